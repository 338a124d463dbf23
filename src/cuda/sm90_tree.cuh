// sm90_tree.cuh — the fixed pairwise tree over 64-token chunks (DESIGN.md section 2),
// evaluated as a binary counter: the replicated gradients' reduction (TREE) and PREFIX's
// loss statistics.
#pragma once
#include "sm90_smem.cuh"

namespace mok {

// The fixed pairwise tree over n leaves in order (DESIGN.md section 2): node i of a
// level = node 2i + node 2i+1 of the level below, a lone last node moving up. Evaluated
// as a binary counter over the leaves in order: node[L] holds the pending left node of
// level L (bit L of the leaves seen); a new node of level L is added to it from the
// right and carries to level L + 1; at the end the pending nodes fold from the lowest
// level up, which is the lone-node rule. The same bits as the level-by-level evaluation.
constexpr int kTreeLevels = 26;  // chunks = ceil(T / 64) < 2^26 for any int32 T
// Where a counter's pending nodes live: a thread's column of shared memory strided by
// kThreads, floats or float4s (tree_task's rounds, PREFIX's loss statistics; no GEMM
// state beside them; PREFIX's in registers spilled the forward kernel).
struct SmemNodes {
  float* p;
  __device__ __forceinline__ float& operator[](int L) { return p[L * kThreads]; }
  __device__ __forceinline__ float operator[](int L) const { return p[L * kThreads]; }
};
// (four adjacent columns' trees side by side: a float4 a node)
struct SmemNodes4 {
  float4* p;
  __device__ __forceinline__ float4& operator[](int L) { return p[L * kThreads]; }
  __device__ __forceinline__ float4 operator[](int L) const { return p[L * kThreads]; }
};
__device__ __forceinline__ float tree_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float4 tree_add(float4 a, float4 b) {  // (each column's own addition)
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}
template <class Nodes, class T = float>
struct TreeCounter {
  Nodes node;
  uint32_t seen = 0;
  // x: the subtree of leaves [seen, seen + 2^level)
  __device__ __forceinline__ void push(T x, int level) {
    bool carry = true;  // (no break: node stays in registers)
#pragma unroll
    for (int L = 0; L < kTreeLevels; L++) {
      if (L < level || !carry) continue;
      if ((seen >> L) & 1u) {
        x = tree_add(node[L], x);
      } else {
        node[L] = x;
        carry = false;
      }
    }
    seen += 1u << level;
  }
  // the pending nodes, from the lowest level up (the lone-node rule)
  __device__ __forceinline__ T fold() const {
    T r{};
    bool any = false;
#pragma unroll
    for (int L = 0; L < kTreeLevels; L++)
      if ((seen >> L) & 1u) {
        r = any ? tree_add(node[L], r) : node[L];
        any = true;
      }
    return r;
  }
};

}  // namespace mok
