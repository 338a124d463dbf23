/* api.c — the public entry points: status strings, the context (validated config,
 * exchange buffers, registry of live contexts), and the validation of every argument of
 * every call before anything is touched. The arithmetic is in the backends (src/cpu/). */
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "cpu/cpu_comm.h"
#include "cpu/gemm.h"
#include "internal.h"
#ifdef MOK_HAVE_NCCL
#include "comm/nccl_comm.h"
#endif
#ifdef MOK_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif

int mok_version(void) { return MOK_VERSION_CODE; }

const char* mok_status_string(mok_status_t s) {
  switch (s) {
    case MOK_STATUS_SUCCESS: return "MOK_STATUS_SUCCESS: success";
    case MOK_STATUS_INVALID_CONTEXT: return "MOK_STATUS_INVALID_CONTEXT: null, destroyed or unknown context";
    case MOK_STATUS_NULL_POINTER: return "MOK_STATUS_NULL_POINTER: a required pointer is NULL";
    case MOK_STATUS_MISALIGNED_POINTER: return "MOK_STATUS_MISALIGNED_POINTER: a pointer breaks its alignment rule";
    case MOK_STATUS_INVALID_SHAPE: return "MOK_STATUS_INVALID_SHAPE: a shape rule is broken";
    case MOK_STATUS_UNSUPPORTED_SHAPE: return "MOK_STATUS_UNSUPPORTED_SHAPE: the backend does not run this shape";
    case MOK_STATUS_INVALID_ARGUMENT: return "MOK_STATUS_INVALID_ARGUMENT: an argument is out of range";
    case MOK_STATUS_NONFINITE_VALUE: return "MOK_STATUS_NONFINITE_VALUE: NaN or Inf where a finite value is required";
    case MOK_STATUS_VERSION_MISMATCH: return "MOK_STATUS_VERSION_MISMATCH: config from another version of mok.h";
    case MOK_STATUS_INDEX_OUT_OF_RANGE: return "MOK_STATUS_INDEX_OUT_OF_RANGE: an expert index outside [0, E)";
    case MOK_STATUS_DUPLICATE_INDEX: return "MOK_STATUS_DUPLICATE_INDEX: a token names one expert twice";
    case MOK_STATUS_WORKSPACE_TOO_SMALL: return "MOK_STATUS_WORKSPACE_TOO_SMALL: workspace or saved buffer too small";
    case MOK_STATUS_INVALID_SAVED:
      return "MOK_STATUS_INVALID_SAVED: saved buffer not from this context's forward, or used up by a backward "
             "(cfg.saved_use = MOK_SAVED_REUSE)";
    case MOK_STATUS_CAPACITY_EXCEEDED: return "MOK_STATUS_CAPACITY_EXCEEDED: a rank would receive more rows than its capacity";
    case MOK_STATUS_COMM_TIMEOUT: return "MOK_STATUS_COMM_TIMEOUT: a peer did not arrive in time";
    case MOK_STATUS_COMM_ERROR: return "MOK_STATUS_COMM_ERROR: communicator error";
    case MOK_STATUS_BACKEND_UNAVAILABLE: return "MOK_STATUS_BACKEND_UNAVAILABLE: backend not built or no device";
    case MOK_STATUS_OUT_OF_MEMORY: return "MOK_STATUS_OUT_OF_MEMORY: allocation failed";
    case MOK_STATUS_CUDA_ERROR: return "MOK_STATUS_CUDA_ERROR: a CUDA call failed";
    case MOK_STATUS_INTERNAL_ERROR: return "MOK_STATUS_INTERNAL_ERROR: internal error";
    case MOK_STATUS_COUNT_: break;
  }
  return "MOK_STATUS_?: unknown status code";
}

/* ---- errors ---- */

static _Thread_local char create_error[MOK_ERROR_LEN];

mok_status_t mok_error_at(mok_context_t* ctx, mok_status_t s, const char* file, int line,
                          const char* fmt, ...) {
  char* dst = ctx ? ctx->last_error : create_error;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(dst, MOK_ERROR_LEN, fmt, ap);
  va_end(ap);
  if (n >= 0 && n < MOK_ERROR_LEN)
    snprintf(dst + n, (size_t)(MOK_ERROR_LEN - n), " [%s:%d]", file, line);
  return s;
}

const char* mok_last_create_error(void) { return create_error; }

/* The id buffer's rule, shared by both id makers: at least MOK_COMM_UNIQUE_ID_BYTES. */
static mok_status_t check_id_buffer(const char* fn, const void* id, size_t size) {
  if (id && size >= MOK_COMM_UNIQUE_ID_BYTES) return MOK_STATUS_SUCCESS;
  snprintf(create_error, MOK_ERROR_LEN, "%s: id must point to at least MOK_COMM_UNIQUE_ID_BYTES = %d bytes (got %zu%s)",
           fn, MOK_COMM_UNIQUE_ID_BYTES, size, id ? "" : " at NULL");
  return id ? MOK_STATUS_INVALID_ARGUMENT : MOK_STATUS_NULL_POINTER;
}

mok_status_t mok_comm_unique_id(void* id, size_t size) {
  mok_status_t s = check_id_buffer("mok_comm_unique_id", id, size);
  if (s) return s;
#ifdef MOK_HAVE_NCCL
  char err[400];
  s = mok_nccl_unique_id(id, err, sizeof err);
  if (s != MOK_STATUS_SUCCESS) snprintf(create_error, MOK_ERROR_LEN, "mok_comm_unique_id: %s", err);
  return s;
#else
  snprintf(create_error, MOK_ERROR_LEN, "mok_comm_unique_id: this libmok was built without NCCL (no nccl.h found)");
  return MOK_STATUS_BACKEND_UNAVAILABLE;
#endif
}

