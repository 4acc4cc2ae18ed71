#include "core/cuda/stream_pool.h"

#include <utility>

#include "core/cuda/cuda_status.h"

namespace attention {
namespace cuda {

StreamPool::StreamPool(int device, int max_contexts)
    : device_(device), max_contexts_(max_contexts < 1 ? 1 : max_contexts) {}

StreamPool::~StreamPool() {
  absl::MutexLock lock(&mu_);
  (void)cudaSetDevice(device_);
  for (std::unique_ptr<StreamContext>& ctx : all_) {
    (void)cudaStreamSynchronize(ctx->stream);
    (void)cudaEventDestroy(ctx->kernels_start);
    (void)cudaEventDestroy(ctx->kernels_stop);
    (void)cudaStreamDestroy(ctx->stream);
  }
}

StreamPool::Lease::~Lease() {
  if (ctx_ != nullptr) pool_->Release(ctx_);
}

absl::StatusOr<StreamPool::Lease> StreamPool::Acquire() {
  absl::MutexLock lock(&mu_);
  auto available = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return !free_.empty() || static_cast<int>(all_.size()) < max_contexts_;
  };
  mu_.Await(absl::Condition(&available));
  if (!free_.empty()) {
    StreamContext* ctx = free_.back();
    free_.pop_back();
    return Lease(this, ctx);
  }
  auto ctx = std::make_unique<StreamContext>();
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking),
      "creating a CUDA stream");
  if (const cudaError_t e = cudaEventCreate(&ctx->kernels_start);
      e != cudaSuccess) {
    (void)cudaStreamDestroy(ctx->stream);
    return CudaStatus(e, "creating a CUDA event");
  }
  if (const cudaError_t e = cudaEventCreate(&ctx->kernels_stop);
      e != cudaSuccess) {
    (void)cudaEventDestroy(ctx->kernels_start);
    (void)cudaStreamDestroy(ctx->stream);
    return CudaStatus(e, "creating a CUDA event");
  }
  StreamContext* raw = ctx.get();
  all_.push_back(std::move(ctx));
  return Lease(this, raw);
}

void StreamPool::Release(StreamContext* ctx) {
  absl::MutexLock lock(&mu_);
  free_.push_back(ctx);
}

}  // namespace cuda
}  // namespace attention
