// sm90_tile_gemm.cuh — the TMA + wgmma tile GEMM every GEMM task runs (gemm_tiles, and
// gemm_group / gemm_tile / paired_task over it), the maps cut to an expert's rows, and
// where each accumulator sits in the tile (acc_row, acc_col).
//
// GEMM tile: C[128 x 256] = A[128 x K] B[K x 256], fp32 accumulators. Each K block of 64
// is six 64 x 64 bf16 TMA boxes (two of A, four of B; 128-byte swizzle; through tall
// maps two a load: gemm_tiles' kBoxRows) in a ring of kStages stages with full/empty
// mbarriers. An operand is K-major (box = 64 rows x 64 k, k contiguous) or MN-major
// (box = 64 k rows x 64 mn, mn contiguous); wgmma reads either through its descriptor
// (the transpose bits). Within a tile each output element is one
// accumulator summed over K blocks in increasing order; inside a block the order is the
// tensor core's, the same on every SM and for every M (one tile shape for everything).
// 128 x 256 rather than 128 x 128: 87 instead of 64 FLOPs per byte brought from L2.
// Every GEMM task is inlined into its kernel: with a wgmma in a called function ptxas
// serialises every wgmma of the kernel (warning C7510; docs/KERNELS.md).
#pragma once
#include "sm90_schedule.cuh"

namespace mok {

// ---- the tile GEMM ----

// Shared-memory descriptors of an A box (a warpgroup's 64 rows) and of the first of
// four B boxes, at their first k16 step. A later step's descriptor is this one plus the
// step's byte offset / 16: the address field (bits 0-13, address / 16) cannot carry
// out, shared memory ending below 256 KB.
template <int TA, int TB>
__device__ __forceinline__ void box_descs(const uint8_t* a, const uint8_t* b, uint64_t& da, uint64_t& db) {
  da = smem_desc(a, TA ? kBoxBytes : 16, 1024);
  db = smem_desc(b, TB ? kBoxBytes : 16, 1024);
}
// The same for warpgroup wg in a stage (A boxes 0-1, B boxes 2-5).
template <int TA, int TB>
__device__ __forceinline__ void stage_descs(const uint8_t* stage, int wg, uint64_t& da, uint64_t& db) {
  box_descs<TA, TB>(stage + wg * kBoxBytes, stage + 2 * kBoxBytes, da, db);
}

// A K block's first kSteps k16 steps for warpgroup wg, as one wgmma group (fence ..
// commit): acc (its 64 x 256 tile) += A box wg x B boxes 2..5 of the stage, da and db
// from stage_descs; with 32 accumulators (a 64 x 64 tile) B box 2 alone. A k16 step is
// 2048 bytes further in an MN-major box (16 rows of 128 bytes), 32 in a K-major one.
// keep (64 x 64 only): 0 for a tile's first block, whose first step then writes acc
// rather than adding to it (a zeroing of acc there made ptxas serialise the kernel's
// wgmmas, C7515).
template <int TA, int TB, int kSteps, int N>
__device__ __forceinline__ void mma_block(float (&acc)[N], uint64_t da, uint64_t db, int keep = 1) {
  static_assert(N == kAcc || N == 32, "m64n256 or m64n64");
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kSteps; ks++) {
    const uint64_t a = da + ks * (TA ? 2048 / 16 : 32 / 16), b = db + ks * (TB ? 2048 / 16 : 32 / 16);
    if constexpr (N == kAcc) wgmma_m64n256k16<TA, TB>(acc, a, b, 1);
    else wgmma_m64n64k16<TA, TB>(acc, a, b, ks > 0 || keep);
  }
  wgmma_commit();
}
template <int TA, int TB, int kSteps>
__device__ __forceinline__ void mma_block(float (&acc)[kAcc], const uint8_t* stage, int wg) {
  uint64_t da, db;
  stage_descs<TA, TB>(stage, wg, da, db);
  mma_block<TA, TB, kSteps>(acc, da, db);
}

