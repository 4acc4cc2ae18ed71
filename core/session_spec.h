// SessionSpec: the shape of a session's KV cache and attention, mirroring
// attention.v1.SessionSpec, and its validation.
#ifndef ATTENTION_CORE_SESSION_SPEC_H_
#define ATTENTION_CORE_SESSION_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace attention {

struct LayerSpec {
  int32_t window = 0;           // 0 = full causal
  int32_t num_sink_tokens = 0;  // StreamingLLM anchors; needs window > 0
  std::vector<float> sink_logits;  // empty or num_q_heads values

  bool operator==(const LayerSpec&) const = default;
};

struct SessionSpec {
  int32_t num_layers = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t value_dim = 0;  // 0 = head_dim
  DType kv_dtype = DType::kFloat32;
  float scale = 0.0f;  // 0 = 1/sqrt(head_dim)
  // 0 entries = all full causal, 1 = every layer, else num_layers entries.
  std::vector<LayerSpec> layers;
  int64_t max_tokens = 0;  // 0 = server default
  std::string model;

  bool operator==(const SessionSpec&) const = default;
};

// Limits a server applies to every spec.
struct SpecLimits {
  int64_t default_max_tokens = 131072;
  int64_t max_tokens_limit = 1 << 20;
  int32_t max_layers = 1024;
  int32_t max_heads = 1024;
  int32_t max_head_dim = 1024;
  // SessionSpec.model is a label: at most this many bytes.
  int32_t max_model_bytes = 256;
};

// Validates `spec` and fills its defaults: value_dim, scale, max_tokens, and
// `layers` expanded to exactly num_layers entries. INVALID_ARGUMENT with a
// message naming the offending field for any violation.
absl::StatusOr<SessionSpec> ResolveSessionSpec(const SessionSpec& spec,
                                               const SpecLimits& limits);

}  // namespace attention

#endif  // ATTENTION_CORE_SESSION_SPEC_H_
