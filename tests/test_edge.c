/* test_edge.c — the edge cases of DESIGN.md section 6. Each layer case runs the same
 * problem three ways: EXACT numerics against reference.c (the forward), BF16 against
 * EXACT (relative error <= 2e-2, the same routing up to near-ties; see test_numerics.c),
 * and BF16 on W > 1 against W = 1 by bytes. Cases: an expert (and a whole rank) with no
 * tokens, every token on one expert, a huge selection bias, exact ties in the router
 * (and between groups and inside groups of group-limited routing),
 * T not a multiple of any tile, K = 1 and K = E, W not dividing T, NaN and Inf in x,
 * capacity exceeded, a peer that never arrives, fp32 gradient accumulation over steps. */
#include <math.h>
#include <string.h>
#include <time.h>

#include "runner.h"

static mok_config_t layer(void) {
  mok_config_t c = MOK_CONFIG_INIT;
  c.H = 64, c.F = 32, c.E = 8, c.K = 2, c.Fs = 16;
  c.aux_loss_coef = 0.01f;
  c.z_loss_coef = 0.001f;
  c.use_bias_select = 1;
  c.num_threads = 1;
  return c;
}

static mok_run_opts_t opts(int W) {
  mok_run_opts_t o = MOK_RUN_OPTS_INIT;
  o.W = W;
  o.num_threads = 1;
  return o;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Sets a real (fp32, or double in EXACT numerics) element of a problem tensor. */
static void set_real(mok_problem_t* p, void* t, int64_t i, double v) {
  if (p->real == 4)
    ((float*)t)[i] = (float)v;
  else
    ((double*)t)[i] = v;
}

/* Replay routing: every token takes K distinct experts, at random, from `allowed`. */
static void route_from(mok_problem_t* p, const int32_t* allowed, int num_allowed, uint64_t seed) {
  int32_t pool[64];
  for (int64_t t = 0; t < p->T_global; t++) {
    memcpy(pool, allowed, (size_t)num_allowed * 4);
    for (int64_t j = 0; j < p->cfg.K; j++) {
      int64_t pick = j + (int64_t)(test_next(&seed) % (uint64_t)(num_allowed - j));
      int32_t e = pool[pick];
      pool[pick] = pool[j];
      pool[j] = e;
      p->topk_idx[t * p->cfg.K + j] = e;
    }
  }
}

typedef void (*prepare_fn)(mok_problem_t* p); /* changes a fresh problem's inputs */

/* The three checks of the file header; `bitwise` names the outputs that must match
 * W = 1 by bytes on each W of Ws (0-terminated). On success *out is the BF16 problem
 * after its last run. */
static int check_layer(const mok_config_t* cfg, int64_t T, prepare_fn prepare, const int* Ws,
                       const char* bitwise, mok_problem_t** out) {
  mok_config_t ce = *cfg;
  ce.numerics = MOK_NUMERICS_EXACT;
  mok_problem_t* pb = test_problem(cfg, T, test_case_seed());
  mok_problem_t* pe = test_problem(&ce, T, test_case_seed());
  TEST_ASSERT(pb && pe, "problems");
  if (prepare) prepare(pb), prepare(pe);
  mok_run_opts_t o = opts(1);
  TEST_ASSERT(!test_run(pe, &o), "EXACT run");
  int bad = test_check_reference(pe);
  TEST_ASSERT(!test_run(pb, &o), "BF16 run");
  test_outputs_t b, e, w;
  test_snapshot(pb, 1, &b);
  test_snapshot(pe, 1, &e);
  if (test_same_bits(&b, &e, "tokens_per_expert", "bf16 vs exact") ||
      (!test_same_routing_up_to_ties(pb, pe) &&
       test_same_bits(&b, &e, "topk_idx", "bf16 vs exact")))
    return 1;
  /* d_w_router of a handful of tokens is ill-conditioned in bf16: a token's dlogits
   * hold differences like dg_1 - dg_2 (dg = dy . o, o rounded to bf16) that can cancel
   * to a few percent of dg; over 32+ tokens the norm averages them out. */
  bad += test_close(&b, &e,
                    T >= 32 ? "y topk_weight dx d_topk_weight d_w_router d_w13 d_w2 d_ws13 d_ws2"
                            : "y topk_weight dx d_topk_weight d_w13 d_w2 d_ws13 d_ws2",
                    2e-2, "bf16 vs exact");
  for (; *Ws; Ws++) {
    o = opts(*Ws);
    TEST_ASSERT(!test_run(pb, &o), "BF16 run on W = %d", *Ws);
    test_snapshot(pb, 1, &w);
    char what[32];
    snprintf(what, sizeof what, "W = %d vs W = 1", *Ws);
    bad += test_same_bits(&w, &b, bitwise, what);
  }
  *out = pb;
  return bad;
}

/* Every element of experts [e] of a gradient ([E, n] in the problem's wgrad type) is 0. */
static int expert_grad_zero(const mok_problem_t* p, const void* g, int64_t n, int64_t e) {
  mok_tensor_view_t v = {"", g, p->cfg.E * n, p->wgrad_elem, p->wgrad_elem == 2 ? 0 : 1};
  for (int64_t i = e * n; i < (e + 1) * n; i++)
    if (mok_view_get(&v, i) != 0) return 0;
  return 1;
}

static const int W124[] = {2, 4, 0}, W2[] = {2, 0};
enum { T_FULL = 256 }; /* 64 tokens per rank on W = 4: every output is W-invariant */

/* Experts 3, 6 and 7 get no token: on W = 4 the rank owning 6 and 7 receives nothing. */
static void avoid_3_6_7(mok_problem_t* p) {
  const int32_t allowed[] = {0, 1, 2, 4, 5};
  route_from(p, allowed, 5, test_case_seed());
}

static int expert_without_tokens(void) {
  mok_config_t c = layer();
  c.routing = MOK_ROUTING_REPLAY;
  mok_problem_t* p;
  int bad = check_layer(&c, T_FULL, avoid_3_6_7, W124, NULL, &p);
  if (bad) return bad;
  const int64_t n13 = 2 * c.F * c.H, n2 = c.H * c.F;
  const int empty[] = {3, 6, 7};
  for (int i = 0; i < 3; i++) {
    int e = empty[i];
    TEST_ASSERT(p->tokens_per_expert[e] == 0, "tokens_per_expert[%d] = %d", e,
                p->tokens_per_expert[e]);
    TEST_ASSERT(expert_grad_zero(p, p->d_w13, n13, e) && expert_grad_zero(p, p->d_w2, n2, e),
                "expert %d has no token but a nonzero gradient", e);
  }
  return 0;
}

static void all_on_expert_0(mok_problem_t* p) {
  for (int64_t t = 0; t < p->T_global; t++) p->topk_idx[t] = 0;
}

static int all_tokens_one_expert(void) {
  mok_config_t c = layer();
  c.routing = MOK_ROUTING_REPLAY;
  c.K = 1;
  mok_problem_t* p;
  int bad = check_layer(&c, T_FULL, all_on_expert_0, W124, NULL, &p);
  if (bad) return bad;
  TEST_ASSERT(p->tokens_per_expert[0] == T_FULL, "tokens_per_expert[0] = %d",
              p->tokens_per_expert[0]);
  for (int e = 1; e < c.E; e++)
    TEST_ASSERT(expert_grad_zero(p, p->d_w13, 2 * c.F * c.H, e) &&
                    expert_grad_zero(p, p->d_w2, c.H * c.F, e),
                "expert %d has no token but a nonzero gradient", e);
  return 0;
}

/* bias_select[5] = 100 puts expert 5 in every token's first slot; its weight is still
 * the score (the reference checks the weights: bias is for selection only). */
static void bias_on_expert_5(mok_problem_t* p) { set_real(p, p->bias_select, 5, 100.0); }

static int bias_selects_one_expert(void) {
  mok_config_t c = layer();
  c.normalize = 0;
  mok_problem_t* p;
  int bad = check_layer(&c, T_FULL, bias_on_expert_5, W2, NULL, &p);
  if (bad) return bad;
  for (int64_t t = 0; t < T_FULL; t++)
    TEST_ASSERT(p->out_topk_idx[t * c.K] == 5, "token %lld: slot 0 is expert %d", (long long)t,
                p->out_topk_idx[t * c.K]);
  TEST_ASSERT(p->tokens_per_expert[5] == T_FULL, "tokens_per_expert[5] = %d",
              p->tokens_per_expert[5]);
  return 0;
}

/* A zero router: every score is equal, so selection is decided by the bias and then by
 * the lower index: slots [6, 7, 0] (bias 0.25 on 6 and 7), each weight 1/3 * scale. */
static void zero_router_bias_6_7(mok_problem_t* p) {
  memset(p->w_router, 0, (size_t)(p->cfg.E * p->cfg.H) * p->act);
  for (int e = 0; e < p->cfg.E; e++) set_real(p, p->bias_select, e, e >= 6 ? 0.25 : 0.0);
}

static int router_ties(void) {
  mok_config_t c = layer();
  c.K = 3;
  c.route_scale = 1.5f;
  mok_problem_t* p;
  int bad = check_layer(&c, T_FULL, zero_router_bias_6_7, W124, NULL, &p);
  if (bad) return bad;
  const int32_t want[3] = {6, 7, 0};
  for (int64_t t = 0; t < T_FULL; t++)
    for (int j = 0; j < 3; j++) {
      float g = ((float*)p->out_topk_weight)[t * 3 + j];
      TEST_ASSERT(p->out_topk_idx[t * 3 + j] == want[j], "token %lld slot %d: expert %d, want %d",
                  (long long)t, j, p->out_topk_idx[t * 3 + j], want[j]);
      TEST_ASSERT(fabsf(g - 0.5f) <= 1e-6f, "token %lld slot %d: weight %.9g, want 0.5",
                  (long long)t, j, g);
    }
  return 0;
}

/* Group-limited routing's ties (cfg.n_group = 4 groups of 4 experts), with a zero router:
 * every score is 1/16 (softmax) or 1/2 (sigmoid), and the bias decides, in values that
 * every key and group score holds exactly (in fp32 too). Biases by group:
 *   group 0 (experts 0-3):   0    0    0    0     top-2 sum 2s,        largest s
 *   group 1 (experts 4-7):   0    1/4  0    1/4   top-2 sum 2s + 1/2,  largest s + 1/4
 *   group 2 (experts 8-11):  1/2  0    0    0     top-2 sum 2s + 1/2,  largest s + 1/2
 *   group 3 (experts 12-15): 1/8  1/8  1/8  1/8   top-2 sum 2s + 1/4,  largest s + 1/8
 * Groups 1 and 2 tie on the top-2 sum (group 1 is ahead: the lower index), and equal
 * keys inside a group go to the lower expert index. */
static void zero_router_group_bias(mok_problem_t* p) {
  static const double bias[16] = {0, 0, 0, 0, 0, 0.25, 0, 0.25, 0.5, 0, 0, 0, 0.125, 0.125, 0.125, 0.125};
  memset(p->w_router, 0, (size_t)(p->cfg.E * p->cfg.H) * p->act);
  for (int e = 0; e < 16; e++) set_real(p, p->bias_select, e, bias[e]);
}

static void zero_router_no_bias(mok_problem_t* p) {
  memset(p->w_router, 0, (size_t)(p->cfg.E * p->cfg.H) * p->act);
  for (int e = 0; e < p->cfg.E; e++) set_real(p, p->bias_select, e, 0.0);
}

static int group_ties(void) {
  static const struct {
    mok_group_score_t group_score;
    int topk_group, K, biased;
    int32_t want[6];
  } cases[] = {
      {MOK_GROUP_SCORE_TOP2, 1, 2, 1, {5, 7}},                /* groups 1 = 2: group 1; without groups 8, 5 */
      {MOK_GROUP_SCORE_TOP2, 2, 4, 1, {8, 5, 7, 4}},          /* then 4, 6, 9, 10, 11 tie: 4 */
      {MOK_GROUP_SCORE_TOP2, 3, 6, 1, {8, 5, 7, 12, 13, 14}}, /* group 0 dropped */
      {MOK_GROUP_SCORE_MAX, 1, 3, 1, {8, 9, 10}},             /* group 2 alone */
      {MOK_GROUP_SCORE_MAX, 2, 3, 1, {8, 5, 7}},
      {MOK_GROUP_SCORE_TOP2, 2, 5, 0, {0, 1, 2, 3, 4}},       /* every group ties: groups 0 and 1 */
  };
  for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++)
    for (int sig = 0; sig < 2; sig++) {
      mok_config_t c = layer();
      c.E = 16, c.n_group = 4;
      c.group_score = cases[i].group_score, c.topk_group = cases[i].topk_group, c.K = cases[i].K;
      c.score = sig ? MOK_SCORE_SIGMOID : MOK_SCORE_SOFTMAX;
      mok_problem_t* p;
      int bad = check_layer(&c, T_FULL, cases[i].biased ? zero_router_group_bias : zero_router_no_bias, W124, NULL,
                            &p);
      if (bad) {
        printf("    (case %d, %s)\n", i, sig ? "sigmoid" : "softmax");
        return bad;
      }
      for (int64_t t = 0; t < T_FULL; t++)
        for (int j = 0; j < c.K; j++) {
          const int32_t e = p->out_topk_idx[t * c.K + j];
          const float g = ((float*)p->out_topk_weight)[t * c.K + j];
          TEST_ASSERT(e == cases[i].want[j], "case %d (%s), token %lld slot %d: expert %d, want %d", i,
                      sig ? "sigmoid" : "softmax", (long long)t, j, e, cases[i].want[j]);
          TEST_ASSERT(fabsf(g - 1.0f / (float)c.K) <= 1e-6f, "case %d, token %lld slot %d: weight %.9g, want 1/%d", i,
                      (long long)t, j, g, (int)c.K);
        }
    }
  return 0;
}

