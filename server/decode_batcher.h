// DecodeBatcher: continuous batching of decode steps. Steps submitted
// concurrently (from Decode streams, DecodeStep calls and BatchDecode calls
// on any sessions) are gathered and run as ONE engine call, and every caller
// gets its own result.
//
// Design (leader/follower, no batcher thread):
//   - A caller queues its step and blocks. When no batch is being formed or
//     run, the caller becomes the *leader*: it waits (bounded by
//     `batch_wait`) for more steps, takes a batch off the queue, runs it on
//     its own thread with AttentionEngine::AppendEach, hands every caller its
//     result, and repeats until its own step is done. Then it hands the lead
//     to the oldest queued caller (if any) and returns.
//   - Running the batch on a caller's thread avoids a thread hop on every
//     step (a lone DecodeStep runs exactly as a direct engine call would)
//     and leaves nothing to start or join. Only one batch runs at a time;
//     steps arriving meanwhile queue up and form the next batch, so the
//     engine is never idle while work waits (continuous batching).
//   - The wait ends early once as many steps are queued as the previous
//     batch held (the recent concurrency), so a lone client never waits and
//     a steady group of N streams is gathered N at a time; after a burst,
//     at most one batch waits the full `batch_wait` before the estimate
//     adapts.
//   - Ordering: steps of one (session, layer) run in arrival order and never
//     share a batch (the engine would fail a duplicate with ABORTED); a later
//     duplicate is deferred to a later batch, together with every step of
//     that (session, layer) queued behind it.
//   - Atomic groups (BatchDecode) go through the same queue and run, when
//     they reach its front, as one all-or-nothing AttentionEngine::AppendBatch
//     call of their own, so they keep their all-or-nothing semantics and the
//     per-(session, layer) order relative to the other steps.
//   - Back-pressure: when more than `max_queued_steps` steps are waiting, a
//     new submission fails at once with UNAVAILABLE instead of queueing.
//
// Results are bitwise those of AttentionEngine::Append (the engine
// guarantees batch invariance); each step succeeds or fails on its own.
//
// Thread-safety: all methods are thread-safe. Append and AppendAtomic block
// the calling thread until the step (or group) has run.
#ifndef ATTENTION_SERVER_DECODE_BATCHER_H_
#define ATTENTION_SERVER_DECODE_BATCHER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/engine.h"

namespace attention::server {

struct DecodeBatcherOptions {
  // Longest time the first step of a batch waits for others to join it.
  // Zero disables waiting; whatever is already queued is still batched.
  absl::Duration batch_wait = absl::Microseconds(200);
  // Most independent steps per engine call (an atomic group always runs
  // whole, whatever its size).
  int max_batch_size = 256;
  // Most steps waiting in the queue; beyond it submissions fail with
  // UNAVAILABLE. A submission into an empty queue is always accepted.
  int64_t max_queued_steps = 4096;
  // Called once per engine call with its number of steps (e.g. for the
  // attention_decode_batch_size histogram). Runs on the thread that ran the
  // batch, after the engine call and before the callers are woken; never
  // concurrently with itself. Must be cheap and must not call the batcher.
  std::function<void(int64_t batch_size)> on_batch;
};

class DecodeBatcher {
 public:
  // INVALID_ARGUMENT naming the offending option.
  static absl::Status ValidateOptions(const DecodeBatcherOptions& options);

  // `engine` must outlive the batcher. REQUIRES: ValidateOptions(options)
  // is OK.
  DecodeBatcher(AttentionEngine* engine, DecodeBatcherOptions options);
  // REQUIRES: no Append / AppendAtomic call in progress.
  ~DecodeBatcher();

  DecodeBatcher(const DecodeBatcher&) = delete;
  DecodeBatcher& operator=(const DecodeBatcher&) = delete;

  // Runs one independent step in the next suitable batch and returns what
  // AttentionEngine::Append would (same status codes, same bits), or
  // UNAVAILABLE when the queue is full (nothing was applied; retry later).
  // `request` (and the tensors it views, and its output destination) must
  // stay valid until the call returns.
  absl::StatusOr<AttentionOutput> Append(const AppendRequest& request);

  // Runs `requests` as one all-or-nothing AttentionEngine::AppendBatch call
  // (BatchDecode), ordered with the other steps of the same sessions and
  // layers. Same results and codes as AppendBatch, or UNAVAILABLE when the
  // queue is full.
  absl::StatusOr<std::vector<AttentionOutput>> AppendAtomic(
      absl::Span<const AppendRequest> requests);

  const DecodeBatcherOptions& options() const { return options_; }

  // Steps waiting in the queue now (not those of the batch running).
  int64_t queued_steps() const;

 private:
  // One submission: a lone step or an atomic group. Owned by the caller's
  // stack frame, which blocks until `done`.
  struct Entry {
    absl::Span<const AppendRequest> requests;
    bool atomic = false;
    // Set under mu_. `lead`: this caller must now run batches.
    bool done = false;
    bool lead = false;
    // Written by the leader before `done` is set; read by the owner after.
    absl::StatusOr<AttentionOutput> step_result;
    absl::StatusOr<std::vector<AttentionOutput>> group_result;
  };

  // Queues `entry`, then waits for it to be done, leading batches when its
  // turn comes. UNAVAILABLE when the queue is full (entry not queued).
  absl::Status Submit(Entry& entry);
  // Runs batches until `self` is done, then passes the lead on.
  void LeadUntilDone(Entry& self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The bounded wait for more steps before a batch is taken.
  void WaitForBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the next batch from the queue: the front atomic group alone, or
  // up to max_batch_size independent steps with distinct (session, layer)
  // that no earlier queued step of the same (session, layer) precedes.
  std::vector<Entry*> TakeBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs a batch taken by TakeBatch (without holding mu_) and stores every
  // entry's result.
  void RunBatch(absl::Span<Entry* const> batch);

  AttentionEngine* const engine_;
  const DecodeBatcherOptions options_;

  mutable absl::Mutex mu_;
  std::deque<Entry*> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_steps_ ABSL_GUARDED_BY(mu_) = 0;
  // True while some caller leads (forms or runs a batch).
  bool leader_active_ ABSL_GUARDED_BY(mu_) = false;
  // Steps in the last independent batch: how many to wait for next time.
  int64_t expected_batch_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_DECODE_BATCHER_H_
