// sm90_moe_backward.cu — the backward megakernel: every gradient of the layer in one
// persistent launch (CPU reference: bf16_backward in src/cpu/layer_impl.h).
//
// Tasks, in ticket order (each waits only on earlier ones):
//   DG[b]         32-token block b: d_g[t, j] = dy[t] . o_j; dy_j = bf16(g dy[t]) to the
//                 expert rows; router backward (dlogits, bf16) or d_topk_weight; with
//                 the shared gate dy_s, dl_g (shared_gate_backward)
//   RG[m,n]       cfg.gate_up = MOK_GATE_UP_RECOMPUTE only: the forward's GEMM1 again,
//                 a_rows = bf16(x_rows w13[e]^T), h_rows = bf16(silu(gate) up)
//   RGS[m,n]      likewise the forward's SHARED1: sa, sh
//   DHS[m,n]      shared expert: dh_s = dy ws2 (dy_s with the gate), d_a_s = bf16(SwiGLU')
//   DH[m,n]       experts: dh = dy_j w2[e], d_a = bf16(SwiGLU')
//   DXR[b,n]      dx router path = dlogits w_router (fp32)
//   DXS[m,n]      dx shared path = d_a_s ws13 (fp32)
//   DX[m,n]       dx_j = bf16(d_a w13[e])
//   WG2[e,m,n]    dw2[e] = dy_rows^T h_rows, over the expert's rows in order
//   DXSUM[b]      (32 tokens) dx[t] = bf16(sum_j dx_j + router path + shared path
//                 (+ dl_g w_sg with the shared gate)); x_late: x[t] back to its rows
//   RW[c]         replicated gradients of 64-token chunk c: d_b_router, d_w_sg
//     [seg,g]     then dW_router, and the shared expert's dws13, dws2: a segment of up
//                 to 16 chunks' partials summed along the tree (seg_task), per 128 x 64 tile
//   WG13[e,m,n]   dw13[e] = d_a^T x_rows (x_late: after every DXSUM)
//   TREE[slice]   the fixed pairwise tree over the chunks, then written out
// MOK_BWD_PRODUCER (a measurement build, sm90_smem.cuh): the forward's producer split
// (MOK_PRODUCER) in this kernel.
#ifdef MOK_BWD_PRODUCER
#define MOK_PRODUCER_TU
#endif
#include "sm90_epilogues.cuh"
#include "sm90_token_rows.cuh"
#include "sm90_tree.cuh"

