// The staged MXFP8 experts' row kernels (issue 6, mokgen.mx_experts; launched from
// templates/mx_gemm.cu): the rows gathered and quantized, SwiGLU with h quantized, the combine.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_fp16.h>

#include "common.cuh"
#include "mx.cuh"
#include "mx_round.cuh"
#include "swiglu_grad.cuh"

namespace mokgen {
namespace mxg {

// ---- the staged MXFP8 experts' quantizers (mokgen.mx_experts): one thread per 32-element block,
// mx.cuh's quantize_block_hw (bit for bit the oracle), the scales written straight into the GEMM's
// blocked layout [K / 128, rows, 4] -------------------------------------------------------------

// A block's 32 codes as two 16-byte stores (dst 16-byte aligned).
MOKGEN_DEVICE void store_codes(const uint8_t (&q)[mx::kBlock], uint8_t* dst) {
  uint4 w[2];
  memcpy(w, q, sizeof(q));
  uint4* d = reinterpret_cast<uint4*>(dst);
  d[0] = w[0];
  d[1] = w[1];
}

MOKGEN_DEVICE void store_block(const uint8_t (&q)[mx::kBlock], uint8_t scale, uint8_t* codes, uint8_t* scales,
                               int r, int b, int rows, int k) {
  store_codes(q, codes + size_t(r) * k + b * mx::kBlock);
  scales[(size_t(b >> 2) * rows + r) * 4 + (b & 3)] = scale;
}

// Row r of the output is row src[r] of x (bf16 [*, H]), or zeros where src[r] < 0 (a padding row
// of an expert's segment), quantized along H.
__global__ void quantize_rows_kernel(const bf16* __restrict__ x, const int* __restrict__ src, int rows, int h,
                                     uint8_t* __restrict__ codes, uint8_t* __restrict__ scales) {
  const int nb = h / mx::kBlock;
  const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (idx >= (long long)rows * nb) return;
  const int r = int(idx / nb), b = int(idx % nb), from = src[r];
  float v[mx::kBlock];
  if (from >= 0) {
    mx::load_bf16_block(x + size_t(from) * h + b * mx::kBlock, v);
  } else {
#pragma unroll
    for (int i = 0; i < mx::kBlock; ++i) v[i] = 0.f;
  }
  uint8_t q[mx::kBlock];
  const uint8_t scale = mx::quantize_block_hw(v, q);
  store_block(q, scale, codes, scales, r, b, rows, h);
}

// out[t] = sum_j w[t, j] * y[row[t k + j]] in float32 in the order j = 0..k-1, each product and
// sum rounded on its own (no FMA: the same bits as the PyTorch expression w0 * y0 + w1 * y1 ...),
// then bf16. One thread per (token, 4 columns).
__global__ void combine_kernel(const float* __restrict__ y, const long long* __restrict__ row,
                               const float* __restrict__ w, int tokens, int k, int h, bf16* __restrict__ out) {
  const int groups = h / 4;
  const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (idx >= (long long)tokens * groups) return;
  const int t = int(idx / groups), g = int(idx % groups);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j = 0; j < k; ++j) {
    const float wj = w[size_t(t) * k + j];
    const float4 v = reinterpret_cast<const float4*>(y + size_t(row[size_t(t) * k + j]) * h)[g];
    const float4 p = make_float4(__fmul_rn(wj, v.x), __fmul_rn(wj, v.y), __fmul_rn(wj, v.z), __fmul_rn(wj, v.w));
    acc = j == 0 ? p
                 : make_float4(__fadd_rn(acc.x, p.x), __fadd_rn(acc.y, p.y), __fadd_rn(acc.z, p.z), __fadd_rn(acc.w, p.w));
  }
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + size_t(t) * h + 4 * g);
  o[0] = __floats2bfloat162_rn(acc.x, acc.y);
  o[1] = __floats2bfloat162_rn(acc.z, acc.w);
}

// ---- the MXFP8 backward's quantizers (mx_experts.experts_forward_train) --------------------------

// float32 rows [rows, k] quantized along k (dy and dgu for the dgrads), the scales blocked.
__global__ void quantize_f32_rows_kernel(const float* __restrict__ x, int rows, int k, uint8_t* __restrict__ codes,
                                         uint8_t* __restrict__ scales) {
  const int nb = k / mx::kBlock;
  const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (idx >= (long long)rows * nb) return;
  const int r = int(idx / nb), b = int(idx % nb);
  const float4* p = reinterpret_cast<const float4*>(x + size_t(r) * k + b * mx::kBlock);
  float v[mx::kBlock];
#pragma unroll
  for (int i = 0; i < mx::kBlock / 4; ++i) {
    const float4 f = p[i];
    v[4 * i] = f.x;
    v[4 * i + 1] = f.y;
    v[4 * i + 2] = f.z;
    v[4 * i + 3] = f.w;
  }
  uint8_t q[mx::kBlock];
  const uint8_t scale = mx::quantize_block_hw(v, q);
  store_block(q, scale, codes, scales, r, b, rows, k);
}

// Rows [rows, n] (float32 or bf16) quantized along the rows, transposed: codes [n, rows], scales
// [n, rows / 32] (the wgrads' operands, the token rows their reduction). Thread (block b of 32
// rows, column c): a warp's threads take 32 consecutive columns, so each of the 32 row reads is
// one 128-byte (float32) or 64-byte (bf16) line.
template <class T>
__global__ void quantize_cols_kernel(const T* __restrict__ x, int rows, int n, uint8_t* __restrict__ codes,
                                     uint8_t* __restrict__ scales) {
  const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  const int nb = rows / mx::kBlock;
  if (idx >= (long long)nb * n) return;
  const int b = int(idx / n), c = int(idx % n);
  float v[mx::kBlock];
#pragma unroll
  for (int i = 0; i < mx::kBlock; ++i) v[i] = float(x[size_t(b * mx::kBlock + i) * n + c]);
  uint8_t q[mx::kBlock];
  const uint8_t scale = mx::quantize_block_hw(v, q);
  store_codes(q, codes + size_t(c) * rows + b * mx::kBlock);
  scales[size_t(c) * nb + b] = scale;
}


// ---- the MXFP8 backward's elementwise stages, fused (v0.40; mx_gemm.combine_backward,
// mx_gemm.swiglu_backward). They replace PyTorch expressions over float32 [rows, H] and
// [rows, I] tensors, each a pass of its own (about 11 GB of traffic on a kimi-k2.5 local step).
// A thread takes 4 consecutive elements of a row and 8 neighbouring lanes a 32-element block
// (v0.41): each warp load and store covers 512 contiguous bytes. v0.40's thread-per-block form
// ran at 1.1-1.6 TB/s on the H100 (each warp access 16 bytes in each of 32 lines; ncu saw the
// same pattern write 3x the L2 sectors in the weights' column quantizer).

