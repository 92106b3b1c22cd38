"""NVLink link microbenchmark: pull versus push copies between ranks, and signal latency.

Measures what the megakernel's dispatch is built from, between real GPUs of a torch.distributed
process group (one process per GPU, NCCL, peer buffers from torch symmetric memory):

* copy bandwidth: every rank at once (a bidirectional load, as in an all-to-all) moves ``size``
  bytes with its next rank, (rank + 1) % W, through ``templates/linkbench.cu``'s copy kernel,
  for each CTA count. *pull*: each rank reads its next rank's source region into its own
  destination region; *push*: each rank writes its source region into its next rank's
  destination region and bumps a completion counter there; the time counted is until the
  receiver's counter is complete (a wait kernel on the receiver's stream).
* signal latency: rank 0 and rank 1 bounce a flag (system-scope release store, acquire poll);
  one-way latency = time / (2 * round trips). The other ranks stay idle.

Copies are verified byte for byte after the timed runs (a rank-dependent pattern; the bytes past
``size`` must stay untouched). NVLink multicast stays off throughout.

Under torchrun: ``torchrun --standalone --nproc-per-node N -m mokgen.linkbench --out DIR`` prints
a table on rank 0 and writes ``DIR/link.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from mokgen._version import __version__
from mokgen.build import build_source, find_source_library, source_library_path, source_toolchain
from mokgen.errors import InputError, KernelError, MokgenError

ARCH = "sm_90a"
SOURCE = "linkbench.cu"
LIBRARY = "liblinkbench.so"
#: NVLink multicast stays off (it can take a shared host's GPUs out of service)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: H200 NVLink line rate, GB/s per direction per GPU (the table's "% line" column)
LINE_RATE_GBPS = 450.0

DEFAULT_SIZES = (1 << 20, 16 << 20, 64 << 20, 256 << 20)
DEFAULT_CTAS = (8, 16, 32, 64, 132)

# flag area after the two data regions: one 128-byte line per counter, so no two share a line
_PULL, _PUSH, _GATE, _PING = 0, 128, 256, 384
_FLAG_BYTES = 4096
_POISON = 255  # never in the pattern (its bytes are < 251)
_GUARD = 4096  # bytes past `size` checked to be untouched
_ERRORS = {1: "a completion counter did not reach its target", 2: "the ping-pong partner stopped answering"}


def _no_multicast() -> None:
    """Force the multicast switches off (a value that turns multicast on would be overridden too:
    keeping it off is not optional on shared hosts). Effective for what starts afterwards."""
    os.environ.update(NO_MULTICAST)


# ---- build -------------------------------------------------------------------------------------


def library_path() -> Path:
    """Where this toolchain's build of the library lives (built or not)."""
    return source_library_path(SOURCE, LIBRARY, cutlass=False, arch=ARCH)


def build_library(*, force: bool = False) -> Path:
    """Compile ``templates/linkbench.cu`` into the build cache once (or find it there); returns
    the library's path (mokgen.build.build_source: cached by the source, the headers, the flags
    and nvcc; a failed build keeps its source and log and names them)."""
    return build_source(SOURCE, LIBRARY, cutlass=False, arch=ARCH, force=force)


