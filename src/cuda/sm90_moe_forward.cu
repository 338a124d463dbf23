// sm90_moe_forward.cu — the forward megakernel: the whole MoE layer forward in one
// persistent launch (CPU reference: bf16_forward in src/cpu/layer_impl.h).
//
// Tasks, in ticket order (each waits only on earlier ones):
//   ROUTE[b]      token block b (128 tokens): logits = x w_router^T (wgmma), scores,
//                 top-K, weights; per-expert counts of the block and each slot's rank
//                 among them; loss statistics of its two 64-token chunks
//   SHARED1[m,n]  shared expert gate|up with SwiGLU (no dependency: fills the gaps)
//   PREFIX        counts -> expert offsets (prefix sums in global token order), the
//                 expert m-tile table, tokens_per_expert, aux and z losses (fixed tree)
//   DISPATCH[b]   W = 1: x rows of 32-token block b to their expert rows at pos =
//                 expert_off[e] + block_off[b, e] + rank
//   DISPATCH[d]   W > 1: stream task d of nd: the slots in stream order, then its share
//                 of every expert's rows into the owners' windows, expert groups in
//                 order, each group flagged to its owner (dispatch_stream_task)
//   GEMM1[m,n]    expert m-tile: a = x_rows w13[e]^T, epilogue h = silu(gate) * up
//   SHARED2[m,n]  shared expert down projection
//   RETURN[d]     W > 1: return stream d of nr: as GEMM2 finishes each of its m-tiles
//                 (mt = d, d + nr, ...), the tile's rows of other ranks' slots to those
//                 ranks' o_kept at the slot (return_task); tickets before GEMM2's
//   GEMM2[m,n]    o = h w2[e]^T
//   COMBINE[b]    (32 tokens) y[t] = bf16(sum_j g[t, j] o_j + shared), slots in order;
//                 with the shared gate shared = s_g o_s, s_g = sigmoid(x[t] . w_sg) here
//                 (W > 1: other ranks' o rows from o_kept, local)
#ifdef MOK_PRODUCER
#define MOK_PRODUCER_TU  // (this kernel's GEMM loads from a producer warpgroup: sm90_smem.cuh)
#endif
#include "sm90_epilogues.cuh"
#include "sm90_token_rows.cuh"
#include "sm90_tree.cuh"

namespace mok {

// then mt1[max_mt] (W > 1: GEMM2's groups count there too, after GEMM1's), smt1[smt]
enum : int { C_ROUTE, C_PREFIX, C_DISPATCH, C_G2, C_S2, C_RET, C_FIXED };
static_assert(C_FIXED == kFwdFixedCounters, "gpu_params.h's fwd_num_counters");

__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

// The top-K order as one unsigned integer, larger first: key a (expert ia) ahead of key
// b (expert ib) when a > b, or a == b and ia < ib; NaN after every number, NaNs by
// index (the CPU rule). The float's bits made monotone (sign-magnitude to unsigned, -0
// as +0 so that it ties with +0; NaN 0, below -inf's 0x007fffff) above 0xffff - index:
// a warp's argmax is then a max of integers, without the branches of comparing floats
// with their NaN cases (ROUTE's top-K loop took ~2/3 of its ~190 us at qwen3-30b-a3b,
// latency-bound at two warps a scheduler). Every expert's key is nonzero.
__device__ __forceinline__ uint64_t topk_key(float v, int e) {
  const uint32_t u = __float_as_uint(v == 0.f ? 0.f : v);
  const uint32_t ord = v != v ? 0u : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t)ord << 32 | (uint32_t)(0xffff - e);
}
__device__ __forceinline__ uint64_t shfl_xor_u64(uint64_t v, int o) {
  const uint32_t lo = __shfl_xor_sync(~0u, (uint32_t)v, o), hi = __shfl_xor_sync(~0u, (uint32_t)(v >> 32), o);
  return (uint64_t)hi << 32 | lo;
}

// ---- ROUTE ----
// Group-limited routing (cfg.n_group = G > 1; mok.h, src/cpu/layer_impl.h group_limit) of
// one token, in its warp: takes out of key (lane's experts lane + 32 i, topk_key; 0:
// none) every expert outside the topk_group best groups. sel: the selection keys as
// floats, sw: the warp's scratch [E]. A group's score: key1 + key2, its two largest
// keys in the top-K order (one fp32 addition), or key1 (group_top2 0, or groups of one);
// groups kept best first in the same order on their scores (ties to the lower group,
// NaN last). Lane holds groups lane + 32 i (G <= E <= 32 NR).
template <int NR>
__device__ __forceinline__ void group_limit(const Shape& s, float* sw, const float (&sel)[NR], uint64_t (&key)[NR]) {
  const int lane = threadIdx.x % 32, E = s.E, G = s.n_group, size = E / G;
#pragma unroll
  for (int i = 0; i < NR; i++)
    if (lane + 32 * i < E) sw[lane + 32 * i] = sel[i];
  __syncwarp();
  uint64_t gkey[NR];
#pragma unroll
  for (int i = 0; i < NR; i++) {
    const int g = lane + 32 * i;
    gkey[i] = 0;
    if (g >= G) continue;
    uint64_t k1 = 0, k2 = 0;  // the group's two largest, in its experts' order
    for (int e = g * size; e < (g + 1) * size; e++) {
      const uint64_t k = topk_key(sw[e], e);
      if (k > k1) k2 = k1, k1 = k;
      else if (k > k2) k2 = k;
    }
    const float v1 = sw[0xffff - (int)(uint32_t)k1];
    const float score = s.group_top2 && size > 1 ? __fadd_rn(v1, sw[0xffff - (int)(uint32_t)k2]) : v1;
    gkey[i] = topk_key(score, g);
  }
  uint32_t kept = 0;  // bit i: group lane + 32 i
  for (int n = 0; n < s.topk_group; n++) {
    uint64_t best = 0;
#pragma unroll
    for (int i = 0; i < NR; i++)
      if (!(kept >> i & 1)) best = max(best, gkey[i]);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) best = max(best, shfl_xor_u64(best, o));
    const int bg = 0xffff - (int)(uint32_t)best;  // (topk_group <= G: a group is left)
    if (bg % 32 == lane) kept |= 1u << (bg / 32);
  }
  __syncwarp();  // (every lane's reads of sw, before it holds the kept flags [G])
  int* const keep = reinterpret_cast<int*>(sw);
