// AttentionEngine: the whole attention service without any RPC layer —
// sessions, their paged KV caches, and stateless attention, over one
// backend. The server translates protobuf to these calls and back.
//
// Every method validates its inputs completely and either succeeds or
// changes nothing (no partial append, no leaked block). Status codes:
//   INVALID_ARGUMENT   bad shape/dtype, NaN/Inf, overflowing logits, bad spec
//   NOT_FOUND          unknown session
//   OUT_OF_RANGE       append past the session's max_tokens
//   RESOURCE_EXHAUSTED KV pool, session count or metadata budget full;
//                      a call whose arithmetic passes max_call_flops
//   FAILED_PRECONDITION truncation needing keys a window layer dropped
//   CANCELLED, DEADLINE_EXCEEDED
//                      the request's CallControl withdrew the call
//   INTERNAL           device failure
//
// Every session belongs to a tenant (core/tenant.h): the one whose call
// created it. Methods naming a session take the calling tenant (default:
// DefaultTenant()) and answer another tenant's session exactly as an
// unknown one (NOT_FOUND, same message). A tenant's quota adds
// RESOURCE_EXHAUSTED naming the quota, the usage and the limit: sessions
// (CreateSession, ForkSession) and KV bytes (appends, checked before any
// work).
//
// A call withdrawn through its CallControl stops within one KV chunk of
// work and, like any failed call, changes nothing: appends are committed
// only after a last check of the control, once nothing else can fail.
#ifndef ATTENTION_CORE_ENGINE_H_
#define ATTENTION_CORE_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/attention_problem.h"
#include "core/backend.h"
#include "core/block_pool.h"
#include "core/call_control.h"
#include "core/session.h"
#include "core/session_busy.h"
#include "core/session_export.h"
#include "core/session_import.h"
#include "core/session_manager.h"
#include "core/session_snapshot.h"
#include "core/session_spec.h"
#include "core/tenant.h"
#include "core/tenant_usage.h"
#include "core/tensor.h"

