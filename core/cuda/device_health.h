// DeviceHealth: whether the CUDA backend's device still works. The backend
// passes the status of every call through Record(); the first UNAVAILABLE
// one (a sticky CUDA error, see cuda_status.h) marks the device failed for
// good, is logged once, and is what failure() and every later call return.
// Other errors (INTERNAL, RESOURCE_EXHAUSTED) stay per-call.
#ifndef ATTENTION_CORE_CUDA_DEVICE_HEALTH_H_
#define ATTENTION_CORE_CUDA_DEVICE_HEALTH_H_

#include <atomic>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace attention {
namespace cuda {

// Thread-safety: every method may be called concurrently.
class DeviceHealth {
 public:
  // `device` names the device in the failure's message and log line.
  explicit DeviceHealth(std::string device) : device_(std::move(device)) {}

  // Returns `status`; an UNAVAILABLE one marks the device failed (the first
  // is kept, with the device named in its message, and written to stderr).
  absl::Status Record(absl::Status status);

  // OK while the device works; afterwards the recorded UNAVAILABLE status.
  // Cheap: one atomic load while healthy.
  absl::Status failure() const;

 private:
  const std::string device_;
  std::atomic<bool> failed_{false};
  mutable absl::Mutex mu_;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cuda
}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_DEVICE_HEALTH_H_
