"""mokgen.backward (the PyTorch baseline backward behind the megakernel's autograd) against
autograd through the reference, on the CPU in float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mokgen.backward import ep_op_backward, experts_backward
from mokgen.reference import experts_forward, swiglu

F64 = torch.float64


def _problem(T=37, H=24, I=16, E=6, K=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen, dtype=F64)
    ids = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
    w = torch.rand(T, K, generator=gen, dtype=F64)
    wg = torch.randn(E, I, H, generator=gen, dtype=F64) * 0.3
    wu = torch.randn(E, I, H, generator=gen, dtype=F64) * 0.3
    wd = torch.randn(E, H, I, generator=gen, dtype=F64) * 0.3
    g = torch.randn(T, H, generator=gen, dtype=F64)
    return x, ids, w, wg, wu, wd, g


def _autograd(x, ids, w, wg, wu, wd, g, clamp):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    xl, wl, gl, ul, dl = leaves
    out = experts_forward(xl, ids, wl, gl, ul, dl, clamp_limit=clamp, acc_dtype=F64)
    out.backward(g)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("clamp", [None, 0.7])
def test_gradients_match_reference_autograd(clamp):
    x, ids, w, wg, wu, wd, g = _problem()
    want = _autograd(x, ids, w, wg, wu, wd, g, clamp)
    got = experts_backward(x, ids, w, wg, wu, wd, g, clamp)
    for name, a, b in zip(("dx", "dw", "dw_gate", "dw_up", "dw_down"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def test_clamp_changes_the_gradients():
    # the clamped case is not trivially equal to the unclamped one (the test above can fail)
    x, ids, w, wg, wu, wd, g = _problem(seed=1)
    a = experts_backward(x * 4, ids, w, wg, wu, wd, g, None)[0]
    b = experts_backward(x * 4, ids, w, wg, wu, wd, g, 0.5)[0]
    assert not torch.allclose(a, b)


def test_dropped_pairs_get_no_gradient_and_zero_tokens():
    x, ids, w, wg, wu, wd, g = _problem(T=9, E=4, K=2, seed=2)
    bad = ids.clone()
    bad[3, 1] = -1
    bad[5, 0] = 4  # out of range: dropped like the kernel's combine does
    dx, dw, dwg, _, _ = experts_backward(x, bad, w, wg, wu, wd, g)
    assert dw[3, 1] == 0 and dw[5, 0] == 0
    # the same as a problem without those pairs (weight 0)
    w0 = w.clone()
    w0[3, 1] = 0
    w0[5, 0] = 0
    fixed = bad.clone()
    fixed[3, 1] = 0
    fixed[5, 0] = 0
    dx2, _, dwg2, _, _ = experts_backward(x, fixed, w0, wg, wu, wd, g)
    torch.testing.assert_close(dx, dx2)
    torch.testing.assert_close(dwg, dwg2)
    z = experts_backward(x[:0], ids[:0], w[:0], wg, wu, wd, g[:0])
    assert z[0].shape == (0, x.shape[1]) and z[1].shape == (0, ids.shape[1]) and not z[2].any()


def test_virtual_ranks_split_and_join():
    x, ids, w, wg, wu, wd, g = _problem(T=20, E=6, seed=3)
    sizes = [7, 0, 13]
    saved = {"xs": list(x.split(sizes)), "topk_ids": list(ids.split(sizes)), "topk_weights": list(w.split(sizes)),
             "w_gate": list(wg.split(2)), "w_up": list(wu.split(2)), "w_down": list(wd.split(2)), "world": 3,
             "clamp_limit": None}
    grads = list(g.split(sizes))
    grads[2] = None  # an output that was not used
    dxs, dws, dwg, dwu, dwd = ep_op_backward(saved, grads)
    g2 = g.clone()
    g2[7:] = 0
    want = experts_backward(x, ids, w, wg, wu, wd, g2)
    torch.testing.assert_close(torch.cat(dxs), want[0])
    torch.testing.assert_close(torch.cat(dws), want[1])
    torch.testing.assert_close(torch.cat(dwd), want[4])
    assert [t.shape[0] for t in dxs] == sizes and [t.shape[0] for t in dwg] == [2, 2, 2]
    saved["world"] = 8  # ranks on other GPUs: not implemented yet, and said so
    with pytest.raises(NotImplementedError, match="across GPUs"):
        ep_op_backward(saved, grads)


def _two_rank_lists(spec, sizes, gen):
    """The op's per-rank lists for two virtual ranks (fp64, CPU): xs, topk_ids, topk_weights and
    each rank's half of the experts' w_gate, w_up, w_down."""
    E, I, H, K = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size, spec.top_k
    xs = [torch.randn(t, H, generator=gen, dtype=F64) for t in sizes]
    ids = [torch.rand(t, E, generator=gen).topk(K, dim=-1).indices for t in sizes]
    ws = [torch.rand(t, K, generator=gen, dtype=F64) for t in sizes]
    wg = list((torch.randn(E, I, H, generator=gen, dtype=F64) * 0.05).split(E // 2))
    wu = list((torch.randn(E, I, H, generator=gen, dtype=F64) * 0.05).split(E // 2))
    wd = list((torch.randn(E, H, I, generator=gen, dtype=F64) * 0.05).split(E // 2))
    return xs, ids, ws, wg, wu, wd


class _Ctx:
    """Stands in for autograd's ctx when the binding's functions are called directly."""

    def save_for_backward(self, *t):
        self.saved_tensors = t

    def set_materialize_grads(self, value):
        self.materialize_grads = value


@pytest.mark.nvcc  # compiles the binding through load()
def test_generated_binding_autograd_plumbing():
    """The autograd functions registered by the generated binding (setup_context + backward),
    called directly with CPU tensors: saved lists are sliced back correctly, and every input of
    the op gets a gradient slot."""
    import mokgen
    from mokgen.load import load

    spec = mokgen.load_spec("qwen3-30b-a3b")
    kernel = load(spec)
    E, H = spec.num_experts, spec.hidden_size
    gen = torch.Generator().manual_seed(5)
    sizes = [6, 3]
    xs, ids, ws, wg, wu, wd = _two_rank_lists(spec, sizes, gen)
    inputs = (xs, ids, ws, wg, wu, wd, [0, 0], 0, 0, 0, 0, 16, 128, 2, 2, 1, 1, -1)

    ctx = _Ctx()
    kernel._ep_setup_context(ctx, inputs, None)
    # outputs without a gradient come as None (autograd fills no zeros for them)
    assert ctx.materialize_grads is False
    gs = [torch.randn(t, H, generator=gen, dtype=F64) for t in sizes]
    out = kernel._ep_backward(ctx, gs)
    # PyTorch requires the same structure as the inputs: a list (of grads or Nones) per list input.
    assert len(out) == len(inputs) and all(o is None for o in out[6:])
    for i in range(6):
        assert isinstance(out[i], (list, tuple)) and len(out[i]) == len(inputs[i]), i
    assert all(o is None for o in out[1])
    want = experts_backward(torch.cat(xs), torch.cat(ids), torch.cat(ws), torch.cat(wg), torch.cat(wu),
                            torch.cat(wd), torch.cat(gs))
    torch.testing.assert_close(torch.cat(out[0]), want[0])
    torch.testing.assert_close(torch.cat(out[2]), want[1])
    torch.testing.assert_close(torch.cat(out[5]), want[4])
    assert [t.shape[0] for t in out[3]] == [E // 2, E // 2]

    # rank 1's output unused: its gradient is None, and its tokens get zero gradients
    dx0 = out[0][0]
    del out, want  # the real spec's fp64 weight gradients: a few GB each
    partial = kernel._ep_backward(ctx, [gs[0], None])
    assert torch.equal(partial[0][1], torch.zeros_like(xs[1]))
    torch.testing.assert_close(partial[0][0], dx0)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("clamp", [None, 0.7])
def test_grouped_bf16_path_matches_fp64_oracle(clamp):
    """BF16 inputs take the grouped-GEMM path (torch._grouped_mm, which also runs on the CPU):
    within bf16 tolerance of the fp64 loop, with an expert that gets no rows, dropped pairs and
    bitwise-equal repeats."""
    x, ids, w, wg, wu, wd, g = _problem(T=53, H=32, I=16, E=6, K=2, seed=3)
    ids = ids % 5  # expert 5 gets no rows
    ids[7, 1] = -1  # dropped
    ids[2, 0] = 6  # out of range: dropped
    ids[7, 0], ids[2, 1] = 0, 1  # keep the remaining ids of those tokens distinct
    bf = [t.to(torch.bfloat16) for t in (x, wg, wu, wd, g)]
    inputs = (bf[0], ids, w.float(), bf[1], bf[2], bf[3], bf[4], clamp)
    got = experts_backward(*inputs)
    again = experts_backward(*inputs)
    want = experts_backward(*(t.to(F64) for t in bf[:1]), ids, w, *(t.to(F64) for t in bf[1:]), clamp)
    for name, a, b, c in zip(("dx", "dw", "dw_gate", "dw_up", "dw_down"), got, want, again):
        assert a.dtype == (torch.float32 if name == "dw" else torch.bfloat16), name
        assert torch.equal(a, c), f"{name}: not bitwise reproducible"
        assert _rel(a, b) < 2e-2, f"{name}: relative error {_rel(a, b):.3e}"
    assert got[1][7, 1] == 0 and got[1][2, 0] == 0
    assert not got[2][5].any() and not got[4][5].any()
    z = experts_backward(bf[0][:0], ids[:0], w[:0].float(), bf[1], bf[2], bf[3], bf[4][:0])
    assert z[0].shape == (0, x.shape[1]) and not z[2].any()


def test_backward_operator_opcheck_and_same_values():
    """experts_backward as an opaque torch operator (what the megakernel's autograd calls, so
    torch.compile traces it as one node): schema, fake implementation and values."""
    from mokgen.backward import experts_backward_op

    x, ids, w, wg, wu, wd, g = _problem(T=11, seed=4)
    args = (x, ids, w, wg, wu, wd, g, 0.7)
    torch.library.opcheck(experts_backward_op, args, test_utils=("test_schema", "test_faketensor"))
    for a, b in zip(experts_backward_op(*args), experts_backward(*args)):
        assert torch.equal(a, b)


def test_bf16_shapes_grouped_mm_cannot_take_use_the_loop():
    """A hidden size that is not a multiple of 8 (rows not 16-byte aligned for torch._grouped_mm)
    still gets correct BF16 gradients, through the per-expert loop."""
    from mokgen.backward import _grouped_ok

    x, ids, w, wg, wu, wd, g = _problem(T=19, H=20, I=16, seed=6)
    bf = [t.to(torch.bfloat16) for t in (x, wg, wu, wd, g)]
    assert not _grouped_ok(bf[0], *bf[1:4])
    got = experts_backward(bf[0], ids, w.float(), *bf[1:])
    want = experts_backward(*(t.to(F64) for t in bf[:1]), ids, w, *(t.to(F64) for t in bf[1:]))
    for a, b in zip(got, want):
        assert _rel(a, b) < 2e-2


def _tiny_kernel(monkeypatch, fuse: bool):
    """The tiny example spec's build (loaded on the CPU: nvcc here), with or without the shared
    expert fused: (spec, kernel module, (E, I, H, K))."""
    import mokgen
    from mokgen.load import load

    monkeypatch.setenv("MOKGEN_FUSE_SHARED", "1" if fuse else "0")
    spec = mokgen.load_spec(str(Path(__file__).resolve().parents[1] / "examples" / "tiny-moe.yaml"))
    kernel = load(spec)
    assert kernel.FUSE_SHARED == fuse
    return spec, kernel, (spec.num_experts, spec.moe_intermediate_size, spec.hidden_size, spec.top_k)


@pytest.mark.nvcc  # compiles the binding through load()
def test_generated_binding_autograd_with_the_fused_shared_expert(monkeypatch):
    """A MOKGEN_FUSE_SHARED build's autograd (CPU tensors, called directly): with the shared
    expert's weights and per-token scale among the op's inputs, the gradients are the routed
    ones plus those of scale[t] * shared_expert(x[t]) (a one-expert, top-1 layer), and the
    result has one entry per input."""
    spec, kernel, (E, I, H, K) = _tiny_kernel(monkeypatch, True)
    gen = torch.Generator().manual_seed(7)
    sizes = [5, 3]
    xs, ids, ws, wg, wu, wd = _two_rank_lists(spec, sizes, gen)
    sg, su = (torch.randn(I, H, generator=gen, dtype=F64) * 0.05 for _ in range(2))
    sd = torch.randn(H, I, generator=gen, dtype=F64) * 0.05
    scale = torch.rand(sum(sizes), generator=gen, dtype=F64)
    inputs = (xs, ids, ws, wg, wu, wd, [0, 0], 0, 0, 0, 0, 16, 128, 2, 2, 1, 1, -1, sg, su, sd, scale)

    ctx = _Ctx()
    kernel._ep_setup_context(ctx, inputs, None)
    gs = [torch.randn(t, H, generator=gen, dtype=F64) for t in sizes]
    out = kernel._ep_backward(ctx, gs)
    assert len(out) == len(inputs)
    x, g = torch.cat(xs), torch.cat(gs)
    routed = experts_backward(x, torch.cat(ids), torch.cat(ws), torch.cat(wg), torch.cat(wu), torch.cat(wd), g)
    shared = experts_backward(x, torch.zeros(len(x), 1, dtype=torch.int64), scale[:, None], sg[None], su[None],
                              sd[None], g)
    torch.testing.assert_close(torch.cat(out[0]), routed[0] + shared[0])
    torch.testing.assert_close(out[18], shared[2][0])
    torch.testing.assert_close(out[19], shared[3][0])
    torch.testing.assert_close(out[20], shared[4][0])
    torch.testing.assert_close(out[21], shared[1][:, 0])
    # and the shared part is not trivially zero
    assert shared[0].abs().sum() > 0 and out[21].abs().sum() > 0


@pytest.mark.nvcc  # compiles the binding through load()
@pytest.mark.parametrize("fuse", [False, True])
def test_op_autograd_through_the_dispatcher(monkeypatch, fuse):
    """The generated op under real autograd (a CPU kernel registered for the test; only the
    backward matters): called without the optional shared-expert arguments (default builds),
    and in a fused build with and without the scale, loss.backward() works and the gradients
    are those of mokgen.backward (PyTorch checks the backward's structure against the inputs
    actually passed, trailing defaults dropped)."""
    spec, kernel, (E, I, H, K) = _tiny_kernel(monkeypatch, fuse)
    torch.library.register_kernel(kernel.EP_OP_NAME, "cpu", lambda xs, *a, **k: [x.clone() for x in xs])
    gen = torch.Generator().manual_seed(8)
    x0 = torch.randn(5, H, generator=gen, dtype=F64)
    ids = torch.rand(5, E, generator=gen).topk(K, dim=-1).indices.to(torch.int32)
    w0 = torch.rand(5, K, generator=gen, dtype=F64)
    wg, wu = (torch.randn(E, I, H, generator=gen, dtype=F64) * 0.05 for _ in range(2))
    wd = torch.randn(E, H, I, generator=gen, dtype=F64) * 0.05
    fixed = ([0], 0, 0, 0, 0, 16, 128, 2, 2, 1, 1, -1)
    variants = [None] if not fuse else ["scale", "no-scale"]
    for variant in variants:
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        extra, leaves = (), []
        if variant is not None:
            sg, su = (torch.randn(I, H, generator=gen, dtype=F64).requires_grad_(True) for _ in range(2))
            sd = torch.randn(H, I, generator=gen, dtype=F64).requires_grad_(True)
            sc = torch.rand(5, generator=gen, dtype=F64).requires_grad_(True) if variant == "scale" else None
            extra, leaves = (sg, su, sd, sc), [sg, su, sd] + ([sc] if sc is not None else [])
        (out,) = kernel.EP_OP([x], [ids], [w], [wg], [wu], [wd], *fixed, *extra)
        out.sum().backward()
        want = experts_backward(x0, ids, w0, wg, wu, wd, torch.ones(5, H, dtype=F64))
        got_x = x.grad
        if variant is not None:
            scale = sc.detach() if sc is not None else torch.ones(5, dtype=F64)
            sh = experts_backward(x0, torch.zeros(5, 1, dtype=torch.int64), scale[:, None], sg.detach()[None],
                                  su.detach()[None], sd.detach()[None], torch.ones(5, H, dtype=F64))
            torch.testing.assert_close(sg.grad, sh[2][0])
            if sc is not None:
                torch.testing.assert_close(sc.grad, sh[1][:, 0])
            got_x = got_x - sh[0]
        torch.testing.assert_close(got_x, want[0])
        torch.testing.assert_close(w.grad, want[1])
        assert all(t.grad is not None for t in leaves)


def _bf16_problem(T=29, H=32, I=16, E=6, K=2, seed=9):
    x, ids, w, wg, wu, wd, g = _problem(T=T, H=H, I=I, E=E, K=K, seed=seed)
    bf = [t.to(torch.bfloat16) for t in (x, wg, wu, wd, g)]
    return bf[0], ids, w.float(), bf[1], bf[2], bf[3], bf[4]


def _pre_activations(x, ids, wg, wu):
    """What the forward's save_gu output holds: row t * K + j = bf16 [g | u] of pair (t, j)."""
    T, K = ids.shape
    rows = x.float().repeat_interleave(K, dim=0)
    e = ids.reshape(-1)
    g = torch.einsum("ph,pih->pi", rows, wg.float()[e])
    u = torch.einsum("ph,pih->pi", rows, wu.float()[e])
    return torch.cat([g, u], dim=1).to(torch.bfloat16)


