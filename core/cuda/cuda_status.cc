#include "core/cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace attention {
namespace cuda {

bool IsStickyCudaError(cudaError_t error) {
  switch (error) {
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContained:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorContextIsDestroyed:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
      return true;
    default:
      return false;
  }
}

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  // Reset the last-error slot; sticky errors (a faulted context) stay and
  // surface again on the next call.
  (void)cudaGetLastError();
  const std::string text =
      absl::StrCat("CUDA error while ", what, ": ", cudaGetErrorName(error),
                   ": ", cudaGetErrorString(error));
  if (IsStickyCudaError(error)) {
    return absl::UnavailableError(absl::StrCat(
        text, "; the GPU context is unusable until the process restarts"));
  }
  if (error == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(text);
  }
  return absl::InternalError(text);
}

}  // namespace cuda
}  // namespace attention
