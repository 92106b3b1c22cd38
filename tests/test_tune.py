"""mokgen.tune: the search space and its pruning, token buckets, tie-breaking, tuned-file storage,
metadata checks and lookup order, the build options a tuned entry gives, and `mokgen tune` on
the command line. CPU only, except the last tests (marked gpu): a real tune on the H200."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import pytest

from mokgen import env
from mokgen import tune as tune_mod
from mokgen.errors import InputError
from mokgen.plan import ep_defaults, make_plan
from mokgen.spec import bundled_specs, load_spec, spec_from_dict
from mokgen.tune import Candidate, TuneKey, choose, search_space, token_bucket

ALL_SPECS = sorted(bundled_specs())
TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-moe.yaml"
GPU = "NVIDIA H200"


@pytest.fixture
def tuned_dirs(tmp_path, monkeypatch):
    """A private user tuned dir and package tuned dir; returns (user, package)."""
    user, package = tmp_path / "user", tmp_path / "package"
    monkeypatch.setenv("MOKGEN_TUNED_DIR", str(user))
    monkeypatch.setattr(tune_mod, "PACKAGE_TUNED", package)
    monkeypatch.delenv("MOKGEN_TUNED", raising=False)
    return user, package


# ---- buckets, candidates, keys -------------------------------------------------------------------


def test_token_bucket():
    assert [token_bucket(t) for t in (0, 1, 255, 256, 257, 2048, 2049, 16384)] == [256, 256, 256, 256, 512, 2048,
                                                                                    4096, 16384]
    with pytest.raises(InputError, match="tokens must be >= 0"):
        token_bucket(-1)


def test_candidate_json_round_trip_and_validation():
    c = Candidate(2, 32, 4096, 8, 16)
    assert Candidate.from_json(json.loads(json.dumps(c.to_json()))) == c
    assert c.build_options() == {"cluster": 2, "block_k": 32, "pull_mode": "copy", "stagger": 0, "mx_form": "codes"}
    bulk = Candidate(2, 32, 4096, 8, 16, "bulk")
    assert Candidate.from_json(bulk.to_json()) == bulk and bulk.build_options()["pull_mode"] == "bulk"
    assert "bulk pull" in bulk.label() and "bulk" not in c.label()
    # files written before the pull mode was tuned: no such field, they ran the copy
    assert Candidate.from_json({k: v for k, v in c.to_json().items() if k != "pull_mode"}) == c
    # nor before the stagger was (v0.47): they ran in lockstep; both may be missing
    assert Candidate.from_json({k: v for k, v in c.to_json().items() if k != "stagger"}) == c
    assert Candidate.from_json({k: v for k, v in c.to_json().items() if k not in ("stagger", "pull_mode")}) == c
    lead = Candidate(2, 32, 4096, 8, 16, "copy", 3)
    assert Candidate.from_json(lead.to_json()) == lead and lead.build_options()["stagger"] == 3
    assert "stagger 3" in lead.label() and "stagger" not in c.label()
    # nor before the MX form was (v0.57): MXFP8 builds ran as codes
    assert Candidate.from_json({k: v for k, v in c.to_json().items() if k != "mx_form"}) == c
    expand = Candidate(2, 64, 4096, 4, None, "copy", 0, "expand")
    assert Candidate.from_json(expand.to_json()) == expand and expand.build_options()["mx_form"] == "expand"
    assert "expanded MX rows" in expand.label() and "expanded" not in c.label()
    assert c.runtime() == {"chunk_rows": 4096, "ring_chunks": 8, "dispatch_ctas": 16}
    for bad in ({**c.to_json(), "extra": 1}, {k: v for k, v in c.to_json().items() if k != "ring_chunks"},
                {**c.to_json(), "chunk_rows": 0}, {**c.to_json(), "block_k": "64"}, {**c.to_json(), "cluster": True},
                {**c.to_json(), "dispatch_ctas": -2}, [1, 2], {**c.to_json(), "cluster": 3},
                {**c.to_json(), "block_k": 48}, {**c.to_json(), "chunk_rows": (1 << 20) + 1},
                {**c.to_json(), "ring_chunks": 1025}, {**c.to_json(), "pull_mode": "dma"},
                {**c.to_json(), "pull_mode": None}, {**c.to_json(), "stagger": 4}, {**c.to_json(), "stagger": -1},
                {**c.to_json(), "stagger": True}, {**c.to_json(), "stagger": None}, {**c.to_json(), "mx_form": "fp8"},
                {**c.to_json(), "mx_form": None}):
        with pytest.raises(ValueError):
            Candidate.from_json(bad)


def test_key_path_names_spec_gpu_numerics_ep_and_bucket():
    spec = load_spec("kimi-k2.5")
    key = TuneKey.of(spec, gpu="NVIDIA H200", ep=8, tokens=2000)
    assert key.relpath() == Path("kimi-k2.5") / "nvidia-h200-bf16-ep8-t2048.json"
    local = TuneKey.of(spec, gpu="NVIDIA H200", ep=8, tokens=2048, workload="local")
    assert local.relpath() == Path("kimi-k2.5") / "nvidia-h200-bf16-ep8-t2048-local.json"
    with pytest.raises(InputError, match="must divide num_experts"):
        TuneKey.of(spec, gpu=GPU, ep=5, tokens=2048)
    with pytest.raises(InputError, match="'local' for EP > 1"):
        TuneKey.of(spec, gpu=GPU, ep=1, tokens=2048, workload="local")


# ---- search space --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_SPECS)
def test_space_starts_at_the_defaults_and_has_no_duplicates(name):
    spec = load_spec(name)
    for ep, tokens in ((1, 16384), (8, 2048), (8, 512), (8, 128)):
        space = search_space(spec, ep=ep, tokens=tokens)
        d = ep_defaults(spec)
        assert space.candidates[0] == Candidate(make_plan(spec).gemm_cluster, 64, d["chunk_rows"], d["ring_chunks"], None)
        assert len(set(space.candidates)) == len(space.candidates)
        assert not set(space.candidates) & {c for c, _ in space.pruned}
        rows = tokens * spec.top_k
        # the chunk that holds every row: the default's if it does, else the smallest tried
        holding = d["chunk_rows"] if d["chunk_rows"] >= rows else min(
            (x for x in tune_mod.CHUNKS if x >= rows), default=None)
        ring0 = space.candidates[0].ring_chunks
        for c in space.candidates[1:]:  # nothing that runs the same as an earlier candidate
            assert holding is None or c.chunk_rows <= holding
            n = math.ceil(rows / c.chunk_rows)
            assert c.ring_chunks == ring0 or min(c.ring_chunks, n) != min(ring0, n)
        # dispatch CTAs: for the real one-rank layer (a local copy of every row), not for the
        # one-GPU stand-in of EP > 1 (no transfers to tune)
        assert {c.dispatch_ctas for c in space.candidates} == (
            {None, *tune_mod.DISPATCH_ONE_RANK} if ep == 1 else {None})
        base = space.candidates[0]
        same_as_defaults = [c for c in space.candidates[1:]  # one chunk either way: the same run
                            if c.build_options() == base.build_options() and c.dispatch_ctas == base.dispatch_ctas
                            and c.chunk_rows >= rows and base.chunk_rows >= rows]
        assert same_as_defaults == []
        dist = search_space(spec, ep=ep, tokens=tokens, distributed=True)
        assert {c.dispatch_ctas for c in dist.candidates} == (
            {None, *tune_mod.DISPATCH_ONE_RANK} if ep == 1 else {None, *tune_mod.DISPATCH})
        # the bulk-copy dispatch: only where rows cross links (one GPU: local copies, measured level)
        assert {c.pull_mode for c in space.candidates} == {"copy"}
        assert {c.pull_mode for c in dist.candidates} == ({"copy"} if ep == 1 else {"copy", "bulk"})
        assert dist.candidates[0] == space.candidates[0]


def test_space_prunes_with_reasons(monkeypatch):
    spec = load_spec("qwen3-30b-a3b")
    space = search_space(spec, ep=8, tokens=2048)  # 16384 rows per rank
    reasons = dict(((c.cluster, c.block_k, c.chunk_rows, c.ring_chunks), why) for c, why in space.pruned)
    # 8192-row chunks: 2 chunks, so a ring of 8 runs as the default ring of 4
    assert reasons[(1, 64, 8192, 8)] == "ring of 8 slots: the same as 4 for 2 chunk(s)"
    assert (1, 64, 8192, 4) not in reasons
    # a rank of 4096 rows: the default chunk (5504) holds them all, so 4096 and 8192 run the same
    small = search_space(spec, ep=8, tokens=512)
    assert ep_defaults(spec)["chunk_rows"] == 5504
    assert {c.chunk_rows for c in small.candidates} == {1024, 2048, 5504}
    assert any("chunk of 4096 rows: a rank has 4096, the chunk of 5504 holds them all" == why for _, why in small.pruned)
    # ... and when the default does not hold them, the smallest tried chunk that does is kept
    big = search_space(spec, ep=8, tokens=1024)  # 8192 rows
    assert {c.chunk_rows for c in big.candidates} == {1024, 2048, 4096, 5504, 8192}
    # shared memory: a limit below BK = 32's 9 stages prunes them (the kernel's static_assert)
    monkeypatch.setattr(tune_mod, "SMEM_LIMIT", 200 * 1024)
    tight = search_space(spec, ep=8, tokens=2048)
    assert all(c.block_k == 64 for c in tight.candidates)
    assert any(why.startswith("shared memory: 222352 B per CTA") for _, why in tight.pruned)
    # memory: a tiny GPU prunes big rings
    mem = search_space(spec, ep=1, tokens=16384, gpu_memory=1 << 30)
    assert any(why.startswith("memory: the ring takes") for _, why in mem.pruned)
    assert all(c.chunk_rows * c.ring_chunks * (2048 + 768) * 2 <= (1 << 30) / 4 for c in mem.candidates[1:])


def test_space_prunes_pairs_on_128_column_down_tiles():
    d = load_spec("deepseek-v3").canonical_dict()
    d.update(name="h1152-test", aliases=[], hidden_size=1152, num_experts=16, target={**d["target"], "max_ep_ranks": 1})
    spec = spec_from_dict(d)
    space = search_space(spec, ep=1, tokens=1024)
    assert all(c.cluster == 1 for c in space.candidates)
    assert any(why.startswith("registers: CTA pairs spill") for c, why in space.pruned if c.cluster == 2)


def test_space_follows_the_switches(monkeypatch):
    kimi = load_spec("kimi-k2.5")
    monkeypatch.setenv("MOKGEN_GEMM_CORE", "mma_sync")  # no pairs, no BK 32: the plan's cluster 1
    assert {(c.cluster, c.block_k) for c in search_space(kimi, ep=8, tokens=2048).candidates} == {(1, 64)}
    monkeypatch.delenv("MOKGEN_GEMM_CORE")
    monkeypatch.setenv("MOKGEN_CLUSTER", "1")  # a set switch fixes its axis (the build would override it)
    space = search_space(kimi, ep=8, tokens=2048)
    assert space.candidates[0].cluster == 1 and {c.cluster for c in space.candidates} == {1}
    assert {c.block_k for c in space.candidates} == {64, 32}
    monkeypatch.setenv("MOKGEN_BLOCK_K", "32")
    space = search_space(kimi, ep=8, tokens=2048)
    assert {(c.cluster, c.block_k) for c in space.candidates} == {(1, 32)}
    monkeypatch.setenv("MOKGEN_PULL_MODE", "bulk")  # pins the dispatch's copy engine, even under torchrun
    dist = search_space(kimi, ep=8, tokens=2048, distributed=True)
    assert {c.pull_mode for c in dist.candidates} == {"bulk"}


def test_space_small_rank_keeps_one_single_chunk_candidate():
    spec = load_spec("qwen3-30b-a3b")  # default chunk 5504
    space = search_space(spec, ep=8, tokens=128)  # 1024 rows: every chunk holds them
    assert {c.chunk_rows for c in space.candidates} == {5504}
    assert {c.ring_chunks for c in space.candidates} == {4}
    assert len(space.candidates) == 4  # the build options only
    assert any(why == "chunk of 1024 rows: a rank has 1024, the chunk of 5504 holds them all" for _, why in space.pruned)


# ---- choosing ------------------------------------------------------------------------------------


def test_choose_breaks_ties_by_index():
    assert choose([1.0, 0.995, 0.996]) == 0  # within 1% of the best: the lowest index wins
    assert choose([1.0, 0.98]) == 1
    assert choose([None, math.inf, float("nan"), 2.0, 1.9999]) == 3
    assert choose([3.0, 1.0, 1.005, 0.999]) == 1
    assert choose([1.0, 0.98], noise=0.05) == 0
    with pytest.raises(InputError, match="no candidate ran"):
        choose([None, math.inf])


# ---- storage and lookup --------------------------------------------------------------------------


def _doc(spec, key: TuneKey, best: Candidate, meta: dict) -> dict:
    return {"_metadata": meta, "key": key.to_json(), "best": best.to_json(), "best_index": 1}


def _meta(**changes):
    meta = tune_mod.metadata(GPU)
    meta.update(changes)
    return meta


def test_the_weights_raw_switch_leaves_a_tuned_entry_fitting(monkeypatch):
    """MOKGEN_MX_FWD_WEIGHTS (v0.68; tune.EITHER_OPTIONS): an entry's fixed plan options and pins are
    the same under either value (the raw weights run the values form's tiles and schedule), while
    a fixed option's switch (MOKGEN_PULL_MODE) still changes them."""
    base = tune_mod.metadata(GPU)["plan_options"]
    assert "mx_fwd_weights" not in base
    monkeypatch.setenv("MOKGEN_MX_FWD_WEIGHTS", "raw")
    assert tune_mod.metadata(GPU)["plan_options"] == base
    monkeypatch.setenv("MOKGEN_PULL_MODE", "bulk")
    assert tune_mod.metadata(GPU)["plan_options"] != base


def test_confirm_choice_keeps_only_a_winner_that_holds_in_alternation():
    """confirm_choice times the defaults and the candidate in turn; the candidate keeps the win
    only beyond NOISE on the medians of its rounds; a failure on either side decides at once."""
    seq: list[int] = []

    def timer(times):
        it = {i: iter(v) for i, v in times.items()}

        def measure(i):
            seq.append(i)
            return next(it[i])
        return measure

    best, rec = tune_mod.confirm_choice(5, timer({0: [2.0, 2.1, 2.0], 5: [1.8, 1.9, 1.8]}), rounds=3)
    assert best == 5 and rec["held"] and seq == [0, 5, 0, 5, 0, 5]
    assert rec["default_ms"] == [2.0, 2.1, 2.0] and rec["candidate_ms"] == [1.8, 1.9, 1.8]
    # within NOISE (1%) of the defaults' median: the defaults win
    best, rec = tune_mod.confirm_choice(5, timer({0: [2.0, 2.0, 2.0], 5: [1.99, 1.985, 1.99]}), rounds=3)
    assert best == 0 and not rec["held"]
    # the first pass's advantage was drift: the candidate is slower in alternation
    best, rec = tune_mod.confirm_choice(2, timer({0: [1.0, 1.0, 1.0], 2: [1.1, 1.05, 1.2]}), rounds=3)
    assert best == 0 and not rec["held"]
    # the candidate fails: the defaults; the defaults fail: the candidate
    assert tune_mod.confirm_choice(4, timer({0: [1.0], 4: [None]}), rounds=3)[0] == 0
    best, rec = tune_mod.confirm_choice(4, timer({0: [None], 4: []}), rounds=3)
    assert best == 4 and rec["held"] and rec["default_ms"] == []


def test_interleaved_verdict_needs_a_resolved_win_beyond_the_noise():
    """The interleaved confirmation holds only where the median per-block ratio is below
    1 - NOISE and the bootstrap interval's upper bound below 1; the same times give the same
    verdict (a fixed seed)."""
    clear = [(2.0, 1.9 + 0.001 * (i % 7)) for i in range(50)]  # 5% faster in every block
    v = tune_mod.interleaved_verdict(clear)
    assert v["held"] and v["ratio"] == pytest.approx(0.9515, abs=2e-3) and v["ratio_lo"] <= v["ratio"] <= v["ratio_hi"] < 1
    assert tune_mod.interleaved_verdict(clear) == v
    small = [(2.0, 1.99) for _ in range(50)]  # 0.5% faster: within NOISE
    assert not tune_mod.interleaved_verdict(small)["held"]
    # a 2% median gain that the blocks do not resolve: half of them 10% slower
    noisy = [(2.0, 1.96)] * 26 + [(2.0, 2.2)] * 24
    v = tune_mod.interleaved_verdict(noisy)
    assert v["ratio"] == pytest.approx(0.98) and v["ratio_hi"] >= 1 and not v["held"]
    with pytest.raises(InputError, match="at least one block"):
        tune_mod.interleaved_verdict([])


def test_confirm_interleaved_keeps_the_defaults_unless_the_candidate_holds():
    calls = []

    def pairs(times):
        def time_pairs(a, b, n):
            calls.append((a, b, n))
            if isinstance(times, Exception):
                raise times
            return [times] * n
        return time_pairs

    best, rec = tune_mod.confirm_interleaved(4, pairs((4.0, 3.6)), blocks=10)
    assert best == 4 and rec["held"] and calls == [(0, 4, 10)] and rec["method"] == "interleaved"
    assert rec["default_ms"] == [2.0] * 10 and rec["candidate_ms"] == [1.8] * 10 and rec["ratio"] == pytest.approx(0.9)
    best, rec = tune_mod.confirm_interleaved(4, pairs((4.0, 4.1)), blocks=10)
    assert best == 0 and not rec["held"]
    best, rec = tune_mod.confirm_interleaved(4, pairs(RuntimeError("launch timed out\nat rank 0")), blocks=10)
    assert best == 0 and rec["error"] == "launch timed out at rank 0" and rec["default_ms"] == []


def test_lookup_finds_a_fitting_entry_user_dir_first(tuned_dirs):
    user, package = tuned_dirs
    spec = load_spec("qwen3-30b-a3b")
    key = TuneKey.of(spec, gpu=GPU, ep=8, tokens=2048)
    a, b = Candidate(2, 32, 4096, 8, None), Candidate(1, 64, 1024, 4, None)
    assert tune_mod.lookup(spec, gpu=GPU, ep=8, tokens=2048) is None
    tune_mod.write_json(package / key.relpath(), _doc(spec, key, b, _meta()))
    got = tune_mod.lookup(spec, gpu=GPU, ep=8, tokens=1500)  # same bucket
    assert got is not None and got.best == b and got.path == package / key.relpath()
    tune_mod.write_json(user / key.relpath(), _doc(spec, key, a, _meta()))
    assert tune_mod.lookup(spec, gpu=GPU, ep=8, tokens=2048).best == a
    assert tune_mod.lookup(spec, gpu=GPU, ep=8, tokens=4096) is None  # another bucket
    assert tune_mod.lookup(spec, gpu="NVIDIA H100 80GB HBM3", ep=8, tokens=2048) is None
    assert [p.name for p in user.rglob("*")] == ["qwen3-30b-a3b", key.relpath().name]  # no temporaries


@pytest.mark.parametrize("field,value", [("mokgen", "0.0.1"), ("templates", "0" * 64), ("gpu", "NVIDIA H100"),
                                         ("format", 0), ("cutlass", "3.0.0"), ("cuda", "release 11.0")])
def test_lookup_ignores_a_mismatched_file_with_a_warning(tuned_dirs, field, value):
    user, _ = tuned_dirs
    spec = load_spec("qwen3-30b-a3b")
    key = TuneKey.of(spec, gpu=GPU, ep=1, tokens=16384)
    meta = _meta(**{field: value})
    if field in ("cuda", "cutlass") and tune_mod.metadata(GPU)[field] is None:
        pytest.skip(f"this machine cannot tell its {field} version")
    tune_mod.write_json(user / key.relpath(), _doc(spec, key, Candidate(1, 32, 1024, 4), meta))
    with pytest.warns(UserWarning, match=rf"was made for {field} .*ignored, the plan's defaults apply"):
        assert tune_mod.lookup(spec, gpu=GPU, ep=1, tokens=16384) is None


def test_mismatch_skips_versions_this_machine_cannot_tell():
    current = {"format": 1, "mokgen": "x", "gpu": "g", "templates": "t", "cuda": None, "cutlass": "4.2"}
    assert tune_mod.mismatch({**current, "cuda": "12.8"}, current) is None
    assert tune_mod.mismatch({**current, "cutlass": None}, current) is None
    assert "cutlass" in tune_mod.mismatch({**current, "cutlass": "4.1"}, current)
    assert tune_mod.mismatch(None, current) == "it has no _metadata block"


def test_lookup_skips_unreadable_files_and_can_be_switched_off(tuned_dirs, monkeypatch):
    user, package = tuned_dirs
    spec = load_spec("qwen3-30b-a3b")
    key = TuneKey.of(spec, gpu=GPU, ep=1, tokens=16384)
    (user / key.relpath()).parent.mkdir(parents=True)
    (user / key.relpath()).write_text("{not json")
    good = Candidate(1, 64, 2048, 4)
    tune_mod.write_json(package / key.relpath(), _doc(spec, key, good, _meta()))
    with pytest.warns(UserWarning, match="is unreadable"):
        assert tune_mod.lookup(spec, gpu=GPU, ep=1, tokens=16384).best == good  # the next root
    other = TuneKey.of(spec, gpu=GPU, ep=2, tokens=16384)
    tune_mod.write_json(user / key.relpath(), _doc(spec, other, good, _meta()))  # a file under the wrong name
    with pytest.warns(UserWarning, match="its key"):
        tune_mod.lookup(spec, gpu=GPU, ep=1, tokens=16384)
    monkeypatch.setenv("MOKGEN_TUNED", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tune_mod.lookup(spec, gpu=GPU, ep=1, tokens=16384) is None


def test_lookup_prefers_the_layer_over_the_local_stand_in(tuned_dirs, monkeypatch):
    user, _ = tuned_dirs
    spec = load_spec("kimi-k2.5")
    layer_key = TuneKey.of(spec, gpu=GPU, ep=8, tokens=2048)
    local_key = TuneKey.of(spec, gpu=GPU, ep=8, tokens=2048, workload="local")
    a, b = Candidate(2, 64, 4096, 4), Candidate(1, 64, 1024, 8)
    tune_mod.write_json(user / local_key.relpath(), _doc(spec, local_key, b, _meta()))
    got = tune_mod.lookup(spec, gpu=GPU, ep=8, tokens=2048)
    assert got.best == b and got.key.workload == "local"
    tune_mod.write_json(user / layer_key.relpath(), _doc(spec, layer_key, a, _meta()))
    assert tune_mod.lookup(spec, gpu=GPU, ep=8, tokens=2048).best == a
    # an entry made under other fixed plan options (here the shared expert outside) does not fit
    monkeypatch.setenv("MOKGEN_FUSE_SHARED", "0")
    with pytest.warns(UserWarning, match="was made for plan_options"):
        tune_mod.lookup(spec, gpu=GPU, ep=8, tokens=2048)


def test_impossible_values_in_a_file_are_skipped(tuned_dirs):
    user, _ = tuned_dirs
    spec = load_spec("qwen3-30b-a3b")
    key = TuneKey.of(spec, gpu=GPU, ep=1, tokens=16384)
    doc = _doc(spec, key, Candidate(1, 64, 1024, 4), _meta())
    doc["best"]["block_k"] = 48
    tune_mod.write_json(user / key.relpath(), doc)
    with pytest.warns(UserWarning, match="block_k must be one of"):
        assert tune_mod.lookup(spec, gpu=GPU, ep=1, tokens=16384) is None


def test_partial_file_resume_is_strict(tmp_path):
    cands = [Candidate(1, 64, 1024, 4), Candidate(1, 32, 1024, 4), Candidate(2, 64, 1024, 4)]
    meta = {"format": 1, "mokgen": "x"}
    partial = tmp_path / "f.json.partial"

    def write(doc):
        partial.write_text(json.dumps(doc))
        return tune_mod._read_partial(partial, meta, cands)

    good = {"_metadata": meta, "candidates": [c.to_json() for c in cands],
            "outcomes": [{"ms": 1.5, "error": None}, {"ms": None, "error": "spills"}, None]}
    got = write(good)
    assert got[0].ms == 1.5 and got[1] is None and got[2] is None  # failures are timed again
    none = [None] * 3
    assert write({**good, "_metadata": {"format": 1, "mokgen": "y"}}) == none
    assert write({**good, "candidates": good["candidates"][:2]}) == none
    assert write({**good, "outcomes": good["outcomes"] + [None]}) == none
    assert write({**good, "outcomes": [{"ms": "1.0"}, {"ms": float("inf")}, {"ms": True}]}) == none
    assert write([1, 2]) == none
    partial.write_text("{broken")
    assert tune_mod._read_partial(partial, meta, cands) == none


def test_tuned_build_options_yield_to_set_switches(monkeypatch):
    for var in ("MOKGEN_CLUSTER", "MOKGEN_BLOCK_K"):
        monkeypatch.delenv(var, raising=False)
    opts = env.plan_options_with({"cluster": 2, "block_k": 32})
    assert (opts["cluster"], opts["block_k"]) == (2, 32)
    assert env.plan_options_with(None) == env.plan_options()
    monkeypatch.setenv("MOKGEN_BLOCK_K", "64")
    opts = env.plan_options_with({"cluster": 2, "block_k": 32})
    assert (opts["cluster"], opts["block_k"]) == (2, 64)
    plan = make_plan(load_spec("qwen3-30b-a3b"), **opts)
    assert (plan.gemm_cluster, plan.gemm_block_k) == (2, 64)


def test_tuned_dir_default_and_switch(monkeypatch, tmp_path):
    monkeypatch.delenv("MOKGEN_TUNED_DIR", raising=False)
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path / "c"))
    assert env.tuned_dir() == tmp_path / "c" / "tuned"
    assert tune_mod.roots() == [tmp_path / "c" / "tuned", tune_mod.PACKAGE_TUNED]


