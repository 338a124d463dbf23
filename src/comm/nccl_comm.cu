// nccl_comm.cu — libnccl.so.2 through dlopen, communicators and symmetric windows
// (nccl_comm.h). Built only when the build found nccl.h (MOK_HAVE_NCCL).
#include "comm/nccl_comm.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <nccl_device.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static_assert(sizeof(ncclUniqueId) == MOK_COMM_UNIQUE_ID_BYTES, "MOK_COMM_UNIQUE_ID_BYTES");

namespace {

struct NcclApi {
  ncclResult_t (*get_unique_id)(ncclUniqueId*);
  ncclResult_t (*comm_init_rank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*comm_destroy)(ncclComm_t);
  ncclResult_t (*comm_abort)(ncclComm_t);
  ncclResult_t (*mem_alloc)(void**, size_t);
  ncclResult_t (*mem_free)(void*);
  ncclResult_t (*window_register)(ncclComm_t, void*, size_t, ncclWindow_t*, int);
  ncclResult_t (*window_deregister)(ncclComm_t, ncclWindow_t);
  const char* (*error_string)(ncclResult_t);
  ncclResult_t (*get_version)(int*);
};

NcclApi api;
pthread_once_t load_once = PTHREAD_ONCE_INIT;
char load_error[512];

void msg(char* err, size_t n, const char* fmt, ...) {
  if (!err || !n) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, n, fmt, ap);
  va_end(ap);
}

void load() {
  if (!getenv("NCCL_NVLS_ENABLE")) setenv("NCCL_NVLS_ENABLE", "0", 0);  // no multicast objects
  void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
#ifdef MOK_NCCL_LIBDIR
  if (!h) h = dlopen(MOK_NCCL_LIBDIR "/libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
#endif
  if (!h) {
    snprintf(load_error, sizeof load_error, "libnccl.so.2 not found (%s)", dlerror());
    return;
  }
  struct {
    void** slot;
    const char* name;
  } syms[] = {
      {(void**)&api.get_unique_id, "ncclGetUniqueId"},
      {(void**)&api.comm_init_rank, "ncclCommInitRank"},
      {(void**)&api.comm_destroy, "ncclCommDestroy"},
      {(void**)&api.comm_abort, "ncclCommAbort"},
      {(void**)&api.mem_alloc, "ncclMemAlloc"},
      {(void**)&api.mem_free, "ncclMemFree"},
      {(void**)&api.window_register, "ncclCommWindowRegister"},
      {(void**)&api.window_deregister, "ncclCommWindowDeregister"},
      {(void**)&api.error_string, "ncclGetErrorString"},
      {(void**)&api.get_version, "ncclGetVersion"},
  };
  for (auto& s : syms)
    if (!(*s.slot = dlsym(h, s.name))) {
      snprintf(load_error, sizeof load_error, "libnccl.so.2 has no %s: NCCL 2.28 or newer is needed", s.name);
      api.get_unique_id = nullptr;
      return;
    }
  int version = 0;
  api.get_version(&version);
  if (version < 22800) {
    snprintf(load_error, sizeof load_error, "libnccl.so.2 is version %d: 2.28 or newer is needed", version);
    api.get_unique_id = nullptr;
  }
}

}  // namespace

struct mok_nccl_comm {
  ncclComm_t comm;
};

extern "C" mok_status_t mok_nccl_load(char* err, size_t err_size) {
  pthread_once(&load_once, load);
  if (api.get_unique_id) return MOK_STATUS_SUCCESS;
  msg(err, err_size, "%s", load_error);
  return MOK_STATUS_BACKEND_UNAVAILABLE;
}

extern "C" mok_status_t mok_nccl_comm_create(const void* unique_id, int W, int rank, mok_nccl_comm_t** out, char* err,
                                             size_t err_size) {
  *out = nullptr;
  mok_status_t s = mok_nccl_load(err, err_size);
  if (s != MOK_STATUS_SUCCESS) return s;
  ncclUniqueId id;
  memcpy(&id, unique_id, sizeof id);
  ncclComm_t comm;
  ncclResult_t r = api.comm_init_rank(&comm, W, id, rank);
  if (r != ncclSuccess) {
    msg(err, err_size, "ncclCommInitRank(W = %d, rank = %d) failed: %s", W, rank, api.error_string(r));
    return MOK_STATUS_COMM_ERROR;
  }
  *out = new mok_nccl_comm{comm};
  return MOK_STATUS_SUCCESS;
}

