// The MXFP8 expert tile for the megakernel (issue 6; docs/architecture.md, "The megakernel's MXFP8
// path"): hopper_gemm.cuh's HopperTile with A as MXFP8 rows, on the BF16 tensor core as the
// bf16-math GEMM (mx_gemm.cuh, namespace bf16m). The megakernel's up and down tiles in MXFP8
// builds (ep_forward.cuh, Cfg::kMx); a standalone kernel in templates/mx_gemm.cu also runs it
// alone against the bf16-math GEMM (tests/test_gpu_mx_gemm.py).
//
// Tile: 128 rows (consumer warpgroup c owns rows 64 c .. 64 c + 63) x kBNB B rows, k-blocks of
// 64. Per stage: A's 128 x 64 E4M3 codes (two 64-row TMA boxes, 64-byte rows, SWIZZLE_64B), B's
// kBNB x 64 bf16 MX values (two boxes, 128-byte rows, SWIZZLE_128B; for a gated tile 128 w_gate
// rows then 128 w_up rows), and the four E8M0 scales of the stage's k128 block for the 128 rows
// (a TMA box of A's blocked scale plane [K / 128, rows, 4]; see kScaleBoxRows for why it is 132
// rows from the 4-aligned row at or below the tile's first). Each consumer decodes its rows'
// codes into the wgmma's register A fragments (mx_decode.cuh), a k-block's four at a time, and
// issues the k-block's four m64nkBNBk16 wgmmas as one commit group, the k-block before kept in flight.
//
// Epilogues: the down tile (not gated) writes bf16 rows as HopperTile's does. The gated tile
// computes h = swiglu(gate, up) and quantizes it to MXFP8 in place of bf16 h: each of its 32-column
// blocks of a row is one MX block, held by the four lanes of a quad (8 values each), which agree
// on its amax by two shuffles; the codes are exchanged so that each lane stores 8 contiguous codes
// and lane 0 of the quad the block's scale (mx::quantize_block's bits).
// Clusters of two (kCluster = 2, v0.55): as HopperTile's pairs, the two CTAs run two tiles that
// share one operand and each CTA's producer multicasts its half of that operand into both CTAs'
// stages. kShareB (row blocks m, m + 1, one column tile): the B half `crank`; kShareA (one row
// block, column tiles n, n + 1): the A codes' half `crank`, and crank 0 multicasts the scales' box
// (both tiles have the same first row). The barriers, the stage release to the peer and the
// multicast itself are HopperTile's. 32-wide k-blocks are not supported.
#pragma once

#include "hopper_gemm.cuh"
#include "mx.cuh"
#include "mx_decode.cuh"
#include "mx_round.cuh"

