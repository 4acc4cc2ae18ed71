// The client library against a real in-process server (and a server
// process, to freeze): handles, streams, error translation, timeouts,
// keepalive and message limits.
#include "client/attention_client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/server/server_process.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

// Layer 0's decode request for token t of `tokens`.
v1::DecodeRequest DecodeRequestAt(const client::SessionHandle& session,
                                  const Tokens& tokens, int64_t t) {
  return *session.MakeDecodeRequest(0, tokens.q_rows(t, 1), tokens.k_rows(t, 1),
                                    tokens.v_rows(t, 1));
}

class AttentionClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = StartTestServer();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  client::AttentionClient& client() { return *server_->client; }

  std::unique_ptr<TestServer> server_;
};

TEST_F(AttentionClientTest, SessionHandleRoundTrip) {
  v1::SessionSpec spec = MakeSpec(2, 4, 2, 8);
  spec.set_model("test-model");
  auto session = client().OpenSession(spec, absl::Seconds(30));
  ATTN_ASSERT_OK(session);
  // The handle carries the resolved spec.
  EXPECT_EQ(session->spec().value_dim(), 8);
  EXPECT_GT(session->spec().max_tokens(), 0);
  EXPECT_EQ(session->spec().model(), "test-model");
  EXPECT_EQ(session->value_dim(), 8);

  const Tokens tokens = RandomTokens(session->spec(), 5, 3);
  auto prefill = session->Prefill(1, tokens.q_rows(0, 4), tokens.k_rows(0, 4),
                                  tokens.v_rows(0, 4));
  ATTN_ASSERT_OK(prefill);
  ASSERT_EQ(prefill->output().shape_size(), 3);
  EXPECT_EQ(prefill->output().shape(0), 4);
  EXPECT_EQ(prefill->output().shape(1), 4);
  EXPECT_EQ(prefill->output().shape(2), 8);
  auto step = session->DecodeStep(1, tokens.q_rows(4, 1), tokens.k_rows(4, 1),
                                  tokens.v_rows(4, 1));
  ATTN_ASSERT_OK(step);
  EXPECT_EQ(step->position(), 4);

  auto info = session->Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 0);
  EXPECT_EQ(info->layer_lengths(1), 5);
  auto fork = session->Fork();
  ATTN_ASSERT_OK(fork);
  EXPECT_NE(fork->id(), session->id());
  auto truncated = fork->Truncate(2);
  ATTN_ASSERT_OK(truncated);
  EXPECT_EQ(truncated->layer_lengths(1), 2);
  ATTN_ASSERT_OK(fork->Delete());
  ATTN_EXPECT_CODE(fork->Info(), absl::StatusCode::kNotFound);
  ATTN_ASSERT_OK(session->Delete());
}

TEST_F(AttentionClientTest, HelpersRejectInconsistentSizesLocally) {
  auto session = client().OpenSession(MakeSpec(1, 4, 2, 8));
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 3, 3);
  // q says 3 tokens, k says 2.
  ATTN_EXPECT_CODE(
      session->MakePrefillRequest(0, tokens.q, tokens.k_rows(0, 2), tokens.v),
      absl::StatusCode::kInvalidArgument);
  // A decode step is one token.
  ATTN_EXPECT_CODE(session->MakeDecodeRequest(0, tokens.q, tokens.k, tokens.v),
                   absl::StatusCode::kInvalidArgument);
  ATTN_EXPECT_CODE(session->MakePrefillRequest(0, {}, {}, {}),
                   absl::StatusCode::kInvalidArgument);
  auto info = session->Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 0);
}

// A handle built from a malformed spec (rows of 2^31 - 1 KV heads of
// 2^31 - 1 values) checks sizes without overflowing (UBSan runs this).
TEST_F(AttentionClientTest, HelpersCheckSizesOfAnySpecWithoutOverflow) {
  v1::SessionInfo info;
  info.set_session_id("malformed");
  v1::SessionSpec* spec = info.mutable_spec();
  spec->set_num_layers(1);
  spec->set_num_q_heads(1);
  spec->set_head_dim(1);
  spec->set_num_kv_heads(std::numeric_limits<int32_t>::max());
  spec->set_value_dim(std::numeric_limits<int32_t>::max());
  const client::SessionHandle handle(&client(), info);
  const std::vector<float> three(3, 0.5f);
  ATTN_EXPECT_CODE(handle.MakePrefillRequest(0, three, three, three),
                   absl::StatusCode::kInvalidArgument);
}

