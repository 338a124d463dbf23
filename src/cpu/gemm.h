/* gemm.h — the CPU backend's GEMM: C[M, N] = sum_k A(m, k) * B(k, n), with A and B in
 * the activation type (bf16 or double) at any strides and C in the accumulation type
 * (fp32 or double), ldc elements apart.
 *
 * Summation order: every C element is one accumulator that adds the products in
 * increasing k, one rounding per multiply and per add (no contraction), starting from
 * +0. Blocking over M, N and K and the thread count change who computes an element,
 * never its order, so the bits do not depend on them. K = 0 gives zeros. */
#ifndef MOK_CPU_GEMM_H
#define MOK_CPU_GEMM_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
  int64_t M, N, K;
  const void* A; int64_t a_m, a_k; /* A(m, k) = A[m * a_m + k * a_k] */
  const void* B; int64_t b_k, b_n; /* B(k, n) = B[k * b_k + n * b_n] */
  void* C; int64_t ldc;            /* C(m, n) = C[m * ldc + n] */
} mok_gemm_t;

/* Packing scratch needed per thread, in bytes. */
size_t mok_gemm_pack_bytes(void);
/* pack: num_threads * mok_gemm_pack_bytes() bytes. */
void mok_gemm_bf16(const mok_gemm_t* g, void* pack, int num_threads); /* A,B bf16; C fp32 */
void mok_gemm_f64(const mok_gemm_t* g, void* pack, int num_threads);  /* A,B,C double */

#endif
