// Probe (H200, not in CI): is the GPU idle between a persistent kernel (plain, cooperative, cluster
// of two, or both) and small kernels enqueued while it runs? A 3 ms spin kernel on every SM (200 KB
// of shared memory each), then three tiny kernels, either enqueued 0.6 ms into the spin or before
// it (behind a plain sleep kernel), with or without a side-stream device-to-host copy after the
// spin (as EpBuffers.watch does). Prints the gap from the spin's last CTA to the first and third
// tiny kernel (%globaltimer), median of 7. docs/perf-notes.md v0.15: 1.6-1.9 us in all 16 cases.
// Build and run: nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a .ci/idle_probe.cu -o /tmp/idle_probe && /tmp/idle_probe
#include <cuda_runtime.h>
#include <cstdio>
#include <chrono>
#include <thread>
#include <vector>
#include <algorithm>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
__device__ __forceinline__ unsigned long long gt() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__global__ void spin(long long ns, unsigned long long* t) {
  extern __shared__ char smem[];
  unsigned long long s = gt();
  if (threadIdx.x == 0 && blockIdx.x == 0) t[0] = s;
  while ((long long)(gt() - s) < ns) {}
  smem[threadIdx.x] = 1;
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(&t[1], gt());
}
__global__ void tiny(unsigned long long* t, int slot) { if (threadIdx.x == 0 && blockIdx.x == 0) t[slot] = gt(); }
__global__ void plain_sleep(long long ns) { unsigned long long s = gt(); while ((long long)(gt() - s) < ns) {} }

static void busy_wait_us(double us) { auto t0 = std::chrono::steady_clock::now(); while (std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() < us) {} }

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int smem = 200 * 1024, threads = 384;
  CK(cudaFuncSetAttribute(spin, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  unsigned long long* t; CK(cudaMalloc(&t, 64 * 8));
  unsigned long long* h; CK(cudaMallocHost(&h, 64 * 8));
  void* pinned; CK(cudaMallocHost(&pinned, 4096));
  void* dbuf; CK(cudaMalloc(&dbuf, 4096));
  cudaStream_t st, side; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t ev; CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  long long ns = 3000000;
  const char* modes[] = {"plain", "coop", "cluster2", "cluster2+coop"};
  for (int prequeue = 0; prequeue < 2; ++prequeue)
  for (int copy = 0; copy < 2; ++copy)
  for (int m = 0; m < 4; ++m) {
    std::vector<double> gaps1, gaps3, startlat;
    for (int rep = 0; rep < 7; ++rep) {
      CK(cudaMemsetAsync(t, 0, 64 * 8, st)); CK(cudaStreamSynchronize(st));
      if (prequeue) plain_sleep<<<1, 32, 0, st>>>(20000000);  // host far ahead
      long long nsa = ns; void* args[] = {&nsa, &t};
      int grid = sms;
      cudaLaunchAttribute at[2]; int na = 0;
      if (m >= 2) { at[na].id = cudaLaunchAttributeClusterDimension; at[na].val.clusterDim.x = 2; at[na].val.clusterDim.y = 1; at[na].val.clusterDim.z = 1; ++na; grid = sms / 2 * 2; }
      if (m == 1 || m == 3) { at[na].id = cudaLaunchAttributeCooperative; at[na].val.cooperative = 1; ++na; }
      cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(grid); cfg.blockDim = dim3(threads); cfg.dynamicSmemBytes = smem; cfg.stream = st; cfg.attrs = at; cfg.numAttrs = na;
      if (m == 1) CK(cudaLaunchCooperativeKernel((void*)spin, dim3(grid), dim3(threads), args, smem, st));
      else CK(cudaLaunchKernelExC(&cfg, (const void*)spin, args));
      if (copy) { CK(cudaEventRecord(ev, st)); CK(cudaStreamWaitEvent(side, ev, 0)); CK(cudaMemcpyAsync(pinned, dbuf, 256, cudaMemcpyDeviceToHost, side)); }
      if (!prequeue) busy_wait_us(600);
      tiny<<<1, 32, 0, st>>>(t, 2);
      tiny<<<1, 32, 0, st>>>(t, 3);
      tiny<<<1, 32, 0, st>>>(t, 4);
      CK(cudaMemcpyAsync(h, t, 64 * 8, cudaMemcpyDeviceToHost, st));
      CK(cudaStreamSynchronize(st)); CK(cudaDeviceSynchronize());
      gaps1.push_back((h[2] - h[1]) / 1e3); gaps3.push_back((h[4] - h[1]) / 1e3);
      startlat.push_back((h[1] - h[0]) / 1e3);
    }
    std::sort(gaps1.begin(), gaps1.end()); std::sort(gaps3.begin(), gaps3.end()); std::sort(startlat.begin(), startlat.end());
    printf("%-14s prequeue=%d sidecopy=%d  spin %.1f us  gap to 1st tiny: med %.1f min %.1f max %.1f us; to 3rd: med %.1f us\n",
           modes[m], prequeue, copy, startlat[3], gaps1[3], gaps1[0], gaps1[6], gaps3[3]);
  }
  return 0;
}
