"""Backward of the routed experts, behind the megakernel's autograd.

The backward of docs/architecture.md ("Backward (issue 5): the design and what is built"):
gradients for the tokens, the routing weights and the expert weights, in fixed-order,
atomic-free kernels, so they are bitwise reproducible run to run. The forward's pre-activations
are saved by its epilogue or recomputed (the policy, below). The GEMMs are mokgen's own Hopper
kernels where they apply and torch._grouped_mm elsewhere (the two paths, below); the chain of
GEMMs also runs as one persistent launch (``MOKGEN_BWD_FUSED=1``, measured no faster, off by
default). The ring-walking backward megakernel of the design (pull of dOut, push of dX) is not
built: this module's interface is where it would go.

Math, per (token t, slot j) pair with expert e = ids[t, j] and row x = x[t]:
    g = x Wg[e]^T, u = x Wu[e]^T, h = swiglu(g, u), y = h Wd[e]^T, out[t] = sum_j w[t, j] y
    dy = w[t, j] dOut[t]                  d w[t, j] = <dOut[t], y>
    dWd[e] += dy^T h,   dh = dy Wd[e],    (dg, du) = swiglu'(g, u) dh
    dWg[e] += dg^T x,   dWu[e] += du^T x, dx_(t,j) = dg Wg[e] + du Wu[e]
    dX[t] = sum_j dx_(t,j), in the order j = 0..k-1.
Rows are processed expert-major (stable order), and each expert's weight gradient is one matmul
over its rows in that order: no split-K, no scatter-add.

Two paths compute this. BF16 inputs take the grouped path (where torch._grouped_mm runs, see
_grouped_ok), with ``d w[t, j] = <dOut[t] Wd[e], h>`` so that y is never recomputed, in one of
two forms:
- mokgen's own Hopper kernels (``mokgen.bwd_gemm``, the default on an sm_90 GPU where H and I
  are multiples of 256; ``MOKGEN_BWD_GEMM=0`` turns them off): dh in fp32 (bf16 under the save
  policy, MOKGEN_BWD_DH), g and u (saved or recomputed, below) through SwiGLU's backward, dx as
  one accumulation over both products (each pair's row rounded to bf16 before the sum over a
  token's slots, MOKGEN_BWD_DX_PAIRS), weight gradients by one CTA per (expert, tile) in row
  order (the gate's and up's in one launch, MOKGEN_BWD_WEIGHTS_JOINT). Measured 1.07x (kimi-k2.5
  local) and 1.44x (qwen3.5-35b-a3b layer) the PyTorch autograd pipeline for fwd+bwd on the
  H200, where the torch._grouped_mm form was 0.89-0.91x (docs/perf-notes.md, v0.10).
- ``torch._grouped_mm``: seven grouped GEMMs (bf16 operands, fp32 accumulation, like the
  PyTorch pipeline the bench compares against) and elementwise passes. Its GEMM outputs are
  bf16: g and u are rounded before the SwiGLU, and dx is the sum of two rounded products.
Both are within bf16 tolerance of the reference. Other dtypes (the fp64 oracle of the CPU
tests, fp32) take the per-expert loop in the inputs' precision.

Save or recompute (``MOKGEN_BWD_POLICY``, ``MoELayer(bwd_policy=...)``): g and u, the up
projection's pre-activations, are either
- ``save`` (the default): written by the forward megakernel's up-projection epilogue in bf16
  (``save_gu``: 4 I bytes per routed (token, slot) pair, e.g. 134 MB for kimi-k2.5's 16384 local
  rows, 268 MB for qwen3.5-35b-a3b at T = 16384), kept by autograd until the backward, which then
  runs an elementwise pass where the recompute runs two GEMMs' worth of FLOPs (4 T k H I). Their
  bf16 rounding is the one the torch._grouped_mm form applies too; h (for dWd and the routing
  weights' gradient) is recomputed from them. Only where every rank is in the process (one
  GPU: a single rank or virtual ranks): a multi-GPU layer's pairs are computed on other GPUs, and
  recompute there.
- ``recompute``: nothing is kept; the backward recomputes g and u from x (in fp32 on mokgen's
  kernels, fused with SwiGLU's backward: g and u never leave the registers).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from mokgen import env
from mokgen.errors import InputError
from mokgen.reference import swiglu


def _swiglu_grads(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, clamp_limit):
    """(dg, du) of h = swiglu(g, u) (mokgen.reference.swiglu, clamps included) for the upstream
    gradient dh, in closed form (no autograd: this runs inside a torch operator):
    gc = min(g, L), uc = clamp(u, -L, L), h = silu(gc) uc,
    dg = dh uc silu'(gc) [g <= L], du = dh silu(gc) [-L <= u <= L],
    silu'(z) = s (1 + z (1 - s)), s = sigmoid(z); the masks are those of torch.clamp's gradient."""
    if clamp_limit is not None:
        limit = float(clamp_limit)
        gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    else:
        gc, uc = g, u
    s = torch.sigmoid(gc)
    dg = dh * uc * (s * (1 + gc * (1 - s)))
    du = dh * (gc * s)
    if clamp_limit is not None:
        dg = dg * (g <= limit)
        du = du * ((u >= -limit) & (u <= limit))
    return dg, du


def _swiglu_fwd_bwd(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, clamp_limit):
    """(h, dg, du) for fp32 g, u, dh: h = swiglu(g, u) in fp32 and its input gradients for the
    upstream gradient dh, rounded to bf16 (the GEMM operands they feed). The same math as
    ``swiglu`` + ``_swiglu_grads`` in fewer passes over the rows (the grouped path's
    elementwise work: one sigmoid, silu' through aten's fused ``silu_backward``)."""
    if clamp_limit is not None:
        limit = float(clamp_limit)
        gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    else:
        gc, uc = g, u
    silu = torch.nn.functional.silu(gc)
    h = silu * uc
    dg = torch.ops.aten.silu_backward(dh * uc, gc)
    du = dh * silu
    if clamp_limit is not None:
        dg.mul_(g <= limit)
        du.mul_((u >= -limit) & (u <= limit))
    return h, dg.to(torch.bfloat16), du.to(torch.bfloat16)


def experts_backward(x, topk_ids, topk_weights, w_gate, w_up, w_down, grad_out, clamp_limit=None,
                     need_weight_grads: bool = True, saved_gu=None, ring_x=None):
    """Gradients of ``out = experts_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down)``.

    ``x [T, H]``, ``topk_ids [T, K]`` (ids in ``[0, E)``), ``topk_weights [T, K]``, ``w_gate`` /
    ``w_up [E, I, H]``, ``w_down [E, H, I]``, ``grad_out [T, H]``. ``saved_gu`` (optional, the
    "save" policy): the forward's pre-activations, bf16 ``[T * K, 2 I]``, row ``t * K + j`` = g
    then u of pair (t, j); g and u are then not recomputed (the BF16 path; the per-expert loop
    of other dtypes ignores them). Computes in fp32 (fp64 for fp64 inputs) and returns
    ``(dx, d_topk_weights, dw_gate, dw_up, dw_down)`` in the dtypes of the inputs (the weight
    gradients are None unless ``need_weight_grads``). ``ring_x`` (optional): the pairs' x rows
    already in the expert-major order of mokgen.bwd_gemm.expert_major, bf16 ``[T * K, H]`` (a
    one-rank forward's receive ring, mokgen.ep.ring_rows_of; rows past the valid pairs are not
    read), used instead of gathering them from x where mokgen's GEMMs run; else ignored."""
    if ring_x is not None:
        T, K = topk_ids.shape
        if ring_x.dtype != torch.bfloat16 or tuple(ring_x.shape) != (T * K, x.shape[1]) or not ring_x.is_contiguous():
            raise InputError(f"ring_x must be a contiguous bf16 tensor [T * K, H] = {(T * K, x.shape[1])}, got "
                             f"{ring_x.dtype} {tuple(ring_x.shape)}")
    if saved_gu is not None:
        T, K = topk_ids.shape
        I = w_gate.shape[1]
        if saved_gu.dtype != torch.bfloat16 or tuple(saved_gu.shape) != (T * K, 2 * I) or not saved_gu.is_contiguous():
            raise InputError(f"saved_gu must be a contiguous bf16 tensor [T * K, 2 I] = {(T * K, 2 * I)}, got "
                             f"{saved_gu.dtype} {tuple(saved_gu.shape)}")
    if _grouped_ok(x, w_gate, w_up, w_down):
        return _experts_backward_grouped(x, topk_ids, topk_weights, w_gate, w_up, w_down, grad_out, clamp_limit,
                                         need_weight_grads, saved_gu, ring_x)
    T, K = topk_ids.shape
    E = w_gate.shape[0]
    f32 = torch.float64 if x.dtype == torch.float64 else torch.float32  # fp32, or fp64 for an oracle
    order, counts, n = _pairs_expert_major(topk_ids, E)
    order, counts = order[:n], counts.tolist()
    tok = torch.div(order, K, rounding_mode="floor")
    rows = x.index_select(0, tok).to(f32)
    go = grad_out.index_select(0, tok).to(f32)
    wts = topk_weights.reshape(-1).index_select(0, order).to(f32)
    N, H = rows.shape
    dx_rows = torch.zeros(N, H, dtype=f32, device=x.device)
    dw_rows = torch.zeros(N, dtype=f32, device=x.device)
    grads = [torch.zeros(w.shape, dtype=f32, device=w.device) for w in (w_gate, w_up, w_down)] if need_weight_grads else None
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sl = slice(start, start + c)
        xr, gr = rows[sl], go[sl]
        wg, wu, wd = w_gate[e].to(f32), w_up[e].to(f32), w_down[e].to(f32)
        g, u = xr @ wg.T, xr @ wu.T
        h = swiglu(g, u, clamp_limit)
        y = h @ wd.T
        dw_rows[sl] = (gr * y).sum(dim=1)
        dy = gr * wts[sl].unsqueeze(1)
        dh = dy @ wd
        dg, du = _swiglu_grads(g, u, dh, clamp_limit)
        dx_rows[sl] = dg @ wg + du @ wu
        if grads is not None:
            grads[0][e] = dg.T @ xr
            grads[1][e] = du.T @ xr
            grads[2][e] = dy.T @ h
        start += c
    dx, dw = _unpermute(order, dx_rows, dw_rows, T, K, f32)
    return _finish(dx, dw, grads, x, topk_weights, (w_gate, w_up, w_down))


