// Transport security and tenants against real servers on loopback, with
// certificates made by openssl at test time (tests/server/test_certificates.h):
// TLS and mutual TLS refuse what they must, certificates rotate without a
// restart, bearer tokens authenticate (health needs none), tenants never see
// each other's sessions, quotas refuse and recover, and a tokens-file edit
// takes effect without a restart; snapshots carry their owner, exports
// and imports act for the caller's tenant and restores for the owner.
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/tokens_file.h"
#include "tests/server/reflection_client.h"
#include "tests/server/test_certificates.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

using client::AttentionClient;
using client::ClientOptions;
using client::SessionHandle;

// Appends token `t` of `tokens` to layer 0 of `session` on `stream`.
absl::StatusOr<v1::AttentionResult> StepToken(client::DecodeStream& stream,
                                              SessionHandle& session,
                                              const Tokens& tokens, int t) {
  ATTN_ASSIGN_OR_RETURN(
      const v1::DecodeRequest request,
      session.MakeDecodeRequest(0, tokens.q_rows(t, 1), tokens.k_rows(t, 1),
                                tokens.v_rows(t, 1)));
  return stream.Step(request);
}

class SecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = MakeTempDirectory();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
    auto ca = MakeCa(dir_, "ca");
    ATTN_ASSERT_OK(ca);
    ca_ = *ca;
    auto server_cert = MakeCertificate(ca_, dir_, "server", "localhost",
                                       CertificateUse::kServer);
    ATTN_ASSERT_OK(server_cert);
    server_cert_ = *server_cert;
  }
  void TearDown() override {
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }

  // A server with TLS from server_cert_ (copied, so that tests may replace
  // the files), plus `options`' other settings.
  std::unique_ptr<server::AttentionServer> Start(
      server::ServerOptions options) {
    auto server = server::AttentionServer::Start(options);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? *std::move(server) : nullptr;
  }
  server::ServerOptions TlsOptions() {
    server::ServerOptions options = TestServerOptions();
    options.tls_cert_file = absl::StrCat(dir_, "/live.crt");
    options.tls_key_file = absl::StrCat(dir_, "/live.key");
    EXPECT_TRUE(WriteFileAtomically(options.tls_key_file,
                                    ReadFileOrEmpty(server_cert_.key)));
    EXPECT_TRUE(WriteFileAtomically(options.tls_cert_file,
                                    ReadFileOrEmpty(server_cert_.cert)));
    options.tls_refresh_interval = absl::Seconds(1);
    return options;
  }

  static std::unique_ptr<AttentionClient> Client(
      const server::AttentionServer& server, ClientOptions options) {
    options.call_timeout = absl::Seconds(10);
    auto client = AttentionClient::Open(server.local_target(), options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }
  ClientOptions TrustingCa(const CertificateFiles& ca) const {
    ClientOptions options;
    options.tls_ca_file = ca.cert;
    return options;
  }
  ClientOptions WithCertificate(const CertificateFiles& ca,
                                const CertificateFiles& cert) const {
    ClientOptions options = TrustingCa(ca);
    options.tls_cert_file = cert.cert;
    options.tls_key_file = cert.key;
    return options;
  }

  std::string dir_;
  CertificateFiles ca_;
  CertificateFiles server_cert_;
};

TEST_F(SecurityTest, PlaintextClientAgainstTlsServerFails) {
  auto server = Start(TlsOptions());
  ASSERT_NE(server, nullptr);
  EXPECT_STREQ(server->transport_mode(), "tls");
  auto plaintext = Client(*server, ClientOptions{});
  const absl::Status refused = plaintext->GetServerInfo().status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  auto tls = Client(*server, TrustingCa(ca_));
  auto info = tls->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->tenant(), "default");
  EXPECT_FALSE(info->has_tenant_max_sessions());
  // A client that does not trust the server's CA refuses it.
  auto other_ca = MakeCa(dir_, "other-ca");
  ATTN_ASSERT_OK(other_ca);
  EXPECT_EQ(
      Client(*server, TrustingCa(*other_ca))->GetServerInfo().status().code(),
      absl::StatusCode::kUnavailable);
}

TEST_F(SecurityTest, MutualTlsRefusesMissingOrForeignClientCertificates) {
  auto alice =
      MakeCertificate(ca_, dir_, "alice", "alice", CertificateUse::kClient);
  ATTN_ASSERT_OK(alice);
  auto rogue_ca = MakeCa(dir_, "rogue-ca");
  ATTN_ASSERT_OK(rogue_ca);
  auto rogue = MakeCertificate(*rogue_ca, dir_, "rogue", "alice",
                               CertificateUse::kClient);
  ATTN_ASSERT_OK(rogue);
  server::ServerOptions options = TlsOptions();
  options.tls_client_ca_file = ca_.cert;
  auto server = Start(options);
  ASSERT_NE(server, nullptr);
  EXPECT_STREQ(server->transport_mode(), "mutual-tls");
  EXPECT_STREQ(server->auth_mode(), "client-cert");

  EXPECT_FALSE(Client(*server, TrustingCa(ca_))->GetServerInfo().ok());
  EXPECT_FALSE(
      Client(*server, WithCertificate(ca_, *rogue))->GetServerInfo().ok());
  auto client = Client(*server, WithCertificate(ca_, *alice));
  auto info = client->GetServerInfo();
  ATTN_ASSERT_OK(info);
  // The certificate's CN names the tenant.
  EXPECT_EQ(info->tenant(), "alice");
  ATTN_ASSERT_OK(client->CreateSession(MakeSpec(1, 1, 1, 8)));
  EXPECT_EQ(client->GetServerInfo()->tenant_sessions(), 1);
  EXPECT_EQ(server->engine().tenant_stats("alice").sessions, 1);
  // The health service works with the client certificate alone.
  auto health = client->CheckHealth();
  ATTN_ASSERT_OK(health);
  EXPECT_EQ(*health, client::ServingStatus::kServing);
}

