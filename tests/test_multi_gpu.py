"""Expert parallelism across real GPUs: MoELayer on W processes, one GPU each (NCCL process group,
torch symmetric memory over NVLink), gives the same bits as ``virtual_ep_forward`` with W virtual
ranks on one GPU, on the same global weights and tokens, and agrees with the PyTorch reference.

For every bundled spec: 2048 tokens per GPU with uniform routing, then with skewed routing (every
token prefers experts of rank 0), as launch epochs 1 and 2 of one layer (the second call must not
see anything of the first). For the first spec also two calls with a different token count on every
rank, one rank with none. Backward (test_moe_layer_backward_across_gpus): the gradients of every
rank's MoELayer, through the process-group backward, against virtual ranks on one GPU.

W = min(GPUs, 8), lowered to a divisor of the expert counts. Each rank reports to a results queue;
a rank that raises, dies, or does not report within the deadline fails the test with its
traceback, and the others are stopped.
"""

from __future__ import annotations

import os
import traceback

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from conftest import run_ranks  # noqa: E402

pytestmark = pytest.mark.multi_gpu

SPECS = ("qwen3-30b-a3b", "qwen3.5-35b-a3b", "qwen3.5-397b-a17b", "glm-5.2", "deepseek-v3", "kimi-k2.5",
         "deepseek-v4-pro")
#: the megakernel's MXFP8 path across GPUs (issue 6): "spec:numerics" (see _load)
MX_SPECS = ("qwen3-30b-a3b:mxfp8", "kimi-k2.5:mxfp8")
TOKENS_PER_GPU = 2048
DEADLINE_S = 900
#: NVLink multicast stays off (it can take a shared host's GPUs out of service); set before init
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: extra calls on the first spec: tokens per rank (the first `world` entries), a zero in each
RAGGED = (
    (1500, 0, 4096, 333, 2048, 1, 777, 3001),
    (0, 2500, 17, 4096, 640, 1, 3000, 129),
)


# ---- the global inputs, reproducible in every process -------------------------------------------


def _load(name: str):
    """The spec of ``name``, or of ``spec:numerics`` with that target numerics."""
    from mokgen.spec import load_spec

    base, _, numerics = name.partition(":")
    spec = load_spec(base)
    return spec.with_target(numerics=numerics) if numerics else spec


def _calls(spec_name: str, world: int) -> list[tuple[str, list[int]]]:
    """(routing, tokens per rank) of each call on this spec."""
    calls = [("uniform", [TOKENS_PER_GPU] * world), ("skewed", [TOKENS_PER_GPU] * world)]
    if spec_name in (SPECS[0], MX_SPECS[0]):
        calls += [("uniform", list(t[:world])) for t in RAGGED]
    return calls


def _rank_inputs(spec, call: int, routing: str, tokens: int, rank: int, world: int, device):
    """Rank ``rank``'s x [T, H] bf16, topk_ids [T, K] (global ids) and weights for ``call``."""
    from mokgen.bench import skewed_routing

    gen = torch.Generator(device=device).manual_seed(100 * call + rank)
    x = torch.randn(tokens, spec.hidden_size, generator=gen, device=device).to(torch.bfloat16)
    if routing == "skewed":
        ids, w = skewed_routing(spec, tokens, gen, max(1, spec.num_experts // world // 2), device=device)
    else:
        ids = torch.rand(tokens, spec.num_experts, generator=gen, device=device).topk(spec.top_k, dim=-1).indices
        w = torch.rand(tokens, spec.top_k, generator=gen, device=device) + 0.05
        w = w / w.sum(-1, keepdim=True)
    return x, ids, w


# ---- one rank ---------------------------------------------------------------------------------------


def _init_rank(rank: int, world: int, port: int):
    """This process's GPU and NCCL process group (NVLink multicast off, the JIT off: the parent
    built every spec). Returns the device."""
    os.environ.update(NO_MULTICAST)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MOKGEN_DISABLE_JIT="1")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    return device


def _worker(rank: int, world: int, port: int, results) -> None:
    _work(rank, world, port, results, SPECS)


def _mx_worker(rank: int, world: int, port: int, results) -> None:
    _work(rank, world, port, results, MX_SPECS)


def _work(rank: int, world: int, port: int, results, specs) -> None:
    try:
        device = _init_rank(rank, world, port)
        reports = []
        try:
            for name in specs:
                outs = _run_rank(name, rank, world, device)
                if rank == 0:
                    reports.append(_compare_on_one_gpu(name, world, outs, device))
                    torch.cuda.empty_cache()
                dist.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, None, reports if rank == 0 else "ok"))
    except BaseException:  # noqa: BLE001 - everything goes to the parent
        results.put((rank, traceback.format_exc(), None))
        raise


