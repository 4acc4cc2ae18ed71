#include "core/cuda/device_buffers.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace attention {
namespace cuda {
namespace {

constexpr int64_t kGranule = int64_t{1} << 20;

// Grows by half again at least, so a slowly growing workload reallocates
// O(log n) times; rounded to whole MiB.
int64_t GrownCapacity(int64_t current, int64_t needed) {
  int64_t capacity = current + current / 2;
  if (capacity < needed) capacity = needed;
  return (capacity + kGranule - 1) / kGranule * kGranule;
}

absl::Status NoRoom(const char* kind, int64_t bytes, cudaError_t error,
                    const char* advice) {
  (void)cudaGetLastError();
  return absl::ResourceExhaustedError(
      absl::StrCat("could not allocate ", bytes, " bytes of ", kind, " (",
                   cudaGetErrorString(error), "); ", advice));
}

}  // namespace

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) (void)cudaFreeHost(data_);
}

absl::Status PinnedBuffer::Reserve(int64_t bytes) {
  if (bytes <= capacity_) return absl::OkStatus();
  if (data_ != nullptr) {
    (void)cudaFreeHost(data_);
    data_ = nullptr;
    capacity_ = 0;
  }
  int64_t capacity = GrownCapacity(capacity_, bytes);
  void* ptr = nullptr;
  cudaError_t error =
      cudaHostAlloc(&ptr, static_cast<size_t>(capacity), cudaHostAllocDefault);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    capacity = (bytes + kGranule - 1) / kGranule * kGranule;
    error = cudaHostAlloc(&ptr, static_cast<size_t>(capacity),
                          cudaHostAllocDefault);
  }
  if (error != cudaSuccess) {
    return NoRoom("pinned host staging memory", capacity, error,
                  "send fewer tokens per call");
  }
  data_ = static_cast<std::byte*>(ptr);
  capacity_ = capacity;
  return absl::OkStatus();
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) (void)cudaFree(data_);
}

absl::Status DeviceBuffer::Reserve(int64_t bytes) {
  if (bytes <= capacity_) return absl::OkStatus();
  if (data_ != nullptr) {
    (void)cudaFree(data_);
    data_ = nullptr;
    capacity_ = 0;
  }
  int64_t capacity = GrownCapacity(capacity_, bytes);
  void* ptr = nullptr;
  cudaError_t error = cudaMalloc(&ptr, static_cast<size_t>(capacity));
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    capacity = (bytes + kGranule - 1) / kGranule * kGranule;
    error = cudaMalloc(&ptr, static_cast<size_t>(capacity));
  }
  if (error != cudaSuccess) {
    return NoRoom("GPU scratch memory", capacity, error,
                  "send fewer tokens per call, or start the server with a "
                  "smaller --kv_cache_bytes to leave the GPU more room");
  }
  data_ = static_cast<std::byte*>(ptr);
  capacity_ = capacity;
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace attention
