"""One forward of the megakernel against the reference, the first thing to run after a kernel
change (a hang shows as a timeout here, not as a silent test or bench run). Usage:
    timeout 60 python3 .ci/gpu_smoke.py [SPEC [T ...]]     (default: qwen3-30b-a3b 1 300 3000)
Prints one line per T: the build and forward time and the relative error against the reference."""
import sys
import time

import torch

import mokgen
from mokgen import reference

name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
tokens = [int(t) for t in sys.argv[2:]] or [1, 300, 3000]
spec = mokgen.load_spec(name)
g = torch.Generator(device="cuda").manual_seed(0)
E, I, H, k = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size, spec.top_k
wg = (torch.randn(E, I, H, generator=g, device="cuda") * H**-0.5).bfloat16()
wu = (torch.randn(E, I, H, generator=g, device="cuda") * H**-0.5).bfloat16()
wd = (torch.randn(E, H, I, generator=g, device="cuda") * I**-0.5).bfloat16()
for T in tokens:
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    ids = torch.rand(T, E, generator=g, device="cuda").topk(k, -1).indices
    w = torch.rand(T, k, generator=g, device="cuda")
    t0 = time.perf_counter()
    out = mokgen.experts_forward(x, ids, w, wg, wu, wd, spec=spec)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    ref = reference.experts_forward(x, ids, w, wg, wu, wd, clamp_limit=spec.activation.clamp_limit)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"{name} T={T}: first forward (with build/load) {t1 - t0:.1f} s, rel err {err:.2e}", flush=True)
