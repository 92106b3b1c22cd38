"""The fused shared expert's backward (mokgen.backward.shared_op_backward) with its dW_down launch
beside the joint dW_gate / dW_up launch (MOKGEN_BWD_OVERLAP auto, B) against one after the other
(MOKGEN_BWD_OVERLAP=0, A), interleaved in ABBA blocks (bench.abba_blocks) in one process, on the
shared expert of each named spec at T tokens (runs on an H200, not in CI; docs/perf-notes.md
v0.36). Also checks the two give the same bits.
Usage: python3 .ci/shared_bwd_ab.py [SPEC ...] [--tokens T] [--blocks N]"""
import argparse
import os

import torch

from mokgen import backward, bench, load_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", default=["qwen3.5-35b-a3b", "qwen3.5-397b-a17b"])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--blocks", type=int, default=30)
    args = ap.parse_args()
    for name in args.specs:
        spec = load_spec(name)
        H, I, T = spec.hidden_size, spec.shared_experts.intermediate_size, args.tokens
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
        g = [torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2)]
        wg, wu = ((torch.randn(I, H, generator=gen, device="cuda") * H**-0.5).to(torch.bfloat16) for _ in range(2))
        wd = (torch.randn(H, I, generator=gen, device="cuda") * I**-0.5).to(torch.bfloat16)
        scale = torch.rand(T, generator=gen, device="cuda")
        os.environ.pop("MOKGEN_BWD_OVERLAP", None)
        overlap = backward.overlap_weight_launches(1, H, I, x.device, "split")

        def run(side: int, i: int):
            if side == 0:
                os.environ["MOKGEN_BWD_OVERLAP"] = "0"
            else:
                os.environ.pop("MOKGEN_BWD_OVERLAP", None)
            return backward.shared_op_backward([x], wg, wu, wd, scale, [g[i % 2]])

        outs = [run(s, 0) for s in (0, 1)]
        same = torch.equal(outs[0][0][0], outs[1][0][0]) and all(
            torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))
        pairs = bench.abba_blocks(lambda side, i: bench.time_launch(lambda: run(side, i)), args.blocks)
        ratio, lo, hi = bench.block_ratio(pairs)
        a_ms = sorted(a / 2 for a, _ in pairs)[len(pairs) // 2]
        b_ms = sorted(b / 2 for _, b in pairs)[len(pairs) // 2]
        print(f"{name}: shared expert H {H} I {I}, T {T}: overlap chosen {overlap}; serial {a_ms:.3f} ms, "
              f"overlapped {b_ms:.3f} ms, B / A {ratio:.4f} [{lo:.4f}, {hi:.4f}]; same bits {same}", flush=True)


if __name__ == "__main__":
    main()