@pytest.mark.parametrize("clamp", [None, 0.7])
def test_saved_pre_activations_replace_the_recompute(clamp):
    """The "save" policy on the grouped path (torch._grouped_mm runs on the CPU): gradients from
    the forward's saved g and u agree with the recompute's within bf16 rounding and with the
    fp64 oracle, repeat bit for bit, and really come from the saved rows (rows moved to other
    pairs change them)."""
    x, ids, w, wg, wu, wd, g = _bf16_problem()
    gu = _pre_activations(x, ids, wg, wu)
    saved = experts_backward(x, ids, w, wg, wu, wd, g, clamp, saved_gu=gu)
    again = experts_backward(x, ids, w, wg, wu, wd, g, clamp, saved_gu=gu)
    recomputed = experts_backward(x, ids, w, wg, wu, wd, g, clamp)
    oracle = experts_backward(x.double(), ids, w.double(), wg.double(), wu.double(), wd.double(), g.double(), clamp)
    for name, a, b, c, d in zip(("dx", "dw", "dw_gate", "dw_up", "dw_down"), saved, again, recomputed, oracle):
        assert torch.equal(a, b), f"{name}: not bitwise reproducible"
        assert _rel(a, c) < 1e-2, f"{name}: saved vs recomputed {_rel(a, c):.3e}"
        assert _rel(a, d) < 2e-2, f"{name}: saved vs oracle {_rel(a, d):.3e}"
    moved = experts_backward(x, ids, w, wg, wu, wd, g, clamp, saved_gu=gu.roll(1, dims=0))
    assert _rel(moved[0], saved[0]) > 0.1 and _rel(moved[2], saved[2]) > 0.1


