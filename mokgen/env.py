"""Every environment switch mokgen reads, in one place (the README lists the same table).

All share the ``MOKGEN_`` prefix. Read them through these functions, never with ``os.environ``
elsewhere, so the list below stays complete.
"""

from __future__ import annotations

import os
from pathlib import Path

#: name -> one-line description (shown by ``mokgen doctor`` and documented in the README)
SWITCHES: dict[str, str] = {
    "MOKGEN_CACHE_DIR": "root of the build cache (default: ~/.cache/mokgen, or $XDG_CACHE_HOME/mokgen)",
    "MOKGEN_GENERATED_DIR": "where `mokgen render/build` write readable sources (default: ./generated)",
    "MOKGEN_DISABLE_JIT": "1: never compile at run time; a missing build is an error",
    "MOKGEN_VERBOSE": "1: print nvcc command lines and cache decisions",
    "MOKGEN_NVCC": "path of the nvcc to use (default: $CUDA_HOME/bin/nvcc, then nvcc on PATH)",
    "MOKGEN_CUTLASS_DIR": "CUTLASS include directory (default: the nvidia-cutlass package's headers)",
    "MOKGEN_BUILD_TIMEOUT": "seconds before an nvcc run is abandoned (default: 900)",
    "MOKGEN_GEMM_CORE": "wgmma (default: TMA + wgmma, sm_90a) or mma_sync (portable reference core)",
    "MOKGEN_SCHEDULE": "flow (default: tiles flow across chunks, per-block dependencies) or phased (barriers per chunk phase)",
    "MOKGEN_FUSE_SHARED": "1 or 0: the shared expert inside the megakernel where the plan allows, or in PyTorch (default: inside wherever the plan allows)",
    "MOKGEN_PULL_UNROLL": "12 (default), 16 or 8: 16-byte loads in flight per lane of the dispatch copy",
    "MOKGEN_MX_FORM": "codes or expand (default: expand in CTA pairs where the plan pairs BF16 builds, else codes in single CTAs): an MXFP8 build's ring as E4M3 codes decoded in the tiles, or as the rows' bf16 MX values multiplied by the bf16 tiles (the same bits)",
    "MOKGEN_PULL_MODE": "copy (default: 16-byte loads and stores by every dispatch thread) or bulk (TMA bulk copies through shared memory) for the dispatch's row copy",
    "MOKGEN_DISPATCH_JOIN": "1 (default) or 0: dispatch CTAs go on computing tiles after their last pull (flow schedule), or idle until the combine",
    "MOKGEN_BLOCK_K": "64 (default: 4 stages of 48 KB) or 32 (9 stages of 24 KB) for the Hopper core's k-blocks",
    "MOKGEN_FWD_STAGGER": "0 (default: lockstep) to 3: the forward megakernel's consumer warpgroup 1 starts its tiles this many k-blocks after warpgroup 0, so one's epilogue overlaps the other's wgmma (BF16 builds, flow schedule; a build option the tuner also tries; lead 2 measured 0.993x the qwen3.5-35b-a3b layer's forward time on an H100, v0.47). The same bits at every value",
    "MOKGEN_CLUSTER": "1 (every CTA loads its own operands) or 2 (flow-schedule CTA pairs share one by TMA multicast); default: 2 for hidden sizes from 5120, else 1",
    "MOKGEN_TUNED_DIR": "where `mokgen tune` writes tuned parameters, looked up before the package's own (default: <cache dir>/tuned)",
    "MOKGEN_TUNED": "0: ignore tuned parameters (the plan's defaults and these switches only; default 1)",
    "MOKGEN_BWD_GEMM": "1 (default) or 0: the experts' backward runs its GEMMs on mokgen's Hopper kernels (mokgen/bwd_gemm.py) where they run (sm_90, H and I multiples of 256), or on torch._grouped_mm",
    "MOKGEN_BWD_CLUSTER": "1 (default) or 2: the backward's weight-gradient GEMMs run as single CTAs, or as CTA pairs that load the shared operand once by TMA multicast (the same bits)",
    "MOKGEN_BWD_ROWS_CLUSTER": "auto (default: CTA pairs where N >= 4096, so dx on the hidden sizes from 4096), 1 or 2: the backward's rows GEMMs (dh and dx) run as single CTAs, or as CTA pairs computing two column tiles of one row block that load the A rows once by TMA multicast (the same bits)",
    "MOKGEN_BWD_WEIGHTS": "auto (default), split or pingpong: the backward's weight-gradient GEMMs in 128 x 256 tiles split between the two consumer warpgroups, or in 128 x 128 tiles, each one warpgroup's, the two taking turns; auto: the split, except under MOKGEN_BWD_TAIL=zero the ping-pong where the experts' mean rows are at most 384 and no operand is read through the token index (the same bits)",
    "MOKGEN_BWD_TAIL": "auto (default), tma, steps or zero: how the backward's weight-gradient GEMMs keep the next expert's rows out of a tile's short last k-block: per-expert copies of the operands' tensor maps that end at the expert's last row, so the TMA loads zeros past it and the k-block runs as a full one (tma), the same maps with the split tiles' k-block running only its 16-row steps that hold expert rows, peeled with no drain (steps), or the consumers zero those rows in shared memory and run the k-block alone, drained (zero); auto: steps for the split tiles, zero for the ping-pong (measured, bwd_gemm.TAIL_AUTO). The same bits",
    "MOKGEN_BWD_WEIGHTS_JOINT": "1 (default) or 0: the gate's and up's weight gradients (both over the x rows) in one launch whose tiles walk an expert's x rows together so they are read from memory once, or in two launches (split schedule only; the same bits)",
    "MOKGEN_BWD_OVERLAP": "auto (default) or 0: an experts backward runs its dW_down launch on a second stream beside the joint dW_gate / dW_up launch where the two launches' tiles fit on the SMs together (a one-expert backward such as the fused shared expert's), or always one after the other (0). The same bits",
    "MOKGEN_BWD_STAGGER": "0 to 3 (default 3): the lead in k-blocks of the backward GEMMs' first consumer warpgroup over the second (its epilogue overlaps the other's wgmma); 0: lockstep. For the ping-pong weight gradients: how many k-blocks before its last one a warpgroup hands the turn over. The same bits at every value",
    "MOKGEN_BWD_DX_PAIRS": "bf16 (default) or fp32: where a token has several pairs, mokgen's backward GEMMs write each pair's dx row rounded to bf16 (as the forward's combine slots and the rows that come back across GPUs) or in fp32, before the fixed-order fp32 sum over the token's slots",
    "MOKGEN_BWD_DH": "bf16 (default) or fp32: under the save policy, mokgen's dh GEMM (dOut through the down projection) writes its rows rounded to bf16, as torch._grouped_mm's would be, or in fp32, for SwiGLU's backward to read",
    "MOKGEN_BWD_RING": "auto (default), reuse or gather: a one-rank MoELayer's backward reads the x rows of its pairs in place from the forward's receive ring where the ring still holds all of them (auto), also sizes its ring to hold max_tokens x top_k rows so that it does (reuse), or always gathers them again (gather)",
    "MOKGEN_BWD_DOUT": "auto (default), inline or gather: mokgen's backward GEMMs that read dOut by routed pair (dh = dOut Wd, dW_down = dOut^T hw) load its rows through the token index themselves (inline: no copy; with the split weight schedule, single CTAs), or read a gathered copy of them in the pairs' order (gather); auto: inline where a token has several routed pairs (the single-GPU layer), gather for one pair per row (an EP rank's received rows). The same bits",
    "MOKGEN_BWD_X": "auto (default), inline or gather: where the backward's x rows are not in the forward's ring (MOKGEN_BWD_RING), the save policy's joint gate/up weight gradients load x's rows through the token index themselves (inline: no copy, single CTAs; v0.25), or read a gathered copy of them (gather); auto: inline where a token has several routed pairs (the single-GPU layers), gather for one pair per row (an EP rank's received rows). The same bits",
    "MOKGEN_BWD_SUM": "side (default) or apart: where a token has several routed pairs, dX's fixed-order sum over its slots runs inside the joint dW_gate / dW_up launch where that launch loads B by TMA (the x rows in the forward's ring or a gathered copy), by its producer warpgroup's idle warps while its tensor cores run (side; elsewhere, and under apart, as a launch of its own after the weight gradients). The same bits. Measured (v0.47, H100, interleaved): the fwd+bwd step 0.9835x on the qwen3.5-35b-a3b layer, 0.9869x on qwen3-30b-a3b's",
    "MOKGEN_BWD_DH_SWIGLU": "1: under the save policy, SwiGLU's backward in the dh GEMM's epilogue (bwd_gemm.dh_swiglu_saved; dOut's rows through the token index where MOKGEN_BWD_DOUT takes it) instead of dh rows then an elementwise pass; 0 (default): the two passes, measured faster (docs/perf-notes.md v0.24). hw, dg and du from the fp32 dh (the two passes round dh to bf16 first under MOKGEN_BWD_DH=bf16)",
    "MOKGEN_BWD_FUSED": "1: the save policy's experts backward (dh, SwiGLU's backward, dx and the three weight gradients) as one persistent launch (bwd_gemm.fused_backward, v0.23) instead of five; 0 (default): the separate launches. The same bits. Reads a gathered copy of dOut's rows (MOKGEN_BWD_DOUT does not apply)",
    "MOKGEN_BWD_FUSED_CHUNK": "rows per group of the fused backward's order (default 8192): a group's dh tiles, then (MOKGEN_BWD_FUSED_LAG groups later) its dx and weight tiles",
    "MOKGEN_BWD_FUSED_LAG": "groups between a group's dh tiles and its dx and weight tiles in the fused backward's order, 1 to 8 (default 3)",
    "MOKGEN_MX_WEIGHTS": "apart (default) or both: an MXFP8 training step quantizes its weights in the forward's orientation in the forward and transposed in the backward, a kernel each, or both orientations in the forward from one read of the weights (mx_gemm.expert_weights_both, v0.43). The staged experts (mokgen.mx_experts.experts_forward_train, bf16-math form) hold the transposed copies until the backward; the MXFP8 layer (v0.65) caches them beside the forward's conversions, per weight version, so the micro-batches of one optimizer step convert nothing (the layer then holds its weights' memory three times). The same bits",
    "MOKGEN_MX_BAND": "1 to 65535 (default 8): the MXFP8 bf16-math GEMM's grouped launches (mokgen.mx_gemm: the staged experts' forward and dgrads) walk their row tiles in bands of this many, column tile by column tile within a band, so the CTAs sharing a column tile of B start together and read it from DRAM about once per band (v0.43); 1: the grid's order, a row tile's column tiles together (v0.42's). The dense and k-ranged launches keep the grid's order. The same bits",
    "MOKGEN_MX_QUANT": "v2 (default since v0.41) or v1: the kernel that quantizes MXFP8 weights and activations along their rows, transposed (mokgen.mx_gemm.expert_weights with transpose, cols_bf16_math): v2 v0.40's 128 x 64 tiles through shared memory, v1 one thread per 32-element block (v0.35). The same bits; v2 measured faster (README, docs/perf-notes.md v0.40-v0.41). (The quantizer along the rows, weight_rows_kernel, is one kernel: v0.39's alternative was retired in v0.41)",
    "MOKGEN_MX_BWD_STAGES": "fused (default) or torch: the MXFP8 backward's elementwise stages (mokgen.mx_experts: the combine's backward with dy's quantization, SwiGLU's backward with [dg | du]'s quantization, dx's sum over a token's pairs) as v0.40's two fused kernels with dx from the combine kernel (at k = 1 the dgrad GEMM's epilogue), or as PyTorch expressions and separate quantizers (v0.39; measured 1.13-1.31x slower). dy and the codes the same bits; the routing weights' gradient summed in a fixed order of its own, dg, du and h within an ulp or two",
    "MOKGEN_MX_WGRAD": "bf16 (default since v0.66) or ranged: the MXFP8 backward's weight gradients on the BF16 backward's weight kernels (mokgen.bwd_gemm.weight_grads and weight_grads_joint) over the operands' MX values as bf16 rows, each expert's rows padded to 32 instead of 128, or on the k-ranged bf16-math GEMM (mokgen.mx_gemm.mx_bf16_math_ranged_gemm, the token operand as E4M3 codes), which bf16 falls back to where mokgen.bwd_gemm does not take the shapes. The same products, summed in another order (not the same bits)",
    "MOKGEN_MX_FWD_WEIGHTS": "auto (default since v0.69), values or raw (v0.68): values: an MXFP8 megakernel build that takes the weights' MX values, converted before the launch by mx_gemm.expert_weights and cached per weight version; raw: one that takes the bf16 weights as the layer holds them and whose tiles quantize each stage's weights in shared memory (templates/include/mokgen/mx_tile.cuh MxQuantB), so no conversion runs when the weights change, at 1.46-1.68x the launch's time (measured on an H100, the weights kept); the expanded form only (raw takes it); the same MX values, so the same bits. auto: the values build, and a one-GPU MoELayer whose build is the expanded form also holds the raw build (the same buffers; mokgen build builds both) and launches it for launches autograd records with at most mokgen.ep.RAW_FWD_MAX_ROWS rows an expert on average where converting would not pay (mokgen.ep._raw_pays: the first training launch at a weight version, no conversion cached, one training launch at the previous version; micro-batches convert once). Measured on an H100 (v0.69), auto / values: the training step with the weights new every step 0.91x on kimi-k2.5 local (341 rows an expert), 0.99x at 512, 1.01x at 4096; with the weights kept and inference 1.00x",
    "MOKGEN_MX_DGRAD_WEIGHTS": "values (default, v0.66's way) or raw (v0.67; its GPU tests pass, but measured slower everywhere on an H100, 1.02-1.32x the MXFP8 step at 341-4096 rows an expert: the dgrads' in-kernel quantization costs more than the transposed conversion it spares): the MXFP8 backward's two dgrads read their weights' transposed MX values, written by a conversion kernel every step (mx_gemm.expert_weights with transpose), or read the bf16 weights as the layer holds them and quantize them along k in shared memory (mx_gemm.mx_bf16_math_raw_gemm, templates/include/mokgen/mx_rawb.cuh), writing no transposed copy. The same MX values; the sums may differ in the last bit (A's k order within each 16 differs)",
    "MOKGEN_MX_WGRAD_OPERANDS": "fused (default since v0.68: its GPU tests pass and it took the MXFP8 step 0.97x the time on kimi-k2.5 and deepseek-v3 local, an H100) or apart (v0.65's way): under MOKGEN_MX_WGRAD=bf16 and the fused elementwise stages, the weight gradients' operand values made by the stages themselves (dy's from dOut and the routing weights, h's, dg's and du's by the SwiGLU backward; no float32 copy of any written), or each by mokgen.mx_gemm.rows_values from the float32 rows the stages write. The same bits",
    "MOKGEN_MX_RANGED": "tiles (default) or persistent: the MXFP8 weight gradients' k-ranged bf16-math GEMM (mokgen.mx_gemm.mx_bf16_math_ranged_gemm) as a CTA per tile (v0.35), or v0.40's persistent kernel, a CTA per SM walking the tiles with its producer filling the next tile's stages during a tile's epilogue. The same bits; persistent measured 5% slower on the H100 (docs/perf-notes.md v0.40)",
    "MOKGEN_BWD_ROW_BAND": "1 to 4096 (default 8): the backward's rows GEMMs (dh, dx) walk each expert's row blocks in bands of this many, column tile by column tile within a band, so the CTAs sharing a column tile of the weights load it together and it comes from DRAM once per band (v0.43); 1: row block by row block (v0.42's order). The same bits at every band",
    "MOKGEN_BWD_POLICY": "save (default) or recompute: the forward keeps the up projection's pre-activations g and u (bf16, 4 I bytes per routed pair; an MXFP8 launch also a copy of each pair's expert output row, 2 H bytes) for the backward, or the backward recomputes them from x (4 T k H I more FLOPs; an MXFP8 layer runs the staged MXFP8 forward again)",
}


