#include "server/parse_error_interceptor.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

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
        start_(absl::Now()),
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
    }
    if (unparsed_ && methods->QueryInterceptionHookPoint(
                         InterceptionHookPoints::PRE_SEND_STATUS)) {
      // The synchronous handlers answer INTERNAL, the callback ones
      // UNIMPLEMENTED with no message.
      const grpc::Status status = methods->GetSendStatus();
      if (status.error_code() == grpc::StatusCode::INTERNAL ||
          (status.error_code() == grpc::StatusCode::UNIMPLEMENTED &&
           status.error_message().empty())) {
        const grpc::Status unparsed = UnparsedStatus();
        methods->ModifySendStatus(unparsed);
        Record(unparsed.error_code());
      }
    }
    methods->Proceed();
  }

 private:
  void Record(grpc::StatusCode code) const {
    const std::optional<RpcMethod> method = RpcMethodOfPath(method_);
    if (metrics_ != nullptr && method.has_value()) {
      metrics_->RecordRequest(*method, code, absl::Now() - start_);
    }
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
        absl::StrCat("the request bytes are not a valid protobuf message for ",
                     method_,
                     "; encode the request with the attention.v1 proto "
                     "(proto/attention/v1/attention.proto)"));
  }

  grpc::experimental::ServerRpcInfo* const info_;
  const Authenticator* const authenticator_;
  ServerMetrics* const metrics_;
  const absl::Time start_;
  const std::string method_;
  const bool single_request_;
  bool unparsed_ = false;
};

}  // namespace

grpc::experimental::Interceptor*
ParseErrorInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new ParseErrorInterceptor(info, authenticator_, metrics_);
}

}  // namespace attention::server
