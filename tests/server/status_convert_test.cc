#include "server/status_convert.h"

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "core/moved_sessions.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

TEST(StatusConvertTest, OkStaysOk) {
  const grpc::Status status = ToGrpcStatus(absl::OkStatus());
  EXPECT_TRUE(status.ok());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::OK);
}

TEST(StatusConvertTest, EveryCanonicalCodeKeepsCodeAndMessage) {
  // Every canonical code from CANCELLED (1) to UNAUTHENTICATED (16).
  for (int code = 1; code <= 16; ++code) {
    const std::string message = "message for code " + std::to_string(code);
    const absl::Status status(static_cast<absl::StatusCode>(code), message);
    const grpc::Status converted = ToGrpcStatus(status);
    EXPECT_EQ(static_cast<int>(converted.error_code()), code) << status;
    EXPECT_EQ(converted.error_message(), message);
    EXPECT_EQ(ToGrpcCode(status.code()), converted.error_code());
  }
}

TEST(StatusConvertTest, NamedCodesUsedByTheEngine) {
  EXPECT_EQ(ToGrpcStatus(absl::InvalidArgumentError("x")).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("x")).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ToGrpcStatus(absl::OutOfRangeError("x")).error_code(),
            grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("x")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ToGrpcStatus(absl::FailedPreconditionError("x")).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(ToGrpcStatus(absl::UnavailableError("x")).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(ToGrpcStatus(absl::InternalError("x")).error_code(),
            grpc::StatusCode::INTERNAL);
}

TEST(StatusConvertTest, CodeOutsideTheCanonicalSetBecomesUnknown) {
  const absl::Status status(static_cast<absl::StatusCode>(77), "odd");
  const grpc::Status converted = ToGrpcStatus(status);
  EXPECT_EQ(converted.error_code(), grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(converted.error_message(), "odd");
}

TEST(StatusConvertTest, ARedirectKeepsCodeAndMessageWithOrWithoutContext) {
  const absl::Status moved = SessionMovedError("abc", "replica-2:50051");
  for (grpc::ServerContext* context :
       {static_cast<grpc::ServerContext*>(nullptr)}) {
    const grpc::Status converted = ToGrpcStatus(moved, context);
    EXPECT_EQ(converted.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(converted.error_message(), std::string(moved.message()));
  }
  // (The trailing metadata itself is checked end to end by
  // tests/server/handover_test.cc.)
  EXPECT_EQ(kSessionOwnerMetadata, std::string("attention-session-owner"));
}

}  // namespace
}  // namespace attention::server
