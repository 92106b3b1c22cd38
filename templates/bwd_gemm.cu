// The experts' backward GEMMs (issue 5, step 2): grouped rows GEMMs and weight-gradient GEMMs on
// the Hopper core of bwd_gemm.cuh, behind a C ABI that mokgen/bwd_gemm.py loads with ctypes. One
// library for every spec: the shapes (rows, K, N, M, experts) are run-time values; the tiles are
// fixed (128 x 256 x 64, four stages).
#include <cuda.h>
#include <cuda_runtime.h>

#include "mokgen/bwd_fused.cuh"
#include "mokgen/bwd_gemm.cuh"

namespace {

using namespace mokgen;

// Trace builds only (-DMOKGEN_BWD_TRACE; .ci/bwd_trace.py compiles one and reads it): each CTA of
// the weight-gradient kernel writes, for its first g_trace_tiles tiles and each role (0: the
// producer, 1 and 2: the consumer warpgroups), eight values: the SM clock at the tile's start,
// at the end of its k-loop (the consumers; the producer: its last load issued), at the end of
// its epilogue, the cycles spent in stage-barrier waits within the tile, and (consumers) the
// clock after each of the epilogue's four boxes. All threads of a role write the same slots (no branch on the thread index, which
// would make ptxas serialize the wgmma). The library's other builds have none of this.
#ifdef MOKGEN_BWD_TRACE
__device__ unsigned long long* g_trace_buf = nullptr;
__device__ int g_trace_tiles = 0;
constexpr int kTraceValues = 8;
MOKGEN_DEVICE void trace_record(int role, int tile, long long t0, long long t1, long long waited,
                                const long long (&rounds)[4]) {
  unsigned long long* buf = g_trace_buf;
  const int tiles = g_trace_tiles;
  if (buf != nullptr && tile < tiles) {
    unsigned long long* p = buf + ((size_t(blockIdx.x) * tiles + tile) * 3 + role) * kTraceValues;
    p[0] = t0;
    p[1] = t1;
    p[2] = clock64();
    p[3] = waited;
#pragma unroll
    for (int i = 0; i < 4; ++i) p[4 + i] = rounds[i];
  }
}
#define MOKGEN_TRACE_STATE() int traced = 0
#define MOKGEN_TRACE_BEGIN()                                             \
  const long long trace_t0 = clock64(), trace_w0 = pipe.waited; \
  long long trace_t1 = 0, trace_rounds[4] = {0, 0, 0, 0}
#define MOKGEN_TRACE_MARK() trace_t1 = clock64()
#define MOKGEN_TRACE_ROUNDS trace_rounds
#define MOKGEN_TRACE_END(role) \
  trace_record(role, traced++, trace_t0, trace_t1 ? trace_t1 : clock64(), pipe.waited - trace_w0, trace_rounds)
#else
#define MOKGEN_TRACE_STATE() (void)0
#define MOKGEN_TRACE_BEGIN() (void)0
#define MOKGEN_TRACE_MARK() (void)0
#define MOKGEN_TRACE_ROUNDS nullptr
#define MOKGEN_TRACE_END(role) (void)0
#endif

struct Maps {
  CUtensorMap a[2];
  CUtensorMap b[2];
  CUtensorMap c;   // the weight gradients' output (TMA stores); unused by the other kernels
  CUtensorMap c1;  // the joint weight gradients' second output (weight_kernel<..., true>)
};

// Rows GEMM: out[r, :] (OutT: fp32, or bf16 rounded from the fp32 sums; ld = N) = sum_p A_p[r, :]
// B_p[e(r)], K per pair. B MN-major: B_p is [E, K, N] (map over [E K, N]); B K-major: B_p is
// [E, N, K] (map over [E N, K]).
// kPair = 2: clusters of two CTAs computing column tiles 2 np and 2 np + 1 of one row block,
// sharing A (bwd_gemm.cuh); N / 256 even. The same tiles and k order either way, so the same bits.
// band: the tile walk's bands of row blocks (bwd_tiles.cuh walk_row_tiles; g_band). The same bits
// at every band.
// kGather (single CTAs, B MN-major, one pair): A row r is source row ga.index[r] of ga.src,
// loaded by warpgroup 0's 128 threads (bwd::produce_gathered) instead of the TMA; maps.a unused.
template <bool kBMN, class OutT, int kPair = 1, bool kGather = false>
__global__ void __launch_bounds__(bwd::kThreads, 1)
    rows_kernel(const __grid_constant__ Maps maps, const int32_t* offs, int E, int total, int K, int N, int pairs,
                OutT* out, const int64_t* out_rows, int lead, bwd::Gather ga, int band) {
  static_assert(!kGather || (kPair == 1 && kBMN), "gathered rows GEMMs: single CTAs, B MN-major");
  extern __shared__ __align__(1024) unsigned char smem[];
  const bwd::Smem s =
      bwd::start_pipeline<bwd::kStages, kPair, bwd::kStageBytes, 2, kGather ? bwd::kGatherFull : 1>(smem);
  const int n_tiles = N / bwd::kBN, kb_per_pair = K / bwd::kBK;
  const int crank = bwd::pair_rank<kPair>();
  auto pipe = bwd::make_pipe<bwd::kStages>(lead);
  bwd::run_roles<kPair, kGather>(
      s, pipe,
      [&](auto&& fn) {
        bwd::walk_row_tiles(offs, E, total, n_tiles, int(blockIdx.x) / kPair, int(gridDim.x) / kPair, fn, kPair,
                            crank, band);
      },
      [&](int e, int row0, int rows, int n) {
        bwd::TileSrc t;
        for (int p = 0; p < 2; ++p) {
          t.a[p] = &maps.a[p];
          t.b[p] = &maps.b[p];
        }
        t.a_row = row0;
        t.a_col = 0;
        t.b_row = kBMN ? e * K : e * N + n * bwd::kBN;
        t.b_col = n * bwd::kBN;
        t.n_k = pairs * kb_per_pair;
        t.kb_per_pair = kb_per_pair;
        t.a_rows = rows;
        if constexpr (kGather) {
          const int64_t unused[4] = {0, 0, 0, 0};  // a K-major A loads its rows' sources itself
          bwd::produce_gathered<false, kBMN>(s, pipe, t, ga, unused);
        } else {
          bwd::produce<false, kBMN, false, kPair, true>(s, pipe, t, crank);
        }
      },
      [&](int wg, int e, int row0, int rows, int n) {
        float acc[bwd::kAcc];
        bwd::consume<false, kBMN, kPair, kGather>(s, pipe, wg, pairs * kb_per_pair, bwd::kBK, acc);
        if (out_rows != nullptr)
          bwd::store_tile(acc, wg, rows, out + n * bwd::kBN, N, out_rows + row0);
        else
          bwd::store_tile(acc, wg, rows, out + int64_t(row0) * N + n * bwd::kBN, N);
      });
}

// k-blocks of a weight-gradient tile whose K is an expert's `rows` (0 for an expert without rows).
MOKGEN_DEVICE int weight_k_blocks(int rows) { return (rows + bwd::kBK - 1) / bwd::kBK; }

// The weight kernels' tile walk (both schedules): this CTA's (or pair's) tiles of E x m_tiles x
// n_tiles, as run_roles takes it (walk(fn)).
template <int kPair>
MOKGEN_DEVICE auto weight_walk(const int32_t* offs, int E, int total, int m_tiles, int n_tiles, int crank) {
  return [=](auto&& fn) {
    bwd::walk_weight_tiles(offs, E, total, m_tiles, n_tiles, int(blockIdx.x) / kPair, int(gridDim.x) / kPair, fn,
                           kPair, crank);
  };
}

// Two weight-gradient problems over one B, stacked along M (weight_kernel's joint form, the gate
// and up projections' dW = dg^T x and du^T x): the M tiles of problem 1 follow problem 0's, each
// problem's A its own map (maps.a[p]) and its output its own map (maps.c, maps.c1).
struct StackedM {
  int p;    // the problem of M row m0
  int col;  // m0 within the problem's A columns and output rows
  MOKGEN_DEVICE StackedM(int m0, int Mp) : p(m0 >= Mp), col(m0 >= Mp ? m0 - Mp : m0) {}
};

// Where a weight-gradient tile's k-blocks come from (both kernels): A columns m * 128 .., B
// columns col0 .., both from k row row0 (the expert's first), one operand pair. kJoint: M tile m
// of the two stacked problems (StackedM, Mp rows each), A from that problem's map.
// bm: the expert's row-bounded maps (bwd::use_bounded), null for the template maps.
template <bool kJoint = false>
MOKGEN_DEVICE bwd::TileSrc weight_tile(const Maps& maps, int row0, int rows, int m, int col0, int Mp = 0,
                                       const CUtensorMap* bm = nullptr) {
  int p = 0, a_col = m * bwd::kBM;
  if constexpr (kJoint) {
    const StackedM sm(a_col, Mp);
    p = sm.p;
    a_col = sm.col;
  }
  bwd::TileSrc t;
  t.a[0] = t.a[1] = &maps.a[p];
  t.b[0] = t.b[1] = &maps.b[0];
  t.a_row = row0;
  t.a_col = a_col;
  t.b_row = row0;
  t.b_col = col0;
  t.n_k = weight_k_blocks(rows);
  t.kb_per_pair = t.n_k > 0 ? t.n_k : 1;
  t.a_rows = rows;
  if (bm != nullptr) bwd::use_bounded(t, bm, p);
  return t;
}

// The k rows that a weight-gradient tile's last k-block holds for the consumers: the expert's
// own (the short k-block path: the consumers zero the rest of its last 16-row step) without
// bounded maps. With them the TMA zero-filled the rest, so nothing needs zeroing: the split
// tiles run it as a full k-block (kSteps false: kBK, in the loop, no drain), the ping-pong's
// (kSteps true) up to its last 16-row step holding expert rows (a multiple of 16: the short
// path's issue without its zeroing; measured against the full k-block, docs/perf-notes.md v0.30).
template <bool kSteps = false>
MOKGEN_DEVICE int weight_k_last(int rows, int n_k, const CUtensorMap* bounded) {
  const int own = rows - (n_k - 1) * bwd::kBK;
  if (bounded == nullptr) return own;
  return kSteps ? (own + 15) / 16 * 16 : bwd::kBK;
}

// Weight gradients: out[e] (bf16 [M, N], maps.c over [E M, N]) = A[rows of e]^T B[rows of e];
// A [rows, M], B [rows, N]. kPair = 2: clusters of two CTAs, row blocks 2 mp and 2 mp + 1 sharing
// B (bwd_gemm.cuh); M / 128 even. The same tiles and k order either way, so the same bits. The
// epilogue stores through shared memory (store_tile_tma): kWeightSmemBytes.
// kJoint (M = 2 Mp): two problems sharing B, out_p[e] = A_p[rows of e]^T B[rows of e] with A_p =
// maps.a[p] [rows, Mp] and out_p = maps.c, maps.c1 over [E Mp, N] (StackedM). An expert's tiles
// of both problems are walked together, so its B rows are read from memory once for both (the
// gate's and up's dW share the x rows); each tile is the single problem's, so the same bits.
// kGather (single CTAs): one operand's k row r is source row ga.index[r] of ga.src, loaded by
// warpgroup 0's 128 threads (bwd::produce_gathered): for one problem A's (M columns; dW_down =
// dOut^T hw from dOut's token rows; maps.a unused), for the joint form B's (N columns; dWg, dWu
// from x's token rows, MOKGEN_BWD_X=inline; maps.b unused).
// steps (MOKGEN_BWD_TAIL=steps, g_steps): with bounded maps, a tile's last k-block issues only its
// 16-row steps that hold the expert's rows (bwd::consume's kLastSteps), picked per tile by a
// switch between tiles; 0: all four, as tail tma.
// kSum (the joint TMA form only): warpgroup 0's idle warps also sum dX over each token's slots
// (bwd::SlotSum, `sum`; MOKGEN_BWD_SUM=side), the bits of sum_slots_kernel.
template <int kPair, bool kJoint = false, bool kGather = false, bool kSum = false>
__global__ void __launch_bounds__(bwd::kThreads, 1)
    weight_kernel(const __grid_constant__ Maps maps, const int32_t* offs, int E, int total, int M, int N, int lead,
                  int Mp, bwd::Gather ga, const CUtensorMap* bounded, int steps, bwd::SlotSum sum) {
  static_assert(!kGather || kPair == 1, "gathered weight gradients: single CTAs");
  static_assert(!kSum || (kJoint && !kGather), "the slots' sum rides on the joint TMA form");
  extern __shared__ __align__(1024) unsigned char smem[];
  const bwd::Smem s = bwd::start_pipeline<bwd::kWeightStages, kPair, bwd::kStageBytes, 2,
                                          kGather ? bwd::kGatherFull : 1>(smem);
  const int m_tiles = M / bwd::kBM, n_tiles = N / bwd::kBN;
  const int crank = bwd::pair_rank<kPair>();
  auto pipe = bwd::make_pipe<bwd::kWeightStages>(lead);
  MOKGEN_TRACE_STATE();
  // the gathering producer issues each tile one step behind the walk (bwd::GatherAhead); the
  // walk then ends with one call at e = -1, which the producer takes to issue its last tile
  // and the consumers ignore
  bwd::GatherAhead<kJoint> ahead;
  bwd::BoundedMaps bmaps{bounded, E};
  const auto walk = weight_walk<kPair>(offs, E, total, m_tiles, n_tiles, crank);
  bwd::run_roles<kPair, kGather>(
      s, pipe,
      [&](auto&& fn) {
        walk(fn);
        if constexpr (kGather) fn(-1, 0, 0, 0, 0);
      },
      [&](int e, int row0, int rows, int m, int n) {
        if constexpr (kGather) {
          if (e < 0)
            ahead.finish(s, pipe, ga);
          else
            ahead.next(s, pipe,
                       weight_tile<kJoint>(maps, row0, rows, m, n * bwd::kBN, Mp, bounded ? bmaps.of(e) : nullptr), ga);
        } else {
          MOKGEN_TRACE_BEGIN();
          bwd::produce<true, true, false, kPair>(
              s, pipe, weight_tile<kJoint>(maps, row0, rows, m, n * bwd::kBN, Mp, bounded ? bmaps.of(e) : nullptr),
              crank);
          MOKGEN_TRACE_END(0);
        }
      },
      [&](int wg, int e, int row0, int rows, int m, int n) {
        if constexpr (kGather)
          if (e < 0) return;
        MOKGEN_TRACE_BEGIN();
        float acc[bwd::kAcc];
        const int n_k = weight_k_blocks(rows);
        const int k_last = weight_k_last(rows, n_k, bounded);
        // a bounded last k-block's steps that hold expert rows (4: all; warp-uniform, from the walk)
#ifdef MOKGEN_BWD_FULL_K  // the measuring variant's every k-block full (bwd::consume): all four steps too
        const int last_steps = 4;
#else
        const int last_steps = steps && bounded != nullptr && n_k > 0 ? weight_k_last<true>(rows, n_k, bounded) / 16 : 4;
#endif
        switch (last_steps) {  // between tiles: no wgmma in flight across it
          case 1: bwd::consume<true, true, kPair, kGather, 1>(s, pipe, wg, n_k, k_last, acc); break;
          case 2: bwd::consume<true, true, kPair, kGather, 2>(s, pipe, wg, n_k, k_last, acc); break;
          case 3: bwd::consume<true, true, kPair, kGather, 3>(s, pipe, wg, n_k, k_last, acc); break;
          default: bwd::consume<true, true, kPair, kGather>(s, pipe, wg, n_k, k_last, acc); break;
        }
        MOKGEN_TRACE_MARK();
#ifdef MOKGEN_BWD_NO_EPILOGUE  // a measuring variant only (.ci/bwd_trace.py): no stores, wrong results
        bwd::sink(acc);
#else
        if constexpr (kJoint) {
          const StackedM sm(m * bwd::kBM, Mp);
          bwd::store_tile_tma(acc, s, wg, sm.p ? &maps.c1 : &maps.c, e * Mp + sm.col, n * bwd::kBN,
                              MOKGEN_TRACE_ROUNDS);
        } else {
          bwd::store_tile_tma(acc, s, wg, &maps.c, e * M + m * bwd::kBM, n * bwd::kBN, MOKGEN_TRACE_ROUNDS);
        }
#endif
        MOKGEN_TRACE_END(1 + wg);
      },
      std::conditional_t<kSum, bwd::SlotSumSide, bwd::NoSide>(sum));
  bwd::store_tma_done();  // the consumers' last stores complete before the CTA exits
}

// Weight gradients in ping-pong (bwd_gemm.cuh, "The weight gradients in ping-pong"): the same
// out, A and B, tiles of 128 x 128 (N % 128 == 0), each a consumer warpgroup's whole; the CTA's
// tiles go to warpgroups 0, 1, 0, ... in walk order. kPair = 2 as weight_kernel (B shared).
template <int kPair>
__global__ void __launch_bounds__(bwd::kThreads, 1)
    weight_pp_kernel(const __grid_constant__ Maps maps, const int32_t* offs, int E, int total, int M, int N,
                     int early, const CUtensorMap* bounded) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const bwd::Smem s = bwd::start_pipeline<bwd::kPPStages, kPair, bwd::kPPStageBytes, 1>(smem);
  const int m_tiles = M / bwd::kBM, n_tiles = N / bwd::kPPBN;
  const int crank = bwd::pair_rank<kPair>();
  auto pipe = bwd::make_pipe<bwd::kPPStages>(0);
  int tile = 0;              // this CTA's tiles so far (a consumer's: whose tile is next)
  uint32_t turn_phase = 0;   // a consumer's turns taken, mod 2
  bwd::BoundedMaps bmaps{bounded, E};
  MOKGEN_TRACE_STATE();
  bwd::run_roles<kPair>(
      s, pipe,
      weight_walk<kPair>(offs, E, total, m_tiles, n_tiles, crank),
      [&](int e, int row0, int rows, int m, int n) {
        MOKGEN_TRACE_BEGIN();
        bwd::produce_pp<kPair>(
            s, pipe, weight_tile(maps, row0, rows, m, n * bwd::kPPBN, 0, bounded ? bmaps.of(e) : nullptr), crank);
        MOKGEN_TRACE_END(0);
      },
      [&](int wg, int e, int row0, int rows, int m, int n) {
        const int n_k = weight_k_blocks(rows);
        if ((tile++ & 1) != wg) {  // the other warpgroup's tile: its stages, not waited for
          pipe.advance_by(n_k);
          return;
        }
        bwd::wait_turn(s, wg, turn_phase);
        MOKGEN_TRACE_BEGIN();
        float acc[bwd::kAcc];
        bwd::consume_pp<kPair>(s, pipe, wg, n_k, weight_k_last<true>(rows, n_k, bounded), acc, bwd::hand_over(n_k, early));
        MOKGEN_TRACE_MARK();
#ifdef MOKGEN_BWD_NO_EPILOGUE  // as weight_kernel's
        bwd::sink(acc);
#else
        bwd::store_tile_tma<true>(acc, s, wg, &maps.c, e * M + m * bwd::kBM, n * bwd::kPPBN, MOKGEN_TRACE_ROUNDS);
#endif
        MOKGEN_TRACE_END(1 + wg);
      });
  bwd::store_tma_done();
}

