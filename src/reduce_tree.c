/* reduce_tree.c — mok_reduce_tree: the fixed binary tree over chunk partials that
 * makes replicated gradients independent of how the chunks are shared out over ranks
 * (node [lo, hi) = node [lo, mid) + node [mid, hi), mid = mok_tree_mid(lo, hi): the
 * pairwise tree). */
#include <stdlib.h>

#include "internal.h"

/* out = sum of partials [lo, hi); scratch holds a partial per level below */
static void tree(const float* partials, int64_t lo, int64_t hi, int64_t n, float* out, float* scratch) {
  if (hi - lo == 1) {
    memcpy(out, partials + lo * n, (size_t)n * sizeof(float));
    return;
  }
  const int64_t mid = mok_tree_mid(lo, hi);
  tree(partials, lo, mid, n, out, scratch);
  tree(partials, mid, hi, n, scratch, scratch + n);
  for (int64_t i = 0; i < n; i++) out[i] = out[i] + scratch[i];
}

mok_status_t mok_reduce_tree(const float* partials, int64_t num_chunks, int64_t n, float* out) {
  if (num_chunks < 0 || n < 0) return MOK_STATUS_INVALID_SHAPE;
  if (!out || (!partials && num_chunks > 0)) return MOK_STATUS_NULL_POINTER;
  if (num_chunks == 0) {
    memset(out, 0, (size_t)n * sizeof(float));
    return MOK_STATUS_SUCCESS;
  }
  float* scratch = malloc((size_t)(mok_tree_depth(num_chunks) * n + 1) * sizeof(float));
  if (!scratch) return MOK_STATUS_OUT_OF_MEMORY;
  tree(partials, 0, num_chunks, n, out, scratch);
  free(scratch);
  return MOK_STATUS_SUCCESS;
}
