// Grouped GEMMs of the experts' backward on Hopper (sm_90a): issue 5, step 2 of the backward
// plan (docs/architecture.md). The forward's HopperTile reads both operands K-major (rows of x or
// h, rows of the weights); the backward also needs operands read along M or N ("MN-major"):
//   rows GEMMs, C[r, :] = sum over the operand pairs p of A_p[r, :] B_p[e(r)], per received row r
//   of expert e(r) (rows expert-major, expert e owning rows [offs[e-1], offs[e])):
//     dh = dOut Wd[e]                 A K-major [rows, H], B = Wd[e] [H, I]: MN-major
//     dx = dg Wg[e] + du Wu[e]        two pairs, B = Wg[e], Wu[e] [I, H]: MN-major
//     g = x Wg[e]^T, u = x Wu[e]^T     B K-major (the forward's operands; the recompute policy)
//   weight gradients, C_e = A[seg e]^T B[seg e], K = the expert's rows (ragged, may be 0):
//     dWg[e] = dg^T x, dWu[e] = du^T x, dWd[e] = dy^T h     A and B both MN-major
// One CTA owns each output tile and walks its K in order (for the weight gradients: the expert's
// rows in their fixed order), so there is no split-K and no float atomic: the bits do not depend
// on the grid, the tile order or the run.
//
// Roles as in the forward (hopper_gemm.cuh): 384 threads, warpgroup 0's thread 0 issues TMA loads
// into a ring of kStages stages (full/empty mbarriers), warpgroups 1 and 2 run wgmma on rows
// 64c..64c+63 of a 128 x 256 tile with one k-block of 64 in flight. Stage: A 128 x 64 in two
// boxes of 64, B 256 x 64 in four MN-major boxes of 64 columns x 64 k rows (or two K-major boxes
// of 128 rows); 48 KB. Every box has 128-byte rows with the 128-byte swizzle, which keeps a row
// within its own 128 bytes: that is what lets the consumers zero the k rows of a short last
// k-block (the next expert's rows, loaded by the TMA box) in place.
//
// This header is not included by the forward megakernel, so editing it does not make the tuned
// files (keyed by the forward's sources, render.kernel_digest) stale.
#pragma once

#include "bwd_tiles.cuh"
#include "desc_mn.cuh"
#include "swiglu_grad.cuh"
#include "hopper_gemm.cuh"

namespace mokgen {
namespace bwd {

using sm90::fence_operands;
using sm90::mbar_arrive;
using sm90::mbar_arrive_expect_tx;
using sm90::smem_desc_k;

// A wait on a stage barrier gives up after kWaitCycles SM clock cycles (2^35: about 17 s at
// 1.98 GHz, far beyond any tile's k-loop) and traps: a protocol error in these kernels ends the
// launch (a failed CUDA call in the caller) instead of hanging the process. The clock is read
// only while the barrier is not yet complete. No printf here or anywhere in these kernels: a
// function call (printf is one, vprintf) anywhere in a kernel makes ptxas serialize all of its
// wgmma (C7510, "wgmma pipeline crossing function boundary"): each HGMMA then waits for the one
// before. v0.10's producer printed the barrier it timed out on, and every kernel of this
// library ran serialized (docs/perf-notes.md v0.11); tests/test_bwd_gemm.py checks the build
// log for C7510.
constexpr long long kWaitCycles = 1ll << 35;

MOKGEN_DEVICE void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  long long start = 0;
  for (int spin = 0;; ++spin) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    if (done) return;
    if (spin == 0) {
      start = clock64();
    } else if (clock64() - start > kWaitCycles) {
      __trap();
    }
  }
}

constexpr int kBM = 128, kBN = 256, kBK = 64;
static_assert(kBM == kTileRows, "the tile walks' row blocks are the tiles' rows");
constexpr int kBox = 64 * kBK * 2;               // 8 KB: 64 rows of 128 bytes
constexpr int kABytes = 2 * kBox;                // 128 x 64
constexpr int kBBytes = 4 * kBox;                // 256 x 64
constexpr int kStageBytes = kABytes + kBBytes;  // 48 KB
constexpr int kStages = 4;        // the rows GEMMs' and the recompute's stage ring
constexpr int kWeightStages = 4;  // the weight gradients' (3 leaves room for whole-tile store buffers: v0.13, slower)
constexpr int kThreads = 384;
constexpr int kAcc = kBN / 2;  // fp32 accumulators per consumer thread (m64n256)
// The forward's non-gated 128 x 256 x 64 tile: its stage layout and epilogue quad exchange are
// used as they are.
using Tile = sm90::HopperTile<kBN, kBK, false, false, kStages, kBN>;
static_assert(Tile::kStageStride == kStageBytes && Tile::kThreads == kThreads, "the forward tile's stage ring");

// Dynamic shared memory of a ring of kS stages of stage_bytes, as the forward's: the full and
// empty barriers, the stagger's lead barrier and the ping-pong's turn barriers, then the stages
// at the next 1024-byte boundary (+1024 of alignment slack).
// The barriers before the stages: full and empty per stage, the stagger's lead, the ping-pong's two turns.
MOKGEN_HOST_DEVICE constexpr int ring_barriers(int kS) { return 2 * kS + 3; }
constexpr size_t ring_bytes(int kS, int stage_bytes = kStageBytes) {
  return size_t(kS) * stage_bytes + ring_barriers(kS) * 8 + 1024;
}
constexpr size_t kSmemBytes = ring_bytes(kStages);

// MN-major operand with the 128-byte swizzle: 64 M/N elements x k rows a box (desc_mn.cuh).
MOKGEN_DEVICE uint64_t smem_desc_mn(const void* smem) { return sm90::smem_desc_mn<kBox>(smem); }

using cute::SM90::GMMA::Major;

// The two bf16 of a 32-bit word as floats (exact): the low half is the element at the lower address.
MOKGEN_DEVICE float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
MOKGEN_DEVICE float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
template <bool kAMN, bool kBMN>
using Mma = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<kAMN ? Major::MN : Major::K, kBMN ? Major::MN : Major::K>;

template <bool kAMN, bool kBMN, size_t... Is>
MOKGEN_DEVICE void mma(uint64_t da, uint64_t db, float* acc, bool accumulate, std::index_sequence<Is...>) {
  Mma<kAMN, kBMN>::fma(da, db, acc[Is]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// The first `steps` 16-row wgmma steps of a k-block (stage operands sa, sb) into acc; the first
// step accumulates when `accumulate` (not the tile's first k-block). K-major: the next 16 k are
// 32 bytes on within each 128-byte row; MN-major: 16 k rows on.
template <bool kAMN, bool kBMN, int kSteps>
MOKGEN_DEVICE void mma_steps(const unsigned char* sa, const unsigned char* sb, float* acc, bool accumulate) {
#pragma unroll
  for (int k16 = 0; k16 < kSteps; ++k16) {
    const uint64_t da = kAMN ? smem_desc_mn(sa + k16 * 2048) : smem_desc_k<128>(sa + k16 * 32);
    const uint64_t db = kBMN ? smem_desc_mn(sb + k16 * 2048) : smem_desc_k<128>(sb + k16 * 32);
    mma<kAMN, kBMN>(da, db, acc, accumulate || k16 > 0, std::make_index_sequence<kAcc>{});
  }
}

// A kernel's shared memory, carved by start_pipeline: the stage barriers, the staggered
// consumers' one hand-over (see Pipe below, an mbarrier just after the stage barriers, in the
// alignment gap before the first stage), the stages, and what follows the ring (the weight
// gradients' store buffers).
struct Smem {
  uint64_t* full;
  uint64_t* empty;
  uint64_t* lead;
  uint64_t* turn;  // [2]: the ping-pong weight kernel's k-loop turns (consumer warpgroup 0, 1)
  unsigned char* stages;
  unsigned char* after;
};

template <int kS, int kStageB = kStageBytes>
MOKGEN_DEVICE Smem carve(unsigned char* raw) {
  static_assert(ring_barriers(kS) * 8 <= 1024, "the barriers fit before the first stage");
  Smem s;
  s.full = reinterpret_cast<uint64_t*>(raw);
  s.empty = s.full + kS;
  s.lead = s.empty + kS;
  s.turn = s.lead + 1;
  s.stages = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + ring_barriers(kS) * 8 + 1023) &
                                              ~uintptr_t(1023));
  s.after = s.stages + size_t(kS) * kStageB;
  return s;
}

MOKGEN_DEVICE uint64_t* lead_barrier(const Smem& s) { return s.lead; }

// Staggered consumers (the default; a run-time setting of every GEMM kernel, the lead): consumer
// warpgroup 1 starts its first tile only once warpgroup 0 has consumed `lead` k-blocks (an
// mbarrier, lead_barrier: a named barrier there, inside the k-loop, made ptxas retire every
// wgmma before it, serializing the pipeline), and the two never wait for each other again (each
// zeroes the short last k-block's tail rows of its own operands). The aim: one warpgroup's
// epilogue overlapping the other's wgmma on the same stages. Lockstep (lead 0) is measurably
// slower, both storing at once. But in-kernel traces (docs/perf-notes.md v0.13) found leads 1,
// 2 and 3 the same, the warpgroups' k-loops overlapping almost entirely whatever the first
// tile's offset: a stage is refilled only once both have released it, so neither gets far
// ahead. A ring of kS stages takes a lead of at most kS - 1. The same bits at every lead: each
// warpgroup's rows and k order are unchanged.
// The largest lead any ring takes (all have kStages stages; set_stagger clamps to it).
constexpr int kMaxLead = kStages - 1;

