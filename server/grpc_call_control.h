// GrpcCallControl: a CallControl (core/call_control.h) that follows one gRPC
// server call, so that the engine stops and changes nothing once the client
// cancels the call, goes away, or lets its deadline pass.
#ifndef ATTENTION_SERVER_GRPC_CALL_CONTROL_H_
#define ATTENTION_SERVER_GRPC_CALL_CONTROL_H_

#include <grpcpp/server_context.h>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/call_control.h"

namespace attention::server {

// Thread-safety: Check() may be called from any thread while the call is
// live. `context` must outlive the control.
class GrpcCallControl final : public CallControl {
 public:
  explicit GrpcCallControl(const grpc::ServerContextBase* context);

  // DEADLINE_EXCEEDED once the call's deadline has passed, CANCELLED once
  // the client cancelled it or went away, OK otherwise.
  absl::Status Check() const override;

 private:
  const grpc::ServerContextBase* const context_;
  const absl::Time deadline_;  // InfiniteFuture() when the call has none
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_GRPC_CALL_CONTROL_H_
