// CpuBackend: the portable CPU implementation of AttentionBackend. KV blocks
// live in ordinary (64-byte aligned) host memory; attention runs on a fixed
// ThreadPool following the canonical reduction order of attention_problem.h.
#ifndef ATTENTION_CORE_CPU_CPU_BACKEND_H_
#define ATTENTION_CORE_CPU_CPU_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/backend.h"
#include "core/thread_pool.h"

namespace attention {

// Thread-safety: every method may be called concurrently (see
// AttentionBackend); concurrent Attend calls share the worker threads.
class CpuBackend final : public AttentionBackend {
 public:
  // Runs attention on `num_threads` threads (the calling thread included);
  // <= 0 means one per hardware thread.
  explicit CpuBackend(int num_threads);
  ~CpuBackend() override;

  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  absl::string_view name() const override { return "cpu"; }
  // CPU model name and thread count, e.g. "AMD EPYC 9654 (16 threads)".
  std::string device() const override { return device_; }
  int num_threads() const { return pool_.num_threads(); }

  // Host memory aligned to 64 bytes. Pages are not touched, so a large
  // arena costs physical memory only as blocks are written.
  // INVALID_ARGUMENT for a negative size, RESOURCE_EXHAUSTED when the
  // allocation fails.
  absl::StatusOr<std::unique_ptr<DeviceArena>> AllocateArena(
      int64_t bytes) override;

  // INTERNAL when a destination block is missing.
  absl::Status WriteKv(const KvWrite& write) override;

  absl::Status CopyBlock(const std::byte* src, std::byte* dst,
                         int64_t bytes) override;

  absl::Status Attend(absl::Span<const AttentionProblem> problems) override;

 private:
  ThreadPool pool_;
  std::string device_;
};

}  // namespace attention

#endif  // ATTENTION_CORE_CPU_CPU_BACKEND_H_
