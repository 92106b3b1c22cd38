"""How much of `mokgen bench`'s forward time is the host's, on the bench's own inputs (H200, not CI).

The bench times each call between two CUDA events on an idle GPU (bench.time_launch), so the
host's work before the megakernel's launch is in its figure. Per workload this prints:
  bench     the bench's figure: median of 20 synchronized calls (ms)
  gpu       the same call enqueued behind a GPU sleep, so the host is ahead: the GPU's own time
            (median of 9), and the kernels' own durations (torch.profiler, CUDA activity)
  launch    host time from the call's start to the megakernel's launch call (the library's
            mokgen_ep_forward, timed by a wrapper), inside that call, and to the call's return
            (median of 40)
  stages    the same calls by stage: to the module's forward, to the error poll, the poll, to the
            binding's implementation, to the launch call, the launch call
  entry     the bench's time with the no-graph entry (mokgen.ep._op's binding itself) against the
            eager autograd.Function, interleaved (30 ABBA blocks; B / A and its 95% interval)
  cprofile  the host call's Python functions by own time (50 calls behind a sleep)
Usage: python3 .ci/fwd_host.py SPEC local|layer [TOKENS] (layer: default 16384 tokens)."""

import cProfile
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mokgen import bench
from mokgen.ep import MoELayer
from mokgen.spec import load_spec
from timed_lib import TimedLib, gpu_ahead_ms, stamp_host_path  # .ci/timed_lib.py, beside this script

name, workload = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "local"
real = load_spec(name)
if workload == "local":
    ep = bench.LOCAL_EP.get(real.name, 8)
    spec, tokens = bench.local_spec(real, ep)
    kwargs = bench.local_layer_kwargs(real, ep) or {}
else:
    spec, tokens, kwargs = real, int(sys.argv[3]) if len(sys.argv) > 3 else 16384, {}
