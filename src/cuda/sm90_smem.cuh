// sm90_smem.cuh — the CTA of both megakernels and its shared memory: the tile constants,
// one GEMM operand's boxes (Operand), the stage ring and its mbarriers, the epilogue
// buffer, the task loop's state (Smem), and kernel_smem, which sets it up at launch.
//
// A CTA is 256 threads, two warpgroups: in GEMM tasks each computes 64 output rows and
// thread 0 also issues the TMA loads; non-GEMM tasks use all 256 threads. Eight warps
// (two per SM quadrant) leave 255 registers a thread: room for 128 accumulators (with a
// third, producer warpgroup, a quadrant holds three warps and 168 registers each).
#pragma once
#include "comm/peer.cuh"
#include "gpu_params.h"
#include "ptx.cuh"

namespace mok {

constexpr int kThreads = 256;
// MOK_PRODUCER (a measurement build, docs/KERNELS.md): the forward kernel is 384 threads,
// warpgroup 2 a producer (setmaxnreg down; one thread issues the GEMM runs' TMA loads
// from the jobs thread 0 posts, Job) and warpgroups 0-1 the CTA's kThreads working
// threads (setmaxnreg up): their barrier is named barrier 1 over kThreads, not
// __syncthreads (cta_sync). sm90_moe_forward.cu defines MOK_PRODUCER_TU for its own
// translation unit. MOK_BWD_PRODUCER (a measurement build) does the same for the
// backward (sm90_moe_backward.cu); without it the backward keeps 256 threads and thread
// 0's loads. The launches (cuda_backend.cu): a producer's kernel at 384 threads,
// unclustered (the producer issues no paired runs' loads); MOK_FWD_UNCLUSTERED, the
// forward producer's baseline: main's forward unclustered (the backward is unclustered
// by default).
#ifdef MOK_PRODUCER
constexpr bool kFwdProducer = true;
#else
constexpr bool kFwdProducer = false;
#endif
#ifdef MOK_BWD_PRODUCER
constexpr bool kBwdProducer = true;
#else
constexpr bool kBwdProducer = false;
#endif
#ifdef MOK_FWD_UNCLUSTERED
constexpr bool kFwdClusters = false;
#else
constexpr bool kFwdClusters = !kFwdProducer;
#endif
constexpr int kProducerThreads = 128;  // (warpgroup 2)
constexpr int kFwdThreads = kThreads + (kFwdProducer ? kProducerThreads : 0);
constexpr int kBwdThreads = kThreads + (kBwdProducer ? kProducerThreads : 0);
#if defined(MOK_PRODUCER_TU)
constexpr bool kProducerTu = true;
constexpr int kProducerRegs = 40, kWorkerRegs = 232;  // 128 x 40 + 256 x 232 <= 65536
#else
constexpr bool kProducerTu = false;
#endif
// Both megakernels' launch bounds: one CTA of kThreads an SM (255 registers a thread); in
// a producer's translation unit kThreads + kProducerThreads; or, in measurement builds,
// -DMOK_MAXNREG=N: at most N registers in every function, the budget a producer
// warpgroup's setmaxnreg split would leave the consumers (LOCAL_MEM_OK=1 when it spills;
// docs/KERNELS.md)
#if defined(MOK_PRODUCER_TU)
#define MOK_KERNEL_BOUNDS __launch_bounds__(kThreads + kProducerThreads, 1)
#elif defined(MOK_MAXNREG)
#define MOK_KERNEL_BOUNDS __maxnreg__(MOK_MAXNREG)
#else
#define MOK_KERNEL_BOUNDS __launch_bounds__(kThreads, 1)
#endif
// Every working thread of the CTA (kThreads; the producer warpgroup, where there is one,
// takes no part).
__device__ __forceinline__ void cta_sync() {
  if constexpr (kProducerTu) asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory");
  else __syncthreads();
}
// __syncthreads_and / __syncthreads_or over the same threads (barrier 1's reduction with a
// producer: barrier 0 would wait for the producer thread, which never arrives).
template <bool kOr> __device__ __forceinline__ bool cta_reduce(bool v) {
  if constexpr (!kProducerTu) return kOr ? __syncthreads_or(v) : __syncthreads_and(v);
  const uint32_t in = kOr ? !v : v;  // (or(v) = !and(!v))
  uint32_t r;
  asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, 1, %2, p;\n selp.u32 %0, 1, 0, q;\n}"
               : "=r"(r)
               : "r"(in), "n"(kThreads)
               : "memory");
  return kOr ? r == 0 : r != 0;
}
constexpr int BM = 128, BN = 256, BK = 64;
constexpr int BF = BN / 2;       // f per SwiGLU tile: 128 gate columns, then 128 up columns
constexpr int kAcc = BM * BN / kThreads;  // fp32 accumulators a thread
constexpr int kStages = 4;
constexpr int kBoxBytes = 64 * 64 * 2;
constexpr int kStageBytes = 6 * kBoxBytes;  // A boxes 0-1, then B boxes 0-3
constexpr int kEpiBytes = 32 * 1024;       // the epilogue buffer: two 128 x 64 bf16 boxes
// The router's experts at most (MOK_MAX_EXPERTS): a warp per token, 32 a lane (token_scores)
constexpr int kMaxRouterExperts = 1024;

