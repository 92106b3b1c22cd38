"""One forward of the megakernel against the reference, the first thing to run after a kernel
change (a hang shows as a timeout here, not as a silent test or bench run). Usage:
    timeout 60 python3 .ci/gpu_smoke.py [SPEC [T ...]]     (default: qwen3-30b-a3b 1 300 3000)
Prints one line per T: the build and forward time and the relative error against the reference.
A spec with a shared expert that the build fuses (the default where the plan can) runs through
MoELayer with the shared expert's weights and a per-token scale, so that its tiles run too (v0.8's
smokes passed none: the fused builds ran their routed tiles only)."""
import sys
import time

import torch

import mokgen
from mokgen import reference
from mokgen.ep import MoELayer

name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
tokens = [int(t) for t in sys.argv[2:]] or [1, 300, 3000]
spec = mokgen.load_spec(name)
g = torch.Generator(device="cuda").manual_seed(0)
E, I, H, k = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size, spec.top_k


def weight(*shape):  # bf16, scaled by the fan-in (the last dimension)
    return (torch.randn(*shape, generator=g, device="cuda") * shape[-1] ** -0.5).bfloat16()


wg, wu, wd = weight(E, I, H), weight(E, I, H), weight(E, H, I)
layer = None
if spec.shared_experts.count > 0:
    t0 = time.perf_counter()
    layer = MoELayer(spec, max_tokens=max(tokens), device="cuda")
    if layer.fuses_shared:
        with torch.no_grad():
            layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
        sg, su, sd = weight(I, H), weight(I, H), weight(H, I)
        print(f"{name}: fused shared expert, layer built/loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    else:
        layer = None
for T in tokens:
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    ids = torch.rand(T, E, generator=g, device="cuda").topk(k, -1).indices
    w = torch.rand(T, k, generator=g, device="cuda")
    t0 = time.perf_counter()
    if layer is not None:
        scale = torch.rand(T, generator=g, device="cuda")
        with torch.no_grad():
            out = layer(x, ids, w, shared=(sg, su, sd, scale))
    else:
        out = mokgen.experts_forward(x, ids, w, wg, wu, wd, spec=spec)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    ref = reference.experts_forward(x, ids, w, wg, wu, wd, clamp_limit=spec.activation.clamp_limit).float()
    if layer is not None:
        ref = ref + scale[:, None] * reference.shared_expert_forward(x, sg, su, sd).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    what = " (with the shared expert)" if layer is not None else ""
    print(f"{name} T={T}{what}: first forward (with build/load) {t1 - t0:.1f} s, rel err {err:.2e}", flush=True)