namespace mok {

enum : int {
  B_DG, B_DH_ALL, B_DHS_ALL, B_DXR, B_DXS, B_DX, B_RW, B_TREE, B_RG_ALL, B_RGS_ALL, B_WG2_ALL, B_DXSUM, B_FIXED
};
// then dh[max_mt], dhs[smt], rg[max_mt], rgs[smt], dh_expert[e_loc] (gpu_params.h's
// bwd_num_counters)
static_assert(B_FIXED == kBwdFixedCounters, "gpu_params.h's bwd_num_counters");
__device__ __forceinline__ int c_rg(const Shape& s, int mt) { return B_FIXED + s.max_mt + s.smt + mt; }
__device__ __forceinline__ int c_rgs(const Shape& s, int mt) { return B_FIXED + 2 * s.max_mt + s.smt + mt; }
// h_late: DH's tasks of this rank's expert e, counted for its WG2 tasks (expert_dh_done)
__device__ __forceinline__ int c_dh_expert(const Shape& s, int e) { return B_FIXED + 2 * (s.max_mt + s.smt) + e; }

__device__ __forceinline__ int cdivb(int a, int b) { return (a + b - 1) / b; }

// Rank r's chunks in the global chunk order (the forward wrote every rank's T into the
// saved header): ceil(T_r / 64).
__device__ __forceinline__ int rank_chunks(const BwdParams& p, int r) {
  return cdivb((int)p.sv.header[5 + r], MOK_REDUCE_CHUNK_TOKENS);
}
// The level of the largest aligned subtree of the chunk tree that starts at chunk a and
// ends by chunk b: the split of a rank's chunks [a, b) into whole nodes of the tree of
// any chunk count, in order (a += 2^level until b).
__device__ __forceinline__ int subtree_level(int a, int b) {
  int L = 0;
  while (L + 1 < 26 && (a & ((2 << L) - 1)) == 0 && a + (2 << L) <= b) L++;
  return L;
}
// The shared expert's segments: the split of a rank's chunks [a, b) into aligned whole
// subtrees of at most 2^kSegLevels chunks (gpu_params.h), in order.
__device__ __forceinline__ int seg_level(int a, int b) { return min(kSegLevels, subtree_level(a, b)); }
// This rank's first chunk in the global chunk order.
__device__ __forceinline__ int first_chunk(const BwdParams& p) {
  int chunk0 = 0;
  for (int r = 0; r < p.s.rank; r++) chunk0 += rank_chunks(p, r);
  return chunk0;
}
// The replicated gradients' columns (partial_len: the tree's, the W > 1 windows'):
// [d_w_router E H | d_ws13 2 Fs H | d_ws2 H Fs | d_b_router | d_w_sg H]. The GEMMs'
// columns, the first router_cols + shared_cols, come a segment of chunks at a time
// (SEG tasks: seg_len columns a node, column x at x - seg_skip; the router's only when
// fused); a chunk's partials (RW) hold the rest, the vectors: chunk_len columns a chunk,
// column x at x - seg_end.
__device__ __forceinline__ int64_t shared_cols(const Shape& s) { return 3LL * s.Fs * s.H; }
__device__ __forceinline__ int64_t seg_end(const Shape& s) { return (int64_t)s.E * s.H + shared_cols(s); }
__device__ __forceinline__ int64_t seg_skip(const Shape& s) { return s.fused ? 0 : (int64_t)s.E * s.H; }
__device__ __forceinline__ int64_t seg_len(const Shape& s) { return seg_end(s) - seg_skip(s); }
__device__ __forceinline__ int64_t chunk_len(const BwdParams& p) { return p.partial_len - seg_end(p.s); }
// SEG's tiles, 128 x 64: d_w_router [E, H] = dlogits^T x (fused), then the shared
// expert's d_ws13 [2Fs, H] = d_a_s^T x and d_ws2 [H, Fs] = dy_s^T sh; kSegTileGroup a
// task, the router's groups first (they wait for DG alone).
__device__ __forceinline__ int router_tiles(const Shape& s) { return s.fused ? cdivb(s.E, BM) * cdivb(s.H, 64) : 0; }
__device__ __forceinline__ int shared_tiles13(const Shape& s) { return cdivb(2 * s.Fs, BM) * cdivb(s.H, 64); }
__device__ __forceinline__ int shared_tiles(const Shape& s) {
  return s.Fs ? shared_tiles13(s) + cdivb(s.H, BM) * cdivb(s.Fs, 64) : 0;
}
__device__ __forceinline__ int router_groups(const Shape& s) { return cdivb(router_tiles(s), kSegTileGroup); }
__device__ __forceinline__ int seg_groups(const Shape& s) {
  return router_groups(s) + cdivb(shared_tiles(s), kSegTileGroup);
}
// RW's per-chunk tasks: with the router bias's gradient or the shared gate's.
__device__ __forceinline__ int rw_chunk_tasks(const Shape& s) {
  return s.use_router_bias || s.shared_gate ? s.chunks : 0;
}

// ---- the saved buffer's checks ----
// The forward writes saved into a caller's buffer, and the backward takes it back from
// there: whatever it holds, no address the backward forms from it may leave the buffers.
// What of saved decides an address:
// - the header's T words: each rank's chunk range (rank_chunks: W > 1, the tree window's
//   subtrees);
// - counts and expert_off of this rank's experts: every m-tile's rows (expert_tile: DH,
//   DX, RG and their TMA boxes, cut maps and tail stores) and each weight gradient's rows
//   (wgrad_task's cut maps);
// - tile_band: which (m-tile, column group) a DH or DX task takes (expert_band_order);
//   in range by construction, but a table that is not a partition of the m-tiles leaves
//   some tile's counter short, and its consumers would wait for the step's timeout;
// - pos and idx: each slot's row in its owner's buffers (DG reads o_j and writes dy_j
//   there, DXSUM reads dx_j) and its expert (the owner; DG's router backward indexes its
//   scores by it).
// (logits, g and the rows' values are values; sorted, loc_off and loc_shift are the
// forward's alone.) The checks, each before the first use it guards:
// - saved_header_ok: thread 0 of every CTA before its first task (every CTA reads the
//   same words, so each raises the error before it takes a ticket): the magic, this
//   context's serial, T, a forward serial in [1, forward_serial], each rank's T in
//   [0, cfg.T] summing to the total and this rank's equal to T, the context's shape;
// - saved_tables_ok: the first DG task (all its threads), before anything that waits for
//   DG: this rank's experts' counts >= 0 and offsets their prefix sums from 0 up to
//   expert_off[E] <= capacity, and tile_band a partition of [0, max_mt) into bands that
//   each of their tiles names. (In the kernel's prologue, a call or the code inlined made
//   the kernel spill.) RG, the one task that reads the tables without waiting for DG,
//   takes an m-tile only when expert_tile's rows lie in [0, capacity);
// - pos and idx (T K words each): where DG loads them anyway. A row at or past capacity
//   or an expert outside [0, E) raises the error and its slot moves nothing.
// A DG task that finds any of these raises MOK_STATUS_INVALID_SAVED and does not signal,
// so no task that waits for DG runs: every writer of an output, and DXSUM, which reads
// pos and idx again after every DG task has checked them.
// (Conditions joined by &, not &&: every load issued at once, not each after the last's
// verdict.)
__device__ __forceinline__ bool saved_header_ok(const BwdParams& p) {
  const Shape& s = p.s;
  const uint64_t* h = p.sv.header;
  bool ok = (h[0] == MOK_SAVED_MAGIC_GPU) & (h[1] == p.context_id) & (h[2] == (uint64_t)s.T) & (h[3] >= 1) &
            (h[3] <= p.forward_serial);
  uint64_t all = 0;  // (W <= kMaxPeers words, each at most cfg.T when ok)
  for (int r = 0; r < s.W; r++) ok &= h[5 + r] <= (uint64_t)s.cfg_T, all += h[5 + r];
  ok &= (all == h[4]) & (h[5 + s.rank] == (uint64_t)s.T);
#pragma unroll
  for (int k = 0; k < kSavedShapeWords; k++) ok &= h[kHeaderShape + k] == saved_shape_word(s, k);
  return ok;
}
static __device__ __noinline__ bool saved_tables_ok(const BwdParams& p) {
  const Shape& s = p.s;
  const SavedView& sv = p.sv;
  bool ok = true;
  const int e0 = s.rank * s.e_loc;
  for (int l = threadIdx.x; l < s.e_loc; l += kThreads) {  // expert l's rows [off, off + n) end where l + 1's begin
    const int64_t off = sv.expert_off[e0 + l], n = sv.counts[e0 + l];
    const int64_t end = sv.expert_off[l + 1 < s.e_loc ? e0 + l + 1 : s.E];
    ok &= (n >= 0) & (l > 0 || off == 0) & (off + n == end) & (end <= p.capacity);
  }
#pragma unroll 4
  for (int q = threadIdx.x; q < s.max_mt; q += kThreads) {  // q's band holds q; the band before ends at its first
    const uint32_t b = (uint32_t)sv.tile_band[q], prev = (uint32_t)sv.tile_band[max(q - 1, 0)];
    const int first = (int)(b >> 8), rows = (int)(b & 255u);
    ok &= (rows > 0) & (first <= q) & (q < first + rows) & (first + rows <= s.max_mt) &
          (q > first ? prev == b : q == 0 || (int)(prev >> 8) + (int)(prev & 255u) == q);
  }
  return cta_reduce<false>(ok);
}

// A token's slots in the router backward, lane j holding slot j (K <= 32): its expert
// (0 if the saved index is out of range: raised, *bad set), d_g times route_scale, and
// the warp's S = sum_j s_j and dot = sum_j dgn_j s_j / S over the slots in order (g_j =
// route_scale s_j / S). sw: the token's scores [E] in the warp's scratch; e: the lane's
// saved expert index (loaded by the caller before the scores, so that its load and the
// logits' are in flight together); dg: the lane's slot's d_g (DG's own warp_sum).
struct TokenSlots {
  int e;
  float dgn, S, dot;
};
__device__ __forceinline__ TokenSlots token_slots(const BwdParams& p, const float* sw, int e, float dg, bool& bad) {
  const int E = p.s.E, K = p.s.K, lane = threadIdx.x % 32;
  TokenSlots ts;
  ts.e = lane < K ? e : 0;
  if ((uint32_t)ts.e >= (uint32_t)E) {  // (sw's index)
    ts.e = 0, bad = true;
    raise_error(p.st, MOK_STATUS_INVALID_SAVED);
  }
  ts.dgn = lane < K ? __fmul_rn(dg, p.s.route_scale) : 0.f;
  __syncwarp();  // (sw's scores written)
  ts.S = 0.f, ts.dot = 0.f;
  for (int j = 0; j < K; j++) ts.S = __fadd_rn(ts.S, sw[__shfl_sync(~0u, ts.e, j)]);
  for (int j = 0; j < K; j++) {
    const float v = sw[__shfl_sync(~0u, ts.e, j)];
    ts.dot = __fadd_rn(ts.dot, __fmul_rn(__shfl_sync(~0u, ts.dgn, j), __fdiv_rn(v, ts.S)));
  }
  __syncwarp();  // (sw read)
  return ts;
}

// The router backward of token t, in one warp (lane holding experts lane + 32 i, i < NR:
// E <= 32 NR): dlogits from the saved logits, the slots' d_g (lane j: slot j's, dg) and
// the losses' terms. A saved expert index out of range is raised and sets bad. The
// caller has acquired sm.epi, where warp_scratch is.
template <int NR>
__device__ __forceinline__ void router_token(Smem& sm, const BwdParams& p, int t, float dg, bool& bad) {
  const Shape& s = p.s;
  const int E = s.E, K = s.K, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float d_aux = p.d_aux ? *p.d_aux : 1.f, d_z = p.d_z ? *p.d_z : 1.f;
  const float T_all = (float)p.sv.header[4], TK = T_all * (float)K;  // (the tokens of every rank)
  const int saved_e = lane < K ? p.sv.idx[(int64_t)t * K + lane] : 0;
  float sc[NR], pz[NR], ds[NR];
  const float lse = token_scores<NR>(p.sv.logits + (int64_t)t * s.Ep, E, s.score, pz, sc);
#pragma unroll
  for (int i = 0; i < NR; i++) {
    const int e = lane + 32 * i;
    ds[i] = 0.f;
    if (e < E && s.aux_coef != 0.f)  // d aux / d s[t, e] = d_aux alpha E f_e / T
      ds[i] = __fdiv_rn(__fmul_rn(__fmul_rn(__fmul_rn(d_aux, s.aux_coef), (float)E),
                                  __fdiv_rn((float)p.sv.counts[e], TK)), T_all);
  }
  float* sw = sm.warp_scratch[warp];  // (shares sm.epi: the caller's epi_acquire)
#pragma unroll
  for (int i = 0; i < NR; i++)
    if (lane + 32 * i < E) sw[lane + 32 * i] = sc[i];
  const TokenSlots ts = token_slots(p, sw, saved_e, dg, bad);
  const int my_e = ts.e;
  const float my_dgn = ts.dgn, S = ts.S, dot = ts.dot;
  for (int j = 0; j < K; j++) {
    const int e = __shfl_sync(~0u, my_e, j);
    const float dgn = __shfl_sync(~0u, my_dgn, j);
    const float d = s.normalize ? __fdiv_rn(__fsub_rn(dgn, dot), S) : dgn;
#pragma unroll
    for (int i = 0; i < NR; i++)
      if (lane + 32 * i == e) ds[i] = __fadd_rn(ds[i], d);
  }
  float dl[NR];
  if (s.score == MOK_SCORE_SOFTMAX) {
    float sd = 0.f;
#pragma unroll
    for (int i = 0; i < NR; i++) sd = __fadd_rn(sd, __fmul_rn(ds[i], sc[i]));
    sd = warp_sum(sd);
#pragma unroll
    for (int i = 0; i < NR; i++) dl[i] = __fmul_rn(sc[i], __fsub_rn(ds[i], sd));
  } else {
#pragma unroll
    for (int i = 0; i < NR; i++) dl[i] = __fmul_rn(__fmul_rn(ds[i], sc[i]), __fsub_rn(1.f, sc[i]));
  }
  if (s.z_coef != 0.f) {  // d/dl of beta mean_t lse^2 = beta 2 lse softmax(l) / T
    const float zc = __fdiv_rn(__fmul_rn(__fmul_rn(__fmul_rn(d_z, s.z_coef), 2.f), lse), T_all);
#pragma unroll
    for (int i = 0; i < NR; i++) dl[i] = __fadd_rn(dl[i], __fmul_rn(zc, pz[i]));
  }
#pragma unroll
  for (int i = 0; i < NR; i++)
    if (lane + 32 * i < E) p.dlogits[(int64_t)t * s.Ep + lane + 32 * i] = to_bf(dl[i]);
}
// router_token for any E (up to kMaxRouterExperts; used past 256), holding no
// per-expert arrays (32 of each would not fit beside the DG task's registers): the
// scores, then ds, live in the warp's scratch row, a probability or score is computed
// again from its logit where it is needed (router_prob / router_score: the same bits),
// and every sum runs in router_token's order (a lane's experts in increasing e, then
// the butterfly), so E <= 256 would give router_token<8>'s bits too.
__device__ __forceinline__ void router_token_wide(Smem& sm, const BwdParams& p, int t, float dg, bool& bad) {
  const Shape& s = p.s;
  const int E = s.E, K = s.K, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float d_aux = p.d_aux ? *p.d_aux : 1.f, d_z = p.d_z ? *p.d_z : 1.f;
  const float T_all = (float)p.sv.header[4], TK = T_all * (float)K;  // (the tokens of every rank)
  float* sw = sm.warp_scratch[warp];  // (shares sm.epi: the caller's epi_acquire)
  const int saved_e = lane < K ? p.sv.idx[(int64_t)t * K + lane] : 0;
  const float* lg = p.sv.logits + (int64_t)t * s.Ep;
  float m, sum;
  const float lse = token_softmax_sums(lg, E, m, sum);
  for (int e = lane; e < E; e += 32) sw[e] = router_score(lg[e], router_prob(lg[e], m, sum), s.score);
  const TokenSlots ts = token_slots(p, sw, saved_e, dg, bad);
  const int my_e = ts.e;
  const float my_dgn = ts.dgn, S = ts.S, dot = ts.dot;
  // ds = the aux term, plus slot j's d at its expert (a token's experts are distinct:
  // one addition each, as in router_token; a corrupt repeat is raised above or only
  // races within this row)
  for (int e = lane; e < E; e += 32)
    sw[e] = s.aux_coef != 0.f ? __fdiv_rn(__fmul_rn(__fmul_rn(__fmul_rn(d_aux, s.aux_coef), (float)E),
                                                    __fdiv_rn((float)p.sv.counts[e], TK)), T_all)
                              : 0.f;
  __syncwarp();
  if (lane < K) sw[my_e] = __fadd_rn(sw[my_e], s.normalize ? __fdiv_rn(__fsub_rn(my_dgn, dot), S) : my_dgn);
  __syncwarp();
  float sd = 0.f;
  if (s.score == MOK_SCORE_SOFTMAX) {
    for (int e = lane; e < E; e += 32) sd = __fadd_rn(sd, __fmul_rn(sw[e], router_prob(lg[e], m, sum)));
    sd = warp_sum(sd);
  }
  const float zc = s.z_coef != 0.f ? __fdiv_rn(__fmul_rn(__fmul_rn(__fmul_rn(d_z, s.z_coef), 2.f), lse), T_all) : 0.f;
  for (int e = lane; e < E; e += 32) {
    const float pz = router_prob(lg[e], m, sum), sc = router_score(lg[e], pz, s.score);
    float dl = s.score == MOK_SCORE_SOFTMAX ? __fmul_rn(sc, __fsub_rn(sw[e], sd))
                                            : __fmul_rn(__fmul_rn(sw[e], sc), __fsub_rn(1.f, sc));
    if (s.z_coef != 0.f) dl = __fadd_rn(dl, __fmul_rn(zc, pz));
    p.dlogits[(int64_t)t * s.Ep + e] = to_bf(dl);
  }
  __syncwarp();  // (the next token's scores overwrite sw)
}

// ---- DG: d_g, dy_j, router backward ----
// A warp's slots stream through a ring of kDgRing units in shared memory; a unit is one
// round of one slot: kDgInFlight 16-byte chunks of its dy row and of its o row a lane
// (cp.async: none held in registers, which the kernel has none to spare for). While the
// warp sums one unit, the next kDgRing - 1 are in flight. One slot at a time a warp, with
// its indices loaded when it came up, DG was a chain of dependent loads: three quarters
// of its time went to the chain, not the rows (PERF.md, seventeenth session). DG tasks
// come first in ticket order, so before any GEMM task of this CTA: the stages are free.
// A lane's chunks: [warp][ring unit][dy, o][kDgInFlight][32 lanes].
constexpr int kDgInFlight = 8, kDgRing = 3;

// The shared gate's backward of tokens [t0, t1) (cfg.use_shared_gate), a warp a token,
// from the forward's s_g and o_s (saved): d s_g = dy[t] . o_s[t] (a lane's 16-byte
// chunks v = lane + 32 u in increasing u, 8 products each in order from +0, then
// warp_sum), dl_g = bf16(d s_g s_g (1 - s_g)) for DXSUM and RW, and dy_s = bf16(s_g dy),
// the shared expert's dy for DHS and RW (which wait for DG). The token's rows alone
// decide them (D3, D4).
__device__ __noinline__ void shared_gate_backward(const BwdParams& p, int t0, int t1) {
  const int H = p.s.H, nv = H / 8, lane = threadIdx.x % 32;
  for (int t = t0 + threadIdx.x / 32; t < t1; t += kThreads / 32) {
    const float sg = p.sv.sg[t];
    const uint4* dy = reinterpret_cast<const uint4*>(p.dy + (int64_t)t * H);
    const uint4* os = reinterpret_cast<const uint4*>(p.sv.shared_o + (int64_t)t * H);
    uint4* dys = reinterpret_cast<uint4*>(p.dy_s + (int64_t)t * H);
    float part = 0.f;
#pragma unroll 4
    for (int v = lane; v < nv; v += 32) {
      const uint4 dr = dy[v], orw = os[v];
      const bf16 *d = reinterpret_cast<const bf16*>(&dr), *o = reinterpret_cast<const bf16*>(&orw);
      uint4 out;
      bf16* ds = reinterpret_cast<bf16*>(&out);
#pragma unroll
      for (int k = 0; k < 8; k++) {
        part = __fadd_rn(part, __fmul_rn(bf(d[k]), bf(o[k])));
        ds[k] = to_bf(__fmul_rn(sg, bf(d[k])));
      }
      dys[v] = out;
    }
    part = warp_sum(part);
    if (lane == 0) p.dl_g[t] = to_bf(__fmul_rn(__fmul_rn(part, sg), __fsub_rn(1.f, sg)));
  }
}
static_assert((kThreads / 32) * kDgRing * 2 * kDgInFlight * 32 * 16 <= kStages * kStageBytes,
              "DG's ring fits in the stages");
__device__ __noinline__ void dg_task(Smem& sm, const BwdParams& p, int sb) {
  const Shape& s = p.s;
  // W > 1: every rank's previous launch has ended before this one writes its dy_rows (two
  // backward calls on one forward: a peer's first may still read them). The first
  // ticket's task (at W > 1 there is one even at T = 0: Shape::ns) tells every rank that
  // this backward has started; at the kernel's start that publish spilled the kernel
  // beside the gate|up recompute tasks (108 bytes).
  if (s.W > 1 && sb == 0 && threadIdx.x == 0) publish_peers(p.px, s, kFlagBackward, sm.peer_serial);
  if (s.W > 1 && !wait_peers(sm, p.st, kFlagBackward)) return;
  if (sb == 0 && !saved_tables_ok(p)) {  // (the saved buffer's checks: no signal, so no task that waits for DG runs)
    if (threadIdx.x == 0) raise_error(p.st, MOK_STATUS_INVALID_SAVED);
    return;
  }
  const int t0 = sb * kSubTokens, t1 = min(s.T, t0 + kSubTokens), K = s.K, H = s.H, E = s.E;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nv = H / 8, rounds = cdivb(nv, 32 * kDgInFlight);
  const uint32_t ring = smem_addr(sm.stage) + (warp * kDgRing * 2 * kDgInFlight * 32 + lane) * 16;
  if (s.fused) epi_acquire(sm);  // warp_scratch shares sm.epi with a previous task's TMA stores
  MOK_STALL_FROM(kStallDgRows);
  // The warp's tokens are t0 + warp + kWarps n, and its slots m < per those tokens' slots
  // in order (token_of(m), slot m % K), taken 32 at a time: lane l loads slot m = b + l's
  // row and weight once, and the warp reads them by shuffle. Once a token's last slot is
  // summed, the warp runs the token's router backward while its ring's next units (the
  // next token's rows) are in flight: the router's chain of dependent loads (logits, then
  // scores through the scratch) under the rows' streaming, not after it.
  constexpr int kWarps = kThreads / 32;
  const int per = max(t1 - t0 - warp + kWarps - 1, 0) / kWarps * K;
  auto token_of = [&](int m) { return t0 + warp + kWarps * (m / K); };
  bool bad = false;  // a slot's row or expert out of range (the saved buffer's checks): raised, and no signal
  float tok_dg = 0.f;  // lane j: d_g of slot j of the warp's current token (K <= 32)
  for (int b = 0; b < per; b += 32) {
    const int nb = min(32, per - b), units = nb * rounds;
    int my_t = 0, my_pos = 0, my_owner = 0;
    float my_g = 0.f;
    if (lane < nb) {
      const int m = b + lane, t = token_of(m), i = t * K + m % K;
      my_t = t, my_pos = p.sv.pos[i], my_g = p.sv.g[i];
      const int e = s.W > 1 ? p.sv.idx[i] : 0;  // (W = 1: every expert is this rank's)
      my_owner = e / s.e_loc;
      if ((uint32_t)my_pos >= (uint32_t)p.capacity || (uint32_t)e >= (uint32_t)E) {  // (its unit moves nothing)
        my_pos = -1, my_owner = s.rank, bad = true;
        raise_error(p.st, MOK_STATUS_INVALID_SAVED);
      }
    }
    // Unit u: slot b + u / rounds, its rows, its chunks v0 + 32 c (v0 = lane + 32
    // kDgInFlight (u % rounds)) and its place in the ring. Made again where the unit is
    // summed (four shuffles), not held in registers across the ring's depth.
    struct Unit {
      const uint4 *dy, *o;
      uint4* dst;
      int i, v0;
      float g;
      uint32_t at;
    };
    auto unit = [&](int u) {
      Unit x;
      const int k = u / rounds, t = __shfl_sync(~0u, my_t, k), pos = __shfl_sync(~0u, my_pos, k),
                owner = __shfl_sync(~0u, my_owner, k);
      x.g = __shfl_sync(~0u, my_g, k);
      x.i = t * K + (b + k) % K;
      const int64_t row = max(pos, 0);  // (pos -1: a slot rejected above, whose chunks all lie past nv)
      x.dy = reinterpret_cast<const uint4*>(p.dy + (int64_t)t * H);
      x.o = reinterpret_cast<const uint4*>(owner == s.rank ? p.peer_o_rows.rows[owner] + row * H
                                                           : p.o_kept + (int64_t)x.i * H);  // (where RETURN put it)
      x.dst = reinterpret_cast<uint4*>(p.peer_dy_rows.rows[owner] + row * H);
      x.v0 = pos < 0 ? nv : lane + (u % rounds) * 32 * kDgInFlight;
      x.at = ring + (u % kDgRing) * 2 * kDgInFlight * 512;
      return x;
    };
    auto issue = [&](int u) {  // (a group even when empty: the waits count groups)
      if (u < units) {
        const Unit x = unit(u);
#pragma unroll
        for (int c = 0; c < kDgInFlight; c++)
          if (x.v0 + 32 * c < nv) {
            cp_async_16(x.at + c * 512, x.dy + x.v0 + 32 * c);
            cp_async_16(x.at + (kDgInFlight + c) * 512, x.o + x.v0 + 32 * c);
          }
      }
      cp_async_commit();
    };
#pragma unroll 1
    for (int u = 0; u < kDgRing - 1; u++) issue(u);
    float part = 0.f;  // a slot's: lane's h in increasing order, then the warp's fixed tree
#pragma unroll 1
    for (int u = 0; u < units; u++) {
      issue(u + kDgRing - 1);
      cp_async_wait_group<kDgRing - 1>();  // (unit u's group; a lane reads back only its own chunks)
      const Unit x = unit(u);
#pragma unroll
      for (int c = 0; c < kDgInFlight; c++) {
        if (x.v0 + 32 * c >= nv) continue;
        const uint4 dr = ld_shared_v4(x.at + c * 512), orw = ld_shared_v4(x.at + (kDgInFlight + c) * 512);
        const bf16* d = reinterpret_cast<const bf16*>(&dr);
        const bf16* o = reinterpret_cast<const bf16*>(&orw);
        uint4 out;
        bf16* dj = reinterpret_cast<bf16*>(&out);
#pragma unroll
        for (int k = 0; k < 8; k++) {
          part = __fadd_rn(part, __fmul_rn(bf(d[k]), bf(o[k])));
          dj[k] = to_bf(__fmul_rn(x.g, bf(d[k])));
        }
        x.dst[x.v0 + 32 * c] = out;
      }
      if (u % rounds == rounds - 1) {  // the slot's last round
        const int m = b + u / rounds;
        part = warp_sum(part);
        if (lane == 0) p.dg[x.i] = part;  // (replay: DXSUM copies it to d_topk_weight, an output)
        if (lane == m % K) tok_dg = part;
        part = 0.f;
        if (s.fused && m % K == K - 1) {  // the token's last slot
          MOK_STALL_ADD(kStallDgRows);
          MOK_STALL_FROM(kStallDgRouter);
          if (E <= 256) router_token<8>(sm, p, token_of(m), tok_dg, bad);
          else router_token_wide(sm, p, token_of(m), tok_dg, bad);
          MOK_STALL_ADD(kStallDgRouter);
          MOK_STALL_FROM(kStallDgRows);
        }
      }
    }
  }
  if (s.shared_gate) shared_gate_backward(p, t0, t1);
  MOK_STALL_ADD(kStallDgRows);
  fence_proxy_async_smem();  // (the stages' generic writes before a next GEMM task's TMA loads)
  // a slot rejected: no signal, so that no task after DG (every writer of an output waits
  // for all of DG) runs; they see the error and leave the step
  if (cta_reduce<true>(bad)) return;
  if (s.W > 1) __threadfence_system();  // (each thread's dy rows into owners' buffers)
  signal_counter_publish(sm, &p.st.sync->counter[B_DG], (uint32_t)s.ns, p.px, s, kFlagDg, sm.peer_serial);
}

// Weight-gradient tile out: bf16 written, or added into fp32 buffers.
// st: the bf16 gradient's store map, whose row map_row is tile row r0.
__device__ __forceinline__ void store_wgrad(Smem& sm, const BwdParams& p, float (&acc)[kAcc], int wg, int w, int l, int r0,
                                            int rows, int c0, int cols, void* out, const StoreMap* st, int map_row,
                                            uint8_t* spare) {
  if (p.wgrad_fp32) store_tile<kAddF32>(sm, acc, wg, w, l, r0, rows, c0, cols, out, cols);
  else store_tile<kStoreBf16>(sm, acc, wg, w, l, r0, rows, c0, cols, out, cols, st, map_row, spare);
}

// Expert m-tile mt of the expert rows: (this rank's expert, first row, end row), false
// past the last. The forward's tile table, walked again from the saved counts and
// offsets of this rank's experts (e: the local index, as the weights are).
__device__ __forceinline__ bool expert_tile(const BwdParams& p, int mt, int* e, int* row0, int* row_end) {
  int first = 0;
  bool found = false;
  const int e0 = p.s.rank * p.s.e_loc;
  walk_tiles(p.sv.counts + e0, p.sv.expert_off + e0, p.s.e_loc, p.s.pairs, [&](int x, int r0, int n, int re) {
    if (mt >= first + n) return first += n, false;
    *e = x, *row0 = r0 + (mt - first) * BM, *row_end = re;
    return found = true;
  });
  // (rows within the buffers: RG runs before DG's check of the tables)
  return found & (*row0 >= 0) & (*row0 < *row_end) & (*row_end <= p.capacity);
}

// ---- RG, RGS: gate|up and h again (cfg.gate_up = MOK_GATE_UP_RECOMPUTE) ----
// The forward's GEMM1 and SHARED1 tasks with the same operands, K order and epilogue
// (swiglu_store), so a_rows, h_rows, sa and sh get the forward's bits: a row's values
// do not depend on the tile that holds it. Unpaired (pairing changes no bit either).
template <bool kClamped>
__device__ __forceinline__ void rg_task(Smem& sm, const BwdParams& p, int mt, int g) {
  const Shape& s = p.s;
  int e = -1, row0 = 0, row_end = 0;
  if (expert_tile(p, mt, &e, &row0, &row_end)) {
    const int F = s.F;
    gemm_group<0, 0, false, kBwdBoxRows>(
        sm, g, cdivb(F, BF), s.H / BK,
        [&](int nt, Operand& A, Operand& B) {
          const int gate = e * 2 * F + nt * BF, up = gate + F;
          A = rows128(&p.k_xrows, row0, 0, row_end - row0);
          B = Operand{&p.k_w13, {gate, gate + 64, up, up + 64}, 0};
        },
        [&](int nt, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
          add_gate_up_bias(acc, l, p.b13, e, F, nt);  // (the forward's gemm1_task)
          swiglu_store<kClamped>(sm, acc, wg, w, l, row0, row_end, nt * BF, F, p.sv.a_rows, p.sv.h_rows, &p.st_arows,
                                 &p.st_hrows, row0, spare, s.swiglu_alpha, s.swiglu_limit);
        });
  }
  signal_counter(sm, &p.st.sync->counter[c_rg(s, mt)]);
  if (threadIdx.x == 0) red_release_add(&p.st.sync->counter[B_RG_ALL], 1);
}

__device__ __forceinline__ void rgs_task(Smem& sm, const BwdParams& p, int mt, int g) {
  const Shape& s = p.s;
  const int t0 = mt * BM, Fs = s.Fs;
  gemm_group<0, 0, false, kBwdBoxRows>(
      sm, g, cdivb(Fs, BF), s.H / BK,
      [&](int nt, Operand& A, Operand& B) {
        A = rows128(&p.k_x, t0, 0, s.T - t0);
        B = Operand{&p.k_ws13, {nt * BF, nt * BF + 64, Fs + nt * BF, Fs + nt * BF + 64}, 0};
      },
      [&](int nt, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
        swiglu_store(sm, acc, wg, w, l, t0, s.T, nt * BF, Fs, p.sv.sa, p.sv.sh, &p.st_sa, &p.st_sh, t0, spare);
      });
  signal_counter(sm, &p.st.sync->counter[c_rgs(s, mt)]);
  if (threadIdx.x == 0) red_release_add(&p.st.sync->counter[B_RGS_ALL], 1);
}
// Column groups of an RG / RGS row tile: what its counter reaches.
__device__ __forceinline__ uint32_t rg_groups(const Shape& s) { return groups(cdivb(s.F, BF), s.H / BK); }
__device__ __forceinline__ uint32_t rgs_groups(const Shape& s) { return groups(cdivb(s.Fs, BF), s.H / BK); }
// The same for DH / DHS (dh's tasks a row tile)
__device__ __forceinline__ int dh_groups(const Shape& s) { return groups(cdivb(s.F, BN), s.H / BK); }
__device__ __forceinline__ int dhs_groups(const Shape& s) { return groups(cdivb(s.Fs, BN), s.H / BK); }

__device__ __forceinline__ void dhs_task(Smem& sm, const BwdParams& p, int mt, int g) {
  const Shape& s = p.s;
  if (p.recompute && !wait_counter(sm, &p.st.sync->counter[c_rgs(s, mt)], rgs_groups(s), p.st, 20)) return;
  if (s.shared_gate && !wait_counter(sm, &p.st.sync->counter[B_DG], s.ns, p.st, 20)) return;  // (dy_s)
  const int t0 = mt * BM;
  gemm_group<0, 1, false, kBwdBoxRows>(
      sm, g, cdivb(s.Fs, BN), s.H / BK,
      [&](int nt, Operand& A, Operand& B) {
        A = rows128(&p.k_dys, t0, 0, s.T - t0);
        B = wide(&p.m_ws2, nt * BN, 0);
      },
      [&](int nt, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
        swiglu_bwd_store(sm, acc, wg, w, l, t0, s.T, nt * BN, s.Fs, &p.m_sa_gu, t0, &p.st_das, t0, p.d_a_s, spare);
      });
  signal_counter(sm, &p.st.sync->counter[B_FIXED + s.max_mt + mt]);
  if (threadIdx.x == 0) red_release_add(&p.st.sync->counter[B_DHS_ALL], 1);
}

// pairable: this task and the partner CTA's are in the same GEMM phase (next_task);
// the key of pair_agree is the expert and column group (-1: no rows, nothing to share).
template <bool kClamped>
__device__ __forceinline__ void dh_task(Smem& sm, const BwdParams& p, int mt, int g, bool pairable) {
  const Shape& s = p.s;
  const bool ok = (p.st.knobs & kKnobOnlyDh) ||
                  (wait_counter(sm, &p.st.sync->counter[B_DG], s.ns, p.st, 20, kFlagDg) &&  // (every rank's dy rows)
                   (!p.recompute || wait_counter(sm, &p.st.sync->counter[c_rg(s, mt)], rg_groups(s), p.st, 20)));
  int e = -1, row0 = 0, row_end = 0;
  const bool valid = ok && expert_tile(p, mt, &e, &row0, &row_end);
  paired_task(sm, pairable, ok, valid, e, g, [&](auto P) {
    const Operand rows = expert_rows(sm, cta_slot(p.cta_maps), &p.k_dyrows, p.dy_rows, s.H, row0, row_end);
    gemm_group<0, 1, decltype(P)::value, kBwdBoxRows>(
        sm, g, cdivb(s.F, BN), s.H / BK,
        [&](int nt, Operand& A, Operand& B) {
          A = rows;
          B = wide(&p.m_w2, nt * BN, e * s.H);
        },
        [&](int nt, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
          swiglu_bwd_store<kClamped>(sm, acc, wg, w, l, row0, row_end, nt * BN, s.F, &p.m_arows_gu, row0, &p.st_da,
                                     row0, p.d_a, spare, p.h_late, &p.st_hrows, p.sv.h_rows,
                                     s.swiglu_alpha, s.swiglu_limit);
        });
  });
  if (!ok) return;
  signal_counter(sm, &p.st.sync->counter[B_FIXED + mt]);
  if (threadIdx.x == 0) {  // (after signal_counter's fence, as its own add)
    red_release_add(&p.st.sync->counter[B_DH_ALL], 1);
    if (p.h_late && e >= 0) red_release_add(&p.st.sync->counter[c_dh_expert(s, e)], 1);
  }
}

// dx_late (plan_bwd_ws, W = 1 with reuse): DX's dx_rows go where WG2 reads dy_rows, and
// DXR's dx_router may go where WG2 reads h_rows; so both wait for every WG2 task
// (wg2_total of them). True at once without dx_late.
__device__ __forceinline__ bool dx_late_ready(Smem& sm, const BwdParams& p, uint32_t wg2_total) {
  return !p.dx_late || wait_counter(sm, &p.st.sync->counter[B_WG2_ALL], wg2_total, p.st, 20);
}

__device__ __forceinline__ void dxr_task(Smem& sm, const BwdParams& p, int b, int g, uint32_t wg2_total) {
  const Shape& s = p.s;
  if (!wait_counter(sm, &p.st.sync->counter[B_DG], s.ns, p.st, 20) || !dx_late_ready(sm, p, wg2_total)) return;
  const int t0 = b * BM;
  gemm_group<0, 1, false, kBwdBoxRows>(
      sm, g, cdivb(s.H, BN), cdivb(s.E, BK),
      [&](int nt, Operand& A, Operand& B) {
        A = rows128(&p.k_dlog, t0, 0, s.T - t0);
        B = wide(&p.m_wr, nt * BN, 0);
      },
      [&](int nt, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
        store_tile<kStoreF32>(sm, acc, wg, w, l, t0, s.T, nt * BN, s.H, p.dx_router, s.H);
      });
  signal_counter(sm, &p.st.sync->counter[B_DXR]);
}

__device__ __forceinline__ void dxs_task(Smem& sm, const BwdParams& p, int mt, int g) {
  const Shape& s = p.s;
  if (!wait_counter(sm, &p.st.sync->counter[B_FIXED + s.max_mt + mt], dhs_groups(s), p.st, 20)) return;
  const int t0 = mt * BM;
  gemm_group<0, 1, false, kBwdBoxRows>(
      sm, g, cdivb(s.H, BN), 2 * s.Fs / BK,
      [&](int nt, Operand& A, Operand& B) {
        A = rows128(&p.k_das, t0, 0, s.T - t0);
        B = wide(&p.m_ws13, nt * BN, 0);
      },
      [&](int nt, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
        store_tile<kStoreF32>(sm, acc, wg, w, l, t0, s.T, nt * BN, s.H, p.dx_shared, s.H);
      });
  signal_counter(sm, &p.st.sync->counter[B_DXS]);
}

__device__ __forceinline__ void dx_task(Smem& sm, const BwdParams& p, int mt, int g, bool pairable,
                                        uint32_t wg2_total) {
  const Shape& s = p.s;
  const bool ok = (p.st.knobs & kKnobOnlyDx) ||
                  (wait_counter(sm, &p.st.sync->counter[B_FIXED + mt], dh_groups(s), p.st, 20) &&
                   dx_late_ready(sm, p, wg2_total));
  int e = -1, row0 = 0, row_end = 0;
  const bool valid = ok && expert_tile(p, mt, &e, &row0, &row_end);
  paired_task(sm, pairable, ok, valid, e, g, [&](auto P) {
    const Operand rows = expert_rows(sm, cta_slot(p.cta_maps), &p.k_da, p.d_a, 2 * s.F, row0, row_end);
    gemm_group<0, 1, decltype(P)::value, kBwdBoxRows>(
        sm, g, cdivb(s.H, BN), 2 * s.F / BK,
        [&](int nt, Operand& A, Operand& B) {
          A = rows;
          B = wide(&p.m_w13, nt * BN, e * 2 * s.F);
        },
        [&](int nt, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
          store_tile<kStoreBf16>(sm, acc, wg, w, l, row0, row_end, nt * BN, s.H, p.dx_rows, s.H, &p.st_dxrows, row0, spare);
        });
  });
  if (!ok) return;
  signal_counter_publish(sm, &p.st.sync->counter[B_DX], (uint32_t)(s.max_mt * groups(cdivb(s.H, BN), 2 * s.F / BK)), p.px,
                         s, kFlagDx, sm.peer_serial);
}

// Column tiles of a weight-gradient task: about 128 K blocks of work, from the mean rows
// an expert gets (T K / E), at most 32 tiles. Grouping only decides which CTA takes a
// tile, never its sum (one accumulator chain per tile), so it may depend on T.
// Why not all of a row tile's column tiles in one task: the row tile's A slice (128
// columns of dy_rows or d_a over the expert's rows) is read again for every column
// tile, and 132 CTAs each holding a different slice outgrow L2 when the rows are many
// (mixtral: 132 x 512 KB). In band order (kBand row tiles a column group) the CTAs
// running at once share fewer slices.
__device__ __forceinline__ int wgrad_group(const Shape& s) {
  return wgrad_group_of(max(1, cdivb(cdivb(s.T * s.K, s.E), BK)));  // (the mean K blocks a tile)
}

// Zeros into rows [r0, r0 + nr) x columns [c0, c0 + nc) of a bf16 matrix (ld columns a
// row; c0, nc and ld multiples of 64, so every row segment is whole 16-byte words): the
// weight gradient of an expert without rows. Plain 16-byte stores from every thread, no
// GEMM pipeline and no shared memory: such tasks are memory-bound (skewed routing
// leaves most experts empty: deepseek-v3's 248 of 256, 21.8 GB of zeros a step), and
// this way a CTA sends its share at the store path's rate, not at an epilogue's.
__device__ __forceinline__ void zero_block(bf16* out, int64_t ld, int r0, int nr, int c0, int nc) {
  const int words = nc / 8;  // 16-byte words a row
  for (int i = threadIdx.x; i < nr * words; i += kThreads)
    *reinterpret_cast<uint4*>(out + (r0 + i / words) * ld + c0 + 8 * (i % words)) = make_uint4(0u, 0u, 0u, 0u);
}

// The expert biases' gradients (cfg.use_expert_bias) of row tile mt of a weight gradient:
// d_b2[e] columns [mt*128, +128) summing dy_rows [.., H] (which 2), or d_b13[e] summing
// d_a [.., 2F] (13), over the expert's rows off .. off + n - 1 (global token order, as its
// weight gradient). The order, fixed by the rows alone (so the same bits at every W):
// kLanes row lanes, lane j summing rows j, j + kLanes, ... in increasing order from +0,
// then the lanes' sums j = 0, 1, .. in order from +0 (fp32 throughout). A thread holds 8
// columns (one 16-byte word) of one lane. Out: bf16 written, or fp32 added into.
// Called before the task's GEMM, so the task's signals (wgrad2_done: the readers of
// dy_rows before dx_late's dx_rows overwrite them) count these reads.
__device__ __noinline__ void bias_grad(Smem& sm, const BwdParams& p, int which, int e, int mt, int off, int n) {
  constexpr int kLanes = kThreads / 16, kUnroll = 4;
  const int cols = which == 2 ? p.s.H : 2 * p.s.F;  // (a multiple of 64: whole 8-column words)
  const bf16* src = which == 2 ? p.dy_rows : p.d_a;
  const int q = threadIdx.x % 16, j = threadIdx.x / 16, c = mt * BM + 8 * q;
  float sum[8];
#pragma unroll
  for (int k = 0; k < 8; k++) sum[k] = 0.f;
  auto add = [&](uint4 v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
      sum[2 * k] = __fadd_rn(sum[2 * k], bf16_lo(w[k]));
      sum[2 * k + 1] = __fadd_rn(sum[2 * k + 1], bf16_hi(w[k]));
    }
  };
  if (c < cols) {
    const bf16* col = src + (int64_t)off * cols + c;
    int r = j;
    for (; r + (kUnroll - 1) * kLanes < n; r += kUnroll * kLanes) {  // kUnroll rows in flight, added in order
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; u++) v[u] = *reinterpret_cast<const uint4*>(col + (int64_t)(r + u * kLanes) * cols);
#pragma unroll
      for (int u = 0; u < kUnroll; u++) add(v[u]);
    }
    for (; r < n; r += kLanes) add(*reinterpret_cast<const uint4*>(col + (int64_t)r * cols));
  }
  if (threadIdx.x == 0) release_stages_from_stores(sm);  // (the stages as scratch: [kLanes][128] floats)
  cta_sync();
  float* lanes = reinterpret_cast<float*>(sm.stage[0]);
  reinterpret_cast<float4*>(lanes + j * BM + 8 * q)[0] = make_float4(sum[0], sum[1], sum[2], sum[3]);
  reinterpret_cast<float4*>(lanes + j * BM + 8 * q)[1] = make_float4(sum[4], sum[5], sum[6], sum[7]);
  cta_sync();
  const int x = mt * BM + threadIdx.x;
  if (threadIdx.x < BM && x < cols) {
    float t = 0.f;
    for (int l = 0; l < kLanes; l++) t = __fadd_rn(t, lanes[l * BM + threadIdx.x]);
    void* out = which == 2 ? p.d_b2 : p.d_b13;
    const int64_t at = (int64_t)e * cols + x;
    if (p.wgrad_fp32) static_cast<float*>(out)[at] = __fadd_rn(static_cast<float*>(out)[at], t);
    else static_cast<bf16*>(out)[at] = to_bf(t);
  }
  cta_sync();  // (the scratch read before the stages are loaded again)
}