def _run_rank(name: str, rank: int, world: int, device):
    """This rank's part for one spec: the layer with its slice of the weights, every call; rank 0
    gathers every rank's outputs and stats (other ranks return None)."""
    import mokgen
    from mokgen.bench import expert_weights

    spec = _load(name)
    calls = _calls(name, world)
    max_tokens = max(max(t) for _, t in calls)
    layer = mokgen.MoELayer(spec, group=dist.group.WORLD, max_tokens=max_tokens, device=device)
    e_loc = spec.num_experts // world
    assert layer.local_experts == range(rank * e_loc, (rank + 1) * e_loc), layer.local_experts
    with torch.no_grad():
        for param, value in zip((layer.w_gate, layer.w_up, layer.w_down), expert_weights(spec, layer.local_experts, device)):
            param.copy_(value)
    gathered = []
    for call, (routing, tokens) in enumerate(calls):
        x, ids, w = _rank_inputs(spec, call, routing, tokens[rank], rank, world, device)
        with torch.no_grad():
            out = layer(x, ids, w)
        layer.check_errors()  # blocks; raises KernelError if a wait of this launch timed out
        stats = layer.stats()
        assert out.shape == x.shape and out.dtype == torch.bfloat16
        # outputs differ in length per rank: pad to max_tokens for the collective
        padded = torch.zeros(max_tokens, spec.hidden_size, dtype=torch.bfloat16, device=device)
        padded[: out.shape[0]] = out
        bufs = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
        dist.gather(padded, bufs, dst=0)
        all_stats = [None] * world
        dist.gather_object(stats, all_stats if rank == 0 else None, dst=0)
        if rank == 0:
            gathered.append(([b[: tokens[r]] for r, b in enumerate(bufs)], all_stats))
    if spec.target.numerics == "mxfp8" and world > 1:
        # training across GPUs is refused on every rank, before any launch, in one line (the MXFP8
        # backward runs the staged experts, every expert on one GPU)
        from mokgen.errors import InputError

        routing, tokens = calls[0]
        x, ids, w = _rank_inputs(spec, 0, routing, tokens[rank], rank, world, device)
        with pytest.raises(InputError, match="MXFP8 training needs every expert on this GPU"):
            layer(x, ids, w.clone().requires_grad_(True))
    torch.cuda.synchronize(device)
    del layer
    return gathered if rank == 0 else None


