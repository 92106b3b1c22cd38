"""The CUDA routed-expert forward (EP = 1) against the PyTorch reference, on the GPU.

Shapes: every bundled spec at its full hidden size, expert intermediate size and expert count;
token counts are scaled down (hundreds to a few thousand) to keep the run short. Inputs are fresh
random values (never zeros); the caching allocator is poisoned with NaN before each call so an
unwritten output element shows up as non-finite.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import mokgen  # noqa: E402
from mokgen import reference  # noqa: E402
from mokgen.errors import InputError  # noqa: E402
from mokgen.spec import bundled_specs, load_spec  # noqa: E402
from mokgen.bench import expert_weights  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_memory", "gpu_module_memory")]

ALL_SPECS = sorted(bundled_specs())
REL_TOL = 2e-2  # bf16 inputs, bf16 intermediate and slots, fp32 accumulation


def _weights(spec, gen, device="cuda"):
    """Full-size bf16 expert weights, drawn expert by expert (bench.expert_weights, seeded from
    ``gen``, which the draw of the seed advances: two calls give two sets): a whole tensor drawn in
    fp32 first took a 22.5 GB fp32 draw for kimi-k2.5's w_gate on top of the bf16 result, more than
    an 80 GB H100 had left (docs/perf-notes.md v0.44)."""
    seed = int(torch.randint(0, 1 << 30, (1,), generator=gen, device=gen.device).item())
    return expert_weights(spec, range(spec.num_experts), device, seed=seed)


def _routing(spec, T, gen, device="cuda"):
    scores = torch.rand(T, spec.num_experts, generator=gen, device=device)
    ids = scores.topk(spec.top_k, dim=-1).indices  # distinct experts per token
    w = torch.rand(T, spec.top_k, generator=gen, device=device) + 0.05
    return ids, w / w.sum(-1, keepdim=True)


def _poison_allocator(nbytes: int) -> None:
    """Fill freed cache blocks with NaN bytes so the op's fresh allocations start poisoned."""
    blob = torch.full((nbytes // 2 + 1,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del blob


def _run(spec, x, ids, w, wg, wu, wd):
    _poison_allocator(x.numel() * 2 * (spec.top_k + 1) * 4 + (64 << 20))
    return mokgen.experts_forward(x, ids, w, wg, wu, wd, spec=spec)


def _check(spec, out, x, ids, w, wg, wu, wd):
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output elements"
    ref = reference.experts_forward(x, ids, w, wg, wu, wd, clamp_limit=spec.activation.clamp_limit)
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    assert err < REL_TOL, f"{spec.name}: relative error {err:.3e}"


@pytest.mark.parametrize("name", ALL_SPECS)
def test_matches_reference_every_spec(name):
    spec = load_spec(name)
    gen = torch.Generator(device="cuda").manual_seed(1000 + len(name))
    wg, wu, wd = _weights(spec, gen)
    T = 1000  # not a multiple of any tile
    x = torch.randn(T, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = _routing(spec, T, gen)
    out = _run(spec, x, ids, w, wg, wu, wd)
    _check(spec, out, x, ids, w, wg, wu, wd)


SMALL = "qwen3-30b-a3b"


@pytest.mark.parametrize("T", [1, 7, 127, 129, 513, 4099])
def test_token_counts_not_tile_multiples(T):
    spec = load_spec(SMALL)
    gen = torch.Generator(device="cuda").manual_seed(T)
    wg, wu, wd = _weights(spec, gen)
    x = torch.randn(T, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = _routing(spec, T, gen)
    _check(spec, _run(spec, x, ids, w, wg, wu, wd), x, ids, w, wg, wu, wd)


def test_zero_tokens():
    spec = load_spec(SMALL)
    gen = torch.Generator(device="cuda").manual_seed(0)
    wg, wu, wd = _weights(spec, gen)
    x = torch.empty(0, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    ids = torch.empty(0, spec.top_k, device="cuda", dtype=torch.int64)
    w = torch.empty(0, spec.top_k, device="cuda")
    out = mokgen.experts_forward(x, ids, w, wg, wu, wd, spec=spec)
    assert out.shape == (0, spec.hidden_size)


@pytest.mark.parametrize("name", [SMALL, "kimi-k2.5"])
def test_skew_every_token_to_one_expert(name):
    """j = 0 of every token goes to one expert; the other k-1 are random distinct experts."""
    spec = load_spec(name)
    gen = torch.Generator(device="cuda").manual_seed(7)
    wg, wu, wd = _weights(spec, gen)
    T = 2500
    x = torch.randn(T, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    hot = spec.num_experts - 1
    scores = torch.rand(T, spec.num_experts, generator=gen, device="cuda")
    scores[:, hot] = 2.0
    ids = scores.topk(spec.top_k, dim=-1).indices
    w = torch.rand(T, spec.top_k, generator=gen, device="cuda")
    assert (ids == hot).sum() == T
    _check(spec, _run(spec, x, ids, w, wg, wu, wd), x, ids, w, wg, wu, wd)


def test_skew_every_pair_to_one_expert():
    """Degenerate routing: all T*k pairs to the same expert (ids repeat within a token)."""
    spec = load_spec(SMALL)
    gen = torch.Generator(device="cuda").manual_seed(11)
    wg, wu, wd = _weights(spec, gen)
    T = 3001
    x = torch.randn(T, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    ids = torch.full((T, spec.top_k), 3, device="cuda", dtype=torch.int32)
    w = torch.rand(T, spec.top_k, generator=gen, device="cuda")
    _check(spec, _run(spec, x, ids, w, wg, wu, wd), x, ids, w, wg, wu, wd)


def test_bitwise_deterministic_over_10_runs():
    spec = load_spec("qwen3.5-35b-a3b")
    gen = torch.Generator(device="cuda").manual_seed(3)
    wg, wu, wd = _weights(spec, gen)
    T = 4096
    x = torch.randn(T, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = _routing(spec, T, gen)
    first = _run(spec, x, ids, w, wg, wu, wd)
    for _ in range(9):
        assert torch.equal(_run(spec, x, ids, w, wg, wu, wd), first)


def test_each_call_uses_the_weights_it_is_given():
    """The launcher reuses the last launch's TMA descriptors when the weights' and buffers'
    addresses and the ring's shape are the same (EpLauncher's launch cache): two weight sets
    alternating, then one changed in place, and each call must compute with its own."""
    spec = load_spec(SMALL)
    gen = torch.Generator(device="cuda").manual_seed(11)
    a, b = _weights(spec, gen), _weights(spec, gen)
    T = 300
    x = torch.randn(T, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = _routing(spec, T, gen)
    outs = []
    for wts in (a, b, a, b):
        outs.append(_run(spec, x, ids, w, *wts))
        _check(spec, outs[-1], x, ids, w, *wts)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    assert not torch.equal(outs[0], outs[1])
    a[2].neg_()  # w_down in place: the same address, new values
    flipped = _run(spec, x, ids, w, *a)
    _check(spec, flipped, x, ids, w, *a)
    assert torch.equal(flipped, -outs[0])


def test_int32_and_int64_ids_and_bf16_weights_agree():
    spec = load_spec(SMALL)
    gen = torch.Generator(device="cuda").manual_seed(5)
    wg, wu, wd = _weights(spec, gen)
    T = 300
    x = torch.randn(T, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = _routing(spec, T, gen)
    a = mokgen.experts_forward(x, ids, w, wg, wu, wd, spec=spec)
    b = mokgen.experts_forward(x, ids.to(torch.int32), w, wg, wu, wd, spec=spec)
    assert torch.equal(a, b)
    c = mokgen.experts_forward(x, ids, w.to(torch.bfloat16), wg, wu, wd, spec=spec)
    _check(spec, c, x, ids, w.to(torch.bfloat16).float(), wg, wu, wd)


def test_out_of_range_ids_rejected_before_launch():
    spec = load_spec(SMALL)
    gen = torch.Generator(device="cuda").manual_seed(5)
    wg, wu, wd = _weights(spec, gen)
    x = torch.randn(4, spec.hidden_size, device="cuda").to(torch.bfloat16)
    ids, w = _routing(spec, 4, gen)
    for bad in (spec.num_experts, -1):
        ids2 = ids.clone()
        ids2[2, 1] = bad
        with pytest.raises(InputError, match=r"topk_ids: expert ids must be in \[0, 128\)"):
            mokgen.experts_forward(x, ids2, w, wg, wu, wd, spec=spec)


def test_non_contiguous_and_wrong_device_rejected():
    spec = load_spec(SMALL)
    gen = torch.Generator(device="cuda").manual_seed(5)
    wg, wu, wd = _weights(spec, gen)
    x = torch.randn(8, 2 * spec.hidden_size, device="cuda").to(torch.bfloat16)[:, ::2]
    ids, w = _routing(spec, 8, gen)
    with pytest.raises(InputError, match="x: must be contiguous"):
        mokgen.experts_forward(x, ids, w, wg, wu, wd, spec=spec)
    with pytest.raises(InputError, match="topk_ids: must be on a CUDA device"):
        mokgen.experts_forward(x.contiguous(), ids.cpu(), w, wg, wu, wd, spec=spec)


def test_module_and_torch_compile_fullgraph():
    spec = load_spec(SMALL)
    layer = mokgen.MoEExperts(spec, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(9)
    T = 200
    x = torch.randn(T, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = _routing(spec, T, gen)
    eager = layer(x, ids, w)
    _check(spec, eager, x, ids, w, layer.w_gate.detach(), layer.w_up.detach(), layer.w_down.detach())
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x, ids, w), eager)