// h_late: WG2 of this rank's expert e reads the h rows that DH's epilogues of e's m-tiles
// wrote; each of those DH tasks also counts into e's counter (c_dh_expert), so one wait
// for ceil(counts[e] / BM) tiles times DH's tasks a tile covers them all.
// (noinline: the GEMM task around it keeps its registers)
__device__ __noinline__ bool expert_dh_done(Smem& sm, const BwdParams& p, int e) {
  const Shape& s = p.s;
  const uint32_t tiles = cdivb(p.sv.counts[s.rank * s.e_loc + e], BM);  // (DG checked counts)
  const uint32_t per_tile = dh_groups(s);
  return wait_counter(sm, &p.st.sync->counter[c_dh_expert(s, e)], tiles * per_tile, p.st, 20);
}

// dW[e] rows [mt*128, +128), column tiles [g * wgrad_group, +wgrad_group) in one
// pipeline; each tile sums over the expert's rows in order, 64 per K block. Its
// operands come through maps cut to the expert's rows (cut_maps): the last K block's
// rows past the expert arrive as zeros, and its k16 steps past them are skipped.
// Paired (pairable: next_task; pair_agree), the two CTAs take two row tiles of one
// expert and column group: the same B (the expert's rows) and K blocks.
__device__ __forceinline__ int tree_slices(int64_t len);  // (TREE's tasks at W = 1: WG13's tail waits for them)
__device__ __forceinline__ void wgrad_task(Smem& sm, const BwdParams& p, int which, int e, int mt, int g,
                                           bool pairable) {
  const Shape& s = p.s;
  const uint32_t* dep = which == 2 ? &p.st.sync->counter[B_DG] : &p.st.sync->counter[B_DH_ALL];
  const uint32_t target = which == 2 ? (uint32_t)s.ns : (uint32_t)(s.max_mt * dh_groups(s));
  const bool ok = (p.st.knobs & kKnobOnlyWgrad) ||
                  (wait_counter(sm, dep, target, p.st, 20, which == 2 ? kFlagDg : -1) &&  // (wgrad2: every rank's dy rows)
                   (which != 2 || !p.recompute ||  // (and h_rows)
                    wait_counter(sm, &p.st.sync->counter[B_RG_ALL], s.max_mt * rg_groups(s), p.st, 20)) &&
                   (which != 2 || !p.h_late || expert_dh_done(sm, p, e)) &&  // (h_rows from DH's epilogues)
                   (which == 2 || !p.x_late ||  // (and x_rows, back over the o rows)
                    wait_counter(sm, &p.st.sync->counter[B_DXSUM], s.ns, p.st, 20)) &&
                   (which == 2 || e < p.seg_e0 ||  // (WG13's tail: SEG's nodes in these rows, every TREE has read them)
                    wait_counter(sm, &p.st.sync->counter[B_TREE], (uint32_t)tree_slices(p.partial_len), p.st, 20)));
  const int rows = which == 2 ? s.H : 2 * s.F, cols = which == 2 ? s.F : s.H;
  const int eg = s.rank * s.e_loc + e;  // (e: this rank's expert, as the gradients are)
  const int off = p.sv.expert_off[eg], n = p.sv.counts[eg], nk = cdivb(n, BK);
  if (ok && g == 0 && (which == 2 ? p.d_b2 : p.d_b13)) bias_grad(sm, p, which, e, mt, off, n);  // (one task a row tile)
  // An expert of at most kArBlocks K blocks runs alone with its A resident (below): 32 KB
  // of B a K block, the L2 bytes a CTA of a pair (16 of A, 16 of B), without a pair's
  // lockstep. Larger ones pair. (pair_agree is still called, as both CTAs of a cluster
  // must; a key of -1 makes both run alone.)
  const bool paired = pair_agree(sm, pairable, ok, pair_key(nk > kArBlocks, e, g));
  if (!ok) return;
  const int valid_last = n - (nk - 1) * BK;  // rows of the last K block
  const size_t esize = p.wgrad_fp32 ? 4 : 2;
  const int size = wgrad_group(s), n0 = g * size;  // column tiles n0 + nt
  if (n == 0 && !p.wgrad_fp32) {  // (accumulating, the fp32 buffers get + 0 as on the CPU)
    bf16* out = which == 2 ? (bf16*)p.d_w2 + (int64_t)e * s.H * s.F : (bf16*)p.d_w13 + (int64_t)e * 2 * s.F * s.H;
    zero_block(out, cols, mt * BM, min(BM, rows - mt * BM), n0 * BN, min(size * BN, cols - n0 * BN));
    return;
  }
  CUtensorMap* maps = cta_slot(p.cta_maps);  // [0] A, [1] B
  if (which == 2) cut_maps(sm, maps, &p.m_dyrows, p.dy_rows, s.H, &p.m_hrows, p.sv.h_rows, s.F, off, n);
  else cut_maps(sm, maps, &p.m_da, p.d_a, 2 * s.F, &p.m_xrows, p.sv.x_rows, s.H, off, n);
  // dw2[e] [H, F] = dy_rows^T h_rows, or dw13[e] [2F, H] = d_a^T x_rows
  char* out = which == 2 ? (char*)p.d_w2 + (int64_t)e * s.H * s.F * esize
                         : (char*)p.d_w13 + (int64_t)e * 2 * s.F * s.H * esize;
  auto run = [&](auto P, auto R) {  // gemm_tiles' PAIRED and AR
    gemm_tiles<1, 1, decltype(P)::value, decltype(R)::value, 4, kBwdBoxRows>(
        sm, min(size, cdivb(cols, BN) - n0),
        [&](int t, Operand& A, Operand& B, int& num_kb, int& kv) {
          A = rows128(maps, mt * BM, 0);
          B = wide(maps + 1, (n0 + t) * BN, 0);
          num_kb = nk, kv = valid_last;
        },
        [&](int t, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
          store_wgrad(sm, p, acc, wg, w, l, mt * BM, rows, (n0 + t) * BN, cols, out,
                      which == 2 ? &p.st_dw2 : &p.st_dw13, e * rows + mt * BM, spare);
        });
  };
  // an expert of at most kArBlocks K blocks (deepseek-v3: 4 on average): every tile of
  // the task has the same A, kept resident while B streams (32 KB a block, not 48)
  // (MOK_BWD_PRODUCER: unclustered, and the producer loads no A-resident runs: plain runs only)
  if constexpr (kProducerTu) run(Flag<false>(), Flag<false>());
  else if (paired) run(Flag<true>(), Flag<false>());
  else if (nk > 0 && nk <= kArBlocks) run(Flag<false>(), Flag<true>());
  else run(Flag<false>(), Flag<false>());
}

