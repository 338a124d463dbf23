// sm90_common.cuh — what the forward and backward megakernels share: the persistent
// task loop's shared memory, bounded dependency waits, and the TMA + wgmma tile GEMM.
//
// A CTA is 256 threads, two warpgroups: in GEMM tasks each computes 64 output rows and
// thread 0 also issues the TMA loads; non-GEMM tasks use all 256 threads. Eight warps
// (two per SM quadrant) leave 255 registers a thread: room for 128 accumulators (with a
// third, producer warpgroup, a quadrant holds three warps and 168 registers each).
// Tasks come from one integer ticket in a fixed topological order, so a task only waits
// for tasks already taken (no deadlock with one CTA per SM). With cfg.cta_pairs the CTAs
// run in clusters of 2 that take two tickets at once, and two GEMM tasks on the same
// weight tile share its loads (pair_agree; docs/KERNELS.md).
//
// GEMM tile: C[128 x 256] = A[128 x K] B[K x 256], fp32 accumulators. Each K block of 64
// is six 64 x 64 bf16 TMA boxes (two of A, four of B; 128-byte swizzle; through tall
// maps two a load: gemm_tiles' kBoxRows) in a ring of kStages stages with full/empty
// mbarriers. An operand is K-major (box = 64 rows x 64 k, k contiguous) or MN-major
// (box = 64 k rows x 64 mn, mn contiguous); wgmma reads either through its descriptor
// (the transpose bits). Within a tile each output element is one
// accumulator summed over K blocks in increasing order; inside a block the order is the
// tensor core's, the same on every SM and for every M (one tile shape for everything).
// 128 x 256 rather than 128 x 128: 87 instead of 64 FLOPs per byte brought from L2.
// Every GEMM task is inlined into its kernel: with a wgmma in a called function ptxas
// serialises every wgmma of the kernel (warning C7510; docs/KERNELS.md).
#pragma once
#include "comm/peer.cuh"
#include "gpu_params.h"
#include "ptx.cuh"

namespace mok {

constexpr int kThreads = 256;
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
  // DISPATCH's bulk row copies: a batch of rows into the stages completes on copy_full
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
    sm.cluster = (int)cluster_nctarank();
    sm.rank = (int)cluster_ctarank();
    fence_mbar_init();
  }
  __syncthreads();
  if (sm.cluster > 1) cluster_sync();  // the partner's barriers exist before any remote use
  return sm;
}

// ---- dependencies ----

// Thread 0: polls until done() (an acquire), at most the step's timeout from now (then
// MOK_STATUS_COMM_TIMEOUT); sets sm.abort when the step is abandoned (timeout, or an
// error raised elsewhere).
template <class Done>
__device__ __forceinline__ void poll(Smem& sm, const GpuStep& st, Done done) {
  const uint64_t t0 = globaltimer_ns();
  while (!done()) {
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
}

// Thread 0, W > 1: every rank's flag `kind` in this rank's window reaches the step's
// serial (sm.peer_*), each within the timeout.
__device__ __forceinline__ void poll_peers(Smem& sm, const GpuStep& st, int kind) {
  for (int r = 0; r < sm.peer_W && sm.abort == 0; r++)
    poll(sm, st, [&] { return flag_acquire_sys(sm.peer_flags + r * kFlagKinds + kind) >= sm.peer_serial; });
}

// Thread 0, MOK_PROFILE / MOK_TRACE: a dependency wait that began at t0 (globaltimer)
// into prof_slot's total (an integer counter) and this task's wait_ns.
__device__ __forceinline__ void count_wait(Smem& sm, const GpuStep& st, int prof_slot, uint64_t t0) {
  if (!st.prof) return;
  const uint64_t waited = globaltimer_ns() - t0;
  atomicAdd(&st.prof[2 * prof_slot], (unsigned long long)waited);
  sm.wait_ns += (uint32_t)waited;
}

// Thread 0 waits until *counter >= target, at most timeout_ns (with W > 1 and peer_kind
// >= 0, then for every rank's flag peer_kind too: poll_peers); then every thread of the
// CTA returns true, or false when the step is being abandoned (timeout or an error
// raised elsewhere). The acquire plus the CTA barrier order the producers' writes
// before this CTA's reads, and fence.proxy.async before its TMA reads.
static __device__ __noinline__ bool wait_counter(Smem& sm, const uint32_t* counter, uint32_t target,
                                          const GpuStep& st, int prof_slot, int peer_kind = -1) {
  if (threadIdx.x == 0) {
    const uint64_t t0 = globaltimer_ns();
    poll(sm, st, [&] { return ld_acquire(counter) >= target; });
    if (peer_kind >= 0 && sm.peer_W > 1) poll_peers(sm, st, peer_kind);
    fence_proxy_async();
    count_wait(sm, st, prof_slot, t0);
  }
  __syncthreads();
  return sm.abort == 0;
}

// MOK_STALL_PROFILE (a measurement build, bench/gpu_session.sh stalls): thread 0 adds
// the cycles of each of its waits to sm.stall[kind] (gpu_params.h's kStall*); other
// builds compile none of it. The span's start is kept in shared memory, per kind (so
// spans nest), with the 32-bit %clock (a span is far below 2^32 cycles): a start in a
// register is live in every thread across the wait, and beside the 128 accumulators
// that made the backward spill.
#ifdef MOK_STALL_PROFILE
#define MOK_STALL_FROM(kind)                                    \
  do {                                                          \
    if (threadIdx.x == 0) sm.stall_from[kind] = (uint32_t)clock(); \
  } while (0)
#define MOK_STALL_ADD(kind)                                                         \
  do {                                                                              \
    if (threadIdx.x == 0) sm.stall[kind] += (uint32_t)clock() - sm.stall_from[kind]; \
  } while (0)
#else
#define MOK_STALL_FROM(kind) \
  do {                       \
  } while (0)
#define MOK_STALL_ADD(kind) \
  do {                      \
  } while (0)
#endif

// MOK_PROFILE: a task's start (thread 0's clock), kept in shared memory: a register
// would be live across the whole task.
__device__ __forceinline__ void profile_start(Smem& sm, const GpuStep& st) {
  if (!st.prof || threadIdx.x != 0) return;
  sm.wait_ns = 0;
#pragma unroll
  for (int i = 0; i < kStallKinds; i++) sm.stall[i] = 0;
  sm.task_start = globaltimer_ns();
  sm.task_clock = clock64();
}

// MOK_PROFILE: adds the task's wall time to its kind's slot; MOK_TRACE: records it.
__device__ __forceinline__ void profile_task(Smem& sm, const GpuStep& st, int slot) {
  if (!st.prof || threadIdx.x != 0) return;
  const uint64_t t0 = sm.task_start, t1 = globaltimer_ns();
  atomicAdd(&st.prof[2 * slot], (unsigned long long)(t1 - t0));
  atomicAdd(&st.prof[2 * slot + 1], 1ull);
  if (st.trace) {
    const uint32_t i = atomicAdd(st.trace_len, 1u);
    if (i < st.trace_cap) {
      const uint32_t cycles = (uint32_t)(clock64() - sm.task_clock);
      TraceRecord r{t0, t1, sm.wait_ns, cycles, (uint16_t)blockIdx.x, (uint16_t)slot, {}};
#pragma unroll
      for (int k = 0; k < kStallKinds; k++) r.stall[k] = sm.stall[k];
      st.trace[i] = r;
    }
  }
}

// Marks one unit of a counter done, after every thread's writes of this task. The whole
// CTA waits for thread 0 here (at the next task's barrier) while the task's TMA stores
// land: MOK_STALL_PROFILE counts it as kStallSignal.
__device__ __forceinline__ void signal_counter(Smem& sm, uint32_t* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    MOK_STALL_FROM(kStallSignal);
    bulk_wait_all();  // the task's TMA stores (issued by thread 0) have landed
    __threadfence();
    MOK_STALL_ADD(kStallSignal);
    red_release_add(counter, 1);
  }
}

// ---- W > 1: flags between ranks (docs/DISTRIBUTED.md, PeerExchange) ----

// Every rank's flag `kind` (poll_peers) outside a counter wait; false when the step is
// abandoned. Reads of what the flags publish (TMA loads too) come after.
static __device__ __noinline__ bool wait_peers(Smem& sm, const GpuStep& st, int kind) {
  if (threadIdx.x == 0) {
    poll_peers(sm, st, kind);
    fence_proxy_async();
  }
  __syncthreads();
  return sm.abort == 0;
}

// Thread 0 at a kernel's start, W > 1: the flags wait_counter's peer_kind and
// wait_peers look at, and the step's serial (GpuSync::launches + 1: no CTA has ended
// this launch yet, since the last to end counts it).
__device__ __forceinline__ void set_peers(Smem& sm, const PeerExchange& px, const Shape& s, const GpuStep& st) {
  if (threadIdx.x == 0 && s.W > 1)
    sm.peer_flags = px.flags[s.rank], sm.peer_serial = (uint64_t)*(volatile uint32_t*)&st.sync->launches + 1,
    sm.peer_W = s.W;
}

// Thread 0: this rank's part `kind` of the step is done, told to every rank (itself
// too): its flag in each rank's window, each after a system-scope fence.
__device__ __forceinline__ void publish_peers(const PeerExchange& px, const Shape& s, int kind, uint64_t serial) {
  for (int r = 0; r < s.W; r++) flag_release_sys(px.flags[r] + s.rank * kFlagKinds + kind, serial);
}

// signal_counter, and with W > 1 the CTA whose arrival brings the counter to `target`
// publishes flag `kind` to every rank: its acq_rel add acquires every earlier arrival
// (each after its CTA's system-scope fence), so the flag's release covers every task's
// stores, into peers' memory included.
__device__ __forceinline__ void signal_counter_publish(Smem& sm, uint32_t* counter, uint32_t target,
                                                       const PeerExchange& px, const Shape& s, int kind,
                                                       uint64_t serial) {
  if (s.W == 1) return signal_counter(sm, counter);
  __syncthreads();
  if (threadIdx.x == 0) {
    bulk_wait_all();
    __threadfence_system();
    if (atom_acq_rel_add(counter, 1) + 1 == target) publish_peers(px, s, kind, serial);
  }
}

// Raises a device-side error (first one wins); every CTA abandons the step.
__device__ __forceinline__ void raise_error(const GpuStep& st, mok_status_t s) {
  atomicCAS(&st.sync->error, 0u, (uint32_t)s);
}

// Takes the next task; false when none is left or the step is abandoned. A cluster of
// 2 takes two consecutive tickets at once, rank r running base + r (which may be past
// the last task: the caller skips it), and the two leave only together (an error seen
// by rank 0 ends both), so that they pass the same cluster barriers.
__device__ __forceinline__ bool next_task(Smem& sm, const GpuStep& st, int num_tasks, int* task) {
  __syncthreads();
  if (sm.cluster == 1) {
    if (threadIdx.x == 0) {
      int t = (int)atomicAdd(&st.sync->ticket, 1u);
      if (*(volatile uint32_t*)&st.sync->error != 0) t = num_tasks;
      sm.task = t;
    }
    __syncthreads();
    *task = sm.task;
    return sm.task < num_tasks && sm.abort == 0;
  }
  // two slots by round parity: rank 0 may write the next round's base while the
  // partner's threads still read this one (never two rounds ahead: each has a barrier)
  const int slot = sm.round & 1;
  if (threadIdx.x == 0 && sm.rank == 0) {
    int t = (int)atomicAdd(&st.sync->ticket, 2u);
    if (*(volatile uint32_t*)&st.sync->error != 0) t = num_tasks;
    sm.pair_task[slot] = t;
    st_remote_u32(mapa_shared(smem_addr(&sm.pair_task[slot]), 1), (uint32_t)t);
  }
  cluster_sync();
  const int base = sm.pair_task[slot];
  if (threadIdx.x == 0) sm.round++;  // (every thread read the round before the barrier)
  *task = base + sm.rank;
  return base < num_tasks;
}