// Four elements times inv as E4M3 codes, element i in byte i (the byte order of store_codes), by
// quantize_block_hw's conversion (cvt.rn.satfinite.e4m3x2.f32: the second operand's code in the
// low byte). sm_89 and later.
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d, float inv) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b * inv), "f"(a * inv));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d * inv), "f"(c * inv));
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

// quantize_block_hw of a 32-element block held 4 a lane by 8 neighbouring lanes (lane group g =
// lane / 8 of the warp, element 4 l + i in lane l's v[i]): the same scale (returned by every lane)
// and codes (this lane's 4, byte i = element 4 l + i: the order store_codes writes). All 32 lanes
// of the warp must call it.
MOKGEN_DEVICE uint8_t quantize_block_lanes(const float (&v)[4], uint32_t& codes4) {
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t a = mx::float_bits(v[i]) & 0x7fffffffu;
    amax = a > amax ? a : amax;
  }
#pragma unroll
  for (int m = 1; m < 8; m <<= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  if (amax >= 0x7f800000u) {  // a NaN or an infinity in the block: the NaN scale and NaN codes
    codes4 = 0x7f7f7f7fu;
    return mx::kE8M0Nan;
  }
  float inv;
  const int s = block_scale_exponent(amax, inv);
  codes4 = e4m3x4(v[0], v[1], v[2], v[3], inv);
  return uint8_t(s + 127);
}

// quantize_block_lanes of the lane's 4 elements 4 q .. 4 q + 3 of row r, stored: the codes as word
// q of codes_row, the block's scale (block b of the row) by the block's first lane into the blocked
// scales [n / 128, rows, 4]. All 32 lanes of the warp must call it.
MOKGEN_DEVICE void quantize_store_lanes(const float (&v)[4], uint8_t* codes_row, int q, uint8_t* scales, int rows,
                                        int r, int b) {
  uint32_t c4;
  const uint8_t scale = quantize_block_lanes(v, c4);
  reinterpret_cast<uint32_t*>(codes_row)[q] = c4;
  if ((q & 7) == 0) scales[(size_t(b >> 2) * rows + r) * 4 + (b & 3)] = scale;
}

// Row r's gate and up elements 4 q .. 4 q + 3 of the float32 gate | up rows gu [rows, 2 I].
MOKGEN_DEVICE void load_gate_up4(const float* gu, int r, int q, int inter, float4& g4, float4& u4) {
  g4 = reinterpret_cast<const float4*>(gu + size_t(r) * 2 * inter)[q];
  u4 = reinterpret_cast<const float4*>(gu + size_t(r) * 2 * inter + inter)[q];
}

// Where the MXFP8 backward's elementwise kernels read a padded row's values (4 consecutive
// columns from `col`, a multiple of 4, of rows `stride` elements long): PaddedF32Rows, the float32
// rows of the padded layout themselves (the staged forward's gu and y, row r); PairBf16Rows, the
// bf16 row of the row's (token, slot) pair p in pair order (what the megakernel's forward leaves:
// its saved [g | u] rows and its combine slots' y rows, mokgen.ep._MXTraining), zeros for a
// padding row (p < 0), as the padded layout holds there. bf16 -> float32 is exact, so a pair row
// read here and the float32 copy of it in the padded layout give the same bits.
struct PaddedF32Rows {
  const float* base;
  MOKGEN_DEVICE float4 load4(int r, int /*p*/, size_t stride, size_t col) const {
    return *reinterpret_cast<const float4*>(base + size_t(r) * stride + col);
  }
};
struct PairBf16Rows {
  const bf16* base;
  MOKGEN_DEVICE float4 load4(int /*r*/, int p, size_t stride, size_t col) const {
    if (p < 0) return make_float4(0.f, 0.f, 0.f, 0.f);
    const uint2 raw = *reinterpret_cast<const uint2*>(base + size_t(p) * stride + col);
    __nv_bfloat162 v01, v23;
    memcpy(&v01, &raw.x, 4);
    memcpy(&v23, &raw.y, 4);
    const float2 a = __bfloat1622float2(v01), b = __bfloat1622float2(v23);
    return make_float4(a.x, a.y, b.x, b.y);
  }
};

// h = swiglu(gate, up) of the float32 gate | up rows gu [rows, 2 I] (common.cuh's swiglu, the
// megakernel's), quantized along I. A thread per 4 consecutive elements of a row, 8 lanes a
// 32-block (v0.41, as the backward's kernels: v0.40's thread per block ran at about 2 TB/s on the
// H100). I a multiple of 128, so a warp's 32 threads lie in one row.
template <bool kHasClamp>
__global__ void swiglu_quantize_kernel(const float* __restrict__ gu, int rows, int inter, float limit,
                                       uint8_t* __restrict__ codes, uint8_t* __restrict__ scales) {
  const int per_row = inter / 4;
  const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (idx >= (long long)rows * per_row) return;  // whole warps: rows * per_row is a multiple of 32
  const int r = int(idx / per_row), q = int(idx % per_row);
  float4 g4, u4;
  load_gate_up4(gu, r, q, inter, g4, u4);
  const float v[4] = {swiglu<kHasClamp>(g4.x, u4.x, limit), swiglu<kHasClamp>(g4.y, u4.y, limit),
                      swiglu<kHasClamp>(g4.z, u4.z, limit), swiglu<kHasClamp>(g4.w, u4.w, limit)};
  quantize_store_lanes(v, codes + size_t(r) * inter, q, scales, rows, r, q / 8);  // block q / 8 along I
}

