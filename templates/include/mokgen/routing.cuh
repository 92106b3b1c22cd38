// Routing prologue: from top-k expert ids to an expert-major order of (token, j) pairs.
//
// Every position is a pure function of the routing, never of timing or atomics on floats:
// pairs are numbered p = t * K + j; within one expert they keep increasing p. Three small
// kernels, all integer work:
//   1. route_histogram  per tile of kRouteTile pairs, count pairs per expert      -> hist[tile][e]
//   2. route_scan       one block: per-expert totals, expert offsets (prefix sum), per-tile bases,
//                       and the GEMM tile table (expert, first row) for BM-row tiles
//   3. route_assign     per tile, one warp walks its pairs in order and gives each its position
// Ids outside [0, E) are skipped (the Python layer rejects them before launch).
#pragma once

#include "common.cuh"

namespace mokgen {

struct RoutingBuffers {
  int32_t* hist;           // [num_route_tiles, E]  counts, then (after scan) base positions
  int32_t* expert_offset;  // [E + 1]               first position of each expert; [E] = pairs
  int32_t* tile_expert;    // [max_gemm_tiles]      expert of each BM-row GEMM tile
  int32_t* tile_row;       // [max_gemm_tiles]      first row of the tile inside its expert
  int32_t* num_tiles;      // [1]                   GEMM tiles in use
  int32_t* sorted_token;   // [pairs]               token of the pair at each position
  int32_t* pair_of_pos;    // [pairs]               pair index p = t*K + j at each position
};

template <int kExperts, int kRouteTile>
__global__ void __launch_bounds__(256) route_histogram(const int32_t* __restrict__ ids,
                                                       int64_t num_pairs, RoutingBuffers buf) {
  __shared__ int32_t count[kExperts];
  for (int e = threadIdx.x; e < kExperts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  const int64_t p0 = int64_t(blockIdx.x) * kRouteTile;
  const int64_t p1 = min(num_pairs, p0 + kRouteTile);
  for (int64_t p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
    const int32_t id = ids[p];
    if (id >= 0 && id < kExperts) atomicAdd(&count[id], 1);  // integer: order-independent
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kExperts; e += blockDim.x)
    buf.hist[int64_t(blockIdx.x) * kExperts + e] = count[e];
}

// One block of 1024 threads; thread e owns expert e (kExperts <= 1024, checked by the spec).
template <int kExperts, int kBM>
__global__ void __launch_bounds__(1024) route_scan(int num_route_tiles, RoutingBuffers buf) {
  static_assert(kExperts <= 1024, "route_scan handles at most 1024 experts");
  __shared__ int32_t scan_rows[1024];
  __shared__ int32_t scan_tiles[1024];
  const int e = threadIdx.x;
  int32_t total = 0;
  if (e < kExperts)
    for (int tile = 0; tile < num_route_tiles; ++tile) total += buf.hist[int64_t(tile) * kExperts + e];
  const int32_t tiles = int32_t(ceil_div(total, kBM));
  scan_rows[e] = total;
  scan_tiles[e] = tiles;
  __syncthreads();
  // Hillis-Steele inclusive scan over 1024 entries.
  for (int d = 1; d < 1024; d <<= 1) {
    const int32_t r = e >= d ? scan_rows[e - d] : 0;
    const int32_t t = e >= d ? scan_tiles[e - d] : 0;
    __syncthreads();
    scan_rows[e] += r;
    scan_tiles[e] += t;
    __syncthreads();
  }
  if (e >= kExperts) return;
  const int32_t first_row = scan_rows[e] - total;
  const int32_t first_tile = scan_tiles[e] - tiles;
  buf.expert_offset[e] = first_row;
  if (e == kExperts - 1) {
    buf.expert_offset[kExperts] = scan_rows[e];
    buf.num_tiles[0] = scan_tiles[e];
  }
  int32_t running = first_row;
  for (int tile = 0; tile < num_route_tiles; ++tile) {
    int32_t* h = buf.hist + int64_t(tile) * kExperts + e;
    const int32_t c = *h;
    *h = running;
    running += c;
  }
  for (int i = 0; i < tiles; ++i) {
    buf.tile_expert[first_tile + i] = e;
    buf.tile_row[first_tile + i] = i * kBM;
  }
}

// One warp per route tile walks its pairs 32 at a time, in order.
template <int kExperts, int kTopK, int kRouteTile>
__global__ void __launch_bounds__(32) route_assign(const int32_t* __restrict__ ids, int64_t num_pairs,
                                                   RoutingBuffers buf) {
  __shared__ int32_t cursor[kExperts];
  const int lane = threadIdx.x;
  for (int e = lane; e < kExperts; e += 32) cursor[e] = buf.hist[int64_t(blockIdx.x) * kExperts + e];
  __syncwarp();
  const int64_t p0 = int64_t(blockIdx.x) * kRouteTile;
  const int64_t p1 = min(num_pairs, p0 + kRouteTile);
  for (int64_t base = p0; base < p1; base += 32) {
    const int64_t p = base + lane;
    const int32_t id = p < p1 ? ids[p] : -1;
    const bool valid = id >= 0 && id < kExperts;
    const int32_t key = valid ? id : -1 - lane;  // invalid lanes never group together
    const uint32_t peers = __match_any_sync(0xffffffffu, key);
    const int32_t rank = __popc(peers & ((1u << lane) - 1u));
    const int32_t start = valid ? cursor[id] : 0;
    __syncwarp();
    if (valid) {
      const int32_t pos = start + rank;
      buf.sorted_token[pos] = int32_t(p / kTopK);
      buf.pair_of_pos[pos] = int32_t(p);
      if (rank == 0) cursor[id] = start + __popc(peers);
    }
    __syncwarp();
  }
}

}  // namespace mokgen
