"""The MXFP8 routed experts (mokgen/mx_experts.py) on the H200: the grouped FP8 GEMM against the
dense one, the layer against the float64 MX oracle (mokgen.reference.mx_experts_forward) and the
float64 layer, and the same bits over 20 repeats."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mokgen import mx, mx_experts, mx_gemm  # noqa: E402
from mokgen import reference as R  # noqa: E402

pytestmark = [pytest.mark.gpu]


def _problem(T, H, I, E, k, seed, skew=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    scores = torch.rand(T, E, generator=gen, device="cuda")
    if skew:  # expert 0 takes most rows, the last expert none
        scores[:, 0] += 0.7
        scores[:, E - 1] = -1.0
    ids = scores.topk(k, dim=-1).indices.to(torch.int32)
    w = torch.rand(T, k, generator=gen, device="cuda")
    w = w / w.sum(-1, keepdim=True)
    wg, wu = ((torch.randn(E, I, H, generator=gen, device="cuda") * H**-0.5).to(torch.bfloat16) for _ in range(2))
    wd = (torch.randn(E, H, I, generator=gen, device="cuda") * I**-0.5).to(torch.bfloat16)
    return x, ids, w, wg, wu, wd


@pytest.mark.parametrize("form", sorted(mx_gemm.FORMS))
def test_grouped_gemm_equals_the_dense_gemm_per_expert(form):
    gen = torch.Generator(device="cuda").manual_seed(1)
    E, N, K = 3, 256, 384
    padded = [256, 0, 128]
    a, sa = mx.quantize(torch.randn(sum(padded), K, generator=gen, device="cuda").to(torch.bfloat16), dim=-1)
    b, sb = mx.quantize((torch.randn(E, N, K, generator=gen, device="cuda") * K**-0.5).to(torch.bfloat16), dim=-1)
    tiles, _ = mx_gemm.row_tiles(padded, "cuda")
    got = mx_gemm.mx_grouped_gemm(a, mx_gemm.block_scales(sa), b, mx_gemm.block_expert_scales(sb), tiles, form=form)
    start = 0
    for e, rows in enumerate(padded):
        if rows:
            want = mx_gemm.mx_gemm(a[start:start + rows].contiguous(), sa[start:start + rows].contiguous(), b[e],
                                   sb[e], form=form)
            assert torch.equal(got[start:start + rows], want), e
        start += rows


def test_quantize_rows_is_the_quantizer_of_the_gathered_rows():
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(50, 384, generator=gen, device="cuda") *
         torch.exp2(torch.randint(-30, 30, (50, 1), generator=gen, device="cuda").float())).to(torch.bfloat16)
    x[3, 40] = float("nan")
    src = torch.tensor([5, -1, 3, 49, 0, -1, 5], dtype=torch.int32, device="cuda")
    codes, scales = mx_gemm.quantize_rows(x, src, 7)
    rows = torch.where((src >= 0)[:, None], x[src.clamp(min=0).long()], torch.zeros_like(x[:7]))
    want_codes, want_scales = mx.quantize(rows, dim=-1)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, mx_gemm.block_scales(want_scales))


def test_combine_has_the_bits_of_the_pytorch_expression():
    gen = torch.Generator(device="cuda").manual_seed(6)
    T, k, H = 70, 3, 256
    y = torch.randn(400, H, generator=gen, device="cuda")
    row = torch.randperm(400, generator=gen, device="cuda")[:T * k]
    w = torch.rand(T, k, generator=gen, device="cuda")
    yk = y[row].view(T, k, H)
    want = w[:, 0:1] * yk[:, 0]
    for j in range(1, k):
        want = want + w[:, j:j + 1] * yk[:, j]
    assert torch.equal(mx_gemm.combine(y, row, w), want.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backward_quantizers_are_the_quantizer_along_each_dimension(dtype):
    gen = torch.Generator(device="cuda").manual_seed(8)
    t = (torch.randn(256, 384, generator=gen, device="cuda") *
         torch.exp2(torch.randint(-20, 20, (256, 1), generator=gen, device="cuda").float())).to(dtype)
    t[7, 3] = float("inf")
    codes, scales = mx_gemm.quantize_cols(t)
    want_codes, want_scales = mx.quantize(t.t().contiguous(), dim=-1)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scales, want_scales)
    if dtype == torch.float32:
        codes, scales = mx_gemm.quantize_f32_rows(t)
        want_codes, want_scales = mx.quantize(t, dim=-1)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
        assert torch.equal(scales, mx_gemm.block_scales(want_scales))


@pytest.mark.parametrize("clamp", [None, 7.0])
def test_swiglu_quantize_against_the_quantized_reference_swiglu(clamp):
    gen = torch.Generator(device="cuda").manual_seed(4)
    gu = torch.randn(256, 2 * 384, generator=gen, device="cuda") * 4
    codes, scales = mx_gemm.swiglu_quantize(gu, clamp)
    want_codes, want_scales = mx.quantize(R.swiglu(gu[:, :384], gu[:, 384:], clamp), dim=-1)
    # the fast division is within 2 ulp of torch's silu: a few codes round the other way
    same = (codes.view(torch.uint8) == want_codes.view(torch.uint8)).float().mean().item()
    assert same > 0.999, same
    assert (scales == mx_gemm.block_scales(want_scales)).float().mean().item() > 0.999


@pytest.mark.parametrize("k", [1, 3])
def test_combine_backward_against_the_pytorch_expressions(k):
    """mx_gemm.combine_backward: dy the PyTorch product's bits (zeros on padding rows), its codes
    quantize_f32_rows' bits, d w within float32 summation order of the PyTorch sum (the kernel's
    order is fixed: the same bits 20 times)."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    T, H, rows = 90, 640, 384
    d_out = (torch.randn(T, H, generator=gen, device="cuda") *
             torch.exp2(torch.randint(-20, 20, (T, 1), generator=gen, device="cuda").float())).to(torch.bfloat16)
    y = torch.randn(rows, H, generator=gen, device="cuda")
    w = torch.rand(T, k, generator=gen, device="cuda")
    row = torch.randperm(rows, generator=gen, device="cuda")[:T * k]
    pair = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
    pair[row] = torch.arange(T * k, dtype=torch.int32, device="cuda")
    dy, (codes, scales), d_w = mx_gemm.combine_backward(d_out, y, pair, w)
    g = d_out.float()
    want = torch.zeros(rows, H, device="cuda")
    want[row] = (w.unsqueeze(-1) * g.unsqueeze(1)).reshape(T * k, H)
    assert torch.equal(dy, want)
    want_codes, want_scales = mx_gemm.quantize_f32_rows(want)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scales, want_scales)
    terms = g.unsqueeze(1) * y[row].view(T, k, H)
    want_dw = terms.sum(-1)
    # another summation order: within float32's rounding of the sum of the terms' sizes
    assert ((d_w - want_dw).abs() <= 1e-5 * terms.abs().sum(-1)).all()
    for _ in range(19):
        assert torch.equal(mx_gemm.combine_backward(d_out, y, pair, w)[2], d_w)
    # keep_dy=False (v0.66): no float32 dy, the same codes, scales and d w
    none, (codes2, scales2), d_w2 = mx_gemm.combine_backward(d_out, y, pair, w, keep_dy=False)
    assert none is None and torch.equal(d_w2, d_w) and torch.equal(scales2, scales)
    assert torch.equal(codes2.view(torch.uint8), codes.view(torch.uint8))
    # dy's values along the rows made from dOut and the routing weights (rows_values with scale):
    # the bits of rows_values on the float32 dy rows, rows gathered through each row's token
    src = torch.where(pair >= 0, pair.div(k, rounding_mode="floor"), -1).to(torch.int32)
    scale = torch.where(pair >= 0, w.view(-1)[pair.clamp(min=0).long()], 0.0).contiguous()
    got = mx_gemm.rows_values(d_out, src, scale=scale)
    assert torch.equal(got.view(torch.int16), mx_gemm.rows_values(dy).view(torch.int16))