// Position in a ring of kS stages, the stagger's lead (0: lockstep) and whether this consumer
// thread still has the stagger's one hand-over to do (1: consumer warpgroup 0, whose thread 0
// arrives on lead_barrier).
template <int kS>
struct Pipe : sm90::PipeState<kS> {
  int lead = 0;
  int stagger_todo = 0;
  MOKGEN_DEVICE bool staggered() const { return lead > 0; }
  // n stages on at once (the ping-pong: the other warpgroup's tile, not waited for)
  MOKGEN_DEVICE void advance_by(int n) {
    const int at = this->stage + n;
    this->phase ^= uint32_t((at / kS) & 1);
    this->stage = at % kS;
  }
#ifdef MOKGEN_BWD_TRACE
  long long waited = 0;  // clock cycles this thread spent in stage-barrier waits (.ci/bwd_trace.py)
#endif
};

// Every role's pipe (the producer's stagger fields stay unused); lead clamped to [0, kS - 1].
// (run_roles sets the hand-over still to do, from the warp-uniform warpgroup index.)
template <int kS>
MOKGEN_DEVICE Pipe<kS> make_pipe(int lead) {
  Pipe<kS> p;
  p.lead = lead < 0 ? 0 : lead > kS - 1 ? kS - 1 : lead;
  return p;
}

// A stage-barrier wait of the pipe's role; trace builds (-DMOKGEN_BWD_TRACE, .ci/bwd_trace.py)
// add its clock cycles to pipe.waited.
template <class P>
MOKGEN_DEVICE void pipe_wait(uint64_t* bar, uint32_t parity, P& pipe) {
#ifdef MOKGEN_BWD_TRACE
  const long long t0 = clock64();
  mbar_wait(bar, parity);
  pipe.waited += clock64() - t0;
#else
  mbar_wait(bar, parity);
#endif
}

template <class P>
MOKGEN_DEVICE void stagger_lead_done(const Smem& s, P& pipe) {
  if (pipe.stagger_todo == 1) {
    if ((threadIdx.x & 127) == 0) mbar_arrive(lead_barrier(s));
    pipe.stagger_todo = 0;
  }
}

// CTA pairs (kPair = 2, a cluster of two CTAs; weight gradients): the two CTAs compute row
// blocks 2 mp and 2 mp + 1 of one expert's column tile, so they read the same B rows and
// columns, and each CTA's producer loads half of B (two of its four boxes) with a TMA multicast
// into both CTAs' stages, A whole on its own: 32 KB per CTA and k-block from L2 instead of 48.
// A stage is refilled only when the consumers of both CTAs have released it (empty counts four
// arrivals: two local, two from the peer); full still expects the whole 48 KB stage. The
// forward's pairs (hopper_gemm.cuh, kShareB) share the weights the same way. The rows GEMMs'
// pairs (v0.14) compute column tiles 2 np and 2 np + 1 of one row block instead, so they share
// A (its two 64-row boxes, one loaded by each CTA into both): 40 KB per CTA and k-block.

// Every kernel's prologue: carve the dynamic shared memory for a ring of kS stages of kStageB
// bytes and initialize the barriers (thread 0), visible to the whole CTA (and, in a pair, to the
// peer) afterwards. kReaders: the consumer warpgroups that read each stage (2: both, the tile
// split between them; 1: the ping-pong's, each stage one warpgroup's), so empty counts kReaders
// arrivals per CTA of the pair. turn[0] starts complete: warpgroup 0 has the first turn.
// kFull: the arrivals that complete a full barrier's phase (1: the producer thread's
// expect_tx; a gathering producer's 128 threads add one each, kGatherFull).
template <int kS, int kPair = 1, int kStageB = kStageBytes, int kReaders = 2, int kFull = 1>
MOKGEN_DEVICE Smem start_pipeline(unsigned char* raw) {
  static_assert(kPair == 1 || kPair == 2, "single CTAs or pairs");
  static_assert(kReaders == 1 || kReaders == 2, "one or both consumer warpgroups read a stage");
  const Smem s = carve<kS, kStageB>(raw);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kS; ++i) {
      sm90::mbar_init(&s.full[i], kFull);
      sm90::mbar_init(&s.empty[i], kReaders * kPair);
    }
    sm90::mbar_init(lead_barrier(s), 1);
    sm90::mbar_init(&s.turn[0], 1);
    sm90::mbar_init(&s.turn[1], 1);
    sm90::fence_barrier_init();
    mbar_arrive(&s.turn[0]);
  }
  if constexpr (kPair == 2)
    cute::cluster_sync();  // the peer's barriers exist before any multicast or remote arrive
  else
    __syncthreads();
  return s;
}

// This CTA's rank in its pair (0 for a single CTA).
template <int kPair>
MOKGEN_DEVICE int pair_rank() {
  if constexpr (kPair == 2)
    return int(cute::block_rank_in_cluster());
  else
    return 0;
}

// Hand stage st back: thread 0 of a consumer warpgroup arrives on this CTA's empty barrier and,
// in a pair, thread 1 on the peer's (whose producer multicasts into this CTA's stage too).
template <int kPair>
MOKGEN_DEVICE void release(const Smem& s, int st, int t) {
  if (t == 0) mbar_arrive(&s.empty[st]);
  if constexpr (kPair == 2)
    if (t == 1) sm90::mbar_arrive_cluster(&s.empty[st], cute::block_rank_in_cluster() ^ 1u);
}

// dX's sum over each token's slots as a side job (MOKGEN_BWD_SUM=side, v0.47): out[t, c] =
// bf16(sum over j = 0..K-1, in that order, of in[t K + j, c]) in fp32 with one rounding, the
// arithmetic of bwd_gemm.cu's sum_slots_kernel (bf16 rows) element for element, so the same bits.
// Run by the warps of warpgroup 0 that a TMA producer leaves idle (warps 1-3: its thread 0 issues
// every load) in the joint weight-gradient launch, which follows dx on the stream and is bound by
// its tensor cores: the sum's 2 T K H bytes read then overlap its k-loops instead of running as a
// launch of their own after it. A worker takes 16-byte units (8 columns of a token) in a grid-wide
// stride and loads up to 8 slots' pieces before adding them, so each of its loads are in flight
// together (96 threads a CTA against the 2048 of the separate launch). out == nullptr: no job.
struct SlotSum {
  bf16* out = nullptr;       // [T, H]
  const bf16* in = nullptr;  // [T K, H]: each pair's dx row, pairs token-major
  int T = 0, K = 0, H = 0;   // H % 8 == 0 (checked by the caller)
};

MOKGEN_DEVICE void slot_sum(const SlotSum& ss, int64_t worker, int64_t workers) {
  const int64_t q = ss.H / 8, total = int64_t(ss.T) * q;
  for (int64_t i = worker; i < total; i += workers) {
    const int64_t t = i / q, c = 8 * (i % q);
    const bf16* src = ss.in + t * ss.K * ss.H + c;
    float acc[8];
    for (int j0 = 0; j0 < ss.K; j0 += 8) {
      uint4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u)  // read once: streamed past L2's retention (the GEMM's operands stay)
        if (j0 + u < ss.K) v[u] = __ldcs(reinterpret_cast<const uint4*>(src + int64_t(j0 + u) * ss.H));
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (j0 + u < ss.K) {
          float f[8];
          unpack_bf16x8(v[u], f);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] = j0 + u == 0 ? f[e] : acc[e] + f[e];
        }
      }
    }
    *reinterpret_cast<uint4*>(ss.out + t * ss.H + c) =
        make_uint4(pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]), pack_bf16x2(acc[4], acc[5]),
                   pack_bf16x2(acc[6], acc[7]));
  }
}

// The side job of run_roles: none (every kernel but the joint weight gradients with MOKGEN_BWD_SUM=side),
// or the slots' sum.
struct NoSide {
  static constexpr bool kAny = false;
  MOKGEN_DEVICE NoSide(const SlotSum&) {}
  NoSide() = default;
  MOKGEN_DEVICE void operator()(int64_t, int64_t) const {}
};
struct SlotSumSide {
  static constexpr bool kAny = true;
  SlotSum ss;
  MOKGEN_DEVICE SlotSumSide(const SlotSum& s) : ss(s) {}
  MOKGEN_DEVICE void operator()(int64_t worker, int64_t workers) const { slot_sum(ss, worker, workers); }
};

// Every kernel's roles over one persistent walk (pipe: this thread's, from make_pipe): walk(fn)
// calls fn(tile...) for each of this CTA's tiles in order. Thread 0 of warpgroup 0 runs produce(tile...) (the rest of warpgroup 0
// has nothing to do after giving its registers back), warpgroups 1 and 2 run consume(wg,
// tile...) with wg = 0 or 1; each role keeps its own copy of the stage ring's position. A pair
// ends with a cluster barrier of all threads: no multicast or remote arrive targets a CTA that
// has exited. kWideProducer: all 128 threads of warpgroup 0 run produce (the gathering
// producer, produce_gathered). side (Side::kAny, a TMA producer only): side(worker, workers) run
// by warps 1-3 of warpgroup 0, 96 workers a CTA, numbered across the grid (SlotSum above).
template <int kPair = 1, bool kWideProducer = false, class P, class Walk, class Produce, class Consume,
          class Side = NoSide>
