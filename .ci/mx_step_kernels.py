"""Where one fwd+bwd step of the MXFP8 megakernel layer spends its GPU time (torch.profiler; runs
on a GPU, not in CI): the bench's local stand-in (mokgen bench --workload local --backward
--numerics mxfp8's MXFP8 megakernel row: a MoELayer of the MXFP8 spec holding the bench's weights,
id checks off, the weights' MX conversions forgotten before every step as a training step's new
weights are), under the backward policy given, kernels summed by name, largest first, and the
step's wall time (CUDA events, median of 10), then every launch of 50 us or more in the order it
ran (which GEMM is which: dh, dx and the weight gradients share kernel names). `--weights kept`: the conversions kept between steps
(the micro-batches of one optimizer step: the weights unchanged). MOKGEN_MX_WEIGHTS (both or apart)
is read as the layer reads it.

Usage: python3 .ci/mx_step_kernels.py SPEC [save|recompute] [--weights new|kept] [--top N]"""
import argparse
from collections import defaultdict

import torch

from mokgen import bench, env, load_spec
from mokgen.ep import MoELayer, refresh_mx_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("policy", nargs="?", default="save", choices=("save", "recompute"))
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--weights", default="new", choices=("new", "kept"))
    args = ap.parse_args()
    real = load_spec(args.spec)
    spec, rows = bench.local_spec(real, bench.LOCAL_EP.get(real.name, 8))
    layer = MoELayer(spec.with_target(numerics="mxfp8"), max_tokens=rows, device="cuda", bwd_policy=args.policy)
    layer.check_ids = False
    with torch.no_grad():
        for p, v in zip((layer.w_gate, layer.w_up, layer.w_down), bench._weights(spec)):
            p.copy_(v)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(rows, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(True)
    ids = torch.rand(rows, spec.num_experts, generator=gen, device="cuda").topk(spec.top_k, -1).indices.to(torch.int32)
    w = torch.rand(rows, spec.top_k, generator=gen, device="cuda").requires_grad_(True)
    d_out = torch.randn(rows, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    params = tuple(layer.parameters())

    def step():
        for t in (x, w, *params):
            t.grad = None
        if args.weights == "new":
            refresh_mx_weights()
        layer(x, ids, w).backward(d_out)

    for _ in range(3):
        step()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    print(f"{spec.name} mxfp8 {args.policy} (weights {args.weights}, MOKGEN_MX_WEIGHTS={env.mx_weights()}): step {times[len(times) // 2]:.3f} ms (median of 10; min {times[0]:.3f})")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    order = []  # every launch of 50 us or more, in the order it ran (which GEMM is which)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            key = ev.name[:90]
            total[key] += ev.device_time_total / 1000.0
            count[key] += 1
            if ev.device_time_total >= 50:
                order.append((ev.time_range.start, ev.device_time_total / 1000.0, key))
    all_ms = sum(total.values())
    print(f"kernels' GPU time {all_ms:.3f} ms in {sum(count.values())} launches")
    for key, ms in sorted(total.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{ms:8.3f} ms {100 * ms / all_ms:5.1f}%  x{count[key]:<3d} {key}")
    print("launches of 50 us or more, in order:")
    for _, ms, key in sorted(order):
        print(f"{ms:8.3f} ms  {key}")


if __name__ == "__main__":
    main()
