"""The weight gradients' two ways of leaving the next expert's rows out of a short last k-block
(bwd_gemm.WEIGHT_TAILS: "zero", the consumers zero them and drain around the short k-block;
"tma", per-expert bounded tensor maps, the TMA loads zeros), in one process on the rows of
`mokgen bench SPEC --workload local --backward` (runs on an H200, not in CI).

For each weight GEMM the backward launches (the joint dW_gate/dW_up over x, dW_down over hw; each
schedule): first that both tails give the same bits, then ABBA blocks of A = zero, B = tma
(bench.abba_blocks), each launch timed by CUDA events. Prints the median ms of each and the median
B / A with its 95% bootstrap interval (bench.block_ratio). Last, the three weight gradients
as each schedule launches them: the ping-pong's three launches (tail zero) against the split
tiles' joint launch and dW_down (tail tma).

With --tails A B (default: zero tma) any two of bwd_gemm.WEIGHT_TAILS are compared instead, and
the last line is the split tiles' three weight gradients under A against B (v0.32: tma steps).

With --three SCHEDULE:TAIL SCHEDULE:TAIL (v0.33: pingpong:steps split:steps) the last line
compares the three weight gradients as those two (schedule, tail) launch them instead: the split
as its joint launch and dW_down, the ping-pong as its three launches.

Usage: python3 .ci/bwd_tail_ab.py [SPEC ...] [--blocks N] [--tails A B] [--three S:T S:T]
(default kimi-k2.5, 30 blocks)"""

import argparse
import statistics

import torch

from mokgen import bench, bwd_gemm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="*", default=["kimi-k2.5"])
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--tails", nargs=2, default=["zero", "tma"], choices=bwd_gemm.WEIGHT_TAILS)
    ap.add_argument("--three", nargs=2, metavar="SCHEDULE:TAIL")
    args = ap.parse_args()
    ta, tb = args.tails
    three = None
    if args.three:
        three = [tuple(x.split(":")) for x in args.three]
        for st in three:
            if len(st) != 2 or st[0] not in bwd_gemm.WEIGHT_SCHEDULES or st[1] not in bwd_gemm.WEIGHT_TAILS:
                ap.error(f"--three takes SCHEDULE:TAIL with a schedule of {bwd_gemm.WEIGHT_SCHEDULES} "
                         f"and a tail of {bwd_gemm.WEIGHT_TAILS}, got {':'.join(st)!r}")
    default = (ta, tb) == ("zero", "tma")
    for name in args.specs:
        spec, gen, counts, offs, rows = bench.local_expert_rows(name)
        E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

        x, go, dg, du, hw = randn(rows, H), randn(rows, H), randn(rows, I), randn(rows, I), randn(rows, I)
        print(f"{name}: {E} local experts, {rows} rows (mean {rows / E:.0f}, min {int(counts.min())}, "
              f"max {int(counts.max())}; last k-block rows mean {float(((counts - 1) % 64 + 1).float().mean()):.1f})")
        cases = [
            ("joint dW_gate, dW_up = [dg; du]^T x, split", 4 * rows * H * I,
             lambda tail: bwd_gemm.weight_grads_joint(dg, du, x, offs, cluster=1, tail=tail)),
            ("dW_down = dOut^T hw, split", 2 * rows * H * I,
             lambda tail: bwd_gemm.weight_grads(go, hw, offs, cluster=1, schedule="split", tail=tail)),
            ("dW_down, pingpong", 2 * rows * H * I,
             lambda tail: bwd_gemm.weight_grads(go, hw, offs, cluster=1, schedule="pingpong", tail=tail)),
            ("dW_gate = dg^T x, pingpong", 2 * rows * H * I,
             lambda tail: bwd_gemm.weight_grads(dg, x, offs, cluster=1, schedule="pingpong", tail=tail)),
            ("dW_gate, split, cluster 2", 2 * rows * H * I,
             lambda tail: bwd_gemm.weight_grads(dg, x, offs, cluster=2, schedule="split", tail=tail)),
        ]
        # the three weight gradients as a schedule launches them under a tail: the ping-pong as
        # three launches, the split tiles as the joint launch and dW_down
        def three_of(schedule, tail):
            if schedule == "pingpong":
                return tuple(bwd_gemm.weight_grads(p, q, offs, cluster=1, schedule="pingpong", tail=tail)
                             for p, q in ((dg, x), (du, x), (go, hw)))
            return (*bwd_gemm.weight_grads_joint(dg, du, x, offs, cluster=1, tail=tail),
                    bwd_gemm.weight_grads(go, hw, offs, cluster=1, schedule="split", tail=tail))

        # A and B of the last line: --three's pairs, else the split under tails A and B, else (the
        # default tails) the ping-pong with zero against the split with tma
        sides = three or ([("split", ta), ("split", tb)] if not default else [("pingpong", "zero"), ("split", "tma")])

        def weights(side):
            return three_of(*sides[side])

        for title, flops, fn in cases:
            zero, tma = fn(ta), fn(tb)
            same = all(torch.equal(p, q) for p, q in zip(zero if isinstance(zero, tuple) else (zero,),
                                                         tma if isinstance(tma, tuple) else (tma,)))
            del zero, tma
            tails = (ta, tb)
            pairs = bench.abba_blocks(lambda side, i: bench.time_launch(lambda: fn(tails[side])), args.blocks)
            a = statistics.median(p[0] / 2 for p in pairs)
            b = statistics.median(p[1] / 2 for p in pairs)
            r, lo, hi = bench.block_ratio(pairs)
            faster = sum(p[1] < p[0] for p in pairs)
            print(f"  {title}: same bits {same}; {ta} {a:.3f} ms ({flops / a / 1e9:.0f} TFLOP/s), "
                  f"{tb} {b:.3f} ms ({flops / b / 1e9:.0f}); {tb} / {ta} {r:.4f} [{lo:.4f}, {hi:.4f}], "
                  f"{tb} faster in {faster}/{len(pairs)}", flush=True)

        same = all(torch.equal(p, q) for p, q in zip(weights(0), weights(1)))
        pairs = bench.abba_blocks(lambda side, i: bench.time_launch(lambda: weights(side)), args.blocks)
        a = statistics.median(p[0] / 2 for p in pairs)
        b = statistics.median(p[1] / 2 for p in pairs)
        r, lo, hi = bench.block_ratio(pairs)
        sa, sb = (f"{sch} {t}" for sch, t in sides)
        print(f"  all three dW: same bits {same}; {sa} {a:.3f} ms ({6 * rows * H * I / a / 1e9:.0f} "
              f"TFLOP/s), {sb} {b:.3f} ms ({6 * rows * H * I / b / 1e9:.0f}); {sb} / {sa} "
              f"{r:.4f} [{lo:.4f}, {hi:.4f}], B faster in {sum(p[1] < p[0] for p in pairs)}/{len(pairs)}",
              flush=True)

if __name__ == "__main__":
    main()