// The recompute of the up projection with SwiGLU's backward in the epilogue: for each row r of
// expert e and 128 columns of I, g and u (fp32, one gated wgmma tile: w_gate and w_up rows), then
// h wt[r], dg, du (bf16 [rows, I]) for dh = dh_u[r] wt[r], and dw_part[r, n] = sum over the
// tile's columns of dh_u h (fp32 [rows, I / 128]).
struct SwigluOut {
  bf16* h;
  bf16* dg;
  bf16* du;
  float* dw_part;
  const float* dh_u;
  const float* wt;
};

__global__ void __launch_bounds__(bwd::kThreads, 1)
    swiglu_kernel(const __grid_constant__ Maps maps, const int32_t* offs, int E, int total, int H, int I, SwigluOut o,
                  int clamp, float limit, int lead) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const bwd::Smem s = bwd::start_pipeline<bwd::kStages>(smem);
  const int n_tiles = I / 128, n_k = H / bwd::kBK;
  auto pipe = bwd::make_pipe<bwd::kStages>(lead);
  bwd::run_roles(
      s, pipe,
      [&](auto&& fn) { bwd::walk_row_tiles(offs, E, total, n_tiles, int(blockIdx.x), int(gridDim.x), fn); },
      [&](int e, int row0, int rows, int n) {
        bwd::TileSrc t;
        t.a[0] = t.a[1] = &maps.a[0];
        t.b[0] = &maps.b[0];
        t.b[1] = &maps.b[1];
        t.a_row = row0;
        t.a_col = 0;
        t.b_row = e * I + n * 128;
        t.b_col = 0;
        t.n_k = n_k;
        t.kb_per_pair = n_k;
        bwd::produce<false, false, true>(s, pipe, t);
      },
      [&](int wg, int e, int row0, int rows, int n) {
        float acc[bwd::kAcc];
        bwd::consume<false, false>(s, pipe, wg, n_k, bwd::kBK, acc);
        const int64_t at = int64_t(row0) * I + n * 128;
        bwd::store_swiglu_grad(acc, wg, rows, o.dh_u + at, o.wt + row0, o.h + at, o.dg + at, o.du + at,
                               o.dw_part + int64_t(row0) * n_tiles + n, n_tiles, I, clamp != 0, limit);
      });
}

