// Robustness: what hostile or careless clients sent that once crashed the
// server, burnt it for a client that had gone, or changed state on failure
// (one test per case of the robustness issue). Every call here must fail
// fast with its documented code and leave the session as it was.
#include <grpc/compression.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

using absl::StatusCode;

class RobustnessTest : public ::testing::Test {
 protected:
  void Start(const server::ServerOptions& options = TestServerOptions()) {
    auto server = StartTestServer(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  client::AttentionClient& client() { return *server_->client; }

  client::SessionHandle Open(const v1::SessionSpec& spec,
                             absl::Duration idle = absl::ZeroDuration()) {
    auto info = client().CreateSession(spec, idle);
    EXPECT_TRUE(info.ok()) << info.status();
    return client::SessionHandle(&client(), *info);
  }

  void ExpectUnchanged(const std::string& id, const StateSnapshot& before,
                       const std::string& what) {
    auto now = Snapshot(client(), id);
    ASSERT_TRUE(now.ok()) << now.status();
    EXPECT_EQ(*now, before) << what;
  }

  // attention_requests_total{method, code} as the server exports it.
  double RequestCount(const std::string& method, const std::string& code) {
    const std::string text = server_->server->metrics().TextExposition();
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      if (!absl::StartsWith(line, "attention_requests_total{") ||
          !absl::StrContains(line, "method=\"" + method + "\"") ||
          !absl::StrContains(line, "code=\"" + code + "\"")) {
        continue;
      }
      double value = 0;
      if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value)) {
        return value;
      }
    }
    return 0;
  }

  // Pages through ListSessions with `page_size`; returns each page's size
  // and appends the listed ids to `ids`.
  std::vector<int> ListPages(int32_t page_size, std::vector<std::string>* ids) {
    v1::ListSessionsRequest request;
    request.set_page_size(page_size);
    std::vector<int> sizes;
    do {
      grpc::ClientContext context;
      v1::ListSessionsResponse page;
      const grpc::Status status =
          client().stub()->ListSessions(&context, request, &page);
      EXPECT_TRUE(status.ok()) << status.error_message();
      if (!status.ok()) break;
      sizes.push_back(page.sessions_size());
      for (const auto& s : page.sessions()) ids->push_back(s.session_id());
      request.set_page_token(page.next_page_token());
    } while (!request.page_token().empty() && sizes.size() < 100);
    return sizes;
  }

  // Waits (bounded, 5 s) until the server has ended a call of `method`
  // with `code`, if it started one: on a slow machine (sanitizers) a large
  // upload can outlast a short deadline, and gRPC then never starts the
  // call. Either way the call applies nothing.
  void AwaitEndedIfStarted(const std::string& method, const std::string& code) {
    for (int i = 0; i < 100 && RequestCount(method, code) < 1; ++i) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_LE(RequestCount(method, code), 1) << method << " " << code;
  }

  // Waits (bounded) until the server has recorded a call with `code`.
  void AwaitRecorded(const std::string& method, const std::string& code) {
    for (int i = 0; i < 600 && RequestCount(method, code) < 1; ++i) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_EQ(RequestCount(method, code), 1) << method << " " << code;
  }

  // The idle deadline (unix ms) an export of session `id` carries.
  int64_t IdleDeadlineMs(const std::string& id) {
    auto exported = server_->server->engine().ExportSession(id);
    EXPECT_TRUE(exported.ok()) << exported.status();
    return exported.ok() ? (*exported)->header().idle_deadline_unix_ms : -1;
  }

  // Sends `bytes` as the request of unary `method` of the service: it must
  // be INVALID_ARGUMENT with `message_part` in its message, and counted as
  // the handler would have counted it (when the call ends, which may be
  // just after the client has its status).
  void ExpectRefusedUnparsed(const std::string& method,
                             const std::string& bytes,
                             const std::string& message_part) {
    auto channel =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->server->port()),
                            grpc::InsecureChannelCredentials());
    const grpc::Status status = RawUnaryCall(
        channel, "/attention.v1.AttentionService/" + method, bytes);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << method << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(message_part), std::string::npos)
        << status.error_message();
    AwaitRecorded(method, "INVALID_ARGUMENT");
  }

  std::unique_ptr<TestServer> server_;
};

// Row 1: a 4 MB request whose result would be 2.1 GB once aborted the
// server after 29 s of work.
TEST_F(RobustnessTest, RepliesTooLargeForAMessageAreRefusedUpFront) {
  Start();
  v1::AttentionRequest request;
  auto tensor = [](v1::Tensor* t, std::vector<int64_t> shape) {
    t->set_dtype(v1::DTYPE_FLOAT32);
    int64_t n = 1;
    for (int64_t d : shape) {
      t->add_shape(d);
      n *= d;
    }
    t->mutable_data()->assign(static_cast<size_t>(n) * 4, '\0');
  };
  tensor(request.mutable_q(), {520, 1, 1});
  tensor(request.mutable_k(), {1, 1, 1});
  tensor(request.mutable_v(), {1, 1, 1048576});
  auto result = client().Attention(request);
  ATTN_EXPECT_CODE(result, StatusCode::kResourceExhausted);
  EXPECT_NE(result.status().message().find("--max_message_bytes"),
            std::string::npos)
      << result.status();

  // The same through a session: H = 1024, value_dim = 1000, T = 520.
  v1::SessionSpec spec = MakeSpec(1, 1024, 1, 1);
  spec.set_value_dim(1000);
  client::SessionHandle session = Open(spec);
  auto before = Snapshot(client(), session.id());
  ATTN_ASSERT_OK(before);
  const Tokens tokens = RandomTokens(session.spec(), 520, 1);
  ATTN_EXPECT_CODE(session.Prefill(0, tokens.q, tokens.k, tokens.v),
                   StatusCode::kResourceExhausted);
  ExpectUnchanged(session.id(), *before, "prefill with a 2 GB reply");
  ATTN_EXPECT_OK(client().GetServerInfo());
}

