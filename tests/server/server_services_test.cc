// What the server offers besides the attention API: server info, the
// grpc.health.v1 health service, server reflection, and graceful shutdown.
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/reflection_client.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

class ServerServicesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server::ServerOptions options = TestServerOptions();
    options.drain_timeout = absl::Seconds(60);
    auto server = StartTestServer(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  client::AttentionClient& client() { return *server_->client; }

  std::unique_ptr<TestServer> server_;
};

TEST_F(ServerServicesTest, ServerInfoDescribesTheServer) {
  auto info = client().GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->version(), server::ServerVersion());
  EXPECT_EQ(info->backend(), "cpu");
  EXPECT_FALSE(info->device().empty());
  EXPECT_EQ(info->kv_cache_capacity_bytes(),
            TestServerOptions().kv_cache_bytes);
  EXPECT_EQ(info->kv_cache_used_bytes(), 0);
  EXPECT_EQ(info->active_sessions(), 0);
  EXPECT_EQ(info->max_message_bytes(), TestServerOptions().max_message_bytes);
  EXPECT_GT(server_->server->port(), 0);
  // What a placer needs (see the proto's "Fleets").
  EXPECT_EQ(info->advertise_address(),
            absl::StrCat("127.0.0.1:", server_->server->port()));
  EXPECT_FALSE(info->draining());
  EXPECT_EQ(info->queued_steps(), 0);
  EXPECT_EQ(info->kv_cache_free_bytes(), TestServerOptions().kv_cache_bytes);

  auto session = client().OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 3, 1);
  ATTN_ASSERT_OK(session->Prefill(0, tokens.q, tokens.k, tokens.v));
  auto used = client().GetServerInfo();
  ATTN_ASSERT_OK(used);
  EXPECT_GT(used->kv_cache_used_bytes(), 0);
  EXPECT_EQ(used->kv_cache_free_bytes(),
            used->kv_cache_capacity_bytes() - used->kv_cache_used_bytes());
}

TEST_F(ServerServicesTest, EverySessionInfoNamesTheOwner) {
  const std::string owner = server_->server->advertise_address();
  EXPECT_EQ(owner, absl::StrCat("127.0.0.1:", server_->server->port()));
  auto created = client().CreateSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(created);
  EXPECT_EQ(created->owner(), owner);
  auto got = client().GetSession(created->session_id());
  ATTN_ASSERT_OK(got);
  EXPECT_EQ(got->owner(), owner);
  auto fork = client().ForkSession(created->session_id());
  ATTN_ASSERT_OK(fork);
  EXPECT_EQ(fork->owner(), owner);
  auto truncated = client().TruncateSession(created->session_id(), 0);
  ATTN_ASSERT_OK(truncated);
  EXPECT_EQ(truncated->owner(), owner);
  auto listed = client().ListSessions();
  ATTN_ASSERT_OK(listed);
  ASSERT_EQ(listed->size(), 2u);
  for (const v1::SessionInfo& info : *listed) EXPECT_EQ(info.owner(), owner);
  std::vector<v1::SessionChunk> chunks;
  ATTN_ASSERT_OK(client().ExportSession(
      created->session_id(),
      [&](const v1::SessionChunk& chunk) -> absl::Status {
        chunks.push_back(chunk);
        return absl::OkStatus();
      }));
  size_t next = 0;
  auto imported = client().ImportSession(
      [&](v1::SessionChunk* chunk) -> absl::StatusOr<bool> {
        if (next == chunks.size()) return false;
        *chunk = chunks[next++];
        return true;
      });
  ATTN_ASSERT_OK(imported);
  EXPECT_EQ(imported->owner(), owner);
}

TEST(AdvertiseAddressTest, TheFlagNamesTheOwner) {
  server::ServerOptions options = TestServerOptions();
  options.advertise_address = "replica-7.attention.example:50051";
  auto server = StartTestServer(options);
  ATTN_ASSERT_OK(server);
  auto info = (*server)->client->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->advertise_address(), options.advertise_address);
  auto created = (*server)->client->CreateSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(created);
  EXPECT_EQ(created->owner(), options.advertise_address);
}

