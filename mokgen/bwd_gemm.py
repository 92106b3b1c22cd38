"""The experts' backward GEMMs on mokgen's Hopper core (issue 5, step 2 of the backward plan).

``templates/bwd_gemm.cu`` (device code in ``templates/include/mokgen/bwd_gemm.cuh``) is one
library for every spec (shapes are run-time values), compiled once into the build cache and
loaded with ctypes, like the link benchmark. Two grouped GEMMs over rows sorted expert-major
(expert ``e`` owns rows ``[offs[e-1], offs[e])``, ``offs`` the inclusive prefix sums of the rows
per expert, int32 on the GPU):

* :func:`rows_gemm`: ``out[r] = sum_p A_p[r] @ B_p[e(r)]`` in fp32, B either ``[E, K, N]``
  (``b_major="mn"``: dh = dOut Wd, dx = dg Wg + du Wu) or ``[E, N, K]`` (``"k"``: x Wg^T alone;
  the backward recomputes g and u through :func:`swiglu_grads` instead);
* :func:`swiglu_grads`: the recompute of ``g = x Wg[e]^T``, ``u = x Wu[e]^T`` (one gated tile
  of gate and up rows, as the forward's) with SwiGLU's backward in the epilogue: ``h``, ``dg``,
  ``du`` in bf16 and the routing weight's gradient ``<dh_u, h>`` per row, without g and u ever
  leaving the registers;
* :func:`swiglu_grads_saved`: the same outputs from the pre-activations g and u that the
  forward saved (the "save" policy of mokgen.backward): an elementwise pass instead of the
  recompute's two GEMMs;
* :func:`weight_grads`: ``out[e] = A[rows of e]^T @ B[rows of e]`` in bf16 (dWg = dg^T x,
  dWu = du^T x, dWd = dy^T h); an expert without rows gets zeros;
* :func:`expert_major`: the rows' order (pairs sorted by expert, stable), offsets, tokens and
  routing weights in one launch; :func:`sum_slots`: dX summed over each token's slots and cast.

One CTA owns each output tile and sums its K in order (for the weight gradients, the expert's
rows in their order): no split-K, no atomics, the same bits on every run. Tiles are 128 x 256
with k-blocks of 64, so N must be a multiple of 256, K (rows GEMMs) of 64 and M (weight
gradients) of 128: every bundled spec's H and I are. ``mokgen.backward`` uses these by default
(``MOKGEN_BWD_GEMM=0``: torch._grouped_mm; measured faster on the H200, docs/perf-notes.md
v0.10). The library is compiled where it is first used (nvcc and the nvidia-cutlass headers
needed); the prebuilt wheels do not carry it yet, so where it can be neither found nor built
(no nvcc, or MOKGEN_DISABLE_JIT=1) the backward warns once and takes torch._grouped_mm. A
stage-barrier wait that does not complete within about 17 s traps: a protocol error ends the
launch, and the next CUDA call fails, instead of hanging the process.
"""

from __future__ import annotations

import ctypes
import os
import re
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from mokgen import env
from mokgen.build import build_source, find_source_library, source_library_path
from mokgen.errors import InputError, KernelError, MokgenError

ARCH = "sm_90a"
SOURCE = "bwd_gemm.cu"
LIBRARY = "libbwdgemm.so"
BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
#: kernels of the trace build (-DMOKGEN_BWD_TRACE) that .ci/bwd_trace.py does not time: the
#: gathered weight gradients (weight_kernel<1, joint, true>, mangled names), whose wgmma ptxas
#: serializes in that build only (C7515, v0.27; the library's own build keeps them pipelined)
TRACE_UNTIMED = re.compile(r"weight_kernelILi1ELb[01]ELb1E")


def trace_serialized(entry) -> list[str]:
    """The kernels of a trace build in ``entry`` whose wgmma ptxas serialized, less
    ``TRACE_UNTIMED``: empty when every kernel the trace times keeps its pipeline."""
    from mokgen.build import serialized_wgmma

    return [n for n in serialized_wgmma(Path(entry)) if not TRACE_UNTIMED.search(n)]


def library_path() -> Path:
    """Where this toolchain's build of the library lives (built or not)."""
    return source_library_path(SOURCE, LIBRARY, cutlass=True, arch=ARCH)


def build_library(*, force: bool = False) -> Path:
    """Compile ``templates/bwd_gemm.cu`` into the build cache once (or find it there)."""
    return build_source(SOURCE, LIBRARY, cutlass=True, arch=ARCH, force=force)


def build_variant(flags: list[str], out_dir) -> Path:
    """A build of ``templates/bwd_gemm.cu`` with more nvcc ``flags`` (``-DMOKGEN_BWD_TRACE``, a
    variant's macros) in ``out_dir``, outside the cache: ``.ci/bwd_trace.py`` and
    ``.ci/bench_bwd_gemm.py`` (``BWD_BENCH_FLAGS``) load it beside this tree's library."""
    from mokgen.build import build_variant as _build_variant

    return _build_variant(SOURCE, LIBRARY, Path(out_dir), list(flags), cutlass=True, arch=ARCH)


_vp, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
#: the library's entry points and their argument types (each returns 0 or a CUDA error code)
_SIGNATURES = {
    "mokgen_bwd_rows": [_vp, _vp, _vp, _vp, _vp, _i, _vp, _i, _i, _i, _i, _i, _vp, _i, _i, _vp],
    "mokgen_bwd_weights": [_vp, _vp, _vp, _vp, _i, _i, _i, _i, _i, _i, _vp, _vp],
    "mokgen_bwd_rows_gathered": [_vp, _vp, _vp, _vp, _vp, _i, _i, _i, _i, _vp, _i, _vp],
    "mokgen_bwd_weights_gathered": [_vp, _vp, _vp, _vp, _vp, _i, _i, _i, _i, _vp, _vp],
    "mokgen_bwd_weights2": [_vp, _vp, _vp, _vp, _vp, _vp, _i, _i, _i, _i, _i, _vp, _vp, _vp, _i, _i, _i, _vp],
    "mokgen_bwd_weights2_gathered": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _i, _i, _i, _i, _vp, _vp],
    "mokgen_bwd_swiglu": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _i, _i, _i, _i, _i, _f, _vp],
    "mokgen_bwd_swiglu_saved": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _i, _i, _i, _i, _f, _i, _vp],
    "mokgen_bwd_dh_swiglu_saved": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _i, _i, _i, _i, _i, _f, _vp, _vp],
    "mokgen_bwd_sum_slots": [_vp, _vp, _i, _i, _i, _i, _vp],
    "mokgen_bwd_expert_major": [_vp, _i, _i, _i, _vp, _vp, _vp, _vp, _vp, _vp, _vp],
    "mokgen_bwd_fused": [_vp] * 19 + [_i] * 7 + [_f, _vp],
}
#: entry points that return a value, not an error code: (argument types, result type)
_QUERIES = {"mokgen_bwd_expert_major_scratch": ([_i, _i], ctypes.c_longlong),
            "mokgen_bwd_fused_counters": ([_i, _i], ctypes.c_longlong)}
#: the most experts expert_major orders (its kernels keep E + 1 counters in 48 KB of shared memory)
EXPERT_MAJOR_MAX_EXPERTS = 12287


