// Top-k sparse attention on the CPU (attention_problem.h's TopKSpec): per
// query row, index scores over the visible keys, the k best kept (ties:
// lower position), then dense attention of the row over exactly those keys,
// in increasing position, run through the ordinary dense kernels over a
// view that addresses each selected token in place (one-token blocks, no
// copy). So a row's output is bitwise the dense non-causal attention over
// its selected keys, whatever the batch.
#ifndef ATTENTION_CORE_CPU_TOPK_ATTENTION_H_
#define ATTENTION_CORE_CPU_TOPK_ATTENTION_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/attention_problem.h"
#include "core/cpu/index_kernels.h"
#include "core/thread_pool.h"

namespace attention::cpu {

// Selects the keys of query row `row` of `problem` (REQUIRES problem.topk)
// into `selected` (cleared first): increasing positions, at most topk.
// `query` is the row's index query (index_kernels.h), scored against the
// index keys of problem.kv by `score_keys`. `scores` is scratch.
// INVALID_ARGUMENT when an index score is not finite. With a `pool` the
// scoring is spread over its threads (the same scores: each depends on its
// key alone); nullptr scores here.
// REQUIRES: not called from one of `pool`'s tasks.
absl::Status SelectTopK(const AttentionProblem& problem, int64_t row,
                        const IndexQuery& query, IndexScoresFn score_keys,
                        ThreadPool* pool,
                        std::vector<std::pair<float, int64_t>>* scores,
                        std::vector<int64_t>* selected);

// Runs the top-k problem `problem` on `pool`, in groups of rows whose
// selections hold at most 2^20 keys together (so memory stays bounded
// whatever topk and the row count are): the group's selection in parallel
// over rows with the index kernel `score_keys` (the backend's ISA), then
// its rows' attention through `attend_dense` (the backend's dense Attend)
// in batches of bounded gathered size. Errors as AttentionBackend::Attend;
// the first in row order (a group's selection before its attention), naming
// `problem` as problem `index` of its batch (-1: no problem, the batch held
// it alone), and its rows' and keys' positions.
absl::Status AttendTopK(
    const AttentionProblem& problem, int64_t index, ThreadPool& pool,
    IndexScoresFn score_keys,
    const std::function<absl::Status(absl::Span<const AttentionProblem>)>&
        attend_dense);

}  // namespace attention::cpu

#endif  // ATTENTION_CORE_CPU_TOPK_ATTENTION_H_
