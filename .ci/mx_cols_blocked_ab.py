"""The weight gradients' A operand, quantize_cols then block_scales (v0.40, A) against
quantize_cols_blocked (v0.41, B; the column quantizer's tiles with codes only), on the bench's
local workload of each named spec (runs on an H200, not in CI; docs/perf-notes.md v0.41): the
three operands of a step alone (dy [R, H], dg and du [R, I], float32), then the staged MXFP8
training step with mx_gemm.quantize_cols_blocked swapped for A's two calls. The bits of both
first, then ABBA blocks of 5 timed calls (median per block), the mean of B / A with its min and
max. Usage: python3 .ci/mx_cols_blocked_ab.py [SPEC ...] (default kimi-k2.5)."""
import statistics
import sys

import torch

from mokgen import bench, load_spec, mx_experts, mx_gemm

BLOCKS = 8
NEW = mx_gemm.quantize_cols_blocked


def old(x):
    codes, scales = mx_gemm.quantize_cols(x)
    return codes, mx_gemm.block_scales(scales)


def timed(fn, n=5):
    return statistics.median(bench.time_cuda(lambda i: fn(), n_inputs=1, warmup=1, iters=n))


def abba(fn, label):
    ms = {"A": [], "B": []}
    for blk in range(BLOCKS):
        for side in (("A", "B") if blk % 2 == 0 else ("B", "A")):
            mx_gemm.quantize_cols_blocked = old if side == "A" else NEW
            ms[side].append(timed(fn))
    mx_gemm.quantize_cols_blocked = NEW
    ratios = [b / a for a, b in zip(ms["A"], ms["B"])]
    print(f"{label}: A {statistics.median(ms['A']):.3f} ms, B {statistics.median(ms['B']):.3f} ms, B / A "
          f"{statistics.mean(ratios):.4f} [{min(ratios):.4f}, {max(ratios):.4f}] over {BLOCKS} blocks", flush=True)


def ab(name: str) -> None:
    spec, tokens = bench.local_spec(load_spec(name), bench.LOCAL_EP.get(name, 8))
    _, gen, counts, _, _ = bench.local_expert_rows(name, bench.LOCAL_EP.get(name, 8))
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
    abba(three, f"{spec.name} dy, dg, du quantized by columns")
    ops.clear()  # their memory back before the step

    layer, (wg, wu, wd), inputs = bench.backward_problem(spec, tokens, 1)
    del layer
    x, ids, w, d_out = inputs[0]
    leaves = [x, w, wg, wu, wd]

    def step():
        for t in leaves:
            t.grad = None
        mx_experts.experts_forward_train(leaves[0], ids, *leaves[1:], spec.activation.clamp_limit).backward(d_out)

    grads = {}
    for side, fn in (("A", old), ("B", NEW)):
        mx_gemm.quantize_cols_blocked = fn
        step()
        grads[side] = [t.grad.clone() for t in leaves]
    mx_gemm.quantize_cols_blocked = NEW
    same = all(torch.equal(a, b) for a, b in zip(grads["A"], grads["B"]))
    print(f"{spec.name}: the step's gradients, A and B the same bits: {same}", flush=True)
    del grads
    abba(step, f"{spec.name} staged MXFP8 fwd+bwd")


for spec_name in sys.argv[1:] or ["kimi-k2.5"]:
    ab(spec_name)
    torch.cuda.empty_cache()
