"""mokgen's backward GEMMs on the GPU (mokgen/bwd_gemm.py): the rows GEMMs and the weight
gradients against fp32 PyTorch per expert, ragged and empty experts, bitwise repeats, and the
experts' backward with MOKGEN_BWD_GEMM=1 against the reference's autograd."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mokgen import bench, bwd_gemm, env, reference  # noqa: E402
from mokgen.backward import experts_backward  # noqa: E402
from mokgen.errors import InputError  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc, pytest.mark.usefixtures("gpu_memory")]

# experts with no rows, one row, rows not a multiple of 64 or 128, and a last expert that ends
# before the operands do (rows past offs[-1])
COUNTS = [0, 1, 130, 257, 64, 0, 65]
SPARE_ROWS = 7


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _offs(counts):
    return torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)


def _randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)


@pytest.mark.parametrize("b_major, pairs", [("mn", 1), ("mn", 2), ("k", 1)])
def test_rows_gemm_matches_fp32_per_expert(b_major, pairs):
    gen = torch.Generator(device="cuda").manual_seed(3)
    E, K, N = len(COUNTS), 512, 768
    rows = sum(COUNTS) + SPARE_ROWS
    ops = [(_randn(rows, K, gen=gen), _randn(E, K, N, gen=gen, scale=K**-0.5) if b_major == "mn"
            else _randn(E, N, K, gen=gen, scale=K**-0.5)) for _ in range(pairs)]
    offs = _offs(COUNTS)
    got = bwd_gemm.rows_gemm(ops, offs, b_major=b_major)
    assert got.dtype == torch.float32 and got.shape == (rows, N)
    want = torch.zeros(rows, N, device="cuda")
    start = 0
    for e, c in enumerate(COUNTS):
        for a, b in ops:
            w = b[e].float() if b_major == "mn" else b[e].float().t()
            want[start:start + c] += a[start:start + c].float() @ w
        start += c
    assert _rel(got, want) < 1e-4
    assert torch.equal(got[sum(COUNTS):], torch.zeros_like(got[sum(COUNTS):]))  # rows past offs[-1]
    again = bwd_gemm.rows_gemm(ops, offs, b_major=b_major)
    assert torch.equal(got, again)


@pytest.mark.parametrize("b_major, n_pairs, N", [("mn", 1, 1024), ("mn", 2, 512), ("k", 1, 1024), ("mn", 1, 768)],
                         ids=["mn-one-pair", "mn-two-pairs", "k-major", "odd-column-tiles"])
def test_rows_gemm_pairs_give_the_bits_of_single_ctas(b_major, n_pairs, N):
    """CTA pairs (cluster=2: column tiles n, n + 1 of one row block share A by TMA multicast) walk
    the same tiles and k-blocks as single CTAs, so the bits are the same: plain fp32 out, and the
    scatter through a map in fp32 and bf16; many experts (empty ones, one-row ones, ragged last
    row blocks). N / 256 odd (768) falls back to single CTAs."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    counts = torch.randint(0, 400, (30,), generator=torch.Generator().manual_seed(17)).tolist()
    counts[2] = counts[11] = 0
    counts[4] = 1
    E, K = len(counts), 512
    rows = sum(counts) + SPARE_ROWS
    offs = _offs(counts)
    shape = (E, K, N) if b_major == "mn" else (E, N, K)
    ops = [(_randn(rows, K, gen=gen), _randn(*shape, gen=gen, scale=K**-0.5)) for _ in range(n_pairs)]
    single = bwd_gemm.rows_gemm(ops, offs, b_major=b_major, cluster=1)
    for _ in range(3):
        assert torch.equal(bwd_gemm.rows_gemm(ops, offs, b_major=b_major, cluster=2), single)
    order = torch.randperm(rows, generator=gen, device="cuda")
    dtypes = (torch.float32, torch.bfloat16) if b_major == "mn" else (torch.float32,)
    for dtype in dtypes:
        outs = []
        for cluster in (1, 2):
            out = torch.full((rows, N), float("nan"), dtype=dtype, device="cuda")
            outs.append(bwd_gemm.rows_gemm(ops, offs, b_major=b_major, out=out, out_rows=order, cluster=cluster))
        assert torch.equal(outs[0], outs[1]), dtype
        assert torch.equal(outs[0][order], single.to(dtype)), dtype
    s0 = sum(counts[:7])
    b7 = ops[0][1][7].float() if b_major == "mn" else ops[0][1][7].float().t()
    want = ops[0][0][s0:s0 + counts[7]].float() @ b7
    if n_pairs == 1:
        assert _rel(single[s0:s0 + counts[7]], want) < 1e-2


