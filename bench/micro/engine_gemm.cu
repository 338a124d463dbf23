// engine_gemm.cu — issue 35's design step: what a GEMM engine on Hopper's own pattern
// reaches on this project's GEMM shapes, measured alone, before it replaces gemm_tiles
// (src/cuda/sm90_tile_gemm.cuh: two warpgroups that both compute, thread 0 issuing the
// TMA loads, each tile's epilogue in series with its mainloop).
//
// C[g] (M x N, bf16) = A[g] (M x K, bf16, K-major) x B[g]^T (B[g]: N x K, bf16, K-major)
// for g < G: one expert GEMM of a layer at its average rows per expert (M = T K / E) for
// each of its E experts, in one persistent launch (grid = the SM count, at most one CTA
// per tile), as the megakernel runs them. A CTA is 384 threads: warpgroup 0 the producer
// (setmaxnreg down to 40; one thread issues every TMA load into a ring of stages behind
// full / empty mbarriers), warpgroups 1 and 2 the consumers (setmaxnreg up to 232,
// wgmma from shared memory, 128 fp32 accumulators a thread). Schedules:
//   cooperative 128x256: both consumers share a 128 x 256 tile, 64 rows each (m64n256k16,
//     gemm_tiles' tile and stage: 48 KB a K block, 4 stages);
//   ping-pong 128x128 / 64x256: each consumer owns its tile (two m64n128k16 row halves,
//     32 KB stages, 5 of them; or one m64n256k16, 40 KB, 4): the two take turns at the
//     mainloop (an mbarrier hand-over after the last K block's wgmmas are issued), so one
//     warpgroup's epilogue runs beside the other's mainloop.
//   gemm_tiles (the control): the megakernel's own GEMM, unchanged (256 threads, both
//     warpgroups computing, thread 0 issuing the loads between its wgmmas, each tile's
//     epilogue in series: store_tile's TMA path with the spare stage), on 2-D maps over
//     the experts' rows as the megakernel's, a CTA's tiles in runs of group_size(K / 64)
//     as its GEMM tasks; N a multiple of 64 (the CUDA backend's rule for H and F). Its
//     maps' boxes 64 rows (6 loads a K block), then 128 (3: kBoxRows, the forward's).
// Tiles: a static order, CTA c taking tiles c, c + grid, ...; tile t -> (g, m, n) with
// the m-tiles of each expert in bands of kGroupM, a band walked column by column (A's
// rows and B's columns reused from L2); ping-pong's warpgroups take a CTA's tiles in turn.
// Epilogue: accumulators -> bf16 -> stmatrix into 64 x 64 boxes in the 128-byte swizzle
// (a buffer per warpgroup) -> TMA stores as a bulk async group; only the next write of
// that buffer waits for the stores to have read it, never the next mainloop. Operands
// come as 3-D tensor maps ([G][rows][K]), 64 x 64 boxes as gemm_tiles': M, N and K that
// are not multiples of the tile read zeros past the expert's rows, columns or K (TMA
// fill) and the stores are clipped there.
// Summation order: each output is one fp32 accumulator over K blocks of 64 in increasing
// order; inside a block, four k16 wgmmas in order and the tensor core's order inside each.
// Each case checks C against an fp32 reference (one thread an output, k increasing, fma;
// |C - ref| <= 1e-2 |ref| + 1e-3 sqrt(K), inputs uniform in [-1, 1)), checks that two
// runs give the same bits, and says whether the schedules agree bit for bit with the
// first one; cuBLAS (strided batched, bf16 in and out, fp32 compute) is the peer, checked
// the same way. Time: the mean of 20 launches after 5, as TFLOP/s (2 G M N K a launch).
// Shapes (bench/shapes.py: T, H, F, E, K): gate/up (M, 2F, H) and down (M, H, F) for
// qwen3-30b-a3b (128 x (1024, 1536, 2048), (1024, 2048, 768)), gpt-oss-120b (128 x
// (512, 5760, 2880), (512, 2880, 2880)), mixtral-8x7b (8 x (2048, 28672, 4096), (2048,
// 4096, 14336)), deepseek-v3 (256 x (256, 4096, 7168), (256, 7168, 2048)); a dense
// 8192^3; and `tails` (3 x (300, 904, 1000): partial and wholly outside A and B boxes,
// a K block of 40, clipped stores, a coop warpgroup with no row stored), all of --quick.
// --dh: each case is instead dh's GEMM of a layer (M = T K / E rows, N = F, K = H) with
// dh's epilogue, the SwiGLU backward of the megakernel's DH tasks: dh (fp32, never
// stored) and gate|up (GU [G][M][2N] bf16: gate columns, then up) give d_a = bf16(dh up
// silu'(gate)) | bf16(dh silu(gate)) into C [G][M][2N], a 64-column quarter of the tile
// at a time (its gate and up boxes loaded by TMA, turned into d_a in place, stored by
// TMA). The question it answers: does ping-pong, which runs one warpgroup's epilogue
// beside the other's mainloop, pay where the epilogue is this heavy (dh: about a third
// of thread 0's cycles in the step), when it did not for plain stores? Schedules:
// cooperative 128x256 (a consumer's 16 KB buffer holds one quarter: each quarter's loads
// after the last one's stores), ping-pong 64x256 and 128x128 (32 KB: two 64 x 64 units,
// the next loads under this one's arithmetic) and the control, gemm_tiles with swiglu_bwd_store itself
// (quarters double-buffered through the spare stage, as in the step). The reference:
// the fp32 reference dh through the same operations; every schedule must give the
// control's bits. N a multiple of 64 (F's rule).
// A failed check prints the first bad element; the program goes on and exits non-zero.
// A wait that hangs (over 2 s) is reported with its role and block, and the launch ends.
// --dh-plain: dh's shapes with the plain epilogue (C = dh), for what the SwiGLU backward
// adds to each schedule.
// --gather: the question after --dh (docs/PERF.md, 2026-12-05 fourth session): can the
// producer warpgroup gather A's rows by index (Hopper's TMA has no row gather) at TMA's
// rate, so that the megakernel's GEMMs read x and dy where they are instead of rows that
// DISPATCH and DG copied? A's logical row i (expert g, row m: i = g M + m) is row
// rows[i] of X [G M][K], a random permutation (X holds A's rows scattered there). The
// producer's 128 threads each copy 16-byte chunks with cp.async (zeros past the expert's
// rows or K), a K block of a 128-row tile 8 a thread; B stays TMA's. A stage's copies
// are seen by the consumers through its full barrier's second arrival, made by thread 0
// once every producer thread has waited for them (cp.async.wait_group, two stages
// behind the newest), fenced them for the async proxy and met at a barrier. The
// cooperative and ping-pong 128x128 engines, each with TMA A and with gathered A, and the
// control; every one must give the first's bits. Beside each, gather-arrive: the same
// copies completing on the ring's barrier (produce_gather_arrive), and for the
// cooperative engine gather-arrive-nofence (the consumers' proxy fence left out: what
// the fence costs, a measurement only). Measured (docs/PERF.md, 2026-12-05 fifth
// session, an H100): gather-arrive 25-50% slower than TMA A, the fence not the cost; one
// TMA load a row, from one producer warp, ran at 10-24% of cuBLAS.
// --gather-scaled: the same with each gathered row scaled on the way, bf16(s_i X[rows[i]])
// with s_i in [0.5, 1) (DG's dy_j = bf16(g dy[t]): a transform, so through the producer's
// registers, not cp.async); A is then those scaled rows, for the reference and the TMA
// schedules. (Measured: 2.8-3.2x TMA A's time.)
//   make micro && build/micro/engine_gemm [--quick] [--dh | --dh-plain | --gather | --gather-scaled]
//                                         [--in-order] [--case SUBSTRING]
// --in-order: the gathers' rows in order (X = A): the mechanism's cost apart from the
// scattered rows' memory access.
// --wgrad: the weight gradients of small experts (docs/PERF.md, seventh 2026-12-05
// session): C[g] = A[g] B[g]^T with K the expert's rows (M = 2F or H, N = H or F, K = T K /
// E: deepseek-v3's 256, kimi-k2's 168 of about 171, qwen3.5's 320), as the
// megakernel's WG2 / WG13 tasks run them: both operands MN-major (the rows of d_a and
// x_rows are k), through 3-D chunk maps as the backward's ([cols / 64][rows][64], 64 x 64 x
// 2 boxes), each expert's k rows padded with zeros to a multiple of 64 (the megakernel's
// maps cut at the expert's end read zeros there), a CTA's tasks (expert, m-tile, group
// of wgrad_group's column tiles) one run each. Schedules: gemm_tiles with A resident (the
// control: today's tasks of at most 4 K blocks; past that streamed and unpaired, where
// the backward pairs them); then the cooperative engine on the same MN-major maps (its
// loads 3-D, 2 chunks each: one of A, two of B a K block) and the engines on the K-major
// copies (the same products), which must give its bits. (The eighth 2026-12-05 session measured a ping-pong form of
// gemm_tiles here, warpgroups taking turns over a resident A: slower; docs/PERF.md.)
//   make micro && build/micro/engine_gemm --wgrad [--spread] [--pairs] [--case SUBSTRING] [--knobs N]
// --spread: each expert's rows (K) drawn as uniform routing spreads them (mean K, standard
// deviation sqrt(K), a fixed draw), not K for every expert; A and B zero past an expert's
// rows, the reference and cuBLAS over the largest K (cuBLAS's rate counts the useful
// FLOPs). --pairs: the control in clusters of two CTAs, and as the backward's wgrad_task
// decides: an expert of at most kArBlocks K blocks runs alone with A resident, a larger
// one paired (both CTAs of a cluster on row tiles mt, mt + 1 of one column group, B
// multicast), else streamed: the backward with cfg.cta_pairs ON; AUTO, the default since
// 63a48d3, leaves the backward unclustered, so --spread alone is the default step's mix
// (docs/PERF.md, 2026-12-06 second and third sessions). The
// engines, unpaired, take each expert's whole K blocks (the zeros in the last multiplied).
// --pairs on the plain cases adds three rows: the control as the forward's GEMM tasks taken
// by ticket, paired in clusters as the forward pairs them, the same each CTA alone, and
// alone in a static round robin (tasks_gemm_kernel). Every timed row of a kernel here
// also gives its CTAs' mean SM clock and its rate a cycle (CtaProbe), as the step's trace
// does: the micro's TFLOP/s ran at other clocks than the step's.
// --knobs N: MOK_KNOBS' bits (gpu_params.h) for every schedule, timed, not checked (2: no
// epilogue, the mainloops alone); 4 (checked): the --wgrad control's epilogue in two
// rounds through sm.epi instead of one through sm.epi and the spare stage.
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "micro_host.h"
#include "cuda/sm90_epilogues.cuh"

using namespace mok;

constexpr int kEngineThreads = 384;  // warpgroup 0 the producer, 1 and 2 the consumers
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 65536, "the register file holds the split");
constexpr int kGroupM = 8;                   // m-tiles a band of the tile order
constexpr int kSmemOptin = 227 * 1024;       // dynamic shared memory a CTA may have (sm_90)
constexpr int kBarBytes = 128;               // the mbarriers, after the buffers
constexpr uint64_t kWaitNs = 2000000000ull;  // a wait past this is a hang: reported, the kernel ends
constexpr int kWarm = 5, kTimed = 20;

// The SM cycles and nanoseconds each CTA of a timed kernel lives (first instruction to
// its last warp's exit), summed over the CTAs of the timed launches: the rate a cycle
// and the mean SM clock, as trace_report.py gives them for the step's tasks (the clock
// of a short micro and of a step under load differ, so TFLOP/s alone do not compare).
// CtaProbe at the top of a kernel: thread 0 notes the start; each warp's lane 0 counts
// itself out at its exit, and the last adds the CTA's span (integer atomics: no float).
constexpr int kMaxGrid = 1024;
__device__ unsigned long long g_probe_cycles, g_probe_ns;  // (launch_ms zeroes them)
__device__ unsigned long long g_probe_start[kMaxGrid][2];
__device__ unsigned g_probe_warps_out[kMaxGrid];
struct CtaProbe {
  __device__ CtaProbe() {
    if (threadIdx.x == 0) {
      g_probe_start[blockIdx.x][0] = clock64();
      g_probe_start[blockIdx.x][1] = globaltimer_ns();
    }
  }
  __device__ ~CtaProbe() {
    if (threadIdx.x % 32 != 0) return;
    __threadfence();  // (thread 0's start before the last warp's read of it)
    if (atomicAdd(&g_probe_warps_out[blockIdx.x], 1u) != blockDim.x / 32 - 1) return;
    __threadfence();
    g_probe_warps_out[blockIdx.x] = 0;  // (the next launch's count)
    atomicAdd(&g_probe_cycles, (unsigned long long)clock64() - g_probe_start[blockIdx.x][0]);
    atomicAdd(&g_probe_ns, globaltimer_ns() - g_probe_start[blockIdx.x][1]);
  }
};

