"""Where the staged MXFP8 experts' time goes (runs on an H200, not in CI; docs/perf-notes.md v0.34):
each stage of mokgen.mx_experts.experts_forward timed alone with CUDA events (median of 10) on
the bench's local workload of each named spec. Usage: python3 .ci/mx_stages.py SPEC [SPEC ...]"""
import statistics
import sys

import torch

from mokgen import bench, load_spec, mx_experts, mx_gemm


def timed(fn, n=10):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


for name in sys.argv[1:] or ["kimi-k2.5"]:
    spec, tokens = bench.local_spec(load_spec(name), bench.LOCAL_EP.get(name, 8))
    wg, wu, wd = bench._weights(spec)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = bench._routing(spec, tokens, gen)
    mxw = mx_experts.quantize_weights(wg, wu, wd)
    T, k = ids.shape
    flat = ids.reshape(-1).long()
    row, tiles, padded, rows = mx_experts._segments(flat, spec.num_experts)
    src = torch.full((rows,), -1, dtype=torch.int32, device=x.device)
    src[row] = (torch.arange(T * k, device=x.device) // k).to(torch.int32)
    xq, xs = mx_gemm.quantize_rows(x, src, rows)
    gu = mx_gemm.mx_grouped_gemm(xq, xs, mxw.gate_up, mxw.gate_up_scales, tiles)
    hq, hs = mx_gemm.swiglu_quantize(gu, spec.activation.clamp_limit)
    y = mx_gemm.mx_grouped_gemm(hq, hs, mxw.down, mxw.down_scales, tiles)
    H, I = spec.hidden_size, spec.moe_intermediate_size
    stages = {
        "whole forward": lambda: mx_experts.experts_forward(x, ids, w, mxw, spec.activation.clamp_limit),
        "segments + tile list (device)": lambda: mx_experts._segments(flat, spec.num_experts, check_ids=False),
        "the ids' range check (host sync)": lambda: bool(((flat < 0) | (flat >= spec.num_experts)).any()),
        "quantize_rows": lambda: mx_gemm.quantize_rows(x, src, rows),
        "grouped GEMM gate|up": lambda: mx_gemm.mx_grouped_gemm(xq, xs, mxw.gate_up, mxw.gate_up_scales, tiles),
        "swiglu_quantize": lambda: mx_gemm.swiglu_quantize(gu, spec.activation.clamp_limit),
        "grouped GEMM down": lambda: mx_gemm.mx_grouped_gemm(hq, hs, mxw.down, mxw.down_scales, tiles),
        "combine": lambda: mx_gemm.combine(y, row, w.contiguous()),
    }
    flops = {"grouped GEMM gate|up": 2 * rows * 2 * I * H, "grouped GEMM down": 2 * rows * H * I}
    print(f"{spec.name}: {T} x {k} rows, {int(padded.sum())} padded ({rows} allocated), H {H}, I {I}")
    for stage, fn in stages.items():
        ms = timed(fn)
        extra = f"  {flops[stage] / ms / 1e9:5.0f} TFLOP/s (padded rows)" if stage in flops else ""
        print(f"  {stage:34s} {ms:7.3f} ms{extra}", flush=True)
