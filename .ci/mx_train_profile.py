"""Where an MXFP8 training step's time goes (runs on an H200, not in CI; docs/perf-notes.md v0.39):
the staged MXFP8 experts' forward + backward (mokgen.mx_experts.experts_forward_train) on the
bench's local workload of each named spec, under torch.profiler after two warm-up steps. Prints
the step's GPU time and the kernels by total GPU time (name, calls, total ms, share), and the
same for the MXFP8 megakernel layer under autograd (its backward recomputes the staged forward).
v0.37 measured kimi-k2.5's step at 27.2 ms, of which 6.8 ms went to the weights' quantizations;
this says where the other 20 go. With --launches, also each MX GEMM launch of the step in the
order it ran, with its GPU time (v0.41: which of the step's GEMMs is slow, by launch).
Usage: python3 .ci/mx_train_profile.py [--launches] [SPEC ...] (default kimi-k2.5)."""
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from mx_ab import staged_step

from mokgen.ep import MoELayer, refresh_mx_weights

TOP = 25
SWITCHES = ("MOKGEN_MX_QUANT", "MOKGEN_MX_BWD_STAGES", "MOKGEN_MX_RANGED")
#: kernel name patterns -> the step's parts (the first match wins)
KINDS = (
    ("MX megakernel", ("ep_forward", "moe_forward", "megakernel")),
    ("weight quantizers", ("weight_rows", "weight_cols", "gather_cols")),
    ("MX GEMMs", ("gemm_kernel", "ranged_kernel", "mx_gemm")),
    ("mokgen row kernels", ("quantize_", "swiglu_", "combine", "segments")),
    ("PyTorch copies and fills", ("copy", "Copy", "fill", "Memcpy", "Memset")),
)


def kind(name: str) -> str:
    for label, patterns in KINDS:
        if any(p in name for p in patterns):
            return label
    return "PyTorch other"


def kernel_table(step, label: str) -> None:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals, calls = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name] += ev.device_time_total / 1e3  # us -> ms
            calls[ev.name] += 1
    total = sum(totals.values())
    switches = ", ".join(f"{k}={os.environ.get(k, 'default')}" for k in SWITCHES)
    print(f"{label}: {total:.3f} ms of GPU time in {sum(calls.values())} kernels and copies ({switches})", flush=True)
    by_kind = defaultdict(float)
    for name, ms in totals.items():
        by_kind[kind(name)] += ms
    print("  by kind: " + ", ".join(f"{k} {ms:.3f} ms ({100 * ms / total:.0f}%)"
                                    for k, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])), flush=True)
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:TOP]:
        print(f"  {ms:8.3f} ms {100 * ms / total:5.1f}% x{calls[name]:<4d} {name[:150]}")
    if LAUNCHES:
        gemms = sorted((ev.time_range.start, ev.device_time_total / 1e3, ev.name) for ev in prof.events()
                       if ev.device_type == torch.autograd.DeviceType.CUDA and kind(ev.name) == "MX GEMMs")
        print(f"  the MX GEMM launches in the order they ran ({len(gemms)}):")
        for i, (_, ms, name) in enumerate(gemms):
            print(f"    {i:2d} {ms:8.3f} ms {name[:120]}")


LAUNCHES = "--launches" in sys.argv[1:]
for name in [a for a in sys.argv[1:] if a != "--launches"] or ["kimi-k2.5"]:
    spec, staged, (x, ids, w, d_out, wg, wu, wd) = staged_step(name)
    tokens = x.shape[0]
    kernel_table(staged, f"{spec.name} staged MXFP8 fwd+bwd")
    mx_layer = MoELayer(spec.with_target(numerics="mxfp8"), max_tokens=tokens, device="cuda")
    with torch.no_grad():
        mx_layer.w_gate.copy_(wg), mx_layer.w_up.copy_(wu), mx_layer.w_down.copy_(wd)
    mx_layer.check_ids = False

    def mega():
        for t in (x, w, *mx_layer.parameters()):
            t.grad = None
        refresh_mx_weights()  # new weights each step, as after an optimizer step: converted again
        mx_layer(x, ids, w).backward(d_out)

    kernel_table(mega, f"{spec.name} MXFP8 megakernel layer fwd+bwd")
    mx_layer = None  # its weights and buffers go before the next spec
    torch.cuda.empty_cache()
