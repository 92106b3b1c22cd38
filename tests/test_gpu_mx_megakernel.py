"""The megakernel's MXFP8 path (numerics: mxfp8; mx_tile.cuh in ep_forward.cuh) on the H200: rows
quantized at publish and dispatched as E4M3 codes plus scales, the up tiles' A decoded in registers,
h quantized in the up tiles' epilogue, the down tiles pushing bf16 rows to the combine.

Oracles:
- the staged MXFP8 experts (mokgen.mx_experts), which compute the same gate | up sums, the same
  h codes and the same down sums; the megakernel rounds each pushed row to bf16 and combines
  with fmaf, so the two differ by that rounding;
- the float64 MX oracle (mokgen.reference.mx_experts_forward);
- itself: every virtual rank count W and ring size gives the same bits (rows are independent and
  the combine order is fixed), and repeats give the same bits.
Under autograd a launch's gradients are the staged experts' MXFP8 backward's (mokgen.ep._MXTraining):
under the recompute policy on the staged forward's own float32 rows, under the save policy (the
default) on the rows the launch kept, which are the staged forward's rounded to bf16.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mokgen import mx_experts  # noqa: E402
from mokgen import reference as R  # noqa: E402
from mokgen.ep import virtual_ep_forward  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402

pytestmark = [pytest.mark.gpu]

SMALL = "qwen3-30b-a3b"


def _problem(spec, tokens, seed, skew=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    E, I, H = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    wg, wu = ((torch.randn(E, I, H, generator=gen, device="cuda") * H**-0.5).to(torch.bfloat16) for _ in range(2))
    wd = (torch.randn(E, H, I, generator=gen, device="cuda") * I**-0.5).to(torch.bfloat16)
    xs, ids, ws = [], [], []
    for T in tokens:
        xs.append(torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16))
        scores = torch.rand(T, E, generator=gen, device="cuda")
        if skew:
            scores[:, : E // 4] += 1.0  # the first ranks' experts take most rows
        ids.append(scores.topk(spec.top_k, dim=-1).indices.to(torch.int32))
        w = torch.rand(T, spec.top_k, generator=gen, device="cuda")
        ws.append(w / w.sum(-1, keepdim=True))
    return xs, ids, ws, (wg, wu, wd)


def _spec(name=SMALL):
    return load_spec(name).with_target(numerics="mxfp8")


@pytest.mark.parametrize("skew", [False, True])
def test_mx_megakernel_against_the_staged_experts_and_the_mx_oracle(skew):
    spec = _spec()
    xs, ids, ws, (wg, wu, wd) = _problem(spec, [700], seed=1, skew=skew)
    with torch.no_grad():
        out = virtual_ep_forward(spec, xs, ids, ws, wg, wu, wd)[0]
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    staged = mx_experts.experts_forward(xs[0], ids[0], ws[0], mx_experts.quantize_weights(wg, wu, wd))
    rel = ((out.double() - staged.double()).norm() / staged.double().norm()).item()
    assert rel < 6e-3, f"against the staged MXFP8 experts: {rel:.2e}"  # the pushed rows' bf16 rounding
    oracle = R.mx_experts_forward(xs[0], ids[0], ws[0], wg, wu, wd, acc_dtype=torch.float64)
    rel = ((out.double() - oracle).norm() / oracle.norm()).item()
    assert rel < 1e-2, f"against the float64 MX oracle: {rel:.2e}"


def test_mx_megakernel_gives_the_same_bits_for_every_w_and_ring():
    """W = 2, 4 and 8 virtual ranks (one without tokens, skewed routing, a ring of 3 x 256 rows)
    against each rank's tokens run alone on one rank holding every expert (the default ring), and
    20 repeats of the W = 4 launch."""
    spec = _spec()
    for sizes, seed in (([900, 0], 12), ([600, 0, 300, 900], 2), ([300, 0, 200, 150, 0, 400, 100, 250], 13)):
        W = len(sizes)
        xs, ids, ws, weights = _problem(spec, sizes, seed=seed, skew=True)
        with torch.no_grad():
            many = virtual_ep_forward(spec, xs, ids, ws, *weights, chunk_rows=256, ring_chunks=3)
            for r in range(W):
                alone = virtual_ep_forward(spec, [xs[r]], [ids[r]], [ws[r]], *weights)[0]
                assert torch.equal(many[r], alone), f"W = {W}, rank {r}"
            for _ in range(19 if W == 4 else 0):
                again = virtual_ep_forward(spec, xs, ids, ws, *weights, chunk_rows=256, ring_chunks=3)
                assert all(torch.equal(a, b) for a, b in zip(many, again))


def _runs_over_cases_and_rings(spec, cases, weights, rings):
    """(W, chunk rows, ring chunks) -> the launch's outputs, every rank's concatenated, for each
    case W -> (xs, ids, ws) and each ring, under the current build."""
    out = {}
    for w, (xs, ids, ws) in cases.items():
        for chunk, ring in rings:
            with torch.no_grad():
                out[w, chunk, ring] = torch.cat(
                    virtual_ep_forward(spec, xs, ids, ws, *weights, chunk_rows=chunk, ring_chunks=ring))
    return out


@pytest.mark.nvcc  # builds the pairs' variant: needs the compiler even where prebuilt wheels serve the defaults
@pytest.mark.parametrize("inter", [768, 640])
def test_mx_cta_pairs_give_the_single_ctas_bits(monkeypatch, inter):
    """MOKGEN_CLUSTER=2 on an MXFP8 build (mx_tile.cuh's CTA pairs, v0.55): each pair-tile's
    shared operand is multicast, B for row blocks m and m + 1, A's codes and scales for column
    tiles n and n + 1 of a segment's odd last block. The tiles' sums are the single CTAs', so the
    bits must be too: W = 1 and W = 4 (one rank without tokens, skewed routing), several rings.
    I = 640 gives 5 up column tiles, so a pair-tile of an odd last block has no n + 1 and its
    second CTA runs a tile of zero rows beside the multicasts."""
    from mokgen.load import load
    from mokgen.spec import spec_from_dict

    d = load_spec(SMALL).canonical_dict()
    d.update(name=f"mx-pairs-i{inter}", aliases=[], moe_intermediate_size=inter)
    spec = spec_from_dict(d).with_target(numerics="mxfp8")
    weights = _problem(spec, [1], seed=3)[3]
    cases = {1: _problem(spec, [1500], seed=4, skew=True)[:3],
             4: _problem(spec, [900, 0, 433, 1201], seed=5, skew=True)[:3]}
    runs = {}
    monkeypatch.setenv("MOKGEN_MX_FORM", "codes")  # MxTile's pairs: a cluster alone would take the expanded form (v0.58)
    for cluster in ("1", "2"):
        monkeypatch.setenv("MOKGEN_CLUSTER", cluster)
        assert int(load(spec).LIB.mokgen_ep_cluster()) == int(cluster) and load(spec).MX_FORM == "codes"
        for key, out in _runs_over_cases_and_rings(spec, cases, weights, ((256, 2), (1024, 3))).items():
            runs[(cluster, *key)] = out
    for (cluster, w, chunk, ring), out in runs.items():
        assert torch.isfinite(out).all()
        assert torch.equal(out, runs["1", w, 256, 2]), f"cluster {cluster}, W = {w}, ring {ring} x {chunk}: bits differ"


@pytest.mark.nvcc  # builds the expanded form's variants
@pytest.mark.parametrize("cluster", ["1", "2"])
def test_the_expanded_mx_build_gives_the_codes_builds_bits(monkeypatch, cluster):
    """Plan mx_form "expand" (MOKGEN_MX_FORM; v0.57, ep_forward.cuh CfgMxExpand): the pull writes
    the rows' bf16 MX values into the ring, the up tiles store h as its MX values in bf16, and the
    bf16 HopperTiles multiply them: the same values in the same k slots as MxTile's decoded
    fragments, so the codes form's bits. W = 1 and W = 4 (one rank without tokens, skewed
    routing), two rings, single CTAs and pairs (the codes form's pairs give its single CTAs' bits,
    test_mx_cta_pairs_give_the_single_ctas_bits)."""
    from mokgen.load import load

    spec = _spec()
    weights = _problem(spec, [1], seed=6)[3]
    cases = {1: _problem(spec, [1100], seed=7, skew=True)[:3],
             4: _problem(spec, [500, 0, 257, 1033], seed=8, skew=True)[:3]}
    monkeypatch.setenv("MOKGEN_CLUSTER", cluster)
    runs = {}
    for form in ("codes", "expand"):
        monkeypatch.setenv("MOKGEN_MX_FORM", form)
        assert int(load(spec).LIB.mokgen_ep_cluster()) == int(cluster) and load(spec).MX_FORM == form
        for key, out in _runs_over_cases_and_rings(spec, cases, weights, ((256, 3), (2048, 2))).items():
            runs[(form, *key)] = out
    for (form, w, chunk, ring), out in runs.items():
        assert torch.isfinite(out).all()
        assert torch.equal(out, runs["codes", w, chunk, ring]), f"{form}, W = {w}, ring {ring} x {chunk}: bits differ"


def _with_special_blocks(weights):
    """The weights with 32-blocks that take MxQuantB's exact path (mx_round.cuh exact_half): a zero
    block, one below E8M0's fast range (exponent fields under 24) and one whose amax saturates at
    448 2^s, in each of the three (the conversion writes the same values for them)."""
    out = [w.clone() for w in weights]
    for i, w in enumerate(out):
        w[0, 1, 32:64] = 0
        w[0, 2, :32] = w[0, 2, :32].float().mul(2.0**-112).to(torch.bfloat16)
        w[-1, 3, 64:96] = torch.linspace(-1.0, 1.9375, 32, device=w.device).to(torch.bfloat16) * (i + 1)
    return out


@pytest.mark.nvcc  # builds the raw weights' variants
@pytest.mark.parametrize("cluster", ["1", "2"])
def test_the_weights_raw_build_gives_the_values_builds_bits(monkeypatch, cluster):
    """Plan mx_fwd_weights "raw" (MOKGEN_MX_FWD_WEIGHTS; v0.68, mx_tile.cuh MxQuantB): the launch
    takes the bf16 weights and the tiles' consumers make each stage's B the MX values that the
    values build reads from the conversion, in the same k slots, so the expanded values build's
    bits: W = 1 and W = 4 (one rank without tokens, skewed routing), two rings, single CTAs and
    pairs, weights with blocks on the quantizer's exact path; and the raw launches convert nothing."""
    from mokgen import ep, mx_gemm
    from mokgen.load import load

    spec = _spec()
    weights = _with_special_blocks(_problem(spec, [1], seed=15)[3])
    cases = {1: _problem(spec, [1100], seed=16, skew=True)[:3],
             4: _problem(spec, [500, 0, 257, 1033], seed=17, skew=True)[:3]}
    monkeypatch.setenv("MOKGEN_CLUSTER", cluster)
    monkeypatch.setenv("MOKGEN_MX_FORM", "expand")
    calls = []
    real = mx_gemm.expert_weights
    monkeypatch.setattr(mx_gemm, "expert_weights", lambda *a, **k: calls.append(1) or real(*a, **k))
    runs = {}
    for kind in ("values", "raw"):
        monkeypatch.setenv("MOKGEN_MX_FWD_WEIGHTS", kind)
        ep.refresh_mx_weights()
        kernel = load(spec)
        assert kernel.MX_FWD_WEIGHTS == kind and kernel.MX_FORM == "expand"
        assert int(kernel.LIB.mokgen_ep_cluster()) == int(cluster)
        before = len(calls)
        for key, out in _runs_over_cases_and_rings(spec, cases, weights, ((256, 3), (2048, 2))).items():
            runs[(kind, *key)] = out
        assert (len(calls) > before) == (kind == "values"), kind
    for (kind, w, chunk, ring), out in runs.items():
        assert torch.isfinite(out).all()
        assert torch.equal(out, runs["values", w, chunk, ring]), f"{kind}, W = {w}, ring {ring} x {chunk}: bits differ"


