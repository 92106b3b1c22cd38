"""Expert parallelism: the megakernel's persistent buffers, virtual ranks, and MoELayer.

One forward = one cooperative launch of the generated megakernel per rank (per process on real
GPUs; one launch for all W virtual ranks on one GPU). The kernel needs three persistent buffers:

* ``sym``: each rank's symmetric region (its tokens, send lists, combine slots and flags), at the
  same offsets on every rank. Real GPUs: torch symmetric memory (peer pointers over NVLink);
  virtual ranks: W regions in one allocation.
* ``local``: each rank's private region (receive ring, row plan, barrier counters, statistics).
* ``ctl``: the control block (launch epoch, abort flag, sticky error record).

All are zeroed once at allocation and never reset by the host afterwards: flags carry the launch
epoch. Buffers are sized by run-time capacities (tokens per rank, ring), never per call.

Errors: every wait in the kernel is bounded by ``timeout_ms``; a rank that times out records
which rank, stage and peer stalled. ``virtual_ep_forward`` checks the record after the launch
(one device sync) and raises KernelError. ``MoELayer`` checks it without blocking at its next
call (and on ``check_errors()``), so the forward itself never waits on the host.
"""

from __future__ import annotations

import itertools
import math
import numbers
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from mokgen import abi, env
from mokgen.errors import InputError, KernelError, LoadError, ToolchainError
from mokgen.load import load
from mokgen.ops import _can_sync, _check, _check_device
from mokgen.plan import ep_defaults
from mokgen.spec import MoESpec, load_spec

DEFAULT_TIMEOUT_MS = 10_000.0


@dataclass(frozen=True)
class Geometry:
    """Run-time shape of the buffers; a different geometry means new buffers."""

    world: int
    launch_ranks: int
    max_tokens: int
    chunk_rows: int
    ring_chunks: int


class EpBuffers:
    """sym/local/ctl for the ranks of one launch. ``peer_ptrs``: sym base of every rank."""

    def __init__(self, kernel, geometry: Geometry, device: torch.device, group=None):
        lib = kernel.LIB
        g = geometry
        self.kernel = kernel
        self.geometry = g
        self.device = device
        self.sym_bytes = int(lib.mokgen_ep_sym_bytes(g.max_tokens))
        self.local_bytes = int(lib.mokgen_ep_local_bytes(g.world, g.chunk_rows, g.ring_chunks))
        self.stats_offset = int(lib.mokgen_ep_stats_offset(g.world, g.chunk_rows, g.ring_chunks))
        ctl_bytes = max(256, int(lib.mokgen_ep_control_bytes()))
        self.ctl = torch.zeros(ctl_bytes, dtype=torch.uint8, device=device)
        self.local = torch.zeros(g.launch_ranks * self.local_bytes, dtype=torch.uint8, device=device)
        if group is None:
            if g.launch_ranks != g.world:
                raise InputError("virtual ranks: every rank must be in the launch")
            self.sym = torch.zeros(g.world * self.sym_bytes, dtype=torch.uint8, device=device)
            base = self.sym.data_ptr()
            self.peer_ptrs = [base + r * self.sym_bytes for r in range(g.world)]
        else:
            import torch.distributed as dist
            import torch.distributed._symmetric_memory as symm_mem

            self.sym = symm_mem.empty(self.sym_bytes, dtype=torch.uint8, device=device)
            self.sym.zero_()
            handle = symm_mem.rendezvous(self.sym, group=group)
            self.peer_ptrs = [int(handle.buffer_ptrs[r]) for r in range(g.world)]
            torch.cuda.synchronize(device)
            dist.barrier(group=group)  # every rank's zeroed flags exist before anyone signals
        # the receive ring's x rows of rank 0, for the backward to read in place (ring_x): their
        # offset from abi.local_layout, trusted only where that mirror gives the library's own
        # size and statistics offset
        self._ring_x_offset = None
        names = ("NUM_EXPERTS", "HIDDEN_SIZE", "INTERMEDIATE_SIZE")
        # (an MXFP8 build's ring holds codes, not bf16 rows, and it has no backward)
        if all(hasattr(kernel, n) for n in names) and getattr(kernel, "NUMERICS", "bf16") == "bf16":
            lay = abi.local_layout(*(int(getattr(kernel, n)) for n in names), g.world, g.chunk_rows, g.ring_chunks)
            if (lay["total"], lay["stats"]) == (self.local_bytes, self.stats_offset):
                self._ring_x_offset = lay["ring_x"]
        # the combine slots of every rank (their expert output rows, for an MXFP8 launch's
        # backward to copy: slot_rows): their offset from abi.sym_layout, trusted only where that
        # mirror gives the library's own size, and one GPU's region of every rank
        self._slots_offset = None
        names = ("NUM_EXPERTS", "HIDDEN_SIZE", "INTERMEDIATE_SIZE", "TOP_K")
        if group is None and all(hasattr(kernel, n) for n in names):
            lay = abi.sym_layout(*(int(getattr(kernel, n)) for n in names), g.max_tokens,
                                 getattr(kernel, "NUMERICS", "bf16"), bool(getattr(kernel, "FUSE_SHARED", False)))
            if lay["total"] == self.sym_bytes:
                self._slots_offset = lay["slots"]
        #: what the last launch on these buffers wrote into the ring (MoELayer.forward: its
        #: inputs' identity, see _ring_key), or None: unknown, the ring is not read back
        self.ring_key = None
        #: set for good once a launch went where the host cannot follow it (a CUDA graph capture)
        self.ring_untracked = False
        self._pending = None  # (pinned copy of the error record, event) of the last launch
        self._pinned = self._code = None  # the pinned record and its code field (watch makes them)
        self._side = None  # the stream the error record's copy runs on (EpBuffers.watch)
        self.watched_timeout_ms = None  # the last watched launch's wait bound (watch)
        self.set_number = 0  # layer_buffers' number for a set it made (0: made elsewhere)
        # plain ints, fixed for the life of the buffers (torch.compile sees constants)
        self._addresses = (self.peer_ptrs, self.local.data_ptr(), self.local_bytes, self.ctl.data_ptr())

    @property
    def nbytes(self) -> int:
        """Device memory these buffers hold on this GPU (this rank's symmetric region, or all
        virtual ranks' regions, the private regions and the control block)."""
        return self.sym.numel() + self.local.numel() + self.ctl.numel()

    def ring_x(self, rows: int) -> torch.Tensor | None:
        """Rank 0's receive-ring x rows ``[rows, H]`` bf16 as a view of the private region, or None
        where the ring has fewer rows (or its layout is not known). Ring row i is received row i
        while the ring holds every received row (chunk c sits in slot c % ring_chunks)."""
        g = self.geometry
        if self._ring_x_offset is None or rows > g.chunk_rows * g.ring_chunks:
            return None
        H = int(self.kernel.HIDDEN_SIZE)
        at = self._ring_x_offset
        return self.local[at:at + 2 * rows * H].view(torch.bfloat16).view(rows, H)

    def slot_rows(self, sizes: list[int]) -> torch.Tensor | None:
        """A copy of the combine slots' rows that the last launch wrote, rank by rank: each
        (token, slot) pair's expert output row, bf16 ``[sum(sizes) * TOP_K, H]`` (``sizes``: the
        launch's tokens per rank), or None where the slots' layout is not known (or the ranks'
        regions are not all on this GPU)."""
        if self._slots_offset is None or len(sizes) != self.geometry.world:
            return None
        K, H = int(self.kernel.TOP_K), int(self.kernel.HIDDEN_SIZE)
        views = []
        for r, t in enumerate(sizes):
            at = r * self.sym_bytes + self._slots_offset
            views.append(self.sym[at:at + 2 * t * K * H].view(torch.bfloat16).view(t * K, H))
        return views[0].clone() if len(views) == 1 else torch.cat(views)

    def addresses(self) -> tuple[list[int], int, int, int]:
        """(peer sym pointers, local base, local bytes per rank, control block) for the op."""
        return self._addresses

    # -- error record -------------------------------------------------------------------------
    def read_error(self) -> dict | None:
        raw = self.ctl[abi.ERROR_OFFSET : abi.ERROR_OFFSET + abi.ERROR_BYTES].cpu().numpy().tobytes()
        return abi.parse_error(raw)

    def clear_error(self) -> None:
        self.ctl[abi.ERROR_OFFSET : abi.ERROR_OFFSET + abi.ERROR_BYTES].zero_()
        if self._pending is not None:  # a watched copy may still be in flight (an error read by
            self._pending[1].synchronize()  # read_error): it lands before its buffer is zeroed
        if self._pinned is not None:
            self._pinned.zero_()
        self._pending = None

    def watch(self, timeout_ms: float | None = None) -> None:
        """After a launch: copy the error record to pinned memory without blocking.
        ``timeout_ms``: the launch's wait bound, kept for the message of an error it records
        (``watched_timeout_ms``; buffers shared by layers report the launching layer's).

        The copy runs on a side stream that waits for the launch (an event), not on the caller's
        stream: a copy-engine operation between the forward and the next kernel on the compute
        stream held that kernel back (0.34 ms of a kimi-k2.5 fwd+bwd step, docs/perf-notes.md
        v0.11). ``poll`` reads the record. The pinned buffer (zeros until a copy lands) and both
        events are made once and reused; the side stream orders each copy after the one before,
        so the buffer holds the latest record that has landed. The kernel's record stays set
        until ``clear_error``, so every copy after a failed launch carries its error: a record
        whose copy has not landed by one poll is seen by a later one. v0.28 made a pinned tensor
        and two events per launch (host time after each launch; docs/perf-notes.md v0.29)."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
            self._pinned = torch.zeros(abi.ERROR_BYTES, dtype=torch.uint8, pin_memory=True)
            self._code = self._pinned.numpy().view("<i4")  # the record's first field, its error code
            self._launched, self._copied = torch.cuda.Event(), torch.cuda.Event()
        self._launched.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            self._side.wait_event(self._launched)
            self._pinned.copy_(self.ctl[abi.ERROR_OFFSET : abi.ERROR_OFFSET + abi.ERROR_BYTES], non_blocking=True)
            self._copied.record(self._side)
        self._pending = (self._pinned, self._copied)
        self.watched_timeout_ms = timeout_ms

    def poll(self, *, block: bool) -> dict | None:
        """The error recorded by the watched launches: with ``block``, once the last watch's copy
        has landed; without, None unless a landed copy holds an error (then it waits for the
        last copy and reads that). Without blocking this reads one int from pinned memory: no
        CUDA call, where an event query cost 0.03 ms of host time at the start of a training
        step (docs/perf-notes.md v0.54). A copy landing during the read changes only whether
        this poll or a later one sees its error, never what is reported."""
        if self._pending is None:
            return None
        pinned, event = self._pending
        if not block:
            if self._code is not None:
                if not self._code[0]:
                    return None
            elif not event.query():  # a record watched by other means than watch (.ci/fwd_host.py)
                return None
        event.synchronize()
        self._pending = None
        return abi.parse_error(pinned.numpy().tobytes())

    def stats(self) -> list[dict]:
        """Per rank of the launch, from the last launch (blocks until it finished): rows received,
        pulled, pushed and pulled from other ranks, and phase times (see ``abi.parse_stats``)."""
        out = []
        for r in range(self.geometry.launch_ranks):
            off = r * self.local_bytes + self.stats_offset
            vals = self.local[off : off + abi.STAT_BYTES].cpu().view(torch.int64).tolist()
            out.append(abi.parse_stats(vals))
        return out


#: process group of each multi-GPU layer, by the address of its private region (the op's
#: local_ptr argument): how the op's backward finds the group to exchange gradients over
_EP_GROUPS: dict[int, object] = {}


#: local region address -> the one-rank MoELayer buffers there, for the backward's ring lookup
_RING_OWNERS: "dict[int, weakref.ref[EpBuffers]]" = {}


def _ring_key(x: torch.Tensor, ids: torch.Tensor) -> tuple:
    """What identifies a launch's ring contents: its x and expert ids (storage, shape, version).
    The ring's x rows are a function of those two alone, and the autograd graph keeps both
    alive (saved) until the backward, so no other tensor can take their storage meanwhile."""
    return (x.data_ptr(), tuple(x.shape), x._version, ids.data_ptr(), tuple(ids.shape), ids._version)


def ring_rows_of(local_ptr: int | None, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """The forward's receive-ring x rows ``[T K, H]`` (received order: expert-major, then the
    pair order; the backward's mokgen.bwd_gemm.expert_major order) of the one-rank MoELayer
    whose private region is at ``local_ptr``, if its last launch was the one of ``x`` and
    ``ids`` and the ring still holds every row; else None (the backward gathers them again)."""
    if local_ptr is None or torch.compiler.is_compiling() or any(type(t) is not torch.Tensor for t in (x, ids)):
        return None  # (AOTAutograd traces a compiled backward with fake tensors: no storage to match)
    if torch._guards.detect_fake_mode((x, ids)) is not None:
        return None
    ref = _RING_OWNERS.get(int(local_ptr))
    bufs = None if ref is None else ref()
    if bufs is None or bufs.ring_untracked or bufs.ring_key is None or bufs.ring_key != _ring_key(x, ids):
        return None
    return bufs.ring_x(ids.numel())


def ep_group_of(local_ptr: int | None):
    """The process group of the MoELayer whose private region starts at ``local_ptr``, or None."""
    return None if local_ptr is None else _EP_GROUPS.get(int(local_ptr))


def _raise(bufs: EpBuffers, err: dict, timeout_ms: float) -> None:
    bufs.clear_error()
    raise KernelError(abi.describe_error(err, timeout_ms))


#: a one-rank layer whose experts are at most this wide (moe_intermediate_size) dispatches with an
#: eighth of its CTAs, not a sixteenth: a routed row's copy then weighs more against its GEMMs
#: (qwen3.5-35b-a3b, 512: 16 dispatch CTAs of 132 against 8, 3.02 -> 2.12 ms with the tile
#: queue; docs/perf-notes.md, v0.16)
NARROW_EXPERTS = 768


def _ctas(kernel, launch_ranks: int, world: int | None = None) -> tuple[int, int]:
    """(CTAs per rank, dispatch CTAs of them) for a launch of ``launch_ranks`` ranks of an EP
    group of ``world`` (default: launch_ranks). Dispatch gets an eighth of a rank's CTAs, a
    sixteenth when the group is one rank (its pulls are local copies): measured 1-3% faster
    than an eighth on one H200 (docs/perf-notes.md, v0.4), except for narrow experts
    (NARROW_EXPERTS), which keep an eighth."""
    total = int(kernel.LIB.mokgen_ep_max_ctas())
    if total <= 0:
        raise KernelError("cannot query the megakernel's occupancy on this device")
    # clusters of two: every rank's CTAs, and its dispatch CTAs, come in whole pairs
    pair = int(kernel.LIB.mokgen_ep_cluster())
    per_rank = total // launch_ranks // pair * pair
    if per_rank < 2 * pair:
        raise InputError(f"{launch_ranks} ranks in one launch need at least {2 * pair * launch_ranks} co-resident "
                         f"CTAs; this GPU holds {total}")
    world = launch_ranks if world is None else world
    narrow = int(kernel.INTERMEDIATE_SIZE) <= NARROW_EXPERTS
    dispatch = max(1, per_rank // (16 if world == 1 and not narrow else 8))
    return per_rank, min(per_rank - pair, -(-dispatch // pair) * pair)


def _check_rank_inputs(spec: MoESpec, r: int, x, ids, w):
    H, K = spec.hidden_size, spec.top_k
    _check(x, f"xs[{r}]", shape=(None, H), dtypes=(torch.bfloat16,))
    T = x.shape[0]
    _check(ids, f"topk_ids[{r}]", shape=(T, K), dtypes=(torch.int32, torch.int64))
    _check(w, f"topk_weights[{r}]", shape=(T, K), dtypes=(torch.float32, torch.bfloat16, torch.float16))
    return T


def _check_expert_weights(spec: MoESpec, num_experts: int, w_gate, w_up, w_down, prefix: str = ""):
    H, I = spec.hidden_size, spec.moe_intermediate_size
    _check(w_gate, f"{prefix}w_gate", shape=(num_experts, I, H), dtypes=(torch.bfloat16,))
    _check(w_up, f"{prefix}w_up", shape=(num_experts, I, H), dtypes=(torch.bfloat16,))
    _check(w_down, f"{prefix}w_down", shape=(num_experts, H, I), dtypes=(torch.bfloat16,))


def _check_ids_range(ids_list, num_experts: int) -> None:
    if not _can_sync():
        return
    for r, ids in enumerate(ids_list):
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= num_experts:
                raise InputError(f"topk_ids[{r}]: expert ids must be in [0, {num_experts}), found values in [{lo}, {hi}]")


BWD_POLICIES = ("save", "recompute")
BWD_RINGS = ("auto", "reuse", "gather")


def _arg_or_env(name: str, value: str | None, allowed: tuple[str, ...], from_env) -> str:
    """A MoELayer choice argument ``name``: ``value`` if one of ``allowed``, or (None) its switch."""
    if value is None:
        return from_env()
    if value not in allowed:
        raise InputError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _bwd_policy(value: str | None) -> str:
    """The backward's save-or-recompute policy (mokgen.backward): ``value``, or MOKGEN_BWD_POLICY."""
    return _arg_or_env("bwd_policy", value, BWD_POLICIES, env.bwd_policy)


