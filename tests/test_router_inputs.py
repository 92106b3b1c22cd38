"""mokgen.router: input validation (CPU; nothing is built or launched) and the weight formula it
shares with the reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mokgen.errors import InputError  # noqa: E402
from mokgen.reference import route as ref_route  # noqa: E402
from mokgen.reference import route_weights  # noqa: E402
from mokgen.router import Router, route  # noqa: E402
from mokgen.spec import bundled_specs, load_spec  # noqa: E402

BIASED = "deepseek-v3"      # sigmoid, bias, 8 groups
PLAIN = "qwen3-30b-a3b"     # softmax, no bias


def test_bias_required_exactly_when_the_spec_has_one():
    logits = torch.zeros(4, 256)
    with pytest.raises(InputError, match="score-correction bias; pass it"):
        route(logits, BIASED)
    with pytest.raises(InputError, match="has no score-correction bias; pass bias=None"):
        route(torch.zeros(4, 128), PLAIN, bias=torch.zeros(128))


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(4, 255), r"logits: shape must be \[\*, 256\]"),
    (torch.zeros(4, 256, dtype=torch.int32), "logits: dtype must be"),
    (torch.zeros(256), r"logits: shape must be"),
])
def test_logits_shape_and_dtype(bad, match):
    with pytest.raises(InputError, match=match):
        route(bad, BIASED, bias=torch.zeros(256))


def test_cpu_tensors_are_refused_before_any_build():
    with pytest.raises(InputError, match="logits: must be on a CUDA device"):
        route(torch.zeros(4, 256), BIASED, bias=torch.zeros(256))
    with pytest.raises(InputError, match=r"bias: shape must be \[256\]"):
        route(torch.zeros(4, 256), BIASED, bias=torch.zeros(255))


def test_router_module_parameters():
    r = Router(BIASED, device="cpu")
    assert tuple(r.weight.shape) == (256, 7168) and r.weight.dtype == torch.bfloat16
    assert tuple(r.e_score_correction_bias.shape) == (256,) and r.e_score_correction_bias.dtype == torch.float32
    assert "e_score_correction_bias" in dict(r.named_buffers())
    p = Router(PLAIN, device="cpu")
    assert p.e_score_correction_bias is None and not list(p.buffers())
    with pytest.raises(InputError, match=r"x: shape must be \[\*, 2048\]"):
        p.logits(torch.zeros(3, 7))


def _weights_by_hand(logits, ids, spec):
    """The routing weights written out from the formula (exp, log1p), not through route_weights:
    the unbiased score of each selected expert (softmax over all E logits, sigmoid, or
    sqrt(softplus)), renormalized over the k if the spec says so, times routed_scaling_factor."""
    r = spec.routing
    picked = torch.take_along_dim(logits, ids.to(torch.int64), dim=1)
    if r.scoring == "softmax":
        z = (logits - logits.amax(-1, keepdim=True).detach()).exp()
        w = torch.take_along_dim(z, ids.to(torch.int64), dim=1) / z.sum(-1, keepdim=True)
    elif r.scoring == "sigmoid":
        w = 1 / (1 + (-picked).exp())
    else:
        w = picked.exp().log1p().sqrt()
    if r.renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * r.routed_scaling_factor


def _row_by_hand(logits_row, ids_row, spec):
    """One token's weights in plain Python floats (math), the formula once more."""
    import math

    r = spec.routing
    x = [float(v) for v in logits_row]
    if r.scoring == "softmax":
        top = max(x)
        total = sum(math.exp(v - top) for v in x)
        w = [math.exp(x[i] - top) / total for i in ids_row]
    elif r.scoring == "sigmoid":
        w = [1 / (1 + math.exp(-x[i])) for i in ids_row]
    else:
        w = [math.sqrt(math.log1p(math.exp(x[i]))) for i in ids_row]
    if r.renormalize:
        w = [v / sum(w) for v in w]
    return [v * r.routed_scaling_factor for v in w]


