// AuthInterceptor: authenticates the calls of the services the server hosts
// besides attention.v1.AttentionService (whose handlers authenticate each
// call themselves, to learn its tenant) and grpc.health.v1 (probes need no
// token): server reflection, and any extra service. A call the
// Authenticator refuses is cancelled with UNAUTHENTICATED as soon as its
// metadata arrives, before any message is answered.
// An interceptor cannot keep the call from its handler: a handler may still
// run for a refused call (its messages are dropped, its status replaced).
// So a service behind it must have no effect but its replies (reflection
// only reads), or check ServerContext::IsCancelled() before acting.
#ifndef ATTENTION_SERVER_AUTH_INTERCEPTOR_H_
#define ATTENTION_SERVER_AUTH_INTERCEPTOR_H_

#include <grpcpp/support/server_interceptor.h>

#include "server/authenticator.h"

namespace attention::server {

class AuthInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // `authenticator` must outlive the server. REQUIRES: it is enabled().
  explicit AuthInterceptorFactory(const Authenticator* authenticator)
      : authenticator_(authenticator) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  const Authenticator* const authenticator_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_AUTH_INTERCEPTOR_H_
