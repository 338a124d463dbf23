/* test_gpu_comm.c — expert parallelism's NCCL layer on real GPUs (docs/DISTRIBUTED.md):
 * W = 2 ranks in one process exchange rows through symmetric windows and released
 * flags (tests/gpu/peer_exchange.cu), and a wait for a flag that never comes gives up
 * within its bound. Needs 2 GPUs (the nvidia-h200-x2 machine); with one it says so and
 * runs nothing. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "../runner.h"
#include "problem.h"

int mok_test_peer_exchange(int W, int steps, double timeout_ms, char* why, size_t why_size);

static int gpus(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  return n;
}

/* Whether the machine has the W GPUs a case needs; says so when not. */
static int have_gpus(int W) {
  if (gpus() >= W) return 1;
  printf("    not run: %d GPU(s), the case needs %d\n", gpus(), W);
  return 0;
}
static int two_gpus(void) { return have_gpus(2); }

/* The fault cases' small problem: E = 8, K = 2 on T tokens. */
static mok_problem_t* small_problem(int64_t T) {
  mok_config_t c = MOK_CONFIG_INIT;
  c.H = 128, c.F = 64, c.E = 8, c.K = 2;
  return test_problem(&c, T, test_case_seed());
}

static int peer_exchange_w2(void) {
  if (!two_gpus()) return TEST_NOT_RUN;
  char why[1024];
  const int failures = mok_test_peer_exchange(2, 3, 300.0, why, sizeof why);
  if (why[0]) printf("    %s\n", why);
  TEST_ASSERT(failures == 0, "%d rank(s) failed", failures);
  return 0;
}

/* Expert parallelism on W GPUs (a thread each): a shape run on the CPU backend at W,
 * then on the CUDA backend at W = 1 and at W. The CUDA outputs at W must have the bits
 * of W = 1 (D3) and be close to the CPU's. */
typedef struct {
  const char* name;
  int64_t T, H, F, E, K, Fs;
  mok_routing_t routing;
  mok_wgrad_t wgrad;
  float aux, z;
} ep_shape_t;

/* Did the GPU's top-K (gpu) differ from the CPU's (cpu) only at near-ties? (selection
 * keys within 1e-6 in the double-precision reference of the same input: the backends'
 * fp32 logits differ in summation order) */
static int ties_only(mok_config_t c, int64_t T, uint64_t seed, const test_outputs_t* cpu, const test_outputs_t* gpu) {
  const mok_tensor_view_t* gi = test_view(gpu, "topk_idx");
  const mok_tensor_view_t* ci = test_view(cpu, "topk_idx");
  if (c.routing != MOK_ROUTING_FUSED || !gi || !ci) return 0;
  c.numerics = MOK_NUMERICS_EXACT;
  mok_problem_t* pe = test_problem(&c, T, seed);
  if (!pe) return 0;
  mok_problem_t pb = *pe;
  memcpy(pe->out_topk_idx, ci->data, (size_t)ci->count * 4);
  pb.out_topk_idx = (int32_t*)gi->data;
  return test_same_routing_up_to_ties(&pb, pe);
}

/* One global batch at W against the CPU at W and bitwise against CUDA W = 1 (D3). A
 * near-tie flipped in top-K changes that token's outputs on either backend rightly:
 * such an input is checked for D3 and its routing up to ties, and the values against
 * the CPU on the next seed's input, up to 4 tries (as gpu.vs_cpu does). */
static int ep_compare(const ep_shape_t* sh, uint64_t seed0, int backward, int W) {
  for (int attempt = 0;; attempt++) {
    const uint64_t seed = seed0 + 0x9e3779b97f4a7c15ull * (uint64_t)attempt;
    mok_config_t c = MOK_CONFIG_INIT;
    c.H = sh->H, c.F = sh->F, c.E = sh->E, c.K = sh->K, c.Fs = sh->Fs;
    c.routing = sh->routing, c.wgrad = sh->wgrad;
    c.aux_loss_coef = sh->aux, c.z_loss_coef = sh->z;
    mok_problem_t* p = test_problem(&c, sh->T, seed);
    TEST_ASSERT(p, "problem");
    mok_run_opts_t o = MOK_RUN_OPTS_INIT;
    o.backward = backward;
    o.capacity = sh->T * sh->K;  // (both ranks' windows alike when their T differ by one)
    test_outputs_t cpu, gpu[2];
    o.W = W;
    if (test_run(p, &o)) return 1;
    test_snapshot(p, backward, &cpu);
    for (int k = 0; k < 2; k++) {  // W = 1, then W
      char err[1024] = "";
      o.W = k ? W : 1;
      const mok_status_t st = mok_problem_run_cuda(p, &o, err, sizeof err);
      TEST_ASSERT(st == MOK_STATUS_SUCCESS, "%s: CUDA W = %d: %s: %s", sh->name, o.W, mok_status_string(st), err);
      test_snapshot(p, backward, &gpu[k]);
    }
    char what[64];
    snprintf(what, sizeof what, "D3 (CUDA W = %d against W = 1)", W);
    int b = test_same_bits(&gpu[1], &gpu[0], NULL, what);
    snprintf(what, sizeof what, "W = %d against the CPU", W);
    if (test_same_bits(&gpu[1], &cpu, "topk_idx tokens_per_expert", what)) {
      if (b == 0 && attempt < 3 && ties_only(c, sh->T, seed, &cpu, &gpu[1])) {
        printf("    %-12s top-K differs from the CPU only at near-ties: values compared on the next seed's input\n",
               sh->name);
        continue;
      }
      b++;
    }
    b += test_close(&gpu[1], &cpu, "y dx topk_weight d_topk_weight aux_loss z_loss d_w_router d_w13 d_w2 d_ws13 d_ws2",
                    1e-2, what);
    if (!b) printf("    %-12s W = %d: the bits of W = 1, close to the CPU\n", sh->name, W);
    return b;
  }
}

