// Translation of engine statuses (absl::Status) into gRPC statuses.
#ifndef ATTENTION_SERVER_STATUS_CONVERT_H_
#define ATTENTION_SERVER_STATUS_CONVERT_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace attention::server {

// Returns the gRPC status with the same canonical code and the same message.
// absl and gRPC share the canonical code space, so every code maps to
// itself; a code outside it becomes UNKNOWN (with the message kept).
grpc::Status ToGrpcStatus(const absl::Status& status);

// The trailing metadata key of a moved session's redirect; its value is the
// new owner's "host:port" (core/moved_sessions.h).
inline constexpr char kSessionOwnerMetadata[] = "attention-session-owner";
// The trailing metadata key ("1") of the UNAVAILABLE a call gets on a
// session being moved (core/moved_sessions.h, SessionMovingError).
inline constexpr char kSessionMovingMetadata[] = "attention-session-moving";
// The trailing metadata key ("1") of the UNAVAILABLE that ends a Decode
// stream at the end of a drain, as it waited for its client: no request
// sent after its last reply was applied (decode_stream_reactor.h).
inline constexpr char kStreamDrainedMetadata[] = "attention-stream-drained";
// The payload type URL of that UNAVAILABLE (StreamDrainedError).
inline constexpr char kStreamDrainedPayload[] =
    "type.googleapis.com/attention.v1.StreamDrained";

// UNAVAILABLE, carrying kStreamDrainedPayload, for a Decode stream the
// drain ends as it waits for its client's next request.
absl::Status StreamDrainedError();

// The one conversion of a call's final status: ToGrpcStatus(status), and
// for a moved session's redirect (MovedSessionOwner) the trailing metadata
// kSessionOwnerMetadata, for a session being moved (IsSessionMoving)
// kSessionMovingMetadata, for a drained stream (StreamDrainedError)
// kStreamDrainedMetadata, on `context` (a sync or callback server context;
// null adds nothing).
grpc::Status ToGrpcStatus(const absl::Status& status,
                          grpc::ServerContextBase* context);

// The gRPC code for `code` (UNKNOWN for a value outside the canonical set).
grpc::StatusCode ToGrpcCode(absl::StatusCode code);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_STATUS_CONVERT_H_