// Row 1 (labels) and row 6: metadata is bounded and accounted.
TEST_F(RobustnessTest, SessionMetadataIsBoundedAndCounted) {
  server::ServerOptions options = TestServerOptions();
  options.max_session_metadata_bytes = 13 << 20;
  options.max_message_bytes = 6 << 20;
  Start(options);
  v1::SessionSpec label = MakeSpec(1, 2, 1, 4);
  label.set_model(std::string(1000, 'm'));
  ATTN_EXPECT_CODE(client().CreateSession(label),
                   StatusCode::kInvalidArgument);

  // 1024 layers x 1024 learned sink logits: 4 MiB of metadata each.
  v1::SessionSpec heavy = MakeSpec(1024, 1024, 1, 1);
  v1::LayerSpec* layer = heavy.add_layers();
  for (int h = 0; h < 1024; ++h) layer->add_sink_logits(0.25f);
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) {
    auto info = client().CreateSession(heavy);
    ATTN_ASSERT_OK(info);
    EXPECT_GE(info->metadata_bytes(), 4 << 20);
    ids.push_back(info->session_id());
  }
  auto refused = client().CreateSession(heavy);
  ATTN_EXPECT_CODE(refused, StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("--max_session_metadata_bytes"),
            std::string::npos)
      << refused.status();
  auto info = client().GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_GE(info->session_metadata_bytes(), 12 << 20);
  EXPECT_EQ(info->max_session_metadata_bytes(), 13 << 20);
  EXPECT_EQ(info->kv_cache_used_bytes(), 0);

  // Each SessionInfo is over 4 MiB; a page stops before the reply would
  // pass the 6 MiB message limit, and the pages still list every session.
  std::vector<std::string> listed;
  EXPECT_EQ(ListPages(0, &listed), (std::vector<int>{1, 1, 1}));
  EXPECT_EQ(std::set<std::string>(listed.begin(), listed.end()),
            std::set<std::string>(ids.begin(), ids.end()));

  for (const std::string& id : ids) ATTN_ASSERT_OK(client().DeleteSession(id));
  info = client().GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->session_metadata_bytes(), 0);
  EXPECT_EQ(info->active_sessions(), 0);
}

// A page ends early when the sessions' metadata (block tables and caches
// included) passes about a reply's worth, but the last page carries no
// next_page_token, also when its last session is the one that passed it.
TEST_F(RobustnessTest, TheLastPageOfHeavySessionsHasNoToken) {
  server::ServerOptions options = TestServerOptions();
  options.max_message_bytes = 64 << 10;
  Start(options);
  // 1024 layers: about 190 KiB of metadata, a 3 KiB SessionInfo.
  v1::SessionSpec heavy = MakeSpec(1024, 1, 1, 16);
  heavy.set_max_tokens(1);
  std::vector<std::string> ids;
  std::vector<std::string> listed;
  for (int i = 0; i < 3; ++i) {
    auto info = client().CreateSession(heavy);
    ATTN_ASSERT_OK(info);
    EXPECT_GT(info->metadata_bytes(), 64 << 10);
    ids.push_back(info->session_id());
    listed.clear();
    EXPECT_EQ(ListPages(0, &listed), std::vector<int>(ids.size(), 1));
  }
  EXPECT_EQ(std::set<std::string>(listed.begin(), listed.end()),
            std::set<std::string>(ids.begin(), ids.end()));
}

TEST_F(RobustnessTest, SessionCountIsBoundedAndListingIsPaginated) {
  server::ServerOptions options = TestServerOptions();
  options.max_sessions = 250;
  Start(options);
  std::set<std::string> created;
  for (int i = 0; i < 250; ++i) {
    auto info = client().CreateSession(MakeSpec(1, 2, 1, 4));
    ATTN_ASSERT_OK(info);
    created.insert(info->session_id());
  }
  ATTN_EXPECT_CODE(client().CreateSession(MakeSpec(1, 2, 1, 4)),
                   StatusCode::kResourceExhausted);
  // Default pages of 100, in id order.
  std::vector<std::string> listed;
  const std::vector<int> sizes = ListPages(0, &listed);
  EXPECT_EQ(sizes, (std::vector<int>{100, 100, 50}));
  EXPECT_EQ(listed, std::vector<std::string>(created.begin(), created.end()));
  // The client library follows the pages.
  auto all = client().ListSessions();
  ATTN_ASSERT_OK(all);
  EXPECT_EQ(all->size(), 250u);
  // A page size above the server's maximum is capped; bad ones refused.
  listed.clear();
  EXPECT_EQ(ListPages(5000, &listed), (std::vector<int>{250}));
  v1::ListSessionsRequest request;
  request.set_page_size(-1);
  grpc::ClientContext bad_context;
  v1::ListSessionsResponse ignored;
  EXPECT_EQ(
      client().stub()->ListSessions(&bad_context, request, &ignored).error_code(),
      grpc::StatusCode::INVALID_ARGUMENT);
}

