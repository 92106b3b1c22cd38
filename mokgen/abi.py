"""ctypes mirrors of the C structs the launcher library exchanges with Python.

Each mirrors a struct in templates/include/mokgen/ (named beside it); the generated binding checks
the sizes against the library at load time, so a mismatch is a LoadError, never a bad launch.
"""

from __future__ import annotations

import ctypes
import struct

MAX_WORLD = 64          # kMaxWorld in ep_forward.cuh
MAX_LAUNCH_RANKS = 16   # kMaxLaunchRanks in ep_forward.cuh

_P = ctypes.c_void_p


class EpParams(ctypes.Structure):
    """mokgen::EpParams (ep_forward.cuh): run-time parameters of one megakernel launch."""

    _fields_ = [
        ("sym", _P * MAX_WORLD),
        ("local", _P * MAX_LAUNCH_RANKS),
        ("x", _P * MAX_LAUNCH_RANKS),
        ("ids", _P * MAX_LAUNCH_RANKS),
        ("weights", _P * MAX_LAUNCH_RANKS),
        ("w_gate", _P * MAX_LAUNCH_RANKS),
        ("w_up", _P * MAX_LAUNCH_RANKS),
        ("w_down", _P * MAX_LAUNCH_RANKS),
        ("out", _P * MAX_LAUNCH_RANKS),
        ("save_gu", _P * MAX_LAUNCH_RANKS),
        ("shared_w", _P * 3),
        ("shared_scale", _P * MAX_LAUNCH_RANKS),
        ("ctl", _P),
        ("timeout_ns", ctypes.c_longlong),
        ("num_tokens", ctypes.c_int * MAX_LAUNCH_RANKS),
        ("world", ctypes.c_int),
        ("rank_base", ctypes.c_int),
        ("launch_ranks", ctypes.c_int),
        ("ctas_per_rank", ctypes.c_int),
        ("dispatch_ctas", ctypes.c_int),
        ("max_tokens", ctypes.c_int),
        ("chunk_rows", ctypes.c_int),
        ("ring_chunks", ctypes.c_int),
        ("silent_rank", ctypes.c_int),
    ]


#: StatSlot of ep_forward.cuh: int64 per-rank statistics of the last launch, in slot order
STAT_SLOTS = ("rows_received", "rows_pulled", "rows_pushed", "rows_remote",
              "t_start_ns", "t_pull_first_ns", "t_pull_last_ns", "t_done_ns", "t_push_first_ns")
STAT_BYTES = 8 * len(STAT_SLOTS)


def parse_stats(vals: list[int]) -> dict:
    """Raw stat slots -> rows received/pulled/pushed/remote and the rank's phase times (ms,
    from its first CTA's start): ``pull_ms`` from the first pull to the last landed chunk (None
    when nothing was pulled), ``done_ms`` until every push was issued, ``push_ms`` from the first
    row block's pushes to done (None when nothing was pushed): the combine's push window."""
    d = dict(zip(STAT_SLOTS, vals))
    out = {k: d[k] for k in ("rows_received", "rows_pulled", "rows_pushed", "rows_remote")}
    t0 = d["t_start_ns"]
    pulled = d["rows_pulled"] > 0 and d["t_pull_last_ns"] >= d["t_pull_first_ns"]
    out["pull_start_ms"] = (d["t_pull_first_ns"] - t0) / 1e6 if pulled else None
    out["pull_ms"] = (d["t_pull_last_ns"] - d["t_pull_first_ns"]) / 1e6 if pulled else None
    out["done_ms"] = (d["t_done_ns"] - t0) / 1e6 if d["t_done_ns"] >= t0 > 0 else None
    pushed = d["rows_pushed"] > 0 and d["t_done_ns"] >= d["t_push_first_ns"]
    out["push_ms"] = (d["t_done_ns"] - d["t_push_first_ns"]) / 1e6 if pushed else None
    return out


#: kStatSlots (ep_forward.cuh) and kRouteParts (ep_routing.cuh): array lengths of LocalLayout
LAYOUT_STAT_SLOTS = 9
ROUTE_PARTS = 32
#: the fields of LocalLayout (ep_forward.cuh), in the order its constructor takes them
LOCAL_FIELDS = ("bar_rank", "bar_compute", "tile_next", "stats", "chunk_landed", "chunk_free", "chunk_arrived",
                "chunk_done", "block_done", "recv_expert_offset", "recv_base", "recv_src_off", "ring_meta", "ring_x",
                "ring_h", "route_hist")


