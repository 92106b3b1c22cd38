"""The backward GEMM library (mokgen/bwd_gemm.py, templates/bwd_gemm.cu): build and input checks,
no GPU needed. Its GPU tests are in test_gpu_bwd_gemm.py."""

from __future__ import annotations

import ctypes
import re
import subprocess

import pytest

torch = pytest.importorskip("torch")

from conftest import EMPTY_WGMMA_GROUP, sass  # noqa: E402
from mokgen import bwd_gemm  # noqa: E402
from mokgen.errors import InputError  # noqa: E402

EXPORTS = ("mokgen_bwd_rows", "mokgen_bwd_weights", "mokgen_bwd_swiglu", "mokgen_bwd_swiglu_saved", "mokgen_bwd_sum_slots",
           "mokgen_bwd_expert_major", "mokgen_bwd_error_string", "mokgen_bwd_set_stagger", "mokgen_bwd_max_lead",
           "mokgen_bwd_expert_major_scratch", "mokgen_bwd_dh_swiglu_saved", "mokgen_bwd_weights2",
           "mokgen_bwd_rows_gathered", "mokgen_bwd_weights_gathered", "mokgen_bwd_fused", "mokgen_bwd_fused_counters",
           "mokgen_bwd_weights2_gathered", "mokgen_bwd_set_row_band")


@pytest.mark.nvcc
def test_library_builds_without_spills_or_serialized_wgmma_and_exports_the_entry_points(private_dirs):
    from mokgen.build import cache_root

    lib = bwd_gemm.build_library()
    assert lib.name == "libbwdgemm.so" and lib.parent.parent == cache_root("sm_90a")
    assert re.fullmatch(r"bwd_gemm-[0-9a-f]{12}", lib.parent.name)
    log = (lib.parent / "build.log").read_text()
    kernels = re.findall(r"Compiling entry function '(\w+)'", log)
    # rows<B MN-major, fp32 out>, rows<B MN-major, bf16 out>, rows<B K-major>, swiglu, swiglu_saved,
    # (single CTAs and CTA pairs), swiglu, swiglu_saved, dh with the saved SwiGLU backward,
    # weights and weights in ping-pong (single CTAs, pairs), zero_rows<fp32>, zero_rows<bf16>,
    # zero_rows3, sum_slots<fp32 in>, sum_slots<bf16 in>, and the row order's expert_count,
    # expert_scan, expert_scatter; swiglu_saved for fp32 and bf16 dh; the joint weights (single
    # CTAs, pairs); the gathering rows (fp32 and bf16 out) and weight kernels (v0.22); the fused
    # backward (v0.23); dh with the saved SwiGLU backward from dOut's rows through the index (v0.24);
    # the joint weights with x's rows through the index (v0.25); the weight gradients' bounded
    # tensor maps (v0.30); the joint weights with dX's slot sum as a side job, single CTAs and
    # pairs (v0.47)
    assert len(kernels) == 33, kernels
    assert sum("bound_maps_kernel" in k for k in kernels) == 1, kernels
    assert sum("fused_kernel" in k for k in kernels) == 1, kernels
    assert sorted(re.search(r"dh_swiglu_kernelILb(\d)", k).group(1) for k in kernels if "dh_swiglu_kernel" in k) \
        == ["0", "1"], kernels
    assert sum(re.search(r"\d\dweight_kernel", k) is not None for k in kernels) == 8, kernels
    # the slot sum's (kSum = true) only in the joint TMA form (kJoint, not kGather), alone and in pairs
    assert sorted(re.search(r"weight_kernelILi(\d)ELb(\d)ELb(\d)ELb1E", k).groups() for k in kernels
                  if re.search(r"weight_kernelILi\dELb\dELb\dELb1E", k)) == [("1", "1", "0"), ("2", "1", "0")], kernels
    assert sum("sum_slots_kernel" in k for k in kernels) == 2, kernels
    assert sum("swiglu_saved_kernel" in k for k in kernels) == 2, kernels
    assert sum("weight_pp_kernel" in k for k in kernels) == 2, kernels
    assert sum(re.search(r"\d\drows_kernel", k) is not None for k in kernels) == 8, kernels  # not zero_rows
    # the gathering kernels: rows<B MN-major, fp32 | bf16, single CTAs, gathered>, weights<single,
    # one problem | joint, gathered>
    gathered = [k for k in kernels if k.endswith("Lb1EEEvNS_4MapsEPKiiiiiiPT0_PKliN6mokgen3bwd6GatherEi")
                or re.search(r"weight_kernelILi1ELb[01]ELb1ELb0EE", k)]
    assert len(gathered) == 4, kernels
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) == len(kernels) and all(s == ("0", "0") for s in spills), spills
    # no kernel has its wgmma serialized (ptxas C7510: a function call such as printf in the kernel)
    from mokgen.build import serialized_wgmma

    assert serialized_wgmma(lib.parent) == [], serialized_wgmma(lib.parent)
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    for name in EXPORTS:
        assert re.search(rf"\bT {name}$", nm, re.MULTILINE), name
    cdll = ctypes.CDLL(str(lib))  # loading needs no driver
    for name in EXPORTS:
        getattr(cdll, name)
    wrapped = bwd_gemm._Lib(lib)
    assert "cuTensorMapEncodeTiled" in wrapped._lib.mokgen_bwd_error_string(1000).decode()
    # the stagger leads Python accepts are the ones the kernels take (bwd_gemm.cuh, kMaxLead)
    assert cdll.mokgen_bwd_max_lead() == bwd_gemm.MAX_LEAD
    # the row order's scratch: (E + 1) counters per chunk of 1024 pairs
    assert [wrapped.expert_major_scratch(n, 48) for n in (1, 1024, 1025, 16384)] == [49, 49, 98, 16 * 49]
    # the fused backward's counters: two per block id, total / 128 + E + 1 block ids
    assert [wrapped.fused_counters(n, 48) for n in (1, 128, 16384)] == [2 * 49, 2 * 50, 2 * 177]
    # a second call finds it in the cache
    mtime = lib.stat().st_mtime_ns
    assert bwd_gemm.build_library() == lib and lib.stat().st_mtime_ns == mtime


