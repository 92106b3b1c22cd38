"""CPU tests of the pure-PyTorch oracle (mokgen.reference)."""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

import pytest
import torch

from mokgen.reference import (
    experts_forward,
    moe_layer_forward,
    route,
    shared_expert_forward,
    swiglu,
)

F64 = torch.float64


def make_spec(
    *,
    E=8,
    k=2,
    H=16,
    I=8,
    scoring="softmax",
    bias=False,
    renormalize=False,
    scale=1.0,
    n_group=1,
    topk_group=1,
    group_score="top2_sum",
    clamp=None,
    shared_count=0,
    shared_I=8,
    shared_gate="none",
):
    return NS(
        hidden_size=H,
        moe_intermediate_size=I,
        num_experts=E,
        top_k=k,
        shared_experts=NS(count=shared_count, intermediate_size=shared_I, gate=shared_gate),
        activation=NS(clamp_limit=clamp),
        routing=NS(
            scoring=scoring,
            score_correction_bias=bias,
            renormalize=renormalize,
            routed_scaling_factor=scale,
            n_group=n_group,
            topk_group=topk_group,
            group_score=group_score,
        ),
    )


def sig(v):
    return 1.0 / (1.0 + math.exp(-v))


def weights(E, I, H, gen, dtype=F64, scale=0.3):
    wg = torch.randn(E, I, H, generator=gen, dtype=dtype) * scale
    wu = torch.randn(E, I, H, generator=gen, dtype=dtype) * scale
    wd = torch.randn(E, H, I, generator=gen, dtype=dtype) * scale
    return wg, wu, wd


# ------------------------------------------------------------------------------------------------
# routing: hand-computed examples


def test_route_softmax_hand_example():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]], dtype=F64)
    z = math.exp(3) + math.exp(2) + math.exp(1) + 5 * math.exp(0)
    ids, w = route(logits, make_spec(scoring="softmax"), acc_dtype=F64)
    assert ids.dtype == torch.int64 and ids.tolist() == [[3, 2]]
    assert w.dtype == F64
    torch.testing.assert_close(w, torch.tensor([[math.exp(3) / z, math.exp(2) / z]], dtype=F64))
    # renormalized: e^3/(e^3+e^2) = sigmoid(1), times the scale
    ids, w = route(logits, make_spec(scoring="softmax", renormalize=True, scale=2.0), acc_dtype=F64)
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(w, torch.tensor([[2 * sig(1.0), 2 * sig(-1.0)]], dtype=F64))


def test_route_sigmoid_hand_example():
    logits = torch.tensor([[-1.0, 2.0, 0.5, 1.0, -3.0, 0.0, 0.0, 0.0]], dtype=F64)
    ids, w = route(logits, make_spec(scoring="sigmoid", scale=2.5), acc_dtype=F64)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(w, torch.tensor([[2.5 * sig(2.0), 2.5 * sig(1.0)]], dtype=F64))
    ids, w = route(logits, make_spec(scoring="sigmoid", renormalize=True, scale=2.5), acc_dtype=F64)
    s = sig(2.0) + sig(1.0)
    torch.testing.assert_close(
        w, torch.tensor([[2.5 * sig(2.0) / s, 2.5 * sig(1.0) / s]], dtype=F64)
    )


def test_route_sqrtsoftplus_hand_example():
    logits = torch.tensor([[0.3, -2.0, 4.0, 1.5, 0.0, -1.0, 2.0, -0.5]], dtype=F64)
    ssp = lambda v: math.sqrt(math.log1p(math.exp(v)))  # noqa: E731
    ids, w = route(logits, make_spec(scoring="sqrtsoftplus", k=3, scale=1.5), acc_dtype=F64)
    assert ids.tolist() == [[2, 6, 3]]
    torch.testing.assert_close(
        w, torch.tensor([[1.5 * ssp(4.0), 1.5 * ssp(2.0), 1.5 * ssp(1.5)]], dtype=F64)
    )


