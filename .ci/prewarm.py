"""Fill the build cache in parallel before a GPU run (device time is short and cold builds run one
after another inside a bench or a test process): every bundled spec's default build and the
bench's local stand-ins (EP8, deepseek-v3 at EP64), the training example's block, the backward GEMM
library and the MX GEMM library.
It builds and loads nothing onto a GPU, so it also runs on the CPU machine: `.ci/prebuild-cache` fills
a cache there for the device runs to carry. Usage: python3 .ci/prewarm.py [JOBS]."""
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
t0 = time.perf_counter()
with ThreadPoolExecutor(jobs) as pool:
    bwd = pool.submit(bwd_gemm.build_library)
    mxg = pool.submit(mx_gemm.build_library)  # the MX GEMM library (the MX tests and the staged experts)
    for spec, res in zip(specs, pool.map(lambda s: build.build(s, publish_generated=False), specs)):
        print(f"{spec.name}: {'cached' if res.cached else 'built'} {res.seconds:.0f} s", flush=True)
    print(f"backward GEMMs: {bwd.result()}", flush=True)
    print(f"MX GEMMs: {mxg.result()}", flush=True)
print(f"prewarm: {len(specs)} builds in {time.perf_counter() - t0:.0f} s")
