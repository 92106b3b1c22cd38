"""Tune: build + load + time candidates -> tuned JSON (the only writer of tuned files).

A candidate is one setting of the megakernel's tunable parameters: four build options (CTA pairs,
k-block size, the dispatch's copy engine, the last only under torchrun, and the consumers'
stagger lead; each a different compiled library) and three run-time ones (chunk rows = the
overlap granularity, ring slots, dispatch CTAs of a rank). The search space comes from the plan
(index 0 is always the plan's defaults), pruned up front by shared-memory, register and memory
limits and by what the workload can use. Every remaining candidate is built (in parallel,
through the build cache), loaded and timed by the bench method (CUDA events, warm-up, median of
at least 20 runs on rotating inputs). A failure (compile error, register spills beyond the
default build's, launch error, an output whose bits differ from the defaults', or on one GPU a
training step's gradients: every axis leaves the bits as they are, so such a candidate is a
broken build; ``same_bits_guard``) counts as
infinite time. The stagger is not an axis of that
product: a second pass (``stagger_variants``) times the first pass's winner at each lead of
STAGGER_TRY, a build and a timing per lead rather than a doubled space; its candidates follow
the first pass's in the file. The winner is the fastest candidate;
times within NOISE of the best count as a tie, which goes to the lower index, so every rank and
every rerun on equal timings picks the same one. A winner other than the defaults is then
confirmed: it and the defaults are timed again in alternation (CONFIRM_ROUNDS each), and it
stays the winner only if the median of its rounds beats the defaults' by more than NOISE. Under
the H200's power cap a time drifts with the GPU's recent load over a tune of many candidates,
so only interleaved times compare; the stored default and tuned times are the confirmation's.
``confirm="interleaved"`` (`mokgen tune --confirm interleaved`, one GPU) confirms instead in
CONFIRM_BLOCKS ABBA blocks of single launches with both layers alive in one process, the method
of `.ci/ab_variants.py` (noise floor about 0.5% against the rounds' 3%, docs/perf-notes.md
v0.19): the winner holds if the median per-block ratio is below 1 - NOISE and its bootstrap 95%
upper bound below 1. The rounds stay the default until its GPU test has run.

Results are stored as JSON per (spec, GPU name, numerics, EP degree, token bucket, workload)
with a ``_metadata`` block: compared on lookup are its format, the mokgen version, the GPU, the
digest of the kernel's sources (``render.kernel_digest``: the megakernel's templates and the
headers they include, so a template no kernel includes leaves the files valid), the plan options that are not tuned (core, schedule, fused shared expert,
dispatch unroll) and the CUDA and CUTLASS versions where both sides know them; the PyTorch
version is recorded only. Files live under
``$MOKGEN_TUNED_DIR`` (default <cache dir>/tuned) and, committed with the project, in the
package's ``tuned/`` folder, looked up in that order. A file whose metadata does not match this
installation is ignored with a warning (the plan's defaults apply). ``mokgen.MoELayer`` and
``mokgen build --ep --tokens`` use the matching entry; ``MOKGEN_TUNED=0`` turns lookups off, and
a set MOKGEN_CLUSTER / MOKGEN_BLOCK_K / MOKGEN_PULL_MODE / MOKGEN_FWD_STAGGER switch wins over a
tuned value.

Workloads: EP degree 1 times the whole layer on one GPU at T tokens; a larger EP degree on one
GPU times one rank's local work after dispatch (bench.local_spec: the rows a rank receives
under uniform routing) as a stand-in, stored as the "local" workload; under torchrun (a process
group) it times the real EP layer ("layer"), every rank's median is reduced to the slowest
rank's, and rank 0 decides and broadcasts. Lookups prefer "layer" entries to "local" ones.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from mokgen import env
from mokgen._version import __version__
from mokgen.errors import InputError, KernelError, PlanError
from mokgen.plan import MX_FORMS, PULL_MODES, SMEM_LIMIT, ep_defaults, make_plan, smem_bytes
from mokgen.spec import MoESpec

#: relative difference below which two timings are a tie (the lower candidate index wins)
NOISE = 0.01
#: alternated re-timings of the defaults and the first pass's winner before the winner is kept
CONFIRM_ROUNDS = 3
#: the interleaved confirmation (``confirm="interleaved"``): ABBA blocks of single launches, and
#: the resamples of its bootstrap interval
CONFIRM_BLOCKS = 50
CONFIRM_BOOTSTRAP = 2000
#: how the first pass's winner is confirmed: "interleaved" (CONFIRM_BLOCKS ABBA blocks in one
#: process, the default on one GPU; measured in v0.21) or "rounds" (CONFIRM_ROUNDS alternated
#: medians, used under a process group whatever is asked)
CONFIRM_METHODS = ("rounds", "interleaved")
#: chunk sizes (received rows per compute batch) the search tries beside the plan's default;
#: 16384 since v0.44, where four of the H100's seven winners took the largest size then tried (8192)
CHUNKS = (1024, 2048, 4096, 8192, 16384)
#: ring slots tried beside the default
RINGS = (4, 8)
#: the consumers' stagger leads (k-blocks) the second pass tries on the first pass's winner
#: (plan.STAGGERS; hopper_gemm.cuh StaggerPipe); each lead is one more build per tune
STAGGER_TRY = (2, 3)
#: dispatch CTAs per rank tried beside the default, under a process group only (real transfers)
DISPATCH = (8, 24)  # the default is an eighth of the CTAs: 16 of an H200's 132
#: dispatch CTAs tried for a one-rank launch (the real single-GPU layer, and the one-GPU stand-in
#: of EP > 1), whose dispatch is a local copy of every routed row; the default there is a
#: sixteenth of the CTAs, 8 of 132, or an eighth for narrow experts (ep.NARROW_EXPERTS): one of
#: these runs as the default does. A stand-in's count serves the stand-in only: a real EP layer,
#: whose dispatch crosses links, keeps its own default (ep._tuned_choice). 32 since v0.44: on
#: the H100 the qwen3.5-35b-a3b layer's and qwen3.5-397b-a17b's winners took the most then tried (24), and
#: the qwen3.5-35b-a3b layer's forward was paced by its dispatch copy (docs/perf-notes.md v0.44).
DISPATCH_ONE_RANK = (4, 8, 16, 24, 32)
#: the ring may take at most this share of the GPU's memory
RING_MEMORY_SHARE = 0.25
#: the package's own tuned files (committed with the project)
PACKAGE_TUNED = Path(__file__).resolve().parent / "tuned"
FORMAT = 1


@dataclass(frozen=True)
class Candidate:
    """One setting of the tunable parameters. ``dispatch_ctas`` None: the layer's default.
    ``pull_mode``: the dispatch's copy engine (a build option, tried only with real transfers).
    ``stagger``: the consumers' stagger lead (a build option, tried by the second pass).
    ``mx_form``: an MXFP8 build's form (plan.MX_FORMS; "codes" for bf16)."""

    cluster: int
    block_k: int
    chunk_rows: int
    ring_chunks: int
    dispatch_ctas: Optional[int] = None
    pull_mode: str = "copy"
    stagger: int = 0
    mx_form: str = "codes"

    def build_options(self) -> dict[str, Any]:
        """The make_plan keyword arguments this candidate sets."""
        return {"cluster": self.cluster, "block_k": self.block_k, "pull_mode": self.pull_mode, "stagger": self.stagger,
                "mx_form": self.mx_form}

    def build_key(self) -> tuple:
        """The build this candidate needs, hashable (candidates with equal keys share a library)."""
        return tuple(sorted(self.build_options().items()))

    def runtime(self) -> dict[str, Optional[int]]:
        """The MoELayer keyword arguments this candidate sets."""
        return {"chunk_rows": self.chunk_rows, "ring_chunks": self.ring_chunks, "dispatch_ctas": self.dispatch_ctas}

    def label(self) -> str:
        d = "default" if self.dispatch_ctas is None else str(self.dispatch_ctas)
        pull = ", bulk pull" if self.pull_mode == "bulk" else ""
        stagger = f", stagger {self.stagger}" if self.stagger else ""
        form = ", expanded MX rows" if self.mx_form == "expand" else ""
        return (f"cluster {self.cluster}, BK {self.block_k}, chunk {self.chunk_rows}, ring {self.ring_chunks}, "
                f"dispatch {d}{pull}{stagger}{form}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any) -> "Candidate":
        fields = set(cls.__dataclass_fields__)
        # files written before pull_mode (v0.7), the stagger (v0.47) or the MX form (v0.57) was
        # tuned lack the field: they ran the copy, in lockstep, MXFP8 builds as codes
        if not isinstance(doc, dict) or not fields - {"pull_mode", "stagger", "mx_form"} <= set(doc) <= fields:
            raise ValueError(f"a candidate has the fields {sorted(cls.__dataclass_fields__)}, got {doc!r}")
        from mokgen.plan import BLOCK_KS, CLUSTERS, MX_FORMS, PULL_MODES, STAGGERS

        doc = dict(doc)
        pull_mode = doc.pop("pull_mode", "copy")
        if pull_mode not in PULL_MODES:
            raise ValueError(f"candidate field pull_mode must be one of {PULL_MODES}, got {pull_mode!r}")
        mx_form = doc.pop("mx_form", "codes")
        if mx_form not in MX_FORMS:
            raise ValueError(f"candidate field mx_form must be one of {MX_FORMS}, got {mx_form!r}")

        allowed = {"cluster": CLUSTERS, "block_k": BLOCK_KS, "stagger": STAGGERS}
        limits = {"chunk_rows": 1 << 20, "ring_chunks": 1024, "dispatch_ctas": 1024}
        for name, value in doc.items():
            if value is None and name == "dispatch_ctas":
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"candidate field {name} must be an integer, got {value!r}")
            if name in allowed and value not in allowed[name]:
                raise ValueError(f"candidate field {name} must be one of {allowed[name]}, got {value}")
            if name in limits and not 1 <= value <= limits[name]:
                raise ValueError(f"candidate field {name} must be in 1..{limits[name]}, got {value}")
        return cls(**doc, pull_mode=pull_mode, mx_form=mx_form)


