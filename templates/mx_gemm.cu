// The MXFP8 kernels on sm_90a (issue 6; not used by the megakernel yet). The GEMM: C = A B^T with
// A [M, K] and B [N, K] as E4M3 codes plus one E8M0 scale per 32 consecutive k (OCP MX), C [M, N]
// float32. The FP8 wgmma has no block scales, so each 32-wide k step runs as its own wgmma into
// a scratch accumulator (scale-d 0), and the consumer promotes it into the float32 sum with the
// product of the row's and the column's scale: acc += tmp * (2^(ea - 127) * 2^(eb - 127)). The
// scales' product is a power of two, exact in float32 for ea + eb in 105..381 (2^-149 .. 2^127),
// so the only roundings are the tensor core's within the 32 products and the one add per
// promotion. Outside that range (both blocks near float32's ends) the product flushes to 0 or
// overflows to inf. (Scaling tmp by one factor first, as v0.33 did, overflowed for a 2^127 row
// scale against a 2^-126 column scale, whose product is 2.)
//
// Tile: 128 x 128 (consumer warpgroup c owns rows 64 c .. 64 c + 63), k-blocks of 128 codes (four
// k32 steps) in a ring of kStages stages loaded by a producer thread: the codes by TMA (two 64-row
// boxes per operand, 128-byte rows, SWIZZLE_128B), the k-block's scales of the tile's rows and
// columns by two bulk copies of 512 bytes (the scales in the blocked layout [K / 128, rows, 4]).
// One tile per CTA. Each consumer waits for its k32 wgmma before promoting it; the two consumer
// warpgroups overlap each other's promotion and MMA. (v0.33's first form had no producer: 256
// threads, thread 0 refilling a stage once both warpgroups had released it, and the scales read
// from global memory. That kept the warpgroups in lockstep: 85-90 TFLOP/s.)
//
// The device code is in headers: include/mokgen/mx_gemm.cuh (the GEMM: forms, producer, decoders,
// consumers) and include/mokgen/mx_rows.cuh (the staged experts' row kernels). This file holds
// the tensor maps, the launchers and the C ABI. Built by mokgen.mx_gemm.load_library
// (build.build_source, CUTLASS/CuTe headers as a library).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mokgen/mx_gemm.cuh"
#include "mokgen/mx_rawb.cuh"
#include "mokgen/mx_rows.cuh"
#include "mokgen/mx_tile.cuh"