MOKGEN_DEVICE void run_roles(const Smem& s, P& pipe, Walk walk, Produce produce, Consume consume, Side side = {}) {
  static_assert(!(kWideProducer && Side::kAny), "a side job needs warpgroup 0's idle warps: a TMA producer");
  const int tid = threadIdx.x, wgi = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform for ptxas
  if (wgi == 0) {
    cutlass::arch::warpgroup_reg_dealloc<72>();
    if (kWideProducer || tid == 0) {
      walk(produce);
    } else if constexpr (Side::kAny) {
      // a plain compare, like the producer's tid == 0 above: a __shfl_sync here (full mask) would
      // wait for warp 0's lane 0, which is in the producer's walk (v0.47's first GPU run hung so)
      if (tid >= 32) side(int64_t(blockIdx.x) * 96 + (tid - 32), int64_t(gridDim.x) * 96);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<216>();
    // the stagger: warpgroup 1 starts after warpgroup 0's lead, and warpgroup 0 arrives even
    // where this CTA has no tile at all. The branch is on the warp-uniform index (a shuffle):
    // on tid / 128, ptxas took any instruction here for a divergent path and serialized the
    // weight kernels' wgmma (C7520, caught by build.serialized_wgmma)
    if (pipe.staggered() && wgi == 2) mbar_wait(lead_barrier(s), 0);
    pipe.stagger_todo = pipe.staggered() && wgi == 1 ? 1 : 0;
    walk([&](auto... tile) { consume(wgi - 1, tile...); });
    stagger_lead_done(s, pipe);
  }
  if constexpr (kPair == 2) cute::cluster_sync();
}

// Where the k-blocks of a tile come from. A tile has n_k k-blocks of 64; k-block kb reads pair
// 0 for kb < kb_per_pair, else pair 1 (dx has two operand pairs), at k0 = 64 (kb mod kb_per_pair).
//   A K-major (rows GEMMs): box (k0, a_row + 64 h), h = 0, 1 (the tile's rows).
//   A MN-major (weight gradients): box (a_col + 64 h, k_row + k0): M columns, k = rows.
//   B MN-major: box (b_col + 64 j, b_row + k0), j = 0..3 (N columns; k = rows of B).
//   B K-major: box (k0, b_row + 128 h), h = 0, 1 (N = rows of B, each box 128 rows).
struct TileSrc {
  const CUtensorMap* a[2];
  const CUtensorMap* b[2];
  int a_row, a_col;  // A K-major: first row; A MN-major: first M column (a_row: first k row)
  int b_row, b_col;  // B MN-major: first k row and N column; B K-major: first N row (b_col unused)
  int n_k, kb_per_pair;
  int a_rows = 0;    // A's valid rows from a_row (the tile's rows; the expert's k rows): produce_gathered only
};

// The weight gradients' row-bounded maps (v0.30; MOKGEN_BWD_TAIL=tma). A weight-gradient tile's K
// is its expert's rows, so its last k-block's TMA box also covers the next expert's first rows.
// The consumers used to zero those rows in shared memory and issue the short k-block alone,
// drained before and after (consume's short_last path: about 950 cycles a ping-pong tile,
// docs/perf-notes.md v0.28). With a copy of each operand's map per expert whose row count
// (global dim 1) is the expert's end row offs[e], the TMA writes zeros for those rows itself
// (out-of-bounds fill), so the short k-block is an ordinary one: 4 wgmma steps in the k-loop,
// no drain, no zeroing. Its rows past the expert add exact zeros (the next expert's values,
// even inf or NaN, never reach this expert's sums), so the bits are the zeroing path's.
// The copies: kBoundedMaps per expert, written by bound_maps (bwd_gemm.cu) before the GEMM
// launch: A pair 0, A pair 1 (the joint form's second problem), B.
constexpr int kBoundedMaps = 3;

// The generic-proxy writes of a tensor map (bound_maps) made visible to the TMA's reads of it:
// the writer's release, then this acquire by each thread that issues loads through the map.
MOKGEN_DEVICE void tensormap_acquire(const CUtensorMap* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(map) : "memory");
}

// Tile t's loads through expert e's bounded maps (bm = the expert's kBoundedMaps), A from pair p.
MOKGEN_DEVICE void use_bounded(TileSrc& t, const CUtensorMap* bm, int p) {
  t.a[0] = t.a[1] = bm + p;
  t.b[0] = t.b[1] = bm + 2;
}

// The TMA unit's fetch of a tensor map, issued ahead of its first load through it.
MOKGEN_DEVICE void tensormap_prefetch(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// The producer's acquires of the bounded maps (each map once per CTA, before its first load
// through it) and the TMA unit's fetch of the next expert's maps ahead of its first loads
// (prefetch.tensormap). Its walk takes an expert's tiles together, in expert order. Where E <=
// kAcquireAllMaps, every map is acquired on the first call, before any load is in flight;
// else each expert's on the move to it, with the next one's (measured, docs/perf-notes.md v0.30).
#ifndef MOKGEN_BWD_ACQUIRE_ALL
#define MOKGEN_BWD_ACQUIRE_ALL 64
#endif
constexpr int kAcquireAllMaps = MOKGEN_BWD_ACQUIRE_ALL;
struct BoundedMaps {
  const CUtensorMap* maps;  // null: the template maps, and the consumers zero the short k-block
  int E;
  int fenced = -1;  // the expert of the last call
  int upto = 0;     // the experts below it have their maps acquired
  MOKGEN_DEVICE const CUtensorMap* of(int e) {
    const CUtensorMap* bm = maps + size_t(e) * kBoundedMaps;
    if (e != fenced) {
      fenced = e;
      int want = e + 2 < E ? e + 2 : E;
      if (upto == 0 && E <= kAcquireAllMaps) want = E;
      for (int i = (upto > e ? upto : e) * kBoundedMaps; i < want * kBoundedMaps; ++i) tensormap_acquire(maps + i);
      if (want > upto) upto = want;
      if (e + 1 < E) {
#pragma unroll
        for (int j = 0; j < kBoundedMaps; ++j) tensormap_prefetch(bm + kBoundedMaps + j);
      }
    }
    return bm;
  }
};

// B's boxes of one k-block (at k0) into sb, by TMA on the stage's full barrier (produce: the
// layouts it lists; kShareB: this CTA's half multicast into both CTAs of the pair).
template <bool kBMN, bool kGated, bool kShareB>
MOKGEN_DEVICE void load_b(const TileSrc& t, unsigned char* sb, uint64_t* full, const CUtensorMap* map_b, int k0,
                          int crank) {
  if constexpr (kBMN) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (kShareB) {
        if ((j >> 1) == crank)
          cute::SM90_TMA_LOAD_MULTICAST_2D::copy(map_b, full, uint16_t(0b11),
                                                 uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL), sb + j * kBox,
                                                 t.b_col + 64 * j, t.b_row + k0);
      } else {
        cute::SM90_TMA_LOAD_2D::copy(map_b, full, 0, sb + j * kBox, t.b_col + 64 * j, t.b_row + k0);
      }
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (kGated)
        cute::SM90_TMA_LOAD_2D::copy(h ? t.b[1] : t.b[0], full, 0, sb + h * (2 * kBox), k0, t.b_row);
      else
        cute::SM90_TMA_LOAD_2D::copy(map_b, full, 0, sb + h * (2 * kBox), k0, t.b_row + 128 * h);
    }
  }
}

// A's two MN-major boxes of one k-block (at k0) into sa, by TMA on the stage's full barrier.
MOKGEN_DEVICE void load_a_mn(const TileSrc& t, unsigned char* sa, uint64_t* full, const CUtensorMap* map_a, int k0) {
#pragma unroll
  for (int h = 0; h < 2; ++h) cute::SM90_TMA_LOAD_2D::copy(map_a, full, 0, sa + h * kBox, t.a_col + 64 * h, t.a_row + k0);
}

// Producer (one thread): every k-block of one tile. kGated (K-major B only): B's two 128-row
// boxes are rows b_row.. of b[0] (gate) and of b[1] (up), as the forward's gated tile; one pair.
// kPair = 2, B shared (the weight gradients' pairs; MN-major B only): this CTA loads B boxes
// 2 crank and 2 crank + 1 into both CTAs of the pair (TMA multicast), the peer the other two.
// kPair = 2, kShareA (the rows GEMMs' pairs; K-major A): this CTA loads A box crank into both
// CTAs, the peer the other; B whole on its own.
template <bool kAMN, bool kBMN, bool kGated = false, int kPair = 1, bool kShareA = false, class P>
MOKGEN_DEVICE void produce(const Smem& s, P& pipe, const TileSrc& t, int crank = 0) {
  static_assert(!kGated || (!kAMN && !kBMN), "gated tiles read K-major operands");
  static_assert(kPair == 1 || kBMN || kShareA, "pairs share an MN-major B, or A");
  static_assert(!kShareA || !kAMN, "pairs share a K-major A");
  constexpr bool kShareB = kPair == 2 && !kShareA;
  for (int kb = 0; kb < t.n_k; ++kb) {
    pipe_wait(&s.empty[pipe.stage], pipe.phase ^ 1u, pipe);
    unsigned char* st = s.stages + size_t(pipe.stage) * kStageBytes;
    uint64_t* full = &s.full[pipe.stage];
#ifdef MOKGEN_BWD_NO_LOAD  // a measuring variant only (.ci/bench_bwd_gemm.py BWD_BENCH_FLAGS): no TMA loads, wrong bits
    mbar_arrive(full);
    pipe.advance();
    continue;
#endif
    mbar_arrive_expect_tx(full, kStageBytes);
    const bool p1 = kb >= t.kb_per_pair;  // the second operand pair (a select: an indexed array would live in local memory)
    const int k0 = (p1 ? kb - t.kb_per_pair : kb) * kBK;
    const CUtensorMap* map_a = p1 ? t.a[1] : t.a[0];
    const CUtensorMap* map_b = p1 ? t.b[1] : t.b[0];
    if constexpr (kAMN) {
      load_a_mn(t, st, full, map_a, k0);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (kPair == 2 && kShareA) {
          if (h == crank)
            cute::SM90_TMA_LOAD_MULTICAST_2D::copy(map_a, full, uint16_t(0b11),
                                                   uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL), st + h * kBox,
                                                   k0, t.a_row + 64 * h);
        } else {
          cute::SM90_TMA_LOAD_2D::copy(map_a, full, 0, st + h * kBox, k0, t.a_row + 64 * h);
        }
      }
    }
    load_b<kBMN, kGated, kShareB>(t, st + kABytes, full, map_b, k0, crank);
    pipe.advance();
  }
}

