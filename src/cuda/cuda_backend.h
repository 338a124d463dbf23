/* cuda_backend.h — the Hopper backend as the host library sees it (C linkage). Built
 * only when nvcc is found (MOK_HAVE_CUDA); api.c validates arguments before calling. */
#ifndef MOK_CUDA_BACKEND_H
#define MOK_CUDA_BACKEND_H
#include "../internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Checks the device (sm_90, CUDA-capable) and the shape rules of the kernels, and
 * allocates the context's device state. */
mok_status_t mok_cuda_create(mok_context_t* ctx);
void mok_cuda_destroy(mok_context_t* ctx);
/* saved's bytes, and the workspace a forward and a backward each need (null: not asked) */
void mok_cuda_sizes(const mok_context_t* ctx, size_t* saved_bytes, size_t* forward_ws_bytes, size_t* backward_ws_bytes);
mok_status_t mok_cuda_forward(mok_context_t* ctx, const mok_forward_args_t* a);
mok_status_t mok_cuda_backward(mok_context_t* ctx, const mok_backward_args_t* a);
/* Zeroes bytes at device pointer dst on stream (a step of no tokens: its outputs). */
mok_status_t mok_cuda_zero(mok_context_t* ctx, void* dst, size_t bytes, void* stream);
/* Zeroes bytes at device pointer p of the current device, done when it returns; on a
 * non-blocking stream of the library's, never the legacy default stream (W ranks on one
 * GPU: that stream would wait for a peer's kernel). Returns a cudaError_t. */
int mok_cuda_zero_now(void* p, size_t bytes);
/* Waits for the context's last launch and returns the status its kernel raised. */
mok_status_t mok_cuda_sync(mok_context_t* ctx);

#ifdef __cplusplus
}
#endif
#endif
