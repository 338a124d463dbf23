/* plan.c — byte layout of the saved buffer and the workspace (see internal.h), for
 * the context's maximum T. Element sizes follow the numerics: act 2 / real 4 bytes
 * (bf16, fp32), or 8 / 8 in EXACT numerics. */
#include "internal.h"

/* Sizes are counted in size_t with every product and sum checked: a shape whose plan
 * would not fit sets *overflow (mok_context_create refuses it) instead of wrapping. */
static size_t mul(int* overflow, size_t a, size_t b) {
  size_t r;
  if (__builtin_mul_overflow(a, b, &r)) *overflow = 1;
  return r;
}
#define MUL3(ov, a, b, c) mul((ov), mul((ov), (size_t)(a), (size_t)(b)), (size_t)(c))

static size_t take(size_t* at, int* overflow, size_t bytes) {
  size_t here = *at, padded;
  if (__builtin_add_overflow(bytes, (size_t)MOK_ALIGN_WORKSPACE - 1, &padded) ||
      __builtin_add_overflow(*at, padded / MOK_ALIGN_WORKSPACE * MOK_ALIGN_WORKSPACE, at))
    *overflow = 1;
  return here;
}

static int64_t max2(int64_t a, int64_t b) { return a > b ? a : b; }

void mok_plan_saved(const mok_context_t* ctx, int64_t T, mok_saved_plan_t* p) {
  const mok_config_t* c = &ctx->cfg;
  const size_t a = (size_t)ctx->act_size, r = (size_t)ctx->real_size;
  const int64_t cap = c->capacity, H = c->H, F = c->F, E = c->E, K = c->K, Fs = c->Fs;
  const int64_t keep = c->gate_up == MOK_GATE_UP_SAVE; /* else in the workspace */
  const int64_t fused = c->routing == MOK_ROUTING_FUSED;
  int* ov = &p->overflow;
  size_t at = 0;
  *ov = 0;
  take(&at, ov, sizeof(mok_saved_header_t));
  p->counts_all = take(&at, ov, MUL3(ov, c->W, E, 4));
  p->topk_idx = take(&at, ov, MUL3(ov, T, K, 4));
  p->slot_pos = take(&at, ov, MUL3(ov, T, K, 4));
  p->topk_weight = take(&at, ov, MUL3(ov, T, K, r));
  p->logits = take(&at, ov, MUL3(ov, fused * T, E, r));
  p->o_slots = take(&at, ov, mul(ov, MUL3(ov, T, K, H), a));
  p->shared_a = take(&at, ov, mul(ov, MUL3(ov, keep * T, 2, Fs), a));
  p->shared_h = take(&at, ov, MUL3(ov, keep * T, Fs, a));
  p->x_rows = take(&at, ov, MUL3(ov, cap, H, a));
  p->a_rows = take(&at, ov, mul(ov, MUL3(ov, keep * cap, 2, F), a));
  p->h_rows = take(&at, ov, MUL3(ov, keep * cap, F, a));
  p->total = at;
}

int64_t mok_tree_depth(int64_t num_chunks) {
  int64_t d = 1;
  while (((int64_t)1 << (d - 1)) < num_chunks) d++;
  return d;
}

void mok_plan_workspace(const mok_context_t* ctx, int64_t T, mok_workspace_plan_t* p) {
  const mok_config_t* c = &ctx->cfg;
  const size_t a = (size_t)ctx->act_size, r = (size_t)ctx->real_size;
  const int64_t H = c->H, F = c->F, E = c->E, K = c->K, Fs = c->Fs, cap = c->capacity;
  int* ov = &p->overflow;
  *ov = 0;
  int64_t chunks = 0;
  for (int i = 0; i < c->W; i++)
    chunks += (ctx->T_all[i] + MOK_REDUCE_CHUNK_TOKENS - 1) / MOK_REDUCE_CHUNK_TOKENS;
  /* replicated sums: [E + 1] loss statistics (forward), [E*H | 2Fs*H | H*Fs | E | H]
   * gradients, the E with use_router_bias, the H with use_shared_gate (mok_context_create
   * bounds H (E + 3 Fs), so this cannot wrap) */
  p->tree_len = max2(E + 1, E * H + 3 * Fs * H + (c->use_router_bias ? E : 0) + (c->use_shared_gate ? H : 0));
  /* own maximal nodes (<= 2 per level), a partial per level while summing one of them,
   * and the output plus a partial per level while combining all ranks' nodes */
  p->tree_vectors = 4 * mok_tree_depth(chunks) + 1;
  const int64_t row_width = max2(max2(2 * F, H), 2 * Fs);
  const int64_t redo = c->gate_up == MOK_GATE_UP_RECOMPUTE; /* else in saved */
  size_t at = 0;
  p->logits = take(&at, ov, MUL3(ov, T, E, r));
  p->idx = take(&at, ov, MUL3(ov, T, K, 4));
  p->weight = take(&at, ov, MUL3(ov, T, K, r));
  p->slot_pos = take(&at, ov, MUL3(ov, T, K, 4));
  p->counts = take(&at, ov, MUL3(ov, c->W + 1, E, 4));
  p->gemm_out = take(&at, ov, MUL3(ov, max2(MOK_ROW_BLOCK * row_width, max2(2 * F * H, 2 * Fs * H)), 1, r));
  const size_t d_a_rows = MUL3(ov, cap, 2, F), d_a_shared = MUL3(ov, T, 2, Fs);
  p->d_a = take(&at, ov, mul(ov, d_a_rows > d_a_shared ? d_a_rows : d_a_shared, a));
  p->tok = take(&at, ov, MUL3(ov, T, max2(H, E + 1), r));
  p->dlogits = take(&at, ov, MUL3(ov, T, E, a));
  p->dg = take(&at, ov, MUL3(ov, T, K, r));
  p->tree = take(&at, ov, MUL3(ov, p->tree_len, p->tree_vectors, r));
  p->shared_a = take(&at, ov, mul(ov, MUL3(ov, redo * T, 2, Fs), a));
  p->shared_h = take(&at, ov, MUL3(ov, redo * T, Fs, a));
  p->a_rows = take(&at, ov, mul(ov, MUL3(ov, redo * cap, 2, F), a));
  p->h_rows = take(&at, ov, MUL3(ov, redo * cap, F, a));
  const int64_t gated = c->use_shared_gate != 0;
  p->shared_dy = take(&at, ov, MUL3(ov, gated * T, H, a));
  p->shared_dl = take(&at, ov, MUL3(ov, gated * T, 1, a));
  p->total = at;
}