namespace mokgen {
namespace mxg {

// uint8 [rows, cols] row-major -> a map of box_rows x box_cols-byte boxes (mx_tile.cuh).
inline CUresult encode_codes(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols,
                             uint32_t box_cols = kBK, uint32_t box_rows = 64) {
  return sm90::encode_codes_2d(map, base, rows, cols, box_cols, box_rows);
}

// Internal linkage (and build.BASE_FLAGS's -fno-gnu-unique): a static local of a template (the
// attribute flag below) was otherwise a GNU-unique symbol, one for every library in the process,
// and a variant build loaded beside this library (.ci/mx_gemm_probe.py --probe) skipped setting
// its own kernel's shared-memory limit.
namespace {

template <int kForm>
int launch(void* c, const void* a, const void* sa, const void* b, const void* sb, const int2* tiles, int n_tiles, int M,
           int N, int K, int E, void* stream) {
  if (M % kBM || N % kBN || K % kBK || M <= 0 || N <= 0 || K <= 0 || E <= 0 || n_tiles <= 0 || n_tiles > 65535)
    return int(cudaErrorInvalidValue);
  CUtensorMap ma, mb;
  if (encode_codes(&ma, a, uint64_t(M), uint64_t(K)) != CUDA_SUCCESS ||
      encode_codes(&mb, b, uint64_t(E) * uint64_t(N), uint64_t(K)) != CUDA_SUCCESS)
    return int(cudaErrorInvalidValue);
  constexpr size_t kSmem = Geometry<kForm>::kSmemBytes;
  static bool attr = false;
  if (!attr) {
    const cudaError_t err =
        cudaFuncSetAttribute(mx_gemm_kernel<kForm>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem));
    if (err != cudaSuccess) return int(err);
    attr = true;
  }
  mx_gemm_kernel<kForm><<<dim3(N / kBN, n_tiles), Geometry<kForm>::kThreads, kSmem, static_cast<cudaStream_t>(stream)>>>(
      ma, mb, static_cast<const uint8_t*>(sa), static_cast<const uint8_t*>(sb), static_cast<float*>(c), M, N, K, tiles);
  return int(cudaGetLastError());
}

int launch_form(int form, void* c, const void* a, const void* sa, const void* b, const void* sb, const int2* tiles,
                int n_tiles, int M, int N, int K, int E, void* stream) {
  switch (form) {
    case kInline: return launch<kInline>(c, a, sa, b, sb, tiles, n_tiles, M, N, K, E, stream);
    case kDecoded: return launch<kDecoded>(c, a, sa, b, sb, tiles, n_tiles, M, N, K, E, stream);
    case kQuad: return launch<kQuad>(c, a, sa, b, sb, tiles, n_tiles, M, N, K, E, stream);
    default: return int(cudaErrorInvalidValue);
  }
}

// The bf16-math GEMM's grouped launches' tile order (bf16m::gemm_kernel's band; set by
// mokgen_mx_set_band, MOKGEN_MX_BAND): bands of g_mx_band row tiles, column tile by column tile
// within a band; 1 the grid's order. The dense and k-ranged launches keep the grid's order (the
// weight gradients' k-ranged launches measured 1.03x slower in bands of 8, H100, v0.43). The same
// bits.
int g_mx_band = 8;

// The bf16-math form: A MXFP8 [M, K] (codes, blocked scales [K / 128, M, 4]), B bf16 [E N, K]
// (MX values, k permuted within each 16: mokgen.mx_gemm.bf16_math_weights), C [M, N] float32.
// Dense (tiles null, E = 1) or grouped: n_tiles row tiles (expert, first row), (-1, 0) skipped.
// K-ranged (kranges given: n_ranges (first k, length) pairs, multiples of 128): C [n_ranges, M, N]
// with slice z the product over its range only (the weight gradients), tiles null.
// Fused epilogues (grouped only, no C): swi.codes not null, h = swiglu(gate, up) quantized to
// MXFP8 (B's rows interleaved in 128s of gate then up: N = 2 inter); swi.out not null, the combine
// of one pair per token.
template <int kEpi>
int launch_bf16_math_epi(void* c, const void* a, const void* sa, const void* b, const void* tiles, int n_tiles, int E,
                         int M, int N, int K, const void* kranges, int n_ranges, int out_bf16, bf16m::EpiArgs swi,
                         void* stream) {
  namespace bm = bf16m;
  CUtensorMap ma, mb;
  if (encode_codes(&ma, a, uint64_t(M), uint64_t(K), bm::kBK, bm::kBM) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&mb, b, uint64_t(E) * uint64_t(N), uint64_t(K), bm::kBN, 64) != CUDA_SUCCESS)
    return int(cudaErrorInvalidValue);
  static bool attr = false;
  if (!attr) {
    const cudaError_t err = cudaFuncSetAttribute(bm::gemm_kernel<kEpi>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 int(bm::kSmemBytes));
    if (err != cudaSuccess) return int(err);
    attr = true;
  }
  bm::gemm_kernel<kEpi><<<dim3(N / bm::kBN, n_tiles, n_ranges), bm::kThreads, bm::kSmemBytes,
                          static_cast<cudaStream_t>(stream)>>>(
      ma, mb, static_cast<const uint8_t*>(sa), static_cast<float*>(c), M, N, K, static_cast<const int2*>(tiles),
      static_cast<const int2*>(kranges), out_bf16, swi, tiles != nullptr ? g_mx_band : 1);
  return int(cudaGetLastError());
}

int launch_bf16_math(void* c, const void* a, const void* sa, const void* b, const void* tiles, int n_tiles, int E,
                     int M, int N, int K, const void* kranges, int n_ranges, int out_bf16, void* stream,
                     bf16m::EpiArgs swi = {}) {
  namespace bm = bf16m;
  if (M % bm::kBM || N % bm::kBN || K % 128 || M <= 0 || N <= 0 || K <= 0 || E <= 0 ||
      (tiles == nullptr && (E != 1 || n_tiles != M / bm::kBM)) || n_tiles < 0 || n_tiles > 65535 ||
      n_ranges < 1 || n_ranges > 65535 || (kranges == nullptr && n_ranges != 1) ||
      (kranges != nullptr && tiles != nullptr) ||
      (swi.codes != nullptr && (swi.scales == nullptr || kranges != nullptr || 2 * swi.inter != N)) ||
      (swi.out != nullptr && (swi.src == nullptr || swi.weight == nullptr || kranges != nullptr || swi.codes)) ||
      (swi.ldc != 0 && (swi.ldc < N || swi.ldc % 2 || swi.codes != nullptr || swi.out != nullptr)))
    return int(cudaErrorInvalidValue);
  if (n_tiles == 0) return 0;
  if (swi.out != nullptr)
    return launch_bf16_math_epi<bm::kEpiCombine1>(c, a, sa, b, tiles, n_tiles, E, M, N, K, kranges, n_ranges, 0,
                                                  swi, stream);
  if (swi.codes == nullptr)
    return launch_bf16_math_epi<bm::kEpiStore>(c, a, sa, b, tiles, n_tiles, E, M, N, K, kranges, n_ranges, out_bf16,
                                               swi, stream);
  if (swi.limit > 0.f)
    return launch_bf16_math_epi<bm::kEpiSwigluClamp>(c, a, sa, b, tiles, n_tiles, E, M, N, K, kranges, n_ranges, 0,
                                                     swi, stream);
  return launch_bf16_math_epi<bm::kEpiSwiglu>(c, a, sa, b, tiles, n_tiles, E, M, N, K, kranges, n_ranges, 0, swi,
                                              stream);
}

// The bf16-math GEMM with B raw (mx_rawb.cuh, v0.67): A MXFP8 [M, K] (codes, blocked scales), B the
// bf16 weights as held, part 0 [E, k0, N] then part 1 [E, K - k0, N] along k (b1 unused when k0 =
// K), n contiguous, quantized along k in the kernel; grouped over n_tiles row tiles (expert, first
// row), (-1, 0) skipped. C [M, N] float32 (bf16 when out_bf16), or the combine of one pair per
// token when epi.out is set.
template <int kEpi>
int launch_raw_epi(void* c, const void* a, const void* sa, const void* b0, const void* b1, int k0, const void* tiles,
                   int n_tiles, int E, int M, int N, int K, int out_bf16, bf16m::EpiArgs epi, void* stream) {
  namespace bm = bf16m;
  CUtensorMap ma, mb0, mb1;
  if (encode_codes(&ma, a, uint64_t(M), uint64_t(K), bm::kBK, bm::kBM) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&mb0, b0, uint64_t(E) * uint64_t(k0), uint64_t(N), 64) != CUDA_SUCCESS)
    return int(cudaErrorInvalidValue);
  if (k0 < K) {
    if (sm90::encode_map_2d(&mb1, b1, uint64_t(E) * uint64_t(K - k0), uint64_t(N), 64) != CUDA_SUCCESS)
      return int(cudaErrorInvalidValue);
  } else {
    mb1 = mb0;
  }
  static bool attr = false;
  if (!attr) {
    const cudaError_t err = cudaFuncSetAttribute(rawb::raw_gemm_kernel<kEpi>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, int(bm::kSmemBytes));
    if (err != cudaSuccess) return int(err);
    attr = true;
  }
  rawb::raw_gemm_kernel<kEpi><<<dim3(N / bm::kBN, n_tiles), bm::kThreads, bm::kSmemBytes,
                                static_cast<cudaStream_t>(stream)>>>(
      ma, mb0, mb1, static_cast<const uint8_t*>(sa), static_cast<float*>(c), M, N, K, k0,
      static_cast<const int2*>(tiles), out_bf16, epi, g_mx_band);
  return int(cudaGetLastError());
}

int launch_raw(void* c, const void* a, const void* sa, const void* b0, const void* b1, int k0, const void* tiles,
               int n_tiles, int E, int M, int N, int K, int out_bf16, bf16m::EpiArgs epi, void* stream) {
  namespace bm = bf16m;
  if (M % bm::kBM || N % bm::kBN || K % 128 || k0 % bm::kBK || M <= 0 || N <= 0 || E <= 0 || k0 <= 0 || k0 > K ||
      tiles == nullptr || n_tiles < 0 || n_tiles > 65535 || (k0 < K && b1 == nullptr) ||
      (epi.out != nullptr && (epi.src == nullptr || epi.weight == nullptr || c != nullptr)) ||
      (epi.out == nullptr && c == nullptr))
    return int(cudaErrorInvalidValue);
  if (n_tiles == 0) return 0;
  if (epi.out != nullptr)
    return launch_raw_epi<bm::kEpiCombine1>(c, a, sa, b0, b1, k0, tiles, n_tiles, E, M, N, K, 0, epi, stream);
  return launch_raw_epi<bm::kEpiStore>(c, a, sa, b0, b1, k0, tiles, n_tiles, E, M, N, K, out_bf16, epi, stream);
}

