"""One workload's forward megakernel, four launches, for a profiler (runs on an H200, not in CI):
the plan's defaults (no tuned entry), run as `mokgen tune` times a candidate (the bench's weights
and uniform routing). Usage, e.g. DRAM and L2 bytes of the third launch (docs/perf-notes.md v0.17):
  ncu --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct -k regex:ep_forward \
      --launch-skip 2 --launch-count 1 python3 .ci/ncu_layer.py qwen3.5-35b-a3b layer
(WORKLOAD: layer = the whole layer at T = 16384, local = one EP8 rank's stand-in.) CTA-pair
builds failed under ncu in v0.17 (an illegal instruction in the profiled launch) and again in
v0.48 (a grid of 0 x 0 x 0, every metric nan): profile single CTAs, MOKGEN_CLUSTER=1 (v0.48's
figures: docs/perf-notes.md)."""
import sys

from mokgen import bench, load_spec, tune

name, kind = sys.argv[1], sys.argv[2]
spec, rows = load_spec(name), 16384
if kind == "local":
    spec, rows = bench.local_spec(spec, 8)
# the tuner's timer of one candidate (the bench's weights and inputs): the defaults' reference launch
# (v0.47), 3 warm-up launches, 1 timed, then its bit check: --launch-skip 2 still profiles a warm launch
tune._layer_timer(spec, rows, 1)(tune.default_candidate(spec))
print("ok")