// dx_late's DX and DXR write where WG2 reads (dy_rows, h_rows): a wgrad2 tile has read
// its dy_rows and h_rows (every K block's TMA load consumed), which is all they need: no
// wait for the tile's TMA stores (signal_counter's).
__device__ __noinline__ void wgrad2_done(Smem& sm, const BwdParams& p) {  // (noinline: no spill at the call)
  cta_sync();
  if (threadIdx.x == 0) red_release_add(&p.st.sync->counter[B_WG2_ALL], 1);
}
// Where d_w_sg's H columns start among the tree's columns (partial_len): after d_b_router's
// padded E.
__device__ __forceinline__ int64_t gate_grad_at(const Shape& s) {
  return (int64_t)s.E * s.H + 3LL * s.Fs * s.H + (s.use_router_bias ? (s.E + 3) / 4 * 4 : 0);
}
// d_w_sg's partial of the chunk from token k0 (cfg.use_shared_gate): dw[h] = sum over the
// chunk's tokens t in increasing order of dl_g[t] x[t, h], fp32 from +0; a thread two
// adjacent columns at a time. (noinline: RW's GEMM keeps its registers)
__device__ __noinline__ void gate_grad_partial(const BwdParams& p, float* dw, int k0) {
  const int H = p.s.H, t1 = min(p.s.T, k0 + MOK_REDUCE_CHUNK_TOKENS);
  for (int h = 2 * threadIdx.x; h < H; h += 2 * kThreads) {
    float a = 0.f, b = 0.f;
    for (int t = k0; t < t1; t++) {
      const float d = bf(__ldcg(p.dl_g + t));  // (DG's, another CTA's: from L2)
      const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(p.x + (int64_t)t * H + h);
      a = __fadd_rn(a, __fmul_rn(d, __low2float(x)));
      b = __fadd_rn(b, __fmul_rn(d, __high2float(x)));
    }
    dw[h] = a, dw[h + 1] = b;  // (signal_counter's cta_sync and fence publish them with the tiles)
  }
}
// RW[c]: chunk c's partials of the vectors (d_b_router, d_w_sg), each column's sum over
// the chunk's tokens in increasing order from +0.
__device__ __noinline__ void rw_task(Smem& sm, const BwdParams& p, int c) {
  const Shape& s = p.s;
  if (!wait_counter(sm, &p.st.sync->counter[B_DG], s.ns, p.st, 20)) return;  // (dlogits, dl_g)
  const int k0 = c * MOK_REDUCE_CHUNK_TOKENS;
  float* const part = p.partials + (int64_t)c * chunk_len(p);  // (column x at part[x - seg_end])
  if (s.use_router_bias) {  // d_b_router's: sum over the chunk's tokens of dlogits[t, e], t increasing
    float* const db = part;
    const int t1 = min(s.T, k0 + MOK_REDUCE_CHUNK_TOKENS);
    for (int e = threadIdx.x; e < (s.E + 3) / 4 * 4; e += kThreads) {  // (the padding: 0)
      float sum = 0.f;
      if (e < s.E)
        for (int t = k0; t < t1; t++) sum = __fadd_rn(sum, bf(__ldcg(p.dlogits + (int64_t)t * s.Ep + e)));
      db[e] = sum;  // (signal_counter's cta_sync and fence publish it with the tiles)
    }
  }
  if (s.shared_gate) gate_grad_partial(p, part + (gate_grad_at(s) - seg_end(s)), k0);
  signal_counter(sm, &p.st.sync->counter[B_RW]);  // (its cta_sync and fence publish the stores)
}

