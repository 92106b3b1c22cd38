"""Summarize Nsight Compute's source page (SASS, CSV) of one kernel: the instructions where warps
were sampled most, with their stall samples, so a reader can see which role waits where (map
addresses to the build's `cuobjdump --dump-sass`). Usage: python3 .ci/top_stalls.py SRC.csv [N]."""

import csv
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(path: str, n: int) -> None:
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    # the header is the first row naming a source or address column (ncu may print notes before it)
    head = next((i for i, r in enumerate(rows) if any(c in ("Source", "Address") for c in r)), None)
    if head is None:
        sys.exit(f"{path}: no header with a Source or Address column (first lines: {rows[:3]})")
    cols, body = rows[head], rows[head + 1:]
    print("columns:", " | ".join(cols))
    samp = [i for i, c in enumerate(cols) if "Sampling" in c and "All" in c] or [i for i, c in enumerate(cols) if "Sampling" in c]
    if not samp:
        sys.exit(f"{path}: no stall-sampling column")
    k = samp[0]
    src = cols.index("Source") if "Source" in cols else None
    addr = cols.index("Address") if "Address" in cols else None
    total = sum(number(r[k]) for r in body if len(r) > k)
    print(f"{cols[k]}: {total:.0f} samples over {len(body)} instructions")
    top = sorted((r for r in body if len(r) > k), key=lambda r: -number(r[k]))[:n]
    for r in top:
        where = r[addr] if addr is not None else ""
        text = r[src] if src is not None else ""
        print(f"{100 * number(r[k]) / max(total, 1):6.2f}%  {where:>8}  {text}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 60)