// Thread 0: every TMA store has read shared memory, so no stage is held as a spare (the
// stages may now be written by anyone: the partner's multicast, another layout's loads).
__device__ __forceinline__ void release_stages_from_stores(Smem& sm) {
  bulk_wait_read();
  sm.load.spare_slot = -1;
}

// pair_agree's key of a task on expert e's column group g (fewer than 4096 groups), or
// -1 when the task shares nothing with a partner: no rows to multiply, or a task that
// runs alone by choice (a small expert's weight gradients, A resident: wgrad_task).
__device__ __forceinline__ int pair_key(bool shares, int e, int g) { return shares ? e * 4096 + g : -1; }

// Whether this CTA and its partner run their GEMM tasks as a pair (each loads half of
// B, multicast to both): both tasks pairable (the same GEMM phase, decided from the two
// tickets alone, so both CTAs call this or neither), both past their dependency waits
// (ok) and with the same B (key >= 0, pair_key: hence the same tiles and K blocks). A
// paired mainloop has no abort point, so a CTA that is abandoning the step runs
// unpaired. Before the exchange every thread is done with the stages and thread 0's TMA
// stores have read them: the partner's multicast may write them from now on.
__device__ __forceinline__ bool pair_agree(Smem& sm, bool pairable, bool ok, int key) {
  if (!pairable) return false;
  const bool ready = ok && key >= 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    release_stages_from_stores(sm);
    const uint32_t other = (uint32_t)(sm.rank ^ 1);
    st_remote_u32(mapa_shared(smem_addr(&sm.pair_ok), other), ready ? 1u : 0u);
    st_remote_u32(mapa_shared(smem_addr(&sm.pair_key), other), (uint32_t)key);
  }
  cluster_sync();
  // (read before the next cluster barrier, after which alone the partner writes them)
  return ready && sm.pair_ok != 0 && sm.pair_key == key;
}

// n, plus one when pairs need it even (a cluster's two tickets, two tiles of a pair).
__host__ __device__ constexpr int pad_even(int n, bool pairs) { return n + (pairs & n & 1); }
// The expert m-tile table (the forward's prefix writes it, the backward's expert_tile
// reads it back from the counts): calls visit(e, row0, n, row_end) for each expert e
// with rows, its n 128-row m-tiles from row0 (rows end at row_end), in table order,
// until visit returns true. Each expert's tiles are consecutive (one weight stream:
// expert_segments keeps them in one band). Without pairs: experts in order. With pairs:
// an expert with an odd number of tiles waits for the next such expert, and the two
// go in side by side there, so that every other expert starts at an even tile and
// pairs whole (a cluster's two tiles, one B); the two odd experts' meeting tiles (the
// first's last, the second's first) run unpaired, side by side, rather than one beside
// an empty tile. A last odd expert with no partner goes at the end.
template <class Visit>
__device__ __forceinline__ void walk_tiles(const int32_t* counts, const int32_t* offs, int E, bool pairs, Visit visit) {
  int waiting = -1;  // the odd expert that waits for the next
  auto expert = [&](int x) { return visit(x, offs[x], (counts[x] + BM - 1) / BM, offs[x] + counts[x]); };
  for (int x = 0; x < E; x++) {
    const int tiles = (counts[x] + BM - 1) / BM;
    if (tiles == 0) continue;
    if (pairs && (tiles & 1)) {
      if (waiting < 0) {
        waiting = x;
        continue;
      }
      if (expert(waiting)) return;
      waiting = -1;
    }
    if (expert(x)) return;
  }
  if (waiting >= 0) expert(waiting);
}

// The GEMM phases' bands of m-tiles: band_order's hold kBand tiles; the expert m-tiles'
// (expert_segments) kExpertBand, up to kExpertBandMax to keep an expert (or two odd
// ones side by side) whole. MOK_BAND sets kExpertBand in measurement builds.
constexpr int kBand = 8;
#ifdef MOK_BAND
constexpr int kExpertBand = MOK_BAND;
#else
constexpr int kExpertBand = kBand;
#endif
constexpr int kExpertBandMax = kExpertBand + 2;
static_assert(kBand % 2 == 0 && kExpertBand % 2 == 0 && kExpertBandMax < 256,
              "pairs need even bands; tile_band packs the tiles in 8 bits");

// PREFIX's thread 0: the expert m-tile bands, from the tile table's runs (walk_tiles'
// visits: run r holds tiles [run_mt0[r], run_mt0[r + 1]), r < num_runs), as segments:
// tiles [seg_mt0[k], seg_mt0[k + 1]) for k < the count returned. A run joins the open
// band while the band stays within kExpertBand tiles; else it starts the next segment
// (with pairs only at an even tile: two odd experts side by side stay together, and
// every segment starts even). A segment longer than kExpertBandMax (a large expert) is
// cut into bands of kExpertBand from its start, the last band taking the rest
// (segment_band); a joining run is measured against that last band. The last segment
// ends at the tiles' end, made even with pairs.
__device__ __forceinline__ int expert_segments(const int* run_mt0, int num_runs, bool pairs, int* seg_mt0) {
  constexpr int band = kExpertBand, most = kExpertBandMax;
  int n = 0, open = 0;
  seg_mt0[n++] = 0;
  for (int r = 0; r < num_runs; r++) {
    const int a = run_mt0[r], b = run_mt0[r + 1];
    if (a > open && b - open > band && !(pairs && (a & 1))) seg_mt0[n++] = open = a;
    if (b - open > most) open += (b - open - most + band - 1) / band * band;
  }
  seg_mt0[n] = pad_even(run_mt0[num_runs], pairs);
  return n;
}
// The band [*first, *end) of tile q in segment [s, t): bands of kExpertBand from s, as
// few as leave at most kExpertBandMax tiles to the last.
__device__ __forceinline__ void segment_band(int s, int t, int q, int* first, int* end) {
  constexpr int band = kExpertBand, most = kExpertBandMax;
  const int cuts = t - s > most ? (t - s - most + band - 1) / band : 0;
  const int c = min((q - s) / band, cuts);
  *first = s + c * band;
  *end = c < cuts ? *first + band : t;
}

// The phase of ticket t, given the phases' [start, end) in ticket order; -1 for a ticket
// skipped between two phases (pad_even of a paired phase's start).
__device__ __forceinline__ int ticket_phase(const int* start, const int* end, int num_phases, int t) {
  int k = 0;
  while (k < num_phases - 1 && t >= end[k]) k++;
  return t < start[k] ? -1 : k;
}
// Whether the partner CTA's ticket (the other of a cluster's base, base + 1) is in
// phase k too: false without clusters.
__device__ __forceinline__ bool partner_in_phase(const Smem& sm, const int* start, const int* end, int num_phases,
                                                 int task, int k) {
  const int other = task ^ 1;
  return sm.cluster > 1 && other < end[num_phases - 1] && ticket_phase(start, end, num_phases, other) == k;
}

// The last CTA to leave publishes the step's status and zeroes the counters for the
// next launch (so a launch needs no memset before it and a CUDA graph can replay it).
// used_up (a backward with MOK_SAVED_REUSE: saved's header[0]) is marked used up unless
// the step stopped at the header's own check, before anything was written.
static __device__ __noinline__ void finish_step(Smem& sm, const GpuStep& st, uint64_t* used_up = nullptr) {
  __syncthreads();
  if (sm.cluster > 1) cluster_sync();  // no CTA leaves while its partner may still write it
  if (threadIdx.x == 0) {
    bulk_wait_all();
    __threadfence();
    sm.last_cta = atomicAdd(&st.sync->exit_count, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!sm.last_cta) return;
  __threadfence();
  // the first error since mok_context_sync last read it stays
  const uint32_t error = *(volatile uint32_t*)&st.sync->error;
  if (threadIdx.x == 0 && *st.status == 0) *st.status = error;
  if (threadIdx.x == 0 && used_up && error != MOK_STATUS_INVALID_SAVED) *used_up = MOK_SAVED_USED_GPU;
  uint32_t* words = st.sync->counter;
  for (uint32_t i = threadIdx.x; i < st.num_counters; i += blockDim.x) words[i] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    st.sync->ticket = 0;
    st.sync->error = 0;
    st.sync->launches++;
    __threadfence();
    st.sync->exit_count = 0;
  }
}

// ---- the tile GEMM ----

// Shared-memory descriptors of an A box (a warpgroup's 64 rows) and of the first of
// four B boxes, at their first k16 step. A later step's descriptor is this one plus the
// step's byte offset / 16: the address field (bits 0-13, address / 16) cannot carry
// out, shared memory ending below 256 KB.
template <int TA, int TB>
__device__ __forceinline__ void box_descs(const uint8_t* a, const uint8_t* b, uint64_t& da, uint64_t& db) {
  da = smem_desc(a, TA ? kBoxBytes : 16, 1024);
  db = smem_desc(b, TB ? kBoxBytes : 16, 1024);
}
// The same for warpgroup wg in a stage (A boxes 0-1, B boxes 2-5).
template <int TA, int TB>
__device__ __forceinline__ void stage_descs(const uint8_t* stage, int wg, uint64_t& da, uint64_t& db) {
  box_descs<TA, TB>(stage + wg * kBoxBytes, stage + 2 * kBoxBytes, da, db);
}

// A K block's first kSteps k16 steps for warpgroup wg, as one wgmma group (fence ..
// commit): acc (its 64 x 256 tile) += A box wg x B boxes 2..5 of the stage, da and db
// from stage_descs; with 32 accumulators (a 64 x 64 tile) B box 2 alone. A k16 step is
// 2048 bytes further in an MN-major box (16 rows of 128 bytes), 32 in a K-major one.
// keep (64 x 64 only): 0 for a tile's first block, whose first step then writes acc
// rather than adding to it (a zeroing of acc there made ptxas serialise the kernel's
// wgmmas, C7515).
template <int TA, int TB, int kSteps, int N>
__device__ __forceinline__ void mma_block(float (&acc)[N], uint64_t da, uint64_t db, int keep = 1) {
  static_assert(N == kAcc || N == 32, "m64n256 or m64n64");
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kSteps; ks++) {
    const uint64_t a = da + ks * (TA ? 2048 / 16 : 32 / 16), b = db + ks * (TB ? 2048 / 16 : 32 / 16);
    if constexpr (N == kAcc) wgmma_m64n256k16<TA, TB>(acc, a, b, 1);
    else wgmma_m64n64k16<TA, TB>(acc, a, b, ks > 0 || keep);
  }
  wgmma_commit();
}
template <int TA, int TB, int kSteps>
__device__ __forceinline__ void mma_block(float (&acc)[kAcc], const uint8_t* stage, int wg) {
  uint64_t da, db;
  stage_descs<TA, TB>(stage, wg, da, db);
  mma_block<TA, TB, kSteps>(acc, da, db);
}

