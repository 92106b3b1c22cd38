"""A generated megakernel module's LIB with its launch entry timed (the host clock at the call and
after it), for the host-latency tools (.ci/fwd_host.py, .ci/step_host.py). The bindings look LIB up
on every call, so `mod.LIB = TimedLib(mod.LIB, marks)` takes effect at the next launch.
gpu_ahead_ms: the GPU's own time of a call, with the host ahead of it. stamp_host_path: host-clock
stamps at the stages of a MoELayer's path to its launch."""
import time


class TimedLib:
    """``marks["launch"]`` and ``marks["launched"]``: host clock at the launch entry's call and
    return; ``before``: called first at each launch (e.g. to stop a profiler there)."""

    def __init__(self, lib, marks: dict, before=None):
        self._lib, self._marks, self._before = lib, marks, before

    def __getattr__(self, attr):
        return getattr(self._lib, attr)

    def mokgen_ep_forward(self, *args):
        if self._before is not None:
            self._before()
        self._marks["launch"] = time.perf_counter()
        code = self._lib.mokgen_ep_forward(*args)
        self._marks["launched"] = time.perf_counter()
        return code


def gpu_ahead_ms(fn, runs: int, sleep_cycles: int) -> list:
    """``fn(i)``'s GPU time (ms, CUDA events) for i = 0 .. runs - 1, each call enqueued behind a GPU
    sleep of ``sleep_cycles`` so the host's work before its first launch is hidden."""
    import torch

    out = []
    for i in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def stamp_host_path(layer, stamps: dict) -> None:
    """Wraps ``layer``'s forward, its error poll and its binding's implementation so that each call
    puts the host clock in ``stamps``: "forward" (the module's forward entered), "poll" and "polled"
    (the error poll entered and left), "binding" (the binding's implementation entered). With a
    TimedLib's marks, "launch" follows."""
    import time

    def stamped(fn, at, after=None):
        def wrapper(*args, **kwargs):
            stamps[at] = time.perf_counter()
            out = fn(*args, **kwargs)
            if after is not None:
                stamps[after] = time.perf_counter()
            return out
        return wrapper

    layer.forward = stamped(layer.forward, "forward")
    layer.check_errors = stamped(layer.check_errors, "poll", "polled")
    layer._kernel._ep_forward = stamped(layer._kernel._ep_forward, "binding")
