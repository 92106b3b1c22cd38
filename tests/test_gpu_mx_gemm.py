"""The MXFP8 GEMM (mokgen/mx_gemm.py) on the H200, against the float64 product of the operands'
exact MX values (mokgen.mx.dequantize, bit for bit the oracle's)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mokgen import mx, mx_gemm  # noqa: E402

pytestmark = [pytest.mark.gpu]

#: relative Frobenius error allowed against the exact product: the tensor core rounds inside
#: each 32-product step (FP8 wgmma accumulates with fewer bits than float32), then one float32 add
REL_TOL = 1e-3


def _blocks(rows, cols, gen, spread):
    """bf16 rows whose 32-wide blocks have magnitudes 2^[-spread, spread] apart (the scales matter)."""
    x = torch.randn(rows, cols, generator=gen, device="cuda")
    mag = torch.exp2(torch.randint(-spread, spread + 1, (rows, cols // 32), generator=gen, device="cuda").float())
    return (x * mag.repeat_interleave(32, dim=1)).to(torch.bfloat16)


def _exact(a, sa, b, sb):
    return mx.dequantize(a, sa, dim=-1, out_dtype=torch.float64) @ mx.dequantize(b, sb, dim=-1,
                                                                                    out_dtype=torch.float64).t()


@pytest.mark.parametrize("form", sorted(mx_gemm.FORMS))
@pytest.mark.parametrize("M, N, K, spread", [(128, 128, 128, 0), (256, 384, 512, 6), (384, 256, 2048, 20)])
def test_mx_gemm_matches_the_exact_mx_product(M, N, K, spread, form):
    gen = torch.Generator(device="cuda").manual_seed(M + N + K)
    a, sa = mx.quantize(_blocks(M, K, gen, spread), dim=-1)
    b, sb = mx.quantize(_blocks(N, K, gen, spread), dim=-1)
    got = mx_gemm.mx_gemm(a, sa, b, sb, form=form)
    want = _exact(a, sa, b, sb)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    assert torch.isfinite(got).all()
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < REL_TOL, f"relative error {err:.3e}"
    # every element, against its own magnitude scale: a wrong scale (2x off) or a misplaced block fails
    scale = (mx.dequantize(a, sa, dim=-1).double().abs() @ mx.dequantize(b, sb, dim=-1).double().abs().t())
    assert ((got.double() - want).abs() <= 4e-3 * scale + 1e-30).all()
    assert torch.equal(mx_gemm.mx_gemm(a, sa, b, sb, form=form), got)  # the same bits again
    for other in sorted(set(mx_gemm.FORMS) - {form}):  # and from the other forms
        assert torch.equal(mx_gemm.mx_gemm(a, sa, b, sb, form=other), got), other


@pytest.mark.parametrize("form", sorted(mx_gemm.FORMS))
def test_a_nan_scale_makes_its_rows_products_nan(form):
    gen = torch.Generator(device="cuda").manual_seed(3)
    a, sa = mx.quantize(_blocks(128, 256, gen, 2), dim=-1)
    b, sb = mx.quantize(_blocks(128, 256, gen, 2), dim=-1)
    sa[5, 3] = 255  # E8M0 NaN: row 5's block 3
    sb[7, 0] = 255  # column 7's block 0
    got = mx_gemm.mx_gemm(a, sa, b, sb, form=form)
    assert torch.isnan(got[5]).all() and torch.isnan(got[:, 7]).all()
    ok = torch.ones_like(got, dtype=torch.bool)
    ok[5] = False
    ok[:, 7] = False
    assert torch.isfinite(got[ok]).all()


@pytest.mark.parametrize("form", sorted(mx_gemm.FORMS))
def test_far_apart_scales_whose_product_is_moderate(form):
    """A 2^127 row scale against a 2^-126 column scale: the scales multiply first (to 2), so the
    products stay finite; multiplied into the partial sum one at a time they overflowed."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    a, sa = mx.quantize(_blocks(128, 128, gen, 0), dim=-1)
    b, sb = mx.quantize(_blocks(128, 128, gen, 0), dim=-1)
    sa.fill_(254)
    sb.fill_(1)
    got = mx_gemm.mx_gemm(a, sa, b, sb, form=form)
    want = _exact(a, sa, b, sb)
    assert torch.isfinite(got).all()
    assert ((got.double() - want).norm() / want.norm()).item() < REL_TOL


def test_a_variant_build_runs_beside_the_library(tmp_path):
    """A second build of the source (a measuring variant, .ci/mx_gemm_probe.py --probe) loaded in
    the same process after the library has run: it sets its own kernel's shared-memory limit and
    gives the same bits. (With a process-wide "attribute set" flag it failed with
    cudaErrorInvalidValue.)"""
    import ctypes

    from mokgen import build

    gen = torch.Generator(device="cuda").manual_seed(9)
    a, sa = mx.quantize(_blocks(256, 256, gen, 3), dim=-1)
    b, sb = mx.quantize(_blocks(128, 256, gen, 3), dim=-1)
    want = mx_gemm.mx_gemm(a, sa, b, sb)
    path = build.build_variant(mx_gemm.SOURCE, mx_gemm.LIBRARY, tmp_path, ["-DMOKGEN_MX_PROBE=0"], cutlass=True,
                               arch=mx_gemm.ARCH)
    lib = ctypes.CDLL(str(path))
    vp, ci = ctypes.c_void_p, ctypes.c_int
    lib.mokgen_mx_gemm_form.argtypes, lib.mokgen_mx_gemm_form.restype = [ci, vp, vp, vp, vp, vp, ci, ci, ci, vp], ci
    bsa, bsb = mx_gemm.block_scales(sa), mx_gemm.block_scales(sb)  # held: their memory stays theirs
    torch.cuda.synchronize()
    for form, code in sorted(mx_gemm.FORMS.items()):
        out = torch.full_like(want, float("nan"))
        rc = lib.mokgen_mx_gemm_form(code, out.data_ptr(), a.data_ptr(), bsa.data_ptr(), b.data_ptr(), bsb.data_ptr(),
                                     256, 128, 256, None)
        torch.cuda.synchronize()
        assert rc == 0, f"form {form}: CUDA error {rc}"
        assert torch.equal(out, want), form


