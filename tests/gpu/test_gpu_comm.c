/* test_gpu_comm.c — expert parallelism on real GPUs (docs/DISTRIBUTED.md): W ranks in
 * one process exchange rows through symmetric windows and released flags
 * (tests/gpu/peer_exchange.cu), and a wait for a flag that never comes gives up within
 * its bound; then the layer at W = 2, 4, 8 against the CPU and W = 1 (D3), per-rank
 * token counts, D1 and D2 at W = 4, capacity overflow and a silent rank. Every case
 * runs where there are fewer GPUs than ranks too: then all W ranks share GPU 0 through
 * a loopback id (mok_comm_loopback_id), the kernels' code and protocol those of W GPUs,
 * each rank SMs / W CTAs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "../runner.h"
#include "problem.h"

int mok_test_peer_exchange(int W, int steps, double timeout_ms, int loopback, char* why, size_t why_size);

/* With W ranks on one GPU each rank's stream needs a hardware queue of its own (mok.h,
 * mok_comm_loopback_id): set before the process's first CUDA call. */
__attribute__((constructor)) static void queues_per_stream(void) { setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0); }

static int gpus(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  return n;
}

/* Whether W ranks share GPU 0 (a loopback id): fewer GPUs than ranks here; says so. */
static int loopback(int W) {
  const int lb = gpus() < W;
  if (lb) printf("    %d ranks on GPU 0 (loopback communicator, %d GPU(s) here)\n", W, gpus());
  return lb;
}

/* The fault cases' small problem: E = 8, K = 2 on T tokens. */
static mok_problem_t* small_problem(int64_t T) {
  mok_config_t c = MOK_CONFIG_INIT;
  c.H = 128, c.F = 64, c.E = 8, c.K = 2;
  return test_problem(&c, T, test_case_seed());
}

static int peer_exchange_w(int W) {
  char why[1024];
  const int failures = mok_test_peer_exchange(W, 3, 300.0, loopback(W), why, sizeof why);
  if (why[0]) printf("    %s\n", why);
  TEST_ASSERT(failures == 0, "%d rank(s) failed", failures);
  return 0;
}
static int peer_exchange_w2(void) { return peer_exchange_w(2); }
static int peer_exchange_w4(void) { return peer_exchange_w(4); }
static int peer_exchange_w8(void) { return peer_exchange_w(8); }

/* Expert parallelism on W GPUs (a thread each): a shape run on the CPU backend at W,
 * then on the CUDA backend at W = 1 and at W. The CUDA outputs at W must have the bits
 * of W = 1 (D3) and be close to the CPU's. */
typedef struct {
  const char* name;
  int64_t T, H, F, E, K, Fs;
  mok_routing_t routing;
  mok_wgrad_t wgrad;
  float aux, z;
  int64_t rank_T[8]; /* each rank's tokens (summing to T), or all 0: the even split */
  int hot;           /* skewed routing: sigmoid scores, experts 0 .. hot - 1 a selection
                        bias of 2 (every token picks them; the owners of the others get
                        no rows), or 0 */
  int n_group, topk_group; /* group-limited routing, DeepSeek-V3's router (sigmoid, bias,
                              scale 2.5, top-2 sums), or 0 */
  int router_bias;         /* cfg.use_router_bias */
  int expert_bias;         /* cfg.use_expert_bias */
  float swiglu_limit;      /* > 0: gpt-oss's clamped SwiGLU at this limit (alpha 1.702), or 0 */
  int shared_gate;         /* cfg.use_shared_gate (needs Fs > 0) */
} ep_shape_t;

/* A capacity that no routing overflows and both backends take at any split: the rows
 * a rank can receive at most, T min(K, E / W) (the CPU's bound: mok.h). */
static int64_t full_capacity(const ep_shape_t* sh, int W) {
  const int64_t per_token = sh->K < sh->E / W ? sh->K : sh->E / W;
  return sh->T * per_token;
}

