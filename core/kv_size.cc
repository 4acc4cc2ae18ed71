#include "core/kv_size.h"

#include <algorithm>

namespace attention {

KvSizePlan PlanKvSize(const SessionSpec& spec, int64_t context) {
  KvSizePlan plan;
  const int64_t value_dim = spec.value_dim > 0 ? spec.value_dim : spec.head_dim;
  plan.bytes_per_token_per_layer = int64_t{spec.num_kv_heads} *
                                   (spec.head_dim + value_dim) *
                                   DTypeSize(spec.kv_dtype);
  plan.bytes_per_token_all_full =
      plan.bytes_per_token_per_layer * spec.num_layers;
  plan.context_bytes_all_full = plan.bytes_per_token_all_full * context;

  // Tolerate an unresolved layer list too: 0 entries = all full, 1 = every
  // layer.
  for (int32_t i = 0; i < spec.num_layers; ++i) {
    const LayerSpec* layer = nullptr;
    if (spec.layers.size() == 1) {
      layer = &spec.layers[0];
    } else if (static_cast<size_t>(i) < spec.layers.size()) {
      layer = &spec.layers[i];
    }
    int64_t tokens = context;
    if (layer != nullptr && layer->window > 0) {
      // A window layer keeps only what a future query can still see.
      tokens = std::min<int64_t>(
          context, int64_t{layer->window} + layer->num_sink_tokens);
      ++plan.window_layers;
    } else {
      ++plan.full_layers;
    }
    plan.context_bytes += tokens * plan.bytes_per_token_per_layer;
  }
  return plan;
}

}  // namespace attention
