// Every error code of the API, each followed by a check that the failed call
// changed nothing (session lengths and bytes, pool usage, session count).
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

using absl::StatusCode;

class ErrorsTest : public ::testing::Test {
 protected:
  void Start(server::ServerOptions options = TestServerOptions()) {
    auto server = StartTestServer(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void SetUp() override {
    Start();
    // Layer 0 full causal, layer 1 window 8; 16 tokens per 4 KiB block.
    auto session = client().OpenSession(MakeSpec(2, 4, 2, 16, {0, 8}));
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = std::make_unique<client::SessionHandle>(*session);
    tokens_ = RandomTokens(session_->spec(), 200, 11);
    for (int layer = 0; layer < 2; ++layer) {
      ATTN_ASSERT_OK(session_->Prefill(layer, tokens_.q_rows(0, kHistory),
                                       tokens_.k_rows(0, kHistory),
                                       tokens_.v_rows(0, kHistory)));
    }
    TakeSnapshot();
  }

  client::AttentionClient& client() { return *server_->client; }

  void TakeSnapshot() {
    auto snapshot = Snapshot(client(), session_->id());
    ASSERT_TRUE(snapshot.ok()) << snapshot.status();
    snapshot_ = *snapshot;
  }
  // The session and the server look exactly as before the failed call.
  void ExpectUnchanged(const std::string& what) {
    auto now = Snapshot(client(), session_->id());
    ASSERT_TRUE(now.ok()) << now.status();
    EXPECT_EQ(*now, snapshot_) << what << ": before " << ToString(snapshot_)
                               << ", after " << ToString(*now);
  }

  v1::PrefillRequest GoodPrefill(int64_t tokens = 2) {
    auto request = session_->MakePrefillRequest(
        0, tokens_.q_rows(kHistory, tokens), tokens_.k_rows(kHistory, tokens),
        tokens_.v_rows(kHistory, tokens));
    EXPECT_TRUE(request.ok()) << request.status();
    return *request;
  }
  v1::DecodeRequest GoodDecode(int layer = 0) {
    auto request = session_->MakeDecodeRequest(
        layer, tokens_.q_rows(kHistory, 1), tokens_.k_rows(kHistory, 1),
        tokens_.v_rows(kHistory, 1));
    EXPECT_TRUE(request.ok()) << request.status();
    return *request;
  }

  static constexpr int64_t kHistory = 40;
  std::unique_ptr<TestServer> server_;
  std::unique_ptr<client::SessionHandle> session_;
  Tokens tokens_;
  StateSnapshot snapshot_;
};

void SetFloat(v1::Tensor* tensor, int64_t index, float value) {
  std::string* data = tensor->mutable_data();
  std::memcpy(data->data() + index * sizeof(float), &value, sizeof(float));
}

TEST_F(ErrorsTest, MalformedPrefillsAreInvalidArgument) {
  const std::vector<
      std::pair<std::string, std::function<void(v1::PrefillRequest&)>>>
      cases = {
          {"q missing", [](auto& r) { r.clear_q(); }},
          {"k without dtype",
           [](auto& r) { r.mutable_k()->set_dtype(v1::DTYPE_UNSPECIFIED); }},
          {"v unknown dtype",
           [](auto& r) {
             r.mutable_v()->set_dtype(static_cast<v1::DType>(7));
           }},
          {"q rank 2",
           [](auto& r) {
             r.mutable_q()->clear_shape();
             r.mutable_q()->add_shape(2);
             r.mutable_q()->add_shape(64);
           }},
          {"k wrong kv heads",
           [](auto& r) {
             r.mutable_k()->set_shape(1, 4);
             r.mutable_k()->set_shape(2, 8);
           }},
          {"v wrong value_dim",
           [](auto& r) {
             r.mutable_v()->set_shape(1, 1);
             r.mutable_v()->set_shape(2, 64);
           }},
          {"q wrong head_dim",
           [](auto& r) {
             r.mutable_q()->set_shape(1, 8);
             r.mutable_q()->set_shape(2, 8);
           }},
          {"k token count differs from q",
           [](auto& r) {
             r.mutable_k()->set_shape(0, 1);
             r.mutable_k()->mutable_data()->resize(2 * 16 * 4);
           }},
          {"data shorter than shape",
           [](auto& r) { r.mutable_q()->mutable_data()->resize(10); }},
          {"negative dimension",
           [](auto& r) { r.mutable_q()->set_shape(0, -2); }},
          {"NaN in q",
           [](auto& r) {
             SetFloat(r.mutable_q(), 3,
                      std::numeric_limits<float>::quiet_NaN());
           }},
          {"Inf in k",
           [](auto& r) {
             SetFloat(r.mutable_k(), 5, std::numeric_limits<float>::infinity());
           }},
          {"-Inf in v",
           [](auto& r) {
             SetFloat(r.mutable_v(), 0,
                      -std::numeric_limits<float>::infinity());
           }},
          {"overflowing logits",
           [](auto& r) {
             for (int i = 0; i < 16; ++i) {
               SetFloat(r.mutable_q(), i, 3e38f);
               SetFloat(r.mutable_k(), i, 3e38f);
             }
           }},
          {"layer -1", [](auto& r) { r.set_layer(-1); }},
          {"layer past num_layers", [](auto& r) { r.set_layer(2); }},
          {"unknown output dtype",
           [](auto& r) { r.set_output_dtype(static_cast<v1::DType>(11)); }},
      };
  for (const auto& [name, mutate] : cases) {
    v1::PrefillRequest request = GoodPrefill();
    mutate(request);
    auto result = client().Prefill(request);
    ATTN_EXPECT_CODE(result, StatusCode::kInvalidArgument);
    ExpectUnchanged(name);
  }
}

TEST_F(ErrorsTest, ValuesOverflowingTheKvDTypeAreInvalidArgument) {
  auto half = client().OpenSession(MakeSpec(1, 2, 1, 8, {}, v1::DTYPE_FLOAT16));
  ATTN_ASSERT_OK(half);
  std::vector<float> q(16, 0.1f), k(8, 0.1f), v(8, 0.1f);
  k[3] = 1e6f;  // finite in float32, +inf in float16
  auto result = half->Prefill(0, q, k, v);
  ATTN_EXPECT_CODE(result, StatusCode::kInvalidArgument);
  auto info = half->Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 0);
  EXPECT_EQ(info->kv_cache_bytes(), 0);
}

TEST_F(ErrorsTest, DecodeStepNeedsExactlyOneToken) {
  v1::DecodeRequest request = GoodDecode();
  const v1::PrefillRequest two = GoodPrefill(2);
  *request.mutable_q() = two.q();
  *request.mutable_k() = two.k();
  *request.mutable_v() = two.v();
  ATTN_EXPECT_CODE(client().DecodeStep(request), StatusCode::kInvalidArgument);
  ExpectUnchanged("DecodeStep with T = 2");
}

TEST_F(ErrorsTest, BadSpecsAreInvalidArgument) {
  std::vector<std::pair<std::string, v1::SessionSpec>> cases;
  cases.emplace_back("q heads not a multiple of kv heads",
                     MakeSpec(1, 3, 2, 8));
  cases.emplace_back("zero layers", MakeSpec(0, 2, 1, 8));
  cases.emplace_back("zero head_dim", MakeSpec(1, 2, 1, 0));
  cases.emplace_back("negative kv heads", MakeSpec(1, 2, -1, 8));
  cases.emplace_back("2 layer specs for 3 layers",
                     MakeSpec(3, 2, 1, 8, {0, 4}));
  cases.emplace_back("negative window", MakeSpec(1, 2, 1, 8, {-4}));
  v1::SessionSpec sinks_without_window = MakeSpec(1, 2, 1, 8, {0});
  sinks_without_window.mutable_layers(0)->set_num_sink_tokens(4);
  cases.emplace_back("sink tokens without window", sinks_without_window);
  v1::SessionSpec wrong_sink_logits = MakeSpec(1, 2, 1, 8, {0});
  wrong_sink_logits.mutable_layers(0)->add_sink_logits(0.5f);
  cases.emplace_back("1 sink logit for 2 heads", wrong_sink_logits);
  v1::SessionSpec nan_sink = MakeSpec(1, 1, 1, 8, {0});
  nan_sink.mutable_layers(0)->add_sink_logits(std::nanf(""));
  cases.emplace_back("NaN sink logit", nan_sink);
  v1::SessionSpec bad_scale = MakeSpec(1, 2, 1, 8);
  bad_scale.set_scale(-1.0f);
  cases.emplace_back("negative scale", bad_scale);
  v1::SessionSpec bad_dtype = MakeSpec(1, 2, 1, 8);
  bad_dtype.set_kv_dtype(static_cast<v1::DType>(9));
  cases.emplace_back("unknown kv_dtype", bad_dtype);
  v1::SessionSpec too_long = MakeSpec(1, 2, 1, 8);
  too_long.set_max_tokens(TestServerOptions().max_session_tokens + 1);
  cases.emplace_back("max_tokens above the server limit", too_long);
  v1::SessionSpec huge_token = MakeSpec(1, 64, 64, 1024);
  cases.emplace_back("a token larger than a KV block", huge_token);
  for (const auto& [name, spec] : cases) {
    ATTN_EXPECT_CODE(client().CreateSession(spec),
                     StatusCode::kInvalidArgument);
    ExpectUnchanged(name);
  }
  v1::CreateSessionRequest negative_timeout;
  *negative_timeout.mutable_spec() = MakeSpec(1, 2, 1, 8);
  negative_timeout.set_idle_timeout_seconds(-5);
  grpc::ClientContext context;
  v1::SessionInfo response;
  const grpc::Status status =
      client().stub()->CreateSession(&context, negative_timeout, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << status.error_message();
  ExpectUnchanged("negative idle timeout");
}

TEST_F(ErrorsTest, StatelessMisuseIsInvalidArgument) {
  v1::AttentionRequest good =
      StatelessRequestFor(tokens_, session_->spec(), 0, v1::DTYPE_FLOAT32);
  const int64_t n = tokens_.count;
  std::vector<
      std::pair<std::string, std::function<void(v1::AttentionRequest&)>>>
      cases = {
          {"window without causal",
           [](auto& r) {
             r.set_causal(false);
             r.set_window(4);
           }},
          {"query_start without causal",
           [](auto& r) {
             r.set_causal(false);
             r.set_query_start(3);
           }},
          {"sinks without window", [](auto& r) { r.set_num_sink_tokens(2); }},
          {"negative query_start", [](auto& r) { r.set_query_start(-1); }},
          {"wrong number of sink logits",
           [](auto& r) { r.add_sink_logits(1); }},
          {"NaN scale", [](auto& r) { r.set_scale(std::nanf("")); }},
          {"bias with +inf",
           [n](auto& r) {
             std::vector<float> bias(n * n, 0.0f);
             bias[5] = std::numeric_limits<float>::infinity();
             *r.mutable_bias() = *client::MakeTensor(bias, {n, n});
           }},
          {"bias with NaN",
           [n](auto& r) {
             std::vector<float> bias(n * n, 0.0f);
             bias[7] = std::nanf("");
             *r.mutable_bias() = *client::MakeTensor(bias, {n, n});
           }},
          {"bias of the wrong shape",
           [n](auto& r) {
             std::vector<float> bias(n * (n - 1), 0.0f);
             *r.mutable_bias() = *client::MakeTensor(bias, {n, n - 1});
           }},
          {"empty row under the ERROR policy",
           [n](auto& r) {
             std::vector<float> bias(n * n, 0.0f);
             for (int64_t j = 0; j < n; ++j) {
               bias[3 * n + j] = -std::numeric_limits<float>::infinity();
             }
             *r.mutable_bias() = *client::MakeTensor(bias, {n, n});
           }},
      };
  for (const auto& [name, mutate] : cases) {
    v1::AttentionRequest request = good;
    mutate(request);
    SCOPED_TRACE(name);
    ATTN_EXPECT_CODE(client().Attention(request), StatusCode::kInvalidArgument);
  }
  ExpectUnchanged("stateless calls");
}

TEST_F(ErrorsTest, UnknownSessionsAreNotFound) {
  const std::string unknown(32, 'f');
  ATTN_EXPECT_CODE(client().GetSession(unknown), StatusCode::kNotFound);
  ATTN_EXPECT_CODE(client().DeleteSession(unknown), StatusCode::kNotFound);
  ATTN_EXPECT_CODE(client().ForkSession(unknown), StatusCode::kNotFound);
  ATTN_EXPECT_CODE(client().TruncateSession(unknown, 1), StatusCode::kNotFound);
  v1::PrefillRequest prefill = GoodPrefill();
  prefill.set_session_id(unknown);
  ATTN_EXPECT_CODE(client().Prefill(prefill), StatusCode::kNotFound);
  v1::DecodeRequest decode = GoodDecode();
  decode.set_session_id(unknown);
  ATTN_EXPECT_CODE(client().DecodeStep(decode), StatusCode::kNotFound);
  v1::BatchDecodeRequest batch;
  *batch.add_steps() = GoodDecode();
  *batch.add_steps() = decode;
  ATTN_EXPECT_CODE(client().BatchDecode(batch), StatusCode::kNotFound);
  auto stream = client().OpenDecodeStream();
  ATTN_EXPECT_CODE(stream->Step(decode), StatusCode::kNotFound);
  ExpectUnchanged("unknown session ids");
}

TEST_F(ErrorsTest, AppendingPastMaxTokensIsOutOfRange) {
  v1::SessionSpec spec = MakeSpec(1, 4, 2, 16);
  spec.set_max_tokens(16);
  auto capped = client().OpenSession(spec);
  ATTN_ASSERT_OK(capped);
  EXPECT_EQ(capped->spec().max_tokens(), 16);
  ATTN_ASSERT_OK(capped->Prefill(0, tokens_.q_rows(0, 10),
                                 tokens_.k_rows(0, 10), tokens_.v_rows(0, 10)));
  session_ = std::make_unique<client::SessionHandle>(*capped);
  TakeSnapshot();
  ATTN_EXPECT_CODE(
      capped->Prefill(0, tokens_.q_rows(10, 7), tokens_.k_rows(10, 7),
                      tokens_.v_rows(10, 7)),
      StatusCode::kOutOfRange);
  ExpectUnchanged("prefill past max_tokens");
  // Exactly max_tokens fits; one more does not.
  ATTN_ASSERT_OK(capped->Prefill(0, tokens_.q_rows(10, 6),
                                 tokens_.k_rows(10, 6), tokens_.v_rows(10, 6)));
  TakeSnapshot();
  EXPECT_EQ(snapshot_.layer_lengths, std::vector<int64_t>{16});
  ATTN_EXPECT_CODE(
      capped->DecodeStep(0, tokens_.q_rows(16, 1), tokens_.k_rows(16, 1),
                         tokens_.v_rows(16, 1)),
      StatusCode::kOutOfRange);
  ExpectUnchanged("decode step at max_tokens");
}

TEST_F(ErrorsTest, FullPoolIsResourceExhausted) {
  // 8 blocks of 4 KiB; the spec stores 16 tokens per block.
  server::ServerOptions options = TestServerOptions();
  options.kv_cache_bytes = 8 * 4096;
  Start(options);
  auto first = client().OpenSession(MakeSpec(1, 4, 2, 16));
  auto second = client().OpenSession(MakeSpec(2, 4, 2, 16));
  ATTN_ASSERT_OK(first);
  ATTN_ASSERT_OK(second);
  ATTN_ASSERT_OK(first->Prefill(0, tokens_.q_rows(0, 100),
                                tokens_.k_rows(0, 100),
                                tokens_.v_rows(0, 100)));  // 7 blocks
  session_ = std::make_unique<client::SessionHandle>(*second);
  TakeSnapshot();
  EXPECT_EQ(snapshot_.kv_cache_used_bytes, 7 * 4096);
  ATTN_EXPECT_CODE(
      second->Prefill(0, tokens_.q_rows(0, 40), tokens_.k_rows(0, 40),
                      tokens_.v_rows(0, 40)),
      StatusCode::kResourceExhausted);
  ExpectUnchanged("prefill into a full pool");
  // Two steps that each fit the one free block alone, but not together: the
  // batch fails as a whole.
  v1::BatchDecodeRequest batch;
  for (int layer = 0; layer < 2; ++layer) {
    *batch.add_steps() =
        *second->MakeDecodeRequest(layer, tokens_.q_rows(0, 1),
                                   tokens_.k_rows(0, 1), tokens_.v_rows(0, 1));
  }
  ATTN_EXPECT_CODE(client().BatchDecode(batch), StatusCode::kResourceExhausted);
  ExpectUnchanged("batch into a full pool");
  // Freeing memory makes room again.
  ATTN_ASSERT_OK(first->Delete());
  ATTN_EXPECT_OK(client().BatchDecode(batch));
}

TEST_F(ErrorsTest, TruncatingAWindowLayerTooFarIsFailedPrecondition) {
  // Layer 1 (window 8) has dropped its oldest blocks after 190 tokens.
  for (int layer = 0; layer < 2; ++layer) {
    ATTN_ASSERT_OK(session_->Prefill(layer, tokens_.q_rows(kHistory, 150),
                                     tokens_.k_rows(kHistory, 150),
                                     tokens_.v_rows(kHistory, 150)));
  }
  TakeSnapshot();
  ATTN_EXPECT_CODE(session_->Truncate(20), StatusCode::kFailedPrecondition);
  ExpectUnchanged("truncate to 20");
  // A short rollback stays possible.
  auto info = session_->Truncate(185);
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 185);
  EXPECT_EQ(info->layer_lengths(1), 185);
  ATTN_EXPECT_CODE(session_->Truncate(-1), StatusCode::kInvalidArgument);
}

TEST_F(ErrorsTest, BadStreamRequestEndsTheStreamAndKeepsEarlierSteps) {
  auto stream = client().OpenDecodeStream();
  for (int64_t t = kHistory; t < kHistory + 3; ++t) {
    auto request = session_->MakeDecodeRequest(
        0, tokens_.q_rows(t, 1), tokens_.k_rows(t, 1), tokens_.v_rows(t, 1));
    ATTN_ASSERT_OK(request);
    auto result = stream->Step(*request);
    ATTN_ASSERT_OK(result);
    EXPECT_EQ(result->position(), t);
  }
  v1::DecodeRequest bad = GoodDecode(1);
  bad.mutable_k()->set_dtype(v1::DTYPE_UNSPECIFIED);
  auto refused = stream->Step(bad);
  ATTN_EXPECT_CODE(refused, StatusCode::kInvalidArgument);
  // The request is named once, before its field.
  EXPECT_EQ(refused.status().message().rfind("requests[3]: k", 0), 0u)
      << refused.status();
  EXPECT_EQ(refused.status().message().find("requests[", 1), std::string::npos)
      << refused.status();
  // The stream is over: more writes fail, Finish reports the same error.
  EXPECT_FALSE(stream->Write(GoodDecode(1)));
  ATTN_EXPECT_CODE(stream->Finish(), StatusCode::kInvalidArgument);
  auto info = session_->Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), kHistory + 3);
  EXPECT_EQ(info->layer_lengths(1), kHistory);
}

