// StreamPool: the CUDA streams of the backend, each with its own pinned
// staging buffer, device scratch buffer and timing events. A call leases one
// context for its duration, so concurrent calls (one per server worker
// thread) run on different streams and their copies overlap each other's
// kernels. Contexts are created on demand up to a limit and then reused.
#ifndef ATTENTION_CORE_CUDA_STREAM_POOL_H_
#define ATTENTION_CORE_CUDA_STREAM_POOL_H_

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
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
  // `device` is selected on the calling thread before contexts are made.
  StreamPool(int device, int max_contexts);
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

  // A free context, a new one while fewer than max_contexts exist, or the
  // next one returned. INTERNAL when a stream cannot be created.
  absl::StatusOr<Lease> Acquire();

 private:
  void Release(StreamContext* ctx);

  const int device_;
  const int max_contexts_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<StreamContext>> all_ ABSL_GUARDED_BY(mu_);
  std::vector<StreamContext*> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cuda
}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_STREAM_POOL_H_
