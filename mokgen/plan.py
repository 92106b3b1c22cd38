"""Plan: spec + target -> compile-time constants, derived figures, the build name and cache key.

Pure: no torch, no nvcc, no Jinja. The build stage passes the toolchain facts (nvcc and CUTLASS
versions, flags) and the digest of the template sources into :func:`cache_key`; this module only
hashes them. ``build_name`` is the one function that formats a build's readable name.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from mokgen._version import __version__
from mokgen.errors import PlanError
from mokgen.spec import MoESpec

#: bump when the C ABI of the launcher library changes (load checks it)
ABI_VERSION = 7

#: filename-safe tags of the numerics (CONVENTIONS.md: one table, used by build_name)
DTYPE_TAGS = {"bf16": "bf16", "mxfp8": "mxfp8"}
#: numerics the megakernel implements: bf16, and mxfp8 (rows as E4M3 codes + E8M0 scales through the
#: dispatch; the Hopper core's flow schedule without the fused shared expert, in the form of
#: Plan.mx_form, chosen with the cluster by default_mx_form; its backward is the staged MXFP8
#: experts', mokgen.ep._MXTraining)
IMPLEMENTED_NUMERICS = ("bf16", "mxfp8")
#: filename-safe tags of the architectures
ARCH_TAGS = {"sm_90a": "sm90a"}

BF16_BYTES = 2
#: elements per MXFP8 scale (OCP MX): a row of n elements is n E4M3 codes plus n / 32 E8M0 scales
MX_BLOCK = 32


def row_bytes(n: int, numerics: str = "bf16") -> int:
    """Bytes of n elements as a row in ``numerics``: bf16 ``2 n``; mxfp8 ``n`` codes plus ``n / 32``
    scales (0.516x bf16)."""
    if numerics == "bf16":
        return n * BF16_BYTES
    if numerics == "mxfp8":
        return n + n // MX_BLOCK
    raise ValueError(f"numerics must be bf16 or mxfp8, got {numerics!r}")


def build_name(spec: "MoESpec | Plan") -> str:
    """The readable name of a build, e.g. ``moe_kimi-k2.5_bf16_h7168_i2048_e384_k8_sm90a``.
    The only function that formats build names; takes a spec or a plan."""
    if isinstance(spec, Plan):
        p = spec
        return (f"moe_{p.spec_name}_{DTYPE_TAGS[p.numerics]}_h{p.hidden_size}_i{p.intermediate_size}"
                f"_e{p.num_experts}_k{p.top_k}_{ARCH_TAGS[p.arch]}")
    t = spec.target
    return (
        f"moe_{spec.name}_{DTYPE_TAGS[t.numerics]}_h{spec.hidden_size}_i{spec.moe_intermediate_size}"
        f"_e{spec.num_experts}_k{spec.top_k}_{ARCH_TAGS[t.arch]}"
    )


def op_identifier(name: str) -> str:
    """A Python/C identifier for a build name (torch.library op names allow no '-' or '.')."""
    return re.sub(r"[^0-9A-Za-z_]", "_", name)


class Plan(BaseModel):
    """Compile-time constants of one build. Every field here goes into the cache key."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec_name: str
    numerics: str
    arch: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    clamp_limit: float | None
    max_tokens_per_rank: int
    # GEMM core and tiles (the tuner will choose these later). "wgmma": TMA + wgmma, one producer
    # and two consumer warpgroups (sm_90a); "mma_sync": cp.async + mma.sync, the portable core.
    gemm_core: str = "wgmma"
    gemm_block_m: int = 128
    gemm_block_n_up: int = 128     # output columns of an up-projection tile (B tile: gate + up rows)
    gemm_block_n_down: int = 256
    gemm_block_k: int = 64
    gemm_stages: int = 4
    # Compute schedule of the megakernel. "flow": one tile order over all chunks, a down tile
    # waits only for its row block's up tiles (Hopper core); "phased": per chunk, up tiles, a
    # barrier of all compute CTAs, down tiles, a barrier (the only one of the portable core).
    schedule: str = "flow"
    # CTAs per cluster (flow schedule of the Hopper core only): 2 pairs compute CTAs whose tiles
    # share an operand, loaded once by TMA multicast into both (hopper_gemm.cuh); 1 runs them
    # alone. make_plan's default is default_cluster(spec): pairs for hidden sizes from
    # CLUSTER_MIN_HIDDEN (docs/perf-notes.md, v0.6).
    gemm_cluster: int = 1
    # The shared expert inside the megakernel (its tiles first in the flow order, on the rank's
    # own tokens; the combine adds it): for one shared expert of the routed experts' size, under
    # the flow schedule, CTAs alone or in pairs. make_plan fuses it wherever can_fuse_shared allows
    # (v0.6: the qwen3.5 blocks 3-14% faster over two runs; docs/perf-notes.md).
    fuse_shared: bool = False
    # Dispatch copy: 16-byte loads in flight per lane of a dispatch warp (ep_forward.cuh). 12 by
    # default (6 KB per warp; 16 spills on kimi-k2.5); 8 was the v0.3-v0.4 copy's.
    pull_unroll: int = 12
    # Dispatch copy engine: "copy" (16-byte loads and stores by every thread of the CTA) or
    # "bulk" (one thread per CTA drives TMA bulk copies through shared memory, bulk_copy.cuh;
    # Hopper core only).
    pull_mode: str = "copy"
    # Dispatch CTAs that have pulled their last chunk go on as compute CTAs, claiming tiles like
    # the others (ep_forward.cuh, kJoin): no SM idles from the last chunk's landing to the end of
    # the compute. Flow schedule of the Hopper core only (the phased one deals tiles to a fixed
    # set of CTAs).
    dispatch_join: bool = False
    # Consumer warpgroup 1 starts its first tile this many k-blocks after warpgroup 0 (then the
    # two stay that far apart, so one's epilogue overlaps the other's k-loop; hopper_gemm.cuh
    # StaggerPipe). 0: lockstep. BF16 builds on the Hopper core's flow schedule only.
    gemm_stagger: int = 0
    # MXFP8 builds' form (ep_forward.cuh CfgMxCodes / CfgMxExpand; docs/architecture.md): "codes"
    # (the ring holds E4M3 codes and scales, the tiles are mx_tile.cuh's MxTile, which decodes A in
    # its consumers) or "expand" (the pull writes the rows' bf16 MX values into the ring, h is
    # stored as its MX values in bf16, the tiles are the bf16 HopperTiles: the same bits, v0.57).
    # "codes" for bf16 plans.
    mx_form: str = "codes"
    # MXFP8 builds' weights (v0.68): "values" (the launch takes their MX values, converted by
    # mokgen.mx_gemm.expert_weights before it and cached per version) or "raw" (the launch takes the
    # bf16 weights and each stage's B is quantized in shared memory by the tiles' consumers,
    # mx_tile.cuh MxQuantB: the same values, no conversion pass; the expanded form only). "values"
    # for bf16 plans.
    mx_fwd_weights: str = "values"
    # router selection (router.cuh), from spec.routing
    router_scoring: str = "softmax"
    router_bias: bool = False
    router_n_group: int = 1
    router_topk_group: int = 1
    router_group_score: str = "top2_sum"
    abi_version: int = ABI_VERSION

    @property
    def name(self) -> str:
        return build_name(self)

    @property
    def clamp_limit_literal(self) -> str:
        """The clamp limit as a C float literal (0.0f when there is no clamp)."""
        value = 0.0 if self.clamp_limit is None else float(self.clamp_limit)
        return f"{value!r}f"

    def compile_fields(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


GEMM_CORES = ("wgmma", "mma_sync")
SCHEDULES = ("flow", "phased")
CLUSTERS = (1, 2)
BLOCK_KS = (64, 32)
PULL_UNROLLS = (12, 16, 8)
PULL_MODES = ("copy", "bulk")
#: the consumers' stagger leads a plan takes (k-blocks; below every core's 4 stages, and within
#: a down tile's k-blocks: the bundled specs' smallest is 8)
STAGGERS = (0, 1, 2, 3)
#: MXFP8 builds' forms (Plan.mx_form)
MX_FORMS = ("codes", "expand")
#: MXFP8 builds' weights (Plan.mx_fwd_weights)
MX_FWD_WEIGHTS = ("values", "raw")


#: hidden size from which CTA pairs (gemm_cluster 2) are the default. Measured on the H200 (v0.6,
#: docs/perf-notes.md): pairs 9-18% faster on the local work of kimi-k2.5, glm-5.2 and
#: deepseek-v4-pro (hidden 6144-7168) and 11-13% at EP4; level on deepseek-v3 EP64; 6% slower on
#: qwen3.5-397b-a17b's (hidden 4096) and 3% on the qwen3.5-35b-a3b layer (2048).
CLUSTER_MIN_HIDDEN = 5120


def default_cluster(spec: MoESpec, gemm_core: str = "wgmma", schedule: str = "flow") -> int:
    """CTAs per cluster when the caller does not choose: 2 on the Hopper core's flow schedule for
    hidden sizes from CLUSTER_MIN_HIDDEN, else 1."""
    return 2 if gemm_core == "wgmma" and schedule == "flow" and spec.hidden_size >= CLUSTER_MIN_HIDDEN else 1


def default_mx_form(spec: MoESpec, cluster: int | None, mx_form: str | None) -> tuple[int, str]:
    """An MXFP8 build's (CTAs per cluster, form) where the caller leaves either to the plan (None).
    The expanded form in CTA pairs where the BF16 rule pairs (hidden from CLUSTER_MIN_HIDDEN),
    else MxTile's codes in single CTAs. Measured on an H100 against codes in single CTAs (docs/
    perf-notes.md v0.58): expanded pairs 0.956 (kimi-k2.5 local), 0.898 (deepseek-v3 local);
    MxTile in pairs 4-8% slower than alone (v0.55, v0.56), the expanded form alone 1.24x slower on
    kimi-k2.5 (v0.57). A form without a cluster takes its own: pairs only for the expanded form
    where the BF16 rule pairs; a cluster without a form takes the form that measured best there."""
    pairs = default_cluster(spec) == 2
    if mx_form is None:
        mx_form = "expand" if (pairs if cluster is None else cluster == 2) else "codes"
    if cluster is None:
        cluster = 2 if mx_form == "expand" and pairs else 1
    return cluster, mx_form


def make_plan(spec: MoESpec, *, gemm_core: str = "wgmma", schedule: str = "flow", cluster: int | None = None,
              fuse_shared: bool | None = None, block_k: int = 64, pull_unroll: int = 12,
              pull_mode: str = "copy", dispatch_join: bool = True, stagger: int = 0,
              mx_form: str | None = None, mx_fwd_weights: str = "values") -> Plan:
    """Plan the build of ``spec`` for its target. Raises PlanError for what cannot be built yet.
    The portable core has only the phased schedule (``schedule`` is ignored for it); clusters
    of two need the Hopper core's flow schedule (``cluster`` is 1 otherwise; None:
    ``default_cluster``); ``fuse_shared`` applies where ``can_fuse_shared`` says so (False
    otherwise; None: wherever it can); ``block_k`` 32 gives the Hopper
    core 9 stages of 24 KB (64-byte rows) instead of 4 of 48 KB (ignored by the portable core);
    ``pull_unroll``: 16-byte loads in flight per lane of the dispatch copy; ``pull_mode``: the
    dispatch's copy engine ("bulk": TMA bulk copies, Hopper core only); ``dispatch_join``: dispatch
    CTAs compute after their last pull (the Hopper core's flow schedule only; False otherwise);
    ``stagger``: the consumer warpgroups' lead in k-blocks (the Hopper core's flow schedule only,
    0 otherwise; not for mxfp8). Numerics mxfp8: the Hopper core's flow schedule with k-blocks
    of 64 and the copy dispatch, no fused shared expert; ``mx_form`` its form (MX_FORMS: "codes" or
    "expand"; ignored for bf16), and with ``cluster`` and ``mx_form`` None, ``default_mx_form``;
    ``mx_fwd_weights`` (MX_FWD_WEIGHTS, ignored for bf16) "raw" needs the expanded form (with
    ``mx_form`` None it takes it)."""
    for option, value, allowed in (("gemm_core", gemm_core, GEMM_CORES), ("schedule", schedule, SCHEDULES),
                                   ("block_k", block_k, BLOCK_KS), ("pull_unroll", pull_unroll, PULL_UNROLLS),
                                   ("cluster", cluster, CLUSTERS), ("pull_mode", pull_mode, PULL_MODES),
                                   ("stagger", stagger, STAGGERS), ("mx_form", mx_form, MX_FORMS),
                                   ("mx_fwd_weights", mx_fwd_weights, MX_FWD_WEIGHTS)):
        if value not in allowed and not (option in ("cluster", "mx_form") and value is None):
            raise PlanError(f"{spec.name}: {option} must be one of {', '.join(map(str, allowed))}, got {value!r}")
    if pull_mode == "bulk" and gemm_core != "wgmma":
        raise PlanError(f"{spec.name}: pull_mode bulk needs the Hopper core (gemm_core wgmma), got {gemm_core}")
    if spec.target.numerics == "mxfp8":
        for option, value, want in (("gemm_core", gemm_core, "wgmma"), ("schedule", schedule, "flow"),
                                    ("block_k", block_k, 64), ("pull_mode", pull_mode, "copy")):
            if value != want:
                raise PlanError(f"{spec.name}: numerics mxfp8 needs {option} {want}, got {value!r}")
        if stagger:
            raise PlanError(f"{spec.name}: numerics mxfp8 runs its consumers in lockstep (stagger 0), got {stagger}")
        if mx_fwd_weights == "raw":
            if mx_form == "codes":
                raise PlanError(f"{spec.name}: mx_fwd_weights raw needs mx_form expand (the bf16 tiles quantize "
                                f"the weights), got mx_form codes")
            mx_form = "expand"
        cluster, mx_form = default_mx_form(spec, cluster, mx_form)
        fuse_shared = False
    if stagger and gemm_core == "wgmma" and schedule == "flow":
        k_blocks = min(spec.hidden_size, spec.moe_intermediate_size) // block_k
        if stagger > k_blocks:
            raise PlanError(f"{spec.name}: stagger {stagger} exceeds a tile's {k_blocks} k-blocks "
                            f"(K = min(hidden, intermediate) / block_k {block_k})")
    if cluster is None:
        cluster = default_cluster(spec, gemm_core, schedule)
    if fuse_shared is None:
        fuse_shared = True
    t = spec.target
    if t.numerics not in IMPLEMENTED_NUMERICS:
        raise PlanError(
            f"{spec.name}: target.numerics {t.numerics!r} is declared but not implemented yet "
            f"(implemented: {', '.join(IMPLEMENTED_NUMERICS)})"
        )
    if t.arch not in ARCH_TAGS:
        raise PlanError(f"{spec.name}: target.arch {t.arch!r} is not supported (supported: {', '.join(ARCH_TAGS)})")
    plan = Plan(
        spec_name=spec.name,
        numerics=t.numerics,
        arch=t.arch,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.moe_intermediate_size,
        num_experts=spec.num_experts,
        top_k=spec.top_k,
        clamp_limit=spec.activation.clamp_limit,
        max_tokens_per_rank=t.max_tokens_per_rank,
        **_tiles(spec, gemm_core, block_k),
        schedule=schedule if gemm_core == "wgmma" else "phased",
        gemm_cluster=cluster if gemm_core == "wgmma" and schedule == "flow" else 1,
        fuse_shared=bool(fuse_shared) and can_fuse_shared(spec, gemm_core, schedule, cluster),
        pull_unroll=pull_unroll,
        pull_mode=pull_mode,
        dispatch_join=bool(dispatch_join) and gemm_core == "wgmma" and schedule == "flow",
        gemm_stagger=stagger if gemm_core == "wgmma" and schedule == "flow" else 0,
        mx_form=mx_form if t.numerics == "mxfp8" else "codes",  # resolved above for mxfp8
        mx_fwd_weights=mx_fwd_weights if t.numerics == "mxfp8" else "values",
        router_scoring=spec.routing.scoring,
        router_bias=spec.routing.score_correction_bias,
        router_n_group=spec.routing.n_group,
        router_topk_group=spec.routing.topk_group,
        router_group_score=spec.routing.group_score,
    )
    return plan


#: dynamic shared memory a megakernel CTA may use: sm_90's 227 KB less 4 KB kept for the
#: kernel's static part (the kernel's own static_assert, ep_forward.cuh, is the authority)
SMEM_LIMIT = 227 * 1024 - 4096


def smem_bytes(plan: Plan) -> int:
    """Dynamic shared memory per CTA of ``plan``'s megakernel, as EpForward::kSmemBytes computes
    it (ep_forward.cuh, hopper_gemm.cuh, grouped_gemm.cuh): the GEMM stage ring (both tile kinds
    step through one ring with the larger stage) or the routing prologue's histograms."""
    if plan.gemm_core == "wgmma" and plan.numerics == "mxfp8" and plan.mx_form == "codes":  # E4M3 A, bf16 B, A scales
        # the scales' box of 132 rows (mx_tile.cuh kScaleBoxRows) and the shift word's 16 bytes
        stride = (128 * 64 + max(256, plan.gemm_block_n_down) * 64 * 2 + 132 * 4 + 16 + 1023) // 1024 * 1024
        gemm, threads = plan.gemm_stages * stride + 2 * plan.gemm_stages * 8 + 1024, 384
    elif plan.gemm_core == "wgmma":  # bf16, and mxfp8's expanded form (the bf16 HopperTiles)
        stride = (128 + max(256, plan.gemm_block_n_down)) * plan.gemm_block_k * 2
        gemm, threads = plan.gemm_stages * stride + 2 * plan.gemm_stages * 8 + 1024, 384
    else:
        gemm, threads = plan.gemm_stages * (128 + 128) * 64 * 2, 256
    return max(gemm, threads // 32 * plan.num_experts * 4)


def can_fuse_shared(spec: MoESpec, gemm_core: str = "wgmma", schedule: str = "flow", cluster: int = 1) -> bool:
    """Whether the megakernel can run ``spec``'s shared expert: one shared expert with the
    routed experts' intermediate size (its tiles reuse the routed tile types), on the Hopper
    core's flow schedule, CTAs alone or in pairs (its pair-tiles share operands as the routed
    ones do; ``cluster`` is kept for callers)."""
    se = spec.shared_experts
    return (se.count == 1 and se.intermediate_size == spec.moe_intermediate_size and gemm_core == "wgmma"
            and schedule == "flow" and cluster in (1, 2))


def _tiles(spec: MoESpec, gemm_core: str, block_k: int = 64) -> dict[str, Any]:
    """Tile shapes per core. wgmma: 128-row tiles, up tiles of 128 output columns (256 B rows),
    down tiles of 256 columns when the hidden size allows, else 128; k-blocks of 64 in 4 stages
    of 48 KB (3 loading, 144 KB, while the consumers compute on one), or of 32 in 9 stages of
    24 KB (216 KB of the 227 KB: 8 loading, 192 KB; v0.5 measured 8 stages of 24 KB, the same
    144 KB loading as 4 x 48, 2-9% slower). mma_sync: 128 x 64 up / 128 x 128 down tiles, 3 stages."""
    if gemm_core == "wgmma":
        down = 256 if spec.hidden_size % 256 == 0 else 128
        return {"gemm_core": "wgmma", "gemm_block_n_up": 128, "gemm_block_n_down": down, "gemm_block_k": block_k,
                "gemm_stages": 4 if block_k == 64 else 9}
    return {"gemm_core": "mma_sync", "gemm_block_n_up": 64, "gemm_block_n_down": 128, "gemm_stages": 3}


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def cache_key(plan: Plan, *, sources_digest: str, toolchain: dict[str, Any]) -> str:
    """Content key of a build: plan fields, template/header contents, mokgen version, toolchain
    (nvcc and CUTLASS versions, arch, flags). Any change to one of them changes the key."""
    payload = {
        "plan": plan.compile_fields(),
        "sources": sources_digest,
        "mokgen": __version__,
        "toolchain": toolchain,
    }
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


# ---- derived figures -------------------------------------------------------------------------


def figures(spec: MoESpec, *, ep: int = 1, tokens: int | None = None) -> dict[str, Any]:
    """FLOPs and bytes of the layer, and per-rank buffer sizes for ``ep`` ranks with ``tokens``
    tokens per rank (default: the target's maximum). Uniform routing is assumed for the
    expected received rows; the worst case is listed beside it."""
    if ep < 1:
        raise PlanError(f"{spec.name}: ep must be >= 1, got {ep}")
    if spec.num_experts % ep:
        raise PlanError(f"{spec.name}: ep ({ep}) must divide num_experts ({spec.num_experts})")
    if ep > spec.target.max_ep_ranks:
        raise PlanError(f"{spec.name}: ep ({ep}) exceeds target.max_ep_ranks ({spec.target.max_ep_ranks})")
    T = spec.target.max_tokens_per_rank if tokens is None else tokens
    if T < 0 or T > spec.target.max_tokens_per_rank:
        raise PlanError(
            f"{spec.name}: tokens ({T}) must be in 0..target.max_tokens_per_rank ({spec.target.max_tokens_per_rank})"
        )
    H, I, E, K = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.top_k
    sh = spec.shared_experts
    routed_flops = 6 * K * H * I
    shared_flops = 6 * sh.count * H * sh.intermediate_size
    nx = spec.target.numerics
    expert_bytes = 3 * row_bytes(H * I, nx)  # routed weights in the target's numerics (MXFP8: codes + scales)
    per_rank_experts = E // ep
    expected_rows = T * K  # each rank receives, on average, as many pairs as it sends
    return {
        "spec": spec.name,
        "ep": ep,
        "tokens_per_rank": T,
        "flops_per_token_routed_fwd": routed_flops,
        "flops_per_token_shared_fwd": shared_flops,
        "flops_per_token_fwd": routed_flops + shared_flops,
        # rows travel in the target's numerics (MXFP8: quantized on dispatch); the combine is BF16
        "bytes_dispatched_per_token": K * row_bytes(H, nx),
        "dispatch_bytes_vs_bf16": row_bytes(H, nx) / row_bytes(H, "bf16"),
        "routing_bytes_per_token": K * (4 + 4),
        "expert_weight_bytes": expert_bytes,
        "routed_weight_bytes_total": E * expert_bytes,
        "shared_weight_bytes": sh.count * 3 * H * sh.intermediate_size * BF16_BYTES,
        "local_experts": per_rank_experts,
        "routed_weight_bytes_per_rank": per_rank_experts * expert_bytes,
        "buffers_per_rank": {
            "x_send": T * row_bytes(H, nx),
            "routing": T * K * 8,
            "combine_slots": T * K * H * BF16_BYTES,
            "expected_rows": expected_rows,
            # every rank's tokens may pick this rank, each with at most min(k, local experts) pairs
            "worst_case_rows": T * ep * min(K, per_rank_experts),
            "intermediate_expected": expected_rows * row_bytes(I, nx),
        },
    }


def ep_defaults(spec: MoESpec) -> dict[str, int]:
    """Run-time defaults of the megakernel's ring: ``chunk_rows`` (received rows per compute
    batch) and ``ring_chunks`` (slots of the receive ring). A chunk should give the up projection
    about two waves of 128 x 128 tiles on a 132-SM GPU: 256 tiles over I / 128 column tiles, in
    128-row steps, clamped to [1024, 8192]. The tuner will replace this guess with measurements."""
    n_tiles = max(1, spec.moe_intermediate_size // 128)
    rows = 128 * -(-256 // n_tiles)
    return {"chunk_rows": max(1024, min(8192, rows)), "ring_chunks": 4}