# ---- tune() on a stand-in GPU ----------------------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch, tuned_dirs):
    """tune() with the GPU, the builds and the timer replaced: ``times[i]`` is candidate i's
    time (an Exception instance: it raises); returns (times, timed indexes, space). The stagger
    pass is off (STAGGER_TRY empty) unless a test sets it: ``times[("stagger", lead)]`` is then the
    time of the first pass's winner at that lead, its index in ``timed`` the same tuple."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: GPU)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(total_memory=141 << 30))
    spec = load_spec("qwen3-30b-a3b")
    space = search_space(spec, ep=1, tokens=2048, gpu_memory=141 << 30)
    times: dict[int, object] = {i: 2.0 + 0.1 * i for i in range(len(space.candidates))}
    timed: list[int] = []
    monkeypatch.setattr(tune_mod, "build_candidates", lambda *a, **k: {})
    monkeypatch.setattr(tune_mod, "STAGGER_TRY", ())

    def fake_timer(work, rows, iters, group=None):
        def time_one(c):
            i = space.candidates.index(c) if c in space.candidates else ("stagger", c.stagger)
            timed.append(i)
            if isinstance(times[i], Exception):
                raise times[i]
            return times[i]
        return time_one

    monkeypatch.setattr(tune_mod, "_layer_timer", fake_timer)
    return spec, space, times, timed


def test_tune_writes_the_winner_and_no_partial(fake_gpu, tuned_dirs):
    spec, space, times, timed = fake_gpu
    times[3] = 1.0
    times[5] = 0.995  # within 1% of candidate 3: a tie, the lower index wins
    times[2] = RuntimeError("launch failed")
    result = tune_mod.tune(spec, ep=1, tokens=2048, iters=20, confirm="rounds")
    n = len(space.candidates)
    # every candidate once, then the winner and the defaults in alternation
    assert timed == list(range(n)) + [0, 3] * tune_mod.CONFIRM_ROUNDS
    assert result.best_index == 3 and result.path == tuned_dirs[0] / TuneKey.of(spec, gpu=GPU, ep=1, tokens=2048).relpath()
    doc = json.loads(result.path.read_text())
    assert doc["best"] == space.candidates[3].to_json() and doc["default_ms"] == 2.0 and doc["best_ms"] == 1.0
    assert doc["confirm"] == {"candidate": 3, "rounds": tune_mod.CONFIRM_ROUNDS, "held": True,
                              "default_ms": [2.0] * tune_mod.CONFIRM_ROUNDS, "candidate_ms": [1.0] * tune_mod.CONFIRM_ROUNDS}
    assert doc["candidates"][2]["ms"] is None and doc["candidates"][2]["error"] == "launch failed"
    assert not list(tuned_dirs[0].rglob("*.partial"))
    assert tune_mod.lookup(spec, gpu=GPU, ep=1, tokens=2048).best == space.candidates[3]


def test_tune_resumes_successes_and_retries_failures(fake_gpu, tuned_dirs):
    spec, space, times, timed = fake_gpu
    key = TuneKey.of(spec, gpu=GPU, ep=1, tokens=2048)
    partial = tuned_dirs[0] / key.relpath().with_name(key.relpath().name + ".partial")
    outcomes = [{"ms": 5.0, "error": None}, {"ms": None, "error": "spills"}] + [None] * (len(space.candidates) - 2)
    tune_mod.write_json(partial, {"_metadata": tune_mod.metadata(GPU), "candidates": [c.to_json() for c in space.candidates],
                                  "outcomes": outcomes})
    logs: list[str] = []
    result = tune_mod.tune(spec, ep=1, tokens=2048, iters=20, log=logs.append, confirm="rounds")
    n = len(space.candidates)
    # the failure is timed again, the resumed success is not; then candidate 1 (2.1 ms against
    # the resumed 5.0) is confirmed in alternation with the defaults, which now take 2.0: it
    # does not hold, and the defaults win
    assert timed == list(range(1, n)) + [0, 1] * tune_mod.CONFIRM_ROUNDS
    assert result.outcomes[0].ms == 5.0 and result.outcomes[1].ms == times[1]
    assert result.best_index == 0 and result.default_ms == 2.0 and result.best_ms == 2.0
    assert result.confirm["held"] is False and result.confirm["candidate"] == 1
    assert any(line.startswith("resuming: 1 of") for line in logs)
    assert any("did not hold against the defaults" in line for line in logs)
    # --no-resume times everything again
    timed.clear()
    tune_mod.write_json(partial, {"_metadata": tune_mod.metadata(GPU), "candidates": [c.to_json() for c in space.candidates],
                                  "outcomes": outcomes})
    tune_mod.tune(spec, ep=1, tokens=2048, iters=20, resume=False, confirm="rounds")
    assert timed == list(range(len(space.candidates)))  # the defaults win the first pass: no confirmation


def test_tune_confirms_interleaved_by_default(fake_gpu, tuned_dirs, monkeypatch):
    """confirm="interleaved" (the default): the first pass's winner against the defaults in ABBA blocks of the
    pair timer (here its times: the candidate's per-launch 1.0 against the defaults' 2.0), the
    record in the file, the stored times the blocks' per-launch medians; a pair timer that shows
    no gain gives the defaults back; an unknown method is a clear error before anything runs."""
    spec, space, times, timed = fake_gpu
    times[3] = 1.0
    seen = []

    def fake_pairs(work, rows):
        def time_pairs(a, b, n):
            ia, ib = space.candidates.index(a), space.candidates.index(b)
            seen.append((ia, ib, n))
            return [(2 * times[ia], 2 * times[ib])] * n
        return time_pairs

    monkeypatch.setattr(tune_mod, "_pair_timer", fake_pairs)
    result = tune_mod.tune(spec, ep=1, tokens=2048, iters=20)
    assert timed == list(range(len(space.candidates)))  # no rounds of medians
    assert seen == [(0, 3, tune_mod.CONFIRM_BLOCKS)] and result.best_index == 3
    doc = json.loads(result.path.read_text())
    assert doc["confirm"]["method"] == "interleaved" and doc["confirm"]["held"] is True
    assert doc["default_ms"] == 2.0 and doc["best_ms"] == 1.0
    # the first pass's 1.0 does not hold in the blocks: 3.99 against 4.0 is inside the noise
    monkeypatch.setattr(tune_mod, "_pair_timer", lambda work, rows: lambda a, b, n: [(4.0, 3.99)] * n)
    logs = []
    result = tune_mod.tune(spec, ep=1, tokens=2048, iters=20, confirm="interleaved", resume=False, log=logs.append)
    assert result.best_index == 0 and any("did not hold against the defaults interleaved" in s for s in logs)
    doc = json.loads(result.path.read_text())
    assert doc["confirm"]["method"] == "interleaved" and doc["confirm"]["held"] is False
    with pytest.raises(InputError, match="confirm must be one of rounds, interleaved, got 'best-of-3'"):
        tune_mod.tune(spec, ep=1, tokens=2048, confirm="best-of-3")


def test_tune_all_failed_names_the_partial_file(fake_gpu, tuned_dirs):
    spec, space, times, timed = fake_gpu
    for i in times:
        times[i] = RuntimeError(f"out of memory {i}")
    with pytest.raises(InputError, match=r"every candidate failed \(the first: out of memory 0\); the outcomes are in .*\.partial"):
        tune_mod.tune(spec, ep=1, tokens=2048, iters=20)
    assert list(tuned_dirs[0].rglob("*.partial")) and not list(tuned_dirs[0].rglob("*.json"))


def test_tune_rejects_too_many_tokens_before_building(fake_gpu):
    spec, *_ = fake_gpu
    with pytest.raises(InputError, match=r"tokens per rank must be in 1\.\.16384, got 20000"):
        tune_mod.tune(spec, ep=1, tokens=20000)


def test_an_entry_tuned_under_a_pinned_switch_needs_that_switch(fake_gpu, monkeypatch):
    spec, space, times, timed = fake_gpu
    monkeypatch.setenv("MOKGEN_BLOCK_K", "64")
    tune_mod.tune(spec, ep=1, tokens=2048, iters=20)
    assert tune_mod.lookup(spec, gpu=GPU, ep=1, tokens=2048) is not None
    monkeypatch.delenv("MOKGEN_BLOCK_K")
    with pytest.warns(UserWarning, match="was made for plan_options"):
        assert tune_mod.lookup(spec, gpu=GPU, ep=1, tokens=2048) is None


def test_tune_stagger_pass_times_the_winner_at_each_lead(fake_gpu, tuned_dirs, monkeypatch):
    """The second pass: the first pass's winner at each lead of STAGGER_TRY, appended after the
    first pass's candidates, a failed lead a failed candidate; the winner then confirmed against
    the defaults as any other; the tuned entry builds the staggered kernel; a partial file of an
    interrupted second pass resumes it; MOKGEN_FWD_STAGGER holds the axis (no second pass)."""
    spec, space, times, timed = fake_gpu
    monkeypatch.setattr(tune_mod, "STAGGER_TRY", (2, 3))
    n = len(space.candidates)
    times[3] = 1.0
    times[("stagger", 2)] = 0.9
    times[("stagger", 3)] = RuntimeError("illegal instruction")
    logs: list[str] = []
    result = tune_mod.tune(spec, ep=1, tokens=2048, iters=20, confirm="rounds", log=logs.append)
    assert timed == list(range(n)) + [("stagger", 2), ("stagger", 3)] + [0, ("stagger", 2)] * tune_mod.CONFIRM_ROUNDS
    assert any(line.startswith(f"stagger pass: {space.candidates[3].label()} at lead(s) 2, 3") for line in logs)
    winner = dataclasses.replace(space.candidates[3], stagger=2)
    assert result.best_index == n and result.space.candidates[n:] == [winner, dataclasses.replace(winner, stagger=3)]
    doc = json.loads(result.path.read_text())
    assert doc["best"] == winner.to_json() and doc["best_index"] == n and doc["best_ms"] == 0.9
    assert [c["index"] for c in doc["candidates"]] == list(range(n + 2))
    assert doc["candidates"][n + 1]["error"] == "illegal instruction" and doc["candidates"][n + 1]["stagger"] == 3
    entry = tune_mod.lookup(spec, gpu=GPU, ep=1, tokens=2048)
    assert entry.best == winner
    assert make_plan(spec, **env.plan_options_with(entry.best.build_options())).gemm_stagger == 2
    # an interrupted second pass: the first pass and lead 2 timed, lead 3 not yet
    key = TuneKey.of(spec, gpu=GPU, ep=1, tokens=2048)
    partial = tuned_dirs[0] / key.relpath().with_name(key.relpath().name + ".partial")
    listed = list(result.space.candidates)
    outcomes = [{"ms": o.ms, "error": o.error} for o in result.outcomes[:n + 1]] + [None]
    tune_mod.write_json(partial, {"_metadata": tune_mod.metadata(GPU), "candidates": [c.to_json() for c in listed],
                                  "outcomes": outcomes})
    timed.clear()
    times[("stagger", 3)] = 0.5
    result = tune_mod.tune(spec, ep=1, tokens=2048, iters=20, confirm="rounds")
    assert timed == [("stagger", 3)] + [0, ("stagger", 3)] * tune_mod.CONFIRM_ROUNDS
    assert result.space.candidates[result.best_index] == dataclasses.replace(winner, stagger=3)
    # the switch holds the axis: every candidate at its lead, no second pass, the pin recorded
    timed.clear()
    monkeypatch.setenv("MOKGEN_FWD_STAGGER", "1")
    pinned = search_space(spec, ep=1, tokens=2048, gpu_memory=141 << 30)
    assert {c.stagger for c in pinned.candidates} == {1}
    assert tune_mod.metadata(GPU)["plan_options"]["pinned"] == {"stagger": 1}
    assert tune_mod.stagger_variants(spec, pinned.candidates[3]) == ([], [])


def test_same_bits_guard_fails_a_candidate_whose_bits_differ():
    """The timer's check of every candidate's output against the defaults': the reference is
    asked once; equal bits pass (NaN included); one ulp, another shape, a NaN moved, +0.0 for
    -0.0 or another dtype fail with a one-line KernelError naming the candidate; a list (the
    gradients) is compared tensor by tensor; a reference that cannot be made fails every
    candidate."""
    import torch

    from mokgen.errors import KernelError

    asked = []
    ref = torch.tensor([[1.0, -0.0, float("nan")], [3.0, 4.0, 5.0]], dtype=torch.bfloat16)
    guard = tune_mod.same_bits_guard(lambda: asked.append(1) or ref)
    guard(ref.clone(), "cluster 1, ...")
    guard(ref.clone(), "cluster 2, ...")
    assert asked == [1]
    one_ulp = ref.clone()
    one_ulp.view(torch.int16)[1, 0] += 1  # 3.0 -> 3.0156, the next bf16
    zero = ref.clone()
    zero[0, 1] = 0.0  # -0.0 -> +0.0: equal as numbers, not as bits
    for bad in (one_ulp, ref[:1].clone(), ref.flip(1).clone(), zero, ref.float()):
        with pytest.raises(KernelError, match=r"^stagger 2: its output differs from the defaults' in its bits"):
            guard(bad, "stagger 2")

    # lists (a training step's gradients): every tensor's bits, in order
    grads = [ref, ref.float()]
    guard = tune_mod.same_bits_guard(lambda: grads, what="gradients")
    guard([g.clone() for g in grads], "cluster 1")
    for bad in ([one_ulp, ref.float()], [ref.float(), ref], [ref], grads + [ref]):
        with pytest.raises(KernelError, match=r"^BK 32: its gradients differ from the defaults' in their bits"):
            guard(bad, "BK 32")

    def broken():
        raise KernelError("the defaults' output failed: launch timed out")

    guard = tune_mod.same_bits_guard(broken)
    with pytest.raises(KernelError, match="launch timed out"):
        guard(ref, "cluster 1")


def test_stagger_variants_where_the_consumers_can_stagger(monkeypatch):
    """Only the Hopper core's flow schedule on BF16 staggers; a lead the plan refuses is pruned with its
    reason; the winner's own lead is not tried again; the stagger is not among a tuned file's fixed
    plan options (files made before it still fit)."""
    from mokgen.spec import spec_from_dict

    for name in ("MOKGEN_FWD_STAGGER", "MOKGEN_GEMM_CORE", "MOKGEN_SCHEDULE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tune_mod, "STAGGER_TRY", (2, 3))
    spec = load_spec("qwen3.5-35b-a3b")
    base = tune_mod.default_candidate(spec)
    assert base.stagger == 0
    more, refused = tune_mod.stagger_variants(spec, base)
    assert [c.stagger for c in more] == [2, 3] and not refused
    assert all(dataclasses.replace(c, stagger=0) == base for c in more)
    assert [c.stagger for c in tune_mod.stagger_variants(spec, dataclasses.replace(base, stagger=2))[0]] == [3]
    assert tune_mod.stagger_variants(spec.with_target(numerics="mxfp8"), base) == ([], [])
    data = spec.model_dump(mode="json")
    data["moe_intermediate_size"] = 128
    more, refused = tune_mod.stagger_variants(spec_from_dict(data), base)
    assert [c.stagger for c in more] == [2] and [c.stagger for c, _ in refused] == [3]
    assert "exceeds a tile's 2 k-blocks" in refused[0][1]
    assert "stagger" not in tune_mod.metadata(GPU)["plan_options"]
    monkeypatch.setenv("MOKGEN_SCHEDULE", "phased")
    assert tune_mod.stagger_variants(spec, base) == ([], [])


# ---- command line --------------------------------------------------------------------------------


def test_cli_dry_run_lists_candidates_and_pruned(tuned_dirs):
    from test_cli import invoke

    code, out, err = invoke("tune", "qwen3-30b-a3b", "--ep", "8", "--tokens", "2048", "--dry-run")
    assert code == 0, err
    assert "(plan defaults)" in out and "the same as 4" in out
    n = len(search_space(load_spec("qwen3-30b-a3b"), ep=8, tokens=2048).candidates)
    assert f"{n} candidates" in out
    assert "pruned  cluster 1, BK 64, chunk 8192, ring 8, dispatch default: ring of 8 slots: the same as 4" in out
    assert "then the stagger pass: the winner at lead(s) 2, 3" in out


def test_cli_numerics_tunes_the_mxfp8_megakernels_space(tuned_dirs):
    """`mokgen tune --numerics mxfp8` searches the MXFP8 build's space (single CTAs, k-blocks of
    64: what the MX tiles build and are measured best at), not the BF16 one; its entries are
    keyed by numerics, so they never stand in for the BF16 file."""
    from test_cli import invoke

    spec = load_spec("kimi-k2.5")
    code, out, err = invoke("tune", "kimi-k2.5", "--numerics", "mxfp8", "--ep", "8", "--dry-run")
    assert code == 0, err
    mx = search_space(spec.with_target(numerics="mxfp8"), ep=8, tokens=2048).candidates
    bf16 = search_space(spec, ep=8, tokens=2048).candidates
    assert f"{len(mx)} candidates" in out and len(mx) < len(bf16)
    assert "BK 32" not in out and "cluster 1, BK 64, chunk 16384" in out
    # CTA pairs only with the expanded rows (MxTile's pairs measured slower, v0.55-v0.56)
    pair_lines = [line for line in out.splitlines() if "cluster 2" in line]
    assert pair_lines and all("expanded MX rows" in line for line in pair_lines)
    code, out, err = invoke("tune", "kimi-k2.5", "--ep", "8", "--dry-run")
    assert code == 0 and "cluster 2" in out, err
    mx_key = TuneKey.of(spec.with_target(numerics="mxfp8"), gpu=GPU, ep=8, tokens=2048, workload="local")
    assert mx_key.relpath() == Path("kimi-k2.5/nvidia-h200-mxfp8-ep8-t2048-local.json")
    assert mx_key.relpath() != TuneKey.of(spec, gpu=GPU, ep=8, tokens=2048, workload="local").relpath()


@pytest.mark.parametrize("args,message", [
    ((), "name at least one SPEC"),
    (("qwen3-30b-a3b", "--ep", "3"), "--ep 3 must divide num_experts (128)"),
    (("qwen3-30b-a3b", "--chunks", "1,x"), "--chunks must be comma-separated integers"),
    (("qwen3-30b-a3b", "--chunks", "0"), "--chunks must be positive integers"),
    (("qwen3-30b-a3b", "--chunks", "1024,2048"), "--chunks belongs to --chunk-sweep"),
    (("qwen3-30b-a3b", "--chunks", "1024", "--plots", "p"), "--chunks and --plots belong to --chunk-sweep"),
])
def test_cli_bad_input_is_one_line(tuned_dirs, args, message):
    from test_cli import _one_error_line, invoke

    line = _one_error_line(*invoke("tune", *args))
    assert message in line


def test_cli_without_a_gpu_says_so(tuned_dirs):
    import torch

    from test_cli import _one_error_line, invoke

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    line = _one_error_line(*invoke("tune", "qwen3-30b-a3b"))
    assert "needs a CUDA GPU" in line or "on a CUDA GPU" in line
    line = _one_error_line(*invoke("build", "qwen3-30b-a3b", "--ep", "1"))
    assert "needs both --ep and --tokens" in line
    line = _one_error_line(*invoke("build", "qwen3-30b-a3b", "--ep", "1", "--tokens", "4096"))
    assert "pass --gpu NAME" in line
    assert not tuned_dirs[0].exists()


# ---- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.nvcc  # builds the candidates' variants
def test_tune_writes_an_entry_the_layer_uses_with_the_same_bits(tuned_dirs):
    """A real tune of the tiny spec: the file is written with every candidate's outcome, the
    winner is chosen from them (the search's, where it held against the defaults in the interleaved
    confirmation, else the defaults), a resumed rerun times nothing again, and MoELayer picks the entry
    up; chunk size and pairs do not change the bits (DESIGN.md), so the tuned layer's output
    equals the untuned one's."""
    import torch

    from mokgen.ep import MoELayer
    from mokgen.spec import load_spec as load

    spec = load(str(TINY))
    result = tune_mod.tune(spec, ep=1, tokens=256, iters=20)
    doc = json.loads(result.path.read_text())
    assert result.path.is_relative_to(tuned_dirs[0])
    assert len(doc["candidates"]) == len(result.space.candidates) and doc["default_ms"] is not None
    times = [c["ms"] for c in doc["candidates"]]
    first, confirm = choose(times), doc["confirm"]
    if first == 0:
        assert doc["best_index"] == 0 and confirm is None
    else:  # the search's winner stands only if it held against the defaults, interleaved (tune's default)
        assert confirm["method"] == "interleaved" and confirm["candidate"] == first
        assert "error" not in confirm, f"the confirmation's timing failed: {confirm.get('error')}"
        assert len(confirm["default_ms"]) == len(confirm["candidate_ms"]) == tune_mod.CONFIRM_BLOCKS
        assert doc["best_index"] == (first if confirm["held"] else 0)
    assert not list(tuned_dirs[0].rglob("*.partial"))
    # resume: a partial file with every outcome makes the rerun time nothing
    partial = result.path.with_name(result.path.name + ".partial")
    tune_mod.write_json(partial, {"_metadata": doc["_metadata"], "candidates": [c.to_json() for c in result.space.candidates],
                                  "outcomes": [{"ms": 1.0 + i, "error": None} for i in range(len(times))]})
    logs = []
    again = tune_mod.tune(spec, ep=1, tokens=256, iters=20, log=logs.append)
    assert any(line.startswith("resuming:") for line in logs)
    assert again.best_index == 0 and again.outcomes[0].ms == 1.0
    tune_mod.write_json(result.path, doc)  # back to the measured entry
    layer = MoELayer(spec, max_tokens=256)
    assert layer.tuned_entry is not None and layer.tuned_entry.best == result.space.candidates[doc["best_index"]]
    plain = MoELayer(spec, max_tokens=256, tuned=False)
    assert plain.tuned_entry is None
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(256, spec.hidden_size, device="cuda").to(torch.bfloat16)
    ids = torch.stack([torch.randperm(spec.num_experts, device="cuda")[: spec.top_k] for _ in range(256)]).int()
    w = torch.rand(256, spec.top_k, device="cuda").softmax(-1)
    assert torch.equal(layer(x, ids, w), plain(x, ids, w))