def _compare_on_one_gpu(name: str, world: int, outs, device) -> str:
    """Rank 0: the same global inputs through W virtual ranks, bit for bit, and the reference."""
    import mokgen
    from mokgen import reference
    from mokgen.bench import expert_weights

    spec = _load(name)
    mx = spec.target.numerics == "mxfp8"
    e_loc = spec.num_experts // world
    wg, wu, wd = expert_weights(spec, range(spec.num_experts), device)
    for call, ((routing, tokens), (got, stats)) in enumerate(zip(_calls(name, world), outs)):
        what = f"{name}, call {call + 1} ({routing}, tokens {tokens})"
        xs, ids, ws = zip(*(_rank_inputs(spec, call, routing, tokens[r], r, world, device) for r in range(world)))
        want = mokgen.virtual_ep_forward(spec, list(xs), list(ids), list(ws), wg, wu, wd)
        for r in range(world):
            assert got[r].shape == want[r].shape, (what, r, got[r].shape, want[r].shape)
            if not torch.equal(got[r], want[r]):
                diff = (got[r].float() - want[r].float()).abs()
                raise AssertionError(f"{what}: rank {r} of {world} differs from virtual ranks: "
                                     f"{int((diff > 0).sum())} elements, max |diff| {diff.max().item():.3e}")
        # no row dropped or duplicated: the kernel's counts against the routing
        dest = [i.long().div(e_loc, rounding_mode="floor") for i in ids]
        for r, st in enumerate(stats):
            want_rows = sum(int((d == r).sum()) for d in dest)
            want_remote = sum(int((d == r).sum()) for q, d in enumerate(dest) if q != r)
            assert st["rows_received"] == st["rows_pulled"] == st["rows_pushed"] == want_rows, (what, r, st, want_rows)
            assert st["rows_remote"] == want_remote, (what, r, st, want_remote)
        if routing == "skewed":
            assert stats[0]["rows_received"] > 1.5 * stats[-1]["rows_received"], (what, stats)
        # and both agree with the PyTorch oracle (a shared mistake would pass the bitwise check):
        # for MXFP8 the float64 MX oracle (within the pushed rows' bf16 rounding, as on one GPU)
        if call == 0 or name in (SPECS[0], MX_SPECS[0]):
            x, i, w = torch.cat(xs), torch.cat(ids), torch.cat(ws)
            if x.shape[0]:
                if mx:  # the virtual run's bf16 copy of the converted weights (34 GB on kimi-k2.5) goes
                    # first: with the oracle's float32 copies it would not fit beside the weights
                    from mokgen.ep import refresh_mx_weights

                    refresh_mx_weights()
                    torch.cuda.empty_cache()
                oracle = reference.mx_experts_forward if mx else reference.experts_forward
                # (the MX oracle copies the weights in its accumulation dtype: float64 where they
                # fit, float32 for kimi-k2.5's 384 experts, 135 GB in float64)
                small = 3 * wg.numel() * 8 < 16e9
                kw = {"acc_dtype": torch.float64 if small else torch.float32} if mx else {}
                ref = oracle(x, i, w, wg, wu, wd, clamp_limit=spec.activation.clamp_limit, **kw)
                err = ((torch.cat(got).double() - ref.double()).norm() / ref.double().norm()).item()
                assert err < (1e-2 if mx else 2e-2), f"{what}: relative error {err:.3e} against the reference"
    del wg, wu, wd
    return f"{name}: {len(outs)} calls at W={world} bitwise equal to virtual ranks"


# ---- the test -------------------------------------------------------------------------------------


def _world() -> int:
    from mokgen.spec import load_spec

    n = min(torch.cuda.device_count(), 8)
    return max(w for w in range(1, n + 1) if all(load_spec(s).num_experts % w == 0 for s in SPECS))


def run_world(world: int, mx: bool = False) -> list[str]:
    """Spawns ``world`` ranks and returns rank 0's report; raises AssertionError with every failing
    rank's traceback. ``mx``: the MXFP8 specs (MX_SPECS). (Callable by hand, e.g. with world=1 on
    a single GPU.)"""
    from mokgen import build as build_mod

    # build once here; the ranks load them with the JIT off (no W concurrent builds); MXFP8
    # layers also convert their weights with the MX GEMM library
    for name in MX_SPECS if mx else SPECS:
        build_mod.build(_load(name), publish_generated=False)
    if mx:
        from mokgen import mx_gemm

        mx_gemm.build_library()
    os.environ.update(NO_MULTICAST)  # inherited by the children, which set them again anyway
    return run_ranks(_mx_worker if mx else _worker, world, DEADLINE_S, "ep-rank")[0]


def test_moe_layer_across_gpus_matches_virtual_ranks():
    world = _world()
    assert world >= 2
    report = run_world(world)
    assert report == [f"{name}: {len(_calls(name, world))} calls at W={world} bitwise equal to virtual ranks"
                      for name in SPECS]


def test_mx_moe_layer_across_gpus_matches_virtual_ranks():
    """The megakernel's MXFP8 path (rows pulled over NVLink as E4M3 codes plus scales) across the
    GPUs, under no_grad: the bits of W virtual ranks on one GPU, every row received once, and the
    float64 MX oracle within 1e-2."""
    world = _world()
    assert world >= 2
    report = run_world(world, mx=True)
    assert report == [f"{name}: {len(_calls(name, world))} calls at W={world} bitwise equal to virtual ranks"
                      for name in MX_SPECS]


