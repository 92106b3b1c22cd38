"""One staged MXFP8 training step (mx_experts.experts_forward_train fwd+bwd) on the bench's local
workload of a spec, run --steps times (default 2) and synchronized: a target for a profiler
(`ncu -k regex:gemm_kernel|ranged_kernel --launch-skip N ...`). Runs on an H100/H200, not in CI.
Usage: python3 .ci/mx_step_once.py [--steps N] [SPEC] (default kimi-k2.5)."""
import argparse

import torch
from mx_ab import staged_step

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("spec", nargs="?", default="kimi-k2.5")
args = ap.parse_args()
spec, step, _ = staged_step(args.spec)
for _ in range(args.steps):
    step()
torch.cuda.synchronize()
print(f"{spec.name}: {args.steps} staged MXFP8 steps ran")
