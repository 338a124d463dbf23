/* reference.c — the layer's forward (DESIGN.md section 1) written again, plainly, in
 * double, sharing no code with the library: the oracle that EXACT numerics is checked
 * against (the grad suite then checks backward against that forward). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runner.h"

static double silu(double v) { return v / (1.0 + exp(-v)); }

/* out[n] = sum_k w[n * k_len + k] * in[k] */
static void matvec(const double* w, const double* in, int64_t n_len, int64_t k_len, double* out) {
  for (int64_t n = 0; n < n_len; n++) {
    double acc = 0;
    for (int64_t k = 0; k < k_len; k++) acc += w[n * k_len + k] * in[k];
    out[n] = acc;
  }
}

/* o[H] = w2 · (silu(gate) * up) + b2, with gate|up = w13 · x + b13; w13 [2F, H], w2 [H, F],
 * the expert biases b13 [2F], b2 [H] or NULL; with clamp (the routed experts under
 * MOK_ACTIVATION_SWIGLU_CLAMPED) gpt-oss's h = (clamp(up, -l, l) + 1) * g * sigmoid(alpha
 * g), g = min(gate, l) */
static void swiglu(const mok_config_t* c, int clamp, const double* w13, const double* w2, const double* b13,
                   const double* b2, const double* x, int64_t H, int64_t F, double* a, double* h, double* o) {
  matvec(w13, x, 2 * F, H, a);
  if (b13)
    for (int64_t f = 0; f < 2 * F; f++) a[f] += b13[f];
  const double l = c->swiglu_limit, alpha = c->swiglu_alpha;
  for (int64_t f = 0; f < F; f++) {
    if (!clamp) {
      h[f] = silu(a[f]) * a[F + f];
      continue;
    }
    const double g = fmin(a[f], l), u = fmax(-l, fmin(a[F + f], l));
    h[f] = (u + 1.0) * g / (1.0 + exp(-alpha * g));
  }
  matvec(w2, h, H, F, o);
  if (b2)
    for (int64_t i = 0; i < H; i++) o[i] += b2[i];
}

/* v into sorted[0 .. n) (descending; n + 1 values after): one insertion sort step. */
static void insert_descending(double* sorted, int64_t n, double v) {
  int64_t at = n;
  while (at > 0 && sorted[at - 1] < v) sorted[at] = sorted[at - 1], at--;
  sorted[at] = v;
}

/* Group-limited routing (mok.h, cfg.n_group), directly. A group's score: the sum of
 * its two largest keys (or the largest), found by sorting the group's keys, largest
 * first. */
static void group_scores(const mok_config_t* c, const double* key, double* score) {
  const int64_t G = c->n_group, size = c->E / G;
  double sorted[1024];
  for (int64_t g = 0; g < G; g++) {
    for (int64_t i = 0; i < size; i++) insert_descending(sorted, i, key[g * size + i]);
    const int two = c->group_score == MOK_GROUP_SCORE_TOP2 && size >= 2;
    score[g] = two ? sorted[0] + sorted[1] : sorted[0];
  }
}

/* allowed[e] = 1 when expert e's group is kept: fewer than topk_group groups rank above
 * it (a larger score, or an equal one and a lower group index). */
static void group_filter(const mok_config_t* c, const double* key, int* allowed) {
  const int64_t G = c->n_group, size = c->E / G;
  double score[1024];
  group_scores(c, key, score);
  for (int64_t g = 0; g < G; g++) {
    int64_t above = 0;
    for (int64_t h = 0; h < G; h++) above += score[h] > score[g] || (score[h] == score[g] && h < g);
    for (int64_t i = 0; i < size; i++) allowed[g * size + i] = above < c->topk_group;
  }
}

/* Are the topk_group-th and the next group score within 1e-6 (n_group > 1)? */
static int group_cut_near_tie(const mok_config_t* c, const double* key) {
  if (c->n_group <= 1 || c->topk_group >= c->n_group) return 0;
  double score[1024], sorted[1024];
  group_scores(c, key, score);
  for (int64_t g = 0; g < c->n_group; g++) insert_descending(sorted, g, score[g]);
  return fabs(sorted[c->topk_group - 1] - sorted[c->topk_group]) <= 1e-6;
}

