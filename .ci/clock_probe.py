"""The SM clock and power during back-to-back fwd+bwd steps (runs on an H200, not in CI).

Times 150 steps of kimi-k2.5's local fwd+bwd the way `mokgen bench --backward` does (a start
event on an idle GPU, the step, an end event, a sync) while `nvidia-smi` samples the SM clock,
power, temperature and the active clock-event reasons every 25 ms into CSV (0x4: software
power cap). Prints the steps' median, min, max and the first and last ten.
Usage: python3 .ci/clock_probe.py OUT.csv"""
import statistics
import subprocess
import sys
import time

from mokgen import bench

spec, tokens = bench.backward_workload("kimi-k2.5", "local")
layer, _, [(x, ids, w, g)] = bench.backward_problem(spec, tokens)
leaves = (x, w, *layer.parameters())


def step(i):
    for t in leaves:
        t.grad = None
    layer(x, ids, w).backward(g)


bench.time_cuda(step, n_inputs=1, iters=5)
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active",
                        "--format=csv,noheader", "-lms", "25"], stdout=open(sys.argv[1], "w"))
time.sleep(0.5)
t0 = time.time()
ms = bench.time_cuda(step, n_inputs=1, warmup=0, iters=150)
t1 = time.time()
time.sleep(0.3)
smi.terminate()
print(f"150 bench steps: median {statistics.median(ms):.3f} min {min(ms):.3f} max {max(ms):.3f} ms; first 10 {[round(v, 2) for v in ms[:10]]}; last 10 {[round(v, 2) for v in ms[-10:]]}")
print(f"wall {t1 - t0:.2f} s")