// dh = dOut Wd[e] for the rows of each expert with SwiGLU's backward from the saved
// pre-activations in the epilogue (bwd_gemm.cuh, store_swiglu_saved): the rows GEMM with B
// MN-major (w_down [E, H, I], map over [E H, I]), K = H, N = I, one operand pair.
struct SavedSwiglu {
  const bf16* gu;
  const int64_t* order;
  const float* wt;
  bf16* h;
  bf16* dg;
  bf16* du;
  float* dw_part;
};

// kGather: go's rows come through ga's index (dOut's token rows, bwd::produce_gathered by
// warpgroup 0's 128 threads, as rows_kernel's), not from a gathered copy; maps.a unused.
// In the measuring build -DMOKGEN_DHSW_PREFETCH each consumer thread also prefetches its rows'
// g and u into L2 after the first k-block (bwd::SavedRows): measured slower, perf-notes v0.24.
template <bool kGather>
__global__ void __launch_bounds__(bwd::kThreads, 1)
    dh_swiglu_kernel(const __grid_constant__ Maps maps, const int32_t* offs, int E, int total, int H, int I,
                     SavedSwiglu o, int clamp, float limit, int lead, bwd::Gather ga) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const bwd::Smem s =
      bwd::start_pipeline<bwd::kStages, 1, bwd::kStageBytes, 2, kGather ? bwd::kGatherFull : 1>(smem);
  const int n_tiles = I / bwd::kBN, n_k = H / bwd::kBK;
  auto pipe = bwd::make_pipe<bwd::kStages>(lead);
  bwd::run_roles<1, kGather>(
      s, pipe,
      [&](auto&& fn) { bwd::walk_row_tiles(offs, E, total, n_tiles, int(blockIdx.x), int(gridDim.x), fn); },
      [&](int e, int row0, int rows, int n) {
        bwd::TileSrc t;
        t.a[0] = t.a[1] = &maps.a[0];
        t.b[0] = t.b[1] = &maps.b[0];
        t.a_row = row0;
        t.a_col = 0;
        t.b_row = e * H;
        t.b_col = n * bwd::kBN;
        t.n_k = n_k;
        t.kb_per_pair = n_k;
        t.a_rows = rows;
        if constexpr (kGather) {
          const int64_t unused[4] = {0, 0, 0, 0};  // a K-major A loads its rows' sources itself
          bwd::produce_gathered<false, true>(s, pipe, t, ga, unused);
        } else {
          bwd::produce<false, true>(s, pipe, t);
        }
      },
      [&](int wg, int e, int row0, int rows, int n) {
        float acc[bwd::kAcc];
        bwd::SavedRows saved;
        saved.load(wg, rows, o.order + row0);
        const int c0 = n * bwd::kBN;
        bwd::consume<false, true, 1, kGather>(s, pipe, wg, n_k, bwd::kBK, acc,
                                              [&]() { saved.prefetch(o.gu, I, c0); });
        const int64_t at = int64_t(row0) * I;
        bwd::store_swiglu_saved(acc, wg, rows, o.order + row0, o.gu, I, c0, o.wt + row0, o.h + at, o.dg + at,
                                o.du + at, o.dw_part + int64_t(row0) * n_tiles + n, n_tiles, clamp != 0, limit);
      });
}

// The weight gradients' row-bounded maps (bwd_gemm.cuh, kBoundedMaps): ws[kBoundedMaps e + j] =
// maps.a[0], maps.a[1], maps.b[0] (j = 0, 1, 2) with their row count set to offs[e], the end
// row of expert e (clamped to [1, rows]: an expert with no rows has no k-block to load). One
// thread per copy: the template's 128 bytes, tensormap.replace of global dim 1 (the rows; dim 0
// is the columns), then the release that the weight kernel's producer acquires
// (bwd::tensormap_acquire). Launched on the GEMM's stream just before it.
__global__ void __launch_bounds__(128)
    bound_maps_kernel(const __grid_constant__ Maps maps, const int32_t* offs, int E, int rows, CUtensorMap* ws) {
  const int i = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= bwd::kBoundedMaps * E) return;
  const int e = i / bwd::kBoundedMaps, j = i % bwd::kBoundedMaps;
  const CUtensorMap* src = j == 0 ? &maps.a[0] : j == 1 ? &maps.a[1] : &maps.b[0];
  const uint4* from = reinterpret_cast<const uint4*>(src);
  uint4* to = reinterpret_cast<uint4*>(ws + i);
#pragma unroll
  for (int w = 0; w < int(sizeof(CUtensorMap) / sizeof(uint4)); ++w) to[w] = from[w];
  const int bound = min(max(offs[e], 1), rows);
  asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], 1, %1;" ::"l"(__cvta_generic_to_global(ws + i)),
               "r"(bound)
               : "memory");
  asm volatile("fence.proxy.tensormap::generic.release.gpu;" ::: "memory");
}

// Rows from offs[E - 1] on (pairs no expert computed) of three bf16 [rows, N] outputs: zeros.
__global__ void __launch_bounds__(256) zero_rows3_kernel(bf16* a, bf16* b, bf16* c, const int32_t* offs, int E, int rows,
                                                         int N) {
  const int first = min(max(offs[E - 1], 0), rows);
  const int64_t per_row = N / 8, total = int64_t(rows - first) * per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t at = (first + i / per_row) * N + 8 * (i % per_row);
    *reinterpret_cast<uint4*>(a + at) = make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(b + at) = make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(c + at) = make_uint4(0, 0, 0, 0);
  }
}

// SwiGLU's backward from the pre-activations the forward saved (mokgen.backward's "save" policy,
// which replaces swiglu_kernel's recompute): for expert-major row i < offs[E - 1], pair order[i]:
// g, u = gu[order[i]] (bf16 [g | u], 2 I per row), dh = dh_u[i] wt[i]; out h wt[i], dg, du (bf16
// [rows, I]) and dw[i] = sum_c dh_u[i, c] h[i, c] (fp32); zeros for rows past offs[E - 1] (pairs
// no expert computed). One warp per row, 8 columns per lane and step (16-byte loads of g and u);
// each lane sums its columns in order, then a fixed butterfly over the lanes: the same bits on
// every run. DhT: dh_u in fp32, or in bf16 (the dh GEMM's fp32 sums rounded once: half the
// bytes written and read; MOKGEN_BWD_DH).
MOKGEN_DEVICE void load8(const float* p, float (&d)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  d[0] = a.x, d[1] = a.y, d[2] = a.z, d[3] = a.w, d[4] = b.x, d[5] = b.y, d[6] = b.z, d[7] = b.w;
}
MOKGEN_DEVICE void load8(const bf16* p, float (&d)[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    d[2 * k] = bwd::bf16_lo(w[k]);
    d[2 * k + 1] = bwd::bf16_hi(w[k]);
  }
}

