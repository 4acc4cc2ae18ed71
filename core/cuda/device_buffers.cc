#include "core/cuda/device_buffers.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace attention {
namespace cuda {
namespace {

absl::Status NoRoom(const char* kind, int64_t bytes, cudaError_t error,
                    const char* advice) {
  (void)cudaGetLastError();
  return absl::ResourceExhaustedError(
      absl::StrCat("could not allocate ", bytes, " bytes of ", kind, " (",
                   cudaGetErrorString(error), "); ", advice));
}

}  // namespace

absl::Status PinnedAllocator::Allocate(int64_t bytes, std::byte** data) {
  void* ptr = nullptr;
  const cudaError_t error =
      cudaHostAlloc(&ptr, static_cast<size_t>(bytes), cudaHostAllocDefault);
  if (error != cudaSuccess) {
    return NoRoom("pinned host staging memory", bytes, error,
                  "send fewer tokens per call");
  }
  *data = static_cast<std::byte*>(ptr);
  return absl::OkStatus();
}

void PinnedAllocator::Free(std::byte* data) { (void)cudaFreeHost(data); }

absl::Status DeviceAllocator::Allocate(int64_t bytes, std::byte** data) {
  void* ptr = nullptr;
  const cudaError_t error = cudaMalloc(&ptr, static_cast<size_t>(bytes));
  if (error != cudaSuccess) {
    return NoRoom("GPU scratch memory", bytes, error,
                  "send fewer tokens per call, or start the server with a "
                  "smaller --kv_cache_bytes to leave the GPU more room");
  }
  *data = static_cast<std::byte*>(ptr);
  return absl::OkStatus();
}

void DeviceAllocator::Free(std::byte* data) { (void)cudaFree(data); }

}  // namespace cuda
}  // namespace attention
