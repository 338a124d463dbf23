// sm90_epilogues.cuh — what a GEMM task does with its accumulators: through sm.epi and
// 16-byte stores, or as 128 x 64 boxes through TMA stores; the expert biases; the SwiGLU
// forward and backward epilogues.
#pragma once
#include "sm90_math.cuh"
#include "sm90_tile_gemm.cuh"

namespace mok {

// ---- epilogues: accumulators -> sm.epi -> 16-byte global stores ----
// The plain layout of sm.epi: 128 rows of 256 bytes (128 bf16 or 64 fp32 columns), the
// 16-byte chunk c of row r at chunk c ^ r % 8, so that the 8 rows a warp writes at once
// fall in different banks. A 128 x 256 tile passes through in 2 (bf16) or 4 (fp32) parts.

// sm.epi may be written: the previous tile's TMA stores (thread 0's) have read it and
// every thread is done with it.
// kPending: the newest store groups that may still be reading (other buffers than sm.epi).
template <int kPending = 0>
__device__ __forceinline__ void epi_acquire(Smem& sm) {
  if (tid_here() == 0) {
    MOK_STALL_FROM(kStallEpiStores);
    bulk_wait_read<kPending>();
    MOK_STALL_ADD(kStallEpiStores);
  }
  MOK_STALL_FROM(kStallEpiBarrier);
  cta_sync();
  MOK_STALL_ADD(kStallEpiBarrier);
}

// Accumulator pairs [i0, i0 + n) into sm.epi (n = 16 bf16 or 8 fp32: one part), at their
// column minus 8 * i0.
template <bool kBf16>
__device__ __forceinline__ void epi_put(Smem& sm, const float (&acc)[kAcc], int wg, int w, int l, int i0, int n) {
  epi_acquire(sm);
  const int r = acc_row(wg, w, l, 0), sw = r % 8, q = l % 4;  // rows r and r + 8: same r % 8
  const uint32_t row0 = smem_addr(sm.epi) + r * 256, row1 = row0 + 8 * 256;
#pragma unroll
  for (int i = 0; i < kAcc / 4; i++) {
    if (i < i0 || i >= i0 + n) continue;
    if (kBf16) {  // byte 16 (i - i0) + 4q: chunk i - i0
      const uint32_t c = (((i - i0) ^ sw) * 16) + 4 * q;
      st_shared_b32(row0 + c, pack_bf16x2(acc[4 * i], acc[4 * i + 1]));
      st_shared_b32(row1 + c, pack_bf16x2(acc[4 * i + 2], acc[4 * i + 3]));
    } else {  // byte 32 (i - i0) + 8q: chunk 2 (i - i0) + q / 2
      const uint32_t c = (((2 * (i - i0) + q / 2) ^ sw) * 16) + 8 * (q % 2);
      st_shared_v2f32(row0 + c, acc[4 * i], acc[4 * i + 1]);
      st_shared_v2f32(row1 + c, acc[4 * i + 2], acc[4 * i + 3]);
    }
  }
  cta_sync();
}

// 16-byte piece c (of 16) of tile row r of sm.epi in the plain layout.
__device__ __forceinline__ uint4 epi_piece(const Smem& sm, int r, int c) {
  return *reinterpret_cast<const uint4*>(sm.epi + r * 256 + ((c ^ (r % 8)) * 16));
}

// ---- epilogues through TMA stores ----
// A bf16 tile goes into shared memory as 128 x 64 boxes (16 KB each) in the TMA 128-byte
// swizzle: 16-byte chunk j of row r sits at chunk j ^ r % 8, so the 8 rows a warp writes
// at once hit 32 banks. Then TMA stores (thread 0; the copy engine writes them while the
// next tile's wgmmas run) take a whole tile in 128-row boxes, or a tile cut short by the
// end of an expert's rows in 16-row boxes, its last rows < 16 through 16-byte stores.
// The boxes live in sm.epi (two) and, when gemm_tiles passes one, in the spare stage
// (three): a whole bf16 tile then goes out in one round. Store groups from the spare are
// committed before the last group from sm.epi (gemm_tiles' refill of the spare waits
// for all groups but the newest).
constexpr int kStoreRows = 16;
constexpr int kBox = BM * 128;  // bytes of a 128 x 64 bf16 box

// Boxes [0, kBoxes) of the buffer at shared address buf from pair(i, h): the packed bf16
// pair of accumulator pair i = 8 (b0 + b) + j (columns 8i + 2(lane%4), +1) in row half h.
// Between epi_acquire() and epi_publish().
template <int kBoxes, class Pair>
__device__ __forceinline__ void epi_put_boxes(uint32_t buf, int wg, int w, int l, int b0, Pair pair) {
  // rows r and r + 8 share r % 8 = (lane / 4) % 8: one swizzle for both
  const int r = acc_row(wg, w, l, 0), sw = r % 8;
  const uint32_t row0 = buf + r * 128 + 4 * (l % 4), row1 = row0 + 8 * 128;
#pragma unroll
  for (int j = 0; j < 8; j++) {  // chunk j of each box: accumulator pairs i = 8 b + j
    const uint32_t c = (j ^ sw) * 16;
#pragma unroll
    for (int b = 0; b < kBoxes; b++) {
      st_shared_b32(row0 + b * kBox + c, pair(8 * (b0 + b) + j, 0));
      st_shared_b32(row1 + b * kBox + c, pair(8 * (b0 + b) + j, 1));
    }
  }
}

// epi_put_boxes through stmatrix, a quarter of the store instructions: one writes the
// warp's 16 rows x 16 columns (chunks j, j + 1 of a box: four 8 x 8 matrices, h = 0 and
// 1 of each chunk); lane l gives the address of row l % 8 of matrix l / 8, whose 8 rows
// fall in 8 different 16-byte bank groups through the swizzle. (Plain bf16 tiles only:
// in the SwiGLU epilogue its four live pairs make the forward spill.)
template <int kBoxes, class Pair>
__device__ __forceinline__ void epi_stmatrix_boxes(uint32_t buf, int wg, int w, int l, int b0, Pair pair) {
  const int q = l / 8, rr = l % 8;                         // matrix q: row half q % 2, chunk j + q / 2
  const int r = acc_row(wg, w, 0, 0) + rr + 8 * (q % 2);  // (acc_row(.., 0, 0) is a multiple of 8)
  const uint32_t row = buf + r * 128;
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    const uint32_t c = ((j + q / 2) ^ rr) * 16;
#pragma unroll
    for (int b = 0; b < kBoxes; b++) {
      const int i = 8 * (b0 + b) + j;
      stmatrix_x4(row + b * kBox + c, pair(i, 0), pair(i, 1), pair(i + 1, 0), pair(i + 1, 1));
    }
  }
}

