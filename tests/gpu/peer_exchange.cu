// peer_exchange.cu — the kernel-side step of expert parallelism (docs/DISTRIBUTED.md),
// driven by tests/gpu/test_gpu_comm.c: W ranks in one process (a thread each; a GPU
// each, or all on one GPU through a loopback id) make one communicator from a unique id
// and a symmetric window; each rank's kernel writes rows into every peer's window
// through the peer table the library's kernels use (mok_nccl_peer_pointers), publishes
// them with a system-scope release of a flag holding the step serial, and checks what
// the peers wrote after a bounded acquire.
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "comm/nccl_comm.h"
#include "comm/peer.cuh"

namespace {

constexpr int kRows = 4096;               // 16-byte rows each rank sends each peer
constexpr size_t kDataOffset = 4096;      // flags [W] uint64 first, then data [W][kRows]
constexpr int kMaxRanks = 8;

__device__ uint4 row_value(int src, int i, uint64_t serial) {
  return make_uint4((unsigned)src, (unsigned)i, (unsigned)serial, 0x6d6f6bu);
}

// Every rank's copy of the window: flags [W] uint64 at its start, data [W][kRows] after.
struct PeerTable {
  uint64_t* flags[kMaxRanks];
  uint4* data[kMaxRanks];
};

// bad: rows that differ from what the peers should have written, or -1 on a timeout.
__global__ void exchange(const __grid_constant__ PeerTable t, int W, int rank, uint64_t serial, uint64_t timeout_ns,
                         int* bad) {
  for (int peer = 0; peer < W; peer++) {
    if (peer == rank) continue;
    uint4* dst = t.data[peer] + (size_t)rank * kRows;
    for (int i = threadIdx.x; i < kRows; i += blockDim.x) dst[i] = row_value(rank, i, serial);
  }
  __syncthreads();
  if (threadIdx.x < W && threadIdx.x != rank)  // my flag in each peer's window, after my rows
    mok::flag_release_sys(t.flags[threadIdx.x] + rank, serial);
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    for (int peer = 0; peer < W; peer++)
      if (peer != rank && !mok::flag_wait_sys(t.flags[rank] + peer, serial, timeout_ns)) ok = 0;
  }
  __syncthreads();
  if (!ok) {
    if (threadIdx.x == 0) *bad = -1;
    return;
  }
  int n = 0;
  for (int peer = 0; peer < W; peer++) {
    if (peer == rank) continue;
    const uint4* src = t.data[rank] + (size_t)peer * kRows;
    for (int i = threadIdx.x; i < kRows; i += blockDim.x) {
      const uint4 v = src[i], e = row_value(peer, i, serial);
      n += v.x != e.x || v.y != e.y || v.z != e.z || v.w != e.w;
    }
  }
  atomicAdd(bad, n);  // an integer count
}

// result: 1 when the flag of `peer` in this rank's window reached serial in time, else -1.
__global__ void wait_only(const uint64_t* flag, uint64_t serial, uint64_t timeout_ns, int* result) {
  if (threadIdx.x == 0) *result = mok::flag_wait_sys(flag, serial, timeout_ns) ? 1 : -1;
}

struct Rank {
  int W, rank, steps;
  bool loopback;  // every rank on GPU 0
  const void* id;
  int failures;
  double timeout_ms;  // rank 0's wait for a flag nobody sets, when > 0
  char why[256];
};

// One rank's device work on a stream of its own that waits for no other (with every
// rank on one GPU, a wait on the legacy default stream would wait for a peer's kernel);
// the stream waited for before the copy to pageable memory, which blocks its thread in
// the driver (issued while the kernel runs, it kept peers from launching theirs).
int read_int(const int* d, cudaStream_t s) {
  int h = -2;
  if (cudaStreamSynchronize(s) != cudaSuccess || cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, s) != cudaSuccess ||
      cudaStreamSynchronize(s) != cudaSuccess)
    return -2;
  return h;
}

