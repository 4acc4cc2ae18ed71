// AttentionServiceImpl: the attention.v1.AttentionService RPCs over an
// AttentionEngine.
//
// Each handler converts the request (proto_convert.h), makes one engine
// call, and converts the result and status back (status_convert.h); the
// semantics and status codes are the engine's (core/engine.h). Decode steps
// (DecodeStep, Decode, BatchDecode) go through a DecodeBatcher, which runs
// concurrent steps as one engine batch; it adds one code: UNAVAILABLE when
// its queue is full (nothing applied; retry).
//
// The hot RPCs — Prefill, DecodeStep, the Decode stream and BatchDecode —
// use gRPC's callback API: a handler converts and bounds the request on the
// gRPC thread and hands the engine work to the DecodeBatcher (decode steps)
// or a small CallExecutor (Prefill), whose completion sends the reply
// (append_call.h, decode_stream_reactor.h). No thread blocks on the engine
// per call or per stream. Their requests and responses live on one protobuf
// arena per call (arena_messages.h). The other RPCs use the synchronous
// API.
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
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "core/call_control.h"
#include "core/engine.h"
#include "server/append_call.h"
#include "server/arena_messages.h"
#include "server/authenticator.h"
#include "server/call_executor.h"
#include "server/decode_batcher.h"
#include "server/decode_step_timing.h"
#include "server/metrics.h"
#include "server/open_streams.h"
#include "server/request_scope.h"
#include "server/server_options.h"
#include "server/stall_watchdog.h"
#include "server/tenant_queue_share.h"
#include "server/unparsed_reads.h"

namespace attention::server {

// The service with the hot RPCs on the callback API, the rest synchronous.
using AttentionServiceBase = v1::AttentionService::WithCallbackMethod_Prefill<
    v1::AttentionService::WithCallbackMethod_DecodeStep<
        v1::AttentionService::WithCallbackMethod_Decode<
            v1::AttentionService::WithCallbackMethod_BatchDecode<
                v1::AttentionService::Service>>>>;

class AttentionServiceImpl final : public AttentionServiceBase {
 public:
  // `engine` and `batcher` (which must run on `engine`) must outlive the
  // service. `version` is reported by GetServerInfo. Of `options` (valid)
  // the service uses max_message_bytes, transfer_stall_timeout (an
  // ExportSession or ImportSession that moves no message that long is
  // cancelled: server/stall_watchdog.h), max_queued_prefills,
  // max_queued_prefill_bytes, tenant_queue_share (of the prefill queue) and
  // on_decode_step_timing (when set, it receives the timing of every
  // successful DecodeStep). `metrics` may be null (no metrics); otherwise
  // it must outlive the service too. So must `authenticator`, which names
  // each call's tenant; null runs every call as DefaultTenant().
  AttentionServiceImpl(AttentionEngine* engine, DecodeBatcher* batcher,
                       std::string version, const ServerOptions& options,
                       ServerMetrics* metrics = nullptr,
                       const Authenticator* authenticator = nullptr);

