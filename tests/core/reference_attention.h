// A plain double-precision attention reference for tests: the direct formula
// of the seeds' sdpa (scores materialised, softmax with an optional learned
// sink, additive bias, empty-row policy, window + sink-token mask, GQA by
// repetition). Deliberately shares no code with the backends.
#ifndef ATTENTION_TESTS_CORE_REFERENCE_ATTENTION_H_
#define ATTENTION_TESTS_CORE_REFERENCE_ATTENTION_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/attention_problem.h"

namespace attention::testing {

struct ReferenceInputs {
  int64_t num_queries = 0;  // T
  int num_heads = 0;        // H
  int num_kv_heads = 0;     // H_kv
  int head_dim = 0;
  int value_dim = 0;
  int64_t num_keys = 0;  // T_k
  // The values exactly as the backend sees them (already rounded to their
  // storage dtype).
  std::vector<float> q;  // [T, H, head_dim]
  std::vector<float> k;  // [T_k, H_kv, head_dim]
  std::vector<float> v;  // [T_k, H_kv, value_dim]
  MaskSpec mask;
  std::vector<float> sink_logits;  // empty or H values
  double scale = 1.0;
  // Additive bias [T, T_k] (bias_rank 2) or [H, T, T_k] (bias_rank 3);
  // bias_rank 0 = none.
  int bias_rank = 0;
  std::vector<float> bias;
  EmptyRowPolicy empty_row_policy = EmptyRowPolicy::kError;
  // Negative control: map query head h to KV head h % H_kv (numpy's tile)
  // instead of h / (H / H_kv) (repeat). Never correct.
  bool tile_kv_heads = false;
};

struct ReferenceOutputs {
  std::vector<double> output;   // [T, H, value_dim]
  std::vector<double> lse;      // [T, H]; -inf for an empty row
  std::vector<double> weights;  // [H, T, T_k]
};

// The mask rule of attention_problem.h, written out independently.
bool ReferenceKeyVisible(const MaskSpec& mask, int64_t position, int64_t key);

// INVALID_ARGUMENT when a visible logit (or logit + finite bias) exceeds the
// float32 range, or when a row sees no key, has no sink and the policy is
// kError.
absl::StatusOr<ReferenceOutputs> ReferenceAttention(
    const ReferenceInputs& inputs);

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_CORE_REFERENCE_ATTENTION_H_
