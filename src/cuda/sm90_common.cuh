// sm90_common.cuh — what the forward and backward megakernels share: the persistent
// task loop's shared memory, bounded dependency waits, and the TMA + wgmma tile GEMM.
//
// A CTA is 384 threads: warpgroup 0 (warp 0, lane 0) is the TMA producer of GEMM tasks,
// warpgroups 1 and 2 are the wgmma consumers (64 output rows each); non-GEMM tasks use
// all 384 threads. Tasks come from one integer ticket in a fixed topological order, so
// a task only waits for tasks already taken (no deadlock with one CTA per SM).
//
// GEMM tile: C[128 x 128] = A[128 x K] B[K x 128], fp32 accumulators. Each K block of 64
// is four 64 x 64 bf16 TMA boxes (two of A, two of B; 128-byte swizzle) in a ring of
// kStages stages with full/empty mbarriers. An operand is K-major (box = 64 rows x 64 k,
// k contiguous) or MN-major (box = 64 k rows x 64 mn, mn contiguous); wgmma reads either
// through its descriptor (the transpose bits). Within a tile each output element is one
// accumulator summed over K blocks in increasing order; inside a block the order is the
// tensor core's, the same on every SM and for every M (one tile shape for everything).
#pragma once
#include "gpu_params.h"
#include "ptx.cuh"

namespace mok {

constexpr int kThreads = 384;
constexpr int BM = 128, BN = 128, BK = 64;
constexpr int kStages = 4;
constexpr int kBoxBytes = 64 * 64 * 2;
constexpr int kStageBytes = 4 * kBoxBytes;  // A box 0, A box 1, B box 0, B box 1
constexpr int kEpiStride = BN * 4 + 16;     // bytes per row of the epilogue tile (fp32, padded)

struct alignas(1024) Smem {
  uint8_t stage[kStages][kStageBytes];
  uint64_t full[kStages];
  uint64_t empty[kStages];
  float warp_scratch[kThreads / 32][256];  // per warp: one token's expert scores
  alignas(16) uint8_t epi[BM * kEpiStride];  // an output tile on its way to global memory
  uint32_t ring_it;  // K blocks this CTA has put through the stage ring so far
  int task;
  int abort;
  int last_cta;
  uint32_t wait_ns;  // MOK_PROFILE: this task's time in wait_counter
};
static_assert(sizeof(Smem) <= 227 * 1024, "shared memory");

// One operand of a tile: the tensor map and, per box, the row (K-major) or the mn start
// (MN-major); k0 is the first k (inner coordinate for K-major, outer for MN-major).
struct Operand {
  const CUtensorMap* map;
  int pos[2];
  int k0;
};

// The kernel's shared memory (dynamic, aligned here to 1024 B for the 128-byte swizzle),
// its mbarriers initialised.
__device__ __forceinline__ Smem& kernel_smem() {
  extern __shared__ uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; s++) {
      mbar_init(&sm.full[s], 1);
      mbar_init(&sm.empty[s], 2);  // one arrival per consumer warpgroup
    }
    sm.abort = 0;
    sm.ring_it = 0;
    fence_mbar_init();
  }
  __syncthreads();
  return sm;
}

// ---- dependencies ----

// Thread 0 waits until *counter >= target, at most timeout_ns; then every thread of the
// CTA returns true, or false when the step is being abandoned (timeout or an error
// raised elsewhere). The acquire plus the CTA barrier order the producers' writes
// before this CTA's reads, and fence.proxy.async before its TMA reads.
static __device__ __noinline__ bool wait_counter(Smem& sm, const uint32_t* counter, uint32_t target,
                                          const GpuStep& st, int prof_slot) {
  if (threadIdx.x == 0) {
    const uint64_t t0 = globaltimer_ns();
    while (ld_acquire(counter) < target) {
      if (*(volatile uint32_t*)&st.sync->error != 0) {
        sm.abort = 1;
        break;
      }
      if (globaltimer_ns() - t0 > st.timeout_ns) {
        atomicCAS(&st.sync->error, 0u, (uint32_t)MOK_STATUS_COMM_TIMEOUT);
        sm.abort = 1;
        break;
      }
      __nanosleep(128);
    }
    fence_proxy_async();
    if (st.prof) {
      const uint64_t waited = globaltimer_ns() - t0;
      atomicAdd(&st.prof[2 * prof_slot], (unsigned long long)waited);
      sm.wait_ns += (uint32_t)waited;
    }
  }
  __syncthreads();
  return sm.abort == 0;
}

// MOK_PROFILE: a task's start (thread 0's view; 0 when not profiling).
__device__ __forceinline__ uint64_t profile_start(Smem& sm, const GpuStep& st) {
  if (!st.prof || threadIdx.x != 0) return 0;
  sm.wait_ns = 0;
  return globaltimer_ns();
}

