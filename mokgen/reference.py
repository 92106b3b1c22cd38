"""Pure-PyTorch oracle for an MoE layer: routing, SwiGLU experts, combine, shared experts, and
expert parallelism over ``torch.distributed``.

This is the ground truth every compiled kernel is compared against. It needs no CUDA and no
compiled code; it runs on CPU and GPU tensors alike, and autograd works through every function
(including the expert-parallel exchange), so it is the oracle for the backward pass as well.

Conventions (the kernels follow the same ones):

* **Weights** use the Hugging Face layout, stacked over experts: ``w_gate [E, I, H]``,
  ``w_up [E, I, H]``, ``w_down [E, H, I]``. An expert computes
  ``down(swiglu(x @ w_gate[e].T, x @ w_up[e].T))``.
* **Precision.** Inputs may be bf16 (or anything else); every function upcasts its inputs to
  ``acc_dtype`` (default ``torch.float32``) and computes there. Pass ``acc_dtype=torch.float64``
  for an exact oracle. Results come back in ``acc_dtype`` unless ``out_dtype`` is given.
  The router logits are computed in ``acc_dtype`` too (fp32 by default, never bf16).
* **SwiGLU clamp** (DeepSeek-V4 / GPT-OSS style): with a limit ``L`` the gate projection is
  clamped from above only, ``gate.clamp(max=L)``, and the up projection on both sides,
  ``up.clamp(-L, L)``, before ``silu(gate) * up``. ``clamp_limit=None`` means no clamp.
* **Routing** (:func:`route`): scores are ``softmax``, ``sigmoid`` or ``sqrt(softplus)`` of the
  logits. With ``score_correction_bias`` the *selection* uses ``scores + bias`` while the returned
  *weights* are gathered from the unbiased scores. Group-limited selection (``n_group > 1``)
  scores each group by the sum of its two best biased scores (``top2_sum``) or its best one
  (``max``), keeps the ``topk_group`` best groups and sets every other expert's selection score to
  ``-inf`` before the top-k. Then weights are optionally renormalized to sum to one (a plain
  division by their sum, no epsilon) and multiplied by ``routed_scaling_factor`` (always, also
  without renormalization). ``topk_ids`` come in descending order of the selection score; on a
  tie (of groups or of experts) the lowest index wins (a stable descending sort), the rule the
  compiled router follows too.
* **Combine order.** For each token the k expert outputs are materialized as per-(t, j) rows
  ``[T, k, H]`` (the "combine slots" of the kernel) and reduced in the fixed order ``j = 0..k-1``:
  ``out = 0; out += w[:, 0] * y[:, 0]; out += w[:, 1] * y[:, 1]; ...``. The loop is written out
  rather than ``(w[..., None] * y).sum(1)`` because ``torch.sum`` does not promise a reduction
  order; the result equals that sum up to rounding. Nothing depends on how pairs are batched
  per expert, so :func:`ep_experts_forward` matches :func:`experts_forward` (bit-exact except for
  matmul blocking differences inside BLAS; ~1e-12 relative in float64).
* **Expert parallelism** (:func:`ep_experts_forward`): rank ``r`` of ``W`` owns the contiguous
  experts ``[r*E/W, (r+1)*E/W)``. The (token, j) pairs are sorted by owning rank (stable, so each
  destination receives its pairs in ascending ``t*k + j`` order), the per-destination counts are
  exchanged with ``dist.all_to_all_single`` on an int64 tensor of size W, then the token rows and
  the expert ids travel with ``dist.all_to_all_single`` using those split sizes, owners compute the
  unweighted expert FFN per pair, the rows travel back with the reversed split sizes, and the token
  owner weights and reduces them as above. The row exchange is a differentiable all-to-all (its
  backward is the all-to-all with the splits swapped), so gradients flow to ``x``, the routing
  weights and the local expert weights. The gloo backend (CPU) supports ``all_to_all_single``
  with uneven and empty splits (checked with torch 2.13), so gloo and NCCL use the same code path.
  A validation failure on any rank (out-of-range id) is agreed on with one ``all_reduce`` first,
  so every rank raises the same ``ValueError`` instead of the others hanging in a collective.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

__all__ = [
    "swiglu",
    "route",
    "route_weights",
    "hash_route",
    "experts_forward",
    "shared_expert_forward",
    "moe_layer_forward",
    "ep_experts_forward",
]

_SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
_GROUP_SCORES = ("top2_sum", "max")


# ----------------------------------------------------------------------------------------------
# helpers


def _finish(t: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    return t if out_dtype is None else t.to(out_dtype)


def _check_weights(w_gate, w_up, w_down, hidden: int | None = None) -> tuple[int, int, int]:
    """Validate stacked HF-layout expert weights; return (E, I, H)."""
    if w_gate.dim() != 3 or w_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            "expert weights must be 3-D: w_gate [E, I, H], w_up [E, I, H], w_down [E, H, I]; got "
            f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}"
        )
    e, i, h = w_gate.shape
    if e < 1:
        raise ValueError("expert weights hold no experts (E = 0)")
    if tuple(w_up.shape) != (e, i, h) or tuple(w_down.shape) != (e, h, i):
        raise ValueError(
            f"expert weight shapes disagree: w_gate {tuple(w_gate.shape)}, w_up {tuple(w_up.shape)}"
            f" (expected {(e, i, h)}), w_down {tuple(w_down.shape)} (expected {(e, h, i)})"
        )
    if hidden is not None and h != hidden:
        raise ValueError(f"x has hidden size {hidden} but the expert weights have {h}")
    return e, i, h


def _check_routing(x, topk_ids, topk_weights) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids must be [T, k] with T = {x.shape[0]}, got shape {tuple(topk_ids.shape)}"
        )
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape "
            f"{tuple(topk_ids.shape)}"
        )
    dt = topk_ids.dtype
    if dt.is_floating_point or dt.is_complex or dt == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    return x.shape[0], topk_ids.shape[1]


def _bad_ids(ids: torch.Tensor, num_experts: int) -> bool:
    return bool(ids.numel()) and bool(((ids < 0) | (ids >= num_experts)).any())


def _check_layer(x, topk_ids, topk_weights, w_gate, w_up, w_down) -> tuple[int, int, int]:
    """The checks of an expert layer's inputs: (T, k, H), or ValueError."""
    num_tokens, k = _check_routing(x, topk_ids, topk_weights)
    num_experts, _, hidden = _check_weights(w_gate, w_up, w_down, x.shape[1])
    if _bad_ids(topk_ids, num_experts):
        raise ValueError(f"topk_ids must lie in [0, {num_experts}); got min "
                         f"{int(topk_ids.min())}, max {int(topk_ids.max())}")
    return num_tokens, k, hidden


