"""What the backward megakernel's order (templates/include/mokgen/bwd_order.cuh) asks of the
ring, per bench workload and chunk size (CPU only; a model of the order's rules, no kernel):

  R min      bwd_min_ring: 2, or one more than the most chunks an expert's rows span (the order
             frees a slot only after the weight tiles of every expert with rows in it)
  ring MB    R min x chunk rows x the bytes a received row keeps in its slot: x and dy (H each)
             and hw, dg, du (I each), bf16
  k-blocks   the weight tiles' k-blocks per expert, cut at chunk boundaries (bwd_expert_kblocks),
             against the same rows cut from the expert's start only: the extra share

On the bench's routing (uniform, as .ci/tile_waste.py draws it) and on a skewed one (one expert
taking half of the rows), where an expert spans many chunks.

    python3 .ci/bwd_ring.py [--chunks 1024 2048 4096 8192] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tile_waste import workloads  # noqa: E402

KKB = 64


def ring_and_kblocks(counts: list[int], chunk: int) -> tuple[int, float]:
    """(bwd_min_ring, extra share of k-blocks from cutting at chunk boundaries)."""
    span, cut, whole, start = 0, 0, 0, 0
    for c in counts:
        if c:
            first, last = start // chunk, (start + c - 1) // chunk
            span = max(span, last - first + 1)
            whole += math.ceil(c / KKB)
            for k in range(first, last + 1):
                cut += math.ceil((min(start + c, (k + 1) * chunk) - max(start, k * chunk)) / KKB)
        start += c
    return max(2, span + 1), (cut / whole - 1) if whole else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    print(f"{'workload':34} {'routing':8} {'chunk':>6} {'R min':>6} {'ring MB':>8} {'k-blocks':>9}")
    for spec, label, counts, _, _ in workloads(gen):
        n = sum(counts)
        skewed = [n // 2] + [round(c * (n - n // 2) / n) for c in counts[1:]]
        row_bytes = 2 * (2 * spec.hidden_size + 3 * spec.moe_intermediate_size)
        for routing, cs in (("uniform", counts), ("skewed", skewed)):
            for chunk in args.chunks:
                r, extra = ring_and_kblocks(cs, chunk)
                print(f"{label:34} {routing:8} {chunk:6d} {r:6d} {r * chunk * row_bytes / 2**20:8.0f} {extra:9.1%}")
        print()


if __name__ == "__main__":
    main()