// Row 3: a reply over the message limit once failed only after appending:
// the retry then duplicated the context.
TEST_F(RobustnessTest, AReplyOverTheLimitAppliesNothingAndTheRetryOnce) {
  server::ServerOptions options = TestServerOptions();
  options.max_message_bytes = 256 << 10;
  options.kv_block_bytes = 64 << 10;
  Start(options);
  client::SessionHandle session =
      Open(MakeSpec(128, 8, 2, 64, {}, v1::DTYPE_FLOAT16));
  auto before = Snapshot(client(), session.id());
  ATTN_ASSERT_OK(before);
  const Tokens tokens = RandomTokens(session.spec(), 128, 2);
  client::StepOptions fp16_in;
  fp16_in.input_dtype = v1::DTYPE_FLOAT16;
  // Float32 output: 128 x 8 x 64 x 4 = 256 KiB + framing.
  ATTN_EXPECT_CODE(session.Prefill(0, tokens.q, tokens.k, tokens.v, fp16_in),
                   StatusCode::kResourceExhausted);
  ExpectUnchanged(session.id(), *before, "prefill with a reply too large");
  client::StepOptions fp16_out = fp16_in;
  fp16_out.output_dtype = v1::DTYPE_FLOAT16;
  ATTN_ASSERT_OK(session.Prefill(0, tokens.q, tokens.k, tokens.v, fp16_out));
  auto info = session.Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 128);

  // BatchDecode: 128 steps of 2 KiB results each pass the limit together.
  before = Snapshot(client(), session.id());
  ATTN_ASSERT_OK(before);
  const Tokens step = RandomTokens(session.spec(), 1, 3);
  v1::BatchDecodeRequest batch;
  for (int layer = 1; layer < 128; ++layer) {
    auto request =
        session.MakeDecodeRequest(layer, step.q, step.k, step.v, fp16_in);
    ATTN_ASSERT_OK(request);
    *batch.add_steps() = *request;
  }
  ATTN_EXPECT_CODE(client().BatchDecode(batch),
                   StatusCode::kResourceExhausted);
  ExpectUnchanged(session.id(), *before, "batch with a reply too large");
  for (auto& s : *batch.mutable_steps()) {
    s.set_output_dtype(v1::DTYPE_FLOAT16);
  }
  ATTN_ASSERT_OK(client().BatchDecode(batch));

  // DecodeStep and the Decode stream: one step's output alone is too large
  // (64 heads x 1024 values x 4 bytes).
  v1::SessionSpec wide = MakeSpec(1, 64, 1, 16);
  wide.set_value_dim(1024);
  client::SessionHandle wide_session = Open(wide);
  auto wide_before = Snapshot(client(), wide_session.id());
  ATTN_ASSERT_OK(wide_before);
  const Tokens one = RandomTokens(wide_session.spec(), 1, 4);
  ATTN_EXPECT_CODE(wide_session.DecodeStep(0, one.q, one.k, one.v),
                   StatusCode::kResourceExhausted);
  auto request = wide_session.MakeDecodeRequest(0, one.q, one.k, one.v);
  ATTN_ASSERT_OK(request);
  client::DecodeStream stream(client().stub());
  ATTN_EXPECT_CODE(stream.Step(*request), StatusCode::kResourceExhausted);
  ExpectUnchanged(wide_session.id(), *wide_before, "decode, reply too large");
}

// Row 1 again: a reply is sized from the session's shapes, not guessed from
// the request's. A shared-latent (MLA) prefill sends no v: its output was
// once counted head_dim (576) wide instead of value_dim (512) and refused
// up to 12.5 % under the limit; and a request that does not fit its session
// was refused as too large instead of INVALID_ARGUMENT.
TEST_F(RobustnessTest, AReplyIsSizedFromTheSessionsShapes) {
  server::ServerOptions options = TestServerOptions();
  options.max_message_bytes = 1100000;
  Start(options);
  v1::SessionSpec spec = MakeSpec(1, 16, 1, 576, {}, v1::DTYPE_FLOAT16);
  spec.set_value_dim(512);
  spec.set_kv_layout(v1::KV_LAYOUT_SHARED_LATENT);
  spec.set_scale(1.0f / std::sqrt(192.0f));  // DeepSeek-V3's 128 + 64
  client::SessionHandle session = Open(spec);
  auto before = Snapshot(client(), session.id());
  ATTN_ASSERT_OK(before);
  const Tokens tokens = RandomTokens(session.spec(), 34, 6);
  client::StepOptions fp16_in;  // float32 output
  fp16_in.input_dtype = v1::DTYPE_FLOAT16;
  // 34 x 16 x 512 x 4 bytes = 1114112: over.
  ATTN_EXPECT_CODE(session.Prefill(0, tokens.q_rows(0, 34),
                                   tokens.k_rows(0, 34), {}, fp16_in),
                   StatusCode::kResourceExhausted);
  ExpectUnchanged(session.id(), *before, "latent prefill, reply too large");
  // q with 24 heads where the session has 16: it does not fit the session.
  auto malformed = session.MakePrefillRequest(
      0, tokens.q_rows(0, 34), tokens.k_rows(0, 34), {}, fp16_in);
  ATTN_ASSERT_OK(malformed);
  malformed->mutable_q()->set_shape(1, 24);
  malformed->mutable_q()->mutable_data()->assign(34 * 24 * 576 * 2, '\0');
  ATTN_EXPECT_CODE(client().Prefill(*malformed), StatusCode::kInvalidArgument);
  ExpectUnchanged(session.id(), *before, "latent prefill, 24 heads");
  // 33 x 16 x 512 x 4 bytes = 1081344: fits (576 wide it would not).
  ATTN_ASSERT_OK(session.Prefill(0, tokens.q_rows(0, 33), tokens.k_rows(0, 33),
                                 {}, fp16_in));
  auto info = session.Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 33);
}