def local_layout(experts: int, hidden: int, inter: int, world: int, chunk_rows: int, ring_chunks: int,
                 numerics: str = "bf16", mx_form: str = "codes") -> dict[str, int]:
    """mokgen::LocalLayout<Cfg> (ep_forward.cuh): the byte offset of each array in a rank's
    private region, and ``total``. The backward reads the receive ring's x rows in place through
    it (mokgen.ep.EpBuffers.ring_x); EpBuffers checks ``total`` and ``stats`` against the
    library's own figures before it trusts the rest, and tests/test_ep_inputs.py compares every
    field with the compiled header."""
    e_loc = experts // world
    ring_rows = chunk_rows * ring_chunks
    # ring rows and h: E4M3 codes plus scale planes (an MXFP8 build's codes form), else bf16 (its
    # expanded form, v0.57, holds the rows' bf16 MX values)
    codes = numerics == "mxfp8" and mx_form == "codes"
    elem = 1 if codes else 2
    sizes = [8, 8, 8, 8 * LAYOUT_STAT_SLOTS, 8 * ring_chunks, 8 * ring_chunks, 8 * ring_chunks, 8 * ring_chunks,
             8 * ring_rows, 4 * (e_loc + 1), 4 * (experts + 1), 4 * experts, 8 * ring_rows, elem * ring_rows * hidden,
             elem * ring_rows * inter, 4 * ROUTE_PARTS * experts]
    fields = list(LOCAL_FIELDS)
    if codes:  # the scale planes, taken after ring_h
        fields[15:15] = ["ring_x_scales", "ring_h_scales"]
        sizes[15:15] = [ring_rows * hidden // 32, ring_rows * inter // 32]
    out, at = {}, 0
    for name, size in zip(fields, sizes):
        out[name] = at
        at = (at + size + 255) // 256 * 256
    out["total"] = at
    return out


def sym_layout(experts: int, hidden: int, inter: int, top_k: int, max_tokens: int, numerics: str = "bf16",
               fuse_shared: bool = False) -> dict[str, int]:
    """mokgen::SymLayout<Cfg> (ep_forward.cuh): the byte offset of each array in a rank's
    symmetric region, and ``total``. An MXFP8 launch's backward reads the combine slots (each
    (token, slot) pair's expert output row, bf16 ``[max_tokens * top_k, hidden]``) through it
    (mokgen.ep.EpBuffers.slot_rows); EpBuffers checks ``total`` against the library's own figure
    before it trusts the rest, and tests/test_ep_inputs.py compares every field with the compiled
    header."""
    mx = numerics == "mxfp8"
    fuse = 1 if fuse_shared else 0
    fields = [("routing_ready", 8), ("done", 8 * MAX_WORLD), ("send_count", 4 * experts),
              ("send_offset", 4 * (experts + 1)), ("send_pairs", 4 * max_tokens * top_k),
              ("x", (1 if mx else 2) * max_tokens * hidden)]
    if mx:  # the published rows' E8M0 scales, right after their codes
        fields.append(("x_scales", max_tokens * hidden // 32))
    fields += [("slots", 2 * max_tokens * top_k * hidden), ("shared_blk", 8 * fuse * ((max_tokens + 127) // 128)),
               ("shared_h", 2 * fuse * max_tokens * inter), ("shared_y", 2 * fuse * max_tokens * hidden)]
    out, at = {}, 0
    for name, size in fields:
        out[name] = at
        at = (at + size + 255) // 256 * 256
    out["total"] = at
    return out


# mokgen::Control (sync.cuh): u64 epoch, u32 finished, u32 abort, then ErrorRecord
# {int code, rank, stage, peer; u64 epoch}.
ERROR_OFFSET = 16
ERROR_BYTES = 24
_ERROR = struct.Struct("<iiiiQ")

#: Stage enum of sync.cuh -> what the waiting rank was waiting for
STAGES = {
    1: "the routing tables of rank {peer} (its prologue never published)",
    2: "the other CTAs of its own rank",
    3: "a free slot of its receive ring",
    4: "rows of its receive ring to land",
    5: "the combine pushes of rank {peer}",
    6: "the up projection of a row block (its own compute CTAs)",
}


def parse_error(raw: bytes) -> dict | None:
    """The ErrorRecord bytes -> None (no error) or a dict with code, rank, stage, peer, epoch."""
    code, rank, stage, peer, epoch = _ERROR.unpack(raw[:ERROR_BYTES])
    if code == 0:
        return None
    return {"code": code, "rank": rank, "stage": stage, "peer": peer, "epoch": epoch}


def describe_error(err: dict, timeout_ms: float) -> str:
    what = STAGES.get(err["stage"], f"stage {err['stage']}").format(peer=err["peer"])
    return (
        f"expert-parallel forward timed out: rank {err['rank']} waited more than {timeout_ms:g} ms for {what} "
        f"(launch epoch {err['epoch']}); a peer is missing, hung, or was called with different arguments"
    )
