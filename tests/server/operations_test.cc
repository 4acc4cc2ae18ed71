// Operations of a running server: Prometheus metrics recorded per RPC, and
// the graceful drain (NOT_SERVING, no new sessions, open streams finish).
#include <grpcpp/client_context.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

class OperationsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server::ServerOptions options = TestServerOptions();
    options.metrics_port = 0;
    options.listen_address = "127.0.0.1";
    options.drain_timeout = absl::Seconds(60);
    auto server = StartTestServer(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  client::AttentionClient& client() { return *server_->client; }
  std::string Metrics() { return server_->server->metrics().TextExposition(); }

  std::unique_ptr<TestServer> server_;
};

TEST_F(OperationsTest, EveryRpcIsCountedWithItsCodeAndTokens) {
  const v1::SessionSpec spec = MakeSpec(1, 4, 2, 8);
  auto session = client().OpenSession(spec);
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 6, 3);
  ATTN_ASSERT_OK(session->Prefill(0, tokens.q_rows(0, 4), tokens.k_rows(0, 4),
                                  tokens.v_rows(0, 4)));
  auto stream = client().OpenDecodeStream();
  for (int64_t i = 4; i < 6; ++i) {
    auto request = session->MakeDecodeRequest(
        0, tokens.q_rows(i, 1), tokens.k_rows(i, 1), tokens.v_rows(i, 1));
    ATTN_ASSERT_OK(request);
    ATTN_ASSERT_OK(stream->Step(*request));
  }
  stream->WritesDone();
  ATTN_ASSERT_OK(stream->Finish());
  v1::GetSessionRequest missing;
  missing.set_session_id("no-such-session");
  ATTN_EXPECT_CODE(client().GetSession(missing.session_id()),
                   absl::StatusCode::kNotFound);

  const std::string text = Metrics();
  auto count = [&](const char* method, const char* code) {
    return absl::StrCat("attention_requests_total{method=\"", method,
                        "\",code=\"", code, "\"} ");
  };
  // Checked one by one so a failure does not print the whole exposition.
  EXPECT_TRUE(absl::StrContains(text, count("CreateSession", "OK") + "1"));
  EXPECT_TRUE(absl::StrContains(text, count("Prefill", "OK") + "1"));
  EXPECT_TRUE(absl::StrContains(text, count("Decode", "OK") + "2"))
      << "a Decode stream counts each step";
  EXPECT_TRUE(absl::StrContains(text, count("GetSession", "NOT_FOUND") + "1"));
  EXPECT_TRUE(
      absl::StrContains(text, "attention_tokens_total{phase=\"prefill\"} 4"));
  EXPECT_TRUE(
      absl::StrContains(text, "attention_tokens_total{phase=\"decode\"} 2"));
  EXPECT_TRUE(absl::StrContains(text, "attention_decode_batch_size_count 2"));
  EXPECT_TRUE(absl::StrContains(text, "attention_sessions_active 1"));
  EXPECT_TRUE(absl::StrContains(text, "attention_streams_active 0"));
  EXPECT_TRUE(absl::StrContains(text, "attention_build_info{backend=\"cpu\""));
  EXPECT_GT(server_->server->metrics_port(), 0);
}

TEST_F(OperationsTest, DrainRefusesNewSessionsAndLetsOpenStreamsFinish) {
  const v1::SessionSpec spec = MakeSpec(1, 2, 1, 8);
  auto session = client().OpenSession(spec);
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 3, 5);
  auto stream = client().OpenDecodeStream();
  auto first = session->MakeDecodeRequest(
      0, tokens.q_rows(0, 1), tokens.k_rows(0, 1), tokens.v_rows(0, 1));
  ATTN_ASSERT_OK(stream->Step(*first));

  absl::Notification stopped;
  std::thread shutdown([&] {
    server_->server->Shutdown();
    stopped.Notify();
  });
  // Health turns NOT_SERVING first (a condition, bounded; no timing).
  client::ServingStatus health = client::ServingStatus::kServing;
  for (int i = 0; i < 2000 && health == client::ServingStatus::kServing; ++i) {
    auto status = client().CheckHealth();
    if (status.ok()) health = *status;
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ(health, client::ServingStatus::kNotServing);
  ATTN_EXPECT_CODE(client().OpenSession(spec), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(stopped.HasBeenNotified())
      << "the server waits for the open stream";

  // The open stream keeps working, then ends; the drain completes.
  auto second = session->MakeDecodeRequest(
      0, tokens.q_rows(1, 1), tokens.k_rows(1, 1), tokens.v_rows(1, 1));
  auto result = stream->Step(*second);
  ATTN_ASSERT_OK(result);
  EXPECT_EQ(result->position(), 1);
  stream->WritesDone();
  ATTN_EXPECT_OK(stream->Finish());
  shutdown.join();
  EXPECT_TRUE(stopped.HasBeenNotified());
}

// A drain whose time for calls runs out ends the Decode streams still open
// as they wait for their next request: UNAVAILABLE naming the first request
// they did not apply, with attention-stream-drained (not gRPC's cancel,
// which would leave the client in doubt). The client library reports a
// stream ended so with every request answered as a clean end.
TEST(DrainDeadlineTest, OpenStreamsEndSayingWhatTheyDidNotApply) {
  server::ServerOptions options = TestServerOptions();
  options.drain_timeout = absl::Seconds(2);
  auto server = StartTestServer(options);
  ATTN_ASSERT_OK(server);
  client::AttentionClient& client = *(*server)->client;
  auto session = client.OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 3, 7);
  auto step = [&](int t) {
    auto request = session->MakeDecodeRequest(
        0, tokens.q_rows(t, 1), tokens.k_rows(t, 1), tokens.v_rows(t, 1));
    EXPECT_TRUE(request.ok()) << request.status();
    return *request;
  };
  // On the wire (gRPC's own stream): one step, then the drain.
  grpc::ClientContext context;
  auto raw = client.stub()->Decode(&context);
  ASSERT_TRUE(raw->Write(step(0)));
  v1::AttentionResult result;
  ASSERT_TRUE(raw->Read(&result));
  // Through the client library: a stream that may still write, and one
  // that has said it will not (whichever of its half-close and the drain's
  // end comes first, it ended cleanly).
  auto open = client.OpenDecodeStream();
  ATTN_ASSERT_OK(open->Step(step(1)));
  auto closed = client.OpenDecodeStream();
  ATTN_ASSERT_OK(closed->Step(step(2)));

  std::thread shutdown([&] { (*server)->server->Shutdown(); });
  EXPECT_FALSE(raw->Read(&result));
  const grpc::Status status = raw->Finish();
  const absl::Status ended = open->Read().status();
  closed->WritesDone();
  const absl::Status finished = closed->Finish();
  shutdown.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << status.error_message();
  EXPECT_TRUE(absl::StartsWith(status.error_message(), "requests[1]: "))
      << status.error_message();
  const auto& trailers = context.GetServerTrailingMetadata();
  const auto drained = trailers.find("attention-stream-drained");
  ASSERT_NE(drained, trailers.end());
  EXPECT_EQ(drained->second, "1");
  EXPECT_TRUE(client::IsStreamDrained(ended)) << ended;
  EXPECT_TRUE(absl::StartsWith(ended.message(), "requests[1]: ")) << ended;
  ATTN_EXPECT_OK(finished);
}

}  // namespace
}  // namespace attention::testing