// SEG[seg, g]: the replicated weight gradients over segment seg of this rank's chunks
// (2^L <= 16 of them, seg_level), tiles [8g, 8g + 8) of 128 x 64 of the router's, or
// [8g', 8g' + 8) of the shared expert's (g' = g - router_groups; shared_tiles13 of
// d_ws13, then d_ws2). Writing every chunk's fp32 partial of all 3 Fs H columns and reading it
// back in TREE cost 12 Fs H bytes a chunk each way (45 GB a step on deepseek-v3 with
// Fs = 2048: docs/PERF.md, 2026-12-04), the router's 4 E H (256 MiB each way at
// qwen3-30b-a3b), so the tree's lowest levels are summed here: for each tile the
// segment's chunks in order, each chunk's partial one K block of 64 tokens from zero
// (m64n64k16: per element the k16 steps of a chunk partial in order), pushed
// into a binary counter of kSegLevels pending nodes (left node + right, __fadd_rn:
// tree_add's additions). The last chunk's carry is the segment's node, the tree's node
// over those leaves, stored to seg_partials[seg]; TREE pushes the nodes at their levels.
// The pending nodes are in shared memory, each thread its own elements (SegNodes): in
// registers beside the accumulators the backward spilled 1.4 KB a thread.
static_assert(kSegLevels == 4 && kStages == 4 && kEpiBytes >= 32 * kThreads * 4, "SegNodes' layout");
// This thread's pending nodes, 32 elements a level, a row of kThreads floats each: levels
// 0-2 in the stages' B boxes 1-3 (24 rows a stage; the narrow tiles load box 0 alone),
// element q of level lv at stage q / 8, row 3 (q % 8) + lv, so that for a q known at
// compile time an element is one add from its level's row (low + lv kThreads); level 3
// in sm.epi, row q. (Rows found by (32 lv + q) / 24 cost SEG's epilogue two thirds of
// thread 0's cycles: docs/PERF.md, 2026-12-05 fifth session.)
struct SegNodes {
  float *low, *top;
  __device__ __forceinline__ explicit SegNodes(Smem& sm)
      : low(reinterpret_cast<float*>(sm.stage[0] + 3 * kBoxBytes) + tid_here()),
        top(reinterpret_cast<float*>(sm.epi) + tid_here()) {}
  __device__ __forceinline__ float* at(int lv, int q) const {  // (lv < 3)
    return low + (q / 8) * (kStageBytes / 4) + (3 * (q % 8) + lv) * kThreads;
  }
  __device__ __forceinline__ float* at3(int q) const { return top + q * kThreads; }
};
__device__ __forceinline__ void seg_task(Smem& sm, const BwdParams& p, int seg, int g) {
  const Shape& s = p.s;
  const bool router = g < router_groups(s);
  // DG's dlogits (the router's tiles), dy_s (the shared gate's); with the nodes in d_w13's
  // tail (seg_e0 < e_loc) every task, so that a saved buffer DG rejects leaves d_w13 as it was
  if ((router || s.shared_gate || p.seg_e0 < s.e_loc) && !wait_counter(sm, &p.st.sync->counter[B_DG], s.ns, p.st, 20))
    return;
  if (!router) {
    if (!wait_counter(sm, &p.st.sync->counter[B_DHS_ALL], (uint32_t)(s.smt * dhs_groups(s)), p.st, 20)) return;  // (d_a_s)
    if (p.recompute && !wait_counter(sm, &p.st.sync->counter[B_RGS_ALL], s.smt * rgs_groups(s), p.st, 20)) return;  // (sh)
  }
  const int chunk0 = first_chunk(p), end = chunk0 + s.chunks;
  int a = chunk0;
  for (int i = 0; i < seg; i++) a += 1 << seg_level(a, end);
  const int L = seg_level(a, end), n = 1 << L, k0 = (a - chunk0) * MOK_REDUCE_CHUNK_TOKENS;
  const int nH = cdivb(s.H, 64), nFs = cdivb(s.Fs, 64), n13 = shared_tiles13(s);
  // t: the tile's index among the router's (router) or the shared expert's (shared_tiles)
  const int t0 = (router ? g : g - router_groups(s)) * kSegTileGroup;
  const int nt = min(kSegTileGroup, (router ? router_tiles(s) : shared_tiles(s)) - t0);
  float* const out = p.seg_partials + (int64_t)seg * seg_len(s);  // (column x at out[x - seg_skip])
  if (threadIdx.x == 0) release_stages_from_stores(sm);  // (earlier epilogues' stores read the nodes' places)
  cta_sync();
  gemm_tiles<1, 1, false, false, 1>(
      sm, nt * n,
      [&](int i, Operand& A, Operand& B, int& num_kb, int& kv) {  // (tile, chunk), the chunk fastest
        const int t = t0 + i / n, k = k0 + i % n * BK;
        num_kb = 1, kv = BK;  // tokens past T are out of bounds: zeros
        if (router) {
          A = rows128(&p.m_dlog, t / nH * BM, k);  // (rows past E: TMA's zeros)
          B = Operand{&p.m_x, {t % nH * 64, 0, 0, 0}, k};
        } else if (t < n13) {
          const int m0 = t / nH * BM;
          A = rows128(&p.m_das, m0, k);  // (both boxes: rows past 2 Fs, H are TMA's zeros)
          B = Operand{&p.m_x, {t % nH * 64, 0, 0, 0}, k};
        } else {
          const int m0 = (t - n13) / nFs * BM;
          A = rows128(&p.m_dys, m0, k);
          B = Operand{&p.m_sh, {(t - n13) % nFs * 64, 0, 0, 0}, k};
        }
      },
      [&](int i, float(&acc)[32], int wg, int w, int l, uint8_t*) {
        const int c = i % n;
        int z = 0;  // chunk c's partial climbs the levels where c's bits are 1, to level z
        while (z < L && ((c >> z) & 1)) z++;
        // each element in place, acc = node + acc level by level (tree_add's order: the
        // left node first), every element of a level at once
        const SegNodes nodes(sm);
        for (int lv = 0; lv < min(z, 3); lv++)
#pragma unroll
          for (int q = 0; q < 32; q++) acc[q] = __fadd_rn(*nodes.at(lv, q), acc[q]);
        if (z > 3)
#pragma unroll
          for (int q = 0; q < 32; q++) acc[q] = __fadd_rn(*nodes.at3(q), acc[q]);
        if (z < L) {  // the node waits at level z for its right sibling
          if (z < 3)
#pragma unroll
            for (int q = 0; q < 32; q++) *nodes.at(z, q) = acc[q];
          else
#pragma unroll
            for (int q = 0; q < 32; q++) *nodes.at3(q) = acc[q];
          return;
        }
        const int t = t0 + i / n;  // z = L (c = n - 1): the segment's node goes out
        const bool wide = router || t < n13;  // ([rows, H]: d_w_router, d_ws13)
        const int m0 = wide ? t / nH * BM : (t - n13) / nFs * BM, n0 = wide ? t % nH * 64 : (t - n13) % nFs * 64;
        const int rows = router ? s.E : wide ? 2 * s.Fs : s.H, cols = wide ? s.H : s.Fs;  // (cols even: H, Fs % 64 == 0)
        const int64_t e1 = (int64_t)s.E * s.H;
        // (the router's columns start at 0 and are there only when seg_skip is 0)
        float* const o = router ? out : wide ? out + (e1 - seg_skip(s)) : out + (e1 - seg_skip(s) + 2LL * s.Fs * s.H);
#pragma unroll
        for (int q = 0; q < 32; q += 2) {  // acc[4i + 2h + x]: row 8h + lane/4, column 8i + 2(lane%4) + x
          const int r = m0 + wg * 64 + w * 16 + l / 4 + 8 * (q / 2 % 2), col = n0 + 8 * (q / 4) + 2 * (l % 4);
          if (r < rows && col < cols) *reinterpret_cast<float2*>(o + (int64_t)r * cols + col) = make_float2(acc[q], acc[q + 1]);
        }
      });
  fence_proxy_async_smem();  // (the nodes' generic writes before a next task's TMA loads there)
  signal_counter(sm, &p.st.sync->counter[B_RW]);  // (its cta_sync and fence publish the stores)
}

