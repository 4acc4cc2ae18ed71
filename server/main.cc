// attention-server: serves attention.v1.AttentionService over gRPC.
//
// Stops on SIGTERM or SIGINT: reports NOT_SERVING, refuses new sessions,
// lets in-flight calls and open Decode streams finish (up to
// --drain_timeout), keeps serving /metrics for --metrics_linger, exits 0.
// SIGHUP re-reads --auth_tokens_file.
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/attention_server.h"
#include "server/log.h"
#include "server/server_options.h"
#include "server/transport_limits.h"

ABSL_FLAG(std::string, listen_address, "0.0.0.0",
          "Address to listen on (0.0.0.0 = all IPv4 interfaces).");
ABSL_FLAG(int, port, 50051,
          "gRPC port; 0 picks a free port and prints it (see --port_file).");
ABSL_FLAG(std::string, advertise_address, "",
          "host:port clients should use for this replica (SessionInfo.owner, "
          "ServerInfo.advertise_address; in Kubernetes the pod's stable DNS "
          "name). Default: the bound address and port (the host name for a "
          "wildcard --listen_address).");
ABSL_FLAG(std::string, port_file, "",
          "When set, the bound port is written to this file once serving.");
ABSL_FLAG(int, metrics_port, 9464,
          "Port of the Prometheus endpoint /metrics (0 = a free port, -1 = "
          "none).");
ABSL_FLAG(std::string, metrics_address, "",
          "Address of the metrics endpoint (empty = --listen_address). It "
          "has no TLS or authentication: keep it on an internal network.");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain of the gRPC port; with --tls_key_file turns "
          "on TLS. Re-read when it changes (every --tls_refresh_interval).");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA certificates: clients must present a certificate they "
          "signed (mutual TLS). Without --auth_tokens_file the certificate's "
          "subject CN names the tenant.");
ABSL_FLAG(absl::Duration, max_connection_age, absl::Minutes(30),
          "Connections older than this (+-10%) are asked to go (GOAWAY): "
          "their clients reconnect for new calls, verified against the "
          "certificates and client CA of that time. At least 1s; 'inf' (or "
          "24 days or more) = never.");
ABSL_FLAG(absl::Duration, max_connection_age_grace, absl::InfiniteDuration(),
          "How long the calls and streams open on a connection past "
          "--max_connection_age may run before it is closed; 'inf' = until "
          "they end (set it to cut a revoked client's open streams).");
ABSL_FLAG(absl::Duration, tls_refresh_interval, absl::Seconds(10),
          "How often the TLS files are checked for changes (>= 1s).");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "Bearer-token authentication: each line 'tenant sha256-of-token "
          "max_sessions max_kv_bytes' ('-' = no limit, # comments). Re-read "
          "when it changes and on SIGHUP; a bad file keeps the previous one.");
ABSL_FLAG(absl::Duration, auth_reload_interval, absl::Seconds(1),
          "How often --auth_tokens_file is checked for changes (SIGHUP "
          "re-reads it at once); 0: on SIGHUP only. 0 or at least 10ms.");
ABSL_FLAG(bool, reflection, true,
          "Serve grpc.reflection (authenticated like the API when auth is "
          "on).");
ABSL_FLAG(std::string, log_level, "info",
          "Least severe log events written to stderr: debug (every request), "
          "info, warning or error.");
ABSL_FLAG(std::string, backend, "auto",
          "Attention backend: auto (cuda when a GPU is usable), cpu or cuda.");
ABSL_FLAG(int64_t, kv_cache_bytes, int64_t{1} << 30,
          "Capacity of the KV block pool in bytes.");
ABSL_FLAG(int64_t, kv_block_bytes, int64_t{64} << 10,
          "Size of one KV block in bytes (a multiple of 256).");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{64} << 20,
          "Largest gRPC message received or sent, in bytes (4096 .. 1 GiB); "
          "replies are sized before any work and refused when larger.");
ABSL_FLAG(int64_t, max_call_flops, int64_t{1} << 41,
          "Most floating-point operations one call may ask for (2 * "
          "(head_dim + value_dim) per visible query-head/key pair); more is "
          "RESOURCE_EXHAUSTED before any work.");
ABSL_FLAG(int64_t, max_sessions, 65536, "Most live sessions.");
ABSL_FLAG(int64_t, max_session_metadata_bytes, int64_t{256} << 20,
          "Most host memory the live sessions' metadata (specs, labels, sink "
          "logits) may take, in bytes.");
ABSL_FLAG(absl::Duration, session_idle_timeout, absl::Minutes(10),
          "Idle time after which a session is deleted (e.g. 10m, 90s).");
