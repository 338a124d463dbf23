/* problem.c — random problems, their runs on W CPU ranks or on GPUs, and the host memory
 * the runs take (see problem.h). */
#define _POSIX_C_SOURCE 200809L
#include "problem.h"

#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu/gemm.h"

static uint64_t splitmix(uint64_t* s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static double uniform(uint64_t* s) { return (double)(splitmix(s) >> 11) * 0x1.0p-53 * 2.0 - 1.0; }

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static double from_bf16(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* What alloc0 takes for a buffer of `bytes`: a whole number of 256-byte lines, one at least. */
static size_t alloc_bytes(size_t bytes) { return bytes ? (bytes + 255) / 256 * 256 : 256; }

static void* alloc0(size_t bytes) {
  const size_t n = alloc_bytes(bytes);
  void* p = aligned_alloc(256, n);
  if (p) memset(p, 0, n);
  return p;
}

/* Fills an act tensor with U(-scale, scale); in bf16 the values are bf16-exact. */
static void fill_act(const mok_problem_t* p, void* dst, int64_t n, double scale, uint64_t* s) {
  for (int64_t i = 0; i < n; i++) {
    double v = uniform(s) * scale;
    if (p->act == 2)
      ((uint16_t*)dst)[i] = to_bf16((float)v);
    else
      ((double*)dst)[i] = from_bf16(to_bf16((float)v)); /* same values as bf16 mode */
  }
}
static void set_real(const mok_problem_t* p, void* dst, int64_t i, double v) {
  if (p->real == 4)
    ((float*)dst)[i] = (float)v;
  else
    ((double*)dst)[i] = v;
}

void mok_problem_destroy(mok_problem_t* p) {
  if (!p) return;
  void* bufs[] = {p->x, p->w_router, p->bias_select, p->b_router, p->w13, p->w2, p->ws13, p->ws2, p->dy,
                  p->topk_idx, p->topk_weight, p->d_aux_loss, p->d_z_loss, p->y, p->dx,
                  p->out_topk_idx, p->out_topk_weight, p->d_topk_weight, p->tokens_per_expert,
                  p->aux_loss, p->z_loss, p->d_w_router, p->d_b_router, p->d_w13, p->d_w2, p->d_ws13,
                  p->d_ws2, p->b13, p->b2, p->d_b13, p->d_b2, p->w_sg, p->d_w_sg};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
  free(p);
}

/* The problem's fields that follow from the config alone (no buffer). */
static void problem_init(mok_problem_t* p, const mok_config_t* cfg, int64_t T_global, uint64_t seed) {
  p->cfg = *cfg;
  p->T_global = T_global;
  p->seed = seed;
  int exact = cfg->numerics == MOK_NUMERICS_EXACT;
  p->act = exact ? 8 : 2;
  p->real = exact ? 8 : 4;
  p->wgrad_elem = exact ? 8 : cfg->wgrad == MOK_WGRAD_FP32_ACCUM ? 4 : 2;
}

/* The problem's buffers, in mok_problem_t's order, and the bytes of each: what
 * mok_problem_create allocates and mok_problem_host_bytes counts. */
enum { PB_X, PB_W_ROUTER, PB_BIAS, PB_B_ROUTER, PB_W13, PB_W2, PB_WS13, PB_WS2, PB_DY, PB_IDX, PB_TW,
       PB_DAUX, PB_DZ, PB_Y, PB_DX, PB_OUT_IDX, PB_OUT_TW, PB_DTW, PB_TPE, PB_AUX, PB_Z, PB_DWR, PB_DBR,
       PB_DW13, PB_DW2, PB_DWS13, PB_DWS2, PB_B13, PB_B2, PB_DB13, PB_DB2, PB_WSG, PB_DWSG,
       NUM_PROBLEM_BUFFERS };

static void problem_buffer_sizes(const mok_problem_t* p, size_t n[NUM_PROBLEM_BUFFERS]) {
  const mok_config_t* c = &p->cfg;
  const int64_t T = p->T_global, H = c->H, F = c->F, E = c->E, K = c->K, Fs = c->Fs;
  const size_t a = p->act, r = p->real, w = p->wgrad_elem;
  n[PB_X] = T * H * a;
  n[PB_W_ROUTER] = E * H * a;
  n[PB_BIAS] = E * r;
  n[PB_B_ROUTER] = E * r;
  n[PB_W13] = E * 2 * F * H * a;
  n[PB_W2] = E * H * F * a;
  n[PB_WS13] = 2 * Fs * H * a;
  n[PB_WS2] = H * Fs * a;
  n[PB_DY] = T * H * a;
  n[PB_IDX] = T * K * 4;
  n[PB_TW] = T * K * r;
  n[PB_DAUX] = r;
  n[PB_DZ] = r;
  n[PB_Y] = T * H * a;
  n[PB_DX] = T * H * a;
  n[PB_OUT_IDX] = T * K * 4;
  n[PB_OUT_TW] = T * K * r;
  n[PB_DTW] = T * K * r;
  n[PB_TPE] = E * 4;
  n[PB_AUX] = r;
  n[PB_Z] = r;
  n[PB_DWR] = E * H * w;
  n[PB_DBR] = E * r;
  n[PB_DW13] = E * 2 * F * H * w;
  n[PB_DW2] = E * H * F * w;
  n[PB_DWS13] = 2 * Fs * H * w;
  n[PB_DWS2] = H * Fs * w;
  n[PB_B13] = E * 2 * F * a;
  n[PB_B2] = E * H * a;
  n[PB_DB13] = E * 2 * F * w;
  n[PB_DB2] = E * H * w;
  n[PB_WSG] = H * a;
  n[PB_DWSG] = H * w;
}

mok_status_t mok_problem_create(const mok_config_t* cfg, int64_t T_global, uint64_t seed,
                                mok_problem_t** out) {
  *out = NULL;
  mok_problem_t* p = calloc(1, sizeof *p);
  if (!p) return MOK_STATUS_OUT_OF_MEMORY;
  problem_init(p, cfg, T_global, seed);
  const int64_t T = T_global, H = cfg->H, F = cfg->F, E = cfg->E, K = cfg->K, Fs = cfg->Fs;
  size_t n[NUM_PROBLEM_BUFFERS];
  problem_buffer_sizes(p, n);
  p->x = alloc0(n[PB_X]);
  p->w_router = alloc0(n[PB_W_ROUTER]);
  p->bias_select = alloc0(n[PB_BIAS]);
  p->b_router = alloc0(n[PB_B_ROUTER]);
  p->w13 = alloc0(n[PB_W13]);
  p->w2 = alloc0(n[PB_W2]);
  p->ws13 = alloc0(n[PB_WS13]);
  p->ws2 = alloc0(n[PB_WS2]);
  p->dy = alloc0(n[PB_DY]);
  p->topk_idx = alloc0(n[PB_IDX]);
  p->topk_weight = alloc0(n[PB_TW]);
  p->d_aux_loss = alloc0(n[PB_DAUX]);
  p->d_z_loss = alloc0(n[PB_DZ]);
  p->y = alloc0(n[PB_Y]);
  p->dx = alloc0(n[PB_DX]);
  p->out_topk_idx = alloc0(n[PB_OUT_IDX]);
  p->out_topk_weight = alloc0(n[PB_OUT_TW]);
  p->d_topk_weight = alloc0(n[PB_DTW]);
  p->tokens_per_expert = alloc0(n[PB_TPE]);
  p->aux_loss = alloc0(n[PB_AUX]);
  p->z_loss = alloc0(n[PB_Z]);
  p->d_w_router = alloc0(n[PB_DWR]);
  p->d_b_router = alloc0(n[PB_DBR]);
  p->d_w13 = alloc0(n[PB_DW13]);
  p->d_w2 = alloc0(n[PB_DW2]);
  p->d_ws13 = alloc0(n[PB_DWS13]);
  p->d_ws2 = alloc0(n[PB_DWS2]);
  p->b13 = alloc0(n[PB_B13]);
  p->b2 = alloc0(n[PB_B2]);
  p->d_b13 = alloc0(n[PB_DB13]);
  p->d_b2 = alloc0(n[PB_DB2]);
  p->w_sg = alloc0(n[PB_WSG]);
  p->d_w_sg = alloc0(n[PB_DWSG]);
  if (!p->b13 || !p->b2 || !p->d_b13 || !p->d_b2 || !p->w_sg || !p->d_w_sg || !p->x || !p->w13 || !p->w2 || !p->dy || !p->y || !p->dx || !p->d_w13 || !p->d_w2 ||
      !p->ws13 || !p->ws2 || !p->d_ws13 || !p->d_ws2 || !p->d_w_router || !p->topk_idx || !p->b_router ||
      !p->d_b_router) {
    mok_problem_destroy(p);
    return MOK_STATUS_OUT_OF_MEMORY;
  }
  uint64_t s = seed;
  fill_act(p, p->x, T * H, 1.0, &s);
  fill_act(p, p->w_router, E * H, 1.0 / sqrt((double)H), &s);
  fill_act(p, p->w13, E * 2 * F * H, 1.0 / sqrt((double)H), &s);
  fill_act(p, p->w2, E * H * F, 1.0 / sqrt((double)F), &s);
  fill_act(p, p->ws13, 2 * Fs * H, 1.0 / sqrt((double)H), &s);
  fill_act(p, p->ws2, H * Fs, 1.0 / sqrt((double)(Fs ? Fs : 1)), &s);
  fill_act(p, p->dy, T * H, 1.0, &s);
  for (int64_t e = 0; e < E; e++) set_real(p, p->bias_select, e, 0.01 * uniform(&s));
  int32_t* perm = malloc(E * sizeof *perm);
  for (int64_t t = 0; t < T; t++) { /* K distinct experts per token, random weights */
    for (int64_t e = 0; e < E; e++) perm[e] = (int32_t)e;
    for (int64_t j = 0; j < K; j++) {
      int64_t pick = j + (int64_t)(splitmix(&s) % (uint64_t)(E - j));
      int32_t tmp = perm[j];
      perm[j] = perm[pick];
      perm[pick] = tmp;
      p->topk_idx[t * K + j] = perm[j];
      set_real(p, p->topk_weight, t * K + j, 0.5 + 0.5 * uniform(&s));
    }
  }
  free(perm);
  set_real(p, p->d_aux_loss, 0, 1.0 + 0.25 * uniform(&s));
  set_real(p, p->d_z_loss, 0, 1.0 + 0.25 * uniform(&s));
  /* the variants' tensors last, so that the draws above do not depend on them */
  for (int64_t e = 0; e < E; e++) set_real(p, p->b_router, e, 0.5 * uniform(&s));
  fill_act(p, p->b13, E * 2 * F, 0.5, &s);
  fill_act(p, p->b2, E * H, 0.5, &s);
  fill_act(p, p->w_sg, H, 2.0 / sqrt((double)H), &s);
  *out = p;
  return MOK_STATUS_SUCCESS;
}

void mok_problem_copy_weights(mok_problem_t* dst, const mok_problem_t* src) {
  size_t n[NUM_PROBLEM_BUFFERS];
  problem_buffer_sizes(src, n);
  static const int weights[] = {PB_W_ROUTER, PB_BIAS, PB_B_ROUTER, PB_W13, PB_W2, PB_WS13, PB_WS2, PB_B13, PB_B2, PB_WSG};
  void* const from[] = {src->w_router, src->bias_select, src->b_router, src->w13, src->w2, src->ws13, src->ws2,
                        src->b13, src->b2, src->w_sg};
  void* const to[] = {dst->w_router, dst->bias_select, dst->b_router, dst->w13, dst->w2, dst->ws13, dst->ws2,
                      dst->b13, dst->b2, dst->w_sg};
  for (size_t i = 0; i < sizeof weights / sizeof weights[0]; i++) memcpy(to[i], from[i], n[weights[i]]);
}

/* ---- running on W ranks ---- */

typedef struct {
  mok_problem_t* p;
  const mok_run_opts_t* o;
  mok_cpu_comm_t* comm;
  int rank;
  int64_t t0, T;          /* this rank's tokens [t0, t0 + T) */
  mok_status_t status;
  char err[512];
  double fwd_s, bwd_s;
} rank_job_t;

/* Rank r's share of the global batch (CPU and CUDA runs alike): o->rank_T[r], or the
 * first T % W ranks one token more; rank r's tokens follow those of ranks < r. */
static int64_t rank_tokens(int64_t T_global, const mok_run_opts_t* o, int r) {
  if (o->rank_T && o->W > 1) return o->rank_T[r];
  return T_global / o->W + (r < T_global % o->W ? 1 : 0);
}
/* Whether o->rank_T (when given) splits T_global: W counts >= 0 summing to it. */
static int split_ok(int64_t T_global, const mok_run_opts_t* o, char* err, size_t err_len) {
  if (!o->rank_T || o->W == 1) return 1;
  int64_t sum = 0;
  for (int r = 0; r < o->W; r++) {
    if (o->rank_T[r] < 0) break;
    sum += o->rank_T[r];
  }
  if (sum == T_global) return 1;
  if (err) snprintf(err, err_len, "rank_T: %d counts >= 0 summing to T_global = %lld", o->W, (long long)T_global);
  return 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void* dup_slice(const void* src, size_t offset, size_t bytes) {
  void* d = alloc0(bytes);
  if (d && bytes) memcpy(d, (const char*)src + offset, bytes);
  return d;
}

#define RANK_FAIL(job, st, ...)                                 \
  do {                                                          \
    (job)->status = (st);                                       \
    snprintf((job)->err, sizeof (job)->err, __VA_ARGS__);       \
    goto done;                                                  \
  } while (0)

/* A rank's config: the problem's layer with the rank's T, W, rank, communicator and
 * the run's options (rank_main and run_bytes_probe alike). */
static mok_config_t rank_config(const mok_config_t* c, const mok_run_opts_t* o, int rank, int64_t T,
                                mok_cpu_comm_t* comm) {
  mok_config_t cfg = *c;
  cfg.T = T;
  cfg.W = o->W;
  cfg.rank = rank;
  cfg.cpu_comm = o->W > 1 ? comm : NULL;
  cfg.capacity = o->capacity;
  cfg.num_threads = o->num_threads;
  if (o->comm_timeout_s > 0) cfg.comm_timeout_s = o->comm_timeout_s;
  return cfg;
}

/* A rank's own buffers (rank_main) and the bytes of each: its slices of the inputs, its
 * outputs, saved, the forward's and the backward's workspaces, its experts' weight
 * gradients and whole replicated ones. mok_problem_run_bytes counts the same. */
enum { RB_X, RB_W13, RB_W2, RB_DY, RB_IDX, RB_TW, RB_Y, RB_DX, RB_DTW, RB_SAVED, RB_WS, RB_WS_BWD,
       RB_DW13, RB_DW2, RB_DWR, RB_DBR, RB_DWS13, RB_DWS2, RB_TPE, RB_AUX, RB_Z, RB_B13, RB_B2, RB_DB13, RB_DB2,
       RB_DWSG, NUM_RANK_BUFFERS };

static void rank_buffer_sizes(const mok_problem_t* p, int W, int64_t T, size_t ws_bytes, size_t sv_bytes,
                              size_t n[NUM_RANK_BUFFERS]) {
  const mok_config_t* c = &p->cfg;
  const int64_t H = c->H, F = c->F, K = c->K, Fs = c->Fs, E = c->E, El = E / W;
  const size_t a = p->act, r = p->real, w = p->wgrad_elem;
  n[RB_X] = T * H * a;
  n[RB_W13] = El * 2 * F * H * a;
  n[RB_W2] = El * H * F * a;
  n[RB_DY] = T * H * a;
  n[RB_IDX] = T * K * 4;
  n[RB_TW] = T * K * r;
  n[RB_Y] = T * H * a;
  n[RB_DX] = T * H * a;
  n[RB_DTW] = T * K * r;
  n[RB_SAVED] = sv_bytes;
  n[RB_WS] = ws_bytes;
  n[RB_WS_BWD] = ws_bytes;
  n[RB_DW13] = El * 2 * F * H * w;
  n[RB_DW2] = El * H * F * w;
  n[RB_DWR] = E * H * w;
  n[RB_DBR] = E * r;
  n[RB_DWS13] = 2 * Fs * H * w;
  n[RB_DWS2] = H * Fs * w;
  n[RB_TPE] = E * 4;
  n[RB_AUX] = r;
  n[RB_Z] = r;
  n[RB_B13] = El * 2 * F * a;
  n[RB_B2] = El * H * a;
  n[RB_DB13] = El * 2 * F * w;
  n[RB_DB2] = El * H * w;
  n[RB_DWSG] = H * w;
}

static void* rank_main(void* arg) {
  rank_job_t* j = arg;
  mok_problem_t* p = j->p;
  const mok_run_opts_t* o = j->o;
  const mok_config_t* c = &p->cfg;
  const int64_t H = c->H, F = c->F, K = c->K, Fs = c->Fs, E = c->E;
  const int64_t El = E / o->W, e0 = (int64_t)j->rank * El, T = j->T, t0 = j->t0;
  const size_t a = p->act, r = p->real, w = p->wgrad_elem;
  mok_context_t* ctx = NULL;
  void *x = NULL, *w13 = NULL, *w2 = NULL, *dy = NULL, *y = NULL, *dx = NULL, *idx = NULL,
       *tw = NULL, *dtw = NULL, *saved = NULL, *ws = NULL, *ws_bwd = NULL, *dw13 = NULL, *dw2 = NULL,
       *dwr = NULL, *dws13 = NULL, *dws2 = NULL, *tpe = NULL, *aux = NULL, *z = NULL, *dbr = NULL, *b13 = NULL,
       *b2 = NULL, *db13 = NULL, *db2 = NULL, *dwsg = NULL;
  mok_config_t cfg = rank_config(c, o, j->rank, T, j->comm);
  mok_status_t s = mok_context_create(&cfg, &ctx);
  if (s) RANK_FAIL(j, s, "rank %d: create: %s", j->rank, mok_last_create_error());
  size_t ws_bytes = 0, sv_bytes = 0;
  mok_workspace_size(ctx, &ws_bytes);
  mok_saved_size(ctx, &sv_bytes);
  size_t n[NUM_RANK_BUFFERS];
  rank_buffer_sizes(p, o->W, T, ws_bytes, sv_bytes, n);
  x = dup_slice(p->x, t0 * H * a, n[RB_X]);
  w13 = dup_slice(p->w13, e0 * 2 * F * H * a, n[RB_W13]);
  w2 = dup_slice(p->w2, e0 * H * F * a, n[RB_W2]);
  dy = dup_slice(p->dy, t0 * H * a, n[RB_DY]);
  idx = dup_slice(p->topk_idx, t0 * K * 4, n[RB_IDX]);
  tw = dup_slice(p->topk_weight, t0 * K * r, n[RB_TW]);
  y = alloc0(n[RB_Y]);
  dx = alloc0(n[RB_DX]);
  dtw = alloc0(n[RB_DTW]);
  saved = alloc0(n[RB_SAVED]);
  ws = alloc0(n[RB_WS]);
  ws_bwd = alloc0(n[RB_WS_BWD]);
  dw13 = alloc0(n[RB_DW13]);
  dw2 = alloc0(n[RB_DW2]);
  dwr = alloc0(n[RB_DWR]);
  dbr = alloc0(n[RB_DBR]);
  dws13 = alloc0(n[RB_DWS13]);
  dws2 = alloc0(n[RB_DWS2]);
  tpe = alloc0(n[RB_TPE]);
  aux = alloc0(n[RB_AUX]);
  z = alloc0(n[RB_Z]);
  b13 = dup_slice(p->b13, e0 * 2 * F * a, n[RB_B13]);
  b2 = dup_slice(p->b2, e0 * H * a, n[RB_B2]);
  db13 = alloc0(n[RB_DB13]);
  db2 = alloc0(n[RB_DB2]);
  dwsg = alloc0(n[RB_DWSG]);
  if (!dwsg || !b13 || !b2 || !db13 || !db2 || !x || !w13 || !w2 || !dy || !idx || !tw || !y || !dx || !dtw || !saved || !ws || !ws_bwd || !dw13 ||
      !dw2 || !dwr || !dws13 || !dws2 || !tpe || !aux || !z || !dbr)
    RANK_FAIL(j, MOK_STATUS_OUT_OF_MEMORY, "rank %d: out of host memory", j->rank);
  const int replay = c->routing == MOK_ROUTING_REPLAY;
  mok_forward_args_t fa = {0};
  fa.num_tokens = T;
  fa.x = x;
  fa.w_router = p->w_router;
  fa.bias_select = c->use_bias_select ? p->bias_select : NULL;
  fa.b_router = c->use_router_bias ? p->b_router : NULL;
  fa.w13 = w13;
  fa.w2 = w2;
  fa.b13 = c->use_expert_bias ? b13 : NULL;
  fa.b2 = c->use_expert_bias ? b2 : NULL;
  fa.ws13 = Fs ? p->ws13 : NULL;
  fa.ws2 = Fs ? p->ws2 : NULL;
  fa.w_sg = c->use_shared_gate ? p->w_sg : NULL;
  fa.topk_idx = idx;
  fa.topk_weight = tw;
  fa.y = y;
  fa.tokens_per_expert = tpe;
  fa.aux_loss = aux;
  fa.z_loss = z;
  fa.saved = saved;
  fa.saved_bytes = sv_bytes;
  fa.workspace = ws;
  fa.workspace_bytes = ws_bytes;
  mok_backward_args_t ba = {0};
  ba.num_tokens = T;
  ba.x = x;
  ba.w_router = p->w_router;
  ba.w13 = w13;
  ba.w2 = w2;
  ba.b13 = fa.b13;
  ba.ws13 = fa.ws13;
  ba.ws2 = fa.ws2;
  ba.w_sg = fa.w_sg;
  ba.dy = dy;
  ba.d_aux_loss = p->d_aux_loss;
  ba.d_z_loss = p->d_z_loss;
  ba.saved = saved;
  ba.saved_bytes = sv_bytes;
  ba.dx = dx;
  ba.d_topk_weight = replay ? dtw : NULL;
  ba.d_w_router = replay ? NULL : dwr;
  ba.d_b_router = c->use_router_bias ? dbr : NULL;
  ba.d_w13 = dw13;
  ba.d_w2 = dw2;
  ba.d_b13 = c->use_expert_bias ? db13 : NULL;
  ba.d_b2 = c->use_expert_bias ? db2 : NULL;
  ba.d_ws13 = Fs ? dws13 : NULL;
  ba.d_ws2 = Fs ? dws2 : NULL;
  ba.d_w_sg = c->use_shared_gate ? dwsg : NULL;
  ba.workspace = ws_bwd; /* (not forward's: filled with 0xff before each step, below) */
  ba.workspace_bytes = ws_bytes;
  for (int step = 0; step < o->steps; step++) {
    /* Backward may not rely on what forward left in its workspace: mok.h makes it one
     * call's scratch. All ones is NaN in bf16, fp32 and double. (Here, not in the
     * backward's time.) */
    if (o->backward) memset(ws_bwd, 0xff, ws_bytes);
    double t_start = now_s();
    s = mok_forward(ctx, &fa);
    if (s) RANK_FAIL(j, s, "rank %d: forward: %s", j->rank, mok_context_last_error(ctx));
    double t_mid = now_s();
    if (o->backward) {
      s = mok_backward(ctx, &ba);
      if (s) RANK_FAIL(j, s, "rank %d: backward: %s", j->rank, mok_context_last_error(ctx));
    }
    j->fwd_s = t_mid - t_start;
    j->bwd_s = now_s() - t_mid;
  }
  const mok_status_t again = o->backward && o->backward_again ? mok_backward(ctx, &ba) : MOK_STATUS_SUCCESS;
  if (again) j->status = again, snprintf(j->err, sizeof j->err, "%s", mok_context_last_error(ctx));
  /* gather this rank's slices into the global outputs */
  memcpy((char*)p->y + t0 * H * a, y, T * H * a);
  memcpy((char*)p->out_topk_idx + t0 * K * 4, idx, T * K * 4);
  memcpy((char*)p->out_topk_weight + t0 * K * r, tw, T * K * r);
  if (o->backward) {
    memcpy((char*)p->dx + t0 * H * a, dx, T * H * a);
    memcpy((char*)p->d_topk_weight + t0 * K * r, dtw, T * K * r);
    memcpy((char*)p->d_w13 + e0 * 2 * F * H * w, dw13, El * 2 * F * H * w);
    memcpy((char*)p->d_w2 + e0 * H * F * w, dw2, El * H * F * w);
    memcpy((char*)p->d_b13 + e0 * 2 * F * w, db13, El * 2 * F * w);
    memcpy((char*)p->d_b2 + e0 * H * w, db2, El * H * w);
  }
  if (j->rank == 0) { /* replicated and global results: rank 0's copy */
    memcpy(p->tokens_per_expert, tpe, E * 4);
    memcpy(p->aux_loss, aux, r);
    memcpy(p->z_loss, z, r);
    if (o->backward) {
      memcpy(p->d_w_router, dwr, E * H * w);
      memcpy(p->d_b_router, dbr, E * r);
      memcpy(p->d_ws13, dws13, 2 * Fs * H * w);
      memcpy(p->d_ws2, dws2, H * Fs * w);
      memcpy(p->d_w_sg, dwsg, H * w);
    }
  }
done:
  if (ctx) mok_context_destroy(ctx);
  void* bufs[] = {x, w13, w2, dy, y, dx, idx, tw, dtw, saved, ws, ws_bwd, dw13, dw2, dwr, dws13,
                  dws2, tpe, aux, z, dbr, b13, b2, db13, db2, dwsg};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
  return NULL;
}

mok_status_t mok_problem_run(mok_problem_t* p, const mok_run_opts_t* o, char* err,
                             size_t err_len) {
  const int W = o->W;
  if (W < 1 || W > 64) return MOK_STATUS_INVALID_ARGUMENT;
  if (!split_ok(p->T_global, o, err, err_len)) return MOK_STATUS_INVALID_ARGUMENT;
  mok_cpu_comm_t* comm = NULL;
  if (W > 1) {
    mok_status_t s = mok_cpu_comm_create(W, &comm);
    if (s) return s;
  }
  rank_job_t jobs[64];
  pthread_t th[64];
  int64_t start = 0;
  for (int r = 0; r < W; r++) {
    const int64_t T = rank_tokens(p->T_global, o, r);
    jobs[r] = (rank_job_t){.p = p, .o = o, .comm = comm, .rank = r, .t0 = start, .T = T};
    start += T;
  }
  for (int r = 0; r < W; r++)
    if (r != o->skip_rank) pthread_create(&th[r], NULL, rank_main, &jobs[r]);
  mok_status_t first = MOK_STATUS_SUCCESS;
  p->seconds_forward = p->seconds_backward = 0;
  for (int r = 0; r < W; r++) {
    if (r == o->skip_rank) continue;
    pthread_join(th[r], NULL);
    if (jobs[r].status && !first) {
      first = jobs[r].status;
      if (err) snprintf(err, err_len, "%s", jobs[r].err);
    }
    if (jobs[r].fwd_s > p->seconds_forward) p->seconds_forward = jobs[r].fwd_s;
    if (jobs[r].bwd_s > p->seconds_backward) p->seconds_backward = jobs[r].bwd_s;
  }
  if (comm) mok_cpu_comm_destroy(comm);
  return first;
}

/* ---- host memory of runs, counted before anything is allocated ---- */

size_t mok_problem_host_bytes(const mok_config_t* cfg, int64_t T_global) {
  mok_problem_t p = {0};
  problem_init(&p, cfg, T_global, 0);
  size_t n[NUM_PROBLEM_BUFFERS], sum = sizeof p;
  problem_buffer_sizes(&p, n);
  for (int i = 0; i < NUM_PROBLEM_BUFFERS; i++) sum += alloc_bytes(n[i]);
  return sum;
}

size_t mok_problem_outputs_bytes(const mok_config_t* cfg, int64_t T_global, int with_backward) {
  mok_problem_t p = {0};
  problem_init(&p, cfg, T_global, 0);
  mok_tensor_view_t v[MOK_PROBLEM_MAX_OUTPUTS];
  const int m = mok_problem_outputs(&p, with_backward, v, MOK_PROBLEM_MAX_OUTPUTS);
  size_t sum = 0;
  for (int i = 0; i < m; i++) sum += (size_t)v[i].count * v[i].elem;
  return sum;
}

/* One rank's context made only to ask the library for its saved and workspace sizes. */
typedef struct {
  mok_config_t cfg;
  size_t ws_bytes, sv_bytes;
  mok_status_t status;
  char err[512];
} probe_job_t;

static void* probe_main(void* arg) {
  probe_job_t* j = arg;
  mok_context_t* ctx = NULL;
  j->status = mok_context_create(&j->cfg, &ctx);
  if (j->status) {
    snprintf(j->err, sizeof j->err, "rank %d: create: %s", j->cfg.rank, mok_last_create_error());
    return NULL;
  }
  mok_workspace_size(ctx, &j->ws_bytes);
  mok_saved_size(ctx, &j->sv_bytes);
  mok_context_destroy(ctx);
  return NULL;
}

mok_status_t mok_problem_run_bytes(const mok_config_t* cfg, int64_t T_global, const mok_run_opts_t* o,
                                   int shape_only, size_t* bytes, char* err, size_t err_len) {
  *bytes = 0;
  const int W = o->W;
  if (W < 1 || W > 64) {
    if (err) snprintf(err, err_len, "W = %d: the CPU runs take 1 <= W <= 64", W);
    return MOK_STATUS_INVALID_ARGUMENT;
  }
  if (!split_ok(T_global, o, err, err_len)) return MOK_STATUS_INVALID_ARGUMENT;
  mok_problem_t p = {0};
  problem_init(&p, cfg, T_global, 0);
  mok_cpu_comm_t* comm = NULL;
  if (!shape_only && W > 1) {
    mok_status_t s = mok_cpu_comm_create(W, &comm);
    if (s) {
      if (err) snprintf(err, err_len, "mok_cpu_comm_create: %s", mok_status_string(s));
      return s;
    }
  }
  probe_job_t jobs[64];
  for (int r = 0; r < W; r++)
    jobs[r] = (probe_job_t){.cfg = rank_config(cfg, o, r, rank_tokens(T_global, o, r), comm)};
  mok_status_t first = MOK_STATUS_SUCCESS;
  if (!shape_only) { /* (a context touches none of its buffers before its first step) */
    if (W == 1) {
      probe_main(&jobs[0]);
    } else {
      pthread_t th[64];
      for (int r = 0; r < W; r++) pthread_create(&th[r], NULL, probe_main, &jobs[r]);
      for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
    }
    for (int r = 0; r < W && !first; r++)
      if ((first = jobs[r].status) && err) snprintf(err, err_len, "%s", jobs[r].err);
    if (comm) mok_cpu_comm_destroy(comm);
    if (first) return first;
  }
  /* the library's own buffers of a CPU context (src/api.c): the exchange's received and
   * returned rows, [capacity, H] act each (capacity's default: every token of every rank
   * sends min(K, E/W) rows here), and the GEMM's packing scratch of each thread */
  const int64_t E_loc = cfg->E / W, rows_per_token = cfg->K < E_loc ? cfg->K : E_loc;
  const int64_t capacity = o->capacity > 0 ? o->capacity : T_global * rows_per_token;
  const int threads = o->num_threads > 0 ? o->num_threads : omp_get_max_threads();
  const size_t library = 2 * alloc_bytes((size_t)capacity * (size_t)cfg->H * p.act) +
                         alloc_bytes(mok_gemm_pack_bytes() * (size_t)threads);
  size_t sum = 0;
  for (int r = 0; r < W; r++) {
    size_t n[NUM_RANK_BUFFERS];
    rank_buffer_sizes(&p, W, jobs[r].cfg.T, jobs[r].ws_bytes, jobs[r].sv_bytes, n);
    for (int i = 0; i < NUM_RANK_BUFFERS; i++) sum += alloc_bytes(n[i]);
    sum += library;
  }
  *bytes = sum;
  return MOK_STATUS_SUCCESS;
}

/* ---- comparing results ---- */

double mok_view_get(const mok_tensor_view_t* v, int64_t i) {
  switch (v->kind) {
    case 0: return from_bf16(((const uint16_t*)v->data)[i]);
    case 1: return ((const float*)v->data)[i];
    case 2: return ((const double*)v->data)[i];
    default: return ((const int32_t*)v->data)[i];
  }
}

int64_t mok_first_difference(const mok_tensor_view_t* a, const mok_tensor_view_t* b) {
  if (a->count != b->count || a->elem != b->elem) return 0;
  for (int64_t i = 0; i < a->count; i++)
    if (memcmp((const char*)a->data + i * a->elem, (const char*)b->data + i * b->elem,
               a->elem) != 0)
      return i;
  return -1;
}

double mok_relative_error(const mok_tensor_view_t* a, const mok_tensor_view_t* b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < b->count; i++) {
    double va = mok_view_get(a, i), vb = mok_view_get(b, i);
    if (isnan(vb) && isnan(va)) continue;
    if (isnan(va) || isnan(vb)) return INFINITY;
    num += (va - vb) * (va - vb);
    den += vb * vb;
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return sqrt(num / den);
}

int mok_problem_outputs(const mok_problem_t* p, int with_backward, mok_tensor_view_t* v,
                        int max_views) {
  const mok_config_t* c = &p->cfg;
  const int64_t T = p->T_global, H = c->H, F = c->F, E = c->E, K = c->K, Fs = c->Fs;
  const int act_kind = p->act == 2 ? 0 : 2, real_kind = p->real == 4 ? 1 : 2;
  const int w_kind = p->wgrad_elem == 2 ? 0 : p->wgrad_elem == 4 ? 1 : 2;
  const int replay = c->routing == MOK_ROUTING_REPLAY;
  mok_tensor_view_t all[MOK_PROBLEM_MAX_OUTPUTS];
  int n = 0;
#define VIEW(nm, ptr, cnt, el, kd) all[n++] = (mok_tensor_view_t){nm, ptr, cnt, el, kd}
  VIEW("y", p->y, T * H, p->act, act_kind);
  VIEW("tokens_per_expert", p->tokens_per_expert, E, 4, 3);
  if (!replay) {
    VIEW("topk_idx", p->out_topk_idx, T * K, 4, 3);
    VIEW("topk_weight", p->out_topk_weight, T * K, p->real, real_kind);
    VIEW("aux_loss", p->aux_loss, 1, p->real, real_kind);
    VIEW("z_loss", p->z_loss, 1, p->real, real_kind);
  }
  if (with_backward) {
    VIEW("dx", p->dx, T * H, p->act, act_kind);
    if (replay)
      VIEW("d_topk_weight", p->d_topk_weight, T * K, p->real, real_kind);
    else
      VIEW("d_w_router", p->d_w_router, E * H, p->wgrad_elem, w_kind);
    if (!replay && c->use_router_bias) VIEW("d_b_router", p->d_b_router, E, p->real, real_kind);
    VIEW("d_w13", p->d_w13, E * 2 * F * H, p->wgrad_elem, w_kind);
    VIEW("d_w2", p->d_w2, E * H * F, p->wgrad_elem, w_kind);
    if (c->use_expert_bias) {
      VIEW("d_b13", p->d_b13, E * 2 * F, p->wgrad_elem, w_kind);
      VIEW("d_b2", p->d_b2, E * H, p->wgrad_elem, w_kind);
    }
    if (Fs) {
      VIEW("d_ws13", p->d_ws13, 2 * Fs * H, p->wgrad_elem, w_kind);
      VIEW("d_ws2", p->d_ws2, H * Fs, p->wgrad_elem, w_kind);
      if (c->use_shared_gate) VIEW("d_w_sg", p->d_w_sg, H, p->wgrad_elem, w_kind);
    }
  }
#undef VIEW
  int m = n < max_views ? n : max_views;
  memcpy(v, all, (size_t)m * sizeof *v);
  return m;
}

/* ---- running on one GPU ---- */

#ifdef MOK_HAVE_CUDA
#include <cuda_runtime_api.h>

typedef struct {
  void* host;   /* problem tensor (input to upload, or output to fill) */
  void* dev;
  size_t bytes;
  int output;   /* poisoned before the run and copied back after it */
} dev_buf_t;

#define CU_FAIL(what)                                                                          \
  do {                                                                                         \
    if (err) snprintf(err, err_len, "%s: %s", what, cudaGetErrorString(cudaGetLastError()));   \
    status = MOK_STATUS_CUDA_ERROR;                                                            \
    goto done;                                                                                 \
  } while (0)

/* Where the W ranks of a CUDA run meet (W > 1): after every rank's setup, before the
 * first step, and after the last copy back, before the frees. A cudaFree waits for the
 * whole device, and with the ranks on one GPU (loopback) a peer's kernel may be waiting
 * for this rank's next launch; a rank that leaves early (a failed create) drops out, so
 * that nobody waits for it. Waits are bounded (kMeetTimeoutS). */
typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int members, arrived;
  uint64_t generation;
} meet_t;
static const double kMeetTimeoutS = 120.0;

/* Returns 0 when the others did not come within kMeetTimeoutS. */
static int meet(meet_t* m) {
  if (!m) return 1;
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += (time_t)kMeetTimeoutS;
  pthread_mutex_lock(&m->mu);
  const uint64_t gen = m->generation;
  if (++m->arrived >= m->members) {
    m->arrived = 0, m->generation++;
    pthread_cond_broadcast(&m->cv);
  }
  while (m->generation == gen)
    if (pthread_cond_timedwait(&m->cv, &m->mu, &deadline) != 0) break;
  const int ok = m->generation != gen;
  if (!ok) m->arrived--;
  pthread_mutex_unlock(&m->mu);
  return ok;
}
/* This rank takes part in no more meetings. */
static void meet_leave(meet_t* m) {
  if (!m) return;
  pthread_mutex_lock(&m->mu);
  m->members--;
  if (m->arrived > 0 && m->arrived >= m->members) {
    m->arrived = 0, m->generation++;
    pthread_cond_broadcast(&m->cv);
  }
  pthread_mutex_unlock(&m->mu);
}

/* One rank of a CUDA run: its tokens [t0, t0 + T) of the global batch and its experts
 * [rank E/W, ..), on device `rank` when W > 1 (each rank a thread), or on device 0 with
 * a loopback id. Replicated outputs (tokens_per_expert, the losses, the router and
 * shared-expert gradients) come back from rank 0. */
typedef struct {
  mok_problem_t* p;
  const mok_run_opts_t* o;
  int rank;
  int64_t t0, T, T_max;
  const void* unique_id;
  int loopback;
  meet_t* meet;
  mok_status_t status;
  char err[512];
} cuda_job_t;

/* One step's library calls, made on a thread of their own (mok_run_opts_t.step_thread). */
typedef struct {
  mok_context_t* ctx;
  const mok_forward_args_t* fa;
  const mok_backward_args_t* ba;  /* NULL: forward only */
  int other_device;               /* the device made current first, or -1 */
  mok_status_t status;
  int device_after;               /* the thread's current device after the calls */
} step_job_t;

static void* step_thread_main(void* arg) {
  step_job_t* j = arg;
  if (j->other_device >= 0 && cudaSetDevice(j->other_device) != cudaSuccess) {
    j->status = MOK_STATUS_CUDA_ERROR;
    return NULL;
  }
  j->status = mok_forward(j->ctx, j->fa);
  if (!j->status && j->ba) j->status = mok_backward(j->ctx, j->ba);
  if (!j->status) j->status = mok_context_sync(j->ctx);
  j->device_after = -1;
  if (j->other_device >= 0) cudaGetDevice(&j->device_after);
  return NULL;
}

static mok_status_t run_cuda_rank(mok_problem_t* p, const mok_run_opts_t* o, const cuda_job_t* job, char* err,
                                  size_t err_len) {
  const int rank = job->rank;
  const int64_t t0 = job->t0, T = job->T;
  meet_t* m = job->meet;
  const mok_config_t* c = &p->cfg;
  const int64_t H = c->H, F = c->F, E = c->E, K = c->K, Fs = c->Fs, W = o->W, El = E / W, e0 = rank * El;
  const size_t a = p->act, r = p->real, w = p->wgrad_elem;
  const int rep = rank == 0; /* replicated outputs copied back by rank 0 alone (output 2: not) */
  const int replay = c->routing == MOK_ROUTING_REPLAY, accum = c->wgrad == MOK_WGRAD_FP32_ACCUM;
  mok_status_t status = MOK_STATUS_SUCCESS;
  mok_context_t* ctx = NULL;
  cudaStream_t stream = NULL;
  cudaEvent_t ev[3] = {NULL, NULL, NULL};
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  int met = 0; /* passed the first meeting: takes part in the second */
  enum { X, WR, BIAS, BR, W13, W2, B13, B2, WS13, WS2, WSG, DY, IDX, TW, DAUX, DZ, Y, DX, DTW, TPE, AUX, Z, DWR,
         DBR, DW13, DW2, DB13, DB2, DWS13, DWS2, DWSG, SAVED, WS, WS_BWD, NBUF };
#define SLICE(ptr, offset) ((ptr) ? (void*)((char*)(ptr) + (offset)) : NULL)
  void* idx_host = replay ? (void*)p->topk_idx : (void*)p->out_topk_idx;
  void* tw_host = replay ? p->topk_weight : p->out_topk_weight;
  dev_buf_t b[NBUF] = {
      [X] = {SLICE(p->x, t0 * H * a), 0, T * H * a, 0}, [WR] = {p->w_router, 0, E * H * a, 0},
      [BIAS] = {p->bias_select, 0, E * r, 0}, [BR] = {p->b_router, 0, E * r, 0}, [W13] = {SLICE(p->w13, e0 * 2 * F * H * a), 0, El * 2 * F * H * a, 0},
      [W2] = {SLICE(p->w2, e0 * H * F * a), 0, El * H * F * a, 0}, [WS13] = {p->ws13, 0, 2 * Fs * H * a, 0},
      [WS2] = {p->ws2, 0, H * Fs * a, 0}, [DY] = {SLICE(p->dy, t0 * H * a), 0, T * H * a, 0},
      [B13] = {SLICE(p->b13, e0 * 2 * F * a), 0, El * 2 * F * a, 0}, [B2] = {SLICE(p->b2, e0 * H * a), 0, El * H * a, 0},
      [WSG] = {p->w_sg, 0, H * a, 0}, [DB13] = {SLICE(p->d_b13, e0 * 2 * F * w), 0, El * 2 * F * w, 1},
      [DB2] = {SLICE(p->d_b2, e0 * H * w), 0, El * H * w, 1}, [DWSG] = {p->d_w_sg, 0, H * w, rep ? 1 : 2},
      [IDX] = {SLICE(idx_host, t0 * K * 4), 0, T * K * 4, !replay},
      [TW] = {SLICE(tw_host, t0 * K * r), 0, T * K * r, !replay},
      [DAUX] = {p->d_aux_loss, 0, r, 0}, [DZ] = {p->d_z_loss, 0, r, 0},
      [Y] = {SLICE(p->y, t0 * H * a), 0, T * H * a, 1}, [DX] = {SLICE(p->dx, t0 * H * a), 0, T * H * a, 1},
      [DTW] = {SLICE(p->d_topk_weight, t0 * K * r), 0, T * K * r, 1},
      [TPE] = {p->tokens_per_expert, 0, E * 4, rep ? 1 : 2},
      [AUX] = {p->aux_loss, 0, r, rep ? 1 : 2}, [Z] = {p->z_loss, 0, r, rep ? 1 : 2},
      [DWR] = {p->d_w_router, 0, E * H * w, rep ? 1 : 2}, [DBR] = {p->d_b_router, 0, E * r, rep ? 1 : 2},
      [DW13] = {SLICE(p->d_w13, e0 * 2 * F * H * w), 0, El * 2 * F * H * w, 1},
      [DW2] = {SLICE(p->d_w2, e0 * H * F * w), 0, El * H * F * w, 1},
      [DWS13] = {p->d_ws13, 0, 2 * Fs * H * w, rep ? 1 : 2}, [DWS2] = {p->d_ws2, 0, H * Fs * w, rep ? 1 : 2},
      [SAVED] = {NULL, 0, 0, 0}, [WS] = {NULL, 0, 0, 0}, [WS_BWD] = {NULL, 0, 0, 0}};
#undef SLICE
  const int device = W > 1 && !job->loopback ? rank : 0;
  if (W > 1 && cudaSetDevice(device) != cudaSuccess) {
    if (err) snprintf(err, err_len, "rank %d: cudaSetDevice(%d): %s", rank, device, cudaGetErrorString(cudaGetLastError()));
    meet_leave(m);
    return MOK_STATUS_CUDA_ERROR;
  }
  mok_config_t cfg = *c;
  cfg.T = job->T_max; /* every rank's bound alike: W > 1 sizes symmetric windows by it */
  cfg.W = (int)W;
  cfg.rank = rank;
  cfg.comm_unique_id = job->unique_id;
  if (o->capacity > 0) cfg.capacity = o->capacity;
  cfg.backend = MOK_BACKEND_CUDA;
  cfg.num_ctas = W > 1 && o->rank_num_ctas[rank] ? o->rank_num_ctas[rank] : o->num_ctas;
  cfg.cta_pairs = (mok_cta_pairs_t)o->cta_pairs;
  if (o->comm_timeout_s > 0) cfg.comm_timeout_s = o->comm_timeout_s;
  status = mok_context_create(&cfg, &ctx);
  if (status) {
    if (err) snprintf(err, err_len, "create: %s", mok_last_create_error());
    meet_leave(m);
    return status;
  }
  if (rank == o->silent_rank) { /* the peers' steps must give up waiting for this rank */
    const double s = (cfg.comm_timeout_s > 0 ? cfg.comm_timeout_s : 5.0) + 1.0;
    struct timespec ts = {(time_t)s, (long)((s - (time_t)s) * 1e9)};
    meet(m); /* (the peers' setup done) */
    nanosleep(&ts, NULL);
    meet(m); /* (the peers' steps over) */
    meet_leave(m);
    mok_context_destroy(ctx);
    return MOK_STATUS_SUCCESS;
  }
  mok_workspace_size(ctx, &b[WS].bytes);
  b[WS_BWD].bytes = b[WS].bytes;
  mok_saved_size(ctx, &b[SAVED].bytes);
  /* a stream that waits for no other (never the legacy default stream, which with the
   * ranks on one GPU would wait for a peer's kernel); every copy and fill on it */
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) CU_FAIL("cudaStreamCreate");
  for (int i = 0; i < 3; i++)
    if (cudaEventCreate(&ev[i]) != cudaSuccess) CU_FAIL("cudaEventCreate");
  for (int i = 0; i < NBUF; i++) {
    if (cudaMalloc(&b[i].dev, b[i].bytes ? b[i].bytes : 256) != cudaSuccess) CU_FAIL("cudaMalloc");
    if (b[i].host && !b[i].output && b[i].bytes &&
        cudaMemcpyAsync(b[i].dev, b[i].host, b[i].bytes, cudaMemcpyHostToDevice, stream) != cudaSuccess)
      CU_FAIL("cudaMemcpyAsync to the device");
    if (b[i].output && cudaMemsetAsync(b[i].dev, 0xFF, b[i].bytes, stream) != cudaSuccess) CU_FAIL("cudaMemsetAsync");
  }
  if (accum) /* the gradients added into, d_w_router through d_w_sg: from zeros, as the CPU's */
    for (int i = DWR; i <= DWSG; i++)
      if (cudaMemsetAsync(b[i].dev, 0, b[i].bytes, stream) != cudaSuccess) CU_FAIL("cudaMemsetAsync");
  if (cudaStreamSynchronize(stream) != cudaSuccess) CU_FAIL("cudaStreamSynchronize");
  met = meet(m);
  if (!met) {
    if (err) snprintf(err, err_len, "rank %d: the other ranks did not finish their setup within %.0f s", rank,
                      kMeetTimeoutS);
    status = MOK_STATUS_COMM_TIMEOUT;
    goto done;
  }
  mok_forward_args_t fa = {0};
  fa.num_tokens = T;
  fa.x = b[X].dev;
  fa.w_router = b[WR].dev;
  fa.bias_select = c->use_bias_select ? b[BIAS].dev : NULL;
  fa.b_router = c->use_router_bias ? b[BR].dev : NULL;
  fa.w13 = b[W13].dev;
  fa.w2 = b[W2].dev;
  fa.ws13 = Fs ? b[WS13].dev : NULL;
  fa.ws2 = Fs ? b[WS2].dev : NULL;
  fa.b13 = c->use_expert_bias ? b[B13].dev : NULL;
  fa.b2 = c->use_expert_bias ? b[B2].dev : NULL;
  fa.w_sg = c->use_shared_gate ? b[WSG].dev : NULL;
  fa.topk_idx = b[IDX].dev;
  fa.topk_weight = b[TW].dev;
  fa.y = b[Y].dev;
  fa.tokens_per_expert = b[TPE].dev;
  fa.aux_loss = b[AUX].dev;
  fa.z_loss = b[Z].dev;
  fa.saved = b[SAVED].dev;
  fa.saved_bytes = b[SAVED].bytes;
  fa.workspace = b[WS].dev;
  fa.workspace_bytes = b[WS].bytes;
  fa.stream = stream;
  mok_backward_args_t ba = {0};
  ba.num_tokens = T;
  ba.x = fa.x;
  ba.w_router = fa.w_router;
  ba.w13 = fa.w13;
  ba.w2 = fa.w2;
  ba.ws13 = fa.ws13;
  ba.ws2 = fa.ws2;
  ba.b13 = fa.b13;
  ba.w_sg = fa.w_sg;
  ba.dy = b[DY].dev;
  ba.d_aux_loss = b[DAUX].dev;
  ba.d_z_loss = b[DZ].dev;
  ba.saved = fa.saved;
  ba.saved_bytes = fa.saved_bytes;
  ba.dx = b[DX].dev;
  ba.d_topk_weight = replay ? b[DTW].dev : NULL;
  ba.d_w_router = replay ? NULL : b[DWR].dev;
  ba.d_b_router = c->use_router_bias ? b[DBR].dev : NULL;
  ba.d_w13 = b[DW13].dev;
  ba.d_w2 = b[DW2].dev;
  ba.d_ws13 = Fs ? b[DWS13].dev : NULL;
  ba.d_ws2 = Fs ? b[DWS2].dev : NULL;
  ba.d_b13 = c->use_expert_bias ? b[DB13].dev : NULL;
  ba.d_b2 = c->use_expert_bias ? b[DB2].dev : NULL;
  ba.d_w_sg = c->use_shared_gate ? b[DWSG].dev : NULL;
  ba.workspace = b[WS_BWD].dev; /* (not forward's: filled with 0xff before each step, below) */
  ba.workspace_bytes = b[WS_BWD].bytes;
  ba.stream = stream;
  if (o->graph) {
    if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) != cudaSuccess) CU_FAIL("capture");
    mok_status_t sf = mok_forward(ctx, &fa);
    mok_status_t sb = o->backward ? mok_backward(ctx, &ba) : MOK_STATUS_SUCCESS;
    if (cudaStreamEndCapture(stream, &graph) != cudaSuccess) CU_FAIL("cudaStreamEndCapture");
    if (sf || sb) {
      status = sf ? sf : sb;
      if (err) snprintf(err, err_len, "captured step: %s", mok_context_last_error(ctx));
      goto done;
    }
    if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) CU_FAIL("cudaGraphInstantiate");
  }
  for (int step = 0; step < o->steps; step++) {
    /* Backward may not rely on what forward left in its workspace (as on the CPU) */
    if (o->backward && cudaMemsetAsync(b[WS_BWD].dev, 0xff, b[WS_BWD].bytes, stream) != cudaSuccess)
      CU_FAIL("cudaMemsetAsync");
    cudaEventRecord(ev[0], stream);
    if (o->graph) {
      if (cudaGraphLaunch(exec, stream) != cudaSuccess) CU_FAIL("cudaGraphLaunch");
      cudaEventRecord(ev[1], stream);
    } else if (o->step_thread) {
      int devices = 0;
      cudaGetDeviceCount(&devices);
      step_job_t j = {ctx, &fa, o->backward ? &ba : NULL, o->step_thread == 2 ? devices - 1 : -1,
                      MOK_STATUS_SUCCESS, -1};
      pthread_t th;
      if (pthread_create(&th, NULL, step_thread_main, &j) != 0) CU_FAIL("pthread_create");
      pthread_join(th, NULL);
      status = j.status;
      if (status) goto fail;
      if (j.device_after != j.other_device) {
        if (err) snprintf(err, err_len, "the step's calls left device %d current on their thread, not %d",
                          j.device_after, j.other_device);
        status = MOK_STATUS_CUDA_ERROR;
        goto done;
      }
      cudaEventRecord(ev[1], stream);  /* (the thread's step is synced: no split times) */
    } else {
      status = mok_forward(ctx, &fa);
      if (status) goto fail;
      cudaEventRecord(ev[1], stream);
      if (o->backward) {
        status = mok_backward(ctx, &ba);
        if (status) goto fail;
      }
    }
    cudaEventRecord(ev[2], stream);
    status = mok_context_sync(ctx);
    if (status) goto fail;
    float ms_f = 0, ms_b = 0;
    cudaEventElapsedTime(&ms_f, ev[0], ev[1]);
    cudaEventElapsedTime(&ms_b, ev[1], ev[2]);
    if (rep) p->seconds_forward = ms_f * 1e-3, p->seconds_backward = ms_b * 1e-3;
  }
  if (o->backward && o->backward_again) {  /* (its status is the run's; the outputs are the steps') */
    status = mok_backward(ctx, &ba);
    if (!status) status = mok_context_sync(ctx);
    if (status && err) snprintf(err, err_len, "%s", mok_context_last_error(ctx));
  }
  goto copy_back;