def _unpermute(order, dx_rows, dw_rows, T: int, K: int, dtype):
    """Rows in expert-major order (row i is pair ``order[i]`` = t * K + j) back to the (t, j)
    pairs (a permutation; pairs not in ``order``, the dropped ones, get zeros), then dx summed
    over j = 0..K-1 in fixed order in ``dtype`` (mokgen's kernels do this in one pass,
    bwd_gemm.sum_slots, with the same bits). Returns (dx [T, H], d weights [T, K])."""
    H = dx_rows.shape[1]
    dx_pairs = torch.zeros(T * K, H, dtype=dtype, device=dx_rows.device)
    dx_pairs[order] = dx_rows.to(dtype)
    dx_pairs = dx_pairs.view(T, K, dx_pairs.shape[1])
    dx = dx_pairs[:, 0] if K == 1 else dx_pairs[:, 0].clone()  # K = 1: the pairs are the tokens
    for j in range(1, K):
        dx.add_(dx_pairs[:, j])
    return dx, _pair_weights(order, dw_rows, T, K)


def _pair_weights(order, dw_rows, T: int, K: int):
    """The routing weights' gradients of expert-major rows back in (t, j) order, ``[T, K]``
    (zeros for pairs not in ``order``)."""
    return torch.zeros(T * K, dtype=dw_rows.dtype, device=dw_rows.device).index_copy_(0, order, dw_rows).view(T, K)


