"""The MXFP8 GEMM's first form (templates/mx_gemm.cu) timed against bf16 matmul on the H200 (not in
CI): C = A B^T at a kimi-k2.5-like shape, median of 20 CUDA-event timings each, and the kernel's
relative error against the exact MX product. Usage: python3 .ci/mx_gemm_probe.py [M N K]"""

import statistics
import sys

import torch

from mokgen import bench, mx, mx_gemm

M, N, K = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 4096, 7168)
gen = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
w = (torch.randn(N, K, generator=gen, device="cuda") * K ** -0.5).to(torch.bfloat16)
a, sa = mx.quantize(x, dim=-1)
b, sb = mx.quantize(w, dim=-1)
flops = 2 * M * N * K
for name, fn in (("mx_gemm (MXFP8, first form)", lambda i: mx_gemm.mx_gemm(a, sa, b, sb)),
                 ("torch.matmul bf16", lambda i: x @ w.t())):
    ms = statistics.median(bench.time_cuda(fn, n_inputs=1, iters=20))
    print(f"{name:30s} {ms:8.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
got = mx_gemm.mx_gemm(a, sa, b, sb).double()
want = mx.dequantize(a, sa, dim=-1).double() @ mx.dequantize(b, sb, dim=-1).double().t()
print(f"relative error against the exact MX product: {((got - want).norm() / want.norm()).item():.2e}")
