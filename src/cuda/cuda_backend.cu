// cuda_backend.cu — host side of the Hopper backend: the context's device state, the
// byte plans of the saved buffer and the workspace, tensor maps, and the launches of
// the two megakernels (one launch per forward, one per backward; no other kernel, no
// copy, no host synchronisation inside a step, so a step can be captured in a graph).
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <pthread.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>

#include "cuda_backend.h"
#include "gpu_params.h"
#ifdef MOK_HAVE_NCCL
#include "comm/nccl_comm.h"
#endif

namespace mok {
__global__ void sm90_moe_forward_kernel(const __grid_constant__ FwdParams p);
__global__ void sm90_moe_backward_kernel(const __grid_constant__ BwdParams p);
// the same with the routed experts' clamped SwiGLU (cfg.activation = MOK_ACTIVATION_SWIGLU_CLAMPED)
__global__ void sm90_moe_forward_clamped_kernel(const __grid_constant__ FwdParams p);
__global__ void sm90_moe_backward_clamped_kernel(const __grid_constant__ BwdParams p);
}  // namespace mok
#include "sm90_epilogues.cuh"  // (the kernels' constants: tiles, Smem, kStoreRows, pad_even)

using namespace mok;

constexpr uint32_t kTraceCap = 1u << 20;  // MOK_TRACE: task records kept per sync

struct GpuContext {
  int device;
  int num_sms;
  GpuSync* sync;          // device: ticket, exit count, error, counters
  uint32_t* status;       // device: status of the last launch
  uint32_t sync_words;    // counters available
  cudaStream_t last_stream;
  unsigned long long* prof;  // MOK_PROFILE=1 or MOK_TRACE: per task kind ns and counts (gpu_params.h)
  TraceRecord* trace;        // MOK_TRACE=file: per task records, appended to the file at each sync
  char trace_path[512];      // MOK_TRACE's file; with W > 1 file.rank<r> (every rank appends its own)
  uint32_t* trace_len;
  int syncs;
  PFN_cuTensorMapEncodeTiled_v12000 encode;
  int grid;       // persistent CTAs a launch: cfg.num_ctas, or one per SM (maybe fewer: clusters)
  bool clusters;  // launched in clusters of 2 (paired GEMM tasks sharing B through TMA multicast)
  // W > 1 (docs/DISTRIBUTED.md): the NCCL communicator, and three symmetric windows:
  // the rows ([capacity, H] x_rows, o_rows, dy_rows, dx_rows), the exchange (counts,
  // flags, loss statistics, arrive table: PeerExchange) and the replicated sums'
  // subtrees, with every rank's copy as this GPU's kernels reach it
  void* comm;
  void *rows_local, *rows_win, *xchg_local, *xchg_win, *tree_local, *tree_win;
  PeerRows peer_x_rows, peer_o_rows, peer_dy_rows, peer_dx_rows;
  PeerReturn ret;  // every rank's o_kept ([cfg.T K, H]) and row_src ([capacity]), in the rows window
  PeerExchange px;
  bool loopback;             // W ranks of this process on this one GPU (mok_comm_loopback_id)
  bool broken;               // a step timed out waiting for a peer: no more steps, destroy aborts
};
static_assert(kMaxPeers == MOK_CUDA_MAX_RANKS, "kMaxPeers");

