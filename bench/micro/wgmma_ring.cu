// wgmma_ring.cu — the tensor core's rate in the megakernels' mainloop shape, with no
// other work: two warpgroups, each K block one sm90_common.cuh mma_block (four k16
// steps of m64n256k16 over a 48 KB stage: A two 64 x 64 boxes, B four, 128-byte
// swizzle), one group a block in flight (`wgmma.wait_group 1`), a ring of kStages
// stages. Each operand K-major or MN-major (TA, TB); with `loads`, thread 0 refills each
// stage kStages - 1 blocks ahead with 48 KB bulk copies from an L2-resident buffer
// behind full/empty mbarriers, as gemm_tiles does with TMA (a linear copy: the same
// bytes, not the same banks). Prints SM cycles a K block: 1024 is the peak (docs/PERF.md,
// seventh session). With one warpgroup (no loads) the second only waits: its cycles a K
// block show whether one warpgroup's wgmmas alone fill the tensor pipe (512: they do),
// which staggered warpgroups (one's epilogue beside the other's wgmmas) would need
// (twentieth session). `tma L2` and `tma DRAM` load each stage as gemm_tiles does, six
// TMA boxes of 64 x 64 (128-byte swizzle) through a tensor map, from an 8 MB matrix
// (L2-resident) or a 1 GiB one (DRAM), every CTA at other coordinates: whether TMA box
// loads with kStages - 1 blocks ahead keep up with the wgmmas (twentieth session: the
// weight gradients' mainloop waits for its stages though L2 hits 93% of their sectors).
// The operands are arbitrary bf16 bits; only the time is read.
//   make micro && build/micro/wgmma_ring
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstdio>

#include "cuda/sm90_common.cuh"

using namespace mok;

constexpr int kCtas = 132;
constexpr int kBlocks = 2048;      // K blocks a CTA
constexpr int kSourceStages = 64;  // the loads' source: 3 MB, L2-resident
enum { kNoLoads, kBulk, kTmaL2, kTmaDram };
const char* const kLoadNames[] = {"no loads", "loads", "tma L2", "tma DRAM"};

