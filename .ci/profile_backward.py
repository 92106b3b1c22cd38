"""Where the forward + backward time goes: torch.profiler over a few fwd+bwd steps of mokgen
(the megakernel, then the baseline backward of mokgen/backward.py) and of the torch._grouped_mm
pipeline under autograd, on the inputs of `mokgen bench --backward`. Prints each side's top CUDA
kernels by total time. Usage: python3 .ci/profile_backward.py SPEC [local|layer] [TOKENS]"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mokgen import bench, env

spec, tokens = bench.backward_workload(sys.argv[1], *sys.argv[2:4])
workload = sys.argv[2] if len(sys.argv) > 2 else "local"
# a local stand-in takes the real spec's tuned entry, as `mokgen bench --backward` does (v0.21)
kwargs = None
if workload == "local":
    from mokgen.spec import load_spec

    real = load_spec(sys.argv[1])
    kwargs = bench.local_layer_kwargs(real, bench.LOCAL_EP.get(real.name, 8))
layer, (wg, wu, wd), [(x, ids, w, g)] = bench.backward_problem(spec, tokens, layer_kwargs=kwargs)
clamp = spec.activation.clamp_limit
leaves = (x, w, wg, wu, wd, *layer.parameters())


def fresh(step):  # gradients start at None every step, as in `mokgen bench --backward` (v0.8)
    def run():
        for t in leaves:
            t.grad = None
        step()
    return run


sides = {
    "mokgen": fresh(lambda: layer(x, ids, w).backward(g)),
    "torch._grouped_mm autograd": fresh(lambda: bench.torch_grouped_mm_pipeline(x, ids, w, wg, wu, wd, clamp).backward(g)),
}
for name, step in sides.items():
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(f"== {name}: {spec.name} {workload} {tokens} rows, 3 steps (MOKGEN_BWD_GEMM={env.bwd_gemm_enabled():d}, "
          f"MOKGEN_BWD_POLICY={env.bwd_policy()})")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=90))
    # The host: how long one step takes to enqueue behind a GPU busy for ~100 ms (a wait for the
    # device inside the step would make it take the sleep's length), then where its CPU time goes.
    torch.cuda._sleep(int(2e8))
    t0 = time.perf_counter()
    step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"host: one step enqueued in {1e3 * (t1 - t0):.2f} ms behind a ~100 ms GPU sleep "
          f"(step done {1e3 * (t2 - t0):.1f} ms after the start; a device wait inside would put the first near 100 ms)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=70))
