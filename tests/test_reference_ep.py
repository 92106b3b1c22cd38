"""Expert-parallel oracle (mokgen.reference.ep_experts_forward) over gloo, 2 and 4 CPU processes.

Every rank builds the same global inputs from one seed, runs the EP version on its slice and
checks it, forward and backward, against single-process experts_forward on the whole batch.
A failing assertion in a worker makes torch.multiprocessing.spawn raise in the test.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mokgen.reference import ep_experts_forward, experts_forward

H, I, E, K = 32, 16, 8, 2
F64 = torch.float64
TOKENS = {2: [7, 0], 4: [5, 0, 11, 3]}  # tokens per rank: all different, one rank empty


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _global_inputs(world: int, seed: int, dtype=F64, ids_mode: str = "random"):
    gen = torch.Generator().manual_seed(seed)
    T = sum(TOKENS[world])
    x = torch.randn(T, H, generator=gen, dtype=F64)
    if ids_mode == "random":  # duplicates within a token allowed
        ids = torch.randint(0, E, (T, K), generator=gen)
    elif ids_mode == "distinct":
        ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]
    elif ids_mode == "last_expert":  # all pairs to one expert, i.e. to the last rank
        ids = torch.full((T, K), E - 1, dtype=torch.int64)
    elif ids_mode == "rank0":  # everything to rank 0's experts
        ids = torch.randint(0, E // world, (T, K), generator=gen)
    else:
        raise AssertionError(ids_mode)
    w = torch.rand(T, K, generator=gen, dtype=F64)
    ws = [torch.randn(E, I, H, generator=gen, dtype=F64) * 0.3,
          torch.randn(E, I, H, generator=gen, dtype=F64) * 0.3,
          torch.randn(E, H, I, generator=gen, dtype=F64) * 0.3]
    g = torch.randn(T, H, generator=gen, dtype=F64)  # upstream gradient
    return [t.to(dtype) for t in (x, w, *ws)] + [ids, g]


def _check_case(rank, world, seed, ids_mode, clamp=None):
    x, w, wg, wu, wd, ids, g = _global_inputs(world, seed, ids_mode=ids_mode)
    lo = sum(TOKENS[world][:rank])
    hi = lo + TOKENS[world][rank]
    el = E // world
    es = slice(rank * el, (rank + 1) * el)

    # single-process oracle on the whole batch, forward and backward
    leaves = [t.clone().requires_grad_() for t in (x, w, wg, wu, wd)]
    ref = experts_forward(leaves[0], ids, leaves[1], *leaves[2:], clamp_limit=clamp, acc_dtype=F64)
    (ref * g).sum().backward()

    # expert parallel: local tokens, local experts
    loc = [t.clone().requires_grad_() for t in (x[lo:hi], w[lo:hi], wg[es], wu[es], wd[es])]
    out = ep_experts_forward(loc[0], ids[lo:hi], loc[1], *loc[2:], clamp_limit=clamp,
                             acc_dtype=F64, num_experts=E)
    assert out.shape == (hi - lo, H) and out.dtype == F64
    torch.testing.assert_close(out, ref[lo:hi].detach(), rtol=1e-10, atol=1e-10)
    (out * g[lo:hi]).sum().backward()
    ref_grads = [leaves[0].grad[lo:hi], leaves[1].grad[lo:hi], leaves[2].grad[es],
                 leaves[3].grad[es], leaves[4].grad[es]]
    for name, a, b in zip(("x", "w", "w_gate", "w_up", "w_down"), (t.grad for t in loc), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"grad {name}: {m}")


def _worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        for seed, ids_mode, clamp in [(0, "random", None), (1, "distinct", 0.5),
                                      (2, "last_expert", None), (3, "rank0", None)]:
            _check_case(rank, world, seed, ids_mode, clamp)

        # bf16 inputs, fp32 accumulation, bf16 output
        x, w, wg, wu, wd, ids, _ = _global_inputs(world, 4, dtype=torch.bfloat16)
        lo = sum(TOKENS[world][:rank])
        hi = lo + TOKENS[world][rank]
        el = E // world
        es = slice(rank * el, (rank + 1) * el)
        ref = experts_forward(x, ids, w, wg, wu, wd)
        out = ep_experts_forward(x[lo:hi], ids[lo:hi], w[lo:hi], wg[es], wu[es], wd[es])
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref[lo:hi], rtol=1e-5, atol=1e-5)
        out_bf = ep_experts_forward(x[lo:hi], ids[lo:hi], w[lo:hi], wg[es], wu[es], wd[es],
                                    out_dtype=torch.bfloat16)
        assert out_bf.dtype == torch.bfloat16

        # an out-of-range id on one rank makes every rank raise (nobody hangs)
        x, w, wg, wu, wd, ids, _ = _global_inputs(world, 5)
        ids_loc = ids[lo:hi].clone()
        if rank == 0:
            ids_loc[0, 1] = E
        try:
            ep_experts_forward(x[lo:hi], ids_loc, w[lo:hi], wg[es], wu[es], wd[es])
        except ValueError as err:
            assert "[0, 8)" in str(err)
        else:
            raise AssertionError("out-of-range id did not raise")

        # a world size that does not divide the number of experts
        try:
            ep_experts_forward(x[lo:hi], ids[lo:hi], w[lo:hi], wg[es], wu[es], wd[es],
                               num_experts=E + 1)
        except ValueError as err:
            assert "does not divide" in str(err)
        else:
            raise AssertionError("num_experts not divisible by the world size did not raise")

        # still in step after the errors
        _check_case(rank, world, 6, "random")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ep_experts_forward_matches_single_process(world):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available")
    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)
