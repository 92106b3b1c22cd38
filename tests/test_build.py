"""mokgen.build and mokgen.load with the real nvcc (no GPU needed): every bundled spec compiles,
cache entries, cache hits, forced rebuilds, failed builds, missing toolchain, concurrent builds,
and loading the binding module."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mokgen import build as build_mod
from mokgen import env, render
from mokgen._version import __version__
from mokgen.errors import BuildError, LoadError, ToolchainError
from mokgen.plan import ABI_VERSION, make_plan
from mokgen.spec import bundled_specs, load_spec
from conftest import EMPTY_WGMMA_GROUP, gnu_unique_symbols, pythonpath, sass as sass_of

ROOT = Path(__file__).resolve().parents[1]
ALL_SPECS = sorted(bundled_specs())
SMALL = "qwen3-30b-a3b"
EXPORTS = ("mokgen_ep_forward", "mokgen_ep_sym_bytes", "mokgen_ep_local_bytes", "mokgen_build_info", "mokgen_abi_version",
           "mokgen_route")


def _entries(cache: Path) -> list[Path]:
    """Complete-looking entries (not temporary, not hidden) under every arch of the cache."""
    root = cache / __version__
    if not root.is_dir():
        return []
    return sorted(p for arch in root.iterdir() if arch.is_dir() and arch.name != "failed"
                  for p in arch.iterdir() if p.is_dir() and not p.name.startswith("."))


def _temporaries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(".tmp-*")) if root.exists() else []


def _assert_no_spills(result) -> None:
    """ptxas reported spill lines for every kernel, all zero, and kept every wgmma pipeline (no
    C7510 serialization: each HGMMA would wait for the one before)."""
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", (result.entry / "build.log").read_text())
    assert spills and all(a == "0" and b == "0" for a, b in spills), build_mod.resource_report(result.entry)
    assert build_mod.serialized_wgmma(result.entry) == [], build_mod.serialized_wgmma(result.entry)


@pytest.mark.nvcc
def test_cluster_pairs_build_with_multicast_and_no_spills(monkeypatch):
    """MOKGEN_CLUSTER=2 (CTA pairs sharing operands): the largest bundled spec compiles without
    spills, and its SASS has the multicast TMA loads and the wgmma (HGMMA) instructions."""
    monkeypatch.setenv("MOKGEN_CLUSTER", "2")
    spec = load_spec("kimi-k2.5")
    result = build_mod.build(spec)
    assert json.loads((result.entry / "plan.json").read_text())["plan"]["gemm_cluster"] == 2
    _assert_no_spills(result)
    sass = sass_of(result.library)
    assert "UTMALDG.2D.MULTICAST" in sass and "HGMMA" in sass
    # the remote stage releases (one per k-block and consumer warpgroup, right after the wgmma wait)
    # carry no memory barrier: .release.cluster put ERRBAR + CGAERRBAR before each (v0.5 notes).
    # The walkers' tile-index hand-over (ep_forward.cuh, off the k-loops, since v0.18) releases at
    # cluster scope on purpose, so only the arrives within 40 instructions after a
    # WARPGROUP.DEPBAR are the stage releases (v0.56: the test had counted those too).
    lines = [l for l in sass.splitlines() if ";" in l]  # instructions only
    remote = [i for i, l in enumerate(lines) if "SYNCS.ARRIVE.TRANS64.RED" in l]
    releases = [i for i in remote if any("WARPGROUP.DEPBAR" in l for l in lines[max(0, i - 40):i])]
    assert releases, "no remote stage releases after a wgmma wait in a pair build"
    assert not [i for i in releases if any("ERRBAR" in l for l in lines[max(0, i - 6):i])]


@pytest.mark.nvcc
def test_block_k_32_build_uses_the_64_byte_swizzle_without_spills(monkeypatch):
    """MOKGEN_BLOCK_K=32: 9 stages of 24 KB (216 KB); compiles without spills for the largest spec, with
    HGMMA, and the rendered source carries the k-block and stage count."""
    monkeypatch.setenv("MOKGEN_BLOCK_K", "32")
    spec = load_spec("kimi-k2.5")
    result = build_mod.build(spec)
    src = (result.entry / "moe_forward.cu").read_text()
    assert "kBlockK = 32;" in src and "kStages = 9;" in src
    _assert_no_spills(result)
    sass = sass_of(result.library)
    assert "HGMMA.64x256x16" in sass


@pytest.mark.nvcc
def test_the_weights_raw_mx_build_quantizes_each_stage_between_the_wgmmas(monkeypatch):
    """MOKGEN_MX_FWD_WEIGHTS=raw (v0.68, mx_tile.cuh MxQuantB) on the largest spec's MXFP8 build:
    no spills, no serialized wgmma; each of the consumers' k-loop bodies (up and down tiles, two
    k-blocks an iteration: four) quantizes its stage with 128-bit shared loads and stores, fences
    them for the async proxy and meets the other consumer warpgroup on named barrier 2 (256
    threads) before its HGMMA; the values build has no such barrier."""
    monkeypatch.setenv("MOKGEN_MX_FWD_WEIGHTS", "raw")
    spec = load_spec("kimi-k2.5").with_target(numerics="mxfp8")
    result = build_mod.build(spec)
    assert "static constexpr bool kMxRawB = true;" in (result.entry / "moe_forward.cu").read_text()
    _assert_no_spills(result)
    lines = [line for line in sass_of(result.library).splitlines() if ";" in line]
    bars = [i for i, line in enumerate(lines) if "BAR.SYNC.DEFER_BLOCKING 0x2, 0x100" in line]
    assert len(bars) == 4, len(bars)
    for i in bars:
        before, after = lines[max(0, i - 400):i], lines[i:i + 60]
        assert sum("STS.128" in line for line in before) >= 4 and any("FENCE.VIEW.ASYNC.S" in line for line in before)
        assert any("HGMMA.64x256x16" in line or "HGMMA.64x128x16" in line for line in after), i
    monkeypatch.delenv("MOKGEN_MX_FWD_WEIGHTS")
    values = build_mod.build(spec)
    assert "BAR.SYNC.DEFER_BLOCKING 0x2" not in sass_of(values.library)


@pytest.mark.nvcc
def test_the_split_raw_mx_build_sends_its_half_of_b_to_the_peer(monkeypatch):
    """-DMOKGEN_MX_RAWB_SPLIT (v0.70, measuring builds; hopper_gemm.cuh kSplitB, mx_tile.cuh
    MxQuantBSplit) on kimi-k2.5's raw MXFP8 build in CTA pairs: no spills, no serialized wgmma; each
    of the four k-loop bodies that takes a split B stores its block in place and to the peer
    (STAS.128, st.async), then waits on its xfull barrier, fences for the async proxy and meets the
    other consumer warpgroup on named barrier 2 before its HGMMA; half of the pair's B boxes leave
    the multicast (the split tiles' own half by a plain TMA load)."""
    monkeypatch.setenv("MOKGEN_MX_FWD_WEIGHTS", "raw")
    monkeypatch.setenv("MOKGEN_CLUSTER", "2")
    spec = load_spec("kimi-k2.5").with_target(numerics="mxfp8")
    whole = build_mod.build(spec)
    monkeypatch.setattr(build_mod, "BASE_FLAGS", [*build_mod.BASE_FLAGS, "-DMOKGEN_MX_RAWB_SPLIT"])
    split = build_mod.build(spec)
    assert split.entry != whole.entry and "static constexpr int kCluster = 2;" in (split.entry / "moe_forward.cu").read_text()
    _assert_no_spills(split)
    lines = [line for line in sass_of(split.library).splitlines() if ";" in line]
    stas = [i for i, line in enumerate(lines) if "STAS.128" in line]
    bodies = [i for n, i in enumerate(stas) if n == 0 or i - stas[n - 1] > 40]
    assert len(stas) == 16 and len(bodies) == 4, (len(stas), bodies)
    for i in bodies:
        after = lines[i:i + 80]
        order = [next(k for k, line in enumerate(after) if key in line)
                 for key in ("SYNCS.PHASECHK", "FENCE.VIEW.ASYNC.S", "BAR.SYNC.DEFER_BLOCKING 0x2", "HGMMA")]
        assert order == sorted(order), (i, order)
    assert "STAS" not in sass_of(whole.library)
    count = lambda text, op: sum(op in line.split(";")[0].split() for line in text.splitlines())  # noqa: E731
    assert count(sass_of(split.library), "UTMALDG.2D.MULTICAST") < count(sass_of(whole.library), "UTMALDG.2D.MULTICAST")


@pytest.mark.nvcc
def test_default_build_sass_roles():
    """The default build of the largest spec, in its SASS: wgmma (HGMMA), one batch kept in flight
    and no empty commit group; no local memory; the
    role-less warps of the producer warpgroup parked on named barrier 1 (128 threads) before
    their setmaxnreg, which comes after it; and the dispatch copy's run of 12 loads in flight
    (pull_unroll) before its stores."""
    result = build_mod.build(load_spec("kimi-k2.5"))
    # no process-wide statics (a launcher's cache guard shared with another spec's library)
    assert gnu_unique_symbols(result.library) == []
    sass = sass_of(result.library)
    assert "HGMMA.64x256x16" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory in the default kernel (a stack frame)"
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass, "every wgmma waited for (serialized pipeline)"
    assert not EMPTY_WGMMA_GROUP.search(sass), "an empty wgmma commit group"
    lines = sass.splitlines()
    park = [i for i, l in enumerate(lines) if "BAR.SYNC.DEFER_BLOCKING 0x1, 0x80" in l]
    assert len(park) == 1, "one named barrier 1 of 128 threads"
    assert any("USETMAXREG" in l for l in lines[park[0]:park[0] + 40]), "setmaxnreg follows the parking barrier"
    # the longest run of 128-bit generic loads with no store between them: the dispatch copy
    run = best = 0
    for l in lines:
        if "LD.E.128" in l and "LDG" not in l:
            run += 1
            best = max(best, run)
        elif "ST.E.128" in l or "STG.E.128" in l:
            run = 0
    assert best == make_plan(load_spec("kimi-k2.5")).pull_unroll == 12


@pytest.mark.nvcc
def test_fused_shared_expert_build(monkeypatch):
    """MOKGEN_FUSE_SHARED=1 on a spec with a sigmoid-gated shared expert: the plan fuses it, the
    library compiles with wgmma, and its binding takes the shared expert's weights."""
    monkeypatch.setenv("MOKGEN_FUSE_SHARED", "1")
    spec = load_spec("qwen3.5-35b-a3b")
    result = build_mod.build(spec)
    assert json.loads((result.entry / "plan.json").read_text())["plan"]["fuse_shared"] is True
    binding = (result.entry / "binding.py").read_text()
    assert "FUSE_SHARED = True" in binding and "shared_scale: Optional[torch.Tensor] = None" in binding
    assert re.search(r"Used \d+ registers", (result.entry / "build.log").read_text())


# ---- every bundled spec ------------------------------------------------------------------------


@pytest.mark.nvcc
@pytest.mark.parametrize("name", ALL_SPECS)
def test_every_bundled_spec_compiles(name):
    spec = load_spec(name)
    result = build_mod.build(spec)
    plan = make_plan(spec)
    lib = f"lib{plan.name}.so"
    assert build_mod.serialized_wgmma(result.entry) == [], "ptxas serialized the megakernel's wgmma (C7510)"
    assert result.name == plan.name
    assert result.entry == build_mod.entry_dir(plan, result.key)
    assert result.entry.parent == env.cache_dir() / __version__ / "sm_90a"
    assert result.entry.name == f"{plan.name}-{result.key[:12]}"
    assert result.library == result.entry / lib
    assert {lib, "plan.json", "build.log", "moe_forward.cu", "binding.py"} <= {
        p.name for p in result.entry.iterdir()
    }

    doc = json.loads((result.entry / "plan.json").read_text())
    assert doc["name"] == plan.name and doc["key"] == result.key
    assert doc["plan"] == plan.compile_fields()
    assert doc["mokgen"] == __version__

    # ptxas's resource report: registers for every kernel and no spills anywhere, fused shared
    # expert included (its 52 / 104 bytes went with the region layouts passed as a kernel
    # parameter, v0.18)
    log = (result.entry / "build.log").read_text()
    assert re.search(r"Used \d+ registers", log), log[-2000:]
    _assert_no_spills(result)

    # the C ABI: symbols exported, callable without a GPU
    if shutil.which("nm"):
        symbols = subprocess.run(["nm", "-D", "--defined-only", str(result.library)],
                                 capture_output=True, text=True, check=True).stdout
        for sym in EXPORTS:
            assert re.search(rf"\bT {sym}$", symbols, re.M), sym
    so = ctypes.CDLL(str(result.library))
    for sym in EXPORTS:
        assert hasattr(so, sym)
    so.mokgen_abi_version.restype = ctypes.c_int
    assert so.mokgen_abi_version() == ABI_VERSION
    so.mokgen_build_info.restype = ctypes.c_char_p
    info = json.loads(so.mokgen_build_info().decode())
    assert info["name"] == plan.name and info["key"] == result.key
    assert (info["hidden_size"], info["num_experts"], info["top_k"]) == (spec.hidden_size, spec.num_experts, spec.top_k)
    so.mokgen_ep_sym_bytes.restype = ctypes.c_longlong
    so.mokgen_ep_sym_bytes.argtypes = [ctypes.c_longlong]
    assert so.mokgen_ep_sym_bytes(2048) > so.mokgen_ep_sym_bytes(1) > 0

    # generated/<name>/: the readable sources and a link to the cached library
    gen = env.generated_dir() / plan.name
    for fn in ("moe_forward.cu", "binding.py", "plan.json", "build.log"):
        assert (gen / fn).read_bytes() == (result.entry / fn).read_bytes(), fn
    assert (gen / lib).is_symlink()
    assert (gen / lib).resolve() == result.library.resolve()


# ---- cache hits and forced rebuilds ------------------------------------------------------------


def _spy_nvcc(monkeypatch, *, allow: bool) -> list[list[str]]:
    """Record (or forbid) compiler runs made by mokgen.build."""
    calls: list[list[str]] = []
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        if isinstance(cmd, (list, tuple)) and cmd and os.path.basename(str(cmd[0])).startswith("nvcc"):
            calls.append(list(cmd))
            if not allow:
                raise AssertionError(f"nvcc ran on a cache hit: {cmd}")
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(build_mod.subprocess, "run", run)
    return calls


@pytest.mark.nvcc
def test_second_build_is_a_cache_hit_without_nvcc(monkeypatch):
    spec = load_spec(SMALL)
    first = build_mod.build(spec)
    build_mod.find_toolchain()  # the nvcc --version query is memoized; compiles are what we forbid
    calls = _spy_nvcc(monkeypatch, allow=False)
    second = build_mod.build(spec)
    assert calls == []
    assert second.cached is True
    assert (second.key, second.entry, second.library) == (first.key, first.entry, first.library)


@pytest.mark.nvcc
def test_force_rebuilds(monkeypatch):
    spec = load_spec(SMALL)
    first = build_mod.build(spec)
    build_mod.find_toolchain()
    before = first.library.stat().st_ino, first.library.stat().st_mtime_ns
    calls = _spy_nvcc(monkeypatch, allow=True)
    again = build_mod.build(spec, force=True)
    assert again.cached is False
    assert len(calls) == 1 and "moe_forward.cu" in calls[0]
    assert again.entry == first.entry and again.library.is_file()
    assert (again.library.stat().st_ino, again.library.stat().st_mtime_ns) != before
    # this process's temporaries only: another process may be building in a shared cache
    assert [t for t in _temporaries(env.cache_dir()) if t.name.endswith(f"-{os.getpid()}")] == []
    assert build_mod.is_complete(again.entry, make_plan(spec))


@pytest.mark.nvcc
def test_changed_templates_miss_the_cache(private_dirs, tmp_path, monkeypatch):
    """A header edit changes the key: a new entry beside the old one, both complete."""
    cache, _ = private_dirs
    spec = load_spec(SMALL)
    first = build_mod.build(spec, publish_generated=False)
    copy = tmp_path / "templates"
    shutil.copytree(render.templates_dir(), copy)
    common = copy / "include" / "mokgen" / "common.cuh"
    common.write_text(common.read_text() + "\n// an edit\n")
    monkeypatch.setattr(render, "templates_dir", lambda: copy)
    monkeypatch.setattr(build_mod, "templates_dir", lambda: copy)
    second = build_mod.build(spec, publish_generated=False)
    assert second.cached is False and second.key != first.key
    assert _entries(cache) == sorted([first.entry, second.entry])


# ---- failed builds -----------------------------------------------------------------------------


@pytest.mark.nvcc
def test_broken_source_raises_build_error_and_leaves_no_entry(private_dirs, tmp_path, monkeypatch):
    cache, generated = private_dirs
    spec = load_spec(SMALL)
    # the include path on nvcc's command line contains the word "error": the message must still
    # quote the compiler's diagnostic, not the command line
    copy = tmp_path / "error-prone" / "templates"
    shutil.copytree(render.templates_dir(), copy)
    monkeypatch.setattr(render, "templates_dir", lambda: copy)
    monkeypatch.setattr(build_mod, "templates_dir", lambda: copy)
    real_render = render.render

    def broken(plan, key):
        files = real_render(plan, key)
        files["moe_forward.cu"] += "\nint mokgen_broken( {\n"
        return files

    monkeypatch.setattr(render, "render", broken)
    with pytest.raises(BuildError) as info:
        build_mod.build(spec)
    message = str(info.value)
    assert "\n" not in message

    failed_root = cache / __version__ / "failed"
    (failed,) = list(failed_root.iterdir())
    assert failed.name.startswith(make_plan(spec).name + "-")
    assert str(failed / "moe_forward.cu") in message
    assert str(failed / "build.log") in message
    diagnostic = message.split(str(failed / "moe_forward.cu") + ": ", 1)[1].split(" (full log: ")[0]
    assert re.search(r"\berror\b", diagnostic), message
    assert "-gencode" not in diagnostic and not diagnostic.startswith("$"), message
    assert "mokgen_broken" in (failed / "moe_forward.cu").read_text()
    assert "error" in (failed / "build.log").read_text()

    assert _entries(cache) == []
    assert _temporaries(cache) == []
    assert not generated.exists() or list(generated.iterdir()) == []


@pytest.mark.nvcc
def test_failed_build_then_good_build(private_dirs, monkeypatch):
    """A failure does not poison the cache: fixing the source builds normally."""
    cache, _ = private_dirs
    spec = load_spec(SMALL)
    with monkeypatch.context() as m:
        m.setattr(render, "render", lambda plan, key: {"moe_forward.cu": "#error broken\n", "binding.py": "\n"})
        with pytest.raises(BuildError):
            build_mod.build(spec, publish_generated=False)
    result = build_mod.build(spec, publish_generated=False)
    assert result.cached is False
    assert _entries(cache) == [result.entry]


# ---- missing toolchain (no nvcc needed) --------------------------------------------------------


def test_mokgen_nvcc_not_a_file(monkeypatch, private_dirs):
    cache, generated = private_dirs
    monkeypatch.setenv("MOKGEN_NVCC", "/nonexistent/bin/nvcc")
    with pytest.raises(ToolchainError, match="MOKGEN_NVCC=/nonexistent/bin/nvcc") as info:
        build_mod.find_nvcc()
    assert "\n" not in str(info.value)
    with pytest.raises(ToolchainError):
        build_mod.build(load_spec(SMALL))
    assert not cache.exists() and not generated.exists()


def test_mokgen_nvcc_not_an_nvcc(monkeypatch, tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'hello'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MOKGEN_NVCC", str(fake))
    with pytest.raises(ToolchainError, match="cannot parse the version"):
        build_mod.find_toolchain()


def test_no_nvcc_anywhere(monkeypatch, tmp_path, private_dirs):
    cache, _ = private_dirs
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.delenv("MOKGEN_NVCC", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(empty))
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, *a, **k: False if str(p).startswith("/usr/local/cuda") else real_access(p, mode, *a, **k)
    )
    with pytest.raises(ToolchainError, match="nvcc not found") as info:
        build_mod.find_nvcc()
    assert "\n" not in str(info.value)
    with pytest.raises(ToolchainError):
        build_mod.build(load_spec(SMALL))
    assert not cache.exists()


def test_cuda_home_without_nvcc_falls_through(monkeypatch, tmp_path):
    monkeypatch.delenv("MOKGEN_NVCC", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # no bin/nvcc there
    monkeypatch.delenv("CUDA_PATH", raising=False)
    fake_bin = tmp_path / "other"
    fake_bin.mkdir()
    nvcc = fake_bin / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake_bin))
    assert build_mod.find_nvcc() == str(nvcc)