def test_rows_gemm_bands_give_the_same_bits(monkeypatch):
    """The rows GEMMs' tile walk by bands of row blocks (MOKGEN_BWD_ROW_BAND, v0.43: column tile
    by column tile within a band) changes which CTA computes a tile and when, not the tile's k
    order: bands 1 (v0.42's order), 3, 8 (the default) and 64 give the same bits, for single CTAs
    and CTA pairs, one and two pairs of operands, plain, scattered through a map and with A's rows
    gathered through an index; experts of up to 19 row blocks (several bands, a short last one),
    empty ones and one-row ones."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    counts = [0, 1, 2400, 130, 0, 700, 1023, 5, 256]
    E, K, N = len(counts), 256, 1024
    rows = sum(counts) + SPARE_ROWS
    offs = _offs(counts)
    ops = [(_randn(rows, K, gen=gen), _randn(E, K, N, gen=gen, scale=K**-0.5)) for _ in range(2)]
    order = torch.randperm(rows, generator=gen, device="cuda")
    a_index = torch.randint(0, rows, (rows,), generator=gen, device="cuda")

    def run():
        got = [bwd_gemm.rows_gemm(ops[:1], offs, a_index=a_index)]  # A's rows gathered by the kernel
        for cluster in (1, 2):
            got += [bwd_gemm.rows_gemm(ops[:1], offs, cluster=cluster), bwd_gemm.rows_gemm(ops, offs, cluster=cluster)]
            out = torch.full((rows, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            got.append(bwd_gemm.rows_gemm(ops, offs, out=out, out_rows=order, cluster=cluster))
        return got

    monkeypatch.setenv("MOKGEN_BWD_ROW_BAND", "1")
    first = run()
    assert torch.equal(first[1], first[4]) and torch.equal(first[2], first[5])  # single CTAs and pairs alike
    for band in ("3", "8", "64"):
        monkeypatch.setenv("MOKGEN_BWD_ROW_BAND", band)
        assert all(torch.equal(p, q) for p, q in zip(run(), first)), band
    monkeypatch.delenv("MOKGEN_BWD_ROW_BAND")
    assert all(torch.equal(p, q) for p, q in zip(run(), first)), "default"
    s0 = sum(counts[:2])  # expert 2's rows against their fp32 product
    assert _rel(first[1][s0:s0 + counts[2]], ops[0][0][s0:s0 + counts[2]].float() @ ops[0][1][2].float()) < 1e-2


@pytest.mark.parametrize("clamp", [None, 0.25], ids=["no-clamp", "clamp"])
def test_dh_swiglu_saved_has_the_bits_of_the_two_passes(clamp):
    """dSwiGLU in the dh GEMM's epilogue (the "save" policy's default) against the dh GEMM's fp32
    dh_u and the elementwise pass over it: hw, dg and du bit for bit (the same float operations
    on the same fp32 sums), zeros from offs[-1] on; d_wt (per 256 columns, then the tiles in
    order) within rounding of the per-row sum, and the same on every run. Empty experts, one-row
    experts, pairs taken through a permutation of more saved rows than rows."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    counts = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(21)).tolist()
    counts[1] = counts[9] = 0
    counts[3] = 1
    E, H, I = len(counts), 512, 768
    rows = sum(counts) + SPARE_ROWS
    offs = _offs(counts)
    go = _randn(rows, H, gen=gen)
    w_down = _randn(E, H, I, gen=gen, scale=H**-0.5)
    gu = _randn(rows + 5, 2 * I, gen=gen)
    order = torch.randperm(rows + 5, generator=gen, device="cuda")[:rows].contiguous()
    wt = torch.rand(rows, generator=gen, device="cuda")
    dh_u = bwd_gemm.rows_gemm([(go, w_down)], offs, b_major="mn", cluster=1)
    want = bwd_gemm.swiglu_grads_saved(gu, order, dh_u, wt, offs, clamp)
    got = bwd_gemm.dh_swiglu_saved(go, w_down, gu, order, wt, offs, clamp)
    for name, a, b in zip(("hw", "dg", "du"), got[:3], want[:3]):
        assert torch.equal(a, b), name
        assert torch.equal(a[sum(counts):], torch.zeros_like(a[sum(counts):])), name
    assert torch.allclose(got[3], want[3], rtol=1e-5, atol=1e-5 * want[3].abs().max().item())
    assert torch.equal(got[3][sum(counts):], torch.zeros_like(got[3][sum(counts):]))
    for _ in range(3):
        again = bwd_gemm.dh_swiglu_saved(go, w_down, gu, order, wt, offs, clamp)
        assert all(torch.equal(p, q) for p, q in zip(again, got))
    # go's rows through an index into a larger source (dOut's token rows): the same bits as the copy
    src = _randn(rows + 37, H, gen=gen)
    tok = torch.randint(0, rows + 37, (rows,), generator=gen, device="cuda")
    gathered = bwd_gemm.dh_swiglu_saved(src.index_select(0, tok).contiguous(), w_down, gu, order, wt, offs, clamp)
    inline = bwd_gemm.dh_swiglu_saved(src, w_down, gu, order, wt, offs, clamp, a_index=tok)
    assert all(torch.equal(p, q) for p, q in zip(inline, gathered))
    with pytest.raises(InputError, match="a_index must be a contiguous int64"):
        bwd_gemm.dh_swiglu_saved(src, w_down, gu, order, wt, offs, clamp, a_index=tok.int())
    with pytest.raises(InputError, match="I % 256 == 0"):
        bwd_gemm.dh_swiglu_saved(go, w_down[:, :, :640].contiguous(), gu[:, :1280].contiguous(), order, wt, offs)
    with pytest.raises(InputError, match=r"gu must be \[pairs, 2 I\]"):
        bwd_gemm.dh_swiglu_saved(go, w_down, gu[:, :I].contiguous(), order, wt, offs)


def test_rows_gemm_scatters_rows_through_a_map():
    """out_rows: row r of the result lands in out row out_rows[r]; the other rows keep their values."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    E, K, N = len(COUNTS), 256, 512
    rows = sum(COUNTS)
    ops = [(_randn(rows, K, gen=gen), _randn(E, K, N, gen=gen, scale=K**-0.5)) for _ in range(2)]
    offs = _offs(COUNTS)
    plain = bwd_gemm.rows_gemm(ops, offs)
    R = rows + 50
    perm = torch.randperm(R, generator=gen, device="cuda")[:rows].contiguous()
    out = torch.full((R, N), 7.0, device="cuda")
    assert bwd_gemm.rows_gemm(ops, offs, out=out, out_rows=perm) is out
    assert torch.equal(out[perm], plain)
    untouched = torch.ones(R, dtype=torch.bool, device="cuda")
    untouched[perm] = False
    assert torch.all(out[untouched] == 7.0)


# last k-blocks of 32, 48 and 16 rows (whole 16-row wgmma steps, nothing to zero), 36 and 17
# (steps 3 and 2, the tail of the last one zeroed), an empty expert
COUNTS_STEPS = [32, 48, 100, 16, 0, 81]


@pytest.mark.parametrize("tail", bwd_gemm.WEIGHT_TAILS)
@pytest.mark.parametrize("schedule", bwd_gemm.WEIGHT_SCHEDULES)
@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("counts", [COUNTS, COUNTS_STEPS], ids=["ragged", "steps"])
def test_weight_grads_match_fp32_per_expert_with_ragged_and_empty_experts(counts, cluster, schedule, tail):
    """Every expert's rows in order; a short last k-block must not pick up the next expert's rows
    (they are in the same TMA box: tail "zero", the kernel zeroes them up to its last 16-row
    wgmma step and skips the steps past it; "tma", the expert's bounded maps make the TMA load
    zeros there), and an expert without rows gets zeros; single CTAs and CTA pairs, both
    schedules."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    E, M, N = len(counts), 256, 512
    rows = sum(counts) + SPARE_ROWS
    a, b = _randn(rows, M, gen=gen), _randn(rows, N, gen=gen)
    offs = _offs(counts)
    got = bwd_gemm.weight_grads(a, b, offs, cluster=cluster, schedule=schedule, tail=tail)
    assert got.dtype == torch.bfloat16 and got.shape == (E, M, N)
    start = 0
    for e, c in enumerate(counts):
        want = a[start:start + c].float().t() @ b[start:start + c].float()
        if c == 0:
            assert torch.equal(got[e], torch.zeros_like(got[e])), f"expert {e} (no rows) is not zero"
        else:
            assert _rel(got[e], want) < 1e-2, f"expert {e} ({c} rows): relative error {_rel(got[e], want):.3e}"
        start += c
    for _ in range(3):
        assert torch.equal(bwd_gemm.weight_grads(a, b, offs, cluster=cluster, schedule=schedule, tail=tail), got)


