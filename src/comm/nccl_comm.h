/* nccl_comm.h — the NCCL layer of expert parallelism on GPUs (docs/DISTRIBUTED.md):
 * libnccl.so.2 loaded at run time (W = 1 needs no NCCL), a communicator per rank from
 * a unique id, and symmetric windows that kernels reach through NCCL's device API
 * (ncclGetPeerPointer). Never a multicast object: NCCL_NVLS_ENABLE is set to 0 before
 * the first communicator when the environment has not set it. A loopback id
 * (mok_comm_loopback_id) takes the same calls for W ranks of one process on one GPU,
 * without NCCL: cudaMalloc windows, every rank's address handed out in process. */
#ifndef MOK_COMM_NCCL_COMM_H
#define MOK_COMM_NCCL_COMM_H
#include <stddef.h>

#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mok_nccl_comm mok_nccl_comm_t;

/* Loads libnccl.so.2 once per process (the loader's path, then the directory the
 * build found NCCL in). On failure: MOK_STATUS_BACKEND_UNAVAILABLE, why in err. */
mok_status_t mok_nccl_load(char* err, size_t err_size);

/* A new unique id (MOK_COMM_UNIQUE_ID_BYTES) into id. */
mok_status_t mok_nccl_unique_id(void* id, char* err, size_t err_size);

/* unique_id: MOK_COMM_UNIQUE_ID_BYTES from mok_comm_unique_id (or mok_comm_loopback_id)
 * on one rank, shared with all. Collective over the W ranks (one thread or process each, its device current). */
mok_status_t mok_nccl_comm_create(const void* unique_id, int W, int rank, mok_nccl_comm_t** out, char* err,
                                  size_t err_size);

/* A symmetric window of `bytes` on every rank (collective): *local is this rank's
 * memory, *window the ncclWindow_t kernels pass to ncclGetPeerPointer. Zeroed. */
mok_status_t mok_nccl_window_alloc(mok_nccl_comm_t* c, size_t bytes, void** local, void** window, char* err,
                                   size_t err_size);
void mok_nccl_window_free(mok_nccl_comm_t* c, void* local, void* window); /* collective */

/* out[i * W + r] = the address of byte offsets[i] of rank r's copy of the window, as
 * this rank's kernels reach it (ncclGetPeerPointer, run once here: the kernels then
 * take plain pointers). n <= 16 offsets. */
mok_status_t mok_nccl_peer_pointers(mok_nccl_comm_t* c, void* window, const size_t* offsets, int n, void** out,
                                    char* err, size_t err_size);

/* Loopback ids (mok_comm_loopback_id): W ranks of one process on one GPU, windows in
 * that GPU's memory, the same peer table; no NCCL is loaded. */
void mok_nccl_loopback_id(void* id);
int mok_nccl_is_loopback_id(const void* unique_id);

/* abort = 1 after a timeout: ncclCommAbort, which does not wait for peers. */
void mok_nccl_comm_destroy(mok_nccl_comm_t* c, int abort);

#ifdef __cplusplus
}
#endif
#endif
