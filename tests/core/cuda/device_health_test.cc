// Fault injection without a GPU: the CUDA backend's error path
// (CudaStatus's classification, then DeviceHealth::Record, exactly as
// CudaBackend runs it around every call) fed with injected CUDA errors, in
// front of a CPU backend, under a real engine. A sticky error must fail the
// backend for good with UNAVAILABLE and the engine must not re-run a
// failed batch problem by problem on it; an out-of-memory error stays
// per-call.
#include "core/cuda/device_health.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/cpu/cpu_backend.h"
#include "core/cuda/cuda_status.h"
#include "core/engine.h"
#include "gtest/gtest.h"
#include "tests/core/test_tensors.h"

namespace attention {
namespace cuda {
namespace {

TEST(CudaStatusTest, ClassifiesStickyOutOfMemoryAndOtherErrors) {
  for (cudaError_t sticky :
       {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorAssert,
        cudaErrorMisalignedAddress, cudaErrorECCUncorrectable}) {
    EXPECT_TRUE(IsStickyCudaError(sticky)) << cudaGetErrorName(sticky);
    const absl::Status status = CudaStatus(sticky, "running a kernel");
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_NE(status.message().find(cudaGetErrorName(sticky)),
              absl::string_view::npos);
  }
  EXPECT_FALSE(IsStickyCudaError(cudaErrorMemoryAllocation));
  EXPECT_EQ(CudaStatus(cudaErrorMemoryAllocation, "x").code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CudaStatus(cudaErrorInvalidValue, "x").code(),
            absl::StatusCode::kInternal);
  EXPECT_TRUE(CudaStatus(cudaSuccess, "x").ok());
}

TEST(DeviceHealthTest, OnlyUnavailableFailsTheDeviceForGood) {
  DeviceHealth health("test GPU");
  EXPECT_TRUE(health.failure().ok());
  EXPECT_EQ(health.Record(CudaStatus(cudaErrorInvalidValue, "x")).code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(health.Record(CudaStatus(cudaErrorMemoryAllocation, "x")).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(health.failure().ok());
  const absl::Status first =
      health.Record(CudaStatus(cudaErrorIllegalAddress, "running attention"));
  EXPECT_EQ(first.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(first.message().find("test GPU"), absl::string_view::npos);
  EXPECT_EQ(health.failure(), first);
  // The first fault is kept; later statuses report it.
  EXPECT_EQ(health.Record(CudaStatus(cudaErrorLaunchFailure, "y")), first);
  EXPECT_EQ(health.Record(absl::OkStatus()), absl::OkStatus());
  EXPECT_EQ(health.failure(), first);
}

// A CPU backend behind the CUDA backend's error path: Attend fails with
// the injected CUDA error (once), classified and recorded as CudaBackend
// does.
class FaultInjectingBackend final : public AttentionBackend {
 public:
  FaultInjectingBackend() : cpu_(2), health_("injected GPU") {}

  void InjectAttendError(cudaError_t error) { injected_ = error; }
  int attend_calls() const { return attend_calls_; }

  absl::string_view name() const override { return "cuda"; }
  std::string device() const override { return "injected GPU"; }
  absl::StatusOr<std::unique_ptr<DeviceArena>> AllocateArena(
      int64_t bytes) override {
    return cpu_.AllocateArena(bytes);
  }
  absl::Status WriteKv(const KvWrite& write) override {
    if (absl::Status failure = health_.failure(); !failure.ok()) {
      return failure;
    }
    return cpu_.WriteKv(write);
  }
  absl::Status CopyBlock(const std::byte* src, std::byte* dst,
                         int64_t bytes) override {
    return cpu_.CopyBlock(src, dst, bytes);
  }
  absl::Status ReadBlock(const std::byte* src, std::byte* dst,
                         int64_t bytes) override {
    return cpu_.ReadBlock(src, dst, bytes);
  }
  absl::Status Attend(absl::Span<const AttentionProblem> problems) override {
    if (absl::Status failure = health_.failure(); !failure.ok()) {
      return failure;
    }
    ++attend_calls_;
    const cudaError_t error = injected_.exchange(cudaSuccess);
    if (error != cudaSuccess) {
      return health_.Record(CudaStatus(error, "running attention on the GPU"));
    }
    return cpu_.Attend(problems);
  }
  absl::Status failure() const override { return health_.failure(); }

 private:
  CpuBackend cpu_;
  DeviceHealth health_;
  std::atomic<cudaError_t> injected_{cudaSuccess};
  std::atomic<int> attend_calls_{0};
};

class FaultInjectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto backend = std::make_unique<FaultInjectingBackend>();
    backend_ = backend.get();
    EngineOptions options;
    options.kv_cache_bytes = int64_t{16} << 20;
    options.kv_block_bytes = 4096;
    options.sessions.reap_interval = absl::ZeroDuration();
    auto engine = AttentionEngine::Create(std::move(backend), options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    SessionSpec spec;
    spec.num_layers = 1;
    spec.num_q_heads = 4;
    spec.num_kv_heads = 2;
    spec.head_dim = 16;
    spec.value_dim = 16;
    spec.max_tokens = 256;
    spec.layers.resize(1);
    for (int s = 0; s < 3; ++s) {
      auto info = engine_->CreateSession(spec, absl::ZeroDuration());
      ASSERT_TRUE(info.ok()) << info.status();
      ids_.push_back(info->session_id);
    }
  }

  // One decode step per session.
  std::vector<AppendRequest> Steps() {
    q_ = testing::RandomTensor({1, 4, 16}, rng_);
    kv_ = testing::RandomTensor({1, 2, 16}, rng_);
    std::vector<AppendRequest> steps;
    for (const std::string& id : ids_) {
      AppendRequest r;
      r.session_id = id;
      r.layer = 0;
      r.q = q_.rows(0, 1);
      r.k = kv_.rows(0, 1);
      r.v = kv_.rows(0, 1);
      steps.push_back(r);
    }
    return steps;
  }

  std::mt19937 rng_{16};
  testing::HostTensor q_, kv_;
  FaultInjectingBackend* backend_ = nullptr;
  std::unique_ptr<AttentionEngine> engine_;
  std::vector<std::string> ids_;
};

TEST_F(FaultInjectionTest, StickyErrorFailsTheBackendWithoutReruns) {
  for (const auto& result : engine_->AppendEach(Steps())) {
    ASSERT_TRUE(result.ok()) << result.status();
  }
  EXPECT_FALSE(engine_->stats().backend_failed);
  const int before = backend_->attend_calls();

  backend_->InjectAttendError(cudaErrorIllegalAddress);
  for (const auto& result : engine_->AppendEach(Steps())) {
    EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable)
        << result.status();
  }
  // One batch call; no problem-by-problem re-run on the dead device.
  EXPECT_EQ(backend_->attend_calls(), before + 1);
  EXPECT_EQ(backend_->failure().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(engine_->stats().backend_failed);

  // Every later call fails fast with the same status, device untouched.
  std::vector<AppendRequest> steps = Steps();
  auto alone = engine_->Append(steps[0]);
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kUnavailable);
  for (const auto& result : engine_->AppendEach(steps)) {
    EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_EQ(backend_->attend_calls(), before + 1);
}

TEST_F(FaultInjectionTest, OutOfMemoryStaysPerCall) {
  for (const auto& result : engine_->AppendEach(Steps())) {
    ASSERT_TRUE(result.ok()) << result.status();
  }
  const int before = backend_->attend_calls();
  backend_->InjectAttendError(cudaErrorMemoryAllocation);
  // The batch fails once; its steps are re-run one by one and succeed.
  for (const auto& result : engine_->AppendEach(Steps())) {
    EXPECT_TRUE(result.ok()) << result.status();
  }
  EXPECT_EQ(backend_->attend_calls(), before + 1 + 3);
  EXPECT_TRUE(backend_->failure().ok());
  EXPECT_FALSE(engine_->stats().backend_failed);
}

}  // namespace
}  // namespace cuda
}  // namespace attention