TEST_F(AttentionClientTest, DecodeStreamResultsComeInOrder) {
  auto a = client().OpenSession(MakeSpec(1, 2, 1, 8));
  auto b = client().OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(a);
  ATTN_ASSERT_OK(b);
  const Tokens tokens = RandomTokens(a->spec(), 6, 4);
  auto stream = client().OpenDecodeStream();
  // Pipeline: write every request first, then read the results.
  for (int64_t t = 0; t < 3; ++t) {
    ASSERT_TRUE(stream->Write(*a->MakeDecodeRequest(
        0, tokens.q_rows(t, 1), tokens.k_rows(t, 1), tokens.v_rows(t, 1))));
    ASSERT_TRUE(stream->Write(*b->MakeDecodeRequest(
        0, tokens.q_rows(t, 1), tokens.k_rows(t, 1), tokens.v_rows(t, 1))));
  }
  stream->WritesDone();
  for (int64_t t = 0; t < 3; ++t) {
    for (int s = 0; s < 2; ++s) {
      auto result = stream->Read();
      ATTN_ASSERT_OK(result);
      EXPECT_EQ(result->position(), t);
    }
  }
  // After the last result the stream ends cleanly.
  ATTN_EXPECT_CODE(stream->Read(), absl::StatusCode::kOutOfRange);
  ATTN_EXPECT_OK(stream->Finish());
  ATTN_EXPECT_OK(stream->Finish());  // idempotent
}

// Writes only queue (the stream sends them in order on gRPC's threads), so
// replies written before a failing request are still read, then the
// failure; one thread may write while another reads; and a stream dropped
// unfinished is cancelled without waiting for its replies.
TEST_F(AttentionClientTest, DecodeStreamQueuesWritesAndEndsCleanly) {
  auto a = client().OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(a);
  const Tokens tokens = RandomTokens(a->spec(), 64, 5);
  auto step = [&](int64_t t) { return DecodeRequestAt(*a, tokens, t); };
  {
    auto stream = client().OpenDecodeStream();
    v1::DecodeRequest unknown = step(1);
    unknown.set_session_id("no-such-session");
    ASSERT_TRUE(stream->Write(step(0)));
    ASSERT_TRUE(stream->Write(unknown));
    stream->Write(step(1));  // after the failure: never applied
    auto first = stream->Read();
    ATTN_ASSERT_OK(first);
    EXPECT_EQ(first->position(), 0);
    auto failed = stream->Read();
    ASSERT_EQ(failed.status().code(), absl::StatusCode::kNotFound)
        << failed.status();
    EXPECT_NE(failed.status().message().find("requests[1]"), std::string::npos)
        << failed.status();
    EXPECT_EQ(stream->Read().status(), failed.status());
    EXPECT_FALSE(stream->Write(step(1)));
    EXPECT_EQ(stream->Finish(), failed.status());
  }
  auto info = a->Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 1);

  // A writer and a reader thread on one stream.
  constexpr int64_t kSteps = 40;
  auto stream = client().OpenDecodeStream();
  std::thread writer([&] {
    for (int64_t t = 1; t <= kSteps; ++t) ASSERT_TRUE(stream->Write(step(t)));
    stream->WritesDone();
  });
  for (int64_t t = 1; t <= kSteps; ++t) {
    auto result = stream->Read();
    ATTN_ASSERT_OK(result);
    EXPECT_EQ(result->position(), t);
  }
  writer.join();
  ATTN_EXPECT_CODE(stream->Read(), absl::StatusCode::kOutOfRange);
  ATTN_EXPECT_OK(stream->Finish());

  // Dropped with a step queued and nothing read: cancelled, and the server
  // goes on serving.
  auto dropped = client().OpenDecodeStream();
  ASSERT_TRUE(dropped->Write(step(kSteps + 1)));
  dropped.reset();
  info = a->Info();
  ATTN_ASSERT_OK(info);
  const int64_t length = info->layer_lengths(0);
  EXPECT_TRUE(length == kSteps + 1 || length == kSteps + 2) << length;
}

