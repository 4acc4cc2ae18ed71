// CudaBackend: AttentionBackend on an NVIDIA GPU (sm_80 and newer).
//
// Memory. The KV pool's arena is one cudaMalloc allocation (never managed
// memory), zeroed once, so KV blocks and the pointers in paged KvViews are
// device addresses. A stateless problem's KvView points at host memory;
// Attend copies those keys and values to the GPU itself.
//
// Calls. Every method leases a stream context (its own CUDA stream, pinned
// staging buffer and device scratch buffer; up to max_streams are made on
// demand), stages its inputs in pinned memory, copies them with one
// cudaMemcpyAsync, runs the kernels, copies the results back and waits for
// its own stream only. Concurrent calls therefore overlap on the GPU.
//
// Kernels (attention_kernels.cu). fp16/bf16 KV with head_dim and value_dim
// multiples of 8 up to 128 run on tensor cores (mma.sync m16n8k16, fp32
// accumulation); fp32 KV and other dims run a SIMT kernel in fp32. Problems
// with few row blocks (decode) use flash-decoding split-KV: one block per
// (problem, KV head, 512-key chunk), serving every query head of the GQA
// group from one load of each K/V tile, then a merge kernel combines the
// chunk states in increasing order. Problems with many rows (prefill) use
// one block per (problem, KV head, row block) that walks and merges its
// chunks itself with the same arithmetic. Either way a row's result is
// bitwise the same (see attention_kernels.cu), so decode == prefill and a
// batch never changes a problem's result.
//
// Errors. CUDA failures are INTERNAL with the CUDA error text; overflowing
// logits and (policy kError) empty rows are INVALID_ARGUMENT naming the
// problem, row and head. A failed call leaves the backend usable unless the
// GPU context itself faulted.
#ifndef ATTENTION_CORE_CUDA_CUDA_BACKEND_H_
#define ATTENTION_CORE_CUDA_CUDA_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/backend.h"

namespace attention {
namespace cuda {
class StreamPool;
}  // namespace cuda

struct CudaBackendOptions {
  // CUDA device ordinal.
  int device = 0;
  // Most concurrent calls on the GPU (stream contexts); more callers wait.
  int max_streams = 8;
};

// Thread-safety: every method may be called concurrently (AttentionBackend).
class CudaBackend final : public AttentionBackend {
 public:
  // UNAVAILABLE, with the reason, when no usable device exists (no driver,
  // no device, compute capability below 8.0, or this binary has no code
  // for it).
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(
      const CudaBackendOptions& options);
  ~CudaBackend() override;  // REQUIRES: every arena already destroyed

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  absl::string_view name() const override { return "cuda"; }
  // e.g. "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)".
  std::string device() const override { return device_; }
  int num_sms() const { return num_sms_; }
  // Free device memory now (cudaMemGetInfo), e.g. to size the KV cache as
  // a fraction of it. INTERNAL on a CUDA failure.
  absl::StatusOr<int64_t> FreeMemoryBytes() const;

  // CudaServesSessionSpec (session_support.h).
  absl::Status CheckSessionSpec(const SessionSpec& spec) const override;

  // cudaMalloc'd and zeroed. INVALID_ARGUMENT for bytes <= 0;
  // RESOURCE_EXHAUSTED (with the free GPU memory) when it does not fit.
  absl::StatusOr<std::unique_ptr<DeviceArena>> AllocateArena(
      int64_t bytes) override;

  // INTERNAL when a destination block is missing or not in an arena of this
  // backend, or on a CUDA failure; FAILED_PRECONDITION for a shared-latent
  // layout (CheckSessionSpec refuses such sessions first).
  absl::Status WriteKv(const KvWrite& write) override;

  // INVALID_ARGUMENT unless both ranges lie in arenas of this backend.
  absl::Status CopyBlock(const std::byte* src, std::byte* dst,
                         int64_t bytes) override;
  // INVALID_ARGUMENT unless `src` lies in an arena of this backend; `dst`
  // is host memory.
  absl::Status ReadBlock(const std::byte* src, std::byte* dst,
                         int64_t bytes) override;

  absl::Status Attend(absl::Span<const AttentionProblem> problems) override;

  // Attend, returning the GPU time of its kernels in milliseconds (copies
  // excluded). For benchmarks.
  absl::StatusOr<float> AttendTimed(
      absl::Span<const AttentionProblem> problems);

  // True when [ptr, ptr + bytes) lies inside one arena of this backend.
  bool IsArenaMemory(const void* ptr, int64_t bytes) const;

 private:
  class Arena;

  CudaBackend(int device, std::string description, int num_sms,
              int max_streams);
  absl::Status AttendImpl(absl::Span<const AttentionProblem> problems,
                          float* kernel_ms);
  void ForgetArena(const std::byte* base);
  // Copies `bytes` of arena memory at `src` to `dst` (arena memory, or host
  // memory when `to_host`) and waits for it. `what` ("CopyBlock",
  // "ReadBlock") names the call in errors.
  absl::Status CopyFromArena(const std::byte* src, std::byte* dst,
                             int64_t bytes, bool to_host,
                             absl::string_view what);

  const int device_ordinal_;
  const std::string device_;
  const int num_sms_;
  const std::unique_ptr<cuda::StreamPool> streams_;

  mutable absl::Mutex arenas_mu_;
  std::vector<std::pair<const std::byte*, int64_t>> arenas_
      ABSL_GUARDED_BY(arenas_mu_);
};

}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_CUDA_BACKEND_H_