def test_route_fp32_default_and_bf16_logits():
    logits = torch.randn(5, 8, dtype=torch.bfloat16)
    ids, w = route(logits, make_spec(scoring="sigmoid"))
    assert w.dtype == torch.float32 and ids.shape == (5, 2)
    ref_ids, ref_w = route(logits.to(F64), make_spec(scoring="sigmoid"), acc_dtype=F64)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w.to(F64), ref_w, rtol=1e-6, atol=1e-7)


def test_route_bias_changes_selection_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -1.0, -1.0, -1.0, -1.0]], dtype=F64)
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=F64)
    spec_nb = make_spec(scoring="sigmoid")
    spec_b = make_spec(scoring="sigmoid", bias=True)
    ids0, w0 = route(logits, spec_nb, acc_dtype=F64)
    ids1, w1 = route(logits, spec_b, bias=bias, acc_dtype=F64)
    assert ids0.tolist() == [[0, 1]]
    assert ids1.tolist() == [[2, 0]]
    # weights are the unbiased scores of the selected experts
    torch.testing.assert_close(w1, torch.tensor([[sig(0.0), sig(2.0)]], dtype=F64))
    # a zero bias is the same as no bias
    ids2, w2 = route(logits, spec_b, bias=torch.zeros(8, dtype=F64), acc_dtype=F64)
    assert torch.equal(ids2, ids0) and torch.equal(w2, w0)


def test_route_bias_required_and_rejected():
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="bias"):
        route(logits, make_spec(scoring="sigmoid", bias=True))
    with pytest.raises(ValueError, match="bias"):
        route(logits, make_spec(scoring="sigmoid"), bias=torch.zeros(8))
    with pytest.raises(ValueError, match="bias"):
        route(logits, make_spec(scoring="sigmoid", bias=True), bias=torch.zeros(7))


# group-limited: groups of 2 experts; plain top-2 picks from groups 0 and 1, but groups 2 and 3
# have the better top-2 sums, so group-limited top2_sum routing picks from them.
GROUP_LOGITS = torch.tensor([[3.0, -5.0, 2.5, -5.0, 1.0, -0.2, 0.9, 0.1]], dtype=F64)


def test_route_group_limited_top2_sum_differs_from_plain():
    plain_ids, _ = route(GROUP_LOGITS, make_spec(scoring="sigmoid"), acc_dtype=F64)
    assert plain_ids.tolist() == [[0, 2]]
    spec = make_spec(scoring="sigmoid", n_group=4, topk_group=2, group_score="top2_sum")
    ids, w = route(GROUP_LOGITS, spec, acc_dtype=F64)
    assert ids.tolist() == [[4, 6]]
    torch.testing.assert_close(w, torch.tensor([[sig(1.0), sig(0.9)]], dtype=F64))


def test_route_group_limited_max():
    # by the max score groups 0 and 1 win, so the result equals plain top-k here ...
    spec = make_spec(scoring="sigmoid", n_group=4, topk_group=2, group_score="max")
    ids, _ = route(GROUP_LOGITS, spec, acc_dtype=F64)
    assert ids.tolist() == [[0, 2]]
    # ... and with one kept group only the best group's experts are eligible.
    spec = make_spec(scoring="sigmoid", n_group=4, topk_group=1, group_score="max")
    ids, _ = route(GROUP_LOGITS, spec, acc_dtype=F64)
    assert ids.tolist() == [[0, 1]]


def test_route_group_limited_masks_with_minus_inf():
    # Biased scores of the kept group are negative; masked experts must still never be chosen
    # (a 0.0 fill would pick expert 2).
    spec = make_spec(E=4, k=2, scoring="sigmoid", bias=True, n_group=2, topk_group=1,
                     renormalize=True, scale=3.0)
    logits = torch.zeros(1, 4, dtype=F64)
    bias = torch.tensor([-0.7, -0.6, 0.45, -20.0], dtype=F64)
    ids, w = route(logits, spec, bias=bias, acc_dtype=F64)
    assert ids.tolist() == [[1, 0]]
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5]], dtype=F64))


