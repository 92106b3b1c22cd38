"""The MXFP8 quantization oracle (mokgen/reference.py, issue 6) against hand-worked cases: the
scale rule, round-to-nearest-even at normal and subnormal spacing, saturation, zeros and their
sign, underflow, the largest finite inputs, NaN / infinity, block layout along any dimension;
and against PyTorch's own float8_e4m3fn cast where both define the result (|x| <= 448)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mokgen.reference import (  # noqa: E402
    MX_BLOCK,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    mx_dequantize,
    mx_fake_quantize,
    mx_quantize,
)


def _block(*head: float) -> torch.Tensor:
    """One block of 32: the given values, then zeros."""
    return torch.tensor(list(head) + [0.0] * (MX_BLOCK - len(head)), dtype=torch.float64)


def _hexes(codes: torch.Tensor) -> list[int]:
    return [int(c) for c in codes.flatten()]


def test_e4m3_codes_by_hand():
    cases = [  # (value, code S.EEEE.MMM); pairs, not a dict: 0.0 == -0.0 as keys
        (0.0, 0x00), (-0.0, 0x80), (1.0, 0x38), (-1.0, 0xB8), (1.125, 0x39), (448.0, 0x7E), (-448.0, 0xFE),
        (256.0, 0x78), (2.0**-6, 0x08),              # smallest normal
        (2.0**-9, 0x01), (7 * 2.0**-9, 0x07),       # subnormals
        (1.0625, 0x38), (1.1875, 0x3A),              # ties between 1, 1.125, 1.25: to even
        (2.0**-10, 0x00), (3 * 2.0**-10, 0x02),      # subnormal ties: to even (0 and 2 * 2**-9)
        (15 * 2.0**-10, 0x08),                       # 7.5 * 2**-9 ties up into the normals
        (-(2.0**-11), 0x80),                         # underflow keeps the sign
        (460.0, 0x7E), (500.0, 0x7E), (1e30, 0x7E), (float("inf"), 0x7E), (float("-inf"), 0xFE),  # saturation
        (float("nan"), 0x7F),
    ]
    values = torch.tensor([v for v, _ in cases], dtype=torch.float64)
    assert _hexes(e4m3_encode(values)) == [c for _, c in cases]
    back = e4m3_decode(torch.tensor([0x38, 0x7E, 0x01, 0x08, 0x80, 0x7F, 0xFF], dtype=torch.uint8))
    assert back[:4].tolist() == [1.0, 448.0, 2.0**-9, 2.0**-6]
    assert str(back[4].item()) == "-0.0" and torch.isnan(back[5:]).all()


def test_every_e4m3_code_round_trips():
    codes = torch.arange(256, dtype=torch.uint8)
    values = e4m3_decode(codes)
    nan = torch.isnan(values)
    assert _hexes(codes[nan]) == [0x7F, 0xFF]
    assert torch.equal(e4m3_encode(values[~nan]), codes[~nan])
    assert values[~nan].abs().max().item() == 448.0


def test_e4m3_matches_torch_float8_in_range():
    gen = torch.Generator().manual_seed(0)
    for scale in (300.0, 1.0, 2.0**-7):  # normals, the middle, subnormals
        x = (torch.randn(8192, generator=gen) * scale).clamp(-448, 448)  # float32: one rounding only
        assert torch.equal(e4m3_encode(x), x.to(torch.float8_e4m3fn).view(torch.uint8)), scale


def test_e8m0_decode():
    assert e8m0_decode(torch.tensor([0, 127, 135, 254], dtype=torch.uint8)).tolist() == [2.0**-127, 1.0, 256.0,
                                                                                          2.0**127]
    assert torch.isnan(e8m0_decode(torch.tensor([255], dtype=torch.uint8))).all()


def test_block_scale_rule_by_hand():
    # max 448: s = floor(log2 448) - 8 = 0, X = 1: everything exact
    codes, scales = mx_quantize(_block(448.0, 1.0, -3.5))
    assert _hexes(scales) == [127] and _hexes(codes[:3]) == [0x7E, 0x38, 0xC6]
    # max 1: s = -8, X = 2**-8, so 1 -> 256 and 2**-17 -> the smallest subnormal
    codes, scales = mx_quantize(_block(1.0, 2.0**-17, 2.0**-18, 3 * 2.0**-18))
    assert _hexes(scales) == [119] and _hexes(codes[:4]) == [0x78, 0x01, 0x00, 0x02]
    assert mx_dequantize(codes, scales)[:4].tolist() == [1.0, 2.0**-17, 0.0, 2.0**-16]
    # max in [480, 512) * X saturates to 448 * X: the only lossy binade of the maximum
    codes, scales = mx_quantize(_block(500.0, 480.0, 470.0, 300.0))
    assert _hexes(scales) == [127]
    assert mx_dequantize(codes, scales)[:4].tolist() == [448.0, 448.0, 448.0, 288.0]


def test_zeros_underflow_and_extremes():
    # all zeros: the smallest scale (code 0 = 2**-127), zeros keep their sign
    codes, scales = mx_quantize(_block(-0.0))
    assert _hexes(scales) == [0] and _hexes(codes[:2]) == [0x80, 0x00]
    # tiny blocks: s clamps at -127, values under 2**-137 underflow to zero
    codes, scales = mx_quantize(_block(2.0**-130, 2.0**-140))
    assert _hexes(scales) == [0] and mx_dequantize(codes, scales)[:2].tolist() == [2.0**-130, 0.0]
    # the largest finite bf16 / fp32 values: s = 127 - 8, the maximum saturates
    for big in (torch.finfo(torch.bfloat16).max, torch.finfo(torch.float32).max):
        codes, scales = mx_quantize(_block(big, 2.0**120))
        assert _hexes(scales) == [127 + 127 - 8]
        assert mx_dequantize(codes, scales)[:2].tolist() == [448.0 * 2.0**119, 2.0**120]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_blocks_become_nan(bad):
    x = torch.cat([_block(bad, 1.0), _block(2.0, 3.0)])
    codes, scales = mx_quantize(x)
    assert _hexes(scales) == [0xFF, 127 - 7]  # the second block is untouched
    out = mx_dequantize(codes, scales)
    assert torch.isnan(out[:MX_BLOCK]).all() and out[MX_BLOCK:MX_BLOCK + 2].tolist() == [2.0, 3.0]


def test_scale_exponent_is_exact_below_a_power_of_two():
    # log2 of the float64 just below 8 rounds to 3.0; the scale must still use exponent 2
    below = torch.nextafter(torch.tensor(8.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)).item()
    _, scales = mx_quantize(_block(below))
    assert _hexes(scales) == [127 + 2 - 8]
    assert _hexes(e4m3_encode(torch.tensor([below], dtype=torch.float64))) == [0x50]  # rounds up to 8.0


def test_empty_inputs():
    for shape in ((0, 32), (0, 64), (4, 0)):
        codes, scales = mx_quantize(torch.zeros(shape))
        assert codes.shape == shape and scales.shape == (shape[0], shape[1] // MX_BLOCK)
        assert mx_dequantize(codes, scales).shape == shape


def test_blocks_along_any_dimension_and_errors():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, 5, generator=gen, dtype=torch.float64)
    codes, scales = mx_quantize(x, dim=1)
    assert codes.shape == (3, 64, 5) and scales.shape == (3, 2, 5)
    # the same as quantizing the transposed tensor along its last dimension
    codes_t, scales_t = mx_quantize(x.transpose(1, 2).contiguous(), dim=-1)
    assert torch.equal(codes_t.transpose(1, 2), codes) and torch.equal(scales_t.transpose(1, 2), scales)
    back = mx_dequantize(codes, scales, dim=1)
    rel = ((back - x).norm() / x.norm()).item()
    assert 1e-3 < rel < 3e-2  # three mantissa bits: about 2**-5 relative per element at worst
    with pytest.raises(ValueError, match="MX blocks are 32 elements along dim -1, which has 48"):
        mx_quantize(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="do not fit codes"):
        mx_dequantize(codes, scales[:, :1], dim=1)


def test_fake_quantize_keeps_dtype_and_is_idempotent():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 128, generator=gen).to(torch.bfloat16)
    once = mx_fake_quantize(x)
    assert once.dtype == torch.bfloat16 and once.shape == x.shape
    assert torch.equal(mx_fake_quantize(once), once)  # representable values stay put
    assert not torch.equal(once, x)


def test_mx_experts_forward_error_against_float64():
    """The MXFP8 oracle of the expert layer against the float64 one, on Gaussian data: every
    quantized operand (x, the weights, h) adds about 3% (three mantissa bits), so the output is
    off by about 7-8%. Recorded in docs/architecture.md (MXFP8): issue 6's 3e-2 bound for the
    forward cannot hold against float64 for any exact MXFP8 computation on such data."""
    from mokgen.reference import experts_forward, mx_experts_forward

    gen = torch.Generator().manual_seed(3)
    T, H, I, E, k = 256, 512, 256, 8, 2
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen, dtype=torch.float64)
    wg, wu = (torch.randn(E, I, H, generator=gen, dtype=torch.float64) * H**-0.5 for _ in range(2))
    wd = torch.randn(E, H, I, generator=gen, dtype=torch.float64) * I**-0.5
    ref = experts_forward(x, ids, w, wg, wu, wd, acc_dtype=torch.float64)
    out = mx_experts_forward(x, ids, w, wg, wu, wd, acc_dtype=torch.float64)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0.05 < rel < 0.11, rel
    assert torch.equal(mx_experts_forward(x, ids, w, wg, wu, wd, acc_dtype=torch.float64), out)  # deterministic
    # operands that are already MXFP8 values lose nothing more on the way in (h still rounds)
    fq = mx_fake_quantize
    again = mx_experts_forward(fq(x), ids, w, fq(wg), fq(wu), fq(wd), acc_dtype=torch.float64)
    assert torch.equal(again, out)
    with pytest.raises(ValueError, match="MX blocks are 32 elements"):
        mx_experts_forward(x[:, :48], ids, w, wg[:, :, :48], wu[:, :, :48], wd[:, :48], acc_dtype=torch.float64)


def test_mx_matmul_quantizes_each_gemm_along_its_own_reduction():
    """The MXFP8 GEMM's backward: dgrad quantizes dY and W along N, wgrad dY and A along the rows
    (padded to 32 with zeros: 40 rows here), both different from the forward's K orientation."""
    from mokgen.reference import _MXMatmul

    gen = torch.Generator().manual_seed(4)
    a = torch.randn(40, 64, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(96, 64, generator=gen, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(40, 96, generator=gen, dtype=torch.float64)
    fq = mx_fake_quantize
    y = _MXMatmul.apply(a, w)
    assert torch.equal(y, fq(a) @ fq(w).T)
    y.backward(gy)
    assert torch.equal(a.grad, fq(gy, dim=-1) @ fq(w, dim=0))
    pad = lambda t: torch.cat([t, t.new_zeros(24, t.shape[1])])  # noqa: E731
    assert torch.equal(w.grad, fq(pad(gy), dim=0)[:40].T @ fq(pad(a.detach()), dim=0)[:40])
    assert not torch.equal(w.grad, fq(gy, dim=-1).T @ fq(a.detach(), dim=-1))  # the orientation matters


def test_mx_experts_backward_against_float64():
    """Gradients of the MXFP8 oracle against float64 autograd: each within the band a few
    quantized operands give (Gaussian data), deterministic; an expert with no rows included."""
    from mokgen.reference import experts_forward, mx_experts_forward

    gen = torch.Generator().manual_seed(5)
    T, H, I, E, k = 200, 256, 128, 6, 2
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(T)])  # expert E-1: no rows
    w = torch.rand(T, k, generator=gen, dtype=torch.float64)
    wg, wu = (torch.randn(E, I, H, generator=gen, dtype=torch.float64) * H**-0.5 for _ in range(2))
    wd = torch.randn(E, H, I, generator=gen, dtype=torch.float64) * I**-0.5
    g_out = torch.randn(T, H, generator=gen, dtype=torch.float64)

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
        fn(leaves[0], ids, *leaves[1:], acc_dtype=torch.float64).backward(g_out)
        return [t.grad for t in leaves]

    ref, mx1, mx2 = grads(experts_forward), grads(mx_experts_forward), grads(mx_experts_forward)
    for name, r, m, m2 in zip(("x", "weights", "w_gate", "w_up", "w_down"), ref, mx1, mx2):
        assert torch.equal(m, m2), name
        rel = ((m - r).norm() / r.norm()).item()
        assert 0.01 < rel < 0.2, (name, rel)
    assert mx1[2][E - 1].abs().max() == 0  # no rows, no gradient
