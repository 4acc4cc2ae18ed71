// AttentionServer: a running attention-service gRPC server — backend,
// engine, AttentionService, grpc.health.v1 and server reflection — that can
// be embedded (the attention-server binary, in-process integration tests).
#ifndef ATTENTION_SERVER_ATTENTION_SERVER_H_
#define ATTENTION_SERVER_ATTENTION_SERVER_H_

#include <grpcpp/server.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/engine.h"
#include "server/attention_service.h"
#include "server/server_options.h"

namespace attention::server {

// The server's version string (the project version).
const char* ServerVersion();

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

  // Shuts down (see Shutdown) if that has not happened yet.
  ~AttentionServer();

  AttentionServer(const AttentionServer&) = delete;
  AttentionServer& operator=(const AttentionServer&) = delete;

  // The bound port (the ephemeral one when options.port was 0).
  int port() const { return port_; }
  // "localhost:<port>", for clients on the same machine.
  std::string local_target() const;
  const ServerOptions& options() const { return options_; }
  // "cpu" or "cuda", and why it was chosen (for the start-up line).
  std::string backend_name() const;
  const std::string& backend_reason() const { return backend_reason_; }
  AttentionEngine& engine() { return *engine_; }

  // Sets the grpc.health.v1 status of the server ("") and of
  // attention.v1.AttentionService (e.g. NOT_SERVING while draining).
  void SetServing(bool serving);

  // Reports NOT_SERVING, stops accepting calls, lets in-flight calls finish
  // for up to options().shutdown_grace, then cancels the rest. Idempotent.
  void Shutdown();

  // Blocks until the server has shut down.
  void Wait();

 private:
  AttentionServer(const ServerOptions& options,
                  std::unique_ptr<AttentionEngine> engine,
                  std::string backend_reason);

  const ServerOptions options_;
  const std::string backend_reason_;
  // Declared in destruction order: the gRPC server goes first.
  std::unique_ptr<AttentionEngine> engine_;
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_ATTENTION_SERVER_H_