// The combine's backward, one CTA per padded row r (pair p = pair[r], -1 for a padding row):
// dy[r] = w[p] * dOut[p / k] in float32 (one product, rounded once: the PyTorch expression's bits),
// dy's row r quantized along H (the dgrad's A), and d w[p] = <dOut[p / k], y[r]>, summed in a
// fixed order: each thread along its own elements (its 4, group after group of the row), then the
// CTA's threads by a fixed tree. A padding row gets zeros (and zero codes). kKeepDy false (v0.66):
// dy's float32 rows not written (its codes and d w only; dy may be null). H a multiple of 128,
// kThreads threads (a multiple of 32). y's rows: YRows (PaddedF32Rows or PairBf16Rows above).
template <int kThreads, class YRows, bool kKeepDy = true>
__global__ void __launch_bounds__(kThreads) combine_backward_kernel(
    const bf16* __restrict__ d_out, const YRows y, const int* __restrict__ pair,
    const float* __restrict__ w, int rows, int k, int h, float* __restrict__ dy, uint8_t* __restrict__ codes,
    uint8_t* __restrict__ scales, float* __restrict__ d_w) {
  __shared__ float partial[kThreads];
  const int r = blockIdx.x, p = pair[r];
  const float wp = p >= 0 ? w[p] : 0.f;
  const bf16* g = p >= 0 ? d_out + size_t(p / k) * h : nullptr;
  float dot = 0.f;
  for (int q = threadIdx.x; q < h / 4; q += kThreads) {  // h / 4 a multiple of 32: whole warps
    float v[4];
    if (p >= 0) {
      const uint2 raw = *reinterpret_cast<const uint2*>(g + 4 * q);
      __nv_bfloat162 d01, d23;
      memcpy(&d01, &raw.x, 4);
      memcpy(&d23, &raw.y, 4);
      const float2 a = __bfloat1622float2(d01), b = __bfloat1622float2(d23);
      const float d[4] = {a.x, a.y, b.x, b.y};
      const float4 yv = y.load4(r, p, size_t(h), size_t(4) * q);
      const float ys[4] = {yv.x, yv.y, yv.z, yv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        dot = __fadd_rn(dot, __fmul_rn(d[i], ys[i]));
        v[i] = __fmul_rn(wp, d[i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = 0.f;
    }
    if constexpr (kKeepDy) reinterpret_cast<float4*>(dy + size_t(r) * h)[q] = make_float4(v[0], v[1], v[2], v[3]);
    uint32_t c4;
    const uint8_t scale = quantize_block_lanes(v, c4);
    reinterpret_cast<uint32_t*>(codes + size_t(r) * h)[q] = c4;
    const int b = q / 8;  // the 32-block along H
    if ((q & 7) == 0) scales[(size_t(b >> 2) * rows + r) * 4 + (b & 3)] = scale;
  }
  if (p < 0) return;  // the whole CTA: p is the row's
  partial[threadIdx.x] = dot;
  __syncthreads();
#pragma unroll
  for (int s = kThreads / 2; s > 0; s /= 2) {  // a fixed tree: the same sums in the same order every run
    if (threadIdx.x < s) partial[threadIdx.x] = __fadd_rn(partial[threadIdx.x], partial[threadIdx.x + s]);
    __syncthreads();
  }
  if (threadIdx.x == 0) d_w[p] = partial[0];
}

// SwiGLU's backward of row r's elements 4 q .. 4 q + 3 (swiglu_grad_exact each): h, dg and du, from
// gu's row (GuRows, through pair[r] for PairBf16Rows) and dh [rows, I]. swiglu_backward_kernel's and
// swiglu_backward_cols_kernel's elements.
template <bool kHasClamp, class GuRows>
MOKGEN_DEVICE void swiglu_grad4(const GuRows& gu, const int* __restrict__ pair, const float* __restrict__ dh, int r,
                                int q, int inter, float limit, float (&vh)[4], float (&vg)[4], float (&vu)[4]) {
  const int p = std::is_same<GuRows, PaddedF32Rows>::value ? r : pair[r];
  const float4 g4 = gu.load4(r, p, size_t(2) * inter, size_t(4) * q);
  const float4 u4 = gu.load4(r, p, size_t(2) * inter, size_t(inter) + 4 * q);
  const float4 d4 = reinterpret_cast<const float4*>(dh + size_t(r) * inter)[q];
  const float gs[4] = {g4.x, g4.y, g4.z, g4.w}, us[4] = {u4.x, u4.y, u4.z, u4.w}, ds[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const bwd::SwigluGrad res = bwd::swiglu_grad_exact(gs[i], us[i], ds[i], kHasClamp, limit);
    vh[i] = res.h;
    vg[i] = res.dg;
    vu[i] = res.du;
  }
}

// SwiGLU's backward, a thread per 4 consecutive elements of a row of I (8 lanes a 32-block), from
// the float32 gate | up rows gu [rows, 2 I] and dh [rows, I]: PyTorch's expressions of
// silu(gate) * up under autograd and of the clamp, each operation rounded on its own with the
// accurate exp (swiglu_grad.cuh swiglu_grad_exact, checked on the host). Writes dg, du and h
// (float32 [rows, I] each: the weight gradients' operands) and [dg | du]'s row quantized along
// 2 I (the dgrad's A; the scales blocked [2 I / 128, rows, 4]). I a multiple of 128, so a warp's
// 32 threads lie in one row. gu's rows: GuRows (PaddedF32Rows, or PairBf16Rows with `pair` the
// padded rows' pairs, -1 for padding; pair is not read for PaddedF32Rows).
template <bool kHasClamp, class GuRows>
__global__ void swiglu_backward_kernel(const GuRows gu, const int* __restrict__ pair, const float* __restrict__ dh,
                                       int rows, int inter, float limit, float* __restrict__ dg,
                                       float* __restrict__ du, float* __restrict__ h, uint8_t* __restrict__ codes,
                                       uint8_t* __restrict__ scales) {
  const int per_row = inter / 4;
  const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (idx >= (long long)rows * per_row) return;  // whole warps: rows * per_row is a multiple of 32
  const int r = int(idx / per_row), q = int(idx % per_row);
  float vh[4], vg[4], vu[4];
  swiglu_grad4<kHasClamp>(gu, pair, dh, r, q, inter, limit, vh, vg, vu);
  const size_t at = size_t(r) * inter;
  reinterpret_cast<float4*>(h + at)[q] = make_float4(vh[0], vh[1], vh[2], vh[3]);
  reinterpret_cast<float4*>(dg + at)[q] = make_float4(vg[0], vg[1], vg[2], vg[3]);
  reinterpret_cast<float4*>(du + at)[q] = make_float4(vu[0], vu[1], vu[2], vu[3]);
  const int b = q / 8, nb = inter / mx::kBlock;  // the 32-block of dg (of du: nb + b along 2 I)
  quantize_store_lanes(vg, codes + size_t(r) * 2 * inter, q, scales, rows, r, b);
  quantize_store_lanes(vu, codes + size_t(r) * 2 * inter + inter, q, scales, rows, r, nb + b);
}

// ---- the expert weights for the bf16-math GEMM (mx_gemm.expert_weights, cols_bf16_math) ---------
// Each 32-element block quantized (quantize_block_hw, the oracle's bits) and its MX values written as
// bf16 (E4M3 value times 2^(s - 127) in float32, then rounded: mx.dequantize(...).to(bf16), exact
// unless the scale is near 2^-127 or 2^127), k permuted within each 16 as the GEMM's register
// fragments read A (bf16m: position 2q + (i & 1) + 8 (i >> 1) holds k 4q + i); optionally the codes
// and the scales too, in the grouped kernels' layout [E, K / 128, N, 4].

MOKGEN_DEVICE int bf16m_pos(int j) {  // j < 32: the position of k j within its block
  const int i = j & 3, q = (j >> 2) & 3;
  return (j & 16) + 2 * q + (i & 1) + 8 * (i >> 1);
}

// A block's codes decoded, times the scale's power of two, to bf16 at the bf16-math GEMM's permuted
// positions (bf16m_pos), 64 bytes at dst (16-byte aligned); pair(j) gives codes j and j + 1 as
// a uint16 (code j in the low byte), however the caller holds them.
template <class Pair>
MOKGEN_DEVICE void store_decoded_pairs(Pair pair, uint8_t scale, bf16* dst) {
  const float f = e8m0_factor(scale);
  alignas(16) bf16 out[mx::kBlock];
#pragma unroll
  for (int j = 0; j < mx::kBlock; j += 2) {
    // two codes -> their exact values as f16x2 (every E4M3 value is an f16 value), then float32:
    // one conversion per pair
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pair(j)));
    const float2 two = __half22float2(*reinterpret_cast<const __half2*>(&h2));
    out[bf16m_pos(j)] = __float2bfloat16_rn(two.x * f);
    out[bf16m_pos(j + 1)] = __float2bfloat16_rn(two.y * f);
  }
  const uint4* src = reinterpret_cast<const uint4*>(out);
  uint4* d = reinterpret_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] = src[i];
}

