"""Build: the only code that runs nvcc.

A build entry is ``$MOKGEN_CACHE_DIR/<mokgen version>/<arch>/<name>-<key12>/`` holding the
rendered sources, the launcher library ``lib<name>.so``, ``plan.json`` and ``build.log`` (with
ptxas's resource report). Entries are content-addressed (see plan.cache_key), built in a
temporary sibling and renamed into place under an flock-based lock (the kernel drops the lock
when its holder dies, so a stale lock never blocks). A failed build leaves no entry: its sources
and log go to ``<cache>/<version>/failed/<name>-<key12>/`` and the error names them.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

from mokgen import env, render
from mokgen._version import __version__
from mokgen.errors import BuildError, InputError, LoadError, ToolchainError
from mokgen.paths import templates_dir
from mokgen.plan import Plan, cache_key, make_plan
from mokgen.spec import MoESpec

#: gencode flags per target architecture
ARCH_FLAGS = {"sm_90a": ["-gencode=arch=compute_90a,code=sm_90a"]}
#: flags every build uses (part of the cache key). -fno-gnu-unique: a static local of an inline
#: function or template (a launcher's cache, its guard variable, a "done once" flag) is otherwise a
#: GNU-unique symbol, which the dynamic linker makes one object for every library in the process,
#: even libraries loaded RTLD_LOCAL; two mokgen libraries in one process (two specs, a build and
#: its measuring variant) then shared such flags, and the second library's kernels could launch
#: without their shared-memory attribute (v0.34, found by .ci/mx_gemm_probe.py --probe).
BASE_FLAGS = ["-std=c++17", "-O3", "--shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-fno-gnu-unique", "-lineinfo",
              "-Xptxas", "-v"]

#: the wait stages (sync.cuh's Stage, abi.STAGES) that a fault-injection build can make time out
FAULT_STAGES = (2, 3, 4, 5, 6)


def fault_flags(stage: int) -> list[str]:
    """The nvcc flags of a fault-injection build of the forward megakernel (tests only): with
    ``-DMOKGEN_FAULT_STAGE=stage`` the kernel leaves out the one signal whose absence makes the
    waits of that stage time out (sync.cuh; docs/architecture.md, "Fault injection"). Stage 1 has
    its run-time switch instead (``virtual_ep_forward(simulate_missing_rank=r)``). Add them to
    BASE_FLAGS (part of the cache key and of load's memo key), as tests/test_gpu_faults.py does:
    the build is then an entry of its own, and the default build is untouched."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in FAULT_STAGES:
        raise InputError(f"fault stage must be one of {', '.join(map(str, FAULT_STAGES))} (sync.cuh, enum Stage; "
                         f"stage 1 is simulate_missing_rank), got {stage!r}")
    return [f"-DMOKGEN_FAULT_STAGE={stage}"]


@dataclass(frozen=True)
class Toolchain:
    nvcc: str
    nvcc_version: str
    cutlass_include: str
    cutlass_version: str

    def key_fields(self, arch: str) -> dict:
        """What of the toolchain enters the cache key (paths do not; versions and flags do)."""
        return {
            "nvcc_version": self.nvcc_version,
            "cutlass_version": self.cutlass_version,
            "arch": arch,
            "flags": BASE_FLAGS + ARCH_FLAGS[arch],
        }


def find_nvcc() -> str:
    override = env.nvcc_override()
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise ToolchainError(f"MOKGEN_NVCC={override} is not an executable file")
        return override
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    if os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
        return "/usr/local/cuda/bin/nvcc"
    raise ToolchainError("nvcc not found: install the CUDA toolkit (12.8+), or set MOKGEN_NVCC or CUDA_HOME")


@lru_cache(maxsize=8)
def _nvcc_version(nvcc: str, mtime: float) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ToolchainError(f"cannot run {nvcc} --version: {err}") from None
    m = re.search(r"release (\d+\.\d+), V([\d.]+)", out)
    if not m:
        raise ToolchainError(f"cannot parse the version of {nvcc}: {out.strip()[:200]!r}")
    return m.group(2)


def find_cutlass() -> tuple[str, str]:
    """(include dir, version) of the CUTLASS/CuTe headers from the nvidia-cutlass package."""
    override = env.cutlass_dir_override()
    if override:
        include = Path(override)
    else:
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or spec.origin is None:
            raise ToolchainError(
                "CUTLASS headers not found: pip install nvidia-cutlass (or set MOKGEN_CUTLASS_DIR)"
            )
        include = Path(spec.origin).parent / "source" / "include"
    version_h = include / "cutlass" / "version.h"
    if not version_h.is_file():
        raise ToolchainError(f"CUTLASS headers not found: no {version_h}")
    text = version_h.read_text()
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise ToolchainError(f"cannot read the CUTLASS version from {version_h}")
    return str(include), ".".join(m.group(1) for m in parts)  # type: ignore[union-attr]


def find_toolchain() -> Toolchain:
    nvcc = find_nvcc()
    include, version = find_cutlass()
    return Toolchain(nvcc, _nvcc_version(nvcc, os.path.getmtime(nvcc)), include, version)


# ---- cache layout ----------------------------------------------------------------------------


def cache_root(arch: str) -> Path:
    return env.cache_dir() / __version__ / arch


def library_name(plan: Plan) -> str:
    return f"lib{plan.name}.so"


# ---- fixed-source libraries (one build for every spec: the link benchmark, the backward GEMMs) -


def _source_flags(arch: str) -> list[str]:
    return [*BASE_FLAGS, *ARCH_FLAGS[arch]]


def source_toolchain(cutlass: bool) -> Toolchain:
    """nvcc, and the CUTLASS headers only where the source needs them (the link benchmark builds
    without the nvidia-cutlass package)."""
    if cutlass:
        return find_toolchain()
    nvcc = find_nvcc()
    return Toolchain(nvcc, _nvcc_version(nvcc, os.path.getmtime(nvcc)), "", "")


def source_key(source: str, tc: Toolchain, *, cutlass: bool, arch: str = "sm_90a") -> str:
    """sha256 over ``templates/<source>``, every header it could include, the flags, the nvcc
    version and (``cutlass``: built against the CUTLASS headers) the CUTLASS version; the
    mokgen version is in the cache path."""
    root = templates_dir()
    h = hashlib.sha256()
    for path in [root / source, *sorted(p for p in (root / "include" / "mokgen").iterdir() if p.is_file())]:
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    meta = {"flags": _source_flags(arch), "nvcc": tc.nvcc_version, "arch": arch}
    if cutlass:
        meta["cutlass"] = tc.cutlass_version
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()


def source_library_path(source: str, library: str, *, cutlass: bool, arch: str = "sm_90a",
                        toolchain: Toolchain | None = None) -> Path:
    """Where this toolchain's build of ``templates/<source>`` lives (built or not):
    ``<cache>/<version>/<arch>/<source stem>-<key[:12]>/<library>``."""
    tc = toolchain or source_toolchain(cutlass)
    key = source_key(source, tc, cutlass=cutlass, arch=arch)
    return cache_root(arch) / f"{Path(source).stem}-{key[:12]}" / library


def build_source(source: str, library: str, *, cutlass: bool, arch: str = "sm_90a", force: bool = False) -> Path:
    """Compile ``templates/<source>`` into the build cache once (or find it there); returns the
    library's path. Built in a temporary sibling and renamed into place under a file lock; a
    failed build keeps its source and log under ``<cache>/<version>/failed/`` and names them."""
    tc = source_toolchain(cutlass)
    lib = source_library_path(source, library, cutlass=cutlass, arch=arch, toolchain=tc)
    entry = lib.parent
    if lib.is_file() and not force:
        return lib
    with file_lock(entry.parent / f".{entry.name}.lock"):
        if lib.is_file() and not force:  # another process built it meanwhile
            return lib
        tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            shutil.copyfile(templates_dir() / source, tmp / source)
            cmd = [tc.nvcc, *_source_flags(arch), "-I", str(templates_dir() / "include")]
            if cutlass:
                cmd += ["-I", tc.cutlass_include]
            code, log = run_nvcc([*cmd, source, "-o", library], tmp, source)
            settle_entry(tmp, entry, source, log, code == 0)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return lib


def build_variant(source: str, library: str, out_dir: Path, flags: list[str], *, cutlass: bool,
                  arch: str = "sm_90a") -> Path:
    """Compile ``templates/<source>`` with more nvcc ``flags`` (a variant's macros, a trace
    build) into ``out_dir/<library>``, outside the build cache, with the log in
    ``out_dir/build.log`` (read by ``serialized_wgmma``); a failed build is a BuildError naming
    the log. For benchmarks that compare a variant with the tree's own build in one process."""
    tc = source_toolchain(cutlass)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [tc.nvcc, *_source_flags(arch), *flags, "-I", str(templates_dir() / "include")]
    if cutlass:
        cmd += ["-I", tc.cutlass_include]
    code, log = run_nvcc([*cmd, str(templates_dir() / source), "-o", str(out_dir / library)], out_dir, source)
    (out_dir / "build.log").write_text(log)
    if code != 0:
        raise BuildError(f"the {source} variant ({' '.join(flags)}) failed to build; see {out_dir / 'build.log'}")
    return out_dir / library


# (source, library, arch, build cache directory) -> the library found or built there
_found_sources: dict[tuple[str, str, str, str], Path] = {}


def find_source_library(source: str, library: str, *, cutlass: bool, arch: str = "sm_90a", module: str) -> Path:
    """``templates/<source>``'s library: found in the build cache, or built there first (with
    MOKGEN_DISABLE_JIT=1 a missing build is an error that names ``<module>.build_library()``).
    Once per process and cache directory: finding the build hashes the source and every header
    (about 1 ms of CPU), and the backward GEMMs did it per call, six times a step, which showed
    as GPU idle time between their launches (v0.8)."""
    key = (source, library, arch, str(env.cache_dir()))
    lib = _found_sources.get(key)
    if lib is None:
        lib = source_library_path(source, library, cutlass=cutlass, arch=arch)
        if not lib.is_file():
            if env.jit_disabled():
                raise LoadError(f"no build of {source} at {lib} and MOKGEN_DISABLE_JIT=1: "
                                f"run {module}.build_library() first")
            lib = build_source(source, library, cutlass=cutlass, arch=arch)
        _found_sources[key] = lib
    return lib


@dataclass(frozen=True)
class BuildResult:
    name: str
    key: str
    entry: Path          # the cache entry directory
    library: Path
    cached: bool         # True: found in the cache, nvcc did not run
    seconds: float

    def to_json(self) -> dict:
        d = asdict(self)
        d["entry"], d["library"] = str(self.entry), str(self.library)
        return d


def entry_dir(plan: Plan, key: str) -> Path:
    return cache_root(plan.arch) / f"{plan.name}-{key[:12]}"


def is_complete(entry: Path, plan: Plan) -> bool:
    return (entry / library_name(plan)).is_file() and (entry / "plan.json").is_file()


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def plan_and_key(spec: MoESpec, toolchain: Toolchain | None = None,
                 options: dict | None = None) -> tuple[Plan, str, Toolchain]:
    """The plan of ``spec`` under ``options`` (make_plan keyword arguments; default: the
    environment's, ``env.plan_options()``), its cache key and the toolchain."""
    plan = make_plan(spec, **(env.plan_options() if options is None else options))
    tc = toolchain or find_toolchain()
    key = cache_key(plan, sources_digest=render.sources_digest(), toolchain=tc.key_fields(plan.arch))
    return plan, key, tc


def raw_twin_options(spec: MoESpec, options: dict | None = None) -> dict | None:
    """Under MOKGEN_MX_FWD_WEIGHTS=auto (the default since v0.69): where ``spec``'s build under
    ``options`` (default: the environment's) is an MXFP8 build of the expanded form taking the
    weights' MX values, the options of its raw twin (plan mx_fwd_weights "raw"), which a one-GPU
    MoELayer loads beside it for training launches (mokgen.ep._raw_twin); else None."""
    if not env.mx_fwd_weights_auto():
        return None
    options = env.plan_options() if options is None else options
    plan = make_plan(spec, **options)
    if plan.numerics != "mxfp8" or plan.mx_form != "expand" or plan.mx_fwd_weights != "values":
        return None
    return {**options, "mx_fwd_weights": "raw"}


def _plan_json(plan: Plan, key: str, tc: Toolchain, spec: MoESpec) -> str:
    doc = {
        "name": plan.name,
        "key": key,
        "mokgen": __version__,
        "plan": plan.compile_fields(),
        "spec": spec.canonical_dict(),
        "toolchain": tc.key_fields(plan.arch),
        "sources_digest": render.sources_digest(),
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def _first_error(log: str) -> str:
    # the "$ nvcc ..." line is the command itself (its paths may contain the word "error")
    output = [l for l in log.splitlines() if not l.startswith("$ ")]
    for line in output:
        if re.search(r"\berror\b", line, re.IGNORECASE):
            return line.strip()
    lines = [l.strip() for l in output if l.strip()]
    return lines[-1] if lines else "no output"


def run_nvcc(cmd: list[str], cwd: Path, what: str) -> tuple[int, str]:
    """Runs an nvcc command line in ``cwd`` under MOKGEN_BUILD_TIMEOUT; returns (exit status,
    log: the command line and its output). ``what`` names the build in errors."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=env.build_timeout())
    except subprocess.TimeoutExpired:
        raise BuildError(f"nvcc timed out after {env.build_timeout():.0f} s building {what}") from None
    except OSError as err:
        raise ToolchainError(f"cannot run {cmd[0]}: {err}") from None
    return proc.returncode, "$ " + " ".join(cmd) + "\n" + proc.stdout + proc.stderr


def _compile(tmp: Path, plan: Plan, tc: Toolchain, log: Callable[[str], None]) -> str:
    cmd = [
        tc.nvcc, *BASE_FLAGS, *ARCH_FLAGS[plan.arch],
        "-I", str(templates_dir() / render.INCLUDE_SUBDIR), "-I", tc.cutlass_include,
        "moe_forward.cu", "-o", library_name(plan),
    ]
    if env.verbose():
        log(" ".join(cmd))
    code, text = run_nvcc(cmd, tmp, plan.name)
    if code != 0:
        raise _CompileFailed(text)
    return text


class _CompileFailed(Exception):
    def __init__(self, log: str):
        self.log = log


def build(
    spec: MoESpec,
    *,
    force: bool = False,
    publish_generated: bool = True,
    log: Callable[[str], None] = lambda s: None,
    options: dict | None = None,
) -> BuildResult:
    """Compile ``spec`` (or find it in the cache) and return where the library is. ``options``:
    make_plan keyword arguments (default: the environment's; tuned builds pass theirs)."""
    start = time.perf_counter()
    plan, key, tc = plan_and_key(spec, options=options)
    entry = entry_dir(plan, key)
    if not force and is_complete(entry, plan):
        if publish_generated:
            publish_to_generated(plan, entry)
        return BuildResult(plan.name, key, entry, entry / library_name(plan), True, time.perf_counter() - start)

    with file_lock(entry.parent / f".{entry.name}.lock"):
        if not force and is_complete(entry, plan):  # another process finished it meanwhile
            cached = True
        else:
            files = render.render(plan, key)
            tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}"
            try:
                render.write_tree({**files, "plan.json": _plan_json(plan, key, tc, spec)}, tmp)
                try:
                    text, ok = _compile(tmp, plan, tc, log), True
                except _CompileFailed as failed:
                    text, ok = failed.log, False
                settle_entry(tmp, entry, "moe_forward.cu", text, ok)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
            cached = False
    if publish_generated:
        publish_to_generated(plan, entry)
    return BuildResult(plan.name, key, entry, entry / library_name(plan), cached, time.perf_counter() - start)


def settle_entry(tmp: Path, entry: Path, source: str, log: str, ok: bool) -> None:
    """After an nvcc run in the temporary directory ``tmp``: write its build.log, then either
    publish ``tmp`` as the cache ``entry`` (replacing a stale one) or, on failure, keep it under
    ``<cache>/<version>/failed/`` and raise a BuildError naming the source, first error and log."""
    (tmp / "build.log").write_text(log)
    if not ok:
        kept = _keep_failed(tmp, entry)
        raise BuildError(f"nvcc failed on {kept / source}: {_first_error(log)} (full log: {kept / 'build.log'})")
    if entry.exists():
        shutil.rmtree(entry)
    os.rename(tmp, entry)


def _keep_failed(tmp: Path, entry: Path) -> Path:
    failed = entry.parent.parent / "failed" / entry.name
    failed.parent.mkdir(parents=True, exist_ok=True)
    if failed.exists():
        shutil.rmtree(failed)
    shutil.move(str(tmp), str(failed))
    return failed


def publish_to_generated(plan: Plan, entry: Path) -> Path:
    """generated/<name>/: the sources, plan.json, build.log and a link to the cached library."""
    dest = env.generated_dir() / plan.name
    lib = entry / library_name(plan)
    link = dest / library_name(plan)
    if link.is_symlink() and os.readlink(link) == str(lib) and (dest / "moe_forward.cu").is_file():
        return dest
    files: dict[str, str | bytes | Path] = {}
    for item in sorted(entry.iterdir()):
        if item.is_file() and item.name != library_name(plan):
            files[item.name] = item
    return render.write_tree(files, dest, links={library_name(plan): lib})


def resource_report(entry: Path) -> list[str]:
    """ptxas's per-kernel lines (registers, spills) from an entry's build log."""
    log = (entry / "build.log").read_text()
    return [l.strip() for l in log.splitlines() if "ptxas info" in l or "spill" in l]


def serialized_wgmma(entry: Path) -> list[str]:
    """The kernels of an entry whose wgmma ptxas serialized (its "Potential Performance Loss:
    wgmma.mma_async instructions are serialized" lines, whatever the code: C7510 for a function
    call such as printf anywhere in the kernel, C7520 for a compiler-inserted warpgroup.arrive in
    what ptxas takes for a divergent path; each HGMMA then waits for the one before), as mangled
    names, each once; empty when every pipeline is kept."""
    log = (entry / "build.log").read_text()
    names = re.findall(r"\(C\d+\) Potential Performance Loss: wgmma\.mma_async instructions are serialized.*?"
                       r"in the function '(\w+)'", log)
    return list(dict.fromkeys(names))
