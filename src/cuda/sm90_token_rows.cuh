// sm90_token_rows.cuh — the memory-bound token tasks' row movers: 16-byte chunks
// through shared memory, a token's slot rows summed in slot order (COMBINE, DXSUM), and
// rows copied by a warp (DISPATCH).
#pragma once
#include "sm90_math.cuh"

namespace mok {

// 8 bf16 (16 bytes, at a shared-memory address) to fp32, and fp32 to 8 bf16 in memory.
__device__ __forceinline__ void ld_shared_bf16x8(uint32_t addr, float (&v)[8]) {
  const uint4 raw = ld_shared_v4(addr);
  const bf16* b = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
  for (int k = 0; k < 8; k++) v[k] = bf(b[k]);
}
// Lane j's pointer, to every lane of the warp (two 32-bit shuffles).
template <class T>
__device__ __forceinline__ T* shfl_ptr(T* p, int j) {
  const uint64_t v = reinterpret_cast<uint64_t>(p);
  const uint32_t lo = __shfl_sync(~0u, (uint32_t)v, j), hi = __shfl_sync(~0u, (uint32_t)(v >> 32), j);
  return reinterpret_cast<T*>((uint64_t)hi << 32 | lo);
}
__device__ __forceinline__ void store_bf16x8(bf16* dst, const float (&v)[8]) {
  uint4 raw;
  bf16* b = reinterpret_cast<bf16*>(&raw);
#pragma unroll
  for (int k = 0; k < 8; k++) b[k] = to_bf(v[k]);
  *reinterpret_cast<uint4*>(dst) = raw;
}

// Token t's slot rows summed, each 16-byte chunk v (8 bf16) of the row: acc = sum over
// slots j in increasing order of (kWeighted: the slot's weight g_j x) row_j[v], row_j =
// peer.rows[idx / e_loc] + pos * H; COMBINE's and DXSUM's sum. Then finish(v, acc, x)
// adds the caller's terms, whose kSlotExtra chunks of v extra(v, x) brought into shared
// memory at x, x + 512, ... (cp_async_16).
// A lane's chunks come through shared memory with cp.async, U a slot and U of the extra
// terms in flight at once, up to kSlotChunks in all: registers held 4 slots' chunks at a
// time, and the sums ran at about a third of HBM's rate. The caller has released the
// stages (release_stages_from_stores); a warp's chunks: [warp][kSlotChunks][32 lanes].
// With kept (W > 1, the forward's COMBINE): a slot whose expert another rank owns is
// read at the slot, kept + (t K + j) H, where that rank's RETURN put it, not from the
// owner's rows.
constexpr int kSlotChunks = 40, kSlotExtra = 4;
static_assert((kThreads / 32) * kSlotChunks * 32 * 16 <= kStages * kStageBytes, "the chunks fit in the stages");
template <bool kWeighted, class Extra, class Finish>
__device__ __forceinline__ void sum_slot_rows(Smem& sm, const PeerRows& peer, const SavedView& sv, const Shape& s,
                                              int t, const bf16* kept, Extra extra, Finish finish) {
  const int K = s.K, nv = s.H / 8, lane = threadIdx.x % 32, U = max(1, kSlotChunks / (K + kSlotExtra));
  const uint32_t buf = smem_addr(sm.stage) + ((threadIdx.x / 32) * kSlotChunks * 32 + lane) * 16;
  // Lane j < K (K <= 32) looks up slot j's row and weight once; every round takes them by
  // shuffle. Looked up slot by slot in each round, they were a chain of dependent loads
  // before the round's first copy.
  const uint4* my_row = nullptr;
  float my_g = 1.f;
  if (lane < K) {
    const int64_t i = (int64_t)t * K + lane;
    const int owner = s.W > 1 ? sv.idx[i] / s.e_loc : 0;  // (W = 1: every expert is this rank's)
    my_row = reinterpret_cast<const uint4*>(kept && owner != s.rank ? kept + i * s.H
                                                                    : peer.rows[owner] + (int64_t)sv.pos[i] * s.H);
    if (kWeighted) my_g = sv.g[i];
  }
  for (int r = 0; r < nv; r += 32 * U) {  // (rounds and shuffles warp-uniform: lanes past nv ride along)
    const int v0 = r + lane;
    for (int j = 0; j < K; j++) {
      const uint4* row = shfl_ptr(my_row, j);
      for (int u = 0; u < U && v0 + 32 * u < nv; u++) cp_async_16(buf + (j * U + u) * 512, row + v0 + 32 * u);
    }
    for (int u = 0; u < U && v0 + 32 * u < nv; u++) extra(v0 + 32 * u, buf + (K * U + u * kSlotExtra) * 512);
    cp_async_wait_all();  // (a lane reads back only its own chunks)
    for (int u = 0; u < U && r + 32 * u < nv; u++) {
      const int v = v0 + 32 * u;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int j = 0; j < K; j++) {
        const float g = kWeighted ? __shfl_sync(~0u, my_g, j) : 1.f;
        if (v >= nv) continue;
        const uint4 raw = ld_shared_v4(buf + (j * U + u) * 512);
        const bf16* x = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
        for (int k = 0; k < 8; k++) acc[k] = __fadd_rn(acc[k], kWeighted ? __fmul_rn(g, bf(x[k])) : bf(x[k]));
      }
      if (v < nv) finish(v, acc, buf + (K * U + u * kSlotExtra) * 512);
    }
  }
}

