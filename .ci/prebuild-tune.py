"""Build the candidates of `.ci/gpu-tune local layer` into the build cache on the CPU machine, so a
device call's `mokgen tune` finds them, with the second pass's stagger leads of the k-block-64
builds (the tuner builds each candidate's options through the same cache; entries are keyed by
sources, plan, nvcc, CUTLASS and flags, not by the GPU). No GPU needed.
`.ci/prebuild-cache` runs it when PREBUILD_TUNE=1. Usage: python3 .ci/prebuild-tune.py [JOBS]"""
import sys
import time

from mokgen import tune
from mokgen.spec import load_spec

jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 2
# (spec, EP, tokens per rank) as .ci/gpu-tune's local and layer steps
TARGETS = [(n, 8, 2048) for n in ("kimi-k2.5", "glm-5.2", "qwen3.5-397b-a17b", "deepseek-v4-pro")]
TARGETS += [("deepseek-v3", 64, 2048), ("qwen3-30b-a3b", 1, 16384), ("qwen3.5-35b-a3b", 1, 16384)]
t0 = time.perf_counter()
for name, ep, tokens in TARGETS:
    spec = load_spec(name)
    work, rows = tune._workload(spec, ep, tokens, False)
    local = ep > 1
    space = tune.search_space(work, ep=1 if local else ep, tokens=rows if local else tokens)
    # the second pass's builds: the first-pass builds with k-blocks of 64 (every shipped winner's,
    # v0.47) at the other stagger leads; the winner is not known here, and all builds' variants
    # would take the carried cache past its 64 MiB with the wheels
    builds = {c.build_key(): c for c in space.candidates if c.block_k == 64}
    more = [v for c in builds.values() for v in tune.stagger_variants(work, c)[0]]
    out = tune.build_candidates(work, space.candidates + more, jobs=jobs)
    bad = {k: v for k, v in out.items() if v is not None}
    print(f"{name} EP{ep}: {len(out)} builds, {len(bad)} unusable {bad if bad else ''}", flush=True)
print(f"prebuild-tune: {time.perf_counter() - t0:.0f} s")