# ---- backward across GPUs ----------------------------------------------------------------------

BWD_SPECS = ("qwen3-30b-a3b", "qwen3.5-35b-a3b")  # small enough for rank 0 to hold every gradient twice


def _bwd_worker(rank: int, world: int, port: int, results) -> None:
    """Each rank: forward + backward of its MoELayer on its tokens (rank 1 has none in the second
    call), twice (same bits); rank 0 gathers every rank's gradients and checks them against
    virtual ranks on one GPU (same global inputs): the same bits."""
    try:
        import mokgen
        from mokgen.bench import expert_weights
        from mokgen.spec import load_spec

        device = _init_rank(rank, world, port)
        report = []
        try:
            for name in BWD_SPECS:
                spec = load_spec(name)
                layer = mokgen.MoELayer(spec, group=dist.group.WORLD, max_tokens=1024, device=device)
                with torch.no_grad():
                    for p_, v in zip((layer.w_gate, layer.w_up, layer.w_down),
                                     expert_weights(spec, layer.local_experts, device)):
                        p_.copy_(v)
                for call, tokens in enumerate(([1024] * world, [700, 0] + [300] * (world - 2))):
                    x, ids, w = _rank_inputs(spec, 10 + call, "uniform", tokens[rank], rank, world, device)
                    gen = torch.Generator(device=device).manual_seed(1000 + 10 * call + rank)
                    g = torch.randn(x.shape, generator=gen, device=device).to(torch.bfloat16)
                    runs = []
                    for _ in range(2):
                        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
                        for p_ in layer.parameters():
                            p_.grad = None
                        layer(xl, ids, wl).backward(g)
                        runs.append([xl.grad, wl.grad] + [p_.grad.clone() for p_ in layer.parameters()])
                    assert all(torch.equal(a, b) for a, b in zip(*runs)), f"{name}: rank {rank} not reproducible"
                    pieces = []
                    for k, t in enumerate(runs[0]):  # x and weights grads per token (padded), then experts
                        shape = (1024,) + tuple(t.shape[1:]) if k < 2 else tuple(t.shape)
                        pad = torch.zeros(shape, dtype=t.dtype, device=device)
                        pad[: t.shape[0]] = t
                        bufs = [torch.empty_like(pad) for _ in range(world)] if rank == 0 else None
                        dist.gather(pad, bufs, dst=0)
                        pieces.append(bufs)
                    if rank == 0:
                        report.append(_compare_backward(spec, world, call, tokens, g.device, pieces))
                del layer
                torch.cuda.empty_cache()
                dist.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, None, report if rank == 0 else "ok"))
    except BaseException:  # noqa: BLE001
        results.put((rank, traceback.format_exc(), None))
        raise


def _compare_backward(spec, world, call, tokens, device, pieces) -> str:
    import mokgen
    from mokgen.bench import expert_weights

    wg, wu, wd = (t.requires_grad_(True) for t in expert_weights(spec, range(spec.num_experts), device))
    xs, ids, ws, gs = [], [], [], []
    for r in range(world):
        x, i, w = _rank_inputs(spec, 10 + call, "uniform", tokens[r], r, world, device)
        gen = torch.Generator(device=device).manual_seed(1000 + 10 * call + r)
        gs.append(torch.randn(x.shape, generator=gen, device=device).to(torch.bfloat16))
        xs.append(x.requires_grad_(True)), ids.append(i), ws.append(w.requires_grad_(True))
    outs = mokgen.virtual_ep_forward(spec, xs, ids, ws, wg, wu, wd)
    torch.autograd.backward(outs, gs)
    want = [torch.cat([x.grad for x in xs]), torch.cat([w.grad for w in ws]), wg.grad, wu.grad, wd.grad]
    got = [torch.cat([b[: tokens[r]] for r, b in enumerate(pieces[0])]),
           torch.cat([b[: tokens[r]] for r, b in enumerate(pieces[1])]),
           *(torch.cat(pieces[k]) for k in (2, 3, 4))]
    for name_, a, b in zip(("x", "weights", "w_gate", "w_up", "w_down"), got, want):
        assert a.shape == b.shape, (name_, a.shape, b.shape)
        err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
        # docs/architecture.md ("Backward"): the owners sum an expert's rows in the virtual ranks'
        # order (expert-major, source rank, pair), so the same bits for any W; until v0.63 this
        # was only reported, with a 2e-2 tolerance asserted
        assert torch.equal(a, b), (f"{spec.name} call {call}: grad {name_} differs from virtual ranks "
                                   f"(relative {err:.3e})")
    return f"{spec.name} call {call} W={world}: gradients match virtual ranks bit for bit"


