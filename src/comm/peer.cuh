// peer.cuh — kernel-side steps of the expert-parallel protocol (docs/DISTRIBUTED.md):
// stores into a peer's window are published by a flag holding the step serial, written
// with system-scope release after the stores; the reader acquires it with a bounded
// wait. Flags only grow, so nothing is reset between steps and a late flag from an
// older step never satisfies a newer wait.
#pragma once
#include <stdint.h>

#include "cuda/ptx.cuh"  // globaltimer_ns

namespace mok {

__device__ __forceinline__ void flag_release_sys(uint64_t* flag, uint64_t serial) {
  asm volatile("fence.acq_rel.sys;\n st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(serial) : "memory");
}

__device__ __forceinline__ uint64_t flag_acquire_sys(const uint64_t* flag) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
  return v;
}

// One thread waits until *flag >= serial; false when timeout_ns passed first.
__device__ __forceinline__ bool flag_wait_sys(const uint64_t* flag, uint64_t serial, uint64_t timeout_ns) {
  const uint64_t t0 = globaltimer_ns();
  while (flag_acquire_sys(flag) < serial) {
    if (globaltimer_ns() - t0 > timeout_ns) return false;
    __nanosleep(256);
  }
  return true;
}

}  // namespace mok
