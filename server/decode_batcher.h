// DecodeBatcher: continuous batching of decode steps. Steps submitted
// concurrently (from Decode streams, DecodeStep calls and BatchDecode calls
// on any sessions) are gathered and run as ONE engine call, and every caller
// gets its own result through its completion callback.
//
// Design (one batch thread, completion callbacks):
//   - A submission (AppendAsync / AppendAtomicAsync) only queues the step
//     with its callback and returns: the gRPC callback thread that submits
//     it does not block on the engine (but see lone callers below), and no
//     thread waits per step or per stream.
//   - The batcher's own thread forms the batches: it waits (bounded, see
//     below) for more steps, takes a batch off the queue, runs it
//     with AttentionEngine::AppendEach (the engine parallelizes it over its
//     backend threads, this thread included), then calls the callback of
//     every entry that ran, in queue order, and repeats. Only one batch runs at
//     a time; steps arriving meanwhile queue up and form the next batch, so the
//     engine is never idle while work waits (continuous batching). A lone
//     step pays one thread wake-up over a direct engine call; the gRPC
//     thread that received it is free meanwhile.
//   - Replies overlap the next batch: when steps already wait for the next
//     batch and the finished batch's steps each kept the engine busy for at
//     least `overlap_replies_step_time` (on average), the batch thread hands
//     its callbacks (which encode and send the replies) to the batcher's
//     reply thread and starts that batch at once, instead of leaving the
//     engine idle while it answers every caller. Otherwise it calls them
//     itself: a lone step pays no second hand-off, and small steps, whose
//     replies cost more than their engine work, are not all funneled
//     through one reply thread. Either way the callbacks of all batches run
//     in batch order (a batch's callbacks go to the reply thread also while
//     an earlier batch's are still running there). The batch thread runs
//     at most one batch ahead of the reply thread: it starts a batch only
//     while the callbacks of at most one earlier batch wait there, so
//     steps that ran but are not yet answered (each holding its request
//     and reply) cannot pile up outside the queue's bounds; when replies
//     fall behind, the queue fills and back-pressure refuses new steps.
//   - Lone callers: a submission may allow running inline
//     (RunInline::kWhenIdle, DecodeStep does). When the batcher is idle --
//     nothing queued or running -- and its last batch was a lone step (no
//     concurrency lately), such a step runs at once on the submitting
//     thread as a batch of its own, saving the wake-up; it holds that
//     thread for the engine step, as a direct engine call would (unless
//     its session is busy: then it queues, see below). Steps arriving
//     meanwhile queue as behind any running batch.
//   - The wait ends once as many steps are queued as the previous batch
//     held (the recent concurrency), so a lone client never waits and a
//     steady group of N streams is gathered N at a time. Otherwise it lasts
//     while steps keep arriving: it ends when none has arrived for
//     `batch_wait`, and at the latest kMaxWaitGaps * `batch_wait` after it
//     began. Steps of N streams answered together come back spread over
//     the transport's time for N round trips (milliseconds on 2 cores), so
//     this gathers them into one batch while the CPU is busy with that
//     transport anyway, instead of splitting them into many small ones;
//     after a burst the estimate adapts with the next batch.
//   - Ordering: steps of one (session, layer) run in arrival order and never
//     share a batch (the engine would fail a duplicate with ABORTED); a later
//     duplicate is deferred to a later batch, together with every step of
//     that (session, layer) queued behind it.
//   - Atomic groups (BatchDecode) go through the same queue and run, when
//     they reach its front (or only entries waiting for busy sessions, see
//     below, and none of the group's (session, layer)s, are before them),
//     as one all-or-nothing AttentionEngine::AppendBatch
//     call of their own (however many steps: one engine batch), so they keep
//     their all-or-nothing semantics and the per-(session, layer) order
//     relative to the other steps.
//   - Busy sessions: a step whose session another call holds when its
//     batch starts (a Prefill computing over it) does not hold up the
//     batch: the engine leaves it out (BusySessions::kSkip, nothing
//     applied) and it goes back to the front of the queue, to be tried
//     again after a back-off (kFirstBusyRetry, doubling up to
//     kMaxBusyRetry) in a later batch, still ahead of the later steps of
//     its (session, layer). Meanwhile the other steps run; so does an
//     atomic group, once none of its (session, layer)s waits before it.
//   - Back-pressure: when `max_queued_steps` steps are waiting, or the
//     tensors of those waiting (request and reply buffers) would pass
//     `max_queued_bytes`, a new submission fails at once with UNAVAILABLE
//     instead of queueing. A submission larger than a bound on its own
//     (a BatchDecode of more steps) is refused only when the queue is
//     full, and otherwise waits behind what is queued. With
//     `tenant_bounds`, a submission that would take its tenant's waiting
//     steps past them fails with RESOURCE_EXHAUSTED instead
//     (TenantQueueShare), so that other tenants still find room.
//
// Results are bitwise those of AttentionEngine::Append (the engine
// guarantees batch invariance); each step succeeds or fails on its own.
//
// Thread-safety: all methods are thread-safe. Callbacks run on the batch
// thread or the reply thread (or, for a refused submission or a step run
// inline, on the submitting thread before the submission returns); they
// must be short (finish a reply, start the next read) and must not call the
// blocking Append / AppendAtomic.
#ifndef ATTENTION_SERVER_DECODE_BATCHER_H_
#define ATTENTION_SERVER_DECODE_BATCHER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/engine.h"
#include "server/call_executor.h"
#include "server/decode_step_timing.h"
#include "server/tenant_queue_share.h"