MOKGEN_DEVICE void store_decoded(const uint8_t (&q)[mx::kBlock], uint8_t scale, bf16* dst) {
  store_decoded_pairs([&](int j) { return uint16_t(q[j] | (q[j + 1] << 8)); }, scale, dst);
}

// x [E, n_in, K] bf16 along K -> rows offset .. offset + n_in of each expert's n_out rows: codes
// [E, n_out, K] and scales [E, K / 128, n_out, 4] when given; decoded [E, n_out, K] bf16 (permuted)
// at row (r / dec_block) dec_stride + dec_offset + r % dec_block of the expert's (dec_block =
// n_in, dec_offset = offset: the codes' rows; dec_block = 128, dec_stride = 256, dec_offset = 0
// or 128: gate and up interleaved in 128s for the fused SwiGLU epilogue).
__global__ void weight_rows_kernel(const bf16* __restrict__ x, int experts, int n_in, int k, int n_out, int offset,
                                   int dec_block, int dec_stride, int dec_offset, bf16* __restrict__ decoded,
                                   uint8_t* __restrict__ codes, uint8_t* __restrict__ scales) {
  const int nb = k / mx::kBlock;
  const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (idx >= (long long)experts * n_in * nb) return;
  const long long r = idx / nb;  // e n_in + row
  const int b = int(idx % nb), e = int(r / n_in), local = int(r % n_in), row = offset + local;
  float v[mx::kBlock];
  mx::load_bf16_block(x + size_t(r) * k + b * mx::kBlock, v);
  uint8_t q[mx::kBlock];
  const uint8_t scale = mx::quantize_block_hw(v, q);
  const size_t out_row = size_t(e) * n_out + row;
  if (decoded != nullptr) {
    const size_t dec_row = size_t(e) * n_out + (local / dec_block) * dec_stride + dec_offset + local % dec_block;
    store_decoded(q, scale, decoded + dec_row * k + b * mx::kBlock);
  }
  if (codes != nullptr) {
    store_codes(q, codes + out_row * k + b * mx::kBlock);
    scales[((size_t(e) * (nb / 4) + (b >> 2)) * n_out + row) * 4 + (b & 3)] = scale;
  }
}

// x [E, rows, n] (bf16, or float32 for activations) along its rows, transposed: expert e's [n, rows_out] with the rows at columns
// offset .. offset + rows (the dgrads' weights: W_down^T along H, [W_gate; W_up]^T along 2 I):
// decoded bf16 (permuted); codes and scales [E, rows_out / 128, n, 4] when given. A warp's threads
// take 32 consecutive columns of one 32-row block.
// gather (one expert only; v0.40, the wgrads' x rows): row r of x is x's row gather[r], or zeros
// where gather[r] < 0 (a padding row), so the gathered rows are never written out.
template <class T>
__global__ void weight_cols_kernel(const T* __restrict__ x, int experts, int rows, int n, int rows_out, int offset,
                                   bf16* __restrict__ decoded, uint8_t* __restrict__ codes,
                                   uint8_t* __restrict__ scales, const int* __restrict__ gather = nullptr) {
  const int nb = rows / mx::kBlock;
  const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (idx >= (long long)experts * nb * n) return;
  const int c = int(idx % n), b = int((idx / n) % nb), e = int(idx / ((long long)n * nb));
  float v[mx::kBlock];
  if (gather != nullptr) {
#pragma unroll
    for (int i = 0; i < mx::kBlock; ++i) {
      const int from = gather[b * mx::kBlock + i];
      v[i] = from >= 0 ? float(x[size_t(from) * n + c]) : 0.f;
    }
  } else {
    const T* src = x + size_t(e) * rows * n + size_t(b) * mx::kBlock * n + c;
#pragma unroll
    for (int i = 0; i < mx::kBlock; ++i) v[i] = float(src[size_t(i) * n]);
  }
  uint8_t q[mx::kBlock];
  const uint8_t scale = mx::quantize_block_hw(v, q);
  const size_t out = (size_t(e) * n + c) * rows_out + offset + b * mx::kBlock;
  if (decoded != nullptr) store_decoded(q, scale, decoded + out);
  if (codes != nullptr) {
    store_codes(q, codes + out);
    const int kb = offset / mx::kBlock + b;  // the 32-block along rows_out
    scales[((size_t(e) * (rows_out / 128) + (kb >> 2)) * n + c) * 4 + (kb & 3)] = scale;
  }
}

// ---- the column tiles' quantizer (weight_cols2_kernel below; MOKGEN_MX_QUANT=v2, the default
// since v0.41). v0.37 measured the weights' three quantizations of a kimi-k2.5 local training step
// at 6.8 ms, about half of the memory's rate, and the kernels above spend about 19 instructions per
// element: a 64-bit index division per thread, the non-finite test per element, and the codes
// taken apart into bytes and put back together for the stores and the decode. These helpers keep
// the codes four to a word from the conversion to the stores and test amax alone (non-finite
// exactly when amax's bits reach the infinity's). (v0.39's by-rows kernel on them, a thread per
// block in a 3-D grid, measured 1.05x (H100, v0.40) and 1.10x (H200, v0.41) the time of
// weight_rows_kernel, and was retired in v0.41.)

// quantize_block_hw with the codes four to a word (code 4 i + j in byte j of word i: the byte
// order of store_codes): the same scale and codes.
__device__ __forceinline__ uint8_t quantize_block_words(const float (&v)[mx::kBlock], uint32_t (&w)[mx::kBlock / 4]) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 890
  uint8_t q[mx::kBlock];
  const uint8_t scale = mx::quantize_block(v, q);
  memcpy(w, q, sizeof(q));
  return scale;
#else
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < mx::kBlock; ++i) {
    const uint32_t a = mx::float_bits(v[i]) & 0x7fffffffu;
    amax = a > amax ? a : amax;
  }
  if (amax >= 0x7f800000u) {  // a NaN or an infinity in the block: the NaN scale and NaN codes
#pragma unroll
    for (int i = 0; i < mx::kBlock / 4; ++i) w[i] = 0x7f7f7f7fu;
    return mx::kE8M0Nan;
  }
  float inv;
  const int s = block_scale_exponent(amax, inv);
