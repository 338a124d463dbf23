/* test_validation.c — every argument rule of the API (mok.h, DESIGN.md section 6):
 * each broken rule returns its own status, names the argument in the message
 * (mok_last_create_error / mok_context_last_error), and changes no output: outputs are
 * filled with a poison byte before the call and compared byte by byte after it.
 * Drives the API directly: one context, W = 1 (more only where a rule needs W > 1),
 * T = 32, H = 64, F = 32, E = 8, K = 2, Fs = 16. */
#include <ctype.h>
#include <float.h>
#include <math.h>
#include <string.h>

#include "runner.h"

#define POISON 0xA5

enum { T_ = 32, H_ = 64, F_ = 32, E_ = 8, K_ = 2, FS_ = 16 };

typedef struct {
  const char* name;
  void* ptr;
  size_t bytes;
} buf_t;

typedef struct {
  mok_config_t cfg;
  mok_context_t* ctx;
  size_t ws_bytes, sv_bytes;
  uint16_t *x, *w_router, *w13, *w2, *ws13, *ws2, *dy, *y, *dx;
  void *d_w_router, *d_w13, *d_w2, *d_ws13, *d_ws2; /* bf16 or fp32 */
  float *bias, *topk_weight, *d_topk_weight, *aux, *z;
  float *b_router, *d_b_router; /* the variants' tensors (mok.h), given whether on or off */
  uint16_t *b13, *b2, *w_sg;
  void *d_b13, *d_b2, *d_w_sg; /* bf16 or fp32, as d_w13 */
  int32_t *topk_idx, *tokens_per_expert;
  void *saved, *workspace;
  mok_forward_args_t fa;
  mok_backward_args_t ba;
  buf_t fwd_out[8], bwd_out[12];
  int num_fwd_out, num_bwd_out;
} fix_t;

static mok_config_t base_config(void) {
  mok_config_t c = MOK_CONFIG_INIT;
  c.T = T_, c.H = H_, c.F = F_, c.E = E_, c.K = K_, c.Fs = FS_;
  c.use_bias_select = 1;
  c.aux_loss_coef = 0.01f;
  c.z_loss_coef = 0.001f;
  c.num_threads = 1;
  return c;
}

static uint16_t* random_bf16(int64_t n, double scale, uint64_t* s) {
  uint16_t* p = test_alloc((size_t)n * 2 + 256); /* + slack for the misaligned-pointer cases */
  for (int64_t i = 0; i < n; i++)
    p[i] = test_bf16((float)(scale * ((double)(test_next(s) >> 11) * 0x1.0p-52 - 1.0)));
  return p;
}

/* A valid context and valid arguments of both calls; each case breaks one thing.
 * variants: the config's router and expert variants on (mok.h), else off. */