namespace mokgen {
namespace sm90 {

// An MX tile's A operand: the codes' tensor map, and the scales' map (encode_scales_2d): the
// blocked layout [K / 128, rows, 4] as 4-byte words [K / 128, rows], a tile's words of one k128
// block in one box. A TMA box, not a bulk copy: a tile's first row is any row of the ring (expert
// segments are not padded there), and a bulk copy needs 16-byte aligned sources.
//
// The box's first coordinate must be 16-byte aligned too: a TMA load whose innermost coordinate
// is not (here: a first row that is not a multiple of 4 words) stops the kernel with
// cudaErrorIllegalInstruction (v0.38: the megakernel's first MXFP8 launch, located with
// compute-sanitizer; the harness's tiles start at multiples of 128 and never showed it). So the
// box starts at the 4-aligned row at or below the tile's first, a_row0 & ~3, and is 4 rows longer
// than the tile; the consumers read it from a_row0 & 3 on, which the producer stores in the stage
// beside the box (kShiftOffset).
constexpr int kScaleBoxRows = 128 + 4;
struct MxA {
  const CUtensorMap* map;
  const CUtensorMap* scales;
};

// Where a gated MX tile's epilogue puts h: codes(r) -> uint8_t* of row r's codes at column 0;
// scale(r, b, s): E8M0 scale s of row r's 32-block b (b counted from column 0).
struct MxRowsBlocked {
  uint8_t* codes_base;  // [rows_total, n] E4M3 codes
  uint8_t* scales;      // [n / 128, rows_total, 4] blocked E8M0 scales
  int n;
  int rows_total;
  int row0;  // the tile's first row in rows_total
  MOKGEN_DEVICE uint8_t* codes(int r) const { return codes_base + size_t(row0 + r) * n; }
  MOKGEN_DEVICE void scale(int r, int b, uint8_t s) const {
    scales[(size_t(b >> 2) * rows_total + row0 + r) * 4 + (b & 3)] = s;
  }
};

// ---- expanded MXFP8 builds (MOKGEN_MX_EXPAND; ep_forward.cuh, CfgMxExpand) --------------------
// The ring and h hold bf16 MX values with k permuted within each 16 as the bf16 MX weights
// (mx_decode.cuh): word position P < 4 of a k16 step holds the pair of k 4P, 4P + 1, position
// 4 + P the pair of k 4P + 2, 4P + 3, which is where MxTile's register fragments put them. The
// bf16 tiles' SS wgmmas then multiply the same values in the same k slots as MxTile's RS ones.

// 16 E4M3 codes of one k16 step (16 bytes, k order) with their block's E8M0 scale s -> the
// step's 16 bf16 MX values in the permuted order: lo = positions 0..7, hi = positions 8..15.
MOKGEN_DEVICE void mx_expand16(const uint4& codes, uint32_t s, uint4& lo, uint4& hi) {
  uint32_t m1, m2;
  mxd::multipliers(s, m1, m2);
  lo = make_uint4(mxd::decode2(codes.x, m1, m2), mxd::decode2(codes.y, m1, m2), mxd::decode2(codes.z, m1, m2),
                  mxd::decode2(codes.w, m1, m2));
  hi = make_uint4(mxd::decode2(codes.x >> 16, m1, m2), mxd::decode2(codes.y >> 16, m1, m2),
                  mxd::decode2(codes.z >> 16, m1, m2), mxd::decode2(codes.w >> 16, m1, m2));
}

// The up tiles' h rows of an expanded build (HopperTile's gated epilogue, RoundsMx): each 32-column
// block of a row quantized as MxTile::quantize_h quantizes it (mx::quantize_block's bits), then
// stored as its bf16 MX values (the decode MxTile's down tiles apply to those codes), k permuted.
template <int kLd>
struct MxRoundedRows {
  static constexpr bool kRoundsMx = true;
  bf16* base;
  MOKGEN_DEVICE bf16* operator()(int r) const { return base + int64_t(r) * kLd; }

  // One 32-column block of a row, held by the 4 lanes of a quad: lane q's h[2u + e] is column
  // 8u + 2q + e. out: the block's first column in the row (nullptr: compute, store nothing; the
  // same for the 4 lanes). Lane q stores 16 bytes: the word positions 4 (q & 1) .. + 3 of the
  // block's k16 step q >> 1.
  MOKGEN_DEVICE static void store_block(const float (&h)[8], int q, bf16* out) {
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t m = mx::float_bits(h[i]) & 0x7fffffffu;
      amax = m > amax ? m : amax;
    }
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const bool finite = amax < 0x7f800000u;  // mx::quantize_block's scale rule, as quantize_h
    const int exp_field = int(amax >> 23);
    int sc = exp_field == 0 ? -127 : exp_field - 127 - 8;
    sc = sc < -127 ? -127 : sc;
    const float inv = mx::bits_float(uint32_t(127 - sc) << 23);
    uint32_t m1, m2;
    mxd::multipliers(finite ? uint32_t(sc + 127) : uint32_t(mx::kE8M0Nan), m1, m2);
    uint32_t word[4];  // group u's pair of this lane, decoded
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      uint16_t pair;
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(h[2 * u + 1] * inv), "f"(h[2 * u] * inv));
      word[u] = mxd::decode2(finite ? pair : uint32_t(mx::kE4M3Nan | (mx::kE4M3Nan << 8)), m1, m2);
    }
    // k16 step m = q >> 1 (groups 2m, 2m + 1), positions of parity p = q & 1: the pairs of lanes
    // p and p + 2 (this lane and lane q ^ 2), groups 2m and 2m + 1, in that order
    const int m = q >> 1;
    const uint32_t s0 = m ? word[0] : word[2], s1 = m ? word[1] : word[3];  // the partner's step
    const uint32_t r0 = __shfl_xor_sync(0xffffffffu, s0, 2), r1 = __shfl_xor_sync(0xffffffffu, s1, 2);
    const uint32_t a0 = m ? word[2] : word[0], a1 = m ? word[3] : word[1];
    const uint4 v = m ? make_uint4(r0, a0, r1, a1) : make_uint4(a0, r0, a1, r1);
    if (out != nullptr) *reinterpret_cast<uint4*>(out + 16 * m + 8 * (q & 1)) = v;
  }
};