#define CUDA_TRY(ctx, call)                                                                   \
  do {                                                                                        \
    cudaError_t err_ = (call);                                                                \
    if (err_ != cudaSuccess)                                                                  \
      return MOK_ERR(ctx, MOK_STATUS_CUDA_ERROR, "%s failed: %s", #call, cudaGetErrorString(err_)); \
  } while (0)

static GpuContext* gpu(const mok_context_t* ctx) { return static_cast<GpuContext*>(ctx->gpu); }

// The context's device made current on the calling thread for one call into the
// backend, and the caller's device restored after it, as a framework's device guard
// does. A call may come from a thread whose current device is another GPU, or from one
// with no CUDA context current at all: PyTorch's autograd thread for device 0 skips
// cudaSetDevice (0 is already "current"), and the driver's cuTensorMapEncodeTiled then
// fails there with CUDA_ERROR_INVALID_CONTEXT (201). cudaSetDevice makes the device's
// primary context current even when the device number does not change.
class DeviceScope {
 public:
  explicit DeviceScope(int device) : device_(device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = device;
    error_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (prev_ != device_) cudaSetDevice(prev_);
  }
  cudaError_t error() const { return error_; }

 private:
  int device_, prev_;
  cudaError_t error_;
};
#define DEVICE_SCOPE(ctx)                        \
  DeviceScope device_scope_(gpu(ctx)->device); \
  CUDA_TRY(ctx, device_scope_.error())

static int cdiv(int64_t a, int64_t b) { return (int)((a + b - 1) / b); }

// A non-blocking stream of the current device that the library's own host-side work
// (zeroing new device state) runs on, one per device for the process, never destroyed.
// Not the legacy default stream: that one waits for every blocking stream's work, so
// with W ranks on one GPU a rank's create would wait for a peer's kernel that waits for
// this rank; and work there is not ordered before a launch on a non-blocking stream.
static cudaError_t side_stream(cudaStream_t* out) {
  static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  static cudaStream_t streams[64];
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  if (device < 0 || device >= 64) return cudaErrorInvalidDevice;
  pthread_mutex_lock(&mu);
  if (!streams[device]) e = cudaStreamCreateWithFlags(&streams[device], cudaStreamNonBlocking);
  *out = streams[device];
  pthread_mutex_unlock(&mu);
  return e;
}

extern "C" int mok_cuda_zero_now(void* p, size_t bytes) {
  cudaStream_t s = nullptr;
  cudaError_t e = side_stream(&s);
  if (e == cudaSuccess) e = cudaMemsetAsync(p, 0, bytes, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  return e;
}
// A copy between host and device memory (or device and device) on the side stream,
// done when it returns.
static cudaError_t copy_now(void* dst, const void* src, size_t bytes) {
  cudaStream_t s = nullptr;
  cudaError_t e = side_stream(&s);
  if (e == cudaSuccess) e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  return e;
}

// pairs: a launch in clusters of 2, whose paired phases want max_mt even (band_order's
// bands then pair whole); the byte plans take that bound either way.
// The expert rows this rank's buffers hold: its own tokens' T K with W = 1, else the
// capacity (rows from every rank).
static int64_t recv_rows(const mok_config_t& c, int64_t T) { return c.W == 1 ? T * c.K : c.capacity; }

// logits' and dlogits' row stride (Shape::Ep): E rounded up to 8.
static int64_t router_stride(const mok_config_t& c) { return (c.E + 7) / 8 * 8; }
// The layer's two kernels: the plain SwiGLU's, or the clamped one's (cfg.activation).
static void (*forward_kernel(const mok_config_t& c))(FwdParams) {
  return c.activation == MOK_ACTIVATION_SWIGLU_CLAMPED ? sm90_moe_forward_clamped_kernel : sm90_moe_forward_kernel;
}
static void (*backward_kernel(const mok_config_t& c))(BwdParams) {
  return c.activation == MOK_ACTIVATION_SWIGLU_CLAMPED ? sm90_moe_backward_clamped_kernel : sm90_moe_backward_kernel;
}
// The replicated gradients, the vector the tree sums: [d_w_router E H | d_ws13 2 Fs H |
// d_ws2 H Fs | d_b_router E, rounded up to 4 (the tree's float4 columns; use_router_bias)
// | d_w_sg H (use_shared_gate)]. The weight gradients' columns (the router's when fused,
// the shared expert's 3 Fs H) come a segment of chunks at a time (seg_partials), the
// vectors' a chunk at a time (partials).
static int64_t partial_len(const mok_config_t& c) {
  return c.E * c.H + 3 * c.Fs * c.H + (c.use_router_bias ? (c.E + 3) / 4 * 4 : 0) + (c.use_shared_gate ? c.H : 0);
}

static Shape make_shape(const mok_config_t& c, int64_t T, bool pairs) {
  Shape s{};
  s.T = (int)T, s.H = (int)c.H, s.F = (int)c.F, s.E = (int)c.E, s.K = (int)c.K, s.Fs = (int)c.Fs;
  s.W = c.W, s.rank = c.rank;
  s.e_loc = (int)(c.E / c.W);
  s.fused = c.routing == MOK_ROUTING_FUSED;
  s.score = c.score;
  s.normalize = c.normalize != 0;
  s.use_bias = c.use_bias_select != 0;
  s.use_router_bias = c.use_router_bias != 0;
  s.shared_gate = c.use_shared_gate != 0;
  s.swiglu_alpha = c.swiglu_alpha, s.swiglu_limit = c.swiglu_limit;
  s.Ep = (int)router_stride(c);
  s.n_group = c.n_group, s.topk_group = c.topk_group;
  s.group_top2 = c.group_score == MOK_GROUP_SCORE_TOP2;
  s.route_scale = c.route_scale, s.aux_coef = c.aux_loss_coef, s.z_coef = c.z_loss_coef;
  s.nb = cdiv(T, 128);
  s.ns = std::max(cdiv(T, kSubTokens), c.W > 1 ? 1 : 0);  // (W > 1: one DISPATCH and DG task publishes even at T = 0)
  s.max_mt = pad_even(cdiv(recv_rows(c, T), BM) + (int)c.E, pairs);
  s.pairs = pairs;
  s.smt = s.nb;
  s.chunks = cdiv(T, MOK_REDUCE_CHUNK_TOKENS);
  s.cfg_T = (int)c.T;
  return s;
}

// The forward's DISPATCH stream tasks asked for at W > 1 (Shape::nd_slots, alike on
// every rank); MOK_DISPATCH_STREAMS (a measurement knob) sets how many.
static int dispatch_slots() {
  const char* v = getenv("MOK_DISPATCH_STREAMS");
  const int n = v ? atoi(v) : 32;  // (qwen3-30b-a3b and deepseek-v3 at W = 2: 16 slower than 32)
  return std::max(1, std::min(n, kMaxStreams));
}
// The forward's DISPATCH tasks (Shape::nd). W = 1: one per token block. W > 1: the
// stream tasks, which meet at a barrier, so all run at once: at most the grid, which
// may differ between ranks (cfg.num_ctas; D2).
static int dispatch_tasks(const Shape& s, const mok_config_t& c, int grid) {
  if (c.W == 1) return s.ns;
  return std::min(dispatch_slots(), grid);
}

// The forward's RETURN tasks at W > 1: they poll GEMM2's tiles while the rest of the
// grid runs them, so a quarter of the grid at most; MOK_RETURN_STREAMS (a measurement
// knob) sets how many. With clusters an even number, from an even ticket: a cluster
// fetches its two tickets together, so a return task beside another phase's task would
// hold its partner at the next fetch for all of GEMM2.
static int return_tasks(const mok_config_t& c, int grid, bool clusters) {
  if (c.W == 1) return 0;
  const char* v = getenv("MOK_RETURN_STREAMS");
  return pad_even(std::max(1, std::min(std::min(v ? atoi(v) : 16, kMaxReturnStreams), grid / 4)), clusters);
}

// ---- byte plans (every piece 256-byte aligned); for the context's max T ----
static int64_t up256(int64_t bytes) { return (bytes + 255) / 256 * 256; }
struct Plan {
  size_t at = 0;
  size_t take(size_t bytes) {
    size_t here = at;
    at += up256((int64_t)bytes);
    return here;
  }
};

// The default layout (MOK_SAVED_REUSE, gate|up kept, W = 1): saved holds the o rows
// where the x rows were, 2H bytes a routed row less (qwen3-30b-a3b: 512 MiB). Forward:
// GEMM2 of an m-tile writes exactly the rows GEMM1 of that m-tile read, and waits for
// all of them (its A is their h). Backward: the region then holds dy_rows (DG) and
// dx_rows (DX), and DXSUM, the dx rows' last reader, writes each token's x row back to
// its slot rows for WG13 (x_late). Not when kept (a second backward would find no x
// rows), nor with the recompute (RG reads the x rows first), nor at W > 1 (the windows).
static bool x_over_o(const mok_config_t& c) {
  return c.saved_use == MOK_SAVED_REUSE && c.gate_up == MOK_GATE_UP_SAVE && c.W == 1;
}

// The default layout with bf16 weight gradients (h_late): saved holds no h either (F
// bytes a routed row less again: qwen3-30b-a3b 192 MiB). The forward writes h into its
// workspace, where GEMM2 reads it; the backward's DH epilogues, which have each tile's
// gate|up in shared memory, write it again, the same bits, to the front of d_w13 for WG2,
// and the router path's fp32 dx goes after it. d_w13 is free until WG13, which runs only
// after every DXSUM (x_late), the last reader of both. Only where both fit in d_w13 at
// cfg.T: R F 2 (rounded to 256) + T H 4 (fused routing) <= E/W 2F H 2; fp32 weight
// gradients are added into, so they keep h in saved.
static int64_t dw13_h_bytes(const mok_config_t& c) { return up256(recv_rows(c, c.T) * c.F * 2); }
// d_w13 [E/W, 2F, H] bf16, in bytes (the room h_in_dw13 and seg_in_dw13 use)
static int64_t dw13_bytes(const mok_config_t& c) { return c.E / c.W * 2 * c.F * c.H * 2; }
// h, then the router path's dx_router: d_w13's front, in bytes
static int64_t dw13_front_bytes(const mok_config_t& c) {
  return dw13_h_bytes(c) + (c.routing == MOK_ROUTING_FUSED ? c.T * c.H * 4 : 0);
}
static bool h_in_dw13(const mok_config_t& c) {
  return x_over_o(c) && c.wgrad == MOK_WGRAD_BF16 && dw13_front_bytes(c) <= dw13_bytes(c);
}

struct SavedPlan {
  size_t header, idx, g, pos, logits, counts, expert_off, tile_band, sorted, loc_off, loc_shift, x_rows, a_rows,
      h_rows, o_rows, sa, sh, sg, shared_o, total;
};
static SavedPlan plan_saved(const mok_config_t& c, int64_t T) {
  const int64_t R = recv_rows(c, T), Rx = c.W == 1 ? R : 0;  // (W > 1: x_rows, o_rows in the window)
  Plan p;
  SavedPlan s;
  s.header = p.take(kHeaderWords * 8);
  s.idx = p.take(T * c.K * 4);
  s.g = p.take(T * c.K * 4);
  s.pos = p.take(T * c.K * 4);
  s.logits = p.take(T * router_stride(c) * 4);
  s.counts = p.take(c.E * 4);
  s.expert_off = p.take((c.E + 1) * 4);
  s.tile_band = p.take((int64_t)make_shape(c, T, true).max_mt * 4);
  s.sorted = p.take(c.W > 1 ? T * c.K * 4 : 0);
  s.loc_off = p.take(c.W > 1 ? (c.E + 1) * 4 : 0);
  s.loc_shift = p.take(c.W > 1 ? c.E * 4 : 0);
  const int64_t keep = c.gate_up == MOK_GATE_UP_SAVE;  // (else in the workspace: GateUpPlan)
  s.x_rows = p.take(Rx * c.H * 2);
  s.a_rows = p.take(keep * R * 2 * c.F * 2);
  s.h_rows = p.take(keep * !h_in_dw13(c) * R * c.F * 2);
  s.o_rows = x_over_o(c) ? s.x_rows : p.take(Rx * c.H * 2);
  s.sa = p.take(keep * T * 2 * c.Fs * 2);
  s.sh = p.take(keep * T * c.Fs * 2);
  const int64_t gated = c.use_shared_gate != 0;  // (the gate and o_s for d s_g = dy . o_s)
  s.sg = p.take(gated * T * 4);
  s.shared_o = p.take(gated * T * c.H * 2);
  s.total = p.at;
  return s;
}

// cfg.gate_up = MOK_GATE_UP_RECOMPUTE: gate|up and h of the expert rows and of the shared
// expert live in the workspace, where forward writes them and backward writes them again
// (each plan below ends with them; empty when they are kept in saved). The backward's
// gate|up takes no room of its own (with_a false): it is written where d_a goes (d_a_s
// for the shared expert's), the same [rows][2][F] layout, since a DH (DHS) epilogue reads
// each 64-column quarter of its tile's gate|up before it stores that quarter's d_a, no
// two tasks' quarters overlap, and nothing reads gate|up after DH (rows past a tile's
// end that its 128-row boxes load are not used).
struct GateUpPlan {
  size_t a_rows, h_rows, sa, sh;
};
static GateUpPlan plan_gate_up(const mok_config_t& c, int64_t T, Plan& p, bool with_a) {
  const int64_t R = recv_rows(c, T), redo = c.gate_up == MOK_GATE_UP_RECOMPUTE, a = redo && with_a;
  GateUpPlan g;
  g.a_rows = p.take(a * R * 2 * c.F * 2);
  g.h_rows = p.take(redo * R * c.F * 2);
  g.sa = p.take(a * T * 2 * c.Fs * 2);
  g.sh = p.take(redo * T * c.Fs * 2);
  return g;
}
// sv's gate|up pointers into the workspace ws (plan g), under MOK_GATE_UP_RECOMPUTE.
static void place_gate_up(const mok_config_t& c, const GateUpPlan& g, char* ws, SavedView* sv) {
  if (c.gate_up != MOK_GATE_UP_RECOMPUTE) return;
  sv->a_rows = reinterpret_cast<bf16*>(ws + g.a_rows);
  sv->h_rows = reinterpret_cast<bf16*>(ws + g.h_rows);
  sv->sa = reinterpret_cast<bf16*>(ws + g.sa);
  sv->sh = reinterpret_cast<bf16*>(ws + g.sh);
}

// Forward and backward scratch: each call's own plan (mok_workspace_sizes); one buffer of
// the larger serves both.
struct FwdWsPlan {
  size_t scores, lse, rank, block_counts, block_off, tile_expert, tile_row0, tile_row_end, num_tiles, chunk_stats,
      shared_o, cta_maps, h_rows, total;
  GateUpPlan gate_up;
};
static FwdWsPlan plan_fwd_ws(const mok_config_t& c, int64_t T) {
  const Shape s = make_shape(c, T, true);
  Plan p;
  FwdWsPlan w;
  w.scores = p.take(T * c.E * 4);
  w.lse = p.take(T * 4);
  w.rank = p.take(T * c.K * 4);
  w.block_counts = p.take((int64_t)s.nb * c.E * 4);
  w.block_off = p.take((int64_t)s.nb * c.E * 4);
  w.tile_expert = p.take((int64_t)s.max_mt * 4);
  w.tile_row0 = p.take((int64_t)s.max_mt * 4);
  w.tile_row_end = p.take((int64_t)s.max_mt * 4);
  w.num_tiles = p.take(4);
  w.chunk_stats = p.take((int64_t)s.nb * 2 * (c.E + 1) * 4);
  // the shared expert's output: none without one, in saved with the gate (plan_saved)
  w.shared_o = p.take((c.Fs > 0 && !c.use_shared_gate) * T * c.H * 2);
  w.cta_maps = p.take((int64_t)kMaxCtas * 2 * sizeof(CUtensorMap));
  w.h_rows = p.take(h_in_dw13(c) * recv_rows(c, T) * c.F * 2);  // (h_in_dw13: not in saved)
  w.gate_up = plan_gate_up(c, T, p, true);
  w.total = p.at;
  return w;
}
// SEG's nodes (seg_partials) in bytes, 256-byte rounded: seg_cap nodes of the router's E H
// (fused) and the shared expert's 3 Fs H fp32 columns.
static int64_t seg_bytes(const mok_config_t& c, int64_t T) {
  const int64_t cols = (c.routing == MOK_ROUTING_FUSED) * c.E * c.H + 3 * c.Fs * c.H;
  return up256(seg_cap(cdiv(T, MOK_REDUCE_CHUNK_TOKENS), c.W) * cols * 4);
}
// SEG's nodes at the tail of d_w13 instead of the workspace (deepseek-v3 at 8192 tokens:
// 81 MB of the backward's 85 MB; 1.9 GB with a 2048-wide shared expert). d_w13 is free
// until WG13 writes it; the nodes live from SEG to TREE, so the WG13 tasks of the experts
// whose rows hold them (BwdParams::seg_e0 on) come after TREE in ticket order, as
// wgrad13's tail, and wait for every TREE; SEG waits for DG's checks of saved, so that a
// rejected one leaves d_w13 as it was. At W = 1 with bf16 weight gradients (fp32 ones
// are added into), where the nodes fit behind h and dx_router (h_in_dw13's front).
static bool seg_in_dw13(const mok_config_t& c) {
  if (c.W != 1 || c.wgrad != MOK_WGRAD_BF16) return false;
  const int64_t seg = seg_bytes(c, c.T);
  return seg > 0 && (h_in_dw13(c) ? dw13_front_bytes(c) : 0) + seg <= dw13_bytes(c);
}

struct BwdWsPlan {
  size_t dg, dy_rows, d_a, dx_rows, dlogits, d_a_s, dx_router, dx_shared, dy_s, dl_g, partials, seg_partials, cta_maps,
      total;
  int64_t partial_len;
  GateUpPlan gate_up;
};
// MOK_SAVED_REUSE: the backward writes its scratch over pieces of saved it has finished
// reading, the same layout in place. DG reads each o row before it stores that row's dy_j
// at the same place (a lane its own chunks; at W > 1 o_rows and dy_rows are in the
// windows, so only W = 1). A DH (DHS) epilogue reads each 64-column quarter of its tile's
// gate|up before it stores that quarter's d_a, no two tasks' quarters overlap, and nothing
// reads gate|up after DH: the recompute's arrangement (plan_gate_up), here over saved.
static bool bwd_reuse_o(const mok_config_t& c) { return c.saved_use == MOK_SAVED_REUSE && c.W == 1; }
static bool bwd_reuse_gate_up(const mok_config_t& c) {
  return c.saved_use == MOK_SAVED_REUSE && c.gate_up == MOK_GATE_UP_SAVE;
}
// With bwd_reuse_o, WG2 (h_rows' last reader) comes before DXR, so the router path's fp32
// dx_router [T, H] can go where h_rows [T K, F] are (saved's, or the recompute's in the
// workspace) when it fits: 4H <= 2 K F bytes a token. With h_in_dw13 it goes into d_w13,
// after h.
static bool bwd_dx_router_in_h(const mok_config_t& c) {
  return bwd_reuse_o(c) && c.routing == MOK_ROUTING_FUSED && 4 * c.H <= 2 * c.K * c.F && !h_in_dw13(c);
}
static BwdWsPlan plan_bwd_ws(const mok_config_t& c, int64_t T) {
  const int64_t R = recv_rows(c, T), chunks = cdiv(T, MOK_REDUCE_CHUNK_TOKENS);
  Plan p;
  BwdWsPlan w;
  w.partial_len = partial_len(c);
  w.dg = p.take(T * c.K * 4);
  const int64_t Rx = c.W == 1 ? R : 0;  // (W > 1: dy_rows, dx_rows in the window)
  // MOK_SAVED_REUSE (bwd_reuse_o, bwd_reuse_gate_up): dy_rows where saved's o_rows are
  // (W = 1), d_a and d_a_s where its gate|up are (kept, not recomputed)
  const int64_t own_dy = !bwd_reuse_o(c), own_da = !bwd_reuse_gate_up(c);
  w.dy_rows = p.take(own_dy * Rx * c.H * 2);
  w.d_a = p.take(own_da * R * 2 * c.F * 2);
  w.dx_rows = p.take(own_dy * Rx * c.H * 2);  // (reused: where dy_rows are, after every WG2)
  const int64_t fused = c.routing == MOK_ROUTING_FUSED, shared = c.Fs > 0;  // (else unused)
  w.dlogits = p.take(fused * T * router_stride(c) * 2);
  w.d_a_s = p.take(own_da * T * 2 * c.Fs * 2);
  w.dx_router = p.take(!bwd_dx_router_in_h(c) * !h_in_dw13(c) * fused * T * c.H * 4);
  w.dx_shared = p.take(shared * T * c.H * 4);
  const int64_t gated = c.use_shared_gate != 0;
  w.dy_s = p.take(gated * T * c.H * 2);
  w.dl_g = p.take(gated * T * 2);
  // The replicated gradients: the vectors' chunk partials [chunks, partial_len - E H -
  // 3 Fs H] fp32, the weight gradients' segment nodes [seg_cap, (fused ? E H : 0) + 3 Fs
  // H] fp32 (the router's: 19 MiB at qwen3-30b-a3b, against 256 MiB of chunk partials)
  w.partials = p.take(chunks * (w.partial_len - c.E * c.H - 3 * c.Fs * c.H) * 4);
  w.seg_partials = p.take(!seg_in_dw13(c) * seg_bytes(c, T));
  w.cta_maps = p.take((int64_t)kMaxCtas * 2 * sizeof(CUtensorMap));
  w.gate_up = plan_gate_up(c, T, p, false);  // (a_rows, sa: in d_a, d_a_s)
  w.total = p.at;
  return w;
}

void mok_cuda_sizes(const mok_context_t* ctx, size_t* saved_bytes, size_t* forward_ws_bytes, size_t* backward_ws_bytes) {
  const mok_config_t& c = ctx->cfg;
  if (saved_bytes) *saved_bytes = plan_saved(c, c.T).total;
  if (forward_ws_bytes) *forward_ws_bytes = plan_fwd_ws(c, c.T).total;
  if (backward_ws_bytes) *backward_ws_bytes = plan_bwd_ws(c, c.T).total;
}

// ---- context ----

// A persistent launch of either kernel: grid CTAs of `threads` (the launches pass
// kFwdThreads / kBwdThreads; the cluster occupancy query takes kThreads) with the kernels'
// shared memory, in clusters of 2 when `clusters` (*attr holds that attribute; it must
// outlive the configuration's use).
static cudaLaunchConfig_t launch_config(int grid, bool clusters, cudaLaunchAttribute* attr, cudaStream_t stream,
                                        int threads = kThreads) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = 2, attr->val.clusterDim.y = 1, attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3(grid), lc.blockDim = dim3(threads), lc.dynamicSmemBytes = sizeof(Smem) + 1024;
  lc.stream = stream, lc.attrs = attr, lc.numAttrs = clusters ? 1 : 0;  // (0: a plain launch)
  return lc;
}

// W > 1: the communicator (collective over the ranks' creates), the two windows and
// every rank's copy of them.
static mok_status_t setup_peers(mok_context_t* ctx, GpuContext& g) {
#ifdef MOK_HAVE_NCCL
  const mok_config_t& c = ctx->cfg;
  char err[400] = "";
  mok_nccl_comm_t* comm = nullptr;
  mok_status_t st = mok_nccl_comm_create(c.comm_unique_id, c.W, c.rank, &comm, err, sizeof err);
  if (st) return MOK_ERR(ctx, st, "cfg.comm_unique_id, W = %d, rank = %d: %s", c.W, c.rank, err);
  g.comm = comm;
  const size_t rows_bytes = (size_t)c.capacity * c.H * 2;  // x_rows, o_rows, dy_rows, dx_rows
  const size_t counts_bytes = up256((size_t)c.W * (c.E + 1) * 4), flags_bytes = up256((size_t)c.W * kFlagKinds * 8);
  const size_t stats_bytes = up256((size_t)c.W * cdiv(c.T, MOK_REDUCE_CHUNK_TOKENS) * (c.E + 1) * 4);  // (T_r <= c.T)
  const size_t arrive_bytes = (size_t)c.W * kMaxStreams * kArriveGroups * 8;
  // the replicated sums' subtrees: [a, a + n) of n <= ceil(T / 64) chunks splits into at
  // most 2 ceil(log2(n + 1)) aligned subtrees (tree_nodes in the kernel)
  int bits = 0;
  while ((1ll << bits) <= cdiv(c.T, MOK_REDUCE_CHUNK_TOKENS)) bits++;
  g.px.tree_nodes = 2 * bits;
  const size_t tree_bytes = (size_t)g.px.tree_nodes * partial_len(c) * 4;
  // o_kept and row_src after the four (PeerReturn)
  const size_t kept_bytes = up256((size_t)c.T * c.K * c.H * 2), src_bytes = up256((size_t)c.capacity * 8);
  st = mok_nccl_window_alloc(comm, 4 * rows_bytes + kept_bytes + src_bytes, &g.rows_local, &g.rows_win, err,
                             sizeof err);
  if (!st) st = mok_nccl_window_alloc(comm, tree_bytes, &g.tree_local, &g.tree_win, err, sizeof err);
  if (!st)
    st = mok_nccl_window_alloc(comm, counts_bytes + flags_bytes + stats_bytes + arrive_bytes, &g.xchg_local,
                               &g.xchg_win, err, sizeof err);
  if (st) return MOK_ERR(ctx, st, "the exchange windows (capacity = %lld rows of H = %lld): %s",
                         (long long)c.capacity, (long long)c.H, err);
  const size_t rows_at[6] = {0, rows_bytes, 2 * rows_bytes, 3 * rows_bytes, 4 * rows_bytes, 4 * rows_bytes + kept_bytes};
  const size_t xchg_at[4] = {0, counts_bytes, counts_bytes + flags_bytes, counts_bytes + flags_bytes + stats_bytes};
  const size_t tree_at[1] = {0};
  void* rows[6 * kMaxPeers];
  void* xchg[4 * kMaxPeers];
  void* tree[kMaxPeers];
  st = mok_nccl_peer_pointers(comm, g.rows_win, rows_at, 6, rows, err, sizeof err);
  if (!st) st = mok_nccl_peer_pointers(comm, g.xchg_win, xchg_at, 4, xchg, err, sizeof err);
  if (!st) st = mok_nccl_peer_pointers(comm, g.tree_win, tree_at, 1, tree, err, sizeof err);
  if (st) return MOK_ERR(ctx, st, "%s", err);
  for (int r = 0; r < c.W; r++) {
    g.peer_x_rows.rows[r] = static_cast<bf16*>(rows[r]);
    g.peer_o_rows.rows[r] = static_cast<bf16*>(rows[c.W + r]);
    g.px.counts[r] = static_cast<int32_t*>(xchg[r]);
    g.px.flags[r] = static_cast<uint64_t*>(xchg[c.W + r]);
    g.px.stats[r] = static_cast<float*>(xchg[2 * c.W + r]);
    g.px.arrive[r] = static_cast<uint64_t*>(xchg[3 * c.W + r]);
    g.peer_dy_rows.rows[r] = static_cast<bf16*>(rows[2 * c.W + r]);
    g.peer_dx_rows.rows[r] = static_cast<bf16*>(rows[3 * c.W + r]);
    g.ret.o_kept[r] = static_cast<bf16*>(rows[4 * c.W + r]);
    g.ret.row_src[r] = static_cast<int64_t*>(rows[5 * c.W + r]);
    g.px.tree[r] = static_cast<float*>(tree[r]);
  }
  return MOK_STATUS_SUCCESS;
#else
  (void)g;
  return MOK_ERR(ctx, MOK_STATUS_BACKEND_UNAVAILABLE, "cfg.W = %d: this build has no NCCL", ctx->cfg.W);
#endif
}

// Destroy, W > 1: peers may still read this rank's windows in their last step, so each
// rank says goodbye (flag BYE in every rank's window, written from the host) and waits
// for every rank's, at most comm_timeout_s; then the windows go, collectively. A rank
// that never says it (or a context broken by a timeout) makes this one abort the
// communicator instead, which waits for no one, and free its memory unregistered.
static void free_peers(GpuContext* g, const mok_config_t& c) {
#ifdef MOK_HAVE_NCCL
  if (!g->comm) return;
  mok_nccl_comm_t* comm = static_cast<mok_nccl_comm_t*>(g->comm);
  cudaDeviceSynchronize();  // (this rank's last launches)
  bool all = !g->broken && g->px.flags[0];
  const uint64_t bye = 1;
  for (int r = 0; r < c.W && all; r++)
    all = copy_now(g->px.flags[r] + c.rank * kFlagKinds + kFlagBye, &bye, 8) == cudaSuccess;
  for (double waited = 0; all;) {
    uint64_t f[kMaxPeers * kFlagKinds];
    if (copy_now(f, g->px.flags[c.rank], sizeof(uint64_t) * c.W * kFlagKinds) != cudaSuccess)
      all = false;
    int n = 0;
    for (int r = 0; r < c.W && all; r++) n += f[r * kFlagKinds + kFlagBye] >= bye;
    if (n == c.W) break;
    if (waited > c.comm_timeout_s) all = false;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, nullptr);
    waited += 1e-3;
  }
  if (all || g->loopback) {  // (loopback: nothing collective to abort, each rank frees its own copies)
    mok_nccl_window_free(comm, g->rows_local, g->rows_win);
    mok_nccl_window_free(comm, g->xchg_local, g->xchg_win);
    mok_nccl_window_free(comm, g->tree_local, g->tree_win);
    mok_nccl_comm_destroy(comm, !all);
  } else {
    mok_nccl_comm_destroy(comm, 1);
    mok_nccl_window_free(nullptr, g->rows_local, nullptr);  // (no collective deregistration)
    mok_nccl_window_free(nullptr, g->xchg_local, nullptr);
    mok_nccl_window_free(nullptr, g->tree_local, nullptr);
  }
  g->comm = nullptr;
#else
  (void)g, (void)c;
#endif
}

