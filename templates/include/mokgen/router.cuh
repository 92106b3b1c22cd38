// Router selection: router logits [T, E] (fp32) -> top-k expert ids [T, k], per the spec's rules
// (mokgen/reference.py, `route`): selection scores are the scores (softmax, sigmoid or
// sqrt(softplus) of the logits) plus the score-correction bias when the spec has one; with
// n_group > 1 only the topk_group best groups (scored by their top-2 sum or max) are eligible;
// the k best eligible experts in descending order. Ties, of groups or experts: the lowest index
// wins. The combine weights are not computed here: mokgen.router gathers them from the logits in
// PyTorch (differentiable), so the gradient to the gate weights and the hidden states comes
// from autograd.
//
// One warp per token. Lane l holds experts l, l + 32, l + 64, ...; group scores and the top-k
// come from warp butterfly reductions that every lane ends with, so every lane makes the same
// decisions and no shared memory is needed. Scores use the accurate expf/log1pf; selection can
// still differ from PyTorch's where two different scores round to within an ulp of each other
// (a near-tie), never on exact ties.
#pragma once

#include "common.cuh"

#include <math_constants.h>

namespace mokgen {

enum RouterScoring : int { kScoreSoftmax = 0, kScoreSigmoid = 1, kScoreSqrtSoftplus = 2 };

// (a, ia) ranks before (b, ib): larger value first, on a tie the lower index.
MOKGEN_DEVICE bool ranks_before(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

template <int kE, int kK, int kScoring, bool kBias, int kNGroup, int kTopKGroup, bool kTop2Sum>
struct RouterSelect {
  static constexpr int kPer = (kE + 31) / 32;  // experts per lane
  static constexpr int kPerGroup = kE / kNGroup;
  static_assert(kE % kNGroup == 0, "groups must divide the experts");
  static_assert(kK >= 1 && kK <= kE, "top-k out of range");
  static_assert(kNGroup <= 64, "at most 64 groups (a 64-bit mask)");
  static_assert(kPer <= 32, "at most 1024 experts (a 32-bit mask of retired experts per lane)");
  static_assert(kTopKGroup >= 1 && kTopKGroup <= kNGroup, "topk_group out of range");

  // Selection value of one expert from its logit (softmax needs the row's max and sum).
  MOKGEN_DEVICE static float score(float logit, float row_max, float inv_sum) {
    if constexpr (kScoring == kScoreSoftmax) {
      return expf(logit - row_max) * inv_sum;
    } else if constexpr (kScoring == kScoreSigmoid) {
      return 1.f / (1.f + expf(-logit));
    } else {
      const float sp = logit > 20.f ? logit : log1pf(expf(logit));  // softplus, as torch's threshold
      return sqrtf(sp);
    }
  }

  MOKGEN_DEVICE static void run(const float* __restrict__ logits, const float* __restrict__ bias, int T,
                                int32_t* __restrict__ ids) {
    const int token = int((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (token >= T) return;  // whole warps leave together
    const float* row = logits + int64_t(token) * kE;
    float v[kPer];
#pragma unroll
    for (int s = 0; s < kPer; ++s) {
      const int e = lane + 32 * s;
      v[s] = e < kE ? row[e] : -CUDART_INF_F;
    }
    // Without a bias, softmax ranks experts as the logits do (the same order, no rounding), and
    // groups too when they are scored by their max; a top-2 SUM of probabilities is not ranked
    // like a sum of logits, so group-limited top2_sum needs the probabilities.
    constexpr bool kRaw = kScoring == kScoreSoftmax && !kBias && (kNGroup == 1 || !kTop2Sum);
    if constexpr (!kRaw) {
      float row_max = -CUDART_INF_F, inv_sum = 1.f;
      if constexpr (kScoring == kScoreSoftmax) {
#pragma unroll
        for (int s = 0; s < kPer; ++s) row_max = fmaxf(row_max, v[s]);
        for (int o = 16; o > 0; o >>= 1) row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, o));
        float sum = 0.f;
#pragma unroll
        for (int s = 0; s < kPer; ++s)
          if (lane + 32 * s < kE) sum += expf(v[s] - row_max);
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        inv_sum = 1.f / sum;
      }
#pragma unroll
      for (int s = 0; s < kPer; ++s) {
        const int e = lane + 32 * s;
        if (e < kE) v[s] = score(v[s], row_max, inv_sum) + (kBias ? bias[e] : 0.f);
      }
    }
    if constexpr (kNGroup > 1) {
      // group scores: every lane ends with all of them
      unsigned long long keep = 0;
      float gs[kNGroup];
#pragma unroll
      for (int g = 0; g < kNGroup; ++g) {
        float a1 = -CUDART_INF_F, a2 = -CUDART_INF_F;  // this lane's best two in group g
#pragma unroll
        for (int s = 0; s < kPer; ++s) {
          const int e = lane + 32 * s;
          if (e < kE && e / kPerGroup == g) {
            if (v[s] > a1) { a2 = a1; a1 = v[s]; } else if (v[s] > a2) { a2 = v[s]; }
          }
        }
        for (int o = 16; o > 0; o >>= 1) {
          const float b1 = __shfl_xor_sync(0xffffffffu, a1, o), b2 = __shfl_xor_sync(0xffffffffu, a2, o);
          const float hi = fmaxf(a1, b1), lo = fmaxf(fminf(a1, b1), fmaxf(a2, b2));
          a1 = hi;
          a2 = lo;
        }
        gs[g] = kTop2Sum ? a1 + a2 : a1;
      }
#pragma unroll 1
      for (int r = 0; r < kTopKGroup; ++r) {  // the topk_group best groups, lowest index on ties
        int best = -1;
        for (int g = 0; g < kNGroup; ++g)
          if (!(keep >> g & 1ull) && (best < 0 || ranks_before(gs[g], g, gs[best], best))) best = g;
        keep |= 1ull << best;
      }
#pragma unroll
      for (int s = 0; s < kPer; ++s) {
        const int e = lane + 32 * s;
        if (e < kE && !(keep >> (e / kPerGroup) & 1ull)) v[s] = -CUDART_INF_F;
      }
    }
    // top-k: k rounds of a warp arg-max; the winner's lane retires that expert (a bit, not a
    // value: an eligible expert may itself score -inf)
    unsigned taken = 0;
#pragma unroll 1
    for (int j = 0; j < kK; ++j) {
      float bv = 0.f;
      int bi = 0x7fffffff;  // none yet: anything ranks before it
#pragma unroll
      for (int s = 0; s < kPer; ++s) {
        const int e = lane + 32 * s;
        if (e < kE && !(taken >> s & 1u) && (bi == 0x7fffffff || ranks_before(v[s], e, bv, bi))) { bv = v[s]; bi = e; }
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi != 0x7fffffff && (bi == 0x7fffffff || ranks_before(ov, oi, bv, bi))) { bv = ov; bi = oi; }
      }
#pragma unroll
      for (int s = 0; s < kPer; ++s)
        if (lane + 32 * s == bi) taken |= 1u << s;
      if (lane == 0) ids[int64_t(token) * kK + j] = bi;
    }
  }
};

template <class Sel>
__global__ void __launch_bounds__(256) route_select_kernel(const float* logits, const float* bias, int T, int32_t* ids) {
  Sel::run(logits, bias, T, ids);
}

}  // namespace mokgen
