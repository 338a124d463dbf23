// beside_stream.cu — can the memory-bound phases run beside the GEMMs' mainloop on the
// same SM? (twenty-third session). The megakernels run one task a CTA at a time, so
// ROUTE, DISPATCH, COMBINE, DG, DXSUM, RW and the tree take whole SMs while the tensor
// pipe idles (qwen3-30b-a3b: about 1.1 of a 7.9 ms traced step). Here warpgroups 0-1
// run wgmma_ring's mainloop and warpgroup 2 streams memory at the same time:
//   main `walk`: wgmma_ring's `tma walk` (48 KB stages of six 64 x 64 TMA boxes from a
//     128 MB matrix, a 128 x 256 tile's 64 K blocks in order, a ring of 4 stages, thread
//     0 refilling 3 blocks ahead); `pair`: the same in clusters of 2 sharing B as
//     gemm_tiles' PAIRED (each CTA loads its A and half of B, multicast: 32 KB a CTA a K
//     block); `peak`: the same wgmmas on one resident stage, no loads; `none`: no
//     mainloop.
//   stream `bulk`: one thread copies 8 KB chunks of a 1 GiB source to a 1 GiB
//     destination through 4 shared buffers (cp.async.bulk in and out), as DISPATCH and
//     DG move rows; `regs`: 128 threads copy 16 bytes a lane, 4 loads in flight, each
//     bf16 pair scaled in fp32 on its way (COMBINE's and DXSUM's kind of pass); `none`.
// With a mainloop the stream runs until the mainloop ends; alone it copies 16 MB a CTA.
// Registers: the mainloop's warpgroups take 232 a thread (setmaxnreg), the stream's 40.
// Printed: SM cycles a mainloop K block (1024 is the tensor peak), the stream's bytes
// read + written per second over the 132 CTAs, and how much faster side by side is than
// one after the other for the same work.
//   make micro && build/micro/beside_stream
#include <cstdint>
#include <cstdio>

#include "micro_host.h"
#include "cuda/sm90_tile_gemm.cuh"

using namespace mok;

constexpr int kCtas = 132;
constexpr int kWgThreads = 384;            // 2 mainloop warpgroups + 1 stream warpgroup
constexpr int kBlocks = 2048;              // mainloop K blocks a CTA
constexpr int kWalkKb = 64;                // K blocks a tile (K = 4096)
constexpr int kChunk = 8192;               // bulk: bytes a chunk
constexpr int kBufs = 4;                   // bulk: shared buffers
constexpr size_t kStreamBytes = 1ull << 30;  // source and destination, each
constexpr int kAloneChunks = 2048;         // stream alone: 16 MB a CTA
enum { kMainNone, kMainWalk, kMainPair, kMainPeak };
enum { kStreamNone, kStreamBulk, kStreamRegs };
const char* const kMainNames[] = {"none", "walk", "pair", "peak"};
const char* const kStreamNames[] = {"none", "bulk", "regs"};

