// Runs the attention-server executable itself: start on an ephemeral port,
// serve, stop on SIGTERM with exit code 0; bad flags and a busy port fail;
// the backend choice without a GPU (auto falls back to the CPU and says why,
// cuda refuses to start); with --snapshot_dir, sessions survive a SIGTERM
// restart bitwise, and a kill -9 during the snapshot leaves each session
// whole or absent.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/frozen_reader.h"
#include "tests/server/http_get.h"
#include "tests/server/scoped_temp_dir.h"
#include "tests/server/server_process.h"
#include "tests/server/test_server.h"

extern char** environ;

namespace attention {
namespace {

using ::attention::testing::HttpGet;
using ::attention::testing::ScopedTempDir;
using ::attention::testing::ServerProcess;

const std::vector<std::string> kSmallServer = {"--port=0",
                                               "--backend=cpu",
                                               "--threads=1",
                                               "--kv_cache_bytes=16777216",
                                               "--listen_address=127.0.0.1",
                                               "--drain_timeout=60s",
                                               "--metrics_port=0"};

TEST(ServerBinaryTest, ServesAndExitsZeroOnSigterm) {
  ServerProcess server(kSmallServer);
  ASSERT_TRUE(server.started());
  const int port = server.WaitForPort();
  ASSERT_GT(port, 0) << "attention-server did not start";

  auto client =
      client::AttentionClient::Connect(absl::StrCat("127.0.0.1:", port));
  auto info = client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "cpu");
  EXPECT_EQ(info->kv_cache_capacity_bytes(), 16777216);
  EXPECT_EQ(info->max_message_bytes(), 64 << 20);
  auto health = client->CheckHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, client::ServingStatus::kServing);

  // A Decode stream in flight when SIGTERM arrives is allowed to finish.
  v1::SessionSpec spec;
  spec.set_num_layers(1);
  spec.set_num_q_heads(1);
  spec.set_num_kv_heads(1);
  spec.set_head_dim(4);
  auto session = client->OpenSession(spec);
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<float> token = {0.1f, 0.2f, 0.3f, 0.4f};
  auto stream = client->OpenDecodeStream();
  ASSERT_TRUE(
      stream->Step(*session->MakeDecodeRequest(0, token, token, token)).ok());
  server.Signal(SIGTERM);
  auto second =
      stream->Step(*session->MakeDecodeRequest(0, token, token, token));
  EXPECT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(stream->Finish().ok());