def _layers_by_weights(monkeypatch, spec, weights, kinds):
    """kind -> a MoELayer made under MOKGEN_MX_FWD_WEIGHTS=kind, holding ``weights``."""
    from mokgen.ep import MoELayer

    layers = {}
    for kind in kinds:
        monkeypatch.setenv("MOKGEN_MX_FWD_WEIGHTS", kind)
        layers[kind] = MoELayer(spec, max_tokens=512, device="cuda")
        with torch.no_grad():
            for p, v in zip((layers[kind].w_gate, layers[kind].w_up, layers[kind].w_down), weights):
                p.copy_(v)
    return layers


def _conversions_along_k(monkeypatch) -> list:
    """A list that gains an entry at each conversion of a weight along k (the forward's values,
    mx_gemm.expert_weights without transpose; the backward's transposed ones are not counted)."""
    from mokgen import mx_gemm

    along_k = []
    real = mx_gemm.expert_weights

    def counted(parts, **kw):
        if not kw.get("transpose"):
            along_k.append(1)
        return real(parts, **kw)

    monkeypatch.setattr(mx_gemm, "expert_weights", counted)
    return along_k


def test_an_mx_moelayer_with_the_weights_raw_trains_as_the_values_build_and_follows_updates(monkeypatch):
    """MoELayer on an MXFP8 spec with MOKGEN_MX_FWD_WEIGHTS=raw against one with values (the same
    weights, the save policy): the same outputs and gradients bit for bit, three steps, each after
    an in-place update of every weight (an optimizer step; the values layer converts again by the
    tensors' versions, the raw one reads them as they are), and the raw layer's forward converts
    no weight along k."""
    spec = _spec()
    xs, ids, ws, weights = _problem(spec, [384], seed=18, skew=True)
    weights = _with_special_blocks(weights)
    d_out = torch.randn(xs[0].shape, generator=torch.Generator(device="cuda").manual_seed(19),
                        device="cuda").to(torch.bfloat16)
    layers = _layers_by_weights(monkeypatch, spec, weights, ("values", "raw"))
    assert layers["raw"]._kernel.MX_FWD_WEIGHTS == "raw" and layers["values"]._kernel.MX_FWD_WEIGHTS == "values"
    along_k = _conversions_along_k(monkeypatch)
    for step in range(3):
        got = {}
        for kind, layer in layers.items():
            x, w = xs[0].clone().requires_grad_(True), ws[0].clone().requires_grad_(True)
            layer.zero_grad(set_to_none=True)
            before = len(along_k)
            out = layer(x, ids[0], w)
            assert (len(along_k) > before) == (kind == "values"), (step, kind)
            out.backward(d_out)
            got[kind] = [out, x.grad, w.grad, layer.w_gate.grad, layer.w_up.grad, layer.w_down.grad]
        for name, a, b in zip(("out", "x", "topk_weights", "w_gate", "w_up", "w_down"), got["raw"], got["values"]):
            assert torch.isfinite(a).all() and torch.equal(a, b), (step, name)
        with torch.no_grad():  # the same update of both layers' weights, in place
            for layer in layers.values():
                for p in (layer.w_gate, layer.w_up, layer.w_down):
                    p.sub_(p.grad * 0.5)


