#include "core/cuda/cuda_backend_factory.h"

#include <utility>

#include "core/cuda/cuda_backend.h"

namespace attention {

absl::StatusOr<std::unique_ptr<AttentionBackend>> CreateCudaBackend() {
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend =
      CudaBackend::Create(CudaBackendOptions());
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<AttentionBackend>(*std::move(backend));
}

}  // namespace attention
