// DeviceProbe and CudaBackend::Create against a driver too old for the
// CUDA 13 runtime: run with LD_LIBRARY_PATH at fake_old_driver.c's
// libcuda.so.1 (CUDA 12.4), as its CTest test does. The reason must name
// both versions and the driver needed, and count as a device present (GPU
// tests then fail instead of skipping).
#include <string>

#include "absl/status/status.h"
#include "core/cuda/cuda_backend.h"
#include "core/cuda/device_probe.h"
#include "gtest/gtest.h"

namespace attention {
namespace cuda {
namespace {

TEST(DeviceProbeOldDriverTest, NamesDriverAndRuntimeVersions) {
  const DeviceProbe probe = ProbeDevices();
  ASSERT_EQ(probe.driver_version, 12040)
      << "not running with the fake CUDA 12.4 driver";
  EXPECT_EQ(probe.device_count, 0);
  EXPECT_TRUE(probe.device_present);
  EXPECT_EQ(probe.status.code(), absl::StatusCode::kUnavailable);
  const std::string message(probe.status.message());
  for (const std::string expected :
       {"driver is too old", "supports CUDA 12.4", "CUDA 13.0 runtime",
        "driver 580 or newer"}) {
    EXPECT_NE(message.find(expected), std::string::npos)
        << "'" << expected << "' not in: " << message;
  }
}

TEST(DeviceProbeOldDriverTest, BackendRefusesWithTheProbesReason) {
  auto backend = CudaBackend::Create(CudaBackendOptions());
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status(), ProbeDevices().status);
}

}  // namespace
}  // namespace cuda
}  // namespace attention
