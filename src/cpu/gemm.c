/* gemm.c — instantiates the CPU GEMM (gemm_impl.h) for bf16 -> fp32 and for double.
 * Built with -ffp-contract=off: the micro-kernel's multiply and add round separately,
 * the same on every instruction set the compiler picks. */
#include "gemm.h"

#include <omp.h>

#include "../internal.h"

#define BLOCK_M 96
#define BLOCK_N 128
#define BLOCK_K 256
#define MICRO_M 6
#define MICRO_N 32
#define GEMM_CAT_(a, b) a##b
#define GEMM_CAT(a, b) GEMM_CAT_(a, b)

size_t mok_gemm_pack_bytes(void) {
  return (size_t)(BLOCK_M + BLOCK_N) * BLOCK_K * sizeof(double) + 64;
}

#define GEMM_NAME mok_gemm_bf16
#define ACT uint16_t
#define REAL float
#define LOAD(v) mok_bf16_to_f32(v)
#include "gemm_impl.h"
#undef GEMM_NAME
#undef ACT
#undef REAL
#undef LOAD

#define GEMM_NAME mok_gemm_f64
#define ACT double
#define REAL double
#define LOAD(v) (v)
#include "gemm_impl.h"
