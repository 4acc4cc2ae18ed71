// ServerOptions: everything that configures an AttentionServer (the
// attention-server flags map one to one onto these fields).
#ifndef ATTENTION_SERVER_SERVER_OPTIONS_H_
#define ATTENTION_SERVER_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace attention::server {

struct ServerOptions {
  // Address to listen on; port 0 picks a free ephemeral port (see
  // AttentionServer::port()).
  std::string listen_address = "0.0.0.0";
  int port = 50051;
  // Prometheus metrics port; accepted now, served in a later release.
  int metrics_port = 9464;
  // Attention backend: "auto" (CUDA when a GPU is usable), "cpu" or "cuda".
  std::string backend = "auto";
  // Backend worker threads; 0 = one per hardware thread.
  int threads = 0;
  // KV block pool capacity and block size.
  int64_t kv_cache_bytes = int64_t{1} << 30;
  int64_t kv_block_bytes = int64_t{64} << 10;
  // Largest message received or sent; also bounds stateless weights.
  int64_t max_message_bytes = int64_t{64} << 20;
  // Idle time after which a session is deleted (when its CreateSession
  // request does not say otherwise).
  absl::Duration session_idle_timeout = absl::Minutes(10);
  // Tokens per layer a session may hold: the default and the largest
  // SessionSpec.max_tokens a client may ask for.
  int64_t max_session_tokens = 131072;
  // How often expired sessions are reaped (their ids stop resolving as soon
  // as they expire, whatever this is).
  absl::Duration session_reap_interval = absl::Seconds(1);
  // How long Shutdown lets in-flight calls finish before cancelling them.
  absl::Duration shutdown_grace = absl::Seconds(10);
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_SERVER_OPTIONS_H_