// The fixed tree over four adjacent columns' n chunk partials (col[c * stride], c < n,
// 16-byte aligned) through TreeCounter (sm90_tree.cuh), each column's own additions.
// Whole aligned runs of 8 leaves go in as their complete level-3 subtree (the next run's
// 8 float4 loads in flight meanwhile), the rest one by one; the pending nodes in the
// caller's shared memory (nodes). Each partial read once.
// Eight adjacent whole subtrees of one level, pairwise: their parent three levels up.
__device__ __forceinline__ float4 tree_of_8(float4 (&v)[8]) {
#pragma unroll
  for (int lv = 0; lv < 3; lv++)  // levels 1..3: 4, 2, 1 nodes
#pragma unroll
    for (int k = 0; k < (4 >> lv); k++) v[k] = tree_add(v[2 * k], v[2 * k + 1]);
  return v[0];
}
__device__ __forceinline__ float4 tree_column4(const float* col, int64_t stride, int n, SmemNodes4 nodes) {
  TreeCounter<SmemNodes4, float4> tc{nodes};
  const auto leaf = [&](int c) { return *reinterpret_cast<const float4*>(col + (int64_t)c * stride); };
  int c = 0;
  float4 next[8];  // the next run's leaves, loaded while this run is added up
  if (n >= 8)
#pragma unroll
    for (int k = 0; k < 8; k++) next[k] = leaf(k);
  for (; c + 8 <= n; c += 8) {
    float4 v[8];
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = next[k];
    if (c + 16 <= n)
#pragma unroll
      for (int k = 0; k < 8; k++) next[k] = leaf(c + 8 + k);
    tc.push(tree_of_8(v), 3);
  }
  for (; c < n; c++) tc.push(leaf(c), 0);
  return tc.fold();
}

