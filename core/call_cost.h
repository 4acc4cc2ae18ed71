// CallCost: the arithmetic one attention call asks for, known before any of
// it runs, so that a server can refuse a call that would occupy it for
// minutes (EngineOptions::max_call_flops) instead of discovering it after.
#ifndef ATTENTION_CORE_CALL_COST_H_
#define ATTENTION_CORE_CALL_COST_H_

#include <cstdint>

#include "core/attention_problem.h"

namespace attention {

// Floating-point operations of `num_queries` query rows of `num_q_heads`
// heads over keys [0, num_keys) under `mask`: 2 * (head_dim + value_dim)
// per visible (query head, key) pair, the q.k dot product and the p.v
// accumulation (softmax and merges are lower order), each width counted as
// at least 16 (the kernels' block of values). A double: the product
// of untrusted dimensions can pass 2^63. O(1).
double AttentionFlops(int64_t num_queries, int64_t num_q_heads,
                      int64_t head_dim, int64_t value_dim,
                      const MaskSpec& mask, int64_t num_keys);

// A top-k problem: the index scoring, 2 * index_heads * index_dim (+ the
// weighted sum; index_dim counted as at least 16) plus 16 for the selection
// per visible (query, key) pair, plus attention over at most `topk` keys
// per query. An upper bound, O(1).
double TopKAttentionFlops(int64_t num_queries, int64_t num_q_heads,
                          int64_t head_dim, int64_t value_dim,
                          int64_t index_heads, int64_t index_dim, int64_t topk,
                          const MaskSpec& mask, int64_t num_keys);

}  // namespace attention

#endif  // ATTENTION_CORE_CALL_COST_H_
