"""The MX format's own error, with no kernel involved (runs on the CPU): Gaussian operands quantized
by the oracle (mokgen.mx.quantize, then dequantize in float64) against their unquantized values,
and the product of two such operands against the exact product, relative Frobenius errors.
docs/perf-notes.md v0.36 (issue 6's accuracy bound). Usage: python3 .ci/mx_format_error.py"""
import torch

from mokgen import mx


def q(t: torch.Tensor) -> torch.Tensor:
    codes, scales = mx.quantize(t.to(torch.bfloat16), dim=-1)
    return mx.dequantize(codes, scales, dim=-1, out_dtype=torch.float64)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


gen = torch.Generator().manual_seed(0)
T, H, N = 256, 1024, 512
x = torch.randn(T, H, generator=gen)
w = torch.randn(N, H, generator=gen) / H**0.5
print(f"x [{T}, {H}] ~ N(0, 1): {rel(q(x), x.double()):.4f}")
print(f"W [{N}, {H}] ~ N(0, 1/{H}): {rel(q(w), w.double()):.4f}")
print(f"x W^T, both quantized: {rel(q(x) @ q(w).T, x.double() @ w.double().T):.4f}")
