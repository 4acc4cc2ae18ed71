// attn-soak: fills the server's KV block pool once and empties it again.
//
// The CPU backend commits the pool's pages when a block is first written, so
// a fresh server's RSS grows by up to --kv_cache_bytes as the load reaches
// new blocks. Filling the pool before the load makes the pool resident from
// the start, so that RSS growth after the warm-up means leaked memory.
#ifndef ATTENTION_BENCH_SOAK_POOL_FILLER_H_
#define ATTENTION_BENCH_SOAK_POOL_FILLER_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "client/attention_client.h"

namespace attention::soak {

// Prefills sessions until the pool answers RESOURCE_EXHAUSTED, then deletes
// them. Returns the most KV bytes in use it saw.
absl::StatusOr<int64_t> FillKvPoolOnce(client::AttentionClient& client);

}  // namespace attention::soak

#endif  // ATTENTION_BENCH_SOAK_POOL_FILLER_H_