/* The shape's layer (c) and its problem on T tokens with the shape's skew. */
static mok_config_t ep_config(const ep_shape_t* sh) {
  mok_config_t c = MOK_CONFIG_INIT;
  c.H = sh->H, c.F = sh->F, c.E = sh->E, c.K = sh->K, c.Fs = sh->Fs;
  c.routing = sh->routing, c.wgrad = sh->wgrad;
  c.aux_loss_coef = sh->aux, c.z_loss_coef = sh->z;
  if (sh->hot) c.score = MOK_SCORE_SIGMOID, c.use_bias_select = 1;
  if (sh->n_group) {
    c.n_group = sh->n_group, c.topk_group = sh->topk_group;
    c.score = MOK_SCORE_SIGMOID, c.use_bias_select = 1, c.route_scale = 2.5f;
  }
  c.use_router_bias = sh->router_bias, c.use_expert_bias = sh->expert_bias, c.use_shared_gate = sh->shared_gate;
  if (sh->swiglu_limit > 0)
    c.activation = MOK_ACTIVATION_SWIGLU_CLAMPED, c.swiglu_alpha = 1.702f, c.swiglu_limit = sh->swiglu_limit;
  return c;
}
static mok_problem_t* ep_problem(const ep_shape_t* sh, const mok_config_t* c, uint64_t seed) {
  mok_problem_t* p = test_problem(c, sh->T, seed);
  for (int e = 0; p && e < sh->hot; e++) {
    if (p->real == 4) ((float*)p->bias_select)[e] = 2.f;
    else ((double*)p->bias_select)[e] = 2.0;
  }
  return p;
}

/* Did the GPU's top-K (gpu) differ from the CPU's (cpu) only at near-ties? (selection
 * keys within 1e-6 in the double-precision reference of the same input: the backends'
 * fp32 logits differ in summation order) */
