// Scratch buffers of the CUDA backend: page-locked host memory for staging
// copies, and plain device memory (cudaMalloc, never managed memory). The
// backend reserves each once at start-up (StreamPool::Create) and never
// grows them while serving; the growth policy is growable_buffer.h's.
#ifndef ATTENTION_CORE_CUDA_DEVICE_BUFFERS_H_
#define ATTENTION_CORE_CUDA_DEVICE_BUFFERS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "core/cuda/growable_buffer.h"

namespace attention {
namespace cuda {

// cudaHostAlloc / cudaFreeHost. RESOURCE_EXHAUSTED when the host cannot pin
// that much memory.
struct PinnedAllocator {
  static absl::Status Allocate(int64_t bytes, std::byte** data);
  static void Free(std::byte* data);
};

// cudaMalloc / cudaFree on the current device. RESOURCE_EXHAUSTED when the
// GPU has no room.
struct DeviceAllocator {
  static absl::Status Allocate(int64_t bytes, std::byte** data);
  static void Free(std::byte* data);
};

using PinnedBuffer = GrowableBuffer<PinnedAllocator>;
using DeviceBuffer = GrowableBuffer<DeviceAllocator>;

}  // namespace cuda
}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_DEVICE_BUFFERS_H_