mok_status_t mok_comm_loopback_id(void* id, size_t size) {
  const mok_status_t s = check_id_buffer("mok_comm_loopback_id", id, size);
  if (s) return s;
#ifdef MOK_HAVE_NCCL
  mok_nccl_loopback_id(id);
  return MOK_STATUS_SUCCESS;
#else
  snprintf(create_error, MOK_ERROR_LEN, "mok_comm_loopback_id: this libmok was built without NCCL (no nccl.h found)");
  return MOK_STATUS_BACKEND_UNAVAILABLE;
#endif
}

/* ---- registry of live contexts: lets a call detect a destroyed context without
 * reading its freed memory ---- */

static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static mok_context_t** registry;
static size_t registry_len, registry_cap;

static int registry_add(mok_context_t* ctx) {
  pthread_mutex_lock(&registry_mu);
  int ok = 1;
  if (registry_len == registry_cap) {
    size_t cap = registry_cap ? 2 * registry_cap : 16;
    mok_context_t** grown = realloc(registry, cap * sizeof *grown);
    if (grown) registry = grown, registry_cap = cap;
    else ok = 0;
  }
  if (ok) registry[registry_len++] = ctx;
  pthread_mutex_unlock(&registry_mu);
  return ok;
}

static int registry_remove(const mok_context_t* ctx) {
  pthread_mutex_lock(&registry_mu);
  int found = 0;
  for (size_t i = 0; i < registry_len; i++)
    if (registry[i] == ctx) {
      registry[i] = registry[--registry_len];
      found = 1;
      break;
    }
  if (registry_len == 0) {
    free(registry);
    registry = NULL;
    registry_cap = 0;
  }
  pthread_mutex_unlock(&registry_mu);
  return found;
}

static int registry_has(const mok_context_t* ctx) {
  pthread_mutex_lock(&registry_mu);
  int found = 0;
  for (size_t i = 0; i < registry_len && !found; i++) found = registry[i] == ctx;
  pthread_mutex_unlock(&registry_mu);
  return found;
}

/* ---- the context ---- */

#define CFG_ERR(status, ...) MOK_ERR(NULL, status, "mok_context_create: " __VA_ARGS__)

/* Group-limited routing's rules (mok.h, cfg.n_group), for a config whose E, K and
 * routing passed theirs. */
static mok_status_t validate_groups(const mok_config_t* c) {
  if ((unsigned)c->group_score > MOK_GROUP_SCORE_MAX)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.group_score = %d is not a mok_group_score_t",
                   (int)c->group_score);
  if (c->n_group < 0)
    return CFG_ERR(MOK_STATUS_INVALID_SHAPE, "cfg.n_group = %d must be >= 0 (0 = no grouping)", c->n_group);
  if (c->n_group == 0) {
    if (c->topk_group != 0)
      return CFG_ERR(MOK_STATUS_INVALID_SHAPE,
                     "cfg.topk_group = %d needs cfg.n_group >= 1 (with n_group = 0, no grouping, it must be 0)",
                     c->topk_group);
    return MOK_STATUS_SUCCESS;
  }
  if (c->E % c->n_group != 0)
    return CFG_ERR(MOK_STATUS_INVALID_SHAPE, "cfg.n_group = %d must divide cfg.E = %lld (groups of E / n_group experts)",
                   c->n_group, (long long)c->E);
  if (c->topk_group < 1 || c->topk_group > c->n_group)
    return CFG_ERR(MOK_STATUS_INVALID_SHAPE, "cfg.topk_group = %d must be in [1, cfg.n_group = %d]", c->topk_group,
                   c->n_group);
  const int64_t kept = (int64_t)c->topk_group * (c->E / c->n_group);
  if (c->K > kept)
    return CFG_ERR(MOK_STATUS_INVALID_SHAPE,
                   "cfg.K = %lld must be at most the experts of the kept groups, cfg.topk_group * (E / n_group) = "
                   "%d * %lld = %lld",
                   (long long)c->K, c->topk_group, (long long)(c->E / c->n_group), (long long)kept);
  if (c->routing != MOK_ROUTING_FUSED)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT,
                   "cfg.n_group = %d: group-limited routing is a rule of fused routing; replay routing "
                   "(cfg.routing = MOK_ROUTING_REPLAY) takes the caller's topk_idx as they are: set n_group = 0",
                   c->n_group);
  return MOK_STATUS_SUCCESS;
}

/* The router and expert variants' rules (mok.h: use_router_bias, activation,
 * use_shared_gate), for a
 * config whose routing passed its own. */
static mok_status_t validate_variants(const mok_config_t* c) {
  if (c->use_router_bias && c->routing != MOK_ROUTING_FUSED)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT,
                   "cfg.use_router_bias = %d: the router logit bias is a rule of fused routing; replay routing "
                   "(cfg.routing = MOK_ROUTING_REPLAY) takes the caller's weights as they are: set use_router_bias = 0",
                   c->use_router_bias);
  if ((unsigned)c->activation > MOK_ACTIVATION_SWIGLU_CLAMPED)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.activation = %d is not a mok_activation_t", (int)c->activation);
  if (c->activation == MOK_ACTIVATION_SWIGLU_CLAMPED) {
    if (!isfinite(c->swiglu_alpha))
      return CFG_ERR(MOK_STATUS_NONFINITE_VALUE, "cfg.swiglu_alpha = %g must be finite (gpt-oss: 1.702)",
                     (double)c->swiglu_alpha);
    if (!(c->swiglu_alpha > 0))
      return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.swiglu_alpha = %g must be > 0 (gpt-oss: 1.702)",
                     (double)c->swiglu_alpha);
    if (!isfinite(c->swiglu_limit))
      return CFG_ERR(MOK_STATUS_NONFINITE_VALUE, "cfg.swiglu_limit = %g must be finite (gpt-oss: 7)",
                     (double)c->swiglu_limit);
    if (!(c->swiglu_limit > 0))
      return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT,
                     "cfg.swiglu_limit = %g must be > 0 (gate and up are clamped at it; gpt-oss: 7)",
                     (double)c->swiglu_limit);
  } else if (c->swiglu_alpha != 0 || c->swiglu_limit != 0) {
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT,
                   "cfg.swiglu_alpha = %g, cfg.swiglu_limit = %g: the clamped SwiGLU's parameters need "
                   "cfg.activation = MOK_ACTIVATION_SWIGLU_CLAMPED (with the plain SwiGLU both must be 0)",
                   (double)c->swiglu_alpha, (double)c->swiglu_limit);
  }
  if (c->use_shared_gate && c->Fs == 0)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT,
                   "cfg.use_shared_gate = %d: the shared-expert gate needs a shared expert (cfg.Fs > 0)",
                   c->use_shared_gate);
  return MOK_STATUS_SUCCESS;
}

