"""Expert parallelism without a GPU: input validation of ``virtual_ep_forward`` and ``MoELayer``,
the ctypes mirrors of mokgen.abi against a compiled library, the ring defaults, the PyTorch peers
of mokgen.bench, and `mokgen bench` without a GPU.

Validation tests run with MOKGEN_DISABLE_JIT=1 and an empty private cache: a call that got past
validation would reach the loader and raise LoadError (``test_valid_call_reaches_the_loader``
shows it does), so getting InputError proves the check comes before any build or load.

Order of the checks in ``virtual_ep_forward``: list lengths, per-rank dtype/shape/layout, expert
weights, then DEVICES, then tokens per rank, the id range, simulate_missing_rank, timeout_ms and
the ring. The checks after the device check cannot be reached with CPU tensors; here they run with
``mokgen.ep._check_device`` replaced by a no-op (and, for the id range, ``_can_sync`` forced to
True, because CPU-only torch builds raise on ``torch.cuda.is_current_stream_capturing``), and again
with real CUDA tensors under the ``gpu`` marker.
"""

from __future__ import annotations

import ctypes
import inspect
import math
import os
import re
import struct
import subprocess

import pytest

torch = pytest.importorskip("torch")

import mokgen  # noqa: E402
from mokgen import abi  # noqa: E402
from mokgen import bench  # noqa: E402
from mokgen import build as build_mod  # noqa: E402
from mokgen import ep as ep_mod  # noqa: E402
from mokgen import load as load_mod  # noqa: E402
from mokgen import reference  # noqa: E402
from mokgen.errors import InputError, LoadError, MokgenError  # noqa: E402
from mokgen.paths import templates_dir  # noqa: E402
from mokgen.plan import ABI_VERSION, ep_defaults  # noqa: E402
from mokgen.spec import bundled_specs, load_spec, spec_from_dict  # noqa: E402

# hidden != intermediate, so a transposed weight has a wrong shape
H, I, E, K = 128, 256, 32, 2
TOKENS = (5, 3)

SPEC = spec_from_dict(
    {
        "name": "tiny-ep-test",
        "hidden_size": H,
        "moe_intermediate_size": I,
        "num_experts": E,
        "top_k": K,
        "routing": {"scoring": "softmax"},
    },
    source="test",
)
SMALL = "qwen3-30b-a3b"


@pytest.fixture
def no_build(tmp_path, monkeypatch):
    """An empty private cache and JIT off: reaching the loader raises LoadError."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(cache))
    monkeypatch.setenv("MOKGEN_DISABLE_JIT", "1")
    monkeypatch.setattr(load_mod, "_by_spec", {})
    monkeypatch.setattr(load_mod, "_by_key", {})
    yield
    assert not cache.exists(), "validation must not build anything"


def _args(tokens=TOKENS, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for T in tokens:
        xs.append(torch.randn(T, H, generator=gen).to(torch.bfloat16))
        ids.append(torch.rand(T, E, generator=gen).topk(K, dim=-1).indices)
        w = torch.rand(T, K, generator=gen) + 0.05
        ws.append(w / w.sum(-1, keepdim=True))
    weights = [
        (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)
        for shape in ((E, I, H), (E, I, H), (E, H, I))
    ]
    mv = lambda t: t.to(device)  # noqa: E731
    return {
        "xs": [mv(t) for t in xs],
        "topk_ids": [mv(t) for t in ids],
        "topk_weights": [mv(t) for t in ws],
        "w_gate": mv(weights[0]),
        "w_up": mv(weights[1]),
        "w_down": mv(weights[2]),
    }


def _call(args, spec=SPEC, **kwargs):
    return mokgen.virtual_ep_forward(
        spec, args["xs"], args["topk_ids"], args["topk_weights"], args["w_gate"], args["w_up"], args["w_down"], **kwargs
    )


def _expect(args, prefix: str, pattern: str, spec=SPEC, **kwargs) -> str:
    """The call raises InputError (not LoadError, not anything else) whose one line starts with
    ``prefix: `` (a regex) and matches ``pattern``."""
    with pytest.raises(MokgenError) as info:
        _call(args, spec, **kwargs)
    err = info.value
    assert isinstance(err, InputError), f"expected InputError, got {type(err).__name__}: {err}"
    assert isinstance(err, ValueError)
    message = str(err)
    assert "\n" not in message
    assert re.match(prefix + ": ", message), (prefix, message)  # prefix is a regex: r"xs\[0\]"
    assert re.search(pattern, message), (pattern, message)
    return message


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values and shape, not contiguous."""
    out = torch.cat([t, t], dim=-1)[..., ::2] if t.dim() > 1 else t.repeat(2)[::2]
    assert out.shape == t.shape and not out.is_contiguous()
    return out


# ---- the rank lists ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [[], (), None, "x"], ids=["empty-list", "empty-tuple", "none", "str"])
def test_xs_must_be_a_non_empty_list(no_build, bad):
    args = _args()
    args["xs"] = bad
    _expect(args, "xs", r"expected a non-empty list of per-rank tensors")


def test_xs_as_one_tensor_is_rejected(no_build):
    args = _args()
    args["xs"] = torch.cat(args["xs"])  # the global tokens, not split per rank
    _expect(args, "xs", r"expected a non-empty list")


def test_at_most_16_virtual_ranks(no_build):
    args = _args(tokens=(1,) * 17)
    _expect(args, "xs", r"at most 16 virtual ranks, got 17")
    # 16 ranks pass this check (and every other one up to the device check)
    _expect(_args(tokens=(1,) * 16), r"xs\[0\]", r"must be on a CUDA device")
    assert abi.MAX_LAUNCH_RANKS == 16


@pytest.mark.parametrize("W", [3, 5, 6])
def test_ranks_must_divide_num_experts(no_build, W):
    _expect(_args(tokens=(2,) * W), "xs", rf"{W} ranks must divide num_experts \({E}\)")


@pytest.mark.parametrize("name", ["topk_ids", "topk_weights"])
@pytest.mark.parametrize("how", ["short", "long", "tensor", "none"])
def test_routing_lists_match_the_ranks(no_build, name, how):
    args = _args()
    if how == "short":
        args[name] = args[name][:1]
    elif how == "long":
        args[name] = args[name] + args[name][:1]
    elif how == "tensor":
        args[name] = torch.cat(args[name])
    else:
        args[name] = None
    _expect(args, name, rf"expected a list of {len(TOKENS)} tensors \(one per rank\)")


def test_tuples_are_accepted_like_lists(no_build):
    args = _args()
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in args.items()}
    _expect(args, r"xs\[0\]", r"must be on a CUDA device")  # got past every list check


# ---- per-rank tensors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, bad",
    [
        ("xs", lambda t: t.float()),
        ("xs", lambda t: t.half()),
        ("topk_ids", lambda t: t.float()),
        ("topk_ids", lambda t: t.to(torch.int16)),
        ("topk_weights", lambda t: t.double()),
        ("topk_weights", lambda t: t.to(torch.int64)),
    ],
    ids=["xs-fp32", "xs-fp16", "ids-fp32", "ids-int16", "weights-fp64", "weights-int64"],
)
@pytest.mark.parametrize("rank", [0, 1])
def test_per_rank_dtype(no_build, name, bad, rank):
    args = _args()
    args[name][rank] = bad(args[name][rank])
    _expect(args, rf"{name}\[{rank}\]", r"dtype must be ")