// The gathering producer (v0.22; MOKGEN_BWD_DOUT=inline): the B boxes by TMA as produce's (one
// operand pair, single CTAs), A's 128 x 64 rows loaded through an index by the 128 threads of
// warpgroup 0 with cp.async. Each A box is 64 rows of 128 bytes in the 128-byte swizzle the TMA
// writes (16-byte chunk c of row r at (c ^ (r % 8)) 16 within the row), whichever way the
// consumers read it, so one routine fills both forms:
//   K-major A (the rows GEMMs: dh = dOut Wd): tile row m is source row index[a_row + m],
//     bytes 2 k0 .. 2 k0 + 127 (box m / 64);
//   MN-major A (the weight gradients: dWd = dOut^T hw): k row r is source row
//     index[a_row + k0 + r], columns a_col + 64 h .. + 63 (box h).
// Thread t copies chunk t % 8 of rows t / 8 + 16 i: eight lanes cover one row's 128 bytes, so a
// warp's cp.async reads four whole rows. Rows past a_rows (past the tile, or the expert's last
// k row) are zero-filled (a source size of 0: nothing read). Every thread then arrives on the
// stage's full barrier through cp.async.mbarrier.arrive.noinc, which fires when its copies have
// landed: the barrier expects kGatherFull arrivals (thread 0's expect_tx of the B bytes and one
// per thread). The consumers fence the generic proxy's writes before their wgmma read them
// (consume<..., true>). The index of the next k-block's k rows is loaded before the wait for
// its stage, so its latency overlaps the wait. An A tile row of dOut gathered this way is the
// row the gather kernel would have written: the same operands, so the same bits.
// kGatherB (v0.25, MN-major only; MOKGEN_BWD_X=inline): B's k rows come through the index
// instead (the joint gate/up weight gradients' x rows: k row r is source row index[a_row + k0 +
// r], columns b_col + 64 j .. + 63, box j = 0..3) and A's two boxes by TMA.
struct Gather {
  const bf16* src;       // the source rows, ld elements each (16-byte aligned)
  const int64_t* index;  // the source row of each A row (K-major) or k row (MN-major)
  int64_t ld;
};
constexpr int kGatherFull = 1 + 128;  // a gathered stage's full-barrier arrivals

MOKGEN_DEVICE void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

MOKGEN_DEVICE void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// MN-major A (or B, kGatherB: the same k rows): the source rows of this thread's k rows kb 64 +
// t / 8 + 16 i (i = 0..3) of tile t, -1 past the expert's rows. The first k-block's are loaded
// by the caller while the previous tile's k-loop is still being issued (GatherAhead), so a
// tile's start does not wait for them.
MOKGEN_DEVICE void gathered_k_rows(const TileSrc& t, const Gather& g, int kb, int64_t (&r)[4]) {
  const int j = (threadIdx.x & 127) >> 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int k = kb * kBK + j + 16 * i;
    r[i] = k < t.a_rows ? g.index[t.a_row + k] : -1;
  }
}

// The gathering producer's stage for k-block kb of tile t, once it is free: thread 0 expects
// the TMA operand's bytes on its full barrier and loads it (B; under kGatherB, A's two MN-major
// boxes). Returns the stage's shared-memory address (the gathered operand's boxes from there,
// for the caller's copies: A at 0, B at kABytes).
template <bool kBMN, bool kGatherB = false, class P>
MOKGEN_DEVICE uint32_t gathered_stage(const Smem& s, P& pipe, const TileSrc& t, int kb) {
  static_assert(!kGatherB || kBMN, "a gathered B is MN-major (k rows)");
  pipe_wait(&s.empty[pipe.stage], pipe.phase ^ 1u, pipe);
  unsigned char* st = s.stages + size_t(pipe.stage) * kStageBytes;
  if ((threadIdx.x & 127) == 0) {
    uint64_t* full = &s.full[pipe.stage];
    if constexpr (kGatherB) {
      mbar_arrive_expect_tx(full, kABytes);
      load_a_mn(t, st, full, t.a[0], kb * kBK);
    } else {
      mbar_arrive_expect_tx(full, kBBytes);
      load_b<kBMN, false, false>(t, st + kABytes, full, t.b[0], kb * kBK, 0);
    }
  }
  return smem_u32(st);
}

// first: MN-major operands only, gathered_k_rows(t, g, 0, first) (K-major A loads its rows' sources
// itself, once per tile).
template <bool kAMN, bool kBMN, bool kGatherB = false, class P>
MOKGEN_DEVICE void produce_gathered(const Smem& s, P& pipe, const TileSrc& t, const Gather& g,
                                    const int64_t (&first)[4]) {
  static_assert(!kGatherB || (kAMN && kBMN), "a gathered B: the weight gradients' MN-major operands");
  const int tid = threadIdx.x & 127, c = tid & 7, j = tid >> 3;
  // row j of each group of 16 rows: its swizzled chunk (r % 8 == j % 8 for r = j + 16 i)
  const uint32_t at = uint32_t(j * 128 + ((c ^ (j & 7)) << 4));
  if constexpr (!kAMN) {
    const bf16* src[8];  // tile rows j + 16 i, i = 0..7 (i < 4: box 0), for the whole k-loop
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int m = j + 16 * i;
      src[i] = m < t.a_rows ? g.src + g.index[t.a_row + m] * g.ld + 8 * c : nullptr;
    }
    for (int kb = 0; kb < t.n_k; ++kb) {
      const uint32_t dst = gathered_stage<kBMN>(s, pipe, t, kb) + at;
#pragma unroll
      for (int i = 0; i < 8; ++i)  // row j + 16 i at byte 128 (j + 16 i) of the two boxes: 2048 i
        cp_async16(dst + i * 2048, src[i] != nullptr ? src[i] + kb * kBK : g.src, src[i] != nullptr);
      cp_async_arrive(&s.full[pipe.stage]);
      pipe.advance();
    }
  } else {
    int64_t cur[4], nxt[4];  // the source rows of k rows j + 16 i (-1: past the expert's rows)
#pragma unroll
    for (int i = 0; i < 4; ++i) cur[i] = first[i];
    for (int kb = 0; kb < t.n_k; ++kb) {
      if (kb + 1 < t.n_k) gathered_k_rows(t, g, kb + 1, nxt);
      const uint32_t dst = gathered_stage<kBMN, kGatherB>(s, pipe, t, kb) + at;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool valid = cur[i] >= 0;
        // k row j + 16 i at byte 2048 i of each of the operand's boxes (A: 2 at 0; B: 4 at kABytes)
        if constexpr (kGatherB) {
          const bf16* row = g.src + (valid ? cur[i] : 0) * g.ld + t.b_col + 8 * c;
#pragma unroll
          for (int b = 0; b < 4; ++b) cp_async16(dst + kABytes + b * kBox + i * 2048, row + 64 * b, valid);
        } else {
          const bf16* row = g.src + (valid ? cur[i] : 0) * g.ld + t.a_col + 8 * c;
#pragma unroll
          for (int h = 0; h < 2; ++h) cp_async16(dst + h * kBox + i * 2048, row + 64 * h, valid);
        }
      }
      cp_async_arrive(&s.full[pipe.stage]);
#pragma unroll
      for (int i = 0; i < 4; ++i) cur[i] = nxt[i];
      pipe.advance();
    }
  }
}

// The weight kernel's gathering producer one tile behind its walk: tile i + 1's first source
// rows are loaded (gathered_k_rows) before tile i's k-loop is issued, so their latency hides
// behind it; finish() issues the last tile. Without it each tile's first k-block waited for
// the index before its copies (a tile of the qwen3.5-35b-a3b layer's dW_down has 8 k-blocks).
// kGatherB: the tiles' B rows are the gathered ones (produce_gathered's kGatherB).
template <bool kGatherB = false>
struct GatherAhead {
  TileSrc tile;
  int64_t first[4];
  bool pending = false;
  template <class P>
  MOKGEN_DEVICE void next(const Smem& s, P& pipe, const TileSrc& t, const Gather& g) {
    int64_t rows[4];
    if (t.n_k > 0) gathered_k_rows(t, g, 0, rows);
    if (pending) produce_gathered<true, true, kGatherB>(s, pipe, tile, g, first);
    tile = t;
#pragma unroll
    for (int i = 0; i < 4; ++i) first[i] = rows[i];
    pending = true;
  }
  template <class P>
  MOKGEN_DEVICE void finish(const Smem& s, P& pipe, const Gather& g) {
    if (pending) produce_gathered<true, true, kGatherB>(s, pipe, tile, g, first);
    pending = false;
  }
};

// Zeroes k rows [valid, end) of one box (rows of 128 bytes), by the 128 threads t of a warpgroup:
// the tail rows of a short last k-block within its last 16-row wgmma step.
MOKGEN_DEVICE void zero_box_rows(unsigned char* box, int valid, int end, int t) {
  for (int i = t * 16; i < (end - valid) * 128; i += 128 * 16)
    *reinterpret_cast<uint4*>(box + valid * 128 + i) = make_uint4(0, 0, 0, 0);
}

