// What the server offers besides the attention API: server info, the
// grpc.health.v1 health service, server reflection, and graceful shutdown.
#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
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

// Runs one async operation on `cq` and returns whether it succeeded.
bool Await(grpc::CompletionQueue& cq, void* tag) {
  void* got = nullptr;
  bool ok = false;
  if (!cq.Next(&got, &ok)) return false;
  EXPECT_EQ(got, tag);
  return ok;
}

TEST_F(ServerServicesTest, ReflectionListsTheServices) {
  // ServerReflectionRequest{list_services: ""} (field 7), hand-encoded: the
  // reflection protos are not installed by the gRPC packages.
  const std::string request_bytes("\x3a\x00", 2);
  grpc::GenericStub stub(client().channel());
  grpc::ClientContext context;
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(
      &context,
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  int tags[5];
  call->StartCall(&tags[0]);
  ASSERT_TRUE(Await(cq, &tags[0]));
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  call->Write(request, &tags[1]);
  ASSERT_TRUE(Await(cq, &tags[1]));
  grpc::ByteBuffer response;
  call->Read(&response, &tags[2]);
  ASSERT_TRUE(Await(cq, &tags[2]));
  call->WritesDone(&tags[3]);
  ASSERT_TRUE(Await(cq, &tags[3]));
  grpc::Status status;
  call->Finish(&status, &tags[4]);
  ASSERT_TRUE(Await(cq, &tags[4]));
  EXPECT_TRUE(status.ok()) << status.error_message();
  cq.Shutdown();

  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  // ServerReflectionResponse.list_services_response (6) .service (1) .name (1)
  google::protobuf::UnknownFieldSet message;
  ASSERT_TRUE(message.ParseFromString(bytes));
  std::vector<std::string> names;
  for (int i = 0; i < message.field_count(); ++i) {
    if (message.field(i).number() != 6) continue;
    google::protobuf::UnknownFieldSet list;
    ASSERT_TRUE(list.ParseFromString(message.field(i).length_delimited()));
    for (int j = 0; j < list.field_count(); ++j) {
      google::protobuf::UnknownFieldSet service;
      ASSERT_TRUE(service.ParseFromString(list.field(j).length_delimited()));
      for (int k = 0; k < service.field_count(); ++k) {
        names.push_back(service.field(k).length_delimited());
      }
    }
  }
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
