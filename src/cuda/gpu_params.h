// gpu_params.h — what the CUDA host code passes to the megakernels: the step's sync
// words, views of the saved buffer and workspace, and each kernel's parameters (tensor
// maps by value, as __grid_constant__). Shapes in the brief's letters; R = rows of this
// rank's experts (T*K with W = 1). Host and device C++ only.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include <algorithm>

#include "mok.h"

namespace mok {

typedef __nv_bfloat16 bf16;

constexpr int kSubTokens = 32;  // tokens per DISPATCH, COMBINE, DG and DXSUM task
// The router's and the shared expert's weight gradients (backward's SEG tasks): the
// chunk tree's lowest kSegLevels levels summed in shared memory, a segment of up to 2^kSegLevels chunks (1024
// tokens) and kSegTileGroup 128 x 64 tiles a task (8 x 16 K blocks); a rank's chunks
// [a, a + n) split into at most n / 16 + 2 kSegLevels segments (kSegLevels pieces on
// either side of the whole ones), the nodes' rows in the workspace (seg_cap). At W = 1
// the chunks start at 0 and n of them split into n / 16 whole segments and one for each
// 1 bit of n % 16: seg_cap is the most over the n <= chunks a call may bring (deepseek-v3
// at 8192 tokens: 11 nodes of 3 Fs H fp32, 176 MB each, where the bound gave 16).
constexpr int kSegLevels = 4, kSegTileGroup = 8;
inline int64_t seg_cap(int64_t chunks, int W) {
  if (W > 1) return (chunks >> kSegLevels) + 2 * kSegLevels;
  int64_t most = 0;
  for (int64_t n = chunks; n >= 1 && n > chunks - (1 << kSegLevels); n--)  // (the most is among the last 16)
    most = std::max(most, (n >> kSegLevels) + __builtin_popcountll(n & ((1 << kSegLevels) - 1)));
  return most;
}
// Those tasks walk rows of H bf16 a warp at a time, lane chunks v = lane + 32 u of 16
// bytes. With one CTA of 8 warps an SM, a lane must have several chunks in flight to
// cover the memory latency (~128 B a lane): every load of a step is issued before any
// of its data is used, and the sums keep their order (chunks in increasing v, slots in
// increasing j).
constexpr uint64_t MOK_SAVED_MAGIC_GPU = 0x6d6f6b2d67707573ull;  // header[0] of a saved buffer
constexpr uint64_t MOK_SAVED_USED_GPU = 0x6d6f6b2d67757364ull;   // and once a MOK_SAVED_REUSE backward ran

// Sync words of a step, zeroed by the last CTA of every launch (finish_step, sm90_schedule.cuh).
struct GpuSync {
  uint32_t ticket;      // next task
  uint32_t exit_count;  // CTAs done
  uint32_t error;       // first mok_status_t raised in the step
  uint32_t launches;    // launches ended (either kernel): W > 1, the flags' step serial is this
                        // + 1, the same on every rank (the same calls in the same order), and
                        // read on the device, so a step replayed from a CUDA graph gets a new one
  uint32_t counter[1];  // the step's dependency counters follow (num_counters)
};

struct GpuStep {
  GpuSync* sync;
  uint32_t* status;      // first error of the launches since mok_context_sync last read it
  uint32_t num_counters;
  uint64_t timeout_ns;
  unsigned long long* prof;  // MOK_PROFILE=1: [kProfSlots][2] ns and count per task kind, or null
  struct TraceRecord* trace; // MOK_TRACE=file: one record per task, or null
  uint32_t* trace_len;       // records written (may pass trace_cap: the rest are dropped)
  uint32_t trace_cap;
  uint32_t knobs;            // MOK_KNOBS, a measurement aid that breaks the results: bit 1 =
                             // plain epilogues skip their global stores, 2 = no epilogues,
                             // 8 = bf16 tiles leave through the plain path, not TMA stores,
                             // 16 = GEMM loads skip the B operand (its L2 traffic and energy),
                             // 32 = every K block of B is the tile's first (same bytes moved,
                             // repeated data), 64 / 128 / 256 / 512 = the backward runs only
                             // its weight-gradient / dx / DG / dh tasks, which do not wait
                             // for their inputs
};
constexpr uint32_t kKnobOnlyWgrad = 64, kKnobOnlyDx = 128, kKnobOnlyDg = 256, kKnobOnlyDh = 512;

// MOK_TRACE: a task's wall-clock span (%globaltimer, ns) on one CTA, and the part of it
// spent waiting for dependencies; kind is the profile slot.
// MOK_STALL_PROFILE builds only (zero otherwise): thread 0's cycles in a task, by kind.
// In GEMM tasks, waiting:
// - for a stage's data (full barrier: load latency or bandwidth);
// - for a stage to empty before refilling it (the other warpgroup behind);
// - for the epilogue's stores to read the spare stage before refilling it;
// - for the last wgmmas of a tile (drain).
// Then the epilogue, whole (thread 0's view), and three parts of it: waiting for
// earlier TMA stores to read sm.epi, the epilogues' CTA barriers, issuing the TMA
// stores. Last, at any task's end: waiting for its TMA stores to land, plus the fence
// before its counter's release (signal_counter). And, in the SwiGLU backward epilogue,
// waiting for its TMA loads of gate and up. Besides the waits, a span of the mainloop:
// each block's wgmma_wait<1> (the tensor core running the previous block's wgmmas).
// ROUTE's parts after its GEMM (thread 0's warp and expert): scores and top-K, the
// per-expert counts and ranks, the loss statistics. PREFIX's (one task): the counts and
// block offsets; thread 0's walks and the tile table. DG's: the slot rows (dots and
// dy_j), the router backward.
enum {
  kStallFull,
  kStallEmpty,
  kStallSpare,
  kStallDrain,
  kStallEpilogue,
  kStallEpiStores,
  kStallEpiBarrier,
  kStallEpiIssue,
  kStallSignal,
  kStallEpiLoads,
  kStallMma,
  kStallRouteTopK,
  kStallRouteCounts,
  kStallRouteStats,
  kStallPrefixSums,
  kStallPrefixWalk,
  kStallDgRows,
  kStallDgRouter,
  kStallKinds
};
struct TraceRecord {
  uint64_t start, end;
  uint32_t wait_ns;
  uint32_t cycles;  // SM cycles over the task (clock64): with end - start, its mean SM clock
  uint16_t cta;
  uint16_t kind;
  uint32_t stall[kStallKinds];
};

// Profile slots: forward task kinds 0..7, backward 8..18, waits 19 (forward) and 20,
// then the backward's gate|up recompute 21 (routed) and 22 (shared), the forward's
// RETURN 23.
// Times are %globaltimer ns (wall clock), not SM cycles: the clock drops under load.
constexpr int kProfSlots = 24;

// The saved buffer (forward -> backward), device pointers.
struct SavedView {
  uint64_t* header;   // [kHeaderWords]: magic, context serial, T, forward serial, the tokens
                      // of every rank together, each rank's T (the backward's chunk ranges:
                      // kMaxPeers words, W written), then the context's shape
                      // (kSavedShapeWords: saved_shape_word)
  int32_t* idx;       // [T, K]
  float* g;           // [T, K] final weights
  int32_t* pos;       // [T, K] row of slot (t, j) in the expert rows
  float* logits;      // [T, Ep]
  int32_t* counts;    // [E] rows per expert
  int32_t* expert_off;// [E + 1] first row of each expert
  int32_t* tile_band; // [max_mt] the band of each expert m-tile (expert_band_order)
  // W > 1: this rank's slots in the order the stream dispatch sends them (by expert,
  // then owner position): sorted[j] = slot i; the rows of expert e are j in
  // [loc_off[e], loc_off[e + 1]), going to owner row j - loc_shift[e]
  int32_t* sorted;    // [T, K]
  int32_t* loc_off;   // [E + 1]
  int32_t* loc_shift; // [E]
  bf16* x_rows;       // [R, H] dispatched rows
  bf16* a_rows;       // [R, 2F] gate | up
  bf16* h_rows;       // [R, F]
  bf16* o_rows;       // [R, H] expert outputs (x_over_o: where x_rows are)
  bf16* sa;           // [T, 2Fs] shared gate | up
  bf16* sh;           // [T, Fs]
  // cfg.use_shared_gate: the gate s_g (COMBINE's) and the shared expert's output o_s,
  // which the backward's d s_g = dy . o_s reads
  float* sg;          // [T]
  bf16* shared_o;     // [T, H]
};

// Row buffers of every rank, indexed by the rank that owns an expert (e / e_loc):
// dispatch and combine go through this table, so expert parallelism changes who owns a
// buffer, not the kernels' structure. With W = 1 only entry 0 (this rank) is used.
constexpr int kMaxPeers = 8;
struct PeerRows {
  bf16* rows[kMaxPeers];
};

// W > 1: expert outputs go back to their tokens' ranks while GEMM2 runs (the forward's
// RETURN stream tasks). In rank r's rows window: o_kept[r] [T K, H], the o rows of r's
// slots that other ranks' experts computed, at the slot (t K + j), which r's COMBINE and
// backward DG read locally; row_src[r] [capacity] int64, for each of r's expert rows the
// source rank (high 32 bits) and its slot there, written by the source's DISPATCH.
struct PeerReturn {
  bf16* o_kept[kMaxPeers];
  int64_t* row_src[kMaxPeers];
};
constexpr int kMaxReturnStreams = 64;

// W > 1: the forward's DISPATCH runs as Shape::nd stream tasks (at most kMaxStreams,
// at most the grid), each sending its share of every expert's rows, expert groups in
// order (kArriveGroups groups of each rank's experts, each published when sent), so
// that GEMM1 starts on the first groups while later ones are still on the way.
constexpr int kMaxStreams = 64;
constexpr int kArriveGroups = 16;

// W > 1 (docs/DISTRIBUTED.md): every rank's exchange window, reached through NCCL's
// peer pointers. In rank r's copy, row q is written by rank q:
//   counts[r]  [W][E + 1] int32: rank q's per-expert counts of its tokens, then its T;
//   flags[r]   [W][kFlagKinds] step serials, each released (system scope) after the
//              data it publishes; a wait is "until flag >= serial": flags only grow,
//              so nothing is reset between steps;
//   stats[r]   [global chunks][E + 1] fp32: the router-loss statistics of every rank's
//              64-token chunks, at their global chunk index (rank q's from
//              chunk0(q) = sum of ceil(T / 64) over the ranks before it).
//   tree[r]    [tree_nodes][partial_len] fp32, written by rank r alone: the sums of its
//              replicated-gradient partials over the aligned subtrees of the chunk
//              tree that lie inside its chunks (tree_nodes), read by every rank.
// (kFlagBye: written by the host at destroy, which waits for every rank's before it
// frees the windows that peers may still read; kFlagBackward: a rank's backward launch
// has begun (its first DG task publishes it), so its previous launch, which may have read dy_rows and the tree window,
// has ended: the backward's DG and TREE wait for every rank's before writing into
// peers. A forward needs no such flag: its writes into peers follow every rank's
// counts of the same step)
enum : int { kFlagCounts, kFlagBackward, kFlagExperts, kFlagStats, kFlagDg, kFlagDx, kFlagTree, kFlagBye, kFlagKinds };
struct PeerExchange {
  int32_t* counts[kMaxPeers];
  uint64_t* flags[kMaxPeers];
  float* stats[kMaxPeers];
  float* tree[kMaxPeers];
  // arrive[r] [W][kMaxStreams][kArriveGroups] step serials in rank r's copy: stream
  // task d of rank q has written all of q's rows of r's expert group g (forward's
  // DISPATCH; GEMM1 of a tile of group g waits for every q and d)
  uint64_t* arrive[kMaxPeers];
  int tree_nodes;  // subtrees a rank can publish (the windows' size)
};
// The saved header's words after the kMaxPeers T words: the writing context's cfg T, H, F,
// E, K, Fs, W and rank (saved_shape_word), which the backward compares with its own.
constexpr int kSavedShapeWords = 8;
constexpr int kHeaderShape = 5 + kMaxPeers;  // the first of them
constexpr int kHeaderWords = kHeaderShape + kSavedShapeWords;

struct Shape {
  int T, H, F, E, K, Fs;
  int W, rank;  // expert-parallel ranks and this one (experts rank*e_loc .. + e_loc)
  int e_loc;    // experts per rank (E / W)
  int Ep;       // the row stride of logits and dlogits: E rounded up to 8 (16-byte rows for
                // the fp32 stores and the bf16 TMA maps; the columns past E are zero)
  int fused, score, normalize, use_bias;
  int use_router_bias;      // the logits' bias b_router (mok.h cfg.use_router_bias)
  int shared_gate;          // the shared expert's per-token sigmoid gate (cfg.use_shared_gate)
  float swiglu_alpha, swiglu_limit;  // the clamped SwiGLU's (cfg.activation: the *_clamped_kernel launches)
  float route_scale, aux_coef, z_coef;
  int n_group, topk_group;  // group-limited routing (mok.h cfg.n_group) when n_group > 1
  int group_top2;           // a group's score: its two largest selection keys (1) or the largest
  int nb;       // token blocks of 128 (routing, shared-expert m-tiles)
  int ns;       // token blocks of kSubTokens (memory-bound token tasks: more of them)
  int nd;       // the forward's DISPATCH tasks: W = 1 ns, W > 1 the stream tasks (kMaxStreams)
  int nd_slots; // W > 1: the arrive table's stream slots that every rank fills and GEMM1
                // polls, the same on every rank (the stream tasks asked for): a rank whose
                // grid runs fewer tasks (nd < nd_slots) has task d fill d, d + nd, ...
  int nr;       // the forward's RETURN tasks: W = 1 none, W > 1 the return streams
  int max_mt;   // expert m-tiles at most: ceil(T*K / 128) + E (pairs: rounded up to even)
  int smt;      // shared-expert m-tiles: nb
  int chunks;   // replicated-sum chunks of MOK_REDUCE_CHUNK_TOKENS tokens
  int pairs;    // 1: launched in clusters of 2 (paired GEMM tasks share B): the tile table
                // holds each expert's even run of m-tiles (walk_tiles) and the paired GEMM
                // phases start at even tickets, so that a cluster's two tickets are two
                // m-tiles of one expert with the same column group, or two experts' last
                // tiles, which run unpaired
  int cfg_T;    // the context's cfg.T (T is this call's num_tokens): the saved header's shape
};

// Word k < kSavedShapeWords of the saved header's shape (header[kHeaderShape + k]): cfg T,
// H, F, E, K, Fs, W, rank. k a constant where it is called (unrolled loops).
__host__ __device__ inline uint64_t saved_shape_word(const Shape& s, int k) {
  return (uint64_t)(k == 0 ? s.cfg_T : k == 1 ? s.H : k == 2 ? s.F : k == 3 ? s.E : k == 4 ? s.K : k == 5 ? s.Fs
                                     : k == 6 ? s.W : s.rank);
}

// The step's dependency counters (GpuSync::counter): the forward's kFwdFixedCounters
// (its C_* enum) then one an expert m-tile and one a shared-expert m-tile; the
// backward's kBwdFixedCounters (B_*) then four: dh and rg an m-tile, dhs and rgs a
// shared m-tile, and one an expert of this rank (DH's tasks of it: h_late). The kernels
// assert their enums against these; the context allocates the larger count.
constexpr int kFwdFixedCounters = 6, kBwdFixedCounters = 12;
__host__ __device__ inline uint32_t fwd_num_counters(const Shape& s) {
  return (uint32_t)(kFwdFixedCounters + s.max_mt + s.smt);
}
__host__ __device__ inline uint32_t bwd_num_counters(const Shape& s) {
  return (uint32_t)(kBwdFixedCounters + 2 * (s.max_mt + s.smt) + s.e_loc);
}

// The TMA store maps of an output: 128-row boxes for whole tiles, kStoreRows-row boxes
// for tiles cut short by the end of an expert's rows (sm90_epilogues.cuh), and `pair`, the
// output seen as [cols / 64][rows][64] with 2 x 128 x 64 boxes: two adjacent 64-column
// boxes of a whole tile in one store (has_pair: cols % 64 == 0 and the map encoded).
struct StoreMap {
  CUtensorMap full, part, pair;
  int has_pair;
};

// The most CTAs a launch has (cfg.num_ctas or the SM count): sizes per-CTA scratch.
constexpr int kMaxCtas = 256;

// The rows of a box in the forward's operand maps (m_x .. m_sh): every forward GEMM
// operand is K-major, so each box is 64 k x 128 rows (gemm_tiles' kBoxRows).
constexpr int kFwdBoxRows = 128;
// The same for the backward's tall maps (BwdParams' k_* and mn maps).
constexpr int kBwdBoxRows = 128;

struct FwdParams {
  CUtensorMap m_x;      // x [T, H]
  CUtensorMap m_wr;     // w_router [E, H]
  CUtensorMap m_w13;    // w13 [E*2F, H]
  CUtensorMap m_w2;     // w2 [E*H, F]
  CUtensorMap m_xrows;  // x_rows [R, H]
  CUtensorMap m_hrows;  // h_rows [R, F]
  CUtensorMap m_ws13;   // ws13 [2Fs, H]
  CUtensorMap m_ws2;    // ws2 [H, Fs]
  CUtensorMap m_sh;     // sh [T, Fs]
  StoreMap st_orows;    // store maps: o_rows [R, H]
  StoreMap st_shared_o; // shared_o [T, H]
  StoreMap st_arows;    // a_rows as [R][2][F] (gate, up)
  StoreMap st_hrows;    // h_rows [R, F]
  StoreMap st_sa;       // sa as [T][2][Fs]
  StoreMap st_sh;       // sh [T, Fs]
  GpuStep st;
  Shape s;
  uint64_t context_id, serial;
  PeerRows peer_x_rows;       // dispatch target: [R, H] rows of each rank's experts
  PeerRows peer_o_rows;       // combine source: [R, H] expert outputs of each rank
  PeerReturn ret;             // W > 1: o rows back to their tokens' ranks (RETURN), read by COMBINE
  PeerExchange px;            // W > 1: counts and flags
  int capacity;               // rows this rank's buffers hold (R)
  const bf16* x;
  const float* bias;          // [E] or null
  const float* b_router;      // [E] fp32, added to the logits (use_router_bias), or null
  const bf16* b13;            // [E/W, 2F] this rank's experts' gate|up biases (use_expert_bias), or null
  const bf16* b2;             // [E/W, H] their output biases (use_expert_bias), or null
  const bf16* w_sg;           // [H] the shared expert's gate (use_shared_gate), or null
  const int32_t* in_idx;      // replay [T, K]
  const float* in_w;          // replay [T, K]
  bf16* y;
  int32_t* tokens_per_expert; // [E] or null
  float* aux_loss;            // or null
  float* z_loss;              // or null
  int32_t* out_idx;           // fused, or null
  float* out_w;               // fused, or null
  SavedView sv;
  // workspace
  float* logits;        // [T, Ep]
  float* scores;        // [T, E]
  float* lse;           // [T]
  int32_t* rank;        // [T, K] slot's rank among its block's rows of that expert
  int32_t* block_counts;// [nb, E]
  int32_t* block_off;   // [nb, E]
  int32_t* tile_expert; // [max_mt]
  int32_t* tile_row0;   // [max_mt]
  int32_t* tile_row_end;// [max_mt]
  int32_t* num_tiles;   // [1]
  float* chunk_stats;   // [chunks, E + 1]
  bf16* shared_o;       // [T, H] (with use_shared_gate saved's, sv.shared_o)
  CUtensorMap* cta_maps;  // [kMaxCtas][2]: each CTA's cut map of an expert's last m-tile (expert_rows)
};

struct BwdParams {
  // Operand maps. The GEMMs of 128 x 256 tiles read tall maps (kBwdBoxRows, gemm_tiles'
  // kBoxRows): K-major ones (k_*) of 64 x 128 boxes; MN-major ones (marked mn) 3-D,
  // [cols / 64][rows][64] with 64 x 64 x 2 boxes. The rest (SEG's 64-column tiles) 2-D
  // maps of 64 x 64 boxes.
  CUtensorMap m_dys;    // the shared expert's dy [T, H]: dy, or dy_s with use_shared_gate (SEG)
  CUtensorMap m_x;      // x [T, H] (SEG)
  CUtensorMap m_wr;     // w_router [E, H], mn (DXR)
  CUtensorMap m_w13;    // w13 [E*2F, H], mn (DX)
  CUtensorMap m_w2;     // w2 [E*H, F], mn (DH)
  CUtensorMap m_dyrows; // dy_rows [R, H], mn (WGRAD2's A, cut)
  CUtensorMap m_xrows;  // x_rows [R, H], mn (WGRAD13's B, cut)
  CUtensorMap m_hrows;  // h_rows [R, F], mn (WGRAD2's B, cut)
  CUtensorMap m_da;     // d_a [R, 2F], mn (WGRAD13's A, cut)
  CUtensorMap m_dlog;   // dlogits [T, E], rows Ep apart (SEG)
  CUtensorMap m_ws13;   // ws13 [2Fs, H], mn (DXS)
  CUtensorMap m_ws2;    // ws2 [H, Fs], mn (DHS)
  CUtensorMap m_sh;     // sh [T, Fs] (SEG)
  CUtensorMap m_das;    // d_a_s [T, 2Fs] (SEG)
  CUtensorMap k_dys, k_dyrows, k_dlog, k_das, k_da;  // the A of DHS, DH, DXR, DXS, DX
  CUtensorMap k_xrows, k_w13, k_x, k_ws13;           // RG's A and B, RGS's A and B
  CUtensorMap m_arows_gu;  // a_rows as [R][2][F], 128-row boxes (swiglu_bwd_store's loads)
  CUtensorMap m_sa_gu;     // sa as [T][2][Fs], likewise
  StoreMap st_da;       // d_a as [R][2][F]
  StoreMap st_das;      // d_a_s as [T][2][Fs]
  StoreMap st_dxrows;  // store maps: dx_rows [R, H]
  StoreMap st_dw13;    // d_w13 [E*2F, H] (bf16 gradients only)
  StoreMap st_dw2;     // d_w2 [E*H, F] (bf16 gradients only)
  // cfg.gate_up = MOK_GATE_UP_RECOMPUTE: the recompute's stores (sv's a_rows, h_rows, sa,
  // sh then point into this call's workspace)
  StoreMap st_arows;    // a_rows as [R][2][F]
  StoreMap st_hrows;    // h_rows [R, F]
  StoreMap st_sa;       // sa as [T][2][Fs]
  StoreMap st_sh;       // sh [T, Fs]
  GpuStep st;
  Shape s;
  uint64_t context_id;
  uint64_t forward_serial;  // the context's forwards so far: a saved header's serial is in [1, it]
  int capacity;         // rows this rank's expert-row buffers hold (R): saved's positions are below it
  int wgrad_fp32;       // add into fp32 buffers instead of writing bf16
  int recompute;        // gate|up: computed again here (the RG and RGS tasks), not kept
  int reuse;            // cfg.saved_use = MOK_SAVED_REUSE: the last CTA marks saved used up
  int dx_late;          // and at W = 1: dx_rows where dy_rows are (over saved's o rows), so
                        // WG2 comes before DX (bwd_order), DX after every WG2; DXR after
                        // every WG2 too (dx_router where h_rows are, when it fits)
  int x_late;           // and with gate|up kept: the forward wrote the o rows over the x
                        // rows (x_over_o), so DXSUM writes each token's x row back to its
                        // slot rows once it has read their dx rows, and WG13 waits for
                        // every DXSUM
  int h_late;           // and x_late with bf16 weight gradients: saved holds no h (h_in_dw13);
                        // DH's epilogue writes h_rows (sv.h_rows: the front of d_w13, which
                        // WG13 writes only after every DXSUM) and WG2 of an expert waits
                        // for DH of its m-tiles (one counter an expert)
  PeerRows peer_o_rows;   // [R, H] expert outputs of each rank (forward's)
  const bf16* o_kept;     // W > 1: [T K, H], other ranks' o rows of this rank's slots (the forward's RETURN)
  PeerRows peer_dy_rows;  // dispatch target of dy_j
  PeerRows peer_dx_rows;  // combine source of dx_j
  PeerExchange px;        // W > 1: flags and the replicated sums' subtrees
  const bf16* dy;
  const float* d_aux;   // or null (1)
  const float* d_z;     // or null (1)
  SavedView sv;
  bf16* dx;
  float* d_topk_weight; // replay
  void* d_w_router;     // [E, H]
  float* d_b_router;    // [E] fp32 whatever cfg.wgrad (use_router_bias), or null
  void* d_w13;          // [E, 2F, H]
  void* d_w2;           // [E, H, F]
  const bf16* b13;      // [E/W, 2F] the gate|up biases for the recompute (use_expert_bias), or null
  void* d_b13;          // [E/W, 2F] like d_w13 (use_expert_bias), or null
  void* d_b2;           // [E/W, H] like d_w2 (use_expert_bias), or null
  void* d_ws13;         // [2Fs, H]
  void* d_ws2;          // [H, Fs]
  const bf16* x;        // [T, H] (use_shared_gate: d_w_sg's partials; x_late: DXSUM's rows), or null
  const bf16* w_sg;     // [H] (use_shared_gate: DXSUM's dl_g w_sg), or null
  void* d_w_sg;         // [H] like d_ws2 (use_shared_gate), or null
  // workspace
  float* dg;            // [T, K]
  bf16* dy_rows;        // [R, H]
  bf16* d_a;            // [R, 2F]
  bf16* dx_rows;        // [R, H]
  bf16* dlogits;        // [T, Ep]
  bf16* d_a_s;          // [T, 2Fs]
  float* dx_router;     // [T, H]
  float* dx_shared;     // [T, H]
  bf16* dy_s;           // [T, H] use_shared_gate: bf16(s_g dy), DG's, the shared expert's dy
  bf16* dl_g;           // [T] use_shared_gate: the gate logit's gradient, DG's
  float* partials;      // [chunks, partial_len - E H - 3 Fs H]: a chunk's, the vectors' (RW)
  float* seg_partials;  // [seg_cap(chunks), (fused ? E H : 0) + 3 Fs H]: the router's and the
                        // shared expert's weight gradients, a node a segment (SEG)
  int64_t partial_len;  // the tree's columns: E*H + 3*Fs*H, then with use_router_bias d_b_router's E
                        // rounded up to 4, then with use_shared_gate d_w_sg's H
  CUtensorMap* cta_maps;  // [kMaxCtas][2]: each CTA's maps of its weight-gradient task's expert, or of an
                          // expert's last m-tile (expert_rows)
  int seg_e0;  // the first of this rank's experts whose d_w13 rows hold seg_partials (its
               // tail, seg_in_dw13: WG13 of e >= seg_e0 comes after TREE and waits for every
               // TREE); e_loc when the nodes are in the workspace
};

}  // namespace mok
