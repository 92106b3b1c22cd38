// Combine: out[t] = sum_{j = 0..K-1} w[t, j] * slot[t, j], in fp32, in fixed j order.
// Each (token, j) result sits in its own bf16 slot (written by the down projection), so no float
// atomics are involved and the bits do not depend on which CTA finished first.
#pragma once

#include "common.cuh"

namespace mokgen {

template <int kHidden, int kTopK, int kExperts>
__global__ void __launch_bounds__(256) combine_kernel(const bf16* __restrict__ slots,
                                                      const int32_t* __restrict__ ids,
                                                      const float* __restrict__ weights,
                                                      bf16* __restrict__ out) {
  static_assert(kHidden % 8 == 0, "hidden must be a multiple of 8");
  const int64_t t = blockIdx.x;
  int32_t id[kTopK];
  float w[kTopK];
#pragma unroll
  for (int j = 0; j < kTopK; ++j) {
    id[j] = ids[t * kTopK + j];
    w[j] = weights[t * kTopK + j];
  }
  for (int c = threadIdx.x; c < kHidden / 8; c += blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kTopK; ++j) {
      if (id[j] < 0 || id[j] >= kExperts) continue;
      float v[8];
      unpack_bf16x8(*reinterpret_cast<const uint4*>(slots + (t * kTopK + j) * kHidden + c * 8), v);
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] = fmaf(w[j], v[q], acc[q]);
    }
    *reinterpret_cast<uint4*>(out + t * kHidden + c * 8) = pack_bf16x8(acc);
  }
}

}  // namespace mokgen
