"""PyTorch-facing API on one GPU: input validation and ``experts_forward``.

The compiled op is registered by the generated binding (see mokgen.load) and driven by mokgen.ep;
this module checks every tensor before it reaches the kernel, so a bad call ends in one clear
InputError and never in a launch on wrong memory. The validation helpers are shared with ep.
"""

from __future__ import annotations

import torch

from mokgen.errors import InputError
from mokgen.spec import MoESpec, load_spec

_ID_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(t: object, name: str, *, shape: tuple, dtypes: tuple, contiguous: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise InputError(f"{name}: dtype must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise InputError(f"{name}: shape must be {want}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise InputError(f"{name}: must be contiguous (call .contiguous())")


def _check_device(t: torch.Tensor, name: str, device: torch.device | None) -> None:
    if t.device.type != "cuda":
        raise InputError(f"{name}: must be on a CUDA device, got {t.device}")
    if device is not None and t.device != device:
        raise InputError(f"{name}: must be on {device} like x, got {t.device}")


def _can_sync() -> bool:
    """May validation read values back from the device (one sync)? Not while torch.compile traces
    or a CUDA graph is being captured."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def validate_forward_inputs(spec: MoESpec, x, topk_ids, topk_weights, w_gate, w_up, w_down, *, check_ids: bool = True):
    H, I, E, K = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.top_k
    # dtypes, shapes and layout of every argument first, devices last: the most specific problem
    # is the one reported (and all of it can be checked on CPU tensors)
    _check(x, "x", shape=(None, H), dtypes=(torch.bfloat16,))
    T = x.shape[0]
    if T > spec.target.max_tokens_per_rank:
        raise InputError(
            f"x: {T} tokens exceed the planned maximum target.max_tokens_per_rank = {spec.target.max_tokens_per_rank}"
        )
    _check(topk_ids, "topk_ids", shape=(T, K), dtypes=_ID_DTYPES)
    _check(topk_weights, "topk_weights", shape=(T, K), dtypes=_WEIGHT_DTYPES)
    _check(w_gate, "w_gate", shape=(E, I, H), dtypes=(torch.bfloat16,))
    _check(w_up, "w_up", shape=(E, I, H), dtypes=(torch.bfloat16,))
    _check(w_down, "w_down", shape=(E, H, I), dtypes=(torch.bfloat16,))
    _check_device(x, "x", None)
    for t, name in ((topk_ids, "topk_ids"), (topk_weights, "topk_weights"), (w_gate, "w_gate"),
                    (w_up, "w_up"), (w_down, "w_down")):
        _check_device(t, name, x.device)
    if check_ids and T > 0 and _can_sync():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= E:
            raise InputError(f"topk_ids: expert ids must be in [0, {E}), found values in [{lo}, {hi}]")


def experts_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    spec: MoESpec | str,
    check_ids: bool = True,
) -> torch.Tensor:
    """Routed experts on one GPU (EP = 1): ``sum_j w[t,j] * FFN_{ids[t,j]}(x[t])`` in bf16.

    x [T, H] bf16; topk_ids [T, K] int32/int64; topk_weights [T, K] (fp32 used inside);
    w_gate, w_up [E, I, H] and w_down [E, H, I] bf16, the Hugging Face layout. Deterministic:
    each (token, j) result has its own slot and the k slots are summed in fixed order in fp32.
    Runs the megakernel as a single rank (one launch), with buffers cached per device.
    ``check_ids`` validates the id range with one device sync (skipped automatically under
    torch.compile and CUDA graph capture).
    """
    if isinstance(spec, str):
        spec = load_spec(spec)
    # validate before loading: a bad call never triggers (or waits for) a build
    validate_forward_inputs(spec, x, topk_ids, topk_weights, w_gate, w_up, w_down, check_ids=check_ids)
    from mokgen.ep import single_rank_forward

    return single_rank_forward(spec, x, topk_ids, topk_weights, w_gate, w_up, w_down)