// A run of output tiles through one continuous pipeline: for tile i, setup(i, A, B,
// num_kb, k_valid_last) names its operands, then acc (per thread: kAcc floats) =
// A[128 x K] B[K x 256] over num_kb K blocks of 64, then epi(i, acc, wg, warp, lane, spare).
// Thread 0 loads kStages - 1 K blocks ahead of the wgmmas, across tile boundaries, so
// the next tile's first blocks arrive during this tile's epilogue; epi also gets `spare`,
// the stage of the tile's last K block (48 KB, or null), free during the epilogue.
// TA / TB = 1 when that operand is MN-major. k_valid_last < 64: the operands' k rows
// past it in the last block are zeros (TMA's fill, through maps cut there: cut_maps),
// and that block's k16 steps past it are skipped.
// Epilogue rows: wg*64 + warp*16 + lane/4 (+8); columns 8*i + 2*(lane%4) (+1) for
// acc[4i..4i+3], i < 32.
// PAIRED (pair_agree): the partner CTA runs the same tiles of B on other rows, in step;
// each CTA loads its A and half of B (boxes 2 rank, 2 rank + 1), multicast to both. A
// template argument, not a run-time flag: the unpaired mainloop stays what it is.
// AR (A resident; unpaired): every tile has the same A of at most kArBlocks K blocks
// (setup's A and num_kb of tile 0), loaded once into the ring's first 64 KB; B streams
// through kStages slots of 32 KB after it. 32 KB a K block into shared memory instead
// of 48 (the bytes each SM takes in bound the mainloop: docs/PERF.md, ninth session);
// the epilogue's spare is a 32 KB slot.
// NB (unpaired, not AR): B boxes a tile, 4 (64 x 256 a warpgroup, kAcc accumulators) or 1
// (64 x 64, 32 accumulators; the stage's other B boxes unused): epi's acc is NB * 32 floats.
// kBoxRows: what one load of an operand brings, 64 or 128 rows (K-major) or mn columns
// (MN-major). With 128 the run's maps are tall: a K-major map has 64 x 128 boxes, an
// MN-major one is 3-D, [cols / 64][rows][64] with 64 x 64 x 2 boxes (make_chunk_map in
// cuda_backend.cu; the coordinate of a box is its chunk, mn / 64). Either way one load
// brings what two 64 x 64 boxes did, into the same shared memory (the 128-byte swizzle
// repeats every 8 rows; a chunk is a box), so a K block takes 3 loads instead of 6
// (paired 2, not 4): thread 0 issues them between its wgmmas, about 150 cycles each
// (engine_gemm, 2026-12-04). B's loads are then pos[0] and pos[2] (pos[1], pos[3] their
// second halves, as wide() and the gate|up operands make them); A loads 128 rows even
// when the tile stores at most 64 (bytes its idle warpgroup leaves unread).
constexpr int kArBlocks = 4;
constexpr int kBSlotBytes = 4 * kBoxBytes;
static_assert(kArBlocks * 2 * kBoxBytes + kStages * kBSlotBytes <= kStages * kStageBytes, "A-resident layout");
template <int TA, int TB, bool PAIRED = false, bool AR = false, int NB = 4, int kBoxRows = 64, class Setup, class Epi>
__device__ __forceinline__ void gemm_tiles(Smem& sm, int num_tiles, Setup setup, Epi epi) {
  static_assert(!(PAIRED && AR), "A-resident runs are unpaired");
  static_assert(NB == 4 || (NB == 1 && !PAIRED && !AR), "narrow tiles are unpaired, not A-resident");
  static_assert(kBoxRows == 64 || (kBoxRows == 128 && NB == 4), "boxes of 64 rows, or 128 for whole tiles");
  constexpr bool kTall = kBoxRows == 128;  // (one load a 128-row or 128-column half)
  // one tall load of an operand's half at mn (or row) position pos, K row k
  auto load_tall = [&](void* dst, const CUtensorMap* map, uint64_t* bar, bool mn_major, int pos, int k) {
    if (mn_major) tma_load_3d(dst, map, bar, 0, k, pos / 64);
    else tma_load_2d(dst, map, bar, k, pos);
  };
  constexpr int kTileAcc = NB * 32;
  const int tid = threadIdx.x, wg = tid / 128;
  uint8_t* const ring = sm.stage[0];
  // a stage's (AR: a B slot's) shared memory
  auto stage_at = [&](uint32_t s) { return AR ? ring + kArBlocks * 2 * kBoxBytes + s * kBSlotBytes : sm.stage[s]; };
  uint64_t* const full = PAIRED ? sm.full2 : sm.full;
  uint64_t* const empty = PAIRED ? sm.empty2 : sm.empty;
  uint32_t it = PAIRED ? sm.ring2_it : sm.ring_it;  // ring position of the next K block to multiply
  // n arrivals for a consumed stage; paired also at the partner's empty2, whose
  // multicast writes this CTA's copy of the stage too
  auto release = [&](uint32_t slot, uint32_t n) {
    if (n == 1) mbar_arrive(&empty[slot]);
    else mbar_arrive_n(&empty[slot], n);
    if (PAIRED) mbar_arrive_remote_n(mapa_shared(smem_addr(&empty[slot]), (uint32_t)(sm.rank ^ 1)), n);
  };
  // Thread 0's load cursor (LoadCursor) lives in shared memory: in registers it would be
  // live, in every thread, across the whole mainloop beside the 128 accumulators.
  LoadCursor& c = sm.load;
  auto settle = [&]() {
    while (c.tile < num_tiles && c.kb >= c.num_kb) {
      c.kb = 0;
      if (++c.tile < num_tiles) setup(c.tile, c.A, c.B, c.num_kb, c.k_valid_last);
    }
  };
  auto load_next = [&]() {
    // the cursor's fields read once into registers, for this load only (otherwise each
    // is read again from shared memory after every TMA issue: the asm's memory clobber)
    const uint32_t lit = c.it;
    const int kb = c.kb;
    if (c.tile >= num_tiles) return;
    const uint32_t s = lit % kStages, ph = (lit / kStages) & 1;
    if ((int)s == c.spare_slot) {
      // the last epilogue's stores from this stage went out first; only its final
      // group (from sm.epi) may still be reading
      MOK_STALL_FROM(kStallSpare);
      bulk_wait_read<1>();
      MOK_STALL_ADD(kStallSpare);
      // paired, the spare's release (both warpgroups', here and at the partner) waited
      // for this: the partner's multicast writes it too
      if (PAIRED) release(s, 2);
      c.spare_slot = -1;
    }
    MOK_STALL_FROM(kStallEmpty);
    while (!mbar_try_wait(&empty[s], ph ^ 1)) {
    }
    MOK_STALL_ADD(kStallEmpty);
    const uint32_t knobs = sm.knobs;              // (once: the TMA asm's memory clobber would re-read it)
    const bool skip_b = !PAIRED && !AR && (knobs & 16);  // MOK_KNOBS 16: B stays what the stage held
    const Operand A = c.A;
    const int a_boxes = kTall || A.rows > 64 ? 2 : 1;  // (Operand::rows; a tall load brings both)
    mbar_arrive_expect_tx(&full[s], AR ? kBSlotBytes : (skip_b ? 0 : NB * kBoxBytes) + a_boxes * kBoxBytes);
    uint8_t* dst = sm.stage[s];
    uint8_t* const b_dst = AR ? stage_at(s) : dst + 2 * kBoxBytes;  // B's first box (AR: A is resident)
    const int k = kb * BK;
    if (!AR && kTall) {
      load_tall(dst, A.map, &full[s], TA, A.pos[0], A.k0 + k);
    } else if (!AR) {
#pragma unroll
      for (int b = 0; b < 2; b++) {
        if (b >= a_boxes) break;
        if (TA) tma_load_2d(dst + b * kBoxBytes, A.map, &full[s], A.pos[b], A.k0 + k);
        else tma_load_2d(dst + b * kBoxBytes, A.map, &full[s], A.k0 + k, A.pos[b]);
      }
    }
    const Operand B = c.B;
    if (PAIRED && kTall) {  // B boxes 2 rank, 2 rank + 1 (one tall load) into both CTAs
      const bool hi = sm.rank != 0;
      const int pos = hi ? B.pos[2] : B.pos[0];
      if (TB) tma_load_3d_multicast(b_dst + (hi ? 2 : 0) * kBoxBytes, B.map, &full[s], 0, B.k0 + k, pos / 64, 0x3);
      else tma_load_2d_multicast(b_dst + (hi ? 2 : 0) * kBoxBytes, B.map, &full[s], B.k0 + k, pos, 0x3);
    } else if (PAIRED) {  // B boxes 2 rank, 2 rank + 1 into both CTAs; the partner loads the others
      const bool hi = sm.rank != 0;
#pragma unroll
      for (int i = 0; i < 2; i++) {
        const int b = hi ? 2 + i : i, pos = hi ? B.pos[2 + i] : B.pos[i];  // (no run-time index: local memory)
        if (TB) tma_load_2d_multicast(b_dst + b * kBoxBytes, B.map, &full[s], pos, B.k0 + k, 0x3);
        else tma_load_2d_multicast(b_dst + b * kBoxBytes, B.map, &full[s], B.k0 + k, pos, 0x3);
      }
    } else if (kTall) {
      const int kb_b = knobs & 32 ? 0 : k;  // MOK_KNOBS 32: every K block of B is the first
      if (!skip_b) {
        load_tall(b_dst, B.map, &full[s], TB, B.pos[0], B.k0 + kb_b);
        load_tall(b_dst + 2 * kBoxBytes, B.map, &full[s], TB, B.pos[2], B.k0 + kb_b);
      }
    } else {
      const int kb_b = knobs & 32 ? 0 : k;  // MOK_KNOBS 32: every K block of B is the first
#pragma unroll
      for (int b = 0; b < NB && !skip_b; b++) {
        if (TB) tma_load_2d(b_dst + b * kBoxBytes, B.map, &full[s], B.pos[b], B.k0 + kb_b);
        else tma_load_2d(b_dst + b * kBoxBytes, B.map, &full[s], B.k0 + kb_b, B.pos[b]);
      }
    }
    c.it = lit + 1, c.kb = kb + 1;
    settle();
  };
  if (tid == 0 && num_tiles > 0) {
    c.it = it, c.tile = 0, c.kb = 0;
    setup(0, c.A, c.B, c.num_kb, c.k_valid_last);
    if (AR) {
      // the A region overlaps stages an earlier epilogue's stores may still read
      release_stages_from_stores(sm);
      const Operand A = c.A;
      mbar_arrive_expect_tx(&sm.a_full, c.num_kb * 2 * kBoxBytes);
      for (int kb = 0; kb < c.num_kb; kb++) {
        uint8_t* dst = ring + kb * 2 * kBoxBytes;
        if (kTall) {
          load_tall(dst, A.map, &sm.a_full, TA, A.pos[0], A.k0 + kb * BK);
          continue;
        }
#pragma unroll
        for (int b = 0; b < 2; b++) {
          if (TA) tma_load_2d(dst + b * kBoxBytes, A.map, &sm.a_full, A.pos[b], A.k0 + kb * BK);
          else tma_load_2d(dst + b * kBoxBytes, A.map, &sm.a_full, A.k0 + kb * BK, A.pos[b]);
        }
      }
    }
    settle();
    for (int i = 0; i < kStages - 1; i++) load_next();
  }
  if (AR && num_tiles > 0) {
    const uint32_t aph = sm.a_phase;
    while (!mbar_try_wait(&sm.a_full, aph)) {
    }
  }
  for (int tile = 0; tile < num_tiles; tile++) {
    Operand A, B;
    int num_kb, k_valid_last;
    setup(tile, A, B, num_kb, k_valid_last);
    float acc[kTileAcc];
    if constexpr (NB == 4) {  // (NB = 1: the first block's first wgmma writes them, mma_block's keep)
#pragma unroll
      for (int i = 0; i < kTileAcc; i++) acc[i] = 0.f;
    }
    // The second warpgroup, when its 64 rows are all past the tile's stored ones
    // (Operand::rows: an expert's last m-tile), multiplies nothing: its accumulators stay
    // zero and no epilogue stores them. It only passes the ring's stages on, each once it
    // has landed (the last one as below). (A loop of its own: a condition in the K loop
    // would be one more register beside the accumulators, and the backward spilled.)
    // (NB = 1: both warpgroups always multiply, so that nothing but a wgmma writes acc)
    if (NB == 4 && wg == 1 && A.rows <= 64) {
      for (int kb = 0; kb < num_kb; kb++, it++) {
        while (!mbar_try_wait(&full[it % kStages], (it / kStages) & 1)) {
        }
        if (kb < num_kb - 1 && tid % 128 == 0) release(it % kStages, 1);
      }
    } else {
      for (int kb = 0; kb < num_kb; kb++, it++) {
        const uint32_t s = it % kStages, ph = (it / kStages) & 1;
        // the descriptors are made before the wait (the empty asm pins them there; the
        // compiler would sink them past it), so that the first wgmma issues as soon as the
        // data lands: when the data comes late, every instruction between is tensor-core time
        uint64_t da, db;
        if (AR) box_descs<TA, TB>(ring + (kb * 2 + wg) * kBoxBytes, stage_at(s), da, db);  // A resident, B in slot s
        else stage_descs<TA, TB>(sm.stage[s], wg, da, db);
        asm volatile("" : "+l"(da), "+l"(db));
        MOK_STALL_FROM(kStallFull);
        while (!mbar_try_wait(&full[s], ph)) {
        }
        MOK_STALL_ADD(kStallFull);
        // the last block of a tile whose operands end early (k_valid_last < 64; its rows
        // past k_valid_last are zeros) skips its k16 steps past them. Each count is its
        // own fence .. commit group of unconditional wgmmas: a wgmma under a condition
        // inside a group makes ptxas serialise every wgmma of the kernel (C7520).
        const int k_steps = kb == num_kb - 1 ? (k_valid_last + 15) / 16 : BK / 16;
        const int keep = NB == 4 || kb > 0;
        if (k_steps == 4) mma_block<TA, TB, 4>(acc, da, db, keep);
        else if (k_steps == 3) mma_block<TA, TB, 3>(acc, da, db, keep);
        else if (k_steps == 2) mma_block<TA, TB, 2>(acc, da, db, keep);
        else mma_block<TA, TB, 1>(acc, da, db, keep);
        // keep this block's wgmmas in flight; the previous block's are done: free its
        // stage, then (thread 0) refill the ring kStages - 1 blocks ahead
        MOK_STALL_FROM(kStallMma);
        wgmma_wait<1>();
        MOK_STALL_ADD(kStallMma);
        if (kb > 0 && tid % 128 == 0) release((it - 1) % kStages, 1);
        if (tid == 0) load_next();
      }
    }
    MOK_STALL_FROM(kStallDrain);
    wgmma_wait<0>();
    MOK_STALL_ADD(kStallDrain);
    // The stage of the tile's last K block is free until thread 0 refills it (its next
    // load, after the epilogue): the epilogue may use it as a second buffer (`spare`),
    // after a CTA barrier (the other warpgroup's wgmmas may still read it until then).
    // Paired, its release waits for that refill (load_next): until then the partner's
    // multicast must not write it.
    if (!PAIRED && num_kb > 0 && tid % 128 == 0) release((it - 1) % kStages, 1);
    if (PAIRED && tid == 0 && c.spare_slot >= 0) {
      // an earlier tile's spare never refilled (this tile has fewer than kStages K
      // blocks): released now, its stores read first
      bulk_wait_read();
      release(c.spare_slot, 2);
      c.spare_slot = -1;
    }
    const int et = tid_here();
    uint8_t* spare = num_kb > 0 ? stage_at((it - 1) % kStages) : nullptr;
    MOK_STALL_FROM(kStallEpilogue);
    epi(tile, acc, et / 128, (et % 128) / 32, et % 32, spare);
    MOK_STALL_ADD(kStallEpilogue);
    if (tid == 0 && num_kb > 0) c.spare_slot = (int)((it - 1) % kStages);
  }
  __syncthreads();
  if (tid == 0) {
    (PAIRED ? sm.ring2_it : sm.ring_it) = it;
    if (PAIRED && c.spare_slot >= 0) {  // the last tile's spare, not refilled in this task
      bulk_wait_read<1>();
      release(c.spare_slot, 2);
      c.spare_slot = -1;
    }
    if (AR && num_tiles > 0) {
      // the next run lays its stages out the usual way, over this one's slots: its
      // loads must not meet this spare's stores (spare_slot names a slot of this layout)
      release_stages_from_stores(sm);
      sm.a_phase ^= 1;
    }
  }
  __syncthreads();
}