// A warp copies n <= kCopyRows rows of H bf16, src[k] to dst[k], their 16-byte chunks
// through shared memory with cp.async: kCopyChunks / kCopyRows chunks of each row a lane
// in flight, in the lane's part of the warp's buffer at buf ([row][chunk][32 lanes], 16
// bytes each; a lane reads back only its own chunks). copy_row's registers held 2 to 4
// chunks a lane. The caller has released the stages (release_stages_from_stores).
constexpr int kCopyRows = 3, kCopyChunks = 24;  // (8 warps: 96 KB of the stages)
__device__ __forceinline__ void copy_rows_smem(uint32_t buf, const bf16* const (&src)[kCopyRows],
                                               bf16* const (&dst)[kCopyRows], int n, int H, int lane) {
  const int nv = H / 8, U = kCopyChunks / kCopyRows;
  for (int v0 = lane; v0 < nv; v0 += 32 * U) {
#pragma unroll
    for (int k = 0; k < kCopyRows; k++)
      for (int u = 0; u < U && v0 + 32 * u < nv && k < n; u++)
        cp_async_16(buf + (k * U + u) * 512, reinterpret_cast<const uint4*>(src[k]) + v0 + 32 * u);
    cp_async_wait_all();
#pragma unroll
    for (int k = 0; k < kCopyRows; k++)
      for (int u = 0; u < U && v0 + 32 * u < nv && k < n; u++)
        reinterpret_cast<uint4*>(dst[k])[v0 + 32 * u] = ld_shared_v4(buf + (k * U + u) * 512);
  }
}

// scatter_token_rows' positions: [(t1 - t0) K] ints at the stages' start (K <= 32: 4 KB),
// written by the caller (then cta_sync); the rows' ring follows them.
constexpr uint32_t kScatterPosBytes = 4096;
__device__ __forceinline__ int* scatter_positions(Smem& sm) { return reinterpret_cast<int*>(sm.stage); }
// Thread 0: token rows t0 .. t1 - 1 of src [T, H] bf16, each out to its K slot rows,
// dst + pos[u K + j] H (pos: scatter_positions), with the bulk copy engine: a batch of
// the rows into the stages after the positions (as many as fit: all 32 of a task's when
// H <= 3008), then each to its K places. The caller has released the stages
// (release_stages_from_stores). Through cp.async and registers (copy_rows_smem) DISPATCH
// moved about 2.3 TB/s of rows at qwen3-30b-a3b, half the HBM copy rate; bulk copies of
// a row a slot (each token row loaded K times) were 14% shorter there and on deepseek-v3.
// The stores stay in thread 0's bulk group: signal_counter waits for them to land.
__device__ __forceinline__ void scatter_token_rows(Smem& sm, const bf16* src, int t0, int t1, int H, int K,
                                                   bf16* dst) {
  const int* const pos = scatter_positions(sm);
  uint8_t* const ring = sm.stage[0] + kScatterPosBytes;
  const uint32_t row_bytes = (uint32_t)H * 2;
  const int rows = (int)((kStages * kStageBytes - kScatterPosBytes) / row_bytes);
  for (int u0 = 0; u0 < t1 - t0; u0 += rows) {  // (u: the tokens from t0)
    const int m = min(rows, t1 - t0 - u0);
    mbar_arrive_expect_tx(&sm.copy_full, (uint32_t)m * row_bytes);
    for (int u = 0; u < m; u++)
      bulk_load(ring + u * row_bytes, src + (int64_t)(t0 + u0 + u) * H, row_bytes, &sm.copy_full);
    while (!mbar_try_wait(&sm.copy_full, sm.copy_phase)) {
    }
    sm.copy_phase ^= 1;
    for (int u = 0; u < m; u++)
      for (int j = 0; j < K; j++) bulk_store(dst + (int64_t)pos[(u0 + u) * K + j] * H, ring + u * row_bytes, row_bytes);
    bulk_commit();
    bulk_wait_read();  // (the ring is refilled next)
  }
}

// fp32 x 4 (16 bytes) of shared memory at addr, into v[0..3].
__device__ __forceinline__ void ld_shared_f32x4(uint32_t addr, float* v) {
  const uint4 r = ld_shared_v4(addr);
  v[0] = __uint_as_float(r.x), v[1] = __uint_as_float(r.y), v[2] = __uint_as_float(r.z), v[3] = __uint_as_float(r.w);
}

}  // namespace mok