namespace attention {

struct EngineOptions {
  // KV pool capacity and block size (bytes). A session's tokens per block is
  // block_bytes / (its K+V bytes per token per layer).
  int64_t kv_cache_bytes = int64_t{1} << 30;
  int64_t kv_block_bytes = 64 << 10;
  // Largest [H, T_q, T_k] weights tensor (bytes) a stateless call may ask
  // for.
  int64_t max_weights_bytes = 64 << 20;
  // Most floating-point operations one call may ask for (AttentionFlops;
  // a batch of appends sums its steps); more is RESOURCE_EXHAUSTED before
  // any work. The default, 2^41 (about 2.2e12), is a 16k-token prefill of
  // 32 heads of 128 dims in one call: seconds on a CPU, milliseconds on a
  // GPU.
  int64_t max_call_flops = int64_t{1} << 41;
  // Recorded in session snapshots (SnapshotHeader::server_version).
  std::string version;
  SessionManagerOptions sessions;
};

// Appends T tokens to one layer (Prefill; DecodeStep is T == 1).
struct AppendRequest {
  std::string session_id;
  int32_t layer = 0;
  TensorView q;  // [T, H, head_dim]
  TensorView k;  // [T, H_kv, head_dim]
  TensorView v;  // [T, H_kv, value_dim]
  DType output_dtype = DType::kFloat32;
  bool return_lse = false;
  // When set, T must equal it (DecodeStep uses 1).
  std::optional<int64_t> required_tokens;
  // Optional caller-owned destination of the output, so that the output is
  // written once, straight where the caller sends it (the server passes the
  // RPC response's bytes) instead of into a Tensor it would then copy. When
  // non-empty it must hold exactly T * H * value_dim elements of
  // output_dtype (INVALID_ARGUMENT otherwise); the output, laid out as
  // AttentionOutput::output would be, is written there and
  // AttentionOutput::output is an empty tensor (shape [0], no bytes). A
  // float32 output is computed in place when the buffer is 4-byte aligned;
  // other dtypes are converted into it from a float32 scratch. The caller
  // keeps it alive and untouched during the call; on error its contents are
  // unspecified (the session is still unchanged).
  absl::Span<std::byte> output_destination;
  // Optional: withdraws the call (see call_control.h). Must outlive it.
  const CallControl* control = nullptr;
  // The calling tenant; null = DefaultTenant(). Must outlive the call.
  const Tenant* tenant = nullptr;
  // Optional: bytes of the encoded message the tensors view, which the
  // caller keeps while the request waits (what a server's queue bounds
  // count; the engine ignores it). 0 = the tensors alone.
  int64_t message_bytes = 0;
  // Top-k layers (LayerSpec::topk > 0) only; empty views otherwise: index
  // keys [T, index_dim] (stored in kv_dtype), index queries [T,
  // index_heads, index_dim] and weights [T, index_heads], any dtype.
  TensorView index_k;
  TensorView index_q;
  TensorView index_weights;
  // Also return the selected positions (AttentionOutput::topk_indices).
  bool return_topk_indices = false;
  // Most bytes the step's result may take in its reply (ResultBytes: what
  // the session's spec makes of the request); more is RESOURCE_EXHAUSTED
  // once the request checked out against the session, before any work.
  // < 0: no bound.
  int64_t max_reply_bytes = -1;
};

// Memory a waiting request keeps: the tensors it views (or the whole
// message they are in, unknown fields included, when message_bytes says)
// and its output destination. What a server's queues bound.
int64_t HeldBytes(const AppendRequest& request);

// Reply bytes one selected position may take (a varint int64).
inline constexpr int64_t kTopKIndexBytes = 10;

// The bytes of an append's result tensors, as a reply carries them: the
// output [T, num_q_heads, value_dim] in `output_dtype`, the lse [T,
// num_q_heads] float32 when asked, and the selected positions of a top-k
// layer (T * topk, kTopKIndexBytes each) when asked. A double, as the
// other bounds on a call.
double ResultBytes(const SessionSpec& spec, int32_t layer, int64_t tokens,
                   DType output_dtype, bool return_lse,
                   bool return_topk_indices);

// Stateless attention (attention.v1.AttentionRequest).
struct StatelessRequest {
  TensorView q;  // [T_q, H, head_dim]
  TensorView k;  // [T_k, H_kv, head_dim]
  TensorView v;  // [T_k, H_kv, value_dim]
  MaskSpec mask{.causal = false};
  std::vector<float> sink_logits;  // empty or H
  std::optional<TensorView> bias;  // [T_q, T_k] or [H, T_q, T_k]
  EmptyRowPolicy empty_row_policy = EmptyRowPolicy::kError;
  float scale = 0.0f;  // 0 = 1/sqrt(head_dim)
  bool return_weights = false;
  DType output_dtype = DType::kFloat32;
  bool return_lse = false;
  // Optional: withdraws the call (see call_control.h). Must outlive it.
  const CallControl* control = nullptr;
};

struct AttentionOutput {
  // [T, H, value_dim] in the requested dtype; empty (shape [0]) when the
  // request gave an output_destination.
  Tensor output;
  int64_t position = 0;
  std::optional<Tensor> weights;  // [H, T_q, T_k] float32
  std::optional<Tensor> lse;      // [T, H] float32
  // Top-k layers with return_topk_indices: [T, topk] selected positions,
  // increasing per row, padded with -1.
  std::vector<int64_t> topk_indices;
};

struct EngineStats {
  BlockPoolStats pool;
  int64_t active_sessions = 0;
  // SessionManager::metadata_bytes().
  int64_t session_metadata_bytes = 0;
  int64_t sessions_created_total = 0;
  int64_t sessions_expired_total = 0;
  // Tokens appended by committed calls: decode steps (requests with
  // required_tokens set, i.e. DecodeStep/Decode/BatchDecode) and prefill.
  int64_t decode_tokens_total = 0;
  int64_t prefill_tokens_total = 0;
  // AttentionBackend::shared_chunk_computations().
  int64_t shared_kv_chunks_total = 0;
  // !AttentionBackend::failure().ok(): the device failed for good.
  bool backend_failed = false;
  // AttentionBackend::scratch_bytes().
  int64_t backend_scratch_bytes = 0;
  // Sessions handed over to other replicas that lookups still redirect
  // (SessionManager::moved_sessions), and the redirects answered so far.
  int64_t moved_sessions = 0;
  int64_t moved_session_redirects_total = 0;
};

// Thread-safety: all methods are thread-safe. Calls on different sessions
// run in parallel; calls on the same session are serialised.
class AttentionEngine {
 public:
  // Takes ownership of `backend` and allocates the KV pool from it.
  // INVALID_ARGUMENT for bad options, RESOURCE_EXHAUSTED when the pool
  // cannot be allocated.
  static absl::StatusOr<std::unique_ptr<AttentionEngine>> Create(
      std::unique_ptr<AttentionBackend> backend, EngineOptions options);
  ~AttentionEngine();

  AttentionEngine(const AttentionEngine&) = delete;
  AttentionEngine& operator=(const AttentionEngine&) = delete;

  const AttentionBackend& backend() const { return *backend_; }
  const EngineOptions& options() const { return options_; }