# ---- concurrency -------------------------------------------------------------------------------

_BUILDER = r"""
from mokgen import build
from mokgen.spec import load_spec
result = build.build(load_spec("qwen3-30b-a3b"))
print("cached" if result.cached else "compiled", result.entry)
"""


@pytest.mark.nvcc
def test_two_processes_build_the_same_spec(tmp_path):
    cache, generated = tmp_path / "cache", tmp_path / "generated"
    env_vars = dict(os.environ, PYTHONPATH=pythonpath(ROOT), MOKGEN_CACHE_DIR=str(cache),
                    MOKGEN_GENERATED_DIR=str(generated))
    procs = [
        subprocess.Popen([sys.executable, "-c", _BUILDER], cwd=tmp_path, env=env_vars,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        outs.append(out.split())
    # exactly one compiled, the other waited on the lock and found the entry
    assert sorted(o[0] for o in outs) == ["cached", "compiled"]
    assert outs[0][1] == outs[1][1]
    (entry,) = _entries(cache)
    assert str(entry) == outs[0][1]
    assert build_mod.is_complete(entry, make_plan(load_spec(SMALL)))
    assert _temporaries(cache) == [] and _temporaries(generated) == []
    name = make_plan(load_spec(SMALL)).name
    assert [p.name for p in generated.iterdir()] == [name]
    assert (generated / name / f"lib{name}.so").resolve() == (entry / f"lib{name}.so").resolve()


# ---- load --------------------------------------------------------------------------------------


@pytest.mark.nvcc
def test_load_returns_the_binding_module():
    torch = pytest.importorskip("torch")
    from mokgen import load as load_mod

    spec = load_spec(SMALL)
    build_mod.build(spec)
    module = load_mod.load(spec)
    _, key, _ = build_mod.plan_and_key(spec)
    assert module.KEY == key
    assert module.NAME == make_plan(spec).name
    assert isinstance(module.EP_OP, torch._ops.OpOverload)
    assert module.EP_OP.name().startswith("mokgen::")
    assert json.loads(module.build_info())["key"] == key
    assert load_mod.load(spec) is module  # one module (one registered op) per process


@pytest.mark.nvcc
def test_load_with_jit_disabled_and_empty_cache(private_dirs, monkeypatch):
    from mokgen import load as load_mod

    cache, _ = private_dirs
    monkeypatch.setenv("MOKGEN_DISABLE_JIT", "1")
    monkeypatch.setattr(load_mod, "_by_spec", {})
    monkeypatch.setattr(load_mod, "_by_key", {})
    with pytest.raises(LoadError, match="mokgen build qwen3-30b-a3b") as info:
        load_mod.load(load_spec(SMALL))
    assert "\n" not in str(info.value)
    assert _entries(cache) == []


def test_serialized_wgmma_reads_every_serialization_code(tmp_path):
    """build.serialized_wgmma names each kernel once, whatever ptxas's code for the serialization
    (C7510: a function call; C7520: a warpgroup.arrive in a divergent path), and ignores the
    informational lines (C7519: an injected warpgroup.arrive alone serializes nothing)."""
    log = "\n".join([
        "ptxas info    : (C7519) warpgroup.arrive is injected in around line 26655 by compiler to allow use of "
        "registers in GMMA in function '_Z6kernelA'",
        "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "program dependence on compiler-inserted WG.AR in divergent path in the function '_Z6kernelB'",
        "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "program dependence on compiler-inserted WG.AR in divergent path in the function '_Z6kernelB'",
        "ptxas info    : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "wgmma pipeline crossing function boundary at a function call in the function '_Z6kernelC'",
    ])
    (tmp_path / "build.log").write_text(log)
    assert build_mod.serialized_wgmma(tmp_path) == ["_Z6kernelB", "_Z6kernelC"]
    (tmp_path / "build.log").write_text(log.split("\n")[0])
    assert build_mod.serialized_wgmma(tmp_path) == []


@pytest.mark.nvcc
def test_forward_trace_build_is_its_own_entry_and_keeps_the_pipeline(monkeypatch):
    """The forward's trace build (-DMOKGEN_FWD_TRACE, .ci/fwd_trace.py): another cache entry than
    the default build (the flags are part of the key); it exports mokgen_fwd_set_trace, which the
    default build does not; and its stamps leave the kernel without spills and its wgmma
    pipelined (a stamp behind a branch on the thread index would serialize them). kimi-k2.5
    without the fused shared expert: fused trace builds spill 8 bytes of stores (qwen3.5-35b-a3b's
    on main since before v0.49, and kimi-k2.5's once it fuses in pairs), which the trace's
    figures tolerate; the routed pipeline is what this checks."""
    monkeypatch.setenv("MOKGEN_FUSE_SHARED", "0")
    spec = load_spec("kimi-k2.5")
    default = build_mod.build(spec)
    monkeypatch.setattr(build_mod, "BASE_FLAGS", [*build_mod.BASE_FLAGS, "-DMOKGEN_FWD_TRACE"])
    traced = build_mod.build(spec)
    assert traced.entry != default.entry
    assert "-DMOKGEN_FWD_TRACE" in (traced.entry / "build.log").read_text().splitlines()[0]
    _assert_no_spills(traced)
    assert hasattr(ctypes.CDLL(str(traced.library)), "mokgen_fwd_set_trace")
    assert not hasattr(ctypes.CDLL(str(default.library)), "mokgen_fwd_set_trace")


def test_load_memo_tells_builds_with_other_nvcc_flags_apart(monkeypatch):
    """A load under other nvcc flags (a measuring build's -DNAME) is another module: the memo's
    key holds build.BASE_FLAGS, so an A/B of two builds of one spec and plan runs two builds."""
    from mokgen import load as load_mod

    spec = load_spec("qwen3.5-35b-a3b")
    plain = load_mod.memo_key(spec, {})
    assert load_mod.memo_key(spec, {}) == plain
    monkeypatch.setattr(build_mod, "BASE_FLAGS", [*build_mod.BASE_FLAGS, "-DMOKGEN_SOME_MEASURE"])
    flagged = load_mod.memo_key(spec, {})
    assert flagged != plain
    monkeypatch.setattr(build_mod, "BASE_FLAGS", build_mod.BASE_FLAGS[:-1])
    assert load_mod.memo_key(spec, {}) == plain


def test_every_source_library_has_the_build_entry_its_jit_off_error_names():
    """find_source_library's error under MOKGEN_DISABLE_JIT=1 tells the user to run
    ``<module>.build_library()`` first: every module that loads a source library has one."""
    import importlib
    import re
    from pathlib import Path

    import mokgen

    root = Path(mokgen.__file__).parent
    users = [p.stem for p in root.glob("*.py") if "find_source_library(" in p.read_text() and p.stem != "build"]
    assert users, "no module loads a source library"
    for name in users:
        module = importlib.import_module(f"mokgen.{name}")
        assert callable(getattr(module, "build_library", None)), name
        assert re.search(r"module=__name__", (root / f"{name}.py").read_text()), name
