// Grouped expert GEMM over ragged per-expert row ranges (mma.sync m16n8k16, bf16 -> fp32).
//
// C[rows of expert e] = A[rows] * B[e]^T with B stored [N, K] (K contiguous), as the Hugging Face
// expert weights are. Two epilogues, chosen at compile time:
//   kGated = true   up projection: B tile = 64 rows of w_gate[e] and the same 64 rows of w_up[e], so
//                   one tile holds matching gate/up columns; SwiGLU in registers; writes h[pos, :].
//                   A rows are gathered: A row of position pos is x[a_row_index[pos]].
//   kGated = false  down projection: B = w_down[e]; writes the bf16 row of position pos to the
//                   combine slot c_row_index[pos] (the pair index t*K + j).
// Tiles: BM = 128 rows x 128 B-rows x BK = 64, 8 warps (4 along M x 2 along N), a STAGES-deep
// cp.async pipeline, 128-byte smem rows with the 16-byte chunks XOR-swizzled by (row & 7) so
// ldmatrix is conflict-free. K is never split, so results do not depend on scheduling.
// This is the portable first GEMM (sm_80+ instructions); the TMA + wgmma core replaces it.
#pragma once

#include "common.cuh"

namespace mokgen {

struct GemmArgs {
  const bf16* A;                 // [*, K]
  const int32_t* a_row_index;    // gated: A row of each position; nullptr: row = position
  const bf16* B0;                // [E, N, K]  (w_gate or w_down)
  const bf16* B1;                // [E, N, K]  (w_up; gated only)
  bf16* C;                       // gated: [pairs, N]; down: [pairs, N] indexed by c_row_index
  const int32_t* c_row_index;    // down: destination row of each position; nullptr: row = position
  const int32_t* expert_offset;  // [E + 1]
  const int32_t* tile_expert;    // [max tiles]
  const int32_t* tile_row;       // [max tiles]
  const int32_t* num_tiles;      // [1]
};

template <int kN, int kK, bool kGated, bool kHasClamp, int kStages>
struct GroupedGemm {
  static constexpr int kBM = 128;
  static constexpr int kBNB = 128;                   // B rows per tile
  static constexpr int kBN = kGated ? kBNB / 2 : kBNB;  // output columns per tile
  static constexpr int kBK = 64;
  static constexpr int kThreads = 256;
  static constexpr int kChunks = kBK / 8;            // 16-byte chunks per smem row
  static constexpr int kStageElems = (kBM + kBNB) * kBK;
  static constexpr size_t kSmemBytes = size_t(kStages) * kStageElems * sizeof(bf16);
  static constexpr int kKTiles = kK / kBK;
  static constexpr int kNTiles = kN / kBN;
  static_assert(kK % kBK == 0, "K must be a multiple of 64");
  static_assert(kN % kBN == 0, "N must be a multiple of the output tile");
  static_assert(kKTiles >= 1, "K too small");

  // Byte-free element offset of (row, 16-byte chunk) inside one smem operand tile.
  MOKGEN_DEVICE static int swz(int row, int chunk) { return row * kBK + ((chunk ^ (row & 7)) << 3); }