namespace attention::server {

struct DecodeBatcherOptions {
  // How long the batch being formed waits for one more step to arrive
  // (the wait as a whole is bounded by kMaxWaitGaps times this). Zero
  // disables waiting; whatever is already queued is still batched.
  absl::Duration batch_wait = absl::Microseconds(200);
  // Most independent steps per engine call (an atomic group always runs
  // whole, whatever its size).
  int max_batch_size = 256;
  // Most steps waiting in the queue; beyond it submissions fail with
  // UNAVAILABLE. A submission of more steps on its own is accepted while
  // fewer are queued (so the queue may hold up to one such submission more,
  // and the steps of one batch sent back because their sessions were
  // busy).
  int64_t max_queued_steps = 4096;
  // Most bytes the waiting steps may hold (their request messages, or the
  // tensors they view when AppendRequest::message_bytes is not set, and
  // their reply buffers); a submission that would pass it fails with
  // UNAVAILABLE, unless it holds more on its own and the queue holds less
  // (an empty queue takes any submission: 0 queues one at a time).
  int64_t max_queued_bytes = int64_t{1} << 30;
  // What one tenant's waiting steps may hold of the queue (steps, and
  // bytes as max_queued_bytes counts them); past them its submission fails
  // with RESOURCE_EXHAUSTED (server/tenant_queue_share.h). Unbounded by
  // default.
  TenantQueueBounds tenant_bounds;
  // Shortest engine time per step (the batch's engine call over its steps)
  // for which a batch's callbacks may move to the reply thread so that the
  // next batch starts at once (see the design note): zero whenever steps
  // wait, InfiniteDuration() never. On 2 cores a reply costs 10-30 us of
  // CPU; handing off context-2048 steps (about 150 us each in batches of
  // 64 streams) raised the served rate, handing off context-16 steps
  // (about 7 us) lowered it.
  absl::Duration overlap_replies_step_time = absl::Microseconds(50);
  // Called once per engine call with its number of steps that ran (e.g.
  // for the attention_decode_batch_size histogram; not when every step was
  // left out for a busy session). Runs on the thread that ran the
  // batch (the batch thread, or the submitter of a step run inline), after
  // the engine call and before the entries' callbacks; never concurrently
  // with itself. Must be cheap and must not call the batcher.
  std::function<void(int64_t batch_size)> on_batch;
};

class DecodeBatcher {
 public:
  // The longest wait for a batch, in units of DecodeBatcherOptions::
  // batch_wait.
  static constexpr int kMaxWaitGaps = 8;
  // The back-off of a step left out of a batch because its session was
  // busy: the first, doubled at every further try up to the last.
  static constexpr absl::Duration kFirstBusyRetry = absl::Microseconds(50);
  static constexpr absl::Duration kMaxBusyRetry = absl::Milliseconds(5);

