// Sender-side routing prologue of the expert-parallel megakernel, run by the first n_parts CTAs of
// each rank (n_parts = min(CTAs of the rank, kRouteParts)).
//
// From this rank's top-k ids it builds, in its symmetric region, the expert-major list of its
// (token, j) pairs: send_count[e], send_offset[e] (prefix sums) and send_pairs[] ordered by
// (expert, pair index p = t*K + j). Receivers read these to know which rows to pull. Everything is
// a pure function of the routing, whatever n_parts: part q owns a contiguous range of the pairs.
//   1. routing_count (parts, then a barrier of the rank's CTAs): per-warp histograms of the
//      part's range in shared memory (kept for step 2), the part's totals to part_hist[q][e].
//   2. routing_assign (parts): every part reads all parts' totals: send_count[e] and the pairs
//      of e in earlier parts; a block scan over experts gives send_offset; each warp then walks
//      its contiguous segment in order (ranks within 32 lanes via __match_any_sync), from
//      send_offset[e] + (earlier parts) + (earlier warps of this part).
// One CTA did all of it before v0.6: 131072 pairs (T = 16384, k = 8) took about 0.18 ms while
// the other CTAs waited.
#pragma once

#include "common.cuh"

namespace mokgen {

constexpr int kRouteParts = 32;  // CTAs of a rank that share the routing prologue, at most

// The pair range [p0, p1) of warp `warp` of part `part` (of n_parts) over T x K pairs.
template <int kTopK, int kWarps>
MOKGEN_DEVICE void routing_range(int num_tokens, int part, int n_parts, int warp, int64_t* p0, int64_t* p1) {
  const int64_t pairs = int64_t(num_tokens) * kTopK;
  const int64_t per = ceil_div(pairs, int64_t(n_parts));
  const int64_t q0 = min(pairs, part * per), q1 = min(pairs, q0 + per);
  const int64_t seg = ceil_div(q1 - q0, int64_t(kWarps));
  *p0 = min(q1, q0 + warp * seg);
  *p1 = min(q1, *p0 + seg);
}

// Step 1. smem: kWarps * E int32 (left holding the per-warp histograms for routing_assign).
// All threads of the CTA call it. Ids outside [0, E) are skipped.
template <int kExperts, int kTopK, int kThreads>
MOKGEN_DEVICE void routing_count(const int32_t* __restrict__ ids, int num_tokens, int part, int n_parts,
                                 int32_t* part_hist, int32_t* smem) {
  constexpr int kWarps = kThreads / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int64_t p0, p1;
  routing_range<kTopK, kWarps>(num_tokens, part, n_parts, warp, &p0, &p1);
  int32_t* hist = smem;  // [kWarps][kExperts]
  for (int i = tid; i < kWarps * kExperts; i += kThreads) hist[i] = 0;
  __syncthreads();
#pragma unroll 4  // several id loads in flight before their shared-memory atomics
  for (int64_t p = p0 + lane; p < p1; p += 32) {
    const int32_t id = ids[p];
    if (id >= 0 && id < kExperts) atomicAdd(&hist[warp * kExperts + id], 1);
  }
  __syncthreads();
  for (int e = tid; e < kExperts; e += kThreads) {
    int32_t c = 0;
    for (int w = 0; w < kWarps; ++w) c += hist[w * kExperts + e];
    part_hist[int64_t(part) * kExperts + e] = c;
  }
}

// Step 2, after a barrier that makes every part's part_hist visible. smem: as routing_count
// left it. Part 0 writes send_count and send_offset; every part writes its pairs.
template <int kExperts, int kTopK, int kThreads>
MOKGEN_DEVICE void routing_assign(const int32_t* __restrict__ ids, int num_tokens, int part, int n_parts,
                                  const int32_t* part_hist, int32_t* send_count, int32_t* send_offset,
                                  int32_t* send_pairs, int32_t* smem) {
  constexpr int kWarps = kThreads / 32;
  __shared__ int32_t s_scan[kThreads];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int32_t* hist = smem;  // [kWarps][kExperts], this part's per-warp counts
  // Block scan over experts: thread tid owns experts [tid * per, (tid + 1) * per).
  constexpr int kPer = (kExperts + kThreads - 1) / kThreads;
  int32_t total[kPer], before[kPer];
  int32_t local = 0;
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int e = tid * kPer + q;
    total[q] = before[q] = 0;
    if (e < kExperts)
      for (int r = 0; r < n_parts; ++r) {
        const int32_t c = part_hist[int64_t(r) * kExperts + e];
        total[q] += c;
        if (r < part) before[q] += c;
      }
    local += total[q];
  }
  int32_t all = 0;
  int32_t running = block_exclusive_scan<kThreads>(local, s_scan, &all);  // this thread's first expert's offset
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int e = tid * kPer + q;
    if (e >= kExperts) break;
    if (part == 0) {
      send_offset[e] = running;
      send_count[e] = total[q];
    }
    int32_t base = running + before[q];
    for (int w = 0; w < kWarps; ++w) {  // per-warp bases, in warp (= pair) order
      const int32_t c = hist[w * kExperts + e];
      hist[w * kExperts + e] = base;
      base += c;
    }
    running += total[q];
  }
  if (part == 0 && tid == kThreads - 1) send_offset[kExperts] = all;
  __syncthreads();
  // In-order assignment: each warp owns row `warp` of hist as its cursors. The next round's id is
  // loaded before this round's cursor updates, so the rounds (a __syncwarp each, which no load
  // crosses) do not wait on a global load each.
  int64_t p0, p1;
  routing_range<kTopK, kWarps>(num_tokens, part, n_parts, warp, &p0, &p1);
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