// The boxes just written are complete for every thread and for the TMA stores.
__device__ __forceinline__ void epi_publish(Smem& sm) {
  fence_proxy_async_smem();
  MOK_STALL_FROM(kStallEpiBarrier);
  cta_sync();
  MOK_STALL_ADD(kStallEpiBarrier);
}

// Rows [0, rows) of boxes [0, nb) at buf out, as one store group: store(b, map, r, src)
// issues the TMA store of box b from its row r at src through map (or skips the box), map
// one of st's; dst(b, r) is where row r of box b goes (64 bf16), or null. Returns whether
// threads read buf for rows past the last whole 16-row box.
template <class Store, class Dst>
__device__ __forceinline__ bool epi_write_boxes(Smem& sm, const uint8_t* buf, const StoreMap* st, int nb, int rows,
                                                Store store, Dst dst) {
  const int tid = tid_here();
  const int full = rows == BM ? 1 : rows / kStoreRows, height = rows == BM ? BM : kStoreRows;
  if (tid == 0) {
    MOK_STALL_FROM(kStallEpiIssue);
    const CUtensorMap* map = rows == BM ? &st->full : &st->part;
    for (int rg = 0; rg < full; rg++)
      for (int b = 0; b < nb; b++) store(b, map, rg * height, buf + b * kBox + rg * (height * 128));
    bulk_commit();
    MOK_STALL_ADD(kStallEpiIssue);
  }
  const int first = height * full, rest = rows - first;
  for (int q = tid; q < rest * nb * 8; q += kThreads) {
    const int r = first + q / (nb * 8), b = (q / 8) % nb, j = q % 8;
    bf16* d = dst(b, r);
    if (d)
      *reinterpret_cast<uint4*>(d + 8 * j) =
          *reinterpret_cast<const uint4*>(buf + b * kBox + r * 128 + ((j ^ (r % 8)) * 16));
  }
  return rest > 0;
}

