// Portable expert GEMM tiles (mma.sync m16n8k16, bf16 -> fp32): the "mma_sync" core.
//
// One tile computes rows [0, rows) (rows <= 128) of C = A * B^T for one expert, where B is stored
// [N, K] with K contiguous, as the Hugging Face expert weights are. Where A rows come from and
// where C rows go are functors, so the same tile serves the single-rank kernels (gather from x by
// token, scatter to combine slots) and the expert-parallel megakernel (ring rows in, rows pushed
// to the token owner's combine slot). Two epilogues, chosen at compile time:
//   kGated = true   up projection: the B tile is 64 rows of w_gate[e] and the same 64 rows of
//                   w_up[e], so one tile holds matching gate/up columns; SwiGLU in registers;
//                   64 bf16 output columns per tile.
//   kGated = false  down projection: B = w_down[e]; 128 bf16 output columns per tile.
// Tiles: BM = 128 rows x 128 B-rows x BK = 64, 8 warps (4 along M x 2 along N), a kStages-deep
// cp.async pipeline, 128-byte smem rows with 16-byte chunks XOR-swizzled by (row & 7) so ldmatrix
// is conflict-free. K is never split and each output row depends only on its own A row and B,
// so results are bitwise independent of how rows are grouped into tiles or scheduled.
// sm_80+ instructions; kept as a reference core and fallback (MOKGEN_GEMM_CORE=mma_sync); the
// default is the TMA + wgmma core in hopper_gemm.cuh.
#pragma once

#include "common.cuh"

namespace mokgen {

template <int kN, int kK, bool kGated, bool kHasClamp, int kStages>
struct GemmTile {
  static constexpr int kBM = 128;
  static constexpr int kBNB = 128;                      // B rows per tile
  static constexpr int kBN = kGated ? kBNB / 2 : kBNB;  // output columns per tile
  static constexpr int kBK = 64;
  static constexpr int kThreads = 256;
  static constexpr int kChunks = kBK / 8;  // 16-byte chunks per smem row
  static constexpr int kStageElems = (kBM + kBNB) * kBK;
  static constexpr size_t kSmemBytes = size_t(kStages) * kStageElems * sizeof(bf16);
  static constexpr int kKTiles = kK / kBK;
  static constexpr int kNTiles = kN / kBN;
  static_assert(kK % kBK == 0, "K must be a multiple of 64");
  static_assert(kN % kBN == 0, "N must be a multiple of the output tile");

  MOKGEN_DEVICE static int swz(int row, int chunk) { return row * kBK + ((chunk ^ (row & 7)) << 3); }

  // First B row of n8 sub-tile j (0..7) of warp column wn.
  MOKGEN_DEVICE static int b_row(int wn, int j) {
    if constexpr (kGated) return (j < 4 ? 0 : kBNB / 2) + wn * 32 + (j & 3) * 8;
    else return wn * 64 + j * 8;
  }

  // One output tile. b0/b1: this expert's [N, K] weights (b1 only when gated); n0: first output
  // column; a_row(r) -> const bf16* of A row r; c_row(r) -> bf16* of output row r (column 0).
  // Called by all 256 threads of the CTA; smem holds kSmemBytes. Ends with a __syncthreads.
  template <class ARow, class CRow>
  MOKGEN_DEVICE static void run(unsigned char* smem_raw, int rows, int n0, const bf16* b0, const bf16* b1,
                                ARow a_row, CRow c_row, float clamp_limit) {
    bf16* smem = reinterpret_cast<bf16*>(smem_raw);
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int wm = warp & 3;   // 32-row slab
    const int wn = warp >> 2;  // column half

    // Per-thread source pointers: 4 A chunks and 4 B chunks per stage.
    const bf16* a_src[4];
    bool a_ok[4];
    const bf16* b_src[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / kChunks, kc = c % kChunks;
      a_ok[i] = r < rows;
      a_src[i] = (a_ok[i] ? a_row(r) : a_row(0)) + kc * 8;
      const bf16* bbase;
      int brow;
      if constexpr (kGated) {
        bbase = r < kBNB / 2 ? b0 : b1;
        brow = n0 + (r % (kBNB / 2));
      } else {
        bbase = b0;
        brow = n0 + r;
      }
      b_src[i] = bbase + int64_t(brow) * kK + kc * 8;
    }

    auto load_stage = [&](int stage, int ktile) {
      bf16* sa = smem + stage * kStageElems;
      bf16* sb = sa + kBM * kBK;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = tid + i * kThreads;
        const int r = c / kChunks, kc = c % kChunks;
        cp_async_16(sa + swz(r, kc), a_src[i] + ktile * kBK, a_ok[i]);
        cp_async_16(sb + swz(r, kc), b_src[i] + ktile * kBK, true);
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
      if (s < kKTiles) load_stage(s, s);
      cp_async_commit();
    }

    for (int kt = 0; kt < kKTiles; ++kt) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      const int next = kt + kStages - 1;
      if (next < kKTiles) load_stage(next % kStages, next);
      cp_async_commit();

      const bf16* sa = smem + (kt % kStages) * kStageElems;
      const bf16* sb = sa + kBM * kBK;
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        uint32_t a[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          const int r = wm * 32 + mi * 16 + (lane & 15);
          ldmatrix_x4(a[mi], sa + swz(r, kk * 2 + (lane >> 4)));
        }
        uint32_t b[8][2];
#pragma unroll
        for (int jp = 0; jp < 4; ++jp) {
          const int r = b_row(wn, 2 * jp) + (lane & 7) + ((lane >> 4) << 3);
          uint32_t q[4];
          ldmatrix_x4(q, sb + swz(r, kk * 2 + ((lane >> 3) & 1)));
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
        if constexpr (kGated) {
          bf16* out = c_row(r) + n0 + wn * 32 + c2;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float h0 = swiglu<kHasClamp>(acc[mi][j][2 * half], acc[mi][j + 4][2 * half], clamp_limit);
            const float h1 =
                swiglu<kHasClamp>(acc[mi][j][2 * half + 1], acc[mi][j + 4][2 * half + 1], clamp_limit);
            *reinterpret_cast<uint32_t*>(out + j * 8) = pack_bf16x2(h0, h1);
          }
        } else {
          bf16* out = c_row(r) + n0 + wn * 64 + c2;
#pragma unroll
          for (int j = 0; j < 8; ++j)
            *reinterpret_cast<uint32_t*>(out + j * 8) = pack_bf16x2(acc[mi][j][2 * half], acc[mi][j][2 * half + 1]);
        }
      }
    }
  }
};

}  // namespace mokgen
