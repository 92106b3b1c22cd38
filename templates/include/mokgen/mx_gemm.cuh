// The MXFP8 GEMM's device side (issue 6; templates/mx_gemm.cu holds its launchers and C ABI):
// C = A B^T with A [M, K] and B [N, K] as E4M3 codes plus one E8M0 scale per 32 consecutive k
// (OCP MX), C [M, N] float32, dense or grouped over a tile list of (expert, first row). Why each
// step is its own wgmma, how it is promoted and what that costs: templates/mx_gemm.cu's header
// and docs/architecture.md (MXFP8).
#pragma once

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include <cutlass/arch/reg_reconfig.h>

#include <cstdint>
#include <utility>

#include "bulk_copy.cuh"
#include "hopper_gemm.cuh"
#include "mx.cuh"
#include "mx_decode.cuh"

namespace mokgen {
namespace mxg {

constexpr int kBM = 128, kBN = 128, kBK = 128;  // kBK in codes (bytes) = four k32 steps
constexpr int kSteps = kBK / 32;
constexpr int kStages = 4;
constexpr int kBoxBytes = 64 * kBK;                // one 64-row box of codes
constexpr int kCodeBytes = 4 * kBoxBytes;          // A: two boxes, B: two boxes (32 KB)
constexpr int kScaleBytes = (kBM + kBN) * 4;       // the k-block's four k32 scales per row and column
constexpr int kFloatBytes = (kBM + kBN) * kSteps * 4;  // the same as float32 (form kDecoded)
constexpr int kAcc = kBN / 2;                      // float32 accumulators per consumer thread
static_assert(kScaleBytes <= 1024 && kFloatBytes % 1024 == 0, "stages stay 1024-aligned");

// The two forms (one kernel template; `mokgen_mx_gemm_form` picks one, for measuring):
//  kInline:  each consumer thread decodes its rows' and columns' E8M0 bytes itself, 34 scales a
//            k32 step (v0.33's second form);
//  kDecoded: the producer warpgroup's other three warps decode the k-block's scales into float32
//            in the stage (rows as a float4 of the four steps, columns per step in the order the
//            accumulator fragment reads them, so a consumer thread's 32 column scales of a step
//            are eight 16-byte loads) and signal `ready`; the consumers' issue slots then go to
//            the promotion's two float32 operations per element alone.
//  kQuad:    kDecoded's producer with four consumer warpgroups of 64 x 64 each (two per row half),
//            so each scheduler has four consumer warps to pick from where kDecoded has two (ncu
//            on kDecoded: 0.88 warps eligible a cycle, the wgmma wait and the promotion in series
//            per warp). Registers: 640 threads launch at 96 each, the producer gives back 56, the
//            consumers take 104.
enum Form { kInline = 0, kDecoded = 1, kQuad = 2 };

template <int kForm>
struct Geometry {
  static constexpr int kStageStride = kCodeBytes + 1024 + (kForm != kInline ? kFloatBytes : 0);
  static constexpr size_t kSmemBytes = size_t(kStages) * kStageStride + 3 * kStages * 8 + 1024;
  static constexpr int kConsumers = kForm == kQuad ? 4 : 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kConsumerRegs = kForm == kQuad ? 104 : 232;
};

using Wgmma = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
using WgmmaQuad = cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_SS_TN<>;
constexpr int kAccQuad = 32;  // float32 accumulators per consumer thread in form kQuad (64 x 64)

template <size_t... Is>
__device__ __forceinline__ void wgmma_quad(uint64_t da, uint64_t db, float (&d)[kAccQuad], std::index_sequence<Is...>) {
  WgmmaQuad::fma(da, db, d[Is]..., cute::SM90::GMMA::ScaleOut::Zero);
}

template <size_t... Is>
__device__ __forceinline__ void wgmma_k32(uint64_t da, uint64_t db, float (&d)[kAcc], std::index_sequence<Is...>,
                                          cute::SM90::GMMA::ScaleOut out = cute::SM90::GMMA::ScaleOut::Zero) {
  Wgmma::fma(da, db, d[Is]..., out);
}

// One 32-wide step of the 64 x 128 forms (consumer warpgroup c_wg's rows) into tmp, scale-d 0,
// waited for: the promotion reads tmp next (read while a wgmma is in flight, ptxas serializes
// every wgmma, C7514).
__device__ __forceinline__ void step_k32(const unsigned char* st, int c_wg, int k32, float (&tmp)[kAcc]) {
  sm90::fence_operands(tmp);
  cute::warpgroup_arrive();
  wgmma_k32(sm90::smem_desc_k<128>(st + c_wg * kBoxBytes + k32 * 32),
            sm90::smem_desc_k<128>(st + 2 * kBoxBytes + k32 * 32), tmp, std::make_index_sequence<kAcc>{});
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
  sm90::fence_operands(tmp);
}

// Timing-only builds (wrong results; .ci/mx_gemm_probe.py --variant): MOKGEN_MX_PROBE in form
// kDecoded, 1: the promotion as acc += tmp (no scales); 2: one promotion per k-block, the four
// steps accumulated in the tensor core (DeepSeek-style 128-wide blocks); 3: no promotion, every
// step accumulated into acc and one wait per k-block (the tile's pipeline without MX); 4: the real
// kernel with consumer warpgroup 1 started about 1 us late (do the warpgroups run in lockstep?).
#ifndef MOKGEN_MX_PROBE
#define MOKGEN_MX_PROBE 0
#endif

// 2^(e - 127) for an E8M0 code e as a float32: e >= 1 a normal number, 0 the subnormal 2^-127,
// 255 NaN (MX: the block's values are NaN). Integer only: e << 23 is the number's bits for e in
// 1..254, and the mantissa's top bit makes 0 into 2^-127 and 255 into a NaN. (Written with
// selects on floats, it compiled to a branch per scale: 135 BSSY/BSYNC a k-block, v0.33.)
__device__ __forceinline__ float scale(uint32_t e) {
  return __uint_as_float((e << 23) | (uint32_t(((e + 1u) & 0xfeu) == 0u) << 22));
}

__device__ __forceinline__ float lane4(const float4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Column c = 8 i + 2 q + j of a tile (i < 16 the accumulator fragment's column group, q = lane & 3,
// j < 2) at float ((i / 2) * 4 + q) * 4 + (i % 2) * 2 + j of its step's 128: thread q's columns of
// fragments 2 m and 2 m + 1 are one float4 (m < 8), and a warp's four q read 64 contiguous bytes.
__device__ __forceinline__ int col_slot(int c) {
  const int i = c >> 3, q = (c >> 1) & 3, j = c & 1;
  return (((i >> 1) * 4 + q) * 4) + (i & 1) * 2 + j;
}

// Threads: a producer warpgroup (thread 0 issues the loads, warps 1-3 decode the scales in form
// kDecoded; setmaxnreg 40) and two consumer warpgroups (setmaxnreg 232). The scales come in the
// kernel's blocked layout, [K / 128, rows, 4] (mokgen.mx_gemm.block_scales): a k-block's scales of
// the tile's 128 rows are 512 contiguous bytes, which one bulk copy per operand puts into the
// stage beside the codes.
constexpr int kDecoders = 96;

template <int kForm>
__global__ void __launch_bounds__(Geometry<kForm>::kThreads, 1)
    mx_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                   const uint8_t* __restrict__ sa, const uint8_t* __restrict__ sb, float* __restrict__ c, int M,
                   int N, int K, const int2* __restrict__ tiles) {
  constexpr int kStageStride = Geometry<kForm>::kStageStride;
  extern __shared__ __align__(1024) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kStages;
  uint64_t* ready = empty + kStages;  // form kDecoded: the stage's float scales written
  // offset from smem itself (not through an integer), so the compiler keeps shared-memory loads
  const uint32_t base = smem_u32(smem);
  unsigned char* stages = smem + (((base + 3 * kStages * 8 + 1023) & ~1023u) - base);
  const int tid = threadIdx.x, t = tid & 127;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform (ptxas: no divergent WG.AR)
  // the row tile: blockIdx.y's entry of `tiles` (expert e, first row m0) in a grouped launch, else
  // (0, 128 blockIdx.y); B's rows and scales are expert e's: rows e N .. of the [E N, K] codes,
  // scales from e's [K / 128, N, 4] block
  const int2 tile = tiles != nullptr ? tiles[blockIdx.y] : make_int2(0, int(blockIdx.y) * kBM);
  const int e = tile.x, m0 = tile.y, n0 = blockIdx.x * kBN, n_k = K / kBK;
  if (e < 0) return;  // a tile past the segments of a fixed-length list (mx_experts._segments)
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) {
      sm90::mbar_init(&full[i], 1);
      sm90::mbar_init(&empty[i], Geometry<kForm>::kConsumers);  // one arrival per consumer warpgroup
      sm90::mbar_init(&ready[i], kDecoders);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (t == 0) {
      for (int kb = 0; kb < n_k; ++kb) {
        const int s = kb % kStages;
        sm90::mbar_wait(&empty[s], ((kb / kStages) & 1u) ^ 1u);
        unsigned char* st = stages + size_t(s) * kStageStride;
        sm90::mbar_arrive_expect_tx(&full[s], kCodeBytes + kScaleBytes);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          cute::SM90_TMA_LOAD_2D::copy(&map_a, &full[s], 0, st + h * kBoxBytes, kb * kBK, m0 + 64 * h);
          cute::SM90_TMA_LOAD_2D::copy(&map_b, &full[s], 0, st + (2 + h) * kBoxBytes, kb * kBK, e * N + n0 + 64 * h);
        }
        bulk::load(st + kCodeBytes, sa + (size_t(kb) * M + m0) * 4, kBM * 4, &full[s]);
        bulk::load(st + kCodeBytes + kBM * 4, sb + ((size_t(e) * n_k + kb) * N + n0) * 4, kBN * 4, &full[s]);
      }
    } else if (kForm != kInline && t >= 32) {
      const int d = t - 32;
      for (int kb = 0; kb < n_k; ++kb) {
        const int s = kb % kStages;
        sm90::mbar_wait(&full[s], (kb / kStages) & 1u);
        unsigned char* st = stages + size_t(s) * kStageStride;
        const uint32_t* raw = reinterpret_cast<const uint32_t*>(st + kCodeBytes);  // rows, then columns
        float4* rows_f = reinterpret_cast<float4*>(st + kCodeBytes + 1024);      // [kBM] x four steps
        float* cols_f = reinterpret_cast<float*>(rows_f + kBM);                  // [kSteps][kBN], col_slot order
        for (int i = d; i < kBM + kBN; i += kDecoders) {
          const uint32_t w = raw[i];
          if (i < kBM) {
            rows_f[i] = make_float4(scale(w & 0xffu), scale((w >> 8) & 0xffu), scale((w >> 16) & 0xffu), scale(w >> 24));
          } else {
            const int slot = col_slot(i - kBM);
#pragma unroll
            for (int k32 = 0; k32 < kSteps; ++k32) cols_f[k32 * kBN + slot] = scale((w >> (8 * k32)) & 0xffu);
          }
        }
        sm90::mbar_arrive(&ready[s]);  // release: the floats above, before the consumers' acquire
      }
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Geometry<kForm>::kConsumerRegs>();
  if constexpr (kForm == kQuad) {
    // consumer cw: rows 64 (cw & 1) .., columns 64 (cw >> 1) .. of the tile
    const int cw = wg - 1, rh = cw & 1, ch = cw >> 1, w = t >> 5, lane = t & 31, q = lane & 3;
    const int rl = 64 * rh + 16 * w + (lane >> 2);
    float acc[kAccQuad], tmp[kAccQuad];
#pragma unroll
    for (int i = 0; i < kAccQuad; ++i) acc[i] = 0.f;
    for (int kb = 0; kb < n_k; ++kb) {
      const int s = kb % kStages;
      sm90::mbar_wait(&full[s], (kb / kStages) & 1u);
      sm90::mbar_wait(&ready[s], (kb / kStages) & 1u);
      const unsigned char* st = stages + size_t(s) * kStageStride;
      const float4* rows_f = reinterpret_cast<const float4*>(st + kCodeBytes + 1024);
      const float4* cols_f = reinterpret_cast<const float4*>(rows_f + kBM) + 4 * (4 * ch) + q;
      const float* ra0 = reinterpret_cast<const float*>(rows_f + rl);
      const float* ra1 = reinterpret_cast<const float*>(rows_f + rl + 8);
#pragma unroll
      for (int k32 = 0; k32 < kSteps; ++k32) {
        sm90::fence_operands(tmp);
        cute::warpgroup_arrive();
        wgmma_quad(sm90::smem_desc_k<128>(st + rh * kBoxBytes + k32 * 32),
                   sm90::smem_desc_k<128>(st + (2 + ch) * kBoxBytes + k32 * 32), tmp,
                   std::make_index_sequence<kAccQuad>{});
        cute::warpgroup_commit_batch();
        const float fa0 = ra0[k32], fa1 = ra1[k32];
        cute::warpgroup_wait<0>();
        sm90::fence_operands(tmp);
#pragma unroll
        for (int mm = 0; mm < 4; ++mm) {  // fragments 2 mm and 2 mm + 1: their columns' scales in one float4
          const float4 cb = cols_f[k32 * (kBN / 4) + 4 * mm];
          const float fb[4] = {cb.x, cb.y, cb.z, cb.w};
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int i = 2 * mm + h;
              acc[4 * i + j] = fmaf(tmp[4 * i + j], fa0 * fb[2 * h + j], acc[4 * i + j]);
              acc[4 * i + 2 + j] = fmaf(tmp[4 * i + 2 + j], fa1 * fb[2 * h + j], acc[4 * i + 2 + j]);
            }
        }
      }
      if (t == 0) sm90::mbar_arrive(&empty[s]);
    }
    const int r0 = m0 + rl;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int col = n0 + 64 * ch + 8 * i + 2 * q;
      *reinterpret_cast<float2*>(c + size_t(r0) * N + col) = make_float2(acc[4 * i], acc[4 * i + 1]);
      *reinterpret_cast<float2*>(c + size_t(r0 + 8) * N + col) = make_float2(acc[4 * i + 2], acc[4 * i + 3]);
    }
    return;
  }
  const int c_wg = wg - 1, w = t >> 5, lane = t & 31, q = lane & 3;
  const int rl = 64 * c_wg + 16 * w + (lane >> 2);  // this thread's first row in the tile (the other: + 8)
  float acc[kAcc], tmp[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
#if MOKGEN_MX_PROBE == 4
  if (c_wg == 1) __nanosleep(1000);
#endif
  for (int kb = 0; kb < n_k; ++kb) {
    const int s = kb % kStages;
    sm90::mbar_wait(&full[s], (kb / kStages) & 1u);
    if (kForm == kDecoded) sm90::mbar_wait(&ready[s], (kb / kStages) & 1u);
    const unsigned char* st = stages + size_t(s) * kStageStride;
    if (kForm == kDecoded) {
      const float4* rows_f = reinterpret_cast<const float4*>(st + kCodeBytes + 1024);
      const float4* cols_f = reinterpret_cast<const float4*>(rows_f + kBM);
      const float* ra0 = reinterpret_cast<const float*>(rows_f + rl);  // rows rl and rl + 8, per step
      const float* ra1 = reinterpret_cast<const float*>(rows_f + rl + 8);
#if MOKGEN_MX_PROBE == 2 || MOKGEN_MX_PROBE == 3
      {
        float(&d)[kAcc] = MOKGEN_MX_PROBE == 3 ? acc : tmp;
        sm90::fence_operands(d);
        cute::warpgroup_arrive();
#pragma unroll
        for (int k32 = 0; k32 < kSteps; ++k32)
          wgmma_k32(sm90::smem_desc_k<128>(st + c_wg * kBoxBytes + k32 * 32),
                    sm90::smem_desc_k<128>(st + 2 * kBoxBytes + k32 * 32), d, std::make_index_sequence<kAcc>{},
                    MOKGEN_MX_PROBE == 3 || k32 ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<0>();
        sm90::fence_operands(d);
      }
#endif
#pragma unroll
      for (int k32 = 0; k32 < (MOKGEN_MX_PROBE == 3 ? 0 : MOKGEN_MX_PROBE == 2 ? 1 : kSteps); ++k32) {
#if MOKGEN_MX_PROBE != 2
        step_k32(st, c_wg, k32, tmp);
#endif
#if MOKGEN_MX_PROBE == 1
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc[i] += tmp[i];
        continue;
#endif
        // the scales after the wait: computing the 64 products fa * fb between the wgmma's issue
        // and its wait was 7% slower (v0.34, call 5)
        const float fa0 = ra0[k32], fa1 = ra1[k32];
        float4 cb[8];  // columns 8 (2 m + h) + 2 q + j at cb[m].{x, y} (h 0) and .{z, w} (h 1)
#pragma unroll
        for (int m = 0; m < 8; ++m) cb[m] = cols_f[k32 * (kBN / 4) + 4 * m + q];
#pragma unroll
        for (int i = 0; i < 16; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float fb = lane4(cb[i >> 1], (i & 1) * 2 + j);
            acc[4 * i + j] = fmaf(tmp[4 * i + j], fa0 * fb, acc[4 * i + j]);
            acc[4 * i + 2 + j] = fmaf(tmp[4 * i + 2 + j], fa1 * fb, acc[4 * i + 2 + j]);
          }
      }
    } else {
      const uint32_t* sc_a = reinterpret_cast<const uint32_t*>(st + kCodeBytes);
      const uint2* sc_b = reinterpret_cast<const uint2*>(st + kCodeBytes + kBM * 4);
      // the k-block's scales: one word per row and column (its four k32 scales); columns 8 i + 2 q
      // and + 1 side by side
      const uint32_t wa0 = sc_a[rl], wa1 = sc_a[rl + 8];
      uint2 wb[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) wb[i] = sc_b[4 * i + q];
#pragma unroll
      for (int k32 = 0; k32 < kSteps; ++k32) {
        step_k32(st, c_wg, k32, tmp);
        const float fa0 = scale((wa0 >> (8 * k32)) & 0xffu), fa1 = scale((wa1 >> (8 * k32)) & 0xffu);
#pragma unroll
        for (int i = 0; i < 16; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float fb = scale(((j ? wb[i].y : wb[i].x) >> (8 * k32)) & 0xffu);
            acc[4 * i + j] = fmaf(tmp[4 * i + j], fa0 * fb, acc[4 * i + j]);
            acc[4 * i + 2 + j] = fmaf(tmp[4 * i + 2 + j], fa1 * fb, acc[4 * i + 2 + j]);
          }
      }
    }
    if (t == 0) sm90::mbar_arrive(&empty[s]);  // the stage's reads retired (wait<0> above; scales read)
  }
  // acc[4 i + {0, 1}]: row r0, columns n0 + 8 i + 2 q + {0, 1}; acc[4 i + {2, 3}]: row r0 + 8
  const int r0 = m0 + rl;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int col = n0 + 8 * i + 2 * q;
    *reinterpret_cast<float2*>(c + size_t(r0) * N + col) = make_float2(acc[4 * i], acc[4 * i + 1]);
    *reinterpret_cast<float2*>(c + size_t(r0 + 8) * N + col) = make_float2(acc[4 * i + 2], acc[4 * i + 3]);
  }
}


// ==== Form "bf16 math" (v0.35: 653 TFLOP/s dense against quad's 382, docs/perf-notes.md) ========
// The same C = A B^T with A MXFP8, on the BF16 tensor core: each consumer decodes its rows' E4M3
// codes, times their block's power of two, into the wgmma's register A fragments (exact: an E4M3
// value times 2^(s - 127) is a BF16 value unless s is near 0 or 254), and B is BF16 in shared
// memory: an MXFP8 weight decoded once (exact too), its k order permuted within each 16 so that a
// thread's four consecutive codes fill its fragment's k slots 2q, 2q + 1, 2q + 8, 2q + 9 (the
// permutation pairs the same A and B elements, so the sum is unchanged). No promotion: the sums
// stay in the tensor core's float32 accumulators, wgmma k16 steps kept in flight.
namespace bf16m {

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 5;
constexpr int kABytes = kBM * kBK;                  // FP8 codes, 64-byte rows, SWIZZLE_64B
constexpr int kBBytes = kBN * kBK * 2;              // bf16, 128-byte rows, SWIZZLE_128B
constexpr int kScaleBytes = kBM * 4;                // the k128 block's four scales per row
constexpr int kStageStride = ((kBBytes + kABytes + kScaleBytes) + 1023) / 1024 * 1024;
constexpr size_t kSmemBytes = size_t(kStages) * kStageStride + 2 * kStages * 8 + 1024;
constexpr int kAcc = kBN / 2;                       // m64n256: 128 float32 per consumer thread
constexpr int kThreads = 384;

template <size_t... Is>
__device__ __forceinline__ void wgmma(const uint32_t (&a)[4], uint64_t db, float (&d)[kAcc], bool accumulate,
                                      std::index_sequence<Is...> seq) {
  mxd::wgmma_rs<kBN>(a, db, d, accumulate, seq);
}

using mxd::decode2;
using mxd::fence_a;
using mxd::multipliers;

// The fused up-projection epilogue (kEpi = kEpiSwiglu, kEpiSwigluClamp): B's rows interleaved in
// 128s (n-tile j = gate rows 128 j .. 128 j + 127, then the same up rows: expert_weights with
// interleave), so a thread holds gate and up of the same column (accumulators i and i + 16); it
// computes h = swiglu(gate, up) (common.cuh's, the megakernel's) and quantizes h to MXFP8 along I
// in place of storing C: a 32-block of a row lies with the four threads q = 0..3 of a quad (8
// values each), which agree on the block's amax by two shuffles. The codes go to h [M, I], the
// scales to [I / 128, M, 4]: the bits of mx_gemm.swiglu_quantize of the float32 gate | up.
//
// The fused combine of one pair per token (kEpi = kEpiCombine1; the local work's k = 1): the
// down projection's row r is token src[r]'s only pair (src < 0: padding), so the epilogue writes
// out[src[r]] = bf16(w[src[r]] * y) itself, the bits of mokgen_mx_combine at k = 1 (one product,
// rounded once), with no float32 y written.
struct EpiArgs {
  uint8_t* codes;       // swiglu: h codes [M, inter]
  uint8_t* scales;      // swiglu: h scales [inter / 128, M, 4]
  int inter;
  float limit;          // swiglu: > 0 clamps
  bf16* out;            // combine: [T, N]
  const int* src;       // combine: [M] the token of each row, -1 for padding
  const float* weight;  // combine: [T] the pair's routing weight
  int ldc;              // store: C's row stride in elements (0: N), C a column block of a wider matrix
};
constexpr int kEpiStore = 0, kEpiSwiglu = 1, kEpiSwigluClamp = 2, kEpiCombine1 = 3;

template <bool kHasClamp>
__device__ __forceinline__ void swiglu_quantize_epilogue(const float (&acc)[kAcc], const EpiArgs& out, int M,
                                                         int row, int n0, int q) {
  const int j0 = (n0 / kBN) * (kBN / 2);  // this tile's first column of h
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // rows row and row + 8
    const int r = row + 8 * half;
#pragma unroll
    for (int bb = 0; bb < 4; ++bb) {  // the tile's four 32-blocks of h
      float h[8];
      uint32_t amax = 0;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = 4 * bb + u;  // gate accumulators i, up i + 16
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float v = swiglu<kHasClamp>(acc[4 * i + 2 * half + e], acc[4 * (i + 16) + 2 * half + e], out.limit);
          h[2 * u + e] = v;
          const uint32_t a = mx::float_bits(v) & 0x7fffffffu;
          amax = a > amax ? a : amax;
        }
      }
      amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      // mx::quantize_block's scale and codes (non-finite: NaN scale and codes)
      const bool finite = amax < 0x7f800000u;
      const int exp_field = int(amax >> 23);
      int sc = exp_field == 0 ? -127 : exp_field - 127 - 8;
      sc = sc < -127 ? -127 : sc;
      const float inv = mx::bits_float(uint32_t(127 - sc) << 23);
      const int j = j0 + 32 * bb + 2 * q;  // this thread's first column of the block; then + 8 u
      uint8_t* dst = out.codes + size_t(r) * out.inter + j;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        uint16_t pair;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(h[2 * u + 1] * inv), "f"(h[2 * u] * inv));
        if (!finite) pair = uint16_t(mx::kE4M3Nan | (mx::kE4M3Nan << 8));
        *reinterpret_cast<uint16_t*>(dst + 8 * u) = pair;
      }
      if (q == 0) {
        const int b = j / 32;  // the block along I
        out.scales[(size_t(b >> 2) * M + r) * 4 + (b & 3)] = finite ? uint8_t(sc + 127) : mx::kE8M0Nan;
      }
    }
  }
}