// One row of it, by the 32 lanes of a warp (expert-major row `row` < offs[E - 1], pair
// order[row]): swiglu_saved_kernel's rows and the fused backward's background warps (fused_kernel)
// both go through this, so their bits are the same. Two 256-column steps' loads are issued
// before either is computed (more bytes in flight for the fused kernel's three warps per SM);
// the arithmetic and its order are the step-by-step loop's. kCg: dh_u read through L2 only (the
// fused kernel's dh rows come from other SMs' stores in the same launch).
template <class DhT, bool kCg = false>
MOKGEN_DEVICE void swiglu_saved_row(bf16* __restrict__ h, bf16* __restrict__ dg, bf16* __restrict__ du,
                                    float* __restrict__ dw, const bf16* __restrict__ gu,
                                    const int64_t* __restrict__ order, const DhT* __restrict__ dh_u,
                                    const float* __restrict__ wt, int row, int I, int lane, int clamp, float limit) {
  const bf16* g = gu + order[row] * (2 * int64_t(I));
  const bf16* u = g + I;
  const int64_t at = int64_t(row) * I;
  const float weight = wt[row];
  float dot = 0.f;
  for (int c0 = lane * 8; c0 < I; c0 += 512) {
    uint4 gv[2], uv[2];
    float d[2][8];
    const bool two = c0 + 256 < I;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (k == 1 && !two) break;
      const int c = c0 + 256 * k;
      gv[k] = *reinterpret_cast<const uint4*>(g + c);
      uv[k] = *reinterpret_cast<const uint4*>(u + c);
      if constexpr (kCg && sizeof(DhT) == 2) {
        const uint4 v = __ldcg(reinterpret_cast<const uint4*>(dh_u + at + c));
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          d[k][2 * j] = bwd::bf16_lo(w[j]);
          d[k][2 * j + 1] = bwd::bf16_hi(w[j]);
        }
      } else {
        load8(dh_u + at + c, d[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (k == 1 && !two) break;
      const int c = c0 + 256 * k;
      const bf16* gs = reinterpret_cast<const bf16*>(&gv[k]);
      const bf16* us = reinterpret_cast<const bf16*>(&uv[k]);
      uint32_t wh[4], wdg[4], wdu[4];
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        const bwd::SwigluWords w =
            bwd::swiglu_words(__bfloat162float(gs[j]), __bfloat162float(gs[j + 1]), __bfloat162float(us[j]),
                              __bfloat162float(us[j + 1]), d[k][j], d[k][j + 1], weight, clamp != 0, limit, dot);
        wh[j / 2] = w.h;
        wdg[j / 2] = w.dg;
        wdu[j / 2] = w.du;
      }
      *reinterpret_cast<uint4*>(h + at + c) = make_uint4(wh[0], wh[1], wh[2], wh[3]);
      *reinterpret_cast<uint4*>(dg + at + c) = make_uint4(wdg[0], wdg[1], wdg[2], wdg[3]);
      *reinterpret_cast<uint4*>(du + at + c) = make_uint4(wdu[0], wdu[1], wdu[2], wdu[3]);
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, m);
  if (lane == 0) dw[row] = dot;
}

template <class DhT>
__global__ void __launch_bounds__(256)
    swiglu_saved_kernel(bf16* h, bf16* dg, bf16* du, float* dw, const bf16* gu, const int64_t* order, const DhT* dh_u,
                        const float* wt, const int32_t* offs, int E, int rows, int I, int clamp, float limit) {
  const int row = int((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int n = min(max(offs[E - 1], 0), rows);
  const int64_t at = int64_t(row) * I;
  if (row >= n) {
    for (int c = lane * 8; c < I; c += 256) {
      *reinterpret_cast<uint4*>(h + at + c) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(dg + at + c) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(du + at + c) = make_uint4(0, 0, 0, 0);
    }
    if (lane == 0) dw[row] = 0.f;
    return;
  }
  swiglu_saved_row<DhT>(h, dg, du, dw, gu, order, dh_u, wt, row, I, lane, clamp, limit);
}

// ---------------------------------------------------------------------------------------------
// The fused backward (v0.23; bwd_gemm.fused_backward, MOKGEN_BWD_FUSED): the experts' GEMM chain
// of the save policy in one persistent launch, in bwd_fused.cuh's order (its header comment
// gives the order, the dependencies and why they cannot deadlock):
//   dh = go Wd[e]             (rows tile, bf16 rows to `dh`: the rows GEMM's bits)
//   swiglu(block)             hw, dg, du, dw from dh and the saved g, u (swiglu_saved_row's bits),
//                             by warps 1-3 of warpgroup 0, which the TMA producer (thread 0)
//                             leaves idle: the elementwise pass overlaps the GEMMs
//   dx = dg Wg[e] + du Wu[e]  (rows tile, bf16 pair rows scattered by `order`)
//   dWd = go^T hw, [dWg; dWu] = [dg; du]^T x   (weight tiles, TMA-store epilogue)
// Each tile is the separate kernels' tile (the same producer, consumer and epilogue code), so
// every output has the bits of the launches it replaces. Dependencies are counters in global
// memory (zeroed by the host before the launch): dh_done[b] counts the consumer warpgroups done
// with block b's dh tiles, sw_done[b] is set once block b's swiglu rows are written. Writers
// store, fence, and one thread releases; waiters acquire (and fence to the async proxy where
// the TMA reads what generic stores wrote). A wait that outlasts kWaitCycles traps.
struct FusedMaps {
  CUtensorMap go;           // dOut rows in the rows' order [rows, H] (dh's A, K-major; dWd's A, MN-major)
  CUtensorMap wd;           // w_down over [E H, I] (dh's B, MN-major)
  CUtensorMap dgu[2];       // dg, du [rows, I] (dx's A pairs; the joint dW's A)
  CUtensorMap wgu[2];       // w_gate, w_up over [E I, H] (dx's B pairs)
  CUtensorMap hw;           // [rows, I] (dWd's B)
  CUtensorMap x;            // the rows' x [rows, H] (the joint dW's B)
  CUtensorMap out_wd;       // dWd over [E H, I]
  CUtensorMap out_wgu[2];   // dWg, dWu over [E I, H]
};

struct FusedArgs {
  const int32_t* offs;
  int E, total, H, I;
  bwd::FusedShape sh;
  bf16* dh;                 // [rows, I] scratch
  bf16 *hw, *dg, *du;       // [rows, I]
  float* dw;                // [rows] (zeroed by the host: rows past offs[E - 1] stay 0)
  const bf16* gu;           // the saved [pairs, 2 I]
  const int64_t* order;     // the pair of each row
  const float* wt;          // [rows]
  bf16* dx;                 // [pairs, H], row order[r] for row r
  int* dh_done;             // [fused_max_blocks]
  int* sw_done;             // [fused_max_blocks]
  int clamp;
  float limit;
  int lead;
};

// The tile queue from the producer thread to the consumers (after the store buffers): the
// producer walks the order and hands each tile's description over, so the consumers keep no
// walk state (with it, their 168 registers spilled: the two k-loops' 128 accumulators and the
// walk's cursors do not fit together). full: the producer's arrival; empty: all 256 consumer
// threads' (each once it has read the entry). kind -1 ends the walk.
constexpr int kFusedQueue = 4;
struct FusedQueue {
  uint64_t full[kFusedQueue];
  uint64_t empty[kFusedQueue];
  int4 item[kFusedQueue][2];  // (kind, e, row0, rows), (blk, m, n, 0)
};
constexpr size_t kFusedSmemBytes = bwd::kWeightSmemBytes + sizeof(FusedQueue);
static_assert(kFusedSmemBytes <= 232448, "the fused kernel's ring, store buffers and queue fit one SM's 227 KB");

MOKGEN_DEVICE int ld_acquire_gpu_s32(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A queue-barrier wait whose loop the warp leaves together (a vote on the try_wait): with
// bwd::mbar_wait's per-thread exit before the tile's k-loop, ptxas took what followed for a
// divergent path and serialized the weight tiles' wgmma (C7520). Traps after kWaitCycles.
MOKGEN_DEVICE void mbar_wait_warp(uint64_t* bar, uint32_t parity) {
  const long long start = clock64();
  for (;;) {
    uint32_t done;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    if (__all_sync(0xffffffffu, done)) return;
    if (clock64() - start > bwd::kWaitCycles) __trap();
  }
}

// Spin until *p >= target (acquire), trapping after kWaitCycles.
MOKGEN_DEVICE void fused_wait(const int* p, int target) {
#ifdef MOKGEN_FUSED_NO_DEPS  // a measuring variant only (.ci/fused_probe.py): not a correct kernel
  return;
#endif
  if (ld_acquire_gpu_s32(p) >= target) return;
  const long long start = clock64();
  while (ld_acquire_gpu_s32(p) < target) {
    __nanosleep(64);
    if (clock64() - start > bwd::kWaitCycles) __trap();
  }
}

__global__ void __launch_bounds__(bwd::kThreads, 1)
    fused_kernel(const __grid_constant__ FusedMaps maps, const FusedArgs a) {
  extern __shared__ __align__(1024) unsigned char smem[];
  FusedQueue* q = nullptr;
  {
    const bwd::Smem c = bwd::carve<bwd::kWeightStages>(smem);
    q = reinterpret_cast<FusedQueue*>(c.after + bwd::kStagingBytes);
    if (threadIdx.x == 0)
      for (int i = 0; i < kFusedQueue; ++i) {
        sm90::mbar_init(&q->full[i], 1);
        sm90::mbar_init(&q->empty[i], 256);
      }
  }
  // (start_pipeline's barrier-init fence and __syncthreads cover the queue's barriers too)
  const bwd::Smem s = bwd::start_pipeline<bwd::kWeightStages, 1, bwd::kStageBytes, 2, 1>(smem);
  auto pipe = bwd::make_pipe<bwd::kWeightStages>(a.lead);
  const int cta = int(blockIdx.x), ctas = int(gridDim.x);
  const int tid = threadIdx.x, wgi = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform for ptxas
  if (wgi == 0) {
    cutlass::arch::warpgroup_reg_dealloc<72>();
    const int warp = __shfl_sync(0xffffffffu, tid / 32, 0), lane = tid & 31;
    if (warp == 0) {
      if (lane == 0) {
        int qs = 0;
        uint32_t qph = 0;
        const auto push = [&](int4 x, int4 y) {
          bwd::mbar_wait(&q->empty[qs], qph ^ 1u);
          q->item[qs][0] = x;
          q->item[qs][1] = y;
          bwd::mbar_arrive(&q->full[qs]);
          if (++qs == kFusedQueue) {
            qs = 0;
            qph ^= 1u;
          }
        };
        bwd::walk_fused(a.offs, a.E, a.total, a.sh, cta, ctas,
                        [&](int kind, int e, int row0, int rows, int blk, int nb, int m, int n) {
          push(make_int4(kind, e, row0, rows), make_int4(blk, m, n, 0));
          bwd::TileSrc t;
          if (kind <= bwd::kFusedDx) {
            const bool dx = kind == bwd::kFusedDx;
            if (dx) {
              fused_wait(&a.sw_done[blk], 1);
              sm90::fence_proxy_async_global();  // dg, du: generic writes -> TMA reads
            }
            const int K = dx ? a.I : a.H;
            for (int p = 0; p < 2; ++p) {
              t.a[p] = dx ? &maps.dgu[p] : &maps.go;
              t.b[p] = dx ? &maps.wgu[p] : &maps.wd;
            }
            t.a_row = row0;
            t.a_col = 0;
            t.b_row = e * K;
            t.b_col = n * bwd::kBN;
            t.kb_per_pair = K / bwd::kBK;
            t.n_k = (dx ? 2 : 1) * t.kb_per_pair;
            t.a_rows = rows;
            bwd::produce<false, true>(s, pipe, t);
          } else {
            for (int b = blk; b < blk + nb; ++b) fused_wait(&a.sw_done[b], 1);
            if (nb > 0) sm90::fence_proxy_async_global();  // hw, dg, du: generic writes -> TMA reads
            int p = 0, a_col = m * bwd::kBM;
            const bool wd = kind == bwd::kFusedWd;
            if (!wd && a_col >= a.I) {
              p = 1;
              a_col -= a.I;
            }
            t.a[0] = t.a[1] = wd ? &maps.go : &maps.dgu[p];
            t.b[0] = t.b[1] = wd ? &maps.hw : &maps.x;
            t.a_row = row0;
            t.a_col = a_col;
            t.b_row = row0;
            t.b_col = n * bwd::kBN;
            t.n_k = (rows + bwd::kBK - 1) / bwd::kBK;
            t.kb_per_pair = t.n_k > 0 ? t.n_k : 1;
            t.a_rows = rows;
            bwd::produce<true, true>(s, pipe, t);
          }
        });
        push(make_int4(-1, 0, 0, 0), make_int4(0, 0, 0, 0));
      }
    } else {
      // the background: this CTA's swiglu items, three warps, one row each at a time
      const int w = warp - 1;
      bwd::walk_fused_swiglu(a.offs, a.E, a.total, cta, ctas, [&](int blk, int row0, int rows) {
        fused_wait(&a.dh_done[blk], 2 * a.sh.dh_n);
#ifndef MOKGEN_FUSED_NO_SWIGLU  // a measuring variant only (.ci/fused_probe.py): not a correct kernel
        for (int r = w; r < rows; r += 3)
#else
        for (int r = w; r < 0; r += 3)
#endif
          swiglu_saved_row<bf16, true>(a.hw, a.dg, a.du, a.dw, a.gu, a.order, a.dh, a.wt, row0 + r, a.I, lane,
                                       a.clamp, a.limit);
        sm90::fence_proxy_async_global();  // read by the TMA loads of dx and weight tiles
        asm volatile("bar.sync 3, 96;" ::: "memory");  // warps 1-3 only (barrier 3 is used nowhere else)
        if (w == 0 && lane == 0) {
          __threadfence();
          atomicExch(&a.sw_done[blk], 1);
        }
      });
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<216>();
    if (pipe.staggered() && wgi == 2) bwd::mbar_wait(bwd::lead_barrier(s), 0);
    pipe.stagger_todo = pipe.staggered() && wgi == 1 ? 1 : 0;
    const int wg = wgi - 1, t = tid & 127;
    int qs = 0;
    uint32_t qph = 0;
    for (;;) {
      mbar_wait_warp(&q->full[qs], qph);
      const int4 x = q->item[qs][0], y = q->item[qs][1];
      bwd::mbar_arrive(&q->empty[qs]);
      if (++qs == kFusedQueue) {
        qs = 0;
        qph ^= 1u;
      }
      // every field through a shuffle: warp-uniform for ptxas (the values steer the k-loops)
      const auto uni = [](int v) { return __shfl_sync(0xffffffffu, v, 0); };
      const int kind = uni(x.x);
      if (kind < 0) break;
      const int e = uni(x.y), row0 = uni(x.z), rows = uni(x.w), blk = uni(y.x), m = uni(y.y), n = uni(y.z);
      // zeroed per tile: without it, ptxas (with -lineinfo, as the library is built) took the
      // accumulators for live across tiles and serialized the wgmma (C7515); 128 moves a tile
      float acc[bwd::kAcc];
#pragma unroll
      for (int i = 0; i < bwd::kAcc; ++i) acc[i] = 0.f;
      if (kind <= bwd::kFusedDx) {
        const bool dx = kind == bwd::kFusedDx;
        const int n_k = (dx ? 2 * a.I : a.H) / bwd::kBK;
        bwd::consume<false, true>(s, pipe, wg, n_k, bwd::kBK, acc);
        if (dx) {
          bwd::store_tile(acc, wg, rows, a.dx + n * bwd::kBN, a.H, a.order + row0);
        } else {
          bwd::store_tile(acc, wg, rows, a.dh + int64_t(row0) * a.I + n * bwd::kBN, a.I);
          asm volatile("bar.sync %0, 128;" ::"r"(4 + wg) : "memory");  // the warpgroup's stores, then the count
          if (t == 0) {
            __threadfence();
            atomicAdd(&a.dh_done[blk], 1);
          }
        }
      } else {
        const int n_k = (rows + bwd::kBK - 1) / bwd::kBK;
        bwd::consume<true, true>(s, pipe, wg, n_k, rows - (n_k - 1) * bwd::kBK, acc);
        if (kind == bwd::kFusedWd) {
          bwd::store_tile_tma(acc, s, wg, &maps.out_wd, e * a.H + m * bwd::kBM, n * bwd::kBN);
        } else {
          const int m0 = m * bwd::kBM, p = m0 >= a.I;
          bwd::store_tile_tma(acc, s, wg, &maps.out_wgu[p], e * a.I + (p ? m0 - a.I : m0), n * bwd::kBN);
        }
      }
    }
    bwd::stagger_lead_done(s, pipe);
    bwd::store_tma_done();
  }
}

// The rows GEMM's rows that no expert owns (r in [offs[E - 1], rows), clamped: pairs no expert
// computed) as zeros, at out row r, or out_rows[r] where a map is given: with them every row
// of the result is written, so the caller need not zero the output first (a 470 MB fill for
// kimi-k2.5's dx). Launched before the GEMM; usually there are no such rows and it only reads
// offs.
template <class OutT>
__global__ void __launch_bounds__(256)
    zero_rows_kernel(OutT* out, const int32_t* offs, int E, int rows, int N, const int64_t* out_rows) {
  const int first = min(max(offs[E - 1], 0), rows);
  const int64_t per_row = N / 4, total = int64_t(rows - first) * per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = first + i / per_row;
    const int64_t row = out_rows != nullptr ? out_rows[r] : r;
    OutT* at = out + row * N + 4 * (i % per_row);
    if constexpr (sizeof(OutT) == 4)
      *reinterpret_cast<float4*>(at) = make_float4(0.f, 0.f, 0.f, 0.f);
    else
      *reinterpret_cast<uint2*>(at) = make_uint2(0u, 0u);
  }
}

// dX of the tokens from the dx rows of their pairs: out[t, c] = bf16(sum over j = 0..K-1, in
// that order, of in[t K + j, c]) (fp32 sums, one rounding), which is what the PyTorch form did
// (a clone of slot 0, K - 1 in-place adds of strided views, a cast) in one pass. 4 columns per
// thread. InT: the pairs' rows in fp32, or in bf16 (each pair's fp32 dx rounded once by the rows
// GEMM, as the forward's combine slots and the dx rows that come back across GPUs are: the sum
// is then the distributed backward's, and half the bytes are written and read).
MOKGEN_DEVICE float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
MOKGEN_DEVICE float4 load4(const bf16* p) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  return make_float4(bwd::bf16_lo(v.x), bwd::bf16_hi(v.x), bwd::bf16_lo(v.y), bwd::bf16_hi(v.y));
}

template <class InT>
__global__ void __launch_bounds__(256) sum_slots_kernel(bf16* out, const InT* in, int T, int K, int H) {
  const int64_t q = H / 4, total = int64_t(T) * q;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / q, c = 4 * (i % q);
    const InT* src = in + t * K * H + c;
    float4 acc = load4(src);
    for (int j = 1; j < K; ++j) {
      const float4 v = load4(src + int64_t(j) * H);
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    *reinterpret_cast<uint2*>(out + t * H + c) = make_uint2(pack_bf16x2(acc.x, acc.y), pack_bf16x2(acc.z, acc.w));
  }
}

// The backward's row order (mokgen.backward): the (token, slot) pairs sorted expert-major,
// stable (each expert's pairs in increasing pair index), the pairs whose id is outside [0, E)
// last (key E): order[r] = pair, tok[r] = pair / K and, where w is given, wts[r] = w[pair];
// offs[e] the inclusive prefix sums of the rows per expert. A counting sort over chunks of
// kSortChunk pairs in three launches, O(pairs + experts x chunks) (v0.11's one block per expert
// read every pair once per expert: 431 us on the qwen3.5-35b-a3b layer, 256 experts x 131072
// pairs, which therefore took PyTorch's sort):
//   1. expert_count_kernel: block b counts the keys of chunk b into counts[b][k];
//   2. expert_scan_kernel (one block): where each key's rows start (a scan over the keys of
//      their totals), offs, and counts[b][k] replaced by the first row of chunk b's key-k pairs;
//   3. expert_scatter_kernel: one warp per chunk walks it in pair order, 32 pairs a step; the
//      lanes holding one key (__match_any_sync) take consecutive rows in lane order.
// Integer counts only: the same result on every run and for every grid.
constexpr int kSortChunk = 1024;  // pairs per chunk
constexpr int kSortSteps = kSortChunk / 32;
constexpr int kSortMaxKeys = 12288;  // E + 1 ints of shared memory in the count and scatter kernels (48 KB)

MOKGEN_DEVICE int sort_key(int id, int E) { return id >= 0 && id < E ? id : E; }

__global__ void __launch_bounds__(256) expert_count_kernel(const int32_t* ids, int n, int E, int32_t* counts) {
  extern __shared__ int hist[];  // [E + 1]
  const int keys = E + 1;
  for (int k = threadIdx.x; k < keys; k += blockDim.x) hist[k] = 0;
  __syncthreads();
  const int64_t c0 = int64_t(blockIdx.x) * kSortChunk, c1 = min(int64_t(n), c0 + kSortChunk);
  for (int64_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) atomicAdd(&hist[sort_key(ids[i], E)], 1);
  __syncthreads();
  for (int k = threadIdx.x; k < keys; k += blockDim.x) counts[int64_t(blockIdx.x) * keys + k] = hist[k];
}

// One block of 1024 threads; thread t owns keys [t per, (t + 1) per).
__global__ void __launch_bounds__(1024) expert_scan_kernel(int E, int chunks, int32_t* counts, int32_t* offs) {
  __shared__ int warp_sum[32];
  const int keys = E + 1, per = (keys + 1023) / 1024;
  const int k0 = min(keys, int(threadIdx.x) * per), k1 = min(keys, k0 + per);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int mine = 0;  // the pairs of this thread's keys
  for (int k = k0; k < k1; ++k) {
#pragma unroll 8
    for (int b = 0; b < chunks; ++b) mine += counts[int64_t(b) * keys + k];
  }
  // exclusive scan of `mine` over the threads, in thread order
  int incl = mine;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_sum[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = warp_sum[lane];
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += v;
    }
    warp_sum[lane] = w;  // inclusive over the warps
  }
  __syncthreads();
  int row = (warp > 0 ? warp_sum[warp - 1] : 0) + incl - mine;  // this thread's first row
  for (int k = k0; k < k1; ++k) {
#pragma unroll 8
    for (int b = 0; b < chunks; ++b) {
      int32_t* c = counts + int64_t(b) * keys + k;
      const int v = *c;
      *c = row;
      row += v;
    }
    if (k < E) offs[k] = row;
  }
}

// One warp per chunk.
__global__ void __launch_bounds__(32)
    expert_scatter_kernel(const int32_t* ids, int n, int E, int K, const float* w, const int32_t* counts, int64_t* order,
                          int64_t* tok, float* wts) {
  extern __shared__ int next_row[];  // [E + 1]: the next row of each key in this chunk
  const int keys = E + 1, lane = threadIdx.x;
  for (int k = lane; k < keys; k += 32) next_row[k] = counts[int64_t(blockIdx.x) * keys + k];
  const int64_t c0 = int64_t(blockIdx.x) * kSortChunk;
  int key[kSortSteps];  // every id of the chunk loaded first (loads in flight together)
#pragma unroll
  for (int st = 0; st < kSortSteps; ++st) {
    const int64_t i = c0 + st * 32 + lane;
    key[st] = i < n ? sort_key(ids[i], E) : keys;  // keys: past the end, no row
  }
  __syncwarp();
#pragma unroll
  for (int st = 0; st < kSortSteps; ++st) {
    const int64_t i = c0 + st * 32 + lane;
    const unsigned same = __match_any_sync(0xffffffffu, key[st]);
    const int rank = __popc(same & ((1u << lane) - 1u));
    if (key[st] < keys) {
      const int r = next_row[key[st]] + rank;
      order[r] = i;
      tok[r] = i / K;
      if (w != nullptr) wts[r] = w[i];
    }
    __syncwarp();
    if (key[st] < keys && rank == 0) next_row[key[st]] += __popc(same);
    __syncwarp();
  }
}

int sm_count() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return 0;
  return n;
}

// A launch of `grid` CTAs with `smem` bytes of dynamic shared memory (bwd::kSmemBytes, or the
// weight kernels' kWeightSmemBytes and kPPSmemBytes). The shared-memory attribute is set at every launch (a few
// microseconds; per device, and the kernels share one function-pointer type, so a per-type
// "done" flag could not tell them apart).
template <class Kernel, class... Args>
int launch(Kernel kernel, int grid, size_t smem, cudaStream_t stream, const Maps& maps, Args... args) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return int(err);
  kernel<<<grid, bwd::kThreads, smem, stream>>>(maps, args...);
  return int(cudaGetLastError());
}