  // Whether a step may run on the submitting thread (see the design note).
  enum class RunInline { kNo, kWhenIdle };

  // Receives a step's result (what AttentionEngine::Append returns) or
  // UNAVAILABLE when the queue was full (RESOURCE_EXHAUSTED: its tenant's
  // part of it).
  using StepDone = absl::AnyInvocable<void(absl::StatusOr<AttentionOutput>)>;
  // Receives an atomic group's results (what AppendBatch returns) or
  // UNAVAILABLE when the queue was full (RESOURCE_EXHAUSTED: its tenant's
  // part of it).
  using GroupDone =
      absl::AnyInvocable<void(absl::StatusOr<std::vector<AttentionOutput>>)>;

  // INVALID_ARGUMENT naming the offending option.
  static absl::Status ValidateOptions(const DecodeBatcherOptions& options);

  // `engine` must outlive the batcher. Starts the batch thread. REQUIRES:
  // ValidateOptions(options) is OK.
  DecodeBatcher(AttentionEngine* engine, DecodeBatcherOptions options);
  // Runs what is still queued (calling its callbacks), then joins the batch
  // thread and the reply thread. REQUIRES: no submission in progress or to
  // come.
  ~DecodeBatcher();

  DecodeBatcher(const DecodeBatcher&) = delete;
  DecodeBatcher& operator=(const DecodeBatcher&) = delete;

  // Queues one independent step for the next suitable batch and returns at
  // once. `done` runs exactly once: with what AttentionEngine::Append would
  // return (same status codes, same bits), after the step ran, on the batch
  // thread or the reply thread; or with UNAVAILABLE when the queue is full
  // (RESOURCE_EXHAUSTED when its tenant's part of it is; nothing applied,
  // retry later), on this thread before AppendAsync returns. `request` (and
  // the tensors it views, its output destination, control and tenant) must
  // stay valid until `done` runs. When `times` is not null, it receives when
  // the step's batch ran, before `done` runs. With RunInline::kWhenIdle and
  // an idle batcher the step instead runs on this thread, and `done` with
  // it, before AppendAsync returns (unless its session is busy: then it
  // queues, as without RunInline).
  void AppendAsync(const AppendRequest& request, StepDone done,
                   BatchTimes* times = nullptr,
                   RunInline run_inline = RunInline::kNo);

  // Queues `requests` to run as one all-or-nothing
  // AttentionEngine::AppendBatch call (BatchDecode) with `max_reply_bytes`,
  // ordered with the other steps of the same sessions and layers. `done`
  // runs exactly once, as for AppendAsync, with AppendBatch's results and
  // codes (or UNAVAILABLE, or RESOURCE_EXHAUSTED). The requests act for one
  // tenant (one call's): the first's counts against tenant_bounds.
  void AppendAtomicAsync(absl::Span<const AppendRequest> requests,
                         int64_t max_reply_bytes, GroupDone done,
                         BatchTimes* times = nullptr);

  // Blocking forms of the above: submit, then wait for the result. Not on
  // the batch thread (not from a callback or on_batch).
  absl::StatusOr<AttentionOutput> Append(const AppendRequest& request);
  absl::StatusOr<std::vector<AttentionOutput>> AppendAtomic(
      absl::Span<const AppendRequest> requests, int64_t max_reply_bytes = -1);

  const DecodeBatcherOptions& options() const { return options_; }

  // Steps waiting in the queue now (not those of the batch running).
  int64_t queued_steps() const;
  // Those of them `tenant` submitted (counted only when tenant_bounds are
  // bounded; 0 otherwise).
  int64_t queued_steps_of(absl::string_view tenant) const;

 private:
  // One submission: a lone step or an atomic group, with its callback.
  struct Entry {
    absl::Span<const AppendRequest> requests;
    bool atomic = false;
    int64_t max_reply_bytes = -1;  // atomic: AppendBatch's bound
    StepDone step_done;    // !atomic
    GroupDone group_done;  // atomic
    BatchTimes* times = nullptr;
    int64_t bytes = 0;  // what its requests hold (max_queued_bytes)
    // Its tenant's name when tenant_bounds are bounded, else empty.
    std::string tenant;
    // Left out of batches because a session was busy: how often, and when
    // it may be tried again.
    int busy_tries = 0;
    absl::Time retry_at = absl::InfinitePast();

