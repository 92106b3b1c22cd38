// The bf16-math GEMM with B taken raw (v0.67, MOKGEN_MX_DGRAD_WEIGHTS=raw): the MXFP8 backward's
// dgrads read the weights as the layer holds them (bf16) and quantize them to MX values along k in
// shared memory, so the transposed copy of each weight (mokgen.mx_gemm.expert_weights with
// transpose: 2.9 ms of kimi-k2.5 local's MXFP8 step on an H100, memory-bound) is never written.
//
// C = A B^T per row tile (expert e, first row m0), as bf16m::gemm_kernel's grouped form, with
//  - A: MXFP8 codes [M, K] and blocked scales [K / 128, M, 4] (unchanged), decoded into the wgmma's
//    register fragments in natural k order: a thread's slots 2q, 2q + 1 and 2q + 8, 2q + 9 are two
//    16-bit loads of its row's codes (gemm_kernel's B is permuted within each 16 so that one 32-bit
//    load serves; here B is not permuted, so A follows it);
//  - B: the weights as stored, part 0 [E, k0, N] then part 1 [E, K - k0, N] stacked along k (the
//    down projection's W_down [E, H, I] alone; gate | up's W_gate, W_up [E, I, H]), n contiguous:
//    MN-major, four TMA boxes of 64 n x 64 k rows a stage (SWIZZLE_128B), read by the wgmma through
//    an MN-major descriptor.
// Each stage's B is quantized in place by the two consumer warpgroups before either issues its
// wgmma on it (named barrier 4): warp 4 c + w takes box (4 c + w) % 4 and k rows 32 ((4 c + w) / 4)
// .. + 31, i.e. 32 word columns (two n each) of one 32-block along k, as the weights' transposed
// quantizer (mx_rows.cuh weight_cols2_kernel) blocks them, in four passes of eight columns, four
// lanes to a column (quantize_quarter: eight words a thread). Stage s + 1 is quantized and its four
// wgmmas are queued behind stage s's while those run (A's fragments double-buffered), so the tensor
// core has work while the consumers quantize.
//
// The values: E4M3 value times 2^scale as bf16, the bits of the transposed conversion's values
// (mx_rows.cuh store_decoded_pairs; the GPU tests compare them bit for bit). Hopper's conversion
// instructions are slow (F2FP), so the common case is bf16x2 arithmetic and bit masks (mx_round.cuh round_block
// below); blocks with a scale near either end of E8M0's range, and non-finite blocks, take the
// conversion kernel's own float arithmetic (exact_half), per warp (all lanes take one path).
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include <cutlass/arch/reg_reconfig.h>

#include <cstdint>
#include <utility>

#include "bulk_copy.cuh"
#include "desc_mn.cuh"
#include "hopper_gemm.cuh"
#include "mx.cuh"
#include "mx_decode.cuh"
#include "mx_gemm.cuh"
#include "mx_round.cuh"
#include "mx_rows.cuh"