// The producer's k-block: stage it % kStages (its phase from it / kStages) filled with B's k-block
// kb (B rows b0..), A's rows m0.. and their four-scale words.
__device__ __forceinline__ void produce_kblock(const CUtensorMap* map_a, const CUtensorMap* map_b,
                                               const uint8_t* __restrict__ sa, unsigned char* stages, uint64_t* full,
                                               uint64_t* empty, int it, int kb, int m0, int b0, int M) {
  const int s = it % kStages;
  sm90::mbar_wait(&empty[s], ((it / kStages) & 1u) ^ 1u);
  unsigned char* st = stages + size_t(s) * kStageStride;
  sm90::mbar_arrive_expect_tx(&full[s], kBBytes + kABytes + kScaleBytes);
  cute::SM90_TMA_LOAD_2D::copy(map_b, &full[s], 0, st, kb * kBK, b0);
  cute::SM90_TMA_LOAD_2D::copy(map_a, &full[s], 0, st + kBBytes, kb * kBK, m0);
  bulk::load(st + kBBytes + kABytes, sa + (size_t(kb / 2) * M + m0) * 4, kScaleBytes, &full[s]);
}

// A consumer's k-block (its tile's kb-th, from stage it % kStages): A decoded into register
// fragments, four wgmma k16 steps kept in flight one behind; the stage before (prev) released once
// its last wgmma retired. kb's parity picks the k64 half of the k128 scale word (k ranges start
// at multiples of 128).
__device__ __forceinline__ void consume_kblock(const unsigned char* stages, uint64_t* full, uint64_t* empty, int it,
                                               int kb, int r0, int q, int t, float (&acc)[kAcc], uint32_t (&a)[2][4],
                                               int& prev) {
  const int s = it % kStages;
  sm90::mbar_wait(&full[s], (it / kStages) & 1u);
  const unsigned char* st = stages + size_t(s) * kStageStride;
  const unsigned char* at = st + kBBytes;
  const uint32_t* sc = reinterpret_cast<const uint32_t*>(st + kBBytes + kABytes);
  const uint32_t wa0 = sc[r0], wa1 = sc[r0 + 8];
#pragma unroll
  for (int k16 = 0; k16 < kBK / 16; ++k16) {
    const int blk = 2 * (kb & 1) + k16 / 2;  // the 32-block of the k128 block's four
    uint32_t m1a, m2a, m1b, m2b;
    multipliers((wa0 >> (8 * blk)) & 0xffu, m1a, m2a);
    multipliers((wa1 >> (8 * blk)) & 0xffu, m1b, m2b);
    // the k16 chunk of rows r0 and r0 + 8 (64-byte rows, SWIZZLE_64B: chunk c at c ^ (r / 2 % 4))
    const uint32_t c0 = *reinterpret_cast<const uint32_t*>(at + r0 * 64 + ((k16 ^ ((r0 >> 1) & 3)) << 4) + 4 * q);
    const uint32_t c1 =
        *reinterpret_cast<const uint32_t*>(at + (r0 + 8) * 64 + ((k16 ^ (((r0 + 8) >> 1) & 3)) << 4) + 4 * q);
    uint32_t(&f)[4] = a[k16 & 1];
    f[0] = decode2(c0, m1a, m2a);        // row r0, k slots 2q, 2q + 1
    f[1] = decode2(c1, m1b, m2b);        // row r0 + 8
    f[2] = decode2(c0 >> 16, m1a, m2a);  // row r0, slots 2q + 8, 2q + 9
    f[3] = decode2(c1 >> 16, m1b, m2b);
    fence_a(f);
    sm90::fence_operands(acc);
    cute::warpgroup_arrive();
    wgmma(f, sm90::smem_desc_k<128>(st + k16 * 32), acc, kb > 0 || k16 > 0, std::make_index_sequence<kAcc>{});
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();  // the step before retired: its A registers are free again
    fence_a(f);
  }
  sm90::fence_operands(acc);
  if (prev >= 0 && t == 0) sm90::mbar_arrive(&empty[prev]);  // its last wgmma retired above
  prev = s;
}