// Row 4: an abandoned call once kept both cores busy, was applied, and was
// counted as OK.
TEST_F(RobustnessTest, ExpiredAndCancelledCallsStopAndApplyNothing) {
  Start();
  client::SessionHandle session =
      Open(MakeSpec(1, 32, 4, 128, {}, v1::DTYPE_FLOAT16));
  auto before = Snapshot(client(), session.id());
  ATTN_ASSERT_OK(before);
  // About 1.4e11 flops: about a second of CPU work or more.
  const Tokens tokens = RandomTokens(session.spec(), 4096, 5);
  client::StepOptions fp16;
  fp16.input_dtype = v1::DTYPE_FLOAT16;
  fp16.output_dtype = v1::DTYPE_FLOAT16;
  auto request =
      session.MakePrefillRequest(0, tokens.q, tokens.k, tokens.v, fp16);
  ATTN_ASSERT_OK(request);
  {
    grpc::ClientContext context;
    // Far shorter than the work, however fast the kernels get.
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(250));
    v1::AttentionResult result;
    const grpc::Status status =
        client().stub()->Prefill(&context, *request, &result);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  AwaitEndedIfStarted("Prefill", "DEADLINE_EXCEEDED");
  EXPECT_EQ(RequestCount("Prefill", "OK"), 0);
  ExpectUnchanged(session.id(), *before, "prefill past its deadline");
  ASSERT_TRUE(
      Eventually([&] { return server_->server->calls_in_flight() == 0; },
                 absl::Seconds(30)));
  {
    // Cancelled once the server holds the whole request and computes: the
    // server must stop it and record it.
    grpc::ClientContext context;
    std::thread canceller([&] {
      for (int i = 0; i < 12000 && server_->server->calls_in_flight() == 0;
           ++i) {
        absl::SleepFor(absl::Milliseconds(5));
      }
      context.TryCancel();
    });
    v1::AttentionResult result;
    const grpc::Status status =
        client().stub()->Prefill(&context, *request, &result);
    canceller.join();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
  }
  AwaitRecorded("Prefill", "CANCELLED");
  EXPECT_EQ(RequestCount("Prefill", "OK"), 0);
  ExpectUnchanged(session.id(), *before, "cancelled prefill");
}

TEST_F(RobustnessTest, CallsOverTheFlopLimitAreRefused) {
  server::ServerOptions options = TestServerOptions();
  options.max_call_flops = 1000000;
  Start(options);
  client::SessionHandle session = Open(MakeSpec(1, 4, 2, 16));
  auto before = Snapshot(client(), session.id());
  ATTN_ASSERT_OK(before);
  // 4 heads x 2 x 32 flops per pair: 1e6 flops is about 3900 pairs.
  const Tokens tokens = RandomTokens(session.spec(), 100, 6);
  auto result = session.Prefill(0, tokens.q, tokens.k, tokens.v);
  ATTN_EXPECT_CODE(result, StatusCode::kResourceExhausted);
  EXPECT_NE(result.status().message().find("--max_call_flops"),
            std::string::npos);
  ExpectUnchanged(session.id(), *before, "prefill over the flop limit");
  auto info = client().GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->max_call_flops(), 1000000);
}

// Row 5: a session once expired during its own call, and an open but
// quiet Decode stream did not keep it alive.
TEST_F(RobustnessTest, SessionsUsedByAnOpenStreamDoNotExpire) {
  server::ServerOptions options = TestServerOptions();
  options.session_reap_interval = absl::Milliseconds(50);
  Start(options);
  client::SessionHandle session =
      Open(MakeSpec(1, 4, 2, 16), absl::Seconds(1));
  const Tokens tokens = RandomTokens(session.spec(), 2, 7);
  client::DecodeStream stream(client().stub());
  auto first = session.MakeDecodeRequest(0, tokens.q_rows(0, 1),
                                         tokens.k_rows(0, 1),
                                         tokens.v_rows(0, 1));
  ATTN_ASSERT_OK(first);
  ATTN_ASSERT_OK(stream.Step(*first));
  absl::SleepFor(absl::Milliseconds(2200));  // twice the idle timeout
  auto second = session.MakeDecodeRequest(0, tokens.q_rows(1, 1),
                                          tokens.k_rows(1, 1),
                                          tokens.v_rows(1, 1));
  ATTN_ASSERT_OK(second);
  auto result = stream.Step(*second);
  ATTN_ASSERT_OK(result);
  EXPECT_EQ(result->position(), 1);
  ATTN_ASSERT_OK(stream.Finish());
  // Once the stream has closed, idle time counts again (from its end: any
  // call, GetSession too, would restart it, so look only once).
  absl::SleepFor(absl::Milliseconds(1600));
  EXPECT_EQ(session.Info().status().code(), StatusCode::kNotFound);
}