TEST_F(SecurityTest, ReplacedCertificateFilesServeNewConnections) {
  server::ServerOptions options = TlsOptions();
  auto server = Start(options);
  ASSERT_NE(server, nullptr);
  ATTN_ASSERT_OK(Client(*server, TrustingCa(ca_))->GetServerInfo());

  auto new_ca = MakeCa(dir_, "new-ca");
  ATTN_ASSERT_OK(new_ca);
  auto new_cert = MakeCertificate(*new_ca, dir_, "new-server", "localhost",
                                  CertificateUse::kServer);
  ATTN_ASSERT_OK(new_cert);
  ASSERT_TRUE(WriteFileAtomically(options.tls_key_file,
                                  ReadFileOrEmpty(new_cert->key)));
  ASSERT_TRUE(WriteFileAtomically(options.tls_cert_file,
                                  ReadFileOrEmpty(new_cert->cert)));
  // Within a few refresh intervals, without a restart, a new connection
  // sees the new certificate...
  EXPECT_TRUE(Eventually(
      [&] {
        return Client(*server, TrustingCa(*new_ca))->GetServerInfo().ok();
      },
      absl::Seconds(20)));
  // ...and a client trusting only the old CA no longer accepts it.
  EXPECT_FALSE(Client(*server, TrustingCa(ca_))->GetServerInfo().ok());
}

// A client CA that no longer trusts a client shuts it out of the
// connection it already has: past --max_connection_age the connection is
// asked to go, the client's next call must reconnect and fails the
// handshake, and its open stream ends after the grace.
TEST_F(SecurityTest, AClientCaRotationReachesOpenConnections) {
  auto alice =
      MakeCertificate(ca_, dir_, "alice", "alice", CertificateUse::kClient);
  ATTN_ASSERT_OK(alice);
  auto new_ca = MakeCa(dir_, "new-client-ca");
  ATTN_ASSERT_OK(new_ca);
  auto bob =
      MakeCertificate(*new_ca, dir_, "bob", "bob", CertificateUse::kClient);
  ATTN_ASSERT_OK(bob);
  server::ServerOptions options = TlsOptions();
  options.tls_client_ca_file = absl::StrCat(dir_, "/live-client-ca.crt");
  ASSERT_TRUE(WriteFileAtomically(options.tls_client_ca_file,
                                  ReadFileOrEmpty(ca_.cert)));
  options.max_connection_age = absl::Seconds(1);
  options.max_connection_age_grace = absl::Seconds(1);
  auto server = Start(options);
  ASSERT_NE(server, nullptr);
  ClientOptions alice_options = WithCertificate(ca_, *alice);
  alice_options.retry_max_attempts = 1;
  auto client = Client(*server, alice_options);
  const v1::SessionSpec spec = MakeSpec(1, 1, 1, 8);
  auto session = client->OpenSession(spec);
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(spec, 256, 13);
  auto stream = client->OpenDecodeStream();
  auto step = [&](int t) { return StepToken(*stream, *session, tokens, t); };
  ATTN_ASSERT_OK(step(0));

  ASSERT_TRUE(WriteFileAtomically(options.tls_client_ca_file,
                                  ReadFileOrEmpty(new_ca->cert)));
  // Once the server has the new CA, a client it signed gets in...
  EXPECT_TRUE(Eventually(
      [&] {
        return Client(*server, WithCertificate(ca_, *bob))
            ->GetServerInfo()
            .ok();
      },
      absl::Seconds(20)));
  // ...and alice's connection, made before, is gone, her stream with it.
  EXPECT_TRUE(Eventually([&] { return !client->GetServerInfo().ok(); },
                         absl::Seconds(20)));
  int t = 1;
  EXPECT_TRUE(Eventually([&] { return t == 255 || !step(t++).ok(); },
                         absl::Seconds(20)));
  EXPECT_LT(t, 255);
}

// A server with bearer tokens: alice (2 sessions, 2 KV blocks of 4 KiB) and
// bob (no limit).
class TokenTest : public SecurityTest {
 protected:
  void SetUp() override {
    SecurityTest::SetUp();
    tokens_file_ = absl::StrCat(dir_, "/tokens");
    ASSERT_TRUE(WriteFileAtomically(tokens_file_, TokensFile("bob-token")));
    server::ServerOptions options = TestServerOptions();
    options.auth_tokens_file = tokens_file_;
    options.auth_reload_interval = absl::Milliseconds(100);
    server_ = Start(options);
    ASSERT_NE(server_, nullptr);
    alice_ = WithToken("alice-token");
    bob_ = WithToken("bob-token");
  }

