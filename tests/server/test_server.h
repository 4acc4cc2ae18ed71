// Helpers for server integration tests: an in-process attention server on an
// ephemeral port with a client, synthetic data, a double-precision reference
// attention, and bitwise comparisons.
#ifndef ATTENTION_TESTS_SERVER_TEST_SERVER_H_
#define ATTENTION_TESTS_SERVER_TEST_SERVER_H_

#include <grpcpp/channel.h>
#include <grpcpp/support/status.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attention/v1/attention.pb.h"
#include "client/attention_client.h"
#include "gtest/gtest.h"
#include "server/attention_server.h"
#include "server/server_options.h"

namespace attention::testing {

namespace v1 = ::attention::v1;

inline absl::Status ToStatus(const absl::Status& status) { return status; }
template <typename T>
absl::Status ToStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

#define ATTN_ASSERT_OK(expr)                                      \
  do {                                                            \
    const ::absl::Status attn_assert_status_ =                    \
        ::attention::testing::ToStatus(expr);                     \
    ASSERT_TRUE(attn_assert_status_.ok()) << attn_assert_status_; \
  } while (false)

#define ATTN_EXPECT_OK(expr)                                      \
  do {                                                            \
    const ::absl::Status attn_expect_status_ =                    \
        ::attention::testing::ToStatus(expr);                     \
    EXPECT_TRUE(attn_expect_status_.ok()) << attn_expect_status_; \
  } while (false)

// Expects `expr` (Status or StatusOr) to fail with `code`.
#define ATTN_EXPECT_CODE(expr, expected_code)                                \
  do {                                                                       \
    const ::absl::Status attn_code_status_ =                                 \
        ::attention::testing::ToStatus(expr);                                \
    EXPECT_EQ(attn_code_status_.code(), expected_code) << attn_code_status_; \
    EXPECT_FALSE(attn_code_status_.message().empty());                       \
  } while (false)

// Options for a test server: localhost, ephemeral port, CPU backend, two
// backend threads, a 64 MiB pool of 4 KiB blocks.
server::ServerOptions TestServerOptions();

// A running in-process server and a client connected to it.
struct TestServer {
  std::unique_ptr<server::AttentionServer> server;
  std::unique_ptr<client::AttentionClient> client;
};
absl::StatusOr<std::unique_ptr<TestServer>> StartTestServer(
    const server::ServerOptions& options = TestServerOptions());

// A session spec. `windows` gives each layer's window (0 = full); empty
// means every layer full.
v1::SessionSpec MakeSpec(int num_layers, int num_q_heads, int num_kv_heads,
                         int head_dim, std::vector<int> windows = {},
                         v1::DType kv_dtype = v1::DTYPE_FLOAT32);

// Uniform values in [-scale, scale), deterministic in `seed`.
std::vector<float> RandomFloats(int64_t count, uint32_t seed,
                                float scale = 1.0f);

// T tokens of one layer: q [T, H, D], k [T, H_kv, D], v [T, H_kv, Dv].
struct Tokens {
  int64_t count = 0, heads = 0, kv_heads = 0, head_dim = 0, value_dim = 0;
  std::vector<float> q, k, v;

  absl::Span<const float> q_rows(int64_t begin, int64_t rows) const;
  absl::Span<const float> k_rows(int64_t begin, int64_t rows) const;
  absl::Span<const float> v_rows(int64_t begin, int64_t rows) const;
};
// Random tokens shaped for a resolved `spec`.
Tokens RandomTokens(const v1::SessionSpec& spec, int64_t count, uint32_t seed);

// Stateless causal attention over all of `tokens` with layer `layer`'s mask,
// sinks and scale from the resolved `spec`; k and v are sent in `kv_dtype`.
v1::AttentionRequest StatelessRequestFor(const Tokens& tokens,
                                         const v1::SessionSpec& spec, int layer,
                                         v1::DType kv_dtype);

// A stateless Attention request whose reply (the weights of 4000 keys for
// as many queries) holds 64 MB: a client that does not read it leaves the
// connection's socket buffers full.
v1::AttentionRequest LargeReplyRequest();

// Bytes of rows [begin, begin + rows) along dimension 0 of `tensor`.
std::string RowBytes(const v1::Tensor& tensor, int64_t begin, int64_t rows);

// The status of unary call `method` ("/package.Service/Method") on
// `channel` with request bytes `bytes` (any bytes, not necessarily a
// message) and, when not empty, `authorization` metadata.
grpc::Status RawUnaryCall(const std::shared_ptr<grpc::Channel>& channel,
                          const std::string& method, const std::string& bytes,
                          const std::string& authorization = "");

// Polls `condition` every 100 ms for up to `timeout` (generous: a bound
// that only a broken server reaches); whether it became true.
template <typename Condition>
bool Eventually(Condition condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return condition();
}

// What a failed call must leave unchanged.
struct StateSnapshot {
  std::vector<int64_t> layer_lengths;
  int64_t kv_cache_bytes = 0;
  int64_t kv_cache_used_bytes = 0;
  int64_t active_sessions = 0;
  bool operator==(const StateSnapshot&) const = default;
};
absl::StatusOr<StateSnapshot> Snapshot(client::AttentionClient& client,
                                       const std::string& session_id);
std::string ToString(const StateSnapshot& snapshot);
inline void PrintTo(const StateSnapshot& snapshot, std::ostream* os) {
  *os << ToString(snapshot);
}

// Attention in double precision, straight from the definition (the seeds'
// make_mask + sdpa), for checking values that are not bitwise comparable.
struct ReferenceProblem {
  int64_t tq = 0, tk = 0, heads = 0, kv_heads = 0, head_dim = 0, value_dim = 0;
  std::vector<float> q, k, v;  // row-major [T, heads, dim]
  bool causal = true;
  int64_t window = 0, num_sink_tokens = 0, query_start = 0;
  std::vector<float> sink_logits;  // empty or heads
  std::vector<float> bias;         // empty or [heads, tq, tk]
  double scale = 0.0;              // 0 = 1/sqrt(head_dim)
};
struct ReferenceResult {
  std::vector<double> output;   // [tq, heads, value_dim]
  std::vector<double> lse;      // [tq, heads]; -inf for an empty row
  std::vector<double> weights;  // [heads, tq, tk]
};
ReferenceResult ReferenceAttention(const ReferenceProblem& problem);

// Values rounded through `dtype` (as the server stores them).
std::vector<float> RoundThrough(absl::Span<const float> values,
                                v1::DType dtype);

// Decodes a result tensor or fails the test.
std::vector<float> Floats(const v1::Tensor& tensor);

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_SERVER_TEST_SERVER_H_
