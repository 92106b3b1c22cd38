"""The MXFP8 GEMM library (mokgen/mx_gemm.py, templates/mx_gemm.cu): build and input checks, no
GPU needed. Its GPU test is in test_gpu_mx_gemm.py."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from conftest import gnu_unique_symbols, sass  # noqa: E402
from mokgen import env, mx, mx_gemm  # noqa: E402
from mokgen.errors import InputError  # noqa: E402


@pytest.mark.nvcc
def test_library_builds_without_spills_with_fp8_wgmma(private_dirs):
    """A GEMM kernel per form and the two quantizers, no spills, no wgmma serialized, and the FP8
    wgmma in the SASS (QGMMA; the 32-wide k steps on E4M3 operands)."""
    from mokgen.build import build_source, serialized_wgmma

    lib = build_source(mx_gemm.SOURCE, mx_gemm.LIBRARY, cutlass=True, arch=mx_gemm.ARCH)
    assert mx_gemm.build_library() == lib  # the entry a run with the JIT off is told to call
    log = (lib.parent / "build.log").read_text()
    kernels = re.findall(r"Compiling entry function '(\w+)'", log)
    assert sum("mx_gemm_kernel" in k for k in kernels) == len(mx_gemm.FORMS), kernels
    assert any("quantize_rows_kernel" in k for k in kernels) and any("swiglu_quantize_kernel" in k for k in kernels)
    # the combine's and SwiGLU's backward read float32 padded rows or bf16 rows by pair (v0.64)
    # each with and without writing dy (v0.66: keep_dy=False, the fused weight-gradient operands)
    assert sum("combine_backward_kernel" in k for k in kernels) == 4
    assert sum("swiglu_backward_kernel" in k for k in kernels) == 4  # each with and without the clamp
    assert sum("swiglu_backward_cols_kernel" in k for k in kernels) == 4  # v0.66: the same four, values out
    assert any("ranged_kernel" in k for k in kernels)  # MOKGEN_MX_RANGED=persistent
    assert sum("raw_gemm_kernel" in k for k in kernels) == 2  # v0.67: the store and the k = 1 combine
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills == [("0", "0")] * len(kernels), spills
    assert serialized_wgmma(lib.parent) == []
    assert gnu_unique_symbols(lib) == []  # no flag shared with a variant build in the process
    code = sass(lib)
    assert re.search(r"QGMMA\.64x128x32\.F32\.E4M3\.E4M3", code), "no FP8 wgmma in the SASS"
    assert re.search(r"QGMMA\.64x64x32\.F32\.E4M3\.E4M3", code), "no 64 x 64 FP8 wgmma (form quad)"
    # the bf16-math form's wgmma: A from registers (BF16), B from shared memory
    assert re.search(r"HGMMA\.64x256x16\.F32\.BF16 R\d+, R\d+, gdesc", code), "no register-A BF16 wgmma"
    # v0.67's raw-weights GEMM: the same wgmma with B MN-major (the weights as held, n contiguous)
    assert re.search(r"HGMMA\.64x256x16\.F32\.BF16 R\d+, R\d+, gdesc\[UR\d+\]\.tnspB", code), "no MN-major B"


def _operands(M=128, N=128, K=128, device="cpu"):
    a = torch.zeros(M, K, dtype=torch.float8_e4m3fn, device=device)
    b = torch.zeros(N, K, dtype=torch.float8_e4m3fn, device=device)
    return a, torch.zeros(M, K // 32, dtype=torch.uint8, device=device), b, torch.zeros(N, K // 32, dtype=torch.uint8,
                                                                                        device=device)


def test_bad_operands_are_refused_with_one_line():
    a, sa, b, sb = _operands()
    with pytest.raises(InputError, match="A codes must be on a CUDA device"):
        mx_gemm.mx_gemm(a, sa, b, sb)
    with pytest.raises(InputError, match="A codes must be a contiguous 2-d float8_e4m3fn"):
        mx_gemm.mx_gemm(a.float(), sa, b, sb)
    with pytest.raises(InputError, match="A codes must be a contiguous 2-d"):
        mx_gemm.mx_gemm(a.t(), sa, b, sb)


def test_an_unknown_form_is_refused():
    with pytest.raises(InputError, match=r"form must be one of \['decoded', 'inline', 'quad'\], got 'fast'"):
        mx_gemm.mx_gemm(*_operands(), form="fast")


def test_shapes_and_scales_are_checked(monkeypatch):
    """Shape checks run before any device work; CPU tensors posing as CUDA ones reach them."""
    a, sa, b, sb = _operands(K=256)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(InputError, match=r"rows and K positive multiples of 128, got \(100, 256\)"):
        mx_gemm.mx_gemm(a[:100], sa[:100], b, sb)
    with pytest.raises(InputError, match=r"A scales must be a contiguous uint8 tensor of shape \(128, 8\)"):
        mx_gemm.mx_gemm(a, sa[:, :4].contiguous(), b, sb)
    with pytest.raises(InputError, match="B codes have K = 128, the other operand 256"):
        mx_gemm.mx_gemm(a, sa, b[:, :128].contiguous(), sb[:, :4].contiguous())


def test_grouped_launches_check_their_operands_and_tile_list(monkeypatch):
    """Both grouped GEMMs refuse a tile list that is not int32 [n, 2] or is too long for the grid,
    and the bf16-math ones a B that is not bf16 with N a multiple of 256, before any launch."""
    a, sa, b, sb = _operands(K=256)
    sa_b, sb_b = mx_gemm.block_scales(sa), mx_gemm.block_expert_scales(sb[None])
    good = torch.zeros(1, 2, dtype=torch.int32)
    for bad in (good.long(), good[:, :1], torch.zeros(65536, 2, dtype=torch.int32)):
        with pytest.raises(InputError, match=r"grouped MX GEMM: tiles must be int32 \[n, 2\] \(n <= 65535\)"):
            mx_gemm.mx_grouped_gemm(a, sa_b, b[None], sb_b, bad)
    b16 = torch.zeros(1, 256, 256, dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"grouped bf16-math GEMM: tiles must be int32"):
        mx_gemm.mx_bf16_math_grouped_gemm(a, sa_b, b16, good.long())
    with pytest.raises(InputError, match=r"B must be contiguous bf16 \[E, N, K\] with K = 256 and N a multiple of 256"):
        mx_gemm.mx_bf16_math_grouped_gemm(a, sa_b, b16[:, :128], good)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(InputError, match=r"B must be contiguous bf16 \[N, K\]"):
        mx_gemm.mx_bf16_math_gemm(a, sa, b16[0].float())


@pytest.fixture
def launches(monkeypatch):
    """mokgen.mx_gemm's library replaced by a recorder: every entry call appended to the returned
    list as (name, args), returning the code in ``launches.returns`` for its name (0 if none); the
    device context a no-op and the current stream STREAM."""
    import contextlib
    import types

    class Calls(list):
        returns: dict

    calls = Calls()
    calls.returns = {}

    class Fake:
        def __getattr__(self, name):
            return lambda *args: calls.append((name, args)) or calls.returns.get(name, 0)

    monkeypatch.setattr(mx_gemm, "load_library", lambda: Fake())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=STREAM))
    return calls


#: the stream the recorded launches see
STREAM = 77


def test_launches_pass_the_stream_last_and_raise_on_a_cuda_error(launches):
    """Every entry point goes through one launch helper: the arguments in the C ABI's order, the
    current stream appended, and a non-zero return a KernelError naming the entry (and the form)."""
    from mokgen.errors import KernelError

    calls, returns = launches, launches.returns
    y, w, row = torch.zeros(6, 8), torch.ones(2, 3), torch.arange(6)
    mx_gemm.combine(y, row, w)
    name, args = calls[-1]
    assert name == "mokgen_mx_combine" and len(args) == 8 and args[4:] == (2, 3, 8, 77)
    a = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    b = torch.zeros(2, 128, 128, dtype=torch.float8_e4m3fn)
    sa, sb = torch.zeros(1, 256, 4, dtype=torch.uint8), torch.zeros(2, 1, 128, 4, dtype=torch.uint8)
    tiles, _ = mx_gemm.row_tiles([128, 128], "cpu")
    mx_gemm.mx_grouped_gemm(a, sa, b, sb, tiles, form="decoded")
    name, args = calls[-1]
    assert name == "mokgen_mx_grouped_gemm" and args[0] == mx_gemm.FORMS["decoded"]
    assert args[7:] == (2, 256, 128, 128, 2, 77)  # tiles, M, N, K, E, stream
    returns["mokgen_mx_grouped_gemm"] = 700
    with pytest.raises(KernelError, match=r"^mokgen_mx_grouped_gemm \(quad\) failed: CUDA error 700$"):
        mx_gemm.mx_grouped_gemm(a, sa, b, sb, tiles)
    returns["mokgen_mx_combine"] = 1
    with pytest.raises(KernelError, match=r"^mokgen_mx_combine failed: CUDA error 1$"):
        mx_gemm.combine(y, row, w)


def test_the_column_tiles_are_taken_only_where_they_apply(monkeypatch):
    """mx_gemm._cols_entry: the tiles' entry (v2) by default and under MOKGEN_MX_QUANT=v2, v1's
    under v1; v1's too past the tiles' grid (65535 CTAs of 128 rows in y, 65535 experts) and for a
    column count not a multiple of 8 bf16 (4 float32) or a base not 16-byte aligned (the same
    bits); any other value a one-line error."""
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    cols = "mokgen_mx_weight_cols"
    monkeypatch.delenv("MOKGEN_MX_QUANT", raising=False)
    assert mx_gemm._cols_entry(x, 1, 4, 64) == cols + "2"
    monkeypatch.setenv("MOKGEN_MX_QUANT", "v1")
    assert mx_gemm._cols_entry(x, 1, 4, 64) == cols
    monkeypatch.setenv("MOKGEN_MX_QUANT", "v2")
    assert mx_gemm._cols_entry(x, 1, 4, 64) == cols + "2"
    assert mx_gemm._cols_entry(x, 1, 4, 63) == cols  # odd n
    assert mx_gemm._cols_entry(x, 1, 4, 60) == cols  # even, but not whole 16-byte loads
    assert mx_gemm._cols_entry(x.view(-1)[1:], 1, 4, 64) == cols  # base one element off
    assert mx_gemm._cols_entry(x.view(-1)[4:], 1, 4, 64) == cols  # 8 bytes off
    assert mx_gemm._cols_entry(x.view(-1)[8:], 1, 4, 64) == cols + "2"  # 16 bytes off
    assert mx_gemm._cols_entry(x.float(), 1, 4, 60) == cols + "2"  # float32: 4 a load
    assert mx_gemm._cols_entry(x, 65535, 4, 64) == cols + "2"
    assert mx_gemm._cols_entry(x, 65536, 4, 64) == cols  # experts past gridDim.z
    assert mx_gemm._cols_entry(x, 1, 4 * 65535, 64) == cols + "2"
    assert mx_gemm._cols_entry(x, 1, 4 * 65535 + 1, 64) == cols  # 128-row tiles past gridDim.y
    monkeypatch.setenv("MOKGEN_MX_QUANT", "v3")
    from mokgen.errors import ToolchainError

    with pytest.raises(ToolchainError, match="^MOKGEN_MX_QUANT must be v2 or v1, got 'v3'$"):
        mx_gemm._cols_entry(x, 1, 4, 64)


def test_the_fused_backward_stages_check_their_operands_and_pass_them_in_order(launches):
    """combine_backward and swiglu_backward: one-line errors for bad operands before any launch,
    and the C entries' argument order (outputs, inputs, sizes, the source's form, stream) with
    the outputs shaped as documented; the pair-order form (the megakernel's saved bf16 rows, v0.64)
    passes its flag or pair array and takes the padded rows' count from the pairs."""
    calls = launches
    T, k, H, rows = 3, 2, 256, 128
    d_out, y = torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(rows, H)
    pair, w = torch.full((rows,), -1, dtype=torch.int32), torch.ones(T, k)
    dy, (codes, scales), d_w = mx_gemm.combine_backward(d_out, y, pair, w)
    name, args = calls[-1]
    assert name == "mokgen_mx_combine_backward" and len(args) == 13 and args[8:] == (rows, k, H, 0, STREAM)
    assert args[:4] == (dy.data_ptr(), codes.data_ptr(), scales.data_ptr(), d_w.data_ptr())
    assert dy.shape == (rows, H) and codes.shape == (rows, H) and scales.shape == (H // 128, rows, 4)
    assert d_w.shape == (T, k) and d_w.dtype == torch.float32
    y_pairs = torch.zeros(T * k, H, dtype=torch.bfloat16)  # by pair: [T k, H] bf16, rows from pair
    dy, _, _ = mx_gemm.combine_backward(d_out, y_pairs, pair, w)
    assert calls[-1][1][5] == y_pairs.data_ptr() and calls[-1][1][8:] == (rows, k, H, 1, STREAM)
    assert dy.shape == (rows, H)
    with pytest.raises(InputError, match=r"or bf16 \[T k, 256\]"):
        mx_gemm.combine_backward(d_out, y_pairs[:T * k - 1], pair, w)
    with pytest.raises(InputError, match=r"d_out must be contiguous bf16 \[3, H\] with H a multiple of 128"):
        mx_gemm.combine_backward(d_out.float(), y, pair, w)
    with pytest.raises(InputError, match=r"combine_backward: y float32 \[rows, 256\] or bf16 \[T k, 256\], pair"):
        mx_gemm.combine_backward(d_out, y[:, :128].contiguous(), pair, w)
    with pytest.raises(InputError, match=r"combine_backward: y float32"):
        mx_gemm.combine_backward(d_out, y, pair.long(), w)
    with pytest.raises(InputError, match=r"combine_backward: y float32"):  # d_out not 16-byte aligned
        mx_gemm.combine_backward(torch.zeros(T * H + 4, dtype=torch.bfloat16)[4:].view(T, H), y, pair, w)

    I = 128
    gu, dh = torch.zeros(rows, 2 * I), torch.zeros(rows, I)
    dg, du, h, (codes, scales) = mx_gemm.swiglu_backward(gu, dh, 7.0)
    name, args = calls[-1]
    assert name == "mokgen_mx_swiglu_backward" and len(args) == 12 and args[7:] == (None, rows, I, 7.0, STREAM)
    assert all(t.shape == (rows, I) for t in (dg, du, h)) and codes.shape == (rows, 2 * I)
    assert scales.shape == (2 * I // 128, rows, 4)
    assert mx_gemm.swiglu_backward(gu, dh)[0].shape == (rows, I) and calls[-1][1][10] == 0.0  # no clamp: limit 0
    gu_pairs = torch.zeros(T * k, 2 * I, dtype=torch.bfloat16)  # by pair: the rows' count is pair's
    dg, _, _, _ = mx_gemm.swiglu_backward(gu_pairs, dh, 7.0, pair)
    assert calls[-1][1][5] == gu_pairs.data_ptr() and calls[-1][1][7:] == (pair.data_ptr(), rows, I, 7.0, STREAM)
    assert dg.shape == (rows, I)
    with pytest.raises(InputError, match=r"gu \(by pair\) must be contiguous bf16 \[T k, 2 I\]"):
        mx_gemm.swiglu_backward(gu_pairs.float(), dh, 7.0, pair)
    with pytest.raises(InputError, match=r"pair must be contiguous int32 \[rows\]"):
        mx_gemm.swiglu_backward(gu_pairs, dh, 7.0, pair.long())
    with pytest.raises(InputError, match=r"gu must be contiguous float32 \[rows, 2 I\]"):
        mx_gemm.swiglu_backward(gu[:, :64].contiguous(), dh)
    with pytest.raises(InputError, match=r"dh must be contiguous float32 \[128, 128\]"):
        mx_gemm.swiglu_backward(gu, dh.t())
    with pytest.raises(InputError, match="clamp_limit must be positive, got -1"):
        mx_gemm.swiglu_backward(gu, dh, -1)
    # values_rows (v0.66): dg, du and h as bf16 MX values [out_rows, I] on their own entry
    block_out, out_end = torch.full((rows // 32,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    n = len(calls)
    for vr in ((block_out.long(), out_end, 96), (block_out[:3], out_end, 96), (block_out, out_end.long(), 96),
               (block_out, torch.zeros(2, dtype=torch.int32), 96), (block_out, out_end, 80)):
        with pytest.raises(InputError, match=r"swiglu_backward values_rows: rows a multiple of 128 \(128\)"):
            mx_gemm.swiglu_backward(gu, dh, 7.0, values_rows=vr)
    assert len(calls) == n
    dg, du, h, (codes, scales) = mx_gemm.swiglu_backward(gu_pairs, dh, 7.0, pair, values_rows=(block_out, out_end, 96))
    name, args = calls[-1]
    assert name == "mokgen_mx_swiglu_backward_values" and len(args) == 15
    assert args[:5] == (h.data_ptr(), dg.data_ptr(), du.data_ptr(), codes.data_ptr(), scales.data_ptr())
    assert args[5:] == (gu_pairs.data_ptr(), dh.data_ptr(), pair.data_ptr(), block_out.data_ptr(), out_end.data_ptr(),
                        rows, I, 96, 7.0, STREAM)
    assert all(t.shape == (96, I) and t.dtype == torch.bfloat16 for t in (dg, du, h))


def test_quantize_cols_blocked_takes_the_column_quantizer_with_codes_only(launches, monkeypatch):
    """quantize_cols_blocked (the weight gradients' A, v0.41): one-line errors before any launch,
    then the column quantizer's entry (the tiles by default, v1's under MOKGEN_MX_QUANT=v1 or for
    an odd n) with no bf16 values out, one expert, rows_out = rows at offset 0, the codes [n, rows]
    and the scales [rows / 128, n, 4]; nothing launched for an empty x."""
    calls = launches
    monkeypatch.delenv("MOKGEN_MX_QUANT", raising=False)
    with pytest.raises(InputError, match=r"rows a multiple of 128, got torch.float32 \(96, 64\)"):
        mx_gemm.quantize_cols_blocked(torch.zeros(96, 64))
    with pytest.raises(InputError, match="x must be contiguous float32 or bf16"):
        mx_gemm.quantize_cols_blocked(torch.zeros(128, 64, dtype=torch.float16))
    with pytest.raises(InputError, match="x must be contiguous float32 or bf16"):
        mx_gemm.quantize_cols_blocked(torch.zeros(64, 256).t())
    assert calls == []
    x = torch.zeros(256, 64)
    codes, scales = mx_gemm.quantize_cols_blocked(x)
    assert codes.shape == (64, 256) and codes.dtype == torch.float8_e4m3fn
    assert scales.shape == (2, 64, 4) and scales.dtype == torch.uint8
    assert calls[-1] == ("mokgen_mx_weight_cols2", (None, codes.data_ptr(), scales.data_ptr(), x.data_ptr(), 1, 256,
                                                    64, 256, 0, 1, STREAM))
    xb = torch.zeros(128, 63, dtype=torch.bfloat16)
    codes, scales = mx_gemm.quantize_cols_blocked(xb)  # odd n: v1's kernel
    assert calls[-1] == ("mokgen_mx_weight_cols", (None, codes.data_ptr(), scales.data_ptr(), xb.data_ptr(), 1, 128,
                                                   63, 128, 0, 0, STREAM))
    monkeypatch.setenv("MOKGEN_MX_QUANT", "v1")
    mx_gemm.quantize_cols_blocked(x)
    assert calls[-1][0] == "mokgen_mx_weight_cols"
    n = len(calls)
    codes, scales = mx_gemm.quantize_cols_blocked(torch.zeros(0, 64))
    assert len(calls) == n and codes.shape == (64, 0) and scales.shape == (0, 64, 4)


def test_cols_bf16_math_with_src_gathers_through_its_own_entry(launches, monkeypatch):
    """cols_bf16_math(x, src=...): one-line errors for a bad src before any launch, then
    mokgen_mx_gather_cols with the output [n, rows], the version MOKGEN_MX_QUANT picks (v2 by
    default, v1 where v2 does not apply: an odd n) and the stream last."""
    calls = launches
    monkeypatch.delenv("MOKGEN_MX_QUANT", raising=False)
    x, src = torch.zeros(10, 64, dtype=torch.bfloat16), torch.full((256,), -1, dtype=torch.int32)
    out = mx_gemm.cols_bf16_math(x, src=src)
    name, args = calls[-1]
    assert name == "mokgen_mx_gather_cols" and out.shape == (64, 256) and out.dtype == torch.bfloat16
    assert args == (out.data_ptr(), x.data_ptr(), src.data_ptr(), 256, 64, 0, 2, STREAM)
    monkeypatch.setenv("MOKGEN_MX_QUANT", "v1")
    mx_gemm.cols_bf16_math(x, src=src)
    assert calls[-1][1][5:7] == (0, 1)  # bf16, v1
    monkeypatch.setenv("MOKGEN_MX_QUANT", "v2")
    mx_gemm.cols_bf16_math(x.float(), src=src)
    assert calls[-1][1][5:7] == (1, 2)  # float32, v2
    mx_gemm.cols_bf16_math(torch.zeros(10, 63), src=src)
    assert calls[-1][1][6] == 1  # an odd n: v1
    for bad in (src.long(), src[:100], src.view(2, 128)):
        with pytest.raises(InputError, match=r"src must be contiguous int32 \[rows\] on cpu with rows a multiple of 128"):
            mx_gemm.cols_bf16_math(x, src=bad)


def test_the_grouped_bf16_math_gemm_writes_into_a_given_column_block(launches):
    """mx_bf16_math_grouped_gemm(..., out=...): C's memory a column block of a wider float32 matrix
    (mokgen_mx_bf16_math_grouped_gemm_ld with its row stride), checked in one line first."""
    calls = launches
    a = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    sa = torch.zeros(1, 256, 4, dtype=torch.uint8)
    b = torch.zeros(2, 256, 128, dtype=torch.bfloat16)
    tiles, _ = mx_gemm.row_tiles([128, 128], "cpu")
    gu = torch.zeros(256, 512)
    got = mx_gemm.mx_bf16_math_grouped_gemm(a, sa, b, tiles, out=gu[:, 256:])
    name, args = calls[-1]
    assert got.data_ptr() == gu[:, 256:].data_ptr()
    assert name == "mokgen_mx_bf16_math_grouped_gemm_ld" and args[:2] == (gu.data_ptr() + 256 * 4, 512)
    assert args[6:] == (2, 2, 256, 256, 128, STREAM)  # n_tiles, E, M, N, K, stream
    mx_gemm.mx_bf16_math_grouped_gemm(a, sa, b, tiles)
    assert calls[-1][0] == "mokgen_mx_bf16_math_grouped_gemm"
    for bad in (gu[:, 1:257], torch.zeros(256, 256, dtype=torch.float64), gu[:128, :256], gu.t()[:256, :256]):
        with pytest.raises(InputError, match=r"grouped bf16-math GEMM: out must be float32 \[256, 256\]"):
            mx_gemm.mx_bf16_math_grouped_gemm(a, sa, b, tiles, out=bad)


def test_the_ranged_gemm_switch_picks_the_entry(launches, monkeypatch):
    """MOKGEN_MX_RANGED picks the ranged GEMM's entry (the same arguments), and refuses other values."""
    from mokgen.errors import ToolchainError

    calls = launches
    # CPU tensors posing as CUDA ones (the wrapper checks the device, then allocates C there)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **kw: real_empty(*a, **kw))
    a = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    sa = torch.zeros(2, 128, 4, dtype=torch.uint8)
    b = torch.zeros(256, 256, dtype=torch.bfloat16)
    kr = torch.tensor([[0, 128], [128, 128]], dtype=torch.int32)
    mx_gemm.mx_bf16_math_ranged_gemm(a, sa, b, kr)
    assert calls[-1][0] == "mokgen_mx_bf16_math_ranged_gemm"
    monkeypatch.setenv("MOKGEN_MX_RANGED", "persistent")
    mx_gemm.mx_bf16_math_ranged_gemm(a, sa, b, kr)
    # the same arguments but C's pointer (each call allocates its own C)
    assert calls[-1][0] == "mokgen_mx_bf16_math_ranged_gemm_persistent" and calls[-1][1][1:] == calls[-2][1][1:]
    monkeypatch.setenv("MOKGEN_MX_RANGED", "fast")
    with pytest.raises(ToolchainError, match="MOKGEN_MX_RANGED must be tiles or persistent, got 'fast'"):
        mx_gemm.mx_bf16_math_ranged_gemm(a, sa, b, kr)


def test_expert_weights_both_launches_one_kernel_per_part(launches, monkeypatch):
    """expert_weights_both (MOKGEN_MX_WEIGHTS=both): a one-line error for what its kernel cannot
    take (here: tensors off the GPU), before any launch; else one launch per part, each writing its
    rows at its offset into both outputs, [E, sum n_i, K] and [E, K, sum n_i]."""
    calls = launches
    gate, up = torch.zeros(2, 64, 256, dtype=torch.bfloat16), torch.zeros(2, 64, 256, dtype=torch.bfloat16)
    assert not mx_gemm.both_applies([gate, up])  # on the CPU
    with pytest.raises(InputError, match=r"expert_weights_both takes contiguous, 16-byte aligned bf16"):
        mx_gemm.expert_weights_both([gate, up])
    assert calls == []
    monkeypatch.setattr(mx_gemm, "both_applies", lambda parts: True)
    rows, cols = mx_gemm.expert_weights_both([gate, up])
    assert rows.shape == (2, 128, 256) and cols.shape == (2, 256, 128) and rows.dtype == cols.dtype == torch.bfloat16
    assert calls == [("mokgen_mx_weight_both", (cols.data_ptr(), rows.data_ptr(), gate.data_ptr(), 2, 64, 256, 128, 0,
                                                STREAM)),
                     ("mokgen_mx_weight_both", (cols.data_ptr(), rows.data_ptr(), up.data_ptr(), 2, 64, 256, 128, 64,
                                                STREAM))]
    # apart (the MXFP8 layer's, v0.65): each part's rows in a tensor of its own ([E, n_i, K], rows
    # stride n_i from row 0), the columns stacked as before
    calls.clear()
    (rg, ru), cols = mx_gemm.expert_weights_both([gate, up], apart=True)
    assert rg.shape == ru.shape == (2, 64, 256) and cols.shape == (2, 256, 128)
    assert calls == [("mokgen_mx_weight_both_parts", (cols.data_ptr(), rg.data_ptr(), gate.data_ptr(), 2, 64, 256,
                                                      128, 0, 64, 0, STREAM)),
                     ("mokgen_mx_weight_both_parts", (cols.data_ptr(), ru.data_ptr(), up.data_ptr(), 2, 64, 256,
                                                      128, 64, 64, 0, STREAM))]


def test_band_switch_reaches_the_library_only_where_it_changes(launches, monkeypatch):
    """MOKGEN_MX_BAND: the default 8 (the library's own: no call), read at each bf16-math launch
    and passed on (mokgen_mx_set_band) only where it changed; a bad value is a one-line error
    before any launch."""
    from mokgen.errors import ToolchainError

    calls = launches
    lib = mx_gemm.load_library()  # one recorder throughout: the library is told per loaded library
    monkeypatch.setattr(mx_gemm, "load_library", lambda: lib)
    monkeypatch.setattr(mx_gemm, "_band_set", {})
    monkeypatch.delenv("MOKGEN_MX_BAND", raising=False)
    assert env.mx_band() == env.MX_BAND_DEFAULT == 8
    a = torch.zeros(256, 256, dtype=torch.uint8)
    sab = torch.zeros(2, 256, 4, dtype=torch.uint8)
    b = torch.zeros(2, 256, 256, dtype=torch.bfloat16)
    tiles = torch.tensor([[0, 0], [1, 128]], dtype=torch.int32)

    def run():
        calls.clear()
        mx_gemm.mx_bf16_math_grouped_gemm(a.view(torch.float8_e4m3fn), sab, b, tiles)
        return [name for name, _ in calls]

    assert run() == ["mokgen_mx_bf16_math_grouped_gemm"]
    monkeypatch.setenv("MOKGEN_MX_BAND", "1")
    assert run() == ["mokgen_mx_set_band", "mokgen_mx_bf16_math_grouped_gemm"]
    assert run() == ["mokgen_mx_bf16_math_grouped_gemm"]  # unchanged: no call
    monkeypatch.setenv("MOKGEN_MX_BAND", "0")
    with pytest.raises(ToolchainError, match="MOKGEN_MX_BAND must be an integer from 1 to 65535"):
        run()
    assert calls == []


def test_rows_values_checks_its_input_then_launches_once(launches):
    """mx_gemm.rows_values (MOKGEN_MX_WGRAD=bf16): a one-line error for what its kernel cannot take,
    before any launch; else one launch with the output's, x's and the gather's pointers, the rows
    (the gather's where given) and whether x is float32."""
    calls = launches
    x = torch.zeros(64, 256, dtype=torch.float32)
    for bad, match in ((torch.zeros(64, 256, dtype=torch.float16), "float32 or bf16"),
                       (torch.zeros(64, 6, dtype=torch.bfloat16), "n a multiple of 8"),
                       (torch.zeros(64, 12, dtype=torch.float32), "n a multiple of 8"),  # 16-byte output pieces
                       (torch.zeros(256, 64).t(), "contiguous"),
                       (torch.zeros(48, 256), "rows must be a multiple of 32, got 48")):
        with pytest.raises(InputError, match=match):
            mx_gemm.rows_values(bad)
    with pytest.raises(InputError, match="src must be contiguous int32"):
        mx_gemm.rows_values(x, torch.zeros(64, dtype=torch.int64))
    with pytest.raises(InputError, match="rows must be a multiple of 32, got 40"):
        mx_gemm.rows_values(x, torch.zeros(40, dtype=torch.int32))
    assert calls == []
    out = mx_gemm.rows_values(x)
    assert out.shape == (64, 256) and out.dtype == torch.bfloat16
    src = torch.full((96,), -1, dtype=torch.int32)
    got = mx_gemm.rows_values(x.to(torch.bfloat16), src)
    assert got.shape == (96, 256)
    assert [c[0] for c in calls] == ["mokgen_mx_rows_values"] * 2
    assert calls[0][1][1:] == (x.data_ptr(), None, 64, 256, 1, STREAM)
    assert calls[1][1][2:] == (src.data_ptr(), 96, 256, 0, STREAM)
    # scale (v0.66): float32 [rows] a row, with src and bf16 x, on its own entry
    xb, scale = x.to(torch.bfloat16), torch.ones(96, dtype=torch.float32)
    for args, match in (((x, src, scale), "with src and bf16 x"), ((xb, None, torch.ones(64)), "with src and bf16 x"),
                        ((xb, src, torch.ones(96, dtype=torch.float64)), "scale must be contiguous float32 \\[96\\]"),
                        ((xb, src, torch.ones(95)), "scale must be contiguous float32 \\[96\\]")):
        with pytest.raises(InputError, match=match):
            mx_gemm.rows_values(*args[:2], scale=args[2])
    assert len(calls) == 2
    got = mx_gemm.rows_values(xb, src, scale=scale)
    assert got.shape == (96, 256) and calls[2][0] == "mokgen_mx_scaled_rows_values"
    assert calls[2][1][1:] == (xb.data_ptr(), src.data_ptr(), scale.data_ptr(), 96, 256, STREAM)


def _round_block_emulated(bits: "torch.Tensor", ea: int, v68: bool = False) -> "torch.Tensor":
    """mx_round.cuh's round_block on int32 bf16 bit patterns of blocks whose amax has exponent field
    ea, instruction by instruction: ms = max.NaN.xorsign.abs(x & 0xff80, 2^(ea - 14)) (x's sign, the
    larger magnitude), x + 16 ms and then minus 16 ms in bf16 (two FMAs, rounded to nearest even;
    the second exact), min.xorsign.abs with 448 2^(ea - 135), x's sign bit or'ed in. v68: the
    rounding before v0.70 (M = 2^(max(ex, ea - 14) + 4) on 16-bit integers, added to and taken
    from |x|, the bound as a 16-bit minimum, the sign put back), which builds with
    -DMOKGEN_MX_ROUND_V68 still run."""
    as_float = lambda b: (b << 16).view(torch.float32)  # noqa: E731
    to_bits = lambda y: y.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF  # noqa: E731
    sign = bits & 0x8000
    if v68:
        a = bits & 0x7FFF
        m = torch.maximum((bits & 0x7F80) + 0x200, torch.full_like(bits, ((ea - 14) << 7) + 0x200))
        s = (as_float(a) + as_float(m)).to(torch.bfloat16).float()  # the bf16 addition, rounded once
        q = to_bits(s - as_float(m))  # exact
        return torch.minimum(q, torch.full_like(q, (ea << 7) | 0x60)) | sign
    t = as_float(torch.full_like(bits, (ea - 14) << 7))
    ms = torch.copysign(torch.maximum(as_float(bits & 0xFF80).abs(), t), as_float(sign))
    s1 = (as_float(bits) + 16.0 * ms).to(torch.bfloat16).float()  # the first FMA, rounded once
    s2 = (s1 - 16.0 * ms).to(torch.bfloat16).float()  # exact; a zero is +0
    sat = as_float(torch.full_like(bits, (ea << 7) | 0x60))
    return to_bits(torch.copysign(torch.minimum(s2.abs(), sat), s2)) | sign


@pytest.mark.parametrize("ea", [24, 25, 40, 112, 127, 134, 135, 136, 200, 249, 250])
def test_the_raw_kernels_integer_rounding_is_the_mx_quantizer(ea):
    """The raw-weights kernel's quantizer (mx_rawb.cuh round_block), emulated bit for bit, against
    mokgen.mx's quantizer then dequantizer, rounded to bf16, over every bf16 magnitude up to the
    block's largest (both signs; E4M3's normal range, its subnormal grid, values that round to zero,
    ties, and amax mantissas that saturate at 448)."""
    gen = torch.Generator().manual_seed(ea)
    for mant in (0x00, 0x5F, 0x68, 0x70, 0x7F):  # the amax's mantissa: 0x68 and up saturate
        amax = (ea << 7) | mant
        pool = torch.arange(0, amax + 1, dtype=torch.int32)  # every magnitude up to the amax
        pool = pool[torch.randperm(pool.numel(), generator=gen)]
        n = -(-pool.numel() // 31) * 31
        pool = torch.cat([pool, pool[: n - pool.numel()]]).view(-1, 31)
        pool = pool | (torch.randint(0, 2, pool.shape, generator=gen, dtype=torch.int32) << 15)  # signs
        blocks = torch.cat([torch.full((pool.shape[0], 1), amax, dtype=torch.int32), pool], dim=1)
        values = (blocks << 16).view(torch.float32)
        codes, scales = mx.quantize(values, dim=-1)
        assert (scales.int() == max(ea - 135, -127) + 127).all()
        want = mx.dequantize(codes, scales, dim=-1).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
        for v68 in (False, True):
            got = _round_block_emulated(blocks, ea, v68)
            bad = got != want
            assert not bad.any(), (v68, mant, blocks[bad][:4].tolist(), got[bad][:4].tolist(), want[bad][:4].tolist())


def _bf16m_pos(j: int) -> int:
    """mx_rows.cuh bf16m_pos: where k j of a 32-block sits in the bf16 MX weights' permuted order."""
    i, q = j & 3, (j >> 2) & 3
    return (j & 16) + 2 * q + (i & 1) + 8 * (i >> 1)


@pytest.mark.parametrize("rows", [256, 128])
def test_a_split_b_is_quantized_once_across_the_pair_without_bank_conflicts(rows):
    """mx_tile.cuh MxQuantBSplit (v0.70, -DMOKGEN_MX_RAWB_SPLIT): CTA crank's consumer thread ct
    (< rows, one block each) takes row crank rows / 2 + ct % (rows / 2), block ct // (rows / 2):
    over both CTAs every 32-block of the stage is quantized exactly once, each CTA only within the
    half its producer loaded (box crank: rows crank rows / 2 ..), and each 8-lane phase of a
    warp's 128-bit accesses touches 8 distinct 16-byte bank groups."""
    half = rows // 2
    seen = {}
    for crank in (0, 1):
        for ct in range(256):
            if ct >= rows:
                continue
            r, b = crank * half + ct % half, ct // half
            assert crank * half <= r < (crank + 1) * half and b in (0, 1)
            assert (r, b) not in seen, ((r, b), seen.get((r, b)), (crank, ct))
            seen[(r, b)] = (crank, ct)
        for warp in range(8):
            for c in range(4):
                for phase in range(4):
                    lanes = [32 * warp + lane for lane in range(8 * phase, 8 * phase + 8) if 32 * warp + lane < rows]
                    addrs = [(crank * half + ct % half) * 128 + (((4 * (ct // half) + c) ^ ((crank * half + ct % half) % 8)) << 4)
                             for ct in lanes]  # MxQuantB::block's address of chunk c
                    groups = {a // 16 % 8 for a in addrs}
                    assert len(groups) == len(lanes), (crank, warp, c, phase)
    assert set(seen) == {(r, b) for r in range(rows) for b in (0, 1)}


@pytest.mark.parametrize("rows", [256, 128])
def test_the_forward_tiles_quantizer_makes_a_stage_the_conversions_values(rows):
    """mx_tile.cuh MxQuantB (v0.68, MOKGEN_MX_FWD_WEIGHTS=raw), emulated on a stage's B as the TMA
    leaves it (rows x 64 bf16, SWIZZLE_128B): the 256 consumer threads' blocks (ct + 256 j) load
    and store every 16-byte slot of the stage exactly once, each 8-lane phase of a warp's 128-bit
    access touches 8 distinct 16-byte bank groups, and the stage ends up holding, row by row,
    what the values form's conversion writes (mx_rows.cuh weight_rows_kernel: each 32-block's MX
    values as bf16 at bf16m_pos), with round_block's integer rounding where the block's exponent
    field allows it and the conversion's arithmetic (mokgen.mx) elsewhere: a zero block, blocks
    below E8M0's fast range and one that saturates at 448."""
    from collections import Counter

    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(rows, 64, generator=gen) * torch.exp2(torch.randint(-30, 30, (rows, 2, 1), generator=gen)
                                                       .float()).repeat_interleave(32, dim=1).view(rows, 64)
    w[3, 32:] = 0.0  # a zero block: the exact path
    w[5, :32] = torch.randn(32, generator=gen) * 2.0**-112  # exponent fields below 24: the exact path
    w[7, 32:] = torch.linspace(-1.0, 1.9375, 32)  # amax mantissa 0x78: saturates at 448 2^s
    bits = w.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    stage = torch.zeros(rows * 64, dtype=torch.int32)  # the stage's bf16 slots, by byte address / 2
    for r in range(rows):
        for k in range(64):
            stage[(r * 128 + (((k // 8) ^ (r % 8)) << 4)) // 2 + k % 8] = bits[r, k]
    ref = w.to(torch.bfloat16).float().view(rows * 2, 32)
    codes, scales = mx.quantize(ref, dim=-1)
    exact = (mx.dequantize(codes, scales, dim=-1).to(torch.bfloat16).view(torch.int16).to(torch.int32)
             & 0xFFFF).view(rows, 2, 32)
    loads, stores, fast = Counter(), Counter(), 0
    out = stage.clone()
    for warp in range(8):
        for j in range(rows // 128):
            addrs = {}
            for lane in range(32):
                ct = 32 * warp + lane
                idx = ct + 256 * j
                r, b = idx % rows, idx // rows
                slot = [r * 128 + (((4 * b + c) ^ (r % 8)) << 4) for c in range(4)]
                addrs[lane] = slot
                vals = torch.cat([stage[a // 2: a // 2 + 8] for a in slot])  # the block's 32 k in order
                loads.update(slot)
                ea = int(vals.bitwise_and(0x7FFF).max()) >> 7
                if 24 <= ea <= 250:
                    q, fast = _round_block_emulated(vals, ea), fast + 1
                else:
                    q = exact[r, b]
                for s in range(2):  # word n of step s to position (n >> 1) + 4 (n & 1)
                    words = [q[16 * s + 2 * n: 16 * s + 2 * n + 2] for n in range(8)]
                    for half, picks in ((0, (0, 2, 4, 6)), (1, (1, 3, 5, 7))):
                        a = r * 128 + (((4 * b + 2 * s + half) ^ (r % 8)) << 4)
                        out[a // 2: a // 2 + 8] = torch.cat([words[n] for n in picks])
                        stores[a] += 1
            for c in range(4):  # 128-bit accesses go in phases of 8 lanes
                for phase in range(4):
                    groups = {(addrs[lane][c] // 16) % 8 for lane in range(8 * phase, 8 * phase + 8)}
                    assert len(groups) == 8, (warp, j, c, phase)
    every = set(range(0, rows * 128, 16))
    assert set(loads) == every and set(loads.values()) == {1}
    assert set(stores) == every and set(stores.values()) == {1}
    assert fast == 2 * rows - 2  # the two blocks above took the exact path, the rest round_block
    got = torch.zeros(rows, 64, dtype=torch.int32)
    for r in range(rows):
        for k in range(64):
            got[r, k] = out[(r * 128 + (((k // 8) ^ (r % 8)) << 4)) // 2 + k % 8]
    want = torch.zeros(rows, 64, dtype=torch.int32)
    for b in range(2):
        for jj in range(32):
            want[:, 32 * b + _bf16m_pos(jj)] = exact[:, b, jj]
    bad = (got != want).nonzero()
    assert bad.numel() == 0, bad[:4].tolist()


def test_the_raw_weights_gemm_checks_and_passes_its_operands(launches):
    """mx_bf16_math_raw_gemm: the C ABI's order (C or the combine's out, src, weight, A, its scales,
    the two parts (null for one), k0, the tiles, E, M, N, K, stream), each wrong operand refused in
    one line before any launch."""
    calls = launches
    a = torch.zeros(256, 384, dtype=torch.float8_e4m3fn)
    sa = torch.zeros(3, 256, 4, dtype=torch.uint8)
    g, u = torch.zeros(2, 256, 512, dtype=torch.bfloat16), torch.zeros(2, 128, 512, dtype=torch.bfloat16)
    tiles, _ = mx_gemm.row_tiles([128, 128], "cpu")
    c = mx_gemm.mx_bf16_math_raw_gemm(a, sa, [g, u], tiles)
    name, args = calls[-1]
    assert name == "mokgen_mx_bf16_math_raw_gemm" and c.shape == (256, 512) and c.dtype == torch.float32
    assert args == (c.data_ptr(), None, None, None, a.data_ptr(), sa.data_ptr(), g.data_ptr(), u.data_ptr(), 256,
                    tiles.data_ptr(), 2, 2, 256, 512, 384, STREAM)
    d = torch.zeros(2, 384, 512, dtype=torch.bfloat16)
    src, weight = torch.arange(256, dtype=torch.int32), torch.ones(256)
    out = mx_gemm.mx_bf16_math_raw_gemm(a, sa, [d], tiles, combine=(src, weight))
    name, args = calls[-1]
    assert out.shape == (256, 512) and out.dtype == torch.bfloat16
    assert args[:4] == (None, out.data_ptr(), src.data_ptr(), weight.data_ptr()) and args[7:9] == (None, 384)
    n = len(calls)
    for parts in ([g], [g.float(), u], [g[:, :, :384].contiguous(), u[:, :, :384].contiguous()], [g, u, u],
                  [torch.zeros(2, 352, 512, dtype=torch.bfloat16), torch.zeros(2, 32, 512, dtype=torch.bfloat16)]):
        with pytest.raises(InputError, match=r"^raw-weights GEMM: B must be one or two bf16 \[E, k_i, N\]"):
            mx_gemm.mx_bf16_math_raw_gemm(a, sa, parts, tiles)
    with pytest.raises(InputError, match="raw-weights GEMM: combine takes src int32"):
        mx_gemm.mx_bf16_math_raw_gemm(a, sa, [d], tiles, combine=(src.long(), weight))
    with pytest.raises(InputError, match="raw-weights GEMM: tiles must be int32"):
        mx_gemm.mx_bf16_math_raw_gemm(a, sa, [d], tiles.long())
    assert len(calls) == n
