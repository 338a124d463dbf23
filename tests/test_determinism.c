/* test_determinism.c — the determinism contract (DESIGN.md section 2), by bytes:
 *  D1  the same problem run again, and 5 steps on one set of contexts, give the same bits;
 *      so do 1, 2 and 3 threads per context;
 *  D3  one global batch (512 tokens: 64 per rank at W = 8, one MOK_REDUCE_CHUNK_TOKENS
 *      chunk) on W = 1, 2, 4, 8 gives the same y, dx, routing, counts, losses,
 *      d_topk_weight and every weight gradient, replicated ones included;
 *  D4  a token's forward alone equals its forward inside a batch, in any order and on
 *      any W, with the global aux loss on;
 *  and mok_reduce_tree is the balanced tree that mok.h describes. Also: recomputing
 *  gate|up in backward (MOK_GATE_UP_RECOMPUTE) gives the bits of keeping it.
 *  D1, threads, D3 and D4 run with group-limited routing too (*_grouped, ep_group_limited),
 *  and one group (n_group = 1) gives the bits of none; and with each router and expert
 *  variant of mok.h alone, then all of them at once (*_variants). */
#include <string.h>

#include "runner.h"

static mok_config_t layer(void) {
  mok_config_t c = MOK_CONFIG_INIT;
  c.H = 64, c.F = 32, c.E = 16, c.K = 4, c.Fs = 32;
  c.aux_loss_coef = 0.01f;
  c.z_loss_coef = 0.001f;
  c.use_bias_select = 1;
  return c;
}

static mok_run_opts_t opts(int W, int steps, int num_threads) {
  mok_run_opts_t o = MOK_RUN_OPTS_INIT;
  o.W = W;
  o.steps = steps;
  o.num_threads = num_threads;
  return o;
}

/* Group-limited routing (cfg.n_group): 4 groups of 4 experts, the best 2 kept, with
 * DeepSeek-V3's sigmoid scores and selection bias; at W = 8 a group spans two ranks. */
static mok_config_t grouped_layer(void) {
  mok_config_t c = layer();
  c.n_group = 4, c.topk_group = 2;
  c.score = MOK_SCORE_SIGMOID;
  c.route_scale = 2.5f;
  return c;
}

/* The router and expert variants (mok.h), each alone on the layer (v < NUM_VARIANTS),
 * then all at once (v = NUM_VARIANTS). */
enum { NUM_VARIANTS = 4 };
static const char* const kVariant[NUM_VARIANTS + 1] = {"use_router_bias", "use_expert_bias", "clamped SwiGLU",
                                                       "use_shared_gate", "all variants"};

static mok_config_t variant_layer(int v) {
  mok_config_t c = layer();
  if (v == 0 || v == NUM_VARIANTS) c.use_router_bias = 1;
  if (v == 1 || v == NUM_VARIANTS) c.use_expert_bias = 1;
  if (v == 2 || v == NUM_VARIANTS) /* (limit 0.25: clamps active) */
    c.activation = MOK_ACTIVATION_SWIGLU_CLAMPED, c.swiglu_alpha = 1.702f, c.swiglu_limit = 0.25f;
  if (v == 3 || v == NUM_VARIANTS) c.use_shared_gate = 1;
  return c;
}

static int run_to_run_of(const mok_config_t* layer_cfg);
static int thread_count_of(const mok_config_t* layer_cfg);
static int ep_invariance(const mok_config_t* c, int steps);
static int batch_invariance_of(const mok_config_t* layer_cfg);

/* Runs check on each variant's layer; names the variant of each failure. */
static int each_variant(int (*check)(const mok_config_t*)) {
  int bad = 0;
  for (int v = 0; v <= NUM_VARIANTS; v++) {
    const mok_config_t c = variant_layer(v);
    const int b = check(&c);
    if (b) printf("    (%s)\n", kVariant[v]);
    bad += b;
  }
  return bad;
}

static int ep_invariance_1(const mok_config_t* c) { return ep_invariance(c, 1); }
static int run_to_run_variants(void) { return each_variant(run_to_run_of); }
static int thread_count_variants(void) { return each_variant(thread_count_of); }
static int ep_variants(void) { return each_variant(ep_invariance_1); }
static int batch_invariance_variants(void) { return each_variant(batch_invariance_of); }