def test_accepted_routing_dtypes(no_build):
    args = _args()
    args["topk_ids"] = [args["topk_ids"][0].int(), args["topk_ids"][1]]  # int32 and int64
    args["topk_weights"] = [args["topk_weights"][0].half(), args["topk_weights"][1].bfloat16()]
    _expect(args, r"xs\[0\]", r"must be on a CUDA device")


@pytest.mark.parametrize(
    "name, shape, want",
    [
        ("xs", (3, H + 128), rf"\[\*, {H}\]"),
        ("xs", (3 * H,), rf"\[\*, {H}\]"),
        ("xs", (1, 3, H), rf"\[\*, {H}\]"),
        ("topk_ids", (3, K + 1), rf"\[3, {K}\]"),
        ("topk_ids", (4, K), rf"\[3, {K}\]"),  # one row more than xs[1] has tokens
        ("topk_ids", (3 * K,), rf"\[3, {K}\]"),
        ("topk_weights", (3, 1), rf"\[3, {K}\]"),
        ("topk_weights", (2, K), rf"\[3, {K}\]"),
    ],
)
def test_per_rank_shape(no_build, name, shape, want):
    args = _args()
    dtype = args[name][1].dtype
    args[name][1] = torch.zeros(shape, dtype=dtype)
    msg = _expect(args, rf"{name}\[1\]", r"shape must be " + want)
    assert f"got {list(shape)}" in msg


def test_xs_shape_error_names_the_rank_with_the_problem(no_build):
    args = _args(tokens=(4, 4, 4, 4))
    args["xs"][2] = args["xs"][2][:, : H // 2].contiguous()
    _expect(args, r"xs\[2\]", r"shape must be")


@pytest.mark.parametrize("name", ["xs", "topk_ids", "topk_weights"])
@pytest.mark.parametrize("rank", [0, 1])
def test_per_rank_non_contiguous(no_build, name, rank):
    args = _args()
    args[name][rank] = _noncontig(args[name][rank])
    _expect(args, rf"{name}\[{rank}\]", r"must be contiguous")


@pytest.mark.parametrize("name", ["xs", "topk_ids", "topk_weights"])
def test_per_rank_not_a_tensor(no_build, name):
    args = _args()
    args[name][1] = args[name][1].tolist()
    _expect(args, rf"{name}\[1\]", r"expected a torch.Tensor, got list")


def test_zero_tokens_on_a_rank_are_valid(no_build):
    _expect(_args(tokens=(0, 4)), r"xs\[0\]", r"must be on a CUDA device")
    _expect(_args(tokens=(0, 0)), r"xs\[0\]", r"must be on a CUDA device")


# ---- expert weights --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, make, pattern",
    [
        ("w_gate", lambda a: a["w_gate"].transpose(1, 2).contiguous(), rf"shape must be \[{E}, {I}, {H}\]"),
        ("w_up", lambda a: a["w_up"][: E // 2].contiguous(), rf"shape must be \[{E}, {I}, {H}\]"),  # one rank's slice
        ("w_down", lambda a: a["w_down"].transpose(1, 2).contiguous(), rf"shape must be \[{E}, {H}, {I}\]"),
        ("w_down", lambda a: a["w_down"][0], rf"shape must be \[{E}, {H}, {I}\]"),
        ("w_gate", lambda a: a["w_gate"].float(), r"dtype must be torch.bfloat16"),
        ("w_down", lambda a: a["w_down"].half(), r"dtype must be torch.bfloat16"),
        ("w_up", lambda a: _noncontig(a["w_up"]), r"must be contiguous"),
        ("w_gate", lambda a: None, r"expected a torch.Tensor, got NoneType"),
    ],
    ids=["gate-transposed", "up-one-rank-slice", "down-transposed", "down-2d", "gate-fp32", "down-fp16",
         "up-noncontig", "gate-none"],
)
def test_expert_weights(no_build, name, make, pattern):
    args = _args()
    args[name] = make(args)
    _expect(args, name, pattern)


# ---- devices -----------------------------------------------------------------------------------------


def test_cpu_tensors_rejected(no_build):
    _expect(_args(), r"xs\[0\]", r"must be on a CUDA device, got cpu")


def test_devices_are_checked_after_dtypes_and_shapes(no_build):
    # every tensor is on the CPU, but the shape problem of rank 1 and of w_down is what is reported
    args = _args()
    args["topk_weights"][1] = torch.zeros(3, K + 1)
    _expect(args, r"topk_weights\[1\]", r"shape must be")
    args = _args()
    args["w_down"] = args["w_down"][:, :, :H].contiguous()
    _expect(args, "w_down", r"shape must be")


def test_meta_tensors_rejected(no_build):
    args = _args()
    args = {k: [t.to("meta") for t in v] if isinstance(v, list) else v.to("meta") for k, v in args.items()}
    _expect(args, r"xs\[0\]", r"must be on a CUDA device, got meta")


# ---- checks after the device check: tokens, ids, simulate_missing_rank, timeout, ring -------------


def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none visible)")
    return "cuda"


@pytest.fixture(params=["cpu-past-device-check", pytest.param("cuda", marks=pytest.mark.gpu)])
def late(request, no_build, monkeypatch):
    """Builds inputs that pass the device check: CPU tensors with the device check disabled, or
    real CUDA tensors (gpu marker). Returns a factory like _args."""
    if request.param == "cuda":
        device = _cuda_or_skip()
    else:
        device = "cpu"
        monkeypatch.setattr(ep_mod, "_check_device", lambda t, name, device: None)
        monkeypatch.setattr(ep_mod, "_can_sync", lambda: True)
    return lambda tokens=TOKENS: _args(tokens, device=device)


def _expect_scalar(args, pattern: str, **kwargs) -> None:
    """Like _expect, for the keyword arguments (their messages start with the argument's name)."""
    with pytest.raises(MokgenError) as info:
        _call(args, **kwargs)
    assert isinstance(info.value, InputError), f"expected InputError, got {type(info.value).__name__}: {info.value}"
    assert "\n" not in str(info.value)
    assert re.match(pattern, str(info.value)), (pattern, str(info.value))


def test_valid_call_reaches_the_loader(late):
    """The control for every test below: with valid arguments the call gets past validation and
    fails only in the loader (no build allowed, nothing cached)."""
    with pytest.raises(LoadError, match="MOKGEN_DISABLE_JIT|no build of"):
        _call(late())
    with pytest.raises(LoadError):  # the limits themselves are accepted
        _call(late((4, 0)), spec=SPEC.with_target(max_tokens_per_rank=4), simulate_missing_rank=1,
              timeout_ms=0.001, chunk_rows=1 << 20, ring_chunks=1024)
    with pytest.raises(LoadError):
        _call(late(), chunk_rows=1, ring_chunks=1, simulate_missing_rank=0)


def test_tokens_above_max_tokens_per_rank(late):
    spec = SPEC.with_target(max_tokens_per_rank=4)
    _expect(late((3, 5)), "xs", r"5 tokens on one rank exceed target.max_tokens_per_rank = 4", spec=spec)
    _expect(late((5, 0)), "xs", r"5 tokens on one rank exceed target.max_tokens_per_rank = 4", spec=spec)


@pytest.mark.parametrize("value", [E, E + 7, -1])
@pytest.mark.parametrize("rank", [0, 1])
def test_expert_ids_out_of_range(late, value, rank):
    args = late()
    ids = args["topk_ids"][rank].clone()
    ids[-1, -1] = value
    args["topk_ids"][rank] = ids
    _expect(args, rf"topk_ids\[{rank}\]", rf"expert ids must be in \[0, {E}\)")
    with pytest.raises(LoadError):  # check_ids=False skips the check (and its device sync)
        _call(args, check_ids=False)


@pytest.mark.parametrize("value", [-1, 2, 99])
def test_simulate_missing_rank_in_range(late, value):
    _expect_scalar(late(), rf"simulate_missing_rank must be in \[0, 2\), got {value}", simulate_missing_rank=value)


@pytest.mark.parametrize("value", [0, -1.0, -1e9, math.nan])
def test_timeout_ms_positive(late, value):
    _expect_scalar(late(), r"timeout_ms must be positive", timeout_ms=value)


@pytest.mark.parametrize("kw, value, pattern", [
    ("chunk_rows", 0, r"chunk_rows must be in 1\.\.1048576, got 0"),
    ("chunk_rows", -128, r"chunk_rows must be in 1\.\.1048576, got -128"),
    ("chunk_rows", (1 << 20) + 1, r"chunk_rows must be in 1\.\.1048576, got 1048577"),
    ("ring_chunks", 0, r"ring_chunks must be in 1\.\.1024, got 0"),
    ("ring_chunks", 1025, r"ring_chunks must be in 1\.\.1024, got 1025"),
])
def test_ring_geometry(late, kw, value, pattern):
    _expect_scalar(late(), pattern, **{kw: value})


# ---- MoELayer's constructor -------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, pattern", [
    ({"device": "cpu"}, r"MoELayer: device must be a CUDA device, got cpu"),
    ({"device": "meta"}, r"MoELayer: device must be a CUDA device, got meta"),
    ({"max_tokens": 0}, r"max_tokens must be in 1\.\.16384, got 0"),
    ({"max_tokens": 16385}, r"max_tokens must be in 1\.\.16384, got 16385"),
    ({"chunk_rows": 0, "device": "cpu"}, r"chunk_rows must be in"),
    ({"ring_chunks": 2000, "device": "cpu"}, r"ring_chunks must be in"),
    ({"max_tokens": 1.5}, r"max_tokens must be an int, got 1\.5"),  # was truncated to 1
    ({"max_tokens": "4096"}, r"max_tokens must be an int, got '4096'"),  # was parsed
    ({"max_tokens": True}, r"max_tokens must be an int, got True"),
])
def test_moe_layer_rejects_bad_arguments_before_loading(no_build, kwargs, pattern):
    with pytest.raises(InputError, match=pattern):
        mokgen.MoELayer(SPEC, **kwargs)