void test_reference_forward(const mok_problem_t* p, double* y, int32_t* topk_idx,
                            double* topk_weight, int32_t* tokens_per_expert, double* aux_loss,
                            double* z_loss, double* scores) {
  const mok_config_t* c = &p->cfg;
  const int64_t T = p->T_global, H = c->H, F = c->F, E = c->E, K = c->K, Fs = c->Fs;
  const double *x = p->x, *wr = p->w_router, *w13 = p->w13, *w2 = p->w2;
  const double* bias = p->bias_select;
  const int fused = c->routing == MOK_ROUTING_FUSED;
  const int64_t Fm = F > Fs ? F : Fs;
  double* s = calloc((size_t)(T * E + 3 * E + 3 * Fm + H), sizeof *s);
  double *logit = s + T * E, *P = logit + E, *a = P + E, *h = a + 2 * Fm, *o = h + Fm;
  double z = 0; /* s: scores [T, E]; P: score sums [E]; a, h, o: one SwiGLU */
  for (int64_t e = 0; e < E; e++) tokens_per_expert[e] = 0;
  for (int64_t t = 0; t < T; t++) {
    const double* xt = x + t * H;
    int32_t* idx = topk_idx + t * K;
    double* g = topk_weight + t * K;
    if (fused) {
      double* st = s + t * E;
      matvec(wr, xt, E, H, logit);
      if (c->use_router_bias) /* the router logit bias, before the scores */
        for (int64_t e = 0; e < E; e++) logit[e] += ((const double*)p->b_router)[e];
      double mx = -INFINITY, sum = 0;
      for (int64_t e = 0; e < E; e++) mx = fmax(mx, logit[e]);
      for (int64_t e = 0; e < E; e++) sum += exp(logit[e] - mx);
      double lse = mx + log(sum);
      z += lse * lse;
      for (int64_t e = 0; e < E; e++)
        st[e] = c->score == MOK_SCORE_SOFTMAX ? exp(logit[e] - lse) : 1.0 / (1.0 + exp(-logit[e]));
      /* top-K of score + bias among the allowed experts: largest first, ties to the
       * lower index */
      double key[1024];
      int allowed[1024];
      for (int64_t e = 0; e < E; e++) key[e] = st[e] + (c->use_bias_select ? bias[e] : 0.0), allowed[e] = 1;
      if (c->n_group > 1) group_filter(c, key, allowed);
      for (int64_t j = 0; j < K; j++) {
        int64_t best = -1;
        double best_key = 0;
        for (int64_t e = 0; e < E; e++) {
          int taken = !allowed[e];
          for (int64_t i = 0; i < j; i++) taken |= idx[i] == e;
          if (!taken && (best < 0 || key[e] > best_key)) best = e, best_key = key[e];
        }
        idx[j] = (int32_t)best;
        g[j] = st[best];
      }
      double gs = 0;
      for (int64_t j = 0; j < K; j++) gs += g[j];
      for (int64_t j = 0; j < K; j++) g[j] = (c->normalize ? g[j] / gs : g[j]) * c->route_scale;
      for (int64_t e = 0; e < E; e++) P[e] += st[e];
    } else {
      for (int64_t j = 0; j < K; j++) {
        idx[j] = p->topk_idx[t * K + j];
        g[j] = ((const double*)p->topk_weight)[t * K + j];
      }
    }
    double* yt = y + t * H;
    for (int64_t i = 0; i < H; i++) yt[i] = 0;
    for (int64_t j = 0; j < K; j++) {
      int64_t e = idx[j];
      tokens_per_expert[e]++;
      const int eb = c->use_expert_bias;
      swiglu(c, c->activation == MOK_ACTIVATION_SWIGLU_CLAMPED, w13 + e * 2 * F * H, w2 + e * H * F, eb ? (const double*)p->b13 + e * 2 * F : NULL,
             eb ? (const double*)p->b2 + e * H : NULL, xt, H, F, a, h, o);
      for (int64_t i = 0; i < H; i++) yt[i] += g[j] * o[i];
    }
    if (Fs) { /* with the gate (Qwen2-MoE): sigmoid(x · w_sg) times the shared output */
      swiglu(c, 0, p->ws13, p->ws2, NULL, NULL, xt, H, Fs, a, h, o);
      double gate = 1;
      if (c->use_shared_gate) {
        double l = 0;
        for (int64_t i = 0; i < H; i++) l += xt[i] * ((const double*)p->w_sg)[i];
        gate = 1.0 / (1.0 + exp(-l));
      }
      for (int64_t i = 0; i < H; i++) yt[i] += gate * o[i];
    }
  }
  double aux = 0;
  for (int64_t e = 0; e < E; e++)
    aux += (double)tokens_per_expert[e] / (double)(T * K) * (P[e] / (double)T);
  *aux_loss = fused && T ? c->aux_loss_coef * (double)E * aux : 0;
  *z_loss = fused && T ? c->z_loss_coef * z / (double)T : 0;
  if (scores) memcpy(scores, s, (size_t)(T * E) * sizeof *s);
  free(s);
}

