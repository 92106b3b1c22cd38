"""MXFP8 routed experts on one GPU (issue 6): the rank-local expert work in MXFP8, on mokgen's MX
GEMMs (``mokgen.mx_gemm``). Not the megakernel yet: the stages run as separate launches, and
the activations are quantized here, where the megakernel's dispatch will quantize them.

The GEMMs' form (``form=``): ``"bf16"`` (the default) computes the exact MX product on the BF16
tensor core, the activations' E4M3 codes decoded in registers and the weights held as their MX
values in bf16 (653 TFLOP/s on the H200 against 382 for the FP8 tensor core with exact
promotion, docs/perf-notes.md v0.35); ``"quad"``, ``"decoded"`` and ``"inline"`` run the FP8
tensor core (QGMMA) with per-32 promotion. All compute the same MX product; the bits differ only
by the FP8 tensor core's narrower sums within 32 products.

Semantics (``numerics: mxfp8``; the oracle is :func:`mokgen.reference.mx_experts_forward`):
  1. each (token, j) row ``x[t]`` is quantized to MXFP8 along H (``mx_gemm.quantize_rows``, the
     bits of ``mokgen.mx.quantize``);
  2. gate and up projections: the exact products of the MX rows with the MX weights (quantized
     once along H by :func:`quantize_weights`), summed in float32;
  3. ``h = swiglu(gate, up)`` (the spec's clamp; the megakernel's SwiGLU, fast division) in
     float32, quantized to MXFP8 along I;
  4. down projection likewise (weights along I), float32;
  5. combine: ``out[t] = sum_j w[t, j] * y[t, j]`` in float32 in the fixed order j = 0..k-1,
     rounded once to bf16.
Each step is deterministic: rows are grouped by a stable sort of the expert ids, every output
element has one owner, no atomics.

Layout: the rows of each expert form a segment padded to whole 128-row tiles (the FP8 GEMM's
tile); padding rows are zero codes and never read back. The segments and the tile list are
computed on the device at a fixed size (the bound of any routing), so the forward needs no host
sync but the ids' range check, which ``check_ids=False`` skips.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mokgen import env, mx, mx_gemm, reference
from mokgen.errors import InputError
from mokgen.plan import row_bytes

__all__ = ["MXExpertWeights", "quantize_weights", "experts_forward", "experts_forward_train", "bytes_per_row"]


#: the GEMM forms mx_experts accepts: the bf16-math form, then mx_gemm's FP8 forms
FORMS = ("bf16", *mx_gemm.FORMS)


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise InputError(f"form must be one of {list(FORMS)}, got {form!r}")


@dataclass
class MXExpertWeights:
    """Expert weights quantized once for the MXFP8 kernels: ``gate_up`` codes ``[E, 2I, H]``
    (gate rows first, then up) and ``down`` codes ``[E, H, I]``, their E8M0 scales in the grouped
    kernel's blocked layout (``mx_gemm.block_expert_scales``), and the same MX values as bf16 with
    k permuted for the bf16-math form (``gate_up_bf16``, ``down_bf16``). The codes are None when
    only the bf16-math form will run (``quantize_weights(..., codes=False)``). With
    ``interleaved``, ``gate_up_bf16``'s rows are gate and up interleaved in 128s (each 256 rows:
    128 gate rows, then the same up rows), for the up projection with SwiGLU and h's quantization
    fused (``mx_gemm.mx_bf16_math_swiglu_gemm``); the codes keep gate then up. ``gate_up_parts``
    (in place of ``gate_up_bf16``, training only): gate's and up's bf16 MX values ``[E, I, H]``
    apart, as the MXFP8 layer's cache holds them; the gate | up GEMM then runs as two launches
    into the halves of one float32 gate | up."""

    gate_up: torch.Tensor | None
    gate_up_scales: torch.Tensor | None
    down: torch.Tensor | None
    down_scales: torch.Tensor | None
    gate_up_bf16: torch.Tensor | None = None
    down_bf16: torch.Tensor | None = None
    interleaved: bool = False
    gate_up_parts: tuple | None = None

    def _gate_up_any(self) -> torch.Tensor:
        for t in (self.gate_up, self.gate_up_bf16):
            if t is not None:
                return t
        return self.gate_up_parts[0]

    @property
    def num_experts(self) -> int:
        return self._gate_up_any().shape[0]

    @property
    def hidden(self) -> int:
        return self._gate_up_any().shape[2]

    @property
    def inter(self) -> int:
        return self.down_bf16.shape[2] if self.down is None else self.down.shape[2]


def _decoded_stack(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per expert, ``mx_gemm.bf16_math_weights`` (the PyTorch expression) of codes ``[E, N, K]`` and
    unblocked scales ``[E, N, K / 32]``."""
    return torch.stack([mx_gemm.bf16_math_weights(c, sc) for c, sc in zip(codes, scales)])


