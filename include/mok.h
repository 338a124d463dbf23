/*
 * mok.h — the one public header of mok, a deterministic mixture-of-experts (MoE)
 * training layer: router, top-K, dispatch, SwiGLU experts, weighted combine, forward
 * and backward, with bits that do not depend on threads, SMs or the number of ranks.
 *
 * Use, per rank (one context per GPU or per simulated CPU rank):
 *
 *   mok_config_t cfg = MOK_CONFIG_INIT;          // versioned defaults
 *   cfg.T = 4096; cfg.H = 2048; cfg.F = 768; cfg.E = 128; cfg.K = 8;
 *   mok_context_t* ctx;
 *   mok_context_create(&cfg, &ctx);              // allocates everything it will need
 *   size_t ws, sv;
 *   mok_workspace_size(ctx, &ws);                // scratch for one call (either kind;
 *                                                // mok_workspace_sizes: each kind's own)
 *   mok_saved_size(ctx, &sv);                    // what forward keeps for backward
 *   mok_forward_args_t f = {0};  ... fill tensors, f.num_tokens = T ...
 *   mok_forward(ctx, &f);                        // y, losses, tokens_per_expert, saved
 *   mok_backward_args_t b = {0}; ... dy, saved ...
 *   mok_backward(ctx, &b);                       // dx, weight gradients
 *   mok_context_destroy(ctx);
 *
 * Every call returns a mok_status_t; mok_status_string() names it and
 * mok_context_last_error() gives the message of the context's last failure (which
 * argument, which rule). A failing call leaves every output buffer untouched.
 * Nothing is allocated inside a step. The layer and its rounding points are described
 * in docs/ (and in the design brief): every sum has one fixed order.
 */
#ifndef MOK_H
#define MOK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MOK_API __attribute__((visibility("default")))
#else
#define MOK_API
#endif

#define MOK_VERSION_MAJOR 0
#define MOK_VERSION_MINOR 5
#define MOK_VERSION_PATCH 0
#define MOK_VERSION_CODE (MOK_VERSION_MAJOR * 10000 + MOK_VERSION_MINOR * 100 + MOK_VERSION_PATCH)

/* Tokens per fixed chunk of mok's replicated-gradient reduction (see mok_reduce_tree):
 * replicated gradients and global loss statistics are an fp32 partial per chunk of
 * this many tokens, combined by one fixed binary tree over the chunks. */
#define MOK_REDUCE_CHUNK_TOKENS 64

/* The longest wait for a peer (cfg.comm_timeout_s above it is taken as it): 10^9 s. */
#define MOK_MAX_TIMEOUT_S 1.0e9

/* The most CPU threads a context may use (cfg.num_threads). */
#define MOK_MAX_THREADS 1024

typedef enum {
  MOK_STATUS_SUCCESS = 0,
  MOK_STATUS_INVALID_CONTEXT,     /* null, destroyed or foreign context */
  MOK_STATUS_NULL_POINTER,        /* a required pointer is NULL */
  MOK_STATUS_MISALIGNED_POINTER,  /* a tensor or workspace pointer breaks its alignment rule */
  MOK_STATUS_INVALID_SHAPE,       /* a shape rule is broken (K > E, E % W, T > config T, ...) */
  MOK_STATUS_UNSUPPORTED_SHAPE,   /* valid, but the chosen backend does not run it */
  MOK_STATUS_INVALID_ARGUMENT,    /* an enum, rank or flag out of range */
  MOK_STATUS_NONFINITE_VALUE,     /* NaN or Inf where a finite coefficient is required */
  MOK_STATUS_VERSION_MISMATCH,    /* config struct from another version of mok.h */
  MOK_STATUS_INDEX_OUT_OF_RANGE,  /* replay topk_idx outside [0, E) */
  MOK_STATUS_DUPLICATE_INDEX,     /* replay topk_idx names one expert twice for a token */
  MOK_STATUS_WORKSPACE_TOO_SMALL, /* workspace or saved buffer smaller than reported */
  MOK_STATUS_INVALID_SAVED,       /* saved buffer not written by this context's forward */
  MOK_STATUS_CAPACITY_EXCEEDED,   /* a rank would receive more rows than its capacity */
  MOK_STATUS_COMM_TIMEOUT,        /* a peer did not arrive within the timeout */
  MOK_STATUS_COMM_ERROR,          /* communicator misuse or failure */
  MOK_STATUS_BACKEND_UNAVAILABLE, /* backend not built in, or no device */
  MOK_STATUS_OUT_OF_MEMORY,       /* allocation at context creation failed */
  MOK_STATUS_CUDA_ERROR,          /* a CUDA call failed (message has file:line) */
  MOK_STATUS_INTERNAL_ERROR,      /* a bug in mok: please report the message */
  MOK_STATUS_COUNT_
} mok_status_t;

