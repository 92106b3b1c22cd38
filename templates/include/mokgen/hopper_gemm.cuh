// Hopper (sm_90a) expert GEMM core: TMA loads into a multi-stage shared-memory pipeline, one
// producer thread and two wgmma consumer warpgroups, 128-row tiles, fused epilogues.
//
// Built on CUTLASS/CuTe as a library: the wgmma instruction wrappers
// (cute::SM90::GMMA::MMA_64xNx16_F32BF16BF16_SS), the shared-memory matrix descriptor
// (cute::GmmaDescriptor), the TMA copy (cute::SM90_TMA_LOAD_2D) and the register reconfiguration
// (cutlass::arch::warpgroup_reg_alloc/dealloc). The pipeline, roles and epilogues are ours.
//
// Clusters of two CTAs (kCluster = 2): the two CTAs of a pair run two tiles that share one
// operand, and each CTA's producer loads half of that operand with a TMA multicast into both
// CTAs' shared memory (cute::SM90_TMA_LOAD_MULTICAST_2D): kShareB for row blocks m and m + 1 of
// one expert and column tile (the weights), kShareA for one row block and column tiles n and
// n + 1. A stage may be refilled only when the consumers of both CTAs released it, so empty[s]
// counts four arrivals (two local, two from the peer); full[s] still expects the whole stage.
//
// Tile: BM = 128 rows (consumer warpgroup c owns rows 64c..64c+63) x kBNB B rows x BK (kBlockK:
// 64 by default, or 32 with MOKGEN_BLOCK_K=32).
//   gated (up projection): the B tile is 128 rows of w_gate[e] then the same 128 rows of w_up[e];
//     one m64n256k16 wgmma yields gate and up for 128 columns in the same thread, SwiGLU in
//     registers, 128 bf16 output columns per tile.
//   down: kBNB = 256 (or 128) rows of w_down[e]; that many bf16 output columns per tile.
// Shared memory per stage: A 128 x BK and B kBNB x BK bf16, BK * 2-byte rows with the matching
// TMA/wgmma swizzle (128B for BK = 64, 64B for BK = 32), 1024-byte aligned. full[s] completes when TMA has delivered stage s (transaction
// bytes); empty[s] when both consumer warpgroups have finished reading it.
// K is never split: a row's result depends only on its A row and the weights, whatever the
// tiling or schedule, so the megakernel stays bitwise deterministic.
#pragma once

#include <cuda.h>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include <type_traits>
#include <utility>

#include "common.cuh"
#include "fwd_trace.cuh"

namespace mokgen {
namespace sm90 {

// ---- mbarrier helpers (shared memory, CTA scope) -----------------------------------------------
MOKGEN_DEVICE void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
MOKGEN_DEVICE void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
MOKGEN_DEVICE void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
MOKGEN_DEVICE void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// Arrive on the barrier at the same shared-memory offset in CTA cta_id of the cluster, with the
// default semantics (release at CTA scope), as CUTLASS's ClusterBarrier::arrive(cta_id) does. The
// consumers use it to hand a stage back to the peer's producer after wgmma.wait_group has retired
// the reads of it; nothing else needs ordering. v0.4 used .release.cluster, which compiles to
// ERRBAR + CGAERRBAR before every arrive: the arriving warp waits there for all its outstanding
// memory operations, the previous tile's epilogue stores included, once per k-block. That held up
// its warpgroup's next wgmma. It is the likely cost that made the pairs slower (v0.5 notes).
MOKGEN_DEVICE void mbar_arrive_cluster(uint64_t* bar, uint32_t cta_id) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(cta_id)
      : "memory");
}
// The same with release at cluster scope (orders this thread's prior stores to the peer's shared
// memory before the arrival), and its matching wait (acquire at cluster scope): the walkers'
// hand-over of claimed tile indices (ep_forward.cuh), off the k-loops.
MOKGEN_DEVICE void mbar_arrive_release_cluster(uint64_t* bar, uint32_t cta_id) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(cta_id)
      : "memory");
}
MOKGEN_DEVICE void mbar_wait_acquire_cluster(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// Store a 32-bit value at the same shared-memory offset in CTA cta_id of the cluster.
MOKGEN_DEVICE void st_cluster_u32(void* smem, uint32_t cta_id, uint32_t value) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "st.shared::cluster.u32 [remote], %2;\n"
      "}\n" ::"r"(smem_u32(smem)),
      "r"(cta_id), "r"(value)
      : "memory");
}
MOKGEN_DEVICE void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// Generic-proxy writes to global memory -> later reads by the TMA (async proxy), and back.
MOKGEN_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
// The same for every state space (global and this CTA's shared memory).
MOKGEN_DEVICE void fence_proxy_async_all() { asm volatile("fence.proxy.async;" ::: "memory"); }