// One operand of a tile: the tensor map and, per box, the row (K-major) or the mn start
// (MN-major): two boxes for A, four for B; k0 is the first k (inner coordinate for
// K-major, outer for MN-major). rows (A only): the tile's rows that are stored; at most
// 64 (an expert's last m-tile), the second warpgroup's wgmmas are skipped, and through
// 64 x 64 maps A's second box too (gemm_tiles): they would only compute rows no
// epilogue stores.
struct Operand {
  const CUtensorMap* map;
  int pos[4];
  int k0;
  int rows;  // (A only, above; B's is not read)
};

// Thread 0's TMA load cursor in gemm_tiles: K block kb (of num_kb) of tile `tile`, ring
// position it; it always rests on a block still to load, or on tile == num_tiles.
// spare_slot: the stage the last epilogue may have used as its spare buffer (-1: none);
// its TMA stores must have read it before a load refills it.
struct LoadCursor {
  Operand A, B;
  uint32_t it;
  int tile, kb, num_kb, k_valid_last;
  int spare_slot;
};

// MOK_PRODUCER: one GEMM tile's loads, as thread 0 posts them to the producer (Smem::job):
// its operands, K blocks, and what the producer must know of the run (kJob* flags); the
// cut maps (cut_maps) it must acquire before loading through them (acquire: null, none).
enum : int { kJobTA = 1, kJobTB = 2, kJobTall = 4, kJobNarrow = 8, kJobStop = 16 };
constexpr int kJobs = 2;
struct Job {
  Operand A, B;
  const CUtensorMap* acquire;  // cut maps to acquire first (nacquire of them), or null
  int num_kb, flags, nacquire;
};

struct alignas(1024) Smem {
  uint8_t stage[kStages][kStageBytes];
  union {  // never in use at once (dg_task takes the scratch after epi_acquire)
    alignas(1024) uint8_t epi[kEpiBytes];    // an output tile on its way to global memory
    float warp_scratch[kThreads / 32][kMaxRouterExperts];  // per warp: one token's expert scores
  };
  alignas(128) uint8_t maps[2][128];  // tensor maps in the making (cut_maps)
  uint64_t full[kStages];
  uint64_t empty[kStages];
  uint64_t epi_full[2];  // swiglu_bwd_store's TMA loads: [0] into the spare stage, [1] into epi
  // Paired GEMM tasks (clusters of 2 sharing B, pair_agree) run the same stages through
  // their own barriers: full2 completes on 48 KB of which 16 come from the partner's
  // multicast, empty2 takes both CTAs' warpgroups (the partner writes the stage too).
  // Between tasks both rings are empty, so the two never hold a stage at once.
  uint64_t full2[kStages];
  uint64_t empty2[kStages];
  // A-resident runs (gemm_tiles' AR): the task's A blocks loaded once, completing on
  // a_full (phase a_phase), while B streams through the ring
  uint64_t a_full;
  uint32_t a_phase;
  // scatter_token_rows' bulk row copies (DISPATCH; DXSUM under x_late): a batch of rows
  // into the stages completes on copy_full
  uint64_t copy_full;
  uint32_t copy_phase;
  uint32_t ring_it;   // K blocks this CTA has put through the stage ring so far
  uint32_t ring2_it;  // the same for paired tasks (equal in both CTAs of a cluster)
  int cluster;        // CTAs in this CTA's cluster: 1, or 2 (pairs)
  int rank;           // this CTA's rank in it
  int pair_ok, pair_key;  // written by the partner in pair_agree
  int pair_task[2];       // the pair's first ticket, by round parity (written by rank 0)
  uint32_t round;         // next_task calls so far
  LoadCursor load;
  int task;
  int abort;
  // W > 1: this rank's flags, the step's serial and W (set_peers), for wait_counter's
  // peer_kind
  const uint64_t* peer_flags;
  uint64_t peer_serial;
  int peer_W;
  int last_cta;
  uint64_t task_start;  // MOK_PROFILE: this task's start (globaltimer, ns)
  uint64_t task_clock;  // and in SM cycles (clock64): the two give the task's mean SM clock
  uint32_t wait_ns;     // MOK_PROFILE: this task's time in wait_counter
  uint32_t stall[kStallKinds];       // MOK_STALL_PROFILE builds: thread 0's waits (kStall*)
  uint32_t stall_from[kStallKinds];  // and the start of the span in progress, per kind
  uint32_t knobs;       // MOK_KNOBS (gpu_params.h)
#ifdef MOK_PRODUCER_TU
  // the jobs' ring (job_full: posted by thread 0; job_empty: read by the producer), jobs
  // posted so far, and the cut maps made since the last post
  Job job[kJobs];
  uint64_t job_full[kJobs], job_empty[kJobs];
  uint32_t jobs_posted;
  const CUtensorMap* fresh_maps;
  int fresh_count;
#endif
};
// + 1024 to align the dynamic base, + 128 for the kernels' static shared memory
static_assert(sizeof(Smem) + 1024 + 128 <= 227 * 1024, "shared memory");