static int run_to_run_of(const mok_config_t* layer_cfg) {
  int bad = 0;
  const int Ws[] = {1, 2};
  for (int i = 0; i < 2; i++) {
    const mok_config_t c = *layer_cfg;
    mok_problem_t* p = test_problem(&c, 256, test_case_seed());
    TEST_ASSERT(p, "problem");
    test_outputs_t first, again, steps;
    mok_run_opts_t o = opts(Ws[i], 1, 1);
    TEST_ASSERT(!test_run(p, &o), "run 1");
    test_snapshot(p, 1, &first);
    TEST_ASSERT(!test_run(p, &o), "run 2");
    test_snapshot(p, 1, &again);
    o.steps = 5;
    TEST_ASSERT(!test_run(p, &o), "5 steps");
    test_snapshot(p, 1, &steps);
    char what[64];
    snprintf(what, sizeof what, "W = %d, second run", Ws[i]);
    bad += test_same_bits(&again, &first, NULL, what);
    snprintf(what, sizeof what, "W = %d, step 5 of 5", Ws[i]);
    bad += test_same_bits(&steps, &first, NULL, what);
  }
  return bad;
}

static int run_to_run(void) {
  const mok_config_t c = layer();
  return run_to_run_of(&c);
}

static int run_to_run_grouped(void) {
  const mok_config_t c = grouped_layer();
  return run_to_run_of(&c);
}

static int thread_count_of(const mok_config_t* layer_cfg) {
  int bad = 0;
  const mok_config_t c = *layer_cfg;
  mok_problem_t* p = test_problem(&c, 256, test_case_seed());
  TEST_ASSERT(p, "problem");
  test_outputs_t ref, out;
  mok_run_opts_t o = opts(1, 1, 1);
  TEST_ASSERT(!test_run(p, &o), "1 thread");
  test_snapshot(p, 1, &ref);
  const int cases[][2] = {{1, 2}, {1, 3}, {2, 1}, {2, 3}}; /* {W, threads per context} */
  for (int i = 0; i < 4; i++) {
    o = opts(cases[i][0], 1, cases[i][1]);
    TEST_ASSERT(!test_run(p, &o), "W = %d, %d threads", cases[i][0], cases[i][1]);
    test_snapshot(p, 1, &out);
    char what[64];
    snprintf(what, sizeof what, "W = %d, %d threads", cases[i][0], cases[i][1]);
    bad += test_same_bits(&out, &ref, NULL, what);
  }
  return bad;
}

static int thread_count(void) {
  const mok_config_t c = layer();
  return thread_count_of(&c);
}

static int thread_count_grouped(void) {
  const mok_config_t c = grouped_layer();
  return thread_count_of(&c);
}

/* D3: the same global batch on W = 1, 2, 4, 8; every output the config has. */
static int ep_invariance(const mok_config_t* c, int steps) {
  mok_problem_t* p = test_problem(c, 512, test_case_seed());
  TEST_ASSERT(p, "problem");
  test_outputs_t ref, out;
  mok_run_opts_t o = opts(1, steps, 1);
  TEST_ASSERT(!test_run(p, &o), "W = 1");
  test_snapshot(p, 1, &ref);
  int bad = 0;
  for (int W = 2; W <= 8; W *= 2) {
    o = opts(W, steps, 1);
    TEST_ASSERT(!test_run(p, &o), "W = %d", W);
    test_snapshot(p, 1, &out);
    char what[32];
    snprintf(what, sizeof what, "W = %d vs W = 1", W);
    bad += test_same_bits(&out, &ref, NULL, what);
  }
  return bad;
}

static int ep_softmax(void) {
  mok_config_t c = layer();
  c.use_bias_select = 0;
  return ep_invariance(&c, 1);
}

static int ep_sigmoid_bias(void) {
  mok_config_t c = layer();
  c.score = MOK_SCORE_SIGMOID;
  c.normalize = 0;
  c.route_scale = 2.0f;
  c.Fs = 0;
  return ep_invariance(&c, 1);
}

static int ep_group_limited(void) {
  const mok_config_t c = grouped_layer();
  int bad = ep_invariance(&c, 1);
  mok_config_t v2 = grouped_layer(); /* DeepSeek-V2's form: softmax, a group's largest key */
  v2.score = MOK_SCORE_SOFTMAX, v2.use_bias_select = 0, v2.group_score = MOK_GROUP_SCORE_MAX, v2.topk_group = 3;
  return bad + ep_invariance(&v2, 1);
}

