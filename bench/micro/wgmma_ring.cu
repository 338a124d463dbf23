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
// (twentieth session). The operands are arbitrary bf16 bits; only the time is read.
//   make micro && build/micro/wgmma_ring
#include <cstdint>
#include <cstdio>

#include "cuda/sm90_common.cuh"

using namespace mok;

constexpr int kCtas = 132;
constexpr int kBlocks = 2048;      // K blocks a CTA
constexpr int kSourceStages = 64;  // the loads' source: 3 MB, L2-resident

template <int TA, int TB, bool kLoads, int kWgs = 2>
__global__ void __launch_bounds__(kThreads, 1) ring(const uint8_t* src, float* sink, long long* cycles) {
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
    bulk_load(stages + s * kStageBytes, src + (size_t)((b * 7 + blockIdx.x) % kSourceStages) * kStageBytes,
              kStageBytes, &full[s]);
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

template <int TA, int TB, bool kLoads, int kWgs = 2>
static void run(const uint8_t* src, float* sink, long long* cycles) {
  static_assert(kWgs == 2 || !kLoads, "with loads both warpgroups release the stages");
  const int smem = kStages * kStageBytes + 1024;
  cudaFuncSetAttribute(ring<TA, TB, kLoads, kWgs>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  for (int rep = 0; rep < 2; rep++) ring<TA, TB, kLoads, kWgs><<<kCtas, kThreads, smem>>>(src, sink, cycles);
  long long h[kCtas];
  cudaMemcpy(h, cycles, sizeof h, cudaMemcpyDeviceToHost);
  double mean = 0;
  for (long long c : h) mean += (double)c / kCtas;
  printf("%-8s A %-8s B %-8s %7.1f SM cycles a K block%s\n", kLoads ? "loads" : "no loads", TA ? "MN-major" : "K-major",
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
  run<0, 0, false>(src, sink, cycles);
  run<1, 1, false>(src, sink, cycles);
  run<0, 0, false, 1>(src, sink, cycles);
  run<0, 0, true>(src, sink, cycles);
  run<0, 1, true>(src, sink, cycles);
  run<1, 0, true>(src, sink, cycles);
  run<1, 1, true>(src, sink, cycles);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) fprintf(stderr, "wgmma_ring: %s\n", cudaGetErrorString(e));
  return e != cudaSuccess;
}
