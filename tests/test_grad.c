/* test_grad.c — backward against central finite differences of forward, in EXACT
 * numerics (every floating tensor double). The scalar checked is the loss whose
 * gradients backward receives:
 *     L = sum(y * dy) + d_aux_loss * aux_loss + d_z_loss * z_loss
 * For ~10 random entries of each input tensor (x, w_router, w13, w2, ws13, ws2, and
 * topk_weight in replay; b_router, b13, b2 with the router and expert biases, w_sg with the
 * shared-expert gate; x, w13, b13
 * on both sides of the clamped SwiGLU's limit), (L(v + eps) - L(v - eps)) / 2 eps must match the analytic
 * gradient to 1e-5 relative (abs floor 1e-7: L's rounding, ~1e-16 |L| over 2 eps).
 * Top-K is discrete: an entry whose perturbation changes the routing is skipped. */
#include <math.h>
#include <string.h>

#include "runner.h"

enum { SAMPLES = 10 };
static const double kEps = 1e-6, kRtol = 1e-5, kAtol = 1e-7;

static mok_config_t small_config(void) {
  mok_config_t c = MOK_CONFIG_INIT;
  c.H = 16, c.F = 8, c.E = 6, c.K = 2, c.Fs = 8;
  c.numerics = MOK_NUMERICS_EXACT;
  c.aux_loss_coef = 0.1f;
  c.z_loss_coef = 0.05f;
  c.num_threads = 1;
  return c;
}

static double loss(const mok_problem_t* p) {
  const double *y = p->y, *dy = p->dy;
  double L = 0;
  for (int64_t i = 0; i < p->T_global * p->cfg.H; i++) L += y[i] * dy[i];
  if (p->cfg.routing == MOK_ROUTING_FUSED)
    L += *(const double*)p->d_aux_loss * *(const double*)p->aux_loss +
         *(const double*)p->d_z_loss * *(const double*)p->z_loss;
  return L;
}

/* L at the current inputs, and whether the routing is still `route` (fused only). */
static int forward_loss(mok_problem_t* p, const mok_run_opts_t* fwd, const int32_t* route,
                        double* L, int* same_route) {
  if (test_run(p, fwd)) return 1;
  *L = loss(p);
  *same_route = p->cfg.routing == MOK_ROUTING_REPLAY ||
                memcmp(p->out_topk_idx, route, (size_t)(p->T_global * p->cfg.K) * 4) == 0;
  return 0;
}

/* How many routed gate and up values of p (EXACT, after a forward) lie on each side of
 * cfg.swiglu_limit: [gate <= limit, gate > limit, |up| <= limit, |up| > limit]; returns a
 * hash of every value's side, in order (equal before and after a change of one input:
 * no value crossed the limit, where the loss has a kink). */
static uint64_t clamp_sides(const mok_problem_t* p, int64_t sides[4]) {
  const mok_config_t* c = &p->cfg;
  const int64_t H = c->H, F = c->F, K = c->K;
  const int32_t* idx = c->routing == MOK_ROUTING_FUSED ? p->out_topk_idx : p->topk_idx;
  const double l = c->swiglu_limit;
  memset(sides, 0, 4 * sizeof *sides);
  uint64_t hash = 0xcbf29ce484222325ull;
  for (int64_t i = 0; i < p->T_global * K; i++) {
    const int64_t e = idx[i];
    const double* x = (const double*)p->x + (i / K) * H;
    for (int64_t f = 0; f < 2 * F; f++) {
      const double* w = (const double*)p->w13 + (e * 2 * F + f) * H;
      double a = c->use_expert_bias ? ((const double*)p->b13)[e * 2 * F + f] : 0;
      for (int64_t h = 0; h < H; h++) a += w[h] * x[h];
      const int side = f < F ? a > l : 2 + (fabs(a) > l);
      sides[side]++;
      hash = (hash ^ (uint64_t)side) * 0x100000001b3ull;
    }
  }
  return hash;
}