@pytest.mark.parametrize("make", [
    lambda: mokgen.MoELayer(SPEC, max_tokens=64),
    lambda: mokgen.MoEExperts(SPEC, device="cuda", max_tokens=64),
    lambda: mokgen.MoEBlock(SPEC, max_tokens=64),
], ids=["MoELayer", "MoEExperts", "MoEBlock"])
def test_modules_without_a_gpu_say_so(no_build, make, request):
    """Without a visible GPU each module raises mokgen's InputError, naming itself (torch's own
    AssertionError "Torch not compiled with CUDA enabled" escaped every documented except clause)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    name = request.node.callspec.id
    with pytest.raises(InputError, match=rf"^{name}: no CUDA GPU is visible"):
        make()


def test_experts_device_error_names_the_class(no_build):
    with pytest.raises(InputError, match=r"^MoEExperts: device must be a CUDA device, got cpu"):
        mokgen.MoEExperts(SPEC, device="cpu")


# ---- mokgen.abi ---------------------------------------------------------------------------------------


def test_error_record_layout():
    assert abi._ERROR.size == abi.ERROR_BYTES == 24
    assert abi.ERROR_OFFSET == 16  # u64 epoch, u32 finished, u32 abort
    assert ctypes.sizeof(abi.EpParams) % 8 == 0
    names = [f[0] for f in abi.EpParams._fields_]
    assert len(names) == len(set(names))
    assert abi.EpParams.sym.size == 8 * abi.MAX_WORLD
    assert abi.EpParams.x.size == 8 * abi.MAX_LAUNCH_RANKS


def test_parse_error_zero_bytes_is_none():
    assert abi.parse_error(bytes(abi.ERROR_BYTES)) is None
    # code 0 means "no error" whatever the other fields hold (they are written after the code)
    assert abi.parse_error(struct.pack("<iiiiQ", 0, 3, 1, 2, 9)) is None


def test_parse_error_packed_record():
    raw = struct.pack("<iiiiQ", 1, 3, 1, 2, 7)
    assert abi.parse_error(raw) == {"code": 1, "rank": 3, "stage": 1, "peer": 2, "epoch": 7}
    # as read from a whole control block (EpBuffers reads ctl[ERROR_OFFSET:ERROR_OFFSET+ERROR_BYTES])
    ctl = bytes(abi.ERROR_OFFSET) + struct.pack("<iiiiQ", 1, 5, 4, -1, (3 << 32) + 1) + bytes(16)
    err = abi.parse_error(ctl[abi.ERROR_OFFSET : abi.ERROR_OFFSET + abi.ERROR_BYTES])
    assert err == {"code": 1, "rank": 5, "stage": 4, "peer": -1, "epoch": (3 << 32) + 1}
    # trailing bytes are ignored; a short record is an error, not a silent "no error"
    assert abi.parse_error(raw + b"\xff" * 8) == abi.parse_error(raw)
    with pytest.raises(struct.error):
        abi.parse_error(raw[:-1])


def test_describe_error_names_rank_stage_peer_and_timeout():
    msg = abi.describe_error({"code": 1, "rank": 3, "stage": 1, "peer": 2, "epoch": 7}, 250)
    assert "\n" not in msg
    assert "rank 3 waited more than 250 ms" in msg
    assert "the routing tables of rank 2" in msg
    assert "launch epoch 7" in msg
    msg = abi.describe_error({"code": 1, "rank": 0, "stage": 5, "peer": 6, "epoch": 1}, 10_000.0)
    assert "rank 0 waited more than 10000 ms for the combine pushes of rank 6" in msg
    msg = abi.describe_error({"code": 1, "rank": 1, "stage": 3, "peer": 0, "epoch": 2}, 0.5)
    assert "0.5 ms" in msg and "a free slot of its receive ring" in msg
    # a stage this mokgen does not know still gives one readable line
    msg = abi.describe_error({"code": 1, "rank": 1, "stage": 42, "peer": 0, "epoch": 2}, 1)
    assert "stage 42" in msg and "\n" not in msg


def test_every_stage_of_sync_cuh_is_described():
    text = (templates_dir() / "include" / "mokgen" / "sync.cuh").read_text()
    stages = {int(v) for name, v in re.findall(r"\b(kStage\w+)\s*=\s*(\d+)", text) if name != "kStageNone"}
    assert stages and stages == set(abi.STAGES)
    for stage, what in abi.STAGES.items():
        msg = abi.describe_error({"code": 1, "rank": 2, "stage": stage, "peer": 4, "epoch": 1}, 100)
        assert what.format(peer=4) in msg


def test_mirrored_constants_match_the_headers():
    text = (templates_dir() / "include" / "mokgen" / "ep_forward.cuh").read_text()
    assert f"constexpr int kMaxWorld = {abi.MAX_WORLD};" in text
    assert f"constexpr int kMaxLaunchRanks = {abi.MAX_LAUNCH_RANKS};" in text


def _library(name: str = SMALL) -> ctypes.CDLL:
    result = build_mod.build(load_spec(name), publish_generated=False)  # session cache: compiled once
    lib = ctypes.CDLL(str(result.library))
    for fn in ("mokgen_ep_params_bytes", "mokgen_ep_control_bytes"):
        getattr(lib, fn).restype = ctypes.c_longlong
        getattr(lib, fn).argtypes = []
    lib.mokgen_ep_sym_bytes.restype = ctypes.c_longlong
    lib.mokgen_ep_sym_bytes.argtypes = [ctypes.c_longlong]
    for fn in ("mokgen_ep_local_bytes", "mokgen_ep_stats_offset"):
        getattr(lib, fn).restype = ctypes.c_longlong
        getattr(lib, fn).argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.mokgen_abi_version.restype = ctypes.c_int
    return lib


@pytest.mark.nvcc
def test_abi_sizes_match_the_compiled_library():
    lib = _library()
    assert lib.mokgen_abi_version() == ABI_VERSION
    assert lib.mokgen_ep_params_bytes() == ctypes.sizeof(abi.EpParams)
    assert lib.mokgen_ep_control_bytes() == abi.ERROR_OFFSET + abi.ERROR_BYTES
    # EpBuffers allocates max(256, control bytes): the record fits in what it allocates
    assert abi.ERROR_OFFSET + abi.ERROR_BYTES <= max(256, lib.mokgen_ep_control_bytes())


@pytest.mark.nvcc
def test_symmetric_region_grows_linearly_with_tokens():
    spec = load_spec(SMALL)
    Hs, Ks = spec.hidden_size, spec.top_k
    lib = _library()
    per_token = 4 * Ks + 2 * Hs + 2 * Ks * Hs  # send pairs (int32), x (bf16), combine slots (bf16)
    base = lib.mokgen_ep_sym_bytes(0)
    assert base > 0  # the flags exist even with no tokens
    sizes = [lib.mokgen_ep_sym_bytes(T) for T in (64, 128, 256, 4096, 16384)]
    assert sizes == [base + T * per_token for T in (64, 128, 256, 4096, 16384)]
    # any T: between the exact figure and it plus the 256-byte alignment of each of 3 arrays
    for T in (1, 3, 100, 1000):
        assert base + T * per_token <= lib.mokgen_ep_sym_bytes(T) <= base + T * per_token + 3 * 256
        assert lib.mokgen_ep_sym_bytes(T) % 256 == 0


@pytest.mark.nvcc
def test_local_region_grows_with_ring_rows():
    spec = load_spec(SMALL)
    lib = _library()
    # meta, the flow schedule's block counter, x row, h row
    per_row = 8 + 8 + 2 * spec.hidden_size + 2 * spec.moe_intermediate_size
    for W in (1, 2, 8):
        small = lib.mokgen_ep_local_bytes(W, 128, 2)
        for C, S in ((256, 2), (128, 4), (1024, 4), (4096, 8)):
            assert lib.mokgen_ep_local_bytes(W, C, S) - small == (C * S - 256) * per_row, (W, C, S)
        # depends on the ring's rows, not how they are split (for up to 32 chunks)
        assert lib.mokgen_ep_local_bytes(W, 512, 2) == lib.mokgen_ep_local_bytes(W, 256, 4) == lib.mokgen_ep_local_bytes(W, 1024, 1)
        # the statistics EpBuffers.stats reads lie inside the region
        off = lib.mokgen_ep_stats_offset(W, 1024, 4)
        assert 0 <= off and off + abi.STAT_BYTES <= lib.mokgen_ep_local_bytes(W, 1024, 4)


@pytest.mark.nvcc
def test_ep_params_field_offsets_match_the_header(tmp_path):
    """sizeof alone misses two fields of one size swapped: compare every field's offset."""
    tc = build_mod.find_toolchain()
    lines = [f'  std::printf("{name} %zu\\n", offsetof(mokgen::EpParams, {name}));' for name, _ in abi.EpParams._fields_]
    source = "\n".join([
        "#include <cstddef>",
        "#include <cstdio>",
        '#include "mokgen/ep_forward.cuh"',
        "int main() {",
        *lines,
        '  std::printf("sizeof %zu\\n", sizeof(mokgen::EpParams));',
        '  std::printf("error_offset %zu\\n", offsetof(mokgen::Control, error));',
        '  std::printf("error_bytes %zu\\n", sizeof(mokgen::ErrorRecord));',
        '  std::printf("rec_peer %zu\\n", offsetof(mokgen::ErrorRecord, peer));',
        '  std::printf("rec_epoch %zu\\n", offsetof(mokgen::ErrorRecord, epoch));',
        "  return 0;",
        "}",
    ]) + "\n"
    (tmp_path / "probe.cu").write_text(source)
    cmd = [tc.nvcc, "-std=c++17", *build_mod.ARCH_FLAGS["sm_90a"], "-I", str(templates_dir() / "include"),
           "-I", tc.cutlass_include, "probe.cu", "-o", "probe"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True, timeout=60, check=True).stdout
    got = dict((k, int(v)) for k, v in (line.split() for line in out.splitlines()))
    want = {name: getattr(abi.EpParams, name).offset for name, _ in abi.EpParams._fields_}
    assert {k: got[k] for k in want} == want
    assert got["sizeof"] == ctypes.sizeof(abi.EpParams)
    assert got["error_offset"] == abi.ERROR_OFFSET
    assert got["error_bytes"] == abi.ERROR_BYTES
    assert (got["rec_peer"], got["rec_epoch"]) == (12, 16)  # matches struct "<iiiiQ"


