/* layer_impl.h — the MoE layer on the CPU: forward and backward of DESIGN.md section 1
 * for one rank of W, exchanging rows with its peers through the in-process
 * communicator. Included once per numerics by layer.c with
 *   FN(name)  a name for this numerics, ACT the activation element (bf16 bits, or
 *   double), REAL the accumulator (fp32, or double), LD(v) ACT -> REAL,
 *   ST(v) REAL -> ACT (the bf16 rounding points), EXP/LOG, GEMM the matching gemm.h call.
 *
 * Order of every sum (fixed, whatever the thread count or W):
 *   GEMM dot products: increasing k (gemm.h).
 *   softmax denominator, normalise sum, loss statistics over e: increasing e / slot j.
 *   group score (group-limited routing): key1 + key2, one addition.
 *   combine y[t] = ((g0*o0 + g1*o1) + ...) + shared(x[t]), slots in slot order.
 *   dx[t] = ((dx_0 + dx_1) + ...) + router path + shared path.
 *   expert weight gradients: over the expert's rows in global token order (all rows
 *   of an expert live on its owner, in that order, whatever W is).
 *   router logit bias: logits = (x w_router^T) + b_router, one addition after the sum.
 *   expert biases: a = bf16((x w13^T) + b13), o = bf16((h w2^T) + b2), likewise; their
 *   gradients d_b13, d_b2 sum d_a and dy_j over the expert's rows in global token order
 *   (the rows of the weight gradients' sums, in their order).
 *   clamped SwiGLU: h = bf16((up' + 1) * (gate' * sigmoid(alpha * gate'))), in that order.
 *   shared-expert gate: s_g = sigmoid(x[t]·w_sg), the dot product over increasing h;
 *   y[t] = (routed slots) + s_g * o_s; dx[t] = (... + shared path) + dl_g * w_sg;
 *   d_w_sg a replicated sum as d_w_router's.
 *   replicated sums (loss statistics, router and shared-expert gradients): a partial per
 *   chunk of MOK_REDUCE_CHUNK_TOKENS tokens (increasing t), combined by the fixed tree
 *   of mok_tree_mid over the global chunk list; each rank sums the subtrees inside its
 *   own chunks, and every rank combines all ranks' subtrees by the same tree. */

typedef struct {
  int64_t lo, hi;   /* chunk range [lo, hi) */
  const REAL* v;    /* its sum */
} FN(node_t);

typedef struct {
  mok_context_t* ctx;
  mok_cpu_comm_t* comm;
  int64_t T, H, F, E, K, Fs, El, W, me, cap;
  int nt;
  /* saved */
  mok_saved_header_t* hdr;
  int32_t* counts_all; /* [W, E] */
  int32_t* idx;        /* [T, K] */
  int32_t* pos;        /* [T, K] */
  REAL* g;             /* [T, K] */
  REAL* logits;        /* [T, E] */
  ACT* o_slots;        /* [T, K, H] */
  ACT* sa;             /* [T, 2Fs] */
  ACT* sh;             /* [T, Fs] */
  ACT* x_rows;         /* [cap, H] */
  ACT* a_rows;         /* [cap, 2F] */
  ACT* h_rows;         /* [cap, F] */
  /* workspace */
  mok_workspace_plan_t wp;
  char* ws;
  /* the replicated-sum tree of this step */
  int64_t chunk_lo[MOK_MAX_RANKS + 1]; /* rank r's chunks are [chunk_lo[r], chunk_lo[r+1]) */
  FN(node_t) nodes[2 * 64];            /* this rank's maximal subtrees */
  int num_nodes;
  int64_t vec_len;                     /* length of the vectors being reduced */
  const void* leaf_ctx;
  void (*leaf)(const void* leaf_ctx, int64_t local_chunk, REAL* out);
} FN(step_t);

#define WS(st, field, type) ((type*)((st)->ws + (st)->wp.field))

static REAL* FN(tree_buf)(FN(step_t)* st, int64_t i) {
  return WS(st, tree, REAL) + i * st->wp.tree_len;
}

static void FN(setup)(FN(step_t)* st, mok_context_t* ctx, void* saved, void* ws, int64_t T) {
  const mok_config_t* c = &ctx->cfg;
  memset(st, 0, sizeof *st);
  st->ctx = ctx;
  st->comm = ctx->comm;
  st->T = T, st->H = c->H, st->F = c->F, st->E = c->E, st->K = c->K, st->Fs = c->Fs;
  st->El = ctx->E_loc, st->W = c->W, st->me = c->rank, st->cap = c->capacity;
  st->nt = c->num_threads;
  mok_saved_plan_t sp;
  mok_plan_saved(ctx, c->T, &sp);
  char* s = saved;
  st->hdr = (mok_saved_header_t*)s;
  st->counts_all = (int32_t*)(s + sp.counts_all);
  st->idx = (int32_t*)(s + sp.topk_idx);
  st->pos = (int32_t*)(s + sp.slot_pos);
  st->g = (REAL*)(s + sp.topk_weight);
  st->logits = (REAL*)(s + sp.logits);
  st->o_slots = (ACT*)(s + sp.o_slots);
  st->x_rows = (ACT*)(s + sp.x_rows);
  mok_plan_workspace(ctx, c->T, &st->wp);
  st->ws = ws;
  /* gate|up and the SwiGLU output: kept in saved, or in this call's workspace */
  const int keep = c->gate_up == MOK_GATE_UP_SAVE;
  char* gu = keep ? s : ws;
  st->sa = (ACT*)(gu + (keep ? sp.shared_a : st->wp.shared_a));
  st->sh = (ACT*)(gu + (keep ? sp.shared_h : st->wp.shared_h));
  st->a_rows = (ACT*)(gu + (keep ? sp.a_rows : st->wp.a_rows));
  st->h_rows = (ACT*)(gu + (keep ? sp.h_rows : st->wp.h_rows));
}

static mok_status_t FN(sync)(FN(step_t)* st) { return mok_cpu_comm_barrier(st->comm, st->ctx); }
static mok_context_t* FN(peer)(FN(step_t)* st, int64_t r) { return st->comm->rank[r].ctx; }

/* Runs C = A(m, k) B(k, n) with this context's threads. */
static void FN(gemm)(FN(step_t)* st, int64_t M, int64_t N, int64_t K, const ACT* A, int64_t a_m,
                     int64_t a_k, const ACT* B, int64_t b_k, int64_t b_n, REAL* C, int64_t ldc) {
  mok_gemm_t g = {M, N, K, A, a_m, a_k, B, b_k, b_n, C, ldc};
  GEMM(&g, st->ctx->pack, st->nt);
}