  // `control` (may be null) is checked right before the session is added:
  // a call withdrawn by then creates nothing (its caller would never learn
  // the id).
  absl::StatusOr<SessionInfo> CreateSession(
      const SessionSpec& spec, absl::Duration idle_timeout,
      const Tenant& tenant = DefaultTenant(),
      const CallControl* control = nullptr);
  // A use of the session: a successful lookup restarts its idle clock. A
  // lookup of a session being moved waits for the move to end, or until
  // `control` (may be null) says the call was withdrawn (CANCELLED or
  // DEADLINE_EXCEEDED).
  absl::StatusOr<SessionInfo> GetSession(const std::string& id,
                                         const Tenant& tenant = DefaultTenant(),
                                         const CallControl* control = nullptr);
  // The same answer (waiting out a seal as GetSession does) without using
  // the session: its idle clock keeps running. For checks before a call
  // that may still fail, since a failed call changes nothing, the idle
  // clock included.
  absl::StatusOr<SessionInfo> PeekSession(
      const std::string& id, const Tenant& tenant = DefaultTenant(),
      const CallControl* control = nullptr);
  // Up to `page_size` (>= 1) of `tenant`'s sessions whose ids follow
  // `after` ("" = from the first), in increasing id order: page through all
  // of them by passing the last id of one page as `after` of the next. The
  // page also ends with the first session that brings the sum of its
  // sessions' metadata_bytes past `max_metadata_bytes` (so the copies a
  // page makes stay near a reply's size); `*cut` (may be null) is set to
  // whether it ended so with sessions left.
  std::vector<SessionInfo> ListSessions(
      const std::string& after, int64_t page_size,
      const Tenant& tenant = DefaultTenant(),
      int64_t max_metadata_bytes = std::numeric_limits<int64_t>::max(),
      bool* cut = nullptr) const;
  // Holds session `id` in use until the hold goes (a Decode stream holds
  // every session it has used while it is open): it cannot expire
  // meanwhile, but DeleteSession still frees it at once. NOT_FOUND for an
  // unknown id; UNAVAILABLE at once, without waiting, while the session is
  // being moved (sealed).
  absl::StatusOr<SessionHold> HoldSession(
      const std::string& id, const Tenant& tenant = DefaultTenant());
  //
  // Delete, fork and truncate may wait for a seal, and fork and truncate
  // for an append that holds the session (a delete removes the session at
  // once: an append running on it completes, as if it came first);
  // `control` (may be null) is checked once they hold it, right before the
  // change, and ends a wait for a seal: a call withdrawn meanwhile changes
  // nothing (CANCELLED or DEADLINE_EXCEEDED).
  absl::Status DeleteSession(const std::string& id,
                             const Tenant& tenant = DefaultTenant(),
                             const CallControl* control = nullptr);
  absl::StatusOr<SessionInfo> ForkSession(
      const std::string& id, const Tenant& tenant = DefaultTenant(),
      const CallControl* control = nullptr);
  // Cuts every layer longer than `length` back to it; all layers or none.
  absl::StatusOr<SessionInfo> TruncateSession(
      const std::string& id, int64_t length,
      const Tenant& tenant = DefaultTenant(),
      const CallControl* control = nullptr);

  // A session's id and its owner tenant's name.
  struct SessionOwner {
    std::string session_id;
    std::string owner;
  };
  // Every tenant's sessions, paged as ListSessions: what the server itself
  // hands over or snapshots when it drains. Only ids and owners: it reads
  // nothing a running call holds, so a long call on one session does not
  // hold up the listing.
  std::vector<SessionOwner> ListAllSessionOwners(const std::string& after,
                                                 int64_t page_size) const;

  // A consistent snapshot of `tenant`'s session `id` (see
  // core/session_export.h for what it costs); its header names the owner.
  // NOT_FOUND for an unknown id or another tenant's. Reading a session does
  // not restart its idle clock: the snapshot records its idle deadline.
  // Every session kind exports (MLA shared-latent and top-k sessions in
  // snapshot format version 2). The export must be destroyed before the
  // engine. A call running on the session is waited for, but not past
  // `wait_until` (SessionBusyError, see core/session_busy.h).
  absl::StatusOr<std::unique_ptr<SessionExport>> ExportSession(
      const std::string& id, const Tenant& tenant = DefaultTenant(),
      absl::Time wait_until = absl::InfiniteFuture());
  // From now on every call that would change a session (create, fork,
  // import, delete, truncate, append) fails with UNAVAILABLE; waits until
  // those already running have finished, but not past `deadline`
  // (DEADLINE_EXCEEDED when some have not). What a server does before its
  // shutdown snapshot, so that the snapshot holds every change made and
  // none comes after it. Reads and exports still work.
  absl::Status StopChanges(absl::Time deadline);
  // Seals session `id` (any tenant) for a handover to another replica; see
  // SessionManager::Seal for the waiting and the errors.
  absl::StatusOr<SessionSeal> SealSession(const std::string& id,
                                          absl::Time deadline);
  // A snapshot of the sealed session, as ExportSession (same refusals).
  absl::StatusOr<std::unique_ptr<SessionExport>> ExportSealed(
      const SessionSeal& seal);
  // Starts restoring a session from a snapshot whose header is `header`
  // (see core/session_import.h for the protocol and its errors;
  // FAILED_PRECONDITION for a spec the backend does not serve, as
  // CreateSession: MLA or top-k on CUDA). The import must be destroyed
  // before the engine.
  absl::StatusOr<std::unique_ptr<SessionImport>> BeginImport(
      const SnapshotHeader& header, const ImportOptions& options);

