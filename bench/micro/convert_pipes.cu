// convert_pipes.cu — how fast an SM converts fp32 to bf16 and evaluates ex2, alone and
// interleaved: thread instructions a cycle per SM (132 CTAs x 256 threads, 8
// independent chains a thread). It showed that `cvt.rn.bf16.f32` (F2F) shares the
// MUFU pipe at 16 a cycle per SM, while `cvt.rn.bf16x2.f32` (F2FP) has its own at 32
// (docs/PERF.md, seventh session; the SwiGLU epilogue in sm90_epilogues.cuh).
//   make micro && build/micro/convert_pipes
#include <cstdint>
#include <cstdio>

constexpr int kCtas = 132, kThreads = 256, kChains = 8, kIters = 4096;

__device__ __forceinline__ uint32_t cvt_bf16x2(float a, float b) {  // F2FP
  uint32_t r;
  asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float cvt_bf16(float a) {  // F2F, back to fp32 by a shift
  uint16_t r;
  asm volatile("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(a));
  return __uint_as_float((uint32_t)r << 16);
}
__device__ __forceinline__ float ex2(float a) {  // MUFU.EX2
  float r;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
// the bf16 pair by integer round-to-nearest-even (no conversion instruction)
__device__ __forceinline__ uint32_t int_bf16x2(float a, float b) {
  uint32_t x = __float_as_uint(a), y = __float_as_uint(b);
  x += 0x7fffu + ((x >> 16) & 1u);
  y += 0x7fffu + ((y >> 16) & 1u);
  return __byte_perm(x, y, 0x7632);
}

enum { kF2fp, kF2f, kEx2, kF2fpEx2, kIntPack, kF2fEx2, kCases };
const char* const kNames[kCases] = {"F2FP (cvt.rn.bf16x2.f32)", "F2F (cvt.rn.bf16.f32)", "MUFU.EX2",
                                    "F2FP + EX2, pairs", "bf16x2 by integer rounding", "F2F + EX2, pairs"};

// Each chain's next value depends on its last (one cheap ALU op beside the measured
// one), so nothing is hoisted; the & keeps the bf16 pairs finite.
template <int kCase>
__global__ void __launch_bounds__(kThreads, 1) pipes(float* sink, long long* cycles) {
  float v[kChains];
  for (int i = 0; i < kChains; i++) v[i] = 1.0f + threadIdx.x * 1e-3f + i;
  __syncthreads();
  const long long t0 = clock64();
  for (int n = 0; n < kIters; n++) {
#pragma unroll
    for (int i = 0; i < kChains; i++) {
      const float w = v[(i + 1) % kChains];
      if (kCase == kF2fp) v[i] = __uint_as_float(cvt_bf16x2(v[i], w) & 0x3fffffffu);
      if (kCase == kF2f) v[i] = cvt_bf16(v[i]) + 1.0f;
      if (kCase == kEx2) v[i] = ex2(v[i] * 1e-3f);
      if (kCase == kF2fpEx2) v[i] = ex2(__uint_as_float(cvt_bf16x2(v[i], w) & 0x3fffffffu) * 1e-3f);
      if (kCase == kIntPack) v[i] = __uint_as_float(int_bf16x2(v[i], w) & 0x3fffffffu);
      if (kCase == kF2fEx2) v[i] = ex2(cvt_bf16(v[i]) * 1e-3f);
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  float s = 0.f;
  for (int i = 0; i < kChains; i++) s += v[i];
  sink[blockIdx.x * kThreads + threadIdx.x] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int kCase>
static void run(float* sink, long long* cycles) {
  for (int rep = 0; rep < 2; rep++) pipes<kCase><<<kCtas, kThreads>>>(sink, cycles);  // the first warms up
  long long h[kCtas];
  cudaMemcpy(h, cycles, sizeof h, cudaMemcpyDeviceToHost);
  double mean = 0;
  for (long long c : h) mean += (double)c / kCtas;
  printf("%-28s %6.2f a cycle per SM\n", kNames[kCase], (double)kThreads * kIters * kChains / mean);
}

int main() {
  float* sink;
  long long* cycles;
  if (cudaMalloc(&sink, sizeof(float) * kCtas * kThreads) != cudaSuccess ||
      cudaMalloc(&cycles, sizeof(long long) * kCtas) != cudaSuccess) {
    fprintf(stderr, "convert_pipes: no GPU memory\n");
    return 1;
  }
  run<kF2fp>(sink, cycles);
  run<kF2f>(sink, cycles);
  run<kEx2>(sink, cycles);
  run<kF2fpEx2>(sink, cycles);
  run<kIntPack>(sink, cycles);
  run<kF2fEx2>(sink, cycles);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) fprintf(stderr, "convert_pipes: %s\n", cudaGetErrorString(e));
  return e != cudaSuccess;
}
