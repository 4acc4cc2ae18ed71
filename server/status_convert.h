// Translation of engine statuses (absl::Status) into gRPC statuses.
#ifndef ATTENTION_SERVER_STATUS_CONVERT_H_
#define ATTENTION_SERVER_STATUS_CONVERT_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace attention::server {

// Returns the gRPC status with the same canonical code and the same message.
// absl and gRPC share the canonical code space, so every code maps to
// itself; a code outside it becomes UNKNOWN (with the message kept).
grpc::Status ToGrpcStatus(const absl::Status& status);

// The gRPC code for `code` (UNKNOWN for a value outside the canonical set).
grpc::StatusCode ToGrpcCode(absl::StatusCode code);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_STATUS_CONVERT_H_