# ---- how a layer takes an entry (CPU: the helpers MoELayer calls) ------------------------------------


def _entry(best: Candidate) -> "tune_mod.Entry":
    spec = load_spec("qwen3-30b-a3b")
    key = TuneKey.of(spec, gpu=GPU, ep=1, tokens=2048)
    return tune_mod.Entry(Path("/tuned") / key.relpath(), key, best, {})


def test_layer_takes_the_entry_and_explicit_values_win(monkeypatch):
    import torch

    from mokgen import ep as ep_mod

    spec = load_spec("qwen3-30b-a3b")
    best = Candidate(2, 32, 1024, 8, 24)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: GPU)
    monkeypatch.setattr(tune_mod, "lookup", lambda *a, **k: _entry(best))
    for var in ("MOKGEN_CLUSTER", "MOKGEN_BLOCK_K"):
        monkeypatch.delenv(var, raising=False)
    entry, options, runtime = ep_mod._tuned_choice(spec, None, 1, 2048, "cuda:0", True, None, (None, None, None))
    assert entry.best == best and (options["cluster"], options["block_k"]) == (2, 32) and runtime == (1024, 8, 24)
    _, _, runtime = ep_mod._tuned_choice(spec, None, 1, 2048, "cuda:0", True, None, (4096, None, 16))
    assert runtime == (4096, 8, 16)  # the caller's values win, the rest come from the entry
    entry, options, runtime = ep_mod._tuned_choice(spec, None, 1, 2048, "cuda:0", False, None, (None, None, None))
    assert entry is None and options == env.plan_options() and runtime == (None, None, None)
    given = {"cluster": 1, "block_k": 64}
    assert ep_mod._tuned_choice(spec, None, 1, 2048, "cuda:0", True, given, (None, 2, None)) == (None, given, (None, 2, None))

    def broken(*a, **k):
        raise OSError("disk gone")

    monkeypatch.setattr(tune_mod, "lookup", broken)
    with pytest.warns(UserWarning, match="looking up tuned parameters failed"):
        entry, options, _ = ep_mod._tuned_choice(spec, None, 1, 2048, "cuda:0", True, None, (None, None, None))
    assert entry is None and options == env.plan_options()


