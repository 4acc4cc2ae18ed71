// DeviceProbe on whatever machine runs it: consistent with itself, and
// consistent with CudaBackend::Create (no device => the backend's reason is
// the probe's).
#include "core/cuda/device_probe.h"

#include <string>

#include "absl/status/status.h"
#include "core/cuda/cuda_backend.h"
#include "gtest/gtest.h"

namespace attention {
namespace cuda {
namespace {

TEST(CudaVersionStringTest, FormatsMajorAndMinor) {
  EXPECT_EQ(CudaVersionString(13000), "13.0");
  EXPECT_EQ(CudaVersionString(12040), "12.4");
  EXPECT_EQ(CudaVersionString(11080), "11.8");
}

TEST(DeviceProbeTest, IsConsistent) {
  const DeviceProbe probe = ProbeDevices();
  EXPECT_GE(probe.runtime_version, 13000) << "the build links CUDA 13";
  if (probe.device_count > 0) {
    EXPECT_TRUE(probe.status.ok()) << probe.status;
    EXPECT_TRUE(probe.device_present);
    EXPECT_GE(probe.driver_version, probe.runtime_version);
    return;
  }
  EXPECT_EQ(probe.status.code(), absl::StatusCode::kUnavailable);
  const std::string message(probe.status.message());
  if (probe.driver_version == 0) {
    EXPECT_FALSE(probe.device_present);
    EXPECT_NE(message.find("no NVIDIA driver"), std::string::npos) << message;
  }
  if (probe.driver_version > 0 &&
      probe.driver_version < probe.runtime_version) {
    EXPECT_TRUE(probe.device_present);
    EXPECT_NE(message.find("driver is too old"), std::string::npos)
        << message;
    EXPECT_NE(message.find(CudaVersionString(probe.runtime_version)),
              std::string::npos)
        << message;
  }
}

TEST(DeviceProbeTest, BackendGivesTheProbesReasonWithoutDevice) {
  const DeviceProbe probe = ProbeDevices();
  if (probe.status.ok()) GTEST_SKIP() << "a CUDA device is present";
  auto backend = CudaBackend::Create(CudaBackendOptions());
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status(), probe.status);
}

}  // namespace
}  // namespace cuda
}  // namespace attention
