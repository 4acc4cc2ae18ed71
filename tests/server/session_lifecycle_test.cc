// Session lifecycle over the RPC API: fork, truncate, hybrid memory,
// list/delete, idle expiry.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/kv_size.h"
#include "core/session_spec.h"
#include "gtest/gtest.h"
#include "server/proto_convert.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

class SessionLifecycleTest : public ::testing::Test {
 protected:
  void Start(server::ServerOptions options = TestServerOptions()) {
    auto server = StartTestServer(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void SetUp() override { Start(); }
  client::AttentionClient& client() { return *server_->client; }

  // Output bytes of a stateless causal call over `tokens` for one layer.
  std::string StatelessRow(const Tokens& tokens, const v1::SessionSpec& spec,
                           int layer, int64_t row) {
    auto result = client().Attention(
        StatelessRequestFor(tokens, spec, layer, v1::DTYPE_FLOAT32));
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? RowBytes(result->output(), row, 1) : "";
  }

  std::unique_ptr<TestServer> server_;
};

// Tokens [0, n) of `a` followed by tokens [n, n + m) of `b`.
Tokens Concat(const Tokens& a, int64_t n, const Tokens& b, int64_t m) {
  Tokens out = a;
  out.count = n + m;
  auto take = [](const std::vector<float>& x, int64_t width, int64_t begin,
                 int64_t rows) {
    return std::vector<float>(x.begin() + begin * width,
                              x.begin() + (begin + rows) * width);
  };
  const int64_t qw = a.heads * a.head_dim, kw = a.kv_heads * a.head_dim,
                vw = a.kv_heads * a.value_dim;
  out.q = take(a.q, qw, 0, n);
  out.k = take(a.k, kw, 0, n);
  out.v = take(a.v, vw, 0, n);
  auto append = [](std::vector<float>& to, const std::vector<float>& from) {
    to.insert(to.end(), from.begin(), from.end());
  };
  append(out.q, take(b.q, qw, n, m));
  append(out.k, take(b.k, kw, n, m));
  append(out.v, take(b.v, vw, n, m));
  return out;
}

TEST_F(SessionLifecycleTest, ForkSharesHistoryAndAppendsNeverCross) {
  auto parent = client().OpenSession(MakeSpec(2, 4, 2, 16, {0, 24}));
  ATTN_ASSERT_OK(parent);
  const v1::SessionSpec& spec = parent->spec();
  const int64_t prompt = 100, extra = 5;
  const Tokens base = RandomTokens(spec, prompt + extra, 1);
  const Tokens other = RandomTokens(spec, prompt + extra, 2);
  for (int layer = 0; layer < 2; ++layer) {
    ATTN_ASSERT_OK(parent->Prefill(layer, base.q_rows(0, prompt),
                                   base.k_rows(0, prompt),
                                   base.v_rows(0, prompt)));
  }
  auto before = Snapshot(client(), parent->id());
  ATTN_ASSERT_OK(before);

  auto fork = parent->Fork();
  ATTN_ASSERT_OK(fork);
  EXPECT_NE(fork->id(), parent->id());
  auto fork_info = fork->Info();
  ATTN_ASSERT_OK(fork_info);
  EXPECT_EQ(std::vector<int64_t>(fork_info->layer_lengths().begin(),
                                 fork_info->layer_lengths().end()),
            before->layer_lengths);
  EXPECT_EQ(fork_info->kv_cache_bytes(), before->kv_cache_bytes);
  EXPECT_EQ(fork_info->spec().SerializeAsString(), spec.SerializeAsString());
  // Copy-on-write: forking allocates no block.
  auto after_fork = Snapshot(client(), parent->id());
  ATTN_ASSERT_OK(after_fork);
  EXPECT_EQ(after_fork->kv_cache_used_bytes, before->kv_cache_used_bytes);

  // Diverge: the parent continues with `base`, the fork with `other`.
  const Tokens fork_history = Concat(base, prompt, other, extra);
  for (int64_t t = prompt; t < prompt + extra; ++t) {
    for (int layer = 0; layer < 2; ++layer) {
      auto from_fork = fork->DecodeStep(layer, other.q_rows(t, 1),
                                        other.k_rows(t, 1), other.v_rows(t, 1));
      ATTN_ASSERT_OK(from_fork);
      auto from_parent = parent->DecodeStep(
          layer, base.q_rows(t, 1), base.k_rows(t, 1), base.v_rows(t, 1));
      ATTN_ASSERT_OK(from_parent);
      EXPECT_EQ(from_parent->output().data(),
                StatelessRow(Concat(base, t + 1, base, 0), spec, layer, t))
          << "parent layer " << layer << " token " << t;
      EXPECT_EQ(from_fork->output().data(),
                StatelessRow(Concat(fork_history, t + 1, fork_history, 0), spec,
                             layer, t))
          << "fork layer " << layer << " token " << t;
    }
  }
  // Deleting the parent leaves the fork intact.
  ATTN_ASSERT_OK(parent->Delete());
  auto fork_after = fork->Info();
  ATTN_ASSERT_OK(fork_after);
  EXPECT_EQ(fork_after->layer_lengths(0), prompt + extra);
}

TEST_F(SessionLifecycleTest, TruncateThenReappendReproducesBitwise) {
  auto session = client().OpenSession(MakeSpec(2, 4, 2, 16, {0, 32}));
  ATTN_ASSERT_OK(session);
  const int64_t prompt = 60, steps = 8;
  std::vector<Tokens> tokens;
  std::vector<std::vector<v1::AttentionResult>> first(2);
  for (int layer = 0; layer < 2; ++layer) {
    tokens.push_back(RandomTokens(session->spec(), prompt + steps, 40 + layer));
    ATTN_ASSERT_OK(session->Prefill(layer, tokens[layer].q_rows(0, prompt),
                                    tokens[layer].k_rows(0, prompt),
                                    tokens[layer].v_rows(0, prompt)));
  }
  auto at_prompt = Snapshot(client(), session->id());
  ATTN_ASSERT_OK(at_prompt);
  for (int64_t t = prompt; t < prompt + steps; ++t) {
    for (int layer = 0; layer < 2; ++layer) {
      auto result = session->DecodeStep(layer, tokens[layer].q_rows(t, 1),
                                        tokens[layer].k_rows(t, 1),
                                        tokens[layer].v_rows(t, 1));
      ATTN_ASSERT_OK(result);
      first[layer].push_back(*std::move(result));
    }
  }
  // Speculative-decoding rollback, then the same tokens again.
  auto truncated = session->Truncate(prompt);
  ATTN_ASSERT_OK(truncated);
  EXPECT_EQ(truncated->layer_lengths(0), prompt);
  EXPECT_EQ(truncated->layer_lengths(1), prompt);
  auto after_truncate = Snapshot(client(), session->id());
  ATTN_ASSERT_OK(after_truncate);
  EXPECT_EQ(after_truncate->layer_lengths, at_prompt->layer_lengths);
  // The window layer may have dropped blocks meanwhile; nothing else grew.
  EXPECT_LE(after_truncate->kv_cache_bytes, at_prompt->kv_cache_bytes);
  EXPECT_EQ(after_truncate->kv_cache_used_bytes,
            after_truncate->kv_cache_bytes);
  for (int64_t t = prompt; t < prompt + steps; ++t) {
    for (int layer = 0; layer < 2; ++layer) {
      auto result = session->DecodeStep(layer, tokens[layer].q_rows(t, 1),
                                        tokens[layer].k_rows(t, 1),
                                        tokens[layer].v_rows(t, 1));
      ATTN_ASSERT_OK(result);
      EXPECT_EQ(result->position(), t);
      EXPECT_EQ(result->output().data(),
                first[layer][t - prompt].output().data());
    }
  }
}

TEST_F(SessionLifecycleTest, TruncateCutsOnlyLongerLayersAndNeverGrows) {
  auto session = client().OpenSession(MakeSpec(3, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 30, 5);
  const std::vector<int64_t> lengths = {30, 10, 20};
  for (int layer = 0; layer < 3; ++layer) {
    ATTN_ASSERT_OK(session->Prefill(layer, tokens.q_rows(0, lengths[layer]),
                                    tokens.k_rows(0, lengths[layer]),
                                    tokens.v_rows(0, lengths[layer])));
  }
  auto info = session->Truncate(15);
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 15);
  EXPECT_EQ(info->layer_lengths(1), 10);
  EXPECT_EQ(info->layer_lengths(2), 15);
  info = session->Truncate(1000);  // longer than every layer: no change
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 15);
  info = session->Truncate(0);
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->kv_cache_bytes(), 0);
}

