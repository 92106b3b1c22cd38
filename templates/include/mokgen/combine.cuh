// Stage 4 of the megakernel (ep_forward.cuh): the token owner's reduction. Every (token, j)
// expert output has its own combine slot (pushed by the down projection's epilogue); the owner
// sums them in fp32 in the fixed order j = 0..k-1, weighted by the routing weights, then adds the
// fused shared expert's row (kShared builds: scale[t] * y[t], scale null = 1), and rounds once to
// bf16. Pairs with an id outside [0, E) were dropped by dispatch and are skipped here too.
// Tokens t = cta, cta + G, ... of this CTA; 8 columns (16 bytes) per item.
#pragma once

#include "common.cuh"

namespace mokgen {

template <int kH, int kK, int kE, int kThreads, bool kShared>
MOKGEN_DEVICE void combine_tokens(const bf16* slots, const int32_t* ids, const float* weights, int T, int cta, int G,
                                  const bf16* shared_y, const float* shared_scale, bf16* out) {
  // The CTA's tokens t = cta + G i as one flat stream of (token, 16-byte column vector) items.
  // Each thread takes kU items at a time and issues all their kU x kK slot loads before it reads
  // a routing id or weight, so kU x kK x 16 bytes are in flight per thread, whatever H and k.
  // (v0.2-v0.4: one token at a time, ids first, one vector per thread: for k = 1 and H = 7168
  // that was three dependent load-then-store rounds per token, about 10% of kimi-k2.5's local
  // workload after the last push.) The items' routing ids and weights (and the shared expert's
  // scale and row) are loaded in the same phase, beside the slots: read per item after the slot loads,
  // each was a dependent global load, kU of them in a row per thread (v0.7). The sum is the same
  // fp32 sequence in the same order, so the bits are unchanged; a dropped pair's slot is read
  // (it is allocated) but not added.
  constexpr int kV = kH / 8;
  // 16 slot loads in flight per thread (k = 1: 16 items); half as many items with a shared
  // expert, whose row is loaded beside them (registers: 16 items of k = 1 with their shared
  // rows spilled 540 bytes)
  constexpr int kU0 = kK >= 16 ? 1 : 16 / kK;
  constexpr int kU = kShared && kU0 > 1 ? kU0 / 2 : kU0;
  if (cta >= T) return;
  const int64_t n_tok = (T - 1 - cta) / G + 1;
  const int64_t total = n_tok * kV;
  for (int64_t f0 = threadIdx.x; f0 < total; f0 += int64_t(kThreads) * kU) {
    uint4 x[kU][kK];
    int32_t id[kU][kK];
    float wt[kU][kK], sc[kU];
    uint4 y[kU];  // the shared expert's row (kShared builds with one)
    int tok[kU], vec[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t f = f0 + int64_t(u) * kThreads;
      tok[u] = -1;
      vec[u] = 0;
      if (f < total) {
        tok[u] = cta + G * int(f / kV);
        vec[u] = int(f % kV);
        const bf16* row = slots + int64_t(tok[u]) * kK * kH + vec[u] * 8;
#pragma unroll
        for (int j = 0; j < kK; ++j) x[u][j] = *reinterpret_cast<const uint4*>(row + int64_t(j) * kH);
#pragma unroll
        for (int j = 0; j < kK; ++j) {
          id[u][j] = __ldg(ids + int64_t(tok[u]) * kK + j);
          wt[u][j] = __ldg(weights + int64_t(tok[u]) * kK + j);
        }
        if constexpr (kShared) {
          if (shared_y != nullptr) {  // written in this launch: a plain load, not the read-only path
            y[u] = *reinterpret_cast<const uint4*>(shared_y + int64_t(tok[u]) * kH + vec[u] * 8);
            sc[u] = shared_scale != nullptr ? __ldg(shared_scale + tok[u]) : 1.f;
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (tok[u] < 0) continue;
      const int64_t t = tok[u];
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kK; ++j) {
        if (id[u][j] < 0 || id[u][j] >= kE) continue;
        const float w = wt[u][j];
        float x8[8];
        unpack_bf16x8(x[u][j], x8);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = fmaf(w, x8[q], acc[q]);
      }
      if constexpr (kShared) {
        if (shared_y != nullptr) {  // + scale[t] * shared expert, after the routed sum
          float y8[8];
          unpack_bf16x8(y[u], y8);
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[q] = fmaf(sc[u], y8[q], acc[q]);
        }
      }
      *reinterpret_cast<uint4*>(out + t * kH + vec[u] * 8) = pack_bf16x8(acc);
    }
  }
}

}  // namespace mokgen