/* T = 1, 37, 65: no tile fits; on W = 2 a rank may have 0 tokens. Only per-token and
 * per-expert results are compared across W: a rank's T that is not a multiple of 64
 * moves chunk edges of the replicated reductions (losses, router and shared grads). */
static const char* kPerToken =
    "y dx topk_idx topk_weight tokens_per_expert d_w13 d_w2 d_topk_weight";

static int ragged_tokens(void) {
  const int64_t Ts[] = {1, 37, 65};
  int bad = 0;
  for (int i = 0; i < 3 && !bad; i++) {
    mok_config_t c = layer();
    mok_problem_t* p;
    bad += check_layer(&c, Ts[i], NULL, W2, kPerToken, &p);
    if (bad) printf("    (T = %lld)\n", (long long)Ts[i]);
  }
  return bad;
}

static int k_one(void) {
  mok_config_t c = layer();
  c.K = 1;
  c.normalize = 0;
  mok_problem_t* p;
  return check_layer(&c, T_FULL, NULL, W124, NULL, &p);
}

static int k_all(void) {
  mok_config_t c = layer();
  c.K = c.E;
  mok_problem_t* p;
  int bad = check_layer(&c, T_FULL, NULL, W124, NULL, &p);
  if (bad) return bad;
  for (int e = 0; e < c.E; e++)
    TEST_ASSERT(p->tokens_per_expert[e] == T_FULL, "K = E: tokens_per_expert[%d] = %d", e,
                p->tokens_per_expert[e]);
  return 0;
}

