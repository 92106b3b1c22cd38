"""Where a weight-gradient tile's time goes, from inside the kernel (runs on an H200, not in CI).

Compiles a trace build of templates/bwd_gemm.cu (-DMOKGEN_BWD_TRACE: each CTA writes SM clock
stamps for its first TILES tiles and each role, see the trace macros there) into a temporary
directory, and runs the weight-gradient GEMMs on the rows of `mokgen bench SPEC --workload local
--backward`: the split tiles at every stagger lead, then the ping-pong ("pp") at every
hand-over (the lead: how many k-blocks before its last a warpgroup hands the turn over; the
kernel keeps at most six). Prints, per
GEMM and run, medians over every CTA's tiles (its first tile left out): the period of a
consumer warpgroup's tiles, its k-loop, the part of the k-loop spent waiting for full stages,
its epilogue, and the producer's waits for empty stages, and how far warpgroup 1's tile starts
lag warpgroup 0's; all in SM clock cycles, next to the tensor-core time of 128 x 256 outputs
at the dense rate (128 cycles per m64n256k16 wgmma, both warpgroups' steps). A split tile is
128 x 256 and a warpgroup's period one tile; a ping-pong tile is 128 x 128, a warpgroup's own
tiles every other one, so its period spans two (the same outputs), and its k-loop starts
after its turn. The trace build's kernel time is printed too: the stamps cost a little.
The epilogue (bwd_gemm.cuh, store_tile_tma) is cut at its stamps ("rounds": cycles from the
k-loop's end to the end of its first box, then of each next box).
BWD_TRACE_FLAGS: more nvcc flags for the trace build (a variant's macros; the measuring ones:
-DMOKGEN_BWD_NO_LOAD, -DMOKGEN_BWD_NO_EPILOGUE, -DMOKGEN_BWD_FULL_K, all with wrong results);
BWD_TRACE_DIR: build it there, or use the library already built there; BWD_TRACE_RUNS=1,pp0:
those runs only (split lead 1, ping-pong lead 0); BWD_TRACE_GEMMS=dWg: that GEMM only. With BWD_TRACE_OUT=DIR the raw stamps
are saved there (trace-<gemm>-<schedule>-lead<l>.pt: int64 [CTAs, tiles, role, 8]). Usage:
python3 .ci/bwd_trace.py [SPEC [TILES]] (kimi-k2.5, 48)."""

import ctypes
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from mokgen import bench, bwd_gemm

TILES = int(sys.argv[2]) if len(sys.argv) > 2 else 48
spec, gen, counts, offs, rows = bench.local_expert_rows(sys.argv[1] if len(sys.argv) > 1 else "kimi-k2.5")
E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size


def randn(*shape):
    return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)


x, go, dg, hw = randn(rows, H), randn(rows, H), randn(rows, I), randn(rows, I)

extra = os.environ.get("BWD_TRACE_FLAGS", "").split()
build_dir = os.environ.get("BWD_TRACE_DIR") or tempfile.mkdtemp(prefix="bwd-trace-")
built = sorted(Path(build_dir).glob("*.so"))
traced = built[0] if built else bwd_gemm.build_variant(["-DMOKGEN_BWD_TRACE", *extra], build_dir)
if bwd_gemm.trace_serialized(traced.parent):  # of the kernels timed here
    print("WARNING: the trace build's wgmma are serialized; its times are not the library's")
lib = bwd_gemm._Lib(traced)
raw = lib._lib  # the trace build's one extra entry point
raw.mokgen_bwd_set_trace.argtypes, raw.mokgen_bwd_set_trace.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
bwd_gemm.load_library = lambda: lib  # noqa: E731 (this process only)
grid = torch.cuda.get_device_properties(0).multi_processor_count
buf = torch.zeros(grid * TILES * 3 * 8, dtype=torch.int64, device="cuda")

cases = {"dWg = dg^T x": (dg, x), "dWd = dOut^T hw": (go, hw)}
save_dir = os.environ.get("BWD_TRACE_OUT")
print(f"== {spec.name} local: {rows} rows, E = {E}, H = {H}, I = {I}; trace of the first {TILES} tiles of "
      f"each of {grid} CTAs (cycles){'; flags ' + ' '.join(extra) if extra else ''}")
