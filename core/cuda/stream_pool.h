// StreamPool: the CUDA streams of the backend, each with its own pinned
// staging buffer, device scratch buffer and timing events. A call leases one
// context for its duration, so concurrent calls (one per server worker
// thread) run on different streams and their copies overlap each other's
// kernels. Every context and buffer is made by Create() (the scratch
// budget, reserved at start-up); none is allocated, grown or freed while
// serving, so no call stalls the device with cudaMalloc/cudaFree.
#ifndef ATTENTION_CORE_CUDA_STREAM_POOL_H_
#define ATTENTION_CORE_CUDA_STREAM_POOL_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/cuda/device_buffers.h"

namespace attention {
namespace cuda {

struct StreamContext {
  cudaStream_t stream = nullptr;
  cudaEvent_t kernels_start = nullptr;
  cudaEvent_t kernels_stop = nullptr;
  PinnedBuffer pinned;
  DeviceBuffer scratch;
};

// Thread-safety: Acquire may be called from any thread.
class StreamPool {
 public:
  // `contexts` contexts (at least 1), each with `scratch_bytes` of device
  // scratch and `pinned_bytes` of pinned staging memory. REQUIRES: `device`
  // selected on the calling thread. RESOURCE_EXHAUSTED when the memory cannot
  // be had, INTERNAL when a stream cannot be created.
  static absl::StatusOr<std::unique_ptr<StreamPool>> Create(
      int device, int contexts, int64_t scratch_bytes, int64_t pinned_bytes);
  ~StreamPool();  // REQUIRES: no lease outstanding
  StreamPool(const StreamPool&) = delete;
  StreamPool& operator=(const StreamPool&) = delete;

  // Returns a context to the pool when destroyed.
  class Lease {
   public:
    Lease(Lease&& other) noexcept : pool_(other.pool_), ctx_(other.ctx_) {
      other.ctx_ = nullptr;
    }
    Lease& operator=(Lease&&) = delete;
    ~Lease();
    StreamContext* operator->() const { return ctx_; }
    StreamContext& operator*() const { return *ctx_; }

   private:
    friend class StreamPool;
    Lease(StreamPool* pool, StreamContext* ctx) : pool_(pool), ctx_(ctx) {}
    StreamPool* pool_;
    StreamContext* ctx_;
  };

  // A free context, or the next one returned.
  Lease Acquire();

  int num_contexts() const { return num_contexts_; }
  // Device scratch and pinned staging bytes of each context.
  int64_t scratch_bytes() const { return scratch_bytes_; }
  int64_t pinned_bytes() const { return pinned_bytes_; }

 private:
  StreamPool(int device, int contexts, int64_t scratch_bytes,
             int64_t pinned_bytes)
      : device_(device),
        num_contexts_(contexts),
        scratch_bytes_(scratch_bytes),
        pinned_bytes_(pinned_bytes) {}
  void Release(StreamContext* ctx);

  const int device_;
  const int num_contexts_;
  const int64_t scratch_bytes_;
  const int64_t pinned_bytes_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<StreamContext>> all_ ABSL_GUARDED_BY(mu_);
  std::vector<StreamContext*> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cuda
}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_STREAM_POOL_H_
