// The attnctl CLI as a user runs it: plan (the seeds' frozen numbers),
// info / demo / health against a real server, cluster against several.
#include <grpcpp/grpcpp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/tokens_file.h"
#include "tests/server/test_certificates.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

CommandResult RunAttnctl(const std::string& args) {
  CommandResult result;
  const std::string command = absl::StrCat(ATTNCTL_BINARY, " ", args, " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer;
  size_t read = 0;
  while ((read = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) {
    result.output.append(buffer.data(), read);
  }
  const int status = pclose(pipe);
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  return result;
}

TEST(AttnctlPlanTest, GptOssHybridReproducesTheSeedCalculator) {
  const CommandResult result = RunAttnctl("plan --preset=gpt-oss-120b");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("4836556800 bytes"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("9663676416 bytes"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("18 full, 18 sliding-window"), std::string::npos)
      << result.output;
}

TEST(AttnctlPlanTest, DenseModelsPerTokenFigures) {
  const CommandResult llama = RunAttnctl("plan --preset=llama-3.3-70b");
  ASSERT_EQ(llama.exit_code, 0) << llama.output;
  EXPECT_NE(llama.output.find("(320 KiB/token"), std::string::npos)
      << llama.output;
  EXPECT_NE(llama.output.find("(40 GiB"), std::string::npos) << llama.output;
  const CommandResult qwen = RunAttnctl("plan --preset=qwen2.5-7b");
  ASSERT_EQ(qwen.exit_code, 0) << qwen.output;
  EXPECT_NE(qwen.output.find("(56 KiB/token"), std::string::npos)
      << qwen.output;
  EXPECT_NE(qwen.output.find("(7 GiB"), std::string::npos) << qwen.output;
}

TEST(AttnctlPlanTest, ExplicitFlagsDescribeTheSameSpecAsThePreset) {
  const CommandResult preset = RunAttnctl("plan --preset=gpt-oss-120b");
  const CommandResult flags = RunAttnctl(
      "plan --num_layers=36 --num_q_heads=64 --num_kv_heads=8 --head_dim=64 "
      "--kv_dtype=bf16 --window_pattern=128,0 --context=131072");
  ASSERT_EQ(flags.exit_code, 0) << flags.output;
  // Identical apart from the model line.
  const auto body = [](const std::string& text) {
    return text.substr(text.find('\n'));
  };
  EXPECT_EQ(body(flags.output), body(preset.output));
}

TEST(AttnctlPlanTest, DeepSeekV3LatentReproducesTheSeeds) {
  const CommandResult result = RunAttnctl("plan --preset=deepseek-v3");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  // (512 + 64) * 61 layers * 2 bytes; MHA: 2 * 61 * 128 * 128 * 2; x56.9.
  EXPECT_NE(result.output.find("70272 bytes"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("3997696 bytes"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("\u00d756.9"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("1152 bytes"), std::string::npos)
      << result.output;  // one latent vector per layer
}

TEST(AttnctlPlanTest, GenericLatentFlagsDescribeTheSamePerTokenBytes) {
  const CommandResult flags = RunAttnctl(
      "plan --num_layers=61 --num_q_heads=128 --kv_layout=latent "
      "--latent_dim=512 --rope_dim=64 --mha_head_dim=128");
  ASSERT_EQ(flags.exit_code, 0) << flags.output;
  EXPECT_NE(flags.output.find("70272 bytes"), std::string::npos)
      << flags.output;
  EXPECT_NE(flags.output.find("3997696 bytes"), std::string::npos)
      << flags.output;
  EXPECT_NE(flags.output.find("\u00d756.9"), std::string::npos)
      << flags.output;
}

TEST(AttnctlPlanTest, SparsePresetCountsIndexKeys) {
  const CommandResult result = RunAttnctl("plan --preset=deepseek-v3.2");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  // 128 bfloat16 index dims per token and layer: 256 bytes, 15616 over 61
  // layers; 70272 + 15616 = 85888 bytes per token in all.
  EXPECT_NE(result.output.find("256 bytes"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("15616 bytes"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("85888 bytes"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("top-2048"), std::string::npos)
      << result.output;
}

TEST(AttnctlPlanTest, BadPlansFail) {
  EXPECT_EQ(RunAttnctl("plan --preset=no-such-model").exit_code, 1);
  EXPECT_EQ(RunAttnctl("plan").exit_code, 1);
  EXPECT_EQ(RunAttnctl("plan --num_layers=2 --num_kv_heads=1 --head_dim=8 "
                       "--window_pattern=x")
                .exit_code,
            1);
  EXPECT_EQ(RunAttnctl("plan --num_layers=2 --num_kv_heads=1 --head_dim=8 "
                       "--kv_layout=diagonal")
                .exit_code,
            1);
  // Byte counts that would pass 2^63.
  EXPECT_EQ(RunAttnctl("plan --num_layers=1 --num_kv_heads=1 --head_dim=64 "
                       "--context=9223372036854775807")
                .exit_code,
            1);
  EXPECT_EQ(RunAttnctl("plan --preset=deepseek-v3 --mha_head_dim=2000000000")
                .exit_code,
            1);
  // Sizes refused before anything is allocated or added up.
  EXPECT_EQ(RunAttnctl("plan --num_layers=2147483647 --num_kv_heads=1 "
                       "--head_dim=1")
                .exit_code,
            1);
  EXPECT_EQ(RunAttnctl("plan --num_layers=1 --kv_layout=latent "
                       "--latent_dim=2147483647 --rope_dim=1")
                .exit_code,
            1);
  EXPECT_EQ(RunAttnctl("frobnicate").exit_code, 1);
}

class AttnctlServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = StartTestServer();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    target_ = absl::StrCat("--target=", server_->server->local_target());
  }

  std::unique_ptr<TestServer> server_;
  std::string target_;
};

TEST_F(AttnctlServerTest, InfoPrintsTheServer) {
  const CommandResult result = RunAttnctl("info " + target_);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("backend:            cpu"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find(server::ServerVersion()), std::string::npos);
}

TEST_F(AttnctlServerTest, DemoIsBitwiseExactAndCleansUp) {
  const CommandResult result = RunAttnctl("demo " + target_);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("max abs difference: 0\n"), std::string::npos)
      << result.output;
  auto info = server_->client->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->active_sessions(), 0);
  EXPECT_EQ(info->kv_cache_used_bytes(), 0);
}

// Bad flags end with an exit code and a message, never an abort, and leave
// no session behind.
TEST_F(AttnctlServerTest, BadFlagsFailCleanly) {
  const CommandResult huge =
      RunAttnctl("demo --prompt_tokens=2147483647 " + target_);
  EXPECT_EQ(huge.exit_code, 1) << huge.output;
  // A token gRPC cannot put in a header (it would abort the call).
  const std::string token_file =
      absl::StrCat(::testing::TempDir(), "/attnctl-bad-token-", getpid());
  {
    std::FILE* out = std::fopen(token_file.c_str(), "w");
    ASSERT_NE(out, nullptr);
    std::fputs("first\nsecond\n", out);
    std::fclose(out);
  }
  const CommandResult token = RunAttnctl(
      absl::StrCat("info --auth_token_file=", token_file, " ", target_));
  EXPECT_EQ(token.exit_code, 1) << token.output;
  EXPECT_NE(token.output.find("HTTP/2 header"), std::string::npos)
      << token.output;
  std::remove(token_file.c_str());
  // A far negative timeout would otherwise mean no deadline at all. A bad
  // flag of the probe's own: exit 1, as grpc_health_probe's.
  const CommandResult timeout =
      RunAttnctl("health --target=127.0.0.1:1 --timeout=-inf");
  EXPECT_EQ(timeout.exit_code, 1) << timeout.output;
  EXPECT_NE(timeout.output.find("--timeout -inf must be positive"),
            std::string::npos)
      << timeout.output;
  auto info = server_->client->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->active_sessions(), 0);
}

TEST_F(AttnctlServerTest, ExportThenImportCopiesTheSession) {
  const CommandResult demo = RunAttnctl("demo --keep_session " + target_);
  ASSERT_EQ(demo.exit_code, 0) << demo.output;
  const size_t at = demo.output.find("kept session ");
  ASSERT_NE(at, std::string::npos) << demo.output;
  const std::string id = demo.output.substr(at + 13, 32);
  const std::string file =
      absl::StrCat(::testing::TempDir(), "/attnctl-export-", getpid());
  const CommandResult exported = RunAttnctl(
      absl::StrCat("export --session=", id, " --out=", file, " ", target_));
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  const CommandResult imported =
      RunAttnctl(absl::StrCat("import --in=", file, " ", target_));
  ASSERT_EQ(imported.exit_code, 0) << imported.output;
  EXPECT_NE(imported.output.find("imported session "), std::string::npos);
  auto sessions = server_->client->ListSessions();
  ATTN_ASSERT_OK(sessions);
  ASSERT_EQ(sessions->size(), 2u);
  EXPECT_EQ((*sessions)[0].layer_lengths(0), (*sessions)[1].layer_lengths(0));
  // The id is taken: --keep_id fails and changes nothing.
  const CommandResult kept =
      RunAttnctl(absl::StrCat("import --keep_id --in=", file, " ", target_));
  EXPECT_NE(kept.exit_code, 0);
  EXPECT_NE(kept.output.find("ALREADY_EXISTS"), std::string::npos)
      << kept.output;
  // A file that is not a snapshot.
  const CommandResult bad =
      RunAttnctl(absl::StrCat("import --in=", ATTNCTL_BINARY, " ", target_));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_EQ(server_->client->ListSessions()->size(), 2u);
  std::remove(file.c_str());
}

TEST_F(AttnctlServerTest, HealthExitCodes) {
  EXPECT_EQ(RunAttnctl("health " + target_).exit_code, 0);
  server_->server->SetServing(false);
  EXPECT_EQ(RunAttnctl("health " + target_).exit_code, 4);
  server_->server->SetServing(true);
  EXPECT_EQ(RunAttnctl("health " + target_).exit_code, 0);
  // Nothing listens on port 1.
  EXPECT_EQ(RunAttnctl("health --target=127.0.0.1:1 --timeout=300ms").exit_code,
            2);
  // A probe's own configuration is at fault, not the server.
  const CommandResult no_ca =
      RunAttnctl("health --tls_ca_file=/nonexistent/ca.pem " + target_);
  EXPECT_EQ(no_ca.exit_code, 1) << no_ca.output;
  EXPECT_NE(no_ca.output.find("/nonexistent/ca.pem"), std::string::npos)
      << no_ca.output;
}

// attnctl against a server with TLS and bearer tokens (certificates made
// by openssl now).
TEST(AttnctlSecurityTest, InfoDemoAndHealthOverTlsWithAToken) {
  auto dir = MakeTempDirectory();
  ATTN_ASSERT_OK(dir);
  auto ca = MakeCa(*dir, "ca");
  ATTN_ASSERT_OK(ca);
  auto cert = MakeCertificate(*ca, *dir, "server", "attention-server",
                              CertificateUse::kServer);
  ATTN_ASSERT_OK(cert);
  const std::string tokens = absl::StrCat(*dir, "/tokens");
  ASSERT_TRUE(WriteFileAtomically(
      tokens, absl::StrCat("team ", server::DigestTokenHex("demo-token"),
                           " 10 -\n")));
  const std::string token_file = absl::StrCat(*dir, "/token");
  ASSERT_TRUE(WriteFileAtomically(token_file, "demo-token\n"));
  server::ServerOptions options = TestServerOptions();
  options.tls_cert_file = cert->cert;
  options.tls_key_file = cert->key;
  options.auth_tokens_file = tokens;
  auto server = server::AttentionServer::Start(options);
  ATTN_ASSERT_OK(server);
  const std::string tls = absl::StrCat(
      " --target=", (*server)->local_target(), " --tls_ca_file=", ca->cert);
  const std::string token = absl::StrCat(" --auth_token_file=", token_file);

  const CommandResult info = RunAttnctl("info" + tls + token);
  ASSERT_EQ(info.exit_code, 0) << info.output;
  EXPECT_NE(info.output.find("tenant:             team\n"), std::string::npos)
      << info.output;
  EXPECT_NE(info.output.find("tenant sessions:    0 of 10\n"),
            std::string::npos)
      << info.output;
  const CommandResult demo = RunAttnctl("demo" + tls + token);
  ASSERT_EQ(demo.exit_code, 0) << demo.output;
  EXPECT_NE(demo.output.find("max abs difference: 0\n"), std::string::npos)
      << demo.output;
  // Health needs no token; the API does.
  EXPECT_EQ(RunAttnctl("health" + tls).exit_code, 0);
  const CommandResult refused = RunAttnctl("info" + tls);
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_NE(refused.output.find("UNAUTHENTICATED"), std::string::npos)
      << refused.output;
  // Plaintext against the TLS port cannot connect.
  EXPECT_EQ(RunAttnctl(absl::StrCat("health --timeout=1s --target=",
                                    (*server)->local_target()))
                .exit_code,
            2);
  std::error_code ignored;
  std::filesystem::remove_all(*dir, ignored);
}

// The line of `output` that mentions `text` (empty when none does).
std::string LineWith(const std::string& output, const std::string& text) {
  const size_t at = output.find(text);
  if (at == std::string::npos) return "";
  const size_t begin = output.rfind('\n', at);
  const size_t end = output.find('\n', at);
  return output.substr(begin == std::string::npos ? 0 : begin + 1,
                       end == std::string::npos ? std::string::npos
                                                : end - begin - 1);
}

TEST(AttnctlClusterTest, ListsTheReplicasAndExportsFromTheOwner) {
  auto a = StartTestServer();
  ATTN_ASSERT_OK(a);
  auto b = StartTestServer();
  ATTN_ASSERT_OK(b);
  auto session = (*b)->client->CreateSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  const std::string address_a = (*a)->server->local_target();
  const std::string address_b = (*b)->server->local_target();
  const std::string cluster = absl::StrCat(
      " --timeout=30s --cluster=", address_a, ",", address_b, ",127.0.0.1:1");
  const CommandResult listed = RunAttnctl("cluster" + cluster);
  ASSERT_EQ(listed.exit_code, 0) << listed.output;
  const std::string line_a = LineWith(listed.output, address_a);
  const std::string line_b = LineWith(listed.output, address_b);
  const std::string line_dead = LineWith(listed.output, "127.0.0.1:1 ");
  EXPECT_NE(line_a.find("SERVING"), std::string::npos) << listed.output;
  EXPECT_NE(line_a.find(" 0  "), std::string::npos) << line_a;
  EXPECT_NE(line_b.find("SERVING"), std::string::npos) << listed.output;
  EXPECT_NE(line_b.find(" 1  "), std::string::npos) << line_b;
  EXPECT_NE(line_b.find(server::ServerVersion()), std::string::npos) << line_b;
  EXPECT_NE(line_b.find("/ 64 MiB"), std::string::npos) << line_b;
  EXPECT_NE(line_dead.find("unreachable"), std::string::npos)
      << listed.output;
  EXPECT_NE(listed.output.find("3 replicas, 2 SERVING"), std::string::npos)
      << listed.output;

  // A replica that stops serving shows it.
  (*a)->server->SetServing(false);
  const CommandResult one = RunAttnctl("cluster" + cluster);
  EXPECT_EQ(one.exit_code, 0) << one.output;
  EXPECT_NE(LineWith(one.output, address_a).find("not-serving"),
            std::string::npos)
      << one.output;

  // export --cluster finds the session on its replica.
  const std::string file =
      absl::StrCat(::testing::TempDir(), "/attnctl-cluster-export-", getpid());
  const CommandResult exported = RunAttnctl(absl::StrCat(
      "export --session=", session->session_id(), " --out=", file, cluster));
  EXPECT_EQ(exported.exit_code, 0) << exported.output;
  EXPECT_TRUE(std::filesystem::exists(file));
  std::remove(file.c_str());

  // Nothing serving: exit 1.
  EXPECT_EQ(RunAttnctl("cluster --timeout=1s --cluster=127.0.0.1:1,127.0.0.1:2")
                .exit_code,
            1);
  EXPECT_EQ(RunAttnctl("cluster --cluster=no-port").exit_code, 1);
}

TEST(AttnctlHealthTest, ServerWithoutHealthServiceIsRpcFailure) {
  // A bare gRPC server: reachable, but grpc.health.v1 is unimplemented.
  grpc::EnableDefaultHealthCheckService(false);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  // gRPC builds no server without a service; this one answers every method
  // UNIMPLEMENTED.
  grpc::CallbackGenericService unimplemented;
  builder.RegisterCallbackGenericService(&unimplemented);
  std::unique_ptr<grpc::Server> bare = builder.BuildAndStart();
  ASSERT_NE(bare, nullptr);
  ASSERT_GT(port, 0);
  EXPECT_EQ(
      RunAttnctl(absl::StrCat("health --target=127.0.0.1:", port)).exit_code,
      3);
  bare->Shutdown();
}

}  // namespace
}  // namespace attention::testing
