// MXFP8 quantization of one 32-element block (issue 6: the dispatch will quantize rows with it,
// the up projection's epilogue its output): E4M3 elements, one E8M0 scale, with the rules of
// mokgen.reference.mx_quantize (the oracle): scale 2**(floor(log2 amax) - 8) clamped to
// 2**-127..2**127 (an all-zero block: 2**-127), elements rounded to nearest, ties to even,
// saturating at +-448, signed zeros and subnormals kept, and a block holding a NaN or an
// infinity gets the NaN scale (0xFF) and NaN codes (0x7F). Host and device code: checked
// bit for bit against the oracle on the CPU (tests/host/mx_check.cu, tests/test_mx.py).
// Computed in float32, exactly: v * 2**-s is exact whenever the result is a normal float32, and
// any result below that rounds to a zero code either way.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.cuh"

namespace mokgen {
namespace mx {

constexpr int kBlock = 32;
constexpr uint8_t kE4M3Nan = 0x7F;
constexpr uint8_t kE8M0Nan = 0xFF;

MOKGEN_HOST_DEVICE uint32_t float_bits(float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}
MOKGEN_HOST_DEVICE float bits_float(uint32_t u) {
  float v;
  memcpy(&v, &u, 4);
  return v;
}

// E4M3 code of a float32: round to nearest even, saturating to +-448 (infinities too), NaN ->
// 0x7F, the sign of zero kept.
MOKGEN_HOST_DEVICE uint8_t e4m3_encode(float v) {
  const uint32_t bits = float_bits(v);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return kE4M3Nan;
  const uint8_t sign = uint8_t((bits >> 24) & 0x80u);
  uint32_t a = bits & 0x7fffffffu;
  if (a > 0x43e00000u) a = 0x43e00000u;  // 448 = 1.75 * 2**8, the largest finite E4M3
  if (a >= 0x3c800000u) {                // >= 2**-6: a normal E4M3 (3 mantissa bits)
    a += 0x7ffffu + ((a >> 20) & 1u);    // round the 23-bit mantissa to 3 bits, ties to even
    a &= ~0xfffffu;                      // (a carry moves to the next binade; 448 stays 448)
    const uint32_t e = (a >> 23) - 127 + 7, m = (a >> 20) & 7u;
    return uint8_t(sign | (e << 3) | m);
  }
  // below 2**-6: multiples of 2**-9 (subnormal E4M3, code = the multiple; 8 is 2**-6, code 0x08)
  const float q = rintf(bits_float(a) * 512.f);  // exact product; rintf: ties to even
  return uint8_t(sign | uint32_t(q));
}

// One block: codes[i] and the returned E8M0 scale code.
MOKGEN_HOST_DEVICE uint8_t quantize_block(const float (&v)[kBlock], uint8_t (&codes)[kBlock]) {
  uint32_t amax = 0;  // bits of max |v| (non-finite: exponent field all ones)
  bool finite = true;
  for (int i = 0; i < kBlock; ++i) {
    const uint32_t a = float_bits(v[i]) & 0x7fffffffu;
    finite = finite && a < 0x7f800000u;
    amax = a > amax ? a : amax;
  }
  if (!finite) {
    for (int i = 0; i < kBlock; ++i) codes[i] = kE4M3Nan;
    return kE8M0Nan;
  }
  // floor(log2 amax) - 8 from the exponent field (a float32 subnormal or zero amax: below -127)
  const int exp_field = int(amax >> 23);
  int s = exp_field == 0 ? -127 : exp_field - 127 - 8;
  s = s < -127 ? -127 : s;  // amax < 2**-119 (zero included): the smallest scale
  const float inv = bits_float(uint32_t(127 - s) << 23);  // 2**-s, a normal float32 for s in [-127, 119]
  for (int i = 0; i < kBlock; ++i) codes[i] = e4m3_encode(v[i] * inv);
  return uint8_t(s + 127);
}


// A 32-element block of bf16 (16-byte aligned) as float32, four 16-byte loads (the row
// quantizers' input, and the megakernel's publish).
MOKGEN_DEVICE void load_bf16_block(const bf16* src, float (&v)[kBlock]) {
  const uint4* p = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 w = p[i];
    const bf16* e = reinterpret_cast<const bf16*>(&w);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[8 * i + j] = __bfloat162float(e[j]);
  }
}

// quantize_block on the GPU with the hardware conversion: the same scale, then each pair of
// scaled values through cvt.rn.satfinite.e4m3x2.f32 (round to nearest even, E4M3 subnormals kept,
// finite values beyond 448 saturated to +-448, the sign of zero kept): the bits of e4m3_encode for
// every finite input, and a block holding a NaN or an infinity still gets the NaN scale and NaN
// codes from the check before. About one instruction per pair where e4m3_encode takes a dozen per
// element. Checked against the oracle's bits on the GPU (tests/test_gpu_mx_gemm.py,
// tests/test_gpu_mx_experts.py), as this has no host form.
// (Before sm_89, which has no such conversion, and in the host pass: quantize_block itself.)
__device__ __forceinline__ uint8_t quantize_block_hw(const float (&v)[kBlock], uint8_t (&codes)[kBlock]) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 890
  return quantize_block(v, codes);
#else
  uint32_t amax = 0;
  bool finite = true;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {
    const uint32_t a = float_bits(v[i]) & 0x7fffffffu;
    finite = finite && a < 0x7f800000u;
    amax = a > amax ? a : amax;
  }
  if (!finite) {
#pragma unroll
    for (int i = 0; i < kBlock; ++i) codes[i] = kE4M3Nan;
    return kE8M0Nan;
  }
  const int exp_field = int(amax >> 23);
  int s = exp_field == 0 ? -127 : exp_field - 127 - 8;
  s = s < -127 ? -127 : s;
  const float inv = bits_float(uint32_t(127 - s) << 23);
#pragma unroll
  for (int i = 0; i < kBlock; i += 2) {
    uint16_t pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(v[i + 1] * inv), "f"(v[i] * inv));
    codes[i] = uint8_t(pair & 0xffu);  // the second operand goes to the low byte
    codes[i + 1] = uint8_t(pair >> 8);
  }
  return uint8_t(s + 127);
#endif
}

}  // namespace mx
}  // namespace mokgen
