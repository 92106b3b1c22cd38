"""Fill the build cache in parallel before a GPU run (device time is short and cold builds run one
after another inside a bench or a test process): every bundled spec's default build and the
bench's local stand-ins (EP8, deepseek-v3 at EP64), and the backward GEMM library. Usage:
python3 .ci/prewarm.py [JOBS]."""
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from mokgen import bench, build, bwd_gemm, load_spec
from mokgen.spec import bundled_specs

jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
specs = [load_spec(n) for n in bundled_specs()]
specs += [bench.local_spec(load_spec(n), 64 if n == "deepseek-v3" else 8)[0]
          for n in ("kimi-k2.5", "glm-5.2", "qwen3.5-397b-a17b", "deepseek-v4-pro", "deepseek-v3", "qwen3-30b-a3b",
                    "qwen3.5-35b-a3b")]
t0 = time.perf_counter()
with ThreadPoolExecutor(jobs) as pool:
    bwd = pool.submit(bwd_gemm.build_library)
    for spec, res in zip(specs, pool.map(lambda s: build.build(s, publish_generated=False), specs)):
        print(f"{spec.name}: {'cached' if res.cached else 'built'} {res.seconds:.0f} s", flush=True)
    print(f"backward GEMMs: {bwd.result()}", flush=True)
print(f"prewarm: {len(specs)} builds in {time.perf_counter() - t0:.0f} s")
