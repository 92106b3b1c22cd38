"""Fault injection without a GPU: the builds that make one wait stage time out (-DMOKGEN_FAULT_STAGE=N,
sync.cuh; docs/architecture.md, "Fault injection") are asked for by name only, refused for any other
stage, kept out of the default build and its cache entry, and compile without spills. Their
launches, and the errors they raise, are tests/test_gpu_faults.py's."""

from __future__ import annotations

import re
import subprocess

import pytest

from mokgen import abi, render
from mokgen import build as build_mod
from mokgen.errors import InputError
from mokgen.paths import templates_dir
from mokgen.plan import cache_key, make_plan
from mokgen.spec import load_spec
from conftest import sass as sass_of

SMALL = "qwen3-30b-a3b"
#: what the kernel's sources say to a stage outside 2..6 (sync.cuh's #error)
HEADER_ERROR = "MOKGEN_FAULT_STAGE must be a wait stage from 2 to 6"


def test_fault_flags_name_the_define_of_each_wait_stage_past_the_first():
    """Stages 2..6 of sync.cuh's Stage (abi.STAGES) have a fault build; stage 1 has its run-time
    switch (simulate_missing_rank). A stage added to abi.STAGES must be added here too."""
    assert set(build_mod.FAULT_STAGES) == set(abi.STAGES) - {1}
    for n in build_mod.FAULT_STAGES:
        assert build_mod.fault_flags(n) == [f"-DMOKGEN_FAULT_STAGE={n}"]


@pytest.mark.parametrize("stage", [0, 1, 7, -2, "4", 4.0, True, None])
def test_fault_flags_refuse_any_other_stage_in_one_line(stage):
    with pytest.raises(InputError, match=r"^fault stage must be one of 2, 3, 4, 5, 6 \(.*\), got ") as err:
        build_mod.fault_flags(stage)
    assert "\n" not in str(err.value)


def _key(plan, flags) -> str:
    tc = {"nvcc_version": "13.0.88", "cutlass_version": "4.2.0", "arch": plan.arch, "flags": flags}
    return cache_key(plan, sources_digest="ab" * 32, toolchain=tc)


def test_default_build_has_no_fault_define_and_each_fault_build_its_own_key():
    """The default flags and the rendered sources carry no MOKGEN_FAULT_STAGE (only the headers
    test it, in #if blocks); each stage's flags give a cache key of their own, none the default's."""
    assert not [f for f in build_mod.BASE_FLAGS if "MOKGEN_FAULT" in f]
    plan = make_plan(load_spec(SMALL))
    for name, text in render.render(plan, "0" * 64).items():
        assert "MOKGEN_FAULT" not in text, name
    base = _key(plan, list(build_mod.BASE_FLAGS))
    keys = {n: _key(plan, [*build_mod.BASE_FLAGS, *build_mod.fault_flags(n)]) for n in build_mod.FAULT_STAGES}
    assert base not in keys.values() and len(set(keys.values())) == len(keys)


def _preprocess(tmp_path, *flags) -> subprocess.CompletedProcess:
    src = tmp_path / "sync_only.cu"
    src.write_text('#include "mokgen/sync.cuh"\n')
    return subprocess.run([build_mod.find_nvcc(), "-std=c++17", "-E", "-I", str(templates_dir() / "include"), *flags,
                           str(src), "-o", str(tmp_path / "sync_only.ii")], capture_output=True, text=True)


@pytest.mark.nvcc
@pytest.mark.parametrize("value", ["0", "1", "7", "", None])
def test_a_fault_stage_outside_2_to_6_does_not_compile(tmp_path, value):
    """-DMOKGEN_FAULT_STAGE=N given by hand (.ci/with_flags.py, .ci/ab_variants.py define=): any N
    but 2..6 stops the build at sync.cuh's #error (None: the bare -DMOKGEN_FAULT_STAGE, which is 1)."""
    flag = "-DMOKGEN_FAULT_STAGE" if value is None else f"-DMOKGEN_FAULT_STAGE={value}"
    done = _preprocess(tmp_path, flag)
    assert done.returncode != 0
    if value != "":  # an empty value is a malformed #if, nvcc's own error
        assert HEADER_ERROR in done.stderr, done.stderr


@pytest.mark.nvcc
def test_stages_2_to_6_and_no_stage_pass_the_header_check(tmp_path):
    for flags in ([], *(build_mod.fault_flags(n) for n in build_mod.FAULT_STAGES)):
        done = _preprocess(tmp_path, *flags)
        assert done.returncode == 0, (flags, done.stderr[-2000:])


def _spills(result) -> list[tuple[str, str]]:
    return re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", (result.entry / "build.log").read_text())


@pytest.mark.nvcc
def test_each_fault_build_is_its_own_entry_without_spills(monkeypatch):
    """Each stage's build of the small spec compiles (ptxas: no spills, the wgmma pipelines kept),
    into a cache entry of its own whose nvcc line carries the define; the default entry stays."""
    spec = load_spec(SMALL)
    default = build_mod.build(spec)
    base = list(build_mod.BASE_FLAGS)
    entries = {default.entry}
    for n in build_mod.FAULT_STAGES:
        monkeypatch.setattr(build_mod, "BASE_FLAGS", [*base, *build_mod.fault_flags(n)])
        result = build_mod.build(spec)
        assert result.entry not in entries, f"stage {n}: the entry of another build"
        entries.add(result.entry)
        assert f"-DMOKGEN_FAULT_STAGE={n}" in (result.entry / "build.log").read_text().splitlines()[0]
        spills = _spills(result)
        assert spills and all(a == "0" and b == "0" for a, b in spills), build_mod.resource_report(result.entry)
        assert build_mod.serialized_wgmma(result.entry) == [], build_mod.serialized_wgmma(result.entry)
    monkeypatch.setattr(build_mod, "BASE_FLAGS", base)
    assert build_mod.build(spec).entry == default.entry


@pytest.mark.nvcc
def test_each_fault_build_changes_the_machine_code(monkeypatch):
    """The define reaches the kernel: each stage's SASS differs from the default build's (that the
    default build's SASS is the one before the fault edits: .ci/sass_same.py)."""
    spec = load_spec(SMALL)
    anon = re.compile(r"_GLOBAL__N__[0-9a-f]+_\w+?_[0-9a-f]{8}")  # follows the compiled file's path

    def code(result) -> list[str]:
        return [anon.sub("ANON", line) for line in sass_of(result.library).splitlines()]

    default = code(build_mod.build(spec))
    base = list(build_mod.BASE_FLAGS)
    seen = [default]
    for n in build_mod.FAULT_STAGES:
        monkeypatch.setattr(build_mod, "BASE_FLAGS", [*base, *build_mod.fault_flags(n)])
        faulty = code(build_mod.build(spec))
        assert all(faulty != other for other in seen), f"stage {n}: the machine code of another build"
        seen.append(faulty)
