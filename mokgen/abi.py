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