def _matmul_t(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return a @ w.T


def _expert_rows(rows, expert_ids, w_gate, w_up, w_down, clamp_limit, mm=_matmul_t):
    """Unweighted expert FFN for each row: ``out[n] = FFN_{expert_ids[n]}(rows[n])``.
    ``mm(a, w)``: the projection ``a @ w.T`` (the MXFP8 oracle passes its quantizing one).

    Rows are grouped per expert (stable sort by expert id), each group runs as one batched
    projection, and the results are scattered back to the rows' original order. Everything is
    differentiable (the scatter is a gather by the inverse permutation).
    """
    n = rows.shape[0]
    num_experts = w_gate.shape[0]
    if n == 0:
        # Run the (empty) projections anyway rather than returning new zeros: the result must stay
        # in the autograd graph of rows and weights, so that in expert parallelism a rank that
        # serves no pair still takes part in the backward all-to-alls.
        dt = rows.dtype
        h = swiglu(mm(rows, w_gate[0].to(dt)), mm(rows, w_up[0].to(dt)), clamp_limit)
        return mm(h, w_down[0].to(dt))
    perm = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=num_experts).tolist()
    sorted_rows = rows.index_select(0, perm)
    outs = []
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        r = sorted_rows[start : start + c]
        # Upcast one expert at a time: the stacked weights of a large model may not fit twice.
        dt = r.dtype
        h = swiglu(mm(r, w_gate[e].to(dt)), mm(r, w_up[e].to(dt)), clamp_limit)
        outs.append(mm(h, w_down[e].to(dt)))
        start += c
    out_sorted = torch.cat(outs, dim=0)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n, device=perm.device)
    return out_sorted.index_select(0, inv)