ABSL_FLAG(int64_t, max_session_tokens, 131072,
          "Default and largest SessionSpec.max_tokens (tokens per layer).");
ABSL_FLAG(int, threads, 0,
          "Backend worker threads; 0 = one per CPU of the process's affinity "
          "(set it to a container's CPU limit).");
ABSL_FLAG(absl::Duration, cpu_spin, absl::ZeroDuration(),
          "CPU backend: how long idle worker threads poll for work before "
          "sleeping (e.g. 100us on a dedicated many-core host; 0 = sleep "
          "at once, best on small or shared machines).");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(25),
          "On SIGTERM/SIGINT, how long in-flight calls and open Decode "
          "streams may take to finish (keep it, plus --metrics_linger, "
          "below the orchestrator's grace period).");
ABSL_FLAG(absl::Duration, metrics_linger, absl::ZeroDuration(),
          "After the drain, keep serving /metrics this long (or until a "
          "second SIGTERM/SIGINT) so that Prometheus scrapes the drain's "
          "final counts (handovers, snapshot) before the process exits; "
          "e.g. the scrape interval. Keep --drain_timeout plus this below "
          "the orchestrator's grace period.");
ABSL_FLAG(absl::Duration, transfer_stall_timeout, absl::Seconds(60),
          "An ExportSession or ImportSession that moves no message for this "
          "long is cancelled (CANCELLED), freeing the KV blocks and the "
          "thread it held. At least 1s.");
ABSL_FLAG(int64_t, max_queued_prefills, 64,
          "Prefills waiting for a prefill thread (4) before new ones get "
          "UNAVAILABLE (overloaded); each holds its request.");
ABSL_FLAG(int64_t, max_queued_prefill_bytes, int64_t{1} << 30,
          "Bytes the prefills waiting for a prefill thread may hold "
          "(requests and reply buffers) before new ones get UNAVAILABLE "
          "(overloaded).");
ABSL_FLAG(double, tenant_queue_share, 1.0,
          "What one tenant may have waiting in the decode and prefill "
          "queues, as a share in (0, 1] of their bounds (steps or prefills, "
          "and bytes); past it its calls get RESOURCE_EXHAUSTED while other "
          "tenants' still queue. 1 = no per-tenant bound.");
ABSL_FLAG(int, max_rpc_threads, 1024,
          "Most threads the synchronous RPCs (all but Prefill, DecodeStep, "
          "Decode and BatchDecode) may take; past it they get "
          "UNAVAILABLE (overloaded).");
ABSL_FLAG(std::string, snapshot_dir, "",
          "When set: on SIGTERM/SIGINT, once calls have finished (first half "
          "of --drain_timeout), every session is written to this directory "
          "(one file each, crash-safe); at start, the sessions found there "
          "are restored with their ids before the server reports SERVING. "
          "The server does not start when it cannot write here.");
ABSL_FLAG(std::string, peers, "",
          "The other replicas: comma-separated host:port, hosts may be DNS "
          "names resolving to several addresses (a headless Service). When "
          "set, SIGTERM first hands every session over to the SERVING peer "
          "with the most free KV memory; the rest go to --snapshot_dir.");
ABSL_FLAG(std::string, peer_token_file, "",
          "File holding the bearer token sent to --peers (a token of the "
          "--peer_tenant tenant in their tokens file).");
ABSL_FLAG(std::string, peer_tls_ca_file, "",
          "With TLS: CA (PEM) verifying the peers' server certificates; empty "
          "= --tls_client_ca_file, or the system's roots.");
ABSL_FLAG(std::string, peer_tls_server_name, "",
          "With TLS: the name the peers' certificates must carry; empty = the "
          "host of each --peers entry.");
ABSL_FLAG(std::string, peer_tenant, "peer",
          "Tenant (tokens file) or client-certificate CN whose handover "
          "imports keep the session's owner tenant.");
ABSL_FLAG(absl::Duration, batch_wait, absl::Microseconds(200),
          "Continuous batching: how long a forming batch of decode steps "
          "waits for one more concurrent step (the whole wait stays under 8 "
          "times this; e.g. 200us; 0 = no waiting, queued steps are still "
          "batched).");
ABSL_FLAG(int, max_batch_size, 256,
          "Most decode steps run as one engine batch.");
ABSL_FLAG(int64_t, max_queued_decode_steps, 4096,
          "Most decode steps waiting for a batch; beyond it new steps fail "
          "with UNAVAILABLE (overloaded, retry).");
ABSL_FLAG(int64_t, max_queued_decode_bytes, int64_t{1} << 30,
          "Most bytes the tensors of decode steps waiting for a batch may "
          "hold (requests and reply buffers); beyond it new steps fail with "
          "UNAVAILABLE (overloaded, retry). 0 = one step (or BatchDecode) "
          "waits at a time.");