@pytest.mark.parametrize("clamp", [None, 3.0])
def test_swiglu_backward_against_pytorch_autograd(clamp):
    """mx_gemm.swiglu_backward against reference.swiglu under autograd: dg, du and h within an ulp
    or two (PyTorch's kernels contract some products; the kernel rounds each operation), NaN where
    PyTorch has NaN, the clamp's masks exactly, and the codes quantize_f32_rows' of [dg | du]
    bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(22)
    rows, I = 256, 384
    gu = torch.randn(rows, 2 * I, generator=gen, device="cuda") * 4
    gu[3, 5] = float("nan")           # a gate NaN
    gu[4, I + 7] = float("nan")       # an up NaN
    gu[5, 9] = -100.0                 # exp(-g) overflows to inf: s = 0, silu = -0
    if clamp is not None:
        gu[6, :16] = clamp            # at the limit: the gradient passes (g <= L)
        gu[6, I:I + 16] = -clamp
    dh = torch.randn(rows, I, generator=gen, device="cuda")
    dg, du, h, (codes, scales) = mx_gemm.swiglu_backward(gu, dh, clamp)
    with torch.enable_grad():
        g, u = (t.detach().clone().requires_grad_(True) for t in (gu[:, :I], gu[:, I:]))
        ref_h = R.swiglu(g, u, clamp)
        ref_dg, ref_du = torch.autograd.grad(ref_h, (g, u), dh)
    # each within a few float32 roundings of its terms' size (dg: |dh u| (1 + |g|); near silu's
    # stationary point its sum cancels, so not relative to dg itself)
    gc, uc = (gu[:, :I], gu[:, I:]) if clamp is None else (gu[:, :I].clamp(max=clamp), gu[:, I:].clamp(-clamp, clamp))
    sizes = ((dh * uc).abs() * (1 + gc.abs()), (dh * gc).abs(), (gc * uc).abs())
    for got, want, size in zip((dg, du, h), (ref_dg, ref_du, ref_h.detach()), sizes):
        assert torch.equal(got.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(got[ok] == 0, want[ok] == 0)  # the clamp's masks
        assert ((got[ok] == want[ok]) | ((got[ok] - want[ok]).abs() <= 1e-6 * size[ok])).all()  # size NaN: a NaN gate
    want_codes, want_scales = mx_gemm.quantize_f32_rows(torch.cat([dg, du], 1))
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("by_pair", [False, True])
@pytest.mark.parametrize("clamp", [None, 3.0])
def test_swiglu_backward_values_are_rows_values_of_its_float32_rows(clamp, by_pair):
    """mx_gemm.swiglu_backward with values_rows (v0.66; the MXFP8 backward's weight gradients on the
    BF16 weight kernels): the same [dg | du] codes and scales as without, and instead of dg, du and h
    in float32, their MX values along the rows in mx_experts._rows32's layout, bit for bit those of
    rows_values on the float32 rows through that layout's rows (skewed routing: an expert without
    rows, blocks of padding; a NaN), the rows past the last expert zeros (the output's memory
    filled with NaN first), and the same bits on a second run."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    T, k, E, I = 300, 2, 5, 256
    ids = torch.randint(0, E - 1, (T * k,), generator=gen, device="cuda")  # expert E - 1 gets no rows
    ids[:100] = 0
    row, src, tiles, padded = mx_experts._segments(ids, E, k)
    rows = mx_gemm.BLOCK * tiles.shape[0]
    pair = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
    pair[row] = torch.arange(T * k, dtype=torch.int32, device="cuda")
    gu_pairs = (torch.randn(T * k, 2 * I, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    gu_pairs[7, 3] = float("nan")
    gu = torch.zeros(rows, 2 * I, device="cuda")
    gu[row] = gu_pairs.float()
    dh = torch.randn(rows, I, generator=gen, device="cuda")
    args = (gu_pairs, dh, clamp, pair) if by_pair else (gu, dh, clamp)
    dg, du, h, (codes, scales) = mx_gemm.swiglu_backward(*args)
    at, _tok, offs = mx_experts._rows32(row, padded, src)
    vr = (mx_experts._block_map(at, rows), offs[-1:], at.shape[0])
    torch.full((3, at.shape[0], I), float("nan"), dtype=torch.bfloat16, device="cuda")  # freed: garbage to reuse
    got = mx_gemm.swiglu_backward(*args, values_rows=vr)
    assert torch.equal(got[3][0].view(torch.uint8), codes.view(torch.uint8)) and torch.equal(got[3][1], scales)
    for name, g, t in zip(("dg", "du", "h"), got[:3], (dg, du, h)):
        want = mx_gemm.rows_values(t, at)
        assert g.dtype == torch.bfloat16 and g.shape == (at.shape[0], I), name
        assert torch.equal(g.view(torch.int16), want.view(torch.int16)), name
        assert not g[int(offs[-1]):].any(), name
    assert g.isnan().any() or not h.isnan().any()  # the NaN reached the values
    again = mx_gemm.swiglu_backward(*args, values_rows=vr)
    for a, b in zip(again[:3], got[:3]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_grouped_gemm_skips_the_tiles_past_the_segments():
    """(-1, 0) entries (the fixed-length tile list of mx_experts._segments) write nothing."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    a, sa = mx.quantize(torch.randn(256, 256, generator=gen, device="cuda").to(torch.bfloat16), dim=-1)
    b, sb = mx.quantize(torch.randn(2, 128, 256, generator=gen, device="cuda").to(torch.bfloat16), dim=-1)
    tiles = torch.tensor([[1, 0], [-1, 0], [-1, 0]], dtype=torch.int32, device="cuda")
    got = mx_gemm.mx_grouped_gemm(a, mx_gemm.block_scales(sa), b, mx_gemm.block_expert_scales(sb), tiles)
    want = mx_gemm.mx_gemm(a[:128].contiguous(), sa[:128].contiguous(), b[1], sb[1])
    assert torch.equal(got[:128], want)


@pytest.mark.parametrize("skew, clamp, form", [(False, None, "bf16"), (True, None, "bf16"), (False, 10.0, "bf16"),
                                               (True, 10.0, "quad")])
def test_mx_experts_match_the_float64_mx_oracle(skew, clamp, form):
    T, H, I, E, k = 300, 512, 256, 6, 2
    x, ids, w, wg, wu, wd = _problem(T, H, I, E, k, seed=7, skew=skew)
    weights = mx_experts.quantize_weights(wg, wu, wd)
    out = mx_experts.experts_forward(x, ids, w, weights, clamp_limit=clamp, form=form)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H) and torch.isfinite(out).all()
    oracle = R.mx_experts_forward(x, ids, w, wg, wu, wd, clamp_limit=clamp, acc_dtype=torch.float64)
    rel = ((out.double() - oracle).norm() / oracle.norm()).item()
    # against the oracle: the bf16 output's rounding (about 1e-3), and h's roundings to E4M3 that
    # come out one step apart where the FP8 tensor core's sums within a 32-wide step (about 14
    # bits) or the fast division move h across a rounding boundary (3.1e-3 seen, v0.34 call 7)
    assert rel < 6e-3, f"against the MX oracle: {rel:.2e}"
    exact = R.experts_forward(x, ids, w, wg, wu, wd, clamp_limit=clamp, acc_dtype=torch.float64)
    rel_exact = ((out.double() - exact).norm() / exact.norm()).item()
    assert 0.02 < rel_exact < 0.12, f"against the float64 layer: {rel_exact:.2e}"  # MXFP8's own error


@pytest.mark.parametrize("form", ["bf16", "quad"])
def test_mx_experts_give_the_same_bits_20_times(form):
    x, ids, w, wg, wu, wd = _problem(512, 256, 128, 4, 3, seed=11, skew=True)
    weights = mx_experts.quantize_weights(wg, wu, wd)
    first = mx_experts.experts_forward(x, ids, w, weights, form=form)
    for _ in range(19):
        assert torch.equal(mx_experts.experts_forward(x, ids, w, weights, form=form), first)


@pytest.mark.parametrize("stages", ["torch", "fused"])
@pytest.mark.parametrize("skew, clamp, form, k", [(False, None, "bf16", 2), (True, 10.0, "bf16", 2),
                                                  (True, 10.0, "quad", 2), (False, 10.0, "bf16", 1),
                                                  (True, None, "bf16", 3)])
def test_mx_backward_matches_the_float64_mx_oracle_gradients(monkeypatch, skew, clamp, form, k, stages):
    """experts_forward_train's gradients (x, the routing weights, the three expert weights) against
    the float64 MX oracle's autograd. Beyond the bf16 rounding of dx and the weight gradients, the
    bound covers E4M3
    roundings that move one step where the FP8 tensor core's 32-wide sums move a value across a
    rounding boundary (as the forward's 6e-3)."""
    monkeypatch.setenv("MOKGEN_MX_BWD_STAGES", stages)
    T, H, I, E = 300, 512, 256, 6
    x, ids, w, wg, wu, wd = _problem(T, H, I, E, k, seed=13, skew=skew)
    d_out = torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(3),
                        device="cuda").to(torch.bfloat16)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]  # weights bf16, as a model holds them
    out = mx_experts.experts_forward_train(leaves[0], ids, *leaves[1:], clamp_limit=clamp, form=form)
    out.backward(d_out)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    ref = R.mx_experts_forward(ref_leaves[0], ids, ref_leaves[1], *ref_leaves[2:], clamp_limit=clamp,
                               acc_dtype=torch.float64)
    ref.backward(d_out.double())
    for name, got, want in zip(("x", "topk_weights", "w_gate", "w_up", "w_down"), leaves, ref_leaves):
        rel = ((got.grad.double() - want.grad).norm() / want.grad.norm()).item()
        assert rel < 6e-3, (name, rel)
    for _ in range(19):  # the same bits 20 times
        again = [t.detach().clone().requires_grad_(True) for t in leaves]
        mx_experts.experts_forward_train(again[0], ids, *again[1:], clamp_limit=clamp, form=form).backward(d_out)
        for got, twice in zip(leaves, again):
            assert torch.equal(got.grad, twice.grad)


@pytest.mark.parametrize("k, skew", [(2, False), (1, True)])
def test_weights_in_both_orientations_from_one_read_give_the_same_gradients(monkeypatch, k, skew):
    """MOKGEN_MX_WEIGHTS=both (the forward quantizes each weight in both orientations from one read
    and keeps the transposed values for the backward) against apart: the same output and gradients,
    bit for bit, and the backward quantizes no weight again."""
    T, H, I, E = 300, 512, 256, 6
    x, ids, w, wg, wu, wd = _problem(T, H, I, E, k, seed=17, skew=skew)
    d_out = torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(4),
                        device="cuda").to(torch.bfloat16)
    calls = {"both": 0, "transposed": 0}
    both, transposed = mx_gemm.expert_weights_both, mx_experts._transposed_weights

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(mx_gemm, "expert_weights_both", count("both", both))
    monkeypatch.setattr(mx_experts, "_transposed_weights", count("transposed", transposed))
    got = {}
    for value in ("apart", "both"):
        monkeypatch.setenv("MOKGEN_MX_WEIGHTS", value)
        calls.update(both=0, transposed=0)
        leaves = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
        out = mx_experts.experts_forward_train(leaves[0], ids, *leaves[1:], clamp_limit=10.0)
        out.backward(d_out)
        got[value] = [out.detach()] + [t.grad for t in leaves]
        assert calls == ({"both": 0, "transposed": 2} if value == "apart" else {"both": 2, "transposed": 0}), value
    for i, (a, b) in enumerate(zip(got["apart"], got["both"])):
        assert torch.equal(a, b), i
    with torch.no_grad():  # no backward to come: the forward quantizes one orientation only
        calls.update(both=0)
        mx_experts.experts_forward_train(x, ids, w, wg, wu, wd, clamp_limit=10.0)
        assert calls["both"] == 0


@pytest.mark.parametrize("stages", ["fused", "torch"])
@pytest.mark.parametrize("k, skew", [(2, False), (1, True), (3, True)])
def test_raw_dgrad_weights_give_the_values_gradients(monkeypatch, k, skew, stages):
    """MOKGEN_MX_DGRAD_WEIGHTS=raw (the dgrads quantize the bf16 weights in the kernel, v0.67)
    against values (the transposed conversion's values): no transposed conversion runs, the
    gradients are the float64 MX oracle's to the backward test's bound and values' to within the
    float32 sums' last bits (an E4M3 rounding downstream may move one step), the same bits 20
    times."""
    monkeypatch.setenv("MOKGEN_MX_BWD_STAGES", stages)
    T, H, I, E = 300, 512, 256, 6
    x, ids, w, wg, wu, wd = _problem(T, H, I, E, k, seed=19 + k, skew=skew)
    d_out = torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(6),
                        device="cuda").to(torch.bfloat16)
    calls = {"transposed": 0}
    transposed = mx_experts._transposed_weights

    def counted(*args, **kwargs):
        calls["transposed"] += 1
        return transposed(*args, **kwargs)

    monkeypatch.setattr(mx_experts, "_transposed_weights", counted)
    got = {}
    for value in ("values", "raw"):
        monkeypatch.setenv("MOKGEN_MX_DGRAD_WEIGHTS", value)
        calls["transposed"] = 0
        leaves = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
        mx_experts.experts_forward_train(leaves[0], ids, *leaves[1:], clamp_limit=10.0).backward(d_out)
        got[value] = [t.grad for t in leaves]
        assert calls["transposed"] == (2 if value == "values" else 0), value
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    R.mx_experts_forward(ref_leaves[0], ids, ref_leaves[1], *ref_leaves[2:], clamp_limit=10.0,
                         acc_dtype=torch.float64).backward(d_out.double())
    for name, raw, vals, ref in zip(("x", "topk_weights", "w_gate", "w_up", "w_down"), got["raw"], got["values"],
                                    ref_leaves):
        assert ((raw.double() - ref.grad).norm() / ref.grad.norm()).item() < 6e-3, name
        rel = ((raw.double() - vals.double()).norm() / vals.double().norm()).item()
        assert rel < 1e-3, (name, rel)
        print(f"{name}: raw vs values relative difference {rel:.2e}, bits equal {torch.equal(raw, vals)}")
    monkeypatch.setenv("MOKGEN_MX_DGRAD_WEIGHTS", "raw")
    for _ in range(19):
        again = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
        mx_experts.experts_forward_train(again[0], ids, *again[1:], clamp_limit=10.0).backward(d_out)
        for first, twice in zip(got["raw"], again):
            assert torch.equal(first, twice.grad)