enum { kCooperative, kPingPong };

// One engine: the schedule and a consumer warpgroup's own tile, WM x WN (64 x 256 or
// 128 x 128); everything else follows from them and from shared memory's size.
template <int kSched, int WM_, int WN_, bool kMN_ = false>
struct Engine {
  static constexpr bool kCoop = kSched == kCooperative;
  // kMN (--wgrad): both operands MN-major through the backward's chunk maps (At, Bt: the
  // control's data and loads), a K block of A one 3-D load of 2 chunks, of B two
  static constexpr bool kMN = kMN_;
  static constexpr int WM = WM_, WN = WN_;
  static constexpr int kRowBlocks = WM / 64;               // m64 wgmmas a k16 step
  static constexpr int TM = kCoop ? 2 * WM : WM, TN = WN;  // a tile of the tile order
  static constexpr int kABoxes = TM / 64, kBBoxes = WN / 64;
  static constexpr int kStageBytes = (kABoxes + kBBoxes) * kBoxBytes;  // A boxes, then B boxes
  static constexpr int kEpiCols = kCoop ? WN / 2 : WN;                 // columns an epilogue round stores
  static constexpr int kRounds = WN / kEpiCols;
  static constexpr int kColBoxes = kEpiCols / 64;
  static constexpr int kEpiBytes = WM * kEpiCols * 2;  // a consumer's store buffer
  static constexpr int kStages = (kSmemOptin - 1024 - kBarBytes - 2 * kEpiBytes) / kStageBytes;
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + 2 * kEpiBytes + kBarBytes;
  static_assert((WM == 64 && WN == 256) || (WM == 128 && WN == 128 && !kCoop), "a warpgroup's tile");
  static_assert(kStages >= 3 && (2 * kStages + 2 + 4) * 8 <= kBarBytes, "the ring and its barriers (+ dh's 4)");
  static constexpr int kDhSlots = kEpiBytes / (2 * kBoxBytes);  // dh quarters (gate + up boxes) a buffer holds
  static_assert(kSmemBytes <= kSmemOptin, "shared memory");
  static_assert(!kMN || (kCoop && WN == 256), "MN-major operands: the cooperative 128 x 256 engine");
  static const char* name() { return kMN ? "cooperative MN-major" : kCoop ? "cooperative" : "ping-pong"; }
};
using Cooperative = Engine<kCooperative, 64, 256>;
using PingPong128 = Engine<kPingPong, 128, 128>;
using PingPong64 = Engine<kPingPong, 64, 256>;
using CooperativeMN = Engine<kCooperative, 64, 256, true>;

struct Problem {
  int G, M, N, K;
  int tiles_m, tiles_n, num_tiles, num_kb;
};
struct Params {
  CUtensorMap a, b, c;  // [G][M][K], [G][N][K], [G][M][N] bf16; boxes of 64 x 64, 128-byte swizzle
  CUtensorMap gu;       // --dh: [G][M][2N] gate|up (C is then d_a, [G][M][2N])
  const bf16* x;        // --gather: A's rows scattered, [G M][K] (row rows[i] holds A's row i)
  const int* rows;      // --gather: [G M]
  const float* scale;   // --gather-scaled: A's row i is bf16(scale[i] X[rows[i]]) ([G M], as DG's bf16(g dy))
  int kpad;             // E::kMN: k rows an expert in the chunk maps a and b ([G kpad] rows)
  const int* k_rows;    // --spread: expert g's rows [G] (A and B zero past them); null: p.K each
  uint32_t knobs;       // --knobs (2: no epilogue, a measurement: C is not written)
  Problem p;
};

// The first wait that timed out: role << 32 | block (0: none). Roles: 1 the producer's
// empty wait, 2 a consumer's full wait, 3 a ping-pong consumer's turn, 4 a --dh quarter's loads.
__device__ unsigned long long g_timeout;

// ---- PTX this file alone uses ----
template <int kRegs>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// A wait for the phase of parity `parity` of bar. False past kWaitNs (g_timeout set: a
// hang) or once another wait has timed out: the launch has failed, and its threads go
// on without waiting so that it ends. (A consumer goes on in any case: an early exit
// with wgmmas in flight makes ptxas serialise them.) Past 1 ms the clock and the flag
// are read; a wait that works is far shorter, and spins on the barrier alone.
__device__ __forceinline__ bool wait_phase(uint64_t* bar, uint32_t parity, unsigned long long role) {
  if (mbar_try_wait(bar, parity)) return true;
  const uint64_t t0 = globaltimer_ns();
  while (!mbar_try_wait(bar, parity)) {
    const uint64_t dt = globaltimer_ns() - t0;
    if (dt < 1000000) continue;
    if (*(volatile unsigned long long*)&g_timeout) return false;
    if (dt > kWaitNs) {
      atomicCAS(&g_timeout, 0ull, role << 32 | blockIdx.x);
      return false;
    }
  }
  return true;
}

// Tile t's expert g and its first row m0 and column n0 (tiles of TM x TN): an expert's
// m-tiles in bands of kGroupM, each band's tiles column by column.
template <int TM, int TN>
__device__ __forceinline__ void tile_origin(const Problem& p, int t, int& g, int& m0, int& n0) {
  const int per_expert = p.tiles_m * p.tiles_n, r = t % per_expert, band = kGroupM * p.tiles_n;
  const int first = r / band * kGroupM, rows = min(p.tiles_m - first, kGroupM), q = r % band;
  g = t / per_expert;
  m0 = (first + q % rows) * TM;
  n0 = q / rows * TN;
}

// Expert g's K blocks (--spread: its own rows', whole blocks, the zeros past them
// multiplied as they are; else every expert's p.num_kb).
__device__ __forceinline__ int expert_kb(const Params& prm, int g) {
  return prm.k_rows ? (prm.k_rows[g] + BK - 1) / BK : prm.p.num_kb;
}
// The K blocks of the CTA's i-th tile (0 past its last).
template <int TM, int TN>
__device__ __forceinline__ int cta_tile_kb(const Params& prm, int i) {
  const int t = (int)blockIdx.x + i * (int)gridDim.x;
  if (t >= prm.p.num_tiles) return 0;
  int g, m0, n0;
  tile_origin<TM, TN>(prm.p, t, g, m0, n0);
  return expert_kb(prm, g);
}

// A consumer's K block: acc (its WM x WN tile) += A (WM rows at da) x B (WN rows at db),
// four k16 steps, one wgmma group. A k16 step is 32 bytes further in a K-major box; the
// second m64 half of A is the next box.
template <class E>
__device__ __forceinline__ void engine_block(float (&acc)[E::kRowBlocks][E::WN / 2], uint64_t da, uint64_t db) {
  if constexpr (E::WN == 256) {
    mma_block<E::kMN, E::kMN, BK / 16>(acc[0], da, db);
  } else {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < BK / 16; ks++)
#pragma unroll
      for (int rb = 0; rb < E::kRowBlocks; rb++)
        wgmma_m64n128k16<0, 0>(acc[rb], da + rb * (kBoxBytes / 16) + ks * (32 / 16), db + ks * (32 / 16), 1);
    wgmma_commit();
  }
}

// The producer (one thread): every K block of the CTA's tiles, in order, into the ring;
// ring position (the K blocks of the CTA's tiles before it) + kb holds K block kb of the
// CTA's i-th tile. Boxes wholly past
// the expert's rows or columns are not loaded (their rows and columns are not stored).
template <class E>
__device__ __forceinline__ void produce(const Params& prm, uint8_t* stages, uint64_t* full, uint64_t* empty) {
  const Problem& p = prm.p;
  uint32_t s = 0, ph = 0;
  for (int t = blockIdx.x; t < p.num_tiles; t += gridDim.x) {
    int g, m0, n0;
    tile_origin<E::TM, E::TN>(p, t, g, m0, n0);
    const int a_boxes = min(E::kABoxes, (p.M - m0 + 63) / 64), b_boxes = min(E::kBBoxes, (p.N - n0 + 63) / 64);
    // (kMN: whole 2-chunk loads, their chunks past M or N zeros, counted all the same)
    const uint32_t bytes = (E::kMN ? E::kABoxes + E::kBBoxes : a_boxes + b_boxes) * (uint32_t)kBoxBytes;
    const int num_kb = expert_kb(prm, g);
    for (int kb = 0; kb < num_kb; kb++) {
      if (!wait_phase(&empty[s], ph ^ 1, 1)) return;  // (a fresh barrier's previous phase counts as done)
      mbar_arrive_expect_tx(&full[s], bytes);
      uint8_t* const dst = stages + s * E::kStageBytes;
      if constexpr (E::kMN) {  // chunk maps [cols / 64][G kpad][64]: 2 chunks (128 columns) a load
        const int k = g * prm.kpad + kb * BK;
        tma_load_3d(dst, &prm.a, &full[s], 0, k, m0 / 64);
        tma_load_3d(dst + 2 * kBoxBytes, &prm.b, &full[s], 0, k, n0 / 64);
        tma_load_3d(dst + 4 * kBoxBytes, &prm.b, &full[s], 0, k, n0 / 64 + 2);
      } else {
#pragma unroll
        for (int b = 0; b < E::kABoxes; b++)
          if (b < a_boxes) tma_load_3d(dst + b * kBoxBytes, &prm.a, &full[s], kb * BK, m0 + 64 * b, g);
#pragma unroll
        for (int b = 0; b < E::kBBoxes; b++)
          if (b < b_boxes) tma_load_3d(dst + (E::kABoxes + b) * kBoxBytes, &prm.b, &full[s], kb * BK, n0 + 64 * b, g);
      }
      if (++s == E::kStages) s = 0, ph ^= 1;
    }
  }
}

// 16 bytes from global to shared memory through cp.async, src_bytes of them read (the
// rest zeros: 0 for a chunk past the expert's rows or K).
__device__ __forceinline__ void cp_async_16_fill(uint32_t saddr, const void* gmem, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(saddr), "l"(gmem), "r"(src_bytes) : "memory");
}

// 16 bytes of global memory through the non-coherent path (read-only here).
__device__ __forceinline__ uint4 ld_global_nc_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// Eight bf16 (a 16-byte chunk) each times s, rounded to bf16: bf16(s x), DG's operations.
__device__ __forceinline__ uint32_t scaled_pair(uint32_t w, float s) {
  return pack_bf16x2(__fmul_rn(bf16_lo(w), s), __fmul_rn(bf16_hi(w), s));
}
__device__ __forceinline__ uint4 scaled_chunk(uint4 v, float s) {
  return make_uint4(scaled_pair(v.x, s), scaled_pair(v.y, s), scaled_pair(v.z, s), scaled_pair(v.w, s));
}

// A gather producer's thread 0: stage dst's B boxes by TMA, full's expect_tx for their
// bytes alone (A's rows come by cp.async or through registers).
template <class E>
__device__ __forceinline__ void load_b_boxes(const Params& prm, uint8_t* dst, uint64_t* full, int b_boxes, int kb,
                                             int n0, int g) {
  mbar_arrive_expect_tx(full, (uint32_t)b_boxes * kBoxBytes);
#pragma unroll
  for (int b = 0; b < E::kBBoxes; b++)
    if (b < b_boxes) tma_load_3d(dst + (E::kABoxes + b) * kBoxBytes, &prm.b, full, kb * BK, n0 + 64 * b, g);
}
// Where 16-byte chunk c of A's row r goes in stage dst: box r / 64, row r % 64, chunk
// c ^ r % 8 of the row (the 128-byte swizzle TMA would have applied).
__device__ __forceinline__ uint32_t gathered_chunk(const uint8_t* dst, int r, int c) {
  return smem_addr(dst + (r / 64) * kBoxBytes + (r % 64) * 128 + ((c ^ (r % 8)) * 16));
}

