/* problem.h — a random MoE problem of one global batch, run on W ranks of the CPU
 * backend (one thread and one context per rank) or on one rank: what `mok check`,
 * `mok bench` and the tests drive the library with.
 *
 * All tensors here are global and host-side; a run copies each rank's slice into its
 * own aligned buffers (rank-major token split: rank r gets tokens
 * [r*T/W + min(r, T%W) ...), or mok_run_opts_t.rank_T's counts in rank order; experts
 * r*E/W ..), runs the steps, and gathers the results
 * back into the global outputs. bf16 tensors are uint16_t, fp32 tensors float; in
 * EXACT numerics every floating tensor is double. */
#ifndef MOK_TOOLS_PROBLEM_H
#define MOK_TOOLS_PROBLEM_H
#include <stddef.h>
#include <stdint.h>

#include "mok.h"

typedef struct {
  mok_config_t cfg;   /* the layer; T, W, rank and cpu_comm are set per run */
  int64_t T_global;   /* tokens over all ranks */
  uint64_t seed;
  size_t act, real;   /* element bytes: 2 and 4, or 8 and 8 in EXACT numerics */
  /* inputs, drawn from seed (weights ~ U(-1/sqrt(in), 1/sqrt(in)), x and dy ~ U(-1, 1)) */
  void* x;            /* [T_global, H] */
  void* w_router;     /* [E, H] */
  void* bias_select;  /* [E] real */
  void* b_router;     /* [E] real, the router logit bias (cfg.use_router_bias), ~ U(-0.5, 0.5) */
  void* w13;          /* [E, 2F, H] */
  void* w2;           /* [E, H, F] */
  void* b13;          /* [E, 2F] the expert biases (cfg.use_expert_bias), ~ U(-0.5, 0.5) */
  void* b2;           /* [E, H] */
  void* ws13;         /* [2Fs, H] */
  void* ws2;          /* [H, Fs] */
  void* w_sg;         /* [H] the shared-expert gate (cfg.use_shared_gate) */
  void* dy;           /* [T_global, H] */
  int32_t* topk_idx;  /* [T_global, K] replay input (distinct experts per token) */
  void* topk_weight;  /* [T_global, K] real, replay input */
  void* d_aux_loss;   /* [1] real, gradient of aux_loss fed to backward */
  void* d_z_loss;     /* [1] real */
  /* outputs of the last run */
  void* y;            /* [T_global, H] */
  void* dx;           /* [T_global, H] */
  int32_t* out_topk_idx;   /* [T_global, K] (fused routing) */
  void* out_topk_weight;   /* [T_global, K] real */
  void* d_topk_weight;     /* [T_global, K] real (replay routing) */
  int32_t* tokens_per_expert; /* [E] */
  void* aux_loss;     /* [1] real */
  void* z_loss;       /* [1] real */
  void* d_w_router;   /* [E, H] wgrad dtype (bf16/act, or fp32 accumulators) */
  void* d_b_router;   /* [E] real (use_router_bias), whatever the wgrad dtype */
  void* d_w13;        /* [E, 2F, H] */
  void* d_w2;         /* [E, H, F] */
  void* d_b13;        /* [E, 2F] wgrad dtype (use_expert_bias) */
  void* d_b2;         /* [E, H] */
  void* d_ws13;       /* [2Fs, H] */
  void* d_ws2;        /* [H, Fs] */
  void* d_w_sg;       /* [H] wgrad dtype (use_shared_gate) */
  size_t wgrad_elem;  /* bytes per weight-gradient element */
  double seconds_forward, seconds_backward; /* time of the last step, slowest rank */
  mok_status_t rank_status[8]; /* the last CUDA run's status of each rank (a silent or
                                  skipped rank: MOK_STATUS_SUCCESS) */
} mok_problem_t;

/* Allocates and fills a problem; cfg gives the layer (its T, W, rank are ignored). */
mok_status_t mok_problem_create(const mok_config_t* cfg, int64_t T_global, uint64_t seed,
                                mok_problem_t** out);
void mok_problem_destroy(mok_problem_t* p);
/* The weights of src in dst, a problem of the same layer and numerics (any T_global):
 * w_router, bias_select, w13, w2, ws13, ws2 and the variants' tensors (b_router, b13,
 * b2, w_sg); x, dy and the replay inputs stay dst's own. */
void mok_problem_copy_weights(mok_problem_t* dst, const mok_problem_t* src);
/* Element count and pointer of a named tensor ("y", "dx", "d_w13", ...) for comparisons. */
typedef struct {
  const char* name;
  const void* data;
  int64_t count;
  size_t elem;   /* bytes per element */
  int kind;      /* 0 bf16, 1 fp32, 2 double, 3 int32 */
} mok_tensor_view_t;
/* Outputs of the last run that the config produces (at most MOK_PROBLEM_MAX_OUTPUTS);
 * returns how many were written. */
#define MOK_PROBLEM_MAX_OUTPUTS 20
int mok_problem_outputs(const mok_problem_t* p, int with_backward, mok_tensor_view_t* views,
                        int max_views);

