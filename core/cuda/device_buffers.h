// Growable scratch buffers of the CUDA backend: page-locked host memory for
// staging copies, and plain device memory (cudaMalloc, never managed
// memory). Both keep their largest size so steady-state calls allocate
// nothing.
#ifndef ATTENTION_CORE_CUDA_DEVICE_BUFFERS_H_
#define ATTENTION_CORE_CUDA_DEVICE_BUFFERS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace attention {
namespace cuda {

// Thread-safety: none; each buffer belongs to one stream context.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  // Makes capacity() >= bytes; the contents are not kept when it grows.
  // RESOURCE_EXHAUSTED when the host cannot pin that much memory.
  absl::Status Reserve(int64_t bytes);
  std::byte* data() const { return data_; }
  int64_t capacity() const { return capacity_; }

 private:
  std::byte* data_ = nullptr;
  int64_t capacity_ = 0;
};

// Thread-safety: none; each buffer belongs to one stream context.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Makes capacity() >= bytes; the contents are not kept when it grows.
  // RESOURCE_EXHAUSTED when the GPU has no room for it.
  absl::Status Reserve(int64_t bytes);
  std::byte* data() const { return data_; }
  int64_t capacity() const { return capacity_; }

 private:
  std::byte* data_ = nullptr;
  int64_t capacity_ = 0;
};

}  // namespace cuda
}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_DEVICE_BUFFERS_H_