  static std::string TokensFile(absl::string_view bob_token) {
    return absl::StrCat(
        "# tenant  sha256(token)  max_sessions  max_kv_bytes\n", "alice ",
        server::DigestTokenHex("alice-token"), "  2  8192\n", "bob   ",
        server::DigestTokenHex(bob_token), "  -  -   # no limits\n");
  }

  static ClientOptions TokenOptions(const std::string& token) {
    ClientOptions options;
    options.auth_token = token;
    return options;
  }

  std::unique_ptr<AttentionClient> WithToken(const std::string& token) {
    return Client(*server_, TokenOptions(token));
  }

  // A server with these tokens that keeps its sessions in a snapshot
  // directory across restarts.
  server::ServerOptions SnapshotDirOptions() const {
    server::ServerOptions options = TestServerOptions();
    options.auth_tokens_file = tokens_file_;
    options.snapshot_dir = absl::StrCat(dir_, "/snapshots");
    // The snapshot gets the second half of the drain: generous for slow
    // (sanitizer) builds; the drain still ends once the snapshot is written.
    options.drain_timeout = absl::Seconds(60);
    return options;
  }

  std::string tokens_file_;
  std::unique_ptr<server::AttentionServer> server_;
  std::unique_ptr<AttentionClient> alice_;
  std::unique_ptr<AttentionClient> bob_;
};

TEST_F(TokenTest, MissingOrWrongTokenIsUnauthenticatedButHealthWorks) {
  EXPECT_STREQ(server_->auth_mode(), "tokens");
  for (const std::string& token : {std::string(), std::string("wrong")}) {
    auto client = WithToken(token);
    ATTN_EXPECT_CODE(client->GetServerInfo(),
                     absl::StatusCode::kUnauthenticated);
    ATTN_EXPECT_CODE(client->CreateSession(MakeSpec(1, 1, 1, 8)),
                     absl::StatusCode::kUnauthenticated);
    ATTN_EXPECT_CODE(client->ListSessions(),
                     absl::StatusCode::kUnauthenticated);
    auto stream = client->OpenDecodeStream();
    ATTN_EXPECT_CODE(stream->Finish(), absl::StatusCode::kUnauthenticated);
    const ReflectionListing reflection = ListServicesByReflection(
        client->channel(), token.empty() ? "" : "Bearer " + token);
    EXPECT_EQ(reflection.status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << reflection.status.error_message();
    // Probes carry no token.
    auto health = client->CheckHealth("attention.v1.AttentionService");
    ATTN_ASSERT_OK(health);
    EXPECT_EQ(*health, client::ServingStatus::kServing);
  }
  // The message never quotes the token.
  const absl::Status wrong =
      WithToken("secret-guess")->GetServerInfo().status();
  EXPECT_EQ(wrong.message().find("secret-guess"), std::string::npos);
  const ReflectionListing reflection =
      ListServicesByReflection(alice_->channel(), "Bearer alice-token");
  EXPECT_TRUE(reflection.status.ok()) << reflection.status.error_message();
  EXPECT_THAT(reflection.services,
              ::testing::Contains("attention.v1.AttentionService"));
  auto info = alice_->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->tenant(), "alice");
  EXPECT_EQ(info->tenant_max_sessions(), 2);
  EXPECT_EQ(info->tenant_max_kv_bytes(), 8192);
}

TEST_F(TokenTest, ReflectionCanBeTurnedOff) {
  server::ServerOptions options = TestServerOptions();
  options.reflection = false;
  auto server = Start(options);
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(ListServicesByReflection(Client(*server, {})->channel())
                .status.error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(TokenTest, TenantsNeverSeeEachOthersSessions) {
  const v1::SessionSpec spec = MakeSpec(1, 2, 1, 8);
  auto mine = alice_->OpenSession(spec);
  ATTN_ASSERT_OK(mine);
  const Tokens tokens = RandomTokens(spec, 3, 1);
  ATTN_ASSERT_OK(mine->Prefill(0, tokens.q, tokens.k, tokens.v));
  auto before = alice_->GetSession(mine->id());
  ATTN_ASSERT_OK(before);
  auto bobs = bob_->OpenSession(spec);
  ATTN_ASSERT_OK(bobs);

  auto listed = bob_->ListSessions();
  ATTN_ASSERT_OK(listed);
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].session_id(), bobs->id());

  // Every call naming alice's session answers as for an unknown id.
  const std::string unknown_message = [&] {
    std::string message(bob_->GetSession("0123456789abcdef0123456789abcdef")
                            .status()
                            .message());
    return message;
  }();
  const Tokens one = RandomTokens(spec, 1, 2);
  SessionHandle foreign(bob_.get(), *before);
  std::vector<absl::Status> refused = {
      bob_->GetSession(mine->id()).status(),
      bob_->DeleteSession(mine->id()),
      bob_->ForkSession(mine->id()).status(),
      bob_->TruncateSession(mine->id(), 0).status(),
      foreign.Prefill(0, one.q, one.k, one.v).status(),
      foreign.DecodeStep(0, one.q, one.k, one.v).status(),
  };
  {
    auto stream = bob_->OpenDecodeStream();
    refused.push_back(
        stream->Step(*foreign.MakeDecodeRequest(0, one.q, one.k, one.v))
            .status());
  }
  {
    // One foreign session fails the whole batch.
    v1::BatchDecodeRequest batch;
    *batch.add_steps() = *bobs->MakeDecodeRequest(0, one.q, one.k, one.v);
    *batch.add_steps() = *foreign.MakeDecodeRequest(0, one.q, one.k, one.v);
    refused.push_back(bob_->BatchDecode(batch).status());
  }
  for (const absl::Status& status : refused) {
    EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
    const std::string shown =
        absl::StrCat("session '", mine->id(), "' not found");
    EXPECT_NE(status.message().find(shown), std::string::npos) << status;
  }
  const std::string expected = absl::StrCat(
      "session '", mine->id(), "'",
      unknown_message.substr(unknown_message.find("' not found") + 1));
  EXPECT_EQ(refused[0].message(), expected);

  auto after = alice_->GetSession(mine->id());
  ATTN_ASSERT_OK(after);
  EXPECT_EQ(after->SerializeAsString(), before->SerializeAsString());
  EXPECT_EQ(bob_->GetSession(bobs->id())->layer_lengths(0), 0);
}