typedef struct {
  int W;              /* ranks */
  int steps;          /* forward (+ backward) steps on the same contexts; outputs are the last */
  int backward;       /* run backward too */
  int num_threads;    /* per context; 0 = library default */
  int64_t capacity;   /* config capacity per rank; 0 = default */
  double comm_timeout_s;
  int skip_rank;      /* a rank that never creates its context nor calls (fault test), or -1 */
  int num_ctas;       /* CUDA: persistent CTAs, 0 = one per SM */
  int graph;          /* CUDA: capture one forward + backward step in a CUDA graph and replay it */
  int cta_pairs;      /* CUDA: cfg.cta_pairs (mok_cta_pairs_t) */
  int silent_rank;    /* CUDA, W > 1: a rank that creates its context, then makes no call
                         for comm_timeout_s + 1 s before destroying it (fault test), or -1 */
  int step_thread;    /* CUDA, no graph: each step's mok_forward, mok_backward and
                         mok_context_sync are called from a new thread (a framework's
                         worker, such as PyTorch's autograd thread): 0 no; 1 a thread that
                         makes no CUDA call of its own (no context current on it); 2 one
                         whose current device is the last visible GPU, which the calls must
                         leave current */
  int backward_again; /* W = 1, with backward: after the last step, mok_backward once more
                         on its saved; the run's status is that call's (MOK_SAVED_REUSE:
                         MOK_STATUS_INVALID_SAVED), the outputs those of the steps */
  const int64_t* rank_T; /* W > 1: each rank's tokens, W counts summing to T_global (0
                            allowed); NULL: the even split. CUDA: every rank's cfg.T is
                            the largest */
  int loopback;       /* CUDA, W > 1: 1 every rank on GPU 0 through mok_comm_loopback_id;
                         0 a GPU per rank where W are visible, else as 1 */
  int rank_num_ctas[8]; /* CUDA, W > 1: rank r's cfg.num_ctas where non-zero (D2 across
                           ranks), else num_ctas */
} mok_run_opts_t;
#define MOK_RUN_OPTS_INIT {1, 1, 1, 0, 0, 0.0, -1, 0, 0, MOK_CTA_PAIRS_AUTO, -1, 0, 0, NULL, 0, {0}}

/* Runs the problem; returns the first failing rank's status. The message of the first
 * failure is copied to err (size err_len) when err is not NULL. Gradient outputs in
 * FP32_ACCUM mode start from zero at each run and accumulate over its steps. */
mok_status_t mok_problem_run(mok_problem_t* p, const mok_run_opts_t* opts, char* err,
                             size_t err_len);

/* Host memory that runs of a problem take, in bytes, from its config and size alone (so
 * that a run that cannot fit is refused before anything is allocated):
 *   mok_problem_host_bytes: what mok_problem_create allocates for T_global tokens;
 *   mok_problem_outputs_bytes: one copy of mok_problem_outputs' tensors;
 *   mok_problem_run_bytes: what one mok_problem_run on o->W ranks allocates beyond the
 *     problem, every rank counted: its slices of the inputs, its outputs, saved, two
 *     workspaces and weight gradients, and the library's buffers of its context (the
 *     exchange rows, [capacity, H] twice, and the GEMM scratch). shape_only: without
 *     saved and the workspaces, from the shape alone; else it creates the W contexts
 *     (one thread each), asks mok_saved_size and mok_workspace_size and destroys them (a
 *     context touches no buffer before a step, so this costs no memory). Fails only as
 *     a context create fails, its message copied to err. */
size_t mok_problem_host_bytes(const mok_config_t* cfg, int64_t T_global);
size_t mok_problem_outputs_bytes(const mok_config_t* cfg, int64_t T_global, int with_backward);
mok_status_t mok_problem_run_bytes(const mok_config_t* cfg, int64_t T_global, const mok_run_opts_t* o,
                                   int shape_only, size_t* bytes, char* err, size_t err_len);

/* The same on the CUDA backend (W ranks on GPUs 0 .. W-1, a thread each, or all on GPU 0
 * through a loopback id: opts.loopback): each rank's work on a non-blocking stream of
 * its own (inputs copied, outputs poisoned and copied back there), the ranks meeting at
 * a barrier after their setup and before their frees, so that no rank's cudaFree (which
 * waits for the whole device) comes while a peer's step still needs this rank; every
 * output poisoned (0xFF bytes) before the run, results copied back into p's outputs
 * (after a failed step too: what it wrote over the poison, so that a test can see that
 * it wrote nothing).
 * seconds_forward / seconds_backward: CUDA-event times of the last step. Returns
 * MOK_STATUS_BACKEND_UNAVAILABLE when the library has no CUDA backend. */
mok_status_t mok_problem_run_cuda(mok_problem_t* p, const mok_run_opts_t* opts, char* err,
                                  size_t err_len);

/* First differing element of two views, -1 when bitwise equal. */
int64_t mok_first_difference(const mok_tensor_view_t* a, const mok_tensor_view_t* b);
/* ||a - b|| / ||b|| over all elements as doubles (b the reference); NaN-aware: a NaN
 * where b is not NaN makes the result +inf. */
double mok_relative_error(const mok_tensor_view_t* a, const mok_tensor_view_t* b);
double mok_view_get(const mok_tensor_view_t* v, int64_t i);

#endif