/* n_group = 1 (topk_group 1) is the routing without groups: the same bits. */
static int one_group(void) {
  mok_config_t c = layer(), g = layer();
  g.n_group = g.topk_group = 1;
  mok_problem_t* pc = test_problem(&c, 256, test_case_seed());
  mok_problem_t* pg = test_problem(&g, 256, test_case_seed());
  TEST_ASSERT(pc && pg, "problems");
  test_outputs_t a, b;
  mok_run_opts_t o = opts(2, 1, 1);
  TEST_ASSERT(!test_run(pc, &o) && !test_run(pg, &o), "runs");
  test_snapshot(pc, 1, &a);
  test_snapshot(pg, 1, &b);
  return test_same_bits(&b, &a, NULL, "n_group = 1 vs 0");
}

static int ep_replay(void) {
  mok_config_t c = layer();
  c.routing = MOK_ROUTING_REPLAY;
  return ep_invariance(&c, 1);
}

static int ep_fp32_accum(void) {
  mok_config_t c = layer();
  c.wgrad = MOK_WGRAD_FP32_ACCUM;
  return ep_invariance(&c, 2);
}

/* MOK_GATE_UP_RECOMPUTE against MOK_GATE_UP_SAVE on one problem: every output and
 * gradient the same bits, at W = 1, 2 and 4, bf16 and exact numerics; saved smaller and the
 * workspace larger by the four gate|up pieces. */
static size_t aligned(int64_t bytes) { return (size_t)(bytes + 255) / 256 * 256; } /* (plan.c's pieces) */

static int gate_up_sizes(const mok_config_t* save, const mok_config_t* redo) {
  mok_context_t *cs = test_context(save, NULL), *cr = test_context(redo, NULL);
  TEST_ASSERT(cs && cr, "contexts");
  size_t saved[2], ws[2];
  TEST_ASSERT(!mok_saved_size(cs, &saved[0]) && !mok_saved_size(cr, &saved[1]), "mok_saved_size");
  TEST_ASSERT(!mok_workspace_size(cs, &ws[0]) && !mok_workspace_size(cr, &ws[1]), "mok_workspace_size");
  const int64_t act = save->numerics == MOK_NUMERICS_EXACT ? 8 : 2;
  const int64_t rows = save->capacity, T = save->T, F = save->F, Fs = save->Fs;
  const size_t pieces = aligned(rows * 2 * F * act) + aligned(rows * F * act) +
                        aligned(T * 2 * Fs * act) + aligned(T * Fs * act);
  TEST_ASSERT(saved[0] - saved[1] == pieces, "saved: %zu keeping, %zu recomputing: %zu less, want %zu",
              saved[0], saved[1], saved[0] - saved[1], pieces);
  TEST_ASSERT(ws[1] - ws[0] == pieces, "workspace: %zu keeping, %zu recomputing: %zu more, want %zu",
              ws[0], ws[1], ws[1] - ws[0], pieces);
  return 0;
}

static int gate_up_recompute(void) {
  int bad = 0;
  for (int i = 0; i < 4; i++) {
    mok_config_t c = layer();
    if (i == 1) c.routing = MOK_ROUTING_REPLAY, c.wgrad = MOK_WGRAD_FP32_ACCUM;
    if (i == 2) c.numerics = MOK_NUMERICS_EXACT;
    if (i == 3) c = variant_layer(NUM_VARIANTS); /* (recomputed with the variants' rules) */
    mok_config_t r = c;
    r.gate_up = MOK_GATE_UP_RECOMPUTE;
    mok_problem_t* ps = test_problem(&c, 256, test_case_seed());
    mok_problem_t* pr = test_problem(&r, 256, test_case_seed());
    TEST_ASSERT(ps && pr, "problems");
    for (int W = 1; W <= 4; W *= 2) {
      test_outputs_t keep, redo;
      mok_run_opts_t o = opts(W, 2, 1);
      TEST_ASSERT(!test_run(ps, &o), "config %d, W = %d, keeping gate|up", i, W);
      test_snapshot(ps, 1, &keep);
      TEST_ASSERT(!test_run(pr, &o), "config %d, W = %d, recomputing gate|up", i, W);
      test_snapshot(pr, 1, &redo);
      char what[64];
      snprintf(what, sizeof what, "config %d, W = %d, recompute vs keep", i, W);
      bad += test_same_bits(&redo, &keep, NULL, what);
    }
    c.T = 256, c.capacity = 256 * c.K;
    r.T = c.T, r.capacity = c.capacity;
    bad += gate_up_sizes(&c, &r);
  }
  return bad;
}