print(f"{'GEMM':18s} {'lead':>4s} {'ms':>7s} {'period':>7s} {'k-loop':>7s} {'full wt':>7s} {'epilog':>7s} "
      f"{'wg gap':>7s} {'prod wt':>7s} {'lag':>7s} {'mma':>6s} {'steps':>5s}  rounds")
# the split tiles at every stagger lead, then the ping-pong at every lead (for it: how many
# k-blocks before its last one a warpgroup hands the turn over)
runs = [(sch, lead) for sch in ("split", "pingpong") for lead in range(bwd_gemm.MAX_LEAD + 1)]
only = os.environ.get("BWD_TRACE_RUNS", "").split(",")  # e.g. "1,pp0": those runs only
runs = [(sch, lead) for sch, lead in runs if only == [""] or ("pp" if sch == "pingpong" else "") + str(lead) in only]
gemms = os.environ.get("BWD_TRACE_GEMMS", "").split(",")  # e.g. "dWg": those GEMMs only
cases = {k: v for k, v in cases.items() if gemms == [""] or k.split()[0] in gemms}
for name, (a, b) in cases.items():
    for sch, lead in runs:
        lib.set_stagger(lead)
        assert raw.mokgen_bwd_set_trace(None, 0) == 0
        ms = statistics.median(bench.time_cuda(lambda i: bwd_gemm.weight_grads(a, b, offs, schedule=sch), n_inputs=1,
                                               iters=10))
        buf.zero_()
        assert raw.mokgen_bwd_set_trace(ctypes.c_void_p(buf.data_ptr()), TILES) == 0
        bwd_gemm.weight_grads(a, b, offs, schedule=sch)
        torch.cuda.synchronize()
        assert raw.mokgen_bwd_set_trace(None, 0) == 0
        raw_t = buf.view(grid, TILES, 3, 8).cpu()
        if save_dir:
            torch.save(raw_t, Path(save_dir) / f"trace-{name.split()[0]}-{sch}-lead{lead}.pt")
        t = raw_t.double()
        stats = {k: [] for k in ("period", "kloop", "fullw", "epi", "gap", "prodw", "lag", "r0", "r1", "r2", "r3")}
        for c in range(grid):
            for role in (1, 2):
                for i in range(1, TILES - 1):
                    cur, nxt = t[c, i, role], t[c, i + 1, role]
                    if cur[0] == 0 or nxt[0] == 0:
                        break
                    stats["period"].append(float(nxt[0] - cur[0]))
                    stats["kloop"].append(float(cur[1] - cur[0]))
                    stats["fullw"].append(float(cur[3]))
                    stats["epi"].append(float(cur[2] - cur[1]))
                    stats["gap"].append(float(nxt[0] - cur[2]))
                    prev = cur[1]
                    for k in range(4):
                        if cur[4 + k] != 0:
                            stats[f"r{k}"].append(float(cur[4 + k] - prev))
                            prev = cur[4 + k]
            for i in range(1, TILES):
                if t[c, i, 0, 0] == 0:
                    break
                stats["prodw"].append(float(t[c, i, 0, 3]))
                if t[c, i, 1, 0] and t[c, i, 2, 0]:
                    stats["lag"].append(float(t[c, i, 2, 0] - t[c, i, 1, 0]))
        med = {k: statistics.median(v) if v else float("nan") for k, v in stats.items()}
        k_steps = (rows // E + 15) // 16  # a mean expert's 16-row wgmma steps
        mma = 2 * k_steps * 128
        print(f"{name:18s} {('pp' if sch == 'pingpong' else '') + str(lead):>4} {ms:7.3f} {med['period']:7.0f} {med['kloop']:7.0f} {med['fullw']:7.0f} "
              f"{med['epi']:7.0f} {med['gap']:7.0f} {med['prodw']:7.0f} {med['lag']:7.0f} {mma:6d} {k_steps:5d}  "
              + " ".join(f"{med[f'r{k}']:.0f}" for k in range(4) if stats[f"r{k}"]))
lib.set_stagger(bwd_gemm.MAX_LEAD)