def _weight_launches(a, a1, b, offs, src_a, a_index, src_b, b_index):
    """Every weight-gradient launch form, as (name, fn(tail) -> tuple of outputs)."""
    out = []
    for schedule in bwd_gemm.WEIGHT_SCHEDULES:
        for cluster in (1, 2):
            out.append((f"{schedule}, cluster {cluster}",
                        lambda tail, s=schedule, c=cluster: (bwd_gemm.weight_grads(a, b, offs, cluster=c, schedule=s,
                                                                                   tail=tail),)))
    for cluster in (1, 2):
        out.append((f"joint, cluster {cluster}",
                    lambda tail, c=cluster: bwd_gemm.weight_grads_joint(a, a1, b, offs, cluster=c, tail=tail)))
    out.append(("A through an index", lambda tail: (bwd_gemm.weight_grads(src_a, b, offs, a_index=a_index,
                                                                          tail=tail),)))
    out.append(("joint, B through an index",
                lambda tail: bwd_gemm.weight_grads_joint(a, a1, src_b, offs, b_index=b_index, tail=tail)))
    return out


def _indexed(t, gen):
    """(src, index): t's rows as rows index[r] of a larger, shuffled src."""
    rows = t.shape[0]
    index = torch.randperm(rows + 29, generator=gen, device="cuda")[:rows]
    src = torch.zeros(rows + 29, t.shape[1], dtype=t.dtype, device="cuda")
    src[index] = t
    return src, index