/* ep_compare over a table of shapes at W, seeds from the case's. */
static int ep_shapes(const ep_shape_t* shapes, size_t n, int backward, int W) {
  int bad = 0;
  for (size_t i = 0; i < n; i++) bad += ep_compare(&shapes[i], test_case_seed() + i, backward, W);
  return bad != 0;
}

/* cfg.gate_up = MOK_GATE_UP_RECOMPUTE at W = 2 (the expert rows' x in the window) has
 * the bits of keeping gate|up at W = 1 (D3 with the option on one side only). */
static int ep_gate_up_w2(void) {
  if (!two_gpus()) return TEST_NOT_RUN;
  static const ep_shape_t shapes[] = {
      {"shared", 768, 192, 64, 8, 2, 192, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f},
      {"e64_k6", 2048, 512, 256, 64, 6, 128, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f},
  };
  int bad = 0;
  for (size_t i = 0; i < 2; i++) {
    const ep_shape_t* sh = &shapes[i];
    mok_config_t c = MOK_CONFIG_INIT;
    c.H = sh->H, c.F = sh->F, c.E = sh->E, c.K = sh->K, c.Fs = sh->Fs;
    c.routing = sh->routing, c.wgrad = sh->wgrad;
    c.aux_loss_coef = sh->aux, c.z_loss_coef = sh->z;
    mok_config_t r = c;
    r.gate_up = MOK_GATE_UP_RECOMPUTE;
    mok_problem_t* keep = test_problem(&c, sh->T, test_case_seed() + i);
    mok_problem_t* redo = test_problem(&r, sh->T, test_case_seed() + i);
    TEST_ASSERT(keep && redo, "problems");
    mok_run_opts_t o = MOK_RUN_OPTS_INIT;
    o.capacity = sh->T * sh->K;
    test_outputs_t a, b;
    char err[1024] = "";
    mok_status_t st = mok_problem_run_cuda(keep, &o, err, sizeof err);
    TEST_ASSERT(st == MOK_STATUS_SUCCESS, "%s: W = 1, keeping: %s: %s", sh->name, mok_status_string(st), err);
    o.W = 2;
    st = mok_problem_run_cuda(redo, &o, err, sizeof err);
    TEST_ASSERT(st == MOK_STATUS_SUCCESS, "%s: W = 2, recomputing: %s: %s", sh->name, mok_status_string(st), err);
    test_snapshot(keep, 1, &a);
    test_snapshot(redo, 1, &b);
    bad += test_same_bits(&b, &a, NULL, sh->name) != 0;
  }
  return bad;
}

/* A step that would overflow a rank's capacity stops on every rank with
 * MOK_STATUS_CAPACITY_EXCEEDED (each rank sees every count, so all decide alike). */
static int ep_capacity(int W) {
  if (!have_gpus(W)) return TEST_NOT_RUN;
  mok_problem_t* p = small_problem(512);
  TEST_ASSERT(p, "problem");
  mok_run_opts_t o = MOK_RUN_OPTS_INIT;
  o.W = W;
  o.capacity = 512 * 2 / W / 2;  // each rank's experts get about 1024 / W of the rows: half fit
  char err[1024] = "";
  const mok_status_t st = mok_problem_run_cuda(p, &o, err, sizeof err);
  printf("    %s: %s\n", mok_status_string(st), err);
  TEST_ASSERT(st == MOK_STATUS_CAPACITY_EXCEEDED, "got %s, not MOK_STATUS_CAPACITY_EXCEEDED", mok_status_string(st));
  return 0;
}

