"""Package: a wheel per model from finished cache entries (tuned parameters join when the tuner
lands).

``build_wheel(spec)`` builds (or finds in the cache) the kernel library for each requested arch
and writes ``<package>-<mokgen version>+cu<CUDA>-py3-none-manylinux_2_28_x86_64.whl`` holding:

* ``<package>/artifacts/<arch>/<build>/``: the library, the generated binding, plan.json, the
  generated source and the build log, exactly as in the cache entry;
* ``<package>/spec.yaml``, ``<package>/metadata.json`` (sha256 of every artifact; mokgen, CUDA
  and CUTLASS versions; archs; provenance: mokgen's source commit and whether its tree was dirty),
  ``<package>/__init__.py`` (rendered from templates/prebuilt_init.py.j2);
* the dist-info with an entry point in the ``mokgen.prebuilt`` group named after the spec, and a
  dependency on a compatible mokgen and on torch (no torch version pinned: the library does not
  link torch).

The wheel is written to a temporary file and renamed into place: nothing half-written is left.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import yaml

from mokgen import build as build_mod
from mokgen import render
from mokgen._version import __version__
from mokgen.errors import PlanError
from mokgen.plan import ARCH_TAGS, op_identifier
from mokgen.spec import MoESpec

PLATFORM_TAG = "manylinux_2_28_x86_64"
ENTRY_POINT_GROUP = "mokgen.prebuilt"
METADATA_FORMAT = 1
#: files of a cache entry that travel in the wheel
ARTIFACT_FILES = ("binding.py", "plan.json", "moe_forward.cu", "build.log")


def package_name(spec: MoESpec) -> str:
    """Import name of a spec's prebuilt package, e.g. ``mokgen_kimi_k2_5``."""
    return "mokgen_" + op_identifier(spec.name).lower()


def wheel_version(nvcc_version: str) -> str:
    major, minor = nvcc_version.split(".")[:2]
    return f"{__version__}+cu{major}{minor}"


def mokgen_requirement() -> str:
    """A compatible mokgen: the same minor series (the ABI and metadata format may change across)."""
    major, minor = (int(x) for x in __version__.split(".")[:2])
    return f"mokgen>={major}.{minor},<{major}.{minor + 1}"


def provenance() -> dict:
    """Source commit of this mokgen and whether its tree had uncommitted changes (None outside git)."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                                timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if commit.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(spec: MoESpec, *, out_dir: Path, archs: tuple[str, ...] = ("sm_90a",),
                log: Callable[[str], None] = lambda s: None) -> Path:
    """Build the prebuilt wheel of ``spec`` into ``out_dir``; returns its path."""
    for arch in archs:
        if arch not in ARCH_TAGS:
            raise PlanError(f"{spec.name}: arch {arch!r} is not supported (supported: {', '.join(ARCH_TAGS)})")
    pkg = package_name(spec)
    files: dict[str, bytes] = {}
    builds, artifacts = [], {}
    toolchain = None
    for arch in archs:
        arch_spec = spec.with_target(arch=arch)
        log(f"{spec.name}: building for {arch}")
        result = build_mod.build(arch_spec, publish_generated=False)
        _, _, toolchain = build_mod.plan_and_key(arch_spec)
        rel_dir = f"artifacts/{arch}/{result.entry.name}"
        for name in (result.library.name, *ARTIFACT_FILES):
            data = (result.entry / name).read_bytes()
            files[f"{pkg}/{rel_dir}/{name}"] = data
            artifacts[f"{rel_dir}/{name}"] = hashlib.sha256(data).hexdigest()
        builds.append({"arch": arch, "name": result.name, "key": result.key, "dir": rel_dir,
                       "library": result.library.name})
    assert toolchain is not None
    meta = {
        "format": METADATA_FORMAT,
        "spec": spec.name,
        "package": pkg,
        "mokgen": __version__,
        "cuda": toolchain.nvcc_version,
        "cutlass": toolchain.cutlass_version,
        "archs": list(archs),
        "builds": builds,
        "artifacts": artifacts,
        "tuned": {},
        "provenance": provenance(),
    }
    files[f"{pkg}/metadata.json"] = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()
    files[f"{pkg}/spec.yaml"] = yaml.safe_dump(spec.canonical_dict(), sort_keys=True).encode()
    files[f"{pkg}/__init__.py"] = render.render_prebuilt_init(spec.name, pkg).encode()

    version = wheel_version(toolchain.nvcc_version)
    dist = f"{pkg}-{version}.dist-info"
    files[f"{dist}/METADATA"] = (
        "Metadata-Version: 2.1\n"
        f"Name: {pkg.replace('_', '-')}\n"
        f"Version: {version}\n"
        f"Summary: Prebuilt mokgen MoE kernels for {spec.name}\n"
        "Requires-Python: >=3.10\n"
        f"Requires-Dist: {mokgen_requirement()}\n"
        "Requires-Dist: torch\n"
    ).encode()
    tag = f"py3-none-{PLATFORM_TAG}"
    files[f"{dist}/WHEEL"] = (
        f"Wheel-Version: 1.0\nGenerator: mokgen {__version__}\nRoot-Is-Purelib: false\nTag: {tag}\n"
    ).encode()
    files[f"{dist}/entry_points.txt"] = f"[{ENTRY_POINT_GROUP}]\n{spec.name} = {pkg}\n".encode()
    record = [f"{name},{_record_hash(data)},{len(data)}" for name, data in sorted(files.items())]
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{pkg}-{version}-{tag}.whl"
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{pkg}-", suffix=".whl", dir=out_dir)
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for name, data in sorted(files.items()):
                info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
                info.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, data)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def verify_package(root: Path, meta: dict) -> list[str]:
    """Problems with an installed prebuilt package's artifacts (empty when all are intact)."""
    problems = []
    for rel, digest in sorted(meta.get("artifacts", {}).items()):
        path = root / rel
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            problems.append(f"{path}: sha256 does not match metadata.json (modified or corrupted)")
    return problems


_ARCH_OF_CAPABILITY = {(9, 0): "sm_90a"}


def device_arch() -> str | None:
    """The arch tag of the current GPU (None without a GPU or torch)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return _ARCH_OF_CAPABILITY.get(torch.cuda.get_device_capability())


def installed_packages() -> list[tuple[str, str]]:
    """(spec name, package import name) of every installed prebuilt package."""
    from importlib.metadata import entry_points

    return sorted((ep.name, ep.value) for ep in entry_points(group=ENTRY_POINT_GROUP))


_SAFE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def package_root(module_name: str) -> Path:
    import importlib

    if not _SAFE.match(module_name):
        raise ValueError(f"not a package name: {module_name!r}")
    module = importlib.import_module(module_name)
    return Path(module.__file__).resolve().parent
