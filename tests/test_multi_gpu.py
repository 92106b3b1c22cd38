"""Expert parallelism across real GPUs: MoELayer on W processes, one GPU each (NCCL process group,
torch symmetric memory over NVLink), gives the same bits as ``virtual_ep_forward`` with W virtual
ranks on one GPU, on the same global weights and tokens, for two calls in a row (launch epochs 1
and 2, different tokens: the second call must not see anything of the first).

W = min(GPUs, 8), lowered to a divisor of the expert count. Every rank has a different token
count, one rank none. Each rank reports to a results queue; a rank that raises, dies, or does not
report within the deadline fails the test with its traceback, and the others are stopped.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

pytestmark = pytest.mark.multi_gpu

SPEC = "qwen3-30b-a3b"
MAX_TOKENS = 4096
DEADLINE_S = 540
#: NVLink multicast stays off (it can take a shared host's GPUs out of service); set before init
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: tokens per rank for each call (the first `world` entries are used); a zero in each call
TOKENS = (
    (1500, 0, 4096, 333, 2048, 1, 777, 3001),
    (0, 2500, 17, 4096, 640, 1, 3000, 129),
)


# ---- the global inputs, reproducible in every process -------------------------------------------


def _expert_weights(spec, experts, device):
    """w_gate, w_up [len(experts), I, H] and w_down [len(experts), H, I] bf16; expert e is drawn
    from its own CPU generator, so any rank can make any slice without talking to the others."""
    H, I = spec.hidden_size, spec.moe_intermediate_size
    out = ([], [], [])
    for e in experts:
        gen = torch.Generator().manual_seed(1000 + e)
        for dst, shape in zip(out, ((I, H), (I, H), (H, I))):
            dst.append((torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16).to(device))
    return tuple(torch.stack(ws) for ws in out)


def _rank_inputs(spec, call, rank, device):
    """Rank ``rank``'s x [T, H] bf16, topk_ids [T, K] (over ALL experts) and weights for ``call``."""
    T = TOKENS[call][rank]
    gen = torch.Generator().manual_seed(100 * call + rank)
    x = torch.randn(T, spec.hidden_size, generator=gen).to(torch.bfloat16)
    ids = torch.rand(T, spec.num_experts, generator=gen).topk(spec.top_k, dim=-1).indices
    w = torch.rand(T, spec.top_k, generator=gen) + 0.05
    return x.to(device), ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)


# ---- one rank ---------------------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, results) -> None:
    try:
        os.environ.update(NO_MULTICAST)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MOKGEN_DISABLE_JIT="1")
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        try:
            outs = _run_rank(rank, world, device)
        finally:
            dist.destroy_process_group()
        detail = _compare_on_one_gpu(world, outs, device) if rank == 0 else "ok"
        results.put((rank, None, detail))
    except BaseException:  # noqa: BLE001 - everything goes to the parent
        results.put((rank, traceback.format_exc(), None))
        raise


def _run_rank(rank: int, world: int, device):
    """This rank's part: the layer, its slice of the weights, two forwards; rank 0 gathers every
    rank's outputs (other ranks return None)."""
    import mokgen
    from mokgen.spec import load_spec

    spec = load_spec(SPEC)
    layer = mokgen.MoELayer(spec, group=dist.group.WORLD, max_tokens=MAX_TOKENS, device=device)
    e_loc = spec.num_experts // world
    assert layer.local_experts == range(rank * e_loc, (rank + 1) * e_loc), layer.local_experts
    with torch.no_grad():
        for param, value in zip((layer.w_gate, layer.w_up, layer.w_down),
                                _expert_weights(spec, layer.local_experts, device)):
            param.copy_(value)
    gathered = []
    for call in range(len(TOKENS)):
        x, ids, w = _rank_inputs(spec, call, rank, device)
        with torch.no_grad():
            out = layer(x, ids, w)
        layer.check_errors()  # blocks; raises KernelError if a wait of this launch timed out
        assert out.shape == x.shape and out.dtype == torch.bfloat16
        # outputs differ in length per rank: pad to max_tokens for the collective
        padded = torch.zeros(MAX_TOKENS, spec.hidden_size, dtype=torch.bfloat16, device=device)
        padded[: out.shape[0]] = out
        bufs = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
        dist.gather(padded, bufs, dst=0)
        if rank == 0:
            gathered.append([b[: TOKENS[call][r]] for r, b in enumerate(bufs)])
    torch.cuda.synchronize(device)
    dist.barrier()
    return gathered if rank == 0 else None


