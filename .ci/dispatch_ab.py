"""The dispatch's copy engine (copy / bulk) and CTA count, alternated rounds on one GPU (runs on
an H200, not in CI): for the qwen3.5-35b-a3b and qwen3-30b-a3b layers (T = 16384) and kimi-k2.5's
local stand-in, the plan's defaults against half the dispatch CTAs, bulk, and bulk with a half
and a quarter, timed as `mokgen tune` times a candidate (docs/perf-notes.md v0.17). Candidates
whose build spills more than the default's are timed anyway (the tuner would drop them).
Usage: python3 .ci/dispatch_ab.py [ROUNDS]"""
import dataclasses
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from mokgen import bench, load_spec, tune

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
work = []
for name, kind in (("qwen3.5-35b-a3b", "layer"), ("qwen3-30b-a3b", "layer"), ("kimi-k2.5", "local")):
    spec = load_spec(name)
    rows = 16384
    if kind == "local":
        spec, rows = bench.local_spec(spec, 8)
    base = tune.default_candidate(spec)
    d = 16 if kind == "layer" else 8
    cands = [base, dataclasses.replace(base, dispatch_ctas=d // 2),
             dataclasses.replace(base, pull_mode="bulk"), dataclasses.replace(base, pull_mode="bulk", dispatch_ctas=d // 2),
             dataclasses.replace(base, pull_mode="bulk", dispatch_ctas=d // 4)]
    work.append((name, kind, spec, rows, cands))
t0 = time.time()
with ThreadPoolExecutor(3) as pool:
    for (name, _, spec, _, cands), res in zip(work, pool.map(lambda w: tune.build_candidates(w[2], w[4], jobs=2), work)):
        print(name, "builds", res, f"{time.time() - t0:.0f} s", flush=True)
for name, kind, spec, rows, cands in work:
    timer = tune._layer_timer(spec, rows, 20)
    times = [[] for _ in cands]
    for r in range(rounds):
        for i, c in enumerate(cands):
            times[i].append(timer(c))
    for c, t in zip(cands, times):
        print(f"{name} {kind}: {c.label():70s} " + " ".join(f"{v:.3f}" for v in t) + f"  median {statistics.median(t):.3f} ms", flush=True)