def _get(name: str) -> str | None:
    assert name in SWITCHES, f"undocumented switch {name}"
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _flag(name: str) -> bool:
    value = _get(name)
    return value is not None and value.strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    value = _get("MOKGEN_CACHE_DIR")
    if value:
        return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mokgen"


def generated_dir() -> Path:
    value = _get("MOKGEN_GENERATED_DIR")
    return Path(value).expanduser() if value else Path.cwd() / "generated"


def jit_disabled() -> bool:
    return _flag("MOKGEN_DISABLE_JIT")


def verbose() -> bool:
    return _flag("MOKGEN_VERBOSE")


def nvcc_override() -> str | None:
    return _get("MOKGEN_NVCC")


def cutlass_dir_override() -> str | None:
    return _get("MOKGEN_CUTLASS_DIR")


def build_timeout() -> float:
    value = _get("MOKGEN_BUILD_TIMEOUT")
    if not value:
        return 900.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        from mokgen.errors import ToolchainError

        raise ToolchainError(f"MOKGEN_BUILD_TIMEOUT must be a positive number of seconds, got {value!r}")
    return seconds


def _choice(name: str, allowed: tuple[str, ...]) -> str:
    """The value of switch ``name`` (default: allowed[0]); anything else is a ToolchainError."""
    value = _get(name) or allowed[0]
    if value not in allowed:
        from mokgen.errors import ToolchainError

        raise ToolchainError(f"{name} must be {' or '.join(allowed)}, got {value!r}")
    return value