typedef enum { MOK_BACKEND_CPU = 0, MOK_BACKEND_CUDA = 1 } mok_backend_t;
typedef enum { MOK_SCORE_SOFTMAX = 0, MOK_SCORE_SIGMOID = 1 } mok_score_t;
typedef enum {
  MOK_ROUTING_FUSED = 0,  /* router inside the layer: logits, scores, top-K, losses */
  MOK_ROUTING_REPLAY = 1  /* caller passes topk_idx / topk_weight; backward gives d_topk_weight */
} mok_routing_t;
/* Group-limited routing (cfg.n_group >= 1): what a group's score is. */
typedef enum {
  MOK_GROUP_SCORE_TOP2 = 0, /* the sum of its two largest selection keys (DeepSeek-V3) */
  MOK_GROUP_SCORE_MAX = 1   /* its largest selection key (DeepSeek-V2) */
} mok_group_score_t;
/* The routed experts' activation (cfg.activation; the shared expert's is always SwiGLU). */
typedef enum {
  MOK_ACTIVATION_SWIGLU = 0,        /* h = silu(gate) * up */
  MOK_ACTIVATION_SWIGLU_CLAMPED = 1 /* gpt-oss: gate and up clamped at cfg.swiglu_limit, h =
                                       (up' + 1) * gate' * sigmoid(cfg.swiglu_alpha * gate') */
} mok_activation_t;
typedef enum {
  MOK_WGRAD_BF16 = 0,       /* weight gradients written as bf16 (overwriting) */
  MOK_WGRAD_FP32_ACCUM = 1  /* weight gradients added into caller fp32 buffers */
} mok_wgrad_t;
typedef enum {
  MOK_NUMERICS_BF16 = 0,  /* the contract: bf16 tensors, fp32 accumulation, bf16 rounding points */
  MOK_NUMERICS_EXACT = 1  /* CPU only: every floating tensor is double, nothing is rounded;
                             for checking gradients against finite differences */
} mok_numerics_t;
typedef enum {
  MOK_CTA_PAIRS_AUTO = 0, /* where measured faster: the forward's GEMM tasks, not the
                             backward's (docs/PERF.md, 2026-12-06 third session) */
  MOK_CTA_PAIRS_OFF = 1,
  MOK_CTA_PAIRS_ON = 2    /* both kernels, whenever the grid is even and every pair fits at once */
} mok_cta_pairs_t;

typedef enum {
  MOK_GATE_UP_SAVE = 0,      /* forward keeps every expert row's gate|up and SwiGLU output
                                (routed and shared experts) in saved for backward */
  MOK_GATE_UP_RECOMPUTE = 1  /* backward recomputes them from the kept x rows with the
                                forward's blocks and rounding: the same bits, saved smaller by
                                6F bytes a routed row and 6Fs a token (bf16), the workspace
                                larger by at most as much (CUDA: by the forward's 6F or the
                                backward's 2F, whichever plan is larger, since the backward
                                writes gate|up where d_a goes) */
} mok_gate_up_t;

typedef enum {
  MOK_SAVED_KEEP = 0,  /* backward only reads saved: it may run again on the same forward */
  MOK_SAVED_REUSE = 1  /* backward writes its own scratch over parts of saved it has read
                          (d_a over the kept gate|up; with W = 1 the gradient rows dy_j,
                          then dx_j, over the expert outputs o, and the router path's
                          fp32 dx over h), so the workspace is smaller by up to 4H + 4F
                          bytes a routed row and 4H + 4Fs a token; with W = 1 and gate|up
                          kept the forward also writes o over the dispatched x rows (the
                          backward puts them back), saved 2H bytes a routed row smaller,
                          and with MOK_WGRAD_BF16 (CUDA) keeps no h either: 2F bytes a
                          routed row less (mok_workspace_sizes); the same bits. saved is
                          then used up: a second backward on it returns
                          MOK_STATUS_INVALID_SAVED */
} mok_saved_use_t;

