"""The command line, through click's CliRunner and as a real `python -m mokgen` subprocess."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mokgen._version import __version__
from mokgen.cli import main
from mokgen.plan import build_name
from mokgen.spec import bundled_specs, load_spec
from conftest import pythonpath

ROOT = Path(__file__).resolve().parents[1]
ALL_SPECS = sorted(bundled_specs())
SMALL = "qwen3-30b-a3b"


def _runner() -> CliRunner:
    # click < 8.2 mixes stderr into stdout unless told not to; 8.2+ always keeps both apart
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:
        return CliRunner(mix_stderr=False)
    return CliRunner()


def invoke(*args: str):
    result = _runner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def run_module(*args: str, env: dict | None = None, cwd: Path = ROOT):
    full_env = dict(os.environ, PYTHONPATH=pythonpath(ROOT), **(env or {}))
    proc = subprocess.run([sys.executable, "-m", "mokgen", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def _nothing_written(cache: Path, generated: Path) -> None:
    for d in (cache, generated):
        assert not d.exists() or list(d.rglob("*")) == [], f"something was written under {d}"


def _one_error_line(code: int, out: str, err: str) -> str:
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    return lines[0]


# ---- list ------------------------------------------------------------------------------------


def test_list_table_names_every_spec_in_full():
    code, out, err = invoke("list")
    assert code == 0, err
    for name in ALL_SPECS:
        assert name in out, f"{name} missing or cut short in:\n{out}"


def test_list_json():
    code, out, err = invoke("list", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["name"] for r in rows] == ALL_SPECS
    kimi = next(r for r in rows if r["name"] == "kimi-k2.5")
    assert kimi["aliases"] == ["kimi-2.5", "kimi-k2.7-code"]
    assert (kimi["hidden"], kimi["intermediate"], kimi["experts"], kimi["top_k"]) == (7168, 2048, 384, 8)
    assert Path(kimi["file"]) == bundled_specs()["kimi-k2.5"]


def test_list_json_subprocess():
    code, out, err = run_module("list", "--json")
    assert code == 0, err
    assert sorted(r["name"] for r in json.loads(out)) == ALL_SPECS
    assert len(ALL_SPECS) == 7


# ---- show ------------------------------------------------------------------------------------


def test_show_json_by_alias():
    code, out, err = invoke("show", "kimi-2.5", "--ep", "8", "--tokens", "2048", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["name"] == "moe_kimi-k2.5_bf16_h7168_i2048_e384_k8_sm90a"
    assert doc["spec"]["name"] == "kimi-k2.5"
    f = doc["figures"]
    assert (f["ep"], f["tokens_per_rank"], f["local_experts"]) == (8, 2048, 48)
    assert f["flops_per_token_routed_fwd"] == 6 * 8 * 7168 * 2048
    assert f["expert_weight_bytes"] == 3 * 7168 * 2048 * 2
    assert f["buffers_per_rank"]["combine_slots"] == 2048 * 8 * 7168 * 2
    assert doc["plan"]["hidden_size"] == 7168 and doc["plan"]["num_experts"] == 384
    assert "plan_error" not in doc


def test_show_table():
    code, out, err = invoke("show", "kimi-2.5", "--ep", "8", "--tokens", "2048")
    assert code == 0, err
    assert "moe_kimi-k2.5_bf16_h7168_i2048_e384_k8_sm90a" in out
    assert "hidden 7168, expert intermediate 2048" in out
    assert "48 experts" in out
    assert "FLOPs / token" in out and "0.705" in out  # 6*8*7168*2048 = 0.705 GFLOP routed
    assert "worst_case_rows" in out and "131072" in out


def test_show_mxfp8_shows_its_plan():
    code, out, err = invoke("show", "kimi-k2.5", "--numerics", "mxfp8", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["name"] == "moe_kimi-k2.5_mxfp8_h7168_i2048_e384_k8_sm90a"
    # v0.58's default: the expanded form in CTA pairs where BF16 builds pair
    assert doc["plan"]["numerics"] == "mxfp8" and doc["plan"]["gemm_cluster"] == 2
    assert doc["plan"]["mx_form"] == "expand"
    assert doc["figures"]["local_experts"] == 384
    code, out, err = invoke("show", "kimi-k2.5", "--numerics", "mxfp8")
    assert code == 0 and "mxfp8" in out, err
    code, out, err = run_module("show", "kimi-k2.5", "--numerics", "mxfp8", env={"COLUMNS": "200"})
    assert code == 0 and "stages 4, CTA pairs, MX form expand" in out, err


# ---- doctor, version ---------------------------------------------------------------------------


def test_version():
    code, out, _ = invoke("--version")
    assert code == 0
    assert out.strip() == f"mokgen, version {__version__}"
    code, out, _ = run_module("--version")
    assert code == 0 and __version__ in out


def test_doctor():
    code, out, err = invoke("doctor")
    assert code == 0, err
    assert "nvcc" in out
    code, out, err = invoke("doctor", "--json")
    assert code == 0, err
    checks = {c["check"]: c for c in json.loads(out)}
    assert {"python", "mokgen", "nvcc", "CUTLASS/CuTe headers", "cache", "generated"} <= set(checks)
    assert checks["mokgen"]["detail"] == __version__


@pytest.mark.nvcc
def test_doctor_finds_nvcc():
    code, out, err = invoke("doctor", "--json")
    assert code == 0, err
    nvcc = next(c for c in json.loads(out) if c["check"] == "nvcc")
    assert nvcc["ok"] is True and "nvcc" in nvcc["detail"]


def test_doctor_without_nvcc_still_exits_0(monkeypatch):
    monkeypatch.setenv("MOKGEN_NVCC", "/nonexistent/nvcc")
    code, out, err = invoke("doctor", "--json")
    assert code == 0, err
    nvcc = next(c for c in json.loads(out) if c["check"] == "nvcc")
    assert nvcc["ok"] is False and "MOKGEN_NVCC" in nvcc["detail"]


# ---- render and build (nvcc: the cache key includes the toolchain) -----------------------------


@pytest.mark.nvcc
def test_render_writes_generated_sources(private_dirs):
    cache, generated = private_dirs
    code, out, err = invoke("render", SMALL)
    assert code == 0, err
    name = build_name(load_spec(SMALL))
    dest = generated / name
    assert sorted(p.name for p in dest.iterdir()) == ["binding.py", "moe_forward.cu"]
    first = (dest / "moe_forward.cu").read_text().splitlines()[0]
    assert first == f"// generated by mokgen {__version__} from templates/moe_forward.cu.j2 for {SMALL}; do not edit."
    assert (dest / "binding.py").read_text().startswith(f"# generated by mokgen {__version__} from templates/binding.py.j2")
    assert str(dest) in out
    assert not cache.exists()  # render does not compile
    # rendering again gives the same bytes
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    assert invoke("render", SMALL)[0] == 0
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before


@pytest.mark.nvcc
def test_build_command(tmp_path, monkeypatch):
    generated = tmp_path / "generated"
    monkeypatch.setenv("MOKGEN_GENERATED_DIR", str(generated))  # the session cache: compiled once
    code, out, err = invoke("build", SMALL)
    assert code == 0, err
    name = build_name(load_spec(SMALL))
    assert out.startswith(f"{name}: ")
    assert "compiled" in out or "cache hit" in out
    assert (generated / name / f"lib{name}.so").resolve().is_file()
    assert f"  {generated / name}/ holds the sources" in out  # the directory written, not ./generated
    code, out, err = invoke("build", "--json", SMALL)
    assert code == 0, err
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["name"] == name and doc["cached"] is True
    assert Path(doc["library"]).is_file()


@pytest.mark.nvcc
def test_build_subprocess(tmp_path):
    env = {"MOKGEN_GENERATED_DIR": str(tmp_path / "generated")}
    code, out, err = run_module("build", "--json", SMALL, env=env, cwd=tmp_path)
    assert code == 0, err
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["name"] == build_name(load_spec(SMALL)) and Path(doc["library"]).is_file()


# ---- bad input: exit 2, one `error:` line, nothing written -------------------------------------


def _spec_file(tmp_path: Path, filename: str = "bad.yaml", **changes) -> Path:
    data = yaml.safe_load(bundled_specs()[SMALL].read_text())
    data["name"] = "my-spec"
    data.pop("aliases", None)
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node[part]
        node[leaf] = value
    path = tmp_path / filename
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _bad_specs(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """case -> (spec argument, text the error line must contain)"""
    malformed = tmp_path / "malformed.yaml"
    malformed.write_text("name: my-spec\nhidden_size: [2048\n")
    return {
        "unknown name": ("no-such-model", "unknown spec 'no-such-model'"),
        "missing file": (str(tmp_path / "missing.yaml"), "spec file not found"),
        "malformed yaml": (str(malformed), "malformed YAML"),
        "unknown field": (str(_spec_file(tmp_path, "unknown.yaml", colour="red")), "colour: unknown field"),
        "top_k > experts": (str(_spec_file(tmp_path, "topk.yaml", num_experts=4, top_k=8)), "top_k: must be between 1 and num_experts (4)"),
        "unsupported arch": (str(_spec_file(tmp_path, "arch.yaml", target__arch="sm_80")), "target.arch"),
    }


BAD_CASES = ["unknown name", "missing file", "malformed yaml", "unknown field", "top_k > experts", "unsupported arch"]


@pytest.mark.parametrize("command", ["show", "render", "build"])
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_spec(case, command, tmp_path, private_dirs):
    ref, expected = _bad_specs(tmp_path)[case]
    line = _one_error_line(*invoke(command, ref))
    assert expected in line, line
    _nothing_written(*private_dirs)


def test_bad_spec_subprocess(tmp_path, private_dirs):
    for case in ("unknown name", "unsupported arch"):
        ref, expected = _bad_specs(tmp_path)[case]
        line = _one_error_line(*run_module("build", ref, cwd=tmp_path))
        assert expected in line, line
    _nothing_written(*private_dirs)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["show", "kimi-k2.5", "--ep", "7"], "ep (7) must divide num_experts (384)"),
        (["show", "kimi-k2.5", "--ep", "128"], "exceeds target.max_ep_ranks (64)"),
        (["show", "kimi-k2.5", "--tokens", "20000"], "tokens (20000)"),
        (["show", "kimi-k2.5", "--ep", "0"], "--ep"),
        (["show", "kimi-k2.5", "--numerics", "fp4"], "--numerics"),
        (["show"], "Missing argument"),
        (["frobnicate"], "No such command"),
    ],
)
def test_bad_arguments(args, expected, private_dirs):
    line = _one_error_line(*invoke(*args))
    assert expected in line, line
    _nothing_written(*private_dirs)


def test_build_without_nvcc(private_dirs, monkeypatch):
    monkeypatch.setenv("MOKGEN_NVCC", "/nonexistent")
    line = _one_error_line(*invoke("build", SMALL))
    assert "MOKGEN_NVCC=/nonexistent" in line
    line = _one_error_line(*run_module("build", SMALL))
    assert "MOKGEN_NVCC=/nonexistent" in line
    _nothing_written(*private_dirs)


def test_build_validates_every_spec_before_compiling(private_dirs):
    line = _one_error_line(*invoke("build", SMALL, "no-such-model"))
    assert "unknown spec 'no-such-model'" in line
    _nothing_written(*private_dirs)


def test_render_mxfp8_sets_the_kernels_numerics(private_dirs):
    code, out, err = invoke("render", "--numerics", "mxfp8", "kimi-k2.5")
    assert code == 0, err
    cu = [Path(line.strip()) for line in out.splitlines() if line.strip().endswith(".cu")]
    assert cu and "static constexpr bool kMx = true;" in cu[0].read_text()
    assert "static constexpr bool kMxExpand = true;" in cu[0].read_text()  # v0.58's default for kimi-k2.5
    code, out, err = invoke("render", "--numerics", "mxfp8", "qwen3-30b-a3b")
    cu = [Path(line.strip()) for line in out.splitlines() if line.strip().endswith(".cu")]
    assert code == 0 and "static constexpr bool kMxExpand = false;" in cu[0].read_text()  # codes below 5120
    code, out, err = invoke("render", "kimi-k2.5")
    cu = [Path(line.strip()) for line in out.splitlines() if line.strip().endswith(".cu")]
    assert code == 0 and "static constexpr bool kMx = false;" in cu[0].read_text()


def test_render_mxfp8_with_the_weights_raw(private_dirs, monkeypatch):
    """MOKGEN_MX_FWD_WEIGHTS=raw (v0.68): the rendered kernel quantizes the weights in its tiles
    (Cfg::kMxRawB) in the expanded form, and the binding says it takes them raw; bf16 builds and
    the default say values."""
    monkeypatch.setenv("MOKGEN_MX_FWD_WEIGHTS", "raw")
    for spec, numerics, raw in (("qwen3-30b-a3b", "mxfp8", True), ("kimi-k2.5", "bf16", False)):
        code, out, err = invoke("render", "--numerics", numerics, spec)
        assert code == 0, err
        paths = [Path(line.strip()) for line in out.splitlines() if line.strip().endswith((".cu", ".py"))]
        cu = next(p for p in paths if p.suffix == ".cu").read_text()
        binding = next(p for p in paths if p.suffix == ".py").read_text()
        flag = "true" if raw else "false"
        assert f"static constexpr bool kMxRawB = {flag};" in cu, spec
        assert f"static constexpr bool kMxExpand = {flag};" in cu, spec  # raw takes the expanded form
        assert f'MX_FWD_WEIGHTS = "{"raw" if raw else "values"}"' in binding, spec
    monkeypatch.delenv("MOKGEN_MX_FWD_WEIGHTS")
    code, out, err = invoke("render", "--numerics", "mxfp8", "kimi-k2.5")
    cu = [Path(line.strip()) for line in out.splitlines() if line.strip().endswith(".cu")]
    assert code == 0 and "static constexpr bool kMxRawB = false;" in cu[0].read_text()


# ---- the file system: folders that cannot be written are one-line errors too --------------------------


def _file_in_the_way(tmp_path: Path) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    return blocker


def test_generated_dir_under_a_file_is_one_line(tmp_path, private_dirs, monkeypatch):
    """An OSError (here NotADirectoryError from making generated/NAME under a regular file) is the
    `error: PATH: reason` line, not a traceback; the cache stays empty."""
    blocker = _file_in_the_way(tmp_path)
    monkeypatch.setenv("MOKGEN_GENERATED_DIR", str(blocker / "generated"))
    line = _one_error_line(*invoke("render", SMALL))
    assert str(blocker) in line and "Not a directory" in line, line
    assert blocker.read_text() == "not a folder\n"
    _nothing_written(private_dirs[0], private_dirs[1])


def test_cache_dir_that_is_a_file_is_one_line_before_compiling(tmp_path, private_dirs, monkeypatch):
    blocker = _file_in_the_way(tmp_path)
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(blocker))
    line = _one_error_line(*invoke("build", SMALL))
    assert str(blocker) in line, line
    _nothing_written(*private_dirs)


@pytest.mark.parametrize("command", [["bench", SMALL], ["wheel", SMALL]])
def test_out_under_a_file_is_refused_before_the_work(command, tmp_path, private_dirs):
    """bench and wheel check --out before timing or compiling anything (bench used to write its results
    only at the end, so a bad --out lost a whole run); nothing is made."""
    blocker = _file_in_the_way(tmp_path)
    line = _one_error_line(*invoke(*command, "--out", str(blocker / "sub" / "out")))
    assert f"--out {blocker / 'sub' / 'out'}: {blocker} is not a directory" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no cache, no generated/, no out/


def test_out_check_leaves_no_probe_and_makes_no_folder(tmp_path):
    from mokgen.cli import _check_out_dir

    out = _check_out_dir(str(tmp_path / "x" / "y"), "--out")
    assert out == tmp_path / "x" / "y" and list(tmp_path.iterdir()) == []


def test_show_refuses_a_bad_environment_switch(monkeypatch, private_dirs):
    """A bad MOKGEN_* switch is an error in show as in render and build (it used to print inside the
    table with exit code 0)."""
    monkeypatch.setenv("MOKGEN_SCHEDULE", "foo")
    for command in ("show", "render"):
        line = _one_error_line(*invoke(command, SMALL))
        assert "MOKGEN_SCHEDULE must be flow or phased, got 'foo'" in line, line
    _nothing_written(*private_dirs)


def test_build_refuses_an_empty_gpu_name(private_dirs):
    line = _one_error_line(*invoke("build", SMALL, "--ep", "1", "--tokens", "4096", "--gpu", " "))
    assert "--gpu needs a GPU name" in line
    _nothing_written(*private_dirs)


def test_numerics_option_is_described_in_help():
    for command in ("render", "build"):
        code, out, _ = invoke(command, "--help")
        assert code == 0 and "override target.numerics" in out, out


def test_wheel_builds_each_arch_once(tmp_path, monkeypatch):
    """`--arch sm_90a --arch sm_90a` asks for one build, not two listed twice in the wheel's metadata."""
    from mokgen import package

    seen = []

    def fake_build_wheel(spec, *, out_dir, archs, log):
        seen.append(archs)
        return out_dir / f"{spec.name}.whl"

    monkeypatch.setattr(package, "build_wheel", fake_build_wheel)
    code, out, err = invoke("wheel", SMALL, "--arch", "sm_90a", "--arch", "sm_90a", "--out", str(tmp_path))
    assert code == 0, err
    assert seen == [("sm_90a",)]