/* Runs backward once, then checks each input's gradient by finite differences. */
static int check_gradients(const mok_config_t* cfg, int64_t T, int W, int zero_dy) {
  mok_problem_t* p = test_problem(cfg, T, test_case_seed());
  TEST_ASSERT(p, "problem");
  const int64_t H = cfg->H, F = cfg->F, E = cfg->E, K = cfg->K, Fs = cfg->Fs;
  const int replay = cfg->routing == MOK_ROUTING_REPLAY;
  const int clamped = cfg->activation == MOK_ACTIVATION_SWIGLU_CLAMPED;
  if (zero_dy) memset(p->dy, 0, (size_t)(T * H) * 8); /* L = the router losses alone */
  mok_run_opts_t opts = MOK_RUN_OPTS_INIT, fwd = MOK_RUN_OPTS_INIT;
  opts.W = fwd.W = W;
  opts.num_threads = fwd.num_threads = 1;
  fwd.backward = 0;
  TEST_ASSERT(!test_run(p, &opts), "forward + backward");
  test_outputs_t grads;
  test_snapshot(p, 1, &grads);
  int32_t* route = test_alloc((size_t)(T * K) * 4);
  memcpy(route, p->out_topk_idx, (size_t)(T * K) * 4);

  struct {
    const char* input;
    double* data;
    int64_t count;
    const char* grad;
  } params[] = {
      {"x", p->x, T * H, "dx"},
      {"w_router", replay ? NULL : p->w_router, E * H, "d_w_router"},
      {"b_router", cfg->use_router_bias ? p->b_router : NULL, E, "d_b_router"},
      {"w13", p->w13, E * 2 * F * H, "d_w13"},
      {"w2", p->w2, E * H * F, "d_w2"},
      {"b13", cfg->use_expert_bias ? p->b13 : NULL, E * 2 * F, "d_b13"},
      {"b2", cfg->use_expert_bias ? p->b2 : NULL, E * H, "d_b2"},
      {"ws13", Fs ? p->ws13 : NULL, 2 * Fs * H, "d_ws13"},
      {"ws2", Fs ? p->ws2 : NULL, H * Fs, "d_ws2"},
      {"w_sg", cfg->use_shared_gate ? p->w_sg : NULL, H, "d_w_sg"},
      {"topk_weight", replay ? p->topk_weight : NULL, T * K, "d_topk_weight"},
  };
  uint64_t rng = test_case_seed() ^ 0x5eedull;
  int bad = 0;
  for (size_t k = 0; k < sizeof params / sizeof params[0]; k++) {
    if (!params[k].data) continue;
    const mok_tensor_view_t* g = test_view(&grads, params[k].grad);
    TEST_ASSERT(g && g->count == params[k].count && g->kind == 2, "no double gradient %s",
                params[k].grad);
    int checked = 0;
    for (int n = 0; n < SAMPLES; n++) {
      int64_t i = (int64_t)(test_next(&rng) % (uint64_t)params[k].count);
      double v = params[k].data[i], Lp, Lm;
      int same_p, same_m;
      int64_t sides[4];
      uint64_t clamps_p = 0, clamps_m = 0;
      params[k].data[i] = v + kEps;
      TEST_ASSERT(!forward_loss(p, &fwd, route, &Lp, &same_p), "forward at +eps");
      if (clamped && same_p) clamps_p = clamp_sides(p, sides);
      params[k].data[i] = v - kEps;
      TEST_ASSERT(!forward_loss(p, &fwd, route, &Lm, &same_m), "forward at -eps");
      if (clamped && same_m) clamps_m = clamp_sides(p, sides);
      params[k].data[i] = v;
      if (!same_p || !same_m) continue; /* top-K flipped inside [v - eps, v + eps] */
      if (clamps_p != clamps_m) continue; /* a gate or up value crossed the clamp there */
      checked++;
      double num = (Lp - Lm) / (2 * kEps), ana = ((const double*)g->data)[i];
      if (!(fabs(num - ana) <= kRtol * fmax(fabs(num), fabs(ana)) + kAtol)) {
        printf("    %s[%lld]: analytic %.10g, finite difference %.10g (W = %d)\n", params[k].grad,
               (long long)i, ana, num, W);
        bad++;
      }
    }
    TEST_ASSERT(checked >= SAMPLES / 2, "%s: only %d of %d entries kept their routing and clamps",
                params[k].input, checked, SAMPLES);
  }
  return bad;
}

