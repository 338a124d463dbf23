/* test_gpu.c — the CUDA backend against the CPU backend (its oracle), and D1, D2, D4,
 * replay, CUDA graphs and device-side errors on the GPU. Built into mok_gpu_tests by
 * `make test-gpu` (same runner, same last line as `make test`).
 *
 * Tolerances: bf16 tensors and fp32 results by ||gpu - cpu|| / ||cpu|| <= 1e-2 (the two
 * backends differ only in the order of fp32 sums inside dot products, softmax and
 * warp reductions); integers (top-K, tokens_per_expert) exactly. Outputs are poisoned
 * on the device before every run (tools/problem.c). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "../runner.h"

typedef struct {
  const char* name;
  int64_t T, H, F, E, K, Fs;
  int routing, score, normalize, bias, wgrad;
  float route_scale, aux, z;
  int nan_token; /* a token whose x gets a NaN, or -1 */
  int hot;       /* experts 0 .. hot - 1 get a selection bias of 2 (sigmoid scores: every
                    token picks them first), or 0 */
  int n_group, topk_group, group_score; /* group-limited routing (cfg.n_group), or 0 */
  int router_bias;                       /* cfg.use_router_bias (b_router ~ U(-0.5, 0.5)) */
  float swiglu_limit;                    /* > 0: gpt-oss's clamped SwiGLU at this limit (alpha
                                            1.702), or 0 */
  int expert_bias;                       /* cfg.use_expert_bias (b13, b2 ~ U(-0.5, 0.5)) */
  int shared_gate;                       /* cfg.use_shared_gate (Fs > 0; w_sg ~ U(-1, 1) 2 / sqrt(H)) */
} gpu_shape_t;

#define FUSED MOK_ROUTING_FUSED
#define REPLAY MOK_ROUTING_REPLAY
#define SOFTMAX MOK_SCORE_SOFTMAX
#define SIGMOID MOK_SCORE_SIGMOID
#define BF16 MOK_WGRAD_BF16
#define ACCUM MOK_WGRAD_FP32_ACCUM

/* 26 shapes: tails of every tile, K = 1 and K = E, E up to 256, shared expert, replay,
 * sigmoid, accumulation, NaN input, skewed routing with empty experts (edge cases of
 * DESIGN.md section 6). */