typedef struct mok_cpu_comm mok_cpu_comm_t; /* in-process communicator for W CPU ranks */
typedef struct mok_context mok_context_t;

typedef struct {
  size_t struct_size;  /* sizeof(mok_config_t), set by MOK_CONFIG_INIT */
  int version;         /* MOK_VERSION_CODE, set by MOK_CONFIG_INIT */
  /* shape */
  int64_t T;           /* max tokens per call on this rank (a call may pass fewer; 0 allowed) */
  int64_t H;           /* hidden size */
  int64_t F;           /* expert ffn size */
  int64_t E;           /* experts in all, 1 <= E <= 1024 */
  int64_t K;           /* experts per token, 1 <= K <= E */
  int W;               /* expert-parallel ranks; E % W == 0 */
  int rank;            /* this rank, 0 <= rank < W; owns experts rank*E/W .. */
  /* router */
  mok_routing_t routing;
  mok_score_t score;
  int normalize;       /* divide the K weights by their sum (before route_scale) */
  float route_scale;   /* multiplies the weights */
  int use_bias_select; /* bias_select [E] fp32 is added to scores for selection only */
  float aux_loss_coef; /* alpha of the load-balancing loss; 0 disables it */
  float z_loss_coef;   /* beta of the router z-loss; 0 disables it */
  /* group-limited routing (DeepSeek-V3: n_group 8, topk_group 4; fused routing, both
   * backends, the same choice and bits).
   * The E experts form n_group groups of E / n_group consecutive experts (group i:
   * experts i E/n_group ..). Per token, from the selection keys key[e] = s[e] +
   * bias_select[e] (fp32: the same rounding as for the top-K; s[e] without bias_select):
   *   group score = key1 + key2, the group's two largest keys, one fp32 addition
   *     (MOK_GROUP_SCORE_TOP2; a group of one expert: key1), or key1 (MOK_GROUP_SCORE_MAX);
   *     "largest" in the top-K's order: larger first, ties to the lower index, NaN last;
   *   the topk_group groups with the largest scores are kept (ties to the lower group
   *     index, NaN last);
   *   the K experts are chosen among the kept groups' experts exactly as without groups
   *     (same keys, same order, same ties); the weights are their scores s, so with
   *     bias_select this is DeepSeek-V3's router (aux-loss-free balancing).
   * The choice is piecewise constant: no gradient flows through it; the weights' and
   * losses' gradients are those of the ordinary top-K of the chosen experts.
   * n_group 0: no grouping (topk_group must be 0); n_group 1 is the same routing.
   * Rules: n_group >= 0 dividing E; 1 <= topk_group <= n_group; K <= topk_group *
   * (E / n_group); fused routing only (MOK_STATUS_INVALID_SHAPE, the routing rule
   * MOK_STATUS_INVALID_ARGUMENT). */
  int n_group;
  int topk_group;
  mok_group_score_t group_score;
  /* router logit bias (gpt-oss): args->b_router [E] fp32 is added to the logits before
   * the scores, logits[t, e] = x[t]·w_router[e] + b_router[e] (the dot product's fp32
   * sum, then one fp32 addition), so it changes both the choice and the weights, and the
   * z-loss sees the biased logits. Its gradient d_b_router[e] = sum over tokens of
   * dlogits[t, e] (the bf16 dlogits that d_w_router uses, fp32 sums) is a replicated
   * one: an fp32 partial per chunk of MOK_REDUCE_CHUNK_TOKENS tokens (increasing t),
   * combined by mok's fixed tree over all ranks, like d_w_router. It is fp32 like the
   * parameter: written with MOK_WGRAD_BF16, added into with MOK_WGRAD_FP32_ACCUM. Fused
   * routing only (else MOK_STATUS_INVALID_ARGUMENT); both backends. 0 = off. */
  int use_router_bias;
  /* expert biases (gpt-oss): args->b13 [E/W, 2F] and b2 [E/W, H], bf16 like the weights
   * they follow, are added in fp32 before the bf16 rounding of the routed experts' a and o:
   *   a = bf16((x·w13[e]^T) + b13[e]), o = bf16((h·w2[e]^T) + b2[e])
   * (each the dot product's fp32 sum, then one fp32 addition). Their gradients are
   * d_b13[e] = sum over the expert's rows of d_a, d_b2[e] = sum over them of dy_j (the
   * bf16 rows that dw13 and dw2 use), fp32 sums over the rows in global token order (the
   * order of the weight gradients' sums), written or added into per cfg.wgrad like
   * d_w13 and d_w2: on the CPU one sum a column from +0 in row order, on CUDA 16
   * interleaved sums (rows j, j + 16, ... from +0) added in j order, each fixed by the
   * expert's rows alone (the same bits at every W). The shared expert has none. Both
   * backends. 0 = off. */
  int use_expert_bias;
  /* the clamped SwiGLU of gpt-oss (cfg.activation = MOK_ACTIVATION_SWIGLU_CLAMPED; gpt-oss:
   * swiglu_alpha 1.702, swiglu_limit 7), for the routed experts (the shared expert keeps
   * the plain SwiGLU). From the bf16 gate and up of a, in fp32 (limit, alpha: the floats
   * of the config):
   *   gate' = min(gate, limit), up' = clamp(up, -limit, limit) (NaN stays NaN),
   *   s = sigmoid(alpha * gate'), h = bf16((up' + 1) * (gate' * s)),
   * in that order of operations. Backward, in fp32 from the same gate and up, then
   * rounded to bf16 (d_a): d_gate = dh (up' + 1) (s + alpha gate' s (1 - s)), zero where
   * gate > limit; d_up = dh gate' s, zero where up > limit or up < -limit (a clamp at
   * its bound passes the gradient, as torch.clamp does). Rules with the clamped SwiGLU:
   * swiglu_alpha and swiglu_limit finite (else MOK_STATUS_NONFINITE_VALUE) and > 0 (else
   * MOK_STATUS_INVALID_ARGUMENT); with MOK_ACTIVATION_SWIGLU both must be 0 (else
   * MOK_STATUS_INVALID_ARGUMENT: set cfg.activation). Both backends (CUDA: a kernel pair
   * of its own, the same launches). */
  mok_activation_t activation;
  float swiglu_alpha;
  float swiglu_limit;
  /* shared expert, applied to every token; Fs = 0 means none */
  int64_t Fs;
  /* the gated shared expert (Qwen2-MoE): the shared expert's output o_s = bf16(h_s ws2^T)
   * is scaled per token by s_g[t] = sigmoid(x[t]·w_sg), args->w_sg [H] bf16 a replicated
   * parameter. Rounding points: the dot product's fp32 sum (increasing h, from +0) is not
   * rounded, s_g is fp32, and y[t] adds s_g[t] * o_s[t] (one fp32 product) where it
   * adds o_s without the gate. Backward: dy_s = bf16(s_g dy) replaces dy in the shared
   * expert (dh_s, d_ws2), d s_g = dy[t]·o_s[t] (fp32 sum over increasing h, o_s again
   * from h_s), dl_g = bf16(d s_g s_g (1 - s_g)); dx[t] adds dl_g w_sg[h] (one fp32
   * product) after the shared expert's d_a_s·ws13; d_w_sg = sum over tokens of dl_g x[t]
   * (fp32), a replicated gradient through mok's fixed tree like d_w_router, written or
   * added into per cfg.wgrad. Needs Fs > 0 (else MOK_STATUS_INVALID_ARGUMENT). Both
   * backends; the CUDA kernels sum the two dot products in a warp (a lane's 8-element
   * chunks h = 8 (lane + 32 u) .. in increasing u, then a fixed butterfly), keep o_s in
   * the saved buffer (T (4 + 2H) bytes more) and sum d_w_sg over 64-token chunks in
   * increasing t, then the tree: the same bits at every W and batch (D3, D4), agreeing
   * with the CPU to fp32 rounding of those sums. 0 = off. */
  int use_shared_gate;
  /* outputs and execution */
  mok_wgrad_t wgrad;
  mok_numerics_t numerics;
  mok_backend_t backend;
  int64_t capacity;    /* rows this rank can receive; 0 = safe default. At most the rows that can
                          ever arrive, (sum of every rank's cfg.T) * min(K, E / W), which is
                          also the default; above it: MOK_STATUS_INVALID_SHAPE */
  int num_threads;     /* CPU threads of this context, at most MOK_MAX_THREADS; 0 = all cores */
  double comm_timeout_s; /* bound on every wait for a peer; 0 = default (5 s); values above
                            MOK_MAX_TIMEOUT_S wait that long */
  mok_cpu_comm_t* cpu_comm; /* CPU backend with W > 1: the shared in-process communicator */
  int num_ctas;        /* CUDA: persistent CTAs per launch; 0 = one per SM (bits do not depend on it) */
  mok_cta_pairs_t cta_pairs; /* CUDA: CTAs in clusters of 2 whose GEMM tasks on the same weight
                                tile load half of it each, multicast to both (bits do not
                                depend on it) */
  const void* comm_unique_id; /* CUDA backend with W > 1: MOK_COMM_UNIQUE_ID_BYTES from
                                 mok_comm_unique_id on one rank, the same bytes on every rank
                                 (which also need the same T and capacity: the exchange
                                 windows are symmetric) */
  mok_gate_up_t gate_up;     /* keep gate|up for backward, or recompute it there */
  mok_saved_use_t saved_use; /* backward leaves saved as it is, or reuses it as scratch */
} mok_config_t;