namespace mokgen {
namespace mxg {
namespace rawb {

// bf16m's geometry, stage layout, pipe and epilogues, by name (mxg has its own kBK, kStages, ...)
using bf16m::band_order;
using bf16m::EpiArgs;
using bf16m::finish_tile;
using bf16m::init_pipe;
using bf16m::kABytes;
using bf16m::kAcc;
using bf16m::kBBytes;
using bf16m::kBK;
using bf16m::kBN;
using bf16m::kEpiCombine1;
using bf16m::kEpiStore;
using bf16m::kScaleBytes;
using bf16m::kSmemBytes;
using bf16m::kStages;
using bf16m::kStageStride;
using bf16m::kThreads;

constexpr int kBox = 64 * 64 * 2;  // one TMA box of B: 64 k rows of 128 bytes (64 n)
static_assert(4 * kBox == kBBytes, "B's four boxes fill gemm_kernel's B part of a stage");
constexpr int kQuantBarrier = 4;   // named barrier: the stage's B quantized (bf16m uses 1, 2 and 3)

// MN-major B with the 128-byte swizzle, four boxes of 64 n x 64 k rows (desc_mn.cuh).
__device__ __forceinline__ uint64_t desc_b(const void* smem) { return sm90::smem_desc_mn<kBox>(smem); }

using Wgmma = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K,
                                                             cute::SM90::GMMA::Major::MN>;

template <size_t... Is>
__device__ __forceinline__ void wgmma(const uint32_t (&a)[4], uint64_t db, float (&d)[kAcc], bool accumulate,
                                      std::index_sequence<Is...>) {
  Wgmma::fma(a[0], a[1], a[2], a[3], db, d[Is]...,
             accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

__device__ __forceinline__ void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t lds16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
  return v;
}

// A quarter of a 32-block: box `box`, k rows 32 kh .. + 31 of word column wc (n 2 wc, 2 wc + 1 of
// the box), of which this thread holds rows 8 p .. 8 p + 7 (p = lane / 8) and lanes lane ^ 8,
// lane ^ 16, lane ^ 24 the rest (the block's amax by two shuffles). Row i of the quarter is
// 8 p + (i + 2 p) % 8, so the four lane groups' rows lie 2 apart in the swizzle phase and their
// words (two 16-byte chunks a group) fall in distinct banks. Eight words a thread: the
// consumers' 128 accumulators and two stages' A fragments leave room for no more.
__device__ __forceinline__ void quantize_quarter(const unsigned char* sb, int box, int kh, int wc, int p) {
  const uint32_t base = smem_u32(sb) + box * kBox + (wc & 3) * 4;
  const int chunk = wc >> 2;
  uint32_t v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = 32 * kh + 8 * p + ((i + 2 * p) & 7);
    v[i] = mxd::lds32(base + row * 128 + ((chunk ^ (row & 7)) << 4));
  }
  uint32_t amax = v[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) amax = absmax_bf16x2(amax, v[i]);
  amax &= 0x7fff7fffu;
  amax = max_u16x2(amax, __shfl_xor_sync(0xffffffffu, amax, 8));
  amax = max_u16x2(amax, __shfl_xor_sync(0xffffffffu, amax, 16));
  const uint32_t ea_lo = (amax >> 7) & 0xffu, ea_hi = amax >> 23;
  if (__all_sync(0xffffffffu, fast_field(ea_lo) && fast_field(ea_hi))) {  // warp-uniform
    round_block(v, ea_lo, ea_hi);
  } else {
    exact_half<false>(v, amax & 0xffffu);
    exact_half<true>(v, amax >> 16);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = 32 * kh + 8 * p + ((i + 2 * p) & 7);
    sts32(base + row * 128 + ((chunk ^ (row & 7)) << 4), v[i]);
  }
}

// The stage's B quantized by both consumer warpgroups (all 256 threads call it), made visible to
// the wgmma (the async proxy) and waited for by both.
__device__ __forceinline__ void quantize_stage(const unsigned char* st, int c_wg, int w, int lane) {
  const int task = 4 * c_wg + w;
#pragma unroll
  for (int pass = 0; pass < 4; ++pass) quantize_quarter(st, task & 3, task >> 2, 8 * pass + (lane & 7), lane >> 3);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("bar.sync %0, 256;" ::"n"(kQuantBarrier) : "memory");
}

// The producer's k-block kb of tile (e, m0, n0) into stage it % kStages: B's 64 k rows from part 0
// (k < k0, rows e k0 + k of map_b0) or part 1 (rows e k1 + k - k0 of map_b1), four boxes of 64 n,
// then A's codes and their scale words as gemm_kernel's producer loads them.
__device__ __forceinline__ void produce_kblock(const CUtensorMap* map_a, const CUtensorMap* map_b0,
                                               const CUtensorMap* map_b1, const uint8_t* __restrict__ sa,
                                               unsigned char* stages, uint64_t* full, uint64_t* empty, int it, int kb,
                                               int m0, int n0, int e, int k0, int k1, int M) {
  const int s = it % kStages;
  sm90::mbar_wait(&empty[s], ((it / kStages) & 1u) ^ 1u);
  unsigned char* st = stages + size_t(s) * kStageStride;
  sm90::mbar_arrive_expect_tx(&full[s], kBBytes + kABytes + kScaleBytes);
  const int k = kb * kBK;
  const bool first = k < k0;
  const CUtensorMap* mb = first ? map_b0 : map_b1;
  const int row = first ? e * k0 + k : e * k1 + (k - k0);
#pragma unroll
  for (int j = 0; j < 4; ++j) cute::SM90_TMA_LOAD_2D::copy(mb, &full[s], 0, st + j * kBox, n0 + 64 * j, row);
  cute::SM90_TMA_LOAD_2D::copy(map_a, &full[s], 0, st + kBBytes, k, m0);
  bulk::load(st + kBBytes + kABytes, sa + (size_t(kb / 2) * M + m0) * 4, kScaleBytes, &full[s]);
}

// A's k16 step of rows r0 and r0 + 8 decoded into f in natural k order (slots 2q, 2q + 1 from
// bytes 2q, 2q + 1 of the row's 16-code chunk; slots 2q + 8, 2q + 9 from bytes 2q + 8, 2q + 9).
__device__ __forceinline__ void decode_a(uint32_t at, int r0, int q, int k16, uint32_t wa0, uint32_t wa1, int blk,
                                         uint32_t (&f)[4]) {
  uint32_t m1a, m2a, m1b, m2b;
  mxd::multipliers((wa0 >> (8 * blk)) & 0xffu, m1a, m2a);
  mxd::multipliers((wa1 >> (8 * blk)) & 0xffu, m1b, m2b);
  // 64-byte rows, SWIZZLE_64B: chunk c of row r at c ^ (r / 2 % 4)
  const uint32_t p0 = at + r0 * 64 + ((k16 ^ ((r0 >> 1) & 3)) << 4) + 2 * q;
  const uint32_t p1 = at + (r0 + 8) * 64 + ((k16 ^ (((r0 + 8) >> 1) & 3)) << 4) + 2 * q;
  f[0] = mxd::decode2(lds16(p0), m1a, m2a);
  f[1] = mxd::decode2(lds16(p1), m1b, m2b);
  f[2] = mxd::decode2(lds16(p0 + 8), m1a, m2a);
  f[3] = mxd::decode2(lds16(p1 + 8), m1b, m2b);
}

// A stage's four wgmmas (A decoded into a first), committed as one batch.
__device__ __forceinline__ void issue_stage(const unsigned char* st, int kb, int r0, int q, float (&acc)[kAcc],
                                            uint32_t (&a)[4][4]) {
  const uint32_t* sc = reinterpret_cast<const uint32_t*>(st + kBBytes + kABytes);
  const uint32_t wa0 = sc[r0], wa1 = sc[r0 + 8];
  const uint32_t at = smem_u32(st + kBBytes);
#pragma unroll
  for (int k16 = 0; k16 < 4; ++k16) {
    decode_a(at, r0, q, k16, wa0, wa1, 2 * (kb & 1) + k16 / 2, a[k16]);
    mxd::fence_a(a[k16]);
  }
  cute::warpgroup_arrive();
#pragma unroll
  for (int k16 = 0; k16 < 4; ++k16)
    wgmma(a[k16], desc_b(st + k16 * 2048), acc, kb > 0 || k16 > 0, std::make_index_sequence<kAcc>{});
  cute::warpgroup_commit_batch();
}

// One k-block kb of consume_tile (kb's four wgmmas in flight, A in cur): stage kb + 1's B quantized
// and its four queued behind them (A in next), then kb's retired (wait 1) and its stage released;
// the last k-block waits for all.
__device__ __forceinline__ void consume_step(unsigned char* stages, uint64_t* full, uint64_t* empty, int n_k, int kb,
                                             int c_wg, int w, int lane, int r0, int q, int t, float (&acc)[kAcc],
                                             uint32_t (&cur)[4][4], uint32_t (&next)[4][4]) {
  if (kb + 1 < n_k) {
    const int s1 = (kb + 1) % kStages;
    const unsigned char* st1 = stages + size_t(s1) * kStageStride;
    sm90::mbar_wait(&full[s1], ((kb + 1) / kStages) & 1u);
    quantize_stage(st1, c_wg, w, lane);
    issue_stage(st1, kb + 1, r0, q, acc, next);
    cute::warpgroup_wait<1>();
  } else {
    cute::warpgroup_wait<0>();
  }
#pragma unroll
  for (int k16 = 0; k16 < 4; ++k16) mxd::fence_a(cur[k16]);
  if (t == 0) sm90::mbar_arrive(&empty[kb % kStages]);
}

// raw_gemm_kernel's consumer warpgroups: stage 0 quantized and issued, consume_step per k-block
// (even k-blocks' A in a0, odd ones' in a1: static registers), then finish_tile's epilogue.
// (ptxas notes C7517, a wait it adds where the epilogue first reads acc: every path has retired
// all wgmmas there already.)
template <int kEpi>
__device__ __forceinline__ void consume_tile(unsigned char* stages, uint64_t* full, uint64_t* empty,
                                             float* __restrict__ c, int M, int N, int n_k, int m0, int n0, int t,
                                             int wg, int out_bf16, const EpiArgs& epi) {
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int c_wg = wg - 1, w = t >> 5, lane = t & 31, q = lane & 3, g = lane >> 2;
  const int r0 = 64 * c_wg + 16 * w + g;
  float acc[kAcc];
  uint32_t a0[4][4], a1[4][4];
  if (n_k == 0) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
  } else {
    sm90::mbar_wait(&full[0], 0);
    quantize_stage(stages, c_wg, w, lane);
    sm90::fence_operands(acc);
    issue_stage(stages, 0, r0, q, acc, a0);
  }
  for (int kb = 0; kb < n_k; kb += 2) {
    consume_step(stages, full, empty, n_k, kb, c_wg, w, lane, r0, q, t, acc, a0, a1);
    if (kb + 1 < n_k) consume_step(stages, full, empty, n_k, kb + 1, c_wg, w, lane, r0, q, t, acc, a1, a0);
  }
  sm90::fence_operands(acc);
  finish_tile<kEpi>(acc, stages, c, M, N, m0, n0, size_t(0), size_t(N), c_wg, w, lane, q, g, r0, out_bf16, epi);
}

// Grouped only: row tile blockIdx.y (after the band order, as gemm_kernel) = tiles[.] = (expert e,
// first row m0), (-1, 0) skipped; column tile blockIdx.x of 256. B: part 0 [E, k0, N] (map_b0,
// rows E k0 of N), part 1 [E, K - k0, N] (map_b1; the same map as map_b0 when k0 = K). kEpi:
// kEpiStore (C [M, N] float32, or bf16 when out_bf16) or kEpiCombine1.
template <int kEpi>
__global__ void __launch_bounds__(kThreads, 1)
    raw_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b0,
                    const __grid_constant__ CUtensorMap map_b1, const uint8_t* __restrict__ sa,
                    float* __restrict__ c, int M, int N, int K, int k0, const int2* __restrict__ tiles, int out_bf16,
                    EpiArgs epi, int band) {
  static_assert(kEpi == kEpiStore || kEpi == kEpiCombine1, "the dgrads' epilogues");
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, t = tid & 127;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  int bx = int(blockIdx.x), by = int(blockIdx.y);
  band_order(bx, by, band);
  const int2 tile = tiles[by];
  if (tile.x < 0) return;
  const int m0 = tile.y, n0 = bx * kBN, n_k = K / kBK;
  uint64_t *full, *empty;
  unsigned char* stages;
  init_pipe(smem, full, empty, stages);
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (t == 0) {
      for (int kb = 0; kb < n_k; ++kb)
        produce_kblock(&map_a, &map_b0, &map_b1, sa, stages, full, empty, kb, kb, m0, n0, tile.x, k0, K - k0, M);
    }
    return;
  }
  consume_tile<kEpi>(stages, full, empty, c, M, N, n_k, m0, n0, t, wg, out_bf16, epi);
}

}  // namespace rawb
}  // namespace mxg
}  // namespace mokgen