// A session deleted and imported again under its id (keep_session_id)
// while a stream that used it stays open is held by that stream again: it
// does not expire under the stream (the stream's hold on the old session
// was keeping nothing alive).
TEST_F(RobustnessTest, AStreamHoldsASessionRecreatedUnderAnIdItUsed) {
  server::ServerOptions options = TestServerOptions();
  options.session_reap_interval = absl::Milliseconds(50);
  Start(options);
  client::SessionHandle session = Open(MakeSpec(1, 4, 2, 16), absl::Seconds(1));
  const Tokens tokens = RandomTokens(session.spec(), 3, 8);
  const auto step = [&](int64_t t) {
    auto request = session.MakeDecodeRequest(
        0, tokens.q_rows(t, 1), tokens.k_rows(t, 1), tokens.v_rows(t, 1));
    EXPECT_TRUE(request.ok()) << request.status();
    return request.ok() ? *request : v1::DecodeRequest();
  };
  client::DecodeStream stream(client().stub());
  ATTN_ASSERT_OK(stream.Step(step(0)));
  std::vector<v1::SessionChunk> records;
  ATTN_ASSERT_OK(
      client().ExportSession(session.id(), [&](const v1::SessionChunk& record) {
        records.push_back(record);
        return absl::OkStatus();
      }));
  ATTN_ASSERT_OK(client().DeleteSession(session.id()));
  size_t next = 0;
  auto imported = client().ImportSession(
      [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
        if (next == records.size()) return false;
        *record = records[next++];
        return true;
      },
      /*keep_session_id=*/true);
  ATTN_ASSERT_OK(imported);
  ASSERT_EQ(imported->session_id(), session.id());
  auto second = stream.Step(step(1));
  ATTN_ASSERT_OK(second);
  EXPECT_EQ(second->position(), 1);
  absl::SleepFor(absl::Milliseconds(2200));  // twice the idle timeout
  auto third = stream.Step(step(2));
  ATTN_ASSERT_OK(third);
  EXPECT_EQ(third->position(), 2);
  ATTN_ASSERT_OK(stream.Finish());
}

// Decode steps on a session being handed over (sealed) answer at once,
// UNAVAILABLE with `attention-session-moving`, and change nothing; steps
// on other sessions keep being served meanwhile (the batcher that runs
// them all waited for the move before). Unsealed, the session is as it was.
TEST_F(RobustnessTest, StepsOnASessionBeingMovedAnswerAtOnce) {
  Start();
  client::SessionHandle moving = Open(MakeSpec(1, 4, 2, 16));
  client::SessionHandle staying = Open(MakeSpec(1, 4, 2, 16));
  const Tokens tokens = RandomTokens(moving.spec(), 2, 11);
  const auto step = [&](client::SessionHandle& session, int64_t t) {
    auto request = session.MakeDecodeRequest(
        0, tokens.q_rows(t, 1), tokens.k_rows(t, 1), tokens.v_rows(t, 1));
    EXPECT_TRUE(request.ok()) << request.status();
    return request.ok() ? *request : v1::DecodeRequest();
  };
  ATTN_ASSERT_OK(client().DecodeStep(step(moving, 0)));
  {
    auto seal = server_->server->engine().SealSession(
        moving.id(), absl::Now() + absl::Seconds(5));
    ATTN_ASSERT_OK(seal);
    const auto expect_moving = [](const absl::Status& status) {
      EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status;
      EXPECT_TRUE(client::IsSessionMoving(status)) << status;
    };
    expect_moving(client().DecodeStep(step(moving, 1)).status());
    v1::BatchDecodeRequest batch;
    *batch.add_steps() = step(staying, 0);
    *batch.add_steps() = step(moving, 1);
    expect_moving(client().BatchDecode(batch).status());
    client::DecodeStream stream(client().stub());
    expect_moving(stream.Step(step(moving, 1)).status());
    expect_moving(stream.Finish());
    auto other = client().DecodeStep(step(staying, 0));
    ATTN_ASSERT_OK(other);
    EXPECT_EQ(other->position(), 0);
  }  // unsealed: the move failed
  auto info = moving.Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 1);
  auto next = client().DecodeStep(step(moving, 1));
  ATTN_ASSERT_OK(next);
  EXPECT_EQ(next->position(), 1);
}