// ---- the megakernel's MX tile run alone (mx_tile.cuh; tests/test_gpu_mx_gemm.py) ----------------
// Fixed shapes, one tile per CTA: the gated tile (up projection: I = 256 output columns of h from
// 128-row gate and up tiles, K = H = 512) and the down tile (N = 512 bf16 columns, K = I = 256),
// M = 256 rows.
namespace mxt {
constexpr int kM = 256, kStages = 4;
using Gated = sm90::MxTile<256, 512, true, false, kStages, 256>;
using GatedClamp = sm90::MxTile<256, 512, true, true, kStages, 256>;
using Down = sm90::MxTile<512, 256, false, false, kStages, 256>;

template <class Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    tile_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_s,
                const __grid_constant__ CUtensorMap map_b0, const __grid_constant__ CUtensorMap map_b1, bf16* c,
                uint8_t* h_codes, uint8_t* h_scales, float limit, int rows, int first_row) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const auto s = Tile::carve(smem);
  if (threadIdx.x == 0) Tile::init_barriers(s);
  __syncthreads();
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0);
  const int m0 = int(blockIdx.y) * Tile::kBM, nt = int(blockIdx.x);
  typename Tile::Pipe pipe;
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0)
      Tile::produce(s, pipe, sm90::MxA{&map_a, &map_s}, m0 + first_row, &map_b0, &map_b1,
                    nt * (Tile::kBBox * (Tile::kBN == 128 ? 1 : 2)));
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int n0 = nt * Tile::kBN;
  // the tile's valid rows (the megakernel's partial tiles): the epilogue writes rows < valid only
  const int valid = rows - m0 < Tile::kBM ? rows - m0 : Tile::kBM;
  if constexpr (Tile::kBN == 128) {  // gated
    const sm90::MxRowsBlocked out{h_codes, h_scales, Tile::kNTiles * Tile::kBN, kM, m0};
    Tile::consume(s, pipe, wg - 1, valid, n0, out, limit);
  } else {
    constexpr int kN = Tile::kNTiles * Tile::kBN;
    const auto out = [&](int r) { return c + size_t(m0 + r) * kN; };
    Tile::consume(s, pipe, wg - 1, valid, n0, out, limit);
  }
}

template <class Tile>
int launch_tile(void* c, void* h_codes, void* h_scales, const void* a, const void* sa, const void* b0, const void* b1,
                float limit, int rows, int first_row, void* stream) {
  constexpr int kK = Tile::kKTiles * Tile::kBK, kRowsB = Tile::kBN == 128 ? Tile::kNTiles * 128 : Tile::kNTiles * 256;
  CUtensorMap ma, ms, mb0, mb1;
  if (encode_codes(&ma, a, uint64_t(kM), uint64_t(kK), Tile::kBK, Tile::kABox) != CUDA_SUCCESS ||
      sm90::encode_scales_2d(&ms, sa, uint64_t(kM), uint64_t(kK / 128)) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&mb0, b0, uint64_t(kRowsB), uint64_t(kK), Tile::kBBox, Tile::kBK) != CUDA_SUCCESS ||
      sm90::encode_map_2d(&mb1, b1 != nullptr ? b1 : b0, uint64_t(kRowsB), uint64_t(kK), Tile::kBBox, Tile::kBK) !=
          CUDA_SUCCESS)
    return int(cudaErrorInvalidValue);
  const cudaError_t err =
      cudaFuncSetAttribute(tile_kernel<Tile>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Tile::kSmemBytes));
  if (err != cudaSuccess) return int(err);
  tile_kernel<Tile><<<dim3(Tile::kNTiles, kM / Tile::kBM), Tile::kThreads, Tile::kSmemBytes,
                      static_cast<cudaStream_t>(stream)>>>(ma, ms, mb0, mb1, static_cast<bf16*>(c),
                                                           static_cast<uint8_t*>(h_codes),
                                                           static_cast<uint8_t*>(h_scales), limit, rows,
                                                           first_row);
  return int(cudaGetLastError());
}
}  // namespace mxt

}  // namespace
}  // namespace mxg
}  // namespace mokgen

