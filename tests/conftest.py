"""Shared test configuration: marker-based skips with reasons, and an isolated build cache.

Markers (registered in pyproject.toml): nvcc (needs the CUDA compiler), gpu (one sm_90 GPU),
multi_gpu (several), slow; gpu + nvcc: a GPU test
that builds a non-default variant (skipped where the JIT is off, e.g. the prebuilt-wheel check). The default `pytest` runs what this machine can run and skips the
rest with a reason that says what is missing.
"""

from __future__ import annotations

import functools
import os
import re
import shutil

import pytest


def pythonpath(*first) -> str:
    """PYTHONPATH for a test's subprocess: ``first`` ahead of the current one (which may hold
    packages the subprocess needs, e.g. wheels installed with --target on a GPU machine)."""
    parts = [str(p) for p in first] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(parts)


@pytest.fixture
def host_check(tmp_path):
    """Compiles tests/host/NAME.cu for the host (nvcc, the templates' include folder; no GPU) and
    returns the executable: ``host_check("tile_order_check")``. For tests marked nvcc."""
    import subprocess
    from pathlib import Path

    from mokgen.build import find_nvcc
    from mokgen.paths import templates_dir

    def compile_check(name: str) -> Path:
        exe = tmp_path / name
        subprocess.run([find_nvcc(), "-std=c++17", "-O1", "--expt-relaxed-constexpr", "-I", str(templates_dir() / "include"),
                        "-o", str(exe), str(Path(__file__).resolve().parent / "host" / f"{name}.cu")],
                       check=True, capture_output=True, text=True)
        return exe

    return compile_check


#: ptxas's empty wgmma commit group in SASS: a commit with no wgmma of its own, a dummy HGMMA
#: writing RZ (after it, wait<1> waits for the batch just issued; docs/perf-notes.md v0.27)
EMPTY_WGMMA_GROUP = re.compile(r"HGMMA\.64x8x16\.F16 RZ, gdesc\[URZ\], RZ")


@functools.lru_cache(maxsize=None)
def gnu_unique_symbols(library) -> list[str]:
    """The names of a shared library's dynamic symbols bound STB_GNU_UNIQUE (ELF64, read here:
    no binutils needed). The dynamic linker keeps one such object for the whole process, so a
    library that has them shares them with every other library that has the same names."""
    import struct
    from pathlib import Path

    data = Path(library).read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2, f"{library} is not an ELF64 file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != 11:  # SHT_DYNSYM
            continue
        strtab = sections[link][4]
        for at in range(offset, offset + size, entsize):
            st_name, st_info = struct.unpack_from("<IB", data, at)
            if st_info >> 4 == 10:  # STB_GNU_UNIQUE
                end = data.index(b"\0", strtab + st_name)
                names.append(data[strtab + st_name:end].decode())
    return names


def sass(library) -> str:
    """The SASS of a built library (cuobjdump beside nvcc); skips the calling test without cuobjdump."""
    import subprocess
    from pathlib import Path

    from mokgen.build import find_nvcc

    cuobjdump = shutil.which("cuobjdump") or str(Path(find_nvcc()).parent / "cuobjdump")
    if not Path(cuobjdump).exists():
        pytest.skip("cuobjdump not found")
    return subprocess.run([cuobjdump, "--dump-sass", str(library)], capture_output=True, text=True, check=True).stdout


def _nvcc_missing() -> str | None:
    try:
        from mokgen.build import find_toolchain

        find_toolchain()
    except Exception as err:  # noqa: BLE001 - any reason is a skip reason
        return f"needs nvcc and the CUTLASS headers: {err}"
    return None


@functools.lru_cache(maxsize=None)
def _gpu_missing(count: int = 1) -> str | None:
    try:
        import torch
    except ImportError:
        return "needs torch"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none visible)"
    n = torch.cuda.device_count()
    if n < count:
        return f"needs {count} CUDA GPUs ({n} visible)"
    cap = torch.cuda.get_device_capability(0)
    if cap != (9, 0):
        return f"needs an sm_90 GPU (H100/H200); found sm_{cap[0]}{cap[1]}"
    from mokgen import env

    # with the JIT off, kernels come from installed prebuilt wheels: no compiler needed
    return None if env.jit_disabled() else _nvcc_missing()