@pytest.mark.nvcc
def test_variant_builds_land_outside_the_cache_with_their_log(private_dirs, tmp_path):
    """bwd_gemm.build_variant (the trace build and BWD_BENCH_FLAGS variants): the library with the
    extra flags in the directory given, its log beside it (no serialized wgmma in the kernels the
    trace build times), nothing in the build cache; a flag nvcc refuses is one BuildError naming the log."""
    from mokgen.build import cache_root, serialized_wgmma
    from mokgen.errors import BuildError

    lib = bwd_gemm.build_variant(["-DMOKGEN_BWD_TRACE"], tmp_path / "trace")
    assert lib == tmp_path / "trace" / bwd_gemm.LIBRARY and lib.is_file()
    # every kernel the trace times keeps its pipeline; the gathered weight kernels (not timed by
    # the trace) are serialized in this build only (bwd_gemm.TRACE_UNTIMED)
    assert bwd_gemm.trace_serialized(lib.parent) == []
    assert all(bwd_gemm.TRACE_UNTIMED.search(n) for n in serialized_wgmma(lib.parent))
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    assert re.search(r"\bT mokgen_bwd_set_trace$", nm, re.MULTILINE)  # the trace build's own entry point
    assert not cache_root("sm_90a").exists() or not any(cache_root("sm_90a").glob("bwd_gemm-*"))
    with pytest.raises(BuildError, match=r"variant \(--no-such-nvcc-flag\) failed to build; see .*build.log"):
        bwd_gemm.build_variant(["--no-such-nvcc-flag"], tmp_path / "bad")
    assert "no-such-nvcc-flag" in (tmp_path / "bad" / "build.log").read_text()