def _layout_probe(tmp_path, name: str, lines: list[str]) -> dict[str, dict[str, int]]:
    """Compile and run a probe program (``lines``, main's body open: its return is added) whose
    lines print ``CASE FIELD VALUE``, the header's layout figures; returns them by case."""
    tc = build_mod.find_toolchain()
    (tmp_path / f"{name}.cu").write_text("\n".join([*lines, "  return 0;", "}"]) + "\n")
    cmd = [tc.nvcc, "-std=c++17", *build_mod.ARCH_FLAGS["sm_90a"], "-I", str(templates_dir() / "include"),
           "-I", tc.cutlass_include, f"{name}.cu", "-o", name]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = subprocess.run([str(tmp_path / name)], capture_output=True, text=True, timeout=60, check=True).stdout
    got: dict[str, dict[str, int]] = {}
    for line in out.splitlines():
        case, field, value = line.split()
        got.setdefault(case, {})[field] = int(value)
    return got


@pytest.mark.nvcc
def test_local_layout_mirror_matches_the_header(tmp_path):
    """abi.local_layout, through which the backward finds the ring's x rows in place: every
    field's offset and the total as the compiled LocalLayout gives them, for ranks, chunk sizes
    and ring lengths that move every array."""
    cases = [(160, 2048, 512, 1, 8192, 4), (160, 2048, 512, 1, 8192, 16), (384, 7168, 2048, 8, 4096, 3),
             (16, 256, 128, 4, 128, 1), (257, 640, 96, 1, 1000, 7)]
    lines = ["#include <cstdio>", '#include "mokgen/ep_forward.cuh"']
    for i, (e, h, inter, *_rest) in enumerate(cases):
        lines.append(f"struct Cfg{i} {{ static constexpr int kExperts = {e}, kHidden = {h}, kInter = {inter}; }};")
        lines.append(f"struct Mx{i} : Cfg{i} {{ static constexpr bool kMx = true; }};")  # MXFP8 builds' layout
        lines.append(f"struct MxE{i} : Mx{i} {{ static constexpr bool kMxExpand = true; }};")  # its expanded form
    lines.append("int main() {")
    for i, (_e, _h, _i, w, c, r) in enumerate(cases):
        lines.append(f"  {{ mokgen::LocalLayout<Cfg{i}> L({w}, {c}, {r});")
        for name in (*abi.LOCAL_FIELDS, "total"):
            lines.append(f'    std::printf("{i} {name} %zu\\n", L.{name});')
        lines.append(f"  }}\n  {{ mokgen::LocalLayout<Mx{i}> L({w}, {c}, {r});")
        for name in (*abi.LOCAL_FIELDS, "ring_x_scales", "ring_h_scales", "total"):
            lines.append(f'    std::printf("mx{i} {name} %zu\\n", L.{name});')
        lines.append(f"  }}\n  {{ mokgen::LocalLayout<MxE{i}> L({w}, {c}, {r});")
        for name in (*abi.LOCAL_FIELDS, "total"):
            lines.append(f'    std::printf("mxe{i} {name} %zu\\n", L.{name});')
        lines.append("  }")
    got = _layout_probe(tmp_path, "layout", lines)
    for i, case in enumerate(cases):
        assert abi.local_layout(*case) == got[str(i)], case
        assert abi.local_layout(*case, numerics="mxfp8") == got[f"mx{i}"], case
        assert got[f"mx{i}"]["ring_x_scales"] > got[f"mx{i}"]["ring_h"]  # the MXFP8 planes exist
        # the expanded form (v0.57): the ring holds bf16 MX values, the bf16 layout
        assert abi.local_layout(*case, numerics="mxfp8", mx_form="expand") == got[f"mxe{i}"] == got[str(i)], case
    # the region's size as the library computes it, for the built spec
    spec, lib = load_spec(SMALL), _library()
    for W, C, S in ((1, 8192, 4), (1, 1024, 64), (2, 512, 3)):
        lay = abi.local_layout(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size, W, C, S)
        assert (lay["total"], lay["stats"]) == (lib.mokgen_ep_local_bytes(W, C, S), lib.mokgen_ep_stats_offset(W, C, S))