/* 37 tokens on W = 2 (19 + 18) and W = 4 (10 + 9 + 9 + 9). */
static int w_not_dividing_t(void) {
  mok_config_t c = layer();
  mok_problem_t* p;
  int bad = check_layer(&c, 37, NULL, W124, kPerToken, &p);
  c.routing = MOK_ROUTING_REPLAY;
  return bad + check_layer(&c, 37, NULL, W124, kPerToken, &p);
}

/* NaN in token 3 and +Inf in token 7: their y is not finite, and every other token's y
 * and dx are the bits of the clean run (losses off: they would mix the tokens). */
static int nonfinite_x(mok_routing_t routing, int W) {
  mok_config_t c = layer();
  c.routing = routing;
  c.aux_loss_coef = c.z_loss_coef = 0;
  const int64_t T = 32, H = c.H, K = c.K;
  mok_problem_t* p = test_problem(&c, T, test_case_seed());
  TEST_ASSERT(p, "problem");
  mok_run_opts_t o = opts(W);
  TEST_ASSERT(!test_run(p, &o), "clean run");
  test_outputs_t clean;
  test_snapshot(p, 1, &clean);
  ((uint16_t*)p->x)[3 * H + 5] = 0x7fc0; /* NaN */
  ((uint16_t*)p->x)[7 * H] = 0x7f80;     /* +Inf */
  memset(p->y, 0xA5, (size_t)(T * H) * 2);
  memset(p->dx, 0xA5, (size_t)(T * H) * 2);
  TEST_ASSERT(!test_run(p, &o), "run with NaN and Inf in x");
  const uint16_t *y = p->y, *dx = p->dx;
  const uint16_t *y0 = test_view(&clean, "y")->data, *dx0 = test_view(&clean, "dx")->data;
  for (int64_t t = 0; t < T; t++) {
    int nan = 0, nonfinite = 0;
    for (int64_t h = 0; h < H; h++) {
      uint16_t v = y[t * H + h];
      nan |= (v & 0x7fff) > 0x7f80;
      nonfinite |= (v & 0x7f80) == 0x7f80;
    }
    if (t == 3) TEST_ASSERT(nan, "y[3] (NaN in x[3]) has no NaN");
    if (t == 7) TEST_ASSERT(nonfinite, "y[7] (Inf in x[7]) is finite");
    if (t == 3 || t == 7) continue;
    for (int64_t h = 0; h < H; h++) {
      TEST_ASSERT(y[t * H + h] == y0[t * H + h], "y[%lld, %lld] = 0x%04x, clean run 0x%04x",
                  (long long)t, (long long)h, y[t * H + h], y0[t * H + h]);
      TEST_ASSERT(dx[t * H + h] == dx0[t * H + h], "dx[%lld, %lld] = 0x%04x, clean run 0x%04x",
                  (long long)t, (long long)h, dx[t * H + h], dx0[t * H + h]);
    }
  }
  int64_t total = 0;
  for (int64_t e = 0; e < c.E; e++) total += p->tokens_per_expert[e];
  TEST_ASSERT(total == T * K, "tokens_per_expert sums to %lld, not T * K", (long long)total);
  const int32_t* idx = routing == MOK_ROUTING_FUSED ? p->out_topk_idx : p->topk_idx;
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < K; j++) {
      int32_t e = idx[t * K + j];
      TEST_ASSERT(e >= 0 && e < c.E, "token %lld slot %lld: expert %d", (long long)t, (long long)j,
                  e);
      for (int64_t i = 0; i < j; i++)
        TEST_ASSERT(idx[t * K + i] != e, "token %lld: expert %d twice", (long long)t, e);
    }
  return 0;
}

