// sm90_sync.cuh — how tasks wait for each other: bounded polls of integer counters
// (acquire / release, no floating-point atomics), the W > 1 flags between ranks, the
// device-side error word, and the MOK_PROFILE / MOK_STALL_PROFILE hooks around waits.
#pragma once
#include "sm90_smem.cuh"

namespace mok {

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
  cta_sync();
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
  cta_sync();
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
  cta_sync();
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
  cta_sync();
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

}  // namespace mok