extern "C" {

// C [M, N] float32 = A [M, K] B [N, K]^T, MXFP8 (codes uint8 E4M3, scales uint8 E8M0 in the blocked
// layout [K / 128, rows, 4]; 16-byte aligned). M, N, K multiples of 128. form: 0 kInline, 1
// kDecoded, 2 kQuad (the same bits). Returns 0 or a CUDA error code.
int mokgen_mx_gemm_form(int form, void* c, const void* a, const void* sa, const void* b, const void* sb, int M, int N,
                        int K, void* stream) {
  return mokgen::mxg::launch_form(form, c, a, sa, b, sb, nullptr, M / mokgen::mxg::kBM, M, N, K, 1, stream);
}

// C [M, N] float32 = A B^T, A MXFP8 (codes, blocked scales), B bf16 [N, K] with its k order
// permuted within each 16 (the bf16-math form; M % 128, N % 256, K % 128).
int mokgen_mx_bf16_math_gemm(void* c, const void* a, const void* sa, const void* b, int M, int N, int K,
                             void* stream) {
  return mokgen::mxg::launch_bf16_math(c, a, sa, b, nullptr, M / 128, 1, M, N, K, nullptr, 1, 0, stream);
}

// Grouped: row tile i = tiles[i] = (expert e, first row m0) of A's M rows times e's N rows of B
// bf16 [E N, K] (permuted as above), into C [M, N]; (-1, 0) tiles skipped.
int mokgen_mx_bf16_math_grouped_gemm(void* c, const void* a, const void* sa, const void* b, const void* tiles,
                                     int n_tiles, int E, int M, int N, int K, void* stream) {
  return mokgen::mxg::launch_bf16_math(c, a, sa, b, tiles, n_tiles, E, M, N, K, nullptr, 1, 0, stream);
}

// The grouped GEMM into a column block of a wider float32 matrix: C's rows ldc elements apart
// (ldc >= N, even; c 8-byte aligned), e.g. gate and up from weights held apart into the halves of
// one [M, 2 I] gate | up.
int mokgen_mx_bf16_math_grouped_gemm_ld(void* c, int ldc, const void* a, const void* sa, const void* b,
                                        const void* tiles, int n_tiles, int E, int M, int N, int K, void* stream) {
  if (ldc <= 0) return int(cudaErrorInvalidValue);
  mokgen::mxg::bf16m::EpiArgs st{};
  st.ldc = ldc;
  return mokgen::mxg::launch_bf16_math(c, a, sa, b, tiles, n_tiles, E, M, N, K, nullptr, 1, 0, stream, st);
}

// The up projection with SwiGLU and h's quantization fused (grouped): A MXFP8 rows [M, K], B bf16
// [E 2I, K] with each expert's gate and up rows interleaved in 128s (mx_gemm.expert_weights'
// interleave), tiles as above -> h codes [M, I] and blocked scales [I / 128, M, 4] of
// swiglu(gate, up) (limit > 0: clamped), the bits of the unfused GEMM then
// mokgen_mx_swiglu_quantize; no float32 gate | up.
int mokgen_mx_bf16_math_swiglu_gemm(void* h_codes, void* h_scales, const void* a, const void* sa, const void* b,
                                    const void* tiles, int n_tiles, int E, int M, int inter, int K, float limit,
                                    void* stream) {
  if (h_codes == nullptr || h_scales == nullptr || inter <= 0) return int(cudaErrorInvalidValue);
  mokgen::mxg::bf16m::EpiArgs swi{};
  swi.codes = static_cast<uint8_t*>(h_codes);
  swi.scales = static_cast<uint8_t*>(h_scales);
  swi.inter = inter;
  swi.limit = limit;
  return mokgen::mxg::launch_bf16_math(nullptr, a, sa, b, tiles, n_tiles, E, M, 2 * inter, K, nullptr, 1, 0, stream,
                                       swi);
}

// The down projection with the combine of one pair per token fused (grouped): A MXFP8 h rows
// [M, K], B bf16 [E N, K], tiles as above -> out bf16 [T, N], out[src[r]] = w[src[r]] * (A B^T)[r]
// (src int32 [M], -1 for padding; w float32 [T]): the bits of the GEMM then mokgen_mx_combine at
// k = 1; no float32 C.
int mokgen_mx_bf16_math_combine1_gemm(void* out, const void* src, const void* w, const void* a, const void* sa,
                                      const void* b, const void* tiles, int n_tiles, int E, int M, int N, int K,
                                      void* stream) {
  if (out == nullptr || src == nullptr || w == nullptr) return int(cudaErrorInvalidValue);
  mokgen::mxg::bf16m::EpiArgs epi{};
  epi.out = static_cast<mokgen::bf16*>(out);
  epi.src = static_cast<const int*>(src);
  epi.weight = static_cast<const float*>(w);
  return mokgen::mxg::launch_bf16_math(nullptr, a, sa, b, tiles, n_tiles, E, M, N, K, nullptr, 1, 0, stream, epi);
}

// The dgrads' GEMM with the weights raw (v0.67): A MXFP8 [M, K] (codes, blocked scales [K / 128, M,
// 4]), B bf16 part 0 [E, k0, N] and part 1 [E, K - k0, N] (b1 null when k0 = K; both contiguous, n
// contiguous) quantized to MX values along k in the kernel (the bits of
// mokgen_mx_weight_cols2's values); tiles as mokgen_mx_bf16_math_grouped_gemm's. Into C [M, N]
// float32, or with out, src and w (c null) the combine of one pair per token as
// mokgen_mx_bf16_math_combine1_gemm. M % 128, N % 256, K % 128, k0 % 64.
int mokgen_mx_bf16_math_raw_gemm(void* c, void* out, const void* src, const void* w, const void* a, const void* sa,
                                 const void* b0, const void* b1, int k0, const void* tiles, int n_tiles, int E, int M,
                                 int N, int K, void* stream) {
  mokgen::mxg::bf16m::EpiArgs epi{};
  epi.out = static_cast<mokgen::bf16*>(out);
  epi.src = static_cast<const int*>(src);
  epi.weight = static_cast<const float*>(w);
  return mokgen::mxg::launch_raw(c, a, sa, b0, b1, k0, tiles, n_tiles, E, M, N, K, 0, epi, stream);
}

// The megakernel's MX tile alone (fixed shapes, mxt above). kind 0: the down tile, c bf16 [256,
// 512] = A [256, 256] B [512, 256]^T; kind 1 / 2: the gated tile without / with the clamp (limit),
// h codes [256, 256] and blocked scales [2, 256, 4] of swiglu(A Bg^T, A Bu^T), A [256, 512], Bg and
// Bu [256, 512]. A MXFP8 (codes, blocked scales [K / 128, 256, 4]); B bf16 MX values, k permuted.
// Only rows < rows (1..256) of the output are written, as the megakernel's partial tiles. Output
// row i is A's row first_row + i (0..127; rows past A's end read as zeros), as the megakernel's
// tiles start at any row of the ring.
int mokgen_mx_tile_test(int kind, void* c, void* h_codes, void* h_scales, const void* a, const void* sa,
                        const void* b0, const void* b1, float limit, int rows, int first_row, void* stream) {
  namespace t = mokgen::mxg::mxt;
  if (rows < 1 || rows > t::kM || first_row < 0 || first_row > 127) return int(cudaErrorInvalidValue);
  switch (kind) {
    case 0: return t::launch_tile<t::Down>(c, nullptr, nullptr, a, sa, b0, nullptr, 0.f, rows, first_row, stream);
    case 1:
      return t::launch_tile<t::Gated>(nullptr, h_codes, h_scales, a, sa, b0, b1, 0.f, rows, first_row, stream);
    case 2:
      return t::launch_tile<t::GatedClamp>(nullptr, h_codes, h_scales, a, sa, b0, b1, limit, rows, first_row, stream);
    default: return int(cudaErrorInvalidValue);
  }
}

// MOKGEN_MX_BAND (v0.43): the bf16-math GEMM's grouped launches walk their row tiles in bands of
// `band` (default 8), column tile by column tile within a band; 1: the grid's order. The same bits.
void mokgen_mx_set_band(int band) { mokgen::mxg::g_mx_band = band < 1 ? 1 : band; }

// The weight gradients: C [n_ranges, M, N] (float32, or bf16 when out_bf16), slice z = A B^T over
// k in range z = kranges[z] (first, length; multiples of 128; length 0: zeros), A MXFP8 [M, K]
// (codes, blocked scales), B bf16 [N, K] (MX values, k permuted).
int mokgen_mx_bf16_math_ranged_gemm(void* c, const void* a, const void* sa, const void* b, const void* kranges,
                                    int n_ranges, int M, int N, int K, int out_bf16, void* stream) {
  return mokgen::mxg::launch_bf16_math(c, a, sa, b, nullptr, M / 128, 1, M, N, K, kranges, n_ranges, out_bf16,
                                       stream);
}

// mokgen_mx_bf16_math_ranged_gemm on the persistent kernel (bf16m::ranged_kernel, v0.40;
// MOKGEN_MX_RANGED=persistent): one CTA per SM walks the tiles, the producer filling the next
// tile's stages during a tile's epilogue. The same arguments and bits.
int mokgen_mx_bf16_math_ranged_gemm_persistent(void* c, const void* a, const void* sa, const void* b,
                                               const void* kranges, int n_ranges, int M, int N, int K, int out_bf16,
                                               void* stream) {
  namespace bm = mokgen::mxg::bf16m;
  if (c == nullptr || kranges == nullptr || M % bm::kBM || N % bm::kBN || K % 128 || M <= 0 || N <= 0 || K <= 0 ||
      n_ranges < 1)
    return int(cudaErrorInvalidValue);
  CUtensorMap ma, mb;
  if (mokgen::mxg::encode_codes(&ma, a, uint64_t(M), uint64_t(K), bm::kBK, bm::kBM) != CUDA_SUCCESS ||
      mokgen::sm90::encode_map_2d(&mb, b, uint64_t(N), uint64_t(K), bm::kBN, 64) != CUDA_SUCCESS)
    return int(cudaErrorInvalidValue);
  static bool attr = false;
  if (!attr) {
    const cudaError_t err =
        cudaFuncSetAttribute(bm::ranged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bm::kSmemBytes));
    if (err != cudaSuccess) return int(err);
    attr = true;
  }
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) !=
                                                cudaSuccess)
    return int(cudaErrorInvalidValue);
  const long long n_tiles = (long long)(N / bm::kBN) * (M / bm::kBM) * n_ranges;
  const unsigned grid = unsigned(n_tiles < sms ? n_tiles : sms);
  bm::ranged_kernel<<<grid, bm::kThreads, bm::kSmemBytes, static_cast<cudaStream_t>(stream)>>>(
      ma, mb, static_cast<const uint8_t*>(sa), static_cast<float*>(c), M, N, static_cast<const int2*>(kranges),
      n_ranges, out_bf16);
  return int(cudaGetLastError());
}