// Zero k rows [valid, end) of boxes of a stage (a short last k-block of a weight-gradient tile:
// the TMA box also brought the next expert's rows; end = valid rounded up to the 16 k rows the
// last wgmma steps read). MN-major boxes only. Lockstep consumers (kAll false): warpgroup wg
// clears its own A box and B boxes 2 wg, 2 wg + 1, and a barrier of both warpgroups follows.
// Staggered ones (kAll): each clears its A box and all four B boxes itself, so neither waits
// for the other; the B rows the other warpgroup may be reading then get the zeros it already
// wrote there before its own reads (the same value, so the overlap changes no byte).
// The caller orders these generic-proxy writes before the wgmma reads (fence.proxy.async).
template <bool kAll>
MOKGEN_DEVICE void zero_tail(unsigned char* st, int wg, int valid, int end, int t) {
  constexpr int kBoxes = kAll ? 5 : 3;
  unsigned char* boxes[kBoxes];
  boxes[0] = st + wg * kBox;
#pragma unroll
  for (int b = 1; b < kBoxes; ++b) boxes[b] = st + kABytes + (kAll ? b - 1 : 2 * wg + b - 1) * kBox;
#pragma unroll
  for (int b = 0; b < kBoxes; ++b) zero_box_rows(boxes[b], valid, end, t);
}

#ifdef MOKGEN_BWD_NO_EPILOGUE
// The measuring builds without an epilogue keep the accumulators live through a store that never
// happens (ptxas drops wgmma whose results are unused: 3 HGMMA were left per weight kernel).
__device__ float g_sink;
MOKGEN_DEVICE void sink(const float (&acc)[kAcc]) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) s += acc[i];
  if (s == 1.2345e-30f) g_sink = s;
}
#endif

// A short last k-block's wgmma (consume, consume_pp): `steps` (1 .. kBK / 16) 16-row steps as one
// batch, issued by mma(std::integral_constant<int, S>{}), committed and drained inside each case,
// so no wgmma is in flight across the switch (see consume).
template <class Mma>
MOKGEN_DEVICE void issue_drained(int steps, Mma mma) {
  switch (steps) {  // the same for the whole warpgroup
    case 1: mma(std::integral_constant<int, 1>{}); cute::warpgroup_commit_batch(); cute::warpgroup_wait<0>(); break;
    case 2: mma(std::integral_constant<int, 2>{}); cute::warpgroup_commit_batch(); cute::warpgroup_wait<0>(); break;
    case 3: mma(std::integral_constant<int, 3>{}); cute::warpgroup_commit_batch(); cute::warpgroup_wait<0>(); break;
    default: mma(std::integral_constant<int, kBK / 16>{}); cute::warpgroup_commit_batch(); cute::warpgroup_wait<0>(); break;
  }
}

// Consumer warpgroup wg (0/1): every k-block of one tile into acc (fp32, m64n256 layout: warp w,
// lane l hold rows 16 w + l / 4 (+ 8) and columns 8 i + 2 (l % 4) + {0, 1} of group i, in
// acc[4 i + {0, 1}] (+ {2, 3} for the row + 8)). k_valid: the rows of the last k-block that
// belong to the tile's K (64 unless the K is ragged). With no k-block, acc is zero.
// kGathered: A came by cp.async (produce_gathered), generic-proxy writes that the wgmma (the
// async proxy) may read only after a proxy fence, here after each full-barrier wait.
// early(): called once, after the first k-block's wgmma are issued (the epilogue's prefetches,
// dh_swiglu_kernel): work that overlaps the k-loop; it must not touch acc. NoEarly by default.
struct NoEarly {
  MOKGEN_DEVICE void operator()() const {}
};
// kLastSteps (1 .. kBK / 16; 0: none, the default): the last k-block is a full one whose k rows
// past the tile's K were zero-filled by the TMA (the weight gradients' bounded maps), and only its
// first kLastSteps 16-row steps hold any of the K: it runs peeled after the loop with those steps
// alone, in one straight run like the loop's (a compile-time count: no switch, no drain; the
// caller picks the instantiation per tile, between tiles, with nothing in flight). The steps left
// out would add exact zeros, and the zero tail's short path leaves out the same ones, so the bits
// are both other tails' (MOKGEN_BWD_TAIL=steps, v0.32).
template <bool kAMN, bool kBMN, int kPair = 1, bool kGathered = false, int kLastSteps = 0, class P,
          class Early = NoEarly>
MOKGEN_DEVICE void consume(const Smem& s, P& pipe, int wg, int n_k, int k_valid_last, float (&acc)[kAcc],
                           Early early = Early{}) {
  static_assert(kLastSteps >= 0 && kLastSteps <= kBK / 16, "the last k-block's 16-row steps");
#ifdef MOKGEN_BWD_FULL_K  // a measuring variant only (.ci/bwd_trace.py): every k-block full, wrong bits
  k_valid_last = kBK;
#endif
  const int t = threadIdx.x & 127;
  if (n_k == 0) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
    stagger_lead_done(s, pipe);
    return;
  }
  // Full k-blocks in the loop: one straight run of wgmma per k-block, one batch left in flight.
  // A short last k-block (ragged K) runs after it, alone: only the 16-row steps that hold valid k
  // rows (its tail rows within the last step zeroed; a tile of 341 rows issues 22 steps, not 24),
  // picked by a switch with nothing in flight across it. v0.13-v0.26 switched inside the loop
  // and committed after the switch: ptxas closed a group in every case and committed a second,
  // empty one at the join (HGMMA.64x8x16 on RZ), so wait<1> waited for the k-block just issued
  // and no k-block overlapped the next one's issue; committing in each case instead left
  // wgmma in flight across the join, which the trace build serialized (C7515, v0.27).
  const bool short_last = kLastSteps == 0 && k_valid_last < kBK;
  const int n_full = short_last || kLastSteps > 0 ? n_k - 1 : n_k;
  int prev_stage = -1;
  // after k-block kb's wgmma have left at most the current batch in flight: hand the stage
  // before it back, step the ring, and the stagger's hand-over once the lead is consumed
  auto retire = [&](int kb) {
    fence_operands(acc);
    if (prev_stage >= 0) release<kPair>(s, prev_stage, t);
    prev_stage = pipe.stage;
    pipe.advance();
    if (kb == pipe.lead - 1) stagger_lead_done(s, pipe);
  };
  // k-block kb as one batch of its first `steps` 16-row steps (a std::integral_constant), one
  // batch left in flight after it: every k-block of the loop, and kLastSteps' peeled last one
  auto run_block = [&](int kb, auto steps) {
    pipe_wait(&s.full[pipe.stage], pipe.phase, pipe);
#ifndef MOKGEN_GATHER_NO_FENCE  // a measuring variant only (.ci/gather_probe.py --flags): not a correct kernel
    if constexpr (kGathered) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
    const unsigned char* st = s.stages + size_t(pipe.stage) * kStageBytes;
    fence_operands(acc);
    cute::warpgroup_arrive();
    mma_steps<kAMN, kBMN, decltype(steps)::value>(st + wg * kBox, st + kABytes, acc, kb > 0);
    cute::warpgroup_commit_batch();
    if (kb == 0) early();
    cute::warpgroup_wait<1>();
    retire(kb);
  };
#pragma unroll 2  // as the forward's mainloop (no spills either way)
  for (int kb = 0; kb < n_full; ++kb) run_block(kb, std::integral_constant<int, kBK / 16>{});
  // the last k-block, its first kLastSteps steps, as the loop runs one
  if constexpr (kLastSteps > 0) run_block(n_k - 1, std::integral_constant<int, kLastSteps>{});
  if (short_last) {
    const int kb = n_k - 1;
    cute::warpgroup_wait<0>();  // nothing in flight from here to the switch's drain
    fence_operands(acc);
    pipe_wait(&s.full[pipe.stage], pipe.phase, pipe);
#ifndef MOKGEN_GATHER_NO_FENCE
    if constexpr (kGathered) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
    unsigned char* st = s.stages + size_t(pipe.stage) * kStageBytes;
    const int steps = (k_valid_last + 15) / 16;
    if (k_valid_last % 16) {
      if (pipe.staggered()) {
        zero_tail<true>(st, wg, k_valid_last, 16 * steps, t);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        // this warpgroup's threads only (barrier 4 or 5: one instruction, not a branch on wg,
        // which ptxas took for a divergent path and serialized the wgmma for, C7520)
        asm volatile("bar.sync %0, 128;" ::"r"(4 + wg) : "memory");
      } else {
        zero_tail<false>(st, wg, k_valid_last, 16 * steps, t);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("bar.sync 2, 256;" ::: "memory");  // both consumer warpgroups
      }
    }
    const unsigned char* sa = st + wg * kBox;
    const unsigned char* sb = st + kABytes;
    fence_operands(acc);
    cute::warpgroup_arrive();
    issue_drained(steps, [&](auto n) { mma_steps<kAMN, kBMN, decltype(n)::value>(sa, sb, acc, kb > 0); });
    if (kb == 0) early();
    retire(kb);
  }
  cute::warpgroup_wait<0>();
  fence_operands(acc);
  release<kPair>(s, prev_stage, t);
  stagger_lead_done(s, pipe);  // a first tile shorter than the lead
}