def test_tma_tail_has_the_bits_of_the_zeroed_tail():
    """The three ways of leaving the next expert's rows out of a short last k-block
    (MOKGEN_BWD_TAIL) add the same products in the same order ("tma" adds the zero-filled steps'
    exact zeros too), so every weight-gradient launch form gives the same bits every way: both
    schedules, single CTAs and pairs, the joint form, and the gathered operands (where the
    gathered operand zero-fills its own rows and the other comes by TMA). The tails alternate
    inside the process, so the library's "steps" setting is switched back and forth."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    counts = COUNTS + COUNTS_STEPS + _ragged_counts(24, 23, (4, 11), 6)
    M, N = 512, 512
    rows = sum(counts) + SPARE_ROWS
    a, a1, b = _randn(rows, M, gen=gen), _randn(rows, M, gen=gen), _randn(rows, N, gen=gen)
    offs = _offs(counts)
    (src_a, a_index), (src_b, b_index) = _indexed(a, gen), _indexed(b, gen)
    for name, fn in _weight_launches(a, a1, b, offs, src_a, a_index, src_b, b_index):
        zero = fn("zero")
        for _ in range(2):
            assert all(torch.equal(p, q) for p, q in zip(fn("tma"), zero)), name
            assert all(torch.equal(p, q) for p, q in zip(fn("steps"), zero)), f"{name} (steps)"


@pytest.mark.parametrize("tail", bwd_gemm.WEIGHT_TAILS)
def test_the_next_experts_inf_rows_stay_out_of_an_expert(tail):
    """Every odd expert's rows (and the rows past the last expert) hold inf and NaN in both
    operands: the even experts' gradients keep the bits of clean operands, in every launch form.
    A short last k-block that multiplied one operand's next-expert rows by the other's zeros
    would make them NaN (0 x inf), and one that read them at all would change the bits."""
    gen = torch.Generator(device="cuda").manual_seed(29)
    counts = [81, 100, 32, 17, 0, 130, 64, 36, 257, 1]
    M, N = 256, 512
    rows = sum(counts) + SPARE_ROWS
    a, a1, b = _randn(rows, M, gen=gen), _randn(rows, M, gen=gen), _randn(rows, N, gen=gen)
    offs = _offs(counts)
    starts = [0] + torch.tensor(counts).cumsum(0).tolist()
    poisoned = torch.zeros(rows, dtype=torch.bool, device="cuda")
    for e in range(1, len(counts), 2):
        poisoned[starts[e]:starts[e + 1]] = True
    poisoned[starts[-1]:] = True
    bad = [t.clone() for t in (a, a1, b)]
    for t in bad:
        t[poisoned] = float("inf")
        t[poisoned, ::3] = float("nan")
    clean = _weight_launches(a, a1, b, offs, *_indexed(a, gen), *_indexed(b, gen))
    dirty = _weight_launches(*bad, offs, *_indexed(bad[0], gen), *_indexed(bad[2], gen))
    for (name, fn_clean), (_, fn_dirty) in zip(clean, dirty):
        for want, got in zip(fn_clean(tail), fn_dirty(tail)):
            for e in range(0, len(counts), 2):
                assert torch.equal(got[e], want[e]), f"{name}: expert {e} ({counts[e]} rows)"


@pytest.mark.parametrize("M, N, experts", [(2048, 768, 40), (384, 512, 7), (128, 256, 300)],
                         ids=["many-tiles", "odd-row-blocks", "many-experts"])
def test_pingpong_weight_grads_have_the_bits_of_the_split_tiles(M, N, experts):
    """The ping-pong (128 x 128 tiles, each one consumer warpgroup's, the CTA's tiles alternating
    between them, each warpgroup stepping over the other's stages) computes every output
    element over the same k order as the split 128 x 256 tile, so the bits are the same, single
    CTAs and pairs. Many tiles per CTA and odd tile counts exercise the turns and the skips;
    empty experts (a turn with no k-block), one-row experts and long ones (more k-blocks than
    the ring has stages: a skip longer than a lap)."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    counts = torch.randint(0, 300, (experts,), generator=torch.Generator().manual_seed(13)).tolist()
    counts[1] = counts[experts - 2] = 0
    counts[2] = 1
    counts[3] = 1000  # 16 k-blocks: more than the ping-pong's six stages
    rows = sum(counts) + SPARE_ROWS
    a, b = _randn(rows, M, gen=gen), _randn(rows, N, gen=gen)
    offs = _offs(counts)
    split = bwd_gemm.weight_grads(a, b, offs, cluster=1, schedule="split")
    for cluster in (1, 2):
        for _ in range(3):
            assert torch.equal(bwd_gemm.weight_grads(a, b, offs, cluster=cluster, schedule="pingpong"), split), cluster
    for e in (0, 1, 2, 3, experts - 1):
        c, s0 = counts[e], sum(counts[:e])
        want = a[s0:s0 + c].float().t() @ b[s0:s0 + c].float()
        assert (c == 0 and torch.equal(split[e], torch.zeros_like(split[e]))) or _rel(split[e], want) < 1e-2, e


def test_staggered_and_lockstep_consumers_give_the_same_bits():
    """The consumer warpgroups' stagger (bwd_gemm.set_stagger, every lead) changes when each warpgroup runs,
    not what it computes: rows GEMMs (one and two pairs), the weight gradients (single CTAs and
    pairs, short last k-blocks) and the fused recompute give the same bits both ways."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    counts = COUNTS + COUNTS_STEPS
    E, K, N, M = len(counts), 512, 768, 256
    rows = sum(counts) + SPARE_ROWS
    offs = _offs(counts)
    ops = [(_randn(rows, K, gen=gen), _randn(E, K, N, gen=gen, scale=K**-0.5)) for _ in range(2)]
    a, b = _randn(rows, M, gen=gen), _randn(rows, N, gen=gen)
    H, I = 512, 256
    x = _randn(rows, H, gen=gen)
    wg, wu = _randn(E, I, H, gen=gen, scale=H**-0.5), _randn(E, I, H, gen=gen, scale=H**-0.5)
    dh_u = torch.randn(rows, I, generator=gen, device="cuda")
    wt = torch.rand(rows, generator=gen, device="cuda")

    def run():
        return [bwd_gemm.rows_gemm(ops[:1], offs), bwd_gemm.rows_gemm(ops, offs),
                bwd_gemm.weight_grads(a, b, offs, cluster=1), bwd_gemm.weight_grads(a, b, offs, cluster=2),
                *bwd_gemm.swiglu_grads(x, wg, wu, dh_u, wt, offs)]

    try:
        bwd_gemm.set_stagger(False)
        lockstep = run()
        for lead in range(1, bwd_gemm.MAX_LEAD + 1):
            bwd_gemm.set_stagger(lead)
            for _ in range(2):
                assert all(torch.equal(p, q) for p, q in zip(run(), lockstep)), f"lead {lead}"
    finally:
        bwd_gemm.set_stagger(True)


def _ragged_counts(experts: int, seed: int, empty: tuple[int, ...], one_row: int) -> list[int]:
    """Rows per expert in 0..299 from ``seed``, the experts ``empty`` without rows and expert
    ``one_row`` with one."""
    counts = torch.randint(0, 300, (experts,), generator=torch.Generator().manual_seed(seed)).tolist()
    for e in empty:
        counts[e] = 0
    counts[one_row] = 1
    return counts


@pytest.mark.parametrize("M", [2048, 384], ids=["pairs", "odd-row-blocks"])
def test_weight_grad_pairs_give_the_bits_of_single_ctas(M):
    """CTA pairs (cluster=2: row blocks m, m + 1 share B by TMA multicast) walk the same tiles and
    k-blocks as single CTAs, so the bits are the same; many experts, so every pair walks many
    tiles (empty experts, rows that end mid-step). M / 128 odd (384) falls back to single CTAs."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    counts = _ragged_counts(40, 9, (3, 17), 5)
    N = 768
    rows = sum(counts) + SPARE_ROWS
    a, b = _randn(rows, M, gen=gen), _randn(rows, N, gen=gen)
    offs = _offs(counts)
    single = bwd_gemm.weight_grads(a, b, offs, cluster=1)
    for _ in range(3):
        assert torch.equal(bwd_gemm.weight_grads(a, b, offs, cluster=2), single)
    for e in (0, 5, 17, 39):
        c = counts[e]
        s0 = sum(counts[:e])
        want = a[s0:s0 + c].float().t() @ b[s0:s0 + c].float()
        assert (c == 0 and torch.equal(single[e], torch.zeros_like(single[e]))) or _rel(single[e], want) < 1e-2


@pytest.mark.parametrize("M, cluster", [(384, 1), (512, 2), (384, 2)], ids=["single", "pairs", "odd-row-blocks"])
def test_joint_weight_grads_have_the_bits_of_two_launches(M, cluster):
    """The gate's and up's weight gradients in one launch (two problems over one B, stacked along
    M, an expert's tiles of both walked together): each output the bits of its own weight_grads
    launch, with empty experts, one-row experts and rows ending mid-step; CTA pairs where M / 128
    is even (384: three row blocks per problem, single CTAs). Each output a contiguous [E, M, N]."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    counts = _ragged_counts(33, 13, (0, 20), 7)
    N = 512
    rows = sum(counts) + SPARE_ROWS
    a0, a1, b = _randn(rows, M, gen=gen), _randn(rows, M, gen=gen), _randn(rows, N, gen=gen)
    offs = _offs(counts)
    want = [bwd_gemm.weight_grads(a, b, offs, cluster=1) for a in (a0, a1)]
    for _ in range(3):
        got = bwd_gemm.weight_grads_joint(a0, a1, b, offs, cluster=cluster)
        for g, w in zip(got, want):
            assert g.shape == (len(counts), M, N) and g.is_contiguous() and torch.equal(g, w)
    assert torch.equal(want[1][20], torch.zeros_like(want[1][20]))
    with pytest.raises(InputError, match="must be \\[rows, M\\]"):
        bwd_gemm.weight_grads_joint(a0, a1[:, :256].contiguous(), b, offs)


@pytest.mark.parametrize("K, H, cluster", [(8, 2048, 1), (8, 7168, 2), (10, 4096, 1), (2, 768, 2), (17, 1024, 1)],
                         ids=["k8", "k8-pairs", "k10", "k2-pairs", "k17"])
def test_slot_sum_in_the_joint_launch_has_the_bits_of_sum_slots(K, H, cluster):
    """MOKGEN_BWD_SUM=side's launch (weight_grads_joint's slot_sum: dX's sum over each token's
    slots done by the producer warpgroup's idle warps): its two weight gradients have the bits of
    the launch without it, and its dx those of sum_slots, bf16 pairs, slots in groups of 8 loads
    (K 2, 8, 10 and 17), CTAs alone and in pairs, tokens not a multiple of the workers; NaN, inf
    and -0.0 rows pass through as sum_slots' do. Bad inputs are one-line errors."""
    gen = torch.Generator(device="cuda").manual_seed(31)
    counts = _ragged_counts(24, 11, (0, 9), 5)
    M, N = 512, 512
    rows = sum(counts) + SPARE_ROWS
    a0, a1, b = _randn(rows, M, gen=gen), _randn(rows, M, gen=gen), _randn(rows, N, gen=gen)
    offs = _offs(counts)
    T = 1237
    pairs = _randn(T * K, H, gen=gen, scale=3.0)
    pairs[5 * K + 1, 3], pairs[9 * K, 8], pairs[11 * K + K - 1, 0] = float("nan"), float("inf"), -0.0
    want_w = bwd_gemm.weight_grads_joint(a0, a1, b, offs, cluster=cluster)
    want_dx = bwd_gemm.sum_slots(pairs, T, K)
    for _ in range(2):
        g0, g1, dx = bwd_gemm.weight_grads_joint(a0, a1, b, offs, cluster=cluster, slot_sum=(pairs, T, K))
        assert torch.equal(g0, want_w[0]) and torch.equal(g1, want_w[1])
        assert dx.shape == (T, H) and dx.dtype == torch.bfloat16
        assert torch.equal(dx.view(torch.int16), want_dx.view(torch.int16))
    with pytest.raises(InputError, match="not with b_index"):
        bwd_gemm.weight_grads_joint(a0, a1, b, offs, b_index=torch.arange(rows, device="cuda"),
                                    slot_sum=(pairs, T, K))
    with pytest.raises(InputError, match="bfloat16"):
        bwd_gemm.weight_grads_joint(a0, a1, b, offs, slot_sum=(pairs.float(), T, K))
    with pytest.raises(InputError, match=r"\[tokens \* top_k, H\]"):
        bwd_gemm.weight_grads_joint(a0, a1, b, offs, slot_sum=(pairs, T + 1, K))


@pytest.mark.parametrize("K, M", [(512, 256), (1024, 384)], ids=["even", "odd-row-blocks"])
def test_gathered_operands_have_the_bits_of_the_gathered_copy(K, M):
    """MOKGEN_BWD_DOUT=inline's GEMMs (a_index: A's rows loaded through an index by warpgroup 0's
    cp.async instead of by TMA from a gathered copy): dh's rows GEMM (fp32 and bf16 out, with and
    without a scatter map) and dW_down's weight gradients (rows ending mid-step, whose zero-filled
    tail the consumers also zero) give the bits of the same calls on ``src.index_select(0,
    index)``, at every stagger lead; the index repeats source rows (a token's K slots) in no
    order; empty experts, one-row experts, rows past offs[-1]."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    counts = _ragged_counts(29, 21, (0, 13), 6) + COUNTS_STEPS
    E, N = len(counts), 512
    rows = sum(counts) + SPARE_ROWS
    S = rows // 3 + 1  # source rows: each used about three times
    index = torch.randint(0, S, (rows,), generator=gen, device="cuda")
    src_k, src_m = _randn(S, K, gen=gen), _randn(S, M, gen=gen)
    wd = _randn(E, K, N, gen=gen, scale=K**-0.5)
    hw = _randn(rows, N, gen=gen)
    offs = _offs(counts)
    copy_k, copy_m = src_k.index_select(0, index), src_m.index_select(0, index)
    order = torch.randperm(rows, generator=gen, device="cuda")
    try:
        for lead in (0, bwd_gemm.MAX_LEAD):
            bwd_gemm.set_stagger(lead)
            for dtype in (torch.float32, torch.bfloat16):
                want = bwd_gemm.rows_gemm([(copy_k, wd)], offs, out_dtype=dtype, cluster=1)
                for _ in range(2):
                    got = bwd_gemm.rows_gemm([(src_k, wd)], offs, out_dtype=dtype, a_index=index)
                    assert got.dtype == dtype and torch.equal(got, want), (lead, dtype)
                scattered = torch.full((rows, N), float("nan"), dtype=dtype, device="cuda")
                bwd_gemm.rows_gemm([(src_k, wd)], offs, out=scattered, out_rows=order, a_index=index)
                assert torch.equal(scattered[order], want), (lead, dtype)
            want_w = bwd_gemm.weight_grads(copy_m, hw, offs, cluster=1, schedule="split")
            for _ in range(2):
                assert torch.equal(bwd_gemm.weight_grads(src_m, hw, offs, a_index=index), want_w), lead
    finally:
        bwd_gemm.set_stagger(True)
    s0 = sum(counts[:6])  # the one-row expert, against fp32 PyTorch
    ref = copy_m[s0:s0 + 1].float().t() @ hw[s0:s0 + 1].float()
    assert _rel(want_w[6], ref) < 1e-2 and torch.equal(want_w[0], torch.zeros_like(want_w[0]))
    with pytest.raises(InputError, match="a_index must be a contiguous int64 tensor"):
        bwd_gemm.rows_gemm([(src_k, wd)], offs, a_index=index.to(torch.int32))
    with pytest.raises(InputError, match="a_index takes one"):
        bwd_gemm.rows_gemm([(src_k, wd), (src_k, wd)], offs, a_index=index)
    with pytest.raises(InputError, match=r"a_index must be a contiguous int64 tensor of shape \(%d,\)" % rows):
        bwd_gemm.weight_grads(src_m, hw, offs, a_index=index[1:])
    with pytest.raises(InputError, match="a_index needs the split schedule"):
        bwd_gemm.weight_grads(src_m, hw, offs, a_index=index, schedule="pingpong")


def test_joint_weight_grads_through_the_token_index_have_the_bits_of_the_copy():
    """MOKGEN_BWD_X=inline's launch (weight_grads_joint's b_index: B's x rows loaded through an
    index by warpgroup 0's cp.async, A's by TMA): the bits of the joint launch on
    ``src.index_select(0, index)``, at every stagger lead; the index repeats source rows in no
    order; empty experts, one-row experts, rows ending mid-step (the TMA's A tail zeroed by the
    consumers), rows past offs[-1]."""
    gen = torch.Generator(device="cuda").manual_seed(25)
    counts = _ragged_counts(31, 25, (0, 11), 5) + COUNTS_STEPS
    E, M, N = len(counts), 256, 512
    rows = sum(counts) + SPARE_ROWS
    S = rows // 3 + 1
    index = torch.randint(0, S, (rows,), generator=gen, device="cuda")
    src = _randn(S, N, gen=gen)
    a0, a1 = _randn(rows, M, gen=gen), _randn(rows, M, gen=gen)
    offs = _offs(counts)
    copy = src.index_select(0, index)
    try:
        for lead in (0, bwd_gemm.MAX_LEAD):
            bwd_gemm.set_stagger(lead)
            want = bwd_gemm.weight_grads_joint(a0, a1, copy, offs, cluster=1)
            for _ in range(2):
                got = bwd_gemm.weight_grads_joint(a0, a1, src, offs, b_index=index)
                for g, w in zip(got, want):
                    assert g.shape == (E, M, N) and torch.equal(g, w), lead
    finally:
        bwd_gemm.set_stagger(True)
    s0 = sum(counts[:5])  # the one-row expert, against fp32 PyTorch
    ref = a1[s0:s0 + 1].float().t() @ copy[s0:s0 + 1].float()
    assert _rel(want[1][5], ref) < 1e-2 and torch.equal(want[0][0], torch.zeros_like(want[0][0]))
    with pytest.raises(InputError, match="b_index must be a contiguous int64 tensor"):
        bwd_gemm.weight_grads_joint(a0, a1, src, offs, b_index=index.to(torch.int32))
    with pytest.raises(InputError, match=r"b_index must be a contiguous int64 tensor of shape \(%d,\)" % rows):
        bwd_gemm.weight_grads_joint(a0, a1, src, offs, b_index=index[1:])


def test_rows_gemm_writes_every_row_of_a_poisoned_output():
    """The output needs no fill: rows past offs[-1] come back as zeros (at their mapped rows where
    a map is given), from memory that held NaNs; rows no map entry names keep their values."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    E, K, N = len(COUNTS), 256, 512
    rows = sum(COUNTS) + SPARE_ROWS
    ops = [(_randn(rows, K, gen=gen), _randn(E, K, N, gen=gen, scale=K**-0.5))]
    offs = _offs(COUNTS)
    poison = torch.full((4 * rows, N), float("nan"), device="cuda")  # freed: the next allocations reuse it
    del poison
    plain = bwd_gemm.rows_gemm(ops, offs)
    assert not plain.isnan().any() and torch.equal(plain[sum(COUNTS):], torch.zeros_like(plain[sum(COUNTS):]))
    R = rows + 9
    perm = torch.randperm(R, generator=gen, device="cuda")[:rows].contiguous()
    out = torch.full((R, N), float("nan"), device="cuda")
    bwd_gemm.rows_gemm(ops, offs, out=out, out_rows=perm)
    assert torch.equal(out[perm], plain)
    untouched = torch.ones(R, dtype=torch.bool, device="cuda")
    untouched[perm] = False
    assert out[untouched].isnan().all()
    # no expert at all: every row is past offs[-1]
    none = torch.zeros(0, dtype=torch.int32, device="cuda")
    empty_b = torch.zeros(0, K, N, dtype=torch.bfloat16, device="cuda")
    out = torch.full((R, N), float("nan"), device="cuda")
    bwd_gemm.rows_gemm([(ops[0][0], empty_b)], none, out=out, out_rows=perm)
    assert torch.equal(out[perm], torch.zeros(rows, N, device="cuda")) and out[untouched].isnan().all()