#pragma unroll
  for (int i = 0; i < NR; i++)
    if (lane + 32 * i < G) keep[lane + 32 * i] = kept >> i & 1;
  __syncwarp();
#pragma unroll
  for (int i = 0; i < NR; i++)
    if (lane + 32 * i < E && !keep[(lane + 32 * i) / size]) key[i] = 0;
  __syncwarp();  // (the flags read before sw's next token)
}

// Scores, top-K and weights of tokens t0 + warp, t0 + warp + 8, ... < t1 (a warp a
// token, lane holding experts lane + 32 i, i < NR: E <= 32 NR), from their logits.
template <int NR>
__device__ __forceinline__ void route_tokens(Smem& sm, const FwdParams& p, int t0, int t1) {
  const Shape& s = p.s;
  const int E = s.E, K = s.K, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int t = t0 + warp; t < t1; t += kThreads / 32) {
    float* const lg = p.logits + (int64_t)t * s.Ep;
    if (s.use_router_bias)  // logits = x w_router^T + b_router, one fp32 addition; saved so
      for (int e = lane; e < E; e += 32) lg[e] = __fadd_rn(lg[e], p.b_router[e]);
    float prob[NR], sc[NR];  // (each lane reads back only its own experts' logits)
    const float lse = token_scores<NR>(lg, E, s.score, prob, sc);
    float sel[NR];     // the selection keys: score + bias_select
    uint64_t key[NR];  // (0: not an expert, or one already chosen)
#pragma unroll
    for (int i = 0; i < NR; i++) {
      const int e = lane + 32 * i;
      sel[i] = s.use_bias && e < E ? __fadd_rn(sc[i], p.bias[e]) : sc[i];
      key[i] = e < E ? topk_key(sel[i], e) : 0;
      if (e < E) p.scores[(int64_t)t * E + e] = sc[i];
    }
    if (s.n_group > 1) group_limit<NR>(s, sm.warp_scratch[warp], sel, key);
    if (lane == 0) p.lse[t] = lse;
    // K rounds of a warp argmax; lane j keeps slot j (K <= 32)
    float gsum = 0.f, my_g = 0.f;
    int my_e = 0;
    for (int j = 0; j < K; j++) {
      uint64_t best = 0;
#pragma unroll
      for (int i = 0; i < NR; i++)
        best = max(best, key[i]);
#pragma unroll
      for (int o = 16; o > 0; o /= 2) best = max(best, shfl_xor_u64(best, o));
      const int be = 0xffff - (int)(uint32_t)best;  // (K <= the kept experts: one is left)
      float gs = 0.f;  // the winner's lane takes it out and broadcasts its score
#pragma unroll
      for (int i = 0; i < NR; i++)
        if (lane + 32 * i == be) key[i] = 0, gs = sc[i];
      gs = __shfl_sync(~0u, gs, be % 32);
      if (lane == j) my_g = gs, my_e = be;
      gsum = __fadd_rn(gsum, gs);  // slots in order
    }
    if (lane < K) {
      const float g = s.normalize ? __fdiv_rn(my_g, gsum) : my_g;
      p.sv.idx[(int64_t)t * K + lane] = my_e;
      p.sv.g[(int64_t)t * K + lane] = __fmul_rn(g, s.route_scale);
    }
  }
}
// route_tokens with the registers E needs: 8 a lane up to 256 experts (every named
// shape: the code and registers the router had), 16 up to 512, 32 up to 1024.
__device__ __forceinline__ void route_tokens_any(Smem& sm, const FwdParams& p, int t0, int t1) {
  if (p.s.E <= 256) route_tokens<8>(sm, p, t0, t1);
  else if (p.s.E <= 512) route_tokens<16>(sm, p, t0, t1);
  else route_tokens<32>(sm, p, t0, t1);
}

__device__ __forceinline__ void route_task(Smem& sm, const FwdParams& p, int b) {
  const Shape& s = p.s;
  const int t0 = b * 128, t1 = min(s.T, t0 + 128), E = s.E, K = s.K;
  if (s.fused) {
    for (int nt = 0; nt < cdiv(E, BN); nt++) {  // (logits' columns E .. Ep - 1: 0, B's rows past E)
      const Operand A = rows128(&p.m_x, t0, 0), B = wide(&p.m_wr, nt * BN, 0);
      gemm_tile<0, 0, kFwdBoxRows>(sm, A, B, s.H / BK, BK, [&](float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
        store_tile<kStoreF32>(sm, acc, wg, w, l, t0, t1, nt * BN, s.Ep, p.logits, s.Ep);
      });
    }
    cta_sync();
    MOK_STALL_FROM(kStallRouteTopK);
    route_tokens_any(sm, p, t0, t1);
    MOK_STALL_ADD(kStallRouteTopK);
  } else {
    for (int t = t0 + (int)threadIdx.x; t < t1; t += kThreads) {
      for (int j = 0; j < K; j++) {
        const int e = p.in_idx[(int64_t)t * K + j];
        if (e < 0 || e >= E) raise_error(p.st, MOK_STATUS_INDEX_OUT_OF_RANGE);
        for (int i = 0; i < j; i++)
          if (p.in_idx[(int64_t)t * K + i] == e) raise_error(p.st, MOK_STATUS_DUPLICATE_INDEX);
        p.sv.idx[(int64_t)t * K + j] = min(max(e, 0), E - 1);
        p.sv.g[(int64_t)t * K + j] = p.in_w[(int64_t)t * K + j];
      }
    }
  }
  MOK_STALL_FROM(kStallRouteCounts);
  if (threadIdx.x == 0) release_stages_from_stores(sm);
  cta_sync();
  // per expert: the block's count and each slot's rank, in token order. Each expert's
  // thread reads all the block's (t1 - t0) K indices from shared memory, where they are
  // broadcast, 32 at a time (8 16-byte loads, then the compares and rank stores; loaded
  // one by one, each load waited for the previous rank store, which may alias it: 15% of
  // ROUTE at qwen3-30b-a3b). The slots past the block's are -1.
  int* block_idx = reinterpret_cast<int*>(sm.stage);  // [(t1 - t0) K, rounded up to 32] (K <= 32: 16 KB)
  const int n_slots = (t1 - t0) * K, n_padded = (n_slots + 31) / 32 * 32;
  for (int i = threadIdx.x; i < n_padded; i += kThreads) block_idx[i] = i < n_slots ? p.sv.idx[(int64_t)t0 * K + i] : -1;
  cta_sync();
  for (int e = threadIdx.x; e < E; e += kThreads) {
    int n = 0;
    for (int i0 = 0; i0 < n_padded; i0 += 32) {  // (i = (t - t0) K + j: tokens, then slots, in order)
      int4 v[8];
#pragma unroll
      for (int u = 0; u < 8; u++) v[u] = reinterpret_cast<const int4*>(block_idx + i0)[u];
#pragma unroll
      for (int u = 0; u < 8; u++) {
        const int q[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int c = 0; c < 4; c++)
          if (q[c] == e) p.rank[(int64_t)t0 * K + i0 + 4 * u + c] = n++;
      }
    }
    p.block_counts[(int64_t)b * E + e] = n;
  }
  fence_proxy_async_smem();  // (block_idx's generic writes before a next GEMM task's TMA loads)
  MOK_STALL_ADD(kStallRouteCounts);
  MOK_STALL_FROM(kStallRouteStats);
  // loss statistics per 64-token chunk: sum_t s[t, e] and sum_t lse_t^2, increasing t
  if (s.fused && (s.aux_coef != 0.f || s.z_coef != 0.f))
    for (int c = 0; c < 2; c++) {
      const int c0 = t0 + c * 64, c1 = min(t1, c0 + 64);
      if (c0 >= t1) break;
      for (int e = threadIdx.x; e <= E; e += kThreads) {
        float acc = 0.f;
        for (int t = c0; t < c1; t++)
          acc = __fadd_rn(acc, e < E ? p.scores[(int64_t)t * E + e] : __fmul_rn(p.lse[t], p.lse[t]));
        p.chunk_stats[(int64_t)(b * 2 + c) * (E + 1) + e] = acc;
      }
    }
  MOK_STALL_ADD(kStallRouteStats);
  signal_counter(sm, &p.st.sync->counter[C_ROUTE]);
}

