// wgmma_ring.cu — the tensor core's rate in the megakernels' mainloop shape, with no
// other work: two warpgroups, each K block one sm90_tile_gemm.cuh mma_block (four k16
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
// Twenty-first session: the TMA cases also run in clusters, B (or A and B) multicast as a
// cluster's CTAs would share them: `pair B` (2 CTAs, two m-tiles sharing B: each loads
// its A and half of B, as gemm_tiles' PAIRED; 32 KB a CTA a K block), `2x2` (4 CTAs, two
// m-tiles by two column tiles: each loads one A box for its row pair and two B boxes for
// its column pair; 24 KB), `quad B` (4 CTAs, four m-tiles sharing B; 24 KB); a stage is
// refilled once every CTA of the cluster has consumed it. Clusters of 4 run 120 CTAs
// (30 fit: cluster_fit), so each line also gives the machine's rate, CTAs / 132 x 1024 /
// cycles. The matrices: 8 MB with a row pitch of 4096 bytes (L2) or 4224 (the same,
// pitch not a power of two), and 128 MB (more than L2 holds), boxes at scattered
// coordinates. `tma walk` loads as a GEMM does: a tile's 64 K blocks in order, then the
// next tile, A from 64 m-tiles and B from 32 column tiles of a 128 MB matrix (both
// reused, mostly L2 hits); `tma strm` the same with B from 480 column tiles of a 1 GiB
// matrix, none reused while in L2 (an expert's weights read once, deepseek-v3's case).
// Variants of the pairs: a ring of 2 or 3 stages instead of 4 (how the rate depends on
// the bytes in flight), and B also prefetched into L2 (cp.async.bulk.prefetch.tensor)
// 4-32 blocks ahead of its load.
// The operands are arbitrary bf16 bits; only the time is read.
//   make micro && build/micro/wgmma_ring
#include <cstdint>
#include <cstdio>

#include "micro_host.h"
#include "cuda/sm90_tile_gemm.cuh"

using namespace mok;

constexpr int kCtas = 132;
constexpr int kBlocks = 2048;      // K blocks a CTA
constexpr int kSourceStages = 64;  // the loads' source: 3 MB, L2-resident
// A hint: bring the 2-D box at (c0 inner, c1 outer) into L2 (no shared memory, no
// barrier), so that a later load of it hits L2. (Here only: it made the mainloop slower.)
__device__ __forceinline__ void tma_prefetch_2d(const CUtensorMap* map, int c0, int c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" ::"l"(reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1)
               : "memory");
}

enum { kNoLoads, kBulk, kTmaL2, kTmaDram, kTmaWalk, kTmaStream, kGatherA, kGatherTma };
const char* const kLoadNames[] = {"no loads", "loads",    "tma L2",   "tma DRAM",
                                  "tma walk", "tma strm", "gather A", "gather T"};
// gather A (twenty-second session): B as `tma walk`, A's 128 rows picked one by one from
// a [kGatherRows, 4096] bf16 matrix (x) through a table of random row indices (a
// token's row for each expert row), each warpgroup copying its own 64-row box with
// cp.async (four 16-byte chunks a thread a K block, into the 128-byte swizzle) kStages - 1
// blocks ahead, as GEMM1 would read x instead of DISPATCH's copy of it
// gather T: the same rows as 128 one-row TMA boxes (64 x 1, 128-byte swizzle: a row's
// place in the 8-row pattern comes from its shared-memory address), 4 a lane of warp 0,
// with the stage's B boxes, behind the stage's full barrier as gemm_tiles' loads
constexpr int kGatherRows = 16384;
__device__ const uint8_t* g_gather_x;
__device__ const int* g_gather_rows;
__device__ CUtensorMap g_gather_map;  // x [kGatherRows, 4096], boxes of 64 x 1
constexpr int kWalkKb = 64;  // tma walk: K blocks a tile (K = 4096)
enum { kAlone, kPairB, kQuad2x2, kQuadB };  // how a cluster's CTAs share the TMA loads
__host__ __device__ constexpr int cluster_ctas(int share) { return share == kAlone ? 1 : share == kPairB ? 2 : 4; }
const char* const kShareNames[] = {"alone", "pair B", "2x2", "quad B"};

