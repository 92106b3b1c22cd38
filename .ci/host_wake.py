"""Why the host path before the forward's launch is slower inside the bench's fwd+bwd step than in
a loop (H100 or H200, not CI). v0.53's `.ci/host_path.py` timed the path at 64 us a call in a loop,
where `.ci/step_host.py` found 0.35 ms from a step's start to the launch when each step starts after
a synchronize, as the bench's do. This script times the bench's own step (mokgen's, save policy,
and the PyTorch autograd peer's) with different things just before the start event:
  sync        the bench's way: the previous step synchronized, then the step at once
  spin        the same, then 2 ms of busy host work before the start event (a running core)
  sleep       the same, then a 2 ms sleep (an idle core, as after a blocking wait)
  gc-off      sync, with Python's garbage collector off for the measurement
Per row: the step's CUDA-event time (median of 30 and min) and, for mokgen, the host time from the
step's start to the forward's launch entry, split at stamps along the path (the gradients reset,
the module's forward entered, the error poll entered and left, the binding's implementation
entered, the launch entry). Then the forward alone with autograd recording (no backward), each
call after a synchronize, and back to back without one (the host path in a loop), for comparison.
Usage: python3 .ci/host_wake.py [SPEC] [local|layer] [TOKENS] (default: the qwen3.5-35b-a3b layer)."""
import gc
import statistics
import sys
import time

import torch

from mokgen import bench, bwd_gemm
from mokgen.spec import load_spec
from timed_lib import TimedLib, stamp_host_path  # .ci/timed_lib.py, beside this script

name = sys.argv[1] if len(sys.argv) > 1 else "qwen3.5-35b-a3b"
workload = sys.argv[2] if len(sys.argv) > 2 else "layer"
real = load_spec(name)
spec, tokens = bench.backward_workload(name, workload, int(sys.argv[3]) if len(sys.argv) > 3 else None)
kwargs = bench.local_layer_kwargs(real, bench.LOCAL_EP.get(real.name, 8)) if workload == "local" else None
layer, (wg, wu, wd), inputs = bench.backward_problem(spec, tokens, 2, kwargs)
layer.bwd_policy = "save"
params = tuple(layer.parameters())  # as the bench holds them (v0.54)
mod = layer._kernel
marks = {}
mod.LIB = TimedLib(mod.LIB, marks)
stamps = {}
stamp_host_path(layer, stamps)
STAGES = ("t0", "reset", "forward", "poll", "polled", "binding", "launch")
clamp = spec.activation.clamp_limit


def ours(i):
    x, ids, w, g = inputs[i % 2]
    for t in (x, w, *params):
        t.grad = None
    stamps["reset"] = time.perf_counter()
    with bwd_gemm.forced(True):
        layer(x, ids, w).backward(g)


def peer(i):
    x, ids, w, g = inputs[i % 2]
    for t in (x, w, wg, wu, wd):
        t.grad = None
    bench.torch_grouped_mm_pipeline(x, ids, w, wg, wu, wd, clamp).backward(g)


def spin(s=0.002):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < s:
        pass


preludes = {"sync": lambda: None, "spin": spin, "sleep": lambda: time.sleep(0.002)}


def measure(fn, prelude, n=30, gc_off=False):
    ms, launch = [], []
    stages.clear()
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    if gc_off:
        gc.disable()
    try:
        for i in range(n):
            prelude()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
            launch.append(1e3 * (marks.get("launch", t0) - t0))
            if fn is ours:
                add_stages(t0)
    finally:
        gc.enable()
    return ms, launch


med = statistics.median
stages = {}


def add_stages(t0):
    """The last call's stage durations (ms) into ``stages``, from its start ``t0`` to its launch."""
    stamps["t0"], stamps["launch"] = t0, marks["launch"]
    for a_, b_ in zip(STAGES, STAGES[1:]):
        stages.setdefault(f"{a_}->{b_}", []).append(1e3 * (stamps[b_] - stamps[a_]))


def stage_line():
    return "         stages, median (min) ms: " + ", ".join(f"{k} {med(v):.4f} ({min(v):.4f})" for k, v in stages.items())


print(f"== {spec.name} {workload}: {tokens} rows, {torch.cuda.get_device_name()}, MoELayer kwargs {kwargs}")
for label, fn in (("mokgen", ours), ("pytorch", peer)):
    for pname, prelude, gc_off in (*((p_, f_, False) for p_, f_ in preludes.items()), ("gc-off", preludes["sync"], True)):
        ms, launch = measure(fn, prelude, gc_off=gc_off)
        extra = f"; to the forward's launch {med(launch):.3f} ms (min {min(launch):.3f})" if label == "mokgen" else ""
        print(f"{label:8s} {pname:6s} step {med(ms):.3f} ms (min {min(ms):.3f}){extra}")
        if label == "mokgen" and not gc_off:
            print(stage_line())

# the forward alone (autograd recording, no backward): each call after a synchronize, then back to
# back (no synchronize between calls: the host path in a loop)
x, ids, w, _ = inputs[0]
for sync in (True, False):
    loop = []
    stages.clear()
    torch.cuda.synchronize()
    for _ in range(20):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stamps["reset"] = t0
        out = layer(x, ids, w)
        loop.append(1e3 * (marks["launch"] - t0))
        add_stages(t0)
        del out
    torch.cuda.synchronize()
    print(f"forward  {'synced' if sync else 'loop  '} to the launch {med(loop):.3f} ms (min {min(loop):.3f}), "
          f"{'each call after a synchronize' if sync else 'back to back'}, autograd recording, no backward")
    print(stage_line())
