"""Interleaved A/B of two variants of one tree, in one process (runs on an H200, not in CI).

`.ci/ab-bench` compares two trees in alternated rounds of `mokgen bench`, a process each; its
noise floor is about 3% (docs/perf-notes.md v0.18: byte-identical machine code differed by
2.3-2.8% over three rounds), because the clock under the power cap drifts between rounds. Here
both variants live in one process as two MoELayers (each its own weights and buffers, the same
inputs) and are launched alternately in ABBA blocks, each launch timed by CUDA events. A drift
slower than a block cancels out of each block's ratio. Variants are plan options (build options,
env.plan_options_with) and the layer's runtime arguments (chunk_rows, ring_chunks, dispatch_ctas),
so a change to measure this way has to sit behind a plan option on its branch. A key that starts
with MOKGEN_ is an environment setting, applied around each of that side's launches and while
its layer is made: the switches read at call time, such as the backward's
(MOKGEN_BWD_DX_PAIRS=fp32), and those a layer reads when made (MOKGEN_MX_FWD_WEIGHTS=auto).
`--backward`: each launch is a forward + backward step (the layer's output, backward of a fixed
dOut, gradients of x, the routing weights and the weights; the gradients reset each step as in
`mokgen bench --backward`). `--weights-new`: the MXFP8 weights' conversions forgotten before
every launch (an optimizer step's new weights); by default both sides keep theirs between steps.

Prints per workload: the median launch of A and of B (each block's mean of its two), the median
over blocks of B's time / A's (its 95% bootstrap interval beside it, bench.block_ratio), and in
how many blocks B was faster (the blocks: bench.abba_blocks, which the tuner's interleaved
confirmation uses too). With no --b, B is A
again: the noise floor of the method itself. `--b tuned`: B is the layer as `mokgen bench` builds
it, with the shipped tuned entry where one fits (issue 7's same-run comparison of tuned against
the defaults; A should then set nothing).

Usage: python3 .ci/ab_variants.py WORKLOAD [WORKLOAD ...] [--a K=V,K=V] [--b K=V,...]
                                   [--blocks N] [--backward] [--check-bits] [--numerics mxfp8]
                                   [--weights-new]
                                   [--out FILE.json]
  WORKLOAD  SPEC:local[:EP] (the bench's local stand-in, EP from bench.LOCAL_EP unless given: the
            rank's share of the experts, the same rows) or SPEC:layer[:TOKENS] (default 16384)
  --a/--b   plan options, runtime arguments or MOKGEN_* settings, e.g. narrow_tiles=0 or
            cluster=1,dispatch_ctas=16 or MOKGEN_BWD_DX_PAIRS=fp32
            or define=NAME[+NAME...]: that side's library built with -DNAME (a measuring macro
            of the kernel sources; its own cache entry)
  --blocks  ABBA blocks per workload (default 100: 400 launches)
  --numerics  the workloads' numerics (default: the spec's, bf16); mxfp8: both sides are the
            megakernel's MXFP8 build (v0.55: its CTA pairs, `--b cluster=2`)
Both variants use the plan's defaults (no tuned entry) where they set nothing."""

import argparse
import contextlib
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from mokgen import bench, build, env
from mokgen.ep import MoELayer, refresh_mx_weights
from mokgen.spec import load_spec

RUNTIME = ("chunk_rows", "ring_chunks", "dispatch_ctas", "bwd_ring", "bwd_policy")  # MoELayer arguments
BOOL_OPTIONS = ("narrow_tiles", "dispatch_join", "fuse_shared")  # given as 1 / 0


def parse_variant(text: str) -> tuple[dict, dict, dict]:
    """'k=v,k=v' -> (build options, runtime arguments, environment settings); values: int,
    true/false, else a string (MOKGEN_* settings stay strings)."""
    opts, rt, envs = {}, {}, {}
    for item in filter(None, (text or "").split(",")):
        if "=" not in item:
            sys.exit(f"ab_variants: expected KEY=VALUE, got {item!r}")
        k, v = (s.strip() for s in item.split("=", 1))
        if k.startswith("MOKGEN_"):
            envs[k] = v
            continue
        if k == "define":  # build flags, not a plan option (kept apart from opts by defines())
            opts["define"] = tuple(filter(None, v.split("+")))
            continue
        if v.lower() in ("true", "false"):
            val = v.lower() == "true"
        else:
            try:
                val = int(v)
            except ValueError:
                val = v
        if k in RUNTIME:
            rt[k] = val
        else:
            if k in BOOL_OPTIONS and isinstance(val, int):
                val = bool(val)
            opts[k] = val
    return opts, rt, envs


