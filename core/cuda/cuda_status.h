// Conversion of CUDA runtime errors into absl::Status. A CUDA failure is a
// device failure (INTERNAL) carrying the runtime's own error text, so an
// operator can act on it; the process keeps serving.
#ifndef ATTENTION_CORE_CUDA_CUDA_STATUS_H_
#define ATTENTION_CORE_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace attention {
namespace cuda {

// OK for cudaSuccess. Otherwise INTERNAL "CUDA error while <what>:
// <name>: <description>". Also clears the runtime's (non-sticky) last error
// so that later calls are not blamed for this one.
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

}  // namespace cuda
}  // namespace attention

// Returns INTERNAL from the enclosing function when `expr` is not
// cudaSuccess. `what` says what was being done ("copying q to the GPU").
#define ATTN_CUDA_RETURN_IF_ERROR(expr, what)                         \
  do {                                                                \
    if (const cudaError_t attn_cuda_error_ = (expr);                  \
        attn_cuda_error_ != cudaSuccess) {                            \
      return ::attention::cuda::CudaStatus(attn_cuda_error_, (what)); \
    }                                                                 \
  } while (false)

#endif  // ATTENTION_CORE_CUDA_CUDA_STATUS_H_