def _bwd_ring(value: str | None) -> str:
    """Where a one-rank layer's backward takes its x rows from: ``value``, or MOKGEN_BWD_RING."""
    return _arg_or_env("bwd_ring", value, BWD_RINGS, env.bwd_ring)


#: under bwd_ring "auto", a one-rank layer whose ring_chunks were not given grows its ring to hold
#: every pair's row where that takes at most this many times the chunks it has: measured level in
#: the forward and 2-3% faster in the fwd+bwd step (docs/perf-notes.md v0.29), for at most as much
#: ring memory again (2 (H + I) + 16 bytes per row)
AUTO_RING_GROWTH = 2


def _ring_for_backward(spec: MoESpec, world: int, max_tokens: int, chunk_rows: int, ring_chunks: int,
                       bwd_ring: str, explicit: bool = False) -> int:
    """ring_chunks of a new MoELayer: under bwd_ring "reuse" (one rank), enough chunks to hold
    max_tokens x top_k rows, so that the backward can read every pair's x row in place; under
    "auto", the same where it takes at most AUTO_RING_GROWTH times ``ring_chunks`` and these
    were not given by the caller (``explicit``: the tuned entry's or the plan's are grown)."""
    # (an MXFP8 layer's backward recomputes through the staged experts: it reads no ring)
    if bwd_ring == "gather" or world != 1 or spec.target.numerics != "bf16":
        return ring_chunks
    need = -(-max_tokens * spec.top_k // chunk_rows)
    if bwd_ring == "auto":
        return need if not explicit and ring_chunks < need <= AUTO_RING_GROWTH * ring_chunks else ring_chunks
    if need > 1024:
        raise InputError(f"bwd_ring='reuse': {max_tokens} x {spec.top_k} rows need {need} ring chunks of {chunk_rows} "
                         "rows, more than 1024; pass a larger chunk_rows or bwd_ring='auto'")
    return max(ring_chunks, need)


#: MXFP8 builds' weights as their MX values in bf16 with k permuted (mx_gemm.expert_weights), per
#: source tensor, held weakly (an entry goes when its tensor does: no stale hit when a new tensor
#: takes a freed one's address), with the version counter it was converted at: converted again
#: after an in-place change (an optimizer step, ``copy_``, ``mul_``). Writes through ``.data``
#: do not bump the counter: call refresh_mx_weights() after them. Inference tensors have no
#: counter and are converted once. A conversion is a bf16 tensor of the weights' size: an MXFP8
#: layer holds its weights' memory twice (refresh_mx_weights frees the copies until the next call).
_MX_WEIGHTS = torch.utils.weak.WeakIdKeyDictionary()
#: conversions read by a captured CUDA graph: its replays read their memory, so they stay alive
#: for the life of the process, whatever happens to the cache
_MX_CAPTURED: dict = {}
#: under MOKGEN_MX_WEIGHTS=both (v0.65), the backward's conversions of an MXFP8 layer's weights,
#: made by a training forward from the same read as the forward's (mx_gemm.expert_weights_both):
#: W_down^T [E, I, H] keyed on w_down, ``(w_down's version, values)``, and [W_gate; W_up]^T [E, H,
#: 2 I] keyed on w_gate, ``(w_gate's version, w_up's weak reference, w_up's version, values)``.
#: Held as _MX_WEIGHTS' entries are, so a backward of weights unchanged since (the micro-batches of
#: one optimizer step) converts nothing, and the layer holds its weights' memory three times.
_MX_TRANSPOSED = torch.utils.weak.WeakIdKeyDictionary()
#: how many times refresh_mx_weights ran: part of a weight version's key where a version counter
#: cannot tell (writes through ``.data``; ``_raw_pays``)
_MX_REFRESHES = [0]


def refresh_mx_weights() -> None:
    """Forget every converted MXFP8 weight: the next forward converts the weights again. Needed
    after writing weights through ``.data`` (which does not bump the tensors' versions); in-place
    updates (an optimizer step) and new tensors are seen without it. A captured CUDA graph keeps
    reading the weights it was captured with: capture again after changing them."""
    _MX_WEIGHTS.clear()
    _MX_TRANSPOSED.clear()
    _MX_REFRESHES[0] += 1


def _capturing(w: torch.Tensor) -> bool:
    """Whether ``w``'s device's current stream is capturing a CUDA graph."""
    return w.is_cuda and torch.cuda.is_current_stream_capturing()


def _mx_operand(w: torch.Tensor) -> torch.Tensor:
    version = None if w.is_inference() else w._version
    hit = _MX_WEIGHTS.get(w)
    capturing = _capturing(w)
    if hit is not None and hit[0] == version:
        if capturing:
            _MX_CAPTURED[id(hit[1])] = hit[1]
        return hit[1]
    if capturing:
        raise InputError("an MXFP8 layer converts its weights outside CUDA graphs: run it once before the capture "
                         "(and capture again after changing the weights)")
    from mokgen import mx_gemm

    out = mx_gemm.expert_weights([w.detach().contiguous()])
    _MX_WEIGHTS[w] = (version, out)
    return out


def _mx_cached(w: torch.Tensor):
    """``w``'s conversion if the cache holds one at ``w``'s current version, else None (no
    conversion made)."""
    hit = _MX_WEIGHTS.get(w)
    version = None if w.is_inference() else w._version
    return hit[1] if hit is not None and hit[0] == version else None


def _mx_transposed(w_gate, w_up, w_down):
    """The backward's conversions the cache holds for these weights at their current versions
    (MOKGEN_MX_WEIGHTS=both), as ``mx_experts._backward``'s ``transposed``: ``((W_down^T values,
    None, None), ([W_gate; W_up]^T values, None, None))``; None where either is missing."""
    down, gu = _MX_TRANSPOSED.get(w_down), _MX_TRANSPOSED.get(w_gate)
    if down is None or gu is None or down[0] != w_down._version or gu[0] != w_gate._version \
            or gu[1]() is not w_up or gu[2] != w_up._version:
        return None
    return (down[1], None, None), (gu[3], None, None)


def _mx_both(w_gate, w_up, w_down) -> None:
    """Under MOKGEN_MX_WEIGHTS=both, before a training launch of an MXFP8 build: where the caches
    lack the forward's or the backward's conversion of these weights at their versions, make both
    from one read of each weight (``mx_gemm.expert_weights_both``, the same bits as the forward's
    ``_mx_operand`` and the backward's ``mx_experts._transposed_weights``) and cache them. Weights
    the bf16-math backward cannot take without codes (I or H not a multiple of 256), that the
    kernel does not take, or inference tensors are left to the two conversions apart."""
    from mokgen import mx_experts, mx_gemm

    ws = (w_gate, w_up, w_down)
    if any(w.is_inference() for w in ws) or _mx_transposed(*ws) is not None \
            and all(_mx_cached(w) is not None for w in ws):
        return
    _, I, H = w_gate.shape
    if not mx_experts._both("bf16", I, H, *ws):
        return
    (down,), down_t = mx_gemm.expert_weights_both([w_down.detach()], apart=True)
    (gate, up), gu_t = mx_gemm.expert_weights_both([w_gate.detach(), w_up.detach()], apart=True)
    for w, out in zip(ws, (gate, up, down)):
        _MX_WEIGHTS[w] = (w._version, out)
    _MX_TRANSPOSED[w_down] = (w_down._version, down_t)
    _MX_TRANSPOSED[w_gate] = (w_gate._version, weakref.ref(w_up), w_up._version, gu_t)


def _is_mx(kernel) -> bool:
    """Whether ``kernel`` is an MXFP8 build."""
    return getattr(kernel, "NUMERICS", "bf16") == "mxfp8"


def _weights_for(kernel, w_gate, w_up, w_down, train: bool = False):
    """The expert weights as ``kernel`` takes them: as given (bf16 builds, and MXFP8 builds whose
    tiles quantize them, plan mx_fwd_weights "raw"), or for an MXFP8 build their MX values
    (``_mx_operand``). ``train``: the launch is recorded for autograd (under MOKGEN_MX_WEIGHTS=both
    the backward's conversions are made too, ``_mx_both``)."""
    if not _is_mx(kernel) or _takes_raw(kernel):
        return w_gate, w_up, w_down
    return _mx_operands(w_gate, w_up, w_down, train)


#: MOKGEN_MX_FWD_WEIGHTS=auto (v0.68): the most rows an expert gets, on average, in a training
#: launch that takes the raw build. Measured on an H100, the MXFP8 step with the weights new every
#: step, raw / values: 0.911 at 341 rows an expert, 0.984 at 512, 1.066 at 1024 and 1.09-1.14
#: beyond (docs/perf-notes.md v0.68): every row tile quantizes the weight tiles it reads again.
RAW_FWD_MAX_ROWS = 512


#: MoELayer._kernel_raw until the first launch that takes the raw twin loads it (``_launch_kernel``)
RAW_TWIN_PENDING = "pending"


def _has_twin(kernel) -> bool:
    """Whether ``kernel`` is a build with a raw twin: an MXFP8 build of the expanded form that
    takes the weights' MX values (the loaded build's side of build.raw_twin_options, which decides
    the same from a plan for `mokgen build`)."""
    return _is_mx(kernel) and not _takes_raw(kernel) and getattr(kernel, "MX_FORM", "") == "expand"


def _raw_twin(spec: MoESpec, options: dict, kernel):
    """Under MOKGEN_MX_FWD_WEIGHTS=auto, for a one-GPU MXFP8 layer whose build (``kernel``, made
    with ``options``) is the expanded form's values build: the raw build of the same options, if
    it loads and keeps the same buffers' layout and CTAs (then one set of buffers serves both);
    else None, with a warning where it does not load (a prebuilt wheel without nvcc)."""
    if not _has_twin(kernel):
        return None
    try:
        raw = load(spec, {**options, "mx_fwd_weights": "raw"})
    except (LoadError, ToolchainError) as err:
        import warnings

        warnings.warn(f"mokgen: MOKGEN_MX_FWD_WEIGHTS=auto: the raw build of {spec.name} is not available "
                      f"({err}); every launch takes the values build", stacklevel=3)
        return None
    a, b = kernel.LIB, raw.LIB
    # (a layout is a function of the build's compile-time shapes, so one geometry tells them apart)
    same = (int(a.mokgen_ep_sym_bytes(4096)) == int(b.mokgen_ep_sym_bytes(4096))
            and int(a.mokgen_ep_local_bytes(1, 1024, 2)) == int(b.mokgen_ep_local_bytes(1, 1024, 2))
            and int(a.mokgen_ep_max_ctas()) == int(b.mokgen_ep_max_ctas())
            and int(a.mokgen_ep_cluster()) == int(b.mokgen_ep_cluster()))
    return raw if same and _takes_raw(raw) else None


def _launch_kernel(layer, x: torch.Tensor, grad_inputs):
    """The build a MoELayer launches for this call: its raw twin (``_raw_twin``) for a launch
    autograd records with at most RAW_FWD_MAX_ROWS rows an expert on average where converting the
    weights would not pay (``_raw_pays``), else its own. The twin is loaded (built if the cache
    lacks it) by the first launch that takes it, outside torch.compile and CUDA graph captures
    (those launch the layer's own build until it is loaded), so layers that never train at few
    rows an expert (inference, the tuner's candidates) never build it."""
    raw = getattr(layer, "_kernel_raw", None)
    if raw is None or torch.compiler.is_compiling() or not _mx_training(layer._kernel, grad_inputs):
        return layer._kernel
    few = x.shape[0] * layer.spec.top_k <= RAW_FWD_MAX_ROWS * layer.spec.num_experts
    if not _raw_pays(layer, few):
        return layer._kernel
    if raw is RAW_TWIN_PENDING:
        if _capturing(layer.w_gate):
            return layer._kernel
        raw = layer._kernel_raw = _raw_twin(layer.spec, layer.build_options, layer._kernel)
    return layer._kernel if raw is None else raw


@torch.compiler.disable
def _raw_pays(layer, few: bool) -> bool:
    """For a training launch of a layer with a raw twin (``few``: at most RAW_FWD_MAX_ROWS rows an
    expert): whether the raw build beats converting the weights. The raw build's tiles quantize the
    weights on every launch (1.46-1.68x the values build's launch, v0.68), a conversion once per
    weight version, so the raw build pays only for the first launch at a version when no
    conversion is cached and the previous version took one training launch (one step without
    micro-batches); a second launch at the same version converts, which serves the rest. Counts
    the layer's training launches per weight version (``layer._raw_launches``: the version's key,
    its launches, the previous version's); refresh_mx_weights starts a new version."""
    ws = (layer.w_gate, layer.w_up, layer.w_down)
    key = (_MX_REFRESHES[0], *((w.data_ptr(), None if w.is_inference() else w._version) for w in ws))
    seen = getattr(layer, "_raw_launches", None)
    if seen is None or seen[0] != key:
        seen = [key, 0, 0 if seen is None else seen[1]]
        layer._raw_launches = seen
    seen[1] += 1
    return (few and seen[1] == 1 and seen[2] <= 1
            and not all(_mx_cached(w) is not None for w in ws))


def _takes_raw(kernel) -> bool:
    """Whether ``kernel`` is an MXFP8 build that takes the bf16 weights and quantizes them in its
    tiles (plan mx_fwd_weights "raw"; builds made before v0.68 take their MX values)."""
    return _is_mx(kernel) and getattr(kernel, "MX_FWD_WEIGHTS", "values") == "raw"


def _mx_training(kernel, grad_inputs) -> bool:
    """Whether this launch is an MXFP8 build's under autograd (``_MXTraining`` then records it)."""
    return _is_mx(kernel) and _records_grad(grad_inputs)


class _MXTraining(torch.autograd.Function):
    """An MXFP8 megakernel launch under autograd (issue 6; docs/architecture.md, the MXFP8
    megakernel's "Training through the layer"). The forward is the launch itself, run without a
    graph of its own (``launch``), so the outputs are the bits of the same call under
    ``torch.no_grad``. The backward is the staged MXFP8 experts' (``mokgen.mx_experts``) on the
    launch's tokens, every rank's concatenated in rank order, with the full expert weights: each
    backward GEMM's operands quantized along its own reduction dimension, straight-through to the
    unquantized inputs. What it starts from, by the backward policy (``bwd_policy``, as the BF16
    layer's):

    - ``save`` (the default; v0.64): the launch keeps each (token, slot) pair's gate | up row
      (``save_gu``, bf16, from the up tiles' float32 sums) and, right after it, a copy of its
      combine slots (``slots``: each pair's expert output row, bf16, what the combine summed);
      the backward reads them (``mx_experts.saved_backward``) and runs no forward again. These
      are the rows the staged forward computes, rounded to bf16 (the tiles' sums are the staged
      GEMMs' bit for bit), and routing weights' gradients of the combine the launch ran.
    - ``recompute``: nothing is kept; the backward runs the staged MXFP8 forward again on the
      launch's tokens, then its backward: the gradients of the staged forward, float32 rows
      (which differs from the megakernel's by its rounding of each expert output row to bf16
      before the combine, relative 6e-3 at most in the GPU tests). The recompute takes the
      weights' MX values from the launch's conversions where the cache still holds them.

    Save costs ``T k (2 I + H)`` bf16 bytes held until the backward (kimi-k2.5's 16384 local pairs:
    369 MB) and spares the step a forward (v0.63: 2.95 ms of kimi-k2.5's 20.87 ms)."""

    @staticmethod
    def forward(ctx, launch, clamp_limit, n, slots, *tensors):
        # tensors: xs (n), topk_weights (n), w_gate, w_up, w_down, topk_ids (n)
        with torch.no_grad():
            outs = launch()
            # the pairs' rows the launch kept (save_gu, then the slots' copy, before another
            # launch on these buffers overwrites them), else nothing
            y = slots() if len(outs) > n and slots is not None else None
        # saved like the inputs (saved-tensor hooks see them; a retained graph's second backward
        # reads them again), after them
        rows = (outs[n], y) if y is not None else ()
        ctx.n, ctx.clamp_limit, ctx.n_rows = n, clamp_limit, len(rows)
        ctx.save_for_backward(*tensors, *rows)
        return tuple(outs[:n])

    @staticmethod
    def backward(ctx, *grads):
        from mokgen import mx_experts

        n, t = ctx.n, ctx.saved_tensors
        rows = t[len(t) - ctx.n_rows:] if ctx.n_rows else None
        xs, ws, weights, ids = t[:n], t[n:2 * n], t[2 * n:2 * n + 3], t[2 * n + 3:3 * n + 3]
        sizes = [x.shape[0] for x in xs]
        gos = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, xs)]

        def cat(ts):
            return ts[0] if len(ts) == 1 else torch.cat(list(ts))

        if sum(sizes) == 0:  # no token on any rank: nothing flows back
            d_weights = [torch.zeros_like(w) for w in weights]
            return (None, None, None, None, *[torch.zeros_like(x) for x in xs], *[torch.zeros_like(w) for w in ws],
                    *d_weights, *[None] * n)
        w_dtype = ws[0].dtype if all(w.dtype == ws[0].dtype for w in ws) else torch.float32
        if rows is not None:
            # the dgrads' conversions a training forward made under MOKGEN_MX_WEIGHTS=both, else made here
            dx, dw, *d_weights = mx_experts.saved_backward(cat(gos), cat(xs).detach(), cat(ids),
                                                           cat([w_.to(w_dtype) for w_ in ws]).detach(),
                                                           *(p.detach() for p in weights), *rows, ctx.clamp_limit,
                                                           transposed=_mx_transposed(*weights))
        else:
            with torch.enable_grad():
                x = cat(xs).detach().requires_grad_(True)
                w = cat([w_.to(w_dtype) for w_ in ws]).detach().requires_grad_(True)
                wts = [p.detach().requires_grad_(True) for p in weights]
                # the launch's conversions of the weights, still cached (no step between the
                # forward and this backward), spare the recompute one quantization of every weight
                converted = [_mx_cached(p) for p in weights]
                out = mx_experts._train(x, cat(ids), w, *wts, ctx.clamp_limit,
                                        converted=tuple(converted) if all(c is not None for c in converted) else None,
                                        transposed=_mx_transposed(*weights))
                dx, dw, *d_weights = torch.autograd.grad(out, (x, w, *wts), cat(gos))
        return (None, None, None, None, *dx.split(sizes), *[g.to(w_.dtype) for g, w_ in zip(dw.split(sizes), ws)],
                *d_weights, *[None] * n)


