"""Where the forward megakernel's time goes, from inside the kernel (runs on an H200, not in CI).

Builds a trace build of the forward (-DMOKGEN_FWD_TRACE: templates/include/mokgen/fwd_trace.cuh
says what each CTA records; a separate build-cache entry, since the flags are part of the key) of
`mokgen bench SPEC` workload (a) or (b), on the bench's inputs and with the layer arguments the
bench uses (the tuned entry where one matches; FWD_TRACE_TUNED=0 for the plan's defaults). Times
the trace build's launch (median of 20; the stamps cost a little), then traces one launch and
prints:
  timing    the trace build's launch, and the untraced build's in a subprocess before and after
            (the same inputs and layer arguments; what the stamps cost, within the clock's drift)
  phases    the launch's start, the compute roles' start and end, the combine, from the stamps
  chunks    when each ring chunk landed (the dispatch CTAs' last part) and how long it took
  tiles     per kind (up, down): tiles, and medians over every compute CTA's tiles of the
            consumer warpgroups' k-loop, their waits for full stages within it, the epilogue,
            the signal handshake, the gap to the warpgroup's next tile, and the producer's
            dependency wait (chunk landed; a down tile: its row block's up tiles) and its waits
            for empty stages; in SM cycles, beside the tensor core's time for the tile at the
            dense rate (1024 cycles per 128 x 256 x 64 k-block, both warpgroups')
            and per kind, the tiles of at most 64 rows (an expert segment's partial last block),
            of 65-128 rows and of a tall block (more than 128 rows, plan tall_tail): their k-loops
            and full-stage waits
  budget    the compute CTAs' time summed over CTAs, split into: before the first tile, k-loops,
            epilogues, between tiles (handshake, walk, producer dependency waits), after the last
            tile (to the compute roles' end), and the combine
  pipeline  per chunk: when it landed, when the producers started its up tiles and how long those
            waited for it, when its down tiles ended; then the compute CTAs' waits for chunks to
            land against their other dependency waits
  blocks    where the records carry each tile's row (newer trace builds): the down tiles'
            dependency waits, the part of them before their row block's last up tile ended, and
            the spread of a block's up tiles' ends
FWD_TRACE_TILES (default 160): tiles traced per CTA; a CTA with more is reported as truncated.
FWD_TRACE_NUMERICS=mxfp8: the spec's MXFP8 megakernel instead (mx_tile.cuh records the same waits and
k-loop ends, v0.55; its tuned entry is the MXFP8 file where one matches).
FWD_TRACE_OUT=DIR saves the raw records there (fwd-trace.pt: int64 [CTAs, tiles + 1, 3, 8]).
The trace build keeps the dispatch CTAs out of the compute (plan dispatch_join is off there:
their records hold their chunks), so its compute span is a little longer than the plain build's.
Usage: python3 .ci/fwd_trace.py SPEC [local|layer] [TOKENS]  (kimi-k2.5 local)"""

import ctypes
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from mokgen import bench, build
from mokgen.spec import load_spec

# FWD_TRACE_PLAIN=1 (this script's own subprocess): time the untraced build only
PLAIN = os.environ.get("FWD_TRACE_PLAIN") == "1"
if not PLAIN:
    build.BASE_FLAGS = [*build.BASE_FLAGS, "-DMOKGEN_FWD_TRACE"]  # the trace build: its own cache entry
# FWD_TRACE_FLAGS: more nvcc flags for both builds (a measuring macro, e.g. -DMOKGEN_PLAN_SCAN)
build.BASE_FLAGS = [*build.BASE_FLAGS, *os.environ.get("FWD_TRACE_FLAGS", "").split()]

from mokgen.ep import MoELayer  # noqa: E402

TILES = int(os.environ.get("FWD_TRACE_TILES", "160"))
name = sys.argv[1] if len(sys.argv) > 1 else "kimi-k2.5"
workload = sys.argv[2] if len(sys.argv) > 2 else "local"
real = load_spec(name)
NUMERICS = os.environ.get("FWD_TRACE_NUMERICS")
if NUMERICS:
    real = real.with_target(numerics=NUMERICS)
