"""How much of the megakernel's tile work is padding, per bench workload and chunk size (CPU only).

The flow schedule cuts the received rows (expert-major) into chunks of C rows and each
(expert, chunk) segment into 128-row blocks (tile_order.cuh), so a segment's last block is
partly empty. This model draws the bench's own routing (uniform: the top-k of random scores;
tokens per GPU as the bench), counts the blocks the kernel computes, and prints the share of
computed rows that are padding ("halves": the same if a block of at most 64 rows cost half a
block, its second consumer warpgroup skipping the tensor core) and the up + down tiles per compute CTA (a 132-SM H200, P = G/8
dispatch CTAs as the layer's default split; the W = 1 layers use G/16).

    python3 .ci/tile_waste.py [--chunks 1024 2048 4096 8192 16384] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

from mokgen import bench
from mokgen.plan import ep_defaults, make_plan
from mokgen.spec import load_spec

LOCAL = ("kimi-k2.5", "glm-5.2", "qwen3.5-397b-a17b", "deepseek-v4-pro", "deepseek-v3")
LAYERS = ("qwen3-30b-a3b", "qwen3.5-35b-a3b")
SMS, BM = 132, 128


def counts_local(spec, ep: int, tokens: int, gen) -> list[int]:
    """Rows per expert of the bench's local workload: bench.local_spec's rows (tokens * k),
    each routed top-1 over the rank's E / ep experts, as bench._routing does."""
    local, rows = bench.local_spec(spec, ep, tokens)
    ids = torch.rand(rows, local.num_experts, generator=gen).argmax(dim=-1)
    return torch.bincount(ids, minlength=local.num_experts).tolist()


def counts_layer(spec, tokens: int, gen) -> list[int]:
    ids = torch.rand(tokens, spec.num_experts, generator=gen).topk(spec.top_k, dim=-1).indices.flatten()
    return torch.bincount(ids, minlength=spec.num_experts).tolist()


def workloads(gen):
    """The bench workloads in order, each as (spec, label, rows per expert, the spec the kernel is
    planned for, compute CTAs): the local stand-ins at their EP degree (2048 tokens per GPU),
    then the layers at T = 16384, on the routing drawn from ``gen``."""
    for name in LOCAL + LAYERS:
        spec = load_spec(name)
        if name in LOCAL:
            ep = bench.LOCAL_EP.get(name, 8)
            yield spec, f"{name} local EP{ep}", counts_local(spec, ep, 2048, gen), bench.local_spec(spec, ep)[0], SMS - SMS // 8
        else:
            yield spec, f"{name} layer T=16384", counts_layer(spec, 16384, gen), spec, SMS - SMS // 16


def blocks(counts: list[int], chunk: int, half: bool = False) -> float:
    """128-row blocks of the flow order: per chunk, per expert segment overlapping it. ``half``:
    count a block of at most 64 rows as half a block (its second consumer warpgroup idle)."""
    n, total, start = sum(counts), 0, 0
    offs = []
    for c in counts:
        offs.append((start, start + c))
        start += c
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        for a, b in offs:
            lo, hi = max(a, r0), min(b, r1)
            if hi > lo:
                full, rest = divmod(hi - lo, BM)
                total += full + (0 if rest == 0 else 0.5 if half and rest <= BM // 2 else 1)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    print(f"{'workload':34} {'rows':>6} {'chunk':>6} {'padding':>8} {'halves':>8} {'tiles/CTA':>9}")
    for spec, label, counts, work, world_ctas in workloads(gen):
        plan = make_plan(work)
        up_n, down_n = spec.moe_intermediate_size // plan.gemm_block_n_up, spec.hidden_size // plan.gemm_block_n_down
        n = sum(counts)
        default = ep_defaults(work)["chunk_rows"]
        for chunk in sorted(set(args.chunks) | {default}):
            b = blocks(counts, chunk)
            pad, pad_half = 1 - n / (b * BM), 1 - n / (blocks(counts, chunk, half=True) * BM)
            tiles = b * (up_n + down_n) / world_ctas
            mark = " (default)" if chunk == default else ""
            print(f"{label:34} {n:6d} {chunk:6d} {pad:8.1%} {pad_half:8.1%} {tiles:9.1f}{mark}")
        print()


if __name__ == "__main__":
    main()
