// The single-rank (EP = 1) routed-expert forward: routing prologue, gated up projection with
// SwiGLU, down projection into per-(token, j) slots, fixed-order combine. Six launches on one
// stream; no host synchronization, no host-side sizing beyond the token count.
//
// Compile-time specialization comes in as `Cfg` (see the generated moe_forward.cu); run-time
// values (pointers, token count, stream) come in as ForwardArgs.
#pragma once

#include "combine.cuh"
#include "grouped_gemm.cuh"
#include "routing.cuh"

namespace mokgen {

struct ForwardArgs {
  const bf16* x;              // [T, H]
  const int32_t* topk_ids;    // [T, K]
  const float* topk_weights;  // [T, K]
  const bf16* w_gate;         // [E, I, H]
  const bf16* w_up;           // [E, I, H]
  const bf16* w_down;         // [E, H, I]
  bf16* out;                  // [T, H]
  void* workspace;            // workspace_bytes(T) bytes, 256-byte aligned
  int64_t num_tokens;
  cudaStream_t stream;
};

// Byte offsets of every scratch buffer inside the workspace, a pure function of T.
template <class Cfg>
struct WorkspaceLayout {
  size_t hist, expert_offset, tile_expert, tile_row, num_tiles, sorted_token, pair_of_pos, h, slots;
  size_t total;
  int64_t pairs, route_tiles, max_gemm_tiles;

  __host__ explicit WorkspaceLayout(int64_t num_tokens) {
    pairs = num_tokens * Cfg::kTopK;
    route_tiles = ceil_div(pairs, Cfg::kRouteTile);
    max_gemm_tiles = ceil_div(pairs, 128) + Cfg::kExperts;  // sum over experts of ceil(rows/128)
    size_t at = 0;
    auto take = [&](size_t bytes) {
      const size_t here = at;
      at = align_up(at + bytes, 256);
      return here;
    };
    hist = take(sizeof(int32_t) * route_tiles * Cfg::kExperts);
    expert_offset = take(sizeof(int32_t) * (Cfg::kExperts + 1));
    tile_expert = take(sizeof(int32_t) * max_gemm_tiles);
    tile_row = take(sizeof(int32_t) * max_gemm_tiles);
    num_tiles = take(sizeof(int32_t));
    sorted_token = take(sizeof(int32_t) * pairs);
    pair_of_pos = take(sizeof(int32_t) * pairs);
    h = take(sizeof(bf16) * pairs * Cfg::kInter);
    slots = take(sizeof(bf16) * pairs * Cfg::kHidden);
    total = at;
  }
};

template <class Cfg>
struct ForwardEp1 {
  using Up = GemmTile<Cfg::kInter, Cfg::kHidden, true, Cfg::kHasClamp, Cfg::kStages>;
  using Down = GemmTile<Cfg::kHidden, Cfg::kInter, false, Cfg::kHasClamp, Cfg::kStages>;

  static size_t workspace_bytes(int64_t num_tokens) { return WorkspaceLayout<Cfg>(num_tokens).total; }

  static cudaError_t run(const ForwardArgs& a) {
    if (a.num_tokens < 0) return cudaErrorInvalidValue;
    if (a.num_tokens == 0) return cudaSuccess;
    const WorkspaceLayout<Cfg> L(a.num_tokens);
    char* ws = static_cast<char*>(a.workspace);
    RoutingBuffers rb{reinterpret_cast<int32_t*>(ws + L.hist),
                      reinterpret_cast<int32_t*>(ws + L.expert_offset),
                      reinterpret_cast<int32_t*>(ws + L.tile_expert),
                      reinterpret_cast<int32_t*>(ws + L.tile_row),
                      reinterpret_cast<int32_t*>(ws + L.num_tiles),
                      reinterpret_cast<int32_t*>(ws + L.sorted_token),
                      reinterpret_cast<int32_t*>(ws + L.pair_of_pos)};
    bf16* h = reinterpret_cast<bf16*>(ws + L.h);
    bf16* slots = reinterpret_cast<bf16*>(ws + L.slots);

    auto up_kernel = grouped_gemm_kernel<Cfg::kInter, Cfg::kHidden, true, Cfg::kHasClamp, Cfg::kStages>;
    auto down_kernel = grouped_gemm_kernel<Cfg::kHidden, Cfg::kInter, false, Cfg::kHasClamp, Cfg::kStages>;
    cudaError_t err;
    // Cheap and idempotent; done every call so a new device or context is always covered.
    if ((err = cudaFuncSetAttribute(up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(Up::kSmemBytes))) != cudaSuccess)
      return err;
    if ((err = cudaFuncSetAttribute(down_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(Down::kSmemBytes))) != cudaSuccess)
      return err;

    const int rt = int(L.route_tiles);
    route_histogram<Cfg::kExperts, Cfg::kRouteTile><<<rt, 256, 0, a.stream>>>(a.topk_ids, L.pairs, rb);
    route_scan<Cfg::kExperts, Up::kBM><<<1, 1024, 0, a.stream>>>(rt, rb);
    route_assign<Cfg::kExperts, Cfg::kTopK, Cfg::kRouteTile><<<rt, 32, 0, a.stream>>>(a.topk_ids, L.pairs, rb);

    const unsigned grid_m = unsigned(L.max_gemm_tiles < 65535 ? L.max_gemm_tiles : 65535);
    GemmArgs up{a.x, rb.sorted_token, a.w_gate, a.w_up, h, nullptr,
                rb.expert_offset, rb.tile_expert, rb.tile_row, rb.num_tiles};
    up_kernel<<<dim3(Up::kNTiles, grid_m), Up::kThreads, Up::kSmemBytes, a.stream>>>(up, Cfg::kClampLimit);
    GemmArgs down{h, nullptr, a.w_down, nullptr, slots, rb.pair_of_pos,
                  rb.expert_offset, rb.tile_expert, rb.tile_row, rb.num_tiles};
    down_kernel<<<dim3(Down::kNTiles, grid_m), Down::kThreads, Down::kSmemBytes, a.stream>>>(down, 0.f);

    combine_kernel<Cfg::kHidden, Cfg::kTopK, Cfg::kExperts><<<unsigned(a.num_tokens), 256, 0, a.stream>>>(
        slots, a.topk_ids, a.topk_weights, a.out);
    return cudaGetLastError();
  }
};

}  // namespace mokgen
