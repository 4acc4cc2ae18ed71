// Growable scratch buffers of the CUDA backend: page-locked host memory for
// staging copies, and plain device memory (cudaMalloc, never managed
// memory). Both keep their largest size so steady-state calls allocate
// nothing, and grow geometrically (see growable_buffer.h).
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
