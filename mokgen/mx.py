"""MXFP8 quantization at scale (issue 6): the layout the FP8 kernels will consume, computed on the
tensors' own device in float32, bit for bit the oracle's (``mokgen.reference.mx_quantize``).

Layout: element codes as ``torch.float8_e4m3fn`` with the input's shape (K-major, as the expert
weights are stored: ``w_gate`` / ``w_up`` ``[E, I, H]`` along H, ``w_down`` ``[E, H, I]`` along
I, the dimension each GEMM reduces over), and one E8M0 scale (uint8, 2**(code - 127), 255 = NaN)
per 32 elements along that dimension, shaped like the input with that dimension divided by 32.
The rules are the oracle's (OCP MX v1.0; the comment block in mokgen/reference.py): scale
2**(floor(log2 amax) - 8), elements rounded to nearest even and saturated at 448, a block with
a NaN or an infinity gets the NaN scale and NaN codes.

Exactness: every step is exact in float32 except the one rounding to E4M3, so the result equals
the float64 oracle for bf16, fp16 and fp32 inputs; float64 inputs are rounded to float32 first.
"""

from __future__ import annotations

import torch

from mokgen.reference import E4M3_MAX, E4M3_NAN, E8M0_NAN, MX_BLOCK, mx_block_scales, mx_blocks, mx_unblocks

__all__ = ["quantize", "dequantize", "quantize_experts"]


def quantize(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of ``x`` along ``dim``: ``(codes float8_e4m3fn shaped like x, scales uint8 with dim /
    32)``, on ``x``'s device. Raises ValueError when ``dim``'s size is not a multiple of 32."""
    blocks, d = mx_blocks(x.detach(), dim)
    b = blocks.float()
    amax = b.abs().amax(-1)
    finite = torch.isfinite(b).all(-1)
    exp = torch.frexp(torch.where(amax > 0, amax, torch.ones_like(amax)))[1] - 1  # floor(log2 amax), exact
    s = torch.where(amax > 0, exp - 8, torch.full_like(exp, -127))
    s = torch.where(finite, s, torch.zeros_like(s)).clamp(-127, 127)
    # b * 2**-s is exact: |b| < 2**(s + 9), and 2**-s is a normal float32 for s in [-127, 119]
    scaled = torch.ldexp(b, (-s).unsqueeze(-1).to(b.dtype))
    codes = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(finite.unsqueeze(-1), codes, torch.full_like(codes, E4M3_NAN))
    scales = torch.where(finite, (s + 127).to(torch.int32), torch.full_like(s, E8M0_NAN, dtype=torch.int32))
    return mx_unblocks(codes, d).view(torch.float8_e4m3fn), scales.to(torch.uint8).movedim(-1, d).contiguous()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dim: int = -1,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of ``quantize``'s ``(codes, scales)`` in ``out_dtype``: exact in float64, and in
    float32 up to its largest finite value (a block whose scale is near 2^127 can exceed it)."""
    blocks, d = mx_blocks(codes.view(torch.float8_e4m3fn), dim)
    e = mx_block_scales(scales, dim, blocks, codes.shape).to(torch.int32)
    work = torch.float64 if out_dtype == torch.float64 else torch.float32
    # 2**(code - 127) >= 2**-127 and every E4M3 value times it (>= 2**-136) are float32 values
    factor = torch.ldexp(torch.ones(e.shape, device=e.device, dtype=work), (e - 127).to(work))
    factor = torch.where(e == E8M0_NAN, torch.full_like(factor, float("nan")), factor)
    return mx_unblocks(blocks.to(work) * factor.unsqueeze(-1), d).to(out_dtype)


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights ``[E, N, K]`` (as mokgen stores them: the GEMM reduces over K) ->
    MXFP8 along K, one expert at a time (float32 temporaries of one expert, not of all)."""
    if w.dim() != 3:
        raise ValueError(f"expert weights are [E, N, K], got shape {tuple(w.shape)}")
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty((*w.shape[:2], w.shape[2] // MX_BLOCK), dtype=torch.uint8, device=w.device)
    for e in range(w.shape[0]):
        codes[e], scales[e] = quantize(w[e], dim=-1)
    return codes, scales