def _compare_on_one_gpu(world: int, outs, device) -> str:
    """Rank 0, after the group is gone: the same global inputs through W virtual ranks."""
    import mokgen
    from mokgen import reference
    from mokgen.spec import load_spec

    spec = load_spec(SPEC)
    wg, wu, wd = _expert_weights(spec, range(spec.num_experts), device)
    for call, got in enumerate(outs):
        xs, ids, ws = zip(*(_rank_inputs(spec, call, r, device) for r in range(world)))
        want = mokgen.virtual_ep_forward(spec, list(xs), list(ids), list(ws), wg, wu, wd)
        for r in range(world):
            assert got[r].shape == want[r].shape, (call, r, got[r].shape, want[r].shape)
            if not torch.equal(got[r], want[r]):
                diff = (got[r].float() - want[r].float()).abs()
                raise AssertionError(
                    f"call {call + 1} (epoch {call + 1}), rank {r} of {world}: {TOKENS[call][r]} tokens differ from "
                    f"virtual ranks: {int((diff > 0).sum())} elements, max |diff| {diff.max().item():.3e}")
        # and both agree with the PyTorch oracle (a shared mistake would pass the bitwise check)
        x, i, w = torch.cat(xs), torch.cat(ids), torch.cat(ws)
        if x.shape[0]:
            ref = reference.experts_forward(x, i, w, wg, wu, wd, clamp_limit=spec.activation.clamp_limit)
            err = ((torch.cat(got).float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"call {call + 1}: relative error {err:.3e} against the reference"
    return f"W={world}: {len(outs)} calls bitwise equal to virtual ranks"


# ---- the test -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world(num_experts: int) -> int:
    n = min(torch.cuda.device_count(), 8)
    return max(w for w in range(1, n + 1) if num_experts % w == 0)


def run_world(world: int) -> str:
    """Spawns ``world`` ranks and returns rank 0's report; raises AssertionError with every failing
    rank's traceback. (Callable by hand, e.g. with world=1 on a single GPU.)"""
    from mokgen import build as build_mod
    from mokgen.spec import load_spec

    # build once here; the ranks load it with the JIT off (no W concurrent builds)
    build_mod.build(load_spec(SPEC), publish_generated=False)
    os.environ.update(NO_MULTICAST)  # inherited by the children, which set them again anyway
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, results), name=f"ep-rank-{r}") for r in range(world)]
    for p in procs:
        p.start()
    reports: dict[int, tuple] = {}
    deadline = time.monotonic() + DEADLINE_S
    try:
        while len(reports) < world and time.monotonic() < deadline:
            try:
                rank, error, detail = results.get(timeout=2)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(2)  # let a dying rank's report arrive
                    while not results.empty():
                        rank, error, detail = results.get()
                        reports[rank] = (error, detail)
                    break  # a rank died (a crash that reported nothing, or after its report)
                continue
            reports[rank] = (error, detail)
            if error is not None:
                break  # the others may wait for it in a collective: stop them below
    finally:
        failed = any(e is not None for e, _ in reports.values()) or len(reports) < world
        for p in procs:
            p.join(timeout=5 if failed else 60)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    problems = [f"rank {r}:\n{e}" for r, (e, _) in sorted(reports.items()) if e is not None]
    missing = [r for r in range(world) if r not in reports]
    if missing:
        codes = {p.name: p.exitcode for p in procs}
        problems.append(f"ranks {missing} reported nothing within {DEADLINE_S} s (exit codes {codes})")
    problems += [f"{p.name} exited with {p.exitcode}" for p in procs if p.exitcode not in (0, None) and not problems]
    if problems:
        raise AssertionError("\n".join(problems))
    return reports[0][1]


def test_moe_layer_across_gpus_matches_virtual_ranks():
    from mokgen.spec import load_spec

    world = _world(load_spec(SPEC).num_experts)
    assert world >= 2
    report = run_world(world)
    assert report == f"W={world}: {len(TOKENS)} calls bitwise equal to virtual ranks"