wg, wu, wd = bench._weights(spec)
gen = torch.Generator(device="cuda").manual_seed(1)
inputs = []
for _ in range(3):
    x = torch.randn(tokens, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    inputs.append((x, *bench._routing(spec, tokens, gen)))
layer = MoELayer(spec, max_tokens=tokens, device="cuda", **kwargs)
with torch.no_grad():
    layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
layer.check_ids = False
mod = layer._kernel
marks = {}


mod.LIB = TimedLib(mod.LIB, marks)
# stamps along the host path (host clock at each point, per call): the module's forward entered,
# the error poll entered and left, the binding's implementation entered, the launch call
stamps = {}
stamp_host_path(layer, stamps)
STAGES = (("t0", "forward"), ("forward", "poll"), ("poll", "polled"), ("polled", "binding"), ("binding", "launch"),
          ("launch", "launched"))
med = statistics.median
print(f"== {spec.name} {workload}: {tokens} rows, build {layer.build_options}, MoELayer kwargs {kwargs}")
with torch.no_grad():
    fn = lambda i: layer(*inputs[i % 3])  # noqa: E731
    bench_ms = bench.time_cuda(fn, n_inputs=3, iters=20)
    to_launch, to_return, in_c, stage_ms = [], [], [], {}
    for i in range(40):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(i)
        t1 = time.perf_counter()
        stamps["t0"], stamps["launch"], stamps["launched"] = t0, marks["launch"], marks["launched"]
        for a_, b_ in STAGES:
            stage_ms.setdefault(f"{a_}->{b_}", []).append(1e3 * (stamps[b_] - stamps[a_]))
        to_launch.append(1e3 * (marks["launch"] - t0))
        in_c.append(1e3 * (marks["launched"] - marks["launch"]))
        to_return.append(1e3 * (t1 - t0))
    torch.cuda.synchronize()
    gpu_ms = gpu_ahead_ms(fn, 9, int(2e7))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            fn(i)
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            kernels[e.key] = (e.device_time_total / max(1, e.count) / 1e3, e.count)
    print(f"bench    {med(bench_ms):.3f} ms (min {min(bench_ms):.3f}, max {max(bench_ms):.3f})")
    print(f"gpu      {med(gpu_ms):.3f} ms with the host ahead (min {min(gpu_ms):.3f})")
    for k, (ms, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
        print(f"  kernel {ms:8.3f} ms x {n:2d}  {k[:100]}")
    print(f"launch   host: {med(to_launch):.3f} ms from the call to the launch (min {min(to_launch):.3f}), "
          f"{med(in_c):.3f} ms in the launch call (maps, attributes, cudaLaunch*; min {min(in_c):.3f}), "
          f"{med(to_return):.3f} ms to the return")
    print(f"exposed  bench - gpu = {med(bench_ms) - med(gpu_ms):.3f} ms")
    print("stages   host path before the launch, median (min) ms: "
          + ", ".join(f"{k} {med(v):.4f} ({min(v):.4f})" for k, v in stage_ms.items()))
    # the entry with no graph to record (the binding itself) against the eager autograd.Function
    # around it, interleaved (ABBA blocks of bench-style launches): B / A
    from mokgen import ep as ep_mod

    real_op = ep_mod._op
    sides = (lambda k, grad=True: real_op(k, True), real_op)

    def launch(side, i):
        ep_mod._op = sides[side]
        try:
            return bench.time_launch(lambda: fn(i))
        finally:
            ep_mod._op = real_op

    ratio, lo, hi = bench.block_ratio(bench.abba_blocks(launch, 30))
    print(f"entry    no-graph entry / eager Function: {ratio:.4f} [{lo:.4f}, {hi:.4f}] over 30 ABBA blocks")
    # the host path of v0.28 (a pinned buffer and two events made per launch's error watch; the
    # launch through torch.cuda.device and current_stream) against the tree's, interleaved
    from mokgen import abi

    bufs = layer._ep

    def watch_v028(timeout_ms=None):  # the tree's watch takes the launch's wait bound (v0.49)
        compute = torch.cuda.current_stream(bufs.device)
        if bufs._side is None:
            bufs._side = torch.cuda.Stream(bufs.device)
        launched = torch.cuda.Event()
        launched.record(compute)
        with torch.cuda.stream(bufs._side):
            bufs._side.wait_event(launched)
            pinned = torch.empty(abi.ERROR_BYTES, dtype=torch.uint8, pin_memory=True)
            pinned.copy_(bufs.ctl[abi.ERROR_OFFSET:abi.ERROR_OFFSET + abi.ERROR_BYTES], non_blocking=True)
            event = torch.cuda.Event()
            event.record(bufs._side)
        bufs._pending = (pinned, event)
        bufs.watched_timeout_ms = timeout_ms

    def launch_v028(entry, device, *args):
        with torch.cuda.device(device):
            return entry(*args, torch.cuda.current_stream(device).cuda_stream)

    tree_launch = getattr(mod, "_launch", None)
    if tree_launch is not None:
        def host_side(side, i):
            bufs.watch = watch_v028 if side == 0 else type(bufs).watch.__get__(bufs)
            mod._launch = launch_v028 if side == 0 else tree_launch
            try:
                return bench.time_launch(lambda: fn(i))
            finally:
                bufs.watch, mod._launch = type(bufs).watch.__get__(bufs), tree_launch

        ratio, lo, hi = bench.block_ratio(bench.abba_blocks(host_side, 30))
        print(f"host     tree's host path / v0.28's (Python side; the library's launch call is the tree's in both): "
              f"{ratio:.4f} [{lo:.4f}, {hi:.4f}] over 30 ABBA blocks")
    prof_c = cProfile.Profile()
    torch.cuda._sleep(int(4e8))
    prof_c.enable()
    for i in range(50):
        fn(i)
    prof_c.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof_c).sort_stats("tottime").print_stats(30)