// The store epilogue: C (float32, or bf16 when out_bf16) rows row and row + 8 of columns n0 ..
// n0 + 255, rows ldc elements apart, from element off of C (counted in C's own type: a k-ranged
// slice's offset, applied after the type is chosen).
__device__ __forceinline__ void store_tile(const float (&acc)[kAcc], float* c, size_t off, size_t ldc, int row, int n0,
                                           int q, int out_bf16) {
  if (out_bf16) {  // C as bf16 (rounded to nearest even, as PyTorch's .to(bfloat16))
    bf16* cb = reinterpret_cast<bf16*>(c) + off;
#pragma unroll
    for (int i = 0; i < kAcc / 4; ++i) {
      const int col = n0 + 8 * i + 2 * q;
      *reinterpret_cast<__nv_bfloat162*>(cb + size_t(row) * ldc + col) =
          __floats2bfloat162_rn(acc[4 * i], acc[4 * i + 1]);
      *reinterpret_cast<__nv_bfloat162*>(cb + size_t(row + 8) * ldc + col) =
          __floats2bfloat162_rn(acc[4 * i + 2], acc[4 * i + 3]);
    }
    return;
  }
  float* cf = c + off;
#pragma unroll
  for (int i = 0; i < kAcc / 4; ++i) {
    const int col = n0 + 8 * i + 2 * q;
    *reinterpret_cast<float2*>(cf + size_t(row) * ldc + col) = make_float2(acc[4 * i], acc[4 * i + 1]);
    *reinterpret_cast<float2*>(cf + size_t(row + 8) * ldc + col) = make_float2(acc[4 * i + 2], acc[4 * i + 3]);
  }
}