fail:
  if (err) snprintf(err, err_len, "%s", mok_context_last_error(ctx));
copy_back: /* (also after a failed step: what it wrote over the poison; its status stays) */
  for (int i = 0; i < NBUF; i++) /* (to pageable memory: each returns once done) */
    if (b[i].output == 1 && b[i].host && b[i].bytes &&
        cudaMemcpyAsync(b[i].host, b[i].dev, b[i].bytes, cudaMemcpyDeviceToHost, stream) != cudaSuccess &&
        !status)
      CU_FAIL("cudaMemcpyAsync to the host");
done:
  if (stream) cudaStreamSynchronize(stream);
  if (met) meet(m); /* (every rank's steps over before any frees) */
  meet_leave(m);
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  for (int i = 0; i < NBUF; i++) cudaFree(b[i].dev);
  for (int i = 0; i < 3; i++)
    if (ev[i]) cudaEventDestroy(ev[i]);
  if (stream) cudaStreamDestroy(stream);
  if (ctx) mok_context_destroy(ctx);
  return status;
}

static void* cuda_rank_main(void* arg) {
  cuda_job_t* j = arg;
  j->status = run_cuda_rank(j->p, j->o, j, j->err, sizeof j->err);
  return NULL;
}

mok_status_t mok_problem_run_cuda(mok_problem_t* p, const mok_run_opts_t* o, char* err, size_t err_len) {
  const int W = o->W;
  for (int r = 0; r < 8; r++) p->rank_status[r] = MOK_STATUS_SUCCESS;
  if (W == 1) {
    const cuda_job_t one = {.p = p, .o = o, .T = p->T_global, .T_max = p->T_global};
    return p->rank_status[0] = run_cuda_rank(p, o, &one, err, err_len);
  }
  if (W < 1 || W > 8) {
    if (err) snprintf(err, err_len, "W = %d: the CUDA runs take 1 <= W <= 8", W);
    return MOK_STATUS_INVALID_ARGUMENT;
  }
  if (!split_ok(p->T_global, o, err, err_len)) return MOK_STATUS_INVALID_ARGUMENT;
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  const int loopback = o->loopback || gpus < W;
  uint8_t id[MOK_COMM_UNIQUE_ID_BYTES] = {0};
  mok_status_t s = loopback ? mok_comm_loopback_id(id, sizeof id) : mok_comm_unique_id(id, sizeof id);
  if (s) {
    if (err) snprintf(err, err_len, "%s", mok_last_create_error());
    return s;
  }
  meet_t m = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, W, 0, 0};
  cuda_job_t jobs[8];
  pthread_t th[8];
  int64_t start = 0, T_max = 0;
  for (int r = 0; r < W; r++)
    if (rank_tokens(p->T_global, o, r) > T_max) T_max = rank_tokens(p->T_global, o, r);
  for (int r = 0; r < W; r++) {
    const int64_t T = rank_tokens(p->T_global, o, r);
    jobs[r] = (cuda_job_t){.p = p, .o = o, .rank = r, .t0 = start, .T = T, .T_max = T_max, .unique_id = id,
                           .loopback = loopback, .meet = &m};
    start += T;
  }
  if (o->skip_rank >= 0 && o->skip_rank < W) m.members--;
  for (int r = 0; r < W; r++)
    if (r != o->skip_rank) pthread_create(&th[r], NULL, cuda_rank_main, &jobs[r]);
  mok_status_t first = MOK_STATUS_SUCCESS;
  for (int r = 0; r < W; r++) {
    if (r == o->skip_rank) continue;
    pthread_join(th[r], NULL);
    p->rank_status[r] = jobs[r].status;
    if (jobs[r].status && !first) {
      first = jobs[r].status;
      if (err) snprintf(err, err_len, "rank %d: %s", r, jobs[r].err);
    }
  }
  return first;
}
#else
mok_status_t mok_problem_run_cuda(mok_problem_t* p, const mok_run_opts_t* o, char* err,
                                  size_t err_len) {
  (void)p, (void)o;
  if (err) snprintf(err, err_len, "this build of mok has no CUDA backend");
  return MOK_STATUS_BACKEND_UNAVAILABLE;
}
#endif
