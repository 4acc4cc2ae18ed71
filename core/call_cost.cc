#include "core/call_cost.h"

#include <algorithm>

namespace attention {
namespace {

// Sum of min(first + i, cap) for i = 0, 1, ..., rows - 1 (rows >= 1), in
// doubles. The row count stays an integer: near 2^63 a double steps by
// 1024, so first + rows - 1 would round back to first.
double SumCapped(double first, int64_t rows, double cap) {
  const double n = static_cast<double>(rows);
  if (first >= cap) return cap * n;
  // Rows below the cap (first < cap: both are key counts, exact here).
  const double below = std::min(n, cap - first);
  return below * first + below * (below - 1) / 2 + (n - below) * cap;
}

// Visible (query, key) pairs, each query's count capped at `cap_keys`.
double VisiblePairs(int64_t num_queries, const MaskSpec& mask,
                    int64_t num_keys, double cap_keys) {
  if (num_queries <= 0 || num_keys <= 0) return 0;
  if (!mask.causal) {
    return static_cast<double>(num_queries) *
           std::min(static_cast<double>(num_keys), cap_keys);
  }
  // Query i sees at most min(p + 1, num_keys) keys, p = query_start + i,
  // and at most window + num_sink_tokens of them under a window. An upper
  // bound is all a limit needs, and it is exact without a window.
  const double first = static_cast<double>(mask.query_start) + 1;
  double cap = std::min(static_cast<double>(num_keys), cap_keys);
  if (mask.window > 0) {
    cap = std::min(cap, static_cast<double>(mask.window) +
                            static_cast<double>(mask.num_sink_tokens));
  }
  return SumCapped(first, num_queries, cap);
}

// What a visible (query head, key) pair costs: 2 * (head_dim + value_dim)
// flops, each width counted as at least kMinCostedWidth: the kernels work
// on whole blocks of 16 values (and the softmax is per pair), so a call of
// width-1 heads costs about what width 16 does.
constexpr int64_t kMinCostedWidth = 16;
double PairFlops(int64_t num_q_heads, int64_t head_dim, int64_t value_dim) {
  return 2.0 *
         static_cast<double>(std::max(head_dim, kMinCostedWidth) +
                             std::max(value_dim, kMinCostedWidth)) *
         static_cast<double>(num_q_heads);
}

}  // namespace

double AttentionFlops(int64_t num_queries, int64_t num_q_heads,
                      int64_t head_dim, int64_t value_dim,
                      const MaskSpec& mask, int64_t num_keys) {
  return PairFlops(num_q_heads, head_dim, value_dim) *
         VisiblePairs(num_queries, mask, num_keys,
                      static_cast<double>(num_keys));
}

double TopKAttentionFlops(int64_t num_queries, int64_t num_q_heads,
                          int64_t head_dim, int64_t value_dim,
                          int64_t index_heads, int64_t index_dim, int64_t topk,
                          const MaskSpec& mask, int64_t num_keys) {
  // The index kernels also work on whole blocks of 16 values, and every
  // scored key is then selected (its score and position written and
  // partitioned): counted as kSelectionFlops.
  constexpr double kSelectionFlops = 16.0;
  const double per_scored_pair =
      2.0 * static_cast<double>(index_heads) *
          static_cast<double>(std::max(index_dim, kMinCostedWidth) + 1) +
      kSelectionFlops;
  const double per_pair = PairFlops(num_q_heads, head_dim, value_dim);
  return per_scored_pair * VisiblePairs(num_queries, mask, num_keys,
                                        static_cast<double>(num_keys)) +
         per_pair * VisiblePairs(num_queries, mask, num_keys,
                                 static_cast<double>(topk));
}

}  // namespace attention
