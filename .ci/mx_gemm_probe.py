"""The MXFP8 GEMM (templates/mx_gemm.cu) timed on the H200 (not in CI): C = A B^T at a
kimi-k2.5-like shape, each form of the kernel against bf16 matmul and per-tensor FP8
torch._scaled_mm (the FP8 tensor core's rate without block scales) in one run, median of 20
CUDA-event timings each, interleaved over --rounds rounds; then the kernel's relative error
against the exact MX product. --probe N (repeatable) adds a timing-only build of the kernel with
-DMOKGEN_MX_PROBE=N (form decoded; templates/mx_gemm.cu says what each leaves out; wrong results).
Usage: python3 .ci/mx_gemm_probe.py [M N K] [--rounds R] [--probe N ...]"""

import argparse
import ctypes
import statistics
import tempfile

import torch

from mokgen import bench, build, mx, mx_gemm

ap = argparse.ArgumentParser()
ap.add_argument("shape", nargs="*", type=int, default=[8192, 4096, 7168])
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--probe", type=int, action="append", default=[])
args = ap.parse_args()
M, N, K = args.shape
gen = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
w = (torch.randn(N, K, generator=gen, device="cuda") * K ** -0.5).to(torch.bfloat16)
a, sa = mx.quantize(x, dim=-1)
b, sb = mx.quantize(w, dim=-1)
flops = 2 * M * N * K
one = torch.ones((), device="cuda")
a8, b8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
cases = {f"mx_gemm form={f}": (lambda i, f=f: mx_gemm.mx_gemm(a, sa, b, sb, form=f)) for f in sorted(mx_gemm.FORMS)}
for n in args.probe:
    path = build.build_variant(mx_gemm.SOURCE, mx_gemm.LIBRARY, tempfile.mkdtemp(prefix="mx-probe-"),
                               [f"-DMOKGEN_MX_PROBE={n}"], cutlass=True, arch=mx_gemm.ARCH)
    if build.serialized_wgmma(path.parent):
        print(f"WARNING: probe {n}'s wgmma are serialized")
    lib = ctypes.CDLL(str(path))
    vp, ci = ctypes.c_void_p, ctypes.c_int
    lib.mokgen_mx_gemm_form.argtypes, lib.mokgen_mx_gemm_form.restype = [ci, vp, vp, vp, vp, vp, ci, ci, ci, vp], ci
    out = torch.empty(M, N, device="cuda")
    bsa, bsb = mx_gemm.block_scales(sa), mx_gemm.block_scales(sb)

    def call(i, lib=lib, out=out, bsa=bsa, bsb=bsb):
        code = lib.mokgen_mx_gemm_form(mx_gemm.FORMS["decoded"], out.data_ptr(), a.data_ptr(), bsa.data_ptr(),
                                       b.data_ptr(), bsb.data_ptr(), M, N, K, torch.cuda.current_stream().cuda_stream)
        assert code == 0, code
    cases[f"probe {n} (timing only)"] = call
if N % mx_gemm.BF16_MATH_N == 0:  # the bf16-math form (A decoded in registers, the BF16 tensor core)
    b16 = mx_gemm.bf16_math_weights(b, sb)
    cases["mx_bf16_math_gemm"] = lambda i: mx_gemm.mx_bf16_math_gemm(a, sa, b16)
cases["torch.matmul bf16"] = lambda i: x @ w.t()
try:
    torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    cases["torch._scaled_mm fp8 per-tensor"] = lambda i: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                                            out_dtype=torch.bfloat16)
except Exception as err:  # noqa: BLE001 - report and go on without that peer
    print(f"torch._scaled_mm unavailable: {err}")
print(f"M N K = {M} {N} {K}; {args.rounds} rounds")
times = {name: [] for name in cases}
for _ in range(args.rounds):
    for name, fn in cases.items():
        times[name].append(statistics.median(bench.time_cuda(fn, n_inputs=1, iters=20)))
for name, ts in times.items():
    ms = statistics.median(ts)
    print(f"{name:34s} {ms:8.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  (rounds: {' '.join(f'{t:.3f}' for t in ts)})",
          flush=True)
want = mx.dequantize(a, sa, dim=-1).double() @ mx.dequantize(b, sb, dim=-1).double().t()
for f in sorted(mx_gemm.FORMS):
    got = mx_gemm.mx_gemm(a, sa, b, sb, form=f).double()
    print(f"form={f}: relative error against the exact MX product: {((got - want).norm() / want.norm()).item():.2e}")
if "mx_bf16_math_gemm" in cases:
    got = mx_gemm.mx_bf16_math_gemm(a, sa, b16).double()
    print(f"bf16-math form: relative error against the exact MX product: "
          f"{((got - want).norm() / want.norm()).item():.2e}")
