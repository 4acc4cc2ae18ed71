#include "server/attention_server.h"

#include <arpa/inet.h>
#include <grpc/grpc.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_initializer.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/backend_factory.h"
#include "core/client_string.h"
#include "core/read_file.h"
#include "core/status_macros.h"
#include "server/auth_interceptor.h"
#include "server/host_port.h"
#include "server/log.h"
#include "server/parse_error_interceptor.h"
#include "server/session_handover.h"
#include "server/snapshot_store.h"
#include "server/tenant_queue_share.h"
#include "server/transport_limits.h"
#include "server/transport_security.h"

#ifndef ATTN_SERVER_VERSION
#define ATTN_SERVER_VERSION "0.0.0"
#endif

namespace attention::server {
namespace {

DecodeBatcherOptions BatcherOptions(const ServerOptions& options) {
  DecodeBatcherOptions batcher;
  batcher.batch_wait = options.batch_wait;
  batcher.max_batch_size = options.max_batch_size;
  batcher.max_queued_steps = options.max_queued_decode_steps;
  batcher.max_queued_bytes = options.max_queued_decode_bytes;
  batcher.tenant_bounds = TenantQueueBounds::ShareOf(
      options.tenant_queue_share, options.max_queued_decode_steps,
      options.max_queued_decode_bytes);
  batcher.on_batch = options.on_decode_batch;
  return batcher;
}

absl::Status ValidateOptions(const ServerOptions& options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "port ", options.port, " is not in [0, 65535] (0 = pick a free one)"));
  }
  if (options.metrics_port < -1 || options.metrics_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics_port ", options.metrics_port,
        " is not in [-1, 65535] (0 = pick a free one, -1 = no endpoint)"));
  }
  if (options.listen_address.empty()) {
    return absl::InvalidArgumentError(
        "listen_address is empty; use 0.0.0.0 (all interfaces) or an address");
  }
  // Far below protobuf's 2 GiB limit on one message, so that no reply can
  // come near it.
  constexpr int64_t kMaxMessageLimit = int64_t{1} << 30;
  if (options.max_message_bytes < 4096 ||
      options.max_message_bytes > kMaxMessageLimit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes ", options.max_message_bytes,
        " must be in [4096, ", kMaxMessageLimit, "]"));
  }
  // The metrics endpoint's HTTP server takes each octet of a malformed
  // IPv4 address modulo 256 (999.1.1.1 binds 231.1.1.1).
  if (!options.metrics_address.empty() &&
      options.metrics_address.find_first_not_of("0123456789.") ==
          std::string::npos) {
    in_addr parsed;
    if (inet_pton(AF_INET, options.metrics_address.c_str(), &parsed) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metrics_address ", QuoteClientString(options.metrics_address),
          " is not an IPv4 address (four numbers 0-255)"));
    }
  }
  if (options.max_call_flops <= 0 || options.max_sessions <= 0 ||
      options.max_session_metadata_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_call_flops (", options.max_call_flops, "), max_sessions (",
        options.max_sessions, ") and max_session_metadata_bytes (",
        options.max_session_metadata_bytes, ") must be positive"));
  }
  if (options.max_session_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_session_tokens ",
                                                   options.max_session_tokens,
                                                   " must be positive"));
  }
  for (const auto& [name, duration] :
       {std::pair{"session_idle_timeout", options.session_idle_timeout},
        std::pair{"transfer_stall_timeout", options.transfer_stall_timeout},
        std::pair{"drain_timeout", options.drain_timeout},
        std::pair{"max_connection_age_grace",
                  options.max_connection_age_grace}}) {
    if (duration <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " ", absl::FormatDuration(duration), " must be positive"));
    }
  }
  // The drain's deadlines come from it: an infinite one would never end a
  // drain that a client holds up (an idle stream, a reply it does not
  // read), and the orchestrator's kill would then lose every session.
  if (options.drain_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        "drain_timeout inf must be finite (keep it below the orchestrator's "
        "grace period, e.g. 25s of Kubernetes' 30s)");
  }
  if (options.max_connection_age < absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_connection_age ", absl::FormatDuration(options.max_connection_age),
        " must be at least 1s (or inf): every client reconnects that often"));
  }
  // Shorter would spin the thread that checks: the tokens file's watcher,
  // the transfers' stall watchdog (which would also cancel every transfer
  // that pauses for a moment).
  if (options.auth_reload_interval < absl::ZeroDuration() ||
      (options.auth_reload_interval > absl::ZeroDuration() &&
       options.auth_reload_interval < absl::Milliseconds(10))) {
    return absl::InvalidArgumentError(
        absl::StrCat("auth_reload_interval ",
                     absl::FormatDuration(options.auth_reload_interval),
                     " must be 0 (re-read on SIGHUP only) or at least 10ms"));
  }
  if (options.transfer_stall_timeout < absl::Seconds(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer_stall_timeout ",
                     absl::FormatDuration(options.transfer_stall_timeout),
                     " must be at least 1s"));
  }
  if (options.max_queued_prefills < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_queued_prefills ", options.max_queued_prefills, " must be >= 1"));
  }
  if (options.max_queued_prefill_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_queued_prefill_bytes ",
                     options.max_queued_prefill_bytes, " must be >= 0"));
  }
  if (!(options.tenant_queue_share > 0 && options.tenant_queue_share <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tenant_queue_share ", options.tenant_queue_share,
                     " must be in (0, 1] (1 = no per-tenant bound)"));
  }
  if (options.max_rpc_threads < 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_rpc_threads ", options.max_rpc_threads, " must be >= 16"));
  }
  // More threads than a process may start abort it (std::system_error).
  if (options.threads < 0 || options.threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads ", options.threads,
                     " must be between 0 (one per core) and 1024"));
  }
  if (options.cpu_spin < absl::ZeroDuration() ||
      options.cpu_spin > absl::Milliseconds(10)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu_spin ", absl::FormatDuration(options.cpu_spin),
                     " must be between 0 and 10ms (e.g. 100us)"));
  }
  if (!options.advertise_address.empty()) {
    ATTN_RETURN_IF_ERROR(
        ParseHostPort(options.advertise_address, "advertise_address").status());
  }
  if (!options.peers.empty()) {
    PeerOptions peers;
    peers.peers = options.peers;
    ATTN_RETURN_IF_ERROR(Peers::Create(std::move(peers)).status());
  }
  return DecodeBatcher::ValidateOptions(BatcherOptions(options));
}

