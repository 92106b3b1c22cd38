"""The weight gradients' A operand, quantize_cols then block_scales (v0.40, A) against
quantize_cols_blocked (v0.41, B; the column quantizer's tiles with codes only), on the bench's
local workload of each named spec (runs on an H200, not in CI; docs/perf-notes.md v0.41): the
three operands of a step alone (dy [R, H], dg and du [R, I], float32), then the staged MXFP8
training step with mx_gemm.quantize_cols_blocked swapped for A's two calls. The bits of both
first, then ABBA blocks of 5 timed calls (median per block), the mean of B / A with its min and
max. Usage: python3 .ci/mx_cols_blocked_ab.py [SPEC ...] (default kimi-k2.5)."""
import sys

import torch
from mx_ab import abba, staged_step

from mokgen import bench, mx_gemm

BLOCKS = 8
NEW = mx_gemm.quantize_cols_blocked


def old(x):
    codes, scales = mx_gemm.quantize_cols(x)
    return codes, mx_gemm.block_scales(scales)


def use(side):
    mx_gemm.quantize_cols_blocked = old if side == "A" else NEW


def report(fn, label):
    r = abba(fn, use, "A", "B", BLOCKS)
    use("B")
    print(f"{label}: A {r[0]:.3f} ms, B {r[1]:.3f} ms, B / A {r[2]:.4f} [{r[3]:.4f}, {r[4]:.4f}] over {BLOCKS} blocks",
          flush=True)


def ab(name: str) -> None:
    spec, gen, counts, _, _ = bench.local_expert_rows(name, bench.LOCAL_EP.get(name, 8))
    R = int(((counts + 127) // 128 * 128).sum())
    H, I = spec.hidden_size, spec.moe_intermediate_size
    ops = [torch.randn(R, n, generator=gen, device="cuda") for n in (H, I, I)]

    def three():
        return [mx_gemm.quantize_cols_blocked(t) for t in ops]

    got = {}
    for side, fn in (("A", old), ("B", NEW)):
        got[side] = [u.view(torch.uint8) for t in ops for u in fn(t)]
    same = all(torch.equal(a, b) for a, b in zip(got["A"], got["B"]))
    print(f"{spec.name}: the three operands ({R} rows), A and B the same bits: {same}", flush=True)
    del got
    report(three, f"{spec.name} dy, dg, du quantized by columns")
    ops.clear()  # their memory back before the step

    spec, step, _ = staged_step(name)
    grads = {}
    for side in ("A", "B"):
        use(side)
        grads[side] = [g.clone() for g in step()]
    same = all(torch.equal(a, b) for a, b in zip(grads["A"], grads["B"]))
    print(f"{spec.name}: the step's gradients, A and B the same bits: {same}", flush=True)
    del grads
    report(step, f"{spec.name} staged MXFP8 fwd+bwd")


for spec_name in sys.argv[1:] or ["kimi-k2.5"]:
    ab(spec_name)
    torch.cuda.empty_cache()
