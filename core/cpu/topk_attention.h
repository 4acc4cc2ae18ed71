// Top-k sparse attention on the CPU (attention_problem.h's TopKSpec): per
// query row, index scores over the visible keys, the k best kept (ties:
// lower position), then dense attention of the row over exactly those keys,
// gathered in increasing position into a contiguous sequence and run
// through the ordinary dense kernels. So a row's output is bitwise the
// dense non-causal attention over its selected keys, whatever the batch.
#ifndef ATTENTION_CORE_CPU_TOPK_ATTENTION_H_
#define ATTENTION_CORE_CPU_TOPK_ATTENTION_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/attention_problem.h"
#include "core/thread_pool.h"

namespace attention::cpu {

// Selects the keys of query row `row` of `problem` (REQUIRES problem.topk)
// into `selected` (cleared first): increasing positions, at most topk.
// `index_q` holds the float32 index queries [T, index_heads, index_dim],
// `weights` the float32 weights [T, index_heads]; index keys are read from
// problem.kv. `scores` is scratch. INVALID_ARGUMENT when an index score is
// not finite. With a `pool` the scoring is spread over its threads (the
// same scores: each depends on its key alone); nullptr scores here.
// REQUIRES: not called from one of `pool`'s tasks.
absl::Status SelectTopK(const AttentionProblem& problem, int64_t row,
                        absl::Span<const float> index_q,
                        absl::Span<const float> weights, ThreadPool* pool,
                        std::vector<std::pair<float, int64_t>>* scores,
                        std::vector<int64_t>* selected);

// The index score of one key: sum_j w[j] * f(dot(q[j], k)), as TopKSpec
// defines it.
float IndexScoreOf(const float* q, const float* w, int index_heads,
                   int index_dim, const float* key, IndexScore f);

// Runs the top-k problem `problem` on `pool`: selection in parallel over
// rows, then the rows' attention through `attend_dense` (the backend's
// dense Attend) in batches of bounded gathered size. Errors as
// AttentionBackend::Attend.
absl::Status AttendTopK(
    const AttentionProblem& problem, ThreadPool& pool,
    const std::function<absl::Status(absl::Span<const AttentionProblem>)>&
        attend_dense);

}  // namespace attention::cpu

#endif  // ATTENTION_CORE_CPU_TOPK_ATTENTION_H_
