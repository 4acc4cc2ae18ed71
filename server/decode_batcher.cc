#include "server/decode_batcher.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/session_busy.h"

namespace attention::server {
namespace {

// What the engine allows once per batch. The views point into the queued
// requests, which outlive the batch being formed.
using StepKey = std::pair<absl::string_view, int32_t>;

StepKey KeyOf(const AppendRequest& request) {
  return {request.session_id, request.layer};
}

const std::string& TenantName(const AppendRequest& request) {
  return (request.tenant != nullptr ? *request.tenant : DefaultTenant()).name;
}

}  // namespace

absl::Status DecodeBatcher::ValidateOptions(
    const DecodeBatcherOptions& options) {
  if (options.batch_wait < absl::ZeroDuration() ||
      options.batch_wait == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch_wait ", absl::FormatDuration(options.batch_wait),
        " must be >= 0 and finite (0 = do not wait for more steps; each "
        "batch waits at most ",
        kMaxWaitGaps, " times it)"));
  }
  if (options.max_batch_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_batch_size ", options.max_batch_size, " must be >= 1"));
  }
  if (options.max_queued_steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_queued_decode_steps ", options.max_queued_steps, " must be >= 1"));
  }
  if (options.max_queued_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_queued_decode_bytes ", options.max_queued_bytes, " must be >= 0"));
  }
  if (options.tenant_bounds.max_items < 1 ||
      options.tenant_bounds.max_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tenant_bounds must be at least 1 step and 0 bytes, got ",
                     options.tenant_bounds.max_items, " steps and ",
                     options.tenant_bounds.max_bytes, " bytes"));
  }
  if (options.overlap_replies_step_time < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "overlap_replies_step_time ",
        absl::FormatDuration(options.overlap_replies_step_time),
        " must be >= 0 (InfiniteDuration: never hand replies off)"));
  }
  return absl::OkStatus();
}

DecodeBatcher::DecodeBatcher(AttentionEngine* engine,
                             DecodeBatcherOptions options)
    : engine_(engine),
      options_(std::move(options)),
      batch_thread_([this] { BatchThreadMain(); }) {}

DecodeBatcher::~DecodeBatcher() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  batch_thread_.join();
  // replies_'s destructor then runs the callbacks still queued there.
}

void DecodeBatcher::AppendAsync(const AppendRequest& request, StepDone done,
                                BatchTimes* times, RunInline run_inline) {
  auto entry = std::make_unique<Entry>();
  entry->requests = absl::MakeConstSpan(&request, 1);
  entry->step_done = std::move(done);
  entry->times = times;
  entry->bytes = HeldBytes(request);
  if (options_.tenant_bounds.bounded()) entry->tenant = TenantName(request);
  if (run_inline == RunInline::kWhenIdle && ClaimIdle()) {
    std::vector<std::unique_ptr<Entry>> batch;
    batch.push_back(std::move(entry));
    RunBatch(std::move(batch), /*on_batch_thread=*/false);
    FinishInline();
    return;
  }
  Submit(std::move(entry));
}

void DecodeBatcher::AppendAtomicAsync(absl::Span<const AppendRequest> requests,
                                      int64_t max_reply_bytes, GroupDone done,
                                      BatchTimes* times) {
  if (requests.empty()) {
    done(std::vector<AttentionOutput>());
    return;
  }
  auto entry = std::make_unique<Entry>();
  entry->requests = requests;
  entry->atomic = true;
  entry->max_reply_bytes = max_reply_bytes;
  entry->group_done = std::move(done);
  entry->times = times;
  for (const AppendRequest& request : requests) {
    entry->bytes += HeldBytes(request);
  }
  // One call: one tenant.
  if (options_.tenant_bounds.bounded()) entry->tenant = TenantName(requests[0]);
  Submit(std::move(entry));
}

absl::StatusOr<AttentionOutput> DecodeBatcher::Append(
    const AppendRequest& request) {
  absl::StatusOr<AttentionOutput> result;
  absl::Notification done;
  AppendAsync(request, [&](absl::StatusOr<AttentionOutput> output) {
    result = std::move(output);
    done.Notify();
  });
  done.WaitForNotification();
  return result;
}

