// CudaBackend: AttentionBackend on an NVIDIA GPU (sm_80 and newer).
//
// Memory. The KV pool's arena is one cudaMalloc allocation (never managed
// memory), zeroed once, so KV blocks and the pointers in paged KvViews are
// device addresses. A stateless problem's KvView points at host memory;
// Attend copies those keys and values to the GPU itself.
//
// Calls. Every method leases a stream context (its own CUDA stream, pinned
// staging buffer and device scratch buffer), stages its inputs in pinned
// memory, copies them with one cudaMemcpyAsync, runs the kernels, copies
// the results back and waits for its own stream only. Concurrent calls
// therefore overlap on the GPU.
//
// Scratch budget. Create() makes all max_streams contexts at once, each
// with scratch_bytes_per_stream of device scratch and
// pinned_bytes_per_stream of pinned staging memory, and never allocates or
// frees either afterwards (no device-wide synchronisation while serving). The
// device part, scratch_bytes() = max_streams * scratch_bytes_per_stream, is
// taken before the KV arena is allocated, so --kv_cache_bytes must leave room
// for it. An Attend call whose plan needs more than one context's scratch is
// refused up front with RESOURCE_EXHAUSTED; WriteKv copies large writes in
// pieces that fit.
//
// Kernels (attention_kernels.cu). fp16/bf16 KV with head_dim and value_dim
// multiples of 8 up to 256 run on tensor cores (mma.sync m16n8k16, fp32
// accumulation; above 128, e.g. Gemma's 256, a variant that keeps q in
// shared memory, with fewer warps per block where the device's shared
// memory is short); fp32 KV and other dims run a SIMT kernel in fp32. Problems
// with few row blocks (decode) use flash-decoding split-KV: one block per
// (problem, KV head, 512-key chunk), serving every query head of the GQA
// group from one load of each K/V tile, then a merge kernel combines the
// chunk states in increasing order. Problems with many rows (prefill) use
// one block per (problem, KV head, row block) that walks and merges its
// chunks itself with the same arithmetic. Either way a row's result is
// bitwise the same (see attention_kernels.cu), so decode == prefill and a
// batch never changes a problem's result.
//
// Errors. CUDA failures are INTERNAL (RESOURCE_EXHAUSTED when out of
// memory) with the CUDA error text; overflowing logits and (policy kError)
// empty rows are INVALID_ARGUMENT naming the problem, row and head. A failed
// call leaves the backend usable unless the GPU context itself faulted (a
// sticky CUDA error, cuda_status.h): then the backend is failed for good,
// failure() and every later call return UNAVAILABLE (device_health.h).
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
#include "core/cuda/device_health.h"

namespace attention {
namespace cuda {
class StreamPool;
}  // namespace cuda

struct CudaBackendOptions {
  // CUDA device ordinal.
  int device = 0;
  // Most concurrent calls on the GPU (stream contexts); more callers wait.
  int max_streams = 8;
  // Device scratch and pinned staging memory (inputs and outputs only) of
  // each stream context, reserved at start-up: the most one call may use.
  // The defaults serve any call the server's 64 MiB messages allow (q, a
  // float32 output twice the size of a 16-bit reply, weights).
  int64_t scratch_bytes_per_stream = int64_t{512} << 20;
  int64_t pinned_bytes_per_stream = int64_t{256} << 20;
  // Split-KV chunk states of one pass (at most a quarter of the scratch);
  // 0 runs every problem in full mode (tests).
  int64_t max_state_bytes = int64_t{64} << 20;
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

  absl::Status failure() const override { return health_.failure(); }
  int64_t scratch_bytes() const override;

 private:
  class Arena;

  CudaBackend(int device, std::string description, int num_sms,
              int64_t max_shared_bytes, const CudaBackendOptions& options,
              std::unique_ptr<cuda::StreamPool> streams);
  absl::Status AttendImpl(absl::Span<const AttentionProblem> problems,
                          float* kernel_ms);
  absl::Status WriteKvImpl(const KvWrite& write);
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
  // Dynamic shared memory a block may use (the device's opt-in limit).
  const int64_t max_shared_bytes_;
  const CudaBackendOptions options_;
  const std::unique_ptr<cuda::StreamPool> streams_;
  cuda::DeviceHealth health_;

  mutable absl::Mutex arenas_mu_;
  std::vector<std::pair<const std::byte*, int64_t>> arenas_
      ABSL_GUARDED_BY(arenas_mu_);
};

}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_CUDA_BACKEND_H_
