// Transport limits: what the gRPC server bounds for every connection and
// call before any handler runs, so that no caller can take the process's
// memory, threads or connections.
//
// - Messages: at most ServerOptions::max_message_bytes either way.
// - Compression: only identity. gRPC inflates a compressed message whole
//   before it checks the size limit, so a small gzip request could take
//   gigabytes (and abort the process); tensors barely compress anyway. A
//   compressed request is refused (UNIMPLEMENTED) from its headers.
// - Streams: at most kMaxStreamsPerConnection open at once per connection
//   (HTTP/2 MAX_CONCURRENT_STREAMS; the client queues the rest).
// - Threads: the synchronous RPCs (everything but Prefill, DecodeStep,
//   Decode and BatchDecode, which take no thread per call) take at most
//   ServerOptions::max_rpc_threads threads; past it they get UNAVAILABLE
//   (gRPC's RESOURCE_EXHAUSTED, rewritten by the ParseErrorInterceptor:
//   an overloaded server), and the callback RPCs run on.
// - Dead peers: every connection is pinged every kKeepaliveTime (also when
//   idle) and closed when an answer takes longer than kKeepaliveTimeout, so
//   a vanished client's streams end and release their sessions. Clients
//   may ping as often as every client::kMinKeepaliveTime (their own
//   keepalive, which finds a frozen server).
// - Connection age: at most ServerOptions::max_connection_age (then
//   GOAWAY, and max_connection_age_grace for the calls open on it), so
//   that certificate and client CA changes reach every connection.
// - Ports: no SO_REUSEPORT, so a port in use is an error.
#ifndef ATTENTION_SERVER_TRANSPORT_LIMITS_H_
#define ATTENTION_SERVER_TRANSPORT_LIMITS_H_

#include <grpcpp/server_builder.h>

#include "absl/time/time.h"
#include "server/server_options.h"

namespace attention::server {

inline constexpr int kMaxStreamsPerConnection = 1024;
inline constexpr absl::Duration kKeepaliveTime = absl::Seconds(60);
inline constexpr absl::Duration kKeepaliveTimeout = absl::Seconds(20);

// Sets the limits above on `builder`.
void ApplyTransportLimits(const ServerOptions& options,
                          grpc::ServerBuilder& builder);

// Raises the soft limit on open files to the hard one (as Go's runtime
// does): gRPC stops accepting connections for good after an accept fails
// with EMFILE, so the usual soft limit of 1024 would let ~1000 idle
// connections take the port down. Returns the limit now in force.
int64_t RaiseOpenFilesLimit();

}  // namespace attention::server

#endif  // ATTENTION_SERVER_TRANSPORT_LIMITS_H_