// Expert weights x bf16 [E, n_in, K] quantized along K into rows offset .. offset + n_in of each
// expert's n_out: decoded bf16 [E, n_out, K] (k permuted for the bf16-math GEMM; with interleave,
// two parts of n_in rows, a multiple of 128, interleaved in 128s), and when codes is not null
// codes [E, n_out, K] and scales [E, K / 128, n_out, 4] (rows in order). K a multiple of 128.
int mokgen_mx_weight_rows(void* decoded, void* codes, void* scales, const void* x, int E, int n_in, int k, int n_out,
                          int offset, int interleave, void* stream) {
  using namespace mokgen;
  if (E < 0 || n_in < 0 || k <= 0 || k % 128 || offset < 0 || offset + n_in > n_out ||
      (decoded == nullptr && codes == nullptr) ||
      (interleave && (n_in <= 0 || n_in % 128 || offset % n_in || 2 * n_in != n_out)))
    return int(cudaErrorInvalidValue);
  // the decoded rows: as the codes', or gate | up interleaved in 128s (offset 0: gate, n_in: up)
  const int dec_block = interleave ? 128 : (n_in > 0 ? n_in : 1), dec_stride = interleave ? 256 : 0;
  const int dec_offset = interleave ? (offset ? 128 : 0) : offset;
  const long long n = (long long)E * n_in * (k / mx::kBlock);
  if (n == 0) return 0;
  mxg::weight_rows_kernel<<<unsigned((n + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const bf16*>(x), E, n_in, k, n_out, offset, dec_block, dec_stride, dec_offset,
      static_cast<bf16*>(decoded),
      static_cast<uint8_t*>(codes), static_cast<uint8_t*>(scales));
  return int(cudaGetLastError());
}

// Expert weights x bf16 [E, rows, n] (float32 when is_f32: activations) quantized along the rows,
// transposed, into columns offset .. offset + rows of each expert's [n, rows_out]: decoded bf16
// (permuted), and when codes is not null codes [E, n, rows_out] and scales [E, rows_out / 128, n,
// 4]. rows, offset multiples of 32, rows_out of 128.
int mokgen_mx_weight_cols(void* decoded, void* codes, void* scales, const void* x, int E, int rows, int n,
                          int rows_out, int offset, int is_f32, void* stream) {
  using namespace mokgen;
  if (E < 0 || rows < 0 || n <= 0 || rows % mx::kBlock || offset % mx::kBlock || rows_out % 128 || offset < 0 ||
      offset + rows > rows_out || (decoded == nullptr && codes == nullptr))
    return int(cudaErrorInvalidValue);
  const long long total = (long long)E * (rows / mx::kBlock) * n;
  if (total == 0) return 0;
  const unsigned grid = unsigned((total + 255) / 256);
  auto st = static_cast<cudaStream_t>(stream);
  if (is_f32)
    mxg::weight_cols_kernel<float><<<grid, 256, 0, st>>>(static_cast<const float*>(x), E, rows, n, rows_out, offset,
                                                         static_cast<bf16*>(decoded), static_cast<uint8_t*>(codes),
                                                         static_cast<uint8_t*>(scales));
  else
    mxg::weight_cols_kernel<bf16><<<grid, 256, 0, st>>>(static_cast<const bf16*>(x), E, rows, n, rows_out, offset,
                                                        static_cast<bf16*>(decoded), static_cast<uint8_t*>(codes),
                                                        static_cast<uint8_t*>(scales));
  return int(cudaGetLastError());
}

// mokgen_mx_weight_cols on v0.40's tiles (mx_rows.cuh weight_cols2_kernel; MOKGEN_MX_QUANT=v2,
// the default since v0.41): the same arguments and bits; n a multiple of 8 (bf16) or 4 (float32)
// and x 16-byte aligned (mokgen_mx_weight_cols takes any n).
int mokgen_mx_weight_cols2(void* decoded, void* codes, void* scales, const void* x, int E, int rows, int n,
                           int rows_out, int offset, int is_f32, void* stream) {
  using namespace mokgen;
  const int vec = is_f32 ? 4 : 8;  // the tiles' 16-byte loads
  if (E < 0 || E > 65535 || rows < 0 || n <= 0 || n % vec || rows % mx::kBlock || offset % mx::kBlock ||
      rows_out % 128 || offset < 0 || offset + rows > rows_out || (decoded == nullptr && codes == nullptr) ||
      reinterpret_cast<uintptr_t>(x) % 16)
    return int(cudaErrorInvalidValue);
  const dim3 grid(unsigned((n + mxg::kColTileCols - 1) / mxg::kColTileCols),
                  unsigned((rows + mxg::kColTileRows - 1) / mxg::kColTileRows), unsigned(E));
  if (grid.y > 65535) return int(cudaErrorInvalidValue);
  if (E == 0 || rows == 0) return 0;
  auto st = static_cast<cudaStream_t>(stream);
  constexpr int kThreads = mxg::kColThreads;
  if (is_f32)
    mxg::weight_cols2_kernel<float><<<grid, kThreads, 0, st>>>(static_cast<const float*>(x), rows, n, rows_out, offset,
                                                               static_cast<bf16*>(decoded), static_cast<uint8_t*>(codes),
                                                               static_cast<uint8_t*>(scales));
  else
    mxg::weight_cols2_kernel<bf16><<<grid, kThreads, 0, st>>>(static_cast<const bf16*>(x), rows, n, rows_out, offset,
                                                              static_cast<bf16*>(decoded), static_cast<uint8_t*>(codes),
                                                              static_cast<uint8_t*>(scales));
  return int(cudaGetLastError());
}

// Both orientations of bf16 expert weights x [E, rows, n] from one read (v0.43, MOKGEN_MX_WEIGHTS=both;
// weight_cols2_kernel<bf16, true>): decoded_cols [E, n, rows_out] with the rows at columns offset ..
// offset + rows, quantized along the rows (mokgen_mx_weight_cols2's decoded values), and
// decoded_rows [E, row_rows, n] at rows row_offset .. row_offset + rows, quantized along n
// (mokgen_mx_weight_rows' decoded values, no interleave): row_rows = rows_out and row_offset =
// offset stack the parts' rows as their columns are (mokgen_mx_weight_both), row_rows = rows and
// row_offset 0 give each part its own tensor (v0.65, the MXFP8 layer's conversions). n a multiple
// of 32, rows of 32, rows_out of 128; x 16-byte aligned.
int mokgen_mx_weight_both_parts(void* decoded_cols, void* decoded_rows, const void* x, int E, int rows, int n,
                                int rows_out, int offset, int row_rows, int row_offset, void* stream) {
  using namespace mokgen;
  if (decoded_cols == nullptr || decoded_rows == nullptr || E < 0 || E > 65535 || rows < 0 || n <= 0 ||
      n % mx::kBlock || rows % mx::kBlock || offset % mx::kBlock || rows_out % 128 || offset < 0 ||
      offset + rows > rows_out || row_offset < 0 || row_offset + rows > row_rows ||
      reinterpret_cast<uintptr_t>(x) % 16)
    return int(cudaErrorInvalidValue);
  const dim3 grid(unsigned((n + mxg::kColTileCols - 1) / mxg::kColTileCols),
                  unsigned((rows + mxg::kColTileRows - 1) / mxg::kColTileRows), unsigned(E));
  if (grid.y > 65535) return int(cudaErrorInvalidValue);
  if (E == 0 || rows == 0) return 0;
  mxg::weight_cols2_kernel<bf16, true><<<grid, mxg::kColThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const bf16*>(x), rows, n, rows_out, offset, static_cast<bf16*>(decoded_cols), nullptr, nullptr,
      nullptr, static_cast<bf16*>(decoded_rows), row_rows, row_offset);
  return int(cudaGetLastError());
}