// Bytes the server cannot parse (here a proto3 string of invalid UTF-8):
// the server ends the stream with INVALID_ARGUMENT naming the request, which
// the client reports at the first unanswered request. The steps before it
// were applied, it and those after it were not.
TEST_F(AttentionClientTest, AStreamEndedBeforeItsAnswersNamesTheUnanswered) {
  auto a = client().OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(a);
  const Tokens tokens = RandomTokens(a->spec(), 4, 7);
  auto step = [&](int64_t t) { return DecodeRequestAt(*a, tokens, t); };
  auto stream = client().OpenDecodeStream();
  v1::DecodeRequest unparsable = step(1);
  unparsable.set_session_id("\xff\xfe");
  ATTN_ASSERT_OK(stream->Step(step(0)));
  ASSERT_TRUE(stream->Write(unparsable));
  stream->Write(step(1));  // after it: never applied
  auto failed = stream->Read();
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kInvalidArgument)
      << failed.status();
  EXPECT_TRUE(absl::StartsWith(failed.status().message(),
                               "requests[1]: the request bytes are not a "
                               "valid protobuf message"))
      << failed.status();
  EXPECT_EQ(stream->Read().status(), failed.status());
  EXPECT_EQ(stream->Finish(), failed.status());
  // Finish, with results not read, says so too.
  auto finished = client().OpenDecodeStream();
  ASSERT_TRUE(finished->Write(step(1)));
  ASSERT_TRUE(finished->Write(unparsable));
  const absl::Status status = finished->Finish();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("requests[1]"), std::string::npos) << status;
  auto info = a->Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 2);
}

// Step sends its request without a copy when nothing is queued, and
// queues it behind earlier writes otherwise; either way the replies keep
// the stream's order, and a step after the stream failed gets the failure.
TEST_F(AttentionClientTest, DecodeStreamStepsKeepOrderWithQueuedWrites) {
  auto a = client().OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(a);
  const Tokens tokens = RandomTokens(a->spec(), 8, 6);
  auto step = [&](int64_t t) { return DecodeRequestAt(*a, tokens, t); };
  auto stream = client().OpenDecodeStream();
  for (int64_t t = 0; t < 2; ++t) {
    auto result = stream->Step(step(t));
    ATTN_ASSERT_OK(result);
    EXPECT_EQ(result->position(), t);
  }
  // A queued write, then a step: the step's reply is the second one.
  ASSERT_TRUE(stream->Write(step(2)));
  auto third = stream->Step(step(3));
  ATTN_ASSERT_OK(third);
  EXPECT_EQ(third->position(), 2);
  auto fourth = stream->Read();
  ATTN_ASSERT_OK(fourth);
  EXPECT_EQ(fourth->position(), 3);

  v1::DecodeRequest unknown = step(4);
  unknown.set_session_id("no-such-session");
  auto failed = stream->Step(unknown);
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kNotFound)
      << failed.status();
  EXPECT_EQ(stream->Step(step(4)).status(), failed.status());
  EXPECT_EQ(stream->Finish(), failed.status());
  auto info = a->Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 4);
}

// GetSessionAsync answers as GetSession does, and a client may be
// destroyed as soon as its callback has run: the call's hold on the
// channel is gone by then. (When the call still held it, the channel could
// be destroyed on gRPC's callback thread; ClusterClientTest crashed that
// way in 5 of 18 runs on a loaded machine. This test did not catch it.)
TEST(AttentionClientAsyncTest, GetSessionAsyncAnswersLikeGetSession) {
  auto server = StartTestServer();
  ATTN_ASSERT_OK(server);
  auto session = (*server)->client->OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  const std::string id = session->id();
  (*server)->client.reset();  // the only channel is the one below
  for (int i = 0; i < 50; ++i) {
    auto own =
        client::AttentionClient::Connect((*server)->server->local_target());
    absl::StatusOr<v1::SessionInfo> found, missing;
    absl::BlockingCounter pending(2);
    own->GetSessionAsync(id, [&](absl::StatusOr<v1::SessionInfo> answer) {
      found = std::move(answer);
      pending.DecrementCount();
    });
    own->GetSessionAsync("no-such-session",
                         [&](absl::StatusOr<v1::SessionInfo> answer) {
                           missing = std::move(answer);
                           pending.DecrementCount();
                         });
    pending.Wait();
    own.reset();
    ATTN_ASSERT_OK(found);
    EXPECT_EQ(found->session_id(), id);
    EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound)
        << missing.status();
  }
}