def test_a_stand_in_entry_sets_the_stand_ins_dispatch_but_not_a_real_ep_layers(monkeypatch):
    import torch

    from mokgen import bench
    from mokgen import ep as ep_mod

    spec = load_spec("kimi-k2.5")
    best = Candidate(2, 64, 4096, 8, 4)
    key = TuneKey.of(spec, gpu=GPU, ep=8, tokens=2048, workload="local")
    entry = tune_mod.Entry(Path("/tuned") / key.relpath(), key, best, {})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: GPU)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tune_mod, "lookup", lambda *a, **k: entry)
    # a real EP8 layer: the entry's build options, chunk and ring; its own dispatch default
    got, options, runtime = ep_mod._tuned_choice(spec, None, 8, 2048, "cuda:0", True, None, (None, None, None))
    assert got is entry and options["cluster"] == 2 and runtime == (4096, 8, None)
    assert ep_mod._tuned_choice(spec, None, 8, 2048, "cuda:0", True, None, (None, None, 12))[2] == (4096, 8, 12)
    # the stand-in the entry was timed on runs all of it
    kwargs = bench.local_layer_kwargs(spec, 8)
    assert (kwargs["chunk_rows"], kwargs["ring_chunks"], kwargs["dispatch_ctas"]) == (4096, 8, 4)
    # an entry timed on the real layer keeps its dispatch count at EP > 1
    layer_key = TuneKey.of(spec, gpu=GPU, ep=8, tokens=2048)
    monkeypatch.setattr(tune_mod, "lookup", lambda *a, **k: tune_mod.Entry(Path("/t") / layer_key.relpath(),
                                                                           layer_key, best, {}))
    assert ep_mod._tuned_choice(spec, None, 8, 2048, "cuda:0", True, None, (None, None, None))[2] == (4096, 8, 4)