// The same over the segments' nodes of chunks [a, b) (col[j * stride]: segment j's, j from
// the first in [a, b)), each pushed at its level: the tree over the chunks' leaves.
// Eight whole segments on a 128-chunk boundary are a level-7 subtree: their loads go out
// together and are added pairwise here (one at a time, each load waited behind the last
// push's shared-memory stores: TREE took 3.6 ms of deepseek-v3's step with Fs = 2048).
__device__ __forceinline__ float4 tree_segments4(const float* col, int64_t stride, int a, int b, SmemNodes4 nodes) {
  TreeCounter<SmemNodes4, float4> tc{nodes};
  const auto leaf = [&](int j) { return *reinterpret_cast<const float4*>(col + (int64_t)j * stride); };
  constexpr int kRun = 8 << kSegLevels;  // chunks
  for (int j = 0; a < b;) {
    if (a % kRun == 0 && a + kRun <= b) {
      float4 v[8];
#pragma unroll
      for (int k = 0; k < 8; k++) v[k] = leaf(j + k);
      tc.push(tree_of_8(v), kSegLevels + 3);
      j += 8, a += kRun;
    } else {
      const int L = seg_level(a, b);
      tc.push(leaf(j++), L);
      a += 1 << L;
    }
  }
  return tc.fold();
}

// TREE's slice of columns: a float4 of adjacent columns a thread, 1 to 8 of them, about
// 1024 slices when the gradients are small, so that the tree fills the machine
// (qwen3-30b-a3b's router, 262144 columns: 256 slices; at 8192 columns a slice its 32
// tasks held 32 CTAs through the backward's last 0.6 ms). The same on every rank.
__device__ __forceinline__ int64_t tree_slice(int64_t len) {
  constexpr int64_t unit = 4 * kThreads;
  return unit * min((int64_t)8, max((int64_t)1, (len + unit * 1024 - 1) / (unit * 1024)));
}
__device__ __forceinline__ int tree_slices(int64_t len) { return (int)((len + tree_slice(len) - 1) / tree_slice(len)); }

// The columns of the replicated gradients' partials that go out (the router's only when
// fused, each only when its output was asked for): the output and the index in it.
__device__ __forceinline__ void* tree_out(const BwdParams& p, int64_t x, int64_t* k) {
  const Shape& s = p.s;
  const int64_t er = s.fused ? (int64_t)s.E * s.H : 0, e1 = (int64_t)s.E * s.H, e2 = e1 + 2LL * s.Fs * s.H;
  const int64_t e3 = e2 + (int64_t)s.H * s.Fs, e4 = gate_grad_at(s);
  if (x >= e4) {  // d_w_sg's (use_shared_gate)
    *k = x - e4;
    return p.d_w_sg;
  }
  if (x >= e3) {  // d_b_router's (use_router_bias)
    *k = x - e3;
    return p.d_b_router;
  }
  if (x < e1 && x >= er) return nullptr;
  *k = x < e1 ? x : x < e2 ? x - e1 : x - e2;
  return x < e1 ? p.d_w_router : x < e2 ? p.d_ws13 : p.d_ws2;
}
__device__ __forceinline__ void tree_store(const BwdParams& p, void* out, int64_t k, float v) {
  if (p.wgrad_fp32) reinterpret_cast<float*>(out)[k] = __fadd_rn(reinterpret_cast<float*>(out)[k], v);
  else reinterpret_cast<bf16*>(out)[k] = to_bf(v);
}
__device__ __forceinline__ void tree_store4(const BwdParams& p, void* out, int64_t k, float4 v) {
  if (out == p.d_b_router) {  // fp32 whatever cfg.wgrad (written, or added into); E of the padded columns
    float* const o = reinterpret_cast<float*>(out);
    const float w[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4 && k + i < p.s.E; i++) o[k + i] = p.wgrad_fp32 ? __fadd_rn(o[k + i], w[i]) : w[i];
    return;
  }
  tree_store(p, out, k, v.x), tree_store(p, out, k + 1, v.y), tree_store(p, out, k + 2, v.z), tree_store(p, out, k + 3, v.w);
}

// Replicated gradients, slice of tree_slice(len) columns: each column's tree over the
// chunks, a thread's four adjacent columns at a time.
// W > 1: the phase has two rounds of the slices. In the first each rank sums its
// partials over the aligned subtrees of the global chunk tree that lie inside its
// chunks (subtree_level), into its own tree window; the task that completes the round
// publishes TREE. In the second, after every rank's TREE, every rank pushes all ranks'
// subtrees in chunk order through tree_column4's binary counter: the same nodes and
// additions as W = 1, so the same bits on every rank and for every W.
__device__ __noinline__ void tree_task(Smem& sm, const BwdParams& p, int task, uint32_t rw_total, int slices) {
  const Shape& s = p.s;
  const bool combine = s.W > 1 && task >= slices;  // (W > 1: the second round)
  const int slice = combine ? task - slices : task;
  if (!(combine ? wait_counter(sm, &p.st.sync->counter[B_TREE], (uint32_t)slices, p.st, 20, kFlagTree)
                : wait_counter(sm, &p.st.sync->counter[B_RW], rw_total, p.st, 20, kFlagBackward)))
    return;
  const int64_t len = p.partial_len, width = tree_slice(len), clen = chunk_len(p), sl = seg_len(s);
  const int chunk0 = first_chunk(p);
  // a thread's kTreeLevels pending float4 nodes strided by kThreads, in the pipeline
  // stages (106 KB; no GEMM here; the last epilogue's stores have read them)
  if (threadIdx.x == 0) release_stages_from_stores(sm);
  cta_sync();
  const SmemNodes4 nodes4{reinterpret_cast<float4*>(sm.stage[0]) + threadIdx.x};
  for (int64_t x = slice * width + 4 * threadIdx.x; x < min(len, (slice + 1) * width); x += 4 * kThreads) {
    int64_t k;
    void* out = tree_out(p, x, &k);  // (the pieces' bounds are multiples of 4: H % 64 == 0, d_b_router's padded)
    if (!out) continue;
    if (!combine) {  // W = 1: the whole tree; W > 1: subtree j of this rank's chunks, into its window
      const bool by_seg = x < seg_end(s);  // (SEG's columns; the vectors' come a chunk at a time)
      for (int a = chunk0, j = 0, sj = 0, end = chunk0 + s.chunks; a < end; j++) {
        const int n = s.W == 1 ? s.chunks : 1 << subtree_level(a, end);
        // (segment sj starts at a; a subtree of more than 16 chunks is 16-chunk segments)
        const float4 v = by_seg ? tree_segments4(p.seg_partials + sj * sl + (x - seg_skip(s)), sl, a, a + n, nodes4)
                                : tree_column4(p.partials + (a - chunk0) * clen + (x - seg_end(s)), clen, n, nodes4);
        sj += n >> kSegLevels ? n >> kSegLevels : 1;
        if (s.W == 1) tree_store4(p, out, k, v);
        else if (j < p.px.tree_nodes) *reinterpret_cast<float4*>(p.px.tree[s.rank] + j * len + x) = v;
        else raise_error(p.st, MOK_STATUS_INTERNAL_ERROR);  // (the window holds every split of <= T tokens)
        a += n;
      }
    } else {  // every rank's subtrees, ranks in chunk order, through the binary counter
      TreeCounter<SmemNodes4, float4> tc{nodes4};
      for (int r = 0, c0 = 0; r < s.W; r++) {
        const int n = rank_chunks(p, r);
        for (int a = c0, j = 0; a < c0 + n; j++) {  // (L2: the nodes are peers' writes)
          const int level = subtree_level(a, c0 + n);
          tc.push(__ldcg(reinterpret_cast<const float4*>(p.px.tree[r] + j * len + x)), level);
          a += 1 << level;
        }
        c0 += n;
      }
      tree_store4(p, out, k, tc.fold());
    }
  }
  if (s.W > 1 && !combine) {
    __threadfence_system();
    signal_counter_publish(sm, &p.st.sync->counter[B_TREE], (uint32_t)slices, p.px, s, kFlagTree, sm.peer_serial);
  }
  if (s.W == 1 && p.seg_e0 < s.e_loc) signal_counter(sm, &p.st.sync->counter[B_TREE]);  // (WG13's tail waits for every TREE)
  fence_proxy_async_smem();  // (the stages' generic writes before a next GEMM task's TMA loads)
  cta_sync();
}

__device__ __noinline__ void dxsum_task(Smem& sm, const BwdParams& p, int sb) {
  const Shape& s = p.s;
  const int nH = cdivb(s.H, BN);
  if (!wait_counter(sm, &p.st.sync->counter[B_DX], (uint32_t)(s.max_mt * groups(nH, 2 * s.F / BK)), p.st, 20, kFlagDx))
    return;  // (every owner's dx rows)
  if (s.fused && !wait_counter(sm, &p.st.sync->counter[B_DXR], (uint32_t)(s.nb * groups(nH, cdivb(s.E, BK))), p.st, 20))
    return;
  if (s.Fs && !wait_counter(sm, &p.st.sync->counter[B_DXS], (uint32_t)(s.smt * groups(nH, 2 * s.Fs / BK)), p.st, 20))
    return;
  const int t0 = sb * kSubTokens, t1 = min(s.T, t0 + kSubTokens), H = s.H;
  if (!s.fused)  // replay: d_topk_weight = d_g, written here (after every DG) rather than by DG, so
                 // that a DG task that rejects saved leaves every output as it was
    for (int i = t0 * s.K + threadIdx.x; i < t1 * s.K; i += kThreads) p.d_topk_weight[i] = p.dg[i];
  if (threadIdx.x == 0) release_stages_from_stores(sm);  // (sum_slot_rows' chunks go there)
  cta_sync();
  for (int t = t0 + threadIdx.x / 32; t < t1; t += kThreads / 32) {
    const float dl = s.shared_gate ? bf(__ldcg(p.dl_g + t)) : 0.f;  // (DG's, another CTA's: from L2)
    sum_slot_rows<false>(  // dx = sum_j dx_j, slots in order, then + router path, + shared path, + gate path
        sm, p.peer_dx_rows, p.sv, s, t, nullptr,
        [&](int v, uint32_t x) {  // (fp32: two chunks each)
          const int64_t at = (int64_t)t * H + v * 8;
          if (s.fused) cp_async_16(x, p.dx_router + at), cp_async_16(x + 512, p.dx_router + at + 4);
          if (s.Fs) cp_async_16(x + 1024, p.dx_shared + at), cp_async_16(x + 1536, p.dx_shared + at + 4);
        },
        [&](int v, float(&acc)[8], uint32_t x) {
          float r[8], sh[8];
          if (s.fused) ld_shared_f32x4(x, r), ld_shared_f32x4(x + 512, r + 4);
          if (s.Fs) ld_shared_f32x4(x + 1024, sh), ld_shared_f32x4(x + 1536, sh + 4);
          uint4 wr = {0u, 0u, 0u, 0u};
          if (s.shared_gate) wr = __ldg(reinterpret_cast<const uint4*>(p.w_sg) + v);
          const bf16* wsg = reinterpret_cast<const bf16*>(&wr);
#pragma unroll
          for (int k = 0; k < 8; k++) {  // then router, then shared, then the gate's dl_g w_sg
            if (s.fused) acc[k] = __fadd_rn(acc[k], r[k]);
            if (s.Fs) acc[k] = __fadd_rn(acc[k], sh[k]);
            if (s.shared_gate) acc[k] = __fadd_rn(acc[k], __fmul_rn(dl, bf(wsg[k])));
          }
          store_bf16x8(p.dx + (int64_t)t * H + v * 8, acc);
        });
  }
  if (p.x_late) {  // each token's x row back to its K slot rows, whose dx rows are read (WG13's x_rows)
    cta_sync();  // (every warp's copies of the rows have landed: cp_async_wait_all)
    int* const sh_pos = scatter_positions(sm);
    for (int i = threadIdx.x; i < (t1 - t0) * s.K; i += kThreads) sh_pos[i] = p.sv.pos[t0 * s.K + i];
    cta_sync();
    if (threadIdx.x == 0) {
      fence_proxy_async();  // (the generic reads of the rows before the bulk copies write them)
      scatter_token_rows(sm, p.x, t0, t1, H, s.K, p.sv.x_rows);
    }
  }
  fence_proxy_async_smem();  // (the stages' generic writes before a next GEMM task's TMA loads)
  signal_counter(sm, &p.st.sync->counter[B_DXSUM]);  // (x_late: its x rows have landed)
}