// How a replica calls its peers: its own transport security and identity.
absl::StatusOr<client::ClientOptions> PeerClientOptions(
    const ServerOptions& options) {
  client::ClientOptions client;
  client.max_send_message_bytes = options.max_message_bytes;
  client.max_receive_message_bytes = options.max_message_bytes;
  if (!options.tls_cert_file.empty()) {
    client.tls = true;
    client.tls_ca_file = options.peer_tls_ca_file.empty()
                             ? options.tls_client_ca_file
                             : options.peer_tls_ca_file;
    client.tls_server_name = options.peer_tls_server_name;
    client.tls_cert_file = options.tls_cert_file;
    client.tls_key_file = options.tls_key_file;
    client.tls_regular_files_only = true;
  }
  if (!options.peer_token_file.empty()) {
    ATTN_ASSIGN_OR_RETURN(std::string token,
                          ReadFile(options.peer_token_file, "peer token file"));
    client.auth_token = std::string(absl::StripAsciiWhitespace(token));
    if (absl::Status status = client::CheckAuthToken(client.auth_token);
        !status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--peer_token_file: ", status.message()));
    }
  }
  return client;
}

TransportSecurityOptions TransportOptions(const ServerOptions& options) {
  TransportSecurityOptions transport;
  transport.cert_file = options.tls_cert_file;
  transport.key_file = options.tls_key_file;
  transport.client_ca_file = options.tls_client_ca_file;
  transport.refresh_interval = options.tls_refresh_interval;
  return transport;
}

// The engine state for the metrics, with the usage of the tenants the
// tokens file names (no other tenant name becomes a label).
MetricsState CurrentMetricsState(const AttentionEngine& engine,
                                 const Authenticator& authenticator) {
  MetricsState state = MetricsStateFromEngineStats(engine.stats());
  for (std::string& name : authenticator.tenant_names()) {
    const TenantStats stats = engine.tenant_stats(name);
    state.tenants.push_back(TenantMetricsState{.tenant = std::move(name),
                                               .sessions = stats.sessions,
                                               .kv_bytes = stats.kv_bytes});
  }
  return state;
}