def test_moe_layer_backward_across_gpus():
    from mokgen import build as build_mod
    from mokgen.spec import load_spec

    world = _world()
    assert world >= 2
    for name in BWD_SPECS:
        build_mod.build(load_spec(name), publish_generated=False)
    os.environ.update(NO_MULTICAST)
    report = run_ranks(_bwd_worker, world, DEADLINE_S, "bwd-rank")[0]
    print("\n".join(report))
    assert len(report) == 2 * len(BWD_SPECS)


# ---- layers sharing their buffers across GPUs ------------------------------------------------------

def _share_worker(rank: int, world: int, port: int, results) -> None:
    """Each rank: a stack of two MoELayers on one set of symmetric buffers (share_buffers=True:
    the second layer finds the first's set on every rank, no second rendezvous) against two
    layers with their own, same weights; the stack's output and gradients, bit for bit, and a
    third shared layer made after the others are gone allocates afresh on every rank."""
    try:
        import mokgen
        from mokgen.bench import expert_weights
        from mokgen.spec import load_spec

        device = _init_rank(rank, world, port)
        report = {}
        try:
            spec = load_spec(BWD_SPECS[0])
            mine = range(spec.num_experts // world * rank, spec.num_experts // world * (rank + 1))
            values = [expert_weights(spec, mine, device, seed=1000 + 5000 * i) for i in range(2)]  # a set per layer

            def stack(share: bool) -> list:
                layers = [mokgen.MoELayer(spec, group=dist.group.WORLD, max_tokens=1024, device=device,
                                          share_buffers=share) for _ in range(2)]
                with torch.no_grad():
                    for layer, vals in zip(layers, values):
                        for p_, v in zip(layer.parameters(), vals):
                            p_.copy_(v)
                return layers

            x, ids, w = _rank_inputs(spec, 30, "uniform", 1024 if rank else 600, rank, world, device)
            g = torch.randn(x.shape, generator=torch.Generator(device=device).manual_seed(77 + rank),
                            device=device).to(torch.bfloat16)
            runs = []
            for share in (False, True):
                layers = stack(share)
                if share:
                    assert [layer.buffers_shared for layer in layers] == [False, True]
                    assert layers[0]._ep is layers[1]._ep
                xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
                out = layers[1](layers[0](xl, ids, wl), ids, wl)
                out.backward(g)
                runs.append([out.detach(), xl.grad, wl.grad, *(p_.grad for layer in layers for p_ in layer.parameters())])
                del layers
            assert all(torch.equal(a, b) for a, b in zip(*runs)), f"rank {rank}: shared buffers changed the bits"
            report["stack"] = "same bits"
            third = mokgen.MoELayer(spec, group=dist.group.WORLD, max_tokens=1024, device=device, share_buffers=True)
            assert not third.buffers_shared
            report["after"] = "new buffers"
            del third
            dist.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, None, report))
    except BaseException:  # noqa: BLE001
        results.put((rank, traceback.format_exc(), None))
        raise


def test_layers_share_buffers_across_gpus():
    from mokgen import build as build_mod
    from mokgen.spec import load_spec

    world = _world()
    assert world >= 2
    build_mod.build(load_spec(BWD_SPECS[0]), publish_generated=False)
    os.environ.update(NO_MULTICAST)
    reports = run_ranks(_share_worker, world, 600, "share-rank")
    assert all(r == {"stack": "same bits", "after": "new buffers"} for r in reports.values()), reports


