// StallWatchdog: cancels streaming calls that stop moving.
//
// A session transfer holds server resources for as long as it runs: an
// ImportSession the KV blocks it reserved from its header on, an
// ExportSession the blocks it pinned, and each a thread of the synchronous
// server blocked in Read or Write. A peer that stops sending (or reading)
// without closing the call would hold them for ever, and the client's
// deadline, when it set one at all, is the client's choice. So each such
// call registers here (Watch) and reports progress after every message it
// moves; a call that has moved no message for `timeout` is cancelled
// through the function it registered (for gRPC, ServerContext::TryCancel,
// which ends the blocked Read or Write). Its handler then returns, and what
// it held goes with it.
//
// One thread checks every watch each min(timeout / 4, 1 s), so a stalled
// call ends between `timeout` and `timeout` + that interval after its last
// message. The thread sleeps while nothing is watched.
//
// Example:
//   auto watch = watchdog.Watch([context] { context->TryCancel(); });
//   while (reader->Read(&chunk)) {
//     watch.Progress();
//     ...
//   }
//   if (watch.stalled()) return watchdog.StallError("import");
//
// Thread-safety: all methods are thread-safe.
#ifndef ATTENTION_SERVER_STALL_WATCHDOG_H_
#define ATTENTION_SERVER_STALL_WATCHDOG_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attention::server {

class StallWatchdog {
 public:
  // REQUIRES: timeout > 0. `now` is the clock (tests pass their own).
  explicit StallWatchdog(absl::Duration timeout,
                         std::function<absl::Time()> now = absl::Now);
  // REQUIRES: no Watch is alive.
  ~StallWatchdog();

  StallWatchdog(const StallWatchdog&) = delete;
  StallWatchdog& operator=(const StallWatchdog&) = delete;

  // One call under watch, from its construction (which counts as progress)
  // until its destruction. Not movable: the watchdog holds its address.
  class Watch {
   public:
    ~Watch();
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;

    // The call moved a message: its stall clock starts again.
    void Progress();
    // Whether the watchdog cancelled the call.
    bool stalled() const { return stalled_.load(std::memory_order_acquire); }

   private:
    friend class StallWatchdog;
    Watch(StallWatchdog* watchdog, std::function<void()> cancel);

    StallWatchdog* const watchdog_;
    const std::function<void()> cancel_;
    std::atomic<int64_t> last_progress_ns_;
    std::atomic<bool> stalled_{false};
  };

  // Watches a call; `cancel` ends it and is called at most once, from the
  // watchdog's thread, while the Watch is alive.
  Watch Start(std::function<void()> cancel);

  // Cancels every watched call that has moved nothing for `timeout` by
  // now (the thread does this on its own; tests call it directly).
  void CancelStalled();

  // CANCELLED, saying that `what` moved nothing for the timeout and naming
  // the flag that sets it: the status a stalled call's handler returns.
  absl::Status StallError(absl::string_view what) const;

  absl::Duration timeout() const { return timeout_; }

 private:
  int64_t NowNanos() const { return absl::ToUnixNanos(now_()); }
  void Loop();

  const absl::Duration timeout_;
  const std::function<absl::Time()> now_;
  absl::Mutex mu_;
  absl::flat_hash_set<Watch*> watches_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the rest is set up
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_STALL_WATCHDOG_H_