def test_route_group_limited_random_only_from_best_groups():
    gen = torch.Generator().manual_seed(1)
    E, G, TG, k = 16, 4, 2, 3
    spec = make_spec(E=E, k=k, scoring="sigmoid", bias=True, n_group=G, topk_group=TG)
    logits = torch.randn(64, E, generator=gen, dtype=F64)
    bias = torch.randn(E, generator=gen, dtype=F64) * 0.1
    ids, _ = route(logits, spec, bias=bias, acc_dtype=F64)
    biased = (torch.sigmoid(logits) + bias).view(64, G, E // G)
    best_groups = biased.topk(2, dim=-1).values.sum(-1).topk(TG, dim=-1).indices
    for t in range(64):
        allowed = {int(g) * (E // G) + i for g in best_groups[t] for i in range(E // G)}
        assert set(ids[t].tolist()) <= allowed
        # and they are the k best (biased) among the allowed ones
        flat = biased[t].reshape(-1)
        best = sorted(allowed, key=lambda e: -float(flat[e]))[:k]
        assert ids[t].tolist() == best


def test_route_ties_lowest_id_wins():
    # every expert equal: the k lowest ids, in order
    spec = make_spec(E=8, k=3, scoring="sigmoid")
    ids, _ = route(torch.zeros(2, 8, dtype=F64), spec, acc_dtype=F64)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    # a tie straddling the k-th place: expert 5 beats expert 6 (same score), 7 is best
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 2.0]], dtype=F64)
    ids, _ = route(logits, make_spec(E=8, k=2, scoring="softmax"), acc_dtype=F64)
    assert ids.tolist() == [[7, 5]]
    # tied groups: the lower group is kept (groups 1 and 3 tie for the second place)
    spec = make_spec(E=8, k=2, scoring="sigmoid", n_group=4, topk_group=2, group_score="max")
    logits = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.0, 0.5, 0.0, 1.0]], dtype=F64)
    ids, _ = route(logits, spec, acc_dtype=F64)
    assert ids.tolist() == [[1, 3]]  # groups 0 and 1; expert 7 (group 3) is not eligible
    spec = make_spec(E=8, k=3, scoring="sigmoid", n_group=4, topk_group=2, group_score="max")
    ids, _ = route(logits, spec, acc_dtype=F64)
    assert ids.tolist() == [[1, 3, 0]]  # the third pick ties among 0 and 2: 0


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_route_renormalize_sums_to_scale(scoring):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(33, 8, generator=gen)
    spec = make_spec(k=3, scoring=scoring, renormalize=True, scale=2.827)
    ids, w = route(logits, spec)
    torch.testing.assert_close(w.sum(-1), torch.full((33,), 2.827))
    # ids are distinct and in descending score order
    assert all(len(set(r)) == 3 for r in ids.tolist())
    spec_raw = make_spec(k=3, scoring=scoring, renormalize=False, scale=1.0)
    _, w_raw = route(logits, spec_raw)
    assert (w_raw[:, :-1] >= w_raw[:, 1:]).all()
    assert not torch.allclose(w_raw.sum(-1), torch.ones(33))


def test_route_zero_tokens():
    spec = make_spec(scoring="sigmoid", bias=True, n_group=4, topk_group=2)
    ids, w = route(torch.zeros(0, 8), spec, bias=torch.zeros(8))
    assert ids.shape == (0, 2) and w.shape == (0, 2)


def test_route_gradcheck():
    gen = torch.Generator().manual_seed(3)
    for scoring in ("softmax", "sigmoid", "sqrtsoftplus"):
        spec = make_spec(k=3, scoring=scoring, renormalize=True, scale=2.5, bias=True,
                         n_group=4, topk_group=2)
        logits = torch.randn(4, 8, generator=gen, dtype=F64, requires_grad=True)
        bias = torch.randn(8, generator=gen, dtype=F64) * 0.1
        assert torch.autograd.gradcheck(
            lambda lg: route(lg, spec, bias=bias, acc_dtype=F64)[1], (logits,)
        )