// A run of output tiles through one continuous pipeline: for tile i, setup(i, A, B,
// num_kb, k_valid_last) names its operands, then acc (per thread: kAcc floats) =
// A[128 x K] B[K x 256] over num_kb K blocks of 64, then epi(i, acc, wg, warp, lane, spare).
// Thread 0 (MOK_PRODUCER's forward: the producer thread, from the jobs thread 0 posts;
// producer_loop below) loads kStages - 1 K blocks ahead of the wgmmas, across tile
// boundaries, so the next tile's first blocks arrive during this tile's epilogue; epi
// also gets `spare`, the stage of the tile's last K block (48 KB, or null), free during
// the epilogue.
// TA / TB = 1 when that operand is MN-major. k_valid_last < 64: the operands' k rows
// past it in the last block are zeros (TMA's fill, through maps cut there: cut_maps),
// and that block's k16 steps past it are skipped.
// Epilogue rows: wg*64 + warp*16 + lane/4 (+8); columns 8*i + 2*(lane%4) (+1) for
// acc[4i..4i+3], i < 32.
// PAIRED (pair_agree): the partner CTA runs the same tiles of B on other rows, in step;
// each CTA loads its A and half of B (boxes 2 rank, 2 rank + 1), multicast to both. A
// template argument, not a run-time flag: the unpaired mainloop stays what it is.
// AR (A resident; unpaired): every tile has the same A of at most kArBlocks K blocks
// (setup's A and num_kb of tile 0), loaded once into the ring's first 64 KB; B streams
// through kStages slots of 32 KB after it. 32 KB a K block into shared memory instead
// of 48 (the bytes each SM takes in bound the mainloop: docs/PERF.md, ninth session);
// the epilogue's spare is a 32 KB slot.
// NB (unpaired, not AR): B boxes a tile, 4 (64 x 256 a warpgroup, kAcc accumulators) or 1
// (64 x 64, 32 accumulators; the stage's other B boxes unused): epi's acc is NB * 32 floats.
// kBoxRows: what one load of an operand brings, 64 or 128 rows (K-major) or mn columns
// (MN-major). With 128 the run's maps are tall: a K-major map has 64 x 128 boxes, an
// MN-major one is 3-D, [cols / 64][rows][64] with 64 x 64 x 2 boxes (make_chunk_map in
// cuda_backend.cu; the coordinate of a box is its chunk, mn / 64). Either way one load
// brings what two 64 x 64 boxes did, into the same shared memory (the 128-byte swizzle
// repeats every 8 rows; a chunk is a box), so a K block takes 3 loads instead of 6
// (paired 2, not 4): thread 0 issues them between its wgmmas, about 150 cycles each
// (engine_gemm, 2026-12-04). B's loads are then pos[0] and pos[2] (pos[1], pos[3] their
// second halves, as wide() and the gate|up operands make them); A loads 128 rows even
// when the tile stores at most 64 (bytes its idle warpgroup leaves unread).
constexpr int kArBlocks = 4;
constexpr int kBSlotBytes = 4 * kBoxBytes;
static_assert(kArBlocks * 2 * kBoxBytes + kStages * kBSlotBytes <= kStages * kStageBytes, "A-resident layout");
// One K block (K row k) of an operand's 128 rows or mn columns from p0 (its 64 x 64 boxes
// at p0 and p1, p0 + 64 unless the caller says otherwise) into dst (16 KB: the two
// boxes in turn), completing on bar: one tall load (kTall: 64 x 128 boxes, or 3-D chunk
// pairs when MN-major) or two 64 x 64 boxes.
template <bool kTall>
__device__ __forceinline__ void load_pair(void* dst, const CUtensorMap* map, uint64_t* bar, bool mn_major, int p0,
                                          int p1, int k) {
  if constexpr (kTall) {
    if (mn_major) tma_load_3d(dst, map, bar, 0, k, p0 / 64);
    else tma_load_2d(dst, map, bar, k, p0);
  } else {
#pragma unroll
    for (int b = 0; b < 2; b++) {
      uint8_t* const d = static_cast<uint8_t*>(dst) + b * kBoxBytes;
      if (mn_major) tma_load_2d(d, map, bar, b ? p1 : p0, k);
      else tma_load_2d(d, map, bar, k, b ? p1 : p0);
    }
  }
}
// An operand's boxes of K block k (at its k0 + k) into dst, completing on bar: boxes
// [0, n) of at most kMax, 64 x 64 each from pos[b], or with tall maps two a load
// (load_pair): the producer's loads, and thread 0's of A (gemm_tiles' load_next; its B
// loops stay their own: they carry MOK_KNOBS 16 and 32, and this helper there moved the
// default kernels' SASS, not yet tested on a GPU).
template <bool kTall, int kMax>
__device__ __forceinline__ void load_boxes(uint8_t* dst, const Operand& op, uint64_t* bar, bool mn_major, int n,
                                           int k) {
#pragma unroll
  for (int b = 0; b < kMax; b += kTall ? 2 : 1) {
    if (b >= n) break;
    if constexpr (kTall) load_pair<true>(dst + b * kBoxBytes, op.map, bar, mn_major, op.pos[b], op.pos[b + 1], op.k0 + k);
    else if (mn_major) tma_load_2d(dst + b * kBoxBytes, op.map, bar, op.pos[b], op.k0 + k);
    else tma_load_2d(dst + b * kBoxBytes, op.map, bar, op.k0 + k, op.pos[b]);
  }
}
#ifdef MOK_PRODUCER_TU
// MOK_PRODUCER (sm90_smem.cuh): thread 0 posts each tile of a plain run (not paired, not
// A-resident) as a Job, kJobs tiles ahead of the one it multiplies, and the producer
// thread issues its K blocks' loads into the same ring, waiting for free stages itself,
// so that the working threads neither issue loads nor wait for stages. The stage of a
// tile's last K block (the epilogue's spare) goes back to the ring only once the
// epilogue's stores have read it: thread 0's bulk groups, so thread 0 waits for them and
// arrives for both warpgroups (release_spare, sm90_schedule.cuh), at the next tile's first
// K block, before a task that reuses the stages, or at the end of the kernel.
// Thread 0: the next job's slot, once the producer has read what it held last; fill it
// (fill(Job&)), then hand it over.
template <class Fill> __device__ __forceinline__ void post_job(Smem& sm, Fill fill) {
  const uint32_t j = sm.jobs_posted++, slot = j % kJobs;
  while (!mbar_try_wait(&sm.job_empty[slot], ((j / kJobs) & 1) ^ 1)) {
  }
  Job& jb = sm.job[slot];
  fill(jb);
  jb.acquire = sm.fresh_maps, jb.nacquire = sm.fresh_count;  // (cut maps since the last job)
  sm.fresh_maps = nullptr, sm.fresh_count = 0;
  mbar_arrive(&sm.job_full[slot]);
}
// The producer thread (warpgroup 2's first): every posted job's K blocks into the ring,
// in order, until the stop job (the kernel's end). ring position pit runs with the
// working threads' sm.ring_it: both advance by a tile's K blocks.
__device__ __forceinline__ void producer_loop(Smem& sm) {
  uint32_t pit = 0;
  for (uint32_t j = 0;; j++) {
    const uint32_t slot = j % kJobs;
    while (!mbar_try_wait(&sm.job_full[slot], (j / kJobs) & 1)) {
    }
    const Job jb = sm.job[slot];
    mbar_arrive(&sm.job_empty[slot]);
    if (jb.flags & kJobStop) return;
    for (int m = 0; m < jb.nacquire; m++) tensormap_acquire(jb.acquire + m);
    // the operands' generic writes (other CTAs', acquired by the working threads' counter
    // waits, then ordered here by the job's barrier) before this thread's TMA reads them
    fence_proxy_async();
    const bool ta = jb.flags & kJobTA, tb = jb.flags & kJobTB, tall = jb.flags & kJobTall;
    const int nb = jb.flags & kJobNarrow ? 1 : 4, a_boxes = tall || jb.A.rows > 64 ? 2 : 1;
    for (int kb = 0; kb < jb.num_kb; kb++, pit++) {
      const uint32_t s = pit % kStages;
      while (!mbar_try_wait(&sm.empty[s], ((pit / kStages) & 1) ^ 1)) {
      }
      uint64_t* const bar = &sm.full[s];
      mbar_arrive_expect_tx(bar, (nb + a_boxes) * kBoxBytes);
      uint8_t* const dst = sm.stage[s];
      const int k = kb * BK;
      if (tall) {
        load_boxes<true, 2>(dst, jb.A, bar, ta, 2, k);
        load_boxes<true, 4>(dst + 2 * kBoxBytes, jb.B, bar, tb, 4, k);
      } else {
        load_boxes<false, 2>(dst, jb.A, bar, ta, a_boxes, k);
        load_boxes<false, 4>(dst + 2 * kBoxBytes, jb.B, bar, tb, nb, k);
      }
    }
  }
}
// At the kernel's start, after kernel_smem: warpgroup 2 gives up registers and its first
// thread runs producer_loop, warpgroups 0-1 take theirs; false for the producer
// warpgroup, which then leaves the kernel.
__device__ __forceinline__ bool producer_split(Smem& sm) {
  if (threadIdx.x >= kThreads) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == kThreads) producer_loop(sm);
    return false;
  }
  setmaxnreg_inc<kWorkerRegs>();
  return true;
}
// Thread 0 at the kernel's end: the last spare back, and the producer's stop.
__device__ __forceinline__ void producer_stop(Smem& sm) {
  if (threadIdx.x != 0) return;
  release_spare<0>(sm);
  post_job(sm, [](Job& jb) { jb.flags = kJobStop, jb.num_kb = 0; });
}
#else
// (no producer: every thread works, nothing to stop)
__device__ __forceinline__ bool producer_split(Smem&) { return true; }
__device__ __forceinline__ void producer_stop(Smem&) {}
#endif

