"""Where the host time before the forward megakernel's launch goes, piece by piece (H100 or H200,
not CI). `.ci/step_host.py` measures the whole path (about 0.3 ms on the device machines' CPUs,
docs/perf-notes.md v0.44-v0.48); this script times it with the launch entry replaced by a stub
that returns at once, so no kernel runs and every figure is host time alone:
  call       `layer(x, ids, w)` whole, autograd recording (as in the bench's fwd+bwd step) and under
             no_grad (as in the forward bench); to the launch entry and to the return
  pieces     each step of MoELayer.forward and of the binding on the same arguments, alone, in a loop
  launch     the real launch entry's own host time (the ctypes call into cudaLaunchKernelExC)
  cprofile   the stubbed whole call, by own time
Medians of 5 rounds of N calls each, in microseconds. Usage: python3 .ci/host_path.py [SPEC] [TOKENS]
(default: the qwen3.5-35b-a3b layer at 16384 tokens, the bench's fwd+bwd workload)."""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from mokgen import bench, ep
from mokgen.ops import _check_device
from timed_lib import TimedLib  # .ci/timed_lib.py, beside this script

name = sys.argv[1] if len(sys.argv) > 1 else "qwen3.5-35b-a3b"
spec, tokens = bench.backward_workload(name, "layer", int(sys.argv[2]) if len(sys.argv) > 2 else None)
layer, _, inputs = bench.backward_problem(spec, tokens, 1, None)
layer.bwd_policy = "save"
x, ids, w, _ = inputs[0]
mod = layer._kernel
real_lib = mod.LIB
marks = {}


class StubLib(TimedLib):
    """The real library with its launch entry a no-op that reports success."""

    def mokgen_ep_forward(self, *args):
        self._marks["launch"] = time.perf_counter()
        return 0


def per_call_us(fn, n=2000, rounds=5):
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append(1e6 * (time.perf_counter() - t0) / n)
    return statistics.median(out)


def whole(grad: bool, n=300, rounds=5):
    """(us to the launch entry, us to the return) of layer(x, ids, w), medians."""
    to_launch, to_return = [], []
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with ctx:
        for _ in range(rounds * n):
            t0 = time.perf_counter()
            out = layer(x, ids, w)
            t1 = time.perf_counter()
            to_launch.append(1e6 * (marks["launch"] - t0))
            to_return.append(1e6 * (t1 - t0))
            del out
    return statistics.median(to_launch), statistics.median(to_return)


print(f"== {spec.name}: {tokens} tokens, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
      f"python {sys.version.split()[0]}")
mod.LIB = StubLib(real_lib, marks)
layer(x, ids, w)  # warm-up
torch.cuda.synchronize()
for grad in (True, False):
    a, b = whole(grad)
    print(f"call     {'grad   ' if grad else 'no_grad'}: {a:7.1f} us to the launch entry, {b:7.1f} us to the return")

s, bufs, g = layer.spec, layer._ep, layer._ep.geometry
ids32 = ids
grad_inputs = (x, w, layer.w_gate, layer.w_up, layer.w_down)
tail = ep._tail_args(mod, "save", True, (), grad_inputs)
args = ([x], [ids32], [w], [layer.w_gate], [layer.w_up], [layer.w_down], *bufs.addresses(), layer.rank, g.max_tokens,
        g.chunk_rows, g.ring_chunks, layer._ctas, layer._dispatch, int(layer.timeout_ms * 1e6), -1, *tail)
pieces = {
    "module __call__ over forward (hooks)": None,
    "_check_rank_inputs": lambda: ep._check_rank_inputs(s, 0, x, ids, w),
    "_check_device x3": lambda: [_check_device(t, "x", bufs.device) for t in (x, ids, w)],
    "torch.compiler.is_compiling": torch.compiler.is_compiling,
    "torch.cuda.is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
    "check_errors(block=False)": lambda: layer.check_errors(block=False),
    "_mx_training": lambda: ep._mx_training(mod, grad_inputs),
    "_tail_args": lambda: ep._tail_args(mod, "save", True, (), grad_inputs),
    "_ring_key": lambda: ep._ring_key(x, ids32),
    "_weights_for": lambda: ep._weights_for(mod, layer.w_gate, layer.w_up, layer.w_down),
    "_records_grad": lambda: ep._records_grad(grad_inputs),
    "_op(kernel, True)": lambda: ep._op(mod, True),
    "bufs.watch": lambda: bufs.watch(layer.timeout_ms),
    "torch.empty_like(x)": lambda: torch.empty_like(x),
    "torch.empty(gu)": lambda: torch.empty(tokens * s.top_k, 2 * s.moe_intermediate_size, dtype=torch.bfloat16,
                                           device=x.device),
    "EpParams() and its fill": None,
    "binding _ep_forward (stub launch)": lambda: mod._ep_forward(*args),
    "binding EP_EAGER (stub launch, grad)": lambda: mod.EP_EAGER(*args),
    "_launch (stub entry)": lambda: mod._launch(mod.LIB.mokgen_ep_forward, x.device, None),
}


def fill():
    p = mod.EpParams()
    p.sym[0] = 1
    p.local[0] = 1
    for f in ("x", "ids", "weights", "w_gate", "w_up", "w_down", "out"):
        getattr(p, f)[0] = x.data_ptr()
    p.num_tokens[0] = x.shape[0]
    for f in ("ctl", "timeout_ns", "world", "rank_base", "launch_ranks", "ctas_per_rank", "dispatch_ctas",
              "max_tokens", "chunk_rows", "ring_chunks", "silent_rank"):
        setattr(p, f, 1)
    return p


pieces["EpParams() and its fill"] = fill
fwd_us = per_call_us(lambda: layer.forward(x, ids, w), n=300)
call_us = per_call_us(lambda: layer(x, ids, w), n=300)
pieces.pop("module __call__ over forward (hooks)")
print(f"piece    layer.forward (grad, stub launch): {fwd_us:7.1f} us; layer(...): {call_us:7.1f} us "
      f"(module __call__ {call_us - fwd_us:+.1f})")
for label, fn in pieces.items():
    n = 300 if "binding" in label else 2000
    print(f"piece    {label:45s} {per_call_us(fn, n=n):7.2f} us")
torch.cuda.synchronize()

# the real launch entry's own host time (kernels run; one at a time)
mod.LIB = TimedLib(real_lib, marks)
own = []
with torch.no_grad():
    for _ in range(30):
        torch.cuda.synchronize()
        layer(x, ids, w)
        own.append(1e6 * (marks["launched"] - marks["launch"]))
torch.cuda.synchronize()
print(f"launch   the real entry: {statistics.median(own):.1f} us (min {min(own):.1f}) of host time per launch")

mod.LIB = StubLib(real_lib, marks)
p = cProfile.Profile()
p.enable()
for _ in range(500):
    out = layer(x, ids, w)
    del out
p.disable()
torch.cuda.synchronize()
buf = io.StringIO()
pstats.Stats(p, stream=buf).sort_stats("tottime").print_stats(30)
print("cprofile (500 stubbed calls, grad) by own time:\n" + buf.getvalue())
mod.LIB = real_lib