int mokgen_mx_weight_both(void* decoded_cols, void* decoded_rows, const void* x, int E, int rows, int n, int rows_out,
                          int offset, void* stream) {
  return mokgen_mx_weight_both_parts(decoded_cols, decoded_rows, x, E, rows, n, rows_out, offset, rows_out, offset,
                                     stream);
}

// The MX values of x's rows quantized along the rows, row-major (mxg::values_rows_kernel; v0.65,
// mx_gemm.rows_values): out [rows, n] bf16, row r from x's row gather[r] (zeros where it is < 0) or,
// with gather null, x's row r (x then [rows, n]). x bf16, or float32 when is_f32, 16-byte aligned;
// rows a multiple of 32; n of 8 (the output's rows go out in 16-byte pieces).
int mokgen_mx_rows_values(void* out, const void* x, const void* gather, int rows, int n, int is_f32, void* stream) {
  using namespace mokgen;
  if (out == nullptr || x == nullptr || rows < 0 || rows % mx::kBlock || n <= 0 || n % 8 ||
      reinterpret_cast<uintptr_t>(x) % 16 || reinterpret_cast<uintptr_t>(out) % 16)
    return int(cudaErrorInvalidValue);
  const dim3 grid(unsigned((n + mxg::kColTileCols - 1) / mxg::kColTileCols),
                  unsigned((rows + mxg::kColTileRows - 1) / mxg::kColTileRows), 1u);
  if (grid.y > 65535) return int(cudaErrorInvalidValue);
  if (rows == 0) return 0;
  auto st = static_cast<cudaStream_t>(stream);
  const int* g = static_cast<const int*>(gather);
  if (is_f32)
    mxg::values_rows_kernel<float><<<grid, mxg::kColThreads, 0, st>>>(static_cast<const float*>(x), rows, n,
                                                                      static_cast<bf16*>(out), g);
  else
    mxg::values_rows_kernel<bf16><<<grid, mxg::kColThreads, 0, st>>>(static_cast<const bf16*>(x), rows, n,
                                                                     static_cast<bf16*>(out), g);
  return int(cudaGetLastError());
}

// rows_values' rows made from bf16 rows times a float32 factor a row (v0.66, mx_gemm.rows_values with
// scale): out row r from x's row gather[r] times scale[r] in float32 (zeros where gather[r] < 0), x
// [tokens, n] bf16; the MXFP8 backward's dy = w dOut quantized along the rows without its float32
// rows. The same shapes and alignment as mokgen_mx_rows_values.
int mokgen_mx_scaled_rows_values(void* out, const void* x, const void* gather, const void* scale, int rows, int n,
                                 void* stream) {
  using namespace mokgen;
  if (out == nullptr || x == nullptr || gather == nullptr || scale == nullptr || rows < 0 || rows % mx::kBlock ||
      n <= 0 || n % 8 || reinterpret_cast<uintptr_t>(x) % 16 || reinterpret_cast<uintptr_t>(out) % 16)
    return int(cudaErrorInvalidValue);
  const dim3 grid(unsigned((n + mxg::kColTileCols - 1) / mxg::kColTileCols),
                  unsigned((rows + mxg::kColTileRows - 1) / mxg::kColTileRows), 1u);
  if (grid.y > 65535) return int(cudaErrorInvalidValue);
  if (rows == 0) return 0;
  mxg::values_rows_kernel<bf16, true><<<grid, mxg::kColThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const bf16*>(x), rows, n, static_cast<bf16*>(out), static_cast<const int*>(gather),
      static_cast<const float*>(scale));
  return int(cudaGetLastError());
}

// x's rows gathered (row r: x's row gather[r], zeros where gather[r] < 0; x [tokens, n] bf16, or
// float32 when is_f32), quantized along the rows, transposed: decoded bf16 [n, rows] (permuted),
// the B operand of the wgrads (mx_gemm.cols_bf16_math with src). version 2: weight_cols2_kernel's
// tiles (n a multiple of 8 bf16 or 4 float32, x 16-byte aligned), else weight_cols_kernel; the same
// bits. rows a multiple of 128.
int mokgen_mx_gather_cols(void* decoded, const void* x, const void* gather, int rows, int n, int is_f32, int version,
                          void* stream) {
  using namespace mokgen;
  if (decoded == nullptr || gather == nullptr || rows < 0 || rows % 128 || n <= 0 || (version == 2 && n % 2))
    return int(cudaErrorInvalidValue);
  if (rows == 0) return 0;
  auto st = static_cast<cudaStream_t>(stream);
  bf16* dec = static_cast<bf16*>(decoded);
  const int* g = static_cast<const int*>(gather);
  const int nb = rows / mx::kBlock;
  if (version == 2) {
    if (n % (is_f32 ? 4 : 8) || reinterpret_cast<uintptr_t>(x) % 16) return int(cudaErrorInvalidValue);
    const dim3 grid(unsigned((n + mxg::kColTileCols - 1) / mxg::kColTileCols),
                    unsigned((rows + mxg::kColTileRows - 1) / mxg::kColTileRows), 1u);
    constexpr int kThreads = mxg::kColThreads;
    if (is_f32)
      mxg::weight_cols2_kernel<float><<<grid, kThreads, 0, st>>>(static_cast<const float*>(x), rows, n, rows, 0, dec,
                                                                 nullptr, nullptr, g);
    else
      mxg::weight_cols2_kernel<bf16><<<grid, kThreads, 0, st>>>(static_cast<const bf16*>(x), rows, n, rows, 0, dec,
                                                                nullptr, nullptr, g);
    return int(cudaGetLastError());
  }
  const long long total = (long long)nb * n;
  const unsigned grid = unsigned((total + 255) / 256);
  if (is_f32)
    mxg::weight_cols_kernel<float><<<grid, 256, 0, st>>>(static_cast<const float*>(x), 1, rows, n, rows, 0, dec, nullptr,
                                                         nullptr, g);
  else
    mxg::weight_cols_kernel<bf16><<<grid, 256, 0, st>>>(static_cast<const bf16*>(x), 1, rows, n, rows, 0, dec, nullptr,
                                                        nullptr, g);
  return int(cudaGetLastError());
}

