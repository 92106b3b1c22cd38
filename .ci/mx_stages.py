"""Where the staged MXFP8 experts' time goes (runs on an H200, not in CI; docs/perf-notes.md v0.34):
each stage of mokgen.mx_experts.experts_forward timed alone with CUDA events (median of 10) on
the bench's local workload of each named spec. Usage: python3 .ci/mx_stages.py SPEC [SPEC ...]"""
import statistics
import sys

import torch

from mokgen import bench, load_spec, mx_experts, mx_gemm


def timed(fn, n=10):
    """Median ms of n CUDA-event timed calls after one warm-up (mokgen.bench.time_cuda)."""
    return statistics.median(bench.time_cuda(lambda i: fn(), n_inputs=1, warmup=1, iters=n))


for name in sys.argv[1:] or ["kimi-k2.5"]:
    spec, tokens = bench.local_spec(load_spec(name), bench.LOCAL_EP.get(name, 8))
    wg, wu, wd = bench._weights(spec)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = bench._routing(spec, tokens, gen)
    mxw = mx_experts.quantize_weights(wg, wu, wd)
    T, k = ids.shape
    flat = ids.reshape(-1).long()
    row, src, tiles, padded = mx_experts._segments(flat, spec.num_experts, k)
    rows = src.numel()
    xq, xs = mx_gemm.quantize_rows(x, src, rows)
    gu = mx_gemm.mx_grouped_gemm(xq, xs, mxw.gate_up, mxw.gate_up_scales, tiles)
    hq, hs = mx_gemm.swiglu_quantize(gu, spec.activation.clamp_limit)
    y = mx_gemm.mx_grouped_gemm(hq, hs, mxw.down, mxw.down_scales, tiles)
    H, I = spec.hidden_size, spec.moe_intermediate_size
    clamp = spec.activation.clamp_limit
    stages = {
        "whole forward (bf16 math)": lambda: mx_experts.experts_forward(x, ids, w, mxw, clamp, check_ids=False),
        "whole forward (FP8 quad)": lambda: mx_experts.experts_forward(x, ids, w, mxw, clamp, form="quad",
                                                                       check_ids=False),
        "weights quantized (3 tensors)": lambda: mx_experts.quantize_weights(wg, wu, wd, codes=False),
        "segments + tile list (device)": lambda: mx_experts._segments(flat, spec.num_experts, k, check_ids=False),
        "segments after a stable sort": lambda: mx_gemm.segments(flat, k, spec.num_experts,
                                                                  torch.sort(flat, stable=True).indices),
        "  the stable sort alone": lambda: torch.sort(flat, stable=True),
        "the ids' range check (host sync)": lambda: bool(((flat < 0) | (flat >= spec.num_experts)).any()),
        "quantize_rows": lambda: mx_gemm.quantize_rows(x, src, rows),
        "grouped GEMM gate|up (FP8 quad)": lambda: mx_gemm.mx_grouped_gemm(xq, xs, mxw.gate_up, mxw.gate_up_scales,
                                                                          tiles),
        "grouped GEMM gate|up (bf16 math)": lambda: mx_gemm.mx_bf16_math_grouped_gemm(xq, xs, mxw.gate_up_bf16, tiles),
        "swiglu_quantize": lambda: mx_gemm.swiglu_quantize(gu, clamp),
        "gate|up + SwiGLU + quantize (fused)": lambda: mx_gemm.mx_bf16_math_swiglu_gemm(xq, xs, mxw.gate_up_bf16, tiles,
                                                                                       clamp),
        "grouped GEMM down (FP8 quad)": lambda: mx_gemm.mx_grouped_gemm(hq, hs, mxw.down, mxw.down_scales, tiles),
        "grouped GEMM down (bf16 math)": lambda: mx_gemm.mx_bf16_math_grouped_gemm(hq, hs, mxw.down_bf16, tiles),
        "combine": lambda: mx_gemm.combine(y, row, w.contiguous()),
    }
    if k == 1:  # the fused combine writes each token's row from its one pair (src: the token)
        stages["down + combine (fused, k = 1)"] = lambda: mx_gemm.mx_bf16_math_combine1_gemm(
            hq, hs, mxw.down_bf16, tiles, src, w.reshape(-1).float().contiguous())
    flops = {name: 2 * rows * 2 * I * H for name in stages if "gate|up" in name}  # padded rows
    flops.update({name: 2 * rows * H * I for name in stages if "GEMM down" in name or name.startswith("down +")})
    print(f"{spec.name}: {T} x {k} rows, {int(padded.sum())} padded ({rows} allocated), H {H}, I {I}")
    for stage, fn in stages.items():
        ms = timed(fn)
        extra = f"  {flops[stage] / ms / 1e9:5.0f} TFLOP/s (padded rows)" if stage in flops else ""
        print(f"  {stage:36s} {ms:7.3f} ms{extra}", flush=True)