# ------------------------------------------------------------------------------------------------
# activation


def test_swiglu_no_clamp():
    g = torch.tensor([-2.0, 0.0, 3.0], dtype=F64)
    u = torch.tensor([1.5, -1.0, 2.0], dtype=F64)
    torch.testing.assert_close(swiglu(g, u), g * torch.sigmoid(g) * u)


def test_swiglu_clamp_applied():
    g = torch.tensor([100.0, 100.0, -100.0, 5.0], dtype=F64)
    u = torch.tensor([-100.0, 100.0, 3.0, 2.0], dtype=F64)
    out = swiglu(g, u, clamp_limit=10.0)
    silu10 = 10.0 * sig(10.0)
    expected = torch.tensor(
        [silu10 * -10.0, silu10 * 10.0, -100.0 * sig(-100.0) * 3.0, 5.0 * sig(5.0) * 2.0], dtype=F64
    )
    torch.testing.assert_close(out, expected)
    # gate is only clamped from above: a very negative gate stays very negative
    neg = swiglu(torch.tensor([-12.0], dtype=F64), torch.tensor([1.0], dtype=F64), 10.0)
    assert neg.item() == pytest.approx(-12.0 * sig(-12.0))
    assert not torch.allclose(swiglu(g, u), out)


# ------------------------------------------------------------------------------------------------
# experts


def naive_experts(x, ids, w, wg, wu, wd, clamp=None):
    out = torch.zeros(x.shape[0], x.shape[1], dtype=F64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g = wg[e] @ x[t]
            u = wu[e] @ x[t]
            if clamp is not None:
                g = g.clamp(max=clamp)
                u = u.clamp(-clamp, clamp)
            h = torch.nn.functional.silu(g) * u
            out[t] += w[t, j] * (wd[e] @ h)
    return out


@pytest.mark.parametrize("clamp", [None, 0.5])
def test_experts_forward_matches_naive_loop(clamp):
    gen = torch.Generator().manual_seed(4)
    T, H, I, E, k = 11, 16, 8, 5, 3
    x = torch.randn(T, H, generator=gen, dtype=F64)
    ids = torch.randint(0, E, (T, k), generator=gen)  # duplicates within a token allowed
    ids[0] = torch.tensor([4, 4, 4])
    w = torch.rand(T, k, generator=gen, dtype=F64)
    wg, wu, wd = weights(E, I, H, gen)
    out = experts_forward(x, ids, w, wg, wu, wd, clamp_limit=clamp, acc_dtype=F64)
    assert out.dtype == F64 and out.shape == (T, H)
    ref = naive_experts(x, ids, w, wg, wu, wd, clamp)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if clamp is not None:  # the clamp actually bit
        unclamped = experts_forward(x, ids, w, wg, wu, wd, acc_dtype=F64)
        assert not torch.allclose(out, unclamped)


def test_experts_forward_dtypes():
    gen = torch.Generator().manual_seed(5)
    T, H, I, E, k = 6, 16, 8, 4, 2
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, k), generator=gen, dtype=torch.int32)
    w = torch.rand(T, k, generator=gen).to(torch.bfloat16)
    wg, wu, wd = (t.to(torch.bfloat16) for t in weights(E, I, H, gen, dtype=torch.float32))
    out = experts_forward(x, ids, w, wg, wu, wd)
    assert out.dtype == torch.float32
    ref = naive_experts(x.to(F64), ids, w.to(F64), wg.to(F64), wu.to(F64), wd.to(F64))
    torch.testing.assert_close(out.to(F64), ref, rtol=1e-5, atol=1e-6)
    out_bf = experts_forward(x, ids, w, wg, wu, wd, out_dtype=torch.bfloat16)
    assert out_bf.dtype == torch.bfloat16
    assert torch.equal(out_bf, out.to(torch.bfloat16))