// The launch configuration of `pairs` clusters of two CTAs (attr: storage for its one
// attribute, the cluster shape), for the occupancy query and the launch alike.
cudaLaunchConfig_t pair_config(int pairs, size_t smem, cudaStream_t stream, cudaLaunchAttribute& attr) {
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 2;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(2 * pairs));
  cfg.blockDim = dim3(bwd::kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Clusters of two CTAs that can be resident at once on the current device (0: none, or the
// query failed), asked once per kernel and device: a grid of more pairs than fit would run its
// last ones as a second wave, doubling the time of a persistent walk. Cached by the kernel's
// address (kernels may share a function-pointer type).
template <class Kernel>
int resident_pairs(Kernel kernel, size_t smem) {
  struct Entry {
    const void* fn;
    int dev;
    int clusters;  // -1: none
  };
  constexpr int kEntries = 64;
  static Entry cache[kEntries] = {};
  static int used = 0;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  const void* fn = reinterpret_cast<const void*>(kernel);
  for (int i = 0; i < used; ++i)
    if (cache[i].fn == fn && cache[i].dev == dev) return cache[i].clusters > 0 ? cache[i].clusters : 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess) return 0;
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = pair_config(sm_count(), smem, nullptr, attr);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, fn, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    clusters = 0;
  }
  if (used < kEntries) cache[used++] = {fn, dev, clusters > 0 ? clusters : -1};
  return clusters;
}