  // Prefill / DecodeStep: appends the request's K/V to the layer and returns
  // causal attention of its queries over the layer's visible history. On a
  // session being moved (sealed) it waits for the move to end, or until the
  // request's control says the call was withdrawn.
  absl::StatusOr<AttentionOutput> Append(const AppendRequest& request);

  // The batched calls below serve many sessions at once, so they never wait
  // for a move: a step on a sealed session fails with UNAVAILABLE at once
  // (nothing applied; a retry after the move gets the redirect).

  // Both wait for a session another call holds (a Prefill computing over
  // it), unless `busy` is BusySessions::kSkip (core/session_busy.h): then
  // they never wait, and a step on such a session applies nothing and fails
  // with SessionBusyError (AppendBatch: the whole batch).

  // Several appends validated together and applied all or nothing (the
  // BatchDecode RPC). A (session, layer) may appear at most once. Results
  // are in request order and bitwise equal to running each request alone.
  // When steps fail in the backend (AttentionBackend::AttendEach: each
  // step's error is the one it would get alone), the error names the first
  // of them. `max_reply_bytes` (< 0: no bound) bounds the sum of the steps'
  // ResultBytes, which one reply carries: RESOURCE_EXHAUSTED before any
  // work when they pass it.
  absl::StatusOr<std::vector<AttentionOutput>> AppendBatch(
      absl::Span<const AppendRequest> requests, int64_t max_reply_bytes = -1,
      BusySessions busy = BusySessions::kWait);

  // Several independent appends run as one backend batch (continuous
  // batching of concurrent decode steps): each request succeeds or fails on
  // its own, exactly as Append would, and the results are bitwise those of
  // Append. A (session, layer) appearing twice fails its later occurrences
  // with ABORTED (retry them in a later batch).
  std::vector<absl::StatusOr<AttentionOutput>> AppendEach(
      absl::Span<const AppendRequest> requests,
      BusySessions busy = BusySessions::kWait);

  // Stateless attention over the request's own keys and values.
  absl::StatusOr<AttentionOutput> Attend(const StatelessRequest& request);

  EngineStats stats() const;
  // What the sessions of the tenant named `name` hold now.
  TenantStats tenant_stats(const std::string& name) const;

 private:
  AttentionEngine(std::unique_ptr<AttentionBackend> backend,
                  std::unique_ptr<BlockPool> pool, EngineOptions options);

  struct BatchStep;
  // Runs `requests` as one batch. Atomic: the first error fails every step
  // and is returned. Otherwise each step gets its own status in `statuses`.
  // A step on a sealed session waits or fails as `seal_wait` says, one on
  // a session another call holds as `busy` says. An atomic batch's steps'
  // ResultBytes add up to at most `max_batch_reply_bytes` (< 0: no bound).
  absl::Status RunBatch(absl::Span<const AppendRequest> requests, bool atomic,
                        int64_t max_batch_reply_bytes,
                        SessionManager::SealWait seal_wait, BusySessions busy,
                        std::vector<absl::Status>* statuses,
                        std::vector<AttentionOutput>* outputs);
  absl::Status ValidateStep(BatchStep& step);
  static int64_t OutputFloats(const BatchStep& step);
  // RESOURCE_EXHAUSTED when `flops` passes options_.max_call_flops.
  absl::Status CheckCallCost(double flops) const;

  const std::unique_ptr<AttentionBackend> backend_;
  const std::unique_ptr<BlockPool> pool_;
  const EngineOptions options_;
  SessionManager sessions_;
  std::atomic<int64_t> decode_tokens_total_{0};
  std::atomic<int64_t> prefill_tokens_total_{0};
};

}  // namespace attention

#endif  // ATTENTION_CORE_ENGINE_H_
