"""A generated megakernel module's LIB with its launch entry timed (the host clock at the call and
after it), for the host-latency tools (.ci/fwd_host.py, .ci/step_host.py). The bindings look LIB up
on every call, so `mod.LIB = TimedLib(mod.LIB, marks)` takes effect at the next launch."""
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
