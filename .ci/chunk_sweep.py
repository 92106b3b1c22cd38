"""Overlap granularity by hand (until `mokgen tune --chunk-sweep`, issue 7): times one rank's
local work (bench workload (a)) with the megakernel over chunk_rows x ring_chunks, median of
20 CUDA-event timings each. Usage: python3 .ci/chunk_sweep.py SPEC [CHUNK ...]; the build
follows the environment (MOKGEN_CLUSTER, MOKGEN_SCHEDULE)."""

import statistics
import sys

import torch

from mokgen import bench
from mokgen.ep import MoELayer
from mokgen.spec import load_spec

spec = load_spec(sys.argv[1])
chunks = [int(c) for c in sys.argv[2:]] or [1024, 2048, 4096, 8192]
local, rows = bench.local_spec(spec, bench.LOCAL_EP.get(spec.name, 8))
wg, wu, wd = bench._weights(local)
gen = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(rows, local.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
ids, w = bench._routing(local, rows, gen)
flops = 6 * rows * local.hidden_size * local.moe_intermediate_size
for chunk in chunks:
    for ring in (2, 4):
        layer = MoELayer(local, max_tokens=rows, device="cuda", chunk_rows=chunk, ring_chunks=ring)
        with torch.no_grad():
            layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
            layer.check_ids = False
            ms = statistics.median(bench.time_cuda(lambda i: layer(x, ids, w), n_inputs=1))
        print(f"{spec.name} chunk_rows {chunk:5d} ring {ring}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        del layer
        torch.cuda.empty_cache()