extern "C" mok_status_t mok_nccl_window_alloc(mok_nccl_comm_t* c, size_t bytes, void** local, void** window,
                                              char* err, size_t err_size) {
  *local = nullptr, *window = nullptr;
  bytes = (bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT * NCCL_WIN_REQUIRED_ALIGNMENT;
  void* p = nullptr;
  ncclResult_t r = api.mem_alloc(&p, bytes);
  if (r != ncclSuccess) {
    msg(err, err_size, "ncclMemAlloc(%zu bytes) failed: %s", bytes, api.error_string(r));
    return MOK_STATUS_OUT_OF_MEMORY;
  }
  ncclWindow_t w;
  r = api.window_register(c->comm, p, bytes, &w, NCCL_WIN_COLL_SYMMETRIC);
  if (r != ncclSuccess) {
    api.mem_free(p);
    msg(err, err_size, "ncclCommWindowRegister(%zu bytes, symmetric) failed: %s", bytes, api.error_string(r));
    return MOK_STATUS_COMM_ERROR;
  }
  if (cudaMemset(p, 0, bytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
    api.window_deregister(c->comm, w);
    api.mem_free(p);
    msg(err, err_size, "zeroing a %zu-byte window failed: %s", bytes, cudaGetErrorString(cudaGetLastError()));
    return MOK_STATUS_CUDA_ERROR;
  }
  *local = p, *window = w;
  return MOK_STATUS_SUCCESS;
}

extern "C" void mok_nccl_window_free(mok_nccl_comm_t* c, void* local, void* window) {
  if (window) api.window_deregister(c->comm, static_cast<ncclWindow_t>(window));
  if (local) api.mem_free(local);
}

extern "C" void mok_nccl_comm_destroy(mok_nccl_comm_t* c, int abort) {
  if (!c) return;
  if (abort) api.comm_abort(c->comm);
  else api.comm_destroy(c->comm);
  delete c;
}

extern "C" mok_status_t mok_nccl_unique_id(void* id, char* err, size_t err_size) {
  mok_status_t s = mok_nccl_load(err, err_size);
  if (s != MOK_STATUS_SUCCESS) return s;
  ncclUniqueId u;
  ncclResult_t r = api.get_unique_id(&u);
  if (r != ncclSuccess) {
    msg(err, err_size, "ncclGetUniqueId failed: %s", api.error_string(r));
    return MOK_STATUS_COMM_ERROR;
  }
  memcpy(id, &u, sizeof u);
  return MOK_STATUS_SUCCESS;
}

namespace {
// out[i * W + r] = rank r's address of byte in[i] of the window (in: n offsets, W <= 8)
__global__ void peer_pointers(ncclWindow_t win, int W, const size_t* in, int n, void** out) {
  const int i = threadIdx.x / 8, r = threadIdx.x % 8;
  if (i < n && r < W) out[i * W + r] = ncclGetPeerPointer(win, in[i], r);
}
}  // namespace

extern "C" mok_status_t mok_nccl_peer_pointers(void* window, int W, const size_t* offsets, int n, void** out,
                                               char* err, size_t err_size) {
  if (n > 16 || W > 8) {
    msg(err, err_size, "mok_nccl_peer_pointers: n = %d > 16 or W = %d > 8", n, W);
    return MOK_STATUS_INVALID_ARGUMENT;
  }
  void* d = nullptr;  // [n] offsets, then [n][W] pointers
  const size_t in_bytes = sizeof(size_t) * n, out_bytes = sizeof(void*) * n * W;
  cudaError_t e = cudaMalloc(&d, in_bytes + out_bytes);
  if (e == cudaSuccess) e = cudaMemcpy(d, offsets, in_bytes, cudaMemcpyHostToDevice);
  void** d_out = reinterpret_cast<void**>(static_cast<char*>(d) + in_bytes);
  if (e == cudaSuccess) {
    peer_pointers<<<1, 128>>>(static_cast<ncclWindow_t>(window), W, static_cast<const size_t*>(d), n, d_out);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMemcpy(out, d_out, out_bytes, cudaMemcpyDeviceToHost);
  cudaFree(d);
  if (e != cudaSuccess) {
    msg(err, err_size, "peer pointers of a window: %s", cudaGetErrorString(e));
    return MOK_STATUS_CUDA_ERROR;
  }
  for (int i = 0; i < n * W; i++)
    if (!out[i]) {
      msg(err, err_size, "rank %d's window is not reachable by load/store from this GPU (ncclGetPeerPointer gave "
          "NULL): the CUDA backend needs every rank in one NVLink domain", i % W);
      return MOK_STATUS_BACKEND_UNAVAILABLE;
    }
  return MOK_STATUS_SUCCESS;
}