// The store epilogue through shared memory (v0.42; gemm_kernel's kEpiStore): a consumer warpgroup
// writes its 64 x 256 rows of C into buf (this warpgroup's part of the spent stages, rows padded
// by 16 bytes so the fragment's writes fall in distinct banks), then each warp stores 16 whole
// rows with 16-byte lanes: 512 contiguous bytes a warp instruction (two for float32). store_tile
// writes 8 bytes a thread (float32) or 4 (bf16), so a quad's store is 32 or 16 contiguous bytes
// of a row: the weight gradients' bf16 tiles came out as 16-byte pieces, 8 L2 requests for every
// 128-byte line, and ncu measured those launches at 76% of L2 throughput with the SMs 33% busy
// (docs/perf-notes.md v0.42). The same values: only the path to memory differs. Needs C's row
// stride and base 16-byte aligned (the caller checks; store_tile otherwise).
constexpr int kStagedStride32 = kBN * 4 + 16, kStagedStride16 = kBN * 2 + 16;
static_assert(2 * 64 * kStagedStride32 <= kStages * kStageStride, "both warpgroups' rows fit the spent stages");

__device__ __forceinline__ void store_tile_staged(const float (&acc)[kAcc], unsigned char* buf, float* c, size_t off,
                                                  size_t ldc, int m_first, int n0, int c_wg, int w, int g, int q,
                                                  int lane, int out_bf16) {
  const int rl = 16 * w + g;  // this thread's rows rl and rl + 8 of the warpgroup's 64
  if (out_bf16) {
#pragma unroll
    for (int i = 0; i < kAcc / 4; ++i) {
      const int col = 8 * i + 2 * q;
      *reinterpret_cast<__nv_bfloat162*>(buf + rl * kStagedStride16 + 2 * col) =
          __floats2bfloat162_rn(acc[4 * i], acc[4 * i + 1]);
      *reinterpret_cast<__nv_bfloat162*>(buf + (rl + 8) * kStagedStride16 + 2 * col) =
          __floats2bfloat162_rn(acc[4 * i + 2], acc[4 * i + 3]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kAcc / 4; ++i) {
      const int col = 8 * i + 2 * q;
      *reinterpret_cast<float2*>(buf + rl * kStagedStride32 + 4 * col) = make_float2(acc[4 * i], acc[4 * i + 1]);
      *reinterpret_cast<float2*>(buf + (rl + 8) * kStagedStride32 + 4 * col) =
          make_float2(acc[4 * i + 2], acc[4 * i + 3]);
    }
  }
  asm volatile("bar.sync %0, 128;" ::"r"(2 + c_wg) : "memory");  // the warpgroup's rows all in buf
  if (out_bf16) {
    bf16* cb = reinterpret_cast<bf16*>(c) + off;
#pragma unroll 4
    for (int rr = 0; rr < 16; ++rr) {
      const int r = 16 * w + rr;
      const uint4 v = *reinterpret_cast<const uint4*>(buf + r * kStagedStride16 + 16 * lane);
      *reinterpret_cast<uint4*>(cb + size_t(m_first + r) * ldc + n0 + 8 * lane) = v;
    }
  } else {
    float* cf = c + off;
#pragma unroll 4
    for (int rr = 0; rr < 16; ++rr) {
      const int r = 16 * w + rr;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 v = *reinterpret_cast<const uint4*>(buf + r * kStagedStride32 + 512 * h + 16 * lane);
        *reinterpret_cast<uint4*>(cf + size_t(m_first + r) * ldc + n0 + 128 * h + 4 * lane) = v;
      }
    }
  }
}