// A bf16 tile: rows [row0, row_end) x columns [c0, ncols) of out (ld a row), whose row
// row0 is row map_row of the store map. With a spare stage: one round (columns c0 + 128..
// from the spare first, then c0.. from sm.epi); without: two rounds through sm.epi.
__device__ __forceinline__ void store_tile_tma(Smem& sm, const float (&acc)[kAcc], int wg, int w, int l,
                                               const StoreMap* st, int map_row, int row0, int row_end, int c0,
                                               int ncols, bf16* out, int64_t ld, uint8_t* spare) {
  const int rows = min(BM, row_end - row0);
  auto pair = [&](int i, int h) { return pack_bf16x2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]); };
  auto write = [&](const uint8_t* buf, int cb) {  // boxes 0, 1 of buf: columns cb.. cb + 127
    if (rows == BM && st->has_pair) {  // both boxes in one store (the map clips a chunk past ncols)
      if (tid_here() == 0) {
        MOK_STALL_FROM(kStallEpiIssue);
        tma_store_3d(&st->pair, buf, 0, map_row, cb / 64);
        bulk_commit();
        MOK_STALL_ADD(kStallEpiIssue);
      }
      return false;
    }
    return epi_write_boxes(
        sm, buf, st, 2, rows,
        [&](int b, const CUtensorMap* map, int r, const uint8_t* src) {
          if (cb + 64 * b < ncols) tma_store_2d(map, src, cb + 64 * b, map_row + r);
        },
        [&](int b, int r) { return cb + 64 * b < ncols ? out + (int64_t)(row0 + r) * ld + cb + 64 * b : nullptr; });
  };
  if (spare) {
    epi_acquire(sm);
    epi_stmatrix_boxes<2>(smem_addr(sm.epi), wg, w, l, 0, pair);
    epi_stmatrix_boxes<2>(smem_addr(spare), wg, w, l, 2, pair);
    epi_publish(sm);
    const bool tail = write(spare, c0 + 128);
    write(sm.epi, c0);
    if (tail) cta_sync();  // the spare's tail rows read before thread 0 refills it
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; half++) {  // boxes 2 half, 2 half + 1 (128 columns)
    epi_acquire(sm);
    epi_stmatrix_boxes<2>(smem_addr(sm.epi), wg, w, l, 2 * half, pair);
    epi_publish(sm);
    write(sm.epi, c0 + 128 * half);
  }
}

