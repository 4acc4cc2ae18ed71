#include "core/cpu/topk_attention.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/call_control.h"
#include "core/cpu/attention_unit.h"
#include "core/dtype.h"
#include "core/kv_view.h"
#include "core/status_macros.h"
#include "core/work_plan.h"

namespace attention::cpu {
namespace {

// Keys the index kernel scores per call (a stack buffer of scores).
constexpr int64_t kScoresPerRun = 256;

// Keys one task scores when a lone row's scoring is spread over threads.
constexpr int64_t kKeysPerPiece = 2048;

// Selected keys of one batch of rows handed to the dense kernels (their
// block tables take 16 bytes per key)...
constexpr int64_t kSelectedKeysPerBatch = int64_t{1} << 20;
// ...and rows times KV heads of one batch: the dense kernels plan a unit
// of work (about 100 bytes) for each, so many rows of a short selection
// would otherwise plan far more than a dense call of the same rows.
constexpr int64_t kSelectedRowHeadsPerBatch = int64_t{1} << 16;

// Index-query floats converted at a time: rows run in groups that hold at
// most this many (or one row), so that many rows of narrow index heads,
// each padded to whole lanes, cannot make a call allocate many times the
// size of its request.
constexpr int64_t kIndexQueryFloatsPerGroup = int64_t{1} << 18;

// Keys scored between two checks for cancellation and the deadline, as
// the dense kernels check once per chunk of keys.
constexpr int64_t kKeysPerCheck = kKeysPerSplit;

// A view of `positions` (increasing) of `kv` as keys [0, n): each selected
// token is a block of one token, addressed in place, so the dense kernels
// read exactly the keys and values a gathered copy would hold, in the same
// order. `k_table` and `v_table` hold the block pointers and must outlive
// the view.
KvView SelectedKvView(const KvView& kv, const std::vector<int64_t>& positions,
                      std::vector<const std::byte*>* k_table,
                      std::vector<const std::byte*>* v_table) {
  const int64_t element = DTypeSize(kv.dtype);
  k_table->resize(positions.size());
  v_table->resize(positions.size());
  for (size_t i = 0; i < positions.size(); ++i) {
    const int64_t block = positions[i] / kv.tokens_per_block;
    const int64_t row = positions[i] % kv.tokens_per_block;
    (*k_table)[i] = kv.k_block(block) + row * kv.k_token_stride * element;
    (*v_table)[i] = kv.v_block(block) + row * kv.v_token_stride * element;
  }
  KvView view = kv;
  view.length = static_cast<int64_t>(positions.size());
  view.tokens_per_block = 1;
  view.k_blocks = *k_table;
  view.v_blocks = *v_table;
  view.gap_begin = 0;
  view.gap_blocks = 0;
  view.index_dim = 0;
  view.index_offset_bytes = 0;
  return view;
}

// The row's higher-ranked entry first: higher score, then lower position.
bool Ranks(const std::pair<float, int64_t>& a,
           const std::pair<float, int64_t>& b) {
  if (a.first != b.first) return a.first > b.first;
  return a.second < b.second;
}

}  // namespace

absl::Status SelectTopK(const AttentionProblem& problem, int64_t row,
                        const IndexQuery& query, IndexScoresFn score_keys,
                        ThreadPool* pool,
                        std::vector<std::pair<float, int64_t>>* scores,
                        std::vector<int64_t>* selected) {
  const TopKSpec& spec = *problem.topk;
  const KvView& kv = problem.kv;
  const MaskSpec& mask = problem.mask;
  const int64_t position = mask.query_start + row;
  // The keys the row sees (core/work_plan.h), flattened: entry f is the
  // f-th visible position.
  const KeyRanges visible =
      RowBlockKeys(mask.causal, mask.window, mask.num_sink_tokens, kv.length,
                   position, position);
  const int64_t count = visible.size();
  scores->resize(static_cast<size_t>(count));
  // Scores entries [begin, end): index keys are contiguous within a block,
  // so the kernel scores one block's run of a range at a time.
  auto score_piece = [&](int64_t begin, int64_t end) -> absl::Status {
    float run_scores[kScoresPerRun];
    int64_t f = begin;
    int64_t next_check = begin;
    while (f < end) {
      if (f >= next_check) {
        ATTN_RETURN_IF_ERROR(CheckCall(problem.control));
        next_check = f + kKeysPerCheck;
      }
      const int64_t pos = visible.at(f);
      const int64_t block_end =
          (pos / kv.tokens_per_block + 1) * kv.tokens_per_block;
      // A run stays inside one block and one range.
      const int64_t first_range = visible.end[0] - visible.begin[0];
      const int64_t range_left = f < first_range ? first_range - f : count - f;
      const int64_t run = std::min(
          {end - f, block_end - pos, range_left, int64_t{kScoresPerRun}});
      score_keys(query, kv.dtype, kv.index_key(pos), run, run_scores);
      for (int64_t j = 0; j < run; ++j) {
        const float score = run_scores[j];
        if (!std::isfinite(score)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "the index score of key ", pos + j,
              " for the query at position ", position, " is not finite (",
              score, "); scale index_q or index_weights down"));
        }
        (*scores)[f + j] = {score, pos + j};
      }
      f += run;
    }
    return absl::OkStatus();
  };
  const int64_t pieces =
      pool == nullptr ? 1
                      : std::min<int64_t>(int64_t{4} * pool->num_threads(),
                                          (count + kKeysPerPiece - 1) /
                                              kKeysPerPiece);
  if (pieces <= 1) {
    ATTN_RETURN_IF_ERROR(score_piece(0, count));
  } else {
    // Each score depends on its key alone: pieces give the same scores.
    std::vector<absl::Status> statuses(static_cast<size_t>(pieces));
    const int64_t per_piece = (count + pieces - 1) / pieces;
    pool->ParallelFor(pieces, [&](int64_t piece) {
      statuses[piece] = score_piece(std::min(count, piece * per_piece),
                                    std::min(count, (piece + 1) * per_piece));
    });
    for (const absl::Status& status : statuses) ATTN_RETURN_IF_ERROR(status);
  }
  const size_t keep = std::min(scores->size(), static_cast<size_t>(spec.topk));
  if (keep < scores->size()) {
    std::nth_element(scores->begin(), scores->begin() + keep, scores->end(),
                     Ranks);
  }
  selected->clear();
  for (size_t i = 0; i < keep; ++i) selected->push_back((*scores)[i].second);
  std::sort(selected->begin(), selected->end());
  return absl::OkStatus();
}