template <int TA, int TB, bool PAIRED = false, bool AR = false, int NB = 4, int kBoxRows = 64, class Setup, class Epi>
__device__ __forceinline__ void gemm_tiles(Smem& sm, int num_tiles, Setup setup, Epi epi) {
  static_assert(!(PAIRED && AR), "A-resident runs are unpaired");
  static_assert(NB == 4 || (NB == 1 && !PAIRED && !AR), "narrow tiles are unpaired, not A-resident");
  static_assert(kBoxRows == 64 || (kBoxRows == 128 && NB == 4), "boxes of 64 rows, or 128 for whole tiles");
  constexpr bool kTall = kBoxRows == 128;  // (one load a 128-row or 128-column half: load_pair)
  constexpr int kTileAcc = NB * 32;
  const int tid = threadIdx.x, wg = tid / 128;
  uint8_t* const ring = sm.stage[0];
  // a stage's (AR: a B slot's) shared memory
  auto stage_at = [&](uint32_t s) { return AR ? ring + kArBlocks * 2 * kBoxBytes + s * kBSlotBytes : sm.stage[s]; };
  uint64_t* const full = PAIRED ? sm.full2 : sm.full;
  uint64_t* const empty = PAIRED ? sm.empty2 : sm.empty;
  uint32_t it = PAIRED ? sm.ring2_it : sm.ring_it;  // ring position of the next K block to multiply
  // n arrivals for a consumed stage; paired also at the partner's empty2, whose
  // multicast writes this CTA's copy of the stage too
  auto release = [&](uint32_t slot, uint32_t n) {
    if (n == 1) mbar_arrive(&empty[slot]);
    else mbar_arrive_n(&empty[slot], n);
    if (PAIRED) mbar_arrive_remote_n(mapa_shared(smem_addr(&empty[slot]), (uint32_t)(sm.rank ^ 1)), n);
  };
  // Thread 0's load cursor (LoadCursor) lives in shared memory: in registers it would be
  // live, in every thread, across the whole mainloop beside the 128 accumulators.
  LoadCursor& c = sm.load;
  auto settle = [&]() {
    while (c.tile < num_tiles && c.kb >= c.num_kb) {
      c.kb = 0;
      if (++c.tile < num_tiles) setup(c.tile, c.A, c.B, c.num_kb, c.k_valid_last);
    }
  };
  auto load_next = [&]() {
    // the cursor's fields read once into registers, for this load only (otherwise each
    // is read again from shared memory after every TMA issue: the asm's memory clobber)
    const uint32_t lit = c.it;
    const int kb = c.kb;
    if (c.tile >= num_tiles) return;
    const uint32_t s = lit % kStages, ph = (lit / kStages) & 1;
    if ((int)s == c.spare_slot) {
      // the last epilogue's stores from this stage went out first; only its final
      // group (from sm.epi) may still be reading
      MOK_STALL_FROM(kStallSpare);
      bulk_wait_read<1>();
      MOK_STALL_ADD(kStallSpare);
      // paired, the spare's release (both warpgroups', here and at the partner) waited
      // for this: the partner's multicast writes it too
      if (PAIRED) release(s, 2);
      c.spare_slot = -1;
    }
    MOK_STALL_FROM(kStallEmpty);
    while (!mbar_try_wait(&empty[s], ph ^ 1)) {
    }
    MOK_STALL_ADD(kStallEmpty);
    const uint32_t knobs = sm.knobs;              // (once: the TMA asm's memory clobber would re-read it)
    const bool skip_b = !PAIRED && !AR && (knobs & 16);  // MOK_KNOBS 16: B stays what the stage held
    const Operand A = c.A;
    const int a_boxes = kTall || A.rows > 64 ? 2 : 1;  // (Operand::rows; a tall load brings both)
    mbar_arrive_expect_tx(&full[s], AR ? kBSlotBytes : (skip_b ? 0 : NB * kBoxBytes) + a_boxes * kBoxBytes);
    uint8_t* dst = sm.stage[s];
    uint8_t* const b_dst = AR ? stage_at(s) : dst + 2 * kBoxBytes;  // B's first box (AR: A is resident)
    const int k = kb * BK;
    if (!AR) load_boxes<kTall, 2>(dst, A, &full[s], TA, kTall ? 2 : a_boxes, k);
    const Operand B = c.B;
    if (PAIRED && kTall) {  // B boxes 2 rank, 2 rank + 1 (one tall load) into both CTAs
      const bool hi = sm.rank != 0;
      const int pos = hi ? B.pos[2] : B.pos[0];
      if (TB) tma_load_3d_multicast(b_dst + (hi ? 2 : 0) * kBoxBytes, B.map, &full[s], 0, B.k0 + k, pos / 64, 0x3);
      else tma_load_2d_multicast(b_dst + (hi ? 2 : 0) * kBoxBytes, B.map, &full[s], B.k0 + k, pos, 0x3);
    } else if (PAIRED) {  // B boxes 2 rank, 2 rank + 1 into both CTAs; the partner loads the others
      const bool hi = sm.rank != 0;
#pragma unroll
      for (int i = 0; i < 2; i++) {
        const int b = hi ? 2 + i : i, pos = hi ? B.pos[2 + i] : B.pos[i];  // (no run-time index: local memory)
        if (TB) tma_load_2d_multicast(b_dst + b * kBoxBytes, B.map, &full[s], pos, B.k0 + k, 0x3);
        else tma_load_2d_multicast(b_dst + b * kBoxBytes, B.map, &full[s], B.k0 + k, pos, 0x3);
      }
    } else if (kTall) {
      const int kb_b = knobs & 32 ? 0 : k;  // MOK_KNOBS 32: every K block of B is the first
      if (!skip_b) {
        load_pair<true>(b_dst, B.map, &full[s], TB, B.pos[0], B.pos[1], B.k0 + kb_b);
        load_pair<true>(b_dst + 2 * kBoxBytes, B.map, &full[s], TB, B.pos[2], B.pos[3], B.k0 + kb_b);
      }
    } else {
      const int kb_b = knobs & 32 ? 0 : k;  // MOK_KNOBS 32: every K block of B is the first
#pragma unroll
      for (int b = 0; b < NB && !skip_b; b++) {
        if (TB) tma_load_2d(b_dst + b * kBoxBytes, B.map, &full[s], B.pos[b], B.k0 + kb_b);
        else tma_load_2d(b_dst + b * kBoxBytes, B.map, &full[s], B.k0 + kb_b, B.pos[b]);
      }
    }
    c.it = lit + 1, c.kb = kb + 1;
    settle();
  };
#ifdef MOK_PRODUCER_TU
  constexpr bool kProd = !PAIRED && !AR;  // (the producer's runs; the others load from thread 0)
  // tile t's job: its operands and how the producer loads them
  auto post_tile = [&](int t) {
    post_job(sm, [&](Job& jb) {
      int kv;
      setup(t, jb.A, jb.B, jb.num_kb, kv);
      jb.flags = (TA ? kJobTA : 0) | (TB ? kJobTB : 0) | (kTall ? kJobTall : 0) | (NB == 1 ? kJobNarrow : 0);
    });
  };
  if (kProd && tid == 0)
    for (int t = 0; t < num_tiles && t < kJobs; t++) post_tile(t);
#else
  constexpr bool kProd = false;
  auto post_tile = [](int) {};
#endif
  if (!kProd && tid == 0 && num_tiles > 0) {
    c.it = it, c.tile = 0, c.kb = 0;
    setup(0, c.A, c.B, c.num_kb, c.k_valid_last);
    if (AR) {
      // the A region overlaps stages an earlier epilogue's stores may still read
      release_stages_from_stores(sm);
      const Operand A = c.A;
      mbar_arrive_expect_tx(&sm.a_full, c.num_kb * 2 * kBoxBytes);
      for (int kb = 0; kb < c.num_kb; kb++) {
        load_pair<kTall>(ring + kb * 2 * kBoxBytes, A.map, &sm.a_full, TA, A.pos[0], A.pos[1], A.k0 + kb * BK);
      }
    }
    settle();
    for (int i = 0; i < kStages - 1; i++) load_next();
  }
  if (AR && num_tiles > 0) {
    const uint32_t aph = sm.a_phase;
    while (!mbar_try_wait(&sm.a_full, aph)) {
    }
  }
  for (int tile = 0; tile < num_tiles; tile++) {
    Operand A, B;
    int num_kb, k_valid_last;
    setup(tile, A, B, num_kb, k_valid_last);
    float acc[kTileAcc];
    if constexpr (NB == 4) {  // (NB = 1: the first block's first wgmma writes them, mma_block's keep)
#pragma unroll
      for (int i = 0; i < kTileAcc; i++) acc[i] = 0.f;
    }
    // The second warpgroup, when its 64 rows are all past the tile's stored ones
    // (Operand::rows: an expert's last m-tile), multiplies nothing: its accumulators stay
    // zero and no epilogue stores them. It only passes the ring's stages on, each once it
    // has landed (the last one as below). (A loop of its own: a condition in the K loop
    // would be one more register beside the accumulators, and the backward spilled.)
    // (NB = 1: both warpgroups always multiply, so that nothing but a wgmma writes acc)
    if (kProd && tid == 0 && num_kb == 0) {  // (no K loop: the last spare and the next post here)
      release_spare<0>(sm);
      if (tile + kJobs < num_tiles) post_tile(tile + kJobs);
    }
    if (NB == 4 && wg == 1 && A.rows <= 64) {
      for (int kb = 0; kb < num_kb; kb++, it++) {
        while (!mbar_try_wait(&full[it % kStages], (it / kStages) & 1)) {
        }
        if (kb < num_kb - 1 && tid % 128 == 0) release(it % kStages, 1);
      }
    } else {
      for (int kb = 0; kb < num_kb; kb++, it++) {
        const uint32_t s = it % kStages, ph = (it / kStages) & 1;
        // the descriptors are made before the wait (the empty asm pins them there; the
        // compiler would sink them past it), so that the first wgmma issues as soon as the
        // data lands: when the data comes late, every instruction between is tensor-core time
        uint64_t da, db;
        if (AR) box_descs<TA, TB>(ring + (kb * 2 + wg) * kBoxBytes, stage_at(s), da, db);  // A resident, B in slot s
        else stage_descs<TA, TB>(sm.stage[s], wg, da, db);
        asm volatile("" : "+l"(da), "+l"(db));
        MOK_STALL_FROM(kStallFull);
        while (!mbar_try_wait(&full[s], ph)) {
        }
        MOK_STALL_ADD(kStallFull);
        // the last block of a tile whose operands end early (k_valid_last < 64; its rows
        // past k_valid_last are zeros) skips its k16 steps past them. Each count is its
        // own fence .. commit group of unconditional wgmmas: a wgmma under a condition
        // inside a group makes ptxas serialise every wgmma of the kernel (C7520).
        const int k_steps = kb == num_kb - 1 ? (k_valid_last + 15) / 16 : BK / 16;
        const int keep = NB == 4 || kb > 0;
        if (k_steps == 4) mma_block<TA, TB, 4>(acc, da, db, keep);
        else if (k_steps == 3) mma_block<TA, TB, 3>(acc, da, db, keep);
        else if (k_steps == 2) mma_block<TA, TB, 2>(acc, da, db, keep);
        else mma_block<TA, TB, 1>(acc, da, db, keep);
        // keep this block's wgmmas in flight; the previous block's are done: free its
        // stage, then (thread 0) refill the ring kStages - 1 blocks ahead
        MOK_STALL_FROM(kStallMma);
        wgmma_wait<1>();
        MOK_STALL_ADD(kStallMma);
        if (kb > 0 && tid % 128 == 0) release((it - 1) % kStages, 1);
        if (kProd && tid == 0 && kb == 0) {
          release_spare<1>(sm);  // (the last tile's spare; the newest group came from sm.epi)
          if (tile + kJobs < num_tiles) post_tile(tile + kJobs);
        } else if (!kProd && tid == 0) {
          load_next();
        }
      }
    }
    MOK_STALL_FROM(kStallDrain);
    wgmma_wait<0>();
    MOK_STALL_ADD(kStallDrain);
    // The stage of the tile's last K block is free until thread 0 refills it (its next
    // load, after the epilogue): the epilogue may use it as a second buffer (`spare`),
    // after a CTA barrier (the other warpgroup's wgmmas may still read it until then).
    // Paired, its release waits for that refill (load_next): until then the partner's
    // multicast must not write it.
    if (!PAIRED && !kProd && num_kb > 0 && tid % 128 == 0) release((it - 1) % kStages, 1);
    if (PAIRED && tid == 0 && c.spare_slot >= 0) {
      // an earlier tile's spare never refilled (this tile has fewer than kStages K
      // blocks): released now, its stores read first
      bulk_wait_read();
      release(c.spare_slot, 2);
      c.spare_slot = -1;
    }
    const int et = tid_here();
    uint8_t* spare = num_kb > 0 ? stage_at((it - 1) % kStages) : nullptr;
    MOK_STALL_FROM(kStallEpilogue);
    epi(tile, acc, et / 128, (et % 128) / 32, et % 32, spare);
    MOK_STALL_ADD(kStallEpilogue);
    if (tid == 0 && num_kb > 0) c.spare_slot = (int)((it - 1) % kStages);
  }
  cta_sync();
  if (tid == 0) {
    (PAIRED ? sm.ring2_it : sm.ring_it) = it;
    if (PAIRED && c.spare_slot >= 0) {  // the last tile's spare, not refilled in this task
      bulk_wait_read<1>();
      release(c.spare_slot, 2);
      c.spare_slot = -1;
    }
    if (AR && num_tiles > 0) {
      // the next run lays its stages out the usual way, over this one's slots: its
      // loads must not meet this spare's stores (spare_slot names a slot of this layout)
      release_stages_from_stores(sm);
      sm.a_phase ^= 1;
    }
  }
  cta_sync();
}