mok_status_t mok_cuda_create(mok_context_t* ctx) {
  const mok_config_t& c = ctx->cfg;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return MOK_ERR(ctx, MOK_STATUS_BACKEND_UNAVAILABLE, "cfg.backend = MOK_BACKEND_CUDA: no CUDA device is visible");
  }
  GpuContext g{};
  CUDA_TRY(ctx, cudaGetDevice(&g.device));
  cudaDeviceProp prop;
  CUDA_TRY(ctx, cudaGetDeviceProperties(&prop, g.device));
  if (prop.major != 9)
    return MOK_ERR(ctx, MOK_STATUS_BACKEND_UNAVAILABLE,
                   "cfg.backend = MOK_BACKEND_CUDA: device %d is sm_%d%d; the kernels are built for sm_90a (Hopper)",
                   g.device, prop.major, prop.minor);
  g.num_sms = prop.multiProcessorCount;
#ifdef MOK_HAVE_NCCL
  g.loopback = c.W > 1 && mok_nccl_is_loopback_id(c.comm_unique_id);
#endif
  // loopback: the W ranks' persistent grids share the SMs and must all be resident at
  // once (each waits for the others' flags), so a rank takes at most SMs / W CTAs
  const int sms = g.loopback ? g.num_sms / c.W : g.num_sms;
  if (c.num_ctas > sms)
    return MOK_ERR(ctx, MOK_STATUS_INVALID_ARGUMENT, "cfg.num_ctas = %d must be <= %d, the %d SMs of device %d%s",
                   c.num_ctas, sms, g.num_sms, g.device, g.loopback ? " shared by the W ranks of a loopback id" : "");
  if ((c.num_ctas > 0 ? c.num_ctas : g.num_sms) > kMaxCtas)
    return MOK_ERR(ctx, MOK_STATUS_BACKEND_UNAVAILABLE,
                   "device %d has %d SMs: a launch of more than %d CTAs needs a larger kMaxCtas (gpu_params.h)",
                   g.device, g.num_sms, kMaxCtas);
  cudaDriverEntryPointQueryResult q;
  void* fn = nullptr;
  CUDA_TRY(ctx, cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  if (!fn || q != cudaDriverEntryPointSuccess)
    return MOK_ERR(ctx, MOK_STATUS_BACKEND_UNAVAILABLE, "the driver has no cuTensorMapEncodeTiled");
  g.encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  const Shape s = make_shape(c, c.T, true);
  g.sync_words = std::max(fwd_num_counters(s), bwd_num_counters(s));
  CUDA_TRY(ctx, cudaMalloc(&g.sync, sizeof(GpuSync) + sizeof(uint32_t) * g.sync_words));
  CUDA_TRY(ctx, (cudaError_t)mok_cuda_zero_now(g.sync, sizeof(GpuSync) + sizeof(uint32_t) * g.sync_words));
  const char* trace = getenv("MOK_TRACE");
  if (trace && *trace) {
    const int n = c.W > 1 ? snprintf(g.trace_path, sizeof g.trace_path, "%s.rank%d", trace, c.rank)
                          : snprintf(g.trace_path, sizeof g.trace_path, "%s", trace);
    if (n < 0 || n >= (int)sizeof g.trace_path)
      return MOK_ERR(ctx, MOK_STATUS_INVALID_ARGUMENT, "MOK_TRACE: a path of at most %d characters",
                     (int)sizeof g.trace_path - 8);
  }
  if ((getenv("MOK_PROFILE") && atoi(getenv("MOK_PROFILE")) > 0) || (trace && *trace)) {
    CUDA_TRY(ctx, cudaMalloc(&g.prof, sizeof(unsigned long long) * 2 * kProfSlots));
    CUDA_TRY(ctx, (cudaError_t)mok_cuda_zero_now(g.prof, sizeof(unsigned long long) * 2 * kProfSlots));
  }
  if (trace && *trace) {
    CUDA_TRY(ctx, cudaMalloc(&g.trace, sizeof(TraceRecord) * kTraceCap));
    CUDA_TRY(ctx, cudaMalloc(&g.trace_len, sizeof(uint32_t)));
    CUDA_TRY(ctx, (cudaError_t)mok_cuda_zero_now(g.trace_len, sizeof(uint32_t)));
  }
  CUDA_TRY(ctx, cudaMalloc(&g.status, sizeof(uint32_t)));
  CUDA_TRY(ctx, (cudaError_t)mok_cuda_zero_now(g.status, sizeof(uint32_t)));
  const int smem = (int)sizeof(Smem) + 1024;
  CUDA_TRY(ctx, cudaFuncSetAttribute(forward_kernel(c), cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CUDA_TRY(ctx, cudaFuncSetAttribute(backward_kernel(c), cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // Clusters of 2 (cfg.cta_pairs) when the grid is even and every pair fits at once; an
  // odd grid runs unclustered, and the bits are the same either way (D2). The forward
  // launches in them, the backward with ON alone (backward_clustered). The default grid
  // (one CTA per SM) shrinks to the pairs that fit when the GPCs leave an SM or two unpaired.
  g.grid = c.num_ctas > 0 ? c.num_ctas : sms;
  const bool want = c.cta_pairs != MOK_CTA_PAIRS_OFF && !g.loopback;  // (loopback: no clusters, see mok.h)
  if (want && (g.grid % 2 == 0 || c.num_ctas == 0)) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t lc = launch_config(g.grid & ~1, true, &attr, nullptr);
    int fwd = 0, bwd = 0;
    if (cudaOccupancyMaxActiveClusters(&fwd, forward_kernel(c), &lc) == cudaSuccess &&
        cudaOccupancyMaxActiveClusters(&bwd, backward_kernel(c), &lc) == cudaSuccess) {
      const int pairs = std::min(fwd, bwd);
      if (c.num_ctas == 0 && 2 * pairs < g.grid && 2 * pairs >= g.grid - 4) g.grid = 2 * pairs;
      g.clusters = g.grid % 2 == 0 && 2 * pairs >= g.grid;
    }
    cudaGetLastError();  // (an occupancy query's failure leaves clusters off)
  }
  if (getenv("MOK_PROFILE") && atoi(getenv("MOK_PROFILE")) > 0)
    fprintf(stderr, "mok: %d CTAs, clusters of 2 %s\n", g.grid, g.clusters ? "on" : "off");
  if (c.W > 1) {
    const mok_status_t st = setup_peers(ctx, g);
    if (st) {
      g.broken = true;  // (the peers' creates may not have come: no collective step)
      free_peers(&g, c);
      return st;
    }
  }
  ctx->gpu = new GpuContext(g);
  return MOK_STATUS_SUCCESS;
}

void mok_cuda_destroy(mok_context_t* ctx) {
  GpuContext* g = gpu(ctx);
  if (!g) return;
  DeviceScope device_scope(g->device);  // (an error here: the frees below report nothing either)
  free_peers(g, ctx->cfg);
  cudaFree(g->sync);
  cudaFree(g->status);
  cudaFree(g->prof);
  cudaFree(g->trace);
  cudaFree(g->trace_len);
  delete g;
  ctx->gpu = nullptr;
}

// MOK_PROFILE=1: CTA time per task kind since the last sync, summed over CTAs (wall-clock
// ms from %globaltimer), to stderr; a measurement aid for choosing what to speed up next.
// MOK_TRACE=file: also appends every task of those launches to the file (W > 1:
// file.rank<r>, a file per rank), one line each:
// "sync kind cta start_ns end_ns wait_ns cycles" and TraceRecord's stall counts
// (bench/trace_report.py reads it).
static mok_status_t print_profile(mok_context_t* ctx) {
  static const char* names[kProfSlots] = {"route", "shared1", "prefix", "dispatch", "gemm1", "shared2", "gemm2",
                                          "combine", "dg", "dhs", "dh", "dxr", "dxs", "dx", "wgrad2", "wgrad13",
                                          "rw", "tree", "dxsum", "wait(fwd)", "wait(bwd)", "rg", "rgs", "return"};
  GpuContext* g = gpu(ctx);
  unsigned long long h[2 * kProfSlots];
  CUDA_TRY(ctx, copy_now(h, g->prof, sizeof h));  // (after mok_cuda_sync's wait for the step)
  CUDA_TRY(ctx, (cudaError_t)mok_cuda_zero_now(g->prof, sizeof h));
  fprintf(stderr, "mok profile, rank %d (CTA-ms summed over CTAs; / %d SMs for wall share):", ctx->cfg.rank,
          g->num_sms);
  for (int i = 0; i < kProfSlots; i++)
    if (h[2 * i]) fprintf(stderr, " %s %.2f (%llu)", names[i], (double)h[2 * i] * 1e-6, h[2 * i + 1]);
  fprintf(stderr, "\n");
  if (!g->trace) return MOK_STATUS_SUCCESS;
  uint32_t n = 0;
  CUDA_TRY(ctx, copy_now(&n, g->trace_len, sizeof n));
  CUDA_TRY(ctx, (cudaError_t)mok_cuda_zero_now(g->trace_len, sizeof n));
  if (n > kTraceCap) {
    fprintf(stderr, "mok trace: %u tasks, only the first %u kept\n", n, kTraceCap);
    n = kTraceCap;
  }
  std::vector<TraceRecord> r(n);
  CUDA_TRY(ctx, copy_now(r.data(), g->trace, sizeof(TraceRecord) * n));
  FILE* f = fopen(g->trace_path, "a");
  if (!f) return MOK_ERR(ctx, MOK_STATUS_INVALID_ARGUMENT, "MOK_TRACE: cannot open %s for appending", g->trace_path);
  for (const TraceRecord& t : r) {
    fprintf(f, "%d %d %d %llu %llu %u %u", g->syncs, (int)t.kind, (int)t.cta, (unsigned long long)t.start,
            (unsigned long long)t.end, t.wait_ns, t.cycles);
    for (int k = 0; k < kStallKinds; k++) fprintf(f, " %u", t.stall[k]);
    fprintf(f, "\n");
  }
  fclose(f);
  g->syncs++;
  return MOK_STATUS_SUCCESS;
}

mok_status_t mok_cuda_zero(mok_context_t* ctx, void* dst, size_t bytes, void* stream) {
  DEVICE_SCOPE(ctx);
  CUDA_TRY(ctx, cudaMemsetAsync(dst, 0, bytes, static_cast<cudaStream_t>(stream)));
  return MOK_STATUS_SUCCESS;
}

mok_status_t mok_cuda_sync(mok_context_t* ctx) {
  GpuContext* g = gpu(ctx);
  DEVICE_SCOPE(ctx);
  // Wait for the step first: a copy to pageable memory blocks its thread inside the
  // driver until the copy is done, and issued while the step runs it can keep the peers'
  // threads (W ranks on one GPU) from launching the kernels the step waits for (the
  // comm suite's peer_exchange, copying first, timed out on every rank at W = 4 and 8 on
  // one H200; waiting first, it passed). Then read and zero the status on the step's
  // stream, ordered before the next launch there whatever kind of stream the caller's is
  // (the legacy default stream's work is not ordered with a non-blocking stream's).
  CUDA_TRY(ctx, cudaStreamSynchronize(g->last_stream));
  uint32_t st = 0;
  CUDA_TRY(ctx, cudaMemcpyAsync(&st, g->status, sizeof st, cudaMemcpyDeviceToHost, g->last_stream));
  CUDA_TRY(ctx, cudaMemsetAsync(g->status, 0, sizeof st, g->last_stream));
  CUDA_TRY(ctx, cudaStreamSynchronize(g->last_stream));
  if (g->prof) print_profile(ctx);
  if (st == MOK_STATUS_COMM_TIMEOUT && ctx->cfg.W > 1) {
    g->broken = true;
    return MOK_ERR(ctx, MOK_STATUS_COMM_TIMEOUT,
                   "a step on the device stopped: a peer rank did not arrive within cfg.comm_timeout_s = %g s; the "
                   "context takes no more steps (destroy it)",
                   ctx->cfg.comm_timeout_s);
  }
  if (st != MOK_STATUS_SUCCESS)
    return MOK_ERR(ctx, (mok_status_t)st, "a step on the device stopped with %s", mok_status_string((mok_status_t)st));
  return MOK_STATUS_SUCCESS;
}

// A bf16 tensor map of `rank` dimensions (dims[0] innermost, in elements; strides of
// dims 1.. in bytes), 128-byte swizzle; out-of-bound elements read as zero and are not
// written by stores.
static CUresult encode_tiled(mok_context_t* ctx, CUtensorMap* map, const void* base, cuuint32_t rank,
                             const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box) {
  const cuuint32_t elem[3] = {1, 1, 1};
  return gpu(ctx)->encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), dims, strides, box,
                          elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                          CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}
// encode_tiled, a failure an error naming the map; zeroed, and not used, when base is
// null (a buffer this configuration does not have).
static mok_status_t encode_map(mok_context_t* ctx, CUtensorMap* map, const void* base, cuuint32_t rank,
                               const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                               const char* name) {
  memset(map, 0, sizeof *map);
  if (!base) return MOK_STATUS_SUCCESS;
  cuuint64_t d[5];  // (an extent of 0, a rank's T = 0 at W > 1: 1, never loaded, as no task reads it)
  for (cuuint32_t i = 0; i < rank; i++) d[i] = dims[i] ? dims[i] : 1;
  const CUresult r = encode_tiled(ctx, map, base, rank, d, strides, box);
  if (r != CUDA_SUCCESS) {
    char shape[96];
    int n = 0;
    for (int d = (int)rank - 1; d >= 0 && n < (int)sizeof shape; d--)  // outermost first
      n += snprintf(shape + n, sizeof shape - n, "%s%llu", n ? ", " : "", (unsigned long long)dims[d]);
    return MOK_ERR(ctx, MOK_STATUS_CUDA_ERROR, "cuTensorMapEncodeTiled(%s [%s]) failed with %d", name, shape, (int)r);
  }
  return MOK_STATUS_SUCCESS;
}

// A 2-D map [rows, cols] (cols contiguous), boxes of box_rows x 64. Loads use 64-row
// boxes or, through tall maps, 128-row ones (gemm_tiles' kBoxRows), the epilogues' TMA
// stores kStoreRows-row boxes (sm90_epilogues.cuh).
// ld: the row stride in elements (0: cols); a multiple of 8 (TMA's 16-byte strides).
static mok_status_t make_map(mok_context_t* ctx, CUtensorMap* map, const void* base, int64_t rows, int64_t cols,
                             const char* name, uint32_t box_rows = 64, int64_t ld = 0) {
  const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)std::max<int64_t>(rows, 1)};
  const cuuint64_t strides[1] = {(cuuint64_t)(ld ? ld : cols) * 2};
  const cuuint32_t box[2] = {64, box_rows};
  return encode_map(ctx, map, base, 2, dims, strides, box, name);
}

