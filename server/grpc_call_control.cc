#include "server/grpc_call_control.h"

#include <chrono>

#include "absl/time/clock.h"

namespace attention::server {
namespace {

absl::Time DeadlineOf(const grpc::ServerContextBase* context) {
  const std::chrono::system_clock::time_point deadline = context->deadline();
  // gRPC reports "no deadline" as the largest time point.
  if (deadline >= std::chrono::system_clock::time_point::max() -
                      std::chrono::hours(24 * 365)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

}  // namespace

GrpcCallControl::GrpcCallControl(const grpc::ServerContextBase* context)
    : context_(context), deadline_(DeadlineOf(context)) {}

absl::Status GrpcCallControl::Check() const {
  const bool expired =
      deadline_ != absl::InfiniteFuture() && absl::Now() >= deadline_;
  if (expired) {
    return absl::DeadlineExceededError(
        "the call's deadline passed before the server finished it; nothing "
        "was applied. Give the call a longer deadline or less work");
  }
  if (context_->IsCancelled()) {
    return absl::CancelledError(
        "the client cancelled the call (or went away) before the server "
        "finished it; nothing was applied");
  }
  return absl::OkStatus();
}

}  // namespace attention::server