template <int kRegs>
__device__ __forceinline__ void set_max_regs() {
  if constexpr (kRegs > 168) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// per CTA: [0] mainloop cycles, [1] stream bytes, [2] stream ns, [3] mainloop ns
template <int kMain, int kStream>
__global__ void __launch_bounds__(kWgThreads, 1) beside(const __grid_constant__ CUtensorMap map, const uint4* src,
                                                        uint4* dst, float* sink, long long* out) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* const stages = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  uint8_t* const bufs = stages + kStages * kStageBytes;
  __shared__ uint64_t full[kStages], empty[kStages], bfull[kBufs];
  __shared__ volatile int main_done;
  constexpr int kCl = kMain == kMainPair ? 2 : 1;
  const int tid = threadIdx.x, wg = tid / 128;
  const int rank = kCl > 1 ? (int)cluster_ctarank() : 0;
  for (int i = tid; i < kStages * kStageBytes / 4; i += kWgThreads)
    reinterpret_cast<uint32_t*>(stages)[i] = 0x3c003c00u ^ ((i * 2654435761u) & 0x00ff00ffu);
  if (tid == 0) {
    // a stage is free once both warpgroups of each CTA its loads write have read it
    for (int s = 0; s < kStages; s++) mbar_init(&full[s], 1), mbar_init(&empty[s], 2 * kCl);
    for (int s = 0; s < kBufs; s++) mbar_init(&bfull[s], 1);
    main_done = kMain == kMainNone;
    fence_mbar_init();
  }
  __syncthreads();
  if (kCl > 1) cluster_sync();  // the partner's barriers exist before a multicast or remote arrival
  if (wg < 2) {
    set_max_regs<232>();
    if constexpr (kMain != kMainNone) {
      // tma walk: A's rows are the matrix's first half (64 m-tiles), B's the second
      auto load = [&](int b) {
        const int s = b % kStages, t = b / kWalkKb, c0 = 64 * (b % kWalkKb);
        if (b >= kStages)
          while (!mbar_try_wait(&empty[s], ((b / kStages) & 1) ^ 1)) {
          }
        mbar_arrive_expect_tx(&full[s], kStageBytes);
        const int mt = ((int)blockIdx.x + kCtas * t) % 64, nt = ((int)blockIdx.x / 2 + kCtas / kCl * t) % 32;
#pragma unroll
        for (int i = 0; i < 6; i++) {
          uint8_t* const d = stages + s * kStageBytes + i * kBoxBytes;
          const int c1 = i < 2 ? 128 * mt + 64 * i : 32 * 256 + 256 * nt + 64 * (i - 2);
          if (kCl == 1 || i < 2) tma_load_2d(d, &map, &full[s], c0, c1);
          else if ((i - 2) / 2 == rank) tma_load_2d_multicast(d, &map, &full[s], c0, c1, 0x3);
        }
      };
      auto release = [&](int s) {  // this warpgroup's arrival at both sharers' empty barrier
        mbar_arrive(&empty[s]);
        if (kCl > 1) mbar_arrive_remote_n(mapa_shared(smem_addr(&empty[s]), (uint32_t)(rank ^ 1)), 1);
      };
      const bool loads = kMain != kMainPeak;
      if (loads && tid == 0)
        for (int b = 0; b < kStages - 1; b++) load(b);
      float acc[kAcc];
#pragma unroll
      for (int i = 0; i < kAcc; i++) acc[i] = 0.f;
      const long long t0 = clock64();
      const uint64_t n0 = globaltimer_ns();
      for (int b = 0; b < kBlocks; b++) {
        const int s = loads ? b % kStages : 0;
        if (loads)
          while (!mbar_try_wait(&full[s], (b / kStages) & 1)) {
          }
        mma_block<0, 0, BK / 16>(acc, stages + s * kStageBytes, wg);
        wgmma_wait<1>();
        if (loads) {
          if (b > 0 && tid % 128 == 0) release((b - 1) % kStages);
          if (tid == 0 && b + kStages - 1 < kBlocks) load(b + kStages - 1);
        }
      }
      wgmma_wait<0>();
      const long long t1 = clock64();
      const uint64_t n1 = globaltimer_ns();
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < kAcc; i++) sum += acc[i];
      sink[blockIdx.x * kWgThreads + tid] = sum;
      asm volatile("bar.sync 1, 256;" ::: "memory");  // both warpgroups' wgmmas are done
      if (tid == 0) out[4 * blockIdx.x] = t1 - t0, out[4 * blockIdx.x + 3] = (long long)(n1 - n0), main_done = 1;
    }
  } else {
    set_max_regs<40>();
    const int st = tid - 256;
    const size_t chunks = kStreamBytes / kChunk;
    auto chunk = [&](long long i) { return (size_t)((blockIdx.x + (long long)kCtas * i) % (long long)chunks); };
    long long moved = 0;
    const uint64_t t0 = globaltimer_ns();
    if constexpr (kStream == kStreamBulk) {
      if (st == 0) {
        auto refill = [&](long long i) {  // chunk i into its buffer
          const int b = (int)(i % kBufs);
          mbar_arrive_expect_tx(&bfull[b], kChunk);
          bulk_load(bufs + b * kChunk, reinterpret_cast<const uint8_t*>(src) + chunk(i) * kChunk, kChunk, &bfull[b]);
        };
        long long issued = 0, i = 0;
        for (; issued < kBufs - 1; issued++) refill(issued);
        for (;; i++) {
          const int b = (int)(i % kBufs);
          while (!mbar_try_wait(&bfull[b], (uint32_t)((i / kBufs) & 1))) {
          }
          bulk_store(reinterpret_cast<uint8_t*>(dst) + chunk(i) * kChunk, bufs + b * kChunk, kChunk);
          bulk_commit();
          moved += 2 * kChunk;
          const bool stop = kMain == kMainNone ? i + 1 >= kAloneChunks : main_done != 0;
          if (stop) break;
          bulk_wait_read<1>();  // chunk i - 1's store has read its buffer: it takes chunk i + kBufs - 1
          refill(issued++);
        }
        for (long long j = i + 1; j < issued; j++)  // the loads still in flight land before the CTA ends
          while (!mbar_try_wait(&bfull[j % kBufs], (uint32_t)((j / kBufs) & 1))) {
          }
        bulk_wait_all();
      }
    } else if constexpr (kStream == kStreamRegs) {
      // 8 KB a round: lane st's 16 bytes at 4 places 2 KB apart; each bf16 pair x 0.5 in fp32
      const size_t vecs = kStreamBytes / 16;
      for (long long i = 0;; i++) {
        const size_t base = chunk(i) * (kChunk / 16) + st;
        uint4 v[4];
#pragma unroll
        for (int q = 0; q < 4; q++) v[q] = src[(base + 128 * q) % vecs];
#pragma unroll
        for (int q = 0; q < 4; q++) {
          uint32_t* w = reinterpret_cast<uint32_t*>(&v[q]);
#pragma unroll
          for (int j = 0; j < 4; j++) {
            const float lo = __uint_as_float(w[j] << 16), hi = __uint_as_float(w[j] & 0xffff0000u);
            w[j] = pack_bf16x2(0.5f * lo, 0.5f * hi);
          }
          dst[(base + 128 * q) % vecs] = v[q];
        }
        moved += 2 * kChunk / 128;  // this lane's share
        if (kMain == kMainNone ? i + 1 >= kAloneChunks : main_done != 0) break;
      }
    }
    const uint64_t t1 = globaltimer_ns();
    if (kStream != kStreamNone) {
      // the warpgroup's bytes and its slowest lane's time
      atomicAdd(reinterpret_cast<unsigned long long*>(&out[4 * blockIdx.x + 1]), (unsigned long long)moved);
      atomicMax(reinterpret_cast<unsigned long long*>(&out[4 * blockIdx.x + 2]), (unsigned long long)(t1 - t0));
    }
  }
  if (kCl > 1) cluster_sync();  // no CTA leaves while its partner may still write or arrive at it
}