def _int_switch(name: str, default: int, hi: int) -> int:
    """The value of integer switch ``name`` in 1..hi (default: ``default``); anything else is a
    ToolchainError."""
    value = _get(name)
    if value is None:
        return default
    if not value.isdigit() or not 1 <= int(value) <= hi:
        from mokgen.errors import ToolchainError

        raise ToolchainError(f"{name} must be an integer from 1 to {hi}, got {value!r}")
    return int(value)


def gemm_core() -> str:
    return _choice("MOKGEN_GEMM_CORE", ("wgmma", "mma_sync"))


def schedule() -> str:
    return _choice("MOKGEN_SCHEDULE", ("flow", "phased"))


def cluster() -> int | None:
    """MOKGEN_CLUSTER, or None (unset: the plan's default_cluster)."""
    return int(_choice("MOKGEN_CLUSTER", ("1", "2"))) if _get("MOKGEN_CLUSTER") else None


def bwd_cluster() -> int:
    """MOKGEN_BWD_CLUSTER: 1 (default) or 2, the weight-gradient GEMMs' CTAs per cluster."""
    return int(_choice("MOKGEN_BWD_CLUSTER", ("1", "2")))


def bwd_rows_cluster() -> int | None:
    """MOKGEN_BWD_ROWS_CLUSTER: 1 or 2, the backward's rows GEMMs' CTAs per cluster (2: column-tile
    pairs sharing the A rows), or None for auto (the default: mokgen.bwd_gemm.rows_cluster, by N)."""
    value = _choice("MOKGEN_BWD_ROWS_CLUSTER", ("auto", "1", "2"))
    return None if value == "auto" else int(value)


