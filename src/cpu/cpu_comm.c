/* cpu_comm.c — in-process communicator for W CPU ranks (see cpu_comm.h). */
#include "cpu_comm.h"

#include <errno.h>
#include <stdlib.h>
#include <time.h>

mok_status_t mok_cpu_comm_create(int num_ranks, mok_cpu_comm_t** comm) {
  if (!comm) return MOK_STATUS_NULL_POINTER;
  *comm = NULL;
  if (num_ranks < 1 || num_ranks > MOK_MAX_RANKS) return MOK_STATUS_INVALID_ARGUMENT;
  mok_cpu_comm_t* c = calloc(1, sizeof *c);
  if (!c) return MOK_STATUS_OUT_OF_MEMORY;
  c->magic = MOK_COMM_MAGIC;
  c->num_ranks = num_ranks;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  *comm = c;
  return MOK_STATUS_SUCCESS;
}

mok_status_t mok_cpu_comm_destroy(mok_cpu_comm_t* comm) {
  if (!comm || comm->magic != MOK_COMM_MAGIC) return MOK_STATUS_INVALID_ARGUMENT;
  pthread_mutex_lock(&comm->mu);
  int busy = comm->attached;
  pthread_mutex_unlock(&comm->mu);
  if (busy) return MOK_STATUS_COMM_ERROR; /* destroy the contexts first */
  comm->magic = 0;
  pthread_cond_destroy(&comm->cv);
  pthread_mutex_destroy(&comm->mu);
  free(comm);
  return MOK_STATUS_SUCCESS;
}

mok_status_t mok_cpu_comm_barrier(mok_cpu_comm_t* comm, mok_context_t* ctx) {
  double timeout = ctx->cfg.comm_timeout_s;
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += (time_t)timeout;
  deadline.tv_nsec += (long)((timeout - (double)(time_t)timeout) * 1e9);
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec += 1;
    deadline.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&comm->mu);
  if (comm->failed) {
    pthread_mutex_unlock(&comm->mu);
    return MOK_ERR(ctx, MOK_STATUS_COMM_TIMEOUT,
                   "rank %d: the communicator failed earlier (a peer did not arrive)",
                   ctx->cfg.rank);
  }
  uint64_t gen = comm->generation;
  if (++comm->arrived == comm->num_ranks) {
    comm->arrived = 0;
    comm->generation++;
    pthread_cond_broadcast(&comm->cv);
    pthread_mutex_unlock(&comm->mu);
    return MOK_STATUS_SUCCESS;
  }
  while (comm->generation == gen && !comm->failed) {
    int rc = pthread_cond_timedwait(&comm->cv, &comm->mu, &deadline);
    if (rc == ETIMEDOUT && comm->generation == gen) {
      comm->failed = 1;
      pthread_cond_broadcast(&comm->cv);
      break;
    }
  }
  int ok = comm->generation != gen;
  pthread_mutex_unlock(&comm->mu);
  if (ok) return MOK_STATUS_SUCCESS;
  return MOK_ERR(ctx, MOK_STATUS_COMM_TIMEOUT,
                 "rank %d: peers did not arrive within comm_timeout_s = %.3g s", ctx->cfg.rank,
                 timeout);
}

/* The fields every rank must agree on: the layer itself. */
static int same_layer(const mok_config_t* a, const mok_config_t* b) {
  return a->H == b->H && a->F == b->F && a->E == b->E && a->K == b->K && a->W == b->W &&
         a->routing == b->routing && a->score == b->score && a->normalize == b->normalize &&
         a->route_scale == b->route_scale && a->use_bias_select == b->use_bias_select &&
         a->aux_loss_coef == b->aux_loss_coef && a->z_loss_coef == b->z_loss_coef &&
         a->n_group == b->n_group && a->topk_group == b->topk_group && a->group_score == b->group_score &&
         a->use_router_bias == b->use_router_bias && a->use_expert_bias == b->use_expert_bias &&
         a->activation == b->activation && a->swiglu_alpha == b->swiglu_alpha && a->swiglu_limit == b->swiglu_limit &&
         a->use_shared_gate == b->use_shared_gate &&
         a->Fs == b->Fs && a->numerics == b->numerics && a->wgrad == b->wgrad;
}

mok_status_t mok_cpu_comm_attach(mok_cpu_comm_t* comm, mok_context_t* ctx) {
  int r = ctx->cfg.rank;
  pthread_mutex_lock(&comm->mu);
  int taken = comm->rank[r].ctx != NULL;
  if (!taken) {
    comm->rank[r].ctx = ctx;
    comm->attached++;
  }
  pthread_mutex_unlock(&comm->mu);
  if (taken)
    return MOK_ERR(ctx, MOK_STATUS_COMM_ERROR,
                   "cfg.rank = %d: that rank of cpu_comm already has a live context", r);
  mok_status_t s = mok_cpu_comm_barrier(comm, ctx);
  if (s != MOK_STATUS_SUCCESS) {
    mok_cpu_comm_detach(comm, ctx);
    return s;
  }
  /* every rank now reads every config; all come to the same verdict, and leave only
   * after the second barrier, when nobody reads another's config any more */
  mok_status_t verdict = MOK_STATUS_SUCCESS;
  for (int p = 0; p < comm->num_ranks && !verdict; p++) {
    const mok_config_t* pc = &comm->rank[p].ctx->cfg;
    if (!same_layer(&ctx->cfg, pc))
      verdict = MOK_ERR(ctx, MOK_STATUS_INVALID_ARGUMENT,
                        "rank %d: its config differs from rank %d's in the layer (H, F, E, K, W, "
                        "router, Fs, numerics and wgrad must agree)",
                        r, p);
    ctx->T_all[p] = pc->T;
  }
  /* cfg.capacity is at most the rows that can ever arrive (mok.h) */
  const int64_t most = verdict ? 0 : mok_capacity_max(&ctx->cfg, ctx->T_all);
  for (int p = 0; p < comm->num_ranks && !verdict; p++) {
    const int64_t cap = comm->rank[p].ctx->cfg.capacity;
    if (cap > most)
      verdict = MOK_ERR(ctx, MOK_STATUS_INVALID_SHAPE,
                        "rank %d: cfg.capacity = %lld of rank %d exceeds the most rows a rank can receive, "
                        "%lld = (sum of every rank's cfg.T) * min(K, E / W)",
                        r, (long long)cap, p, (long long)most);
  }
  s = mok_cpu_comm_barrier(comm, ctx);
  if (s == MOK_STATUS_SUCCESS) s = verdict;
  if (s != MOK_STATUS_SUCCESS) mok_cpu_comm_detach(comm, ctx);
  return s;
}

void mok_cpu_comm_detach(mok_cpu_comm_t* comm, mok_context_t* ctx) {
  pthread_mutex_lock(&comm->mu);
  if (comm->rank[ctx->cfg.rank].ctx == ctx) {
    comm->rank[ctx->cfg.rank].ctx = NULL;
    comm->attached--;
  }
  pthread_mutex_unlock(&comm->mu);
}
