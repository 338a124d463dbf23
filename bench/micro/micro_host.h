// micro_host.h — the microbenchmarks' host-side helpers: tensor maps encoded as the
// library's are (2-D bf16, boxes of 64 columns x box_rows, 128-byte swizzle, L2
// promotion of 128 bytes) through the driver's cuTensorMapEncodeTiled found at run time
// (no -lcuda), and launch configurations in clusters.
#pragma once
#include <cudaTypedefs.h>

#include <cuda_runtime.h>

#include <cstdio>

// A map of the [rows, cols] bf16 matrix at base; false (and a line on stderr naming
// `who`) when the driver has no encoder or refuses the map.
static inline bool bf16_map(const char* who, CUtensorMap* map, void* base, int rows, int cols, int box_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (!encode) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        !fn) {
      fprintf(stderr, "%s: no cuTensorMapEncodeTiled\n", who);
      return false;
    }
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)cols * 2};
  const cuuint32_t box[2] = {64, (cuuint32_t)box_rows}, elem[2] = {1, 1};
  if (encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    fprintf(stderr, "%s: cuTensorMapEncodeTiled failed (%d x %d, boxes of 64 x %d)\n", who, rows, cols, box_rows);
    return false;
  }
  return true;
}

// grid CTAs of `threads` threads and smem bytes of dynamic shared memory, in clusters of
// cl (1: a cluster of one, as a plain launch). *attr holds the cluster attribute: it must
// outlive the configuration's use (as cuda_backend.cu's launch_config).
static inline cudaLaunchConfig_t cluster_config(int grid, int cl, int threads, int smem, cudaLaunchAttribute* attr) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = cl, attr->val.clusterDim.y = 1, attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3(grid), lc.blockDim = dim3(threads), lc.dynamicSmemBytes = smem;
  lc.attrs = attr, lc.numAttrs = 1;
  return lc;
}
