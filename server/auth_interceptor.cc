#include "server/auth_interceptor.h"

#include <grpc/grpc.h>

#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace attention::server {
namespace {

using grpc::experimental::InterceptionHookPoints;

// Method path prefixes the interceptor leaves alone.
constexpr absl::string_view kExempt[] = {
    "/grpc.health.v1.Health/",          // probes carry no token
    "/attention.v1.AttentionService/",  // handlers authenticate themselves
};

class AuthInterceptor final : public grpc::experimental::Interceptor {
 public:
  AuthInterceptor(grpc::experimental::ServerRpcInfo* info,
                  const Authenticator* authenticator)
      : info_(info), authenticator_(authenticator) {}

  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      grpc::ServerContextBase* context = info_->server_context();
      const std::shared_ptr<const grpc::AuthContext> auth =
          context->auth_context();
      const absl::StatusOr<Tenant> tenant = authenticator_->Authenticate(
          *methods->GetRecvInitialMetadata(), auth.get());
      if (!tenant.ok()) {
        refused_ = grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                                std::string(tenant.status().message()));
        grpc_call_cancel_with_status(context->c_call(),
                                     GRPC_STATUS_UNAUTHENTICATED,
                                     refused_.error_message().c_str(), nullptr);
      }
    }
    if (!refused_.ok() && methods->QueryInterceptionHookPoint(
                              InterceptionHookPoints::PRE_SEND_STATUS)) {
      methods->ModifySendStatus(refused_);
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  const Authenticator* const authenticator_;
  grpc::Status refused_;
};

bool Exempt(const char* method) {
  if (method == nullptr) return false;
  for (absl::string_view prefix : kExempt) {
    if (absl::StartsWith(method, prefix)) return true;
  }
  return false;
}

}  // namespace

grpc::experimental::Interceptor*
AuthInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  // Returning null leaves the call without this interceptor.
  if (Exempt(info->method())) return nullptr;
  return new AuthInterceptor(info, authenticator_);
}

}  // namespace attention::server
