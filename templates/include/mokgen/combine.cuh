// Stage 4 of the megakernel (ep_forward.cuh): the token owner's reduction. Every (token, j)
// expert output has its own combine slot (pushed by the down projection's epilogue); the owner
// sums them in fp32 in the fixed order j = 0..k-1, weighted by the routing weights, then adds the
// fused shared expert's row (kShared builds: scale[t] * y[t], scale null = 1), and rounds once to
// bf16. Pairs with an id outside [0, E) were dropped by dispatch and are skipped here too.
// Tokens t = cta, cta + G, ... of this CTA; 8 columns (16 bytes) per thread and step.
#pragma once

#include "common.cuh"

namespace mokgen {

template <int kH, int kK, int kE, int kThreads, bool kShared>
MOKGEN_DEVICE void combine_tokens(const bf16* slots, const int32_t* ids, const float* weights, int T, int cta, int G,
                                  const bf16* shared_y, const float* shared_scale, bf16* out) {
  const int tid = threadIdx.x;
  for (int t = cta; t < T; t += G) {
    int32_t id[kK];
    float wt[kK];
#pragma unroll
    for (int j = 0; j < kK; ++j) {
      id[j] = ids[int64_t(t) * kK + j];
      wt[j] = weights[int64_t(t) * kK + j];
    }
    for (int v = tid; v < kH / 8; v += kThreads) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kK; ++j) {
        if (id[j] < 0 || id[j] >= kE) continue;
        float x8[8];
        unpack_bf16x8(*reinterpret_cast<const uint4*>(slots + (int64_t(t) * kK + j) * kH + v * 8), x8);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = fmaf(wt[j], x8[q], acc[q]);
      }
      if constexpr (kShared) {
        if (shared_y != nullptr) {  // + scale[t] * shared expert, after the routed sum
          const float sc = shared_scale != nullptr ? shared_scale[t] : 1.f;
          float y8[8];
          unpack_bf16x8(*reinterpret_cast<const uint4*>(shared_y + int64_t(t) * kH + v * 8), y8);
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[q] = fmaf(sc, y8[q], acc[q]);
        }
      }
      *reinterpret_cast<uint4*>(out + int64_t(t) * kH + v * 8) = pack_bf16x8(acc);
    }
  }
}

}  // namespace mokgen