// Copies of two 2-D tensor maps ([rows, cols], ld elements a row) cut to rows [row0,
// row0 + n) (at least one row: a map's extent must not be 0), at dst[0] and dst[1]
// (global memory, 128-byte aligned, this CTA's alone): loads through them read zeros
// from row n on, as TMA fills what lies outside a tensor. b null: a's alone, at dst[0].
// Warp 0 makes them; thread 0, the one that issues TMA, acquires them. The slot's
// previous maps are no longer in use: a task's loads have all landed before it ends.
__device__ __forceinline__ void cut_maps(Smem& sm, CUtensorMap* dst, const CUtensorMap* a, const bf16* a_base,
                                         int64_t a_ld, const CUtensorMap* b, const bf16* b_base, int64_t b_ld,
                                         int64_t row0, int n) {
  const int tid = tid_here(), maps = b ? 2 : 1;
  if (tid >= 32) return;
  if (tid < 8 * maps) {  // 16 bytes a lane: lanes 0-7 copy a, 8-15 b (maps[0], maps[1])
    // (the address made here, opaque: made once at the kernel's start it held a register
    // through every task, which swiglu_bwd_store's loop needs)
    uint32_t at = smem_addr(sm.maps[0]) + 16 * tid;
    asm volatile("" : "+r"(at));
    st_shared_v4(at, reinterpret_cast<const uint4*>(tid < 8 ? a : b)[tid % 8]);
  }
  __syncwarp();
  if (tid < maps) {
    const uint32_t m = smem_addr(sm.maps[tid]);
    tensormap_set_base(m, tid == 0 ? a_base + row0 * a_ld : b_base + row0 * b_ld);
    tensormap_set_outer_dim(m, (uint32_t)max(n, 1));
  }
  __syncwarp();
  tensormap_publish(dst, smem_addr(sm.maps[0]));
  if (b) tensormap_publish(dst + 1, smem_addr(sm.maps[1]));
  if (tid == 0) {
    tensormap_acquire(dst);
    if (b) tensormap_acquire(dst + 1);
#ifdef MOK_PRODUCER_TU
    sm.fresh_maps = dst, sm.fresh_count = maps;  // (the producer loads through them: it acquires them too)
#endif
  }
}
// rows128's A operand of an expert's m-tile (rows [row0, row_end) of the map `full` over
// `base`, ld elements a row): a tile with fewer than BM rows (the expert's last) reads
// through a copy of the map cut at row_end (this CTA's slot, cut_maps), so that its rows
// past the expert are zeros, not the next expert's rows: the wgmmas over them
// (Operand::rows skips a warpgroup's only when all its 64 are past) then multiply
// zeros, at a lower energy (docs/PERF.md, nineteenth session). No epilogue stores them.
// This CTA's two map slots of cta_maps ([kMaxCtas][2]: the weight gradients' cut maps, expert_rows').
__device__ __forceinline__ CUtensorMap* cta_slot(CUtensorMap* cta_maps) { return cta_maps + 2 * blockIdx.x; }
__device__ __forceinline__ Operand expert_rows(Smem& sm, CUtensorMap* slot, const CUtensorMap* full, const bf16* base,
                                               int64_t ld, int row0, int row_end) {
  if (row_end - row0 >= BM) return rows128(full, row0, 0, row_end - row0);
  cut_maps(sm, slot, full, base, ld, nullptr, nullptr, 0, row0, row_end - row0);
  return rows128(slot, 0, 0, row_end - row0);
}