TUNED = os.environ.get("FWD_TRACE_TUNED", "1") == "1"
# the layer's arguments: the stand-in of (a) takes the real spec's tuned entry (as the bench does);
# the real spec of (b) looks its own up (tuned=True), as the bench's layer does
kwargs = {"tuned": False}
if workload == "local":
    ep = bench.LOCAL_EP.get(real.name, 8)
    spec, tokens = bench.local_spec(real, ep)  # in real's numerics
    if TUNED:
        kwargs = bench.local_layer_kwargs(real, ep) or kwargs
else:
    spec, tokens = real, int(sys.argv[3]) if len(sys.argv) > 3 else 16384
    kwargs = {"tuned": TUNED}
wg, wu, wd = bench._weights(spec)
gen = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(tokens, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
ids, w = bench._routing(spec, tokens, gen)
layer = MoELayer(spec, max_tokens=tokens, device="cuda", **kwargs)
with torch.no_grad():
    layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
layer.check_ids = False
if PLAIN:
    with torch.no_grad():
        print(f"{statistics.median(bench.time_cuda(lambda i: layer(x, ids, w), n_inputs=1, iters=20)):.3f}")
    sys.exit(0)


def untraced_ms() -> str:
    proc = subprocess.run([sys.executable, __file__, *sys.argv[1:]], env={**os.environ, "FWD_TRACE_PLAIN": "1"},
                          capture_output=True, text=True)
    lines = proc.stdout.split()
    return f"{lines[-1]} ms" if proc.returncode == 0 and lines else f"failed ({proc.stderr.strip().splitlines()[-1:]})"


plain_before = untraced_ms()
lib = layer._kernel.LIB  # the library this layer runs (its build options, tuned or not)
if not hasattr(lib, "mokgen_fwd_set_trace"):
    sys.exit("the loaded forward is not a trace build (a prebuilt package of this spec took its place?)")
lib.mokgen_fwd_set_trace.argtypes = [ctypes.c_void_p, ctypes.c_int]
grid = torch.cuda.get_device_properties(0).multi_processor_count
buf = torch.zeros(grid, TILES + 1, 3, 8, dtype=torch.int64, device="cuda")

with torch.no_grad():
    assert lib.mokgen_fwd_set_trace(None, 0) == 0
    ms = statistics.median(bench.time_cuda(lambda i: layer(x, ids, w), n_inputs=1, iters=20))
    assert lib.mokgen_fwd_set_trace(buf.data_ptr(), TILES) == 0
    layer(x, ids, w)
    torch.cuda.synchronize()
    assert lib.mokgen_fwd_set_trace(None, 0) == 0
raw = buf.cpu()
plain_after = untraced_ms()
if os.environ.get("FWD_TRACE_OUT"):
    torch.save(raw, Path(os.environ["FWD_TRACE_OUT"]) / "fwd-trace.pt")
st = layer.stats()
if layer.tuned_entry is not None:
    config = f"tuned {layer.tuned_entry.path.name} (build options {layer.build_options})"
elif "build_options" in kwargs:
    config = f"tuned {kwargs}"
else:
    config = "plan defaults"
print(f"== {spec.name} {workload} {tokens} rows")
print(f"timing   trace build {ms:.3f} ms per launch (median of 20); untraced build {plain_before} before, "
      f"{plain_after} after; {config}")
full = int((raw[:, TILES - 1, 1, 1] != 0).sum())
if full:
    print(f"WARNING: {full} CTAs filled all {TILES} traced tiles (more are not recorded): raise FWD_TRACE_TILES")

ph = raw[:, TILES, 0]  # per CTA: start, compute start, compute end, combine start, end, dispatch?, -
used = ph[:, 0] > 0
ctas = int(used.sum())
disp = used & (ph[:, 5] == 1)
comp = used & (ph[:, 5] != 1)
t0 = int(ph[used, 0].min())


def us(v):
    return (float(v) - t0) / 1e3


print(f"phases   {ctas} CTAs ({int(disp.sum())} dispatch); us after the first CTA's start:")
print(f"  compute roles start  median {us(ph[comp, 1].median()):8.1f}  max {us(ph[comp, 1].max()):8.1f}")
print(f"  compute roles end    min {us(ph[comp, 2].min()):8.1f}  median {us(ph[comp, 2].median()):8.1f}  "
      f"max {us(ph[comp, 2].max()):8.1f}")
print(f"  combine start        median {us(ph[used, 3].median()):8.1f}  max {us(ph[used, 3].max()):8.1f}")
print(f"  combine end          median {us(ph[used, 4].median()):8.1f}  max {us(ph[used, 4].max()):8.1f}")
pr = raw[:, TILES, 2]  # the prologue's stamps (role 2 of the phase record), where the build records them
if int(pr[used, 3].max()) > 0:
    print("prologue (us after the first CTA's start; median / max over CTAs; CTA 0's plan scan ends at 'plan'):")
    for i, label in ((4, "routing counted"), (0, "barrier 1 passed"), (5, "routing assigned"), (1, "barrier 2 passed"),
                     (2, "plan (before barrier 3)"), (3, "barrier 3 passed")):
        print(f"  {label:24s} median {us(pr[used, i].median()):8.1f}  max {us(pr[used, i].max()):8.1f}  "
              f"CTA 0 {us(pr[0, i]):8.1f}")

d = raw[disp, :TILES, 0]
if d.shape[0]:
    print("chunks   per chunk (dispatch CTAs): start, slot free, landed (last part), us")
    for c in range(TILES):
        if int(d[:, c, 2].max()) == 0:
            break
        print(f"  chunk {c}: start {us(d[:, c, 0].min()):8.1f}  free {us(d[:, c, 1].max()):8.1f}  "
              f"landed {us(d[:, c, 2].max()):8.1f}")

# SM clock rate: cycles per ns from the producers' first and last traced tiles
prod = raw[comp, :TILES, 0]
rates = []
for r in prod:
    n = int((r[:, 1] != 0).sum())
    if n >= 2 and r[n - 1, 0] > r[0, 0]:
        rates.append(float(r[n - 1, 1] - r[0, 1]) / float(r[n - 1, 0] - r[0, 0]))
ghz = statistics.median(rates) if rates else 1.0
print(f"clock    {ghz:.3f} GHz (SM cycles per ns of globaltimer, median over CTAs)")

K_ = {"up": spec.hidden_size // 64, "down": spec.moe_intermediate_size // 64}
stats = {k: {f: [] for f in ("kloop", "fullw", "epi", "sig", "gap", "dep", "empty")} for k in ("up", "down")}
budget = {k: 0.0 for k in ("before", "kloop", "epilogue", "between", "after")}
by_rows = {}  # (kind, at most 64 rows) -> ([k-loop], [full waits]): a partial block's tiles against full ones
for ci in torch.nonzero(comp).flatten().tolist():
    cons = raw[ci, :TILES]
    n_t = int((cons[:, 1, 1] != 0).sum())
    if n_t == 0:
        continue
    for role in (1, 2):
        r = cons[:, role]
        budget["before"] += float(r[0, 0] - ph[ci, 1]) * ghz / 2
        for i in range(n_t):
            kind = "up" if int(r[i, 6]) in (0, 2) else "down"
            s = stats[kind]
            kl, epi = float(r[i, 2] - r[i, 1]), float(r[i, 3] - r[i, 2])
            s["kloop"].append(kl)
            s["fullw"].append(float(r[i, 4]))
            rows_i = int(r[i, 7])  # the row bucket: <= 64, 65-128, a tall block's (> 128)
            part = by_rows.setdefault((kind, 0 if rows_i <= 64 else 1 if rows_i <= 128 else 2), ([], []))
            part[0].append(kl)
            part[1].append(float(r[i, 4]))
            s["epi"].append(epi)
            s["sig"].append(float(r[i, 5] - r[i, 3]))
            budget["kloop"] += kl / 2
            budget["epilogue"] += epi / 2
            if i + 1 < n_t:
                gap = float(r[i + 1, 1] - r[i, 5])
                s["gap"].append(gap)
                budget["between"] += (gap + float(r[i, 5] - r[i, 3])) / 2
        last_end = r[n_t - 1, 0] + int(float(r[n_t - 1, 5] - r[n_t - 1, 1]) / ghz)
        budget["after"] += float(ph[ci, 2] - last_end) * ghz / 2
    p = cons[:, 0]
    for i in range(int((p[:, 1] != 0).sum())):
        kind = "up" if int(p[i, 4]) in (0, 2) else "down"
        stats[kind]["dep"].append(float(p[i, 2] - p[i, 1]))
        stats[kind]["empty"].append(float(p[i, 7]))


def med(v):
    return statistics.median(v) if v else float("nan")


print(f"tiles    medians over the compute CTAs' traced tiles (first {TILES} per CTA), SM cycles")
print(f"  {'kind':5s} {'tiles':>6s} {'dense':>7s} {'k-loop':>7s} {'full wt':>7s} {'epilog':>7s} {'signal':>7s} "
      f"{'gap':>7s} {'dep wt':>7s} {'sum dep':>9s} {'empty wt':>8s}")
for kind, s in stats.items():
    n = len(s["kloop"]) // 2
    dense = K_[kind] * 1024
    print(f"  {kind:5s} {n:6d} {dense:7d} {med(s['kloop']):7.0f} {med(s['fullw']):7.0f} {med(s['epi']):7.0f} "
          f"{med(s['sig']):7.0f} {med(s['gap']):7.0f} {med(s['dep']):7.0f} {sum(s['dep']):9.0f} {med(s['empty']):8.0f}")
print("  by rows (k-loop / full wt medians): " + "; ".join(
    f"{kind} {('<= 64', '65-128', 'tall, > 128')[b]} rows: {len(v[0]) // 2} tiles, {med(v[0]):.0f} / {med(v[1]):.0f}"
    for (kind, b), v in sorted(by_rows.items(), key=lambda kv: (kv[0][0] != "up", kv[0][1]))))
total = sum(budget.values())
comb = float((ph[comp, 4] - ph[comp, 3]).sum()) * ghz
print("budget   compute CTAs' cycles (per CTA, the two warpgroups averaged), share of the compute roles' span:")
for k, v in budget.items():
    print(f"  {k:9s} {v / max(total, 1) * 100:6.1f}%   ({v / ghz / 1e3 / max(int(comp.sum()), 1):8.1f} us per CTA)")
print(f"  combine   {comb / ghz / 1e3 / max(int(comp.sum()), 1):8.1f} us per CTA after the compute roles")
sig = raw[:, TILES, 1]  # the signallers' sums (phase record, role 1), where the build records them
if comp.any() and bool((sig[comp, 3] > 0).any()):
    n_sig = max(int(comp.sum()), 1)
    tiles_sig = float(sig[comp, 3].sum())
    print(f"signaller per compute CTA: {float(sig[comp, 0].sum()) / ghz / 1e3 / n_sig:.1f} us waiting for the "
          f"consumers' handshakes, {float(sig[comp, 1].sum()) / ghz / 1e3 / n_sig:.1f} us publishing "
          f"({float(sig[comp, 1].sum()) / max(tiles_sig, 1):.0f} cycles per tile, the most "
          f"{float(sig[comp, 2].max()):.0f})")


def routed_tiles() -> list[tuple]:
    """The compute CTAs' routed tiles: (kind, chunk, row or None, the producer's start ns, its
    dependency wait ns, the consumers' end ns, the last after their handshake). A consumer
    record's tile is the producer record's at the same queue position; the row is there where
    the records carry it (phase field 6)."""
    out = []
    for ci in torch.nonzero(comp).flatten().tolist():
        p, cons = raw[ci, :TILES, 0], raw[ci, :TILES, 1]
        carry = int(ph[ci, 6]) == 1
        for i in range(int((p[:, 1] != 0).sum())):
            kind = int(p[i, 4])
            if kind not in (0, 1) or cons[i, 1] == 0:
                continue
            out.append((kind, int(p[i, 5]), int(p[i, 6]) >> 32 if carry else None, float(p[i, 0]),
                        float(p[i, 2] - p[i, 1]) / ghz, float(cons[i, 0]) + float(cons[i, 5] - cons[i, 1]) / ghz))
    return out


def pipeline(tiles: list[tuple]) -> None:
    """Per chunk: when it landed, when the producers started its up tiles and how long those waited
    for it, and when its down tiles ended; then the compute CTAs' waits for chunks against their
    other waits."""
    if not d.shape[0]:
        return
    by_chunk: dict[tuple[int, int], list[tuple]] = {}
    for t in tiles:
        by_chunk.setdefault((t[1], t[0]), []).append(t)
    n_comp = max(int(comp.sum()), 1)
    print("pipeline per chunk, us: landed; its up tiles' producer starts (first, last) and waits for it "
          "(summed over CTAs); its down tiles' last end")
    chunk_wait = other_wait = 0.0
    for c in range(TILES):
        landed = float(d[:, c, 2].max())
        if landed == 0:
            break
        ups, downs = by_chunk.get((c, 0), []), by_chunk.get((c, 1), [])
        if not ups:
            continue
        # an up tile's wait for its chunk: the part of its dependency wait before the chunk landed
        waited = sum(min(t[4], max(0.0, landed - t[3])) for t in ups)
        chunk_wait += waited
        other_wait += sum(t[4] for t in ups) - waited + sum(t[4] for t in downs)
        last_down = max((t[5] for t in downs), default=float("nan"))
        print(f"  chunk {c}: landed {us(landed):8.1f}  up starts {us(min(t[3] for t in ups)):8.1f} "
              f"{us(max(t[3] for t in ups)):8.1f}  waited {waited / 1e3:8.1f}  down end {us(last_down):8.1f}")
    print(f"  per compute CTA: {chunk_wait / 1e3 / n_comp:.1f} us waiting for chunks to land, "
          f"{other_wait / 1e3 / n_comp:.1f} us in the producers' other dependency waits (row blocks, fences)")


def row_blocks(tiles: list[tuple]) -> None:
    """Down tiles against their row blocks' up tiles (where the records carry the row): when the
    last up tile of the block ended and the part of the down tile's dependency wait before that;
    the spread of a block's up tiles' ends."""
    n = int((comp & (ph[:, 6] == 1)).sum())
    if n == 0:
        return
    ends: dict[tuple[int, int], list[float]] = {}
    for kind, c, m, _, _, end in tiles:
        if kind == 0 and m is not None:
            ends.setdefault((c, m), []).append(end)
    waited = total = 0.0
    for kind, c, m, start, wait, _ in tiles:
        if kind == 1 and m is not None:
            total += wait
            if (c, m) in ends:
                waited += min(wait, max(0.0, max(ends[(c, m)]) - start))
    spread = [max(v) - min(v) for v in ends.values() if len(v) > 1]
    print(f"blocks   down tiles: {total / 1e3 / n:.1f} us of dependency waits per compute CTA, "
          f"{waited / 1e3 / n:.1f} us of it before their row block's last up tile ended; a block's up "
          f"tiles ended over {statistics.median(spread) / 1e3 if spread else float('nan'):.1f} us (median)")


routed = routed_tiles()
pipeline(routed)
row_blocks(routed)
if st:
    print(f"stats    {st}")
