#include "bench/soak/pool_filler.h"

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attention::soak {
namespace {

constexpr int kHeadDim = 64;
constexpr int kChunkTokens = 64;
// Bounds the loop whatever the pool size: 8192 calls of 64 tokens of
// 512 bytes fill 256 MiB.
constexpr int kMaxCalls = 8192;

}  // namespace

absl::StatusOr<int64_t> FillKvPoolOnce(client::AttentionClient& client) {
  v1::SessionSpec spec;
  spec.set_num_layers(1);
  spec.set_num_q_heads(1);
  spec.set_num_kv_heads(1);
  spec.set_head_dim(kHeadDim);
  spec.set_model("attn-soak pool filler");
  const std::vector<float> chunk(kChunkTokens * kHeadDim, 0.25f);
  std::vector<client::SessionHandle> sessions;
  absl::Status status = absl::OkStatus();
  for (int calls = 0; calls < kMaxCalls; ++calls) {
    // A session is full (OUT_OF_RANGE at --max_session_tokens): next one.
    if (sessions.empty() || status.code() == absl::StatusCode::kOutOfRange) {
      auto session = client.OpenSession(spec);
      if (!session.ok()) {
        status = session.status();
        break;
      }
      sessions.push_back(*std::move(session));
    }
    status = sessions.back().Prefill(0, chunk, chunk, chunk).status();
    if (!status.ok() && status.code() != absl::StatusCode::kOutOfRange) break;
  }
  int64_t most_used = 0;
  if (auto info = client.GetServerInfo(); info.ok()) {
    most_used = info->kv_cache_used_bytes();
  }
  for (client::SessionHandle& session : sessions) {
    if (absl::Status deleted = session.Delete(); !deleted.ok()) return deleted;
  }
  if (status.code() != absl::StatusCode::kResourceExhausted) {
    return absl::FailedPreconditionError(
        absl::StrCat("the pool never filled: ", status.ToString()));
  }
  return most_used;
}

}  // namespace attention::soak