def test_rows_gemm_bf16_output_has_the_bits_of_the_fp32_sums_rounded():
    """A bf16 out (the backward's dx where each token has one pair): the kernel rounds the fp32
    sums itself, to the bits of the fp32 result cast to bf16, writing the mapped rows only
    (zeros for the rows past offs[-1], from memory that held NaNs); bf16 with B K-major or a
    float16 out are one clear error."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    E, K, N = len(COUNTS), 256, 512
    rows = sum(COUNTS) + SPARE_ROWS
    ops = [(_randn(rows, K, gen=gen), _randn(E, K, N, gen=gen, scale=K**-0.5)) for _ in range(2)]
    offs = _offs(COUNTS)
    R = rows + 9
    perm = torch.randperm(R, generator=gen, device="cuda")[:rows].contiguous()
    want = torch.full((R, N), float("nan"), device="cuda")
    bwd_gemm.rows_gemm(ops, offs, out=want, out_rows=perm)
    out = torch.full((R, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert bwd_gemm.rows_gemm(ops, offs, out=out, out_rows=perm) is out
    assert torch.equal(out[perm], want[perm].to(torch.bfloat16))
    assert torch.equal(out[perm[sum(COUNTS):]], torch.zeros(SPARE_ROWS, N, dtype=torch.bfloat16, device="cuda"))
    untouched = torch.ones(R, dtype=torch.bool, device="cuda")
    untouched[perm] = False
    assert out[untouched].isnan().all()
    kb = [(ops[0][0], _randn(E, N, K, gen=gen))]
    with pytest.raises(InputError, match="contiguous float32 tensor"):
        bwd_gemm.rows_gemm(kb, offs, b_major="k", out=out, out_rows=perm)
    with pytest.raises(InputError, match="float32 or bfloat16"):
        bwd_gemm.rows_gemm(ops, offs, out=out.half(), out_rows=perm)
    # without a map (the backward's dh under MOKGEN_BWD_DH=bf16): the same rounding, every row
    plain = bwd_gemm.rows_gemm(ops, offs)
    rounded = bwd_gemm.rows_gemm(ops, offs, out_dtype=torch.bfloat16)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, plain.to(torch.bfloat16))
    with pytest.raises(InputError, match="out_dtype must be torch.float32 with b_major='k'"):
        bwd_gemm.rows_gemm(kb, offs, b_major="k", out_dtype=torch.bfloat16)
    with pytest.raises(InputError, match="out_dtype is for the output it allocates"):
        bwd_gemm.rows_gemm(ops, offs, out=out, out_rows=perm, out_dtype=torch.bfloat16)


# (experts, tokens, slots, skewed): one chunk of 1024 pairs or less, a chunk and one pair, many
# chunks (kimi-k2.5's local rows, the qwen3.5-35b-a3b layer), more keys than the scan's threads
# (5 keys each), the most experts, and nine pairs in ten on one expert
@pytest.mark.parametrize("E, T, K, skewed", [
    (1, 5, 1, False), (7, 1000, 3, False), (300, 2049, 8, False), (3, 1025, 1, False), (48, 16384, 1, False),
    (256, 16384, 8, False), (5000, 700, 2, False), (bwd_gemm.EXPERT_MAJOR_MAX_EXPERTS, 3000, 2, False),
    (64, 4000, 4, True)])
def test_expert_major_order_matches_the_stable_sort(E, T, K, skewed):
    """The row order (a counting sort over chunks of pairs) against PyTorch's stable argsort, with
    dropped pairs (ids -1 and E) sorted last: the same order, offsets, token of each row and
    gathered weights, every run."""
    from mokgen.backward import _pairs_expert_major

    gen = torch.Generator(device="cuda").manual_seed(11)
    ids = torch.randint(0, E, (T, K), generator=gen, device="cuda", dtype=torch.int32)
    if skewed:
        ids = torch.where(torch.rand(T, K, generator=gen, device="cuda") < 0.9, 5, ids).to(torch.int32)
    drop = torch.rand(T, K, generator=gen, device="cuda") < 0.05
    ids = torch.where(drop, torch.where(torch.rand(T, K, generator=gen, device="cuda") < 0.5, -1, E), ids).to(torch.int32)
    w = torch.rand(T, K, generator=gen, device="cuda")
    order, tok, offs, wts = bwd_gemm.expert_major(ids, E, w)
    want_order, counts, _ = _pairs_expert_major(ids, E)
    assert torch.equal(order, want_order)
    assert torch.equal(offs, counts.cumsum(0).to(torch.int32))
    assert torch.equal(tok, want_order // K)
    assert torch.equal(wts, w.reshape(-1)[want_order])
    again = bwd_gemm.expert_major(ids, E, w)
    assert all(torch.equal(a, b) for a, b in zip(again, (order, tok, offs, wts)))
    assert bwd_gemm.expert_major(ids, E)[3] is None
    with pytest.raises(InputError, match="experts <= 12287"):
        bwd_gemm.expert_major(ids, bwd_gemm.EXPERT_MAJOR_MAX_EXPERTS + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("K", [1, 3, 8])
def test_sum_slots_has_the_bits_of_the_in_place_sum(K, dtype):
    """dx over a token's slots in one pass: the same bits as slot 0 plus slots 1.. in order in
    fp32 (bf16 rows converted exactly), then one cast to bf16 (what mokgen.backward._unpermute
    does)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    T, H = 301, 768
    pairs = (torch.randn(T * K, H, generator=gen, device="cuda") * 3).to(dtype)
    want = pairs.view(T, K, H)[:, 0].float().clone()
    for j in range(1, K):
        want.add_(pairs.view(T, K, H)[:, j])
    got = bwd_gemm.sum_slots(pairs, T, K)
    assert got.dtype == torch.bfloat16 and got.shape == (T, H)
    assert torch.equal(got, want.to(torch.bfloat16))
    assert bwd_gemm.sum_slots(pairs[:0], 0, K).shape == (0, H)


