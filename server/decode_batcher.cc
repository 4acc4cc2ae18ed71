#include "server/decode_batcher.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"

namespace attention::server {
namespace {

// What the engine allows once per batch. The views point into the queued
// requests, which outlive the batch being formed.
using StepKey = std::pair<absl::string_view, int32_t>;

StepKey KeyOf(const AppendRequest& request) {
  return {request.session_id, request.layer};
}

}  // namespace

absl::Status DecodeBatcher::ValidateOptions(
    const DecodeBatcherOptions& options) {
  if (options.batch_wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_wait ", absl::FormatDuration(options.batch_wait),
                     " must be >= 0 (0 = do not wait for more steps)"));
  }
  if (options.max_batch_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_batch_size ", options.max_batch_size, " must be >= 1"));
  }
  if (options.max_queued_steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_queued_decode_steps ", options.max_queued_steps, " must be >= 1"));
  }
  return absl::OkStatus();
}

DecodeBatcher::DecodeBatcher(AttentionEngine* engine,
                             DecodeBatcherOptions options)
    : engine_(engine), options_(std::move(options)) {}

DecodeBatcher::~DecodeBatcher() = default;

absl::StatusOr<AttentionOutput> DecodeBatcher::Append(
    const AppendRequest& request) {
  Entry entry;
  entry.requests = absl::MakeConstSpan(&request, 1);
  if (absl::Status status = Submit(entry); !status.ok()) return status;
  return std::move(entry.step_result);
}

absl::StatusOr<std::vector<AttentionOutput>> DecodeBatcher::AppendAtomic(
    absl::Span<const AppendRequest> requests) {
  if (requests.empty()) return std::vector<AttentionOutput>();
  Entry entry;
  entry.requests = requests;
  entry.atomic = true;
  if (absl::Status status = Submit(entry); !status.ok()) return status;
  return std::move(entry.group_result);
}

int64_t DecodeBatcher::queued_steps() const {
  absl::MutexLock lock(&mu_);
  return queued_steps_;
}

absl::Status DecodeBatcher::Submit(Entry& entry) {
  const int64_t steps = static_cast<int64_t>(entry.requests.size());
  absl::MutexLock lock(&mu_);
  if (queued_steps_ > 0 && queued_steps_ + steps > options_.max_queued_steps) {
    return absl::UnavailableError(absl::StrCat(
        "the server is overloaded: ", queued_steps_,
        " decode steps are already queued (limit ", options_.max_queued_steps,
        "); nothing was applied, retry with backoff (or raise "
        "--max_queued_decode_steps)"));
  }
  queue_.push_back(&entry);
  queued_steps_ += steps;
  if (!leader_active_) {
    leader_active_ = true;
    entry.lead = true;
  }
  auto done_or_lead = [&entry] { return entry.done || entry.lead; };
  mu_.Await(absl::Condition(&done_or_lead));
  if (!entry.done) LeadUntilDone(entry);
  return absl::OkStatus();
}

void DecodeBatcher::LeadUntilDone(Entry& self) {
  while (!self.done) {
    WaitForBatch();
    std::vector<Entry*> batch = TakeBatch();
    mu_.Unlock();
    RunBatch(batch);
    mu_.Lock();
    // Owners read their results only after seeing `done` under mu_.
    for (Entry* entry : batch) entry->done = true;
  }
  self.lead = false;
  if (queue_.empty()) {
    leader_active_ = false;
  } else {
    // The oldest waiting caller leads next; its entry is at the front, so
    // it is in the next batch.
    queue_.front()->lead = true;
  }
}

void DecodeBatcher::WaitForBatch() {
  // An atomic group at the front runs alone: nothing to gather.
  if (options_.batch_wait <= absl::ZeroDuration() || queue_.front()->atomic) {
    return;
  }
  const int64_t target =
      std::min<int64_t>(options_.max_batch_size, expected_batch_);
  auto ready = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queued_steps_ >= target;
  };
  if (ready()) return;
  mu_.AwaitWithTimeout(absl::Condition(&ready), options_.batch_wait);
}

std::vector<DecodeBatcher::Entry*> DecodeBatcher::TakeBatch() {
  std::vector<Entry*> batch;
  if (queue_.front()->atomic) {
    batch.push_back(queue_.front());
    queue_.pop_front();
    queued_steps_ -= static_cast<int64_t>(batch[0]->requests.size());
    return batch;
  }
  if (queue_.size() == 1) {  // a lone step: nothing to sort out
    batch.push_back(queue_.front());
    queue_.pop_front();
    queued_steps_ -= 1;
    expected_batch_ = 1;
    return batch;
  }
  // Keys of steps taken, and of steps left behind: a step may not overtake
  // a queued step of the same (session, layer).
  absl::flat_hash_set<StepKey> taken;
  absl::flat_hash_set<StepKey> blocked;
  auto keep = queue_.begin();
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    Entry* entry = *it;
    bool take = false;
    if (entry->atomic) {
      for (const AppendRequest& request : entry->requests) {
        blocked.insert(KeyOf(request));
      }
    } else if (static_cast<int>(batch.size()) < options_.max_batch_size) {
      const StepKey key = KeyOf(entry->requests[0]);
      if (!blocked.contains(key) && taken.insert(key).second) {
        take = true;
      } else {
        blocked.insert(key);
      }
    }
    if (take) {
      batch.push_back(entry);
    } else {
      *keep++ = entry;
    }
  }
  queue_.erase(keep, queue_.end());
  queued_steps_ -= static_cast<int64_t>(batch.size());
  expected_batch_ = static_cast<int64_t>(batch.size());
  return batch;
}

void DecodeBatcher::RunBatch(absl::Span<Entry* const> batch) {
  if (batch.size() == 1 && batch[0]->atomic) {
    Entry& group = *batch[0];
    group.group_result = engine_->AppendBatch(group.requests);
    if (options_.on_batch) {
      options_.on_batch(static_cast<int64_t>(group.requests.size()));
    }
    return;
  }
  std::vector<AppendRequest> requests;
  requests.reserve(batch.size());
  for (const Entry* entry : batch) requests.push_back(entry->requests[0]);
  std::vector<absl::StatusOr<AttentionOutput>> results =
      engine_->AppendEach(requests);
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i]->step_result = std::move(results[i]);
  }
  if (options_.on_batch) options_.on_batch(static_cast<int64_t>(batch.size()));
}

}  // namespace attention::server