// Copies of two 2-D tensor maps ([rows, cols], ld elements a row) cut to rows [row0,
// row0 + n) (at least one row: a map's extent must not be 0), at dst[0] and dst[1]
// (global memory, 128-byte aligned, this CTA's alone): loads through them read zeros
// from row n on, as TMA fills what lies outside a tensor. b null: a's alone, at dst[0].
// Warp 0 makes them; thread 0, the one that issues TMA, acquires them. The slot's
// previous maps are no longer in use: a task's loads have all landed before it ends.
__device__ __forceinline__ void cut_maps(Smem& sm, CUtensorMap* dst, const CUtensorMap* a, const bf16* a_base,
                                         int64_t a_ld, const CUtensorMap* b, const bf16* b_base, int64_t b_ld,
                                         int64_t row0, int n) {
  const int tid = tid_here(), maps = b ? 2 : 1;
  if (tid >= 32) return;
  if (tid < 8 * maps) {  // 16 bytes a lane: lanes 0-7 copy a, 8-15 b (maps[0], maps[1])
    // (the address made here, opaque: made once at the kernel's start it held a register
    // through every task, which swiglu_bwd_store's loop needs)
    uint32_t at = smem_addr(sm.maps[0]) + 16 * tid;
    asm volatile("" : "+r"(at));
    st_shared_v4(at, reinterpret_cast<const uint4*>(tid < 8 ? a : b)[tid % 8]);
  }
  __syncwarp();
  if (tid < maps) {
    const uint32_t m = smem_addr(sm.maps[tid]);
    tensormap_set_base(m, tid == 0 ? a_base + row0 * a_ld : b_base + row0 * b_ld);
    tensormap_set_outer_dim(m, (uint32_t)max(n, 1));
  }
  __syncwarp();
  tensormap_publish(dst, smem_addr(sm.maps[0]));
  if (b) tensormap_publish(dst + 1, smem_addr(sm.maps[1]));
  if (tid == 0) {
    tensormap_acquire(dst);
    if (b) tensormap_acquire(dst + 1);
  }
}
// rows128's A operand of an expert's m-tile (rows [row0, row_end) of the map `full` over
// `base`, ld elements a row): a tile with fewer than BM rows (the expert's last) reads
// through a copy of the map cut at row_end (this CTA's slot, cut_maps), so that its rows
// past the expert are zeros, not the next expert's rows: the wgmmas over them
// (Operand::rows skips a warpgroup's only when all its 64 are past) then multiply
// zeros, at a lower energy (docs/PERF.md, nineteenth session). No epilogue stores them.
// This CTA's two map slots of cta_maps ([kMaxCtas][2]: the weight gradients' cut maps, expert_rows').
__device__ __forceinline__ CUtensorMap* cta_slot(CUtensorMap* cta_maps) { return cta_maps + 2 * blockIdx.x; }
__device__ __forceinline__ Operand expert_rows(Smem& sm, CUtensorMap* slot, const CUtensorMap* full, const bf16* base,
                                               int64_t ld, int row0, int row_end) {
  if (row_end - row0 >= BM) return rows128(full, row0, 0, row_end - row0);
  cut_maps(sm, slot, full, base, ld, nullptr, nullptr, 0, row0, row_end - row0);
  return rows128(slot, 0, 0, row_end - row0);
}

// GEMM tasks own a group of column tiles of one row tile (one pipeline): about
// kGroupKb K blocks of work per task, at most 8 tiles, so that tasks with a long K stay
// short at the tails of phases. Fixed by the shape, never by T or the routing.
#ifndef MOK_GROUP_KB
#define MOK_GROUP_KB 128
#endif
constexpr int kGroupKb = MOK_GROUP_KB;
__host__ __device__ constexpr int group_size(int num_kb) {
  return num_kb >= kGroupKb ? 1 : (kGroupKb / (num_kb > 0 ? num_kb : 1) < 8 ? kGroupKb / (num_kb > 0 ? num_kb : 1) : 8);
}
__host__ __device__ constexpr int groups(int n, int num_kb) { return (n + group_size(num_kb) - 1) / group_size(num_kb); }

// Group g of the n column tiles: setup(nt, A, B) and epi(nt, acc, wg, warp, lane, spare)
// per column tile nt; every tile runs num_kb K blocks.
template <int TA, int TB, bool PAIRED = false, int kBoxRows = 64, class Setup, class Epi>
__device__ __forceinline__ void gemm_group(Smem& sm, int g, int n, int num_kb, Setup setup, Epi epi) {
  const int size = group_size(num_kb);
  gemm_tiles<TA, TB, PAIRED, false, 4, kBoxRows>(
      sm, min(size, n - g * size),
      [&](int t, Operand& A, Operand& B, int& nk, int& kv) {
        setup(g * size + t, A, B);
        nk = num_kb, kv = BK;
      },
      [&](int t, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) { epi(g * size + t, acc, wg, w, l, spare); });
}

// A run-time choice between template instances: f(Flag<true>()) or f(Flag<false>()).
template <bool V> struct Flag {
  static constexpr bool value = V;
};
// f(Flag<paired>()): a GEMM task's body in its paired and its unpaired instantiation
// (gemm_tiles' PAIRED), chosen at run time by pair_agree's answer.
template <class F> __device__ __forceinline__ void with_pairing(bool paired, F f) {
  if (paired) f(Flag<true>());
  else f(Flag<false>());
}
// A GEMM task of a paired phase on expert e's column group g: both CTAs agree whether to
// pair (pair_agree), then, when the task has a tile (valid, which implies it is past its
// dependency wait, ok), run(Flag<paired>()).
template <class Run>
__device__ __forceinline__ void paired_task(Smem& sm, bool pairable, bool ok, bool valid, int e, int g, Run run) {
  const bool paired = pair_agree(sm, pairable, ok, pair_key(valid, e, g));
  if (valid) with_pairing(paired, run);
}