@contextlib.contextmanager
def defines(opts: dict):
    """Builds and loads under this side's -D flags (build.BASE_FLAGS, part of the cache key),
    with its plan options (opts without 'define') as the value."""
    names = opts.get("define", ())
    saved = build.BASE_FLAGS
    build.BASE_FLAGS = [*saved, *(f"-D{n}" for n in names)]
    try:
        yield {k: v for k, v in opts.items() if k != "define"}
    finally:
        build.BASE_FLAGS = saved


def build_side(opts: dict, specs, jobs: int = 4) -> list:
    """One side's libraries for ``specs`` under its plan options and define= flags, in parallel
    through the build cache (also .ci/prebuild-ab.py's, on the CPU machine); the build results."""
    with defines(opts) as plan_opts:
        options = env.plan_options_with(plan_opts)
        with ThreadPoolExecutor(jobs) as pool:
            return list(pool.map(lambda spec: build.build(spec, publish_generated=False, options=options), specs))


def apply_env(envs: dict, keys) -> None:
    """The environment of one side: its MOKGEN_* settings set, the other side's keys removed."""
    for k in keys:
        if k in envs:
            os.environ[k] = envs[k]
        else:
            os.environ.pop(k, None)


def workload(text: str, numerics: str | None = None):
    """'SPEC:local[:EP]' or 'SPEC:layer[:TOKENS]' -> (label, spec, rows, real spec, EP degree), the
    spec in ``numerics`` where given."""
    parts = text.split(":")
    name, kind = parts[0], parts[1] if len(parts) > 1 else "local"
    real = load_spec(name)
    ep = (int(parts[2]) if len(parts) > 2 else bench.LOCAL_EP.get(real.name, 8)) if kind == "local" else 1
    if kind == "local":
        try:
            spec, rows = bench.local_spec(real, ep)
        except ValueError as e:
            sys.exit(f"ab_variants: {e}")
    elif kind == "layer":
        spec, rows = real, int(parts[2]) if len(parts) > 2 else 16384
    else:
        sys.exit(f"ab_variants: workload kind must be local or layer, got {kind!r}")
    if numerics:
        spec = spec.with_target(numerics=numerics)
    label = f"{name} {kind}" + (f" EP{ep}" if kind == "local" and len(parts) > 2 else "") + f" {rows}"
    return label + (f" {numerics}" if numerics else ""), spec, rows, real, ep


