#include "core/kv_size.h"

#include <algorithm>

namespace attention {

KvSizePlan PlanKvSize(const SessionSpec& spec, int64_t context) {
  KvSizePlan plan;
  const int64_t element = DTypeSize(spec.kv_dtype);
  const int64_t value_dim = spec.value_dim > 0 ? spec.value_dim : spec.head_dim;
  // A shared latent stores one vector; its values are its leading entries.
  const int64_t stored_dims = spec.kv_layout == KvLayout::kSharedLatent
                                  ? spec.head_dim
                                  : spec.head_dim + value_dim;
  plan.bytes_per_token_per_layer =
      int64_t{spec.num_kv_heads} * stored_dims * element;
  plan.index_bytes_per_token_per_layer = int64_t{spec.index_dim} * element;

  // Tolerate an unresolved layer list too: 0 entries = all full, 1 = every
  // layer.
  for (int32_t i = 0; i < spec.num_layers; ++i) {
    const LayerSpec* layer = nullptr;
    if (spec.layers.size() == 1) {
      layer = &spec.layers[0];
    } else if (static_cast<size_t>(i) < spec.layers.size()) {
      layer = &spec.layers[i];
    }
    int64_t layer_bytes = plan.bytes_per_token_per_layer;
    if (layer != nullptr && layer->topk > 0) {
      layer_bytes += plan.index_bytes_per_token_per_layer;
      ++plan.sparse_layers;
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
    plan.bytes_per_token_all_full += layer_bytes;
    plan.context_bytes += tokens * layer_bytes;
  }
  plan.context_bytes_all_full = plan.bytes_per_token_all_full * context;
  return plan;
}

int64_t MhaEquivalentBytesPerToken(const SessionSpec& spec,
                                   int64_t mha_head_dim) {
  return 2 * int64_t{spec.num_layers} * spec.num_q_heads * mha_head_dim *
         DTypeSize(spec.kv_dtype);
}

}  // namespace attention
