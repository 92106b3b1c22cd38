"""Fill the build cache in parallel before a GPU run (device time is short and cold builds run one
after another inside a bench or a test process): every bundled spec's default build and the
bench's local stand-ins (EP8, deepseek-v3 at EP64), the training example's block, the backward GEMM
library and the MX GEMM library.
It builds and loads nothing onto a GPU, so it also runs on the CPU machine: `.ci/prebuild-cache` fills
a cache there for the device runs to carry. Usage: python3 .ci/prewarm.py [JOBS]."""
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from mokgen import bench, build, bwd_gemm, load_spec, mx_gemm
from mokgen.spec import bundled_specs

jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
specs = [load_spec(n) for n in bundled_specs()]
specs += [bench.local_spec(load_spec(n), 64 if n == "deepseek-v3" else 8)[0]
          for n in ("kimi-k2.5", "glm-5.2", "qwen3.5-397b-a17b", "deepseek-v4-pro", "deepseek-v3", "qwen3-30b-a3b",
                    "qwen3.5-35b-a3b")]
# the megakernel's MXFP8 builds (when the tree has them): the GPU tests' spec and the local benches'
from mokgen.plan import IMPLEMENTED_NUMERICS  # noqa: E402

if "mxfp8" in IMPLEMENTED_NUMERICS:
    specs += [load_spec("qwen3-30b-a3b").with_target(numerics="mxfp8")]
    specs += [bench.local_spec(load_spec(n), 64 if n == "deepseek-v3" else 8)[0].with_target(numerics="mxfp8")
              for n in ("kimi-k2.5", "glm-5.2", "qwen3.5-397b-a17b", "deepseek-v4-pro", "deepseek-v3", "qwen3-30b-a3b",
                        "qwen3.5-35b-a3b")]
# the training example's block (tests/test_gpu_block.py), in BF16 and, where built, MXFP8
tiny = load_spec("examples/tiny-moe.yaml")
specs += [tiny] + ([tiny.with_target(numerics="mxfp8")] if "mxfp8" in IMPLEMENTED_NUMERICS else [])
# (spec, build options) beyond the defaults: PREWARM_STAGGER=1 adds the forward's stagger leads 1-3 of
# the A/Bs of .ci/measure-v047 stagger (the two one-GPU layers and kimi-k2.5's stand-in, CTAs alone
# and in pairs), of tests/test_gpu_ep.py's stagger test, and lead 2 of the block's specs
variants = [(s, None) for s in specs]
if os.environ.get("PREWARM_STAGGER"):
    from mokgen import env
    from mokgen.spec import spec_from_dict

    d = load_spec("qwen3-30b-a3b").canonical_dict()
    d.update(name="i256-stagger-test", aliases=[], hidden_size=2048, moe_intermediate_size=256, num_experts=16, top_k=4)
    for spec in (load_spec("qwen3.5-35b-a3b"), load_spec("qwen3-30b-a3b"), bench.local_spec(load_spec("kimi-k2.5"), 8)[0],
                 spec_from_dict(d)):
        variants += [(spec, {**env.plan_options(), "cluster": c, "stagger": lead}) for c in (1, 2) for lead in (0, 1, 2, 3)]
    # the block's module under MOKGEN_FWD_STAGGER=2 (tests/test_gpu_block.py: its own specs, their default clusters)
    variants += [(s, {**env.plan_options(), "stagger": 2}) for s in (load_spec("qwen3.5-35b-a3b"), tiny)]
t0 = time.perf_counter()
with ThreadPoolExecutor(jobs) as pool:
    bwd = pool.submit(bwd_gemm.build_library)
    mxg = pool.submit(mx_gemm.build_library)  # the MX GEMM library (the MX tests and the staged experts)
    runs = pool.map(lambda v: build.build(v[0], publish_generated=False, options=v[1]), variants)
    for (spec, options), res in zip(variants, runs):
        extra = f" ({', '.join(f'{k} {options[k]}' for k in ('cluster', 'stagger'))})" if options else ""
        print(f"{spec.name}{extra}: {'cached' if res.cached else 'built'} {res.seconds:.0f} s", flush=True)
    print(f"backward GEMMs: {bwd.result()}", flush=True)
    print(f"MX GEMMs: {mxg.result()}", flush=True)
print(f"prewarm: {len(variants)} builds in {time.perf_counter() - t0:.0f} s")
