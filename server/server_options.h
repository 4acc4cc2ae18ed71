// ServerOptions: everything that configures an AttentionServer (the
// attention-server flags map one to one onto these fields).
#ifndef ATTENTION_SERVER_SERVER_OPTIONS_H_
#define ATTENTION_SERVER_SERVER_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/time/time.h"
#include "core/thread_pool.h"
#include "server/decode_step_timing.h"

namespace attention::server {

struct ServerOptions {
  // Address to listen on; port 0 picks a free ephemeral port (see
  // AttentionServer::port()).
  std::string listen_address = "0.0.0.0";
  int port = 50051;
  // The address clients should use for this replica ("host:port"), reported
  // as SessionInfo.owner and ServerInfo.advertise_address (in Kubernetes the
  // pod's stable DNS name). Empty = the bound address: listen_address (the
  // host name for a wildcard address such as 0.0.0.0) and the bound port
  // (the ephemeral one when port is 0).
  std::string advertise_address;
  // Prometheus metrics endpoint (/metrics) port; 0 picks a free port
  // (AttentionServer::metrics_port()), -1 serves no endpoint (metrics are
  // still recorded). The attention-server flag defaults to 9464; embedded
  // servers (tests) default to none.
  int metrics_port = -1;
  // Address of the metrics endpoint; empty = listen_address. The metrics
  // endpoint has no TLS and no authentication: keep it on an internal
  // address (e.g. the pod network) when the gRPC port is exposed.
  std::string metrics_address;
  // Transport security of the gRPC port (server/transport_security.h):
  // TLS with tls_cert_file + tls_key_file (PEM); mutual TLS with
  // tls_client_ca_file too; plaintext when none is set. The files are
  // re-read every tls_refresh_interval (certificate rotation without a
  // restart).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  absl::Duration tls_refresh_interval = absl::Seconds(10);
  // A connection older than max_connection_age (+-10% jitter) is asked to
  // go (HTTP/2 GOAWAY): its client's next calls open a new one, verified
  // against the certificates and client CA of that time, so a client CA
  // rotation reaches every connection within it. The calls and streams
  // open on the old connection then have max_connection_age_grace to end
  // before it is closed (infinite: they end on their own). Infinite
  // max_connection_age (or ~24.8 days or more): connections live as long as
  // their clients keep them. At least 1 s.
  absl::Duration max_connection_age = absl::Minutes(30);
  absl::Duration max_connection_age_grace = absl::InfiniteDuration();
  // Bearer-token authentication and tenants (server/authenticator.h): the
  // tokens file, empty = none (with mutual TLS the client certificate's CN
  // names the tenant; otherwise everything runs as tenant `default`). It is
  // checked for changes every auth_reload_interval (and on SIGHUP).
  std::string auth_tokens_file;
  absl::Duration auth_reload_interval = absl::Seconds(1);
  // Serve grpc.reflection (authenticated like the API when auth is on).
  bool reflection = true;
  // Attention backend: "auto" (CUDA when a GPU is usable), "cpu" or "cuda".
  std::string backend = "auto";
  // Backend worker threads, at most 1024; 0 = one per hardware thread.
  int threads = 0;
  // How long idle CPU backend threads poll for work before sleeping. Zero
  // (the default) suits small or shared machines; on a dedicated many-core
  // host ~100us saves a thread wake-up per call.
  absl::Duration cpu_spin = ThreadPool::kDefaultSpin;
  // KV block pool capacity and block size.
  int64_t kv_cache_bytes = int64_t{1} << 30;
  int64_t kv_block_bytes = int64_t{64} << 10;
  // Largest message received or sent (at most 1 GiB); also bounds
  // stateless weights. Replies are sized before the work and refused when
  // larger.
  int64_t max_message_bytes = int64_t{64} << 20;
  // Most floating-point operations one call may ask for
  // (EngineOptions::max_call_flops).
  int64_t max_call_flops = int64_t{1} << 41;
  // Most live sessions, and most host memory their metadata may take
  // (SessionManagerOptions).
  int64_t max_sessions = 65536;
  int64_t max_session_metadata_bytes = int64_t{256} << 20;
  // Idle time after which a session is deleted (when its CreateSession
  // request does not say otherwise).
  absl::Duration session_idle_timeout = absl::Minutes(10);
  // Tokens per layer a session may hold: the default and the largest
  // SessionSpec.max_tokens a client may ask for.
  int64_t max_session_tokens = 131072;
  // How often expired sessions are reaped (their ids stop resolving as soon
  // as they expire, whatever this is).
  absl::Duration session_reap_interval = absl::Seconds(1);
  // Graceful drain on Shutdown (SIGTERM): health turns NOT_SERVING and new
  // sessions are refused at once; in-flight calls and open Decode streams
  // get up to this long to finish (inside Kubernetes' default 30 s grace)
  // before the rest are cancelled.
  absl::Duration drain_timeout = absl::Seconds(25);
  // An ExportSession or ImportSession that moves no message for this long
  // is cancelled, freeing the KV blocks and the thread it held (a stalled
  // or vanished peer). > 0.
  absl::Duration transfer_stall_timeout = absl::Seconds(60);
  // Most threads the synchronous RPCs may take (server/transport_limits.h).
  int max_rpc_threads = 1024;
  // When set, the drain ends by writing every session to this directory
  // (server/snapshot_store.h), and Start restores the sessions found there
  // before it serves. In-flight calls then get the first half of
  // drain_timeout and the snapshot the rest.
  std::string snapshot_dir;
  // Fleets (server/session_handover.h). The other replicas, as a
  // comma-separated list of host:port whose hosts may be DNS names
  // resolving to several addresses (a headless Service), re-resolved when
  // used. When set, the drain first hands every session over to the SERVING
  // peer with the most free KV memory (within the call part of
  // drain_timeout); what could not be moved is then snapshotted to
  // snapshot_dir when that is set. Empty = no handover.
  std::string peers;
  // A file holding the bearer token this replica sends to its peers (a
  // token of the tenant peer_tenant in their tokens file); empty = none.
  // Read at start-up.
  std::string peer_token_file;
  // With TLS (tls_cert_file set), peers are called over TLS: verified
  // against peer_tls_ca_file (empty = tls_client_ca_file, or the system's
  // roots without either) under the name peer_tls_server_name (empty = the
  // host of each --peers entry), with tls_cert_file / tls_key_file as the
  // client certificate.
  std::string peer_tls_ca_file;
  std::string peer_tls_server_name;
  // The identity whose handover imports keep the session's owner tenant: a
  // tokens-file tenant, or the client certificate's CN in client-cert mode
  // (server/authenticator.h). Ignored when nobody is authenticated.
  std::string peer_tenant = "peer";
  // Continuous batching of decode steps (server/decode_batcher.h): how long
  // a forming batch waits for one more concurrent step (0 = no waiting,
  // whatever is queued is still batched), the most steps per engine batch,
  // and the most steps (and bytes of their tensors) queued before new ones
  // fail with UNAVAILABLE.
  absl::Duration batch_wait = absl::Microseconds(200);
  int max_batch_size = 256;
  int64_t max_queued_decode_steps = 4096;
  int64_t max_queued_decode_bytes = int64_t{1} << 30;
  // Prefills waiting for one of the prefill threads before new ones get
  // UNAVAILABLE (each holds its request, up to max_message_bytes).
  int64_t max_queued_prefills = 64;
  // Bytes those waiting prefills may hold (requests and reply buffers)
  // before new ones get UNAVAILABLE; one may always wait alone.
  int64_t max_queued_prefill_bytes = int64_t{1} << 30;
  // What one tenant may have waiting in each of those two queues, as a
  // share in (0, 1] of their bounds (steps or prefills, and bytes); past it
  // its calls get RESOURCE_EXHAUSTED while other tenants' still queue
  // (server/tenant_queue_share.h). 1 = no per-tenant bound.
  double tenant_queue_share = 1.0;
  // Not a flag: called once per engine batch of decode steps with its size
  // (e.g. to export a batch-size histogram); see
  // DecodeBatcherOptions::on_batch for the rules it must follow.
  std::function<void(int64_t batch_size)> on_decode_batch;
  // Not a flag: polled while Start restores --snapshot_dir and once before
  // it serves (the attention-server binary: whether SIGTERM or SIGINT is
  // pending). True: Start stops, leaves every snapshot file in place for
  // the next start, and returns CANCELLED. Empty: never.
  std::function<bool()> stop_requested;
  // Not a flag: when set, called with the server-side timing of every
  // successful DecodeStep (server/decode_step_timing.h; attn-bench's latency
  // budget). Unset, no timestamp is taken on the call's path.
  std::function<void(const DecodeStepTiming&)> on_decode_step_timing;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_SERVER_OPTIONS_H_