@torch.compiler.disable
def _mx_train(kernel, launch, xs, topk_ids, topk_weights, w_gate, w_up, w_down, slots=None) -> list:
    """``launch()`` (an MXFP8 build's, every rank of it in this process, holding the experts
    ``w_gate`` / ``w_up`` / ``w_down`` [E, ...] between them) recorded for autograd by
    ``_MXTraining``; eager under torch.compile (a graph break). A launch that returns one more
    tensor than ranks saved the pairs' gate | up rows (``save_gu``); ``slots()`` then copies
    the pairs' expert output rows out of the combine slots, and the backward starts from both."""
    n = len(xs)
    return list(_MXTraining.apply(launch, getattr(kernel, "CLAMP_LIMIT", None), n, slots, *xs, *topk_weights, w_gate,
                                  w_up, w_down, *topk_ids))


def _call_op(kernel, grad_inputs, args: tuple, mx_inputs: tuple, bufs: "EpBuffers | None" = None) -> list:
    """The megakernel op on ``args`` (``_op``'s form for ``grad_inputs``); an MXFP8 build's call
    that autograd records goes through ``_mx_train`` with ``mx_inputs`` (xs, topk_ids,
    topk_weights, w_gate, w_up, w_down: the caller's, unconverted) and, where the launch saves
    its rows (``save_gu`` in ``args``), the combine slots of ``bufs`` (one GPU's buffers). An
    eager call that autograd records launches first and is recorded after
    (``_launch_then_record``)."""
    grad = _records_grad(grad_inputs)
    if grad and _is_mx(kernel):  # _mx_training, with grad already known
        slots = None
        if len(args) > _SAVE_GU_ARG and args[_SAVE_GU_ARG] and bufs is not None:
            sizes = [x.shape[0] for x in mx_inputs[0]]
            slots = lambda: bufs.slot_rows(sizes)  # noqa: E731
        return _mx_train(kernel, lambda: _op(kernel, False)(*args), *mx_inputs, slots=slots)
    if grad and not torch.compiler.is_compiling():
        outs = _launch_then_record(kernel, args)
        if outs is not None:
            return outs
    return _op(kernel, grad)(*args)


