#include "core/cuda/stream_pool.h"

#include <algorithm>
#include <utility>

#include "core/cuda/cuda_status.h"
#include "core/status_macros.h"

namespace attention {
namespace cuda {

absl::StatusOr<std::unique_ptr<StreamPool>> StreamPool::Create(
    int device, int contexts, int64_t scratch_bytes, int64_t pinned_bytes) {
  std::unique_ptr<StreamPool> pool(new StreamPool(device, std::max(contexts, 1),
                                                  scratch_bytes, pinned_bytes));
  absl::MutexLock lock(&pool->mu_);
  for (int i = 0; i < pool->num_contexts_; ++i) {
    auto ctx = std::make_unique<StreamContext>();
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking),
        "creating a CUDA stream");
    StreamContext* raw = ctx.get();
    // Owned from here on: the destructor releases what was made.
    pool->all_.push_back(std::move(ctx));
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&raw->kernels_start),
                              "creating a CUDA event");
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&raw->kernels_stop),
                              "creating a CUDA event");
    ATTN_RETURN_IF_ERROR(raw->scratch.Reserve(scratch_bytes));
    ATTN_RETURN_IF_ERROR(raw->pinned.Reserve(pinned_bytes));
    pool->free_.push_back(raw);
  }
  return pool;
}

StreamPool::~StreamPool() {
  absl::MutexLock lock(&mu_);
  (void)cudaSetDevice(device_);
  for (std::unique_ptr<StreamContext>& ctx : all_) {
    if (ctx->stream != nullptr) (void)cudaStreamSynchronize(ctx->stream);
    if (ctx->kernels_start != nullptr) {
      (void)cudaEventDestroy(ctx->kernels_start);
    }
    if (ctx->kernels_stop != nullptr) (void)cudaEventDestroy(ctx->kernels_stop);
    if (ctx->stream != nullptr) (void)cudaStreamDestroy(ctx->stream);
  }
}

StreamPool::Lease::~Lease() {
  if (ctx_ != nullptr) pool_->Release(ctx_);
}

StreamPool::Lease StreamPool::Acquire() {
  absl::MutexLock lock(&mu_);
  auto available = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return !free_.empty();
  };
  mu_.Await(absl::Condition(&available));
  StreamContext* ctx = free_.back();
  free_.pop_back();
  return Lease(this, ctx);
}

void StreamPool::Release(StreamContext* ctx) {
  absl::MutexLock lock(&mu_);
  free_.push_back(ctx);
}

}  // namespace cuda
}  // namespace attention