template <int TA, int TB, int kLoads, int kWgs = 2, int kShare = kAlone, int kPrefetch = 0, int kRing = kStages>
__global__ void __launch_bounds__(kThreads, 1) ring(const uint8_t* src, float* sink,
                                                    const __grid_constant__ CUtensorMap map, int rows64, int cols64,
                                                    long long* cycles) {
  constexpr int kCl = cluster_ctas(kShare);
  extern __shared__ uint8_t smem_raw[];
  uint8_t* stages = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  __shared__ uint64_t full[kRing], empty[kRing];
  for (int i = threadIdx.x; i < kRing * kStageBytes / 4; i += kThreads)
    reinterpret_cast<uint32_t*>(stages)[i] = 0x3c003c00u ^ ((i * 2654435761u) & 0x00ff00ffu);
  if (threadIdx.x == 0) {
    // a stage is free once both warpgroups of every CTA that its loads write have read it
    for (int s = 0; s < kRing; s++) mbar_init(&full[s], 1), mbar_init(&empty[s], 2 * kCl);
    fence_mbar_init();
  }
  __syncthreads();
  if (kCl > 1) cluster_sync();  // every CTA's barriers exist before a remote arrival or multicast
  const int tid = threadIdx.x, wg = tid / 128;
  const int rank = kCl > 1 ? (int)cluster_ctarank() : 0, cl = (int)blockIdx.x / kCl;
  const int row = rank >> 1, col = rank & 1;  // 2x2: the CTA's m-tile and column tile
  // tma walk: as a GEMM's tiles, the K blocks of one 128 x 256 tile in order, then the next
  // tile; A's rows are the matrix's first half (64 m-tiles), B's the second (32 column
  // tiles); the CTAs that share a box have the same m-tile (A) or column tile (B)
  const int ctas = (int)gridDim.x, clusters = ctas / kCl;
  auto m_tile = [&](int t) {
    return kShare == kQuad2x2 ? (2 * cl + row + 2 * clusters * t) % 64 : ((int)blockIdx.x + ctas * t) % 64;
  };
  const int n_tiles = kLoads == kTmaStream ? (rows64 / 4 - 32) : 32;  // tma strm: B from DRAM
  auto n_tile = [&](int t) {
    return kShare == kQuad2x2 ? (2 * cl + col + 2 * clusters * t) % n_tiles
                              : ((int)blockIdx.x / (kCl == 1 ? 2 : kCl) + clusters * t) % n_tiles;
  };
  // box i of block b: 64 x 64 at coordinates that depend on who shares it (key)
  auto box = [&](int b, int i, int key, uint8_t* dst, uint64_t* bar, uint16_t mask) {
    int c0 = 64 * ((b + i + key) % cols64), c1 = 64 * ((b * 7 + i * 3 + key * 5) % rows64);
    if (kLoads == kTmaWalk || kLoads == kTmaStream || kLoads == kGatherA || kLoads == kGatherTma) {
      const int t = b / kWalkKb;
      c0 = 64 * (b % kWalkKb);
      c1 = i < 2 ? 128 * m_tile(t) + 64 * i : 32 * 256 + 256 * n_tile(t) + 64 * (i - 2);
    }
    if (mask) tma_load_2d_multicast(dst, &map, bar, c0, c1, mask);
    else tma_load_2d(dst, &map, bar, c0, c1);
  };
  auto load = [&](int b) {  // thread 0 (gather T: warp 0): block b into its stage, once every sharer freed it
    const int s = b % kRing;
    if (b >= kRing)
      while (!mbar_try_wait(&empty[s], ((b / kRing) & 1) ^ 1)) {
      }
    uint8_t* const dst = stages + s * kStageBytes;
    if constexpr (kLoads == kGatherTma) {
      const int lane = tid % 32, t = b / kWalkKb, k0 = 64 * (b % kWalkKb);
      if (lane == 0) mbar_arrive_expect_tx(&full[s], kStageBytes);
      __syncwarp();
#pragma unroll
      for (int q = 0; q < 4; q++) {
        const int r = lane + 32 * q, row = g_gather_rows[(128 * m_tile(t) + r) % kGatherRows];
        tma_load_2d(dst + (r / 64) * kBoxBytes + (r % 64) * 128, &g_gather_map, &full[s], k0, row);
      }
      if (lane != 0) return;
    } else {
      mbar_arrive_expect_tx(&full[s], kLoads == kGatherA ? 4 * kBoxBytes : kStageBytes);
    }
    if constexpr (kLoads == kBulk) {
      bulk_load(dst, src + (size_t)((b * 7 + blockIdx.x) % kSourceStages) * kStageBytes, kStageBytes, &full[s]);
    } else {
#pragma unroll
      for (int i = 0; i < 6; i++) {  // A boxes 0-1, B boxes 2-5
        uint8_t* const d = dst + i * kBoxBytes;
        if ((kLoads == kGatherA || kLoads == kGatherTma) && i < 2) continue;  // (A: gathered)
        if (kShare == kAlone) {
          box(b, i, (int)blockIdx.x, d, &full[s], 0);
        } else if (kShare == kPairB) {
          if (i < 2) box(b, i, (int)blockIdx.x, d, &full[s], 0);
          else if ((i - 2) / 2 == rank) box(b, i, cl, d, &full[s], 0x3);
        } else if (kShare == kQuad2x2) {
          if (i < 2 && i == col) box(b, i, 2 * cl + row, d, &full[s], (uint16_t)(0x3 << (2 * row)));
          if (i >= 2 && (i - 2) / 2 == row) box(b, i, 2 * cl + col + 7, d, &full[s], (uint16_t)(0x5 << col));
        } else {  // kQuadB
          if (i < 2) box(b, i, (int)blockIdx.x, d, &full[s], 0);
          else if (i - 2 == rank) box(b, i, cl, d, &full[s], 0xf);
        }
      }
      // tma strm: the B boxes this CTA loads, kPrefetch blocks ahead, into L2
      if (kPrefetch && kLoads == kTmaStream && b + kPrefetch < kBlocks) {
        const int pb = b + kPrefetch, t = pb / kWalkKb;
#pragma unroll
        for (int i = 2; i < 6; i++)
          if (kShare == kAlone || (i - 2) / 2 == rank)
            tma_prefetch_2d(&map, 64 * (pb % kWalkKb), 32 * 256 + 256 * n_tile(t) + 64 * (i - 2));
      }
    }
  };
  auto release = [&](int s) {  // a warpgroup's arrival at every sharer's empty barrier
#pragma unroll
    for (int c = 0; c < kCl; c++)
      if (c == rank) mbar_arrive(&empty[s]);
      else mbar_arrive_remote_n(mapa_shared(smem_addr(&empty[s]), (uint32_t)c), 1);
  };
  // gather A: this warpgroup's box of block b (its 64 rows of m-tile b / kWalkKb, K block
  // b % kWalkKb), chunk j = tid % 128 + 128 q: row j / 8, 16-byte chunk j % 8 at j % 8 ^ row % 8
  auto gather = [&](int b) {
    if constexpr (kLoads == kGatherA) {
      const uint32_t box = smem_addr(stages + (b % kRing) * kStageBytes + wg * kBoxBytes);
      const int t = b / kWalkKb, k0 = 64 * (b % kWalkKb);
#pragma unroll
      for (int q = 0; q < 4; q++) {
        const int j = tid % 128 + 128 * q, r = j / 8, c = j % 8;
        const int row = g_gather_rows[(128 * m_tile(t) + 64 * wg + r) % kGatherRows];
        cp_async_16(box + r * 128 + ((c ^ (r % 8)) * 16), g_gather_x + ((size_t)row * 4096 + k0 + 8 * c) * 2);
      }
      cp_async_commit();
    }
  };
  const bool loader = kLoads == kGatherTma ? tid < 32 : tid == 0;
  if (kLoads && loader)
    for (int b = 0; b < kRing - 1; b++) load(b);
  if (kLoads == kGatherA)
    for (int b = 0; b < kRing - 1; b++) gather(b);
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; i++) acc[i] = 0.f;
  const long long t0 = clock64();
  for (int b = 0; b < kBlocks; b++) {
    if (kLoads)
      while (!mbar_try_wait(&full[b % kRing], (b / kRing) & 1)) {
      }
    if (kLoads == kGatherA) {  // this warpgroup's gathers of block b landed, seen by the tensor core
      cp_async_wait_group<kRing - 2>();
      fence_proxy_async_smem();
      asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
    }
    if (wg < kWgs) {
      mma_block<TA, TB, BK / 16>(acc, stages + (b % kRing) * kStageBytes, wg);
      wgmma_wait<1>();
    }
    // block b - 1's wgmmas are done: this warpgroup's box of its stage takes block b + kRing - 1
    if (kLoads == kGatherA) {
      if (b + kRing - 1 < kBlocks) gather(b + kRing - 1);
      else cp_async_commit();  // (an empty group: the wait above counts groups)
    }
    if (kLoads) {
      if (b > 0 && tid % 128 == 0) release((b - 1) % kRing);
      if (loader && b + kRing - 1 < kBlocks) load(b + kRing - 1);
    }
  }
  wgmma_wait<0>();
  const long long t1 = clock64();
  if (kCl > 1) cluster_sync();  // no CTA leaves while a sharer may still write or arrive at it
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kAcc; i++) s += acc[i];
  sink[blockIdx.x * kThreads + tid] = s;
  if (tid == 0) cycles[blockIdx.x] = t1 - t0;
}