/* ---- the fixed replicated-sum tree ---- */

static int64_t FN(range_owner)(const FN(step_t)* st, int64_t lo, int64_t hi) {
  for (int64_t r = 0; r < st->W; r++)
    if (lo >= st->chunk_lo[r] && hi <= st->chunk_lo[r + 1]) return r;
  return -1;
}

/* Sum of chunks [lo, hi) inside this rank, into out; scratch from tree buffer `level`. */
static void FN(tree_local)(FN(step_t)* st, int64_t lo, int64_t hi, REAL* out, int64_t level) {
  if (hi - lo == 1) {
    st->leaf(st->leaf_ctx, lo - st->chunk_lo[st->me], out);
    return;
  }
  const int64_t mid = mok_tree_mid(lo, hi), n = st->vec_len;
  REAL* right = FN(tree_buf)(st, level);
  FN(tree_local)(st, lo, mid, out, level + 1);
  FN(tree_local)(st, mid, hi, right, level + 1);
#pragma omp parallel for schedule(static) num_threads(st->nt)
  for (int64_t i = 0; i < n; i++) out[i] = out[i] + right[i];
}

/* Finds the maximal subtrees inside this rank's chunks and sums each one. */
static void FN(tree_collect)(FN(step_t)* st, int64_t lo, int64_t hi, int64_t depth) {
  const int64_t mine_lo = st->chunk_lo[st->me], mine_hi = st->chunk_lo[st->me + 1];
  if (hi <= lo || hi <= mine_lo || lo >= mine_hi) return;
  int64_t owner = FN(range_owner)(st, lo, hi);
  if (owner == st->me) {
    /* node buffers follow the 'depth' recursion scratch buffers */
    REAL* out = FN(tree_buf)(st, depth + st->num_nodes);
    FN(tree_local)(st, lo, hi, out, 0);
    st->nodes[st->num_nodes++] = (FN(node_t)){lo, hi, out};
    return;
  }
  const int64_t mid = mok_tree_mid(lo, hi);
  FN(tree_collect)(st, lo, mid, depth);
  FN(tree_collect)(st, mid, hi, depth);
}

/* Combines every rank's published subtrees into out by the same tree. */
static void FN(tree_combine)(FN(step_t)* st, int64_t lo, int64_t hi, REAL* out, REAL* scratch,
                             int64_t level) {
  const int64_t n = st->vec_len;
  int64_t owner = FN(range_owner)(st, lo, hi);
  if (owner >= 0) {
    const FN(step_t)* os = st->comm->rank[owner].slot[0];
    for (int i = 0; i < os->num_nodes; i++)
      if (os->nodes[i].lo == lo && os->nodes[i].hi == hi) {
        memcpy(out, os->nodes[i].v, (size_t)n * sizeof(REAL));
        return;
      }
  }
  const int64_t mid = mok_tree_mid(lo, hi);
  REAL* right = scratch + level * st->wp.tree_len;
  FN(tree_combine)(st, lo, mid, out, scratch, level + 1);
  FN(tree_combine)(st, mid, hi, right, scratch, level + 1);
#pragma omp parallel for schedule(static) num_threads(st->nt)
  for (int64_t i = 0; i < n; i++) out[i] = out[i] + right[i];
}

/* The replicated sum of one vector of length n over all ranks' chunks, into out (a
 * tree buffer). T_all gives every rank's tokens. Two barriers: publish, then release. */
static mok_status_t FN(tree_sum)(FN(step_t)* st, const int64_t* T_all, int64_t n,
                                 const void* leaf_ctx,
                                 void (*leaf)(const void*, int64_t, REAL*), REAL** result) {
  const int64_t C = MOK_REDUCE_CHUNK_TOKENS;
  st->chunk_lo[0] = 0;
  for (int64_t r = 0; r < st->W; r++) st->chunk_lo[r + 1] = st->chunk_lo[r] + (T_all[r] + C - 1) / C;
  const int64_t N = st->chunk_lo[st->W], depth = mok_tree_depth(N);
  st->vec_len = n;
  st->leaf = leaf;
  st->leaf_ctx = leaf_ctx;
  st->num_nodes = 0;
  FN(tree_collect)(st, 0, N, depth);
  st->comm->rank[st->me].slot[0] = st;
  mok_status_t s = FN(sync)(st);
  if (s) return s;
  /* after this rank's nodes: the output, then a partial per level */
  REAL* out = FN(tree_buf)(st, depth + st->num_nodes);
  if (N == 0)
    memset(out, 0, (size_t)n * sizeof(REAL));
  else
    FN(tree_combine)(st, 0, N, out, out + st->wp.tree_len, 0);
  *result = out;
  return FN(sync)(st); /* peers may still read this rank's nodes */
}

/* ---- routing ---- */