__device__ __forceinline__ void init_pipe(unsigned char* smem, uint64_t*& full, uint64_t*& empty,
                                          unsigned char*& stages) {
  full = reinterpret_cast<uint64_t*>(smem);
  empty = full + kStages;
  const uint32_t base = smem_u32(smem);
  stages = smem + (((base + 2 * kStages * 8 + 1023) & ~1023u) - base);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      sm90::mbar_init(&full[i], 1);
      sm90::mbar_init(&empty[i], 2);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
}

// A consumer thread's epilogue of its tile (acc final, every wgmma retired): the fused SwiGLU
// quantizer, the fused combine, or the store of C (through the spent stages where aligned).
// Shared by gemm_kernel and mx_rawb.cuh's raw_gemm_kernel.
template <int kEpi>
__device__ __forceinline__ void finish_tile(const float (&acc)[kAcc], unsigned char* stages, float* __restrict__ c,
                                            int M, int N, int m0, int n0, size_t z_off, size_t ldc, int c_wg, int w,
                                            int lane, int q, int g, int r0, int out_bf16, const EpiArgs& swi) {
  const int row = m0 + r0;
  if constexpr (kEpi == kEpiSwiglu || kEpi == kEpiSwigluClamp) {
    swiglu_quantize_epilogue<kEpi == kEpiSwigluClamp>(acc, swi, M, row, n0, q);
    return;
  }
  if constexpr (kEpi == kEpiCombine1) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = swi.src[row + 8 * half];
      if (t < 0) continue;
      const float wt = swi.weight[t];
      bf16* o = swi.out + size_t(t) * N;
#pragma unroll
      for (int i = 0; i < kAcc / 4; ++i) {
        const int col = n0 + 8 * i + 2 * q;
        *reinterpret_cast<__nv_bfloat162*>(o + col) = __floats2bfloat162_rn(
            __fmul_rn(wt, acc[4 * i + 2 * half]), __fmul_rn(wt, acc[4 * i + 2 * half + 1]));
      }
    }
    return;
  }
  // whole rows through the spent stages where C's rows and base are 16-byte aligned; both
  // consumer warpgroups' wgmma have retired (barrier 1) before either overwrites a stage
  const bool aligned = (ldc * (out_bf16 ? 2 : 4)) % 16 == 0 && (reinterpret_cast<uintptr_t>(c) & 15) == 0;
  if (!aligned) {
    store_tile(acc, c, z_off, ldc, row, n0, q, out_bf16);
    return;
  }
  asm volatile("bar.sync 1, 256;" ::: "memory");
  unsigned char* buf = stages + size_t(c_wg) * 64 * (out_bf16 ? kStagedStride16 : kStagedStride32);
  store_tile_staged(acc, buf, c, z_off, ldc, m0 + 64 * c_wg, n0, c_wg, w, g, q, lane, out_bf16);
}

