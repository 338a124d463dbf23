// cluster_fit.cu — how many CTAs of one SM each (the megakernels' shape: 256 threads,
// ~200 KB of dynamic shared memory) run at once in clusters of 1, 2, 4 and 8, by
// cudaOccupancyMaxActiveClusters. A cluster's CTAs must share a GPC, so an SM count per
// GPC that the cluster size does not divide leaves SMs idle: the question for clusters
// of 4 (two m-tiles by two column tiles, or four m-tiles sharing B: docs/PERF.md,
// twentieth session), against the 132 CTAs of pairs.
//   make micro && build/micro/cluster_fit
#include <cstdio>

#include "micro_host.h"

__global__ void one_cta_per_sm(int* out) {
  extern __shared__ int smem[];
  smem[threadIdx.x] = (int)threadIdx.x;
  __syncthreads();
  if (threadIdx.x == 0 && out) out[blockIdx.x] = smem[1];
}

int main() {
  int dev = 0, sms = 0, smem_max = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  const int smem = 200 * 1024 < smem_max ? 200 * 1024 : smem_max;
  if (cudaFuncSetAttribute(one_cta_per_sm, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
      cudaFuncSetAttribute(one_cta_per_sm, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    printf("cluster_fit: cudaFuncSetAttribute failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  printf("%d SMs, %d KB of dynamic shared memory a CTA, 256 threads\n", sms, smem / 1024);
  for (int size = 1; size <= 16; size *= 2) {
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t lc = cluster_config(size * (sms / size), size, 256, smem, &attr);
    int clusters = 0;
    const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, one_cta_per_sm, &lc);
    if (e != cudaSuccess) {
      printf("clusters of %2d: %s\n", size, cudaGetErrorString(e));
      cudaGetLastError();
      continue;
    }
    printf("clusters of %2d: %3d at once, %3d CTAs (%d SMs idle)\n", size, clusters, clusters * size,
           sms - clusters * size);
  }
  return 0;
}
