"""One rank's local expert work (bench workload (a)) as a standalone program for Nsight Compute:
a few warm-up launches of the megakernel, then the launches ncu captures.
Usage: python3 .ci/profile_local.py SPEC [EP]   (run under `ncu ... --launch-skip N`)."""

import sys

import torch

from mokgen import bench
from mokgen.ep import MoELayer
from mokgen.spec import load_spec

spec = load_spec(sys.argv[1])
ep = int(sys.argv[2]) if len(sys.argv) > 2 else bench.LOCAL_EP.get(spec.name, 8)
local, rows = bench.local_spec(spec, ep)
wg, wu, wd = bench._weights(local)
gen = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(rows, local.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
ids, w = bench._routing(local, rows, gen)
layer = MoELayer(local, max_tokens=rows, device="cuda")
with torch.no_grad():
    layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
    layer.check_ids = False
    for _ in range(4):
        layer(x, ids, w)
torch.cuda.synchronize()
print(spec.name, "local EP", ep, "rows", rows, "stats", layer.stats())