@pytest.mark.nvcc
def test_library_sass_keeps_one_wgmma_batch_in_flight(private_dirs):
    """In the SASS of every GEMM kernel the consumers wait for all but the last wgmma batch
    (WARPGROUP.DEPBAR.LE gsb0, 0x1): with the pipeline serialized (ptxas C7510) every HGMMA is
    followed by a wait for zero, and no such wait exists."""
    functions = re.split(r"\n\s*Function : ", sass(bwd_gemm.build_library()))[1:]
    gemms = {f.split("\n", 1)[0]: f for f in functions if "HGMMA" in f}
    # rows x 3 (single, pairs), swiglu, dh_swiglu, weights, ping-pong and the joint weights (x 2
    # each: single, pairs), the gathering rows (fp32, bf16 out) and weights: the count left at 12
    # when the joint weights came (v0.20) went unseen until v0.22, as CPU CI has no cuobjdump;
    # the fused backward (v0.23); dh_swiglu through the index (v0.24); the joint weights through
    # the index (v0.25); the joint weights summing dX's slots on their idle warps (v0.47, single
    # and pairs: 20 -> 22, found in v0.56 on a machine with cuobjdump)
    assert len(gemms) == 22, list(gemms)
    for name, body in gemms.items():
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in body, f"{name}: every wgmma waited for (serialized pipeline)"
        # an empty commit group (a commit that ptxas could not fold into the last wgmma, v0.13-v0.26's
        # commit after the short-k-block switch): wait<1> then waits for the batch just issued
        assert not EMPTY_WGMMA_GROUP.search(body), f"{name}: an empty wgmma commit group (HGMMA.64x8x16 on RZ)"


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


def test_dh_swiglu_saved_refuses_operands_off_the_gpu():
    """The fused dh + SwiGLU backward checks its operands before it loads anything (shapes: the
    GPU tests)."""
    order, wt, offs = torch.zeros(4, dtype=torch.int64), torch.zeros(4), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(InputError, match="go must be on a CUDA device of compute capability 9.0"):
        bwd_gemm.dh_swiglu_saved(_bf16(4, 64), _bf16(2, 64, 256), _bf16(4, 512), order, wt, offs)
    with pytest.raises(InputError, match="go must be a contiguous 2-d bfloat16 tensor, got torch.float32"):
        bwd_gemm.dh_swiglu_saved(torch.zeros(4, 64), _bf16(2, 64, 256), _bf16(4, 512), order, wt, offs)


@pytest.mark.parametrize("call, message", [
    (lambda: bwd_gemm.rows_gemm([(_bf16(4, 64), _bf16(2, 64, 256))], torch.zeros(2, dtype=torch.int32)),
     "compute capability 9.0"),
    (lambda: bwd_gemm.rows_gemm([(torch.zeros(4, 64), _bf16(2, 64, 256))], torch.zeros(2, dtype=torch.int32)),
     r"A\[0\] must be a contiguous 2-d bfloat16 tensor, got torch.float32"),
    (lambda: bwd_gemm.rows_gemm([(_bf16(64, 4).t(), _bf16(2, 64, 256))], torch.zeros(2, dtype=torch.int32)),
     "not contiguous"),
    (lambda: bwd_gemm.rows_gemm([], torch.zeros(2, dtype=torch.int32)), "one or two"),
    (lambda: bwd_gemm.rows_gemm([(_bf16(4, 64), _bf16(2, 64, 256))], torch.zeros(2, dtype=torch.int32),
                                b_major="t"), "b_major"),
    (lambda: bwd_gemm.weight_grads(torch.zeros(4, 128), _bf16(4, 256), torch.zeros(2, dtype=torch.int32)),
     "must be a contiguous 2-d bfloat16"),
    (lambda: bwd_gemm.weight_grads(_bf16(4, 128), _bf16(4, 256), torch.zeros(2, dtype=torch.int32), cluster=4),
     "cluster must be 1 or 2"),
    (lambda: bwd_gemm.sum_slots(torch.zeros(6, 8, dtype=torch.float64), 3, 2), "contiguous 2-d float32"),
    (lambda: bwd_gemm.expert_major(torch.zeros(6, 2, dtype=torch.int64), 4), "contiguous 2-d int32"),
])
def test_bad_input_is_one_clear_error(call, message):
    with pytest.raises(InputError, match=message):
        call()