class _Lib:
    """The library's entry points with ctypes signatures; a non-zero code raises KernelError.
    ``entries``: the ones to bind (all by default; a benchmark of an older build binds the ones
    it has)."""

    def __init__(self, path: Path, entries=tuple(_SIGNATURES)):
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.mokgen_bwd_error_string.argtypes, lib.mokgen_bwd_error_string.restype = [_i], ctypes.c_char_p
        for name in entries:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = _SIGNATURES[name], _i
        for name, (args, result) in _QUERIES.items():
            if hasattr(lib, name):  # an older build (a benchmark's) may lack it
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, result
        self._lib = lib
        self._tail_steps = False  # the library's own default (g_steps 0)
        if hasattr(lib, "mokgen_bwd_set_tail_steps"):
            lib.mokgen_bwd_set_tail_steps.argtypes, lib.mokgen_bwd_set_tail_steps.restype = [_i], None
        if hasattr(lib, "mokgen_bwd_set_stagger"):  # an older build (a benchmark's) may lack it
            lib.mokgen_bwd_set_stagger.argtypes, lib.mokgen_bwd_set_stagger.restype = [_i], None
            self.set_stagger(env.bwd_stagger())
        self._band = env.BWD_ROW_BAND_DEFAULT  # the library's own default (g_band)
        if hasattr(lib, "mokgen_bwd_set_row_band"):  # v0.43; an older build (a benchmark's) lacks it
            lib.mokgen_bwd_set_row_band.argtypes, lib.mokgen_bwd_set_row_band.restype = [_i], None

    def _row_band(self) -> None:
        """The rows GEMMs' tile walk (MOKGEN_BWD_ROW_BAND, read at each launch); a library call only
        when it changes."""
        band = env.bwd_row_band()
        if band != self._band and hasattr(self._lib, "mokgen_bwd_set_row_band"):
            self._lib.mokgen_bwd_set_row_band(band)
            self._band = band

    def set_tail_steps(self, on: bool) -> None:
        """Whether the split weight tiles of this library's launches leave out a bounded last
        k-block's empty 16-row steps (tail "steps"); a library call only when it changes."""
        on = bool(on)
        if on != self._tail_steps:
            if not hasattr(self._lib, "mokgen_bwd_set_tail_steps"):  # an older build (a benchmark's)
                if on:
                    raise InputError("this build of the backward library has no tail \"steps\"")
                return
            self._lib.mokgen_bwd_set_tail_steps(int(on))
            self._tail_steps = on

    def set_stagger(self, lead: int) -> None:
        """The consumer warpgroups' stagger lead (k-blocks; 0: lockstep) in this library's GEMM launches."""
        self._lib.mokgen_bwd_set_stagger(int(lead))

    def check(self, what: str, code: int) -> None:
        if code != 0:
            raise KernelError(f"{what} failed to launch: error {code} ({self._lib.mokgen_bwd_error_string(code).decode()})")

    def _call(self, name: str, *args) -> None:
        self.check(name, getattr(self._lib, name)(*args))

    def rows(self, *args) -> None:
        self._row_band()
        self._call("mokgen_bwd_rows", *args)

    def weights(self, *args) -> None:
        self._call("mokgen_bwd_weights", *args)

    def rows_gathered(self, *args) -> None:
        self._row_band()
        self._call("mokgen_bwd_rows_gathered", *args)

    def weights_gathered(self, *args) -> None:
        self._call("mokgen_bwd_weights_gathered", *args)

    def weights2(self, *args) -> None:
        self._call("mokgen_bwd_weights2", *args)

    def weights2_gathered(self, *args) -> None:
        self._call("mokgen_bwd_weights2_gathered", *args)

    def swiglu(self, *args) -> None:
        self._call("mokgen_bwd_swiglu", *args)

    def swiglu_saved(self, *args) -> None:
        self._call("mokgen_bwd_swiglu_saved", *args)

    def dh_swiglu_saved(self, *args) -> None:
        self._call("mokgen_bwd_dh_swiglu_saved", *args)

    def sum_slots(self, *args) -> None:
        self._call("mokgen_bwd_sum_slots", *args)

    def expert_major(self, *args) -> None:
        self._call("mokgen_bwd_expert_major", *args)

    def fused(self, *args) -> None:
        self._call("mokgen_bwd_fused", *args)

    def fused_counters(self, rows: int, experts: int) -> int:
        """int32 elements of the fused backward's dependency counters."""
        return int(self._lib.mokgen_bwd_fused_counters(rows, experts))

    def expert_major_scratch(self, n: int, experts: int) -> int:
        """int32 elements of expert_major's scratch for n pairs and ``experts`` experts."""
        return int(self._lib.mokgen_bwd_expert_major_scratch(n, experts))


@lru_cache(maxsize=None)
def _load(path: str) -> _Lib:
    return _Lib(Path(path))


#: the library by the environment that names the build cache directory (mokgen.env.cache_dir
#: reads these): a lookup per GEMM call instead of the cache directory's path arithmetic
_by_env: dict[tuple, _Lib] = {}


def load_library() -> _Lib:
    """The library, built first if needed (with MOKGEN_DISABLE_JIT=1 a missing build is an error);
    found once per process and build cache directory."""
    key = tuple(os.environ.get(k) for k in ("MOKGEN_CACHE_DIR", "XDG_CACHE_HOME", "HOME"))
    lib = _by_env.get(key)
    if lib is None:
        lib = _load(str(find_source_library(SOURCE, LIBRARY, cutlass=True, arch=ARCH, module=__name__)))
        _by_env[key] = lib
    return lib


#: compute capability 9.0 or not, per CUDA device index (asked once: every operand check asks)
_sm90: dict[int, bool] = {}