@pytest.mark.parametrize("M, N, K, spread", [(128, 256, 128, 0), (256, 512, 1024, 6), (384, 256, 2048, 20)])
def test_bf16_math_gemm_matches_the_exact_mx_product(M, N, K, spread):
    """The bf16-math form (dense): A's blocks decoded into BF16 register fragments, B decoded once; float32 sums with no promotion, so closer to the exact product than
    the FP8 forms (their 32-wide sums keep about 14 bits)."""
    gen = torch.Generator(device="cuda").manual_seed(M + N + K + 1)
    a, sa = mx.quantize(_blocks(M, K, gen, spread), dim=-1)
    b, sb = mx.quantize(_blocks(N, K, gen, spread), dim=-1)
    got = mx_gemm.mx_bf16_math_gemm(a, sa, mx_gemm.bf16_math_weights(b, sb))
    want = _exact(a, sa, b, sb)
    assert torch.isfinite(got).all()
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < 1e-5, f"relative error {err:.3e}"
    assert torch.equal(mx_gemm.mx_bf16_math_gemm(a, sa, mx_gemm.bf16_math_weights(b, sb)), got)


def test_bf16_math_grouped_gemm_equals_the_dense_form_per_expert():
    """Grouped over (expert, first row) tiles with (-1, 0) entries skipped: each expert's rows
    are the dense bf16-math GEMM's bits against that expert's B."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    E, N, K = 3, 512, 384
    padded = [256, 0, 128]
    a, sa = mx.quantize(_blocks(sum(padded), K, gen, 8), dim=-1)
    b, sb = mx.quantize(torch.stack([_blocks(N, K, gen, 8) for _ in range(E)]), dim=-1)
    b16 = torch.stack([mx_gemm.bf16_math_weights(b[e], sb[e]) for e in range(E)])
    tiles, n = mx_gemm.row_tiles(padded, "cuda")
    tiles = torch.cat([tiles, torch.tensor([[-1, 0]] * 2, dtype=torch.int32, device="cuda")])
    got = mx_gemm.mx_bf16_math_grouped_gemm(a, mx_gemm.block_scales(sa), b16, tiles)
    start = 0
    for e, rows in enumerate(padded):
        if rows:
            want = mx_gemm.mx_bf16_math_gemm(a[start:start + rows].contiguous(), sa[start:start + rows].contiguous(),
                                             b16[e])
            assert torch.equal(got[start:start + rows], want), e
        start += rows


@pytest.mark.parametrize("pad, first", [(8, 4), (2, 0), (4, 2)])
def test_grouped_gemm_into_a_column_block_of_a_wider_matrix(pad, first):
    """``out=`` a float32 view [M, N] of a wider matrix (row stride N + pad, from column first): the
    bits of the plain call in the view, nothing written outside it. pad 8 from column 4 keeps C's
    rows and base 16-byte aligned (the epilogue's whole-row stores through shared memory); pad 2
    (rows 8 bytes off) and column 2 (base 8 bytes off) take the per-fragment stores."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    E, N, K = 2, 256, 256
    padded = [128, 256]
    a, sa = mx.quantize(_blocks(sum(padded), K, gen, 8), dim=-1)
    b, sb = mx.quantize(torch.stack([_blocks(N, K, gen, 8) for _ in range(E)]), dim=-1)
    b16 = torch.stack([mx_gemm.bf16_math_weights(b[e], sb[e]) for e in range(E)])
    tiles, _ = mx_gemm.row_tiles(padded, "cuda")
    want = mx_gemm.mx_bf16_math_grouped_gemm(a, mx_gemm.block_scales(sa), b16, tiles)
    wide = torch.full((sum(padded), N + pad), 7.0, device="cuda")
    view = wide[:, first:first + N]
    got = mx_gemm.mx_bf16_math_grouped_gemm(a, mx_gemm.block_scales(sa), b16, tiles, out=view)
    assert got.data_ptr() == view.data_ptr()
    assert torch.equal(view, want)
    rest = torch.ones_like(wide, dtype=torch.bool)
    rest[:, first:first + N] = False
    assert (wide[rest] == 7.0).all()


@pytest.mark.parametrize("quant", ["v1", "v2"])
@pytest.mark.parametrize("transpose", [False, True])
def test_expert_weights_are_the_quantizer_s_values_codes_and_scales(transpose, quant, monkeypatch):
    """mx_gemm.expert_weights' kernels (both versions, MOKGEN_MX_QUANT) against mokgen.mx.quantize
    of the stacked (or stacked and transposed) weights: the bf16-math values (bf16_math_weights'
    bits), the codes and the blocked scales; rows scaled over a wide range, one NaN."""
    monkeypatch.setenv("MOKGEN_MX_QUANT", quant)
    gen = torch.Generator(device="cuda").manual_seed(22 + transpose)
    E, R, C = 3, 256, 384
    parts = [(torch.randn(E, R, C, generator=gen, device="cuda") *
              torch.exp2(torch.randint(-40, 40, (E, R, 1), generator=gen, device="cuda").float())).to(torch.bfloat16)
             for _ in range(2)]
    parts[1][2, 5, 7] = float("nan")
    dec, codes, scales = mx_gemm.expert_weights(parts, transpose=transpose, codes=True)
    stacked = torch.cat(parts, dim=1)
    if transpose:
        stacked = stacked.transpose(1, 2).contiguous()
    want_codes, want_scales = mx.quantize_experts(stacked)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, mx_gemm.block_expert_scales(want_scales))
    want_dec = torch.stack([mx_gemm.bf16_math_weights(want_codes[e], want_scales[e]) for e in range(E)])
    assert torch.equal(dec.view(torch.int16), want_dec.view(torch.int16))
    alone = mx_gemm.expert_weights(parts, transpose=transpose)
    assert torch.equal(alone.view(torch.int16), dec.view(torch.int16))


