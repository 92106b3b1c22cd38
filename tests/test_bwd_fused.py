"""The fused backward's order and switches on the CPU (the kernel itself: tests/test_gpu_bwd_fused.py).

tests/host/bwd_fused_check.cu lists templates/include/mokgen/bwd_fused.cuh's order on random
plans (empty, one-row and large experts; operands shorter than offs says; groups of 1-5000 rows,
lags 1-4, 1-140 CTAs) and checks every tile once against an independent listing, each CTA's
items in order, every dependency earlier, every block's SwiGLU item once, and that a simulation
of the kernel's roles finishes every item (no deadlock)."""

from __future__ import annotations

import subprocess

import pytest

from mokgen import env
from mokgen.errors import ToolchainError


@pytest.mark.nvcc
def test_fused_order_lists_every_tile_once_after_its_dependencies_without_deadlock(host_check):
    run = subprocess.run([str(host_check("bwd_fused_check")), "300"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("ok "), run.stdout + run.stderr
    assert int(run.stdout.split()[1]) > 300_000  # items checked


def test_fused_switches_and_when_the_backward_takes_the_fused_launch(monkeypatch):
    from mokgen.backward import fused_applies

    for name in ("MOKGEN_BWD_FUSED", "MOKGEN_BWD_FUSED_CHUNK", "MOKGEN_BWD_FUSED_LAG", "MOKGEN_BWD_WEIGHTS",
                 "MOKGEN_BWD_WEIGHTS_JOINT", "MOKGEN_BWD_DH", "MOKGEN_BWD_DX_PAIRS"):
        monkeypatch.delenv(name, raising=False)
    assert not env.bwd_fused() and not fused_applies(True, 8)  # off by default
    assert env.bwd_fused_chunk() == env.BWD_FUSED_CHUNK_DEFAULT and env.bwd_fused_lag() == env.BWD_FUSED_LAG_DEFAULT
    monkeypatch.setenv("MOKGEN_BWD_FUSED", "1")
    assert fused_applies(True, 8) and fused_applies(True, 1)
    assert not fused_applies(False, 8)  # the recompute policy: the separate launches
    monkeypatch.setenv("MOKGEN_BWD_DX_PAIRS", "fp32")
    assert not fused_applies(True, 8) and fused_applies(True, 1)  # fp32 pair rows: only one pair per row
    monkeypatch.delenv("MOKGEN_BWD_DX_PAIRS")
    for name, value in (("MOKGEN_BWD_DH", "fp32"), ("MOKGEN_BWD_WEIGHTS_JOINT", "0"), ("MOKGEN_BWD_WEIGHTS", "pingpong")):
        monkeypatch.setenv(name, value)
        assert not fused_applies(True, 8), name
        monkeypatch.delenv(name)
    monkeypatch.setenv("MOKGEN_BWD_FUSED", "yes")
    with pytest.raises(ToolchainError, match="MOKGEN_BWD_FUSED must be 0 or 1"):
        env.bwd_fused()
    monkeypatch.setenv("MOKGEN_BWD_FUSED_CHUNK", "4096")
    monkeypatch.setenv("MOKGEN_BWD_FUSED_LAG", "3")
    assert env.bwd_fused_chunk() == 4096 and env.bwd_fused_lag() == 3
    for name, bad in (("MOKGEN_BWD_FUSED_CHUNK", "0"), ("MOKGEN_BWD_FUSED_CHUNK", "big"), ("MOKGEN_BWD_FUSED_LAG", "9")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ToolchainError, match=f"{name} must be an integer from 1 to"):
            env.bwd_fused_chunk() if name.endswith("CHUNK") else env.bwd_fused_lag()
        monkeypatch.delenv(name)
