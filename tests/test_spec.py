"""mokgen.spec: bundled specs, loading, validation messages. CPU only, fast."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import yaml

from mokgen.errors import SpecError
from mokgen.paths import specs_dir
from mokgen.spec import (
    MoESpec,
    bundled_aliases,
    bundled_specs,
    load_spec,
    resolve_spec,
    spec_from_dict,
)

EXPECTED_NAMES = {
    "kimi-k2.5",
    "glm-5.2",
    "qwen3.5-397b-a17b",
    "deepseek-v4-pro",
    "deepseek-v3",
    "qwen3-30b-a3b",
    "qwen3.5-35b-a3b",
}

# name: (hidden, inter, experts, top_k, shared count, shared inter, shared gate, scoring, bias,
#        renormalize, scale, n_group, topk_group, clamp_limit, max_ep_ranks)
EXPECTED = {
    "kimi-k2.5": (7168, 2048, 384, 8, 1, 2048, "none", "sigmoid", True, True, 2.827, 1, 1, None, 64),
    "glm-5.2": (6144, 2048, 256, 8, 1, 2048, "none", "sigmoid", True, True, 2.5, 1, 1, None, 64),
    "qwen3.5-397b-a17b": (4096, 1024, 512, 10, 1, 1024, "sigmoid", "softmax", False, True, 1.0, 1, 1, None, 64),
    "deepseek-v4-pro": (7168, 3072, 384, 6, 1, 3072, "none", "sqrtsoftplus", True, True, 2.5, 1, 1, 10.0, 64),
    "deepseek-v3": (7168, 2048, 256, 8, 1, 2048, "none", "sigmoid", True, True, 2.5, 8, 4, None, 64),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 0, 0, "none", "softmax", False, True, 1.0, 1, 1, None, 1),
    "qwen3.5-35b-a3b": (2048, 512, 256, 8, 1, 512, "sigmoid", "softmax", False, True, 1.0, 1, 1, None, 1),
}

VALID = {
    "name": "toy",
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "top_k": 2,
    "routing": {"scoring": "softmax"},
}


def _write(tmp_path: Path, data, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def _variant(**changes) -> dict:
    data = yaml.safe_load(yaml.safe_dump(VALID))  # deep copy
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return data


def _load_error(path: Path) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert "\n" not in message, message
    assert str(path) in message, message
    return message


# ------------------------------------------------------------------ bundled specs
def test_bundled_names_are_exactly_the_published_models():
    assert set(bundled_specs()) == EXPECTED_NAMES
    assert list(bundled_specs()) == sorted(EXPECTED_NAMES)


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_bundled_spec_loads_and_matches_published_values(name):
    path = bundled_specs()[name]
    assert path.parent == specs_dir()
    assert path.stem == name
    spec = load_spec(name)
    assert spec.name == path.stem == name
    (hidden, inter, experts, top_k, sh_count, sh_inter, sh_gate, scoring, bias, renorm, scale,
     n_group, topk_group, clamp, max_ep) = EXPECTED[name]
    assert spec.hidden_size == hidden
    assert spec.moe_intermediate_size == inter
    assert spec.num_experts == experts
    assert spec.top_k == top_k
    assert spec.shared_experts.count == sh_count
    assert spec.shared_experts.intermediate_size == sh_inter
    assert spec.shared_experts.gate == sh_gate
    assert spec.routing.scoring == scoring
    assert spec.routing.score_correction_bias is bias
    assert spec.routing.renormalize is renorm
    assert spec.routing.routed_scaling_factor == pytest.approx(scale)
    assert spec.routing.n_group == n_group
    assert spec.routing.topk_group == topk_group
    assert spec.activation.kind == "swiglu"
    assert spec.activation.clamp_limit == clamp
    assert spec.target.arch == "sm_90a"
    assert spec.target.numerics == "bf16"
    assert spec.target.max_ep_ranks == max_ep
    assert spec.target.max_tokens_per_rank == 16384
    assert spec.description.strip()


def test_deepseek_v3_group_limited_routing():
    spec = load_spec("deepseek-v3")
    assert spec.routing.group_score == "top2_sum"
    assert spec.experts_per_rank(64) == 4


def test_bundled_files_keep_stem_equal_to_name_on_disk():
    for stem, path in bundled_specs().items():
        raw = yaml.safe_load(path.read_text())
        assert raw["name"] == stem, path
        # Every bundled file writes out the full layout, so readers see every choice.
        assert set(raw) >= {"name", "aliases", "description", "hidden_size",
                            "moe_intermediate_size", "num_experts", "top_k", "shared_experts",
                            "activation", "routing", "target"}, path


def test_aliases_resolve():
    assert load_spec("kimi-2.5").name == "kimi-k2.5"
    assert load_spec("kimi-k2.7-code").name == "kimi-k2.5"
    assert bundled_aliases() == {"kimi-2.5": "kimi-k2.5", "kimi-k2.7-code": "kimi-k2.5"}
    assert resolve_spec("kimi-2.5") == bundled_specs()["kimi-k2.5"]


def test_names_are_case_sensitive():
    with pytest.raises(SpecError, match="unknown spec 'Kimi-K2.5'"):
        load_spec("Kimi-K2.5")


def test_load_by_path(tmp_path):
    src = bundled_specs()["glm-5.2"]
    copy = tmp_path / "my-glm.yaml"
    copy.write_text(src.read_text())
    by_path = load_spec(copy)  # a user file may keep any stem
    assert by_path == load_spec("glm-5.2")
    assert load_spec(str(copy)) == by_path
    assert load_spec(src) == by_path


def test_frozen_models_reject_mutation():
    spec = load_spec("deepseek-v3")
    with pytest.raises(pydantic.ValidationError):
        spec.top_k = 4
    with pytest.raises(pydantic.ValidationError):
        spec.routing.n_group = 1
    with pytest.raises(pydantic.ValidationError):
        spec.target.max_ep_ranks = 8
    assert spec.top_k == 8 and spec.routing.n_group == 8


def test_with_target_revalidates():
    kimi = load_spec("kimi-k2.5")
    mx = kimi.with_target(numerics="mxfp8", max_ep_ranks=8)
    assert mx.target.numerics == "mxfp8" and mx.target.max_ep_ranks == 8
    assert kimi.target.numerics == "bf16"  # original untouched
    assert mx.num_experts == kimi.num_experts
    with pytest.raises(SpecError) as info:
        kimi.with_target(max_ep_ranks=7)
    message = str(info.value)
    assert "target.max_ep_ranks" in message and "must divide num_experts (384)" in message
    assert "got 7" in message and "kimi-k2.5" in message
    with pytest.raises(SpecError, match="target.max_ep_rank: unknown field"):
        kimi.with_target(max_ep_rank=8)
    with pytest.raises(SpecError, match="target.numerics"):
        kimi.with_target(numerics="fp4")


def test_canonical_dict_round_trips():
    spec = load_spec("kimi-k2.5")
    data = spec.canonical_dict()
    assert data["aliases"] == ["kimi-2.5", "kimi-k2.7-code"]
    assert data["routing"]["routed_scaling_factor"] == 2.827
    assert spec_from_dict(data) == spec


def test_experts_per_rank():
    spec = load_spec("kimi-k2.5")
    assert spec.experts_per_rank(8) == 48
    assert spec.experts_per_rank(1) == 384
    with pytest.raises(SpecError, match=r"ep: must divide num_experts \(384\), got 5"):
        spec.experts_per_rank(5)
    with pytest.raises(SpecError, match="positive"):
        spec.experts_per_rank(0)


def test_valid_minimal_spec_uses_defaults(tmp_path):
    spec = load_spec(_write(tmp_path, VALID))
    assert spec.shared_experts.count == 0 and spec.shared_experts.gate == "none"
    assert spec.routing.renormalize is True and spec.routing.n_group == 1
    assert spec.target.max_ep_ranks == 1 and spec.target.max_tokens_per_rank == 16384
    assert spec.aliases == ()


# ------------------------------------------------------------------ one test per bad input class
def test_malformed_yaml_reports_line_and_column(tmp_path):
    path = _write(tmp_path, "name: toy\nhidden_size: [256\ntop_k: 2\n")
    message = _load_error(path)
    assert "malformed YAML" in message and "line" in message and "column" in message


def test_duplicate_key_is_rejected(tmp_path):
    text = yaml.safe_dump(VALID, sort_keys=False) + "top_k: 4\n"
    message = _load_error(_write(tmp_path, text))
    assert "duplicate key 'top_k'" in message


def test_top_level_list(tmp_path):
    message = _load_error(_write(tmp_path, "- name: toy\n- top_k: 2\n"))
    assert "top level must be a mapping" in message and "list" in message


def test_empty_file(tmp_path):
    message = _load_error(_write(tmp_path, "# nothing here\n"))
    assert "top level must be a mapping" in message


def test_unknown_field(tmp_path):
    data = dict(VALID)
    data["hiden_size"] = data.pop("hidden_size")
    message = _load_error(_write(tmp_path, data))
    assert "hiden_size: unknown field" in message
    assert "did you mean 'hidden_size'" in message
    assert "(and 1 more)" in message  # hidden_size is now missing too


def test_unknown_nested_field(tmp_path):
    message = _load_error(_write(tmp_path, _variant(routing__scoring_func="sigmoid")))
    assert "routing.scoring_func: unknown field" in message


def test_wrong_type(tmp_path):
    message = _load_error(_write(tmp_path, _variant(top_k="abc")))
    assert "top_k: must be a valid integer" in message and "'abc'" in message


def test_bool_is_not_an_int(tmp_path):
    message = _load_error(_write(tmp_path, _variant(num_experts=True)))
    assert "num_experts: must be a valid integer" in message


def test_missing_field(tmp_path):
    data = dict(VALID)
    del data["routing"]
    message = _load_error(_write(tmp_path, data))
    assert "routing: missing required field" in message


def test_top_k_greater_than_num_experts(tmp_path):
    message = _load_error(_write(tmp_path, _variant(top_k=9)))
    assert "top_k: must be between 1 and num_experts (8), got 9" in message


def test_top_k_above_kernel_limit(tmp_path):
    message = _load_error(_write(tmp_path, _variant(num_experts=64, top_k=33)))
    assert "top_k:" in message and "32" in message


def test_n_group_not_dividing_experts(tmp_path):
    data = _variant(num_experts=256, top_k=8, routing__n_group=7)
    message = _load_error(_write(tmp_path, data))
    assert "routing.n_group: must divide num_experts (256), got 7" in message


def test_topk_group_greater_than_n_group(tmp_path):
    data = _variant(routing__n_group=2, routing__topk_group=3)
    message = _load_error(_write(tmp_path, data))
    assert "routing.topk_group: must be between 1 and n_group (2), got 3" in message


def test_top_k_beyond_selected_groups(tmp_path):
    # 8 experts in 4 groups of 2, top-1 group -> at most 2 experts reachable
    data = _variant(top_k=3, routing__n_group=4, routing__topk_group=1)
    message = _load_error(_write(tmp_path, data))
    assert "top_k: must be at most routing.topk_group * (num_experts // routing.n_group)" in message


def test_hidden_not_multiple_of_128(tmp_path):
    message = _load_error(_write(tmp_path, _variant(hidden_size=200)))
    assert "hidden_size: must be a positive multiple of 128" in message
    assert "tile alignment" in message and "got 200" in message


def test_intermediate_not_multiple_of_128(tmp_path):
    message = _load_error(_write(tmp_path, _variant(moe_intermediate_size=0)))
    assert "moe_intermediate_size: must be a positive multiple of 128" in message


def test_shared_gate_without_shared_experts(tmp_path):
    data = _variant(shared_experts__count=0, shared_experts__gate="sigmoid")
    message = _load_error(_write(tmp_path, data))
    assert "shared_experts.gate: must be 'none' when count is 0" in message


def test_shared_experts_need_aligned_size(tmp_path):
    data = _variant(shared_experts__count=1, shared_experts__intermediate_size=100)
    message = _load_error(_write(tmp_path, data))
    assert "shared_experts.intermediate_size: must be a positive multiple of 128" in message


def test_max_ep_ranks_must_divide_experts(tmp_path):
    message = _load_error(_write(tmp_path, _variant(target__max_ep_ranks=3)))
    assert "target.max_ep_ranks: must divide num_experts (8)" in message


def test_bad_name_pattern(tmp_path):
    message = _load_error(_write(tmp_path, _variant(name="bad name;rm")))
    assert "name: must match pattern" in message and "'bad name;rm'" in message


def test_bad_alias_and_repeated_alias(tmp_path):
    message = _load_error(_write(tmp_path, _variant(aliases=["ok", "Not-OK"])))
    assert "aliases.1: must match pattern" in message
    message = _load_error(_write(tmp_path, _variant(aliases=["toy"])))
    assert "aliases.0: must not repeat the name" in message
    message = _load_error(_write(tmp_path, _variant(aliases=["a", "a"])))
    assert "aliases.1: must not repeat another alias" in message


def test_unknown_bundled_name_lists_known_names():
    with pytest.raises(SpecError) as info:
        load_spec("kimi-k3")
    message = str(info.value)
    assert "\n" not in message
    assert "unknown spec 'kimi-k3'" in message
    for name in EXPECTED_NAMES | {"kimi-2.5", "kimi-k2.7-code"}:
        assert name in message


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    message = _load_error(missing)
    assert "not found" in message
    with pytest.raises(SpecError, match="not found"):
        load_spec(str(missing))


def test_bundled_file_must_match_its_stem(tmp_path, monkeypatch):
    import mokgen.spec as spec_module

    bundle = tmp_path / "model_specs"
    bundle.mkdir()
    path = _write(bundle, _variant(name="other"), name="toy.yaml")
    monkeypatch.setattr(spec_module, "specs_dir", lambda: bundle)
    message = _load_error(path)
    assert "name: must equal the file stem 'toy'" in message and "'other'" in message


def test_in_memory_validation_errors_are_spec_errors():
    with pytest.raises(SpecError, match=r"^<dict>: num_experts: must be less than or equal to 1024"):
        spec_from_dict(_variant(num_experts=2048))
    with pytest.raises(pydantic.ValidationError):
        MoESpec(**_variant(top_k=0))  # direct construction raises pydantic's own error


@pytest.mark.parametrize("field", ["hidden_size", "moe_intermediate_size", "shared_experts__intermediate_size"])
def test_widths_have_an_upper_bound(tmp_path, field):
    """A mistyped width (an extra digit) is refused instead of planning terabytes of weights."""
    changes = {field: 1048576}
    if field.startswith("shared"):
        changes["shared_experts__count"] = 1
    message = _load_error(_write(tmp_path, _variant(**changes)))
    assert f"{field.replace('__', '.')}: must be at most 32768, got 1048576" in message
