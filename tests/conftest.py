"""Shared test configuration: marker-based skips with reasons, and an isolated build cache.

Markers (registered in pyproject.toml): nvcc (needs the CUDA compiler), gpu (one sm_90 GPU),
multi_gpu (several), slow. The default `pytest` runs what this machine can run and skips the
rest with a reason that says what is missing.
"""

from __future__ import annotations

import functools
import os
import shutil

import pytest


def pythonpath(*first) -> str:
    """PYTHONPATH for a test's subprocess: ``first`` ahead of the current one (which may hold
    packages the subprocess needs, e.g. wheels installed with --target on a GPU machine)."""
    parts = [str(p) for p in first] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(parts)


@functools.lru_cache(maxsize=None)
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
        if "multi_gpu" in item.keywords:
            reason = _gpu_missing(2)
        elif "gpu" in item.keywords:
            reason = _gpu_missing(1)
        elif "nvcc" in item.keywords:
            reason = _nvcc_missing()
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def _isolated_dirs(tmp_path_factory):
    """Builds of the test run go to a session cache (shared by all tests, so each spec compiles
    once) unless MOKGEN_CACHE_DIR is set; generated/ output goes to a temporary folder."""
    saved = {k: os.environ.get(k) for k in ("MOKGEN_CACHE_DIR", "MOKGEN_GENERATED_DIR")}
    if not saved["MOKGEN_CACHE_DIR"]:
        os.environ["MOKGEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    os.environ["MOKGEN_GENERATED_DIR"] = str(tmp_path_factory.mktemp("generated"))
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
