/* plan.c — byte layout of the saved buffer and the workspace (see internal.h), for
 * the context's maximum T. Element sizes follow the numerics: act 2 / real 4 bytes
 * (bf16, fp32), or 8 / 8 in EXACT numerics. */
#include "internal.h"

static size_t take(size_t* at, size_t bytes) {
  size_t here = *at;
  *at += (bytes + MOK_ALIGN_WORKSPACE - 1) / MOK_ALIGN_WORKSPACE * MOK_ALIGN_WORKSPACE;
  return here;
}

static int64_t max2(int64_t a, int64_t b) { return a > b ? a : b; }

void mok_plan_saved(const mok_context_t* ctx, int64_t T, mok_saved_plan_t* p) {
  const mok_config_t* c = &ctx->cfg;
  const size_t a = (size_t)ctx->act_size, r = (size_t)ctx->real_size;
  const int64_t cap = c->capacity;
  size_t at = 0;
  take(&at, sizeof(mok_saved_header_t));
  p->counts_all = take(&at, (size_t)c->W * c->E * 4);
  p->topk_idx = take(&at, (size_t)(T * c->K) * 4);
  p->slot_pos = take(&at, (size_t)(T * c->K) * 4);
  p->topk_weight = take(&at, (size_t)(T * c->K) * r);
  p->logits = take(&at, c->routing == MOK_ROUTING_FUSED ? (size_t)(T * c->E) * r : 0);
  p->o_slots = take(&at, (size_t)(T * c->K * c->H) * a);
  const int64_t keep = c->gate_up == MOK_GATE_UP_SAVE; /* else in the workspace */
  p->shared_a = take(&at, (size_t)(keep * T * 2 * c->Fs) * a);
  p->shared_h = take(&at, (size_t)(keep * T * c->Fs) * a);
  p->x_rows = take(&at, (size_t)(cap * c->H) * a);
  p->a_rows = take(&at, (size_t)(keep * cap * 2 * c->F) * a);
  p->h_rows = take(&at, (size_t)(keep * cap * c->F) * a);
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
  int64_t chunks = 0;
  for (int i = 0; i < c->W; i++)
    chunks += (ctx->T_all[i] + MOK_REDUCE_CHUNK_TOKENS - 1) / MOK_REDUCE_CHUNK_TOKENS;
  /* replicated sums: [E + 1] loss statistics (forward), [E*H | 2Fs*H | H*Fs] gradients */
  p->tree_len = max2(E + 1, E * H + 3 * Fs * H);
  /* own maximal nodes (<= 2 per level), a partial per level while summing one of them,
   * and the output plus a partial per level while combining all ranks' nodes */
  p->tree_vectors = 4 * mok_tree_depth(chunks) + 1;
  const int64_t row_width = max2(max2(2 * F, H), 2 * Fs);
  size_t at = 0;
  p->logits = take(&at, (size_t)(T * E) * r);
  p->idx = take(&at, (size_t)(T * K) * 4);
  p->weight = take(&at, (size_t)(T * K) * r);
  p->slot_pos = take(&at, (size_t)(T * K) * 4);
  p->counts = take(&at, (size_t)(c->W + 1) * E * 4);
  p->gemm_out = take(&at, (size_t)max2(MOK_ROW_BLOCK * row_width, max2(2 * F * H, 2 * Fs * H)) * r);
  p->d_a = take(&at, (size_t)max2(cap * 2 * F, T * 2 * Fs) * a);
  p->tok = take(&at, (size_t)(T * max2(H, E + 1)) * r);
  p->dlogits = take(&at, (size_t)(T * E) * a);
  p->dg = take(&at, (size_t)(T * K) * r);
  p->tree = take(&at, (size_t)(p->tree_len * p->tree_vectors) * r);
  const int64_t redo = c->gate_up == MOK_GATE_UP_RECOMPUTE; /* else in saved */
  p->shared_a = take(&at, (size_t)(redo * T * 2 * Fs) * a);
  p->shared_h = take(&at, (size_t)(redo * T * Fs) * a);
  p->a_rows = take(&at, (size_t)(redo * cap * 2 * F) * a);
  p->h_rows = take(&at, (size_t)(redo * cap * F) * a);
  p->total = at;
}