#define MOK_CONFIG_INIT                                                              \
  {                                                                                  \
    sizeof(mok_config_t), MOK_VERSION_CODE, 0, 0, 0, 0, 0, 1, 0, MOK_ROUTING_FUSED,  \
        MOK_SCORE_SOFTMAX, 1, 1.0f, 0, 0.0f, 0.0f, 0, 0, MOK_GROUP_SCORE_TOP2, 0, 0, \
        MOK_ACTIVATION_SWIGLU, 0.0f, 0.0f, 0, 0, MOK_WGRAD_BF16, MOK_NUMERICS_BF16,  \
        MOK_BACKEND_CPU, 0, 0, 0.0, NULL, 0, MOK_CTA_PAIRS_AUTO, NULL,               \
        MOK_GATE_UP_SAVE, MOK_SAVED_KEEP                                             \
  }

/* Tensors of one forward call. bf16 tensors are uint16_t bit patterns (double in
 * EXACT numerics, where "fp32" tensors are double too). Pointers are host pointers for
 * the CPU backend, device pointers for CUDA; all 16-byte aligned, rows contiguous. */
typedef struct {
  int64_t num_tokens;        /* T of this call, 0 <= T <= config T. T = 0 with W = 1 gives
                                what an empty batch gives: tokens_per_expert, aux_loss and
                                z_loss (those given) are written as zeros, nothing else is
                                written, saved included */
  const void* x;             /* [T, H] bf16 */
  const void* w_router;      /* [E, H] bf16, fused routing */
  const float* bias_select;  /* [E] fp32, when use_bias_select */
  const float* b_router;     /* [E] fp32 router logit bias, when use_router_bias */
  const void* w13;           /* [E/W, 2F, H] bf16: rows 0..F-1 gate, F..2F-1 up */
  const void* w2;            /* [E/W, H, F] bf16 */
  const void* b13;           /* [E/W, 2F] bf16 expert bias of a, when use_expert_bias */
  const void* b2;            /* [E/W, H] bf16 expert bias of o, when use_expert_bias */
  const void* ws13;          /* [2Fs, H] bf16, when Fs > 0 */
  const void* ws2;           /* [H, Fs] bf16, when Fs > 0 */
  const void* w_sg;          /* [H] bf16 shared-expert gate, when use_shared_gate */
  int32_t* topk_idx;         /* [T, K] int32: replay input; fused: written if not NULL */
  float* topk_weight;        /* [T, K] fp32: replay input; fused: written if not NULL */
  void* y;                   /* [T, H] bf16 out */
  int32_t* tokens_per_expert;/* [E] int32 out, global over ranks; optional */
  float* aux_loss;           /* [1] fp32 out, global; optional */
  float* z_loss;             /* [1] fp32 out, global; optional */
  void* saved;               /* mok_saved_size() bytes: kept for backward */
  size_t saved_bytes;
  void* workspace;           /* mok_workspace_sizes()' forward_bytes (or more), 256-byte aligned */
  size_t workspace_bytes;
  void* stream;              /* cudaStream_t for CUDA; ignored by CPU */
} mok_forward_args_t;

