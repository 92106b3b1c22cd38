"""The command line: `mokgen list | show | render | build | doctor | bench | tune | wheel | prebuilt`.

Errors a user can cause print one line (``error: ...``) on stderr and exit with code 2; no
traceback. Long work shows progress with rich.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from mokgen import env
from mokgen._version import __version__
from mokgen.errors import MokgenError

console = Console()
err_console = Console(stderr=True)


def _fail(message: str) -> None:
    message = " ".join(str(message).splitlines()).strip()  # always one line
    err_console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(2)


class _Group(click.Group):
    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        # Bad options and arguments are user errors too: one `error:` line and exit code 2,
        # instead of click's multi-line usage block. `mokgen` alone still prints the help.
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as err:
            err.show()
            sys.exit(err.exit_code)
        except click.UsageError as err:
            path = err.ctx.command_path if err.ctx is not None else "mokgen"
            _fail(f"{err.format_message()} (see `{path} --help`)")
        except click.ClickException as err:
            _fail(err.format_message())
        except click.Abort:
            _fail("aborted")
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MokgenError as err:
            _fail(str(err))
        except OSError as err:  # a directory that cannot be written, a file in the way, a full disk
            _fail(_os_error_line(err))
        except KeyboardInterrupt:
            _fail("interrupted")


def _os_error_line(err: OSError) -> str:
    """``PATH: what went wrong`` for an OSError, without the errno's bracket."""
    what = err.strerror or str(err)
    where = ": ".join(str(f) for f in (err.filename, err.filename2) if f is not None)
    return f"{where}: {what}" if where else what