TEST_F(SessionLifecycleTest, TruncatingAForkLeavesTheParentAlone) {
  auto parent = client().OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(parent);
  const Tokens tokens = RandomTokens(parent->spec(), 41, 9);
  ATTN_ASSERT_OK(parent->Prefill(0, tokens.q_rows(0, 40), tokens.k_rows(0, 40),
                                 tokens.v_rows(0, 40)));
  auto fork = parent->Fork();
  ATTN_ASSERT_OK(fork);
  ATTN_ASSERT_OK(fork->Truncate(3));
  auto parent_info = parent->Info();
  ATTN_ASSERT_OK(parent_info);
  EXPECT_EQ(parent_info->layer_lengths(0), 40);
  auto next = parent->DecodeStep(0, tokens.q_rows(40, 1), tokens.k_rows(40, 1),
                                 tokens.v_rows(40, 1));
  ATTN_ASSERT_OK(next);
  EXPECT_EQ(next->output().data(), StatelessRow(tokens, parent->spec(), 0, 40));
}

// Blocks a window layer needs after `length` tokens: those holding the
// positions a future query can see, [length - window + 1, length), and the
// sink tokens.
int64_t NeededWindowBlocks(int64_t length, int64_t window, int64_t sinks,
                           int64_t tokens_per_block) {
  if (length == 0) return 0;
  const int64_t first = std::max<int64_t>(0, length - window + 1);
  int64_t blocks =
      (length - 1) / tokens_per_block - first / tokens_per_block + 1;
  const int64_t sink_blocks = std::min<int64_t>(
      (std::min(sinks, length) + tokens_per_block - 1) / tokens_per_block,
      first / tokens_per_block);
  return blocks + sink_blocks;
}