typedef struct {
  int64_t num_tokens;        /* same T as the forward that wrote saved (else
                                MOK_STATUS_INVALID_SAVED). T = 0 with W = 1: saved is not
                                read, and the weight gradients of no tokens are zero: bf16
                                ones (MOK_WGRAD_BF16) written as zeros, fp32 ones
                                (MOK_WGRAD_FP32_ACCUM) left as they are */
  const void* x;             /* [T, H] bf16, the forward's input */
  const void* w_router;      /* [E, H] bf16 */
  const void* w13;           /* [E/W, 2F, H] bf16 */
  const void* w2;            /* [E/W, H, F] bf16 */
  const void* b13;           /* [E/W, 2F] bf16, when use_expert_bias (gate|up is recomputed
                                from it under MOK_GATE_UP_RECOMPUTE) */
  const void* ws13;          /* [2Fs, H] bf16 */
  const void* ws2;           /* [H, Fs] bf16 */
  const void* w_sg;          /* [H] bf16, when use_shared_gate */
  const void* dy;            /* [T, H] bf16, gradient of y */
  const float* d_aux_loss;   /* [1] gradient of aux_loss; NULL means 1 */
  const float* d_z_loss;     /* [1] gradient of z_loss; NULL means 1 */
  const void* saved;         /* written by mok_forward on this context (and by this call
                                when cfg.saved_use = MOK_SAVED_REUSE). Checked before use:
                                its header names the writing context by a serial that is
                                never reused in the process, the forward and the shape; the
                                CPU backend also checks every index it holds (counts,
                                experts, row positions) against the forward's layout, the
                                CUDA backend every index that decides an address. A saved
                                buffer that fails gives MOK_STATUS_INVALID_SAVED (CUDA: at
                                mok_context_sync) and no output is written (with W > 1 on
                                every rank) */
  size_t saved_bytes;
  void* dx;                  /* [T, H] bf16 out */
  float* d_topk_weight;      /* [T, K] fp32 out, replay routing */
  /* weight gradients: bf16 written, or fp32 buffers added into (config wgrad) */
  void* d_w_router;          /* [E, H], summed over ranks by mok's fixed tree */
  float* d_b_router;         /* [E] fp32 (use_router_bias), summed over ranks by mok's fixed
                                tree; fp32 whatever cfg.wgrad: written, or added into with
                                MOK_WGRAD_FP32_ACCUM; optional, as d_w_router */
  void* d_w13;               /* [E/W, 2F, H] (CUDA, mok_workspace_sizes: may hold the
                                backward's scratch before its gradient is written) */
  void* d_w2;                /* [E/W, H, F] */
  void* d_b13;               /* [E/W, 2F] (use_expert_bias), as d_w13: bf16 written or fp32 added into */
  void* d_b2;                /* [E/W, H] (use_expert_bias), as d_w2 */
  void* d_ws13;              /* [2Fs, H], summed over ranks by mok's fixed tree */
  void* d_ws2;               /* [H, Fs], summed over ranks by mok's fixed tree */
  void* d_w_sg;              /* [H] (use_shared_gate), summed over ranks by mok's fixed tree */
  void* workspace;           /* mok_workspace_sizes()' backward_bytes (or more), 256-byte aligned */
  size_t workspace_bytes;
  void* stream;
} mok_backward_args_t;