@pytest.mark.nvcc
def test_sym_layout_mirror_matches_the_header(tmp_path):
    """abi.sym_layout, through which an MXFP8 launch's backward reads the combine slots: every
    field's offset and the total as the compiled SymLayout gives them, bf16 and MXFP8 builds,
    with and without the fused shared expert, for token counts that move every array."""
    cases = [(160, 2048, 512, 8, 8192, False), (384, 7168, 2048, 8, 4096, True), (16, 256, 128, 1, 1000, False),
             (257, 640, 96, 3, 129, True)]
    lines = ["#include <cstdio>", '#include "mokgen/ep_forward.cuh"']
    for i, (e, h, inter, k, _t, fuse) in enumerate(cases):
        lines.append(f"struct Cfg{i} {{ static constexpr int kExperts = {e}, kHidden = {h}, kInter = {inter}, "
                     f"kTopK = {k}; static constexpr bool kFuseShared = {'true' if fuse else 'false'}; }};")
        lines.append(f"struct Mx{i} : Cfg{i} {{ static constexpr bool kMx = true; }};")
    lines.append("int main() {")
    fields = {kind: list(abi.sym_layout(16, 256, 128, 1, 1, numerics)) for kind, numerics in (("", "bf16"),
                                                                                            ("mx", "mxfp8"))}
    for i, (*_rest, t, _f) in enumerate(cases):
        for kind, cfg in (("", f"Cfg{i}"), ("mx", f"Mx{i}")):
            lines.append(f"  {{ mokgen::SymLayout<{cfg}> S({t});")
            for name in fields[kind]:
                lines.append(f'    std::printf("{kind}{i} {name} %zu\\n", S.{name});')
            lines.append("  }")
    got = _layout_probe(tmp_path, "sym", lines)
    for i, (e, h, inter, k, t, fuse) in enumerate(cases):
        assert abi.sym_layout(e, h, inter, k, t, "bf16", fuse) == got[str(i)], i
        assert abi.sym_layout(e, h, inter, k, t, "mxfp8", fuse) == got[f"mx{i}"], i
        assert got[f"mx{i}"]["slots"] < got[str(i)]["slots"]  # the MXFP8 rows are codes (and scales)
    # the region's size as the library computes it, for the built spec
    spec, lib = load_spec(SMALL), _library()
    for t in (1, 512, 4096):
        lay = abi.sym_layout(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size, spec.top_k, t)
        assert lay["total"] == lib.mokgen_ep_sym_bytes(t)


# ---- ring defaults -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(bundled_specs()))
def test_ep_defaults(name):
    spec = load_spec(name)
    d = ep_defaults(spec)
    assert set(d) == {"chunk_rows", "ring_chunks"}
    assert d["chunk_rows"] % 128 == 0
    assert 1024 <= d["chunk_rows"] <= 8192
    assert d["ring_chunks"] >= 2  # one chunk landing while another is computed
    # what MoELayer / virtual_ep_forward use when given nothing
    assert ep_mod._ring(spec, None, None) == (d["chunk_rows"], d["ring_chunks"])


class _FakeKernel:
    """What ep._ctas reads of a kernel module: its occupancy, its CTA pairs, its expert width."""

    def __init__(self, ctas: int, pair: int, inter: int):
        self.INTERMEDIATE_SIZE = inter
        self.LIB = type("Lib", (), {"mokgen_ep_max_ctas": staticmethod(lambda: ctas),
                                    "mokgen_ep_cluster": staticmethod(lambda: pair)})()


@pytest.mark.parametrize("ctas,pair,inter,launch_ranks,world,want", [
    (132, 1, 2048, 1, 1, (132, 8)),      # one rank: a sixteenth
    (132, 1, 512, 1, 1, (132, 16)),      # one rank, narrow experts: an eighth
    (132, 1, ep_mod.NARROW_EXPERTS, 1, 1, (132, 16)),
    (132, 1, ep_mod.NARROW_EXPERTS + 1, 1, 1, (132, 8)),
    (132, 2, 2048, 1, 1, (132, 8)),      # pairs: whole pairs
    (132, 2, 512, 1, 1, (132, 16)),
    (132, 1, 2048, 1, 8, (132, 16)),     # one rank of an EP group: an eighth
    (132, 2, 512, 8, 8, (16, 2)),        # eight virtual ranks in one launch
])
def test_dispatch_ctas_default(ctas, pair, inter, launch_ranks, world, want):
    assert ep_mod._ctas(_FakeKernel(ctas, pair, inter), launch_ranks, world) == want


# ---- mokgen.bench's PyTorch peers on CPU -----------------------------------------------------------------

BH, BI, BE, BK = 64, 32, 8, 2
REL_TOL = 2e-2  # bf16 intermediates against the fp32 reference


def _bench_inputs(T, seed=0, skew=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, BH, generator=gen).to(torch.bfloat16)
    scores = torch.rand(T, BE, generator=gen)
    if skew:  # every token to experts 0 and 5: six experts get nothing
        scores[:, 0] += 2
        scores[:, 5] += 2
    ids = scores.topk(BK, dim=-1).indices.to(torch.int32)
    w = torch.rand(T, BK, generator=gen) + 0.05
    w = w / w.sum(-1, keepdim=True)
    weights = [(torch.randn(*s, generator=gen) * s[-1] ** -0.5).to(torch.bfloat16)
               for s in ((BE, BI, BH), (BE, BI, BH), (BE, BH, BI))]
    return (x, ids, w, *weights)