def test_on_by_default_only_on_sm90_and_off_by_switch(monkeypatch):
    from mokgen import env

    monkeypatch.delenv("MOKGEN_BWD_GEMM", raising=False)
    assert env.bwd_gemm_enabled()
    assert not bwd_gemm.usable(2048, 1024, "cpu")  # not an sm_90 device
    assert not bwd_gemm.supported("cpu")
    with bwd_gemm.forced(True):
        assert not bwd_gemm.usable(2048, 1024, "cpu")
    monkeypatch.setenv("MOKGEN_BWD_GEMM", "0")
    assert not env.bwd_gemm_enabled()


def test_weight_gradient_pairs_and_stagger_switches(monkeypatch):
    from mokgen import env
    from mokgen.errors import ToolchainError

    monkeypatch.delenv("MOKGEN_BWD_CLUSTER", raising=False)
    monkeypatch.delenv("MOKGEN_BWD_STAGGER", raising=False)
    assert env.bwd_cluster() == 1 and env.bwd_stagger() == env.BWD_STAGGER_DEFAULT
    assert 1 <= env.BWD_STAGGER_DEFAULT <= bwd_gemm.MAX_LEAD
    monkeypatch.setenv("MOKGEN_BWD_CLUSTER", "2")
    for lead in range(bwd_gemm.MAX_LEAD + 1):
        monkeypatch.setenv("MOKGEN_BWD_STAGGER", str(lead))
        assert env.bwd_cluster() == 2 and env.bwd_stagger() == lead
    monkeypatch.setenv("MOKGEN_BWD_CLUSTER", "4")
    with pytest.raises(ToolchainError, match="MOKGEN_BWD_CLUSTER must be 1 or 2"):
        env.bwd_cluster()
    for bad in ("yes", "4", "-1"):
        monkeypatch.setenv("MOKGEN_BWD_STAGGER", bad)
        with pytest.raises(ToolchainError, match="MOKGEN_BWD_STAGGER must be"):
            env.bwd_stagger()
    # set_stagger refuses a lead the stage ring cannot hold before it loads anything
    for bad in (-1, bwd_gemm.MAX_LEAD + 1):
        with pytest.raises(InputError, match="stagger lead must be 0 to 3"):
            bwd_gemm.set_stagger(bad)


def test_rows_cluster_switch(monkeypatch):
    from mokgen import env
    from mokgen.errors import ToolchainError

    monkeypatch.delenv("MOKGEN_BWD_ROWS_CLUSTER", raising=False)
    assert env.bwd_rows_cluster() is None  # auto: by N
    assert [bwd_gemm.rows_cluster(n) for n in (512, 2048, 4096, 7168)] == [1, 1, 2, 2]
    monkeypatch.setenv("MOKGEN_BWD_ROWS_CLUSTER", "auto")
    assert env.bwd_rows_cluster() is None
    for value in (1, 2):
        monkeypatch.setenv("MOKGEN_BWD_ROWS_CLUSTER", str(value))
        assert env.bwd_rows_cluster() == value
    monkeypatch.setenv("MOKGEN_BWD_ROWS_CLUSTER", "4")
    with pytest.raises(ToolchainError, match="MOKGEN_BWD_ROWS_CLUSTER must be"):
        env.bwd_rows_cluster()
    with pytest.raises(InputError, match="cluster must be 1 or 2, got 3"):
        bwd_gemm.rows_gemm([], None, cluster=3)


def test_weight_schedule_switch(monkeypatch):
    from mokgen import env
    from mokgen.errors import ToolchainError

    monkeypatch.delenv("MOKGEN_BWD_WEIGHTS", raising=False)
    assert env.bwd_weights() == env.BWD_WEIGHTS_DEFAULT == "auto"
    for value in bwd_gemm.WEIGHT_SCHEDULES:
        monkeypatch.setenv("MOKGEN_BWD_WEIGHTS", value)
        assert env.bwd_weights() == value
    monkeypatch.setenv("MOKGEN_BWD_WEIGHTS", "coop")
    with pytest.raises(ToolchainError, match="MOKGEN_BWD_WEIGHTS must be auto or split or pingpong, got 'coop'"):
        env.bwd_weights()
    # a bad schedule is refused before anything is checked or loaded
    with pytest.raises(InputError, match="schedule must be one of split, pingpong, got 'fast'"):
        bwd_gemm.weight_grads(None, None, None, cluster=1, schedule="fast")