#: the weight-gradient GEMMs' default schedule (MOKGEN_BWD_WEIGHTS; docs/perf-notes.md v0.14, v0.28)
BWD_WEIGHTS_DEFAULT = "auto"


def bwd_weights() -> str:
    """MOKGEN_BWD_WEIGHTS: the weight-gradient GEMMs' schedule, "split" (128 x 256 tiles split
    between the two consumer warpgroups), "pingpong" (128 x 128 tiles, one warpgroup's each,
    taking turns) or "auto" (by the experts' rows: bwd_gemm.weight_schedule); default
    BWD_WEIGHTS_DEFAULT."""
    return _choice("MOKGEN_BWD_WEIGHTS", (BWD_WEIGHTS_DEFAULT, *(v for v in ("auto", "split", "pingpong")
                                                                 if v != BWD_WEIGHTS_DEFAULT)))


#: how the weight gradients' short last k-block leaves out the next expert's rows (MOKGEN_BWD_TAIL;
#: bwd_gemm.WEIGHT_TAILS)
BWD_TAIL_DEFAULT = "auto"


def bwd_tail() -> str:
    """MOKGEN_BWD_TAIL: "tma" (the TMA loads zeros past the expert's rows through per-expert
    bounded tensor maps), "steps" (those maps, and the split tiles' last k-block issues only its
    steps that hold expert rows), "zero" (the consumers zero them) or "auto" (per schedule,
    bwd_gemm.TAIL_AUTO); default BWD_TAIL_DEFAULT."""
    return _choice("MOKGEN_BWD_TAIL", (BWD_TAIL_DEFAULT, *(v for v in ("auto", "tma", "steps", "zero")
                                                          if v != BWD_TAIL_DEFAULT)))