  const int status = server.Wait();
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// A client that stops reading its replies holds gRPC's transport for as
// long as it stays connected; the process still exits 0 once the drain
// is over (a pod would otherwise be killed at the end of its grace period,
// its metrics linger and exit code lost).
TEST(ServerBinaryTest, AClientThatStopsReadingDoesNotHoldTheExit) {
  std::vector<std::string> flags = kSmallServer;
  flags.push_back("--drain_timeout=2s");
  ServerProcess server(flags);
  const int port = server.WaitForPort();
  ASSERT_GT(port, 0) << server.output();
  // Calls whose replies fill the socket buffers.
  const v1::AttentionRequest request = testing::LargeReplyRequest();
  testing::FrozenReader frozen;
  ASSERT_TRUE(frozen.Connect(port).ok());
  for (int call = 0; call < 2; ++call) {
    ASSERT_TRUE(frozen
                    .Call("/attention.v1.AttentionService/Attention",
                          request.SerializeAsString())
                    .ok());
  }
  absl::SleepFor(absl::Seconds(1));  // the calls are computed and answered
  server.Signal(SIGTERM);
  // Only a process held by the client gets here: released after a bound
  // far past the drain's 2 s (gRPC gave the transport up after about 20 s
  // here), and the test fails.
  absl::Notification exited;
  bool released = false;
  std::thread guard([&] {
    if (!exited.WaitForNotificationWithTimeout(absl::Seconds(12))) {
      released = true;
      frozen.Close();
    }
  });
  const int status = server.Wait();
  exited.Notify();
  guard.join();
  EXPECT_FALSE(released) << server.output();
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(ServerBinaryTest, SigintAlsoExitsZero) {
  ServerProcess server(kSmallServer);
  ASSERT_TRUE(server.started());
  ASSERT_GT(server.WaitForPort(), 0);
  server.Signal(SIGINT);
  const int status = server.Wait();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(ServerBinaryTest, BadFlagsFailToStart) {
  for (const char* flag :
       {"--backend=tpu", "--kv_cache_bytes=0", "--max_message_bytes=-1",
        "--port=70000", "--session_idle_timeout=-1s", "--cpu_spin=-1us",
        "--cpu_spin=1s", "--tls_cert_file=/nonexistent/server.crt",
        "--tls_client_ca_file=/nonexistent/ca.crt",
        "--auth_tokens_file=/nonexistent/tokens", "--metrics_linger=-1s",
        "--drain_timeout=0s", "--drain_timeout=inf", "--batch_wait=inf",
        "--snapshot_dir=/dev/null/snapshots", "--metrics_port=-2",
        "--metrics_port=65536"}) {
    std::vector<std::string> flags = kSmallServer;
    flags.push_back(flag);
    ServerProcess server(flags);
    ASSERT_TRUE(server.started());
    EXPECT_EQ(server.WaitForPort(), 0) << flag;
    const int status = server.Wait();
    ASSERT_TRUE(WIFEXITED(status)) << flag;
    EXPECT_NE(WEXITSTATUS(status), 0) << flag;
  }
}

TEST(ServerBinaryTest, SighupRereadsTheTokensFile) {
  const std::string tokens =
      absl::StrCat(::testing::TempDir(), "/attention-server-tokens-", getpid());
  const auto write_tokens = [&](absl::string_view digest) {
    std::ofstream out(tokens, std::ios::trunc);
    out << "team " << digest << " - -\n";
  };
  // SHA-256 of "test" and of "fresh-token".
  write_tokens(
      "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08");
  std::vector<std::string> flags = kSmallServer;
  flags.push_back("--auth_tokens_file=" + tokens);
  flags.push_back("--auth_reload_interval=0s");  // SIGHUP only
  ServerProcess server(flags);
  ASSERT_TRUE(server.started());
  const int port = server.WaitForPort();
  ASSERT_GT(port, 0);
  const auto info_with = [&](const std::string& token) {
    client::ClientOptions options;
    options.auth_token = token;
    return client::AttentionClient::Connect(absl::StrCat("127.0.0.1:", port),
                                            options)
        ->GetServerInfo()
        .status();
  };
  EXPECT_TRUE(info_with("test").ok());
  EXPECT_EQ(info_with("fresh-token").code(),
            absl::StatusCode::kUnauthenticated);
  write_tokens(
      "5e2040ab40dda85da03488a044e0fe9b344d6479f9e26ae74d72d9e784e1d0c0");
  server.Signal(SIGHUP);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!info_with("fresh-token").ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(info_with("fresh-token").ok());
  EXPECT_EQ(info_with("test").code(), absl::StatusCode::kUnauthenticated);
  server.Signal(SIGTERM);
  const int status = server.Wait();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  std::remove(tokens.c_str());
}

// The flags of kSmallServer with another --backend.
std::vector<std::string> WithBackend(const std::string& backend) {
  std::vector<std::string> flags = kSmallServer;
  for (std::string& flag : flags) {
    if (flag.rfind("--backend=", 0) == 0) flag = "--backend=" + backend;
  }
  return flags;
}

TEST(ServerBinaryTest, AutoFallsBackToCpuAndSaysWhy) {
  ServerProcess server(WithBackend("auto"));
  ASSERT_TRUE(server.started());
  const int port = server.WaitForPort();
  ASSERT_GT(port, 0) << server.output();
  auto client =
      client::AttentionClient::Connect(absl::StrCat("127.0.0.1:", port));
  auto info = client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  if (info->backend() == "cuda") {
    server.Signal(SIGTERM);
    server.Wait();
    GTEST_SKIP() << "a CUDA device is usable here: " << info->device();
  }
  EXPECT_EQ(info->backend(), "cpu");
  server.Signal(SIGTERM);
  EXPECT_EQ(WEXITSTATUS(server.Wait()), 0);
  // The start-up line and the structured log give the reason: no CUDA
  // backend in this build, or the CUDA probe's reason (no device, driver
  // too old, ...), each ending in "using cpu".
  const std::string output = server.output();
  const bool has_cuda_reason =
      output.find("backend=cpu (cuda requested by auto but no device is "
                  "usable: ") != std::string::npos;
  const bool has_no_cuda_reason =
      output.find("backend=cpu (auto: this build has no CUDA backend; "
                  "using cpu)") != std::string::npos;
  EXPECT_TRUE(has_cuda_reason || has_no_cuda_reason) << output;
  EXPECT_NE(output.find("event=server_started"), std::string::npos) << output;
  EXPECT_NE(output.find("backend_reason="), std::string::npos) << output;
}

TEST(ServerBinaryTest, CudaWithoutDeviceFailsAtStartUp) {
  ServerProcess server(WithBackend("cuda"));
  ASSERT_TRUE(server.started());
  if (server.WaitForPort() > 0) {
    server.Signal(SIGTERM);
    server.Wait();
    GTEST_SKIP() << "a CUDA device is usable here";
  }
  const int status = server.Wait();
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_NE(WEXITSTATUS(status), 0);
  const std::string output = server.output();
  EXPECT_NE(output.find("cannot start: UNAVAILABLE: cuda backend requested "
                        "but "),
            std::string::npos)
      << output;
  EXPECT_NE(output.find("use --backend=cpu or --backend=auto"),
            std::string::npos)
      << output;
}

TEST(ServerBinaryTest, BusyPortFailsToStart) {
  ServerProcess first(kSmallServer);
  ASSERT_TRUE(first.started());
  const int port = first.WaitForPort();
  ASSERT_GT(port, 0);
  std::vector<std::string> flags = kSmallServer;
  flags[0] = absl::StrCat("--port=", port);
  ServerProcess second(flags);
  ASSERT_TRUE(second.started());
  EXPECT_EQ(second.WaitForPort(), 0);
  const int status = second.Wait();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  first.Signal(SIGTERM);
  EXPECT_EQ(WEXITSTATUS(first.Wait()), 0);
}

std::vector<float> Random(int64_t count, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = uniform(rng);
  return values;
}

// A session with a window layer and a full one, `tokens` prefilled, and the
// output bytes of the next decode step on each layer.
struct KnownSession {
  std::string id;
  std::vector<int64_t> lengths;
  std::vector<float> q, k, v;  // the next step's token
  std::vector<std::string> next_outputs;
};

KnownSession MakeKnownSession(client::AttentionClient& client, int64_t tokens,
                              uint32_t seed) {
  KnownSession known;
  v1::SessionSpec spec;
  spec.set_num_layers(2);
  spec.set_num_q_heads(8);
  spec.set_num_kv_heads(4);
  spec.set_head_dim(64);
  spec.add_layers()->set_window(0);
  spec.add_layers()->set_window(100);
  spec.mutable_layers(1)->set_num_sink_tokens(4);
  auto session = client.OpenSession(spec);
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return known;
  std::mt19937 rng(seed);
  for (int layer = 0; layer < 2; ++layer) {
    const auto q = Random(tokens * 8 * 64, rng);
    const auto k = Random(tokens * 4 * 64, rng);
    const auto v = Random(tokens * 4 * 64, rng);
    EXPECT_TRUE(session->Prefill(layer, q, k, v).ok());
    known.lengths.push_back(tokens);
  }
  known.q = Random(8 * 64, rng);
  known.k = Random(4 * 64, rng);
  known.v = Random(4 * 64, rng);
  // The answer, from a fork that is deleted again.
  auto fork = session->Fork();
  EXPECT_TRUE(fork.ok()) << fork.status();
  for (int layer = 0; layer < 2; ++layer) {
    auto step = fork->DecodeStep(layer, known.q, known.k, known.v);
    EXPECT_TRUE(step.ok()) << step.status();
    known.next_outputs.push_back(step.ok() ? step->output().data() : "");
  }
  EXPECT_TRUE(fork->Delete().ok());
  known.id = session->id();
  return known;
}

// The session is back whole (same lengths, same next outputs, bitwise).
void ExpectRestoredWhole(client::AttentionClient& client,
                         const KnownSession& known) {
  auto info = client.GetSession(known.id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(std::vector<int64_t>(info->layer_lengths().begin(),
                                 info->layer_lengths().end()),
            known.lengths);
  client::SessionHandle session(&client, *info);
  for (int layer = 0; layer < 2; ++layer) {
    auto step = session.DecodeStep(layer, known.q, known.k, known.v);
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_EQ(step->output().data(), known.next_outputs[layer])
        << "layer " << layer;
  }
}

TEST(ServerBinaryTest, SessionsSurviveASigtermRestart) {
  const ScopedTempDir scoped_dir("binary-snapshot");
  const std::string& dir = scoped_dir.path();
  std::vector<std::string> flags = kSmallServer;
  flags.push_back("--snapshot_dir=" + dir);
  std::vector<KnownSession> sessions;
  {
    ServerProcess server(flags);
    ASSERT_TRUE(server.started());
    const int port = server.WaitForPort();
    ASSERT_GT(port, 0);
    auto client =
        client::AttentionClient::Connect(absl::StrCat("127.0.0.1:", port));
    for (uint32_t seed = 1; seed <= 3; ++seed) {
      sessions.push_back(MakeKnownSession(*client, 150 + 20 * seed, seed));
    }
    server.Signal(SIGTERM);
    const int status = server.Wait();
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }
  ServerProcess restarted(flags);
  ASSERT_TRUE(restarted.started());
  const int port = restarted.WaitForPort();
  ASSERT_GT(port, 0);
  auto client =
      client::AttentionClient::Connect(absl::StrCat("127.0.0.1:", port));
  for (const KnownSession& known : sessions) {
    ExpectRestoredWhole(*client, known);
  }
  // Every file restored is removed; the server's lock file stays.
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().filename(), ".lock");
  }
  restarted.Signal(SIGKILL);
  restarted.Wait();
}

// A start that fails after restoring (its port taken) keeps the snapshot
// files: the next start restores the sessions whole.
TEST(ServerBinaryTest, AStartThatFailsKeepsTheSnapshot) {
  const ScopedTempDir scoped_dir("binary-failed-start");
  const std::string& dir = scoped_dir.path();
  std::vector<std::string> flags = kSmallServer;
  flags.push_back("--snapshot_dir=" + dir);
  KnownSession known;
  {
    ServerProcess server(flags);
    ASSERT_TRUE(server.started());
    const int port = server.WaitForPort();
    ASSERT_GT(port, 0);
    auto client =
        client::AttentionClient::Connect(absl::StrCat("127.0.0.1:", port));
    known = MakeKnownSession(*client, 60, 7);
    server.Signal(SIGTERM);
    ASSERT_EQ(WEXITSTATUS(server.Wait()), 0);
  }
  const std::string file = absl::StrCat(dir, "/", known.id, ".session");
  ASSERT_TRUE(std::filesystem::exists(file));
  {
    ServerProcess holder(kSmallServer);
    ASSERT_TRUE(holder.started());
    const int busy = holder.WaitForPort();
    ASSERT_GT(busy, 0);
    std::vector<std::string> on_busy_port = flags;
    on_busy_port[0] = absl::StrCat("--port=", busy);
    ServerProcess failed(on_busy_port);
    ASSERT_TRUE(failed.started());
    EXPECT_EQ(failed.WaitForPort(), 0);
    EXPECT_EQ(WEXITSTATUS(failed.Wait()), 1);
    EXPECT_THAT(failed.output(), ::testing::HasSubstr("restored=1"));
    EXPECT_TRUE(std::filesystem::exists(file));
    holder.Signal(SIGTERM);
    holder.Wait();
  }
  ServerProcess restarted(flags);
  ASSERT_TRUE(restarted.started());
  const int port = restarted.WaitForPort();
  ASSERT_GT(port, 0);
  auto client =
      client::AttentionClient::Connect(absl::StrCat("127.0.0.1:", port));
  ExpectRestoredWhole(*client, known);
  EXPECT_FALSE(std::filesystem::exists(file));
  restarted.Signal(SIGKILL);
  restarted.Wait();
}

// A server whose stdout is a pipe nobody reads any more (`... | tee log`
// after tee died) still drains and snapshots: the write of its "draining"
// line fails with EPIPE instead of killing it. Without the metrics
// endpoint, nothing else ignores SIGPIPE.
TEST(ServerBinaryTest, AClosedStdoutDoesNotStopTheDrain) {
  const std::string script = absl::StrCat(
      ::testing::TempDir(), "/attention-server-closed-stdout-", getpid());
  {
    std::ofstream out(script, std::ios::trunc);
    out << "#!/bin/bash\nexec > >(exit 0)\nexec "
        << ServerProcess::DefaultBinary() << " \"$@\"\n";
  }
  std::filesystem::permissions(script, std::filesystem::perms::owner_all);
  const ScopedTempDir scoped_dir("binary-closed-stdout");
  const std::string& dir = scoped_dir.path();
  std::vector<std::string> flags = kSmallServer;
  flags.back() = "--metrics_port=-1";
  flags.push_back("--snapshot_dir=" + dir);
  ServerProcess server(flags, script);
  ASSERT_TRUE(server.started());
  const int port = server.WaitForPort();
  ASSERT_GT(port, 0) << server.output();
  auto client =
      client::AttentionClient::Connect(absl::StrCat("127.0.0.1:", port));
  const KnownSession known = MakeKnownSession(*client, 20, 3);
  server.Signal(SIGTERM);
  const int status = server.Wait();
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_TRUE(
      std::filesystem::exists(absl::StrCat(dir, "/", known.id, ".session")));
  std::remove(script.c_str());
}

// The metrics port from the server's start-up log line, or 0.
int MetricsPort(const ServerProcess& server) {
  const std::string output = server.output();
  const std::string key = " metrics_port=";
  const size_t at = output.find(key);
  if (at == std::string::npos) return 0;
  const size_t begin = at + key.size();
  int port = 0;
  const size_t end = output.find(' ', begin);
  return absl::SimpleAtoi(output.substr(begin, end - begin), &port) ? port : 0;
}

// A server listening on every address (`--listen_address=::`, as an IPv6
// or dual-stack cluster sets it) starts and serves its metrics on IPv4
// too: "[::]:port" bound IPv6 only, and with Debian's civetweb (no IPv6)
// it stopped the start.
TEST(ServerBinaryTest, EveryAddressServesMetricsOnIpv4Too) {
  std::vector<std::string> flags = kSmallServer;
  flags[4] = "--listen_address=::";
  ServerProcess server(flags);
  ASSERT_TRUE(server.started());
  ASSERT_GT(server.WaitForPort(), 0) << server.output();
  const int metrics_port = MetricsPort(server);
  ASSERT_GT(metrics_port, 0) << server.output();
  EXPECT_THAT(HttpGet(metrics_port, "/metrics"),
              ::testing::HasSubstr("attention_build_info"));
  server.Signal(SIGTERM);
  const int status = server.Wait();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// A replica with peers but no --advertise_address sends peers and clients
// to whatever its own host name or listen address is: it says so.
TEST(ServerBinaryTest, PeersWithoutAnAdvertiseAddressAreWarnedOf) {
  for (const bool advertised : {false, true}) {
    std::vector<std::string> flags = kSmallServer;
    flags.push_back("--peers=127.0.0.1:1");
    if (advertised) flags.push_back("--advertise_address=replica-0.test:1");
    ServerProcess server(flags);
    ASSERT_TRUE(server.started());
    ASSERT_GT(server.WaitForPort(), 0) << server.output();
    EXPECT_EQ(
        server.output().find("advertise_address_unset") == std::string::npos,
        advertised)
        << server.output();
    server.Signal(SIGKILL);
    server.Wait();
  }
}

// Whether the server's output says `text` within `timeout`.
bool WaitForOutput(const ServerProcess& server, const std::string& text,
                   absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (server.output().find(text) == std::string::npos) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

// With --metrics_linger the drained server keeps /metrics up, so that a
// scrape after the drain sees its final counts (here the snapshot's); the
// gRPC port is closed by then. A second SIGTERM ends the linger at once;
// otherwise it ends by itself. Both exit 0.
TEST(ServerBinaryTest, MetricsStayUpAfterTheDrainForTheLastScrape) {
  const ScopedTempDir scoped_dir("binary-linger");
  const std::string& dir = scoped_dir.path();
  std::vector<std::string> flags = kSmallServer;
  flags.push_back("--snapshot_dir=" + dir);
  flags.push_back("--metrics_linger=300s");
  {
    ServerProcess server(flags);
    ASSERT_TRUE(server.started());
    const int port = server.WaitForPort();
    ASSERT_GT(port, 0);
    const int metrics_port = MetricsPort(server);
    ASSERT_GT(metrics_port, 0) << server.output();
    auto client =
        client::AttentionClient::Connect(absl::StrCat("127.0.0.1:", port));
    MakeKnownSession(*client, 40, 1);
    EXPECT_THAT(HttpGet(metrics_port, "/metrics"),
                ::testing::HasSubstr(
                    "\nattention_snapshot_sessions_written_total 0\n"));

    server.Signal(SIGTERM);
    ASSERT_TRUE(WaitForOutput(server, "serving /metrics for 5m more",
                              absl::Seconds(60)))
        << server.output();
    const std::string scraped = HttpGet(metrics_port, "/metrics");
    EXPECT_THAT(scraped, ::testing::HasSubstr("200 OK"));
    EXPECT_THAT(scraped,
                ::testing::HasSubstr(
                    "\nattention_snapshot_sessions_written_total 1\n"));
    EXPECT_THAT(scraped, ::testing::HasSubstr(
                             "\nattention_snapshot_sessions_failed_total 0\n"));
    EXPECT_FALSE(client->GetServerInfo().ok());

    const absl::Time second_signal = absl::Now();
    server.Signal(SIGTERM);
    const int status = server.Wait();
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0);
    EXPECT_LT(absl::Now() - second_signal, absl::Seconds(60));
  }

  flags = kSmallServer;
  flags.push_back("--metrics_linger=1s");
  ServerProcess server(flags);
  ASSERT_TRUE(server.started());
  ASSERT_GT(server.WaitForPort(), 0);
  server.Signal(SIGTERM);
  const int status = server.Wait();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_THAT(server.output(), ::testing::HasSubstr("serving /metrics for 1s"));
  EXPECT_THAT(server.output(),
              ::testing::HasSubstr("attention-server: stopped"));
}

TEST(ServerBinaryTest, KillDuringTheSnapshotLeavesSessionsWholeOrAbsent) {
  std::vector<std::string> flags = kSmallServer;
  flags[3] = "--kv_cache_bytes=67108864";
  int restored = 0;
  int absent = 0;
  // Killed at several moments after the first snapshot file appears: while
  // writing a file, between files, around the renames.
  for (int delay_ms : {0, 3, 10, 25, 60}) {
    SCOPED_TRACE(absl::StrCat("kill -9 ", delay_ms, " ms into the snapshot"));
    const ScopedTempDir scoped_dir("binary-kill");
    const std::string& dir = scoped_dir.path();
    std::vector<std::string> with_dir = flags;
    with_dir.push_back("--snapshot_dir=" + dir);
    std::vector<KnownSession> sessions;
    {
      ServerProcess server(with_dir);
      ASSERT_TRUE(server.started());
      const int port = server.WaitForPort();
      ASSERT_GT(port, 0);
      auto client =
          client::AttentionClient::Connect(absl::StrCat("127.0.0.1:", port));
      for (uint32_t seed = 1; seed <= 6; ++seed) {
        sessions.push_back(MakeKnownSession(*client, 1000, seed));
      }
      server.Signal(SIGTERM);
      const absl::Time give_up = absl::Now() + absl::Seconds(60);
      while (std::filesystem::is_empty(dir) && absl::Now() < give_up) {
        absl::SleepFor(absl::Microseconds(200));
      }
      absl::SleepFor(absl::Milliseconds(delay_ms));
      server.Signal(SIGKILL);
      server.Wait();
    }
    ServerProcess restarted(with_dir);
    ASSERT_TRUE(restarted.started());
    const int port = restarted.WaitForPort();
    ASSERT_GT(port, 0) << "a crash during the snapshot must not stop a start";
    auto client =
        client::AttentionClient::Connect(absl::StrCat("127.0.0.1:", port));
    for (const KnownSession& known : sessions) {
      auto info = client->GetSession(known.id);
      if (info.ok()) {
        ++restored;
        ExpectRestoredWhole(*client, known);
      } else {
        ++absent;
        EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound)
            << info.status();
      }
    }
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.path().filename() == ".lock") continue;  // the server's
      ADD_FAILURE() << "left in the snapshot directory: " << entry.path();
    }
    restarted.Signal(SIGKILL);
    restarted.Wait();
  }
  std::cout << "kill -9 during the snapshot: " << restored
            << " sessions restored whole, " << absent << " absent" << std::endl;
}

}  // namespace
}  // namespace attention