namespace attention::server {
namespace {

ServerOptions OptionsFromFlags() {
  ServerOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen_address);
  options.port = absl::GetFlag(FLAGS_port);
  options.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  options.tls_refresh_interval = absl::GetFlag(FLAGS_tls_refresh_interval);
  options.max_connection_age = absl::GetFlag(FLAGS_max_connection_age);
  options.max_connection_age_grace =
      absl::GetFlag(FLAGS_max_connection_age_grace);
  options.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  options.auth_reload_interval = absl::GetFlag(FLAGS_auth_reload_interval);
  options.reflection = absl::GetFlag(FLAGS_reflection);
  options.backend = absl::GetFlag(FLAGS_backend);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.cpu_spin = absl::GetFlag(FLAGS_cpu_spin);
  options.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  options.kv_block_bytes = absl::GetFlag(FLAGS_kv_block_bytes);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.max_call_flops = absl::GetFlag(FLAGS_max_call_flops);
  options.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.max_session_metadata_bytes =
      absl::GetFlag(FLAGS_max_session_metadata_bytes);
  options.session_idle_timeout = absl::GetFlag(FLAGS_session_idle_timeout);
  options.max_session_tokens = absl::GetFlag(FLAGS_max_session_tokens);
  options.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  options.transfer_stall_timeout = absl::GetFlag(FLAGS_transfer_stall_timeout);
  options.max_rpc_threads = absl::GetFlag(FLAGS_max_rpc_threads);
  options.max_queued_prefills = absl::GetFlag(FLAGS_max_queued_prefills);
  options.max_queued_prefill_bytes =
      absl::GetFlag(FLAGS_max_queued_prefill_bytes);
  options.tenant_queue_share = absl::GetFlag(FLAGS_tenant_queue_share);
  options.snapshot_dir = absl::GetFlag(FLAGS_snapshot_dir);
  options.peers = absl::GetFlag(FLAGS_peers);
  options.peer_token_file = absl::GetFlag(FLAGS_peer_token_file);
  options.peer_tenant = absl::GetFlag(FLAGS_peer_tenant);
  options.peer_tls_ca_file = absl::GetFlag(FLAGS_peer_tls_ca_file);
  options.peer_tls_server_name = absl::GetFlag(FLAGS_peer_tls_server_name);
  options.batch_wait = absl::GetFlag(FLAGS_batch_wait);
  options.max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  options.max_queued_decode_steps =
      absl::GetFlag(FLAGS_max_queued_decode_steps);
  options.max_queued_decode_bytes =
      absl::GetFlag(FLAGS_max_queued_decode_bytes);
  return options;
}

// Writes the port via a temporary file and rename, so a reader never sees a
// partial number.
bool WritePortFile(const std::string& path, int port) {
  const std::string temporary = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << port << "\n";
    if (!out.good()) return false;
  }
  return std::rename(temporary.c_str(), path.c_str()) == 0;
}

// After the drain: keeps the metrics endpoint up for --metrics_linger, so
// that the drain's final counts are scraped; a second SIGTERM or SIGINT
// ends it early (SIGHUP does not).
void LingerForMetrics(const AttentionServer& server, const sigset_t& signals,
                      absl::Duration linger) {
  if (linger <= absl::ZeroDuration() || server.metrics_port() < 0) return;
  std::cout << "attention-server: drained; serving /metrics for "
            << absl::FormatDuration(linger) << " more" << std::endl;
  Log(LogLevel::kInfo, "metrics_linger",
      {{"linger", absl::FormatDuration(linger)},
       {"metrics_port", server.metrics_port()}});
  // Timed on the monotonic clock: a wall-clock step must not stretch the
  // linger past the pod's grace period.
  const std::chrono::steady_clock::time_point start =
      std::chrono::steady_clock::now();
  for (absl::Duration left = linger; left > absl::ZeroDuration();
       left = linger -
              absl::FromChrono(std::chrono::steady_clock::now() - start)) {
    const timespec timeout = absl::ToTimespec(left);
    const int signal_number = sigtimedwait(&signals, nullptr, &timeout);
    if (signal_number == SIGTERM || signal_number == SIGINT) return;
  }
}