def test_experts_forward_zero_tokens():
    gen = torch.Generator().manual_seed(6)
    wg, wu, wd = weights(4, 8, 16, gen)
    out = experts_forward(torch.zeros(0, 16, dtype=F64), torch.zeros(0, 2, dtype=torch.int64),
                          torch.zeros(0, 2, dtype=F64), wg, wu, wd, acc_dtype=F64)
    assert out.shape == (0, 16) and out.dtype == F64


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_experts_forward_out_of_range_id_raises(bad):
    gen = torch.Generator().manual_seed(7)
    wg, wu, wd = weights(4, 8, 16, gen)
    ids = torch.tensor([[0, 1], [2, bad]])
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        experts_forward(torch.randn(2, 16, dtype=F64), ids, torch.rand(2, 2, dtype=F64),
                        wg, wu, wd)


def test_experts_forward_shape_errors():
    gen = torch.Generator().manual_seed(8)
    wg, wu, wd = weights(4, 8, 16, gen)
    x = torch.randn(3, 16, dtype=F64)
    ids = torch.zeros(3, 2, dtype=torch.int64)
    w = torch.rand(3, 2, dtype=F64)
    with pytest.raises(ValueError):
        experts_forward(x, ids, w[:, :1], wg, wu, wd)
    with pytest.raises(ValueError):
        experts_forward(x, ids.float(), w, wg, wu, wd)
    with pytest.raises(ValueError):
        experts_forward(x, ids, w, wg, wu, wd.transpose(1, 2))
    with pytest.raises(ValueError):
        experts_forward(x[:, :8], ids, w, wg, wu, wd)


def test_experts_forward_gradcheck():
    gen = torch.Generator().manual_seed(9)
    T, H, I, E, k = 3, 4, 3, 3, 2
    ids = torch.tensor([[0, 2], [2, 1], [1, 1]])
    x = torch.randn(T, H, generator=gen, dtype=F64, requires_grad=True)
    w = torch.rand(T, k, generator=gen, dtype=F64, requires_grad=True)
    wg, wu, wd = (t.requires_grad_() for t in weights(E, I, H, gen, scale=0.5))
    assert torch.autograd.gradcheck(
        lambda *a: experts_forward(a[0], ids, *a[1:], acc_dtype=F64), (x, w, wg, wu, wd)
    )


# ------------------------------------------------------------------------------------------------
# shared experts and the whole layer


def test_shared_expert_with_and_without_gate():
    gen = torch.Generator().manual_seed(10)
    T, H, Is = 5, 16, 12
    x = torch.randn(T, H, generator=gen, dtype=F64)
    wg, wu, wd = (t[0] for t in weights(1, Is, H, gen))
    out = shared_expert_forward(x, wg, wu, wd, acc_dtype=F64)
    ref = naive_experts(x, torch.zeros(T, 1, dtype=torch.int64), torch.ones(T, 1, dtype=F64),
                        wg[None], wu[None], wd[None])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)

    gate = torch.randn(1, H, generator=gen, dtype=F64)
    gated = shared_expert_forward(x, wg, wu, wd, gate_weight=gate, acc_dtype=F64)
    factor = torch.sigmoid(x @ gate[0])
    torch.testing.assert_close(gated, ref * factor[:, None], rtol=1e-12, atol=1e-12)
    gated_1d = shared_expert_forward(x, wg, wu, wd, gate_weight=gate[0], acc_dtype=F64)
    torch.testing.assert_close(gated_1d, gated, rtol=0, atol=0)
    with pytest.raises(ValueError):
        shared_expert_forward(x, wg, wu, wd, gate_weight=torch.zeros(2, H, dtype=F64))


