// MX rounding of bf16 values by bf16x2 arithmetic and bit masks (v0.67's raw dgrads, mx_rawb.cuh;
// v0.68's raw forward weights, mx_tile.cuh MxQuantB), and the two pieces of the conversion
// kernels' float arithmetic they fall back on (mx_rows.cuh). A block's MX values: its E4M3 codes
// times the block's power-of-two scale, as bf16, the bits of the conversion kernels' decoded values
// (mx_rows.cuh store_decoded_pairs). Hopper's F2FP conversions are slow, so the common case
// (round_block) is bf16x2 arithmetic and bit masks; a block with its scale near either end of E8M0's
// range, or not finite, takes the conversion's own float path (exact_half).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "mx.cuh"

namespace mokgen {
namespace mxg {

// The scale exponent s of a finite block from the bits of its amax (mx::quantize_block's: floor(log2
// amax) - 8, clamped to -127; its E8M0 code s + 127), with inv = 2**-s to multiply its elements by.
MOKGEN_DEVICE int block_scale_exponent(uint32_t amax, float& inv) {
  const int exp_field = int(amax >> 23);
  int s = exp_field == 0 ? -127 : exp_field - 127 - 8;
  s = s < -127 ? -127 : s;
  inv = mx::bits_float(uint32_t(127 - s) << 23);
  return s;
}

MOKGEN_DEVICE float e8m0_factor(uint8_t s) {  // 2^(s - 127); 2^-127 is a float32 subnormal
  return s == 0xffu ? __int_as_float(0x7fc00000) : s == 0 ? __int_as_float(0x00400000) : __int_as_float(int(s) << 23);
}

__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t min_u16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("min.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// max(|a|, |b|) per half (the sign bits then xor'ed in, masked off by the caller); NaN propagates
__device__ __forceinline__ uint32_t absmax_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// min(|a|, |b|) per half, with the sign of a xor that of b (absmax's counterpart, NaN not propagated)
__device__ __forceinline__ uint32_t min_xorsign_abs_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("min.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t add_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t sub_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// Whether a 32-block whose largest magnitude has the bf16 exponent field ea takes round_block:
// its scale 2^(ea - 135) (ea >= 8), the E4M3 normal range from exponent field t = ea - 14 >= 10
// (so no input is a bf16 subnormal that the rounding grid could see), and ea + 4 <= 254 (the
// rounding constant 16 2^max(ex, t) below stays finite; ea 255 is a NaN or an infinity in the block).
__device__ __forceinline__ bool fast_field(uint32_t ea) { return ea >= 24u && ea <= 250u; }

// Eight words of bf16 pairs made MX values in place: the low halves belong to a 32-block whose
// amax has the exponent field ea_lo, the high halves to one with ea_hi (two columns' blocks of an
// MN-major tile, mx_rawb.cuh; the same block twice in a K-major row, MxQuantB), both in fast_field.
// Per element x (exponent field ex): the E4M3 value of x / 2^s (s = ea - 135), times 2^s, is x
// rounded to nearest even on a grid of 2^(max(ex, t) - 3) (t = ea - 14: three mantissa bits in
// E4M3's normal range, its subnormal grid 2^(s - 9) below), then saturated at 448 2^s (bits
// (ea << 7) | 0x60). The rounding is one bf16 addition of M = 16 2^max(ex, t), with x's sign, and
// its subtraction: |x| < M / 8, so |x| + M lies in [M, 2 M), where the bf16 grid is M / 128 =
// 2^(max(ex, t) - 3), rounded to nearest even once (M is an even multiple of the grid, so the tie
// goes as E4M3's; round to nearest even is symmetric, so the sign may ride along), and the
// subtraction is exact. A value rounded to zero comes out +0; the sign goes back by bits (a
// negative one stays -0, as the conversion's decoded -0 code). Per word: the signed power of two
// x & 0xff80 (a bits mask), its larger magnitude with 2^t (bf16 max), the addition and the
// subtraction of 16 times it (two bf16 FMAs), the saturation (bf16 min) and the sign: six
// instructions, four on the ALU pipe. (v0.68-v0.69: the magnitude rounded and the bounds taken
// on 16-bit integers, eight instructions, six on the ALU pipe; the same bits, docs/perf-notes.md v0.70.)
__device__ __forceinline__ void round_block(uint32_t (&v)[8], uint32_t ea_lo, uint32_t ea_hi) {
  const uint32_t t = ((ea_lo - 14u) << 7) | (((ea_hi - 14u) << 7) << 16);
  const uint32_t sat = ((ea_lo << 7) | 0x60u) | (((ea_hi << 7) | 0x60u) << 16);
  constexpr uint32_t kPlus16 = 0x41804180u, kMinus16 = 0xc180c180u;  // bf16x2 (16, 16), (-16, -16)
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const uint32_t x = v[r];
#if defined(MOKGEN_MX_ROUND_V68)
    // measuring build (the same bits): v0.68's rounding, for the A/B of docs/perf-notes.md v0.70
    const uint32_t t4 = t + 0x02000200u;
    const uint32_t m = max_u16x2((x & 0x7f807f80u) + 0x02000200u, t4);
    const uint32_t y = min_u16x2(sub_bf16x2(add_bf16x2(x & 0x7fff7fffu, m), m), sat);
    v[r] = y | (x & 0x80008000u);
    (void)kPlus16, (void)kMinus16;
#else
    // +-2^max(ex, t) with x's sign (absmax keeps a's sign, t's is 0; the block is finite: fast_field)
    const uint32_t ms = absmax_bf16x2(x & 0xff80ff80u, t);
    const uint32_t y = fma_bf16x2(ms, kMinus16, fma_bf16x2(ms, kPlus16, x));
    v[r] = min_xorsign_abs_bf16x2(y, sat) | (x & 0x80008000u);
#endif
  }
}

// The conversion's own arithmetic for one half (hi: the upper bf16 of each word) of v: the block's
// scale from amax's bits (block_scale_exponent; non-finite: the NaN scale and NaN codes), x times
// 2^-s to E4M3 (cvt.rn.satfinite), and back as store_decoded_pairs decodes it (f16, float32, times
// e8m0_factor, rounded to bf16).
template <bool kHi>
__device__ __forceinline__ void exact_half(uint32_t (&v)[8], uint32_t amax16) {
  const uint32_t amax = amax16 << 16;
  const bool finite = amax < 0x7f800000u;
  float inv;
  const int s = block_scale_exponent(amax, inv);
  const float f = e8m0_factor(finite ? uint8_t(s + 127) : mx::kE8M0Nan);
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const uint32_t x = v[r];
    const float xf = __uint_as_float(kHi ? (x & 0xffff0000u) : (x << 16));
    uint16_t code2;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(code2) : "f"(0.f), "f"(xf * inv));
    if (!finite) code2 = mx::kE4M3Nan;
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(code2));
    const float val = __low2float(*reinterpret_cast<const __half2*>(&h2));
    const uint32_t b = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(val * f)));
    v[r] = kHi ? ((x & 0x0000ffffu) | (b << 16)) : ((x & 0xffff0000u) | b);
  }
}

}  // namespace mxg
}  // namespace mokgen
