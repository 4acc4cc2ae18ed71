// AttentionServiceImpl: the attention.v1.AttentionService RPCs over an
// AttentionEngine (synchronous gRPC API).
//
// Each handler converts the request (proto_convert.h), makes one engine
// call, and converts the result and status back (status_convert.h); the
// semantics and status codes are the engine's (core/engine.h). Decode steps
// (DecodeStep, Decode, BatchDecode) go through a DecodeBatcher, which runs
// concurrent steps as one engine batch; it adds one code: UNAVAILABLE when
// its queue is full (nothing applied; retry).
//
// Every call first learns its tenant from the Authenticator (UNAUTHENTICATED
// when it cannot) and acts on that tenant's sessions only (core/engine.h).
//
// Tensor bytes are copied as little as the protobuf API allows: inputs are
// views into the request's bytes (the engine converts them straight into the
// KV blocks), and a Prefill's or decode step's output is written once by the
// engine, straight into the response's pre-sized bytes (AppendRequest's
// output_destination).
//
// Thread-safety: handlers run concurrently on gRPC's threads; the engine is
// thread-safe.
#ifndef ATTENTION_SERVER_ATTENTION_SERVICE_H_
#define ATTENTION_SERVER_ATTENTION_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "core/engine.h"
#include "server/authenticator.h"
#include "server/decode_batcher.h"
#include "server/metrics.h"
#include "server/request_scope.h"

namespace attention::server {

class AttentionServiceImpl final : public v1::AttentionService::Service {
 public:
  // `engine` and `batcher` (which must run on `engine`) must outlive the
  // service. `version` and `max_message_bytes` are reported by
  // GetServerInfo.
  // `metrics` may be null (no metrics); otherwise it must outlive the
  // service too. So must `authenticator`, which names each call's tenant;
  // null runs every call as DefaultTenant().
  AttentionServiceImpl(AttentionEngine* engine, DecodeBatcher* batcher,
                       std::string version, int64_t max_message_bytes,
                       ServerMetrics* metrics = nullptr,
                       const Authenticator* authenticator = nullptr);

  // From now on CreateSession and ForkSession fail with UNAVAILABLE (a fork
  // of a session not here: NOT_FOUND, or the redirect of a moved one);
  // calls on existing sessions still run (graceful drain).
  void StartDraining();
  // ImportSession calls carrying kHandoverMetadata (a draining peer handing
  // a session over; server/session_handover.h) keep the snapshot's owner
  // tenant - instead of becoming the caller's - when the caller is the
  // tenant named `peer_tenant` (a tokens-file tenant or a client
  // certificate's CN), or when the server authenticates nobody; from any
  // other caller they fail with PERMISSION_DENIED. Call before serving.
  void AcceptHandoversFrom(std::string peer_tenant) {
    peer_tenant_ = std::move(peer_tenant);
  }
  // Whether StartDraining has been called.
  bool draining() const { return draining_.load(std::memory_order_acquire); }
  // The replica's --advertise_address ("host:port"): SessionInfo.owner and
  // ServerInfo.advertise_address. Set once the port is bound, before the
  // server reports SERVING.
  void SetAdvertiseAddress(std::string address);
  std::string advertise_address() const;
  // Calls and open streams currently inside a handler.
  int64_t in_flight() const { return in_flight_.count(); }

  grpc::Status CreateSession(grpc::ServerContext* context,
                             const v1::CreateSessionRequest* request,
                             v1::SessionInfo* response) override;
  grpc::Status GetSession(grpc::ServerContext* context,
                          const v1::GetSessionRequest* request,
                          v1::SessionInfo* response) override;
  grpc::Status ListSessions(grpc::ServerContext* context,
                            const v1::ListSessionsRequest* request,
                            v1::ListSessionsResponse* response) override;
  grpc::Status DeleteSession(grpc::ServerContext* context,
                             const v1::DeleteSessionRequest* request,
                             v1::DeleteSessionResponse* response) override;
  grpc::Status ForkSession(grpc::ServerContext* context,
                           const v1::ForkSessionRequest* request,
                           v1::SessionInfo* response) override;
  grpc::Status TruncateSession(grpc::ServerContext* context,
                               const v1::TruncateSessionRequest* request,
                               v1::SessionInfo* response) override;
  grpc::Status Prefill(grpc::ServerContext* context,
                       const v1::PrefillRequest* request,
                       v1::AttentionResult* response) override;
  grpc::Status DecodeStep(grpc::ServerContext* context,
                          const v1::DecodeRequest* request,
                          v1::AttentionResult* response) override;
  // One step per request, answered in order: the stream reads its next
  // request only once the previous step's result is written. Each step is
  // batched with concurrent steps of other callers (DecodeBatcher). The
  // first failing request ends the stream with its status; earlier steps
  // stay applied.
  grpc::Status Decode(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::AttentionResult, v1::DecodeRequest>* stream)
      override;
  // All steps run as one atomic group through the DecodeBatcher (one engine
  // AppendBatch, ordered with other callers' steps): all or nothing.
  grpc::Status BatchDecode(grpc::ServerContext* context,
                           const v1::BatchDecodeRequest* request,
                           v1::BatchDecodeResponse* response) override;
  grpc::Status Attention(grpc::ServerContext* context,
                         const v1::AttentionRequest* request,
                         v1::AttentionResult* response) override;
  // Streams the session's snapshot: header, data chunks of about 1 MiB,
  // trailer (server/session_transfer.h).
  grpc::Status ExportSession(
      grpc::ServerContext* context, const v1::ExportSessionRequest* request,
      grpc::ServerWriter<v1::SessionChunk>* writer) override;
  // Creates a session from a snapshot stream; nothing stays behind when it
  // fails. UNAVAILABLE while draining.
  grpc::Status ImportSession(grpc::ServerContext* context,
                             grpc::ServerReader<v1::SessionChunk>* reader,
                             v1::SessionInfo* response) override;
  grpc::Status GetServerInfo(grpc::ServerContext* context,
                             const v1::GetServerInfoRequest* request,
                             v1::ServerInfo* response) override;

 private:
  // `info` as the reply's SessionInfo, owned by this replica.
  void SessionReply(const SessionInfo& info, v1::SessionInfo* out) const;
  // Completes `options` (the caller's tenant set) for an ImportSession
  // call: a handover's keeps the snapshot's owner (see
  // AcceptHandoversFrom); PERMISSION_DENIED when the caller may not.
  absl::Status HandoverImportOptions(const grpc::ServerContext& context,
                                     ImportOptions& options) const;
  // The tenant of the call in `context`, or UNAUTHENTICATED.
  absl::StatusOr<Tenant> Caller(const grpc::ServerContext& context) const;
  // One unary append (Prefill, DecodeStep): the caller's tenant, the
  // request converted, run with `run` (the engine or the batcher) under the
  // call's control, and the reply written straight into `response`.
  template <typename Request, typename Run>
  grpc::Status UnaryAppend(grpc::ServerContext* context, RpcMethod method,
                           const Request& request,
                           v1::AttentionResult* response, Run run);

  AttentionEngine* const engine_;
  DecodeBatcher* const batcher_;
  const std::string version_;
  const int64_t max_message_bytes_;
  ServerMetrics* const metrics_;
  const Authenticator* const authenticator_;
  InFlightCounter in_flight_;
  std::atomic<bool> draining_{false};
  std::string peer_tenant_ = "peer";
  mutable absl::Mutex advertise_mu_;
  std::string advertise_address_ ABSL_GUARDED_BY(advertise_mu_);
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_ATTENTION_SERVICE_H_