// ---------------------------------------------------------------------------------------------
// The weight gradients in ping-pong (v0.14; bwd_gemm.weight_grads(schedule="pingpong"),
// MOKGEN_BWD_WEIGHTS). In the split tile above both consumer warpgroups read every stage, so
// their k-loops run together and their epilogues (a third of the tile's time,
// docs/perf-notes.md v0.13) leave the tensor core idle. Here each consumer warpgroup owns whole
// tiles of 128 x 128 (two m64n128k16 wgmma per 16 k rows: the same 128 fp32 accumulators per
// thread) and the stages they read: the CTA's tiles go to warpgroups 0, 1, 0, 1, ... in walk
// order, the producer loads every tile's k-blocks into one ring in that order, and a warpgroup
// steps its ring position over the other's tiles without waiting. Turn barriers order the
// k-loops: a warpgroup starts its tile's k-loop once the other has issued the wgmma of its
// hand-over k-block (hand_over: `early` k-blocks before its last, the library's stagger lead).
// The turn is also what makes the skip safe: a warpgroup waits on a stage only once the
// producer has filled the stage's previous lap, so a barrier is never a whole phase behind its
// waiter. Stage: A 128 x 64 (two MN-major boxes), B 128 x 64 (two): 32 KB, half the split
// tile's FLOPs for two thirds of its bytes; CTA pairs share B (each CTA loads one box into
// both), 24 KB per CTA. The same k order per output element, so the bits of the split tile.
// Measured (docs/perf-notes.md v0.14): no faster than the split tile. One warpgroup's k-loop
// alone ran at about half the tensor core's rate here (not the MN-major operands: v0.26's probe
// runs one warpgroup at the peak on every major; a 128 x 128 tile in 6.3-6.5k cycles against
// 2.8k), so strict turns (early 0) lengthened the period by 15%, and with the k-loops
// overlapping (early 1-3) the period equalled the split tile's. Part of that was the empty
// commit group of consume's note (v0.27: every k-block waited for; without it the weight
// gradients ran 6-11% faster and a strict-turn k-loop took 4.8k cycles instead of 6.5k).
constexpr int kPPBN = 128;                 // a ping-pong tile's columns
constexpr int kPPStageBytes = 4 * kBox;    // A 128 x 64 + B 128 x 64
constexpr int kPPStages = 6;               // 192 KB, then the store buffers
constexpr int kPPHalfAcc = kPPBN / 2;      // accumulators of one m64n128 half
static_assert(2 * kPPHalfAcc == kAcc, "a ping-pong tile has the split tile's accumulators per thread");
using MmaPP = cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS<Major::MN, Major::MN>;

template <size_t... Is>
MOKGEN_DEVICE void mma_pp(uint64_t da, uint64_t db, float* acc, bool accumulate, std::index_sequence<Is...>) {
  MmaPP::fma(da, db, acc[Is]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// The first kSteps 16-row steps of a ping-pong k-block: rows 0..63 of the tile (A box 0) into
// acc[0, 64), rows 64..127 (A box 1) into acc[64, 128), both against B's two boxes.
template <int kSteps>
MOKGEN_DEVICE void mma_steps_pp(const unsigned char* sa, const unsigned char* sb, float* acc, bool accumulate) {
#pragma unroll
  for (int k16 = 0; k16 < kSteps; ++k16) {
    const uint64_t db = smem_desc_mn(sb + k16 * 2048);
#pragma unroll
    for (int mh = 0; mh < 2; ++mh)
      mma_pp(smem_desc_mn(sa + mh * kBox + k16 * 2048), db, acc + mh * kPPHalfAcc, accumulate || k16 > 0,
             std::make_index_sequence<kPPHalfAcc>{});
  }
}

// Producer of a ping-pong tile (t as the weight gradients' TileSrc; B 128 columns): A boxes
// (a_col + 64 h, a_row + k0), B boxes (b_col + 64 j, b_row + k0). kPair = 2: B box crank goes
// into both CTAs of the pair by multicast, the peer's the other.
template <int kPair = 1, class P>
MOKGEN_DEVICE void produce_pp(const Smem& s, P& pipe, const TileSrc& t, int crank = 0) {
  for (int kb = 0; kb < t.n_k; ++kb) {
    pipe_wait(&s.empty[pipe.stage], pipe.phase ^ 1u, pipe);
    unsigned char* st = s.stages + size_t(pipe.stage) * kPPStageBytes;
    uint64_t* full = &s.full[pipe.stage];
#ifdef MOKGEN_BWD_NO_LOAD  // as produce's (v0.26's "ping-pong, no loads" row still loaded: this was missing)
    mbar_arrive(full);
    pipe.advance();
    continue;
#endif
    mbar_arrive_expect_tx(full, kPPStageBytes);
    const int k0 = kb * kBK;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      cute::SM90_TMA_LOAD_2D::copy(t.a[0], full, 0, st + h * kBox, t.a_col + 64 * h, t.a_row + k0);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      unsigned char* dst = st + (2 + j) * kBox;
      if constexpr (kPair == 2) {
        if (j == crank)
          cute::SM90_TMA_LOAD_MULTICAST_2D::copy(t.b[0], full, uint16_t(0b11),
                                                 uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL), dst,
                                                 t.b_col + 64 * j, t.b_row + k0);
      } else {
        cute::SM90_TMA_LOAD_2D::copy(t.b[0], full, 0, dst, t.b_col + 64 * j, t.b_row + k0);
      }
    }
    pipe.advance();
  }
}

// Consumer warpgroup wg's ping-pong tile, after its turn (wait_turn; turn_phase: the parity of
// this thread's count of turns taken): every k-block into acc (two m64n128 halves; k_valid_last
// as consume), the turn handed to the other warpgroup once k-block `hand`'s wgmma are issued
// (hand_over). A short last k-block's tail rows are zeroed in all four boxes of the stage
// (this warpgroup's alone).
// The k-block of an n_k-block tile after which its warpgroup hands the turn over: `early`
// k-blocks before its last, but never before k-block n_k - kPPStages. The other warpgroup's
// first wait is on the position just past this tile, whose previous lap is this tile's k-block
// n_k - kPPStages: once this warpgroup has waited that one full, the producer has filled it.
MOKGEN_DEVICE int hand_over(int n_k, int early) {
  const int h = n_k - 1 - early, floor = n_k - kPPStages;
  return h > floor ? (h > 0 ? h : 0) : floor;
}

MOKGEN_DEVICE void wait_turn(const Smem& s, int wg, uint32_t& turn_phase) {
  mbar_wait(&s.turn[wg], turn_phase);
  turn_phase ^= 1u;
}

template <int kPair = 1, class P>
MOKGEN_DEVICE void consume_pp(const Smem& s, P& pipe, int wg, int n_k, int k_valid_last, float (&acc)[kAcc],
                              int hand) {
#ifdef MOKGEN_BWD_FULL_K  // as consume's
  k_valid_last = kBK;
#endif
  const int t = threadIdx.x & 127;
  if (n_k == 0) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
    if (t == 0) mbar_arrive(&s.turn[wg ^ 1]);
    return;
  }
  // full k-blocks in the loop, a short last one alone after it (as consume's)
  const bool short_last = k_valid_last < kBK;
  const int n_full = short_last ? n_k - 1 : n_k;
  int prev_stage = -1;
  auto retire = [&]() {  // as consume's (no stagger here: the turns order the warpgroups)
    fence_operands(acc);
    if (prev_stage >= 0) release<kPair>(s, prev_stage, t);
    prev_stage = pipe.stage;
    pipe.advance();
  };
#pragma unroll 2
  for (int kb = 0; kb < n_full; ++kb) {
    pipe_wait(&s.full[pipe.stage], pipe.phase, pipe);
    const unsigned char* st = s.stages + size_t(pipe.stage) * kPPStageBytes;
    fence_operands(acc);
    cute::warpgroup_arrive();
    mma_steps_pp<kBK / 16>(st, st + 2 * kBox, acc, kb > 0);
    cute::warpgroup_commit_batch();
    if (kb == hand && t == 0) mbar_arrive(&s.turn[wg ^ 1]);
    cute::warpgroup_wait<1>();
    retire();
  }
  if (short_last) {
    const int kb = n_k - 1;
    cute::warpgroup_wait<0>();  // nothing in flight from here to the switch's drain
    fence_operands(acc);
    pipe_wait(&s.full[pipe.stage], pipe.phase, pipe);
    unsigned char* st = s.stages + size_t(pipe.stage) * kPPStageBytes;
    const int steps = (k_valid_last + 15) / 16;
    if (k_valid_last % 16) {
#pragma unroll
      for (int b = 0; b < 4; ++b) zero_box_rows(st + b * kBox, k_valid_last, 16 * steps, t);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("bar.sync %0, 128;" ::"r"(4 + wg) : "memory");
    }
    const unsigned char* sa = st;
    const unsigned char* sb = st + 2 * kBox;
    fence_operands(acc);
    cute::warpgroup_arrive();
    issue_drained(steps, [&](auto n) { mma_steps_pp<decltype(n)::value>(sa, sb, acc, kb > 0); });
    if (kb == hand && t == 0) mbar_arrive(&s.turn[wg ^ 1]);
    retire();
  }
  cute::warpgroup_wait<0>();
  fence_operands(acc);
  release<kPair>(s, prev_stage, t);
}