// A tall MN-major operand map (gemm_tiles' kBoxRows 128) of [rows, cols] (cols
// contiguous, a multiple of 64), seen as [cols / 64][rows][64] with 64 x 64 x 2 boxes:
// one load brings two adjacent 64 x 64 boxes (k rows x mn columns), the second chunk
// after the first, as two 2-D loads would. (Its strides do not increase, as the store
// pair map's: the driver takes them.)
static mok_status_t make_chunk_map(mok_context_t* ctx, CUtensorMap* map, const void* base, int64_t rows, int64_t cols,
                                   const char* name) {
  const cuuint64_t dims[3] = {64, (cuuint64_t)std::max<int64_t>(rows, 1), (cuuint64_t)cols / 64};
  const cuuint64_t strides[2] = {(cuuint64_t)cols * 2, 128};
  const cuuint32_t box[3] = {64, 64, 2};
  return encode_map(ctx, map, base, 3, dims, strides, box, name);
}

// A map of a gate|up buffer [rows, 2F] seen as [rows][2][F] (64 x 1 x box_rows boxes),
// so that a box of gate columns never spills into the up half: the SwiGLU epilogues'
// TMA stores and (128-row boxes) the backward's loads of gate and up.
static mok_status_t make_gate_up_map(mok_context_t* ctx, CUtensorMap* map, const void* base, int64_t rows, int64_t F,
                                     const char* name, uint32_t box_rows) {
  const cuuint64_t dims[3] = {(cuuint64_t)F, 2, (cuuint64_t)std::max<int64_t>(rows, 1)};
  const cuuint64_t strides[2] = {(cuuint64_t)F * 2, (cuuint64_t)F * 4};
  const cuuint32_t box[3] = {64, 1, box_rows};
  return encode_map(ctx, map, base, 3, dims, strides, box, name);
}