// One tile: gemm_tiles with a single tile; epi(acc, wg, warp, lane, spare).
template <int TA, int TB, int kBoxRows = 64, class Epi>
__device__ __forceinline__ void gemm_tile(Smem& sm, const Operand& A, const Operand& B, int num_kb,
                                          int k_valid_last, Epi epi) {
  gemm_tiles<TA, TB, false, false, 4, kBoxRows>(
      sm, 1,
      [&](int, Operand& a, Operand& b, int& nk, int& kv) { a = A, b = B, nk = num_kb, kv = k_valid_last; },
      [&](int, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) { epi(acc, wg, w, l, spare); });
}

// Output coordinates of accumulator pair i (acc[4i + 2h], acc[4i + 2h + 1]).
__device__ __forceinline__ int acc_row(int wg, int warp, int lane, int h) { return wg * 64 + warp * 16 + lane / 4 + 8 * h; }
__device__ __forceinline__ int acc_col(int lane, int i) { return 8 * i + 2 * (lane % 4); }

__device__ __forceinline__ float bf(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ __nv_bfloat16 to_bf(float v) { return __float2bfloat16_rn(v); }
// The two bf16 of a pack_bf16x2 word as floats: the first (low half), the second (high).
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
// A token's softmax probability and router score of logit l, given the logits' max m and
// sum of exp(l - m): one expression each, so that every caller gets the same bits.
__device__ __forceinline__ float router_prob(float l, float m, float sum) {
  return __fdiv_rn(__expf(__fsub_rn(l, m)), sum);
}
// sigmoid(l) = 1 / (1 + e^-l), rounded division: the router's sigmoid scores and the
// shared-expert gate.
__device__ __forceinline__ float sigmoid_rn(float l) { return __fdiv_rn(1.f, __fadd_rn(1.f, __expf(-l))); }
__device__ __forceinline__ float router_score(float l, float prob, int score) {
  return score == MOK_SCORE_SOFTMAX ? prob : sigmoid_rn(l);
}
__device__ __forceinline__ float warp_sum(float v) {  // fixed butterfly order
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = __fadd_rn(v, __shfl_xor_sync(~0u, v, o));
  return v;
}
// The shared-expert gate of one token (cfg.use_shared_gate), in a warp: s_g =
// sigmoid(x . w_sg) over the token's row x [H], the dot product a lane's 16-byte chunks
// v = lane + 32 u in increasing u (8 products each in order, from +0), then warp_sum's
// butterfly; every lane gets it. The token's row alone decides it: the same bits at
// every W and in every batch (D3, D4). The forward's COMBINE computes it once and saves
// it for the backward.
__device__ __forceinline__ float shared_gate_warp(const bf16* x, const bf16* w_sg, int H) {
  const int nv = H / 8;
  float part = 0.f;
#pragma unroll 4
  for (int v = threadIdx.x % 32; v < nv; v += 32) {
    const uint4 xr = *reinterpret_cast<const uint4*>(x + v * 8), wr = __ldg(reinterpret_cast<const uint4*>(w_sg) + v);
    const bf16 *a = reinterpret_cast<const bf16*>(&xr), *b = reinterpret_cast<const bf16*>(&wr);
#pragma unroll
    for (int k = 0; k < 8; k++) part = __fadd_rn(part, __fmul_rn(bf(a[k]), bf(b[k])));
  }
  return sigmoid_rn(warp_sum(part));
}
// One token's router scores, in a warp: lane holds experts lane + 32 i (i < NR; E <= 32
// NR: NR = 8 up to 256 experts, 16 up to 512, 32 up to 1024). prob = softmax of the
// logits, score = the router score (softmax or sigmoid), both 0 past E; returns
// logsumexp. Sums: a lane's experts in increasing i, then the warp's fixed butterfly
// (token_softmax_sums: the same order without the arrays). Forward and backward call
// these functions: the same bits.
template <int NR>
__device__ __forceinline__ float token_scores(const float* logits, int E, int score, float (&prob)[NR],
                                              float (&sc)[NR]) {
  const int lane = threadIdx.x % 32;
  float l[NR], m = -INFINITY;
#pragma unroll
  for (int i = 0; i < NR; i++) {
    l[i] = lane + 32 * i < E ? logits[lane + 32 * i] : -INFINITY;
    m = fmaxf(m, l[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NR; i++) sum = __fadd_rn(sum, lane + 32 * i < E ? __expf(__fsub_rn(l[i], m)) : 0.f);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum = __fadd_rn(sum, __shfl_xor_sync(~0u, sum, o));
#pragma unroll
  for (int i = 0; i < NR; i++) {
    const bool in = lane + 32 * i < E;
    prob[i] = in ? router_prob(l[i], m, sum) : 0.f;
    sc[i] = in ? router_score(l[i], prob[i], score) : 0.f;
  }
  return __fadd_rn(m, __logf(sum));
}
// token_scores' max m and sum of exp(l - m) for any E (<= kMaxRouterExperts), the
// logits read again instead of held: a lane's experts in increasing i, then the same
// butterfly (the lanes past E add nothing: the same bits as token_scores); returns
// logsumexp.
__device__ __forceinline__ float token_softmax_sums(const float* logits, int E, float& m, float& sum) {
  const int lane = threadIdx.x % 32;
  m = -INFINITY;
  for (int e = lane; e < E; e += 32) m = fmaxf(m, logits[e]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  sum = 0.f;
  for (int e = lane; e < E; e += 32) sum = __fadd_rn(sum, __expf(__fsub_rn(logits[e], m)));
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum = __fadd_rn(sum, __shfl_xor_sync(~0u, sum, o));
  return __fadd_rn(m, __logf(sum));
}

// 8 bf16 (16 bytes, at a shared-memory address) to fp32, and fp32 to 8 bf16 in memory.
__device__ __forceinline__ void ld_shared_bf16x8(uint32_t addr, float (&v)[8]) {
  const uint4 raw = ld_shared_v4(addr);
  const bf16* b = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
  for (int k = 0; k < 8; k++) v[k] = bf(b[k]);
}
// Lane j's pointer, to every lane of the warp (two 32-bit shuffles).
template <class T>
__device__ __forceinline__ T* shfl_ptr(T* p, int j) {
  const uint64_t v = reinterpret_cast<uint64_t>(p);
  const uint32_t lo = __shfl_sync(~0u, (uint32_t)v, j), hi = __shfl_sync(~0u, (uint32_t)(v >> 32), j);
  return reinterpret_cast<T*>((uint64_t)hi << 32 | lo);
}
__device__ __forceinline__ void store_bf16x8(bf16* dst, const float (&v)[8]) {
  uint4 raw;
  bf16* b = reinterpret_cast<bf16*>(&raw);
#pragma unroll
  for (int k = 0; k < 8; k++) b[k] = to_bf(v[k]);
  *reinterpret_cast<uint4*>(dst) = raw;
}

// Token t's slot rows summed, each 16-byte chunk v (8 bf16) of the row: acc = sum over
// slots j in increasing order of (kWeighted: the slot's weight g_j x) row_j[v], row_j =
// peer.rows[idx / e_loc] + pos * H; COMBINE's and DXSUM's sum. Then finish(v, acc, x)
// adds the caller's terms, whose kSlotExtra chunks of v extra(v, x) brought into shared
// memory at x, x + 512, ... (cp_async_16).
// A lane's chunks come through shared memory with cp.async, U a slot and U of the extra
// terms in flight at once, up to kSlotChunks in all: registers held 4 slots' chunks at a
// time, and the sums ran at about a third of HBM's rate. The caller has released the
// stages (release_stages_from_stores); a warp's chunks: [warp][kSlotChunks][32 lanes].
// With kept (W > 1, the forward's COMBINE): a slot whose expert another rank owns is
// read at the slot, kept + (t K + j) H, where that rank's RETURN put it, not from the
// owner's rows.
constexpr int kSlotChunks = 40, kSlotExtra = 4;
static_assert((kThreads / 32) * kSlotChunks * 32 * 16 <= kStages * kStageBytes, "the chunks fit in the stages");
template <bool kWeighted, class Extra, class Finish>
__device__ __forceinline__ void sum_slot_rows(Smem& sm, const PeerRows& peer, const SavedView& sv, const Shape& s,
                                              int t, const bf16* kept, Extra extra, Finish finish) {
  const int K = s.K, nv = s.H / 8, lane = threadIdx.x % 32, U = max(1, kSlotChunks / (K + kSlotExtra));
  const uint32_t buf = smem_addr(sm.stage) + ((threadIdx.x / 32) * kSlotChunks * 32 + lane) * 16;
  // Lane j < K (K <= 32) looks up slot j's row and weight once; every round takes them by
  // shuffle. Looked up slot by slot in each round, they were a chain of dependent loads
  // before the round's first copy.
  const uint4* my_row = nullptr;
  float my_g = 1.f;
  if (lane < K) {
    const int64_t i = (int64_t)t * K + lane;
    const int owner = s.W > 1 ? sv.idx[i] / s.e_loc : 0;  // (W = 1: every expert is this rank's)
    my_row = reinterpret_cast<const uint4*>(kept && owner != s.rank ? kept + i * s.H
                                                                    : peer.rows[owner] + (int64_t)sv.pos[i] * s.H);
    if (kWeighted) my_g = sv.g[i];
  }
  for (int r = 0; r < nv; r += 32 * U) {  // (rounds and shuffles warp-uniform: lanes past nv ride along)
    const int v0 = r + lane;
    for (int j = 0; j < K; j++) {
      const uint4* row = shfl_ptr(my_row, j);
      for (int u = 0; u < U && v0 + 32 * u < nv; u++) cp_async_16(buf + (j * U + u) * 512, row + v0 + 32 * u);
    }
    for (int u = 0; u < U && v0 + 32 * u < nv; u++) extra(v0 + 32 * u, buf + (K * U + u * kSlotExtra) * 512);
    cp_async_wait_all();  // (a lane reads back only its own chunks)
    for (int u = 0; u < U && r + 32 * u < nv; u++) {
      const int v = v0 + 32 * u;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int j = 0; j < K; j++) {
        const float g = kWeighted ? __shfl_sync(~0u, my_g, j) : 1.f;
        if (v >= nv) continue;
        const uint4 raw = ld_shared_v4(buf + (j * U + u) * 512);
        const bf16* x = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
        for (int k = 0; k < 8; k++) acc[k] = __fadd_rn(acc[k], kWeighted ? __fmul_rn(g, bf(x[k])) : bf(x[k]));
      }
      if (v < nv) finish(v, acc, buf + (K * U + u * kSlotExtra) * 512);
    }
  }
}

// A warp copies n <= kCopyRows rows of H bf16, src[k] to dst[k], their 16-byte chunks
// through shared memory with cp.async: kCopyChunks / kCopyRows chunks of each row a lane
// in flight, in the lane's part of the warp's buffer at buf ([row][chunk][32 lanes], 16
// bytes each; a lane reads back only its own chunks). copy_row's registers held 2 to 4
// chunks a lane. The caller has released the stages (release_stages_from_stores).
constexpr int kCopyRows = 3, kCopyChunks = 24;  // (8 warps: 96 KB of the stages)
__device__ __forceinline__ void copy_rows_smem(uint32_t buf, const bf16* const (&src)[kCopyRows],
                                               bf16* const (&dst)[kCopyRows], int n, int H, int lane) {
  const int nv = H / 8, U = kCopyChunks / kCopyRows;
  for (int v0 = lane; v0 < nv; v0 += 32 * U) {
#pragma unroll
    for (int k = 0; k < kCopyRows; k++)
      for (int u = 0; u < U && v0 + 32 * u < nv && k < n; u++)
        cp_async_16(buf + (k * U + u) * 512, reinterpret_cast<const uint4*>(src[k]) + v0 + 32 * u);
    cp_async_wait_all();
#pragma unroll
    for (int k = 0; k < kCopyRows; k++)
      for (int u = 0; u < U && v0 + 32 * u < nv && k < n; u++)
        reinterpret_cast<uint4*>(dst[k])[v0 + 32 * u] = ld_shared_v4(buf + (k * U + u) * 512);
  }
}

// The fixed pairwise tree over n leaves in order (DESIGN.md section 2): node i of a
// level = node 2i + node 2i+1 of the level below, a lone last node moving up. Evaluated
// as a binary counter over the leaves in order: node[L] holds the pending left node of
// level L (bit L of the leaves seen); a new node of level L is added to it from the
// right and carries to level L + 1; at the end the pending nodes fold from the lowest
// level up, which is the lone-node rule. The same bits as the level-by-level evaluation.
constexpr int kTreeLevels = 26;  // chunks = ceil(T / 64) < 2^26 for any int32 T
// Where a counter's pending nodes live: a thread's column of shared memory strided by
// kThreads, floats or float4s (tree_task's rounds, PREFIX's loss statistics; no GEMM
// state beside them; PREFIX's in registers spilled the forward kernel).
struct SmemNodes {
  float* p;
  __device__ __forceinline__ float& operator[](int L) { return p[L * kThreads]; }
  __device__ __forceinline__ float operator[](int L) const { return p[L * kThreads]; }
};
// (four adjacent columns' trees side by side: a float4 a node)
struct SmemNodes4 {
  float4* p;
  __device__ __forceinline__ float4& operator[](int L) { return p[L * kThreads]; }
  __device__ __forceinline__ float4 operator[](int L) const { return p[L * kThreads]; }
};
__device__ __forceinline__ float tree_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float4 tree_add(float4 a, float4 b) {  // (each column's own addition)
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}
template <class Nodes, class T = float>
struct TreeCounter {
  Nodes node;
  uint32_t seen = 0;
  // x: the subtree of leaves [seen, seen + 2^level)
  __device__ __forceinline__ void push(T x, int level) {
    bool carry = true;  // (no break: node stays in registers)
#pragma unroll
    for (int L = 0; L < kTreeLevels; L++) {
      if (L < level || !carry) continue;
      if ((seen >> L) & 1u) {
        x = tree_add(node[L], x);
      } else {
        node[L] = x;
        carry = false;
      }
    }
    seen += 1u << level;
  }
  // the pending nodes, from the lowest level up (the lone-node rule)
  __device__ __forceinline__ T fold() const {
    T r{};
    bool any = false;
#pragma unroll
    for (int L = 0; L < kTreeLevels; L++)
      if ((seen >> L) & 1u) {
        r = any ? tree_add(node[L], r) : node[L];
        any = true;
      }
    return r;
  }
};

// fp32 x 4 (16 bytes) of shared memory at addr, into v[0..3].
__device__ __forceinline__ void ld_shared_f32x4(uint32_t addr, float* v) {
  const uint4 r = ld_shared_v4(addr);
  v[0] = __uint_as_float(r.x), v[1] = __uint_as_float(r.y), v[2] = __uint_as_float(r.z), v[3] = __uint_as_float(r.w);
}

// sigmoid and silu through the SFU (ex2 and rcp, approximate; no division's slow-path
// branch, so the SwiGLU epilogues' 64-128 evaluations a thread interleave). DESIGN.md
// fixes the rounding points around them (bf16 gate and up in, bf16 h or d_a out), not
// their last fp32 bit; every run and every SM gives the same bits. e^-g is __expf's
// (-g times log2 e rounded to float, then ex2) with subnormal results flushed: those
// come from g > 87, where 1 + e^-g is 1 either way, so sigmoid's bits are __expf's.
__device__ __forceinline__ float sigmoid_fast(float g) {
  return rcp_approx(__fadd_rn(1.f, ex2_approx_ftz(__fmul_rn(-g, __int_as_float(0x3fb8aa3b)))));
}
__device__ __forceinline__ float silu(float g) { return __fmul_rn(g, sigmoid_fast(g)); }
// gpt-oss's clamped SwiGLU (mok.h cfg.activation, docs/CPU.md): gate' = min(gate, limit),
// up' = clamp(up, -limit, limit), NaN staying NaN (the comparisons fail for it).
__device__ __forceinline__ float clamp_gate(float g, float limit) { return g > limit ? limit : g; }
__device__ __forceinline__ float clamp_up(float u, float limit) { return u > limit ? limit : u < -limit ? -limit : u; }
// h of a bf16 gate and up, in fp32: silu(gate) up, or (kClamped) (up' + 1) (gate'
// sigmoid(alpha gate')) in that order.
template <bool kClamped>
__device__ __forceinline__ float swiglu_h(float g, float u, float alpha, float limit) {
  if constexpr (!kClamped) return __fmul_rn(silu(g), u);
  const float gc = clamp_gate(g, limit);
  return __fmul_rn(__fadd_rn(clamp_up(u, limit), 1.f), __fmul_rn(gc, sigmoid_fast(__fmul_rn(alpha, gc))));
}

// ---- epilogues: accumulators -> sm.epi -> 16-byte global stores ----
// The plain layout of sm.epi: 128 rows of 256 bytes (128 bf16 or 64 fp32 columns), the
// 16-byte chunk c of row r at chunk c ^ r % 8, so that the 8 rows a warp writes at once
// fall in different banks. A 128 x 256 tile passes through in 2 (bf16) or 4 (fp32) parts.

// sm.epi may be written: the previous tile's TMA stores (thread 0's) have read it and
// every thread is done with it.
// kPending: the newest store groups that may still be reading (other buffers than sm.epi).
template <int kPending = 0>
__device__ __forceinline__ void epi_acquire(Smem& sm) {
  if (tid_here() == 0) {
    MOK_STALL_FROM(kStallEpiStores);
    bulk_wait_read<kPending>();
    MOK_STALL_ADD(kStallEpiStores);
  }
  MOK_STALL_FROM(kStallEpiBarrier);
  __syncthreads();
  MOK_STALL_ADD(kStallEpiBarrier);
}

// Accumulator pairs [i0, i0 + n) into sm.epi (n = 16 bf16 or 8 fp32: one part), at their
// column minus 8 * i0.
template <bool kBf16>
__device__ __forceinline__ void epi_put(Smem& sm, const float (&acc)[kAcc], int wg, int w, int l, int i0, int n) {
  epi_acquire(sm);
  const int r = acc_row(wg, w, l, 0), sw = r % 8, q = l % 4;  // rows r and r + 8: same r % 8
  const uint32_t row0 = smem_addr(sm.epi) + r * 256, row1 = row0 + 8 * 256;
#pragma unroll
  for (int i = 0; i < kAcc / 4; i++) {
    if (i < i0 || i >= i0 + n) continue;
    if (kBf16) {  // byte 16 (i - i0) + 4q: chunk i - i0
      const uint32_t c = (((i - i0) ^ sw) * 16) + 4 * q;
      st_shared_b32(row0 + c, pack_bf16x2(acc[4 * i], acc[4 * i + 1]));
      st_shared_b32(row1 + c, pack_bf16x2(acc[4 * i + 2], acc[4 * i + 3]));
    } else {  // byte 32 (i - i0) + 8q: chunk 2 (i - i0) + q / 2
      const uint32_t c = (((2 * (i - i0) + q / 2) ^ sw) * 16) + 8 * (q % 2);
      st_shared_v2f32(row0 + c, acc[4 * i], acc[4 * i + 1]);
      st_shared_v2f32(row1 + c, acc[4 * i + 2], acc[4 * i + 3]);
    }
  }
  __syncthreads();
}

// 16-byte piece c (of 16) of tile row r of sm.epi in the plain layout.
__device__ __forceinline__ uint4 epi_piece(const Smem& sm, int r, int c) {
  return *reinterpret_cast<const uint4*>(sm.epi + r * 256 + ((c ^ (r % 8)) * 16));
}

// ---- epilogues through TMA stores ----
// A bf16 tile goes into shared memory as 128 x 64 boxes (16 KB each) in the TMA 128-byte
// swizzle: 16-byte chunk j of row r sits at chunk j ^ r % 8, so the 8 rows a warp writes
// at once hit 32 banks. Then TMA stores (thread 0; the copy engine writes them while the
// next tile's wgmmas run) take a whole tile in 128-row boxes, or a tile cut short by the
// end of an expert's rows in 16-row boxes, its last rows < 16 through 16-byte stores.
// The boxes live in sm.epi (two) and, when gemm_tiles passes one, in the spare stage
// (three): a whole bf16 tile then goes out in one round. Store groups from the spare are
// committed before the last group from sm.epi (gemm_tiles' refill of the spare waits
// for all groups but the newest).
constexpr int kStoreRows = 16;
constexpr int kBox = BM * 128;  // bytes of a 128 x 64 bf16 box

// Boxes [0, kBoxes) of the buffer at shared address buf from pair(i, h): the packed bf16
// pair of accumulator pair i = 8 (b0 + b) + j (columns 8i + 2(lane%4), +1) in row half h.
// Between epi_acquire() and epi_publish().
template <int kBoxes, class Pair>
__device__ __forceinline__ void epi_put_boxes(uint32_t buf, int wg, int w, int l, int b0, Pair pair) {
  // rows r and r + 8 share r % 8 = (lane / 4) % 8: one swizzle for both
  const int r = acc_row(wg, w, l, 0), sw = r % 8;
  const uint32_t row0 = buf + r * 128 + 4 * (l % 4), row1 = row0 + 8 * 128;
#pragma unroll
  for (int j = 0; j < 8; j++) {  // chunk j of each box: accumulator pairs i = 8 b + j
    const uint32_t c = (j ^ sw) * 16;
#pragma unroll
    for (int b = 0; b < kBoxes; b++) {
      st_shared_b32(row0 + b * kBox + c, pair(8 * (b0 + b) + j, 0));
      st_shared_b32(row1 + b * kBox + c, pair(8 * (b0 + b) + j, 1));
    }
  }
}

// epi_put_boxes through stmatrix, a quarter of the store instructions: one writes the
// warp's 16 rows x 16 columns (chunks j, j + 1 of a box: four 8 x 8 matrices, h = 0 and
// 1 of each chunk); lane l gives the address of row l % 8 of matrix l / 8, whose 8 rows
// fall in 8 different 16-byte bank groups through the swizzle. (Plain bf16 tiles only:
// in the SwiGLU epilogue its four live pairs make the forward spill.)
template <int kBoxes, class Pair>
__device__ __forceinline__ void epi_stmatrix_boxes(uint32_t buf, int wg, int w, int l, int b0, Pair pair) {
  const int q = l / 8, rr = l % 8;                         // matrix q: row half q % 2, chunk j + q / 2
  const int r = acc_row(wg, w, 0, 0) + rr + 8 * (q % 2);  // (acc_row(.., 0, 0) is a multiple of 8)
  const uint32_t row = buf + r * 128;
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    const uint32_t c = ((j + q / 2) ^ rr) * 16;
#pragma unroll
    for (int b = 0; b < kBoxes; b++) {
      const int i = 8 * (b0 + b) + j;
      stmatrix_x4(row + b * kBox + c, pair(i, 0), pair(i, 1), pair(i + 1, 0), pair(i + 1, 1));
    }
  }
}

// The boxes just written are complete for every thread and for the TMA stores.
__device__ __forceinline__ void epi_publish(Smem& sm) {
  fence_proxy_async_smem();
  MOK_STALL_FROM(kStallEpiBarrier);
  __syncthreads();
  MOK_STALL_ADD(kStallEpiBarrier);
}

// Rows [0, rows) of boxes [0, nb) at buf out, as one store group: store(b, map, r, src)
// issues the TMA store of box b from its row r at src through map (or skips the box), map
// one of st's; dst(b, r) is where row r of box b goes (64 bf16), or null. Returns whether
// threads read buf for rows past the last whole 16-row box.
template <class Store, class Dst>
__device__ __forceinline__ bool epi_write_boxes(Smem& sm, const uint8_t* buf, const StoreMap* st, int nb, int rows,
                                                Store store, Dst dst) {
  const int tid = tid_here();
  const int full = rows == BM ? 1 : rows / kStoreRows, height = rows == BM ? BM : kStoreRows;
  if (tid == 0) {
    MOK_STALL_FROM(kStallEpiIssue);
    const CUtensorMap* map = rows == BM ? &st->full : &st->part;
    for (int rg = 0; rg < full; rg++)
      for (int b = 0; b < nb; b++) store(b, map, rg * height, buf + b * kBox + rg * (height * 128));
    bulk_commit();
    MOK_STALL_ADD(kStallEpiIssue);
  }
  const int first = height * full, rest = rows - first;
  for (int q = tid; q < rest * nb * 8; q += kThreads) {
    const int r = first + q / (nb * 8), b = (q / 8) % nb, j = q % 8;
    bf16* d = dst(b, r);
    if (d)
      *reinterpret_cast<uint4*>(d + 8 * j) =
          *reinterpret_cast<const uint4*>(buf + b * kBox + r * 128 + ((j ^ (r % 8)) * 16));
  }
  return rest > 0;
}

// A bf16 tile: rows [row0, row_end) x columns [c0, ncols) of out (ld a row), whose row
// row0 is row map_row of the store map. With a spare stage: one round (columns c0 + 128..
// from the spare first, then c0.. from sm.epi); without: two rounds through sm.epi.
__device__ __forceinline__ void store_tile_tma(Smem& sm, const float (&acc)[kAcc], int wg, int w, int l,
                                               const StoreMap* st, int map_row, int row0, int row_end, int c0,
                                               int ncols, bf16* out, int64_t ld, uint8_t* spare) {
  const int rows = min(BM, row_end - row0);
  auto pair = [&](int i, int h) { return pack_bf16x2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]); };
  auto write = [&](const uint8_t* buf, int cb) {  // boxes 0, 1 of buf: columns cb.. cb + 127
    if (rows == BM && st->has_pair) {  // both boxes in one store (the map clips a chunk past ncols)
      if (tid_here() == 0) {
        MOK_STALL_FROM(kStallEpiIssue);
        tma_store_3d(&st->pair, buf, 0, map_row, cb / 64);
        bulk_commit();
        MOK_STALL_ADD(kStallEpiIssue);
      }
      return false;
    }
    return epi_write_boxes(
        sm, buf, st, 2, rows,
        [&](int b, const CUtensorMap* map, int r, const uint8_t* src) {
          if (cb + 64 * b < ncols) tma_store_2d(map, src, cb + 64 * b, map_row + r);
        },
        [&](int b, int r) { return cb + 64 * b < ncols ? out + (int64_t)(row0 + r) * ld + cb + 64 * b : nullptr; });
  };
  if (spare) {
    epi_acquire(sm);
    epi_stmatrix_boxes<2>(smem_addr(sm.epi), wg, w, l, 0, pair);
    epi_stmatrix_boxes<2>(smem_addr(spare), wg, w, l, 2, pair);
    epi_publish(sm);
    const bool tail = write(spare, c0 + 128);
    write(sm.epi, c0);
    if (tail) __syncthreads();  // the spare's tail rows read before thread 0 refills it
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; half++) {  // boxes 2 half, 2 half + 1 (128 columns)
    epi_acquire(sm);
    epi_stmatrix_boxes<2>(smem_addr(sm.epi), wg, w, l, 2 * half, pair);
    epi_publish(sm);
    write(sm.epi, c0 + 128 * half);
  }
}