# ---- tuned entries across ranks -------------------------------------------------------------------

TUNE_SPEC = "qwen3-30b-a3b"


def _tune_worker(rank: int, world: int, port: int, results) -> None:
    """Each rank writes its own tuned file for (TUNE_SPEC, this GPU, EP world, 1024 tokens) into
    its own MOKGEN_TUNED_DIR, then makes the layer. Same file on every rank: every rank uses the
    entry (BK 32, 1024-row chunks), and the output equals the untuned layer's bit for bit (chunk
    size and k-block do not change the bits). Rank 0's file different: every rank warns and takes
    the plan's defaults."""
    import tempfile
    import warnings
    from pathlib import Path

    try:
        import mokgen
        from mokgen import tune
        from mokgen.bench import expert_weights
        from mokgen.plan import make_plan
        from mokgen.spec import load_spec

        device = _init_rank(rank, world, port)
        os.environ.pop("MOKGEN_TUNED", None)  # the test session turns tuned files off; these turn them on
        os.environ["MOKGEN_TUNED_DIR"] = tempfile.mkdtemp(prefix=f"tuned-{rank}-")
        spec = load_spec(TUNE_SPEC)
        gpu = torch.cuda.get_device_name(device)
        key = tune.TuneKey.of(spec, gpu=gpu, ep=world, tokens=1024)
        base = make_plan(spec)

        def write(chunk: int) -> None:
            best = tune.Candidate(base.gemm_cluster, 32, chunk, 4, None)
            tune.write_json(Path(os.environ["MOKGEN_TUNED_DIR"]) / key.relpath(),
                            {"_metadata": tune.metadata(gpu), "key": key.to_json(), "best": best.to_json()})

        report = {}
        try:
            write(1024)
            layer = mokgen.MoELayer(spec, group=dist.group.WORLD, max_tokens=1024, device=device)
            plain = mokgen.MoELayer(spec, group=dist.group.WORLD, max_tokens=1024, device=device, tuned=False)
            assert layer.tuned_entry is not None and plain.tuned_entry is None
            assert (layer.chunk_rows, layer.build_options["block_k"]) == (1024, 32), (layer.chunk_rows, layer.build_options)
            with torch.no_grad():
                for a, b, v in zip((layer.w_gate, layer.w_up, layer.w_down), (plain.w_gate, plain.w_up, plain.w_down),
                                   expert_weights(spec, layer.local_experts, device)):
                    a.copy_(v), b.copy_(v)
                x, ids, w = _rank_inputs(spec, 20, "uniform", 1024, rank, world, device)
                same = torch.equal(layer(x, ids, w), plain(x, ids, w))
            assert same, f"rank {rank}: the tuned layer's output differs from the untuned one's"
            report["same entry"] = "used on every rank, same bits"
            del layer, plain
            write(2048 if rank == 0 else 1024)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                layer = mokgen.MoELayer(spec, group=dist.group.WORLD, max_tokens=1024, device=device)
            assert layer.tuned_entry is None and layer.build_options["block_k"] == 64, layer.build_options
            assert any("found different tuned entries" in str(c.message) for c in caught), [str(c.message) for c in caught]
            report["different entries"] = "plan defaults on every rank"
            del layer
            dist.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, None, report))
    except BaseException:  # noqa: BLE001
        results.put((rank, traceback.format_exc(), None))
        raise


def test_tuned_entries_agree_across_ranks():
    from mokgen import build as build_mod
    from mokgen import env
    from mokgen.spec import load_spec

    world = _world()
    assert world >= 2
    spec = load_spec(TUNE_SPEC)
    build_mod.build(spec, publish_generated=False)  # the ranks load with the JIT off
    build_mod.build(spec, publish_generated=False, options=env.plan_options_with({"block_k": 32}))
    os.environ.update(NO_MULTICAST)
    reports = run_ranks(_tune_worker, world, 600, "tune-rank")
    assert all(r == {"same entry": "used on every rank, same bits", "different entries": "plan defaults on every rank"}
               for r in reports.values()), reports