#pragma unroll
  for (int i = 0; i < mx::kBlock / 4; ++i)
    w[i] = e4m3x4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3], inv);
  return uint8_t(s + 127);
#endif
}

// store_decoded from the codes four to a word (code 4 i + j in byte j of word i).
MOKGEN_DEVICE void store_decoded_words(const uint32_t (&w)[mx::kBlock / 4], uint8_t scale, bf16* dst) {
  store_decoded_pairs([&](int j) { return uint16_t(w[j >> 2] >> (8 * (j & 2))); }, scale, dst);
}

MOKGEN_DEVICE void store_code_words(const uint32_t (&w)[mx::kBlock / 4], uint8_t* dst) {
  uint4* d = reinterpret_cast<uint4*>(dst);
  d[0] = make_uint4(w[0], w[1], w[2], w[3]);
  d[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

template <class T>
struct Pair2;
template <>
struct Pair2<bf16> {
  using type = __nv_bfloat162;
  MOKGEN_DEVICE static float2 get(type p) { return __bfloat1622float2(p); }
};
template <>
struct Pair2<float> {
  using type = float2;
  MOKGEN_DEVICE static float2 get(type p) { return p; }
};

// weight_cols_kernel's work by tiles (v0.40; MOKGEN_MX_QUANT=v2, the default since v0.41): v0.40 measured the columns'
// quantizers at 1.5 TB/s on the H100 against 2.9 for the rows', with v0.39's thread-per-column-pair
// form no faster than v1's. Both read a 32-row block down each column (a 64- or 128-byte piece of
// 32 rows per warp load) and write 64 bytes per column and block, each block's at a time of its
// own. Here a CTA takes a 128-row by 64-column tile of an expert: it loads the tile's rows as
// whole 128-byte (bf16) segments into shared memory, then thread (column, block) quantizes one
// 32-row block of one column, the four blocks of a column by four threads at once, so each column
// gets 256 contiguous bytes of decoded output (and 128 of codes) in one go. The same quantizer
// and stores as v1, so the same bits. n a multiple of 16 bytes' elements (8 bf16, 4 float32),
// x 16-byte aligned (mx_gemm._cols_entry falls back to v1 otherwise). Grid (ceil(n / 64),
// ceil(rows / 128), E), kColThreads (256) threads. gather: as weight_cols_kernel's (one expert).
constexpr int kColTileRows = 128, kColTileCols = 64;

constexpr int kColThreads = 256;  // weight_cols2_kernel's CTA (its launches' blockDim)

// 16 raw bytes as float32: 8 bf16 or 4 float32.
MOKGEN_DEVICE void unpack16(const uint4& raw, float (&v)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 h;
    memcpy(&h, &w[i], 4);
    const float2 f = __bfloat1622float2(h);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
MOKGEN_DEVICE void unpack16(const uint4& raw, float (&v)[4]) {
  v[0] = __uint_as_float(raw.x);
  v[1] = __uint_as_float(raw.y);
  v[2] = __uint_as_float(raw.z);
  v[3] = __uint_as_float(raw.w);
}

// A column tile's rows loaded into shared memory as float32 (weight_cols2_kernel's and
// values_rows_kernel's): rows r0 .. r0 + 127 and columns c0 .. c0 + 63 of x [rows, n] (an expert's
// rows), or with gather row r taken from x's row gather[r]; zeros past the edges and where gather
// is < 0. kScaled (v0.66, with gather): row r's elements each multiplied by row_scale[r] in
// float32, one product rounded once (the MXFP8 backward's dy = w dOut, combine_backward_kernel's
// bits). Every load of the thread is issued before the first is used (v0.41: the loop of load,
// convert, store to shared memory kept one load a thread in flight, and DRAM at about half its
// rate). The caller syncs before reading the tile.
template <class T, int kBufRows, bool kScaled = false>
MOKGEN_DEVICE void load_col_tile(const T* __restrict__ x, int rows, int n, int r0, int c0,
                                 const int* __restrict__ gather, float (&tile)[kBufRows][kColTileCols + 1],
                                 const float* __restrict__ row_scale = nullptr) {
  constexpr int kVec = 16 / int(sizeof(T));              // elements per 16-byte load
  constexpr int kLoadsPerRow = kColTileCols / kVec;
  constexpr int kLoads = kColTileRows * kLoadsPerRow / kColThreads;  // a thread's: 4 (bf16) or 8 (float32)
  uint4 raw[kLoads];
  float scale[kLoads];  // kScaled only
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const int i = threadIdx.x + l * kColThreads;
    const int row = r0 + i / kLoadsPerRow, col = c0 + (i % kLoadsPerRow) * kVec;
    int from = row < rows && col < n ? row : -1;
    if (from >= 0 && gather != nullptr) from = gather[row];
    raw[l] = from >= 0 ? *reinterpret_cast<const uint4*>(x + size_t(from) * n + col)
                       : make_uint4(0u, 0u, 0u, 0u);  // padding rows (gather) and the tile's edges: zeros
    if constexpr (kScaled) scale[l] = from >= 0 ? row_scale[row] : 1.f;
  }
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const int i = threadIdx.x + l * kColThreads;
    const int r = i / kLoadsPerRow, cv = (i % kLoadsPerRow) * kVec;
    float v[kVec];
    unpack16(raw[l], v);
    if constexpr (kScaled) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = __fmul_rn(scale[l], v[j]);
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) tile[r][cv + j] = v[j];
  }
}

