"""The backward's GEMMs one by one (mokgen/bwd_gemm.py against torch._grouped_mm), on the rows
of `mokgen bench SPEC --workload local --backward` (expert-major, the bench's routing): each
kernel's median time of 20 (CUDA events) and TFLOP/s, so changes to one kernel can be measured
alone. LIB...: other builds of the library (libbwdgemm.so files, e.g. of an earlier tree or a
variant of templates/bwd_gemm.cu): their weight gradients timed in the same run after this tree's.
BWD_BENCH_FLAGS="-DNAME ...": instead of the stagger sweep, this tree's library and a variant
build of it with those nvcc flags, every kernel, three passes in alternation; BWD_BENCH_LIB=PATH
likewise against another build of the library with this tree's entry points. Usage:
python3 .ci/bench_bwd_gemm.py [SPEC [LIB...]] (default kimi-k2.5)."""

import ctypes
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from mokgen import bench, build, bwd_gemm

spec, gen, counts, offs, rows = bench.local_expert_rows(sys.argv[1] if len(sys.argv) > 1 else "kimi-k2.5")
E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)


x, go, dg, du, hw = randn(rows, H), randn(rows, H), randn(rows, I), randn(rows, I), randn(rows, I)
wg, wu = randn(E, I, H, scale=H**-0.5), randn(E, I, H, scale=H**-0.5)
wd = randn(E, H, I, scale=I**-0.5)
order = torch.randperm(rows, generator=gen, device="cuda")
dx_out = torch.zeros(rows, H, device="cuda")
dx_bf16 = torch.zeros(rows, H, dtype=torch.bfloat16, device="cuda")


def timed(fn):
    return statistics.median(bench.time_cuda(lambda i: fn(), n_inputs=1))


gmm = torch._grouped_mm
cases = {
    "dh = dOut Wd (rows, K = H, N = I)": (2 * rows * H * I,
                                         lambda: bwd_gemm.rows_gemm([(go, wd)], offs, b_major="mn", cluster=1),
                                         lambda: gmm(go, wd, offs=offs)),
    "dh as above, cluster 2 (column-tile pairs share A)": (
        2 * rows * H * I, lambda: bwd_gemm.rows_gemm([(go, wd)], offs, b_major="mn", cluster=2),
        lambda: gmm(go, wd, offs=offs)),
    "dx = dg Wg + du Wu (rows, K = 2 I, N = H), scattered": (
        4 * rows * H * I,
        lambda: bwd_gemm.rows_gemm([(dg, wg), (du, wu)], offs, b_major="mn", out=dx_out, out_rows=order, cluster=1),
        lambda: gmm(dg, wg, offs=offs).add_(gmm(du, wu, offs=offs))),
    "dx as above, bf16 out (one slot per token: no sum_slots pass)": (
        4 * rows * H * I,
        lambda: bwd_gemm.rows_gemm([(dg, wg), (du, wu)], offs, b_major="mn", out=dx_bf16, out_rows=order, cluster=1),
        lambda: gmm(dg, wg, offs=offs).add_(gmm(du, wu, offs=offs)).to(torch.bfloat16)),
    "dx bf16 out, cluster 2 (column-tile pairs share A)": (
        4 * rows * H * I,
        lambda: bwd_gemm.rows_gemm([(dg, wg), (du, wu)], offs, b_major="mn", out=dx_bf16, out_rows=order, cluster=2),
        lambda: gmm(dg, wg, offs=offs).add_(gmm(du, wu, offs=offs)).to(torch.bfloat16)),
}
for sch in bwd_gemm.WEIGHT_SCHEDULES:  # the split 128 x 256 tiles, the ping-pong's 128 x 128
    for c in (1, 2):  # single CTAs (the default), CTA pairs sharing B
        cases[f"dWg = dg^T x (M = I, N = H, K = rows of e), {sch}, cluster {c}"] = (
            2 * rows * H * I, lambda c=c, sch=sch: bwd_gemm.weight_grads(dg, x, offs, cluster=c, schedule=sch),
            lambda: gmm(dg.t(), x, offs=offs))
        cases[f"dWd = dOut^T hw (M = H, N = I, K = rows of e), {sch}, cluster {c}"] = (
            2 * rows * H * I, lambda c=c, sch=sch: bwd_gemm.weight_grads(go, hw, offs, cluster=c, schedule=sch),
            lambda: gmm(go.t(), hw, offs=offs))
print(f"== {spec.name} local: {rows} rows, E = {E}, H = {H}, I = {I} (rows per expert {counts.min().item()}-"
      f"{counts.max().item()})")


def table(title, only=None):
    print(f"-- {title}")
    print(f"{'GEMM':78s} {'mokgen ms':>10s} {'TFLOP/s':>8s} {'torch ms':>10s} {'TFLOP/s':>8s}")
    for name, (flops, ours, torch_fn) in cases.items():
        if only is not None and not only(name):
            continue
        a, t = timed(ours), timed(torch_fn)
        print(f"{name:78s} {a:10.3f} {flops / a / 1e9:8.1f} {t:10.3f} {flops / t / 1e9:8.1f}")


variant_flags = os.environ.get("BWD_BENCH_FLAGS", "").split()
other_lib = os.environ.get("BWD_BENCH_LIB", "")
if variant_flags or other_lib:
    # this tree's library against a variant build of it (the same sources, more nvcc flags) or
    # another build with this tree's entry points (BWD_BENCH_LIB), at the default lead, three
    # times in alternation
    libs = {"this tree": bwd_gemm.load_library()}
    if variant_flags:
        variant = bwd_gemm.build_variant(variant_flags, tempfile.mkdtemp(prefix="bwd-variant-"))
        if build.serialized_wgmma(variant.parent):
            print("WARNING: the variant's wgmma are serialized")
        libs[" ".join(variant_flags)] = bwd_gemm._Lib(variant)
    if other_lib:
        libs[other_lib] = bwd_gemm._Lib(Path(other_lib))
    default_load = bwd_gemm.load_library
    for rep in (1, 2, 3):
        for label, lib in libs.items():
            bwd_gemm.load_library = lambda lib=lib: lib  # noqa: E731 (this process only)
            table(f"pass {rep}, {label}")
    bwd_gemm.load_library = default_load
else:
    # every stagger lead of the consumer warpgroups (0: lockstep), twice in alternation: the
    # spread between the two passes is the run's noise
    for rep in (1, 2):
        for lead in range(bwd_gemm.MAX_LEAD, -1, -1):
            bwd_gemm.set_stagger(lead)
            table(f"pass {rep}, consumers " + (f"staggered, lead {lead}" if lead else "in lockstep"))
    bwd_gemm.set_stagger(True)
for lib in sys.argv[2:]:
    # an earlier build (v0.8-v0.13) may lack the later entry points and has the weight
    # gradients' ABI without a schedule (split tiles only): bind and time those alone
    other = bwd_gemm._Lib(Path(lib), entries=())
    fn = other._lib.mokgen_bwd_weights
    fn.argtypes, fn.restype = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5 + [ctypes.c_void_p], ctypes.c_int
    other.weights = lambda *args, fn=fn, other=other: other.check("mokgen_bwd_weights", fn(*args[:-2], args[-1]))
    bwd_gemm.load_library = lambda: other  # noqa: E731 (this process only)
    table(f"library {lib}", only=lambda name: name.startswith("dW") and ", split," in name)