def _combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted reduction of combine slots ``y [T, k, H]`` in the fixed order j = 0..k-1."""
    out = y.new_zeros((y.shape[0], y.shape[2]))
    for j in range(y.shape[1]):
        out = out + weights[:, j : j + 1] * y[:, j]
    return out


# ----------------------------------------------------------------------------------------------
# activation and routing


def swiglu(gate: torch.Tensor, up: torch.Tensor, clamp_limit: float | None = None) -> torch.Tensor:
    """``silu(gate) * up``, computed in the inputs' dtype.

    With ``clamp_limit=L`` (DeepSeek-V4 / GPT-OSS convention) the inputs are clamped first:
    ``gate = gate.clamp(max=L)`` (upper side only) and ``up = up.clamp(-L, L)``.
    """
    if clamp_limit is not None:
        limit = float(clamp_limit)
        if not limit > 0:
            raise ValueError(f"clamp_limit must be positive, got {clamp_limit}")
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def route(
    logits: torch.Tensor,
    spec: Any,
    bias: torch.Tensor | None = None,
    acc_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select ``k = spec.top_k`` experts per token and their weights.

    ``logits [T, E]`` (any float dtype, upcast to ``acc_dtype``); ``bias [E]`` is the score
    correction bias, required when ``spec.routing.score_correction_bias`` and rejected otherwise.
    Returns ``topk_ids`` (int64 ``[T, k]``, descending selection score) and ``topk_weights``
    (``acc_dtype`` ``[T, k]``), differentiable w.r.t. ``logits``. See the module docstring for
    the exact rules.
    """
    r = spec.routing
    num_experts, k = int(spec.num_experts), int(spec.top_k)
    if logits.dim() != 2 or logits.shape[1] != num_experts:
        raise ValueError(f"logits must be [T, {num_experts}], got shape {tuple(logits.shape)}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {k}")
    logits = logits.to(acc_dtype)

    if r.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif r.scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    elif r.scoring == "sqrtsoftplus":
        scores = torch.sqrt(F.softplus(logits))
    else:
        raise ValueError(f"routing.scoring must be one of {_SCORINGS}, got {r.scoring!r}")

    if r.score_correction_bias:
        if bias is None:
            raise ValueError("routing.score_correction_bias is set but no bias was given")
        if tuple(bias.shape) != (num_experts,):
            raise ValueError(f"bias must be [{num_experts}], got shape {tuple(bias.shape)}")
        select = scores.detach() + bias.detach().to(device=scores.device, dtype=acc_dtype)
    else:
        if bias is not None:
            raise ValueError("a bias was given but routing.score_correction_bias is not set")
        select = scores.detach()

    n_group = int(r.n_group)
    if n_group > 1:
        topk_group = int(r.topk_group)
        if num_experts % n_group:
            raise ValueError(f"n_group {n_group} does not divide num_experts {num_experts}")
        per_group = num_experts // n_group
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be in [1, {n_group}], got {topk_group}")
        if k > topk_group * per_group:
            raise ValueError(
                f"top_k {k} exceeds the {topk_group} kept groups x {per_group} experts per group"
            )
        grouped = select.view(-1, n_group, per_group)
        if r.group_score == "top2_sum":
            if per_group < 2:
                raise ValueError("group_score 'top2_sum' needs at least 2 experts per group")
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        elif r.group_score == "max":
            group_scores = grouped.amax(dim=-1)
        else:
            raise ValueError(
                f"routing.group_score must be one of {_GROUP_SCORES}, got {r.group_score!r}"
            )
        keep_groups = _top_lowest_id(group_scores, topk_group)
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, keep_groups, True)
        expert_mask = group_mask.repeat_interleave(per_group, dim=1)
        select = select.masked_fill(~expert_mask, float("-inf"))

    topk_ids = _top_lowest_id(select, k)
    topk_weights = route_weights(logits, topk_ids, spec, acc_dtype=acc_dtype)
    return topk_ids.to(torch.int64), topk_weights


