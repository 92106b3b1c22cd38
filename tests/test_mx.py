"""mokgen.mx, the MXFP8 quantizer at scale: bit for bit the float64 oracle
(mokgen.reference.mx_quantize) for bf16, fp16 and fp32 inputs, edge blocks included, along any
dimension; the expert-weight helper; and, on a GPU, the same bits on CUDA as on the CPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mokgen import mx  # noqa: E402
from mokgen import reference as R  # noqa: E402


def _wide(shape, dtype, seed):
    """Random values over a wide range of magnitudes (per-row exponents), with edge blocks: all
    zeros, signed zeros, a NaN, an infinity, values below the smallest scale, the largest finite
    value of the dtype."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-40, 40, (shape[0], 1), generator=gen).float())
    x = x.to(dtype)
    x[0, :32] = 0
    x[1, :32] = -0.0
    x[2, 5] = float("nan")
    x[3, 40] = float("-inf")
    if torch.finfo(dtype).tiny < 2.0**-120:  # bf16 / fp32 reach below the smallest MX scale
        x[4, :32] = 2.0**-125
    x[5, 3] = torch.finfo(dtype).max
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim", [-1, 0])
def test_same_bits_as_the_oracle(dtype, dim):
    x = _wide((64, 128), dtype, seed=1)
    codes, scales = mx.quantize(x, dim=dim)
    ref_codes, ref_scales = R.mx_quantize(x, dim=dim)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
    assert torch.equal(codes.view(torch.uint8), ref_codes)
    assert torch.equal(scales, ref_scales)
    back, ref_back = mx.dequantize(codes, scales, dim=dim), R.mx_dequantize(ref_codes, ref_scales, dim=dim)
    assert torch.equal(back.double().nan_to_num(nan=7.0), ref_back.nan_to_num(nan=7.0))


def test_expert_weights_along_k():
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(3, 16, 96, generator=gen) * 0.02).to(torch.bfloat16)  # [E, N, K]
    codes, scales = mx.quantize_experts(w)
    assert codes.shape == (3, 16, 96) and scales.shape == (3, 16, 3)
    ref_codes, ref_scales = R.mx_quantize(w, dim=-1)
    assert torch.equal(codes.view(torch.uint8), ref_codes) and torch.equal(scales, ref_scales)
    with pytest.raises(ValueError, match=r"expert weights are \[E, N, K\]"):
        mx.quantize_experts(w[0])
    with pytest.raises(ValueError, match="MX blocks are 32 elements along dim -1, which has 40"):
        mx.quantize_experts(w[..., :40])
    with pytest.raises(ValueError, match="do not fit codes"):
        mx.dequantize(codes, scales[..., :2])


@pytest.mark.gpu
def test_cuda_gives_the_cpu_bits():
    x = _wide((256, 512), torch.bfloat16, seed=3)
    codes, scales = mx.quantize(x.cuda())
    ref_codes, ref_scales = mx.quantize(x)
    assert torch.equal(codes.cpu().view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scales.cpu(), ref_scales)