def _rel_err(out, ref):
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _grouped_mm_or_skip():
    try:
        a = torch.randn(4, 16).to(torch.bfloat16)
        b = torch.randn(2, 16, 16).to(torch.bfloat16)
        torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32))
    except (NotImplementedError, RuntimeError, AttributeError) as err:
        pytest.skip(f"torch._grouped_mm does not run on CPU in torch {torch.__version__}: {str(err)[:120]}")


PEERS = {
    "torch_loop": bench.torch_loop,
    "torch_grouped_mm_pipeline": bench.torch_grouped_mm_pipeline,
}


@pytest.mark.parametrize("peer", sorted(PEERS))
@pytest.mark.parametrize("clamp", [None, 0.5], ids=["no-clamp", "clamp"])
@pytest.mark.parametrize("T, skew", [(37, False), (128, False), (50, True), (1, False)])
def test_bench_peer_matches_reference(peer, clamp, T, skew):
    if peer == "torch_grouped_mm_pipeline":
        _grouped_mm_or_skip()
    x, ids, w, wg, wu, wd = _bench_inputs(T, seed=T, skew=skew)
    ref = reference.experts_forward(x, ids, w, wg, wu, wd, clamp_limit=clamp)
    out = PEERS[peer](x, ids, w, wg, wu, wd, clamp)
    assert _rel_err(out, ref) < REL_TOL
    if T < 32:
        return
    # the tolerance discriminates: gate and up swapped, or the clamp forgotten, is far outside it
    assert _rel_err(PEERS[peer](x, ids, w, wu, wg, wd, clamp), ref) > 10 * REL_TOL
    if clamp is not None:
        assert _rel_err(PEERS[peer](x, ids, w, wg, wu, wd, None), ref) > 10 * REL_TOL


def test_bench_peers_agree_with_each_other():
    _grouped_mm_or_skip()
    x, ids, w, wg, wu, wd = _bench_inputs(200, seed=3)
    a = bench.torch_loop(x, ids, w, wg, wu, wd)
    b = bench.torch_grouped_mm_pipeline(x, ids, w, wg, wu, wd)
    assert _rel_err(a, b.float()) < REL_TOL


def test_torch_loop_zero_tokens():
    x, ids, w, wg, wu, wd = _bench_inputs(0)
    out = bench.torch_loop(x, ids, w, wg, wu, wd)
    assert out.shape == (0, BH) and out.dtype == torch.bfloat16


def test_routed_flops():
    spec = load_spec(SMALL)
    assert bench.routed_flops(spec, 4096) == 6.0 * 4096 * 8 * 2048 * 768
    assert bench.routed_flops(spec, 0) == 0
    assert bench.routed_flops(spec, 2 * 1000) == 2 * bench.routed_flops(spec, 1000)
    # DESIGN.md's figures use the same count: qwen3-30b-a3b T=4096 at 2.12 ms is 146 TFLOP/s,
    # qwen3.5-35b-a3b T=16384 at 5.66 ms is 146 TFLOP/s
    assert round(bench.routed_flops(spec, 4096) / 2.12e-3 / 1e12) == 146
    assert round(bench.routed_flops(load_spec("qwen3.5-35b-a3b"), 16384) / 5.66e-3 / 1e12) == 146
    # shared experts and routing are not counted: only the routed top-k FFNs
    kimi = load_spec("kimi-k2.5")
    assert bench.routed_flops(kimi, 1) == 6 * kimi.top_k * kimi.hidden_size * kimi.moe_intermediate_size


# ---- `mokgen bench` without a GPU -------------------------------------------------------------------------


@pytest.fixture
def invoke(tmp_path, monkeypatch):
    """Runs `mokgen ARGS` through click in an empty working directory; returns (exit code, stdout,
    stderr, what was left in the directory)."""
    from click.testing import CliRunner

    from mokgen.cli import main

    monkeypatch.chdir(tmp_path)
    runner = CliRunner(mix_stderr=False) if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters else CliRunner()

    def run(*args):
        result = runner.invoke(main, list(args), catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr, os.listdir(tmp_path)

    return run


def _one_error_line(code, out, err) -> str:
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible: `mokgen bench` would run")
def test_cli_bench_without_gpu(invoke):
    code, out, err, leftovers = invoke("bench", SMALL)
    assert _one_error_line(code, out, err) == "error: mokgen bench needs a CUDA GPU; none is visible"
    assert out == "" and leftovers == []  # no bench-out/ written


def test_cli_bench_needs_a_spec(invoke):
    code, out, err, leftovers = invoke("bench")
    assert _one_error_line(code, out, err) == "error: name at least one SPEC, or pass --all"
    assert leftovers == []


def test_cli_bench_unknown_spec_before_the_gpu_check(invoke):
    code, out, err, _ = invoke("bench", "no-such-model")
    line = _one_error_line(code, out, err)
    assert "no-such-model" in line and "CUDA" not in line


def test_cli_bench_mxfp8_only_for_the_layer_local_virtual_and_ep_workloads(invoke):
    cases = ((("--workload", "block"), "error: --numerics mxfp8 times the layer, local, virtual and ep workloads "
              "(pass --workload layer, local, virtual or ep)"),
             (("--workload", "block", "--backward"), "error: --numerics mxfp8 times the layer, local, virtual and ep "
              "workloads (pass --workload layer, local, virtual or ep)"),
             (("--workload", "ep", "--backward"), "error: --numerics mxfp8 --backward times the layer and local "
              "workloads (pass --workload layer or local)"))
    for extra, want in cases:
        code, out, err, leftovers = invoke("bench", SMALL, "--numerics", "mxfp8", *extra)
        assert _one_error_line(code, out, err) == want, extra
        assert leftovers == []


def test_cli_bench_backward_only_for_layer_local_and_block(invoke):
    code, out, err, leftovers = invoke("bench", SMALL, "--backward", "--workload", "virtual")
    line = _one_error_line(code, out, err)
    assert line == ("error: --backward times the layer, local and block workloads only (pass --workload layer, "
                    "local or block)")
    assert leftovers == []


def test_mxfp8_builds_take_converted_weights_and_train_through_their_own_node():
    """mokgen.ep._weights_for: a bf16 build gets the weight tensors themselves, an MXFP8 build
    their conversions (eagerly, also under torch.compile: a graph break); _mx_training: only an
    MXFP8 build's call that autograd would record goes through the MXFP8 training node."""
    import types

    from mokgen import ep, mx_gemm

    w = [torch.zeros(2, 128, 256, dtype=torch.bfloat16) for _ in range(3)]
    bf16 = types.SimpleNamespace(NUMERICS="bf16")
    assert all(a is b for a, b in zip(ep._weights_for(bf16, *w), w))
    mx = types.SimpleNamespace(NUMERICS="mxfp8")
    x = torch.zeros(4, 256, requires_grad=True)
    assert ep._mx_training(mx, (x,)) and not ep._mx_training(mx, (x.detach(),))
    assert not ep._mx_training(bf16, (x,))
    with torch.no_grad():
        assert not ep._mx_training(mx, (x,))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx_gemm, "expert_weights", lambda parts: parts[0] + 1)
        mp.setattr(torch.compiler, "is_compiling", lambda: True)
        ep.refresh_mx_weights()
        got = ep._weights_for(mx, *w)
    ep.refresh_mx_weights()
    assert all(torch.equal(g, t + 1) for g, t in zip(got, w))