def quantize_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
                     codes: bool = True, interleave: bool = True) -> MXExpertWeights:
    """``w_gate`` / ``w_up`` ``[E, I, H]`` and ``w_down`` ``[E, H, I]`` (mokgen's layout) ->
    MXFP8 along the dimension each GEMM reduces over. bf16 weights on a GPU take one kernel pass
    per tensor (``mx_gemm.expert_weights``); other dtypes or devices the PyTorch expression of
    ``mokgen.mx.quantize``, one expert at a time (the same bits). H and I must be multiples of
    128 (the GEMM's tile). ``codes=False`` keeps only the bf16-math form's operands;
    ``interleave`` (the default) lays the bf16 gate | up rows out for the fused SwiGLU epilogue."""
    if w_gate.dim() != 3 or w_gate.shape != w_up.shape or w_down.dim() != 3 \
            or w_down.shape != (w_gate.shape[0], w_gate.shape[2], w_gate.shape[1]):
        raise InputError(f"expert weights must be w_gate / w_up [E, I, H] and w_down [E, H, I], got "
                         f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}")
    E, I, H = w_gate.shape
    if H % mx_gemm.BLOCK or I % mx_gemm.BLOCK:
        raise InputError(f"MXFP8 experts need hidden and intermediate sizes that are multiples of "
                         f"{mx_gemm.BLOCK}, got H = {H}, I = {I}")
    if w_gate.is_cuda and all(w.dtype == torch.bfloat16 for w in (w_gate, w_up, w_down)):
        gu = mx_gemm.expert_weights([w_gate.contiguous(), w_up.contiguous()], codes=codes, interleave=interleave)
        dn = mx_gemm.expert_weights([w_down.contiguous()], codes=codes)
        if not codes:
            return MXExpertWeights(None, None, None, None, gu, dn, interleave)
        return MXExpertWeights(gu[1], gu[2], dn[1], dn[2], gu[0], dn[0], interleave)
    gu_codes = torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn, device=w_gate.device)
    gu_scales = torch.empty(E, 2 * I, H // 32, dtype=torch.uint8, device=w_gate.device)
    for e in range(E):
        gu_codes[e, :I], gu_scales[e, :I] = mx.quantize(w_gate[e], dim=-1)
        gu_codes[e, I:], gu_scales[e, I:] = mx.quantize(w_up[e], dim=-1)
    d_codes, d_scales = mx.quantize_experts(w_down)
    gu_bf16 = _decoded_stack(gu_codes, gu_scales)
    if interleave:  # [E, (gate, up), I / 128, 128, H] -> [E, I / 128, (gate, up), 128, H]
        gu_bf16 = gu_bf16.view(E, 2, I // 128, 128, H).transpose(1, 2).reshape(E, 2 * I, H)
    return MXExpertWeights(gu_codes, mx_gemm.block_expert_scales(gu_scales), d_codes,
                           mx_gemm.block_expert_scales(d_scales), gu_bf16, _decoded_stack(d_codes, d_scales),
                           interleave)


def _grouped(a, sa, b_bf16, b_codes, b_scales, tiles, form: str, interleaved: bool = False):
    """The grouped GEMM in ``form``; the bf16-math form needs N a multiple of 256 and falls back to
    quad (the same MX product) otherwise, and so needs the codes then."""
    if form == "bf16" and b_bf16 is not None and b_bf16.shape[1] % mx_gemm.BF16_MATH_N == 0:
        if interleaved:  # gate | up rows interleaved in 128s: C's columns likewise, put back in order
            c = mx_gemm.mx_bf16_math_grouped_gemm(a, sa, b_bf16, tiles)
            rows, n = c.shape
            return c.view(rows, n // 256, 2, 128).transpose(1, 2).reshape(rows, n)
        return mx_gemm.mx_bf16_math_grouped_gemm(a, sa, b_bf16, tiles)
    if b_codes is None:
        why = (f"form {form!r} runs on the FP8 tensor core" if form != "bf16" else
               f"N = {b_bf16.shape[1]} is not a multiple of {mx_gemm.BF16_MATH_N}, so the bf16-math form falls back "
               f"to quad")
        raise InputError(f"{why} and needs the weights' codes: quantize_weights(..., codes=True)")
    return mx_gemm.mx_grouped_gemm(a, sa, b_codes, b_scales, tiles, form="quad" if form == "bf16" else form)


def _needs_codes(form: str, *ns: int) -> bool:
    return form != "bf16" or any(n % mx_gemm.BF16_MATH_N for n in ns)


def bytes_per_row(hidden: int, numerics: str = "mxfp8") -> int:
    """Bytes of one token row as the dispatch moves it (``mokgen.plan.row_bytes``): bf16 ``2 H``;
    MXFP8 ``H`` codes plus ``H / 32`` scales (0.516x)."""
    try:
        return row_bytes(hidden, numerics)
    except ValueError as err:
        raise InputError(str(err)) from None


def _segments(flat_ids: torch.Tensor, num_experts: int, k: int, check_ids: bool = True):
    """Rows grouped by expert (a stable sort: ties keep (token, j) order), on the device with no
    host sync: each pair's row in the padded layout, each padded row's source token (-1 for
    padding), the row tiles of the grouped GEMM and the padded segment sizes (device). The tile
    list has a fixed length, ceil(n / 128) + E for n pairs, the bound of any routing; tiles past
    the segments' are (-1, 0), which the kernels skip, and the rows past them are zeros. On a GPU
    one kernel (``mx_gemm.segments``, after a sort only past 1024 experts); elsewhere the PyTorch
    expression below, its reference. ``check_ids``: raise InputError for an id outside [0, E), at the cost of one host
    sync."""
    E, n = num_experts, flat_ids.numel()
    if check_ids and bool(((flat_ids < 0) | (flat_ids >= E)).any()):
        raise InputError(f"topk_ids must lie in [0, {E})")
    if flat_ids.is_cuda:  # one kernel; past its expert count, after a stable sort
        order = None if E <= mx_gemm.SEGMENTS_MAX_UNSORTED else torch.sort(flat_ids, stable=True).indices
        return mx_gemm.segments(flat_ids, k, E, order)
    order = torch.sort(flat_ids, stable=True).indices
    block = mx_gemm.BLOCK
    counts = torch.zeros(E, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids.clamp(0, E - 1), torch.ones_like(flat_ids))
    padded = (counts + block - 1) // block * block
    shift = torch.cumsum(padded - counts, 0) - (padded - counts)  # padding rows before each segment
    row = torch.empty_like(order)
    row[order] = torch.arange(n, device=flat_ids.device) + shift[flat_ids[order].clamp(0, E - 1)]
    # tile i: the expert whose tiles cover it (a search over the cumulative tile counts)
    n_tiles = -(-n // block) + E
    per = padded // block
    ends = torch.cumsum(per, 0)
    i = torch.arange(n_tiles, device=flat_ids.device)
    expert = torch.searchsorted(ends, i, right=True)
    valid = expert < E
    e = expert.clamp(max=E - 1)
    first = (torch.cumsum(padded, 0) - padded)[e] + block * (i - (ends - per)[e])
    tiles = torch.stack([torch.where(valid, e, -1), torch.where(valid, first, 0)], 1).to(torch.int32)
    src = torch.full((block * n_tiles,), -1, dtype=torch.int32, device=flat_ids.device)
    src[row] = (torch.arange(n, device=flat_ids.device) // k).to(torch.int32)
    return row, src, tiles, padded


def _check_inputs(x, topk_ids, topk_weights, hidden: int) -> None:
    if x.dim() != 2 or x.shape[1] != hidden or x.dtype != torch.bfloat16:
        raise InputError(f"x must be bf16 [T, {hidden}], got {x.dtype} {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise InputError(f"topk_ids and topk_weights must both be [T, k] with T = {x.shape[0]}, got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")


@dataclass
class _Saved:
    """What the forward leaves for the backward: each pair's padded row, the segments and their
    tiles, the float32 gate | up rows and the float32 expert outputs."""

    row: torch.Tensor
    padded: torch.Tensor
    tiles: torch.Tensor
    gu: torch.Tensor | None  # None when the fused up projection ran (inference)
    y: torch.Tensor | None  # None when the fused combine ran (inference, k = 1)


def _forward(x, topk_ids, topk_weights, weights: MXExpertWeights, clamp_limit, form: str, check_ids: bool = True,
             keep_gu: bool = False):
    """The staged forward; ``keep_gu``: also the float32 gate | up rows (the backward's), which
    the fused up projection does not write."""
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)
    row, src, tiles, padded = _segments(flat, weights.num_experts, k, check_ids)
    rows = src.shape[0]
    # 1. the rows gathered and quantized in one pass (the megakernel's dispatch will do this on
    #    the way): padded row r holds token src[r], or zeros
    xq, xs = mx_gemm.quantize_rows(x.contiguous(), src, rows)
    if weights.gate_up_parts is not None:
        # 2. gate and up from weights held apart, each GEMM into its half of gu (training: the
        #    forward keeps gu; the same bits as the stacked weights' single GEMM)
        inter = weights.inter
        gu = torch.empty(rows, 2 * inter, dtype=torch.float32, device=x.device)
        for half, part in enumerate(weights.gate_up_parts):
            mx_gemm.mx_bf16_math_grouped_gemm(xq, xs, part, tiles, out=gu[:, half * inter:(half + 1) * inter])
        # 3. SwiGLU in float32 and h quantized along I, one pass
        hq, hs = mx_gemm.swiglu_quantize(gu, clamp_limit)
    elif form == "bf16" and weights.interleaved and not keep_gu:
        # 2-3. gate and up with SwiGLU and h's quantization in the GEMM's epilogue
        gu = None
        hq, hs = mx_gemm.mx_bf16_math_swiglu_gemm(xq, xs, weights.gate_up_bf16, tiles, clamp_limit)
    else:
        # 2. gate and up
        gu = _grouped(xq, xs, weights.gate_up_bf16, weights.gate_up, weights.gate_up_scales, tiles, form,
                      weights.interleaved)
        # 3. SwiGLU in float32 and h quantized along I, one pass
        hq, hs = mx_gemm.swiglu_quantize(gu, clamp_limit)
    if k == 1 and form == "bf16" and not keep_gu and weights.hidden % mx_gemm.BF16_MATH_N == 0:
        # 4-5. down with the combine of each token's one pair in the GEMM's epilogue (no float32 y)
        out = mx_gemm.mx_bf16_math_combine1_gemm(hq, hs, weights.down_bf16, tiles, src,
                                                 topk_weights.reshape(-1).to(torch.float32).contiguous())
        return out, _Saved(row, padded, tiles, gu, None)
    # 4. down
    y = _grouped(hq, hs, weights.down_bf16, weights.down, weights.down_scales, tiles, form)
    # 5. combine in the fixed order j = 0..k-1
    out = mx_gemm.combine(y, row, topk_weights.to(torch.float32).contiguous())
    return out, _Saved(row, padded, tiles, gu, y)


def experts_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: MXExpertWeights,
                    clamp_limit: float | None = None, *, form: str = "bf16", check_ids: bool = True) -> torch.Tensor:
    """The routed experts in MXFP8 on one GPU: ``x [T, H]`` (bf16), ``topk_ids [T, k]``,
    ``topk_weights [T, k]`` -> ``[T, H]`` bf16 (the module docstring's semantics). Inference:
    no gradient (:func:`experts_forward_train` for training). ``check_ids=False`` skips the ids'
    range check, the one host sync: the call is then free of them (CUDA graph capture)."""
    _check_inputs(x, topk_ids, topk_weights, weights.hidden)
    _check_form(form)
    if x.shape[0] == 0:
        return torch.zeros(0, weights.hidden, dtype=torch.bfloat16, device=x.device)
    return _forward(x, topk_ids, topk_weights, weights, clamp_limit, form, check_ids)[0]


# ---- training: the MXFP8 backward -----------------------------------------------------------------
#
# The oracle's semantics (mokgen.reference._MXMatmul, the transposed quantization of MX
# training): every backward GEMM quantizes its two operands along its own reduction dimension.
#   dgrad  dh = q_H(dy) q_H(W_down)        (W_down [H, I] along H: its transpose [I, H] along H)
#          dx_rows = q_2I(dgu) q_2I(W_gu)  (W_gu = [W_gate; W_up] [2I, H] along 2I)
#   wgrad  dW_down = q_n(dy)^T q_n(h),  dW_gu = q_n(dgu)^T q_n(x_rows)   (n: the expert's rows)
# with dy[t, j] = w[t, j] dOut[t], d w[t, j] = <dOut[t], y[t, j]> and the SwiGLU backward in
# float32 (the oracle's swiglu under autograd). The rows of an expert's segment start at a
# multiple of 128 and its padding rows are zeros, so the 32-row blocks along n are the oracle's
# (which pads each expert's rows with zeros to a multiple of 32). The dgrads run on the grouped
# GEMM (the forward's form) with weights quantized in the transposed orientation. The wgrads: by
# default (MOKGEN_MX_WGRAD=bf16, v0.66) on the BF16 backward's weight kernels over the operands' MX
# values as bf16 rows, each expert's rows padded to 32 (_rows32; the values made by rows_values, or
# under MOKGEN_MX_WGRAD_OPERANDS=fused by the elementwise stages themselves); else on the bf16-math
# form one launch over k ranges (each expert's padded segment, no host sync); on the FP8 forms the
# dense GEMM per expert with rows (K = its segment, after a host sync). Staged like
# the forward: the activations' quantizers are mx_gemm's kernels (along K, and along the rows with
# a transpose), the weights' quantizations mx_gemm.expert_weights' kernels on every call (a
# training step's weights change; bf16 weights on a GPU, else mokgen.mx's PyTorch expression).
# Under MOKGEN_MX_WEIGHTS=both (v0.43) the forward quantizes each weight in both orientations from
# one read (mx_gemm.expert_weights_both) and keeps the transposed values for the backward.
# The elementwise stages: fused (MOKGEN_MX_BWD_STAGES=fused, the default since v0.40, measured
# 0.764-0.887x the step): mx_gemm.combine_backward (dy, its codes along H and d w in one pass) and
# mx_gemm.swiglu_backward (dg, du, h and [dg | du]'s codes along 2 I in one pass), dx the combine
# kernel's with unit weights, at k = 1 the dgrad GEMM's combine epilogue; or (=torch) PyTorch
# expressions and the quantizers apart.


def _weight_grads(a_t: torch.Tensor, b_t: torch.Tensor, padded: torch.Tensor, form: str) -> torch.Tensor:
    """``out[e] = q_n(a_e)^T q_n(b_e)`` per expert: ``a_t`` / ``b_t`` the transposed rows
    ``[M, R]`` / ``[N, R]`` quantized along R, e's rows its padded segment; ``[E, M, N]`` float32
    (zeros for an expert without rows)."""
    (a_codes, a_scales), (b_codes, b_scales) = a_t, b_t
    E, M, N = len(padded), a_codes.shape[0], b_codes.shape[0]
    out = torch.zeros(E, M, N, dtype=torch.float32, device=a_codes.device)
    start = 0
    for e, rows in enumerate(padded.tolist()):  # the backward's host sync: a launch per expert with rows
        if rows:
            cols, blocks = slice(start, start + rows), slice(start // 32, (start + rows) // 32)
            out[e] = mx_gemm.mx_gemm(a_codes[:, cols].contiguous(), a_scales[:, blocks].contiguous(),
                                     b_codes[:, cols].contiguous(), b_scales[:, blocks].contiguous(),
                                     form="quad" if form == "bf16" else form)
        start += rows
    return out


def _transposed_weights(parts, form: str, n: int):
    """The dgrads' weights: the transpose of the stacked ``parts`` quantized along their rows,
    ``(bf16-math values, codes, blocked scales)`` (codes None when the bf16-math form runs; values
    None off the GPU kernels' path)."""
    if parts[0].is_cuda and all(p.dtype == torch.bfloat16 for p in parts):
        got = mx_gemm.expert_weights([p.contiguous() for p in parts], transpose=True,
                                     codes=_needs_codes(form, n))
        return got if isinstance(got, tuple) else (got, None, None)
    codes, scales = mx.quantize_experts(torch.cat(parts, dim=1).transpose(1, 2).contiguous())
    return _decoded_stack(codes, scales), codes, mx_gemm.block_expert_scales(scales)


def _both(form: str, I: int, H: int, *weights: torch.Tensor) -> bool:
    """Whether the forward quantizes the weights in both orientations (MOKGEN_MX_WEIGHTS=both): the
    bf16-math form throughout (no codes in either orientation), weights that
    mx_gemm.expert_weights_both takes, and dgrads that read transposed values (not
    MOKGEN_MX_DGRAD_WEIGHTS=raw, whose dgrads quantize the weights themselves)."""
    if env.mx_weights() != "both" or _needs_codes(form, 2 * I, H) or _needs_codes(form, I):
        return False
    w_gate, w_up, w_down = (w.detach() for w in weights)
    if w_down.is_cuda and _raw_dgrads(form, w_gate, w_up, w_down):  # the dgrads read no transposed values
        return False
    return mx_gemm.both_applies([w_gate, w_up]) and mx_gemm.both_applies([w_down])


def _weight_grads_ranged(a_rows: torch.Tensor, b_rows: torch.Tensor | None, padded: torch.Tensor,
                         out_dtype: torch.dtype, b_bf16: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_weight_grads` on the bf16-math form in one launch and no host sync: ``out[e] =
    q_n(a_e)^T q_n(b_e)`` for the token rows ``a_rows [R, M]`` (float32) and ``b_rows [R, N]``
    (float32 or bf16), each expert's k range its padded segment (empty: zeros), ``[E, M, N]`` in
    ``out_dtype``. ``b_bf16``: ``mx_gemm.cols_bf16_math(b_rows)`` when the caller has it (then
    ``b_rows`` may be None)."""
    # codes and blocked scales in one pass (v0.41); the padded rows are a multiple of 128, as the
    # ranged GEMM's K must be
    a_codes, a_blocked = mx_gemm.quantize_cols_blocked(a_rows.contiguous())
    start = torch.cumsum(padded, 0) - padded
    kranges = torch.stack([start, padded], 1).to(torch.int32)
    # the kernel writes float32 or bf16; other weight dtypes (fp16, fp64) take float32 and the
    # caller's cast
    od = out_dtype if out_dtype in (torch.float32, torch.bfloat16) else torch.float32
    b = mx_gemm.cols_bf16_math(b_rows) if b_bf16 is None else b_bf16
    return mx_gemm.mx_bf16_math_ranged_gemm(a_codes, a_blocked, b, kranges, out_dtype=od)


def _ranged(form: str, t: torch.Tensor, n: int) -> bool:
    return form == "bf16" and t.is_cuda and n % mx_gemm.BF16_MATH_N == 0


def _raw_dgrads(form: str, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether the dgrads read the weights raw (MOKGEN_MX_DGRAD_WEIGHTS=raw): the bf16-math form on
    bf16 weights on a GPU that mx_gemm.mx_bf16_math_raw_gemm takes (W_down [E, H, I] as one part,
    W_gate and W_up [E, I, H] as two)."""
    if env.mx_dgrad_weights() != "raw" or form != "bf16" or not w_down.is_cuda:
        return False
    return mx_gemm.raw_weights_apply([w_down]) and mx_gemm.raw_weights_apply([w_gate, w_up])


def _wgrad_bf16(form: str, t: torch.Tensor, H: int, I: int) -> bool:
    """Whether the weight gradients run on the BF16 backward's weight kernels (MOKGEN_MX_WGRAD=bf16,
    the default): the bf16-math form on a GPU where mokgen.bwd_gemm takes H and I."""
    if env.mx_wgrad() != "bf16" or form != "bf16" or not t.is_cuda:
        return False
    from mokgen import bwd_gemm

    return bwd_gemm.usable(H, I, t.device)


def _rows32(row: torch.Tensor, padded: torch.Tensor, src: torch.Tensor):
    """The weight gradients' rows with each expert's padded to 32 instead of 128 (v0.65): for each
    pair's row ``row`` in the padded layout, that layout's segment sizes ``padded`` and its rows'
    tokens ``src`` (-1 on padding rows), returns ``(at, tok, offs)``: each new row's padded-layout
    row (-1 past the last expert), its token (-1: zeros), and the new layout's inclusive prefix
    sums per expert (int32, as mokgen.bwd_gemm takes them). A fixed length, ``T k + 31 E`` rounded
    up to 32, and no host sync: rows past ``offs[-1]`` are no expert's. An expert's rows keep
    their order, so each 32-row block holds the same rows as in the padded layout."""
    E = padded.shape[0]
    end = torch.cumsum(padded, 0)
    experts = torch.searchsorted(end, row.to(end.dtype), right=True)  # each pair's expert
    # the pairs per expert without torch.bincount, whose output size waits on the GPU (a host sync)
    count = torch.zeros(E, dtype=torch.int64, device=row.device).scatter_add_(0, experts, torch.ones_like(experts))
    n32 = (count + 31) // 32 * 32
    end32 = torch.cumsum(n32, 0)
    start32, start = end32 - n32, end - padded
    length = -(-(row.shape[0] + 31 * E) // 32) * 32
    r = torch.arange(length, device=row.device)
    e = torch.searchsorted(end32, r, right=True)
    ec = e.clamp(max=E - 1)
    at = torch.where(e < E, start[ec] + r - start32[ec], -1).to(torch.int32)
    tok = torch.where(at >= 0, src[at.clamp(min=0).long()], -1).to(torch.int32)
    return at, tok, end32.to(torch.int32)


def _weight_grads_bf16(dy, h, dg, du, x, at, tok, offs, dtypes, values: bool = False):
    """The three weight gradients on the BF16 backward's weight kernels (MOKGEN_MX_WGRAD=bf16): each
    operand's MX values along the rows as bf16 rows in the 32-padded layout (``mx_gemm.rows_values``
    through ``at``, x's through its tokens ``tok``), then dW_down = dy^T h and the joint dW_gate,
    dW_up = dg^T x, du^T x, each expert over its rows (``offs``), float32 sums rounded to bf16,
    cast to ``dtypes`` (w_gate's, w_up's, w_down's). ``dy``: its float32 rows in the padded
    layout, or (v0.66) ``(d_out, w_rows)``, bf16 dOut [T, H] and each new row's routing weight
    (float32, 0 where the row has no pair): dy's values made from them (``rows_values`` with
    ``scale``, the bits of w dOut's), with no float32 dy written or read. ``values``: h, dg and du
    are their MX values in that layout already (``mx_gemm.swiglu_backward`` with ``values_rows``)."""
    from mokgen import bwd_gemm

    f32 = torch.float32
    if isinstance(dy, tuple):
        d_out, w_rows = dy
        dyv = mx_gemm.rows_values(d_out, tok, scale=w_rows)
    else:
        dyv = mx_gemm.rows_values(dy.to(f32).contiguous(), at)
    hv = h if values else mx_gemm.rows_values(h.to(f32).contiguous(), at)
    d_wd = bwd_gemm.weight_grads(dyv, hv, offs)                                             # [E, H, I]
    del dyv, hv, h
    if values:
        dgv, duv = dg, du
    else:
        dgv, duv = mx_gemm.rows_values(dg.contiguous(), at), mx_gemm.rows_values(du.contiguous(), at)
    del dg, du
    xv = mx_gemm.rows_values(x.contiguous(), tok)
    d_wg, d_wu = bwd_gemm.weight_grads_joint(dgv, duv, xv, offs)                            # [E, I, H] each
    return d_wg.to(dtypes[0]), d_wu.to(dtypes[1]), d_wd.to(dtypes[2])


def _block_map(at: torch.Tensor, rows: int) -> torch.Tensor:
    """For each of the padded layout's ``rows / 32`` row blocks, its block in :func:`_rows32`'s
    layout (``at``: each new row's padded row), -1 where none (int32; no host sync). Each new block
    starts a padded block: an expert's rows start a multiple of 128 in one layout and of 32 in the
    other, in the same order."""
    starts = at.view(-1, 32)[:, 0].long()
    nb = rows // 32
    # blocks past the last expert (start -1) all go to a spare last entry, dropped
    idx = torch.where(starts >= 0, starts // 32, nb)
    out = torch.full((nb + 1,), -1, dtype=torch.int32, device=at.device)
    out.scatter_(0, idx, torch.arange(starts.shape[0], dtype=torch.int32, device=at.device))
    return out[:nb].contiguous()


def _row_tokens(row: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Each of the padded layout's ``rows`` rows' token (int32, -1 on padding rows), pair p (token
    p // k) being on row ``row[p]``."""
    src = torch.full((rows,), -1, dtype=torch.int32, device=row.device)
    src[row] = torch.arange(row.shape[0], device=row.device).div(k, rounding_mode="floor").to(torch.int32)
    return src


def _padded_rows(t: torch.Tensor, row: torch.Tensor, rows: int) -> torch.Tensor:
    """Pair-order rows ``t [T k, n]`` as the padded layout's float32 rows ``[rows, n]`` (pair p on
    row ``row[p]``, zeros on the padding rows)."""
    out = torch.zeros(rows, t.shape[1], dtype=torch.float32, device=t.device)
    out[row] = t.to(torch.float32)
    return out


def _backward(d_out, x, w, w_gate, w_up, w_down, row, tiles, padded, gu, y, clamp_limit, form, transposed=None):
    """The MXFP8 backward (the section comment above) from what a forward left: each pair's
    padded row ``row``, the segments' ``tiles`` and sizes ``padded``, and the gate | up rows and
    expert output rows, either the staged forward's (float32 ``gu [rows, 2 I]`` and ``y [rows,
    H]`` in the padded layout) or the megakernel's (bf16 ``[T k, 2 I]`` and ``[T k, H]`` in pair
    order, mokgen.ep._MXTraining: the fused kernels read them through each padded row's pair, the
    PyTorch stages their float32 copies in the padded layout, the same bits). ``transposed``: the
    dgrads' weights where the forward quantized them. Returns the gradients of x, topk_weights,
    w_gate, w_up and w_down, each in its input's dtype."""
    T, k = w.shape
    E, I, H = w_gate.shape
    rows = mx_gemm.BLOCK * tiles.shape[0]
    fused = env.mx_bwd_stages() == "fused"
    # the weight gradients on the BF16 weight kernels (MOKGEN_MX_WGRAD=bf16): with the fused stages
    # their operands' MX values come from the stages (MOKGEN_MX_WGRAD_OPERANDS=fused): dy's from
    # dOut, so the combine's backward writes no float32 dy, and h's, dg's and du's from the SwiGLU
    # backward, which writes none of the three in float32
    wgrad_bf16 = _wgrad_bf16(form, x, H, I) and x.dtype in (torch.bfloat16, torch.float32)
    values = fused and wgrad_bf16 and env.mx_wgrad_operands() == "fused"
    by_pair = gu.dtype == torch.bfloat16
    if by_pair and not fused:  # the PyTorch stages take the padded layout's float32 rows
        gu, y = (_padded_rows(t, row, rows) for t in (gu, y))
        by_pair = False
    # the combine: d w[t, j] = <dOut[t], y[t, j]>; dy[t, j] = w[t, j] dOut[t] on its padded row
    # (zeros on padding rows), quantized along H for the dgrad below
    if fused:  # one pass, over each padded row's pair (-1: padding)
        pair = torch.full((rows,), -1, dtype=torch.int32, device=x.device)
        pair[row] = torch.arange(T * k, dtype=torch.int32, device=x.device)
        d_out16, w32 = d_out.to(torch.bfloat16).contiguous(), w.to(torch.float32).contiguous()
        dy, (dyq, dys), d_w = mx_gemm.combine_backward(d_out16, y, pair, w32, keep_dy=not values)
    else:
        g_out = d_out.to(torch.float32)
        d_w = (g_out.unsqueeze(1) * y[row].view(T, k, H)).sum(-1)
        dy = torch.zeros(rows, H, dtype=torch.float32, device=x.device)
        dy[row] = (w.to(torch.float32).unsqueeze(-1) * g_out.unsqueeze(1)).reshape(T * k, H)
        dyq, dys = mx_gemm.quantize_f32_rows(dy)
    # dgrad of the down projection: dh = q_H(dy) q_H(W_down), W_down^T [E, I, H] along H; with the
    # weights raw (MOKGEN_MX_DGRAD_WEIGHTS=raw) the kernel quantizes W_down [E, H, I] along H itself
    raw = transposed is None and _raw_dgrads(form, w_gate, w_up, w_down)
    if raw:
        dh = mx_gemm.mx_bf16_math_raw_gemm(dyq, dys, [w_down.detach()], tiles)
    else:
        wd_t = _transposed_weights([w_down], form, I) if transposed is None else transposed[0]
        dh = _grouped(dyq, dys, *wd_t, tiles, form)
    # SwiGLU backward in float32 (the oracle's swiglu under autograd), h, and [dg | du]
    # quantized along 2 I for the dgrad below
    if values:  # the weight gradients' layout first: dg, du and h come out as its MX values
        src = _row_tokens(row, rows, k)
        at, tok, offs = _rows32(row, padded, src)
        dg, du, h, (dguq, dgus) = mx_gemm.swiglu_backward(gu, dh, clamp_limit, pair if by_pair else None,
                                                          values_rows=(_block_map(at, rows), offs[-1:], at.shape[0]))
    elif fused:  # one pass
        dg, du, h, (dguq, dgus) = mx_gemm.swiglu_backward(gu, dh, clamp_limit, pair if by_pair else None)
    else:
        with torch.enable_grad():
            g, u = gu[:, :I].detach().requires_grad_(True), gu[:, I:].detach().requires_grad_(True)
            h = reference.swiglu(g, u, clamp_limit)
            dg, du = torch.autograd.grad(h, (g, u), dh)
        h = h.detach()
        dguq, dgus = mx_gemm.quantize_f32_rows(torch.cat([dg, du], dim=1))
    # dgrad of gate | up: dx_rows = q_2I(dgu) q_2I(W_gu), [W_gate; W_up]^T [E, H, 2I] along 2I;
    # then dx[t] = sum_j dx_rows[t, j]: fused, in the order j = 0..k-1 and rounded once to bf16
    # by the combine kernel with unit weights (at k = 1 the GEMM's epilogue writes it)
    ones = (torch.ones(T, dtype=torch.float32, device=x.device) if k == 1 else
            torch.ones(T, k, dtype=torch.float32, device=x.device))
    if raw:  # [W_gate; W_up] [E, 2 I, H] quantized along 2 I in the kernel
        gu_parts = [w_gate.detach(), w_up.detach()]
        if fused and k == 1:
            dx = mx_gemm.mx_bf16_math_raw_gemm(dguq, dgus, gu_parts, tiles, combine=(pair, ones))
        elif fused:
            dx = mx_gemm.combine(mx_gemm.mx_bf16_math_raw_gemm(dguq, dgus, gu_parts, tiles), row, ones)
        else:
            dx = mx_gemm.mx_bf16_math_raw_gemm(dguq, dgus, gu_parts, tiles)[row].view(T, k, H).sum(1)
    else:
        wgu_t = _transposed_weights([w_gate, w_up], form, H) if transposed is None else transposed[1]
        transposed = None
        if fused and k == 1 and form == "bf16" and H % mx_gemm.BF16_MATH_N == 0:
            dx = mx_gemm.mx_bf16_math_combine1_gemm(dguq, dgus, wgu_t[0], tiles, pair, ones)
        elif fused:
            dx = mx_gemm.combine(_grouped(dguq, dgus, *wgu_t, tiles, form), row, ones.view(T, k))
        else:
            dx = _grouped(dguq, dgus, *wgu_t, tiles, form)[row].view(T, k, H).sum(1)
        del wgu_t
    # wgrads, per expert over its rows: on the BF16 backward's weight kernels over the operands' MX
    # values (MOKGEN_MX_WGRAD=bf16), else one k-ranged bf16-math launch each (else per expert on quad)
    if wgrad_bf16:
        if not values:
            src = _row_tokens(row, rows, k)
            at, tok, offs = _rows32(row, padded, src)
        if dy is None:  # fused: each new row's routing weight (0 without a pair), for dy = w dOut
            p = torch.where(at >= 0, pair[at.clamp(min=0).long()], -1)
            dy = (d_out16, torch.where(p >= 0, w32.view(-1)[p.clamp(min=0).long()], 0.0).contiguous())
        d_wg, d_wu, d_wd = _weight_grads_bf16(dy, h, dg, du, x, at, tok, offs,
                                              (w_gate.dtype, w_up.dtype, w_down.dtype), values=values)
        return (dx.to(x.dtype), d_w.to(w.dtype), d_wg, d_wu, d_wd)
    if _ranged(form, dy, I):
        d_wd = _weight_grads_ranged(dy, h, padded, w_down.dtype)                                    # [E, H, I]
    else:
        d_wd = _weight_grads(mx_gemm.quantize_cols(dy), mx_gemm.quantize_cols(h), padded, form)
    if _ranged(form, dg, H):
        # gate's and up's gradients as two launches over the same B (x's rows, quantized once):
        # each lands contiguous, where slices of one [E, 2 I, H] result would be copied again
        # by autograd into the weights' layout (2.8 GB read and written on kimi-k2.5 local).
        # Quantizing along the rows is per column, so dg's and du's codes are dgu's halves.
        # x's rows are gathered by the quantizer (row r: token src[r], zeros on padding rows),
        # with no copy of them written.
        src = _row_tokens(row, rows, k)
        xb = mx_gemm.cols_bf16_math(x.contiguous(), src=src)
        d_wg = _weight_grads_ranged(dg, None, padded, w_gate.dtype, b_bf16=xb)                    # [E, I, H]
        d_wu = _weight_grads_ranged(du, None, padded, w_up.dtype, b_bf16=xb)
    else:
        x_rows = torch.zeros(rows, H, dtype=x.dtype, device=x.device)
        x_rows[row] = x.repeat_interleave(k, dim=0)
        dgu = torch.cat([dg, du], dim=1)
        d_wgu = _weight_grads(mx_gemm.quantize_cols(dgu), mx_gemm.quantize_cols(x_rows), padded, form)
        d_wg, d_wu = d_wgu[:, :I], d_wgu[:, I:]
    return (dx.to(x.dtype), d_w.to(w.dtype), d_wg.to(w_gate.dtype), d_wu.to(w_up.dtype),
            d_wd.to(w_down.dtype))


class _MXExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, w_gate, w_up, w_down, topk_ids, clamp_limit, form, converted=None,
                held=None):
        E, I, H = w_gate.shape
        # the dgrads' weights (W_down^T, [W_gate; W_up]^T) when quantized here or held by the caller
        # with ``converted`` (mokgen.ep under MOKGEN_MX_WEIGHTS=both)
        transposed = None
        if converted is not None and held is not None and not _needs_codes(form, I, H):
            transposed = held
        if converted is not None and not _needs_codes(form, I, H):
            # the weights' MX values as a caller already holds them (the MXFP8 layer's conversions,
            # mokgen.ep), gate and up apart (two GEMMs into gu's halves): the same bits
            cg, cu, cd = converted
            weights = MXExpertWeights(None, None, None, None, None, cd, False, gate_up_parts=(cg, cu))
        elif converted is not None and not _needs_codes(form, 2 * I, H):
            # I not a multiple of 256 (the bf16-math tile's N): gate | up stacked by one copy
            cg, cu, cd = converted
            weights = MXExpertWeights(None, None, None, None, torch.cat([cg, cu], dim=1), cd, False)
        elif any(ctx.needs_input_grad) and _both(form, I, H, w_gate, w_up, w_down):
            # MOKGEN_MX_WEIGHTS=both: each weight read once for both orientations, the backward's
            # (transposed) kept on ctx until it runs; the same bits as quantizing them apart
            gu, gu_t = mx_gemm.expert_weights_both([w_gate.detach(), w_up.detach()])
            dn, dn_t = mx_gemm.expert_weights_both([w_down.detach()])
            weights = MXExpertWeights(None, None, None, None, gu, dn, False)
            transposed = ((dn_t, None, None), (gu_t, None, None))
        else:
            weights = quantize_weights(w_gate, w_up, w_down, codes=_needs_codes(form, 2 * I, H), interleave=False)
        out, saved = _forward(x, topk_ids, topk_weights, weights, clamp_limit, form, keep_gu=True)
        ctx.save_for_backward(x, topk_weights, w_gate, w_up, w_down, saved.row, saved.tiles, saved.gu, saved.y)
        ctx.padded, ctx.clamp_limit, ctx.form = saved.padded, clamp_limit, form
        ctx.transposed = transposed
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, w, w_gate, w_up, w_down, row, tiles, gu, y = ctx.saved_tensors
        transposed, ctx.transposed = ctx.transposed, None  # dropped with this frame's last use
        return (*_backward(d_out, x, w, w_gate, w_up, w_down, row, tiles, ctx.padded, gu, y, ctx.clamp_limit,
                           ctx.form, transposed), None, None, None, None, None)


def saved_backward(d_out, x, topk_ids, topk_weights, w_gate, w_up, w_down, gu, y, clamp_limit=None, transposed=None):
    """The MXFP8 backward (bf16-math form) from a forward that kept its rows in pair order: the
    MXFP8 megakernel's saved gate | up rows ``gu`` bf16 ``[T k, 2 I]`` and its combine slots'
    expert output rows ``y`` bf16 ``[T k, H]`` (mokgen.ep._MXTraining under the save policy), so
    no forward is run again. The gradients of x, topk_weights, w_gate, w_up and w_down, the
    weights' quantized afresh in the dgrads' orientation (a step's weights change). The same
    bits as the staged backward given the float32 copies of those rows (tests/test_gpu_mx_megakernel.py).
    ``transposed``: the dgrads' weights as ``_backward`` takes them where a caller holds them
    (mokgen.ep's conversions under MOKGEN_MX_WEIGHTS=both; the same bits), else quantized here.
    An id outside [0, E) raises InputError (one host sync), as the recompute's staged forward does:
    a launch skips such pairs and keeps no rows for them."""
    T, k = topk_ids.shape
    row, _src, tiles, padded = _segments(topk_ids.reshape(-1).to(torch.int64), w_gate.shape[0], k)
    return _backward(d_out, x, topk_weights, w_gate, w_up, w_down, row, tiles, padded, gu, y, clamp_limit, "bf16",
                     transposed)


def experts_forward_train(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                          w_up: torch.Tensor, w_down: torch.Tensor, clamp_limit: float | None = None, *,
                          form: str = "bf16") -> torch.Tensor:
    """:func:`experts_forward` with gradients for ``x``, ``topk_weights`` and the three expert
    weights (mokgen's layout, unquantized: quantized on every call, as a training step's weights
    change), the MXFP8 backward above. Straight-through: the gradients are of the unquantized
    inputs, as the oracle's (``mokgen.reference.mx_experts_forward``)."""
    return _train(x, topk_ids, topk_weights, w_gate, w_up, w_down, clamp_limit, form)


def _train(x, topk_ids, topk_weights, w_gate, w_up, w_down, clamp_limit, form: str = "bf16", converted=None,
           transposed=None):
    """:func:`experts_forward_train`; ``converted``: the three weights' bf16 MX values with k
    permuted (``mx_gemm.expert_weights`` of each, as the MXFP8 layer caches them), used in place of
    quantizing the weights again where the form needs no codes (the same bits); ``transposed``
    with it: the dgrads' weights as :func:`_backward` takes them (the layer's under
    MOKGEN_MX_WEIGHTS=both)."""
    _check_inputs(x, topk_ids, topk_weights, w_gate.shape[2] if w_gate.dim() == 3 else -1)
    _check_form(form)
    if x.shape[0] == 0:
        raise InputError("experts_forward_train needs at least one token")
    return _MXExperts.apply(x, topk_weights, w_gate, w_up, w_down, topk_ids, clamp_limit, form, converted, transposed)