// --gather's producer (all 128 threads of warpgroup 0, lt its thread): the ring as
// produce's, A's rows copied by index (E::TM rows x 8 chunks a K block: chunk j = lt + 128
// q is row j / 8, chunk j % 8, at chunk j % 8 ^ row % 8 of its 128-byte row in the
// swizzled box), B by TMA from thread 0. full[s] takes two arrivals: thread 0's
// expect_tx for B, then, kLag positions later, thread 0's once every thread has waited
// for its copies of the position (cp.async groups, one a position), fenced them for the
// tensor core's reads (async proxy) and met at named barrier 3.
// kScaled (--gather-scaled): each chunk through registers instead, as dy's rows would
// come (DG's dy_j = bf16(g dy[t]), the contract's rounding point): 16 bytes loaded
// (ld.global.nc), each bf16 times scale[i] rounded to bf16 (scaled_chunk), stored to
// shared memory, kBatch chunks a batch (the loads of a batch in flight together: the
// producer has 40 registers). No cp.async groups then: a position is complete once its
// stores are done (kLag 0: the same fence, barrier and arrival, at once).
template <class E, bool kScaled = false>
__device__ __forceinline__ void produce_gather(const Params& prm, uint8_t* stages, uint64_t* full, uint64_t* empty,
                                               int lt) {
  constexpr int kLag = kScaled ? 0 : 2, kChunks = E::TM * 8 / 128, kBatch = 4;
  static_assert(kLag < E::kStages, "a position completes before its stage comes round again");
  const Problem& p = prm.p;
  auto complete = [&](uint32_t j) {  // position j's copies have landed (this thread's: waited for)
    fence_proxy_async_smem();
    named_bar_sync(3, 128);
    if (lt == 0) mbar_arrive(&full[j % E::kStages]);
  };
  uint32_t i = 0;  // ring position: K block kb of the CTA's n-th tile
  for (int t = blockIdx.x; t < p.num_tiles; t += gridDim.x) {
    int g, m0, n0;
    tile_origin<E::TM, E::TN>(p, t, g, m0, n0);
    const int b_boxes = min(E::kBBoxes, (p.N - n0 + 63) / 64);
    for (int kb = 0; kb < p.num_kb; kb++, i++) {
      const uint32_t s = i % E::kStages, ph = (i / E::kStages) & 1;
      // (a timed-out wait copies nothing but goes on, so that every thread meets every
      // barrier 3 and the launch ends)
      const bool ok = wait_phase(&empty[s], ph ^ 1, 1);
      uint8_t* const dst = stages + s * E::kStageBytes;
      if (lt == 0 && ok) load_b_boxes<E>(prm, dst, &full[s], b_boxes, kb, n0, g);
      const int c = lt % 8, k = kb * BK + 8 * c;
      // chunk q: row r = lt / 8 + 16 q (gathered_chunk)
      if constexpr (!kScaled) {
#pragma unroll 4
        for (int q = 0; q < kChunks; q++) {
          const int r = lt / 8 + 16 * q, m = m0 + r;
          const bool in = m < p.M && k < p.K;
          const bf16* src = in ? prm.x + (size_t)__ldg(prm.rows + (size_t)g * p.M + m) * p.K + k : prm.x;
          if (ok) cp_async_16_fill(gathered_chunk(dst, r, c), src, in ? 16 : 0);
        }
        cp_async_commit();
        if (i >= kLag) {
          cp_async_wait_group<kLag>();
          complete(i - kLag);
        }
      } else {
        for (int q0 = 0; q0 < kChunks; q0 += kBatch) {
          uint4 v[kBatch];
          float sc[kBatch];
#pragma unroll
          for (int u = 0; u < kBatch; u++) {  // (the batch's loads first, all in flight)
            const int m = m0 + lt / 8 + 16 * (q0 + u);
            const bool in = ok && m < p.M && k < p.K;
            const size_t i_row = (size_t)g * p.M + m;
            v[u] = in ? ld_global_nc_v4(prm.x + (size_t)__ldg(prm.rows + i_row) * p.K + k) : make_uint4(0, 0, 0, 0);
            sc[u] = in ? __ldg(prm.scale + i_row) : 0.f;
          }
#pragma unroll
          for (int u = 0; u < kBatch; u++)
            if (ok) st_shared_v4(gathered_chunk(dst, lt / 8 + 16 * (q0 + u), c), scaled_chunk(v[u], sc[u]));
        }
        complete(i);
      }
    }
  }
  if (!kScaled) cp_async_wait_all();
  for (uint32_t j = i > kLag ? i - kLag : 0; j < i; j++) complete(j);
}

// --gather's producer with the cp.async completions on the ring's barrier instead
// (gather-arrive, as QuACK's gather_A; all 128 threads of warpgroup 0, lt its thread): each
// thread looks up its 8 rows (lt / 8 + 16 q) once a tile, copies its chunks of a position
// and hands their completion to full[s] (cp.async.mbarrier.arrive.noinc: full[s] expects
// 1 + 128 arrivals), then goes on to the next position at once: no cp.async group waits,
// no fence and no barrier on the producer's path. The consumers fence the async proxy
// after their full wait (the rows came through the generic proxy; wgmma reads them
// through the async one).
template <class E>
__device__ __forceinline__ void produce_gather_arrive(const Params& prm, uint8_t* stages, uint64_t* full,
                                                      uint64_t* empty, int lt) {
  constexpr int kChunks = E::TM * 8 / 128;
  const Problem& p = prm.p;
  uint32_t i = 0;
  for (int t = blockIdx.x; t < p.num_tiles; t += gridDim.x) {
    int g, m0, n0;
    tile_origin<E::TM, E::TN>(p, t, g, m0, n0);
    const int b_boxes = min(E::kBBoxes, (p.N - n0 + 63) / 64);
    int xr[kChunks];  // (-1: past the expert's rows)
#pragma unroll
    for (int q = 0; q < kChunks; q++) {
      const int m = m0 + lt / 8 + 16 * q;
      xr[q] = m < p.M ? __ldg(prm.rows + (size_t)g * p.M + m) : -1;
    }
    const int c = lt % 8;
    for (int kb = 0; kb < p.num_kb; kb++, i++) {
      const uint32_t s = i % E::kStages, ph = (i / E::kStages) & 1;
      if (!wait_phase(&empty[s], ph ^ 1, 1)) return;
      uint8_t* const dst = stages + s * E::kStageBytes;
      if (lt == 0) load_b_boxes<E>(prm, dst, &full[s], b_boxes, kb, n0, g);
      const int k = kb * BK + 8 * c;
#pragma unroll
      for (int q = 0; q < kChunks; q++) {
        const int r = lt / 8 + 16 * q;
        const bool in = xr[q] >= 0 && k < p.K;
        const bf16* src = in ? prm.x + (size_t)xr[q] * p.K + k : prm.x;
        cp_async_16_fill(gathered_chunk(dst, r, c), src, in ? 16 : 0);
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(&full[s])) : "memory");
    }
  }
}

// The packed bf16 pair of accumulators 4i + 2h, + 1 (row half h, chunk i of 8 columns).
template <int N>
__device__ __forceinline__ uint32_t acc_pair(const float (&a)[N], int i, int h) {
  return pack_bf16x2(a[4 * i + 2 * h], a[4 * i + 2 * h + 1]);
}

// A consumer's tile out: round r takes columns [r kEpiCols, (r + 1) kEpiCols) into buf as
// 64 x 64 boxes (row block rb, column box cb at box rb kColBoxes + cb; 16-byte chunk j of
// row x at chunk j ^ x % 8), then one thread stores those inside C as one bulk group.
// stmatrix: one writes the warp's 16 rows x 16 columns (chunks j, j + 1), lane l giving
// the address of row l % 8 of matrix l / 8 (row half (l / 8) % 2, chunk j + l / 16).
template <class E>
__device__ __forceinline__ void store_wg_tile(const Params& prm, const float (&acc)[E::kRowBlocks][E::WN / 2],
                                              uint8_t* buf, int t, int w, int lt) {
  const Problem& p = prm.p;
  int g, m0, n0;
  tile_origin<E::TM, E::TN>(p, t, g, m0, n0);
  if (E::kCoop) m0 += 64 * w;  // this warpgroup's half of the shared tile
  const int lane = lt % 32, q = lane / 8, rr = lane % 8;
  const uint32_t row = smem_addr(buf) + ((lt / 32) * 16 + rr + 8 * (q % 2)) * 128;
#pragma unroll
  for (int r = 0; r < E::kRounds; r++) {
    if (lt == 0) bulk_wait_read<0>();  // the stores of buf's previous round have read it
    named_bar_sync(1 + w, 128);
#pragma unroll
    for (int rb = 0; rb < E::kRowBlocks; rb++)
#pragma unroll
      for (int cb = 0; cb < E::kColBoxes; cb++)
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
          const int i = r * (E::kEpiCols / 8) + 8 * cb + j;
          stmatrix_x4(row + (rb * E::kColBoxes + cb) * kBoxBytes + (((j + q / 2) ^ rr) * 16), acc_pair(acc[rb], i, 0),
                      acc_pair(acc[rb], i, 1), acc_pair(acc[rb], i + 1, 0), acc_pair(acc[rb], i + 1, 1));
        }
    fence_proxy_async_smem();
    named_bar_sync(1 + w, 128);
    if (lt == 0) {
#pragma unroll
      for (int rb = 0; rb < E::kRowBlocks; rb++)
#pragma unroll
        for (int cb = 0; cb < E::kColBoxes; cb++) {
          const int m = m0 + 64 * rb, n = n0 + r * E::kEpiCols + 64 * cb;
          if (m < p.M && n < p.N) tma_store_3d(&prm.c, buf + (rb * E::kColBoxes + cb) * kBoxBytes, n, m, g);
        }
      bulk_commit();
    }
  }
}

// d_a's two bf16 words for dh values dh0, dh1 at gate words g2 and up words u2
// (swiglu_bwd, as the megakernel's swiglu_bwd_store: the same bits).
__device__ __forceinline__ void swiglu_bwd_pair(uint32_t g2, uint32_t u2, float dh0, float dh1, uint32_t& dg2,
                                                uint32_t& du2) {
  float dg[2], du[2], si;
  swiglu_bwd(bf16_lo(g2), bf16_lo(u2), dh0, dg[0], du[0], si);
  swiglu_bwd(bf16_hi(g2), bf16_hi(u2), dh1, dg[1], du[1], si);
  dg2 = pack_bf16x2(dg[0], dg[1]), du2 = pack_bf16x2(du[0], du[1]);
}