#define MAP_TRY(expr)                 \
  do {                                \
    mok_status_t s_ = (expr);         \
    if (s_ != MOK_STATUS_SUCCESS) return s_; \
  } while (0)

// The store maps of a 2-D output [rows, cols], or of a gate|up output [rows, 2F]. The
// pair map's strides are not increasing (a chunk of columns is 128 B, a row cols * 2):
// where the driver refuses it, the stores take one box at a time (has_pair 0).
static mok_status_t make_store_map(mok_context_t* ctx, StoreMap* m, const void* base, int64_t rows, int64_t cols,
                                   const char* name) {
  MAP_TRY(make_map(ctx, &m->full, base, rows, cols, name, BM));
  MAP_TRY(make_map(ctx, &m->part, base, rows, cols, name, kStoreRows));
  memset(&m->pair, 0, sizeof m->pair);
  m->has_pair = 0;
  if (base && cols % 64 == 0) {
    const cuuint64_t dims[3] = {64, (cuuint64_t)std::max<int64_t>(rows, 1), (cuuint64_t)cols / 64};
    const cuuint64_t strides[2] = {(cuuint64_t)cols * 2, 128};
    const cuuint32_t box[3] = {64, BM, 2};
    m->has_pair = encode_tiled(ctx, &m->pair, base, 3, dims, strides, box) == CUDA_SUCCESS;
  }
  return MOK_STATUS_SUCCESS;
}
static mok_status_t make_gate_up_store_map(mok_context_t* ctx, StoreMap* m, const void* base, int64_t rows, int64_t F,
                                           const char* name) {
  MAP_TRY(make_gate_up_map(ctx, &m->full, base, rows, F, name, BM));
  return make_gate_up_map(ctx, &m->part, base, rows, F, name, kStoreRows);
}

