#include "core/cuda/device_health.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attention {
namespace cuda {

absl::Status DeviceHealth::Record(absl::Status status) {
  if (status.code() != absl::StatusCode::kUnavailable) return status;
  absl::MutexLock lock(&mu_);
  if (failure_.ok()) {
    failure_ = absl::UnavailableError(absl::StrCat(
        "the CUDA backend on ", device_, " has failed: ", status.message()));
    failed_.store(true, std::memory_order_release);
    // core/ has no logger; the server also logs it (backend_failed).
    std::fprintf(stderr, "CUDA backend failed for good: %s\n",
                 std::string(failure_.message()).c_str());
  }
  return failure_;
}

absl::Status DeviceHealth::failure() const {
  if (!failed_.load(std::memory_order_acquire)) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  return failure_;
}

}  // namespace cuda
}  // namespace attention