// gemm_kernel's consumer warpgroups: the tile's k-blocks, then its epilogue.
template <int kEpi>
__device__ __forceinline__ void consume_tile(unsigned char* stages, uint64_t* full,
                                             uint64_t* empty, float* __restrict__ c, int M, int N, int n_k, int m0,
                                             int n0, size_t z_off, size_t ldc, int t, int wg, int out_bf16,
                                             const EpiArgs& swi) {
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int c_wg = wg - 1, w = t >> 5, lane = t & 31, q = lane & 3, g = lane >> 2;
  const int r0 = 64 * c_wg + 16 * w + g;  // this thread's rows r0 and r0 + 8 of the tile
  float acc[kAcc];
  if (n_k == 0) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
  }
  uint32_t a[2][4];
  int prev = -1;
  for (int kb = 0; kb < n_k; ++kb) consume_kblock(stages, full, empty, kb, kb, r0, q, t, acc, a, prev);
  cute::warpgroup_wait<0>();
  sm90::fence_operands(acc);
  finish_tile<kEpi>(acc, stages, c, M, N, m0, n0, z_off, ldc, c_wg, w, lane, q, g, r0, out_bf16, swi);
}

// band > 1 (grouped launches; MOKGEN_MX_BAND, v0.43, default 8): the CTAs in launch order (x
// fastest, then y) walk the tile list in bands of `band` row tiles, column tile by column tile
// within a band, so the CTAs that share a column tile of B (one expert's weights: 58 MB per
// expert in kimi-k2.5 local's dx) start together and it comes from DRAM about once per band; the
// band's A rows stay in L2 across its column tiles. band 1: the grid's order, a row tile's column
// tiles together (v0.42's; B's column tiles then came from DRAM again for each wave that held
// some of an expert's row tiles: kimi-k2.5's dx 2.30 -> 1.71 ms on the H100 with bands of 8). The
// same tiles either way (the same bits).
// The CTA (bx, by) of a grouped launch as its place in the band order (band above; band <= 1: the
// grid's own order).
__device__ __forceinline__ void band_order(int& bx, int& by, int band) {
  if (band > 1) {
    const int nx = int(gridDim.x), ny = int(gridDim.y);
    const int l = by * nx + bx;                            // the CTA's place in launch order
    const int b = l / (band * nx), r = l - b * band * nx;  // its band, and place within the band
    const int in_band = ny - b * band < band ? ny - b * band : band;
    bx = r / in_band;
    by = b * band + r % in_band;
  }
}