// The saved buffer's pieces; with W > 1 the expert rows x_rows and o_rows are this
// rank's in the windows (peers write and read them), not in the buffer.
static SavedView saved_view(const mok_context_t* ctx, void* base) {
  const mok_config_t& c = ctx->cfg;
  const SavedPlan sp = plan_saved(c, c.T);
  char* b = static_cast<char*>(base);
  SavedView v;
  v.header = reinterpret_cast<uint64_t*>(b + sp.header);
  v.idx = reinterpret_cast<int32_t*>(b + sp.idx);
  v.g = reinterpret_cast<float*>(b + sp.g);
  v.pos = reinterpret_cast<int32_t*>(b + sp.pos);
  v.logits = reinterpret_cast<float*>(b + sp.logits);
  v.counts = reinterpret_cast<int32_t*>(b + sp.counts);
  v.expert_off = reinterpret_cast<int32_t*>(b + sp.expert_off);
  v.tile_band = reinterpret_cast<int32_t*>(b + sp.tile_band);
  v.sorted = reinterpret_cast<int32_t*>(b + sp.sorted);
  v.loc_off = reinterpret_cast<int32_t*>(b + sp.loc_off);
  v.loc_shift = reinterpret_cast<int32_t*>(b + sp.loc_shift);
  v.x_rows = reinterpret_cast<bf16*>(b + sp.x_rows);
  v.a_rows = reinterpret_cast<bf16*>(b + sp.a_rows);
  v.h_rows = reinterpret_cast<bf16*>(b + sp.h_rows);
  v.o_rows = reinterpret_cast<bf16*>(b + sp.o_rows);
  v.sa = reinterpret_cast<bf16*>(b + sp.sa);
  v.sh = reinterpret_cast<bf16*>(b + sp.sh);
  v.sg = reinterpret_cast<float*>(b + sp.sg);
  v.shared_o = reinterpret_cast<bf16*>(b + sp.shared_o);
  if (c.W > 1) v.x_rows = gpu(ctx)->peer_x_rows.rows[c.rank], v.o_rows = gpu(ctx)->peer_o_rows.rows[c.rank];
  return v;
}

static GpuStep make_step(const mok_context_t* ctx) {
  GpuContext* g = gpu(ctx);
  GpuStep st;
  st.sync = g->sync;
  st.status = g->status;
  st.num_counters = g->sync_words;
  st.timeout_ns = (uint64_t)(ctx->cfg.comm_timeout_s * 1e9);
  st.prof = gpu(ctx)->prof;
  st.trace = gpu(ctx)->trace;
  st.trace_len = gpu(ctx)->trace_len;
  st.trace_cap = kTraceCap;
  st.knobs = getenv("MOK_KNOBS") ? (uint32_t)strtoul(getenv("MOK_KNOBS"), nullptr, 0) : 0;
  return st;
}

// Whether the backward launches in clusters of 2 (the forward does whenever the context
// has them: cfg.cta_pairs not OFF, an even grid whose pairs fit). AUTO leaves the
// backward unclustered: its pairs (dh, dx, the streamed weight gradients) measured 0 to
// 2.6% slower on the step than each CTA alone, while the forward's were up to 2.7%
// faster (docs/PERF.md, 2026-12-06 third session); ON clusters both. Either way both
// kernels lay the tile table out for pairs when the context has clusters (Shape::pairs:
// the backward reads the forward's bands, saved's tile_band), an unclustered backward
// then skipping a ticket at a paired phase's odd start. The bits are the same (D2).
static bool backward_clustered(const mok_context_t* ctx) {
  return !kBwdProducer && gpu(ctx)->clusters && ctx->cfg.cta_pairs == MOK_CTA_PAIRS_ON;
}