#: the op's required arguments (xs .. silent_rank); the optional ones follow (shared_gate,
#: shared_up, shared_down, shared_scale, save_gu: the binding's _OPTIONAL_DEFAULTS)
_OP_REQUIRED = 18
#: save_gu's position among the op's arguments (after the four shared-expert ones)
_SAVE_GU_ARG = _OP_REQUIRED + 4


class _LaunchedEp(torch.autograd.Function):
    """The autograd record of an eager megakernel call that has already launched
    (``_launch_then_record``). Its forward only records: the binding's ``_ep_setup_context``
    saves what the backward needs (the inputs, and the pre-activations where the launch saved
    them), and the launch's outputs become this node's. The backward is the binding's own eager
    Function's (``_EagerEp``, behind ``EP_EAGER``, which records before it launches), so the saved
    tensors, the gradients and their bits are the same. Inputs: the kernel
    module, the op's 23 arguments, the launch's outputs (none of the three is a tensor argument
    of the node), then the tensors that get gradients, in ``EP_EAGER``'s order (xs, topk_ids,
    topk_weights, w_gate, w_up, w_down, the shared expert's given tensors)."""

    @staticmethod
    def forward(ctx, kernel, inputs, outs, *tensors):
        kernel._ep_setup_context(ctx, inputs, outs)
        ctx.kernel = kernel
        if inputs[-1]:  # save_gu: the pre-activations are saved for the backward, not differentiated
            ctx.mark_non_differentiable(outs[-1])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # _EagerEp's gradients lead with its one non-tensor input's None; here there are three
        return (None, None, *ctx.kernel._EagerEp.backward(ctx, *grads))


