#include "core/cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace attention {
namespace cuda {

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  // Reset the last-error slot; sticky errors (a faulted context) stay and
  // surface again on the next call, which is what we want.
  (void)cudaGetLastError();
  return absl::InternalError(absl::StrCat("CUDA error while ", what, ": ",
                                          cudaGetErrorName(error), ": ",
                                          cudaGetErrorString(error)));
}

}  // namespace cuda
}  // namespace attention
