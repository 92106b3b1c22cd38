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
from pathlib import Path

import pytest

from mokgen import build as build_mod
from mokgen.paths import templates_dir

ROOT = Path(__file__).resolve().parent


@pytest.mark.nvcc
def test_backward_order_lists_every_tile_once_after_its_dependencies(tmp_path):
    exe = tmp_path / "bwd_order_check"
    subprocess.run([build_mod.find_nvcc(), "-std=c++17", "-O1", "--expt-relaxed-constexpr",
                    "-I", str(templates_dir() / "include"), "-o", str(exe), str(ROOT / "host" / "bwd_order_check.cu")],
                   check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe), "200"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("ok "), run.stdout + run.stderr
    _, tiles, tight = run.stdout.split()
    assert int(tiles) > 500_000  # tiles checked
    assert int(tight) > 100  # plans where the brute-force ring is bwd_min_ring's: the bound is tight