  // First B row of n8 sub-tile j (0..7) of warp column wn.
  MOKGEN_DEVICE static int b_row(int wn, int j) {
    if constexpr (kGated) return (j < 4 ? 0 : kBNB / 2) + wn * 32 + (j & 3) * 8;
    else return wn * 64 + j * 8;
  }
};

template <int kN, int kK, bool kGated, bool kHasClamp, int kStages>
__global__ void __launch_bounds__(256) grouped_gemm_kernel(GemmArgs args, float clamp_limit) {
  using G = GroupedGemm<kN, kK, kGated, kHasClamp, kStages>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp & 3;   // 32-row slab
  const int wn = warp >> 2;  // column half
  const int n0 = blockIdx.x * G::kBN;
  const int num_tiles = *args.num_tiles;

  for (int tile = blockIdx.y; tile < num_tiles; tile += gridDim.y) {
    const int e = args.tile_expert[tile];
    const int row0 = args.expert_offset[e] + args.tile_row[tile];
    const int rows = min(G::kBM, args.expert_offset[e + 1] - row0);

    // Per-thread source pointers: 4 A chunks and 4 B chunks per stage.
    const bf16* a_src[4];
    bool a_ok[4];
    const bf16* b_src[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = tid + i * G::kThreads;
      const int r = c / G::kChunks, kc = c % G::kChunks;
      a_ok[i] = r < rows;
      int64_t arow = 0;
      if (a_ok[i]) arow = args.a_row_index ? args.a_row_index[row0 + r] : int64_t(row0 + r);
      a_src[i] = args.A + arow * kK + kc * 8;
      const bf16* bbase;
      int brow;
      if constexpr (kGated) {
        bbase = r < G::kBNB / 2 ? args.B0 : args.B1;
        brow = n0 + (r % (G::kBNB / 2));
      } else {
        bbase = args.B0;
        brow = n0 + r;
      }
      b_src[i] = bbase + (int64_t(e) * kN + brow) * kK + kc * 8;
    }

    auto load_stage = [&](int stage, int ktile) {
      bf16* sa = smem + stage * G::kStageElems;
      bf16* sb = sa + G::kBM * G::kBK;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = tid + i * G::kThreads;
        const int r = c / G::kChunks, kc = c % G::kChunks;
        cp_async_16(sa + G::swz(r, kc), a_src[i] + ktile * G::kBK, a_ok[i]);
        cp_async_16(sb + G::swz(r, kc), b_src[i] + ktile * G::kBK, true);
      }
    };

    float acc[2][8][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[mi][j][q] = 0.f;

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < G::kKTiles) load_stage(s, s);
      cp_async_commit();
    }

    for (int kt = 0; kt < G::kKTiles; ++kt) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      const int next = kt + kStages - 1;
      if (next < G::kKTiles) load_stage(next % kStages, next);
      cp_async_commit();

      const bf16* sa = smem + (kt % kStages) * G::kStageElems;
      const bf16* sb = sa + G::kBM * G::kBK;
#pragma unroll
      for (int kk = 0; kk < G::kBK / 16; ++kk) {
        uint32_t a[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          const int r = wm * 32 + mi * 16 + (lane & 15);
          ldmatrix_x4(a[mi], sa + G::swz(r, kk * 2 + (lane >> 4)));
        }
        uint32_t b[8][2];
#pragma unroll
        for (int jp = 0; jp < 4; ++jp) {
          const int r = G::b_row(wn, 2 * jp) + (lane & 7) + ((lane >> 4) << 3);
          uint32_t q[4];
          ldmatrix_x4(q, sb + G::swz(r, kk * 2 + ((lane >> 3) & 1)));
          b[2 * jp][0] = q[0];
          b[2 * jp][1] = q[1];
          b[2 * jp + 1][0] = q[2];
          b[2 * jp + 1][1] = q[3];
        }
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
          for (int j = 0; j < 8; ++j) mma_bf16_16816(acc[mi][j], a[mi], b[j][0], b[j][1]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile's prologue overwrites the stages

    // Epilogue straight from the accumulators: (row g, cols 2c..2c+1) and (row g+8, same cols).
    const int g = lane >> 2, c2 = (lane & 3) * 2;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = wm * 32 + mi * 16 + g + half * 8;
        if (r >= rows) continue;
        const int pos = row0 + r;
        if constexpr (kGated) {
          bf16* out = args.C + int64_t(pos) * kN + n0 + wn * 32 + c2;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float h0 = swiglu<kHasClamp>(acc[mi][j][2 * half], acc[mi][j + 4][2 * half], clamp_limit);
            const float h1 =
                swiglu<kHasClamp>(acc[mi][j][2 * half + 1], acc[mi][j + 4][2 * half + 1], clamp_limit);
            *reinterpret_cast<uint32_t*>(out + j * 8) = pack_bf16x2(h0, h1);
          }
        } else {
          const int64_t dst = args.c_row_index ? args.c_row_index[pos] : pos;
          bf16* out = args.C + dst * kN + n0 + wn * 64 + c2;
#pragma unroll
          for (int j = 0; j < 8; ++j)
            *reinterpret_cast<uint32_t*>(out + j * 8) =
                pack_bf16x2(acc[mi][j][2 * half], acc[mi][j][2 * half + 1]);
        }
      }
    }
  }
}

}  // namespace mokgen