// BatchDecodeAsync answers as BatchDecode does: the same results for the
// same steps, and a failed batch (an unknown session) applies nothing.
TEST_F(AttentionClientTest, BatchDecodeAsyncAnswersLikeBatchDecode) {
  auto a = client().OpenSession(MakeSpec(1, 2, 1, 8));
  auto b = client().OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(a);
  ATTN_ASSERT_OK(b);
  const Tokens tokens = RandomTokens(a->spec(), 4, 7);
  auto batch_of = [&](const client::SessionHandle& session, int64_t t) {
    v1::BatchDecodeRequest batch;
    *batch.add_steps() = DecodeRequestAt(session, tokens, t);
    return batch;
  };
  auto async_batch = [&](v1::BatchDecodeRequest batch) {
    absl::StatusOr<std::vector<v1::AttentionResult>> answer;
    absl::BlockingCounter pending(1);
    client().BatchDecodeAsync(
        std::move(batch),
        [&](absl::StatusOr<std::vector<v1::AttentionResult>> got) {
          answer = std::move(got);
          pending.DecrementCount();
        });
    pending.Wait();
    return answer;
  };
  for (int64_t t = 0; t < 3; ++t) {
    auto sync = client().BatchDecode(batch_of(*a, t));
    auto async = async_batch(batch_of(*b, t));
    ATTN_ASSERT_OK(sync);
    ATTN_ASSERT_OK(async);
    ASSERT_EQ(sync->size(), 1u);
    ASSERT_EQ(async->size(), 1u);
    EXPECT_EQ((*async)[0].position(), t);
    ASSERT_FALSE((*sync)[0].output().data().empty());
    EXPECT_EQ((*async)[0].output().data(), (*sync)[0].output().data());
  }
  v1::BatchDecodeRequest failing = batch_of(*b, 3);
  *failing.add_steps() = DecodeRequestAt(*b, tokens, 3);
  failing.mutable_steps(1)->set_session_id("no-such-session");
  auto failed = async_batch(std::move(failing));
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kNotFound)
      << failed.status();
  auto info = b->Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 3);
}

TEST_F(AttentionClientTest, HealthAndInfo) {
  ATTN_ASSERT_OK(client().WaitForConnected(absl::Seconds(30)));
  auto health = client().CheckHealth();
  ATTN_ASSERT_OK(health);
  EXPECT_EQ(*health, client::ServingStatus::kServing);
  auto info = client().GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->backend(), "cpu");

  // The same answers without blocking; an unknown service is named so.
  absl::StatusOr<client::ServingStatus> async_health, unknown_service;
  absl::StatusOr<v1::ServerInfo> async_info;
  absl::BlockingCounter pending(3);
  client().CheckHealthAsync("", [&](absl::StatusOr<client::ServingStatus> got) {
    async_health = std::move(got);
    pending.DecrementCount();
  });
  client().CheckHealthAsync("no.such.Service",
                            [&](absl::StatusOr<client::ServingStatus> got) {
                              unknown_service = std::move(got);
                              pending.DecrementCount();
                            });
  client().GetServerInfoAsync([&](absl::StatusOr<v1::ServerInfo> got) {
    async_info = std::move(got);
    pending.DecrementCount();
  });
  pending.Wait();
  ATTN_ASSERT_OK(async_health);
  EXPECT_EQ(*async_health, client::ServingStatus::kServing);
  ATTN_ASSERT_OK(async_info);
  EXPECT_EQ(async_info->backend(), "cpu");
  EXPECT_EQ(async_info->version(), info->version());
  auto sync_unknown = client().CheckHealth("no.such.Service");
  EXPECT_EQ(unknown_service.status(), sync_unknown.status());
  if (sync_unknown.ok()) {
    EXPECT_EQ(*unknown_service, *sync_unknown);
  }
}