// A launch in clusters of two CTAs, `pairs` of them.
template <class Kernel, class... Args>
int launch_pairs(Kernel kernel, int pairs, size_t smem, cudaStream_t stream, const Maps& maps, Args... args) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return int(err);
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = pair_config(pairs, smem, stream, attr);
  return int(cudaLaunchKernelEx(&cfg, kernel, maps, args...));
}

constexpr int kBadMap = 1000;  // a tensor map could not be encoded (mokgen_bwd_error_string)

// The consumers' stagger (bwd_gemm.cuh, Pipe) in every GEMM launch of this process: the lead of
// consumer warpgroup 0 in k-blocks, 0 (lockstep) to kMaxLead, set by mokgen_bwd_set_stagger
// (mokgen.bwd_gemm.set_stagger; MOKGEN_BWD_STAGGER). The same bits at every lead.
int g_lead = bwd::kMaxLead;

// The weight kernels' bounded last k-block (weight_kernel's `steps`): 1, only its 16-row steps
// that hold the expert's rows (MOKGEN_BWD_TAIL=steps), or 0, all four (tma); set by
// mokgen_bwd_set_tail_steps (mokgen.bwd_gemm.weight_tail). The same bits either way.
int g_steps = 0;

// The rows GEMMs' (rows_kernel's) tile walk: bands of g_band row blocks, column tile by column tile
// within a band (bwd_tiles.cuh walk_row_tiles); 1 is v0.42's row-block-major order. Set by
// mokgen_bwd_set_row_band (mokgen.bwd_gemm; MOKGEN_BWD_ROW_BAND). The same bits at every band.
int g_band = 8;

// A rows GEMM's launch: CTA pairs sharing A (rows_kernel<..., 2>) where `pairs_fit` and pairs
// can be resident, else single CTAs.
template <bool kBMN, class OutT>
int launch_rows(bool pairs_fit, int grid, cudaStream_t stream, const Maps& maps, const int32_t* offs, int E, int rows,
                int K, int N, int pairs, OutT* out, const int64_t* out_rows) {
  if (pairs_fit) {
    const int clusters = resident_pairs(rows_kernel<kBMN, OutT, 2>, bwd::kSmemBytes);
    if (clusters > 0)
      return launch_pairs(rows_kernel<kBMN, OutT, 2>, clusters, bwd::kSmemBytes, stream, maps, offs, E, rows, K, N,
                          pairs, out, out_rows, g_lead, bwd::Gather{}, g_band);
  }
  return launch(rows_kernel<kBMN, OutT, 1>, grid, bwd::kSmemBytes, stream, maps, offs, E, rows, K, N, pairs, out,
                out_rows, g_lead, bwd::Gather{}, g_band);
}

// weight_kernel as CTA pairs where they fit and are resident, else single CTAs (both weight entries);
// kSum (the joint form): with the slots' sum `sum` as the side job.
template <bool kJoint, bool kSum = false>
int launch_weights(const Maps& maps, bool pairs_fit, int grid, const int32_t* offs, int E, int rows, int M, int N,
                   int Mp, const CUtensorMap* bounded, cudaStream_t stream, const bwd::SlotSum& sum = {}) {
  static_assert(!kSum || kJoint, "the slots' sum rides on the joint form");
  if (pairs_fit) {
    const int pairs = resident_pairs(weight_kernel<2, kJoint, false, kSum>, bwd::kWeightSmemBytes);
    if (pairs > 0)
      return launch_pairs(weight_kernel<2, kJoint, false, kSum>, pairs, bwd::kWeightSmemBytes, stream, maps, offs, E,
                          rows, M, N, g_lead, Mp, bwd::Gather{}, bounded, g_steps, sum);
  }
  return launch(weight_kernel<1, kJoint, false, kSum>, grid, bwd::kWeightSmemBytes, stream, maps, offs, E, rows, M, N,
                g_lead, Mp, bwd::Gather{}, bounded, g_steps, sum);
}

// The weight entries' bounded maps: none where bounded_ws is null (the consumers zero the short
// k-block), else bound_maps_kernel writes kBoundedMaps E of them into bounded_ws (device memory,
// 128-byte aligned: sizeof(CUtensorMap) E kBoundedMaps bytes) on the stream, and *out points there.
int bound_maps(const Maps& maps, const int32_t* offs, int E, int rows, void* bounded_ws, cudaStream_t stream,
               const CUtensorMap** out) {
  *out = nullptr;
  if (bounded_ws == nullptr) return 0;
  if (reinterpret_cast<uintptr_t>(bounded_ws) % 128) return int(cudaErrorMisalignedAddress);
  CUtensorMap* ws = static_cast<CUtensorMap*>(bounded_ws);
  const int n = bwd::kBoundedMaps * E;
  bound_maps_kernel<<<(n + 127) / 128, 128, 0, stream>>>(maps, offs, E, rows, ws);
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) *out = ws;
  return int(err);
}

// The joint weight gradients' maps but B's: the two problems' A [rows, Mp] and outputs [E Mp, N].
bool joint_maps(Maps* maps, void* out0, void* out1, const void* a0, const void* a1, int E, int rows, int Mp, int N) {
  return sm90::encode_map_2d(&maps->a[0], a0, uint64_t(rows), uint64_t(Mp), 64) == CUDA_SUCCESS &&
         sm90::encode_map_2d(&maps->a[1], a1, uint64_t(rows), uint64_t(Mp), 64) == CUDA_SUCCESS &&
         sm90::encode_map_2d(&maps->c, out0, uint64_t(E) * Mp, uint64_t(N), 64) == CUDA_SUCCESS &&
         sm90::encode_map_2d(&maps->c1, out1, uint64_t(E) * Mp, uint64_t(N), 64) == CUDA_SUCCESS;
}

}  // namespace

extern "C" {

#ifdef MOKGEN_BWD_TRACE
// A trace build's buffer (device memory, [grid][tiles][3][8] uint64, zeroed by the caller) for
// the weight-gradient launches that follow; null stops the tracing.
int mokgen_bwd_set_trace(void* buf, int tiles) {
  unsigned long long* p = static_cast<unsigned long long*>(buf);
  cudaError_t err = cudaMemcpyToSymbol(g_trace_buf, &p, sizeof(p));
  if (err == cudaSuccess) err = cudaMemcpyToSymbol(g_trace_tiles, &tiles, sizeof(tiles));
  return int(err);
}
#endif

void mokgen_bwd_set_tail_steps(int on) { g_steps = on ? 1 : 0; }

void mokgen_bwd_set_row_band(int band) { g_band = band < 1 ? 1 : band; }

void mokgen_bwd_set_stagger(int lead) { g_lead = lead < 0 ? 0 : lead > bwd::kMaxLead ? bwd::kMaxLead : lead; }

int mokgen_bwd_max_lead() { return bwd::kMaxLead; }

const char* mokgen_bwd_error_string(int code) {
  if (code == kBadMap) return "cuTensorMapEncodeTiled refused an operand (alignment or size)";
  return cudaGetErrorString(cudaError_t(code));
}

// out [rows, N] fp32 (out_bf16: bf16, the fp32 sums rounded once; B MN-major only) = sum_p a_p
// [rows, K] (bf16, row-major) x B_p[e(r)] (row r of the result written to out row out_rows[r]
// where out_rows is given, int64 [rows]; rows past offs[E - 1] written as zeros,
// zero_rows_kernel), b_mn: B_p [E, K, N] (else [E, N, K]); offs [E] int32 on the device: end
// row of each expert (inclusive prefix sums; clamped to [0, rows], so a bad offs cannot make
// the kernel write past out). N % 256 == 0, K % 64 == 0, rows >= 1 (checked by the caller).
// cluster 2: CTA pairs sharing a (rows_kernel<..., 2>: column tiles 2 np, 2 np + 1) where N / 256
// is even and pairs can be resident; else single CTAs. The same bits either way.
int mokgen_bwd_rows(void* out, const void* a0, const void* b0, const void* a1, const void* b1, int pairs,
                    const int32_t* offs, int E, int rows, int K, int N, int b_mn, const int64_t* out_rows,
                    int out_bf16, int cluster, cudaStream_t stream) {
  Maps maps;
  const void* as[2] = {a0, pairs > 1 ? a1 : a0};
  const void* bs[2] = {b0, pairs > 1 ? b1 : b0};
  for (int p = 0; p < 2; ++p) {
    if (sm90::encode_map_2d(&maps.a[p], as[p], uint64_t(rows), uint64_t(K), 64) != CUDA_SUCCESS) return kBadMap;
    const CUresult rb = b_mn ? sm90::encode_map_2d(&maps.b[p], bs[p], uint64_t(E) * K, uint64_t(N), 64)
                             : sm90::encode_map_2d(&maps.b[p], bs[p], uint64_t(E) * N, uint64_t(K), 128);
    if (rb != CUDA_SUCCESS) return kBadMap;
  }
  const int grid = sm_count();
  if (grid == 0) return int(cudaErrorNoDevice);
  const bool pairs_fit = cluster == 2 && (N / bwd::kBN) % 2 == 0;
  if (out_bf16) {
    if (!b_mn) return int(cudaErrorInvalidValue);
    bf16* o = static_cast<bf16*>(out);
    zero_rows_kernel<<<grid, 256, 0, stream>>>(o, offs, E, rows, N, out_rows);
    return launch_rows<true, bf16>(pairs_fit, grid, stream, maps, offs, E, rows, K, N, pairs, o, out_rows);
  }
  float* o = static_cast<float*>(out);
  zero_rows_kernel<<<grid, 256, 0, stream>>>(o, offs, E, rows, N, out_rows);
  return b_mn ? launch_rows<true, float>(pairs_fit, grid, stream, maps, offs, E, rows, K, N, pairs, o, out_rows)
              : launch_rows<false, float>(pairs_fit, grid, stream, maps, offs, E, rows, K, N, pairs, o, out_rows);
}

// mokgen_bwd_rows with one pair, B MN-major and A's rows gathered: row r of A is row index[r]
// of src ([src_rows, K] bf16, row-major; index int64 [rows], trusted to lie in [0, src_rows)),
// loaded through the index by the kernel (rows_kernel<true, ..., 1, true>) instead of from a
// gathered copy: dh = dOut Wd[e] straight from dOut's token rows. Single CTAs. The bits of
// mokgen_bwd_rows on the gathered copy.
int mokgen_bwd_rows_gathered(void* out, const void* src, const int64_t* index, const void* b0, const int32_t* offs,
                             int E, int rows, int K, int N, const int64_t* out_rows, int out_bf16,
                             cudaStream_t stream) {
  Maps maps;
  if (sm90::encode_map_2d(&maps.b[0], b0, uint64_t(E) * K, uint64_t(N), 64) != CUDA_SUCCESS) return kBadMap;
  maps.b[1] = maps.b[0];
  maps.a[0] = maps.a[1] = maps.b[0];  // unused (A comes through the index)
  const int grid = sm_count();
  if (grid == 0) return int(cudaErrorNoDevice);
  const bwd::Gather ga{static_cast<const bf16*>(src), index, int64_t(K)};
  if (out_bf16) {
    bf16* o = static_cast<bf16*>(out);
    zero_rows_kernel<<<grid, 256, 0, stream>>>(o, offs, E, rows, N, out_rows);
    return launch(rows_kernel<true, bf16, 1, true>, grid, bwd::kSmemBytes, stream, maps, offs, E, rows, K, N, 1, o,
                  out_rows, g_lead, ga, g_band);
  }
  float* o = static_cast<float*>(out);
  zero_rows_kernel<<<grid, 256, 0, stream>>>(o, offs, E, rows, N, out_rows);
  return launch(rows_kernel<true, float, 1, true>, grid, bwd::kSmemBytes, stream, maps, offs, E, rows, K, N, 1, o,
                out_rows, g_lead, ga, g_band);
}

// The recompute of g = x Wg[e]^T, u = x Wu[e]^T with SwiGLU's backward in the epilogue (see
// swiglu_kernel): x [rows, H] bf16, w_gate / w_up [E, I, H] bf16, dh_u [rows, I] fp32, wt [rows]
// fp32; out h (= swiglu(g, u) wt, the weighted activation), dg, du [rows, I] bf16 and dw_part
// [rows, I / 128] fp32. H % 64 == 0, I % 128 == 0.
int mokgen_bwd_swiglu(void* h, void* dg, void* du, float* dw_part, const void* x, const void* w_gate,
                      const void* w_up, const float* dh_u, const float* wt, const int32_t* offs, int E, int rows, int H,
                      int I, int clamp, float limit, cudaStream_t stream) {
  Maps maps;
  if (sm90::encode_map_2d(&maps.a[0], x, uint64_t(rows), uint64_t(H), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.b[0], w_gate, uint64_t(E) * I, uint64_t(H), 128) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.b[1], w_up, uint64_t(E) * I, uint64_t(H), 128) != CUDA_SUCCESS)
    return kBadMap;
  maps.a[1] = maps.a[0];
  const int grid = sm_count();
  if (grid == 0) return int(cudaErrorNoDevice);
  const SwigluOut o{static_cast<bf16*>(h), static_cast<bf16*>(dg), static_cast<bf16*>(du), dw_part, dh_u, wt};
  return launch(swiglu_kernel, grid, bwd::kSmemBytes, stream, maps, offs, E, rows, H, I, o, clamp, limit, g_lead);
}

