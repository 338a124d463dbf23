// nccl_comm.cu — libnccl.so.2 through dlopen, communicators and symmetric windows
// (nccl_comm.h). Built only when the build found nccl.h (MOK_HAVE_NCCL).
#include "comm/nccl_comm.h"
#include "cuda/cuda_backend.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <nccl_device.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

// ---- the loopback communicator (mok_comm_loopback_id): W ranks of one process on one
// GPU. Its windows are plain cudaMalloc memory of that GPU, and every rank's addresses
// are handed out through a group in process memory, so the kernels get the same peer
// table as from NCCL (mok_nccl_peer_pointers) and run the same protocol over it; only
// NVLink is not crossed. Collectives (create, window_alloc) meet at a bounded barrier.

namespace {

constexpr char kLoopMagic[8] = {'m', 'o', 'k', 'l', 'o', 'o', 'p', 0};  // id bytes 0..7; 8..15: the group
constexpr int kLoopMaxRanks = 8;
constexpr double kLoopTimeoutS = 60.0;  // a collective waits this long for the other ranks

struct LoopGroup {
  uint64_t key;
  int W, members;
  int arrived;            // at the current barrier
  uint64_t generation;    // barriers completed
  // what each rank published for the collective of generation g, in slot[g % 2]: a rank
  // that leaves a barrier first may publish for the next one before a slower rank has
  // read this one's, but can get no further (the next barrier waits for that rank)
  void* slot[2][kLoopMaxRanks];
  LoopGroup* next;
};

pthread_mutex_t loop_mu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t loop_cv = PTHREAD_COND_INITIALIZER;
LoopGroup* loop_groups;
uint64_t loop_next_key;

// Publishes `mine` as this rank's slot and waits for every rank's, at most the bound;
// then all[r] = rank r's slot. False on a timeout.
bool loop_exchange(LoopGroup* g, int rank, void* mine, void** all) {
  timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += (time_t)kLoopTimeoutS;
  pthread_mutex_lock(&loop_mu);
  const uint64_t gen = g->generation;
  g->slot[gen % 2][rank] = mine;
  bool ok = true;
  if (++g->arrived == g->W) {
    g->arrived = 0, g->generation++;
    pthread_cond_broadcast(&loop_cv);
  }
  while (g->generation == gen && ok) ok = pthread_cond_timedwait(&loop_cv, &loop_mu, &deadline) == 0;
  ok = g->generation != gen;
  if (ok && all) memcpy(all, g->slot[gen % 2], sizeof(void*) * g->W);
  pthread_mutex_unlock(&loop_mu);
  return ok;
}

struct LoopWindow {
  void* base[kLoopMaxRanks];  // every rank's copy of the window
};

}  // namespace

struct mok_nccl_comm {
  ncclComm_t comm;  // NCCL; null for a loopback communicator
  LoopGroup* loop;  // loopback; null for NCCL
  int W, rank;
};

extern "C" int mok_nccl_is_loopback_id(const void* unique_id) {
  return memcmp(unique_id, kLoopMagic, sizeof kLoopMagic) == 0;
}

extern "C" void mok_nccl_loopback_id(void* id) {
  pthread_mutex_lock(&loop_mu);
  const uint64_t key = ++loop_next_key;
  pthread_mutex_unlock(&loop_mu);
  memset(id, 0, MOK_COMM_UNIQUE_ID_BYTES);
  memcpy(id, kLoopMagic, sizeof kLoopMagic);
  memcpy(static_cast<char*>(id) + 8, &key, sizeof key);
}

static mok_status_t loop_comm_create(const void* unique_id, int W, int rank, mok_nccl_comm_t** out, char* err,
                                     size_t err_size) {
  if (W > kLoopMaxRanks) {
    msg(err, err_size, "a loopback communicator has at most %d ranks (W = %d)", kLoopMaxRanks, W);
    return MOK_STATUS_INVALID_ARGUMENT;
  }
  uint64_t key;
  memcpy(&key, static_cast<const char*>(unique_id) + 8, sizeof key);
  pthread_mutex_lock(&loop_mu);
  LoopGroup* g = loop_groups;
  while (g && g->key != key) g = g->next;
  if (!g) {
    g = new LoopGroup{};
    g->key = key, g->W = W, g->next = loop_groups;
    loop_groups = g;
  }
  const bool fits = g->W == W && g->members < W;
  if (fits) g->members++;
  pthread_mutex_unlock(&loop_mu);
  if (!fits) {
    msg(err, err_size, "loopback id: its group has W = %d ranks, %s (this rank: W = %d, rank %d)", g->W,
        g->W == W ? "all of them joined" : "not this W", W, rank);
    return MOK_STATUS_COMM_ERROR;
  }
  *out = new mok_nccl_comm{nullptr, g, W, rank};
  if (!loop_exchange(g, rank, nullptr, nullptr)) {
    msg(err, err_size, "loopback communicator: the other ranks did not join within %.0f s", kLoopTimeoutS);
    mok_nccl_comm_destroy(*out, 1);
    *out = nullptr;
    return MOK_STATUS_COMM_TIMEOUT;
  }
  return MOK_STATUS_SUCCESS;
}