static mok_status_t validate_config(const mok_config_t* c) {
  if (c->struct_size != sizeof(mok_config_t) || c->version != MOK_VERSION_CODE)
    return CFG_ERR(MOK_STATUS_VERSION_MISMATCH,
                   "cfg.struct_size = %zu, cfg.version = %d, but this library has %zu and %d: "
                   "initialise the config with MOK_CONFIG_INIT of the same mok.h",
                   c->struct_size, c->version, sizeof(mok_config_t), MOK_VERSION_CODE);
  if (c->T < 0) return CFG_ERR(MOK_STATUS_INVALID_SHAPE, "cfg.T = %lld must be >= 0", (long long)c->T);
  if (c->H < 1) return CFG_ERR(MOK_STATUS_INVALID_SHAPE, "cfg.H = %lld must be >= 1", (long long)c->H);
  if (c->F < 1) return CFG_ERR(MOK_STATUS_INVALID_SHAPE, "cfg.F = %lld must be >= 1", (long long)c->F);
  if (c->E < 1) return CFG_ERR(MOK_STATUS_INVALID_SHAPE, "cfg.E = %lld must be >= 1", (long long)c->E);
  if (c->K < 1 || c->K > c->E)
    return CFG_ERR(MOK_STATUS_INVALID_SHAPE, "cfg.K = %lld must be in [1, E = %lld]",
                   (long long)c->K, (long long)c->E);
  if (c->W < 1 || c->W > MOK_MAX_RANKS)
    return CFG_ERR(MOK_STATUS_INVALID_SHAPE, "cfg.W = %d must be in [1, %d]", c->W, MOK_MAX_RANKS);
  if (c->E % c->W != 0)
    return CFG_ERR(MOK_STATUS_INVALID_SHAPE, "cfg.E = %lld must be divisible by cfg.W = %d",
                   (long long)c->E, c->W);
  if (c->Fs < 0) return CFG_ERR(MOK_STATUS_INVALID_SHAPE, "cfg.Fs = %lld must be >= 0", (long long)c->Fs);
  if (c->capacity < 0)
    return CFG_ERR(MOK_STATUS_INVALID_SHAPE, "cfg.capacity = %lld must be >= 0 (0 = default)",
                   (long long)c->capacity);
  if (c->rank < 0 || c->rank >= c->W)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.rank = %d must be in [0, W = %d)", c->rank, c->W);
  if ((unsigned)c->routing > MOK_ROUTING_REPLAY)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.routing = %d is not a mok_routing_t", (int)c->routing);
  if ((unsigned)c->score > MOK_SCORE_SIGMOID)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.score = %d is not a mok_score_t", (int)c->score);
  if ((unsigned)c->wgrad > MOK_WGRAD_FP32_ACCUM)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.wgrad = %d is not a mok_wgrad_t", (int)c->wgrad);
  if ((unsigned)c->numerics > MOK_NUMERICS_EXACT)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.numerics = %d is not a mok_numerics_t", (int)c->numerics);
  if ((unsigned)c->backend > MOK_BACKEND_CUDA)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.backend = %d is not a mok_backend_t", (int)c->backend);
  if (c->num_threads < 0 || c->num_threads > MOK_MAX_THREADS)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.num_threads = %d must be in [0, MOK_MAX_THREADS = %d] (0 = all cores)",
                   c->num_threads, MOK_MAX_THREADS);
  if (!isfinite(c->route_scale))
    return CFG_ERR(MOK_STATUS_NONFINITE_VALUE, "cfg.route_scale = %g must be finite", (double)c->route_scale);
  if (!isfinite(c->aux_loss_coef))
    return CFG_ERR(MOK_STATUS_NONFINITE_VALUE, "cfg.aux_loss_coef = %g must be finite", (double)c->aux_loss_coef);
  if (!isfinite(c->z_loss_coef))
    return CFG_ERR(MOK_STATUS_NONFINITE_VALUE, "cfg.z_loss_coef = %g must be finite", (double)c->z_loss_coef);
  if (!isfinite(c->comm_timeout_s) || c->comm_timeout_s < 0)
    return CFG_ERR(MOK_STATUS_NONFINITE_VALUE, "cfg.comm_timeout_s = %g must be finite and >= 0",
                   c->comm_timeout_s);
  if (c->numerics == MOK_NUMERICS_EXACT && c->backend != MOK_BACKEND_CPU)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT,
                   "cfg.numerics = MOK_NUMERICS_EXACT needs cfg.backend = MOK_BACKEND_CPU");
  if (c->num_ctas < 0)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.num_ctas = %d must be >= 0 (0 = one per SM)", c->num_ctas);
  if ((unsigned)c->cta_pairs > MOK_CTA_PAIRS_ON)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.cta_pairs = %d is not a mok_cta_pairs_t", (int)c->cta_pairs);
  if ((unsigned)c->gate_up > MOK_GATE_UP_RECOMPUTE)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.gate_up = %d is not a mok_gate_up_t", (int)c->gate_up);
  if ((unsigned)c->saved_use > MOK_SAVED_REUSE)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT, "cfg.saved_use = %d is not a mok_saved_use_t", (int)c->saved_use);
  const mok_status_t groups = validate_groups(c);
  if (groups) return groups;
  const mok_status_t variants = validate_variants(c);
  if (variants) return variants;
  if (c->backend == MOK_BACKEND_CUDA) {
#ifndef MOK_HAVE_CUDA
    return CFG_ERR(MOK_STATUS_BACKEND_UNAVAILABLE,
                   "cfg.backend = MOK_BACKEND_CUDA: this build of mok has no CUDA backend (built without nvcc)");
#else
    /* the kernels' tiles: 64-wide TMA boxes along H, F, Fs (E: any up to MOK_MAX_EXPERTS,
     * a router warp's 32 registers a lane; K: a lane a slot) */
    if (c->H % 64 || c->F % 64 || c->Fs % 64)
      return CFG_ERR(MOK_STATUS_UNSUPPORTED_SHAPE,
                     "cfg.H = %lld, cfg.F = %lld, cfg.Fs = %lld: the CUDA backend needs multiples of 64",
                     (long long)c->H, (long long)c->F, (long long)c->Fs);
    if (c->K > 32)
      return CFG_ERR(MOK_STATUS_UNSUPPORTED_SHAPE, "cfg.K = %lld: the CUDA backend needs K <= 32", (long long)c->K);
    if (c->W > 1) {
#ifndef MOK_HAVE_NCCL
      return CFG_ERR(MOK_STATUS_BACKEND_UNAVAILABLE,
                     "cfg.W = %d: this build of mok has no NCCL (no nccl.h found), so the CUDA backend runs W = 1 only",
                     c->W);
#endif
      if (c->W > MOK_CUDA_MAX_RANKS)
        return CFG_ERR(MOK_STATUS_UNSUPPORTED_SHAPE, "cfg.W = %d: the CUDA backend runs W <= %d", c->W,
                       MOK_CUDA_MAX_RANKS);
      if (!c->comm_unique_id)
        return CFG_ERR(MOK_STATUS_NULL_POINTER,
                       "cfg.comm_unique_id is NULL: the CUDA backend with W = %d > 1 needs the ranks' NCCL unique "
                       "id (mok_comm_unique_id on one rank, the same bytes on every rank)", c->W);
    }
#endif
  }
  if (c->E > MOK_MAX_EXPERTS)
    return CFG_ERR(MOK_STATUS_UNSUPPORTED_SHAPE, "cfg.E = %lld: mok runs E <= %d (both backends)",
                   (long long)c->E, MOK_MAX_EXPERTS);
  /* sizes must fit: every dimension an int32 (row positions and the kernels' indices),
   * the largest buffers [W T K, H] and the weights below 2^53 elements (so the products
   * below, in double, are exact enough, and the plans' int64 products cannot wrap) */
  const int64_t dims[] = {c->T, c->H, c->F, c->Fs}; /* (capacity: bounded by the rows that can arrive) */
  static const char* const dim_names[] = {"cfg.T", "cfg.H", "cfg.F", "cfg.Fs"};
  for (int i = 0; i < 4; i++)
    if (dims[i] > INT32_MAX)
      return CFG_ERR(MOK_STATUS_UNSUPPORTED_SHAPE, "%s = %lld: must be at most 2^31 - 1 = %d", dim_names[i],
                     (long long)dims[i], INT32_MAX);
  if ((double)c->H * ((double)c->E + 2.0 * (double)c->F + 3.0 * (double)c->Fs) >= 9.0e15)
    return CFG_ERR(MOK_STATUS_UNSUPPORTED_SHAPE,
                   "cfg.H = %lld, E = %lld, F = %lld, Fs = %lld: the weights H (E + 2F + 3Fs) would reach 2^53 elements",
                   (long long)c->H, (long long)c->E, (long long)c->F, (long long)c->Fs);
  const double rows = (double)c->W * (double)c->T * (double)c->K;
  const double width = (double)(c->H > 2 * c->F ? c->H : 2 * c->F) + (double)c->E + 2.0 * (double)c->Fs;
  if (rows >= 2147483647.0 || rows * width >= 9.0e15 || (double)c->H * (double)c->F * (double)c->E >= 9.0e15)
    return CFG_ERR(MOK_STATUS_UNSUPPORTED_SHAPE,
                   "cfg.T = %lld, W = %d, K = %lld, H = %lld, F = %lld: buffers would exceed "
                   "int32 row positions or 2^53 elements",
                   (long long)c->T, c->W, (long long)c->K, (long long)c->H, (long long)c->F);
  if (c->W > 1 && !c->cpu_comm && c->backend == MOK_BACKEND_CPU)
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT,
                   "cfg.cpu_comm is NULL: the CPU backend with W = %d > 1 needs the ranks' shared "
                   "communicator (mok_cpu_comm_create)", c->W);
  if (c->cpu_comm && (c->cpu_comm->magic != MOK_COMM_MAGIC || c->cpu_comm->num_ranks != c->W))
    return CFG_ERR(MOK_STATUS_INVALID_ARGUMENT,
                   "cfg.cpu_comm: not a live communicator of W = %d ranks", c->W);
  return MOK_STATUS_SUCCESS;
}