// "host:port", bracketing a bare IPv6 address.
std::string ListenUri(const std::string& address, int port) {
  if (address.find(':') != std::string::npos && address.front() != '[') {
    return absl::StrCat("[", address, "]:", port);
  }
  return absl::StrCat(address, ":", port);
}

// Where the metrics endpoint listens (civetweb's syntax): `+port` for an
// IPv6 wildcard, every address civetweb can bind (IPv6 and IPv4 when it is
// built with IPv6, IPv4 otherwise); "[::]:port" would bind IPv6 only, or,
// in a build without IPv6 (Debian's), stop the start.
std::string MetricsListenAddress(const std::string& address, int port) {
  if (address == "::" || address == "[::]") return absl::StrCat("+", port);
  return ListenUri(address, port);
}

// The address clients should use: options.advertise_address, or the bound
// one (the host name in place of a wildcard listen address).
std::string AdvertiseAddress(const ServerOptions& options, int bound_port) {
  if (!options.advertise_address.empty()) return options.advertise_address;
  std::string host = options.listen_address;
  if (host == "0.0.0.0" || host == "::" || host == "[::]") {
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') {
      host = name;
    }
  }
  return ListenUri(host, bound_port);
}

// The name clients check with grpc.health.v1 (besides "" = the server).
constexpr char kServiceName[] = "attention.v1.AttentionService";

}  // namespace

const char* ServerVersion() { return ATTN_SERVER_VERSION; }

void ConfigureServingProcess() {
#ifdef NDEBUG
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
}

absl::StatusOr<std::unique_ptr<AttentionServer>> AttentionServer::Start(
    const ServerOptions& options) {
  return Start(options, {});
}

