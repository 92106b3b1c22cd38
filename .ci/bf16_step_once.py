"""One BF16 fwd+bwd step of mokgen's layer (the megakernel forward, the backward's kernels) on the
inputs of `mokgen bench --backward` for a spec's local or layer workload, run --steps times and
synchronized, the last step alone inside cudaProfilerStart/Stop: a target for a profiler (`ncu
--profile-from-start off --section SpeedOfLight python3 .ci/bf16_step_once.py`,
issue 5: do the BF16 GEMMs sit against L2 as the MX ones did, docs/perf-notes.md v0.42). Runs on
an H100/H200, not in CI. Usage: python3 .ci/bf16_step_once.py [--steps N] [SPEC [local|layer]]."""
import argparse

import torch

from mokgen import bench
from mokgen.spec import load_spec

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("spec", nargs="?", default="kimi-k2.5")
ap.add_argument("workload", nargs="?", default="local", choices=["local", "layer"])
args = ap.parse_args()
spec, tokens = bench.backward_workload(args.spec, args.workload)
kwargs = None
if args.workload == "local":  # the real spec's tuned entry, as `mokgen bench --backward` takes
    real = load_spec(args.spec)
    kwargs = bench.local_layer_kwargs(real, bench.LOCAL_EP.get(real.name, 8))
layer, (wg, wu, wd), [(x, ids, w, g)] = bench.backward_problem(spec, tokens, layer_kwargs=kwargs)
leaves = (x, w, wg, wu, wd, *layer.parameters())
for i in range(args.steps):
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    if i == args.steps - 1:  # the last step alone between the profiler's start and stop
        torch.cuda.cudart().cudaProfilerStart()
    layer(x, ids, w).backward(g)
    torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print(f"{spec.name} {args.workload}: {args.steps} BF16 fwd+bwd steps ran ({tokens} tokens)")
