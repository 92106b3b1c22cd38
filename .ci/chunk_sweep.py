"""Overlap granularity and the dispatch / compute split by hand (until `mokgen tune`, issue 7):
times the megakernel on one GPU over chunk_rows x ring_chunks x dispatch CTAs, median of 20
CUDA-event timings each. Workloads as `mokgen bench`: `local` (one rank's work after dispatch,
the default) or `layer` (the whole layer, --tokens T). The build follows the environment
(MOKGEN_CLUSTER, MOKGEN_SCHEDULE).

  python3 .ci/chunk_sweep.py SPEC [--workload local|layer] [--tokens T] [--chunks 1024 2048 ...]
                                  [--rings 2 4] [--dispatch 4 8 16 ...]
"""

import argparse
import statistics

import torch

from mokgen import bench
from mokgen.ep import MoELayer
from mokgen.plan import ep_defaults
from mokgen.spec import load_spec

ap = argparse.ArgumentParser()
ap.add_argument("spec")
ap.add_argument("--workload", choices=("local", "layer"), default="local")
ap.add_argument("--tokens", type=int, default=16384, help="layer: tokens")
ap.add_argument("--chunks", type=int, nargs="*", default=None, help="default: the plan's chunk_rows")
ap.add_argument("--rings", type=int, nargs="*", default=None, help="default: the plan's ring_chunks")
ap.add_argument("--dispatch", type=int, nargs="*", default=[None], help="dispatch CTAs (default: the layer's)")
args = ap.parse_args()

spec = load_spec(args.spec)
if args.workload == "local":
    spec, rows = bench.local_spec(spec, bench.LOCAL_EP.get(spec.name, 8))
    tokens = rows
else:
    tokens = args.tokens
defaults = ep_defaults(spec)
wg, wu, wd = bench._weights(spec)
gen = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(tokens, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
ids, w = bench._routing(spec, tokens, gen)
flops = bench.routed_flops(spec, tokens)
for chunk in args.chunks or [defaults["chunk_rows"]]:
    for ring in args.rings or [defaults["ring_chunks"]]:
        for dispatch in args.dispatch:
            layer = MoELayer(spec, max_tokens=tokens, device="cuda", chunk_rows=chunk, ring_chunks=ring,
                             dispatch_ctas=dispatch)
            with torch.no_grad():
                layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
                layer.check_ids = False
                ms = statistics.median(bench.time_cuda(lambda i: layer(x, ids, w), n_inputs=1))
            print(f"{args.spec} {args.workload} chunk_rows {chunk:5d} ring {ring} dispatch {layer.dispatch_ctas:3d} "
                  f"of {layer._ctas}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            layer = None  # the timing lambda closes over the name
            torch.cuda.empty_cache()
