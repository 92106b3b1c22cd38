// The tensor core's rate for the wgmma shapes and operand majors the kernels use, with no loads:
// each consumer warpgroup issues batches of 4 k16 steps on a fixed shared-memory stage (zeros),
// committing each batch and waiting until at most `depth` batches are in flight, as the
// mainloops do (depth 1). One CTA per SM, so the clock is the loaded one.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -I templates/include -I $CUTLASS/include .ci/wgmma_rate_probe.cu -o /tmp/wgmma_rate
// Output per variant: SM cycles per m64nNk16 step per warpgroup, and the SM's dense rate as bf16
// flops per cycle (4096 is the H100/H200 peak per SM). "tile T" variants (v0.27) drain the
// pipeline (wait<0>) every T batches, as a weight-gradient tile of T k-blocks does at its end:
// the cost of a short tile's fill and drain, with no loads, barriers or epilogue.
#include <cstdio>
#include <utility>

// the kernels' own descriptors: K-major rows of 128 bytes (hopper_gemm.cuh) and MN-major 64 x 64
// boxes (bwd_gemm.cuh), both in the 128-byte swizzle
#include "mokgen/bwd_gemm.cuh"

using namespace cute::SM90::GMMA;
using mokgen::bwd::kBox;  // one 64 x 64 bf16 box

__device__ uint64_t desc(const void* p, bool mn) {
  return mn ? mokgen::bwd::smem_desc_mn(p) : mokgen::sm90::smem_desc_k<128>(p);
}

template <int kN, bool kAMN, bool kBMN>
using Op = std::conditional_t<kN == 256, MMA_64x256x16_F32BF16BF16_SS<kAMN ? Major::MN : Major::K, kBMN ? Major::MN : Major::K>,
                              MMA_64x128x16_F32BF16BF16_SS<kAMN ? Major::MN : Major::K, kBMN ? Major::MN : Major::K>>;

template <int kN, bool kAMN, bool kBMN, size_t... Is>
__device__ void step(uint64_t da, uint64_t db, float* acc, std::index_sequence<Is...>) {
  Op<kN, kAMN, kBMN>::fma(da, db, acc[Is]..., ScaleOut::One);
}

// kHalves: wgmma per k16 step per warpgroup (2 for the ping-pong's two m64n128 halves).
template <int kN, bool kAMN, bool kBMN, int kHalves, int kDepth, int kTile = 0>
__global__ void __launch_bounds__(384, 1) probe(int wgs, int iters, long long* cycles) {
  extern __shared__ __align__(1024) unsigned char smem[];
  constexpr int kAcc = kN / 2;
  const int wg = threadIdx.x / 128;
  if (wg >= wgs) return;
  float acc[kHalves * kAcc];
#pragma unroll
  for (int i = 0; i < kHalves * kAcc; ++i) acc[i] = 0.f;
  unsigned char* sa = smem + wg * 2 * kBox;
  unsigned char* sb = smem + 4 * kBox;
  __syncwarp();
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < kHalves * kAcc; ++i) cute::warpgroup_fence_operand(acc[i]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int k16 = 0; k16 < 4; ++k16)
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
        step<kN, kAMN, kBMN>(desc(sa + h * kBox + (kAMN ? k16 * 2048 : k16 * 32), kAMN),
                             desc(sb + (kBMN ? k16 * 2048 : k16 * 32), kBMN), acc + h * kAcc,
                             std::make_index_sequence<kAcc>{});
    cute::warpgroup_commit_batch();
    if (kTile > 0 && it % kTile == kTile - 1)
      cute::warpgroup_wait<0>();  // the end of a tile: its accumulators complete
    else
      cute::warpgroup_wait<kDepth>();
#pragma unroll
    for (int i = 0; i < kHalves * kAcc; ++i) cute::warpgroup_fence_operand(acc[i]);
  }
  cute::warpgroup_wait<0>();
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kHalves * kAcc; ++i) s += acc[i];
  if ((threadIdx.x & 127) == 0) cycles[blockIdx.x * 3 + wg] = t1 - t0;
  if (s == 12345.f) cycles[0] = 0;  // keep acc live
}

template <int kN, bool kAMN, bool kBMN, int kHalves, int kDepth, int kTile = 0>
void run(const char* name, int wgs, long long* d_cycles, int sms) {
  auto k = probe<kN, kAMN, kBMN, kHalves, kDepth, kTile>;
  const int smem = 4 * kBox + 4 * kBox + 1024;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int iters = 4000;
  cudaMemset(d_cycles, 0, sms * 3 * sizeof(long long));
  k<<<sms, 384, smem>>>(wgs, 200, d_cycles);  // warm-up
  k<<<sms, 384, smem>>>(wgs, iters, d_cycles);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    printf("%s: launch failed: %s\n", name, cudaGetErrorString(cudaGetLastError()));
    return;
  }
  long long h[3 * 1024];
  cudaMemcpy(h, d_cycles, sms * 3 * sizeof(long long), cudaMemcpyDeviceToHost);
  double sum = 0;
  for (int b = 0; b < sms; ++b)
    for (int w = 0; w < wgs; ++w) sum += double(h[b * 3 + w]);
  const double cyc = sum / (sms * wgs);
  const double steps = double(iters) * 4 * kHalves;  // wgmma per warpgroup
  const double per = cyc / steps;
  const double flops = 2.0 * 64 * kN * 16 * wgs / per;  // per SM cycle
  printf("%-34s wgs %d depth %d tile %d: %7.1f cycles per m64n%dk16 per warpgroup, %6.0f flops/cycle/SM (%.0f%% of 4096)\n",
         name, wgs, kDepth, kTile, per, kN, flops, 100.0 * flops / 4096);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  long long* d = nullptr;
  cudaMalloc(&d, sms * 3 * sizeof(long long));
  for (int wgs = 1; wgs <= 2; ++wgs) {
    run<256, false, false, 1, 1>("n256 A K-major, B K-major", wgs, d, sms);
    run<256, true, true, 1, 1>("n256 A MN-major, B MN-major", wgs, d, sms);
    run<256, false, true, 1, 1>("n256 A K-major, B MN-major", wgs, d, sms);
    run<256, true, false, 1, 1>("n256 A MN-major, B K-major", wgs, d, sms);
    run<128, true, true, 2, 1>("n128 x2 halves, MN/MN (ping-pong)", wgs, d, sms);
    run<128, false, false, 2, 1>("n128 x2 halves, K/K", wgs, d, sms);
  }
  run<256, true, true, 1, 0>("n256 MN/MN", 1, d, sms);
  run<256, false, false, 1, 0>("n256 K/K", 1, d, sms);
  run<128, true, true, 2, 0>("n128 x2 halves, MN/MN", 1, d, sms);
  run<256, true, true, 1, 2>("n256 MN/MN", 1, d, sms);
  run<128, true, true, 2, 2>("n128 x2 halves, MN/MN", 1, d, sms);
  // short tiles: kimi-k2.5's local weight tiles hold 5-6 k-blocks (297-378 rows per expert)
  run<128, true, true, 2, 1, 6>("n128 x2 halves, MN/MN", 1, d, sms);
  run<128, true, true, 2, 1, 3>("n128 x2 halves, MN/MN", 1, d, sms);
  run<256, true, true, 1, 1, 6>("n256 MN/MN", 1, d, sms);
  run<256, true, true, 1, 1, 6>("n256 MN/MN", 2, d, sms);
  cudaFree(d);
  return 0;
}