// Writes rows [row0, row_end) x columns [c0, ncols) of out (ld elements a row) from the
// 128 x 256 accumulator tile whose first column is c0: bf16 written, fp32 written, or
// fp32 added (one add per element: out = out + acc). ncols and c0 multiples of 8.
// st (bf16 only, may be null): a store map of out whose row map_row is row row0: then
// the tile goes out through TMA stores (store_tile_tma, with gemm_tiles' spare stage).
enum { kStoreBf16, kStoreF32, kAddF32 };
template <int kMode>
__device__ __forceinline__ void store_tile(Smem& sm, const float (&acc)[kAcc], int wg, int w, int l, int row0,
                                           int row_end, int c0, int ncols, void* out, int64_t ld,
                                           const StoreMap* st = nullptr, int map_row = 0, uint8_t* spare = nullptr) {
  constexpr int kElem = kMode == kStoreBf16 ? 2 : 4, kCols = 256 / kElem, kPer16 = 16 / kElem;
  constexpr int kPieces = kCols / kPer16;  // 16 a row
  if (sm.knobs & 2) return;
  if (kMode == kStoreBf16 && st && !(sm.knobs & 8)) {
    store_tile_tma(sm, acc, wg, w, l, st, map_row, row0, row_end, c0, ncols, static_cast<bf16*>(out), ld, spare);
    return;
  }
  for (int part = 0; part < BN / kCols; part++) {
    epi_put<kMode == kStoreBf16>(sm, acc, wg, w, l, part * kCols / 8, kCols / 8);
    if (sm.knobs & 1) continue;
    const int cb = c0 + part * kCols;
    for (int q = tid_here(); q < BM * kPieces; q += kThreads) {
      const int r = q / kPieces, c = (q % kPieces) * kPer16;
      if (row0 + r >= row_end || cb + c >= ncols) continue;
      const uint4 v = epi_piece(sm, r, q % kPieces);
      uint4* g = reinterpret_cast<uint4*>(static_cast<uint8_t*>(out) + ((int64_t)(row0 + r) * ld + cb + c) * kElem);
      if (kMode == kAddF32) {
        const float4 o = *reinterpret_cast<const float4*>(g);
        const float4 a = *reinterpret_cast<const float4*>(&v);
        *reinterpret_cast<float4*>(g) = make_float4(__fadd_rn(o.x, a.x), __fadd_rn(o.y, a.y), __fadd_rn(o.z, a.z), __fadd_rn(o.w, a.w));
      } else {
        *g = v;
      }
    }
  }
}