def test_saved_pre_activations_of_the_wrong_shape_are_one_clear_error():
    from mokgen.errors import InputError

    x, ids, w, wg, wu, wd, g = _bf16_problem()
    gu = _pre_activations(x, ids, wg, wu)
    for bad in (gu[:-1], gu[:, :-2], gu.float(), gu.t().contiguous().t()):
        with pytest.raises(InputError, match=r"saved_gu must be a contiguous bf16 tensor \[T \* K, 2 I\]"):
            experts_backward(x, ids, w, wg, wu, wd, g, saved_gu=bad)


def test_pairs_expert_major_counts_without_waiting():
    from mokgen.backward import _pairs_expert_major

    ids = torch.tensor([[3, 0], [-1, 3], [7, 1], [0, 3]])
    order, counts, n = _pairs_expert_major(ids, 4)
    order2, counts2, n2 = _pairs_expert_major(ids, 4, count=False)
    assert n == 6 and n2 is None
    assert torch.equal(order, order2) and torch.equal(counts, counts2)
    assert counts.tolist() == [2, 1, 0, 3]
    assert order.tolist()[:6] == [1, 6, 5, 0, 3, 7]  # expert-major, pair order within an expert
    assert sorted(order.tolist()[6:]) == [2, 4]  # the dropped pairs last