def test_layer_falls_back_to_the_default_build_when_the_tuned_one_cannot_load(monkeypatch):
    from mokgen import ep as ep_mod
    from mokgen.errors import LoadError

    spec = load_spec("qwen3-30b-a3b")
    tuned_opts = env.plan_options_with({"cluster": 2, "block_k": 32})
    loaded = []

    def fake_load(spec_, options):
        loaded.append(options)
        if options == tuned_opts:
            raise LoadError("no build of it here and no nvcc")
        return "default kernel"

    monkeypatch.setattr(ep_mod, "load", fake_load)
    entry = _entry(Candidate(2, 32, 1024, 4))
    with pytest.warns(UserWarning, match="tuned build of qwen3-30b-a3b .* is not available"):
        kernel, options = ep_mod._load_agreed(spec, tuned_opts, None, entry)
    assert kernel == "default kernel" and options == env.plan_options() and loaded == [tuned_opts, env.plan_options()]
    # without an entry a load error is the user's to see, as is any other error with one
    with pytest.raises(LoadError):
        ep_mod._load_agreed(spec, tuned_opts, None, None)

    def other(spec_, options):
        raise RuntimeError("bad")

    monkeypatch.setattr(ep_mod, "load", other)
    with pytest.raises(RuntimeError, match="bad"):
        ep_mod._load_agreed(spec, tuned_opts, None, entry)