int test_check_reference(const mok_problem_t* p) {
  const int64_t T = p->T_global, H = p->cfg.H, K = p->cfg.K, E = p->cfg.E;
  double* y = test_alloc((size_t)(T * H) * 8);
  double* w = test_alloc((size_t)(T * K) * 8);
  int32_t* idx = test_alloc((size_t)(T * K) * 4);
  int32_t* tpe = test_alloc((size_t)E * 4);
  double aux, z;
  test_reference_forward(p, y, idx, w, tpe, &aux, &z, NULL);
  int bad = 0;
  if (p->cfg.routing == MOK_ROUTING_FUSED) {
    for (int64_t i = 0; i < T * K && !bad; i++)
      if (p->out_topk_idx[i] != idx[i]) {
        printf("    topk_idx[%lld, %lld] = %d, reference %d\n", (long long)(i / K),
               (long long)(i % K), p->out_topk_idx[i], idx[i]);
        bad++;
      }
    if (bad) return bad;
  }
  for (int64_t e = 0; e < E; e++)
    if (p->tokens_per_expert[e] != tpe[e]) {
      printf("    tokens_per_expert[%lld] = %d, reference %d\n", (long long)e,
             p->tokens_per_expert[e], tpe[e]);
      return 1;
    }
  mok_tensor_view_t ry = {"y", y, T * H, 8, 2}, ly = {"y", p->y, T * H, 8, 2};
  mok_tensor_view_t rw = {"w", w, T * K, 8, 2}, lw = {"w", p->out_topk_weight, T * K, 8, 2};
  double ey = mok_relative_error(&ly, &ry);
  double ew = p->cfg.routing == MOK_ROUTING_FUSED ? mok_relative_error(&lw, &rw) : 0;
  double ea = fabs(*(double*)p->aux_loss - aux) / fmax(fabs(aux), 1e-300);
  double ez = fabs(*(double*)p->z_loss - z) / fmax(fabs(z), 1e-300);
  if (p->cfg.routing == MOK_ROUTING_REPLAY) ea = ez = 0;
  if (!(ey <= 1e-12)) printf("    y: relative error %.3g against the reference\n", ey), bad++;
  if (!(ew <= 1e-12)) printf("    topk_weight: relative error %.3g\n", ew), bad++;
  if (!(ea <= 1e-12 || (aux == 0 && *(double*)p->aux_loss == 0)))
    printf("    aux_loss %.17g, reference %.17g\n", *(double*)p->aux_loss, aux), bad++;
  if (!(ez <= 1e-12 || (z == 0 && *(double*)p->z_loss == 0)))
    printf("    z_loss %.17g, reference %.17g\n", *(double*)p->z_loss, z), bad++;
  return bad;
}

int test_same_routing_up_to_ties(const mok_problem_t* pb, const mok_problem_t* pe) {
  const int64_t T = pe->T_global, K = pe->cfg.K, E = pe->cfg.E;
  if (pe->cfg.routing != MOK_ROUTING_FUSED) return 1;
  double* s = test_alloc((size_t)(T * E) * 8);
  double* y = test_alloc((size_t)(T * pe->cfg.H) * 8);
  double* w = test_alloc((size_t)(T * K) * 8);
  int32_t* idx = test_alloc((size_t)(T * K) * 4);
  int32_t* tpe = test_alloc((size_t)E * 4);
  double aux, z;
  test_reference_forward(pe, y, idx, w, tpe, &aux, &z, s);
  const double* bias = pe->bias_select;
  for (int64_t t = 0; t < T; t++) {
    double key[1024];
    for (int64_t e = 0; e < E; e++) key[e] = s[t * E + e] + (pe->cfg.use_bias_select ? bias[e] : 0);
    /* with group-limited routing a near-tie between the last kept group's score and the
     * best dropped one's changes which experts compete at all: the token's whole top-K
     * may differ, keys far apart (comm.ep_router_w8, seed 1796398381365775538) */
    if (group_cut_near_tie(&pe->cfg, key)) continue;
    for (int64_t j = 0; j < K; j++) {
      int32_t a = pb->out_topk_idx[t * K + j], b = pe->out_topk_idx[t * K + j];
      if (a < 0 || a >= E) return 0;
      if (fabs(key[a] - key[b]) > 1e-6) return 0;
    }
  }
  return 1;
}
