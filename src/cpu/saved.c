/* saved.c — the CPU backend's saved buffer as a backward may trust it: the header the
 * forward writes (who wrote it, for which shape, which step), and the check a backward
 * makes of the header and of every index it will read (counts, experts, row positions)
 * before it reads or writes anything. Whatever the caller's buffer holds, a backward
 * then either runs on indices the forward could have written, or returns
 * MOK_STATUS_INVALID_SAVED with every output untouched. */
#include <stdio.h>
#include <string.h>

#include "../internal.h"
#include "cpu_comm.h"

static void header_shape(const mok_context_t* ctx, int64_t shape[8]) {
  const mok_config_t* c = &ctx->cfg;
  const int64_t v[8] = {c->T, c->H, c->F, c->E, c->K, c->Fs, c->W, c->rank};
  memcpy(shape, v, sizeof v);
}

void mok_saved_header_write(mok_context_t* ctx, mok_saved_header_t* h, int64_t T, const int64_t* T_all) {
  h->magic = MOK_SAVED_MAGIC;
  h->context_serial = ctx->serial;
  h->serial = ++ctx->forward_serial;
  h->T = T;
  header_shape(ctx, h->shape);
  memcpy(h->T_all, T_all, (size_t)ctx->cfg.W * sizeof(int64_t));
}

#define SAVED_ERR(...) MOK_ERR(ctx, MOK_STATUS_INVALID_SAVED, "mok_backward: " __VA_ARGS__)

static mok_status_t check_header(mok_context_t* ctx, const mok_saved_header_t* h, int64_t T) {
  const mok_config_t* c = &ctx->cfg;
  if (h->magic == MOK_SAVED_USED && h->context_serial == ctx->serial)
    return SAVED_ERR("args->saved was used up by an earlier mok_backward (cfg.saved_use = MOK_SAVED_REUSE); "
                     "run mok_forward again, or keep it with MOK_SAVED_KEEP");
  if (h->magic != MOK_SAVED_MAGIC || h->context_serial != ctx->serial)
    return SAVED_ERR("args->saved was not written by mok_forward on this context");
  if (h->serial < 1 || h->serial > ctx->forward_serial)
    return SAVED_ERR("args->saved names forward %llu of this context, which has run %llu forwards",
                     (unsigned long long)h->serial, (unsigned long long)ctx->forward_serial);
  int64_t shape[8];
  header_shape(ctx, shape);
  if (memcmp(shape, h->shape, sizeof shape) != 0)
    return SAVED_ERR("args->saved holds another shape than this context's (cfg T, H, F, E, K, Fs, W, rank)");
  if (h->T != T)
    return SAVED_ERR("args->num_tokens = %lld, but the forward that wrote args->saved had %lld", (long long)T,
                     (long long)h->T);
  for (int r = 0; r < c->W; r++)
    if (h->T_all[r] < 0 || h->T_all[r] > ctx->T_all[r] || (r == c->rank && h->T_all[r] != T))
      return SAVED_ERR("args->saved gives rank %d %lld tokens, outside [0, its cfg.T = %lld]%s", r,
                       (long long)h->T_all[r], (long long)ctx->T_all[r], r == c->rank ? " or not num_tokens" : "");
  return MOK_STATUS_SUCCESS;
}

/* The indices of saved against the layout the forward makes of them (layer_impl.h,
 * forward steps 1-3): every rank's counts add up to its K T slots and fit each owner's
 * capacity, this rank's experts are distinct and in [0, E) per token and count up to its
 * counts, and each slot's row position is the one the forward gives it. */