MOK_API const char* mok_status_string(mok_status_t status);
MOK_API int mok_version(void); /* MOK_VERSION_CODE of the library */

/* GPUs (CUDA backend, W > 1; docs/DISTRIBUTED.md): the W ranks' NCCL communicator is
 * created from one unique id, made by one rank and shared with the others. Needs
 * libnccl.so.2 (2.28 or newer) at run time, loaded on first use. On failure the message
 * is mok_last_create_error(). */
#define MOK_COMM_UNIQUE_ID_BYTES 128
MOK_API mok_status_t mok_comm_unique_id(void* id, size_t size);
/* An id for W ranks of one process on one GPU, for testing expert parallelism where one
 * GPU is lent: every rank's context on the device current at its create, its windows in
 * that GPU's memory, the peers' addresses handed out in process (no NCCL is loaded), so
 * the kernels run the same exchange protocol through the same peer table as across GPUs;
 * only NVLink is not crossed, and speed means nothing. The W ranks' launches must be
 * resident at once: a context takes cfg.num_ctas = SMs / W by default (larger:
 * MOK_STATUS_INVALID_ARGUMENT) and no CTA pairs; each rank's stream must wait for no
 * other rank's (cudaStreamNonBlocking, never the legacy default stream), and the
 * process needs a hardware queue per rank's stream (CUDA_DEVICE_MAX_CONNECTIONS=32 in
 * the environment before CUDA starts: with the default 8, two ranks' streams can share
 * a queue, and one rank's kernel then waits behind another's until comm_timeout_s). */
