// Probe (H200): can the up tile's A operand be gathered row by row with 2-D TMA boxes of one row
// (64 bf16 x 1, SWIZZLE_128B) into the layout a 128-row box gives, and at what rate?
// 1. layout: rows gathered one box each into a 1024-aligned stage, compared with the expected
//    128B-swizzled layout (16-byte chunk j of row r at r*128 + ((j ^ (r & 7)) * 16)).
// 2. rate: every SM streams k-blocks of 128 rows x 64 columns through an 8-stage ring
//    (mode 0: two 64-row boxes of contiguous rows; 1: 128 one-row boxes, 4 per lane of a warp;
//    2: 128 one-row boxes from one thread); GB/s over all SMs.
// Runs on an H200, not in CI (docs/perf-notes.md v0.17):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/tgp .ci/tma_gather_probe.cu && /tmp/tgp
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

__device__ __forceinline__ uint32_t su32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_init(uint64_t* b, int n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(su32(b)), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_expect(uint64_t* b, uint32_t bytes) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su32(b)), "r"(bytes) : "memory"); }
__device__ __forceinline__ void bar_arrive(uint64_t* b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(su32(b)) : "memory"); }
__device__ __forceinline__ void bar_wait(uint64_t* b, uint32_t ph) {
  asm volatile("{\n.reg .pred p;\nW_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W_%=;\n}\n" ::"r"(su32(b)), "r"(ph) : "memory");
}
__device__ __forceinline__ void tma2d(const CUtensorMap* m, uint64_t* bar, void* dst, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
               ::"r"(su32(dst)), "l"(m), "r"(su32(bar)), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ unsigned long long gtimer() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }

constexpr int kStages = 8, kStageBytes = 128 * 128;

// one block: warp 0 produces, warp 1 lane 0 consumes
__global__ void __launch_bounds__(64) stream(const __grid_constant__ CUtensorMap row_map, const __grid_constant__ CUtensorMap blk_map,
                                             const int* rows, int n_rows, int kblocks_total, int kcols, int mode,
                                             unsigned long long* t_out, unsigned char* dump) {
  extern __shared__ __align__(1024) unsigned char sm_raw[];
  unsigned char* st = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(sm_raw) + 1023) & ~uintptr_t(1023));
  __shared__ uint64_t full[kStages], empty[kStages];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) { bar_init(&full[s], 1); bar_init(&empty[s], 1); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const unsigned long long t0 = gtimer();
  const int kpr = kcols / 64;  // k-blocks per row
  if (warp == 0) {
    int r4[4];
    for (int kb = 0; kb < kblocks_total; ++kb) {
      const int s = kb % kStages;
      const uint32_t ph = (kb / kStages) & 1;
      const int tile = kb / kpr + blockIdx.x * 7, k0 = (kb % kpr) * 64;
      if (kb % kpr == 0)
        for (int u = 0; u < 4; ++u) r4[u] = rows[(tile * 128 + lane + 32 * u) % n_rows];
      if (kb >= kStages) bar_wait(&empty[s], ph ^ 1);
      unsigned char* dst = st + s * kStageBytes;
      if (lane == 0) bar_expect(&full[s], kStageBytes);
      __syncwarp();
      if (mode == 0) {
        if (lane == 0) {
          const int r0 = (tile * 128) % (n_rows - 128);
          tma2d(&blk_map, &full[s], dst, k0, r0);
          tma2d(&blk_map, &full[s], dst + 64 * 128, k0, r0 + 64);
        }
      } else if (mode == 1) {
        for (int u = 0; u < 4; ++u) tma2d(&row_map, &full[s], dst + (lane + 32 * u) * 128, k0, r4[u]);
      } else {
        if (lane == 0)
          for (int r = 0; r < 128; ++r) tma2d(&row_map, &full[s], dst + r * 128, k0, rows[(tile * 128 + r) % n_rows]);
      }
    }
  } else if (lane == 0) {
    for (int kb = 0; kb < kblocks_total; ++kb) {
      const int s = kb % kStages;
      bar_wait(&full[s], (kb / kStages) & 1);
      if (dump != nullptr && blockIdx.x == 0 && kb == 0)
        for (int i = 0; i < kStageBytes; ++i) dump[i] = st[s * kStageBytes + i];
      bar_arrive(&empty[s]);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) { t_out[2 * blockIdx.x] = t0; t_out[2 * blockIdx.x + 1] = gtimer(); }
}

using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                            const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                            CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static CUtensorMap make_map(Encode enc, void* base, uint64_t rows, uint64_t cols, uint32_t box_rows) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * 2};
  const cuuint32_t box[2] = {64, box_rows};
  const cuuint32_t es[2] = {1, 1};
  CUresult r = enc(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                   CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { printf("encode failed %d\n", int(r)); exit(1); }
  return m;
}

