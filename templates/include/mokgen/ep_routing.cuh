// Sender-side routing prologue of the expert-parallel megakernel, run by one CTA of each rank.
//
// From this rank's top-k ids it builds, in its symmetric region, the expert-major list of its
// (token, j) pairs: send_count[e], send_offset[e] (prefix sums) and send_pairs[] ordered by
// (expert, pair index p = t*K + j). Receivers read these to know which rows to pull. Everything is
// a pure function of the routing: per-warp histograms (integer), a block scan, then each warp
// walks its contiguous segment of pairs in order (ranks within 32 lanes via __match_any_sync).
#pragma once

#include "common.cuh"

namespace mokgen {

// smem: kWarps * E int32. All threads of the CTA call it. Ids outside [0, E) are skipped.
template <int kExperts, int kTopK, int kThreads>
MOKGEN_DEVICE void sender_routing(const int32_t* __restrict__ ids, int num_tokens, int32_t* send_count,
                                  int32_t* send_offset, int32_t* send_pairs, int32_t* smem) {
  constexpr int kWarps = kThreads / 32;
  __shared__ int32_t s_scan[kThreads];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t pairs = int64_t(num_tokens) * kTopK;
  const int64_t seg = ceil_div(pairs, kWarps);
  const int64_t p0 = min(pairs, warp * seg), p1 = min(pairs, p0 + seg);
  int32_t* hist = smem;  // [kWarps][kExperts]
  for (int i = tid; i < kWarps * kExperts; i += kThreads) hist[i] = 0;
  __syncthreads();
#pragma unroll 4  // several id loads in flight before their shared-memory atomics
  for (int64_t p = p0 + lane; p < p1; p += 32) {
    const int32_t id = ids[p];
    if (id >= 0 && id < kExperts) atomicAdd(&hist[warp * kExperts + id], 1);
  }
  __syncthreads();
  // Block scan over experts: thread tid owns experts [tid * per, (tid + 1) * per).
  constexpr int kPer = (kExperts + kThreads - 1) / kThreads;
  int32_t local = 0;
  for (int q = 0; q < kPer; ++q) {
    const int e = tid * kPer + q;
    if (e < kExperts)
      for (int w = 0; w < kWarps; ++w) local += hist[w * kExperts + e];
  }
  s_scan[tid] = local;
  __syncthreads();
  for (int d = 1; d < kThreads; d <<= 1) {
    const int32_t v = tid >= d ? s_scan[tid - d] : 0;
    __syncthreads();
    s_scan[tid] += v;
    __syncthreads();
  }
  int32_t running = s_scan[tid] - local;  // exclusive prefix of this thread's first expert
  for (int q = 0; q < kPer; ++q) {
    const int e = tid * kPer + q;
    if (e >= kExperts) break;
    send_offset[e] = running;
    int32_t total = 0;
    for (int w = 0; w < kWarps; ++w) {  // per-warp bases, in warp (= pair) order
      const int32_t c = hist[w * kExperts + e];
      hist[w * kExperts + e] = running + total;
      total += c;
    }
    send_count[e] = total;
    running += total;
  }
  if (tid == kThreads - 1) send_offset[kExperts] = s_scan[tid];
  __syncthreads();
  // In-order assignment: each warp owns row `warp` of hist as its cursors. The next round's id is
  // loaded before this round's cursor updates, so the rounds (a __syncwarp each, which no load
  // crosses) do not wait on a global load each: one CTA does this for all T x k pairs of the
  // rank while the others wait (131072 pairs, 341 rounds per warp, for T = 16384 and k = 8).
  int32_t* cursor = hist + warp * kExperts;
  int32_t id_next = p0 + lane < p1 ? ids[p0 + lane] : -1;
  for (int64_t base = p0; base < p1; base += 32) {
    const int64_t p = base + lane;
    const int32_t id = id_next;
    id_next = base + 32 + lane < p1 ? ids[base + 32 + lane] : -1;
    const bool valid = id >= 0 && id < kExperts;
    const uint32_t peers = __match_any_sync(0xffffffffu, valid ? id : -1 - lane);
    const int32_t rank = __popc(peers & ((1u << lane) - 1u));
    const int32_t start = valid ? cursor[id] : 0;
    __syncwarp();
    if (valid) {
      send_pairs[start + rank] = int32_t(p);
      if (rank == 0) cursor[id] = start + __popc(peers);
    }
    __syncwarp();
  }
}

}  // namespace mokgen