/* Context serials: process-unique and never reused (a saved buffer names its writer by
 * it; an address can come back from malloc after a destroy). */
static uint64_t next_serial(void) {
  static uint64_t last;
  pthread_mutex_lock(&registry_mu);
  uint64_t s = ++last;
  pthread_mutex_unlock(&registry_mu);
  return s;
}

/* The plans of a created context fit in memory's sizes (plan.c checks each product). */
static mok_status_t check_plans(mok_context_t* ctx) {
  mok_saved_plan_t sp;
  mok_workspace_plan_t wp;
  mok_plan_saved(ctx, ctx->cfg.T, &sp);
  mok_plan_workspace(ctx, ctx->cfg.T, &wp);
  size_t rows_bytes;
  const int rows_overflow = __builtin_mul_overflow((size_t)ctx->cfg.capacity, (size_t)ctx->cfg.H * (size_t)ctx->act_size,
                                                   &rows_bytes);
  if (sp.overflow || wp.overflow || rows_overflow || sp.total > MOK_MAX_BUFFER_BYTES ||
      wp.total > MOK_MAX_BUFFER_BYTES || rows_bytes > MOK_MAX_BUFFER_BYTES)
    return MOK_ERR(ctx, MOK_STATUS_UNSUPPORTED_SHAPE,
                   "mok_context_create: cfg.T = %lld, H = %lld, F = %lld, E = %lld, K = %lld, Fs = %lld, capacity = "
                   "%lld: the saved buffer, workspace or exchange buffers would exceed 2^48 bytes",
                   (long long)ctx->cfg.T, (long long)ctx->cfg.H, (long long)ctx->cfg.F, (long long)ctx->cfg.E,
                   (long long)ctx->cfg.K, (long long)ctx->cfg.Fs, (long long)ctx->cfg.capacity);
  return MOK_STATUS_SUCCESS;
}