TEST_F(TokenTest, QuotasRefuseAndRecoverAfterDeletes) {
  // 1 KV head of 64 dims: 512 bytes a token, 8 tokens a 4 KiB block.
  const v1::SessionSpec spec = MakeSpec(1, 1, 1, 64);
  auto first = alice_->OpenSession(spec);
  ATTN_ASSERT_OK(first);
  auto second = alice_->OpenSession(spec);
  ATTN_ASSERT_OK(second);
  const absl::Status third = alice_->CreateSession(spec).status();
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_NE(third.message().find("max_sessions is 2"), std::string::npos)
      << third;
  ATTN_EXPECT_OK(bob_->CreateSession(spec));  // bob is not limited

  const Tokens sixteen = RandomTokens(spec, 16, 3);
  ATTN_ASSERT_OK(first->Prefill(0, sixteen.q, sixteen.k, sixteen.v));
  const Tokens one = RandomTokens(spec, 1, 4);
  const absl::Status full = second->Prefill(0, one.q, one.k, one.v).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("uses 8192 bytes"), std::string::npos) << full;
  EXPECT_NE(full.message().find("max_kv_bytes of 8192"), std::string::npos)
      << full;
  EXPECT_EQ(alice_->GetSession(second->id())->layer_lengths(0), 0);
  auto info = alice_->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->tenant_sessions(), 2);
  EXPECT_EQ(info->tenant_kv_bytes(), 8192);
  const std::string metrics = server_->metrics().TextExposition();
  EXPECT_NE(metrics.find("attention_tenant_kv_bytes{tenant=\"alice\"} 8192"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("attention_tenant_sessions{tenant=\"bob\"} 1"),
            std::string::npos);

  ATTN_ASSERT_OK(alice_->DeleteSession(first->id()));
  ATTN_EXPECT_OK(second->Prefill(0, one.q, one.k, one.v));
  ATTN_EXPECT_OK(alice_->CreateSession(spec));
}

TEST_F(TokenTest, UnparseableRequestsOfStrangersAreUnauthenticated) {
  const std::string garbage = "\xff\xff\xff\xff\x0f";
  auto call = [&](const char* method, const std::string& token) {
    return RawUnaryCall(alice_->channel(), method, garbage,
                        token.empty() ? "" : absl::StrCat("Bearer ", token));
  };
  for (const char* method : {"/attention.v1.AttentionService/Prefill",
                             "/attention.v1.AttentionService/GetSession"}) {
    for (const std::string& token : {std::string(), std::string("wrong")}) {
      EXPECT_EQ(call(method, token).error_code(),
                grpc::StatusCode::UNAUTHENTICATED)
          << method << " with token '" << token << "'";
    }
    EXPECT_EQ(call(method, "alice-token").error_code(),
              grpc::StatusCode::INVALID_ARGUMENT)
        << method;
  }
}

TEST_F(TokenTest, ARevokedTokenEndsAnOpenDecodeStream) {
  const v1::SessionSpec spec = MakeSpec(1, 1, 1, 64);
  auto mine = alice_->OpenSession(spec);
  ATTN_ASSERT_OK(mine);
  const Tokens tokens = RandomTokens(spec, 2, 11);
  auto stream = alice_->OpenDecodeStream();
  auto step = [&](int t) { return StepToken(*stream, *mine, tokens, t); };
  ATTN_ASSERT_OK(step(0));
  // Alice's line goes: her open stream must not outlive her token.
  ASSERT_TRUE(WriteFileAtomically(
      tokens_file_,
      absl::StrCat("bob ", server::DigestTokenHex("bob-token"), " - -\n")));
  ATTN_ASSERT_OK(server_->ReloadAuthTokens());
  const absl::Status refused = step(1).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnauthenticated) << refused;
  EXPECT_NE(refused.message().find("requests[1]"), std::string::npos)
      << refused;
  // The refused step changed nothing.
  const Tenant alice{.name = "alice", .quota = {}};
  auto info = server_->engine().GetSession(mine->id(), alice);
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths[0], 1);
}