static const gpu_shape_t shapes[] = {
    {"tiny", 512, 256, 128, 8, 2, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"one_token", 1, 128, 64, 8, 2, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"t37", 37, 128, 64, 16, 4, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"t129", 129, 192, 192, 16, 2, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 0.f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"k1", 300, 128, 128, 8, 1, 0, FUSED, SOFTMAX, 0, 0, BF16, 1.f, 1e-2f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"k_all", 200, 128, 64, 8, 8, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"sigmoid_bias", 700, 256, 128, 32, 4, 0, FUSED, SIGMOID, 1, 1, BF16, 2.5f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"sigmoid_plain", 333, 128, 192, 16, 3, 0, FUSED, SIGMOID, 0, 0, BF16, 1.f, 0.f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"scale_no_norm", 256, 256, 64, 16, 2, 0, FUSED, SOFTMAX, 0, 0, BF16, 2.5f, 0.f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"shared", 400, 256, 128, 16, 2, 128, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"shared_tail", 77, 192, 64, 8, 2, 192, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"e256", 1024, 256, 64, 256, 8, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"e128_k8", 2048, 512, 256, 128, 8, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"h_not_128", 300, 320, 320, 16, 2, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"f64", 500, 128, 64, 8, 2, 64, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 0.f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"accum", 256, 256, 128, 16, 2, 128, FUSED, SOFTMAX, 1, 0, ACCUM, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"replay", 300, 256, 128, 16, 4, 0, REPLAY, SOFTMAX, 1, 0, BF16, 1.f, 0.f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"replay_shared", 150, 128, 128, 8, 2, 64, REPLAY, SOFTMAX, 1, 0, BF16, 1.f, 0.f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"replay_k1", 257, 128, 64, 8, 1, 0, REPLAY, SOFTMAX, 1, 0, BF16, 1.f, 0.f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"nan_x", 200, 128, 64, 8, 2, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 0.f, 0.f, 5, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"nan_x_replay", 200, 128, 64, 8, 2, 0, REPLAY, SOFTMAX, 1, 0, BF16, 1.f, 0.f, 0.f, 5, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"wide", 4096, 1024, 512, 32, 4, 256, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"tall", 8192, 256, 128, 64, 6, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    // 4096 rows an expert: weight-gradient tasks of 2 of the 3 column tiles (two groups)
    {"wgrad_groups", 4096, 576, 576, 8, 8, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"accum_replay", 128, 128, 128, 8, 2, 0, REPLAY, SOFTMAX, 1, 0, ACCUM, 1.f, 0.f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    // skewed routing: 4 experts of 8192 rows, 4 empty ones whose zero gradients span
    // two column groups (2 tiles, then 1 of 64 columns) and a last row tile of 64 rows
    {"skewed_groups", 8192, 576, 576, 8, 4, 0, FUSED, SIGMOID, 1, 1, BF16, 1.f, 0.f, 1e-3f, -1, 4, 0, 0, 0, 0, 0.f, 0, 0},
    // about 350 rows an expert: weight-gradient tasks of 5 to 7 K blocks (paired, past
    // the A-resident runs' 4), H = 192: a last row tile of 64 rows
    {"rows_350", 700, 192, 128, 4, 2, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
};

#define TOP2 MOK_GROUP_SCORE_TOP2
#define MAX1 MOK_GROUP_SCORE_MAX

/* The router's and experts' variants (issue 33): E from 1 to 1024, not a multiple of 8
 * (the logits' rows padded to 8), more than 256 (the router warps' 16 and 32 registers a
 * lane), K up to 32; group-limited routing: DeepSeek-V3's (8 groups of 32, the best 4 by
 * their top-2 sums, sigmoid, bias, scale 2.5), DeepSeek-V2's largest-key groups, groups
 * of one expert, groups beyond 256 experts; gpt-oss's router logit bias and clamped
 * SwiGLU. */
static const gpu_shape_t router_shapes[] = {
    {"e1", 200, 128, 64, 1, 1, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"e3", 300, 128, 64, 3, 2, 64, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"e4_sigmoid", 257, 128, 128, 4, 4, 0, FUSED, SIGMOID, 1, 1, BF16, 2.5f, 1e-2f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"e6", 500, 192, 64, 6, 3, 0, FUSED, SOFTMAX, 0, 0, ACCUM, 1.f, 0.f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"e60", 1000, 256, 64, 60, 4, 128, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"e384_k8", 1024, 256, 64, 384, 8, 0, FUSED, SIGMOID, 1, 1, BF16, 2.5f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"e512_k10", 1024, 128, 64, 512, 10, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"e1024_k32", 512, 128, 64, 1024, 32, 64, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"e1000_replay", 300, 128, 64, 1000, 6, 0, REPLAY, SOFTMAX, 1, 0, BF16, 1.f, 0.f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 0},
    {"groups_v3", 1024, 256, 64, 256, 8, 0, FUSED, SIGMOID, 1, 1, BF16, 2.5f, 1e-2f, 1e-3f, -1, 0, 8, 4, TOP2, 0, 0.f, 0, 0},
    {"groups_v2", 700, 128, 128, 64, 6, 64, FUSED, SOFTMAX, 0, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 8, 3, MAX1, 0, 0.f, 0, 0},
    {"groups_of_one", 300, 128, 64, 16, 2, 0, FUSED, SIGMOID, 1, 1, BF16, 1.f, 0.f, 0.f, -1, 0, 16, 5, TOP2, 0, 0.f, 0, 0},
    {"groups_e384", 512, 128, 64, 384, 8, 0, FUSED, SIGMOID, 1, 1, BF16, 2.5f, 1e-2f, 0.f, -1, 0, 12, 4, TOP2, 0, 0.f, 0, 0},
    {"groups_e60", 400, 128, 64, 60, 4, 0, FUSED, SIGMOID, 1, 1, BF16, 1.f, 0.f, 1e-3f, -1, 0, 6, 2, TOP2, 0, 0.f, 0, 0},
    // gpt-oss's router logit bias: softmax over the biased logits, d_b_router through the
    // tree (written fp32, or added into; chunks of T = 300 with a tail), and with groups
    {"bias_gptoss", 512, 256, 128, 32, 4, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 1, 0.f, 0, 0},
    {"bias_accum_e60", 300, 128, 64, 60, 4, 64, FUSED, SOFTMAX, 1, 0, ACCUM, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 1, 0.f, 0, 0},
    {"bias_groups_e384", 512, 128, 64, 384, 8, 0, FUSED, SIGMOID, 1, 1, BF16, 2.5f, 1e-2f, 0.f, -1, 0, 12, 4, TOP2, 1, 0.f, 0, 0},
    // gpt-oss's clamped SwiGLU (the *_clamped_kernel launches): at its limit 7 (rarely
    // active here) beside the logit bias, and at 0.5 (gate and up clamped often) with the
    // shared expert's plain SwiGLU, and in replay routing
    {"clamped_gptoss", 512, 256, 128, 32, 4, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 1, 7.f, 0, 0},
    {"clamped_tight", 300, 128, 192, 16, 2, 64, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 0.f, -1, 0, 0, 0, 0, 0, 0.5f, 0, 0},
    {"clamped_replay", 200, 128, 64, 8, 2, 0, REPLAY, SOFTMAX, 1, 0, BF16, 1.f, 0.f, 0.f, -1, 0, 0, 0, 0, 0, 0.5f, 0, 0},
    // gpt-oss's expert biases (b13 in GEMM1's and RG's epilogues, b2 in GEMM2's; d_b13,
    // d_b2 in the weight-gradient tasks): with its router bias and clamped SwiGLU, an F
    // tail of half a tile (F % 128 = 64) and an H tail of a quarter (H % 256 = 64); added
    // into fp32 beside a shared expert and E not a multiple of 8; replay; skewed routing
    // (empty experts: zero gradients, + 0 added); experts of several row blocks each
    {"ebias_gptoss", 512, 320, 192, 32, 4, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 1, 7.f, 1, 0},
    {"ebias_accum_e60", 300, 128, 64, 60, 4, 64, FUSED, SOFTMAX, 1, 0, ACCUM, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 1, 0},
    {"ebias_replay", 200, 256, 128, 8, 2, 0, REPLAY, SOFTMAX, 1, 0, BF16, 1.f, 0.f, 0.f, -1, 0, 0, 0, 0, 0, 0.5f, 1, 0},
    {"ebias_skewed", 1024, 192, 128, 16, 4, 0, FUSED, SIGMOID, 1, 1, BF16, 1.f, 0.f, 1e-3f, -1, 4, 0, 0, 0, 0, 0.f, 1, 0},
    {"ebias_skewed_accum", 1024, 192, 128, 16, 4, 0, FUSED, SIGMOID, 1, 1, ACCUM, 1.f, 0.f, 0.f, -1, 4, 0, 0, 0, 0, 0.f, 1, 0},
    {"ebias_tall", 8192, 256, 128, 8, 2, 0, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 1, 0},
    // Qwen2-MoE's gated shared expert (s_g in COMBINE, kept in saved; dy_s and dl_g in DG,
    // d_w_sg through the tree): Qwen2-MoE's router (60 experts, top-4, no normalisation)
    // with H of 4 chunks a lane; an H tail (24 chunks: lanes past them idle) with a chunk
    // tail added into fp32; replay; every variant at once (gpt-oss's router and experts
    // beside the gate); many chunks (8192 tokens)
    {"gate_qwen2", 1024, 1024, 128, 60, 4, 512, FUSED, SOFTMAX, 0, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 1},
    {"gate_accum_tail", 300, 192, 64, 8, 2, 192, FUSED, SOFTMAX, 1, 0, ACCUM, 1.f, 1e-2f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 1},
    {"gate_replay", 200, 128, 64, 8, 2, 64, REPLAY, SOFTMAX, 1, 0, BF16, 1.f, 0.f, 0.f, -1, 0, 0, 0, 0, 0, 0.f, 0, 1},
    {"gate_all", 512, 320, 192, 32, 4, 128, FUSED, SOFTMAX, 1, 0, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 8, 3, MAX1, 1, 7.f, 1, 1},
    {"gate_tall", 8192, 256, 128, 16, 2, 128, FUSED, SIGMOID, 1, 1, BF16, 1.f, 1e-2f, 1e-3f, -1, 0, 0, 0, 0, 0, 0.f, 0, 1},
};

static mok_config_t shape_config(const gpu_shape_t* s) {
  mok_config_t c = MOK_CONFIG_INIT;
  c.H = s->H, c.F = s->F, c.E = s->E, c.K = s->K, c.Fs = s->Fs;
  c.routing = s->routing, c.score = s->score, c.normalize = s->normalize;
  c.use_bias_select = s->bias, c.wgrad = s->wgrad, c.route_scale = s->route_scale;
  c.aux_loss_coef = s->aux, c.z_loss_coef = s->z;
  c.n_group = s->n_group, c.topk_group = s->topk_group, c.group_score = (mok_group_score_t)s->group_score;
  c.use_router_bias = s->router_bias, c.use_expert_bias = s->expert_bias, c.use_shared_gate = s->shared_gate;
  if (s->swiglu_limit > 0)
    c.activation = MOK_ACTIVATION_SWIGLU_CLAMPED, c.swiglu_alpha = 1.702f, c.swiglu_limit = s->swiglu_limit;
  return c;
}

static mok_problem_t* shape_problem_as(const gpu_shape_t* s, uint64_t seed, mok_gate_up_t gate_up,
                                       mok_saved_use_t saved_use) {
  mok_config_t c = shape_config(s);
  c.gate_up = gate_up, c.saved_use = saved_use;
  mok_problem_t* p = test_problem(&c, s->T, seed);
  if (p && s->nan_token >= 0) ((uint16_t*)p->x)[s->nan_token * s->H + 3] = 0x7fc0;
  for (int e = 0; p && e < s->hot; e++) {
    if (p->real == 4) ((float*)p->bias_select)[e] = 2.f;
    else ((double*)p->bias_select)[e] = 2.0;
  }
  return p;
}
static mok_problem_t* shape_problem(const gpu_shape_t* s, uint64_t seed) {
  return shape_problem_as(s, seed, MOK_GATE_UP_SAVE, MOK_SAVED_KEEP);
}

static mok_status_t run_cuda(mok_problem_t* p, const mok_run_opts_t* o) {
  char err[512] = "";
  mok_status_t s = mok_problem_run_cuda(p, o, err, sizeof err);
  if (s) printf("    cuda run: %s: %s\n", mok_status_string(s), err);
  return s;
}

/* Routing of the GPU (gpu) against the CPU (cpu): the same experts in every slot, or a
 * near-tie (selection keys within 1e-6 in the double-precision reference: the two
 * backends' fp32 logits differ in summation order; *tied is then 1), and
 * tokens_per_expert equal to the count of the GPU's own top-K. Returns failures. */
static int same_routing(const gpu_shape_t* s, uint64_t seed, const test_outputs_t* cpu, const test_outputs_t* gpu,
                        int* tied) {
  *tied = 0;
  if (test_same_bits(gpu, cpu, "topk_idx tokens_per_expert", "") == 0) return 0;
  *tied = 1;
  const mok_tensor_view_t* gi = test_view(gpu, "topk_idx");
  const mok_tensor_view_t* ci = test_view(cpu, "topk_idx");
  const mok_tensor_view_t* gt = test_view(gpu, "tokens_per_expert");
  if (s->routing != MOK_ROUTING_FUSED || !gi || !ci || !gt) return 1;
  mok_config_t c = shape_config(s);
  c.numerics = MOK_NUMERICS_EXACT;
  mok_problem_t* pe = test_problem(&c, s->T, seed);
  TEST_ASSERT(pe, "exact twin problem");
  if (s->nan_token >= 0) ((double*)pe->x)[s->nan_token * s->H + 3] = NAN;
  mok_problem_t pb = *pe;
  memcpy(pe->out_topk_idx, ci->data, (size_t)ci->count * 4);
  pb.out_topk_idx = (int32_t*)gi->data;
  TEST_ASSERT(test_same_routing_up_to_ties(&pb, pe), "%s: GPU and CPU top-K differ beyond near-ties", s->name);
  int64_t* n = calloc((size_t)s->E, sizeof *n);
  for (int64_t i = 0; i < gi->count; i++) n[((const int32_t*)gi->data)[i]]++;
  int bad = 0;
  for (int64_t e = 0; e < s->E; e++) bad += n[e] != ((const int32_t*)gt->data)[e];
  free(n);
  TEST_ASSERT(!bad, "%s: tokens_per_expert is not the count of the GPU's top-K", s->name);
  printf("    %s: top-K differs from the CPU only at near-ties (keys within 1e-6)\n", s->name);
  return 0;
}

/* The GPU against the CPU on every shape. A near-tie flipped in top-K changes that
 * token's outputs and every gradient it feeds, on either backend rightly (d_w_router
 * by 1.4e-2 once, in "tall"): such an input is checked for its routing alone, and the
 * values on the next seed's input, up to 4 tries (then on the last, ties or not). */
static int vs_cpu_on(const gpu_shape_t* list, size_t n, mok_cta_pairs_t pairs) {
  int bad = 0;
  for (size_t i = 0; i < n; i++) {
    const gpu_shape_t* s = &list[i];
    test_outputs_t cpu, gpu;
    int b = 0;
    for (int attempt = 0;; attempt++) {
      const uint64_t seed = test_case_seed() + i + 0x9e3779b97f4a7c15ull * (uint64_t)attempt;
      mok_problem_t* p = shape_problem(s, seed);
      TEST_ASSERT(p, "problem");
      mok_run_opts_t o = MOK_RUN_OPTS_INIT;
      if (test_run(p, &o)) return 1;
      test_snapshot(p, 1, &cpu);
      o.cta_pairs = pairs;
      if (run_cuda(p, &o)) return 1;
      test_snapshot(p, 1, &gpu);
      int tied;
      b = same_routing(s, seed, &cpu, &gpu, &tied);
      if (b == 0 && tied && attempt < 3) {
        printf("    %s: values compared on the next seed's input\n", s->name);
        continue;
      }
      break;
    }
    b += test_close(&gpu, &cpu, "y dx topk_weight d_topk_weight aux_loss z_loss d_w_router d_b_router d_w13 d_w2 d_b13 d_b2 d_ws13 d_ws2 d_w_sg",
                    1e-2,
                    s->name);
    if (b == 0) {
      double worst = 0;
      for (int k = 0; k < cpu.n; k++) {
        double e = mok_relative_error(&gpu.v[k], &cpu.v[k]);
        if (e > worst) worst = e;
      }
      printf("    %-14s T=%-5lld H=%-5lld F=%-4lld E=%-4lld K=%-2lld Fs=%-4lld worst relative error %.2e\n", s->name,
             (long long)s->T, (long long)s->H, (long long)s->F, (long long)s->E, (long long)s->K, (long long)s->Fs,
             worst);
    }
    bad += b;
  }
  return bad != 0;
}
/* Both GEMM paths: CTAs in clusters of 2 whose tasks on the same weight tile share its
 * loads (paired), and every CTA alone. */
#define COUNT(a) (sizeof(a) / sizeof((a)[0]))
static int gpu_vs_cpu_paired(void) { return vs_cpu_on(shapes, COUNT(shapes), MOK_CTA_PAIRS_ON); }
static int gpu_vs_cpu_unpaired(void) { return vs_cpu_on(shapes, COUNT(shapes), MOK_CTA_PAIRS_OFF); }
static int router_vs_cpu(void) { return vs_cpu_on(router_shapes, COUNT(router_shapes), MOK_CTA_PAIRS_AUTO); }

/* Bytes of every output of two CUDA runs with options a and b. */
static int same_bits_runs(const gpu_shape_t* s, mok_run_opts_t a, mok_run_opts_t b, const char* what) {
  mok_problem_t* p = shape_problem(s, test_case_seed());
  TEST_ASSERT(p, "problem");
  test_outputs_t ra, rb;
  if (run_cuda(p, &a)) return 1;
  test_snapshot(p, 1, &ra);
  if (run_cuda(p, &b)) return 1;
  test_snapshot(p, 1, &rb);
  return test_same_bits(&ra, &rb, NULL, what) != 0;
}

/* D1: the same step again (a fresh context) and 10 steps on one context. */
static int d1_repeat(void) {
  mok_run_opts_t one = MOK_RUN_OPTS_INIT, ten = MOK_RUN_OPTS_INIT;
  ten.steps = 10;
  return same_bits_runs(&shapes[9], one, one, "D1 twice") + same_bits_runs(&shapes[12], one, ten, "D1 ten steps") +
         same_bits_runs(&shapes[6], one, ten, "D1 ten steps sigmoid");
}

/* D2: the grid at 132, 66 and 17 CTAs gives the same bits, and 132 CTAs in pairs (66
 * clusters of 2 sharing weight tiles) the same as 132 alone; 17 runs unpaired (odd). */
static int d2_grid(void) {
  int bad = 0;
  const int grids[] = {66, 17, 132};
  const char* what[] = {"D2 132 paired vs 66 paired", "D2 132 paired vs 17", "D2 132 paired vs 132 unpaired"};
  for (int i = 0; i < 3; i++) {
    mok_run_opts_t full = MOK_RUN_OPTS_INIT, part = MOK_RUN_OPTS_INIT;
    full.num_ctas = 132;
    full.cta_pairs = MOK_CTA_PAIRS_ON;
    part.num_ctas = grids[i];
    part.cta_pairs = i == 2 ? MOK_CTA_PAIRS_OFF : MOK_CTA_PAIRS_ON;
    bad += same_bits_runs(&shapes[12], full, part, what[i]);
    bad += same_bits_runs(&shapes[9], full, part, what[i]);
  }
  return bad;
}

/* D4: a token's y alone equals its y inside the batch (tokens 0, 1, T / 2 and T - 1). */
static int d4_of(const gpu_shape_t* s) {
  mok_problem_t* big = shape_problem(s, test_case_seed());
  TEST_ASSERT(big, "problem");
  mok_run_opts_t o = MOK_RUN_OPTS_INIT;
  o.backward = 0;
  if (run_cuda(big, &o)) return 1;
  const int64_t tokens[] = {0, 1, s->T / 2, s->T - 1};
  for (int i = 0; i < 4; i++) {
    mok_config_t c = shape_config(s);
    mok_problem_t* one = test_problem(&c, 1, 1);
    TEST_ASSERT(one, "problem");
    const size_t row = (size_t)s->H * 2;
    memcpy(one->x, (char*)big->x + tokens[i] * row, row);
    mok_problem_copy_weights(one, big);  // (every weight and variant tensor: b_router too)
    if (run_cuda(one, &o)) return 1;
    TEST_ASSERT(memcmp(one->y, (char*)big->y + tokens[i] * row, row) == 0,
                "D4 (%s): token %lld alone differs from in the batch", s->name, (long long)tokens[i]);
  }
  return 0;
}
static int d4_batch(void) { return d4_of(&shapes[12]); }

/* A forward + backward step captured in a CUDA graph and replayed gives the eager bits. */
static int graph_capture(void) {
  mok_run_opts_t eager = MOK_RUN_OPTS_INIT, graph = MOK_RUN_OPTS_INIT;
  graph.graph = 1;
  graph.steps = 3;
  return same_bits_runs(&shapes[9], eager, graph, "graph replay") + same_bits_runs(&shapes[16], eager, graph, "graph replay (replay routing)");
}

/* The router's variants keep D1 (ten steps on one context against one), D2 (132 CTAs
 * paired against 17) and D4: 384 experts (16 registers a lane), 1024 and K = 32, E not
 * a multiple of 8, DeepSeek-V3's groups and groups beyond 256 experts, the logit bias,
 * the clamped SwiGLU. */
static const gpu_shape_t* router_shape(const char* name) {
  for (size_t i = 0; i < COUNT(router_shapes); i++)
    if (!strcmp(router_shapes[i].name, name)) return &router_shapes[i];
  return NULL;
}
static int router_determinism(void) {
  static const char* const names[] = {"e3",          "e384_k8",          "e1024_k32",     "groups_v3",   "groups_e384",
                                      "bias_gptoss", "bias_groups_e384", "clamped_tight", "ebias_gptoss", "ebias_skewed",
                                      "gate_qwen2",  "gate_all"};
  int bad = 0;
  for (size_t k = 0; k < COUNT(names); k++) {
    const gpu_shape_t* s = router_shape(names[k]);
    TEST_ASSERT(s, "no router shape %s", names[k]);
    mok_run_opts_t one = MOK_RUN_OPTS_INIT, ten = MOK_RUN_OPTS_INIT, full = MOK_RUN_OPTS_INIT, part = MOK_RUN_OPTS_INIT;
    ten.steps = 10;
    full.num_ctas = 132, full.cta_pairs = MOK_CTA_PAIRS_ON;
    part.num_ctas = 17;
    char what[96];
    snprintf(what, sizeof what, "D1 ten steps (%s)", s->name);
    bad += same_bits_runs(s, one, ten, what);
    snprintf(what, sizeof what, "D2 132 paired vs 17 (%s)", s->name);
    bad += same_bits_runs(s, full, part, what);
    bad += d4_of(s);
  }
  return bad != 0;
}

/* The clamped SwiGLU and the expert biases with gate|up recomputed in the backward (the
 * RG tasks' epilogue) and with saved reused give the bits of keeping gate|up. */
static int variants_gate_up(void) {
  static const char* const names[] = {"clamped_tight", "ebias_gptoss", "gate_all"};
  const mok_gate_up_t gate_up[] = {MOK_GATE_UP_RECOMPUTE, MOK_GATE_UP_SAVE};
  const mok_saved_use_t saved_use[] = {MOK_SAVED_KEEP, MOK_SAVED_REUSE};
  int bad = 0;
  for (size_t k = 0; k < COUNT(names); k++)
    for (int v = 0; v < 2; v++) {
      const gpu_shape_t* s = router_shape(names[k]);
      TEST_ASSERT(s, "no router shape %s", names[k]);
      mok_problem_t* keep = shape_problem_as(s, test_case_seed(), MOK_GATE_UP_SAVE, MOK_SAVED_KEEP);
      mok_problem_t* other = shape_problem_as(s, test_case_seed(), gate_up[v], saved_use[v]);
      TEST_ASSERT(keep && other, "problems");
      mok_run_opts_t o = MOK_RUN_OPTS_INIT;
      if (run_cuda(keep, &o) || run_cuda(other, &o)) return 1;
      test_outputs_t a, b;
      test_snapshot(keep, 1, &a);
      test_snapshot(other, 1, &b);
      char what[96];
      snprintf(what, sizeof what, "%s: %s vs keep", s->name, v ? "reuse" : "recompute");
      bad += test_same_bits(&b, &a, NULL, what) != 0;
    }
  return bad;
}

/* Steps called from a thread other than the one that made the context give the same
 * bits: one with no CUDA context current (PyTorch's autograd thread for device 0), and
 * one whose current device is another GPU (the last one visible), left current. */
static int step_thread(void) {
  mok_run_opts_t here = MOK_RUN_OPTS_INIT, bare = MOK_RUN_OPTS_INIT, here2 = MOK_RUN_OPTS_INIT,
                 other = MOK_RUN_OPTS_INIT;
  bare.step_thread = 1;
  here2.steps = other.steps = 2;  // (fp32 accumulation over two steps)
  other.step_thread = 2;
  return same_bits_runs(&shapes[9], here, bare, "a step on a thread with no context") +
         same_bits_runs(&shapes[15], here2, other, "steps on a thread with another device current") +
         same_bits_runs(&shapes[16], here, bare, "a replay step on a thread with no context");
}

/* cfg.gate_up = MOK_GATE_UP_RECOMPUTE: the backward's RG and RGS tasks run the forward's
 * GEMM1 and SHARED1 again, so every output and gradient has the bits of keeping gate|up:
 * shared experts (with tails), fp32 accumulation over two steps, replay, skewed routing
 * with empty experts, 17 CTAs, and a CUDA graph. The fixture hands backward a workspace
 * of NaNs, so a backward that read forward's gate|up there instead would fail. */
static size_t aligned256(int64_t bytes) { return (size_t)(bytes + 255) / 256 * 256; }

/* The shapes a variant of the kernels (gate_up_recompute, saved_reuse) is checked on:
 * shared experts (with tails), fp32 accumulation over two steps, replay, skewed routing
 * with empty experts; the variant runs the first in a CUDA graph (3 steps), the second
 * on 17 CTAs. */
static const int variant_shapes[] = {9, 10, 12, 15, 17, 21, 25};
enum { kVariantShapes = sizeof variant_shapes / sizeof variant_shapes[0] };

/* Case i of variant_shapes: the problem kept as it is (keep) and the variant (other) run
 * (options *o and *r), keep's outputs in *a, other's compared with them bit for bit
 * (label names the variant). Returns failures. */
static int variant_vs_keep(size_t i, mok_problem_t* keep, mok_problem_t* other, const char* label, mok_run_opts_t* o,
                           mok_run_opts_t* r, test_outputs_t* a) {
  const gpu_shape_t* s = &shapes[variant_shapes[i]];
  TEST_ASSERT(keep && other, "%s: problems", s->name);
  *o = *r = (mok_run_opts_t)MOK_RUN_OPTS_INIT;
  o->steps = r->steps = s->wgrad == ACCUM ? 2 : 1;
  if (i == 1) r->num_ctas = 17;
  if (i == 0) r->graph = 1, r->steps = 3;
  if (run_cuda(keep, o) || run_cuda(other, r)) return 1;
  test_outputs_t b;
  test_snapshot(keep, 1, a);
  test_snapshot(other, 1, &b);
  char what[64];
  snprintf(what, sizeof what, "%s: %s vs keep", s->name, label);
  return test_same_bits(&b, a, NULL, what) != 0;
}

/* The saved and workspace sizes of shape wide's CUDA context as it is (*sk, *wk) and
 * with a variant's options (gate_up, saved_use: *sr, *wr). Returns failures. */
static int variant_sizes(mok_gate_up_t gate_up, mok_saved_use_t saved_use, size_t* sk, size_t* sr, size_t* wk,
                         size_t* wr) {
  const gpu_shape_t* s = &shapes[21];
  mok_config_t c = shape_config(s);
  c.T = s->T, c.backend = MOK_BACKEND_CUDA;
  mok_config_t r = c;
  r.gate_up = gate_up, r.saved_use = saved_use;
  mok_context_t *ck = test_context(&c, NULL), *cr = test_context(&r, NULL);
  TEST_ASSERT(ck && cr, "contexts");
  TEST_ASSERT(!mok_saved_size(ck, sk) && !mok_saved_size(cr, sr), "mok_saved_size");
  TEST_ASSERT(!mok_workspace_size(ck, wk) && !mok_workspace_size(cr, wr), "mok_workspace_size");
  return 0;
}

static int gate_up_recompute(void) {
  int bad = 0;
  {  // sizes: saved smaller by the four pieces; the workspace larger, by less (d_a's place)
    const gpu_shape_t* s = &shapes[21];
    size_t sk = 0, sr = 0, wk = 0, wr = 0;
    if (variant_sizes(MOK_GATE_UP_RECOMPUTE, MOK_SAVED_KEEP, &sk, &sr, &wk, &wr)) return 1;
    const int64_t R = s->T * s->K;  // (W = 1: every routed row)
    const size_t pieces = aligned256(R * 2 * s->F * 2) + aligned256(R * s->F * 2) + aligned256(s->T * 2 * s->Fs * 2) +
                          aligned256(s->T * s->Fs * 2);
    printf("    %s: saved %zu -> %zu bytes, workspace %zu -> %zu\n", s->name, sk, sr, wk, wr);
    TEST_ASSERT(sk - sr == pieces, "saved %zu less, want %zu", sk - sr, pieces);
    TEST_ASSERT(wr >= wk && wr - wk < pieces, "workspace %zu more, want less than %zu", wr - wk, pieces);
  }
  for (size_t i = 0; i < kVariantShapes; i++) {
    const gpu_shape_t* s = &shapes[variant_shapes[i]];
    mok_run_opts_t o, r;
    test_outputs_t a;
    bad += variant_vs_keep(i, shape_problem_as(s, test_case_seed() + i, MOK_GATE_UP_SAVE, MOK_SAVED_KEEP),
                           shape_problem_as(s, test_case_seed() + i, MOK_GATE_UP_RECOMPUTE, MOK_SAVED_KEEP),
                           "recompute", &o, &r, &a);
  }
  return bad;
}

/* cfg.saved_use = MOK_SAVED_REUSE: the forward's o rows go where its x rows are (gate|up
 * kept, W = 1), the backward's dy rows, then its dx rows, where saved's o rows are, then
 * the x rows back (DXSUM), d_a (d_a_s) where its gate|up are, and the router path's dx
 * where h is when it fits (e128_k8, wide, skewed_groups; not the others), so saved is
 * smaller by the o rows, the workspace smaller, and every output and gradient has the
 * bits of keeping saved: shared experts
 * (with tails), fp32 accumulation over two steps, replay, skewed routing with empty
 * experts, 17 CTAs, a CUDA graph, and with the gate|up recompute (then gate|up and h are
 * the workspace's). A second backward on the used-up saved is refused on the device
 * (MOK_STATUS_INVALID_SAVED, every output as the steps left it); a kept saved takes it
 * and writes the same bits again. */
static int saved_reuse(void) {
  int bad = 0;
  {  // sizes: saved smaller by the o rows and h (bf16 gradients: h_in_dw13); the forward's
     // workspace larger by h, the backward's smaller (dy, dx rows and dx_router elsewhere)
    const gpu_shape_t* s = &shapes[21];
    size_t sk = 0, sr = 0, wk = 0, wr = 0;
    if (variant_sizes(MOK_GATE_UP_SAVE, MOK_SAVED_REUSE, &sk, &sr, &wk, &wr)) return 1;
    const size_t o_rows = aligned256(s->T * s->K * s->H * 2), h_rows = aligned256(s->T * s->K * s->F * 2);  // (W = 1)
    printf("    %s: saved %zu -> %zu bytes, workspace %zu -> %zu\n", s->name, sk, sr, wk, wr);
    TEST_ASSERT(sk - sr == o_rows + h_rows, "saved %zu less, want %zu", sk - sr, o_rows + h_rows);
    mok_config_t c = shape_config(s);
    c.T = s->T, c.backend = MOK_BACKEND_CUDA;
    mok_config_t r = c;
    r.saved_use = MOK_SAVED_REUSE;
    mok_context_t *ck = test_context(&c, NULL), *cr = test_context(&r, NULL);
    size_t fk = 0, bk = 0, fr = 0, br = 0;
    TEST_ASSERT(ck && cr && !mok_workspace_sizes(ck, &fk, &bk) && !mok_workspace_sizes(cr, &fr, &br), "sizes");
    printf("    %s: forward workspace %zu -> %zu bytes, backward %zu -> %zu\n", s->name, fk, fr, bk, br);
    TEST_ASSERT(fr - fk == h_rows, "forward workspace %zu more, want %zu (h)", fr - fk, h_rows);
    TEST_ASSERT(br < bk, "the backward's workspace smaller");
    TEST_ASSERT(wr == (fr > br ? fr : br) && wk == (fk > bk ? fk : bk), "mok_workspace_size: the larger");
  }
  for (size_t i = 0; i < kVariantShapes; i++) {
    const gpu_shape_t* s = &shapes[variant_shapes[i]];
    const mok_gate_up_t gate_up = i == 2 ? MOK_GATE_UP_RECOMPUTE : MOK_GATE_UP_SAVE;
    mok_problem_t* keep = shape_problem_as(s, test_case_seed() + i, MOK_GATE_UP_SAVE, MOK_SAVED_KEEP);
    mok_problem_t* reuse = shape_problem_as(s, test_case_seed() + i, gate_up, MOK_SAVED_REUSE);
    mok_run_opts_t o, r;
    test_outputs_t a, b;
    bad += variant_vs_keep(i, keep, reuse, "reuse", &o, &r, &a);
    if (i != 5) continue;  // (shape wide)
    r.backward_again = o.backward_again = 1;  // (bf16 gradients: written, not added to)
    char err[512] = "";
    const mok_status_t st = mok_problem_run_cuda(reuse, &r, err, sizeof err);
    printf("    %s: a second backward on used-up saved: %s\n", s->name, err);
    TEST_ASSERT(st == MOK_STATUS_INVALID_SAVED, "want MOK_STATUS_INVALID_SAVED, got %s", mok_status_string(st));
    test_snapshot(reuse, 1, &b);
    bad += test_same_bits(&b, &a, NULL, "outputs after the refused backward") != 0;
    if (run_cuda(keep, &o)) return 1;
    test_snapshot(keep, 1, &b);
    bad += test_same_bits(&b, &a, NULL, "kept: after a second backward") != 0;
  }
  // the clamped SwiGLU's h from DH's epilogue (the *_clamped_kernel launches): F = 192
  // (the last dh tile has no fourth quarter), 600 rows (tails of 16-row boxes), with and
  // without the expert biases
  const char* clamped[] = {"clamped_tight", "ebias_gptoss"};
  for (int i = 0; i < 2; i++) {
    const gpu_shape_t* s = NULL;
    for (size_t j = 0; j < sizeof router_shapes / sizeof router_shapes[0]; j++)
      if (!strcmp(router_shapes[j].name, clamped[i])) s = &router_shapes[j];
    TEST_ASSERT(s && s->swiglu_limit > 0.f && s->routing == FUSED && s->wgrad == BF16, "%s: a clamped bf16 case",
                clamped[i]);
    mok_problem_t* keep = shape_problem_as(s, test_case_seed() + 100 + i, MOK_GATE_UP_SAVE, MOK_SAVED_KEEP);
    mok_problem_t* reuse = shape_problem_as(s, test_case_seed() + 100 + i, MOK_GATE_UP_SAVE, MOK_SAVED_REUSE);
    TEST_ASSERT(keep && reuse, "%s: problems", s->name);
    mok_run_opts_t o = MOK_RUN_OPTS_INIT, r = MOK_RUN_OPTS_INIT;
    if (run_cuda(keep, &o) || run_cuda(reuse, &r)) return 1;
    test_outputs_t a, b;
    test_snapshot(keep, 1, &a);
    test_snapshot(reuse, 1, &b);
    char what[64];
    snprintf(what, sizeof what, "%s: reuse vs keep", s->name);
    bad += test_same_bits(&b, &a, NULL, what) != 0;
  }
  return bad;
}

/* Device-side errors come back as statuses from mok_context_sync, outputs untouched. */
static int device_errors(void) {
  const gpu_shape_t* s = &shapes[16];
  mok_problem_t* p = shape_problem(s, test_case_seed());
  TEST_ASSERT(p, "problem");
  p->topk_idx[10] = (int32_t)s->E; /* out of range */
  mok_run_opts_t o = MOK_RUN_OPTS_INIT;
  memset(p->y, 0x5A, (size_t)s->T * s->H * 2);
  char err[512] = "";
  mok_status_t st = mok_problem_run_cuda(p, &o, err, sizeof err);
  TEST_ASSERT(st == MOK_STATUS_INDEX_OUT_OF_RANGE, "out-of-range replay index: got %s (%s)", mok_status_string(st), err);
  p->topk_idx[10] = p->topk_idx[11]; /* duplicate within token 5 (K = 4: slots 8..11) */
  st = mok_problem_run_cuda(p, &o, err, sizeof err);
  TEST_ASSERT(st == MOK_STATUS_DUPLICATE_INDEX, "duplicate replay index: got %s (%s)", mok_status_string(st), err);
  return 0;
}

/* ---- a saved buffer that is not what the forward wrote (issue 31) ----
 * The backward forms addresses from saved (src/cuda/sm90_moe_backward.cu, saved_ok): a
 * saved buffer whose body was overwritten, with an index word or a table word out of
 * place, or whose header names another context, forward or shape, must stop the
 * backward with MOK_STATUS_INVALID_SAVED at mok_context_sync, leave every output as it
 * was, and leave the context usable (the next forward and backward give the reference
 * bits). The library is driven directly here, on device buffers of this case's own, so
 * that saved can be changed between the forward and the backward. */

/* cuda_backend.cu's plan_saved at W = 1 with gate|up kept (every piece 256-byte aligned),
 * and gpu_params.h's header: 21 words, the shape's 8 from word 13. */
enum { kSvHeaderWords = 21, kSvHeaderShape = 13 };
typedef struct {
  size_t idx, g, pos, logits, counts, expert_off, tile_band, tiles;
} saved_layout_t;
static saved_layout_t saved_layout(const gpu_shape_t* s) {
  saved_layout_t l;
  const int64_t TK = s->T * s->K;
  l.idx = aligned256(kSvHeaderWords * 8);
  l.g = l.idx + aligned256(TK * 4);
  l.pos = l.g + aligned256(TK * 4);
  l.logits = l.pos + aligned256(TK * 4);
  l.counts = l.logits + aligned256(s->T * s->E * 4);
  l.expert_off = l.counts + aligned256(s->E * 4);
  l.tile_band = l.expert_off + aligned256((s->E + 1) * 4);
  l.tiles = (size_t)((TK + 127) / 128 + s->E); /* m-tile slots the backward reads (max_mt, unpadded) */
  return l;
}

enum { kRigOutputs = 7, kRigBuffers = 40 };
typedef struct {
  const gpu_shape_t* s;
  mok_context_t* ctx;
  mok_forward_args_t fa;
  mok_backward_args_t ba;
  void* dev[kRigBuffers];
  int n_dev;
  const char* name[kRigOutputs]; /* the backward's outputs: poisoned before each backward */
  void* out[kRigOutputs];
  size_t bytes[kRigOutputs];
  uint8_t* ref[kRigOutputs]; /* their bits after a valid step */
  uint8_t* host[kRigOutputs];
  int n_out;
  uint8_t* saved; /* a valid saved buffer, as the forward wrote it (host copy) */
  size_t saved_bytes;
  cudaStream_t stream; /* the steps' stream, and of every fill and copy between them */
} rig_t;

static void* rig_buf(rig_t* r, const void* host, size_t bytes) {
  void* d = NULL;
  if (r->n_dev == kRigBuffers || cudaMalloc(&d, bytes ? bytes : 256) != cudaSuccess) return NULL;
  r->dev[r->n_dev++] = d;
  if (host && bytes && cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) return NULL;
  return d;
}
static void* rig_out(rig_t* r, const char* name, size_t bytes) {
  void* d = rig_buf(r, NULL, bytes);
  if (!d) return NULL;
  r->name[r->n_out] = name, r->out[r->n_out] = d, r->bytes[r->n_out] = bytes;
  r->ref[r->n_out] = test_alloc(bytes), r->host[r->n_out] = test_alloc(bytes);
  r->n_out++;
  return d;
}
static void rig_free(rig_t* r) {
  for (int i = 0; i < r->n_dev; i++) cudaFree(r->dev[i]);
  if (r->stream) cudaStreamDestroy(r->stream);
  if (r->ctx) test_context_destroy(r->ctx);
}

/* stream_flags: the steps' stream is a new one with these flags, or -1: the legacy
 * default stream. */
static int rig_make(rig_t* r, const gpu_shape_t* s, uint64_t seed, int stream_flags) {
  memset(r, 0, sizeof *r);
  r->s = s;
  if (stream_flags >= 0)
    TEST_ASSERT(cudaStreamCreateWithFlags(&r->stream, (unsigned)stream_flags) == cudaSuccess, "stream");
  mok_config_t c = shape_config(s);
  c.T = s->T, c.backend = MOK_BACKEND_CUDA;
  mok_problem_t* p = shape_problem(s, seed);
  TEST_ASSERT(p, "problem");
  r->ctx = test_context(&c, NULL);
  TEST_ASSERT(r->ctx, "context");
  const int64_t T = s->T, H = s->H, F = s->F, E = s->E, K = s->K, Fs = s->Fs;
  const int replay = s->routing == MOK_ROUTING_REPLAY;
  const size_t w = p->wgrad_elem;
  size_t ws = 0;
  TEST_ASSERT(!mok_saved_size(r->ctx, &r->saved_bytes) && !mok_workspace_size(r->ctx, &ws), "sizes");
  mok_forward_args_t* fa = &r->fa;
  mok_backward_args_t* ba = &r->ba;
  fa->num_tokens = ba->num_tokens = T;
  fa->x = ba->x = rig_buf(r, p->x, T * H * 2);
  fa->w_router = ba->w_router = rig_buf(r, p->w_router, E * H * 2);
  fa->bias_select = s->bias ? rig_buf(r, p->bias_select, E * 4) : NULL;
  fa->w13 = ba->w13 = rig_buf(r, p->w13, E * 2 * F * H * 2);
  fa->w2 = ba->w2 = rig_buf(r, p->w2, E * H * F * 2);
  fa->ws13 = ba->ws13 = Fs ? rig_buf(r, p->ws13, 2 * Fs * H * 2) : NULL;
  fa->ws2 = ba->ws2 = Fs ? rig_buf(r, p->ws2, H * Fs * 2) : NULL;
  fa->topk_idx = rig_buf(r, replay ? p->topk_idx : NULL, T * K * 4);
  fa->topk_weight = rig_buf(r, replay ? p->topk_weight : NULL, T * K * 4);
  fa->y = rig_buf(r, NULL, T * H * 2);
  fa->tokens_per_expert = rig_buf(r, NULL, E * 4);
  fa->aux_loss = rig_buf(r, NULL, 4);
  fa->z_loss = rig_buf(r, NULL, 4);
  ba->saved = fa->saved = rig_buf(r, NULL, r->saved_bytes);
  fa->saved_bytes = ba->saved_bytes = r->saved_bytes;
  fa->workspace = ba->workspace = rig_buf(r, NULL, ws);
  fa->workspace_bytes = ba->workspace_bytes = ws;
  ba->dy = rig_buf(r, p->dy, T * H * 2);
  ba->d_aux_loss = rig_buf(r, p->d_aux_loss, 4);
  ba->d_z_loss = rig_buf(r, p->d_z_loss, 4);
  ba->dx = rig_out(r, "dx", T * H * 2);
  ba->d_topk_weight = replay ? rig_out(r, "d_topk_weight", T * K * 4) : NULL;
  ba->d_w_router = replay ? NULL : rig_out(r, "d_w_router", E * H * w);
  ba->d_w13 = rig_out(r, "d_w13", E * 2 * F * H * w);
  ba->d_w2 = rig_out(r, "d_w2", E * H * F * w);
  ba->d_ws13 = Fs ? rig_out(r, "d_ws13", 2 * Fs * H * w) : NULL;
  ba->d_ws2 = Fs ? rig_out(r, "d_ws2", H * Fs * w) : NULL;
  TEST_ASSERT(r->n_dev < kRigBuffers && ba->d_w2 && fa->workspace && ba->dy, "device buffers (%s)",
              cudaGetErrorString(cudaGetLastError()));
  r->saved = test_alloc(r->saved_bytes);
  fa->stream = ba->stream = r->stream;
  TEST_ASSERT(cudaDeviceSynchronize() == cudaSuccess, "uploads"); /* (on the legacy stream: before any step) */
  return 0;
}

enum { kPoison = 0x5A };
/* The backward's outputs poisoned, then forward (fwd) and backward, then the status of
 * mok_context_sync; the outputs back in r->host. */
static mok_status_t rig_step(rig_t* r, int fwd) {
  for (int i = 0; i < r->n_out; i++)
    if (cudaMemsetAsync(r->out[i], kPoison, r->bytes[i], r->stream) != cudaSuccess) return MOK_STATUS_CUDA_ERROR;
  mok_status_t st = fwd ? mok_forward(r->ctx, &r->fa) : MOK_STATUS_SUCCESS;
  if (!st) st = mok_backward(r->ctx, &r->ba);
  const mok_status_t sync = mok_context_sync(r->ctx);
  if (!st) st = sync;
  for (int i = 0; i < r->n_out; i++) /* (to pageable memory: done when it returns) */
    if (cudaMemcpyAsync(r->host[i], r->out[i], r->bytes[i], cudaMemcpyDeviceToHost, r->stream) != cudaSuccess)
      return MOK_STATUS_CUDA_ERROR;
  return st;
}
/* Outputs in r->host equal to the reference (ref) or still all poison; returns how many
 * are not, each printed unless what is NULL. */
static int rig_outputs_are(const rig_t* r, int ref, const char* what) {
  int bad = 0;
  for (int i = 0; i < r->n_out; i++) {
    size_t k = 0;
    for (; k < r->bytes[i]; k++)
      if (ref ? r->host[i][k] != r->ref[i][k] : r->host[i][k] != kPoison) break;
    if (k < r->bytes[i]) {
      if (what) printf("    %s: %s: %s differs at byte %zu of %zu\n", r->s->name, what, r->name[i], k, r->bytes[i]);
      bad++;
    }
  }
  return bad;
}

/* One altered saved buffer: the valid one with `n` 32-bit words (at byte offsets at[],
 * values v[]) or, with n < 0, every byte from 512 on set to 0xFF; the backward's status
 * then (want), the outputs untouched when it fails, and a valid step after it. */
static int rig_case(rig_t* r, const char* what, int n, const size_t* at, const uint32_t* v, mok_status_t want) {
  uint8_t* b = malloc(r->saved_bytes);
  TEST_ASSERT(b, "malloc");
  memcpy(b, r->saved, r->saved_bytes);
  if (n < 0) memset(b + 512, 0xFF, r->saved_bytes - 512);
  for (int k = 0; k < n; k++) memcpy(b + at[k], &v[k], 4);
  cudaError_t ce = cudaMemcpyAsync(r->fa.saved, b, r->saved_bytes, cudaMemcpyHostToDevice, r->stream);
  if (ce == cudaSuccess) ce = cudaStreamSynchronize(r->stream); /* (b is freed next) */
  free(b);
  TEST_ASSERT(ce == cudaSuccess, "upload saved");
  int bad = 0;
  const mok_status_t st = rig_step(r, 0);
  if (st != want) {
    printf("    %s: %s: backward gave %s, want %s (%s)\n", r->s->name, what, mok_status_string(st),
           mok_status_string(want), mok_context_last_error(r->ctx));
    bad++;
  }
  bad += rig_outputs_are(r, want == MOK_STATUS_SUCCESS, want == MOK_STATUS_SUCCESS ? what : "outputs after it");
  const mok_status_t again = rig_step(r, 1);
  if (again != MOK_STATUS_SUCCESS) {
    printf("    %s: %s: the next step gave %s\n", r->s->name, what, mok_status_string(again));
    bad++;
  }
  bad += rig_outputs_are(r, 1, "the next step");
  return bad;
}

/* A word of v's index array of `count` entries from byte `base` (at[k], v[k]): a random
 * entry, set to a random value that is no row or expert (below 0 or at least `limit`), or,
 * limit 0, to any value but the one there. */
static void rig_word(const rig_t* r, uint64_t* rng, size_t base, size_t count, uint32_t limit, size_t* at,
                     uint32_t* v) {
  const size_t k = (size_t)(test_next(rng) % count);
  uint32_t x = (uint32_t)test_next(rng), old;
  memcpy(&old, r->saved + base + 4 * k, 4);
  if (limit && x < limit) x |= 0x80000000u;
  if (!limit && x == old) x ^= 1u;
  *at = base + 4 * k, *v = x;
}

static int saved_corrupt_on(rig_t* r, const gpu_shape_t* s) {
  if (rig_make(r, s, test_case_seed(), -1)) return 1;
  const int64_t TK = s->T * s->K;
  const int replay = s->routing == MOK_ROUTING_REPLAY;
  TEST_ASSERT(rig_step(r, 1) == MOK_STATUS_SUCCESS, "%s: a valid step: %s", s->name, mok_context_last_error(r->ctx));
  for (int i = 0; i < r->n_out; i++) memcpy(r->ref[i], r->host[i], r->bytes[i]);
  TEST_ASSERT(rig_outputs_are(r, 0, NULL) == r->n_out, "%s: a valid step left an output as poisoned", s->name);
  TEST_ASSERT(cudaMemcpy(r->saved, r->fa.saved, r->saved_bytes, cudaMemcpyDeviceToHost) == cudaSuccess, "saved");
  /* the layout this case assumes, as the forward wrote it */
  const saved_layout_t l = saved_layout(s);
  const uint64_t* h = (const uint64_t*)r->saved;
  const int32_t* counts = (const int32_t*)(r->saved + l.counts);
  const int32_t* off = (const int32_t*)(r->saved + l.expert_off);
  const uint64_t shape[8] = {(uint64_t)s->T, (uint64_t)s->H, (uint64_t)s->F, (uint64_t)s->E,
                             (uint64_t)s->K, (uint64_t)s->Fs, 1, 0};
  int64_t rows = 0;
  for (int64_t e = 0; e < s->E; e++) {
    TEST_ASSERT(off[e] == rows, "%s: expert_off[%lld]", s->name, (long long)e);
    rows += counts[e];
  }
  TEST_ASSERT(h[0] == 0x6d6f6b2d67707573ull && h[2] == (uint64_t)s->T && h[4] == (uint64_t)s->T &&
                  h[5] == (uint64_t)s->T && rows == TK && off[s->E] == TK,
              "%s: saved's layout is not the one this case assumes (plan_saved)", s->name);
  for (int k = 0; k < 8; k++) TEST_ASSERT(h[kSvHeaderShape + k] == shape[k], "header shape word %d", k);
  int bad = 0;
  /* (a) the body overwritten, the header intact */
  bad += rig_case(r, "bytes from 512 on 0xFF", -1, NULL, NULL, MOK_STATUS_INVALID_SAVED);
  /* (b) a word of an index array or table out of place, two of each */
  uint64_t rng = test_case_seed() ^ 0x5eedull;
  const struct {
    const char* what;
    size_t base, count;
    uint32_t limit;
  } areas[] = {{"idx", l.idx, (size_t)TK, (uint32_t)s->E},
               {"pos", l.pos, (size_t)TK, (uint32_t)TK},
               {"counts", l.counts, (size_t)s->E, 0},
               {"expert_off", l.expert_off, (size_t)s->E + 1, 0},
               {"tile_band", l.tile_band, l.tiles, 0}};
  for (size_t a = 0; a < sizeof areas / sizeof areas[0]; a++)
    for (int rep = 0; rep < 2; rep++) {
      size_t at;
      uint32_t v;
      rig_word(r, &rng, areas[a].base, areas[a].count, areas[a].limit, &at, &v);
      char what[96];
      snprintf(what, sizeof what, "%s[%zu] = 0x%08x", areas[a].what, (at - areas[a].base) / 4, v);
      /* a replay backward at W = 1 reads no expert index (the rows come from pos): it
       * still gives the reference bits */
      const int unread = replay && a == 0;
      bad += rig_case(r, what, 1, &at, &v, unread ? MOK_STATUS_SUCCESS : MOK_STATUS_INVALID_SAVED);
    }
  /* (c) the header: another context's serial, a forward serial of none of this context's
   * forwards (0, or past their count), another shape, the T words */
  const struct {
    const char* what;
    int word;
    uint64_t value;
  } words[] = {{"context serial", 1, h[1] ^ 1},
               {"forward serial 0", 3, 0},
               {"forward serial past the count", 3, h[3] + 1000},
               {"shape word cfg.T", kSvHeaderShape, h[kSvHeaderShape] + 1},
               {"shape word H", kSvHeaderShape + 1, h[kSvHeaderShape + 1] + 64},
               {"shape word rank", kSvHeaderShape + 7, 1},
               {"tokens of every rank", 4, h[4] + 1},
               {"this rank's T word", 5, h[5] - 1}};
  for (size_t k = 0; k < sizeof words / sizeof words[0]; k++) {
    size_t at[2] = {8 * (size_t)words[k].word, 8 * (size_t)words[k].word + 4};
    uint32_t v[2] = {(uint32_t)words[k].value, (uint32_t)(words[k].value >> 32)};
    bad += rig_case(r, words[k].what, 2, at, v, MOK_STATUS_INVALID_SAVED);
  }
  printf("    %-14s %d altered saved buffers: %s\n", s->name, 1 + 10 + (int)(sizeof words / sizeof words[0]),
         bad ? "FAILED" : "each refused (replay: idx unread), outputs untouched, the next step the same bits");
  return bad;
}

/* Fused routing with a shared expert, and replay (d_topk_weight). */
static int saved_corrupt(void) {
  int bad = 0;
  const int which[] = {9, 16};
  for (int i = 0; i < 2; i++) {
    rig_t r;
    bad += saved_corrupt_on(&r, &shapes[which[i]]);
    rig_free(&r);
  }
  return bad;
}

/* Issue 32: a step's status is read and cleared on the step's own stream. On a stream
 * that does not wait for the legacy default stream (cudaStreamNonBlocking, as PyTorch's
 * side streams), 12 rounds of a backward refused on device (saved's body 0xFF: its
 * INVALID_SAVED raised by the kernel) and then a valid step, the next launch each time
 * right after mok_context_sync: every refused one reports INVALID_SAVED with its
 * outputs untouched, every valid one SUCCESS and the reference bits (a status cleared
 * after the next launch, or read before its kernel ends, would show here). */
static int stream_nonblocking(void) {
  const gpu_shape_t* s = &shapes[9];
  rig_t r;
  int bad = rig_make(&r, s, test_case_seed(), cudaStreamNonBlocking);
  if (!bad) {
    bad = rig_step(&r, 1) != MOK_STATUS_SUCCESS;
    for (int i = 0; i < r.n_out && !bad; i++) memcpy(r.ref[i], r.host[i], r.bytes[i]);
    bad += cudaMemcpy(r.saved, r.fa.saved, r.saved_bytes, cudaMemcpyDeviceToHost) != cudaSuccess;
    for (int round = 0; round < 12 && !bad; round++)
      bad += rig_case(&r, "bytes from 512 on 0xFF", -1, NULL, NULL, MOK_STATUS_INVALID_SAVED);
    if (!bad) printf("    %s: 12 refused backwards and 12 valid steps on a non-blocking stream, each as expected\n", s->name);
  }
  rig_free(&r);
  return bad;
}

/* Small case for compute-sanitizer (memcheck and racecheck run it alone). */
static int sanitizer_small(void) {
  const gpu_shape_t* s = &shapes[10];
  mok_problem_t* p = shape_problem(s, test_case_seed());
  TEST_ASSERT(p, "problem");
  mok_run_opts_t o = MOK_RUN_OPTS_INIT;
  o.num_ctas = 8;
  o.cta_pairs = MOK_CTA_PAIRS_ON;  // (the pairs' multicast and remote arrivals under the tools too)
  return run_cuda(p, &o) != 0;
}

/* compute-sanitizer over this program's sanitizer_small case: no error reported. The
   run is bounded too (it takes seconds): a hang fails the case instead of the suite. */
enum { kSanitizeLimitS = 120 };
static int sanitize(const char* tool) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd,
           "timeout -k 10 %d compute-sanitizer --tool %s --error-exitcode 3 /proc/%d/exe -k gpu.sanitizer_small "
           "--seed %llu > sanitizer_%s.log 2>&1",
           kSanitizeLimitS, tool, (int)getpid(), (unsigned long long)test_seed, tool);
  const int status = system(cmd);
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  TEST_ASSERT(rc != 124 && rc != 137, "compute-sanitizer --tool %s did not end within %d s (see sanitizer_%s.log)",
              tool, kSanitizeLimitS, tool);
  char path[64], line[512], summary[512] = "", last[512] = "";
  snprintf(path, sizeof path, "sanitizer_%s.log", tool);
  FILE* f = fopen(path, "r");
  TEST_ASSERT(f, "no %s", path);
  while (fgets(line, sizeof line, f)) {
    if (strstr(line, "ERROR SUMMARY") || strstr(line, "RACECHECK SUMMARY")) snprintf(summary, sizeof summary, "%s", line);
    if (strstr(line, "passed,")) snprintf(last, sizeof last, "%s", line);
  }
  fclose(f);
  printf("    %s: %s    %s", tool, summary, last);
  TEST_ASSERT(rc == 0 && (strstr(summary, ": 0 errors") || strstr(summary, "(0 errors")) &&
                  strstr(last, "1 passed, 0 failed"),
              "compute-sanitizer --tool %s: exit %d (see %s)", tool, rc, path);
  return 0;
}
static int memcheck(void) { return sanitize("memcheck"); }
static int racecheck(void) { return sanitize("racecheck"); }

const test_case_t suite_gpu[] = {
    {"vs_cpu_paired", gpu_vs_cpu_paired},
    {"vs_cpu_unpaired", gpu_vs_cpu_unpaired},
    {"d1_repeat", d1_repeat},
    {"d2_grid", d2_grid},
    {"d4_batch", d4_batch},
    {"router_vs_cpu", router_vs_cpu},
    {"router_determinism", router_determinism},
    {"variants_gate_up", variants_gate_up},
    {"graph_capture", graph_capture},
    {"step_thread", step_thread},
    {"gate_up_recompute", gate_up_recompute},
    {"saved_reuse", saved_reuse},
    {"device_errors", device_errors},
    {"saved_corrupt", saved_corrupt},
    {"stream_nonblocking", stream_nonblocking},
    {"sanitizer_small", sanitizer_small},
    {"memcheck", memcheck},
    {"racecheck", racecheck},
    TEST_END};
