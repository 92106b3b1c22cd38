"""The split weight tiles' two epilogues (bwd_gemm.WEIGHT_STORES: "buffers", two 8 KB store
buffers per consumer warpgroup used in turn; "held", the whole tile staged at once, warpgroup 1's
half in the tile's last ring stage), in one process on the rows of `mokgen bench SPEC --workload
local --backward` (runs on an H200, not in CI).

For each split weight GEMM form the backward launches: first that both epilogues give the same
bits, then ABBA blocks of A = buffers, B = held (bench.abba_blocks), each launch timed by CUDA
events. Prints the median ms of each and the median B / A with its 95% bootstrap interval
(bench.block_ratio), then the same for the joint dW_gate/dW_up and dW_down launched together (the
default schedule's weight gradients).

Usage: python3 .ci/bwd_store_ab.py [SPEC ...] [--blocks N] (default kimi-k2.5, 30 blocks)"""

import argparse
import statistics

import torch

from mokgen import bench, bwd_gemm


def _report(title, flops, fn, blocks):
    one, two = fn("buffers"), fn("held")
    same = all(torch.equal(p, q) for p, q in zip(one if isinstance(one, tuple) else (one,),
                                                 two if isinstance(two, tuple) else (two,)))
    del one, two
    stores = ("buffers", "held")
    pairs = bench.abba_blocks(lambda side, i: bench.time_launch(lambda: fn(stores[side])), blocks)
    a = statistics.median(p[0] / 2 for p in pairs)
    b = statistics.median(p[1] / 2 for p in pairs)
    r, lo, hi = bench.block_ratio(pairs)
    faster = sum(p[1] < p[0] for p in pairs)
    print(f"  {title}: same bits {same}; buffers {a:.3f} ms ({flops / a / 1e9:.0f} TFLOP/s), "
          f"held {b:.3f} ms ({flops / b / 1e9:.0f}); held / buffers {r:.4f} [{lo:.4f}, {hi:.4f}], "
          f"held faster in {faster}/{len(pairs)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="*", default=["kimi-k2.5"])
    ap.add_argument("--blocks", type=int, default=30)
    args = ap.parse_args()
    for name in args.specs:
        spec, gen, counts, offs, rows = bench.local_expert_rows(name)
        E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

        x, go, dg, du, hw = randn(rows, H), randn(rows, H), randn(rows, I), randn(rows, I), randn(rows, I)
        index = torch.randperm(rows, generator=gen, device="cuda")
        x_src = torch.empty_like(x)
        x_src[index] = x
        print(f"{name}: {E} local experts, {rows} rows (mean {rows / E:.0f}, min {int(counts.min())}, "
              f"max {int(counts.max())})", flush=True)
        cases = [
            ("joint dW_gate, dW_up = [dg; du]^T x, cluster 1", 4 * rows * H * I,
             lambda st: bwd_gemm.weight_grads_joint(dg, du, x, offs, cluster=1, store=st)),
            ("dW_down = dOut^T hw, cluster 1", 2 * rows * H * I,
             lambda st: bwd_gemm.weight_grads(go, hw, offs, cluster=1, schedule="split", store=st)),
            ("dW_gate = dg^T x, cluster 2", 2 * rows * H * I,
             lambda st: bwd_gemm.weight_grads(dg, x, offs, cluster=2, schedule="split", store=st)),
            ("joint, x's rows through an index", 4 * rows * H * I,
             lambda st: bwd_gemm.weight_grads_joint(dg, du, x_src, offs, b_index=index, store=st)),
        ]
        for title, flops, fn in cases:
            _report(title, flops, fn, args.blocks)
        _report("all three dW (joint + dW_down, cluster 1)", 6 * rows * H * I,
                lambda st: (*bwd_gemm.weight_grads_joint(dg, du, x, offs, cluster=1, store=st),
                            bwd_gemm.weight_grads(go, hw, offs, cluster=1, schedule="split", store=st)),
                args.blocks)


if __name__ == "__main__":
    main()
