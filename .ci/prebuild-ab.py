"""Adds the builds of .ci/ab_variants.py A/Bs to a build cache on the CPU machine, so that a device
call does not compile them: each side's library for each workload, as ab_variants builds it
(its plan options and define= flags). Run with MOKGEN_CACHE_DIR set to the cache to fill (as
.ci/prebuild-cache's PREBUILD_AB does). Usage: python3 .ci/prebuild-ab.py [--numerics mxfp8]
WORKLOAD[,WORKLOAD...] VARIANT [VARIANT ...]  (VARIANT: ab_variants' --a / --b text; '' the defaults)"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_variants import build_side, parse_variant, workload  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("workloads")
ap.add_argument("variants", nargs="+")
ap.add_argument("--numerics", choices=("bf16", "mxfp8"), default=None)
args = ap.parse_args()
specs = [workload(w, args.numerics)[1] for w in args.workloads.split(",")]
for text in args.variants:
    for spec, res in zip(specs, build_side(parse_variant(text)[0], specs, jobs=2)):
        print(f"{spec.name} [{text or 'defaults'}]: {'cached' if res.cached else 'built'} {res.seconds:.0f} s", flush=True)
