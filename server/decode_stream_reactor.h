// DecodeStreamReactor: one Decode stream (bidirectional) on gRPC's callback
// API. One step per request, answered in order:
//
//   read request -> convert, bound -> DecodeBatcher (queued with the steps
//   of every other stream and call) -> result written -> read the next
//
// The stream reads its next request only once the previous step's result
// is written, so the order within a stream is the order of its requests,
// and at most one step per stream is in the batcher. No thread waits for
// the stream: between steps it is only this object; reads and writes
// complete on gRPC's threads, steps on the batcher's.
//
// The first failing request ends the stream with its status, prefixed with
// `requests[i]: ` (the client has seen i results); earlier steps stay
// applied. A request whose bytes do not parse is such a failing request
// (INVALID_ARGUMENT; server/unparsed_reads.h). Every session the stream has
// used stays in use (it cannot expire) until the stream ends. When the server's
// tenants change (a reloaded tokens file) the stream authenticates again at
// once if it waits for its client (OpenStreams calls it), else before its next
// step or read: a revoked token ends it with UNAUTHENTICATED, a token that now
// names another tenant lets the old tenant's sessions go, and a changed
// quota applies from the next step on. At the end of a drain's time for
// calls (OpenStreams::EndIdle) the stream ends as soon as it waits for its
// client's next request, with UNAVAILABLE and the trailing metadata
// `attention-stream-drained: 1`: it applied no request the client sent
// after its last reply. The stream counts as in
// flight while open; each step is recorded as one Decode request (its own
// code and latency).
//
// Threads: gRPC runs one reaction of the stream at a time; OpenStreams
// may call OnTenantsChanged meanwhile, which acts only while a read or a
// write is pending (reading_, writing_), when no reaction runs, and
// OnEndIdle, which acts only while a read is pending. mu_ orders them. A
// revocation found while a write is pending lets the stream's sessions go at
// once (a client that stops reading holds the write) and ends the stream when
// the write completes.
#ifndef ATTENTION_SERVER_DECODE_STREAM_REACTOR_H_
#define ATTENTION_SERVER_DECODE_STREAM_REACTOR_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "attention/v1/attention.pb.h"
#include "core/engine.h"
#include "core/session_holds.h"
#include "server/authenticator.h"
#include "server/decode_batcher.h"
#include "server/grpc_call_control.h"
#include "server/metrics.h"
#include "server/open_streams.h"
#include "server/request_scope.h"
#include "server/unparsed_reads.h"

namespace attention::server {

class DecodeStreamReactor final
    : public grpc::ServerBidiReactor<v1::DecodeRequest, v1::AttentionResult>,
      public OpenStreamListener {
 public:
  // What the stream runs on; everything must outlive the stream.
  struct Deps {
    AttentionEngine* engine;
    DecodeBatcher* batcher;
    ServerMetrics* metrics;  // may be null
    InFlightCounter* in_flight;
    int64_t max_message_bytes;
    const Authenticator* authenticator;  // may be null: no authentication
    OpenStreams* open_streams;           // may be null
    // Where the server notes a read that ended at a request that did not
    // parse; may be null (such a request then ends the stream as its
    // client's half-close would).
    UnparsedReads* unparsed_reads;
  };

  // Authenticates the caller (ending the stream at once when that fails).
  // Deletes itself when gRPC is done with the stream (OnDone).
  DecodeStreamReactor(grpc::CallbackServerContext* context, const Deps& deps);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override;
  void OnTenantsChanged() override ABSL_LOCKS_EXCLUDED(mu_);
  void OnEndIdle() override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The caller's tenant (again, when the tenants changed since it was last
  // found): UNAUTHENTICATED when its credentials no longer hold.
  absl::Status Authenticate();
  // Reads the next request, unless the tenants changed and the caller's
  // credentials no longer hold, or streams end when idle (the stream then
  // ends).
  void ReadNext() ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the stream as it waits for its client (OpenStreams::EndIdle), the
  // read pending (reading_) or about to start.
  void EndIdle() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // While a write is pending: when the caller's credentials no longer hold,
  // lets the held sessions go and sets revoked_.
  void RevokeWhileWriting() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs request_ as step `index_`: converted, bounded and queued in the
  // batcher; OnStepDone follows.
  void StartStep();
  void OnStepDone(absl::StatusOr<AttentionOutput> output);
  // Ends the stream with `status`: the one place its status is converted.
  void End(const absl::Status& status);
  // Finishes the stream (End, or a clean close by the client).
  void Close(const grpc::Status& status);

  grpc::CallbackServerContext* const context_;
  const Deps deps_;
  absl::Mutex mu_;
  // A read is pending: no reaction runs, and OnTenantsChanged and
  // OnEndIdle may act.
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  // OnTenantsChanged or OnEndIdle ended the stream: the pending read's
  // reaction does nothing.
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  // A reply is being written: no reaction runs until OnWriteDone.
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  // Not OK once the caller's credentials failed while a reply was being
  // written: OnWriteDone ends the stream with it.
  absl::Status revoked_ ABSL_GUARDED_BY(mu_);
  RequestScope scope_;
  std::optional<ScopedStreamMetric> open_stream_;  // once authenticated
  GrpcCallControl control_;
  // The caller, as the authenticator said at auth_generation_.
  Tenant tenant_;
  uint64_t auth_generation_ = 0;
  // The sessions the stream has used.
  SessionHolds held_;
  int64_t index_ = 0;
  v1::DecodeRequest request_;
  // The step being run: views into request_, output into result_. Reused,
  // so a steady stream reuses its buffers.
  AppendRequest append_;
  v1::AttentionResult result_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_DECODE_STREAM_REACTOR_H_