@pytest.mark.parametrize("clamp", [None, 0.75])
def test_swiglu_grads_match_fp32_recompute(clamp):
    """g and u recomputed per expert in fp32, SwiGLU's backward in closed form (with a clamp that
    clips many values), against the fused kernel's h, dg, du (bf16) and d weight (fp32)."""
    from mokgen.backward import _swiglu_grads

    gen = torch.Generator(device="cuda").manual_seed(8)
    E, H, I = len(COUNTS), 512, 384
    rows = sum(COUNTS) + SPARE_ROWS
    x = _randn(rows, H, gen=gen)
    wg, wu = _randn(E, I, H, gen=gen, scale=H**-0.5), _randn(E, I, H, gen=gen, scale=H**-0.5)
    dh_u = torch.randn(rows, I, generator=gen, device="cuda")
    wt = torch.rand(rows, generator=gen, device="cuda")
    offs = _offs(COUNTS)
    hw, dg, du, dw = bwd_gemm.swiglu_grads(x, wg, wu, dh_u, wt, offs, clamp)
    n = sum(COUNTS)
    g = torch.zeros(n, I, device="cuda")
    u = torch.zeros(n, I, device="cuda")
    start = 0
    for e, c in enumerate(COUNTS):
        g[start:start + c] = x[start:start + c].float() @ wg[e].float().t()
        u[start:start + c] = x[start:start + c].float() @ wu[e].float().t()
        start += c
    want_h = reference.swiglu(g, u, clamp)
    want_dg, want_du = _swiglu_grads(g, u, dh_u[:n] * wt[:n, None], clamp)
    for name, a, b in (("h wt", hw[:n], want_h * wt[:n, None]), ("dg", dg[:n], want_dg), ("du", du[:n], want_du)):
        assert a.dtype == torch.bfloat16 and _rel(a, b) < 1e-2, f"{name}: relative error {_rel(a, b):.3e}"
    assert _rel(dw[:n], (dh_u[:n] * want_h).sum(1)) < 1e-3
    if clamp is not None:  # the masks element by element, away from the edges (g, u differ in the last bits)
        margin = 1e-2
        assert torch.all(dg[:n][g > clamp + margin] == 0)
        assert torch.all(du[:n][(u.abs() > clamp + margin)] == 0)
        inside = (g < clamp - margin) & (u.abs() < clamp - margin) & (want_dg.abs() > 1e-3)
        assert torch.all(dg[:n][inside] != 0) and inside.sum() > 100
    for t in (hw[n:], dg[n:], du[n:]):  # rows past offs[-1] stay zero
        assert torch.equal(t, torch.zeros_like(t))
    again = bwd_gemm.swiglu_grads(x, wg, wu, dh_u, wt, offs, clamp)
    assert all(torch.equal(a, b) for a, b in zip((hw, dg, du, dw), again))


