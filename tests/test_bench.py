"""CPU checks of the benchmark's workload definitions (the timings themselves run on a GPU)."""

from __future__ import annotations

import pytest

from mokgen.bench import LOCAL_EP, local_spec, routed_flops
from mokgen.spec import bundled_specs, load_spec

# DESIGN.md's table of the rank-local workload: spec -> (EP degree, local experts, rows measured
# there under uniform routing); our rows are the expectation 2048 * k, within 3% of those samples.
DESIGN_LOCAL = {
    "kimi-k2.5": (8, 48, 16064),
    "glm-5.2": (8, 32, 16144),
    "qwen3.5-397b-a17b": (8, 64, 19968),
    "deepseek-v4-pro": (8, 48, 12000),
    "deepseek-v3": (64, 4, 16352),
}


@pytest.mark.parametrize("name", sorted(DESIGN_LOCAL))
def test_local_workload_matches_design_table(name):
    ep, experts, design_rows = DESIGN_LOCAL[name]
    assert LOCAL_EP.get(name, 8) == ep
    spec = load_spec(name)
    local, rows = local_spec(spec, ep)
    assert local.num_experts == experts and local.top_k == 1
    assert (local.hidden_size, local.moe_intermediate_size) == (spec.hidden_size, spec.moe_intermediate_size)
    assert local.activation == spec.activation
    assert abs(rows - design_rows) / design_rows < 0.03
    assert local.target.max_tokens_per_rank >= rows
    # the same FLOPs as the rank's share of the layer: rows of H x I SwiGLU experts
    assert routed_flops(local, rows) == 6 * rows * spec.hidden_size * spec.moe_intermediate_size


def test_local_workload_rejects_an_ep_that_does_not_divide():
    with pytest.raises(ValueError, match="must divide num_experts"):
        local_spec(load_spec("kimi-k2.5"), 7)


@pytest.mark.parametrize("name", sorted(bundled_specs()))
def test_local_spec_names_are_distinct_from_bundled(name):
    local, _ = local_spec(load_spec(name), 8 if load_spec(name).num_experts % 8 == 0 else 1)
    assert local.name not in bundled_specs() and local.name.startswith(name)


def test_ep_workload_outside_torchrun_is_a_clear_error(monkeypatch):
    from mokgen.cli import _init_ep_group
    from mokgen.errors import InputError

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(InputError, match="launch it as `torchrun --nproc-per-node N -m mokgen bench"):
        _init_ep_group()


def test_skewed_routing_prefers_the_hot_experts_and_keeps_ids_distinct():
    torch = pytest.importorskip("torch")
    from mokgen.bench import skewed_routing

    spec = load_spec("kimi-k2.5")
    gen = torch.Generator().manual_seed(0)
    ids, w = skewed_routing(spec, 500, gen, hot_experts=96, device="cpu")
    assert ids.shape == (500, spec.top_k) and w.shape == (500, spec.top_k)
    assert all(len(set(row)) == spec.top_k for row in ids.tolist())
    assert (ids < 96).all()  # top_k = 8 <= 96 hot experts: every pick is hot
    torch.testing.assert_close(w.sum(-1), torch.ones(500))


def test_remote_bytes_counts_rows_from_other_ranks_only():
    torch = pytest.importorskip("torch")
    from mokgen.bench import _remote_bytes

    spec = load_spec("qwen3-30b-a3b")  # 128 experts, H = 2048
    # 2 ranks (64 experts each); rank 0 sends 3 pairs to rank 1 and 1 to itself
    ids0 = torch.tensor([[64, 0], [100, 127]])
    ids1 = torch.tensor([[1, 2], [3, 70]])
    row = spec.hidden_size * 2
    assert _remote_bytes(spec, [ids0, ids1], 0, 2) == 3 * row  # from rank 1: 1, 2, 3
    assert _remote_bytes(spec, [ids0, ids1], 1, 2) == 3 * row  # from rank 0: 64, 100, 127


def test_kernel_statistics_parsing():
    from mokgen.abi import STAT_SLOTS, parse_stats

    ns = {"t_start_ns": 1_000_000, "t_pull_first_ns": 1_200_000, "t_pull_last_ns": 1_700_000, "t_done_ns": 3_000_000,
          "t_push_first_ns": 1_900_000}
    vals = [100, 100, 100, 40] + [ns[k] for k in STAT_SLOTS[4:]]
    st = parse_stats(vals)
    assert (st["rows_received"], st["rows_remote"]) == (100, 40)
    assert st["pull_start_ms"] == pytest.approx(0.2) and st["pull_ms"] == pytest.approx(0.5)
    assert st["done_ms"] == pytest.approx(2.0) and st["push_ms"] == pytest.approx(1.1)
    # nothing pulled or pushed: the windows are unknown (the kernel leaves first = max, last = 0)
    idle = parse_stats([0, 0, 0, 0, 1_000_000, 2**63 - 1, 0, 1_500_000, 2**63 - 1])
    assert idle["pull_ms"] is None and idle["pull_start_ms"] is None and idle["done_ms"] == pytest.approx(0.5)
    assert idle["push_ms"] is None