#: the backward GEMMs' default stagger lead in k-blocks (MOKGEN_BWD_STAGGER; measured, docs/perf-notes.md v0.13)
BWD_STAGGER_DEFAULT = 3
#: the backward's rows GEMMs' bands of row blocks (MOKGEN_BWD_ROW_BAND; templates/bwd_gemm.cu g_band)
BWD_ROW_BAND_DEFAULT = 8
#: the MX bf16-math GEMM's grouped launches' bands of row tiles (MOKGEN_MX_BAND; templates/mx_gemm.cu g_mx_band)
MX_BAND_DEFAULT = 8


def bwd_stagger() -> int:
    """MOKGEN_BWD_STAGGER: the backward GEMMs' stagger, the lead of consumer warpgroup 0 in
    k-blocks: 0 (lockstep) to 3, default BWD_STAGGER_DEFAULT."""
    allowed = (str(BWD_STAGGER_DEFAULT), *(str(v) for v in range(4) if v != BWD_STAGGER_DEFAULT))
    return int(_choice("MOKGEN_BWD_STAGGER", allowed))


def bwd_row_band() -> int:
    """MOKGEN_BWD_ROW_BAND: the backward's rows GEMMs (dh, dx) walk an expert's row blocks in bands
    of this many, column tile by column tile within a band (default 8, v0.43); 1 is v0.42's order,
    row block by row block. The same bits at every band."""
    return _int_switch("MOKGEN_BWD_ROW_BAND", BWD_ROW_BAND_DEFAULT, 4096)


