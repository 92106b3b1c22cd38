"""The NVLink link microbenchmark (mokgen/linkbench.py, templates/linkbench.cu).

* nvcc: the library builds into the cache without spills, exports its C entry points (loadable
  without a GPU: cudart is linked statically), is found in the cache the second time, and a
  broken source fails with a BuildError that names the kept log.
* multi_gpu: 2 ranks (spawned, NCCL, symmetric memory) run the benchmark with small, odd sizes;
  every copy is verified inside run_link_bench, which raises on a wrong byte.
* CPU: argument checks and the best-CTA choice of the report.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import traceback

import pytest

from conftest import run_ranks
from mokgen import build as build_mod
from mokgen import linkbench
from mokgen.errors import BuildError, InputError, LoadError

EXPORTS = ("mokgen_link_copy", "mokgen_link_wait", "mokgen_link_pingpong", "mokgen_link_error_string")


# ---- build (nvcc, no GPU) ------------------------------------------------------------------------


@pytest.mark.nvcc
def test_library_builds_without_spills_and_exports_the_entry_points():
    from mokgen.build import cache_root

    lib = linkbench.build_library()
    assert lib.name == "liblinkbench.so" and lib.parent.parent == cache_root("sm_90a")
    assert re.fullmatch(r"linkbench-[0-9a-f]{12}", lib.parent.name)
    log = (lib.parent / "build.log").read_text()
    kernels = re.findall(r"Compiling entry function '(\w+)'", log)
    assert len(kernels) == 4, kernels  # copy<4>, copy<8>, wait, pingpong
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) == len(kernels) and all(s == ("0", "0") for s in spills), spills
    # the symbols are exported (nm needs nothing of CUDA) ...
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    for name in EXPORTS:
        assert re.search(rf"\bT {name}$", nm, re.MULTILINE), name
    # ... and resolve through ctypes: loading needs no driver (libcuda is opened on first use)
    cdll = ctypes.CDLL(str(lib))
    for name in EXPORTS:
        getattr(cdll, name)
    assert "libcudart" not in subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout
    # the argument checks run before any CUDA call, so they answer without a GPU
    wrapped = linkbench._Lib(lib)
    invalid = 1  # cudaErrorInvalidValue
    assert wrapped._lib.mokgen_link_copy(None, None, 24, 1, 32, None, 8, None) == invalid  # not a multiple of 16
    assert wrapped._lib.mokgen_link_copy(None, None, 0, 1, 32, None, 6, None) == invalid  # unroll 6
    assert wrapped._lib.mokgen_link_pingpong(None, None, 0, 1, 0, 1, None, None, None) == invalid
    assert wrapped._lib.mokgen_link_error_string(invalid) == b"invalid argument"
    # a second call finds it in the cache
    mtime = lib.stat().st_mtime_ns
    assert linkbench.build_library() == lib and lib.stat().st_mtime_ns == mtime
    assert linkbench.load_library().path == lib


@pytest.mark.nvcc
def test_broken_source_fails_with_the_log_and_leaves_no_entry(private_dirs, tmp_path, monkeypatch):
    templates = tmp_path / "templates"
    shutil.copytree(build_mod.templates_dir(), templates)
    (templates / "linkbench.cu").write_text((templates / "linkbench.cu").read_text() + "\nnot_a_type x;\n")
    monkeypatch.setattr(build_mod, "templates_dir", lambda: templates)
    with pytest.raises(BuildError, match=r"nvcc failed on .*linkbench\.cu: .*error.*full log: (\S+build\.log)") as info:
        linkbench.build_library()
    log = re.search(r"full log: (\S+build\.log)", str(info.value)).group(1)
    assert "not_a_type" in open(log).read()
    assert not linkbench.library_path().parent.exists()


@pytest.mark.nvcc
def test_disabled_jit_with_an_empty_cache_is_an_error(private_dirs, monkeypatch):
    monkeypatch.setenv("MOKGEN_DISABLE_JIT", "1")
    with pytest.raises(LoadError, match="MOKGEN_DISABLE_JIT=1"):
        linkbench.load_library()


# ---- pure Python -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    ({"sizes": (1 << 20, 100)}, "sizes"),
    ({"sizes": ()}, "sizes"),
    ({"ctas": (8, 0)}, "ctas"),
    ({"iters": 0}, "iters"),
    ({"threads": 48}, "threads"),
    ({"unroll": 2}, "unroll"),
])
def test_check_args_names_the_bad_argument(kwargs, field):
    args = {"sizes": (1 << 20,), "ctas": (8,), "iters": 20, "threads": 512, "unroll": 8, "pingpong_iters": 10}
    args.update(kwargs)
    with pytest.raises(InputError, match=field):
        linkbench.check_args(**args)
    del args[field]
    linkbench.check_args(**{**args, field: {"sizes": (16,), "ctas": (1,), "iters": 1, "threads": 32,
                                            "unroll": 4}[field]})


def _row(mode, ctas, nbytes, gbps):
    return {"mode": mode, "ctas": ctas, "bytes": nbytes, "ms": nbytes / gbps / 1e6, "gbps": gbps,
            "rank_ms": None, "one_way_us": None}


def test_best_rows_and_table():
    rows = [
        _row("pull", 8, 1 << 20, 100.0), _row("pull", 32, 1 << 20, 300.0), _row("pull", 16, 1 << 20, 300.0),
        _row("push", 8, 1 << 20, 250.0), _row("push", 32, 1 << 20, 200.0), _row("pull", 8, 1040, 5.0),
        {"mode": "pingpong", "ctas": 1, "bytes": 8, "ms": 0.004, "gbps": None, "rank_ms": None, "one_way_us": 2.0},
    ]
    best = linkbench.best_rows(rows)
    assert set(best) == {("pull", 1 << 20), ("push", 1 << 20), ("pull", 1040)}
    assert best[("pull", 1 << 20)]["ctas"] == 16  # a tie goes to fewer CTAs
    assert best[("push", 1 << 20)]["ctas"] == 8
    lines = linkbench.format_table(rows).splitlines()
    marked = [line.split()[:3] for line in lines if line.endswith("*")]
    assert marked == [["pull", "1", "MiB"], ["push", "1", "MiB"], ["pull", "1040", "B"]]
    assert any("16" in line and "66.7%" in line for line in lines)  # 300 of 450 GB/s
    assert any("2.00 us one way" in line and "4.00 us round trip" in line for line in lines)


def test_write_json(tmp_path):
    rows = [_row("push", 8, 1 << 20, 250.0)]
    path = linkbench.write_json(rows, tmp_path / "out", {"world": 2})
    import json

    doc = json.loads(path.read_text())
    assert path.name == "link.json" and doc["rows"] == rows
    assert doc["_metadata"]["world"] == 2 and doc["_metadata"]["line_rate_gbps"] == 450.0
    assert [p.name for p in path.parent.iterdir()] == ["link.json"]  # no temporary left


@pytest.mark.nvcc
def test_run_metadata_names_the_toolchain(monkeypatch):
    # the JSON's metadata of a torchrun run (v0.8 had lost the import it used: the run measured,
    # then failed writing its results)
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    meta = linkbench._metadata(2)
    assert meta["gpu"] == "NVIDIA H200" and meta["world"] == 2
    assert meta["nvcc"] == build_mod.source_toolchain(False).nvcc_version and meta["nvcc"]


# ---- two GPUs ------------------------------------------------------------------------------------

DEADLINE_S = 300
SIZES = (16 * 1001, (1 << 20) + 48)  # not multiples of the CTA ranges: partial and empty CTAs
CTAS = (1, 7, 132)


def _worker(rank: int, world: int, port: int, results) -> None:
    try:
        import torch
        import torch.distributed as dist

        os.environ.update(linkbench.NO_MULTICAST)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MOKGEN_DISABLE_JIT="1")
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        try:
            rows = linkbench.run_link_bench(sizes=SIZES, ctas=CTAS, iters=3, warmup=1, pingpong_iters=50,
                                            timeout_s=20.0)
        finally:
            dist.destroy_process_group()
        results.put((rank, None, rows))
    except BaseException:  # noqa: BLE001 - everything goes to the parent
        results.put((rank, traceback.format_exc(), None))
        raise


@pytest.mark.multi_gpu
def test_link_bench_on_two_gpus():
    linkbench.build_library()  # once here; the ranks load it with the JIT off
    os.environ.update(linkbench.NO_MULTICAST)
    world = 2
    reports = run_ranks(_worker, world, DEADLINE_S, "link-rank")

    rows, others = reports[0], reports[1]
    assert others == []  # rows come back on rank 0 only
    copies = [r for r in rows if r["mode"] in ("pull", "push")]
    assert {(r["mode"], r["bytes"], r["ctas"]) for r in copies} == {
        (m, s, c) for m in ("pull", "push") for s in SIZES for c in CTAS}
    for r in copies:
        assert r["gbps"] > 0 and r["ms"] > 0 and len(r["rank_ms"]) == world and r["ms"] == max(r["rank_ms"])
    (ping,) = [r for r in rows if r["mode"] == "pingpong"]
    assert 0 < ping["one_way_us"] < 1000