// The tensor rate of m64n128k16 (both warpgroups, A box wg and B boxes 2-3 of a stage,
// both from shared memory, no loads): a 128 x 128 tile reads A from shared memory once
// per 128 columns instead of 256, 24 KB a MFLOP against 20: whether shared memory's
// bandwidth holds the tensor pipe below its peak (512 cycles a K block here).
__global__ void __launch_bounds__(kThreads, 1) ring128(float* sink, long long* cycles) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* stages = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  for (int i = threadIdx.x; i < kStages * kStageBytes / 4; i += kThreads)
    reinterpret_cast<uint32_t*>(stages)[i] = 0x3c003c00u ^ ((i * 2654435761u) & 0x00ff00ffu);
  __syncthreads();
  const int tid = threadIdx.x, wg = tid / 128;
  float acc[kAcc / 2];
#pragma unroll
  for (int i = 0; i < kAcc / 2; i++) acc[i] = 0.f;
  const long long t0 = clock64();
  for (int b = 0; b < kBlocks; b++) {
    uint64_t da, db;
    stage_descs<0, 0>(stages + (b % kStages) * kStageBytes, wg, da, db);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < BK / 16; ks++) wgmma_m64n128k16<0, 0>(acc, da + ks * 2, db + ks * 2, 1);
    wgmma_commit();
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kAcc / 2; i++) s += acc[i];
  sink[blockIdx.x * kThreads + tid] = s;
  if (tid == 0) cycles[blockIdx.x] = t1 - t0;
}