def test_weight_tail_switch(monkeypatch):
    from mokgen import env
    from mokgen.errors import ToolchainError

    monkeypatch.delenv("MOKGEN_BWD_TAIL", raising=False)
    assert env.bwd_tail() == env.BWD_TAIL_DEFAULT in bwd_gemm.WEIGHT_TAILS
    for value in bwd_gemm.WEIGHT_TAILS:
        monkeypatch.setenv("MOKGEN_BWD_TAIL", value)
        assert env.bwd_tail() == value
    monkeypatch.setenv("MOKGEN_BWD_TAIL", "pad")
    with pytest.raises(ToolchainError, match="MOKGEN_BWD_TAIL must be auto or tma or steps or zero, got 'pad'"):
        env.bwd_tail()
    monkeypatch.delenv("MOKGEN_BWD_TAIL")
    # a bad tail is refused before anything is checked or loaded, by both weight entries
    with pytest.raises(InputError, match="tail must be one of auto, tma, zero, steps, got 'pad'"):
        bwd_gemm.weight_grads(None, None, None, cluster=1, tail="pad")
    with pytest.raises(InputError, match="tail must be one of auto, tma, zero, steps, got 'pad'"):
        bwd_gemm.weight_grads_joint(None, None, None, None, cluster=1, tail="pad")
    # auto resolves per schedule (the bounded maps for the split tiles, the zeroing for the
    # ping-pong); an explicit tail is kept for both, and the switch is read where tail is None
    assert bwd_gemm.weight_tail("auto", "split") == "steps"
    assert bwd_gemm.weight_tail("auto", "pingpong") == "zero"
    for value in ("tma", "zero", "steps"):
        assert all(bwd_gemm.weight_tail(value, s) == value for s in bwd_gemm.WEIGHT_SCHEDULES)
        monkeypatch.setenv("MOKGEN_BWD_TAIL", value)
        assert bwd_gemm.weight_tail(None, "pingpong") == value
    monkeypatch.delenv("MOKGEN_BWD_TAIL")
    assert set(bwd_gemm.TAIL_AUTO) == set(bwd_gemm.WEIGHT_SCHEDULES)


class _FakeStepsLib:
    """A library build's tail-steps setter, counting its calls."""

    def __init__(self, has_setter=True):
        self.calls = []
        if has_setter:
            self.mokgen_bwd_set_tail_steps = self.calls.append


def test_the_tail_steps_setting_reaches_the_library_only_when_it_changes():
    lib = bwd_gemm._Lib.__new__(bwd_gemm._Lib)
    lib._lib, lib._tail_steps = _FakeStepsLib(), False
    for on in (False, True, True, False, True):
        lib.set_tail_steps(on)
    assert lib._lib.calls == [1, 0, 1] and lib._tail_steps is True
    # an older build without it: all four steps is what it does; "steps" is refused
    old = bwd_gemm._Lib.__new__(bwd_gemm._Lib)
    old._lib, old._tail_steps = _FakeStepsLib(has_setter=False), False
    old.set_tail_steps(False)
    with pytest.raises(InputError, match='no tail "steps"'):
        old.set_tail_steps(True)
    # "zero" asks the library for no bounded maps; "tma" for 3 maps of 128 bytes per expert
    assert bwd_gemm._bounded_ws("zero", 7, "cpu") is None
    ws = bwd_gemm._bounded_ws("tma", 7, "cpu")
    assert ws.dtype == torch.uint8 and ws.numel() == 7 * 3 * 128


def test_library_is_found_once_per_cache_directory(tmp_path, monkeypatch):
    # finding the build hashes the sources: once per process and cache directory, not per GEMM
    # call (six calls per backward step showed as GPU idle time between the launches)
    from mokgen import build

    found = []

    def fake_path(source, library, **kw):
        found.append((source, str(bwd_gemm.env.cache_dir())))
        lib = bwd_gemm.env.cache_dir() / library
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.touch()
        return lib

    monkeypatch.setattr(build, "source_library_path", fake_path)
    monkeypatch.setattr(build, "_found_sources", {})
    monkeypatch.setattr(bwd_gemm, "_load", lambda path: ("lib", path))
    monkeypatch.setattr(bwd_gemm, "_by_env", {})
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path / "a"))
    first = bwd_gemm.load_library()
    assert bwd_gemm.load_library() == first and found == [("bwd_gemm.cu", str(tmp_path / "a"))]
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path / "b"))
    other = bwd_gemm.load_library()
    assert other != first and other[1].startswith(str(tmp_path / "b")) and len(found) == 2
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path / "a"))
    assert bwd_gemm.load_library() == first and len(found) == 2