// Writes rows [row0, row_end) x columns [c0, ncols) of out (ld elements a row) from the
// 128 x 256 accumulator tile whose first column is c0: bf16 written, fp32 written, or
// fp32 added (one add per element: out = out + acc). ncols and c0 multiples of 8.
// st (bf16 only, may be null): a store map of out whose row map_row is row row0: then
// the tile goes out through TMA stores (store_tile_tma, with gemm_tiles' spare stage).
enum { kStoreBf16, kStoreF32, kAddF32 };
template <int kMode>
__device__ __forceinline__ void store_tile(Smem& sm, const float (&acc)[kAcc], int wg, int w, int l, int row0,
                                           int row_end, int c0, int ncols, void* out, int64_t ld,
                                           const StoreMap* st = nullptr, int map_row = 0, uint8_t* spare = nullptr) {
  constexpr int kElem = kMode == kStoreBf16 ? 2 : 4, kCols = 256 / kElem, kPer16 = 16 / kElem;
  constexpr int kPieces = kCols / kPer16;  // 16 a row
  if (sm.knobs & 2) return;
  if (kMode == kStoreBf16 && st && !(sm.knobs & 8)) {
    store_tile_tma(sm, acc, wg, w, l, st, map_row, row0, row_end, c0, ncols, static_cast<bf16*>(out), ld, spare);
    return;
  }
  for (int part = 0; part < BN / kCols; part++) {
    epi_put<kMode == kStoreBf16>(sm, acc, wg, w, l, part * kCols / 8, kCols / 8);
    if (sm.knobs & 1) continue;
    const int cb = c0 + part * kCols;
    for (int q = tid_here(); q < BM * kPieces; q += kThreads) {
      const int r = q / kPieces, c = (q % kPieces) * kPer16;
      if (row0 + r >= row_end || cb + c >= ncols) continue;
      const uint4 v = epi_piece(sm, r, q % kPieces);
      uint4* g = reinterpret_cast<uint4*>(static_cast<uint8_t*>(out) + ((int64_t)(row0 + r) * ld + cb + c) * kElem);
      if (kMode == kAddF32) {
        const float4 o = *reinterpret_cast<const float4*>(g);
        const float4 a = *reinterpret_cast<const float4*>(&v);
        *reinterpret_cast<float4*>(g) = make_float4(__fadd_rn(o.x, a.x), __fadd_rn(o.y, a.y), __fadd_rn(o.z, a.z), __fadd_rn(o.w, a.w));
      } else {
        *g = v;
      }
    }
  }
}

// The expert biases (cfg.use_expert_bias) into a 128 x 256 accumulator tile before its
// bf16 rounding: one fp32 addition a value. Tile column c < 128 gets lo[c] while c < n_lo,
// c >= 128 hi[c - 128] while c - 128 < n_hi (columns past them are never stored: no
// bias is read there). A thread's pair i is tile column acc_col(l, i) of both its rows;
// the 8 lanes of a warp with the same l % 4 share those columns, so each loads 4 of the
// 32 bias words and the rest come by shuffle (4 registers, not 32: the epilogue has none
// to spare).
__device__ __forceinline__ void add_col_bias(float (&acc)[kAcc], int l, const bf16* lo, int n_lo, const bf16* hi,
                                             int n_hi) {
  constexpr int kPairs = kAcc / 4, kHalf = kPairs / 2;  // 32 pairs, the first 16 in lo
  const int q = l % 4, r = l / 4;
  uint32_t word[kPairs / 8];  // pair r + 8k's bias
#pragma unroll
  for (int k = 0; k < kPairs / 8; k++) {
    const int i = r + 8 * k, c = acc_col(l, i) % 128;  // (n even: a pair's columns both in or both out)
    word[k] = c < (i < kHalf ? n_lo : n_hi) ? __ldg(reinterpret_cast<const unsigned int*>((i < kHalf ? lo : hi) + c)) : 0u;
  }
#pragma unroll
  for (int i = 0; i < kPairs; i++) {
    const uint32_t b = __shfl_sync(~0u, word[i / 8], (i % 8) * 4 + q);
#pragma unroll
    for (int h = 0; h < 2; h++) {
      acc[4 * i + 2 * h] = __fadd_rn(acc[4 * i + 2 * h], bf16_lo(b));
      acc[4 * i + 2 * h + 1] = __fadd_rn(acc[4 * i + 2 * h + 1], bf16_hi(b));
    }
  }
}