// ---- expanded MXFP8 builds with the weights raw (plan mx_fwd_weights "raw", Cfg::kMxRawB; v0.68) ----
// The tiles' B is the layer's bf16 weights as it holds them (W_gate, W_up [E, I, H], W_down [E, H,
// I]: k contiguous), and the two consumer warpgroups make each stage's B the MX values that
// mokgen.mx_gemm.expert_weights writes for the values form (mx_rows.cuh weight_rows_kernel: each
// 32-block along k quantized, its values as bf16, k permuted within each 16 as above) in place,
// before either issues its wgmmas on the stage (HopperTile's StageB hook). The conversion pass
// over the weights (kimi-k2.5 local: 2.86 ms of the MXFP8 training step on an H100, v0.66) is
// then never run; a training step whose weights change every step reads them once.
// A stage's B: kBNB rows of 64 k, 128 bytes each (SWIZZLE_128B: 16-byte chunk c of row r at
// c ^ (r % 8)), 2 kBNB 32-blocks of four chunks. Consumer thread ct (0..255) takes blocks ct + 256 j:
// row (ct + 256 j) % kBNB, block (ct + 256 j) / kBNB of the row. The eight threads of a 16-byte
// access phase hold eight consecutive rows' chunk c, eight distinct 16-byte slots of the 128
// banks' bytes: no bank conflicts. The values are mx_round.cuh's (the conversion's bits).
struct MxQuantB {
  static constexpr bool kActive = true;
  static constexpr bool kSplit = false;
  // named barrier of the 256 consumer threads (barrier 1 parks the producer warpgroup's idle warps,
  // ep_forward.cuh)
  static constexpr int kBarrier = 2;

  MOKGEN_DEVICE static uint4 lds128(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
  }
  MOKGEN_DEVICE static void sts128(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
  }

  // st.async of 16 bytes to a peer CTA's shared memory (shared::cluster address), counted on its
  // mbarrier (complete_tx) at the same time.
  MOKGEN_DEVICE static void st_async128(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                 ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d), "r"(bar) : "memory");
  }

  // Block b (0, 1) of row `row` of the stage's B at shared address sb: its two k16 steps' words
  // v[s][0..7] in k order, made MX values, stored back with word n of a step at position
  // (n >> 1) + 4 (n & 1) (the pair of k 4P, 4P + 1 at P < 4, of 4P + 2, 4P + 3 at 4 + P).
  // kRemote (MxQuantBSplit): also stored at the same offset from peer_sb, the peer's copy of the
  // stage (shared::cluster), counted on the peer's barrier peer_bar.
  template <bool kRemote = false>
  MOKGEN_DEVICE static void block(uint32_t sb, int row, int b, uint32_t peer_sb = 0, uint32_t peer_bar = 0) {
    const uint32_t line = sb + uint32_t(row) * 128u;
    const int sw = row & 7;
    uint32_t v[2][8];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint4 x = lds128(line + (((4 * b + c) ^ sw) << 4));
      uint32_t* d = &v[c >> 1][4 * (c & 1)];
      d[0] = x.x, d[1] = x.y, d[2] = x.z, d[3] = x.w;
    }
    uint32_t amax = mxg::absmax_bf16x2(v[0][0], v[0][1]);
#pragma unroll
    for (int i = 2; i < 16; ++i) amax = mxg::absmax_bf16x2(amax, v[i >> 3][i & 7]);
    amax &= 0x7fff7fffu;
    amax = mxg::max_u16x2(amax, amax >> 16) & 0xffffu;  // the block's largest magnitude, bf16 bits
    const uint32_t ea = amax >> 7;