// Epilogue stores of one consumer warpgroup: rows r < rows of the tile (r = 64 wg + ...), 256
// columns; tile row r goes to out row r, or to out row row_map[r] where a map is given (the
// rows GEMM's scatter to (token, slot) order). fp32 out (row stride ld floats): each lane
// stores its 2 columns per 8-column group (a quad writes 32 contiguous bytes of a row). bf16 out (row stride ld elements): as the
// forward's epilogue, two butterfly exchanges per 4 groups give each lane one whole group (16
// bytes), so a quad writes 64 contiguous bytes per store instead of 16.
template <class OutT>
MOKGEN_DEVICE void store_tile(const float (&acc)[kAcc], int wg, int rows, OutT* out, int64_t ld,
                              const int64_t* row_map = nullptr) {
  const int t = threadIdx.x & 127, w = t >> 5, lane = t & 31, q = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = wg * 64 + w * 16 + (lane >> 2) + half * 8;
    const bool valid = r < rows;  // the same for the 4 lanes of a quad (the shuffles need all 32)
    const int64_t out_row = !valid ? 0 : row_map != nullptr ? row_map[r] : r;
    OutT* row = out + out_row * ld;
    if constexpr (sizeof(OutT) == 4) {
#pragma unroll
      for (int i = 0; i < kAcc / 4; ++i)
        if (valid)
          *reinterpret_cast<float2*>(row + 8 * i + 2 * q) = make_float2(acc[4 * i + 2 * half], acc[4 * i + 2 * half + 1]);
    } else {
#pragma unroll
      for (int b = 0; b < kAcc / 16; ++b) {
        uint32_t word[4];  // this lane's 2 columns of groups 4b .. 4b + 3
#pragma unroll
        for (int u = 0; u < 4; ++u)
          word[u] = pack_bf16x2(acc[4 * (4 * b + u) + 2 * half], acc[4 * (4 * b + u) + 2 * half + 1]);
        const uint4 v = Tile::quad_transpose(word, q);  // group 4b + q, columns 0..7
        if (valid) *reinterpret_cast<uint4*>(row + 8 * (4 * b + q)) = v;
      }
    }
  }
}

// The weight gradients' epilogue through shared memory and TMA stores (v0.13). In-kernel traces
// (.ci/bwd_trace.py, docs/perf-notes.md v0.13) showed the register-to-global epilogue
// (store_tile: packs, quad exchanges, 16-byte stores) taking 2.7k of a tile's 10.9k cycles,
// with the tensor core idle for most of it. Here each consumer warpgroup writes its 64 x 256
// bf16 rows as four boxes of 64 x 64 (stmatrix, the accumulator fragments as they are, into
// the 128-byte swizzle the TMA expects: conflict-free), and one thread issues each box's TMA
// store. Two 8 KB buffers per warpgroup follow the stage ring, used in turn: before a buffer is
// written again, the store that last read it is done reading (cp.async.bulk.wait_group.read 1:
// at most the other buffer's store still reading). The stores drain at about 16 bytes per
// cycle per warpgroup, so the epilogue still waits out about half of its drain (2.1-2.3k
// cycles in all); buffers for the whole tile (32 KB per warpgroup) need the ring cut to three
// stages, and the k-loop then lost to the data waits what the epilogue gained (measured).
constexpr int kStoreBox = 64 * 64 * 2;  // 64 rows x 64 bf16 columns
constexpr int kStoreBoxes = kBN / 64;   // boxes of a warpgroup's 64 x 256 rows
constexpr int kStoreBuffers = 2;        // per consumer warpgroup
constexpr size_t kStagingBytes = 2 * size_t(kStoreBuffers) * kStoreBox;
constexpr size_t kWeightSmemBytes = ring_bytes(kWeightStages) + kStagingBytes;
static_assert(kWeightSmemBytes <= 232448, "the stage ring and the store buffers fit one SM's 227 KB");
constexpr size_t kPPSmemBytes = ring_bytes(kPPStages, kPPStageBytes) + kStagingBytes;  // the ping-pong's
static_assert(kPPSmemBytes <= 232448, "the ping-pong's ring and store buffers fit one SM's 227 KB");

// Buffer b of consumer warpgroup wg: after the stage ring (1024-aligned, as the swizzle needs).
MOKGEN_DEVICE unsigned char* store_buffer(const Smem& s, int wg, int b) {
  return s.after + size_t(kStoreBuffers * wg + b) * kStoreBox;
}

MOKGEN_DEVICE void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// This thread's TMA stores but the last kPending have read their shared memory (kDone false),
// or all are complete (kDone: written to global memory, before the kernel exits). Own asm:
// CuTe's wrappers call a sync-log hook, and a function call anywhere in a kernel serializes
// its wgmma (C7510).
template <int kPending, bool kDone = false>
MOKGEN_DEVICE void store_wait() {
  if constexpr (kDone)
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
  else
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Consumer warpgroup wg's rows of a weight-gradient tile: out rows row0 + 64 wg .. + 63 and
// columns col0 .. col0 + 255 of map `out` (bf16 [E M, N], boxes of 64 x 64, 128-byte swizzle).
// Box j (columns 64 j ..) goes through buffer j % 2. Thread 0 of the warpgroup issues the
// stores and waits for them; the bar.sync of the warpgroup's 128 threads (barrier 4 + wg, as
// the short k-block's zeroing) orders the buffer's reuse before its writes, and the writes
// before the store. stamps (trace builds only, else null): the SM clock after each box.
// kPP (the ping-pong's 128 x 128 tile, two m64n128 halves): box j holds rows 64 (j / 2) and
// columns 64 (j % 2) of the tile at out rows row0 + 64 (j / 2), whichever warpgroup stores it.
template <bool kPP = false>
MOKGEN_DEVICE void store_tile_tma(const float (&acc)[kAcc], const Smem& s, int wg, const CUtensorMap* out, int row0,
                                  int col0, long long* stamps = nullptr) {
  const int t = threadIdx.x & 127, w = t >> 5, lane = t & 31;
  // this lane's row address for stmatrix: matrix lane / 8 of each x4 (0: rows 16 w + 0..7 of the
  // first group, 1: rows + 8 of it, 2 and 3: the same of the second group), row lane % 8 of it
  const int mat = lane >> 3, r = 16 * w + (lane & 7) + 8 * (mat & 1), second = mat >> 1;
#pragma unroll
  for (int j = 0; j < kStoreBoxes; ++j) {
    unsigned char* buf = store_buffer(s, wg, j % kStoreBuffers);
    if (t == 0) store_wait<kStoreBuffers - 1>();  // the store that read this buffer last is done reading it
    asm volatile("bar.sync %0, 128;" ::"r"(4 + wg) : "memory");
    // the box's first 8-column accumulator group: m64n128 half j / 2 holds groups 16 (j / 2) ..
    const int group0 = kPP ? 16 * (j >> 1) + 8 * (j & 1) : 8 * j;
#pragma unroll
    for (int p = 0; p < 4; ++p) {  // groups group0 + 2 p and + 1: 16 columns each pair
      const int g0 = group0 + 2 * p, g1 = g0 + 1;
      const int chunk = 2 * p + second;  // 16-byte chunk of the box row (8 columns, one group)
      const uint32_t addr = smem_u32(buf + r * 128 + ((chunk ^ (r & 7)) << 4));
      stmatrix_x4(addr, pack_bf16x2(acc[4 * g0], acc[4 * g0 + 1]), pack_bf16x2(acc[4 * g0 + 2], acc[4 * g0 + 3]),
                  pack_bf16x2(acc[4 * g1], acc[4 * g1 + 1]), pack_bf16x2(acc[4 * g1 + 2], acc[4 * g1 + 3]));
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the writes, before the TMA reads them
    asm volatile("bar.sync %0, 128;" ::"r"(4 + wg) : "memory");
    if (t == 0) {
      if constexpr (kPP)
        cute::SM90_TMA_STORE_2D::copy(out, buf, col0 + 64 * (j & 1), row0 + 64 * (j >> 1));
      else
        cute::SM90_TMA_STORE_2D::copy(out, buf, col0 + 64 * j, row0 + 64 * wg);
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    if (stamps != nullptr) stamps[j] = clock64();
  }
}

// The end of a consumer warpgroup's stores: its thread 0 waits for them to complete.
MOKGEN_DEVICE void store_tma_done() {
  if ((threadIdx.x & 127) == 0) store_wait<0, true>();
}

// SwiGLU's backward of two adjacent columns (g0, u0, d0) and (g1, u1, d1) of a row with routing
// weight `weight` (dh = d weight): the packed bf16 pairs of h weight, dg and du, and the row's
// sum of d h carried on in `dot`. Every SwiGLU-backward pass of the library goes through this
// (the two GEMM epilogues, swiglu_saved_kernel), so they round the same floats the same way.
struct SwigluWords {
  uint32_t h, dg, du;
};
MOKGEN_DEVICE SwigluWords swiglu_words(float g0, float g1, float u0, float u1, float d0, float d1, float weight,
                                       bool clamp, float limit, float& dot) {
  const SwigluGrad a = swiglu_grad(g0, u0, d0 * weight, clamp, limit);
  const SwigluGrad c = swiglu_grad(g1, u1, d1 * weight, clamp, limit);
  dot = fmaf(d0, a.h, dot);
  dot = fmaf(d1, c.h, dot);
  return {pack_bf16x2(a.h * weight, c.h * weight), pack_bf16x2(a.dg, c.dg), pack_bf16x2(a.du, c.du)};
}

// A quad's words of 4 column groups (w[k]: this lane's 2 columns of group 4 b + k) stored as
// whole groups: the exchange hands lane q group 4 b + q's 8 columns, 16 bytes at row + 8 (4 b + q)
// of each output (valid: the quad's row is the tile's; the shuffles run for all lanes).
MOKGEN_DEVICE void store_swiglu_groups(const SwigluWords (&w)[4], int b, int q, bool valid, bf16* h, bf16* dg,
                                       bf16* du, int64_t row) {
  uint32_t wh[4], wdg[4], wdu[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    wh[k] = w[k].h;
    wdg[k] = w[k].dg;
    wdu[k] = w[k].du;
  }
  const uint4 vh = Tile::quad_transpose(wh, q), vdg = Tile::quad_transpose(wdg, q), vdu = Tile::quad_transpose(wdu, q);
  if (valid) {
    const int64_t at = row + 8 * (4 * b + q);
    *reinterpret_cast<uint4*>(h + at) = vh;
    *reinterpret_cast<uint4*>(dg + at) = vdg;
    *reinterpret_cast<uint4*>(du + at) = vdu;
  }
}

// A row's partial sum from its quad's 4 lanes, added in a fixed order (lanes q = 0..3), written
// by lane 0 of the quad to *out where the row is the tile's.
MOKGEN_DEVICE void store_quad_sum(float dot, int q, bool valid, float* out) {
  dot += __shfl_xor_sync(0xffffffffu, dot, 1);
  dot += __shfl_xor_sync(0xffffffffu, dot, 2);
  if (valid && q == 0) *out = dot;
}

// Epilogue of the gated recompute tile (acc: gate in groups 0..15, up in 16..31, as the
// forward's gated tile): for each of its rows r < rows and 128 columns c0 + ..., with
// dh = dh_u[r, c] wt[r]: hw = h wt[r] (the down projection's weight gradient is dOut^T hw, so
// no weighted copy of dOut is needed), dg, du (bf16, row stride ld) and, per row, the partial sum over
// these 128 columns of dh_u h (fp32, the routing weight's gradient; one float per row and
// column tile, summed over the tiles in order by the caller). Quad exchanges as store_tile.
MOKGEN_DEVICE void store_swiglu_grad(const float (&acc)[kAcc], int wg, int rows, const float* dh_u, const float* wt,
                                     bf16* h, bf16* dg, bf16* du, float* dw_part, int n_parts, int ld, bool clamp,
                                     float limit) {
  const int t = threadIdx.x & 127, w = t >> 5, lane = t & 31, q = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = wg * 64 + w * 16 + (lane >> 2) + half * 8;
    const bool valid = r < rows;  // the same for the 4 lanes of a quad
    const int64_t off = int64_t(valid ? r : 0) * ld;
    const float weight = valid ? wt[valid ? r : 0] : 0.f;
    float dot = 0.f;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      SwigluWords words[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = 4 * b + u;  // gate group i, up group i + 16: columns 8 i + 2 q + {0, 1}
        float2 d = make_float2(0.f, 0.f);
        if (valid) d = *reinterpret_cast<const float2*>(dh_u + off + 8 * i + 2 * q);
        words[u] = swiglu_words(acc[4 * i + 2 * half], acc[4 * i + 2 * half + 1], acc[4 * (i + 16) + 2 * half],
                                acc[4 * (i + 16) + 2 * half + 1], d.x, d.y, weight, clamp, limit, dot);
      }
      store_swiglu_groups(words, b, q, valid, h, dg, du, off);
    }
    store_quad_sum(dot, q, valid, dw_part + int64_t(r) * n_parts);
  }
}

// Group 4 b + q's 8 columns of a saved g or u row (zeros for a row past the tile's).
MOKGEN_DEVICE uint4 uv_load(const bf16* row, int b, int q, bool valid) {
#ifdef MOKGEN_DHSW_NO_LOADS  // a measuring variant (.ci/dh_swiglu_probe.py; wrong results): no g, u loads
  return make_uint4(0x3f803f80u ^ uint32_t(b), 0x3f803f80u, 0x3f803f80u, 0x3f803f80u ^ uint32_t(q));
#endif
  return valid ? *reinterpret_cast<const uint4*>(row + 8 * (4 * b + q)) : make_uint4(0, 0, 0, 0);
}

// The epilogue's g and u rows brought into L2 while the tile's k-loop runs (dh_swiglu_kernel),
// in the measuring build -DMOKGEN_DHSW_PREFETCH only (elsewhere load and prefetch do nothing):
// load() reads the pairs of this thread's two rows before the k-loop (a row past the tile's
// takes row 0's: no branch inside the k-loop, where a divergent path serializes the wgmma,
// C7520); prefetch(), consume's early(), has lane q of a quad prefetch 128-byte line q of its
// rows' 256 columns of g and of u. Measured 8% slower with it (docs/perf-notes.md v0.24).
struct SavedRows {
#ifdef MOKGEN_DHSW_PREFETCH
  static constexpr bool kOn = true;
#else
  static constexpr bool kOn = false;
#endif
  int64_t pair[2];
  MOKGEN_DEVICE void load(int wg, int rows, const int64_t* order) {
    if constexpr (kOn) {
      const int t = threadIdx.x & 127, w = t >> 5, lane = t & 31;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = wg * 64 + w * 16 + (lane >> 2) + half * 8;
        pair[half] = order[r < rows ? r : 0];
      }
    }
  }
  MOKGEN_DEVICE void prefetch(const bf16* gu, int I, int c0) const {
    if constexpr (kOn) {
      const int q = threadIdx.x & 3;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const bf16* g = gu + pair[half] * (2 * int64_t(I)) + c0 + 64 * q;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(g));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(g + I));
      }
    }
  }
};