static int ties_only(const ep_shape_t* sh, mok_config_t c, uint64_t seed, const test_outputs_t* cpu,
                     const test_outputs_t* gpu) {
  const mok_tensor_view_t* gi = test_view(gpu, "topk_idx");
  const mok_tensor_view_t* ci = test_view(cpu, "topk_idx");
  if (c.routing != MOK_ROUTING_FUSED || !gi || !ci) return 0;
  c.numerics = MOK_NUMERICS_EXACT;
  mok_problem_t* pe = ep_problem(sh, &c, seed);
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
    const mok_config_t c = ep_config(sh);
    mok_problem_t* p = ep_problem(sh, &c, seed);
    TEST_ASSERT(p, "problem");
    mok_run_opts_t o = MOK_RUN_OPTS_INIT;
    o.backward = backward;
    o.capacity = full_capacity(sh, W);  // (every rank's window alike, whatever its T)
    if (sh->rank_T[0] || sh->rank_T[1]) o.rank_T = sh->rank_T;
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
      if (b == 0 && attempt < 3 && ties_only(sh, c, seed, &cpu, &gpu[1])) {
        printf("    %-12s top-K differs from the CPU only at near-ties: values compared on the next seed's input\n",
               sh->name);
        continue;
      }
      b++;
    }
    b += test_close(&gpu[1], &cpu, "y dx topk_weight d_topk_weight aux_loss z_loss d_w_router d_b_router d_w13 d_w2 d_b13 d_b2 d_ws13 d_ws2 d_w_sg",
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

/* A memory option at W = 2 has the bits of the defaults at W = 1 (D3 with the option on
 * one side only): cfg.gate_up = MOK_GATE_UP_RECOMPUTE (the expert rows' x in the
 * window), or cfg.saved_use = MOK_SAVED_REUSE (d_a over the received rows' gate|up). */
static int ep_option_w2(mok_gate_up_t gate_up, mok_saved_use_t saved_use) {
  loopback(2);
  static const ep_shape_t shapes[] = {
      {"shared", 768, 192, 64, 8, 2, 192, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"e64_k6", 2048, 512, 256, 64, 6, 128, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
  };
  int bad = 0;
  for (size_t i = 0; i < 2; i++) {
    const ep_shape_t* sh = &shapes[i];
    mok_config_t c = MOK_CONFIG_INIT;
    c.H = sh->H, c.F = sh->F, c.E = sh->E, c.K = sh->K, c.Fs = sh->Fs;
    c.routing = sh->routing, c.wgrad = sh->wgrad;
    c.aux_loss_coef = sh->aux, c.z_loss_coef = sh->z;
    mok_config_t r = c;
    r.gate_up = gate_up, r.saved_use = saved_use;
    mok_problem_t* keep = test_problem(&c, sh->T, test_case_seed() + i);
    mok_problem_t* other = test_problem(&r, sh->T, test_case_seed() + i);
    TEST_ASSERT(keep && other, "problems");
    mok_run_opts_t o = MOK_RUN_OPTS_INIT;
    o.capacity = full_capacity(sh, 2);
    test_outputs_t a, b;
    char err[1024] = "";
    mok_status_t st = mok_problem_run_cuda(keep, &o, err, sizeof err);
    TEST_ASSERT(st == MOK_STATUS_SUCCESS, "%s: W = 1, defaults: %s: %s", sh->name, mok_status_string(st), err);
    o.W = 2;
    st = mok_problem_run_cuda(other, &o, err, sizeof err);
    TEST_ASSERT(st == MOK_STATUS_SUCCESS, "%s: W = 2, the option: %s: %s", sh->name, mok_status_string(st), err);
    test_snapshot(keep, 1, &a);
    test_snapshot(other, 1, &b);
    bad += test_same_bits(&b, &a, NULL, sh->name) != 0;
  }
  return bad;
}
static int ep_gate_up_w2(void) { return ep_option_w2(MOK_GATE_UP_RECOMPUTE, MOK_SAVED_KEEP); }
static int ep_saved_reuse_w2(void) { return ep_option_w2(MOK_GATE_UP_SAVE, MOK_SAVED_REUSE); }

/* Every output of the last run (forward's and backward's, every rank's slice, rank 0's
 * replicated ones) still the run's poison, 0xFF bytes: nothing was written. */
static int untouched(const mok_problem_t* p, const char* when) {
  mok_tensor_view_t v[32];
  const int n = mok_problem_outputs(p, 1, v, 32);
  int bad = 0;
  for (int i = 0; i < n; i++) {
    const uint8_t* b = v[i].data;
    size_t k = 0;
    while (k < (size_t)v[i].count * v[i].elem && b[k] == 0xFF) k++;
    if (k < (size_t)v[i].count * v[i].elem) {
      printf("    %s: %s written (byte %zu)\n", when, v[i].name, k);
      bad++;
    }
  }
  if (!bad) printf("    %s: all %d outputs untouched\n", when, n);
  return bad;
}

/* A step that would overflow a rank's capacity stops on every rank with
 * MOK_STATUS_CAPACITY_EXCEEDED (each rank sees every count, so all decide alike). */
static int ep_capacity(int W) {
  loopback(W);
  mok_problem_t* p = small_problem(512);
  TEST_ASSERT(p, "problem");
  mok_run_opts_t o = MOK_RUN_OPTS_INIT;
  o.W = W;
  o.capacity = 512 * 2 / W / 2;  // each rank's experts get about 1024 / W of the rows: half fit
  char err[1024] = "";
  const mok_status_t st = mok_problem_run_cuda(p, &o, err, sizeof err);
  printf("    %s: %s\n", mok_status_string(st), err);
  for (int r = 0; r < W; r++)
    TEST_ASSERT(p->rank_status[r] == MOK_STATUS_CAPACITY_EXCEEDED, "rank %d: got %s, not MOK_STATUS_CAPACITY_EXCEEDED",
                r, mok_status_string(p->rank_status[r]));
  return untouched(p, "after the overflowing step (forward and backward)");
}

/* A rank that creates its context and then never steps: the others' steps return
 * MOK_STATUS_COMM_TIMEOUT within their bound (0.5 s here), no hang, and every context
 * is destroyed. */
static int ep_timeout(int W) {
  loopback(W);
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
  for (int r = 0; r < W; r++)
    TEST_ASSERT(p->rank_status[r] == (r == 1 ? MOK_STATUS_SUCCESS : MOK_STATUS_COMM_TIMEOUT),
                "rank %d: got %s", r, mok_status_string(p->rank_status[r]));
  TEST_ASSERT(s < 10.0, "the run took %.1f s", s);
  /* every context destroyed cleanly: the same W runs again, every rank present */
  o.silent_rank = -1;
  o.comm_timeout_s = 0;  // (the default bound)
  const mok_status_t again = mok_problem_run_cuda(p, &o, err, sizeof err);
  TEST_ASSERT(again == MOK_STATUS_SUCCESS, "the run after it: %s: %s", mok_status_string(again), err);
  printf("    every other rank COMM_TIMEOUT; the next run at W = %d: SUCCESS\n", W);
  return 0;
}

static int ep_capacity_w2(void) { return ep_capacity(2); }
static int ep_timeout_w2(void) { return ep_timeout(2); }

/* At W = 2, 4 and 8: the forward and a step against the CPU at W and bitwise against W = 1, hence
 * D3 over W = 1, 2, 4, 8 on each batch; capacity and timeout at 2 and 4.
 * The forward alone: token counts that split unevenly (77, 513), shared expert, replay;
 * the router losses where every rank's T is a multiple of 64 (DESIGN's D3 condition).
 * A step: every gradient, the replicated ones through the ranks' subtrees (every
 * rank's T a multiple of 64, the chunks W = 1 has: T_global a multiple of 64 W).
 * E a multiple of 8. */
static int ep_forward_w(int W) {
  loopback(W);
  static const ep_shape_t shapes[] = {
      {"e16_k4", 300, 256, 128, 16, 4, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 0.f, 0.f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"shared_tail", 77, 192, 64, 8, 2, 192, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 0.f, 0.f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"replay", 513, 128, 64, 8, 2, 0, MOK_ROUTING_REPLAY, MOK_WGRAD_BF16, 0.f, 0.f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"losses", 1024, 256, 128, 16, 4, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"e64_k6", 2048, 512, 256, 64, 6, 128, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
  };
  return ep_shapes(shapes, sizeof shapes / sizeof shapes[0], 0, W);
}
static int ep_step_w(int W) {
  loopback(W);
  static const ep_shape_t shapes[] = {
      {"e16_k4", 512, 256, 128, 16, 4, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"shared", 1024, 192, 64, 8, 2, 192, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"replay", 512, 128, 64, 8, 2, 64, MOK_ROUTING_REPLAY, MOK_WGRAD_BF16, 0.f, 0.f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"accum", 1024, 256, 128, 16, 2, 128, MOK_ROUTING_FUSED, MOK_WGRAD_FP32_ACCUM, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"e64_k6", 2048, 512, 256, 64, 6, 128, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      // every token's two experts among 0 .. 3: at W = 2 rank 1's experts get no rows
      // (W = 4: ranks 2, 3; W = 8: ranks 4 .. 7), rank 0's all it can receive
      {"skewed", 1024, 256, 128, 8, 2, 64, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 0.f, 1e-3f, {0}, 4, 0, 0, 0, 0, 0.f, 0},
  };
  return ep_shapes(shapes, sizeof shapes / sizeof shapes[0], 1, W);
}
static int ep_forward_w2(void) { return ep_forward_w(2); }
static int ep_step_w2(void) { return ep_step_w(2); }
static int ep_forward_w4(void) { return ep_forward_w(4); }
static int ep_step_w4(void) { return ep_step_w(4); }
static int ep_capacity_w4(void) { return ep_capacity(4); }
static int ep_capacity_w8(void) { return ep_capacity(8); }
static int ep_timeout_w8(void) { return ep_timeout(8); }
static int ep_timeout_w4(void) { return ep_timeout(4); }
static int ep_forward_w8(void) { return ep_forward_w(8); }
static int ep_step_w8(void) { return ep_step_w(8); }

/* The router's and experts' variants at W (issue 33; those of E a multiple of W): E not
 * a multiple of 8, more than 256 experts, K up to 32, group-limited routing with a group
 * on one rank, on several, and spanning ranks (W = 8, groups of 4: two groups a rank; 12
 * groups of 32 on 8 ranks of 48 experts), the router logit bias (d_b_router through the
 * ranks' subtrees; added into fp32), gpt-oss's expert biases and clamped SwiGLU, Qwen2-MoE's
 * gated shared expert. A step:
 * forward and backward, D3 and the CPU. */
static int ep_router_w(int W) {
  loopback(W);
  static const ep_shape_t shapes[] = {
      {"e60", 512, 128, 64, 60, 4, 64, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"e24_k3", 512, 128, 64, 24, 3, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"e384_k8", 1024, 128, 64, 384, 8, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"e1024_k32", 512, 128, 64, 1024, 32, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"groups_v3", 1024, 128, 64, 256, 8, 64, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 8, 4, 0, 0, 0.f, 0},
      {"groups_of_4", 512, 128, 64, 32, 4, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 0.f, 1e-3f, {0}, 0, 8, 3, 0, 0, 0.f, 0},
      {"groups_e384", 512, 128, 64, 384, 8, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 0.f, {0}, 0, 12, 4, 0, 0, 0.f, 0},
      {"bias_e64", 1024, 128, 64, 64, 4, 64, MOK_ROUTING_FUSED, MOK_WGRAD_FP32_ACCUM, 1e-2f, 1e-3f, {0}, 0, 0, 0, 1, 0, 0.f, 0},
      {"bias_groups", 512, 128, 64, 256, 8, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 8, 4, 1, 0, 0.f, 0},
      // gpt-oss's experts: biases (d_b13, d_b2 summed on each owner over every rank's
      // rows) with its router bias and clamped SwiGLU, F and H tails; written and added into
      {"gptoss_e32", 512, 320, 192, 32, 4, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 0, 0, 1, 1, 0.5f, 0},
      {"ebias_accum", 1024, 128, 64, 16, 2, 64, MOK_ROUTING_FUSED, MOK_WGRAD_FP32_ACCUM, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 1, 0.f, 0},
      // Qwen2-MoE's gated shared expert: s_g and dl_g per token on its own rank, d_w_sg
      // through the ranks' subtrees (written, and added into beside the router bias)
      {"gate_e60", 512, 256, 64, 60, 4, 128, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 1},
      {"gate_accum", 1024, 128, 64, 16, 2, 64, MOK_ROUTING_FUSED, MOK_WGRAD_FP32_ACCUM, 1e-2f, 1e-3f, {0}, 0, 0, 0, 1, 1, 0.f, 1},
  };
  int bad = 0;
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
    if (shapes[i].E % W == 0) bad += ep_compare(&shapes[i], test_case_seed() + i, 1, W);
  return bad != 0;
}
static int ep_router_w2(void) { return ep_router_w(2); }
static int ep_router_w4(void) { return ep_router_w(4); }
static int ep_router_w8(void) { return ep_router_w(8); }

/* Each rank its own token count (DESIGN.md section 1: T may differ between ranks), a
 * rank with none among them: the forward on any split; a step with the router losses
 * and the replicated gradients where every rank's T is a multiple of 64 (D3's
 * condition), against the CPU on the same split and bitwise against W = 1. */
static int ep_uneven(int W) {
  loopback(W);
  static const ep_shape_t fwd2[] = {
      {"first_empty", 300, 256, 128, 16, 4, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 0.f, 0.f, {0, 300}, 0, 0, 0, 0, 0, 0.f, 0},
      {"last_empty", 77, 192, 64, 8, 2, 192, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 0.f, 0.f, {77, 0}, 0, 0, 0, 0, 0, 0.f, 0},
  };
  static const ep_shape_t fwd4[] = {
      {"0_77_300_135", 512, 256, 128, 16, 4, 0, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 0.f, 0.f, {0, 77, 300, 135}, 0, 0, 0, 0, 0, 0.f, 0},
      {"replay_1_0_2_510", 513, 128, 64, 8, 2, 64, MOK_ROUTING_REPLAY, MOK_WGRAD_BF16, 0.f, 0.f, {1, 0, 2, 510}, 0, 0, 0, 0, 0, 0.f, 0},
  };
  static const ep_shape_t fwd8[] = {
      {"8_ranks_3_empty", 1000, 256, 128, 16, 4, 128, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 0.f, 0.f,
       {0, 400, 1, 0, 333, 200, 0, 66}, 0, 0, 0, 0, 0, 0.f, 0},
  };
  static const ep_shape_t step2[] = {
      {"step_0_512", 512, 256, 128, 16, 4, 128, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f, {0, 512}, 0, 0, 0, 0, 0, 0.f, 0},
  };
  static const ep_shape_t step4[] = {
      {"step_0_192_64_256", 512, 192, 64, 8, 2, 192, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f,
       {0, 192, 64, 256}, 0, 0, 0, 0, 0, 0.f, 0},
      {"accum_128_0_384_0", 512, 256, 128, 16, 2, 0, MOK_ROUTING_FUSED, MOK_WGRAD_FP32_ACCUM, 1e-2f, 1e-3f,
       {128, 0, 384, 0}, 0, 0, 0, 0, 0, 0.f, 0},
      {"replay_64_320_0_128", 512, 128, 64, 8, 2, 64, MOK_ROUTING_REPLAY, MOK_WGRAD_BF16, 0.f, 0.f,
       {64, 320, 0, 128}, 0, 0, 0, 0, 0, 0.f, 0},
  };
  static const ep_shape_t step8[] = {
      {"step_8_ranks", 1024, 256, 128, 16, 4, 128, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f, 1e-3f,
       {0, 256, 64, 0, 448, 64, 192, 0}, 0, 0, 0, 0, 0, 0.f, 0},
  };
#define N(a) (sizeof a / sizeof a[0])
  if (W == 2) return ep_shapes(fwd2, N(fwd2), 0, 2) + ep_shapes(step2, N(step2), 1, 2);
  if (W == 4) return ep_shapes(fwd4, N(fwd4), 0, 4) + ep_shapes(step4, N(step4), 1, 4);
  return ep_shapes(fwd8, N(fwd8), 0, 8) + ep_shapes(step8, N(step8), 1, 8);
#undef N
}
static int ep_uneven_w2(void) { return ep_uneven(2); }
static int ep_uneven_w4(void) { return ep_uneven(4); }
static int ep_uneven_w8(void) { return ep_uneven(8); }

/* The outputs of two CUDA runs of one problem at W = 4, bit for bit. */
static int ep_same_runs(const ep_shape_t* sh, const mok_run_opts_t* a, const mok_run_opts_t* b, const char* what) {
  const mok_config_t c = ep_config(sh);
  mok_problem_t* p = ep_problem(sh, &c, test_case_seed());
  TEST_ASSERT(p, "problem");
  test_outputs_t out[2];
  const mok_run_opts_t* o[2] = {a, b};
  for (int k = 0; k < 2; k++) {
    char err[1024] = "";
    const mok_status_t st = mok_problem_run_cuda(p, o[k], err, sizeof err);
    TEST_ASSERT(st == MOK_STATUS_SUCCESS, "%s: %s, run %d: %s: %s", sh->name, what, k, mok_status_string(st), err);
    test_snapshot(p, 1, &out[k]);
  }
  const int bad = test_same_bits(&out[1], &out[0], NULL, what) != 0;
  if (!bad) printf("    %-12s %s: bitwise identical\n", sh->name, what);
  return bad;
}

static const ep_shape_t d_shape = {"shared", 1024, 256, 128, 16, 4, 128, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1e-2f,
                                   1e-3f, {0}, 0, 0, 0, 0, 0, 0.f, 0};

/* D1 at W = 4: a run of 3 steps twice, and 1 step against 3 (every step's outputs are
 * the same bits: nothing of a step leaks into the next). */
static int ep_d1_w4(void) {
  loopback(4);
  mok_run_opts_t three = MOK_RUN_OPTS_INIT, one = MOK_RUN_OPTS_INIT;
  three.W = one.W = 4;
  three.steps = 3;
  three.capacity = one.capacity = full_capacity(&d_shape, 4);
  return ep_same_runs(&d_shape, &three, &three, "D1 run-to-run (3 steps)") +
         ep_same_runs(&d_shape, &one, &three, "D1 step-to-step (1 step vs 3)");
}

/* D2 at W = 4: the same bits whatever CTAs each rank's launches get, the ranks' grids
 * different from each other's too. */
static int ep_d2_w4(void) {
  const int lb = loopback(4);
  int sms = 0;
  TEST_ASSERT(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess, "SM count");
  const int most = lb ? sms / 4 : sms;  // (a loopback rank's bound: SMs / W)
  mok_run_opts_t base = MOK_RUN_OPTS_INIT, mixed = MOK_RUN_OPTS_INIT, small = MOK_RUN_OPTS_INIT;
  base.W = mixed.W = small.W = 4;
  base.capacity = mixed.capacity = small.capacity = full_capacity(&d_shape, 4);
  const int grids[4] = {most, 9, most - 1, 16};
  for (int r = 0; r < 4; r++) mixed.rank_num_ctas[r] = grids[r];
  small.num_ctas = 8;
  char what[96];
  snprintf(what, sizeof what, "D2 grids %d, %d, %d, %d vs the default", grids[0], grids[1], grids[2], grids[3]);
  const int a = ep_same_runs(&d_shape, &base, &mixed, what);
  return a + ep_same_runs(&d_shape, &base, &small, "D2 8 CTAs a rank vs the default");
}

/* With a loopback id a rank's grid is at most SMs / W: cfg.num_ctas above that is
 * refused at create, naming the bound, on every rank (no launch could be resident). */
static int ep_loopback_grid(void) {
  if (gpus() >= 2) printf("    (loopback forced: %d GPUs here)\n", gpus());
  int sms = 0;
  TEST_ASSERT(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess, "SM count");
  mok_problem_t* p = small_problem(256);
  TEST_ASSERT(p, "problem");
  mok_run_opts_t o = MOK_RUN_OPTS_INIT;
  o.W = 2;
  o.loopback = 1;
  o.num_ctas = sms / 2 + 1;
  char err[1024] = "";
  mok_status_t st = mok_problem_run_cuda(p, &o, err, sizeof err);
  printf("    num_ctas = %d: %s: %s\n", o.num_ctas, mok_status_string(st), err);
  TEST_ASSERT(st == MOK_STATUS_INVALID_ARGUMENT && strstr(err, "cfg.num_ctas"), "got %s, want INVALID_ARGUMENT",
              mok_status_string(st));
  o.num_ctas = sms / 2;
  st = mok_problem_run_cuda(p, &o, err, sizeof err);
  TEST_ASSERT(st == MOK_STATUS_SUCCESS, "num_ctas = %d: %s: %s", o.num_ctas, mok_status_string(st), err);
  return 0;
}

const test_case_t suite_gpu_comm[] = {
    {"peer_exchange_w2", peer_exchange_w2}, {"peer_exchange_w4", peer_exchange_w4},
    {"peer_exchange_w8", peer_exchange_w8}, {"ep_forward_w2", ep_forward_w2}, {"ep_step_w2", ep_step_w2},
    {"ep_capacity_w2", ep_capacity_w2},     {"ep_timeout_w2", ep_timeout_w2},   {"ep_gate_up_w2", ep_gate_up_w2},
    {"ep_saved_reuse_w2", ep_saved_reuse_w2},
    {"ep_forward_w4", ep_forward_w4},       {"ep_step_w4", ep_step_w4},         {"ep_capacity_w4", ep_capacity_w4},
    {"ep_timeout_w4", ep_timeout_w4},       {"ep_forward_w8", ep_forward_w8},   {"ep_step_w8", ep_step_w8},
    {"ep_capacity_w8", ep_capacity_w8},     {"ep_timeout_w8", ep_timeout_w8},   {"ep_uneven_w2", ep_uneven_w2},
    {"ep_uneven_w4", ep_uneven_w4},         {"ep_uneven_w8", ep_uneven_w8},     {"ep_d1_w4", ep_d1_w4},
    {"ep_d2_w4", ep_d2_w4},                 {"ep_loopback_grid", ep_loopback_grid},
    {"ep_router_w2", ep_router_w2},         {"ep_router_w4", ep_router_w4},     {"ep_router_w8", ep_router_w8},
    TEST_END};
