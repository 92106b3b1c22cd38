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
