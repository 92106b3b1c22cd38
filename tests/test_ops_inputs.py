"""mokgen.ops input validation on CPU tensors (no GPU, no build).

Every call runs with MOKGEN_DISABLE_JIT=1 and an empty private cache, so a call that reached the
loader would raise LoadError: getting InputError proves validation happens before any build or
load."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import mokgen  # noqa: E402
from mokgen import load as load_mod  # noqa: E402
from mokgen.errors import InputError, MokgenError  # noqa: E402
from mokgen.ops import validate_forward_inputs  # noqa: E402
from mokgen.spec import spec_from_dict  # noqa: E402

H, I, E, K, T = 256, 128, 4, 2, 6

SPEC = spec_from_dict(
    {
        "name": "tiny-test",
        "hidden_size": H,
        "moe_intermediate_size": I,
        "num_experts": E,
        "top_k": K,
        "routing": {"scoring": "softmax"},
    },
    source="test",
)


@pytest.fixture(autouse=True)
def _no_build(tmp_path, monkeypatch):
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MOKGEN_DISABLE_JIT", "1")
    monkeypatch.setattr(load_mod, "_by_spec", {})
    monkeypatch.setattr(load_mod, "_by_key", {})
    yield
    assert not (tmp_path / "cache").exists(), "validation must not build anything"


def _args(T=T, **changes):
    gen = torch.Generator().manual_seed(0)
    args = {
        "x": torch.randn(T, H, generator=gen).to(torch.bfloat16),
        "topk_ids": torch.randint(0, E, (T, K), generator=gen, dtype=torch.int64),
        "topk_weights": torch.rand(T, K, generator=gen),
        "w_gate": torch.randn(E, I, H, generator=gen).to(torch.bfloat16),
        "w_up": torch.randn(E, I, H, generator=gen).to(torch.bfloat16),
        "w_down": torch.randn(E, H, I, generator=gen).to(torch.bfloat16),
    }
    args.update(changes)
    return args


def _call(spec=SPEC, **changes):
    a = _args(**changes)
    return mokgen.experts_forward(
        a["x"], a["topk_ids"], a["topk_weights"], a["w_gate"], a["w_up"], a["w_down"], spec=spec
    )


def _expect(argname: str, pattern: str, spec=SPEC, **changes):
    with pytest.raises(InputError, match=pattern) as info:
        _call(spec, **changes)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{argname}: "), message
    # input errors are also ValueErrors (ordinary except clauses catch them)
    assert isinstance(info.value, ValueError) and isinstance(info.value, MokgenError)
    return message


# ---- dtypes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argname, bad",
    [
        ("x", torch.float32),
        ("x", torch.float16),
        ("topk_ids", torch.float32),
        ("topk_ids", torch.int16),
        ("topk_weights", torch.int64),
        ("w_gate", torch.float32),
        ("w_up", torch.float16),
        ("w_down", torch.float32),
    ],
)
def test_wrong_dtype(argname, bad):
    good = _args()[argname]
    message = _expect(argname, "dtype must be", **{argname: good.to(bad)})
    assert str(bad) in message


def test_not_a_tensor():
    _expect("topk_weights", "expected a torch.Tensor, got list", topk_weights=[[0.5, 0.5]] * T)


# ---- shapes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argname, shape",
    [
        ("x", (T, H + 128)),
        ("x", (T, H, 1)),
        ("x", (H,)),
        ("topk_ids", (T, K + 1)),
        ("topk_ids", (T + 1, K)),
        ("topk_weights", (T, 1)),
        ("topk_weights", (T * K,)),
        ("w_gate", (E + 1, I, H)),
        ("w_gate", (E, H, I)),  # transposed
        ("w_up", (E, I, H + 128)),
        ("w_down", (E, I, H)),  # the gate/up layout instead of [E, H, I]
        ("w_down", (E, H * I)),
    ],
)
def test_wrong_shape(argname, shape):
    good = _args()[argname]
    bad = torch.zeros(shape, dtype=good.dtype)
    message = _expect(argname, "shape must be", **{argname: bad})
    assert str(list(shape)) in message


def test_shape_message_names_the_expected_shape():
    message = _expect("w_down", "shape must be", w_down=torch.zeros(E, I, H, dtype=torch.bfloat16))
    assert f"[{E}, {H}, {I}]" in message


# ---- layout, device, token limit --------------------------------------------------------------


def test_non_contiguous_x():
    x = torch.randn(H, T).to(torch.bfloat16).t()
    assert x.shape == (T, H) and not x.is_contiguous()
    _expect("x", r"must be contiguous", x=x)


def test_non_contiguous_weight():
    w = torch.randn(E, H, I).to(torch.bfloat16).transpose(1, 2)
    _expect("w_gate", r"must be contiguous", w_gate=w)


def test_cpu_tensors_rejected():
    message = _expect("x", "must be on a CUDA device")
    assert "cpu" in message


def test_tokens_above_the_planned_maximum():
    small = SPEC.with_target(max_tokens_per_rank=4)
    message = _expect("x", r"5 tokens exceed .*max_tokens_per_rank = 4", spec=small, T=5)
    # at the limit the token count is accepted (and the CPU device is what is rejected)
    with pytest.raises(InputError, match="must be on a CUDA device"):
        _call(small, T=4)
    assert "5" in message


def test_spec_by_name_validates_before_loading():
    """A bundled spec by name: validation still comes before the (disabled) build."""
    x = torch.zeros(3, 7, dtype=torch.bfloat16)
    a = _args()
    with pytest.raises(InputError, match=r"x: shape must be \[\*, 2048\]"):
        mokgen.experts_forward(x, a["topk_ids"], a["topk_weights"], a["w_gate"], a["w_up"], a["w_down"],
                               spec="qwen3-30b-a3b")


def test_validate_forward_inputs_directly():
    a = _args()
    with pytest.raises(InputError, match="w_up: dtype must be torch.bfloat16, got torch.float32"):
        validate_forward_inputs(SPEC, **{**a, "w_up": a["w_up"].float()})
    with pytest.raises(InputError, match="x: must be on a CUDA device, got cpu"):
        validate_forward_inputs(SPEC, **a)


def test_can_sync_is_true_outside_compile_and_capture_even_without_cuda():
    from mokgen.ops import _can_sync

    assert _can_sync() is True


def test_block_layer_kwargs_that_repeat_its_own_arguments_are_refused():
    """MoEBlock(layer_kwargs=...) passes MoELayer arguments through; the ones MoEBlock takes itself
    are refused by name before anything is allocated or built."""
    from mokgen.block import MoEBlock

    with pytest.raises(InputError, match=r"layer_kwargs: device, max_tokens are MoEBlock's own arguments"):
        MoEBlock(SPEC, layer_kwargs={"max_tokens": 4, "device": "cuda", "chunk_rows": 128})