int main() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  Encode enc = reinterpret_cast<Encode>(fn);
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t smem = kStages * kStageBytes + 1024;
  CK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  unsigned long long* t_dev;
  unsigned char* dump;
  CK(cudaMalloc(&t_dev, 2 * sms * 8));
  CK(cudaMalloc(&dump, kStageBytes));
  std::vector<unsigned long long> t(2 * sms);
  for (int cfg = 0; cfg < 2; ++cfg) {
    // cfg 0: x of 4096 rows (16 MB, L2-resident); cfg 1: 131072 rows (512 MB, HBM)
    const int n_x = cfg == 0 ? 4096 : 131072, cols = 2048;
    uint16_t* x;
    int* rows;
    CK(cudaMalloc(&x, size_t(n_x) * cols * 2));
    CK(cudaMalloc(&rows, size_t(n_x) * 4));
    std::vector<uint16_t> hx(size_t(n_x) * cols);
    for (size_t i = 0; i < hx.size(); ++i) hx[i] = uint16_t((i * 2654435761u) >> 7);
    CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    std::vector<int> hr(n_x);
    srand(7);
    for (int i = 0; i < n_x; ++i) hr[i] = rand() % n_x;
    CK(cudaMemcpy(rows, hr.data(), n_x * 4, cudaMemcpyHostToDevice));
    CUtensorMap rm = make_map(enc, x, n_x, cols, 1), bm = make_map(enc, x, n_x, cols, 64);
    if (cfg == 0) {  // layout check, k-block 0 of block 0's first tile (tile = 0)
      stream<<<1, 64, smem>>>(rm, bm, rows, n_x, 1, cols, 1, t_dev, dump);
      CK(cudaDeviceSynchronize());
      std::vector<unsigned char> d(kStageBytes);
      CK(cudaMemcpy(d.data(), dump, kStageBytes, cudaMemcpyDeviceToHost));
      long bad = 0;
      for (int r = 0; r < 128; ++r)
        for (int j = 0; j < 8; ++j)
          for (int b = 0; b < 16; ++b) {
            const unsigned char want = reinterpret_cast<const unsigned char*>(&hx[size_t(hr[r % n_x]) * cols])[j * 16 + b];
            if (d[r * 128 + ((j ^ (r & 7)) * 16) + b] != want) ++bad;
          }
      printf("layout: one-row boxes at 128-byte offsets, %ld of %d bytes differ from the 128B-swizzled layout\n", bad, kStageBytes);
    }
    for (int mode = 0; mode < 3; ++mode) {
      const int kbs = 32 * 64;  // 64 tiles of 32 k-blocks per CTA
      for (int rep = 0; rep < 3; ++rep) {
        stream<<<sms, 64, smem>>>(rm, bm, rows, n_x, kbs, cols, mode, t_dev, nullptr);
        CK(cudaDeviceSynchronize());
      }
      CK(cudaMemcpy(t.data(), t_dev, 2 * sms * 8, cudaMemcpyDeviceToHost));
      unsigned long long lo = ~0ull, hi = 0, sum = 0;
      for (int b = 0; b < sms; ++b) { lo = t[2 * b] < lo ? t[2 * b] : lo; hi = t[2 * b + 1] > hi ? t[2 * b + 1] : hi; sum += t[2 * b + 1] - t[2 * b]; }
      const double bytes = double(sms) * kbs * kStageBytes;
      printf("x %6d rows, mode %d (%s): %.1f GB/s over %d SMs, %.2f ns per k-block per SM (mean)\n", n_x, mode,
             mode == 0 ? "two 64-row boxes" : mode == 1 ? "128 one-row boxes, 4 per lane" : "128 one-row boxes, one thread",
             bytes / double(hi - lo), sms, double(sum) / sms / kbs);
    }
    CK(cudaFree(x));
    CK(cudaFree(rows));
  }
  return 0;
}
