"""The megakernel's tile order (templates/include/mokgen/tile_order.cuh), checked on the host:
tests/host/tile_order_check.cu compares, for every CTA (or CTA pair) on random receive plans
(uniform, skewed, mostly empty and tiny experts, up to 256 experts; chunks of 1-4096 rows; 1-140
units; a running index starting past a fused shared expert's tiles), the walks the kernel runs
against the v0.2-v0.4 walk that visited every tile of the order, and each chunk's tile count
against the real (rows > 0) down tiles all units visit; and, independently of the reference
walk, that every real tile is visited exactly once. Needs nvcc (host code only, no GPU)."""

from __future__ import annotations

import subprocess

import pytest


@pytest.mark.nvcc
def test_tile_walks_match_the_reference_order(host_check):
    run = subprocess.run([str(host_check("tile_order_check")), "1500"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("ok "), run.stdout + run.stderr
    assert int(run.stdout.split()[1]) > 100_000  # tiles compared
