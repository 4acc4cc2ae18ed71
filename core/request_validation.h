// Validation of attention inputs shared by the engine's session and
// stateless paths. Every failure is INVALID_ARGUMENT with a message naming
// the tensor, the expected and the actual shape.
#ifndef ATTENTION_CORE_REQUEST_VALIDATION_H_
#define ATTENTION_CORE_REQUEST_VALIDATION_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/tensor.h"

namespace attention {

// The geometry q/k/v must have: q [T, H, head_dim], k [T_k, H_kv, head_dim],
// v [T_k, H_kv, value_dim].
struct QkvShape {
  int64_t num_queries = 0;
  int64_t num_keys = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t value_dim = 0;
};

// Checks ranks, byte sizes, head grouping and finiteness, and derives the
// geometry. When `expected` is given (a session), every dimension except
// the token counts must match it.
absl::StatusOr<QkvShape> ValidateQkv(const TensorView& q, const TensorView& k,
                                     const TensorView& v,
                                     const std::optional<QkvShape>& expected);

// Checks an additive bias: [T_q, T_k] or [H, T_q, T_k], finite or -inf.
absl::Status ValidateBias(const TensorView& bias, const QkvShape& shape);

// Checks the index inputs of `tokens` queries of a top-k layer: index_k
// [T, index_dim], index_q [T, index_heads, index_dim] and index_weights
// [T, index_heads], all finite.
absl::Status ValidateIndexInputs(const TensorView& index_k,
                                 const TensorView& index_q,
                                 const TensorView& index_weights,
                                 int64_t tokens, int32_t index_heads,
                                 int32_t index_dim);

// Checks learned sink logits: empty or exactly num_q_heads finite values.
absl::Status ValidateSinkLogits(absl::Span<const float> sink_logits,
                                int32_t num_q_heads);

}  // namespace attention

#endif  // ATTENTION_CORE_REQUEST_VALIDATION_H_