/* A rank that creates its context and then never steps: the others' steps return
 * MOK_STATUS_COMM_TIMEOUT within their bound (0.5 s here), no hang, and every context
 * is destroyed. */
static int ep_timeout(int W) {
  if (!have_gpus(W)) return TEST_NOT_RUN;
  mok_problem_t* p = small_problem(256);
  TEST_ASSERT(p, "problem");
  mok_run_opts_t o = MOK_RUN_OPTS_INIT;
  o.W = W;
  o.silent_rank = 1;
  o.comm_timeout_s = 0.5;
  char err[1024] = "";
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  const mok_status_t st = mok_problem_run_cuda(p, &o, err, sizeof err);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  printf("    %s after %.2f s (rank 1 silent for 1.5 s): %s\n", mok_status_string(st), s, err);
  TEST_ASSERT(st == MOK_STATUS_COMM_TIMEOUT, "got %s, not MOK_STATUS_COMM_TIMEOUT", mok_status_string(st));
  TEST_ASSERT(s < 10.0, "the run took %.1f s", s);
  return 0;
}

static int ep_capacity_w2(void) { return ep_capacity(2); }
static int ep_timeout_w2(void) { return ep_timeout(2); }

/* At W = 2, 4 and 8 (4 and 8: issue 6; a case is not run where the machine has fewer
 * GPUs): the forward and a step against the CPU at W and bitwise against W = 1, hence
 * D3 over W = 1, 2, 4, 8 on each batch; capacity and timeout at 2 and 4.
 * The forward alone: token counts that split unevenly (77, 513), shared expert, replay;
 * the router losses where every rank's T is a multiple of 64 (DESIGN's D3 condition).
 * A step: every gradient, the replicated ones through the ranks' subtrees (every
 * rank's T a multiple of 64, the chunks W = 1 has: T_global a multiple of 64 W).
 * E a multiple of 8. */
static int ep_forward_w(int W) {
  if (!have_gpus(W)) return TEST_NOT_RUN;
  static const ep_shape_t shapes[] = {
      {"e16_k4", 300, 256, 128, 16, 4, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 0.f, 0.f},
      {"shared_tail", 77, 192, 64, 8, 2, 192, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 0.f, 0.f},
      {"replay", 513, 128, 64, 8, 2, 0, MOK_ROUTING_REPLAY, MOK_WGRAD_BF16, 0.f, 0.f},
      {"losses", 1024, 256, 128, 16, 4, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f},
      {"e64_k6", 2048, 512, 256, 64, 6, 128, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f},
  };
  return ep_shapes(shapes, sizeof shapes / sizeof shapes[0], 0, W);
}
static int ep_step_w(int W) {
  if (!have_gpus(W)) return TEST_NOT_RUN;
  static const ep_shape_t shapes[] = {
      {"e16_k4", 512, 256, 128, 16, 4, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f},
      {"shared", 1024, 192, 64, 8, 2, 192, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f},
      {"replay", 512, 128, 64, 8, 2, 64, MOK_ROUTING_REPLAY, MOK_WGRAD_BF16, 0.f, 0.f},
      {"accum", 1024, 256, 128, 16, 2, 128, MOK_ROUTING_FUSED, MOK_WGRAD_FP32_ACCUM, 1e-2f, 1e-3f},
      {"e64_k6", 2048, 512, 256, 64, 6, 128, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f},
  };
  return ep_shapes(shapes, sizeof shapes / sizeof shapes[0], 1, W);
}
static int ep_forward_w2(void) { return ep_forward_w(2); }
static int ep_step_w2(void) { return ep_step_w(2); }
static int ep_forward_w4(void) { return ep_forward_w(4); }
static int ep_step_w4(void) { return ep_step_w(4); }
static int ep_capacity_w4(void) { return ep_capacity(4); }
static int ep_timeout_w4(void) { return ep_timeout(4); }
static int ep_forward_w8(void) { return ep_forward_w(8); }
static int ep_step_w8(void) { return ep_step_w(8); }

const test_case_t suite_gpu_comm[] = {
    {"peer_exchange_w2", peer_exchange_w2}, {"ep_forward_w2", ep_forward_w2}, {"ep_step_w2", ep_step_w2},
    {"ep_capacity_w2", ep_capacity_w2},     {"ep_timeout_w2", ep_timeout_w2},   {"ep_gate_up_w2", ep_gate_up_w2},
    {"ep_forward_w4", ep_forward_w4},       {"ep_step_w4", ep_step_w4},         {"ep_capacity_w4", ep_capacity_w4},
    {"ep_timeout_w4", ep_timeout_w4},       {"ep_forward_w8", ep_forward_w8},   {"ep_step_w8", ep_step_w8},
    TEST_END};