class _Lib:
    """The library's entry points with ctypes signatures; a non-zero CUDA code raises."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        vp, ll, ull, i = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_ulonglong, ctypes.c_int
        lib.mokgen_link_error_string.argtypes, lib.mokgen_link_error_string.restype = [i], ctypes.c_char_p
        lib.mokgen_link_copy.argtypes, lib.mokgen_link_copy.restype = [vp, vp, ll, i, i, vp, i, vp], i
        lib.mokgen_link_wait.argtypes, lib.mokgen_link_wait.restype = [vp, ull, ll, vp, vp], i
        lib.mokgen_link_pingpong.argtypes = [vp, vp, i, i, ull, ll, vp, vp, vp]
        lib.mokgen_link_pingpong.restype = i
        self._lib = lib

    def _check(self, what: str, code: int) -> None:
        if code != 0:
            msg = self._lib.mokgen_link_error_string(code).decode()
            raise KernelError(f"{what} failed to launch: CUDA error {code} ({msg})")

    def copy(self, dst: int, src: int, nbytes: int, ctas: int, threads: int, counter: int, unroll: int,
             stream: int) -> None:
        self._check("mokgen_link_copy", self._lib.mokgen_link_copy(dst, src, nbytes, ctas, threads, counter or None,
                                                                   unroll, stream))

    def wait(self, counter: int, target: int, timeout_ns: int, error: int, stream: int) -> None:
        self._check("mokgen_link_wait", self._lib.mokgen_link_wait(counter, target, timeout_ns, error, stream))

    def pingpong(self, my_flag: int, peer_flag: int, iters: int, initiator: bool, base: int, timeout_ns: int,
                 out_ns: int, error: int, stream: int) -> None:
        self._check("mokgen_link_pingpong", self._lib.mokgen_link_pingpong(
            my_flag, peer_flag, iters, int(initiator), base, timeout_ns, out_ns or None, error, stream))


@lru_cache(maxsize=None)
def _load(path: str) -> _Lib:
    return _Lib(Path(path))


def load_library() -> _Lib:
    """The library, built first if needed (unless MOKGEN_DISABLE_JIT=1: then a missing build is
    an error); found once per process and build cache directory."""
    return _load(str(find_source_library(SOURCE, LIBRARY, cutlass=False, arch=ARCH, module=__name__)))


# ---- the benchmark -------------------------------------------------------------------------------


def check_args(sizes: Sequence[int], ctas: Sequence[int], iters: int, threads: int, unroll: int,
               pingpong_iters: int) -> None:
    """Raise InputError naming the first bad argument of run_link_bench."""
    if not sizes or any(s <= 0 or s % 16 for s in sizes):
        raise InputError(f"sizes must be positive multiples of 16 bytes, got {list(sizes)}")
    if not ctas or any(c < 1 for c in ctas):
        raise InputError(f"ctas must be positive CTA counts, got {list(ctas)}")
    if iters < 1 or pingpong_iters < 1:
        raise InputError(f"iters and pingpong_iters must be >= 1, got {iters} and {pingpong_iters}")
    if not (32 <= threads <= 1024 and threads % 32 == 0):
        raise InputError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
    if unroll not in (4, 8):
        raise InputError(f"unroll must be 4 or 8, got {unroll}")


def _pattern(src_rank: int, n: int, device):
    """Rank ``src_rank``'s source bytes: (i + 131 * rank) mod 251. The period 251 is prime, so
    two ranks (< 251) differ at every byte and any shift that is not a multiple of 251 bytes
    (16-byte misplacements included) shows."""
    import torch

    period = (torch.arange(251, device=device) + 131 * src_rank) % 251
    return period.to(torch.uint8).repeat((n + 250) // 251)[:n]


def run_link_bench(
    group=None,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    ctas: Sequence[int] = DEFAULT_CTAS,
    iters: int = 20,
    warmup: int = 3,
    threads: int = 512,
    unroll: int = 8,
    pingpong_iters: int = 1000,
    timeout_s: float = 10.0,
) -> list[dict]:
    """Run on every rank of an initialized NCCL process group (``group``, default WORLD) with
    W >= 2 ranks, each on its current CUDA device. Returns the rows on group rank 0 (an empty
    list elsewhere), each ``{mode, ctas, bytes, ms, gbps, rank_ms, one_way_us}``:

    * mode "pull"/"push": ``ms`` is the slowest rank's median over ``iters`` timed runs (the
      all-to-all ends when the slowest rank does; ``rank_ms`` holds every rank's median),
      ``gbps`` = bytes / ms, per GPU and direction; ``one_way_us`` is None.
    * mode "pingpong" (one row; ctas 1, bytes 8): ``ms`` per round trip, ``gbps`` None,
      ``one_way_us`` = total / (2 * pingpong_iters).

    Raises KernelError if a wait times out (after ``timeout_s``) or a copy is wrong."""
    _no_multicast()
    check_args(sizes, ctas, iters, threads, unroll, pingpong_iters)
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world < 2:
        raise InputError(f"the link benchmark needs a group of at least 2 ranks, got {world}")
    lib = load_library()
    device = torch.device("cuda", torch.cuda.current_device())
    region = -(-max(sizes) // 4096) * 4096
    buf = symm_mem.empty(2 * region + _FLAG_BYTES, dtype=torch.uint8, device=device)
    buf[2 * region:].zero_()  # counters start at 0 and only grow
    handle = symm_mem.rendezvous(buf, group=group)
    ptrs = [int(handle.buffer_ptrs[r]) for r in range(world)]
    src, dst = buf[:region], buf[region:2 * region]
    src.copy_(_pattern(rank, region, device))
    flags = ptrs[rank] + 2 * region
    error = torch.zeros(1, dtype=torch.int32, device=device)
    out_ns = torch.zeros(1, dtype=torch.int64, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream
    timeout_ns = int(timeout_s * 1e9)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    targets = {"gate": 0, "push": 0}  # running totals of this rank's counters

    def check(what: str) -> None:
        code = int(error.item())  # synchronizes
        if code:
            raise KernelError(f"link bench, rank {rank} of {world}, {what}: {_ERRORS.get(code, code)} "
                              f"within {timeout_s:g} s")

    def gate() -> None:
        """Start every rank's timed region together: a host barrier alone leaves the GPUs as far
        apart as the processes leave it; a device barrier (a 0-byte copy is a pure signal to
        each rank, then a wait for all W) aligns them to the NVLink latency."""
        for q in range(world):
            lib.copy(0, 0, 0, 1, 32, ptrs[q] + 2 * region + _GATE, unroll, stream)
        targets["gate"] += world
        lib.wait(flags + _GATE, targets["gate"], timeout_ns, error.data_ptr(), stream)

    def transfer(mode: str, size: int, c: int) -> None:
        if mode == "pull":  # the counter is local; nobody waits on it, but both modes signal alike
            lib.copy(dst.data_ptr(), ptrs[nxt], size, c, threads, flags + _PULL, unroll, stream)
        else:
            lib.copy(ptrs[nxt] + region, src.data_ptr(), size, c, threads, ptrs[nxt] + 2 * region + _PUSH,
                     unroll, stream)
            targets["push"] += c  # the previous rank pushes the same configuration into us
            lib.wait(flags + _PUSH, targets["push"], timeout_ns, error.data_ptr(), stream)

    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    rows: list[dict] = []
    for mode in ("pull", "push"):
        sender = nxt if mode == "pull" else prv  # whose pattern lands in our destination
        for size in sizes:
            expected = _pattern(sender, size, device)
            guard = min(_GUARD, region - size)
            for c in ctas:
                # poison first; no peer writes into it before the barrier of the first run
                dst[: size + guard].fill_(_POISON)
                events = []
                for _ in range(warmup + iters):
                    # runs never overlap: the previous one has finished on every GPU before any
                    # rank signals the next gate (the counters' running targets rely on it)
                    torch.cuda.synchronize(device)
                    dist.barrier(group=group)
                    gate()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    transfer(mode, size, c)
                    end.record()
                    events.append((start, end))
                torch.cuda.synchronize(device)
                check(f"{mode} of {size} bytes with {c} CTAs")
                if not torch.equal(dst[:size], expected):
                    bad = int((dst[:size] != expected).sum())
                    raise KernelError(f"link bench, rank {rank}: {mode} of {size} bytes with {c} CTAs: "
                                      f"{bad} bytes differ from rank {sender}'s pattern")
                if guard and not bool((dst[size: size + guard] == _POISON).all()):
                    raise KernelError(f"link bench, rank {rank}: {mode} of {size} bytes with {c} CTAs wrote "
                                      "past the end")
                median = statistics.median(s.elapsed_time(e) for s, e in events[warmup:])
                every = torch.empty(world, dtype=torch.float64, device=device)
                dist.all_gather_into_tensor(every, torch.tensor([median], dtype=torch.float64, device=device),
                                            group=group)
                rank_ms = every.tolist()
                ms = max(rank_ms)
                rows.append({"mode": mode, "ctas": c, "bytes": size, "ms": ms, "gbps": size / (ms * 1e-3) / 1e9,
                             "rank_ms": rank_ms, "one_way_us": None})
    rows.append(_pingpong(lib, rank, ptrs, 2 * region + _PING, pingpong_iters, timeout_ns, error, out_ns,
                          stream, group, check))
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # no rank frees its buffer while a peer may still touch it
    return rows if rank == 0 else []


def _pingpong(lib: _Lib, rank: int, ptrs: list[int], offset: int, iters: int, timeout_ns: int, error, out_ns,
              stream: int, group, check) -> dict:
    """Ranks 0 and 1 bounce the flag at ``offset`` of their buffers: a warm-up call, then the
    timed one (flag values keep growing from call to call)."""
    import torch
    import torch.distributed as dist

    dist.barrier(group=group)
    if rank < 2:
        base = 0
        for _ in range(2):
            lib.pingpong(ptrs[rank] + offset, ptrs[1 - rank] + offset, iters, rank == 0, base, timeout_ns,
                         out_ns.data_ptr() if rank == 0 else 0, error.data_ptr(), stream)
            base += 2 * (iters + 1)
        torch.cuda.current_stream().synchronize()
        check(f"ping-pong of rank {rank} with rank {1 - rank}")
    total_ns = int(out_ns.item())
    return {"mode": "pingpong", "ctas": 1, "bytes": 8, "ms": total_ns / iters / 1e6, "gbps": None,
            "rank_ms": None, "one_way_us": total_ns / (2 * iters) / 1e3}


# ---- reporting -----------------------------------------------------------------------------------


def best_rows(rows: Sequence[dict]) -> dict[tuple[str, int], dict]:
    """The fastest copy row per (mode, bytes); ties go to fewer CTAs (fewer SMs taken from compute)."""
    best: dict[tuple[str, int], dict] = {}
    for row in rows:
        if row["gbps"] is None:
            continue
        key = (row["mode"], row["bytes"])
        if key not in best or (row["gbps"], -row["ctas"]) > (best[key]["gbps"], -best[key]["ctas"]):
            best[key] = row
    return best


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def format_table(rows: Sequence[dict]) -> str:
    """Plain-text table: one line per copy row (the best CTA count of each mode and size marked
    with *), the share of the line rate, then the ping-pong latency."""
    best = {id(r) for r in best_rows(rows).values()}
    lines = [f"{'mode':<6} {'size':>9} {'ctas':>5} {'ms':>9} {'GB/s':>8} {'% line':>7}"]
    for r in rows:
        if r["gbps"] is None:
            continue
        mark = " *" if id(r) in best else ""
        lines.append(f"{r['mode']:<6} {_size(r['bytes']):>9} {r['ctas']:>5} {r['ms']:>9.4f} {r['gbps']:>8.1f} "
                     f"{100 * r['gbps'] / LINE_RATE_GBPS:>6.1f}%{mark}")
    for r in rows:
        if r["mode"] == "pingpong":
            lines.append(f"signal latency rank 0 <-> 1: {r['one_way_us']:.2f} us one way "
                         f"({1e3 * r['ms']:.2f} us round trip)")
    lines.append(f"GB/s per GPU per direction, slowest rank's median; line rate {LINE_RATE_GBPS:g} GB/s; "
                 "* best CTA count")
    return "\n".join(lines)


def write_json(rows: Sequence[dict], directory: str | os.PathLike, metadata: dict | None = None) -> Path:
    """``directory/link.json``: {"_metadata": ..., "rows": [...]}, written atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "link.json"
    tmp = directory / f".link.json.{os.getpid()}"
    doc = {"_metadata": {"mokgen": __version__, "line_rate_gbps": LINE_RATE_GBPS, **(metadata or {})},
           "rows": list(rows)}
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def _metadata(world: int) -> dict:
    import torch

    return {"gpu": torch.cuda.get_device_name(), "world": world, "torch": torch.__version__,
            "cuda": torch.version.cuda, "nvcc": source_toolchain(False).nvcc_version}


# ---- torchrun entry ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mokgen.linkbench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-out", help="directory for link.json (default: bench-out)")
    parser.add_argument("--sizes", type=int, nargs="+", help="bytes per copy (default: 1, 16, 64, 256 MiB)")
    parser.add_argument("--ctas", type=int, nargs="+", default=list(DEFAULT_CTAS))
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        print("error: run one process per GPU: torchrun --nproc-per-node N -m mokgen.linkbench --out DIR",
              file=sys.stderr)
        return 2
    _no_multicast()  # before NCCL and symmetric memory start
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        rows = run_link_bench(sizes=tuple(args.sizes or DEFAULT_SIZES), ctas=tuple(args.ctas), iters=args.iters)
        if dist.get_rank() == 0:
            print(format_table(rows))
            print(f"wrote {write_json(rows, args.out, _metadata(dist.get_world_size()))}")
    except MokgenError as err:
        print(f"error: rank {dist.get_rank()}: {err}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
