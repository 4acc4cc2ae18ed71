// ParseErrorInterceptor: answers a request whose bytes are not a valid
// protobuf message, or would take more than their parse budget
// (proto/parse_budget.h), with INVALID_ARGUMENT and a message, instead of
// the INTERNAL (synchronous handlers) or UNIMPLEMENTED (callback handlers)
// with no message that gRPC sends.
//
// gRPC deserializes a unary request before our handler runs and, when that
// fails, answers without calling it. The interceptor notes the failure
// (POST_RECV_MESSAGE without a message, on a method that takes one request
// message) and rewrites that status when it is sent (PRE_SEND_STATUS).
// A streamed message that does not parse ends the stream's reads inside
// gRPC as its clean end does (no message either way); the interceptor
// tells the two apart and notes such a call in UnparsedReads, for its
// handler to answer INVALID_ARGUMENT itself. A caller the
// server's authenticator refuses gets UNAUTHENTICATED instead, as it would
// with a valid message: the handler that would have said so never ran.
// The interceptor also counts such a call in attention_requests_total,
// which the handler would have done. It also answers a synchronous call
// that found every RPC thread busy (gRPC's "Server Threadpool Exhausted",
// RESOURCE_EXHAUSTED) with UNAVAILABLE, what the proto promises from an
// overloaded server, and counts it.
#ifndef ATTENTION_SERVER_PARSE_ERROR_INTERCEPTOR_H_
#define ATTENTION_SERVER_PARSE_ERROR_INTERCEPTOR_H_

#include <grpcpp/support/server_interceptor.h>

#include "server/authenticator.h"
#include "server/metrics.h"
#include "server/unparsed_reads.h"

namespace attention::server {

class ParseErrorInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // `authenticator` (may be null: no authentication), `metrics` (may be
  // null) and `unparsed_reads` (may be null: streamed reads are not
  // watched) must outlive the server.
  ParseErrorInterceptorFactory(const Authenticator* authenticator,
                               ServerMetrics* metrics,
                               UnparsedReads* unparsed_reads)
      : authenticator_(authenticator),
        metrics_(metrics),
        unparsed_reads_(unparsed_reads) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  const Authenticator* const authenticator_;
  ServerMetrics* const metrics_;
  UnparsedReads* const unparsed_reads_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_PARSE_ERROR_INTERCEPTOR_H_
