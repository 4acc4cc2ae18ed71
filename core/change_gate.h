// ChangeGate: lets changes to the sessions through until it is closed, and
// tells the closer when the last change let through has finished.
//
// The engine passes every call that changes sessions (appends, truncates,
// deletes, creations) through one gate. A server shutting down closes it
// before writing its snapshot: from then on such calls fail with
// UNAVAILABLE, so that the snapshot holds every change a caller may have
// been told of and nothing is applied after it. (gRPC's own shutdown is no
// such point: a client that stops reading keeps its reply, and the
// server's shutdown, waiting long after every session is at rest.)
//
// Thread-safety: all methods are thread-safe.
#ifndef ATTENTION_CORE_CHANGE_GATE_H_
#define ATTENTION_CORE_CHANGE_GATE_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attention {

class ChangeGate {
 public:
  // One change let through: the gate counts it until the pass goes.
  // Move-only.
  class Pass {
   public:
    Pass(Pass&& other) noexcept : gate_(other.gate_) { other.gate_ = nullptr; }
    Pass& operator=(Pass&&) = delete;
    ~Pass() {
      if (gate_ != nullptr) gate_->Leave();
    }

   private:
    friend class ChangeGate;
    explicit Pass(ChangeGate* gate) : gate_(gate) {}
    ChangeGate* gate_;
  };

  ChangeGate() = default;
  ChangeGate(const ChangeGate&) = delete;
  ChangeGate& operator=(const ChangeGate&) = delete;

  // A pass for one change, or UNAVAILABLE once the gate is closed.
  absl::StatusOr<Pass> Enter() ABSL_LOCKS_EXCLUDED(mu_);

  // Closes the gate for good and waits until every pass has gone, but not
  // past `deadline`: DEADLINE_EXCEEDED (naming how many changes still run)
  // when some have not. Closing again waits again.
  absl::Status Close(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  bool closed() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Leave() ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  int64_t passes_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace attention

#endif  // ATTENTION_CORE_CHANGE_GATE_H_
