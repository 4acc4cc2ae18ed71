#include "core/backend_factory.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

using ::testing::HasSubstr;

TEST(BackendFactoryTest, CpuOnRequest) {
  BackendOptions options;
  options.kind = "cpu";
  options.threads = 2;
  absl::StatusOr<BackendChoice> choice = CreateBackend(options);
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->backend->name(), "cpu");
  EXPECT_THAT(choice->backend->device(), HasSubstr("2 threads"));
  EXPECT_FALSE(choice->reason.empty());
}

TEST(BackendFactoryTest, AutoAlwaysYieldsABackend) {
  BackendOptions options;  // auto
  absl::StatusOr<BackendChoice> choice = CreateBackend(options);
  ASSERT_TRUE(choice.ok()) << choice.status();
  ASSERT_NE(choice->backend, nullptr);
  EXPECT_FALSE(choice->reason.empty());
  if (!CudaBackendCompiled()) {
    EXPECT_EQ(choice->backend->name(), "cpu");
    EXPECT_THAT(choice->reason, HasSubstr("no CUDA backend"));
  }
}

TEST(BackendFactoryTest, CudaWithoutCudaBuildIsUnavailable) {
  if (CudaBackendCompiled()) {
    GTEST_SKIP() << "this build has the CUDA backend";
  }
  BackendOptions options;
  options.kind = "cuda";
  absl::StatusOr<BackendChoice> choice = CreateBackend(options);
  EXPECT_EQ(choice.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(choice.status().message(), HasSubstr("no CUDA backend"));
}

TEST(BackendFactoryTest, UnknownKindIsInvalid) {
  BackendOptions options;
  options.kind = "tpu";
  absl::StatusOr<BackendChoice> choice = CreateBackend(options);
  EXPECT_EQ(choice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(choice.status().message(), HasSubstr("tpu"));
}

}  // namespace
}  // namespace attention
