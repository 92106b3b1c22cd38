"""How much of `mokgen bench --backward`'s fwd+bwd step is the host's, on the bench's own inputs and
step (H200 or H100, not CI). The bench times each step between two CUDA events on an idle GPU, so
the host's work before the forward's launch is in its figure. Prints:
  bench     the bench's figure for the step (mokgen's GEMMs, save policy): median of 20
  gpu       the same step enqueued behind a GPU sleep, so the host is ahead: the GPU's own time
  launch    host time from the step's start to the forward megakernel's launch call (the
            library's mokgen_ep_forward, timed by a wrapper), and to the step's return (median of 20)
  cprofile  the host path from the step's start to that launch, by cumulative and own time
            (cProfile, stopped inside the launch call; 20 steps behind a GPU sleep)
Usage: python3 .ci/step_host.py SPEC local|layer [TOKENS] (layer: default 16384 tokens)."""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from mokgen import bench, bwd_gemm
from mokgen.spec import load_spec
from timed_lib import TimedLib, gpu_ahead_ms  # .ci/timed_lib.py, beside this script

name, workload = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "local"
real = load_spec(name)
spec, tokens = bench.backward_workload(name, workload, int(sys.argv[3]) if len(sys.argv) > 3 else None)
kwargs = bench.local_layer_kwargs(real, bench.LOCAL_EP.get(real.name, 8)) if workload == "local" else None
layer, _, inputs = bench.backward_problem(spec, tokens, 2, kwargs)
layer.bwd_policy = "save"
mod = layer._kernel
marks = {}
prof = [None]


def _stop_profiler():  # the profile covers the step's start to the forward's launch
    if prof[0] is not None:
        prof[0].disable()
        prof[0] = None


mod.LIB = TimedLib(mod.LIB, marks, before=_stop_profiler)


def step(i):
    x, ids, w, g = inputs[i % 2]
    for t in (x, w, *layer.parameters()):
        t.grad = None
    with bwd_gemm.forced(True):
        layer(x, ids, w).backward(g)


med = statistics.median
print(f"== {spec.name} {workload}: {tokens} rows, MoELayer kwargs {kwargs}")
bench_ms = bench.time_cuda(step, n_inputs=2, iters=20)
to_launch, to_return = [], []
for i in range(20):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(i)
    t1 = time.perf_counter()
    to_launch.append(1e3 * (marks["launch"] - t0))
    to_return.append(1e3 * (t1 - t0))
torch.cuda.synchronize()
gpu_ms = gpu_ahead_ms(step, 9, int(3e7))
print(f"bench    {med(bench_ms):.3f} ms (min {min(bench_ms):.3f}, max {max(bench_ms):.3f})")
print(f"gpu      {med(gpu_ms):.3f} ms with the host ahead (min {min(gpu_ms):.3f})")
print(f"exposed  bench - gpu = {med(bench_ms) - med(gpu_ms):.3f} ms")
print(f"launch   host: {med(to_launch):.3f} ms from the step's start to the forward's launch "
      f"(min {min(to_launch):.3f}); {med(to_return):.3f} ms to the step's return")
for i in range(20):
    torch.cuda._sleep(int(3e7))
    p = cProfile.Profile()
    prof[0] = p
    p.enable()
    step(i)
    torch.cuda.synchronize()
    if i == 0:
        stats = pstats.Stats(p)
    else:
        stats.add(p)
for key in ("cumulative", "tottime"):
    s = io.StringIO()
    stats.stream = s
    stats.sort_stats(key).print_stats(28)
    print(f"cprofile (20 steps, the start to the forward's launch) by {key}:")
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000])