static int fix_init_with(fix_t* f, mok_routing_t routing, mok_wgrad_t wgrad, int variants) {
  memset(f, 0, sizeof *f);
  f->cfg = base_config();
  f->cfg.routing = routing;
  f->cfg.wgrad = wgrad;
  if (variants) f->cfg.use_router_bias = routing == MOK_ROUTING_FUSED, f->cfg.use_expert_bias = 1;
  if (variants) f->cfg.use_shared_gate = 1;
  f->ctx = test_context(&f->cfg, NULL);
  if (!f->ctx) return 1;
  if (mok_workspace_size(f->ctx, &f->ws_bytes) || mok_saved_size(f->ctx, &f->sv_bytes)) return 1;
  uint64_t s = test_case_seed();
  const size_t wg = wgrad == MOK_WGRAD_FP32_ACCUM ? 4 : 2;
  f->x = random_bf16(T_ * H_, 1.0, &s);
  f->w_router = random_bf16(E_ * H_, 0.125, &s);
  f->w13 = random_bf16(E_ * 2 * F_ * H_, 0.125, &s);
  f->w2 = random_bf16(E_ * H_ * F_, 0.18, &s);
  f->ws13 = random_bf16(2 * FS_ * H_, 0.125, &s);
  f->ws2 = random_bf16(H_ * FS_, 0.25, &s);
  f->dy = random_bf16(T_ * H_, 1.0, &s);
  f->y = test_alloc(T_ * H_ * 2 + 256);
  f->dx = test_alloc(T_ * H_ * 2);
  f->d_w_router = test_alloc(E_ * H_ * wg);
  f->d_w13 = test_alloc(E_ * 2 * F_ * H_ * wg);
  f->d_w2 = test_alloc(E_ * H_ * F_ * wg);
  f->d_ws13 = test_alloc(2 * FS_ * H_ * wg);
  f->d_ws2 = test_alloc(H_ * FS_ * wg);
  f->b_router = test_alloc(E_ * 4 + 256);
  for (int e = 0; e < E_; e++) f->b_router[e] = 0.25f - 0.0625f * (float)e;
  f->d_b_router = test_alloc(E_ * 4 + 256);
  f->b13 = random_bf16(E_ * 2 * F_, 0.5, &s);
  f->b2 = random_bf16(E_ * H_, 0.5, &s);
  f->d_b13 = test_alloc(E_ * 2 * F_ * wg + 256);
  f->d_b2 = test_alloc(E_ * H_ * wg + 256);
  f->w_sg = random_bf16(H_, 0.25, &s);
  f->d_w_sg = test_alloc(H_ * wg + 256);
  f->bias = test_alloc(E_ * 4);
  for (int e = 0; e < E_; e++) f->bias[e] = 0.001f * (float)e;
  f->topk_idx = test_alloc(T_ * K_ * 4);
  f->topk_weight = test_alloc(T_ * K_ * 4);
  for (int t = 0; t < T_; t++)
    for (int j = 0; j < K_; j++) {
      f->topk_idx[t * K_ + j] = (t + 3 * j) % E_; /* distinct for K_ = 2 */
      f->topk_weight[t * K_ + j] = 0.25f + 0.5f * (float)j;
    }
  f->d_topk_weight = test_alloc(T_ * K_ * 4);
  f->tokens_per_expert = test_alloc(E_ * 4);
  f->aux = test_alloc(4);
  f->z = test_alloc(4);
  f->saved = test_alloc(f->sv_bytes);
  f->workspace = test_alloc(f->ws_bytes + 256);

  mok_forward_args_t* a = &f->fa;
  a->num_tokens = T_;
  a->x = f->x, a->w_router = f->w_router, a->bias_select = f->bias, a->b_router = f->b_router;
  a->w13 = f->w13, a->w2 = f->w2, a->ws13 = f->ws13, a->ws2 = f->ws2;
  a->b13 = f->b13, a->b2 = f->b2, a->w_sg = f->w_sg;
  a->topk_idx = f->topk_idx, a->topk_weight = f->topk_weight;
  a->y = f->y, a->tokens_per_expert = f->tokens_per_expert, a->aux_loss = f->aux, a->z_loss = f->z;
  a->saved = f->saved, a->saved_bytes = f->sv_bytes;
  a->workspace = f->workspace, a->workspace_bytes = f->ws_bytes;
  mok_backward_args_t* b = &f->ba;
  b->num_tokens = T_;
  b->x = f->x, b->w_router = f->w_router, b->w13 = f->w13, b->w2 = f->w2;
  b->ws13 = f->ws13, b->ws2 = f->ws2, b->dy = f->dy;
  b->saved = f->saved, b->saved_bytes = f->sv_bytes;
  b->dx = f->dx;
  b->d_topk_weight = routing == MOK_ROUTING_REPLAY ? f->d_topk_weight : NULL;
  b->d_w_router = routing == MOK_ROUTING_REPLAY ? NULL : f->d_w_router;
  b->d_w13 = f->d_w13, b->d_w2 = f->d_w2, b->d_ws13 = f->d_ws13, b->d_ws2 = f->d_ws2;
  b->d_b_router = f->d_b_router;
  b->b13 = f->b13, b->d_b13 = f->d_b13, b->d_b2 = f->d_b2, b->w_sg = f->w_sg, b->d_w_sg = f->d_w_sg;
  b->workspace = f->workspace, b->workspace_bytes = f->ws_bytes;

  int n = 0;
  f->fwd_out[n++] = (buf_t){"y", f->y, T_ * H_ * 2};
  f->fwd_out[n++] = (buf_t){"tokens_per_expert", f->tokens_per_expert, E_ * 4};
  f->fwd_out[n++] = (buf_t){"aux_loss", f->aux, 4};
  f->fwd_out[n++] = (buf_t){"z_loss", f->z, 4};
  f->fwd_out[n++] = (buf_t){"saved", f->saved, f->sv_bytes};
  if (routing == MOK_ROUTING_FUSED) { /* written outputs in fused routing, inputs in replay */
    f->fwd_out[n++] = (buf_t){"topk_idx", f->topk_idx, T_ * K_ * 4};
    f->fwd_out[n++] = (buf_t){"topk_weight", f->topk_weight, T_ * K_ * 4};
  }
  f->num_fwd_out = n;
  n = 0;
  f->bwd_out[n++] = (buf_t){"dx", f->dx, T_ * H_ * 2};
  f->bwd_out[n++] = (buf_t){"d_topk_weight", f->d_topk_weight, T_ * K_ * 4};
  f->bwd_out[n++] = (buf_t){"d_w_router", f->d_w_router, E_ * H_ * wg};
  f->bwd_out[n++] = (buf_t){"d_w13", f->d_w13, E_ * 2 * F_ * H_ * wg};
  f->bwd_out[n++] = (buf_t){"d_w2", f->d_w2, E_ * H_ * F_ * wg};
  f->bwd_out[n++] = (buf_t){"d_ws13", f->d_ws13, 2 * FS_ * H_ * wg};
  f->bwd_out[n++] = (buf_t){"d_ws2", f->d_ws2, H_ * FS_ * wg};
  f->bwd_out[n++] = (buf_t){"d_w_sg", f->d_w_sg, H_ * wg};
  f->bwd_out[n++] = (buf_t){"d_b13", f->d_b13, E_ * 2 * F_ * wg};
  f->bwd_out[n++] = (buf_t){"d_b2", f->d_b2, E_ * H_ * wg};
  f->bwd_out[n++] = (buf_t){"d_b_router", f->d_b_router, E_ * 4}; /* (last: variant_arguments) */
  f->num_bwd_out = n;
  return 0;
}

static int fix_init(fix_t* f, mok_routing_t routing, mok_wgrad_t wgrad) { return fix_init_with(f, routing, wgrad, 0); }

static void poison(const buf_t* b, int n) {
  for (int i = 0; i < n; i++) memset(b[i].ptr, POISON, b[i].bytes);
}
/* Name of the first buffer with a byte that is not the poison, or NULL. */
static const char* touched(const buf_t* b, int n) {
  for (int i = 0; i < n; i++)
    for (size_t k = 0; k < b[i].bytes; k++)
      if (((const uint8_t*)b[i].ptr)[k] != POISON) return b[i].name;
  return NULL;
}

/* Does msg name one of the '|'-separated names? Names of one or two characters ("K",
 * "Fs", "x") must stand as a word, longer ones may be part of one ("workspace_bytes"). */
static int names_one_of(const char* msg, const char* names) {
  if (!msg) return 0;
  char buf[128];
  snprintf(buf, sizeof buf, "%s", names);
  for (char* nm = strtok(buf, "|"); nm; nm = strtok(NULL, "|")) {
    size_t n = strlen(nm);
    for (const char* q = msg; (q = strstr(q, nm)) != NULL; q++) {
      int word = (q == msg || !(isalnum((unsigned char)q[-1]) || q[-1] == '_')) &&
                 !(isalnum((unsigned char)q[n]) || q[n] == '_');
      if (n > 2 || word) return 1;
    }
  }
  return 0;
}

static int check_outcome(const char* rule, mok_status_t got, mok_status_t want, int want2,
                         const char* msg, const char* names, const char* changed) {
  if (got != want && (int)got != want2) {
    printf("    %s: got %s, want %s: \"%s\"\n", rule, mok_status_string(got),
           mok_status_string(want), msg ? msg : "(null)");
    return 1;
  }
  if (changed) {
    printf("    %s: returned %s but changed %s\n", rule, mok_status_string(got), changed);
    return 1;
  }
  if (names && !names_one_of(msg, names)) {
    printf("    %s: message does not name %s: \"%s\"\n", rule, names, msg ? msg : "(null)");
    return 1;
  }
  return 0;
}

