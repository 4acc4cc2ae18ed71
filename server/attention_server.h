// AttentionServer: a running attention-service gRPC server — backend,
// engine, AttentionService, grpc.health.v1 and server reflection, with
// transport security and authentication as its options say — that can be
// embedded (the attention-server binary, in-process integration tests).
#ifndef ATTENTION_SERVER_ATTENTION_SERVER_H_
#define ATTENTION_SERVER_ATTENTION_SERVER_H_

#include <grpcpp/impl/service_type.h>
#include <grpcpp/server.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/types/span.h"
#include "core/engine.h"
#include "server/attention_service.h"
#include "server/authenticator.h"
#include "server/backend_watch.h"
#include "server/decode_batcher.h"
#include "server/metrics.h"
#include "server/peers.h"
#include "server/reflection_service.h"
#include "server/server_options.h"
#include "server/snapshot_store.h"

namespace attention::server {

// The server's version string (the project version).
const char* ServerVersion();

// Process-wide settings for a process whose job is serving (the
// attention-server binary, attn-bench); call once from main before any
// thread starts. In builds with NDEBUG it turns off absl::Mutex's deadlock
// detection, which Debian's absl leaves on: it updates a lock graph under a
// global lock on every Lock/Unlock (4-6 % of a small decode step's engine
// time). Builds without NDEBUG keep it, and tests, which do not call this,
// keep absl's default.
void ConfigureServingProcess();

// Thread-safety: all methods are thread-safe.
class AttentionServer {
 public:
  // Chooses the backend, creates the engine, binds and starts serving, then
  // reports SERVING on the health service. Errors: INVALID_ARGUMENT for bad
  // options, UNAVAILABLE when the address cannot be bound or an explicitly
  // requested backend is unusable, RESOURCE_EXHAUSTED when the KV pool cannot
  // be allocated.
  static absl::StatusOr<std::unique_ptr<AttentionServer>> Start(
      const ServerOptions& options);
  // As above, also registering `extra_services` on the same gRPC server
  // (same port, channel settings and message limits; e.g. attn-bench's echo
  // service). They are not owned and must outlive the AttentionServer.
  static absl::StatusOr<std::unique_ptr<AttentionServer>> Start(
      const ServerOptions& options,
      absl::Span<grpc::Service* const> extra_services);

  // Shuts down (see Shutdown) if that has not happened yet.
  ~AttentionServer();

  AttentionServer(const AttentionServer&) = delete;
  AttentionServer& operator=(const AttentionServer&) = delete;

  // The bound port (the ephemeral one when options.port was 0).
  int port() const { return port_; }
  // The address clients should use for this replica (SessionInfo.owner):
  // options().advertise_address, or the bound host:port.
  std::string advertise_address() const;
  // "localhost:<port>", for clients on the same machine.
  std::string local_target() const;
  const ServerOptions& options() const { return options_; }
  // "cpu" or "cuda", and why it was chosen (for the start-up line).
  std::string backend_name() const;
  const std::string& backend_reason() const { return backend_reason_; }
  // "plaintext", "tls" or "mutual-tls" (server/transport_security.h).
  const char* transport_mode() const;
  // "tokens", "client-cert" or "none" (server/authenticator.h).
  const char* auth_mode() const { return authenticator_->mode(); }
  // Re-reads the tokens file now (SIGHUP); on error the previous tenants
  // stay in force and the error names the file and line.
  absl::Status ReloadAuthTokens() { return authenticator_->Reload(); }
  AttentionEngine& engine() { return *engine_; }

  // Sets the grpc.health.v1 status of the server ("") and of
  // attention.v1.AttentionService (e.g. NOT_SERVING while draining).
  void SetServing(bool serving);

  // Drains, then stops: reports NOT_SERVING, refuses new sessions with
  // UNAVAILABLE, hands the sessions over to SERVING peers (with
  // options().peers; server/session_handover.h), waits until no call or
  // Decode stream is in flight or options().drain_timeout has passed, then
  // stops the gRPC server (cancelling what is left) and snapshots what is
  // left (with options().snapshot_dir). Idempotent; blocks until done, but
  // not for gRPC's transport past the drain: a client that stops reading a
  // reply can hold that for as long as it stays connected
  // (transport_stopped() says; the destructor waits for it).
  void Shutdown();
  // Whether gRPC's transport has stopped since Shutdown.
  bool transport_stopped() const {
    return transport_stopped_.HasBeenNotified();
  }

  // The bound metrics port, or -1 without a metrics endpoint.
  int metrics_port() const;
  // The Prometheus metrics (always recorded, served when metrics_port >= 0).
  ServerMetrics& metrics() { return *metrics_; }
  // Calls and open Decode streams inside a handler now: a unary call counts
  // from when its whole request has arrived until its reply is written.
  int64_t calls_in_flight() const;

  // Blocks until the server has shut down.
  void Wait();

 private:
  AttentionServer(const ServerOptions& options,
                  std::unique_ptr<AttentionEngine> engine,
                  std::string backend_reason);
  // The drain's handover of every session to peers_, until `deadline`.
  void HandOverSessions(absl::Time deadline);
  // Stops every change to the sessions, then writes them all to
  // options_.snapshot_dir, until `deadline`.
  void WriteSnapshot(absl::Time deadline);
  // How long before the calls' deadline open Decode streams are told to
  // end (OpenStreams::EndIdle), and how long past it the snapshot waits for
  // gRPC's shutdown before it goes ahead.
  static absl::Duration ShutdownGrace(absl::Duration drain_timeout);

  const ServerOptions options_;
  const std::string backend_reason_;
  // Declared in destruction order: the gRPC server goes first.
  std::unique_ptr<Authenticator> authenticator_;
  std::unique_ptr<AttentionEngine> engine_;
  // After the engine (destroyed first): it reads the engine at scrape time.
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<DecodeBatcher> decode_batcher_;
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<ReflectionService> reflection_;  // with options.reflection
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  // With options().peers: the replicas the drain hands sessions to.
  std::unique_ptr<Peers> peers_;
  SnapshotDirectoryLock snapshot_lock_;  // with snapshot_dir
  // Last: stopped first. Turns health NOT_SERVING when the backend fails.
  std::unique_ptr<BackendWatch> backend_watch_;

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  // Runs gRPC's shutdown from Shutdown on; joined by the destructor.
  std::thread transport_stopper_;
  absl::Notification transport_stopped_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_ATTENTION_SERVER_H_