absl::StatusOr<std::unique_ptr<AttentionServer>> AttentionServer::Start(
    const ServerOptions& options,
    absl::Span<grpc::Service* const> extra_services) {
  if (absl::Status status = ValidateOptions(options); !status.ok()) {
    return status;
  }
  absl::StatusOr<client::ClientOptions> peer_client =
      PeerClientOptions(options);
  if (!peer_client.ok()) return peer_client.status();
  auto credentials = MakeServerCredentials(TransportOptions(options));
  if (!credentials.ok()) return credentials.status();
  AuthenticatorOptions auth_options;
  auth_options.tokens_file = options.auth_tokens_file;
  auth_options.reload_interval = options.auth_reload_interval;
  auth_options.tenant_from_client_certificate =
      !options.tls_client_ca_file.empty();
  auto authenticator = Authenticator::Create(auth_options);
  if (!authenticator.ok()) return authenticator.status();

  BackendOptions backend_options;
  backend_options.kind = options.backend;
  backend_options.threads = options.threads;
  backend_options.cpu_spin = options.cpu_spin;
  auto choice = CreateBackend(backend_options);
  if (!choice.ok()) return choice.status();

  EngineOptions engine_options;
  engine_options.kv_cache_bytes = options.kv_cache_bytes;
  engine_options.kv_block_bytes = options.kv_block_bytes;
  // A weights tensor larger than a message could never be sent back.
  engine_options.max_weights_bytes = options.max_message_bytes;
  engine_options.sessions.default_idle_timeout = options.session_idle_timeout;
  engine_options.sessions.max_idle_timeout = std::max(
      engine_options.sessions.max_idle_timeout, options.session_idle_timeout);
  engine_options.sessions.limits.default_max_tokens =
      options.max_session_tokens;
  engine_options.sessions.limits.max_tokens_limit = options.max_session_tokens;
  engine_options.sessions.reap_interval = options.session_reap_interval;
  engine_options.sessions.max_sessions = options.max_sessions;
  engine_options.sessions.max_metadata_bytes =
      options.max_session_metadata_bytes;
  engine_options.max_call_flops = options.max_call_flops;
  engine_options.version = ServerVersion();
  auto engine =
      AttentionEngine::Create(std::move(choice->backend), engine_options);
  if (!engine.ok()) return engine.status();

  std::unique_ptr<AttentionServer> server(new AttentionServer(
      options, *std::move(engine), std::move(choice->reason)));
  server->authenticator_ = *std::move(authenticator);
  AttentionEngine* const engine_ptr = server->engine_.get();
  const Authenticator* const authenticator_ptr = server->authenticator_.get();

  ServerMetricsOptions metrics_options;
  if (options.metrics_port >= 0) {
    metrics_options.listen_address = MetricsListenAddress(
        options.metrics_address.empty() ? options.listen_address
                                        : options.metrics_address,
        options.metrics_port);
  } else {
    metrics_options.listen_address.clear();
  }
  metrics_options.version = ServerVersion();
  metrics_options.backend = std::string(engine_ptr->backend().name());
  metrics_options.device = engine_ptr->backend().device();
  auto metrics = ServerMetrics::Create(metrics_options);
  if (!metrics.ok()) return metrics.status();
  server->metrics_ = *std::move(metrics);
  server->metrics_->SetStateProvider([engine_ptr, authenticator_ptr] {
    return CurrentMetricsState(*engine_ptr, *authenticator_ptr);
  });

  std::vector<std::string> restored_files;
  if (!options.snapshot_dir.empty()) {
    // Before anything serves: health reports SERVING only afterwards.
    ATTN_ASSIGN_OR_RETURN(server->snapshot_lock_,
                          PrepareSnapshotDirectory(options.snapshot_dir));
    const absl::Time start = absl::Now();
    OwnerQuota owner_quota;
    if (authenticator_ptr->enabled()) {
      owner_quota = [authenticator_ptr](const std::string& owner) {
        return authenticator_ptr->QuotaOf(owner);
      };
    }
    RestoreAllResult restored = RestoreAllSessions(
        *engine_ptr, options.snapshot_dir, options.stop_requested, owner_quota);
    restored_files = std::move(restored.files);
    server->metrics_->RecordRestore(restored.restored, restored.corrupt,
                                    restored.rejected, restored.kept);
    Log(LogLevel::kInfo, "sessions_restored",
        {{"dir", options.snapshot_dir},
         {"restored", restored.restored},
         {"corrupt", restored.corrupt},
         {"rejected", restored.rejected},
         {"kept", restored.kept},
         {"kv_bytes", restored.bytes},
         {"duration_ms", absl::ToInt64Milliseconds(absl::Now() - start)}});
  }

  if (options.stop_requested && options.stop_requested()) {
    // Stopped before serving (a rollout replaced the pod while it
    // restored): the files keep every session, and nothing has run here.
    return absl::CancelledError(
        "a stop was requested during start-up; the snapshot files stay in "
        "--snapshot_dir for the next start");
  }

  DecodeBatcherOptions batcher_options = BatcherOptions(options);
  ServerMetrics* const metrics_ptr = server->metrics_.get();
  batcher_options.on_batch = [metrics_ptr,
                              user = options.on_decode_batch](int64_t size) {
    metrics_ptr->ObserveDecodeBatch(size);
    if (user) user(size);
  };
  server->decode_batcher_ =
      std::make_unique<DecodeBatcher>(engine_ptr, batcher_options);
  server->service_ = std::make_unique<AttentionServiceImpl>(
      engine_ptr, server->decode_batcher_.get(), ServerVersion(), options,
      metrics_ptr, authenticator_ptr);
  server->service_->AcceptHandoversFrom(options.peer_tenant);
  server->authenticator_->SetChangeListener(
      [service = server->service_.get()] { service->TenantsChanged(); });

  // A process-wide switch read when a server is built.
  grpc::EnableDefaultHealthCheckService(true);

  grpc::ServerBuilder builder;
  const std::string uri = ListenUri(options.listen_address, options.port);
  builder.AddListeningPort(uri, *credentials, &server->port_);
  ApplyTransportLimits(options, builder);
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(std::make_unique<ParseErrorInterceptorFactory>(
      authenticator_ptr, metrics_ptr, server->service_->unparsed_reads()));
  if (authenticator_ptr->enabled()) {
    interceptors.push_back(
        std::make_unique<AuthInterceptorFactory>(authenticator_ptr));
  }
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.RegisterService(server->service_.get());
  for (grpc::Service* service : extra_services) {
    builder.RegisterService(service);
  }
  if (options.reflection) {
    server->reflection_ =
        std::make_unique<ReflectionService>(server->service_->unparsed_reads());
    builder.RegisterService(server->reflection_.get());
  }
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    if (server->server_ != nullptr) server->server_->Shutdown();
    return absl::UnavailableError(
        absl::StrCat("could not listen on ", uri,
                     " (port in use or address not available); choose another "
                     "--port/--listen_address, or --port=0 for a free port"));
  }
  if (server->reflection_ != nullptr) {
    // Every service the server registered, the default health service too.
    server->reflection_->SetServices(
        *grpc::ServerInitializer(server->server_.get()).GetServiceList());
  }
  // Serving from here: a failure below drains, which snapshots the
  // restored sessions again.
  RemoveRestoredFiles(options.snapshot_dir, restored_files);
  server->service_->SetAdvertiseAddress(
      AdvertiseAddress(options, server->port_));
  if (!options.peers.empty()) {
    if (options.advertise_address.empty()) {
      // Peers and clients are sent here by that address (SessionInfo.owner,
      // redirects): a host name only this machine resolves, or a loopback
      // address, sends them nowhere.
      Log(LogLevel::kWarning, "advertise_address_unset",
          {{"advertise_address", server->advertise_address()},
           {"hint",
            "with --peers, set --advertise_address to the host:port other "
            "replicas and clients reach this one at"}});
    }
    auto peers =
        Peers::Create(PeerOptions{.peers = options.peers,
                                  .self_address = server->advertise_address(),
                                  .client = *std::move(peer_client)});
    if (!peers.ok()) return peers.status();
    server->peers_ = *std::move(peers);
  }
  server->SetServing(true);
  // A backend that failed for good (a sticky GPU fault) answers UNAVAILABLE
  // to every call: report NOT_SERVING so that the pod is restarted.
  AttentionServer* const server_ptr = server.get();
  server->backend_watch_ = std::make_unique<BackendWatch>(
      &engine_ptr->backend(), absl::Seconds(1),
      [server_ptr](const absl::Status& failure) {
        Log(LogLevel::kError, "backend_failed",
            {{"error", std::string(failure.message())}});
        server_ptr->SetServing(false);
      });
  return server;
}