/* cfg.saved_use = MOK_SAVED_REUSE against MOK_SAVED_KEEP: the same bits, and saved used
 * up: a second backward on it returns MOK_STATUS_INVALID_SAVED with a message naming the
 * rule, every output as the steps left it; kept, the second backward runs (and, with
 * bf16 gradients written, writes the same bits again). */
static int saved_reuse(void) {
  mok_config_t c = layer();
  mok_config_t r = c;
  r.saved_use = MOK_SAVED_REUSE;
  mok_problem_t* pk = test_problem(&c, 256, test_case_seed());
  mok_problem_t* pr = test_problem(&r, 256, test_case_seed());
  TEST_ASSERT(pk && pr, "problems");
  test_outputs_t keep, reuse, after;
  mok_run_opts_t o = opts(1, 2, 1);
  TEST_ASSERT(!test_run(pk, &o), "keeping saved");
  test_snapshot(pk, 1, &keep);
  TEST_ASSERT(!test_run(pr, &o), "reusing saved");
  test_snapshot(pr, 1, &reuse);
  int bad = test_same_bits(&reuse, &keep, NULL, "reuse vs keep") != 0;
  o.backward_again = 1;
  char err[512] = "";
  mok_status_t s = mok_problem_run(pr, &o, err, sizeof err);
  printf("    a second backward on used-up saved: %s: %s\n", mok_status_string(s), err);
  TEST_ASSERT(s == MOK_STATUS_INVALID_SAVED && strstr(err, "used up"), "want MOK_STATUS_INVALID_SAVED, used up");
  test_snapshot(pr, 1, &after);
  bad += test_same_bits(&after, &keep, NULL, "outputs after the refused backward") != 0;
  TEST_ASSERT(!mok_problem_run(pk, &o, err, sizeof err), "kept saved: a second backward: %s", err);
  test_snapshot(pk, 1, &after);
  bad += test_same_bits(&after, &keep, NULL, "kept: after the second backward") != 0;
  return bad;
}

/* The forward of token t alone (T_global = 1, on W = 1 and on W = 2 where rank 1 has no
 * token) equals row t of the batch's forward; so does every row of the batch reversed
 * and run on W = 2. */
static int batch_invariance_of(const mok_config_t* layer_cfg) {
  const mok_config_t c = *layer_cfg;
  const int64_t T = 64, H = c.H, K = c.K;
  mok_problem_t* p = test_problem(&c, T, test_case_seed());
  mok_problem_t* rev = test_problem(&c, T, test_case_seed());
  mok_problem_t* one = test_problem(&c, 1, test_case_seed() + 1);
  TEST_ASSERT(p && rev && one, "problems");
  mok_run_opts_t o = opts(1, 1, 1);
  o.backward = 0;
  TEST_ASSERT(!test_run(p, &o), "batch");
  /* weights of p in `one` and `rev`; the tokens of p reversed in `rev` */
  mok_problem_copy_weights(one, p);
  mok_problem_copy_weights(rev, p);
  const size_t row = (size_t)H * 2;
  for (int64_t t = 0; t < T; t++)
    memcpy((char*)rev->x + t * row, (char*)p->x + (T - 1 - t) * row, row);
  o.W = 2;
  TEST_ASSERT(!test_run(rev, &o), "reversed batch on W = 2");
  for (int64_t t = 0; t < T; t++) {
    int64_t r = T - 1 - t;
    TEST_ASSERT(memcmp((char*)rev->y + r * row, (char*)p->y + t * row, row) == 0 &&
                    memcmp(rev->out_topk_idx + r * K, p->out_topk_idx + t * K, K * 4) == 0 &&
                    memcmp((float*)rev->out_topk_weight + r * K, (float*)p->out_topk_weight + t * K,
                           K * 4) == 0,
                "token %lld: forward in the reversed batch on W = 2 differs", (long long)t);
  }
  uint64_t rng = test_case_seed();
  for (int n = 0; n < 4; n++) {
    int64_t t = (int64_t)(test_next(&rng) % (uint64_t)T);
    memcpy(one->x, (char*)p->x + t * row, row);
    for (int W = 1; W <= 2; W++) {
      o.W = W;
      memset(one->y, 0xA5, row);
      TEST_ASSERT(!test_run(one, &o), "token %lld alone on W = %d", (long long)t, W);
      for (int64_t h = 0; h < H; h++) {
        uint16_t a = ((uint16_t*)one->y)[h], b = ((uint16_t*)p->y)[t * H + h];
        TEST_ASSERT(a == b, "token %lld alone on W = %d: y[%lld] = 0x%04x, in the batch 0x%04x",
                    (long long)t, W, (long long)h, a, b);
      }
      TEST_ASSERT(memcmp(one->out_topk_idx, p->out_topk_idx + t * K, K * 4) == 0 &&
                      memcmp(one->out_topk_weight, (float*)p->out_topk_weight + t * K, K * 4) == 0,
                  "token %lld alone on W = %d: routing differs", (long long)t, W);
    }
  }
  return 0;
}

