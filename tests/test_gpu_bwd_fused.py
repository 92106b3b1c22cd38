"""The fused backward (bwd_gemm.fused_backward, MOKGEN_BWD_FUSED=1) on the GPU: every gradient
with the bits of the separate launches it replaces, whatever the grouping of its order, with
skewed routing (empty experts), dropped pairs, the SwiGLU clamp and one pair per row; bitwise
repeats; clear errors for bad operands."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mokgen import bench, bwd_gemm  # noqa: E402
from mokgen.backward import experts_backward  # noqa: E402
from mokgen.errors import InputError  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc, pytest.mark.usefixtures("gpu_memory")]


def _randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)


def _problem(spec_name, T, top_k, seed, hot=3):
    spec = load_spec(spec_name)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    E, I, H = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    wg, wu = _randn(E, I, H, gen=gen, scale=H**-0.5), _randn(E, I, H, gen=gen, scale=H**-0.5)
    wd = _randn(E, H, I, gen=gen, scale=I**-0.5)
    x, g = _randn(T, H, gen=gen), _randn(T, H, gen=gen)
    ids, w = bench.skewed_routing(spec, T, gen, hot_experts=hot)
    ids, w = ids[:, :top_k].contiguous().long(), w[:, :top_k].contiguous()
    ids[5, 0] = E  # dropped pairs: sorted past offs[-1]
    ids[17, top_k - 1] = -1
    saved = _randn(T * top_k, 2 * I, gen=gen, scale=2.0)  # the save policy's g and u (any values)
    return x, ids, w, wg, wu, wd, g, saved


@pytest.mark.parametrize("spec_name, T, top_k, clamp, chunk, lag", [
    ("qwen3-30b-a3b", 611, 8, None, 16384, 1),     # one group; dh of 3 column tiles
    ("qwen3-30b-a3b", 611, 8, None, 1, 1),         # every expert its own group
    ("qwen3.5-35b-a3b", 901, 8, 7.0, 700, 2),      # groups of ~700 rows, two steps behind, clamped
    ("qwen3.5-35b-a3b", 901, 8, None, 300, 3),
    ("qwen3.5-35b-a3b", 1500, 1, None, 512, 1),    # one pair per row: dx rows are dX
], ids=["one-group", "expert-groups", "lag2-clamp", "lag3", "one-pair"])
def test_fused_backward_has_the_bits_of_the_separate_launches(monkeypatch, spec_name, T, top_k, clamp, chunk, lag):
    x, ids, w, wg, wu, wd, g, saved = _problem(spec_name, T, top_k, seed=29 + T + lag)
    launches = []  # the fused launch's calls: both sides must be what they claim to be
    fused = bwd_gemm.fused_backward
    monkeypatch.setattr(bwd_gemm, "fused_backward", lambda *a, **k: launches.append(k) or fused(*a, **k))
    monkeypatch.setenv("MOKGEN_BWD_GEMM", "1")
    monkeypatch.setenv("MOKGEN_BWD_DOUT", "gather")
    monkeypatch.setenv("MOKGEN_BWD_FUSED", "0")
    want = experts_backward(x, ids, w, wg, wu, wd, g, clamp_limit=clamp, saved_gu=saved)
    assert all(t is not None for t in want)
    assert launches == []  # the separate launches
    monkeypatch.setenv("MOKGEN_BWD_FUSED", "1")
    monkeypatch.setenv("MOKGEN_BWD_FUSED_CHUNK", str(chunk))
    monkeypatch.setenv("MOKGEN_BWD_FUSED_LAG", str(lag))
    for i in range(3):
        got = experts_backward(x, ids, w, wg, wu, wd, g, clamp_limit=clamp, saved_gu=saved)
        assert len(launches) == i + 1, "MOKGEN_BWD_FUSED=1 did not take the fused launch"
        for name, a, b in zip(("dx", "d_weights", "dW_gate", "dW_up", "dW_down"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), name
    # the default dOut mode takes the same bits (inline where a token has several pairs)
    monkeypatch.setenv("MOKGEN_BWD_FUSED", "0")
    monkeypatch.delenv("MOKGEN_BWD_DOUT")
    assert all(torch.equal(a, b) for a, b in zip(experts_backward(x, ids, w, wg, wu, wd, g, clamp_limit=clamp,
                                                                  saved_gu=saved), want))


def test_fused_backward_is_bitwise_repeatable_and_its_outputs_match_the_pieces(monkeypatch):
    """20 launches give the same bits, and the direct call's outputs are the pieces' outputs:
    rows_gemm's dh fed to swiglu_grads_saved, the dx rows GEMM, weight_grads and
    weight_grads_joint (zeros for an expert without rows, dx rows of dropped pairs zero)."""
    x, ids, w, wg, wu, wd, g, saved = _problem("qwen3.5-35b-a3b", 777, 8, seed=5, hot=2)
    E = wg.shape[0]
    ids[ids == 7] = E  # expert 7 without rows (its pairs dropped)
    order, tok, offs, wt = bwd_gemm.expert_major(ids.to(torch.int32).contiguous(), E, w.float().contiguous())
    go = g.index_select(0, tok).contiguous()
    rows = x.index_select(0, tok).contiguous()
    outs = [bwd_gemm.fused_backward(go, rows, wg, wu, wd, saved, order, wt, offs, chunk=2000, lag=1)
            for _ in range(20)]
    dx, d_wt, grads = outs[0]
    for o in outs[1:]:
        assert torch.equal(o[0], dx) and torch.equal(o[1], d_wt) and all(torch.equal(a, b) for a, b in zip(o[2], grads))
    dh = bwd_gemm.rows_gemm([(go, wd)], offs, b_major="mn", out_dtype=torch.bfloat16)
    hw, dg, du, dw_rows = bwd_gemm.swiglu_grads_saved(saved, order, dh, wt, offs, None)
    want_dx = torch.empty_like(dx)
    bwd_gemm.rows_gemm([(dg, wg), (du, wu)], offs, b_major="mn", out=want_dx, out_rows=order)
    assert torch.equal(dx, want_dx)
    assert torch.equal(d_wt, dw_rows)
    assert torch.equal(grads[2], bwd_gemm.weight_grads(go, hw, offs))
    wgr, wur = bwd_gemm.weight_grads_joint(dg, du, rows, offs)
    assert torch.equal(grads[0], wgr) and torch.equal(grads[1], wur)
    empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
    assert bool(empty[7])
    assert not grads[0][empty].any() and not grads[2][empty].any()
    n = int(offs[-1])
    assert not dx[order[n:]].any()  # the dropped pairs' rows


def test_fused_backward_bad_operands_are_clear_errors():
    bf = torch.bfloat16
    E, I, H, rows = 2, 256, 256, 64
    go = torch.zeros(rows, H, dtype=bf, device="cuda")
    wg = torch.zeros(E, I, H, dtype=bf, device="cuda")
    wd = torch.zeros(E, H, I, dtype=bf, device="cuda")
    gu = torch.zeros(rows, 2 * I, dtype=bf, device="cuda")
    order = torch.arange(rows, device="cuda")
    wt = torch.ones(rows, device="cuda")
    offs = torch.tensor([32, 64], dtype=torch.int32, device="cuda")
    with pytest.raises(InputError, match="x_rows must be"):
        bwd_gemm.fused_backward(go, go[:32], wg, wg, wd, gu, order, wt, offs)
    with pytest.raises(InputError, match="lag 1 to 8"):
        bwd_gemm.fused_backward(go, go, wg, wg, wd, gu, order, wt, offs, lag=9)
    with pytest.raises(InputError, match="order must be"):
        bwd_gemm.fused_backward(go, go, wg, wg, wd, gu, order.int(), wt, offs)
    with pytest.raises(InputError, match="multiples of 256"):
        bwd_gemm.fused_backward(go[:, :128].contiguous(), go[:, :128].contiguous(), wg[:, :, :128].contiguous(),
                                wg[:, :, :128].contiguous(), wd[:, :128].contiguous(), gu, order, wt, offs)