// B boxes of a 256-wide column tile starting at n0 (4 consecutive 64-wide boxes).
__device__ __forceinline__ Operand wide(const CUtensorMap* map, int n0, int k0) {
  return Operand{map, {n0, n0 + 64, n0 + 128, n0 + 192}, k0};
}
// A boxes of a 128-row tile starting at m0, whose first `rows` rows are stored (BM or
// more: all; rows past them belong to another expert, or to no one).
__device__ __forceinline__ Operand rows128(const CUtensorMap* map, int m0, int k0, int rows = BM) {
  return Operand{map, {m0, m0 + 64, 0, 0}, k0, rows};
}

// The kernel's shared memory (dynamic, aligned here to 1024 B for the 128-byte swizzle),
// its mbarriers initialised and the launch's MOK_KNOBS in place.
__device__ __forceinline__ Smem& kernel_smem(uint32_t knobs) {
  extern __shared__ uint8_t smem_raw[];
  // an offset from smem_raw, not integer arithmetic on its address: the compiler then
  // still knows sm is shared memory and uses LDS/STS rather than generic loads
  const uint32_t pad = (1024u - (smem_addr(smem_raw) & 1023u)) & 1023u;
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw + pad);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; s++) {
      mbar_init(&sm.full[s], 1);
      mbar_init(&sm.empty[s], 2);  // one arrival per warpgroup
      mbar_init(&sm.full2[s], 1);
      mbar_init(&sm.empty2[s], 4);  // both CTAs' warpgroups
    }
    for (int b = 0; b < 2; b++) mbar_init(&sm.epi_full[b], 1);
    mbar_init(&sm.a_full, 1);
    sm.a_phase = 0;
    mbar_init(&sm.copy_full, 1);
    sm.copy_phase = 0;
    sm.abort = 0;
    sm.peer_W = 1;
    sm.ring_it = 0;
    sm.ring2_it = 0;
    sm.round = 0;
    sm.load.spare_slot = -1;
    sm.knobs = knobs;
#ifdef MOK_PRODUCER_TU
    for (int j = 0; j < kJobs; j++) mbar_init(&sm.job_full[j], 1), mbar_init(&sm.job_empty[j], 1);
    sm.jobs_posted = 0, sm.fresh_maps = nullptr, sm.fresh_count = 0;
#endif
    sm.cluster = (int)cluster_nctarank();
    sm.rank = (int)cluster_ctarank();
    fence_mbar_init();
  }
  __syncthreads();  // (every thread of the CTA, MOK_PRODUCER's producer warpgroup too: not cta_sync)
  if (sm.cluster > 1) cluster_sync();  // the partner's barriers exist before any remote use
  return sm;
}

}  // namespace mok