static int softmax_normalized(void) {
  mok_config_t c = small_config();
  c.route_scale = 2.5f;
  return check_gradients(&c, 12, 1, 0);
}

static int softmax_unnormalized(void) {
  mok_config_t c = small_config();
  c.normalize = 0;
  c.Fs = 0;
  return check_gradients(&c, 16, 1, 0);
}

static int sigmoid_normalized_bias(void) {
  mok_config_t c = small_config();
  c.score = MOK_SCORE_SIGMOID;
  c.use_bias_select = 1;
  c.route_scale = 1.5f;
  return check_gradients(&c, 12, 1, 0);
}

static int sigmoid_unnormalized(void) {
  mok_config_t c = small_config();
  c.score = MOK_SCORE_SIGMOID;
  c.normalize = 0;
  c.route_scale = 0.7f;
  c.aux_loss_coef = 0.2f;
  c.z_loss_coef = 0;
  return check_gradients(&c, 12, 1, 0);
}

/* dy = 0: the load-balancing and z losses are all of L, so their gradients are checked
 * on their own rather than beside the larger expert path. */
static int router_losses_softmax(void) {
  mok_config_t c = small_config();
  c.aux_loss_coef = 1.0f;
  c.z_loss_coef = 0.5f;
  return check_gradients(&c, 12, 1, 1);
}

static int router_losses_sigmoid(void) {
  mok_config_t c = small_config();
  c.score = MOK_SCORE_SIGMOID;
  c.use_bias_select = 1;
  c.aux_loss_coef = 1.0f;
  c.z_loss_coef = 0.5f;
  return check_gradients(&c, 12, 1, 1);
}

/* Group-limited routing: the group choice is piecewise constant, so the gradients are
 * those of the ordinary top-K of the chosen experts (an entry that flips a group is
 * skipped as a flipped top-K is). DeepSeek-V3's router (sigmoid, bias, normalised,
 * scaled; groups of 2 experts, the best 2 of 3 groups by their top-2 sums) on W = 1 and
 * 2; DeepSeek-V2's form (softmax, a group's largest score) with the router losses alone. */
static int group_limited(void) {
  mok_config_t c = small_config();
  c.score = MOK_SCORE_SIGMOID;
  c.use_bias_select = 1;
  c.route_scale = 2.5f;
  c.n_group = 3, c.topk_group = 2, c.K = 3;
  return check_gradients(&c, 12, 1, 0) + check_gradients(&c, 12, 2, 0);
}

static int group_limited_losses(void) {
  mok_config_t c = small_config();
  c.n_group = 3, c.topk_group = 1, c.group_score = MOK_GROUP_SCORE_MAX;
  c.aux_loss_coef = 1.0f;
  c.z_loss_coef = 0.5f;
  return check_gradients(&c, 12, 1, 1);
}

/* The router logit bias (gpt-oss: softmax, top-4 of 32 there): its gradient is the
 * dlogits' sum over tokens; through the weights, the losses (aux on dy's path, both
 * alone) and on W = 2 (the replicated tree). */
static int router_bias(void) {
  mok_config_t c = small_config();
  c.use_router_bias = 1;
  return check_gradients(&c, 12, 1, 0) + check_gradients(&c, 12, 2, 0);
}

static int router_bias_losses(void) {
  mok_config_t c = small_config();
  c.use_router_bias = 1;
  c.score = MOK_SCORE_SIGMOID;
  c.use_bias_select = 1;
  c.aux_loss_coef = 1.0f;
  c.z_loss_coef = 0.5f;
  return check_gradients(&c, 12, 1, 1);
}

/* The expert biases (gpt-oss): d_b13 and d_b2 sum d_a and dy_j over each expert's rows;
 * on W = 1 and 2 (the rows of an expert from two ranks), and in replay routing. */
static int expert_bias(void) {
  mok_config_t c = small_config();
  c.use_expert_bias = 1;
  int bad = check_gradients(&c, 12, 1, 0) + check_gradients(&c, 12, 2, 0);
  c.routing = MOK_ROUTING_REPLAY;
  return bad + check_gradients(&c, 12, 1, 0);
}