def fuse_shared() -> bool | None:
    """MOKGEN_FUSE_SHARED, or None (unset: fused wherever the plan allows)."""
    return _flag("MOKGEN_FUSE_SHARED") if _get("MOKGEN_FUSE_SHARED") else None


def block_k() -> int:
    return int(_choice("MOKGEN_BLOCK_K", ("64", "32")))


def fwd_stagger() -> int:
    """MOKGEN_FWD_STAGGER: the forward's consumer stagger lead in k-blocks, 0 (default) to 3."""
    return int(_choice("MOKGEN_FWD_STAGGER", ("0", "1", "2", "3")))


def pull_unroll() -> int:
    return int(_choice("MOKGEN_PULL_UNROLL", ("12", "16", "8")))


def pull_mode() -> str:
    return _choice("MOKGEN_PULL_MODE", ("copy", "bulk"))


def mx_form() -> str | None:
    """MOKGEN_MX_FORM: an MXFP8 build's form, ``codes`` or ``expand`` (plan.MX_FORMS), or None
    (unset: the plan's default_mx_form)."""
    return _choice("MOKGEN_MX_FORM", ("codes", "expand")) if _get("MOKGEN_MX_FORM") else None


def mx_fwd_weights() -> str:
    """MOKGEN_MX_FWD_WEIGHTS: ``auto`` (default since v0.69), ``values`` or ``raw`` (v0.68): an MXFP8
    megakernel build that takes the weights' MX values (converted before the launch, cached per
    version) or the bf16 weights, quantized by its tiles (plan.MX_FWD_WEIGHTS; the expanded form);
    ``auto`` builds the values one (plan_options), and a one-GPU MoELayer of the expanded form also
    loads the raw one and launches it for training launches with few rows an expert
    (mokgen.ep.RAW_FWD_MAX_ROWS) where converting would not pay (mokgen.ep._raw_pays: the first
    launch at a weight version, none cached, one launch at the previous version)."""
    return _choice("MOKGEN_MX_FWD_WEIGHTS", ("auto", "values", "raw"))


def mx_fwd_weights_auto() -> bool:
    """Whether MOKGEN_MX_FWD_WEIGHTS is ``auto`` (see mx_fwd_weights)."""
    return mx_fwd_weights() == "auto"


def dispatch_join() -> bool:
    """MOKGEN_DISPATCH_JOIN: 1 (default) or 0."""
    return _choice("MOKGEN_DISPATCH_JOIN", ("1", "0")) == "1"


def bwd_gemm_enabled() -> bool:
    """MOKGEN_BWD_GEMM: on unless set to 0 (measured faster than torch._grouped_mm on the H200, v0.10)."""
    return _get("MOKGEN_BWD_GEMM") is None or _flag("MOKGEN_BWD_GEMM")


def bwd_policy() -> str:
    """MOKGEN_BWD_POLICY: ``save`` (default) or ``recompute`` (mokgen.backward, "Save or recompute")."""
    return _choice("MOKGEN_BWD_POLICY", ("save", "recompute"))


def mx_quant() -> str:
    """MOKGEN_MX_QUANT: ``v2`` (default since v0.41, the column tiles) or ``v1`` (a thread per
    32-element block) for the MXFP8 column quantizer (mx_gemm._cols_entry); the same bits."""
    return _choice("MOKGEN_MX_QUANT", ("v2", "v1"))


def mx_weights() -> str:
    """MOKGEN_MX_WEIGHTS: ``apart`` (default) or ``both`` (v0.43): an MXFP8 training step's weights
    quantized in each orientation by a kernel of its own (the forward's along their rows, the
    backward's transposed), or both from one read in the forward, the transposed copies kept for
    the backward (mokgen.mx_experts; the MXFP8 layer caches them per weight version, v0.65:
    mokgen.ep._mx_both)."""
    return _choice("MOKGEN_MX_WEIGHTS", ("apart", "both"))


def mx_band() -> int:
    """MOKGEN_MX_BAND: the MXFP8 bf16-math GEMM's grouped launches walk their row tiles in bands of
    this many, column tile by column tile within a band (v0.43; default 8); 1: the grid's order.
    The same bits."""
    return _int_switch("MOKGEN_MX_BAND", MX_BAND_DEFAULT, 65535)


def mx_bwd_stages() -> str:
    return _choice("MOKGEN_MX_BWD_STAGES", ("fused", "torch"))


def mx_ranged() -> str:
    return _choice("MOKGEN_MX_RANGED", ("tiles", "persistent"))