// MOK_PROFILE: adds the task's wall time to its kind's slot; MOK_TRACE: records it.
__device__ __forceinline__ void profile_task(Smem& sm, const GpuStep& st, int slot, uint64_t t0) {
  if (!st.prof || threadIdx.x != 0) return;
  const uint64_t t1 = globaltimer_ns();
  atomicAdd(&st.prof[2 * slot], (unsigned long long)(t1 - t0));
  atomicAdd(&st.prof[2 * slot + 1], 1ull);
  if (st.trace) {
    const uint32_t i = atomicAdd(st.trace_len, 1u);
    if (i < st.trace_cap) st.trace[i] = TraceRecord{t0, t1, sm.wait_ns, (uint16_t)blockIdx.x, (uint16_t)slot};
  }
}

// Marks one unit of a counter done, after every thread's writes of this task.
__device__ __forceinline__ void signal_counter(uint32_t* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    red_release_add(counter, 1);
  }
}

// Raises a device-side error (first one wins); every CTA abandons the step.
__device__ __forceinline__ void raise_error(const GpuStep& st, mok_status_t s) {
  atomicCAS(&st.sync->error, 0u, (uint32_t)s);
}

// Takes the next task; false when none is left or the step is abandoned.
__device__ __forceinline__ bool next_task(Smem& sm, const GpuStep& st, int num_tasks, int* task) {
  __syncthreads();
  if (threadIdx.x == 0) {
    int t = (int)atomicAdd(&st.sync->ticket, 1u);
    if (*(volatile uint32_t*)&st.sync->error != 0) t = num_tasks;
    sm.task = t;
  }
  __syncthreads();
  *task = sm.task;
  return sm.task < num_tasks && sm.abort == 0;
}

// The last CTA to leave publishes the step's status and zeroes the counters for the
// next launch (so a launch needs no memset before it and a CUDA graph can replay it).
static __device__ __noinline__ void finish_step(Smem& sm, const GpuStep& st) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    sm.last_cta = atomicAdd(&st.sync->exit_count, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!sm.last_cta) return;
  __threadfence();
  // the first error since mok_context_sync last read it stays
  if (threadIdx.x == 0 && *st.status == 0) *st.status = *(volatile uint32_t*)&st.sync->error;
  uint32_t* words = st.sync->counter;
  for (uint32_t i = threadIdx.x; i < st.num_counters; i += blockDim.x) words[i] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    st.sync->ticket = 0;
    st.sync->error = 0;
    __threadfence();
    st.sync->exit_count = 0;
  }
}

// ---- the tile GEMM ----