def pytest_collection_modifyitems(config, items):
    # MOKGEN_TEST_SPECS=a,b: run only the spec-parametrized tests of those specs (e.g. the GPU
    # tests from installed prebuilt wheels of a and b, with the JIT off); the rest are deselected
    only = {s.strip() for s in os.environ.get("MOKGEN_TEST_SPECS", "").split(",") if s.strip()}
    if only:
        keep, drop = [], []
        for item in items:
            name = getattr(item, "callspec", None) and item.callspec.params.get("name")
            (drop if isinstance(name, str) and name not in only else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    for item in items:
        reason = None
        gpus = 2 if "multi_gpu" in item.keywords else 1 if "gpu" in item.keywords else 0
        if gpus:
            reason = _gpu_missing(gpus)
            if not reason and "nvcc" in item.keywords:  # a GPU test that builds a non-default variant
                from mokgen import env

                reason = "builds a variant: needs the JIT (MOKGEN_DISABLE_JIT is set)" if env.jit_disabled() else None
                reason = reason or _nvcc_missing()
        elif "nvcc" in item.keywords:
            reason = _nvcc_missing()
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def _isolated_dirs(tmp_path_factory):
    """Builds of the test run go to a session cache (shared by all tests, so each spec compiles
    once) unless MOKGEN_CACHE_DIR is set; generated/ output goes to a temporary folder. Tuned
    files are off (MOKGEN_TUNED=0): a test runs the configuration it names, whatever this machine
    or the package has tuned (tests/test_tune.py turns them back on where it tests them)."""
    saved = {k: os.environ.get(k) for k in ("MOKGEN_CACHE_DIR", "MOKGEN_GENERATED_DIR", "MOKGEN_TUNED")}
    if not saved["MOKGEN_CACHE_DIR"]:
        os.environ["MOKGEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    os.environ["MOKGEN_GENERATED_DIR"] = str(tmp_path_factory.mktemp("generated"))
    os.environ["MOKGEN_TUNED"] = "0"
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def gpu_memory():
    """GPU tests: wait for the device and return cached blocks after each test."""
    yield
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def gpu_module_memory(request):
    """GPU test modules: drop the module's cached weights (``_weights_cache``) and the cached
    megakernel buffers when the module ends, so the next module starts with the memory free."""
    yield
    import torch

    import mokgen.ep

    getattr(request.module, "_weights_cache", {}).clear()
    mokgen.ep.release_buffers()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.fixture
def private_dirs(tmp_path, monkeypatch):
    """A private build cache and generated/ for one test (in this process and inherited by its
    subprocesses); returns (cache, generated)."""
    cache, generated = tmp_path / "cache", tmp_path / "generated"
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(cache))
    monkeypatch.setenv("MOKGEN_GENERATED_DIR", str(generated))
    return cache, generated


# ---- several ranks, one process per GPU ------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, world: int, deadline_s: float, name: str = "rank") -> dict:
    """Spawns ``worker(rank, world, port, results)`` for each rank (spawn context) and collects
    what each puts on ``results`` as ``(rank, traceback or None, detail)``. Returns
    {rank: detail}; raises AssertionError with every failing rank's traceback when a rank raises,
    dies, or reports nothing within ``deadline_s`` (the others are then stopped)."""
    import queue
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, results), name=f"{name}-{r}") for r in range(world)]
    for p in procs:
        p.start()
    reports: dict[int, tuple] = {}
    deadline = time.monotonic() + deadline_s
    try:
        while len(reports) < world and time.monotonic() < deadline:
            try:
                rank, error, detail = results.get(timeout=2)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(2)  # let a dying rank's report arrive
                    while not results.empty():
                        rank, error, detail = results.get()
                        reports[rank] = (error, detail)
                    break  # a rank died (a crash that reported nothing, or after its report)
                continue
            reports[rank] = (error, detail)
            if error is not None:
                break  # the others may wait for it in a collective: stop them below
    finally:
        failed = any(e is not None for e, _ in reports.values()) or len(reports) < world
        for p in procs:
            p.join(timeout=5 if failed else 60)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    problems = [f"rank {r}:\n{e}" for r, (e, _) in sorted(reports.items()) if e is not None]
    missing = [r for r in range(world) if r not in reports]
    if missing:
        codes = {p.name: p.exitcode for p in procs}
        problems.append(f"ranks {missing} reported nothing within {deadline_s} s (exit codes {codes})")
    problems += [f"{p.name} exited with {p.exitcode}" for p in procs if p.exitcode not in (0, None) and not problems]
    if problems:
        raise AssertionError("\n".join(problems))
    return {r: d for r, (_, d) in reports.items()}