def test_shipped_tuned_files_fit_this_tree(monkeypatch):
    """Every file in mokgen/tuned/ was measured with this tree's kernel (render.kernel_digest), this
    mokgen version and the default plan options, and parses: an edit to the kernel's sources
    without a re-tune (or without removing the files) fails here instead of warning every H200
    user and running the defaults."""
    from mokgen import __version__, render

    from mokgen import env

    for name in env.PLAN_SWITCHES.values():
        monkeypatch.delenv(name, raising=False)
    files = sorted(tune_mod.PACKAGE_TUNED.glob("*/*.json"))
    kernel = render.kernel_digest()
    for path in files:
        doc = json.loads(path.read_text())
        meta = doc["_metadata"]
        assert meta["templates"] == kernel, f"{path}: tuned with other kernel sources: re-tune or remove it"
        assert meta["mokgen"] == __version__ and meta["format"] == tune_mod.FORMAT, path
        assert meta["plan_options"] == tune_mod.metadata(meta["gpu"])["plan_options"], path
        Candidate.from_json(doc["best"])
        assert path.parent.name in ALL_SPECS, path


def test_rekey_tool_rewrites_only_the_digest(tmp_path):
    """.ci/rekey_tuned.py's rewrite (run after .ci/sass_same.py finds the default builds' SASS
    unchanged): a file keyed to another digest gets the new one and is otherwise byte for byte
    the same; a file already keyed to it is left alone."""
    import importlib.util

    script = Path(__file__).resolve().parent.parent / ".ci" / "rekey_tuned.py"
    spec = importlib.util.spec_from_file_location("rekey_tuned", script)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    shipped = sorted(tune_mod.PACKAGE_TUNED.glob("*/*.json"))[0]
    text = shipped.read_text()
    old = json.loads(text)["_metadata"]["templates"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    stale, fresh = tmp_path / "a" / "x.json", tmp_path / "b" / "y.json"
    stale.write_text(text)
    new = "f" * len(old)
    fresh.write_text(text.replace(old, new))
    before = fresh.stat().st_mtime_ns
    assert tool.rekey(tmp_path, new) == [stale]
    assert stale.read_text() == text.replace(f'"templates": "{old}"', f'"templates": "{new}"')
    assert json.loads(stale.read_text())["_metadata"]["templates"] == new
    assert fresh.stat().st_mtime_ns == before
    assert tool.rekey(tmp_path, new) == []
    # --only: the named specs' files alone (another spec's stale file is left as it was)
    other = tmp_path / "c" / "z.json"
    other.parent.mkdir()
    other.write_text(text)
    stale.write_text(text)
    assert tool.rekey(tmp_path, new, ["a"]) == [stale]
    assert other.read_text() == text
    # the SASS checked first: a spec's MXFP8 build too where it ships an MXFP8 file
    mx_specs = sorted({p.parent.name for p in tune_mod.PACKAGE_TUNED.glob("*/*-mxfp8-*.json")})
    bf16_only = sorted({p.parent.name for p in tune_mod.PACKAGE_TUNED.glob("*/*.json")} - set(mx_specs))
    assert mx_specs and bf16_only
    assert tool.checked_builds([mx_specs[0], bf16_only[0]]) == [mx_specs[0], f"{mx_specs[0]}:mxfp8", bf16_only[0]]


@pytest.mark.gpu
def test_layer_timer_fails_a_candidate_whose_gradients_differ(monkeypatch):
    """The tuner's timer checks a training step's gradients beside the forward's output: with the
    backward's GEMMs switched to torch._grouped_mm after the defaults' reference was made
    (MOKGEN_BWD_GEMM=0: the same forward, other gradient bits), the same candidate fails on its
    gradients, which the forward's bits alone would not show."""
    from mokgen.errors import KernelError
    from mokgen.spec import load_spec as load

    spec = load("qwen3-30b-a3b")  # H and I tile-sized: the reference's backward is mokgen's GEMMs
    time_one = tune_mod._layer_timer(spec, 256, 20)
    default = tune_mod.default_candidate(spec)
    assert time_one(default) > 0
    monkeypatch.setenv("MOKGEN_BWD_GEMM", "0")
    with pytest.raises(KernelError, match=r"its gradients differ from the defaults' in their bits"):
        time_one(default)


@pytest.mark.gpu
@pytest.mark.nvcc
def test_pair_timer_times_both_layers_in_abba_blocks():
    """The interleaved confirmation's timer on a GPU: the defaults against themselves (two
    layers of one build) in ABBA blocks give pairs of positive times whose median ratio is near
    1, and the verdict's fields agree with each other. Whether the verdict holds is not asserted:
    two layers of one build, each with its own buffers, can differ by a few percent on a launch
    this short (an H100, v0.45: 0.968, its interval below 1), and the tuner's margin is for
    candidates, not for that."""
    from mokgen.spec import load_spec as load

    spec = load(str(TINY))
    space = search_space(spec, ep=1, tokens=256, gpu_memory=141 << 30)
    default = space.candidates[0]
    pairs = tune_mod._pair_timer(spec, 256)(default, default, 20)
    assert len(pairs) == 20 and all(a > 0 and b > 0 for a, b in pairs)
    v = tune_mod.interleaved_verdict(pairs)
    assert 0.9 < v["ratio"] < 1.1, v
    assert v["ratio_lo"] <= v["ratio"] <= v["ratio_hi"], v
    assert v["held"] == (v["ratio"] < 1 - tune_mod.NOISE and v["ratio_hi"] < 1), v


def test_the_mxfp8_space_keeps_to_what_the_mx_tiles_build():
    """numerics mxfp8: no 32-wide k-blocks, no bulk dispatch among the candidates (make_plan
    refuses them); both forms (v0.57), CTA pairs only in the expanded one (MxTile's pairs measured
    slower); the rings and chunks searched as for bf16; MOKGEN_MX_FORM holds the form's axis."""
    from mokgen.spec import load_spec

    three = {(1, 64, "copy", "codes"), (1, 64, "copy", "expand"), (2, 64, "copy", "expand")}
    for name, default in (("kimi-k2.5", (2, "expand")), ("qwen3-30b-a3b", (1, "codes"))):  # v0.58's defaults
        spec = load_spec(name).with_target(numerics="mxfp8")
        space = search_space(spec, ep=8, tokens=2048, distributed=True)
        assert (space.candidates[0].cluster, space.candidates[0].mx_form) == default, name
        assert {(c.cluster, c.block_k, c.pull_mode, c.mx_form) for c in space.candidates} == three, name
    spec = load_spec("kimi-k2.5").with_target(numerics="mxfp8")
    assert len({(c.chunk_rows, c.ring_chunks) for c in space.candidates}) > 1
    # bf16 specs have one form
    assert {c.mx_form for c in search_space(load_spec("kimi-k2.5"), ep=8, tokens=2048).candidates} == {"codes"}


def test_the_mxfp8_space_under_the_weights_raw_has_the_expanded_form_only(monkeypatch):
    """MOKGEN_MX_FWD_WEIGHTS=raw (v0.68): the plan refuses the raw weights with codes, so the space
    holds the expanded form alone (single CTAs and pairs where the pair axis is open) and every
    candidate's build plans."""
    from mokgen import env
    from mokgen.plan import make_plan
    from mokgen.spec import load_spec

    monkeypatch.setenv("MOKGEN_MX_FWD_WEIGHTS", "raw")
    for name in ("kimi-k2.5", "qwen3-30b-a3b"):
        spec = load_spec(name).with_target(numerics="mxfp8")
        space = search_space(spec, ep=8, tokens=2048, distributed=True)
        assert {c.mx_form for c in space.candidates} == {"expand"}, name
        assert {c.cluster for c in space.candidates} == {1, 2}, name
        for c in space.candidates:
            assert make_plan(spec, **env.plan_options_with(c.build_options())).mx_fwd_weights == "raw"
