"""Benchmarks: mokgen and its peers side by side, in one process, on the same inputs.

Timing: CUDA events around each call, warm-up first, then the median of ``iters`` (>= 20) runs,
rotating over several input sets so no run reads another's inputs from L2. FLOPs are counted as
6 * T * k * H * I for the routed experts' forward (padding excluded). The dense bf16 GEMM ceiling
(8192^3) is measured in the same run. Results: a table, JSON, and a PNG bar chart.

Workloads (more come with the Hopper GEMM core):
* ``layer``    routed experts of the whole layer on one GPU (T tokens, uniform routing):
               the mokgen megakernel (MoELayer, W = 1), the PyTorch
               ``torch._grouped_mm`` pipeline and a per-expert PyTorch loop.
* ``virtual``  the megakernel with W = 8 virtual ranks on one GPU (T tokens per rank), against the
               PyTorch pipeline and the per-expert loop computing the same global tokens without
               any transfer.
* ``local``    one rank's expert work after dispatch at EP 8 (EP 64 for deepseek-v3), 2048 tokens
               per GPU before routing: the rank's E/EP experts and ~2048 k rows, as a single-rank
               problem (see ``local_spec``).
* ``ep``       real expert parallelism under torchrun (one process per GPU): MoELayer over torch
               symmetric memory against all-to-all + grouped GEMMs (``torch_ep_pipeline``).
"""

from __future__ import annotations

import json
import statistics
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from mokgen.errors import MokgenError
from mokgen.spec import MoESpec


@dataclass
class Row:
    workload: str
    spec: str
    tokens: int
    impl: str
    ms: float
    tflops: float
    ms_all: list[float] = field(default_factory=list)
    # mokgen rows: the kernel's own phase times of the last timed launch (``abi.parse_stats``:
    # pull_start_ms, pull_ms, push_ms, done_ms, from the rank's first CTA start)
    phases: dict = field(default_factory=dict)
    # fwd+bwd rows: the peak GPU memory of the timed steps above what was allocated before them
    # (GiB), the side's own activations, gradients and workspaces
    peak_gib: float | None = None
    # fwd+bwd rows: device memory the side holds for its life outside the step (GiB): a MoELayer's
    # persistent buffers (MoELayer.buffer_bytes: symmetric region with the combine slots, receive
    # ring), allocated once at construction and so not in ``peak_gib``; PyTorch's pipeline, 0
    held_gib: float | None = None
    # ``--numerics mxfp8`` rows: relative Frobenius error of the row's output on the first input
    # set against the float64 layer (mokgen.reference.experts_forward)
    error: float | None = None
    # virtual-rank megakernel rows: bytes of rows dispatched between ranks per token, counted by
    # the kernel (every rank's rows pulled from another rank, times the row's bytes in its numerics)
    bytes_per_token: float | None = None
    # a row's one-line finding, printed under the table (the block bench's time saved by the fused
    # shared expert)
    note: str | None = None


PHASES = ("pull_start_ms", "pull_ms", "push_ms", "done_ms")


def phase_line(row: Row) -> str | None:
    """One line of a mokgen row's kernel phases, or None without them: when the first pull
    started, how long the pulls and pushes took, when every push was done, and what came after
    (the median launch time minus done: the combine, the done waits and the launch itself)."""
    ph = row.phases
    if not ph or ph.get("done_ms") is None:
        return None
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    return (f"{row.workload} {row.spec}: first pull at {fmt(ph.get('pull_start_ms'))} ms, pulls {fmt(ph.get('pull_ms'))} ms, "
            f"pushes {fmt(ph.get('push_ms'))} ms, all pushed at {fmt(ph['done_ms'])} ms, "
            f"then {row.ms - ph['done_ms']:.3f} ms to the end ({row.ms:.3f} ms median)")


def time_launch(fn: Callable[[], object]) -> float:
    """ms of one call of ``fn`` on the current stream, by CUDA events (synchronized)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def abba_blocks(launch: Callable[[int, int], float], blocks: int, *, warmup: int = 6) -> list[tuple[float, float]]:
    """An interleaved comparison of two sides: ``warmup`` launches alternating, then ``blocks``
    ABBA blocks of ``launch(side, i)`` (side 0 = A, 1 = B; i the block's input index, i + 1 for
    its second half; returns ms). Each block gives (A's two launches, B's two) summed: a drift of
    the clock slower than a block cancels out of its ratio. `.ci/ab_variants.py` and the tuner's
    interleaved confirmation time this way."""
    for i in range(warmup):
        launch(i % 2, i)
    pairs = []
    for blk in range(blocks):
        a1, b1, b2, a2 = launch(0, blk), launch(1, blk), launch(1, blk + 1), launch(0, blk + 1)
        pairs.append((a1 + a2, b1 + b2))
    return pairs


def block_ratio(pairs, *, resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(median, 2.5th, 97.5th percentile) of B / A over ABBA blocks ``pairs`` of (A ms, B ms): the
    median of the per-block ratios and a bootstrap 95% interval of it (``resamples`` resamples
    from a fixed seed, so the same times give the same interval)."""
    import random

    ratios = [b / a for a, b in pairs]
    rng = random.Random(seed)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), boot[int(0.025 * resamples)], boot[min(resamples - 1, int(0.975 * resamples))]


def time_cuda(fn: Callable[[int], object], *, n_inputs: int, warmup: int = 3, iters: int = 20) -> list[float]:
    """Times ``fn(i)`` (i = input set index, rotating) with CUDA events; returns ms per run."""
    for i in range(warmup):
        fn(i % n_inputs)
    torch.cuda.synchronize()
    return [time_launch(lambda: fn(i % n_inputs)) for i in range(iters)]


