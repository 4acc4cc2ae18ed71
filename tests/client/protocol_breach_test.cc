// The client library against a server that breaks the protocol of
// attention.proto: a stand-in AttentionService written here (not the
// project's server, which keeps it) that answers a Decode request twice,
// ends a snapshot export early without an error, or hands out ListSessions
// page tokens that come round again. The client reports each as an error
// instead of returning misattributed results, a cut snapshot or looping.
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/attention_client.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"

namespace attention::client {
namespace {

class BreachingService final : public v1::AttentionService::Service {
 public:
  // Answers every request twice.
  grpc::Status Decode(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::AttentionResult, v1::DecodeRequest>* stream)
      override {
    v1::DecodeRequest request;
    int64_t position = 0;
    while (stream->Read(&request)) {
      v1::AttentionResult result;
      result.set_position(position++);
      stream->Write(result);
      stream->Write(result);
    }
    return grpc::Status::OK;
  }

  // A header and `data_records` data records, then the end (OK) without the
  // trailer; with `trailer` set, a trailer counting `trailer_count`.
  grpc::Status ExportSession(
      grpc::ServerContext*, const v1::ExportSessionRequest*,
      grpc::ServerWriter<v1::SessionChunk>* writer) override {
    v1::SessionChunk record;
    record.mutable_header()->set_session_id("s");
    writer->Write(record);
    for (int i = 0; i < data_records; ++i) {
      record.Clear();
      record.mutable_data();
      writer->Write(record);
    }
    if (trailer) {
      record.Clear();
      record.mutable_trailer()->set_num_chunks(trailer_count);
      writer->Write(record);
    }
    return grpc::Status::OK;
  }

  // Pages of one session whose tokens go a, b, a, b, ...
  grpc::Status ListSessions(grpc::ServerContext*,
                            const v1::ListSessionsRequest* request,
                            v1::ListSessionsResponse* response) override {
    response->add_sessions()->set_session_id("s");
    response->set_next_page_token(request->page_token() == "a" ? "b" : "a");
    return grpc::Status::OK;
  }

  int data_records = 2;
  bool trailer = false;
  int64_t trailer_count = 0;
};

class ProtocolBreachTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    client_ = AttentionClient::Connect(absl::StrCat("127.0.0.1:", port));
  }
  void TearDown() override {
    client_.reset();
    server_->Shutdown();
  }

  BreachingService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<AttentionClient> client_;
};

TEST_F(ProtocolBreachTest, SurplusDecodeResultsEndTheStreamWithAnError) {
  // One request written, then read: its second result comes for no
  // request.
  std::unique_ptr<DecodeStream> stream = client_->OpenDecodeStream();
  ASSERT_TRUE(stream->Write(v1::DecodeRequest()));
  ASSERT_TRUE(stream->Read().ok());
  const absl::StatusOr<v1::AttentionResult> surplus = stream->Read();
  EXPECT_EQ(surplus.status().code(), absl::StatusCode::kInternal)
      << surplus.status();
  EXPECT_EQ(stream->Finish().code(), absl::StatusCode::kInternal);

  // Step by step: each step reads a result, so the surplus shows at the
  // end, where a clean end was reported before.
  stream = client_->OpenDecodeStream();
  ASSERT_TRUE(stream->Step(v1::DecodeRequest()).ok());
  ASSERT_TRUE(stream->Step(v1::DecodeRequest()).ok());
  const absl::Status end = stream->Finish();
  EXPECT_EQ(end.code(), absl::StatusCode::kInternal) << end;
}

TEST_F(ProtocolBreachTest, AnExportCutShortIsDataLoss) {
  int records = 0;
  const auto sink = [&records](const v1::SessionChunk&) {
    ++records;
    return absl::OkStatus();
  };
  absl::Status status = client_->ExportSession("s", sink);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_NE(status.message().find("without a trailer"), std::string::npos)
      << status;
  EXPECT_EQ(records, 3);

  // A trailer that miscounts the data is refused before the sink sees it.
  service_.trailer = true;
  service_.trailer_count = 3;
  records = 0;
  status = client_->ExportSession("s", sink);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_EQ(records, 3);

  // The shape the proto gives is accepted.
  service_.trailer_count = 2;
  records = 0;
  EXPECT_TRUE(client_->ExportSession("s", sink).ok());
  EXPECT_EQ(records, 4);
}

TEST_F(ProtocolBreachTest, PageTokensThatComeRoundAgainAreAnError) {
  const auto sessions = client_->ListSessions();
  EXPECT_EQ(sessions.status().code(), absl::StatusCode::kInternal)
      << sessions.status();
}

}  // namespace
}  // namespace attention::client