// The staged experts' segments from the pairs' ids (int64 [n]) and their stable sort order (int64
// [n]; null: ranked in the kernel, E <= 1024): row int64 [n], src int32 [128 n_tiles], tiles int2
// [n_tiles], padded int64 [E]. One CTA.
int mokgen_mx_segments(void* row, void* src, void* tiles, void* padded, const void* ids, const void* order, int n,
                       int k, int E, int n_tiles, void* stream) {
  using namespace mokgen;
  if (n < 0 || k <= 0 || E <= 0 || E > 8192 || n_tiles < 0 || (order == nullptr && E > mxg::kSegMaxUnsorted))
    return int(cudaErrorInvalidValue);
  const size_t smem = mxg::segments_smem_bytes(E, order != nullptr);
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(mxg::segments_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return int(err);
  }
  mxg::segments_kernel<<<1, mxg::kSegThreads, smem, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const long long*>(ids), static_cast<const long long*>(order), n, k, E, n_tiles,
      static_cast<long long*>(row), static_cast<int*>(src), static_cast<int2*>(tiles),
      static_cast<long long*>(padded));
  return int(cudaGetLastError());
}

// Codes [rows, H] and blocked scales [H / 128, rows, 4] of x's rows src[r] (zeros where src[r] <
// 0); H a multiple of 128, x 16-byte aligned rows.
int mokgen_mx_quantize_rows(void* codes, void* scales, const void* x, const void* src, int rows, int h, void* stream) {
  using namespace mokgen;
  if (rows < 0 || h <= 0 || h % 128) return int(cudaErrorInvalidValue);
  const long long n = (long long)rows * (h / mx::kBlock);
  if (n == 0) return 0;
  mxg::quantize_rows_kernel<<<unsigned((n + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const bf16*>(x), static_cast<const int*>(src), rows, h, static_cast<uint8_t*>(codes),
      static_cast<uint8_t*>(scales));
  return int(cudaGetLastError());
}

// Codes [rows, I] and blocked scales [I / 128, rows, 4] of swiglu(gu[:, :I], gu[:, I:]) (gu float32
// [rows, 2 I]); limit > 0: the SwiGLU clamp, else none.
int mokgen_mx_swiglu_quantize(void* codes, void* scales, const void* gu, int rows, int inter, float limit,
                              void* stream) {
  using namespace mokgen;
  if (rows < 0 || inter <= 0 || inter % 128) return int(cudaErrorInvalidValue);
  const long long n = (long long)rows * (inter / 4);  // a thread per 4 elements
  if (n == 0) return 0;
  const unsigned grid = unsigned((n + 255) / 256);
  auto st = static_cast<cudaStream_t>(stream);
  if (limit > 0.f)
    mxg::swiglu_quantize_kernel<true><<<grid, 256, 0, st>>>(static_cast<const float*>(gu), rows, inter, limit,
                                                           static_cast<uint8_t*>(codes), static_cast<uint8_t*>(scales));
  else
    mxg::swiglu_quantize_kernel<false><<<grid, 256, 0, st>>>(static_cast<const float*>(gu), rows, inter, 0.f,
                                                            static_cast<uint8_t*>(codes), static_cast<uint8_t*>(scales));
  return int(cudaGetLastError());
}

// Codes [rows, k] and blocked scales [k / 128, rows, 4] of float32 rows x [rows, k] (k a multiple
// of 128, 16-byte aligned rows).
int mokgen_mx_quantize_f32_rows(void* codes, void* scales, const void* x, int rows, int k, void* stream) {
  using namespace mokgen;
  if (rows < 0 || k <= 0 || k % 128) return int(cudaErrorInvalidValue);
  const long long n = (long long)rows * (k / mx::kBlock);
  if (n == 0) return 0;
  mxg::quantize_f32_rows_kernel<<<unsigned((n + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const float*>(x), rows, k, static_cast<uint8_t*>(codes), static_cast<uint8_t*>(scales));
  return int(cudaGetLastError());
}

// x [rows, n] (bf16 when is_bf16, else float32) quantized along the rows, transposed: codes [n, rows],
// scales [n, rows / 32]; rows a multiple of 32.
int mokgen_mx_quantize_cols(void* codes, void* scales, const void* x, int is_bf16, int rows, int n, void* stream) {
  using namespace mokgen;
  if (rows < 0 || n <= 0 || rows % mx::kBlock) return int(cudaErrorInvalidValue);
  const long long total = (long long)(rows / mx::kBlock) * n;
  if (total == 0) return 0;
  const unsigned grid = unsigned((total + 255) / 256);
  auto st = static_cast<cudaStream_t>(stream);
  if (is_bf16)
    mxg::quantize_cols_kernel<bf16><<<grid, 256, 0, st>>>(static_cast<const bf16*>(x), rows, n,
                                                         static_cast<uint8_t*>(codes), static_cast<uint8_t*>(scales));
  else
    mxg::quantize_cols_kernel<float><<<grid, 256, 0, st>>>(static_cast<const float*>(x), rows, n,
                                                          static_cast<uint8_t*>(codes), static_cast<uint8_t*>(scales));
  return int(cudaGetLastError());
}

// out bf16 [tokens, H] = sum_j w[t, j] y[row[t k + j]] (y float32 [*, H], row int64 [tokens k], w
// float32 [tokens, k]); H a multiple of 4.
int mokgen_mx_combine(void* out, const void* y, const void* row, const void* w, int tokens, int k, int h,
                      void* stream) {
  using namespace mokgen;
  if (tokens < 0 || k <= 0 || h <= 0 || h % 4) return int(cudaErrorInvalidValue);
  const long long n = (long long)tokens * (h / 4);
  if (n == 0) return 0;
  mxg::combine_kernel<<<unsigned((n + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const float*>(y), static_cast<const long long*>(row), static_cast<const float*>(w), tokens, k, h,
      static_cast<bf16*>(out));
  return int(cudaGetLastError());
}

// The MXFP8 backward's combine, fused (mx_rows.cuh combine_backward_kernel): for each of the rows
// padded rows r, pair p = pair[r] (-1: padding), dy float32 [rows, H] = w[p] dOut[p / k] (zeros
// for padding), its codes [rows, H] and blocked scales [H / 128, rows, 4] along H, and d_w[p] =
// <dOut[p / k], y of the pair> (float32 [tokens k]). y: float32 [rows, H] in the padded layout
// (y_pairs 0), or bf16 [tokens k, H] in pair order (y_pairs 1). H a multiple of 128.
int mokgen_mx_combine_backward(void* dy, void* codes, void* scales, void* d_w, const void* d_out, const void* y,
                               const void* pair, const void* w, int rows, int k, int h, int y_pairs, void* stream) {
  using namespace mokgen;
  if (rows < 0 || k <= 0 || h <= 0 || h % 128) return int(cudaErrorInvalidValue);
  if (rows == 0) return 0;
  constexpr int kThreads = 128;
  const auto launch = [&](auto rows_of_y) {
    using Y = decltype(rows_of_y);
    // dy null (v0.66, mx_gemm.combine_backward keep_dy=False): its own instantiation, which writes no dy
    const auto kernel = dy != nullptr ? mxg::combine_backward_kernel<kThreads, Y, true>
                                      : mxg::combine_backward_kernel<kThreads, Y, false>;
    kernel<<<unsigned(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const bf16*>(d_out), rows_of_y, static_cast<const int*>(pair), static_cast<const float*>(w), rows,
        k, h, static_cast<float*>(dy), static_cast<uint8_t*>(codes), static_cast<uint8_t*>(scales),
        static_cast<float*>(d_w));
  };
  if (y_pairs)
    launch(mxg::PairBf16Rows{static_cast<const bf16*>(y)});
  else
    launch(mxg::PaddedF32Rows{static_cast<const float*>(y)});
  return int(cudaGetLastError());
}

// SwiGLU's backward, fused (mx_rows.cuh swiglu_backward_kernel): from the gate | up rows and dh
// float32 [rows, I], dg, du and h float32 [rows, I] each, and [dg | du] quantized along 2 I
// (codes [rows, 2 I], blocked scales [2 I / 128, rows, 4]). gu: float32 [rows, 2 I] in the padded
// layout (pair null), or bf16 [tokens k, 2 I] in pair order with pair [rows] the padded rows'
// pairs (-1: padding). limit > 0 clamps. I a multiple of 128.
int mokgen_mx_swiglu_backward(void* dg, void* du, void* h, void* codes, void* scales, const void* gu, const void* dh,
                              const void* pair, int rows, int inter, float limit, void* stream) {
  using namespace mokgen;
  if (rows < 0 || inter <= 0 || inter % 128) return int(cudaErrorInvalidValue);
  const long long n = (long long)rows * (inter / 4);  // a thread per 4 elements
  if (n == 0) return 0;
  const unsigned grid = unsigned((n + 255) / 256);
  auto st = static_cast<cudaStream_t>(stream);
  const int* pr = static_cast<const int*>(pair);
  const float* d = static_cast<const float*>(dh);
  float *og = static_cast<float*>(dg), *ou = static_cast<float*>(du), *oh = static_cast<float*>(h);
  auto* oc = static_cast<uint8_t*>(codes);
  auto* os = static_cast<uint8_t*>(scales);
  const auto launch = [&](auto rows_of_gu) {
    if (limit > 0.f)
      mxg::swiglu_backward_kernel<true><<<grid, 256, 0, st>>>(rows_of_gu, pr, d, rows, inter, limit, og, ou, oh, oc, os);
    else
      mxg::swiglu_backward_kernel<false><<<grid, 256, 0, st>>>(rows_of_gu, pr, d, rows, inter, 0.f, og, ou, oh, oc, os);
  };
  if (pr != nullptr)
    launch(mxg::PairBf16Rows{static_cast<const bf16*>(gu)});
  else
    launch(mxg::PaddedF32Rows{static_cast<const float*>(gu)});
  return int(cudaGetLastError());
}

// SwiGLU's backward with the weight gradients' operands as MX values (v0.66, mx_rows.cuh
// swiglu_backward_cols_kernel; mx_gemm.swiglu_backward with values_rows): [dg | du]'s codes and
// scales along 2 I as mokgen_mx_swiglu_backward writes them, and instead of dg, du and h float32,
// their MX values along the rows as bf16 [out_rows, I] each (padded block b to output block
// block_out[b], none where < 0; rows from *out_end on zeroed). I a multiple of 128, rows of 128.
int mokgen_mx_swiglu_backward_values(void* h_out, void* dg_out, void* du_out, void* codes, void* scales, const void* gu,
                                     const void* dh, const void* pair, const void* block_out, const void* out_end,
                                     int rows, int inter, int out_rows, float limit, void* stream) {
  using namespace mokgen;
  if (rows < 0 || rows % 128 || inter <= 0 || inter % 128 || out_rows < 0 || out_rows % mx::kBlock ||
      block_out == nullptr || out_end == nullptr)
    return int(cudaErrorInvalidValue);
  if (rows == 0) return 0;
  const dim3 grid(unsigned(inter / mxg::kColTileCols), unsigned(rows / mxg::kColTileRows), 1u);
  if (grid.y > 65535) return int(cudaErrorInvalidValue);
  auto st = static_cast<cudaStream_t>(stream);
  const int* pr = static_cast<const int*>(pair);
  const float* d = static_cast<const float*>(dh);
  auto* oc = static_cast<uint8_t*>(codes);
  auto* os = static_cast<uint8_t*>(scales);
  const int* bo = static_cast<const int*>(block_out);
  const int* oe = static_cast<const int*>(out_end);
  bf16 *oh = static_cast<bf16*>(h_out), *og = static_cast<bf16*>(dg_out), *ou = static_cast<bf16*>(du_out);
  cudaError_t err = cudaSuccess;
  const auto launch = [&](auto kernel, auto rows_of_gu) {
    // above 48 KB of dynamic shared memory a kernel must opt in (per instantiation; cheap to repeat)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, mxg::kSwigluColsSmem);
    if (err != cudaSuccess) return;
    kernel<<<grid, mxg::kColThreads, mxg::kSwigluColsSmem, st>>>(rows_of_gu, pr, d, rows, inter, limit, oc, os, bo, oe,
                                                                  out_rows, oh, og, ou);
  };
  if (pr != nullptr) {
    using R = mxg::PairBf16Rows;
    const R g{static_cast<const bf16*>(gu)};
    limit > 0.f ? launch(mxg::swiglu_backward_cols_kernel<true, R>, g) : launch(mxg::swiglu_backward_cols_kernel<false, R>, g);
  } else {
    using R = mxg::PaddedF32Rows;
    const R g{static_cast<const float*>(gu)};
    limit > 0.f ? launch(mxg::swiglu_backward_cols_kernel<true, R>, g) : launch(mxg::swiglu_backward_cols_kernel<false, R>, g);
  }
  if (err != cudaSuccess) return int(err);
  return int(cudaGetLastError());
}

// Grouped: rows of A in segments of whole 128-row tiles, one expert's each. `tiles` (device,
// int32 pairs) lists the row tiles as (expert e, first row m0); C's rows m0 .. m0 + 127 get
// A's rows times expert e's B, where B holds E experts' codes [E, N, K] and their scales
// [E, K / 128, N, 4]. Rows outside every tile are not written.
int mokgen_mx_grouped_gemm(int form, void* c, const void* a, const void* sa, const void* b, const void* sb,
                           const void* tiles, int n_tiles, int M, int N, int K, int E, void* stream) {
  return mokgen::mxg::launch_form(form, c, a, sa, b, sb, static_cast<const int2*>(tiles), n_tiles, M, N, K, E, stream);
}

}  // extern "C"