@pytest.mark.parametrize("k, skew", [(2, True), (1, False)])
def test_band_orders_give_the_same_forward_and_training_step(monkeypatch, k, skew):
    """MOKGEN_MX_BAND (the bf16-math GEMM's grouped launches' tile order by bands of row tiles)
    against the grid's order over a whole staged forward (the fused SwiGLU epilogue; at k = 1 the
    fused combine) and training step (the grouped forward and dgrads, the k-ranged weight
    gradients): the same output and gradients, bit for bit."""
    T, H, I, E = 700, 512, 256, 6
    x, ids, w, wg, wu, wd = _problem(T, H, I, E, k, seed=29, skew=skew)
    d_out = torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(6),
                        device="cuda").to(torch.bfloat16)
    weights = mx_experts.quantize_weights(wg, wu, wd)
    got = {}
    for band in ("1", "8", "3"):
        monkeypatch.setenv("MOKGEN_MX_BAND", band)
        leaves = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
        out = mx_experts.experts_forward_train(leaves[0], ids, *leaves[1:], clamp_limit=10.0)
        out.backward(d_out)
        got[band] = [mx_experts.experts_forward(x, ids, w, weights, clamp_limit=10.0), out.detach()] + \
            [t.grad for t in leaves]
    for band, value in got.items():
        for i, (a, b) in enumerate(zip(got["1"], value)):
            assert torch.equal(a, b), (band, i)


