#include "server/parse_error_interceptor.h"

#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/parse_budget.h"

namespace attention::server {
namespace {

using grpc::experimental::InterceptionHookPoints;

class ParseErrorInterceptor final : public grpc::experimental::Interceptor {
 public:
  ParseErrorInterceptor(grpc::experimental::ServerRpcInfo* info,
                        const Authenticator* authenticator,
                        ServerMetrics* metrics)
      : info_(info),
        authenticator_(authenticator),
        metrics_(metrics),
        method_(info->method() != nullptr ? info->method() : ""),
        single_request_(
            info->type() == grpc::experimental::ServerRpcInfo::Type::UNARY ||
            info->type() ==
                grpc::experimental::ServerRpcInfo::Type::SERVER_STREAMING) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods)
      override {
    // No received message where the method takes exactly one means its
    // bytes did not parse. A streaming request also ends with no message,
    // at its clean end, so there a missing message says nothing.
    if (single_request_ &&
        methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      unparsed_ = true;
      // Only a failed read reads the clock: the interceptor runs on every
      // call, the decode steps included.
      failed_at_ = absl::Now();
    }
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::PRE_SEND_STATUS) &&
        IsThreadpoolExhausted(methods->GetSendStatus())) {
      // gRPC's own refusal when every synchronous RPC thread is busy: an
      // overloaded server answers UNAVAILABLE, which callers retry.
      methods->ModifySendStatus(Overloaded());
      failed_at_ = absl::Now();
      to_record_ = grpc::StatusCode::UNAVAILABLE;
      Record();
    }
    if (unparsed_ && methods->QueryInterceptionHookPoint(
                         InterceptionHookPoints::PRE_SEND_STATUS)) {
      // The synchronous handlers answer INTERNAL, the callback ones
      // UNIMPLEMENTED with no message.
      const grpc::Status status = methods->GetSendStatus();
      const bool sync = status.error_code() == grpc::StatusCode::INTERNAL;
      if (sync || (status.error_code() == grpc::StatusCode::UNIMPLEMENTED &&
                   status.error_message().empty())) {
        const grpc::Status unparsed = UnparsedStatus();
        methods->ModifySendStatus(unparsed);
        to_record_ = unparsed.error_code();
        callback_ = !sync;
        if (sync) Record();
      }
    }
    // To a callback handler, a request that did not arrive whole (the
    // client cancelled, or its deadline passed, while it was sent) is no
    // message too; the call's close tells it apart. (A synchronous call
    // must not ask IsCancelled here: that runs this hook again.)
    if (callback_ && to_record_.has_value() &&
        methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::POST_RECV_CLOSE)) {
      grpc::ServerContextBase* const context = info_->server_context();
      if (context->IsCancelled()) {
        to_record_ = absl::Now() >= absl::FromChrono(context->deadline())
                         ? grpc::StatusCode::DEADLINE_EXCEEDED
                         : grpc::StatusCode::CANCELLED;
      }
      Record();
    }
    methods->Proceed();
  }

  // A call that ends without a close is counted as it is.
  ~ParseErrorInterceptor() override { Record(); }

 private:
  // Counts the call once, with to_record_ (if set).
  void Record() {
    const std::optional<RpcMethod> method = RpcMethodOfPath(method_);
    if (metrics_ != nullptr && method.has_value() && to_record_.has_value()) {
      metrics_->RecordRequest(*method, *to_record_, absl::Now() - failed_at_);
    }
    to_record_.reset();
  }

  // gRPC's answer for a synchronous call that found no thread
  // (ResourceQuota::SetMaxThreads).
  static bool IsThreadpoolExhausted(const grpc::Status& status) {
    return status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
           status.error_message() == "Server Threadpool Exhausted";
  }

  static grpc::Status Overloaded() {
    return grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        "the server is overloaded: every thread for its synchronous RPCs "
        "(--max_rpc_threads) is busy; nothing was applied, retry with "
        "backoff");
  }

  // What an unparsable request gets: UNAUTHENTICATED for a caller the
  // authenticator refuses, else INVALID_ARGUMENT.
  grpc::Status UnparsedStatus() const {
    if (authenticator_ != nullptr && authenticator_->enabled()) {
      const absl::StatusOr<Tenant> tenant =
          authenticator_->Authenticate(*info_->server_context());
      if (!tenant.ok()) {
        return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                            std::string(tenant.status().message()));
      }
    }
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat(
            "the request bytes are not a valid protobuf message for ", method_,
            ", or parsing them would take more than ", proto::kParseBudgetRatio,
            " times their size in memory (at least ",
            proto::kParseBudgetFloor >> 20,
            " MiB: too many sub-messages, repeated values or unknown "
            "fields for their size); encode the request with the "
            "attention.v1 proto (proto/attention/v1/attention.proto)"));
  }

  grpc::experimental::ServerRpcInfo* const info_;
  const Authenticator* const authenticator_;
  ServerMetrics* const metrics_;
  const std::string method_;
  const bool single_request_;
  bool unparsed_ = false;
  absl::Time failed_at_;  // when the request turned out missing
  // The status to count for a request that did not parse, until counted.
  std::optional<grpc::StatusCode> to_record_;
  bool callback_ = false;  // its handler is a callback one
};

}  // namespace

grpc::experimental::Interceptor*
ParseErrorInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new ParseErrorInterceptor(info, authenticator_, metrics_);
}

}  // namespace attention::server