// SwiGLU's backward from saved pre-activations (swiglu_saved_kernel): gu [*, 2 I] bf16 (row p: g
// then u of pair p), order [rows] int64 (the pair of expert-major row i), dh_u [rows, I] fp32 (or
// bf16: dh_bf16), wt [rows] fp32, offs [E] int32; out h (= swiglu(g, u) wt), dg, du [rows, I] bf16, dw [rows] fp32.
// I % 8 == 0, rows >= 1 (checked by the caller).
int mokgen_bwd_swiglu_saved(void* h, void* dg, void* du, float* dw, const void* gu, const int64_t* order,
                            const void* dh_u, const float* wt, const int32_t* offs, int E, int rows, int I, int clamp,
                            float limit, int dh_bf16, cudaStream_t stream) {
  const unsigned blocks = unsigned((int64_t(rows) * 32 + 255) / 256);
  bf16 *ho = static_cast<bf16*>(h), *dgo = static_cast<bf16*>(dg), *duo = static_cast<bf16*>(du);
  const bf16* g = static_cast<const bf16*>(gu);
  if (dh_bf16)
    swiglu_saved_kernel<bf16><<<blocks, 256, 0, stream>>>(ho, dgo, duo, dw, g, order, static_cast<const bf16*>(dh_u),
                                                          wt, offs, E, rows, I, clamp, limit);
  else
    swiglu_saved_kernel<float><<<blocks, 256, 0, stream>>>(ho, dgo, duo, dw, g, order, static_cast<const float*>(dh_u),
                                                           wt, offs, E, rows, I, clamp, limit);
  return int(cudaGetLastError());
}

// dh = go Wd[e] with SwiGLU's backward from saved pre-activations in the epilogue
// (dh_swiglu_kernel): go [rows, H] bf16 (expert-major rows), w_down [E, H, I] bf16, gu [*, 2 I]
// bf16 (row p: g then u of pair p), order [rows] int64 (the pair of each row), wt [rows] fp32,
// offs [E] int32; out h (= swiglu(g, u) wt), dg, du [rows, I] bf16 (zeros from offs[E - 1] on)
// and dw_part [rows, I / 256] fp32 (the caller zeroes it; each row's partial sums of dh_u h per
// 256 columns). H % 64 == 0, I % 256 == 0, rows >= 1 (checked by the caller).
// go_index (may be null): go is dOut [src_rows, H] and row r's is row go_index[r] (int64 [rows],
// trusted to lie in [0, src_rows)), loaded through the index by the kernel (v0.24): the bits of
// the gathered copy.
int mokgen_bwd_dh_swiglu_saved(void* h, void* dg, void* du, float* dw_part, const void* go, const void* w_down,
                               const void* gu, const int64_t* order, const float* wt, const int32_t* offs, int E,
                               int rows, int H, int I, int clamp, float limit, const int64_t* go_index,
                               cudaStream_t stream) {
  Maps maps;
  if (sm90::encode_map_2d(&maps.b[0], w_down, uint64_t(E) * H, uint64_t(I), 64) != CUDA_SUCCESS) return kBadMap;
  if (go_index == nullptr) {
    if (sm90::encode_map_2d(&maps.a[0], go, uint64_t(rows), uint64_t(H), 64) != CUDA_SUCCESS) return kBadMap;
  } else {
    maps.a[0] = maps.b[0];  // unused (A comes through the index)
  }
  maps.a[1] = maps.a[0];
  maps.b[1] = maps.b[0];
  const bwd::Gather ga{static_cast<const bf16*>(go), go_index, int64_t(H)};
  const int grid = sm_count();
  if (grid == 0) return int(cudaErrorNoDevice);
  const SavedSwiglu o{static_cast<const bf16*>(gu), order, wt, static_cast<bf16*>(h), static_cast<bf16*>(dg),
                      static_cast<bf16*>(du), dw_part};
  zero_rows3_kernel<<<grid, 256, 0, stream>>>(o.h, o.dg, o.du, offs, E, rows, I);
  return launch(go_index != nullptr ? dh_swiglu_kernel<true> : dh_swiglu_kernel<false>, grid, bwd::kSmemBytes, stream,
                maps, offs, E, rows, H, I, o, clamp, limit, g_lead, ga);
}

// out [E, M, N] bf16: out[e] = a[rows of e]^T b[rows of e]; a [rows, M], b [rows, N] bf16
// row-major; an expert without rows gets zeros. M % 128 == 0, N % 256 == 0, rows >= 1.
// cluster 2: CTA pairs sharing b (weight_kernel<2>) where M / 128 is even and pairs can be
// resident; else (or cluster 1) single CTAs. pingpong 1: weight_pp_kernel (128 x 128 tiles,
// one consumer warpgroup's each); 0: weight_kernel (128 x 256, split between the two). The same
// bits every way.
int mokgen_bwd_weights(void* out, const void* a, const void* b, const int32_t* offs, int E, int rows, int M, int N,
                       int cluster, int pingpong, void* bounded_ws, cudaStream_t stream) {
  Maps maps;
  if (sm90::encode_map_2d(&maps.a[0], a, uint64_t(rows), uint64_t(M), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.b[0], b, uint64_t(rows), uint64_t(N), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.c, out, uint64_t(E) * M, uint64_t(N), 64) != CUDA_SUCCESS)
    return kBadMap;
  maps.a[1] = maps.a[0];
  maps.b[1] = maps.b[0];
  const int grid = sm_count();
  if (grid == 0) return int(cudaErrorNoDevice);
  const CUtensorMap* bounded = nullptr;
  if (const int err = bound_maps(maps, offs, E, rows, bounded_ws, stream, &bounded)) return err;
  const bool pairs_fit = cluster == 2 && (M / bwd::kBM) % 2 == 0;
  if (pingpong) {
    if (pairs_fit) {
      const int pairs = resident_pairs(weight_pp_kernel<2>, bwd::kPPSmemBytes);
      if (pairs > 0)
        return launch_pairs(weight_pp_kernel<2>, pairs, bwd::kPPSmemBytes, stream, maps, offs, E, rows, M, N, g_lead,
                            bounded);
    }
    return launch(weight_pp_kernel<1>, grid, bwd::kPPSmemBytes, stream, maps, offs, E, rows, M, N, g_lead, bounded);
  }
  return launch_weights<false>(maps, pairs_fit, grid, offs, E, rows, M, N, M, bounded, stream);
}

// mokgen_bwd_weights (split schedule, single CTAs) with A's k rows gathered: row r of A is row
// index[r] of src ([src_rows, M] bf16; index int64 [rows], trusted to lie in [0, src_rows)),
// loaded through the index by the kernel (weight_kernel<1, false, true>): dWd = dOut^T hw
// straight from dOut's token rows. The bits of mokgen_bwd_weights on the gathered copy.
int mokgen_bwd_weights_gathered(void* out, const void* src, const int64_t* index, const void* b, const int32_t* offs,
                                int E, int rows, int M, int N, void* bounded_ws, cudaStream_t stream) {
  Maps maps;
  if (sm90::encode_map_2d(&maps.b[0], b, uint64_t(rows), uint64_t(N), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.c, out, uint64_t(E) * M, uint64_t(N), 64) != CUDA_SUCCESS)
    return kBadMap;
  maps.b[1] = maps.b[0];
  maps.a[0] = maps.a[1] = maps.b[0];  // unused (A comes through the index)
  const int grid = sm_count();
  if (grid == 0) return int(cudaErrorNoDevice);
  const bwd::Gather ga{static_cast<const bf16*>(src), index, int64_t(M)};
  const CUtensorMap* bounded = nullptr;
  if (const int err = bound_maps(maps, offs, E, rows, bounded_ws, stream, &bounded)) return err;
  return launch(weight_kernel<1, false, true>, grid, bwd::kWeightSmemBytes, stream, maps, offs, E, rows, M, N, g_lead,
                M, ga, bounded, g_steps, bwd::SlotSum{});
}