def supported(device) -> bool:
    """Whether the library's sm_90a code runs on ``device`` (a CUDA device of compute capability 9.0)."""
    import torch

    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _sm90.get(index)
    if ok is None:
        ok = _sm90[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return ok


@contextmanager
def _on(device):
    """The raw current stream of ``device`` (a CUDA tensor's device), with ``device`` the current
    device for the launch: a context switch only where it is not current already (the launches
    are a few microseconds; torch.cuda.device and current_stream cost as much again each)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if torch.cuda.current_device() == index:
        yield raw(index) if raw is not None else torch.cuda.current_stream(device).cuda_stream
        return
    with torch.cuda.device(index):
        yield raw(index) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def _check_operand(name: str, t, ndim: int) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16 or t.dim() != ndim or not t.is_contiguous():
        raise InputError(f"{name} must be a contiguous {ndim}-d bfloat16 tensor, got {t.dtype} "
                         f"{tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")
    if not supported(t.device):
        raise InputError(f"{name} must be on a CUDA device of compute capability 9.0 (sm_90), got {t.device}")
    if t.data_ptr() % 16:
        raise InputError(f"{name} must start at a 16-byte aligned address (the TMA's rule), got a view at "
                         f"{t.data_ptr() % 16} bytes past one")


def _check_offs(offs, experts: int, device) -> None:
    import torch

    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or tuple(offs.shape) != (experts,) \
            or offs.device != device or not offs.is_contiguous():
        raise InputError(f"offs must be a contiguous int32 tensor of shape ({experts},) on {device} (the rows per expert, "
                         f"inclusive prefix sums), got {getattr(offs, 'dtype', type(offs).__name__)} "
                         f"{tuple(getattr(offs, 'shape', ()))} on {getattr(offs, 'device', '?')}")


def _check_clamp(clamp_limit) -> None:
    if clamp_limit is not None and not float(clamp_limit) > 0:
        raise InputError(f"clamp_limit must be positive (or None), got {clamp_limit}")


def _check_row_floats(dh_u, wt, rows: int, I: int, device, *, dh_bf16_ok: bool = False) -> None:
    """The SwiGLU backward's inputs: ``dh_u [rows, I]`` (fp32, or bf16 where ``dh_bf16_ok``) and
    ``wt [rows]`` fp32, contiguous, on ``device``."""
    import torch

    dh_types = (torch.float32, torch.bfloat16) if dh_bf16_ok else (torch.float32,)
    for name, t, shape, types in (("dh_u", dh_u, (rows, I), dh_types), ("wt", wt, (rows,), (torch.float32,))):
        if not isinstance(t, torch.Tensor) or t.dtype not in types or tuple(t.shape) != shape \
                or not t.is_contiguous() or t.device != device:
            kinds = "float32 or bfloat16" if len(types) > 1 else "float32"
            raise InputError(f"{name} must be a contiguous {kinds} tensor of shape {shape} on {device}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


#: the narrowest N whose rows GEMMs run as CTA pairs by default (rows_cluster): measured on
#: kimi-k2.5's local rows, pairs took dx (N = 7168, 28 column tiles) from 1.87 to 1.70 ms and dh
#: (N = 2048, 8 tiles) from 0.85 to 0.90 (docs/perf-notes.md v0.14)
ROWS_PAIR_MIN_N = 4096


def _check_index(a_index, rows: int | None, device, name: str = "a_index") -> int:
    """A gathered operand's row index (``name`` in the error): a contiguous 1-d int64 tensor on
    ``device`` (``rows`` long where given); returns its length. Its values are trusted (the
    backward's token index)."""
    import torch

    if not isinstance(a_index, torch.Tensor) or a_index.dtype != torch.int64 or a_index.dim() != 1 \
            or not a_index.is_contiguous() or a_index.device != device \
            or (rows is not None and a_index.shape[0] != rows):
        want = f"({rows},)" if rows is not None else "(rows,)"
        raise InputError(f"{name} must be a contiguous int64 tensor of shape {want} on {device}, got "
                         f"{getattr(a_index, 'dtype', type(a_index).__name__)} {tuple(getattr(a_index, 'shape', ()))}")
    return int(a_index.shape[0])


def rows_cluster(N: int) -> int:
    """The rows GEMMs' CTAs per cluster when neither the call nor MOKGEN_BWD_ROWS_CLUSTER says:
    column-tile pairs (2) from N = ROWS_PAIR_MIN_N, single CTAs (1) below."""
    return 2 if N >= ROWS_PAIR_MIN_N else 1


def rows_gemm(pairs: Sequence[tuple], offs, *, b_major: str = "mn", out=None, out_rows=None,
              cluster: int | None = None, out_dtype=None, a_index=None):
    """``out [rows, N] fp32 = sum_p A_p @ B_p[e]`` for the rows of each expert ``e``: ``A_p``
    ``[rows, K]`` bf16, ``B_p`` ``[E, K, N]`` (``b_major="mn"``) or ``[E, N, K]`` (``"k"``)
    bf16, one or two pairs of the same shapes, ``offs`` ``[E]`` int32 (rows past ``offs[-1]``
    are zeros). ``out_rows`` (int64 ``[rows]``, distinct values) scatters: row ``r`` of the
    result goes to row ``out_rows[r]`` of ``out`` (``[R, N]``, given by the caller; the rows of
    ``out`` that no ``out_rows[r]`` names are left as they are, so where the map covers every
    row ``out`` may come from torch.empty). ``out`` is fp32, or (``b_major="mn"``) bf16: the
    fp32 sums rounded once to nearest even, the bits of ``out.float().to(torch.bfloat16)``, half
    the bytes written (the backward's dx where each token has one pair). The map is trusted: its
    values must lie in [0, R). Every result row is written by the kernels (no fill of the output
    first). ``cluster`` 2: CTA pairs that compute column tiles n, n + 1 of one row block load
    the A rows once between them (TMA multicast), where N / 256 is even; 1: every CTA loads its
    own. The same bits either way. Default: MOKGEN_BWD_ROWS_CLUSTER, else rows_cluster(N).
    ``out_dtype`` (without a map): the dtype of the output it allocates, torch.float32 (default)
    or, with ``b_major="mn"``, torch.bfloat16 (the rounding above).
    ``a_index`` (int64 ``[rows]``, values in ``[0, S)``, trusted): A's rows gathered by the
    kernel, row ``r`` of A being row ``a_index[r]`` of ``pairs[0][0]`` (``[S, K]``), with no
    gathered copy made (the backward's dh = dOut Wd from dOut's token rows; MOKGEN_BWD_DOUT);
    one pair, ``b_major="mn"``, single CTAs (``cluster`` is not used). The bits of the call on
    ``A.index_select(0, a_index)``."""
    import torch

    if cluster is None:
        cluster = env.bwd_rows_cluster()
    if cluster not in (None, 1, 2):
        raise InputError(f"cluster must be 1 or 2, got {cluster!r}")
    if b_major not in ("mn", "k"):
        raise InputError(f"b_major must be 'mn' or 'k', got {b_major!r}")
    if not 1 <= len(pairs) <= 2:
        raise InputError(f"rows_gemm takes one or two (A, B) pairs, got {len(pairs)}")
    for p, (a, b) in enumerate(pairs):
        _check_operand(f"A[{p}]", a, 2)
        _check_operand(f"B[{p}]", b, 3)
    a0, b0 = pairs[0]
    rows, K = a0.shape
    if a_index is not None:
        if len(pairs) != 1 or b_major != "mn":
            raise InputError("rows_gemm: a_index takes one (A, B) pair with b_major='mn'")
        rows = _check_index(a_index, None, a0.device)
    E = b0.shape[0]
    N = b0.shape[2] if b_major == "mn" else b0.shape[1]
    want_b = (E, K, N) if b_major == "mn" else (E, N, K)
    for p, (a, b) in enumerate(pairs):
        if (a_index is None and tuple(a.shape) != (rows, K)) or tuple(b.shape) != want_b or a.device != a0.device or b.device != a0.device:
            raise InputError(f"pair {p}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit A [rows, K] = "
                             f"{(rows, K)} and B {'[E, K, N]' if b_major == 'mn' else '[E, N, K]'} = {want_b} "
                             f"on {a0.device}")
    if N == 0 or K == 0 or N % BLOCK_N or K % BLOCK_K:
        raise InputError(f"rows_gemm needs N, K > 0 with N % {BLOCK_N} == 0 and K % {BLOCK_K} == 0, got N = {N}, "
                         f"K = {K}")
    if cluster is None:
        cluster = rows_cluster(N)
    _check_offs(offs, E, a0.device)
    if out_rows is None:
        if out is not None:
            raise InputError("rows_gemm: pass out together with out_rows (without a map it allocates its own)")
        out_dtype = torch.float32 if out_dtype is None else out_dtype
        if out_dtype not in ((torch.float32, torch.bfloat16) if b_major == "mn" else (torch.float32,)):
            raise InputError(f"rows_gemm: out_dtype must be torch.float32{' or torch.bfloat16' if b_major == 'mn' else ''}"
                             f" with b_major={b_major!r}, got {out_dtype}")
        out = (torch.empty if rows and E else torch.zeros)(rows, N, dtype=out_dtype, device=a0.device)
    else:
        if out_dtype is not None:
            raise InputError("rows_gemm: out_dtype is for the output it allocates (without out_rows); with a map, out sets it")
        if not isinstance(out_rows, torch.Tensor) or out_rows.dtype != torch.int64 or tuple(out_rows.shape) != (rows,) \
                or not out_rows.is_contiguous() or out_rows.device != a0.device:
            raise InputError(f"out_rows must be a contiguous int64 tensor of shape ({rows},) on {a0.device}")
        dtypes = (torch.float32, torch.bfloat16) if b_major == "mn" else (torch.float32,)
        if not isinstance(out, torch.Tensor) or out.dtype not in dtypes or out.dim() != 2 or out.shape[1] != N \
                or not out.is_contiguous() or out.device != a0.device:
            kinds = "float32 or bfloat16" if b_major == "mn" else "float32"
            raise InputError(f"out must be a contiguous {kinds} tensor [R, {N}] on {a0.device} with out_rows")
    if rows == 0 or E == 0:
        if rows and out_rows is not None:  # no expert: every row is past offs[-1]
            out.index_fill_(0, out_rows, 0.0)
        return out
    if a_index is not None:
        with _on(a0.device) as stream:
            load_library().rows_gathered(out.data_ptr(), a0.data_ptr(), a_index.data_ptr(), b0.data_ptr(),
                                         offs.data_ptr(), E, rows, K, N,
                                         out_rows.data_ptr() if out_rows is not None else None,
                                         int(out.dtype == torch.bfloat16), stream)
        return out
    a1, b1 = pairs[1] if len(pairs) > 1 else (a0, b0)
    with _on(a0.device) as stream:
        load_library().rows(out.data_ptr(), a0.data_ptr(), b0.data_ptr(), a1.data_ptr(), b1.data_ptr(), len(pairs),
                            offs.data_ptr(), E, rows, K, N, int(b_major == "mn"),
                            out_rows.data_ptr() if out_rows is not None else None,
                            int(out.dtype == torch.bfloat16), cluster, stream)
    return out


#: the largest stagger lead: the stage ring's four stages less the one warpgroup 0 loads into
MAX_LEAD = 3


def set_stagger(lead: int | bool) -> None:
    """The GEMMs' two consumer warpgroups staggered, for the launches that follow in this process:
    warpgroup 0 leads by ``lead`` k-blocks (0 to MAX_LEAD; 0 or False: lockstep; True: the
    default, ``env.BWD_STAGGER_DEFAULT``), so one's epilogue overlaps the other's wgmma. The
    same bits at every lead (benchmarks compare them)."""
    if lead is True:
        lead = env.BWD_STAGGER_DEFAULT
    lead = int(lead)
    if not 0 <= lead <= MAX_LEAD:
        raise InputError(f"stagger lead must be 0 to {MAX_LEAD} k-blocks, got {lead}")
    load_library().set_stagger(lead)


def expert_major(topk_ids, experts: int, topk_weights=None):
    """The backward's rows: ``(order, tok, offs, wts)`` for ``topk_ids [T, K]`` (int32) and
    ``experts`` experts (at most EXPERT_MAJOR_MAX_EXPERTS): ``order [T K]`` int64, the pairs
    ``t * K + j`` sorted by expert id, stable, the pairs whose id is outside ``[0, experts)``
    last; ``tok = order // K``; ``offs [experts]`` int32, the inclusive prefix sums of the pairs
    per expert; ``wts [T K]`` = ``topk_weights.reshape(-1)[order]`` (``topk_weights [T, K]``
    fp32), or None without weights. What mokgen.backward._pairs_expert_major and a cumsum, a
    division and a gather give, without the dozen small operations (and their host time) those
    take: a counting sort over chunks of 1024 pairs in three launches, O(pairs + experts x
    chunks), the same result on every run."""
    import torch

    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype != torch.int32 or topk_ids.dim() != 2 \
            or not topk_ids.is_contiguous() or not supported(topk_ids.device):
        raise InputError("topk_ids must be a contiguous 2-d int32 tensor on a CUDA device of compute capability 9.0")
    T, K = topk_ids.shape
    n = T * K
    if not 1 <= experts <= EXPERT_MAJOR_MAX_EXPERTS or K < 1:
        raise InputError(f"expert_major needs 1 <= experts <= {EXPERT_MAJOR_MAX_EXPERTS} and K >= 1, got {experts} "
                         f"and {K}")
    if topk_weights is not None and (not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32
                                     or tuple(topk_weights.shape) != (T, K) or not topk_weights.is_contiguous()
                                     or topk_weights.device != topk_ids.device):
        raise InputError(f"topk_weights must be a contiguous float32 tensor [T, K] = {(T, K)} on {topk_ids.device}")
    dev = topk_ids.device
    order, tok = torch.empty(n, dtype=torch.int64, device=dev), torch.empty(n, dtype=torch.int64, device=dev)
    offs = torch.zeros(experts, dtype=torch.int32, device=dev) if n == 0 else torch.empty(experts, dtype=torch.int32,
                                                                                          device=dev)
    wts = None if topk_weights is None else torch.empty(n, dtype=torch.float32, device=dev)
    if n:
        lib = load_library()
        counts = torch.empty(lib.expert_major_scratch(n, experts), dtype=torch.int32, device=dev)
        with _on(dev) as stream:
            lib.expert_major(topk_ids.data_ptr(), n, experts, K, None if topk_weights is None else topk_weights.data_ptr(),
                             order.data_ptr(), tok.data_ptr(), None if wts is None else wts.data_ptr(), offs.data_ptr(),
                             counts.data_ptr(), stream)
    return order, tok, offs, wts


def sum_slots(dx_pairs, tokens: int, top_k: int):
    """``dx [tokens, H]`` bf16 from the dx rows of the (token, slot) pairs, ``dx_pairs
    [tokens * top_k, H]`` fp32 or bf16 (row ``t * top_k + j``): ``dx[t] = sum over j =
    0..top_k-1, in that order, of dx_pairs[t * top_k + j]`` in fp32, rounded once to bf16. The
    same bits as summing the slots in place in fp32 (bf16 rows converted exactly) and casting, in
    one pass (H a multiple of 4)."""
    import torch

    if not isinstance(dx_pairs, torch.Tensor) or dx_pairs.dtype not in (torch.float32, torch.bfloat16) \
            or dx_pairs.dim() != 2 or not dx_pairs.is_contiguous() or not supported(dx_pairs.device):
        raise InputError("dx_pairs must be a contiguous 2-d float32 or bfloat16 tensor on a CUDA device of compute "
                         "capability 9.0")
    H = dx_pairs.shape[1]
    if tokens < 0 or top_k < 1 or dx_pairs.shape[0] != tokens * top_k or H % 4 or dx_pairs.data_ptr() % 16:
        raise InputError(f"dx_pairs must be [tokens * top_k, H] = [{tokens} * {top_k}, H] with H % 4 == 0 and 16-byte "
                         f"aligned, got {tuple(dx_pairs.shape)}")
    out = torch.empty(tokens, H, dtype=torch.bfloat16, device=dx_pairs.device)
    if tokens and H:
        with _on(dx_pairs.device) as stream:
            load_library().sum_slots(out.data_ptr(), dx_pairs.data_ptr(), tokens, top_k, H,
                                     int(dx_pairs.dtype == torch.bfloat16), stream)
    return out


#: the weight gradients' schedules (weight_grads' ``schedule``, MOKGEN_BWD_WEIGHTS)
WEIGHT_SCHEDULES = ("split", "pingpong")
#: the mean rows per expert up to which MOKGEN_BWD_WEIGHTS=auto takes the ping-pong (6 k-blocks).
#: Measured in the fwd+bwd step (docs/perf-notes.md v0.28, interleaved, ping-pong / split): 0.980
#: on kimi-k2.5's local rows (341 per expert), 0.979 on qwen3.5-397b-a17b's (320), 1.003 on
#: deepseek-v4-pro's (256), 0.993 on glm-5.2's (512), 1.025 on deepseek-v3's (4096): a short K
#: leaves the split tile's epilogue a large share of its period, which the ping-pong overlaps.
#: Since v0.30 only where the consumers zero the short last k-block (MOKGEN_BWD_TAIL=zero): with
#: the bounded maps (tail tma, the default's for the split) the split tiles' three weight
#: gradients are faster than the ping-pong's at every measured size (docs/perf-notes.md v0.30).
PINGPONG_MAX_ROWS = 384


def weight_schedule(rows: int, experts: int, *, gathered: bool = False) -> str:
    """The weight gradients' schedule for ``rows`` rows over ``experts`` experts: MOKGEN_BWD_WEIGHTS
    where it names one, else (``auto``) the split, but under MOKGEN_BWD_TAIL=zero the ping-pong
    where the mean rows per expert are at most PINGPONG_MAX_ROWS and no operand comes through a
    token index (``gathered``: only the split schedule gathers)."""
    mode = env.bwd_weights()
    if mode != "auto":
        return mode
    if env.bwd_tail() != "zero":
        return "split"
    return "pingpong" if not gathered and rows <= PINGPONG_MAX_ROWS * max(1, experts) else "split"


#: how a weight-gradient tile's short last k-block (the expert's rows end inside it) gets the rows
#: past the expert out of its sums: "tma", per-expert copies of the operands' tensor maps whose row
#: count ends at the expert's last row, so the TMA loads zeros there and the k-block runs as a
#: full one (v0.30); "steps", the same maps, and the split tiles' k-block runs only its 16-row
#: steps that hold expert rows, peeled after the loop with no drain (v0.32; the ping-pong runs it
#: as "tma"); "zero", the consumers zero those rows in shared memory and run the k-block alone
#: after the loop, drained before and after; "auto", the measured faster per schedule
#: (TAIL_AUTO). The same bits every way (MOKGEN_BWD_TAIL).
WEIGHT_TAILS = ("auto", "tma", "zero", "steps")
#: the tail "auto" takes per schedule (docs/perf-notes.md v0.30: the bounded maps took 3-6% off
#: the split tiles' weight GEMMs and added 2-8% to the ping-pong's; v0.32: "steps" took another
#: 3-6% off the split tiles' three weight gradients against "tma")
TAIL_AUTO = {"split": "steps", "pingpong": "zero"}
#: bytes of bounded tensor maps per expert (bwd_gemm.cuh kBoundedMaps, 128 bytes each)
_BOUNDED_MAP_BYTES = 3 * 128


def _weight_tail(tail: str | None) -> str:
    """``tail`` checked against WEIGHT_TAILS (None: MOKGEN_BWD_TAIL), not yet resolved."""
    tail = env.bwd_tail() if tail is None else tail
    if tail not in WEIGHT_TAILS:
        raise InputError(f"tail must be one of {', '.join(WEIGHT_TAILS)}, got {tail!r}")
    return tail


def weight_tail(tail: str | None, schedule: str) -> str:
    """The tail ("tma", "steps" or "zero") that a weight-gradient launch of ``schedule`` runs with for
    ``tail`` (None: MOKGEN_BWD_TAIL; "auto": TAIL_AUTO)."""
    tail = _weight_tail(tail)
    return TAIL_AUTO[schedule] if tail == "auto" else tail


def _bounded_ws(tail: str, experts: int, device):
    """The device memory that the weight entries write the experts' bounded maps into (tail
    "tma" or "steps"), else None. From the caching allocator on the launch's stream: freed after
    the call, its reuse ordered after the launch."""
    if tail not in ("tma", "steps"):
        return None
    import torch

    return torch.empty(experts * _BOUNDED_MAP_BYTES, dtype=torch.uint8, device=device)


def dh_swiglu_saved(go, w_down, gu, order, wt, offs, clamp_limit=None, a_index=None):
    """``(hw, dg, du, d_wt)`` as ``swiglu_grads_saved(gu, order, rows_gemm([(go, w_down)], offs),
    wt, offs, clamp_limit)`` in one kernel: the rows GEMM ``dh_u = go @ w_down[e]`` (fp32, never
    stored) with SwiGLU's backward from the saved pre-activations in its epilogue. ``go [rows,
    H]`` bf16 (expert-major rows), ``w_down [E, H, I]`` bf16, ``gu [pairs, 2 I]`` bf16, ``order
    [rows]`` int64 (values in ``[0, pairs)``), ``wt [rows]`` fp32, ``offs [E]`` int32; H % 64 ==
    0, I % 256 == 0. ``hw``, ``dg``, ``du`` have the two passes' bits (zeros from ``offs[-1]``
    on); ``d_wt`` sums each row's products per 256 columns, then the column tiles in order (the
    same result on every run; within rounding of the two passes' one per-row order).
    ``a_index`` (int64 ``[rows]``, values in ``[0, S)``, trusted): ``go`` is ``[S, H]`` (dOut) and
    row ``r``'s operand is row ``a_index[r]`` of it, loaded through the index by the kernel (no
    gathered copy; the bits of ``go.index_select(0, a_index)``). Measured slower than
    the two passes (v0.14: 971 us against 785 + 117 on kimi-k2.5's local rows; v0.24: 1.11-1.20
    ms against 0.74 on the qwen3.5-35b-a3b layer's shapes, the epilogue's arithmetic on 8 warps
    per SM with the tensor core idle). The backward takes it where MOKGEN_BWD_DH_SWIGLU=1 (off by
    default; docs/perf-notes.md v0.24)."""
    import torch

    _check_operand("go", go, 2)
    _check_operand("w_down", w_down, 3)
    _check_operand("gu", gu, 2)
    rows, H = go.shape
    if a_index is not None:
        rows = _check_index(a_index, None, go.device)
    E, I = w_down.shape[0], w_down.shape[2]
    if tuple(w_down.shape) != (E, H, I) or w_down.device != go.device:
        raise InputError(f"w_down must be [E, H, I] with H = {H} (go's columns) on {go.device}, got "
                         f"{tuple(w_down.shape)}")
    if H == 0 or I == 0 or H % BLOCK_K or I % BLOCK_N:
        raise InputError(f"dh_swiglu_saved needs H % {BLOCK_K} == 0 and I % {BLOCK_N} == 0 (both positive), got "
                         f"H = {H}, I = {I}")
    pairs = gu.shape[0]
    if tuple(gu.shape) != (pairs, 2 * I) or gu.device != go.device:
        raise InputError(f"gu must be [pairs, 2 I] = [*, {2 * I}] on {go.device}, got {tuple(gu.shape)}")
    if not isinstance(order, torch.Tensor) or order.dtype != torch.int64 or tuple(order.shape) != (rows,) \
            or not order.is_contiguous() or order.device != go.device:
        raise InputError(f"order must be a contiguous int64 tensor of shape ({rows},) on {go.device}")
    if rows > pairs:
        raise InputError(f"order has {rows} rows, more than gu's {pairs} pairs")
    if not isinstance(wt, torch.Tensor) or wt.dtype != torch.float32 or tuple(wt.shape) != (rows,) \
            or not wt.is_contiguous() or wt.device != go.device:
        raise InputError(f"wt must be a contiguous float32 tensor of shape ({rows},) on {go.device}")
    _check_clamp(clamp_limit)
    if not isinstance(offs, torch.Tensor) or offs.dim() != 1 or offs.shape[0] != E:
        raise InputError(f"offs must be a 1-d int32 tensor of the {E} experts' row ends (inclusive prefix sums)")
    _check_offs(offs, E, go.device)
    h, dg, du = (torch.empty(rows, I, dtype=torch.bfloat16, device=go.device) for _ in range(3))
    dw_part = torch.zeros(rows, I // BLOCK_N, dtype=torch.float32, device=go.device)
    if rows and E:
        clamp = clamp_limit is not None
        with _on(go.device) as stream:
            load_library().dh_swiglu_saved(h.data_ptr(), dg.data_ptr(), du.data_ptr(), dw_part.data_ptr(),
                                           go.data_ptr(), w_down.data_ptr(), gu.data_ptr(), order.data_ptr(),
                                           wt.data_ptr(), offs.data_ptr(), E, rows, H, I, int(clamp),
                                           float(clamp_limit) if clamp else 0.0,
                                           None if a_index is None else a_index.data_ptr(), stream)
    elif rows:  # no expert: every row is past offs[-1]
        for t in (h, dg, du):
            t.zero_()
    return h, dg, du, dw_part.sum(dim=1)


def _weight_cluster(cluster: int | None) -> int:
    """The weight gradients' CTAs per cluster: ``cluster``, else MOKGEN_BWD_CLUSTER; 1 or 2."""
    cluster = env.bwd_cluster() if cluster is None else cluster
    if cluster not in (1, 2):
        raise InputError(f"cluster must be 1 or 2, got {cluster!r}")
    return cluster


def _weight_experts(fn: str, M: int, N: int, offs, device) -> int:
    """The weight gradients' tile-sized M and N and their offsets checked; returns the experts."""
    import torch

    if M == 0 or N == 0 or M % BLOCK_M or N % BLOCK_N:
        raise InputError(f"{fn} needs M, N > 0 with M % {BLOCK_M} == 0 and N % {BLOCK_N} == 0, got M = {M}, N = {N}")
    if not isinstance(offs, torch.Tensor) or offs.dim() != 1:
        raise InputError("offs must be a 1-d int32 tensor (the rows per expert, inclusive prefix sums)")
    E = offs.shape[0]
    _check_offs(offs, E, device)
    return E


def weight_tiles(experts: int, M: int, N: int, schedule: str = "split") -> int:
    """Output tiles of a weight-gradient launch over ``experts`` experts' ``[M, N]`` gradients
    (128 x 256 tiles on the split schedule, 128 x 128 on the ping-pong): its busy CTAs, one tile
    each where there are no more tiles than CTAs."""
    if schedule not in WEIGHT_SCHEDULES:
        raise InputError(f"schedule must be one of {', '.join(WEIGHT_SCHEDULES)}, got {schedule!r}")
    return experts * (M // BLOCK_M) * (N // (BLOCK_N if schedule == "split" else BLOCK_N // 2))


def weight_grads(a, b, offs, *, cluster: int | None = None, schedule: str | None = None, a_index=None,
                 tail: str | None = None):
    """``out [E, M, N] bf16``, ``out[e] = A[rows of e]^T @ B[rows of e]`` (fp32 accumulation in
    row order): ``A [rows, M]``, ``B [rows, N]`` bf16, ``offs [E]`` int32; zeros for an expert
    without rows. ``cluster`` 2: CTA pairs that compute row blocks m, m + 1 of one tile column
    load B once between them (TMA multicast), where M / 128 is even; 1: every CTA loads its own.
    Default: MOKGEN_BWD_CLUSTER (1). ``schedule`` "split": tiles of 128 x 256 split between the
    two consumer warpgroups; "pingpong": tiles of 128 x 128, each one warpgroup's, the two taking
    turns at the k-loop (the stagger lead: how many k-blocks before its last one a warpgroup
    hands the turn over) so one's epilogue overlaps the other's wgmma. Default:
    ``weight_schedule`` (MOKGEN_BWD_WEIGHTS; ``auto``: the split, or under MOKGEN_BWD_TAIL=zero
    the ping-pong for short experts, mean rows at most PINGPONG_MAX_ROWS). The same bits every way.
    ``a_index`` (int64 ``[rows]``, values in ``[0, S)``, trusted): A's rows gathered by the
    kernel, row ``r`` of A being row ``a_index[r]`` of ``a`` (``[S, M]``), with no gathered copy
    made (the backward's dW_down = dOut^T hw from dOut's token rows; MOKGEN_BWD_DOUT); the split
    schedule, single CTAs (``cluster`` is not used). The bits of the call on
    ``a.index_select(0, a_index)``. ``tail``: one of WEIGHT_TAILS (default MOKGEN_BWD_TAIL), how
    a short last k-block leaves out the next expert's rows (weight_tail); the same bits every way."""
    import torch

    cluster = _weight_cluster(cluster)
    _weight_tail(tail)
    if schedule is not None and schedule not in WEIGHT_SCHEDULES:
        raise InputError(f"schedule must be one of {', '.join(WEIGHT_SCHEDULES)}, got {schedule!r}")

    _check_operand("A", a, 2)
    _check_operand("B", b, 2)
    rows, M = a.shape
    if schedule is None:
        schedule = weight_schedule(b.shape[0], offs.shape[0] if isinstance(offs, torch.Tensor) else 0,
                                   gathered=a_index is not None)
    if a_index is not None:
        if schedule != "split":
            raise InputError(f"weight_grads: a_index needs the split schedule, got {schedule!r}")
        rows = _check_index(a_index, b.shape[0], a.device)
    N = b.shape[1]
    if b.shape[0] != rows or b.device != a.device:
        raise InputError(f"A {tuple(a.shape)} and B {tuple(b.shape)} must have the same rows, on one device")
    E = _weight_experts("weight_grads", M, N, offs, a.device)
    if rows == 0 or E == 0:
        return torch.zeros(E, M, N, dtype=torch.bfloat16, device=a.device)
    out = torch.empty(E, M, N, dtype=torch.bfloat16, device=a.device)
    tail = weight_tail(tail, schedule)
    ws = _bounded_ws(tail, E, a.device)
    ws_ptr = None if ws is None else ws.data_ptr()
    load_library().set_tail_steps(tail == "steps")
    if a_index is not None:
        with _on(a.device) as stream:
            load_library().weights_gathered(out.data_ptr(), a.data_ptr(), a_index.data_ptr(), b.data_ptr(),
                                            offs.data_ptr(), E, rows, M, N, ws_ptr, stream)
        return out
    with _on(a.device) as stream:
        load_library().weights(out.data_ptr(), a.data_ptr(), b.data_ptr(), offs.data_ptr(), E, rows, M, N, cluster,
                               int(schedule == "pingpong"), ws_ptr, stream)
    return out


def weight_grads_joint(a0, a1, b, offs, *, cluster: int | None = None, b_index=None, tail: str | None = None,
                       slot_sum=None):
    """``(out0, out1)`` = ``(weight_grads(a0, b, offs), weight_grads(a1, b, offs))`` in one launch
    (the split schedule): the gate's and up's ``dW = dg^T x``, ``du^T x`` over their shared x rows.
    The two problems' tiles are stacked along M and an expert's tiles of both are walked together,
    so its B rows are read from memory once for both instead of once per launch; each tile is the
    single problem's, so the bits are weight_grads'. ``a0``, ``a1`` ``[rows, M]``, ``b [rows, N]``
    bf16; the outputs ``[E, M, N]`` bf16, two allocations (a custom op's outputs may not alias).
    ``cluster`` as weight_grads (2 needs M / 128 even).
    ``b_index`` (int64 ``[rows]``, values in ``[0, S)``, trusted): B's rows gathered by the kernel,
    row ``r`` of B being row ``b_index[r]`` of ``b`` (``[S, N]``), with no gathered copy made (the
    backward's x rows through the token index; MOKGEN_BWD_X=inline); single CTAs (``cluster`` is
    not used). The bits of the call on ``b.index_select(0, b_index)``. ``tail`` as weight_grads.
    ``slot_sum`` = ``(dx_pairs, tokens, top_k)`` (B by TMA only, not with ``b_index``): the launch
    also returns ``sum_slots(dx_pairs, tokens, top_k)``, computed by its producer warpgroup's idle
    warps beside the GEMM (bf16 ``dx_pairs``, the same bits; MOKGEN_BWD_SUM=side): ``(out0, out1,
    dx)`` then."""
    import torch

    cluster = _weight_cluster(cluster)
    tail = weight_tail(tail, "split")
    _check_operand("A0", a0, 2)
    _check_operand("A1", a1, 2)
    _check_operand("B", b, 2)
    rows, M = a0.shape
    N = b.shape[1]
    if b_index is not None:
        _check_index(b_index, rows, a0.device, name="b_index")
    if tuple(a1.shape) != (rows, M) or (b_index is None and b.shape[0] != rows) or a1.device != a0.device \
            or b.device != a0.device:
        raise InputError(f"A0 {tuple(a0.shape)}, A1 {tuple(a1.shape)} and B {tuple(b.shape)} must be [rows, M], "
                         f"[rows, M] and [rows, N] on one device")
    E = _weight_experts("weight_grads_joint", M, N, offs, a0.device)
    summed = None
    if slot_sum is not None:
        if b_index is not None:
            raise InputError("slot_sum rides on the joint launch's TMA producer: not with b_index")
        pairs, tokens, top_k = slot_sum
        if not isinstance(pairs, torch.Tensor) or pairs.dtype != torch.bfloat16 or pairs.dim() != 2 \
                or not pairs.is_contiguous() or pairs.device != a0.device:
            raise InputError("slot_sum's dx_pairs must be a contiguous 2-d bfloat16 tensor on A0's device")
        H = pairs.shape[1]
        if tokens < 1 or top_k < 1 or pairs.shape[0] != tokens * top_k or H % 8 or pairs.data_ptr() % 16:
            raise InputError(f"slot_sum's dx_pairs must be [tokens * top_k, H] = [{tokens} * {top_k}, H] with H % 8 "
                             f"== 0 and 16-byte aligned, got {tuple(pairs.shape)}")
        # no launch to ride on (no rows or no experts): the sum's own
        summed = (torch.empty(tokens, H, dtype=torch.bfloat16, device=a0.device) if rows and E
                  else sum_slots(pairs, tokens, top_k))
    alloc = torch.zeros if rows == 0 or E == 0 else torch.empty
    out0, out1 = (alloc(E, M, N, dtype=torch.bfloat16, device=a0.device) for _ in range(2))
    if rows and E:
        ws = _bounded_ws(tail, E, a0.device)
        ws_ptr = None if ws is None else ws.data_ptr()
        load_library().set_tail_steps(tail == "steps")
        with _on(a0.device) as stream:
            if b_index is not None:
                load_library().weights2_gathered(out0.data_ptr(), out1.data_ptr(), a0.data_ptr(), a1.data_ptr(),
                                                 b.data_ptr(), b_index.data_ptr(), offs.data_ptr(), E, rows, M, N,
                                                 ws_ptr, stream)
            else:
                sum_args = ((summed.data_ptr(), pairs.data_ptr(), tokens, top_k, H) if summed is not None
                            else (None, None, 0, 0, 0))
                load_library().weights2(out0.data_ptr(), out1.data_ptr(), a0.data_ptr(), a1.data_ptr(), b.data_ptr(),
                                        offs.data_ptr(), E, rows, M, N, cluster, ws_ptr, *sum_args, stream)
    return (out0, out1) if summed is None else (out0, out1, summed)


def swiglu_grads(x, w_gate, w_up, dh_u, wt, offs, clamp_limit=None):
    """``(hw, dg, du, d_wt)`` for the rows of each expert ``e``: ``g = x Wg[e]^T``, ``u = x Wu[e]^T``
    recomputed in fp32 (never stored), ``h = swiglu(g, u)`` (mokgen.reference.swiglu, clamp
    included), ``hw = h * wt[:, None]`` (the weighted activation: the down projection's weight
    gradient is ``dOut^T hw``), ``dg, du`` the input gradients for ``dh = dh_u * wt[:, None]``,
    all three bf16 ``[rows, I]``, and ``d_wt[r] = sum_c dh_u[r, c] h[r, c]`` (fp32 ``[rows]``,
    summed per 128 columns, then over the column tiles in order). ``x [rows, H]``, ``w_gate / w_up [E, I, H]``
    bf16, ``dh_u [rows, I]`` and ``wt [rows]`` fp32, ``offs [E]`` int32."""
    import torch

    _check_operand("x", x, 2)
    _check_operand("w_gate", w_gate, 3)
    _check_operand("w_up", w_up, 3)
    rows, H = x.shape
    E, I = w_gate.shape[0], w_gate.shape[1]
    if tuple(w_gate.shape) != (E, I, H) or tuple(w_up.shape) != (E, I, H):
        raise InputError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must both be [E, I, H] with "
                         f"H = {H} (x's columns)")
    _check_row_floats(dh_u, wt, rows, I, x.device)
    if H == 0 or I == 0 or H % BLOCK_K or I % (BLOCK_N // 2):
        raise InputError(f"swiglu_grads needs H, I > 0 with H % {BLOCK_K} == 0 and I % {BLOCK_N // 2} == 0, got "
                         f"H = {H}, I = {I}")
    if dh_u.data_ptr() % 8:
        raise InputError("dh_u must start at an 8-byte aligned address (the kernel reads float pairs)")
    _check_clamp(clamp_limit)
    _check_offs(offs, E, x.device)
    parts = I // (BLOCK_N // 2)
    h, dg, du = (torch.zeros(rows, I, dtype=torch.bfloat16, device=x.device) for _ in range(3))
    dw_part = torch.zeros(rows, parts, dtype=torch.float32, device=x.device)
    if rows and E:
        clamp = clamp_limit is not None
        with _on(x.device) as stream:
            load_library().swiglu(h.data_ptr(), dg.data_ptr(), du.data_ptr(), dw_part.data_ptr(), x.data_ptr(),
                                  w_gate.data_ptr(), w_up.data_ptr(), dh_u.data_ptr(), wt.data_ptr(), offs.data_ptr(),
                                  E, rows, H, I, int(clamp), float(clamp_limit) if clamp else 0.0, stream)
    return h, dg, du, dw_part.sum(dim=1)


def swiglu_grads_saved(gu, order, dh_u, wt, offs, clamp_limit=None):
    """:func:`swiglu_grads`'s outputs ``(hw, dg, du, d_wt)`` from saved pre-activations instead of
    a recompute: ``gu [pairs, 2 I]`` bf16 (row ``p``: g then u of pair ``p``, as the forward's
    ``save_gu`` output), ``order [rows]`` int64 (the pair of each expert-major row, values in
    ``[0, pairs)``), ``dh_u [rows, I]`` fp32 or bf16 (the dh GEMM's output rounded once,
    MOKGEN_BWD_DH; read as exact fp32 values), ``wt [rows]`` fp32, ``offs [E]`` int32. Rows from
    ``offs[-1]`` on (pairs no expert computed) get zeros. ``d_wt`` is each row's sum in one fixed
    order (not the recompute's per-128-column partial sums, so the two policies agree within
    rounding, not bit for bit)."""
    import torch

    _check_operand("gu", gu, 2)
    pairs, I2 = gu.shape
    I = I2 // 2
    if I2 % 16 or I == 0:
        raise InputError(f"gu must be [pairs, 2 I] with I a positive multiple of 8, got {tuple(gu.shape)}")
    if not isinstance(order, torch.Tensor) or order.dtype != torch.int64 or order.dim() != 1 \
            or not order.is_contiguous() or order.device != gu.device:
        raise InputError(f"order must be a contiguous 1-d int64 tensor on {gu.device}")
    rows = order.shape[0]
    if rows > pairs:
        raise InputError(f"order has {rows} rows, more than gu's {pairs} pairs")
    _check_row_floats(dh_u, wt, rows, I, gu.device, dh_bf16_ok=True)
    if dh_u.data_ptr() % 16:
        raise InputError("dh_u must start at a 16-byte aligned address (the kernel reads 16-byte vectors)")
    _check_clamp(clamp_limit)
    if not isinstance(offs, torch.Tensor) or offs.dim() != 1 or offs.shape[0] == 0:
        raise InputError("offs must be a non-empty 1-d int32 tensor (the rows per expert, inclusive prefix sums)")
    E = offs.shape[0]
    _check_offs(offs, E, gu.device)
    h, dg, du = (torch.empty(rows, I, dtype=torch.bfloat16, device=gu.device) for _ in range(3))
    d_wt = torch.empty(rows, dtype=torch.float32, device=gu.device)
    if rows:
        clamp = clamp_limit is not None
        with _on(gu.device) as stream:
            load_library().swiglu_saved(h.data_ptr(), dg.data_ptr(), du.data_ptr(), d_wt.data_ptr(), gu.data_ptr(),
                                        order.data_ptr(), dh_u.data_ptr(), wt.data_ptr(), offs.data_ptr(), E, rows, I,
                                        int(clamp), float(clamp_limit) if clamp else 0.0,
                                        int(dh_u.dtype == torch.bfloat16), stream)
    return h, dg, du, d_wt


_forced: bool | None = None


@contextmanager
def forced(on: bool):
    """Within the block, mokgen.backward uses these GEMMs (``on``) or torch._grouped_mm whatever
    MOKGEN_BWD_GEMM says (the bench times both in one run this way). Not thread-local."""
    global _forced
    saved, _forced = _forced, bool(on)
    try:
        yield
    finally:
        _forced = saved


#: why the library could not be had in this process, by build cache directory (None: it loaded)
_unavailable: dict[str, str | None] = {}


def available() -> bool:
    """Whether the library loads here (found in the cache, or built now); the first failure
    (no nvcc, MOKGEN_DISABLE_JIT=1 without a build, ...) warns once, and the answer is kept for
    the process and cache directory."""
    key = str(env.cache_dir())
    if key not in _unavailable:
        try:
            load_library()
            _unavailable[key] = None
        except MokgenError as err:
            import warnings

            _unavailable[key] = str(err)
            warnings.warn(f"mokgen: the backward GEMM library is not available ({err}); the backward runs on "
                          "torch._grouped_mm", stacklevel=2)
    return _unavailable[key] is None


def usable(hidden: int, inter: int, device) -> bool:
    """Whether mokgen.backward can take these GEMMs for a layer of hidden size ``hidden`` and
    intermediate size ``inter`` on ``device``: MOKGEN_BWD_GEMM on (the default; or a
    :func:`forced` block), an sm_90 device, tile-sized H and I (N % 256 for both orientations,
    M % 128), and the library :func:`available` (a forced block skips that check, so that a
    missing library is an error there)."""
    if not (env.bwd_gemm_enabled() if _forced is None else _forced):
        return False
    if not (supported(device) and hidden % BLOCK_N == 0 and inter % BLOCK_N == 0):
        return False
    return bool(_forced) or available()


def fused_backward(go, x_rows, w_gate, w_up, w_down, gu, order, wt, offs, clamp_limit=None, *,
                   chunk: int | None = None, lag: int | None = None):
    """The save policy's experts backward in one persistent launch (v0.23; ``fused_kernel`` in
    templates/bwd_gemm.cu, its order in templates/include/mokgen/bwd_fused.cuh): ``dh = go @
    w_down[e]`` (bf16), SwiGLU's backward from the saved pre-activations (by the producer
    warpgroup's idle warps, overlapping the GEMMs), ``dx = dg @ w_gate[e] + du @ w_up[e]`` per
    pair and the three weight gradients, each tile waiting only for the tiles it reads.

    ``go [rows, H]`` (dOut's rows in the rows' order) and ``x_rows [rows, H]`` bf16, ``w_gate`` /
    ``w_up [E, I, H]``, ``w_down [E, H, I]`` bf16, ``gu [pairs, 2 I]`` bf16 (the forward's saved
    g then u per pair), ``order [rows]`` int64 (the pair of each row, distinct, in ``[0,
    pairs)``), ``wt [rows]`` fp32, ``offs [E]`` int32 (the expert-major rows' ends); H and I
    multiples of 256. Returns ``(dx_pairs, d_wt, (dWg, dWu, dWd))``: ``dx_pairs [pairs, H]`` bf16
    (row ``order[r]``; zeros for the pairs no expert computed, those past ``offs[-1]``), ``d_wt
    [rows]`` fp32 (the routing weight's gradient per row, 0 past ``offs[-1]``) and the weight
    gradients in bf16. The bits of ``rows_gemm`` (bf16 dh), ``swiglu_grads_saved``, ``rows_gemm``
    (dx, bf16 pair rows), ``weight_grads`` (dWd) and ``weight_grads_joint`` (dWg, dWu) on the same
    inputs. ``chunk`` rows per group and ``lag`` (the order; default MOKGEN_BWD_FUSED_CHUNK and
    MOKGEN_BWD_FUSED_LAG) change the schedule, not the bits. Peak memory: dh [rows, I] bf16 lives
    through the launch, beside hw, dg and du."""
    import torch

    chunk = env.bwd_fused_chunk() if chunk is None else int(chunk)
    lag = env.bwd_fused_lag() if lag is None else int(lag)
    if chunk < 1 or not 1 <= lag <= 8:
        raise InputError(f"fused_backward: chunk must be >= 1 and lag 1 to 8, got {chunk} and {lag}")
    for name, t, nd in (("go", go, 2), ("x_rows", x_rows, 2), ("w_gate", w_gate, 3), ("w_up", w_up, 3),
                        ("w_down", w_down, 3), ("gu", gu, 2)):
        _check_operand(name, t, nd)
    rows, H = go.shape
    E, I = w_gate.shape[0], w_gate.shape[1]
    dev = go.device
    for name, t, shape in (("x_rows", x_rows, (rows, H)), ("w_gate", w_gate, (E, I, H)), ("w_up", w_up, (E, I, H)),
                           ("w_down", w_down, (E, H, I))):
        if tuple(t.shape) != shape or t.device != dev:
            raise InputError(f"fused_backward: {name} must be {list(shape)} on {dev}, got {list(t.shape)} on {t.device}")
    pairs = gu.shape[0]
    if tuple(gu.shape) != (pairs, 2 * I) or gu.device != dev:
        raise InputError(f"fused_backward: gu must be [pairs, 2 I] = [*, {2 * I}] on {dev}, got {list(gu.shape)}")
    if H == 0 or I == 0 or H % BLOCK_N or I % BLOCK_N:
        raise InputError(f"fused_backward needs H and I positive multiples of {BLOCK_N}, got H = {H}, I = {I}")
    if rows > pairs:
        raise InputError(f"fused_backward: {rows} rows, more than gu's {pairs} pairs")
    if not isinstance(order, torch.Tensor) or order.dtype != torch.int64 or tuple(order.shape) != (rows,) \
            or not order.is_contiguous() or order.device != dev:
        raise InputError(f"fused_backward: order must be a contiguous int64 tensor of shape ({rows},) on {dev}, got "
                         f"{getattr(order, 'dtype', type(order).__name__)} {tuple(getattr(order, 'shape', ()))}")
    if not isinstance(wt, torch.Tensor) or wt.dtype != torch.float32 or tuple(wt.shape) != (rows,) \
            or not wt.is_contiguous() or wt.device != dev:
        raise InputError(f"fused_backward: wt must be a contiguous float32 tensor of shape ({rows},) on {dev}")
    _check_clamp(clamp_limit)
    _check_offs(offs, E, dev)
    bf = torch.bfloat16
    dx = torch.empty(pairs, H, dtype=bf, device=dev)
    grads = (torch.empty(E, I, H, dtype=bf, device=dev), torch.empty(E, I, H, dtype=bf, device=dev),
             torch.empty(E, H, I, dtype=bf, device=dev))
    d_wt = torch.zeros(rows, dtype=torch.float32, device=dev)
    if rows == 0 or E == 0:
        dx.zero_()
        for g in grads:
            g.zero_()
        return dx, d_wt, grads
    hw, dg, du, dh = (torch.empty(rows, I, dtype=bf, device=dev) for _ in range(4))
    lib = load_library()
    counters = torch.empty(lib.fused_counters(rows, E), dtype=torch.int32, device=dev)
    clamp = clamp_limit is not None
    with _on(dev) as stream:
        lib.fused(dx.data_ptr(), grads[0].data_ptr(), grads[1].data_ptr(), grads[2].data_ptr(), hw.data_ptr(),
                  dg.data_ptr(), du.data_ptr(), d_wt.data_ptr(), dh.data_ptr(), counters.data_ptr(), go.data_ptr(),
                  x_rows.data_ptr(), w_gate.data_ptr(), w_up.data_ptr(), w_down.data_ptr(), gu.data_ptr(),
                  order.data_ptr(), wt.data_ptr(), offs.data_ptr(), E, rows, H, I, chunk, lag, int(clamp),
                  float(clamp_limit) if clamp else 0.0, stream)
    return dx, d_wt, grads
