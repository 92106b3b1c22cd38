"""mokgen.plan: build names, identifiers, derived figures, plan errors and the cache key. CPU only."""

from __future__ import annotations

import re

import pytest

import mokgen.plan as plan_mod
from mokgen import build as build_mod
from mokgen.errors import PlanError
from mokgen.plan import (
    Plan,
    build_name,
    cache_key,
    figures,
    make_plan,
    op_identifier,
    smem_bytes,
)
from mokgen.spec import bundled_specs, load_spec

ALL_SPECS = sorted(bundled_specs())

EXPECTED_NAMES = {
    "kimi-k2.5": "moe_kimi-k2.5_bf16_h7168_i2048_e384_k8_sm90a",
    "glm-5.2": "moe_glm-5.2_bf16_h6144_i2048_e256_k8_sm90a",
    "qwen3.5-397b-a17b": "moe_qwen3.5-397b-a17b_bf16_h4096_i1024_e512_k10_sm90a",
    "deepseek-v4-pro": "moe_deepseek-v4-pro_bf16_h7168_i3072_e384_k6_sm90a",
    "deepseek-v3": "moe_deepseek-v3_bf16_h7168_i2048_e256_k8_sm90a",
    "qwen3-30b-a3b": "moe_qwen3-30b-a3b_bf16_h2048_i768_e128_k8_sm90a",
    "qwen3.5-35b-a3b": "moe_qwen3.5-35b-a3b_bf16_h2048_i512_e256_k8_sm90a",
}