static void context_free(mok_context_t* ctx) {
#ifdef MOK_HAVE_CUDA
  mok_cuda_destroy(ctx);
#endif
  free(ctx->recv_rows);
  free(ctx->ret_rows);
  free(ctx->pack);
  if (ctx->owns_comm) mok_cpu_comm_destroy(ctx->comm);
  ctx->magic = 0;
  free(ctx);
}

static void* alloc_aligned(size_t bytes) {
  size_t n = (bytes + MOK_ALIGN_WORKSPACE - 1) / MOK_ALIGN_WORKSPACE * MOK_ALIGN_WORKSPACE;
  return aligned_alloc(MOK_ALIGN_WORKSPACE, n ? n : MOK_ALIGN_WORKSPACE);
}

mok_status_t mok_context_create(const mok_config_t* cfg, mok_context_t** out) {
  if (!out) return CFG_ERR(MOK_STATUS_NULL_POINTER, "ctx (the output pointer) is NULL");
  *out = NULL;
  if (!cfg) return CFG_ERR(MOK_STATUS_NULL_POINTER, "cfg is NULL");
  mok_status_t s = validate_config(cfg);
  if (s) return s;
  mok_context_t* ctx = calloc(1, sizeof *ctx);
  if (!ctx) return CFG_ERR(MOK_STATUS_OUT_OF_MEMORY, "no host memory for the context");
  ctx->magic = MOK_CONTEXT_MAGIC;
  ctx->serial = next_serial();
  ctx->cfg = *cfg;
  mok_config_t* c = &ctx->cfg;
  if (c->num_threads == 0) c->num_threads = omp_get_max_threads();
  if (c->comm_timeout_s == 0) c->comm_timeout_s = 5.0;
  /* a bound past MOK_MAX_TIMEOUT_S waits that long (deadlines in time_t and ns must not overflow) */
  if (c->comm_timeout_s > MOK_MAX_TIMEOUT_S) c->comm_timeout_s = MOK_MAX_TIMEOUT_S;
  ctx->E_loc = c->E / c->W;
  ctx->act_size = c->numerics == MOK_NUMERICS_EXACT ? 8 : 2;
  ctx->real_size = c->numerics == MOK_NUMERICS_EXACT ? 8 : 4;
#ifdef MOK_HAVE_CUDA
  if (c->backend == MOK_BACKEND_CUDA) {
    for (int r = 0; r < c->W; r++) ctx->T_all[r] = c->T; /* (symmetric windows: every rank's T alike) */
    if (c->capacity > mok_capacity_max(c, ctx->T_all)) {
      CFG_ERR(MOK_STATUS_INVALID_SHAPE,
              "cfg.capacity = %lld exceeds the most rows a rank can receive, %lld = W * cfg.T * min(K, E / W)",
              (long long)c->capacity, (long long)mok_capacity_max(c, ctx->T_all));
      free(ctx);
      return MOK_STATUS_INVALID_SHAPE;
    }
    if (c->W == 1) c->capacity = c->T * c->K; /* every routed row stays here */
    else if (c->capacity == 0) /* safe when every rank's cfg.T is this one's: each of the W T tokens
                                  sends min(K, E/W) rows here; a step beyond it stops everywhere */
      c->capacity = (int64_t)c->W * c->T * (c->K < ctx->E_loc ? c->K : ctx->E_loc);
    s = mok_cuda_create(ctx);
    if (s || !registry_add(ctx)) {
      snprintf(create_error, MOK_ERROR_LEN, "mok_context_create: %.400s", s ? ctx->last_error : "out of host memory");
      mok_cuda_destroy(ctx);
      free(ctx);
      return s ? s : MOK_STATUS_OUT_OF_MEMORY;
    }
    *out = ctx;
    return MOK_STATUS_SUCCESS;
  }
#endif
  if (c->W == 1) {
    s = mok_cpu_comm_create(1, &ctx->comm);
    if (s) {
      free(ctx);
      return CFG_ERR(MOK_STATUS_OUT_OF_MEMORY, "no host memory for the communicator");
    }
    ctx->owns_comm = 1;
  } else {
    ctx->comm = c->cpu_comm;
  }
  s = mok_cpu_comm_attach(ctx->comm, ctx);
  if (s) {
    snprintf(create_error, MOK_ERROR_LEN, "mok_context_create: %.400s", ctx->last_error);
    context_free(ctx);
    return s;
  }
  if (c->capacity == 0) c->capacity = mok_capacity_max(c, ctx->T_all); /* (attach checked a given one) */
  s = check_plans(ctx);
  if (s) {
    snprintf(create_error, MOK_ERROR_LEN, "%.500s", ctx->last_error);
    mok_cpu_comm_detach(ctx->comm, ctx);
    context_free(ctx);
    return s;
  }
  const size_t row_bytes = (size_t)c->H * (size_t)ctx->act_size;
  ctx->recv_rows = alloc_aligned((size_t)c->capacity * row_bytes);
  ctx->ret_rows = alloc_aligned((size_t)c->capacity * row_bytes);
  ctx->pack = alloc_aligned(mok_gemm_pack_bytes() * (size_t)c->num_threads);
  if (!ctx->recv_rows || !ctx->ret_rows || !ctx->pack || !registry_add(ctx)) {
    CFG_ERR(MOK_STATUS_OUT_OF_MEMORY,
            "no host memory for the exchange buffers (capacity = %lld rows of H = %lld)",
            (long long)c->capacity, (long long)c->H);
    mok_cpu_comm_detach(ctx->comm, ctx);
    context_free(ctx);
    return MOK_STATUS_OUT_OF_MEMORY;
  }
  *out = ctx;
  return MOK_STATUS_SUCCESS;
}