static int expect_fwd(fix_t* f, const mok_forward_args_t* a, mok_status_t want, const char* names,
                      const char* rule) {
  poison(f->fwd_out, f->num_fwd_out);
  mok_status_t s = mok_forward(f->ctx, a);
  return check_outcome(rule, s, want, -1, mok_context_last_error(f->ctx), names,
                       touched(f->fwd_out, f->num_fwd_out));
}

static int expect_bwd(fix_t* f, const mok_backward_args_t* b, mok_status_t want, int want2,
                      const char* names, const char* rule) {
  poison(f->bwd_out, f->num_bwd_out);
  mok_status_t s = mok_backward(f->ctx, b);
  return check_outcome(rule, s, want, want2, mok_context_last_error(f->ctx), names,
                       touched(f->bwd_out, f->num_bwd_out));
}

/* A forward that succeeds, so that backward has a valid saved buffer. */
static int good_forward(fix_t* f) {
  mok_status_t s = mok_forward(f->ctx, &f->fa);
  if (s) printf("    forward: %s: %s\n", mok_status_string(s), mok_context_last_error(f->ctx));
  return s != MOK_STATUS_SUCCESS;
}

static int expect_create(const mok_config_t* cfg, mok_status_t want, int want2, const char* names,
                         const char* rule) {
  mok_context_t* ctx = (mok_context_t*)&ctx; /* a sentinel: must come back NULL */
  mok_status_t s = mok_context_create(cfg, &ctx);
  if (s == MOK_STATUS_SUCCESS) {
    mok_context_destroy(ctx);
    printf("    %s: create succeeded\n", rule);
    return 1;
  }
  return check_outcome(rule, s, want, want2, mok_last_create_error(), names,
                       ctx ? "*ctx (not NULL)" : NULL);
}

/* ---- cases ---- */

static int valid_calls(void) {
  for (int replay = 0; replay < 2; replay++) {
    fix_t f;
    TEST_ASSERT(!fix_init(&f, replay, MOK_WGRAD_BF16), "fixture");
    poison(f.fwd_out, f.num_fwd_out);
    poison(f.bwd_out, f.num_bwd_out);
    TEST_ASSERT(!good_forward(&f), "valid forward failed (replay %d)", replay);
    mok_status_t s = mok_backward(f.ctx, &f.ba);
    TEST_ASSERT(s == MOK_STATUS_SUCCESS, "valid backward (replay %d): %s: %s", replay,
                mok_status_string(s), mok_context_last_error(f.ctx));
    const char* ys[] = {"y", "dx"};
    const uint16_t* bufs[] = {f.y, f.dx};
    for (int i = 0; i < 2; i++)
      for (int k = 0; k < T_ * H_; k++)
        TEST_ASSERT(bufs[i][k] != 0xA5A5, "%s[%d] not written (replay %d)", ys[i], k, replay);
  }
  return 0;
}

static int create_version(void) {
  int bad = 0;
  mok_config_t c = base_config();
  c.version = MOK_VERSION_CODE + 1;
  bad += expect_create(&c, MOK_STATUS_VERSION_MISMATCH, -1, "version", "version + 1");
  c = base_config();
  c.struct_size = sizeof(mok_config_t) - 8;
  bad += expect_create(&c, MOK_STATUS_VERSION_MISMATCH, -1, "struct_size", "struct_size - 8");
  TEST_ASSERT(mok_context_create(NULL, &(mok_context_t*){NULL}) == MOK_STATUS_NULL_POINTER,
              "create(NULL config)");
  c = base_config();
  TEST_ASSERT(mok_context_create(&c, NULL) == MOK_STATUS_NULL_POINTER, "create(NULL out)");
  return bad;
}