@pytest.mark.parametrize("E, n", [(1, 1), (3, 300), (48, 16384), (384, 20000), (8, 0), (1024, 3000), (2, 131072)])
def test_segments_kernel_is_the_pytorch_expression(E, n):
    """mx_gemm.segments (one CTA) against mx_experts._segments' PyTorch expression on the CPU:
    rows, sources, tiles and padded sizes, on random and skewed routings."""
    from mokgen import mx_experts

    gen = torch.Generator().manual_seed(E + n)
    for skew in (False, True):
        ids = torch.randint(0, E, (n,), generator=gen)
        if skew and n:
            ids[: n // 2] = 0
        k = 2 if n % 2 == 0 and n else 1
        want = mx_experts._segments(ids, E, k)
        dev = ids.cuda()
        unsorted = mx_experts._segments(dev, E, k)  # the kernel ranks the pairs itself
        sorted_ = mx_gemm.segments(dev, k, E, torch.sort(dev, stable=True).indices)
        for got in (unsorted, sorted_):
            for name, g, w in zip(("row", "src", "tiles", "padded"), got, want):
                assert torch.equal(g.cpu(), w), name


@pytest.mark.parametrize("quant", ["v1", "v2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cols_bf16_math_is_the_transposed_quantizer_s_values(dtype, quant, monkeypatch):
    monkeypatch.setenv("MOKGEN_MX_QUANT", quant)
    gen = torch.Generator(device="cuda").manual_seed(31)
    x = (torch.randn(384, 512, generator=gen, device="cuda") *
         torch.exp2(torch.randint(-30, 30, (384, 1), generator=gen, device="cuda").float())).to(dtype)
    codes, scales = mx.quantize(x.t().contiguous(), dim=-1)
    want = mx_gemm.bf16_math_weights(codes, scales)
    assert torch.equal(mx_gemm.cols_bf16_math(x).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("quant", ["v1", "v2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_cols_blocked_is_quantize_cols_with_blocked_scales(dtype, quant, monkeypatch):
    """quantize_cols_blocked (the weight gradients' A, v0.41): the codes of quantize_cols and
    block_scales of its scales, bit for bit, under both column quantizers; rows scaled over a
    wide range, a NaN and an infinity, a partial 64-column tile (328) and an odd n (v1's kernel)."""
    monkeypatch.setenv("MOKGEN_MX_QUANT", quant)
    gen = torch.Generator(device="cuda").manual_seed(37)
    for n in (328, 512, 63):
        x = (torch.randn(384, n, generator=gen, device="cuda") *
             torch.exp2(torch.randint(-60, 60, (384, 1), generator=gen, device="cuda").float())).to(dtype)
        x[5, 7], x[200, 11] = float("nan"), float("inf")
        codes, scales = mx_gemm.quantize_cols_blocked(x)
        want_codes, want_scales = mx_gemm.quantize_cols(x)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), n
        assert torch.equal(scales, mx_gemm.block_scales(want_scales)), n


@pytest.mark.parametrize("quant", ["v1", "v2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cols_bf16_math_gathering_rows_is_the_gathered_copy_s(dtype, quant, monkeypatch):
    """cols_bf16_math(x, src=...) (the wgrads' x rows, v0.40): the bits of cols_bf16_math of the
    gathered copy (row r = x[src[r]], zeros where src[r] < 0), repeated tokens and padding rows
    in 32-row blocks of their own and mixed with tokens, under both quantizer versions."""
    monkeypatch.setenv("MOKGEN_MX_QUANT", quant)
    gen = torch.Generator(device="cuda").manual_seed(33)
    T, n, rows = 100, 328, 384  # a partial 64-column tile (v2's tiles)
    x = (torch.randn(T, n, generator=gen, device="cuda") *
         torch.exp2(torch.randint(-30, 30, (T, 1), generator=gen, device="cuda").float())).to(dtype)
    x[7, 11] = float("nan")
    src = torch.randint(0, T, (rows,), generator=gen, device="cuda", dtype=torch.int32)
    src[64:96] = -1           # a whole 32-row block of padding
    src[130:140] = -1         # padding inside a block
    src[300:] = -1            # a segment's tail
    copy = torch.where((src >= 0)[:, None], x[src.clamp(min=0).long()], torch.zeros(rows, n, dtype=dtype, device="cuda"))
    want = mx_gemm.cols_bf16_math(copy)
    got = mx_gemm.cols_bf16_math(x, src=src)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_values_are_the_column_quantizers_values_in_rows(dtype):
    """rows_values (MOKGEN_MX_WGRAD=bf16, v0.65): each column's 32-row blocks quantized as
    mx.quantize(x.t()) does, their MX values as bf16 in x's own layout (unpermuted), bit for bit;
    a NaN and an infinity (their blocks NaN), a partial 64-column tile (328), and through a gather
    with padding rows (whole blocks and inside blocks), as on the gathered copy."""
    gen = torch.Generator(device="cuda").manual_seed(41)
    for n in (328, 512):
        x = (torch.randn(384, n, generator=gen, device="cuda") *
             torch.exp2(torch.randint(-30, 30, (384, 1), generator=gen, device="cuda").float())).to(dtype)
        x[5, 7], x[200, 11] = float("nan"), float("inf")
        codes, scales = mx.quantize(x.t().contiguous(), dim=-1)
        want = mx.dequantize(codes, scales, out_dtype=torch.float32).to(torch.bfloat16).t()
        got = mx_gemm.rows_values(x)
        assert got.shape == (384, n) and got[5, 7].isnan() and got[31, 7].isnan()
        assert torch.equal(got.view(torch.int16), want.contiguous().view(torch.int16)), n
        src = torch.randint(0, 384, (320,), generator=gen, device="cuda", dtype=torch.int32)
        src[64:96], src[130:140], src[300:] = -1, -1, -1
        copy = torch.where((src >= 0)[:, None], x[src.clamp(min=0).long()], torch.zeros(320, n, dtype=dtype,
                                                                                        device="cuda"))
        assert torch.equal(mx_gemm.rows_values(x, src).view(torch.int16),
                           mx_gemm.rows_values(copy).view(torch.int16)), n


@pytest.mark.parametrize("ranged", ["tiles", "persistent"])
def test_ranged_gemm_is_the_dense_gemm_over_each_range(ranged, monkeypatch):
    """The weight gradients' launch, both kernels (MOKGEN_MX_RANGED): slice z over its k range has
    the dense bf16-math GEMM's bits on the operands sliced to that range; an empty range gives
    zeros; bf16 output is the float32 output rounded."""
    monkeypatch.setenv("MOKGEN_MX_RANGED", ranged)
    gen = torch.Generator(device="cuda").manual_seed(32)
    M, N, K = 256, 512, 1024
    a, sa = mx.quantize(_blocks(M, K, gen, 10), dim=-1)
    b, sb = mx.quantize(_blocks(N, K, gen, 10), dim=-1)
    b16 = mx_gemm.bf16_math_weights(b, sb)
    ranges = [(0, 384), (384, 0), (384, 128), (512, 512)]
    kr = torch.tensor(ranges, dtype=torch.int32, device="cuda")
    got = mx_gemm.mx_bf16_math_ranged_gemm(a, mx_gemm.block_scales(sa), b16, kr)
    for z, (first, length) in enumerate(ranges):
        if length == 0:
            assert (got[z] == 0).all()
            continue
        cols, blocks = slice(first, first + length), slice(first // 32, (first + length) // 32)
        want = mx_gemm.mx_bf16_math_gemm(a[:, cols].contiguous(), sa[:, blocks].contiguous(),
                                         b16[:, cols].contiguous())
        assert torch.equal(got[z], want), z
    low = mx_gemm.mx_bf16_math_ranged_gemm(a, mx_gemm.block_scales(sa), b16, kr, out_dtype=torch.bfloat16)
    assert torch.equal(low, got.to(torch.bfloat16))


def test_band_orders_give_the_grid_orders_bits(monkeypatch):
    """MOKGEN_MX_BAND (the grouped launches' tiles in launch order by bands of row tiles, column
    tile by column tile within a band) against the grid's order (band 1), every launch form (the
    dense and k-ranged ones keep the grid's order at any band): dense with an odd row-tile count,
    grouped with expert boundaries, an empty expert and skipped (-1, 0) tiles (an odd list),
    k-ranged with an empty range and bf16 out, an unaligned ``out=`` column block (the
    per-fragment stores), the fused SwiGLU epilogue and the fused combine; each run twice. The
    same bits."""
    gen = torch.Generator(device="cuda").manual_seed(61)
    E, N, K, I = 3, 512, 384, 256
    padded = [384, 0, 256]  # tiles: expert 0's three, expert 2's two, then two skipped
    a, sa = mx.quantize(_blocks(sum(padded), K, gen, 8), dim=-1)
    sab = mx_gemm.block_scales(sa)
    b, sb = mx.quantize(torch.stack([_blocks(N, K, gen, 8) for _ in range(E)]), dim=-1)
    b16 = torch.stack([mx_gemm.bf16_math_weights(b[e], sb[e]) for e in range(E)])
    tiles, _ = mx_gemm.row_tiles(padded, "cuda")
    tiles = torch.cat([tiles, torch.tensor([[-1, 0]] * 2, dtype=torch.int32, device="cuda")])  # 7: odd
    dense_rows = 640  # 5 row tiles
    ad, sad = mx.quantize(_blocks(dense_rows, K, gen, 8), dim=-1)
    kr = torch.tensor([(0, 128), (128, 0), (128, 256)], dtype=torch.int32, device="cuda")
    wg, wu = ((torch.randn(E, I, K, generator=gen, device="cuda") * K**-0.5).to(torch.bfloat16) for _ in range(2))
    fused = mx_gemm.expert_weights([wg, wu], interleave=True)
    rows = sum(padded)
    src = torch.full((rows,), -1, dtype=torch.int32, device="cuda")  # every 5th row padding, the rest
    real = torch.arange(rows, device="cuda")[torch.arange(rows, device="cuda") % 5 != 0]  # one token each
    src[real] = torch.randperm(real.numel(), generator=gen, device="cuda").to(torch.int32)
    weight = torch.rand(real.numel(), generator=gen, device="cuda")

    def run():
        wide = torch.full((rows, N + 2), 7.0, device="cuda")
        mx_gemm.mx_bf16_math_grouped_gemm(a, sab, b16, tiles, out=wide[:, 2:2 + N])
        return [mx_gemm.mx_bf16_math_gemm(ad, sad, b16[0]),
                mx_gemm.mx_bf16_math_grouped_gemm(a, sab, b16, tiles),
                mx_gemm.mx_bf16_math_ranged_gemm(a, sab, b16[1], kr),
                mx_gemm.mx_bf16_math_ranged_gemm(a, sab, b16[1], kr, out_dtype=torch.bfloat16),
                wide,
                *[t.view(torch.uint8) for t in mx_gemm.mx_bf16_math_swiglu_gemm(a, sab, fused, tiles, 10.0)],
                mx_gemm.mx_bf16_math_combine1_gemm(a, sab, b16, tiles, src, weight)]

    monkeypatch.setenv("MOKGEN_MX_BAND", "1")
    grid = run()
    assert (grid[2][1] == 0).all()  # the empty range
    for band in ("2", "3", "8", "64"):  # bands of 2 and 3 row tiles (a short last band), 8, one band
        monkeypatch.setenv("MOKGEN_MX_BAND", band)
        for _ in range(2):
            for i, (p, q) in enumerate(zip(run(), grid)):
                assert torch.equal(p, q), (band, i)
    monkeypatch.delenv("MOKGEN_MX_BAND")  # the default (8)
    assert all(torch.equal(p, q) for p, q in zip(run(), grid))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_persistent_ranged_gemm_gives_the_tile_kernels_bits(out_dtype, monkeypatch):
    """MOKGEN_MX_RANGED=persistent (direct stores) against tiles (stores through shared memory) on a
    wgrad-shaped launch with more tiles than SMs (each CTA walks several, its stage counter running
    on across tiles of different k lengths, empty ranges among them), and on one with fewer tiles
    than SMs; the same bits 3 times."""
    gen = torch.Generator(device="cuda").manual_seed(34)
    for M, N, lengths in ((1024, 1024, [384, 0, 128, 640, 256, 0, 896, 128, 384, 512]), (256, 256, [512, 128])):
        K = sum(lengths)
        first = [sum(lengths[:i]) for i in range(len(lengths))]
        a, sa = mx.quantize(_blocks(M, K, gen, 10), dim=-1)
        b, sb = mx.quantize(_blocks(N, K, gen, 10), dim=-1)
        b16 = mx_gemm.bf16_math_weights(b, sb)
        kr = torch.tensor(list(zip(first, lengths)), dtype=torch.int32, device="cuda")
        got = {}
        for ranged in ("tiles", "persistent"):
            monkeypatch.setenv("MOKGEN_MX_RANGED", ranged)
            got[ranged] = mx_gemm.mx_bf16_math_ranged_gemm(a, mx_gemm.block_scales(sa), b16, kr, out_dtype=out_dtype)
        assert torch.equal(got["persistent"], got["tiles"]), (M, N)
        for z, (f, n) in enumerate(zip(first, lengths)):  # and each slice the dense GEMM over its range
            if n == 0:
                assert not got["persistent"][z].any()
                continue
            cols, blocks = slice(f, f + n), slice(f // 32, (f + n) // 32)
            want = mx_gemm.mx_bf16_math_gemm(a[:, cols].contiguous(), sa[:, blocks].contiguous(),
                                             b16[:, cols].contiguous())
            assert torch.equal(got["persistent"][z], want.to(out_dtype)), (M, N, z)
        for _ in range(2):
            again = mx_gemm.mx_bf16_math_ranged_gemm(a, mx_gemm.block_scales(sa), b16, kr, out_dtype=out_dtype)
            assert torch.equal(again, got["persistent"])


def _every_case_weights(E, R, C, seed):
    """float32 [E, R, C] whose 32-blocks along C reach every case of the quantizer: scales from
    2^-135 to 2^120, a zero block, float32 (and bf16) subnormals, a value past E4M3's largest after
    scaling, an infinity and a NaN (in the first 128 columns of rows 0-4)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(E, R, C, generator=gen, device="cuda") * torch.exp2(
        torch.randint(-135, 120, (E, R, C // 32, 1), generator=gen, device="cuda").float()).repeat_interleave(
        32, dim=2).view(E, R, C)
    w[0, 0, :32] = 0.0
    w[0, 1, :32] = 1e-40  # subnormals (in float32 and in bf16)
    w[1, 2, :32] = 448.0 * 2.0 ** 20
    w[1, 2, 5] = 500.0 * 2.0 ** 20  # past the largest E4M3 after scaling: saturates
    w[2, 3, 64 + 7] = float("inf")
    w[2, 4, 96 + 1] = float("nan")
    return w


@pytest.mark.parametrize("sizes, C", [([640, 640], 3200), ([96, 160], 1024), ([32, 96], 128), ([384], 7168)])
def test_both_orientations_from_one_read_are_the_two_kernels_bits(sizes, C):
    """mx_gemm.expert_weights_both (MOKGEN_MX_WEIGHTS=both) against expert_weights in each
    orientation: the same bits, on blocks that reach every case of the quantizer (NaN and
    infinity blocks included), parts of 32 rows up to several 128-row tiles (partial tiles along
    the rows), and a 7168-column weight (kimi-k2.5's H)."""
    wb = _every_case_weights(3, sum(sizes), C, seed=52).to(torch.bfloat16)
    parts = [t.contiguous() for t in wb.split(sizes, dim=1)]
    assert mx_gemm.both_applies(parts)
    rows, cols = mx_gemm.expert_weights_both(parts)
    want_rows = mx_gemm.expert_weights(parts)
    want_cols = mx_gemm.expert_weights(parts, transpose=True)
    assert rows.shape == want_rows.shape and cols.shape == want_cols.shape
    assert torch.equal(rows.view(torch.int16), want_rows.view(torch.int16))
    assert torch.equal(cols.view(torch.int16), want_cols.view(torch.int16))
    if len(sizes) > 1:
        assert rows.isnan().any() and cols.isnan().any()  # the NaN blocks reached both outputs
    # apart (v0.65, the MXFP8 layer's conversions): each part's forward values in a tensor of its
    # own, expert_weights([part])'s bits, and the same transposed values
    parts_rows, cols_apart = mx_gemm.expert_weights_both(parts, apart=True)
    assert torch.equal(cols_apart.view(torch.int16), want_cols.view(torch.int16))
    assert len(parts_rows) == len(parts)
    for p, r in zip(parts, parts_rows):
        want_p = mx_gemm.expert_weights([p])
        assert r.shape == want_p.shape and torch.equal(r.view(torch.int16), want_p.view(torch.int16))


def test_both_orientations_refuse_what_their_kernel_cannot_take():
    w = torch.zeros(2, 96, 256, dtype=torch.bfloat16, device="cuda")
    for parts in ([w[:, :40].contiguous()],  # rows not a multiple of 32
                  [torch.zeros(2, 96, 200, dtype=torch.bfloat16, device="cuda")],  # K not a multiple of 128
                  [w[:, :32]],  # not contiguous
                  [w.float()]):  # not bf16
        assert not mx_gemm.both_applies(parts)
        with pytest.raises(mx_gemm.InputError, match="expert_weights_both takes"):
            mx_gemm.expert_weights_both(parts)


def test_the_weight_quantizers_two_versions_give_the_same_bits(monkeypatch):
    """MOKGEN_MX_QUANT v1 and v2 (the column quantizers; by rows one kernel since v0.41, run too)
    on blocks that reach every case of the quantizer: zeros, float32 subnormals, values past
    E4M3's largest after scaling, an infinity, a NaN, scales from 2^-135 to 2^120 (bf16 weights
    by rows, interleaved and by columns; float32 and bf16 activations by column), partial tiles
    in every grid dimension, and an odd column count (v1's kernel then)."""
    E, R, C = 3, 1280, 3200  # C / 32 = 100 blocks: a partial CTA of 32 along the rows' K
    w = _every_case_weights(E, R, C, seed=51)
    wb = w.to(torch.bfloat16)
    halves = [t.contiguous() for t in wb.split([R // 2, R // 2], dim=1)]  # 640 rows each (interleave)
    ragged = [wb[:, :100].contiguous(), wb[:, 100:136].contiguous()]  # rows: partial CTAs of 8 rows
    thirds = [wb[:, :96].contiguous(), wb[:, 96:256].contiguous()]  # columns: 3 and 5 blocks of 32 rows
    acts = [w[0].contiguous(), wb[1].contiguous()]

    def run(quant):
        monkeypatch.setenv("MOKGEN_MX_QUANT", quant)
        out = []
        for transpose in (False, True):
            out += list(mx_gemm.expert_weights(halves, transpose=transpose, codes=True))
        out.append(mx_gemm.expert_weights(halves, interleave=True))
        out += list(mx_gemm.expert_weights(ragged, codes=True))
        out += list(mx_gemm.expert_weights(thirds, transpose=True, codes=True))
        out += [mx_gemm.cols_bf16_math(a) for a in acts]
        out += [mx_gemm.cols_bf16_math(a[:, :C - 2].contiguous()) for a in acts]  # n % 8 != 0: v1's kernel
        out += [mx_gemm.cols_bf16_math(a[:, :C - 8].contiguous()) for a in acts]  # v2: a partial 64-column tile
        out.append(mx_gemm.cols_bf16_math(acts[1][:, :C - 1].contiguous()))  # odd n
        return [t.view(torch.uint8) for t in out]

    one, two = run("v1"), run("v2")
    for i, (a, b) in enumerate(zip(one, two)):
        assert torch.equal(a, b), i
    assert (one[2] == 0xFF).any()  # the rows' scales: the NaN and infinity blocks reached the NaN scale


@pytest.mark.parametrize("clamp", [None, 7.0])
def test_fused_swiglu_gemm_is_the_gemm_then_swiglu_quantize(clamp):
    """The up projection with SwiGLU and h's quantization in the epilogue (B interleaved in 128s)
    has the bits of the unfused grouped GEMM followed by swiglu_quantize, over every tile of the
    segments; skipped (-1, 0) tiles write nothing. Rows scaled over a wide range, a NaN row."""
    gen = torch.Generator(device="cuda").manual_seed(41)
    E, I, K = 3, 256, 384
    padded = [256, 0, 128]
    x = _blocks(sum(padded), K, gen, 12)
    x[130, 5] = float("nan")  # its h row: the NaN scale and codes where the product meets it
    a, sa = mx.quantize(x, dim=-1)
    wg, wu = ((torch.randn(E, I, K, generator=gen, device="cuda") * K**-0.5).to(torch.bfloat16) for _ in range(2))
    plain = mx_gemm.expert_weights([wg, wu])
    fused = mx_gemm.expert_weights([wg, wu], interleave=True)
    tiles, n = mx_gemm.row_tiles(padded, "cuda")
    tiles = torch.cat([tiles, torch.tensor([[-1, 0]], dtype=torch.int32, device="cuda")])
    gu = mx_gemm.mx_bf16_math_grouped_gemm(a, mx_gemm.block_scales(sa), plain, tiles)
    want_codes, want_scales = mx_gemm.swiglu_quantize(gu, clamp)
    codes, scales = mx_gemm.mx_bf16_math_swiglu_gemm(a, mx_gemm.block_scales(sa), fused, tiles, clamp)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    # the NaN row reached the check; under the clamp, SwiGLU's fminf / fmaxf map a NaN gate or
    # up to the limit (common.cuh, every mokgen SwiGLU), so that row's h is finite
    assert (scales == 255).any() if clamp is None else not (scales == 255).any()


@pytest.mark.parametrize("rows", [256, 77])
def test_the_megakernels_mx_down_tile_has_the_bf16_math_gemms_bits(rows):
    """mx_tile.cuh's tile (the megakernel's MX path, run alone): the down tile's bf16 rows are the
    dense bf16-math GEMM's float32 result rounded (the same k16 steps in the same order). With 77
    valid rows the first 128-row tile is partial and the second has none: only rows < 77 are
    written (the rest keep the NaN marker)."""
    M, N, K = mx_gemm.TILE_TEST_SHAPES["down"]
    gen = torch.Generator(device="cuda").manual_seed(51)
    a, sa = mx.quantize(_blocks(M, K, gen, 10), dim=-1)
    b, sb = mx.quantize(_blocks(N, K, gen, 10), dim=-1)
    b16 = mx_gemm.bf16_math_weights(b, sb)
    got = mx_gemm._mx_tile_test("down", a, mx_gemm.block_scales(sa), b16, rows=rows)
    want = mx_gemm.mx_bf16_math_gemm(a, sa, b16).to(torch.bfloat16)
    assert torch.equal(got[:rows], want[:rows])
    assert torch.isnan(got[rows:]).all()


@pytest.mark.parametrize("clamp, rows", [(None, 256), (3.0, 256), (None, 200)])
def test_the_megakernels_mx_gated_tile_has_the_unfused_bits(clamp, rows):
    """The gated tile (gate and up from two weight tensors, as the megakernel loads them): h's
    codes and scales are those of the unfused path, the grouped bf16-math GEMM then
    swiglu_quantize (GPU-tested against the float64 oracle), and of the fused SwiGLU GEMM. A NaN
    in row 130 gives that row NaN codes and the NaN scale (without the clamp: the clamp's
    fminf / fmaxf take the limit for a NaN); a partial tile (rows < 256) leaves the
    rows past it unwritten (the 0xEE marker)."""
    M, I, K = mx_gemm.TILE_TEST_SHAPES["gated"]
    gen = torch.Generator(device="cuda").manual_seed(52)
    x = _blocks(M, K, gen, 10)
    x[130, 5] = float("nan")
    a, sa = mx.quantize(x, dim=-1)
    wg, wu = ((torch.randn(1, I, K, generator=gen, device="cuda") * K**-0.5).to(torch.bfloat16) for _ in range(2))
    bg, bu = mx_gemm.expert_weights([wg]), mx_gemm.expert_weights([wu])
    codes, scales = mx_gemm._mx_tile_test("gated", a, mx_gemm.block_scales(sa), bg[0], bu[0], clamp, rows=rows)
    codes = codes.view(torch.uint8)
    tiles, _ = mx_gemm.row_tiles([M], "cuda")
    gu = mx_gemm.mx_bf16_math_grouped_gemm(a, mx_gemm.block_scales(sa), mx_gemm.expert_weights([wg, wu]), tiles)
    want_codes, want_scales = mx_gemm.swiglu_quantize(gu, clamp)
    fused_codes, fused_scales = mx_gemm.mx_bf16_math_swiglu_gemm(
        a, mx_gemm.block_scales(sa), mx_gemm.expert_weights([wg, wu], interleave=True), tiles, clamp)
    for wc, ws in ((want_codes, want_scales), (fused_codes, fused_scales)):
        assert torch.equal(codes[:rows], wc.view(torch.uint8)[:rows])
        assert torch.equal(scales[:, :rows], ws[:, :rows])
    # the NaN row reached the check (under the clamp a NaN becomes the limit: finite scales)
    assert (scales[:, 130] == 255).all() if clamp is None else (scales[:, 130] != 255).all()
    assert (codes[rows:] == 0xEE).all() and (scales[:, rows:] == 0xEE).all()


@pytest.mark.parametrize("first_row", [1, 2, 3, 6])
def test_the_megakernels_mx_tiles_start_at_any_row(first_row):
    """The megakernel's tiles start at any row of its ring (expert segments are not padded there),
    and a TMA load whose innermost coordinate is not 16-byte aligned is an illegal instruction: the
    scales' box starts at the 4-aligned row below the tile (mx_tile.cuh, kScaleBoxRows; v0.38).
    Tiles from row first_row on give the rows of the tiles from row 0, shifted: the down tile's
    bf16 rows and the gated tile's h codes and scales, bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(53)
    M, N, K = mx_gemm.TILE_TEST_SHAPES["down"]
    a, sa = mx.quantize(_blocks(M, K, gen, 10), dim=-1)
    b, sb = mx.quantize(_blocks(N, K, gen, 10), dim=-1)
    b16 = mx_gemm.bf16_math_weights(b, sb)
    n = M - first_row
    want = mx_gemm._mx_tile_test("down", a, mx_gemm.block_scales(sa), b16)
    got = mx_gemm._mx_tile_test("down", a, mx_gemm.block_scales(sa), b16, rows=n, first_row=first_row)
    assert torch.equal(got[:n], want[first_row:])
    assert torch.isnan(got[n:]).all()

    M, I, K = mx_gemm.TILE_TEST_SHAPES["gated"]
    a, sa = mx.quantize(_blocks(M, K, gen, 10), dim=-1)
    wg, wu = ((torch.randn(1, I, K, generator=gen, device="cuda") * K**-0.5).to(torch.bfloat16) for _ in range(2))
    bg, bu = mx_gemm.expert_weights([wg]), mx_gemm.expert_weights([wu])
    want_codes, want_scales = mx_gemm._mx_tile_test("gated", a, mx_gemm.block_scales(sa), bg[0], bu[0])
    n = M - first_row
    codes, scales = mx_gemm._mx_tile_test("gated", a, mx_gemm.block_scales(sa), bg[0], bu[0], rows=n,
                                          first_row=first_row)
    assert torch.equal(codes.view(torch.uint8)[:n], want_codes.view(torch.uint8)[first_row:])
    assert torch.equal(scales[:, :n], want_scales[:, first_row:])


# ---- the dgrads' GEMM with the weights raw (v0.67, mx_rawb.cuh) -----------------------------------

def _natural_k(dec):
    """expert_weights' bf16-math values with k back in natural order (their position bf16m_pos(j)
    holds k j of each 32-block: mx_rows.cuh)."""
    j = torch.arange(32)
    i, q = j & 3, (j >> 2) & 3
    pos = (j & 16) + 2 * q + (i & 1) + 8 * (i >> 1)
    K = dec.shape[-1]
    perm = (torch.arange(K) // 32 * 32 + pos.repeat(K // 32)).to(dec.device)
    return dec[..., perm]


def _raw_parts(gen, E, sizes, N, hard=True):
    """Weights [E, k_i, N] whose 32-blocks along k cover both of the kernel's paths: blocks scaled
    2^[-60, 60] (the integer rounding), blocks near E8M0's ends (amax below 2^-103 or above 2^123:
    the conversion's float path), zero blocks, blocks with elements far below their amax (E4M3's
    subnormal grid) and blocks whose largest element saturates at 448 2^s."""
    parts = []
    for r in sizes:
        w = torch.randn(E, r, N, generator=gen, device="cuda")
        w = w * torch.exp2(torch.randint(-60, 61, (E, r // 32, 1, N), generator=gen, device="cuda").float()) \
            .repeat_interleave(32, dim=1).view(E, r, N)
        if hard:
            w[:, 0:32, 0:2] = torch.randn(E, 32, 2, generator=gen, device="cuda") * 2.0**-110  # amax below 2^-103
            w[:, 0:32, 2:4] = torch.randn(E, 32, 2, generator=gen, device="cuda") * 2.0**-131  # bf16 subnormals
            w[:, 32:64, 4:8] = torch.randn(E, 32, 4, generator=gen, device="cuda") * 2.0**124  # above 2^123
            w[:, 0:32, 8:10] = 0.0              # zero blocks
            w[:, 0:31, 10:12] *= 2.0**-20       # one large element, the rest on E4M3's subnormal grid
            w[:, 32:64, 12:16] = torch.randn(E, 32, 4, generator=gen, device="cuda") * 4.0
            w[:, 40, 12:16] = 1.98 * 2.0**5     # the amax, saturates: 1.98 2^e rounds past 448 2^s
            w[:, 41, 12:16] = -1.9 * 2.0**5
            w[:, 0:64:3, 16:20] = -0.0
        parts.append(w.to(torch.bfloat16))
    return parts


@pytest.mark.parametrize("sizes, N", [([256], 256), ([128, 128], 512), ([192, 64], 256)])
def test_raw_weights_are_quantized_to_the_transposed_conversions_bits(sizes, N):
    """With A the identity (code 1.0, scale 2^0), C = B's MX values transposed, exactly: each of
    the kernel's quantized weights against expert_weights(parts, transpose=True)'s values (k back in
    natural order), over blocks that take the integer rounding and blocks that take the float path."""
    gen = torch.Generator(device="cuda").manual_seed(61 + N)
    E, K = 2, sum(sizes)
    parts = _raw_parts(gen, E, sizes, N)
    eye = torch.eye(K, device="cuda").repeat(E, 1)  # expert e's rows: the identity over K
    a, sa = mx.quantize(eye, dim=-1)
    tiles, _ = mx_gemm.row_tiles([K] * E, "cuda")
    got = mx_gemm.mx_bf16_math_raw_gemm(a, mx_gemm.block_scales(sa), parts, tiles)
    want = _natural_k(mx_gemm.expert_weights(parts, transpose=True))  # [E, N, K]
    bad = (got.view(E, K, N) != want.float().transpose(1, 2)).nonzero()
    if bad.numel():  # where: (expert, k, n) of the first few, and the k rows / n columns mod 64 hit
        print("mismatches", bad.shape[0], bad[:8].tolist(), "k%64", sorted(set((bad[:, 1] % 64).tolist()))[:16],
              "n%64", sorted(set((bad[:, 2] % 64).tolist()))[:16])
    assert bad.numel() == 0
    # and against mokgen.mx's quantizer of the stacked transposed weights
    codes, scales = mx.quantize_experts(torch.cat(parts, dim=1).transpose(1, 2).contiguous())
    ref = mx.dequantize(codes, scales, dim=-1).to(torch.bfloat16).float()
    assert torch.equal(got.view(E, K, N), ref.transpose(1, 2))


@pytest.mark.parametrize("k1", [0, 256])
def test_raw_weights_gemm_is_the_values_gemm(k1):
    """The raw-weights GEMM against the bf16-math grouped GEMM over the transposed conversion's
    values: the same MX products (A's k order differs within each 16, so the float32 sums may differ
    in their last bits), NaN where a weight block is NaN, the same bits on every repeat; skipped
    tiles are not written; and the combine epilogue writes bf16(w * C) of the store's C."""
    gen = torch.Generator(device="cuda").manual_seed(67 + k1)
    E, k0, N = 3, 512, 768
    sizes = [k0] + ([k1] if k1 else [])
    K = sum(sizes)
    parts = _raw_parts(gen, E, sizes, N, hard=False)
    parts[0][2, 70, 300] = float("nan")  # expert 2's k block 2 of column 300
    padded = [256, 0, 384]
    M = sum(padded)
    a, sa = mx.quantize(_blocks(M, K, gen, 8), dim=-1)
    tiles, _ = mx_gemm.row_tiles(padded, "cuda")
    tiles = torch.cat([tiles, torch.tensor([[-1, 0]], dtype=torch.int32, device="cuda")])
    sab = mx_gemm.block_scales(sa)
    values = mx_gemm.expert_weights(parts, transpose=True)
    got = mx_gemm.mx_bf16_math_raw_gemm(a, sab, parts, tiles)
    want = mx_gemm.mx_bf16_math_grouped_gemm(a, sab, values, tiles)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.isnan(got[256:, 300]).all() and not torch.isnan(got[:256]).any()
    # each element against its own magnitude scale, sum |a| |b| (float64)
    av, bv = mx.dequantize(a, sa, dim=-1).double().abs(), _natural_k(values).double().abs().nan_to_num(0.0)
    scale = torch.cat([av[:256] @ bv[0].t(), av[256:] @ bv[2].t()])
    ok = ~torch.isnan(want)
    diff = (got.double() - want.double()).abs()
    assert (diff[ok] <= 1e-6 * scale[ok] + 1e-30).all(), (diff[ok] / scale[ok]).max().item()
    print(f"raw vs values: {int((got[ok] != want[ok]).sum())} of {int(ok.sum())} elements differ")
    assert torch.equal(mx_gemm.mx_bf16_math_raw_gemm(a, sab, parts, tiles).nan_to_num(7.0), got.nan_to_num(7.0))
    # the combine epilogue (one pair per token): token t on row src_rows[t]
    T = 400
    rows = torch.randperm(M, generator=torch.Generator().manual_seed(5))[:T].to("cuda")
    src = torch.full((M,), -1, dtype=torch.int32, device="cuda")
    src[rows] = torch.arange(T, dtype=torch.int32, device="cuda")
    weight = torch.rand(T, generator=gen, device="cuda")
    out = mx_gemm.mx_bf16_math_raw_gemm(a, sab, parts, tiles, combine=(src, weight))
    want_out = (weight[:, None] * got[rows]).to(torch.bfloat16)
    assert torch.equal(out.isnan(), want_out.isnan())
    assert torch.equal(out.nan_to_num(0.0).view(torch.int16), want_out.nan_to_num(0.0).view(torch.int16))


def test_raw_weights_gemm_refuses_what_it_cannot_take():
    gen = torch.Generator(device="cuda").manual_seed(71)
    a, sa = mx.quantize(_blocks(128, 256, gen, 2), dim=-1)
    tiles, _ = mx_gemm.row_tiles([128], "cuda")
    w = torch.randn(1, 256, 256, device="cuda").to(torch.bfloat16)
    for bad in ([w[:, :, :128].contiguous()], [w[:, :96]], [w.float()], [w, w, w]):
        with pytest.raises(mx_gemm.InputError, match="raw-weights GEMM"):
            mx_gemm.mx_bf16_math_raw_gemm(a, mx_gemm.block_scales(sa), bad, tiles)
