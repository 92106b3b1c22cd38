"""The MXFP8 backward's elementwise stages, PyTorch expressions against v0.40's fused kernels
(MOKGEN_MX_BWD_STAGES=torch|fused; runs on an H200, not in CI; docs/perf-notes.md v0.40): the staged
MXFP8 experts' fwd+bwd step (mokgen.mx_experts.experts_forward_train) on the bench's local workload
of each named spec. First each form's gradients once, against each other (relative Frobenius
difference per gradient: the fused form sums the routing weights' gradient in its own order and
rounds SwiGLU's backward op by op, so a few E4M3 codes may differ) and the fused form's bits
twice. Then ABBA blocks of 5 timed steps each (median per block), the mean of fused / torch over
the blocks with its min and max. Usage: python3 .ci/mx_bwd_stages_ab.py [SPEC ...] (default
kimi-k2.5)."""
import os
import statistics
import sys

import torch

from mokgen import bench, load_spec, mx_experts

BLOCKS = 8


def ab(name: str) -> None:
    spec, tokens = bench.local_spec(load_spec(name), bench.LOCAL_EP.get(name, 8))
    layer, (wg, wu, wd), inputs = bench.backward_problem(spec, tokens, 1)
    del layer
    x, ids, w, d_out = inputs[0]
    clamp = spec.activation.clamp_limit
    leaves = [x, w, wg, wu, wd]  # leaves that require gradients

    def step():
        for t in leaves:
            t.grad = None
        mx_experts.experts_forward_train(leaves[0], ids, *leaves[1:], clamp).backward(d_out)

    grads = {}
    for stages in ("torch", "fused", "fused"):
        os.environ["MOKGEN_MX_BWD_STAGES"] = stages
        step()
        got = [t.grad.clone() for t in leaves]
        if stages in grads:
            same = all(torch.equal(a, b) for a, b in zip(got, grads[stages]))
            print(f"{spec.name}: fused, the same bits twice: {same}", flush=True)
        grads[stages] = got
    diffs = ", ".join(f"{n} {((a.double() - b.double()).norm() / b.double().norm()).item():.2e}"
                      for n, a, b in zip(("x", "w", "w_gate", "w_up", "w_down"), grads["fused"], grads["torch"]))
    print(f"{spec.name}: fused against torch, relative difference: {diffs}", flush=True)
    del grads
    ms = {"torch": [], "fused": []}
    for blk in range(BLOCKS):
        for stages in (("torch", "fused") if blk % 2 == 0 else ("fused", "torch")):
            os.environ["MOKGEN_MX_BWD_STAGES"] = stages
            ms[stages].append(statistics.median(bench.time_cuda(lambda i: step(), n_inputs=1, warmup=1, iters=5)))
    ratios = [b / a for a, b in zip(ms["torch"], ms["fused"])]
    print(f"{spec.name} staged MXFP8 fwd+bwd: torch {statistics.median(ms['torch']):.3f} ms, fused "
          f"{statistics.median(ms['fused']):.3f} ms, fused / torch {statistics.mean(ratios):.4f} "
          f"[{min(ratios):.4f}, {max(ratios):.4f}] over {BLOCKS} blocks", flush=True)
    os.environ.pop("MOKGEN_MX_BWD_STAGES", None)


for spec_name in sys.argv[1:] or ["kimi-k2.5"]:
    ab(spec_name)
    torch.cuda.empty_cache()
