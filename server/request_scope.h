// RequestScope: what every RPC handler does around its work — count the call
// as in flight (so a draining server knows when it is idle), record its
// method, final status code and duration in the metrics, and log it (every
// request at debug level; server-side failures at warning).
#ifndef ATTENTION_SERVER_REQUEST_SCOPE_H_
#define ATTENTION_SERVER_REQUEST_SCOPE_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/client_string.h"
#include "grpcpp/support/status.h"
#include "server/log.h"
#include "server/metrics.h"

namespace attention::server {

// Calls and streams currently inside a handler.
// Thread-safety: thread-safe.
class InFlightCounter {
 public:
  void Enter() { count_.fetch_add(1, std::memory_order_relaxed); }
  void Leave() { count_.fetch_sub(1, std::memory_order_release); }
  int64_t count() const { return count_.load(std::memory_order_acquire); }

 private:
  std::atomic<int64_t> count_{0};
};

// Usage: `RequestScope scope(metrics, in_flight, RpcMethod::kPrefill, id);
//         ... return scope.Finish(status);`
// `metrics` may be null. Both pointers must outlive the scope.
class RequestScope {
 public:
  RequestScope(ServerMetrics* metrics, InFlightCounter* in_flight,
               RpcMethod method, absl::string_view session_id)
      : metrics_(metrics),
        in_flight_(in_flight),
        method_(method),
        session_id_(std::string(session_id.substr(0, kMaxQuotedClientBytes))),
        start_(absl::Now()) {
    in_flight_->Enter();
  }
  ~RequestScope() { in_flight_->Leave(); }

  RequestScope(const RequestScope&) = delete;
  RequestScope& operator=(const RequestScope&) = delete;

  // Starts timing the next request of a stream. Logs keep at most a short
  // prefix of the client's session id.
  void Restart(absl::string_view session_id) {
    session_id_ = std::string(session_id.substr(0, kMaxQuotedClientBytes));
    start_ = absl::Now();
  }

  // Records one completed request of this method (a Decode stream records
  // one per step) and returns `status` unchanged.
  grpc::Status Finish(grpc::Status status) {
    const absl::Duration elapsed = absl::Now() - start_;
    if (metrics_ != nullptr) {
      metrics_->RecordRequest(method_, status.error_code(), elapsed);
    }
    const bool server_fault =
        status.error_code() == grpc::StatusCode::INTERNAL ||
        status.error_code() == grpc::StatusCode::UNKNOWN;
    const LogLevel level = server_fault ? LogLevel::kWarning : LogLevel::kDebug;
    if (LogEnabled(level)) {
      Log(level, "rpc",
          {{"method", RpcMethodName(method_)},
           {"code", GrpcCodeName(status.error_code())},
           {"duration_us", absl::ToInt64Microseconds(elapsed)},
           {"session", session_id_},
           {"message", status.error_message()}});
    }
    return status;
  }

 private:
  ServerMetrics* const metrics_;
  InFlightCounter* const in_flight_;
  const RpcMethod method_;
  std::string session_id_;
  absl::Time start_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_REQUEST_SCOPE_H_
