"""mokgen.mx_experts (the MXFP8 routed experts) without a GPU: the weights' layout, the grouping of
rows into padded expert segments, the tile list, the bytes per row and the input checks. The GPU
run against the float64 MX oracle is in test_gpu_mx_experts.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mokgen import env, mx, mx_experts, mx_gemm  # noqa: E402
from mokgen.errors import InputError  # noqa: E402


def test_segments_group_rows_by_expert_in_pair_order_with_padding():
    ids = torch.tensor([2, 0, 2, 2, 0, 3])  # pairs 0..5
    row, src, tiles, padded = mx_experts._segments(ids, 4, k=2)
    rows = src.numel()
    assert padded.tolist() == [128, 0, 128, 128]
    # expert 0: pairs 1, 4 at rows 0, 1; expert 2: pairs 0, 2, 3 at 128, 129, 130; expert 3: pair 5 at 256
    assert row.tolist() == [128, 0, 129, 130, 1, 256]
    # each padded row's token (pair // k), -1 for padding
    assert src[[0, 1, 2, 128, 129, 130, 131, 256, 257]].tolist() == [0, 2, -1, 0, 1, 1, -1, 2, -1]
    # ceil(6 / 128) + 4 = 5 tiles, three of them the segments'; rows for every tile
    assert tiles.tolist() == [[0, 0], [2, 128], [3, 256], [-1, 0], [-1, 0]] and rows == 5 * 128


def test_segments_of_a_full_tile_and_more():
    ids = torch.zeros(129, dtype=torch.int64)
    row, src, tiles, padded = mx_experts._segments(ids, 2, k=1)
    rows = src.numel()
    assert padded.tolist() == [256, 0] and row.tolist() == list(range(129))
    assert tiles.tolist() == [[0, 0], [0, 128], [-1, 0], [-1, 0]] and rows == 4 * 128


def test_segments_tile_list_is_row_tiles_padded_to_the_bound():
    """On random routings the device-side list equals mx_gemm.row_tiles of the segment sizes,
    then (-1, 0) up to ceil(n / 128) + E entries."""
    gen = torch.Generator().manual_seed(4)
    for E in (1, 3, 16):
        ids = torch.randint(0, E, (int(torch.randint(1, 700, (1,), generator=gen)),), generator=gen)
        row, src, tiles, padded = mx_experts._segments(ids, E, k=1)
        rows = src.numel()
        want, n = mx_gemm.row_tiles(padded, "cpu")
        bound = -(-ids.numel() // 128) + E
        assert tiles.shape == (bound, 2) and rows == 128 * bound
        assert torch.equal(tiles[:n], want) and (tiles[n:] == torch.tensor([-1, 0], dtype=torch.int32)).all()
        assert len(set(row.tolist())) == ids.numel() and int(row.max()) < int(padded.sum())


def test_row_tiles_list_each_segments_tiles():
    tiles, n = mx_gemm.row_tiles([256, 0, 128, 384], "cpu")
    assert n == 6 and tiles.dtype == torch.int32
    assert tiles.tolist() == [[0, 0], [0, 128], [2, 256], [3, 384], [3, 512], [3, 640]]
    with pytest.raises(InputError, match="non-negative multiples of 128"):
        mx_gemm.row_tiles([100], "cpu")


def _small_weights(seed: int, E: int = 2, I: int = 128, H: int = 256):
    """bf16 w_gate, w_up [E, I, H] and w_down [E, H, I] drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    wg, wu = (torch.randn(E, I, H, generator=gen).to(torch.bfloat16) for _ in range(2))
    return wg, wu, torch.randn(E, H, I, generator=gen).to(torch.bfloat16)


def test_quantized_weights_are_the_quantizer_s_in_the_blocked_layout():
    E, I, H = 2, 128, 256
    wg, wu, wd = _small_weights(0, E, I, H)
    w = mx_experts.quantize_weights(wg, wu, wd)
    assert (w.num_experts, w.hidden, w.inter) == (E, H, I)
    codes, scales = mx.quantize(wu[1], dim=-1)
    assert torch.equal(w.gate_up[1, I:].view(torch.uint8), codes.view(torch.uint8))
    # blocked: [E, K / 128, N, 4], row n's four scales of k-block b at [e, b, n]
    assert tuple(w.gate_up_scales.shape) == (E, H // 128, 2 * I, 4)
    assert torch.equal(w.gate_up_scales[1, 1, I + 5], scales[5, 4:8])
    dcodes, dscales = mx.quantize(wd[0], dim=-1)
    assert torch.equal(w.down[0].view(torch.uint8), dcodes.view(torch.uint8))
    assert torch.equal(w.down_scales[0, 0, 7], dscales[7, 0:4])


def test_weights_must_have_the_layout_and_tile_multiples():
    wg = torch.zeros(2, 128, 256)
    with pytest.raises(InputError, match=r"w_gate / w_up \[E, I, H\] and w_down \[E, H, I\]"):
        mx_experts.quantize_weights(wg, wg, wg)
    small = torch.zeros(2, 96, 256)
    with pytest.raises(InputError, match="multiples of 128, got H = 256, I = 96"):
        mx_experts.quantize_weights(small, small, torch.zeros(2, 256, 96))


def test_bytes_per_row():
    assert mx_experts.bytes_per_row(7168, "bf16") == 14336
    assert mx_experts.bytes_per_row(7168) == 7168 + 224
    assert mx_experts.bytes_per_row(7168) / mx_experts.bytes_per_row(7168, "bf16") == pytest.approx(0.515625)
    with pytest.raises(InputError, match="numerics must be bf16 or mxfp8"):
        mx_experts.bytes_per_row(7168, "fp8")


def test_forward_checks_its_inputs():
    E, I, H = 2, 128, 128
    w = mx_experts.quantize_weights(torch.zeros(E, I, H), torch.zeros(E, I, H), torch.zeros(E, H, I))
    x = torch.zeros(4, H, dtype=torch.bfloat16)
    ids, wts = torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2)
    with pytest.raises(InputError, match=r"x must be bf16 \[T, 128\]"):
        mx_experts.experts_forward(x[:, :64], ids, wts, w)
    with pytest.raises(InputError, match=r"x must be bf16 \[T, 128\], got torch.float32"):
        mx_experts.experts_forward(x.float(), ids, wts, w)
    with pytest.raises(InputError, match=r"topk_ids and topk_weights must both be \[T, k\]"):
        mx_experts.experts_forward(x, ids, wts[:, :1], w)
    with pytest.raises(InputError, match=r"topk_ids must lie in \[0, 2\)"):
        mx_experts.experts_forward(x, ids + 2, wts, w)
    assert mx_experts.experts_forward(x[:0], ids[:0], wts[:0], w).shape == (0, H)


