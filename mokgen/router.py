"""The router: hidden states -> (top-k expert ids, combine weights), compiled per spec.

Selection (which experts) runs in the generated kernel (templates/include/mokgen/router.cuh,
exported by each build as ``ROUTE_OP``): scoring, the score-correction bias for selection only,
group-limited top-k, lowest expert id on ties. The combine weights are gathered from the logits
by :func:`mokgen.reference.route_weights` (softmax / sigmoid / sqrt-softplus at the selected ids,
renormalization, routed scaling factor) in PyTorch, so gradients reach the logits, hence the
gate weights and the hidden states, through autograd; the ids carry no gradient. The gate GEMM
is an fp32 ``F.linear`` (router logits are never computed in bf16).

GPU tests: tests/test_gpu_router.py (every bundled spec against the reference, ties, gradients).
"""

from __future__ import annotations

import torch

from mokgen.errors import InputError
from mokgen.load import load
from mokgen.ops import _check, _check_device
from mokgen.reference import hash_route, route_weights
from mokgen.spec import MoESpec, load_spec


def _spec(spec: MoESpec | str) -> MoESpec:
    return load_spec(spec) if isinstance(spec, str) else spec


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_route_inputs(spec: MoESpec, logits: torch.Tensor, bias: torch.Tensor | None) -> None:
    # shapes and dtypes of every argument first, devices last (as in mokgen.ops); logits are
    # checked by the caller
    E = spec.num_experts
    floats = _FLOATS
    if spec.routing.score_correction_bias:
        if bias is None:
            raise InputError(f"bias: {spec.name} routes with a score-correction bias; pass it ([{E}] float)")
        _check(bias, "bias", shape=(E,), dtypes=floats, contiguous=False)
    elif bias is not None:
        raise InputError(f"bias: {spec.name} has no score-correction bias; pass bias=None")
    _check_device(logits, "logits", None)
    if bias is not None:
        _check_device(bias, "bias", logits.device)


def route(logits: torch.Tensor, spec: MoESpec | str, bias: torch.Tensor | None = None, *,
          token_ids: torch.Tensor | None = None, hash_table: torch.Tensor | None = None):
    """Select ``spec.top_k`` experts per token from router ``logits [T, E]`` (any float dtype;
    computed in fp32). Returns ``(topk_ids, topk_weights)``: int32 ``[T, k]`` ids, best first
    (equal to :func:`mokgen.reference.route`'s, ties to the lowest id), and fp32 ``[T, k]``
    weights, differentiable w.r.t. ``logits``. ``bias [E]``: the score-correction bias, required
    exactly when the spec has one.

    Hash routing (DeepSeek-V4's first layers): with ``hash_table [V, k]`` and ``token_ids [T]``
    the ids are ``hash_table[token_ids]`` (no selection, the bias unused) and the weights the
    scores there (:func:`mokgen.reference.hash_route`)."""
    spec = _spec(spec)
    _check(logits, "logits", shape=(None, spec.num_experts), dtypes=_FLOATS, contiguous=False)
    if hash_table is not None or token_ids is not None:
        if hash_table is None or token_ids is None:
            raise InputError("hash routing needs both hash_table [V, k] and token_ids [T]")
        _check(hash_table, "hash_table", shape=(None, spec.top_k), dtypes=(torch.int32, torch.int64), contiguous=False)
        _check(token_ids, "token_ids", shape=(logits.shape[0],), dtypes=(torch.int32, torch.int64), contiguous=False)
        try:
            ids, w = hash_route(logits, token_ids, hash_table, spec)
        except ValueError as err:
            raise InputError(str(err)) from None
        return ids.to(torch.int32), w
    _check_route_inputs(spec, logits, bias)
    lf = logits.detach().float().contiguous()
    bf = None if bias is None else bias.detach().float().contiguous()
    ids = load(spec).ROUTE_OP(lf, bf)
    return ids, route_weights(logits, ids, spec)


class Router(torch.nn.Module):
    """The gate of an MoE block: ``weight [E, H]`` (the Hugging Face ``gate.weight``) and, when the
    spec has one, the buffer ``e_score_correction_bias [E]`` (fp32). ``forward(x [T, H])`` returns
    ``(topk_ids int32 [T, k], topk_weights fp32 [T, k])``; gradients flow to ``weight`` and ``x``
    through the weights."""

    def __init__(self, spec: MoESpec | str, *, device=None, dtype: torch.dtype = torch.bfloat16,
                 hash_table: torch.Tensor | None = None):
        super().__init__()
        self.spec = _spec(spec)
        #: hash routing: ``forward(x, token_ids)`` takes the experts from this [V, k] table
        self.register_buffer("hash_table", None if hash_table is None else hash_table.to(device=device))
        E, H = self.spec.num_experts, self.spec.hidden_size
        self.weight = torch.nn.Parameter(torch.empty(E, H, device=device, dtype=dtype))
        torch.nn.init.normal_(self.weight, std=H**-0.5)
        if self.spec.routing.score_correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(E, device=device, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        _check(x, "x", shape=(None, self.spec.hidden_size), dtypes=(torch.bfloat16, torch.float16, torch.float32),
               contiguous=False)
        return torch.nn.functional.linear(x.float(), self.weight.float())

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None):
        if self.hash_table is not None:
            if token_ids is None:
                raise InputError("this router hashes token ids to experts: pass token_ids")
            return route(self.logits(x), self.spec, token_ids=token_ids, hash_table=self.hash_table)
        if token_ids is not None:
            raise InputError("token_ids given, but this router has no hash table")
        return route(self.logits(x), self.spec, self.e_score_correction_bias)

    def extra_repr(self) -> str:
        r = self.spec.routing
        return (f"spec={self.spec.name}, experts={self.spec.num_experts}, top_k={self.spec.top_k}, scoring={r.scoring}, "
                f"bias={r.score_correction_bias}, groups={r.n_group}/{r.topk_group}")