// The expert biases (cfg.use_expert_bias) into a 128 x 256 accumulator tile before its
// bf16 rounding: one fp32 addition a value. Tile column c < 128 gets lo[c] while c < n_lo,
// c >= 128 hi[c - 128] while c - 128 < n_hi (columns past them are never stored: no
// bias is read there). A thread's pair i is tile column acc_col(l, i) of both its rows;
// the 8 lanes of a warp with the same l % 4 share those columns, so each loads 4 of the
// 32 bias words and the rest come by shuffle (4 registers, not 32: the epilogue has none
// to spare).
__device__ __forceinline__ void add_col_bias(float (&acc)[kAcc], int l, const bf16* lo, int n_lo, const bf16* hi,
                                             int n_hi) {
  constexpr int kPairs = kAcc / 4, kHalf = kPairs / 2;  // 32 pairs, the first 16 in lo
  const int q = l % 4, r = l / 4;
  uint32_t word[kPairs / 8];  // pair r + 8k's bias
#pragma unroll
  for (int k = 0; k < kPairs / 8; k++) {
    const int i = r + 8 * k, c = acc_col(l, i) % 128;  // (n even: a pair's columns both in or both out)
    word[k] = c < (i < kHalf ? n_lo : n_hi) ? __ldg(reinterpret_cast<const unsigned int*>((i < kHalf ? lo : hi) + c)) : 0u;
  }
#pragma unroll
  for (int i = 0; i < kPairs; i++) {
    const uint32_t b = __shfl_sync(~0u, word[i / 8], (i % 8) * 4 + q);
#pragma unroll
    for (int h = 0; h < 2; h++) {
      acc[4 * i + 2 * h] = __fadd_rn(acc[4 * i + 2 * h], bf16_lo(b));
      acc[4 * i + 2 * h + 1] = __fadd_rn(acc[4 * i + 2 * h + 1], bf16_hi(b));
    }
  }
}

// Gate|up tile nt of expert e (gate columns f = nt BF + c, up columns F + f of its 2F)
// plus the expert's biases b13 [E, 2F] (cfg.use_expert_bias; null: none): GEMM1's and the
// backward's recompute (RG) epilogue, the same bits.
__device__ __forceinline__ void add_gate_up_bias(float (&acc)[kAcc], int l, const bf16* b13, int e, int F, int nt) {
  if (!b13) return;
  const bf16* b = b13 + (int64_t)e * 2 * F + nt * BF;
  add_col_bias(acc, l, b, F - nt * BF, b + F, F - nt * BF);
}

