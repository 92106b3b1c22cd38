"""MXFP8 GEMMs on the H200 (issue 6), dense and grouped over expert segments, and the quantizers
of the staged MXFP8 experts (``mokgen.mx_experts``). Two kinds of GEMM compute the same MX
product: the FP8 tensor core with the block scales promoted per 32-wide k step (below), and the
bf16-math form (A's codes decoded in registers, B as BF16 MX values; see its section further
down), the faster one on Hopper (653 against 382 TFLOP/s, docs/perf-notes.md v0.35).

``templates/mx_gemm.cu``: ``C = A B^T`` with A ``[M, K]`` and B ``[N, K]`` in MXFP8 as
:func:`mokgen.mx.quantize` makes them along K (E4M3 codes, one E8M0 scale per 32 consecutive k)
and C in float32. Each 32-wide k step is its own FP8 wgmma (QGMMA in SASS), promoted into the
float32 sum with the row's and the column's power-of-two scales, so the result is the exact MX
product up to the tensor core's rounding within 32 products and one float32 add per step (the
GPU test bounds it against the float64 oracle). A scale of 255 (NaN) makes its block's products
NaN. M, N and K must be multiples of 128. One library for every shape, compiled once into the
build cache (nvcc and the nvidia-cutlass headers), loaded with ctypes.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from mokgen import env
from mokgen.build import build_source, find_source_library
from mokgen.errors import InputError, KernelError

ARCH = "sm_90a"
SOURCE = "mx_gemm.cu"
LIBRARY = "libmxgemm.so"
#: M, N and K must be multiples of this
BLOCK = 128
#: the kernel's forms (``templates/mx_gemm.cu``), the same bits: ``quad`` (the default, 391-408
#: TFLOP/s on the H200, v0.34) has the producer warpgroup turn the E8M0 scales into float32 in
#: shared memory for four consumer warpgroups of 64 x 64; ``decoded`` the same producer for two
#: consumer warpgroups of 64 x 128 (331-345); ``inline`` has every consumer thread decode its own
#: scales (v0.33's form, 257-270). The slower forms are kept to measure against.
FORMS = {"inline": 0, "decoded": 1, "quad": 2}


def build_library(*, force: bool = False) -> Path:
    """Compile ``templates/mx_gemm.cu`` into the build cache once (or find it there): what a
    process that runs with MOKGEN_DISABLE_JIT=1 (the ranks of a multi-GPU run) loads."""
    return build_source(SOURCE, LIBRARY, cutlass=True, arch=ARCH, force=force)


_by_env: dict = {}


def load_library() -> ctypes.CDLL:
    """The library, built first if needed; found once per process and build cache directory."""
    key = tuple(os.environ.get(k) for k in ("MOKGEN_CACHE_DIR", "XDG_CACHE_HOME", "HOME"))
    lib = _by_env.get(key)
    if lib is None:
        path: Path = find_source_library(SOURCE, LIBRARY, cutlass=True, arch=ARCH, module=__name__)
        lib = bind_library(ctypes.CDLL(str(path)))
        _by_env[key] = lib
    return lib


def bind_library(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the entries' argument and return types on a loaded build of ``templates/mx_gemm.cu``
    (this tree's, or another tree's build of the same entries for an A/B: .ci/mx_lib_ab.py)."""
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.mokgen_mx_gemm_form.argtypes = [i, vp, vp, vp, vp, vp, i, i, i, vp]
    lib.mokgen_mx_gemm_form.restype = i
    lib.mokgen_mx_grouped_gemm.argtypes = [i, vp, vp, vp, vp, vp, vp, i, i, i, i, i, vp]
    lib.mokgen_mx_grouped_gemm.restype = i
    lib.mokgen_mx_quantize_rows.argtypes, lib.mokgen_mx_quantize_rows.restype = [vp, vp, vp, vp, i, i, vp], i
    lib.mokgen_mx_swiglu_quantize.argtypes = [vp, vp, vp, i, i, ctypes.c_float, vp]
    lib.mokgen_mx_swiglu_quantize.restype = i
    lib.mokgen_mx_combine.argtypes, lib.mokgen_mx_combine.restype = [vp, vp, vp, vp, i, i, i, vp], i
    lib.mokgen_mx_quantize_f32_rows.argtypes = [vp, vp, vp, i, i, vp]
    lib.mokgen_mx_quantize_f32_rows.restype = i
    lib.mokgen_mx_quantize_cols.argtypes, lib.mokgen_mx_quantize_cols.restype = [vp, vp, vp, i, i, i, vp], i
    lib.mokgen_mx_combine_backward.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, i, i, i, i, vp]
    lib.mokgen_mx_combine_backward.restype = i
    lib.mokgen_mx_swiglu_backward.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, i, i, ctypes.c_float, vp]
    lib.mokgen_mx_swiglu_backward.restype = i
    lib.mokgen_mx_bf16_math_gemm.argtypes = [vp, vp, vp, vp, i, i, i, vp]
    lib.mokgen_mx_bf16_math_gemm.restype = i
    lib.mokgen_mx_bf16_math_grouped_gemm.argtypes = [vp, vp, vp, vp, vp, i, i, i, i, i, vp]
    lib.mokgen_mx_bf16_math_grouped_gemm.restype = i
    lib.mokgen_mx_bf16_math_grouped_gemm_ld.argtypes = [vp, i, vp, vp, vp, vp, i, i, i, i, i, vp]
    lib.mokgen_mx_bf16_math_grouped_gemm_ld.restype = i
    lib.mokgen_mx_weight_rows.argtypes = [vp, vp, vp, vp, i, i, i, i, i, i, vp]
    lib.mokgen_mx_weight_rows.restype = i
    lib.mokgen_mx_bf16_math_swiglu_gemm.argtypes = [vp, vp, vp, vp, vp, vp, i, i, i, i, i, ctypes.c_float, vp]
    lib.mokgen_mx_bf16_math_swiglu_gemm.restype = i
    lib.mokgen_mx_bf16_math_combine1_gemm.argtypes = [vp, vp, vp, vp, vp, vp, vp, i, i, i, i, i, vp]
    lib.mokgen_mx_bf16_math_combine1_gemm.restype = i
    lib.mokgen_mx_tile_test.argtypes = [i, vp, vp, vp, vp, vp, vp, vp, ctypes.c_float, i, i, vp]
    lib.mokgen_mx_tile_test.restype = i
    lib.mokgen_mx_weight_cols.argtypes = [vp, vp, vp, vp, i, i, i, i, i, i, vp]
    lib.mokgen_mx_weight_cols.restype = i
    lib.mokgen_mx_weight_cols2.argtypes = [vp, vp, vp, vp, i, i, i, i, i, i, vp]  # MOKGEN_MX_QUANT=v2
    lib.mokgen_mx_weight_cols2.restype = i
    lib.mokgen_mx_gather_cols.argtypes, lib.mokgen_mx_gather_cols.restype = [vp, vp, vp, i, i, i, i, vp], i
    if hasattr(lib, "mokgen_mx_set_band"):  # v0.43 (MOKGEN_MX_BAND)
        lib.mokgen_mx_set_band.argtypes, lib.mokgen_mx_set_band.restype = [i], None
    if hasattr(lib, "mokgen_mx_weight_both"):  # v0.43 (MOKGEN_MX_WEIGHTS=both); older builds for A/Bs lack it
        lib.mokgen_mx_weight_both.argtypes, lib.mokgen_mx_weight_both.restype = [vp, vp, vp, i, i, i, i, i, vp], i
    if hasattr(lib, "mokgen_mx_rows_values"):  # v0.65 (MOKGEN_MX_WGRAD=bf16)
        lib.mokgen_mx_rows_values.argtypes, lib.mokgen_mx_rows_values.restype = [vp, vp, vp, i, i, i, vp], i
    if hasattr(lib, "mokgen_mx_swiglu_backward_values"):  # v0.66 (dg, du and h as MX values along the rows)
        lib.mokgen_mx_swiglu_backward_values.argtypes = [vp] * 10 + [i, i, i, ctypes.c_float, vp]
        lib.mokgen_mx_swiglu_backward_values.restype = i
    if hasattr(lib, "mokgen_mx_scaled_rows_values"):  # v0.66 (dy's values from dOut and the routing weights)
        lib.mokgen_mx_scaled_rows_values.argtypes = [vp, vp, vp, vp, i, i, vp]
        lib.mokgen_mx_scaled_rows_values.restype = i
    if hasattr(lib, "mokgen_mx_weight_both_parts"):  # v0.65 (the MXFP8 layer's conversions under both)
        lib.mokgen_mx_weight_both_parts.argtypes = [vp, vp, vp, i, i, i, i, i, i, i, vp]
        lib.mokgen_mx_weight_both_parts.restype = i
    if hasattr(lib, "mokgen_mx_bf16_math_raw_gemm"):  # v0.67 (MOKGEN_MX_DGRAD_WEIGHTS=raw)
        lib.mokgen_mx_bf16_math_raw_gemm.argtypes = [vp] * 8 + [i, vp, i, i, i, i, i, vp]
        lib.mokgen_mx_bf16_math_raw_gemm.restype = i
    lib.mokgen_mx_bf16_math_ranged_gemm.argtypes = [vp, vp, vp, vp, vp, i, i, i, i, i, vp]
    lib.mokgen_mx_bf16_math_ranged_gemm.restype = i
    lib.mokgen_mx_bf16_math_ranged_gemm_persistent.argtypes = lib.mokgen_mx_bf16_math_ranged_gemm.argtypes
    lib.mokgen_mx_bf16_math_ranged_gemm_persistent.restype = i
    lib.mokgen_mx_segments.argtypes, lib.mokgen_mx_segments.restype = [vp, vp, vp, vp, vp, vp, i, i, i, i, vp], i
    return lib


