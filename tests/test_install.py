"""A non-editable install works: the wheel carries templates/ and model_specs/ inside the package,
and mokgen runs from it with the checkout out of reach."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mokgen.spec import bundled_specs

ROOT = Path(__file__).resolve().parents[1]


def _copy_project(dest: Path) -> Path:
    """The files a wheel is built from, copied so the build writes nothing into the checkout
    (setuptools leaves build/ and *.egg-info behind, and a stale build/ could leak into a wheel)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info")
    dest.mkdir()
    for name in ("mokgen", "templates", "model_specs"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for extra in ("README.md", "LICENSE"):
        if (ROOT / extra).is_file():
            shutil.copy2(ROOT / extra, dest / extra)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _copy_project(tmp / "src")
    out = tmp / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("mokgen-*.whl")
    return whl


def test_wheel_carries_templates_and_specs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "mokgen/templates/moe_forward.cu.j2" in names
    assert "mokgen/templates/binding.py.j2" in names
    headers = sorted(p.name for p in (ROOT / "templates" / "include" / "mokgen").glob("*.cuh"))
    assert headers
    for h in headers:
        assert f"mokgen/templates/include/mokgen/{h}" in names, h
    # every template file of the checkout travels (the digest, hence the cache key, covers them all)
    for path in (ROOT / "templates").rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            assert "mokgen/templates/" + path.relative_to(ROOT / "templates").as_posix() in names, path
    specs = sorted(n for n in names if n.startswith("mokgen/model_specs/") and n.endswith(".yaml"))
    assert specs == sorted(f"mokgen/model_specs/{n}.yaml" for n in bundled_specs())
    assert len(specs) == 7
    assert "mokgen/cli.py" in names and "mokgen/__main__.py" in names


def test_installed_wheel_runs_without_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOKGEN_")}
    env.update(PYTHONPATH=str(site), MOKGEN_CACHE_DIR=str(tmp_path / "cache"),
               MOKGEN_GENERATED_DIR=str(tmp_path / "generated"))

    def run(*args: str) -> str:
        p = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout

    out = run("-c", "import mokgen, mokgen.paths, mokgen.render as r; "
                    "print(mokgen.__file__); print(mokgen.paths.templates_dir()); "
                    "print(mokgen.paths.specs_dir()); print(r.sources_digest())")
    module, templates, specs, digest = out.split()
    resolved_site = site.resolve()
    for p in (module, templates, specs):
        assert Path(p).resolve().is_relative_to(resolved_site), p
    assert Path(templates).name == "templates" and Path(specs).name == "model_specs"
    # the installed templates are the checkout's: same digest, so the same cache keys
    from mokgen import render

    assert digest == render.sources_digest()

    rows = json.loads(run("-m", "mokgen", "list", "--json"))
    assert sorted(r["name"] for r in rows) == sorted(bundled_specs())
    assert len(rows) == 7
    assert all(Path(r["file"]).resolve().is_relative_to(resolved_site) for r in rows)
    doc = json.loads(run("-m", "mokgen", "show", "kimi-2.5", "--ep", "8", "--json"))
    assert doc["figures"]["local_experts"] == 48


def test_every_switch_is_documented_in_the_readme_and_no_other():
    """The README's switch table and mokgen.env.SWITCHES name the same switches: each switch
    appears in the README, and every row of its table names a switch mokgen reads."""
    import re

    from mokgen import env

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = set(re.findall(r"^\| `(MOKGEN_[A-Z0-9_]+)` \|", readme, re.M))
    named = set(re.findall(r"`(MOKGEN_[A-Z0-9_]+)`", readme))
    assert sorted(set(env.SWITCHES) - named) == []
    assert sorted(rows - set(env.SWITCHES)) == []