// What one launch measured: the mainloop's SM cycles a K block and ns (CTA means), the
// stream's GB/s (bytes read + written a ns, summed over the CTAs) and bytes.
struct Result {
  bool ok = false;
  double cycles = 0, main_ns = 0, gbps = 0, bytes = 0;
};

template <int kMain, int kStream>
static Result run(const CUtensorMap& map, const uint4* src, uint4* dst, float* sink, long long* out) {
  const int smem = kStages * kStageBytes + kBufs * kChunk + 1024;
  auto kernel = beside<kMain, kStream>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t lc = cluster_config(kCtas, kMain == kMainPair ? 2 : 1, kWgThreads, smem, &attr);
  long long h[4 * kCtas];
  for (int rep = 0; rep < 2; rep++) {  // the second launch is the one read
    cudaMemset(out, 0, sizeof h);
    cudaLaunchKernelEx(&lc, kernel, map, src, dst, sink, out);
  }
  Result r;
  if (cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost) != cudaSuccess) {
    printf("main %s, stream %s: %s\n", kMainNames[kMain], kStreamNames[kStream], cudaGetErrorString(cudaGetLastError()));
    return r;
  }
  r.ok = true;
  for (int c = 0; c < kCtas; c++) {
    r.cycles += (double)h[4 * c] / kCtas / kBlocks;
    r.main_ns += (double)h[4 * c + 3] / kCtas;
    r.bytes += (double)h[4 * c + 1];
    if (h[4 * c + 2] > 0) r.gbps += (double)h[4 * c + 1] / (double)h[4 * c + 2];  // bytes a ns = GB/s
  }
  return r;
}

