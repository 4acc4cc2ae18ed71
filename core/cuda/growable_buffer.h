// GrowableBuffer: a scratch buffer that keeps its largest size, so that
// steady-state calls allocate nothing, and grows geometrically (by half
// again at least, in whole MiB) so that a slowly growing workload
// reallocates O(log n) times. The memory itself comes from an allocator
// policy (page-locked host or device memory in device_buffers.h); this
// header needs no CUDA, so the growth policy is tested on any machine.
#ifndef ATTENTION_CORE_CUDA_GROWABLE_BUFFER_H_
#define ATTENTION_CORE_CUDA_GROWABLE_BUFFER_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace attention {
namespace cuda {

inline constexpr int64_t kBufferGranule = int64_t{1} << 20;

// `bytes` rounded up to whole granules (MiB).
constexpr int64_t RoundToGranule(int64_t bytes) {
  return (bytes + kBufferGranule - 1) / kBufferGranule * kBufferGranule;
}

// The capacity to allocate when a buffer of `current` bytes must hold
// `needed` (> current): at least 1.5 * current, at least needed, whole MiB.
constexpr int64_t GrownCapacity(int64_t current, int64_t needed) {
  int64_t capacity = current + current / 2;
  if (capacity < needed) capacity = needed;
  return RoundToGranule(capacity);
}

// `Allocator` provides
//   static absl::Status Allocate(int64_t bytes, std::byte** data);
//     (RESOURCE_EXHAUSTED with advice for the caller when there is no room)
//   static void Free(std::byte* data);
// Thread-safety: none; each buffer belongs to one stream context.
template <typename Allocator>
class GrowableBuffer {
 public:
  GrowableBuffer() = default;
  ~GrowableBuffer() {
    if (data_ != nullptr) Allocator::Free(data_);
  }
  GrowableBuffer(const GrowableBuffer&) = delete;
  GrowableBuffer& operator=(const GrowableBuffer&) = delete;

  // Makes capacity() >= bytes; the contents are not kept when it grows.
  // When the grown capacity cannot be had, tries just `bytes` (in whole
  // MiB) before failing with the allocator's error; the buffer is then
  // empty.
  absl::Status Reserve(int64_t bytes) {
    if (bytes <= capacity_) return absl::OkStatus();
    const int64_t grown = GrownCapacity(capacity_, bytes);
    if (data_ != nullptr) {
      // Freed first, so the old and the new buffer never coexist.
      Allocator::Free(data_);
      data_ = nullptr;
      capacity_ = 0;
    }
    absl::Status status = Allocator::Allocate(grown, &data_);
    int64_t capacity = grown;
    if (!status.ok() && RoundToGranule(bytes) < grown) {
      capacity = RoundToGranule(bytes);
      status = Allocator::Allocate(capacity, &data_);
    }
    if (!status.ok()) {
      data_ = nullptr;
      return status;
    }
    capacity_ = capacity;
    return absl::OkStatus();
  }

  std::byte* data() const { return data_; }
  int64_t capacity() const { return capacity_; }

 private:
  std::byte* data_ = nullptr;
  int64_t capacity_ = 0;
};

}  // namespace cuda
}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_GROWABLE_BUFFER_H_
