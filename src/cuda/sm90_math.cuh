// sm90_math.cuh — the layer's arithmetic at its rounding points (DESIGN.md section 1,
// docs/CPU.md): bf16 conversions, the router's scores and softmax sums, the shared
// expert's gate, and the SwiGLU (plain and gpt-oss's clamped); every sum in one fixed
// order, written beside it, so that the forward and backward kernels get the same bits.
#pragma once
#include "sm90_smem.cuh"  // (kMaxRouterExperts)

namespace mok {

__device__ __forceinline__ float bf(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ __nv_bfloat16 to_bf(float v) { return __float2bfloat16_rn(v); }
// The two bf16 of a pack_bf16x2 word as floats: the first (low half), the second (high).
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
// A token's softmax probability and router score of logit l, given the logits' max m and
// sum of exp(l - m): one expression each, so that every caller gets the same bits.
__device__ __forceinline__ float router_prob(float l, float m, float sum) {
  return __fdiv_rn(__expf(__fsub_rn(l, m)), sum);
}
// sigmoid(l) = 1 / (1 + e^-l), rounded division: the router's sigmoid scores and the
// shared-expert gate.
__device__ __forceinline__ float sigmoid_rn(float l) { return __fdiv_rn(1.f, __fadd_rn(1.f, __expf(-l))); }
__device__ __forceinline__ float router_score(float l, float prob, int score) {
  return score == MOK_SCORE_SOFTMAX ? prob : sigmoid_rn(l);
}
__device__ __forceinline__ float warp_sum(float v) {  // fixed butterfly order
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = __fadd_rn(v, __shfl_xor_sync(~0u, v, o));
  return v;
}
// The shared-expert gate of one token (cfg.use_shared_gate), in a warp: s_g =
// sigmoid(x . w_sg) over the token's row x [H], the dot product a lane's 16-byte chunks
// v = lane + 32 u in increasing u (8 products each in order, from +0), then warp_sum's
// butterfly; every lane gets it. The token's row alone decides it: the same bits at
// every W and in every batch (D3, D4). The forward's COMBINE computes it once and saves
// it for the backward.
__device__ __forceinline__ float shared_gate_warp(const bf16* x, const bf16* w_sg, int H) {
  const int nv = H / 8;
  float part = 0.f;
#pragma unroll 4
  for (int v = threadIdx.x % 32; v < nv; v += 32) {
    const uint4 xr = *reinterpret_cast<const uint4*>(x + v * 8), wr = __ldg(reinterpret_cast<const uint4*>(w_sg) + v);
    const bf16 *a = reinterpret_cast<const bf16*>(&xr), *b = reinterpret_cast<const bf16*>(&wr);
#pragma unroll
    for (int k = 0; k < 8; k++) part = __fadd_rn(part, __fmul_rn(bf(a[k]), bf(b[k])));
  }
  return sigmoid_rn(warp_sum(part));
}
// One token's router scores, in a warp: lane holds experts lane + 32 i (i < NR; E <= 32
// NR: NR = 8 up to 256 experts, 16 up to 512, 32 up to 1024). prob = softmax of the
// logits, score = the router score (softmax or sigmoid), both 0 past E; returns
// logsumexp. Sums: a lane's experts in increasing i, then the warp's fixed butterfly
// (token_softmax_sums: the same order without the arrays). Forward and backward call
// these functions: the same bits.
template <int NR>
__device__ __forceinline__ float token_scores(const float* logits, int E, int score, float (&prob)[NR],
                                              float (&sc)[NR]) {
  const int lane = threadIdx.x % 32;
  float l[NR], m = -INFINITY;
#pragma unroll
  for (int i = 0; i < NR; i++) {
    l[i] = lane + 32 * i < E ? logits[lane + 32 * i] : -INFINITY;
    m = fmaxf(m, l[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NR; i++) sum = __fadd_rn(sum, lane + 32 * i < E ? __expf(__fsub_rn(l[i], m)) : 0.f);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum = __fadd_rn(sum, __shfl_xor_sync(~0u, sum, o));
#pragma unroll
  for (int i = 0; i < NR; i++) {
    const bool in = lane + 32 * i < E;
    prob[i] = in ? router_prob(l[i], m, sum) : 0.f;
    sc[i] = in ? router_score(l[i], prob[i], score) : 0.f;
  }
  return __fadd_rn(m, __logf(sum));
}
// token_scores' max m and sum of exp(l - m) for any E (<= kMaxRouterExperts), the
// logits read again instead of held: a lane's experts in increasing i, then the same
// butterfly (the lanes past E add nothing: the same bits as token_scores); returns
// logsumexp.
__device__ __forceinline__ float token_softmax_sums(const float* logits, int E, float& m, float& sum) {
  const int lane = threadIdx.x % 32;
  m = -INFINITY;
  for (int e = lane; e < E; e += 32) m = fmaxf(m, logits[e]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  sum = 0.f;
  for (int e = lane; e < E; e += 32) sum = __fadd_rn(sum, __expf(__fsub_rn(logits[e], m)));
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum = __fadd_rn(sum, __shfl_xor_sync(~0u, sum, o));
  return __fadd_rn(m, __logf(sum));
}

// sigmoid and silu through the SFU (ex2 and rcp, approximate; no division's slow-path
// branch, so the SwiGLU epilogues' 64-128 evaluations a thread interleave). DESIGN.md
// fixes the rounding points around them (bf16 gate and up in, bf16 h or d_a out), not
// their last fp32 bit; every run and every SM gives the same bits. e^-g is __expf's
// (-g times log2 e rounded to float, then ex2) with subnormal results flushed: those
// come from g > 87, where 1 + e^-g is 1 either way, so sigmoid's bits are __expf's.
__device__ __forceinline__ float sigmoid_fast(float g) {
  return rcp_approx(__fadd_rn(1.f, ex2_approx_ftz(__fmul_rn(-g, __int_as_float(0x3fb8aa3b)))));
}
__device__ __forceinline__ float silu(float g) { return __fmul_rn(g, sigmoid_fast(g)); }
// gpt-oss's clamped SwiGLU (mok.h cfg.activation, docs/CPU.md): gate' = min(gate, limit),
// up' = clamp(up, -limit, limit), NaN staying NaN (the comparisons fail for it).
__device__ __forceinline__ float clamp_gate(float g, float limit) { return g > limit ? limit : g; }
__device__ __forceinline__ float clamp_up(float u, float limit) { return u > limit ? limit : u < -limit ? -limit : u; }
// The clamped h from gate' (gc) and sg = sigmoid(alpha gate') already at hand (the
// SwiGLU backward has them): (up' + 1) (gate' sg).
__device__ __forceinline__ float swiglu_h_clamped(float gc, float sg, float u, float limit) {
  return __fmul_rn(__fadd_rn(clamp_up(u, limit), 1.f), __fmul_rn(gc, sg));
}
// h of a bf16 gate and up, in fp32: silu(gate) up, or (kClamped) (up' + 1) (gate'
// sigmoid(alpha gate')) in that order.
template <bool kClamped>
__device__ __forceinline__ float swiglu_h(float g, float u, float alpha, float limit) {
  if constexpr (!kClamped) return __fmul_rn(silu(g), u);
  const float gc = clamp_gate(g, limit);
  return swiglu_h_clamped(gc, sigmoid_fast(__fmul_rn(alpha, gc)), u, limit);
}
// The SwiGLU backward of one element, not clamped (docs/CPU.md): d_gate = (dh up) silu'(gate),
// d_up = dh silu(gate), silu' = s (1 + gate (1 - s)), s = sigmoid(gate); si = silu(gate)
// (h = si up: swiglu_h<false>'s operations).
__device__ __forceinline__ void swiglu_bwd(float gate, float up, float dh, float& dg, float& du, float& si) {
  const float sg = sigmoid_fast(gate);
  si = __fmul_rn(gate, sg);
  const float dsi = __fmul_rn(sg, __fadd_rn(1.f, __fmul_rn(gate, __fsub_rn(1.f, sg))));
  dg = __fmul_rn(__fmul_rn(dh, up), dsi);
  du = __fmul_rn(dh, si);
}

}  // namespace mok