// ---- PREFIX ----
// W > 1, after COUNTS: rank r's count of expert e (e = E: its T), from this rank's
// counts table (written by peers: read through volatile).
__device__ __forceinline__ int peer_count(const FwdParams& p, int r, int e) {
  return *(volatile const int32_t*)&p.px.counts[p.s.rank][r * (p.s.E + 1) + e];
}
__device__ __noinline__ void prefix_task(Smem& sm, const FwdParams& p) {
  const Shape& s = p.s;
  const int E = s.E;
  if (!wait_counter(sm, &p.st.sync->counter[C_ROUTE], s.nb, p.st, 19)) return;
  // PREFIX runs on one CTA while every other waits for it (0.5 ms at qwen3-30b-a3b in
  // the thirteenth session's trace): its loops load before they store (a store may alias
  // a later load as far as the compiler knows, and each load after one waits for it),
  // and thread 0's serial walks read the counts and offsets from shared memory (the
  // stages: sh_counts [E], sh_off [E + 1], sh_loc_off [E + 1], sh_loc_shift [E]).
  if (threadIdx.x == 0) release_stages_from_stores(sm);
  cta_sync();
  int* const sh_counts = reinterpret_cast<int*>(sm.stage);
  int* const sh_off = sh_counts + E, *const sh_loc_off = sh_off + E + 1, *const sh_loc_shift = sh_loc_off + E + 1;
  // the tile table's runs (walk_tiles' visits, at most E), each from its first
  // tile: thread 0 walks, then every thread writes tiles
  int* const run_mt0 = sh_loc_shift + E, *const run_e = run_mt0 + E + 1, *const run_row0 = run_e + E + 1;
  int* const run_end = run_row0 + E + 1;
  int* const seg_mt0 = run_end + E + 1;  // the band segments (expert_segments, at most E + 2)
  __shared__ int num_segs;
  __shared__ int num_runs;
  MOK_STALL_FROM(kStallPrefixSums);
  // With W > 1 the counts and T go to every rank (row s.rank of each rank's counts
  // table) and this rank's rows of expert e follow those of ranks < s.rank: block
  // offsets start there. Every rank then holds the same [W][E + 1] table and computes
  // the same offsets, totals and capacity decision from it.
  for (int e = threadIdx.x; e <= E; e += kThreads) {
    int tot = s.T;
    if (e < E) {
      tot = 0;
      for (int b = 0; b < s.nb; b++) tot += p.block_counts[(int64_t)b * E + e];
      p.sv.counts[e] = tot;
    }
    for (int r = 0; r < s.W && s.W > 1; r++) p.px.counts[r][s.rank * (E + 1) + e] = tot;
  }
  if (s.W > 1) {
    cta_sync();
    if (threadIdx.x == 0) {
      __threadfence_system();
      publish_peers(p.px, s, kFlagCounts, sm.peer_serial);
    }
    if (!wait_peers(sm, p.st, kFlagCounts)) return;
  }
  for (int e = threadIdx.x; e < E; e += kThreads) {
    int before = 0, tot = s.W > 1 ? 0 : p.sv.counts[e];  // rows of ranks < s.rank; all ranks'
    for (int r = 0; r < s.W && s.W > 1; r++) {  // (ranks in order: integer sums)
      const int n = peer_count(p, r, e);
      if (r == s.rank) sh_loc_off[e] = n, sh_loc_shift[e] = before;  // (made offsets below)
      if (r < s.rank) before += n;
      tot += n;
    }
    for (int b0 = 0; b0 < s.nb; b0 += 8) {  // 8 blocks' counts loaded, then their offsets stored
      int n[8];
#pragma unroll
      for (int k = 0; k < 8; k++) n[k] = b0 + k < s.nb ? p.block_counts[(int64_t)(b0 + k) * E + e] : 0;
#pragma unroll
      for (int k = 0; k < 8; k++)
        if (b0 + k < s.nb) p.block_off[(int64_t)(b0 + k) * E + e] = before, before += n[k];
    }
    p.sv.counts[e] = sh_counts[e] = tot;
  }
  MOK_STALL_ADD(kStallPrefixSums);
  // loss statistics: the fixed pairwise tree over the chunks, per column, into row 0.
  // With W > 1 over every rank's chunks in global order: each rank's rows go into every
  // rank's stats table at its first global chunk, and every rank sums the whole table
  // (the same tree over the same chunks as W = 1, when every rank but the last has a
  // multiple of 64 tokens: docs/CPU.md).
  const bool losses = s.fused && (s.aux_coef != 0.f || s.z_coef != 0.f);
  float* stats = p.chunk_stats;
  int chunks = s.chunks, T_all = s.T;
  if (s.W > 1) {
    int chunk0 = 0;
    T_all = chunks = 0;
    for (int r = 0; r < s.W; r++) {
      const int Tr = peer_count(p, r, E);
      if (r < s.rank) chunk0 += cdiv(Tr, MOK_REDUCE_CHUNK_TOKENS);
      chunks += cdiv(Tr, MOK_REDUCE_CHUNK_TOKENS), T_all += Tr;
    }
    if (losses) {
      const int64_t n = (int64_t)s.chunks * (E + 1);
      for (int64_t i0 = threadIdx.x; i0 < n; i0 += 8 * kThreads) {  // 8 loaded, then stored to every rank
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = i0 + k * kThreads < n ? p.chunk_stats[i0 + k * kThreads] : 0.f;
        for (int r = 0; r < s.W; r++)
#pragma unroll
          for (int k = 0; k < 8; k++)
            if (i0 + k * kThreads < n) p.px.stats[r][chunk0 * (int64_t)(E + 1) + i0 + k * kThreads] = v[k];
      }
      __threadfence_system();
      cta_sync();
      if (threadIdx.x == 0) publish_peers(p.px, s, kFlagStats, sm.peer_serial);
      if (!wait_peers(sm, p.st, kFlagStats)) return;
      stats = p.px.stats[s.rank];
    }
  }
  if (losses)  // each column's tree (TreeCounter, 8 leaves loaded at a time) into its row 0
    for (int e = threadIdx.x; e <= E; e += kThreads) {
      const float* col = stats + e;
      TreeCounter<SmemNodes> tc{{reinterpret_cast<float*>(sm.stage[1]) + threadIdx.x}};  // (registers: a spill)
      for (int c0 = 0; c0 < chunks; c0 += 8) {
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; k++)  // (L2: at W > 1 rows written by peers)
          v[k] = c0 + k < chunks ? __ldcg(col + (int64_t)(c0 + k) * (E + 1)) : 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++)
          if (c0 + k < chunks) tc.push(v[k], 0);
      }
      stats[e] = tc.fold();
    }
  __shared__ int over;  // some rank's experts would receive more rows than the capacity
  cta_sync();
  if (threadIdx.x == 0) {
    // expert_off[e]: expert e's first row in its owner's buffers (each owner's experts
    // in order); [E]: the rows this rank's experts receive. The tile table covers this
    // rank's experts, tile_expert holding the local index (the weights are local).
    int off = 0, mine = 0;
    over = 0;
    for (int e = 0; e < E; e++) {
      if (e % s.e_loc == 0) off = 0;
      p.sv.expert_off[e] = sh_off[e] = off, off += sh_counts[e];
      over |= off > p.capacity;
      if (e / s.e_loc == s.rank) mine = off;
    }
    p.sv.expert_off[E] = sh_off[E] = mine;
    // every rank sees every count and stops alike, before any row moves or output is
    // written: PREFIX never completes, so the tasks waiting for it give up
    if (over) raise_error(p.st, MOK_STATUS_CAPACITY_EXCEEDED);
  }
  cta_sync();
  if (over) return;
  MOK_STALL_FROM(kStallPrefixWalk);
  if (threadIdx.x == 0) {
    int mt = 0, r = 0;
    const int e0 = s.rank * s.e_loc;
    walk_tiles(sh_counts + e0, sh_off + e0, s.e_loc, s.pairs, [&](int e, int row0, int n, int row_end) {
      run_mt0[r] = mt, run_e[r] = e, run_row0[r] = row0, run_end[r] = row_end;
      r++, mt += n;
      return false;
    });
    run_mt0[r] = mt, num_runs = r;
    *p.num_tiles = mt;
    num_segs = expert_segments(run_mt0, r, s.pairs, seg_mt0);
    if (s.W > 1) {  // this rank's rows in stream order (by expert, then owner row: j = pos + loc_shift[e])
      int j = 0;
      for (int e = 0; e < E; e++) {
        const int mine = sh_loc_off[e], owner_row = sh_off[e] + sh_loc_shift[e];
        p.sv.loc_off[e] = j, p.sv.loc_shift[e] = j - owner_row;
        j += mine;
      }
      p.sv.loc_off[E] = j;
    }
    if (losses) {  // aux = alpha E sum_e f_e P_e (increasing e); z = beta mean_t lse^2
      float aux = 0.f;
      const float TK = (float)T_all * (float)s.K;
      for (int e = 0; e < E; e++)
        aux = __fadd_rn(aux, __fmul_rn(__fdiv_rn((float)sh_counts[e], TK), __fdiv_rn(stats[e], (float)T_all)));
      if (p.aux_loss) *p.aux_loss = __fmul_rn(__fmul_rn(s.aux_coef, (float)E), aux);
      if (p.z_loss) *p.z_loss = __fmul_rn(s.z_coef, __fdiv_rn(stats[E], (float)T_all));
    } else {
      if (p.aux_loss) *p.aux_loss = 0.f;
      if (p.z_loss) *p.z_loss = 0.f;
    }
    p.sv.header[0] = MOK_SAVED_MAGIC_GPU;
    p.sv.header[1] = p.context_id;
    p.sv.header[2] = (uint64_t)s.T;
    p.sv.header[3] = p.serial;
    p.sv.header[4] = (uint64_t)T_all;
    for (int r = 0; r < s.W; r++)  // every rank's T, for the backward's chunk ranges
      p.sv.header[5 + r] = (uint64_t)(s.W > 1 ? peer_count(p, r, E) : s.T);
#pragma unroll
    for (int k = 0; k < kSavedShapeWords; k++)  // the context's shape (the backward compares it)
      p.sv.header[kHeaderShape + k] = saved_shape_word(s, k);
  }
  cta_sync();
  // the tile table and the band table (sv.tile_band, every m-tile slot up to max_mt: the
  // backward reads it too), from the runs and the segments
  auto last_start = [](const int* start, int n, int mt) {  // the last of n sorted starts <= mt
    int lo = 0, hi = n - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (start[mid] <= mt) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  };
  const int banded = seg_mt0[num_segs];  // (the tiles, made even with pairs)
  for (int mt = threadIdx.x; mt < s.max_mt; mt += kThreads) {
    if (mt < run_mt0[num_runs]) {
      const int r = last_start(run_mt0, num_runs, mt);
      p.tile_expert[mt] = run_e[r], p.tile_row0[mt] = run_row0[r] + (mt - run_mt0[r]) * BM;
      p.tile_row_end[mt] = run_end[r];
    }
    int first, end;
    if (mt < banded) {
      const int k = last_start(seg_mt0, num_segs, mt);
      segment_band(seg_mt0[k], seg_mt0[k + 1], mt, &first, &end);
    } else {  // past the tiles (tasks with no rows): fixed bands
      first = banded + (mt - banded) / kBand * kBand, end = min(first + kBand, s.max_mt);
    }
    p.sv.tile_band[mt] = first << 8 | (end - first);
  }
  MOK_STALL_ADD(kStallPrefixWalk);
  // outputs only when the step goes on (a capacity overflow stops it on every rank
  // first); topk_idx and topk_weight come with DISPATCH, which runs only then
  if (*(volatile uint32_t*)&p.st.sync->error == 0)
    for (int e = threadIdx.x; e < E && p.tokens_per_expert; e += kThreads) p.tokens_per_expert[e] = p.sv.counts[e];
  fence_proxy_async_smem();  // (the stages' generic writes before a next GEMM task's TMA loads)
  signal_counter(sm, &p.st.sync->counter[C_PREFIX]);
}