def test_passed_inputs_drops_trailing_defaults_only():
    from mokgen.backward import passed_inputs

    defaults = (None, None, None, None, False)
    req = tuple(range(18))
    assert passed_inputs(req + (None,) * 4 + (False,), 18, defaults) == (18, [None] * 4 + [False])
    n, opt = passed_inputs(req + (None,) * 4 + (True,), 18, defaults)
    assert n == 23 and opt[4] is True
    t = torch.zeros(1)
    n, opt = passed_inputs(req + (t, t, t, None, False), 18, defaults)
    assert n == 21 and opt[:3] == [t, t, t] and opt[3] is None
    assert passed_inputs(req, 18, defaults) == (18, [None] * 4 + [False])


def test_save_is_asked_only_where_the_backward_can_use_it():
    from types import SimpleNamespace

    from mokgen.ep import _bwd_policy, _tail_args
    from mokgen.errors import InputError

    can, cannot = SimpleNamespace(CAN_SAVE=True), SimpleNamespace(CAN_SAVE=False)
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(2)
    shared = (b, b, b, None)
    assert _tail_args(can, "save", True, (), (a, b)) == (None, None, None, None, True)
    assert _tail_args(can, "save", True, shared, (a, b)) == (*shared, True)
    assert _tail_args(can, "recompute", True, shared, (a, b)) == shared
    assert _tail_args(cannot, "save", True, (), (a, b)) == ()
    assert _tail_args(can, "save", False, (), (a, b)) == ()  # a multi-GPU layer: its pairs are elsewhere
    assert _tail_args(can, "save", True, (), (b,)) == ()  # nothing requires a gradient
    with torch.no_grad():
        assert _tail_args(can, "save", True, (), (a, b)) == ()
    with pytest.raises(InputError, match="bwd_policy must be one of save, recompute"):
        _bwd_policy("keep")


def test_ring_reuse_bookkeeping(monkeypatch):
    """The backward's ring lookup (mokgen.ep.ring_rows_of): rows only for the launch whose x and
    ids it was given (same storage, shape and version), while the ring holds T K rows, never
    after a capture or under no key; the "reuse" sizing; the bwd_ring checks."""
    import weakref

    from mokgen import ep, env
    from mokgen.errors import InputError, ToolchainError
    from mokgen.spec import load_spec

    class Bufs:  # what ring_rows_of reads of an EpBuffers
        def __init__(self, ring_rows, H):
            self.ring_rows, self.H, self.ring_key, self.ring_untracked = ring_rows, H, None, False
            self.storage = torch.arange(ring_rows * H, dtype=torch.float32).to(torch.bfloat16)

        def ring_x(self, rows):
            return None if rows > self.ring_rows else self.storage[: rows * self.H].view(rows, self.H)

    T, K, H = 6, 2, 4
    x, ids = torch.randn(T, H).to(torch.bfloat16), torch.zeros(T, K, dtype=torch.int32)
    bufs = Bufs(16, H)
    monkeypatch.setitem(ep._RING_OWNERS, 1234, weakref.ref(bufs))
    assert ep.ring_rows_of(1234, x, ids) is None  # no launch recorded
    bufs.ring_key = ep._ring_key(x, ids)
    rows = ep.ring_rows_of(1234, x, ids)
    assert rows.shape == (T * K, H) and rows.data_ptr() == bufs.storage.data_ptr()
    assert ep.ring_rows_of(None, x, ids) is None and ep.ring_rows_of(99, x, ids) is None
    assert ep.ring_rows_of(1234, x.clone(), ids) is None  # another x: another launch's rows
    assert ep.ring_rows_of(1234, x, ids.clone()) is None
    assert ep.ring_rows_of(1234, x[:5], ids[:5]) is None  # a view of the same storage
    x.add_(1)  # the same tensor, written since
    assert ep.ring_rows_of(1234, x, ids) is None
    bufs.ring_key = ep._ring_key(x, ids)
    assert ep.ring_rows_of(1234, x, ids) is not None
    bufs.ring_untracked = True  # a CUDA graph captured a launch: its replays are invisible
    assert ep.ring_rows_of(1234, x, ids) is None
    bufs.ring_untracked, bufs.ring_rows = False, T * K - 1  # a ring of fewer rows than pairs
    assert ep.ring_rows_of(1234, x, ids) is None
    del bufs
    assert ep.ring_rows_of(1234, x, ids) is None  # the layer is gone

    spec = load_spec("qwen3-30b-a3b")  # top-8
    assert ep._ring_for_backward(spec, 1, 16384, 8192, 4, "reuse") == 16
    assert ep._ring_for_backward(spec, 1, 1000, 1024, 2, "reuse") == 8
    assert ep._ring_for_backward(spec, 1, 100, 8192, 4, "reuse") == 4  # already holds them
    assert ep._ring_for_backward(spec, 1, 16384, 8192, 4, "auto") == 4  # 16 chunks: more than twice 4
    assert ep._ring_for_backward(spec, 1, 16384, 8192, 8, "auto") == 16  # twice 8: grown
    assert ep._ring_for_backward(spec, 1, 16384, 8192, 8, "auto", explicit=True) == 8  # the caller's size
    assert ep._ring_for_backward(spec, 1, 2560, 4096, 4, "auto") == 5
    assert ep._ring_for_backward(spec, 1, 100, 8192, 4, "auto") == 4  # already holds them
    assert ep._ring_for_backward(spec, 1, 16384, 8192, 8, "gather") == 8
    assert ep._ring_for_backward(spec, 2, 16384, 8192, 8, "auto") == 8  # across GPUs: not in this ring
    assert ep._ring_for_backward(spec, 2, 16384, 8192, 4, "reuse") == 4  # across GPUs: not in this ring
    with pytest.raises(InputError, match="16448 x 8 rows need 1028 ring chunks of 128 rows, more than 1024"):
        ep._ring_for_backward(spec, 1, 16448, 128, 4, "reuse")
    with pytest.raises(InputError, match="bwd_ring must be one of auto, reuse, gather, got 'keep'"):
        ep._bwd_ring("keep")
    monkeypatch.delenv("MOKGEN_BWD_RING", raising=False)
    assert ep._bwd_ring(None) == "auto" and ep._bwd_ring("gather") == "gather"
    monkeypatch.setenv("MOKGEN_BWD_RING", "reuse")
    assert ep._bwd_ring(None) == "reuse"
    monkeypatch.setenv("MOKGEN_BWD_RING", "always")
    with pytest.raises(ToolchainError, match="MOKGEN_BWD_RING must be auto or reuse or gather"):
        env.bwd_ring()