void* run_rank(void* arg) {
  Rank& r = *static_cast<Rank*>(arg);
  char err[256];
  mok_nccl_comm_t* comm = nullptr;
  void *local = nullptr, *win = nullptr;
  int* bad = nullptr;
  cudaStream_t stream = nullptr;
  r.failures = 1;
  if (cudaSetDevice(r.loopback ? 0 : r.rank) != cudaSuccess ||
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    snprintf(r.why, sizeof r.why, "rank %d: cudaSetDevice or cudaStreamCreate failed", r.rank);
    return nullptr;
  }
  if (mok_nccl_comm_create(r.id, r.W, r.rank, &comm, err, sizeof err) != MOK_STATUS_SUCCESS) {
    snprintf(r.why, sizeof r.why, "rank %d: %s", r.rank, err);
    return nullptr;
  }
  if (mok_nccl_window_alloc(comm, kDataOffset + (size_t)r.W * kRows * 16, &local, &win, err, sizeof err) !=
      MOK_STATUS_SUCCESS) {
    snprintf(r.why, sizeof r.why, "rank %d: %s", r.rank, err);
    mok_nccl_comm_destroy(comm, 1);
    return nullptr;
  }
  PeerTable t = {};
  void* ptrs[2 * kMaxRanks];
  const size_t at[2] = {0, kDataOffset};
  if (mok_nccl_peer_pointers(comm, win, at, 2, ptrs, err, sizeof err) != MOK_STATUS_SUCCESS) {
    snprintf(r.why, sizeof r.why, "rank %d: %s", r.rank, err);
    mok_nccl_window_free(comm, local, win);
    mok_nccl_comm_destroy(comm, 1);
    return nullptr;
  }
  for (int p = 0; p < r.W; p++) t.flags[p] = static_cast<uint64_t*>(ptrs[p]), t.data[p] = static_cast<uint4*>(ptrs[r.W + p]);
  cudaMalloc(&bad, sizeof(int));
  r.failures = 0;
  for (int s = 1; s <= r.steps && !r.failures; s++) {
    cudaMemsetAsync(bad, 0, sizeof(int), stream);
    exchange<<<1, 256, 0, stream>>>(t, r.W, r.rank, (uint64_t)s, 5000000000ull, bad);
    const int h = read_int(bad, stream);
    if (h != 0) {
      snprintf(r.why, sizeof r.why, "rank %d step %d: %s", r.rank, s,
               h < 0 ? "a peer's flag did not arrive within 5 s" : "rows from a peer differ from what it wrote");
      r.failures = 1;
    }
  }
  if (!r.failures && r.timeout_ms > 0 && r.rank == 0) {  // a serial no peer will ever publish
    cudaMemsetAsync(bad, 0, sizeof(int), stream);
    timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    wait_only<<<1, 32, 0, stream>>>(t.flags[0] + 1, (uint64_t)r.steps + 100, (uint64_t)(r.timeout_ms * 1e6), bad);
    const int h = read_int(bad, stream);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) * 1e-6;
    if (h != -1 || ms > r.timeout_ms + 2000) {
      snprintf(r.why, sizeof r.why, "timeout case: result %d after %.0f ms (want -1 within %.0f ms + 2 s)", h, ms,
               r.timeout_ms);
      r.failures = 1;
    } else {
      snprintf(r.why, sizeof r.why, "timeout case: the wait gave up after %.0f ms (bound %.0f ms)", ms, r.timeout_ms);
    }
  }
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  cudaFree(bad);
  mok_nccl_window_free(comm, local, win);
  mok_nccl_comm_destroy(comm, 0);
  return nullptr;
}

}  // namespace

// W ranks, `steps` exchanges (loopback: every rank on GPU 0 through a loopback id);
// then, when timeout_ms > 0, rank 0 waits for a serial rank 1 never publishes, which
// must give up after timeout_ms. Returns the failing ranks, reasons (and the timeout
// case's note) in why.
extern "C" int mok_test_peer_exchange(int W, int steps, double timeout_ms, int loopback, char* why, size_t why_size) {
  char err[256];
  unsigned char id[MOK_COMM_UNIQUE_ID_BYTES];
  why[0] = 0;
  if (W > kMaxRanks) return snprintf(why, why_size, "W = %d > %d", W, kMaxRanks), 1;
  if (loopback)
    mok_nccl_loopback_id(id);
  else if (mok_nccl_unique_id(id, err, sizeof err) != MOK_STATUS_SUCCESS)
    return snprintf(why, why_size, "%s", err), 1;
  Rank ranks[kMaxRanks];
  pthread_t threads[kMaxRanks];
  for (int r = 0; r < W; r++) {
    ranks[r] = Rank{W, r, steps, loopback != 0, id, 0, timeout_ms, ""};
    pthread_create(&threads[r], nullptr, run_rank, &ranks[r]);
  }
  int failures = 0;
  for (int r = 0; r < W; r++) {
    pthread_join(threads[r], nullptr);
    failures += ranks[r].failures;
    if (ranks[r].why[0]) {
      const size_t used = strlen(why);
      snprintf(why + used, why_size - used, "%s%s", used ? "; " : "", ranks[r].why);
    }
  }
  return failures;
}