//
// kRows (v0.43, MOKGEN_MX_WEIGHTS=both; bf16 weights, decoded values only): the tile's rows are
// quantized too, along n, into row_decoded [E, row_rows, n] at rows row_offset .. row_offset + rows (the
// forward's orientation, weight_rows_kernel's bits with dec_block = rows: no interleave), so one
// read of the weights gives both orientations (6 bytes moved per weight element instead of the
// two kernels' 8). Thread (row t % 128, 32-column block t / 128) takes one row block: a warp's 32
// rows at one column offset hit 32 banks (the tile's rows are 65 floats). Both orientations are
// staged in shared memory and written out whole sectors: the columns as below, the rows 128
// contiguous bytes each (8 lanes a row). n a multiple of 32.
template <class T, bool kRows = false>
__global__ void __launch_bounds__(kColThreads, 4)  // 4 CTAs an SM (their tiles' 132 KB, kRows 140 KB): up to 64 registers
    weight_cols2_kernel(const T* __restrict__ x, int rows, int n, int rows_out, int offset,
                        bf16* __restrict__ decoded, uint8_t* __restrict__ codes, uint8_t* __restrict__ scales,
                        const int* __restrict__ gather = nullptr, bf16* __restrict__ row_decoded = nullptr,
                        int row_rows = 0, int row_offset = 0) {
  // kRows: the staged columns and rows side by side need 35840 bytes, 138 of the tile's 260-byte rows
  constexpr int kBufRows = kRows ? 138 : kColTileRows;
  __shared__ __align__(16) float tile[kBufRows][kColTileCols + 1];  // + 1: a column's reads hit 32 banks
  const int c0 = blockIdx.x * kColTileCols, r0 = blockIdx.y * kColTileRows, e = blockIdx.z;
  load_col_tile(x + size_t(e) * rows * n, rows, n, r0, c0, gather, tile);
  __syncthreads();
  const int c = threadIdx.x % kColTileCols, blk = threadIdx.x / kColTileCols;  // 4 blocks of 32 rows
  const int col = c0 + c, b = r0 / mx::kBlock + blk;
  const bool mine = col < n && b < rows / mx::kBlock;
  float v[mx::kBlock];
#pragma unroll
  for (int i = 0; i < mx::kBlock; ++i) v[i] = tile[blk * mx::kBlock + i][c];
  uint32_t w[mx::kBlock / 4];
  const uint8_t scale = quantize_block_words(v, w);
  const int rr = threadIdx.x % kColTileRows, rb = threadIdx.x / kColTileRows;  // kRows: this thread's row block
  uint32_t rw[mx::kBlock / 4];
  uint8_t rscale = 0;
  if constexpr (kRows) {
    static_assert(kColThreads == 2 * kColTileRows && kColTileCols == 2 * mx::kBlock, "a thread per row block");
#pragma unroll
    for (int i = 0; i < mx::kBlock; ++i) v[i] = tile[rr][rb * mx::kBlock + i];
    rscale = quantize_block_words(v, rw);
  }
  const size_t out = (size_t(e) * n + col) * rows_out + offset + b * mx::kBlock;
  if (mine && codes != nullptr) {
    store_code_words(w, codes + out);
    const int kb = offset / mx::kBlock + b;  // the 32-block along rows_out
    scales[((size_t(e) * (rows_out / 128) + (kb >> 2)) * n + col) * 4 + (kb & 3)] = scale;
  }
  if (decoded == nullptr) return;
  // the decoded values through shared memory (the tile's buffer, free once every thread holds its
  // block): written out a column at a time, 16 lanes to a column's 256 bytes, so every warp store
  // writes whole 32-byte sectors. Stored straight from each thread (v0.40's first tiled form),
  // each warp store wrote 16 bytes into each of 32 rows: ncu counted 3x the sectors written to L2
  // that reached DRAM, and 46% of DRAM's throughput.
  __syncthreads();
  constexpr int kStageRow = kColTileRows + 8;  // bf16 a staged column, padded (16 B) against bank conflicts
  bf16* stage = reinterpret_cast<bf16*>(&tile[0][0]);
  static_assert(kColTileCols * kStageRow * sizeof(bf16) <= sizeof(tile), "the staged columns fit the tile's buffer");
  store_decoded_words(w, scale, stage + c * kStageRow + blk * mx::kBlock);
  constexpr int kRowStageRow = kColTileCols + 8;  // bf16 a staged row, padded (16 B): 8 rows a phase hit 32 banks
  bf16* row_stage = stage + kColTileCols * kStageRow;
  if constexpr (kRows) {
    static_assert((kColTileCols * kStageRow + kColTileRows * kRowStageRow) * sizeof(bf16) <= sizeof(tile),
                  "the staged columns and rows fit the tile's buffer");
    store_decoded_words(rw, rscale, row_stage + rr * kRowStageRow + rb * mx::kBlock);
  }
  __syncthreads();
  const int valid_rows = rows - r0 < kColTileRows ? rows - r0 : kColTileRows;  // a multiple of 32
  constexpr int kChunks = kColTileRows * int(sizeof(bf16)) / 16;               // 16-byte pieces a column
#pragma unroll
  for (int i = threadIdx.x; i < kColTileCols * kChunks; i += kColThreads) {
    const int cc = i / kChunks, chunk = i % kChunks;
    if (c0 + cc >= n || chunk * 8 >= valid_rows) continue;
    const uint4 piece = *reinterpret_cast<const uint4*>(stage + cc * kStageRow + chunk * 8);
    *reinterpret_cast<uint4*>(decoded + (size_t(e) * n + c0 + cc) * rows_out + offset + r0 + chunk * 8) = piece;
  }
  if constexpr (kRows) {
    constexpr int kRowChunks = kColTileCols * int(sizeof(bf16)) / 16;  // 16-byte pieces a row
#pragma unroll
    for (int i = threadIdx.x; i < kColTileRows * kRowChunks; i += kColThreads) {
      const int r = i / kRowChunks, chunk = i % kRowChunks;
      if (r >= valid_rows || c0 + chunk * 8 >= n) continue;
      const uint4 piece = *reinterpret_cast<const uint4*>(row_stage + r * kRowStageRow + chunk * 8);
      *reinterpret_cast<uint4*>(row_decoded + (size_t(e) * row_rows + row_offset + r0 + r) * n + c0 + chunk * 8) = piece;
    }
  }
}

// A block's codes (four to a word) decoded, times the scale's power of two, to bf16 in k's own
// order (store_decoded_words' values without the bf16-math GEMM's permutation).
MOKGEN_DEVICE void decode_block_words(const uint32_t (&w)[mx::kBlock / 4], uint8_t scale, bf16 (&out)[mx::kBlock]) {
  const float f = e8m0_factor(scale);
#pragma unroll
  for (int j = 0; j < mx::kBlock; j += 2) {
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(uint16_t(w[j >> 2] >> (8 * (j & 2)))));
    const float2 two = __half22float2(*reinterpret_cast<const __half2*>(&h2));
    out[j] = __float2bfloat16_rn(two.x * f);
    out[j + 1] = __float2bfloat16_rn(two.y * f);
  }
}