#if defined(MOKGEN_MX_RAWB_NO_ROUND)
    // measuring build (wrong results): the loads, the amax and the permuted stores, no rounding
    if (ea == 0x1ffu) v[0][0] = amax;  // (never: keeps the amax)
#else
    if (mxg::fast_field(ea)) {
      mxg::round_block(v[0], ea, ea);
      mxg::round_block(v[1], ea, ea);
    } else {  // near E8M0's ends, zero, or not finite: the conversion's own arithmetic
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        mxg::exact_half<false>(v[s], amax);
        mxg::exact_half<true>(v[s], amax);
      }
    }
#endif
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const uint32_t a0 = line + (((4 * b + 2 * s) ^ sw) << 4), a1 = line + (((4 * b + 2 * s + 1) ^ sw) << 4);
      sts128(a0, v[s][0], v[s][2], v[s][4], v[s][6]);
      sts128(a1, v[s][1], v[s][3], v[s][5], v[s][7]);
      if constexpr (kRemote) {
        st_async128(a0 - sb + peer_sb, v[s][0], v[s][2], v[s][4], v[s][6], peer_bar);
        st_async128(a1 - sb + peer_sb, v[s][1], v[s][3], v[s][5], v[s][7], peer_bar);
      }
    }
  }

  // All 256 consumer threads: the stage's B (kBNB rows at sb) made MX values, then visible to the
  // wgmmas (the async proxy) of both warpgroups.
  template <int kBNB>
  MOKGEN_DEVICE static void stage(const unsigned char* sb, int ct) {
    static_assert(kBNB == 256 || kBNB == 128, "B tiles of 128 or 256 rows");
    const uint32_t base = smem_u32(sb);
#if defined(MOKGEN_MX_RAWB_BARRIER_ONLY)
    (void)base, (void)ct;  // measuring build (wrong results): the fence and the barrier alone
#else
#pragma unroll
    for (int j = 0; j < kBNB / 128; ++j) {
      const int id = ct + 256 * j;
      block(base, id % kBNB, id / kBNB);
    }
#endif
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync %0, 256;" ::"n"(kBarrier) : "memory");
  }
};

// The same values with a CTA pair's shared B split between the two CTAs (HopperTile's kSplitB;
// measuring builds of -DMOKGEN_MX_RAWB_SPLIT, v0.70, not yet run on a GPU). Each CTA's consumers
// quantize only the half of B their producer loaded (rows crank kBNB / 2 .. + kBNB / 2: 2 x
// kBNB / 2 blocks, one a thread for kBNB 256, the first 128 threads for 128), store it in place
// and, by st.async, at the same offset of the peer's stage, counted on the peer's xfull[s]. Then
// they wait on their own xfull[s] (the peer's half landed), make both halves visible to the
// wgmmas (a proxy fence after the wait orders this thread's stores and the observed peer's), and
// meet at the named barrier. Half the rounding a CTA, plus 16-byte stores to the peer.
struct MxQuantBSplit : MxQuantB {
  static constexpr bool kSplit = true;

  template <int kBNB>
  MOKGEN_DEVICE static void stage_split(const unsigned char* sb, int ct, int crank, uint64_t* xfull, uint32_t parity) {
    static_assert(kBNB == 256 || kBNB == 128, "B tiles of 128 or 256 rows");
    constexpr int kHalf = kBNB / 2;
    const uint32_t base = smem_u32(sb), peer = cute::block_rank_in_cluster() ^ 1u;
    uint32_t peer_base, peer_bar;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peer_base) : "r"(base), "r"(peer));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peer_bar) : "r"(smem_u32(xfull)), "r"(peer));
    if (ct < kBNB) block<true>(base, crank * kHalf + ct % kHalf, ct / kHalf, peer_base, peer_bar);
    mbar_wait_acquire_cluster(xfull, parity);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync %0, 256;" ::"n"(kBarrier) : "memory");
  }
};

