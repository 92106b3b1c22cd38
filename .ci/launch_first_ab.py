"""v0.54's host path before the forward's launch against v0.53's, in one process (H100 or H200,
not CI).

Under autograd, MoELayer's eager call used to go through the binding's EP_EAGER: an
autograd.Function whose apply (the node, the saved tensors) ran before the launch, host time an
idle GPU waits for at the start of each fwd+bwd step. mokgen.ep._call_op now launches first
(the binding's _ep_forward) and records after (_LaunchedEp), and its non-blocking error poll
reads the pinned record's code where v0.53's queried the copy's event (EpBuffers.poll). This
script times the bench's own fwd+bwd step (`mokgen bench SPEC --backward`'s mokgen row: save
policy, mokgen's backward GEMMs, each step after a synchronize, CUDA events around it) both ways
in interleaved ABBA blocks:
  A  v0.53's path (mokgen.ep._launch_then_record stubbed to None, so _call_op takes EP_EAGER;
     with --poll, also v0.53's EpBuffers.poll, copied below)
  B  this tree's
and prints B / A (median of the blocks' ratios, bootstrap 95% interval), each side's median step,
the host time from the step's start to the launch entry (median over the timed steps), and
whether the two sides' five gradients and outputs have the same bits.
Usage: python3 .ci/launch_first_ab.py [SPEC] [local|layer] [BLOCKS] [--poll] (default: the
qwen3.5-35b-a3b layer at T = 16384, 30 blocks)."""
import statistics
import sys
import time

import torch

from mokgen import bench, bwd_gemm
from mokgen import ep as ep_mod
from mokgen.spec import load_spec
from timed_lib import TimedLib  # .ci/timed_lib.py, beside this script

old_poll_too = "--poll" in sys.argv
argv = [a for a in sys.argv if a != "--poll"]
name = argv[1] if len(argv) > 1 else "qwen3.5-35b-a3b"
workload = argv[2] if len(argv) > 2 else "layer"
blocks = int(argv[3]) if len(argv) > 3 else 30
real = load_spec(name)
spec, tokens = bench.backward_workload(name, workload)
kwargs = bench.local_layer_kwargs(real, bench.LOCAL_EP.get(real.name, 8)) if workload == "local" else None
layer, _, inputs = bench.backward_problem(spec, tokens, 2, kwargs)
layer.bwd_policy = "save"
params = tuple(layer.parameters())  # as the bench holds them (v0.54)
mod = layer._kernel
marks = {}
mod.LIB = TimedLib(mod.LIB, marks)
new_path = ep_mod._launch_then_record
new_poll = ep_mod.EpBuffers.poll
delays = {0: [], 1: []}


def v053_poll(self, *, block: bool):
    """EpBuffers.poll as v0.53 had it (for side A only)."""
    from mokgen import abi

    if self._pending is None:
        return None
    pinned, event = self._pending
    if not block and not event.query():
        return None
    event.synchronize()
    self._pending = None
    return abi.parse_error(pinned.numpy().tobytes())


def set_side(side: int) -> None:
    ep_mod._launch_then_record = new_path if side == 1 else (lambda kernel, args: None)
    ep_mod.EpBuffers.poll = v053_poll if side == 0 and old_poll_too else new_poll


def step(i: int):
    x, ids, w, g = inputs[i % 2]
    t0 = time.perf_counter()
    for t in (x, w, *params):
        t.grad = None
    with bwd_gemm.forced(True):
        out = layer(x, ids, w)
        out.backward(g)
    return t0, out


def launch(side: int, i: int) -> float:
    set_side(side)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    t0, _ = step(i)
    end.record()
    end.synchronize()
    delays[side].append(1e3 * (marks["launch"] - t0))
    return start.elapsed_time(end)


print(f"== {spec.name} {workload} ({tokens} rows), {torch.cuda.get_device_name()}, torch {torch.__version__}, "
      f"tuned entry: {layer.tuned_entry is not None}, {blocks} ABBA blocks; A with v0.53's poll: {old_poll_too}")
pairs = bench.abba_blocks(launch, blocks)
for s in (0, 1):
    delays[s] = delays[s][6 // 2:]  # without the warm-up's launches (3 a side)
ratio, lo, hi = bench.block_ratio(pairs)
a_ms = statistics.median(a / 2 for a, _ in pairs)
b_ms = statistics.median(b / 2 for _, b in pairs)
print(f"A record-then-launch: {a_ms:.3f} ms a step; start -> launch entry {statistics.median(delays[0]):.3f} ms")
print(f"B launch-then-record: {b_ms:.3f} ms a step; start -> launch entry {statistics.median(delays[1]):.3f} ms")
print(f"B / A = {ratio:.4f} [{lo:.4f}, {hi:.4f}], B faster in {sum(b < a for a, b in pairs)}/{len(pairs)} blocks")


def grads(side: int):
    set_side(side)
    _, out = step(0)
    x, _, w, _ = inputs[0]
    return [out.detach().clone(), x.grad.clone(), w.grad.clone(), *(p.grad.clone() for p in params)]


ga, gb = grads(0), grads(1)
same = all(torch.equal(a, b) for a, b in zip(ga, gb))
print(f"bits: output and {len(ga) - 1} gradients {'the same' if same else 'DIFFERENT'} on both sides")
set_side(1)
if not same:
    sys.exit(1)
