// KV-cache size calculator: the payload bytes a spec needs per token and
// per context, reproducing the seeds' frozen reference numbers (e.g. the
// gpt-oss hybrid stack: 4 836 556 800 bytes at 131 072 tokens; MLA in
// DeepSeek-V3: (512 + 64) * 61 * 2 = 70 272 bytes per token).
#ifndef ATTENTION_CORE_KV_SIZE_H_
#define ATTENTION_CORE_KV_SIZE_H_

#include <cstdint>

#include "core/session_spec.h"

namespace attention {

struct KvSizePlan {
  // K+V bytes one token adds to one layer (one latent vector for a shared
  // latent layout), index keys excluded.
  int64_t bytes_per_token_per_layer = 0;
  // Index-key bytes one token adds to one top-k layer (index_dim elements).
  int64_t index_bytes_per_token_per_layer = 0;
  // Bytes one token adds across all layers, index keys included, if every
  // layer kept its full history (the calculator's "per token" figure).
  int64_t bytes_per_token_all_full = 0;
  // Payload bytes at `context` tokens, window layers capped at what they can
  // still see (window + sink tokens).
  int64_t context_bytes = 0;
  // The same with every layer full.
  int64_t context_bytes_all_full = 0;
  int64_t full_layers = 0;
  int64_t window_layers = 0;
  // Layers with topk > 0 (counted among full or window layers too).
  int64_t sparse_layers = 0;
};

// K+V bytes per token of the multi-head equivalent of a shared-latent
// (MLA) spec, as in the seeds: 2 * num_layers * num_q_heads * head_dim *
// dtype size, where `mha_head_dim` is the per-head dimension before
// absorption (128 for DeepSeek-V3).
int64_t MhaEquivalentBytesPerToken(const SessionSpec& spec,
                                   int64_t mha_head_dim);

// REQUIRES: `spec` resolved (ResolveSessionSpec) and context >= 0.
KvSizePlan PlanKvSize(const SessionSpec& spec, int64_t context);

}  // namespace attention

#endif  // ATTENTION_CORE_KV_SIZE_H_