/* scores of one token from its logits: s[e], and logsumexp(logits) */
static REAL FN(scores)(const mok_config_t* c, const REAL* l, REAL* s, int64_t E) {
  REAL m = l[0];
  for (int64_t e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
  REAL sum = 0;
  for (int64_t e = 0; e < E; e++) sum = sum + EXP(l[e] - m);
  for (int64_t e = 0; e < E; e++)
    s[e] = c->score == MOK_SCORE_SOFTMAX ? EXP(l[e] - m) / sum : (REAL)1 / ((REAL)1 + EXP(-l[e]));
  return m + LOG(sum);
}

/* Is key a (index ia) ahead of key b (index ib) in the top-K order? Larger first, ties
 * to the lower index; NaN after every number, so that a NaN token still picks K experts. */
static int FN(ahead)(REAL a, int64_t ia, REAL b, int64_t ib) {
  if (a != a) return b != b && ia < ib;
  if (b != b) return 1;
  return a > b || (a == b && ia < ib);
}

/* Group-limited routing (cfg.n_group > 1, mok.h): marks every expert outside the
 * topk_group best groups in `out`, so that the top-K chooses among the kept groups'
 * experts only. key: [E] selection keys. A group's score is key1 + key2, its two
 * largest keys in `ahead` order (one addition: its bits do not depend on the order of
 * the two), or key1 (MOK_GROUP_SCORE_MAX, or a group of one expert); groups are kept
 * best first by `ahead` on their scores (larger first, ties to the lower group index,
 * NaN last). */
static void FN(group_limit)(const mok_config_t* c, const REAL* key, int64_t E, unsigned char* out) {
  const int64_t G = c->n_group, size = E / G;
  REAL score[MOK_MAX_EXPERTS];
  unsigned char kept[MOK_MAX_EXPERTS];
  for (int64_t grp = 0; grp < G; grp++) {
    const REAL* k = key + grp * size;
    int64_t first = 0, second = -1;
    for (int64_t i = 1; i < size; i++) {
      if (FN(ahead)(k[i], i, k[first], first)) second = first, first = i;
      else if (second < 0 || FN(ahead)(k[i], i, k[second], second)) second = i;
    }
    const int top2 = c->group_score == MOK_GROUP_SCORE_TOP2 && second >= 0;
    score[grp] = top2 ? k[first] + k[second] : k[first];
    kept[grp] = 0;
  }
  for (int64_t n = 0; n < c->topk_group; n++) {
    int64_t best = -1;
    for (int64_t grp = 0; grp < G; grp++)
      if (!kept[grp] && (best < 0 || FN(ahead)(score[grp], grp, score[best], best))) best = grp;
    kept[best] = 1;
  }
  for (int64_t e = 0; e < E; e++) out[e] = !kept[e / size];
}

typedef struct {
  const FN(step_t)* st;
  const REAL* scores; /* [T, E + 1]: s then logsumexp */
} FN(stats_leaf_t);

/* loss statistics of one chunk: [sum_t s[t, e] for each e, sum_t lse_t^2], increasing t */
static void FN(stats_leaf)(const void* p, int64_t chunk, REAL* out) {
  const FN(stats_leaf_t)* L = p;
  const int64_t E = L->st->E, t0 = chunk * MOK_REDUCE_CHUNK_TOKENS;
  int64_t t1 = t0 + MOK_REDUCE_CHUNK_TOKENS;
  if (t1 > L->st->T) t1 = L->st->T;
  for (int64_t e = 0; e <= E; e++) out[e] = 0;
  for (int64_t t = t0; t < t1; t++) {
    const REAL* s = L->scores + t * (E + 1);
    for (int64_t e = 0; e < E; e++) out[e] = out[e] + s[e];
    out[E] = out[E] + s[E] * s[E];
  }
}

/* ---- gate|up and SwiGLU: forward, and backward again under MOK_GATE_UP_RECOMPUTE (the
 * same blocks, so the same bits as forward kept) ---- */

/* The clamped SwiGLU's clamps (mok.h): gate' = min(gate, limit), up' = clamp(up, -limit,
 * limit), NaN kept. */
static REAL FN(clamp_gate)(REAL g, REAL limit) { return g > limit ? limit : g; }
static REAL FN(clamp_up)(REAL u, REAL limit) { return u > limit ? limit : u < -limit ? -limit : u; }

/* One block of n rows of x [n, H]: a = bf16(x w13^T (+ b13)) [n, 2F] (gate | up), then
 * h = bf16(silu(gate) up) [n, F], or the clamped SwiGLU's h (clamped: the routed experts
 * under MOK_ACTIVATION_SWIGLU_CLAMPED). b13: [2F] expert bias or NULL. acc: [n, 2F] real
 * scratch. */
static void FN(gate_up_block)(FN(step_t)* st, int64_t n, int64_t F, const ACT* x, const ACT* w13,
                              const ACT* b13, int clamped, ACT* ar, ACT* hr, REAL* acc) {
  const REAL alpha = (REAL)st->ctx->cfg.swiglu_alpha, limit = (REAL)st->ctx->cfg.swiglu_limit;
  FN(gemm)(st, n, 2 * F, st->H, x, st->H, 1, w13, 1, st->H, acc, 2 * F);
#pragma omp parallel for schedule(static) num_threads(st->nt)
  for (int64_t i = 0; i < n; i++)
    for (int64_t f = 0; f < F; f++) {
      REAL* ai = acc + i * 2 * F;
      if (b13) /* the expert bias: one addition after the dot product, before the rounding */
        ai[f] = ai[f] + LD(b13[f]), ai[F + f] = ai[F + f] + LD(b13[F + f]);
      ar[i * 2 * F + f] = ST(ai[f]);
      ar[i * 2 * F + F + f] = ST(ai[F + f]);
      REAL gate = LD(ar[i * 2 * F + f]), up = LD(ar[i * 2 * F + F + f]);
      if (clamped) {
        const REAL g = FN(clamp_gate)(gate, limit), u = FN(clamp_up)(up, limit);
        const REAL sg = (REAL)1 / ((REAL)1 + EXP(-(alpha * g)));
        hr[i * F + f] = ST((u + (REAL)1) * (g * sg));
      } else {
        hr[i * F + f] = ST(gate / ((REAL)1 + EXP(-gate)) * up);
      }
    }
}

/* Rows of the block at row b of n (MOK_ROW_BLOCK at most): forward and a recomputing
 * backward split alike. */
static int64_t FN(block_rows)(int64_t n, int64_t b) { return n - b < MOK_ROW_BLOCK ? n - b : MOK_ROW_BLOCK; }

/* The shared-expert gate of a token (use_shared_gate): sigmoid(x · w_sg), the dot
 * product's sum over increasing h from +0 (the GEMM's order), not rounded. */
static REAL FN(shared_gate)(const ACT* x, const ACT* w_sg, int64_t H) {
  REAL l = 0;
  for (int64_t h = 0; h < H; h++) l = l + LD(x[h]) * LD(w_sg[h]);
  return (REAL)1 / ((REAL)1 + EXP(-l));
}

/* ---- forward ---- */

static mok_status_t FN(forward)(mok_context_t* ctx, const mok_forward_args_t* a) {
  const mok_config_t* c = &ctx->cfg;
  FN(step_t) S, *st = &S;
  FN(setup)(st, ctx, a->saved, a->workspace, a->num_tokens);
  const int64_t T = st->T, H = st->H, F = st->F, E = st->E, K = st->K, Fs = st->Fs;
  const int64_t El = st->El, W = st->W, me = st->me;
  const int fused = c->routing == MOK_ROUTING_FUSED;
  const int losses = fused && (c->aux_loss_coef != 0 || c->z_loss_coef != 0);
  const int clamped = c->activation == MOK_ACTIVATION_SWIGLU_CLAMPED; /* (routed experts only) */
  const ACT* x = a->x;
  REAL* logits = WS(st, logits, REAL);  /* [T, E] */
  int32_t* idx = WS(st, idx, int32_t);  /* [T, K] */
  REAL* g = WS(st, weight, REAL);       /* [T, K] */
  int32_t* pos = WS(st, slot_pos, int32_t);
  int32_t* counts = WS(st, counts, int32_t); /* [E] this rank, then [W, E] all ranks */
  REAL* scores = WS(st, tok, REAL);     /* [T, E + 1] */

  /* 1. routing: logits = x w_router^T (+ b_router), scores, top-K, weights */
  if (fused) {
    FN(gemm)(st, T, E, H, x, H, 1, a->w_router, 1, H, logits, E);
#pragma omp parallel for schedule(static) num_threads(st->nt)
    for (int64_t t = 0; t < T; t++) {
      REAL* s = scores + t * (E + 1);
      if (c->use_router_bias) /* the logit bias: one addition after the dot product */
        for (int64_t e = 0; e < E; e++) logits[t * E + e] = logits[t * E + e] + ((const REAL*)a->b_router)[e];
      s[E] = FN(scores)(c, logits + t * E, s, E);
      /* selection keys s + bias_select; chosen: taken, or outside the kept groups */
      REAL key[MOK_MAX_EXPERTS];
      for (int64_t e = 0; e < E; e++) key[e] = c->use_bias_select ? s[e] + ((const REAL*)a->bias_select)[e] : s[e];
      unsigned char chosen[MOK_MAX_EXPERTS];
      if (c->n_group > 1) FN(group_limit)(c, key, E, chosen);
      else memset(chosen, 0, (size_t)E);
      for (int64_t j = 0; j < K; j++) { /* (K <= the kept groups' experts: one is always left) */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
          if (!chosen[e] && (best < 0 || FN(ahead)(key[e], e, key[best], best))) best = e;
        chosen[best] = 1;
        idx[t * K + j] = (int32_t)best;
        g[t * K + j] = s[best];
      }
      if (c->normalize) {
        REAL sum = 0;
        for (int64_t j = 0; j < K; j++) sum = sum + g[t * K + j];
        for (int64_t j = 0; j < K; j++) g[t * K + j] = g[t * K + j] / sum;
      }
      for (int64_t j = 0; j < K; j++) g[t * K + j] = g[t * K + j] * (REAL)c->route_scale;
    }
  } else {
    if (T > 0) memcpy(idx, a->topk_idx, (size_t)(T * K) * 4);
    if (T > 0) memcpy(g, a->topk_weight, (size_t)(T * K) * sizeof(REAL));
  }
  memset(counts, 0, (size_t)E * 4);
  for (int64_t i = 0; i < T * K; i++) counts[idx[i]]++;

  /* 2. every rank's counts and tokens reach every rank; global loss statistics */
  mok_comm_rank_t* pub = &st->comm->rank[me];
  pub->slot[1] = counts;
  pub->value[0] = T;
  mok_status_t s = FN(sync)(st);
  if (s) return s;
  int64_t T_all[MOK_MAX_RANKS], T_global = 0;
  int32_t* counts_all = counts + E; /* [W, E] */
  for (int64_t r = 0; r < W; r++) {
    T_all[r] = st->comm->rank[r].value[0];
    T_global += T_all[r];
    memcpy(counts_all + r * E, st->comm->rank[r].slot[1], (size_t)E * 4);
  }
  s = FN(sync)(st); /* everyone has read the counts */
  if (s) return s;
  int64_t expert_off[MOK_MAX_EXPERTS + 1]; /* expert e's first row in its owner's buffer */
  for (int64_t o = 0; o < W; o++) {
    int64_t rows = 0;
    for (int64_t e = o * El; e < (o + 1) * El; e++) {
      expert_off[e] = rows;
      for (int64_t r = 0; r < W; r++) rows += counts_all[r * E + e];
    }
    int64_t cap = FN(peer)(st, o)->cfg.capacity;
    if (rows > cap)
      return MOK_ERR(ctx, MOK_STATUS_CAPACITY_EXCEEDED,
                     "rank %lld would receive %lld rows, above its capacity of %lld rows "
                     "(config capacity)",
                     (long long)o, (long long)rows, (long long)cap);
  }
  REAL aux = 0, zl = 0;
  if (losses && T_global > 0) { /* (a step of no tokens on any rank: no loss, 0) */
    FN(stats_leaf_t) L = {st, scores};
    REAL* tot;
    s = FN(tree_sum)(st, T_all, E + 1, &L, FN(stats_leaf), &tot);
    if (s) return s;
    /* aux = alpha * E * sum_e f_e P_e, increasing e; f_e = count_e / (T K), P_e = sum / T */
    for (int64_t e = 0; e < E; e++) {
      int64_t n_e = 0;
      for (int64_t r = 0; r < W; r++) n_e += counts_all[r * E + e];
      REAL f = (REAL)n_e / (REAL)(T_global * K), P = tot[e] / (REAL)T_global;
      aux = aux + f * P;
    }
    aux = (REAL)c->aux_loss_coef * (REAL)E * aux;
    zl = (REAL)c->z_loss_coef * (tot[E] / (REAL)T_global);
  }

  /* 3. positions in global token order: expert block, then source rank, then token */
  {
    int64_t cursor[MOK_MAX_EXPERTS];
    for (int64_t e = 0; e < E; e++) {
      cursor[e] = expert_off[e];
      for (int64_t r = 0; r < me; r++) cursor[e] += counts_all[r * E + e];
    }
    for (int64_t i = 0; i < T * K; i++) pos[i] = (int32_t)cursor[idx[i]]++;
  }
  /* the step will go through: from here on the saved buffer is written */
  memcpy(st->counts_all, counts_all, (size_t)(W * E) * 4);
  memcpy(st->idx, idx, (size_t)(T * K) * 4);
  memcpy(st->pos, pos, (size_t)(T * K) * 4);
  memcpy(st->g, g, (size_t)(T * K) * sizeof(REAL));
  if (fused) memcpy(st->logits, logits, (size_t)(T * E) * sizeof(REAL));

  /* 4. dispatch: x rows straight into the owners' receive buffers */
#pragma omp parallel for schedule(static) num_threads(st->nt)
  for (int64_t i = 0; i < T * K; i++) {
    ACT* dst = (ACT*)FN(peer)(st, idx[i] / El)->recv_rows + (int64_t)pos[i] * H;
    memcpy(dst, x + (i / K) * H, (size_t)H * sizeof(ACT));
  }
  s = FN(sync)(st);
  if (s) return s;

  /* 5. this rank's experts: a = x w13^T, h = silu(gate) * up, o = h w2^T */
  int64_t rows_recv = 0;
  for (int64_t e = me * El; e < (me + 1) * El; e++)
    for (int64_t r = 0; r < W; r++) rows_recv += counts_all[r * E + e];
  memcpy(st->x_rows, ctx->recv_rows, (size_t)(rows_recv * H) * sizeof(ACT));
  REAL* acc = WS(st, gemm_out, REAL);
  ACT* ret = ctx->ret_rows;
  for (int64_t le = 0; le < El; le++) {
    const int64_t e = me * El + le, r0 = expert_off[e];
    int64_t n = 0;
    for (int64_t r = 0; r < W; r++) n += counts_all[r * E + e];
    const ACT* w13 = (const ACT*)a->w13 + le * 2 * F * H;
    const ACT* w2 = (const ACT*)a->w2 + le * H * F;
    const ACT* b13 = c->use_expert_bias ? (const ACT*)a->b13 + le * 2 * F : NULL;
    const ACT* b2 = c->use_expert_bias ? (const ACT*)a->b2 + le * H : NULL;
    for (int64_t b = 0; b < n; b += MOK_ROW_BLOCK) {
      const int64_t rb = FN(block_rows)(n, b), row = r0 + b;
      ACT* hr = st->h_rows + row * F;
      FN(gate_up_block)(st, rb, F, st->x_rows + row * H, w13, b13, clamped, st->a_rows + row * 2 * F, hr, acc);
      FN(gemm)(st, rb, H, F, hr, F, 1, w2, 1, F, acc, H);
#pragma omp parallel for schedule(static) num_threads(st->nt)
      for (int64_t i = 0; i < rb * H; i++) /* o = bf16(h w2^T (+ b2)): one addition, then the rounding */
        ret[row * H + i] = ST(b2 ? acc[i] + LD(b2[i % H]) : acc[i]);
    }
  }
  /* shared expert on this rank's tokens: o_s = bf16(h_s ws2^T), kept in tok as REAL */
  REAL* shared_o = WS(st, tok, REAL); /* [T, H] (the scores are no longer needed) */
  for (int64_t b = 0; Fs > 0 && b < T; b += MOK_ROW_BLOCK) {
    const int64_t rb = FN(block_rows)(T, b);
    ACT* hr = st->sh + b * Fs;
    FN(gate_up_block)(st, rb, Fs, x + b * H, a->ws13, NULL, 0, st->sa + b * 2 * Fs, hr, acc);
    FN(gemm)(st, rb, H, Fs, hr, Fs, 1, a->ws2, 1, Fs, acc, H);
#pragma omp parallel for schedule(static) num_threads(st->nt)
    for (int64_t i = 0; i < rb * H; i++) shared_o[b * H + i] = LD(ST(acc[i]));
  }
  s = FN(sync)(st);
  if (s) return s;

  /* 6. combine: y[t] = bf16(sum_j g[t, j] o_j + (s_g) shared), slots in order */
  ACT* y = a->y;
#pragma omp parallel for schedule(static) num_threads(st->nt)
  for (int64_t t = 0; t < T; t++) {
    const ACT* o[MOK_MAX_EXPERTS];
    for (int64_t j = 0; j < K; j++) {
      int64_t i = t * K + j;
      o[j] = (const ACT*)FN(peer)(st, idx[i] / El)->ret_rows + (int64_t)pos[i] * H;
      memcpy(st->o_slots + i * H, o[j], (size_t)H * sizeof(ACT));
    }
    const REAL sg = c->use_shared_gate ? FN(shared_gate)(x + t * H, a->w_sg, H) : (REAL)1;
    for (int64_t h = 0; h < H; h++) {
      REAL sum = 0;
      for (int64_t j = 0; j < K; j++) sum = sum + g[t * K + j] * LD(o[j][h]);
      if (Fs > 0) sum = sum + (c->use_shared_gate ? sg * shared_o[t * H + h] : shared_o[t * H + h]);
      y[t * H + h] = ST(sum);
    }
  }
  if (a->tokens_per_expert)
    for (int64_t e = 0; e < E; e++) {
      int32_t n = 0;
      for (int64_t r = 0; r < W; r++) n += counts_all[r * E + e];
      a->tokens_per_expert[e] = n;
    }
  if (fused && a->topk_idx) memcpy(a->topk_idx, idx, (size_t)(T * K) * 4);
  if (fused && a->topk_weight) memcpy(a->topk_weight, g, (size_t)(T * K) * sizeof(REAL));
  if (a->aux_loss) *(REAL*)a->aux_loss = aux;
  if (a->z_loss) *(REAL*)a->z_loss = zl;
  mok_saved_header_write(ctx, st->hdr, T, T_all);
  /* peers read this rank's ret_rows in their combine: nobody may start writing them in
   * a next call before all are done, which that call's first barrier guarantees */
  return MOK_STATUS_SUCCESS;
}

/* ---- backward ---- */

/* weight gradient out: bf16 (or double) written, or added into fp32 (double) buffers */
static void FN(write_wgrad)(const FN(step_t)* st, void* dst, const REAL* v, int64_t n) {
  if (st->ctx->cfg.wgrad == MOK_WGRAD_FP32_ACCUM) {
    REAL* d = dst;
#pragma omp parallel for schedule(static) num_threads(st->nt)
    for (int64_t i = 0; i < n; i++) d[i] = d[i] + v[i];
  } else {
    ACT* d = dst;
#pragma omp parallel for schedule(static) num_threads(st->nt)
    for (int64_t i = 0; i < n; i++) d[i] = ST(v[i]);
  }
}

/* fp32 (double) gradient out, whatever cfg.wgrad (d_b_router): written, or added into */
static void FN(write_real_grad)(const FN(step_t)* st, REAL* dst, const REAL* v, int64_t n) {
  const int add = st->ctx->cfg.wgrad == MOK_WGRAD_FP32_ACCUM;
  for (int64_t i = 0; i < n; i++) dst[i] = add ? dst[i] + v[i] : v[i];
}

typedef struct {
  FN(step_t)* st;
  const mok_backward_args_t* a;
  const ACT* dlogits; /* [T, E] */
  const ACT* d_a_s;   /* [T, 2Fs] */
  const ACT* dy_s;    /* [T, H]: the shared expert's output gradient (dy, or bf16(s_g dy)) */
  const ACT* dl_g;    /* [T] the shared-expert gate logit's gradient (use_shared_gate) */
  int fused;
  int64_t at_ws13, at_ws2, at_b_router, at_w_sg, len; /* the pieces of a replicated-gradient vector */
} FN(grad_leaf_t);

/* The replicated gradients' vector: [dW_router (E, H) | dws13 (2Fs, H) | dws2 (H, Fs) |
 * d_b_router (E, with use_router_bias) | d_w_sg (H, with use_shared_gate)]. */
static void FN(grad_layout)(const FN(step_t)* st, FN(grad_leaf_t)* L) {
  const int64_t H = st->H, E = st->E, Fs = st->Fs;
  L->at_ws13 = E * H;
  L->at_ws2 = L->at_ws13 + 2 * Fs * H;
  L->at_b_router = L->at_ws2 + H * Fs;
  L->at_w_sg = L->at_b_router + (st->ctx->cfg.use_router_bias ? E : 0);
  L->len = L->at_w_sg + (st->ctx->cfg.use_shared_gate ? H : 0);
}

/* replicated gradients of one chunk (grad_layout's pieces), each a sum over the chunk's
 * tokens in increasing t (the GEMM's k; d_b_router's plain sums of dlogits alike) */
static void FN(grad_leaf)(const void* p, int64_t chunk, REAL* out) {
  const FN(grad_leaf_t)* L = p;
  FN(step_t)* st = L->st;
  const int64_t H = st->H, E = st->E, Fs = st->Fs, t0 = chunk * MOK_REDUCE_CHUNK_TOKENS;
  int64_t ct = st->T - t0 < MOK_REDUCE_CHUNK_TOKENS ? st->T - t0 : MOK_REDUCE_CHUNK_TOKENS;
  const ACT* x = (const ACT*)L->a->x + t0 * H;
  if (L->fused)
    FN(gemm)(st, E, H, ct, L->dlogits + t0 * E, 1, E, x, H, 1, out, H);
  else
    memset(out, 0, (size_t)(E * H) * sizeof(REAL));
  if (Fs > 0) {
    FN(gemm)(st, 2 * Fs, H, ct, L->d_a_s + t0 * 2 * Fs, 1, 2 * Fs, x, H, 1, out + L->at_ws13, H);
    FN(gemm)(st, H, Fs, ct, L->dy_s + t0 * H, 1, H, st->sh + t0 * Fs, Fs, 1, out + L->at_ws2, Fs);
  }
  if (L->len > L->at_b_router) { /* d_b_router[e] = sum_t dlogits[t, e] */
    REAL* db = out + L->at_b_router;
    for (int64_t e = 0; e < E; e++) db[e] = 0;
    for (int64_t t = t0; t < t0 + ct; t++)
      for (int64_t e = 0; e < E; e++) db[e] = db[e] + LD(L->dlogits[t * E + e]);
  }
  if (L->len > L->at_w_sg) { /* d_w_sg[h] = sum_t dl_g[t] x[t, h] */
    REAL* dw = out + L->at_w_sg;
    for (int64_t h = 0; h < H; h++) dw[h] = 0;
    for (int64_t t = 0; t < ct; t++)
      for (int64_t h = 0; h < H; h++) dw[h] = dw[h] + LD(L->dl_g[t0 + t]) * LD(x[t * H + h]);
  }
}

/* d_a = bf16(SwiGLU derivative) of gate|up rows a [n, 2F] given dh [n, F]; clamped: the
 * clamped SwiGLU's (zero where a clamp is active) */
static void FN(swiglu_backward)(const FN(step_t)* st, int64_t n, int64_t F, const ACT* a, int clamped,
                                const REAL* dh, ACT* d_a) {
  const REAL alpha = (REAL)st->ctx->cfg.swiglu_alpha, limit = (REAL)st->ctx->cfg.swiglu_limit;
#pragma omp parallel for schedule(static) num_threads(st->nt)
  for (int64_t i = 0; i < n; i++)
    for (int64_t f = 0; f < F; f++) {
      REAL gate = LD(a[i * 2 * F + f]), up = LD(a[i * 2 * F + F + f]), d = dh[i * F + f];
      if (clamped) { /* d_gate = dh (up' + 1) (s + alpha gate' s (1 - s)), d_up = dh gate' s */
        const REAL g = FN(clamp_gate)(gate, limit), u = FN(clamp_up)(up, limit);
        const REAL sg = (REAL)1 / ((REAL)1 + EXP(-(alpha * g)));
        const REAL dglu = sg + alpha * g * sg * ((REAL)1 - sg);
        d_a[i * 2 * F + f] = ST(gate > limit ? (REAL)0 : d * (u + (REAL)1) * dglu);
        d_a[i * 2 * F + F + f] = ST(up > limit || up < -limit ? (REAL)0 : d * (g * sg));
        continue;
      }
      REAL sg = (REAL)1 / ((REAL)1 + EXP(-gate));
      REAL silu = gate * sg, dsilu = sg * ((REAL)1 + gate * ((REAL)1 - sg));
      d_a[i * 2 * F + f] = ST(d * up * dsilu);
      d_a[i * 2 * F + F + f] = ST(d * silu);
    }
}

static mok_status_t FN(backward)(mok_context_t* ctx, const mok_backward_args_t* a) {
  const mok_config_t* c = &ctx->cfg;
  FN(step_t) S, *st = &S;
  FN(setup)(st, ctx, (void*)a->saved, a->workspace, a->num_tokens);
  const int64_t T = st->T, H = st->H, F = st->F, E = st->E, K = st->K, Fs = st->Fs;
  const int64_t El = st->El, W = st->W, me = st->me;
  const int fused = c->routing == MOK_ROUTING_FUSED;
  const ACT* dy = a->dy;
  const int64_t* T_all = st->hdr->T_all;
  int64_t T_global = 0;
  for (int64_t r = 0; r < W; r++) T_global += T_all[r];
  REAL* dg = WS(st, dg, REAL); /* [T, K] d loss / d g */

  /* 1. d_g = dy . o_j, and dy_j = bf16(g dy) to the owners' receive buffers */
#pragma omp parallel for schedule(static) num_threads(st->nt)
  for (int64_t i = 0; i < T * K; i++) {
    const ACT* dyt = dy + (i / K) * H;
    const ACT* o = st->o_slots + i * H;
    ACT* dst = (ACT*)FN(peer)(st, st->idx[i] / El)->recv_rows + (int64_t)st->pos[i] * H;
    REAL sum = 0;
    for (int64_t h = 0; h < H; h++) {
      sum = sum + LD(dyt[h]) * LD(o[h]);
      dst[h] = ST(st->g[i] * LD(dyt[h]));
    }
    dg[i] = sum;
  }
  mok_status_t s = FN(sync)(st);
  if (s) return s;
  const int redo = c->gate_up == MOK_GATE_UP_RECOMPUTE; /* gate|up and h: again, block by block */
  const int clamped = c->activation == MOK_ACTIVATION_SWIGLU_CLAMPED; /* (routed experts only) */

  /* 2. this rank's experts: dh = dy_j w2, d_a, dx_j = d_a w13 back; dw2, dw13 */
  REAL* acc = WS(st, gemm_out, REAL);
  ACT* d_a = WS(st, d_a, ACT); /* [rows, 2F] */
  const ACT* dy_rows = ctx->recv_rows;
  ACT* ret = ctx->ret_rows;
  const int64_t wsize = c->wgrad == MOK_WGRAD_FP32_ACCUM ? sizeof(REAL) : sizeof(ACT);
  int64_t r0 = 0;
  for (int64_t le = 0; le < El; le++) {
    const int64_t e = me * El + le;
    int64_t n = 0;
    for (int64_t r = 0; r < W; r++) n += st->counts_all[r * E + e];
    const ACT* w13 = (const ACT*)a->w13 + le * 2 * F * H;
    const ACT* w2 = (const ACT*)a->w2 + le * H * F;
    const ACT* b13 = c->use_expert_bias ? (const ACT*)a->b13 + le * 2 * F : NULL;
    for (int64_t b = 0; b < n; b += MOK_ROW_BLOCK) {
      const int64_t rb = FN(block_rows)(n, b), row = r0 + b;
      if (redo)
        FN(gate_up_block)(st, rb, F, st->x_rows + row * H, w13, b13, clamped, st->a_rows + row * 2 * F,
                          st->h_rows + row * F, acc);
      FN(gemm)(st, rb, F, H, dy_rows + row * H, H, 1, w2, F, 1, acc, F);
      FN(swiglu_backward)(st, rb, F, st->a_rows + row * 2 * F, clamped, acc, d_a + row * 2 * F);
      FN(gemm)(st, rb, H, 2 * F, d_a + row * 2 * F, 2 * F, 1, w13, H, 1, acc, H);
#pragma omp parallel for schedule(static) num_threads(st->nt)
      for (int64_t i = 0; i < rb * H; i++) ret[row * H + i] = ST(acc[i]);
    }
    /* dw2[e] = dy_rows^T h_rows, dw13[e] = d_a^T x_rows: sums over the rows in order */
    FN(gemm)(st, H, F, n, dy_rows + r0 * H, 1, H, st->h_rows + r0 * F, F, 1, acc, F);
    FN(write_wgrad)(st, (char*)a->d_w2 + le * H * F * wsize, acc, H * F);
    FN(gemm)(st, 2 * F, H, n, d_a + r0 * 2 * F, 1, 2 * F, st->x_rows + r0 * H, H, 1, acc, H);
    FN(write_wgrad)(st, (char*)a->d_w13 + le * 2 * F * H * wsize, acc, 2 * F * H);
    if (c->use_expert_bias) { /* d_b13[e] = sum of d_a, d_b2[e] = sum of dy_j: over the rows in order */
      for (int64_t f = 0; f < 2 * F; f++) {
        REAL sum = 0;
        for (int64_t i = r0; i < r0 + n; i++) sum = sum + LD(d_a[i * 2 * F + f]);
        acc[f] = sum;
      }
      FN(write_wgrad)(st, (char*)a->d_b13 + le * 2 * F * wsize, acc, 2 * F);
      for (int64_t h = 0; h < H; h++) {
        REAL sum = 0;
        for (int64_t i = r0; i < r0 + n; i++) sum = sum + LD(dy_rows[i * H + h]);
        acc[h] = sum;
      }
      FN(write_wgrad)(st, (char*)a->d_b2 + le * H * wsize, acc, H);
    }
    r0 += n;
  }
  s = FN(sync)(st);
  if (s) return s;

  /* 3. router backward: d_g -> d scores -> dlogits (+ aux and z losses), bf16 */
  ACT* dlogits = WS(st, dlogits, ACT); /* [T, E] */
  REAL* dx_router = WS(st, tok, REAL); /* [T, H] */
  if (fused) {
    REAL* ds_all = WS(st, logits, REAL); /* [T, E] scratch */
    const REAL d_aux = a->d_aux_loss ? *(const REAL*)a->d_aux_loss : (REAL)1;
    const REAL d_z = a->d_z_loss ? *(const REAL*)a->d_z_loss : (REAL)1;
    REAL aux_coef[MOK_MAX_EXPERTS]; /* d aux / d s[t, e] = d_aux alpha E f_e / T_global */
    for (int64_t e = 0; e < E; e++) {
      int64_t n_e = 0;
      for (int64_t r = 0; r < W; r++) n_e += st->counts_all[r * E + e];
      REAL f = (REAL)n_e / (REAL)(T_global * K);
      aux_coef[e] = d_aux * (REAL)c->aux_loss_coef * (REAL)E * f / (REAL)T_global;
    }
#pragma omp parallel for schedule(static) num_threads(st->nt)
    for (int64_t t = 0; t < T; t++) {
      REAL sc[MOK_MAX_EXPERTS], p[MOK_MAX_EXPERTS];
      REAL* ds = ds_all + t * E;
      const REAL* l = st->logits + t * E;
      REAL lse = FN(scores)(c, l, sc, E);
      for (int64_t e = 0; e < E; e++) ds[e] = c->aux_loss_coef != 0 ? aux_coef[e] : (REAL)0;
      /* g_j = route_scale * s_j / S (S = sum_j s_j when normalising) */
      REAL S = 0, dot = 0;
      for (int64_t j = 0; j < K; j++) S = S + sc[st->idx[t * K + j]];
      for (int64_t j = 0; j < K; j++)
        dot = dot + dg[t * K + j] * (REAL)c->route_scale * (sc[st->idx[t * K + j]] / S);
      for (int64_t j = 0; j < K; j++) {
        const int64_t e = st->idx[t * K + j];
        REAL dgn = dg[t * K + j] * (REAL)c->route_scale;
        ds[e] = ds[e] + (c->normalize ? (dgn - dot) / S : dgn);
      }
      REAL dl[MOK_MAX_EXPERTS];
      if (c->score == MOK_SCORE_SOFTMAX) {
        REAL sd = 0;
        for (int64_t e = 0; e < E; e++) sd = sd + ds[e] * sc[e];
        for (int64_t e = 0; e < E; e++) dl[e] = sc[e] * (ds[e] - sd);
      } else {
        for (int64_t e = 0; e < E; e++) dl[e] = ds[e] * sc[e] * ((REAL)1 - sc[e]);
      }
      if (c->z_loss_coef != 0) { /* d/dl of beta mean_t lse^2 = beta 2 lse softmax(l) / T */
        REAL m = l[0], sum = 0;
        for (int64_t e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
        for (int64_t e = 0; e < E; e++) sum = sum + EXP(l[e] - m);
        for (int64_t e = 0; e < E; e++) p[e] = EXP(l[e] - m) / sum;
        REAL zc = d_z * (REAL)c->z_loss_coef * (REAL)2 * lse / (REAL)T_global;
        for (int64_t e = 0; e < E; e++) dl[e] = dl[e] + zc * p[e];
      }
      for (int64_t e = 0; e < E; e++) dlogits[t * E + e] = ST(dl[e]);
    }
    FN(gemm)(st, T, H, E, dlogits, E, 1, a->w_router, H, 1, dx_router, H);
  } else if (T > 0) {
    memcpy(a->d_topk_weight, dg, (size_t)(T * K) * sizeof(REAL));
  }

  /* 4. shared expert: dh_s = dy_s ws2, d_a_s; dx_s = d_a_s ws13 enters dx below. With the
   * gate: o_s = bf16(h_s ws2^T) again, d s_g = dy . o_s, dl_g = bf16(d s_g s_g (1 - s_g)),
   * dy_s = bf16(s_g dy); else dy_s = dy */
  ACT* d_a_s = d_a; /* [T, 2Fs]: the experts' d_a is no longer needed */
  const int gated = c->use_shared_gate;
  ACT* dy_s = gated ? WS(st, shared_dy, ACT) : (ACT*)dy; /* [T, H] */
  ACT* dl_g = WS(st, shared_dl, ACT);                     /* [T] */
  for (int64_t b = 0; Fs > 0 && b < T; b += MOK_ROW_BLOCK) {
    const int64_t rb = FN(block_rows)(T, b);
    if (redo) /* (sh is read again by the replicated gradients, step 6) */
      FN(gate_up_block)(st, rb, Fs, (const ACT*)a->x + b * H, a->ws13, NULL, 0, st->sa + b * 2 * Fs,
                        st->sh + b * Fs, acc);
    if (gated) {
      FN(gemm)(st, rb, H, Fs, st->sh + b * Fs, Fs, 1, a->ws2, 1, Fs, acc, H); /* o_s, as forward */
#pragma omp parallel for schedule(static) num_threads(st->nt)
      for (int64_t t = b; t < b + rb; t++) {
        const REAL sg = FN(shared_gate)((const ACT*)a->x + t * H, a->w_sg, H);
        REAL ds = 0;
        for (int64_t h = 0; h < H; h++) {
          ds = ds + LD(dy[t * H + h]) * LD(ST(acc[(t - b) * H + h]));
          dy_s[t * H + h] = ST(sg * LD(dy[t * H + h]));
        }
        dl_g[t] = ST(ds * sg * ((REAL)1 - sg));
      }
    }
    FN(gemm)(st, rb, Fs, H, dy_s + b * H, H, 1, a->ws2, Fs, 1, acc, Fs);
    FN(swiglu_backward)(st, rb, Fs, st->sa + b * 2 * Fs, 0, acc, d_a_s + b * 2 * Fs);
  }

  /* 5. dx[t] = bf16(sum_j dx_j + router path + shared path), by token blocks */
  ACT* dx = a->dx;
  for (int64_t b = 0; b < T; b += MOK_ROW_BLOCK) {
    const int64_t rb = T - b < MOK_ROW_BLOCK ? T - b : MOK_ROW_BLOCK;
    if (Fs > 0) FN(gemm)(st, rb, H, 2 * Fs, d_a_s + b * 2 * Fs, 2 * Fs, 1, a->ws13, H, 1, acc, H);
#pragma omp parallel for schedule(static) num_threads(st->nt)
    for (int64_t t = b; t < b + rb; t++) {
      const ACT* dxj[MOK_MAX_EXPERTS];
      for (int64_t j = 0; j < K; j++) {
        int64_t i = t * K + j;
        dxj[j] = (const ACT*)FN(peer)(st, st->idx[i] / El)->ret_rows + (int64_t)st->pos[i] * H;
      }
      for (int64_t h = 0; h < H; h++) {
        REAL sum = 0;
        for (int64_t j = 0; j < K; j++) sum = sum + LD(dxj[j][h]);
        if (fused) sum = sum + dx_router[t * H + h];
        if (Fs > 0) sum = sum + acc[(t - b) * H + h];
        if (gated) sum = sum + LD(dl_g[t]) * LD(((const ACT*)a->w_sg)[h]);
        dx[t * H + h] = ST(sum);
      }
    }
  }

  /* 6. replicated gradients over all ranks by the fixed tree */
  if (fused || Fs > 0) {
    FN(grad_leaf_t) L = {st, a, dlogits, d_a_s, dy_s, dl_g, fused, 0, 0, 0, 0, 0};
    FN(grad_layout)(st, &L);
    REAL* tot;
    s = FN(tree_sum)(st, T_all, L.len, &L, FN(grad_leaf), &tot);
    if (s) return s;
    if (fused && a->d_w_router) FN(write_wgrad)(st, a->d_w_router, tot, E * H);
    if (Fs > 0) {
      FN(write_wgrad)(st, a->d_ws13, tot + L.at_ws13, 2 * Fs * H);
      FN(write_wgrad)(st, a->d_ws2, tot + L.at_ws2, H * Fs);
    }
    if (c->use_router_bias && a->d_b_router) FN(write_real_grad)(st, (REAL*)a->d_b_router, tot + L.at_b_router, E);
    if (gated) FN(write_wgrad)(st, a->d_w_sg, tot + L.at_w_sg, H);
  }
  /* peers read this rank's ret_rows (dx_j) in step 5: the tree's barriers, or the
   * next call's first barrier, keep them until everyone is done */
  return MOK_STATUS_SUCCESS;
}

#undef WS
