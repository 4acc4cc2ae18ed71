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

// How a session stores each token's keys and values.
enum class KvLayout {
  // Keys [num_kv_heads, head_dim] and values [num_kv_heads, value_dim].
  kSeparate,
  // Multi-head latent attention (MLA, absorbed form): one vector
  // [head_dim] per token (latent || rotated RoPE key) shared by every query
  // head (num_kv_heads == 1); the values are its first value_dim entries.
  // Requests carry no v.
  kSharedLatent,
};

// The function f of a top-k layer's index score sum_j w_j * f(q_j . k_s).
enum class IndexScore {
  kIdentity,  // the seeds' shortlist
  kRelu,      // DeepSeek-V3.2's lightning indexer
};

struct LayerSpec {
  int32_t window = 0;           // 0 = full causal
  int32_t num_sink_tokens = 0;  // StreamingLLM anchors; needs window > 0
  std::vector<float> sink_logits;  // empty or num_q_heads values
  // Top-k sparse attention: each query attends only to the `topk` visible
  // keys of highest index score (ties: lower position first). 0 = dense.
  // Needs the session's index_dim and index_heads.
  int32_t topk = 0;
  IndexScore index_score = IndexScore::kIdentity;

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
  KvLayout kv_layout = KvLayout::kSeparate;
  // The index of top-k layers: every token of such a layer stores an index
  // key [index_dim] (in kv_dtype) and every query brings index queries
  // [index_heads, index_dim] with weights [index_heads]. Both 0 unless some
  // layer has topk > 0, then both > 0.
  int32_t index_dim = 0;
  int32_t index_heads = 0;

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

// OK when num_layers is in [1, max_layers] and a spec of `num_layers`
// layers may have `entries` layer entries: none (every layer full causal),
// one (applies to every layer) or exactly num_layers; INVALID_ARGUMENT
// otherwise. ResolveSessionSpec checks it; a translation from the wire
// checks it before converting the entries (so that no more than
// max_layers are converted).
absl::Status CheckLayerEntries(int64_t entries, int64_t num_layers,
                               int64_t max_layers = SpecLimits{}.max_layers);

// The logit scale a spec or stateless call of scale 0 gets: the seeds'
// 1/sqrt(head_dim), computed in double and rounded once to float32 (a
// float32 square root and division can differ by an ulp). REQUIRES:
// head_dim > 0.
float DefaultScale(int64_t head_dim);

// Validates `spec` and fills its defaults: value_dim, scale, max_tokens, and
// `layers` expanded to exactly num_layers entries. INVALID_ARGUMENT with a
// message naming the offending field for any violation.
absl::StatusOr<SessionSpec> ResolveSessionSpec(const SessionSpec& spec,
                                               const SpecLimits& limits);

}  // namespace attention

#endif  // ATTENTION_CORE_SESSION_SPEC_H_