mok_status_t mok_context_destroy(mok_context_t* ctx) {
  if (!ctx || !registry_remove(ctx)) return MOK_STATUS_INVALID_CONTEXT;
  /* collective: peers may still read this rank's exchange buffers in their last call
   * (bounded: a failed communicator returns at once) */
  if (ctx->comm) {
    if (ctx->cfg.W > 1) mok_cpu_comm_barrier(ctx->comm, ctx);
    mok_cpu_comm_detach(ctx->comm, ctx);
  }
  context_free(ctx);
  return MOK_STATUS_SUCCESS;
}

const char* mok_context_last_error(const mok_context_t* ctx) {
  if (!ctx || !registry_has(ctx)) return "invalid context (NULL or destroyed)";
  return ctx->last_error;
}

mok_status_t mok_workspace_sizes(const mok_context_t* ctx, size_t* forward_bytes, size_t* backward_bytes) {
  if (!ctx || !registry_has(ctx)) return MOK_STATUS_INVALID_CONTEXT;
  if (!forward_bytes || !backward_bytes)
    return MOK_ERR((mok_context_t*)ctx, MOK_STATUS_NULL_POINTER, "mok_workspace_sizes: %s is NULL",
                   !forward_bytes ? "forward_bytes" : "backward_bytes");
#ifdef MOK_HAVE_CUDA
  if (ctx->gpu) {
    mok_cuda_sizes(ctx, NULL, forward_bytes, backward_bytes);
    return MOK_STATUS_SUCCESS;
  }
#endif
  mok_workspace_plan_t p; /* (the CPU backend: one plan serves both) */
  mok_plan_workspace(ctx, ctx->cfg.T, &p);
  *forward_bytes = *backward_bytes = p.total;
  return MOK_STATUS_SUCCESS;
}

mok_status_t mok_workspace_size(const mok_context_t* ctx, size_t* bytes) {
  if (!ctx || !registry_has(ctx)) return MOK_STATUS_INVALID_CONTEXT;
  if (!bytes) return MOK_ERR((mok_context_t*)ctx, MOK_STATUS_NULL_POINTER, "mok_workspace_size: bytes is NULL");
  size_t fwd = 0, bwd = 0;
  mok_workspace_sizes(ctx, &fwd, &bwd);
  *bytes = fwd > bwd ? fwd : bwd;
  return MOK_STATUS_SUCCESS;
}

mok_status_t mok_saved_size(const mok_context_t* ctx, size_t* bytes) {
  if (!ctx || !registry_has(ctx)) return MOK_STATUS_INVALID_CONTEXT;
  if (!bytes) return MOK_ERR((mok_context_t*)ctx, MOK_STATUS_NULL_POINTER, "mok_saved_size: bytes is NULL");
#ifdef MOK_HAVE_CUDA
  if (ctx->gpu) {
    mok_cuda_sizes(ctx, bytes, NULL, NULL);
    return MOK_STATUS_SUCCESS;
  }
#endif
  mok_saved_plan_t p;
  mok_plan_saved(ctx, ctx->cfg.T, &p);
  *bytes = p.total;
  return MOK_STATUS_SUCCESS;
}

/* ---- argument checks shared by forward and backward ---- */

typedef struct {
  const char* name;
  const void* ptr;
  int required;
  size_t align;
} ptr_rule_t;

static mok_status_t check_pointers(mok_context_t* ctx, const char* fn, const ptr_rule_t* rules, int n) {
  for (int i = 0; i < n; i++) {
    const ptr_rule_t* r = &rules[i];
    if (!r->ptr) {
      if (r->required)
        return MOK_ERR(ctx, MOK_STATUS_NULL_POINTER, "%s: args->%s is NULL but required by this config", fn, r->name);
      continue;
    }
    if ((uintptr_t)r->ptr % r->align)
      return MOK_ERR(ctx, MOK_STATUS_MISALIGNED_POINTER, "%s: args->%s = %p must be %zu-byte aligned",
                     fn, r->name, r->ptr, r->align);
  }
  return MOK_STATUS_SUCCESS;
}

