// The server's reflection service over a real server and gRPC's generic
// stub (requests and responses as bytes on the wire): the descriptors a
// client such as grpcurl needs to call the API, with every file they
// import; answers for questions without one, after which the stream goes
// on; and a request that would parse into far more memory than its size,
// which is refused before it is parsed, as the API's requests are.
#include "server/reflection_service.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/descriptor_database.h>

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/server/reflection_client.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

using grpc::reflection::v1alpha::ServerReflectionRequest;
using grpc::reflection::v1alpha::ServerReflectionResponse;

class ReflectionServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = StartTestServer();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  // One stream carrying `requests`; each must be answered.
  std::vector<ServerReflectionResponse> Ask(
      const std::vector<ServerReflectionRequest>& requests) {
    std::vector<std::string> encoded;
    for (const ServerReflectionRequest& request : requests) {
      encoded.push_back(request.SerializeAsString());
    }
    const ReflectionExchange exchange =
        ExchangeWithReflection(server_->client->channel(), encoded);
    EXPECT_TRUE(exchange.status.ok()) << exchange.status.error_message();
    EXPECT_EQ(exchange.responses.size(), requests.size());
    std::vector<ServerReflectionResponse> responses;
    for (const std::string& bytes : exchange.responses) {
      EXPECT_TRUE(responses.emplace_back().ParseFromString(bytes));
    }
    return responses;
  }

  std::unique_ptr<TestServer> server_;
};

ServerReflectionRequest SymbolRequest(const std::string& symbol) {
  ServerReflectionRequest request;
  request.set_file_containing_symbol(symbol);
  return request;
}

ServerReflectionRequest FileRequest(const std::string& name) {
  ServerReflectionRequest request;
  request.set_file_by_filename(name);
  return request;
}

// The files of `response` alone, as a database a pool builds from (in any
// order): a type builds only when the response carries every file its file
// imports, directly or not.
struct ResponseFiles {
  explicit ResponseFiles(const ServerReflectionResponse& response) {
    for (const std::string& bytes :
         response.file_descriptor_response().file_descriptor_proto()) {
      google::protobuf::FileDescriptorProto file;
      EXPECT_TRUE(file.ParseFromString(bytes));
      names.push_back(file.name());
      EXPECT_TRUE(database.Add(file)) << file.name();
    }
  }
  google::protobuf::SimpleDescriptorDatabase database;
  google::protobuf::DescriptorPool pool{&database};
  std::vector<std::string> names;  // in response order
};

TEST_F(ReflectionServiceTest, DescribesTheApiWithEveryFileItImports) {
  const std::vector<ServerReflectionResponse> responses =
      Ask({SymbolRequest("attention.v1.AttentionService"),
           SymbolRequest("attention.v1.DecodeRequest"),
           FileRequest("attention/v1/attention.proto")});
  ASSERT_EQ(responses.size(), 3u);
  for (const ServerReflectionResponse& response : responses) {
    ASSERT_TRUE(response.has_file_descriptor_response())
        << response.DebugString();
    ResponseFiles files(response);
    ASSERT_FALSE(files.names.empty());
    EXPECT_EQ(files.names[0], "attention/v1/attention.proto");
    const google::protobuf::ServiceDescriptor* service =
        files.pool.FindServiceByName("attention.v1.AttentionService");
    ASSERT_NE(service, nullptr);
    const google::protobuf::MethodDescriptor* decode =
        service->FindMethodByName("Decode");
    ASSERT_NE(decode, nullptr);
    EXPECT_TRUE(decode->client_streaming());
    EXPECT_TRUE(decode->server_streaming());
    EXPECT_EQ(decode->input_type()->full_name(), "attention.v1.DecodeRequest");
  }
  // A file whose imports share one (api.proto imports type.proto and
  // source_context.proto; type.proto imports source_context.proto and
  // any.proto): each comes once, and the type builds from them alone.
  const std::vector<ServerReflectionResponse> api =
      Ask({SymbolRequest("google.protobuf.Api")});
  ASSERT_EQ(api.size(), 1u);
  ResponseFiles api_files(api[0]);
  EXPECT_EQ(api_files.names.size(), 4u);
  EXPECT_EQ(api_files.names[0], "google/protobuf/api.proto");
  const google::protobuf::Descriptor* api_type =
      api_files.pool.FindMessageTypeByName("google.protobuf.Api");
  ASSERT_NE(api_type, nullptr);
  EXPECT_EQ(api_type->FindFieldByName("methods")->message_type()->full_name(),
            "google.protobuf.Method");
  // The reflection service describes itself too.
  const std::vector<ServerReflectionResponse> itself = Ask({SymbolRequest(
      "grpc.reflection.v1alpha.ServerReflection.ServerReflectionInfo")});
  ASSERT_EQ(itself.size(), 1u);
  ResponseFiles reflection(itself[0]);
  EXPECT_NE(reflection.pool.FindServiceByName(
                "grpc.reflection.v1alpha.ServerReflection"),
            nullptr);
}