@pytest.mark.nvcc  # builds the raw twin
def test_an_auto_weights_moelayer_trains_on_its_raw_twin_and_infers_on_its_values_build(monkeypatch):
    """MOKGEN_MX_FWD_WEIGHTS=auto (v0.68, mokgen.ep._raw_twin / _launch_kernel): a one-GPU MoELayer
    of the expanded form holds the raw build beside its values build on the same buffers; a
    training call with few rows an expert (here 24) launches the raw one (no conversion along k), a
    second training call at the same weights' version and an inference call the values one (the
    weights converted), and all give a values layer's bits (outputs and gradients). The twin is
    loaded by the first launch that takes it (v0.69)."""
    from mokgen import ep

    spec = _spec()
    monkeypatch.setenv("MOKGEN_MX_FORM", "expand")
    xs, ids, ws, weights = _problem(spec, [384], seed=20, skew=True)
    d_out = torch.randn(xs[0].shape, generator=torch.Generator(device="cuda").manual_seed(21),
                        device="cuda").to(torch.bfloat16)
    layers = _layers_by_weights(monkeypatch, spec, weights, ("values", "auto"))
    auto = layers["auto"]
    assert layers["values"]._kernel_raw is None and auto._kernel.MX_FWD_WEIGHTS == "values"
    assert auto._kernel_raw is ep.RAW_TWIN_PENDING  # loaded by the first launch that takes it
    along_k = _conversions_along_k(monkeypatch)
    got = {}
    for kind, layer in layers.items():
        x, w = xs[0].clone().requires_grad_(True), ws[0].clone().requires_grad_(True)
        before = len(along_k)
        out = layer(x, ids[0], w)
        assert (len(along_k) > before) == (kind == "values"), kind  # the raw twin converts nothing
        out.backward(d_out)
        got[kind] = [out, x.grad, w.grad, layer.w_gate.grad, layer.w_up.grad, layer.w_down.grad]
    assert auto._kernel_raw.MX_FWD_WEIGHTS == "raw"
    for name, a, b in zip(("out", "x", "topk_weights", "w_gate", "w_up", "w_down"), got["auto"], got["values"]):
        assert torch.equal(a, b), name
    # a second training launch at the same weights' version (a micro-batch): the values build, which
    # converts them once for the rest (ep._raw_pays), with the same bits
    before = len(along_k)
    again = auto(xs[0].clone().requires_grad_(True), ids[0], ws[0].clone().requires_grad_(True))
    assert len(along_k) == before + 3 and torch.equal(again, got["values"][0])
    with torch.no_grad():
        auto.w_down.mul_(2.0)  # exact in bf16 and in MX: the output doubles exactly
        before = len(along_k)
        inferred = auto(xs[0], ids[0], ws[0])
        assert len(along_k) == before + 1  # inference: the values build, converting w_down (gate and up cached)
        assert torch.equal(inferred, got["values"][0].detach() * 2)