def _launch_then_record(kernel, args: tuple) -> list | None:
    """The op on ``args`` (its positional arguments, the optional ones possibly left off) under
    autograd, in eager mode: the binding's implementation launches the kernel, then
    ``_LaunchedEp`` records the call. Recording first (``EP_EAGER``, an autograd.Function around
    the launch) put the Function's host work, about 25 us in a loop and three times that at the
    start of a training step, between the step's start and the launch, where an idle GPU waits
    for it (docs/perf-notes.md v0.54). None where the binding lacks the pieces (a build older
    than them): the caller then takes ``EP_EAGER``."""
    raw = getattr(kernel, "_ep_forward", None)
    if raw is None or not all(hasattr(kernel, a) for a in ("_ep_setup_context", "_EagerEp", "_OPTIONAL_DEFAULTS")):
        return None
    optional = list(args[_OP_REQUIRED:]) + list(kernel._OPTIONAL_DEFAULTS[len(args) - _OP_REQUIRED:])
    inputs = (*args[:_OP_REQUIRED], *optional)
    outs = raw(*inputs)
    lists = args[:6]
    tensors = [t for lst in lists for t in lst] + [t for t in optional[:4] if t is not None]
    return list(_LaunchedEp.apply(kernel, inputs, outs, *tensors))


@torch.compiler.disable
def _mx_operands(w_gate, w_up, w_down, train: bool = False):
    """The three conversions, eager under torch.compile too (a graph break: the cache keys on the
    tensors themselves and their versions, which a traced graph cannot); the compiled graph then
    takes the converted weights as inputs. ``train`` under MOKGEN_MX_WEIGHTS=both: the backward's
    conversions from the same reads (``_mx_both``)."""
    if train and env.mx_weights() == "both" and not _capturing(w_gate):
        _mx_both(w_gate, w_up, w_down)
    return _mx_operand(w_gate), _mx_operand(w_up), _mx_operand(w_down)


def _op(kernel, grad: bool = True):
    """The megakernel's entry: the registered op (EP_OP) while torch.compile traces, else its
    eager form (EP_EAGER: the same implementation and backward without the custom op's dispatch,
    about half a millisecond less CPU before each launch; builds made before it have EP_OP only;
    ``_call_op`` takes ``_launch_then_record`` before it where the binding allows).
    ``grad`` False (eager, no autograd graph to record: grad mode off or no input requiring
    grad): the binding's implementation itself (``_ep_forward``, what both wrap), without the
    autograd.Function around it, whose apply cost about 45 us of host time before each launch
    (docs/perf-notes.md v0.28), time an idle GPU waits for."""
    if torch.compiler.is_compiling():
        return kernel.EP_OP
    if not grad:
        raw = getattr(kernel, "_ep_forward", None)
        if raw is not None:
            return raw
    return getattr(kernel, "EP_EAGER", None) or kernel.EP_OP