// Gate|up tile nt of expert e (gate columns f = nt BF + c, up columns F + f of its 2F)
// plus the expert's biases b13 [E, 2F] (cfg.use_expert_bias; null: none): GEMM1's and the
// backward's recompute (RG) epilogue, the same bits.
__device__ __forceinline__ void add_gate_up_bias(float (&acc)[kAcc], int l, const bf16* b13, int e, int F, int nt) {
  if (!b13) return;
  const bf16* b = b13 + (int64_t)e * 2 * F + nt * BF;
  add_col_bias(acc, l, b, F - nt * BF, b + F, F - nt * BF);
}

// SwiGLU forward epilogue of a gate|up tile (columns 0..127 gate f0.., 128..255 up f0..),
// rows [row0, row_end), f < F: a = bf16(gate | up) into a_rows [.., 2F] (store map st_a:
// [rows][2][F], row map_row = row0), and h = bf16(silu(a_gate) * a_up) into h_rows
// [.., F] (store map st_h). A thread holds gate and up of the same columns (pairs i and
// i + 16), so h comes from registers. With a spare stage two rounds (gate from sm.epi,
// up and h's first box from the spare; then h's second box, once the gate's stores alone
// have read sm.epi), without three. kClamped: gpt-oss's clamped SwiGLU (swiglu_h; alpha,
// limit), the routed experts' under cfg.activation, in the kernels' clamped variants.
template <bool kClamped = false>
__device__ __forceinline__ void swiglu_store(Smem& sm, float (&acc)[kAcc], int wg, int w, int l, int row0, int row_end,
                                             int f0, int F, bf16* a_rows, bf16* h_rows, const StoreMap* st_a,
                                             const StoreMap* st_h, int map_row, uint8_t* spare, float alpha = 0.f,
                                             float limit = 0.f) {
  if (sm.knobs & 2) return;
  const int rows = min(BM, row_end - row0);
  auto apair = [&](int i, int h) { return pack_bf16x2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]); };
  // h from the bf16 gate and up of apair, unpacked by shifts: a bf16 rounding of each
  // value on its own (cvt.rn.bf16.f32) would take the SFU's pipe, 16 a cycle per SM,
  // beside silu's two MUFU (measured on the H200: together they halve the rate).
  auto hpair = [&](int i, int h) {
    const uint32_t g = apair(i, h), u = apair(i + 16, h);
    return pack_bf16x2(swiglu_h<kClamped>(bf16_lo(g), bf16_lo(u), alpha, limit),
                       swiglu_h<kClamped>(bf16_hi(g), bf16_hi(u), alpha, limit));
  };
  auto write_a = [&](const uint8_t* buf, int half) {  // gate (half 0) or up (1): 2 boxes
    epi_write_boxes(
        sm, buf, st_a, 2, rows,
        [&](int b, const CUtensorMap* map, int r, const uint8_t* src) {
          if (f0 + 64 * b < F) tma_store_3d(map, src, f0 + 64 * b, half, map_row + r);
        },
        [&](int b, int r) {
          const int f = f0 + 64 * b;
          return f < F ? a_rows + (int64_t)(row0 + r) * 2 * F + half * F + f : nullptr;
        });
  };
  auto write_h = [&](const uint8_t* buf, int b0, int nb) {  // h boxes b0 .. b0 + nb - 1
    epi_write_boxes(
        sm, buf, st_h, nb, rows,
        [&](int b, const CUtensorMap* map, int r, const uint8_t* src) {
          if (f0 + 64 * (b0 + b) < F) tma_store_2d(map, src, f0 + 64 * (b0 + b), map_row + r);
        },
        [&](int b, int r) {
          const int f = f0 + 64 * (b0 + b);
          return f < F ? h_rows + (int64_t)(row0 + r) * F + f : nullptr;
        });
  };
  if (spare) {
    epi_acquire(sm);
    epi_put_boxes<2>(smem_addr(sm.epi), wg, w, l, 0, apair);
    epi_put_boxes<2>(smem_addr(spare), wg, w, l, 2, apair);
    epi_put_boxes<1>(smem_addr(spare) + 2 * kBox, wg, w, l, 0, hpair);
    epi_publish(sm);
    write_a(sm.epi, 0);  // first: the next round waits for this group alone
    write_a(spare, 1);
    write_h(spare + 2 * kBox, 0, 1);
    epi_acquire<2>(sm);  // (its barrier also orders the tail reads of the spare before a refill)
    epi_put_boxes<1>(smem_addr(sm.epi), wg, w, l, 1, hpair);
    epi_publish(sm);
    write_h(sm.epi, 1, 1);
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; half++) {  // gate (boxes 0, 1), then up (boxes 2, 3)
    epi_acquire(sm);
    epi_put_boxes<2>(smem_addr(sm.epi), wg, w, l, 2 * half, apair);
    epi_publish(sm);
    write_a(sm.epi, half);
  }
  epi_acquire(sm);
  epi_put_boxes<2>(smem_addr(sm.epi), wg, w, l, 0, hpair);
  epi_publish(sm);
  write_h(sm.epi, 0, 2);
}

