// AppendCall: one unary append RPC (Prefill, DecodeStep, BatchDecode) on
// gRPC's callback API, from its handler until gRPC is done with it.
//
// The handler (on a gRPC thread) creates the call, converts the request
// into `appends` (views into the request's bytes, which gRPC keeps until
// the call is done), bounds the reply and hands the work to the
// DecodeBatcher or the CallExecutor; the completion (on their thread)
// completes the response and calls Reply. No thread is held per call, and
// a gRPC thread computes only a lone DecodeStep that finds the batcher
// idle (DecodeBatcher::RunInline), replying before the handler returns.
//
// The call counts as in flight (drain), and is recorded in the metrics and
// the log, from creation until gRPC is done with it (RequestScope).
#ifndef ATTENTION_SERVER_APPEND_CALL_H_
#define ATTENTION_SERVER_APPEND_CALL_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>

#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/engine.h"
#include "server/decode_step_timing.h"
#include "server/grpc_call_control.h"
#include "server/metrics.h"
#include "server/request_scope.h"

namespace attention::server {

class AppendCall final : public grpc::ServerUnaryReactor {
 public:
  // `context`, `metrics` (may be null) and `in_flight` must outlive the
  // call. Deletes itself when gRPC is done with it (OnDone).
  AppendCall(grpc::CallbackServerContext* context, ServerMetrics* metrics,
             InFlightCounter* in_flight, RpcMethod method,
             absl::string_view session_id);

  // What the handler fills in: the caller's tenant and the engine
  // requests, which the call's control and tenant are set on by
  // AdoptAppends.
  std::optional<Tenant> tenant;
  std::vector<AppendRequest> appends;
  // Points every request at this call's control and tenant.
  void AdoptAppends();

  // When set (DecodeStep with ServerOptions::on_decode_step_timing), the
  // call fills `timing` and reports it to the hook on success.
  void EnableTiming(const DecodeStepTimingHook* hook);
  DecodeStepTiming* timing() { return hook_ != nullptr ? &timing_ : nullptr; }

  // Sends the reply with `status` (the response as prepared when OK): the
  // one place a reply's status is converted and recorded. The call may be
  // gone when Reply returns: touch nothing of it afterwards.
  void Reply(const absl::Status& status);

  void OnDone() override { delete this; }

 private:
  // Kept for the reply's status conversion, which may add trailing
  // metadata to it.
  grpc::CallbackServerContext* const context_;
  RequestScope scope_;
  GrpcCallControl control_;
  const DecodeStepTimingHook* hook_ = nullptr;
  DecodeStepTiming timing_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_APPEND_CALL_H_
