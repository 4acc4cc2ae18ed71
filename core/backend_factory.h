// Chooses and creates the attention backend at start-up.
#ifndef ATTENTION_CORE_BACKEND_FACTORY_H_
#define ATTENTION_CORE_BACKEND_FACTORY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/backend.h"
#include "core/thread_pool.h"

namespace attention {

struct BackendOptions {
  // "auto" (CUDA when a device is usable, else CPU), "cpu" or "cuda".
  std::string kind = "auto";
  // CPU worker threads; <= 0 means one per hardware thread.
  int threads = 0;
  // How long idle CPU threads poll before sleeping (ThreadPool's `spin`).
  absl::Duration cpu_spin = ThreadPool::kDefaultSpin;
};

struct BackendChoice {
  std::unique_ptr<AttentionBackend> backend;
  // Why this backend was chosen (e.g. "cuda requested by auto but no device
  // is usable: ...; using cpu"), for the start-up log.
  std::string reason;
};

// INVALID_ARGUMENT for an unknown kind; UNAVAILABLE when "cuda" is requested
// explicitly but the build has no CUDA backend or no device is usable.
absl::StatusOr<BackendChoice> CreateBackend(const BackendOptions& options);

// True when this build contains the CUDA backend.
bool CudaBackendCompiled();

}  // namespace attention

#endif  // ATTENTION_CORE_BACKEND_FACTORY_H_