// A lookup of a session being handed over waits for the move to end, but
// no longer than its call: GetSession, ForkSession and TruncateSession
// past their deadline leave their handler threads at once, while the seal
// still holds (a hand-over of a large session takes seconds).
TEST_F(RobustnessTest, LookupsOfASessionBeingMovedEndWithTheirCall) {
  Start();
  client::SessionHandle moving = Open(MakeSpec(1, 4, 2, 16));
  auto sealed = server_->server->engine().SealSession(
      moving.id(), absl::Now() + absl::Seconds(60));
  ATTN_ASSERT_OK(sealed);
  std::optional<SessionSeal> seal(*std::move(sealed));
  const auto deadline = [] {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::milliseconds(300));
    return context;
  };
  v1::SessionInfo reply;
  v1::GetSessionRequest get;
  get.set_session_id(moving.id());
  EXPECT_EQ(
      client().stub()->GetSession(deadline().get(), get, &reply).error_code(),
      grpc::StatusCode::DEADLINE_EXCEEDED);
  v1::ForkSessionRequest fork;
  fork.set_session_id(moving.id());
  EXPECT_EQ(
      client().stub()->ForkSession(deadline().get(), fork, &reply).error_code(),
      grpc::StatusCode::DEADLINE_EXCEEDED);
  v1::TruncateSessionRequest truncate;
  truncate.set_session_id(moving.id());
  EXPECT_EQ(client()
                .stub()
                ->TruncateSession(deadline().get(), truncate, &reply)
                .error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  // The handlers ended with their calls, while the seal still holds.
  EXPECT_TRUE(
      Eventually([&] { return server_->server->calls_in_flight() == 0; },
                 absl::Seconds(5)));
  seal.reset();
  // Unsealed (the move failed): the session is as it was.
  auto info = moving.Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 0);
}

// A BatchDecode's step count is bounded before anything is sized from it:
// 65537 empty steps (2 bytes each on the wire) are refused for their
// number, 65536 get as far as the first step's own error.
TEST_F(RobustnessTest, BatchDecodeStepsAreBoundedUpFront) {
  Start();
  v1::BatchDecodeRequest batch;
  for (int i = 0; i < 65537; ++i) batch.add_steps();
  auto refused = client().BatchDecode(batch);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("at most 65536"), std::string::npos)
      << refused.status();
  batch.mutable_steps()->RemoveLast();
  auto first_step = client().BatchDecode(batch);
  EXPECT_EQ(first_step.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(first_step.status().message().find("steps[0]"), std::string::npos)
      << first_step.status();
}

// A stream whose only step on a session failed changes nothing there, the
// idle clock included: its end leaves the deadline as it was.
TEST_F(RobustnessTest, AStreamThatOnlyFailedOnASessionLeavesItsIdleClock) {
  Start();
  client::SessionHandle session =
      Open(MakeSpec(1, 4, 2, 16), absl::Seconds(60));
  const int64_t before = IdleDeadlineMs(session.id());
  absl::SleepFor(absl::Milliseconds(20));  // a later clock would show
  const Tokens tokens = RandomTokens(session.spec(), 1, 9);
  auto step = session.MakeDecodeRequest(
      0, tokens.q_rows(0, 1), tokens.k_rows(0, 1), tokens.v_rows(0, 1));
  ATTN_ASSERT_OK(step);
  step->set_layer(3);  // no such layer
  client::DecodeStream stream(client().stub());
  EXPECT_FALSE(stream.Step(*step).ok());
  EXPECT_EQ(stream.Finish().code(), StatusCode::kInvalidArgument);
  // The server lets the stream's sessions go once the stream is done there.
  ASSERT_TRUE(Eventually(
      [&] {
        return absl::StrContains(server_->server->metrics().TextExposition(),
                                 "attention_streams_active 0");
      },
      absl::Seconds(20)));
  EXPECT_EQ(IdleDeadlineMs(session.id()), before);
}

// Failed Truncate and Fork calls leave the idle clock as it was: their
// size check used to look the session up as a use of it.
TEST_F(RobustnessTest, FailedTruncateAndForkLeaveTheIdleClock) {
  server::ServerOptions options = TestServerOptions();
  options.max_sessions = 1;  // every fork is refused
  Start(options);
  client::SessionHandle session =
      Open(MakeSpec(1, 4, 2, 16), absl::Seconds(60));
  const int64_t before = IdleDeadlineMs(session.id());
  absl::SleepFor(absl::Milliseconds(20));  // a later clock would show
  ATTN_EXPECT_CODE(client().TruncateSession(session.id(), -1),
                   StatusCode::kInvalidArgument);
  ATTN_EXPECT_CODE(client().ForkSession(session.id()),
                   StatusCode::kResourceExhausted);
  EXPECT_EQ(IdleDeadlineMs(session.id()), before);
  // A call that succeeds does restart it.
  ATTN_ASSERT_OK(client().TruncateSession(session.id(), 0));
  EXPECT_GT(IdleDeadlineMs(session.id()), before);
}

// Row 7: an 8000-character id was echoed whole into the error, which the
// client then could not receive.
TEST_F(RobustnessTest, ErrorsQuoteOnlyAShortPrefixOfClientStrings) {
  Start();
  const std::string id(8000, 'z');
  auto missing = client().GetSession(id);
  ATTN_EXPECT_CODE(missing, StatusCode::kNotFound);
  EXPECT_LT(missing.status().message().size(), 300u);
  EXPECT_NE(missing.status().message().find("zzzz"), std::string::npos);
  ATTN_EXPECT_CODE(client().DeleteSession(id), StatusCode::kNotFound);
  ATTN_EXPECT_CODE(client().TruncateSession(id, 0), StatusCode::kNotFound);
  v1::ListSessionsRequest request;
  request.set_page_token(id);
  grpc::ClientContext context;
  v1::ListSessionsResponse page;
  const grpc::Status status =
      client().stub()->ListSessions(&context, request, &page);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(status.error_message().size(), 300u);
}