def test_bundled_name_with_a_suffix_gets_a_hint(private_dirs):
    line = _one_error_line(*invoke("show", "kimi-k2.5.yaml"))
    assert "spec file not found (the bundled spec is named without a path or suffix: 'kimi-k2.5')" in line


def test_build_mxfp8_builds_the_raw_twin_under_auto(monkeypatch, tmp_path):
    """`mokgen build --numerics mxfp8` under MOKGEN_MX_FWD_WEIGHTS=auto (the default since v0.69):
    an expanded-form build (kimi-k2.5) is followed by its raw twin (mx_fwd_weights "raw", not
    published to generated/), which a one-GPU layer loads for training; a codes-form build
    (qwen3-30b-a3b), a bf16 build and the switch set to values build one library each."""
    from mokgen import build as build_mod

    calls = []

    def fake_build(spec, *, force=False, log=None, options=None, publish_generated=True):
        calls.append((spec.name, spec.target.numerics, options, publish_generated))
        return build_mod.BuildResult("moe_x", "k", tmp_path, tmp_path / "lib.so", True, 0.0)

    monkeypatch.setattr(build_mod, "build", fake_build)
    monkeypatch.delenv("MOKGEN_MX_FWD_WEIGHTS", raising=False)
    code, out, err = invoke("build", "--numerics", "mxfp8", "kimi-k2.5")
    assert code == 0, err
    (_, _, first, pub1), (_, _, twin, pub2) = calls
    assert first is None and pub1 and not pub2 and twin["mx_fwd_weights"] == "raw"
    assert twin == {**build_mod.env.plan_options(), "mx_fwd_weights": "raw"}
    assert "raw-weights twin" in out
    for args, env_value in ((("--numerics", "mxfp8", "qwen3-30b-a3b"), None), (("kimi-k2.5",), None),
                            (("--numerics", "mxfp8", "kimi-k2.5"), "values")):
        calls.clear()
        if env_value:
            monkeypatch.setenv("MOKGEN_MX_FWD_WEIGHTS", env_value)
        code, out, err = invoke("build", *args)
        assert code == 0 and len(calls) == 1 and calls[0][2] is None, (args, err)