// The MX values of rows quantized along the rows (v0.65, mx_gemm.rows_values): each column's
// 32-row blocks quantized as weight_cols2_kernel quantizes them (the same scales and codes), the
// values written back in x's own layout, row-major and unpermuted: out [rows, n] bf16, row r the
// values of x's row r, or of x's row gather[r] (zeros where gather[r] < 0) when gather is given.
// The operands of the MXFP8 backward's weight gradients on the BF16 backward's weight kernels,
// which take bf16 rows expert by expert. rows a multiple of 32, n of 8 (16-byte loads of x and
// stores of out), x and out 16-byte aligned. Grid (ceil(n / 64), ceil(rows / 128)), kColThreads
// threads. kScaled (v0.66, with gather; load_col_tile): row r's values those of x's row gather[r]
// times row_scale[r] (the MXFP8 backward's dy, made here from dOut and the routing weights instead
// of read as float32 rows).
template <class T, bool kScaled = false>
__global__ void __launch_bounds__(kColThreads, 4)
    values_rows_kernel(const T* __restrict__ x, int rows, int n, bf16* __restrict__ out,
                       const int* __restrict__ gather, const float* __restrict__ row_scale = nullptr) {
  __shared__ __align__(16) float tile[kColTileRows][kColTileCols + 1];
  const int c0 = blockIdx.x * kColTileCols, r0 = blockIdx.y * kColTileRows;
  load_col_tile<T, kColTileRows, kScaled>(x, rows, n, r0, c0, gather, tile, row_scale);
  __syncthreads();
  const int c = threadIdx.x % kColTileCols, blk = threadIdx.x / kColTileCols;  // 4 blocks of 32 rows
  float v[mx::kBlock];
#pragma unroll
  for (int i = 0; i < mx::kBlock; ++i) v[i] = tile[blk * mx::kBlock + i][c];
  uint32_t w[mx::kBlock / 4];
  const uint8_t scale = quantize_block_words(v, w);
  bf16 vals[mx::kBlock];
  decode_block_words(w, scale, vals);
  __syncthreads();  // every thread holds its block: the tile's buffer takes the values, row-major
  constexpr int kStageRow = kColTileCols + 8;  // bf16 a staged row, padded to keep rows 16-byte aligned
  bf16* stage = reinterpret_cast<bf16*>(&tile[0][0]);
  static_assert(kColTileRows * kStageRow * sizeof(bf16) <= sizeof(tile), "the staged rows fit the tile's buffer");
#pragma unroll
  for (int i = 0; i < mx::kBlock; ++i) stage[(blk * mx::kBlock + i) * kStageRow + c] = vals[i];
  __syncthreads();
  const int valid_rows = rows - r0 < kColTileRows ? rows - r0 : kColTileRows;
  constexpr int kChunks = kColTileCols * int(sizeof(bf16)) / 16;  // 16-byte pieces a row
#pragma unroll
  for (int i = threadIdx.x; i < kColTileRows * kChunks; i += kColThreads) {
    const int r = i / kChunks, chunk = i % kChunks;
    if (r >= valid_rows || c0 + chunk * 8 >= n) continue;
    *reinterpret_cast<uint4*>(out + size_t(r0 + r) * n + c0 + chunk * 8) =
        *reinterpret_cast<const uint4*>(stage + r * kStageRow + chunk * 8);
  }
}

// SwiGLU's backward with the weight gradients' operands as MX values (v0.66, mx_gemm.swiglu_backward
// with values_rows; the MXFP8 backward's weight gradients on the BF16 weight kernels): a CTA per 128
// padded rows by 64 columns of I. Each element as swiglu_backward_kernel makes it (the same thread
// layout: a thread per 4 consecutive elements of a row, 8 lanes a 32-block, so [dg | du]'s codes and
// scales along 2 I are that kernel's), but dg, du and h stay in shared memory as float32, and each
// column's 32-row blocks of them are quantized there (values_rows_kernel's quantizer and values) and
// written out as bf16 rows: padded block b (rows 32 b .. 32 b + 31) to rows 32 block_out[b] .. of
// h_out, dg_out and du_out ([out_rows, I] each), not at all where block_out[b] < 0. So none of the
// three float32 [rows, I] is written, nor read again by rows_values. The output's rows from
// *out_end to out_rows (no block's) are zeroed, the column tile's 64 columns by each CTA of the
// column. I a multiple of 64 (of 128 for the codes), rows of 128. Grid (I / 64, rows / 128),
// kColThreads threads, kSwigluColsSmem bytes of dynamic shared memory.
constexpr int kSwigluColsPitch = kColTileCols + 1;  // float32 a staged row (+ 1: a column's reads hit 32 banks)
constexpr int kSwigluColsSmem = 3 * kColTileRows * kSwigluColsPitch * int(sizeof(float));
template <bool kHasClamp, class GuRows>
__global__ void __launch_bounds__(kColThreads, 2)
    swiglu_backward_cols_kernel(const GuRows gu, const int* __restrict__ pair, const float* __restrict__ dh, int rows,
                                int inter, float limit, uint8_t* __restrict__ codes, uint8_t* __restrict__ scales,
                                const int* __restrict__ block_out, const int* __restrict__ out_end, int out_rows,
                                bf16* __restrict__ h_out, bf16* __restrict__ dg_out, bf16* __restrict__ du_out) {
  static_assert(kColThreads == 256 && kColTileRows == 128 && kColTileCols == 64, "the thread layouts below");
  extern __shared__ __align__(16) float sw_smem[];
  float* tiles[3] = {sw_smem, sw_smem + kColTileRows * kSwigluColsPitch, sw_smem + 2 * kColTileRows * kSwigluColsPitch};
  const int c0 = blockIdx.x * kColTileCols, r0 = blockIdx.y * kColTileRows;
  const int nb = inter / mx::kBlock;
  // 1. the elements: 16 threads a row (4 columns each), 16 rows a pass, 8 passes
  const int ql = threadIdx.x % 16, q = c0 / 4 + ql;
#pragma unroll 1
  for (int pass = 0; pass < kColTileRows / 16; ++pass) {
    const int rl = pass * 16 + threadIdx.x / 16, r = r0 + rl;
    float vh[4], vg[4], vu[4];
    swiglu_grad4<kHasClamp>(gu, pair, dh, r, q, inter, limit, vh, vg, vu);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      tiles[0][rl * kSwigluColsPitch + 4 * ql + i] = vh[i];
      tiles[1][rl * kSwigluColsPitch + 4 * ql + i] = vg[i];
      tiles[2][rl * kSwigluColsPitch + 4 * ql + i] = vu[i];
    }
    const int b = q / 8;  // the 32-block of dg along I (of du: nb + b along 2 I)
    quantize_store_lanes(vg, codes + size_t(r) * 2 * inter, q, scales, rows, r, b);
    quantize_store_lanes(vu, codes + size_t(r) * 2 * inter + inter, q, scales, rows, r, nb + b);
  }
  __syncthreads();
  // 2. each column's four 32-row blocks of h, dg and du quantized, their values kept as bf16
  const int c = threadIdx.x % kColTileCols, blk = threadIdx.x / kColTileCols;
  bf16 vals[3][mx::kBlock];
#pragma unroll
  for (int o = 0; o < 3; ++o) {
    float v[mx::kBlock];
#pragma unroll
    for (int i = 0; i < mx::kBlock; ++i) v[i] = tiles[o][(blk * mx::kBlock + i) * kSwigluColsPitch + c];
    uint32_t w[mx::kBlock / 4];
    const uint8_t scale = quantize_block_words(v, w);
    decode_block_words(w, scale, vals[o]);
  }
  __syncthreads();  // every thread holds its blocks: the buffer takes the values as bf16 rows
  constexpr int kStageRow = kColTileCols + 8;  // bf16 a staged row, padded to keep rows 16-byte aligned
  static_assert(3 * kColTileRows * kStageRow * int(sizeof(bf16)) <= kSwigluColsSmem, "the staged rows fit");
  bf16* stage = reinterpret_cast<bf16*>(sw_smem);