def _records_grad(tensors) -> bool:
    """Whether autograd records a graph through an op of ``tensors`` (grad mode on and one of
    them requiring grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _tail_args(kernel, policy: str, all_in_launch: bool, shared_args: tuple, tensors) -> tuple:
    """The op's optional trailing arguments: ``shared_args`` (the fused shared expert's, or none),
    then ``save_gu=True`` where the backward will read the forward's pre-activations: the "save"
    policy, a build whose epilogue writes them (CAN_SAVE), every rank in this launch, and autograd
    recording a graph through the op."""
    if policy != "save" or not all_in_launch or not getattr(kernel, "CAN_SAVE", False):
        return shared_args
    if not _records_grad(tensors):
        return shared_args
    return (*shared_args, *([None] * (4 - len(shared_args))), True)


def _ring(spec: MoESpec, chunk_rows: int | None, ring_chunks: int | None) -> tuple[int, int]:
    defaults = ep_defaults(spec)
    c = defaults["chunk_rows"] if chunk_rows is None else int(chunk_rows)
    s = defaults["ring_chunks"] if ring_chunks is None else int(ring_chunks)
    if c < 1 or c > 1 << 20:
        raise InputError(f"chunk_rows must be in 1..{1 << 20}, got {c}")
    if s < 1 or s > 1024:
        raise InputError(f"ring_chunks must be in 1..1024, got {s}")
    if spec.target.numerics == "mxfp8" and (c * s) % MX_RING_ROWS_MULTIPLE:
        # the ring's scale planes are read by TMA maps whose row stride (4 bytes per ring row)
        # must be a multiple of 16 bytes
        raise InputError(f"numerics mxfp8: chunk_rows x ring_chunks must be a multiple of {MX_RING_ROWS_MULTIPLE} "
                         f"(the ring's scale planes), got {c} x {s}")
    return c, s


#: an MXFP8 ring's rows (chunk_rows x ring_chunks) come in multiples of this (see _ring)
MX_RING_ROWS_MULTIPLE = 4


#: buffers that MoELayers made with ``share_buffers=True`` hold together, by what they must agree
#: on (build, geometry, device, process group, CTA counts): an entry lives while a layer holds it
_SHARED_BUFFERS: weakref.WeakValueDictionary[tuple, EpBuffers] = weakref.WeakValueDictionary()


def _group_key(group):
    """A process group as a dictionary key (None: one rank); groups hash by identity."""
    if group is None:
        return None
    try:
        hash(group)
    except TypeError:
        return ("id", id(group))
    return group


#: numbers the sets that layer_buffers makes, in order; the ranks of a group make theirs in the same
#: order, so a set made together has the same number on every rank
_SET_NUMBERS = itertools.count(1)


def _agree(values: list[int], group) -> tuple[list[int], list[int]]:
    """(minimum, maximum) of each of ``values`` over the ranks of ``group``: one all-reduce."""
    import torch.distributed as dist

    t = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    n = len(values)
    return t[:n].tolist(), [-v for v in t[n:].tolist()]


def layer_buffers(key: tuple, make, share: bool, group=None, agree=_agree) -> tuple[EpBuffers, bool]:
    """(buffers, shared from another layer) of a new MoELayer: ``make()``'s own buffers, or with
    ``share`` the buffers that an existing layer of the same ``key`` holds (made once, by the
    first such layer). Under a process group the ranks agree first (``agree``: minima and
    maxima over the ranks, one all-reduce, whether or not they share): ``share`` must be the
    same on every rank (else InputError on every rank, before any allocation), and a set is
    reused only where every rank holds one for ``key`` and it is the same set everywhere (its
    number, counted alike on every rank); otherwise every rank makes new buffers (a collective
    allocation) and those become the entry. So no rank waits in a rendezvous that another
    skipped, and no two ranks pair sets that were not made together."""
    found = _SHARED_BUFFERS.get(key) if share else None
    if group is not None:
        number = 0 if found is None else found.set_number
        lo, hi = agree([int(bool(share)), int(found is not None), number], group)
        if lo[0] != hi[0]:
            raise InputError("share_buffers differs between the ranks of the group: every rank must pass the same value")
        if lo[1] == 0 or lo[2] != hi[2]:
            found = None
    if found is not None:
        return found, True
    bufs = make()
    bufs.set_number = next(_SET_NUMBERS)
    if share:
        _SHARED_BUFFERS[key] = bufs
    return bufs, False


#: buffers of virtual_ep_forward / experts_forward, most recently used last; bounded, since one
#: entry of a large model holds gigabytes
_virtual_cache: "OrderedDict[tuple, EpBuffers]" = OrderedDict()
MAX_CACHED_BUFFERS = 2


def release_buffers() -> None:
    """Free the buffers cached by ``virtual_ep_forward`` and ``experts_forward`` (they are
    allocated again, zeroed, on the next call). MoELayer instances own theirs."""
    _virtual_cache.clear()


def _capacity(tokens: int) -> int:
    """Token capacity of cached buffers: the next power of two, at least 256, so growing token
    counts reallocate O(log T) times."""
    return max(256, 1 << max(0, int(tokens) - 1).bit_length())


def _virtual_buffers(kernel, geometry: Geometry, device: torch.device) -> EpBuffers:
    key = (kernel.KEY, geometry.world, device)
    bufs = _virtual_cache.get(key)
    if bufs is not None:
        g = bufs.geometry
        if (g.chunk_rows, g.ring_chunks) == (geometry.chunk_rows, geometry.ring_chunks) and g.max_tokens >= geometry.max_tokens:
            _virtual_cache.move_to_end(key)
            return bufs
        del _virtual_cache[key]
        del bufs
    while len(_virtual_cache) >= MAX_CACHED_BUFFERS:
        _virtual_cache.popitem(last=False)
    bufs = EpBuffers(kernel, geometry, device)
    _virtual_cache[key] = bufs
    return bufs


#: a fused shared expert passed to a build that runs it in PyTorch
_NOT_FUSED = ("shared=: this build runs the shared expert in PyTorch (MOKGEN_FUSE_SHARED=0, or a shared expert "
              "it cannot fuse; see mokgen.plan.can_fuse_shared)")


def _check_shared_weights(spec: MoESpec, gate, up, down, device) -> None:
    """dtype, shape, layout and device of a fused shared expert's weights (w_gate / w_up [I, H],
    w_down [H, I])."""
    H, I = spec.hidden_size, spec.moe_intermediate_size
    for t, n, shape in ((gate, "shared w_gate", (I, H)), (up, "shared w_up", (I, H)), (down, "shared w_down", (H, I))):
        _check(t, n, shape=shape, dtypes=(torch.bfloat16,))
        _check_device(t, n, device)


def _shared_args(spec: MoESpec, shared, tokens: list[int], device) -> tuple:
    """The op's shared-expert arguments (gate, up, down, scale) from ``virtual_ep_forward``'s
    ``shared``: the weights checked, the per-rank scales checked and joined in rank order (the
    op takes every rank's tokens' scales as one tensor), or None."""
    if not isinstance(shared, (list, tuple)) or len(shared) != 4:
        raise InputError("shared: expected (w_gate, w_up, w_down, scales)")
    gate, up, down, scales = shared
    _check_shared_weights(spec, gate, up, down, device)
    scale = None
    if scales is not None:
        if not isinstance(scales, (list, tuple)) or len(scales) != len(tokens):
            raise InputError(f"shared scales: expected None or a list of {len(tokens)} tensors (one per rank)")
        for r, (sc, T) in enumerate(zip(scales, tokens)):
            _check(sc, f"shared scales[{r}]", shape=(T,), dtypes=(torch.float32,))
            _check_device(sc, f"shared scales[{r}]", device)
        scale = scales[0] if len(scales) == 1 else torch.cat(list(scales))
    return gate, up, down, scale


def virtual_ep_forward(
    spec: MoESpec | str,
    xs,
    topk_ids,
    topk_weights,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    chunk_rows: int | None = None,
    ring_chunks: int | None = None,
    timeout_ms: float = DEFAULT_TIMEOUT_MS,
    check_ids: bool = True,
    return_stats: bool = False,
    simulate_missing_rank: int | None = None,
    bwd_policy: str | None = None,
    shared: tuple | None = None,
):
    """Run the expert-parallel megakernel with W = len(xs) virtual ranks on one GPU.

    Rank r holds tokens ``xs[r]`` [T_r, H] bf16 (T_r may differ per rank and be 0) routed by
    ``topk_ids[r]`` [T_r, K] (global expert ids) with ``topk_weights[r]`` [T_r, K], and owns
    experts [r*E/W, (r+1)*E/W) of the stacked weights ``w_gate``/``w_up`` [E, I, H] and ``w_down``
    [E, H, I]. All ranks run inside one persistent launch, each as a group of CTAs with its own
    buffers, through the full protocol: routing prologue, pull dispatch into each rank's receive
    ring of ``ring_chunks`` x ``chunk_rows`` rows, expert GEMMs, push combine, fixed-order
    reduction. Returns the list of outputs [T_r, H] bf16 (and per-rank row counts if
    ``return_stats``). Bitwise identical for any W, chunk size and ring size.

    ``simulate_missing_rank`` (testing): that rank never publishes its routing, so the others
    time out after ``timeout_ms`` and this call raises KernelError naming rank and stage.
    ``bwd_policy``: ``"save"`` or ``"recompute"`` (default: MOKGEN_BWD_POLICY, else save): whether
    a forward that autograd records keeps g and u for the backward (mokgen.backward).
    ``shared`` (builds that fuse the shared expert, ``FUSE_SHARED``): ``(w_gate [I, H], w_up [I, H],
    w_down [H, I], scales)`` of the spec's shared expert, the same weights on every rank, and
    ``scales`` None or a list of W tensors [T_r] fp32; each rank's outputs then include
    ``scales[r][t] * shared_expert(xs[r][t])``, computed inside the launch on the rank's own tokens
    as a MoELayer's (differentiable in all of them).
    """
    if isinstance(spec, str):
        spec = load_spec(spec)
    if not isinstance(xs, (list, tuple)) or not xs:
        raise InputError("xs: expected a non-empty list of per-rank tensors")
    W = len(xs)
    if W > abi.MAX_LAUNCH_RANKS:
        raise InputError(f"xs: at most {abi.MAX_LAUNCH_RANKS} virtual ranks, got {W}")
    if spec.num_experts % W:
        raise InputError(f"xs: {W} ranks must divide num_experts ({spec.num_experts})")
    if not isinstance(topk_ids, (list, tuple)) or len(topk_ids) != W:
        raise InputError(f"topk_ids: expected a list of {W} tensors (one per rank)")
    if not isinstance(topk_weights, (list, tuple)) or len(topk_weights) != W:
        raise InputError(f"topk_weights: expected a list of {W} tensors (one per rank)")
    tokens = [_check_rank_inputs(spec, r, xs[r], topk_ids[r], topk_weights[r]) for r in range(W)]
    _check_expert_weights(spec, spec.num_experts, w_gate, w_up, w_down)
    device = xs[0].device
    for r in range(W):
        for t, n in ((xs[r], f"xs[{r}]"), (topk_ids[r], f"topk_ids[{r}]"), (topk_weights[r], f"topk_weights[{r}]")):
            _check_device(t, n, device)
    for t, n in ((w_gate, "w_gate"), (w_up, "w_up"), (w_down, "w_down")):
        _check_device(t, n, device)
    if max(tokens) > spec.target.max_tokens_per_rank:
        raise InputError(f"xs: {max(tokens)} tokens on one rank exceed target.max_tokens_per_rank = "
                         f"{spec.target.max_tokens_per_rank}")
    if check_ids:
        _check_ids_range(topk_ids, spec.num_experts)
    if simulate_missing_rank is not None and not 0 <= simulate_missing_rank < W:
        raise InputError(f"simulate_missing_rank must be in [0, {W}), got {simulate_missing_rank}")
    if not timeout_ms > 0:
        raise InputError(f"timeout_ms must be positive, got {timeout_ms}")
    shared_args = _shared_args(spec, shared, tokens, device) if shared is not None else ()
    c, s = _ring(spec, chunk_rows, ring_chunks)
    policy = _bwd_policy(bwd_policy)

    kernel = load(spec)
    if shared_args and not getattr(kernel, "FUSE_SHARED", False):
        raise InputError(_NOT_FUSED)
    with torch.cuda.device(device):
        geometry = Geometry(W, W, _capacity(max(tokens)), c, s)
        bufs = _virtual_buffers(kernel, geometry, device)
        ctas, dispatch = _ctas(kernel, W)
        e_loc = spec.num_experts // W
        grad_inputs = (*xs, *topk_weights, w_gate, w_up, w_down, *shared_args)
        tail = _tail_args(kernel, policy, True, shared_args, grad_inputs)
        wg, wu, wd = _weights_for(kernel, w_gate, w_up, w_down, _mx_training(kernel, grad_inputs))
        ids32 = [i if i.dtype == torch.int32 else i.to(torch.int32) for i in topk_ids]
        outs = _call_op(kernel, grad_inputs, (
            list(xs), ids32,
            [w if w.dtype == torch.float32 else w.float() for w in topk_weights],
            [wg[r * e_loc : (r + 1) * e_loc] for r in range(W)],
            [wu[r * e_loc : (r + 1) * e_loc] for r in range(W)],
            [wd[r * e_loc : (r + 1) * e_loc] for r in range(W)],
            *bufs.addresses(), 0, bufs.geometry.max_tokens, c, s, ctas, dispatch,
            int(timeout_ms * 1e6), -1 if simulate_missing_rank is None else int(simulate_missing_rank), *tail,
        ), (xs, ids32, topk_weights, w_gate, w_up, w_down), bufs)
        outs = outs[:W]  # without the saved pre-activations (autograd keeps them)
        if _can_sync():
            err = bufs.read_error()
            if err is not None:
                _raise(bufs, err, timeout_ms)
        if return_stats:
            return list(outs), bufs.stats()
    return list(outs)


def single_rank_forward(spec: MoESpec, x, topk_ids, topk_weights, w_gate, w_up, w_down) -> torch.Tensor:
    """The megakernel as one rank holding every expert (inputs already validated by the caller).
    Buffers are cached per (build, device); a timeout of an earlier call surfaces here."""
    kernel = load(spec)
    c, s = _ring(spec, None, None)
    device = x.device
    with torch.cuda.device(device):
        bufs = _virtual_buffers(kernel, Geometry(1, 1, _capacity(x.shape[0]), c, s), device)
        if not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing():
            err = bufs.poll(block=False)
            if err is not None:
                _raise(bufs, err, DEFAULT_TIMEOUT_MS)
        ctas, dispatch = _ctas(kernel, 1)
        grad_inputs = (x, topk_weights, w_gate, w_up, w_down)
        tail = _tail_args(kernel, env.bwd_policy(), True, (), grad_inputs)
        wg, wu, wd = _weights_for(kernel, w_gate, w_up, w_down, _mx_training(kernel, grad_inputs))
        ids32 = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
        out = _call_op(kernel, grad_inputs, (
            [x], [ids32],
            [topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()],
            [wg], [wu], [wd],
            *bufs.addresses(), 0, bufs.geometry.max_tokens, c, s, ctas, dispatch, int(DEFAULT_TIMEOUT_MS * 1e6), -1,
            *tail,
        ), ([x], [ids32], [topk_weights], w_gate, w_up, w_down), bufs)[0]
        if not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing():
            bufs.watch()
    return out


def _tuned_choice(spec: MoESpec, group, world: int, max_tokens: int, device, tuned: bool, build_options,
                  explicit: tuple, stand_in: bool = False):
    """(tuned entry or None, build options, (chunk_rows, ring_chunks, dispatch_ctas)) of a new
    MoELayer: ``build_options`` as given; else the tuned entry of (spec, GPU, world, max_tokens'
    bucket) where one fits and, under a group, every rank found the same one; else the plan's
    defaults. The caller's explicit run-time values (``explicit``, None = unset) always win.
    An entry timed on the one-GPU stand-in of EP > 1 found its dispatch count for local copies:
    a real EP layer, whose dispatch crosses links, keeps its own default; ``stand_in``: the
    caller is that stand-in (bench.local_layer_kwargs), which runs the entry's count too."""
    import warnings

    if build_options is not None:
        return None, build_options, explicit
    entry = None
    if tuned:
        from mokgen import tune

        try:
            entry = tune.lookup(spec, gpu=torch.cuda.get_device_name(device), ep=world, tokens=max_tokens)
        except Exception as err:  # a lookup never breaks a layer, nor leaves one rank behind the others
            warnings.warn(f"mokgen: looking up tuned parameters failed ({err}); the plan's defaults apply", stacklevel=3)
        if group is not None:
            import torch.distributed as dist

            mine = None if entry is None else entry.best.to_json()
            theirs: list = [None] * world
            dist.all_gather_object(theirs, mine, group=group)
            if any(t != mine for t in theirs):
                warnings.warn("mokgen: the ranks of this MoELayer found different tuned entries; all use the plan's "
                              "defaults", stacklevel=3)
                entry = None
    if entry is None:
        return None, env.plan_options_with(None), explicit
    best, (c, r, d) = entry.best, explicit
    tuned_d = None if entry.key.workload == "local" and world > 1 and not stand_in else best.dispatch_ctas
    return entry, env.plan_options_with(best.build_options()), (best.chunk_rows if c is None else c,
                                                                 best.ring_chunks if r is None else r,
                                                                 tuned_d if d is None else d)