// An asynchronous call ends by the deadline it is given, whatever the
// client's call_timeout (infinite here): to an address that accepts
// connections and never answers, each fails DEADLINE_EXCEEDED instead of
// waiting for ever.
TEST_F(AttentionClientTest, AsyncCallsEndByTheirDeadline) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), length), 0);
  ASSERT_EQ(listen(listener, 16), 0);
  ASSERT_EQ(
      getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length), 0);
  auto silent = client::AttentionClient::Connect(
      absl::StrCat("127.0.0.1:", ntohs(address.sin_port)));
  absl::StatusOr<client::ServingStatus> health;
  absl::StatusOr<v1::ServerInfo> info;
  absl::StatusOr<v1::SessionInfo> session;
  absl::BlockingCounter pending(3);
  const absl::Time deadline = absl::Now() + absl::Milliseconds(200);
  silent->CheckHealthAsync(
      "",
      [&](absl::StatusOr<client::ServingStatus> got) {
        health = std::move(got);
        pending.DecrementCount();
      },
      deadline);
  silent->GetServerInfoAsync(
      [&](absl::StatusOr<v1::ServerInfo> got) {
        info = std::move(got);
        pending.DecrementCount();
      },
      deadline);
  silent->GetSessionAsync(
      "no-such-session",
      [&](absl::StatusOr<v1::SessionInfo> got) {
        session = std::move(got);
        pending.DecrementCount();
      },
      deadline);
  pending.Wait();
  close(listener);
  EXPECT_EQ(health.status().code(), absl::StatusCode::kDeadlineExceeded)
      << health.status();
  EXPECT_EQ(info.status().code(), absl::StatusCode::kDeadlineExceeded)
      << info.status();
  EXPECT_EQ(session.status().code(), absl::StatusCode::kDeadlineExceeded)
      << session.status();

  // A deadline in the future leaves the call its answer.
  ATTN_ASSERT_OK(client().WaitForConnected(absl::Seconds(30)));
  absl::Notification answered;
  client().GetServerInfoAsync(
      [&](absl::StatusOr<v1::ServerInfo> got) {
        info = std::move(got);
        answered.Notify();
      },
      absl::Now() + absl::Seconds(60));
  answered.WaitForNotification();
  ATTN_EXPECT_OK(info);
}

TEST_F(AttentionClientTest, UnreachableServerIsUnavailableOrDeadline) {
  // Port 1 on localhost: nothing listens there.
  client::ClientOptions options;
  options.call_timeout = absl::Seconds(5);
  auto unreachable = client::AttentionClient::Connect("127.0.0.1:1", options);
  ATTN_EXPECT_CODE(unreachable->WaitForConnected(absl::Milliseconds(200)),
                   absl::StatusCode::kDeadlineExceeded);
  auto info = unreachable->GetServerInfo();
  ASSERT_FALSE(info.ok());
  EXPECT_TRUE(info.status().code() == absl::StatusCode::kUnavailable ||
              info.status().code() == absl::StatusCode::kDeadlineExceeded)
      << info.status();
}

// A server that stops answering (its process stopped: the kernel still
// takes the bytes) fails a Decode stream's step, which has no deadline,
// once a keepalive ping goes unanswered; before that, the server accepts
// pings as often as the client may send them.
TEST(AttentionClientKeepaliveTest, AFrozenServerFailsTheOpenStream) {
  ServerProcess server({"--listen_address=127.0.0.1", "--port=0",
                        "--backend=cpu", "--threads=1",
                        "--kv_cache_bytes=16777216", "--kv_block_bytes=4096",
                        "--metrics_port=-1"});
  const int port = server.WaitForPort();
  ASSERT_GT(port, 0) << server.output();
  client::ClientOptions options;
  options.keepalive_time = client::kMinKeepaliveTime;
  options.keepalive_timeout = absl::Seconds(1);
  auto client =
      client::AttentionClient::Open(absl::StrCat("127.0.0.1:", port), options);
  ATTN_ASSERT_OK(client);
  auto session = (*client)->OpenSession(MakeSpec(1, 2, 1, 16));
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 3, 11);
  auto stream = (*client)->OpenDecodeStream();
  ATTN_ASSERT_OK(stream->Step(DecodeRequestAt(*session, tokens, 0)));
  // Open and quiet across four pings (gRPC's default server policy closes
  // the connection at the third).
  absl::SleepFor(4 * client::kMinKeepaliveTime + absl::Seconds(1));
  ATTN_ASSERT_OK(stream->Step(DecodeRequestAt(*session, tokens, 1)));

  ASSERT_TRUE(server.Freeze());
  // Only a client that never pings gets here: the step would wait for
  // ever, so it is ended (and the test failed) after a generous bound.
  absl::Notification answered;
  std::atomic<bool> guard_fired = false;
  std::thread guard([&] {
    if (!answered.WaitForNotificationWithTimeout(absl::Seconds(60))) {
      guard_fired = true;
      server.Signal(SIGKILL);
    }
  });
  auto frozen = stream->Step(DecodeRequestAt(*session, tokens, 2));
  answered.Notify();
  guard.join();
  EXPECT_FALSE(guard_fired) << "no keepalive ended the step";
  ATTN_EXPECT_CODE(frozen, absl::StatusCode::kUnavailable);
  server.Signal(SIGCONT);
}

