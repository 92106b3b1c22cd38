"""The SM clock and power during back-to-back work (runs on an H200, not in CI).

Times RUNS (default 150) back-to-back runs of one workload the way the bench does (a start event, the work, an
end event, a sync) while `nvidia-smi` samples the SM clock, power, temperature and the active
clock-event reasons every 25 ms into CSV (0x4: software power cap). Workloads:
  fwdbwd   kimi-k2.5's local fwd+bwd, as `mokgen bench --backward` (the default)
  forward  kimi-k2.5's local forward (the megakernel, its tuned entry where one fits)
  ceiling  the bench's dense bf16 ceiling: one 8192^3 matmul (cuBLAS)
Prints the runs' median, min, max and the first and last ten, and the median SM clock and power
of the samples taken while they ran (does the megakernel hold the clock the dense GEMM holds
under the same cap?).
150 dense ceiling runs take 0.24 s, too short for the cap to act (v0.17: 1980 MHz, 148 W against
the forward's 1500 MHz, 287 W over 0.5 s); give the ceiling about 1500 runs to compare.
Usage: python3 .ci/clock_probe.py OUT.csv [fwdbwd|forward|ceiling] [RUNS]"""
import datetime
import statistics
import subprocess
import sys
import time

WORKLOADS = ("fwdbwd", "forward", "ceiling")


def window_medians(lines: list[str], t0: float, t1: float) -> tuple[float, float, int]:
    """(median SM clock MHz, median power W, samples) of the nvidia-smi CSV lines stamped within
    [t0, t1] (seconds since the epoch, local time as nvidia-smi stamps)."""
    clocks, power = [], []
    for line in lines:
        f = [v.strip() for v in line.split(",")]
        if len(f) < 3:
            continue
        try:
            ts = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            mhz, watts = float(f[1].split()[0]), float(f[2].split()[0])
        except ValueError:
            continue
        if t0 <= ts <= t1:
            clocks.append(mhz)
            power.append(watts)
    if not clocks:
        return float("nan"), float("nan"), 0
    return statistics.median(clocks), statistics.median(power), len(clocks)


def main() -> None:
    if (len(sys.argv) < 2 or (len(sys.argv) > 2 and sys.argv[2] not in WORKLOADS)
            or (len(sys.argv) > 3 and not sys.argv[3].isdigit())):
        sys.exit(f"usage: python3 .ci/clock_probe.py OUT.csv [{'|'.join(WORKLOADS)}] [RUNS]")
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 150
    if runs < 10:
        sys.exit(f"RUNS must be at least 10, got {runs}")
    import torch

    from mokgen import bench

    workload = sys.argv[2] if len(sys.argv) > 2 else "fwdbwd"
    if workload == "ceiling":
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

        def step(i):
            a @ b
    else:
        spec, tokens = bench.backward_workload("kimi-k2.5", "local")
        layer, _, [(x, ids, w, g)] = bench.backward_problem(spec, tokens)
        leaves = (x, w, *layer.parameters())
        if workload == "forward":
            def step(i):
                with torch.no_grad():
                    layer(x, ids, w)
        else:
            def step(i):
                for t in leaves:
                    t.grad = None
                layer(x, ids, w).backward(g)

    bench.time_cuda(step, n_inputs=1, iters=5)
    out = open(sys.argv[1], "w")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,"
                            "clocks_event_reasons.active", "--format=csv,noheader", "-lms", "25"], stdout=out)
    time.sleep(0.5)
    t0 = time.time()
    ms = bench.time_cuda(step, n_inputs=1, warmup=0, iters=runs)
    t1 = time.time()
    time.sleep(0.3)
    smi.terminate()
    smi.wait()
    out.close()
    print(f"{runs} {workload} runs: median {statistics.median(ms):.3f} min {min(ms):.3f} max {max(ms):.3f} ms; "
          f"first 10 {[round(v, 2) for v in ms[:10]]}; last 10 {[round(v, 2) for v in ms[-10:]]}")
    if workload == "ceiling":
        print(f"dense ceiling: {2 * 8192**3 / statistics.median(ms) / 1e9:.0f} TFLOP/s (median run)")
    mhz, watts, n = window_medians(open(sys.argv[1]).read().splitlines(), t0, t1)
    print(f"while they ran: SM clock {mhz:.0f} MHz, power {watts:.0f} W (medians of {n} samples); wall {t1 - t0:.2f} s")


if __name__ == "__main__":
    main()