def _load_agreed(spec: MoESpec, options: dict, group, entry):
    """(kernel module, build options) of a new MoELayer. A tuned variant (``entry`` set) that is
    neither installed, cached nor buildable here (a prebuilt wheel holds the default build)
    gives way to the default build, with the entry's run-time values. Under a group the ranks
    agree first: if any rank falls back, all do; if any fails otherwise, all raise."""
    status, error, kernel = 0, None, None
    try:
        kernel = load(spec, options)
    except (LoadError, ToolchainError) as err:
        status, error = (1 if entry is not None else 2), err
    except Exception as err:  # raised below, after the other ranks know
        status, error = 2, err
    worst = status
    if group is not None:
        import torch.distributed as dist

        flag = torch.tensor([status], device="cuda")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        worst = int(flag.item())
    if worst == 2:
        raise error if status == 2 else LoadError(f"{spec.name}: the kernel failed to load on another rank")
    if worst == 1:
        import warnings

        why = f" ({error})" if error is not None else " (on another rank)"
        warnings.warn(f"mokgen: the tuned build of {spec.name} ({entry.path.name}) is not available{why}; "
                      "using the default build", stacklevel=3)
        options = env.plan_options_with(None)
        kernel = load(spec, options)
    return kernel, options


def cuda_device(device, who: str) -> torch.device:
    """``device`` (None: the current CUDA device) as a CUDA device with its index, or an InputError
    naming ``who`` when it is not a CUDA device or no GPU is visible (not torch's assertion)."""
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        raise InputError(f"{who}: device must be a CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise InputError(f"{who}: no CUDA GPU is visible (torch.cuda.is_available() is False); it runs on an "
                         "sm_90 GPU (`mokgen build` compiles without one)")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


