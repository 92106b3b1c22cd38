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


def _device_blocks() -> torch.Tensor:
    """float32 test blocks for the device quantizer: random magnitudes over the whole float32
    range, bf16-exact rows, and hand-made edges (zeros and signed zeros, float32 subnormals,
    E4M3 ties at every binade, the subnormal/normal boundary, saturation, non-finite values)."""
    gen = torch.Generator().manual_seed(12)
    blocks = []
    exps = torch.randint(-150, 128, (3000, 1), generator=gen).float()
    blocks.append(torch.randn(3000, 32, generator=gen) * torch.exp2(exps))
    blocks.append((torch.randn(500, 32, generator=gen) * 3).bfloat16().float())
    # ties: with amax 448 (scale 1), midpoints between neighbouring E4M3 values, both parities
    codes = torch.arange(0, 0x7E, dtype=torch.uint8)
    vals = R.e4m3_decode(codes)
    mids = ((vals[1:] + vals[:-1]) / 2).float()
    tie = torch.cat([mids, -mids, mids * 1.0000001, mids * 0.9999999])
    tie = torch.cat([tie, torch.zeros(-tie.numel() % 31)]).view(-1, 31)
    blocks.append(torch.cat([torch.full((tie.shape[0], 1), 448.0), tie], 1))
    edges = torch.zeros(8, 32)
    edges[1, ::2] = -0.0
    edges[2, 0] = 1e-45  # the smallest float32 subnormal: scale 2**-127, codes 0
    edges[3, :] = torch.tensor(2.0**-6) * torch.linspace(0.9, 1.1, 32)  # across E4M3's min normal
    edges[4, :] = torch.linspace(400, 470, 32)  # saturation: amax 470 -> scale 1, above 448 -> 448
    edges[5, 3] = float("inf")
    edges[6, 7] = float("nan")
    edges[7, :] = -3.0e38
    blocks.append(edges)
    return torch.cat(blocks).contiguous()


@pytest.mark.nvcc
def test_device_quantizer_matches_the_oracle_bit_for_bit(tmp_path, host_check):
    """templates/include/mokgen/mx.cuh (the quantizer the kernels will use), compiled for the host
    by tests/host/mx_check.cu, gives the oracle's codes and scales on every test block."""
    import subprocess

    exe = host_check("mx_check")
    x = _device_blocks()
    (tmp_path / "in.bin").write_bytes(x.numpy().tobytes())
    run = subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], capture_output=True)
    assert run.returncode == 0, run
    raw = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.uint8)
    codes, scales = raw[: x.numel()].view(x.shape), raw[x.numel():]
    want_codes, want_scales = R.mx_quantize(x, dim=-1)
    assert torch.equal(scales, want_scales.view(-1)), (scales != want_scales.view(-1)).nonzero()[:5]
    bad = (codes != want_codes).nonzero()
    assert bad.numel() == 0, [(x[i, j].item(), codes[i, j].item(), want_codes[i, j].item()) for i, j in bad[:5].tolist()]


@pytest.mark.gpu
def test_the_gpu_quantizers_match_the_oracle_on_the_edge_blocks():
    """The kernels' quantizer on the hardware conversion (mx::quantize_block_hw,
    cvt.rn.satfinite.e4m3x2) on the hand-made edges above (float32 subnormals, signed zeros,
    ties in every binade, saturation, inf and NaN): along rows (mx_gemm.quantize_f32_rows, 128 k
    per row) and transposed (mx_gemm.quantize_cols), bit for bit the oracle's."""
    from mokgen import mx_gemm

    x = _device_blocks()
    x = torch.cat([x, torch.zeros(-x.shape[0] % 4, 32)])  # whole 128-wide rows
    want_codes, want_scales = R.mx_quantize(x, dim=-1)
    rows = x.view(-1, 128)
    codes, scales = mx_gemm.quantize_f32_rows(rows.cuda())
    assert torch.equal(scales.cpu().view(-1, 4), want_scales.view(-1, 4))
    assert torch.equal(codes.cpu().view(torch.uint8).view(-1, 32), want_codes)
    codes, scales = mx_gemm.quantize_cols(x.t().contiguous().cuda())
    assert torch.equal(scales.cpu().view(-1), want_scales.view(-1))
    assert torch.equal(codes.cpu().view(torch.uint8), want_codes)


def test_dequantize_in_float64_is_exact_past_float32s_range():
    """Blocks scaled near 2^127 exceed float32 (inf there); float64 holds them exactly, and for
    ordinary scales the two agree bit for bit."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    codes, scales = mx.quantize(x)
    assert torch.equal(mx.dequantize(codes, scales, out_dtype=torch.float64).float(), mx.dequantize(codes, scales))
    scales.fill_(254)  # 2^127
    big = mx.dequantize(codes, scales, out_dtype=torch.float64)
    want = codes.view(torch.float8_e4m3fn).double() * 2.0**127
    assert torch.equal(big, want) and torch.isfinite(big).all()
    assert torch.isinf(mx.dequantize(codes, scales)).any()