TEST_F(SessionLifecycleTest, HybridSessionUsesWhatTheBlockMathPredicts) {
  // gpt-oss scaled down: full and window layers alternate.
  constexpr int kLayers = 6, kWindowLayers = 3;
  constexpr int64_t kWindow = 40, kBlockBytes = 4096;
  for (v1::DType kv_dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16}) {
    v1::SessionSpec requested = MakeSpec(
        kLayers, 4, 2, 16, {kWindow, 0, kWindow, 0, kWindow, 0}, kv_dtype);
    requested.mutable_layers(4)->set_num_sink_tokens(4);
    auto session = client().OpenSession(requested);
    ATTN_ASSERT_OK(session);
    const v1::SessionSpec& spec = session->spec();
    const int64_t bytes_per_token =
        2 * 2 * 16 * (kv_dtype == v1::DTYPE_FLOAT32 ? 4 : 2);
    const int64_t tokens_per_block = kBlockBytes / bytes_per_token;
    const Tokens tokens = RandomTokens(spec, 700, 3);

    int64_t length = 0;
    int64_t window_bytes_at_300 = -1;
    for (int64_t chunk : {10, 90, 200, 400}) {
      for (int layer = 0; layer < kLayers; ++layer) {
        ATTN_ASSERT_OK(session->Prefill(layer, tokens.q_rows(length, chunk),
                                        tokens.k_rows(length, chunk),
                                        tokens.v_rows(length, chunk)));
      }
      length += chunk;
      int64_t full_blocks = 0, min_window_blocks = 0;
      for (int layer = 0; layer < kLayers; ++layer) {
        const v1::LayerSpec& layer_spec = spec.layers(layer);
        if (layer_spec.window() == 0) {
          full_blocks += (length + tokens_per_block - 1) / tokens_per_block;
        } else {
          min_window_blocks += NeededWindowBlocks(length, layer_spec.window(),
                                                  layer_spec.num_sink_tokens(),
                                                  tokens_per_block);
        }
      }
      auto info = session->Info();
      ATTN_ASSERT_OK(info);
      const int64_t window_bytes =
          info->kv_cache_bytes() - full_blocks * kBlockBytes;
      // Full layers hold every block; a window layer holds what it can still
      // see plus at most one block of rollback slack.
      EXPECT_GE(window_bytes, min_window_blocks * kBlockBytes)
          << "length " << length;
      EXPECT_LE(window_bytes, (min_window_blocks + kWindowLayers) * kBlockBytes)
          << "length " << length;
      if (length == 300) window_bytes_at_300 = window_bytes;
      if (length == 700) {
        // Bounded: 400 more tokens did not grow the window layers.
        EXPECT_EQ(window_bytes, window_bytes_at_300);
      }
      // The seeds' calculator gives the payload; blocks round it up.
      auto core_spec = server::SessionSpecFromProto(spec);
      ATTN_ASSERT_OK(core_spec);
      const KvSizePlan plan = PlanKvSize(*core_spec, length);
      EXPECT_GE(info->kv_cache_bytes(), plan.context_bytes);
      EXPECT_LE(info->kv_cache_bytes(),
                plan.context_bytes + kLayers * 3 * kBlockBytes);
      // One session: the pool holds exactly its blocks.
      auto server_info = client().GetServerInfo();
      ATTN_ASSERT_OK(server_info);
      EXPECT_EQ(server_info->kv_cache_used_bytes(), info->kv_cache_bytes());
    }
    ATTN_ASSERT_OK(session->Delete());
  }
}