// K-major, swizzled shared-memory operand with kRowBytes-byte rows (128: 64 bf16 per row,
// SWIZZLE_128B, 8-row groups 1024 B apart; 64: 32 bf16, SWIZZLE_64B, 8-row groups 512 B apart).
template <int kRowBytes>
MOKGEN_DEVICE uint64_t smem_desc_k(const void* smem) {
  static_assert(kRowBytes == 128 || kRowBytes == 64, "128- or 64-byte rows");
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = uint16_t(smem_u32(smem) >> 4);
  d.bitfield.leading_byte_offset_ = 1;               // unused by swizzled K-major layouts
  d.bitfield.stride_byte_offset_ = (8 * kRowBytes) >> 4;
  d.bitfield.base_offset_ = 0;                       // stage buffers are 1024-byte aligned
  d.bitfield.layout_type_ = kRowBytes == 128 ? 1 : 2;  // SWIZZLE_128B / SWIZZLE_64B
  return d.desc_;
}

template <int kN>
struct Wgmma;
template <>
struct Wgmma<256> {
  using Op = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
};
template <>
struct Wgmma<128> {
  using Op = cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
};

// acc[kN / 2] += A(64 x 16) * B(kN x 16)^T; scale_d = 0 overwrites.
template <int kN, size_t... Is>
MOKGEN_DEVICE void wgmma_call(uint64_t da, uint64_t db, float* acc, bool accumulate, std::index_sequence<Is...>) {
  Wgmma<kN>::Op::fma(da, db, acc[Is]...,
                     accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// Position in the stage ring, advanced identically by the producer and every consumer thread.
template <int kStages>
struct PipeState {
  int stage = 0;
  uint32_t phase = 0;
  MOKGEN_DEVICE void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// Staggered consumers (plan.gemm_stagger = L > 0, a forward build option; docs/architecture.md,
// "Staggered consumers in the forward"): consumer warpgroup 1 (the tile's rows 64..127) starts its
// first tile only once warpgroup 0 has consumed L k-blocks of its own, so from then on the two run
// L k-blocks apart and one warpgroup's epilogue overlaps the other's last k-blocks. Warpgroup 0's
// thread 0 arrives on s_stagger_bar once; StaggerPipe carries whether that arrival is still owed.
// (The backward's GEMMs do the same with a run-time lead, bwd_gemm.cuh.) Builds without a stagger
// keep PipeState and never name the barrier.
__shared__ uint64_t s_stagger_bar;

template <int kStages>
struct StaggerPipe : PipeState<kStages> {
  int stagger_todo = 0;  // 1: this consumer thread's warpgroup still owes the hand-over
};

// Register dependency on every accumulator, so the compiler keeps reads and writes of acc on
// the right side of wgmma fences and waits (the asm statements do not name them otherwise).
template <int kN>
MOKGEN_DEVICE void fence_operands(float (&acc)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) cute::warpgroup_fence_operand(acc[i]);
}

// How the two tiles of a cluster pair share a stage (see the header comment).
enum TileShare : int { kShareNone = 0, kShareB = 1, kShareA = 2 };

// Where a gated tile's epilogue also keeps its pre-activations for the backward (the "save"
// policy of mokgen.backward): row r -> bf16* of that row's [g | u] pair of kN-column halves.
// NoSaveRows: never (the default); a functor with kMay = true is asked enabled() once per tile
// (uniform over the warpgroup, so the extra exchanges run for all lanes or none).
struct NoSaveRows {
  static constexpr bool kMay = false;
  MOKGEN_DEVICE bool enabled() const { return false; }
  MOKGEN_DEVICE bf16* operator()(int) const { return nullptr; }
};

// Output rows whose gated epilogue rounds h to MXFP8 (the expanded MXFP8 builds' h rows,
// mx_tile.cuh MxRoundedRows): C::kRoundsMx, and C::store_block(h, q, out) stores a row's
// 32-column block from the quad's 8 values per lane.
template <class C, class = void>
struct RoundsMx : std::false_type {};
template <class C>
struct RoundsMx<C, std::void_t<decltype(C::kRoundsMx)>> : std::bool_constant<C::kRoundsMx> {};

// What the consumers do to a stage's B before their wgmmas read it (HopperTile's StageB): nothing
// here; mx_tile.cuh's MxQuantB makes raw bf16 weights MX values in place (expanded MXFP8 builds
// with plan mx_fwd_weights "raw"). An active StageB has stage<kBNB>(sb, ct) called by each of the
// 256 consumer threads (ct = 128 wg + t), which returns once the whole stage's B is ready for the
// async proxy.
// A StageB with kSplit (mx_tile.cuh MxQuantBSplit, CTA pairs only) splits the work of a pair's
// shared B (kShareB tiles) between the two CTAs: see HopperTile's xfull barriers.
struct PlainB {
  static constexpr bool kActive = false;
  static constexpr bool kSplit = false;
};

// kStride: bytes from one stage to the next (0: this tile's own stage size). Tiles that share one
// pipeline (the up and down tiles of a CTA) must use the same stride, or a stage of one would
// overlap the next stage of the other while both are in flight.
// kStagger: the consumers' stagger lead in k-blocks (0: lockstep; see StaggerPipe). StageB: PlainB
// or MxQuantB (above).
template <int kN, int kK, bool kGated, bool kHasClamp, int kStages, int kBNB, int kStride = 0, int kCluster = 1,
          int kBlockK = 64, int kStagger = 0, class StageB = PlainB>
struct HopperTile {
  static constexpr int kBM = 128;
  static constexpr int kBK = kBlockK;  // 64 (128-byte rows, SWIZZLE_128B) or 32 (64-byte rows, SWIZZLE_64B)
  static constexpr int kRowBytes = kBK * 2;
  static_assert(kBK == 64 || kBK == 32, "k-blocks of 64 or 32");
  static constexpr int kBN = kGated ? kBNB / 2 : kBNB;  // output columns per tile
  static constexpr int kAcc = kBNB / 2;                  // fp32 accumulators per consumer thread
  static constexpr int kABytes = kBM * kBK * 2;
  static constexpr int kBBytes = kBNB * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;  // bytes the TMA delivers per stage
  static constexpr int kStageStride = kStride ? kStride : kStageBytes;
  static_assert(kStageStride >= kStageBytes && kStageStride % 1024 == 0, "stage stride");
  static constexpr int kKTiles = kK / kBK;
  static constexpr int kNTiles = kN / kBN;
  static constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
  // kShareB tiles of a pair with their B split (StageB::kSplit; measuring builds of
  // -DMOKGEN_MX_RAWB_SPLIT, v0.70, not yet run on a GPU): each CTA's producer loads only its own
  // half of B (box crank, a plain TMA load: no multicast), its consumers make that half ready
  // (StageB::stage_split) and also write it into the peer's stage by st.async, whose bytes the
  // peer's xfull[s] counts; full[s] expects A and the own half, xfull[s] the peer's half (one
  // arrival, the producer's, armed with those bytes; a plain arrival for every other use of the
  // stage, so that its phases follow full[s]'s). The peer's stage is free for those writes: the
  // producer that armed it waited on its empty barrier, which counts this CTA's consumers too.
  static constexpr bool kSplitB = StageB::kSplit;
  static_assert(!kSplitB || (kCluster == 2 && StageB::kActive), "a split B: CTA pairs and an active StageB");
  static constexpr int kBarrierBytes = (kSplitB ? 3 : 2) * kStages * 8;
  // full/empty (and xfull) barriers, then the 1024-aligned stages (+1024 of alignment slack)
  static constexpr size_t kSmemBytes = size_t(kStages) * kStageStride + kBarrierBytes + 1024;
  static_assert(kK % kBK == 0, "K must be a multiple of the k-block");
  static_assert(kN % kBN == 0, "N must be a multiple of the output tile");
  static_assert(kBNB == 256 || kBNB == 128, "B tile of 128 or 256 rows");
  static_assert(!kGated || kBNB == 256, "gated tiles pair 128 gate and 128 up rows");
  static_assert(kCluster == 1 || kCluster == 2, "clusters of one or two CTAs");
  // TMA boxes: A in two halves of 64 rows, B in two halves (gate / up rows of a gated tile).
  static constexpr int kABox = kBM / 2;
  static constexpr int kBBox = kBNB / 2;

  // Dynamic shared memory: the full/empty barriers first, then the stages at the next 1024-byte
  // boundary. Both tile types of a kernel (up and down) carve the same way, so they can share
  // one pipeline (and its barriers) across phases.
  struct Smem {
    uint64_t* full;
    uint64_t* empty;
    uint64_t* xfull;  // kSplitB only: the peer's half of B (above)
    unsigned char* stages;
  };

  MOKGEN_DEVICE static Smem carve(unsigned char* raw) {
    Smem s;
    s.full = reinterpret_cast<uint64_t*>(raw);
    s.empty = s.full + kStages;
    s.xfull = s.empty + kStages;
    const uintptr_t base = (reinterpret_cast<uintptr_t>(raw) + kBarrierBytes + 1023) & ~uintptr_t(1023);
    s.stages = reinterpret_cast<unsigned char*>(base);
    return s;
  }

  // Once per CTA (thread 0), before the roles start; followed by __syncthreads by the caller.
  MOKGEN_DEVICE static void init_barriers(const Smem& s) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], 2 * kCluster);
      if constexpr (kSplitB) mbar_init(&s.xfull[i], 1);
    }
    fence_barrier_init();
  }

  using Pipe = std::conditional_t<kStagger == 0, PipeState<kStages>, StaggerPipe<kStages>>;
  static_assert(kStagger == 0 || (kStagger >= 1 && kStagger < kStages && kStagger <= kKTiles),
                "the stagger's lead: 1 .. stages - 1 k-blocks, within one tile");
  static_assert(!StageB::kActive || (kStagger == 0 && kBK == 64),
                "a stage's B worked on by both consumer warpgroups: lockstep consumers, k-blocks of 64");

  // Producer (one thread): all k-blocks of one tile. a_row0: first A row (TMA coordinate);
  // b_row0: first B row in the [E*N, K] tensor maps, of map_b0 and map_b1 (gate and up rows of a
  // gated tile) or of map_b0 alone (both halves). share / crank (kCluster == 2): the operand this
  // tile shares with the peer's tile, and this CTA's rank in the cluster; this CTA loads half
  // crank of the shared operand into both CTAs, and its own operand whole.
  MOKGEN_DEVICE static void produce(const Smem& s, Pipe& pipe, const CUtensorMap* map_a, int a_row0,
                                    const CUtensorMap* map_b0, const CUtensorMap* map_b1, int b_row0,
                                    int share = kShareNone, int crank = 0) {
    MOKGEN_FWD_TRACE_ONLY(unsigned tr_waited = 0;)
    for (int kb = 0; kb < kKTiles; ++kb) {
      MOKGEN_FWD_TRACE_ONLY(const unsigned tr0 = fwd_trace::clock32();)
      mbar_wait(&s.empty[pipe.stage], pipe.phase ^ 1u);
      MOKGEN_FWD_TRACE_ONLY(tr_waited += fwd_trace::clock32() - tr0;)
      unsigned char* st = s.stages + size_t(pipe.stage) * kStageStride;
      uint64_t* full = &s.full[pipe.stage];
      const bool split = kSplitB && share == kShareB;
      if constexpr (kSplitB) {  // before full's arrival, which the consumers' wait acquires
        if (split)
          mbar_arrive_expect_tx(&s.xfull[pipe.stage], kBBytes / 2);
        else
          mbar_arrive(&s.xfull[pipe.stage]);
      }
      mbar_arrive_expect_tx(full, split ? kStageBytes - kBBytes / 2 : kStageBytes);
      const int k0 = kb * kBK;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const CUtensorMap* mb = kGated && h ? map_b1 : map_b0;
        const int b_row = kGated ? b_row0 : b_row0 + h * kBBox;
        unsigned char* sa = st + h * (kABox * kBK * 2);
        unsigned char* sb = st + kABytes + h * (kBBox * kBK * 2);
        load_box(map_a, full, sa, k0, a_row0 + h * kABox, share == kShareA, h == crank);
        if (!split)
          load_box(mb, full, sb, k0, b_row, share == kShareB, h == crank);
        else if (h == crank)  // the own half only, into this CTA alone; the peer's comes by st.async
          cute::SM90_TMA_LOAD_2D::copy(mb, full, 0, sb, k0, b_row);
      }
      pipe.advance();
    }
    MOKGEN_FWD_TRACE_ONLY(fwd_trace::s_waited[0] = tr_waited;)
  }

  // One box of a stage: where the pair shares it (shared, kCluster == 2), multicast by the CTA
  // whose half it is (mine) into both CTAs; otherwise a plain TMA load into this CTA.
  MOKGEN_DEVICE static void load_box(const CUtensorMap* map, uint64_t* full, void* smem, int c0, int c1, bool shared,
                                     bool mine) {
    if (kCluster == 2 && shared) {
      if (mine) multicast(map, full, smem, c0, c1);
    } else {
      cute::SM90_TMA_LOAD_2D::copy(map, full, 0, smem, c0, c1);
    }
  }

  // One box into the same offset of both CTAs of the pair; each CTA's full barrier (same offset)
  // receives its bytes.
  MOKGEN_DEVICE static void multicast(const CUtensorMap* map, uint64_t* full, void* smem, int c0, int c1) {
    cute::SM90_TMA_LOAD_MULTICAST_2D::copy(map, full, uint16_t(0b11), uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                                           smem, c0, c1);
  }

  // Consumer warpgroup wg (0/1): all k-blocks of one tile into acc, then the epilogue for rows
  // [64 wg, 64 wg + 64) of the tile that are < rows. c_row(r) -> bf16* of output row r, column 0.
  // abort_flag (optional, shared memory): read after the last k-block has landed; when set, the
  // epilogue writes nothing (the launch has failed; the pipeline still drains in step).
  // s_row (gated tiles): where the epilogue also stores g and u in bf16 (SaveRows above), beside h.
  // share / crank: the producer's (kSplitB only: whether this tile's B is split, and the own half).
  template <class CRow, class SRow = NoSaveRows>
  MOKGEN_DEVICE static void consume(const Smem& s, Pipe& pipe, int wg, int rows, int n0, CRow c_row,
                                    float clamp_limit, const volatile int* abort_flag = nullptr,
                                    SRow s_row = SRow{}, int share = kShareNone, int crank = 0) {
    float acc[kAcc];
    const int t = threadIdx.x & 127;
    // One k-block of wgmmas stays in flight: after issuing block kb, wait until block kb-1 has
    // retired and hand its stage back to the producer.
    int prev_stage = -1;
    MOKGEN_FWD_TRACE_ONLY(unsigned tr_waited = 0;)
#pragma unroll 2  // as the compiler picks for long K; a short K fully unrolled spilled the accumulators
    for (int kb = 0; kb < kKTiles; ++kb) {
      MOKGEN_FWD_TRACE_ONLY(const unsigned tr0 = fwd_trace::clock32();)
      mbar_wait(&s.full[pipe.stage], pipe.phase);
      MOKGEN_FWD_TRACE_ONLY(tr_waited += fwd_trace::clock32() - tr0;)
      const unsigned char* st = s.stages + size_t(pipe.stage) * kStageStride;
      const unsigned char* sa = st + wg * (64 * kRowBytes);
      const unsigned char* sb = st + kABytes;
      // (an active StageB: the stage's B made ready here, while the k-block before is in flight)
      if constexpr (kSplitB) {
        if (share == kShareB)
          StageB::template stage_split<kBNB>(sb, 128 * wg + t, crank, &s.xfull[pipe.stage], pipe.phase);
        else
          StageB::template stage<kBNB>(sb, 128 * wg + t);
      } else if constexpr (StageB::kActive) {
        StageB::template stage<kBNB>(sb, 128 * wg + t);
      }
      fence_operands(acc);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k16 = 0; k16 < kBK / 16; ++k16)
        wgmma_call<kBNB>(smem_desc_k<kRowBytes>(sa + k16 * 32), smem_desc_k<kRowBytes>(sb + k16 * 32), acc,
                         kb > 0 || k16 > 0,
                         std::make_index_sequence<kAcc>{});
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<1>();
      fence_operands(acc);
      if (prev_stage >= 0) release(s, prev_stage, t);
      prev_stage = pipe.stage;
      pipe.advance();
      if constexpr (kStagger > 0) {
        if (pipe.stagger_todo && kb == kStagger - 1) {  // the lead consumed: warpgroup 1 may start
          if (t == 0) mbar_arrive(&s_stagger_bar);
          pipe.stagger_todo = 0;
        }
      }
    }
    cute::warpgroup_wait<0>();
    fence_operands(acc);  // the epilogue reads acc only after the last wgmma retired
    MOKGEN_FWD_TRACE_ONLY(fwd_trace::s_kloop_end[1 + wg] = fwd_trace::clock(); fwd_trace::s_waited[1 + wg] = tr_waited;)
    release(s, prev_stage, t);
    if (abort_flag != nullptr && *abort_flag) rows = 0;
    // Accumulator layout (per warp w of the warpgroup, lane l): rows 16w + l/4 and +8;
    // n8 group i: columns 8i + 2(l%4) + {0,1} -> acc[4i + {0,1}] (row), acc[4i + {2,3}] (row + 8).
    // The 4 lanes of a quad share a row; per 4 groups, two butterfly exchanges (quad_transpose)
    // give each lane one whole group (8 columns, 16 bytes), so a warp stores 64 contiguous
    // bytes per row per instruction instead of 16 (full 32-byte sectors, 4x fewer stores).
    const int w = t >> 5, lane = t & 31;
    const int q = lane & 3;
    constexpr int kGroups = kGated ? kAcc / 8 : kAcc / 4;  // output n8 groups per row
    static_assert(kGroups % 4 == 0, "groups come in blocks of 4");
    if constexpr (kGated && SRow::kMay) {
      if (s_row.enabled()) save_pre_activations(acc, wg, rows, n0, s_row);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wg * 64 + w * 16 + (lane >> 2) + half * 8;
      const bool valid = r < rows;  // the same for the 4 lanes of a quad
      bf16* out = valid ? c_row(r) + n0 : nullptr;
      if constexpr (kGated && RoundsMx<CRow>::value) {  // h as MX values (expanded MXFP8 builds)
#pragma unroll
        for (int b = 0; b < kGroups / 4; ++b) {
          float h[8];  // this lane's 2 columns of groups 4b .. 4b+3: one 32-column block
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int i = 4 * b + u;
#pragma unroll
            for (int e = 0; e < 2; ++e)
              h[2 * u + e] = swiglu<kHasClamp>(acc[4 * i + 2 * half + e], acc[4 * (i + 16) + 2 * half + e], clamp_limit);
          }
          CRow::store_block(h, q, valid ? out + 32 * b : nullptr);
        }
      } else {
#pragma unroll
        for (int b = 0; b < kGroups / 4; ++b) {
          uint32_t word[4];  // this lane's 2 columns of groups 4b .. 4b+3
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int i = 4 * b + u;
            if constexpr (kGated) {  // gate in groups 0..15, up 16 groups later
              word[u] = pack_bf16x2(
                  swiglu<kHasClamp>(acc[4 * i + 2 * half], acc[4 * (i + 16) + 2 * half], clamp_limit),
                  swiglu<kHasClamp>(acc[4 * i + 2 * half + 1], acc[4 * (i + 16) + 2 * half + 1], clamp_limit));
            } else {
              word[u] = pack_bf16x2(acc[4 * i + 2 * half], acc[4 * i + 2 * half + 1]);
            }
          }
          const uint4 v = quad_transpose(word, q);  // group 4b + q, columns 0..7
          if (valid) *reinterpret_cast<uint4*>(out + 8 * (4 * b + q)) = v;
        }
      }
    }
  }

  // The gated epilogue's save (the backward's "save" policy): g and u of this thread's rows in
  // bf16, g at columns [n0, n0 + kBN) and u at [kN + n0, kN + n0 + kBN) of row s_row(r), with the
  // same quad exchange as h (16-byte stores, 64 contiguous bytes per warp and row).
  template <class SRow>
  MOKGEN_DEVICE static void save_pre_activations(const float (&acc)[kAcc], int wg, int rows, int n0, const SRow& s_row) {
    const int t = threadIdx.x & 127, w = t >> 5, lane = t & 31, q = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wg * 64 + w * 16 + (lane >> 2) + half * 8;
      const bool valid = r < rows;  // the same for the 4 lanes of a quad
      bf16* out = valid ? s_row(r) : nullptr;
#pragma unroll
      for (int b = 0; b < kAcc / 32; ++b) {
        uint32_t wg_[4], wu_[4];  // this lane's 2 columns of gate / up groups 4b .. 4b+3
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int i = 4 * b + u;
          wg_[u] = pack_bf16x2(acc[4 * i + 2 * half], acc[4 * i + 2 * half + 1]);
          wu_[u] = pack_bf16x2(acc[4 * (i + 16) + 2 * half], acc[4 * (i + 16) + 2 * half + 1]);
        }
        const uint4 vg = quad_transpose(wg_, q), vu = quad_transpose(wu_, q);
        if (valid) {
          const int col = n0 + 8 * (4 * b + q);
          *reinterpret_cast<uint4*>(out + col) = vg;
          *reinterpret_cast<uint4*>(out + kN + col) = vu;
        }
      }
    }
  }

  // Hand stage st back: thread 0 of the warpgroup arrives on this CTA's empty barrier and, in a
  // pair, thread 1 on the peer's (whose producer multicasts into this CTA's stage too).
  MOKGEN_DEVICE static void release(const Smem& s, int st, int t) {
    if (t == 0) mbar_arrive(&s.empty[st]);
    if constexpr (kCluster == 2)
      if (t == 1) mbar_arrive_cluster(&s.empty[st], cute::block_rank_in_cluster() ^ 1u);
  }

  // In: lane q of a quad holds word[u] = its 2 columns of group u (u = 0..3). Out: lane q gets
  // the 4 lanes' words of group q, in lane order (columns 0..7 of the group). Two exchanges:
  // with lane q^1 (keep the groups of q's parity), then with lane q^2 (keep group q).
  MOKGEN_DEVICE static uint4 quad_transpose(const uint32_t (&word)[4], int q) {
    const int p = q & 1, k = q >> 1;
    // stage 1: send the two groups of the other parity, receive the partner's of ours
    const uint32_t s0 = p ? word[0] : word[1], s1 = p ? word[2] : word[3];
    const uint32_t r0 = __shfl_xor_sync(0xffffffffu, s0, 1), r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
    const uint32_t m0 = p ? word[1] : word[0], m1 = p ? word[3] : word[2];  // ours: groups p, p+2
    // words of lanes 2k and 2k+1 for groups p (lo0, hi0) and p + 2 (lo1, hi1)
    const uint32_t lo0 = p ? r0 : m0, hi0 = p ? m0 : r0, lo1 = p ? r1 : m1, hi1 = p ? m1 : r1;
    // stage 2: keep group q = p + 2k, send group p + 2(1 - k), receive the other lane pair's half
    const uint32_t a0 = k ? lo0 : lo1, a1 = k ? hi0 : hi1;
    const uint32_t b0 = __shfl_xor_sync(0xffffffffu, a0, 2), b1 = __shfl_xor_sync(0xffffffffu, a1, 2);
    const uint32_t keep0 = k ? lo1 : lo0, keep1 = k ? hi1 : hi0;
    return k ? make_uint4(b0, b1, keep0, keep1) : make_uint4(keep0, keep1, b0, b1);
  }
};

// ---- host: 2-D bf16 tensor maps for the tiles (row-major [rows, cols], swizzled boxes) -----------
// box_cols 64 (128-byte rows, SWIZZLE_128B) or 32 (64-byte rows, SWIZZLE_64B), as the tile's kBK.
inline CUresult encode_map_2d(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols, uint32_t box_rows,
                              uint32_t box_cols = 64) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * 2};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, box_cols == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

}  // namespace sm90
}  // namespace mokgen