// SM cycles a K block, the CTAs' mean over the second of two launches of `kernel` (ctas
// CTAs in clusters of cl, the ring's shared memory); negative on a launch error.
template <class Kernel, class... Args>
static double cycles_per_block(Kernel kernel, int ctas, int cl, long long* cycles, Args... args) {
  const int smem = kStages * kStageBytes + 1024;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t lc = cluster_config(ctas, cl, kThreads, smem, &attr);
  for (int rep = 0; rep < 2; rep++) cudaLaunchKernelEx(&lc, kernel, args..., cycles);
  long long h[kCtas];
  if (cudaMemcpy(h, cycles, sizeof(long long) * ctas, cudaMemcpyDeviceToHost) != cudaSuccess) return -1;
  double mean = 0;
  for (int i = 0; i < ctas; i++) mean += (double)h[i] / ctas;
  return mean / kBlocks;
}

template <int TA, int TB, int kLoads, int kWgs = 2, int kShare = kAlone, int kPrefetch = 0, int kRing = kStages>
static void run(const uint8_t* src, float* sink, long long* cycles, const CUtensorMap& map = CUtensorMap{},
                int rows = 64, int cols = 64, const char* matrix = "") {
  static_assert(kWgs == 2 || !kLoads, "with loads both warpgroups release the stages");
  constexpr int kCl = cluster_ctas(kShare);
  const int ctas = kCl == 4 ? 120 : kCtas;  // (30 clusters of 4 fit: cluster_fit)
  const double per_block = cycles_per_block(ring<TA, TB, kLoads, kWgs, kShare, kPrefetch, kRing>, ctas, kCl, cycles,
                                            src, sink, map, rows / 64, cols / 64);
  if (per_block < 0) {
    printf("%s %s: %s\n", kLoadNames[kLoads], kShareNames[kShare], cudaGetErrorString(cudaGetLastError()));
    return;
  }
  printf("%-8s A %-8s B %-8s %7.1f SM cycles a K block", kLoadNames[kLoads], TA ? "MN-major" : "K-major",
         TB ? "MN-major" : "K-major", per_block);
  if (kLoads >= kTmaL2)
    printf("  %-6s %3d CTAs, machine %5.1f%% of peak, %s", kShareNames[kShare], ctas,
           100.0 * ctas / kCtas * 1024.0 / per_block, matrix);
  if (kPrefetch) printf(", B into L2 %d blocks ahead", kPrefetch);
  if (kRing != kStages) printf(", a ring of %d stages", kRing);
  printf("%s\n", kWgs == 1 ? " (one warpgroup: its 64 rows)" : "");
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
  // gather A's x and its row table (rows in a scattered order, as tokens reach an expert)
  uint8_t* gx;
  int* grows;
  if (cudaMalloc(&gx, (size_t)kGatherRows * 4096 * 2) != cudaSuccess ||
      cudaMalloc(&grows, sizeof(int) * kGatherRows) != cudaSuccess) {
    fprintf(stderr, "wgmma_ring: no GPU memory for gather A\n");
    return 1;
  }
  cudaMemset(gx, 0x11, (size_t)kGatherRows * 4096 * 2);
  {
    int* h = new int[kGatherRows];
    for (int i = 0; i < kGatherRows; i++) h[i] = (int)(((uint32_t)i * 2654435761u) % kGatherRows);
    cudaMemcpy(grows, h, sizeof(int) * kGatherRows, cudaMemcpyHostToDevice);
    delete[] h;
  }
  cudaMemcpyToSymbol(g_gather_x, &gx, sizeof gx);
  cudaMemcpyToSymbol(g_gather_rows, &grows, sizeof grows);
  CUtensorMap gm;
  if (!bf16_map("wgmma_ring", &gm, gx, kGatherRows, 4096, 1)) return 1;
  cudaMemcpyToSymbol(g_gather_map, &gm, sizeof gm);
  run<0, 0, kNoLoads>(src, sink, cycles);
  run<1, 1, kNoLoads>(src, sink, cycles);
  run<0, 0, kNoLoads, 1>(src, sink, cycles);
  printf("no loads A K-major  B K-major  %7.1f SM cycles a K block (m64n128k16: 128 x 128 tiles, peak 512)\n",
         cycles_per_block(ring128, kCtas, 1, cycles, sink));
  run<0, 0, kBulk>(src, sink, cycles);
  run<0, 1, kBulk>(src, sink, cycles);
  run<1, 0, kBulk>(src, sink, cycles);
  run<1, 1, kBulk>(src, sink, cycles);
  // TMA boxes: an [rows, cols] bf16 matrix, 64 x 64 boxes
  struct Matrix {
    int rows, cols, loads;
    const char* name;
  };
  const Matrix matrices[] = {{2048, 2048, kTmaL2, "8 MB, pitch 4096 B"},
                             {2048, 2112, kTmaL2, "8 MB, pitch 4224 B"},
                             {16384, 4096, kTmaDram, "128 MB, pitch 8192 B"},
                             {16384, 4096, kTmaWalk, "128 MB, tiles of 64 K blocks in order"},
                             {131072, 4096, kTmaStream, "1 GiB, B streamed from DRAM"}};
  for (const Matrix& mx : matrices) {
    const int rows = mx.rows, cols = mx.cols;
    void* m = nullptr;
    if (cudaMalloc(&m, (size_t)rows * cols * 2) != cudaSuccess) {
      fprintf(stderr, "wgmma_ring: no GPU memory for the TMA matrix\n");
      return 1;
    }
    cudaMemset(m, 0x11, (size_t)rows * cols * 2);
    CUtensorMap map;
    if (!bf16_map("wgmma_ring", &map, m, rows, cols, 64)) return 1;
    if (mx.loads == kTmaStream) {
      run<0, 0, kTmaStream>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaStream, 2, kPairB, 0, 2>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaStream, 2, kPairB, 0, 3>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaStream, 2, kPairB>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaStream, 2, kPairB, 4>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaStream, 2, kPairB, 8>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaStream, 2, kPairB, 16>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaStream, 2, kPairB, 32>(src, sink, cycles, map, rows, cols, mx.name);
    } else if (mx.loads == kTmaWalk) {
      run<0, 0, kTmaWalk>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaWalk, 2, kPairB, 0, 2>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaWalk, 2, kPairB, 0, 3>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaWalk, 2, kPairB>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaWalk, 2, kQuad2x2>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaWalk, 2, kQuadB>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kGatherA>(src, sink, cycles, map, rows, cols, "B as tma walk, A gathered from 128 MB by row");
      run<0, 0, kGatherA, 2, kPairB>(src, sink, cycles, map, rows, cols, "B as tma walk, A gathered from 128 MB by row");
      run<0, 0, kGatherTma>(src, sink, cycles, map, rows, cols, "B as tma walk, A as one-row TMA boxes from 128 MB");
      run<0, 0, kGatherTma, 2, kPairB>(src, sink, cycles, map, rows, cols, "B as tma walk, A as one-row TMA boxes from 128 MB");
    } else if (mx.loads == kTmaDram) {
      run<0, 0, kTmaDram>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaDram, 2, kPairB>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaDram, 2, kQuad2x2>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaDram, 2, kQuadB>(src, sink, cycles, map, rows, cols, mx.name);
    } else {
      run<0, 0, kTmaL2>(src, sink, cycles, map, rows, cols, mx.name);
      run<1, 1, kTmaL2>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaL2, 2, kPairB>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaL2, 2, kQuad2x2>(src, sink, cycles, map, rows, cols, mx.name);
      run<0, 0, kTmaL2, 2, kQuadB>(src, sink, cycles, map, rows, cols, mx.name);
    }
    cudaDeviceSynchronize();
    cudaFree(m);
  }
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) fprintf(stderr, "wgmma_ring: %s\n", cudaGetErrorString(e));
  return e != cudaSuccess;
}