/* gpt-oss's clamped SwiGLU (alpha 1.702; limit 0.25 here, so that about a third of the
 * gate and up values are clamped): the gradient is zero through a clamp and the
 * derivative of (up' + 1) gate' sigmoid(alpha gate') elsewhere; each side of the limit is
 * checked to hold values (x, w13 and b13 near both sides), on W = 1 and 2, then with
 * gpt-oss's router and expert biases, and in replay. */
static int clamped_swiglu(void) {
  int bad = 0;
  for (int i = 0; i < 3; i++) {
    mok_config_t c = small_config();
    c.activation = MOK_ACTIVATION_SWIGLU_CLAMPED;
    c.swiglu_alpha = 1.702f;
    c.swiglu_limit = 0.25f;
    if (i == 1) c.use_router_bias = c.use_expert_bias = 1;
    if (i == 2) c.routing = MOK_ROUTING_REPLAY;
    mok_problem_t* p = test_problem(&c, 12, test_case_seed());
    mok_run_opts_t o = MOK_RUN_OPTS_INIT;
    o.backward = 0;
    TEST_ASSERT(p && !test_run(p, &o), "forward");
    int64_t sides[4];
    clamp_sides(p, sides);
    printf("    config %d: gate <= limit %lld, > limit %lld; |up| <= limit %lld, > limit %lld\n", i,
           (long long)sides[0], (long long)sides[1], (long long)sides[2], (long long)sides[3]);
    for (int k = 0; k < 4; k++)
      TEST_ASSERT(sides[k] >= 10, "config %d: too few values on one side of the limit (the case tests less)", i);
    bad += check_gradients(&c, 12, 1, 0);
    if (i == 0) bad += check_gradients(&c, 12, 2, 0);
  }
  return bad;
}

/* Qwen2-MoE's gated shared expert: sigmoid(x · w_sg) scales the shared output; d_w_sg
 * is a replicated gradient (W = 2: the tree over both ranks' chunks), x gets the gate's
 * path too; in replay, and with the losses alone (dy = 0: the gate gets nothing, the
 * case checks that nothing leaks into it). */
static int shared_gate(void) {
  mok_config_t c = small_config();
  c.use_shared_gate = 1;
  int bad = check_gradients(&c, 12, 1, 0) + check_gradients(&c, 12, 2, 0);
  c.routing = MOK_ROUTING_REPLAY;
  bad += check_gradients(&c, 12, 1, 0);
  c.routing = MOK_ROUTING_FUSED, c.gate_up = MOK_GATE_UP_RECOMPUTE;
  return bad + check_gradients(&c, 12, 1, 1);
}

static int replay(void) {
  mok_config_t c = small_config();
  c.routing = MOK_ROUTING_REPLAY;
  return check_gradients(&c, 12, 1, 0);
}

static int two_ranks(void) {
  mok_config_t c = small_config();
  c.use_bias_select = 1;
  c.route_scale = 1.25f;
  return check_gradients(&c, 12, 2, 0);
}

static int two_ranks_replay(void) {
  mok_config_t c = small_config();
  c.routing = MOK_ROUTING_REPLAY;
  return check_gradients(&c, 11, 2, 0);
}

const test_case_t suite_grad[] = {
    {"softmax_normalized", softmax_normalized},
    {"softmax_unnormalized", softmax_unnormalized},
    {"sigmoid_normalized_bias", sigmoid_normalized_bias},
    {"sigmoid_unnormalized", sigmoid_unnormalized},
    {"router_losses_softmax", router_losses_softmax},
    {"router_losses_sigmoid", router_losses_sigmoid},
    {"group_limited", group_limited},
    {"group_limited_losses", group_limited_losses},
    {"router_bias", router_bias},
    {"router_bias_losses", router_bias_losses},
    {"expert_bias", expert_bias},
    {"clamped_swiglu", clamped_swiglu},
    {"shared_gate", shared_gate},
    {"replay", replay},
    {"two_ranks", two_ranks},
    {"two_ranks_replay", two_ranks_replay},
    TEST_END,
};