def tuned_layer(spec, rows, real, ep):
    """The layer as `mokgen bench` builds it: the tuned entry of the real spec at this EP degree
    for a local stand-in (bench.local_layer_kwargs), the spec's own lookup for a layer. Returns (layer, what it took)."""
    if ep > 1:
        kwargs = bench.local_layer_kwargs(real, ep)
        if kwargs is None:
            return MoELayer(spec, max_tokens=rows, tuned=False), "no tuned entry (the defaults)"
        return MoELayer(spec, max_tokens=rows, tuned=False, **kwargs), f"{real.name}'s tuned entry at EP{ep}: {kwargs}"
    layer = MoELayer(spec, max_tokens=rows, tuned=True)
    entry = layer.tuned_entry
    return layer, f"the tuned entry {entry.path}" if entry is not None else "no tuned entry (the defaults)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="+")
    ap.add_argument("--a", default="")
    ap.add_argument("--b", default=None)
    ap.add_argument("--blocks", type=int, default=100)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--numerics", choices=("bf16", "mxfp8"), default=None)
    ap.add_argument("--weights-new", action="store_true",
                    help="forget the weights' MX conversions before every launch (mokgen.ep.refresh_mx_weights), "
                         "as an optimizer step leaves them; by default the steps keep them (the micro-batches of "
                         "one optimizer step)")
    ap.add_argument("--check-bits", action="store_true",
                    help="after timing, run both sides on one input set and exit 1 unless their outputs (and, "
                         "with --backward, the gradients of x, the routing weights and the three weights) are "
                         "bitwise equal: for variants meant to change no bit")
    args = ap.parse_args()
    va = parse_variant(args.a)
    tuned = args.b == "tuned"
    vb = va if args.b is None or tuned else parse_variant(args.b)
    env_keys = set(va[2]) | set(vb[2])
    for k in env_keys:  # a side's settings are its own, not the caller's environment's
        os.environ.pop(k, None)
    if args.numerics and args.b == "tuned":
        sys.exit("ab_variants: --b tuned takes the spec's own numerics; leave out --numerics")
    work = [workload(w, args.numerics) for w in args.workloads]
    # every build first, in parallel (the cache makes MoELayer's own load instant; a tuned
    # entry's build is made by its layer)
    sides = list({id(va): va, id(vb): vb}.values())
    for v in sides:  # a side's -D flags are a global of build: one side's builds at a time
        build_side(v[0], [spec for _, spec, _, _, _ in work])
    results, bad_bits = [], []
    for label, spec, rows, real, ep in work:
        wg, wu, wd = bench._weights(spec)
        gen = torch.Generator(device="cuda").manual_seed(5)
        inputs = []
        for _ in range(3):
            x = torch.randn(rows, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
            ids, w = bench._routing(spec, rows, gen)
            if args.backward:
                inputs.append((x.requires_grad_(True), ids, w.requires_grad_(True), torch.randn_like(x)))
            else:
                inputs.append((x, ids, w))
        layers = []
        for side, (opts, rt, _) in enumerate((va, vb)):
            if side == 1 and tuned:
                layer, took = tuned_layer(spec, rows, real, ep)
                print(f"{label}: B takes {took}", flush=True)
            else:
                apply_env((va, vb)[side][2], env_keys)  # (a setting the layer reads when made: MOKGEN_MX_FWD_WEIGHTS=auto)
                with defines(opts) as plan_opts:
                    layer = MoELayer(spec, max_tokens=rows, tuned=False, build_options=env.plan_options_with(plan_opts),
                                     **rt)
                apply_env({}, env_keys)
            with torch.no_grad():
                layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
            layer.check_ids = False
            layers.append(layer)
        del wg, wu, wd

        def step(layer, args_):
            if not args.backward:
                return layer(*args_)
            x, ids, w, g = args_
            for t in (x, w, *layer.parameters()):
                t.grad = None
            layer(x, ids, w).backward(g)

        def launch(side, i, inputs=inputs, layers=layers):
            apply_env((va, vb)[side][2], env_keys)
            if args.weights_new:  # host-side only: the cached conversions dropped, made again in the launch
                refresh_mx_weights()
            return bench.time_launch(lambda: step(layers[side], inputs[i % len(inputs)]))

        with torch.set_grad_enabled(args.backward):
            pairs = bench.abba_blocks(launch, args.blocks)
        apply_env({}, env_keys)
        for layer in layers:
            layer.check_errors()
        if args.check_bits:
            got = []
            for side, layer in enumerate(layers):
                apply_env((va, vb)[side][2], env_keys)
                with torch.set_grad_enabled(args.backward):
                    if args.backward:
                        x, ids, w, g = inputs[0]
                        step(layer, inputs[0])
                        got.append([x.grad.clone(), w.grad.clone(), *(p.grad.clone() for p in layer.parameters())])
                    else:
                        got.append([step(layer, inputs[0]).clone()])
                layer.check_errors()
            apply_env({}, env_keys)
            same = len(got[0]) == len(got[1]) and all(torch.equal(a, b) for a, b in zip(*got))
            print(f"{label:34s} bits: {'the same' if same else 'DIFFERENT'} ({len(got[0])} tensors)", flush=True)
            if not same:
                for i, (a, b) in enumerate(zip(*got)):  # how far apart: relative Frobenius and the largest difference
                    d = (a.double() - b.double())
                    rel = (d.norm() / a.double().norm().clamp_min(1e-300)).item()
                    print(f"{label:34s}   tensor {i}: relative difference {rel:.3e}, largest {d.abs().max().item():.3e}, "
                          f"{int((a != b).sum())} of {a.numel()} elements differ", flush=True)
                bad_bits.append(label)
        ratio, lo, hi = bench.block_ratio(pairs)
        r = {"workload": label, "a": args.a, "b": args.b, "blocks": args.blocks, "backward": args.backward,
             "weights_new": args.weights_new,
             # a launch's median time per side (half of a block's two)
             "a_ms": statistics.median(a / 2 for a, _ in pairs), "b_ms": statistics.median(b / 2 for _, b in pairs),
             "ratio": ratio, "ratio_lo": lo, "ratio_hi": hi, "b_faster": sum(b < a for a, b in pairs)}
        results.append(r)
        print(f"{label:34s} A {r['a_ms']:.3f} ms  B {r['b_ms']:.3f} ms  B/A {r['ratio']:.4f} "
              f"[{r['ratio_lo']:.4f}, {r['ratio_hi']:.4f}]  B faster in {r['b_faster']}/{args.blocks} blocks", flush=True)
        del layers, inputs
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if bad_bits:
        sys.exit(f"ab_variants: the two sides' bits differ on {', '.join(bad_bits)}")


if __name__ == "__main__":
    main()