TEST_F(ReflectionServiceTest,
       QuestionsWithoutAnAnswerGetAnErrorAndTheStreamGoesOn) {
  ServerReflectionRequest extension;
  extension.mutable_file_containing_extension()->set_containing_type(
      "attention.v1.DecodeRequest");
  extension.mutable_file_containing_extension()->set_extension_number(1000);
  ServerReflectionRequest numbers;
  numbers.set_all_extension_numbers_of_type("attention.v1.DecodeRequest");
  ServerReflectionRequest unknown_type;
  unknown_type.set_all_extension_numbers_of_type("no.such.Type");
  const std::string long_name(5000, 'x');
  const std::vector<ServerReflectionResponse> responses =
      Ask({SymbolRequest("no.such.Service"), FileRequest("no/such.proto"),
           extension, numbers, unknown_type, SymbolRequest(long_name),
           ServerReflectionRequest(),
           SymbolRequest("attention.v1.AttentionService")});
  ASSERT_EQ(responses.size(), 8u);
  for (int i : {0, 1, 2, 4, 5}) {
    EXPECT_EQ(responses[i].error_response().error_code(),
              static_cast<int>(grpc::StatusCode::NOT_FOUND))
        << i << ": " << responses[i].DebugString();
  }
  EXPECT_NE(
      responses[0].error_response().error_message().find("no.such.Service"),
      std::string::npos);
  // A long name is quoted by a short prefix only.
  EXPECT_LT(responses[5].error_response().error_message().size(), 200u);
  // No extension of a proto3 message: an empty list, not an error.
  EXPECT_TRUE(responses[3].has_all_extension_numbers_response());
  EXPECT_EQ(responses[3].all_extension_numbers_response().base_type_name(),
            "attention.v1.DecodeRequest");
  EXPECT_EQ(responses[6].error_response().error_code(),
            static_cast<int>(grpc::StatusCode::UNIMPLEMENTED));
  EXPECT_TRUE(responses[7].has_file_descriptor_response());
  // Each response carries the request it answers.
  EXPECT_EQ(responses[1].original_request().file_by_filename(),
            "no/such.proto");
}

// An answer echoes the host and the request: a request of a 1 MiB host is
// refused without them, and the stream goes on.
TEST_F(ReflectionServiceTest, ALargeRequestIsRefusedWithoutAnEcho) {
  ServerReflectionRequest large;
  large.set_host(std::string(1 << 20, 'h'));
  large.set_list_services("");
  const std::vector<ServerReflectionResponse> responses =
      Ask({large, SymbolRequest("attention.v1.AttentionService")});
  ASSERT_EQ(responses.size(), 2u);
  EXPECT_EQ(responses[0].error_response().error_code(),
            static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT))
      << responses[0].error_response().error_message();
  EXPECT_NE(responses[0].error_response().error_message().find("65536"),
            std::string::npos);
  EXPECT_LT(responses[0].ByteSizeLong(), 1024u);
  EXPECT_TRUE(responses[1].has_file_descriptor_response());
}

// 4 Mi empty groups of an unknown field (8 MiB) would parse into hundreds
// of MiB of unknown-field records. The request is refused unparsed: no
// answer comes, where a parsed request would have been answered (it asks
// nothing: an UNIMPLEMENTED error_response), and the stream ends with
// INVALID_ARGUMENT, as it does for bytes that are not a request at all
// (after answering the request before them). The server serves on.
TEST_F(ReflectionServiceTest, ARequestOverItsParseBudgetIsNotParsed) {
  std::string groups;
  for (int i = 0; i < (4 << 20); ++i) groups += "\x7b\x7c";  // field 15
  const ReflectionExchange refused =
      ExchangeWithReflection(server_->client->channel(), {groups});
  EXPECT_TRUE(refused.responses.empty());
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.status.error_message().find(
                "/grpc.reflection.v1alpha.ServerReflection/"
                "ServerReflectionInfo, or parsing them would take more than"),
            std::string::npos)
      << refused.status.error_message();
  const ReflectionExchange garbage = ExchangeWithReflection(
      server_->client->channel(),
      {SymbolRequest("attention.v1.AttentionService").SerializeAsString(),
       "\xff\xff\xff\xff\x0f"});
  EXPECT_EQ(garbage.responses.size(), 1u);
  EXPECT_EQ(garbage.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << garbage.status.error_message();
  const ReflectionExchange small =
      ExchangeWithReflection(server_->client->channel(), {"\x7b\x7c"});
  ASSERT_EQ(small.responses.size(), 1u);
  ServerReflectionResponse answer;
  ASSERT_TRUE(answer.ParseFromString(small.responses[0]));
  EXPECT_EQ(answer.error_response().error_code(),
            static_cast<int>(grpc::StatusCode::UNIMPLEMENTED));
  ATTN_EXPECT_OK(server_->client->GetServerInfo());
}

}  // namespace
}  // namespace attention::testing
