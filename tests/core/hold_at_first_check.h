// A CallControl for tests: holds its call at its first check until the test
// lets it go. The engine makes that check with the call's sessions locked,
// so this stands for a long call (a Prefill of a long prompt) on them,
// without timing anything.
#ifndef ATTENTION_TESTS_CORE_HOLD_AT_FIRST_CHECK_H_
#define ATTENTION_TESTS_CORE_HOLD_AT_FIRST_CHECK_H_

#include <atomic>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "core/call_control.h"

namespace attention::testing {

class HoldAtFirstCheck : public CallControl {
 public:
  absl::Status Check() const override {
    if (!entering_.exchange(true)) entered_.Notify();
    released_.WaitForNotification();
    return absl::OkStatus();
  }
  // Blocks until the call is held at its first check.
  void WaitUntilHeld() const { entered_.WaitForNotification(); }
  // Lets the call go on (every later check passes at once).
  void Release() { released_.Notify(); }

 private:
  mutable std::atomic<bool> entering_{false};
  mutable absl::Notification entered_;
  absl::Notification released_;
};

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_CORE_HOLD_AT_FIRST_CHECK_H_
