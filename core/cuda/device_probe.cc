#include "core/cuda/device_probe.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace attention {
namespace cuda {

std::string CudaVersionString(int version) {
  return absl::StrCat(version / 1000, ".", (version % 1000) / 10);
}

DeviceProbe ProbeDevices() {
  DeviceProbe probe;
  (void)cudaRuntimeGetVersion(&probe.runtime_version);
  if (cudaDriverGetVersion(&probe.driver_version) != cudaSuccess) {
    probe.driver_version = 0;
  }
  const cudaError_t error = cudaGetDeviceCount(&probe.device_count);
  (void)cudaGetLastError();
  if (error != cudaSuccess) probe.device_count = 0;
  probe.device_present =
      probe.device_count > 0 ||
      (probe.driver_version > 0 && error != cudaSuccess &&
       error != cudaErrorNoDevice && error != cudaErrorStubLibrary);
  const std::string runtime = CudaVersionString(probe.runtime_version);
  if (probe.device_count > 0) {
    probe.status = absl::OkStatus();
  } else if (probe.driver_version == 0) {
    probe.status = absl::UnavailableError(absl::StrCat(
        "no CUDA device: no NVIDIA driver is installed (this build's CUDA "
        "runtime is ", runtime, ")"));
  } else if (probe.driver_version < probe.runtime_version) {
    probe.status = absl::UnavailableError(absl::StrCat(
        "the NVIDIA driver is too old: it supports CUDA ",
        CudaVersionString(probe.driver_version),
        " but this build links the CUDA ", runtime,
        " runtime statically; install a driver that supports CUDA ", runtime,
        " or newer (",
        probe.runtime_version >= 13000 ? "driver 580 or newer, " : "",
        "cudaGetDeviceCount: ", cudaGetErrorName(error), ")"));
  } else if (error != cudaSuccess) {
    probe.status = absl::UnavailableError(absl::StrCat(
        "no CUDA device: cudaGetDeviceCount failed: ", cudaGetErrorName(error),
        ": ", cudaGetErrorString(error), " (driver CUDA ",
        CudaVersionString(probe.driver_version), ", runtime ", runtime, ")"));
  } else {
    probe.status = absl::UnavailableError(
        absl::StrCat("no CUDA device: the driver reports none (driver CUDA ",
                     CudaVersionString(probe.driver_version), ", runtime ",
                     runtime, ")"));
  }
  return probe;
}

}  // namespace cuda
}  // namespace attention