static int create_shape(void) {
  int bad = 0;
  const mok_status_t S = MOK_STATUS_INVALID_SHAPE;
  mok_config_t c;
#define RULE(assign, names) \
  (c = base_config(), assign, bad += expect_create(&c, S, -1, names, #assign))
  RULE(c.K = E_ + 1, "K");
  RULE(c.K = 0, "K");
  RULE(c.K = -1, "K");
  RULE(c.H = 0, "H");
  RULE(c.H = -64, "H");
  RULE(c.F = 0, "F");
  RULE(c.E = 0, "E");
  RULE(c.T = -1, "T");
  RULE(c.Fs = -1, "Fs");
  /* group-limited routing: n_group >= 0 dividing E, topk_group in [1, n_group] (0 without
   * groups), K at most the kept groups' experts */
  RULE(c.n_group = -1, "n_group");
  RULE((c.n_group = 3, c.topk_group = 1), "n_group");
  RULE((c.n_group = 16, c.topk_group = 1), "n_group");
  RULE(c.topk_group = 1, "topk_group");
  RULE(c.topk_group = -1, "topk_group");
  RULE(c.n_group = 4, "topk_group");
  RULE((c.n_group = 4, c.topk_group = 5), "topk_group");
  RULE((c.n_group = 8, c.topk_group = 1), "K");
  RULE((c.n_group = 4, c.topk_group = 1, c.K = 3), "K");
  /* capacity: at most the rows that can arrive, T min(K, E / W) here (2^62 once made
   * the forward write past its buffers) */
  RULE(c.capacity = T_ * K_ + 1, "capacity");
  RULE(c.capacity = (int64_t)1 << 62, "capacity");
  RULE((c.T = 64, c.H = 2, c.F = 2, c.E = 2, c.K = 2, c.Fs = 0, c.capacity = (int64_t)1 << 62), "capacity");
  /* sizes that would not fit: refused at create, whatever the product */
  const mok_status_t U = MOK_STATUS_UNSUPPORTED_SHAPE;
  c = base_config(), c.H = (int64_t)1 << 40;
  bad += expect_create(&c, U, -1, "H", "H = 2^40");
  c = base_config(), c.T = 0, c.Fs = (int64_t)1 << 30, c.H = (int64_t)1 << 30;
  bad += expect_create(&c, U, -1, "Fs", "T = 0, H = Fs = 2^30");
  c = base_config(), c.T = (int64_t)1 << 31;
  bad += expect_create(&c, U, -1, "T", "T = 2^31");
  /* E % W: with a communicator of 3, so that only the shape is wrong */
  mok_cpu_comm_t* comm3 = test_comm(3);
  TEST_ASSERT(comm3, "cpu_comm_create(3)");
  RULE((c.W = 3, c.cpu_comm = comm3, c.comm_timeout_s = 0.5), "E|W");
#undef RULE
  return bad;
}

static int create_argument(void) {
  int bad = 0;
  const mok_status_t A = MOK_STATUS_INVALID_ARGUMENT;
  mok_cpu_comm_t* comm2 = test_comm(2);
  TEST_ASSERT(comm2, "cpu_comm_create(2)");
  mok_config_t c;
#define RULE(assign, names) \
  (c = base_config(), assign, bad += expect_create(&c, A, -1, names, #assign))
  RULE((c.W = 2, c.cpu_comm = comm2, c.comm_timeout_s = 0.5, c.rank = 2), "rank");
  RULE((c.W = 2, c.cpu_comm = comm2, c.comm_timeout_s = 0.5, c.rank = -1), "rank");
  RULE(c.rank = 1, "rank");
  RULE(c.W = 2, "cpu_comm");
  RULE(c.routing = (mok_routing_t)2, "routing");
  RULE(c.score = (mok_score_t)-1, "score");
  RULE(c.wgrad = (mok_wgrad_t)2, "wgrad");
  RULE(c.numerics = (mok_numerics_t)2, "numerics");
  RULE(c.backend = (mok_backend_t)7, "backend");
  RULE(c.num_threads = -1, "num_threads");
  RULE(c.num_threads = MOK_MAX_THREADS + 1, "num_threads");
  RULE(c.gate_up = (mok_gate_up_t)2, "gate_up");
  RULE(c.saved_use = (mok_saved_use_t)2, "saved_use");
  RULE(c.group_score = (mok_group_score_t)2, "group_score");
  RULE(c.group_score = (mok_group_score_t)-1, "group_score");
  RULE((c.routing = MOK_ROUTING_REPLAY, c.use_bias_select = 0, c.n_group = 4, c.topk_group = 2), "n_group");
  RULE((c.routing = MOK_ROUTING_REPLAY, c.use_bias_select = 0, c.use_router_bias = 1), "use_router_bias");
  RULE((c.Fs = 0, c.use_shared_gate = 1), "use_shared_gate");
#undef RULE
  mok_cpu_comm_t* none = NULL;
  TEST_ASSERT(mok_cpu_comm_create(0, &none) == A && none == NULL, "cpu_comm_create(0)");
  return bad;
}

static int create_nonfinite(void) {
  int bad = 0;
  const float vals[] = {NAN, INFINITY, -INFINITY};
  for (int i = 0; i < 3; i++) {
    mok_config_t c;
    char rule[64];
#define RULE(field)                                              \
  (c = base_config(), c.field = vals[i],                         \
   snprintf(rule, sizeof rule, #field " = %g", (double)vals[i]), \
   bad += expect_create(&c, MOK_STATUS_NONFINITE_VALUE, -1, #field, rule))
    RULE(route_scale);
    RULE(aux_loss_coef);
    RULE(z_loss_coef);
#undef RULE
  }
  return bad;
}

/* The clamped SwiGLU's parameters (mok.h cfg.activation): finite (NONFINITE_VALUE) and
 * > 0 (INVALID_ARGUMENT) with MOK_ACTIVATION_SWIGLU_CLAMPED, 0 without it; the activation
 * a mok_activation_t. Each message names the field; gpt-oss's values create. */
static int create_activation(void) {
  int bad = 0;
  const mok_status_t A = MOK_STATUS_INVALID_ARGUMENT, NF = MOK_STATUS_NONFINITE_VALUE;
  const float nonfinite[] = {NAN, INFINITY, -INFINITY}, nonpositive[] = {0.0f, -0.0f, -1.0f, -FLT_MAX};
  mok_config_t g = base_config();
  g.activation = MOK_ACTIVATION_SWIGLU_CLAMPED, g.swiglu_alpha = 1.702f, g.swiglu_limit = 7.0f;
  mok_context_t* ctx = test_context(&g, NULL);
  TEST_ASSERT(ctx, "gpt-oss's clamped SwiGLU (alpha 1.702, limit 7) does not create");
  mok_config_t c;
  char rule[96];
#define RULE(change, status, name)                                              \
  (c = g, change, snprintf(rule, sizeof rule, "%s (%g, %g)", #change, (double)c.swiglu_alpha, \
                           (double)c.swiglu_limit),                                \
   bad += expect_create(&c, status, -1, name, rule))
  for (int i = 0; i < 3; i++) {
    RULE(c.swiglu_alpha = nonfinite[i], NF, "swiglu_alpha");
    RULE(c.swiglu_limit = nonfinite[i], NF, "swiglu_limit");
  }
  for (int i = 0; i < 4; i++) {
    RULE(c.swiglu_alpha = nonpositive[i], A, "swiglu_alpha");
    RULE(c.swiglu_limit = nonpositive[i], A, "swiglu_limit");
  }
  RULE(c.activation = (mok_activation_t)2, A, "activation");
  RULE(c.activation = (mok_activation_t)-1, A, "activation");
  RULE((c.activation = MOK_ACTIVATION_SWIGLU, c.swiglu_limit = 0), A, "swiglu_alpha|activation");
  RULE((c.activation = MOK_ACTIVATION_SWIGLU, c.swiglu_alpha = 0), A, "swiglu_limit|activation");
  RULE((c.activation = MOK_ACTIVATION_SWIGLU, c.swiglu_alpha = NAN, c.swiglu_limit = 0), A, "swiglu_alpha");
#undef RULE
  return bad;
}

/* Without nvcc the library has no CUDA backend: BACKEND_UNAVAILABLE. With it, a shape
 * the kernels take creates (a GPU) or gives BACKEND_UNAVAILABLE (no device), and one
 * they do not take (F = 32, K = 33) gives UNSUPPORTED_SHAPE. EXACT numerics is CPU-only.
 * The kernels take any E up to MOK_MAX_EXPERTS, group-limited routing, the router bias,
 * the clamped SwiGLU and the gated shared expert. */
static int cuda_takes(const mok_config_t* c, const char* what) {
#ifndef MOK_HAVE_CUDA
  return expect_create(c, MOK_STATUS_BACKEND_UNAVAILABLE, -1, "backend|CUDA|cuda", what);
#else
  mok_context_t* ctx = NULL;
  mok_status_t s = mok_context_create(c, &ctx);
  if (s == MOK_STATUS_SUCCESS) {
    mok_context_destroy(ctx);
    return 0;
  }
  return check_outcome(what, s, MOK_STATUS_BACKEND_UNAVAILABLE, -1, mok_last_create_error(),
                       "backend|CUDA|cuda|device|GPU", ctx ? "*ctx (not NULL)" : NULL);
#endif
}

static int create_backend(void) {
  int bad = 0;
  mok_config_t c = base_config();
  c.backend = MOK_BACKEND_CUDA;
#ifdef MOK_HAVE_CUDA
  bad += expect_create(&c, MOK_STATUS_UNSUPPORTED_SHAPE, -1, "F", "cuda backend, F = 32");
#endif
  c.F = c.Fs = 64;
  bad += cuda_takes(&c, "cuda backend");
  mok_config_t v = c;
  v.n_group = 4, v.topk_group = 2;
  bad += cuda_takes(&v, "cuda backend, n_group = 4");
  v = c, v.E = 3, v.K = 2;
  bad += cuda_takes(&v, "cuda backend, E = 3");
  v = c, v.use_router_bias = 1;
  bad += cuda_takes(&v, "cuda backend, use_router_bias = 1");
  v = c, v.activation = MOK_ACTIVATION_SWIGLU_CLAMPED, v.swiglu_alpha = 1.702f, v.swiglu_limit = 7.0f;
  bad += cuda_takes(&v, "cuda backend, the clamped SwiGLU");
  v = c, v.use_shared_gate = 1;
  bad += cuda_takes(&v, "cuda backend, use_shared_gate = 1");
  v = c, v.E = 1024, v.K = 32;  /* the most experts (internal.h: MOK_MAX_EXPERTS) */
  bad += cuda_takes(&v, "cuda backend, E = 1024, K = 32");
#ifdef MOK_HAVE_CUDA
  v.K = 33;
  bad += expect_create(&v, MOK_STATUS_UNSUPPORTED_SHAPE, -1, "K", "cuda backend, K = 33");
#endif
  c.numerics = MOK_NUMERICS_EXACT;
  bad += expect_create(&c, MOK_STATUS_UNSUPPORTED_SHAPE, MOK_STATUS_INVALID_ARGUMENT, "numerics",
                       "EXACT numerics on cuda");
  return bad;
}

static int forward_shape(void) {
  fix_t f;
  TEST_ASSERT(!fix_init(&f, MOK_ROUTING_FUSED, MOK_WGRAD_BF16), "fixture");
  int bad = 0;
  mok_forward_args_t a = f.fa;
  a.num_tokens = T_ + 1;
  bad += expect_fwd(&f, &a, MOK_STATUS_INVALID_SHAPE, "num_tokens", "num_tokens > cfg.T");
  a.num_tokens = -1;
  bad += expect_fwd(&f, &a, MOK_STATUS_INVALID_SHAPE, "num_tokens", "num_tokens < 0");
  TEST_ASSERT(mok_forward(f.ctx, NULL) == MOK_STATUS_NULL_POINTER, "forward(ctx, NULL)");
  TEST_ASSERT(mok_backward(f.ctx, NULL) == MOK_STATUS_NULL_POINTER, "backward(ctx, NULL)");
  return bad;
}

static int forward_null(void) {
  int bad = 0;
  fix_t f;
  TEST_ASSERT(!fix_init(&f, MOK_ROUTING_FUSED, MOK_WGRAD_BF16), "fixture");
  mok_forward_args_t a;
#define RULE(field)          \
  (a = f.fa, a.field = NULL, \
   bad += expect_fwd(&f, &a, MOK_STATUS_NULL_POINTER, #field, #field " = NULL"))
  RULE(x);
  RULE(w_router);
  RULE(bias_select);
  RULE(w13);
  RULE(w2);
  RULE(ws13);
  RULE(ws2);
  RULE(y);
  RULE(saved);
  RULE(workspace);
  TEST_ASSERT(!fix_init(&f, MOK_ROUTING_REPLAY, MOK_WGRAD_BF16), "replay fixture");
  RULE(topk_idx);
  RULE(topk_weight);
#undef RULE
  return bad;
}

static int forward_misaligned(void) {
  int bad = 0;
  fix_t f;
  TEST_ASSERT(!fix_init(&f, MOK_ROUTING_FUSED, MOK_WGRAD_BF16), "fixture");
  const mok_status_t M = MOK_STATUS_MISALIGNED_POINTER;
  mok_forward_args_t a;
  a = f.fa, a.x = (const char*)f.x + 2;
  bad += expect_fwd(&f, &a, M, "x", "x + 2 bytes");
  a = f.fa, a.w13 = (const char*)f.w13 + 2;
  bad += expect_fwd(&f, &a, M, "w13", "w13 + 2 bytes");
  a = f.fa, a.y = (char*)f.y + 2;
  bad += expect_fwd(&f, &a, M, "y", "y + 2 bytes");
  a = f.fa, a.workspace = (char*)f.workspace + 16; /* 16- but not 256-byte aligned */
  bad += expect_fwd(&f, &a, M, "workspace", "workspace + 16 bytes");
  return bad;
}

static int forward_small_buffers(void) {
  int bad = 0;
  fix_t f;
  TEST_ASSERT(!fix_init(&f, MOK_ROUTING_FUSED, MOK_WGRAD_BF16), "fixture");
  const mok_status_t S = MOK_STATUS_WORKSPACE_TOO_SMALL;
  size_t fwd = 0, bwd = 0; /* (the CPU backend: one plan, so the same) */
  TEST_ASSERT(!mok_workspace_sizes(f.ctx, &fwd, &bwd) && fwd == f.ws_bytes && bwd == f.ws_bytes,
              "mok_workspace_sizes: %zu, %zu against mok_workspace_size's %zu", fwd, bwd, f.ws_bytes);
  mok_forward_args_t a = f.fa;
  a.workspace_bytes = f.ws_bytes - 1;
  bad += expect_fwd(&f, &a, S, "workspace", "workspace_bytes - 1");
  a = f.fa;
  a.saved_bytes = f.sv_bytes - 1;
  bad += expect_fwd(&f, &a, S, "saved", "saved_bytes - 1");
  return bad;
}

static int replay_indices(void) {
  int bad = 0;
  fix_t f;
  TEST_ASSERT(!fix_init(&f, MOK_ROUTING_REPLAY, MOK_WGRAD_BF16), "fixture");
  int32_t keep = f.topk_idx[5 * K_ + 1];
  f.topk_idx[5 * K_ + 1] = -1;
  bad += expect_fwd(&f, &f.fa, MOK_STATUS_INDEX_OUT_OF_RANGE, "topk_idx", "topk_idx = -1");
  f.topk_idx[5 * K_ + 1] = E_;
  bad += expect_fwd(&f, &f.fa, MOK_STATUS_INDEX_OUT_OF_RANGE, "topk_idx", "topk_idx = E");
  f.topk_idx[5 * K_ + 1] = f.topk_idx[5 * K_];
  bad += expect_fwd(&f, &f.fa, MOK_STATUS_DUPLICATE_INDEX, "topk_idx", "duplicate topk_idx");
  f.topk_idx[5 * K_ + 1] = keep;
  bad += good_forward(&f);
  return bad;
}

static int backward_null(void) {
  int bad = 0;
  fix_t f;
  TEST_ASSERT(!fix_init(&f, MOK_ROUTING_FUSED, MOK_WGRAD_BF16), "fixture");
  TEST_ASSERT(!good_forward(&f), "forward");
  mok_backward_args_t b;
#define RULE(field)          \
  (b = f.ba, b.field = NULL, \
   bad += expect_bwd(&f, &b, MOK_STATUS_NULL_POINTER, -1, #field, #field " = NULL"))
  RULE(x);
  RULE(dy);
  RULE(dx);
  RULE(saved);
  RULE(workspace);
#undef RULE
  return bad;
}

static int backward_buffers(void) {
  int bad = 0;
  fix_t f;
  TEST_ASSERT(!fix_init(&f, MOK_ROUTING_FUSED, MOK_WGRAD_BF16), "fixture");
  TEST_ASSERT(!good_forward(&f), "forward");
  mok_backward_args_t b = f.ba;
  b.saved_bytes = f.sv_bytes - 1;
  bad += expect_bwd(&f, &b, MOK_STATUS_WORKSPACE_TOO_SMALL, -1, "saved", "saved_bytes - 1");
  b = f.ba, b.workspace_bytes = f.ws_bytes - 1;
  bad += expect_bwd(&f, &b, MOK_STATUS_WORKSPACE_TOO_SMALL, -1, "workspace", "workspace_bytes - 1");
  b = f.ba, b.dy = (const char*)f.dy + 2;
  bad += expect_bwd(&f, &b, MOK_STATUS_MISALIGNED_POINTER, -1, "dy", "dy + 2 bytes");
  b = f.ba, b.num_tokens = T_ - 1; /* not the forward's T */
  bad += expect_bwd(&f, &b, MOK_STATUS_INVALID_SAVED, MOK_STATUS_INVALID_SHAPE, "num_tokens|saved",
                    "num_tokens != forward's");
  return bad;
}

static int backward_invalid_saved(void) {
  int bad = 0;
  fix_t f;
  TEST_ASSERT(!fix_init(&f, MOK_ROUTING_FUSED, MOK_WGRAD_BF16), "fixture");
  /* never written by a forward */
  bad += expect_bwd(&f, &f.ba, MOK_STATUS_INVALID_SAVED, -1, "saved", "zeroed saved");
  /* written by another context's forward */
  mok_context_t* other = test_context(&f.cfg, NULL);
  TEST_ASSERT(other, "second context");
  mok_status_t s = mok_forward(other, &f.fa);
  TEST_ASSERT(s == MOK_STATUS_SUCCESS, "forward on the second context: %s", mok_status_string(s));
  bad += expect_bwd(&f, &f.ba, MOK_STATUS_INVALID_SAVED, -1, "saved", "another context's saved");
  return bad;
}

static int invalid_context(void) {
  fix_t f;
  TEST_ASSERT(!fix_init(&f, MOK_ROUTING_FUSED, MOK_WGRAD_BF16), "fixture");
  TEST_ASSERT(!good_forward(&f), "forward");
  mok_context_t* dead = test_context(&f.cfg, NULL);
  TEST_ASSERT(dead, "second context");
  test_context_destroy(dead);
  mok_context_t* ctxs[2] = {NULL, dead};
  for (int i = 0; i < 2; i++) {
    const char* which = i ? "destroyed" : "NULL";
    size_t bytes = 12345;
    poison(f.fwd_out, f.num_fwd_out);
    poison(f.bwd_out, f.num_bwd_out);
    mok_status_t s = mok_forward(ctxs[i], &f.fa);
    TEST_ASSERT(s == MOK_STATUS_INVALID_CONTEXT, "forward(%s): %s", which, mok_status_string(s));
    s = mok_backward(ctxs[i], &f.ba);
    TEST_ASSERT(s == MOK_STATUS_INVALID_CONTEXT, "backward(%s): %s", which, mok_status_string(s));
    const char* t = touched(f.fwd_out, f.num_fwd_out);
    if (!t) t = touched(f.bwd_out, f.num_bwd_out);
    TEST_ASSERT(!t, "calls on a %s context changed %s", which, t);
    s = mok_workspace_size(ctxs[i], &bytes);
    TEST_ASSERT(s == MOK_STATUS_INVALID_CONTEXT && bytes == 12345, "workspace_size(%s): %s", which,
                mok_status_string(s));
    s = mok_saved_size(ctxs[i], &bytes);
    TEST_ASSERT(s == MOK_STATUS_INVALID_CONTEXT && bytes == 12345, "saved_size(%s): %s", which,
                mok_status_string(s));
    size_t fwd = 12345, bwd = 12345;
    s = mok_workspace_sizes(ctxs[i], &fwd, &bwd);
    TEST_ASSERT(s == MOK_STATUS_INVALID_CONTEXT && fwd == 12345 && bwd == 12345, "workspace_sizes(%s): %s", which,
                mok_status_string(s));
  }
  mok_status_t s = mok_context_destroy(dead);
  TEST_ASSERT(s == MOK_STATUS_INVALID_CONTEXT, "destroy twice: %s", mok_status_string(s));
  s = mok_workspace_size(f.ctx, NULL);
  TEST_ASSERT(s == MOK_STATUS_NULL_POINTER, "workspace_size(ctx, NULL): %s", mok_status_string(s));
  size_t bytes = 0;
  s = mok_workspace_sizes(f.ctx, NULL, &bytes);
  TEST_ASSERT(s == MOK_STATUS_NULL_POINTER && strstr(mok_context_last_error(f.ctx), "forward_bytes"),
              "workspace_sizes(ctx, NULL, ..): %s", mok_status_string(s));
  s = mok_workspace_sizes(f.ctx, &bytes, NULL);
  TEST_ASSERT(s == MOK_STATUS_NULL_POINTER && strstr(mok_context_last_error(f.ctx), "backward_bytes"),
              "workspace_sizes(ctx, .., NULL): %s", mok_status_string(s));
  /* the live context still works */
  TEST_ASSERT(!good_forward(&f), "forward on the live context after the failures");
  return 0;
}

/* T = 0 at W = 1: both calls succeed and give what an empty batch gives: zero expert
 * counts and losses, zero weight gradients (written in bf16, nothing added in fp32); y,
 * dx and saved are not touched. */
static int empty_batch(void) {
  for (int wgrad = 0; wgrad < 2; wgrad++)
    for (int replay = 0; replay < 2; replay++) {
      fix_t f;
      TEST_ASSERT(!fix_init(&f, replay, wgrad), "fixture");
      mok_forward_args_t a = f.fa;
      a.num_tokens = 0;
      mok_backward_args_t b = f.ba;
      b.num_tokens = 0;
      poison(f.fwd_out, f.num_fwd_out);
      poison(f.bwd_out, f.num_bwd_out);
      mok_status_t s = mok_forward(f.ctx, &a);
      TEST_ASSERT(s == MOK_STATUS_SUCCESS, "forward T = 0 (replay %d, wgrad %d): %s: %s", replay, wgrad,
                  mok_status_string(s), mok_context_last_error(f.ctx));
      s = mok_backward(f.ctx, &b);
      TEST_ASSERT(s == MOK_STATUS_SUCCESS, "backward T = 0 (replay %d, wgrad %d): %s: %s", replay, wgrad,
                  mok_status_string(s), mok_context_last_error(f.ctx));
      for (int i = 0; i < f.num_fwd_out; i++) {
        const buf_t* o = &f.fwd_out[i];
        const int zeroed = strcmp(o->name, "tokens_per_expert") == 0 || strcmp(o->name, "aux_loss") == 0 ||
                           strcmp(o->name, "z_loss") == 0;
        for (size_t k = 0; k < o->bytes; k++)
          TEST_ASSERT(((const uint8_t*)o->ptr)[k] == (zeroed ? 0 : POISON), "forward T = 0 (replay %d): %s[%zu] = %d",
                      replay, o->name, k, ((const uint8_t*)o->ptr)[k]);
      }
      for (int i = 0; i < f.num_bwd_out; i++) {
        const buf_t* o = &f.bwd_out[i];
        const int grad = strncmp(o->name, "d_w", 3) == 0 && !(replay && strcmp(o->name, "d_w_router") == 0) &&
                         !(strcmp(o->name, "d_w_sg") == 0 && !f.cfg.use_shared_gate); /* (a variant off: left) */
        const int zeroed = grad && wgrad == MOK_WGRAD_BF16;
        for (size_t k = 0; k < o->bytes; k++)
          TEST_ASSERT(((const uint8_t*)o->ptr)[k] == (zeroed ? 0 : POISON),
                      "backward T = 0 (replay %d, wgrad %d): %s[%zu] = %d", replay, wgrad, o->name, k,
                      ((const uint8_t*)o->ptr)[k]);
      }
    }
  return 0;
}

/* The variants' tensors (mok.h): each required one NULL, each misaligned; valid calls
 * with every variant on (bf16 and fp32 gradients) write each variant's gradient; their
 * empty batch zeroes the bf16 gradients (d_w_sg, d_b13, d_b2) and the fp32 d_b_router (written
 * whatever cfg.wgrad), adds nothing to fp32 accumulators. */
static int variant_arguments(void) {
  int bad = 0;
  fix_t f;
  TEST_ASSERT(!fix_init_with(&f, MOK_ROUTING_FUSED, MOK_WGRAD_BF16, 1), "fixture");
  mok_forward_args_t a;
  mok_backward_args_t b;
  const mok_status_t N = MOK_STATUS_NULL_POINTER, M = MOK_STATUS_MISALIGNED_POINTER;
#define FWD(field, value, status) \
  (a = f.fa, a.field = (value), bad += expect_fwd(&f, &a, status, #field, #field " = " #value))
#define BWD(field, value, status) \
  (b = f.ba, b.field = (value), bad += expect_bwd(&f, &b, status, -1, #field, #field " = " #value))
  FWD(b_router, NULL, N);
  FWD(b_router, (const float*)((const char*)f.b_router + 2), M);
  FWD(b13, NULL, N);
  FWD(b13, (const void*)((const char*)f.b13 + 2), M);
  FWD(b2, NULL, N);
  FWD(b2, (const void*)((const char*)f.b2 + 8), M);
  FWD(w_sg, NULL, N);
  FWD(w_sg, (const void*)((const char*)f.w_sg + 2), M);
  TEST_ASSERT(!good_forward(&f), "forward with every variant");
  BWD(d_b_router, (float*)((char*)f.d_b_router + 4), M);
  BWD(b13, NULL, N);
  BWD(b13, (const void*)((const char*)f.b13 + 2), M);
  BWD(d_b13, NULL, N);
  BWD(d_b13, (void*)((char*)f.d_b13 + 2), M);
  BWD(d_b2, NULL, N);
  BWD(d_b2, (void*)((char*)f.d_b2 + 8), M);
  BWD(w_sg, NULL, N);
  BWD(w_sg, (const void*)((const char*)f.w_sg + 4), M);
  BWD(d_w_sg, NULL, N);
  BWD(d_w_sg, (void*)((char*)f.d_w_sg + 2), M);
  b = f.ba, b.d_b_router = NULL; /* optional, as d_w_router */
  poison(f.bwd_out, f.num_bwd_out);
  mok_status_t s = mok_backward(f.ctx, &b);
  TEST_ASSERT(s == MOK_STATUS_SUCCESS, "backward without d_b_router: %s: %s", mok_status_string(s),
              mok_context_last_error(f.ctx));
#undef FWD
#undef BWD
  for (int wgrad = 0; wgrad < 2; wgrad++) {
    TEST_ASSERT(!fix_init_with(&f, MOK_ROUTING_FUSED, (mok_wgrad_t)wgrad, 1), "fixture (wgrad %d)", wgrad);
    TEST_ASSERT(!good_forward(&f), "forward (wgrad %d)", wgrad);
    poison(f.bwd_out, f.num_bwd_out);
    s = mok_backward(f.ctx, &f.ba);
    TEST_ASSERT(s == MOK_STATUS_SUCCESS, "backward (wgrad %d): %s: %s", wgrad, mok_status_string(s),
                mok_context_last_error(f.ctx));
    for (int i = f.num_bwd_out - 4; i < f.num_bwd_out; i++) /* d_w_sg, d_b13, d_b2, d_b_router */
      TEST_ASSERT(touched(f.bwd_out + i, 1), "%s not written (wgrad %d)", f.bwd_out[i].name, wgrad);
    b = f.ba, b.num_tokens = 0;
    a = f.fa, a.num_tokens = 0;
    poison(f.bwd_out, f.num_bwd_out);
    TEST_ASSERT(!mok_forward(f.ctx, &a) && !mok_backward(f.ctx, &b), "empty batch (wgrad %d)", wgrad);
    for (const buf_t* d = &f.bwd_out[f.num_bwd_out - 4]; d < f.bwd_out + f.num_bwd_out; d++)
      for (size_t k = 0; k < d->bytes; k++)
        TEST_ASSERT(((const uint8_t*)d->ptr)[k] == (wgrad == MOK_WGRAD_BF16 ? 0 : POISON),
                    "empty batch (wgrad %d): %s[%zu] = %d", wgrad, d->name, k, ((const uint8_t*)d->ptr)[k]);
  }
  return bad;
}

static int status_strings(void) {
  for (int i = 0; i < MOK_STATUS_COUNT_; i++) {
    const char* s = mok_status_string((mok_status_t)i);
    TEST_ASSERT(s && s[0], "status %d has no string", i);
    for (int j = 0; j < i; j++)
      TEST_ASSERT(strcmp(s, mok_status_string((mok_status_t)j)) != 0,
                  "statuses %d and %d share \"%s\"", j, i, s);
  }
  const int outside[] = {MOK_STATUS_COUNT_, -1, 1000};
  for (int i = 0; i < 3; i++) {
    const char* s = mok_status_string((mok_status_t)outside[i]);
    TEST_ASSERT(s && s[0], "out-of-range status %d has no string", outside[i]);
  }
  return 0;
}

static int version(void) {
  TEST_ASSERT(mok_version() == MOK_VERSION_CODE, "mok_version() = %d, header %d", mok_version(),
              MOK_VERSION_CODE);
  return 0;
}

/* mok_comm_unique_id: bad buffers get their status and a message naming the argument
 * and leave the buffer untouched; a good one gets an id where NCCL loads (the CPU is
 * enough for ncclGetUniqueId), or BACKEND_UNAVAILABLE with the reason. */
static int comm_unique_id(void) {
  unsigned char id[MOK_COMM_UNIQUE_ID_BYTES + 1];
  memset(id, 0xA5, sizeof id);
  mok_status_t s = mok_comm_unique_id(NULL, MOK_COMM_UNIQUE_ID_BYTES);
  TEST_ASSERT(s == MOK_STATUS_NULL_POINTER && strstr(mok_last_create_error(), "id "), "NULL id: %s, '%s'",
              mok_status_string(s), mok_last_create_error());
  s = mok_comm_unique_id(id, MOK_COMM_UNIQUE_ID_BYTES - 1);
  TEST_ASSERT(s == MOK_STATUS_INVALID_ARGUMENT && strstr(mok_last_create_error(), "MOK_COMM_UNIQUE_ID_BYTES"),
              "short id: %s, '%s'", mok_status_string(s), mok_last_create_error());
  for (size_t i = 0; i < sizeof id; i++) TEST_ASSERT(id[i] == 0xA5, "a rejected call wrote byte %zu", i);
  s = mok_comm_unique_id(id, sizeof id);
  if (s == MOK_STATUS_BACKEND_UNAVAILABLE) {
    printf("    no NCCL here: %s\n", mok_last_create_error());
    return 0;
  }
  TEST_ASSERT(s == MOK_STATUS_SUCCESS, "%s: %s", mok_status_string(s), mok_last_create_error());
  int changed = 0;
  for (size_t i = 0; i < MOK_COMM_UNIQUE_ID_BYTES; i++) changed += id[i] != 0xA5;
  TEST_ASSERT(changed > 0 && id[MOK_COMM_UNIQUE_ID_BYTES] == 0xA5, "id not written, or written past its 128 bytes");
  return 0;
}

const test_case_t suite_validation[] = {
    {"valid_calls", valid_calls},
    {"create_version", create_version},
    {"create_shape", create_shape},
    {"create_argument", create_argument},
    {"create_nonfinite", create_nonfinite},
    {"create_backend", create_backend},
    {"forward_shape", forward_shape},
    {"forward_null", forward_null},
    {"forward_misaligned", forward_misaligned},
    {"forward_small_buffers", forward_small_buffers},
    {"replay_indices", replay_indices},
    {"backward_null", backward_null},
    {"backward_buffers", backward_buffers},
    {"backward_invalid_saved", backward_invalid_saved},
    {"invalid_context", invalid_context},
    {"empty_batch", empty_batch},
    {"variant_arguments", variant_arguments},
    {"create_activation", create_activation},
    {"status_strings", status_strings},
    {"version", version},
    {"comm_unique_id", comm_unique_id},
    TEST_END,
};