def _form(form: str) -> int:
    if form not in FORMS:
        raise InputError(f"form must be one of {sorted(FORMS)}, got {form!r}")
    return FORMS[form]


def _launch(entry: str, device, *args, what: str = "") -> None:
    """``entry(*args, stream)`` of the library on ``device``'s current stream; a non-zero CUDA error
    code raises KernelError naming the entry (and ``what``)."""
    import torch

    with torch.cuda.device(device):
        lib = load_library()
        if entry.startswith("mokgen_mx_bf16_math"):
            _sync_band(lib)
        code = getattr(lib, entry)(*args, torch.cuda.current_stream().cuda_stream)
    if code:
        raise KernelError(f"{entry}{f' ({what})' if what else ''} failed: CUDA error {code}")


#: the MOKGEN_MX_BAND value each loaded library was last told (mokgen_mx_set_band), by id
_band_set: dict = {}


def _sync_band(lib) -> None:
    """Tell ``lib`` MOKGEN_MX_BAND (read at every bf16-math launch) where it changed: the grouped
    launches' tile order. The same bits."""
    band = env.mx_band()
    if _band_set.get(id(lib), env.MX_BAND_DEFAULT) != band and hasattr(lib, "mokgen_mx_set_band"):
        lib.mokgen_mx_set_band(band)
        _band_set[id(lib)] = band