def test_an_mxfp8_build_with_the_weights_raw_takes_them_unconverted(monkeypatch):
    """mokgen.ep._weights_for (v0.68): an MXFP8 build of plan mx_fwd_weights "raw" (its binding's
    MX_FWD_WEIGHTS) gets the weight tensors themselves and no conversion runs, under autograd and
    MOKGEN_MX_WEIGHTS=both too; a build without the constant (made before v0.68) takes values."""
    import types

    from mokgen import ep, mx_gemm

    calls = []
    monkeypatch.setattr(mx_gemm, "expert_weights", lambda parts: calls.append(1) or parts[0] + 1)
    monkeypatch.setattr(mx_gemm, "expert_weights_both", lambda *a, **k: calls.append(2))
    monkeypatch.setenv("MOKGEN_MX_WEIGHTS", "both")
    ep.refresh_mx_weights()
    w = [torch.zeros(2, 128, 256, dtype=torch.bfloat16) for _ in range(3)]
    raw = types.SimpleNamespace(NUMERICS="mxfp8", MX_FWD_WEIGHTS="raw")
    for train in (False, True):
        assert all(a is b for a, b in zip(ep._weights_for(raw, *w, train), w))
    assert calls == [] and len(ep._MX_WEIGHTS) == 0
    monkeypatch.setenv("MOKGEN_MX_WEIGHTS", "apart")
    old = types.SimpleNamespace(NUMERICS="mxfp8")
    assert all(torch.equal(g, t + 1) for g, t in zip(ep._weights_for(old, *w), w)) and calls == [1, 1, 1]
    values = types.SimpleNamespace(NUMERICS="mxfp8", MX_FWD_WEIGHTS="values")
    w2 = [t.clone() for t in w]
    assert all(torch.equal(g, t + 1) for g, t in zip(ep._weights_for(values, *w2), w2)) and len(calls) == 6
    ep.refresh_mx_weights()


def test_the_auto_weights_layer_launches_its_raw_twin_for_training_at_few_rows(monkeypatch):
    """MOKGEN_MX_FWD_WEIGHTS=auto (v0.68): mokgen.ep._raw_twin gives a one-GPU MXFP8 layer of the
    expanded form the raw build of its options where it loads with the same buffers' layout and
    CTAs (None for a bf16 build, the codes form, a raw build already, a build that does not load
    (with a warning) or one whose layout differs); _launch_kernel takes it for launches autograd
    records with at most RAW_FWD_MAX_ROWS rows an expert on average where a conversion would not pay
    (_raw_pays: the first launch at a weight version, none cached, the previous version one launch),
    the layer's own otherwise."""
    import types

    from mokgen import ep

    def lib(sym=100, local=200, ctas=132, pair=2):
        return types.SimpleNamespace(mokgen_ep_sym_bytes=lambda t: sym, mokgen_ep_local_bytes=lambda w, c, r: local,
                                     mokgen_ep_max_ctas=lambda: ctas, mokgen_ep_cluster=lambda: pair)

    def build(kind="values", form="expand", numerics="mxfp8", **lay):
        return types.SimpleNamespace(NUMERICS=numerics, MX_FORM=form, MX_FWD_WEIGHTS=kind, LIB=lib(**lay))

    spec = types.SimpleNamespace(name="s", top_k=8, num_experts=48)
    asked = []
    raw = build("raw")
    monkeypatch.setattr(ep, "load", lambda s, options: asked.append(options) or raw)
    assert ep._raw_twin(spec, {"cluster": 2}, build()) is raw and asked == [{"cluster": 2, "mx_fwd_weights": "raw"}]
    for kernel in (build(numerics="bf16"), build(form="codes"), build("raw")):
        assert ep._raw_twin(spec, {}, kernel) is None
    assert len(asked) == 1
    for other in (build("raw", sym=101), build("raw", local=1), build("raw", ctas=130), build("raw", pair=1),
                  build("values")):
        monkeypatch.setattr(ep, "load", lambda s, options, other=other: other)
        assert ep._raw_twin(spec, {}, build()) is None

    def fails(s, options):
        raise ep.ToolchainError("no nvcc")

    monkeypatch.setattr(ep, "load", fails)
    with pytest.warns(UserWarning, match="MOKGEN_MX_FWD_WEIGHTS=auto: the raw build of s is not available"):
        assert ep._raw_twin(spec, {}, build()) is None
    values = build()
    wg, wu, wd = (torch.zeros(2, 2, requires_grad=True) for _ in range(3))
    layer = types.SimpleNamespace(_kernel=values, _kernel_raw=raw, spec=spec, w_gate=wg, w_up=wu, w_down=wd)
    rows = ep.RAW_FWD_MAX_ROWS * spec.num_experts // spec.top_k  # tokens at the limit

    def step(launches=1, tokens=rows, grad=True):
        """``launches`` launches at one new weight version (an optimizer step before them): the builds taken."""
        with torch.no_grad():
            wd.add_(1)
        return [ep._launch_kernel(layer, torch.zeros(tokens, 4), (wg if grad else wg.detach(),))
                for _ in range(launches)]

    assert step() == [raw] and step() == [raw]  # one training launch a step: raw every step
    assert step(tokens=rows + 1) == [values]  # too many rows an expert
    assert step(grad=False) == [values]  # not recorded: inference
    with torch.no_grad():
        assert ep._launch_kernel(layer, torch.zeros(8, 4), (wg,)) is values
    # micro-batches: the first step's second launch converts (which serves the rest); later steps convert at once
    assert step(4) == [raw, values, values, values] and step(4) == [values] * 4 and step(2) == [values] * 2
    assert step() == [values] and step() == [raw]  # back to one launch a step: raw from the step after
    # weights written through .data keep their versions: refresh_mx_weights starts a new one
    assert ep._launch_kernel(layer, torch.zeros(rows, 4), (wg,)) is values  # a second launch at the version
    ep.refresh_mx_weights()
    assert ep._launch_kernel(layer, torch.zeros(rows, 4), (wg,)) is values  # (the previous version had two)
    ep.refresh_mx_weights()
    assert ep._launch_kernel(layer, torch.zeros(rows, 4), (wg,)) is raw
    # a conversion cached at this version (an inference call made it): the values build
    monkeypatch.setattr(ep, "_mx_cached", lambda w: w)
    assert step() == [values]
    layer._kernel_raw = None
    assert step() == [values]
    # made under auto, a layer holds RAW_TWIN_PENDING: the first launch that takes the twin loads it
    # (none under a CUDA graph capture), a layer that never takes it never builds it
    monkeypatch.undo()
    loads = []
    monkeypatch.setattr(ep, "load", lambda s, options: loads.append(options) or raw)
    layer = types.SimpleNamespace(_kernel=values, _kernel_raw=ep.RAW_TWIN_PENDING, spec=spec, w_gate=wg, w_up=wu,
                                  w_down=wd, build_options={"cluster": 2})
    assert step(grad=False) == [values] and step(tokens=rows + 1) == [values] and loads == []
    monkeypatch.setattr(ep, "_capturing", lambda w: True)
    assert step() == [values] and loads == []
    monkeypatch.setattr(ep, "_capturing", lambda w: False)
    assert step() == [raw] and loads == [{"cluster": 2, "mx_fwd_weights": "raw"}] and layer._kernel_raw is raw
    assert step() == [raw] and len(loads) == 1