// GEMM tasks own a group of column tiles of one row tile (one pipeline): about
// kGroupKb K blocks of work per task, at most 8 tiles, so that tasks with a long K stay
// short at the tails of phases. Fixed by the shape, never by T or the routing.
#ifndef MOK_GROUP_KB
#define MOK_GROUP_KB 128
#endif
constexpr int kGroupKb = MOK_GROUP_KB;
__host__ __device__ constexpr int group_size(int num_kb) {
  return num_kb >= kGroupKb ? 1 : (kGroupKb / (num_kb > 0 ? num_kb : 1) < 8 ? kGroupKb / (num_kb > 0 ? num_kb : 1) : 8);
}
__host__ __device__ constexpr int groups(int n, int num_kb) { return (n + group_size(num_kb) - 1) / group_size(num_kb); }
// A weight-gradient task's column tiles (wgrad_group in the backward) from the mean K
// blocks a tile: about 128 K blocks of work, at most 32 tiles.
__host__ __device__ constexpr int wgrad_group_of(int mean_kb) {  // (mean_kb >= 1)
  const int tiles = 128 / mean_kb > 1 ? 128 / mean_kb : 1;
  return tiles < 32 ? tiles : 32;
}

// Group g of the n column tiles: setup(nt, A, B) and epi(nt, acc, wg, warp, lane, spare)
// per column tile nt; every tile runs num_kb K blocks.
template <int TA, int TB, bool PAIRED = false, int kBoxRows = 64, class Setup, class Epi>
__device__ __forceinline__ void gemm_group(Smem& sm, int g, int n, int num_kb, Setup setup, Epi epi) {
  const int size = group_size(num_kb);
  gemm_tiles<TA, TB, PAIRED, false, 4, kBoxRows>(
      sm, min(size, n - g * size),
      [&](int t, Operand& A, Operand& B, int& nk, int& kv) {
        setup(g * size + t, A, B);
        nk = num_kb, kv = BK;
      },
      [&](int t, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) { epi(g * size + t, acc, wg, w, l, spare); });
}

