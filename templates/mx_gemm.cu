// MXFP8 GEMM on sm_90a (issue 6, first piece; not used by the megakernel yet): C = A B^T with
// A [M, K] and B [N, K] as E4M3 codes plus one E8M0 scale per 32 consecutive k (OCP MX), C [M, N]
// float32. The FP8 wgmma has no block scales, so each 32-wide k step runs as its own wgmma into
// a scratch accumulator (scale-d 0), and the consumer promotes it into the float32 sum with the
// product of the row's and the column's scale: acc += (tmp * 2^(ea - 127)) * 2^(eb - 127). Both
// factors are powers of two, so the only roundings are the tensor core's within the 32 products
// and the one add per promotion.
//
// Tile: 128 x 128 (consumer warpgroup c owns rows 64 c .. 64 c + 63; a producer warp issues the
// TMA), k-blocks of 128 codes (four
// k32 steps) in a ring of kStages stages of 32 KB loaded by TMA (two 64-row boxes per operand,
// 128-byte rows, SWIZZLE_128B); the consumers read the scales from global memory, one 32-bit
// word per row and column and k-block (its four k32 scales). One tile per CTA. This first form
// waits for each k32 wgmma before promoting it; the two consumer warpgroups interleave on the
// tensor core. Correctness first: the layout of the scales and the promotion are what the later
// kernels reuse.
//
// Built by mokgen.mx_gemm.build_library (build.build_source, CUTLASS/CuTe headers as a library).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include <cstdint>
#include <utility>

#include "mokgen/hopper_gemm.cuh"

namespace mokgen {
namespace mxg {

constexpr int kBM = 128, kBN = 128, kBK = 128;  // kBK in codes (bytes) = four k32 steps
constexpr int kStages = 4;
constexpr int kBoxBytes = 64 * kBK;                // one 64-row box
constexpr int kStageBytes = 4 * kBoxBytes;         // A: two boxes, B: two boxes (32 KB)
constexpr int kAcc = kBN / 2;                      // float32 accumulators per consumer thread
constexpr size_t kSmemBytes = size_t(kStages) * kStageBytes + 2 * kStages * 8 + 1024;

using Wgmma = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;

template <size_t... Is>
__device__ __forceinline__ void wgmma_k32(uint64_t da, uint64_t db, float (&d)[kAcc], std::index_sequence<Is...>) {
  Wgmma::fma(da, db, d[Is]..., cute::SM90::GMMA::ScaleOut::Zero);
}

// 2^(e - 127) for an E8M0 code e as a float32: e >= 1 a normal number, 0 the subnormal 2^-127,
// 255 NaN (MX: the block's values are NaN)
__device__ __forceinline__ float scale(uint32_t e) {
  return e == 0xffu ? __uint_as_float(0x7fc00000u) : e ? __uint_as_float(e << 23) : __uint_as_float(0x00400000u);
}

// Threads: the two consumer warpgroups alone (256), thread 0 issuing the TMA loads between its
// k-blocks. A producer warpgroup (384 threads) or warp (288: three warps on one of the SM's four
// register files) leaves 168 registers per thread, and acc, tmp and the scales of a step spilled
// there (setmaxnreg did not raise ptxas's budget); with 256, ptxas has 255.
constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads, 1)
    mx_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                   const uint8_t* __restrict__ sa, const uint8_t* __restrict__ sb, float* __restrict__ c, int M,
                   int N, int K) {
  extern __shared__ __align__(1024) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kStages;
  unsigned char* stages =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem) + 2 * kStages * 8 + 1023) & ~uintptr_t(1023));
  const int tid = threadIdx.x, t = tid & 127;
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN, n_k = K / kBK, ks = K / 32;
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) {
      sm90::mbar_init(&full[i], 1);
      sm90::mbar_init(&empty[i], 2);  // one arrival per consumer warpgroup
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  // k-block kb into stage kb % kStages (thread 0)
  auto load = [&](int kb) {
    const int s = kb % kStages;
    unsigned char* st = stages + size_t(s) * kStageBytes;
    sm90::mbar_arrive_expect_tx(&full[s], kStageBytes);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      cute::SM90_TMA_LOAD_2D::copy(&map_a, &full[s], 0, st + h * kBoxBytes, kb * kBK, m0 + 64 * h);
      cute::SM90_TMA_LOAD_2D::copy(&map_b, &full[s], 0, st + (2 + h) * kBoxBytes, kb * kBK, n0 + 64 * h);
    }
  };
  if (tid == 0)
    for (int kb = 0; kb < kStages && kb < n_k; ++kb) load(kb);
  const int c_wg = tid / 128, w = t >> 5, lane = t & 31, q = lane & 3;
  // this thread's rows (two) and columns (two per n8 group) of the tile
  const int r0 = m0 + 64 * c_wg + 16 * w + (lane >> 2);
  float acc[kAcc], tmp[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
  const uint32_t* sa_w = reinterpret_cast<const uint32_t*>(sa);  // a row's four k32 scales of a k-block
  const uint32_t* sb_w = reinterpret_cast<const uint32_t*>(sb);
  const int words = ks / 4;  // 32-bit scale words per row (K % 128 == 0)
  for (int kb = 0; kb < n_k; ++kb) {
    const int s = kb % kStages;
    // the k-block's scales, one word per row and column (before the stage's wait: their loads
    // overlap it)
    const uint32_t wa0 = __ldg(sa_w + size_t(r0) * words + kb), wa1 = __ldg(sa_w + size_t(r0 + 8) * words + kb);
    uint32_t wb[32];
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wb[2 * i + j] = __ldg(sb_w + size_t(n0 + 8 * i + 2 * q + j) * words + kb);
    sm90::mbar_wait(&full[s], (kb / kStages) & 1u);
    const unsigned char* st = stages + size_t(s) * kStageBytes;
#pragma unroll
    for (int k32 = 0; k32 < kBK / 32; ++k32) {
      sm90::fence_operands(tmp);
      cute::warpgroup_arrive();
      wgmma_k32(sm90::smem_desc_k<128>(st + c_wg * kBoxBytes + k32 * 32),
                sm90::smem_desc_k<128>(st + 2 * kBoxBytes + k32 * 32), tmp, std::make_index_sequence<kAcc>{});
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      sm90::fence_operands(tmp);
      const float fa0 = scale((wa0 >> (8 * k32)) & 0xffu), fa1 = scale((wa1 >> (8 * k32)) & 0xffu);
#pragma unroll
      for (int i = 0; i < 16; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float fb = scale((wb[2 * i + j] >> (8 * k32)) & 0xffu);
          acc[4 * i + j] = fmaf(tmp[4 * i + j] * fa0, fb, acc[4 * i + j]);
          acc[4 * i + 2 + j] = fmaf(tmp[4 * i + 2 + j] * fa1, fb, acc[4 * i + 2 + j]);
        }
    }
    if (t == 0) sm90::mbar_arrive(&empty[s]);  // the stage's reads retired (wait<0> above)
    if (tid == 0 && kb + kStages < n_k) {  // refill the stage once both warpgroups released it
      sm90::mbar_wait(&empty[s], (kb / kStages) & 1u);
      load(kb + kStages);
    }
  }
  // acc[4 i + {0, 1}]: row r0, columns n0 + 8 i + 2 q + {0, 1}; acc[4 i + {2, 3}]: row r0 + 8
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int col = n0 + 8 * i + 2 * q;
    *reinterpret_cast<float2*>(c + size_t(r0) * N + col) = make_float2(acc[4 * i], acc[4 * i + 1]);
    *reinterpret_cast<float2*>(c + size_t(r0 + 8) * N + col) = make_float2(acc[4 * i + 2], acc[4 * i + 3]);
  }
}