template <int kN, int kK, bool kGated, bool kHasClamp, int kStages, int kBNB, int kStride = 0, int kCluster = 1>
struct MxTile {
  static constexpr int kBM = 128;
  static constexpr int kBK = 64;
  static constexpr int kBN = kGated ? kBNB / 2 : kBNB;  // output columns per tile
  static constexpr int kAcc = kBNB / 2;                  // fp32 accumulators per consumer thread
  static constexpr int kABytes = kBM * kBK;              // E4M3 codes
  static constexpr int kBBytes = kBNB * kBK * 2;         // bf16 MX values
  static constexpr int kScaleBytes = kScaleBoxRows * 4;  // the k128 block's four scales per row (kScaleBoxRows)
  static constexpr int kStageBytes = kABytes + kBBytes + kScaleBytes;  // bytes the TMA delivers per stage
  static constexpr int kStageStride = kStride ? kStride : (kStageBytes + 16 + 1023) / 1024 * 1024;
  static_assert(kStageStride >= kStageBytes + 16 && kStageStride % 1024 == 0, "stage stride");
  // int: a_row0 & 3, the tile's first row in the scales' box. At the stride's end, past every TMA
  // box of both tile kinds that share the stride (up and down), so that no byte is written by
  // the producer's plain store in one use of a stage and by the TMA in another.
  static constexpr int kShiftOffset = kStageStride - 16;
  static_assert(kBM <= kScaleBoxRows - 3 && kScaleBytes % 16 == 0, "the scales' box covers a tile from a 4-aligned row");
  static constexpr int kKTiles = kK / kBK;
  static constexpr int kNTiles = kN / kBN;
  static constexpr int kThreads = 384;
  static constexpr size_t kSmemBytes = size_t(kStages) * kStageStride + 2 * kStages * 8 + 1024;
  static_assert(kK % 128 == 0, "K must be a multiple of the scales' k128 block");
  static_assert(kN % kBN == 0, "N must be a multiple of the output tile");
  static_assert(kBNB == 256 || kBNB == 128, "B tile of 128 or 256 rows");
  static_assert(!kGated || kBNB == 256, "gated tiles pair 128 gate and 128 up rows");
  static constexpr int kABox = kBM / 2;
  static constexpr int kBBox = kBNB / 2;

  // HopperTile's stride-free parts: the barriers' carve and init (the empty barriers count the
  // peer's consumers in a pair), the stage release (to the peer too), the multicast, the quad
  // exchange (its own stage sizes are bf16 A's and play no part here)
  using Base = HopperTile<kN, kK, kGated, kHasClamp, kStages, kBNB, 0, kCluster>;
  using Smem = typename Base::Smem;
  using Pipe = PipeState<kStages>;

  MOKGEN_DEVICE static Smem carve(unsigned char* raw) { return Base::carve(raw); }
  MOKGEN_DEVICE static void init_barriers(const Smem& s) { Base::init_barriers(s); }

