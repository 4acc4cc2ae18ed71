#include "core/cpu/cpu_features.h"

#include <cstdlib>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "core/cpu/cpu_backend.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

using ::testing::HasSubstr;

constexpr CpuIsa kAllIsas[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512};

// Sets ATTN_CPU_ISA for the scope of one test and restores it afterwards.
class ScopedIsaEnv {
 public:
  explicit ScopedIsaEnv(const char* value) {
    if (const char* old = std::getenv("ATTN_CPU_ISA")) old_ = old;
    if (value == nullptr) {
      unsetenv("ATTN_CPU_ISA");
    } else {
      setenv("ATTN_CPU_ISA", value, 1);
    }
  }
  ~ScopedIsaEnv() {
    if (old_.has_value()) {
      setenv("ATTN_CPU_ISA", old_->c_str(), 1);
    } else {
      unsetenv("ATTN_CPU_ISA");
    }
  }

 private:
  std::optional<std::string> old_;
};

TEST(CpuFeaturesTest, NamesRoundTrip) {
  for (CpuIsa isa : kAllIsas) {
    absl::StatusOr<CpuIsa> parsed = ParseCpuIsa(CpuIsaName(isa));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, isa);
  }
  EXPECT_EQ(*ParseCpuIsa("AVX512"), CpuIsa::kAvx512);
}

TEST(CpuFeaturesTest, UnknownNameIsInvalidArgumentListingTheChoices) {
  absl::StatusOr<CpuIsa> parsed = ParseCpuIsa("sse9");
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(parsed.status().message(), HasSubstr("sse9"));
  EXPECT_THAT(parsed.status().message(), HasSubstr("scalar, avx2 or avx512"));
}

TEST(CpuFeaturesTest, BestIsSupportedAndNothingFasterIs) {
  EXPECT_TRUE(CpuIsaSupported(CpuIsa::kScalar));
  const CpuIsa best = BestCpuIsa();
  EXPECT_TRUE(CpuIsaSupported(best));
  for (CpuIsa isa : kAllIsas) {
    if (isa > best) {
      EXPECT_FALSE(CpuIsaSupported(isa)) << CpuIsaName(isa);
    }
  }
}

TEST(CpuFeaturesTest, DefaultFollowsTheEnvironment) {
  std::string warning = "stale";
  {
    ScopedIsaEnv env(nullptr);
    EXPECT_EQ(DefaultCpuIsa(&warning), BestCpuIsa());
    EXPECT_EQ(warning, "");
  }
  {
    ScopedIsaEnv env("auto");
    EXPECT_EQ(DefaultCpuIsa(&warning), BestCpuIsa());
    EXPECT_EQ(warning, "");
  }
  {
    ScopedIsaEnv env("scalar");
    EXPECT_EQ(DefaultCpuIsa(&warning), CpuIsa::kScalar);
    EXPECT_EQ(warning, "");
    // The backend constructor uses the same choice.
    CpuBackend backend(1);
    EXPECT_EQ(backend.isa(), CpuIsa::kScalar);
    EXPECT_THAT(backend.device(), HasSubstr("(scalar, 1 thread)"));
  }
  {
    ScopedIsaEnv env("mmx");
    EXPECT_EQ(DefaultCpuIsa(&warning), BestCpuIsa());
    EXPECT_THAT(warning, HasSubstr("ATTN_CPU_ISA=mmx"));
  }
}

TEST(CpuFeaturesTest, UnsupportedIsaInTheEnvironmentFallsBack) {
  for (CpuIsa isa : kAllIsas) {
    if (CpuIsaSupported(isa)) continue;
    ScopedIsaEnv env(std::string(CpuIsaName(isa)).c_str());
    std::string warning;
    EXPECT_EQ(DefaultCpuIsa(&warning), BestCpuIsa());
    EXPECT_THAT(warning, HasSubstr("not supported"));
    return;
  }
  GTEST_SKIP() << "this machine supports every kernel ISA; nothing to fall "
                  "back from";
}

TEST(CpuFeaturesTest, CpuModelNameIsNotEmpty) {
  EXPECT_FALSE(CpuModelName().empty());
}

}  // namespace
}  // namespace attention