// Epilogue of dh = dOut Wd with SwiGLU's backward from the saved pre-activations (v0.14: the
// "save" policy's dSwiGLU fused into the dh GEMM, where swiglu_saved_kernel made a pass over an
// fp32 dh_u): acc = dh_u of the tile's rows r < rows and 256 columns c0 .. of I. For each, g
// and u from row order[r] of gu (bf16 [pairs, 2 I]: g then u), dh = dh_u wt[r]; out hw = h
// wt[r], dg, du (bf16 rows of I, at h / dg / du + r I + c0) and, per row, the partial sum over
// these 256 columns of dh_u h (fp32, dw_part[r n_parts]; the caller sums a row's parts in
// order). The same float operations as swiglu_saved_kernel on the same fp32 dh_u, so hw, dg and
// du have its bits; the partial sums differ in order from its per-row sum. Per 4 groups, each
// lane loads one group's 8 columns of g and of u (16 bytes, as the stores write them), and the
// quad exchange (quad_transpose is its own inverse) hands each lane its 2 columns of all 4.
// Measured slower than the two passes (docs/perf-notes.md v0.14, v0.24: its arithmetic on the 8
// consumer warps, not these loads), so the backward takes it only under MOKGEN_BWD_DH_SWIGLU=1.
MOKGEN_DEVICE void store_swiglu_saved(const float (&acc)[kAcc], int wg, int rows, const int64_t* order,
                                      const bf16* gu, int I, int c0, const float* wt, bf16* h, bf16* dg, bf16* du,
                                      float* dw_part, int n_parts, bool clamp, float limit) {
  const int t = threadIdx.x & 127, w = t >> 5, lane = t & 31, q = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = wg * 64 + w * 16 + (lane >> 2) + half * 8;
    const bool valid = r < rows;  // the same for the 4 lanes of a quad (the shuffles need all 32)
    const int rr = valid ? r : 0;
    const bf16* g = gu + (valid ? order[rr] : 0) * (2 * int64_t(I)) + c0;
    const bf16* u = g + I;
    const int64_t off = int64_t(rr) * I + c0;
    const float weight = valid ? wt[rr] : 0.f;
    float dot = 0.f;
    // the loads run kAhead groups of 4 ahead of their use (registers: 8 words per group in
    // flight), rather than each behind the previous group's stores (the pointers may alias, so
    // the compiler could not hoist them): one latency per half instead of one per group
#ifndef MOKGEN_DHSW_AHEAD  // measuring variants (.ci/dh_swiglu_probe.py): 1 (each load one group ahead)
#define MOKGEN_DHSW_AHEAD 2
#endif
    constexpr int kAhead = MOKGEN_DHSW_AHEAD, kB = kAcc / 16;
    uint4 gbuf[kAhead], ubuf[kAhead];
#pragma unroll
    for (int b = 0; b < kAhead; ++b) {
      gbuf[b] = uv_load(g, b, q, valid);
      ubuf[b] = uv_load(u, b, q, valid);
    }
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const uint4 gv = gbuf[b % kAhead], uv = ubuf[b % kAhead];
      if (b + kAhead < kB) {
        gbuf[b % kAhead] = uv_load(g, b + kAhead, q, valid);
        ubuf[b % kAhead] = uv_load(u, b + kAhead, q, valid);
      }
      const uint32_t g_in[4] = {gv.x, gv.y, gv.z, gv.w}, u_in[4] = {uv.x, uv.y, uv.z, uv.w};
      const uint4 gq = Tile::quad_transpose(g_in, q), uq = Tile::quad_transpose(u_in, q);
      const uint32_t gw[4] = {gq.x, gq.y, gq.z, gq.w}, uw[4] = {uq.x, uq.y, uq.z, uq.w};
      SwigluWords words[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = 4 * b + k;  // group i: columns 8 i + 2 q + {0, 1}, bf16 pairs low then high
        words[k] = swiglu_words(bf16_lo(gw[k]), bf16_hi(gw[k]), bf16_lo(uw[k]), bf16_hi(uw[k]),
                                acc[4 * i + 2 * half], acc[4 * i + 2 * half + 1], weight, clamp, limit, dot);
      }
      store_swiglu_groups(words, b, q, valid, h, dg, du, off);
    }
    store_quad_sum(dot, q, valid, dw_part + int64_t(r) * n_parts);
  }
}

}  // namespace bwd
}  // namespace mokgen