template <int kEpi>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                const uint8_t* __restrict__ sa, float* __restrict__ c, int M, int N, int K,
                const int2* __restrict__ tiles, const int2* __restrict__ kranges, int out_bf16, EpiArgs swi, int band) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, t = tid & 127;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  int bx = int(blockIdx.x), by = int(blockIdx.y);  // this CTA's column tile and row tile
  band_order(bx, by, band);
  // grouped (tiles given): tile (expert e, first row m0) against e's N rows of the stacked B
  // [E N, K]; (-1, 0) tiles (past the segments of a fixed-length list) are skipped
  const int2 tile = tiles != nullptr ? tiles[by] : make_int2(0, by * kBM);
  if (tile.x < 0) return;
  const int m0 = tile.y, n0 = bx * kBN, b0 = tile.x * N + n0;
  // k-ranged (kranges given, the weight gradients): output z = blockIdx.z reduces k in
  // [first, first + length) of its range (first a multiple of 128; length 0 writes zeros) into
  // its own [M, N] slice of C
  const int2 kr = kranges != nullptr ? kranges[blockIdx.z] : make_int2(0, K);
  const int kb0 = kr.x / kBK, n_k = kr.y / kBK;
  const size_t ldc = swi.ldc > 0 ? size_t(swi.ldc) : size_t(N);  // C's row stride (kEpiStore)
  const size_t z_off = size_t(blockIdx.z) * M * ldc;  // elements of C (float32 or bf16) before slice z
  uint64_t *full, *empty;
  unsigned char* stages;
  init_pipe(smem, full, empty, stages);
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (t == 0) {
      for (int kb = 0; kb < n_k; ++kb) produce_kblock(&map_a, &map_b, sa, stages, full, empty, kb, kb0 + kb, m0, b0, M);
    }
    return;
  }
  consume_tile<kEpi>(stages, full, empty, c, M, N, n_k, m0, n0, z_off, ldc, t, wg, out_bf16, swi);
}