// The joint form of two weight-gradient problems over one B (weight_kernel<..., true>, StackedM):
// out_p [E, Mp, N] bf16, out_p[e] = A_p[rows of e]^T B[rows of e], A_p [rows, Mp], B [rows, N];
// the split schedule only. Mp % 128 == 0 (cluster 2: Mp / 128 even), N % 256 == 0 (checked by
// the caller).
int mokgen_bwd_weights2(void* out0, void* out1, const void* a0, const void* a1, const void* b, const int32_t* offs,
                        int E, int rows, int Mp, int N, int cluster, void* bounded_ws, void* sum_out, const void* sum_in,
                        int sum_T, int sum_K, int sum_H, cudaStream_t stream) {
  Maps maps;
  if (!joint_maps(&maps, out0, out1, a0, a1, E, rows, Mp, N) ||
      sm90::encode_map_2d(&maps.b[0], b, uint64_t(rows), uint64_t(N), 64) != CUDA_SUCCESS)
    return kBadMap;
  maps.b[1] = maps.b[0];
  const int grid = sm_count();
  if (grid == 0) return int(cudaErrorNoDevice);
  const CUtensorMap* bounded = nullptr;
  if (const int err = bound_maps(maps, offs, E, rows, bounded_ws, stream, &bounded)) return err;
  // a pair's two row blocks in one problem: Mp / 128 even
  const bwd::SlotSum sum{static_cast<bf16*>(sum_out), static_cast<const bf16*>(sum_in), sum_T, sum_K, sum_H};
  const bool pairs_fit = cluster == 2 && (Mp / bwd::kBM) % 2 == 0;
  return sum.out != nullptr
             ? launch_weights<true, true>(maps, pairs_fit, grid, offs, E, rows, 2 * Mp, N, Mp, bounded, stream, sum)
             : launch_weights<true>(maps, pairs_fit, grid, offs, E, rows, 2 * Mp, N, Mp, bounded, stream);
}

// mokgen_bwd_weights2 (single CTAs) with B's k rows gathered: row r of B is row index[r] of src
// ([src_rows, N] bf16; index int64 [rows], trusted to lie in [0, src_rows)), loaded through the
// index by the kernel (weight_kernel<1, true, true>): dWg, dWu straight from x's token rows. The
// bits of mokgen_bwd_weights2 on the gathered copy.
int mokgen_bwd_weights2_gathered(void* out0, void* out1, const void* a0, const void* a1, const void* src,
                                 const int64_t* index, const int32_t* offs, int E, int rows, int Mp, int N,
                                 void* bounded_ws, cudaStream_t stream) {
  Maps maps;
  if (!joint_maps(&maps, out0, out1, a0, a1, E, rows, Mp, N)) return kBadMap;
  maps.b[0] = maps.b[1] = maps.a[0];  // unused (B comes through the index)
  const int grid = sm_count();
  if (grid == 0) return int(cudaErrorNoDevice);
  const bwd::Gather ga{static_cast<const bf16*>(src), index, int64_t(N)};
  const CUtensorMap* bounded = nullptr;
  if (const int err = bound_maps(maps, offs, E, rows, bounded_ws, stream, &bounded)) return err;
  return launch(weight_kernel<1, true, true>, grid, bwd::kWeightSmemBytes, stream, maps, offs, E, rows, 2 * Mp, N,
                g_lead, Mp, ga, bounded, g_steps, bwd::SlotSum{});
}

// The fused backward of the save policy (fused_kernel): one launch for dh, SwiGLU's backward,
// dx and the three weight gradients, with the bits of mokgen_bwd_rows (dh in bf16; dx in bf16
// pair rows), mokgen_bwd_swiglu_saved, mokgen_bwd_weights (dWd) and mokgen_bwd_weights2 (dWg,
// dWu). go [rows, H] (dOut's rows in the rows' order), x [rows, H] (the rows' x), w_gate / w_up
// [E, I, H], w_down [E, H, I], gu [pairs, 2 I], order [rows] int64, wt [rows] fp32, offs [E]
// int32, all on the device; out dx [pairs, H] bf16 (row order[r]; rows past offs[E - 1]
// zeroed here), dwg / dwu [E, I, H], dwd [E, H, I] bf16, hw / dg / du / dh [rows, I] bf16
// (scratch the caller may read: hw, dg, du as swiglu_saved's), dw [rows] fp32 (zeroed by the
// caller), counters: 2 fused_max_blocks(rows, E) int32 (zeroed here). chunk (rows per group,
// >= 1) and lag (>= 1) set the order. H % 256 == 0, I % 256 == 0, rows >= 1 (checked by the caller).
long long mokgen_bwd_fused_counters(int rows, int E) { return 2ll * bwd::fused_max_blocks(rows, E); }

int mokgen_bwd_fused(void* dx, void* dwg, void* dwu, void* dwd, void* hw, void* dg, void* du, float* dw, void* dh,
                     int* counters, const void* go, const void* x, const void* w_gate, const void* w_up,
                     const void* w_down, const void* gu, const int64_t* order, const float* wt, const int32_t* offs,
                     int E, int rows, int H, int I, int chunk, int lag, int clamp, float limit, cudaStream_t stream) {
  FusedMaps maps;
  const uint64_t R = uint64_t(rows), EH = uint64_t(E) * H, EI = uint64_t(E) * I;
  if (sm90::encode_map_2d(&maps.go, go, R, uint64_t(H), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.wd, w_down, EH, uint64_t(I), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.dgu[0], dg, R, uint64_t(I), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.dgu[1], du, R, uint64_t(I), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.wgu[0], w_gate, EI, uint64_t(H), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.wgu[1], w_up, EI, uint64_t(H), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.hw, hw, R, uint64_t(I), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.x, x, R, uint64_t(H), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.out_wd, dwd, EH, uint64_t(I), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.out_wgu[0], dwg, EI, uint64_t(H), 64) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&maps.out_wgu[1], dwu, EI, uint64_t(H), 64) != CUDA_SUCCESS)
    return kBadMap;
  const int grid = sm_count();
  if (grid == 0) return int(cudaErrorNoDevice);
  const int blocks = bwd::fused_max_blocks(rows, E);
  cudaError_t err = cudaMemsetAsync(counters, 0, sizeof(int) * 2 * size_t(blocks), stream);
  if (err != cudaSuccess) return int(err);
  FusedArgs args;
  args.offs = offs;
  args.E = E;
  args.total = rows;
  args.H = H;
  args.I = I;
  args.sh = bwd::FusedShape{I / bwd::kBN, H / bwd::kBN, H / bwd::kBM, I / bwd::kBN, 2 * I / bwd::kBM, H / bwd::kBN,
                            chunk < 1 ? 1 : chunk, lag < 1 ? 1 : lag};
  args.dh = static_cast<bf16*>(dh);
  args.hw = static_cast<bf16*>(hw);
  args.dg = static_cast<bf16*>(dg);
  args.du = static_cast<bf16*>(du);
  args.dw = dw;
  args.gu = static_cast<const bf16*>(gu);
  args.order = order;
  args.wt = wt;
  args.dx = static_cast<bf16*>(dx);
  args.dh_done = counters;
  args.sw_done = counters + blocks;
  args.clamp = clamp;
  args.limit = limit;
  args.lead = g_lead;
  zero_rows_kernel<<<grid, 256, 0, stream>>>(args.dx, offs, E, rows, H, order);
  err = cudaFuncSetAttribute(fused_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kFusedSmemBytes));
  if (err != cudaSuccess) return int(err);
  fused_kernel<<<grid, bwd::kThreads, kFusedSmemBytes, stream>>>(maps, args);
  return int(cudaGetLastError());
}

// out [T, H] bf16: the sum over each token's K slots of in [T K, H], fp32 (in_bf16 = 0) or
// bf16 (sum_slots_kernel). H % 4 == 0, T >= 1 (checked by the caller).
int mokgen_bwd_sum_slots(void* out, const void* in, int T, int K, int H, int in_bf16, cudaStream_t stream) {
  const int grid = sm_count();
  if (grid == 0) return int(cudaErrorNoDevice);
  const int64_t want = (int64_t(T) * (H / 4) + 255) / 256;
  const unsigned blocks = unsigned(want < 8 * grid ? want : 8 * grid);
  if (in_bf16)
    sum_slots_kernel<bf16><<<blocks, 256, 0, stream>>>(static_cast<bf16*>(out), static_cast<const bf16*>(in), T, K, H);
  else
    sum_slots_kernel<float><<<blocks, 256, 0, stream>>>(static_cast<bf16*>(out), static_cast<const float*>(in), T, K, H);
  return int(cudaGetLastError());
}

// The expert-major row order of n = T K pairs (expert_count/scan/scatter_kernel): ids [n]
// int32 (global pair order), E experts, K slots per token, w [n] fp32 or null; out order, tok
// [n] int64, wts [n] fp32 (where w is given), offs [E] int32; counts: scratch of
// mokgen_bwd_expert_major_scratch(n, E) int32. n >= 1, 1 <= E < kSortMaxKeys (checked by the caller).
long long mokgen_bwd_expert_major_scratch(int n, int E) {
  return (int64_t(n) + kSortChunk - 1) / kSortChunk * (int64_t(E) + 1);
}

int mokgen_bwd_expert_major(const int32_t* ids, int n, int E, int K, const float* w, int64_t* order, int64_t* tok,
                            float* wts, int32_t* offs, int32_t* counts, cudaStream_t stream) {
  if (E < 1 || E + 1 > kSortMaxKeys || n < 1) return int(cudaErrorInvalidValue);
  const int chunks = int((int64_t(n) + kSortChunk - 1) / kSortChunk);
  const size_t smem = size_t(E + 1) * sizeof(int);
  expert_count_kernel<<<unsigned(chunks), 256, smem, stream>>>(ids, n, E, counts);
  expert_scan_kernel<<<1, 1024, 0, stream>>>(E, chunks, counts, offs);
  expert_scatter_kernel<<<unsigned(chunks), 32, smem, stream>>>(ids, n, E, K, w, counts, order, tok, wts);
  return int(cudaGetLastError());
}

}  // extern "C"
