/* internal.h — what the host library shares between its files: the context, the error
 * path (a status plus a message with file:line, stored per context), bf16 conversion,
 * and the plan of the saved buffer and the workspace. Not installed. */
#ifndef MOK_INTERNAL_H
#define MOK_INTERNAL_H
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOK_ERROR_LEN 512
#define MOK_MAX_RANKS 64
#define MOK_CUDA_MAX_RANKS 8 /* the CUDA backend's W bound (kMaxPeers in cuda/gpu_params.h) */
#define MOK_MAX_EXPERTS 1024
#define MOK_ALIGN_TENSOR 16
#define MOK_ALIGN_WORKSPACE 256
#define MOK_MAX_BUFFER_BYTES ((size_t)1 << 48) /* any one plan or buffer of a context */

struct mok_context {
  uint64_t magic;          /* MOK_CONTEXT_MAGIC while alive */
  mok_config_t cfg;        /* validated copy; capacity and num_threads resolved */
  int64_t E_loc;           /* experts of this rank, E / W */
  int64_t T_all[MOK_MAX_RANKS]; /* config T of every rank (exchanged at create) */
  int64_t act_size;        /* bytes of a bf16 tensor element: 2, or 8 in EXACT numerics */
  int64_t real_size;       /* bytes of an fp32 element: 4, or 8 in EXACT numerics */
  /* CPU backend: the rank's exchange buffers, reached by peers through comm (the
   * caller's cpu_comm, or a one-rank communicator of its own when W = 1) */
  mok_cpu_comm_t* comm;
  int owns_comm;
  void* recv_rows;         /* [capacity, H] act: rows sent to this rank's experts */
  void* ret_rows;          /* [capacity, H] act: expert results, read back by token ranks */
  void* pack;              /* GEMM packing scratch, mok_gemm_pack_bytes() per thread */
  void* gpu;               /* CUDA backend state (src/cuda/cuda_backend.cu), or NULL */
  uint64_t serial;         /* process-unique, never reused (mok_context_create's counter):
                              ties a saved buffer to this context, whatever its address */
  uint64_t forward_serial; /* counts forwards; written into saved, which a backward checks */
  char last_error[MOK_ERROR_LEN];
};
#define MOK_CONTEXT_MAGIC 0x6d6f6b2d63747821ull

/* The most rows a rank can ever receive in a step: every token of every rank (T_all:
 * each rank's cfg.T) sends min(K, E / W) rows to one owner. cfg.capacity's bound and its
 * default (mok.h). */
static inline int64_t mok_capacity_max(const mok_config_t* c, const int64_t* T_all) {
  int64_t T_global = 0;
  for (int r = 0; r < c->W; r++) T_global += T_all[r];
  const int64_t E_loc = c->E / c->W;
  return T_global * (c->K < E_loc ? c->K : E_loc);
}

/* Records a status and message (with file:line) in ctx and returns the status. */
mok_status_t mok_error_at(mok_context_t* ctx, mok_status_t s, const char* file, int line,
                          const char* fmt, ...) __attribute__((format(printf, 5, 6)));
#define MOK_ERR(ctx, status, ...) mok_error_at((ctx), (status), __FILE__, __LINE__, __VA_ARGS__)

/* bf16 <-> fp32, round to nearest even; NaN stays NaN (quiet). */
static inline float mok_bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t mok_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* ---- plan: byte layout of the saved buffer and the workspace (per call T_max) ----
 * saved (written by forward, read by backward), offsets from the buffer start:
 *   header            mok_saved_header_t
 *   counts_all        [W, E] int32   every rank's per-expert counts of the step
 *   topk_idx          [T, K] int32
 *   slot_pos          [T, K] int32   row of slot (t, j) in its owner's receive buffer
 *   topk_weight       [T, K] real    final weights g
 *   logits            [T, E] real    fused routing
 *   o_slots           [T, K, H] act  expert outputs of this rank's slots
 *   shared_a          [T, 2Fs] act   shared expert gate|up
 *   shared_h          [T, Fs] act
 *   x_rows            [capacity, H] act   rows this rank's experts received
 *   a_rows            [capacity, 2F] act  their gate|up
 *   h_rows            [capacity, F] act   their SwiGLU output
 * every piece 256-byte aligned. With cfg.gate_up = MOK_GATE_UP_RECOMPUTE, shared_a,
 * shared_h, a_rows and h_rows are empty here and live in the workspace instead. */