def _staged_grads(spec, xs, ids, ws, weights, d_outs):
    """experts_forward_train's gradients (x, topk_weights, w_gate, w_up, w_down) on the ranks'
    tokens concatenated in rank order: what an MXFP8 launch's backward returns."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (torch.cat(xs), torch.cat(ws), *weights)]
    out = mx_experts.experts_forward_train(leaves[0], torch.cat(ids), *leaves[1:], spec.activation.clamp_limit)
    out.backward(torch.cat(d_outs))
    return [t.grad for t in leaves]


def test_mx_moelayer_trains_with_the_staged_experts_gradients_the_same_bits_20_times():
    """MoELayer on an MXFP8 spec under autograd, the recompute policy: the forward is the launch's
    bits under no_grad, the gradients (tokens, routing weights, the layer's three weights) are
    experts_forward_train's bit for bit, and 20 repeats give the same bits."""
    from mokgen.ep import MoELayer

    spec = _spec()
    xs, ids, ws, weights = _problem(spec, [384], seed=9, skew=True)
    d_out = torch.randn(xs[0].shape, generator=torch.Generator(device="cuda").manual_seed(10),
                        device="cuda").to(torch.bfloat16)
    layer = MoELayer(spec, max_tokens=512, device="cuda", bwd_policy="recompute")
    with torch.no_grad():
        for p, v in zip((layer.w_gate, layer.w_up, layer.w_down), weights):
            p.copy_(v)
        want_out = layer(xs[0], ids[0], ws[0])
    want = _staged_grads(spec, xs, ids, ws, weights, [d_out])
    first = None
    for _ in range(20):
        x, w = xs[0].clone().requires_grad_(True), ws[0].clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        out = layer(x, ids[0], w)
        assert torch.equal(out, want_out)
        out.backward(d_out)
        got = [x.grad, w.grad, layer.w_gate.grad, layer.w_up.grad, layer.w_down.grad]
        for name, g, v in zip(("x", "topk_weights", "w_gate", "w_up", "w_down"), got, want):
            assert g.dtype == v.dtype and torch.equal(g, v), name
        if first is None:
            first = got
        assert all(torch.equal(a, b) for a, b in zip(got, first))


def test_virtual_mx_launch_trains_like_the_staged_experts_on_every_ranks_tokens():
    """virtual_ep_forward with W = 4 MXFP8 ranks (one without tokens, skewed routing) under
    autograd, the recompute policy: each rank's output is the no_grad launch's, and the gradients
    are experts_forward_train's on the ranks' tokens in rank order, bit for bit; a rank's unused
    output counts as a zero gradient."""
    spec = _spec()
    xs, ids, ws, weights = _problem(spec, [300, 0, 200, 250], seed=11, skew=True)
    gen = torch.Generator(device="cuda").manual_seed(12)
    d_outs = [torch.randn(x.shape, generator=gen, device="cuda").to(torch.bfloat16) for x in xs]
    d_outs[3].zero_()  # rank 3's output is left out of the backward below
    with torch.no_grad():
        want_outs = virtual_ep_forward(spec, xs, ids, ws, *weights, chunk_rows=256, ring_chunks=3)
    want = _staged_grads(spec, xs, ids, ws, weights, d_outs)
    lx = [x.clone().requires_grad_(True) for x in xs]
    lw = [w.clone().requires_grad_(True) for w in ws]
    lweights = [t.clone().requires_grad_(True) for t in weights]
    outs = virtual_ep_forward(spec, lx, ids, lw, *lweights, chunk_rows=256, ring_chunks=3, bwd_policy="recompute")
    assert all(torch.equal(o, v) for o, v in zip(outs, want_outs))
    torch.autograd.backward(outs[:3], d_outs[:3])
    assert torch.equal(torch.cat([t.grad for t in lx]), want[0])
    assert torch.equal(torch.cat([t.grad for t in lw]), want[1])
    for name, g, v in zip(("w_gate", "w_up", "w_down"), lweights, want[2:]):
        assert torch.equal(g.grad, v), name


def _saved_rows_grads(spec, xs, ids, ws, weights, d_outs):
    """The staged MXFP8 backward (mx_experts._backward) on the staged forward's gate | up and
    expert output rows rounded to bf16, in the padded layout as float32: what the save policy's
    backward must give, the megakernel's tiles computing the staged GEMMs' sums bit for bit. The
    ranks' tokens concatenated in rank order."""
    x, idc, w = torch.cat(xs), torch.cat(ids), torch.cat(ws)
    q = mx_experts.quantize_weights(*weights, interleave=False)
    clamp = spec.activation.clamp_limit
    _, saved = mx_experts._forward(x, idc, w, q, clamp, "bf16", keep_gu=True)
    rows = saved.gu.shape[0]
    padded = [mx_experts._padded_rows(t[saved.row].to(torch.bfloat16), saved.row, rows) for t in (saved.gu, saved.y)]
    return list(mx_experts._backward(torch.cat(d_outs), x, w, *weights, saved.row, saved.tiles, saved.padded,
                                     *padded, clamp, "bf16"))


def test_mx_moelayer_under_the_save_policy_runs_no_forward_again_and_repeats_its_bits(monkeypatch):
    """MoELayer on an MXFP8 spec under autograd, the save policy (the default): the forward is the
    launch's bits under no_grad; the backward runs no staged forward; its gradients are the
    staged backward's on the staged forward's rows rounded to bf16, bit for bit (so the launch
    kept exactly those rows: its saved gate | up rows and its combine slots); 20 repeats give
    the same bits; and they stay near the recompute policy's (the rows' bf16 rounding)."""
    from mokgen.ep import MoELayer

    spec = _spec()
    xs, ids, ws, weights = _problem(spec, [384], seed=9, skew=True)
    d_out = torch.randn(xs[0].shape, generator=torch.Generator(device="cuda").manual_seed(10),
                        device="cuda").to(torch.bfloat16)
    layer = MoELayer(spec, max_tokens=512, device="cuda")
    assert layer.bwd_policy == "save"
    with torch.no_grad():
        for p, v in zip((layer.w_gate, layer.w_up, layer.w_down), weights):
            p.copy_(v)
        want_out = layer(xs[0], ids[0], ws[0])
    want = _saved_rows_grads(spec, xs, ids, ws, weights, [d_out])
    recomputed = _staged_grads(spec, xs, ids, ws, weights, [d_out])
    forwards = []
    real_forward = mx_experts._forward
    monkeypatch.setattr(mx_experts, "_forward", lambda *a, **kw: forwards.append(1) or real_forward(*a, **kw))
    first = None
    for _ in range(20):
        x, w = xs[0].clone().requires_grad_(True), ws[0].clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        out = layer(x, ids[0], w)
        assert torch.equal(out, want_out)
        out.backward(d_out)
        got = [x.grad, w.grad, layer.w_gate.grad, layer.w_up.grad, layer.w_down.grad]
        for name, g, v in zip(("x", "topk_weights", "w_gate", "w_up", "w_down"), got, want):
            assert g.dtype == v.dtype and torch.equal(g, v), name
        if first is None:
            first = got
        assert all(torch.equal(a, b) for a, b in zip(got, first))
    assert forwards == []
    for name, g, v in zip(("x", "topk_weights", "w_gate", "w_up", "w_down"), first, recomputed):
        rel = ((g.double() - v.double()).norm() / v.double().norm()).item()
        assert rel < 5e-2, (name, rel)


@pytest.mark.nvcc  # builds the forms' and the pairs' variants
@pytest.mark.parametrize("form, cluster", [("codes", "1"), ("codes", "2"), ("expand", "1"), ("expand", "2")])
def test_virtual_mx_launches_save_the_same_rows_for_every_w(monkeypatch, form, cluster):
    """virtual_ep_forward under autograd, the save policy: W = 1, 2 and 4 ranks (one rank without
    tokens, skewed routing, a short ring) give the same gradients bit for bit, those of the
    staged backward on the staged forward's rows rounded to bf16: each rank's saved rows and
    combine slots land where its backward reads them. Both MXFP8 forms (MxTile's epilogue saves
    in the codes form, HopperTile's in the expanded one), single CTAs and pairs."""
    from mokgen.load import load

    monkeypatch.setenv("MOKGEN_MX_FORM", form)
    monkeypatch.setenv("MOKGEN_CLUSTER", cluster)
    spec = _spec()
    assert load(spec).MX_FORM == form and int(load(spec).LIB.mokgen_ep_cluster()) == int(cluster)
    sizes = [300, 0, 200, 250]
    xs, ids, ws, weights = _problem(spec, sizes, seed=13, skew=True)
    gen = torch.Generator(device="cuda").manual_seed(14)
    d_outs = [torch.randn(x.shape, generator=gen, device="cuda").to(torch.bfloat16) for x in xs]
    want = _saved_rows_grads(spec, xs, ids, ws, weights, d_outs)
    x, idc, w, d_out = torch.cat(xs), torch.cat(ids), torch.cat(ws), torch.cat(d_outs)
    for W in (1, 2, 4):
        split = [sum(sizes)] if W == 1 else [sum(sizes[:2]), sum(sizes[2:])] if W == 2 else sizes
        lx = [t.clone().requires_grad_(True) for t in x.split(split)]
        lw = [t.clone().requires_grad_(True) for t in w.split(split)]
        lweights = [t.clone().requires_grad_(True) for t in weights]
        outs = virtual_ep_forward(spec, lx, list(idc.split(split)), lw, *lweights, chunk_rows=128, ring_chunks=3)
        torch.autograd.backward(outs, list(d_out.split(split)))
        got = [torch.cat([t.grad for t in lx]), torch.cat([t.grad for t in lw]), *(t.grad for t in lweights)]
        for name, g, v in zip(("x", "topk_weights", "w_gate", "w_up", "w_down"), got, want):
            assert torch.equal(g, v), (W, name)


@pytest.mark.parametrize("policy", ["save", "recompute"])
def test_mx_moelayer_under_both_conversions_gives_aparts_bits_and_converts_once(monkeypatch, policy):
    """MOKGEN_MX_WEIGHTS=both on the MXFP8 layer (v0.65): a training forward converts each weight
    once for both orientations (mx_gemm.expert_weights_both), the backward converts none, and the
    gradients are apart's bit for bit; a second step on the same weights (a micro-batch) converts
    nothing at all; after an optimizer-like in-place update both are made again."""
    from mokgen import ep, mx_gemm
    from mokgen.ep import MoELayer

    spec = _spec()
    xs, ids, ws, weights = _problem(spec, [384], seed=21, skew=True)
    d_out = torch.randn(xs[0].shape, generator=torch.Generator(device="cuda").manual_seed(22),
                        device="cuda").to(torch.bfloat16)
    layer = MoELayer(spec, max_tokens=512, device="cuda", bwd_policy=policy)
    with torch.no_grad():
        for p, v in zip((layer.w_gate, layer.w_up, layer.w_down), weights):
            p.copy_(v)
    calls = []
    for name in ("expert_weights", "expert_weights_both"):
        real = getattr(mx_gemm, name)
        monkeypatch.setattr(mx_gemm, name, lambda *a, _n=name, _r=real, **kw: calls.append(_n) or _r(*a, **kw))

    def step(mode):
        monkeypatch.setenv("MOKGEN_MX_WEIGHTS", mode)
        x, w = xs[0].clone().requires_grad_(True), ws[0].clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        layer(x, ids[0], w).backward(d_out)
        torch.cuda.synchronize()
        return [x.grad, w.grad, layer.w_gate.grad, layer.w_up.grad, layer.w_down.grad]

    try:
        ep.refresh_mx_weights()
        want = step("apart")
        assert calls.count("expert_weights") == 5 and "expert_weights_both" not in calls  # 3 forward, 2 backward
        ep.refresh_mx_weights()
        calls.clear()
        got = step("both")
        assert calls == ["expert_weights_both"] * 2  # w_down; w_gate with w_up; the backward none
        for name, g, v in zip(("x", "topk_weights", "w_gate", "w_up", "w_down"), got, want):
            assert g.dtype == v.dtype and torch.equal(g, v), name
        calls.clear()
        again = step("both")  # the same weights: nothing converted
        assert calls == [] and all(torch.equal(a, b) for a, b in zip(again, want))
        with torch.no_grad():
            layer.w_up.mul_(1.0)  # a new version
        step("both")
        assert calls == ["expert_weights_both"] * 2
    finally:
        ep.refresh_mx_weights()


@pytest.mark.parametrize("skew", [False, True])
def test_mx_weight_gradients_on_the_bf16_weight_kernels_match_the_ranged_ones(monkeypatch, skew):
    """MOKGEN_MX_WGRAD=bf16 (v0.65): the MXFP8 layer's weight gradients on the BF16 backward's
    weight kernels over the operands' MX values (each expert's rows padded to 32) against the
    k-ranged bf16-math GEMM's: the same products in another order, so within a few bf16
    roundings (relative 2e-3), zeros for experts without rows, and the same bits over repeats;
    x's and the routing weights' gradients do not depend on it (the same bits). The operands'
    values made by the fused stages (MOKGEN_MX_WGRAD_OPERANDS=fused, v0.66) or apart: the same bits."""
    from mokgen.ep import MoELayer

    spec = _spec()
    xs, ids, ws, weights = _problem(spec, [448], seed=31, skew=skew)
    d_out = torch.randn(xs[0].shape, generator=torch.Generator(device="cuda").manual_seed(32),
                        device="cuda").to(torch.bfloat16)
    layer = MoELayer(spec, max_tokens=512, device="cuda")
    with torch.no_grad():
        for p, v in zip((layer.w_gate, layer.w_up, layer.w_down), weights):
            p.copy_(v)

    def step(mode):
        monkeypatch.setenv("MOKGEN_MX_WGRAD", mode)
        x, w = xs[0].clone().requires_grad_(True), ws[0].clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        layer(x, ids[0], w).backward(d_out)
        return [x.grad, w.grad, layer.w_gate.grad, layer.w_up.grad, layer.w_down.grad]

    want = step("ranged")
    got = step("bf16")
    for name, g, v in zip(("x", "topk_weights"), got[:2], want[:2]):
        assert torch.equal(g, v), name
    for name, g, v in zip(("w_gate", "w_up", "w_down"), got[2:], want[2:]):
        assert g.dtype == v.dtype == torch.bfloat16 and g.shape == v.shape, name
        rel = ((g.double() - v.double()).norm() / v.double().norm()).item()
        assert rel < 2e-3, (name, rel)
        idle = torch.bincount(ids[0].reshape(-1).long(), minlength=spec.num_experts) == 0
        assert not g[idle].any(), name  # an expert without rows: zeros (its 32-row padding takes none)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(step("bf16"), got))
    # v0.66: the operands' values from the fused stages (the default since v0.68) or by rows_values
    # from their float32 rows (apart): the same bits
    monkeypatch.setenv("MOKGEN_MX_WGRAD_OPERANDS", "apart")
    apart = step("bf16")
    monkeypatch.delenv("MOKGEN_MX_WGRAD_OPERANDS")
    for name, a, b in zip(("x", "topk_weights", "w_gate", "w_up", "w_down"), apart, got):
        assert torch.equal(a, b), name


def test_mx_moelayer_is_the_virtual_launchs_bits_and_converts_its_weights_once_per_version():
    """MoELayer on an MXFP8 spec (one rank, every expert) under no_grad: the same bits as
    virtual_ep_forward on the same weights; the weights' MX values are converted again after an
    in-place update (the tensor's version), and the output follows."""
    from mokgen.ep import MoELayer

    spec = _spec()
    xs, ids, ws, (wg, wu, wd) = _problem(spec, [500], seed=4)
    layer = MoELayer(spec, max_tokens=512, device="cuda")
    with torch.no_grad():
        layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
        first = layer(xs[0], ids[0], ws[0])
        assert torch.equal(first, virtual_ep_forward(spec, xs, ids, ws, wg, wu, wd)[0])
        layer.w_down.mul_(2.0)  # exact in bf16 and in MX (scales move by one)
        second = layer(xs[0], ids[0], ws[0])
    # the MX values of w_down double exactly (codes kept, scales + 1), so y, its bf16 rounding and
    # the combine's fused multiply-adds all double exactly
    assert torch.equal(second, first * 2)


def test_new_weights_at_a_freed_weights_address_are_converted_anew():
    """The MX weight conversions are per tensor object: new weights that the caching allocator
    places at freed weights' address (version 0 like theirs) are converted again, not served the
    old conversion (v0.36 review: keyed by address, they were)."""
    spec = _spec()
    xs, ids, ws, (wg, wu, wd) = _problem(spec, [300], seed=6)
    with torch.no_grad():
        first = virtual_ep_forward(spec, xs, ids, ws, wg, wu, wd)[0]
        shape, ptr = wd.shape, wd.data_ptr()
        del wd
        wd2 = (torch.randn(shape, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda")
               * spec.moe_intermediate_size**-0.5).to(torch.bfloat16)
        second = virtual_ep_forward(spec, xs, ids, ws, wg, wu, wd2)[0]
        fresh = virtual_ep_forward(spec, xs, ids, ws, wg, wu, wd2.clone())[0]  # another object: converted
    assert torch.equal(second, fresh)
    assert not torch.equal(second, first)
    print(f"(the new weights {'took' if wd2.data_ptr() == ptr else 'did not take'} the freed address)")


def test_mx_moelayer_under_torch_compile_gives_the_eager_bits():
    """torch.compile of an MXFP8 MoELayer (no_grad): the weights' conversion runs eagerly at a graph
    break (its cache keys on the tensors and their versions), the op in the graph; the same bits
    as eager, and an in-place weight update is seen by the compiled layer."""
    from mokgen.ep import MoELayer

    spec = _spec()
    xs, ids, ws, (wg, wu, wd) = _problem(spec, [400], seed=8)
    layer = MoELayer(spec, max_tokens=512, device="cuda")
    compiled = torch.compile(layer)
    with torch.no_grad():
        layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
        eager = layer(xs[0], ids[0], ws[0])
        assert torch.equal(compiled(xs[0], ids[0], ws[0]), eager)
        layer.w_down.mul_(2.0)
        assert torch.equal(compiled(xs[0], ids[0], ws[0]), eager * 2)


def test_the_virtual_bench_counts_the_same_rows_in_both_numerics():
    """Issue 6's bytes between ranks per token on one GPU (mokgen.bench.bench_virtual, numerics
    mxfp8, W = 8): the BF16 and MXFP8 megakernels pull the same rows from other ranks for the same
    routing (the kernels' own count), so their bytes per token differ by the row sizes alone,
    (H + H / 32) / 2 H."""
    from mokgen import bench
    from mokgen.plan import row_bytes

    spec = load_spec(SMALL)
    rows = bench.bench_virtual(spec, 64, 8, iters=3, numerics="mxfp8")
    counted = {r.impl: r.bytes_per_token for r in rows if r.bytes_per_token is not None}
    bf16 = counted["mokgen megakernel (W=8 virtual)"]
    mx = counted["mokgen megakernel MXFP8 (W=8 virtual)"]
    H = spec.hidden_size
    assert bf16 > 0
    assert mx / bf16 == pytest.approx(row_bytes(H, "mxfp8") / row_bytes(H, "bf16"), rel=1e-12)
    print(f"(bytes between ranks per token: bf16 {bf16:.0f}, mxfp8 {mx:.0f})")


def test_the_fwd_bwd_bench_times_the_mxfp8_rows():
    """mokgen bench --backward --numerics mxfp8's rows (bench_layer_backward) on a small local
    workload: the MXFP8 layer under autograd and the staged experts, beside the BF16 rows."""
    from mokgen import bench

    local, rows = bench.local_spec(load_spec(SMALL), 8, tokens_per_gpu=64)
    got = {r.impl: r for r in bench.bench_layer_backward(local, rows, iters=2, n_inputs=1, numerics="mxfp8")}
    for name in (bench.MX_MEGA_BWD_ROW, bench.MX_BWD_ROW, "torch._grouped_mm autograd"):
        assert name in got and got[name].ms > 0 and got[name].peak_gib is not None, name