TEST(AdvertiseAddressTest, AMalformedAddressIsRefused) {
  for (const char* bad : {"no-port", ":50051", "host:0", "host:65536",
                          "host:http", "::1:50051"}) {
    server::ServerOptions options = TestServerOptions();
    options.advertise_address = bad;
    auto server = server::AttentionServer::Start(options);
    ATTN_EXPECT_CODE(server, absl::StatusCode::kInvalidArgument);
    if (!server.ok()) {
      EXPECT_THAT(std::string(server.status().message()),
                  ::testing::HasSubstr("advertise_address"));
    }
  }
}

TEST(TenantQueueShareOptionTest, ASharePastOneOrNotPositiveIsRefused) {
  for (const double bad : {0.0, -0.5, 1.5, std::nan("")}) {
    server::ServerOptions options = TestServerOptions();
    options.tenant_queue_share = bad;
    auto server = server::AttentionServer::Start(options);
    ATTN_EXPECT_CODE(server, absl::StatusCode::kInvalidArgument);
    if (!server.ok()) {
      EXPECT_THAT(std::string(server.status().message()),
                  ::testing::HasSubstr("tenant_queue_share"));
    }
  }
  server::ServerOptions options = TestServerOptions();
  options.tenant_queue_share = 0.25;
  ATTN_EXPECT_OK(StartTestServer(options));
}

TEST_F(ServerServicesTest, HealthServiceReportsServing) {
  auto overall = client().CheckHealth();
  ATTN_ASSERT_OK(overall);
  EXPECT_EQ(*overall, client::ServingStatus::kServing);
  auto service = client().CheckHealth("attention.v1.AttentionService");
  ATTN_ASSERT_OK(service);
  EXPECT_EQ(*service, client::ServingStatus::kServing);
  ATTN_EXPECT_CODE(client().CheckHealth("no.such.Service"),
                   absl::StatusCode::kNotFound);

  server_->server->SetServing(false);
  auto draining = client().CheckHealth();
  ATTN_ASSERT_OK(draining);
  EXPECT_EQ(*draining, client::ServingStatus::kNotServing);
}

TEST_F(ServerServicesTest, ReflectionListsTheServices) {
  const ReflectionListing listing =
      ListServicesByReflection(client().channel());
  EXPECT_TRUE(listing.status.ok()) << listing.status.error_message();
  const std::vector<std::string>& names = listing.services;
  EXPECT_THAT(names, ::testing::Contains("attention.v1.AttentionService"));
  EXPECT_THAT(names, ::testing::Contains("grpc.health.v1.Health"));
}

TEST_F(ServerServicesTest, ShutdownLetsInFlightStreamsFinish) {
  auto session = client().OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 2, 1);
  auto stream = client().OpenDecodeStream();
  auto first = stream->Step(*session->MakeDecodeRequest(
      0, tokens.q_rows(0, 1), tokens.k_rows(0, 1), tokens.v_rows(0, 1)));
  ATTN_ASSERT_OK(first);

  std::thread shutdown([this] { server_->server->Shutdown(); });
  // Wait until shutdown has begun: health stops reporting SERVING.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    auto health = client().CheckHealth();
    if (!health.ok() || *health != client::ServingStatus::kServing) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  // Placers see the replica draining.
  auto info = client().GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_TRUE(info->draining());
  // The open stream is still served.
  auto second = stream->Step(*session->MakeDecodeRequest(
      0, tokens.q_rows(1, 1), tokens.k_rows(1, 1), tokens.v_rows(1, 1)));
  ATTN_EXPECT_OK(second);
  if (second.ok()) {
    EXPECT_EQ(second->position(), 1);
  }
  ATTN_EXPECT_OK(stream->Finish());
  shutdown.join();
  // New calls are refused.
  ATTN_EXPECT_CODE(client().GetServerInfo(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace attention::testing