@pytest.mark.nvcc
def test_tile_walks_cover_every_tile_once_in_order(host_check):
    """tests/host/bwd_tiles_check.cu on the CPU: the rows-GEMM and weight-gradient walks of
    bwd_tiles.cuh over random plans (empty and tiny experts, offs past the operands' rows, 1-140
    CTAs, bands of 1-10 row blocks) visit every tile exactly once, each CTA in its order, with the
    clamped rows."""
    run = subprocess.run([str(host_check("bwd_tiles_check")), "400"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("ok "), run.stdout + run.stderr
    assert int(run.stdout.split()[1]) > 100_000  # tiles checked


@pytest.mark.nvcc
@pytest.mark.parametrize("clamp", [None, 7.0])
def test_swiglu_grad_matches_the_closed_form(tmp_path, host_check, clamp):
    """swiglu_grad.cuh (the fused recompute's epilogue math), compiled for the host by
    tests/host/swiglu_check.cu, against mokgen.backward's closed form in float64 on values that
    cross the clamp (both signs of u, g above and below it) and reach the sigmoid's tails."""
    from mokgen.backward import _swiglu_grads
    from mokgen.reference import swiglu

    exe = host_check("swiglu_check")
    gen = torch.Generator().manual_seed(2)
    n = 20000
    g = torch.randn(n, generator=gen) * 6
    u = torch.randn(n, generator=gen) * 6
    dh = torch.randn(n, generator=gen)
    g[:3] = torch.tensor([-90.0, 90.0, 0.0])  # the sigmoid's tails and zero
    limit = torch.full((n,), clamp if clamp is not None else 0.0)
    (tmp_path / "in.bin").write_bytes(torch.stack([g, u, dh, limit], 1).contiguous().numpy().tobytes())
    run = subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], capture_output=True)
    assert run.returncode == 0, run
    got = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).view(n, 3).double()
    g64, u64, dh64 = g.double(), u.double(), dh.double()
    want_h = swiglu(g64, u64, clamp)
    want_dg, want_du = _swiglu_grads(g64, u64, dh64, clamp)
    for name, a, b in (("h", got[:, 0], want_h), ("dg", got[:, 1], want_dg), ("du", got[:, 2], want_du)):
        err = (a - b).abs().max().item() / b.abs().max().item()
        assert err < 1e-5, f"{name}: max error {err:.2e} of the largest value"
        if clamp is not None and name != "h":  # the masks exactly: zero where the clamp cut the gradient
            assert torch.all(a[b == 0] == 0), f"{name}: a gradient the clamp cuts is not zero"
            assert torch.all(b[a == 0].abs() < 1e-30), f"{name}: zero where the closed form is not"  # float32 underflow only
            assert int((b == 0).sum()) > 100  # the clamp did cut gradients


def test_a_missing_library_falls_back_with_one_warning(monkeypatch, tmp_path):
    """Where the library can be neither found nor built (a prebuilt install without nvcc), the
    backward is told once, with the reason, and takes torch._grouped_mm from then on."""
    from mokgen.errors import LoadError

    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path))
    calls = []

    def missing():
        calls.append(1)
        raise LoadError("no build of bwd_gemm.cu and MOKGEN_DISABLE_JIT=1")

    monkeypatch.setattr(bwd_gemm, "load_library", missing)
    monkeypatch.setattr(bwd_gemm, "_unavailable", {})
    with pytest.warns(UserWarning, match="backward GEMM library is not available .*MOKGEN_DISABLE_JIT=1"):
        assert not bwd_gemm.available()
    assert not bwd_gemm.available() and len(calls) == 1  # decided once per process and cache directory
    monkeypatch.setattr(bwd_gemm, "load_library", lambda: None)
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path / "other"))
    assert bwd_gemm.available()


