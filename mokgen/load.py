"""Load: the only code that imports compiled artifacts.

Order: an installed prebuilt package (``mokgen wheel``; entry point group ``mokgen.prebuilt``,
verified: mokgen version, arch against the GPU, plan, sha256 of every artifact) -> the build
cache (exact content key) -> a JIT build (unless MOKGEN_DISABLE_JIT=1). Without an nvcc, the
cache is searched for an entry whose plan, template digest and mokgen version match. A loaded
binding module is kept per cache key for the life of the process: the custom op it registers
exists once.
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


def _options(options: dict | None) -> dict:
    return env.plan_options() if options is None else options


def _find_without_toolchain(spec: MoESpec, options: dict | None = None) -> tuple[Path, str]:
    plan = make_plan(spec, **_options(options))
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


def find_prebuilt(spec: MoESpec, options: dict | None = None) -> tuple[Path, str] | None:
    """(artifact directory, key) of ``spec`` in an installed prebuilt package, or None when no
    package provides it (or provides a different plan). A package that is present but unusable
    (other mokgen version, no build for this GPU, modified artifacts) is an error, not a miss."""
    from mokgen import package

    plan = make_plan(spec, **_options(options))
    for spec_name, module_name in package.installed_packages():
        if spec_name != spec.name:
            continue
        root = package.package_root(module_name)
        meta = json.loads((root / "metadata.json").read_text())
        if meta.get("mokgen") != __version__:
            raise LoadError(f"prebuilt package {module_name} was built for mokgen {meta.get('mokgen')}; "
                            f"this is mokgen {__version__}: install the matching wheel or uninstall it")
        arch = package.device_arch() or plan.arch
        builds = [b for b in meta.get("builds", []) if b.get("arch") == arch]
        if not builds:
            raise LoadError(f"prebuilt package {module_name} has no build for {arch} "
                            f"(it has: {', '.join(meta.get('archs', [])) or 'none'})")
        entry = root / builds[0]["dir"]
        doc = json.loads((entry / "plan.json").read_text())
        if doc.get("plan") != plan.compile_fields():
            if env.verbose():
                print(f"mokgen: prebuilt {module_name} holds another plan of {spec.name}; not used")
            return None
        flags = (doc.get("toolchain") or {}).get("flags")
        if flags is not None and flags != build_mod.BASE_FLAGS + build_mod.ARCH_FLAGS.get(arch, []):
            # a measuring or fault-injection build (extra -D flags in BASE_FLAGS) is not the
            # package's build of this plan: build it, as the cache key says
            if env.verbose():
                print(f"mokgen: prebuilt {module_name} was built with other nvcc flags; not used")
            return None
        problems = package.verify_package(root, meta)
        if problems:
            raise LoadError(f"prebuilt package {module_name} failed verification: {problems[0]}"
                            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                            + "; reinstall it")
        return entry, builds[0]["key"]
    return None


def memo_key(spec: MoESpec, options: dict) -> str:
    """The per-process memo's key of a load: the spec, the plan options and the nvcc flags of
    the build (build.BASE_FLAGS, part of the cache key too). Without the flags, a measuring build
    (`.ci/ab_variants.py define=NAME`, which sets them) got the module loaded first for the same
    spec and options, so both sides of such an A/B ran one build (docs/perf-notes.md v0.26)."""
    return json.dumps([spec.canonical_dict(), options, list(build_mod.BASE_FLAGS)], sort_keys=True)


def load(spec: MoESpec, options: dict | None = None) -> ModuleType:
    """The binding module of ``spec``'s build (building it first when needed and allowed).
    ``options``: make_plan keyword arguments (default: the environment's, env.plan_options();
    tuned layers pass theirs, mokgen.tune)."""
    options = _options(options)
    spec_id = memo_key(spec, options)
    if spec_id in _by_spec:
        return _by_spec[spec_id]
    prebuilt = find_prebuilt(spec, options)
    if prebuilt is not None:
        entry, key = prebuilt
        module = _import_binding(entry, key, make_plan(spec, **options).name)
        _by_spec[spec_id] = module
        return module
    try:
        plan, key, _ = build_mod.plan_and_key(spec, options=options)
    except ToolchainError:
        entry, key = _find_without_toolchain(spec, options)
        name = make_plan(spec, **options).name
    else:
        entry = build_mod.entry_dir(plan, key)
        name = plan.name
        if not build_mod.is_complete(entry, plan):
            if env.jit_disabled():
                raise LoadError(
                    f"{name} is not built and MOKGEN_DISABLE_JIT is set: run `mokgen build {spec.name}` first"
                )
            build_mod.build(spec, publish_generated=False, options=options)
    module = _import_binding(entry, key, name)
    _by_spec[spec_id] = module
    return module
