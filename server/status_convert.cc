#include "server/status_convert.h"

#include <optional>
#include <string>

#include "absl/strings/cord.h"
#include "core/moved_sessions.h"

namespace attention::server {

grpc::StatusCode ToGrpcCode(absl::StatusCode code) {
  // Spelled out rather than cast so that a code outside the canonical set
  // can never reach the wire as an arbitrary integer.
  switch (code) {
    case absl::StatusCode::kOk:
      return grpc::StatusCode::OK;
    case absl::StatusCode::kCancelled:
      return grpc::StatusCode::CANCELLED;
    case absl::StatusCode::kUnknown:
      return grpc::StatusCode::UNKNOWN;
    case absl::StatusCode::kInvalidArgument:
      return grpc::StatusCode::INVALID_ARGUMENT;
    case absl::StatusCode::kDeadlineExceeded:
      return grpc::StatusCode::DEADLINE_EXCEEDED;
    case absl::StatusCode::kNotFound:
      return grpc::StatusCode::NOT_FOUND;
    case absl::StatusCode::kAlreadyExists:
      return grpc::StatusCode::ALREADY_EXISTS;
    case absl::StatusCode::kPermissionDenied:
      return grpc::StatusCode::PERMISSION_DENIED;
    case absl::StatusCode::kResourceExhausted:
      return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case absl::StatusCode::kFailedPrecondition:
      return grpc::StatusCode::FAILED_PRECONDITION;
    case absl::StatusCode::kAborted:
      return grpc::StatusCode::ABORTED;
    case absl::StatusCode::kOutOfRange:
      return grpc::StatusCode::OUT_OF_RANGE;
    case absl::StatusCode::kUnimplemented:
      return grpc::StatusCode::UNIMPLEMENTED;
    case absl::StatusCode::kInternal:
      return grpc::StatusCode::INTERNAL;
    case absl::StatusCode::kUnavailable:
      return grpc::StatusCode::UNAVAILABLE;
    case absl::StatusCode::kDataLoss:
      return grpc::StatusCode::DATA_LOSS;
    case absl::StatusCode::kUnauthenticated:
      return grpc::StatusCode::UNAUTHENTICATED;
    default:
      break;
  }
  return grpc::StatusCode::UNKNOWN;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(ToGrpcCode(status.code()), std::string(status.message()));
}

grpc::Status ToGrpcStatus(const absl::Status& status,
                          grpc::ServerContextBase* context) {
  if (context != nullptr) {
    if (std::optional<std::string> owner = MovedSessionOwner(status)) {
      context->AddTrailingMetadata(kSessionOwnerMetadata, *owner);
    } else if (IsSessionMoving(status)) {
      context->AddTrailingMetadata(kSessionMovingMetadata, "1");
    } else if (status.GetPayload(kStreamDrainedPayload).has_value()) {
      context->AddTrailingMetadata(kStreamDrainedMetadata, "1");
    }
  }
  return ToGrpcStatus(status);
}

absl::Status StreamDrainedError() {
  absl::Status status = absl::UnavailableError(
      "the server is draining and ended this Decode stream as it waited for "
      "the next request: it applied no request sent after its last reply, "
      "neither this one nor any later one; send them again on a new stream "
      "(trailing metadata attention-stream-drained)");
  status.SetPayload(kStreamDrainedPayload, absl::Cord("1"));
  return status;
}

}  // namespace attention::server
