"""What the MXFP8 A/B and profile scripts share (.ci/mx_step_ab.py, .ci/mx_lib_ab.py,
.ci/mx_cols_blocked_ab.py, .ci/mx_train_profile.py;
imported from the scripts' own folder, not a script itself): the staged MXFP8 training step on
the bench's local workload of a spec, and ABBA timing of a call under two sides."""
import statistics

from mokgen import bench, load_spec, mx_experts


def timed(fn, n: int = 5) -> float:
    """The median of n timed calls (ms) after one warm-up."""
    return statistics.median(bench.time_cuda(lambda i: fn(), n_inputs=1, warmup=1, iters=n))


def abba(fn, use, a: str, b: str, blocks: int = 8) -> list:
    """``fn`` timed under side a and side b (``use(side)`` switches to it) in ABBA blocks of 5
    calls: ``[median ms of a, median ms of b, mean of b / a over the blocks, min, max]``."""
    ms = {a: [], b: []}
    for blk in range(blocks):
        for side in ((a, b) if blk % 2 == 0 else (b, a)):
            use(side)
            ms[side].append(timed(fn))
    ratios = [y / x for x, y in zip(ms[a], ms[b])]
    return [statistics.median(ms[a]), statistics.median(ms[b]), statistics.mean(ratios), min(ratios), max(ratios)]


def staged_step(name: str):
    """``(spec, step, inputs)`` for spec ``name``'s local workload: ``step()`` runs
    mx_experts.experts_forward_train's fwd+bwd with the gradients set to None first and returns
    them (x, the routing weights, w_gate, w_up, w_down); ``inputs`` is ``(x, ids, w, d_out, wg, wu,
    wd)``."""
    spec, tokens = bench.local_spec(load_spec(name), bench.LOCAL_EP.get(name, 8))
    layer, (wg, wu, wd), problem = bench.backward_problem(spec, tokens, 1)
    del layer
    x, ids, w, d_out = problem[0]
    leaves = [x, w, wg, wu, wd]  # leaves that require gradients

    def step():
        for t in leaves:
            t.grad = None
        mx_experts.experts_forward_train(x, ids, w, wg, wu, wd, spec.activation.clamp_limit).backward(d_out)
        return [t.grad for t in leaves]

    return spec, step, (x, ids, w, d_out, wg, wu, wd)