def mx_wgrad() -> str:
    """MOKGEN_MX_WGRAD: ``bf16`` (default since v0.66) or ``ranged``: the MXFP8 backward's weight
    gradients on the BF16 backward's weight kernels (bwd_gemm.weight_grads, weight_grads_joint)
    over the operands' MX values as bf16 rows (mx_gemm.rows_values, v0.65), each expert's rows
    padded to 32 only; or on the k-ranged bf16-math GEMM (mx_gemm.mx_bf16_math_ranged_gemm, A as
    codes), which bf16 falls back to where mokgen.bwd_gemm does not take the shapes. The same
    products; the sums' order differs, so not the same bits. Measured (an H100, docs/perf-notes.md
    v0.66): bf16 0.90-0.99x the step's time at 341-4096 rows an expert."""
    return _choice("MOKGEN_MX_WGRAD", ("bf16", "ranged"))


def mx_dgrad_weights() -> str:
    """MOKGEN_MX_DGRAD_WEIGHTS: ``values`` (default) or ``raw`` (v0.67): where the MXFP8 backward's
    dgrads get their weights: the transposed MX values written by a conversion kernel each step,
    or the bf16 weights quantized inside the dgrad kernel (mx_gemm.mx_bf16_math_raw_gemm)."""
    return _choice("MOKGEN_MX_DGRAD_WEIGHTS", ("values", "raw"))


def mx_wgrad_operands() -> str:
    """MOKGEN_MX_WGRAD_OPERANDS: ``fused`` (v0.66; the default since v0.68, measured 0.97x the step
    on an H100) or ``apart`` (v0.65's way), how the MXFP8
    weight gradients on the BF16 weight kernels (MOKGEN_MX_WGRAD=bf16) get their operands' MX values
    under the fused elementwise stages: made by the SwiGLU backward (h, dg, du) and from dOut and
    the routing weights (dy), with no float32 copy of any written; or each by mx_gemm.rows_values
    from the float32 rows the stages write. The same bits."""
    return _choice("MOKGEN_MX_WGRAD_OPERANDS", ("fused", "apart"))


def bwd_dx_pairs() -> str:
    """MOKGEN_BWD_DX_PAIRS: ``bf16`` (default) or ``fp32``, the dtype of the per-pair dx rows that
    mokgen's backward sums over a token's slots (mokgen.backward)."""
    return _choice("MOKGEN_BWD_DX_PAIRS", ("bf16", "fp32"))


def bwd_ring() -> str:
    """MOKGEN_BWD_RING: ``auto`` (default), ``reuse`` or ``gather``, where a one-rank MoELayer's
    backward takes its pairs' x rows from (mokgen.ep.MoELayer's ``bwd_ring``)."""
    return _choice("MOKGEN_BWD_RING", ("auto", "reuse", "gather"))


def bwd_weights_joint() -> bool:
    """MOKGEN_BWD_WEIGHTS_JOINT: the gate's and up's weight gradients in one launch
    (bwd_gemm.weight_grads_joint; the default, the same bits, 0.2% faster fwd+bwd in v0.21) or
    in two (0)."""
    return _choice("MOKGEN_BWD_WEIGHTS_JOINT", ("1", "0")) == "1"


def bwd_overlap() -> str:
    """MOKGEN_BWD_OVERLAP: ``auto`` (default) runs an experts backward's dW_down launch on a second
    stream beside its joint dW_gate / dW_up launch where the two launches' tiles fit on the GPU's
    SMs together (a one-expert backward such as the fused shared expert's: 32 + 64 tiles of 132
    SMs on qwen3.5-35b-a3b), instead of one after the other; ``0`` never. The same bits
    (mokgen.backward.overlap_weight_launches)."""
    return _choice("MOKGEN_BWD_OVERLAP", ("auto", "0"))


def bwd_dh() -> str:
    """MOKGEN_BWD_DH: ``bf16`` (default) or ``fp32``, the dtype of the dh rows that SwiGLU's backward
    reads under the save policy (mokgen.backward)."""
    return _choice("MOKGEN_BWD_DH", ("bf16", "fp32"))


def bwd_dout() -> str:
    """MOKGEN_BWD_DOUT: ``auto`` (default), ``inline`` or ``gather``, how mokgen's dh and dW_down GEMMs
    get the dOut rows of the routed pairs (mokgen.backward.dout_inline; bwd_gemm's ``a_index``)."""
    return _choice("MOKGEN_BWD_DOUT", ("auto", "inline", "gather"))


