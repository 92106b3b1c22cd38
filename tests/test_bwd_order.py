"""The backward megakernel's tile order (templates/include/mokgen/bwd_order.cuh, not yet walked
by a kernel), checked on the host: tests/host/bwd_order_check.cu lists the order on random
receive plans (uniform, skewed, mostly empty and tiny experts, up to 200 experts; chunks of
7-4096 rows; random tile counts per kind) and checks that every tile is listed once against an
independent listing, that every tile comes after its dependencies, that each expert's k-blocks
for its weight tiles (bwd_expert_kblocks: per chunk segment) cover its rows in ring order, and that a ring of
bwd_min_ring slots cannot deadlock, with no smaller ring found to work where the bound says it
would not. Needs nvcc (host code only, no GPU)."""

from __future__ import annotations

import subprocess

import pytest


@pytest.mark.nvcc
def test_backward_order_lists_every_tile_once_after_its_dependencies(host_check):
    run = subprocess.run([str(host_check("bwd_order_check")), "200"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("ok "), run.stdout + run.stderr
    _, tiles, tight = run.stdout.split()
    assert int(tiles) > 500_000  # tiles checked
    assert int(tight) > 100  # plans where the brute-force ring is bwd_min_ring's: the bound is tight
