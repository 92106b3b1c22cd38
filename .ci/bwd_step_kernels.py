"""Which kernels one fwd+bwd step of a local stand-in launches, and their GPU time, under each
MOKGEN_* setting given (torch.profiler; runs on an H200, not in CI). A check that a backward
switch reaches the step: e.g. MOKGEN_BWD_TAIL=zero against the default. Then where the GPU
waits for the host: the step's wall time (CUDA events), the host's time to enqueue it, and one
profiled step's kernels in order with the idle gap before each (as `mokgen bench`'s layers:
check_ids off).

Usage: python3 .ci/bwd_step_kernels.py SPEC [K=V ...]   (each K=V one setting; '-' the default)"""
import os
import sys
import time
from collections import defaultdict

import torch

from mokgen import MoELayer, bench, load_spec


def main() -> None:
    name, settings = sys.argv[1], sys.argv[2:] or ["-"]
    real = load_spec(name)
    spec, rows = bench.local_spec(real, bench.LOCAL_EP.get(real.name, 8))
    layer = MoELayer(spec, max_tokens=rows, tuned=False)
    layer.check_ids = False
    wg, wu, wd = bench._weights(spec)
    with torch.no_grad():
        layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(rows, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(True)
    ids, w = bench._routing(spec, rows, gen)
    w.requires_grad_(True)
    g = torch.randn_like(x)

    def step():
        for t in (x, w, *layer.parameters()):
            t.grad = None
        layer(x, ids, w).backward(g)

    for setting in settings:
        for k in [k for k in os.environ if k.startswith("MOKGEN_BWD_")]:
            os.environ.pop(k)
        if setting != "-":
            k, v = setting.split("=", 1)
            os.environ[k] = v
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        total = defaultdict(float)
        count = defaultdict(int)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                total[ev.name] += ev.device_time_total / 5 / 1e3
                count[ev.name] += 1
        print(f"{name} ({rows} rows) under {setting}: {sum(total.values()):.3f} ms of kernels per step", flush=True)
        for k, ms in sorted(total.items(), key=lambda kv: -kv[1])[:14]:
            print(f"  {ms:7.3f} ms  x{count[k] // 5}  {k[:120]}")
        walls, hosts = [], []
        for _ in range(10):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            step()
            end.record()
            hosts.append((time.perf_counter() - t0) * 1e3)
            end.synchronize()
            walls.append(start.elapsed_time(end))
        print(f"  step wall {sorted(walls)[5]:.3f} ms (CUDA events, median of 10); host enqueue {sorted(hosts)[5]:.3f} ms")
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda ev: ev.time_range.start)
        if kernels:
            t_first, prev = kernels[0].time_range.start, kernels[0].time_range.start
            idle = 0.0
            print("  one step's kernels (start ms from the first, gap before it in us, duration us):")
            for ev in kernels:
                gap = ev.time_range.start - prev
                idle += max(gap, 0)
                print(f"    {(ev.time_range.start - t_first) / 1e3:7.3f}  gap {gap:7.1f}  {ev.time_range.elapsed_us():8.1f}  "
                      f"{ev.name[:90]}")
                prev = max(prev, ev.time_range.end)
            print(f"  first kernel to last end {(prev - t_first) / 1e3:.3f} ms, {idle / 1e3:.3f} ms of it idle")


if __name__ == "__main__":
    main()
