#include "server/append_call.h"

#include "server/status_convert.h"

namespace attention::server {

AppendCall::AppendCall(grpc::CallbackServerContext* context,
                       ServerMetrics* metrics, InFlightCounter* in_flight,
                       RpcMethod method, absl::string_view session_id)
    : context_(context),
      scope_(metrics, in_flight, method, session_id),
      control_(context) {}

void AppendCall::AdoptAppends() {
  for (AppendRequest& append : appends) {
    append.control = &control_;
    append.tenant = tenant.has_value() ? &*tenant : nullptr;
  }
}

void AppendCall::EnableTiming(const DecodeStepTimingHook* hook) {
  hook_ = hook;
}

void AppendCall::Reply(const absl::Status& status) {
  const grpc::Status reply = scope_.Finish(ToGrpcStatus(status, context_));
  if (hook_ == nullptr || !status.ok()) {
    Finish(reply);
    return;
  }
  // Finish may end the call (and delete it) before it returns: keep what
  // the hook needs.
  DecodeStepTiming timing = timing_;
  const DecodeStepTimingHook* hook = hook_;
  Finish(reply);
  timing.replied = DecodeStepTiming::Clock::now();
  (*hook)(timing);
}

}  // namespace attention::server
