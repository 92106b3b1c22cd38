"""MoEBlock on the GPU: output and gradients against the reference block, and the training
example (examples/train_tiny_moe.py) following the reference block's loss curve."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import mokgen  # noqa: E402
from mokgen.block import MoEBlock  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_memory")]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b", str(EXAMPLES / "tiny-moe.yaml")])
def test_block_matches_the_reference_block(name):
    spec = mokgen.load_spec(name)
    torch.manual_seed(0)
    block = MoEBlock(spec, max_tokens=512)
    if block.shared is not None and block.shared.gate_weight is not None:
        block.shared.gate_weight.data.normal_(std=0.05)
    x = torch.randn(2, 200, spec.hidden_size, device="cuda").to(torch.bfloat16).requires_grad_(True)
    out = block(x)
    g = torch.randn_like(out)
    out.backward(g)
    got = [x.grad] + [p.grad for p in block.parameters()]
    x2 = x.detach().clone().requires_grad_(True)
    for p in block.parameters():
        p.grad = None
    ref = block.reference_forward(x2)
    ref.backward(g)
    want = [x2.grad] + [p.grad for p in block.parameters()]
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()  # noqa: E731
    assert rel(out, ref) < 2e-2
    for (name_, _), a, b in zip([("x", None)] + list(block.named_parameters()), got, want):
        assert a is not None and b is not None, name_
        assert rel(a, b) < 3e-2, f"{name_}: relative error {rel(a, b):.3e}"


def test_training_example_follows_the_reference_loss_curve():
    spec = importlib.util.spec_from_file_location("train_tiny_moe", EXAMPLES / "train_tiny_moe.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    ours, ref = example.main(["--steps", "15"])
    assert ours[-1] < 0.8 * ours[0]  # it learns
    assert max(abs(a - b) for a, b in zip(ours, ref)) < 0.1 * ref[0]  # like the reference block