// gRPC aborts a call whose metadata cannot go in an HTTP/2 header: Open
// refuses such a token, and a client made with Connect fails its calls
// instead of sending it.
TEST_F(AttentionClientTest, ATokenAHeaderCannotCarryNeverReachesGrpc) {
  for (const char* token : {"first\nsecond", "tab\there", "caf\xc3\xa9"}) {
    SCOPED_TRACE(token);
    client::ClientOptions options;
    options.auth_token = token;
    options.call_timeout = absl::Seconds(1);
    const std::string target = server_->server->local_target();
    ATTN_EXPECT_CODE(client::AttentionClient::Open(target, options),
                     absl::StatusCode::kInvalidArgument);
    auto connected = client::AttentionClient::Connect(target, options);
    EXPECT_FALSE(connected->GetServerInfo().ok());
    EXPECT_FALSE(connected->CheckHealth().ok());
    auto stream = connected->OpenDecodeStream();
    v1::DecodeRequest request;
    request.set_session_id("none");
    EXPECT_FALSE(stream->Step(request).ok());
  }
  EXPECT_TRUE(client::CheckAuthToken("printable ~ token").ok());
}

// A server's peer client reads its TLS files as regular files only: a FIFO
// named by a flag is refused at once instead of blocking the drain that
// opens the channel. A command-line tool's FIFO (`<(...)`) is read.
TEST(AttentionClientTlsFilesTest, RegularFilesOnlyRefusesAFifo) {
  const std::string fifo =
      absl::StrCat(::testing::TempDir(), "/ca-fifo-", ::getpid());
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  client::ClientOptions options;
  options.tls_ca_file = fifo;
  options.tls_regular_files_only = true;
  const auto refused = client::OpenChannel("localhost:1", options);
  ATTN_EXPECT_CODE(refused, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("not a regular file"),
            std::string::npos)
      << refused.status();

  options.tls_regular_files_only = false;
  std::thread writer([&] {
    const int fd = ::open(fifo.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ::close(fd);  // empty: the system's roots
  });
  EXPECT_TRUE(client::OpenChannel("localhost:1", options).ok());
  writer.join();
  ::unlink(fifo.c_str());
}

TEST_F(AttentionClientTest, ClientMessageLimitApplies) {
  client::ClientOptions options;
  options.max_send_message_bytes = 1024;
  client::AttentionClient small(
      client::CreateChannel(server_->server->local_target(), options), options);
  auto session = small.OpenSession(MakeSpec(1, 4, 2, 16));
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 20, 5);  // > 1 KiB
  ATTN_EXPECT_CODE(session->Prefill(0, tokens.q, tokens.k, tokens.v),
                   absl::StatusCode::kResourceExhausted);
  auto info = session->Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 0);
}

TEST_F(AttentionClientTest, ServerErrorsKeepCodeAndMessage) {
  auto result = client().GetSession("not-a-session");
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(result.status().message().empty());
}

// The documented retry policy: an idempotent call made while the server
// restarts (UNAVAILABLE) is retried until the new server answers; with
// retries off it fails at once.
TEST(AttentionClientRetryTest, IdempotentCallsRetryWhileTheServerRestarts) {
  auto first = StartTestServer();
  ATTN_ASSERT_OK(first);
  server::ServerOptions options = TestServerOptions();
  options.port = (*first)->server->port();
  const std::string target = (*first)->server->local_target();
  // Reconnects soon enough for the retries' last attempt (about 3 s in)
  // to find the new server; gRPC's default waits 1 s, then about 2.6 s.
  client::ClientOptions retrying;
  retrying.max_reconnect_backoff = absl::Milliseconds(100);
  auto client = client::AttentionClient::Connect(target, retrying);
  client::ClientOptions no_retries;
  no_retries.retry_max_attempts = 1;
  auto impatient = client::AttentionClient::Connect(target, no_retries);
  ATTN_ASSERT_OK(client->GetServerInfo());
  ATTN_ASSERT_OK(impatient->GetServerInfo());
  first->reset();  // drains and stops
  ATTN_EXPECT_CODE(impatient->GetServerInfo(), absl::StatusCode::kUnavailable);
  std::unique_ptr<TestServer> second;
  // Starting a server takes longer than issuing the call: the call meets
  // the server down.
  std::thread restart([&] {
    auto started = StartTestServer(options);
    ATTN_ASSERT_OK(started);
    second = *std::move(started);
  });
  auto info = client->GetServerInfo();
  restart.join();
  ATTN_EXPECT_OK(info);
}

}  // namespace
}  // namespace attention::testing
