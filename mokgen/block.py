"""MoEBlock: the whole MoE block of a model, hidden states in, block output out.

router (mokgen.router: compiled top-k selection, differentiable weights) -> routed experts
(mokgen.ep.MoELayer: the megakernel; backward through its autograd registration) + shared
expert(s): inside the megakernel as local work that overlaps the dispatch wait where the build
fuses it (``MoELayer.fuses_shared``; its backward is a one-expert experts backward,
mokgen.backward.shared_op_backward), else ``SharedExpertMLP`` in PyTorch. The same computation
as ``mokgen.reference.moe_layer_forward``; the module a model's code swaps in for its MoE block
(weights in the Hugging Face layout).
"""

from __future__ import annotations

import math

import torch

from mokgen.ep import MoELayer, cuda_device
from mokgen.errors import InputError
from mokgen.reference import shared_expert_forward, swiglu
from mokgen.router import Router
from mokgen.spec import MoESpec, load_spec


class SharedExpertMLP(torch.nn.Module):
    """``spec.shared_experts.count`` SwiGLU experts applied to every token, summed in order, and
    with ``gate == "sigmoid"`` scaled by ``sigmoid(x @ gate_weight.T)`` (Qwen3.5).

    BF16 inputs run as BF16 GEMMs (fp32 accumulation), SwiGLU in fp32 rounded to BF16 like the
    megakernel's h rows; other dtypes go through the fp32 reference. (The fp32 reference took
    2.7 ms of the 9.0 ms qwen3.5-35b-a3b block at 16384 tokens; docs/perf-notes.md, v0.4.)"""

    def __init__(self, spec: MoESpec, *, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        se, H = spec.shared_experts, spec.hidden_size
        n, Is = se.count, se.intermediate_size
        kw = dict(device=device, dtype=dtype)
        self.w_gate = torch.nn.Parameter(torch.randn(n, Is, H, **kw) / math.sqrt(H))
        self.w_up = torch.nn.Parameter(torch.randn(n, Is, H, **kw) / math.sqrt(H))
        self.w_down = torch.nn.Parameter(torch.randn(n, H, Is, **kw) / math.sqrt(Is))
        self.gate_weight = torch.nn.Parameter(torch.zeros(1, H, **kw)) if se.gate == "sigmoid" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or self.w_gate.dtype != torch.bfloat16:
            return shared_expert_forward(x, self.w_gate, self.w_up, self.w_down, gate_weight=self.gate_weight,
                                         out_dtype=x.dtype)
        F = torch.nn.functional
        out = None
        for s in range(self.w_gate.shape[0]):  # experts summed in order, fp32
            h = swiglu(F.linear(x, self.w_gate[s]).float(), F.linear(x, self.w_up[s]).float()).to(x.dtype)
            y = F.linear(h, self.w_down[s]).float()
            out = y if out is None else out + y
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x.float(), self.gate_weight.float()))
        return out.to(x.dtype)


class MoEBlock(torch.nn.Module):
    """Router + routed experts + shared expert(s) of ``spec`` on one expert-parallel rank.

    ``group``: the EP process group (None: one rank). ``forward(hidden [..., H] bf16, token_ids=None)``
    returns the block output of the same shape (``token_ids [...]`` for a hash-routing router, see
    ``Router(hash_table=...)``); the routing of the last call is kept in ``last_routing``
    (ids, weights) for auxiliary losses or inspection. ``share_buffers``: the routed experts run
    on the persistent buffers of the model's other blocks made with it whose build, geometry,
    device, group and CTA counts are the same (``MoELayer(share_buffers=True)``, whose rules
    apply): one set per model instead of one per block. ``layer_kwargs``: further MoELayer
    arguments for the routed experts (``chunk_rows``, ``ring_chunks``, ``dispatch_ctas``,
    ``tuned``, ``build_options``, ``bwd_policy``, ``bwd_ring``, ``timeout_ms``)."""

    def __init__(self, spec: MoESpec | str, group=None, *, max_tokens: int | None = None, device=None,
                 share_buffers: bool = False, layer_kwargs: dict | None = None):
        super().__init__()
        self.spec = load_spec(spec) if isinstance(spec, str) else spec
        layer_kwargs = dict(layer_kwargs or {})
        taken = sorted(set(layer_kwargs) & {"group", "max_tokens", "device", "share_buffers", "spec"})
        if taken:
            raise InputError(f"layer_kwargs: {', '.join(taken)} are MoEBlock's own arguments; pass them to MoEBlock")
        device = cuda_device(device, "MoEBlock")
        self.router = Router(self.spec, device=device)
        self.experts = MoELayer(self.spec, group, max_tokens=max_tokens, device=device, share_buffers=share_buffers,
                                **layer_kwargs)
        self.shared = SharedExpertMLP(self.spec, device=device) if self.spec.shared_experts.count else None
        self.last_routing = None

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        H = self.spec.hidden_size
        if hidden.shape[-1] != H:
            raise InputError(f"hidden: last dimension must be {H}, got shape {list(hidden.shape)}")
        if hidden.dtype != torch.bfloat16:
            raise InputError(f"hidden: dtype must be torch.bfloat16, got {hidden.dtype}")
        x = hidden.reshape(-1, H).contiguous()
        ids, w = self.router(x, None if token_ids is None else token_ids.reshape(-1))
        self.last_routing = (ids.detach(), w.detach())
        sh = self.shared
        if sh is not None and self.experts.fuses_shared:  # the megakernel runs the shared expert too
            scale = None
            if sh.gate_weight is not None:
                scale = torch.sigmoid(torch.nn.functional.linear(x.float(), sh.gate_weight.float())).reshape(-1)
            y = self.experts(x, ids, w, shared=(sh.w_gate[0], sh.w_up[0], sh.w_down[0], scale))
        else:
            y = self.experts(x, ids, w)
            if sh is not None:
                y = y + sh(x)
        return y.reshape(hidden.shape)

    def reference_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The same block through mokgen.reference (fp32, PyTorch only): the oracle to compare
        outputs, gradients and loss curves against."""
        from mokgen.reference import moe_layer_forward

        if self.experts.world != 1:
            raise InputError("reference_forward needs a single-rank block (every expert here)")
        x = hidden.reshape(-1, self.spec.hidden_size)
        shared = None
        if self.shared is not None:
            shared = {"w_gate": self.shared.w_gate, "w_up": self.shared.w_up, "w_down": self.shared.w_down}
            if self.shared.gate_weight is not None:
                shared["gate_weight"] = self.shared.gate_weight
        out, _, _ = moe_layer_forward(x, self.router.weight, self.experts.w_gate, self.experts.w_up,
                                      self.experts.w_down, self.spec, router_bias=self.router.e_score_correction_bias,
                                      shared=shared, out_dtype=hidden.dtype)
        return out.reshape(hidden.shape)