TEST_F(ErrorsTest, BatchDecodeIsAllOrNothing) {
  auto other = client().OpenSession(MakeSpec(1, 4, 2, 16));
  ATTN_ASSERT_OK(other);
  v1::BatchDecodeRequest batch;
  *batch.add_steps() = GoodDecode(0);
  *batch.add_steps() = GoodDecode(1);
  *batch.add_steps() = *other->MakeDecodeRequest(
      0, tokens_.q_rows(0, 1), tokens_.k_rows(0, 1), tokens_.v_rows(0, 1));
  SetFloat(batch.mutable_steps(2)->mutable_v(), 1,
           std::numeric_limits<float>::infinity());
  TakeSnapshot();
  ATTN_EXPECT_CODE(client().BatchDecode(batch), StatusCode::kInvalidArgument);
  ExpectUnchanged("batch with a bad last step");
  auto other_info = other->Info();
  ATTN_ASSERT_OK(other_info);
  EXPECT_EQ(other_info->layer_lengths(0), 0);

  v1::BatchDecodeRequest duplicate;
  *duplicate.add_steps() = GoodDecode(0);
  *duplicate.add_steps() = GoodDecode(0);
  ATTN_EXPECT_CODE(client().BatchDecode(duplicate),
                   StatusCode::kInvalidArgument);
  ExpectUnchanged("batch naming a (session, layer) twice");
}