// SwiGLU forward epilogue of a gate|up tile (columns 0..127 gate f0.., 128..255 up f0..),
// rows [row0, row_end), f < F: a = bf16(gate | up) into a_rows [.., 2F] (store map st_a:
// [rows][2][F], row map_row = row0), and h = bf16(silu(a_gate) * a_up) into h_rows
// [.., F] (store map st_h). A thread holds gate and up of the same columns (pairs i and
// i + 16), so h comes from registers. With a spare stage two rounds (gate from sm.epi,
// up and h's first box from the spare; then h's second box, once the gate's stores alone
// have read sm.epi), without three. kClamped: gpt-oss's clamped SwiGLU (swiglu_h; alpha,
// limit), the routed experts' under cfg.activation, in the kernels' clamped variants.
template <bool kClamped = false>
__device__ __forceinline__ void swiglu_store(Smem& sm, float (&acc)[kAcc], int wg, int w, int l, int row0, int row_end,
                                             int f0, int F, bf16* a_rows, bf16* h_rows, const StoreMap* st_a,
                                             const StoreMap* st_h, int map_row, uint8_t* spare, float alpha = 0.f,
                                             float limit = 0.f) {
  if (sm.knobs & 2) return;
  const int rows = min(BM, row_end - row0);
  auto apair = [&](int i, int h) { return pack_bf16x2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]); };
  // h from the bf16 gate and up of apair, unpacked by shifts: a bf16 rounding of each
  // value on its own (cvt.rn.bf16.f32) would take the SFU's pipe, 16 a cycle per SM,
  // beside silu's two MUFU (measured on the H200: together they halve the rate).
  auto hpair = [&](int i, int h) {
    const uint32_t g = apair(i, h), u = apair(i + 16, h);
    return pack_bf16x2(swiglu_h<kClamped>(bf16_lo(g), bf16_lo(u), alpha, limit),
                       swiglu_h<kClamped>(bf16_hi(g), bf16_hi(u), alpha, limit));
  };
  auto write_a = [&](const uint8_t* buf, int half) {  // gate (half 0) or up (1): 2 boxes
    epi_write_boxes(
        sm, buf, st_a, 2, rows,
        [&](int b, const CUtensorMap* map, int r, const uint8_t* src) {
          if (f0 + 64 * b < F) tma_store_3d(map, src, f0 + 64 * b, half, map_row + r);
        },
        [&](int b, int r) {
          const int f = f0 + 64 * b;
          return f < F ? a_rows + (int64_t)(row0 + r) * 2 * F + half * F + f : nullptr;
        });
  };
  auto write_h = [&](const uint8_t* buf, int b0, int nb) {  // h boxes b0 .. b0 + nb - 1
    epi_write_boxes(
        sm, buf, st_h, nb, rows,
        [&](int b, const CUtensorMap* map, int r, const uint8_t* src) {
          if (f0 + 64 * (b0 + b) < F) tma_store_2d(map, src, f0 + 64 * (b0 + b), map_row + r);
        },
        [&](int b, int r) {
          const int f = f0 + 64 * (b0 + b);
          return f < F ? h_rows + (int64_t)(row0 + r) * F + f : nullptr;
        });
  };
  if (spare) {
    epi_acquire(sm);
    epi_put_boxes<2>(smem_addr(sm.epi), wg, w, l, 0, apair);
    epi_put_boxes<2>(smem_addr(spare), wg, w, l, 2, apair);
    epi_put_boxes<1>(smem_addr(spare) + 2 * kBox, wg, w, l, 0, hpair);
    epi_publish(sm);
    write_a(sm.epi, 0);  // first: the next round waits for this group alone
    write_a(spare, 1);
    write_h(spare + 2 * kBox, 0, 1);
    epi_acquire<2>(sm);  // (its barrier also orders the tail reads of the spare before a refill)
    epi_put_boxes<1>(smem_addr(sm.epi), wg, w, l, 1, hpair);
    epi_publish(sm);
    write_h(sm.epi, 1, 1);
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; half++) {  // gate (boxes 0, 1), then up (boxes 2, 3)
    epi_acquire(sm);
    epi_put_boxes<2>(smem_addr(sm.epi), wg, w, l, 2 * half, apair);
    epi_publish(sm);
    write_a(sm.epi, half);
  }
  epi_acquire(sm);
  epi_put_boxes<2>(smem_addr(sm.epi), wg, w, l, 0, hpair);
  epi_publish(sm);
  write_h(sm.epi, 0, 2);
}

// SwiGLU backward epilogue of a dh tile (columns f0 .. f0 + 255 of dh, rows [row0,
// row_end)), given a = gate|up (ld_a: a load map of it as [rows][2][F], row a_row =
// row0): d_a = bf16(dh up silu'(gate) | dh silu(gate)) into d_a [.., 2F] (store map
// st_da as [rows][2][F], row map_row = row0). Four rounds, one per 64-column quarter q,
// alternating between the spare stage (q = 0, 2) and sm.epi (q = 1, 3): TMA brings the
// quarter's gate and up boxes (128 x 64 bf16 each, 32 KB), each thread turns the words
// under its own accumulators into d_a words in place (the boxes' swizzled layout is
// epi_put_boxes'), and TMA stores send them to d_a. Quarter q + 2's loads go out once
// quarter q's stores have read the buffer, so they land while quarter q + 1 computes.
// The last store group comes from sm.epi (gemm_tiles' refill of the spare waits for
// all groups but the newest). epi_full[b] completes two phases a tile: quarter q
// waits for parity q / 2. kClamped: the clamped SwiGLU's derivative (docs/CPU.md: d_gate
// = dh (up' + 1) (s + alpha gate' s (1 - s)), 0 where gate > limit; d_up = dh gate' s,
// 0 where |up| > limit; s = sigmoid(alpha gate')).
template <bool kClamped = false>
__device__ __forceinline__ void swiglu_bwd_store(Smem& sm, float (&acc)[kAcc], int wg, int w, int l, int row0,
                                                 int row_end, int f0, int F, const CUtensorMap* ld_a, int a_row,
                                                 const StoreMap* st_da, int map_row, bf16* d_a, uint8_t* spare,
                                                 float alpha = 0.f, float limit = 0.f) {
  if (sm.knobs & 2) return;
  const int tid = tid_here(), rows = min(BM, row_end - row0);
  auto load = [&](int q) {  // thread 0: quarter q's gate and up boxes (none past F)
    uint8_t* buf = q % 2 ? sm.epi : spare;
    uint64_t* bar = &sm.epi_full[q % 2];
    const bool in = f0 + 64 * q < F;
    mbar_arrive_expect_tx(bar, in ? 2 * kBox : 0);
    if (in) {
      tma_load_3d(buf, ld_a, bar, f0 + 64 * q, 0, a_row);
      tma_load_3d(buf + kBox, ld_a, bar, f0 + 64 * q, 1, a_row);
    }
  };
  epi_acquire(sm);  // (its CTA barrier: both warpgroups' wgmmas are also done with the spare)
  if (tid == 0) load(0), load(1);
  const int r = acc_row(wg, w, l, 0), sw = r % 8;  // rows r and r + 8: same swizzle
  bool tail = false;  // threads read rows past the last whole 16-row box (the same each quarter)
  // quarter q, its dh values from dh_at(i), i = 4 j + 2 h + x: accumulator 32 q + i
  auto quarter = [&](int q, auto dh_at) {
    uint8_t* buf = q % 2 ? sm.epi : spare;
    MOK_STALL_FROM(kStallEpiLoads);
    while (!mbar_try_wait(&sm.epi_full[q % 2], q / 2)) {
    }
    MOK_STALL_ADD(kStallEpiLoads);
    if (f0 + 64 * q < F) {
      const uint32_t row_a = smem_addr(buf) + r * 128 + 4 * (l % 4);
#pragma unroll
      for (int j = 0; j < 8; j++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const uint32_t at = row_a + h * 8 * 128 + (j ^ sw) * 16;  // gate; up one box on
          const uint32_t g2 = ld_shared_b32(at), u2 = ld_shared_b32(at + kBox);
          float dg[2], du[2];
#pragma unroll
          for (int x = 0; x < 2; x++) {
            const float gate = x ? bf16_hi(g2) : bf16_lo(g2);
            const float up = x ? bf16_hi(u2) : bf16_lo(u2);
            const float dh = dh_at(4 * j + 2 * h + x);
            if constexpr (kClamped) {
              const float gc = clamp_gate(gate, limit), ag = __fmul_rn(alpha, gc), sg = sigmoid_fast(ag);
              const float dglu = __fadd_rn(sg, __fmul_rn(__fmul_rn(ag, sg), __fsub_rn(1.f, sg)));
              dg[x] = gate > limit ? 0.f : __fmul_rn(__fmul_rn(dh, __fadd_rn(clamp_up(up, limit), 1.f)), dglu);
              du[x] = up > limit || up < -limit ? 0.f : __fmul_rn(dh, __fmul_rn(gc, sg));
            } else {
              const float sg = sigmoid_fast(gate), si = __fmul_rn(gate, sg);
              const float dsi = __fmul_rn(sg, __fadd_rn(1.f, __fmul_rn(gate, __fsub_rn(1.f, sg))));
              dg[x] = __fmul_rn(__fmul_rn(dh, up), dsi);
              du[x] = __fmul_rn(dh, si);
            }
          }
          st_shared_b32(at, pack_bf16x2(dg[0], dg[1]));
          st_shared_b32(at + kBox, pack_bf16x2(du[0], du[1]));
        }
      }
      epi_publish(sm);
      tail = epi_write_boxes(
          sm, buf, st_da, 2, rows,
          [&](int b, const CUtensorMap* map, int rr, const uint8_t* src) {
            tma_store_3d(map, src, f0 + 64 * q, b, map_row + rr);
          },
          [&](int b, int rr) { return d_a + (int64_t)(row0 + rr) * 2 * F + b * F + f0 + 64 * q; });
    }
    if (q < 2) {
      // Before thread 0 arms the barrier's next phase, every thread must be past its
      // wait on this one: the tail rows read before the buffer is refilled, and with no
      // quarter q (F - f0 <= 64: gpt-oss's 2880, the tests' 64, 320, 576) nothing else
      // orders them, and load(q + 2) completes at once (no bytes); a thread still polling
      // would then see the parity it waits for come round again and wait for the next
      // tile's phase: a hang (found by racecheck's slow warps, branch pairs-nopad).
      if (tail || f0 + 64 * q >= F) __syncthreads();
      if (tid == 0) {
        MOK_STALL_FROM(kStallEpiStores);
        bulk_wait_read();
        MOK_STALL_ADD(kStallEpiStores);
        load(q + 2);
      }
    }
  };
  // The first quarter unrolled (its accumulators then die), the other three one loop
  // body taking theirs by selects among constant indices: the four quarters unrolled
  // were 2400 instructions a tile that missed the instruction cache (docs/PERF.md,
  // seventeenth session); one loop over all four keeps all 128 accumulators live through
  // it and spilled (twenty-first session).
  quarter(0, [&](int i) { return acc[i]; });
#pragma unroll 1
  for (int q = 1; q < 4; q++)
    quarter(q, [&](int i) { return q == 1 ? acc[32 + i] : q == 2 ? acc[64 + i] : acc[96 + i]; });
  if (tail) __syncthreads();
  // no quarter 3 (the last tile of an F that is not a multiple of 256): the last group
  // came from the spare, so it must be read before gemm_tiles refills the spare
  if (tid == 0 && f0 + 192 >= F) bulk_wait_read();
}

// GEMM phases over (m-tile, column group): the ticket order visits a band of m-tiles for
// each column group before the next, so the tasks running at once share the weight
// columns they read (in L2) instead of each m-tile streaming all of an expert's weights.
// band_order: fixed bands of kBand m-tiles (the weight gradients' row tiles, and the
// expert m-tiles' fallback).
__device__ __forceinline__ void band_order(int task, int num_mt, int num_g, int* mt, int* g) {
  const int band = task / (kBand * num_g), in = task % (kBand * num_g);
  const int rows = min(kBand, num_mt - band * kBand);
  *g = in / rows;
  *mt = band * kBand + in % rows;
}

// The expert m-tiles' bands end where an expert's run of tiles ends (PREFIX writes
// them, expert_segments): a band cut inside an expert has the expert's weights read by two
// waves, once from DRAM each (deepseek-v3's 2-3 tile experts against fixed bands of 8:
// a fifth of its experts). tile_band[q] = (first tile << 8) | tiles, of the band that
// holds m-tile q, for every q < num_mt. Task `task` of a phase with num_g column groups
// a tile: the band of q = task / num_g holds tasks [first num_g, (first + tiles) num_g),
// column group by column group. An entry that cannot be this step's (the backward after
// a forward that stopped early: MOK_STATUS_INVALID_SAVED is raised) falls back to the
// fixed bands, so that the task stays in range.
__device__ __forceinline__ void expert_band_order(const int32_t* tile_band, int task, int num_mt, int num_g, int* mt,
                                                  int* g) {
  const int q = task / num_g;
  const uint32_t band = (uint32_t)tile_band[q];
  const int first = (int)(band >> 8), rows = (int)(band & 255u);
  if (rows == 0 || first > q || q - first >= rows || first + rows > num_mt) return band_order(task, num_mt, num_g, mt, g);
  const int in = task - first * num_g;
  *g = in / rows;
  *mt = first + in % rows;
}

}  // namespace mok