def dense_ceiling_tflops(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = statistics.median(time_cuda(lambda i: a @ b, n_inputs=1, iters=iters))
    return 2 * n**3 / ms / 1e9


def routed_flops(spec: MoESpec, tokens: int) -> float:
    return 6.0 * tokens * spec.top_k * spec.hidden_size * spec.moe_intermediate_size


# ---- PyTorch peers -------------------------------------------------------------------------------


def torch_grouped_mm_pipeline(x, ids, w, w_gate, w_up, w_down, clamp_limit=None):
    """Permute by expert, torch._grouped_mm for gate/up and down, weighted scatter-add combine."""
    T, K = ids.shape
    E = w_gate.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = x.index_select(0, order // K)
    gate = torch._grouped_mm(rows, w_gate.transpose(1, 2), offs=offs)
    up = torch._grouped_mm(rows, w_up.transpose(1, 2), offs=offs)
    if clamp_limit is not None:
        gate = gate.clamp(max=clamp_limit)
        up = up.clamp(-clamp_limit, clamp_limit)
    h = torch.nn.functional.silu(gate) * up
    y = torch._grouped_mm(h, w_down.transpose(1, 2), offs=offs)
    y = y * w.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    out = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
    out.index_add_(0, order // K, y.float())
    return out.to(torch.bfloat16)


def _grouped_ffn(rows, expert_ids, num_experts, w_gate, w_up, w_down, clamp_limit=None):
    """Unweighted SwiGLU FFN of each row by its expert, through torch._grouped_mm (rows in any
    order; returned in the same order)."""
    order = torch.argsort(expert_ids, stable=True)
    offs = torch.cumsum(torch.bincount(expert_ids, minlength=num_experts), 0).to(torch.int32)
    r = rows.index_select(0, order)
    gate = torch._grouped_mm(r, w_gate.transpose(1, 2), offs=offs)
    up = torch._grouped_mm(r, w_up.transpose(1, 2), offs=offs)
    if clamp_limit is not None:
        gate, up = gate.clamp(max=clamp_limit), up.clamp(-clamp_limit, clamp_limit)
    y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w_down.transpose(1, 2), offs=offs)
    out = torch.empty_like(y)
    out[order] = y
    return out


def torch_ep_pipeline(x, ids, w, w_gate_local, w_up_local, w_down_local, group=None, clamp_limit=None):
    """The expert-parallel peer: all-to-all (NCCL on GPUs) + torch._grouped_mm.

    Rank r owns experts [r*E/W, (r+1)*E/W). Counts are exchanged first (all_to_all_single), then
    the (token, j) rows, the experts' FFNs run as grouped GEMMs, the results come back by the
    reverse all-to-all, and the owner adds them with the routing weights (scatter-add in fp32)."""
    import torch.distributed as dist

    from mokgen.reference import ep_dispatch_plan

    world = dist.get_world_size(group)
    T, K = ids.shape
    e_loc = w_gate_local.shape[0]
    flat = ids.reshape(-1).to(torch.int64)
    dest, order, send, recv = ep_dispatch_plan(flat, e_loc, world, group)
    rows = x.index_select(0, torch.div(order, K, rounding_mode="floor"))
    local_ids = (flat - dest * e_loc).index_select(0, order)
    got_rows = rows.new_empty((sum(recv), x.shape[1]))
    dist.all_to_all_single(got_rows, rows, recv, send, group=group)
    got_ids = local_ids.new_empty((sum(recv),))
    dist.all_to_all_single(got_ids, local_ids, recv, send, group=group)
    y = _grouped_ffn(got_rows, got_ids, e_loc, w_gate_local, w_up_local, w_down_local, clamp_limit)
    back = y.new_empty((flat.numel(), x.shape[1]))
    dist.all_to_all_single(back, y.contiguous(), send, recv, group=group)
    out = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
    weights = w.reshape(-1).index_select(0, order).unsqueeze(1).float()
    out.index_add_(0, torch.div(order, K, rounding_mode="floor"), back.float() * weights)
    return out.to(torch.bfloat16)


def torch_loop(x, ids, w, w_gate, w_up, w_down, clamp_limit=None):
    """One expert at a time (the naive baseline)."""
    T, K = ids.shape
    out = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
    flat = ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        pos = (flat == e).nonzero().squeeze(1)
        tok = pos // K
        xe = x.index_select(0, tok)
        gate, up = xe @ w_gate[e].T, xe @ w_up[e].T
        if clamp_limit is not None:
            gate, up = gate.clamp(max=clamp_limit), up.clamp(-clamp_limit, clamp_limit)
        y = (torch.nn.functional.silu(gate) * up) @ w_down[e].T
        out.index_add_(0, tok, y.float() * w.reshape(-1)[pos].unsqueeze(1))
    return out.to(torch.bfloat16)


# ---- workloads -------------------------------------------------------------------------------------


def _weights(spec: MoESpec, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    E, I, H = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    return tuple(
        (torch.randn(*shape, generator=gen, device="cuda") * shape[-1] ** -0.5).to(torch.bfloat16)
        for shape in ((E, I, H), (E, I, H), (E, H, I))
    )


def _routing(spec: MoESpec, T: int, gen):
    scores = torch.rand(T, spec.num_experts, generator=gen, device="cuda")
    ids = scores.topk(spec.top_k, dim=-1).indices.to(torch.int32)
    w = torch.rand(T, spec.top_k, generator=gen, device="cuda")
    return ids, w / w.sum(-1, keepdim=True)


#: EP degree of the "local" workload per spec (DESIGN.md's table); the rest use 8
LOCAL_EP = {"deepseek-v3": 64}


def local_spec(spec: MoESpec, ep: int, tokens_per_gpu: int = 2048) -> tuple[MoESpec, int]:
    """The rank-local work after dispatch at EP ``ep`` as a single-rank problem: a spec with the
    rank's E/ep experts, top-1 (every dispatched (token, j) row is its own row), and the rows a
    rank receives on average under uniform routing (tokens_per_gpu * k). Returns (spec, rows)."""
    from mokgen.spec import spec_from_dict

    if ep < 1 or spec.num_experts % ep:
        raise ValueError(f"{spec.name}: ep ({ep}) must divide num_experts ({spec.num_experts})")
    rows = tokens_per_gpu * spec.top_k
    d = spec.canonical_dict()
    d.update(
        name=f"{spec.name}-ep{ep}-local",
        aliases=[],
        description=f"rank-local expert work of {spec.name} at EP{ep} (bench workload)",
        num_experts=spec.num_experts // ep,
        top_k=1,
        routing={**d["routing"], "n_group": 1, "topk_group": 1},
        target={**d["target"], "max_ep_ranks": 1, "max_tokens_per_rank": max(rows, 1)},
    )
    return spec_from_dict(d, source=f"bench local workload of {spec.name}"), rows


def local_layer_kwargs(spec: MoESpec, ep: int, tokens_per_gpu: int = 2048) -> dict | None:
    """MoELayer arguments for the stand-in layer of ``spec``'s local work at EP ``ep``: the real
    spec's tuned entry at this EP degree, if any (as a MoELayer of the real spec at EP ep would
    take it), else None (the plan's defaults). The entry's ring is grown as a layer grows a
    tuned ring for its backward (mokgen.ep.AUTO_RING_GROWTH): passed on, it would count as the
    caller's own size."""
    from mokgen.ep import _bwd_ring, _ring_for_backward, _tuned_choice

    entry, options, (chunk_rows, ring_chunks, dispatch_ctas) = _tuned_choice(
        spec, None, ep, tokens_per_gpu, torch.device("cuda", torch.cuda.current_device()), True, None, (None, None, None),
        stand_in=True)
    if entry is None:
        return None
    if chunk_rows is not None and ring_chunks is not None:  # the stand-in's rows: tokens_per_gpu x top_k
        ring_chunks = _ring_for_backward(spec, 1, tokens_per_gpu, chunk_rows, ring_chunks, _bwd_ring(None))
    return {"build_options": options, "chunk_rows": chunk_rows, "ring_chunks": ring_chunks,
            "dispatch_ctas": dispatch_ctas}


def bench_local(spec: MoESpec, ep: int | None = None, *, tokens_per_gpu: int = 2048, iters: int = 20,
                loop: bool = False, numerics: str = "bf16") -> list[Row]:
    """Workload (a): one rank's expert work after dispatch (ep from LOCAL_EP, default 8)."""
    ep = LOCAL_EP.get(spec.name, 8) if ep is None else ep
    local, rows = local_spec(spec, ep, tokens_per_gpu)
    # the MXFP8 megakernel takes the real spec's MXFP8 tuned entry where one exists (mokgen tune --numerics mxfp8)
    mx_kwargs = local_layer_kwargs(spec.with_target(numerics="mxfp8"), ep, tokens_per_gpu) if numerics == "mxfp8" else None
    out = bench_layer(local, rows, iters=iters, loop=loop, layer_kwargs=local_layer_kwargs(spec, ep, tokens_per_gpu),
                      numerics=numerics, mx_layer_kwargs=mx_kwargs)
    for r in out:
        r.workload = f"local EP{ep}"
    return out


#: the bench's rows of the MXFP8 experts (``--numerics mxfp8``): the default bf16-math form and
#: the FP8 tensor core's quad form (mokgen.mx_experts.FORMS)
MX_ROW = "mokgen MXFP8 experts (staged, bf16 math)"
MX_FP8_ROW = "mokgen MXFP8 experts (staged, FP8 quad)"
#: the megakernel built with numerics mxfp8 (mx_tile.cuh: rows dispatched as E4M3 codes + scales)
MX_MEGA_ROW = "mokgen megakernel MXFP8 (W=1)"


def _tuned_row(name: str, layer, layer_kwargs: dict | None) -> str:
    """A megakernel row's name, "(..., tuned)" where the layer runs a tuned entry (mokgen tune): its
    own lookup's, or one passed in as ``layer_kwargs`` (bench_local)."""
    return name[:-1] + ", tuned)" if layer.tuned_entry is not None or layer_kwargs is not None else name


def bench_layer(spec: MoESpec, tokens: int, *, iters: int = 20, n_inputs: int = 3, loop: bool = True,
                layer_kwargs: dict | None = None, numerics: str = "bf16",
                mx_layer_kwargs: dict | None = None) -> list[Row]:
    """mokgen against its peers on ``spec``'s layer at ``tokens`` tokens on one GPU.
    ``layer_kwargs``: MoELayer arguments of a tuned entry found for another spec (bench_local);
    ``mx_layer_kwargs``: the same for the MXFP8 megakernel (an MXFP8 tuned entry). A megakernel
    row that runs a tuned entry says so in its name.
    ``numerics="mxfp8"`` adds the MXFP8 experts (mokgen.mx_experts, weights quantized once before
    the timing) and, for them and the BF16 megakernel, the error against the float64 layer."""
    from mokgen.ep import MoELayer

    wg, wu, wd = _weights(spec)
    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs = []
    for _ in range(n_inputs):
        x = torch.randn(tokens, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        inputs.append((x, *_routing(spec, tokens, gen)))
    layer = MoELayer(spec, max_tokens=tokens, device="cuda", **(layer_kwargs or {}))
    with torch.no_grad():
        layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
    layer.check_ids = False
    clamp = spec.activation.clamp_limit
    ours = _tuned_row("mokgen megakernel (W=1)", layer, layer_kwargs)
    mx_row = MX_MEGA_ROW  # numerics mxfp8: the MXFP8 megakernel's row
    impls = {
        ours: lambda i: layer(*inputs[i]),
        "torch._grouped_mm": lambda i: torch_grouped_mm_pipeline(*inputs[i], wg, wu, wd, clamp),
    }
    if numerics == "mxfp8":
        from mokgen import mx_experts

        mxw = mx_experts.quantize_weights(wg, wu, wd)
        impls[MX_ROW] = lambda i: mx_experts.experts_forward(*inputs[i], mxw, clamp, check_ids=False)
        impls[MX_FP8_ROW] = lambda i: mx_experts.experts_forward(*inputs[i], mxw, clamp, form="quad",
                                                                check_ids=False)
        mx_layer = MoELayer(spec.with_target(numerics="mxfp8"), max_tokens=tokens, device="cuda",
                            **(mx_layer_kwargs or {}))
        with torch.no_grad():
            mx_layer.w_gate.copy_(wg), mx_layer.w_up.copy_(wu), mx_layer.w_down.copy_(wd)
        mx_layer.check_ids = False
        mx_row = _tuned_row(MX_MEGA_ROW, mx_layer, mx_layer_kwargs)
        impls[mx_row] = lambda i: mx_layer(*inputs[i])
    elif numerics != "bf16":
        raise ValueError(f"numerics must be bf16 or mxfp8, got {numerics!r}")
    if loop:
        impls["torch per-expert loop"] = lambda i: torch_loop(*inputs[i], wg, wu, wd, clamp)
    rows = []
    flops = routed_flops(spec, tokens)
    with torch.no_grad():
        for name, fn in impls.items():
            times = time_cuda(fn, n_inputs=n_inputs, iters=iters)
            ms = statistics.median(times)
            rows.append(Row("layer", spec.name, tokens, name, ms, flops / ms / 1e9, times))
            if name == ours:  # the kernel's phases of its last timed launch
                st = layer.stats()
                rows[-1].phases = {k: st.get(k) for k in PHASES}
        if numerics == "mxfp8":
            from mokgen import reference

            exact = reference.experts_forward(*inputs[0], wg, wu, wd, clamp_limit=clamp, acc_dtype=torch.float64)
            for r in rows:
                if r.impl in (ours, MX_ROW, MX_FP8_ROW, mx_row):
                    got = impls[r.impl](0).double()
                    r.error = ((got - exact).norm() / exact.norm()).item()
            del exact
    return rows


def backward_workload(name: str, workload: str = "local", tokens: int | None = None) -> tuple[MoESpec, int]:
    """(spec, rows) of `mokgen bench NAME --backward`'s workload: ``local``, one rank's rows at
    the spec's LOCAL_EP degree (a stand-in spec, local_spec), or ``layer``, the whole layer at
    ``tokens`` (default 16384)."""
    from mokgen.spec import load_spec

    spec = load_spec(name)
    if workload == "local":
        return local_spec(spec, LOCAL_EP.get(spec.name, 8))
    return spec, 16384 if tokens is None else int(tokens)


def backward_problem(spec: MoESpec, tokens: int, n_inputs: int = 1, layer_kwargs: dict | None = None):
    """The fwd+bwd bench's problem: a single-GPU MoELayer holding the bench's weights (id checks
    off; ``layer_kwargs``: its MoELayer arguments, as bench_layer's, e.g. a local stand-in's
    tuned entry), the same weights as leaves for the PyTorch peer ``(wg, wu, wd)``, and
    ``n_inputs`` input sets ``(x, ids, w, dOut)`` with x and w requiring gradients."""
    from mokgen.ep import MoELayer

    wg, wu, wd = (w.detach().requires_grad_(True) for w in _weights(spec))
    gen = torch.Generator(device="cuda").manual_seed(3)
    inputs = []
    for _ in range(n_inputs):
        x = torch.randn(tokens, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(True)
        ids, w = _routing(spec, tokens, gen)
        inputs.append((x, ids, w.requires_grad_(True), torch.randn_like(x)))
    layer = MoELayer(spec, max_tokens=tokens, device="cuda", **(layer_kwargs or {}))
    with torch.no_grad():
        layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
    layer.check_ids = False
    return layer, (wg, wu, wd), inputs


def local_expert_rows(name: str, ep: int = 8, seed: int = 3):
    """The expert-major rows of ``mokgen bench NAME --workload local --backward`` (EP ``ep``, the
    bench's routing), for the backward GEMMs' own benchmarks: ``(spec, gen, counts, offs, rows)``,
    the local spec, the generator after the routing (for the operands), rows per expert [E]
    int64, their inclusive prefix sums [E] int32 and the total."""
    from mokgen.spec import load_spec

    spec, tokens = local_spec(load_spec(name), ep)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids, _ = _routing(spec, tokens, gen)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=spec.num_experts)
    return spec, gen, counts, counts.cumsum(0).to(torch.int32), int(counts.sum())


def bench_layer_backward(spec: MoESpec, tokens: int, *, iters: int = 20, n_inputs: int = 2,
                         workload: str = "layer", layer_kwargs: dict | None = None,
                         numerics: str = "bf16") -> list[Row]:
    """Forward + backward of the routed experts on one GPU: mokgen (the megakernel forward, then
    its autograd backward, mokgen/backward.py: on torch._grouped_mm with g and u recomputed, and
    on mokgen's backward GEMMs with g and u recomputed or saved by the forward) against the
    ``torch._grouped_mm`` pipeline under autograd. Gradients for x, the routing weights and the
    three expert weights; FLOPs counted as 3x the forward's. Each row's ``ms_all`` holds the
    timings; the peak memory of each side (bytes above the inputs) is its ``peak_gib``. Every
    step starts with the gradients set to None, as ``optimizer.zero_grad()`` leaves them by
    default, so neither side pays for adding into an existing ``.grad`` (v0.7 and earlier
    accumulated across the timed steps: about 3 ms of kimi-k2.5's local step, on both sides).
    ``layer_kwargs``: MoELayer arguments (a local stand-in's tuned entry, local_layer_kwargs, as
    the forward bench's local rows take it; v0.21). ``numerics="mxfp8"`` adds the MXFP8
    megakernel under autograd (its backward the staged MXFP8 experts', mokgen.ep's _MXTraining:
    from the rows the launch saved, or under MOKGEN_BWD_POLICY=recompute after the staged
    forward again) and the staged MXFP8 experts' own fwd+bwd (mx_experts.experts_forward_train),
    the weights quantized on every step in both, as a training step's change."""
    if numerics not in ("bf16", "mxfp8"):
        raise ValueError(f"numerics must be bf16 or mxfp8, got {numerics!r}")
    layer, (wg, wu, wd), inputs = backward_problem(spec, tokens, n_inputs, layer_kwargs)
    clamp = spec.activation.clamp_limit

    def fresh(*leaves):
        for t in leaves:
            t.grad = None

    # each side's parameters as one fixed sequence, made before the timing, as an optimizer holds
    # them (the PyTorch side names its three): walking a module's parameters() generator inside
    # the timed step cost about 0.03 ms of host time there at the step's start (v0.54)
    params = tuple(layer.parameters())

    def ours(i):
        x, ids, w, g = inputs[i]
        fresh(x, w, *params)
        layer(x, ids, w).backward(g)

    def peer(i):
        x, ids, w, g = inputs[i]
        fresh(x, w, wg, wu, wd)
        torch_grouped_mm_pipeline(x, ids, w, wg, wu, wd, clamp).backward(g)

    from mokgen import bwd_gemm

    def ours_on(gemms: bool, policy: str):  # the backward's GEMMs (mokgen's or torch's) and g/u policy
        def run(i):
            layer.bwd_policy = policy
            with bwd_gemm.forced(gemms):
                ours(i)
        return run

    impls = {"mokgen megakernel + torch._grouped_mm backward, recompute (W=1)": ours_on(False, "recompute")}
    # mokgen's backward GEMMs, with g and u recomputed and (the default) saved by the forward,
    # where they run (an sm_90 GPU, tile-sized H and I, the library built or buildable here)
    if bwd_gemm.usable(spec.hidden_size, spec.moe_intermediate_size, "cuda"):
        try:
            bwd_gemm.load_library()
        except MokgenError as err:  # no nvcc here: the rows are left out, with the reason
            warnings.warn(f"mokgen bench: the backward GEMMs are not timed: {err}")
        else:
            impls["mokgen megakernel + mokgen backward, recompute (W=1)"] = ours_on(True, "recompute")
            impls["mokgen megakernel + mokgen backward, save (W=1)"] = ours_on(True, "save")
            ring_layer = _ring_reuse_layer(spec, tokens, layer)
            if ring_layer is not None:
                def ring_run(i, ring_layer=ring_layer, ring_params=tuple(ring_layer.parameters())):
                    x, ids, w, g = inputs[i]
                    fresh(x, w, *ring_params)
                    ring_layer(x, ids, w).backward(g)
                impls[RING_ROW] = ring_run
    impls["torch._grouped_mm autograd"] = peer
    if numerics == "mxfp8":
        from mokgen import mx_experts
        from mokgen.ep import MoELayer, refresh_mx_weights

        mx_layer = MoELayer(spec.with_target(numerics="mxfp8"), max_tokens=tokens, device="cuda")
        with torch.no_grad():
            mx_layer.w_gate.copy_(wg), mx_layer.w_up.copy_(wu), mx_layer.w_down.copy_(wd)
        mx_layer.check_ids = False

        mx_params = tuple(mx_layer.parameters())

        def mx_mega(i):
            x, ids, w, g = inputs[i]
            fresh(x, w, *mx_params)
            refresh_mx_weights()  # a training step's weights are new: the forward converts them again
            mx_layer(x, ids, w).backward(g)

        def mx_staged(i):
            x, ids, w, g = inputs[i]
            fresh(x, w, wg, wu, wd)
            mx_experts.experts_forward_train(x, ids, w, wg, wu, wd, clamp).backward(g)

        impls[MX_MEGA_BWD_ROW] = mx_mega
        impls[MX_BWD_ROW] = mx_staged
    # the layer each mokgen row runs, for the buffers it holds (the PyTorch rows hold none)
    holders = {name: layer for name in impls if name.startswith("mokgen megakernel +")}
    if RING_ROW in impls:
        holders[RING_ROW] = ring_layer
    if numerics == "mxfp8":
        holders[MX_MEGA_BWD_ROW] = mx_layer
    rows = []
    flops = 3 * routed_flops(spec, tokens)
    for name, fn in impls.items():
        fn(0)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = time_cuda(fn, n_inputs=n_inputs, iters=iters)
        peak = torch.cuda.max_memory_allocated() - base
        held = holders[name].buffer_bytes if name in holders else 0
        ms = statistics.median(times)
        rows.append(Row(f"{workload} fwd+bwd", spec.name, tokens, name, ms, flops / ms / 1e9, times,
                        peak_gib=peak / 2**30, held_gib=held / 2**30))
    return rows


#: the fwd+bwd bench's MXFP8 rows (``--numerics mxfp8 --backward``): the MXFP8 megakernel under
#: autograd (its backward: the staged experts' recomputed forward and MXFP8 backward), and the
#: staged experts alone
MX_MEGA_BWD_ROW = "mokgen megakernel MXFP8 + staged MXFP8 backward (W=1)"
MX_BWD_ROW = "mokgen MXFP8 experts, staged fwd+bwd (bf16 math)"
#: the fwd+bwd bench's row of a layer whose ring is sized to hold every pair (bwd_ring "reuse")
RING_ROW = "mokgen megakernel + mokgen backward, save, ring reused (W=1)"


def _ring_reuse_layer(spec: MoESpec, tokens: int, layer):
    """For the fwd+bwd bench: where ``layer``'s ring (as tuned) holds fewer rows than the pairs,
    so its backward gathers them, a copy of it with bwd_ring "reuse" (the ring grown to hold
    them, read in place by the backward); else None (the default row reads the ring already).
    Its row's held memory (``Row.held_gib``) is its buffers with the larger ring."""
    from mokgen.ep import MoELayer

    if layer.world != 1 or layer.chunk_rows * layer.ring_chunks >= tokens * spec.top_k:
        return None
    other = MoELayer(spec, max_tokens=tokens, device="cuda", chunk_rows=layer.chunk_rows, ring_chunks=layer.ring_chunks,
                     dispatch_ctas=layer.dispatch_ctas, build_options=layer.build_options, tuned=False, bwd_ring="reuse")
    with torch.no_grad():
        other.w_gate.copy_(layer.w_gate), other.w_up.copy_(layer.w_up), other.w_down.copy_(layer.w_down)
    other.check_ids = False
    return other


def block_flops(spec: MoESpec, tokens: int) -> float:
    """Forward FLOPs of the whole block: router GEMM, routed experts, shared expert(s)."""
    se = spec.shared_experts
    return routed_flops(spec, tokens) + 2.0 * tokens * spec.hidden_size * (
        spec.num_experts + 3 * se.count * se.intermediate_size)


def torch_block(x, block, clamp_limit=None):
    """The PyTorch peer of mokgen.MoEBlock with the same weights: fp32 router logits, the
    reference's selection and weights, the ``torch._grouped_mm`` pipeline, the shared expert(s)
    as a separate PyTorch MLP."""
    from mokgen import reference

    spec = block.spec
    logits = torch.nn.functional.linear(x.float(), block.router.weight.float())
    ids, w = reference.route(logits, spec, block.router.e_score_correction_bias)
    y = torch_grouped_mm_pipeline(x, ids, w, block.experts.w_gate, block.experts.w_up, block.experts.w_down,
                                  clamp_limit)
    return y if block.shared is None else y + block.shared(x)


def bench_block(spec: MoESpec, tokens: int, *, iters: int = 20, n_inputs: int = 2, backward: bool = False) -> list[Row]:
    """Whole MoE block on one GPU (issue 8): ``mokgen.MoEBlock`` (compiled router selection,
    megakernel, the shared expert inside it where the build fuses it, else in PyTorch; see
    ``MOKGEN_FUSE_SHARED``) against ``torch_block`` on the same weights, plus the shared expert
    MLP alone (the most a fused shared expert can save). Where the block fuses its shared expert,
    a second MoEBlock with the same weights runs it as a PyTorch MLP beside the megakernel (the
    first one's build options with ``fuse_shared`` off, and its chunk rows, ring and dispatch
    CTAs), and the mokgen row's ``note`` gives the time the fusion saved and the fused block's
    time over the other's in ABBA blocks (``abba_blocks``, ``block_ratio``: a bootstrap 95%
    interval). The rows are timed in interleaved rounds, so every comparison is a same-run one.
    ``backward``: forward + backward under autograd, FLOPs counted as 3x the forward's."""
    from mokgen.block import MoEBlock

    block = MoEBlock(spec, max_tokens=tokens, device="cuda")
    block.experts.check_ids = False
    unfused = None
    if block.shared is not None and block.experts.fuses_shared:
        ex = block.experts  # the same build and run-time values but the fusion (a tuned entry's too)
        unfused = MoEBlock(spec, max_tokens=tokens, device="cuda", layer_kwargs=dict(
            build_options={**ex.build_options, "fuse_shared": False}, chunk_rows=ex.chunk_rows,
            ring_chunks=ex.ring_chunks, dispatch_ctas=ex.dispatch_ctas))
        _share_tensors(unfused, block)  # one set of weights on the GPU (kimi-k2.5's experts: 34 GB)
        unfused.experts.check_ids = False
    gen = torch.Generator(device="cuda").manual_seed(4)
    inputs = []
    for _ in range(n_inputs):
        x = torch.randn(tokens, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        inputs.append((x.requires_grad_(backward), torch.randn_like(x)))
    clamp = spec.activation.clamp_limit

    def run(f, module):
        if not backward:
            return lambda i: f(inputs[i][0])
        params = tuple(module.parameters())  # made once, as bench_layer_backward's

        def step(i):  # gradients start at None every step (as bench_layer_backward's)
            for t in (inputs[i][0], *params):
                t.grad = None
            f(inputs[i][0]).backward(inputs[i][1])
        return step

    impls = {"mokgen MoEBlock": run(block, block),
             "PyTorch block (torch._grouped_mm)": run(lambda x: torch_block(x, block, clamp), block)}
    if unfused is not None:
        impls[UNFUSED_BLOCK_ROW] = run(unfused, unfused)
    if block.shared is not None:
        impls["shared expert MLP alone (PyTorch)"] = run(block.shared, block.shared)
    pairs = None
    with torch.set_grad_enabled(backward):
        times = interleaved_times(impls, n_inputs=n_inputs, iters=iters)
        if unfused is not None:  # the project's A/B method on top: ABBA blocks, bootstrap interval
            sides = (impls[UNFUSED_BLOCK_ROW], impls["mokgen MoEBlock"])  # A the MLP, B the fused: B / A
            pairs = abba_blocks(lambda side, i: time_launch(lambda: sides[side](i % n_inputs)), SAVED_ABBA_BLOCKS)
    rows = []
    scale = 3 if backward else 1
    wl = "block fwd+bwd" if backward else "block"
    for name, ts in times.items():
        ms = statistics.median(ts)
        flops = block_flops(spec, tokens) if "alone" not in name else (
            6.0 * tokens * spec.hidden_size * spec.shared_experts.count * spec.shared_experts.intermediate_size)
        rows.append(Row(wl, spec.name, tokens, name, ms, scale * flops / ms / 1e9, ts))
    if pairs is not None:
        fused_ms, mlp_ms = rows[0].ms, next(r.ms for r in rows if r.impl == UNFUSED_BLOCK_ROW)
        ratio, lo, hi = block_ratio(pairs)
        rows[0].note = (f"{wl} {spec.name}: the shared expert inside the megakernel saved {mlp_ms - fused_ms:.3f} ms "
                        f"({100 * (mlp_ms - fused_ms) / mlp_ms:.1f}%) against it as a PyTorch MLP beside the "
                        f"megakernel ({fused_ms:.3f} against {mlp_ms:.3f} ms, medians of {len(rows[0].ms_all)} "
                        f"steps timed in interleaved rounds); fused / PyTorch MLP {ratio:.4f} [{lo:.4f}, {hi:.4f}] "
                        f"over {len(pairs)} ABBA blocks")
    return rows


SAVED_ABBA_BLOCKS = 10  # the block bench's fused-against-MLP A/B (bench_block)


UNFUSED_BLOCK_ROW = "mokgen MoEBlock, shared expert as a PyTorch MLP"


def interleaved_times(impls: dict[str, Callable[[int], object]], *, n_inputs: int, iters: int,
                      rounds: int = 4) -> dict[str, list[float]]:
    """``iters`` timed calls of each of ``impls`` (ms), taken in ``rounds`` rounds that visit every
    impl in turn, so a drift of the clock or the power cap over the run falls on all of them alike."""
    per = [n for n in (iters // rounds + (r < iters % rounds) for r in range(rounds)) if n]
    out = {name: [] for name in impls}
    for n in per:
        for name, fn in impls.items():
            out[name] += time_cuda(fn, n_inputs=n_inputs, iters=n)
    return out


def _share_tensors(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """Makes every parameter and buffer of ``dst`` the same tensor as ``src``'s of the same name
    (two modules of one structure), freeing ``dst``'s own."""
    modules = dict(src.named_modules())
    for name, m in dst.named_modules():
        for table in (m._parameters, m._buffers):
            for key, t in table.items():
                if t is not None:
                    table[key] = getattr(modules[name], key)


def bench_virtual(spec: MoESpec, tokens_per_rank: int, world: int = 8, *, iters: int = 20, n_inputs: int = 2,
                  loop: bool = False, numerics: str = "bf16") -> list[Row]:
    """The megakernel with ``world`` virtual ranks on one GPU against the PyTorch pipeline on the
    same global tokens without any transfer, and (``loop``) the per-expert PyTorch loop. The
    megakernel rows carry the bytes dispatched between ranks per token as the kernel counted them
    (``bytes_per_token``). ``numerics="mxfp8"`` adds the MXFP8 megakernel (rows dispatched as E4M3
    codes plus scales: issue 6's bytes per token against BF16's, on one GPU)."""
    from mokgen.ep import virtual_ep_forward
    from mokgen.plan import row_bytes

    if numerics not in ("bf16", "mxfp8"):
        raise ValueError(f"numerics must be bf16 or mxfp8, got {numerics!r}")

    wg, wu, wd = _weights(spec)
    gen = torch.Generator(device="cuda").manual_seed(2)
    inputs = []
    for _ in range(n_inputs):
        T = tokens_per_rank * world
        x = torch.randn(T, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        ids, w = _routing(spec, T, gen)
        inputs.append((x, ids, w, list(x.split(tokens_per_rank)), list(ids.split(tokens_per_rank)), list(w.split(tokens_per_rank))))
    clamp = spec.activation.clamp_limit
    megakernels = {f"mokgen megakernel (W={world} virtual)": spec}
    if numerics == "mxfp8":
        megakernels[f"mokgen megakernel MXFP8 (W={world} virtual)"] = spec.with_target(numerics="mxfp8")
    impls = {name: (lambda i, s=s: virtual_ep_forward(s, *inputs[i][3:], wg, wu, wd, check_ids=False))
             for name, s in megakernels.items()}
    impls["torch._grouped_mm (no transfer)"] = lambda i: torch_grouped_mm_pipeline(*inputs[i][:3], wg, wu, wd, clamp)
    if loop:
        impls["torch per-expert loop (no transfer)"] = lambda i: torch_loop(*inputs[i][:3], wg, wu, wd, clamp)
    rows = []
    T = tokens_per_rank * world
    flops = routed_flops(spec, T)
    with torch.no_grad():
        for name, fn in impls.items():
            times = time_cuda(fn, n_inputs=n_inputs, iters=iters)
            ms = statistics.median(times)
            rows.append(Row("virtual", spec.name, T, name, ms, flops / ms / 1e9, times))
            s = megakernels.get(name)
            if s is not None:  # the rows the kernel pulled from other ranks, on input set 0
                stats = virtual_ep_forward(s, *inputs[0][3:], wg, wu, wd, check_ids=False, return_stats=True)[1]
                remote = sum(st["rows_remote"] for st in stats)
                rows[-1].bytes_per_token = remote * row_bytes(spec.hidden_size, s.target.numerics) / T
    return rows


def bytes_line(row: Row) -> str | None:
    """One line of a virtual-rank megakernel row's bytes dispatched between ranks per token, or None."""
    if row.bytes_per_token is None:
        return None
    return f"{row.spec} {row.impl}: {row.bytes_per_token:.0f} B dispatched between ranks per token (kernel count)"


def write_results(rows: list[Row], ceiling: float, out_dir: Path, extra: dict | None = None) -> tuple[Path, Path | None]:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"dense_bf16_tflops": ceiling, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "rows": [asdict(r) for r in rows], **(extra or {})}
    js = out_dir / "bench.json"
    js.write_text(json.dumps(doc, indent=2) + "\n")
    png = out_dir / "bench.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return js, None
    groups = sorted({(r.workload, r.spec, r.tokens) for r in rows})
    impls = list(dict.fromkeys(r.impl for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * len(impls) / 2), 4.5))
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        vals = [next((r.tflops for r in rows if (r.workload, r.spec, r.tokens) == g and r.impl == impl), 0) for g in groups]
        ax.bar([i + k * width for i in range(len(groups))], vals, width, label=impl)
    ax.axhline(ceiling, color="gray", linestyle="--", label=f"dense bf16 GEMM {ceiling:.0f}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{w}\n{s}\nT={t}" for w, s, t in groups], fontsize=7)
    ax.set_ylabel("TFLOP/s (6 T k H I)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return js, png


def write_chunk_curve(spec: MoESpec, ep: int, tokens: int, curve: list, gpu: str, out_dir: Path) -> tuple[Path, Path | None]:
    """``mokgen tune --chunk-sweep``'s result: JSON and a PNG of layer ms against chunk rows
    (``curve``: (chunk rows, mokgen.tune.Outcome) pairs; failed points are left out of the plot)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"chunk-sweep-{spec.name}-ep{ep}-t{tokens}"
    doc = {"spec": spec.name, "ep": ep, "tokens_per_rank": tokens, "gpu": gpu, "torch": torch.__version__,
           "points": [{"chunk_rows": c, **o.to_json()} for c, o in curve]}
    js = out_dir / f"{stem}.json"
    js.write_text(json.dumps(doc, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return js, None
    pts = [(c, o.ms) for c, o in curve if o.ms is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([c for c, _ in pts], [m for _, m in pts], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk rows (received rows per compute batch)")
    ax.set_ylabel("layer ms (median)")
    ax.set_title(f"{spec.name}, EP{ep}, {tokens} tokens per rank, {gpu}", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    png = out_dir / f"{stem}.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return js, png


def expert_weights(spec: MoESpec, experts, device="cuda", seed: int = 1000):
    """w_gate, w_up [len(experts), I, H] and w_down [len(experts), H, I] bf16 of the global
    experts ``experts``; expert e is drawn from its own generator (seed + e) on ``device``, so
    every rank can make exactly its slice, and any GPU the whole set, without communication."""
    H, I = spec.hidden_size, spec.moe_intermediate_size
    experts = list(experts)
    out = [torch.empty(len(experts), *shape, device=device, dtype=torch.bfloat16) for shape in ((I, H), (I, H), (H, I))]
    for n, e in enumerate(experts):
        gen = torch.Generator(device=device).manual_seed(seed + e)
        for dst in out:
            fan_in = dst.shape[-1]
            dst[n] = torch.randn(*dst.shape[1:], generator=gen, device=device) * fan_in**-0.5
    return tuple(out)


def skewed_routing(spec: MoESpec, T: int, gen, hot_experts: int, device="cuda"):
    """Routing where every token prefers the ``hot_experts`` lowest expert ids (a rank's hot
    spot: under EP its owner receives most rows). Top-k ids stay distinct per token."""
    scores = torch.rand(T, spec.num_experts, generator=gen, device=device)
    scores[:, :hot_experts] += 1.0
    ids = scores.topk(spec.top_k, dim=-1).indices.to(torch.int32)
    w = torch.rand(T, spec.top_k, generator=gen, device=device) + 0.05
    return ids, w / w.sum(-1, keepdim=True)


def _remote_bytes(spec: MoESpec, ids_all: list[torch.Tensor], rank: int, world: int, numerics: str = "bf16") -> int:
    """Bytes of rows rank ``rank`` receives from OTHER ranks (= bytes it sends back in combine, for
    bf16): rows of ``plan.row_bytes(H, numerics)``, E4M3 codes plus scales for mxfp8."""
    from mokgen.plan import row_bytes

    e_loc = spec.num_experts // world
    rows = sum(int((i.long().div(e_loc, rounding_mode="floor") == rank).sum()) for q, i in enumerate(ids_all) if q != rank)
    return rows * row_bytes(spec.hidden_size, numerics)


def bench_ep(spec: MoESpec, tokens_per_rank: int, *, iters: int = 20, skew: bool = False,
             numerics: str = "bf16") -> tuple[list[Row], dict]:
    """Real expert parallelism, one process per GPU (run under torchrun; the NCCL process group
    must be initialized): mokgen.MoELayer over torch symmetric memory against NCCL all-to-all +
    grouped GEMMs (``torch_ep_pipeline``), same inputs, every rank timing its own launches; the
    slowest rank's median is the layer's time. Returns (rows, link figures) on rank 0 and
    ([], {}) elsewhere.

    Link figures (GB/s per GPU per direction, remote bytes only, of the rank receiving the most
    remote bytes: the busiest link direction): ``mokgen
    dispatch`` = bytes pulled from peers / the kernel's pull window, measured in-kernel
    (%globaltimer) once with the default ring (pulls throttled by the GEMMs' consumption) and
    once with a ring holding every received row (pulls limited by the links); ``mokgen
    combine`` = the same bytes (each pulled remote row is pushed back) / the push window, from
    the first row block's pushes to the rank's done (pushes come from down-tile epilogues, so
    throttled by the GEMMs); ``nccl dispatch`` / ``nccl combine`` = the same bytes / the rows'
    all_to_all_single time, each way. ``numerics="mxfp8"`` adds the MXFP8 megakernel (rows dispatched
    as E4M3 codes plus scales): its row, its dispatch figure over its own remote bytes, and the
    bytes crossing per token of both builds (``bytes per token``)."""
    import torch.distributed as dist

    from mokgen.ep import MoELayer
    from mokgen.reference import ep_dispatch_plan

    world, rank = dist.get_world_size(), dist.get_rank()
    e_loc = spec.num_experts // world
    local = range(rank * e_loc, (rank + 1) * e_loc)
    wg, wu, wd = expert_weights(spec, local)
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    inputs = []
    for _ in range(2):
        x = torch.randn(tokens_per_rank, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        ids, w = skewed_routing(spec, tokens_per_rank, gen, max(1, e_loc // 2)) if skew else _routing(spec, tokens_per_rank, gen)
        inputs.append((x, ids, w))
    clamp = spec.activation.clamp_limit

    def make_layer(ring_chunks=None):
        layer = MoELayer(spec, dist.group.WORLD, max_tokens=tokens_per_rank, ring_chunks=ring_chunks,
                         device=torch.cuda.current_device())
        with torch.no_grad():
            layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
        layer.check_ids = False
        return layer

    # rows each rank receives, from everyone's routing (input set 0)
    ids_all = [torch.empty_like(inputs[0][1]) for _ in range(world)]
    dist.all_gather(ids_all, inputs[0][1])
    remote = _remote_bytes(spec, ids_all, rank, world)
    received = sum(int((i.long().div(e_loc, rounding_mode="floor") == rank).sum()) for i in ids_all)
    max_received = [0] * world
    dist.all_gather_object(max_received, received)

    layer = make_layer()
    tag = "skewed" if skew else "uniform"
    impls = {
        f"mokgen megakernel (EP{world}{', tuned' if layer.tuned_entry is not None else ''})": lambda i: layer(*inputs[i]),
        f"NCCL all-to-all + torch._grouped_mm (EP{world})": lambda i: torch_ep_pipeline(
            *inputs[i], wg, wu, wd, None, clamp),
    }
    mx_layer = None
    if numerics == "mxfp8":
        mx_layer = MoELayer(spec.with_target(numerics="mxfp8"), dist.group.WORLD, max_tokens=tokens_per_rank,
                            device=torch.cuda.current_device())
        with torch.no_grad():
            mx_layer.w_gate.copy_(wg), mx_layer.w_up.copy_(wu), mx_layer.w_down.copy_(wd)
        mx_layer.check_ids = False
        impls[f"mokgen megakernel MXFP8 (EP{world})"] = lambda i: mx_layer(*inputs[i])
    elif numerics != "bf16":
        raise ValueError(f"numerics must be bf16 or mxfp8, got {numerics!r}")
    flops = routed_flops(spec, tokens_per_rank)  # per rank
    medians = {}
    with torch.no_grad():
        for name, fn in impls.items():
            dist.barrier()
            medians[name] = statistics.median(time_cuda(fn, n_inputs=2, iters=iters))
        # the link figures, on input set 0
        link = {}
        layer(*inputs[0])
        st = layer.stats()
        link["mokgen dispatch (default ring)"] = (remote, st["pull_ms"])
        link["mokgen combine (push window, default ring)"] = (remote, st["push_ms"])
        if mx_layer is not None:  # the same rows as codes plus scales; the kernel's own count of them
            mx_layer(*inputs[0])
            mst = mx_layer.stats()
            from mokgen.plan import row_bytes

            mx_remote = mst["rows_remote"] * row_bytes(spec.hidden_size, "mxfp8")
            link["mokgen MXFP8 dispatch (default ring)"] = (mx_remote, mst["pull_ms"])
            link["bytes per token: bf16 rows"] = (remote, None, remote / tokens_per_rank)
            link["bytes per token: MXFP8 rows"] = (mx_remote, None, mx_remote / tokens_per_rank)
            del mx_layer
        ring = max(1, -(-max(max_received) // layer.chunk_rows))
        layer = None  # frees it (the timing lambdas above close over the name)
        big = make_layer(ring_chunks=ring)
        for _ in range(3):
            big(*inputs[0])
        st = big.stats()
        link[f"mokgen dispatch (ring of {ring} chunks: every row)"] = (remote, st["pull_ms"])
        del big
        x, ids, _ = inputs[0]
        flat = ids.reshape(-1).long()
        _, order, send, recv = ep_dispatch_plan(flat, e_loc, world)
        rows = x.index_select(0, torch.div(order, spec.top_k, rounding_mode="floor"))
        got = rows.new_empty((sum(recv), x.shape[1]))
        dist.barrier()
        a2a = statistics.median(time_cuda(lambda i: dist.all_to_all_single(got, rows, recv, send), n_inputs=1, iters=iters))
        link["NCCL dispatch (all_to_all_single of the rows)"] = (remote, a2a)
        back = rows.new_empty(rows.shape)  # the combine's direction: expert outputs back to the owners
        dist.barrier()
        a2a_back = statistics.median(time_cuda(lambda i: dist.all_to_all_single(back, got, send, recv), n_inputs=1,
                                               iters=iters))
        link["NCCL combine (all_to_all_single of the rows back)"] = (remote, a2a_back)
    gathered = [None] * world
    dist.all_gather_object(gathered, (medians, link))
    if rank:
        return [], {}
    out = []
    for name in impls:
        ms = max(g[0][name] for g in gathered)
        times = [g[0][name] for g in gathered]
        out.append(Row(f"ep{world} {tag}", spec.name, tokens_per_rank, name, ms, flops / ms / 1e9, times))
    figures = {}
    for name in link:
        per_rank = [g[1][name] for g in gathered]  # (remote bytes, ms[, bytes per token]) per rank
        busiest = max(range(world), key=lambda r: per_rank[r][0])  # the most loaded link
        b, ms = per_rank[busiest][:2]
        figures[name] = {"gbps": b / (ms * 1e6) if ms else None, "busiest_rank": busiest,
                         "remote_bytes_per_rank": [v[0] for v in per_rank], "ms_per_rank": [v[1] for v in per_rank]}
        if len(per_rank[busiest]) > 2:  # bytes crossing per token (the busiest rank's remote bytes / its tokens)
            figures[name]["bytes_per_token"] = per_rank[busiest][2]
    return out, figures