#pragma unroll
  for (int o = 0; o < 3; ++o) {
#pragma unroll
    for (int i = 0; i < mx::kBlock; ++i)
      stage[(o * kColTileRows + blk * mx::kBlock + i) * kStageRow + c] = vals[o][i];
  }
  __syncthreads();
  // 3. the rows out, 16-byte pieces (8 a row of the tile), each 32-row block to its place
  // the output of o by selects (an array indexed at run time would live in local memory)
  const auto out_of = [&](int o) { return o == 0 ? h_out : o == 1 ? dg_out : du_out; };
  constexpr int kChunks = kColTileCols * int(sizeof(bf16)) / 16;
  for (int i = threadIdx.x; i < 3 * kColTileRows * kChunks; i += kColThreads) {
    const int o = i / (kColTileRows * kChunks), rl = (i / kChunks) % kColTileRows, chunk = i % kChunks;
    const int ob = block_out[(r0 + rl) / mx::kBlock];
    if (ob < 0) continue;
    *reinterpret_cast<uint4*>(out_of(o) + size_t(ob * mx::kBlock + rl % mx::kBlock) * inter + c0 + chunk * 8) =
        *reinterpret_cast<const uint4*>(stage + (o * kColTileRows + rl) * kStageRow + chunk * 8);
  }
  // 4. the output's rows past the last block: zeros (this column tile's, rows shared among the column's CTAs)
  const int end = *out_end;
  const int tail_rows = out_rows - end;
  if (tail_rows <= 0) return;
  const int per_cta = (tail_rows + gridDim.y - 1) / gridDim.y, first = end + blockIdx.y * per_cta;
  const int n_rows = min(per_cta, out_rows - first);
  for (int i = threadIdx.x; i < 3 * n_rows * kChunks; i += kColThreads) {
    const int o = i / (n_rows * kChunks), rr = first + (i / kChunks) % n_rows, chunk = i % kChunks;
    *reinterpret_cast<uint4*>(out_of(o) + size_t(rr) * inter + c0 + chunk * 8) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// ---- the staged experts' segments on the device, one CTA (mx_experts._segments) -----------------
// From the pairs' expert ids (flat, n = T k), and their stable sort order or none: each pair's row
// in the padded layout (segments in expert order, each a multiple of 128 rows), the source token of
// every padded row (-1: padding), the fixed-length tile list (n_tiles = ceil(n / 128) + E entries,
// (-1, 0) past the segments) and the padded sizes. Ids outside [0, E) are clamped, as the
// PyTorch expression did (experts_forward checks them first unless told not to).
//
// Without the order (E <= kSegMaxUnsorted), the kernel ranks the pairs itself, in the sort's
// order: chunks of 1024 pairs in turn; within a warp, the lanes holding one expert find each other
// (__match_any_sync) and count the lanes before them; across the chunk's 32 warps, a warp's base
// for expert e is the pairs of e in the warps before it (hist [32][E] in shared memory, turned
// into exclusive prefixes by a thread per expert), plus the pairs of e in the chunks before.
constexpr int kSegThreads = 1024;
constexpr int kSegMaxUnsorted = 1024;  // 4 E + 32 E ints of shared memory: 144 KB at 1024

inline size_t segments_smem_bytes(int E, bool sorted) { return size_t(sorted ? 4 : 36) * E * sizeof(int); }

__global__ void __launch_bounds__(kSegThreads, 1)
    segments_kernel(const long long* __restrict__ ids, const long long* __restrict__ order, int n, int k, int E,
                    int n_tiles, long long* __restrict__ row, int* __restrict__ src, int2* __restrict__ tiles,
                    long long* __restrict__ padded_out) {
  extern __shared__ int seg_smem[];  // counts, pairs before, segment starts, tile ends: 4 E ints;
                                     // unsorted: then hist [32][E]
  int* counts = seg_smem;
  int* before = counts + E;
  int* start = before + E;
  int* tile_end = start + E;
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += kSegThreads) counts[e] = 0;
  const int rows = 128 * n_tiles;
  for (int r = tid; r < rows; r += kSegThreads) src[r] = -1;
  __syncthreads();
  auto expert_of = [&](long long id) { return int(id < 0 ? 0 : id >= E ? E - 1 : id); };
  for (int p = tid; p < n; p += kSegThreads) atomicAdd(&counts[expert_of(ids[p])], 1);  // integer: exact
  __syncthreads();
  if (tid == 0) {
    int c = 0, s = 0, t = 0;
    for (int e = 0; e < E; ++e) {
      const int padded = (counts[e] + 127) / 128 * 128;
      before[e] = c;
      start[e] = s;
      c += counts[e];
      s += padded;
      t += padded / 128;
      tile_end[e] = t;
      padded_out[e] = padded;
    }
  }
  __syncthreads();
  if (order != nullptr) {
    // the p-th pair in sorted order (by id, stable) is its expert's (p - before[e])-th row
    for (int p = tid; p < n; p += kSegThreads) {
      const long long i = order[p];
      const int e = expert_of(ids[i]);
      const int r = start[e] + (p - before[e]);
      row[i] = r;
      src[r] = int(i / k);
    }
  } else {
    int* hist = tile_end + E;  // [32][E]
    const int warp = tid >> 5, lane = tid & 31;
    for (int i = tid; i < 32 * E; i += kSegThreads) hist[i] = 0;
    for (int e = tid; e < E; e += kSegThreads) before[e] = 0;  // now: pairs of e in the chunks before
    __syncthreads();
    for (int chunk = 0; chunk < n; chunk += kSegThreads) {
      const int p = chunk + tid;
      const int e = p < n ? expert_of(ids[p]) : E;  // E: no pair
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      const int lanes_before = __popc(peers & ((1u << lane) - 1u));
      if (e < E && lanes_before == 0) hist[warp * E + e] = __popc(peers);
      __syncthreads();
      for (int x = tid; x < E; x += kSegThreads) {  // hist[., x] -> exclusive prefixes, chunk base added
        int acc = before[x];
        for (int w = 0; w < 32; ++w) {
          const int c = hist[w * E + x];
          hist[w * E + x] = acc;
          acc += c;
        }
        before[x] = acc;
      }
      __syncthreads();
      if (e < E) {
        const int r = start[e] + hist[warp * E + e] + lanes_before;
        row[p] = r;
        src[r] = p / k;
      }
      __syncthreads();
      for (int i = tid; i < 32 * E; i += kSegThreads) hist[i] = 0;
      __syncthreads();
    }
  }
  for (int i = tid; i < n_tiles; i += kSegThreads) {
    int lo = 0, hi = E;  // the first expert whose tiles end past i
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (tile_end[mid] <= i) lo = mid + 1; else hi = mid;
    }
    tiles[i] = lo < E ? make_int2(lo, start[lo] + 128 * (i - (tile_end[lo] - (counts[lo] + 127) / 128)))
                      : make_int2(-1, 0);
  }
}

}  // namespace mxg
}  // namespace mokgen
