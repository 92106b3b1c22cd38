"""Where a fwd+bwd step of mokgen leaves the GPU idle, on the inputs of `mokgen bench --backward`.

Prints, for one spec and workload (default policy and GEMMs from the environment):
  bench    the step as the bench times it (a start event on an idle GPU, the step, an end event; median of 20)
  gpu      the same step enqueued behind a GPU sleep, so the host is ahead: the GPU's own time
           (event after the sleep to the end event; median of 7), and the host's enqueue time
  phases   host time of the forward call and of backward() alone (host ahead, median of 7)
  stream   GPU times of the same points (CUDA events recorded on the compute stream beside the host
           marks, each completing when the work enqueued before it has run), per bench step
  kernels  one step's GPU work in order (torch.profiler, CUDA activity only): start offset,
           duration and the idle gap before each; the sum of kernel time and of gaps
  cprofile the Python functions of 10 host-ahead steps by own time and by cumulative time
HOST_GAPS_NO_WATCH=1 leaves out the forward's copy of its error record to pinned memory (an
experiment: the copy engine's operation between the forward and the backward).
Usage: python3 .ci/host_gaps.py SPEC [local|layer] [TOKENS]"""

import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mokgen import bench, bwd_gemm, env
from mokgen import ep as ep_mod

spec, tokens = bench.backward_workload(sys.argv[1], *sys.argv[2:4])
workload = sys.argv[2] if len(sys.argv) > 2 else "local"
layer, _, [(x, ids, w, g)] = bench.backward_problem(spec, tokens)
leaves = (x, w, *layer.parameters())
marks = {}
# host times of a few points inside the step (seconds after its start): around the error
# record's copy after the launch (EpBuffers.watch) and at the backward's first launch
points = {}
# the same points on the GPU: an event recorded on the compute stream at each mark
stream_events = {}


def mark_event(name):
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    stream_events[name] = e


def timed_at(name, fn):
    def run(*a, **k):
        points[name + " in"] = time.perf_counter() - marks["t0"]
        mark_event(name + " in")
        out = fn(*a, **k)
        points[name + " out"] = time.perf_counter() - marks["t0"]
        mark_event(name + " out")
        return out
    return run


if os.environ.get("HOST_GAPS_NO_WATCH"):  # an experiment: no copy of the error record after the launch
    ep_mod.EpBuffers.watch = lambda self: None
ep_mod.EpBuffers.watch = timed_at("watch", ep_mod.EpBuffers.watch)
bwd_gemm.expert_major = timed_at("expert_major", bwd_gemm.expert_major)


def step():
    for t in leaves:
        t.grad = None
    t0 = marks["t0"] = time.perf_counter()
    mark_event("start")
    y = layer(x, ids, w)
    t1 = time.perf_counter()
    mark_event("forward returned")
    y.backward(g)
    marks["fwd"], marks["bwd"] = t1 - t0, time.perf_counter() - t1
    mark_event("backward returned")


print(f"== {spec.name} {workload} {tokens} rows (MOKGEN_BWD_GEMM={env.bwd_gemm_enabled():d}, "
      f"MOKGEN_BWD_POLICY={env.bwd_policy()})")
for _ in range(3):
    step()
torch.cuda.synchronize()
bench_points, ahead_points = [], []


def step_points():
    return {**points, "forward returned": marks["fwd"], "backward returned": marks["fwd"] + marks["bwd"]}


bench_gpu_points = []


def bench_step(i):
    step()
    bench_points.append(step_points())
    bench_gpu_points.append(dict(stream_events))


bench_ms = bench.time_cuda(bench_step, n_inputs=1, warmup=0)
gpu_ms, host_ms, fwd_ms, bwd_ms = [], [], [], []
for _ in range(7):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(1e8))
    a.record()
    t0 = time.perf_counter()
    step()
    host_ms.append(1e3 * (time.perf_counter() - t0))
    fwd_ms.append(1e3 * marks["fwd"])
    bwd_ms.append(1e3 * marks["bwd"])
    ahead_points.append(step_points())
    b.record()
    b.synchronize()
    gpu_ms.append(a.elapsed_time(b))
med = statistics.median
print(f"bench    {med(bench_ms):.3f} ms (min {min(bench_ms):.3f})")
print(f"gpu      {med(gpu_ms):.3f} ms with the host ahead (min {min(gpu_ms):.3f}); host enqueue {med(host_ms):.3f} ms")
print(f"phases   forward call {med(fwd_ms):.3f} ms, backward() {med(bwd_ms):.3f} ms of host time")
print(f"exposed  {med(bench_ms) - med(gpu_ms):.3f} ms of the bench's step is the GPU waiting for the host")
print("host     ms after the step's start (median): as the bench runs it | behind a GPU sleep")
for k in bench_points[0]:
    print(f"  {k:22s} {1e3 * med(p[k] for p in bench_points):8.3f} | {1e3 * med(p[k] for p in ahead_points):8.3f}")
torch.cuda.synchronize()
gpu_at = [{k: ev["start"].elapsed_time(e) for k, e in ev.items() if k != "start"} for ev in bench_gpu_points]
names = sorted(gpu_at[0], key=lambda k: med(p[k] for p in gpu_at))
print("stream   ms after the step's start on the GPU, each bench step (events on the compute stream)")
print("  " + " ".join(f"{k[:16]:>16s}" for k in names))
for p in sorted(gpu_at, key=lambda p: p[names[-1]]):
    print("  " + " ".join(f"{p[k]:16.3f}" for k in names))

with profile(activities=[ProfilerActivity.CUDA]) as prof:
    step()
    torch.cuda.synchronize()
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e),
             key=lambda e: e["ts"])
if gpu:
    t0, end, busy, idle = gpu[0]["ts"], gpu[0]["ts"], 0.0, 0.0
    print(f"kernels  {len(gpu)} GPU operations in one step (offset, duration, gap before; us)")
    for e in gpu:
        gap = max(0.0, e["ts"] - end)
        idle += gap
        busy += e["dur"]
        print(f"  {e['ts'] - t0:9.1f} {e['dur']:9.1f} {gap:8.1f}  {e['name'][:90]}")
        end = max(end, e["ts"] + e["dur"])
    print(f"kernels  busy {busy / 1e3:.3f} ms, idle gaps {idle / 1e3:.3f} ms, first to last {(end - t0) / 1e3:.3f} ms")

prof_c = cProfile.Profile()
torch.cuda._sleep(int(8e8))
prof_c.enable()
for _ in range(10):
    step()
prof_c.disable()
torch.cuda.synchronize()
st = pstats.Stats(prof_c)
st.sort_stats("tottime").print_stats(40)
st.sort_stats("cumulative").print_stats(45)