// Row 8: bytes that are not a message were INTERNAL with no message.
TEST_F(RobustnessTest, UnparseableRequestsAreInvalidArgument) {
  Start();
  const std::string garbage = "\xff\xff\xff\xff\x0f";
  for (const char* method : {"Prefill", "GetSession"}) {
    ExpectRefusedUnparsed(method, garbage, "not a valid protobuf");
  }
  ATTN_EXPECT_OK(client().GetServerInfo());
}

// A Decode stream's request whose bytes do not parse (here a proto3 string
// of invalid UTF-8) ended the stream as its client's half-close does, with
// OK: gRPC ends the reads the same way for both. It now fails the stream as
// a bad request does, naming it; the step before it stays applied, the one
// after it is not.
TEST_F(RobustnessTest, AStreamedRequestThatDoesNotParseEndsItsStream) {
  Start();
  client::SessionHandle session = Open(MakeSpec(1, 2, 1, 8), absl::Seconds(60));
  const Tokens tokens = RandomTokens(session.spec(), 3, 9);
  const auto step = [&](int64_t t) {
    return *session.MakeDecodeRequest(0, tokens.q_rows(t, 1),
                                      tokens.k_rows(t, 1), tokens.v_rows(t, 1));
  };
  v1::DecodeRequest unparsable = step(1);
  unparsable.set_session_id("\xff\xfe");
  grpc::ClientContext context;
  auto stream = client().stub()->Decode(&context);
  ASSERT_TRUE(stream->Write(step(0)));
  v1::AttentionResult result;
  ASSERT_TRUE(stream->Read(&result));
  ASSERT_TRUE(stream->Write(unparsable));
  stream->Write(step(1));
  stream->WritesDone();
  EXPECT_FALSE(stream->Read(&result));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << status.error_message();
  EXPECT_TRUE(absl::StartsWith(
      status.error_message(),
      "requests[1]: the request bytes are not a valid protobuf message for "
      "/attention.v1.AttentionService/Decode"))
      << status.error_message();
  AwaitRecorded("Decode", "INVALID_ARGUMENT");
  auto info = session.Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 1);

  // As the first request, and after unary requests that did not parse: a
  // clean end stays OK.
  grpc::ClientContext first_context;
  auto first = client().stub()->Decode(&first_context);
  ASSERT_TRUE(first->Write(unparsable));
  first->WritesDone();
  EXPECT_FALSE(first->Read(&result));
  const grpc::Status first_status = first->Finish();
  EXPECT_TRUE(absl::StartsWith(first_status.error_message(), "requests[0]: "))
      << first_status.error_message();
  for (int call = 0; call < 8; ++call) {
    v1::AttentionResult unary;
    grpc::ClientContext unary_context;
    EXPECT_EQ(client()
                  .stub()
                  ->DecodeStep(&unary_context, unparsable, &unary)
                  .error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  for (int t = 1; t < 3; ++t) {
    grpc::ClientContext clean_context;
    auto clean = client().stub()->Decode(&clean_context);
    ASSERT_TRUE(clean->Write(step(t)));
    clean->WritesDone();
    EXPECT_TRUE(clean->Read(&result));
    EXPECT_FALSE(clean->Read(&result));
    const grpc::Status clean_status = clean->Finish();
    EXPECT_TRUE(clean_status.ok()) << clean_status.error_message();
  }
  info = session.Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 3);
}

// 8 MiB of empty BatchDecode steps (or session layers) would have parsed
// into gigabytes of objects; they are refused before they are parsed.
TEST_F(RobustnessTest, RequestsThatWouldParseIntoGigabytesAreRefused) {
  Start();
  std::string empty_entries;
  for (int i = 0; i < (4 << 20); ++i) empty_entries += "\x0a\x00";
  // CreateSession's spec (field 1) holding 4 Mi empty layers (field 8).
  std::string layers;
  for (int i = 0; i < (4 << 20); ++i) layers += "\x42\x00";
  std::string spec = "\x0a";
  for (uint64_t n = layers.size(); n != 0; n >>= 7) {
    spec += static_cast<char>((n & 0x7f) | (n >= 0x80 ? 0x80 : 0));
  }
  spec += layers;
  ExpectRefusedUnparsed("BatchDecode", empty_entries,
                        "times their size in memory");
  ExpectRefusedUnparsed("CreateSession", spec, "times their size in memory");
  ATTN_EXPECT_OK(client().GetServerInfo());
}

// gRPC inflates a compressed message whole before it checks the size
// limit: a few MB of gzip once took gigabytes of memory. The
// server takes no compressed request at all.
TEST_F(RobustnessTest, CompressedRequestsAreRefusedFromTheirHeaders) {
  Start();
  v1::AttentionRequest request;
  request.mutable_q()->set_dtype(v1::DTYPE_FLOAT32);
  request.mutable_q()->add_shape(1);
  request.mutable_q()->add_shape(1);
  request.mutable_q()->add_shape(int64_t{8} << 20);
  request.mutable_q()->set_data(std::string(size_t{32} << 20, '\0'));
  for (grpc_compression_algorithm algorithm :
       {GRPC_COMPRESS_GZIP, GRPC_COMPRESS_DEFLATE}) {
    grpc::ClientContext context;
    context.set_compression_algorithm(algorithm);
    v1::AttentionResult result;
    const grpc::Status status =
        client().stub()->Attention(&context, request, &result);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED)
        << status.error_message();
  }
  ATTN_EXPECT_OK(client().GetServerInfo());
}

