// Runs the attention-server executable itself: start on an ephemeral port,
// serve, stop on SIGTERM with exit code 0; bad flags and a busy port fail;
// the backend choice without a GPU (auto falls back to the CPU and says why,
// cuda refuses to start).
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "gtest/gtest.h"

extern char** environ;

namespace attention {
namespace {

// A child attention-server process.
class ServerProcess {
 public:
  explicit ServerProcess(std::vector<std::string> flags) {
    port_file_ = absl::StrCat(::testing::TempDir(), "/attention-server-port-",
                              getpid(), "-", counter_++);
    std::remove(port_file_.c_str());
    output_file_ = port_file_ + ".out";
    std::vector<std::string> args = {ATTN_SERVER_BINARY,
                                     "--port_file=" + port_file_};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    // stdout and stderr go to one file, read by output().
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO,
                                     output_file_.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    if (posix_spawn(&pid_, ATTN_SERVER_BINARY, &actions, nullptr, argv.data(),
                    environ) != 0) {
      pid_ = -1;
    }
    posix_spawn_file_actions_destroy(&actions);
  }
  ~ServerProcess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      Wait();
    }
    std::remove(port_file_.c_str());
    std::remove(output_file_.c_str());
  }

  bool started() const { return pid_ > 0; }

  // The port from --port_file, or 0 if the server exited or took too long.
  int WaitForPort() {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      std::ifstream in(port_file_);
      std::string text;
      int port = 0;
      if (in >> text && absl::SimpleAtoi(text, &port) && port > 0) return port;
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        status_ = status;
        return 0;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return 0;
  }

  void Signal(int signal_number) { kill(pid_, signal_number); }

  // What the server wrote to stdout and stderr so far.
  std::string output() const {
    std::ifstream in(output_file_);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  // The raw wait status once the process has exited.
  int Wait() {
    if (!exited_) {
      while (waitpid(pid_, &status_, 0) < 0 && errno == EINTR) {
      }
      exited_ = true;
    }
    return status_;
  }

 private:
  static inline int counter_ = 0;
  std::string port_file_;
  std::string output_file_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = 0;
};

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
        "--auth_tokens_file=/nonexistent/tokens"}) {
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

}  // namespace
}  // namespace attention
