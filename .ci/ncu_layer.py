"""One workload's forward megakernel, three launches, for a profiler (runs on an H200, not in CI):
the plan's defaults (no tuned entry), the bench's uniform routing. Usage, e.g. DRAM and L2 bytes
of the third launch (docs/perf-notes.md v0.17):
  ncu --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct -k regex:ep_forward \
      --launch-skip 2 --launch-count 1 python3 .ci/ncu_layer.py qwen3.5-35b-a3b layer
(WORKLOAD: layer = the whole layer at T = 16384, local = one EP8 rank's stand-in.) CTA-pair
builds failed under ncu in v0.17 (an illegal instruction in the profiled launch)."""
import sys, torch
from mokgen import bench, load_spec
name, kind = sys.argv[1], sys.argv[2]
spec = load_spec(name); rows = 16384
if kind == "local":
    spec, rows = bench.local_spec(spec, 8)
from mokgen.ep import MoELayer
gen = torch.Generator(device="cuda").manual_seed(11)
layer = MoELayer(spec, None, max_tokens=rows, tuned=False)
x = torch.randn(rows, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
ids, w = bench._routing(spec, rows, gen)
layer.check_ids = False
with torch.no_grad():
    for _ in range(3):
        layer(x, ids, w)
torch.cuda.synchronize()
print("ok")