def _finish(dx, dw, grads, x, topk_weights, weights):
    """experts_backward's result in the inputs' dtypes (weight gradients None when not computed)."""
    out = (dx.to(x.dtype), dw.to(topk_weights.dtype))
    if grads is None:
        return (*out, None, None, None)
    return (*out, *(gw.to(w.dtype) for gw, w in zip(grads, weights)))


def _grouped_ok(x, w_gate, w_up, w_down) -> bool:
    """Whether torch._grouped_mm can run this backward: BF16 everywhere, 16-byte row strides
    (H and I multiples of 8), and a device it supports (CUDA: sm_90 or newer; CPU: PyTorch 2.9
    or newer). Otherwise the per-expert loop runs."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16:
        return False
    if any(w.dtype != torch.bfloat16 for w in (w_gate, w_up, w_down)):
        return False
    if w_gate.shape[1] % 8 or w_gate.shape[2] % 8:
        return False
    if x.is_cuda:
        return torch.cuda.get_device_capability(x.device) >= (9, 0)
    major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 9)


def _pairs_expert_major(topk_ids: torch.Tensor, E: int, *, count: bool = True):
    """(order, counts, n_valid): the (t, j) pairs sorted expert-major (stable), rows per expert
    [E] (int64, on the device), and how many pairs have an id in [0, E) (dropped ones sort last).
    ``count=False``: n_valid is None, and nothing waits for the device (the counts are a
    scatter-add, not bincount, whose output size needs the largest id on the host)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    key = torch.where((flat >= 0) & (flat < E), flat, torch.full_like(flat, E))
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, key, torch.ones_like(key))
    return order, counts[:E], (int(counts[:E].sum()) if count else None)


#: mokgen's GEMMs take their rows' order from bwd_gemm.expert_major (a counting sort in three
#: launches, v0.13) where True; False: PyTorch's radix sort and a scatter-add, a dozen small
#: operations (the tests compare the two: the same bits). Before v0.13 expert_major read every
#: pair once per expert and took 431 us on the qwen3.5-35b-a3b layer (256 experts x 131072
#: pairs), so layers above 2^22 experts x pairs took PyTorch's sort.
USE_EXPERT_MAJOR = True

def fuse_dh_swiglu(saved: bool) -> bool:
    """Whether the save policy (``saved``) on mokgen's GEMMs takes SwiGLU's backward from the saved
    g and u in the dh GEMM's epilogue (bwd_gemm.dh_swiglu_saved): MOKGEN_BWD_DH_SWIGLU=1, off by
    default. Otherwise the dh GEMM writes its rows (bf16 by default, MOKGEN_BWD_DH) and an
    elementwise pass reads them (bwd_gemm.swiglu_grads_saved). The routing weights' gradient
    sums each row per 256 columns first (within rounding). v0.14 measured the fusion slower
    (971 us against 785 + 117 on kimi-k2.5's local rows: the epilogue's loads of g and u,
    gathered through the pair map, were thought exposed); v0.24 measured it slower still, and as
    slow without any g / u loads: the epilogue's arithmetic on 8 warps per SM with the tensor
    core idle is the cost (docs/perf-notes.md v0.24)."""
    return saved and env.bwd_dh_swiglu()


