// CallControl: how the caller of an engine call withdraws it.
//
// A server call can stop being wanted while it runs: the client cancels it,
// its deadline passes, or the client goes away. The engine and the backends
// ask the call's CallControl between pieces of work (a backend between KV
// chunks of kKeysPerSplit keys, the engine before it starts and again right
// before it commits an append), so a call nobody waits for costs at most the
// piece in flight and never changes a session. What the server cannot see
// is the race after the commit: the call succeeded but its reply was lost
// (see the proto's notes on DEADLINE_EXCEEDED).
#ifndef ATTENTION_CORE_CALL_CONTROL_H_
#define ATTENTION_CORE_CALL_CONTROL_H_

#include <atomic>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attention {

// Thread-safety: Check() is called concurrently from the backend's worker
// threads and must be cheap (it runs once per chunk of work).
class CallControl {
 public:
  virtual ~CallControl() = default;

  // OK while the caller still wants the result; CANCELLED or
  // DEADLINE_EXCEEDED (with a message saying which) once it does not. Once
  // not OK it stays not OK.
  virtual absl::Status Check() const = 0;
};

// A CallControl driven by a flag and an optional deadline: what tests and
// in-process callers use.
class CancellationFlag : public CallControl {
 public:
  explicit CancellationFlag(absl::Time deadline = absl::InfiniteFuture())
      : deadline_(deadline) {}

  void Cancel() { cancelled_.store(true, std::memory_order_release); }

  absl::Status Check() const override {
    if (cancelled_.load(std::memory_order_acquire)) {
      return absl::CancelledError("the call was cancelled by its caller");
    }
    if (deadline_ != absl::InfiniteFuture() && absl::Now() >= deadline_) {
      return absl::DeadlineExceededError(
          "the call's deadline passed before it finished");
    }
    return absl::OkStatus();
  }

 private:
  const absl::Time deadline_;
  std::atomic<bool> cancelled_{false};
};

// Check() of an optional control: OK when there is none.
inline absl::Status CheckCall(const CallControl* control) {
  return control == nullptr ? absl::OkStatus() : control->Check();
}

}  // namespace attention

#endif  // ATTENTION_CORE_CALL_CONTROL_H_
