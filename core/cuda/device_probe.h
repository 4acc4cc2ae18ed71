// DeviceProbe: what the CUDA runtime finds on this machine before the
// backend is created: driver and runtime versions and the device count.
// It tells "no device here" (CPU-only machines: GPU tests skip, --backend=auto
// uses the CPU) from "a device exists but cannot be used" (a driver older
// than the runtime this build links: GPU tests fail, the server says which
// versions to fix).
#ifndef ATTENTION_CORE_CUDA_DEVICE_PROBE_H_
#define ATTENTION_CORE_CUDA_DEVICE_PROBE_H_

#include <string>

#include "absl/status/status.h"

namespace attention {
namespace cuda {

struct DeviceProbe {
  // cudaDriverGetVersion, e.g. 13000 for 13.0; 0 when no driver is
  // installed (libcuda cannot be loaded).
  int driver_version = 0;
  // cudaRuntimeGetVersion: the runtime linked into this binary.
  int runtime_version = 0;
  // Devices the driver reports; 0 when cudaGetDeviceCount failed.
  int device_count = 0;
  // True when a CUDA device is (or appears to be) installed: the driver
  // reports one, or a driver is installed but fails for another reason
  // than "no device" (e.g. it is older than this build's runtime). False on
  // machines without a driver, without devices, or with only the stub
  // library of the toolkit.
  bool device_present = false;
  // OK when device_count > 0; else UNAVAILABLE saying why, naming both
  // versions when the driver is too old for the runtime.
  absl::Status status;
};

// Queries the CUDA runtime (initialises nothing beyond what
// cudaGetDeviceCount does).
DeviceProbe ProbeDevices();

// "13.0" for 13000, "12.4" for 12040.
std::string CudaVersionString(int version);

}  // namespace cuda
}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_DEVICE_PROBE_H_
