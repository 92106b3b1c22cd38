"""Load: the only code that imports compiled artifacts.

Order: the build cache (exact content key) -> a JIT build (unless MOKGEN_DISABLE_JIT=1). Without
an nvcc, the cache is searched for an entry whose plan, template digest and mokgen version match.
Prebuilt wheels (a later issue) will be looked at first. A loaded binding module is kept per
cache key for the life of the process: the custom op it registers exists once.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from mokgen import build as build_mod
from mokgen import env, render
from mokgen._version import __version__
from mokgen.errors import LoadError, ToolchainError
from mokgen.plan import make_plan, op_identifier
from mokgen.spec import MoESpec

_by_key: dict[str, ModuleType] = {}
_by_spec: dict[str, ModuleType] = {}


def _import_binding(entry: Path, key: str, name: str) -> ModuleType:
    if key in _by_key:
        return _by_key[key]
    path = entry / "binding.py"
    if not path.is_file():
        raise LoadError(f"{entry} is not a complete mokgen build (no binding.py); delete it and rebuild")
    mod_name = f"mokgen._kernels.{op_identifier(name)}_{key[:12]}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    if module.KEY != key:
        raise LoadError(f"{path}: cache key {module.KEY} does not match {key}; delete {entry} and rebuild")
    _by_key[key] = module
    return module


def _find_without_toolchain(spec: MoESpec) -> tuple[Path, str]:
    plan = make_plan(spec, gemm_core=env.gemm_core())
    root = build_mod.cache_root(plan.arch)
    digest = render.sources_digest()
    candidates = sorted(root.glob(f"{plan.name}-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for entry in candidates:
        try:
            doc = json.loads((entry / "plan.json").read_text())
        except (OSError, ValueError):
            continue
        if (
            doc.get("plan") == plan.compile_fields()
            and doc.get("sources_digest") == digest
            and doc.get("mokgen") == __version__
            and build_mod.is_complete(entry, plan)
        ):
            return entry, doc["key"]
    raise LoadError(
        f"no build of {plan.name} in {root} and no nvcc to make one: run `mokgen build {spec.name}` "
        "on a machine with the CUDA toolkit, or install the CUDA toolkit"
    )


def load(spec: MoESpec) -> ModuleType:
    """The binding module of ``spec``'s build (building it first when needed and allowed)."""
    spec_id = json.dumps(spec.canonical_dict(), sort_keys=True)
    if spec_id in _by_spec:
        return _by_spec[spec_id]
    try:
        plan, key, _ = build_mod.plan_and_key(spec)
    except ToolchainError:
        entry, key = _find_without_toolchain(spec)
        name = make_plan(spec, gemm_core=env.gemm_core()).name
    else:
        entry = build_mod.entry_dir(plan, key)
        name = plan.name
        if not build_mod.is_complete(entry, plan):
            if env.jit_disabled():
                raise LoadError(
                    f"{name} is not built and MOKGEN_DISABLE_JIT is set: run `mokgen build {spec.name}` first"
                )
            build_mod.build(spec, publish_generated=False)
    module = _import_binding(entry, key, name)
    _by_spec[spec_id] = module
    return module