absl::StatusOr<std::vector<AttentionOutput>> DecodeBatcher::AppendAtomic(
    absl::Span<const AppendRequest> requests, int64_t max_reply_bytes) {
  absl::StatusOr<std::vector<AttentionOutput>> result;
  absl::Notification done;
  AppendAtomicAsync(requests, max_reply_bytes,
                    [&](absl::StatusOr<std::vector<AttentionOutput>> outputs) {
                      result = std::move(outputs);
                      done.Notify();
                    });
  done.WaitForNotification();
  return result;
}

int64_t DecodeBatcher::queued_steps() const {
  absl::MutexLock lock(&mu_);
  return queued_steps_;
}

int64_t DecodeBatcher::queued_steps_of(absl::string_view tenant) const {
  absl::MutexLock lock(&mu_);
  return tenant_share_.waiting_items(tenant);
}

void DecodeBatcher::Submit(std::unique_ptr<Entry> entry) {
  const int64_t steps = static_cast<int64_t>(entry->requests.size());
  int64_t queued = 0;
  int64_t queued_bytes = 0;
  absl::Status tenant_refusal;
  {
    absl::MutexLock lock(&mu_);
    queued = queued_steps_;
    queued_bytes = queued_bytes_;
    const bool fits = queued + steps <= options_.max_queued_steps &&
                      queued_bytes + entry->bytes <= options_.max_queued_bytes;
    // One larger than a bound on its own would never fit a queue in use:
    // it waits behind what is queued unless the queue is full already.
    const bool oversize = steps > options_.max_queued_steps ||
                          entry->bytes > options_.max_queued_bytes;
    // An empty queue is never full (so a bytes bound of 0 queues one step
    // or atomic group at a time, as the prefill queue does).
    const bool full = queued >= options_.max_queued_steps ||
                      (queued > 0 && queued_bytes >= options_.max_queued_bytes);
    // A tenant past its share is told so, whatever the queue holds.
    tenant_refusal = tenant_share_.Admit(entry->tenant, steps, entry->bytes);
    if (tenant_refusal.ok()) {
      if (fits || (oversize && !full)) {
        queued_steps_ += steps;
        queued_bytes_ += entry->bytes;
        queue_.push_back(std::move(entry));
        last_arrival_ = absl::Now();
        ++arrivals_;
        return;
      }
      tenant_share_.Release(entry->tenant, steps, entry->bytes);
    }
  }
  absl::Status refusal =
      tenant_refusal.ok() ? QueueFull(queued, queued_bytes, steps, entry->bytes)
                          : std::move(tenant_refusal);
  if (entry->atomic) {
    entry->group_done(std::move(refusal));
  } else {
    entry->step_done(std::move(refusal));
  }
}

absl::Status DecodeBatcher::QueueFull(int64_t queued, int64_t queued_bytes,
                                      int64_t steps, int64_t bytes) const {
  if (queued + steps > options_.max_queued_steps) {
    return absl::UnavailableError(absl::StrCat(
        "the server is overloaded: ", queued,
        " decode steps are already queued (limit ", options_.max_queued_steps,
        "); nothing was applied, retry with backoff (or raise "
        "--max_queued_decode_steps)"));
  }
  return absl::UnavailableError(absl::StrCat(
      "the server is overloaded: the decode steps already queued hold ",
      queued_bytes, " bytes of tensors and these ", bytes,
      " more would pass the limit of ", options_.max_queued_bytes,
      "; nothing was applied, retry with backoff (or raise "
      "--max_queued_decode_bytes)"));
}

bool DecodeBatcher::ClaimIdle() {
  absl::MutexLock lock(&mu_);
  // Callbacks still on the reply thread run first (batch order).
  if (running_ || !queue_.empty() || expected_batch_ != 1 || stopping_ ||
      deferred_batches_ > 0) {
    return false;
  }
  running_ = true;
  return true;
}

void DecodeBatcher::FinishInline() {
  absl::MutexLock lock(&mu_);
  running_ = false;
}

void DecodeBatcher::BatchThreadMain() {
  absl::MutexLock lock(&mu_);
  // A step run inline finishes before the next batch starts, and so do the
  // callbacks of all but the latest batch handed to the reply thread.
  auto work_or_stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (running_) return false;
    return queue_.empty() ? stopping_ : deferred_batches_ <= 1;
  };
  while (true) {
    mu_.Await(absl::Condition(&work_or_stop));
    if (queue_.empty()) return;  // stopping, nothing left
    WaitForBatch();
    const absl::Time now = absl::Now();
    std::vector<std::unique_ptr<Entry>> batch = TakeBatch(now);
    if (batch.empty()) {
      WaitForRetry(now);
      continue;
    }
    running_ = true;
    mu_.Unlock();
    RunBatch(std::move(batch), /*on_batch_thread=*/true);
    mu_.Lock();
    running_ = false;
  }
}