// --dh: a consumer's dh tile (64 x 256, or 128 x 128 as two 64-row blocks) out as d_a,
// in four units of 64 rows x 64 columns (unit u: quarter u of 64 x 256; column half u % 2
// of row block u / 2 of 128 x 128), unit u through slot u % kSlots of buf (a gate box,
// then an up box, 8 KB each; epi_full[slot] completes once a use, 4 / kSlots uses a tile,
// an even count, so use v of a slot in a tile waits for parity v & 1): thread lt 0 loads
// the unit's gate and up boxes, every thread turns the words under its accumulators into
// d_a in place, lt 0 stores both boxes. With two slots unit u + 2's loads go out once
// unit u's stores have read the slot.
template <class E>
__device__ __forceinline__ void dh_wg_tile(const Params& prm, const float (&acc)[E::kRowBlocks][E::WN / 2],
                                           uint8_t* buf, uint64_t* epi_full, int t, int w, int lt) {
  static_assert(E::WN * E::kRowBlocks == 256 && E::kDhSlots >= 1, "64 x 256 or 128 x 128 a warpgroup");
  constexpr int kSlots = E::kDhSlots > 2 ? 2 : E::kDhSlots;
  const Problem& p = prm.p;
  int g, m0, n0;
  tile_origin<E::TM, E::TN>(p, t, g, m0, n0);
  if (E::kCoop) m0 += 64 * w;
  constexpr int kQuarters = E::WN / 64;  // (unit u: column quarter u % kQuarters, row block u / kQuarters)
  auto load = [&](int u) {  // (lt 0)
    uint8_t* const dst = buf + (u % kSlots) * 2 * kBoxBytes;
    const int n = n0 + 64 * (u % kQuarters), m = m0 + 64 * (u / kQuarters);
    const bool in = n < p.N;
    mbar_arrive_expect_tx(&epi_full[u % kSlots], in ? 2 * kBoxBytes : 0);
    if (in) {
      tma_load_3d(dst, &prm.gu, &epi_full[u % kSlots], n, m, g);
      tma_load_3d(dst + kBoxBytes, &prm.gu, &epi_full[u % kSlots], p.N + n, m, g);
    }
  };
  if (lt == 0) {
    bulk_wait_read<0>();  // (the last tile's stores have read buf)
    for (int q = 0; q < kSlots; q++) load(q);
  }
  const int lane = lt % 32, r = (lt / 32) * 16 + lane / 4, sw = r % 8;  // rows r and r + 8: the same swizzle
#pragma unroll
  for (int u = 0; u < 4; u++) {
    const int q = u % kQuarters, rb = u / kQuarters, n = n0 + 64 * q;
    uint8_t* const dst = buf + (u % kSlots) * 2 * kBoxBytes;
    wait_phase(&epi_full[u % kSlots], (u / kSlots) & 1, 4);
    if (n < p.N) {
      const uint32_t row_a = smem_addr(dst) + r * 128 + 4 * (lane % 4);
#pragma unroll
      for (int j = 0; j < 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const uint32_t at = row_a + h * 8 * 128 + (j ^ sw) * 16;  // gate; up one box on
          const int i = 4 * (8 * q + j) + 2 * h;
          uint32_t dg2, du2;
          swiglu_bwd_pair(ld_shared_b32(at), ld_shared_b32(at + kBoxBytes), acc[rb][i], acc[rb][i + 1], dg2, du2);
          st_shared_b32(at, dg2);
          st_shared_b32(at + kBoxBytes, du2);
        }
      fence_proxy_async_smem();
    }
    named_bar_sync(1 + w, 128);  // (also: every thread past the wait before lt 0 arms the slot again)
    if (lt == 0) {
      if (n < p.N) {
        tma_store_3d(&prm.c, dst, n, m0 + 64 * rb, g);
        tma_store_3d(&prm.c, dst + kBoxBytes, p.N + n, m0 + 64 * rb, g);
        bulk_commit();
      }
      if (u + kSlots < 4) {
        bulk_wait_read<0>();
        load(u + kSlots);
      }
    }
  }
}

// Consumer w (0 or 1): cooperative, 64 rows of every tile of the CTA; ping-pong, the
// CTA's tiles i = w, w + 2, ..., its mainloop after the other's (turn[w]: the hand-over).
template <class E, bool kDh, bool kFenceA = false>
__device__ __forceinline__ void consume(const Params& prm, uint8_t* stages, uint8_t* epi, uint64_t* full,
                                        uint64_t* empty, uint64_t* turn, uint64_t* epi_full, int w) {
  const Problem& p = prm.p;
  const int lt = threadIdx.x % 128;
  uint8_t* const buf = epi + w * E::kEpiBytes;
  // ring position of tile i's first K block: the K blocks of the CTA's tiles before it
  // (ping-pong: the other consumer's between)
  uint32_t it0 = E::kCoop || w == 0 ? 0 : cta_tile_kb<E::TM, E::TN>(prm, 0);
  for (int i = E::kCoop ? 0 : w;; i += E::kCoop ? 1 : 2) {
    const int t = (int)blockIdx.x + i * (int)gridDim.x;
    if (t >= p.num_tiles) break;
    const int num_kb = cta_tile_kb<E::TM, E::TN>(prm, i);
    float acc[E::kRowBlocks][E::WN / 2];
#pragma unroll
    for (int rb = 0; rb < E::kRowBlocks; rb++)
#pragma unroll
      for (int x = 0; x < E::WN / 2; x++) acc[rb][x] = 0.f;
    // hand-over i - 1 (the other warpgroup's) is phase (i - 1) / 2 of turn[w]
    if (!E::kCoop && i > 0) wait_phase(&turn[w], ((i - 1) / 2) & 1, 3);
    uint32_t s = it0 % E::kStages, ph = (it0 / E::kStages) & 1, prev = 0;
    for (int kb = 0; kb < num_kb; kb++) {
      // the descriptors before the wait (pinned there), so the first wgmma issues as the data lands
      const uint8_t* const st = stages + s * E::kStageBytes;
      uint64_t da, db;
      box_descs<E::kMN, E::kMN>(st + (E::kCoop ? w : 0) * kBoxBytes, st + E::kABoxes * kBoxBytes, da, db);
      asm volatile("" : "+l"(da), "+l"(db));
      wait_phase(&full[s], ph, 2);
      if constexpr (kFenceA) fence_proxy_async_smem();  // (kFenceA: A's rows came by cp.async, unfenced)
      engine_block<E>(acc, da, db);
      // this block's wgmmas stay in flight; the previous block's are done: its stage is free
      // (an arrival a warp: a warp past its wait knows only its own share of the wgmmas)
      wgmma_wait<1>();
      if (kb > 0 && lt % 32 == 0) mbar_arrive(&empty[prev]);
      prev = s;
      if (++s == E::kStages) s = 0, ph ^= 1;
    }
    if (!E::kCoop && lt == 0) mbar_arrive(&turn[w ^ 1]);  // every wgmma of the tile issued
    wgmma_wait<0>();
    if (lt % 32 == 0) mbar_arrive(&empty[prev]);
    it0 += num_kb + (E::kCoop ? 0 : cta_tile_kb<E::TM, E::TN>(prm, i + 1));
    if (prm.knobs & 2) continue;  // (--knobs 2: no epilogue; a run-time flag, so the wgmmas stay)
    if constexpr (kDh) dh_wg_tile<E>(prm, acc, buf, epi_full + 2 * w, t, w, lt);
    else store_wg_tile<E>(prm, acc, buf, t, w, lt);
  }
  if (lt == 0) bulk_wait_all();  // the stores have read shared memory and are complete
}

// kGather: A by TMA (0), gathered by cp.async (1, --gather), through registers, scaled (2,
// --gather-scaled), or by cp.async completing on the ring's barrier (3, --gather; 4: the
// same without the consumers' proxy fence, a measurement of the fence's cost only: the
// memory model then does not order the rows before the wgmmas)
template <class E, bool kDh = false, int kGather = 0>
__global__ void __launch_bounds__(kEngineThreads, 1) engine_gemm_kernel(const __grid_constant__ Params prm) {
  const CtaProbe probe;  // (the rate a cycle: launch_ms)
  extern __shared__ uint8_t smem_raw[];
  // stages [kStages][kStageBytes], the consumers' store buffers [2][kEpiBytes] (both
  // 1024-byte aligned: the 128-byte swizzle), then full [kStages], empty [kStages], turn [2],
  // epi_full [2][2] (--dh: each consumer's quarter slots)
  uint8_t* const stages = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  uint8_t* const epi = stages + E::kStages * E::kStageBytes;
  uint64_t* const full = reinterpret_cast<uint64_t*>(epi + 2 * E::kEpiBytes);
  uint64_t* const empty = full + E::kStages;
  uint64_t* const turn = empty + E::kStages;
  uint64_t* const epi_full = turn + 2;
  if (threadIdx.x == 0) {
    for (int s = 0; s < E::kStages; s++) {
      // thread 0's expect_tx; the bytes; (kGather 1, 2) a second arrival once A's rows are
      // in, (3) each producer thread's cp.async completions
      mbar_init(&full[s], kGather >= 3 ? 1 + 128 : kGather ? 2 : 1);
      mbar_init(&empty[s], (E::kCoop ? 2 : 1) * 4);  // each warp of each consumer that reads it
    }
    mbar_init(&turn[0], 1), mbar_init(&turn[1], 1);
    for (int i = 0; i < 4; i++) mbar_init(&epi_full[i], 1);
    fence_mbar_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    regs_dec<kProducerRegs>();
    if (kGather >= 3) produce_gather_arrive<E>(prm, stages, full, empty, threadIdx.x);
    else if (kGather) produce_gather<E, kGather == 2>(prm, stages, full, empty, threadIdx.x);
    else if (threadIdx.x == 0) produce<E>(prm, stages, full, empty);
  } else {
    regs_inc<kConsumerRegs>();
    consume<E, kDh, kGather == 3>(prm, stages, epi, full, empty, turn, epi_full, wg - 1);
  }
}

// The control: the CTA's tiles (the engines' order, 128 x 256) through gemm_tiles, in
// runs of group_size(num_kb) tiles (one pipeline each, as one GEMM task of the
// megakernel), each tile's epilogue store_tile's bf16 TMA path.
struct TilesParams {
  CUtensorMap a, b;  // [G M, K], [G N, K] bf16, boxes of 64 x kBoxRows
  StoreMap c;        // [G M, N] (make_store_map's three maps); --dh: d_a, [G M][2][N] (gate_up_map's)
  CUtensorMap gu;    // --dh: gate|up, [G M][2][N], 64 x 1 x 128 boxes (the backward's m_arows_gu)
  bf16* c_base;
  uint32_t knobs;  // --knobs: MOK_KNOBS' measurement bits (gpu_params.h; 2: no epilogue)
  GpuStep st;      // tasks_gemm_kernel with st.sync: tasks by ticket (next_task), as the kernels take them
  Problem p;
};
template <int kBoxRows, bool kDh = false>
__global__ void __launch_bounds__(kThreads, 1) tiles_gemm_kernel(const __grid_constant__ TilesParams prm) {
  const CtaProbe probe;  // (the rate a cycle: launch_ms)
  Smem& sm = kernel_smem(prm.knobs);
  const Problem& p = prm.p;
  const int mine = ((int)(p.num_tiles - blockIdx.x) + (int)gridDim.x - 1) / (int)gridDim.x;
  const int size = group_size(p.num_kb);
  for (int r0 = 0; r0 < mine; r0 += size) {
    auto tile = [&](int i) { return (int)blockIdx.x + (r0 + i) * (int)gridDim.x; };
    gemm_tiles<0, 0, false, false, 4, kBoxRows>(
        sm, min(size, mine - r0),
        [&](int i, Operand& A, Operand& B, int& nk, int& kv) {
          int g, m0, n0;
          tile_origin<BM, BN>(p, tile(i), g, m0, n0);
          A = rows128(&prm.a, g * p.M + m0, 0, p.M - m0);
          B = wide(&prm.b, g * p.N + n0, 0);
          nk = p.num_kb, kv = p.K - (p.num_kb - 1) * BK;
        },
        [&](int i, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
          int g, m0, n0;
          tile_origin<BM, BN>(p, tile(i), g, m0, n0);
          if constexpr (kDh) {  // (rows as the map's: expert g's rows follow g - 1's)
            const int row0 = g * p.M + m0;
            swiglu_bwd_store(sm, acc, wg, w, l, row0, g * p.M + p.M, n0, p.N, &prm.gu, row0, &prm.c, row0,
                             prm.c_base, spare);
          } else {
            store_tile<kStoreBf16>(sm, acc, wg, w, l, m0, p.M, n0, p.N, prm.c_base + (size_t)g * p.M * p.N, p.N,
                                   &prm.c, g * p.M + m0, spare);
          }
        });
  }
  if (threadIdx.x == 0) bulk_wait_all();
}