static mok_status_t check_tokens(mok_context_t* ctx, const char* fn, int64_t T) {
  if (T < 0 || T > ctx->cfg.T)
    return MOK_ERR(ctx, MOK_STATUS_INVALID_SHAPE, "%s: args->num_tokens = %lld must be in [0, cfg.T = %lld]",
                   fn, (long long)T, (long long)ctx->cfg.T);
  return MOK_STATUS_SUCCESS;
}

/* forward: the call is a forward (its workspace need: mok_workspace_sizes' first), else a backward */
static mok_status_t check_workspace(mok_context_t* ctx, const char* fn, int forward, size_t have, size_t saved_have) {
  size_t fwd = 0, bwd = 0, saved_need = 0;
  mok_workspace_sizes(ctx, &fwd, &bwd);
  mok_saved_size(ctx, &saved_need);
  const size_t need = forward ? fwd : bwd;
  if (have < need)
    return MOK_ERR(ctx, MOK_STATUS_WORKSPACE_TOO_SMALL,
                   "%s: args->workspace_bytes = %zu, below mok_workspace_sizes()' %s = %zu", fn, have,
                   forward ? "forward_bytes" : "backward_bytes", need);
  if (saved_have < saved_need)
    return MOK_ERR(ctx, MOK_STATUS_WORKSPACE_TOO_SMALL,
                   "%s: args->saved_bytes = %zu, below mok_saved_size() = %zu", fn, saved_have, saved_need);
  return MOK_STATUS_SUCCESS;
}

/* A step of no tokens at W = 1 (mok.h): what it leaves is what an empty batch gives,
 * zero expert counts and losses; its weight gradients are zero, written as such in bf16
 * and added (nothing) in fp32. Nothing else is read or written, saved included. */
static mok_status_t zero_output(mok_context_t* ctx, void* dst, size_t bytes, void* stream) {
  if (!dst) return MOK_STATUS_SUCCESS;
#ifdef MOK_HAVE_CUDA
  if (ctx->gpu) return mok_cuda_zero(ctx, dst, bytes, stream);
#endif
  (void)ctx, (void)stream;
  memset(dst, 0, bytes);
  return MOK_STATUS_SUCCESS;
}

static mok_status_t forward_no_tokens(mok_context_t* ctx, const mok_forward_args_t* a) {
  const size_t r = (size_t)ctx->real_size;
  mok_status_t s = zero_output(ctx, a->tokens_per_expert, (size_t)ctx->cfg.E * 4, a->stream);
  if (!s) s = zero_output(ctx, a->aux_loss, r, a->stream);
  if (!s) s = zero_output(ctx, a->z_loss, r, a->stream);
  return s;
}

static mok_status_t backward_no_tokens(mok_context_t* ctx, const mok_backward_args_t* a) {
  const mok_config_t* c = &ctx->cfg;
  if (c->wgrad == MOK_WGRAD_FP32_ACCUM) return MOK_STATUS_SUCCESS;
  const size_t g = (size_t)ctx->act_size, H = (size_t)c->H, F = (size_t)c->F, Fs = (size_t)c->Fs;
  const size_t El = (size_t)ctx->E_loc;
  const int fused = c->routing == MOK_ROUTING_FUSED;
  mok_status_t s = zero_output(ctx, fused ? a->d_w_router : NULL, (size_t)c->E * H * g, a->stream);
  if (!s && fused && c->use_router_bias) /* (fp32 whatever cfg.wgrad: written as zeros here too) */
    s = zero_output(ctx, a->d_b_router, (size_t)c->E * (size_t)ctx->real_size, a->stream);
  if (!s) s = zero_output(ctx, a->d_w13, El * 2 * F * H * g, a->stream);
  if (!s) s = zero_output(ctx, a->d_w2, El * H * F * g, a->stream);
  if (!s && c->use_expert_bias) s = zero_output(ctx, a->d_b13, El * 2 * F * g, a->stream);
  if (!s && c->use_expert_bias) s = zero_output(ctx, a->d_b2, El * H * g, a->stream);
  if (!s) s = zero_output(ctx, a->d_ws13, 2 * Fs * H * g, a->stream);
  if (!s) s = zero_output(ctx, a->d_ws2, H * Fs * g, a->stream);
  if (!s && c->use_shared_gate) s = zero_output(ctx, a->d_w_sg, H * g, a->stream);
  return s;
}

#define T16 MOK_ALIGN_TENSOR
#define WS256 MOK_ALIGN_WORKSPACE

