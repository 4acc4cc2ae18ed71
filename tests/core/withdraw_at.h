// A CallControl for tests: withdraws its call from a chosen check on and
// counts the checks.
#ifndef ATTENTION_TESTS_CORE_WITHDRAW_AT_H_
#define ATTENTION_TESTS_CORE_WITHDRAW_AT_H_

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "core/call_control.h"

namespace attention::testing {

// Withdraws its call from the `fail_at`-th check on (counting from 0) with
// `code`, and counts the checks (fail_at = INT64_MAX: never withdraws).
class WithdrawAt : public CallControl {
 public:
  WithdrawAt(int64_t fail_at, absl::StatusCode code)
      : fail_at_(fail_at), code_(code) {}
  absl::Status Check() const override {
    if (checks_.fetch_add(1) >= fail_at_) {
      return absl::Status(code_, "withdrawn by the test");
    }
    return absl::OkStatus();
  }
  int64_t checks() const { return checks_.load(); }

 private:
  const int64_t fail_at_;
  const absl::StatusCode code_;
  mutable std::atomic<int64_t> checks_{0};
};

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_CORE_WITHDRAW_AT_H_