    bool waiting(absl::Time now) const { return retry_at > now; }
  };

  // Queues `entry`, or answers it with UNAVAILABLE when the queue is full
  // (RESOURCE_EXHAUSTED past its tenant's bounds).
  void Submit(std::unique_ptr<Entry> entry);
  // The UNAVAILABLE of a submission of `steps` holding `bytes` that the
  // queue, holding `queued` steps and `queued_bytes`, has no room for.
  absl::Status QueueFull(int64_t queued, int64_t queued_bytes, int64_t steps,
                         int64_t bytes) const;
  // True, with the batcher marked running, when nothing is queued or
  // running, no batch's callbacks wait on the reply thread, and the last
  // batch was a lone step: the caller then runs its step and calls
  // FinishInline.
  bool ClaimIdle();
  void FinishInline();
  // The batch thread: forms and runs batches until stopping_ and the queue
  // is empty.
  void BatchThreadMain();
  // The bounded wait for more steps before a batch is taken.
  void WaitForBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // When TakeBatch(now) took nothing (every queued entry waits, see
  // Entry::retry_at, or is held back by one that does): sleeps until the
  // first may be tried again or another step arrives.
  void WaitForRetry(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the next batch from the queue, passing over entries waiting
  // at `now`: the first atomic group alone, when no entry before it is
  // taken and none of its (session, layer)s waits before it; or up to
  // max_batch_size independent steps with distinct (session, layer) that no
  // earlier queued step of the same (session, layer) precedes. Empty when
  // every entry waits or is held back by one that waits.
  std::vector<std::unique_ptr<Entry>> TakeBatch(absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // TakeBatch's choice, before the queue's counts are updated.
  std::vector<std::unique_ptr<Entry>> SelectBatch(absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts entries of a batch that the engine left out (their sessions were
  // busy; in batch order) back at the front of the queue, each waiting for
  // its back-off.
  void Requeue(std::vector<std::unique_ptr<Entry>> entries);
  // Runs a batch taken by TakeBatch (without holding mu_), sends the
  // entries left out for busy sessions back to the queue (Requeue) and has
  // every other entry's callback called with its result (Deliver;
  // `on_batch_thread`: whether this is the batch thread, which may hand
  // them off).
  void RunBatch(std::vector<std::unique_ptr<Entry>> batch,
                bool on_batch_thread);
  // Runs a finished batch's `callbacks` here, or queues them on the reply
  // thread: on the batch thread, when earlier callbacks are still there, or
  // when steps wait for the next batch and the batch's engine call took
  // `step_time` per step >= options_.overlap_replies_step_time.
  void Deliver(absl::AnyInvocable<void() &&> callbacks, bool on_batch_thread,
               absl::Duration step_time);

  AttentionEngine* const engine_;
  const DecodeBatcherOptions options_;

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<Entry>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_steps_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of the queued entries
  // Steps in the last independent batch: how many to wait for next time.
  int64_t expected_batch_ ABSL_GUARDED_BY(mu_) = 1;
  // A batch is running (on the batch thread or inline): no other may start.
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  // When the latest step was queued, and how many submissions were.
  absl::Time last_arrival_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t arrivals_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Batches whose callbacks are queued or running on the reply thread
  // (incremented by the batch thread, decremented by the reply thread).
  int deferred_batches_ ABSL_GUARDED_BY(mu_) = 0;
  // What each tenant has queued (options_.tenant_bounds); kept with
  // queued_steps_ and queued_bytes_, under mu_.
  TenantQueueShare tenant_share_ ABSL_GUARDED_BY(mu_){"decode steps",
                                                      options_.tenant_bounds};
  // The reply thread; before batch_thread_, whose batches use it.
  CallExecutor replies_{1};
  // Last: started once everything above is initialized.
  std::thread batch_thread_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_DECODE_BATCHER_H_