@pytest.mark.parametrize("clamp", [None, 10.0])
def test_the_fused_up_projection_gives_the_unfused_bits(clamp):
    """experts_forward with the gate | up weights interleaved (SwiGLU and h's quantization in the
    GEMM's epilogue, the default) and without (the GEMM, then swiglu_quantize): the same bits."""
    x, ids, w, wg, wu, wd = _problem(300, 512, 256, 6, 2, seed=17, skew=True)
    fused = mx_experts.quantize_weights(wg, wu, wd)
    plain = mx_experts.quantize_weights(wg, wu, wd, interleave=False)
    assert fused.interleaved and not plain.interleaved
    assert torch.equal(mx_experts.experts_forward(x, ids, w, fused, clamp_limit=clamp),
                       mx_experts.experts_forward(x, ids, w, plain, clamp_limit=clamp))


@pytest.mark.parametrize("skew", [False, True])
def test_the_fused_combine_gives_the_unfused_bits(skew):
    """k = 1: the down projection with the combine in its epilogue (the default) against the same
    forward on the FP8 path's order of stages (down GEMM, then the combine kernel), the same
    bf16-math GEMM in both: the same bits; and the same bits 20 times."""
    x, ids, w, wg, wu, wd = _problem(1000, 512, 256, 6, 1, seed=19, skew=skew)
    weights = mx_experts.quantize_weights(wg, wu, wd)
    fused = mx_experts.experts_forward(x, ids, w, weights)
    flat = ids.reshape(-1).long()
    row, src, tiles, padded = mx_experts._segments(flat, 6, 1)
    xq, xs = mx_gemm.quantize_rows(x, src, src.numel())
    hq, hs = mx_gemm.mx_bf16_math_swiglu_gemm(xq, xs, weights.gate_up_bf16, tiles)
    y = mx_gemm.mx_bf16_math_grouped_gemm(hq, hs, weights.down_bf16, tiles)
    assert torch.equal(fused, mx_gemm.combine(y, row, w.float().contiguous()))
    for _ in range(19):
        assert torch.equal(mx_experts.experts_forward(x, ids, w, weights), fused)