class MoELayer(torch.nn.Module):
    """The routed experts of one expert-parallel rank, run by the megakernel.

    ``group``: a torch.distributed process group whose ranks are the EP ranks (one GPU each,
    NVLink peers; buffers through torch symmetric memory), or None for a single rank. The module
    holds this rank's E/W experts in the Hugging Face layout (w_gate/w_up [E/W, I, H], w_down
    [E/W, H, I]). ``forward(x, topk_ids, topk_weights)`` takes this rank's tokens with GLOBAL
    expert ids and returns [T, H] bf16; every rank of the group must call it together.
    ``max_tokens``: the most tokens any rank will pass (sizes the symmetric buffers once).
    ``chunk_rows`` / ``ring_chunks``: the receive ring (default: ``plan.ep_defaults``);
    ``dispatch_ctas``: how many of the rank's CTAs pull rows while the rest compute (default: an
    eighth of them; a sixteenth for a single rank, unless its experts are narrow: ``NARROW_EXPERTS``);
    under the plan's ``dispatch_join`` (the default) they compute too once the last chunk is pulled.
    ``tuned``: use the tuned entry of (spec, this GPU, EP degree, max_tokens' bucket) where one
    exists and fits (``mokgen tune``; ``tuned_entry`` then names its file): its build options
    and, for those not passed here, its chunk_rows / ring_chunks / dispatch_ctas. Without one,
    the plan's defaults. ``build_options``: make_plan keyword arguments for the kernel (instead
    of the environment and tuned entry; what `mokgen tune` uses to time candidates).
    ``bwd_policy``: ``"save"`` or ``"recompute"`` (default: MOKGEN_BWD_POLICY, else save), the
    backward's source of the pre-activations g and u (mokgen.backward); the attribute of the
    same name can change it between calls. A multi-GPU layer always recomputes.
    ``bwd_ring``: ``"auto"``, ``"reuse"`` or ``"gather"`` (default: MOKGEN_BWD_RING, else auto),
    where a one-rank layer's backward takes its pairs' x rows: in place from the forward's
    receive ring, where the ring still holds every received row and no other launch on the
    layer's buffers ran in between (auto; eager mode: never under torch.compile or after a CUDA graph
    capture of the layer or of one sharing its buffers; a ring whose size was not passed is grown to hold max_tokens x top_k
    rows where that takes at most AUTO_RING_GROWTH times its chunks); the same, with the ring
    sized to hold max_tokens x top_k rows so that it always does (reuse: 2 (H + I) + 16 bytes per row of memory for the life of the layer); or
    gathered again from x (gather). The bits are the same.
    ``share_buffers``: run on the persistent buffers (``buffer_bytes``: the symmetric region with
    the combine slots, the receive ring) of an existing layer made with the same argument, build,
    geometry (max_tokens, ring, group) and CTA counts, instead of allocating its own: one set for
    the MoE layers of a whole model instead of one each. The layers sharing them must run one
    after the other in stream order, as a model's layers do (on one stream; every rank in the
    same order: a rank that launches another of them than its peers is not detected, where
    layers with their own buffers would time out); a backward under ``bwd_ring="auto"`` then
    reads the ring in place only for the layer that launched last, and gathers x for the others
    (the same bits); ``bwd_ring="reuse"`` is refused (MOKGEN_BWD_RING=reuse gives way to auto,
    with a warning). ``check_errors`` and ``stats`` report the last launch on the buffers. Under
    a group every rank must pass the same ``share_buffers``.
    """

    def __init__(self, spec: MoESpec | str, group=None, *, max_tokens: int | None = None,
                 chunk_rows: int | None = None, ring_chunks: int | None = None,
                 dispatch_ctas: int | None = None, timeout_ms: float = DEFAULT_TIMEOUT_MS, device=None,
                 tuned: bool = True, build_options: dict | None = None, bwd_policy: str | None = None,
                 bwd_ring: str | None = None, share_buffers: bool = False):
        super().__init__()
        self.bwd_policy = bwd_policy  # checked once, by the property's setter
        self.bwd_ring = _bwd_ring(bwd_ring)
        if share_buffers and self.bwd_ring == "reuse":
            if bwd_ring is not None:
                raise InputError("bwd_ring='reuse' keeps every row in the layer's own ring until its backward; with "
                                 "share_buffers=True another layer's forward overwrites it: use bwd_ring='auto' or "
                                 "'gather'")
            import warnings

            warnings.warn("mokgen: MOKGEN_BWD_RING=reuse does not apply to a layer made with share_buffers=True "
                          "(another layer's forward overwrites the ring); this layer uses bwd_ring='auto'", stacklevel=2)
            self.bwd_ring = "auto"
        self.spec = load_spec(spec) if isinstance(spec, str) else spec
        s = self.spec
        if group is not None:
            import torch.distributed as dist

            self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        else:
            self.world, self.rank = 1, 0
        if self.world > abi.MAX_WORLD or s.num_experts % self.world:
            raise InputError(f"EP degree {self.world} must divide num_experts ({s.num_experts}) and be <= {abi.MAX_WORLD}")
        self.group = group
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral)):
            raise InputError(f"max_tokens must be an int, got {max_tokens!r}")  # never truncated or parsed
        self.max_tokens = s.target.max_tokens_per_rank if max_tokens is None else int(max_tokens)
        if not 1 <= self.max_tokens <= s.target.max_tokens_per_rank:
            raise InputError(f"max_tokens must be in 1..{s.target.max_tokens_per_rank}, got {self.max_tokens}")
        _ring(s, chunk_rows, ring_chunks)  # explicit values are checked before anything else happens
        ring_given = ring_chunks is not None
        device = cuda_device(device, type(self).__name__)
        #: the tuned entry in use (mokgen.tune.Entry), or None: the plan's defaults
        with torch.cuda.device(device):  # its collectives (under a group) run on this layer's GPU
            self.tuned_entry, build_options, (chunk_rows, ring_chunks, dispatch_ctas) = _tuned_choice(
                s, group, self.world, self.max_tokens, device, tuned, build_options,
                (chunk_rows, ring_chunks, dispatch_ctas))
        self.build_options = dict(build_options)
        self.chunk_rows, self.ring_chunks = _ring(s, chunk_rows, ring_chunks)
        self.ring_chunks = _ring_for_backward(s, self.world, self.max_tokens, self.chunk_rows, self.ring_chunks,
                                              self.bwd_ring, explicit=ring_given)
        self.timeout_ms = float(timeout_ms)
        #: validate the expert-id range before each launch (one device sync; off for graphs)
        self.check_ids = True
        e_loc = s.num_experts // self.world
        H, I = s.hidden_size, s.moe_intermediate_size
        kw = dict(device=device, dtype=torch.bfloat16)
        self.w_gate = torch.nn.Parameter(torch.empty(e_loc, I, H, **kw))
        self.w_up = torch.nn.Parameter(torch.empty(e_loc, I, H, **kw))
        self.w_down = torch.nn.Parameter(torch.empty(e_loc, H, I, **kw))
        with torch.no_grad():
            torch.nn.init.normal_(self.w_gate, std=1 / math.sqrt(H))
            torch.nn.init.normal_(self.w_up, std=1 / math.sqrt(H))
            torch.nn.init.normal_(self.w_down, std=1 / math.sqrt(I))
        # Resolve the kernel and allocate the buffers now, outside any torch.compile region.
        with torch.cuda.device(device):
            self._kernel, self.build_options = _load_agreed(s, self.build_options, group, self.tuned_entry)
            self._ctas, self._dispatch = _ctas(self._kernel, 1, self.world)
            if dispatch_ctas is not None:  # checked before any buffer exists
                pair = int(self._kernel.LIB.mokgen_ep_cluster())
                P = int(dispatch_ctas)
                if not 1 <= P <= self._ctas - pair or P % pair:
                    extra = f" and a multiple of {pair} (CTA pairs)" if pair > 1 else ""
                    raise InputError(f"dispatch_ctas must be in 1..{self._ctas - pair}{extra} (this GPU runs "
                                     f"{self._ctas} CTAs per rank), got {dispatch_ctas}")
                self._dispatch = P
            geometry = Geometry(self.world, 1, self.max_tokens, self.chunk_rows, self.ring_chunks)
            key = (self._kernel.KEY, geometry, device, _group_key(group), self._ctas, self._dispatch)
            #: whether this layer found its buffers made by another layer (share_buffers=True)
            self._ep, self.buffers_shared = layer_buffers(
                key, lambda: EpBuffers(self._kernel, geometry, device, group), bool(share_buffers), group)
            #: MOKGEN_MX_FWD_WEIGHTS=auto: the raw build launched for training launches with few rows
            #: an expert (_launch_kernel), on the same buffers: RAW_TWIN_PENDING until the first such
            #: launch loads it; None where there is none (or it did not load)
            self._kernel_raw = (RAW_TWIN_PENDING if env.mx_fwd_weights_auto() and self.world == 1
                                and _has_twin(self._kernel) else None)
        self.share_buffers = bool(share_buffers)
        if self.world > 1:
            _EP_GROUPS[int(self._ep.addresses()[1])] = group
        elif self.build_options.get("pull_mode") != "gather":  # (which reads x in place: no ring rows)
            _RING_OWNERS[int(self._ep.addresses()[1])] = weakref.ref(self._ep)

    @property
    def dispatch_ctas(self) -> int:
        """How many of the rank's CTAs pull rows (the caller's value, the tuned entry's or the
        default), before they join the compute under the plan's ``dispatch_join``."""
        return self._dispatch

    @property
    def buffer_bytes(self) -> int:
        """Device memory of the megakernel's persistent buffers this layer runs on (its symmetric
        region, private region and control block; mokgen.ep's module docstring). Layers made with
        ``share_buffers=True`` and the same build, geometry and group hold one set between them."""
        return self._ep.nbytes

    @property
    def bwd_policy(self) -> str:
        """"save" or "recompute": where the backward takes g and u from (mokgen.backward)."""
        return self._bwd_policy

    @bwd_policy.setter
    def bwd_policy(self, value: str | None) -> None:
        self._bwd_policy = _bwd_policy(value)

    @property
    def local_experts(self) -> range:
        e_loc = self.spec.num_experts // self.world
        return range(self.rank * e_loc, (self.rank + 1) * e_loc)

    def check_errors(self, block: bool = True) -> None:
        """Raise KernelError if a finished forward of this layer timed out."""
        err = self._ep.poll(block=block)
        if err is None and block:
            err = self._ep.read_error()
        if err is not None:
            _raise(self._ep, err, self._ep.watched_timeout_ms or self.timeout_ms)

    def stats(self) -> dict:
        """This rank's statistics of the last forward (blocks until it finished): rows received,
        pulled, pushed and pulled from other ranks, and phase times (``mokgen.abi.parse_stats``)."""
        return self._ep.stats()[0]

    @property
    def fuses_shared(self) -> bool:
        """Whether this build runs the shared expert inside the megakernel (plan.fuse_shared: by
        default wherever mokgen.plan.can_fuse_shared allows; ``MOKGEN_FUSE_SHARED=0`` turns it
        off): forward then takes ``shared=``."""
        return bool(getattr(self._kernel, "FUSE_SHARED", False))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                shared: tuple | None = None) -> torch.Tensor:
        """``shared`` (fused builds only, see ``fuses_shared``): ``(w_gate [I, H], w_up [I, H],
        w_down [H, I], scale [T] fp32 or None)`` of the spec's shared expert; the output then
        includes ``scale[t] * shared_expert(x[t])`` (differentiable in all four)."""
        s, bufs = self.spec, self._ep
        T = _check_rank_inputs(s, 0, x, topk_ids, topk_weights)
        shared_args = ()
        if shared is not None:
            if not self.fuses_shared:
                raise InputError(_NOT_FUSED)
            gate, up, down, scale = shared
            _check_shared_weights(s, gate, up, down, bufs.device)
            if scale is not None:
                _check(scale, "shared scale", shape=(T,), dtypes=(torch.float32,))
                _check_device(scale, "shared scale", bufs.device)
            shared_args = (gate, up, down, scale)
        for t, n in ((x, "x"), (topk_ids, "topk_ids"), (topk_weights, "topk_weights")):
            _check_device(t, n, bufs.device)
        if T > self.max_tokens:
            raise InputError(f"x: {T} tokens exceed this layer's max_tokens ({self.max_tokens})")
        compiling = torch.compiler.is_compiling()
        capturing = not compiling and torch.cuda.is_current_stream_capturing()
        if not compiling:
            if self.check_ids:
                _check_ids_range([topk_ids], s.num_experts)
            if not capturing:
                self.check_errors(block=False)
        g = bufs.geometry
        grad_inputs = (x, topk_weights, self.w_gate, self.w_up, self.w_down, *shared_args)
        if self.world != 1 and _mx_training(self._kernel, grad_inputs):  # before any launch or conversion
            raise InputError("MXFP8 training needs every expert on this GPU (the backward runs the staged MXFP8 "
                             "experts on one GPU): a multi-GPU MXFP8 layer is forward only, run it under "
                             "torch.no_grad()")
        kernel = _launch_kernel(self, x, grad_inputs)
        tail = _tail_args(kernel, self._bwd_policy, self.world == 1, shared_args, grad_inputs)
        ids32 = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
        # what this launch leaves in the ring, for the backward (ring_rows_of): known in eager
        # mode only; a compiled call forgets the last key, a captured one stops the tracking.
        # An eager call's key is taken after its launch (host time the GPU no longer waits for);
        # until then the ring holds no tracked rows, so a launch that fails claims none.
        bufs.ring_key = None
        if capturing:
            bufs.ring_untracked = True
        wg, wu, wd = _weights_for(kernel, self.w_gate, self.w_up, self.w_down, _mx_training(kernel, grad_inputs))
        out = _call_op(kernel, grad_inputs, (
            [x], [ids32],
            [topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()],
            [wg], [wu], [wd],
            *bufs.addresses(), self.rank, g.max_tokens, g.chunk_rows, g.ring_chunks,
            self._ctas, self._dispatch, int(self.timeout_ms * 1e6), -1, *tail,
        ), ([x], [ids32], [topk_weights], self.w_gate, self.w_up, self.w_down), bufs)[0]
        if not compiling and not capturing:
            if self.bwd_ring != "gather":
                bufs.ring_key = _ring_key(x, ids32)
            bufs.watch(self.timeout_ms)
        return out

    def extra_repr(self) -> str:
        s = self.spec
        return (f"spec={s.name}, rank={self.rank}/{self.world}, local_experts={len(self.local_experts)}, "
                f"max_tokens={self.max_tokens}, ring={self.ring_chunks}x{self.chunk_rows} rows"
                + (f", tuned={self.tuned_entry.path.name}" if self.tuned_entry is not None else ""))


class MoEExperts(MoELayer):
    """All E routed experts of a spec on one GPU (a single-rank MoELayer), weights in the
    Hugging Face layout: w_gate/w_up [E, I, H], w_down [E, H, I]; forward and backward as
    MoELayer's."""

    def __init__(self, spec: MoESpec | str, *, device=None, dtype: torch.dtype = torch.bfloat16,
                 max_tokens: int | None = None, share_buffers: bool = False):
        spec = load_spec(spec) if isinstance(spec, str) else spec
        if dtype != torch.bfloat16:
            raise InputError(f"MoEExperts: dtype must be torch.bfloat16 for numerics {spec.target.numerics}")
        super().__init__(spec, None, max_tokens=max_tokens, device=device, share_buffers=share_buffers)
