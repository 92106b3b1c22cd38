"""The MX GEMM (templates/mx_gemm.cu) launched a few times for a profiler (runs on an H200, not in
CI; docs/perf-notes.md v0.34), at the probe's shape. Usage, e.g.:
  ncu --section SchedulerStats --section WarpStateStats -k regex:mx_gemm_kernel --launch-skip 2 \\
      --launch-count 1 python3 .ci/mx_gemm_ncu.py [decoded|inline]"""
import sys

import torch

from mokgen import mx, mx_gemm

form = sys.argv[1] if len(sys.argv) > 1 else "decoded"
M, N, K = 8192, 4096, 7168
gen = torch.Generator(device="cuda").manual_seed(0)
a, sa = mx.quantize(torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16), dim=-1)
b, sb = mx.quantize((torch.randn(N, K, generator=gen, device="cuda") * K ** -0.5).to(torch.bfloat16), dim=-1)
for _ in range(4):
    mx_gemm.mx_gemm(a, sa, b, sb, form=form)
torch.cuda.synchronize()
print(f"mx_gemm form={form} {M}x{N}x{K}: ok")