// A stream that waits for its client sees a revoked token at once: it ends
// and lets go of the sessions it kept from expiring, although its client
// sends nothing more (a silent stream would otherwise hold them as long as
// its connection lived).
TEST_F(TokenTest, ARevokedTokenEndsAnIdleDecodeStreamAndItsHolds) {
  const v1::SessionSpec spec = MakeSpec(1, 1, 1, 64);
  auto mine = alice_->OpenSession(spec, absl::Seconds(1));
  ATTN_ASSERT_OK(mine);
  const Tokens tokens = RandomTokens(spec, 1, 13);
  auto stream = alice_->OpenDecodeStream();
  ATTN_ASSERT_OK(stream->Step(*mine->MakeDecodeRequest(
      0, tokens.q_rows(0, 1), tokens.k_rows(0, 1), tokens.v_rows(0, 1))));
  ASSERT_TRUE(WriteFileAtomically(
      tokens_file_,
      absl::StrCat("bob ", server::DigestTokenHex("bob-token"), " - -\n")));
  ATTN_ASSERT_OK(server_->ReloadAuthTokens());
  const Tenant alice{.name = "alice", .quota = {}};
  EXPECT_TRUE(Eventually(
      [&] { return server_->engine().ListSessions("", 10, alice).empty(); },
      absl::Seconds(20)))
      << "alice's session never expired while her idle stream was open";
  const absl::Status ended = stream->Finish();
  EXPECT_EQ(ended.code(), absl::StatusCode::kUnauthenticated) << ended;
  EXPECT_NE(ended.message().find("requests[1]"), std::string::npos) << ended;
  // The stream ended on the server too (its pending read was let go).
  EXPECT_TRUE(Eventually([&] { return server_->calls_in_flight() == 0; },
                         absl::Seconds(10)));
}

// The same for a stream whose client stops reading: the step's reply of
// 4 MB waits in a write the client's flow-control window holds up, and no
// reaction of the stream runs until the client reads or goes away. The
// revocation lets its sessions go all the same.
TEST_F(TokenTest, ARevokedTokenLetsGoTheSessionsOfAStreamThatStopsReading) {
  // 1024 heads of 1024: a 4 MB reply, one float16 token per 4 KiB block.
  const v1::SessionSpec spec =
      MakeSpec(1, 1024, 1, 1024, {}, v1::DTYPE_FLOAT16);
  auto mine = alice_->OpenSession(spec, absl::Seconds(1));
  ATTN_ASSERT_OK(mine);
  const int64_t rows = 1;
  const Tokens tokens = RandomTokens(spec, rows, 14);
  auto request =
      mine->MakeDecodeRequest(0, tokens.q_rows(0, rows), tokens.k_rows(0, rows),
                              tokens.v_rows(0, rows));
  ATTN_ASSERT_OK(request);
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer alice-token");
  auto stream = alice_->stub()->Decode(&context);
  ASSERT_TRUE(stream->Write(*request)) << stream->Finish().error_message();
  const Tenant alice{.name = "alice", .quota = {}};
  const auto sessions = [&] {
    return server_->engine().ListSessions("", 10, alice);
  };
  // The step is applied; its reply is on its way (and stays there).
  ASSERT_TRUE(Eventually(
      [&] {
        const auto listed = sessions();
        return listed.size() == 1 && listed[0].layer_lengths[0] == rows;
      },
      absl::Seconds(20)));
  ASSERT_TRUE(WriteFileAtomically(
      tokens_file_,
      absl::StrCat("bob ", server::DigestTokenHex("bob-token"), " - -\n")));
  ATTN_ASSERT_OK(server_->ReloadAuthTokens());
  EXPECT_TRUE(Eventually([&] { return sessions().empty(); }, absl::Seconds(20)))
      << "alice's session never expired while her stream held a reply";
  context.TryCancel();
  EXPECT_FALSE(stream->Finish().ok());
  EXPECT_TRUE(Eventually([&] { return server_->calls_in_flight() == 0; },
                         absl::Seconds(10)));
}