  // Producer (one thread): all k-blocks of one tile. a_row0: first A row (TMA coordinate, and the
  // row of A's blocked scales); b_row0: first B row of map_b0 and map_b1 (gate and up rows of a
  // gated tile) or of map_b0 alone (both halves). HopperTile's signature, A an MxA. share / crank
  // (kCluster == 2): the operand this tile shares with the peer's tile, and this CTA's rank in the
  // cluster (see the header comment); each CTA's full barrier still receives kStageBytes.
  MOKGEN_DEVICE static void produce(const Smem& s, Pipe& pipe, const MxA& a, int a_row0, const CUtensorMap* map_b0,
                                    const CUtensorMap* map_b1, int b_row0, int share = kShareNone, int crank = 0) {
    MOKGEN_FWD_TRACE_ONLY(unsigned tr_waited = 0;)  // trace builds: the waits for empty stages
    for (int kb = 0; kb < kKTiles; ++kb) {
      MOKGEN_FWD_TRACE_ONLY(const unsigned tr0 = fwd_trace::clock32();)
      mbar_wait(&s.empty[pipe.stage], pipe.phase ^ 1u);
      MOKGEN_FWD_TRACE_ONLY(tr_waited += fwd_trace::clock32() - tr0;)
      unsigned char* st = s.stages + size_t(pipe.stage) * kStageStride;
      uint64_t* full = &s.full[pipe.stage];
      // the scales' shift, a plain store that the arrival below releases to the consumers (their
      // wait on full acquires it); the stage's previous readers are done (the empty wait)
      *reinterpret_cast<int*>(st + kShiftOffset) = a_row0 & 3;
      mbar_arrive_expect_tx(full, kStageBytes);
      const int k0 = kb * kBK;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const CUtensorMap* mb = kGated && h ? map_b1 : map_b0;
        const int b_row = kGated ? b_row0 : b_row0 + h * kBBox;
        unsigned char* sa = st + h * (kABox * kBK);
        unsigned char* sb = st + kABytes + h * (kBBox * kBK * 2);
        Base::load_box(a.map, full, sa, k0, a_row0 + h * kABox, share == kShareA, h == crank);
        Base::load_box(mb, full, sb, k0, b_row, share == kShareB, h == crank);
      }
      unsigned char* ss = st + kABytes + kBBytes;
      if (kCluster == 2 && share == kShareA) {
        if (crank == 0) Base::multicast(a.scales, full, ss, a_row0 & ~3, k0 / 128);
      } else {
        cute::SM90_TMA_LOAD_2D::copy(a.scales, full, 0, ss, a_row0 & ~3, k0 / 128);
      }
      pipe.advance();
    }
    MOKGEN_FWD_TRACE_ONLY(fwd_trace::s_waited[0] = tr_waited;)
  }

  // Consumer warpgroup wg (0/1): all k-blocks of one tile, then the epilogue for rows
  // [64 wg, 64 wg + 64) of the tile that are < rows. Down tiles: out(r) -> bf16* of output row r at
  // column 0 (as HopperTile). Gated tiles: out is an MxRowsBlocked-like object (codes, scale).
  // HopperTile's signature. s_row (gated tiles): where the epilogue also stores g and u in bf16
  // (HopperTile::save_pre_activations, the same accumulator layout), beside h's codes: the
  // training save of MXFP8 builds (mokgen.ep._MXTraining).
  // (share / crank: HopperTile's signature; this tile's B is never split)
  template <class Out, class SRow = NoSaveRows>
  MOKGEN_DEVICE static void consume(const Smem& s, Pipe& pipe, int wg, int rows, int n0, const Out& out,
                                    float clamp_limit, const volatile int* abort_flag = nullptr,
                                    SRow s_row = SRow{}, int /*share*/ = kShareNone, int /*crank*/ = 0) {
    float acc[kAcc];
    const int t = threadIdx.x & 127, w = t >> 5, lane = t & 31, q = lane & 3, g = lane >> 2;
    const int r0 = 64 * wg + 16 * w + g;  // this thread's rows r0 and r0 + 8 of the tile
    int prev_stage = -1;
    MOKGEN_FWD_TRACE_ONLY(unsigned tr_waited = 0;)  // trace builds: the waits for full stages
    // A k-block's four A fragments are decoded together, then one fence, its four wgmmas in one
    // commit group and the wait for the k-block before: one k-block in flight, HopperTile's
    // structure. The fragments are double-buffered by k-block parity (32 registers), so the
    // decode of k-block kb overlaps the wgmmas of kb - 1. (Before v0.56: a fence, a commit group
    // and a wait per k16 step, one step in flight; the same wgmmas in the same order, so the same
    // bits, 0.984-0.995 of the time on an H100, docs/perf-notes.md v0.56.)
    uint32_t a[2][kBK / 16][4];
    const auto kblock = [&](int kb, auto buffer) {
      constexpr int B = decltype(buffer)::value;
      MOKGEN_FWD_TRACE_ONLY(const unsigned tr0 = fwd_trace::clock32();)
      mbar_wait(&s.full[pipe.stage], pipe.phase);
      MOKGEN_FWD_TRACE_ONLY(tr_waited += fwd_trace::clock32() - tr0;)
      const unsigned char* st = s.stages + size_t(pipe.stage) * kStageStride;
      const unsigned char* sb = st + kABytes;
      // the stage's words by shared-window addresses: LDS (mx_decode.cuh lds32; generic loads,
      // LD.E, before v0.56: 0.965-0.980 of their time, docs/perf-notes.md v0.56)
      const uint32_t sst = smem_u32(st);
      const uint32_t sc = sst + kABytes + kBBytes + 4u * mxd::lds32(sst + kShiftOffset);
      const uint32_t wa0 = mxd::lds32(sc + 4u * r0), wa1 = mxd::lds32(sc + 4u * (r0 + 8));
      // the k16 chunk of row r (64-byte rows, SWIZZLE_64B: chunk c at c ^ (r / 2 % 4))
      const auto code = [&](int r, int k16) { return mxd::lds32(sst + r * 64 + ((k16 ^ ((r >> 1) & 3)) << 4) + 4 * q); };
#pragma unroll
      for (int k16 = 0; k16 < kBK / 16; ++k16) {
#if defined(MOKGEN_MX_SS_A)
        (void)wa0, (void)wa1, (void)code;
#else
        const int blk = 2 * (kb & 1) + k16 / 2;  // the 32-block of the k128 block's four
        uint32_t m1a, m2a, m1b, m2b;
        mxd::multipliers((wa0 >> (8 * blk)) & 0xffu, m1a, m2a);
        mxd::multipliers((wa1 >> (8 * blk)) & 0xffu, m1b, m2b);
        const uint32_t c0 = code(r0, k16), c1 = code(r0 + 8, k16);
        uint32_t(&f)[4] = a[B][k16];
#if defined(MOKGEN_MX_NO_DECODE)
        // measuring build (wrong results): the codes' words as the A fragments, undecoded
        f[0] = c0, f[1] = c1, f[2] = c0 ^ m1a, f[3] = c1 ^ m1b;
#else
        f[0] = mxd::decode2(c0, m1a, m2a);        // row r0, k slots 2q, 2q + 1
        f[1] = mxd::decode2(c1, m1b, m2b);        // row r0 + 8
        f[2] = mxd::decode2(c0 >> 16, m1a, m2a);  // row r0, slots 2q + 8, 2q + 9
        f[3] = mxd::decode2(c1 >> 16, m1b, m2b);
#endif
        mxd::fence_a(f);
#endif
      }
      fence_operands(acc);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k16 = 0; k16 < kBK / 16; ++k16) {
#if defined(MOKGEN_MX_SS_A)
        // measuring build (wrong results): no A fragments; an SS wgmma reads the codes' bytes in
        // shared memory as bf16 A (64-byte rows: k16 steps 0 and 1 only)
        wgmma_call<kBNB>(smem_desc_k<64>(st + wg * 64 * 64 + (k16 & 1) * 32), smem_desc_k<128>(sb + k16 * 32), acc,
                         kb > 0 || k16 > 0, std::make_index_sequence<kAcc>{});
#else
        mxd::wgmma_rs<kBNB>(a[B][k16], smem_desc_k<128>(sb + k16 * 32), acc, kb > 0 || k16 > 0,
                            std::make_index_sequence<kAcc>{});
#endif
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<1>();  // the k-block before retired: its stage and its fragments are free
#pragma unroll
      for (int k16 = 0; k16 < kBK / 16; ++k16) mxd::fence_a(a[B ^ 1][k16]);
      fence_operands(acc);
      if (prev_stage >= 0) Base::release(s, prev_stage, t);
      prev_stage = pipe.stage;
      pipe.advance();
    };
    static_assert(kKTiles % 2 == 0, "k-blocks in pairs (K is a multiple of 128)");
    for (int kb = 0; kb < kKTiles; kb += 2) {
      kblock(kb, std::integral_constant<int, 0>{});
      kblock(kb + 1, std::integral_constant<int, 1>{});
    }
    cute::warpgroup_wait<0>();
    fence_operands(acc);
    MOKGEN_FWD_TRACE_ONLY(fwd_trace::s_kloop_end[1 + wg] = fwd_trace::clock(); fwd_trace::s_waited[1 + wg] = tr_waited;)
    Base::release(s, prev_stage, t);
    if (abort_flag != nullptr && *abort_flag) rows = 0;
    if constexpr (kGated) {
      quantize_h(acc, rows, r0, n0, q, out, clamp_limit);
      if constexpr (SRow::kMay) {
        if (s_row.enabled()) Base::save_pre_activations(acc, wg, rows, n0, s_row);
      }
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = r0 + 8 * half;
        const bool valid = r < rows;  // the same for the 4 lanes of a quad
        bf16* o = valid ? out(r) + n0 : nullptr;
#pragma unroll
        for (int b = 0; b < kAcc / 16; ++b) {
          uint32_t word[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int i = 4 * b + u;
            word[u] = pack_bf16x2(acc[4 * i + 2 * half], acc[4 * i + 2 * half + 1]);
          }
          const uint4 v = Base::quad_transpose(word, q);
          if (valid) *reinterpret_cast<uint4*>(o + 8 * (4 * b + q)) = v;
        }
      }
    }
  }

  // The gated epilogue: h = swiglu(gate, up) for the tile's kBN columns, quantized per 32-block.
  // Lane q of a quad holds columns 8u + 2q, +1 (u = 0..3) of block b; after quad_transpose on the
  // 16-bit code pairs it holds the 8 codes of group q (columns 8q .. 8q + 7), one 8-byte store.
  template <class Out>
  MOKGEN_DEVICE static void quantize_h(const float (&acc)[kAcc], int rows, int r0, int n0, int q, const Out& out,
                                       float clamp_limit) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + 8 * half;
      const bool valid = r < rows;  // the same for the 4 lanes of a quad