// The MOK_KNOBS bit that runs phase k alone (0: none does).
__device__ __forceinline__ uint32_t only_knob(int k) {
  return k == 6 || k == 7 || k == 13 ? kKnobOnlyWgrad : k == 5 ? kKnobOnlyDx : k == 0 ? kKnobOnlyDg : k == 2 ? kKnobOnlyDh : 0u;
}

// The phases whose GEMM tasks two CTAs of a cluster may run as a pair: dh, dx, wgrad2,
// wgrad13 (and its tail).
__device__ __forceinline__ bool paired_phase(int k) { return k == 2 || k == 5 || k == 6 || k == 7 || k == 13; }

// Phases (k): 0 dg, 1 dhs, 2 dh, 3 dxr, 4 dxs, 5 dx, 6 wgrad2, 7 wgrad13, 8 rw, 9 tree,
// 10 dxsum, 11 rg, 12 rgs, 13 wgrad13's tail (profile kinds 8 + k, 21 and 22 for rg and
// rgs, wgrad13's 15 for its tail). Ticket order: dg, rg, rgs, dhs, dh, dxr, dxs, dx,
// wgrad2, dxsum, rw, wgrad13, tree, wgrad13's tail; with dx_late (BwdParams) wgrad2 right
// after dh, before dxr, dxs and dx. rg and rgs come right after dg: dg is memory-bound and
// short, and at W > 1 the peers' dh waits for this rank's dg. The memory-bound dxsum and
// rw go between the weight gradients, whose GEMMs hide them, each after what it waits for
// has long finished (dxsum: every dx; rw: dg, and dhs for the shared expert's segments);
// only tree (every rw) is left after the last GEMM, and wgrad13's tail: the experts
// [seg_e0, e_loc) whose d_w13 rows hold SEG's nodes until every TREE has read them (W = 1:
// seg_in_dw13 in cuda_backend.cu; none elsewhere). The i-th phase in ticket order, and
// phase k's place.
constexpr int kBwdPhases = 14;
// (nibble i: the phase at place i, and the inverse; an array indexed at run time would
// live in local memory)
constexpr uint64_t kBwdOrder = 0xd978a654321cb0ull, kBwdOrderLate = 0xd978a543621cb0ull;
constexpr uint64_t kBwdPlace = 0xd219cab8765430ull, kBwdPlaceLate = 0xd219cab5876430ull;
__host__ __device__ constexpr int bwd_order(int i, bool late) {
  return (int)((late ? kBwdOrderLate : kBwdOrder) >> (4 * i) & 15);
}
__host__ __device__ constexpr int bwd_place(int k, bool late) {
  return (int)((late ? kBwdPlaceLate : kBwdPlace) >> (4 * k) & 15);
}
constexpr bool bwd_place_inverts_order() {
  for (int late = 0; late < 2; late++)
    for (int i = 0; i < kBwdPhases; i++)
      if (bwd_place(bwd_order(i, late), late) != i) return false;
  return true;
}
static_assert(bwd_place_inverts_order(), "bwd_place is bwd_order's inverse");

// The kernel's body; kClamped: the routed experts' clamped SwiGLU (cfg.activation) in
// the recompute's and dh's epilogues, a kernel of its own as the forward's.
template <bool kClamped>
__device__ __forceinline__ void backward_kernel(const BwdParams& p) {
  Smem& sm = kernel_smem(p.st.knobs);
  if (!producer_split(sm)) return;  // (a producer's kernel: its warpgroup 2 leaves)
  const Shape& s = p.s;
  set_peers(sm, p.px, s, p.st);
  if (threadIdx.x == 0 && !saved_header_ok(p)) raise_error(p.st, MOK_STATUS_INVALID_SAVED);  // (before any task)
  // The phases in ticket order: tasks in each and, for 2-D phases, the tasks per row
  // (GEMM tasks: a row tile and a group of its column tiles). Kept in shared memory so
  // that the dispatch loop holds few registers across the task calls.
  // With pairs the paired phases (dh, dx, wgrad2, wgrad13) start at an even ticket (one
  // skipped before), so that a cluster's two tickets are two row tiles of one column
  // group (expert_segments: even bands from even tiles; kBand is even, and an odd number
  // of weight-gradient row tiles makes that band's last pair straddle two groups): a
  // pair when both are the same expert's (pair_agree; walk_tiles puts two odd experts
  // side by side, their meeting tiles unpaired).
  __shared__ int phase_start[kBwdPhases], phase_end[kBwdPhases], phase_cols[kBwdPhases], wgrad_mt[2];  // (by place)
  __shared__ int phase_kind[kBwdPhases];  // (by place: bwd_order's)
  if (threadIdx.x == 0) {
    wgrad_mt[0] = cdivb(s.H, BM);  // dw2's row tiles
    wgrad_mt[1] = cdivb(2 * s.F, BM);
    const int nH = cdivb(s.H, BN), wg_size = wgrad_group(s);
    int segs = 0;  // the segments of this rank's chunks (seg_level), when SEG has tiles
    for (int a = first_chunk(p), end = a + s.chunks; seg_groups(s) && a < end; segs++) a += 1 << seg_level(a, end);
    const int rw = rw_chunk_tasks(s) + segs * seg_groups(s);
    // a phase's tasks: rows x column groups (phase_cols, at least 1 for the dispatch)
    // (TREE whenever there are replicated gradients, even on a rank without tokens: at
    // W > 1 every rank's round-one signal is waited for)
    const int slices = s.fused || s.Fs ? tree_slices(p.partial_len) : 0;
    const int rows[kBwdPhases] = {s.ns, s.Fs ? s.smt : 0, s.max_mt, s.fused ? s.nb : 0, s.Fs ? s.smt : 0, s.max_mt,
                                  s.e_loc, p.seg_e0, rw, s.W > 1 ? 2 * slices : slices, s.ns,
                                  p.recompute ? s.max_mt : 0, p.recompute && s.Fs ? s.smt : 0, s.e_loc - p.seg_e0};
    const int cols[kBwdPhases] = {1, dhs_groups(s), dh_groups(s),
                                  groups(nH, cdivb(s.E, BK)), groups(nH, 2 * s.Fs / BK), groups(nH, 2 * s.F / BK),
                                  wgrad_mt[0] * cdivb(cdivb(s.F, BN), wg_size), wgrad_mt[1] * cdivb(nH, wg_size), 1, 1, 1,
                                  (int)rg_groups(s), (int)rgs_groups(s), wgrad_mt[1] * cdivb(nH, wg_size)};
    int t = 0;
#pragma unroll
    for (int i = 0; i < kBwdPhases; i++) {  // (unrolled: rows and cols stay in registers)
      // (either order's kind a constant: an index chosen at run time would put rows and
      // cols in local memory)
      const int k0 = bwd_order(i, false), k1 = bwd_order(i, true), k = p.dx_late ? k1 : k0;
      const int n = p.dx_late ? rows[k1] * cols[k1] : rows[k0] * cols[k0];
      const int c = p.dx_late ? cols[k1] : cols[k0];
      t = pad_even(t, s.pairs && paired_phase(k));
      phase_start[i] = t, phase_end[i] = t += n, phase_cols[i] = c > 0 ? c : 1, phase_kind[i] = k;
    }
  }
  cta_sync();
  const int num_tasks = phase_end[kBwdPhases - 1];
  auto phase_size = [&](int place) { return (uint32_t)(phase_end[place] - phase_start[place]); };
  auto wg2_total = [&] { return phase_size(bwd_place(6, p.dx_late)); };  // (read where used: no register held)
  int task;
  while (next_task(sm, p.st, num_tasks, &task)) {
    if (task >= num_tasks) continue;  // a cluster's second ticket past the last task
    const int i = ticket_phase(phase_start, phase_end, kBwdPhases, task);
    if (i < 0) continue;
    const int k = phase_kind[i];
    profile_start(sm, p.st);
    const int local = task - phase_start[i];
    int row = local / phase_cols[i], col = local % phase_cols[i];
    const bool pairable = paired_phase(k) && partner_in_phase(sm, phase_start, phase_end, kBwdPhases, task, i);
    // MOK_KNOBS 64 / 128 / 256 / 512: only the weight-gradient / dx / DG / dh tasks run
    // (without waiting for their inputs), so that ncu sees that phase alone
    const uint32_t only = p.st.knobs & (kKnobOnlyWgrad | kKnobOnlyDx | kKnobOnlyDg | kKnobOnlyDh);
    if (only && !(only & only_knob(k))) continue;
    switch (k) {
      case 0: dg_task(sm, p, local); break;
      case 1: dhs_task(sm, p, row, col); break;
      case 2:
        expert_band_order(p.sv.tile_band, local, s.max_mt, phase_cols[i], &row, &col);
        dh_task<kClamped>(sm, p, row, col, pairable);
        break;
      case 3: dxr_task(sm, p, row, col, wg2_total()); break;
      case 4: dxs_task(sm, p, row, col); break;
      case 5:
        expert_band_order(p.sv.tile_band, local, s.max_mt, phase_cols[i], &row, &col);
        dx_task(sm, p, row, col, pairable, wg2_total());
        break;
      case 6:
      case 7:
      case 13: {  // row = expert (the tail's from seg_e0); col: its (row tile, column group) in band order
        const int e = k == 13 ? p.seg_e0 + row : row, nmt = wgrad_mt[k == 6 ? 0 : 1];
        band_order(col, nmt, phase_cols[i] / nmt, &row, &col);
        wgrad_task(sm, p, k == 6 ? 2 : 13, e, row, col, pairable);
        if (k == 6) wgrad2_done(sm, p);
        break;
      }
      case 8:
        if (local < rw_chunk_tasks(s)) rw_task(sm, p, local);
        else seg_task(sm, p, (local - rw_chunk_tasks(s)) / seg_groups(s), (local - rw_chunk_tasks(s)) % seg_groups(s));
        break;
      case 9: {
        const uint32_t rw_total = phase_size(bwd_place(8, p.dx_late));
        const int slices = (phase_end[i] - phase_start[i]) / (s.W > 1 ? 2 : 1);  // (W > 1: two rounds)
        tree_task(sm, p, local, rw_total, slices);
        break;
      }
      case 11: rg_task<kClamped>(sm, p, row, col); break;
      case 12: rgs_task(sm, p, row, col); break;
      default: dxsum_task(sm, p, local); break;
    }
    profile_task(sm, p.st, k == 13 ? 15 : k < 11 ? 8 + k : 10 + k);
  }
  producer_stop(sm);
  finish_step(sm, p.st, p.reuse ? &p.sv.header[0] : nullptr);
}

__global__ void MOK_KERNEL_BOUNDS sm90_moe_backward_kernel(const __grid_constant__ BwdParams p) {
  backward_kernel<false>(p);
}
__global__ void MOK_KERNEL_BOUNDS sm90_moe_backward_clamped_kernel(const __grid_constant__ BwdParams p) {
  backward_kernel<true>(p);
}

}  // namespace mok