def bwd_x() -> str:
    """MOKGEN_BWD_X: ``auto`` (default), ``inline`` or ``gather``, how the save policy's joint
    weight gradients get the pairs' x rows where the ring does not hold them
    (mokgen.backward.x_inline; bwd_gemm.weight_grads_joint's ``b_index``)."""
    return _choice("MOKGEN_BWD_X", ("auto", "inline", "gather"))


def tuned_dir() -> Path:
    value = _get("MOKGEN_TUNED_DIR")
    return Path(value).expanduser() if value else cache_dir() / "tuned"


def tuned_enabled() -> bool:
    value = _get("MOKGEN_TUNED")
    return value is None or value.strip().lower() not in ("0", "false", "no", "off")


#: plan option -> the switch that sets it
PLAN_SWITCHES = {"gemm_core": "MOKGEN_GEMM_CORE", "schedule": "MOKGEN_SCHEDULE", "cluster": "MOKGEN_CLUSTER",
                 "fuse_shared": "MOKGEN_FUSE_SHARED", "block_k": "MOKGEN_BLOCK_K", "pull_unroll": "MOKGEN_PULL_UNROLL",
                 "pull_mode": "MOKGEN_PULL_MODE", "dispatch_join": "MOKGEN_DISPATCH_JOIN", "stagger": "MOKGEN_FWD_STAGGER",
                 "mx_form": "MOKGEN_MX_FORM", "mx_fwd_weights": "MOKGEN_MX_FWD_WEIGHTS"}


def switch_set(option: str) -> bool:
    """Whether the switch of plan option ``option`` is set (it then wins over tuned values)."""
    return _get(PLAN_SWITCHES[option]) is not None


def plan_options_with(tuned: dict | None) -> dict:
    """Build options from tuned values (plan option -> value) under the environment: a switch
    that is set wins over the tuned value, the tuned value over the plan's default."""
    options = plan_options()
    for option, value in (tuned or {}).items():
        # the weights raw take the expanded form: a tuned form of codes gives way to it
        if not switch_set(option) and not (option == "mx_form" and options["mx_fwd_weights"] == "raw"):
            options[option] = value
    return options


def plan_options() -> dict:
    """Build options chosen by the environment, as make_plan keyword arguments."""
    return {"gemm_core": gemm_core(), "schedule": schedule(), "cluster": cluster(), "fuse_shared": fuse_shared(),
            "block_k": block_k(), "pull_unroll": pull_unroll(), "pull_mode": pull_mode(),
            "dispatch_join": dispatch_join(), "stagger": fwd_stagger(), "mx_form": mx_form(),
            "mx_fwd_weights": "values" if mx_fwd_weights() == "auto" else mx_fwd_weights()}


def bwd_sum() -> str:
    """MOKGEN_BWD_SUM: ``side`` (default since v0.47: mokgen.backward's dX sum over the slots inside
    the joint weight-gradient launch, bwd_gemm.weight_grads_joint's ``slot_sum``, where that launch
    loads B by TMA) or ``apart`` (its own launch, sum_slots)."""
    return _choice("MOKGEN_BWD_SUM", ("side", "apart"))


def bwd_dh_swiglu() -> bool:
    """MOKGEN_BWD_DH_SWIGLU: the save policy's SwiGLU backward in the dh GEMM's epilogue (bwd_gemm.dh_swiglu_saved), off by default."""
    return _choice("MOKGEN_BWD_DH_SWIGLU", ("0", "1")) == "1"


def bwd_fused() -> bool:
    """MOKGEN_BWD_FUSED: the save policy's experts backward in one launch (bwd_gemm.fused_backward), off by default."""
    return _choice("MOKGEN_BWD_FUSED", ("0", "1")) == "1"


BWD_FUSED_CHUNK_DEFAULT = 8192
BWD_FUSED_LAG_DEFAULT = 3


def _positive_int(name: str, default: int, top: int) -> int:
    value = _get(name)
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= top:
        from mokgen.errors import ToolchainError

        raise ToolchainError(f"{name} must be an integer from 1 to {top}, got {value!r}")
    return n


def bwd_fused_chunk() -> int:
    """MOKGEN_BWD_FUSED_CHUNK: rows per group of the fused backward's order (default BWD_FUSED_CHUNK_DEFAULT)."""
    return _positive_int("MOKGEN_BWD_FUSED_CHUNK", BWD_FUSED_CHUNK_DEFAULT, 1 << 30)


def bwd_fused_lag() -> int:
    """MOKGEN_BWD_FUSED_LAG: groups from a group's dh tiles to its dx and weight tiles, 1 to 8 (default 3)."""
    return _positive_int("MOKGEN_BWD_FUSED_LAG", BWD_FUSED_LAG_DEFAULT, 8)
