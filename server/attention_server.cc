#include "server/attention_server.h"

#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/backend_factory.h"

#ifndef ATTN_SERVER_VERSION
#define ATTN_SERVER_VERSION "0.0.0"
#endif

namespace attention::server {
namespace {

absl::Status ValidateOptions(const ServerOptions& options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "port ", options.port, " is not in [0, 65535] (0 = pick a free one)"));
  }
  if (options.listen_address.empty()) {
    return absl::InvalidArgumentError(
        "listen_address is empty; use 0.0.0.0 (all interfaces) or an address");
  }
  if (options.max_message_bytes <= 0 ||
      options.max_message_bytes > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes ", options.max_message_bytes, " must be in [1, ",
        std::numeric_limits<int>::max(), "] (gRPC's limit)"));
  }
  if (options.max_session_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_session_tokens ",
                                                   options.max_session_tokens,
                                                   " must be positive"));
  }
  if (options.session_idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_idle_timeout ",
                     absl::FormatDuration(options.session_idle_timeout),
                     " must be positive"));
  }
  if (options.threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "threads ", options.threads, " must be >= 0 (0 = one per core)"));
  }
  return absl::OkStatus();
}

// "host:port", bracketing a bare IPv6 address.
std::string ListenUri(const std::string& address, int port) {
  if (address.find(':') != std::string::npos && address.front() != '[') {
    return absl::StrCat("[", address, "]:", port);
  }
  return absl::StrCat(address, ":", port);
}

// The name clients check with grpc.health.v1 (besides "" = the server).
constexpr char kServiceName[] = "attention.v1.AttentionService";

}  // namespace

const char* ServerVersion() { return ATTN_SERVER_VERSION; }

absl::StatusOr<std::unique_ptr<AttentionServer>> AttentionServer::Start(
    const ServerOptions& options) {
  if (absl::Status status = ValidateOptions(options); !status.ok()) {
    return status;
  }

  BackendOptions backend_options;
  backend_options.kind = options.backend;
  backend_options.threads = options.threads;
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
  auto engine =
      AttentionEngine::Create(std::move(choice->backend), engine_options);
  if (!engine.ok()) return engine.status();

  std::unique_ptr<AttentionServer> server(new AttentionServer(
      options, *std::move(engine), std::move(choice->reason)));
  server->service_ = std::make_unique<AttentionServiceImpl>(
      server->engine_.get(), ServerVersion(), options.max_message_bytes);

  // Both are process-wide switches read when a server is built.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  grpc::ServerBuilder builder;
  const std::string uri = ListenUri(options.listen_address, options.port);
  builder.AddListeningPort(uri, grpc::InsecureServerCredentials(),
                           &server->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  // gRPC sets SO_REUSEPORT by default, which would let two servers share a
  // port silently; a port in use must be an error instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    if (server->server_ != nullptr) server->server_->Shutdown();
    return absl::UnavailableError(
        absl::StrCat("could not listen on ", uri,
                     " (port in use or address not available); choose another "
                     "--port/--listen_address, or --port=0 for a free port"));
  }
  server->SetServing(true);
  return server;
}

AttentionServer::AttentionServer(const ServerOptions& options,
                                 std::unique_ptr<AttentionEngine> engine,
                                 std::string backend_reason)
    : options_(options),
      backend_reason_(std::move(backend_reason)),
      engine_(std::move(engine)) {}

AttentionServer::~AttentionServer() { Shutdown(); }

std::string AttentionServer::local_target() const {
  return absl::StrCat("localhost:", port_);
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
  // Load balancers watching health stop routing here first.
  SetServing(false);
  server_->Shutdown(absl::ToChronoTime(absl::Now() + options_.shutdown_grace));
}

void AttentionServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace attention::server