# ---- the orchestration on the CPU: the MX kernels replaced by exact emulations ---------------------

def _unblock(scales):  # [K / 128, M, 4] -> [M, K / 32]
    kb, m, _ = scales.shape
    return scales.permute(1, 0, 2).reshape(m, kb * 4)


def _unblock_experts(scales):  # [E, K / 128, N, 4] -> [E, N, K / 32]
    e, kb, n, _ = scales.shape
    return scales.permute(0, 2, 1, 3).reshape(e, n, kb * 4)


def unpermute(b):
    """The bf16-math B operand's k order undone: position 2q + (i & 1) + 8 (i >> 1) of each 16
    holds k 4q + i (written out by loops, apart from mx_gemm's index expression)."""
    pos = {}
    for q in range(4):
        for i in range(4):
            pos[4 * q + i] = 2 * q + (i & 1) + 8 * (i >> 1)
    idx = torch.tensor([16 * c + pos[j] for c in range(b.shape[-1] // 16) for j in range(16)])
    return b[..., idx]


def test_bf16_math_weights_are_the_mx_values_permuted_within_16():
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(256, 128, generator=gen) * torch.exp2(torch.randint(-9, 9, (256, 1), generator=gen).float()))
    codes, scales = mx.quantize(w.to(torch.bfloat16), dim=-1)
    b = mx_gemm.bf16_math_weights(codes, scales)
    assert b.dtype == torch.bfloat16 and b.shape == (256, 128)
    assert torch.equal(unpermute(b), mx.dequantize(codes, scales).to(torch.bfloat16))
    assert not torch.equal(b, unpermute(b))  # a permutation that moves elements


def test_quantized_weights_hold_the_bf16_math_operands():
    I = 256  # two 128-row groups, so the interleave moves rows (at I = 128 it is the identity)
    wg, wu, wd = _small_weights(6, I=I)
    w = mx_experts.quantize_weights(wg, wu, wd, interleave=False)
    codes, scales = mx.quantize(wu[1], dim=-1)
    assert torch.equal(unpermute(w.gate_up_bf16[1, I:]), mx.dequantize(codes, scales).to(torch.bfloat16))
    # interleaved (the default): rows 256 j .. 256 j + 127 gate's 128 j .., then up's
    fused = mx_experts.quantize_weights(wg, wu, wd)
    assert fused.interleaved and not w.interleaved and torch.equal(fused.gate_up, w.gate_up)
    for e in range(2):
        assert torch.equal(fused.gate_up_bf16[e, :128], w.gate_up_bf16[e, :128])             # gate 0..127
        assert torch.equal(fused.gate_up_bf16[e, 128:256], w.gate_up_bf16[e, I:I + 128])     # up 0..127
        assert torch.equal(fused.gate_up_bf16[e, 256:384], w.gate_up_bf16[e, 128:256])       # gate 128..255
        assert torch.equal(fused.gate_up_bf16[e, 384:512], w.gate_up_bf16[e, I + 128:])      # up 128..255
    codes, scales = mx.quantize(wd[0], dim=-1)
    assert torch.equal(unpermute(w.down_bf16[0]), mx.dequantize(codes, scales).to(torch.bfloat16))


def test_an_unknown_form_is_refused():
    E, I, H = 1, 128, 128
    w = mx_experts.quantize_weights(torch.zeros(E, I, H), torch.zeros(E, I, H), torch.zeros(E, H, I))
    x, ids, wts = torch.zeros(4, H, dtype=torch.bfloat16), torch.zeros(4, 1, dtype=torch.int32), torch.ones(4, 1)
    with pytest.raises(InputError, match=r"form must be one of \['bf16', 'inline', 'decoded', 'quad'\]"):
        mx_experts.experts_forward(x, ids, wts, w, form="fp8")


def test_one_pair_per_token_matches_the_mx_oracle(emulated):
    """k = 1 (the local work): the down projection's epilogue combines (emulated here); every
    token's row written, against the oracle."""
    from mokgen import reference as R

    x, ids, w, wg, wu, wd = _cpu_problem(k=1)
    out = mx_experts.experts_forward(x, ids, w, mx_experts.quantize_weights(wg, wu, wd))
    oracle = R.mx_experts_forward(x, ids, w, wg, wu, wd, acc_dtype=torch.float64)
    assert torch.isfinite(out).all() and _rel(out, oracle) < 4e-3


def test_the_fp8_form_without_codes_is_refused(emulated):
    x, ids, w, wg, wu, wd = _cpu_problem()
    weights = mx_experts.quantize_weights(wg, wu, wd)
    bare = mx_experts.MXExpertWeights(None, None, None, None, weights.gate_up_bf16, weights.down_bf16,
                                      interleaved=weights.interleaved)
    assert bare.num_experts == 4 and bare.hidden == 256 and bare.inter == 256
    assert torch.equal(mx_experts.experts_forward(x, ids, w, bare), mx_experts.experts_forward(x, ids, w, weights))
    with pytest.raises(InputError, match=r"form 'quad' runs on the FP8 tensor core and needs the weights' codes"):
        mx_experts.experts_forward(x, ids, w, bare, form="quad")


@pytest.fixture
def emulated(monkeypatch):
    emulate_kernels(monkeypatch)


def emulate_kernels(monkeypatch):
    """mokgen.mx_gemm's kernels as exact float64 emulations (the GEMM is the exact MX product, SwiGLU
    the oracle's): what mx_experts builds around them runs on the CPU. Rows a grouped launch does
    not cover come back NaN, so a stage that reads them shows."""
    from mokgen import reference as R

    f64 = torch.float64

    def gemm(a, sa, b, sb, form="quad"):
        return (mx.dequantize(a, sa, out_dtype=f64) @ mx.dequantize(b, sb, out_dtype=f64).T).float()

    def grouped(a, sa, b, sb, tiles, form="quad"):
        A = mx.dequantize(a, _unblock(sa), out_dtype=f64)
        B = mx.dequantize(b, _unblock_experts(sb), out_dtype=f64)
        c = torch.full((a.shape[0], b.shape[1]), float("nan"))
        for e, m0 in tiles.tolist():
            if e >= 0:  # the kernel skips (-1, 0) tiles
                c[m0:m0 + 128] = (A[m0:m0 + 128] @ B[e].T).float()
        return c

    def quantize_rows(x, src, rows):
        picked = torch.where((src >= 0)[:, None], x[src.clamp(min=0).long()], torch.zeros(rows, x.shape[1],
                                                                                         dtype=x.dtype))
        codes, scales = mx.quantize(picked, dim=-1)
        return codes, mx_gemm.block_scales(scales)

    def swiglu_quantize(gu, clamp_limit=None):
        inter = gu.shape[1] // 2
        codes, scales = mx.quantize(R.swiglu(gu[:, :inter], gu[:, inter:], clamp_limit), dim=-1)
        return codes, mx_gemm.block_scales(scales)

    def combine(y, row, w):
        T, k = w.shape
        yk = y[row].view(T, k, -1)
        out = w[:, 0:1] * yk[:, 0]
        for j in range(1, k):
            out = out + w[:, j:j + 1] * yk[:, j]
        return out.to(torch.bfloat16)

    def quantize_f32_rows(x):
        codes, scales = mx.quantize(x, dim=-1)
        return codes, mx_gemm.block_scales(scales)

    def quantize_cols(x):
        return mx.quantize(x.t().contiguous(), dim=-1)

    def bf16_grouped(a, sa, b_bf16, tiles, out=None):
        A = mx.dequantize(a, _unblock(sa), out_dtype=f64)
        B = unpermute(b_bf16).double()
        c = torch.full((a.shape[0], b_bf16.shape[1]), float("nan"))
        for e, m0 in tiles.tolist():
            if e >= 0:
                c[m0:m0 + 128] = (A[m0:m0 + 128] @ B[e].T).float()
        if out is not None:  # C's memory given (a column block of a wider matrix)
            out.copy_(c)
            return out
        return c

    def swiglu_gemm(a, sa, b_interleaved, tiles, clamp_limit=None):
        gu = bf16_grouped(a, sa, b_interleaved, tiles)  # columns interleaved in 128s, as B's rows
        rows, n = gu.shape
        gu = gu.view(rows, n // 256, 2, 128).transpose(1, 2).reshape(rows, n)
        return swiglu_quantize(torch.nan_to_num(gu), clamp_limit)  # rows outside the tiles: unwritten

    def combine1_gemm(a, sa, b_bf16, tiles, src, weight):
        y = bf16_grouped(a, sa, b_bf16, tiles)
        out = torch.full((weight.shape[0], b_bf16.shape[1]), float("nan"), dtype=torch.bfloat16)
        valid = src >= 0
        t = src[valid].long()
        out[t] = (weight[t][:, None] * y[valid]).to(torch.bfloat16)
        return out

    def raw_gemm(a, sa, parts, tiles, combine=None):  # the dgrads with the weights raw (v0.67)
        assert mx_gemm.raw_weights_apply(parts)
        stacked_t = torch.cat(parts, dim=1).transpose(1, 2).contiguous()  # [E, N, K], quantized along K
        codes, scales = mx.quantize_experts(stacked_t)
        values = mx.dequantize(codes, scales, out_dtype=torch.float32).to(torch.bfloat16)
        A = mx.dequantize(a, _unblock(sa), out_dtype=f64)
        c = torch.full((a.shape[0], values.shape[1]), float("nan"))
        for e, m0 in tiles.tolist():
            if e >= 0:
                c[m0:m0 + 128] = (A[m0:m0 + 128] @ values[e].double().T).float()
        if combine is None:
            return c
        src, weight = combine
        out = torch.full((weight.shape[0], c.shape[1]), float("nan"), dtype=torch.bfloat16)
        valid = src >= 0
        t = src[valid].long()
        out[t] = (weight[t][:, None] * c[valid]).to(torch.bfloat16)
        return out

    def by_pair(t, pair):  # the kernels' pair-order bf16 rows as their float32 padded rows
        out = torch.zeros(pair.shape[0], t.shape[1], dtype=torch.float32)
        out[pair >= 0] = t[pair[pair >= 0].long()].to(torch.float32)
        return out

    def combine_backward(d_out, y, pair, w, keep_dy=True):  # the PyTorch expressions the kernel replaces
        T, k = w.shape
        y = by_pair(y, pair) if y.dtype == torch.bfloat16 else y
        valid = pair >= 0
        p = pair[valid].long()
        g = d_out.to(torch.float32)
        dy = torch.zeros(y.shape, dtype=torch.float32)
        dy[valid] = w.reshape(-1)[p][:, None] * g[p // k]
        d_w = torch.zeros(T * k)
        d_w[p] = (g[p // k] * y[valid]).sum(-1)
        return dy if keep_dy else None, quantize_f32_rows(dy), d_w.view(T, k)

    def swiglu_backward(gu, dh, clamp_limit=None, pair=None, values_rows=None):
        gu = gu if pair is None else by_pair(gu, pair)
        inter = gu.shape[1] // 2
        with torch.enable_grad():
            g, u = (t.detach().requires_grad_(True) for t in (gu[:, :inter], gu[:, inter:]))
            h = R.swiglu(g, u, clamp_limit)
            dg, du = torch.autograd.grad(h, (g, u), dh)
        codes = quantize_f32_rows(torch.cat([dg, du], 1))
        if values_rows is None:
            return dg, du, h.detach(), codes
        block_out, out_end, out_rows = values_rows  # each padded 32-row block's values to its output block

        def values(t):
            c, sc = mx.quantize(t.detach().float().t().contiguous(), dim=-1)
            v = mx.dequantize(c, sc, out_dtype=torch.float32).to(torch.bfloat16).t()
            out = torch.zeros(out_rows, t.shape[1], dtype=torch.bfloat16)
            for b, ob in enumerate(block_out.tolist()):
                if ob >= 0:
                    assert ob * 32 < int(out_end)
                    out[ob * 32:ob * 32 + 32] = v[b * 32:b * 32 + 32]
            return out

        return values(dg), values(du), values(h), codes

    for name, fn in (("mx_gemm", gemm), ("mx_grouped_gemm", grouped), ("mx_bf16_math_grouped_gemm", bf16_grouped),
                     ("mx_bf16_math_swiglu_gemm", swiglu_gemm), ("mx_bf16_math_combine1_gemm", combine1_gemm), ("quantize_rows", quantize_rows),
                     ("swiglu_quantize", swiglu_quantize), ("combine", combine),
                     ("quantize_f32_rows", quantize_f32_rows), ("quantize_cols", quantize_cols),
                     ("combine_backward", combine_backward), ("swiglu_backward", swiglu_backward),
                     ("mx_bf16_math_raw_gemm", raw_gemm)):
        monkeypatch.setattr(mx_gemm, name, fn)


def _cpu_problem(T=96, H=256, I=256, E=4, k=2, seed=0, skew=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    scores = torch.rand(T, E, generator=gen)
    if skew:  # expert 0 takes most rows, the last none
        scores[:, 0] += 0.7
        scores[:, E - 1] = -1.0
    ids = scores.topk(k, dim=-1).indices
    w = torch.rand(T, k, generator=gen)
    w = w / w.sum(-1, keepdim=True)
    wg, wu = (torch.randn(E, I, H, generator=gen) * H**-0.5 for _ in range(2))
    wd = torch.randn(E, H, I, generator=gen) * I**-0.5
    return x, ids, w, wg, wu, wd


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("skew, clamp", [(False, None), (True, 1.5)])
def test_forward_orchestration_matches_the_mx_oracle(emulated, skew, clamp):
    from mokgen import reference as R

    x, ids, w, wg, wu, wd = _cpu_problem(skew=skew)
    out = mx_experts.experts_forward(x, ids, w, mx_experts.quantize_weights(wg, wu, wd), clamp)
    oracle = R.mx_experts_forward(x, ids, w, wg, wu, wd, clamp_limit=clamp, acc_dtype=torch.float64)
    assert out.dtype == torch.bfloat16 and _rel(out, oracle) < 4e-3  # the bf16 output's rounding


@pytest.mark.parametrize("stages", ["torch", "fused"])
@pytest.mark.parametrize("skew, clamp, k", [(False, None, 2), (True, 1.5, 2), (False, 1.5, 1), (False, None, 3)])
def test_backward_orchestration_matches_the_mx_oracle_gradients(emulated, monkeypatch, skew, clamp, k, stages):
    """Every gradient of experts_forward_train (the kernels emulated exactly) against the float64 MX
    oracle's autograd: the transposed quantizations, the SwiGLU backward, the per-expert row
    blocks of the weight gradients and the combine's gradients all have to agree. Both forms of
    the elementwise stages (MOKGEN_MX_BWD_STAGES); fused, k = 1 takes dx from the dgrad GEMM's
    combine epilogue, k > 1 from the combine kernel."""
    from mokgen import reference as R

    monkeypatch.setenv("MOKGEN_MX_BWD_STAGES", stages)
    x, ids, w, wg, wu, wd = _cpu_problem(skew=skew, seed=1, k=k)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    out = mx_experts.experts_forward_train(leaves[0], ids, *leaves[1:], clamp_limit=clamp)
    out.backward(d_out)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    ref = R.mx_experts_forward(ref_leaves[0], ids, ref_leaves[1], *ref_leaves[2:], clamp_limit=clamp,
                               acc_dtype=torch.float64)
    ref.backward(d_out.double())
    assert _rel(out, ref) < 4e-3
    # x's gradient is rounded to bf16 (about 2e-3); the others stay float32 and agree to float32's
    # precision (1e-8 seen). Dgrad weights quantized along the forward's K instead put them 8e-3 to
    # 2e-2 off.
    for name, got, want in zip(("x", "topk_weights", "w_gate", "w_up", "w_down"), leaves, ref_leaves):
        assert got.grad is not None and got.grad.dtype == got.dtype, name
        assert _rel(got.grad, want.grad) < (4e-3 if name == "x" else 1e-5), (name, _rel(got.grad, want.grad))
    # a skewed routing leaves the last expert without rows: its weight gradients are zeros
    if skew:
        assert not leaves[2].grad[-1].any() and not leaves[4].grad[-1].any()


def test_the_mx_megakernels_autograd_node_returns_the_staged_experts_gradients(emulated):
    """mokgen.ep._MXTraining, the node an MXFP8 megakernel launch gets under autograd: its outputs
    are the launch's own (called once, under no_grad), and its backward gives, for every rank,
    the gradients experts_forward_train gives on the ranks' tokens concatenated in rank order,
    bit for bit (the kernels emulated), with an empty rank, an output without a gradient and
    bf16 routing weights; a launch without tokens gets zero gradients."""
    from mokgen import ep

    x, ids, w, wg, wu, wd = _cpu_problem(T=120, seed=3)
    w = w.to(torch.bfloat16)
    sizes = [50, 0, 70]
    xs, idss, ws = (list(t.split(sizes)) for t in (x, ids, w))
    d_outs = [torch.randn(n, x.shape[1], generator=torch.Generator().manual_seed(4 + i)).to(torch.bfloat16)
              for i, n in enumerate(sizes)]
    calls = []

    def launch():  # the megakernel's stand-in: any per-rank outputs, recorded
        calls.append(torch.is_grad_enabled())
        return [torch.full((n, x.shape[1]), float(i + 1), dtype=torch.bfloat16) for i, n in enumerate(sizes)]

    leaves = [[t.clone().requires_grad_(True) for t in ts] for ts in (xs, ws)]
    wts = [t.clone().requires_grad_(True) for t in (wg, wu, wd)]
    kernel = type("K", (), {"CLAMP_LIMIT": 1.5})
    outs = ep._mx_train(kernel, launch, leaves[0], idss, leaves[1], *wts)
    assert calls == [False]
    assert all(torch.equal(o, e) for o, e in zip(outs, launch()))
    # rank 2's output unused: its gradient is None, taken as zeros
    torch.autograd.backward(outs[:2], d_outs[:2])

    ref = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    out = mx_experts.experts_forward_train(ref[0], ids, ref[1], *ref[2:], clamp_limit=1.5)
    out.backward(torch.cat([d_outs[0], d_outs[1], torch.zeros_like(d_outs[2])]))
    assert torch.equal(torch.cat([t.grad for t in leaves[0]]), ref[0].grad)
    assert all(t.grad.dtype == torch.bfloat16 for t in leaves[1])
    assert torch.equal(torch.cat([t.grad for t in leaves[1]]), ref[1].grad)
    for got, want in zip(wts, ref[2:]):
        assert torch.equal(got.grad, want.grad)

    # no token on any rank: zero gradients, no staged call
    empty = [torch.zeros(0, x.shape[1], dtype=torch.bfloat16, requires_grad=True)]
    wts = [t.clone().requires_grad_(True) for t in (wg, wu, wd)]
    out = ep._mx_train(kernel, lambda: [torch.zeros(0, x.shape[1], dtype=torch.bfloat16)], empty,
                       [ids[:0]], [w[:0].clone().requires_grad_(True)], *wts)[0]
    out.sum().backward()
    assert all(t.grad is not None and not t.grad.any() for t in wts)


@pytest.mark.parametrize("stages", ["torch", "fused"])
def test_the_mx_node_under_the_save_policy_starts_from_the_launchs_rows(emulated, monkeypatch, stages):
    """mokgen.ep._MXTraining when the launch saved its rows (save_gu, then the combine slots'
    copy): the backward runs no forward (nor does a retained graph's second backward, which gives
    the same gradients), and its gradients, every rank's, are the staged
    backward's on those rows (each pair's gate | up and expert output rows, bf16, here the staged
    forward's rounded) in the padded layout, bit for bit, in both stage forms; and they stay near
    the float64 MX oracle's: g and u rounded to bf16 move some of [dg | du]'s E4M3 codes by one
    step (1.2e-2 to 2.8e-2 off here on this small problem, the float32 rows' 4e-3 or less), inside
    the MX format's own error against unquantized math (8e-2); wrong rows would be off by about 1."""
    from mokgen import ep
    from mokgen import reference as R

    monkeypatch.setenv("MOKGEN_MX_BWD_STAGES", stages)
    x, ids, w, wg, wu, wd = _cpu_problem(T=120, seed=7, skew=True)
    sizes = [50, 0, 70]
    T, k = ids.shape
    weights = mx_experts.quantize_weights(wg, wu, wd, interleave=False)
    _, saved = mx_experts._forward(x, ids, w, weights, 1.5, "bf16", keep_gu=True)
    gu_pairs, y_pairs = (t[saved.row].to(torch.bfloat16) for t in (saved.gu, saved.y))  # what a launch keeps
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)

    forwards = []
    real_forward = mx_experts._forward
    monkeypatch.setattr(mx_experts, "_forward", lambda *a, **kw: forwards.append(1) or real_forward(*a, **kw))
    xs, idss, ws = (list(t.split(sizes)) for t in (x, ids, w))
    leaves = [[t.clone().requires_grad_(True) for t in ts] for ts in (xs, ws)]
    wts = [t.clone().requires_grad_(True) for t in (wg, wu, wd)]
    kernel = type("K", (), {"CLAMP_LIMIT": 1.5})
    outs = ep._mx_train(kernel, lambda: [torch.zeros(n, x.shape[1], dtype=torch.bfloat16) for n in sizes] + [gu_pairs],
                        leaves[0], idss, leaves[1], *wts, slots=lambda: y_pairs)
    assert len(outs) == len(sizes)  # the saved rows are not an output
    torch.autograd.backward(outs, list(d_out.split(sizes)), retain_graph=True)
    got = [torch.cat([t.grad for t in leaves[0]]), torch.cat([t.grad for t in leaves[1]]), *(t.grad for t in wts)]
    for t in (*leaves[0], *leaves[1], *wts):
        t.grad = None
    torch.autograd.backward(outs, list(d_out.split(sizes)))  # a retained graph's second backward: the same rows
    again = [torch.cat([t.grad for t in leaves[0]]), torch.cat([t.grad for t in leaves[1]]), *(t.grad for t in wts)]
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    assert forwards == []  # nothing recomputed, either time

    rows = saved.gu.shape[0]
    want = mx_experts._backward(d_out, x, w, wg, wu, wd, saved.row, saved.tiles, saved.padded,
                                mx_experts._padded_rows(gu_pairs, saved.row, rows),
                                mx_experts._padded_rows(y_pairs, saved.row, rows), 1.5, "bf16")
    for name, a, b in zip(("x", "topk_weights", "w_gate", "w_up", "w_down"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    R.mx_experts_forward(ref_leaves[0], ids, ref_leaves[1], *ref_leaves[2:], clamp_limit=1.5,
                         acc_dtype=torch.float64).backward(d_out.double())
    for name, a, ref in zip(("x", "topk_weights", "w_gate", "w_up", "w_down"), got, ref_leaves):
        assert _rel(a, ref.grad) < 5e-2, (name, _rel(a, ref.grad))
    assert T * k == gu_pairs.shape[0]


@pytest.mark.parametrize("inter", [256, 128])
def test_the_mx_node_recomputes_with_the_layers_cached_conversions(emulated, monkeypatch, inter):
    """The node's recompute takes the weights' MX values from the MXFP8 layer's cache
    (mokgen.ep._MX_WEIGHTS) where it holds them at the weights' current versions, instead of
    quantizing the weights again: the same gradients bit for bit (I = 256: gate and up apart,
    two GEMMs into gu's halves; I = 128: stacked by a copy); after an in-place change the cache is
    stale and the weights are quantized again."""
    from mokgen import ep

    x, ids, w, wg, wu, wd = _cpu_problem(T=64, I=inter, seed=5)
    parts = []
    real_grouped = mx_gemm.mx_bf16_math_grouped_gemm
    monkeypatch.setattr(mx_gemm, "mx_bf16_math_grouped_gemm",
                        lambda *a, out=None: parts.append(out is not None) or real_grouped(*a, out=out))
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    kernel = type("K", (), {"CLAMP_LIMIT": None})
    quantized = []
    real = mx_experts.quantize_weights
    monkeypatch.setattr(mx_experts, "quantize_weights", lambda *a, **kw: quantized.append(1) or real(*a, **kw))

    def grads(wts):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = ep._mx_train(kernel, lambda: [torch.zeros_like(x)], [xl], [ids], [wl], *wts)[0]
        out.backward(d_out)
        return [xl.grad, wl.grad, *(t.grad for t in wts)]

    wts = [t.clone().requires_grad_(True) for t in (wg, wu, wd)]
    want = grads(wts)
    assert quantized == [1]  # nothing cached: the recompute quantized the weights
    try:
        for t in wts:  # what the layer's launch leaves in the cache (the emulated conversion)
            ep._MX_WEIGHTS[t] = (t._version, mx_experts._decoded_stack(*mx.quantize_experts(t.detach())))
        for t in wts:
            t.grad = None
        parts.clear()
        got = grads(wts)
        assert quantized == [1]  # taken from the cache
        assert parts.count(True) == (2 if inter == 256 else 0)  # gate and up apart, into gu's halves
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        with torch.no_grad():
            wts[2].mul_(1.0)  # an in-place change: a new version, the entry is stale
        for t in wts:
            t.grad = None
        assert all(torch.equal(a, b) for a, b in zip(grads(wts), want)) and quantized == [1, 1]
    finally:
        ep.refresh_mx_weights()


@pytest.mark.nvcc
@pytest.mark.parametrize("clamp", [None, 3.0])
def test_the_mx_swiglu_gradient_is_pytorchs_autograd(tmp_path, host_check, clamp):
    """swiglu_grad.cuh's swiglu_grad_exact (mx_gemm.swiglu_backward's element math), compiled for
    the host by tests/host/swiglu_check.cu, against reference.swiglu under PyTorch's float32
    autograd: h, dg, du within a few roundings of each term's size (PyTorch's CPU kernels have
    their own exp and contractions), NaN exactly where PyTorch has NaN, and the clamp's zeros
    exactly where PyTorch's (a NaN gate passes no gradient through the clamp, an input at the
    limit passes it)."""
    import subprocess

    from mokgen import reference as R

    exe = host_check("swiglu_check")
    gen = torch.Generator().manual_seed(7)
    n = 20000
    g, u, dh = torch.randn(n, generator=gen) * 5, torch.randn(n, generator=gen) * 5, torch.randn(n, generator=gen)
    g[:6] = torch.tensor([-100.0, 100.0, 0.0, float("nan"), 3.0, -1.2785])  # exp's overflow, NaN, the limit
    u[6:9] = torch.tensor([float("nan"), -3.0, 3.0])
    limit = torch.full((n,), clamp if clamp is not None else 0.0)
    (tmp_path / "in.bin").write_bytes(torch.stack([g, u, dh, limit], 1).contiguous().numpy().tobytes())
    run = subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin"), "exact"], capture_output=True)
    assert run.returncode == 0, run
    got = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).view(n, 3)
    with torch.enable_grad():
        G, U = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
        h = R.swiglu(G, U, clamp)
        dg, du = torch.autograd.grad(h, (G, U), dh)
    gc, uc = (g, u) if clamp is None else (g.clamp(max=clamp), u.clamp(-clamp, clamp))
    sizes = ((gc * uc).abs(), (dh * uc).abs() * (1 + gc.abs()), (dh * gc).abs())
    for i, (name, want, size) in enumerate(zip(("h", "dg", "du"), (h.detach(), dg, du), sizes)):
        a = got[:, i]
        assert torch.equal(a.isnan(), want.isnan()), name
        ok = ~want.isnan()
        assert torch.equal(a[ok] == 0, want[ok] == 0), name  # the clamp's masks and the tails' zeros
        assert ((a[ok] == want[ok]) | ((a[ok] - want[ok]).abs() <= 1e-6 * size[ok])).all(), name  # size NaN: a NaN gate


@pytest.mark.parametrize("policy", ["save", "recompute"])
def test_the_mx_layers_both_orientations_serve_its_backward(emulated, monkeypatch, policy):
    """MOKGEN_MX_WEIGHTS=both on the MXFP8 layer's path (v0.65, mokgen.ep._mx_both): a training
    launch's conversions read each weight once for both orientations (expert_weights_both, the
    forward's per tensor) and cache both, so the backward quantizes no weight, under either
    backward policy, with apart's gradients bit for bit. A second step on the same weights (a
    micro-batch) converts nothing; an in-place change converts again; a launch outside autograd
    makes only the forward's conversions; refresh_mx_weights forgets both."""
    from mokgen import ep

    x, ids, w, wg, wu, wd = _cpu_problem(T=64, seed=11)
    wg, wu, wd = (t.to(torch.bfloat16) for t in (wg, wu, wd))
    T, k = ids.shape
    E, I, H = wg.shape
    calls = []
    real_transposed = mx_experts._transposed_weights

    def rows_of(p):  # expert_weights([p]) as the CPU expression (the kernel's bits)
        return mx_experts._decoded_stack(*mx.quantize_experts(p.float()))

    def expert_weights(parts, transpose=False, codes=False, interleave=False):
        assert not (transpose or codes or interleave) and len(parts) == 1
        calls.append("rows")
        return rows_of(parts[0])

    def both(parts, apart=False):
        assert apart
        calls.append(("both", len(parts)))
        return [rows_of(p) for p in parts], real_transposed([p.float() for p in parts], "bf16", 0)[0]

    monkeypatch.setattr(mx_gemm, "expert_weights", expert_weights)
    monkeypatch.setattr(mx_gemm, "expert_weights_both", both)
    monkeypatch.setattr(mx_gemm, "both_applies", lambda parts: True)
    monkeypatch.setattr(mx_experts, "_transposed_weights",
                        lambda *a, **kw: calls.append("transposed") or real_transposed(*a, **kw))
    monkeypatch.setattr(mx_experts, "quantize_weights", lambda *a, **kw: pytest.fail("the weights quantized again"))
    kernel = type("K", (), {"CLAMP_LIMIT": 1.5, "NUMERICS": "mxfp8"})
    staged = mx_experts.MXExpertWeights(None, None, None, None, None, rows_of(wd), False,
                                        gate_up_parts=(rows_of(wg), rows_of(wu)))
    _, saved = mx_experts._forward(x, ids, w, staged, 1.5, "bf16", keep_gu=True)
    gu_pairs, y_pairs = (t[saved.row].to(torch.bfloat16) for t in (saved.gu, saved.y))
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    out_rows = [torch.zeros(T, H, dtype=torch.bfloat16)] + ([gu_pairs] if policy == "save" else [])

    def step(wts, mode):
        monkeypatch.setenv("MOKGEN_MX_WEIGHTS", mode)
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ep._weights_for(kernel, *wts, train=True)
        out = ep._mx_train(kernel, lambda: list(out_rows), [xl], [ids], [wl], *wts,
                           slots=(lambda: y_pairs) if policy == "save" else None)[0]
        out.backward(d_out)
        got = [xl.grad, wl.grad, *(t.grad for t in wts)]
        for t in wts:
            t.grad = None
        return got

    try:
        wts = [t.clone().requires_grad_(True) for t in (wg, wu, wd)]
        want = step(wts, "apart")
        assert calls == ["rows"] * 3 + ["transposed"] * 2  # the forward's three, the backward's two
        ep.refresh_mx_weights()
        calls.clear()
        got = step(wts, "both")
        assert calls == [("both", 1), ("both", 2)]  # w_down, then w_gate with w_up; nothing in the backward
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        calls.clear()
        assert all(torch.equal(a, b) for a, b in zip(step(wts, "both"), want)) and calls == []  # a micro-batch
        with torch.no_grad():
            wts[1].mul_(1.0)  # an in-place change: a new version of w_up
        assert ep._mx_transposed(*wts) is None
        assert all(torch.equal(a, b) for a, b in zip(step(wts, "both"), want))
        assert calls == [("both", 1), ("both", 2)]
        ep.refresh_mx_weights()
        assert ep._mx_transposed(*wts) is None and ep._mx_cached(wts[0]) is None
        calls.clear()
        with torch.no_grad():
            ep._weights_for(kernel, *wts, train=False)  # outside autograd: the forward's only
        assert calls == ["rows"] * 3 and ep._mx_transposed(*wts) is None
    finally:
        ep.refresh_mx_weights()


@pytest.mark.parametrize("skew", [False, True])
def test_rows32_keeps_each_experts_rows_in_blocks_of_32(skew):
    """mx_experts._rows32 (MOKGEN_MX_WGRAD=bf16): the weight gradients' layout with each expert's
    rows padded to 32 instead of 128, against a loop: each new row's padded-layout row and token,
    the experts' inclusive ends, and a fixed length with nothing (-1) past the last expert; an
    expert without rows takes none."""
    x, ids, w, *_ = _cpu_problem(T=150, E=6, k=2, seed=3, skew=skew)
    E = 6
    row, src, _tiles, padded = mx_experts._segments(ids.reshape(-1), E, 2)
    at, tok, offs = mx_experts._rows32(row, padded, src)
    counts = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    want_at, want_ends, start = [], [], 0
    for e in range(E):
        n32 = -(-counts[e] // 32) * 32
        want_at += range(start, start + n32)
        want_ends.append(len(want_at))
        start += int(padded[e])
    length = -(-(ids.numel() + 31 * E) // 32) * 32
    want_at += [-1] * (length - len(want_at))
    assert at.dtype == tok.dtype == offs.dtype == torch.int32
    assert at.tolist() == want_at and offs.tolist() == want_ends
    assert tok.tolist() == [int(src[a]) if a >= 0 else -1 for a in want_at]
    if skew:
        assert counts[E - 1] == 0 and offs[E - 1] == offs[E - 2]
    # every pair's row is kept, each in its expert's range and at the same place in it
    kept = set(at[at >= 0].tolist())
    assert set(row.tolist()) <= kept
    # each padded 32-row block's block in the new layout (v0.66, the SwiGLU backward's values), -1 none
    rows = int(padded.sum())
    bmap = mx_experts._block_map(at, rows)
    want = [-1] * (rows // 32)
    for j in range(len(want_at) // 32):
        if want_at[32 * j] >= 0:
            assert want_at[32 * j] % 32 == 0 and want_at[32 * j:32 * j + 32] == list(range(want_at[32 * j],
                                                                                          want_at[32 * j] + 32))
            want[want_at[32 * j] // 32] = j
    assert bmap.dtype == torch.int32 and bmap.tolist() == want


@pytest.mark.parametrize("stages", ["fused", "torch", "fused-apart"])
@pytest.mark.parametrize("skew", [False, True])
def test_weight_gradients_on_the_bf16_weight_kernels_are_the_mx_products(emulated, monkeypatch, skew, stages):
    """MOKGEN_MX_WGRAD=bf16's orchestration on the CPU under each way to its operands (the fused
    stages making their values, v0.66; the torch stages; the fused stages with the values made
    apart by rows_values, v0.65) (mx_gemm.rows_values and the BF16 weight
    kernels emulated exactly): the operands' MX values laid out with each expert padded to 32 rows
    (mx_experts._rows32), x's rows through their tokens, each weight gradient in its weight's
    orientation. Against the default path (the MX product per expert, emulated in float64): x's
    and the routing weights' gradients the same bits, the weights' within one bf16 rounding (the
    emulations round float64 sums to bf16 directly or through float32)."""
    from mokgen import bwd_gemm

    f64 = torch.float64

    def rows_values(x, src=None, scale=None):
        if src is not None:
            x = torch.where((src >= 0)[:, None], x[src.clamp(min=0).long()], torch.zeros((), dtype=x.dtype))
        if scale is not None:  # the kernel's one float32 product a element (w dOut's bits)
            assert x.dtype == torch.bfloat16 and src is not None
            x = scale[:, None] * x.float()
        codes, scales = mx.quantize(x.float().t().contiguous(), dim=-1)
        return mx.dequantize(codes, scales, out_dtype=torch.float32).to(torch.bfloat16).t().contiguous()

    def per_expert(a, b, offs):
        out = torch.zeros(offs.shape[0], a.shape[1], b.shape[1], dtype=f64)
        start = 0
        for e, end in enumerate(offs.tolist()):
            out[e] = a[start:end].to(f64).t() @ b[start:end].to(f64)
            start = end
        return out.to(torch.bfloat16)

    calls = []
    monkeypatch.setattr(mx_gemm, "rows_values",
                        lambda x, src=None, scale=None: calls.append("values" if scale is None else "dy values")
                        or rows_values(x, src, scale))
    monkeypatch.setattr(bwd_gemm, "weight_grads", lambda a, b, offs: calls.append("wd") or per_expert(a, b, offs))
    monkeypatch.setattr(bwd_gemm, "weight_grads_joint",
                        lambda a0, a1, b, offs: calls.append("joint") or (per_expert(a0, b, offs),
                                                                          per_expert(a1, b, offs)))
    monkeypatch.setenv("MOKGEN_MX_BWD_STAGES", stages.split("-")[0])
    # fused-apart: the operands' values by rows_values from the stages' float32 rows (v0.65's way)
    monkeypatch.setenv("MOKGEN_MX_WGRAD_OPERANDS", "apart" if stages == "fused-apart" else "fused")
    x, ids, w, wg, wu, wd = _cpu_problem(T=150, E=4, seed=13, skew=skew)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)

    def grads(on):
        monkeypatch.setattr(mx_experts, "_wgrad_bf16", lambda *a: on)
        leaves = [t.clone().requires_grad_(True) for t in (x, w, wg.to(torch.bfloat16), wu.to(torch.bfloat16),
                                                            wd.to(torch.bfloat16))]
        mx_experts.experts_forward_train(leaves[0], ids, *leaves[1:], clamp_limit=1.5).backward(d_out)
        return [t.grad for t in leaves]

    want = grads(False)
    assert calls == []
    got = grads(True)
    # the fused stages (the default): dy's values from dOut and the routing weights, h's, dg's and
    # du's from the SwiGLU backward, no float32 copy of any
    if stages == "fused":
        assert calls == ["dy values", "wd", "values", "joint"]
    else:
        assert calls == ["values", "values", "wd", "values", "values", "values", "joint"]
    for name, a, b in zip(("x", "topk_weights"), got[:2], want[:2]):
        assert torch.equal(a, b), name
    for name, a, b in zip(("w_gate", "w_up", "w_down"), got[2:], want[2:]):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape, name
        # one bf16 rounding apart at most, element by element
        assert ((a.double() - b.double()).abs() <= b.double().abs() * 2**-7 + 1e-30).all(), name
        assert _rel(a, b) < 1e-2 and b.abs().sum() > 0, name


@pytest.mark.parametrize("stages", ["fused", "torch"])
@pytest.mark.parametrize("k, skew", [(1, False), (2, True), (3, False)])
def test_raw_dgrad_weights_read_the_weights_as_held(emulated, monkeypatch, k, skew, stages):
    """MOKGEN_MX_DGRAD_WEIGHTS=raw's orchestration on the CPU (the raw-weights GEMM emulated as the
    transposed quantizer's values times A, exactly): dh from W_down alone and dx from W_gate and
    W_up stacked, as held (no transposed conversion made), dx's combine fused at k = 1 under the
    fused stages; the same gradients as the values path, bit for bit (the emulations' products are
    the same); and MOKGEN_MX_WEIGHTS=both then converts one orientation only."""
    monkeypatch.setenv("MOKGEN_MX_BWD_STAGES", stages)
    x, ids, w, wg, wu, wd = _cpu_problem(T=120, E=4, k=k, seed=23, skew=skew)
    wg, wu, wd = (t.to(torch.bfloat16) for t in (wg, wu, wd))
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(24)).to(torch.bfloat16)
    raw_gemm, transposed = mx_gemm.mx_bf16_math_raw_gemm, mx_experts._transposed_weights
    calls = []

    def recorded_raw(a, sa, parts, tiles, combine=None):
        calls.append(("raw", tuple(p.data_ptr() for p in parts), combine is not None))
        return raw_gemm(a, sa, parts, tiles, combine=combine)

    monkeypatch.setattr(mx_gemm, "mx_bf16_math_raw_gemm", recorded_raw)
    monkeypatch.setattr(mx_experts, "_transposed_weights", lambda *a: calls.append("transposed") or transposed(*a))

    def grads(value):
        monkeypatch.setenv("MOKGEN_MX_DGRAD_WEIGHTS", value)
        calls.clear()
        leaves = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
        mx_experts.experts_forward_train(leaves[0], ids, *leaves[1:], clamp_limit=1.5).backward(d_out)
        return leaves, [t.grad for t in leaves]

    _, want = grads("values")
    assert calls == ["transposed", "transposed"]
    # the raw path takes GPU weights only (test_raw_dgrad_weights_switch_and_where_it_applies)
    monkeypatch.setattr(mx_experts, "_raw_dgrads", lambda form, *ws: env.mx_dgrad_weights() == "raw")
    leaves, got = grads("raw")
    fused1 = stages == "fused" and k == 1
    assert calls == [("raw", (leaves[4].data_ptr(),), False),
                     ("raw", (leaves[2].data_ptr(), leaves[3].data_ptr()), fused1)], calls
    for name, a, b in zip(("x", "topk_weights", "w_gate", "w_up", "w_down"), got, want):
        assert torch.equal(a, b), name


def test_raw_dgrad_weights_switch_and_where_it_applies(monkeypatch):
    """The switch's values (others refused), the shapes the raw-weights GEMM takes (one or two bf16
    [E, k_i, N] parts, N % 256, k_i % 64, their sum % 128), and no raw dgrads off the GPU or on the
    FP8 forms."""
    from mokgen.errors import ToolchainError

    assert env.mx_dgrad_weights() == "values"
    monkeypatch.setenv("MOKGEN_MX_DGRAD_WEIGHTS", "raw")
    assert env.mx_dgrad_weights() == "raw"
    bf = torch.bfloat16
    wg, wu, wd = torch.zeros(2, 256, 512, dtype=bf), torch.zeros(2, 256, 512, dtype=bf), torch.zeros(2, 512, 256, dtype=bf)
    assert mx_gemm.raw_weights_apply([wd]) and mx_gemm.raw_weights_apply([wg, wu])
    assert not mx_experts._raw_dgrads("bf16", wg, wu, wd)  # CPU tensors
    assert not mx_gemm.raw_weights_apply([torch.zeros(2, 256, 384, dtype=bf)])  # N % 256
    assert not mx_gemm.raw_weights_apply([torch.zeros(2, 96, 256, dtype=bf)])   # k % 64
    assert not mx_gemm.raw_weights_apply([torch.zeros(2, 64, 256, dtype=bf)] * 3)  # at most two parts
    assert not mx_gemm.raw_weights_apply([])
    assert not mx_gemm.raw_weights_apply([torch.zeros(2, 64, 256, dtype=bf), torch.zeros(2, 128, 256, dtype=bf)])
    assert not mx_gemm.raw_weights_apply([torch.zeros(2, 256, 256)])  # float32
    import types

    def on_gpu(t):  # what _raw_dgrads reads of a CUDA tensor
        return types.SimpleNamespace(dtype=t.dtype, dim=t.dim, shape=t.shape, device="cuda:0", is_cuda=True)

    assert mx_experts._raw_dgrads("bf16", on_gpu(wg), on_gpu(wu), on_gpu(wd))
    assert not mx_experts._raw_dgrads("quad", on_gpu(wg), on_gpu(wu), on_gpu(wd))
    assert not mx_experts._raw_dgrads("bf16", on_gpu(wg), on_gpu(wu[:, :, :256]), on_gpu(wd))  # N differs
    monkeypatch.setenv("MOKGEN_MX_DGRAD_WEIGHTS", "values")
    assert not mx_experts._raw_dgrads("bf16", on_gpu(wg), on_gpu(wu), on_gpu(wd))
    monkeypatch.setenv("MOKGEN_MX_DGRAD_WEIGHTS", "fast")
    with pytest.raises(ToolchainError, match="^MOKGEN_MX_DGRAD_WEIGHTS must be values or raw, got 'fast'$"):
        env.mx_dgrad_weights()