static int batch_invariance(void) {
  const mok_config_t c = layer();
  return batch_invariance_of(&c);
}

static int batch_invariance_grouped(void) {
  const mok_config_t c = grouped_layer();
  return batch_invariance_of(&c);
}

/* The tree of mok.h: node [lo, hi) = node [lo, mid) + node [mid, hi), mid = lo + the
 * largest power of two below hi - lo. */
static float tree(const float* partials, int64_t n, int64_t lo, int64_t hi, int64_t i) {
  if (hi - lo == 1) return partials[lo * n + i];
  int64_t half = 1;
  while (2 * half < hi - lo) half *= 2;
  int64_t mid = lo + half;
  float a = tree(partials, n, lo, mid, i), b = tree(partials, n, mid, hi, i);
  return a + b;
}

static int reduce_tree(void) {
  enum { N = 33, MAX_CHUNKS = 40 };
  float* partials = test_alloc(MAX_CHUNKS * N * 4);
  float* out = test_alloc(N * 4);
  uint64_t rng = test_case_seed();
  for (int i = 0; i < MAX_CHUNKS * N; i++) /* wide exponents: the order shows in the bits */
    partials[i] = (float)((double)(int64_t)test_next(&rng) * 0x1.0p-63 *
                          (double)(1u << (test_next(&rng) % 24)));
  const int64_t counts[] = {1, 2, 3, 5, 7, 8, 13, 16, 31, 40};
  for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
    mok_status_t s = mok_reduce_tree(partials, counts[c], N, out);
    TEST_ASSERT(s == MOK_STATUS_SUCCESS, "reduce_tree(%lld chunks): %s", (long long)counts[c],
                mok_status_string(s));
    for (int64_t i = 0; i < N; i++) {
      float want = tree(partials, N, 0, counts[c], i);
      TEST_ASSERT(memcmp(&out[i], &want, 4) == 0, "%lld chunks: out[%lld] = %.9g, tree %.9g",
                  (long long)counts[c], (long long)i, out[i], want);
    }
  }
  TEST_ASSERT(mok_reduce_tree(NULL, 4, N, out) == MOK_STATUS_NULL_POINTER, "NULL partials");
  TEST_ASSERT(mok_reduce_tree(partials, 4, N, NULL) == MOK_STATUS_NULL_POINTER, "NULL out");
  return 0;
}

const test_case_t suite_determinism[] = {
    {"run_to_run", run_to_run},
    {"run_to_run_grouped", run_to_run_grouped},
    {"run_to_run_variants", run_to_run_variants},
    {"thread_count", thread_count},
    {"thread_count_grouped", thread_count_grouped},
    {"thread_count_variants", thread_count_variants},
    {"ep_softmax", ep_softmax},
    {"ep_sigmoid_bias", ep_sigmoid_bias},
    {"ep_group_limited", ep_group_limited},
    {"ep_variants", ep_variants},
    {"one_group", one_group},
    {"ep_replay", ep_replay},
    {"ep_fp32_accum", ep_fp32_accum},
    {"gate_up_recompute", gate_up_recompute},
    {"saved_reuse", saved_reuse},
    {"batch_invariance", batch_invariance},
    {"batch_invariance_grouped", batch_invariance_grouped},
    {"batch_invariance_variants", batch_invariance_variants},
    {"reduce_tree", reduce_tree},
    TEST_END,
};