def token_bucket(tokens: int) -> int:
    """Tokens per rank -> the bucket a tuned entry covers: the next power of two, at least 256."""
    if tokens < 0:
        raise InputError(f"tokens must be >= 0, got {tokens}")
    return max(256, 1 << max(0, int(tokens) - 1).bit_length())


def _slug(text: str) -> str:
    """A GPU name as a file-name part: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


#: what a tuned entry was timed on: the layer itself (one GPU at EP 1, or every rank under
#: torchrun), or one rank's local work on one GPU as a stand-in for EP > 1
WORKLOADS = ("layer", "local")


@dataclass(frozen=True)
class TuneKey:
    spec: str
    gpu: str
    numerics: str
    ep: int
    bucket: int
    workload: str = "layer"

    @classmethod
    def of(cls, spec: MoESpec, *, gpu: str, ep: int, tokens: int, workload: str = "layer") -> "TuneKey":
        if ep < 1 or spec.num_experts % ep:
            raise InputError(f"{spec.name}: the EP degree ({ep}) must divide num_experts ({spec.num_experts})")
        if workload not in WORKLOADS or (workload == "local" and ep == 1):
            raise InputError(f"workload must be 'layer', or 'local' for EP > 1, got {workload!r} at EP {ep}")
        return cls(spec.name, gpu, spec.target.numerics, int(ep), token_bucket(tokens), workload)

    def relpath(self) -> Path:
        tail = "-local" if self.workload == "local" else ""
        return Path(self.spec) / f"{_slug(self.gpu)}-{self.numerics}-ep{self.ep}-t{self.bucket}{tail}.json"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def default_candidate(spec: MoESpec) -> Candidate:
    """The plan's defaults under the environment's switches (MOKGEN_CLUSTER, MOKGEN_BLOCK_K,
    MOKGEN_PULL_MODE, the core and schedule decide the build options), the ring of
    ``plan.ep_defaults``; MOKGEN_FWD_STAGGER sets the stagger."""
    plan = make_plan(spec, **env.plan_options())
    d = ep_defaults(spec)
    return Candidate(plan.gemm_cluster, plan.gemm_block_k, d["chunk_rows"], d["ring_chunks"], None, plan.pull_mode,
                     plan.gemm_stagger, plan.mx_form)


@dataclass
class Space:
    candidates: list[Candidate]
    pruned: list[tuple[Candidate, str]] = field(default_factory=list)


def search_space(spec: MoESpec, *, ep: int, tokens: int, distributed: bool = False,
                 gpu_memory: Optional[int] = None) -> Space:
    """The candidates for ``spec`` at EP ``ep`` and ``tokens`` per rank, index 0 = the plan's
    defaults, and the ones pruned up front with the reason. ``distributed``: timed with real
    transfers (dispatch CTAs are tried; at EP 1 they always are: the real one-GPU layer);
    ``gpu_memory``: bytes of the GPU (ring memory limit)."""
    base = default_candidate(spec)
    options = env.plan_options()
    # an axis whose switch is set stays at the switch's value (the build would override it)
    pairs_possible = options["gemm_core"] == "wgmma" and options["schedule"] == "flow"
    # the MX builds: k-blocks of 64 and the copy dispatch, in both forms (v0.57); CTA pairs only in
    # the expanded form: MxTile's measured 4-8% slower than its single CTAs on an H100 (v0.55,
    # v0.56), the expanded form's 3-19% faster (v0.57; docs/perf-notes.md)
    mx = spec.target.numerics == "mxfp8"
    clusters = [base.cluster] + ([3 - base.cluster] if pairs_possible and not env.switch_set("cluster") else [])
    # (the weights raw, v0.68, take the expanded form only: the plan refuses them with codes)
    forms = [base.mx_form] + ([f for f in MX_FORMS if f != base.mx_form]
                              if mx and not env.switch_set("mx_form") and options["mx_fwd_weights"] != "raw" else [])
    block_ks = [base.block_k] + ([b for b in (64, 32) if b != base.block_k]
                                 if options["gemm_core"] == "wgmma" and not mx and not env.switch_set("block_k")
                                 else [])
    chunks = [base.chunk_rows] + [c for c in CHUNKS if c != base.chunk_rows]
    rings = [base.ring_chunks] + [r for r in RINGS if r != base.ring_chunks]
    dispatch = [None] + (list(DISPATCH) if distributed and ep > 1 else list(DISPATCH_ONE_RANK) if ep == 1 else [])
    # the bulk-copy dispatch only where rows cross links: on one GPU every pull is a local copy,
    # and the two modes measured level there (docs/perf-notes.md, v0.7)
    pulls = [base.pull_mode] + ([m for m in PULL_MODES if m != base.pull_mode]
                                if distributed and ep > 1 and options["gemm_core"] == "wgmma" and not mx
                                and not env.switch_set("pull_mode") else [])
    rows = int(tokens) * spec.top_k  # rows a rank receives on average (uniform routing)
    # the chunk that holds all rows (the default's if it does, else the smallest tried): larger
    # ones run the same single chunk
    holding = base.chunk_rows if base.chunk_rows >= rows else min((c for c in chunks if c >= rows), default=None)
    H, I = spec.hidden_size, spec.moe_intermediate_size
    space = Space([])
    mxtile_pairs = (2, "codes")  # built only where the defaults are pinned to them
    builds = [(c, b, m, f) for c in clusters for b in block_ks for m in pulls for f in forms
              if not (mx and (c, f) == mxtile_pairs and (base.cluster, base.mx_form) != mxtile_pairs)]
    for cluster, block_k, pull_mode, mx_form in builds:
        plan = make_plan(spec, **{**options, "cluster": cluster, "block_k": block_k, "pull_mode": pull_mode,
                                  "stagger": base.stagger, "mx_form": mx_form})
        build_why = None  # a reason that prunes every candidate of this build
        if smem_bytes(plan) > SMEM_LIMIT:
            build_why = f"shared memory: {smem_bytes(plan)} B per CTA > {SMEM_LIMIT}"
        elif plan.gemm_cluster == 2 and plan.gemm_block_n_down == 128:
            build_why = "registers: CTA pairs spill on down tiles of 128 columns (docs/architecture.md)"
        for chunk in chunks:
            n = math.ceil(rows / chunk)
            for ring in rings:
                same = _same_ring(ring, rings, n)
                for p in dispatch:
                    c = Candidate(cluster, block_k, chunk, ring, p, pull_mode, base.stagger, mx_form)
                    why = build_why
                    if why is None and c != base and holding is not None and chunk >= rows and chunk != holding:
                        why = f"chunk of {chunk} rows: a rank has {rows}, the chunk of {holding} holds them all"
                    if why is None and c != base and same is not None:
                        why = f"ring of {ring} slots: the same as {same} for {n} chunk(s)"
                    if why is None and gpu_memory and chunk * ring * (H + I) * 2 > RING_MEMORY_SHARE * gpu_memory:
                        why = f"memory: the ring takes {chunk * ring * (H + I) * 2 / 2**30:.1f} GiB"
                    if why is None:
                        space.candidates.append(c)
                    else:
                        space.pruned.append((c, why))
    if not space.candidates or space.candidates[0] != base:
        # the defaults are always measured: they are what the tuned entry is compared against
        space.candidates.insert(0, base)
        space.pruned = [(c, w) for c, w in space.pruned if c != base]
    return space


def stagger_variants(spec: MoESpec, winner: Candidate) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """The second pass: ``winner`` (the first pass's) at each lead of STAGGER_TRY other than its
    own, and the ones the plan refuses, with the reason. Nothing where the consumers cannot stagger
    (the portable core, the phased schedule, mxfp8) or MOKGEN_FWD_STAGGER holds the axis."""
    options = env.plan_options()
    if (options["gemm_core"] != "wgmma" or options["schedule"] != "flow" or spec.target.numerics == "mxfp8"
            or env.switch_set("stagger")):
        return [], []
    out: list[Candidate] = []
    pruned: list[tuple[Candidate, str]] = []
    for lead in STAGGER_TRY:
        if lead == winner.stagger:
            continue
        c = dataclasses.replace(winner, stagger=lead)
        try:
            make_plan(spec, **env.plan_options_with(c.build_options()))
        except PlanError as err:
            pruned.append((c, str(err)))
            continue
        out.append(c)
    return out, pruned


def _same_ring(ring: int, rings: list[int], n_chunks: int) -> Optional[int]:
    """An earlier ring size in ``rings`` that runs ``n_chunks`` chunks exactly as ``ring`` does
    (slots beyond the chunk count stay unused), or None."""
    eff = min(ring, max(1, n_chunks))
    for r in rings[: rings.index(ring)]:
        if min(r, max(1, n_chunks)) == eff:
            return r
    return None


def choose(times: list[Optional[float]], noise: float = NOISE) -> int:
    """Index of the winner: the fastest finite time; any time within ``noise`` (relative) of it
    is a tie, won by the lowest index. None / inf / nan are failures."""
    finite = [(i, t) for i, t in enumerate(times) if t is not None and math.isfinite(t)]
    if not finite:
        raise InputError("no candidate ran: every build or launch failed (see the tuned file's errors)")
    best = min(t for _, t in finite)
    return min(i for i, t in finite if t <= best * (1 + noise))


# ---- storage -----------------------------------------------------------------------------------

#: the build options the tuner chooses: not among a file's fixed plan options (a switch that pins
#: one is recorded under "pinned"). pull_mode stays among the fixed ones (see metadata)
TUNED_OPTIONS = ("cluster", "block_k", "stagger", "mx_form")
#: build options a tuned entry holds for either value: MXFP8 builds' weights raw (v0.68) run the
#: values form's tiles, pipeline and schedule with each stage's B quantized by the consumers, so an
#: entry timed with either fits both (the tuner times the values form unless the switch says raw)
EITHER_OPTIONS = ("mx_fwd_weights",)


def metadata(gpu: str) -> dict[str, Any]:
    """What a tuned entry depends on besides its key."""
    from mokgen import render

    options = env.plan_options()
    # the options that are not tuned; the tuned ones only where a switch pinned them (the
    # search then held that axis, so the entry fits only where the switch says the same)
    fixed = {k: v for k, v in options.items() if k not in TUNED_OPTIONS + EITHER_OPTIONS}
    fixed["fuse_shared"] = "auto" if fixed["fuse_shared"] in (None, True) else False  # True: the same builds
    # (pull_mode stays among the fixed options: an entry made under MOKGEN_PULL_MODE=bulk fits
    # only there, and one made without it fits under an explicit =copy too)
    fixed["pinned"] = {k: options[k] for k in TUNED_OPTIONS if env.switch_set(k)}
    doc: dict[str, Any] = {"mokgen": __version__, "gpu": gpu, "templates": render.kernel_digest(), "format": FORMAT,
                           "plan_options": fixed}
    doc.update(_toolchain_versions())
    try:
        import torch

        doc["torch"] = torch.__version__.split("+")[0]
    except ImportError:  # pragma: no cover - torch is a dependency
        doc["torch"] = None
    return doc


def _toolchain_versions() -> dict[str, Optional[str]]:
    """nvcc and CUTLASS versions where this machine can tell (None where it cannot)."""
    from mokgen import build as build_mod
    from mokgen.errors import ToolchainError

    out: dict[str, Optional[str]] = {"cuda": None, "cutlass": None}
    try:
        out["cutlass"] = build_mod.find_cutlass()[1]
        out["cuda"] = build_mod.find_toolchain().nvcc_version
    except ToolchainError:
        pass
    return out


def mismatch(meta: Any, current: dict[str, Any]) -> Optional[str]:
    """Why a tuned file's ``_metadata`` does not fit this installation (None if it does). The
    CUDA and CUTLASS versions count only where both are known."""
    if not isinstance(meta, dict):
        return "it has no _metadata block"
    for name in ("format", "mokgen", "gpu", "templates", "plan_options"):
        if meta.get(name) != current.get(name):
            return f"{name} {meta.get(name)!r} (here {current.get(name)!r})"
    for name in ("cuda", "cutlass"):
        if meta.get(name) and current.get(name) and meta[name] != current[name]:
            return f"{name} {meta[name]!r} (here {current[name]!r})"
    return None


def roots() -> list[Path]:
    """Where tuned files are looked up, in order."""
    return [env.tuned_dir(), PACKAGE_TUNED]


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Atomic write: a temporary file in the same folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@dataclass(frozen=True)
class Entry:
    """A tuned entry that fits this installation."""

    path: Path
    key: TuneKey
    best: Candidate
    doc: dict[str, Any]


def lookup(spec: MoESpec, *, gpu: str, ep: int, tokens: int, current: Optional[dict[str, Any]] = None) -> Optional[Entry]:
    """The tuned entry for (spec, gpu, numerics, ep, token bucket), or None: an entry timed on the
    layer before one timed on the local stand-in, and per kind the user dir before the package's. A
    file that does not parse, holds impossible values or whose metadata does not fit is skipped
    with a warning."""
    if not env.tuned_enabled():
        return None
    keys = [TuneKey.of(spec, gpu=gpu, ep=ep, tokens=tokens)]
    if ep > 1:
        keys.append(TuneKey.of(spec, gpu=gpu, ep=ep, tokens=tokens, workload="local"))
    for key in keys:  # an entry timed on the layer anywhere before a stand-in's
        for root in roots():
            path = root / key.relpath()
            if not path.is_file():
                continue
            try:
                doc = json.loads(path.read_text())
                best = Candidate.from_json(doc["best"])
                if doc.get("key") != key.to_json():
                    raise ValueError(f"its key {doc.get('key')} is not {key.to_json()}")
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                warnings.warn(f"mokgen: tuned file {path} is unreadable ({err}); ignored", stacklevel=2)
                continue
            current = metadata(gpu) if current is None else current
            why = mismatch(doc.get("_metadata"), current)
            if why is not None:
                warnings.warn(f"mokgen: tuned file {path} was made for {why}; ignored, the plan's defaults apply "
                              f"(rerun `mokgen tune {spec.name} --ep {ep} --tokens {tokens}`)", stacklevel=2)
                continue
            return Entry(path, key, best, doc)
    return None


# ---- measuring ---------------------------------------------------------------------------------

@dataclass
class Outcome:
    ms: Optional[float] = None
    error: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        return {"ms": self.ms, "error": self.error}


def _one_line(err: BaseException) -> str:
    """An exception as the one-line reason stored with a failed candidate."""
    return " ".join(str(err).splitlines())[:300] or type(err).__name__


def _spill_bytes(entry: Path) -> int:
    from mokgen import build as build_mod

    total = 0
    for line in build_mod.resource_report(entry):
        m = re.search(r"(\d+) bytes spill stores", line)
        total += int(m.group(1)) if m else 0
    return total


def build_candidates(spec: MoESpec, candidates: list[Candidate], *, jobs: int = 4,
                     progress: Callable[[str], None] = lambda s: None) -> dict[tuple, Optional[str]]:
    """Builds every distinct build-option set of ``candidates`` (in parallel, through the cache).
    Returns build options (as a sorted tuple) -> None, or why that build cannot be used (a
    compile error; register spills beyond the default build's, the first set)."""
    from concurrent.futures import ThreadPoolExecutor

    from mokgen import build as build_mod

    sets = list(dict.fromkeys(c.build_key() for c in candidates))  # distinct, first-seen order

    def one(t: tuple):
        try:
            result = build_mod.build(spec, publish_generated=False, options=env.plan_options_with(dict(t)))
            return _spill_bytes(result.entry), None
        except Exception as err:  # a failed build is a failed candidate, recorded with its reason
            return None, _one_line(err)

    out: dict[tuple, Optional[str]] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(one, sets))
    base_spills = results[0][0] if results and results[0][0] is not None else 0
    for t, (spills, error) in zip(sets, results):
        if error is None and spills is not None and spills > base_spills:
            error = f"register spills: {spills} B of spill stores (the default build: {base_spills})"
        out[t] = error
        progress(f"build {dict(t)}: {'ok' if error is None else error}")
    return out


def _timing_problem(spec: MoESpec, rows: int, group=None):
    """The timers' weights (this rank's experts under a process group) and three input sets of
    ``rows`` tokens, uniform routing, as the bench makes them."""
    import torch

    from mokgen import bench

    rank = 0 if group is None else torch.distributed.get_rank(group)
    gen = torch.Generator(device="cuda").manual_seed(11 + rank)
    if group is None:
        wg, wu, wd = bench._weights(spec)
    else:  # this rank's experts only
        e_loc = spec.num_experts // torch.distributed.get_world_size(group)
        wg, wu, wd = bench.expert_weights(spec, range(rank * e_loc, (rank + 1) * e_loc))
    inputs = []
    for _ in range(3):
        x = torch.randn(rows, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        inputs.append((x, *bench._routing(spec, rows, gen)))
    return (wg, wu, wd), inputs


def _candidate_layer(spec: MoESpec, rows: int, c: "Candidate", weights, group=None):
    """Candidate ``c``'s MoELayer holding ``weights`` (id checks off)."""
    import torch

    from mokgen.ep import MoELayer

    # MoELayer's constructor agrees on the kernel's load before its first collective
    # (ep._load_agreed): a load failing on one rank raises on every rank
    layer = MoELayer(spec, group, max_tokens=rows, tuned=False, build_options=env.plan_options_with(c.build_options()),
                     **c.runtime())
    wg, wu, wd = weights
    with torch.no_grad():
        layer.w_gate.copy_(wg), layer.w_up.copy_(wu), layer.w_down.copy_(wd)
    layer.check_ids = False
    return layer


def same_bits_guard(reference: Callable[[], Any], what: str = "output") -> Callable[[Any, str], None]:
    """A check that an output (a tensor, or a list of them) has the bits of ``reference()``
    (asked once, on first use). Every axis of the search space leaves the layer's bits as they
    are (CTA pairs, k-block, dispatch engine and CTAs, chunk, ring, stagger: each GPU-tested
    bitwise on one GPU, the dispatch engine and CTA counts on virtual ranks only, not yet across
    GPUs), so a candidate whose output differs from the defaults' is a broken build, not a
    faster one: the check raises a KernelError naming ``what``, which fails the candidate. The
    timer checks the forward's output, and on one GPU (BF16) a training step's gradients too,
    which read the g and u the forward saved."""
    import torch

    ref: list[Any] = []

    def same(a, b) -> bool:  # compared as bytes: a NaN equals itself, -0.0 differs from 0.0
        return (a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))

    def check(out: Any, label: str) -> None:
        if not ref:
            ref.append(reference())
        r = ref[0]
        outs, refs = (list(out), list(r)) if isinstance(r, (list, tuple)) else ([out], [r])
        if len(outs) != len(refs) or not all(same(a, b) for a, b in zip(outs, refs)):
            verb, its = ("differs", "its") if what == "output" else ("differ", "their")
            raise KernelError(f"{label}: its {what} {verb} from the defaults' in {its} bits; not a valid candidate")

    return check


def _layer_timer(spec: MoESpec, rows: int, iters: int, group=None):
    """A function (candidate) -> median ms of ``spec``'s layer on ``rows`` tokens per rank,
    uniform routing, bench's weights and inputs (shared by every candidate). Each candidate's
    output on the first input set must have the defaults' bits (same_bits_guard), and on one GPU
    (BF16) so must the gradients of one fwd+bwd step on it, or it fails.
    Under a process group a failure to load the kernel on one rank fails the candidate on all
    of them in step (the layer's constructor agrees on the load first)."""
    import torch

    from mokgen import bench

    weights, inputs = _timing_problem(spec, rows, group)
    # one GPU, BF16: a training step's gradients are checked too (mokgen's backward reads the g and
    # u the candidate's forward saved); across GPUs the backward recomputes them, and an MXFP8
    # layer's backward is the staged experts' whatever the candidate
    train = group is None and spec.target.numerics == "bf16"
    grad_out = (torch.randn(rows, spec.hidden_size, generator=torch.Generator(device="cuda").manual_seed(12),
                            device="cuda").to(torch.bfloat16) if train else None)

    def step_grads(layer):
        """One fwd+bwd step on the first input set: the gradients of x, the routing weights and
        the three expert weights."""
        x, ids, w = inputs[0]
        x, w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        layer(x, ids, w).backward(grad_out)
        return [x.grad, w.grad, layer.w_gate.grad, layer.w_up.grad, layer.w_down.grad]

    def defaults_output():
        layer = _candidate_layer(spec, rows, default_candidate(spec), weights, group)
        with torch.no_grad():
            out = layer(*inputs[0])
        grads = step_grads(layer) if train else None
        layer.check_errors()
        return out, grads

    # made here, before any candidate, so that under a process group every rank builds the
    # defaults' layer (collective) in step; a failure fails every candidate (nothing to check against)
    try:
        ref = defaults_output()

        def reference():
            return ref[0]

        def grad_reference():
            return ref[1]
    except Exception as err:
        why = _one_line(err)

        def reference():
            raise KernelError(f"the defaults' output, the reference for every candidate's bits, failed: {why}")
        grad_reference = reference
    same_bits = same_bits_guard(reference)
    same_grads = same_bits_guard(grad_reference, what="gradients")

    def time_one(c: Candidate) -> float:
        layer = _candidate_layer(spec, rows, c, weights, group)
        with torch.no_grad():
            times = bench.time_cuda(lambda i: layer(*inputs[i]), n_inputs=len(inputs), iters=iters)
            out = layer(*inputs[0])
        layer.check_errors()  # a launch that timed out fails the candidate
        same_bits(out, c.label())
        if train:
            same_grads(step_grads(layer), c.label())
            layer.check_errors()
        layer = None  # frees it before the next candidate (the timing lambda closes over the name)
        return statistics.median(times)

    return time_one


def _pair_timer(spec: MoESpec, rows: int):
    """A function (candidate a, candidate b, blocks) -> ``blocks`` pairs (a's ms, b's ms): both
    layers live at once (each its own buffers, the same weights and inputs) and are launched in
    ABBA blocks of single launches timed by CUDA events, each pair the block's two launches of a
    side summed. A drift of the clock slower than a block (the H200's power cap) cancels out of
    the block's ratio. One GPU, no process group. A launch error or timeout raises."""
    import torch

    from mokgen import bench

    weights, inputs = _timing_problem(spec, rows)

    def time_pairs(a: Candidate, b: Candidate, blocks: int) -> list[tuple[float, float]]:
        layers = [_candidate_layer(spec, rows, c, weights) for c in (a, b)]

        def launch(side: int, i: int) -> float:
            return bench.time_launch(lambda: layers[side](*inputs[i % len(inputs)]))

        with torch.no_grad():
            pairs = bench.abba_blocks(launch, blocks)
        for layer in layers:
            layer.check_errors()
        return pairs

    return time_pairs


def interleaved_verdict(pairs: Sequence[tuple[float, float]], *, noise: float = NOISE, resamples: int = CONFIRM_BOOTSTRAP,
                        seed: int = 0) -> dict[str, Any]:
    """The interleaved confirmation's decision from ABBA blocks ``(defaults' ms, candidate's ms)``:
    the per-block ratios candidate / defaults, their median, and a bootstrap 95% interval of the
    median (``resamples`` resamples from a fixed seed: the same verdict for the same times). The
    candidate holds only if the median is below ``1 - noise`` and the interval's upper bound below
    1, so a winner within the noise or not resolved from it goes back to the defaults."""
    from mokgen import bench

    if not pairs:
        raise InputError("interleaved_verdict needs at least one block")
    median, lo, hi = bench.block_ratio(pairs, resamples=resamples, seed=seed)
    return {"ratio": median, "ratio_lo": lo, "ratio_hi": hi, "held": median < 1 - noise and hi < 1}


def confirm_interleaved(first: int, time_pairs: Callable[[int, int, int], Sequence[tuple[float, float]]],
                        blocks: int = CONFIRM_BLOCKS, noise: float = NOISE) -> tuple[int, dict[str, Any]]:
    """confirm_choice's interleaved form: the defaults (index 0) and ``first`` in ``blocks`` ABBA
    blocks (``time_pairs(0, first, blocks)``, raising for a failure of either side, which keeps
    the defaults); the winner and the record. The record's ``default_ms`` / ``candidate_ms`` are
    the per-launch times of each block (half its pair), so Result's medians are launch times."""
    record: dict[str, Any] = {"candidate": first, "method": "interleaved", "blocks": blocks, "default_ms": [],
                              "candidate_ms": [], "held": False}
    try:
        pairs = list(time_pairs(0, first, blocks))
    except Exception as err:  # either side failing to run: the defaults stay
        record["error"] = _one_line(err)
        return 0, record
    record["default_ms"] = [a / 2 for a, _ in pairs]
    record["candidate_ms"] = [b / 2 for _, b in pairs]
    record.update(interleaved_verdict(pairs, noise=noise))
    return (first if record["held"] else 0), record


@dataclass
class Result:
    key: TuneKey
    path: Path
    space: Space
    outcomes: list[Outcome]
    best_index: int
    workload: str
    #: the confirmation (None where the first pass's winner was the defaults): the candidate
    #: re-timed, its and the defaults' alternated times, and whether it held
    confirm: Optional[dict[str, Any]] = None

    @property
    def default_ms(self) -> Optional[float]:
        if self.confirm is not None and self.confirm["default_ms"]:
            return statistics.median(self.confirm["default_ms"])
        return self.outcomes[0].ms

    @property
    def best_ms(self) -> Optional[float]:
        if self.confirm is not None:
            times = self.confirm["default_ms" if self.best_index == 0 else "candidate_ms"]
            if times:
                return statistics.median(times)
        return self.outcomes[self.best_index].ms


def confirm_choice(first: int, measure: Callable[[int], Optional[float]], rounds: int = CONFIRM_ROUNDS,
                   noise: float = NOISE) -> tuple[int, dict[str, Any]]:
    """Times the defaults (index 0) and the first pass's winner ``first`` in alternation,
    ``rounds`` times each (``measure(i)`` -> ms, None for a failure); returns the winner and the
    record. ``first`` stays the winner only if the median of its times is below the defaults'
    by more than ``noise``; a failure of either side ends the rounds: the defaults win if
    ``first`` failed, ``first`` if the defaults did."""
    record: dict[str, Any] = {"candidate": first, "rounds": rounds, "default_ms": [], "candidate_ms": [], "held": False}
    for _ in range(rounds):
        d = measure(0)
        if d is None:
            record["held"] = True
            return first, record
        c = measure(first)
        if c is None:
            return 0, record
        record["default_ms"].append(d)
        record["candidate_ms"].append(c)
    held = statistics.median(record["candidate_ms"]) < statistics.median(record["default_ms"]) * (1 - noise)
    record["held"] = held
    return (first if held else 0), record


def _read_partial(partial: Path, meta: dict[str, Any], cands: list[Candidate]) -> list[Optional[Outcome]]:
    """The successful outcomes of an interrupted run with the same metadata whose candidates begin
    with ``cands`` (failures are timed again: their cause may be gone); anything unusable counts as
    nothing."""
    none: list[Optional[Outcome]] = [None] * len(cands)
    try:
        old = json.loads(partial.read_text())
        if not isinstance(old, dict) or old.get("_metadata") != meta:
            return none
        listed = [Candidate.from_json(c) for c in old["candidates"]]
        # the file may list more after them: the second pass's candidates of an interrupted run
        if listed[:len(cands)] != cands or len(old["outcomes"]) != len(listed):
            return none
        out: list[Optional[Outcome]] = []
        for o in old["outcomes"][:len(cands)]:
            ms = o.get("ms") if isinstance(o, dict) else None
            ok = isinstance(ms, (int, float)) and not isinstance(ms, bool) and math.isfinite(ms) and ms > 0
            out.append(Outcome(float(ms), None) if ok else None)
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return none


def _workload(spec: MoESpec, ep: int, tokens: int, distributed: bool) -> tuple[MoESpec, int]:
    """(spec to time, tokens per rank of its layer): the spec itself, or on one GPU at EP > 1 the
    stand-in for one rank's local work (bench.local_spec: its rows are the tokens, top-1)."""
    from mokgen import bench

    if ep > 1 and not distributed:
        return bench.local_spec(spec, ep, tokens)
    return spec, int(tokens)


def tune(spec: MoESpec, *, ep: int = 1, tokens: int, iters: int = 20, resume: bool = True, group=None,
         root: Optional[Path] = None, jobs: int = 4, log: Callable[[str], None] = lambda s: None,
         step: Callable[[int, int, Candidate, Outcome], None] = lambda i, n, c, o: None,
         confirm: str = "interleaved") -> Result:
    """Measure every candidate of ``spec`` at EP ``ep`` and ``tokens`` per rank on this GPU, write
    the tuned file (under ``root``, default $MOKGEN_TUNED_DIR) and return the result. Resumable:
    the timings so far are kept in ``<file>.partial`` after every candidate and reused by a rerun
    with the same metadata and candidates. Under a process group (``group``), the ranks time
    together, every rank making the same collective calls: rank 0 reads the partial file and
    broadcasts it, a candidate's time is the slowest rank's (a failure on any rank fails it),
    rank 0 writes the file and decides the winner. ``confirm``: how a winner other than the
    defaults is confirmed, "interleaved" (confirm_interleaved, the default; one GPU only: under a
    process group the rounds are used) or "rounds" (confirm_choice)."""
    import torch

    if confirm not in CONFIRM_METHODS:
        raise InputError(f"confirm must be one of {', '.join(CONFIRM_METHODS)}, got {confirm!r}")
    if not torch.cuda.is_available():
        raise InputError("mokgen tune times candidates on a CUDA GPU; none is visible")
    distributed = group is not None
    dist = torch.distributed
    if distributed and dist.get_world_size(group) != ep:
        raise InputError(f"--ep {ep} under a process group of {dist.get_world_size(group)} ranks: they must be equal")
    local = ep > 1 and not distributed
    if not local and not 1 <= tokens <= spec.target.max_tokens_per_rank:
        raise InputError(f"{spec.name}: tokens per rank must be in 1..{spec.target.max_tokens_per_rank}, got {tokens}")
    rank0 = not distributed or dist.get_rank(group) == 0
    src0 = dist.get_global_rank(group, 0) if distributed else 0
    gpu = torch.cuda.get_device_name()
    key = TuneKey.of(spec, gpu=gpu, ep=ep, tokens=tokens, workload="local" if local else "layer")
    path = (env.tuned_dir() if root is None else Path(root)) / key.relpath()
    partial = path.with_name(path.name + ".partial")
    meta = metadata(gpu)
    work, rows = _workload(spec, ep, tokens, distributed)
    if local:
        workload = f"local work of one rank at EP{ep} ({rows} rows, uniform routing), one GPU"
    else:
        workload = f"EP{ep} layer, {tokens} tokens per rank, uniform routing" + (" (torchrun)" if distributed else "")
    # the stand-in is a one-rank problem: its rows are the rank's received rows, top-1
    space = search_space(work, ep=1 if local else ep, tokens=rows if local else tokens, distributed=distributed,
                         gpu_memory=torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    cands = space.candidates  # the second pass extends it in place

    def resumed(listed: list[Candidate]) -> list[Optional[Outcome]]:
        """The partial file's outcomes for ``listed`` (rank 0 reads, every rank gets the same)."""
        outs: list[Optional[Outcome]] = [None] * len(listed)
        if resume and rank0 and partial.is_file():
            outs = _read_partial(partial, meta, listed)
        if distributed:  # every rank has rank 0's candidates and resumes exactly what rank 0 resumed
            box = [([c.to_json() for c in listed], [None if o is None else o.ms for o in outs])]
            dist.broadcast_object_list(box, src=src0, group=group)
            differs = torch.tensor([int(box[0][0] != [c.to_json() for c in listed])], device="cuda")
            dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
            if differs.item():
                raise InputError(f"{spec.name}: the ranks built different search spaces (other switches or GPUs); run "
                                 "every rank with the same environment")
            outs = [None if ms is None else Outcome(ms, None) for ms in box[0][1]]
        return outs

    outcomes = resumed(cands)
    if any(o is not None for o in outcomes):
        log(f"resuming: {sum(o is not None for o in outcomes)} of {len(cands)} candidates already timed ({partial})")
    # the defaults' build first: spills are judged against it
    builds = build_candidates(work, cands[:1] + [c for c, o in zip(cands, outcomes) if o is None], jobs=jobs,
                              progress=log)
    timer = _layer_timer(work, rows, iters, group)

    def measure(c: Candidate) -> Outcome:
        """One timing of a built candidate; under a process group the slowest rank's (a failure
        on any rank fails it), every rank making the same collective calls."""
        try:
            outcome = Outcome(timer(c), None)
        except Exception as err:  # a candidate that cannot run is a failed candidate
            outcome = Outcome(None, _one_line(err))
        if distributed:
            t = torch.tensor([math.inf if outcome.ms is None else outcome.ms], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            if math.isinf(t.item()):
                outcome = Outcome(None, outcome.error or "failed on another rank")
            else:
                outcome = Outcome(t.item(), None)
        return outcome

    def time_from(first: int) -> None:
        """Times candidates ``first`` .. of ``cands`` that have no outcome yet, the partial file
        rewritten after each."""
        for i in range(first, len(cands)):
            c = cands[i]
            if outcomes[i] is None:
                error = builds.get(c.build_key())
                if distributed:  # a build that failed on any rank fails the candidate on every rank
                    flag = torch.tensor([0 if error is not None else 1], device="cuda")
                    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
                    if error is None and flag.item() == 0:
                        error = "the build failed on another rank"
                outcomes[i] = Outcome(None, error) if error is not None else measure(c)
                if rank0:
                    write_json(partial, {"_metadata": meta, "candidates": [x.to_json() for x in cands],
                                         "outcomes": [None if o is None else o.to_json() for o in outcomes]})
            step(i, len(cands), c, outcomes[i])

    def decide() -> int:
        """Rank 0's winner over every outcome so far, broadcast; an InputError if all failed."""
        best: Any = None
        if rank0:
            try:
                best = choose([o.ms for o in outcomes])
            except InputError:
                first = next((o.error for o in outcomes if o.error), "no error recorded")
                best = f"every candidate failed (the first: {first}); the outcomes are in {partial}"
        if distributed:
            box = [best]
            dist.broadcast_object_list(box, src=src0, group=group)
            best = box[0]
        if isinstance(best, str):
            raise InputError(f"{spec.name}: {best}")
        return best

    time_from(0)
    best = decide()
    # the second pass: the first pass's winner at the other stagger leads (every rank derives the
    # same candidates from the broadcast winner)
    more, refused = stagger_variants(work, cands[best])
    space.pruned.extend(refused)
    if more:
        n_first = len(cands)
        cands.extend(more)
        outcomes.extend(resumed(cands)[n_first:])
        todo = [c for c, o in zip(cands[n_first:], outcomes[n_first:]) if o is None]
        log(f"stagger pass: {cands[best].label()} at lead(s) {', '.join(str(c.stagger) for c in more)}")
        if todo:
            builds.update(build_candidates(work, cands[:1] + todo, jobs=jobs, progress=log))
        time_from(n_first)
        best = decide()
    record = None
    if best != 0 and outcomes[0].ms is not None and confirm == "interleaved" and not distributed:
        log(f"confirming {cands[best].label()} against the defaults ({CONFIRM_BLOCKS} interleaved ABBA blocks)")
        first = best
        pair_timer = _pair_timer(work, rows)
        best, record = confirm_interleaved(first, lambda a, b, n: pair_timer(cands[a], cands[b], n))
        if best != first:
            log(f"{cands[first].label()} did not hold against the defaults interleaved "
                f"(ratio {record.get('ratio', float('nan')):.4f}, upper bound {record.get('ratio_hi', float('nan')):.4f}"
                f"{', ' + record['error'] if 'error' in record else ''}): the defaults win")
    elif best != 0 and outcomes[0].ms is not None:  # every rank knows best (broadcast) and times in step
        log(f"confirming {cands[best].label()} against the defaults ({CONFIRM_ROUNDS} alternated rounds)")
        first = best
        best, record = confirm_choice(first, lambda i: measure(cands[i]).ms)
        if distributed:  # rank 0's decision (the times are the same reduced values on every rank)
            box = [best]
            dist.broadcast_object_list(box, src=src0, group=group)
            best = box[0]
        if best != first:
            log(f"{cands[first].label()} did not hold against the defaults in alternation: the defaults win")
    result = Result(key, path, space, outcomes, best, workload, record)
    if rank0:
        write_json(path, to_doc(result, meta))
        if partial.exists():
            partial.unlink()
    return result


def to_doc(result: Result, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "_metadata": meta,
        "key": result.key.to_json(),
        "workload": result.workload,
        "noise": NOISE,
        "best": result.space.candidates[result.best_index].to_json(),
        "best_index": result.best_index,
        "default_ms": result.default_ms,
        "best_ms": result.best_ms,
        "confirm": result.confirm,
        "candidates": [{"index": i, **c.to_json(), **o.to_json()}
                       for i, (c, o) in enumerate(zip(result.space.candidates, result.outcomes))],
        "pruned": [{**c.to_json(), "reason": why} for c, why in result.space.pruned],
    }


def chunk_sweep(spec: MoESpec, *, ep: int, tokens: int, chunks: list[int], iters: int = 20,
                step: Callable[[int, int, int, Outcome], None] = lambda i, n, c, o: None) -> list[tuple[int, Outcome]]:
    """The layer time against chunk rows (the overlap granularity), the rest at the defaults, on
    this GPU (EP > 1: one rank's local work, as tune)."""
    work, rows = _workload(spec, ep, tokens, distributed=False)
    base = default_candidate(work)
    build_candidates(work, [base])
    timer = _layer_timer(work, rows, iters)
    out = []
    for i, chunk in enumerate(chunks):
        c = dataclasses.replace(base, chunk_rows=chunk)
        try:
            o = Outcome(timer(c), None)
        except Exception as err:
            o = Outcome(None, _one_line(err))
        out.append((chunk, o))
        step(i, len(chunks), chunk, o)
    return out