def _poison_allocator(*shapes, dtype=torch.bfloat16):
    """Leave NaN-filled blocks of these shapes in the caching allocator, so that the next
    torch.empty of the same sizes (the outputs a function allocates itself) starts as NaN."""
    blocks = [torch.full(s, float("nan"), dtype=dtype, device="cuda") for s in shapes]
    del blocks


@pytest.mark.parametrize("clamp", [None, 0.75])
def test_swiglu_grads_from_saved_pre_activations(clamp):
    """The "save" policy's elementwise pass: g and u read through the rows' pair map from a
    [pairs, 2 I] buffer, against the closed form on the same bf16 values; rows past offs[-1]
    come out zero (every output poisoned first), the same bits on a repeat, and close to the
    recompute on the same rows."""
    from mokgen.backward import _swiglu_grads

    gen = torch.Generator(device="cuda").manual_seed(12)
    E, H, I = len(COUNTS), 512, 384
    rows = sum(COUNTS) + SPARE_ROWS
    n = sum(COUNTS)
    pairs = rows + 5  # more pairs than rows: order picks a permutation of a subset
    order = torch.randperm(pairs, generator=torch.Generator().manual_seed(1))[:rows].to("cuda")
    x = _randn(pairs, H, gen=gen)
    wg, wu = _randn(E, I, H, gen=gen, scale=H**-0.5), _randn(E, I, H, gen=gen, scale=H**-0.5)
    offs = _offs(COUNTS)
    seg = torch.repeat_interleave(torch.arange(E, device="cuda"), torch.tensor(COUNTS, device="cuda"))
    gu = torch.zeros(pairs, 2 * I, dtype=torch.bfloat16, device="cuda")
    xo = x[order[:n]].float()
    gu[order[:n], :I] = torch.einsum("rh,rih->ri", xo, wg.float()[seg]).to(torch.bfloat16)
    gu[order[:n], I:] = torch.einsum("rh,rih->ri", xo, wu.float()[seg]).to(torch.bfloat16)
    dh_u = torch.randn(rows, I, generator=gen, device="cuda")
    wt = torch.rand(rows, generator=gen, device="cuda")
    _poison_allocator((rows, I), (rows, I), (rows, I))
    hw, dg, du, dw = bwd_gemm.swiglu_grads_saved(gu, order, dh_u, wt, offs, clamp)
    g, u = gu[order[:n], :I].float(), gu[order[:n], I:].float()
    want_h = reference.swiglu(g, u, clamp)
    want_dg, want_du = _swiglu_grads(g, u, dh_u[:n] * wt[:n, None], clamp)
    for name, a, b in (("h wt", hw[:n], want_h * wt[:n, None]), ("dg", dg[:n], want_dg), ("du", du[:n], want_du)):
        assert a.dtype == torch.bfloat16 and _rel(a, b) < 5e-3, f"{name}: relative error {_rel(a, b):.3e}"
    assert _rel(dw[:n], (dh_u[:n] * want_h).sum(1)) < 1e-4
    for t in (hw[n:], dg[n:], du[n:], dw[n:]):
        assert torch.equal(t, torch.zeros_like(t))
    again = bwd_gemm.swiglu_grads_saved(gu, order, dh_u, wt, offs, clamp)
    assert all(torch.equal(a, b) for a, b in zip((hw, dg, du, dw), again))
    # dh_u in bf16 (MOKGEN_BWD_DH=bf16): the bits of the fp32 call on the same values
    dh_b = dh_u.to(torch.bfloat16)
    from_bf16 = bwd_gemm.swiglu_grads_saved(gu, order, dh_b, wt, offs, clamp)
    from_fp32 = bwd_gemm.swiglu_grads_saved(gu, order, dh_b.float(), wt, offs, clamp)
    assert all(torch.equal(a, b) for a, b in zip(from_bf16, from_fp32))
    with pytest.raises(InputError, match="dh_u must be a contiguous float32 or bfloat16 tensor"):
        bwd_gemm.swiglu_grads_saved(gu, order, dh_u.half(), wt, offs, clamp)
    # the recompute from the same x rows (g, u in fp32 there): equal up to g and u's bf16 rounding
    # (with a clamp, the masks of values within that rounding of the limit differ too: measured
    # 4.4e-2 at a limit of 0.75 that clips many values, so only the unclamped case is compared)
    if clamp is None:
        recomputed = bwd_gemm.swiglu_grads(x[order].contiguous(), wg, wu, dh_u, wt, offs, clamp)
        for a, b in zip((hw, dg, du, dw), recomputed):
            assert _rel(a[:n], b[:n]) < 2e-2