// A stream keeps the sessions it has used from expiring only for the tenant
// its token names: when a reload moves the token to another tenant, the
// old tenant's sessions are let go (their idle clocks run again).
TEST_F(TokenTest, AStreamWhoseTokenChangesTenantLetsTheOldSessionsGo) {
  const v1::SessionSpec spec = MakeSpec(1, 1, 1, 64);
  auto old_session = alice_->OpenSession(spec, absl::Seconds(1));
  ATTN_ASSERT_OK(old_session);
  const Tokens tokens = RandomTokens(spec, 2, 12);
  auto stream = alice_->OpenDecodeStream();
  auto step = [&](SessionHandle& session) {
    return stream->Step(*session.MakeDecodeRequest(
        0, tokens.q_rows(0, 1), tokens.k_rows(0, 1), tokens.v_rows(0, 1)));
  };
  ATTN_ASSERT_OK(step(*old_session));
  ASSERT_TRUE(WriteFileAtomically(
      tokens_file_,
      absl::StrCat("carol ", server::DigestTokenHex("alice-token"), " - -\n",
                   "bob ", server::DigestTokenHex("bob-token"), " - -\n")));
  ATTN_ASSERT_OK(server_->ReloadAuthTokens());
  auto new_session = alice_->OpenSession(spec);  // carol's now
  ATTN_ASSERT_OK(new_session);
  // No step needed: the reload reached the waiting stream. Listing does
  // not use a session, so it leaves the idle clock running.
  EXPECT_TRUE(Eventually(
      [&] {
        return server_->engine()
            .ListSessions("", 10, Tenant{.name = "alice", .quota = {}})
            .empty();
      },
      absl::Seconds(20)))
      << "alice's session never expired while carol's stream was open";
  ATTN_EXPECT_OK(step(*new_session));
  ATTN_EXPECT_OK(stream->Finish());
}

TEST_F(TokenTest, TokensFileEditTakesEffectWithoutRestart) {
  ATTN_ASSERT_OK(bob_->GetServerInfo());
  ASSERT_TRUE(WriteFileAtomically(tokens_file_, TokensFile("bob-new-token")));
  auto renewed = WithToken("bob-new-token");
  EXPECT_TRUE(Eventually([&] { return renewed->GetServerInfo().ok(); },
                         absl::Seconds(10)));
  ATTN_EXPECT_CODE(bob_->GetServerInfo(), absl::StatusCode::kUnauthenticated);

  // A file that does not parse leaves the previous one in force.
  ASSERT_TRUE(WriteFileAtomically(tokens_file_, "alice not-a-digest - -\n"));
  const absl::Status reload = server_->ReloadAuthTokens();
  EXPECT_EQ(reload.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(reload.message().find("line 1"), std::string::npos) << reload;
  absl::SleepFor(absl::Milliseconds(300));  // the watcher saw it too
  ATTN_EXPECT_OK(renewed->GetServerInfo());
  ATTN_EXPECT_OK(alice_->GetServerInfo());
}

// The records of `client`'s export of session `id`.
absl::StatusOr<std::vector<v1::SessionChunk>> Export(AttentionClient& client,
                                                     const std::string& id) {
  std::vector<v1::SessionChunk> records;
  ATTN_RETURN_IF_ERROR(
      client.ExportSession(id, [&](const v1::SessionChunk& record) {
        records.push_back(record);
        return absl::OkStatus();
      }));
  return records;
}

absl::StatusOr<v1::SessionInfo> Import(
    AttentionClient& client, const std::vector<v1::SessionChunk>& records,
    bool keep_session_id = false) {
  size_t next = 0;
  return client.ImportSession(
      [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
        if (next == records.size()) return false;
        *record = records[next++];
        return true;
      },
      keep_session_id);
}

TEST_F(TokenTest, KeepingASessionIdCannotProbeOtherTenantsIds) {
  const v1::SessionSpec spec = MakeSpec(1, 1, 1, 64);
  auto alices = alice_->OpenSession(spec);
  ATTN_ASSERT_OK(alices);
  auto bobs = bob_->OpenSession(spec);
  ATTN_ASSERT_OK(bobs);
  auto records = Export(*bob_, bobs->id());
  ATTN_ASSERT_OK(records);
  // Bob's snapshot renamed to alice's live id, and to an unused one (the
  // id is not checksummed): the same refusal, so he learns nothing.
  const int64_t blocks = server_->engine().stats().pool.blocks_used;
  std::vector<std::string> messages;
  for (const std::string& id :
       {alices->id(), std::string("0123456789abcdef0123456789abcdef")}) {
    std::vector<v1::SessionChunk> renamed = *records;
    renamed.front().mutable_header()->set_session_id(id);
    const absl::Status status =
        Import(*bob_, renamed, /*keep_session_id=*/true).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
    messages.emplace_back(status.message());
  }
  EXPECT_EQ(messages[0], messages[1]);
  EXPECT_EQ(server_->engine().stats().pool.blocks_used, blocks);
  EXPECT_EQ(bob_->GetServerInfo()->tenant_sessions(), 1);
  // Without keep_session_id the import gets a new id, as always.
  auto copy = Import(*bob_, *records);
  ATTN_ASSERT_OK(copy);
  EXPECT_NE(copy->session_id(), bobs->id());
}

// A revoked token also ends the transfers it has open: an import is
// refused at its next record and creates nothing, an export stops at its
// next record.
TEST_F(TokenTest, ARevokedTokenEndsOpenTransfers) {
  // 8 layers of 4 KV heads of 128 float32 dims: 32 KiB a token (a 4 KiB
  // block per layer), so the 512 tokens' export (16 MiB in 1 MiB records)
  // cannot all be sent before the client reads.
  const v1::SessionSpec spec = MakeSpec(8, 4, 4, 128);
  auto bobs = bob_->OpenSession(spec);
  ATTN_ASSERT_OK(bobs);
  const Tokens tokens = RandomTokens(spec, 512, 13);
  for (int layer = 0; layer < 8; ++layer) {
    ATTN_ASSERT_OK(bobs->Prefill(layer, tokens.q_rows(0, 512),
                                 tokens.k_rows(0, 512), tokens.v_rows(0, 512)));
  }
  auto records = Export(*bob_, bobs->id());
  ATTN_ASSERT_OK(records);
  ASSERT_GT(records->size(), 8u);
  const auto revoke_bob = [&] {
    EXPECT_TRUE(WriteFileAtomically(
        tokens_file_,
        absl::StrCat("alice ", server::DigestTokenHex("alice-token"),
                     " - -\n")));
    EXPECT_TRUE(server_->ReloadAuthTokens().ok());
  };
  const auto restore_bob = [&] {
    EXPECT_TRUE(WriteFileAtomically(tokens_file_, TokensFile("bob-token")));
    EXPECT_TRUE(server_->ReloadAuthTokens().ok());
  };

  size_t next = 0;
  auto imported = bob_->ImportSession(
      [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
        if (next == 2) revoke_bob();
        if (next == records->size()) return false;
        *record = (*records)[next++];
        return true;
      });
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kUnauthenticated)
      << imported.status();
  restore_bob();
  EXPECT_EQ(bob_->GetServerInfo()->tenant_sessions(), 1);

  size_t received = 0;
  const absl::Status exported =
      bob_->ExportSession(bobs->id(), [&](const v1::SessionChunk&) {
        if (++received == 1) revoke_bob();
        return absl::OkStatus();
      });
  EXPECT_EQ(exported.code(), absl::StatusCode::kUnauthenticated) << exported;
  EXPECT_LT(received, records->size());
  restore_bob();
}

