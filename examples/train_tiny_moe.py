"""Swap the MoE block of a small Hugging Face-style model for mokgen.MoEBlock and train it.

The model below is written here (no downloads): token embedding, a few pre-norm decoder layers
(causal self-attention + MoE block), a tied output head; a synthetic next-token task (copy the
token from 3 positions back). The same initial weights train twice, once with mokgen's block
and once with the reference block (mokgen.reference, fp32 PyTorch), on the same batches; the
two loss curves are printed side by side. ``--numerics mxfp8`` trains mokgen's block with the
MXFP8 megakernel (its backward: the staged MXFP8 experts', mokgen.ep) against the same fp32
reference block. Needs one H100/H200.

    python examples/train_tiny_moe.py [--steps 30] [--spec examples/tiny-moe.yaml] [--numerics bf16|mxfp8]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import mokgen
from mokgen.block import MoEBlock

HERE = Path(__file__).resolve().parent


class DecoderLayer(torch.nn.Module):
    def __init__(self, spec, heads: int):
        super().__init__()
        H = spec.hidden_size
        self.norm1 = torch.nn.RMSNorm(H, device="cuda", dtype=torch.bfloat16)
        self.attn = torch.nn.MultiheadAttention(H, heads, batch_first=True, device="cuda", dtype=torch.bfloat16)
        self.norm2 = torch.nn.RMSNorm(H, device="cuda", dtype=torch.bfloat16)
        # the swapped-in MoE block; the model's blocks run on one set of the megakernel's buffers
        self.mlp = MoEBlock(spec, device="cuda", share_buffers=True)
        self.use_reference = False

    def forward(self, h):
        S = h.shape[1]
        mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=h.device), 1)
        a = self.norm1(h)
        h = h + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        m = self.norm2(h)
        return h + (self.mlp.reference_forward(m) if self.use_reference else self.mlp(m))


class TinyMoEModel(torch.nn.Module):
    def __init__(self, spec, vocab: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
        self.layers = torch.nn.ModuleList(DecoderLayer(spec, heads) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(spec.hidden_size, device="cuda", dtype=torch.bfloat16)

    def set_reference(self, on: bool):
        for layer in self.layers:
            layer.use_reference = on

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h) @ self.embed.weight.T


def batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq + 3), generator=gen, device="cuda")
        yield x[:, 3:], x[:, :-3]  # predict the token 3 positions back


def train(model, data, lr: float) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for tokens, target in data:
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None) -> tuple[list[float], list[float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(HERE / "tiny-moe.yaml"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--numerics", choices=("bf16", "mxfp8"), default="bf16")
    args = ap.parse_args(argv)
    spec = mokgen.load_spec(args.spec).with_target(numerics=args.numerics)
    torch.manual_seed(0)
    model = TinyMoEModel(spec)
    twin = TinyMoEModel(spec)  # the same initial weights (each MoELayer keeps its own kernel buffers)
    twin.load_state_dict(model.state_dict())
    twin.set_reference(True)
    vocab = model.embed.num_embeddings
    ours = train(model, batches(args.steps, args.batch, args.seq, vocab), args.lr)
    ref = train(twin, batches(args.steps, args.batch, args.seq, vocab), args.lr)
    print(f"{'step':>4}  {'mokgen':>8}  {'reference':>9}")
    for i, (a, b) in enumerate(zip(ours, ref)):
        print(f"{i:>4}  {a:8.4f}  {b:9.4f}")
    return ours, ref


if __name__ == "__main__":
    main()