// SwiGLU backward epilogue of a dh tile (columns f0 .. f0 + 255 of dh, rows [row0,
// row_end)), given a = gate|up (ld_a: a load map of it as [rows][2][F], row a_row =
// row0): d_a = bf16(dh up silu'(gate) | dh silu(gate)) into d_a [.., 2F] (store map
// st_da as [rows][2][F], row map_row = row0). Four rounds, one per 64-column quarter q,
// alternating between the spare stage (q = 0, 2) and sm.epi (q = 1, 3): TMA brings the
// quarter's gate and up boxes (128 x 64 bf16 each, 32 KB), each thread turns the words
// under its own accumulators into d_a words in place (the boxes' swizzled layout is
// epi_put_boxes'), and TMA stores send them to d_a. Quarter q + 2's loads go out once
// quarter q's stores have read the buffer, so they land while quarter q + 1 computes.
// The last store group comes from sm.epi (gemm_tiles' refill of the spare waits for
// all groups but the newest). epi_full[b] completes two phases a tile: quarter q
// waits for parity q / 2. kClamped: the clamped SwiGLU's derivative (docs/CPU.md: d_gate
// = dh (up' + 1) (s + alpha gate' s (1 - s)), 0 where gate > limit; d_up = dh gate' s,
// 0 where |up| > limit; s = sigmoid(alpha gate')).
// with_h: also h = swiglu_h(gate, up) of the same bf16 values, the forward's
// bits, into h_rows [.., F] (store map st_h, row map_row = row0), for WG2 when saved
// holds no h (h_late). Each quarter's h box (128 x 64 bf16) goes through the spare's
// third box, written once the last quarter's h store has read it (a CTA barrier at the
// quarter's start); its store group is committed before the quarter's d_a group, so that
// quarter 3's last group still comes from sm.epi.
template <bool kClamped = false>
__device__ __forceinline__ void swiglu_bwd_store(Smem& sm, float (&acc)[kAcc], int wg, int w, int l, int row0,
                                                 int row_end, int f0, int F, const CUtensorMap* ld_a, int a_row,
                                                 const StoreMap* st_da, int map_row, bf16* d_a, uint8_t* spare,
                                                 bool with_h = false, const StoreMap* st_h = nullptr,
                                                 bf16* h_rows = nullptr, float alpha = 0.f, float limit = 0.f) {
  if (sm.knobs & 2) return;
  const int tid = tid_here(), rows = min(BM, row_end - row0);
  auto load = [&](int q) {  // thread 0: quarter q's gate and up boxes (none past F)
    uint8_t* buf = q % 2 ? sm.epi : spare;
    uint64_t* bar = &sm.epi_full[q % 2];
    const bool in = f0 + 64 * q < F;
    mbar_arrive_expect_tx(bar, in ? 2 * kBox : 0);
    if (in) {
      tma_load_3d(buf, ld_a, bar, f0 + 64 * q, 0, a_row);
      tma_load_3d(buf + kBox, ld_a, bar, f0 + 64 * q, 1, a_row);
    }
  };
  epi_acquire(sm);  // (its CTA barrier: both warpgroups' wgmmas are also done with the spare)
  if (tid == 0) load(0), load(1);
  const int r = acc_row(wg, w, l, 0), sw = r % 8;  // rows r and r + 8: same swizzle
  bool tail = false;  // threads read rows past the last whole 16-row box (the same each quarter)
  // quarter q, its dh values from dh_at(i), i = 4 j + 2 h + x: accumulator 32 q + i
  auto quarter = [&](int q, auto dh_at) {
    uint8_t* buf = q % 2 ? sm.epi : spare;
    MOK_STALL_FROM(kStallEpiLoads);
    while (!mbar_try_wait(&sm.epi_full[q % 2], q / 2)) {
    }
    MOK_STALL_ADD(kStallEpiLoads);
    if (with_h && q > 0) {
      // the last quarter's h store has read the h box: quarters 1, 2 follow thread 0's wait for
      // every group (before load(q + 1)); quarter 3's for all but the newest (quarter 2's
      // d_a, committed after its h)
      if (q == 3 && tid == 0) bulk_wait_read<1>();
      cta_sync();
    }
    if (f0 + 64 * q < F) {
      const uint32_t row_a = smem_addr(buf) + r * 128 + 4 * (l % 4);
      const uint32_t h_at = smem_addr(spare) + 2 * kBox - smem_addr(buf);  // (h's box, the spare's third: gate's plus this)
#pragma unroll
      for (int j = 0; j < 8; j++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const uint32_t at = row_a + h * 8 * 128 + (j ^ sw) * 16;  // gate; up one box on
          const uint32_t g2 = ld_shared_b32(at), u2 = ld_shared_b32(at + kBox);
          float dg[2], du[2], hv[2];
#pragma unroll
          for (int x = 0; x < 2; x++) {
            const float gate = x ? bf16_hi(g2) : bf16_lo(g2);
            const float up = x ? bf16_hi(u2) : bf16_lo(u2);
            const float dh = dh_at(4 * j + 2 * h + x);
            if constexpr (kClamped) {
              const float gc = clamp_gate(gate, limit), ag = __fmul_rn(alpha, gc), sg = sigmoid_fast(ag);
              const float dglu = __fadd_rn(sg, __fmul_rn(__fmul_rn(ag, sg), __fsub_rn(1.f, sg)));
              dg[x] = gate > limit ? 0.f : __fmul_rn(__fmul_rn(dh, __fadd_rn(clamp_up(up, limit), 1.f)), dglu);
              du[x] = up > limit || up < -limit ? 0.f : __fmul_rn(dh, __fmul_rn(gc, sg));
              hv[x] = swiglu_h_clamped(gc, sg, up, limit);
            } else {
              float si;
              swiglu_bwd(gate, up, dh, dg[x], du[x], si);
              hv[x] = __fmul_rn(si, up);  // (swiglu_h<false>'s operations)
            }
          }
          st_shared_b32(at, pack_bf16x2(dg[0], dg[1]));
          st_shared_b32(at + kBox, pack_bf16x2(du[0], du[1]));
          st_shared_b32(at + h_at, pack_bf16x2(hv[0], hv[1]));  // (without with_h unread: no predicate)
        }
      }
      epi_publish(sm);
      if (with_h)  // (its tail rows: as d_a's, below)
        epi_write_boxes(
            sm, spare + 2 * kBox, st_h, 1, rows,
            [&](int, const CUtensorMap* map, int rr, const uint8_t* src) { tma_store_2d(map, src, f0 + 64 * q, map_row + rr); },
            [&](int, int rr) { return h_rows + (int64_t)(row0 + rr) * F + f0 + 64 * q; });
      tail = epi_write_boxes(
          sm, buf, st_da, 2, rows,
          [&](int b, const CUtensorMap* map, int rr, const uint8_t* src) {
            tma_store_3d(map, src, f0 + 64 * q, b, map_row + rr);
          },
          [&](int b, int rr) { return d_a + (int64_t)(row0 + rr) * 2 * F + b * F + f0 + 64 * q; });
    }
    if (q < 2) {
      // Before thread 0 arms the barrier's next phase, every thread must be past its
      // wait on this one: the tail rows read before the buffer is refilled, and with no
      // quarter q (F - f0 <= 64: gpt-oss's 2880, the tests' 64, 320, 576) nothing else
      // orders them, and load(q + 2) completes at once (no bytes); a thread still polling
      // would then see the parity it waits for come round again and wait for the next
      // tile's phase: a hang (found by racecheck's slow warps, branch pairs-nopad).
      if (tail || f0 + 64 * q >= F) cta_sync();
      if (tid == 0) {
        MOK_STALL_FROM(kStallEpiStores);
        bulk_wait_read();
        MOK_STALL_ADD(kStallEpiStores);
        load(q + 2);
      }
    }
  };
  // The first quarter unrolled (its accumulators then die), the other three one loop
  // body taking theirs by selects among constant indices: the four quarters unrolled
  // were 2400 instructions a tile that missed the instruction cache (docs/PERF.md,
  // seventeenth session); one loop over all four keeps all 128 accumulators live through
  // it and spilled (twenty-first session).
  quarter(0, [&](int i) { return acc[i]; });
