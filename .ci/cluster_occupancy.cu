// How many clusters of 1, 2, 4 and 8 CTAs can be resident at once on this GPU for a kernel shaped
// like the forward megakernel (one CTA per SM: 384 threads, the opt-in maximum of shared memory),
// by cudaOccupancyMaxActiveClusters; so how many SMs whole clusters leave idle (v0.50's "Next":
// count them before any 2 x 2 cluster build). Build: nvcc -std=c++17 -O2
// -gencode=arch=compute_90a,code=sm_90a .ci/cluster_occupancy.cu -o cluster_occupancy; run on the GPU.
#include <cstdio>
#include <cuda_runtime.h>

__global__ void probe_kernel(int* out) {
  extern __shared__ int smem[];
  if (threadIdx.x == 0 && out != nullptr) out[blockIdx.x] = smem[0];
}

int main() {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) { std::printf("no GPU\n"); return 1; }
  const int smem = static_cast<int>(prop.sharedMemPerBlockOptin);
  cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  std::printf("%s: %d SMs, %d bytes of shared memory per CTA (opt-in)\n", prop.name, prop.multiProcessorCount, smem);
  for (int c : {1, 2, 4, 8, 16}) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(c * 256);
    cfg.blockDim = dim3(384);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = c;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = -1;
    cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, probe_kernel, &cfg);
    if (e != cudaSuccess) {
      std::printf("cluster %2d: %s\n", c, cudaGetErrorString(e));
      cudaGetLastError();
      continue;
    }
    std::printf("cluster %2d: %3d clusters resident, %3d CTAs, %3d SMs idle\n", c, clusters, clusters * c,
                prop.multiProcessorCount - clusters * c);
  }
  return 0;
}