// uint8 [rows, cols] row-major -> a map of 64-row x 128-byte boxes, 128-byte swizzle
inline CUresult encode_codes(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult qr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &qr) != cudaSuccess ||
        qr != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols};
  const cuuint32_t box[2] = {uint32_t(kBK), 64};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

}  // namespace mxg
}  // namespace mokgen

extern "C" {

// C [M, N] float32 = A [M, K] B [N, K]^T, MXFP8 (codes uint8 E4M3, scales uint8 E8M0 [rows, K / 32]).
// M, N, K multiples of 128. Returns 0 or a CUDA error code.
int mokgen_mx_gemm(void* c, const void* a, const void* sa, const void* b, const void* sb, int M, int N, int K,
                   void* stream) {
  using namespace mokgen::mxg;
  if (M % kBM || N % kBN || K % kBK || M <= 0 || N <= 0 || K <= 0) return int(cudaErrorInvalidValue);
  CUtensorMap ma, mb;
  if (encode_codes(&ma, a, uint64_t(M), uint64_t(K)) != CUDA_SUCCESS ||
      encode_codes(&mb, b, uint64_t(N), uint64_t(K)) != CUDA_SUCCESS)
    return int(cudaErrorInvalidValue);
  static bool attr = false;
  if (!attr) {
    const cudaError_t e = cudaFuncSetAttribute(mx_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes));
    if (e != cudaSuccess) return int(e);
    attr = true;
  }
  mx_gemm_kernel<<<dim3(N / kBN, M / kBM), kThreads, kSmemBytes, static_cast<cudaStream_t>(stream)>>>(
      ma, mb, static_cast<const uint8_t*>(sa), static_cast<const uint8_t*>(sb), static_cast<float*>(c), M, N, K);
  return int(cudaGetLastError());
}

}  // extern "C"