int Run() {
  const int64_t max_open_files = RaiseOpenFilesLimit();
  // A closed stdout or stderr (the reader of a pipe gone) must not kill the
  // drain: writes then fail with EPIPE instead. civetweb does the same, but
  // only when the metrics endpoint is on.
  signal(SIGPIPE, SIG_IGN);
  // Block the signals before any thread exists, so every thread inherits
  // the mask and only sigwait below ever sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto log_level = ParseLogLevel(absl::GetFlag(FLAGS_log_level));
  if (!log_level.ok()) {
    std::cerr << "attention-server: --log_level: " << log_level.status()
              << std::endl;
    return 1;
  }
  SetLogLevel(*log_level);
  const absl::Duration metrics_linger = absl::GetFlag(FLAGS_metrics_linger);
  if (metrics_linger < absl::ZeroDuration()) {
    std::cerr << "attention-server: --metrics_linger must not be negative, "
                 "got "
              << absl::FormatDuration(metrics_linger) << std::endl;
    return 1;
  }
  ServerOptions options = OptionsFromFlags();
  // A stop during start-up (a long restore) ends it before serving.
  options.stop_requested = [] {
    sigset_t pending;
    sigemptyset(&pending);
    return sigpending(&pending) == 0 && (sigismember(&pending, SIGTERM) == 1 ||
                                         sigismember(&pending, SIGINT) == 1);
  };
  auto server = AttentionServer::Start(options);
  if (server.status().code() == absl::StatusCode::kCancelled) {
    Log(LogLevel::kInfo, "stopped_during_start",
        {{"message", server.status().message()}});
    return 0;
  }
  if (!server.ok()) {
    std::cerr << "attention-server: cannot start: " << server.status()
              << std::endl;
    return 1;
  }
  std::cout << "attention-server " << ServerVersion() << " listening on "
            << options.listen_address << ":" << (*server)->port()
            << " port=" << (*server)->port()
            << " backend=" << (*server)->backend_name() << " ("
            << (*server)->backend_reason() << ")"
            << " device=\"" << (*server)->engine().backend().device() << "\""
            << " transport=" << (*server)->transport_mode()
            << " auth=" << (*server)->auth_mode() << std::endl;
  if (!options.auth_tokens_file.empty() && options.tls_cert_file.empty()) {
    Log(LogLevel::kWarning, "tokens_over_plaintext",
        {{"hint",
          "bearer tokens travel unencrypted; set --tls_cert_file and "
          "--tls_key_file"}});
  }
  Log(LogLevel::kInfo, "server_started",
      {{"version", ServerVersion()},
       {"port", (*server)->port()},
       {"advertise_address", (*server)->advertise_address()},
       {"metrics_port", (*server)->metrics_port()},
       {"backend", (*server)->backend_name()},
       {"backend_reason", (*server)->backend_reason()},
       {"device", (*server)->engine().backend().device()},
       {"transport", (*server)->transport_mode()},
       {"auth", (*server)->auth_mode()},
       {"kv_cache_bytes", options.kv_cache_bytes},
       {"max_open_files", max_open_files}});
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty() && !WritePortFile(port_file, (*server)->port())) {
    std::cerr << "attention-server: cannot write --port_file " << port_file
              << ": " << std::strerror(errno) << std::endl;
    return 1;
  }

  int signal_number = 0;
  while (true) {
    if (sigwait(&signals, &signal_number) != 0) continue;
    if (signal_number != SIGHUP) break;
    // Logged either way; a bad file leaves the previous tenants in force.
    (*server)->ReloadAuthTokens().IgnoreError();
  }
  std::cout << "attention-server: " << strsignal(signal_number)
            << ", draining (up to "
            << absl::FormatDuration(options.drain_timeout) << ")" << std::endl;
  Log(LogLevel::kInfo, "signal", {{"signal", strsignal(signal_number)}});
  (*server)->Shutdown();
  LingerForMetrics(**server, signals, metrics_linger);
  if (!(*server)->transport_stopped()) {
    // A client that does not read its reply still holds gRPC's transport,
    // and would hold the server's destruction as long as it stays
    // connected: the drain and the snapshot are done, so leave now (exit 0
    // inside the pod's grace period).
    Log(LogLevel::kWarning, "exit_with_transport_open",
        {{"hint", "a client stopped reading a reply"}});
    std::cout << "attention-server: stopped" << std::endl;
    std::cerr.flush();
    std::fflush(nullptr);
    std::_Exit(0);
  }
  server->reset();
  std::cout << "attention-server: stopped" << std::endl;
  return 0;
}

}  // namespace
}  // namespace attention::server

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Serves attention.v1.AttentionService (transformer attention with "
      "paged KV-cache sessions) over gRPC.\nUsage: attention-server "
      "[--port=50051] [--backend=auto|cpu|cuda] [--kv_cache_bytes=N] ...");
  absl::ParseCommandLine(argc, argv);
  attention::server::ConfigureServingProcess();
  return attention::server::Run();
}