def dout_inline(top_k: int) -> bool:
    """Whether mokgen's dh and dW_down GEMMs load the pairs' dOut rows through the token index
    (MOKGEN_BWD_DOUT ``inline``) rather than from a gathered copy (``gather``), for ``top_k``
    pairs per token. ``auto`` (the default) takes the index where a token has several pairs: the
    copy is then top_k times dOut's bytes, and the single-GPU layers' fwd+bwd step was 1.4-2.8%
    faster without it; with one pair per row (an EP rank's received rows, the local stand-ins)
    the copy is no larger than dOut and the TMA's reads of it were 0.4% faster on kimi-k2.5
    (docs/perf-notes.md v0.22)."""
    return _through_index(env.bwd_dout(), top_k)


def _through_index(mode: str, top_k: int) -> bool:
    """Whether an operand switch (MOKGEN_BWD_DOUT, MOKGEN_BWD_X) asks for its rows through the
    token index: ``inline``, or ``auto`` where a token has several pairs."""
    return mode == "inline" or (mode == "auto" and top_k > 1)


def weight_schedule(rows: int, experts: int, top_k: int) -> str:
    """The weight gradients' schedule of an experts backward over ``rows`` pairs and ``experts``
    experts (bwd_gemm.weight_schedule): under MOKGEN_BWD_WEIGHTS ``auto``, the split wherever a
    launch reads an operand through the token index (dout_inline, an ``inline`` or ``auto`` x
    for several pairs per token, x_inline) or the fused backward is asked for: those exist for
    the split schedule only."""
    gathered = dout_inline(top_k) or _through_index(env.bwd_x(), top_k) or env.bwd_fused()
    from mokgen import bwd_gemm

    return bwd_gemm.weight_schedule(rows, experts, gathered=gathered)


def x_inline(saved: bool, need_weight_grads: bool, top_k: int, schedule: str | None = None) -> bool:
    """Whether the joint gate/up weight gradients load the pairs' x rows through the token index
    (MOKGEN_BWD_X ``inline``; bwd_gemm.weight_grads_joint's ``b_index``) rather than from a
    gathered copy (``gather``), where the ring does not hold them, for ``top_k`` pairs per token.
    Only the save policy (``saved``; the recompute reads the rows in SwiGLU's backward too) with
    weight gradients, on the split ``schedule``'s joint launch in single CTAs (MOKGEN_BWD_CLUSTER 1):
    only that launch has a gathered B. ``auto`` (the default) takes the index where a token has
    several pairs (the fwd+bwd step 2.0% faster on the qwen3.5-35b-a3b layer, 0.7% on
    qwen3-30b-a3b's, 0.5 GiB less peak memory) and the copy for one pair per row, where it is no
    larger than x and the gathering launch's 10% loss outweighs it (0.7% slower on kimi-k2.5's
    local rows; docs/perf-notes.md v0.25)."""
    return (_through_index(env.bwd_x(), top_k) and saved and need_weight_grads and _split(schedule)
            and env.bwd_weights_joint() and env.bwd_cluster() == 1)


def _split(schedule: str | None) -> bool:
    """Whether the weight gradients take the split schedule: ``schedule`` as weight_schedule gave
    it, or (None) MOKGEN_BWD_WEIGHTS, whose ``auto`` is the split wherever a gathered or fused
    launch is asked for (weight_schedule), which is where the callers ask."""
    return (schedule or env.bwd_weights()) in ("split", "auto")


#: a second stream per device for overlap_weight_launches (created once: a stream per call would
#: cost as much as the overlap saves)
_SIDE_STREAMS: dict = {}


def overlap_weight_launches(experts: int, hidden: int, inter: int, device, schedule: str) -> bool:
    """Whether an experts backward runs its dW_down launch on a second stream beside the joint
    dW_gate / dW_up launch (MOKGEN_BWD_OVERLAP ``auto``, the default): on the split ``schedule``
    with the joint launch, outside CUDA graph capture, where the two launches' tiles (one CTA
    each) fit on the device's SMs together. A one-expert backward, such as the fused shared
    expert's (``shared_op_backward``), has few output tiles, each walking every token's row:
    qwen3.5-35b-a3b's shared expert has 32 dW_down and 64 dW_gate / dW_up tiles for 132 SMs,
    so one after the other each launch leaves most SMs idle. The same bits either way."""
    if env.bwd_overlap() == "0" or schedule != "split" or not env.bwd_weights_joint():
        return False
    from mokgen import bwd_gemm

    tiles = bwd_gemm.weight_tiles(experts, hidden, inter) + 2 * bwd_gemm.weight_tiles(experts, inter, hidden)
    return (tiles <= torch.cuda.get_device_properties(device).multi_processor_count
            and not torch.cuda.is_current_stream_capturing())


