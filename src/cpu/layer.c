/* layer.c — the CPU backend: instantiates layer_impl.h for the two numerics,
 *   bf16:  ACT bf16 bits, REAL fp32, ST rounds to bf16 at the contract's points;
 *   exact: ACT = REAL = double, ST is the identity (for finite-difference checks),
 * and dispatches the context's calls to them. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "../internal.h"
#include "cpu_comm.h"
#include "gemm.h"

#define FN(name) bf16_##name
#define ACT uint16_t
#define REAL float
#define LD(v) mok_bf16_to_f32(v)
#define ST(v) mok_f32_to_bf16(v)
#define EXP expf
#define LOG logf
#define GEMM mok_gemm_bf16
#include "layer_impl.h"
#undef FN
#undef ACT
#undef REAL
#undef LD
#undef ST
#undef EXP
#undef LOG
#undef GEMM

#define FN(name) exact_##name
#define ACT double
#define REAL double
#define LD(v) (v)
#define ST(v) (v)
#define EXP exp
#define LOG log
#define GEMM mok_gemm_f64
#include "layer_impl.h"

mok_status_t mok_cpu_forward(mok_context_t* ctx, const mok_forward_args_t* a) {
  return ctx->cfg.numerics == MOK_NUMERICS_EXACT ? exact_forward(ctx, a) : bf16_forward(ctx, a);
}

mok_status_t mok_cpu_backward(mok_context_t* ctx, const mok_backward_args_t* a) {
  return ctx->cfg.numerics == MOK_NUMERICS_EXACT ? exact_backward(ctx, a) : bf16_backward(ctx, a);
}