namespace {

// The selections of rows [first, first + selected->size()) of `problem`
// into *selected, in parallel over rows (or, for fewer rows than threads,
// each row's scoring spread over the threads).
absl::Status SelectRows(const AttentionProblem& problem, ThreadPool& pool,
                        IndexScoresFn score_keys,
                        const std::function<IndexQuery(int64_t)>& query_of,
                        int64_t first,
                        std::vector<std::vector<int64_t>>* selected) {
  const int64_t count = static_cast<int64_t>(selected->size());
  std::vector<absl::Status> statuses(static_cast<size_t>(count));
  if (count < pool.num_threads()) {
    std::vector<std::pair<float, int64_t>> scores;
    for (int64_t i = 0; i < count; ++i) {
      statuses[i] = SelectTopK(problem, first + i, query_of(first + i),
                               score_keys, &pool, &scores, &(*selected)[i]);
    }
  } else {
    pool.ParallelFor(count, [&](int64_t i) {
      if (!CheckCall(problem.control).ok()) return;  // reported below
      std::vector<std::pair<float, int64_t>> scores;
      statuses[i] = SelectTopK(problem, first + i, query_of(first + i),
                               score_keys, nullptr, &scores, &(*selected)[i]);
    });
  }
  ATTN_RETURN_IF_ERROR(CheckCall(problem.control));
  for (const absl::Status& status : statuses) ATTN_RETURN_IF_ERROR(status);
  return absl::OkStatus();
}

// Rows [first, first + selected.size()) of `problem` attend over their
// selected keys: one dense non-causal problem per row over a view whose
// "blocks" are the selected tokens in place (nothing is copied), run in
// batches of bounded table and plan size.
absl::Status AttendSelected(
    const AttentionProblem& problem, int64_t index, int64_t first,
    const std::vector<std::vector<int64_t>>& selected,
    const std::function<absl::Status(absl::Span<const AttentionProblem>)>&
        attend_dense) {
  const KvView& kv = problem.kv;
  const int heads = static_cast<int>(problem.q.dim(1));
  const int head_dim = static_cast<int>(problem.q.dim(2));
  const int value_dim = kv.value_dim;
  const int64_t q_row_bytes =
      int64_t{heads} * head_dim * DTypeSize(problem.q.dtype);
  const int64_t count = static_cast<int64_t>(selected.size());
  const int64_t most_rows =
      std::max<int64_t>(1, kSelectedRowHeadsPerBatch / kv.num_kv_heads);
  int64_t i = 0;
  while (i < count) {
    int64_t end = i;
    int64_t batch_keys = 0;
    while (end < count && (end == i || (batch_keys < kSelectedKeysPerBatch &&
                                        end - i < most_rows))) {
      batch_keys += static_cast<int64_t>(selected[end].size());
      ++end;
    }
    std::vector<std::vector<const std::byte*>> tables(2 * (end - i));
    std::vector<ProblemOrigin> origins(end - i);
    std::vector<AttentionProblem> batch;
    batch.reserve(end - i);
    for (int64_t j = i; j < end; ++j) {
      const int64_t r = first + j;
      origins[j - i] = ProblemOrigin{.problem = index,
                                     .row = r,
                                     .position = problem.mask.query_start + r,
                                     .keys = selected[j].data()};
      AttentionProblem one;
      one.q = TensorView{problem.q.dtype,
                         {1, heads, head_dim},
                         problem.q.data + r * q_row_bytes,
                         q_row_bytes};
      one.kv = SelectedKvView(kv, selected[j], &tables[2 * (j - i)],
                              &tables[2 * (j - i) + 1]);
      one.mask = MaskSpec{.causal = false};
      one.sink_logits = problem.sink_logits;
      one.scale = problem.scale;
      one.empty_row_policy = problem.empty_row_policy;
      one.control = problem.control;
      one.output = problem.output + r * heads * value_dim;
      one.lse = problem.lse == nullptr ? nullptr : problem.lse + r * heads;
      one.origin = &origins[j - i];
      batch.push_back(one);
    }
    ATTN_RETURN_IF_ERROR(attend_dense(batch));
    i = end;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AttendTopK(
    const AttentionProblem& problem, int64_t index, ThreadPool& pool,
    IndexScoresFn score_keys,
    const std::function<absl::Status(absl::Span<const AttentionProblem>)>&
        attend_dense) {
  const TopKSpec& spec = *problem.topk;
  const KvView& kv = problem.kv;
  const int64_t rows = problem.q.dim(0);

  // The index queries as the kernels take them: float32, each padded with
  // zeros to whole lanes; converted one group of rows at a time.
  const int index_heads = static_cast<int>(spec.index_q.dim(1));
  const int index_dim = static_cast<int>(spec.index_q.dim(2));
  const int index_stride = IndexDimPadded(index_dim);
  const int64_t row_query_floats = int64_t{index_heads} * index_stride;
  const int64_t index_q_bytes =
      int64_t{index_dim} * DTypeSize(spec.index_q.dtype);
  const int64_t weight_bytes = DTypeSize(spec.index_weights.dtype);
  std::vector<float> index_q;
  std::vector<float> weights;
  int64_t first = 0;
  auto query_of = [&](int64_t row) -> IndexQuery {
    return IndexQuery{.q = index_q.data() + (row - first) * row_query_floats,
                      .w = weights.data() + (row - first) * index_heads,
                      .heads = index_heads,
                      .dim = index_dim,
                      .f = spec.score};
  };
  // Rows run in groups whose selections together hold at most
  // kSelectedKeysPerBatch keys (a row selects at most min(topk, length))
  // and whose index queries at most kIndexQueryFloatsPerGroup floats, so
  // that a long prefill's memory stays bounded whatever topk and the index
  // shape are; each row's selection and output depend on that row alone.
  const int64_t most_per_row =
      std::max<int64_t>(1, std::min<int64_t>(spec.topk, kv.length));
  const int64_t group_rows = std::max<int64_t>(
      1, std::min(kSelectedKeysPerBatch / most_per_row,
                  kIndexQueryFloatsPerGroup / row_query_floats));
  std::vector<std::vector<int64_t>> selected;
  for (; first < rows; first += group_rows) {
    const int64_t end = std::min(rows, first + group_rows);
    ATTN_RETURN_IF_ERROR(CheckCall(problem.control));
    const int64_t group_heads = (end - first) * index_heads;
    index_q.assign(static_cast<size_t>(group_heads * index_stride), 0.0f);
    for (int64_t qh = 0; qh < group_heads; ++qh) {
      ConvertToFloat(
          spec.index_q.dtype,
          spec.index_q.data + (first * index_heads + qh) * index_q_bytes,
          index_dim, index_q.data() + qh * index_stride);
    }
    weights.resize(static_cast<size_t>(group_heads));
    ConvertToFloat(spec.index_weights.dtype,
                   spec.index_weights.data + first * index_heads * weight_bytes,
                   group_heads, weights.data());
    selected.assign(static_cast<size_t>(end - first), {});
    if (absl::Status status =
            SelectRows(problem, pool, score_keys, query_of, first, &selected);
        !status.ok()) {
      // Selection errors name their rows and keys by position; in a batch
      // they also name the problem, as the attention's errors do.
      return absl::IsInvalidArgument(status)
                 ? absl::InvalidArgumentError(absl::StrCat(
                       ProblemLabel(index, ": "), status.message()))
                 : status;
    }
    if (spec.selected != nullptr) {
      for (int64_t r = first; r < end; ++r) {
        int64_t* out = spec.selected + r * spec.topk;
        std::fill(out, out + spec.topk, -1);
        std::copy(selected[r - first].begin(), selected[r - first].end(), out);
      }
    }
    ATTN_RETURN_IF_ERROR(
        AttendSelected(problem, index, first, selected, attend_dense));
  }
  return absl::OkStatus();
}

}  // namespace attention::cpu