def _check(name: str, codes, scales, k: int | None = None) -> tuple[int, int]:
    import torch

    if not isinstance(codes, torch.Tensor) or codes.dtype not in (torch.float8_e4m3fn, torch.uint8) \
            or codes.dim() != 2 or not codes.is_contiguous():
        raise InputError(f"{name} codes must be a contiguous 2-d float8_e4m3fn (or uint8) tensor")
    if codes.device.type != "cuda":
        raise InputError(f"{name} codes must be on a CUDA device, got {codes.device}")
    rows, cols = codes.shape
    if rows % BLOCK or cols % BLOCK or rows == 0 or cols == 0:
        raise InputError(f"{name} codes must be [rows, K] with rows and K positive multiples of {BLOCK}, "
                         f"got {tuple(codes.shape)}")
    if k is not None and cols != k:
        raise InputError(f"{name} codes have K = {cols}, the other operand {k}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or tuple(scales.shape) != (rows, cols // 32) \
            or not scales.is_contiguous() or scales.device != codes.device:
        raise InputError(f"{name} scales must be a contiguous uint8 tensor of shape {(rows, cols // 32)} on "
                         f"{codes.device} (E8M0, one per 32 k)")
    return rows, cols


def block_scales(scales):
    """``mx.quantize``'s scales ``[rows, K / 32]`` in the kernel's layout ``[K / 128, rows, 4]``: a
    k-block's four scales of consecutive rows side by side (one bulk copy per tile and k-block)."""
    rows, ks = scales.shape
    return scales.view(rows, ks // 4, 4).transpose(0, 1).contiguous()


def mx_gemm(a_codes, a_scales, b_codes, b_scales, *, form: str = "quad"):
    """``A B^T`` in float32 for MXFP8 operands quantized along K (``mokgen.mx.quantize(x, dim=-1)``):
    A ``[M, K]``, B ``[N, K]``, their scales ``[M, K / 32]`` and ``[N, K / 32]`` (re-laid out by
    :func:`block_scales` for the kernel, a pass over 1/32 of the codes' bytes). ``form`` picks the
    kernel's form (:data:`FORMS`; all give the same bits)."""
    import torch

    form_id = _form(form)
    M, K = _check("A", a_codes, a_scales)
    N, _ = _check("B", b_codes, b_scales, K)
    if b_codes.device != a_codes.device:
        raise InputError(f"A and B must be on one device, got {a_codes.device} and {b_codes.device}")
    out = torch.empty(M, N, dtype=torch.float32, device=a_codes.device)
    sa, sb = block_scales(a_scales), block_scales(b_scales)
    _launch("mokgen_mx_gemm_form", a_codes.device, form_id, out.data_ptr(), a_codes.data_ptr(), sa.data_ptr(),
            b_codes.data_ptr(), sb.data_ptr(), M, N, K, what=form)
    return out


def block_expert_scales(scales):
    """Expert weights' scales ``[E, N, K / 32]`` (``mx.quantize_experts``) in the grouped kernel's
    layout ``[E, K / 128, N, 4]``: each expert's block as :func:`block_scales` lays out one
    matrix."""
    experts, rows, ks = scales.shape
    return scales.view(experts, rows, ks // 4, 4).transpose(1, 2).contiguous()


def _check_tiles(tiles, device, what: str) -> None:
    """A grouped launch's tile list: int32 ``[n, 2]`` of (expert, first row) on ``device``, at most
    65535 entries (the launch grid's y dimension)."""
    import torch

    if tiles.dtype != torch.int32 or tiles.dim() != 2 or tiles.shape[1] != 2 or tiles.device != device \
            or tiles.shape[0] > 65535:
        raise InputError(f"{what}: tiles must be int32 [n, 2] (n <= 65535) on the operands' device (row_tiles)")


def row_tiles(padded_counts, device) -> tuple:
    """The grouped launch's row tiles for segments of ``padded_counts[e]`` rows (multiples of
    128, expert e's segment after expert e - 1's): ``(tiles int32 [n, 2] of (expert, first row)
    on device, n)``."""
    import torch

    counts = torch.as_tensor(padded_counts, dtype=torch.int64).cpu()
    if (counts % BLOCK).any() or (counts < 0).any():
        raise InputError(f"segment rows must be non-negative multiples of {BLOCK}, got {counts.tolist()}")
    per = counts // BLOCK  # tiles per expert
    n = int(per.sum())
    experts = torch.repeat_interleave(torch.arange(len(counts)), per)
    tile_in_expert = torch.arange(n) - (torch.cumsum(per, 0) - per)[experts]
    first = (torch.cumsum(counts, 0) - counts)[experts] + BLOCK * tile_in_expert
    return torch.stack([experts, first], 1).to(torch.int32).to(device), n


def mx_grouped_gemm(a_codes, a_scales_blocked, b_codes, b_scales_blocked, tiles, *, form: str = "quad"):
    """Per-expert ``A B_e^T`` in float32 over row segments of whole 128-row tiles: A ``[M, K]``
    codes with its scales already in the blocked layout (``block_scales``), B ``[E, N, K]`` codes
    with ``block_expert_scales``' layout, ``tiles`` from :func:`row_tiles`. Returns C ``[M, N]``;
    rows outside every tile are not written (uninitialized)."""
    import torch

    form_id = _form(form)
    M, K = a_codes.shape
    E, N, Kb = b_codes.shape
    if Kb != K or M % BLOCK or N % BLOCK or K % BLOCK:
        raise InputError(f"grouped MX GEMM: A {tuple(a_codes.shape)}, B {tuple(b_codes.shape)}: K must match and "
                         f"M, N, K be multiples of {BLOCK}")
    if tuple(a_scales_blocked.shape) != (K // BLOCK, M, 4) or tuple(b_scales_blocked.shape) != (E, K // BLOCK, N, 4):
        raise InputError("grouped MX GEMM: scales not in the blocked layouts (block_scales, block_expert_scales)")
    _check_tiles(tiles, a_codes.device, "grouped MX GEMM")
    c = torch.empty(M, N, dtype=torch.float32, device=a_codes.device)
    if tiles.shape[0] == 0:
        return c
    _launch("mokgen_mx_grouped_gemm", a_codes.device, form_id, c.data_ptr(), a_codes.data_ptr(),
            a_scales_blocked.data_ptr(), b_codes.data_ptr(), b_scales_blocked.data_ptr(), tiles.data_ptr(),
            int(tiles.shape[0]), M, N, K, E, what=form)
    return c


def quantize_rows(x, src, rows: int):
    """MXFP8 along H of ``rows`` rows: row r is ``x[src[r]]`` (``x`` bf16 ``[*, H]``, ``src`` int32
    on its device), zeros where ``src[r] < 0``. Returns ``(codes float8_e4m3fn [rows, H], scales
    uint8 [H / 128, rows, 4])``, the scales in the GEMM's blocked layout; the same bits as
    ``block_scales(mx.quantize(rows of x))``."""
    import torch

    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] % BLOCK:
        raise InputError(f"x must be contiguous bf16 [T, H] with H a multiple of {BLOCK}, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if src.dtype != torch.int32 or src.shape != (rows,) or src.device != x.device:
        raise InputError(f"src must be int32 [{rows}] on {x.device}")
    H = x.shape[1]
    codes = torch.empty(rows, H, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(H // BLOCK, rows, 4, dtype=torch.uint8, device=x.device)
    _launch("mokgen_mx_quantize_rows", x.device, codes.data_ptr(), scales.data_ptr(), x.data_ptr(), src.data_ptr(),
            rows, H)
    return codes, scales


def swiglu_quantize(gu, clamp_limit: float | None = None):
    """``h = swiglu(gate, up)`` of float32 rows ``gu [rows, 2 I]`` (gate columns first; the
    megakernel's SwiGLU, fast division), quantized to MXFP8 along I: ``(codes [rows, I], scales
    [I / 128, rows, 4])``."""
    import torch

    if gu.dtype != torch.float32 or gu.dim() != 2 or not gu.is_contiguous() or gu.shape[1] % (2 * BLOCK):
        raise InputError(f"gu must be contiguous float32 [rows, 2 I] with I a multiple of {BLOCK}, got {gu.dtype} "
                         f"{tuple(gu.shape)}")
    rows, inter = gu.shape[0], gu.shape[1] // 2
    limit = 0.0 if clamp_limit is None else float(clamp_limit)
    if clamp_limit is not None and not limit > 0:
        raise InputError(f"clamp_limit must be positive, got {clamp_limit}")
    codes = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=gu.device)
    scales = torch.empty(inter // BLOCK, rows, 4, dtype=torch.uint8, device=gu.device)
    _launch("mokgen_mx_swiglu_quantize", gu.device, codes.data_ptr(), scales.data_ptr(), gu.data_ptr(), rows, inter,
            limit)
    return codes, scales


def combine(y, row, weights):
    """``out[t] = sum_j weights[t, j] * y[row[t k + j]]`` in float32, j = 0..k-1 in order, each
    product and sum rounded on its own (the bits of that PyTorch expression), then bf16:
    ``y`` float32 ``[*, H]``, ``row`` int64 ``[T k]``, ``weights`` float32 ``[T, k]``."""
    import torch

    T, k = weights.shape
    H = y.shape[1]
    if y.dtype != torch.float32 or not y.is_contiguous() or H % 4 or row.dtype != torch.int64 \
            or row.shape != (T * k,) or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise InputError("combine: y float32 [*, H] (H a multiple of 4), row int64 [T k], weights float32 [T, k]")
    out = torch.empty(T, H, dtype=torch.bfloat16, device=y.device)
    _launch("mokgen_mx_combine", y.device, out.data_ptr(), y.data_ptr(), row.data_ptr(), weights.data_ptr(), T, k,
            H)
    return out


def quantize_f32_rows(x):
    """MXFP8 of float32 rows ``x [rows, K]`` along K: ``(codes [rows, K], scales [K / 128, rows,
    4])``, the scales blocked; the bits of ``mx.quantize(x, dim=-1)``."""
    import torch

    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] % BLOCK:
        raise InputError(f"x must be contiguous float32 [rows, K] with K a multiple of {BLOCK}, got {x.dtype} "
                         f"{tuple(x.shape)}")
    rows, k = x.shape
    codes = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(k // BLOCK, rows, 4, dtype=torch.uint8, device=x.device)
    _launch("mokgen_mx_quantize_f32_rows", x.device, codes.data_ptr(), scales.data_ptr(), x.data_ptr(), rows, k)
    return codes, scales


def quantize_cols(x):
    """MXFP8 of ``x [rows, n]`` (float32 or bf16) along its rows, transposed: ``(codes [n, rows],
    scales [n, rows / 32])``, the bits of ``mx.quantize(x.t(), dim=-1)`` (rows a multiple of 32)."""
    import torch

    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or not x.is_contiguous() or x.shape[0] % 32:
        raise InputError(f"x must be contiguous float32 or bf16 [rows, n] with rows a multiple of 32, got {x.dtype} "
                         f"{tuple(x.shape)}")
    rows, n = x.shape
    codes = torch.empty(n, rows, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(n, rows // 32, dtype=torch.uint8, device=x.device)
    _launch("mokgen_mx_quantize_cols", x.device, codes.data_ptr(), scales.data_ptr(), x.data_ptr(),
            int(x.dtype == torch.bfloat16), rows, n)
    return codes, scales


def quantize_cols_blocked(x):
    """:func:`quantize_cols` with its scales in the kernel's layout, in one pass: ``(codes [n,
    rows], scales [rows / 128, n, 4])``, the bits of ``quantize_cols(x)``'s codes and of
    :func:`block_scales` of its scales (the weight gradients' A operand, v0.41). The column
    quantizer of the weights (:func:`_cols_entry`: its tiles by default) with no bf16 values out.
    ``x [rows, n]`` float32 or bf16, rows a multiple of 128."""
    import torch

    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or not x.is_contiguous() \
            or x.shape[0] % BLOCK:
        raise InputError(f"x must be contiguous float32 or bf16 [rows, n] with rows a multiple of {BLOCK}, got "
                         f"{x.dtype} {tuple(x.shape)}")
    rows, n = x.shape
    codes = torch.empty(n, rows, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows // BLOCK, n, 4, dtype=torch.uint8, device=x.device)
    if rows and n:
        _launch(_cols_entry(x, 1, rows // 32, n), x.device, None, codes.data_ptr(), scales.data_ptr(), x.data_ptr(),
                1, rows, n, rows, 0, int(x.dtype == torch.float32))
    return codes, scales


def combine_backward(d_out, y, pair, weights, keep_dy: bool = True):
    """The combine's backward in one pass (the MXFP8 backward's, ``mx_experts``): for each padded
    row r with pair ``p = pair[r]`` (int32 ``[rows]``, -1 for a padding row) of ``weights``
    (float32 ``[T, k]``), ``dy[r] = weights[p] * d_out[p // k]`` in float32 (zeros for padding: the
    bits of that PyTorch product), dy quantized along H (``quantize_f32_rows``' bits) and
    ``d_w[p] = <d_out[p // k], y_p>`` (float32, summed in a fixed order, not PyTorch's). ``d_out``
    bf16 ``[T, H]``; ``y`` float32 ``[rows, H]`` in the padded layout (``y_p = y[r]``), or bf16
    ``[T k, H]`` in pair order (``y_p = y[p]``: the megakernel's combine slots, the same bits as
    their float32 copy in the padded layout). Returns ``(dy, (codes, scales), d_w [T, k])``;
    ``keep_dy`` False (v0.66): dy's float32 rows are not written, and dy is None (the weight
    gradients then make dy's values from d_out: :func:`rows_values` with ``scale``)."""
    import torch

    T, k = weights.shape
    rows = pair.shape[0] if pair.dim() == 1 else -1
    if d_out.dtype != torch.bfloat16 or d_out.dim() != 2 or d_out.shape[0] != T or not d_out.is_contiguous() \
            or d_out.shape[1] % BLOCK:
        raise InputError(f"d_out must be contiguous bf16 [{T}, H] with H a multiple of {BLOCK}, got {d_out.dtype} "
                         f"{tuple(d_out.shape)}")
    H = d_out.shape[1]
    by_pair = y.dtype == torch.bfloat16
    y_rows = T * k if by_pair else rows
    if y.dtype not in (torch.float32, torch.bfloat16) or y.shape != (y_rows, H) or not y.is_contiguous() \
            or pair.dtype != torch.int32 or not pair.is_contiguous() or weights.dtype != torch.float32 \
            or not weights.is_contiguous() or any(t.device != y.device for t in (d_out, pair, weights)) \
            or d_out.data_ptr() % 16 or y.data_ptr() % 16:
        raise InputError(f"combine_backward: y float32 [rows, {H}] or bf16 [T k, {H}], pair int32 [rows], weights "
                         f"float32 [T, k], all contiguous on one device (d_out and y 16-byte aligned), got {y.dtype} "
                         f"{tuple(y.shape)}, {pair.dtype} {tuple(pair.shape)}, {weights.dtype}")
    dy = torch.empty(rows, H, dtype=torch.float32, device=y.device) if keep_dy else None
    codes = torch.empty(rows, H, dtype=torch.float8_e4m3fn, device=y.device)
    scales = torch.empty(H // BLOCK, rows, 4, dtype=torch.uint8, device=y.device)
    d_w = torch.zeros(T, k, dtype=torch.float32, device=y.device)  # pairs without a row stay 0 (none in a segment list)
    _launch("mokgen_mx_combine_backward", y.device, None if dy is None else dy.data_ptr(), codes.data_ptr(),
            scales.data_ptr(), d_w.data_ptr(), d_out.data_ptr(), y.data_ptr(), pair.data_ptr(), weights.data_ptr(), rows, k, H,
            int(by_pair))
    return dy, (codes, scales), d_w


def swiglu_backward(gu, dh, clamp_limit: float | None = None, pair=None, values_rows=None):
    """SwiGLU's backward in one pass (the MXFP8 backward's): from the float32 gate | up rows ``gu
    [rows, 2 I]`` and ``dh [rows, I]``, PyTorch's expressions of ``reference.swiglu`` under
    autograd (each operation rounded on its own: within an ulp or two of PyTorch's kernels, whose
    contractions are theirs) -> ``(dg, du, h)`` float32 ``[rows, I]`` each and ``[dg | du]``
    quantized along 2 I ``(codes [rows, 2 I], scales [2 I / 128, rows, 4])`` (the bits of
    ``quantize_f32_rows`` of ``cat([dg, du], 1)``). With ``pair`` (int32 ``[rows]``, each padded
    row's pair, -1 for padding), ``gu`` is bf16 ``[T k, 2 I]`` in pair order instead (the
    megakernel's saved rows): row r reads ``gu[pair[r]]`` (zeros for padding), the same bits as
    its float32 copy in the padded layout. ``values_rows`` (v0.66): ``(block_out, out_end,
    out_rows)``, and then dg, du and h come back as their MX values along the rows, bf16 ``[out_rows,
    I]`` each (:func:`rows_values`' bits), with no float32 copy written: the padded rows' 32-row
    block b (rows a multiple of 128 here) goes to block ``block_out[b]`` of the output (int32
    ``[rows / 32]``; -1: nowhere), and the output's rows from ``out_end`` (an int32 tensor of one
    element, on the device) to ``out_rows`` (a multiple of 32) are zeros. The MXFP8 backward's
    weight gradients on the BF16 weight kernels (mx_experts._rows32's layout)."""
    import torch

    if pair is not None:
        if gu.dtype != torch.bfloat16 or gu.dim() != 2 or not gu.is_contiguous() or gu.shape[1] % (2 * BLOCK) \
                or gu.data_ptr() % 16:
            raise InputError(f"gu (by pair) must be contiguous bf16 [T k, 2 I] with I a multiple of {BLOCK}, got "
                             f"{gu.dtype} {tuple(gu.shape)}")
        if pair.dtype != torch.int32 or pair.dim() != 1 or not pair.is_contiguous() or pair.device != gu.device:
            raise InputError(f"pair must be contiguous int32 [rows] on gu's device, got {pair.dtype} "
                             f"{tuple(pair.shape)}")
        rows, inter = pair.shape[0], gu.shape[1] // 2
    elif gu.dtype != torch.float32 or gu.dim() != 2 or not gu.is_contiguous() or gu.shape[1] % (2 * BLOCK):
        raise InputError(f"gu must be contiguous float32 [rows, 2 I] with I a multiple of {BLOCK}, got {gu.dtype} "
                         f"{tuple(gu.shape)}")
    else:
        rows, inter = gu.shape[0], gu.shape[1] // 2
    if dh.dtype != torch.float32 or dh.shape != (rows, inter) or not dh.is_contiguous() or dh.device != gu.device \
            or gu.data_ptr() % 16 or dh.data_ptr() % 16:
        raise InputError(f"dh must be contiguous float32 [{rows}, {inter}] on gu's device (both 16-byte aligned), got "
                         f"{dh.dtype} {tuple(dh.shape)}")
    limit = 0.0 if clamp_limit is None else float(clamp_limit)
    if clamp_limit is not None and not limit > 0:
        raise InputError(f"clamp_limit must be positive, got {clamp_limit}")
    codes = torch.empty(rows, 2 * inter, dtype=torch.float8_e4m3fn, device=gu.device)
    scales = torch.empty(2 * inter // BLOCK, rows, 4, dtype=torch.uint8, device=gu.device)
    if values_rows is not None:
        block_out, out_end, out_rows = values_rows
        if rows % BLOCK or block_out.dtype != torch.int32 or tuple(block_out.shape) != (rows // 32,) \
                or not block_out.is_contiguous() or out_end.dtype != torch.int32 or out_end.numel() != 1 \
                or out_rows < 0 or out_rows % 32 or any(t.device != gu.device for t in (block_out, out_end)):
            raise InputError(f"swiglu_backward values_rows: rows a multiple of {BLOCK} ({rows}), block_out int32 "
                             f"[{rows // 32}], out_end int32 of one element, out_rows a multiple of 32 ({out_rows}), "
                             f"on gu's device")
        h, dg, du = (torch.empty(out_rows, inter, dtype=torch.bfloat16, device=gu.device) for _ in range(3))
        _launch("mokgen_mx_swiglu_backward_values", gu.device, h.data_ptr(), dg.data_ptr(), du.data_ptr(),
                codes.data_ptr(), scales.data_ptr(), gu.data_ptr(), dh.data_ptr(),
                None if pair is None else pair.data_ptr(), block_out.data_ptr(), out_end.data_ptr(), rows, inter,
                out_rows, limit)
        return dg, du, h, (codes, scales)
    dg, du, h = (torch.empty(rows, inter, dtype=torch.float32, device=gu.device) for _ in range(3))
    _launch("mokgen_mx_swiglu_backward", gu.device, dg.data_ptr(), du.data_ptr(), h.data_ptr(), codes.data_ptr(),
            scales.data_ptr(), gu.data_ptr(), dh.data_ptr(), None if pair is None else pair.data_ptr(), rows, inter,
            limit)
    return dg, du, h, (codes, scales)


# ---- the bf16-math form (docs/architecture.md "Which MXFP8 next"; v0.35: 653 TFLOP/s against quad's
# 382 on the H200): A MXFP8 decoded into BF16 register fragments, B as BF16 MX values in shared
# memory, the BF16 tensor core (HGMMA with A from registers); the exact MX product, its sums
# float32 with no promotion. B's k order is permuted within each 16 to match A's fragments.

#: N must be a multiple of this for the bf16-math GEMMs (their tile is 128 x 256)
BF16_MATH_N = 256


def bf16_math_weights(b_codes, b_scales):
    """MXFP8 ``B [N, K]`` decoded exactly to bf16 (``mx.dequantize``; exact unless a scale is near
    2^-127 or 2^127) with its k order permuted within each 16 as the bf16-math GEMM's register
    fragments read A: position ``2q + (i & 1) + 8 (i >> 1)`` holds k ``4q + i``. PyTorch
    operations (any device): the reference for :func:`expert_weights`' kernels."""
    import torch

    from mokgen import mx

    N, K = b_codes.shape
    values = mx.dequantize(b_codes, b_scales, dim=-1, out_dtype=torch.float32).to(torch.bfloat16)
    L = torch.arange(16)
    q, i = (L % 8) // 2, (L % 2) + 2 * (L // 8)
    idx = (torch.arange(K // 16)[:, None] * 16 + (4 * q + i)[None, :]).reshape(-1).to(b_codes.device)
    return values[:, idx].contiguous()


def _check_blocked_a(a_codes, a_scales_blocked, what: str) -> tuple[int, int]:
    """``(M, K)`` of an MXFP8 A operand with blocked scales ``[K / 128, M, 4]`` (M and K multiples
    of BLOCK), or InputError naming ``what``."""
    M, K = a_codes.shape
    if M % BLOCK or K % BLOCK or tuple(a_scales_blocked.shape) != (K // BLOCK, M, 4):
        raise InputError(f"{what}: A {tuple(a_codes.shape)} must have M, K multiples of {BLOCK} "
                         f"and blocked scales [K / 128, M, 4]")
    return M, K


def _check_bf16_b(b_bf16, K: int, stacked: bool):
    import torch

    want = 3 if stacked else 2
    if b_bf16.dtype != torch.bfloat16 or b_bf16.dim() != want or b_bf16.shape[-1] != K \
            or b_bf16.shape[-2] % BF16_MATH_N or not b_bf16.is_contiguous():
        shape = "[E, N, K]" if stacked else "[N, K]"
        raise InputError(f"B must be contiguous bf16 {shape} with K = {K} and N a multiple of {BF16_MATH_N} "
                         f"(bf16_math_weights / expert_weights), got {b_bf16.dtype} {tuple(b_bf16.shape)}")


def mx_bf16_math_gemm(a_codes, a_scales, b_bf16):
    """``A B^T`` in float32 for A MXFP8 ``[M, K]`` (``mx.quantize`` along K) and B from
    :func:`bf16_math_weights`, on the BF16 tensor core (M % 128, N % 256, K % 128)."""
    import torch

    M, K = _check("A", a_codes, a_scales)
    _check_bf16_b(b_bf16, K, stacked=False)
    N = b_bf16.shape[0]
    out = torch.empty(M, N, dtype=torch.float32, device=a_codes.device)
    sa = block_scales(a_scales)
    _launch("mokgen_mx_bf16_math_gemm", a_codes.device, out.data_ptr(), a_codes.data_ptr(), sa.data_ptr(),
            b_bf16.data_ptr(), M, N, K)
    return out


def mx_bf16_math_grouped_gemm(a_codes, a_scales_blocked, b_bf16, tiles, *, out=None):
    """:func:`mx_grouped_gemm` on the bf16-math form: A ``[M, K]`` codes with blocked scales,
    B bf16 ``[E, N, K]`` from :func:`expert_weights` (MX values, k permuted), ``tiles`` int32
    ``[n, 2]`` of (expert, first row), (-1, 0) entries skipped. Returns C ``[M, N]`` float32; rows
    outside every tile are not written. ``out``: C's memory, a float32 ``[M, N]`` view whose rows
    may lie further apart (a column block of a wider matrix, e.g. one half of ``[M, 2 N]``)."""
    import torch

    M, K = _check_blocked_a(a_codes, a_scales_blocked, "grouped bf16-math GEMM")
    _check_bf16_b(b_bf16, K, stacked=True)
    E, N, _ = b_bf16.shape
    _check_tiles(tiles, a_codes.device, "grouped bf16-math GEMM")
    if out is None:
        c = torch.empty(M, N, dtype=torch.float32, device=a_codes.device)
    else:
        if out.dtype != torch.float32 or out.shape != (M, N) or out.device != a_codes.device or out.stride(1) != 1 \
                or out.stride(0) < N or out.stride(0) % 2 or out.data_ptr() % 8:
            raise InputError(f"grouped bf16-math GEMM: out must be float32 [{M}, {N}] on {a_codes.device} with unit "
                             f"column stride and an even row stride of at least {N}, 8-byte aligned, got {out.dtype} "
                             f"{tuple(out.shape)} strides {out.stride()}")
        c = out
    if tiles.shape[0] == 0:
        return c
    if out is None:
        _launch("mokgen_mx_bf16_math_grouped_gemm", a_codes.device, c.data_ptr(), a_codes.data_ptr(),
                a_scales_blocked.data_ptr(), b_bf16.data_ptr(), tiles.data_ptr(), int(tiles.shape[0]), E, M, N, K,
                what="bf16 math")
    else:
        _launch("mokgen_mx_bf16_math_grouped_gemm_ld", a_codes.device, c.data_ptr(), int(c.stride(0)),
                a_codes.data_ptr(), a_scales_blocked.data_ptr(), b_bf16.data_ptr(), tiles.data_ptr(),
                int(tiles.shape[0]), E, M, N, K, what="bf16 math, strided C")
    return c


def mx_bf16_math_swiglu_gemm(a_codes, a_scales_blocked, b_interleaved, tiles, clamp_limit: float | None = None):
    """The up projection with SwiGLU and h's quantization fused into the bf16-math GEMM's epilogue
    (grouped): A ``[M, H]`` MXFP8 rows with blocked scales, B the gate | up weights from
    :func:`expert_weights` with ``interleave`` (``[E, 2I, H]``), ``tiles`` as
    :func:`mx_bf16_math_grouped_gemm`'s. Returns h as ``(codes [M, I], scales [I / 128, M, 4])``:
    the bits of :func:`swiglu_quantize` of the unfused GEMM's gate | up, with no float32 gate | up
    written. Rows outside every tile are not written."""
    import torch

    M, K = _check_blocked_a(a_codes, a_scales_blocked, "fused SwiGLU GEMM")
    _check_bf16_b(b_interleaved, K, stacked=True)
    _check_tiles(tiles, a_codes.device, "fused SwiGLU GEMM")
    E, N, _ = b_interleaved.shape
    inter = N // 2
    limit = 0.0 if clamp_limit is None else float(clamp_limit)
    if clamp_limit is not None and not limit > 0:
        raise InputError(f"clamp_limit must be positive, got {clamp_limit}")
    codes = torch.empty(M, inter, dtype=torch.float8_e4m3fn, device=a_codes.device)
    scales = torch.empty(inter // BLOCK, M, 4, dtype=torch.uint8, device=a_codes.device)
    if tiles.shape[0]:
        _launch("mokgen_mx_bf16_math_swiglu_gemm", a_codes.device, codes.data_ptr(), scales.data_ptr(),
                a_codes.data_ptr(), a_scales_blocked.data_ptr(), b_interleaved.data_ptr(), tiles.data_ptr(),
                int(tiles.shape[0]), E, M, inter, K, limit, what="bf16 math, fused SwiGLU")
    return codes, scales


def mx_bf16_math_combine1_gemm(a_codes, a_scales_blocked, b_bf16, tiles, src, weight):
    """The down projection with the combine of one pair per token (k = 1) fused into the bf16-math
    GEMM's epilogue (grouped): A ``[M, K]`` MXFP8 h rows with blocked scales, B bf16 ``[E, N, K]``,
    ``tiles`` as :func:`mx_bf16_math_grouped_gemm`'s, ``src`` int32 ``[M]`` (each row's token,
    -1 for padding; every token exactly once) and ``weight`` float32 ``[T]``. Returns ``out [T, N]``
    bf16 with ``out[src[r]] = weight[src[r]] * (A B^T)[r]``: the bits of the GEMM then
    :func:`combine` at k = 1, with no float32 C written."""
    import torch

    M, K = _check_blocked_a(a_codes, a_scales_blocked, "fused combine GEMM")
    _check_bf16_b(b_bf16, K, stacked=True)
    _check_tiles(tiles, a_codes.device, "fused combine GEMM")
    if src.dtype != torch.int32 or src.shape != (M,) or weight.dtype != torch.float32 or weight.dim() != 1 \
            or not weight.is_contiguous() or src.device != a_codes.device or weight.device != a_codes.device:
        raise InputError(f"fused combine GEMM: src int32 [{M}] and weight float32 [T] on the operands' device")
    E, N, _ = b_bf16.shape
    out = torch.empty(weight.shape[0], N, dtype=torch.bfloat16, device=a_codes.device)
    if tiles.shape[0] and weight.shape[0]:
        _launch("mokgen_mx_bf16_math_combine1_gemm", a_codes.device, out.data_ptr(), src.data_ptr(),
                weight.data_ptr(), a_codes.data_ptr(), a_scales_blocked.data_ptr(), b_bf16.data_ptr(),
                tiles.data_ptr(), int(tiles.shape[0]), E, M, N, K, what="bf16 math, fused combine")
    return out


def raw_weights_apply(parts) -> bool:
    """Whether :func:`mx_bf16_math_raw_gemm` takes ``parts`` as its B: one or two bf16 ``[E, k_i,
    N]`` tensors alike in E and N on one device, N a multiple of 256, each k_i of 64 and their sum
    of 128 (the device is the caller's to check)."""
    import torch

    if len(parts) not in (1, 2):
        return False
    first = parts[0]
    return (all(
        p.dtype == torch.bfloat16 and p.dim() == 3 and p.device == first.device
        and p.shape[0] == first.shape[0] and p.shape[2] == first.shape[2] for p in parts)
        and first.shape[2] % BF16_MATH_N == 0 and all(p.shape[1] % 64 == 0 for p in parts)
        and sum(p.shape[1] for p in parts) % BLOCK == 0)


def mx_bf16_math_raw_gemm(a_codes, a_scales_blocked, parts, tiles, *, combine=None):
    """The dgrads' grouped GEMM with the weights raw (v0.67, templates/include/mokgen/mx_rawb.cuh):
    ``C = A B^T`` per row tile, A ``[M, K]`` MXFP8 codes with blocked scales, B the stack along k of
    ``parts`` (one or two bf16 ``[E, k_i, N]``, n contiguous: W_down ``[E, H, I]``, or W_gate and
    W_up ``[E, I, H]``) quantized to MX values along k inside the kernel: the product of
    :func:`mx_bf16_math_grouped_gemm` with ``expert_weights(parts, transpose=True)``, with no
    transposed copy of the weights written. ``tiles`` as that function's. Returns C ``[M, N]``
    float32 (rows outside every tile not written), or with ``combine=(src, weight)`` the combine
    of one pair per token as :func:`mx_bf16_math_combine1_gemm` (``out [T, N]`` bf16)."""
    import torch

    M, K = _check_blocked_a(a_codes, a_scales_blocked, "raw-weights GEMM")
    parts = [p.contiguous() for p in parts]
    if not raw_weights_apply(parts) or sum(p.shape[1] for p in parts) != K or parts[0].device != a_codes.device:
        raise InputError(f"raw-weights GEMM: B must be one or two bf16 [E, k_i, N] tensors on {a_codes.device} with "
                         f"each k_i a multiple of 64 summing to K = {K} and N a multiple of {BF16_MATH_N}, got "
                         f"{[(str(p.dtype), tuple(p.shape)) for p in parts]}")
    _check_tiles(tiles, a_codes.device, "raw-weights GEMM")
    E, k0, N = parts[0].shape
    b1 = parts[1].data_ptr() if len(parts) == 2 else None
    if combine is None:
        c = torch.empty(M, N, dtype=torch.float32, device=a_codes.device)
        out, src, weight, n_out = None, None, None, M
    else:
        src, weight = combine
        if src.dtype != torch.int32 or src.shape != (M,) or weight.dtype != torch.float32 or weight.dim() != 1 \
                or not weight.is_contiguous() or src.device != a_codes.device or weight.device != a_codes.device:
            raise InputError(f"raw-weights GEMM: combine takes src int32 [{M}] and weight float32 [T] on the "
                             f"operands' device")
        c = torch.empty(weight.shape[0], N, dtype=torch.bfloat16, device=a_codes.device)
        out, n_out = c, weight.shape[0]
    if tiles.shape[0] and n_out:
        _launch("mokgen_mx_bf16_math_raw_gemm", a_codes.device, None if out is not None else c.data_ptr(),
                None if out is None else out.data_ptr(), None if src is None else src.data_ptr(),
                None if weight is None else weight.data_ptr(), a_codes.data_ptr(), a_scales_blocked.data_ptr(),
                parts[0].data_ptr(), b1, k0, tiles.data_ptr(), int(tiles.shape[0]), E, M, N, K,
                what="bf16 math, raw weights")
    return c


#: the column tiles' grid (mx_rows.cuh weight_cols2_kernel): 128 rows (four 32-row blocks) per CTA
#: in y, at most 65535 CTAs in y and 65535 experts in z
_TILE_BLOCKS, _GRID_MAX = 4, 65535


def _cols_entry(x, experts: int, units: int, n: int) -> str:
    """The weights' column quantizer for input ``x`` (``units`` 32-row blocks of ``n`` columns, per
    expert): v0.40's tiles (``mokgen_mx_weight_cols2``, written out whole sectors since v0.41)
    under MOKGEN_MX_QUANT=v2 (the default) where they apply: ``experts`` and the tiles within their
    grid, ``n`` a multiple of 16 bytes' elements and ``x`` 16-byte aligned. Else v1's thread per
    block (``mokgen_mx_weight_cols``): the same arguments and bits."""
    entry = "mokgen_mx_weight_cols"
    if env.mx_quant() != "v2" or experts > _GRID_MAX or -(-units // _TILE_BLOCKS) > _GRID_MAX:
        return entry
    if n % (16 // x.element_size()) or x.data_ptr() % 16:  # the tiles' 16-byte loads
        return entry
    return entry + "2"


def expert_weights(parts, *, transpose: bool = False, codes: bool = False, interleave: bool = False):
    """Stacked expert weights (bf16, mokgen's layout) quantized to MXFP8 on the GPU in one pass each,
    for the grouped GEMMs: ``parts`` are ``[E, n_i, K]`` tensors stacked along their rows (gate then
    up), quantized along K; with ``transpose`` the parts are ``[E, r_i, n]`` and the result is the
    transpose of their stack, ``[E, n, sum r_i]``, quantized along ``sum r_i`` (the dgrads'
    orientation). Returns the MX values as bf16 with k permuted for the bf16-math GEMM
    (:func:`bf16_math_weights`' bits), then with ``codes`` the E4M3 codes and the E8M0 scales in
    ``block_expert_scales``' layout for the FP8 forms. ``interleave`` (two parts of equal rows, a
    multiple of 128, along K): the bf16 values' rows interleaved in 128s, gate then up, as
    :func:`mx_bf16_math_swiglu_gemm` reads them (the codes keep the parts' order)."""
    import torch

    parts = list(parts)
    first = parts[0]
    if any(p.dtype != torch.bfloat16 or p.dim() != 3 or not p.is_contiguous() or p.device != first.device
           or p.shape[0] != first.shape[0] or p.shape[2] != first.shape[2] for p in parts):
        raise InputError("expert weights must be contiguous bf16 [E, n, K] tensors on one device, alike in E and K")
    E, dev = first.shape[0], first.device
    sizes = [p.shape[1] for p in parts]
    total, inner = sum(sizes), first.shape[2]
    if interleave and (transpose or len(parts) != 2 or sizes[0] != sizes[1] or sizes[0] % BLOCK):
        raise InputError(f"interleave takes two parts of equal rows, a multiple of {BLOCK}, along K; got {sizes}"
                         f"{' transposed' if transpose else ''}")
    if transpose:
        if total % BLOCK or any(r % 32 for r in sizes):
            raise InputError(f"transposed expert weights: the stacked rows {sizes} must be multiples of 32 summing to a "
                             f"multiple of {BLOCK}")
        N, K = inner, total
    else:
        if inner % BLOCK:
            raise InputError(f"expert weights: K = {inner} must be a multiple of {BLOCK}")
        N, K = total, inner
    dec = torch.empty(E, N, K, dtype=torch.bfloat16, device=dev)
    cod = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=dev) if codes else None
    sc = torch.empty(E, K // BLOCK, N, 4, dtype=torch.uint8, device=dev) if codes else None
    ptr = (lambda t: t.data_ptr() if t is not None else None)
    offset = 0
    for p, size in zip(parts, sizes):
        if transpose:
            _launch(_cols_entry(p, E, size // 32, N), dev, dec.data_ptr(), ptr(cod), ptr(sc),
                    p.data_ptr(), E, size, N, K, offset, 0)
        else:
            _launch("mokgen_mx_weight_rows", dev, dec.data_ptr(), ptr(cod), ptr(sc),
                    p.data_ptr(), E, size, K, N, offset, int(interleave))
        offset += size
    return (dec, cod, sc) if codes else dec


def both_applies(parts) -> bool:
    """Whether :func:`expert_weights_both` takes ``parts`` (as :func:`expert_weights` does: contiguous
    bf16 ``[E, n_i, K]`` on one GPU, alike in E and K): each part's rows a multiple of 32 summing
    to a multiple of 128, K a multiple of 128, 16-byte aligned data and the column tiles' grid
    (at most 65535 experts and 65535 tiles of 128 rows)."""
    import torch

    parts = list(parts)
    first = parts[0]
    if not first.is_cuda or any(p.dtype != torch.bfloat16 or p.dim() != 3 or not p.is_contiguous()
                                or p.device != first.device or p.shape[0] != first.shape[0]
                                or p.shape[2] != first.shape[2] or p.data_ptr() % 16 for p in parts):
        return False
    sizes = [p.shape[1] for p in parts]
    return (first.shape[0] <= _GRID_MAX and first.shape[2] % BLOCK == 0 and sum(sizes) % BLOCK == 0
            and all(r % 32 == 0 and -(-r // 128) <= _GRID_MAX for r in sizes))


def expert_weights_both(parts, *, apart: bool = False):
    """``(expert_weights(parts), expert_weights(parts, transpose=True))`` from one read of the
    weights (``mokgen_mx_weight_both``; MOKGEN_MX_WEIGHTS=both): the MX values as bf16 with k
    permuted in the forward's orientation ``[E, sum n_i, K]`` (no interleave) and in the dgrads'
    ``[E, K, sum n_i]``, the same bits as the two calls. ``parts`` as :func:`both_applies` takes.
    ``apart``: the forward's orientation as a list, ``expert_weights([p])`` for each part (the
    MXFP8 layer converts w_gate and w_up each on its own; ``mokgen_mx_weight_both_parts``)."""
    import torch

    parts = list(parts)
    if not both_applies(parts):
        raise InputError("expert_weights_both takes contiguous, 16-byte aligned bf16 [E, n_i, K] tensors on one GPU, "
                         f"alike in E and K, with K a multiple of {BLOCK} and rows multiples of 32 summing to a "
                         f"multiple of {BLOCK}; got {[(p.dtype, tuple(p.shape)) for p in parts]}")
    E, K, dev = parts[0].shape[0], parts[0].shape[2], parts[0].device
    total = sum(p.shape[1] for p in parts)
    cols_dec = torch.empty(E, K, total, dtype=torch.bfloat16, device=dev)
    if apart:
        rows_dec = [torch.empty(E, p.shape[1], K, dtype=torch.bfloat16, device=dev) for p in parts]
        offset = 0
        for p, r in zip(parts, rows_dec):
            _launch("mokgen_mx_weight_both_parts", dev, cols_dec.data_ptr(), r.data_ptr(), p.data_ptr(), E,
                    p.shape[1], K, total, offset, p.shape[1], 0)
            offset += p.shape[1]
        return rows_dec, cols_dec
    rows_dec = torch.empty(E, total, K, dtype=torch.bfloat16, device=dev)
    offset = 0
    for p in parts:
        _launch("mokgen_mx_weight_both", dev, cols_dec.data_ptr(), rows_dec.data_ptr(), p.data_ptr(), E, p.shape[1],
                K, total, offset)
        offset += p.shape[1]
    return rows_dec, cols_dec


def rows_values(x, src=None, scale=None):
    """The MX values of rows ``x [rows, n]`` (float32 or bf16) quantized along the rows, in x's own
    layout: each column's 32-row blocks quantized (``mx.quantize(x.t(), dim=-1)``'s scales and
    codes, :func:`cols_bf16_math`'s), their values written back row-major and unpermuted as bf16
    ``[rows, n]``. With ``src`` (int32 ``[rows]``): row r from ``x[src[r]]``, zeros where
    ``src[r] < 0`` (``x [T, n]``), no gathered copy written. rows a multiple of 32, n of 8. The operands
    of the MXFP8 backward's weight gradients on the BF16 backward's weight kernels
    (MOKGEN_MX_WGRAD=bf16, v0.65). ``scale`` (v0.66; float32 ``[rows]``, with ``src`` and bf16 x):
    row r is ``scale[r] * x[src[r]].float()``, one float32 product rounded once (the MXFP8 backward's
    dy = w dOut from dOut's rows, with no float32 copy of dy read)."""
    import torch

    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or not x.is_contiguous() \
            or x.shape[1] % 8 or (x.numel() and x.data_ptr() % 16):
        raise InputError(f"x must be contiguous, 16-byte aligned float32 or bf16 [rows, n] with n a multiple of 8, "
                         f"got {x.dtype} {tuple(x.shape)}")
    if src is not None and (src.dtype != torch.int32 or src.dim() != 1 or src.device != x.device
                            or not src.is_contiguous()):
        raise InputError(f"src must be contiguous int32 [rows] on {x.device}, got {src.dtype} {tuple(src.shape)}")
    rows = x.shape[0] if src is None else src.shape[0]
    if scale is not None and (src is None or x.dtype != torch.bfloat16 or scale.dtype != torch.float32
                              or tuple(scale.shape) != (rows,) or scale.device != x.device
                              or not scale.is_contiguous()):
        raise InputError(f"rows_values: scale must be contiguous float32 [{rows}] on {x.device}, with src and bf16 x, "
                         f"got {scale.dtype} {tuple(scale.shape)} and x {x.dtype}")
    if rows % 32:
        raise InputError(f"rows_values quantizes 32-row blocks: rows must be a multiple of 32, got {rows}")
    n = x.shape[1]
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=x.device)
    if rows and n:
        if scale is not None:
            _launch("mokgen_mx_scaled_rows_values", x.device, out.data_ptr(), x.data_ptr(), src.data_ptr(),
                    scale.data_ptr(), rows, n)
        else:
            _launch("mokgen_mx_rows_values", x.device, out.data_ptr(), x.data_ptr(),
                    None if src is None else src.data_ptr(), rows, n, int(x.dtype == torch.float32))
    return out


def cols_bf16_math(x, src=None):
    """Rows ``x [rows, n]`` (float32 or bf16 activations) quantized along the rows (32-row blocks,
    ``mx.quantize(x.t(), dim=-1)``), transposed, as the bf16-math GEMM's B operand: ``[n, rows]``
    bf16 MX values with k permuted (``bf16_math_weights``' bits). rows a multiple of 128. With
    ``src`` (int32 ``[rows]`` on x's device): the rows gathered on the way, row r being
    ``x[src[r]]`` or zeros where ``src[r] < 0`` (``x [T, n]``; the bits of the gathered copy's,
    which is never written)."""
    import torch

    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or not x.is_contiguous() \
            or (src is None and x.shape[0] % BLOCK):
        raise InputError(f"x must be contiguous float32 or bf16 [rows, n] with rows a multiple of {BLOCK}, got "
                         f"{x.dtype} {tuple(x.shape)}")
    n = x.shape[1]
    if src is not None:
        if src.dtype != torch.int32 or src.dim() != 1 or src.shape[0] % BLOCK or src.device != x.device \
                or not src.is_contiguous():
            raise InputError(f"src must be contiguous int32 [rows] on {x.device} with rows a multiple of {BLOCK}, got "
                             f"{src.dtype} {tuple(src.shape)}")
        rows = src.shape[0]
        out = torch.empty(n, rows, dtype=torch.bfloat16, device=x.device)
        if rows and n:
            version = 2 if _cols_entry(x, 1, rows // 32, n).endswith("2") else 1
            _launch("mokgen_mx_gather_cols", x.device, out.data_ptr(), x.data_ptr(), src.data_ptr(), rows, n,
                    int(x.dtype == torch.float32), version)
        return out
    rows = x.shape[0]
    out = torch.empty(n, rows, dtype=torch.bfloat16, device=x.device)
    if rows and n:
        _launch(_cols_entry(x, 1, rows // 32, n), x.device, out.data_ptr(), None, None,
                x.data_ptr(), 1, rows, n, rows, 0, int(x.dtype == torch.float32))
    return out


def mx_bf16_math_ranged_gemm(a_codes, a_scales_blocked, b_bf16, kranges, *, out_dtype=None, check_ranges: bool = False):
    """The weight gradients' GEMM on the bf16-math form: ``C[z] = A[:, r_z] B[:, r_z]^T`` for each
    k range ``r_z = kranges[z]`` (int32 ``[Z, 2]`` of (first k, length), multiples of 128; a zero
    length gives zeros): A MXFP8 ``[M, K]`` codes with blocked scales ``[K / 128, M, 4]`` (an
    operand quantized along K, here the token rows), B bf16 ``[N, K]`` (:func:`cols_bf16_math`).
    Returns ``[Z, M, N]`` in float32 or bf16 (``out_dtype``), each sum in one fixed order. The
    ranges are trusted unless ``check_ranges`` (a host sync): a range outside ``[0, K]`` reads
    out of bounds."""
    import torch

    out_dtype = torch.float32 if out_dtype is None else out_dtype
    if not isinstance(a_codes, torch.Tensor) or a_codes.dtype not in (torch.float8_e4m3fn, torch.uint8) \
            or a_codes.dim() != 2 or not a_codes.is_contiguous() or a_codes.device.type != "cuda":
        raise InputError("ranged bf16-math GEMM: A codes must be a contiguous 2-d float8_e4m3fn (or uint8) CUDA tensor")
    M, K = a_codes.shape
    if M % BLOCK or K % BLOCK or tuple(a_scales_blocked.shape) != (K // BLOCK, M, 4) \
            or a_scales_blocked.dtype != torch.uint8 or not a_scales_blocked.is_contiguous() \
            or a_scales_blocked.device != a_codes.device:
        raise InputError(f"ranged bf16-math GEMM: A {tuple(a_codes.shape)} must have M, K multiples of {BLOCK} "
                         f"and contiguous uint8 blocked scales [K / 128, M, 4] on its device")
    _check_bf16_b(b_bf16, K, stacked=False)
    if b_bf16.device != a_codes.device:
        raise InputError(f"ranged bf16-math GEMM: B is on {b_bf16.device}, A on {a_codes.device}")
    if kranges.dtype != torch.int32 or kranges.dim() != 2 or kranges.shape[1] != 2 or kranges.device != a_codes.device \
            or not kranges.is_contiguous() or not 0 < kranges.shape[0] <= 65535 \
            or out_dtype not in (torch.float32, torch.bfloat16):
        raise InputError("ranged bf16-math GEMM: kranges contiguous int32 [Z, 2] (1 <= Z <= 65535) on the operands' "
                         "device, out_dtype float32 or bf16")
    # the ranges are read by the kernel (a bad one would read A's scales out of bounds); checking
    # them on the host costs a sync, so only where the caller asks (the layer's own ranges are
    # built from its segments and need none)
    if check_ranges:
        first, length = kranges[:, 0].cpu(), kranges[:, 1].cpu()
        if bool(((first % BLOCK != 0) | (length % BLOCK != 0) | (first < 0) | (length < 0) | (first + length > K)).any()):
            raise InputError(f"ranged bf16-math GEMM: every k range (first, length) must be multiples of {BLOCK} "
                             f"within [0, {K}]")
    N = b_bf16.shape[0]
    c = torch.empty(kranges.shape[0], M, N, dtype=out_dtype, device=a_codes.device)
    # MOKGEN_MX_RANGED: a CTA per tile (v0.35), or v0.40's persistent walk; the same bits
    entry = "mokgen_mx_bf16_math_ranged_gemm" + ("_persistent" if env.mx_ranged() == "persistent" else "")
    _launch(entry, a_codes.device, c.data_ptr(), a_codes.data_ptr(),
            a_scales_blocked.data_ptr(), b_bf16.data_ptr(), kranges.data_ptr(), int(kranges.shape[0]), M, N, K,
            int(out_dtype == torch.bfloat16), what="bf16 math, k ranges")
    return c


#: the most experts mx_gemm.segments ranks without a sort order (its shared memory)
SEGMENTS_MAX_UNSORTED = 1024


def segments(ids, k: int, num_experts: int, order=None):
    """The staged experts' segments on the GPU in one launch (``mx_experts._segments``'
    semantics): the pairs' ids int64 ``[n]`` -> ``(row int64 [n], src int32 [128 n_tiles], tiles
    int32 [n_tiles, 2], padded int64 [E])`` with ``n_tiles = ceil(n / 128) + E``. Given ``order``
    (the ids' stable sort order, int64 ``[n]``) the kernel reads the ranks from it; without, it
    ranks the pairs itself (at most :data:`SEGMENTS_MAX_UNSORTED` experts)."""
    import torch

    n, E = ids.numel(), num_experts
    if ids.dtype != torch.int64 or ids.dim() != 1 or (order is not None and (order.dtype != torch.int64
                                                                             or order.shape != ids.shape)):
        raise InputError("segments: ids (and order, when given) must be int64 [n]")
    if not 0 < E <= (8192 if order is not None else SEGMENTS_MAX_UNSORTED):
        raise InputError(f"segments: 1 to {8192 if order is not None else SEGMENTS_MAX_UNSORTED} experts "
                         f"{'with' if order is not None else 'without'} a sort order, got {E}")
    n_tiles = -(-n // BLOCK) + E
    dev = ids.device
    row = torch.empty(n, dtype=torch.int64, device=dev)
    src = torch.empty(BLOCK * n_tiles, dtype=torch.int32, device=dev)
    tiles = torch.empty(n_tiles, 2, dtype=torch.int32, device=dev)
    padded = torch.empty(E, dtype=torch.int64, device=dev)
    _launch("mokgen_mx_segments", dev, row.data_ptr(), src.data_ptr(), tiles.data_ptr(), padded.data_ptr(),
            ids.data_ptr(), None if order is None else order.data_ptr(), n, k, E, n_tiles)
    return row, src, tiles, padded


#: the megakernel's MX tile run alone (templates/include/mokgen/mx_tile.cuh), fixed shapes per
#: kind: (M, N out, K); the GPU test holds it to the bf16-math GEMM's bits
TILE_TEST_SHAPES = {"down": (256, 512, 256), "gated": (256, 256, 512)}


def _mx_tile_test(kind: str, a_codes, a_scales_blocked, b0, b1=None, clamp_limit: float | None = None, *,
                  rows: int | None = None, first_row: int = 0):
    """The MX tile alone (not yet the megakernel's): ``down`` -> bf16 ``A B0^T``; ``gated`` -> h =
    swiglu(A B0^T, A B1^T) quantized, ``(codes, blocked scales)``. A MXFP8 with blocked scales, B0
    and B1 bf16 MX values with k permuted (:func:`bf16_math_weights`), shapes
    :data:`TILE_TEST_SHAPES`. ``rows`` (default all): the tiles write output rows ``< rows`` only,
    as the megakernel's partial tiles; the outputs start filled with a marker (NaN, codes and
    scales 0xEE) so that rows left unwritten show. ``first_row`` (0..127): output row ``i`` is A's
    row ``first_row + i`` (rows past A's end read as zeros), as the megakernel's tiles start at any
    row of its ring (the scales' TMA box then starts below the tile, mx_tile.cuh kScaleBoxRows)."""
    import torch

    M, N, K = TILE_TEST_SHAPES[kind]  # B: N rows (the down tile's outputs; gate and up rows of h's N)
    rows = M if rows is None else int(rows)
    gated = kind == "gated"
    for t, shape in ((a_codes, (M, K)), (b0, (N, K))) + (((b1, (N, K)),) if gated else ()):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not t.is_contiguous():
            raise InputError(f"MX tile test ({kind}): contiguous operands of shapes A {(M, K)}, B {(N, K)}"
                             f"{' (gate and up)' if gated else ''}")
    if a_codes.dtype not in (torch.float8_e4m3fn, torch.uint8) or a_codes.device.type != "cuda":
        raise InputError("MX tile test: A codes must be float8_e4m3fn (or uint8) on a CUDA device")
    if a_scales_blocked.dtype != torch.uint8 or tuple(a_scales_blocked.shape) != (K // BLOCK, M, 4) \
            or not a_scales_blocked.is_contiguous():
        raise InputError(f"MX tile test: A's scales must be contiguous uint8 blocked scales {(K // BLOCK, M, 4)}")
    if any(t.dtype != torch.bfloat16 for t in ((b0, b1) if gated else (b0,))):
        raise InputError("MX tile test: B must be bf16 MX values with k permuted (bf16_math_weights)")
    if any(t.device != a_codes.device for t in (a_scales_blocked, b0) + ((b1,) if gated else ())):
        raise InputError("MX tile test: every operand on A's device")
    if clamp_limit is not None and not clamp_limit > 0:
        raise InputError(f"MX tile test: clamp_limit must be positive, got {clamp_limit}")
    if not 1 <= rows <= M:
        raise InputError(f"MX tile test: rows must be in [1, {M}], got {rows}")
    if not 0 <= int(first_row) <= 127:
        raise InputError(f"MX tile test: first_row must be in [0, 127], got {first_row}")
    dev = a_codes.device
    if kind == "down":
        c = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=dev)
        _launch("mokgen_mx_tile_test", dev, 0, c.data_ptr(), None, None, a_codes.data_ptr(),
                a_scales_blocked.data_ptr(), b0.data_ptr(), None, 0.0, rows, int(first_row))
        return c
    codes = torch.full((M, N), 0xEE, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    scales = torch.full((N // BLOCK, M, 4), 0xEE, dtype=torch.uint8, device=dev)
    _launch("mokgen_mx_tile_test", dev, 1 if clamp_limit is None else 2, None, codes.data_ptr(), scales.data_ptr(),
            a_codes.data_ptr(), a_scales_blocked.data_ptr(), b0.data_ptr(), b1.data_ptr(),
            0.0 if clamp_limit is None else float(clamp_limit), rows, int(first_row))
    return codes, scales