// The k-ranged GEMM (the weight gradients) persistent (v0.40): gridDim.x CTAs walk the tiles
// (n tile fastest, then the row tile, then the range z, as gemm_kernel's grid), each CTA every
// gridDim.x-th. The producer's stage counter runs on across tiles, so it fills the next tile's
// stages while the consumers finish a tile and store it: a tile's k-range (about 384 rows per
// expert on kimi-k2.5 local, 6 k-blocks) no longer pays its pipeline's fill. The same k-loop per
// tile, so the same bits as gemm_kernel<kEpiStore>.
__global__ void __launch_bounds__(kThreads, 1)
    ranged_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                  const uint8_t* __restrict__ sa, float* __restrict__ c, int M, int N,
                  const int2* __restrict__ kranges, int n_ranges, int out_bf16) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, t = tid & 127;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int n_nt = N / kBN, n_mt = M / kBM;
  const long long n_tiles = (long long)n_nt * n_mt * n_ranges;
  uint64_t *full, *empty;
  unsigned char* stages;
  init_pipe(smem, full, empty, stages);
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (t == 0) {
      int it = 0;
      for (long long i = blockIdx.x; i < n_tiles; i += gridDim.x) {
        const int nt = int(i % n_nt), mt = int((i / n_nt) % n_mt), z = int(i / ((long long)n_nt * n_mt));
        const int2 kr = kranges[z];
        const int kb0 = kr.x / kBK, n_k = kr.y / kBK;
        for (int kb = 0; kb < n_k; ++kb, ++it)
          produce_kblock(&map_a, &map_b, sa, stages, full, empty, it, kb0 + kb, mt * kBM, nt * kBN, M);
      }
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int c_wg = wg - 1, w = t >> 5, lane = t & 31, q = lane & 3, g = lane >> 2;
  const int r0 = 64 * c_wg + 16 * w + g;
  float acc[kAcc];
  uint32_t a[2][4];
  int it = 0;
  for (long long i = blockIdx.x; i < n_tiles; i += gridDim.x) {
    const int nt = int(i % n_nt), mt = int((i / n_nt) % n_mt), z = int(i / ((long long)n_nt * n_mt));
    const int n_k = kranges[z].y / kBK;
    if (n_k == 0) {
#pragma unroll
      for (int j = 0; j < kAcc; ++j) acc[j] = 0.f;
    }
    int prev = -1;
    for (int kb = 0; kb < n_k; ++kb, ++it) consume_kblock(stages, full, empty, it, kb, r0, q, t, acc, a, prev);
    cute::warpgroup_wait<0>();
    sm90::fence_operands(acc);
    if (prev >= 0 && t == 0) sm90::mbar_arrive(&empty[prev]);  // the tile's last stage: all its wgmmas retired
    store_tile(acc, c, size_t(z) * M * N, size_t(N), mt * kBM + r0, nt * kBN, q, out_bf16);
  }
}

}  // namespace bf16m
}  // namespace mxg
}  // namespace mokgen