// A run of output tiles through one continuous pipeline: for tile i, setup(i, A, B,
// num_kb, k_valid_last) names its operands, then acc (per consumer thread: 64 floats) =
// A[128 x K] B[K x 128] over num_kb K blocks of 64, then epi(i, acc, wg, warp, lane).
// The producer runs ahead into the next tile while the consumers finish this one.
// TA / TB = 1 when that operand is MN-major. k_valid_last < 64 zeroes the k rows past
// it in the last block (MN-major operands whose k are rows of several experts).
// Epilogue rows: wg*64 + warp*16 + lane/4 (+8); columns 8*i + 2*(lane%4) (+1) for
// acc[4i..4i+3].
template <int TA, int TB, class Setup, class Epi>
__device__ __forceinline__ void gemm_tiles(Smem& sm, int num_tiles, Setup setup, Epi epi) {
  const int tid = threadIdx.x;
  uint32_t it = sm.ring_it;
  if (tid == 0) {
    for (int tile = 0; tile < num_tiles; tile++) {
      Operand A, B;
      int num_kb, k_valid_last;
      setup(tile, A, B, num_kb, k_valid_last);
      for (int kb = 0; kb < num_kb; kb++, it++) {
        const uint32_t s = it % kStages, ph = (it / kStages) & 1;
        while (!mbar_try_wait(&sm.empty[s], ph ^ 1)) {
        }
        mbar_arrive_expect_tx(&sm.full[s], kStageBytes);
        uint8_t* dst = sm.stage[s];
        const int k = kb * BK;
#pragma unroll
        for (int b = 0; b < 2; b++) {
          if (TA) tma_load_2d(dst + b * kBoxBytes, A.map, &sm.full[s], A.pos[b], A.k0 + k);
          else tma_load_2d(dst + b * kBoxBytes, A.map, &sm.full[s], A.k0 + k, A.pos[b]);
          if (TB) tma_load_2d(dst + (2 + b) * kBoxBytes, B.map, &sm.full[s], B.pos[b], B.k0 + k);
          else tma_load_2d(dst + (2 + b) * kBoxBytes, B.map, &sm.full[s], B.k0 + k, B.pos[b]);
        }
      }
    }
  } else if (tid >= 128) {
    const int wg = tid / 128 - 1, ct = tid - 128;
    for (int tile = 0; tile < num_tiles; tile++) {
      Operand A, B;
      int num_kb, k_valid_last;
      setup(tile, A, B, num_kb, k_valid_last);
      float acc[64];
#pragma unroll
      for (int i = 0; i < 64; i++) acc[i] = 0.f;
      for (int kb = 0; kb < num_kb; kb++, it++) {
        const uint32_t s = it % kStages, ph = (it / kStages) & 1;
        while (!mbar_try_wait(&sm.full[s], ph)) {
        }
        uint8_t* stage = sm.stage[s];
        if (kb == num_kb - 1 && k_valid_last < BK) {
          // zero k rows [k_valid_last, 64) of all four boxes (MN-major: a k row = 128 B)
          const int rows = BK - k_valid_last, chunks = 4 * rows * 8;
          for (int i = ct; i < chunks; i += 256) {
            const int box = i / (rows * 8), r = k_valid_last + (i / 8) % rows, c = i % 8;
            *reinterpret_cast<uint4*>(stage + box * kBoxBytes + r * 128 + c * 16) = make_uint4(0, 0, 0, 0);
          }
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          asm volatile("bar.sync 1, 256;" ::: "memory");
        }
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 16; ks++) {
          const uint8_t* a = stage + wg * kBoxBytes;
          const uint8_t* b = stage + 2 * kBoxBytes;
          const uint64_t da = TA ? smem_desc(a + ks * 2048, kBoxBytes, 1024) : smem_desc(a + ks * 32, 16, 1024);
          const uint64_t db = TB ? smem_desc(b + ks * 2048, kBoxBytes, 1024) : smem_desc(b + ks * 32, 16, 1024);
          wgmma_m64n128k16<TA, TB>(acc, da, db, 1);
        }
        wgmma_commit();
        // keep this block's wgmmas in flight; the previous block's are done: free its stage
        wgmma_wait<1>();
        if (kb > 0 && ct % 128 == 0) mbar_arrive(&sm.empty[(it - 1) % kStages]);
      }
      wgmma_wait<0>();
      if (num_kb > 0 && ct % 128 == 0) mbar_arrive(&sm.empty[(it - 1) % kStages]);
      epi(tile, acc, wg, (ct % 128) / 32, ct % 32);
    }
  } else {
    for (int tile = 0; tile < num_tiles; tile++) {
      Operand A, B;
      int num_kb, k_valid_last;
      setup(tile, A, B, num_kb, k_valid_last);
      it += num_kb;
    }
  }
  // every thread counted the same K blocks; thread 0's count is the CTA's
  __syncthreads();
  if (tid == 0) sm.ring_it = it;
  __syncthreads();
}

// GEMM tasks own a group of column tiles of one row tile (one pipeline): about 128 K
// blocks of work per task, at most 8 tiles, so that tasks with a long K stay short at
// the tails of phases. Fixed by the shape, never by T or the routing.
__host__ __device__ constexpr int group_size(int num_kb) {
  return num_kb >= 128 ? 1 : (128 / (num_kb > 0 ? num_kb : 1) < 8 ? 128 / (num_kb > 0 ? num_kb : 1) : 8);
}
__host__ __device__ constexpr int groups(int n, int num_kb) { return (n + group_size(num_kb) - 1) / group_size(num_kb); }

// Group g of the n column tiles: setup(nt, A, B) and epi(nt, acc, wg, warp, lane) per
// column tile nt; every tile runs num_kb K blocks.
template <int TA, int TB, class Setup, class Epi>
__device__ __forceinline__ void gemm_group(Smem& sm, int g, int n, int num_kb, Setup setup, Epi epi) {
  const int size = group_size(num_kb);
  gemm_tiles<TA, TB>(
      sm, min(size, n - g * size),
      [&](int t, Operand& A, Operand& B, int& nk, int& kv) {
        setup(g * size + t, A, B);
        nk = num_kb, kv = BK;
      },
      [&](int t, float(&acc)[64], int wg, int w, int l) { epi(g * size + t, acc, wg, w, l); });
}

// One tile: gemm_tiles with a single tile.
template <int TA, int TB, class Epi>
__device__ __forceinline__ void gemm_tile(Smem& sm, const Operand& A, const Operand& B, int num_kb,
                                          int k_valid_last, Epi epi) {
  gemm_tiles<TA, TB>(
      sm, 1,
      [&](int, Operand& a, Operand& b, int& nk, int& kv) { a = A, b = B, nk = num_kb, kv = k_valid_last; },
      [&](int, float(&acc)[64], int wg, int w, int l) { epi(acc, wg, w, l); });
}