def _side_stream(device) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def fused_applies(saved: bool, top_k: int, schedule: str | None = None) -> bool:
    """Whether mokgen's backward takes the fused launch (bwd_gemm.fused_backward) on its GEMMs:
    MOKGEN_BWD_FUSED=1 (off by default), the save policy (``saved``: g and u from the forward),
    and the settings whose separate launches it reproduces bit for bit: the split weight
    schedule with the joint gate/up launch, dh in bf16, and bf16 dx pair rows where a token has
    several (``top_k`` > 1); ``schedule``: the weight gradients' (weight_schedule)."""
    return (env.bwd_fused() and saved and not fuse_dh_swiglu(saved) and _split(schedule)
            and env.bwd_weights_joint() and env.bwd_dh() == "bf16" and (top_k == 1 or env.bwd_dx_pairs() == "bf16"))


def _experts_backward_grouped(x, topk_ids, topk_weights, w_gate, w_up, w_down, grad_out, clamp_limit,
                              need_weight_grads, saved_gu=None, ring_x=None):
    """The BF16 path of experts_backward: grouped GEMMs over the expert-major rows."""
    T, K = topk_ids.shape
    E, I = w_gate.shape[0], w_gate.shape[1]
    f32 = torch.float32
    gmm = torch._grouped_mm
    from mokgen import bwd_gemm

    # mokgen's Hopper GEMMs (the default on an H100/H200): fp32 outputs, bf16 weight grads
    ours = bwd_gemm.usable(x.shape[1], I, x.device)
    # ours: every pair's row, the dropped ones (ids outside [0, E), sorted last) included, since
    # the kernels treat rows past offs[-1] as no expert's (zeros): no wait for the device to
    # count the valid pairs, and (expert_major) the order, token of each row, offsets and
    # routing weights in one launch; torch._grouped_mm gets the valid rows only
    in_ring = False
    if ours and USE_EXPERT_MAJOR and E <= bwd_gemm.EXPERT_MAJOR_MAX_EXPERTS:
        # the forward's ring holds the valid pairs' rows in this order (rows past offs[-1] are
        # not read: no expert's)
        in_ring = ring_x is not None
        ids32 = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
        order, tok, offs, wt = bwd_gemm.expert_major(ids32.contiguous(), E, topk_weights.to(f32).contiguous())
        wts = wt.unsqueeze(1)
    else:
        order, counts, n = _pairs_expert_major(topk_ids, E, count=not ours)
        if not ours:
            order = order[:n]
        offs = counts.cumsum(0).to(torch.int32)
        tok = torch.div(order, K, rounding_mode="floor")
        wt = topk_weights.reshape(-1).index_select(0, order).to(f32)  # [rows], as expert_major's
        wts = wt.unsqueeze(1)
    # the dOut rows of the pairs, in order: gathered into a copy (2 T K H bytes written, then
    # read by dh and dW_down), or (MOKGEN_BWD_DOUT=inline, mokgen's GEMMs on the split weight
    # schedule) loaded by those two GEMMs through the token index from dOut itself (v0.22)
    schedule = weight_schedule(T * K, E, K)  # the weight gradients' (ours)
    fused = ours and need_weight_grads and fused_applies(saved_gu is not None, K, schedule)
    # the x rows of the pairs, in order: in place in the forward's receive ring (issue 5's ring
    # walked in reverse: 2 T K H bytes neither written nor read again), or gathered again, or
    # (MOKGEN_BWD_X=inline, the joint weight gradients their only reader) none: that launch
    # loads them through the token index from x itself (v0.25)
    inline_x = ours and not in_ring and not fused and x_inline(saved_gu is not None, need_weight_grads, K, schedule)
    rows = ring_x if in_ring else None if inline_x else x.index_select(0, tok).contiguous()
    inline_dout = ours and not fused and dout_inline(K) and schedule == "split"
    dout = grad_out.to(torch.bfloat16).contiguous()
    # ring_x being x itself says the token order is the expert-major order (the fused shared
    # expert's one-expert backward, shared_op_backward): dOut's rows are then in order as well
    in_order = in_ring and ring_x.data_ptr() == x.data_ptr() and ring_x.shape == x.shape
    go = None if inline_dout else dout if in_order else dout.index_select(0, tok).contiguous()
    if ours:
        w_gate, w_up, w_down = w_gate.contiguous(), w_up.contiguous(), w_down.contiguous()
    # dOut back through the down projection (unweighted), then g and u (saved, or recomputed:
    # ours fuses the recompute with SwiGLU's backward, g and u never leave the registers)
    if fused:  # one launch for the GEMM chain and SwiGLU's backward (MOKGEN_BWD_FUSED; the same bits)
        dx_pairs, dw_rows, grads = bwd_gemm.fused_backward(go, rows, w_gate, w_up, w_down, saved_gu, order, wt, offs,
                                                           clamp_limit)
        dx = dx_pairs if K == 1 else bwd_gemm.sum_slots(dx_pairs, T, K)
        del dx_pairs
        return _finish(dx, _pair_weights(order, dw_rows, T, K), list(grads), x, topk_weights, (w_gate, w_up, w_down))
    if ours and fuse_dh_swiglu(saved_gu is not None):  # dSwiGLU in dh's epilogue: no dh rows
        src, index = (dout, tok) if inline_dout else (go, None)
        hw, dg, du, dw_rows = bwd_gemm.dh_swiglu_saved(src, w_down, saved_gu, order, wt, offs, clamp_limit,
                                                       a_index=index)
    elif ours:  # h comes weighted (hw = h wt): dWd = dOut^T hw needs no weighted dOut rows
        # under the save policy dh in bf16 by default (MOKGEN_BWD_DH: the precision of
        # torch._grouped_mm's dh, half the bytes of fp32 rows written and read; measured in
        # docs/perf-notes.md v0.20); the recompute's fused kernel reads fp32
        dh_dtype = torch.bfloat16 if saved_gu is not None and env.bwd_dh() == "bf16" else torch.float32
        if inline_dout:
            dh_u = bwd_gemm.rows_gemm([(dout, w_down)], offs, b_major="mn", out_dtype=dh_dtype, a_index=tok)
        else:
            dh_u = bwd_gemm.rows_gemm([(go, w_down)], offs, b_major="mn", out_dtype=dh_dtype)
        if saved_gu is not None:
            hw, dg, du, dw_rows = bwd_gemm.swiglu_grads_saved(saved_gu, order, dh_u, wt, offs, clamp_limit)
        else:
            hw, dg, du, dw_rows = bwd_gemm.swiglu_grads(rows, w_gate, w_up, dh_u, wt, offs, clamp_limit)
        del dh_u
    else:
        if saved_gu is not None:
            gu = saved_gu.index_select(0, order)
            g, u = gu[:, :I].to(f32), gu[:, I:].to(f32)
            del gu
        else:
            g = gmm(rows, w_gate.transpose(1, 2), offs=offs).to(f32)
            u = gmm(rows, w_up.transpose(1, 2), offs=offs).to(f32)
        dh_u = gmm(go, w_down, offs=offs).to(f32)
        h, dg, du = _swiglu_fwd_bwd(g, u, dh_u * wts, clamp_limit)
        dw_rows = (dh_u * h).sum(dim=1)
        del g, u, dh_u
    if ours:  # one fp32 accumulation over both products, scattered to (token, slot) order by the kernel
        # order holds every pair, and the kernel writes each pair's row (zeros for the dropped
        # ones, past offs[-1]): no fill first. One slot per token (K = 1, an EP rank's received
        # rows): the kernel rounds to bf16 itself, the bits of sum_slots' one rounding, with no
        # fp32 copy and no pass over it
        # Several slots: each pair's row in bf16 by default (MOKGEN_BWD_DX_PAIRS), rounded once
        # like the forward's combine slots and like the rows distributed_backward sends back, so
        # the sum over the slots is the distributed one's, with half the bytes of fp32 rows
        # written and read (measured: docs/perf-notes.md v0.20)
        one_slot = K == 1
        pair_dtype = torch.bfloat16 if one_slot or env.bwd_dx_pairs() == "bf16" else f32
        dx_pairs = torch.empty(T * K, x.shape[1], dtype=pair_dtype, device=x.device)
        bwd_gemm.rows_gemm([(dg, w_gate), (du, w_up)], offs, b_major="mn", out=dx_pairs, out_rows=order)
        dx_rows = None
    else:
        dx_rows = gmm(dg, w_gate, offs=offs).to(f32).add_(gmm(du, w_up, offs=offs))  # f32 + (bf16 -> f32), exact
    grads = None
    sum_in_joint = False  # dX's sum over the slots done inside the joint weight launch (below)
    if need_weight_grads:
        if ours:  # one CTA per (expert, tile), rows in order; zeros for an expert without rows
            joint = env.bwd_weights_joint() and schedule == "split"  # x rows read once for both
            # launches that leave most SMs idle run side by side (overlap_weight_launches, which
            # asks for the joint launch)
            side = None
            if joint and overlap_weight_launches(E, x.shape[1], I, x.device, schedule):
                side = _side_stream(x.device)
                main = torch.cuda.current_stream(x.device)
                side.wait_stream(main)
            dw_down = None
            # dX's sum over the slots inside the joint launch (MOKGEN_BWD_SUM=side): its TMA
            # producer leaves warpgroup 0's other warps idle; the gathering producer does not
            sum_in_joint = joint and not inline_x and not one_slot and pair_dtype == torch.bfloat16 \
                and env.bwd_sum() == "side"
            try:
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    dw_down = (bwd_gemm.weight_grads(dout, hw, offs, a_index=tok) if inline_dout
                               else bwd_gemm.weight_grads(go, hw, offs, schedule=schedule))
                if joint:
                    src, index = (x.contiguous(), tok) if inline_x else (rows, None)
                    out = bwd_gemm.weight_grads_joint(dg, du, src, offs, b_index=index,
                                                      slot_sum=(dx_pairs, T, K) if sum_in_joint else None)
                    grads = [*out[:2], dw_down]
                    if sum_in_joint:
                        dx = out[2]
            finally:  # joined even if a launch raised: the inputs stay referenced until then
                if side is not None:
                    main.wait_stream(side)
                    if dw_down is not None:
                        dw_down.record_stream(main)
            if not joint:
                grads = [bwd_gemm.weight_grads(dg, rows, offs, schedule=schedule),
                         bwd_gemm.weight_grads(du, rows, offs, schedule=schedule), dw_down]
        else:
            dy = (go * wts).to(torch.bfloat16)  # bf16 * f32 promotes exactly to f32
            hb = h.to(torch.bfloat16)
            grads = [gmm(dg.t(), rows, offs=offs), gmm(du.t(), rows, offs=offs), gmm(dy.t(), hb, offs=offs)]
            empty = counts == 0  # an expert with no rows gets an exact zero gradient
            if bool(empty.any()):
                for gw in grads:
                    gw[empty] = 0
    if ours:  # dx summed over the slots in order and cast to bf16 in one pass (the bits of _unpermute's)
        if not sum_in_joint:
            dx = dx_pairs if one_slot else bwd_gemm.sum_slots(dx_pairs, T, K)
        del dx_pairs
        dw = _pair_weights(order, dw_rows, T, K)
    else:
        dx, dw = _unpermute(order, dx_rows, dw_rows, T, K, f32)
    return _finish(dx, dw, grads, x, topk_weights, (w_gate, w_up, w_down))