def test_shared_layer_buffers_pool(monkeypatch):
    """mokgen.ep.layer_buffers: without share, always new buffers, never pooled; with it, the
    first layer of a key makes them and the next find them, until the last holder is gone;
    another key gets its own. MoELayer refuses share_buffers with the reused ring before any
    device work, and groups become keys by identity."""
    import gc

    from mokgen import ep
    from mokgen.errors import InputError

    class Bufs:  # stands in for EpBuffers (anything weakly referenced)
        pass

    monkeypatch.setattr(ep, "_SHARED_BUFFERS", __import__("weakref").WeakValueDictionary())
    made = []

    def make():
        made.append(Bufs())
        return made[-1]

    a, shared = ep.layer_buffers(("k", 1), make, False)
    assert not shared and len(made) == 1 and len(ep._SHARED_BUFFERS) == 0
    b, shared = ep.layer_buffers(("k", 1), make, True)
    assert not shared and b is not a and len(made) == 2
    c, shared = ep.layer_buffers(("k", 1), make, True)
    assert shared and c is b and len(made) == 2
    d, shared = ep.layer_buffers(("k", 2), make, True)
    assert not shared and d is not b and len(made) == 3
    e, shared = ep.layer_buffers(("k", 1), make, False)  # not asked to share: its own
    assert not shared and e is not b
    del b, c, made[:]
    gc.collect()
    assert ("k", 1) not in ep._SHARED_BUFFERS and ("k", 2) in ep._SHARED_BUFFERS
    _, shared = ep.layer_buffers(("k", 1), make, True)
    assert not shared and len(made) == 1

    class Unhashable:
        __hash__ = None

    g = Unhashable()
    assert ep._group_key(None) is None and ep._group_key(g) == ("id", id(g))
    h = object()
    assert ep._group_key(h) is h
    with pytest.raises(InputError, match="bwd_ring='reuse' keeps every row .* share_buffers=True"):
        ep.MoELayer("qwen3-30b-a3b", bwd_ring="reuse", share_buffers=True)


def test_shared_layer_buffers_agree_across_ranks(monkeypatch):
    """Under a process group, layer_buffers asks the ranks (one all-reduce of minima and maxima,
    here a stand-in that plays the other ranks): a set is reused only where every rank holds one
    and the same one (its number); a rank without one, or with another set, makes every rank
    allocate afresh; ranks that disagree on share_buffers get an InputError before anything is
    allocated; a layer that does not share still takes part in the all-reduce."""
    import weakref

    from mokgen import ep
    from mokgen.errors import InputError

    class Bufs:
        pass

    monkeypatch.setattr(ep, "_SHARED_BUFFERS", weakref.WeakValueDictionary())
    others = {}  # what the other ranks report: share flag, hit flag, set number
    calls = []

    def agree(values, group):
        calls.append((list(values), group))
        rows = [values, [others.get("share", values[0]), others.get("hit", values[1]), others.get("number", values[2])]]
        return [min(c) for c in zip(*rows)], [max(c) for c in zip(*rows)]

    group = object()
    made = []

    def make():
        made.append(Bufs())
        return made[-1]

    a, shared = ep.layer_buffers(("k",), make, True, group, agree)
    assert not shared and calls[-1][0] == [1, 0, 0] and calls[-1][1] is group
    b, shared = ep.layer_buffers(("k",), make, True, group, agree)  # every rank holds the same set
    assert shared and b is a and calls[-1][0] == [1, 1, a.set_number]
    others["hit"] = 0  # another rank lost its set: everyone allocates
    c, shared = ep.layer_buffers(("k",), make, True, group, agree)
    assert not shared and c is not a and ep._SHARED_BUFFERS[("k",)] is c
    others.update(hit=1, number=c.set_number + 5)  # another rank holds a set made elsewhere
    d, shared = ep.layer_buffers(("k",), make, True, group, agree)
    assert not shared and d is not c
    others.clear()
    n = len(made)
    _, shared = ep.layer_buffers(("j",), make, False, group, agree)  # not sharing: still asks
    assert not shared and calls[-1][0] == [0, 0, 0] and len(made) == n + 1
    others["share"] = 0
    with pytest.raises(InputError, match="share_buffers differs between the ranks"):
        ep.layer_buffers(("k",), make, True, group, agree)
    assert len(made) == n + 1  # nothing allocated
    assert len({x.set_number for x in made}) == len(made)  # numbered in order


def test_env_reuse_gives_way_for_shared_buffers(monkeypatch):
    """MOKGEN_BWD_RING=reuse in the environment does not refuse a sharing layer (as an explicit
    bwd_ring='reuse' does): it warns and takes auto. Checked up to the first device step."""
    from mokgen import ep

    import sys

    monkeypatch.setenv("MOKGEN_BWD_RING", "reuse")
    seen = []

    def stop(*args, **kwargs):  # the layer's choice so far, then out before any device work
        seen.append(sys._getframe(1).f_locals["self"].bwd_ring)
        raise RuntimeError("stop before any device work")

    monkeypatch.setattr(ep, "_ring", stop)
    with pytest.warns(UserWarning, match="MOKGEN_BWD_RING=reuse does not apply"), \
            pytest.raises(RuntimeError, match="stop before"):
        ep.MoELayer("qwen3-30b-a3b", share_buffers=True)
    assert seen == ["auto"]
    with pytest.raises(RuntimeError, match="stop before"):  # a layer of its own keeps the switch's reuse
        ep.MoELayer("qwen3-30b-a3b")
    assert seen == ["auto", "reuse"]