def _check_out_dir(path: str, option: str) -> Path:
    """An output folder checked before any long work: a folder that can be written to, or one that
    can be made (nothing is made here; a probe file is written and removed in the nearest existing
    folder). Raises InputError naming ``option``."""
    import tempfile

    from mokgen.errors import InputError

    out = Path(path).expanduser()
    probe = out
    while not probe.exists():
        if probe.is_symlink():  # a dangling link where the folder should be
            raise InputError(f"{option} {path}: {probe} is a broken symbolic link")
        probe = probe.parent
    if not probe.is_dir():
        raise InputError(f"{option} {path}: {probe} is not a directory")
    try:
        fd, name = tempfile.mkstemp(prefix=".mokgen-probe-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise InputError(f"{option} {path}: cannot write in {probe} ({err.strerror or err})") from None
    return out


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mokgen")
def main() -> None:
    """mokgen: compile specialized expert-parallel MoE CUDA kernels from model specs.

    SPEC is a bundled spec name or alias (see `mokgen list`) or a path to a YAML file.
    """


def _spec(ref: str, numerics: str | None = None):
    from mokgen.spec import load_spec

    spec = load_spec(ref)
    if numerics:
        spec = spec.with_target(numerics=numerics)
    return spec


@main.command("list")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def list_cmd(as_json: bool) -> None:
    """List the bundled model specs."""
    from mokgen.spec import bundled_specs, load_spec

    rows = []
    for name, path in bundled_specs().items():
        s = load_spec(path)
        rows.append(
            {
                "name": s.name,
                "aliases": list(s.aliases),
                "hidden": s.hidden_size,
                "intermediate": s.moe_intermediate_size,
                "experts": s.num_experts,
                "top_k": s.top_k,
                "shared": s.shared_experts.count,
                "scoring": s.routing.scoring,
                "file": str(path),
            }
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="bundled MoE specs")
    table.add_column("name", no_wrap=True)  # never ellipsized: it is what users type
    for col in ("aliases", "hidden", "intermediate", "experts / top-k", "shared", "scoring"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(
            r["name"], ", ".join(r["aliases"]), str(r["hidden"]), str(r["intermediate"]),
            f"{r['experts']} / {r['top_k']}", str(r["shared"]), r["scoring"],
        )
    console.print(table)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies under it (generated/NAME), else whole."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


@main.command()
@click.argument("spec_ref", metavar="SPEC")
@click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True, help="expert-parallel degree")
@click.option("--tokens", type=click.IntRange(min=0), default=None, help="tokens per rank (default: the target's maximum)")
@click.option("--numerics", type=click.Choice(["bf16", "mxfp8"]), default=None, help="override target.numerics")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def show(spec_ref: str, ep: int, tokens: int | None, numerics: str | None, as_json: bool) -> None:
    """Show a spec, its plan (build name, tiles) and derived figures."""
    from mokgen.plan import build_name, figures

    spec = _spec(spec_ref, numerics)
    figs = figures(spec, ep=ep, tokens=tokens)
    doc = {"name": build_name(spec), "spec": spec.canonical_dict(), "figures": figs}
    options = env.plan_options()  # a bad MOKGEN_* switch is an error here as in render and build
    try:
        from mokgen.plan import make_plan

        doc["plan"] = make_plan(spec, **options).compile_fields()
    except MokgenError as err:  # a target the plan refuses (make_plan's error): still show the figures
        doc["plan"] = None
        doc["plan_error"] = str(err)
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    table = Table(title=f"{spec.name}  ->  {doc['name']}", show_header=False)
    table.add_column("field")
    table.add_column("value")
    s = spec
    table.add_row("shape", f"hidden {s.hidden_size}, expert intermediate {s.moe_intermediate_size}")
    table.add_row("experts", f"{s.num_experts} routed, top-{s.top_k}; shared {s.shared_experts.count}"
                  + (f" x {s.shared_experts.intermediate_size} (gate {s.shared_experts.gate})" if s.shared_experts.count else ""))
    r = s.routing
    table.add_row("routing", f"{r.scoring}, bias {r.score_correction_bias}, renormalize {r.renormalize}, "
                  f"scale {r.routed_scaling_factor}, groups {r.n_group}/{r.topk_group}")
    table.add_row("activation", f"{s.activation.kind}" + (f", clamp {s.activation.clamp_limit}" if s.activation.clamp_limit else ""))
    table.add_row("target", f"{s.target.arch}, {s.target.numerics}, EP <= {s.target.max_ep_ranks}, "
                  f"tokens/rank <= {s.target.max_tokens_per_rank}")
    if doc["plan"]:
        p = doc["plan"]
        table.add_row("tiles", f"BM {p['gemm_block_m']}, BN up {p['gemm_block_n_up']} / down {p['gemm_block_n_down']}, "
                      f"BK {p['gemm_block_k']}, stages {p['gemm_stages']}"
                      + (", CTA pairs" if p["gemm_cluster"] == 2 else "")
                      + (f", MX form {p['mx_form']}" if p["numerics"] == "mxfp8" else ""))
    else:
        table.add_row("plan", doc["plan_error"])
    f = figs
    table.add_row("FLOPs / token (fwd)", f"{f['flops_per_token_fwd'] / 1e9:.3f} GFLOP (routed {f['flops_per_token_routed_fwd'] / 1e9:.3f})")
    ratio = "" if f["dispatch_bytes_vs_bf16"] == 1 else f" ({f['dispatch_bytes_vs_bf16']:.3f}x bf16)"
    table.add_row("dispatched / token", _human_bytes(f["bytes_dispatched_per_token"]) + ratio
                  + f" + routing {f['routing_bytes_per_token']} B")
    table.add_row("expert weights", f"{_human_bytes(f['expert_weight_bytes'])} each, {_human_bytes(f['routed_weight_bytes_total'])} routed in all")
    table.add_row(f"per rank (EP {ep}, {f['tokens_per_rank']} tokens)",
                  f"{f['local_experts']} experts, {_human_bytes(f['routed_weight_bytes_per_rank'])} of weights")
    for k, v in f["buffers_per_rank"].items():
        table.add_row(f"  {k}", str(v) if "rows" in k else _human_bytes(v))
    console.print(table)


@main.command("render")
@click.argument("spec_ref", metavar="SPEC")
@click.option("--numerics", type=click.Choice(["bf16", "mxfp8"]), default=None,
              help="override target.numerics (bf16 or mxfp8: the MXFP8 build)")
def render_cmd(spec_ref: str, numerics: str | None) -> None:
    """Render the generated sources into generated/<name>/ (no compilation)."""
    from mokgen import build as build_mod
    from mokgen import render

    spec = _spec(spec_ref, numerics)
    plan, key, tc = build_mod.plan_and_key(spec)
    files = render.render(plan, key)
    dest = render.write_tree(files, env.generated_dir() / plan.name)
    click.echo(f"rendered {plan.name} (key {key[:12]}) -> {dest}")
    for name in sorted(files):
        click.echo(f"  {dest / name}")


@main.command("build")
@click.argument("spec_refs", metavar="SPEC...", nargs=-1, required=True)
@click.option("--force", is_flag=True, help="rebuild even when the cache has the build")
@click.option("--numerics", type=click.Choice(["bf16", "mxfp8"]), default=None,
              help="override target.numerics (bf16 or mxfp8: the MXFP8 build)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON line per build")
@click.option("--ep", type=click.IntRange(min=1), default=None,
              help="with --tokens: build the tuned variant for this EP degree (mokgen tune), if one exists")
@click.option("--tokens", type=click.IntRange(min=1), default=None, help="tokens per rank of the tuned entry")
@click.option("--gpu", default=None, help="GPU name of the tuned entry (default: the visible GPU's)")
def build_cmd(spec_refs: tuple[str, ...], force: bool, numerics: str | None, as_json: bool, ep: int | None,
              tokens: int | None, gpu: str | None) -> None:
    """Compile the kernel library of each SPEC (cached by content). With --ep/--tokens, the build
    options of the matching tuned entry (`mokgen tune`) where one exists."""
    from mokgen import build as build_mod
    from mokgen.errors import InputError

    specs = [_spec(ref, numerics) for ref in spec_refs]  # validate everything before compiling
    tuned_for = None
    if ep is not None or tokens is not None or gpu is not None:
        if ep is None or tokens is None:
            raise InputError("a tuned build needs both --ep and --tokens")
        if gpu is not None and not gpu.strip():
            raise InputError("--gpu needs a GPU name, as torch.cuda.get_device_name() gives it")
        if gpu is None:
            import torch

            if not torch.cuda.is_available():
                raise InputError("--ep/--tokens pick a tuned entry by GPU name: no GPU is visible, pass --gpu NAME")
            gpu = torch.cuda.get_device_name()
        tuned_for = (gpu, ep, tokens)
    for spec in specs:
        options = None
        if tuned_for is not None:
            from mokgen import tune as tune_mod

            entry = tune_mod.lookup(spec, gpu=tuned_for[0], ep=tuned_for[1], tokens=tuned_for[2])
            if entry is None:
                err_console.print(f"{spec.name}: no tuned entry for {tuned_for[0]}, EP{ep}, {tokens} tokens: "
                                  "the plan's defaults", markup=False)
            else:
                options = env.plan_options_with(entry.best.build_options())
                err_console.print(f"{spec.name}: tuned entry {entry.path} ({entry.best.label()})", markup=False)
        # an MXFP8 build of the expanded form under MOKGEN_MX_FWD_WEIGHTS=auto: its raw twin too
        # (the build a one-GPU layer launches for training at few rows an expert, mokgen.ep._raw_twin)
        builds = [(options, "")]
        twin = build_mod.raw_twin_options(spec, options)
        if twin is not None:
            builds.append((twin, " (the raw-weights twin, MOKGEN_MX_FWD_WEIGHTS=auto)"))
        for opts, what in builds:
            with err_console.status(f"building {spec.name}{what} (nvcc, sm_90a) ...", spinner="dots"):
                result = build_mod.build(spec, force=force, log=lambda s: err_console.print(s, markup=False),
                                         options=opts, publish_generated=not what)  # (generated/ shows the build)
            if as_json:
                click.echo(json.dumps(result.to_json()))
                continue
            how = "cache hit" if result.cached else "compiled"
            click.echo(f"{result.name}{what}: {how} in {result.seconds:.2f} s -> {result.library}")
            if not result.cached:
                spills = [l for l in build_mod.resource_report(result.entry) if "spill" in l]
                bad = [l for l in spills if "0 bytes spill stores, 0 bytes spill loads" not in l]
                serial = build_mod.serialized_wgmma(result.entry)
                click.echo(f"  ptxas: {'no spills' if not bad else '; '.join(bad)}"
                           f"{'' if not serial else f'; wgmma serialized in {len(serial)} kernel(s)'} "
                           f"(report in {result.entry / 'build.log'})")
            if what:
                click.echo(f"  {_shown(result.entry)}/ holds its sources")
            else:
                click.echo(f"  {_shown(env.generated_dir() / result.name)}/ holds the sources and a link to the library")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def doctor(as_json: bool) -> None:
    """Check the toolchain and the GPU: what works and what is missing."""
    from mokgen import build as build_mod

    checks: list[tuple[str, bool, str]] = []
    checks.append(("python", True, f"{platform.python_version()} ({sys.executable})"))
    checks.append(("mokgen", True, __version__))
    try:
        nvcc = build_mod.find_nvcc()
        ver = build_mod._nvcc_version(nvcc, os.path.getmtime(nvcc))
        ok = tuple(int(x) for x in ver.split(".")[:2]) >= (12, 8)
        checks.append(("nvcc", ok, f"{ver} at {nvcc}" + ("" if ok else " (12.8 or newer needed)")))
    except MokgenError as err:
        checks.append(("nvcc", False, str(err)))
    try:
        inc, cver = build_mod.find_cutlass()
        checks.append(("CUTLASS/CuTe headers", True, f"{cver} at {inc}"))
    except MokgenError as err:
        checks.append(("CUTLASS/CuTe headers", False, str(err)))
    try:
        import torch

        checks.append(("torch", True, f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"))
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                cap = torch.cuda.get_device_capability(i)
                ok = cap == (9, 0)
                checks.append((f"GPU {i}", ok, f"{torch.cuda.get_device_name(i)}, sm_{cap[0]}{cap[1]}"
                               + ("" if ok else " (kernels target sm_90a: H100/H200)")))
        else:
            checks.append(("GPU", False, "no CUDA GPU visible: can build, cannot run kernels"))
    except ImportError:
        checks.append(("torch", False, "not installed: pip install torch"))
    checks.append(("cache", True, str(env.cache_dir())))
    checks.append(("generated", True, str(env.generated_dir())))
    for name in env.SWITCHES:
        if os.environ.get(name):
            checks.append((name, True, os.environ[name]))
    if as_json:
        click.echo(json.dumps([{"check": c, "ok": ok, "detail": d} for c, ok, d in checks], indent=2))
        return
    table = Table(title="mokgen doctor")
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    for c, ok, d in checks:
        table.add_row(c, "[green]ok[/green]" if ok else "[red]missing[/red]", d)
    console.print(table)


def _init_ep_group() -> bool:
    """Join the torchrun process group (NCCL, one GPU per process, NVLink multicast off).
    Returns whether this is rank 0."""
    import os

    from mokgen.errors import InputError

    if "WORLD_SIZE" not in os.environ:
        raise InputError("--workload ep runs one process per GPU: launch it as "
                         "`torchrun --nproc-per-node N -m mokgen bench SPEC --workload ep`")
    # multicast stays off: a program that uses it can take a shared host's GPUs out of service
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    return dist.get_rank() == 0


def bench_table(rows, ceiling: float, gpu: str) -> Table:
    """`mokgen bench`'s table: a row per implementation, each peer's time against the best mokgen
    row of its (workload, spec, tokens) group, and, where the rows are fwd+bwd ones, the peak
    memory of each side above its inputs and the memory it holds outside the step (a MoELayer's
    persistent buffers)."""
    table = Table(title=f"mokgen bench on {gpu} (dense bf16 ceiling {ceiling:.0f} TFLOP/s)")
    peaks = any(r.peak_gib is not None for r in rows)
    helds = any(r.held_gib is not None for r in rows)
    errors = any(r.error is not None for r in rows)
    for col in ("workload", "spec", "tokens", "implementation", "ms", "TFLOP/s", "% ceiling", "mokgen speedup",
                *(("peak GiB",) if peaks else ()), *(("held GiB",) if helds else ()),
                *(("err vs fp64", "vs mokgen bf16") if errors else ())):
        table.add_column(col)
    for r in rows:
        group = [q for q in rows if (q.workload, q.spec, q.tokens) == (r.workload, r.spec, r.tokens)]
        best = min((q.ms for q in group if q.impl.startswith("mokgen")), default=None)
        speed = "" if r.impl.startswith("mokgen") or best is None else f"{r.ms / best:.2f}x"
        peak = ("" if r.peak_gib is None else f"+{r.peak_gib:.2f}",) if peaks else ()
        held = ("" if r.held_gib is None else f"{r.held_gib:.2f}",) if helds else ()
        err = ()
        if errors:  # --numerics mxfp8: each row's error, and the MXFP8 row's speed over the BF16 megakernel
            # the BF16 megakernel's rows only: an MXFP8 megakernel row faster than BF16 is not the baseline
            bf16 = min((q.ms for q in group if q.impl.startswith("mokgen megakernel") and "MXFP8" not in q.impl),
                       default=None)
            ratio = f"{bf16 / r.ms:.2f}x" if "MXFP8" in r.impl and bf16 else ""
            err = ("" if r.error is None else f"{r.error:.2e}", ratio)
        table.add_row(r.workload, r.spec, str(r.tokens), r.impl, f"{r.ms:.3f}", f"{r.tflops:.0f}",
                      f"{100 * r.tflops / ceiling:.0f}%", speed, *peak, *held, *err)
    return table


@main.command()
@click.argument("spec_refs", metavar="[SPEC]...", nargs=-1)
@click.option("--all", "all_specs", is_flag=True, help="every bundled spec")
@click.option("--workload", type=click.Choice(["layer", "virtual", "local", "ep", "block"]), multiple=True,
              help="layer: whole routed layer on one GPU; virtual: W=8 virtual EP; local: one rank's "
                   "work after dispatch at EP8 (EP64 for deepseek-v3); ep: real EP, one process per GPU "
                   "under torchrun; block: the whole MoE block (router, experts, shared expert) on one "
                   "GPU (default: layer and virtual)")
@click.option("--tokens", type=click.IntRange(min=1), default=None,
              help="tokens (layer, block) or tokens per rank (virtual, local, ep); default 4096 / 2048")
@click.option("--iters", type=click.IntRange(min=20), default=20, show_default=True, help="timed runs (median)")
@click.option("--no-loop", is_flag=True, help="skip the slow per-expert PyTorch loop")
@click.option("--skew", is_flag=True, help="ep: skewed routing (every token prefers experts of rank 0)")
@click.option("--backward", is_flag=True,
              help="layer/local/block: time forward + backward (autograd) instead of forward")
@click.option("--numerics", type=click.Choice(["bf16", "mxfp8"]), default="bf16", show_default=True,
              help="mxfp8: the layer and local workloads add the MXFP8 megakernel and staged experts (forward: "
                   "with each mokgen row's error against the float64 layer; --backward: their fwd+bwd), virtual "
                   "and ep the MXFP8 megakernel with the bytes dispatched between ranks per token")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench-out", show_default=True)
def bench(spec_refs, all_specs, workload, tokens, iters, no_loop, skew, backward, numerics, out_dir) -> None:
    """Time mokgen against PyTorch on the same inputs (needs an sm_90 GPU)."""
    from mokgen.errors import InputError
    from mokgen.spec import bundled_specs

    refs = list(bundled_specs()) if all_specs else list(spec_refs)
    if not refs:
        raise InputError("name at least one SPEC, or pass --all")
    specs = [_spec(r) for r in refs]
    workloads = workload or ("layer", "virtual")
    if numerics == "mxfp8" and not set(workloads) <= {"layer", "local", "virtual", "ep"}:
        raise InputError("--numerics mxfp8 times the layer, local, virtual and ep workloads (pass --workload layer, "
                         "local, virtual or ep)")
    if numerics == "mxfp8" and backward and not set(workloads) <= {"layer", "local"}:
        raise InputError("--numerics mxfp8 --backward times the layer and local workloads (pass --workload layer or "
                         "local)")
    if backward and not set(workloads) <= {"layer", "local", "block"}:
        raise InputError("--backward times the layer, local and block workloads only (pass --workload layer, local "
                         "or block)")
    _check_out_dir(out_dir, "--out")  # before the benchmark, not after it
    import torch

    if not torch.cuda.is_available():
        raise InputError("mokgen bench needs a CUDA GPU; none is visible")
    from mokgen import bench as b

    main_rank = True
    if "ep" in workloads:
        main_rank = _init_ep_group()
    rows, links = [], {}
    with err_console.status("measuring the dense bf16 GEMM ceiling ...", spinner="dots"):
        ceiling = b.dense_ceiling_tflops()
    import time

    for spec in specs:
        for wl in workloads:
            start, first = time.perf_counter(), len(rows)
            with err_console.status(f"{wl}: {spec.name} ...", spinner="dots"):
                if wl == "layer" and backward:
                    rows += b.bench_layer_backward(spec, tokens or 4096, iters=iters, numerics=numerics)
                elif wl == "layer":
                    rows += b.bench_layer(spec, tokens or 4096, iters=iters, loop=not no_loop, numerics=numerics)
                elif wl == "local" and backward:
                    ep = b.LOCAL_EP.get(spec.name, 8)
                    local, local_rows = b.local_spec(spec, ep, tokens or 2048)
                    rows += b.bench_layer_backward(local, local_rows, iters=iters, workload=f"local EP{ep}",
                                                   layer_kwargs=b.local_layer_kwargs(spec, ep, tokens or 2048),
                                                   numerics=numerics)
                elif wl == "local":
                    rows += b.bench_local(spec, tokens_per_gpu=tokens or 2048, iters=iters, loop=not no_loop,
                                          numerics=numerics)
                elif wl == "block":
                    rows += b.bench_block(spec, tokens or 4096, iters=iters, backward=backward)
                elif wl == "ep":
                    ep_rows, figures = b.bench_ep(spec, tokens or 2048, iters=iters, skew=skew, numerics=numerics)
                    rows += ep_rows
                    if figures:
                        links[f"{spec.name} {ep_rows[0].workload}"] = figures
                elif spec.num_experts % 8 == 0:
                    rows += b.bench_virtual(spec, tokens or 2048, iters=iters, loop=not no_loop, numerics=numerics)
            if main_rank and len(rows) > first:  # progress in logs too (the table comes at the end)
                err_console.print(f"{wl} {spec.name}: " + ", ".join(f"{r.impl} {r.ms:.3f} ms" for r in rows[first:])
                                  + f" ({time.perf_counter() - start:.0f} s)", highlight=False)
    if not main_rank:
        return
    console.print(bench_table(rows, ceiling, torch.cuda.get_device_name()))
    for r in rows:
        for line in (b.phase_line(r), b.bytes_line(r), r.note):
            if line:
                click.echo(line)
    if links:
        lt = Table(title="expert-parallel links: GB/s per GPU per direction, remote bytes only, busiest rank")
        for col in ("spec / workload", "transfer", "remote MB (busiest rank)", "ms", "GB/s"):
            lt.add_column(col)
        for what, figures in links.items():
            for name, f in figures.items():
                r = f["busiest_rank"]
                ms, gbps = f["ms_per_rank"][r], f["gbps"]
                if "bytes_per_token" in f:  # --numerics mxfp8: bytes crossing per token, no time
                    lt.add_row(what, name, f"{f['remote_bytes_per_rank'][r] / 1e6:.1f}", "-",
                               f"{f['bytes_per_token']:.0f} B / token")
                    continue
                lt.add_row(what, name, f"{f['remote_bytes_per_rank'][r] / 1e6:.1f}",
                           "-" if ms is None else f"{ms:.3f}", "-" if gbps is None else f"{gbps:.0f}")
        console.print(lt)
    js, png = b.write_results(rows, ceiling, Path(out_dir), extra={"links": links} if links else None)
    click.echo(f"wrote {js}" + (f" and {png}" if png else " (no PNG: matplotlib is not installed)"))


@main.command()
@click.argument("spec_refs", metavar="[SPEC]...", nargs=-1)
@click.option("--all", "all_specs", is_flag=True, help="a wheel for every bundled spec")
@click.option("--arch", "archs", multiple=True, default=("sm_90a",), show_default=True, help="target arch (repeatable)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="dist", show_default=True)
def wheel(spec_refs, all_specs, archs, out_dir) -> None:
    """Build a prebuilt wheel per SPEC: compiled kernels, binding, spec and metadata."""
    from mokgen import package
    from mokgen.errors import InputError
    from mokgen.spec import bundled_specs

    refs = list(bundled_specs()) if all_specs else list(spec_refs)
    if not refs:
        raise InputError("name at least one SPEC, or pass --all")
    specs = [_spec(r) for r in refs]  # validate everything first
    archs = tuple(dict.fromkeys(archs))  # `--arch sm_90a --arch sm_90a` builds it once
    _check_out_dir(out_dir, "--out")
    from rich.progress import Progress

    with Progress(console=err_console, transient=True) as progress:
        task = progress.add_task("building wheels", total=len(specs))
        for spec in specs:
            progress.update(task, description=f"wheel {spec.name}")
            path = package.build_wheel(spec, out_dir=Path(out_dir), archs=tuple(archs),
                                       log=lambda s: progress.console.print(s, markup=False))
            click.echo(f"{spec.name}: {path}")
            progress.advance(task)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def prebuilt(as_json: bool) -> None:
    """List the installed prebuilt packages and verify their artifacts (exit 1 if one fails)."""
    from mokgen import package

    rows = []
    for spec_name, module_name in package.installed_packages():
        try:
            root = package.package_root(module_name)
            meta = json.loads((root / "metadata.json").read_text())
            problems = package.verify_package(root, meta)
            rows.append({"spec": spec_name, "package": module_name, "root": str(root), "mokgen": meta.get("mokgen"),
                         "cuda": meta.get("cuda"), "archs": meta.get("archs"),
                         "artifacts": sorted(meta.get("artifacts", {})), "verified": not problems,
                         "problems": problems, "provenance": meta.get("provenance")})
        except Exception as err:  # noqa: BLE001 - a broken package is reported, not fatal
            rows.append({"spec": spec_name, "package": module_name, "verified": False, "problems": [str(err)]})
    failed = any(not r["verified"] for r in rows)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        sys.exit(1 if failed else 0)
    if not rows:
        click.echo("no prebuilt mokgen packages are installed (build one with `mokgen wheel SPEC`)")
        return
    table = Table(title="installed prebuilt mokgen packages")
    for col in ("spec", "package", "archs", "artifacts", "verified"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["spec"], r["package"], ", ".join(r.get("archs") or []), str(len(r.get("artifacts", []))),
                      "[green]yes[/green]" if r["verified"] else f"[red]no[/red]: {r['problems'][0]}")
    console.print(table)
    sys.exit(1 if failed else 0)


@main.command()
@click.argument("spec_refs", metavar="[SPEC]...", nargs=-1)
@click.option("--all", "all_specs", is_flag=True, help="every bundled spec")
@click.option("--ep", type=click.IntRange(min=1), default=None,
              help="EP degree (default: 1, or the process group's size under torchrun)")
@click.option("--tokens", type=click.IntRange(min=1), default=None,
              help="tokens per rank (default: 16384 at EP 1, else 2048); entries cover its power-of-two bucket")
@click.option("--iters", type=click.IntRange(min=20), default=20, show_default=True, help="timed runs per candidate")
@click.option("--no-resume", is_flag=True, help="time every candidate again (ignore a previous run's partial file)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="where tuned files go (default: $MOKGEN_TUNED_DIR, else <cache dir>/tuned)")
@click.option("--jobs", type=click.IntRange(min=1), default=4, show_default=True, help="parallel nvcc builds")
@click.option("--dry-run", is_flag=True, help="print the search space (and what was pruned, why); no GPU needed")
@click.option("--chunk-sweep", is_flag=True,
              help="instead: the layer time against chunk rows (overlap granularity), a JSON and PNG curve per spec")
@click.option("--chunks", default="512,1024,2048,3072,4096,6144,8192,12288,16384", show_default=True,
              help="--chunk-sweep: the chunk sizes (received rows per compute batch)")
@click.option("--plots", "plot_dir", type=click.Path(file_okay=False), default="tune-out", show_default=True,
              help="--chunk-sweep: where the JSON and PNG go")
@click.option("--confirm", "confirm", type=click.Choice(["interleaved", "rounds"]), default="interleaved",
              show_default=True,
              help="how a winner other than the defaults is confirmed: interleaved ABBA blocks of single launches "
                   "in one process (one GPU; under torchrun the rounds), or alternated rounds of medians")
@click.option("--numerics", type=click.Choice(["bf16", "mxfp8"]), default=None,
              help="override target.numerics: tune the spec's MXFP8 megakernel (its own tuned file)")
@click.pass_context
def tune(ctx, spec_refs, all_specs, ep, tokens, iters, no_resume, out_dir, jobs, dry_run, chunk_sweep, chunks,
         plot_dir, confirm, numerics) -> None:
    """Pick tile, pipeline and overlap parameters per SPEC on this GPU (mokgen.tune): build and
    time every candidate of the search space against the plan's defaults, write the tuned file
    that `mokgen.MoELayer` and `mokgen build --ep/--tokens` then use, print default vs tuned."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mokgen import tune as tune_mod
    from mokgen.errors import InputError
    from mokgen.spec import bundled_specs

    refs = list(bundled_specs()) if all_specs else list(spec_refs)
    if not refs:
        raise InputError("name at least one SPEC, or pass --all")
    specs = [_spec(r, numerics) for r in refs]
    try:
        sizes = [int(c) for c in chunks.split(",") if c.strip()]
    except ValueError:
        raise InputError(f"--chunks must be comma-separated integers, got {chunks!r}") from None
    if not sizes or min(sizes) < 1:
        raise InputError(f"--chunks must be positive integers, got {chunks!r}")
    given = [option for option, param in (("--chunks", "chunks"), ("--plots", "plot_dir"))
             if ctx.get_parameter_source(param) is click.core.ParameterSource.COMMANDLINE]
    if given and not chunk_sweep:
        raise InputError(f"{' and '.join(given)} {'belongs' if len(given) == 1 else 'belong'} to --chunk-sweep "
                         "(pass it, or leave them out)")
    group, main_rank = None, True
    if not dry_run and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        main_rank = _init_ep_group()
        group = dist.group.WORLD
        world = dist.get_world_size()
        if ep is not None and ep != world:
            raise InputError(f"--ep {ep} under torchrun with {world} processes: they must be equal (or leave --ep out)")
        ep = world
    ep = ep or 1
    tokens = tokens or (16384 if ep == 1 else 2048)
    for spec in specs:  # every spec's arguments are checked before anything is built
        if spec.num_experts % ep:
            raise InputError(f"{spec.name}: --ep {ep} must divide num_experts ({spec.num_experts})")
        if (ep == 1 or group is not None) and tokens > spec.target.max_tokens_per_rank:
            raise InputError(f"{spec.name}: --tokens {tokens} is above the spec's target.max_tokens_per_rank "
                             f"({spec.target.max_tokens_per_rank})")
    if dry_run:
        for spec in specs:
            space = tune_mod.search_space(spec, ep=ep, tokens=tokens, distributed=False)
            click.echo(f"{spec.name}: EP{ep}, {tokens} tokens per rank: {len(space.candidates)} candidates, "
                       f"{len(space.pruned)} pruned")
            for i, c in enumerate(space.candidates):
                click.echo(f"  {i:3d}  {c.label()}" + ("  (plan defaults)" if i == 0 else ""))
            for c, why in space.pruned:
                click.echo(f"  pruned  {c.label()}: {why}")
            more, refused = tune_mod.stagger_variants(spec, space.candidates[0])
            leads = ", ".join(str(c.stagger) for c in more + [c for c, _ in refused])
            if leads:
                click.echo(f"  then the stagger pass: the winner at lead(s) {leads} (a build each; a lead the plan "
                           "refuses is pruned then)")
        return
    import torch

    if not torch.cuda.is_available():
        raise InputError("mokgen tune times candidates on a CUDA GPU; none is visible (--dry-run shows the space)")
    if chunk_sweep:
        _check_out_dir(plot_dir, "--plots")
    else:  # where the tuned files go, before the first candidate is built
        _check_out_dir(out_dir or str(env.tuned_dir()), "--out" if out_dir else "MOKGEN_TUNED_DIR")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    if chunk_sweep:
        from mokgen import bench as b

        out = Path(plot_dir)
        for spec in specs:
            with Progress(*columns, console=err_console, transient=True, disable=not main_rank) as progress:
                task = progress.add_task(f"chunk sweep {spec.name}", total=len(sizes))
                curve = tune_mod.chunk_sweep(spec, ep=ep, tokens=tokens, chunks=sizes, iters=iters,
                                             step=lambda i, n, c, o: progress.advance(task))
            if not main_rank:
                continue
            js, png = b.write_chunk_curve(spec, ep, tokens, curve, torch.cuda.get_device_name(), out)
            for chunk, o in curve:
                click.echo(f"{spec.name} EP{ep} T={tokens} chunk {chunk}: "
                           + (f"{o.ms:.3f} ms" if o.ms is not None else f"failed: {o.error}"))
            click.echo(f"wrote {js}" + (f" and {png}" if png else " (no PNG: matplotlib is not installed)"))
        return
    results = []
    for spec in specs:
        with Progress(*columns, console=err_console, transient=True, disable=not main_rank) as progress:
            task = progress.add_task(f"tune {spec.name} (building)", total=None)

            def step(i, n, c, o, task=task, progress=progress, name=spec.name):
                progress.update(task, total=n, completed=i + 1, description=f"tune {name}")

            results.append(tune_mod.tune(spec, ep=ep, tokens=tokens, iters=iters, resume=not no_resume, group=group,
                                         root=Path(out_dir) if out_dir else None, jobs=jobs,
                                         log=lambda s, p=progress: p.console.print(s, markup=False), step=step,
                                         confirm=confirm))
    if not main_rank:
        return
    table = Table(title=f"mokgen tune on {torch.cuda.get_device_name()}: EP{ep}, {tokens} tokens per rank")
    for col in ("spec", "candidates", "default ms", "tuned ms", "speedup", "tuned setting"):
        table.add_column(col)
    for r in results:
        best = r.space.candidates[r.best_index]
        speed = f"{r.default_ms / r.best_ms:.3f}x" if r.default_ms and r.best_ms else "-"
        table.add_row(r.key.spec, str(len(r.space.candidates)), "-" if r.default_ms is None else f"{r.default_ms:.3f}",
                      "-" if r.best_ms is None else f"{r.best_ms:.3f}", speed,
                      "plan defaults" if r.best_index == 0 else best.label())
    console.print(table)
    for r in results:
        click.echo(f"wrote {r.path}")