AttentionServer::AttentionServer(const ServerOptions& options,
                                 std::unique_ptr<AttentionEngine> engine,
                                 std::string backend_reason)
    : options_(options),
      backend_reason_(std::move(backend_reason)),
      engine_(std::move(engine)) {}

AttentionServer::~AttentionServer() {
  // The listener goes after the drain (a reload during it still reaches
  // the open streams) and before the members: the service goes before the
  // authenticator, whose watcher may reload.
  Shutdown();
  if (authenticator_ != nullptr) authenticator_->SetChangeListener(nullptr);
  if (transport_stopper_.joinable()) transport_stopper_.join();
}

std::string AttentionServer::advertise_address() const {
  return service_->advertise_address();
}

std::string AttentionServer::local_target() const {
  return absl::StrCat("localhost:", port_);
}

const char* AttentionServer::transport_mode() const {
  return TransportMode(TransportOptions(options_));
}

std::string AttentionServer::backend_name() const {
  return std::string(engine_->backend().name());
}

void AttentionServer::SetServing(bool serving) {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus(kServiceName, serving);
  health->SetServingStatus(serving);
}

void AttentionServer::Shutdown() {
  absl::MutexLock lock(&shutdown_mu_);
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  // Load balancers watching health stop routing here first; sessions living
  // here keep being served while their calls and streams finish.
  const absl::Time drain_start = absl::Now();
  const absl::Time snapshot_deadline = drain_start + options_.drain_timeout;
  // With a snapshot to write, calls get the first half of the drain.
  const absl::Time deadline = options_.snapshot_dir.empty()
                                  ? snapshot_deadline
                                  : drain_start + options_.drain_timeout / 2;
  SetServing(false);
  service_->StartDraining();
  Log(LogLevel::kInfo, "drain_started",
      {{"in_flight", service_->in_flight()},
       {"drain_timeout", absl::FormatDuration(options_.drain_timeout)},
       {"sessions", engine_->stats().active_sessions}});
  // Streams still open near the deadline (or opened after it) end as they
  // wait for their client, saying that nothing sent after their last reply
  // was applied (a step in progress finishes first), where gRPC's cancel
  // at the deadline would leave the client in doubt. A timer of its own
  // does it: a hand-over still running then (an import's answer awaited
  // past the deadline) does not delay it.
  const absl::Duration grace = ShutdownGrace(options_.drain_timeout);
  absl::Notification calls_done;
  std::thread end_idle_streams([this, &calls_done, at = deadline - grace] {
    calls_done.WaitForNotificationWithDeadline(at);
    service_->EndIdleStreams();
  });
  if (peers_ != nullptr) HandOverSessions(deadline);
  const auto wait_for_calls = [this](absl::Time until) {
    while (service_->in_flight() > 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
  };
  wait_for_calls(deadline - grace);
  calls_done.Notify();
  end_idle_streams.join();
  wait_for_calls(deadline);
  const int64_t left = service_->in_flight();
  // gRPC's shutdown cancels the calls left at the deadline, but may return
  // long after it: a client that stops reading keeps its reply, and the
  // shutdown, waiting in the transport. Neither the snapshot nor Shutdown
  // waits for it.
  transport_stopper_ = std::thread([this, deadline] {
    server_->Shutdown(absl::ToChronoTime(std::max(deadline, absl::Now())));
    transport_stopped_.Notify();
  });
  const bool stopped =
      transport_stopped_.WaitForNotificationWithDeadline(deadline + grace);
  Log(left > 0 || !stopped ? LogLevel::kWarning : LogLevel::kInfo,
      "drain_finished",
      {{"cancelled_calls", left},
       {"transport_stopped", stopped ? "true" : "false"}});
  if (!options_.snapshot_dir.empty()) WriteSnapshot(snapshot_deadline);
}

absl::Duration AttentionServer::ShutdownGrace(absl::Duration drain_timeout) {
  return std::min(absl::Seconds(1), drain_timeout / 10);
}

void AttentionServer::WriteSnapshot(absl::Time deadline) {
  // From here no call changes a session, so the snapshot holds every change
  // a caller may have been told of (the calls still in gRPC's hands fail
  // with UNAVAILABLE if they try). Changes still running get a quarter of
  // the time left: one stuck call must not cost every session its file.
  const absl::Time now = absl::Now();
  const absl::Time stop_deadline =
      now + std::max(absl::ZeroDuration(), (deadline - now) / 4);
  if (absl::Status stopped = engine_->StopChanges(stop_deadline);
      !stopped.ok()) {
    Log(LogLevel::kWarning, "snapshot_changes_still_running",
        {{"message", stopped.message()}});
  }
  const SaveAllResult saved =
      SaveAllSessions(*engine_, options_.snapshot_dir, deadline);
  metrics_->RecordSnapshot(saved.written, saved.failed, saved.duration);
  Log(saved.failed > 0 ? LogLevel::kError : LogLevel::kInfo, "snapshot_written",
      {{"dir", options_.snapshot_dir},
       {"sessions", saved.written},
       {"failed", saved.failed},
       {"kv_bytes", saved.bytes},
       {"duration_ms", absl::ToInt64Milliseconds(saved.duration)}});
}

void AttentionServer::HandOverSessions(absl::Time deadline) {
  // The peer token as it is now (a rotated Secret), read at the drain that
  // needs it; the one read at the start when it cannot be read.
  Peers* peers = peers_.get();
  std::unique_ptr<Peers> current;
  if (!options_.peer_token_file.empty()) {
    absl::StatusOr<client::ClientOptions> client = PeerClientOptions(options_);
    absl::StatusOr<std::unique_ptr<Peers>> fresh =
        client.ok()
            ? Peers::Create(PeerOptions{.peers = options_.peers,
                                        .self_address = advertise_address(),
                                        .client = *std::move(client)})
            : client.status();
    if (fresh.ok()) {
      current = *std::move(fresh);
      peers = current.get();
    } else {
      Log(LogLevel::kError, "peer_token_reload_failed",
          {{"file", options_.peer_token_file},
           {"error", fresh.status().message()}});
    }
  }
  SessionHandover handover(engine_.get(), peers, metrics_.get(),
                           advertise_address());
  const HandoverResult result = handover.HandOverAll(deadline);
  Log(result.failed + result.left > 0 ? LogLevel::kWarning : LogLevel::kInfo,
      "handover_finished",
      {{"sent", result.sent},
       {"failed", result.failed},
       {"left", result.left},
       {"duration_ms", absl::ToInt64Milliseconds(result.duration)}});
}

int AttentionServer::metrics_port() const {
  return options_.metrics_port >= 0 ? metrics_->port() : -1;
}

int64_t AttentionServer::calls_in_flight() const {
  return service_->in_flight();
}

void AttentionServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace attention::server