template <int TA, int TB, int kLoads, int kWgs = 2>
__global__ void __launch_bounds__(kThreads, 1) ring(const uint8_t* src, float* sink, long long* cycles,
                                                    const __grid_constant__ CUtensorMap map, int rows64, int cols64) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* stages = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  __shared__ uint64_t full[kStages], empty[kStages];
  for (int i = threadIdx.x; i < kStages * kStageBytes / 4; i += kThreads)
    reinterpret_cast<uint32_t*>(stages)[i] = 0x3c003c00u ^ ((i * 2654435761u) & 0x00ff00ffu);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; s++) mbar_init(&full[s], 1), mbar_init(&empty[s], 2);
    fence_mbar_init();
  }
  __syncthreads();
  const int tid = threadIdx.x, wg = tid / 128;
  auto load = [&](int b) {  // thread 0: block b into its stage, once both warpgroups freed it
    const int s = b % kStages;
    if (b >= kStages)
      while (!mbar_try_wait(&empty[s], ((b / kStages) & 1) ^ 1)) {
      }
    mbar_arrive_expect_tx(&full[s], kStageBytes);
    if (kLoads == kBulk) {
      bulk_load(stages + s * kStageBytes, src + (size_t)((b * 7 + blockIdx.x) % kSourceStages) * kStageBytes,
                kStageBytes, &full[s]);
    } else {
#pragma unroll
      for (int i = 0; i < 6; i++)  // A boxes 0-1, B boxes 2-5
        tma_load_2d(stages + s * kStageBytes + i * kBoxBytes, &map, &full[s],
                    64 * ((b + i + (int)blockIdx.x) % cols64), 64 * ((b * 7 + i * 3 + (int)blockIdx.x * 5) % rows64));
    }
  };
  if (kLoads && tid == 0)
    for (int b = 0; b < kStages - 1; b++) load(b);
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; i++) acc[i] = 0.f;
  const long long t0 = clock64();
  for (int b = 0; b < kBlocks; b++) {
    if (kLoads)
      while (!mbar_try_wait(&full[b % kStages], (b / kStages) & 1)) {
      }
    if (wg < kWgs) {
      mma_block<TA, TB, BK / 16>(acc, stages + (b % kStages) * kStageBytes, wg);
      wgmma_wait<1>();
    }
    if (kLoads) {
      if (b > 0 && tid % 128 == 0) mbar_arrive(&empty[(b - 1) % kStages]);
      if (tid == 0 && b + kStages - 1 < kBlocks) load(b + kStages - 1);
    }
  }
  wgmma_wait<0>();
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kAcc; i++) s += acc[i];
  sink[blockIdx.x * kThreads + tid] = s;
  if (tid == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int TA, int TB, int kLoads, int kWgs = 2>
static void run(const uint8_t* src, float* sink, long long* cycles, const CUtensorMap& map = CUtensorMap{},
                int rows = 64, int cols = 64) {
  static_assert(kWgs == 2 || !kLoads, "with loads both warpgroups release the stages");
  const int smem = kStages * kStageBytes + 1024;
  cudaFuncSetAttribute(ring<TA, TB, kLoads, kWgs>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  for (int rep = 0; rep < 2; rep++)
    ring<TA, TB, kLoads, kWgs><<<kCtas, kThreads, smem>>>(src, sink, cycles, map, rows / 64, cols / 64);
  long long h[kCtas];
  cudaMemcpy(h, cycles, sizeof h, cudaMemcpyDeviceToHost);
  double mean = 0;
  for (long long c : h) mean += (double)c / kCtas;
  printf("%-8s A %-8s B %-8s %7.1f SM cycles a K block%s\n", kLoadNames[kLoads], TA ? "MN-major" : "K-major",
         TB ? "MN-major" : "K-major", mean / kBlocks, kWgs == 1 ? " (one warpgroup: its 64 rows)" : "");
}

int main() {
  uint8_t* src;
  float* sink;
  long long* cycles;
  if (cudaMalloc(&src, (size_t)kSourceStages * kStageBytes) != cudaSuccess ||
      cudaMalloc(&sink, sizeof(float) * kCtas * kThreads) != cudaSuccess ||
      cudaMalloc(&cycles, sizeof(long long) * kCtas) != cudaSuccess) {
    fprintf(stderr, "wgmma_ring: no GPU memory\n");
    return 1;
  }
  cudaMemset(src, 0x11, (size_t)kSourceStages * kStageBytes);
  run<0, 0, kNoLoads>(src, sink, cycles);
  run<1, 1, kNoLoads>(src, sink, cycles);
  run<0, 0, kNoLoads, 1>(src, sink, cycles);
  run<0, 0, kBulk>(src, sink, cycles);
  run<0, 1, kBulk>(src, sink, cycles);
  run<1, 0, kBulk>(src, sink, cycles);
  run<1, 1, kBulk>(src, sink, cycles);
  // TMA boxes: an [rows, cols] bf16 matrix, 64 x 64 boxes, as the library's maps
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      !fn) {
    fprintf(stderr, "wgmma_ring: no cuTensorMapEncodeTiled\n");
    return 1;
  }
  const auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  for (int dram = 0; dram < 2; dram++) {
    const int rows = dram ? 65536 : 2048, cols = dram ? 8192 : 2048;  // 1 GiB or 8 MB
    void* m = nullptr;
    if (cudaMalloc(&m, (size_t)rows * cols * 2) != cudaSuccess) {
      fprintf(stderr, "wgmma_ring: no GPU memory for the TMA matrix\n");
      return 1;
    }
    cudaMemset(m, 0x11, (size_t)rows * cols * 2);
    CUtensorMap map;
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)cols * 2};
    const cuuint32_t box[2] = {64, 64}, elem[2] = {1, 1};
    if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, m, dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      fprintf(stderr, "wgmma_ring: cuTensorMapEncodeTiled failed\n");
      return 1;
    }
    if (dram) {
      run<0, 0, kTmaDram>(src, sink, cycles, map, rows, cols);
      run<1, 1, kTmaDram>(src, sink, cycles, map, rows, cols);
    } else {
      run<0, 0, kTmaL2>(src, sink, cycles, map, rows, cols);
      run<1, 1, kTmaL2>(src, sink, cycles, map, rows, cols);
    }
    cudaDeviceSynchronize();
    cudaFree(m);
  }
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) fprintf(stderr, "wgmma_ring: %s\n", cudaGetErrorString(e));
  return e != cudaSuccess;
}
