// sm90_schedule.cuh — which CTA runs what, in which order: the ticket counter (tasks in
// a fixed topological order, so a task only waits for tasks already taken: no deadlock
// with one CTA per SM), the agreement of a cluster's two CTAs to run paired GEMM tasks
// (cfg.cta_pairs: two tickets at once, two tasks on the same weight tile sharing its
// loads; docs/KERNELS.md), the expert m-tile table and its bands, and the step's end
// (finish_step). None of it changes a bit of any result (D2).
#pragma once
#include "sm90_sync.cuh"

namespace mok {

// Takes the next task; false when none is left or the step is abandoned. A cluster of
// 2 takes two consecutive tickets at once, rank r running base + r (which may be past
// the last task: the caller skips it), and the two leave only together (an error seen
// by rank 0 ends both), so that they pass the same cluster barriers.
__device__ __forceinline__ bool next_task(Smem& sm, const GpuStep& st, int num_tasks, int* task) {
  cta_sync();
  if (sm.cluster == 1) {
    if (threadIdx.x == 0) {
      int t = (int)atomicAdd(&st.sync->ticket, 1u);
      if (*(volatile uint32_t*)&st.sync->error != 0) t = num_tasks;
      sm.task = t;
    }
    cta_sync();
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

// A producer's kernel (MOK_PRODUCER_TU; sm90_tile_gemm.cuh's producer_loop): the
// epilogue's spare stage back to the ring once the stores have read it (all bulk groups
// of thread 0's but the newest N), arriving for both warpgroups, which did not release
// it after their last K block.
template <int N> __device__ __forceinline__ void release_spare(Smem& sm) {  // (thread 0)
  if (sm.load.spare_slot < 0) return;
  bulk_wait_read<N>();
  mbar_arrive_n(&sm.empty[sm.load.spare_slot], 2);
  sm.load.spare_slot = -1;
}
// Thread 0: every TMA store has read shared memory, so no stage is held as a spare (the
// stages may now be written by anyone: the partner's multicast, another layout's loads).
// (A producer's kernel also gives the spare back to the ring; the wait itself stays
// unconditional: with no spare held, the last epilogue's store from sm.epi may still read.)
__device__ __forceinline__ void release_stages_from_stores(Smem& sm) {
  if constexpr (kProducerTu) release_spare<0>(sm);
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
  cta_sync();
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
  cta_sync();
  if (sm.cluster > 1) cluster_sync();  // no CTA leaves while its partner may still write it
  if (threadIdx.x == 0) {
    bulk_wait_all();
    __threadfence();
    sm.last_cta = atomicAdd(&st.sync->exit_count, 1u) == gridDim.x - 1;
  }
  cta_sync();
  if (!sm.last_cta) return;
  __threadfence();
  // the first error since mok_context_sync last read it stays
  const uint32_t error = *(volatile uint32_t*)&st.sync->error;
  if (threadIdx.x == 0 && *st.status == 0) *st.status = error;
  if (threadIdx.x == 0 && used_up && error != MOK_STATUS_INVALID_SAVED) *used_up = MOK_SAVED_USED_GPU;
  uint32_t* words = st.sync->counter;
  // the working threads alone (kThreads; a producer warpgroup has stopped)
  for (uint32_t i = threadIdx.x; i < st.num_counters; i += kThreads) words[i] = 0;
  cta_sync();
  if (threadIdx.x == 0) {
    st.sync->ticket = 0;
    st.sync->error = 0;
    st.sync->launches++;
    __threadfence();
    st.sync->exit_count = 0;
  }
}

}  // namespace mok