@pytest.mark.parametrize("name", sorted(bundled_specs()))
def test_route_weights_is_the_reference_formula(name):
    """route_weights (what the reference's route and the compiled routers return as weights) at
    the reference's ids equals the formula written out by hand, values and gradients; one token
    again in plain floats. (It used to be compared with the reference's route, which calls it.)"""
    spec = load_spec(name)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, spec.num_experts, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(spec.num_experts, generator=gen, dtype=torch.float64) * 0.1 if spec.routing.score_correction_bias else None
    ids, w = ref_route(logits, spec, bias=bias, acc_dtype=torch.float64)
    want = _weights_by_hand(logits, ids, spec)
    torch.testing.assert_close(w, want)
    torch.testing.assert_close(route_weights(logits, ids.to(torch.int32), spec, acc_dtype=torch.float64), want)
    assert w[0].tolist() == pytest.approx(_row_by_hand(logits[0].detach(), ids[0].tolist(), spec), rel=1e-12)
    g = torch.randn_like(w)
    (a,) = torch.autograd.grad((w * g).sum(), logits, retain_graph=True)
    (b,) = torch.autograd.grad((want * g).sum(), logits)
    torch.testing.assert_close(a, b)
    assert a.abs().sum() > 0


def test_hash_route_reference():
    from mokgen.reference import hash_route

    spec = load_spec("deepseek-v4-pro")  # sqrtsoftplus, renormalized, scaled
    gen = torch.Generator().manual_seed(0)
    table = torch.rand(50, spec.num_experts, generator=gen).topk(spec.top_k, dim=-1).indices
    tok = torch.tensor([3, 3, 49, 0])
    logits = torch.randn(4, spec.num_experts, generator=gen, dtype=torch.float64, requires_grad=True)
    ids, w = hash_route(logits, tok, table, spec, acc_dtype=torch.float64)
    assert torch.equal(ids, table[tok])  # the same token, the same experts, whatever the logits
    torch.testing.assert_close(w, _weights_by_hand(logits, ids, spec))
    torch.testing.assert_close(w.sum(-1), torch.full((4,), spec.routing.routed_scaling_factor, dtype=torch.float64))
    w.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"token_ids must be in \[0, 50\)"):
        hash_route(logits, torch.tensor([0, 1, 2, 50]), table, spec)
    with pytest.raises(ValueError, match="hash table must be"):
        hash_route(logits, tok, table[:, :2], spec)


def test_hash_routing_inputs():
    spec = load_spec("deepseek-v4-pro")
    table = torch.zeros(10, spec.top_k, dtype=torch.int64)
    with pytest.raises(InputError, match="needs both hash_table"):
        route(torch.zeros(2, spec.num_experts), spec, hash_table=table)
    with pytest.raises(InputError, match="hash table ids must be in"):
        route(torch.zeros(2, spec.num_experts), spec, token_ids=torch.tensor([0, 1]), hash_table=table - 1)
    ids, w = route(torch.zeros(2, spec.num_experts), spec, token_ids=torch.tensor([0, 9]),
                   hash_table=torch.arange(10 * spec.top_k).view(10, spec.top_k) % spec.num_experts)
    assert ids.dtype == torch.int32 and ids[1].tolist() == list(range(9 * spec.top_k, 10 * spec.top_k))
    r = Router(spec, device="cpu", hash_table=table)
    with pytest.raises(InputError, match="pass token_ids"):
        r(torch.zeros(2, spec.hidden_size, dtype=torch.bfloat16))
    with pytest.raises(InputError, match="has no hash table"):
        Router(spec, device="cpu")(torch.zeros(2, spec.hidden_size, dtype=torch.bfloat16), torch.tensor([0, 1]))


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b", "deepseek-v3"])
def test_shared_expert_mlp_bf16_path_matches_the_fp64_reference(name):
    """MoEBlock's shared expert: BF16 inputs run as BF16 GEMMs (the fast path), within bf16
    tolerance of the fp64 reference, the sigmoid gate included; gradients reach every weight."""
    from mokgen.block import SharedExpertMLP
    from mokgen.reference import shared_expert_forward

    spec = load_spec(name)
    torch.manual_seed(0)
    m = SharedExpertMLP(spec)
    if m.gate_weight is not None:
        m.gate_weight.data.normal_(std=0.05)
    x = torch.randn(48, spec.hidden_size).to(torch.bfloat16).requires_grad_(True)
    out = m(x)
    gate = None if m.gate_weight is None else m.gate_weight.double()
    want = shared_expert_forward(x.double(), m.w_gate.double(), m.w_up.double(), m.w_down.double(), gate_weight=gate)
    assert out.dtype == torch.bfloat16
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-2
    wrong = shared_expert_forward(x.double(), m.w_up.double(), m.w_gate.double(), m.w_down.double(), gate_weight=gate)
    assert ((out.double() - wrong).norm() / wrong.norm()).item() > 0.1  # the check discriminates
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