// A new window's memory is zeroed on the library's side stream (mok_cuda_zero_now), so
// that this rank's creation never waits for a peer's kernel already running.
static cudaError_t zero_window(void* p, size_t bytes) { return (cudaError_t)mok_cuda_zero_now(p, bytes); }

static mok_status_t loop_window_alloc(mok_nccl_comm_t* c, size_t bytes, void** local, void** window, char* err,
                                      size_t err_size) {
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes ? bytes : 256);
  if (e == cudaSuccess) e = zero_window(p, bytes);
  // (a rank that failed still takes part, publishing NULL, so that no peer waits in vain)
  LoopWindow* w = new LoopWindow{};
  const bool met = loop_exchange(c->loop, c->rank, e == cudaSuccess ? p : nullptr, w->base);
  bool all = met;
  for (int r = 0; r < c->W && all; r++) all = w->base[r] != nullptr;
  if (e != cudaSuccess || !all) {
    if (p) cudaFree(p);
    delete w;
    if (e != cudaSuccess)
      msg(err, err_size, "a %zu-byte loopback window: %s", bytes, cudaGetErrorString(e));
    else
      msg(err, err_size, "a loopback window: %s", met ? "a peer's allocation failed" : "the peers did not arrive");
    return e == cudaErrorMemoryAllocation ? MOK_STATUS_OUT_OF_MEMORY : MOK_STATUS_COMM_ERROR;
  }
  *local = p, *window = w;
  return MOK_STATUS_SUCCESS;
}

extern "C" mok_status_t mok_nccl_load(char* err, size_t err_size) {
  pthread_once(&load_once, load);
  if (api.get_unique_id) return MOK_STATUS_SUCCESS;
  msg(err, err_size, "%s", load_error);
  return MOK_STATUS_BACKEND_UNAVAILABLE;
}

extern "C" mok_status_t mok_nccl_comm_create(const void* unique_id, int W, int rank, mok_nccl_comm_t** out, char* err,
                                             size_t err_size) {
  *out = nullptr;
  if (mok_nccl_is_loopback_id(unique_id)) return loop_comm_create(unique_id, W, rank, out, err, err_size);
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
  *out = new mok_nccl_comm{comm, nullptr, W, rank};
  return MOK_STATUS_SUCCESS;
}

extern "C" mok_status_t mok_nccl_window_alloc(mok_nccl_comm_t* c, size_t bytes, void** local, void** window,
                                              char* err, size_t err_size) {
  *local = nullptr, *window = nullptr;
  if (c->loop) return loop_window_alloc(c, bytes, local, window, err, err_size);
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
  if (zero_window(p, bytes) != cudaSuccess) {
    api.window_deregister(c->comm, w);
    api.mem_free(p);
    msg(err, err_size, "zeroing a %zu-byte window failed: %s", bytes, cudaGetErrorString(cudaGetLastError()));
    return MOK_STATUS_CUDA_ERROR;
  }
  *local = p, *window = w;
  return MOK_STATUS_SUCCESS;
}

extern "C" void mok_nccl_window_free(mok_nccl_comm_t* c, void* local, void* window) {
  if (c && c->loop) {  // (no collective: each rank frees its own copy)
    delete static_cast<LoopWindow*>(window);
    if (local) cudaFree(local);
    return;
  }
  if (window) api.window_deregister(c->comm, static_cast<ncclWindow_t>(window));
  if (local) api.mem_free(local);
}

extern "C" void mok_nccl_comm_destroy(mok_nccl_comm_t* c, int abort) {
  if (!c) return;
  if (c->loop) {  // the last rank to leave removes the group
    pthread_mutex_lock(&loop_mu);
    if (--c->loop->members == 0) {
      LoopGroup** at = &loop_groups;
      while (*at != c->loop) at = &(*at)->next;
      *at = c->loop->next;
      delete c->loop;
    }
    pthread_mutex_unlock(&loop_mu);
  } else if (abort) {
    api.comm_abort(c->comm);
  } else {
    api.comm_destroy(c->comm);
  }
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

extern "C" mok_status_t mok_nccl_peer_pointers(mok_nccl_comm_t* c, void* window, const size_t* offsets, int n,
                                               void** out, char* err, size_t err_size) {
  const int W = c->W;
  if (n > 16 || W > 8) {
    msg(err, err_size, "mok_nccl_peer_pointers: n = %d > 16 or W = %d > 8", n, W);
    return MOK_STATUS_INVALID_ARGUMENT;
  }
  if (c->loop) {  // every rank's base, handed out at the window's allocation
    const LoopWindow* w = static_cast<const LoopWindow*>(window);
    for (int i = 0; i < n; i++)
      for (int r = 0; r < W; r++) out[i * W + r] = static_cast<char*>(w->base[r]) + offsets[i];
    return MOK_STATUS_SUCCESS;
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
