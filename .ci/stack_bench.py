"""A model's stack of MoE layers on one GPU, each with its own buffers against all on one set
(MoELayer(share_buffers=True)): memory and fwd+bwd step time (runs on an H100 or H200, not in CI).

N layers of SPEC at T tokens, layer i's weights the same on both sides; a step runs x through the
layers in turn (one routing for all, as the bench's), then the backward of a fixed dOut, with the
gradients reset each step as `mokgen bench --backward` does. Prints, per side:
  buffers   the megakernel buffers the stack holds (distinct sets, MoELayer.buffer_bytes)
  peak      the step's peak allocated memory over what was allocated before it
  step      the median step (CUDA events), and from interleaved ABBA blocks (bench.abba_blocks)
            the median of shared / own with its 95% interval
  bits      whether both sides' outputs and gradients agree bit for bit
Own buffers with bwd_ring "auto": every layer's backward reads its own ring in place where the ring
holds every pair's row; shared: only the layer that launched last does, the others gather x again.
Usage: python3 .ci/stack_bench.py SPEC [TOKENS] [LAYERS] [--blocks N]   (defaults 16384, 4, 10)"""
import argparse
import statistics

import torch

from mokgen import bench
from mokgen.ep import MoELayer
from mokgen.spec import load_spec

ap = argparse.ArgumentParser()
ap.add_argument("spec")
ap.add_argument("tokens", nargs="?", type=int, default=16384)
ap.add_argument("layers", nargs="?", type=int, default=4)
ap.add_argument("--blocks", type=int, default=10)
args = ap.parse_args()
spec, T, N = load_spec(args.spec), args.tokens, args.layers
gen = torch.Generator(device="cuda").manual_seed(3)
x = torch.randn(T, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(True)
ids, w = bench._routing(spec, T, gen)
w.requires_grad_(True)
g = torch.randn_like(x)


def stack(share: bool) -> list:
    layers = []
    for i in range(N):
        torch.manual_seed(100 + i)
        layer = MoELayer(spec, max_tokens=T, device="cuda", share_buffers=share)
        layer.check_ids = False
        layers.append(layer)
    return layers


def step(layers, keep: bool = False):
    leaves = [x, w, *(p for layer in layers for p in layer.parameters())]
    for t in leaves:
        t.grad = None
    h = x
    for layer in layers:
        h = layer(h, ids, w)
    h.backward(g)
    if keep:
        return [h.detach().clone(), *(t.grad.clone() for t in leaves)]
    return None


def buffers(layers) -> int:
    return sum({id(layer._ep): layer.buffer_bytes for layer in layers}.values())


sides = {}
for name, share in (("own", False), ("shared", True)):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    layers = stack(share)
    made = torch.cuda.memory_allocated() - before
    step(layers)  # warm-up: builds, workspaces
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    bits = step(layers, keep=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    sides[name] = (layers, bits)
    gib = 1 << 30
    print(f"{name:7s} buffers {buffers(layers) / gib:.2f} GiB in {len({id(l._ep) for l in layers})} set(s) "
          f"(one set {layers[0].buffer_bytes / gib:.2f} GiB); the stack allocated {made / gib:.2f} GiB with its "
          f"weights; step peak +{peak / gib:.2f} GiB", flush=True)
    del bits
same = all(torch.equal(a, b) for a, b in zip(step(sides["own"][0], keep=True), step(sides["shared"][0], keep=True)))
print(f"bits    {'the same' if same else 'DIFFER'} (output and {2 + 3 * N} gradients)")
order = (sides["own"][0], sides["shared"][0])
pairs = bench.abba_blocks(lambda side, i: bench.time_launch(lambda: step(order[side])), args.blocks)
med, lo, hi = bench.block_ratio(pairs)
print(f"step    {N} layers x {T} tokens: own {statistics.median(a for a, _ in pairs) / 2:.3f} ms, shared "
      f"{statistics.median(b for _, b in pairs) / 2:.3f} ms; shared / own {med:.4f} [{lo:.4f}, {hi:.4f}] over "
      f"{args.blocks} ABBA blocks")