def test_phase_line_from_kernel_statistics():
    from mokgen.bench import Row, phase_line

    row = Row("local EP8", "kimi-k2.5-ep8-local", 16384, "mokgen megakernel (W=1)", 4.5, 300.0)
    assert phase_line(row) is None  # no phases (a peer row, or stats not read)
    row.phases = {"pull_start_ms": 0.04, "pull_ms": 2.4, "push_ms": 3.5, "done_ms": 3.96}
    line = phase_line(row)
    assert line.startswith("local EP8 kimi-k2.5-ep8-local: first pull at 0.040 ms")
    assert "all pushed at 3.960 ms, then 0.540 ms to the end (4.500 ms median)" in line
    row.phases = {"pull_start_ms": None, "pull_ms": None, "push_ms": None, "done_ms": None}  # an aborted launch
    assert phase_line(row) is None


def test_bytes_line_from_the_kernels_count():
    from mokgen.bench import Row, bytes_line

    row = Row("virtual", "kimi-k2.5", 16384, "mokgen megakernel MXFP8 (W=8 virtual)", 3.0, 400.0)
    assert bytes_line(row) is None  # a peer row, or no count read
    row.bytes_per_token = 51_999.6
    assert bytes_line(row) == ("kimi-k2.5 mokgen megakernel MXFP8 (W=8 virtual): 52000 B dispatched between ranks "
                               "per token (kernel count)")


def test_bench_table_speedups_and_peak_memory_column():
    """The table compares each peer with the best mokgen row of its group; fwd+bwd rows add a
    peak-memory column (rows without a figure leave it blank), forward rows alone have none."""
    from rich.console import Console

    from mokgen.bench import Row
    from mokgen.cli import bench_table

    def render(rows):
        console = Console(width=240, record=True)
        console.print(bench_table(rows, 700.0, "NVIDIA H200"))
        return console.export_text()

    fwd = [Row("layer", "qwen3.5-35b-a3b", 16384, "mokgen megakernel (W=1)", 2.0, 400.0),
           Row("layer", "qwen3.5-35b-a3b", 16384, "torch._grouped_mm", 5.0, 160.0)]
    text = render(fwd)
    assert "peak GiB" not in text and "2.50x" in text and "dense bf16 ceiling 700" in text
    bwd = [Row("layer fwd+bwd", "qwen3.5-35b-a3b", 16384, "mokgen megakernel + mokgen backward, save (W=1)", 6.4,
               390.0, peak_gib=2.19),
           Row("layer fwd+bwd", "qwen3.5-35b-a3b", 16384, "torch._grouped_mm autograd", 14.5, 170.0, peak_gib=2.13)]
    text = render(fwd + bwd)
    assert "peak GiB" in text and "+2.19" in text and "+2.13" in text and "2.27x" in text
    assert "held GiB" not in text  # rows that do not say what they hold
    bwd[0].held_gib, bwd[1].held_gib = 1.19, 0.0
    text = render(fwd + bwd)
    assert "held GiB" in text and "1.19" in text and "0.00" in text


def test_bench_table_mxfp8_columns():
    """--numerics mxfp8: each row's error against float64 and the MXFP8 row's speed over the BF16
    megakernel of its group; without errors, no such columns."""
    from rich.console import Console

    from mokgen.bench import MX_ROW, Row
    from mokgen.cli import bench_table

    rows = [Row("local EP8", "kimi-k2.5-ep8-local", 16384, "mokgen megakernel (W=1, tuned)", 3.0, 550.0, error=0.0031),
            Row("local EP8", "kimi-k2.5-ep8-local", 16384, MX_ROW, 4.0, 412.0, error=0.071),
            Row("local EP8", "kimi-k2.5-ep8-local", 16384, "torch._grouped_mm", 6.0, 275.0)]
    console = Console(width=260, record=True)
    console.print(bench_table(rows, 700.0, "NVIDIA H200"))
    text = console.export_text()
    assert "err vs fp64" in text and "3.10e-03" in text and "7.10e-02" in text
    assert "0.75x" in text  # 3.0 / 4.0
    assert "2.00x" in text  # the peer against the best mokgen row
    console = Console(width=260, record=True)
    plain = [Row(r.workload, r.spec, r.tokens, r.impl, r.ms, r.tflops) for r in (rows[0], rows[2])]
    console.print(bench_table(plain, 700.0, "NVIDIA H200"))
    assert "err vs fp64" not in console.export_text()
    # an MXFP8 megakernel row faster than the BF16 one (qwen3.5-397b-a17b local, v0.40: 1.459 against
    # 1.610 ms) is measured against the BF16 row, not against itself
    faster = [rows[0], Row(rows[1].workload, rows[1].spec, rows[1].tokens, "mokgen megakernel MXFP8 (W=1)", 2.5,
                           660.0, error=0.071)]
    console = Console(width=260, record=True)
    console.print(bench_table(faster, 700.0, "NVIDIA H200"))
    text = console.export_text()
    assert "1.20x" in text and "1.00x" not in text  # 3.0 / 2.5