// The synchronous RPCs take one thread each while they run; past
// max_rpc_threads they are refused, and the callback RPCs (the decode
// path) run on.
TEST_F(RobustnessTest, SynchronousCallsTakeAtMostMaxRpcThreads) {
  server::ServerOptions options = TestServerOptions();
  options.max_rpc_threads = 16;
  options.transfer_stall_timeout = absl::Seconds(10);
  Start(options);
  client::SessionHandle session = Open(MakeSpec(1, 2, 1, 8));
  const Tokens tokens = RandomTokens(session.spec(), 1, 3);
  // Imports that send nothing: each holds a thread until the stall
  // timeout ends it.
  constexpr int kCalls = 60;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientWriter<v1::SessionChunk>>> writers;
  std::vector<v1::SessionInfo> replies(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() +
                                  std::chrono::seconds(60));
    writers.push_back(
        client().stub()->ImportSession(contexts.back().get(), &replies[i]));
  }
  ATTN_EXPECT_OK(session.DecodeStep(0, tokens.q_rows(0, 1), tokens.k_rows(0, 1),
                                    tokens.v_rows(0, 1)));
  int refused = 0;
  int stalled = 0;
  for (auto& writer : writers) {
    const grpc::Status status = writer->Finish();
    if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
      // Overloaded, which callers retry (not gRPC's RESOURCE_EXHAUSTED).
      EXPECT_TRUE(absl::StrContains(status.error_message(), "overloaded"))
          << status.error_message();
      ++refused;
    } else if (status.error_code() == grpc::StatusCode::CANCELLED) {
      ++stalled;
    } else {
      ADD_FAILURE() << status.error_code() << " " << status.error_message();
    }
  }
  EXPECT_LE(stalled, options.max_rpc_threads);
  EXPECT_EQ(refused + stalled, kCalls);
  EXPECT_GT(refused, 0);
  ATTN_EXPECT_OK(client().GetServerInfo());
}

// Thread counts a process cannot start are refused before any starts
// (std::thread would throw and abort the process).
TEST(ServerOptionsTest, ThreadCountsOutOfRangeAreRefused) {
  for (int threads : {-1, 1025, 1 << 30}) {
    server::ServerOptions options = TestServerOptions();
    options.threads = threads;
    auto server = StartTestServer(options);
    ATTN_EXPECT_CODE(server, StatusCode::kInvalidArgument);
  }
}

// A tokens-file check or a transfer stall check that often would spin its
// thread (and cancel every transfer that pauses), a --peers naming no
// peer, and a malformed IPv4 metrics address (bound elsewhere): refused.
// 0 checks the tokens file on SIGHUP only.
TEST(ServerOptionsTest, SpinningChecksAndMalformedAddressesAreRefused) {
  for (absl::Duration interval :
       {-absl::Seconds(5), absl::Nanoseconds(1), absl::Milliseconds(9)}) {
    server::ServerOptions options = TestServerOptions();
    options.auth_reload_interval = interval;
    ATTN_EXPECT_CODE(StartTestServer(options), StatusCode::kInvalidArgument);
  }
  for (absl::Duration stall : {absl::Nanoseconds(1), absl::Milliseconds(999)}) {
    server::ServerOptions options = TestServerOptions();
    options.transfer_stall_timeout = stall;
    ATTN_EXPECT_CODE(StartTestServer(options), StatusCode::kInvalidArgument);
  }
  for (const char* peers : {",", " , ,"}) {
    server::ServerOptions options = TestServerOptions();
    options.peers = peers;
    ATTN_EXPECT_CODE(StartTestServer(options), StatusCode::kInvalidArgument);
  }
  for (const char* address : {"999.1.1.1", "1.2.3", "256.0.0.1"}) {
    server::ServerOptions options = TestServerOptions();
    options.metrics_address = address;
    ATTN_EXPECT_CODE(StartTestServer(options), StatusCode::kInvalidArgument);
  }
  server::ServerOptions options = TestServerOptions();
  options.auth_reload_interval = absl::ZeroDuration();
  options.transfer_stall_timeout = absl::Seconds(1);
  ATTN_EXPECT_OK(StartTestServer(options));
}

// A connection age under a second would have every client reconnect
// constantly (and one under a millisecond means no age to gRPC).
TEST(ServerOptionsTest, ConnectionAgesUnderASecondAreRefused) {
  for (absl::Duration age : {absl::Microseconds(500), absl::Milliseconds(999),
                             absl::ZeroDuration(), -absl::Seconds(1)}) {
    server::ServerOptions options = TestServerOptions();
    options.max_connection_age = age;
    auto server = StartTestServer(options);
    ATTN_EXPECT_CODE(server, StatusCode::kInvalidArgument);
  }
  server::ServerOptions options = TestServerOptions();
  options.max_connection_age = absl::InfiniteDuration();
  options.max_connection_age_grace = absl::Seconds(1);
  auto server = StartTestServer(options);
  ATTN_EXPECT_OK(server);
}

}  // namespace
}  // namespace attention::testing