// Output coordinates of accumulator pair i (acc[4i + 2h], acc[4i + 2h + 1]).
__device__ __forceinline__ int acc_row(int wg, int warp, int lane, int h) { return wg * 64 + warp * 16 + lane / 4 + 8 * h; }
__device__ __forceinline__ int acc_col(int lane, int i) { return 8 * i + 2 * (lane % 4); }

__device__ __forceinline__ float bf(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ __nv_bfloat16 to_bf(float v) { return __float2bfloat16_rn(v); }
// One token's router scores, in a warp: lane holds experts lane + 32 i (i < 8, E <= 256).
// prob = softmax of the logits, score = the router score (softmax or sigmoid), both 0
// past E; returns logsumexp. Sums: a lane's experts in increasing i, then the warp's
// fixed butterfly. Forward and backward call this one function: the same bits.
__device__ __forceinline__ float token_scores(const float* logits, int E, int score, float (&prob)[8],
                                              float (&sc)[8]) {
  const int lane = threadIdx.x % 32;
  float l[8], m = -INFINITY;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    l[i] = lane + 32 * i < E ? logits[lane + 32 * i] : -INFINITY;
    m = fmaxf(m, l[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 8; i++) sum = __fadd_rn(sum, lane + 32 * i < E ? __expf(__fsub_rn(l[i], m)) : 0.f);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum = __fadd_rn(sum, __shfl_xor_sync(~0u, sum, o));
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const bool in = lane + 32 * i < E;
    prob[i] = in ? __fdiv_rn(__expf(__fsub_rn(l[i], m)), sum) : 0.f;
    sc[i] = score == MOK_SCORE_SOFTMAX ? prob[i] : (in ? __fdiv_rn(1.f, __fadd_rn(1.f, __expf(-l[i]))) : 0.f);
  }
  return __fadd_rn(m, __logf(sum));
}

// 8 bf16 (16 bytes) to fp32 and back.
__device__ __forceinline__ void load_bf16x8(const bf16* src, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const bf16* b = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
  for (int k = 0; k < 8; k++) v[k] = bf(b[k]);
}
__device__ __forceinline__ void store_bf16x8(bf16* dst, const float (&v)[8]) {
  uint4 raw;
  bf16* b = reinterpret_cast<bf16*>(&raw);
#pragma unroll
  for (int k = 0; k < 8; k++) b[k] = to_bf(v[k]);
  *reinterpret_cast<uint4*>(dst) = raw;
}

__device__ __forceinline__ float silu(float g) { return __fdiv_rn(g, __fadd_rn(1.f, __expf(-g))); }

// Epilogue of a 128 x 128 tile through shared memory: the consumer threads put the
// accumulators in sm.epi, then write rows [row0, row_end) x columns [c0, ncols) of out
// (ld elements per row) in 16-byte pieces: bf16 written, fp32 written, or fp32 added
// (one add per element: out = out + acc). ncols and c0 multiples of 8.
enum { kStoreBf16, kStoreF32, kAddF32 };
template <int kMode>
__device__ __forceinline__ void store_tile(Smem& sm, float (&acc)[64], int wg, int w, int l, int row0, int row_end,
                                           int c0, int ncols, void* out, int64_t ld) {
  constexpr int kElem = kMode == kStoreBf16 ? 2 : 4, kPer16 = 16 / kElem, kChunks = BN / kPer16;
  const int ct = threadIdx.x - 128;
  asm volatile("bar.sync 1, 256;" ::: "memory");  // the previous tile has left sm.epi
#pragma unroll
  for (int i = 0; i < 16; i++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      uint8_t* dst = sm.epi + acc_row(wg, w, l, h) * kEpiStride + acc_col(l, i) * kElem;
      if (kMode == kStoreBf16)
        *reinterpret_cast<__nv_bfloat162*>(dst) = __halves2bfloat162(to_bf(acc[4 * i + 2 * h]), to_bf(acc[4 * i + 2 * h + 1]));
      else
        *reinterpret_cast<float2*>(dst) = make_float2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]);
    }
  asm volatile("bar.sync 1, 256;" ::: "memory");
  for (int q = ct; q < BM * kChunks; q += 256) {
    const int r = q / kChunks, c = (q % kChunks) * kPer16;
    if (row0 + r >= row_end || c0 + c >= ncols) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(sm.epi + r * kEpiStride + c * kElem);
    uint4* g = reinterpret_cast<uint4*>(static_cast<uint8_t*>(out) + ((int64_t)(row0 + r) * ld + c0 + c) * kElem);
    if (kMode == kAddF32) {
      const float4 o = *reinterpret_cast<const float4*>(g);
      const float4 a = *reinterpret_cast<const float4*>(&v);
      *reinterpret_cast<float4*>(g) = make_float4(__fadd_rn(o.x, a.x), __fadd_rn(o.y, a.y), __fadd_rn(o.z, a.z), __fadd_rn(o.w, a.w));
    } else {
      *g = v;
    }
  }
}

}  // namespace mok
