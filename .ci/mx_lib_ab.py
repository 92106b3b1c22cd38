"""The tree's MXFP8 library (templates/mx_gemm.cu) against another build of it, in one process
(runs on an H200, not in CI; docs/perf-notes.md v0.41): A = OLD (a libmxgemm.so built from another
tree, e.g. main's: `PYTHONPATH=<tree> MOKGEN_CACHE_DIR=<dir> python3 -c "from mokgen import mx_gemm;
print(mx_gemm.build_library())"`), B = this tree's build. The same Python wrappers drive both (the
entries' signatures must match). On the bench's local workload of each named spec:
  combine    mx_gemm.combine_backward (dy, its codes along H, d w) on the padded rows
  swiglu     mx_gemm.swiglu_backward (dg, du, h, [dg | du]'s codes)
  swiglu_q   mx_gemm.swiglu_quantize (the forward's h codes and scales from [g | u])
  wgrad      one weight gradient's k-ranged GEMM (dW_down's shape: A dy's codes along the rows, B h's
             bf16 values, each expert's padded rows its k range, bf16 out)
  columns    the weights' quantizers by columns (down^T, [gate; up]^T) under MOKGEN_MX_QUANT=v2
  step       the staged MXFP8 training step (experts_forward_train fwd+bwd, the fused stages)
Each case: A's and B's outputs compared (bit for bit, or the relative Frobenius difference where
the order of a sum changed), then ABBA blocks of 5 timed calls (median per block), the mean of
B / A with its min and max, and GB/s of the kernels' own bytes. With --once, each case's call
once under A then once under B and nothing timed (for a profiler: ncu -k regex:NAME).
Usage: python3 .ci/mx_lib_ab.py --old PATH [--cases combine,swiglu,swiglu_q,wgrad,columns,step] [--once] [SPEC ...]"""
import argparse
import ctypes
import os

import torch
from mx_ab import abba, staged_step

from mokgen import bench, load_spec, mx_gemm

BLOCKS = 8


def key():
    return tuple(os.environ.get(k) for k in ("MOKGEN_CACHE_DIR", "XDG_CACHE_HOME", "HOME"))


def problems(name: str, wanted) -> dict:
    """case -> (fn, bytes moved by the kernels, output names whose sums may be reordered); the
    wgrad and step cases' operands are built only where wanted"""
    spec, gen, counts, _, _ = bench.local_expert_rows(name, bench.LOCAL_EP.get(name, 8))
    tokens = bench.local_spec(load_spec(name), bench.LOCAL_EP.get(name, 8))[1]
    T, k, H, I = tokens, spec.top_k, spec.hidden_size, spec.moe_intermediate_size
    padded = (counts + 127) // 128 * 128  # each expert's rows padded, as mx_experts lays them out
    rows = int(padded.sum())
    dev = "cuda"
    at = torch.randperm(rows, generator=gen, device=dev)[: T * k].sort().values
    pair = torch.full((rows,), -1, dtype=torch.int32, device=dev)
    pair[at] = torch.randperm(T * k, generator=gen, device=dev).to(torch.int32)
    d_out = torch.randn(T, H, generator=gen, device=dev).to(torch.bfloat16)
    y = torch.randn(rows, H, generator=gen, device=dev)
    w = torch.rand(T, k, generator=gen, device=dev)
    gu = torch.randn(rows, 2 * I, generator=gen, device=dev) * 3
    dh = torch.randn(rows, I, generator=gen, device=dev)
    clamp = spec.activation.clamp_limit
    wg, wu, wd = bench._weights(spec)
    cases = {
        "combine": (lambda: mx_gemm.combine_backward(d_out, y, pair, w),
                    2 * T * H + 4 * rows * H * 2 + rows * H + rows * H // 32 + 4 * rows, {3}),
        "swiglu": (lambda: mx_gemm.swiglu_backward(gu, dh, clamp),
                   4 * rows * I * 3 + 4 * rows * I * 3 + rows * 2 * I + rows * 2 * I // 32, set()),
        "swiglu_q": (lambda: mx_gemm.swiglu_quantize(gu, clamp),
                     rows * 2 * I * 4 + rows * I + rows * I // 32, set()),
        "columns": (lambda: (mx_gemm.expert_weights([wd], transpose=True),
                             mx_gemm.expert_weights([wg, wu], transpose=True)),
                    2 * 2 * (wg.numel() + wu.numel() + wd.numel()), set()),
    }
    if "wgrad" in wanted:
        kr = torch.stack([torch.cumsum(padded, 0) - padded, padded], 1).to(torch.int32).to(dev)
        wa, wab = mx_gemm.quantize_cols_blocked(y)
        wb = mx_gemm.cols_bf16_math(dh)
        cases["wgrad"] = (lambda: mx_gemm.mx_bf16_math_ranged_gemm(wa, wab, wb, kr, out_dtype=torch.bfloat16),
                          len(counts) * H * I * 2 + H * rows + I * rows * 2, set())
    if "step" in wanted:
        cases["step"] = (staged_step(name)[1], 0, {0, 1, 2, 3, 4})
    return spec, cases


def flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in flat(o)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--cases", default="combine,swiglu,columns,step")
    ap.add_argument("--once", action="store_true")
    ap.add_argument("specs", nargs="*", default=["kimi-k2.5"])
    args = ap.parse_args()
    os.environ["MOKGEN_MX_QUANT"] = "v2"
    libs = {"A": mx_gemm.bind_library(ctypes.CDLL(os.path.abspath(args.old))), "B": mx_gemm.load_library()}

    def use(side):
        mx_gemm._by_env[key()] = libs[side]

    for name in args.specs:
        wanted = args.cases.split(",")
        spec, cases = problems(name, wanted)
        for case in wanted:
            fn, nbytes, reordered = cases[case]
            outs = {}
            for side in ("A", "B", "B"):
                use(side)
                got = [t.clone() for t in flat(fn())]
                torch.cuda.synchronize()
                if side in outs and not args.once:
                    same = all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(got, outs[side]))
                    print(f"{spec.name} {case}: B twice, the same bits: {same}", flush=True)
                outs[side] = got
            if args.once:
                continue
            parts = []
            for i, (a, b) in enumerate(zip(outs["A"], outs["B"])):
                if i in reordered:
                    d = ((b.double() - a.double()).norm() / a.double().norm().clamp_min(1e-300)).item()
                    parts.append(f"{i}: {d:.2e}")
                else:
                    parts.append(f"{i}: {'same' if torch.equal(a.view(torch.uint8), b.view(torch.uint8)) else 'DIFFER'}")
            print(f"{spec.name} {case}: B against A, per output: {', '.join(parts)}", flush=True)
            del outs
            a, b, mean, lo, hi = abba(fn, use, "A", "B", BLOCKS)
            rate = f" ({nbytes / a / 1e6:.0f} -> {nbytes / b / 1e6:.0f} GB/s)" if nbytes else ""
            print(f"{spec.name} {case}: A {a:.3f} ms, B {b:.3f} ms{rate}, B / A {mean:.4f} "
                  f"[{lo:.4f}, {hi:.4f}] over {BLOCKS} blocks", flush=True)
    use("B")


if __name__ == "__main__":
    main()