TEST_F(SessionLifecycleTest, ListAndDeleteFreeMemoryAtOnce) {
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) {
    auto session = client().OpenSession(MakeSpec(1, 2, 1, 8));
    ATTN_ASSERT_OK(session);
    const Tokens tokens = RandomTokens(session->spec(), 50, i);
    ATTN_ASSERT_OK(session->Prefill(
        0, tokens.q_rows(0, 50), tokens.k_rows(0, 50), tokens.v_rows(0, 50)));
    ids.push_back(session->id());
    EXPECT_GE(ids.back().size(), 32u);  // 128 random bits, hex
  }
  auto listed = client().ListSessions();
  ATTN_ASSERT_OK(listed);
  ASSERT_EQ(listed->size(), 3u);
  for (const v1::SessionInfo& info : *listed) {
    EXPECT_NE(std::find(ids.begin(), ids.end(), info.session_id()), ids.end());
    EXPECT_EQ(info.layer_lengths(0), 50);
  }
  for (const std::string& id : ids) ATTN_ASSERT_OK(client().DeleteSession(id));
  auto info = client().GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->active_sessions(), 0);
  EXPECT_EQ(info->kv_cache_used_bytes(), 0);
  ATTN_EXPECT_CODE(client().GetSession(ids[0]), absl::StatusCode::kNotFound);
  auto empty = client().ListSessions();
  ATTN_ASSERT_OK(empty);
  EXPECT_TRUE(empty->empty());
}

TEST_F(SessionLifecycleTest, IdleSessionsExpire) {
  server::ServerOptions options = TestServerOptions();
  // Long enough that the session cannot expire between OpenSession and
  // Prefill, even in a sanitizer build on a slow machine.
  options.session_idle_timeout = absl::Seconds(2);
  Start(options);
  auto idle = client().OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(idle);
  const Tokens tokens = RandomTokens(idle->spec(), 20, 1);
  ATTN_ASSERT_OK(idle->Prefill(0, tokens.q_rows(0, 20), tokens.k_rows(0, 20),
                               tokens.v_rows(0, 20)));
  // A per-session timeout overrides the server default.
  auto kept = client().OpenSession(MakeSpec(1, 2, 1, 8), absl::Seconds(600));
  ATTN_ASSERT_OK(kept);

  // The reaper removes the expired session and frees its blocks. Polled
  // with GetServerInfo, which leaves the sessions' idle clocks alone.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  v1::ServerInfo info;
  do {
    auto current = client().GetServerInfo();
    ATTN_ASSERT_OK(current);
    info = *current;
    if (info.active_sessions() == 1 && info.kv_cache_used_bytes() == 0) break;
    absl::SleepFor(absl::Milliseconds(20));
  } while (absl::Now() < deadline);
  EXPECT_EQ(info.active_sessions(), 1);
  EXPECT_EQ(info.kv_cache_used_bytes(), 0);
  ATTN_EXPECT_CODE(idle->Info(), absl::StatusCode::kNotFound);
  ATTN_EXPECT_CODE(idle->DecodeStep(0, tokens.q_rows(0, 1), tokens.k_rows(0, 1),
                                    tokens.v_rows(0, 1)),
                   absl::StatusCode::kNotFound);
  ATTN_EXPECT_OK(kept->Info());
}

}  // namespace
}  // namespace attention::testing