#pragma unroll 1
  for (int q = 1; q < 4; q++)
    quarter(q, [&](int i) { return q == 1 ? acc[32 + i] : q == 2 ? acc[64 + i] : acc[96 + i]; });
  if (tail) cta_sync();
  // no quarter 3 (the last tile of an F that is not a multiple of 256): the last group
  // came from the spare, so it must be read before gemm_tiles refills the spare
  if (tid == 0 && f0 + 192 >= F) bulk_wait_read();
}

// GEMM phases over (m-tile, column group): the ticket order visits a band of m-tiles for
// each column group before the next, so the tasks running at once share the weight
// columns they read (in L2) instead of each m-tile streaming all of an expert's weights.
// band_order: fixed bands of kBand m-tiles (the weight gradients' row tiles, and the
// expert m-tiles' fallback).
__device__ __forceinline__ void band_order(int task, int num_mt, int num_g, int* mt, int* g) {
  const int band = task / (kBand * num_g), in = task % (kBand * num_g);
  const int rows = min(kBand, num_mt - band * kBand);
  *g = in / rows;
  *mt = band * kBand + in % rows;
}

// The expert m-tiles' bands end where an expert's run of tiles ends (PREFIX writes
// them, expert_segments): a band cut inside an expert has the expert's weights read by two
// waves, once from DRAM each (deepseek-v3's 2-3 tile experts against fixed bands of 8:
// a fifth of its experts). tile_band[q] = (first tile << 8) | tiles, of the band that
// holds m-tile q, for every q < num_mt. Task `task` of a phase with num_g column groups
// a tile: the band of q = task / num_g holds tasks [first num_g, (first + tiles) num_g),
// column group by column group. An entry that cannot be this step's (the backward after
// a forward that stopped early: MOK_STATUS_INVALID_SAVED is raised) falls back to the
// fixed bands, so that the task stays in range.
__device__ __forceinline__ void expert_band_order(const int32_t* tile_band, int task, int num_mt, int num_g, int* mt,
                                                  int* g) {
  const int q = task / num_g;
  const uint32_t band = (uint32_t)tile_band[q];
  const int first = (int)(band >> 8), rows = (int)(band & 255u);
  if (rows == 0 || first > q || q - first >= rows || first + rows > num_mt) return band_order(task, num_mt, num_g, mt, g);
  const int in = task - first * num_g;
  *g = in / rows;
  *mt = first + in % rows;
}

}  // namespace mok