// --pairs (plain cases): the control as the forward's GEMM tasks instead (gemm_group's:
// expert g's m-tile mt and a group of group_size(num_kb) column tiles, mt fastest), a
// cluster's CTAs on tasks base, base + 1 (m-tiles mt, mt + 1 of one column group when
// tiles_m is even), paired when both hold the same expert's column group (pair_agree:
// each CTA loads its A and half of B, multicast to both), as the forward pairs them.
// With prm.st.sync the CTAs take the tasks by ticket (next_task: a cluster two at once;
// finish_step zeroes the ticket for the next launch), as the kernels do; without, CTA b
// takes b, b + grid, ... (a static round robin).
template <int kBoxRows>
__global__ void __launch_bounds__(kThreads, 1) tasks_gemm_kernel(const __grid_constant__ TilesParams prm) {
  const CtaProbe probe;  // (the rate a cycle: launch_ms)
  Smem& sm = kernel_smem(prm.knobs);
  const Problem& p = prm.p;
  const int size = group_size(p.num_kb), groups = (p.tiles_n + size - 1) / size;
  const int tasks = p.G * groups * p.tiles_m, kv = p.K - (p.num_kb - 1) * BK;
  const bool tickets = prm.st.sync != nullptr;
  for (int base = blockIdx.x - sm.rank;; base += gridDim.x) {  // (both CTAs loop alike)
    int task = base + sm.rank;
    if (tickets ? !next_task(sm, prm.st, tasks, &task) : base >= tasks) break;
    const bool valid = task < tasks;
    const int mt = task % p.tiles_m, cg = task / p.tiles_m % groups, g = task / p.tiles_m / groups;
    const int n0 = cg * size, n = min(size, p.tiles_n - n0), m0 = mt * BM;
    auto setup = [&](int t, Operand& A, Operand& B, int& nk, int& v) {
      A = rows128(&prm.a, g * p.M + m0, 0, p.M - m0);
      B = wide(&prm.b, g * p.N + (n0 + t) * BN, 0);
      nk = p.num_kb, v = kv;
    };
    auto store = [&](int t, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
      store_tile<kStoreBf16>(sm, acc, wg, w, l, m0, p.M, (n0 + t) * BN, p.N, prm.c_base + (size_t)g * p.M * p.N, p.N,
                             &prm.c, g * p.M + m0, spare);
    };
    const bool paired = sm.cluster > 1 && pair_agree(sm, true, valid, valid ? pair_key(true, g, cg) : -1);
    if (!valid) continue;
    if (paired) gemm_tiles<0, 0, true, false, 4, kBoxRows>(sm, n, setup, store);
    else gemm_tiles<0, 0, false, false, 4, kBoxRows>(sm, n, setup, store);
  }
  if (tickets) {
    finish_step(sm, prm.st);  // (its stores' wait, the partner's barrier, the ticket zeroed)
    return;
  }
  if (threadIdx.x == 0) bulk_wait_all();
  if (sm.cluster > 1) cluster_sync();  // (no CTA leaves while its partner may still signal it)
}

// --wgrad: the weight-gradient tasks of case (G, M, N, K) (wgrad_task's A-resident runs):
// task (expert g, column group cg, m-tile mt), mt fastest (the CTAs at work at once share
// the expert's B), each a run of the group's column tiles over A = the expert's rows m-tile
// mt. a, b: chunk maps of the MN-major At [G][kpad][M], Bt [G][kpad][N] (k rows past K
// zeros); c: store maps of C [G M, N].
struct WgradParams {
  CUtensorMap a, b;
  StoreMap c;
  bf16* c_base;
  const int* k_rows;  // --spread: expert g's rows [G] (k rows of At, Bt past them zeros); null: p.K each
  int group;          // column tiles a task: wgrad_group_of(the mean K blocks), as the backward's
  int kpad;
  uint32_t knobs;  // --knobs, as TilesParams' (4: no spare stage for the epilogue)
  Problem p;
};
__global__ void __launch_bounds__(kThreads, 1) wgrad_tiles_kernel(const __grid_constant__ WgradParams prm) {
  const CtaProbe probe;  // (the rate a cycle: launch_ms)
  Smem& sm = kernel_smem(prm.knobs);
  const Problem& p = prm.p;
  const int size = prm.group, groups = (p.tiles_n + size - 1) / size;
  const int tasks = p.G * groups * p.tiles_m;
  // A cluster's CTAs take tasks base + rank (--pairs: two row tiles of one column group
  // when tiles_m is even), both looping alike: pair_agree is a cluster barrier.
  for (int base = blockIdx.x - sm.rank; base < tasks; base += gridDim.x) {
    const int task = base + sm.rank;
    const bool valid = task < tasks;
    const int mt = task % p.tiles_m, cg = task / p.tiles_m % groups, g = task / p.tiles_m / groups;
    const int k = valid ? (prm.k_rows ? prm.k_rows[g] : p.K) : 0;
    const int nk = (k + BK - 1) / BK, kv = k - (nk - 1) * BK;
    // wgrad_task's choice: at most kArBlocks K blocks alone (A resident), more paired
    const bool paired = sm.cluster > 1 && pair_agree(sm, true, valid, valid ? pair_key(nk > kArBlocks, g, cg) : -1);
    if (!valid) continue;
    const int n0 = cg * size, n = min(size, p.tiles_n - n0), map_row = g * p.M + mt * BM;
    auto setup = [&](int t, Operand& A, Operand& B, int& num_kb, int& v) {
      A = rows128(&prm.a, mt * BM, g * prm.kpad);
      B = wide(&prm.b, (n0 + t) * BN, g * prm.kpad);
      num_kb = nk, v = kv;
    };
    auto store = [&](int t, float(&acc)[kAcc], int wg, int w, int l, uint8_t* spare) {
      bf16* const c = prm.c_base + (size_t)g * p.M * p.N;
      store_tile<kStoreBf16>(sm, acc, wg, w, l, mt * BM, p.M, (n0 + t) * BN, p.N, c, p.N, &prm.c, map_row,
                             prm.knobs & 4 ? nullptr : spare);
    };
    if (paired) {
      gemm_tiles<1, 1, true, false, 4, 128>(sm, n, setup, store);
    } else if (nk <= kArBlocks) {
      gemm_tiles<1, 1, false, true, 4, 128>(sm, n, setup, store);
    } else {  // (without --pairs, or a partner on another column group)
      gemm_tiles<1, 1, false, false, 4, 128>(sm, n, setup, store);
    }
  }
  if (threadIdx.x == 0) bulk_wait_all();
  if (sm.cluster > 1) cluster_sync();  // (no CTA leaves while its partner may still signal it)
}

// --spread: zeros in X [G][rows][K] past expert g's k_rows[g] columns.
__global__ void zero_k_tail_kernel(bf16* X, int G, int rows, int K, const int* k_rows) {
  const size_t n = (size_t)G * rows * K;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    if ((int)(i % K) >= k_rows[i / K / rows]) X[i] = to_bf(0.f);
}

// --wgrad: At[g][k][m] = A[g][m][k] for k < K, zeros for K <= k < kpad (an MN-major copy).
__global__ void transpose_pad_kernel(const bf16* A, bf16* At, int G, int M, int K, int kpad) {
  const size_t n = (size_t)G * kpad * M;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const int m = (int)(i % M), k = (int)(i / M % kpad), g = (int)(i / M / kpad);
    At[i] = k < K ? A[((size_t)g * M + m) * K + k] : to_bf(0.f);
  }
}

// ---- reference, checks, inputs ----

// ref[g][m][n] = sum over k in increasing order of A[g][m][k] B[g][n][k] (fp32 fma), one
// thread an output; 32 x 32 outputs a block through shared memory, 32 k at a time.
__global__ void __launch_bounds__(1024)
    reference_kernel(const bf16* A, const bf16* B, float* ref, int M, int N, int K) {
  __shared__ float as[32][33], bs[32][33];
  const int tx = threadIdx.x, ty = threadIdx.y, g = blockIdx.z;
  const int m = blockIdx.y * 32 + ty, n = blockIdx.x * 32 + tx, nb = blockIdx.x * 32 + ty;
  const bf16* a = A + (size_t)g * M * K;
  const bf16* b = B + (size_t)g * N * K;
  float acc = 0.f;
  for (int k0 = 0; k0 < K; k0 += 32) {
    const int k = k0 + tx;
    as[ty][tx] = m < M && k < K ? bf(a[(size_t)m * K + k]) : 0.f;
    bs[ty][tx] = nb < N && k < K ? bf(b[(size_t)nb * K + k]) : 0.f;
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 32; kk++) acc = __fmaf_rn(as[ty][kk], bs[tx][kk], acc);
    __syncthreads();
  }
  if (m < M && n < N) ref[((size_t)g * M + m) * N + n] = acc;
}

// --dh: the reference d_a [G][M][2N] from the reference dh [G][M][N] and gate|up GU
// [G][M][2N], through swiglu_bwd (fp32, before the bf16 rounding).
__global__ void dh_reference_kernel(const float* dh, const bf16* gu, float* ref, size_t n, int N) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t row = i / N, col = i % N;
    float si;
    swiglu_bwd(bf(gu[row * 2 * N + col]), bf(gu[row * 2 * N + N + col]), dh[i], ref[row * 2 * N + col],
               ref[row * 2 * N + N + col], si);
  }
}

// The first i where c[i] is not within |c - ref| <= 1e-2 |ref| + atol (NaN: never), into *bad.
__global__ void check_kernel(const bf16* c, const float* ref, size_t n, float atol, unsigned long long* bad) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float v = bf(c[i]), r = ref[i];
    if (!(fabsf(v - r) <= 1e-2f * fabsf(r) + atol)) atomicMin(bad, (unsigned long long)i);
  }
}
// The first i where x and y differ in their bits, into *diff.
__global__ void same_bits_kernel(const uint16_t* x, const uint16_t* y, size_t n, unsigned long long* diff) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    if (x[i] != y[i]) atomicMin(diff, (unsigned long long)i);
}
// --gather-scaled: A's row i times scale[i], rounded to bf16 (scaled_pair's operations).
__global__ void scale_rows_kernel(bf16* A, const float* scale, size_t n_rows, int K) {
  for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n_rows * K; e += (size_t)gridDim.x * blockDim.x)
    A[e] = to_bf(__fmul_rn(bf(A[e]), scale[e / K]));
}
// x[i] scaled to [0.5, 1) (fill_kernel's values, made positive and halved).
__global__ void half_to_one_kernel(float* x, const bf16* u, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    x[i] = 0.75f + 0.25f * bf(u[i]);
}
// --gather: X's row rows[i] = A's row i ([G M] rows of K).
__global__ void scatter_rows_kernel(const bf16* A, const int* rows, bf16* X, size_t n_rows, int K) {
  for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n_rows * K; e += (size_t)gridDim.x * blockDim.x)
    X[(size_t)rows[e / K] * K + e % K] = A[e];
}
// x[i] uniform in [-1, 1) (splitmix64 of i and seed), rounded to bf16.
__global__ void fill_kernel(bf16* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint64_t z = i + seed * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    x[i] = to_bf((float)(z >> 40) * (2.f / 16777216.f) - 1.f);
  }
}

