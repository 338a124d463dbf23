/* gemm_impl.h — body of the CPU GEMM, included once per numeric type by gemm.c with
 *   GEMM_NAME   the function, ACT the operand type, REAL the accumulator type,
 *   LOAD(v)     ACT -> REAL.
 * Tiles of C (BLOCK_M x BLOCK_N) are shared out over threads; each tile walks K in
 * steps of BLOCK_K, packing its A and B slices into REAL panels, and a register-blocked
 * micro-kernel (MICRO_M x MICRO_N) continues each C element's running sum from where
 * the previous K step left it, so the k order is the plain 0..K-1 order. */

static inline __attribute__((always_inline)) void GEMM_CAT(GEMM_NAME, _micro)(int64_t kc, const REAL* restrict ap,
                                        const REAL* restrict bp, REAL* restrict c,
                                        int64_t ldc, int64_t mr, int64_t nr, int first) {
  REAL acc[MICRO_M][MICRO_N];
  for (int i = 0; i < MICRO_M; i++)
    for (int j = 0; j < MICRO_N; j++)
      acc[i][j] = (!first && i < mr && j < nr) ? c[i * ldc + j] : (REAL)0;
  for (int64_t k = 0; k < kc; k++) {
    const REAL* a = ap + k * MICRO_M;
    const REAL* b = bp + k * MICRO_N;
    for (int i = 0; i < MICRO_M; i++)
      for (int j = 0; j < MICRO_N; j++) acc[i][j] = acc[i][j] + a[i] * b[j];
  }
  for (int64_t i = 0; i < mr; i++)
    for (int64_t j = 0; j < nr; j++) c[i * ldc + j] = acc[i][j];
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void GEMM_NAME(const mok_gemm_t* g, void* pack, int num_threads) {
  const ACT* A = (const ACT*)g->A;
  const ACT* B = (const ACT*)g->B;
  REAL* C = (REAL*)g->C;
  const int64_t tiles_m = (g->M + BLOCK_M - 1) / BLOCK_M;
  const int64_t tiles_n = (g->N + BLOCK_N - 1) / BLOCK_N;
  if (g->M <= 0 || g->N <= 0) return;
  if (g->K <= 0) {
    for (int64_t m = 0; m < g->M; m++)
      for (int64_t n = 0; n < g->N; n++) C[m * g->ldc + n] = (REAL)0;
    return;
  }
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t tile = 0; tile < tiles_m * tiles_n; tile++) {
    REAL* ap = (REAL*)((char*)pack + (size_t)omp_get_thread_num() * mok_gemm_pack_bytes());
    REAL* bp = ap + BLOCK_M * BLOCK_K;
    const int64_t m0 = (tile / tiles_n) * BLOCK_M, n0 = (tile % tiles_n) * BLOCK_N;
    const int64_t mc = g->M - m0 < BLOCK_M ? g->M - m0 : BLOCK_M;
    const int64_t nc = g->N - n0 < BLOCK_N ? g->N - n0 : BLOCK_N;
    for (int64_t k0 = 0; k0 < g->K; k0 += BLOCK_K) {
      const int64_t kc = g->K - k0 < BLOCK_K ? g->K - k0 : BLOCK_K;
      /* A panels: [mc / MICRO_M][kc][MICRO_M], rows past M are zero */
      for (int64_t i0 = 0; i0 < mc; i0 += MICRO_M)
        for (int64_t k = 0; k < kc; k++)
          for (int64_t i = 0; i < MICRO_M; i++) {
            int64_t m = m0 + i0 + i;
            ap[i0 * kc + k * MICRO_M + i] =
                (i0 + i < mc) ? LOAD(A[m * g->a_m + (k0 + k) * g->a_k]) : (REAL)0;
          }
      /* B panels: [nc / MICRO_N][kc][MICRO_N], columns past N are zero */
      for (int64_t j0 = 0; j0 < nc; j0 += MICRO_N)
        for (int64_t k = 0; k < kc; k++)
          for (int64_t j = 0; j < MICRO_N; j++) {
            int64_t n = n0 + j0 + j;
            bp[j0 * kc + k * MICRO_N + j] =
                (j0 + j < nc) ? LOAD(B[(k0 + k) * g->b_k + n * g->b_n]) : (REAL)0;
          }
      for (int64_t i0 = 0; i0 < mc; i0 += MICRO_M)
        for (int64_t j0 = 0; j0 < nc; j0 += MICRO_N) {
          int64_t mr = mc - i0 < MICRO_M ? mc - i0 : MICRO_M;
          int64_t nr = nc - j0 < MICRO_N ? nc - j0 : MICRO_N;
          GEMM_CAT(GEMM_NAME, _micro)(kc, ap + i0 * kc, bp + j0 * kc,
                                      C + (m0 + i0) * g->ldc + n0 + j0, g->ldc, mr, nr, k0 == 0);
        }
    }
  }
}