TEST_F(TokenTest, SnapshotsCarryTheirTenantAndCountTowardsTheImporter) {
  // 1 KV head of 64 dims: 512 bytes a token, 8 tokens a 4 KiB block.
  const v1::SessionSpec spec = MakeSpec(1, 1, 1, 64);
  auto mine = alice_->OpenSession(spec);
  ATTN_ASSERT_OK(mine);
  const Tokens sixteen = RandomTokens(spec, 16, 5);
  ATTN_ASSERT_OK(mine->Prefill(0, sixteen.q_rows(0, 8), sixteen.k_rows(0, 8),
                               sixteen.v_rows(0, 8)));

  // Bob cannot export alice's session: the same answer as an unknown id.
  const absl::Status foreign = Export(*bob_, mine->id()).status();
  EXPECT_EQ(foreign.code(), absl::StatusCode::kNotFound) << foreign;
  const std::string unknown_message(
      Export(*bob_, "0123456789abcdef0123456789abcdef").status().message());
  EXPECT_EQ(foreign.message(),
            absl::StrCat("session '", mine->id(), "'",
                         unknown_message.substr(
                             unknown_message.find("' not found") + 1)));

  auto records = Export(*alice_, mine->id());
  ATTN_ASSERT_OK(records);
  ASSERT_TRUE(records->front().has_header());
  EXPECT_EQ(records->front().header().owner(), "alice");

  // An import belongs to the importing tenant, whatever the header says.
  auto bobs = Import(*bob_, *records);
  ATTN_ASSERT_OK(bobs);
  ATTN_EXPECT_OK(bob_->GetSession(bobs->session_id()));
  ATTN_EXPECT_CODE(alice_->GetSession(bobs->session_id()),
                   absl::StatusCode::kNotFound);
  EXPECT_EQ(bob_->GetServerInfo()->tenant_sessions(), 1);

  // It counts towards alice's quotas when she imports: 2 sessions, 8 KiB.
  auto copy = Import(*alice_, *records);
  ATTN_ASSERT_OK(copy);
  auto info = alice_->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->tenant_sessions(), 2);
  EXPECT_EQ(info->tenant_kv_bytes(), 8192);
  const absl::Status third = Import(*alice_, *records).status();
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_NE(third.message().find("max_sessions"), std::string::npos) << third;

  // Checked from the header, before any data: alice's KV quota is full.
  ATTN_ASSERT_OK(alice_->DeleteSession(copy->session_id()));
  ATTN_ASSERT_OK(mine->Prefill(0, sixteen.q_rows(8, 8), sixteen.k_rows(8, 8),
                               sixteen.v_rows(8, 8)));
  const int64_t used_blocks = server_->engine().stats().pool.blocks_used;
  const absl::Status full = Import(*alice_, *records).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("max_kv_bytes of 8192"), std::string::npos)
      << full;
  EXPECT_NE(full.message().find("uses 8192 bytes"), std::string::npos) << full;
  // Nothing stays behind.
  info = alice_->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->tenant_sessions(), 1);
  EXPECT_EQ(info->tenant_kv_bytes(), 8192);
  EXPECT_EQ(server_->engine().stats().pool.blocks_used, used_blocks);
  EXPECT_EQ(alice_->ListSessions()->size(), 1u);
}

