// The growth policy of the CUDA backend's scratch buffers, with a host
// allocator that records every request: needs no GPU (label unit).
#include "core/cuda/growable_buffer.h"

#include <cstdlib>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace attention {
namespace cuda {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// malloc with a configurable ceiling; remembers what was asked and how many
// blocks are live.
struct RecordingAllocator {
  static inline std::vector<int64_t> requests;
  static inline int live = 0;
  static inline int64_t limit = int64_t{1} << 40;

  static void Reset() {
    requests.clear();
    live = 0;
    limit = int64_t{1} << 40;
  }
  static absl::Status Allocate(int64_t bytes, std::byte** data) {
    requests.push_back(bytes);
    if (bytes > limit) return absl::ResourceExhaustedError("over the limit");
    *data = static_cast<std::byte*>(std::malloc(static_cast<size_t>(bytes)));
    ++live;
    return absl::OkStatus();
  }
  static void Free(std::byte* data) {
    std::free(data);
    --live;
  }
};

using Buffer = GrowableBuffer<RecordingAllocator>;

class GrowableBufferTest : public ::testing::Test {
 protected:
  void SetUp() override { RecordingAllocator::Reset(); }
  void TearDown() override { EXPECT_EQ(RecordingAllocator::live, 0); }
};

TEST(GrownCapacityTest, RoundsToWholeMiB) {
  EXPECT_EQ(GrownCapacity(0, 1), kMiB);
  EXPECT_EQ(GrownCapacity(0, kMiB), kMiB);
  EXPECT_EQ(GrownCapacity(0, kMiB + 1), 2 * kMiB);
}

TEST(GrownCapacityTest, GrowsByHalfAgainAtLeast) {
  EXPECT_EQ(GrownCapacity(4 * kMiB, 4 * kMiB + 1), 6 * kMiB);
  EXPECT_EQ(GrownCapacity(10 * kMiB, 11 * kMiB), 15 * kMiB);
  // A request beyond 1.5x is taken as it is.
  EXPECT_EQ(GrownCapacity(4 * kMiB, 20 * kMiB), 20 * kMiB);
}

TEST_F(GrowableBufferTest, StartsEmptyAndReservesWholeMiB) {
  Buffer buffer;
  EXPECT_EQ(buffer.capacity(), 0);
  EXPECT_EQ(buffer.data(), nullptr);
  ASSERT_TRUE(buffer.Reserve(100).ok());
  EXPECT_EQ(buffer.capacity(), kMiB);
  EXPECT_NE(buffer.data(), nullptr);
}

TEST_F(GrowableBufferTest, SmallerRequestsAllocateNothing) {
  Buffer buffer;
  ASSERT_TRUE(buffer.Reserve(3 * kMiB).ok());
  ASSERT_TRUE(buffer.Reserve(kMiB).ok());
  ASSERT_TRUE(buffer.Reserve(3 * kMiB).ok());
  EXPECT_EQ(RecordingAllocator::requests, std::vector<int64_t>{3 * kMiB});
}

// The regression of issue 9: the capacity used to be reset before the
// growth was computed, so every growth allocated just the request.
TEST_F(GrowableBufferTest, GrowsGeometrically) {
  Buffer buffer;
  ASSERT_TRUE(buffer.Reserve(4 * kMiB).ok());
  ASSERT_TRUE(buffer.Reserve(4 * kMiB + 1).ok());
  EXPECT_EQ(buffer.capacity(), 6 * kMiB);
  ASSERT_TRUE(buffer.Reserve(6 * kMiB + 1).ok());
  EXPECT_EQ(buffer.capacity(), 9 * kMiB);
  EXPECT_EQ(RecordingAllocator::live, 1);
}

TEST_F(GrowableBufferTest, SlowGrowthReallocatesLogarithmically) {
  Buffer buffer;
  for (int64_t bytes = kMiB; bytes <= 1024 * kMiB; bytes += kMiB) {
    ASSERT_TRUE(buffer.Reserve(bytes).ok());
  }
  // 1 MiB * 1.5^n >= 1 GiB after about 18 growths (rounding helps early).
  EXPECT_LE(RecordingAllocator::requests.size(), 20u);
}

TEST_F(GrowableBufferTest, FallsBackToTheRequestWhenGrowthHasNoRoom) {
  Buffer buffer;
  ASSERT_TRUE(buffer.Reserve(10 * kMiB).ok());
  RecordingAllocator::limit = 12 * kMiB;
  ASSERT_TRUE(buffer.Reserve(11 * kMiB).ok());
  EXPECT_EQ(buffer.capacity(), 11 * kMiB);
  EXPECT_EQ(RecordingAllocator::requests,
            (std::vector<int64_t>{10 * kMiB, 15 * kMiB, 11 * kMiB}));
}

TEST_F(GrowableBufferTest, FailureLeavesAnEmptyBufferThatCanRetry) {
  Buffer buffer;
  ASSERT_TRUE(buffer.Reserve(2 * kMiB).ok());
  RecordingAllocator::limit = 4 * kMiB;
  const absl::Status status = buffer.Reserve(8 * kMiB);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(buffer.capacity(), 0);
  EXPECT_EQ(buffer.data(), nullptr);
  EXPECT_EQ(RecordingAllocator::live, 0);
  ASSERT_TRUE(buffer.Reserve(3 * kMiB).ok());
  EXPECT_EQ(buffer.capacity(), 3 * kMiB);
}

}  // namespace
}  // namespace cuda
}  // namespace attention