KEY_ARGS = dict(
    sources_digest="ab" * 32,
    toolchain={
        "nvcc_version": "13.0.88",
        "cutlass_version": "4.2.0",
        "arch": "sm_90a",
        "flags": ["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
    },
)


def test_expected_names_cover_every_bundled_spec():
    assert set(EXPECTED_NAMES) == set(ALL_SPECS)


@pytest.mark.parametrize("name", ALL_SPECS)
def test_build_name_every_bundled_spec(name):
    spec = load_spec(name)
    got = build_name(spec)
    assert got == EXPECTED_NAMES[name]
    # filename-safe: no separators, no spaces, nothing a shell or a file system needs quoted
    assert re.fullmatch(r"[a-z0-9._\-]+", got), got
    # make_plan agrees with build_name (it is the one place names are formatted)
    assert make_plan(spec).name == got


def test_build_name_follows_numerics():
    spec = load_spec("kimi-k2.5").with_target(numerics="mxfp8")
    assert build_name(spec) == "moe_kimi-k2.5_mxfp8_h7168_i2048_e384_k8_sm90a"


@pytest.mark.parametrize("name", ALL_SPECS)
def test_op_identifier_is_a_valid_identifier(name):
    ident = op_identifier(build_name(load_spec(name)))
    assert ident.isidentifier(), ident
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", ident)
    assert "-" not in ident and "." not in ident


def test_op_identifier_distinguishes_bundled_specs():
    idents = {op_identifier(build_name(load_spec(n))) for n in ALL_SPECS}
    assert len(idents) == len(ALL_SPECS)


# ---- figures ----------------------------------------------------------------------------------


def test_figures_kimi_ep8_2048_tokens():
    spec = load_spec("kimi-k2.5")
    f = figures(spec, ep=8, tokens=2048)
    H, I, E, K, T, ep = 7168, 2048, 384, 8, 2048, 8
    expert_bytes = 3 * H * I * 2
    assert f["spec"] == "kimi-k2.5"
    assert f["ep"] == ep
    assert f["tokens_per_rank"] == T
    assert f["flops_per_token_routed_fwd"] == 6 * K * H * I == 704_643_072
    assert f["flops_per_token_shared_fwd"] == 6 * 1 * H * 2048
    assert f["flops_per_token_fwd"] == 6 * K * H * I + 6 * H * 2048
    assert f["bytes_dispatched_per_token"] == K * H * 2 and f["dispatch_bytes_vs_bf16"] == 1.0
    assert f["routing_bytes_per_token"] == K * 8
    assert f["expert_weight_bytes"] == expert_bytes == 88_080_384
    assert f["routed_weight_bytes_total"] == E * expert_bytes
    assert f["shared_weight_bytes"] == 3 * H * 2048 * 2
    assert f["local_experts"] == 48
    assert f["routed_weight_bytes_per_rank"] == 48 * expert_bytes
    b = f["buffers_per_rank"]
    assert b["x_send"] == T * H * 2
    assert b["routing"] == T * K * 8
    assert b["combine_slots"] == T * K * H * 2
    assert b["expected_rows"] == T * K
    assert b["worst_case_rows"] == T * K * ep  # 48 local experts >= k: a token can send all k here
    assert b["intermediate_expected"] == T * K * I * 2


def test_figures_in_mxfp8_count_codes_and_scales():
    """numerics mxfp8: dispatched rows, the send buffer, h and the routed weights as E4M3 codes plus
    one E8M0 scale per 32 (0.516x bf16); the combine and the shared expert stay bf16."""
    from mokgen.plan import row_bytes

    spec = load_spec("kimi-k2.5")
    H, I, K = spec.hidden_size, spec.moe_intermediate_size, spec.top_k
    bf, mx = figures(spec, ep=8, tokens=2048), figures(spec.with_target(numerics="mxfp8"), ep=8, tokens=2048)
    assert mx["bytes_dispatched_per_token"] == K * (H + H // 32) == 59_136
    assert mx["dispatch_bytes_vs_bf16"] == pytest.approx(0.515625)
    assert mx["expert_weight_bytes"] == 3 * (H * I + H * I // 32)
    assert mx["buffers_per_rank"]["x_send"] == 2048 * (H + H // 32)
    assert mx["buffers_per_rank"]["intermediate_expected"] == 2048 * K * (I + I // 32)
    for key in ("shared_weight_bytes", "routing_bytes_per_token", "flops_per_token_fwd"):
        assert mx[key] == bf[key], key
    assert mx["buffers_per_rank"]["combine_slots"] == bf["buffers_per_rank"]["combine_slots"]
    assert row_bytes(64) == 128 and row_bytes(64, "mxfp8") == 66
    with pytest.raises(ValueError, match="numerics must be bf16 or mxfp8"):
        row_bytes(64, "fp8")


def test_figures_default_tokens_and_ep():
    spec = load_spec("qwen3-30b-a3b")
    f = figures(spec)
    assert f["ep"] == 1
    assert f["tokens_per_rank"] == spec.target.max_tokens_per_rank
    assert f["local_experts"] == spec.num_experts
    assert f["flops_per_token_shared_fwd"] == 0 and f["shared_weight_bytes"] == 0


def test_figures_worst_case_rows_bounded_by_local_experts():
    """A token picks k distinct experts: one rank can receive at most min(k, local experts) of
    its pairs. deepseek-v3 at EP 64 holds 4 experts per rank with k = 8."""
    spec = load_spec("deepseek-v3")
    f = figures(spec, ep=64, tokens=2048)
    assert f["local_experts"] == 4
    assert f["buffers_per_rank"]["worst_case_rows"] == 2048 * 64 * 4


def test_figures_zero_tokens():
    f = figures(load_spec("kimi-k2.5"), ep=8, tokens=0)
    assert f["tokens_per_rank"] == 0
    assert all(v == 0 for v in f["buffers_per_rank"].values())


@pytest.mark.parametrize(
    "name, kwargs, pattern",
    [
        ("kimi-k2.5", dict(ep=7), r"ep \(7\) must divide num_experts \(384\)"),
        ("kimi-k2.5", dict(ep=0), r"ep must be >= 1"),
        ("kimi-k2.5", dict(ep=128), r"ep \(128\) exceeds target.max_ep_ranks \(64\)"),
        ("qwen3-30b-a3b", dict(ep=2), r"ep \(2\) exceeds target.max_ep_ranks \(1\)"),
        ("kimi-k2.5", dict(ep=8, tokens=16385), r"tokens \(16385\) must be in 0..target.max_tokens_per_rank \(16384\)"),
        ("kimi-k2.5", dict(ep=8, tokens=-1), r"tokens \(-1\)"),
    ],
)
def test_figures_errors_are_one_line_plan_errors(name, kwargs, pattern):
    spec = load_spec(name)
    with pytest.raises(PlanError, match=pattern) as info:
        figures(spec, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{name}: ")


# ---- make_plan --------------------------------------------------------------------------------


def test_make_plan_mxfp8_takes_the_hopper_flow_schedule_without_fusion_and_pairs_on_request():
    """numerics mxfp8 (mx_tile.cuh in the megakernel): the fused shared expert is dropped, MxTile's
    CTA pairs are built when asked for (v0.55); options the MX tiles do not have are refused with
    one line. The clusters and forms left to the plan follow default_mx_form (v0.58)."""
    spec = load_spec("qwen3.5-35b-a3b").with_target(numerics="mxfp8")  # fuses its shared expert in bf16
    plan = make_plan(spec)
    assert plan.numerics == "mxfp8" and plan.gemm_cluster == 1 and not plan.fuse_shared
    assert plan.gemm_core == "wgmma" and plan.schedule == "flow" and plan.gemm_block_k == 64
    kimi = load_spec("kimi-k2.5").with_target(numerics="mxfp8")
    paired = make_plan(kimi, cluster=2, mx_form="codes")
    assert paired.gemm_cluster == 2 and paired.numerics == "mxfp8" and not paired.fuse_shared
    assert smem_bytes(paired) == smem_bytes(make_plan(kimi, cluster=1))  # pairs share operands, not stages
    # a stage: A's 128 x 64 codes, B's 256 x 64 bf16, the k128 block's scales, 1024-aligned
    assert smem_bytes(plan) == plan.gemm_stages * 41984 + 2 * plan.gemm_stages * 8 + 1024
    # the expanded form (v0.57): the bf16 HopperTiles' stage, A's and B's bf16 (128 + 256) x 64
    assert plan.mx_form == "codes" and make_plan(spec, mx_form="expand").mx_form == "expand"
    assert smem_bytes(make_plan(spec, mx_form="expand")) == plan.gemm_stages * 49152 + 2 * plan.gemm_stages * 8 + 1024
    assert make_plan(load_spec("kimi-k2.5"), mx_form="expand").mx_form == "codes"  # bf16 plans have one form
    for options, what in (({"gemm_core": "mma_sync"}, "gemm_core wgmma"), ({"schedule": "phased"}, "schedule flow"),
                          ({"block_k": 32}, "block_k 64"), ({"pull_mode": "bulk"}, "pull_mode copy"),
                          ({"stagger": 1}, "in lockstep"), ({"mx_form": "fp8"}, "mx_form must be one of codes, expand")):
        with pytest.raises(PlanError, match=what) as info:
            make_plan(spec, **options)
        assert "\n" not in str(info.value) and str(info.value).startswith(f"{spec.name}: ")


@pytest.mark.parametrize("name", ALL_SPECS)
def test_make_plan_copies_the_spec(name):
    spec = load_spec(name)
    plan = make_plan(spec)
    assert plan.spec_name == spec.name
    assert (plan.hidden_size, plan.intermediate_size, plan.num_experts, plan.top_k) == (
        spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.top_k,
    )
    assert plan.clamp_limit == spec.activation.clamp_limit
    assert plan.max_tokens_per_rank == spec.target.max_tokens_per_rank
    assert plan.abi_version == plan_mod.ABI_VERSION


def test_clamp_limit_literal():
    assert make_plan(load_spec("deepseek-v4-pro")).clamp_limit_literal == "10.0f"
    assert make_plan(load_spec("kimi-k2.5")).clamp_limit_literal == "0.0f"


# ---- cache key --------------------------------------------------------------------------------


def _changed(value):
    if value is None:
        return 1.5
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value + "x"
    raise AssertionError(f"no change rule for {value!r}")


def test_cache_key_is_deterministic():
    spec = load_spec("kimi-k2.5")
    a = cache_key(make_plan(spec), **KEY_ARGS)
    b = cache_key(make_plan(load_spec("kimi-2.5")), **KEY_ARGS)
    assert a == b
    assert re.fullmatch(r"[0-9a-f]{64}", a)
    # the toolchain dict's insertion order does not matter (canonical JSON, sorted keys)
    reordered = dict(reversed(list(KEY_ARGS["toolchain"].items())))
    assert cache_key(make_plan(spec), sources_digest=KEY_ARGS["sources_digest"], toolchain=reordered) == a


@pytest.mark.parametrize("field", sorted(Plan.model_fields))
def test_cache_key_changes_with_every_plan_field(field):
    plan = make_plan(load_spec("deepseek-v4-pro"))
    base = cache_key(plan, **KEY_ARGS)
    other = plan.model_copy(update={field: _changed(getattr(plan, field))})
    assert cache_key(other, **KEY_ARGS) != base


def test_cache_key_changes_with_sources_digest():
    plan = make_plan(load_spec("kimi-k2.5"))
    base = cache_key(plan, **KEY_ARGS)
    assert cache_key(plan, sources_digest="cd" * 32, toolchain=KEY_ARGS["toolchain"]) != base


def test_cache_key_changes_with_mokgen_version(monkeypatch):
    plan = make_plan(load_spec("kimi-k2.5"))
    base = cache_key(plan, **KEY_ARGS)
    monkeypatch.setattr(plan_mod, "__version__", plan_mod.__version__ + ".post1")
    assert cache_key(plan, **KEY_ARGS) != base


def _toolchain(nvcc_version="13.0.88", cutlass_version="4.2.0"):
    return build_mod.Toolchain(
        nvcc="/opt/cuda/bin/nvcc", nvcc_version=nvcc_version,
        cutlass_include="/opt/cutlass/include", cutlass_version=cutlass_version,
    )


def _key_with(tc, plan):
    return cache_key(plan, sources_digest=KEY_ARGS["sources_digest"], toolchain=tc.key_fields(plan.arch))


def test_cache_key_changes_with_toolchain(monkeypatch):
    plan = make_plan(load_spec("kimi-k2.5"))
    base = _key_with(_toolchain(), plan)
    assert _key_with(_toolchain(nvcc_version="13.0.89"), plan) != base
    assert _key_with(_toolchain(cutlass_version="4.2.1"), plan) != base
    # paths of the toolchain do not enter the key, only versions, arch and flags
    moved = build_mod.Toolchain("/elsewhere/nvcc", "13.0.88", "/elsewhere/include", "4.2.0")
    assert _key_with(moved, plan) == base
    monkeypatch.setattr(build_mod, "BASE_FLAGS", build_mod.BASE_FLAGS + ["-DMOKGEN_EXTRA"])
    assert _key_with(_toolchain(), plan) != base


def test_cache_key_changes_with_arch_flags(monkeypatch):
    plan = make_plan(load_spec("kimi-k2.5"))
    base = _key_with(_toolchain(), plan)
    monkeypatch.setitem(build_mod.ARCH_FLAGS, "sm_90a", ["-gencode=arch=compute_90a,code=[sm_90a,compute_90a]"])
    assert _key_with(_toolchain(), plan) != base


def test_cache_key_ignores_spec_fields_outside_the_plan():
    """Description, aliases, routing rules and max_ep_ranks do not change the compiled code."""
    spec = load_spec("kimi-k2.5")
    base = cache_key(make_plan(spec), **KEY_ARGS)
    data = spec.model_dump()
    data["description"] = "something else"
    data["aliases"] = ()
    data["routing"]["routed_scaling_factor"] = 1.0
    data["target"]["max_ep_ranks"] = 8
    from mokgen.spec import spec_from_dict

    assert cache_key(make_plan(spec_from_dict(data)), **KEY_ARGS) == base
    # ... but the compile-time token limit does
    assert cache_key(make_plan(spec.with_target(max_tokens_per_rank=4096)), **KEY_ARGS) != base


def test_schedule_option():
    spec = load_spec("qwen3-30b-a3b")
    assert make_plan(spec).schedule == "flow"
    assert make_plan(spec, schedule="phased").schedule == "phased"
    assert make_plan(spec, gemm_core="mma_sync").schedule == "phased"  # the portable core has one
    with pytest.raises(PlanError, match="schedule must be one of flow, phased"):
        make_plan(spec, schedule="eager")
    a = cache_key(make_plan(spec), **KEY_ARGS)
    assert cache_key(make_plan(spec, schedule="phased"), **KEY_ARGS) != a


def test_schedule_from_environment(monkeypatch):
    from mokgen import env
    from mokgen.errors import ToolchainError

    monkeypatch.setenv("MOKGEN_SCHEDULE", "phased")
    assert env.plan_options() == {"gemm_core": "wgmma", "schedule": "phased", "cluster": None, "fuse_shared": None,
                                  "block_k": 64, "pull_unroll": 12, "pull_mode": "copy", "dispatch_join": True,
                                  "stagger": 0, "mx_form": None, "mx_fwd_weights": "values"}
    monkeypatch.setenv("MOKGEN_SCHEDULE", "fast")
    with pytest.raises(ToolchainError, match="MOKGEN_SCHEDULE must be flow or phased"):
        env.plan_options()


def _check_switch(monkeypatch, var, option, good, want, bad, message):
    """Environment switch ``var``: ``good`` gives plan option ``option`` == ``want``; ``bad`` is a
    ToolchainError matching ``message``."""
    from mokgen import env
    from mokgen.errors import ToolchainError

    monkeypatch.setenv(var, good)
    assert env.plan_options()[option] == want
    monkeypatch.setenv(var, bad)
    with pytest.raises(ToolchainError, match=message):
        env.plan_options()


def test_cluster_option(monkeypatch):
    from mokgen.plan import CLUSTER_MIN_HIDDEN

    # the measured default (docs/perf-notes.md, v0.6): pairs from CLUSTER_MIN_HIDDEN on
    for name in sorted(bundled_specs()):
        spec = load_spec(name)
        assert make_plan(spec).gemm_cluster == (2 if spec.hidden_size >= CLUSTER_MIN_HIDDEN else 1), name
        assert make_plan(spec, schedule="phased").gemm_cluster == 1, name
    assert make_plan(load_spec("kimi-k2.5")).gemm_cluster == 2
    assert make_plan(load_spec("kimi-k2.5"), cluster=1).gemm_cluster == 1
    spec = load_spec("qwen3-30b-a3b")
    assert make_plan(spec).gemm_cluster == 1
    assert make_plan(spec, cluster=2).gemm_cluster == 2
    # pairs need the Hopper core's flow schedule; elsewhere the option is ignored
    assert make_plan(spec, cluster=2, schedule="phased").gemm_cluster == 1
    assert make_plan(spec, cluster=2, gemm_core="mma_sync").gemm_cluster == 1
    with pytest.raises(PlanError, match="cluster must be one of 1, 2"):
        make_plan(spec, cluster=4)
    assert cache_key(make_plan(spec, cluster=2), **KEY_ARGS) != cache_key(make_plan(spec), **KEY_ARGS)
    _check_switch(monkeypatch, "MOKGEN_CLUSTER", "cluster", "2", 2, "two", "MOKGEN_CLUSTER must be 1 or 2")
    monkeypatch.setenv("MOKGEN_CLUSTER", "1")
    from mokgen import env

    assert make_plan(load_spec("kimi-k2.5"), **env.plan_options()).gemm_cluster == 1


def test_fuse_shared_option(monkeypatch):
    from mokgen import env
    from mokgen.plan import can_fuse_shared

    for name in sorted(bundled_specs()):
        spec = load_spec(name)
        se = spec.shared_experts
        want = se.count == 1 and se.intermediate_size == spec.moe_intermediate_size
        assert can_fuse_shared(spec) == want, name
        # on by default wherever the plan can, CTAs alone or in pairs (the large hidden sizes)
        assert make_plan(spec).fuse_shared == want, name
        assert make_plan(spec, cluster=1).fuse_shared == want, name
        assert make_plan(spec, cluster=2).fuse_shared == want, name
        assert make_plan(spec, fuse_shared=False).fuse_shared is False, name
        assert make_plan(spec, fuse_shared=True).fuse_shared == want, name
    assert make_plan(load_spec("kimi-k2.5")).gemm_cluster == 2 and make_plan(load_spec("kimi-k2.5")).fuse_shared
    spec = load_spec("qwen3.5-35b-a3b")
    assert make_plan(spec, fuse_shared=True, cluster=2).fuse_shared
    assert not make_plan(spec, fuse_shared=True, schedule="phased").fuse_shared
    assert not make_plan(spec, fuse_shared=True, gemm_core="mma_sync").fuse_shared
    assert cache_key(make_plan(spec, fuse_shared=False), **KEY_ARGS) != cache_key(make_plan(spec), **KEY_ARGS)
    assert make_plan(spec).fuse_shared is True
    monkeypatch.setenv("MOKGEN_FUSE_SHARED", "1")
    assert env.plan_options()["fuse_shared"] is True
    monkeypatch.setenv("MOKGEN_FUSE_SHARED", "0")
    assert env.plan_options()["fuse_shared"] is False
    assert make_plan(spec, **env.plan_options()).fuse_shared is False


def test_block_k_option(monkeypatch):
    spec = load_spec("kimi-k2.5")
    a, b = make_plan(spec), make_plan(spec, block_k=32)
    assert (a.gemm_block_k, a.gemm_stages) == (64, 4) and (b.gemm_block_k, b.gemm_stages) == (32, 9)
    assert cache_key(a, **KEY_ARGS) != cache_key(b, **KEY_ARGS)
    with pytest.raises(PlanError, match="block_k must be one of 64, 32"):
        make_plan(spec, block_k=128)
    _check_switch(monkeypatch, "MOKGEN_BLOCK_K", "block_k", "32", 32, "16", "MOKGEN_BLOCK_K must be 64 or 32")


def test_pull_mode_option(monkeypatch):
    spec = load_spec("kimi-k2.5")
    a, b = make_plan(spec), make_plan(spec, pull_mode="bulk")
    assert (a.pull_mode, b.pull_mode) == ("copy", "bulk")
    assert cache_key(a, **KEY_ARGS) != cache_key(b, **KEY_ARGS)
    with pytest.raises(PlanError, match="pull_mode must be one of copy, bulk"):
        make_plan(spec, pull_mode="dma")
    with pytest.raises(PlanError, match="pull_mode bulk needs the Hopper core"):
        make_plan(spec, gemm_core="mma_sync", pull_mode="bulk")
    _check_switch(monkeypatch, "MOKGEN_PULL_MODE", "pull_mode", "bulk", "bulk", "tma",
                  "MOKGEN_PULL_MODE must be copy or bulk")


def test_mx_form_option(monkeypatch):
    """MOKGEN_MX_FORM: an MXFP8 build's form (v0.57); bf16 plans have one form."""
    spec = load_spec("deepseek-v3").with_target(numerics="mxfp8")
    assert make_plan(spec, mx_form="codes").mx_form == "codes" and make_plan(spec, mx_form="expand").mx_form == "expand"
    _check_switch(monkeypatch, "MOKGEN_MX_FORM", "mx_form", "expand", "expand", "fp8",
                  "MOKGEN_MX_FORM must be codes or expand")


def test_mx_fwd_weights_option(monkeypatch):
    """MOKGEN_MX_FWD_WEIGHTS (v0.68): an MXFP8 build whose tiles quantize the bf16 weights takes
    the expanded form (left to the plan, it is chosen; asked for codes, one line); its own cache
    key; a tuned form of codes gives way to it while a switch-set form does not; bf16 plans have
    one kind of weights."""
    from mokgen import env

    kimi = load_spec("kimi-k2.5").with_target(numerics="mxfp8")
    small = load_spec("qwen3-30b-a3b").with_target(numerics="mxfp8")
    assert make_plan(kimi).mx_fwd_weights == "values" and make_plan(small).mx_form == "codes"
    raw = make_plan(kimi, mx_fwd_weights="raw")
    assert (raw.mx_fwd_weights, raw.mx_form, raw.gemm_cluster) == ("raw", "expand", 2)
    assert cache_key(raw, **KEY_ARGS) != cache_key(make_plan(kimi), **KEY_ARGS)
    raw = make_plan(small, mx_fwd_weights="raw")
    assert (raw.mx_fwd_weights, raw.mx_form, raw.gemm_cluster) == ("raw", "expand", 1)
    assert make_plan(small, mx_fwd_weights="raw", cluster=2).gemm_cluster == 2
    with pytest.raises(PlanError, match="mx_fwd_weights raw needs mx_form expand") as info:
        make_plan(small, mx_fwd_weights="raw", mx_form="codes")
    assert "\n" not in str(info.value)
    with pytest.raises(PlanError, match="mx_fwd_weights must be one of values, raw, got 'bits'"):
        make_plan(small, mx_fwd_weights="bits")
    assert make_plan(load_spec("kimi-k2.5"), mx_fwd_weights="raw").mx_fwd_weights == "values"  # bf16
    _check_switch(monkeypatch, "MOKGEN_MX_FWD_WEIGHTS", "mx_fwd_weights", "raw", "raw", "codes",
                  "MOKGEN_MX_FWD_WEIGHTS must be auto or values or raw")
    monkeypatch.setenv("MOKGEN_MX_FWD_WEIGHTS", "auto")  # the layer's own build is the values one
    assert env.plan_options()["mx_fwd_weights"] == "values" and env.mx_fwd_weights_auto()
    monkeypatch.delenv("MOKGEN_MX_FWD_WEIGHTS")  # auto by default since v0.69
    assert env.mx_fwd_weights_auto() and env.plan_options()["mx_fwd_weights"] == "values"
    monkeypatch.setenv("MOKGEN_MX_FWD_WEIGHTS", "values")
    assert not env.mx_fwd_weights_auto()
    monkeypatch.delenv("MOKGEN_MX_FWD_WEIGHTS")
    tuned = {"mx_form": "codes", "cluster": 1}
    assert env.plan_options_with(tuned)["mx_form"] == "codes"
    monkeypatch.setenv("MOKGEN_MX_FWD_WEIGHTS", "raw")
    options = env.plan_options_with(tuned)
    assert options["mx_form"] is None and options["cluster"] == 1
    assert make_plan(small, **options).mx_form == "expand"
    monkeypatch.setenv("MOKGEN_MX_FORM", "codes")  # asked for by a switch: refused, not overridden
    with pytest.raises(PlanError, match="mx_fwd_weights raw needs mx_form expand"):
        make_plan(small, **env.plan_options_with(tuned))


def test_mxfp8_default_form_and_cluster_by_the_pair_rule(monkeypatch):
    """v0.58 (docs/perf-notes.md): an MXFP8 build left to the plan takes the expanded form in CTA
    pairs where the BF16 rule pairs (hidden from CLUSTER_MIN_HIDDEN) and MxTile's codes in single
    CTAs elsewhere; a cluster asked for takes the form measured best there, a form asked for its
    own cluster (pairs only for the expanded form where the rule pairs); the switches do the same."""
    from mokgen import env
    from mokgen.plan import CLUSTER_MIN_HIDDEN, default_mx_form

    for name in sorted(bundled_specs()):
        spec = load_spec(name).with_target(numerics="mxfp8")
        big = spec.hidden_size >= CLUSTER_MIN_HIDDEN
        plan = make_plan(spec)
        assert (plan.gemm_cluster, plan.mx_form) == ((2, "expand") if big else (1, "codes")), name
        assert (make_plan(spec, cluster=1).mx_form, make_plan(spec, cluster=2).mx_form) == ("codes", "expand"), name
        assert make_plan(spec, mx_form="codes").gemm_cluster == 1, name
        assert make_plan(spec, mx_form="expand").gemm_cluster == (2 if big else 1), name
        assert (make_plan(spec, cluster=2, mx_form="codes").gemm_cluster,
                make_plan(spec, cluster=1, mx_form="expand").mx_form) == (2, "expand"), name
        assert default_mx_form(spec, None, None) == (plan.gemm_cluster, plan.mx_form)
        assert make_plan(load_spec(name)).mx_form == "codes"  # bf16 plans have one form
    kimi = load_spec("kimi-k2.5").with_target(numerics="mxfp8")
    monkeypatch.setenv("MOKGEN_MX_FORM", "codes")
    plan = make_plan(kimi, **env.plan_options())
    assert (plan.gemm_cluster, plan.mx_form) == (1, "codes")
    monkeypatch.delenv("MOKGEN_MX_FORM")
    monkeypatch.setenv("MOKGEN_CLUSTER", "1")
    plan = make_plan(kimi, **env.plan_options())
    assert (plan.gemm_cluster, plan.mx_form) == (1, "codes")
    monkeypatch.delenv("MOKGEN_CLUSTER")
    assert env.plan_options()["mx_form"] is None


def test_dispatch_join_option(monkeypatch):
    spec = load_spec("kimi-k2.5")
    a, b = make_plan(spec), make_plan(spec, dispatch_join=False)
    assert (a.dispatch_join, b.dispatch_join) == (True, False)
    assert cache_key(a, **KEY_ARGS) != cache_key(b, **KEY_ARGS)
    # only the Hopper core's flow schedule lets a dispatch CTA claim tiles
    assert make_plan(spec, schedule="phased").dispatch_join is False
    assert make_plan(spec, gemm_core="mma_sync").dispatch_join is False
    _check_switch(monkeypatch, "MOKGEN_DISPATCH_JOIN", "dispatch_join", "0", False, "yes",
                  "MOKGEN_DISPATCH_JOIN must be 1 or 0")


def test_pull_unroll_option(monkeypatch):
    spec = load_spec("kimi-k2.5")
    a, b = make_plan(spec), make_plan(spec, pull_unroll=8)
    assert (a.pull_unroll, b.pull_unroll) == (12, 8)
    assert cache_key(a, **KEY_ARGS) != cache_key(b, **KEY_ARGS)
    with pytest.raises(PlanError, match="pull_unroll must be one of 12, 16, 8"):
        make_plan(spec, pull_unroll=4)
    _check_switch(monkeypatch, "MOKGEN_PULL_UNROLL", "pull_unroll", "8", 8, "32",
                  "MOKGEN_PULL_UNROLL must be 12 or 16 or 8")



def test_stagger_option(monkeypatch):
    """The consumers' stagger lead: a build option of the Hopper core's flow schedule (0 elsewhere,
    as the cluster), refused for mxfp8 and beyond a tile's k-blocks, in the cache key, rendered
    into the kernel's Config, and set by MOKGEN_FWD_STAGGER."""
    from mokgen import env, render
    from mokgen.errors import ToolchainError
    from mokgen.spec import spec_from_dict

    spec = load_spec("qwen3.5-35b-a3b")
    assert make_plan(spec).gemm_stagger == 0
    for lead in (1, 2, 3):
        assert make_plan(spec, stagger=lead).gemm_stagger == lead
    assert make_plan(spec, stagger=2, schedule="phased").gemm_stagger == 0
    assert make_plan(spec, stagger=2, gemm_core="mma_sync").gemm_stagger == 0
    assert make_plan(spec, stagger=3, block_k=32).gemm_stagger == 3  # 9 stages, 16 k-blocks of 32 in a down tile
    with pytest.raises(PlanError, match="stagger must be one of 0, 1, 2, 3, got 4"):
        make_plan(spec, stagger=4)
    with pytest.raises(PlanError, match="numerics mxfp8 runs its consumers in lockstep"):
        make_plan(spec.with_target(numerics="mxfp8"), stagger=1)
    assert make_plan(spec.with_target(numerics="mxfp8")).gemm_stagger == 0
    data = spec.model_dump(mode="json")
    data["moe_intermediate_size"] = 128  # a down tile of 2 k-blocks
    small = spec_from_dict(data)
    assert make_plan(small, stagger=2).gemm_stagger == 2
    with pytest.raises(PlanError, match="stagger 3 exceeds a tile's 2 k-blocks"):
        make_plan(small, stagger=3)
    keys = {cache_key(make_plan(spec, stagger=lead), **KEY_ARGS) for lead in (0, 1, 2, 3)}
    assert len(keys) == 4
    plan = make_plan(spec, stagger=2)
    assert "static constexpr int kStagger = 2;" in render.render(plan, "k")["moe_forward.cu"]
    assert "static constexpr int kStagger = 0;" in render.render(make_plan(spec), "k")["moe_forward.cu"]
    monkeypatch.setenv("MOKGEN_FWD_STAGGER", "3")
    assert env.plan_options()["stagger"] == 3 and env.switch_set("stagger")
    assert make_plan(spec, **env.plan_options()).gemm_stagger == 3
    monkeypatch.setenv("MOKGEN_FWD_STAGGER", "5")
    with pytest.raises(ToolchainError, match="MOKGEN_FWD_STAGGER must be 0 or 1 or 2 or 3, got '5'"):
        env.plan_options()
