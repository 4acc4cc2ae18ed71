#include "server/transport_limits.h"

#include <grpc/compression.h>
#include <grpcpp/resource_quota.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

#include "client/attention_client.h"

namespace attention::server {

void ApplyTransportLimits(const ServerOptions& options,
                          grpc::ServerBuilder& builder) {
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             kMaxStreamsPerConnection);
  grpc::ResourceQuota quota("attention-server");
  quota.SetMaxThreads(options.max_rpc_threads);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(
      GRPC_ARG_KEEPALIVE_TIME_MS,
      static_cast<int>(absl::ToInt64Milliseconds(kKeepaliveTime)));
  builder.AddChannelArgument(
      GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
      static_cast<int>(absl::ToInt64Milliseconds(kKeepaliveTimeout)));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Clients' keepalive pings (client::ClientOptions::keepalive_time, at
  // least kMinKeepaliveTime apart): accepted with half that as a margin
  // for timers; gRPC's default (5 minutes) would close their connections.
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
      static_cast<int>(
          absl::ToInt64Milliseconds(client::kMinKeepaliveTime / 2)));
  for (const auto& [arg, duration] :
       {std::pair{GRPC_ARG_MAX_CONNECTION_AGE_MS, options.max_connection_age},
        std::pair{GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                  options.max_connection_age_grace}}) {
    if (duration == absl::InfiniteDuration()) continue;  // gRPC's default
    // Whole milliseconds, rounded up; INT_MAX (~24.8 days) is gRPC's never.
    builder.AddChannelArgument(arg, static_cast<int>(std::min<int64_t>(
                                        absl::ToInt64Milliseconds(absl::Ceil(
                                            duration, absl::Milliseconds(1))),
                                        std::numeric_limits<int>::max())));
  }
  // gRPC sets SO_REUSEPORT by default, which would let two servers share a
  // port silently; a port in use must be an error instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
}

int64_t RaiseOpenFilesLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return -1;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  return limit.rlim_cur == RLIM_INFINITY ? -1
                                         : static_cast<int64_t>(limit.rlim_cur);
}

}  // namespace attention::server