// One line a case. Together against one after the other: the mainloop alone's time
// plus the time the stream alone takes for the bytes it moved here, over this run's
// time (above 1: running them side by side is faster).
static void print(int main, int stream, const Result& r, const Result& main_alone, const Result& stream_alone) {
  if (!r.ok) return;  // (run printed why)
  printf("main %-4s stream %-4s", kMainNames[main], kStreamNames[stream]);
  if (main != kMainNone) printf("  mainloop %7.1f SM cycles a K block (%5.1f%% of peak)", r.cycles, 100.0 * 1024.0 / r.cycles);
  if (stream != kStreamNone) printf("  stream %5.0f GB/s", r.gbps);
  if (main != kMainNone && stream != kStreamNone && main_alone.ok && stream_alone.ok)
    printf("  one after the other / side by side %.2f", (main_alone.main_ns + r.bytes / stream_alone.gbps) / r.main_ns);
  printf("\n");
}

template <int kMain>
static void cases(const CUtensorMap& map, const uint4* src, uint4* dst, float* sink, long long* out,
                  const Result& bulk_alone, const Result& regs_alone) {
  const Result alone = run<kMain, kStreamNone>(map, src, dst, sink, out);
  print(kMain, kStreamNone, alone, alone, Result{});
  print(kMain, kStreamBulk, run<kMain, kStreamBulk>(map, src, dst, sink, out), alone, bulk_alone);
  print(kMain, kStreamRegs, run<kMain, kStreamRegs>(map, src, dst, sink, out), alone, regs_alone);
}

int main() {
  void *m = nullptr, *src = nullptr, *dst = nullptr;
  float* sink;
  long long* out;
  const int rows = 16384, cols = 4096;  // tma walk's matrix: 128 MB
  if (cudaMalloc(&m, (size_t)rows * cols * 2) != cudaSuccess || cudaMalloc(&src, kStreamBytes) != cudaSuccess ||
      cudaMalloc(&dst, kStreamBytes) != cudaSuccess ||
      cudaMalloc(&sink, sizeof(float) * kCtas * kWgThreads) != cudaSuccess ||
      cudaMalloc(&out, sizeof(long long) * 4 * kCtas) != cudaSuccess) {
    fprintf(stderr, "beside_stream: no GPU memory\n");
    return 1;
  }
  cudaMemset(m, 0x11, (size_t)rows * cols * 2);
  cudaMemset(src, 0x22, kStreamBytes);
  CUtensorMap map;
  if (!bf16_map("beside_stream", &map, m, rows, cols, 64)) return 1;
  const uint4* s = static_cast<const uint4*>(src);
  uint4* d = static_cast<uint4*>(dst);
  const Result bulk = run<kMainNone, kStreamBulk>(map, s, d, sink, out);
  const Result regs = run<kMainNone, kStreamRegs>(map, s, d, sink, out);
  print(kMainNone, kStreamBulk, bulk, Result{}, Result{});
  print(kMainNone, kStreamRegs, regs, Result{}, Result{});
  cases<kMainPeak>(map, s, d, sink, out, bulk, regs);
  cases<kMainWalk>(map, s, d, sink, out, bulk, regs);
  cases<kMainPair>(map, s, d, sink, out, bulk, regs);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) fprintf(stderr, "beside_stream: %s\n", cudaGetErrorString(e));
  return e != cudaSuccess;
}