def test_gate_and_up_gemms_into_gus_halves_are_the_stacked_gemms_bits():
    """The staged forward with gate and up held apart (the MXFP8 layer's cached conversions, v0.40):
    two grouped GEMMs, each into its half of one float32 gate | up (a row stride of 2 I), give the
    stacked weights' single GEMM's bits, and leave the other half alone."""
    gen = torch.Generator(device="cuda").manual_seed(24)
    E, I, H, rows = 3, 256, 384, 5 * 128
    a, sa = mx.quantize(torch.randn(rows, H, generator=gen, device="cuda").to(torch.bfloat16), dim=-1)
    sa = mx_gemm.block_scales(sa)
    wg, wu = ((torch.randn(E, I, H, generator=gen, device="cuda") * H**-0.5).to(torch.bfloat16) for _ in range(2))
    tiles, _ = mx_gemm.row_tiles([256, 0, 384], "cuda")
    stacked = mx_gemm.mx_bf16_math_grouped_gemm(a, sa, mx_gemm.expert_weights([wg, wu]), tiles)
    gu = torch.full((rows, 2 * I), 7.0, device="cuda")
    mx_gemm.mx_bf16_math_grouped_gemm(a, sa, mx_gemm.expert_weights([wg]), tiles, out=gu[:, :I])
    assert torch.equal(gu[:, :I], stacked[:, :I]) and (gu[:, I:] == 7.0).all()
    mx_gemm.mx_bf16_math_grouped_gemm(a, sa, mx_gemm.expert_weights([wu]), tiles, out=gu[:, I:])
    assert torch.equal(gu, stacked)