@pytest.mark.parametrize("one_slot", [False, True], ids=["top-k", "one-slot"])
def test_experts_backward_on_mokgen_gemms_matches_the_reference(monkeypatch, one_slot):
    """The BF16 backward on mokgen's GEMMs against the reference's autograd; one_slot: one
    pair per token (an EP rank's received rows, the shared expert), where the dx GEMM writes
    bf16 itself instead of fp32 rows summed by sum_slots."""
    spec = load_spec("qwen3-30b-a3b")
    gen = torch.Generator(device="cuda").manual_seed(9)
    E, I, H, k = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size, spec.top_k
    wg, wu = _randn(E, I, H, gen=gen, scale=H**-0.5), _randn(E, I, H, gen=gen, scale=H**-0.5)
    wd = _randn(E, H, I, gen=gen, scale=I**-0.5)
    T = 700
    x, g = _randn(T, H, gen=gen), _randn(T, H, gen=gen)
    ids, w = bench.skewed_routing(spec, T, gen, hot_experts=2)  # two hot experts, many empty ones
    ids = ids.long()
    if one_slot:
        ids, w = ids[:, :1].contiguous(), w[:, :1].contiguous()
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    reference.experts_forward(leaves[0], ids, *leaves[1:]).backward(g.float())
    want = [t.grad for t in leaves]
    monkeypatch.setenv("MOKGEN_BWD_GEMM", "1")
    assert bwd_gemm.usable(H, I, x.device)
    got = experts_backward(x, ids, w, wg, wu, wd, g)
    for name, a, b in zip(("x", "weights", "w_gate", "w_up", "w_down"), got, want):
        assert _rel(a, b) < 2e-2, f"{name}: relative error {_rel(a, b):.3e}"
    again = experts_backward(x, ids, w, wg, wu, wd, g)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    # the rows ordered by PyTorch's sort instead of bwd_gemm.expert_major (large layers): the same bits
    from mokgen import backward

    assert backward.USE_EXPERT_MAJOR
    monkeypatch.setattr(backward, "USE_EXPERT_MAJOR", False)
    sorted_by_torch = experts_backward(x, ids, w, wg, wu, wd, g)
    assert all(torch.equal(a, b) for a, b in zip(got, sorted_by_torch))
    if one_slot:
        return
    # Each pair's dx row in bf16 (the default): dx is then the fixed-order fp32 sum of the bf16
    # rows of each slot run alone (one pair per token, whose dx the GEMM rounds once), which is
    # what distributed_backward sums; fp32 rows give another rounding within bf16 tolerance.
    assert env.bwd_dx_pairs() == "bf16"
    want_dx = torch.zeros(T, H, dtype=torch.float32, device="cuda")
    for j in range(k):
        one = experts_backward(x, ids[:, j:j + 1].contiguous(), w[:, j:j + 1].contiguous(), wg, wu, wd, g,
                               need_weight_grads=False)
        want_dx += one[0].float()
    assert torch.equal(got[0], want_dx.to(torch.bfloat16))
    monkeypatch.setenv("MOKGEN_BWD_DX_PAIRS", "fp32")
    fp32_rows = experts_backward(x, ids, w, wg, wu, wd, g)
    assert _rel(fp32_rows[0], want[0]) < 2e-2 and not torch.equal(fp32_rows[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(fp32_rows[1:], got[1:]))  # only dx changes


@pytest.mark.parametrize("policy", ["save", "recompute"])
def test_experts_backward_with_dout_inline_has_the_bits_of_the_gathered_copy(monkeypatch, policy):
    """MOKGEN_BWD_DOUT=inline (dh and dW_down load dOut's rows through the token index) changes
    where the rows come from, not the operands: every gradient has the bits of the default
    (a gathered copy), under both policies, with skewed routing (empty experts) and dropped
    pairs (ids outside [0, E), sorted past offs[-1]); and a non-contiguous dOut (the expand
    of a sum's backward) is taken as its values."""
    spec = load_spec("qwen3-30b-a3b")
    gen = torch.Generator(device="cuda").manual_seed(23)
    E, I, H = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    wg, wu = _randn(E, I, H, gen=gen, scale=H**-0.5), _randn(E, I, H, gen=gen, scale=H**-0.5)
    wd = _randn(E, H, I, gen=gen, scale=I**-0.5)
    T = 611
    x, g = _randn(T, H, gen=gen), _randn(T, H, gen=gen)
    ids, w = bench.skewed_routing(spec, T, gen, hot_experts=3)
    ids = ids.long()
    ids[5, 1] = E  # a dropped pair
    ids[17, 0] = -1
    monkeypatch.setenv("MOKGEN_BWD_GEMM", "1")
    # the save policy's pre-activations (any values: only the two modes are compared)
    saved = _randn(T * ids.shape[1], 2 * I, gen=gen) if policy == "save" else None
    monkeypatch.setenv("MOKGEN_BWD_DOUT", "gather")
    want = experts_backward(x, ids, w, wg, wu, wd, g, saved_gu=saved)
    monkeypatch.setenv("MOKGEN_BWD_DOUT", "inline")
    for _ in range(2):
        got = experts_backward(x, ids, w, wg, wu, wd, g, saved_gu=saved)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), policy
    ones = torch.ones(1, H, dtype=torch.bfloat16, device="cuda").expand(T, H)  # stride 0: not contiguous
    got = experts_backward(x, ids, w, wg, wu, wd, ones, saved_gu=saved)
    monkeypatch.setenv("MOKGEN_BWD_DOUT", "gather")
    assert all(torch.equal(a, b) for a, b in zip(got, experts_backward(x, ids, w, wg, wu, wd, ones.contiguous(),
                                                                        saved_gu=saved)))


def test_misaligned_or_strided_inputs_are_clear_errors():
    a = torch.zeros(64 * 64 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(64, 64)  # 2 bytes off
    b = torch.zeros(1, 64, 256, dtype=torch.bfloat16, device="cuda")
    offs = torch.tensor([64], dtype=torch.int32, device="cuda")
    with pytest.raises(InputError, match="16-byte aligned"):
        bwd_gemm.rows_gemm([(a, b)], offs)
    strided = torch.tensor([32, 0, 64, 0], dtype=torch.int32, device="cuda")[::2]  # two experts, stride 2
    b2 = torch.zeros(2, 64, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(InputError, match="contiguous int32"):
        bwd_gemm.rows_gemm([(torch.zeros(64, 64, dtype=torch.bfloat16, device="cuda"), b2)], strided)