// ---- host ----
#define CK(x)                                                                                          \
  do {                                                                                                 \
    const cudaError_t e_ = (x);                                                                        \
    if (e_ != cudaSuccess) {                                                                           \
      fprintf(stderr, "engine_gemm: %s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                                         \
    }                                                                                                  \
  } while (0)
#define CKB(x)                                                                                        \
  do {                                                                                                \
    const cublasStatus_t s_ = (x);                                                                    \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                \
      fprintf(stderr, "engine_gemm: %s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #x, (int)s_); \
      exit(1);                                                                                        \
    }                                                                                                 \
  } while (0)

// A 3-D bf16 map at base (128-byte swizzle, 128-byte L2 promotion, zeros past the tensor)
// through the driver's cuTensorMapEncodeTiled, looked up once; whether the driver took it.
static bool encode_3d(CUtensorMap* map, const void* base, const cuuint64_t (&dims)[3], const cuuint64_t (&strides)[2],
                      const cuuint32_t (&box)[3]) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (!encode) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    if (!fn) fprintf(stderr, "engine_gemm: no cuTensorMapEncodeTiled\n"), exit(1);
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  const cuuint32_t elem[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box, elem,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A map of the [G][rows][cols] bf16 tensor at base, boxes of 64 columns x 64 rows x 1, as
// micro_host.h's 2-D bf16_map.
static void bf16_map_3d(CUtensorMap* map, const void* base, int G, int rows, int cols) {
  const cuuint64_t dims[3] = {(cuuint64_t)cols, (cuuint64_t)rows, (cuuint64_t)G};
  const cuuint64_t strides[2] = {(cuuint64_t)cols * 2, (cuuint64_t)rows * cols * 2};
  const cuuint32_t box[3] = {64, 64, 1};
  if (!encode_3d(map, base, dims, strides, box))
    fprintf(stderr, "engine_gemm: cuTensorMapEncodeTiled failed (%d x %d x %d)\n", G, rows, cols), exit(1);
}

// make_gate_up_map's map (cuda_backend.cu) of the [rows, 2F] gate|up buffer at base, seen
// as [rows][2][F], boxes of 64 x 1 x box_rows.
static void gate_up_map(CUtensorMap* map, const void* base, int rows, int F, int box_rows) {
  const cuuint64_t dims[3] = {(cuuint64_t)F, 2, (cuuint64_t)rows}, strides[2] = {(cuuint64_t)F * 2, (cuuint64_t)F * 4};
  const cuuint32_t box[3] = {64, 1, (cuuint32_t)box_rows};
  if (!encode_3d(map, base, dims, strides, box))
    fprintf(stderr, "engine_gemm: cuTensorMapEncodeTiled failed (gate|up %d x 2 x %d)\n", rows, F), exit(1);
}

// make_store_map's maps (cuda_backend.cu) of the [rows, cols] bf16 matrix at base: 128-
// and 16-row boxes, and the pair map (two 64-column boxes in one store) where the
// driver takes it.
static void store_maps(StoreMap* m, void* base, int rows, int cols) {
  if (!bf16_map("engine_gemm", &m->full, base, rows, cols, BM) ||
      !bf16_map("engine_gemm", &m->part, base, rows, cols, kStoreRows))
    exit(1);
  const cuuint64_t dims[3] = {64, (cuuint64_t)rows, (cuuint64_t)cols / 64}, strides[2] = {(cuuint64_t)cols * 2, 128};
  const cuuint32_t box[3] = {64, BM, 2};
  m->has_pair = encode_3d(&m->pair, base, dims, strides, box);
}

struct Case {
  char name[48];
  int G, M, N, K;
  std::vector<int> k_rows;  // --spread: each expert's rows (K is then their largest, rounded up to 8)
  int rows(int g) const { return k_rows.empty() ? K : k_rows[g]; }  // expert g's K
  double rows_total() const {
    double k = 0;
    for (int g = 0; g < G; g++) k += rows(g);
    return k;
  }
  double flops() const { return 2.0 * M * N * rows_total(); }  // (the useful ones)
};

// --wgrad: a chunk map (make_chunk_map's) of an MN-major copy [rows][cols] (rows: G kpad).
static void chunk_map(CUtensorMap* map, const bf16* base, int rows, int cols) {
  const cuuint64_t dims[3] = {64, (cuuint64_t)rows, (cuuint64_t)cols / 64};
  const cuuint64_t strides[2] = {(cuuint64_t)cols * 2, 128};
  const cuuint32_t box[3] = {64, 64, 2};
  if (!encode_3d(map, base, dims, strides, box))
    fprintf(stderr, "engine_gemm: cuTensorMapEncodeTiled failed (chunk map, %d columns)\n", cols), exit(1);
}

static bool g_dh = false;  // --dh: dh's GEMM with its SwiGLU backward epilogue (C = d_a, [G][M][2N])
static bool g_dh_shapes = false;  // --dh and --dh-plain (dh's shapes, the plain bf16 epilogue: C = dh)
static bool g_gather = false;     // --gather: A's rows gathered by the producer (cp.async)
static bool g_gather_scaled = false;  // --gather-scaled: and scaled on the way (through registers)
static bool g_in_order = false;  // --in-order: the gathers' row table the identity (X = A), not a permutation
static bool g_wgrad = false;     // --wgrad: small experts' weight gradients (MN-major, A resident)
static bool g_spread = false;    // --wgrad --spread: each expert's rows as routing spreads them
static bool g_pairs = false;     // --wgrad --pairs: the control in clusters, pairing as the backward does
// --knobs N: MOK_KNOBS' bits for every schedule (gpu_params.h; 2: no epilogue), nothing
// checked; and this file's own, checked: 4, the --wgrad control's tiles leave in two rounds
// through sm.epi, not one through it and the spare stage
static uint32_t g_knobs = 0;

// One case's device buffers: A [G][M][K], B [G][N][K]; C, C2 (a second run), C0 (the
// first schedule's output) [G][M][N] bf16; ref [G][M][N] fp32; two result words. --dh:
// C, C2, C0 and ref are d_a's [G][M][2N], GU gate|up [G][M][2N], ref_dh and C_dh (cuBLAS's
// output) dh's [G][M][N].
struct Buffers {
  bf16 *A, *B, *C, *C2, *C0, *GU, *C_dh, *X;
  bf16 *At, *Bt;  // --wgrad: MN-major copies [G][kpad][M], [G][kpad][N] (transpose_pad_kernel)
  int* k_rows;    // --spread: Case::k_rows on the device
  int* rows;     // --gather: X's row of A's row i (X [G M][K])
  float* scale;  // --gather-scaled: A's row i = bf16(scale[i] X[rows[i]])
  float *ref, *ref_dh;
  unsigned long long* word;
  size_t nc;
};

// Mean ms of kTimed launches after kWarm.
template <class Launch>
// The mean ms of kTimed launches after kWarm; *probe: CtaProbe's sums over the timed
// launches' CTAs ({cycles, ns}; zeros for a kernel without one, cuBLAS's).
static double launch_ms(Launch launch, unsigned long long (*probe)[2] = nullptr) {
  for (int i = 0; i < kWarm; i++) launch();
  const unsigned long long zero = 0;
  CK(cudaMemcpyToSymbol(g_probe_cycles, &zero, sizeof zero));
  CK(cudaMemcpyToSymbol(g_probe_ns, &zero, sizeof zero));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  for (int i = 0; i < kTimed; i++) launch();
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0.f;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  if (probe) {
    CK(cudaMemcpyFromSymbol(&(*probe)[0], g_probe_cycles, sizeof zero));
    CK(cudaMemcpyFromSymbol(&(*probe)[1], g_probe_ns, sizeof zero));
  }
  return ms / kTimed;
}

static int g_sms = 0;

// The first index at which kernel k(args..., word) finds a fault, or -1.
template <class Kernel, class... Args>
static long long first_fault(const Buffers& b, Kernel k, Args... args) {
  const unsigned long long none = ~0ull;
  CK(cudaMemcpy(b.word, &none, sizeof none, cudaMemcpyHostToDevice));
  k<<<g_sms * 8, 256>>>(args..., b.word);
  CK(cudaGetLastError());
  unsigned long long h = 0;
  CK(cudaMemcpy(&h, b.word, sizeof h, cudaMemcpyDeviceToHost));
  return h == none ? -1 : (long long)h;
}

// C against the reference; true when every element is within tolerance, else a line
// naming the first bad one.
// (dh_out: C is dh [G][M][N] against ref_dh, cuBLAS's under --dh)
static bool check_ref(const Case& c, const Buffers& b, const bf16* C, const char* who, bool dh_out = false) {
  const float* ref = dh_out ? b.ref_dh : b.ref;
  const int cols = g_dh && !dh_out ? 2 * c.N : c.N;
  const size_t n = (size_t)c.G * c.M * cols;
  const long long i = first_fault(b, check_kernel, (const bf16*)C, ref, n, 1e-3f * sqrtf((float)c.K));
  if (i < 0) return true;
  bf16 v;
  float r;
  CK(cudaMemcpy(&v, C + i, sizeof v, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&r, ref + i, sizeof r, cudaMemcpyDeviceToHost));
  const long long mn = (long long)c.M * cols;
  printf("  %s: MISMATCH at index %lld (expert %lld, row %lld, column %lld): %g, reference %g\n", who, i, i / mn,
         i % mn / cols, i % cols, (double)__bfloat162float(v), (double)r);
  return false;
}
static long long first_diff(const Buffers& b, const bf16* x, const bf16* y) {
  return first_fault(b, same_bits_kernel, (const uint16_t*)x, (const uint16_t*)y, b.nc);
}

// case c's problem in tiles of TM x TN.
static Problem tiled(const Case& c, int TM, int TN) {
  Problem p;
  p.G = c.G, p.M = c.M, p.N = c.N, p.K = c.K;
  p.tiles_m = (c.M + TM - 1) / TM, p.tiles_n = (c.N + TN - 1) / TN;
  p.num_tiles = c.G * p.tiles_m * p.tiles_n, p.num_kb = (c.K + BK - 1) / BK;
  return p;
}

// One schedule `who` on case c: launch(C) checked twice (into C against the reference,
// then into C2 for the same bits; failed(): the run itself failed, e.g. a wait timed
// out), then timed(). The first schedule to pass keeps its output in C0 (have_first) for
// the others' bits to be compared with. Returns false on a failed check.
template <class Launch, class Failed, class Timed>
static bool check_and_time(const Case& c, const Buffers& b, const char* who, int stages, double cublas_ms,
                           bool& have_first, Launch launch, Failed failed, Timed timed) {
  // --knobs other than 4: a measurement aid, the output is not the product: run, not checked
  const bool checked = !(g_knobs & ~4u);
  bool ok = true;
  for (int run = 0; run < 2 && ok; run++) {
    bf16* const C = run ? b.C2 : b.C;
    CK(cudaMemset(C, 0xff, b.nc * 2));  // NaN: an element no store reaches fails the check
    launch(C);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    ok = !failed() && (!checked || check_ref(c, b, C, who));
  }
  const long long d = ok && checked ? first_diff(b, b.C, b.C2) : -1;
  if (d >= 0) printf("  %s: NOT DETERMINISTIC: two runs differ first at index %lld\n", who, d), ok = false;
  if (!ok) return false;
  const char* vs_first = "";
  if (!checked) {
    vs_first = "; --knobs: not checked";
  } else if (!have_first) {
    CK(cudaMemcpy(b.C0, b.C, b.nc * 2, cudaMemcpyDeviceToDevice));
    have_first = true;
  } else {
    vs_first = first_diff(b, b.C, b.C0) < 0 ? ", same bits as the first" : ", other bits than the first";
  }
  unsigned long long probe[2];
  const double ms = launch_ms(timed, &probe);
  CK(cudaGetLastError());
  // the rate a cycle: the launches' FLOPs over the CTAs' cycles, 4096 FLOPs a cycle an SM
  // (dense bf16; trace_report.py's "% of peak per cycle"), at the CTAs' mean clock
  char cycle[48] = "";
  if (probe[0] > 0 && probe[1] > 0)
    snprintf(cycle, sizeof cycle, ", %4.0f MHz, %4.1f%% of peak a cycle", 1e3 * probe[0] / probe[1],
             100.0 * kTimed * c.flops() / ((double)probe[0] * 4096));
  printf("  %-24s %2d stages %8.3f ms %7.1f TFLOP/s %6.3fx cuBLAS  (%s%s%s)\n", who, stages, ms,
         c.flops() / ms * 1e-9, cublas_ms / ms, checked ? "checked, deterministic" : "run", vs_first, cycle);
  return true;
}

// Engine E on case c (check_and_time); kDh: --dh's epilogue (C is d_a); kGather: A's rows
// gathered from b.X through b.rows by the producer (1: cp.async; 2: scaled by b.scale; 3:
// cp.async completing on the ring's barrier).
template <class E, bool kDh = false, int kGather = 0>
static bool run_engine(const Case& c, const Buffers& b, double cublas_ms, bool& have_first) {
  Params prm;
  prm.x = b.X, prm.rows = b.rows, prm.scale = b.scale;
  prm.p = tiled(c, E::TM, E::TN);
  prm.knobs = g_knobs;
  prm.kpad = prm.p.num_kb * BK;
  prm.k_rows = b.k_rows;
  if (E::kMN) {  // (the control's MN-major copies and maps)
    if (c.M % 64 || c.N % 64) {
      printf("  %-24s not run: M or N %% 64 != 0 (chunk maps)\n", E::name());
      return true;
    }
    chunk_map(&prm.a, b.At, c.G * prm.kpad, c.M);
    chunk_map(&prm.b, b.Bt, c.G * prm.kpad, c.N);
  } else {
    bf16_map_3d(&prm.a, b.A, c.G, c.M, c.K);
    bf16_map_3d(&prm.b, b.B, c.G, c.N, c.K);
  }
  if (kDh) bf16_map_3d(&prm.gu, b.GU, c.G, c.M, 2 * c.N);
  CK(cudaFuncSetAttribute(engine_gemm_kernel<E, kDh, kGather>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          E::kSmemBytes));
  const int grid = prm.p.num_tiles < g_sms ? prm.p.num_tiles : g_sms;
  char who[64];
  snprintf(who, sizeof who, "%s %dx%d%s", E::name(), E::TM, E::TN,
           kDh                ? " dh"
           : kGather == 1     ? " gather"
           : kGather == 2     ? " gather-scaled"
           : kGather == 3     ? " gather-arrive"
           : kGather == 4     ? " gather-arrive-nofence"
                              : "");
  auto launch = [&](bf16* C) {
    bf16_map_3d(&prm.c, C, c.G, c.M, kDh ? 2 * c.N : c.N);
    engine_gemm_kernel<E, kDh, kGather><<<grid, kEngineThreads, E::kSmemBytes>>>(prm);
  };
  auto timed_out = [&] {
    unsigned long long to = 0;
    CK(cudaMemcpyFromSymbol(&to, g_timeout, sizeof to));
    if (!to) return false;
    printf("  %s: an mbarrier wait timed out (role %llu: 1 producer empty, 2 consumer full, 3 turn, 4 dh loads; "
           "block %llu)\n",
           who, to >> 32, to & 0xffffffffull);
    const unsigned long long zero = 0;
    CK(cudaMemcpyToSymbol(g_timeout, &zero, sizeof zero));
    return true;
  };
  return check_and_time(c, b, who, E::kStages, cublas_ms, have_first, launch, timed_out,
                        [&] { engine_gemm_kernel<E, kDh, kGather><<<grid, kEngineThreads, E::kSmemBytes>>>(prm); });
}

// A launch of grid CTAs of kThreads, in clusters of two when `pairs` (the backward's
// launch_config; *attr must outlive the configuration's use).
static cudaLaunchConfig_t cluster_launch(int grid, int smem, bool pairs, cudaLaunchAttribute* attr) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = 2, attr->val.clusterDim.y = 1, attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3(grid), lc.blockDim = dim3(kThreads), lc.dynamicSmemBytes = smem;
  lc.attrs = attr, lc.numAttrs = pairs ? 1 : 0;
  return lc;
}

// The control (tiles_gemm_kernel, maps of kBoxRows-row boxes) on case c (check_and_time);
// kDh: with swiglu_bwd_store (C is d_a); kTasks (--pairs): tasks_gemm_kernel instead, the
// forward's GEMM tasks, in clusters of two (`clusters`) or each CTA alone (the same tasks,
// never paired: what pairing itself costs or gains), taken by ticket as the kernels take
// them (`tickets`) or in a static round robin.
template <int kBoxRows, bool kDh = false, bool kTasks = false>
static bool run_tiles(const Case& c, const Buffers& b, double cublas_ms, bool& have_first, bool clusters = true,
                      bool tickets = true) {
  static_assert(!(kDh && kTasks), "the tasks' form has the plain epilogue");
  char who[64];
  if (kTasks)
    snprintf(who, sizeof who, "gemm_tiles %d tasks %s%s", kBoxRows, clusters ? "paired" : "alone",
             tickets ? "" : ", static");
  else snprintf(who, sizeof who, "gemm_tiles %d-row boxes%s", kBoxRows, kDh ? " dh" : "");
  if (c.N % 64) {
    printf("  %-24s not run: N %% 64 != 0 (the CUDA backend's rule for H and F)\n", who);
    return true;
  }
  TilesParams prm;
  memset(&prm.st, 0, sizeof prm.st);
  prm.p = tiled(c, BM, BN);
  prm.knobs = g_knobs;
  if (kTasks && tickets) {  // (one zeroed GpuSync and status word for every such run: finish_step re-zeroes)
    static GpuSync* sync = nullptr;
    static uint32_t* status = nullptr;
    if (!sync) {
      CK(cudaMalloc(&sync, sizeof(GpuSync)));
      CK(cudaMalloc(&status, sizeof(uint32_t)));
      CK(cudaMemset(sync, 0, sizeof(GpuSync)));
      CK(cudaMemset(status, 0, sizeof(uint32_t)));
    }
    prm.st.sync = sync, prm.st.status = status;
  }
  if (!bf16_map("engine_gemm", &prm.a, b.A, c.G * c.M, c.K, kBoxRows) ||
      !bf16_map("engine_gemm", &prm.b, b.B, c.G * c.N, c.K, kBoxRows))
    exit(1);
  if (kDh) gate_up_map(&prm.gu, b.GU, c.G * c.M, c.N, BM);
  const int size = group_size(prm.p.num_kb);
  const int work = kTasks ? c.G * ((prm.p.tiles_n + size - 1) / size) * prm.p.tiles_m : prm.p.num_tiles;
  int grid = work < g_sms ? work : g_sms;
  if (kTasks && clusters) grid += grid & 1;  // (whole clusters)
  const int smem = (int)sizeof(Smem) + 1024;
  auto* const kernel = [] {  // (the one instantiated)
    if constexpr (kTasks) return tasks_gemm_kernel<kBoxRows>;
    else return tiles_gemm_kernel<kBoxRows, kDh>;
  }();
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t lc = cluster_launch(grid, smem, kTasks && clusters, &attr);
  auto run = [&] { CK(cudaLaunchKernelEx(&lc, kernel, prm)); };
  auto launch = [&](bf16* C) {
    if (kDh) {  // (make_gate_up_store_map's: no pair map)
      memset(&prm.c, 0, sizeof prm.c);
      gate_up_map(&prm.c.full, C, c.G * c.M, c.N, BM);
      gate_up_map(&prm.c.part, C, c.G * c.M, c.N, kStoreRows);
    } else {
      store_maps(&prm.c, C, c.G * c.M, c.N);
    }
    prm.c_base = C;
    run();
  };
  return check_and_time(c, b, who, kStages, cublas_ms, have_first, launch, [] { return false; }, run);
}

// --wgrad: wgrad_tiles_kernel on case c (check_and_time).
static bool run_wgrad(const Case& c, const Buffers& b, double cublas_ms, bool& have_first) {
  WgradParams prm;
  prm.p = tiled(c, BM, BN);
  // the mean K blocks a tile, as the backward's wgrad_group (max(1, ceil(ceil(T K / E) / 64)))
  const int mean_k = (int)ceil(c.rows_total() / c.G);
  const int mean_kb = mean_k > BK ? (mean_k + BK - 1) / BK : 1;
  int ar = 0, more = 0;  // experts of at most kArBlocks K blocks, and of more
  for (int g = 0; g < c.G; g++) (c.rows(g) + BK - 1) / BK <= kArBlocks ? ar++ : more++;
  char who[48];
  if (!more) snprintf(who, sizeof who, "gemm_tiles AR");
  else if (!ar) snprintf(who, sizeof who, "gemm_tiles %s", g_pairs ? "paired" : "streamed");
  else snprintf(who, sizeof who, "gemm_tiles %d AR, %d %s", ar, more, g_pairs ? "paired" : "streamed");
  if (c.M % 64 || c.N % 64) {
    printf("  %-24s not run: M or N %% 64 != 0 (the CUDA backend's rule for H and F)\n", who);
    return true;
  }
  prm.kpad = prm.p.num_kb * BK;
  prm.knobs = g_knobs;
  prm.k_rows = b.k_rows;
  prm.group = wgrad_group_of(mean_kb);
  chunk_map(&prm.a, b.At, c.G * prm.kpad, c.M);
  chunk_map(&prm.b, b.Bt, c.G * prm.kpad, c.N);
  const int tasks = c.G * ((prm.p.tiles_n + prm.group - 1) / prm.group) * prm.p.tiles_m;
  int grid = tasks < g_sms ? tasks : g_sms;
  if (g_pairs) grid += grid & 1;  // (whole clusters)
  const int smem = (int)sizeof(Smem) + 1024;
  CK(cudaFuncSetAttribute(wgrad_tiles_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t lc = cluster_launch(grid, smem, g_pairs, &attr);
  auto run = [&] { CK(cudaLaunchKernelEx(&lc, wgrad_tiles_kernel, prm)); };
  auto launch = [&](bf16* C) {
    store_maps(&prm.c, C, c.G * c.M, c.N);
    prm.c_base = C;
    run();
  };
  return check_and_time(c, b, who, kStages, cublas_ms, have_first, launch, [] { return false; }, run);
}

// C = A B^T for every expert: cuBLAS is column-major, so it computes C^T (N x M, ld N) =
// B (N x K: op T of the K x N column-major view, ld K) x A^T (K x M column-major, ld K).
static void cublas_gemm(cublasHandle_t h, const Case& c, const Buffers& b, bf16* C) {
  const float one = 1.f, zero = 0.f;
  CKB(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, c.N, c.M, c.K, &one, b.B, CUDA_R_16BF, c.K,
                                 (long long)c.N * c.K, b.A, CUDA_R_16BF, c.K, (long long)c.M * c.K, &zero, C,
                                 CUDA_R_16BF, c.N, (long long)c.M * c.N, c.G, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// Lets E's kernel have its shared memory and prints its configuration.
template <class E>
static void describe(const char* sep) {
  CK(cudaFuncSetAttribute(engine_gemm_kernel<E>, cudaFuncAttributeMaxDynamicSharedMemorySize, E::kSmemBytes));
  cudaFuncAttributes fa;
  CK(cudaFuncGetAttributes(&fa, engine_gemm_kernel<E>));
  printf("%s%s %dx%d: %d stages of %d KB, %d KB shared, %d registers a thread at launch", sep, E::name(), E::TM, E::TN,
         E::kStages, E::kStageBytes / 1024, E::kSmemBytes / 1024, fa.numRegs);
}

int main(int argc, char** argv) {
  bool quick = false;
  const char* only = nullptr;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick"))
      quick = true;
    else if (!strcmp(argv[i], "--dh"))
      g_dh = g_dh_shapes = true;
    else if (!strcmp(argv[i], "--dh-plain"))
      g_dh_shapes = true;
    else if (!strcmp(argv[i], "--gather"))
      g_gather = true;
    else if (!strcmp(argv[i], "--gather-scaled"))
      g_gather_scaled = true;
    else if (!strcmp(argv[i], "--in-order"))
      g_in_order = true;
    else if (!strcmp(argv[i], "--wgrad"))
      g_wgrad = true;
    else if (!strcmp(argv[i], "--spread"))
      g_spread = true;
    else if (!strcmp(argv[i], "--pairs"))
      g_pairs = true;
    else if (!strcmp(argv[i], "--case") && i + 1 < argc)
      only = argv[++i];
    else if (!strcmp(argv[i], "--knobs") && i + 1 < argc)
      g_knobs = (uint32_t)strtoul(argv[++i], nullptr, 0);
    else
      return fprintf(stderr, "usage: engine_gemm [--quick] [--dh | --dh-plain | --gather | --gather-scaled | --wgrad] "
                             "[--spread] [--pairs] [--in-order] [--case SUBSTRING] [--knobs N]\n"),
             2;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  g_sms = prop.multiProcessorCount;
  if (prop.major != 9) return fprintf(stderr, "engine_gemm: needs sm_90 (found %d.%d)\n", prop.major, prop.minor), 1;
  cublasHandle_t handle;
  CKB(cublasCreate(&handle));

  // The named layers (bench/shapes.py: T, H, F, E, K), each expert at M = T K / E rows.
  struct Layer {
    const char* name;
    int T, H, F, E, K;
  };
  const Layer layers[] = {{"qwen3-30b-a3b", 16384, 2048, 768, 128, 8},
                          {"gpt-oss-120b", 16384, 2880, 2880, 128, 4},
                          {"mixtral-8x7b", 8192, 4096, 14336, 8, 2},
                          {"deepseek-v3", 8192, 7168, 2048, 256, 8}};
  std::vector<Case> cases;
  if (g_wgrad) {  // dW13 (M 2F, N H) and dW2 (M H, N F) of 64 experts, K = an expert's rows
    cases.push_back({"tails wgrad", 3, 320, 704, 200});  // (a last K block of 8 rows, a half past N)
    cases.push_back({"tails wgrad 6 blocks", 3, 192, 576, 360});  // (streamed; a last block of 40 rows)
    const struct {
      const char* name;
      int H, F, rows;
    } small[] = {{"deepseek-v3", 7168, 2048, 256}, {"kimi-k2", 7168, 2048, 168}, {"qwen3.5", 4096, 1024, 320}};
    for (const auto& l : small) {
      if (quick) break;
      Case w13{}, w2{};
      snprintf(w13.name, sizeof w13.name, "%s dW13", l.name);
      snprintf(w2.name, sizeof w2.name, "%s dW2", l.name);
      w13.G = w2.G = 64, w13.K = w2.K = l.rows;
      w13.M = 2 * l.F, w13.N = l.H, w2.M = l.H, w2.N = l.F;
      cases.push_back(w13), cases.push_back(w2);
    }
  } else if (g_dh_shapes) {  // dh = dy_rows w2[e]: M = T K / E, N = F, K = H (tails: N a multiple of 64)
    cases.push_back({"tails dh", 3, 300, 960, 1000});
    for (const Layer& l : layers) {
      if (quick) break;
      Case dh{};
      snprintf(dh.name, sizeof dh.name, "%s dh", l.name);
      dh.G = l.E, dh.M = l.T * l.K / l.E, dh.N = l.F, dh.K = l.H;
      cases.push_back(dh);
    }
  } else {
    cases.push_back({"tails", 3, 300, 904, 1000});
  }
  if (!quick && !g_dh_shapes && !g_wgrad) {
    for (const Layer& l : layers) {
      const int M = l.T * l.K / l.E;
      Case up{}, down{};
      snprintf(up.name, sizeof up.name, "%s gate/up", l.name);
      snprintf(down.name, sizeof down.name, "%s down", l.name);
      up.G = down.G = l.E, up.M = down.M = M;
      up.N = 2 * l.F, up.K = l.H, down.N = l.H, down.K = l.F;
      cases.push_back(up), cases.push_back(down);
    }
    cases.push_back({"dense", 1, 8192, 8192, 8192});
  }
  if ((g_spread && !g_wgrad) || (g_pairs && (g_dh_shapes || g_gather || g_gather_scaled)))
    return fprintf(stderr, "engine_gemm: --spread goes with --wgrad, --pairs with --wgrad or the plain cases\n"), 2;
  if (g_spread) {  // each expert's rows: mean K, standard deviation sqrt(K) (routing's binomial, E large), one fixed draw
    uint64_t z = 0x2545f4914f6cdd1dull;
    auto uniform = [&] {  // (0, 1)
      z ^= z << 13, z ^= z >> 7, z ^= z << 17;
      return ((double)(z >> 11) + 0.5) / 9007199254740992.0;
    };
    for (Case& c : cases) {
      int kmax = 0;
      for (int g = 0; g < c.G; g++) {
        const double u1 = uniform(), u2 = uniform();
        const double normal = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);  // (Box-Muller)
        const int k = std::max(1, (int)lround(c.K + sqrt((double)c.K) * normal));
        c.k_rows.push_back(k), kmax = std::max(kmax, k);
      }
      c.K = (kmax + 7) / 8 * 8;  // (the K-major A and B: rows of whole 16-byte words)
    }
  }
  printf(
      "engine_gemm: %s, %d SMs; C = A B^T per expert, bf16 in and out, fp32 accumulation; mean of %d launches "
      "after %d\n",
      prop.name, g_sms, kTimed, kWarm);
  describe<Cooperative>("  ");
  describe<PingPong128>("; ");
  describe<PingPong64>("; ");
  printf(" (setmaxnreg: producer %d, consumers %d)\n", kProducerRegs, kConsumerRegs);

  int failed = 0;
  for (const Case& c : cases) {
    if (only && !strstr(c.name, only)) continue;
    if (c.N % 8 || c.K % 8) {  // TMA: row pitches a multiple of 16 bytes
      printf("%s: N and K must be multiples of 8\n", c.name);
      failed++;
      continue;
    }
    printf("%s: %d x (M %d, N %d, K %d), %.1f GFLOP", c.name, c.G, c.M, c.N, c.K, c.flops() * 1e-9);
    if (!c.k_rows.empty())
      printf(" (--spread: K the largest expert's; rows %d to %d, mean %.1f)",
             *std::min_element(c.k_rows.begin(), c.k_rows.end()), *std::max_element(c.k_rows.begin(), c.k_rows.end()),
             c.rows_total() / c.G);
    printf("\n");
    fflush(stdout);
    Buffers b{};
    const size_t na = (size_t)c.G * c.M * c.K, nb = (size_t)c.G * c.N * c.K;
    const size_t ndh = (size_t)c.G * c.M * c.N;
    b.nc = g_dh ? 2 * ndh : ndh;
    CK(cudaMalloc(&b.A, na * 2));
    CK(cudaMalloc(&b.B, nb * 2));
    CK(cudaMalloc(&b.C, b.nc * 2));
    CK(cudaMalloc(&b.C2, b.nc * 2));
    CK(cudaMalloc(&b.C0, b.nc * 2));
    CK(cudaMalloc(&b.ref, b.nc * 4));
    CK(cudaMalloc(&b.word, sizeof(unsigned long long)));
    fill_kernel<<<g_sms * 8, 256>>>(b.A, na, 1);
    fill_kernel<<<g_sms * 8, 256>>>(b.B, nb, 2);
    if (!c.k_rows.empty()) {  // --spread: no expert has rows past its own
      CK(cudaMalloc(&b.k_rows, c.G * sizeof(int)));
      CK(cudaMemcpy(b.k_rows, c.k_rows.data(), c.G * sizeof(int), cudaMemcpyHostToDevice));
      zero_k_tail_kernel<<<g_sms * 8, 256>>>(b.A, c.G, c.M, c.K, b.k_rows);
      zero_k_tail_kernel<<<g_sms * 8, 256>>>(b.B, c.G, c.N, c.K, b.k_rows);
    }
    if (g_gather || g_gather_scaled) {  // A's rows scattered into X by a permutation (and A scaled)
      std::vector<int> rows(c.G * (size_t)c.M);
      for (size_t i = 0; i < rows.size(); i++) rows[i] = (int)i;
      uint64_t z = 0x9e3779b97f4a7c15ull;  // (a fixed Fisher-Yates shuffle: the same rows every run)
      for (size_t i = rows.size(); i > 1 && !g_in_order; i--) {
        z ^= z << 13, z ^= z >> 7, z ^= z << 17;
        std::swap(rows[i - 1], rows[z % i]);
      }
      CK(cudaMalloc(&b.rows, rows.size() * sizeof(int)));
      CK(cudaMalloc(&b.X, na * 2));
      CK(cudaMemcpy(b.rows, rows.data(), rows.size() * sizeof(int), cudaMemcpyHostToDevice));
      scatter_rows_kernel<<<g_sms * 8, 256>>>(b.A, b.rows, b.X, rows.size(), c.K);
      if (g_gather_scaled) {  // the logical A: each row scaled, as the producer will make it from X
        bf16* u = nullptr;
        CK(cudaMalloc(&u, rows.size() * 2));
        CK(cudaMalloc(&b.scale, rows.size() * sizeof(float)));
        fill_kernel<<<g_sms * 8, 256>>>(u, rows.size(), 4);
        half_to_one_kernel<<<g_sms * 8, 256>>>(b.scale, u, rows.size());
        scale_rows_kernel<<<g_sms * 8, 256>>>(b.A, b.scale, rows.size(), c.K);
        CK(cudaDeviceSynchronize());
        CK(cudaFree(u));
      }
      CK(cudaGetLastError());
    }
    if (g_wgrad) {  // the MN-major copies, k padded with zeros to whole K blocks
      const int kpad = (c.K + BK - 1) / BK * BK;
      CK(cudaMalloc(&b.At, (size_t)c.G * kpad * c.M * 2));
      CK(cudaMalloc(&b.Bt, (size_t)c.G * kpad * c.N * 2));
      transpose_pad_kernel<<<g_sms * 8, 256>>>(b.A, b.At, c.G, c.M, c.K, kpad);
      transpose_pad_kernel<<<g_sms * 8, 256>>>(b.B, b.Bt, c.G, c.N, c.K, kpad);
      CK(cudaGetLastError());
    }
    if (g_dh) {  // the reference dh, then d_a from it and gate|up
      CK(cudaMalloc(&b.GU, b.nc * 2));
      CK(cudaMalloc(&b.C_dh, ndh * 2));
      CK(cudaMalloc(&b.ref_dh, ndh * 4));
      fill_kernel<<<g_sms * 8, 256>>>(b.GU, b.nc, 3);
      reference_kernel<<<dim3((c.N + 31) / 32, (c.M + 31) / 32, c.G), dim3(32, 32)>>>(b.A, b.B, b.ref_dh, c.M, c.N,
                                                                                      c.K);
      dh_reference_kernel<<<g_sms * 8, 256>>>(b.ref_dh, b.GU, b.ref, ndh, c.N);
    } else {
      reference_kernel<<<dim3((c.N + 31) / 32, (c.M + 31) / 32, c.G), dim3(32, 32)>>>(b.A, b.B, b.ref, c.M, c.N, c.K);
    }
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());

    bf16* const C_peer = g_dh ? b.C_dh : b.C;  // (--dh: cuBLAS's dh alone, no epilogue)
    CK(cudaMemset(C_peer, 0xff, ndh * 2));
    cublas_gemm(handle, c, b, C_peer);
    CK(cudaDeviceSynchronize());
    // (--spread: cuBLAS multiplies every expert at the largest K, zeros past its rows)
    const char* peer = g_dh ? "cuBLAS (dh alone)" : c.k_rows.empty() ? "cuBLAS" : "cuBLAS (largest K)";
    const bool peer_ok = check_ref(c, b, C_peer, peer, g_dh);
    const double peer_ms = launch_ms([&] { cublas_gemm(handle, c, b, C_peer); });
    printf("  %-24s %9s %8.3f ms %7.1f TFLOP/s%s\n", peer, "", peer_ms,
           c.flops() / peer_ms * 1e-9, peer_ok ? "  (checked)" : "");
    failed += !peer_ok;
    bool have_first = false;
    if (g_dh) {  // the control first: the others' bits are compared with the step's epilogue
      failed += !run_tiles<128, true>(c, b, peer_ms, have_first);
      failed += !run_engine<Cooperative, true>(c, b, peer_ms, have_first);
      failed += !run_engine<PingPong128, true>(c, b, peer_ms, have_first);
      failed += !run_engine<PingPong64, true>(c, b, peer_ms, have_first);
    } else if (g_wgrad) {  // the control first
      failed += !run_wgrad(c, b, peer_ms, have_first);
      failed += !run_engine<CooperativeMN>(c, b, peer_ms, have_first);
      failed += !run_engine<Cooperative>(c, b, peer_ms, have_first);
      failed += !run_engine<PingPong128>(c, b, peer_ms, have_first);
    } else if (g_gather || g_gather_scaled) {  // each engine with TMA A, then A gathered from X
      failed += !run_engine<Cooperative>(c, b, peer_ms, have_first);
      if (g_gather) {
        failed += !run_engine<Cooperative, false, 1>(c, b, peer_ms, have_first);
        failed += !run_engine<Cooperative, false, 3>(c, b, peer_ms, have_first);
        failed += !run_engine<Cooperative, false, 4>(c, b, peer_ms, have_first);
      } else {
        failed += !run_engine<Cooperative, false, 2>(c, b, peer_ms, have_first);
      }
      failed += !run_engine<PingPong128>(c, b, peer_ms, have_first);
      if (g_gather) {
        failed += !run_engine<PingPong128, false, 1>(c, b, peer_ms, have_first);
        failed += !run_engine<PingPong128, false, 3>(c, b, peer_ms, have_first);
      } else {
        failed += !run_engine<PingPong128, false, 2>(c, b, peer_ms, have_first);
      }
      failed += !run_tiles<128>(c, b, peer_ms, have_first);
    } else {
      failed += !run_engine<Cooperative>(c, b, peer_ms, have_first);
      failed += !run_engine<PingPong128>(c, b, peer_ms, have_first);
      failed += !run_engine<PingPong64>(c, b, peer_ms, have_first);
      failed += !run_tiles<64>(c, b, peer_ms, have_first);
      failed += !run_tiles<128>(c, b, peer_ms, have_first);
      if (g_pairs) {
        failed += !run_tiles<128, false, true>(c, b, peer_ms, have_first);
        failed += !run_tiles<128, false, true>(c, b, peer_ms, have_first, false);
        failed += !run_tiles<128, false, true>(c, b, peer_ms, have_first, false, false);
      }
    }
    fflush(stdout);
    CK(cudaFree(b.A));
    CK(cudaFree(b.B));
    CK(cudaFree(b.C));
    CK(cudaFree(b.C2));
    CK(cudaFree(b.C0));
    CK(cudaFree(b.ref));
    CK(cudaFree(b.word));
    if (g_dh) {
      CK(cudaFree(b.GU));
      CK(cudaFree(b.C_dh));
      CK(cudaFree(b.ref_dh));
    }
    if (g_wgrad) {
      CK(cudaFree(b.At));
      CK(cudaFree(b.Bt));
    }
    if (b.k_rows) CK(cudaFree(b.k_rows));
    if (g_gather || g_gather_scaled) {
      CK(cudaFree(b.rows));
      CK(cudaFree(b.X));
      if (g_gather_scaled) CK(cudaFree(b.scale));
    }
  }
  CKB(cublasDestroy(handle));
  printf(failed ? "engine_gemm: %d checks FAILED\n" : "engine_gemm: every check passed\n", failed);
  return failed ? 1 : 0;
}
