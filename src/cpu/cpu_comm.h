/* cpu_comm.h — the in-process communicator of the CPU backend: W ranks of one process,
 * one thread each. It is the CPU image of the NCCL symmetric windows the GPU backend
 * uses: every rank registers its exchange buffers once (at context creation), peers
 * write and read them directly, and a bounded barrier orders the phases of a step.
 *
 * Memory ordering: a rank's writes before cpu_comm_barrier() are visible to every rank
 * after it returns (mutex acquire/release). A wait longer than the timeout marks the
 * communicator failed and returns MOK_STATUS_COMM_TIMEOUT on that rank and on every
 * later call of every rank; nothing waits forever. */
#ifndef MOK_CPU_COMM_H
#define MOK_CPU_COMM_H
#include <pthread.h>

#include "../internal.h"

#define MOK_COMM_SLOTS 4 /* pointers a rank can publish per phase */

typedef struct {
  mok_context_t* ctx;              /* the rank's context: recv_rows, ret_rows, config */
  const void* slot[MOK_COMM_SLOTS]; /* what the rank published in the current phase */
  int64_t value[MOK_COMM_SLOTS];
} mok_comm_rank_t;

struct mok_cpu_comm {
  uint64_t magic;
  int num_ranks;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int arrived;         /* ranks at the current barrier */
  uint64_t generation; /* barriers completed */
  int failed;          /* a wait timed out: every later barrier fails at once */
  int attached;        /* ranks with a live context */
  mok_comm_rank_t rank[MOK_MAX_RANKS];
};
#define MOK_COMM_MAGIC 0x6d6f6b2d636f6d6dull

/* Registers ctx as rank cfg.rank (collective; checks that every rank's config agrees on
 * the layer and exchanges config T). */
mok_status_t mok_cpu_comm_attach(mok_cpu_comm_t* comm, mok_context_t* ctx);
void mok_cpu_comm_detach(mok_cpu_comm_t* comm, mok_context_t* ctx);
/* Waits until all ranks arrive, at most timeout_s seconds. */
mok_status_t mok_cpu_comm_barrier(mok_cpu_comm_t* comm, mok_context_t* ctx);

#endif