def test_ring_rows_are_checked_and_ignored_off_mokgens_gemms():
    """experts_backward's ring_x: a wrong shape or dtype is a clear error; where mokgen's GEMMs
    do not run (here, on the CPU), the rows are gathered from x and ring_x is not read."""
    from mokgen.errors import InputError

    torch.manual_seed(3)
    T, K, E, H, I = 9, 2, 4, 16, 8
    x = torch.randn(T, H).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    wg, wu = (torch.randn(E, I, H) * 0.3).to(torch.bfloat16), (torch.randn(E, I, H) * 0.3).to(torch.bfloat16)
    wd = (torch.randn(E, H, I) * 0.3).to(torch.bfloat16)
    g = torch.randn(T, H).to(torch.bfloat16)
    want = experts_backward(x, ids, w, wg, wu, wd, g)
    got = experts_backward(x, ids, w, wg, wu, wd, g, ring_x=torch.full((T * K, H), float("nan"), dtype=torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for bad in (torch.zeros(T * K - 1, H, dtype=torch.bfloat16), torch.zeros(T * K, H), torch.zeros(H, T * K).t()):
        with pytest.raises(InputError, match=r"ring_x must be a contiguous bf16 tensor \[T \* K, H\] = \(18, 16\)"):
            experts_backward(x, ids, w, wg, wu, wd, g, ring_x=bad)


def test_policy_switches(monkeypatch):
    from mokgen import env
    from mokgen.errors import ToolchainError

    monkeypatch.delenv("MOKGEN_BWD_POLICY", raising=False)
    monkeypatch.delenv("MOKGEN_BWD_GEMM", raising=False)
    assert env.bwd_policy() == "save" and env.bwd_gemm_enabled()
    monkeypatch.setenv("MOKGEN_BWD_POLICY", "recompute")
    monkeypatch.setenv("MOKGEN_BWD_GEMM", "0")
    assert env.bwd_policy() == "recompute" and not env.bwd_gemm_enabled()
    monkeypatch.setenv("MOKGEN_BWD_POLICY", "sometimes")
    with pytest.raises(ToolchainError, match="MOKGEN_BWD_POLICY must be save or recompute"):
        env.bwd_policy()
    for name, read, bad in (("MOKGEN_BWD_DX_PAIRS", env.bwd_dx_pairs, "fp16"), ("MOKGEN_BWD_DH", env.bwd_dh, "tf32")):
        monkeypatch.delenv(name, raising=False)
        assert read() == "bf16"
        monkeypatch.setenv(name, "fp32")
        assert read() == "fp32"
        monkeypatch.setenv(name, bad)
        with pytest.raises(ToolchainError, match=f"{name} must be bf16 or fp32"):
            read()
    monkeypatch.delenv("MOKGEN_BWD_DOUT", raising=False)
    from mokgen.backward import dout_inline

    # auto: dh and dW_down load dOut's rows through the token index where a token has several
    # pairs, and read a gathered copy for one pair per row (v0.22's measurements)
    assert env.bwd_dout() == "auto" and dout_inline(8) and dout_inline(2) and not dout_inline(1)
    monkeypatch.setenv("MOKGEN_BWD_DOUT", "gather")
    assert env.bwd_dout() == "gather" and not dout_inline(8)
    monkeypatch.setenv("MOKGEN_BWD_DOUT", "inline")
    assert dout_inline(1) and dout_inline(8)
    monkeypatch.setenv("MOKGEN_BWD_DOUT", "tma")
    with pytest.raises(ToolchainError, match="MOKGEN_BWD_DOUT must be auto or inline or gather"):
        env.bwd_dout()
    from mokgen.backward import x_inline

    for name in ("MOKGEN_BWD_X", "MOKGEN_BWD_WEIGHTS", "MOKGEN_BWD_WEIGHTS_JOINT", "MOKGEN_BWD_CLUSTER"):
        monkeypatch.delenv(name, raising=False)
    # auto: the joint weight gradients load x's rows through the token index where a token has
    # several pairs, and read a gathered copy for one pair per row (v0.25's measurements)
    assert env.bwd_x() == "auto" and x_inline(True, True, 8) and not x_inline(True, True, 1)
    monkeypatch.setenv("MOKGEN_BWD_X", "gather")
    assert not x_inline(True, True, 8)
    monkeypatch.setenv("MOKGEN_BWD_X", "inline")
    # only the save policy's joint launch, single CTAs, with weight gradients, has a gathered B
    assert x_inline(True, True, 1) and not x_inline(False, True, 8) and not x_inline(True, False, 8)
    for name, value in (("MOKGEN_BWD_WEIGHTS", "pingpong"), ("MOKGEN_BWD_WEIGHTS_JOINT", "0"),
                        ("MOKGEN_BWD_CLUSTER", "2")):
        monkeypatch.setenv(name, value)
        assert not x_inline(True, True, 8), name
        monkeypatch.delenv(name)
    monkeypatch.setenv("MOKGEN_BWD_X", "ring")
    with pytest.raises(ToolchainError, match="MOKGEN_BWD_X must be auto or inline or gather"):
        env.bwd_x()
    monkeypatch.delenv("MOKGEN_BWD_X")
    monkeypatch.delenv("MOKGEN_BWD_WEIGHTS_JOINT", raising=False)
    assert env.bwd_weights_joint()  # one launch for the gate's and up's weight gradients (v0.21)
    monkeypatch.setenv("MOKGEN_BWD_WEIGHTS_JOINT", "0")
    assert not env.bwd_weights_joint()
    monkeypatch.setenv("MOKGEN_BWD_WEIGHTS_JOINT", "yes")
    with pytest.raises(ToolchainError, match="MOKGEN_BWD_WEIGHTS_JOINT must be 1 or 0"):
        env.bwd_weights_joint()
    monkeypatch.delenv("MOKGEN_BWD_SUM", raising=False)
    assert env.bwd_sum() == "side"  # dX's slot sum inside the joint weight launch (measured, v0.47)
    monkeypatch.setenv("MOKGEN_BWD_SUM", "apart")
    assert env.bwd_sum() == "apart"
    monkeypatch.setenv("MOKGEN_BWD_SUM", "fused")
    with pytest.raises(ToolchainError, match="MOKGEN_BWD_SUM must be side or apart"):
        env.bwd_sum()


@pytest.mark.nvcc  # compiles the binding through load()
def test_op_autograd_with_saved_pre_activations(monkeypatch):
    """The generated op under real autograd with save_gu=True (a CPU kernel stands in for the
    megakernel and returns the outputs plus the pairs' pre-activations): the extra output is
    kept for the backward, which uses it (a wrong one changes the gradients) and gives the
    recompute's gradients from the right one; the backward's structure fits the inputs."""
    spec, kernel, (E, I, H, K) = _tiny_kernel(monkeypatch, False)
    assert kernel.CAN_SAVE
    gen = torch.Generator().manual_seed(10)
    x0 = (torch.randn(9, H, generator=gen)).to(torch.bfloat16)
    ids = torch.rand(9, E, generator=gen).topk(K, dim=-1).indices.to(torch.int32)
    w0 = torch.rand(9, K, generator=gen)
    wg, wu = ((torch.randn(E, I, H, generator=gen) * H**-0.5).to(torch.bfloat16) for _ in range(2))
    wd = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(torch.bfloat16)
    good = _pre_activations(x0, ids.long(), wg, wu)
    stand_in = {"gu": good}

    def cpu_kernel(xs, ids_, ws, *a, **k):
        outs = [x.clone() for x in xs]
        return outs + [stand_in["gu"].clone()] if (a[-1] is True or k.get("save_gu")) else outs

    torch.library.register_kernel(kernel.EP_OP_NAME, "cpu", cpu_kernel)
    fixed = ([0], 0, 0, 0, 0, 16, 128, 2, 2, 1, 1, -1)
    go = torch.randn(9, H, generator=gen).to(torch.bfloat16)

    def grads(tail):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        outs = kernel.EP_OP([x], [ids], [w], [wg], [wu], [wd], *fixed, *tail)
        assert len(outs) == (2 if tail else 1)
        outs[0].backward(go)
        return x.grad, w.grad

    recomputed = grads(())
    saved = grads((None, None, None, None, True))
    for a, b in zip(saved, recomputed):
        assert _rel(a, b) < 1e-2
    stand_in["gu"] = good.roll(1, dims=0)
    wrong = grads((None, None, None, None, True))
    assert _rel(wrong[0], saved[0]) > 0.1


@pytest.mark.nvcc  # compiles the binding through load()
@pytest.mark.parametrize("fuse, tail", [(False, "none"), (False, "save"), (True, "scale"), (True, "no-scale")])
def test_eager_form_has_the_registered_ops_gradients(monkeypatch, fuse, tail):
    """EP_EAGER (the op's implementation and backward as a plain autograd.Function) and
    mokgen.ep's launch-then-record form (what MoELayer calls outside torch.compile where autograd
    records: the implementation first, then ``_LaunchedEp`` around its outputs) against EP_OP
    through the dispatcher, with one CPU stand-in for the megakernel behind all three: the same
    outputs and the same gradients for x, the routing weights, the experts and the shared
    expert, with and without the saved pre-activations."""
    from mokgen import ep as ep_mod

    spec, kernel, (E, I, H, K) = _tiny_kernel(monkeypatch, fuse)
    gen = torch.Generator().manual_seed(12)
    T = 7
    x0 = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices.to(torch.int32)
    w0 = torch.rand(T, K, generator=gen)
    wg, wu = ((torch.randn(E, I, H, generator=gen) * H**-0.5).to(torch.bfloat16) for _ in range(2))
    wd = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(torch.bfloat16)
    gu = _pre_activations(x0, ids.long(), wg, wu)

    def stand_in(xs, ids_, ws, *a, **k):
        outs = [x * 2 for x in xs]
        return outs + [gu.clone()] if (a[-1] is True or k.get("save_gu")) else outs

    torch.library.register_kernel(kernel.EP_OP_NAME, "cpu", stand_in)
    monkeypatch.setattr(kernel, "_ep_forward", stand_in)
    fixed = ([0], 0, 0, 0, 0, 16, 128, 2, 2, 1, 1, -1)
    go = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    shared0 = [(torch.randn(I, H, generator=gen) * 0.05).to(torch.bfloat16) for _ in range(2)]
    shared0.append((torch.randn(H, I, generator=gen) * 0.05).to(torch.bfloat16))
    scale0 = torch.rand(T, generator=gen)

    def run(op):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        leaves = [x, w]
        extra = ()
        if tail == "save":
            extra = (None, None, None, None, True)
        elif fuse:
            sh = [t.clone().requires_grad_(True) for t in shared0]
            sc = scale0.clone().requires_grad_(True) if tail == "scale" else None
            extra = (*sh, sc)
            leaves += sh + ([sc] if sc is not None else [])
        outs = op([x], [ids], [w], [wg], [wu], [wd], *fixed, *extra)
        outs[0].backward(go)
        return [o.detach() for o in outs], [t.grad for t in leaves]

    outs_op, grads_op = run(kernel.EP_OP)
    for form in (kernel.EP_EAGER, lambda *args: ep_mod._launch_then_record(kernel, args)):
        outs_eager, grads_eager = run(form)
        assert len(outs_op) == len(outs_eager) == (2 if tail == "save" else 1)
        for a, b in zip(outs_op, outs_eager):
            assert torch.equal(a, b)
        assert all(g is not None for g in grads_eager)
        for a, b in zip(grads_op, grads_eager):
            assert torch.equal(a, b)
        if tail == "save":
            assert not outs_eager[1].requires_grad  # the pre-activations get no gradient


def test_a_recorded_eager_call_launches_before_autograd_records_it(monkeypatch):
    """mokgen.ep._call_op under autograd, eager: the binding's implementation (the launch) runs
    before the binding's _ep_setup_context (the autograd node's work), so that work is host time
    after the launch; the outputs carry the node, and its backward is the binding's
    _EagerEp.backward, one gradient per tensor input. Without autograd the implementation runs alone, and a binding
    without the pieces falls back to EP_EAGER (which records first)."""
    from types import SimpleNamespace

    from mokgen import ep as ep_mod

    order = []
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.rand(3, 2, requires_grad=True)
    ids = torch.zeros(3, 2, dtype=torch.int32)
    wg, wu, wd = (torch.randn(2, 4, 4, requires_grad=True) for _ in range(3))

    def raw(xs, ids_, ws, *rest):
        order.append("launch")
        assert len(rest) in (3 + 12, 3 + 12 + 5)  # w_gate .. w_down, the 12 scalars, the optional ones
        return [xs[0].detach() * 2]

    def setup(ctx, inputs, outs):
        order.append("record")
        ctx.counts, ctx.shared = (1, 1), (False,) * 4

    def backward(ctx, *gs):  # as the binding's _EagerEp.backward: its layout's None, then per tensor
        order.append("backward")
        return (None, gs[0] * 2, None, torch.ones_like(w), torch.zeros_like(wg), torch.zeros_like(wu),
                torch.zeros_like(wd))

    k = SimpleNamespace(_ep_forward=raw, _ep_setup_context=setup, _EagerEp=SimpleNamespace(backward=backward),
                        _OPTIONAL_DEFAULTS=(None,) * 4 + (False,), EP_EAGER="eager", EP_OP="op")
    args = ([x], [ids], [w], [wg], [wu], [wd], *([0] * 12))
    out = ep_mod._call_op(k, (x, w, wg, wu, wd), args, ())[0]
    assert order == ["launch", "record"]
    assert out.grad_fn is not None
    out.sum().backward()
    assert order == ["launch", "record", "backward"]
    assert torch.equal(x.grad, torch.full_like(x, 2.0)) and torch.equal(w.grad, torch.ones_like(w))
    order.clear()
    with torch.no_grad():
        out = ep_mod._call_op(k, (x, w, wg, wu, wd), args, ())[0]
    assert order == ["launch"] and out.grad_fn is None
    old = SimpleNamespace(_ep_forward=raw, EP_EAGER=lambda *a: ["eager"], EP_OP="op")
    assert ep_mod._call_op(old, (x, w, wg, wu, wd), args, ()) == ["eager"]


def test_entry_without_a_graph_is_the_binding_itself(monkeypatch):
    """mokgen.ep._op: the registered op while torch.compile traces; outside it the eager form
    where autograd records a graph, and the binding's implementation (_ep_forward, what both
    wrap) where it does not (no autograd.Function's apply before the launch); a build without
    the eager form falls back to the op. _records_grad: grad mode on and a tensor requiring grad."""
    from types import SimpleNamespace

    from mokgen import ep as ep_mod

    k = SimpleNamespace(EP_OP="op", EP_EAGER="eager", _ep_forward="raw")
    assert ep_mod._op(k, grad=True) == "eager"
    assert ep_mod._op(k, grad=False) == "raw"
    assert ep_mod._op(SimpleNamespace(EP_OP="op"), grad=True) == "op"
    assert ep_mod._op(SimpleNamespace(EP_OP="op", EP_EAGER="eager"), grad=False) == "eager"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert ep_mod._op(k, grad=False) == "op"
    monkeypatch.undo()
    a, b = torch.zeros(2), torch.zeros(2, requires_grad=True)
    assert ep_mod._records_grad((a, None, b))
    assert not ep_mod._records_grad((a, None))
    with torch.no_grad():
        assert not ep_mod._records_grad((a, b))


def test_weight_launches_overlap_only_where_both_fit_on_the_sms(monkeypatch):
    """MOKGEN_BWD_OVERLAP auto: dW_down beside the joint dW_gate / dW_up launch only on the split
    schedule with the joint launch, outside graph capture, and where the two launches' tiles fit
    on the SMs together (qwen3.5-35b-a3b's shared expert: 32 + 64 tiles of 132; its routed
    experts, or kimi-k2.5's shared expert, far more); 0: never; anything else refused."""
    import types

    from mokgen import backward, bwd_gemm
    from mokgen.errors import ToolchainError

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for name in ("MOKGEN_BWD_OVERLAP", "MOKGEN_BWD_WEIGHTS_JOINT"):
        monkeypatch.delenv(name, raising=False)
    assert bwd_gemm.weight_tiles(1, 2048, 512) == 32 and bwd_gemm.weight_tiles(1, 512, 2048) == 8 * 4
    assert bwd_gemm.weight_tiles(1, 512, 2048, "pingpong") == 64
    fits = lambda E, H, I, schedule="split": backward.overlap_weight_launches(E, H, I, "cuda:0", schedule)  # noqa: E731
    assert fits(1, 2048, 512)            # 32 + 64 tiles
    assert not fits(2, 2048, 512)        # 64 + 128
    assert not fits(1, 7168, 2048)       # kimi-k2.5's shared expert: 448 + 896
    assert not fits(1, 2048, 512, "pingpong")
    monkeypatch.setenv("MOKGEN_BWD_WEIGHTS_JOINT", "0")
    assert not fits(1, 2048, 512)
    monkeypatch.delenv("MOKGEN_BWD_WEIGHTS_JOINT")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not fits(1, 2048, 512)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("MOKGEN_BWD_OVERLAP", "0")
    assert not fits(1, 2048, 512)
    monkeypatch.setenv("MOKGEN_BWD_OVERLAP", "1")
    with pytest.raises(ToolchainError, match="MOKGEN_BWD_OVERLAP must be auto or 0"):
        fits(1, 2048, 512)


def test_shared_op_backward_is_a_one_expert_layer_of_the_scaled_tokens():
    """The fused shared expert's backward (fp64 on the CPU, the per-expert loop): dx per rank, the
    three weight gradients and d scale are autograd's through scale[t] * shared_expert(x[t]), for
    one rank and for two virtual ranks (their tokens concatenated in order)."""
    from mokgen.backward import shared_op_backward

    gen = torch.Generator().manual_seed(21)
    H, I = 64, 32
    wg, wu = (torch.randn(I, H, generator=gen, dtype=torch.float64) * H**-0.5 for _ in range(2))
    wd = torch.randn(H, I, generator=gen, dtype=torch.float64) * I**-0.5
    for sizes in ([7], [5, 9]):
        xs = [torch.randn(n, H, generator=gen, dtype=torch.float64) for n in sizes]
        gs = [torch.randn(n, H, generator=gen, dtype=torch.float64) for n in sizes]
        scale = torch.rand(sum(sizes), generator=gen, dtype=torch.float64)
        dxs, (dg, du, dd, ds) = shared_op_backward(xs, wg, wu, wd, scale, gs)
        leaves = [t.clone().requires_grad_(True) for t in (*xs, wg, wu, wd, scale)]
        x = torch.cat(leaves[: len(xs)])
        lg, lu, ld, ls = leaves[len(xs):]
        y = ls[:, None] * (swiglu(x @ lg.T, x @ lu.T) @ ld.T)
        y.backward(torch.cat(gs))
        for got, leaf in zip([*dxs, dg, du, dd, ds], leaves):
            assert torch.allclose(got, leaf.grad, rtol=1e-10, atol=1e-12)