void DecodeBatcher::WaitForBatch() {
  if (options_.batch_wait <= absl::ZeroDuration()) return;
  // Nothing to gather when the first entry that may run is an atomic group
  // (it runs alone), or when every entry waits for a busy session.
  const absl::Time now = absl::Now();
  auto first = std::find_if(queue_.begin(), queue_.end(),
                            [now](const std::unique_ptr<Entry>& entry) {
                              return !entry->waiting(now);
                            });
  if (first == queue_.end() || (*first)->atomic) return;
  const int64_t target =
      std::min<int64_t>(options_.max_batch_size, expected_batch_);
  auto ready = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queued_steps_ >= target || stopping_;
  };
  // Sleeps until the gap after the latest arrival would end, then looks
  // again: no wake-up per arriving step.
  const absl::Time limit = absl::Now() + kMaxWaitGaps * options_.batch_wait;
  while (!ready()) {
    const absl::Time gap_end =
        std::min(last_arrival_ + options_.batch_wait, limit);
    if (absl::Now() >= gap_end) return;
    mu_.AwaitWithDeadline(absl::Condition(&ready), gap_end);
  }
}

void DecodeBatcher::WaitForRetry(absl::Time now) {
  // Entries not waiting themselves wait behind one that does.
  absl::Time due = absl::InfiniteFuture();
  for (const std::unique_ptr<Entry>& entry : queue_) {
    if (entry->waiting(now)) due = std::min(due, entry->retry_at);
  }
  const int64_t arrivals = arrivals_;
  auto arrived = [this, arrivals]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return arrivals_ != arrivals;
  };
  mu_.AwaitWithDeadline(absl::Condition(&arrived), due);
}

std::vector<std::unique_ptr<DecodeBatcher::Entry>> DecodeBatcher::TakeBatch(
    absl::Time now) {
  std::vector<std::unique_ptr<Entry>> batch = SelectBatch(now);
  for (const std::unique_ptr<Entry>& entry : batch) {
    const int64_t steps = static_cast<int64_t>(entry->requests.size());
    queued_steps_ -= steps;
    queued_bytes_ -= entry->bytes;
    tenant_share_.Release(entry->tenant, steps, entry->bytes);
  }
  return batch;
}

std::vector<std::unique_ptr<DecodeBatcher::Entry>> DecodeBatcher::SelectBatch(
    absl::Time now) {
  std::vector<std::unique_ptr<Entry>> batch;
  if (queue_.size() == 1 && !queue_.front()->waiting(now)) {
    // A lone submission: nothing to sort out.
    if (!queue_.front()->atomic) expected_batch_ = 1;
    batch.push_back(std::move(queue_.front()));
    queue_.pop_front();
    return batch;
  }
  // Keys of steps taken, and of steps left behind: a step may not overtake
  // a queued step of the same (session, layer).
  absl::flat_hash_set<StepKey> taken;
  absl::flat_hash_set<StepKey> blocked;
  auto held_back = [&blocked](const Entry& entry) {
    for (const AppendRequest& request : entry.requests) {
      if (blocked.contains(KeyOf(request))) return true;
    }
    return false;
  };
  bool group = false;  // an atomic group was taken: it runs alone
  auto keep = queue_.begin();
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    Entry& entry = **it;
    bool take = false;
    if (group) {
      // The rest waits for the next batch.
    } else if (entry.atomic) {
      take = group = batch.empty() && !entry.waiting(now) && !held_back(entry);
    } else if (!entry.waiting(now) &&
               static_cast<int>(batch.size()) < options_.max_batch_size) {
      const StepKey key = KeyOf(entry.requests[0]);
      take = !blocked.contains(key) && taken.insert(key).second;
    }
    if (take) {
      batch.push_back(std::move(*it));
      continue;
    }
    for (const AppendRequest& request : entry.requests) {
      blocked.insert(KeyOf(request));
    }
    *keep++ = std::move(*it);
  }
  queue_.erase(keep, queue_.end());
  if (!group && !batch.empty()) {
    expected_batch_ = static_cast<int64_t>(batch.size());
  }
  return batch;
}