static int nonfinite_x_fused(void) { return nonfinite_x(MOK_ROUTING_FUSED, 1); }
static int nonfinite_x_replay(void) { return nonfinite_x(MOK_ROUTING_REPLAY, 2); }

/* W = 2, every slot on rank 1's experts (4..7): rank 1 would receive 128 rows, capacity
 * 100. Every rank must stop with CAPACITY_EXCEEDED at once and write nothing: the
 * fixture reports rank 0's status first, and gathers a rank's outputs only when it
 * succeeded, so the poison must survive. Capacity 128 then suffices. */
static void slots_on_rank_1(mok_problem_t* p) {
  if (p->cfg.routing == MOK_ROUTING_FUSED) /* sigmoid scores < 1: bias 10 decides */
    for (int e = 4; e < 8; e++) set_real(p, p->bias_select, e, 10.0);
  else
    route_from(p, (const int32_t[]){4, 5, 6, 7}, 4, test_case_seed());
}

static int capacity(mok_routing_t routing) {
  mok_config_t c = layer();
  c.routing = routing;
  c.score = MOK_SCORE_SIGMOID;
  const int64_t T = 64, H = c.H, K = c.K;
  mok_problem_t* p = test_problem(&c, T, test_case_seed());
  TEST_ASSERT(p, "problem");
  slots_on_rank_1(p);
  struct {
    const char* name;
    void* data;
    size_t bytes;
  } outs[] = {{"y", p->y, (size_t)(T * H) * 2},
              {"dx", p->dx, (size_t)(T * H) * 2},
              {"topk_idx", p->out_topk_idx, (size_t)(T * K) * 4},
              {"tokens_per_expert", p->tokens_per_expert, (size_t)c.E * 4},
              {"d_w13", p->d_w13, (size_t)(c.E * 2 * c.F * H) * 2}};
  for (int i = 0; i < 5; i++) memset(outs[i].data, 0xA5, outs[i].bytes);
  mok_run_opts_t o = opts(2);
  o.capacity = 100;
  o.comm_timeout_s = 3;
  char err[512] = "";
  double t0 = now_s();
  mok_status_t s = mok_problem_run(p, &o, err, sizeof err);
  double dt = now_s() - t0;
  TEST_ASSERT(s == MOK_STATUS_CAPACITY_EXCEEDED, "rank 0 returned %s: %s", mok_status_string(s),
              err);
  TEST_ASSERT(strstr(err, "capacity"), "message does not name capacity: \"%s\"", err);
  TEST_ASSERT(dt < 1.5, "took %.2f s: a rank waited for the timeout", dt);
  for (int i = 0; i < 5; i++)
    for (size_t k = 0; k < outs[i].bytes; k++)
      TEST_ASSERT(((uint8_t*)outs[i].data)[k] == 0xA5, "%s changed by a failed step", outs[i].name);
  o.capacity = T * K;
  TEST_ASSERT(!test_run(p, &o), "capacity = T * K = %lld rows is enough", (long long)(T * K));
  TEST_ASSERT(p->tokens_per_expert[4] + p->tokens_per_expert[5] + p->tokens_per_expert[6] +
                      p->tokens_per_expert[7] ==
                  T * K,
              "the slots are not all on rank 1's experts");
  return 0;
}

