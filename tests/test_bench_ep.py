"""The expert-parallel PyTorch peer of the benchmark (all-to-all + grouped GEMMs), checked on the
CPU over gloo with 2 processes against the single-process reference."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mokgen.bench import torch_ep_pipeline
from mokgen.reference import experts_forward

H, I, E, K = 64, 32, 8, 2
TOKENS = [9, 0]


def _grouped_mm_runs_on_cpu() -> bool:
    try:
        a = torch.randn(4, 16, dtype=torch.bfloat16)
        b = torch.randn(2, 16, 8, dtype=torch.bfloat16)
        torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


def _worker(rank: int, world: int, port: int, clamp) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        g = torch.Generator().manual_seed(0)
        wg = (torch.randn(E, I, H, generator=g) * 0.2).to(torch.bfloat16)
        wu = (torch.randn(E, I, H, generator=g) * 0.2).to(torch.bfloat16)
        wd = (torch.randn(E, H, I, generator=g) * 0.2).to(torch.bfloat16)
        xs = [torch.randn(t, H, generator=g).to(torch.bfloat16) for t in TOKENS]
        ids = [torch.rand(t, E, generator=g).topk(K, -1).indices for t in TOKENS]
        ws = [torch.rand(t, K, generator=g) for t in TOKENS]
        e_loc = E // world
        mine = slice(rank * e_loc, (rank + 1) * e_loc)
        out = torch_ep_pipeline(xs[rank], ids[rank], ws[rank], wg[mine], wu[mine], wd[mine], clamp_limit=clamp)
        ref = experts_forward(xs[rank], ids[rank], ws[rank], wg, wu, wd, clamp_limit=clamp)
        assert out.shape == (TOKENS[rank], H) and out.dtype == torch.bfloat16
        if TOKENS[rank]:
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"rank {rank}: relative error {err}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("clamp", [None, 0.5])
def test_ep_peer_matches_reference_over_gloo(clamp):
    if not _grouped_mm_runs_on_cpu():
        pytest.skip(f"torch._grouped_mm does not run on the CPU in torch {torch.__version__}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, clamp), nprocs=2, join=True)
