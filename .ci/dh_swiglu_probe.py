"""Where the dh epilogue's SwiGLU backward loses (runs on an H200, not in CI): on the
qwen3.5-35b-a3b layer's shapes at T = 16384 (uniform routing), timed interleaved by CUDA events
(median of `--iters` rounds, each round one launch of every form in turn):
  dh alone     the dh rows GEMM (bf16 out, dOut through the token index)
  two passes   those dh rows then swiglu_grads_saved: the default
  fused index  bwd_gemm.dh_swiglu_saved with dOut through the index (MOKGEN_BWD_DH_SWIGLU=1's)
  fused copy   the same from a gathered copy of dOut (TMA)
and, for the fused kernel, measuring builds of the library (bwd_gemm.build_variant, built in
parallel): -DMOKGEN_DHSW_PREFETCH (an L2 prefetch of g and u during the k-loop; off since v0.24's run), -DMOKGEN_DHSW_AHEAD=1 (the
epilogue's loads one group ahead, not two), -DMOKGEN_DHSW_NO_LOADS (no g, u loads: wrong
results, the epilogue's cost without its gathered reads), -DMOKGEN_SWIGLU_FAST_RCP (SwiGLU's
backward with __fdividef for the sigmoid, no IEEE slow-path call: other bits; timed fused and as
the two passes).
Usage: python3 .ci/dh_swiglu_probe.py [--iters 20] [--no-variants]"""

import argparse
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mokgen import bench, bwd_gemm

ap = argparse.ArgumentParser()
ap.add_argument("--iters", type=int, default=20)
ap.add_argument("--no-variants", action="store_true")
args = ap.parse_args()
VARIANTS = [] if args.no_variants else [["-DMOKGEN_DHSW_PREFETCH"], ["-DMOKGEN_DHSW_AHEAD=1"],
                                         ["-DMOKGEN_DHSW_NO_LOADS"], ["-DMOKGEN_SWIGLU_FAST_RCP"]]
tmp = Path(tempfile.mkdtemp())
with ThreadPoolExecutor(4) as pool:
    libs = list(pool.map(lambda fv: bwd_gemm._Lib(bwd_gemm.build_variant(fv[1], tmp / f"v{fv[0]}")),
                         enumerate(VARIANTS)))
main_lib = bwd_gemm.load_library()
T, K, E, H, I = 16384, 8, 256, 2048, 512
gen = torch.Generator(device="cuda").manual_seed(0)
ids = torch.stack([torch.randperm(E, generator=gen, device="cuda")[:K] for _ in range(T)]).to(torch.int32)
wts = torch.rand(T, K, device="cuda")
order, tok, offs, wt = bwd_gemm.expert_major(ids.contiguous(), E, wts)
dout = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
copy = dout.index_select(0, tok).contiguous()
gu = torch.randn(T * K, 2 * I, generator=gen, device="cuda").to(torch.bfloat16)
wd = (torch.randn(E, H, I, generator=gen, device="cuda") * H**-0.5).to(torch.bfloat16)


def on(lib, f):
    def run():
        bwd_gemm.load_library = lambda: lib
        try:
            return f()
        finally:
            bwd_gemm.load_library = lambda: main_lib
    return run


def two_passes():
    dh = bwd_gemm.rows_gemm([(dout, wd)], offs, out_dtype=torch.bfloat16, a_index=tok)
    return bwd_gemm.swiglu_grads_saved(gu, order, dh, wt, offs)


forms = {
    "dh alone": on(main_lib, lambda: bwd_gemm.rows_gemm([(dout, wd)], offs, out_dtype=torch.bfloat16, a_index=tok)),
    "two passes": on(main_lib, two_passes),
    "fused index": on(main_lib, lambda: bwd_gemm.dh_swiglu_saved(dout, wd, gu, order, wt, offs, a_index=tok)),
    "fused copy": on(main_lib, lambda: bwd_gemm.dh_swiglu_saved(copy, wd, gu, order, wt, offs)),
}
for flags, lib in zip(VARIANTS, libs):
    forms[f"fused index {' '.join(flags)}"] = on(lib, lambda: bwd_gemm.dh_swiglu_saved(dout, wd, gu, order, wt, offs,
                                                                                         a_index=tok))
    if "-DMOKGEN_SWIGLU_FAST_RCP" in flags:
        forms["two passes -DMOKGEN_SWIGLU_FAST_RCP"] = on(lib, two_passes)
ref = forms["fused index"]()
assert all(torch.equal(a, b) for a, b in zip(ref, forms["fused copy"]())), "index and copy differ"
for f in forms.values():
    f()
torch.cuda.synchronize()
times = {k: [] for k in forms}
for _ in range(args.iters):
    for k, f in forms.items():
        times[k].append(bench.time_launch(f))
for k, v in times.items():
    print(f"{k:44s} {statistics.median(v):.3f} ms (median of {len(v)})")
for k in [k for k in forms if "FAST_RCP" in k]:
    base = forms["two passes" if k.startswith("two passes") else "fused index"]()
    for i, (a, b) in enumerate(zip(forms[k](), base)):
        a, b = a.float(), b.float()
        print(f"{k}: output {i} max |diff| {(a - b).abs().max().item():.3e}, relative Frobenius "
              f"{((a - b).norm() / b.norm().clamp_min(1e-30)).item():.3e}, bitwise equal fraction "
              f"{(a == b).float().mean().item():.4f}")