mok_status_t mok_forward(mok_context_t* ctx, const mok_forward_args_t* a) {
  static const char fn[] = "mok_forward";
  if (!ctx || !registry_has(ctx)) return MOK_STATUS_INVALID_CONTEXT;
  if (!a) return MOK_ERR(ctx, MOK_STATUS_NULL_POINTER, "%s: args is NULL", fn);
  const mok_config_t* c = &ctx->cfg;
  mok_status_t s = check_tokens(ctx, fn, a->num_tokens);
  if (s) return s;
  const int64_t T = a->num_tokens, K = c->K, E = c->E;
  const int tok = T > 0, fused = c->routing == MOK_ROUTING_FUSED, shared = c->Fs > 0;
  const ptr_rule_t rules[] = {
      {"x", a->x, tok, T16},
      {"w_router", a->w_router, fused, T16},
      {"bias_select", a->bias_select, fused && c->use_bias_select, T16},
      {"b_router", a->b_router, fused && c->use_router_bias, T16},
      {"w13", a->w13, 1, T16},
      {"w2", a->w2, 1, T16},
      {"b13", a->b13, c->use_expert_bias, T16},
      {"b2", a->b2, c->use_expert_bias, T16},
      {"ws13", a->ws13, shared, T16},
      {"ws2", a->ws2, shared, T16},
      {"w_sg", a->w_sg, c->use_shared_gate, T16},
      {"topk_idx", a->topk_idx, !fused && tok, T16},
      {"topk_weight", a->topk_weight, !fused && tok, T16},
      {"y", a->y, tok, T16},
      {"tokens_per_expert", a->tokens_per_expert, 0, 4},
      {"aux_loss", a->aux_loss, 0, 4},
      {"z_loss", a->z_loss, 0, 4},
      {"saved", a->saved, 1, WS256},
      {"workspace", a->workspace, 1, WS256},
  };
  s = check_pointers(ctx, fn, rules, (int)(sizeof rules / sizeof rules[0]));
  if (s) return s;
  s = check_workspace(ctx, fn, 1, a->workspace_bytes, a->saved_bytes);
  if (s) return s;
  if (T == 0 && c->W == 1) return forward_no_tokens(ctx, a);
#ifdef MOK_HAVE_CUDA
  if (ctx->gpu) return mok_cuda_forward(ctx, a); /* replay indices are checked on the device */
#endif
  if (!fused) /* replay routing: K distinct experts in [0, E) per token */
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < K; j++) {
        int32_t e = a->topk_idx[t * K + j];
        if (e < 0 || e >= E)
          return MOK_ERR(ctx, MOK_STATUS_INDEX_OUT_OF_RANGE,
                         "%s: args->topk_idx[%lld, %lld] = %d must be in [0, E = %lld)", fn,
                         (long long)t, (long long)j, e, (long long)E);
        for (int64_t i = 0; i < j; i++)
          if (a->topk_idx[t * K + i] == e)
            return MOK_ERR(ctx, MOK_STATUS_DUPLICATE_INDEX,
                           "%s: args->topk_idx of token %lld names expert %d twice (slots %lld "
                           "and %lld): a token's K experts must be distinct",
                           fn, (long long)t, e, (long long)i, (long long)j);
      }
  return mok_cpu_forward(ctx, a);
}

mok_status_t mok_backward(mok_context_t* ctx, const mok_backward_args_t* a) {
  static const char fn[] = "mok_backward";
  if (!ctx || !registry_has(ctx)) return MOK_STATUS_INVALID_CONTEXT;
  if (!a) return MOK_ERR(ctx, MOK_STATUS_NULL_POINTER, "%s: args is NULL", fn);
  const mok_config_t* c = &ctx->cfg;
  mok_status_t s = check_tokens(ctx, fn, a->num_tokens);
  if (s) return s;
  const int64_t T = a->num_tokens;
  const int tok = T > 0, fused = c->routing == MOK_ROUTING_FUSED, shared = c->Fs > 0;
  const size_t wa = c->wgrad == MOK_WGRAD_FP32_ACCUM ? 4 : T16;
  const ptr_rule_t rules[] = {
      {"x", a->x, tok, T16},
      {"w_router", a->w_router, fused, T16},
      {"w13", a->w13, 1, T16},
      {"w2", a->w2, 1, T16},
      {"b13", a->b13, c->use_expert_bias, T16},
      {"ws13", a->ws13, shared, T16},
      {"ws2", a->ws2, shared, T16},
      {"w_sg", a->w_sg, c->use_shared_gate, T16},
      {"dy", a->dy, tok, T16},
      {"d_aux_loss", a->d_aux_loss, 0, 4},
      {"d_z_loss", a->d_z_loss, 0, 4},
      {"saved", a->saved, 1, WS256},
      {"dx", a->dx, tok, T16},
      {"d_topk_weight", a->d_topk_weight, !fused && tok, T16},
      {"d_w_router", a->d_w_router, 0, wa},
      {"d_b_router", a->d_b_router, 0, wa},
      {"d_w13", a->d_w13, 1, wa},
      {"d_w2", a->d_w2, 1, wa},
      {"d_b13", a->d_b13, c->use_expert_bias, wa},
      {"d_b2", a->d_b2, c->use_expert_bias, wa},
      {"d_ws13", a->d_ws13, shared, wa},
      {"d_ws2", a->d_ws2, shared, wa},
      {"d_w_sg", a->d_w_sg, c->use_shared_gate, wa},
      {"workspace", a->workspace, 1, WS256},
  };
  s = check_pointers(ctx, fn, rules, (int)(sizeof rules / sizeof rules[0]));
  if (s) return s;
  s = check_workspace(ctx, fn, 0, a->workspace_bytes, a->saved_bytes);
  if (s) return s;
  if (T == 0 && c->W == 1) return backward_no_tokens(ctx, a);
#ifdef MOK_HAVE_CUDA
  if (ctx->gpu) return mok_cuda_backward(ctx, a); /* the saved header is checked on the device */
#endif
  s = mok_cpu_saved_check(ctx, a); /* header and every index, before anything is read or written */
  if (s) return s;
  s = mok_cpu_backward(ctx, a);
  /* the CPU backward writes nothing into saved, but keeps the contract: used up */
  if (s == MOK_STATUS_SUCCESS && ctx->cfg.saved_use == MOK_SAVED_REUSE)
    ((mok_saved_header_t*)a->saved)->magic = MOK_SAVED_USED;
  return s;
}

mok_status_t mok_context_sync(mok_context_t* ctx) {
  if (!ctx || !registry_has(ctx)) return MOK_STATUS_INVALID_CONTEXT;
#ifdef MOK_HAVE_CUDA
  if (ctx->gpu) return mok_cuda_sync(ctx);
#endif
  return MOK_STATUS_SUCCESS;
}