def test_abba_blocks_interleave_the_sides_and_block_ratio_is_reproducible():
    """abba_blocks launches warm-up then A B B A per block (input i, then i + 1), pairing each
    side's two launches; block_ratio's median and bootstrap interval come from those pairs, the
    same on every call (fixed seed)."""
    from mokgen.bench import abba_blocks, block_ratio

    calls = []

    def launch(side, i):
        calls.append((side, i))
        return 1.0 + side * 0.1 + 0.01 * (i % 3)  # B 10% slower, a drift both sides share

    pairs = abba_blocks(launch, 4, warmup=2)
    assert calls[:2] == [(0, 0), (1, 1)]
    assert calls[2:6] == [(0, 0), (1, 0), (1, 1), (0, 1)] and len(calls) == 2 + 4 * 4
    assert pairs[0] == pytest.approx((2.01, 2.21))
    ratio, lo, hi = block_ratio(pairs)
    assert lo <= ratio <= hi and ratio == pytest.approx(1.1, abs=0.01)
    assert block_ratio(pairs) == (ratio, lo, hi)


def test_remote_bytes_count_rows_as_their_numerics_carries_them():
    """bench_ep's remote bytes: the rows a rank receives from the others, bf16 2 H bytes each, MXFP8
    H codes plus H / 32 scales (0.516x)."""
    torch = pytest.importorskip("torch")
    from mokgen.bench import _remote_bytes
    from mokgen.spec import load_spec

    spec = load_spec("qwen3-30b-a3b")  # 128 experts: 64 per rank at W = 2
    ids_all = [torch.tensor([[0, 64], [65, 1]]), torch.tensor([[0, 127], [2, 3]])]
    # rank 0 receives from rank 1 the pairs of experts 0, 2, 3 (3 rows); its own are not remote
    assert _remote_bytes(spec, ids_all, 0, 2) == 3 * 2 * 2048
    assert _remote_bytes(spec, ids_all, 0, 2, "mxfp8") == 3 * (2048 + 64)
    assert _remote_bytes(spec, ids_all, 1, 2) == 2 * 2 * 2048  # experts 64 and 65 of rank 0's tokens


def test_interleaved_times_visit_every_side_in_turn(monkeypatch):
    """The block bench's rounds: each side timed in turn, round after round, ``iters`` in all."""
    from mokgen import bench

    calls = []

    def fake_time_cuda(fn, *, n_inputs, iters):
        calls.append((fn, iters))
        return [float(len(calls))] * iters

    monkeypatch.setattr(bench, "time_cuda", fake_time_cuda)
    impls = {"a": "A", "b": "B", "c": "C"}
    out = bench.interleaved_times(impls, n_inputs=2, iters=10, rounds=4)
    assert [fn for fn, _ in calls] == list("ABC") * 4
    assert [n for _, n in calls] == [3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2]
    assert {k: len(v) for k, v in out.items()} == {"a": 10, "b": 10, "c": 10}
    assert out["b"][:3] == [2.0] * 3 and out["b"][3:6] == [5.0] * 3  # its first and second rounds
    calls.clear()
    out = bench.interleaved_times({"a": "A"}, n_inputs=1, iters=2, rounds=4)  # fewer calls than rounds
    assert [n for _, n in calls] == [1, 1] and len(out["a"]) == 2


def test_share_tensors_leaves_one_set_of_weights():
    import torch

    from mokgen import bench

    def make():
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))

    src, dst = make(), make()
    bench._share_tensors(dst, src)
    for (n1, a), (n2, b) in zip(src.state_dict(keep_vars=True).items(), dst.state_dict(keep_vars=True).items()):
        assert n1 == n2 and a is b
    assert {id(p) for p in dst.parameters()} == {id(p) for p in src.parameters()}
    x = torch.randn(5, 4)
    src.eval(), dst.eval()
    assert torch.equal(src(x), dst(x))