#pragma unroll
      for (int b = 0; b < kBN / 32; ++b) {
        float h[8];
        uint32_t amax = 0;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int i = 4 * b + u;  // gate accumulators i, up i + 16
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float v =
                swiglu<kHasClamp>(acc[4 * i + 2 * half + e], acc[4 * (i + 16) + 2 * half + e], clamp_limit);
            h[2 * u + e] = v;
            const uint32_t m = mx::float_bits(v) & 0x7fffffffu;
            amax = m > amax ? m : amax;
          }
        }
        amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const bool finite = amax < 0x7f800000u;  // mx::quantize_block's scale rule
        const int exp_field = int(amax >> 23);
        int sc = exp_field == 0 ? -127 : exp_field - 127 - 8;
        sc = sc < -127 ? -127 : sc;
        const float inv = mx::bits_float(uint32_t(127 - sc) << 23);
        uint32_t word[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          uint16_t pair;
          asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(h[2 * u + 1] * inv), "f"(h[2 * u] * inv));
          word[u] = finite ? pair : uint32_t(mx::kE4M3Nan | (mx::kE4M3Nan << 8));
        }
        const uint4 v = Base::quad_transpose(word, q);  // lanes 0..3's pairs of group q
        if (valid) {
          const int col = n0 + 32 * b + 8 * q;
          *reinterpret_cast<uint2*>(out.codes(r) + col) =
              make_uint2(v.x | (v.y << 16), v.z | (v.w << 16));
          if (q == 0) out.scale(r, (n0 + 32 * b) / 32, finite ? uint8_t(sc + 127) : mx::kE8M0Nan);
        }
      }
    }
  }
};

// ---- host: the scales' map (MxA::scales): blocked scales [k_blocks, rows, 4] as 4-byte words
// [k_blocks, rows], boxes of kScaleBoxRows rows of one k-block (528 bytes), no swizzle; rows past
// the end read as zeros, as the codes' do.
inline CUresult encode_scales_2d(CUtensorMap* map, const void* base, uint64_t rows, uint64_t k_blocks) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult qr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &qr) != cudaSuccess ||
        qr != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  const cuuint64_t dims[2] = {rows, k_blocks};
  const cuuint64_t strides[1] = {rows * 4};
  const cuuint32_t box[2] = {kScaleBoxRows, 1};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// ---- host: 2-D uint8 tensor maps of E4M3 codes (row-major [rows, cols]) --------------------------
// Boxes of box_rows x box_cols bytes, 128-byte swizzle for 128-byte box rows, else 64-byte (the MX
// tiles' A: 64-byte rows). hopper_gemm.cuh's encode_map_2d is bf16 only.
inline CUresult encode_codes_2d(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols, uint32_t box_cols,
                                uint32_t box_rows) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult qr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &qr) != cudaSuccess ||
        qr != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, box_cols == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

}  // namespace sm90
}  // namespace mokgen