// One persistent launch of `threads` a CTA, in clusters of 2 when `clusters`.
template <class Params>
static cudaError_t launch(const mok_context_t* ctx, void (*kernel)(Params), const Params& p, bool clusters,
                          cudaStream_t stream, int threads) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t lc = launch_config(gpu(ctx)->grid, clusters, &attr, stream, threads);
  return cudaLaunchKernelEx(&lc, kernel, p);
}

// A context whose step timed out waiting for a peer takes no more steps.
static mok_status_t check_not_broken(mok_context_t* ctx) {
  if (!gpu(ctx)->broken) return MOK_STATUS_SUCCESS;
  return MOK_ERR(ctx, MOK_STATUS_COMM_TIMEOUT,
                 "an earlier step timed out waiting for a peer rank: this context takes no more steps (destroy it)");
}

mok_status_t mok_cuda_forward(mok_context_t* ctx, const mok_forward_args_t* a) {
  const mok_config_t& c = ctx->cfg;
  if (mok_status_t st = check_not_broken(ctx)) return st;
  DEVICE_SCOPE(ctx);
  const int64_t T = a->num_tokens, R = recv_rows(c, T), H = c.H, F = c.F, E = c.E, El = c.E / c.W, Fs = c.Fs;
  FwdParams p;
  memset(&p, 0, sizeof p);
  p.s = make_shape(c, T, gpu(ctx)->clusters);
  p.s.nd = dispatch_tasks(p.s, c, gpu(ctx)->grid);
  p.s.nd_slots = c.W > 1 ? dispatch_slots() : 0;
  p.s.nr = return_tasks(c, gpu(ctx)->grid, gpu(ctx)->clusters);
  p.st = make_step(ctx);
  p.context_id = ctx->serial;
  p.serial = ++ctx->forward_serial;
  p.sv = saved_view(ctx, a->saved);
  p.capacity = (int)R;
  if (c.W > 1) {  // expert rows in the windows, which peers write (x_rows) and read (o_rows)
    const GpuContext* g = gpu(ctx);
    p.peer_x_rows = g->peer_x_rows, p.peer_o_rows = g->peer_o_rows, p.px = g->px, p.ret = g->ret;
  } else {  // this rank owns every expert
    p.peer_x_rows.rows[0] = p.sv.x_rows;
    p.peer_o_rows.rows[0] = p.sv.o_rows;
  }
  const FwdWsPlan wp = plan_fwd_ws(c, c.T);
  char* ws = static_cast<char*>(a->workspace);
  place_gate_up(c, wp.gate_up, ws, &p.sv);
  if (h_in_dw13(c)) p.sv.h_rows = reinterpret_cast<bf16*>(ws + wp.h_rows);  // (GEMM1 to GEMM2 only)
  MAP_TRY(make_map(ctx, &p.m_x, a->x, T, H, "x", kFwdBoxRows));
  MAP_TRY(make_map(ctx, &p.m_wr, p.s.fused ? a->w_router : nullptr, E, H, "w_router", kFwdBoxRows));
  MAP_TRY(make_map(ctx, &p.m_w13, a->w13, El * 2 * F, H, "w13", kFwdBoxRows));
  MAP_TRY(make_map(ctx, &p.m_w2, a->w2, El * H, F, "w2", kFwdBoxRows));
  MAP_TRY(make_map(ctx, &p.m_xrows, p.sv.x_rows, R, H, "x_rows", kFwdBoxRows));
  MAP_TRY(make_map(ctx, &p.m_hrows, p.sv.h_rows, R, F, "h_rows", kFwdBoxRows));
  MAP_TRY(make_map(ctx, &p.m_ws13, Fs ? a->ws13 : nullptr, 2 * Fs, H, "ws13", kFwdBoxRows));
  MAP_TRY(make_map(ctx, &p.m_ws2, Fs ? a->ws2 : nullptr, H, Fs, "ws2", kFwdBoxRows));
  MAP_TRY(make_map(ctx, &p.m_sh, Fs ? p.sv.sh : nullptr, T, Fs, "shared_h", kFwdBoxRows));
  MAP_TRY(make_store_map(ctx, &p.st_orows, p.sv.o_rows, R, H, "o_rows"));
  MAP_TRY(make_gate_up_store_map(ctx, &p.st_arows, p.sv.a_rows, R, F, "a_rows"));
  MAP_TRY(make_store_map(ctx, &p.st_hrows, p.sv.h_rows, R, F, "h_rows"));
  MAP_TRY(make_gate_up_store_map(ctx, &p.st_sa, Fs ? p.sv.sa : nullptr, T, Fs, "shared_a"));
  MAP_TRY(make_store_map(ctx, &p.st_sh, Fs ? p.sv.sh : nullptr, T, Fs, "shared_h"));
  p.x = static_cast<const bf16*>(a->x);
  p.bias = c.use_bias_select ? a->bias_select : nullptr;
  p.b_router = c.use_router_bias ? a->b_router : nullptr;
  p.b13 = c.use_expert_bias ? static_cast<const bf16*>(a->b13) : nullptr;
  p.b2 = c.use_expert_bias ? static_cast<const bf16*>(a->b2) : nullptr;
  p.w_sg = c.use_shared_gate ? static_cast<const bf16*>(a->w_sg) : nullptr;
  p.in_idx = a->topk_idx;
  p.in_w = a->topk_weight;
  p.y = static_cast<bf16*>(a->y);
  p.tokens_per_expert = a->tokens_per_expert;
  p.aux_loss = a->aux_loss;
  p.z_loss = a->z_loss;
  p.out_idx = p.s.fused ? a->topk_idx : nullptr;
  p.out_w = p.s.fused ? a->topk_weight : nullptr;
  p.logits = p.sv.logits;
  p.scores = reinterpret_cast<float*>(ws + wp.scores);
  p.lse = reinterpret_cast<float*>(ws + wp.lse);
  p.rank = reinterpret_cast<int32_t*>(ws + wp.rank);
  p.block_counts = reinterpret_cast<int32_t*>(ws + wp.block_counts);
  p.block_off = reinterpret_cast<int32_t*>(ws + wp.block_off);
  p.tile_expert = reinterpret_cast<int32_t*>(ws + wp.tile_expert);
  p.tile_row0 = reinterpret_cast<int32_t*>(ws + wp.tile_row0);
  p.tile_row_end = reinterpret_cast<int32_t*>(ws + wp.tile_row_end);
  p.cta_maps = reinterpret_cast<CUtensorMap*>(ws + wp.cta_maps);
  p.num_tiles = reinterpret_cast<int32_t*>(ws + wp.num_tiles);
  p.chunk_stats = reinterpret_cast<float*>(ws + wp.chunk_stats);
  p.shared_o = c.use_shared_gate ? p.sv.shared_o : reinterpret_cast<bf16*>(ws + wp.shared_o);
  MAP_TRY(make_store_map(ctx, &p.st_shared_o, Fs ? p.shared_o : nullptr, T, H, "shared_o"));
  cudaStream_t stream = static_cast<cudaStream_t>(a->stream);
  CUDA_TRY(ctx, launch(ctx, forward_kernel(c), p, kFwdClusters && gpu(ctx)->clusters, stream, kFwdThreads));
  gpu(ctx)->last_stream = stream;
  return MOK_STATUS_SUCCESS;
}