// Slot i's top-K outputs (fused routing: topk_idx, topk_weight, when asked for), e its
// expert: DISPATCH writes them beside the slot's position, after PREFIX has let the
// step go on.
__device__ __forceinline__ void put_topk_out(const FwdParams& p, int i, int e) {
  if (p.out_idx) p.out_idx[i] = e;
  if (p.out_w) p.out_w[i] = p.sv.g[i];
}

// ---- DISPATCH, W > 1: stream task d of s.nd ----
// First every stream task puts its share of the slots into the stream order (sv.pos,
// sv.sorted), and they all meet (C_DISPATCH). Then task d sends rows j = loc_off[e] + d +
// nd * (warp + kWarps * i) of each expert e, expert groups in order (local expert l in
// group l / gs, of every owner), and after each group tells the owner, in its arrive
// table, that its part of the group is there: GEMM1 starts on a group when every rank's
// every stream task has sent it, while the later groups travel.
__device__ __noinline__ void dispatch_stream_task(Smem& sm, const FwdParams& p, int d) {
  const Shape& s = p.s;
  if (!wait_counter(sm, &p.st.sync->counter[C_PREFIX], 1, p.st, 19)) return;
  const int K = s.K, H = s.H, E = s.E;
  for (int i = d * kThreads + threadIdx.x; i < s.T * K; i += s.nd * kThreads) {
    const int e = p.sv.idx[i];
    put_topk_out(p, i, e);
    const int pos = p.sv.expert_off[e] + p.block_off[(int64_t)(i / K / 128) * E + e] + p.rank[i];
    p.sv.pos[i] = pos;
    p.sv.sorted[pos + p.sv.loc_shift[e]] = i;
  }
  signal_counter(sm, &p.st.sync->counter[C_DISPATCH]);  // (W > 1: the stream order's barrier)
  if (!wait_counter(sm, &p.st.sync->counter[C_DISPATCH], (uint32_t)s.nd, p.st, 19)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = kThreads / 32;
  const int gs = cdiv(s.e_loc, kArriveGroups), groups = cdiv(s.e_loc, gs);
  if (threadIdx.x == 0) release_stages_from_stores(sm);  // (copy_rows_smem's chunks go there)
  cta_sync();
  const uint32_t buf = smem_addr(sm.stage) + (warp * kCopyChunks * 32 + lane) * 16;
  for (int g = 0; g < groups; g++) {
    for (int r = 0; r < s.W; r++)
      for (int l = g * gs; l < min(s.e_loc, (g + 1) * gs); l++) {
        const int e = r * s.e_loc + l, j1 = p.sv.loc_off[e + 1], shift = p.sv.loc_shift[e], step = s.nd * warps;
        bf16* rows = p.peer_x_rows.rows[r];
        for (int j0 = p.sv.loc_off[e] + d + s.nd * warp; j0 < j1; j0 += kCopyRows * step) {  // rows j0, j0 + step, ...
          const bf16* src[kCopyRows];
          bf16* dst[kCopyRows];
#pragma unroll
          for (int k = 0; k < kCopyRows; k++) {
            const int j = min(j0 + k * step, j1 - 1), i = p.sv.sorted[j];
            if (lane == 0) p.ret.row_src[r][j - shift] = (int64_t)s.rank << 32 | (uint32_t)i;  // (RETURN's way back)
            src[k] = p.x + (int64_t)(i / K) * H, dst[k] = rows + (int64_t)(j - shift) * H;
          }
          copy_rows_smem(buf, src, dst, min(kCopyRows, (j1 - 1 - j0) / step + 1), H, lane);
        }
      }
    __threadfence_system();  // (each thread's stores into the owners' rows)
    cta_sync();
    if (threadIdx.x < s.W)  // (flag_release_sys: a system-scope fence, then the serial)
      for (int k = d; k < s.nd_slots; k += s.nd) {  // (peers poll nd_slots slots, whatever this grid runs)
        uint64_t* flag = p.px.arrive[threadIdx.x] + ((int64_t)s.rank * kMaxStreams + k) * kArriveGroups + g;
        flag_release_sys(flag, sm.peer_serial);
      }
  }
  fence_proxy_async_smem();  // (the stages' generic writes before a next GEMM task's TMA loads)
}

// ---- DISPATCH: W = 1 block sb of kSubTokens tokens; W > 1 stream task sb ----
__device__ __noinline__ void dispatch_task(Smem& sm, const FwdParams& p, int sb) {
  const Shape& s = p.s;
  if (s.W > 1) return dispatch_stream_task(sm, p, sb);
  if (!wait_counter(sm, &p.st.sync->counter[C_PREFIX], 1, p.st, 19)) return;
  const int t0 = sb * kSubTokens, t1 = min(s.T, t0 + kSubTokens), b = t0 / 128, K = s.K, H = s.H;
  if (threadIdx.x == 0) release_stages_from_stores(sm);  // (the positions and rows go there)
  cta_sync();
  // The slots' positions into shared memory, then thread 0 moves the rows with the bulk
  // copy engine (scatter_token_rows).
  int* const sh_pos = scatter_positions(sm);
  const int i0 = t0 * K, n = (t1 - t0) * K;
  for (int j = threadIdx.x; j < n; j += kThreads) {
    const int i = i0 + j, e = p.sv.idx[i];
    const int pos = p.sv.expert_off[e] + p.block_off[(int64_t)b * s.E + e] + p.rank[i];
    p.sv.pos[i] = sh_pos[j] = pos;
    put_topk_out(p, i, e);
  }
  cta_sync();
  if (threadIdx.x == 0) scatter_token_rows(sm, p.x, t0, t1, H, K, p.sv.x_rows);
  fence_proxy_async_smem();  // (the stages' generic writes before a next GEMM task's TMA loads)
  signal_counter(sm, &p.st.sync->counter[C_DISPATCH]);
}

// GEMM1 of m-tile mt may read its rows. W = 1: every DISPATCH task is done. W > 1:
// PREFIX is (the tile table), then, when mt is a tile, every rank's every stream task
// has sent its rows of the tile's expert group: lanes of warp 0 poll the W x nd_slots
// flags (every rank fills nd_slots, whatever number of stream tasks its grid runs).
// MOK_PROFILE / MOK_TRACE count the wait, as wait_counter's.
static __device__ __noinline__ bool wait_tile_rows(Smem& sm, const FwdParams& p, int task, int num_g) {
  const Shape& s = p.s;
  const uint32_t* counter = &p.st.sync->counter[s.W == 1 ? C_DISPATCH : C_PREFIX];
  const uint32_t target = s.W == 1 ? s.ns : 1;
  if (threadIdx.x < 32) {
    const uint64_t t0 = globaltimer_ns();
    if (threadIdx.x == 0) poll(sm, p.st, [&] { return ld_acquire(counter) >= target; });
    __syncwarp();
    int mt = 0, col = 0;  // (after PREFIX: its band table)
    if (s.W > 1) expert_band_order(p.sv.tile_band, task, s.max_mt, num_g, &mt, &col);
    if (s.W > 1 && sm.abort == 0 && mt < *(volatile const int*)p.num_tiles) {
      const int g = p.tile_expert[mt] / cdiv(s.e_loc, kArriveGroups);
      for (int k = threadIdx.x; k < s.W * s.nd_slots && sm.abort == 0; k += 32) {
        const uint64_t* f = p.px.arrive[s.rank] + ((k / s.nd_slots) * kMaxStreams + k % s.nd_slots) * kArriveGroups + g;
        poll(sm, p.st, [&] { return flag_acquire_sys(f) >= sm.peer_serial; });
      }
      __syncwarp();
    }
    fence_proxy_async();  // (GEMM1's TMA loads of the rows)
    if (threadIdx.x == 0) count_wait(sm, p.st, 19, t0);
  }
  cta_sync();
  return sm.abort == 0;
}

// ---- expert and shared GEMMs ----
// pairable: this task and the partner CTA's are in the same GEMM phase (next_task);
// the key of pair_agree is the expert and column group (-1: no rows, nothing to share).
template <bool kClamped>
__device__ __forceinline__ void gemm1_task(Smem& sm, const FwdParams& p, int task, bool pairable) {
  const Shape& s = p.s;
  const int num_g = groups(cdiv(s.F, BF), s.H / BK);
  const bool ok = wait_tile_rows(sm, p, task, num_g);
  int mt, g;  // (after PREFIX: its band table)
  expert_band_order(p.sv.tile_band, task, s.max_mt, num_g, &mt, &g);
  const bool valid = ok && mt < *p.num_tiles;  // (walk_tiles' tiles all hold rows)
  paired_task(sm, pairable, ok, valid, valid ? p.tile_expert[mt] : 0, g, [&](auto P) {
    const int e = p.tile_expert[mt], row0 = p.tile_row0[mt], row_end = p.tile_row_end[mt], F = s.F;
    const Operand rows = expert_rows(sm, cta_slot(p.cta_maps), &p.m_xrows, p.sv.x_rows, s.H, row0, row_end);
    gemm_group<0, 0, decltype(P)::value, kFwdBoxRows>(
        sm, g, cdiv(F, BF), s.H / BK,
        [&](int nt, Operand& A, Operand& B) {
          const int gate = e * 2 * F + nt * BF, up = gate + F;
          A = rows;
          B = Operand{&p.m_w13, {gate, gate + 64, up, up + 64}, 0};
        },
        [&](int nt, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
          add_gate_up_bias(acc, l, p.b13, e, F, nt);
          swiglu_store<kClamped>(sm, acc, wg, w, l, row0, row_end, nt * BF, F, p.sv.a_rows, p.sv.h_rows, &p.st_arows,
                                 &p.st_hrows, row0, spare, s.swiglu_alpha, s.swiglu_limit);
        });
  });
  if (!ok) return;
  signal_counter(sm, &p.st.sync->counter[C_FIXED + mt]);
}

__device__ __forceinline__ void shared1_task(Smem& sm, const FwdParams& p, int mt, int g) {
  const Shape& s = p.s;
  const int t0 = mt * BM, Fs = s.Fs;
  gemm_group<0, 0, false, kFwdBoxRows>(
      sm, g, cdiv(Fs, BF), s.H / BK,
      [&](int nt, Operand& A, Operand& B) {
        A = rows128(&p.m_x, t0, 0, s.T - t0);
        B = Operand{&p.m_ws13, {nt * BF, nt * BF + 64, Fs + nt * BF, Fs + nt * BF + 64}, 0};
      },
      [&](int nt, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
        swiglu_store(sm, acc, wg, w, l, t0, s.T, nt * BF, Fs, p.sv.sa, p.sv.sh, &p.st_sa, &p.st_sh, t0, spare);
      });
  signal_counter(sm, &p.st.sync->counter[C_FIXED + s.max_mt + mt]);
}

__device__ __forceinline__ void gemm2_task(Smem& sm, const FwdParams& p, int task, bool pairable) {
  const Shape& s = p.s;
  int mt, g;  // (after PREFIX: its band table)
  bool ok = wait_counter(sm, &p.st.sync->counter[C_PREFIX], 1, p.st, 19);
  expert_band_order(p.sv.tile_band, task, s.max_mt, groups(cdiv(s.H, BN), s.F / BK), &mt, &g);
  ok = ok && wait_counter(sm, &p.st.sync->counter[C_FIXED + mt], groups(cdiv(s.F, BF), s.H / BK), p.st, 19);
  const bool valid = ok && mt < *p.num_tiles;  // (walk_tiles' tiles all hold rows)
  paired_task(sm, pairable, ok, valid, valid ? p.tile_expert[mt] : 0, g, [&](auto P) {
    const int e = p.tile_expert[mt], row0 = p.tile_row0[mt], row_end = p.tile_row_end[mt];
    const Operand rows = expert_rows(sm, cta_slot(p.cta_maps), &p.m_hrows, p.sv.h_rows, s.F, row0, row_end);
    gemm_group<0, 0, decltype(P)::value, kFwdBoxRows>(
        sm, g, cdiv(s.H, BN), s.F / BK,
        [&](int nt, Operand& A, Operand& B) {
          A = rows;
          B = wide(&p.m_w2, e * s.H + nt * BN, 0);
        },
        [&](int nt, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
          if (p.b2) {  // columns h = nt BN + c of b2[e] [H]
            const bf16* b = p.b2 + (int64_t)e * s.H + nt * BN;
            add_col_bias(acc, l, b, s.H - nt * BN, b + 128, s.H - nt * BN - 128);
          }
          store_tile<kStoreBf16>(sm, acc, wg, w, l, row0, row_end, nt * BN, s.H, p.sv.o_rows, s.H, &p.st_orows, row0, spare);
        });
  });
  if (!ok) return;
  // W = 1: all of GEMM2 (COMBINE's wait); W > 1: the tile's count, after GEMM1's groups
  // (RETURN's wait), and RETURN publishes the rows' arrival
  signal_counter(sm, &p.st.sync->counter[s.W > 1 ? C_FIXED + mt : C_G2]);
}

// ---- RETURN, W > 1: return stream d of s.nr ----
// As GEMM2 completes each m-tile mt = d, d + nr, ... of this rank's experts (the tile's
// counter: GEMM1's groups, then GEMM2's), the tile's rows of other ranks' slots go to
// those ranks' o_kept at the slot (row_src, written by the source's DISPATCH), while
// GEMM2 goes on with later tiles. COMBINE then reads only local rows instead of pulling
// T K (W - 1) / W rows over NVLink after every owner's last GEMM2 (268 MB each way at
// qwen3-30b-a3b, W = 2: about 0.77 ms of NVLink with nothing beside it). A warp copies
// kCopyRows rows at a time (copy_rows_smem). The last return task to finish publishes
// kFlagExperts.
__device__ __noinline__ void return_task(Smem& sm, const FwdParams& p, int d) {
  const Shape& s = p.s;
  if (!wait_counter(sm, &p.st.sync->counter[C_PREFIX], 1, p.st, 19)) return;  // (the tile table)
  const uint32_t done = (uint32_t)(groups(cdiv(s.F, BF), s.H / BK) + groups(cdiv(s.H, BN), s.F / BK));
  const int tiles = *(volatile const int*)p.num_tiles, H = s.H;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = kThreads / 32;
  if (threadIdx.x == 0) release_stages_from_stores(sm);
  cta_sync();
  const uint32_t buf = smem_addr(sm.stage) + (warp * kCopyChunks * 32 + lane) * 16;
  for (int mt = d; mt < tiles; mt += s.nr) {
    if (!wait_counter(sm, &p.st.sync->counter[C_FIXED + mt], done, p.st, 19)) return;
    const int row0 = p.tile_row0[mt], row1 = min(row0 + BM, p.tile_row_end[mt]);
    for (int pos = row0 + warp; pos < row1;) {  // the warp's rows of other ranks' slots, kCopyRows at a time
      const bf16* src[kCopyRows];
      bf16* dst[kCopyRows];
      int n = 0;
#pragma unroll
      for (int k = 0; k < kCopyRows; k++) {
        src[k] = p.sv.o_rows, dst[k] = nullptr;
        for (; pos < row1 && dst[k] == nullptr; pos += warps) {
          const int64_t from = p.ret.row_src[s.rank][pos];
          const int r = (int)(from >> 32);
          if (r == s.rank) continue;  // (COMBINE reads this rank's own rows in place)
          src[k] = p.sv.o_rows + (int64_t)pos * H, dst[k] = p.ret.o_kept[r] + (int64_t)(uint32_t)from * H;
          n = k + 1;
        }
      }
      copy_rows_smem(buf, src, dst, n, H, lane);
    }
  }
  fence_proxy_async_smem();  // (the stages' generic writes before a next GEMM task's TMA loads)
  __threadfence_system();  // (each thread's stores into the sources' o_kept)
  signal_counter_publish(sm, &p.st.sync->counter[C_RET], (uint32_t)s.nr, p.px, s, kFlagExperts, sm.peer_serial);
}

__device__ __forceinline__ void shared2_task(Smem& sm, const FwdParams& p, int mt, int g) {
  const Shape& s = p.s;
  if (!wait_counter(sm, &p.st.sync->counter[C_FIXED + s.max_mt + mt], groups(cdiv(s.Fs, BF), s.H / BK), p.st, 19)) return;
  const int t0 = mt * BM;
  gemm_group<0, 0, false, kFwdBoxRows>(
      sm, g, cdiv(s.H, BN), s.Fs / BK,
      [&](int nt, Operand& A, Operand& B) {
        A = rows128(&p.m_sh, t0, 0, s.T - t0);
        B = wide(&p.m_ws2, nt * BN, 0);
      },
      [&](int nt, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
        store_tile<kStoreBf16>(sm, acc, wg, w, l, t0, s.T, nt * BN, s.H, p.shared_o, s.H, &p.st_shared_o, t0, spare);
      });
  signal_counter(sm, &p.st.sync->counter[C_S2]);
}

// ---- COMBINE ----
__device__ __noinline__ void combine_task(Smem& sm, const FwdParams& p, int sb) {
  const Shape& s = p.s;
  const int nH2 = groups(cdiv(s.H, BN), s.F / BK), nHs = groups(cdiv(s.H, BN), s.Fs / BK);
  const bool ret = s.W > 1;  // every rank's RETURN has sent this rank its o rows
  if (!wait_counter(sm, &p.st.sync->counter[ret ? C_RET : C_G2], ret ? (uint32_t)s.nr : (uint32_t)(s.max_mt * nH2),
                    p.st, 19, kFlagExperts))
    return;  // (every owner's o rows)
  if (s.Fs > 0 && !wait_counter(sm, &p.st.sync->counter[C_S2], (uint32_t)(s.smt * nHs), p.st, 19)) return;
  const int t0 = sb * kSubTokens, t1 = min(s.T, t0 + kSubTokens), H = s.H;
  if (threadIdx.x == 0) release_stages_from_stores(sm);  // (sum_slot_rows' chunks go there)
  cta_sync();
  for (int t = t0 + threadIdx.x / 32; t < t1; t += kThreads / 32) {
    // the shared gate (use_shared_gate; kept in saved for the backward), else 1: not applied
    const float sg = s.shared_gate ? shared_gate_warp(p.x + (int64_t)t * H, p.w_sg, H) : 1.f;
    if (s.shared_gate && threadIdx.x % 32 == 0) p.sv.sg[t] = sg;
    sum_slot_rows<true>(  // y = sum_j g_j o_j, slots in order, then + (s_g) the shared expert's o
        sm, p.peer_o_rows, p.sv, s, t, ret ? p.ret.o_kept[s.rank] : nullptr,
        [&](int v, uint32_t x) {
          if (s.Fs > 0) cp_async_16(x, p.shared_o + (int64_t)t * H + v * 8);
        },
        [&](int v, float(&acc)[8], uint32_t x) {
          if (s.Fs > 0) {
            float o[8];
            ld_shared_bf16x8(x, o);
#pragma unroll
            for (int k = 0; k < 8; k++) acc[k] = __fadd_rn(acc[k], s.shared_gate ? __fmul_rn(sg, o[k]) : o[k]);
          }
          store_bf16x8(p.y + (int64_t)t * H + v * 8, acc);
        });
  }
  fence_proxy_async_smem();  // (the stages' generic writes before a next GEMM task's TMA loads)
  cta_sync();
}

// The phases whose GEMM tasks two CTAs of a cluster may run as a pair: gemm1, gemm2.
__device__ __forceinline__ bool paired_phase(int k) { return k == 4 || k == 6; }

// Phases (kinds): 0 route, 1 shared1, 2 prefix, 3 dispatch, 4 gemm1, 5 shared2, 6 gemm2,
// 7 combine, 8 return (profile slot 23). The i-th phase in ticket order: return's
// tickets come before gemm2's, so that its tasks hold their CTAs while GEMM2 runs.
constexpr int kFwdPhases = 9;
__host__ __device__ constexpr int fwd_order(int i) { return i <= 5 ? i : i == 6 ? 8 : i - 1; }

// The kernel's body; kClamped: the routed experts' clamped SwiGLU (cfg.activation), in a
// kernel of its own so that the plain one keeps its code and registers (one body inlining
// both epilogues spilled at 255 registers).
template <bool kClamped>
__device__ __forceinline__ void forward_kernel(const FwdParams& p) {
  Smem& sm = kernel_smem(p.st.knobs);
  if (!producer_split(sm)) return;  // (a producer's kernel: its warpgroup 2 leaves)
  const Shape& s = p.s;
  set_peers(sm, p.px, s, p.st);
  // GEMM tasks per row tile (column-tile groups)
  const int nF1 = groups(cdiv(s.F, BF), s.H / BK), nS1 = groups(cdiv(s.Fs, BF), s.H / BK);
  const int nH2 = groups(cdiv(s.H, BN), s.F / BK), nHs = groups(cdiv(s.H, BN), s.Fs / BK);
  const int n_route = s.nb, n_sh1 = s.Fs ? s.smt * nS1 : 0, n_g1 = s.max_mt * nF1;
  const int n_sh2 = s.Fs ? s.smt * nHs : 0, n_g2 = s.max_mt * nH2;
  // The phases in ticket order: route, shared1, prefix, dispatch, gemm1, shared2, return,
  // gemm2, combine (kinds 0-5, 8, 6, 7: fwd_order); with pairs the paired phases (gemm1,
  // gemm2) start at an even ticket (one skipped before), so that a cluster's two tickets
  // are two m-tiles of one column group (expert_segments: every band starts at an even tile
  // and holds an even number of tiles): a pair when both are the same expert's
  // (pair_agree; walk_tiles). In shared memory: indexed by a run-time phase, an array in
  // registers would be local memory.
  __shared__ int phase_start[kFwdPhases], phase_end[kFwdPhases];
  if (threadIdx.x == 0) {
    const int count[kFwdPhases] = {n_route, n_sh1, 1, s.nd, n_g1, n_sh2, n_g2, s.ns, s.nr};
    int t = 0;
    for (int i = 0; i < kFwdPhases; i++) {
      const int k = fwd_order(i);
      t = pad_even(t, s.pairs && (paired_phase(k) || k == 8));  // (return: return_tasks)
      phase_start[i] = t, phase_end[i] = t += count[k];
    }
  }
  cta_sync();
  const int num_tasks = phase_end[kFwdPhases - 1];
  int task;
  while (next_task(sm, p.st, num_tasks, &task)) {
    if (task >= num_tasks) continue;  // a cluster's second ticket past the last task
    const int i = ticket_phase(phase_start, phase_end, kFwdPhases, task);
    if (i < 0) continue;
    const int kind = fwd_order(i);
    profile_start(sm, p.st);
    const int local = task - phase_start[i];
    const bool pairable = paired_phase(kind) && partner_in_phase(sm, phase_start, phase_end, kFwdPhases, task, i);
    switch (kind) {
      case 0: route_task(sm, p, local); break;
      case 1: shared1_task(sm, p, local / nS1, local % nS1); break;
      case 2: prefix_task(sm, p); break;
      case 3: dispatch_task(sm, p, local); break;
      case 4: gemm1_task<kClamped>(sm, p, local, pairable); break;
      case 5: shared2_task(sm, p, local / nHs, local % nHs); break;
      case 6: gemm2_task(sm, p, local, pairable); break;
      case 7: combine_task(sm, p, local); break;
      default: return_task(sm, p, local); break;
    }
    profile_task(sm, p.st, kind == 8 ? 23 : kind);
  }
  producer_stop(sm);
  finish_step(sm, p.st);
}
__global__ void MOK_KERNEL_BOUNDS sm90_moe_forward_kernel(const __grid_constant__ FwdParams p) {
  forward_kernel<false>(p);
}
__global__ void MOK_KERNEL_BOUNDS sm90_moe_forward_clamped_kernel(const __grid_constant__ FwdParams p) {
  forward_kernel<true>(p);
}

}  // namespace mok
