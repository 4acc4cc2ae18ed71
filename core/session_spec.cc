#include "core/session_spec.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace attention {
namespace {

absl::Status SpecError(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("invalid SessionSpec: ", field, " ", problem));
}

absl::Status CheckRange(absl::string_view field, int64_t value, int64_t lo,
                        int64_t hi, absl::string_view hint = "") {
  if (value < lo || value > hi) {
    return SpecError(field, absl::StrCat("must be in [", lo, ", ", hi,
                                         "], got ", value, hint));
  }
  return absl::OkStatus();
}

absl::Status ValidateLayer(const LayerSpec& layer, absl::string_view name,
                           int32_t num_q_heads, int64_t max_tokens_limit) {
  if (layer.window < 0) {
    return SpecError(
        absl::StrCat(name, ".window"),
        absl::StrCat("must be >= 0 (0 = full causal), got ", layer.window));
  }
  if (layer.num_sink_tokens < 0) {
    return SpecError(absl::StrCat(name, ".num_sink_tokens"),
                     absl::StrCat("must be >= 0, got ", layer.num_sink_tokens));
  }
  if (layer.num_sink_tokens > 0 && layer.window == 0) {
    return SpecError(
        absl::StrCat(name, ".num_sink_tokens"),
        absl::StrCat("= ", layer.num_sink_tokens,
                     " needs a sliding window (window > 0); a full causal "
                     "layer already sees every token"));
  }
  if (!layer.sink_logits.empty() &&
      layer.sink_logits.size() != static_cast<size_t>(num_q_heads)) {
    return SpecError(
        absl::StrCat(name, ".sink_logits"),
        absl::StrCat("must be empty or have exactly num_q_heads = ",
                     num_q_heads, " values, got ", layer.sink_logits.size()));
  }
  if (layer.topk < 0) {
    return SpecError(absl::StrCat(name, ".topk"),
                     absl::StrCat("must be >= 0 (0 = dense), got ", layer.topk));
  }
  // No session here holds more tokens: a larger topk selects nothing more,
  // but would size every return_topk_indices reply by it.
  if (layer.topk > max_tokens_limit) {
    return SpecError(
        absl::StrCat(name, ".topk"),
        absl::StrCat("must be at most the server's largest max_tokens = ",
                     max_tokens_limit, ", got ", layer.topk));
  }
  if (layer.index_score != IndexScore::kIdentity &&
      layer.index_score != IndexScore::kRelu) {
    return SpecError(absl::StrCat(name, ".index_score"),
                     absl::StrCat("is not a known index score (",
                                  static_cast<int>(layer.index_score), ")"));
  }
  for (size_t h = 0; h < layer.sink_logits.size(); ++h) {
    if (!std::isfinite(layer.sink_logits[h])) {
      return SpecError(
          absl::StrCat(name, ".sink_logits[", h, "]"),
          absl::StrCat("must be finite, got ", layer.sink_logits[h]));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckLayerEntries(int64_t entries, int64_t num_layers,
                               int64_t max_layers) {
  ATTN_RETURN_IF_ERROR(CheckRange("num_layers", num_layers, 1, max_layers));
  if (entries <= 1 || entries == num_layers) return absl::OkStatus();
  return SpecError(
      "layers",
      absl::StrCat("must have 0 entries (all full causal), 1 entry (applies "
                   "to every layer) or num_layers = ",
                   num_layers, " entries, got ", entries));
}

float DefaultScale(int64_t head_dim) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

absl::StatusOr<SessionSpec> ResolveSessionSpec(const SessionSpec& spec,
                                               const SpecLimits& limits) {
  // Before the spec (and its layer entries) is copied.
  ATTN_RETURN_IF_ERROR(
      CheckLayerEntries(static_cast<int64_t>(spec.layers.size()),
                        spec.num_layers, limits.max_layers));
  SessionSpec out = spec;
  if (auto s = CheckRange("num_q_heads", spec.num_q_heads, 1, limits.max_heads);
      !s.ok()) {
    return s;
  }
  if (auto s = CheckRange("num_kv_heads", spec.num_kv_heads, 1,
                          spec.num_q_heads, " (at most num_q_heads)");
      !s.ok()) {
    return s;
  }
  if (spec.num_q_heads % spec.num_kv_heads != 0) {
    return SpecError(
        "num_q_heads",
        absl::StrCat("= ", spec.num_q_heads,
                     " must be a multiple of num_kv_heads = ",
                     spec.num_kv_heads, " (grouped-query attention)"));
  }
  if (auto s = CheckRange("head_dim", spec.head_dim, 1, limits.max_head_dim);
      !s.ok()) {
    return s;
  }
  if (auto s = CheckRange("value_dim", spec.value_dim, 0, limits.max_head_dim,
                          " (0 = head_dim)");
      !s.ok()) {
    return s;
  }
  if (out.value_dim == 0) out.value_dim = spec.head_dim;
  switch (spec.kv_layout) {
    case KvLayout::kSeparate:
      break;
    case KvLayout::kSharedLatent:
      if (spec.num_kv_heads != 1) {
        return SpecError(
            "num_kv_heads",
            absl::StrCat("must be 1 with kv_layout shared latent (one latent "
                         "vector per token serves every query head), got ",
                         spec.num_kv_heads));
      }
      if (spec.value_dim == 0) {
        // head_dim would make the RoPE part of the keys values too, which
        // MLA never does (the seeds' output is p @ C over the latent).
        return SpecError(
            "value_dim",
            absl::StrCat("must be set with kv_layout shared latent: the "
                         "latent width, the values' leading entries of each "
                         "key (e.g. 512 of head_dim 576); head_dim = ",
                         spec.head_dim));
      }
      if (out.value_dim > spec.head_dim) {
        return SpecError(
            "value_dim",
            absl::StrCat("= ", out.value_dim,
                         " must be at most head_dim = ", spec.head_dim,
                         " with kv_layout shared latent: the values are the "
                         "first value_dim entries of each stored key"));
      }
      if (spec.scale == 0.0f) {
        // 1/sqrt(head_dim) would use the absorbed width; MLA scales by the
        // per-head query-key width before absorption, which only the
        // caller knows.
        return SpecError(
            "scale",
            absl::StrCat("must be set with kv_layout shared latent: 1/sqrt of "
                         "the per-head query-key width before absorption "
                         "(DeepSeek-V3: 1/sqrt(128 + 64)), not of head_dim = ",
                         spec.head_dim));
      }
      break;
    default:
      return SpecError("kv_layout",
                       absl::StrCat("is not a known layout (",
                                    static_cast<int>(spec.kv_layout), ")"));
  }
  switch (spec.kv_dtype) {
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kBFloat16:
      break;
    default:
      return SpecError("kv_dtype",
                       absl::StrCat("is not a known dtype (",
                                    static_cast<int>(spec.kv_dtype),
                                    "); use float32, float16 or bfloat16"));
  }
  if (!std::isfinite(spec.scale) || spec.scale < 0.0f) {
    return SpecError("scale", absl::StrCat("must be finite and >= 0 (0 = "
                                           "1/sqrt(head_dim)), got ",
                                           spec.scale));
  }
  if (spec.scale == 0.0f) out.scale = DefaultScale(spec.head_dim);

  const size_t num_layers = static_cast<size_t>(spec.num_layers);
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    if (auto s = ValidateLayer(spec.layers[i], absl::StrCat("layers[", i, "]"),
                               spec.num_q_heads, limits.max_tokens_limit);
        !s.ok()) {
      return s;
    }
  }
  if (spec.layers.empty()) {
    out.layers.assign(num_layers, LayerSpec{});
  } else if (spec.layers.size() == 1) {
    out.layers.assign(num_layers, spec.layers[0]);
  }

  bool sparse = false;
  for (const LayerSpec& layer : out.layers) sparse |= layer.topk > 0;
  if (sparse) {
    if (auto s = CheckRange("index_dim", spec.index_dim, 1,
                            limits.max_head_dim, " (a layer has topk > 0)");
        !s.ok()) {
      return s;
    }
    if (auto s = CheckRange("index_heads", spec.index_heads, 1,
                            limits.max_heads, " (a layer has topk > 0)");
        !s.ok()) {
      return s;
    }
  } else if (spec.index_dim != 0 || spec.index_heads != 0) {
    return SpecError("index_dim",
                     absl::StrCat("and index_heads must be 0 without a top-k "
                                  "layer (topk > 0), got ",
                                  spec.index_dim, " and ", spec.index_heads));
  }

  if (spec.max_tokens < 0) {
    return SpecError(
        "max_tokens",
        absl::StrCat("must be >= 0 (0 = server default ",
                     limits.default_max_tokens, "), got ", spec.max_tokens));
  }
  if (spec.max_tokens > limits.max_tokens_limit) {
    return SpecError(
        "max_tokens",
        absl::StrCat("= ", spec.max_tokens, " exceeds this server's limit of ",
                     limits.max_tokens_limit, " tokens"));
  }
  if (spec.max_tokens == 0) out.max_tokens = limits.default_max_tokens;
  if (spec.model.size() > static_cast<size_t>(limits.max_model_bytes)) {
    return SpecError("model", absl::StrCat("is a label of at most ",
                                           limits.max_model_bytes,
                                           " bytes, got ", spec.model.size()));
  }
  return out;
}

}  // namespace attention