mok_status_t mok_cuda_backward(mok_context_t* ctx, const mok_backward_args_t* a) {
  const mok_config_t& c = ctx->cfg;
  if (mok_status_t st = check_not_broken(ctx)) return st;
  DEVICE_SCOPE(ctx);
  const int64_t T = a->num_tokens, R = recv_rows(c, T), H = c.H, F = c.F, E = c.E, El = c.E / c.W, Fs = c.Fs;
  BwdParams p;
  memset(&p, 0, sizeof p);
  p.s = make_shape(c, T, gpu(ctx)->clusters);  // (the forward's tile table: backward_clustered)
  p.st = make_step(ctx);
  p.context_id = ctx->serial;
  p.forward_serial = ctx->forward_serial;  // (saved's serial is one of these forwards')
  p.capacity = (int)R;
  p.wgrad_fp32 = c.wgrad == MOK_WGRAD_FP32_ACCUM;
  p.recompute = c.gate_up == MOK_GATE_UP_RECOMPUTE;
  p.sv = saved_view(ctx, const_cast<void*>(a->saved));
  const BwdWsPlan wp = plan_bwd_ws(c, c.T);
  char* ws = static_cast<char*>(a->workspace);
  place_gate_up(c, wp.gate_up, ws, &p.sv);
  p.dg = reinterpret_cast<float*>(ws + wp.dg);
  p.dy_rows = reinterpret_cast<bf16*>(ws + wp.dy_rows);
  p.d_a = reinterpret_cast<bf16*>(ws + wp.d_a);
  p.dx_rows = reinterpret_cast<bf16*>(ws + wp.dx_rows);
  p.dlogits = reinterpret_cast<bf16*>(ws + wp.dlogits);
  p.d_a_s = reinterpret_cast<bf16*>(ws + wp.d_a_s);
  p.dx_router = reinterpret_cast<float*>(ws + wp.dx_router);
  p.dx_shared = reinterpret_cast<float*>(ws + wp.dx_shared);
  p.dy_s = reinterpret_cast<bf16*>(ws + wp.dy_s);
  p.dl_g = reinterpret_cast<bf16*>(ws + wp.dl_g);
  if (p.recompute) p.sv.a_rows = p.d_a, p.sv.sa = p.d_a_s;  // (plan_gate_up: DH reads a where it writes d_a)
  p.reuse = c.saved_use == MOK_SAVED_REUSE;
  if (bwd_reuse_gate_up(c)) p.d_a = p.sv.a_rows, p.d_a_s = p.sv.sa;  // (bwd_reuse_*: in place over saved)
  if (bwd_reuse_o(c)) p.dy_rows = p.dx_rows = p.sv.o_rows, p.dx_late = 1;
  p.x_late = x_over_o(c);
  if (bwd_dx_router_in_h(c)) p.dx_router = reinterpret_cast<float*>(p.sv.h_rows);
  p.h_late = h_in_dw13(c);
  if (p.h_late) {  // (h_in_dw13: h, then dx_router, at d_w13's front until WG13)
    p.sv.h_rows = static_cast<bf16*>(a->d_w13);
    p.dx_router = reinterpret_cast<float*>(static_cast<char*>(a->d_w13) + dw13_h_bytes(c));
  }
  p.partial_len = wp.partial_len;
  p.seg_partials = reinterpret_cast<float*>(ws + wp.seg_partials);
  p.seg_e0 = (int)El;
  if (seg_in_dw13(c)) {  // (the tail, 256-byte aligned; expert seg_e0's rows hold its first byte)
    const int64_t expert = dw13_bytes(c) / El, at = (dw13_bytes(c) - seg_bytes(c, c.T)) / 256 * 256;  // (expert: its rows)
    p.seg_partials = reinterpret_cast<float*>(static_cast<char*>(a->d_w13) + at);
    p.seg_e0 = (int)(at / expert);
  }
  p.cta_maps = reinterpret_cast<CUtensorMap*>(ws + wp.cta_maps);
  if (c.W > 1) {  // expert rows in the windows: peers write dy_rows and read o_rows, dx_rows
    GpuContext* g = gpu(ctx);
    p.peer_o_rows = g->peer_o_rows, p.peer_dy_rows = g->peer_dy_rows, p.peer_dx_rows = g->peer_dx_rows;
    p.o_kept = g->ret.o_kept[c.rank];
    p.px = g->px;
    p.dy_rows = g->peer_dy_rows.rows[c.rank];
    p.dx_rows = g->peer_dx_rows.rows[c.rank];
  } else {  // this rank owns every expert
    p.peer_o_rows.rows[0] = p.sv.o_rows;
    p.peer_dy_rows.rows[0] = p.dy_rows;
    p.peer_dx_rows.rows[0] = p.dx_rows;
  }
  p.partials = reinterpret_cast<float*>(ws + wp.partials);
  const void* dys = c.use_shared_gate ? p.dy_s : a->dy;
  const char* dys_name = c.use_shared_gate ? "dy_s" : "dy";
  const void* dlog = p.s.fused ? p.dlogits : nullptr;
  MAP_TRY(make_map(ctx, &p.m_dys, dys, T, H, dys_name));
  MAP_TRY(make_map(ctx, &p.m_x, a->x, T, H, "x"));
  MAP_TRY(make_chunk_map(ctx, &p.m_wr, p.s.fused ? a->w_router : nullptr, E, H, "w_router"));
  MAP_TRY(make_chunk_map(ctx, &p.m_w13, a->w13, El * 2 * F, H, "w13"));
  MAP_TRY(make_chunk_map(ctx, &p.m_w2, a->w2, El * H, F, "w2"));
  MAP_TRY(make_chunk_map(ctx, &p.m_dyrows, p.dy_rows, R, H, "dy_rows"));
  MAP_TRY(make_chunk_map(ctx, &p.m_xrows, p.sv.x_rows, R, H, "x_rows"));
  MAP_TRY(make_chunk_map(ctx, &p.m_hrows, p.sv.h_rows, R, F, "h_rows"));
  MAP_TRY(make_chunk_map(ctx, &p.m_da, p.d_a, R, 2 * F, "d_a"));
  MAP_TRY(make_map(ctx, &p.m_dlog, dlog, T, E, "dlogits", 64, p.s.Ep));
  MAP_TRY(make_chunk_map(ctx, &p.m_ws13, Fs ? a->ws13 : nullptr, 2 * Fs, H, "ws13"));
  MAP_TRY(make_chunk_map(ctx, &p.m_ws2, Fs ? a->ws2 : nullptr, H, Fs, "ws2"));
  MAP_TRY(make_map(ctx, &p.m_sh, Fs ? p.sv.sh : nullptr, T, Fs, "shared_h"));
  MAP_TRY(make_map(ctx, &p.m_das, Fs ? p.d_a_s : nullptr, T, 2 * Fs, "d_a_s"));
  MAP_TRY(make_map(ctx, &p.k_dys, Fs ? dys : nullptr, T, H, dys_name, kBwdBoxRows));
  MAP_TRY(make_map(ctx, &p.k_dyrows, p.dy_rows, R, H, "dy_rows", kBwdBoxRows));
  MAP_TRY(make_map(ctx, &p.k_dlog, dlog, T, E, "dlogits", kBwdBoxRows, p.s.Ep));
  MAP_TRY(make_map(ctx, &p.k_das, Fs ? p.d_a_s : nullptr, T, 2 * Fs, "d_a_s", kBwdBoxRows));
  MAP_TRY(make_map(ctx, &p.k_da, p.d_a, R, 2 * F, "d_a", kBwdBoxRows));
  MAP_TRY(make_map(ctx, &p.k_xrows, p.sv.x_rows, R, H, "x_rows", kBwdBoxRows));
  MAP_TRY(make_map(ctx, &p.k_w13, a->w13, El * 2 * F, H, "w13", kBwdBoxRows));
  MAP_TRY(make_map(ctx, &p.k_x, a->x, T, H, "x", kBwdBoxRows));
  MAP_TRY(make_map(ctx, &p.k_ws13, Fs ? a->ws13 : nullptr, 2 * Fs, H, "ws13", kBwdBoxRows));
  MAP_TRY(make_gate_up_map(ctx, &p.m_arows_gu, p.sv.a_rows, R, F, "a_rows", BM));
  MAP_TRY(make_gate_up_map(ctx, &p.m_sa_gu, Fs ? p.sv.sa : nullptr, T, Fs, "shared_a", BM));
  MAP_TRY(make_gate_up_store_map(ctx, &p.st_da, p.d_a, R, F, "d_a"));
  MAP_TRY(make_gate_up_store_map(ctx, &p.st_das, Fs ? p.d_a_s : nullptr, T, Fs, "d_a_s"));
  MAP_TRY(make_store_map(ctx, &p.st_dxrows, p.dx_rows, R, H, "dx_rows"));
  MAP_TRY(make_store_map(ctx, &p.st_dw13, p.wgrad_fp32 ? nullptr : a->d_w13, El * 2 * F, H, "d_w13"));
  MAP_TRY(make_store_map(ctx, &p.st_dw2, p.wgrad_fp32 ? nullptr : a->d_w2, El * H, F, "d_w2"));
  const bool redo = p.recompute;
  MAP_TRY(make_gate_up_store_map(ctx, &p.st_arows, redo ? p.sv.a_rows : nullptr, R, F, "a_rows"));
  MAP_TRY(make_store_map(ctx, &p.st_hrows, redo || p.h_late ? p.sv.h_rows : nullptr, R, F, "h_rows"));
  MAP_TRY(make_gate_up_store_map(ctx, &p.st_sa, redo && Fs ? p.sv.sa : nullptr, T, Fs, "shared_a"));
  MAP_TRY(make_store_map(ctx, &p.st_sh, redo && Fs ? p.sv.sh : nullptr, T, Fs, "shared_h"));
  p.dy = static_cast<const bf16*>(a->dy);
  p.d_aux = a->d_aux_loss;
  p.d_z = a->d_z_loss;
  p.dx = static_cast<bf16*>(a->dx);
  p.d_topk_weight = a->d_topk_weight;
  p.d_w_router = a->d_w_router;
  p.d_b_router = c.use_router_bias ? a->d_b_router : nullptr;
  p.d_w13 = a->d_w13;
  p.d_w2 = a->d_w2;
  p.b13 = c.use_expert_bias ? static_cast<const bf16*>(a->b13) : nullptr;
  p.d_b13 = c.use_expert_bias ? a->d_b13 : nullptr;
  p.d_b2 = c.use_expert_bias ? a->d_b2 : nullptr;
  p.d_ws13 = a->d_ws13;
  p.d_ws2 = a->d_ws2;
  p.x = c.use_shared_gate || p.x_late ? static_cast<const bf16*>(a->x) : nullptr;
  p.w_sg = c.use_shared_gate ? static_cast<const bf16*>(a->w_sg) : nullptr;
  p.d_w_sg = c.use_shared_gate ? a->d_w_sg : nullptr;
  cudaStream_t stream = static_cast<cudaStream_t>(a->stream);
  CUDA_TRY(ctx, launch(ctx, backward_kernel(c), p, backward_clustered(ctx), stream, kBwdThreads));
  gpu(ctx)->last_stream = stream;
  return MOK_STATUS_SUCCESS;
}