@torch.library.custom_op("mokgen::experts_backward", mutates_args=())
def experts_backward_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                        w_up: torch.Tensor, w_down: torch.Tensor, grad_out: torch.Tensor,
                        clamp_limit: Optional[float], saved_gu: Optional[torch.Tensor] = None,
                        ring_x: Optional[torch.Tensor] = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts_backward as one opaque operator, so that torch.compile (AOTAutograd) traces the
    megakernel's backward as a single node: its data-dependent sizes (rows per expert) stay
    inside. Returns fresh tensors (dx, d_topk_weights, dw_gate, dw_up, dw_down)."""
    out = experts_backward(x, topk_ids, topk_weights, w_gate, w_up, w_down, grad_out, clamp_limit, saved_gu=saved_gu,
                           ring_x=ring_x)
    inputs = (x, topk_ids, topk_weights, w_gate, w_up, w_down, grad_out)
    # a custom op may not return its inputs: copy in the (theoretical) case a path returns one
    return tuple(o.clone() if any(o is i for i in inputs) else o for o in out)


@experts_backward_op.register_fake
def _experts_backward_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, grad_out, clamp_limit, saved_gu=None,
                           ring_x=None):
    return (torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w_gate), torch.empty_like(w_up),
            torch.empty_like(w_down))


def distributed_backward(x, topk_ids, topk_weights, w_gate, w_up, w_down, grad_out, clamp_limit, group):
    """Backward of one expert-parallel rank across a ``torch.distributed`` group (every rank
    calls it together): this rank's tokens ``x [T, H]`` with global ids and weights, its local
    experts ``w_* [E/W, ...]``, ``grad_out [T, H]``. The mirror of the forward's dispatch:
    (token, j) pairs go to their experts' owners with their x row, routing weight and dOut row
    (all_to_all_single); each owner runs experts_backward on the rows it received (order:
    source rank, then the source's pair order: a fixed order, so weight gradients are
    reproducible), and sends each pair's dx row (in x's dtype, like the forward's combine rows)
    and d weight back; the token owner sums dx over j = 0..k-1 in fp32, in order.
    Returns (dx, d_topk_weights, dw_gate, dw_up, dw_down) of this rank."""
    import torch.distributed as dist

    from mokgen.reference import ep_dispatch_plan

    T, K = topk_ids.shape
    e_loc = w_gate.shape[0]
    W = dist.get_world_size(group)
    flat = topk_ids.reshape(-1).to(torch.int64)
    dest, order, send, recv = ep_dispatch_plan(flat, e_loc, W, group)
    tok = torch.div(order, K, rounding_mode="floor")

    def exchange(t, out_splits, in_splits):
        out = t.new_empty((sum(out_splits),) + tuple(t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
        return out

    r_x = exchange(x.index_select(0, tok), recv, send)
    r_g = exchange(grad_out.to(x.dtype).index_select(0, tok), recv, send)
    r_w = exchange(topk_weights.reshape(-1).index_select(0, order), recv, send)
    r_ids = exchange((flat - dest * e_loc).index_select(0, order), recv, send)
    # each received row is a token routed to one local expert
    dxr, dwr, dwg, dwu, dwd = experts_backward_op(r_x, r_ids.unsqueeze(1), r_w.unsqueeze(1), w_gate, w_up, w_down,
                                                  r_g, clamp_limit)
    b_dx = exchange(dxr, send, recv)
    b_dw = exchange(dwr.reshape(-1), send, recv)
    f32 = torch.float64 if x.dtype == torch.float64 else torch.float32
    dx, dw = _unpermute(order, b_dx, b_dw, T, K, f32)
    return dx.to(x.dtype), dw.to(topk_weights.dtype), dwg, dwu, dwd


def shared_op_backward(xs, w_gate, w_up, w_down, scale, grads_out):
    """Backward of the fused shared expert (FUSE_SHARED builds): out_r[t] += scale[t] *
    shared_expert(x_r[t]) for every rank r of the launch (scale None: 1). It is a one-expert
    layer with top-1 and weight scale[t], so experts_backward_op computes it (no clamp, as the
    reference's shared expert). Returns (per-rank dx lists, (d gate, d up, d down, d scale))."""
    sizes = [x.shape[0] for x in xs]
    gos = [go if go is not None else torch.zeros_like(x_) for go, x_ in zip(grads_out, xs)]
    # one rank: its own tensors (torch.cat of one copies)
    x = xs[0].contiguous() if len(xs) == 1 else torch.cat(list(xs))
    g = gos[0].contiguous() if len(gos) == 1 else torch.cat(gos)
    T = x.shape[0]
    ids = torch.zeros(T, 1, dtype=torch.int64, device=x.device)
    wdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = (scale.to(wdt) if scale is not None else torch.ones(T, dtype=wdt, device=x.device)).reshape(T, 1)
    # every token is a row of the one expert, in token order: x itself is the expert-major rows
    # (ring_x), which the kernels then read in place instead of gathering a copy
    ring = x if x.dtype == torch.bfloat16 else None
    dx, dw, dg, du, dd = experts_backward_op(x, ids, w, w_gate.unsqueeze(0), w_up.unsqueeze(0), w_down.unsqueeze(0),
                                             g, None, None, ring)
    d_scale = dw.reshape(T).to(scale.dtype) if scale is not None else None
    return list(dx.split(sizes)), (dg[0], du[0], dd[0], d_scale)


def passed_inputs(inputs, n_required: int, defaults: tuple) -> tuple[int, list]:
    """(how many arguments the caller passed, the optional ones with their defaults filled in) of
    an op call whose ``inputs`` are its ``n_required`` required arguments, then optional ones
    (``defaults``, each None or False). The dispatcher drops trailing optional arguments equal to
    their defaults from the structure autograd checks a backward's result against, so the
    backward returns that many gradients."""
    optional = list(inputs[n_required:]) + list(defaults[max(0, len(inputs) - n_required):])
    n = n_required + len(optional)
    while n > n_required and optional[n - n_required - 1] is defaults[n - n_required - 1]:
        n -= 1
    return n, optional


def ep_op_backward(saved: dict, grads_out):
    """Backward of the megakernel op for the ranks of one process (one rank, or W virtual ranks
    whose experts are all here): ``saved`` holds the op's lists (xs, topk_ids, topk_weights,
    w_gate, w_up, w_down), ``world``, ``clamp_limit`` and ``gu`` (the forward's saved
    pre-activations of every rank's pairs, or None: recompute); ``grads_out`` the gradients of the
    per-rank outputs (None for an unused output). Returns per-rank lists
    (dxs, d_topk_weights, dw_gate, dw_up, dw_down)."""
    xs, ids, ws = saved["xs"], saved["topk_ids"], saved["topk_weights"]
    wg, wu, wd = saved["w_gate"], saved["w_up"], saved["w_down"]
    n = len(xs)
    if saved["world"] != n:
        from mokgen.ep import ep_group_of

        group = ep_group_of(saved.get("local_ptr"))
        if n != 1 or group is None:
            raise NotImplementedError(
                "backward across GPUs needs the layer's process group: use mokgen.MoELayer(spec, group)")
        go = grads_out[0] if grads_out[0] is not None else torch.zeros_like(xs[0])
        out = distributed_backward(xs[0], ids[0], ws[0], wg[0], wu[0], wd[0], go, saved["clamp_limit"], group)
        return tuple([t] for t in out)
    sizes = [x.shape[0] for x in xs]
    gos = [go if go is not None else torch.zeros_like(x_) for go, x_ in zip(grads_out, xs)]

    def cat(ts):  # one rank: its own tensors (torch.cat of one would copy the weights: 4 GB on kimi-k2.5)
        return ts[0].contiguous() if len(ts) == 1 else torch.cat(list(ts))

    e_loc = [t.shape[0] for t in wg]
    # one rank: its x rows in place in the forward's receive ring, if that still holds them
    ring = None
    if n == 1:
        from mokgen.ep import ring_rows_of

        ring = ring_rows_of(saved.get("local_ptr"), xs[0], ids[0])
    # saved["gu"] (the "save" policy): the op's pre-activations, already rank by rank in pair order
    dx, dw, dwg, dwu, dwd = experts_backward_op(cat(xs), cat(ids), cat(ws), cat(wg), cat(wu), cat(wd), cat(gos),
                                                saved["clamp_limit"], saved.get("gu"), ring)
    return (list(dx.split(sizes)), list(dw.split(sizes)), list(dwg.split(e_loc)), list(dwu.split(e_loc)),
            list(dwd.split(e_loc)))