void DecodeBatcher::Requeue(std::vector<std::unique_ptr<Entry>> entries) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    Entry& entry = **it;
    entry.retry_at =
        now + std::min(kFirstBusyRetry *
                           (int64_t{1} << std::min(entry.busy_tries, 16)),
                       kMaxBusyRetry);
    ++entry.busy_tries;
    const int64_t steps = static_cast<int64_t>(entry.requests.size());
    queued_steps_ += steps;
    queued_bytes_ += entry.bytes;
    tenant_share_.Readmit(entry.tenant, steps, entry.bytes);
    queue_.push_front(std::move(*it));
  }
}

void DecodeBatcher::RunBatch(std::vector<std::unique_ptr<Entry>> batch,
                             bool on_batch_thread) {
  const std::chrono::steady_clock::time_point start =
      std::chrono::steady_clock::now();
  // Records when the batch's entries that ran did; returns how long the
  // engine took.
  auto record_times = [&](std::chrono::steady_clock::time_point end) {
    for (const std::unique_ptr<Entry>& entry : batch) {
      if (entry->times != nullptr) *entry->times = {start, end};
    }
    return absl::FromChrono(end - start);
  };
  if (batch.size() == 1 && batch[0]->atomic) {
    Entry& group = *batch[0];
    absl::StatusOr<std::vector<AttentionOutput>> results = engine_->AppendBatch(
        group.requests, group.max_reply_bytes, BusySessions::kSkip);
    if (!results.ok() && IsSessionBusy(results.status())) {
      Requeue(std::move(batch));
      return;
    }
    const int64_t steps = static_cast<int64_t>(group.requests.size());
    const absl::Duration step_time =
        record_times(std::chrono::steady_clock::now()) / steps;
    if (options_.on_batch) options_.on_batch(steps);
    Deliver(
        [entry = std::move(batch[0]), results = std::move(results)]() mutable {
          entry->group_done(std::move(results));
        },
        on_batch_thread, step_time);
    return;
  }
  std::vector<AppendRequest> requests;
  requests.reserve(batch.size());
  for (const std::unique_ptr<Entry>& entry : batch) {
    requests.push_back(entry->requests[0]);
  }
  std::vector<absl::StatusOr<AttentionOutput>> results =
      engine_->AppendEach(requests, BusySessions::kSkip);
  const std::chrono::steady_clock::time_point end =
      std::chrono::steady_clock::now();
  // The steps left out go back to the queue; the others are answered.
  std::vector<std::unique_ptr<Entry>> busy;
  size_t ran = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!results[i].ok() && IsSessionBusy(results[i].status())) {
      busy.push_back(std::move(batch[i]));
    } else {
      batch[ran] = std::move(batch[i]);
      results[ran++] = std::move(results[i]);
    }
  }
  batch.resize(ran);
  results.resize(ran);
  if (!busy.empty()) Requeue(std::move(busy));
  if (batch.empty()) return;
  const absl::Duration step_time =
      record_times(end) / static_cast<int64_t>(batch.size());
  if (options_.on_batch) options_.on_batch(static_cast<int64_t>(batch.size()));
  Deliver(
      [batch = std::move(batch), results = std::move(results)]() mutable {
        for (size_t i = 0; i < batch.size(); ++i) {
          batch[i]->step_done(std::move(results[i]));
        }
      },
      on_batch_thread, step_time);
}

void DecodeBatcher::Deliver(absl::AnyInvocable<void() &&> callbacks,
                            bool on_batch_thread, absl::Duration step_time) {
  bool defer = false;
  if (on_batch_thread) {
    absl::MutexLock lock(&mu_);
    // Zero: every earlier batch's callbacks have run.
    defer =
        deferred_batches_ > 0 ||
        (step_time >= options_.overlap_replies_step_time && !queue_.empty());
    if (defer) ++deferred_batches_;
  }
  if (!defer) {
    std::move(callbacks)();
    return;
  }
  replies_.Schedule([this, callbacks = std::move(callbacks)]() mutable {
    std::move(callbacks)();
    absl::MutexLock lock(&mu_);
    --deferred_batches_;
  });
}

}  // namespace attention::server
