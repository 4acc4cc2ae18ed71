// KV-cache size calculator: the payload bytes a spec needs per token and
// per context, reproducing the seeds' frozen reference numbers (e.g. the
// gpt-oss hybrid stack: 4 836 556 800 bytes at 131 072 tokens).
#ifndef ATTENTION_CORE_KV_SIZE_H_
#define ATTENTION_CORE_KV_SIZE_H_

#include <cstdint>

#include "core/session_spec.h"

namespace attention {

struct KvSizePlan {
  // K+V bytes one token adds to one layer.
  int64_t bytes_per_token_per_layer = 0;
  // K+V bytes one token adds across all layers if every layer kept its full
  // history (the calculator's "per token" figure).
  int64_t bytes_per_token_all_full = 0;
  // Payload bytes at `context` tokens, window layers capped at what they can
  // still see (window + sink tokens).
  int64_t context_bytes = 0;
  // The same with every layer full.
  int64_t context_bytes_all_full = 0;
  int64_t full_layers = 0;
  int64_t window_layers = 0;
};

// REQUIRES: `spec` resolved (ResolveSessionSpec) and context >= 0.
KvSizePlan PlanKvSize(const SessionSpec& spec, int64_t context);

}  // namespace attention

#endif  // ATTENTION_CORE_KV_SIZE_H_