static mok_status_t check_indices(mok_context_t* ctx, const mok_saved_header_t* h, const int32_t* counts_all,
                                  const int32_t* idx, const int32_t* pos, int64_t T) {
  const mok_config_t* c = &ctx->cfg;
  const int64_t E = c->E, K = c->K, W = c->W, El = ctx->E_loc, me = c->rank;
  for (int64_t r = 0; r < W; r++) {
    int64_t sum = 0;
    for (int64_t e = 0; e < E; e++) {
      if (counts_all[r * E + e] < 0)
        return SAVED_ERR("args->saved's count of rank %lld for expert %lld is %d < 0", (long long)r, (long long)e,
                         counts_all[r * E + e]);
      sum += counts_all[r * E + e];
    }
    if (sum != h->T_all[r] * K)
      return SAVED_ERR("args->saved's counts of rank %lld add up to %lld rows, not its K T = %lld", (long long)r,
                       (long long)sum, (long long)(h->T_all[r] * K));
  }
  int64_t cursor[MOK_MAX_EXPERTS]; /* expert e's next row in its owner's buffer, this rank's slots */
  for (int64_t o = 0; o < W; o++) {
    int64_t rows = 0;
    for (int64_t e = o * El; e < (o + 1) * El; e++) {
      cursor[e] = rows; /* expert e's block starts here; then the ranks before this one */
      for (int64_t r = 0; r < me; r++) cursor[e] += counts_all[r * E + e];
      for (int64_t r = 0; r < W; r++) rows += counts_all[r * E + e];
    }
    const int64_t cap = ctx->comm->rank[o].ctx->cfg.capacity;
    if (rows > cap)
      return SAVED_ERR("args->saved sends %lld rows to rank %lld, above its capacity of %lld", (long long)rows,
                       (long long)o, (long long)cap);
  }
  int64_t seen[MOK_MAX_EXPERTS]; /* the last token that chose e, + 1 */
  memset(seen, 0, sizeof seen);
  int64_t mine[MOK_MAX_EXPERTS] = {0};
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < K; j++) {
      const int64_t i = t * K + j, e = idx[i];
      if (e < 0 || e >= E)
        return SAVED_ERR("args->saved's topk_idx[%lld, %lld] = %lld is outside [0, E = %lld)", (long long)t,
                         (long long)j, (long long)e, (long long)E);
      if (seen[e] == t + 1)
        return SAVED_ERR("args->saved's topk_idx names expert %lld twice for token %lld", (long long)e, (long long)t);
      seen[e] = t + 1;
      if (++mine[e] > counts_all[me * E + e])
        return SAVED_ERR("args->saved's topk_idx sends more rows to expert %lld than its count %d", (long long)e,
                         counts_all[me * E + e]);
      if (pos[i] != cursor[e])
        return SAVED_ERR("args->saved's row position of slot (%lld, %lld) is %d, not the forward's %lld",
                         (long long)t, (long long)j, pos[i], (long long)cursor[e]);
      cursor[e]++;
    }
  return MOK_STATUS_SUCCESS; /* (the counts add up to K T and none is exceeded: all equal) */
}

mok_status_t mok_cpu_saved_check(mok_context_t* ctx, const mok_backward_args_t* a) {
  const mok_config_t* c = &ctx->cfg;
  const mok_saved_header_t* h = a->saved;
  mok_status_t s = check_header(ctx, h, a->num_tokens);
  mok_saved_plan_t sp;
  mok_plan_saved(ctx, c->T, &sp);
  const int32_t* counts_all = (const int32_t*)((const char*)a->saved + sp.counts_all);
  if (!s)
    s = check_indices(ctx, h, counts_all, (const int32_t*)((const char*)a->saved + sp.topk_idx),
                      (const int32_t*)((const char*)a->saved + sp.slot_pos), a->num_tokens);
  if (c->W == 1) return s;
  /* W > 1: one verdict for all, before any rank writes into a peer's buffers (value[1] and
   * slot[2] are next written by the next backward's check, after this one's barriers) */
  mok_comm_rank_t* rank = ctx->comm->rank;
  rank[c->rank].value[1] = s;
  rank[c->rank].slot[2] = counts_all;
  mok_status_t b = mok_cpu_comm_barrier(ctx->comm, ctx);
  if (b) return b;
  for (int r = 0; r < c->W; r++)
    if (rank[r].value[1] != MOK_STATUS_SUCCESS)
      return s ? s
               : SAVED_ERR("rank %d's args->saved failed its check (that rank's message says why): no rank runs this "
                           "backward", r);
  /* every rank's copy of every rank's counts is the same step's: each rank compares all
   * copies with rank 0's, so all come to one verdict; the barrier after it keeps every
   * saved buffer alive until nobody reads it */
  int differ = -1;
  for (int r = 1; r < c->W && differ < 0; r++)
    if (memcmp(rank[r].slot[2], rank[0].slot[2], (size_t)(c->W * c->E) * 4) != 0) differ = r;
  b = mok_cpu_comm_barrier(ctx->comm, ctx);
  if (b) return b;
  if (differ >= 0)
    return SAVED_ERR("rank %d's args->saved holds other counts of the step than rank 0's: the ranks' saved buffers "
                     "are not from one forward",
                     differ);
  return MOK_STATUS_SUCCESS;
}