MOK_API mok_status_t mok_comm_loopback_id(void* id, size_t size);

/* In-process communicator for W CPU ranks of one process (one thread per rank). */
MOK_API mok_status_t mok_cpu_comm_create(int num_ranks, mok_cpu_comm_t** comm);
MOK_API mok_status_t mok_cpu_comm_destroy(mok_cpu_comm_t* comm);

/* Validates cfg and allocates the context. With W > 1 the W ranks' creates are
 * collective: call them concurrently, one thread per rank. On failure *ctx is NULL and
 * mok_last_create_error() holds the message. CUDA: the context belongs to the calling
 * thread's current device; later calls may come from any thread (each makes that device
 * current for its length and restores the caller's). */
MOK_API mok_status_t mok_context_create(const mok_config_t* cfg, mok_context_t** ctx);
/* With W > 1 destroy is collective too (peers may still read this rank's buffers);
 * its wait is bounded by the timeout, so a context whose peers died still goes. */
MOK_API mok_status_t mok_context_destroy(mok_context_t* ctx);
MOK_API const char* mok_context_last_error(const mok_context_t* ctx);
MOK_API const char* mok_last_create_error(void); /* this thread's last failed create or unique id */

/* The workspace a call needs: mok_workspace_size the most either call needs (one buffer
 * kept for both), mok_workspace_sizes each call's own. A forward's args->workspace_bytes
 * must reach forward_bytes, a backward's backward_bytes. CUDA, MOK_SAVED_REUSE with
 * gate|up kept, W = 1, MOK_WGRAD_BF16: the forward's workspace holds the SwiGLU output h
 * (F bytes a routed row), which saved then does not, and the backward writes its h and
 * the router path's fp32 dx into d_w13 before the weight gradient itself (where they fit:
 * 2 T K F + 4 T H <= E 4F H bytes). CUDA, W = 1, MOK_WGRAD_BF16: the fp32 nodes of the
 * router's and shared expert's weight-gradient tree go at d_w13's end, not the backward's
 * workspace, where they fit behind those. Allocated for each call, the two give a lower
 * peak than one buffer of the larger. */
MOK_API mok_status_t mok_workspace_size(const mok_context_t* ctx, size_t* bytes);
MOK_API mok_status_t mok_workspace_sizes(const mok_context_t* ctx, size_t* forward_bytes, size_t* backward_bytes);
MOK_API mok_status_t mok_saved_size(const mok_context_t* ctx, size_t* bytes);

/* With W > 1, every rank calls the same sequence of forward/backward concurrently. */
MOK_API mok_status_t mok_forward(mok_context_t* ctx, const mok_forward_args_t* args);
MOK_API mok_status_t mok_backward(mok_context_t* ctx, const mok_backward_args_t* args);

/* CUDA: forward and backward only enqueue work on args->stream and return; an error
 * the kernel meets (a bounded wait that timed out, replay indices out of range, a saved
 * buffer from elsewhere) is returned here, after waiting for the context's last launch:
 * the first such error since the previous mok_context_sync. A step that meets one
 * stops before it writes its outputs (y, dx: backward may have written weight gradients).
 * CPU: returns MOK_STATUS_SUCCESS at once (its calls are synchronous). */
MOK_API mok_status_t mok_context_sync(mok_context_t* ctx);

/* mok's fixed-order reduction, for any replicated parameter's gradient.
 * partials: [num_chunks, n] fp32, one partial per chunk (chunks in global order);
 * out: [n] = the sum over chunks by the balanced binary tree fixed by num_chunks
 * (node [lo, hi) = node [lo, mid) + node [mid, hi), mid = lo + the largest power of two
 * below hi - lo: the pairwise tree, level l+1 node i = level l nodes 2i + 2i+1).
 * Summing a contiguous run of chunks per rank and combining the ranks' subtrees by the
 * same tree gives the same bits (docs/CPU.md, "Numerics"). */
MOK_API mok_status_t mok_reduce_tree(const float* partials, int64_t num_chunks, int64_t n, float* out);

#ifdef __cplusplus
}
#endif
#endif /* MOK_H */
