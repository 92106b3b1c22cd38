"""The compiled router (templates/include/mokgen/router.cuh via mokgen.router) against
mokgen.reference.route on the GPU: ids and weights for every bundled spec, exact ties, gradients,
zero tokens, determinism."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mokgen import reference  # noqa: E402
from mokgen.router import Router, route  # noqa: E402
from mokgen.spec import bundled_specs, load_spec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_memory")]

ALL_SPECS = sorted(bundled_specs())


def _inputs(spec, T, seed, quantized):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, spec.num_experts, generator=gen, device="cuda")
    if quantized:  # coarse values: many exact ties, no near-ties between distinct values
        logits = torch.round(logits * 2) / 2
    bias = None
    if spec.routing.score_correction_bias:
        bias = torch.randn(spec.num_experts, generator=gen, device="cuda") * 0.05
        if quantized:
            bias = torch.round(bias * 64) / 64
    return logits, bias


def _selection(spec, logits, bias):
    """The reference's selection score (what the ids are ranked by), fp64."""
    r = spec.routing
    x = logits.double()
    s = {"softmax": lambda: torch.softmax(x, -1), "sigmoid": lambda: torch.sigmoid(x),
         "sqrtsoftplus": lambda: torch.sqrt(torch.nn.functional.softplus(x))}[r.scoring]()
    return s + (bias.double() if bias is not None else 0)


@pytest.mark.parametrize("name", ALL_SPECS)
@pytest.mark.parametrize("quantized", [True, False], ids=["ties", "random"])
def test_ids_and_weights_match_the_reference(name, quantized):
    spec = load_spec(name)
    logits, bias = _inputs(spec, 4096, 7, quantized)
    ids, w = route(logits, spec, bias)
    ref_ids, ref_w = reference.route(logits, spec, bias=bias)
    assert ids.dtype == torch.int32 and tuple(ids.shape) == (4096, spec.top_k)
    same = (ids.long() == ref_ids).all(dim=1)
    if quantized:
        assert bool(same.all()), f"{int((~same).sum())} tokens differ; first: {ids[~same][:2].tolist()} vs {ref_ids[~same][:2].tolist()}"
    else:
        # continuous logits: the kernel's fp32 scores may differ from torch's by an ulp, so a
        # different pick is allowed only between selection scores that are that close
        sel = _selection(spec, logits, bias)
        for t in (~same).nonzero().flatten().tolist():
            a, b = sel[t, ids[t].long()], sel[t, ref_ids[t]]
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (t, ids[t].tolist(), ref_ids[t].tolist())
        assert int((~same).sum()) <= 2
    rows = same.nonzero().flatten()
    torch.testing.assert_close(w[rows], ref_w[rows])


@pytest.mark.parametrize("scoring, group_score, bias", [
    ("softmax", "top2_sum", False),   # group sums need probabilities, not logits
    ("softmax", "max", False),
    ("sqrtsoftplus", "top2_sum", True),
    ("sigmoid", "max", True),
])
def test_group_limited_rules_on_custom_specs(scoring, group_score, bias):
    from mokgen.spec import spec_from_dict

    d = load_spec("deepseek-v3").canonical_dict()
    d.update(name=f"router-{scoring}-{group_score.replace('_', '')}", aliases=[], num_experts=64, top_k=4,
             routing={**d["routing"], "scoring": scoring, "group_score": group_score, "n_group": 8,
                      "topk_group": 2, "score_correction_bias": bias})
    spec = spec_from_dict(d)
    logits, b = _inputs(spec, 2048, 11, quantized=True)
    ids, w = route(logits, spec, b)
    ref_ids, ref_w = reference.route(logits, spec, bias=b)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w, ref_w)


def test_every_selection_rule_on_small_hand_cases():
    spec = load_spec("deepseek-v3")  # sigmoid + bias, 8 groups of 32, keep 4, top-8
    logits = torch.zeros(3, 256, device="cuda")
    bias = torch.zeros(256, device="cuda")
    ids, _ = route(logits, spec, bias)
    assert ids[0].tolist() == list(range(8))  # all tied: groups 0..3 kept, lowest ids
    # a bias that makes group 7 the best and its experts 255, 254 the top two
    bias[255], bias[254] = 1.0, 0.5
    ids, _ = route(logits, spec, bias)
    assert ids[0].tolist()[:2] == [255, 254] and ids[0].tolist()[2:] == list(range(6))


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3.5-397b-a17b", "deepseek-v4-pro"])
def test_router_module_gradients_match_the_reference(name):
    spec = load_spec(name)
    torch.manual_seed(0)
    router = Router(spec, device="cuda", dtype=torch.float32)
    if router.e_score_correction_bias is not None:
        router.e_score_correction_bias.normal_(std=0.05)
    x = torch.randn(512, spec.hidden_size, device="cuda", requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    wt = router.weight.detach().clone().requires_grad_(True)
    ids, w = router(x)
    ref_ids, ref_w = reference.route(torch.nn.functional.linear(x2, wt), spec, bias=router.e_score_correction_bias)
    same = (ids.long() == ref_ids).all(dim=1)
    assert int((~same).sum()) <= 1  # an fp32 near-tie at most (see the test above)
    g = torch.randn_like(w) * same.unsqueeze(1)  # rows picked differently contribute nothing
    (w * g).sum().backward()
    gx, gw = x.grad.clone(), router.weight.grad.clone()
    (ref_w * g).sum().backward()
    torch.testing.assert_close(gx, x2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, wt.grad, rtol=1e-4, atol=1e-5)


def test_zero_tokens_and_determinism():
    spec = load_spec("kimi-k2.5")
    logits, bias = _inputs(spec, 0, 1, False)
    ids, w = route(logits, spec, bias)
    assert tuple(ids.shape) == (0, spec.top_k) and tuple(w.shape) == (0, spec.top_k)
    logits, bias = _inputs(spec, 8192, 2, False)
    first = route(logits, spec, bias)[0]
    for _ in range(20):
        assert torch.equal(route(logits, spec, bias)[0], first)