def _top_lowest_id(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values per row, in descending order; equal values are ordered by
    index, so on a tie the lowest index wins (a stable descending sort)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def hash_route(logits: torch.Tensor, token_ids: torch.Tensor, table: torch.Tensor, spec: Any,
               acc_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing (DeepSeek-V4's first layers): the experts of a token are a fixed function of
    its token id, ``table[token_id]`` (``table [V, k]``, distinct ids in ``[0, E)`` per row); the
    weights are the router's scores at those experts, as in :func:`route_weights` (scoring,
    renormalization, routed scaling factor). Returns ``(topk_ids int64 [T, k], topk_weights)``."""
    k, E = int(spec.top_k), int(spec.num_experts)
    if table.dim() != 2 or table.shape[1] != k:
        raise ValueError(f"hash table must be [V, {k}], got shape {tuple(table.shape)}")
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= E):
        raise ValueError(f"hash table ids must be in [0, {E})")
    if token_ids.dim() != 1 or token_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"token_ids must be [{logits.shape[0]}], got shape {tuple(token_ids.shape)}")
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= table.shape[0]):
        raise ValueError(f"token_ids must be in [0, {table.shape[0]}) (the hash table's rows)")
    ids = table.to(torch.int64).index_select(0, token_ids.to(torch.int64))
    return ids, route_weights(logits, ids, spec, acc_dtype=acc_dtype)


def route_weights(logits: torch.Tensor, topk_ids: torch.Tensor, spec: Any,
                  acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The combine weights of already selected experts: the unbiased scores of ``topk_ids``
    (softmax over all E logits, sigmoid or sqrt(softplus)), renormalized if the spec says so,
    times ``routed_scaling_factor``. Differentiable w.r.t. ``logits``; compiled routers select
    the ids and call this for the weights."""
    r = spec.routing
    logits = logits.to(acc_dtype)
    ids = topk_ids.to(torch.int64)
    if r.scoring == "softmax":
        w = torch.softmax(logits, dim=-1).gather(1, ids)
    elif r.scoring == "sigmoid":
        w = torch.sigmoid(logits.gather(1, ids))
    elif r.scoring == "sqrtsoftplus":
        w = torch.sqrt(F.softplus(logits.gather(1, ids)))
    else:
        raise ValueError(f"routing.scoring must be one of {_SCORINGS}, got {r.scoring!r}")
    if r.renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * float(r.routed_scaling_factor)


# ----------------------------------------------------------------------------------------------
# experts


def experts_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    clamp_limit: float | None = None,
    acc_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Routed experts of one rank holding all E experts: ``x [T, H] -> [T, H]``.

    For each (token t, slot j) the expert ``topk_ids[t, j]`` computes its unweighted SwiGLU FFN
    of ``x[t]`` into combine slot ``[t, j]`` of a ``[T, k, H]`` buffer (pairs are batched per
    expert); the output is ``sum_j topk_weights[t, j] * slot[t, j]`` accumulated in the fixed
    order j = 0..k-1. Raises ``ValueError`` for ids outside ``[0, E)``. ``T`` may be 0.
    """
    num_tokens, k, hidden = _check_layer(x, topk_ids, topk_weights, w_gate, w_up, w_down)
    xa = x.to(acc_dtype)
    ids = topk_ids.to(torch.int64).reshape(-1)
    rows = xa.repeat_interleave(k, dim=0)  # row t*k + j is x[t]
    y = _expert_rows(rows, ids, w_gate, w_up, w_down, clamp_limit).view(num_tokens, k, hidden)
    return _finish(_combine(y, topk_weights.to(acc_dtype)), out_dtype)


def shared_expert_forward(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    gate_weight: torch.Tensor | None = None,
    clamp_limit: float | None = None,
    acc_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Shared expert(s), applied to every token: ``x [T, H] -> [T, H]``.

    One expert: ``w_gate [Is, H]``, ``w_up [Is, H]``, ``w_down [H, Is]``. Several: the same
    stacked, ``[n, Is, H]`` / ``[n, Is, H]`` / ``[n, H, Is]``; their outputs are summed in order
    0..n-1. With ``gate_weight`` (``[1, H]`` or ``[H]``, the Qwen shared-expert gate) the summed
    output is multiplied by ``sigmoid(x @ gate_weight.T)`` per token.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    if w_gate.dim() == 2 and w_up.dim() == 2 and w_down.dim() == 2:
        w_gate, w_up, w_down = w_gate.unsqueeze(0), w_up.unsqueeze(0), w_down.unsqueeze(0)
    n, _, hidden = _check_weights(w_gate, w_up, w_down, x.shape[1])
    xa = x.to(acc_dtype)
    out = xa.new_zeros((x.shape[0], hidden))
    for s in range(n):
        wg, wu, wd = (w[s].to(acc_dtype) for w in (w_gate, w_up, w_down))
        out = out + swiglu(xa @ wg.T, xa @ wu.T, clamp_limit) @ wd.T
    if gate_weight is not None:
        if gate_weight.dim() == 1:
            gate_weight = gate_weight.unsqueeze(0)
        if tuple(gate_weight.shape) != (1, hidden):
            raise ValueError(f"gate_weight must be [1, {hidden}] or [{hidden}], got "
                             f"{tuple(gate_weight.shape)}")
        out = out * torch.sigmoid(xa @ gate_weight.to(acc_dtype).T)
    return _finish(out, out_dtype)


def moe_layer_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    spec: Any,
    router_bias: torch.Tensor | None = None,
    shared: Mapping[str, Any] | None = None,
    acc_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole MoE layer on one rank: router, routed experts, shared expert(s).

    ``logits = x @ router_weight.T`` in ``acc_dtype`` (``router_weight [E, H]``), then
    :func:`route` (``router_bias`` is the score correction bias), :func:`experts_forward` with
    ``spec.activation.clamp_limit``, plus :func:`shared_expert_forward` when
    ``spec.shared_experts.count > 0``. ``shared`` is a dict with ``w_gate``, ``w_up``, ``w_down``
    and, when ``spec.shared_experts.gate == "sigmoid"``, ``gate_weight``; an optional
    ``clamp_limit`` key applies a SwiGLU clamp to the shared expert (default: none, the spec's
    clamp is for the routed experts). Returns ``(out, topk_ids, topk_weights)``.
    """
    hidden, num_experts = int(spec.hidden_size), int(spec.num_experts)
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [T, {hidden}], got shape {tuple(x.shape)}")
    if tuple(router_weight.shape) != (num_experts, hidden):
        raise ValueError(f"router_weight must be [{num_experts}, {hidden}], got "
                         f"{tuple(router_weight.shape)}")
    e, i, _ = _check_weights(w_gate, w_up, w_down, hidden)
    if e != num_experts or i != int(spec.moe_intermediate_size):
        raise ValueError(f"expert weights are for E={e}, I={i}; the spec says "
                         f"E={num_experts}, I={spec.moe_intermediate_size}")
    xa = x.to(acc_dtype)
    logits = xa @ router_weight.to(acc_dtype).T
    topk_ids, topk_weights = route(logits, spec, bias=router_bias, acc_dtype=acc_dtype)
    out = experts_forward(xa, topk_ids, topk_weights, w_gate, w_up, w_down,
                          clamp_limit=spec.activation.clamp_limit, acc_dtype=acc_dtype)

    se = spec.shared_experts
    count = int(se.count)
    if count > 0:
        if shared is None:
            raise ValueError(
                f"the spec has {count} shared expert(s) but no shared weights were given"
            )
        sw = [shared["w_gate"], shared["w_up"], shared["w_down"]]
        n = 1 if sw[0].dim() == 2 else sw[0].shape[0]
        if n != count or sw[0].shape[-2] != int(se.intermediate_size):
            raise ValueError(f"shared weights w_gate {tuple(sw[0].shape)} do not match the spec's "
                             f"{count} x {se.intermediate_size} shared expert(s)")
        gate_weight = shared.get("gate_weight")
        if se.gate == "sigmoid" and gate_weight is None:
            raise ValueError(
                "shared_experts.gate is 'sigmoid' but shared['gate_weight'] is missing"
            )
        if se.gate == "none" and gate_weight is not None:
            raise ValueError("shared['gate_weight'] was given but shared_experts.gate is 'none'")
        out = out + shared_expert_forward(xa, *sw, gate_weight=gate_weight,
                                          clamp_limit=shared.get("clamp_limit"),
                                          acc_dtype=acc_dtype)
    elif shared is not None:
        raise ValueError("shared weights were given but the spec has no shared experts")
    return _finish(out, out_dtype), topk_ids, topk_weights


# ----------------------------------------------------------------------------------------------
# expert parallelism


class _AllToAllRows(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` along dim 0; backward sends gradients back."""

    @staticmethod
    def forward(ctx, inp, out_splits, in_splits, group):
        import torch.distributed as dist

        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = inp.new_empty((sum(out_splits),) + tuple(inp.shape[1:]))
        dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = _AllToAllRows.apply(
            grad_out.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group
        )
        return grad_in, None, None, None


def _all_to_all_rows(inp, out_splits, in_splits, group):
    return _AllToAllRows.apply(inp, list(out_splits), list(in_splits), group)


def ep_dispatch_plan(flat_ids: torch.Tensor, e_local: int, world: int, group=None):
    """Where each (token, j) pair goes under expert parallelism: ``dest`` (owner rank of each
    pair, experts split evenly over ``world`` ranks), ``order`` (pairs sorted stably by owner),
    and the send / receive row counts per rank (exchanged with one all_to_all_single)."""
    import torch.distributed as dist

    dest = torch.div(flat_ids, e_local, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return dest, order, send_counts.tolist(), recv_counts.tolist()


def ep_experts_forward(
    x_local: torch.Tensor,
    topk_ids_local: torch.Tensor,
    topk_weights_local: torch.Tensor,
    w_gate_local: torch.Tensor,
    w_up_local: torch.Tensor,
    w_down_local: torch.Tensor,
    group: Any = None,
    clamp_limit: float | None = None,
    acc_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
    num_experts: int | None = None,
) -> torch.Tensor:
    """Expert-parallel :func:`experts_forward` over a ``torch.distributed`` group.

    Every rank of ``group`` (default: the world) calls this with its own tokens
    ``x_local [T_r, H]`` (``T_r`` may differ per rank and be 0), their routing with *global*
    expert ids, and its slice of the experts ``w_*_local [E/W, ...]``: rank ``r`` owns experts
    ``[r*E/W, (r+1)*E/W)``. Returns ``[T_r, H]``, equal (up to rounding) to the matching rows of
    :func:`experts_forward` on the concatenated global inputs. ``num_experts`` (optional) is the
    global E, checked against the weights; a world size that does not divide it is a
    ``ValueError``, as is an id outside ``[0, E)`` on any rank (raised on every rank).
    Collective: every rank of the group must call it, with the same weights shapes and dtypes.
    Backward is collective too: every rank must run backward through the output, with the same
    ``requires_grad`` pattern (x, weights) on every rank, so that the all-to-alls pair up.
    """
    import torch.distributed as dist

    num_tokens, k = _check_routing(x_local, topk_ids_local, topk_weights_local)
    e_local, _, hidden = _check_weights(w_gate_local, w_up_local, w_down_local, x_local.shape[1])
    world = dist.get_world_size(group)
    if num_experts is not None:
        if num_experts % world:
            raise ValueError(f"world size {world} does not divide num_experts {num_experts}")
        if num_experts // world != e_local:
            raise ValueError(f"num_experts {num_experts} over {world} ranks is "
                             f"{num_experts // world} experts per rank, but the local weights "
                             f"hold {e_local}")
    total_experts = e_local * world
    device = x_local.device

    # Agree on validity first so that a bad input on one rank cannot leave the others waiting.
    bad = torch.tensor([int(_bad_ids(topk_ids_local, total_experts))], dtype=torch.int64,
                       device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if int(bad.item()):
        raise ValueError(f"topk_ids must lie in [0, {total_experts}) on every rank; "
                         f"an out-of-range id was found"
                         + (" on this rank" if _bad_ids(topk_ids_local, total_experts) else
                            " on another rank"))

    # Dispatch: pair p = t*k + j goes to rank ids[p] // e_local; stable sort by destination.
    ids = topk_ids_local.to(torch.int64).reshape(-1)
    dest, order, send_splits, recv_splits = ep_dispatch_plan(ids, e_local, world, group)

    xa = x_local.to(acc_dtype)
    send_rows = xa.index_select(0, torch.div(order, k, rounding_mode="floor"))
    send_ids = (ids - dest * e_local).index_select(0, order)
    recv_ids = send_ids.new_empty((sum(recv_splits),))
    dist.all_to_all_single(recv_ids, send_ids.contiguous(), recv_splits, send_splits, group=group)
    recv_rows = _all_to_all_rows(send_rows, recv_splits, send_splits, group)

    # Owner: unweighted expert FFN per received pair, then push the results back.
    results = _expert_rows(recv_rows, recv_ids, w_gate_local, w_up_local, w_down_local, clamp_limit)
    back = _all_to_all_rows(results, send_splits, recv_splits, group)

    # Token owner: undo the destination sort into combine slots [T, k, H], reduce j = 0..k-1.
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    y = back.index_select(0, inv).view(num_tokens, k, hidden)
    return _finish(_combine(y, topk_weights_local.to(acc_dtype)), out_dtype)


# ----------------------------------------------------------------------------------------------
# MX quantization (issue 6): the oracle for `numerics: mxfp8`
#
# OCP Microscaling (MX) v1.0 semantics, MXFP8 with E4M3 elements:
#
# * A block is 32 consecutive elements along the reduction dimension (``dim``); it shares one
#   scale X = 2**s stored as E8M0: 8 exponent bits, bias 127, codes 0..254 for 2**-127..2**127,
#   255 = NaN; no zero, no sign, no infinity.
# * s = floor(log2(max |V_i|)) - 8, 8 being the exponent of E4M3's largest normal (448 = 1.75 *
#   2**8), clamped to [-127, 127]. An all-zero block takes s = -127.
# * Each element is V_i / X (exact: a power of two) rounded to E4M3 with round-to-nearest-even;
#   magnitudes above 448 saturate to 448 (E4M3 has no infinity). With the floor rule above
#   |V_i / X| < 512, so at most the block maximum's binade saturates: a block maximum in
#   [480, 512) * X comes back as 448 * X, a relative error of up to 12.5% on that element only.
# * E4M3 (the OCP "E4M3FN" element type): 1 sign, 4 exponent (bias 7), 3 mantissa bits; normals
#   2**-6 .. 448, subnormals m * 2**-9 (m = 1..7), NaN = S.1111.111 (0x7F / 0xFF), signed zeros.
#   Values up to half the smallest subnormal (2**-10, a tie: to even) round to zero, keeping
#   their sign.
# * NaN and infinity (left implementation-defined for the scale by MX v1.0): a block that holds
#   a NaN or an infinity gets the NaN scale (0xFF) and NaN element codes (0x7F), so the value
#   propagates through dequantization instead of saturating to a finite 448 * X.
#
# Codes are uint8 tensors: elements with the input's shape, scales with ``dim`` divided by 32.
# The arithmetic is float64, where every step above is exact except the one rounding to E4M3.

MX_BLOCK = 32
E4M3_MAX = 448.0
E4M3_NAN = 0x7F
E8M0_NAN = 0xFF
_E4M3_EMAX = 8           # exponent of the largest normal
_E4M3_MIN_NORMAL = 2.0 ** -6
_E4M3_SUBNORMAL = 2.0 ** -9  # spacing of subnormals (the smallest one)

__all__ += ["MX_BLOCK", "e4m3_encode", "e4m3_decode", "e8m0_decode", "mx_quantize", "mx_dequantize",
            "mx_fake_quantize", "mx_experts_forward"]


def _exponent(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for a > 0, exactly (from the binary exponent; log2 may round up to the next
    integer for a float64 just below a power of two)."""
    return (torch.frexp(a)[1] - 1).to(torch.float64)


def e4m3_encode(values: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (uint8) of ``values``: round-to-nearest-even, saturating to +-448 (infinities
    too), NaN -> 0x7F, the sign of zero kept."""
    v = values.detach().to(torch.float64)
    a = v.abs()
    nan = torch.isnan(v)
    a = torch.where(nan, torch.zeros_like(a), a).clamp(max=E4M3_MAX)
    # the spacing of representable values at a: 2**(e - 3) for normals, 2**-9 below 2**-6
    e = _exponent(a.clamp(min=_E4M3_MIN_NORMAL)).clamp(max=_E4M3_EMAX)
    step = torch.where(a < _E4M3_MIN_NORMAL, torch.full_like(a, _E4M3_SUBNORMAL), torch.exp2(e - 3))
    q = (torch.round(a / step) * step).clamp(max=E4M3_MAX)  # torch.round: ties to even
    # q -> fields: subnormal (exponent field 0) or normal (q may have reached the next binade)
    sub = q < _E4M3_MIN_NORMAL
    qe = _exponent(q.clamp(min=_E4M3_MIN_NORMAL))
    exp_field = torch.where(sub, torch.zeros_like(qe), qe + 7)
    mant = torch.where(sub, q / _E4M3_SUBNORMAL, (q / torch.exp2(qe) - 1.0) * 8.0)
    code = (exp_field * 8 + mant).to(torch.int64)
    code = code + torch.signbit(v).to(torch.int64) * 0x80
    code = torch.where(nan, torch.full_like(code, E4M3_NAN), code)
    return code.to(torch.uint8)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of E4M3 codes (uint8); 0x7F / 0xFF decode to NaN."""
    c = codes.to(torch.int64)
    sign = torch.where(c >= 0x80, -1.0, 1.0).to(torch.float64)
    exp_field, mant = (c >> 3) & 0xF, (c & 0x7).to(torch.float64)
    normal = (1.0 + mant / 8.0) * torch.exp2((exp_field - 7).to(torch.float64))
    value = torch.where(exp_field == 0, mant * _E4M3_SUBNORMAL, normal) * sign
    return torch.where((c & 0x7F) == E4M3_NAN, torch.full_like(value, float("nan")), value)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """float64 scales 2**(code - 127) of E8M0 codes (uint8); 0xFF decodes to NaN."""
    c = codes.to(torch.int64)
    value = torch.exp2((c - 127).to(torch.float64))
    return torch.where(c == E8M0_NAN, torch.full_like(value, float("nan")), value)


def mx_blocks(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """``x`` with ``dim`` moved last and split into blocks of 32: ``[..., dim / 32, 32]``, and
    ``dim`` as a non-negative index; ValueError when ``dim``'s size is not a multiple of 32."""
    if x.dim() == 0:
        raise ValueError("MX quantization needs at least one dimension")
    d = dim % x.dim()
    if x.shape[d] % MX_BLOCK:
        raise ValueError(f"MX blocks are {MX_BLOCK} elements along dim {dim}, which has {x.shape[d]} "
                         f"(not a multiple of {MX_BLOCK})")
    moved = x.movedim(d, -1)
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // MX_BLOCK, MX_BLOCK), d


def mx_unblocks(blocks: torch.Tensor, d: int) -> torch.Tensor:
    """The inverse of :func:`mx_blocks`: ``[..., n, 32]`` back to ``dim`` ``d`` (contiguous)."""
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * MX_BLOCK).movedim(-1, d).contiguous()


def mx_block_scales(scales: torch.Tensor, dim: int, blocks: torch.Tensor, codes_shape) -> torch.Tensor:
    """``scales`` with ``dim`` moved last, checked against the code blocks they scale."""
    sc = scales.movedim(dim % scales.dim(), -1)
    if sc.shape != blocks.shape[:-1]:
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not fit codes of shape {tuple(codes_shape)} "
                         f"(one per {MX_BLOCK} elements along dim {dim})")
    return sc


def mx_quantize(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 (E4M3 elements, E8M0 scales per 32 elements along ``dim``) of ``x``: returns
    ``(codes, scales)``, uint8, codes shaped like ``x``, scales like ``x`` with ``dim`` / 32.
    Raises ValueError when ``dim``'s size is not a multiple of 32."""
    blocks, d = mx_blocks(x.detach().to(torch.float64), dim)
    amax = blocks.abs().amax(-1)
    finite = torch.isfinite(blocks).all(-1)
    tiny = torch.where(amax > 0, amax, torch.ones_like(amax))  # an all-zero block: s = -127 below
    s = torch.where(amax > 0, _exponent(tiny) - _E4M3_EMAX, torch.full_like(amax, -127.0))
    s = torch.where(finite, s, torch.zeros_like(s)).clamp(-127, 127)
    codes = e4m3_encode(blocks / torch.exp2(s)[..., None])
    codes = torch.where(finite[..., None], codes, torch.full_like(codes, E4M3_NAN))
    scales = torch.where(finite, (s + 127).to(torch.int64), torch.full_like(s, E8M0_NAN, dtype=torch.int64))
    return mx_unblocks(codes, d), scales.to(torch.uint8).movedim(-1, d).contiguous()


def mx_dequantize(codes: torch.Tensor, scales: torch.Tensor, dim: int = -1,
                  out_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The values of MXFP8 ``(codes, scales)`` as ``mx_quantize`` returns them, in ``out_dtype``."""
    blocks, d = mx_blocks(codes, dim)
    sc = mx_block_scales(scales, dim, blocks, codes.shape)
    return mx_unblocks(e4m3_decode(blocks) * e8m0_decode(sc)[..., None], d).to(out_dtype)


def mx_fake_quantize(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x`` through MXFP8 and back, in ``x``'s dtype: what a kernel computing on MXFP8 operands
    sees (no gradient: the oracle of the quantized forward)."""
    return mx_dequantize(*mx_quantize(x, dim), dim=dim, out_dtype=x.dtype)


def _fake_quantize_rows(t: torch.Tensor) -> torch.Tensor:
    """MXFP8 along dim 0 (the rows a weight gradient sums over), zero rows padding it to a
    multiple of 32 (zeros change no block's maximum)."""
    pad = -t.shape[0] % MX_BLOCK
    padded = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t
    return mx_fake_quantize(padded, dim=0)[: t.shape[0]]


class _MXMatmul(torch.autograd.Function):
    """``a [n, K] @ w [N, K]^T`` as an MXFP8 GEMM: forward with a and w quantized along K; backward
    with each GEMM's operands quantized along its own reduction dimension (the transposed
    quantization of MX training): dgrad ``dA = q_N(dY) q_N(W)`` (dY along its columns, W along its
    rows), wgrad ``dW = q_n(dY)^T q_n(A)`` (both along the token rows). Straight-through: the
    gradient is of the unquantized inputs."""

    @staticmethod
    def forward(ctx, a, w):
        ctx.save_for_backward(a, w)
        return mx_fake_quantize(a) @ mx_fake_quantize(w).T

    @staticmethod
    def backward(ctx, gy):
        a, w = ctx.saved_tensors
        ga = mx_fake_quantize(gy, dim=-1) @ mx_fake_quantize(w, dim=0) if ctx.needs_input_grad[0] else None
        gw = _fake_quantize_rows(gy).T @ _fake_quantize_rows(a) if ctx.needs_input_grad[1] else None
        return ga, gw


def mx_experts_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    clamp_limit: float | None = None,
    acc_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`experts_forward` on the operands an MXFP8 layer computes with (issue 6): the token
    rows (quantized on dispatch) and the intermediate activation h (quantized in the
    up-projection epilogue) go through MXFP8 along their reduction dimension (H, then I), the
    weights along theirs (``w_gate`` / ``w_up`` along H, ``w_down`` along I); products and sums
    in ``acc_dtype``, the combine as in BF16. Differentiable: every backward GEMM quantizes its
    operands along its own reduction dimension (``_MXMatmul``), the SwiGLU and combine backward
    stay in ``acc_dtype``; the oracle of the MXFP8 forward and backward. H and I must be
    multiples of 32."""
    num_tokens, k, hidden = _check_layer(x, topk_ids, topk_weights, w_gate, w_up, w_down)
    inter = w_gate.shape[1]
    if hidden % MX_BLOCK or inter % MX_BLOCK:
        raise ValueError(f"MX blocks are {MX_BLOCK} elements: the hidden ({hidden}) and intermediate ({inter}) "
                         f"sizes must be multiples of {MX_BLOCK}")
    rows = x.to(acc_dtype).repeat_interleave(k, dim=0)
    ids = topk_ids.to(torch.int64).reshape(-1)
    wq = [w.to(acc_dtype) for w in (w_gate, w_up, w_down)]
    y = _expert_rows(rows, ids, *wq, clamp_limit, mm=_MXMatmul.apply).view(num_tokens, k, hidden)
    return _finish(_combine(y, topk_weights.to(acc_dtype)), out_dtype)