typedef struct {
  uint64_t magic;          /* MOK_SAVED_MAGIC (MOK_SAVED_USED once a reusing backward ran) */
  uint64_t context_serial; /* serial of the writing context (never reused in a process) */
  uint64_t serial;         /* forward_serial of the writing forward */
  int64_t T;               /* num_tokens of that forward */
  int64_t shape[8];        /* the writing context's cfg T, H, F, E, K, Fs, W, rank */
  int64_t T_all[MOK_MAX_RANKS]; /* num_tokens of every rank in that step */
} mok_saved_header_t;
#define MOK_SAVED_MAGIC 0x6d6f6b2d73617664ull
#define MOK_SAVED_USED 0x6d6f6b2d75736564ull /* magic after a MOK_SAVED_REUSE backward */

typedef struct {
  size_t counts_all, topk_idx, slot_pos, topk_weight, logits, o_slots, shared_a, shared_h,
      x_rows, a_rows, h_rows, total;
  int overflow;          /* a size did not fit in size_t: the plan is void */
} mok_saved_plan_t;

/* workspace (scratch of one call), offsets from the workspace start:
 *   route             [T, E] real logits, [T, K] int32 idx, [T, K] real weights,
 *                     [T, K] int32 slot_pos, [E] int32 counts (fused scratch before the
 *                     capacity check, so that a failing step writes nothing)
 *   gemm_out          [MOK_ROW_BLOCK, max(2F, H, 2Fs)] real, or [max(2F*H, 2Fs*H), 1]
 *   d_a               [max(capacity, T), max(2F, 2Fs)] act
 *   tok               [T, H] real   router/shared contributions to dx, or stats scratch
 *   dlogits           [T, E] act
 *   dg                [T, K] real
 *   tree              [tree_vectors, tree_len] real  nodes of the fixed reduction tree
 *   shared_a, shared_h, a_rows, h_rows   as in saved, with MOK_GATE_UP_RECOMPUTE only:
 *                     forward computes them here, backward computes them again
 *   shared_dy         [T, H] act   dy_s = bf16(s_g dy), with use_shared_gate only
 *   shared_dl         [T] act      dl_g, the gate logit's gradient, likewise */
typedef struct {
  size_t logits, idx, weight, slot_pos, counts, gemm_out, d_a, tok, dlogits, dg, tree, shared_a, shared_h,
      a_rows, h_rows, shared_dy, shared_dl, total;
  int64_t tree_len;      /* longest vector reduced by the tree */
  int64_t tree_vectors;  /* node buffers the tree needs */
  int overflow;          /* a size did not fit in size_t: the plan is void */
} mok_workspace_plan_t;

#define MOK_ROW_BLOCK 512 /* rows per expert GEMM call on the CPU (bounds the scratch) */

void mok_plan_saved(const mok_context_t* ctx, int64_t T, mok_saved_plan_t* p);
void mok_plan_workspace(const mok_context_t* ctx, int64_t T, mok_workspace_plan_t* p);
int64_t mok_tree_depth(int64_t num_chunks); /* levels of the fixed tree, leaves included */



/* The fixed reduction tree: node [lo, hi) of chunks (hi - lo >= 2) splits after the
 * largest power of two below hi - lo. This is the pairwise tree built level by level
 * (level l+1 node i = level l nodes 2i + 2i+1, a lone last node passed up), so a GPU
 * can evaluate it in place without a stack. Used by mok_reduce_tree and the backends. */
static inline int64_t mok_tree_mid(int64_t lo, int64_t hi) {
  int64_t half = 1;
  while (2 * half < hi - lo) half *= 2;
  return lo + half;
}

/* Backend entry points (arguments validated by api.c). */
mok_status_t mok_cpu_forward(mok_context_t* ctx, const mok_forward_args_t* a);
mok_status_t mok_cpu_backward(mok_context_t* ctx, const mok_backward_args_t* a);
/* saved.c: the header a forward writes, and a backward's check of a saved buffer
 * (MOK_STATUS_INVALID_SAVED; collective with W > 1: every rank gets the same verdict). */
void mok_saved_header_write(mok_context_t* ctx, mok_saved_header_t* h, int64_t T, const int64_t* T_all);
mok_status_t mok_cpu_saved_check(mok_context_t* ctx, const mok_backward_args_t* a);
#ifdef __cplusplus
}
#endif
#endif
