/* test_gpu_comm.c — expert parallelism's NCCL layer on real GPUs (docs/DISTRIBUTED.md):
 * W = 2 ranks in one process exchange rows through symmetric windows and released
 * flags (tests/gpu/peer_exchange.cu), and a wait for a flag that never comes gives up
 * within its bound. Needs 2 GPUs (the nvidia-h200-x2 machine); with one it says so and
 * runs nothing. */
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "../runner.h"

int mok_test_peer_exchange(int W, int steps, double timeout_ms, char* why, size_t why_size);

static int gpus(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  return n;
}

static int peer_exchange_w2(void) {
  if (gpus() < 2) {
    printf("    not run: %d GPU(s), the case needs 2\n", gpus());
    return 0;
  }
  char why[1024];
  const int failures = mok_test_peer_exchange(2, 3, 300.0, why, sizeof why);
  if (why[0]) printf("    %s\n", why);
  TEST_ASSERT(failures == 0, "%d rank(s) failed", failures);
  return 0;
}

const test_case_t suite_gpu_comm[] = {{"peer_exchange_w2", peer_exchange_w2}, TEST_END};
