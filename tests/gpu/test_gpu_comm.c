/* test_gpu_comm.c — expert parallelism's NCCL layer on real GPUs (docs/DISTRIBUTED.md):
 * W = 2 ranks in one process exchange rows through symmetric windows and released
 * flags (tests/gpu/peer_exchange.cu), and a wait for a flag that never comes gives up
 * within its bound. Needs 2 GPUs (the nvidia-h200-x2 machine); with one it says so and
 * runs nothing. */
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "../runner.h"
#include "problem.h"

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

/* The forward at W = 2 (two GPUs, a thread each) against the CPU backend at W = 2, and
 * D3: the same bits as the CUDA forward at W = 1 on the same global batch (the router
 * losses too where rank 0's T is a multiple of 64, as DESIGN's D3 asks). */
static int ep_forward_w2(void) {
  if (gpus() < 2) {
    printf("    not run: %d GPU(s), the case needs 2\n", gpus());
    return 0;
  }
  static const struct {
    const char* name;
    int64_t T, H, F, E, K, Fs;
    mok_routing_t routing;
    float aux, z;
  } shapes[] = {
      {"e16_k4", 300, 256, 128, 16, 4, 0, MOK_ROUTING_FUSED, 0.f, 0.f},
      {"shared_tail", 77, 192, 64, 8, 2, 192, MOK_ROUTING_FUSED, 0.f, 0.f},
      {"replay", 513, 128, 64, 8, 2, 0, MOK_ROUTING_REPLAY, 0.f, 0.f},
      {"losses", 512, 256, 128, 16, 4, 0, MOK_ROUTING_FUSED, 1e-2f, 1e-3f},
      {"e64_k6", 2048, 512, 256, 64, 6, 128, MOK_ROUTING_FUSED, 1e-2f, 1e-3f},
  };
  int bad = 0;
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    mok_config_t c = MOK_CONFIG_INIT;
    c.H = shapes[i].H, c.F = shapes[i].F, c.E = shapes[i].E, c.K = shapes[i].K, c.Fs = shapes[i].Fs;
    c.routing = shapes[i].routing;
    c.aux_loss_coef = shapes[i].aux, c.z_loss_coef = shapes[i].z;
    mok_problem_t* p = test_problem(&c, shapes[i].T, test_case_seed() + i);
    TEST_ASSERT(p, "problem");
    mok_run_opts_t o = MOK_RUN_OPTS_INIT;
    o.backward = 0;
    o.capacity = shapes[i].T * shapes[i].K;  // (the ranks' T differ by one: the same windows on both)
    test_outputs_t cpu, gpu1, gpu2;
    o.W = 2;
    if (test_run(p, &o)) return 1;
    test_snapshot(p, 0, &cpu);
    char err[1024] = "";
    o.W = 1;
    mok_status_t st = mok_problem_run_cuda(p, &o, err, sizeof err);
    TEST_ASSERT(st == MOK_STATUS_SUCCESS, "%s: CUDA W = 1: %s: %s", shapes[i].name, mok_status_string(st), err);
    test_snapshot(p, 0, &gpu1);
    o.W = 2;
    st = mok_problem_run_cuda(p, &o, err, sizeof err);
    TEST_ASSERT(st == MOK_STATUS_SUCCESS, "%s: CUDA W = 2: %s: %s", shapes[i].name, mok_status_string(st), err);
    test_snapshot(p, 0, &gpu2);
    int b = test_same_bits(&gpu2, &gpu1, NULL, "D3 (CUDA W = 2 against W = 1)");
    b += test_same_bits(&gpu2, &cpu, "topk_idx tokens_per_expert", "W = 2 against the CPU");
    b += test_close(&gpu2, &cpu, "y topk_weight aux_loss z_loss", 1e-2, "W = 2 against the CPU");
    if (!b) printf("    %-12s W = 2: the same bits as W = 1, close to the CPU\n", shapes[i].name);
    bad += b;
  }
  return bad != 0;
}

const test_case_t suite_gpu_comm[] = {{"peer_exchange_w2", peer_exchange_w2}, {"ep_forward_w2", ep_forward_w2}, TEST_END};
