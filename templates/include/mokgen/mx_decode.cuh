// MXFP8 A operands decoded in registers for the BF16 tensor core (wgmma with A from registers):
// shared by the bf16-math GEMM (mx_gemm.cuh, namespace bf16m) and the MX expert tile
// (mx_tile.cuh). An E4M3 value times its block's power of two 2^(s - 127) is a BF16 value (exact
// unless s is near 0 or 254), so the products and their float32 sums are the exact MX product's.
// B, in shared memory, holds BF16 MX values with k permuted within each 16 so that a thread's four
// consecutive codes fill its fragment's k slots 2q, 2q + 1, 2q + 8, 2q + 9
// (mokgen.mx_gemm.bf16_math_weights).
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>

#include <cstdint>
#include <utility>

namespace mokgen {
namespace mxd {

template <int kN>
struct WgmmaRS;
template <>
struct WgmmaRS<256> {
  using Op = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
};
template <>
struct WgmmaRS<128> {
  using Op = cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
};

// d[kN / 2] += A(64 x 16, registers) * B(kN x 16, shared memory)^T; accumulate false overwrites.
template <int kN, int kAcc, size_t... Is>
__device__ __forceinline__ void wgmma_rs(const uint32_t (&a)[4], uint64_t db, float (&d)[kAcc], bool accumulate,
                                         std::index_sequence<Is...>) {
  WgmmaRS<kN>::Op::fma(a[0], a[1], a[2], a[3], db, d[Is]...,
                       accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// A register dependency on the fragment, so its writes stay between the wgmma fences and waits.
__device__ __forceinline__ void fence_a(uint32_t (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// Two E4M3 codes (the low 16 bits of w) -> bf16x2 of their values times 2^(s - 127), given
// m1 = 2^(min(s, 142) - 15) and m2 = 2^(max(s, 142) - 142) as bf16x2 (m1 NaN for the NaN scale).
// cvt gives the exact f16x2; its bits shifted right by 3 (sign kept) read as bf16 are the value
// times 2^-112 (zero stays zero), and the two exact multiplications put back 2^(112 + s - 127).
__device__ __forceinline__ uint32_t decode2(uint32_t w, uint32_t m1, uint32_t m2) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(uint16_t(w & 0xffffu)));
  uint32_t t = ((h >> 3) & 0x0fff0fffu) | (h & 0x80008000u);
  asm("mul.rn.bf16x2 %0, %0, %1;" : "+r"(t) : "r"(m1));
  asm("mul.rn.bf16x2 %0, %0, %1;" : "+r"(t) : "r"(m2));
  return t;
}

// A 32-bit load from shared memory by its shared-window address: LDS in SASS. The MX tile's stage
// pointers reach it through the megakernel's carve as generic pointers, which compile to generic
// loads (LD.E, a 64-bit address each) where the bf16-math GEMM's own `extern __shared__` stages
// give LDS (v0.56). volatile: kept after the full barrier's wait, as the generic load was.
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ void multipliers(uint32_t s, uint32_t& m1, uint32_t& m2) {
  const uint32_t lo = s < 142u ? s : 142u, hi = s > 142u ? s : 142u;
  const uint32_t b1 = s == 255u ? 0x7fc0u : (lo + 112u) << 7;  // 2^(lo - 15)
  const uint32_t b2 = (hi - 142u + 127u) << 7;                  // 2^(hi - 142)
  m1 = b1 | (b1 << 16);
  m2 = b2 | (b2 << 16);
}

}  // namespace mxd
}  // namespace mokgen
