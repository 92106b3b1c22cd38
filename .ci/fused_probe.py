"""Where the fused backward's time goes (runs on an H200, not in CI): the experts' backward GEMM
chain of one workload (the save policy, uniform routing) timed interleaved by CUDA events
(median of `--iters` rounds, each round one launch of every form in turn):
  separate        the five launches the fused one replaces (dh in bf16, SwiGLU's backward from
                  the saved g and u, dx in bf16 pair rows, dW_down, the joint dW_gate / dW_up;
                  dOut's rows from the gathered copy, as the fused kernel reads them)
  fused c=C l=L   bwd_gemm.fused_backward's launch with groups of C rows and lag L
  no-swiglu       a variant build whose background warps skip the SwiGLU rows (-DMOKGEN_FUSED_NO_SWIGLU)
  no-deps         a variant whose tiles wait for nothing (-DMOKGEN_FUSED_NO_DEPS)
The variants are measurements, not correct kernels. If no-swiglu runs as separate-minus-the-pass,
the background warps are the bottleneck; if no-deps is fast, the waits are.
Usage: python3 .ci/fused_probe.py [qwen35-layer|kimi-local] [--iters 15] [--no-variants]"""

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from mokgen import bwd_gemm

ap = argparse.ArgumentParser()
ap.add_argument("workload", nargs="?", default="qwen35-layer")
ap.add_argument("--iters", type=int, default=15)
ap.add_argument("--no-variants", action="store_true")
args = ap.parse_args()
T, K, E, H, I = {"qwen35-layer": (16384, 8, 256, 2048, 512), "kimi-local": (16384, 1, 48, 7168, 2048)}[args.workload]
gen = torch.Generator(device="cuda").manual_seed(0)
bf = torch.bfloat16
if K > 1:
    ids = torch.stack([torch.randperm(E, generator=gen, device="cuda")[:K] for _ in range(T)]).to(torch.int32)
else:
    ids = torch.randint(0, E, (T, 1), generator=gen, device="cuda", dtype=torch.int32)
order, tok, offs, wt = bwd_gemm.expert_major(ids.contiguous(), E, torch.rand(T, K, device="cuda"))
rows = T * K


def rn(*shape, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(bf)


x, dout = rn(T, H), rn(T, H)
wg, wu, wd = rn(E, I, H, scale=H**-0.5), rn(E, I, H, scale=H**-0.5), rn(E, H, I, scale=I**-0.5)
gu = rn(rows, 2 * I, scale=2.0)
go = dout.index_select(0, tok).contiguous()
xr = x.index_select(0, tok).contiguous()
main = bwd_gemm.load_library()


def separate():
    dh = bwd_gemm.rows_gemm([(go, wd)], offs, b_major="mn", out_dtype=bf)
    hw, dg, du, _ = bwd_gemm.swiglu_grads_saved(gu, order, dh, wt, offs, None)
    dx = torch.empty(rows, H, dtype=bf, device="cuda")
    bwd_gemm.rows_gemm([(dg, wg), (du, wu)], offs, b_major="mn", out=dx, out_rows=order)
    bwd_gemm.weight_grads(go, hw, offs)
    bwd_gemm.weight_grads_joint(dg, du, xr, offs)


bufs = dict(dx=torch.empty(rows, H, dtype=bf, device="cuda"), g0=torch.empty(E, I, H, dtype=bf, device="cuda"),
            g1=torch.empty(E, I, H, dtype=bf, device="cuda"), g2=torch.empty(E, H, I, dtype=bf, device="cuda"),
            hw=torch.empty(rows, I, dtype=bf, device="cuda"), dg=torch.empty(rows, I, dtype=bf, device="cuda"),
            du=torch.empty(rows, I, dtype=bf, device="cuda"), dh=torch.empty(rows, I, dtype=bf, device="cuda"),
            dw=torch.zeros(rows, device="cuda"),
            cnt=torch.empty(main.fused_counters(rows, E), dtype=torch.int32, device="cuda"))


def fused(lib, chunk, lag):
    b = bufs
    stream = torch.cuda.current_stream().cuda_stream
    lib.fused(b["dx"].data_ptr(), b["g0"].data_ptr(), b["g1"].data_ptr(), b["g2"].data_ptr(), b["hw"].data_ptr(),
              b["dg"].data_ptr(), b["du"].data_ptr(), b["dw"].data_ptr(), b["dh"].data_ptr(), b["cnt"].data_ptr(),
              go.data_ptr(), xr.data_ptr(), wg.data_ptr(), wu.data_ptr(), wd.data_ptr(), gu.data_ptr(),
              order.data_ptr(), wt.data_ptr(), offs.data_ptr(), E, rows, H, I, chunk, lag, 0, 0.0, stream)


forms = {"separate": separate}
for chunk, lag in ((16384, 1), (1 << 30, 1), (4096, 1), (4096, 2), (8192, 3), (32768, 1)):
    forms[f"fused c={chunk} l={lag}"] = (lambda c, l: lambda: fused(main, c, l))(chunk, lag)
if not args.no_variants:
    from concurrent.futures import ThreadPoolExecutor

    variants = (("-DMOKGEN_FUSED_NO_SWIGLU", "no-swiglu"), ("-DMOKGEN_FUSED_NO_DEPS", "no-deps"),
                ("-DMOKGEN_FUSED_NO_SWIGLU,-DMOKGEN_FUSED_NO_DEPS", "no-swiglu no-deps"))
    with ThreadPoolExecutor(len(variants)) as pool:  # nvcc runs concurrently
        paths = list(pool.map(lambda v: bwd_gemm.build_variant(v[0].split(","), Path(tempfile.mkdtemp()) / "variant"),
                              variants))
    for (flag, name), path in zip(variants, paths):
        forms[f"{name} c=16384 l=1"] = (lambda lb: lambda: fused(lb, 16384, 1))(bwd_gemm._Lib(path))
times = {k: [] for k in forms}
for name, fn in forms.items():  # warm-up
    fn()
torch.cuda.synchronize()
for _ in range(args.iters):
    for name, fn in forms.items():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times[name].append(a.elapsed_time(b))
flops = 2 * rows * 6 * H * I  # dh (H I), dx (2 I H), dWd (H I), dWg + dWu (2 I H)
print(f"{args.workload}: T={T} K={K} E={E} H={H} I={I}, medians of {args.iters} interleaved rounds")
for name, ts in times.items():
    med = statistics.median(ts)
    print(f"  {name:28s} {med:7.3f} ms  {flops / med / 1e9:6.0f} TFLOP/s  (min {min(ts):.3f})")
