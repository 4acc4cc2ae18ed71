// Conversion of CUDA runtime errors into absl::Status, by kind:
//   * sticky errors (IsStickyCudaError: an illegal address, a kernel fault,
//     an uncorrectable ECC error...) leave the process's CUDA context
//     unusable until the process restarts: UNAVAILABLE, so that callers and
//     the backend's DeviceHealth treat the device as gone;
//   * out of device memory: RESOURCE_EXHAUSTED, a per-call failure;
//   * anything else: INTERNAL, a per-call device failure.
// Every status carries the runtime's own error text, so an operator can act
// on it.
#ifndef ATTENTION_CORE_CUDA_CUDA_STATUS_H_
#define ATTENTION_CORE_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace attention {
namespace cuda {

// True for the errors after which, per the CUDA runtime documentation, the
// context is in an inconsistent state and the process must be terminated
// and relaunched to use the device again.
bool IsStickyCudaError(cudaError_t error);

// OK for cudaSuccess. Otherwise "CUDA error while <what>: <name>:
// <description>" with the code above. Also clears the runtime's
// (non-sticky) last error so that later calls are not blamed for this one.
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

}  // namespace cuda
}  // namespace attention

// Returns CudaStatus(expr, what) from the enclosing function when `expr` is
// not cudaSuccess. `what` says what was being done ("copying q to the GPU").
#define ATTN_CUDA_RETURN_IF_ERROR(expr, what)                         \
  do {                                                                \
    if (const cudaError_t attn_cuda_error_ = (expr);                  \
        attn_cuda_error_ != cudaSuccess) {                            \
      return ::attention::cuda::CudaStatus(attn_cuda_error_, (what)); \
    }                                                                 \
  } while (false)

#endif  // ATTENTION_CORE_CUDA_CUDA_STATUS_H_