def test_mxfp8_weight_conversions_follow_each_tensor_and_its_version(monkeypatch):
    """mokgen.ep._mx_operand: one conversion per tensor object and version. A new tensor that
    takes a freed one's address is converted anew (no stale hit); an in-place update converts
    again; refresh_mx_weights forgets everything (for writes through .data, which keep the
    version); inference tensors (no version counter) convert once; under a CUDA graph capture a
    current conversion is used and kept alive, a missing one refused in one line."""
    import gc

    from mokgen import ep, mx_gemm

    calls = []

    def convert(parts):  # the GPU kernel's stand-in: a copy that records each call
        calls.append(parts[0])
        return parts[0].clone()

    monkeypatch.setattr(mx_gemm, "expert_weights", convert)
    monkeypatch.setattr(ep, "_MX_CAPTURED", {})
    ep.refresh_mx_weights()
    a = torch.ones(2, 128, 256)
    first = ep._mx_operand(a)
    assert ep._mx_operand(a) is first and len(calls) == 1
    a.mul_(2)  # in place: a new version
    assert torch.equal(ep._mx_operand(a), a) and len(calls) == 2
    a.data.fill_(5)  # through .data: the version stays, the conversion too, until a refresh
    assert ep._mx_operand(a)[0, 0, 0] == 2
    ep.refresh_mx_weights()
    assert ep._mx_operand(a)[0, 0, 0] == 5 and len(calls) == 3
    del a, first
    gc.collect()
    assert len(ep._MX_WEIGHTS) == 0  # the entry went with its tensor
    b = torch.full((2, 128, 256), 3.0)  # (the allocator may hand it the freed address)
    assert ep._mx_operand(b)[0, 0, 0] == 3 and len(calls) == 4
    with torch.inference_mode():
        c = torch.full((2, 128, 256), 7.0)
    assert ep._mx_operand(c)[0, 0, 0] == 7 and ep._mx_operand(c)[0, 0, 0] == 7 and len(calls) == 5
    monkeypatch.setattr(ep, "_capturing", lambda w: True)
    held = ep._mx_operand(b)
    assert ep._MX_CAPTURED[id(held)] is held and len(calls) == 5
    with pytest.raises(InputError, match="converts its weights outside CUDA graphs") as info:
        ep._mx_operand(torch.zeros(2, 128, 256))
    assert "\n" not in str(info.value)


def test_an_mxfp8_ring_holds_a_multiple_of_four_rows():
    from mokgen import ep

    spec = load_spec(SMALL).with_target(numerics="mxfp8")
    assert ep._ring(spec, 1000, 2) == (1000, 2)
    with pytest.raises(InputError, match=r"chunk_rows x ring_chunks must be a multiple of 4.*got 1001 x 1"):
        ep._ring(spec, 1001, 1)
    assert ep._ring(load_spec(SMALL), 1001, 1) == (1001, 1)  # bf16 rings have no such bound
    # an MXFP8 layer's backward recomputes through the staged experts: it reads no ring
    assert ep._ring_for_backward(spec, 1, 4096, 128, 4, "reuse") == 4


def test_virtual_shared_expert_arguments(late):
    """virtual_ep_forward(shared=...): the shared expert's weights and per-rank scales are
    checked before any build (one-line InputErrors naming the argument); valid ones reach the
    loader."""
    args = late()
    sh = [torch.zeros(I, H, dtype=torch.bfloat16), torch.zeros(I, H, dtype=torch.bfloat16),
          torch.zeros(H, I, dtype=torch.bfloat16)]
    dev = args["xs"][0].device
    sh = [t.to(dev) for t in sh]
    scales = [torch.ones(T, device=dev) for T in TOKENS]
    with pytest.raises(LoadError):
        _call(args, shared=(*sh, scales))
    with pytest.raises(LoadError):
        _call(args, shared=(*sh, None))
    _expect_scalar(args, r"shared: expected \(w_gate, w_up, w_down, scales\)", shared=tuple(sh))
    _expect_scalar(args, r"shared w_gate: shape must be \[256, 128\], got \[128, 256\]",
                   shared=(sh[2], sh[1], sh[2], scales))
    _expect_scalar(args, r"shared w_down: dtype must be torch.bfloat16", shared=(*sh[:2], sh[2].float(), scales))
    _expect_scalar(args, r"shared scales: expected None or a list of 2 tensors \(one per rank\)",
                   shared=(*sh, scales[:1]))
    _expect_scalar(args, r"shared scales\[1\]: shape must be \[3\], got \[5\]", shared=(*sh, [scales[0], scales[0]]))
    _expect_scalar(args, r"shared scales\[0\]: dtype must be torch.float32",
                   shared=(*sh, [scales[0].bfloat16(), scales[1]]))


def test_error_poll_reads_the_watched_record_once():
    """EpBuffers.poll, MoELayer's look at the launches' error record (copied to pinned memory after
    each launch, mokgen.ep.EpBuffers.watch): without blocking it reads the pinned record's code
    and reports nothing while it is 0, without a CUDA call (the copy may not have landed: the
    kernel's record stays set, so a later copy carries an error); a nonzero code waits for the
    last copy, reports the record's fields once and clears the pending record; blocking always
    waits first; clear_error waits for a copy still in flight and zeroes the pinned record too,
    so a reported error is not seen again. A record watched by other means (no code view) falls back to the event's query."""

    class Event:
        def __init__(self, done):
            self.done, self.syncs, self.queries = done, 0, 0

        def query(self):
            self.queries += 1
            return self.done

        def synchronize(self):
            self.syncs += 1
            self.done = True

    bufs = ep_mod.EpBuffers.__new__(ep_mod.EpBuffers)
    bufs._pending = bufs._pinned = bufs._code = None
    bufs.ctl = torch.zeros(abi.ERROR_OFFSET + abi.ERROR_BYTES, dtype=torch.uint8)
    assert bufs.poll(block=False) is None and bufs.poll(block=True) is None
    bufs._pinned = torch.zeros(abi.ERROR_BYTES, dtype=torch.uint8)
    bufs._code = bufs._pinned.numpy().view("<i4")
    ev = Event(False)
    bufs._pending = (bufs._pinned, ev)
    assert bufs.poll(block=False) is None and bufs._pending is not None
    assert ev.syncs == 0 and ev.queries == 0  # no CUDA call while the code is 0
    bufs._pinned.copy_(torch.tensor(list(struct.pack("<iiiiQ", 1, 3, 2, 5, 9)), dtype=torch.uint8))
    bufs.ctl[abi.ERROR_OFFSET] = 1
    assert bufs.poll(block=False) == {"code": 1, "rank": 3, "stage": 2, "peer": 5, "epoch": 9}
    assert ev.syncs == 1 and bufs._pending is None
    assert bufs.poll(block=False) is None  # reported once
    ev = Event(False)
    bufs._pending = (bufs._pinned, ev)  # an error read by read_error while a copy is in flight
    bufs.clear_error()  # what _raise does after the report: the copy lands, then its buffer is zeroed
    assert ev.syncs == 1 and bufs._pending is None and not bufs._pinned.any() and not bufs.ctl.any()
    ev = Event(False)
    bufs._pending = (bufs._pinned, ev)
    assert bufs.poll(block=True) is None and ev.syncs == 1 and bufs._pending is None
    bufs._code = None
    ev = Event(False)
    bufs._pending = (torch.zeros(abi.ERROR_BYTES, dtype=torch.uint8), ev)
    assert bufs.poll(block=False) is None and ev.queries == 1 and bufs._pending is not None
    ev.done = True
    assert bufs.poll(block=False) is None and bufs._pending is None