def test_shared_expert_stacked_sums():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 16, generator=gen, dtype=F64)
    wg, wu, wd = weights(2, 8, 16, gen)
    out = shared_expert_forward(x, wg, wu, wd, acc_dtype=F64)
    parts = sum(shared_expert_forward(x, wg[s], wu[s], wd[s], acc_dtype=F64) for s in range(2))
    torch.testing.assert_close(out, parts, rtol=1e-12, atol=1e-12)
    assert shared_expert_forward(x.float(), wg, wu, wd).dtype == torch.float32


def test_moe_layer_forward_composes():
    gen = torch.Generator().manual_seed(12)
    T, H, I, E, k, Is = 9, 16, 8, 8, 2, 12
    spec = make_spec(E=E, k=k, H=H, I=I, scoring="sigmoid", bias=True, renormalize=True,
                     scale=2.5, n_group=4, topk_group=2, clamp=1.0, shared_count=1,
                     shared_I=Is, shared_gate="sigmoid")
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    router = torch.randn(E, H, generator=gen, dtype=F64)
    rbias = torch.randn(E, generator=gen, dtype=F64) * 0.1
    wg, wu, wd = weights(E, I, H, gen)
    sg, su, sd = (t[0] for t in weights(1, Is, H, gen))
    gate = torch.randn(H, generator=gen, dtype=F64)
    shared = dict(w_gate=sg, w_up=su, w_down=sd, gate_weight=gate)
    out, ids, w = moe_layer_forward(x, router, wg, wu, wd, spec, router_bias=rbias,
                                    shared=shared, acc_dtype=F64)
    xd = x.to(F64)
    ref_ids, ref_w = route(xd @ router.T, spec, bias=rbias, acc_dtype=F64)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=0)
    ref = naive_experts(xd, ids, w, wg, wu, wd, clamp=1.0)
    ref = ref + shared_expert_forward(xd, sg, su, sd, gate_weight=gate, acc_dtype=F64)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)

    out_bf, _, _ = moe_layer_forward(x, router, wg, wu, wd, spec, router_bias=rbias,
                                     shared=shared, out_dtype=torch.bfloat16)
    assert out_bf.dtype == torch.bfloat16

    with pytest.raises(ValueError, match="shared"):
        moe_layer_forward(x, router, wg, wu, wd, spec, router_bias=rbias)
    with pytest.raises(ValueError, match="gate_weight"):
        moe_layer_forward(x, router, wg, wu, wd, spec, router_bias=rbias,
                          shared=dict(w_gate=sg, w_up=su, w_down=sd))
    with pytest.raises(ValueError, match="bias"):
        moe_layer_forward(x, router, wg, wu, wd, spec, shared=shared)
    no_shared = make_spec(E=E, k=k, H=H, I=I)
    with pytest.raises(ValueError, match="shared"):
        moe_layer_forward(x, router, wg, wu, wd, no_shared, shared=shared)
    out2, _, _ = moe_layer_forward(x, router, wg, wu, wd, no_shared)
    assert out2.shape == (T, H) and out2.dtype == torch.float32


def test_moe_layer_forward_backward_reaches_everything():
    gen = torch.Generator().manual_seed(13)
    T, H, I, E, k = 5, 8, 4, 4, 2
    spec = make_spec(E=E, k=k, H=H, I=I, scoring="softmax", renormalize=True, shared_count=1,
                     shared_I=4)
    x = torch.randn(T, H, generator=gen, dtype=F64, requires_grad=True)
    router = torch.randn(E, H, generator=gen, dtype=F64, requires_grad=True)
    ws = [t.requires_grad_() for t in weights(E, I, H, gen)]
    sh = [t[0].detach().requires_grad_() for t in weights(1, 4, H, gen)]
    out, _, _ = moe_layer_forward(x, router, *ws, spec,
                                  shared=dict(w_gate=sh[0], w_up=sh[1], w_down=sh[2]),
                                  acc_dtype=F64)
    out.square().sum().backward()
    for t in [x, router, *ws, *sh]:
        assert t.grad is not None and t.grad.abs().sum() > 0