TEST_F(ErrorsTest, MessagesAboveTheLimitAreRejected) {
  server::ServerOptions options = TestServerOptions();
  options.max_message_bytes = 64 << 10;
  Start(options);
  auto session = client().OpenSession(MakeSpec(1, 4, 2, 16));
  ATTN_ASSERT_OK(session);
  session_ = std::make_unique<client::SessionHandle>(*session);
  TakeSnapshot();
  // 300 tokens of q alone are 75 KiB.
  const Tokens big = RandomTokens(session->spec(), 300, 3);
  ATTN_EXPECT_CODE(session->Prefill(0, big.q, big.k, big.v),
                   StatusCode::kResourceExhausted);
  ExpectUnchanged("oversized prefill");
  auto info = client().GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->max_message_bytes(), 64 << 10);
  // Stateless weights that could not be sent back are refused up front.
  v1::AttentionRequest weights =
      StatelessRequestFor(RandomTokens(session->spec(), 100, 4),
                          session->spec(), 0, v1::DTYPE_FLOAT32);
  weights.set_return_weights(true);  // 4 x 100 x 100 x 4 bytes = 160 KB
  auto result = client().Attention(weights);
  EXPECT_FALSE(result.ok());
  EXPECT_TRUE(result.status().code() == StatusCode::kInvalidArgument ||
              result.status().code() == StatusCode::kResourceExhausted)
      << result.status();
  // A 1 KiB layer entry spelled out for 64 layers: the SessionInfo that
  // CreateSession (or a fork or truncation of it) answers with would not
  // fit the limit, so the session is not created.
  v1::SessionSpec wide = MakeSpec(64, 256, 1, 16);
  wide.clear_layers();
  v1::LayerSpec* layer = wide.add_layers();
  for (int h = 0; h < 256; ++h) layer->add_sink_logits(0.5f);
  auto refused = client().CreateSession(wide);
  ATTN_EXPECT_CODE(refused, StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("--max_message_bytes"),
            std::string::npos)
      << refused.status();
  ExpectUnchanged("a spec whose SessionInfo passes the limit");
  // The same spec with 16 layers fits, and so do its fork and truncation.
  wide.set_num_layers(16);
  auto fits = client().CreateSession(wide);
  ATTN_ASSERT_OK(fits);
  EXPECT_EQ(fits->spec().layers_size(), 16);
  ATTN_EXPECT_OK(client().ForkSession(fits->session_id()));
  ATTN_EXPECT_OK(client().TruncateSession(fits->session_id(), 0));
}

}  // namespace
}  // namespace attention::testing