TEST_F(TokenTest, SnapshotDirRestoresEverySessionToItsOwner) {
  const server::ServerOptions options = SnapshotDirOptions();
  auto first = Start(options);
  ASSERT_NE(first, nullptr);
  const ClientOptions alice_options = TokenOptions("alice-token");
  const ClientOptions bob_options = TokenOptions("bob-token");
  const v1::SessionSpec spec = MakeSpec(1, 1, 1, 64);
  std::string id;
  {
    auto alice = Client(*first, alice_options);
    auto session = alice->OpenSession(spec);
    ATTN_ASSERT_OK(session);
    const Tokens tokens = RandomTokens(spec, 5, 6);
    ATTN_ASSERT_OK(session->Prefill(0, tokens.q, tokens.k, tokens.v));
    id = session->id();
  }
  first->Shutdown();
  first.reset();

  auto second = Start(options);
  ASSERT_NE(second, nullptr);
  auto alice = Client(*second, alice_options);
  auto bob = Client(*second, bob_options);
  auto restored = alice->GetSession(id);
  ATTN_ASSERT_OK(restored);
  EXPECT_EQ(restored->layer_lengths(0), 5);
  ATTN_EXPECT_CODE(bob->GetSession(id), absl::StatusCode::kNotFound);
  ATTN_EXPECT_CODE(Export(*bob, id), absl::StatusCode::kNotFound);
  EXPECT_TRUE(bob->ListSessions()->empty());
  auto info = alice->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->tenant_sessions(), 1);
  EXPECT_EQ(info->tenant_kv_bytes(), 4096);
}

// Restored forks come back as whole copies and can pass their owner's
// quota: the sessions within each owner's quota restore first, so that one
// tenant's forks never take the room of another tenant's sessions, and the
// rest only into the room left.
TEST_F(TokenTest, SnapshotRestoreFillsEveryTenantsQuotaBeforeForks) {
  server::ServerOptions options = SnapshotDirOptions();
  const ClientOptions alice_options = TokenOptions("alice-token");
  const ClientOptions bob_options = TokenOptions("bob-token");
  // 8 tokens per 4 KiB block: alice's prompt takes 2 blocks, all of her
  // max_kv_bytes (8192); its fork shares them while live.
  const v1::SessionSpec spec = MakeSpec(1, 1, 1, 64);
  std::string prompt_id, fork_id, bob_id;
  {
    auto first = Start(options);
    ASSERT_NE(first, nullptr);
    auto alice = Client(*first, alice_options);
    auto bob = Client(*first, bob_options);
    auto prompt = alice->OpenSession(spec);
    ATTN_ASSERT_OK(prompt);
    const Tokens tokens = RandomTokens(spec, 16, 7);
    ATTN_ASSERT_OK(prompt->Prefill(0, tokens.q, tokens.k, tokens.v));
    auto fork = prompt->Fork();
    ATTN_ASSERT_OK(fork);
    auto mine = bob->OpenSession(spec);
    ATTN_ASSERT_OK(mine);
    ATTN_ASSERT_OK(mine->Prefill(0, tokens.q_rows(0, 4), tokens.k_rows(0, 4),
                                 tokens.v_rows(0, 4)));
    prompt_id = prompt->id();
    fork_id = fork->id();
    bob_id = mine->id();
    first->Shutdown();
  }
  const auto alice_lengths = [&](server::AttentionServer& server) {
    auto alice = Client(server, alice_options);
    std::vector<int64_t> lengths;
    for (const std::string& id : {prompt_id, fork_id}) {
      auto info = alice->GetSession(id);
      if (info.ok()) lengths.push_back(info->layer_lengths(0));
    }
    return lengths;
  };

  // Room for 4 of the 5 blocks the copies need: one of alice's two (her
  // quota full) and bob's session, whatever order the files are read in;
  // her other one stays on disk.
  options.kv_cache_bytes = 4 * 4096;
  {
    auto second = Start(options);
    ASSERT_NE(second, nullptr);
    auto bob = Client(*second, bob_options);
    auto restored = bob->GetSession(bob_id);
    ATTN_ASSERT_OK(restored);
    EXPECT_EQ(restored->layer_lengths(0), 4);
    EXPECT_EQ(alice_lengths(*second), std::vector<int64_t>{16});
    int on_disk = 0;
    for (const std::string& id : {prompt_id, fork_id}) {
      on_disk += std::filesystem::exists(
          absl::StrCat(options.snapshot_dir, "/", id, ".session"));
    }
    EXPECT_EQ(on_disk, 1);
    second->Shutdown();
  }

  // With room for every copy the fork restores too, past alice's quota.
  options.kv_cache_bytes = int64_t{64} << 20;
  auto third = Start(options);
  ASSERT_NE(third, nullptr);
  EXPECT_EQ(alice_lengths(*third), (std::vector<int64_t>{16, 16}));
  auto alice = Client(*third, alice_options);
  auto info = alice->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->tenant_sessions(), 2);
  EXPECT_EQ(info->tenant_kv_bytes(), 4 * 4096);
  // Over her quota, her new sessions wait for her to delete some.
  ATTN_EXPECT_CODE(alice->CreateSession(spec),
                   absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace attention::testing