  // From now on CreateSession, ForkSession and ImportSession fail with
  // UNAVAILABLE (a fork of a session not here: NOT_FOUND, or the redirect
  // of a moved one); calls on existing sessions still run (graceful drain).
  // Returns once the sessions being made have been (so that the drain's
  // hand-over and snapshot see all of them).
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
  // The server's tenants changed: open Decode streams authenticate again
  // (server/open_streams.h).
  void TenantsChanged() { open_streams_.TenantsChanged(); }
  // The drain's time for calls is over: open Decode streams end as soon as
  // they wait for their client (OpenStreams::EndIdle).
  void EndIdleStreams() { open_streams_.EndIdle(); }
  // Where the server's ParseErrorInterceptor notes the streams whose reads
  // ended at a message that did not parse (Decode, ImportSession).
  UnparsedReads* unparsed_reads() { return &unparsed_reads_; }

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
  // Runs on the CallExecutor (a prefill can take long).
  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* context,
                                    const v1::PrefillRequest* request,
                                    v1::AttentionResult* response) override;
  grpc::ServerUnaryReactor* DecodeStep(grpc::CallbackServerContext* context,
                                       const v1::DecodeRequest* request,
                                       v1::AttentionResult* response) override;
  // One step per request, answered in order: the stream reads its next
  // request only once the previous step's result is written. Each step is
  // batched with concurrent steps of other callers (DecodeBatcher). The
  // first failing request ends the stream with its status; earlier steps
  // stay applied (decode_stream_reactor.h).
  grpc::ServerBidiReactor<v1::DecodeRequest, v1::AttentionResult>* Decode(
      grpc::CallbackServerContext* context) override;
  // All steps run as one atomic group through the DecodeBatcher (one engine
  // AppendBatch, ordered with other callers' steps): all or nothing.
  grpc::ServerUnaryReactor* BatchDecode(grpc::CallbackServerContext* context,
                                        const v1::BatchDecodeRequest* request,
                                        v1::BatchDecodeResponse* response)
      override;
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
  // CheckSessionMessageSize for the caller's session `session_id` (NOT_FOUND
  // when it has none of that id), before a call whose reply is its
  // SessionInfo changes it. `control` ends a wait for a move (see
  // AttentionEngine::PeekSession).
  absl::Status CheckSessionMessageSizeOf(const std::string& session_id,
                                         const Tenant& tenant,
                                         const CallControl& control) const;
  // Runs `create`, which makes a session here, unless the server drains
  // (UNAVAILABLE). StartDraining waits for a running one, so that the
  // drain's hand-over and snapshot see every session made before it.
  absl::StatusOr<SessionInfo> UnlessDraining(
      absl::FunctionRef<absl::StatusOr<SessionInfo>()> create)
      ABSL_LOCKS_EXCLUDED(drain_mu_);
  // Puts a session transfer's call under transfer_watchdog_.
  StallWatchdog::Watch WatchTransfer(grpc::ServerContext* context);
  // Why the `what` ("import", "export") of a call that was cancelled or
  // went away ended: the watchdog's stall error when it cancelled it.
  absl::Status TransferEnded(const StallWatchdog::Watch& watch,
                             absl::string_view what) const;
  // Completes `options` (the caller's tenant set) for an ImportSession
  // call: a handover's keeps the snapshot's owner (see
  // AcceptHandoversFrom) and idle deadline; PERMISSION_DENIED when the
  // caller may not.
  absl::Status HandoverImportOptions(const grpc::ServerContext& context,
                                     ImportOptions& options) const;
  // The tenant of the call in `context`, or UNAUTHENTICATED.
  absl::StatusOr<Tenant> Caller(const grpc::ServerContextBase& context) const;
  // The start of a unary append (Prefill, DecodeStep): the caller's tenant
  // and the request converted and bounded into `call`, its reply prepared
  // in `response`.
  template <typename Request>
  absl::Status StartUnaryAppend(grpc::CallbackServerContext* context,
                                const Request& request,
                                v1::AttentionResult* response,
                                AppendCall* call);
  // Why a prefill holding `bytes` was not queued (UNAVAILABLE).
  absl::Status PrefillsOverloaded(const CallExecutor::Admission& admission,
                                  int64_t bytes) const;

  AttentionEngine* const engine_;
  DecodeBatcher* const batcher_;
  const std::string version_;
  const int64_t max_message_bytes_;
  ServerMetrics* const metrics_;
  const Authenticator* const authenticator_;
  const DecodeStepTimingHook on_decode_step_timing_;
  InFlightCounter in_flight_;
  OpenStreams open_streams_;
  UnparsedReads unparsed_reads_;
  StallWatchdog transfer_watchdog_;
  // Written under drain_mu_ (read without it where a late answer is fine).
  absl::Mutex drain_mu_;
  std::atomic<bool> draining_{false};
  std::string peer_tenant_ = "peer";
  mutable absl::Mutex advertise_mu_;
  std::string advertise_address_ ABSL_GUARDED_BY(advertise_mu_);
  ArenaMessageAllocator<v1::PrefillRequest, v1::AttentionResult>
      prefill_messages_;
  ArenaMessageAllocator<v1::DecodeRequest, v1::AttentionResult>
      decode_step_messages_;
  ArenaMessageAllocator<v1::BatchDecodeRequest, v1::BatchDecodeResponse>
      batch_decode_messages_;
  // What each tenant has waiting in prefill_executor_'s queue.
  TenantQueueShare prefill_share_;
  // Runs Prefills. Last: destroyed (drained and joined) first.
  CallExecutor prefill_executor_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_ATTENTION_SERVICE_H_