def test_auto_weight_schedule_by_the_experts_rows(monkeypatch):
    """MOKGEN_BWD_WEIGHTS=auto: the split under the default tail (the bounded maps); under
    MOKGEN_BWD_TAIL=zero the ping-pong up to PINGPONG_MAX_ROWS mean rows per expert and no
    gathered operand, the split otherwise; a named schedule is taken as it is. The backward's
    choice (mokgen.backward.weight_schedule) keeps the split wherever a launch reads an operand
    through the token index or the fused launch is asked for, since only the split has those."""
    from mokgen import backward, env

    for name in ("MOKGEN_BWD_WEIGHTS", "MOKGEN_BWD_DOUT", "MOKGEN_BWD_X", "MOKGEN_BWD_FUSED", "MOKGEN_BWD_TAIL"):
        monkeypatch.delenv(name, raising=False)
    for tail in ("auto", "tma"):  # the default tail and the explicit bounded maps
        monkeypatch.setenv("MOKGEN_BWD_TAIL", tail)
        for rows, experts in ((48 * 384, 48), (16384, 48), (5, 0), (16384, 4)):
            assert bwd_gemm.weight_schedule(rows, experts) == "split", (tail, rows)
        assert backward.weight_schedule(16384, 48, 1) == "split"
    monkeypatch.setenv("MOKGEN_BWD_TAIL", "zero")
    cap = bwd_gemm.PINGPONG_MAX_ROWS
    assert bwd_gemm.weight_schedule(48 * cap, 48) == "pingpong"
    assert bwd_gemm.weight_schedule(48 * cap + 1, 48) == "split"
    assert bwd_gemm.weight_schedule(16384, 48, gathered=True) == "split"
    assert bwd_gemm.weight_schedule(16384, 4) == "split"  # deepseek-v3's 4096 rows per expert
    assert bwd_gemm.weight_schedule(5, 0) == "pingpong"  # no experts: nothing to multiply either way
    # an EP rank's rows (one pair per row): the copy of dOut and x, so the rows decide
    assert backward.weight_schedule(16384, 48, 1) == "pingpong"
    assert backward.weight_schedule(16384, 32, 1) == "split"
    # several pairs per token: dOut (and x) through the token index, which only the split reads
    assert backward.weight_schedule(1024, 256, 8) == "split"
    for name, value in (("MOKGEN_BWD_DOUT", "inline"), ("MOKGEN_BWD_X", "inline"), ("MOKGEN_BWD_FUSED", "1")):
        monkeypatch.setenv(name, value)
        assert backward.weight_schedule(16384, 48, 1) == "split", name
        monkeypatch.delenv(name)
    monkeypatch.setenv("MOKGEN_BWD_DOUT", "gather")
    monkeypatch.setenv("MOKGEN_BWD_X", "gather")
    assert backward.weight_schedule(1024, 256, 8) == "pingpong"
    for value in bwd_gemm.WEIGHT_SCHEDULES:
        monkeypatch.setenv("MOKGEN_BWD_WEIGHTS", value)
        assert bwd_gemm.weight_schedule(16384, 4) == backward.weight_schedule(1024, 256, 8) == value
    assert env.bwd_weights() == "pingpong"


def test_row_band_switch(monkeypatch):
    """MOKGEN_BWD_ROW_BAND: the default 8 (the library's own), integers 1-4096, else a one-line
    error naming the switch."""
    from mokgen import env
    from mokgen.errors import ToolchainError

    monkeypatch.delenv("MOKGEN_BWD_ROW_BAND", raising=False)
    assert env.bwd_row_band() == env.BWD_ROW_BAND_DEFAULT == 8
    for value in ("1", "3", "4096"):
        monkeypatch.setenv("MOKGEN_BWD_ROW_BAND", value)
        assert env.bwd_row_band() == int(value)
    for bad in ("0", "-2", "4097", "eight", "2.5"):
        monkeypatch.setenv("MOKGEN_BWD_ROW_BAND", bad)
        with pytest.raises(ToolchainError, match="MOKGEN_BWD_ROW_BAND must be an integer from 1 to 4096"):
            env.bwd_row_band()
