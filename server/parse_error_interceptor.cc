#include "server/parse_error_interceptor.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace attention::server {
namespace {

using grpc::experimental::InterceptionHookPoints;

class ParseErrorInterceptor final : public grpc::experimental::Interceptor {
 public:
  ParseErrorInterceptor(grpc::experimental::ServerRpcInfo* info,
                        const Authenticator* authenticator)
      : info_(info),
        authenticator_(authenticator),
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
        methods->ModifySendStatus(UnparsedStatus());
      }
    }
    methods->Proceed();
  }

 private:
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
  const std::string method_;
  const bool single_request_;
  bool unparsed_ = false;
};

}  // namespace

grpc::experimental::Interceptor*
ParseErrorInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new ParseErrorInterceptor(info, authenticator_);
}

}  // namespace attention::server
