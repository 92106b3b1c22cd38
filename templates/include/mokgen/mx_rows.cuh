// The staged MXFP8 experts' row kernels (issue 6, mokgen.mx_experts; launched from
// templates/mx_gemm.cu): the rows gathered and quantized, SwiGLU with h quantized, the combine.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.cuh"
#include "mx.cuh"

namespace mokgen {
namespace mxg {

// ---- the staged MXFP8 experts' quantizers (mokgen.mx_experts): one thread per 32-element block,
// mx.cuh's quantize_block (bit for bit the oracle), the scales written straight into the GEMM's
// blocked layout [K / 128, rows, 4] -------------------------------------------------------------

MOKGEN_DEVICE void store_block(const uint8_t (&q)[mx::kBlock], uint8_t scale, uint8_t* codes, uint8_t* scales,
                               int r, int b, int rows, int k) {
  uint4 w[2];
  memcpy(w, q, sizeof(q));
  uint4* dst = reinterpret_cast<uint4*>(codes + size_t(r) * k + b * mx::kBlock);
  dst[0] = w[0];
  dst[1] = w[1];
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
    const uint4* p = reinterpret_cast<const uint4*>(x + size_t(from) * h + b * mx::kBlock);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 w = p[i];
      const bf16* e = reinterpret_cast<const bf16*>(&w);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[8 * i + j] = __bfloat162float(e[j]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < mx::kBlock; ++i) v[i] = 0.f;
  }
  uint8_t q[mx::kBlock];
  const uint8_t scale = mx::quantize_block(v, q);
  store_block(q, scale, codes, scales, r, b, rows, h);
}

// h = swiglu(gate, up) of the float32 gate | up rows gu [rows, 2 I] (common.cuh's swiglu, the
// megakernel's), quantized along I.
template <bool kHasClamp>
__global__ void swiglu_quantize_kernel(const float* __restrict__ gu, int rows, int inter, float limit,
                                       uint8_t* __restrict__ codes, uint8_t* __restrict__ scales) {
  const int nb = inter / mx::kBlock;
  const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (idx >= (long long)rows * nb) return;
  const int r = int(idx / nb), b = int(idx % nb);
  const float4* g = reinterpret_cast<const float4*>(gu + size_t(r) * 2 * inter + b * mx::kBlock);
  const float4* u = reinterpret_cast<const float4*>(gu + size_t(r) * 2 * inter + inter + b * mx::kBlock);
  float v[mx::kBlock];
#pragma unroll
  for (int i = 0; i < mx::kBlock / 4; ++i) {
    const float4 gv = g[i], uv = u[i];
    v[4 * i] = swiglu<kHasClamp>(gv.x, uv.x, limit);
    v[4 * i + 1] = swiglu<kHasClamp>(gv.y, uv.y, limit);
    v[4 * i + 2] = swiglu<kHasClamp>(gv.z, uv.z, limit);
    v[4 * i + 3] = swiglu<kHasClamp>(gv.w, uv.w, limit);
  }
  uint8_t q[mx::kBlock];
  const uint8_t scale = mx::quantize_block(v, q);
  store_block(q, scale, codes, scales, r, b, rows, inter);
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
  const uint8_t scale = mx::quantize_block(v, q);
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
  const uint8_t scale = mx::quantize_block(v, q);
  uint4 w[2];
  memcpy(w, q, sizeof(q));
  uint4* dst = reinterpret_cast<uint4*>(codes + size_t(c) * rows + b * mx::kBlock);
  dst[0] = w[0];
  dst[1] = w[1];
  scales[size_t(c) * nb + b] = scale;
}

}  // namespace mxg
}  // namespace mokgen
