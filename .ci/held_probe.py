"""Which split weight-gradient launches fail or differ under MOKGEN_BWD_STORE=held (runs on an
H200, not in CI; docs/perf-notes.md v0.32). Each case runs in its own process (a trap ends the
CUDA context): one launch form, an expert count, a tail and a row count per expert, the held
epilogue's output against the store buffers'. Prints one line per case: ok (same bits), DIFF or
FAIL (the child's exit and its last line).

Usage: python3 .ci/held_probe.py [--timeout S]"""

import argparse
import subprocess
import sys

FORMS = ("single", "joint", "a_index", "b_index", "pairs")


def child(form: str, experts: int, tail: str, rows: int, empty: int, M: int, N: int) -> None:
    import torch

    from mokgen import bwd_gemm

    gen = torch.Generator(device="cuda").manual_seed(7)
    counts = [rows] * experts
    if empty:  # every (experts // empty)-th expert without rows
        for e in range(0, experts, max(1, experts // empty)):
            counts[e] = 0
    total = sum(counts) + 7

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    a, a1, b = randn(total, M), randn(total, M), randn(total, N)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    index = torch.randperm(total, generator=gen, device="cuda")

    def run(store):
        if form == "single":
            return (bwd_gemm.weight_grads(a, b, offs, cluster=1, schedule="split", tail=tail, store=store),)
        if form == "pairs":
            return (bwd_gemm.weight_grads(a, b, offs, cluster=2, schedule="split", tail=tail, store=store),)
        if form == "joint":
            return bwd_gemm.weight_grads_joint(a, a1, b, offs, cluster=1, tail=tail, store=store)
        if form == "a_index":
            src = torch.empty_like(a)
            src[index] = a
            return (bwd_gemm.weight_grads(src, b, offs, a_index=index, tail=tail, store=store),)
        src = torch.empty_like(b)
        src[index] = b
        return bwd_gemm.weight_grads_joint(a, a1, src, offs, b_index=index, tail=tail, store=store)

    want = run("buffers")
    torch.cuda.synchronize()
    for _ in range(3):
        got = run("held")
        torch.cuda.synchronize()
        if not all(torch.equal(p, q) for p, q in zip(got, want)):
            print("DIFF")
            return
    print("ok")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=40)
    ap.add_argument("--child", nargs=7)
    args = ap.parse_args()
    if args.child:
        f, e, t, r, z, m, n = args.child
        child(f, int(e), t, int(r), int(z), int(m), int(n))
        return
    cases = []
    for form in FORMS:
        for experts in (48, 128):
            cases.append((form, experts, "tma", 512, 0, 2048, 768))
    cases += [("a_index", 128, "zero", 512, 0, 2048, 768), ("b_index", 128, "zero", 512, 0, 768, 2048),
              ("a_index", 48, "tma", 512, 0, 1024, 1024), ("a_index", 128, "tma", 256, 0, 1024, 1024),
              ("single", 128, "tma", 64, 0, 2048, 768), ("a_index", 128, "tma", 40, 16, 2048, 768)]
    for case in cases:
        cmd = [sys.executable, __file__, "--child", *map(str, case)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            last = (p.stdout.strip().splitlines() or p.stderr.strip().splitlines() or ["(nothing)"])[-1]
            verdict = last if p.returncode == 0 else f"FAIL rc={p.returncode}: {last[:120]}"
        except subprocess.TimeoutExpired:
            verdict = f"FAIL: no answer in {args.timeout:.0f} s"
        print(f"{' '.join(map(str, case)):42s} {verdict}", flush=True)


if __name__ == "__main__":
    main()
