#include "core/request_validation.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/status_macros.h"

namespace attention {
namespace {

absl::Status Mismatch(absl::string_view what, absl::string_view layout,
                      const Shape& expected, const Shape& actual) {
  return absl::InvalidArgumentError(
      absl::StrCat(what, " must have shape ", layout, " = ",
                   ShapeString(expected), ", got ", ShapeString(actual)));
}

}  // namespace

absl::StatusOr<QkvShape> ValidateQkv(const TensorView& q, const TensorView& k,
                                     const TensorView& v,
                                     const std::optional<QkvShape>& expected) {
  ATTN_RETURN_IF_ERROR(q.Validate("q", 3));
  ATTN_RETURN_IF_ERROR(k.Validate("k", 3));
  ATTN_RETURN_IF_ERROR(v.Validate("v", 3));
  QkvShape shape;
  shape.num_queries = q.dim(0);
  shape.num_keys = k.dim(0);
  shape.num_q_heads = static_cast<int32_t>(q.dim(1));
  shape.head_dim = static_cast<int32_t>(q.dim(2));
  shape.num_kv_heads = static_cast<int32_t>(k.dim(1));
  shape.value_dim = static_cast<int32_t>(v.dim(2));
  if (expected.has_value()) {
    const QkvShape& e = *expected;
    if (q.dim(1) != e.num_q_heads || q.dim(2) != e.head_dim) {
      return Mismatch("q", "[T, num_q_heads, head_dim]",
                      {q.dim(0), e.num_q_heads, e.head_dim}, q.shape);
    }
    shape.num_kv_heads = e.num_kv_heads;
    shape.value_dim = e.value_dim;
  }
  const Shape want_k = {shape.num_keys, shape.num_kv_heads, shape.head_dim};
  if (k.shape != want_k) {
    return Mismatch("k", "[T_k, num_kv_heads, head_dim]", want_k, k.shape);
  }
  const Shape want_v = {shape.num_keys, shape.num_kv_heads, shape.value_dim};
  if (v.shape != want_v) {
    return Mismatch("v", "[T_k, num_kv_heads, value_dim]", want_v, v.shape);
  }
  if (shape.num_q_heads % shape.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the number of query heads (", shape.num_q_heads,
                     ") must be a multiple of the number of KV heads (",
                     shape.num_kv_heads, ")"));
  }
  ATTN_RETURN_IF_ERROR(CheckFinite(q.dtype, q.data, q.num_elements(), "q"));
  ATTN_RETURN_IF_ERROR(CheckFinite(k.dtype, k.data, k.num_elements(), "k"));
  ATTN_RETURN_IF_ERROR(CheckFinite(v.dtype, v.data, v.num_elements(), "v"));
  return shape;
}

absl::Status ValidateIndexInputs(const TensorView& index_k,
                                 const TensorView& index_q,
                                 const TensorView& index_weights,
                                 int64_t tokens, int32_t index_heads,
                                 int32_t index_dim) {
  ATTN_RETURN_IF_ERROR(index_k.Validate("index_k", 2));
  ATTN_RETURN_IF_ERROR(index_q.Validate("index_q", 3));
  ATTN_RETURN_IF_ERROR(index_weights.Validate("index_weights", 2));
  const Shape want_k = {tokens, index_dim};
  if (index_k.shape != want_k) {
    return Mismatch("index_k", "[T, index_dim]", want_k, index_k.shape);
  }
  const Shape want_q = {tokens, index_heads, index_dim};
  if (index_q.shape != want_q) {
    return Mismatch("index_q", "[T, index_heads, index_dim]", want_q,
                    index_q.shape);
  }
  const Shape want_w = {tokens, index_heads};
  if (index_weights.shape != want_w) {
    return Mismatch("index_weights", "[T, index_heads]", want_w,
                    index_weights.shape);
  }
  ATTN_RETURN_IF_ERROR(CheckFinite(index_k.dtype, index_k.data,
                                   index_k.num_elements(), "index_k"));
  ATTN_RETURN_IF_ERROR(CheckFinite(index_q.dtype, index_q.data,
                                   index_q.num_elements(), "index_q"));
  return CheckFinite(index_weights.dtype, index_weights.data,
                     index_weights.num_elements(), "index_weights");
}

absl::Status ValidateBias(const TensorView& bias, const QkvShape& shape) {
  const Shape per_row = {shape.num_queries, shape.num_keys};
  const Shape per_head = {shape.num_q_heads, shape.num_queries, shape.num_keys};
  if (bias.shape != per_row && bias.shape != per_head) {
    return absl::InvalidArgumentError(
        absl::StrCat("bias must have shape [T_q, T_k] = ", ShapeString(per_row),
                     " or [H, T_q, T_k] = ", ShapeString(per_head), ", got ",
                     ShapeString(bias.shape)));
  }
  ATTN_RETURN_IF_ERROR(bias.Validate("bias", bias.rank()));
  // -inf forbids a key; NaN and +inf have no meaning as a bias.
  std::vector<float> row(std::min<int64_t>(bias.num_elements(), 4096));
  const int64_t element_bytes = DTypeSize(bias.dtype);
  for (int64_t start = 0; start < bias.num_elements();
       start += static_cast<int64_t>(row.size())) {
    const int64_t count = std::min<int64_t>(static_cast<int64_t>(row.size()),
                                            bias.num_elements() - start);
    ConvertToFloat(bias.dtype, bias.data + start * element_bytes, count,
                   row.data());
    for (int64_t i = 0; i < count; ++i) {
      if (std::isnan(row[i]) || row[i] == INFINITY) {
        return absl::InvalidArgumentError(absl::StrCat(
            "bias element ", start + i,
            " is NaN or +inf; a bias may hold finite values and -inf only"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateSinkLogits(absl::Span<const float> sink_logits,
                                int32_t num_q_heads) {
  if (sink_logits.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(sink_logits.size()) != num_q_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sink_logits must be empty or hold one value per query head (",
        num_q_heads, "), got ", sink_logits.size()));
  }
  for (size_t h = 0; h < sink_logits.size(); ++h) {
    if (!std::isfinite(sink_logits[h])) {
      return absl::InvalidArgumentError(
          absl::StrCat("sink_logits[", h, "] must be finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace attention
