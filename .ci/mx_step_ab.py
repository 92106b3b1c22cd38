"""An A/B of one switch on the staged MXFP8 training step (runs on an H200, not in CI;
docs/perf-notes.md v0.40): mokgen.mx_experts.experts_forward_train's fwd+bwd on the bench's local
workload of each named spec, under SWITCH=A and SWITCH=B. First each value's gradients once,
against each other (relative Frobenius difference per gradient), and B's bits twice. Then ABBA
blocks of 5 timed steps each (median per block), the mean of B / A over the blocks with its min
and max. With --wgrad, also the step's three weight-gradient launches alone (the k-ranged GEMM on
the step's own segments), A against B likewise.
Usage: python3 .ci/mx_step_ab.py [--switch NAME A B] [--wgrad] [SPEC ...]
(default: MOKGEN_MX_BWD_STAGES torch fused, kimi-k2.5). v0.40's: MOKGEN_MX_BWD_STAGES torch fused;
MOKGEN_MX_RANGED tiles persistent --wgrad; v0.43's: MOKGEN_MX_WEIGHTS apart both. Each side's peak
memory over one step is printed before the timing."""
import argparse
import os

import torch
from mx_ab import abba, staged_step

from mokgen import mx_experts, mx_gemm

BLOCKS = 8


def ab(spec_name: str, name: str, a: str, b: str, wgrad: bool) -> None:
    spec, step, (x, ids, _, _, wg, _, _) = staged_step(spec_name)

    def use(value):
        os.environ[name] = value

    grads = {}
    for value in (a, b, b):
        use(value)
        got = [g.clone() for g in step()]
        if value in grads:
            same = all(torch.equal(u, v) for u, v in zip(got, grads[value]))
            print(f"{spec.name}: {name}={b}, the same bits twice: {same}", flush=True)
        grads[value] = got
    diffs = ", ".join(f"{n} {((u.double() - v.double()).norm() / v.double().norm()).item():.2e}"
                      for n, u, v in zip(("x", "w", "w_gate", "w_up", "w_down"), grads[b], grads[a]))
    print(f"{spec.name}: {b} against {a}, relative difference: {diffs}", flush=True)
    del grads
    for value in (a, b):  # each side's peak memory over one step, from the same baseline
        use(value)
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        print(f"{spec.name}: {name}={value} peak memory {peak / 2**30:.2f} GiB ({(peak - base) / 2**30:.2f} GiB above "
              f"the {base / 2**30:.2f} GiB held between steps)", flush=True)
    r = abba(step, use, a, b, BLOCKS)
    print(f"{spec.name} staged MXFP8 fwd+bwd: {a} {r[0]:.3f} ms, {b} {r[1]:.3f} ms, {b} / {a} {r[2]:.4f} "
          f"[{r[3]:.4f}, {r[4]:.4f}] over {BLOCKS} blocks", flush=True)
    if wgrad:  # the three weight-gradient launches on the step's own segments
        E, I, H = wg.shape
        flat = ids.reshape(-1).to(torch.int64)
        _, src, _, padded = mx_experts._segments(flat, E, ids.shape[1], check_ids=False)
        rows = src.shape[0]
        gen = torch.Generator(device="cuda").manual_seed(5)
        dy, h = torch.randn(rows, H, generator=gen, device="cuda"), torch.randn(rows, I, generator=gen, device="cuda")
        dg = torch.randn(rows, I, generator=gen, device="cuda")
        xb = mx_gemm.cols_bf16_math(x.detach().contiguous(), src=src)
        hb = mx_gemm.cols_bf16_math(h)
        flops = 2 * 3 * int(padded.sum()) * H * I

        def launches():
            mx_experts._weight_grads_ranged(dy, None, padded, torch.bfloat16, b_bf16=hb)
            mx_experts._weight_grads_ranged(dg, None, padded, torch.bfloat16, b_bf16=xb)
            mx_experts._weight_grads_ranged(dg, None, padded, torch.bfloat16, b_bf16=xb)

        r = abba(launches, use, a, b, BLOCKS)
        print(f"{spec.name} three wgrad launches ({int(padded.sum())} padded rows, {flops / 1e12:.2f} TFLOP, "
              f"quantizers included): {a} {r[0]:.3f} ms ({flops / r[0] / 1e9:.0f} TFLOP/s), {b} {r[1]:.3f} ms "
              f"({flops / r[1] / 1e9:.0f}), {b} / {a} {r[2]:.4f} [{r[3]:.4f}, {r[4]:.4f}]", flush=True)
    os.environ.pop(name, None)


parser = argparse.ArgumentParser()
parser.add_argument("--switch", nargs=3, default=["MOKGEN_MX_BWD_STAGES", "torch", "fused"])
parser.add_argument("--wgrad", action="store_true")
parser.add_argument("specs", nargs="*", default=["kimi-k2.5"])
args = parser.parse_args()
for spec_name in args.specs:
    ab(spec_name, *args.switch, args.wgrad)
    torch.cuda.empty_cache()