def test_gate_and_up_weight_gradients_apart_are_the_joint_launchs_halves():
    """The backward's dW_gate and dW_up as two k-ranged launches over one B (each contiguous, no
    copy into the weights' layout) against one launch over [dg | du]: the same bits, since the
    quantization along the rows is per column and each output element's k-loop is the same."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    R, I, H = 6 * 128, 256, 512
    padded = torch.tensor([256, 0, 384, 128], device="cuda")
    dg, du = (torch.randn(R, I, generator=gen, device="cuda") for _ in range(2))
    x_rows = torch.randn(R, H, generator=gen, device="cuda").to(torch.bfloat16)
    joint = mx_experts._weight_grads_ranged(torch.cat([dg, du], dim=1), x_rows, padded, torch.bfloat16)
    xb = mx_gemm.cols_bf16_math(x_rows)
    apart = [mx_experts._weight_grads_ranged(t, x_rows, padded, torch.bfloat16, b_bf16=xb) for t in (dg, du)]
    assert all(t.is_contiguous() for t in apart)
    assert torch.equal(apart[0], joint[:, :I]) and torch.equal(apart[1], joint[:, I:])
    assert not apart[0][1].any()  # the expert without rows


def test_the_backward_takes_any_float_weight_dtype():
    """The weight gradients' launch writes float32 or bf16: weights held in fp16 get the float32
    gradients cast once (the same values quantize to the same codes, so the gradients are those of
    float32 weights rounded to fp16), not an error."""
    T, H, I, E, k = 200, 256, 256, 3, 2
    x, ids, w, wg, wu, wd = _problem(T, H, I, E, k, seed=17, skew=False)
    d_out = torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(4),
                        device="cuda").to(torch.bfloat16)
    grads = {}
    for dtype in (torch.float32, torch.float16):
        # fp16-exact values in both dtypes (bf16's tiniest values are fp16 subnormals)
        leaves = [t.to(torch.float16).to(dtype).requires_grad_(True) for t in (wg, wu, wd)]
        mx_experts.experts_forward_train(x, ids, w, *leaves, form="bf16").backward(d_out)
        assert all(t.grad.dtype == dtype for t in leaves)
        grads[dtype] = [t.grad for t in leaves]
    for g32, g16 in zip(grads[torch.float32], grads[torch.float16]):
        assert torch.equal(g16, g32.to(torch.float16))
