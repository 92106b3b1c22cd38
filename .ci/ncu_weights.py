"""The split weight-gradient launches of one local workload, each twice, for a profiler (runs on
an H200, not in CI; docs/perf-notes.md v0.32): the joint dW_gate/dW_up and dW_down of
`mokgen bench SPEC --workload local --backward`'s rows, single CTAs, with the default tail and
store. Usage, e.g. the second launch of each (docs/bench/v0.32-call5-ncu-weights-kimi.txt):
  ncu --section SpeedOfLight --section MemoryWorkloadAnalysis -k regex:weight_kernel \
      --launch-skip 2 --launch-count 2 python3 .ci/ncu_weights.py kimi-k2.5"""
import sys

import torch

from mokgen import bench, bwd_gemm

spec, gen, counts, offs, rows = bench.local_expert_rows(sys.argv[1] if len(sys.argv) > 1 else "kimi-k2.5")
H, I = spec.hidden_size, spec.moe_intermediate_size


def randn(*shape):
    return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)


x, go, dg, du, hw = randn(rows, H), randn(rows, H), randn(rows, I), randn(rows, I), randn(rows, I)
for _ in range(2):
    bwd_gemm.weight_grads_joint(dg, du, x, offs, cluster=1)
    bwd_gemm.weight_grads(go, hw, offs, cluster=1, schedule="split")
torch.cuda.synchronize()
print(f"{spec.name}: {spec.num_experts} experts, {rows} rows: ok")