// A run-time choice between template instances: f(Flag<true>()) or f(Flag<false>()).
template <bool V> struct Flag {
  static constexpr bool value = V;
};
// f(Flag<paired>()): a GEMM task's body in its paired and its unpaired instantiation
// (gemm_tiles' PAIRED), chosen at run time by pair_agree's answer.
// (MOK_PRODUCER_TU: its kernels run unclustered, so never paired: the paired instance
// is not compiled)
template <class F> __device__ __forceinline__ void with_pairing(bool paired, F f) {
  if constexpr (kProducerTu) f(Flag<false>());
  else if (paired) f(Flag<true>());
  else f(Flag<false>());
}
// A GEMM task of a paired phase on expert e's column group g: both CTAs agree whether to
// pair (pair_agree), then, when the task has a tile (valid, which implies it is past its
// dependency wait, ok), run(Flag<paired>()).
template <class Run>
__device__ __forceinline__ void paired_task(Smem& sm, bool pairable, bool ok, bool valid, int e, int g, Run run) {
  const bool paired = pair_agree(sm, pairable, ok, pair_key(valid, e, g));
  if (valid) with_pairing(paired, run);
}

// One tile: gemm_tiles with a single tile; epi(acc, wg, warp, lane, spare).
template <int TA, int TB, int kBoxRows = 64, class Epi>
__device__ __forceinline__ void gemm_tile(Smem& sm, const Operand& A, const Operand& B, int num_kb,
                                          int k_valid_last, Epi epi) {
  gemm_tiles<TA, TB, false, false, 4, kBoxRows>(
      sm, 1,
      [&](int, Operand& a, Operand& b, int& nk, int& kv) { a = A, b = B, nk = num_kb, kv = k_valid_last; },
      [&](int, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) { epi(acc, wg, w, l, spare); });
}

// Output coordinates of accumulator pair i (acc[4i + 2h], acc[4i + 2h + 1]).
__device__ __forceinline__ int acc_row(int wg, int warp, int lane, int h) { return wg * 64 + warp * 16 + lane / 4 + 8 * h; }
__device__ __forceinline__ int acc_col(int lane, int i) { return 8 * i + 2 * (lane % 4); }

}  // namespace mok