static int capacity_exceeded_replay(void) { return capacity(MOK_ROUTING_REPLAY); }
static int capacity_exceeded_fused(void) { return capacity(MOK_ROUTING_FUSED); }

static int comm_timeout(void) {
  mok_config_t c = layer();
  mok_problem_t* p = test_problem(&c, 64, test_case_seed());
  TEST_ASSERT(p, "problem");
  mok_run_opts_t o = opts(2);
  o.skip_rank = 1;
  o.comm_timeout_s = 0.5;
  double t0 = now_s();
  mok_status_t s = mok_problem_run(p, &o, NULL, 0);
  double dt = now_s() - t0;
  TEST_ASSERT(s == MOK_STATUS_COMM_TIMEOUT, "rank 0 returned %s", mok_status_string(s));
  TEST_ASSERT(dt >= 0.45 && dt <= 2.0, "timed out after %.2f s (timeout 0.5 s)", dt);
  return 0;
}

/* FP32_ACCUM: one step gives g1 (0 + g1), two steps g2 = g1 + g1 exactly, and g1
 * rounded to bf16 is the gradient that BF16 wgrad writes. */
static int fp32_accumulation(void) {
  mok_config_t c = layer();
  mok_config_t cb = c;
  c.wgrad = MOK_WGRAD_FP32_ACCUM;
  const int64_t T = 128;
  mok_problem_t* p = test_problem(&c, T, test_case_seed());
  mok_problem_t* pb = test_problem(&cb, T, test_case_seed());
  TEST_ASSERT(p && pb, "problems");
  int bad = 0;
  for (int W = 1; W <= 2; W++) {
    mok_run_opts_t o = opts(W);
    test_outputs_t one, two, b;
    TEST_ASSERT(!test_run(p, &o), "1 step");
    test_snapshot(p, 1, &one);
    TEST_ASSERT(!test_run(pb, &o), "BF16 wgrad");
    test_snapshot(pb, 1, &b);
    o.steps = 2;
    TEST_ASSERT(!test_run(p, &o), "2 steps");
    test_snapshot(p, 1, &two);
    bad += test_same_bits(&two, &one, "y dx", "step 2 vs step 1");
    const char* names[] = {"d_w_router", "d_w13", "d_w2", "d_ws13", "d_ws2"};
    for (int k = 0; k < 5; k++) {
      const mok_tensor_view_t *g1 = test_view(&one, names[k]), *g2 = test_view(&two, names[k]),
                              *gb = test_view(&b, names[k]);
      TEST_ASSERT(g1 && g2 && gb && g1->kind == 1 && gb->kind == 0, "%s missing", names[k]);
      const float *a1 = g1->data, *a2 = g2->data;
      const uint16_t* ab = gb->data;
      for (int64_t i = 0; i < g1->count; i++) {
        if (a2[i] != a1[i] + a1[i]) {
          printf("    W = %d: %s[%lld]: 2 steps %.9g, 1 step %.9g\n", W, names[k], (long long)i,
                 a2[i], a1[i]);
          bad++;
          break;
        }
        if (test_bf16(a1[i]) != ab[i]) {
          printf("    W = %d: %s[%lld]: fp32 %.9g rounds to 0x%04x, BF16 wgrad wrote 0x%04x\n", W,
                 names[k], (long long)i, a1[i], test_bf16(a1[i]), ab[i]);
          bad++;
          break;
        }
      }
    }
  }
  return bad;
}

const test_case_t suite_edge[] = {
    {"expert_without_tokens", expert_without_tokens},
    {"all_tokens_one_expert", all_tokens_one_expert},
    {"bias_selects_one_expert", bias_selects_one_expert},
    {"router_ties", router_ties},
    {"group_ties", group_ties},
    {"ragged_tokens", ragged_tokens},
    {"k_one", k_one},
    {"k_all", k_all},
    {"w_not_dividing_t", w_not_dividing_t},
    {"nonfinite_x_fused", nonfinite_x_fused},
    {"nonfinite_x_replay", nonfinite_x_replay},
    {"capacity_exceeded_replay", capacity_exceeded_replay},
    {"capacity_exceeded_fused", capacity_exceeded_fused},
    {"comm_timeout", comm_timeout},
    {"fp32_accumulation", fp32_accumulation},
    TEST_END,
};
