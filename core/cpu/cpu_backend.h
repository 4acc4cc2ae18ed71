// CpuBackend: the CPU implementation of AttentionBackend. KV blocks live in
// ordinary (64-byte aligned) host memory; attention runs on a fixed
// ThreadPool following the canonical reduction order of attention_problem.h,
// with SIMD kernels chosen at run time (see cpu_features.h). Every kernel
// path gives bitwise the same results, so the choice only changes speed.
//
// Work split: a problem is cut into units of (query rows, KV head); all
// query heads of a KV head share each converted K/V tile. Where the KV
// layout keeps a tile's heads next to each other (paged blocks of at most a
// tile of tokens), up to 8 units of a row block run on one thread with
// their tiles interleaved, so that each block is read in one sweep
// (UnitRunner::RunInterleaved). When there are too few such groups to
// occupy the threads (a lone long decode), their key chunks
// (kKeysPerSplit positions each) are spread over several threads and
// their states merged afterwards in increasing chunk order — the canonical
// order defines every chunk state from empty, so this gives the same bits.
// For the same reason, decode steps of one call that read the same KV
// blocks (forks of one prompt) compute each such chunk once for all of them
// (shared_chunks.h). A call with little work (a short decode) runs on the
// calling thread: waking a worker would cost more than it saves.
#ifndef ATTENTION_CORE_CPU_CPU_BACKEND_H_
#define ATTENTION_CORE_CPU_CPU_BACKEND_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/backend.h"
#include "core/cpu/cpu_features.h"
#include "core/thread_pool.h"

namespace attention {
namespace cpu {
struct KernelTable;
}  // namespace cpu

// Thread-safety: every method may be called concurrently (see
// AttentionBackend); concurrent Attend calls share the worker threads.
class CpuBackend final : public AttentionBackend {
 public:
  // Runs attention on `num_threads` threads (the calling thread included);
  // <= 0 means one per hardware thread. Uses DefaultCpuIsa(): the fastest
  // kernels the processor supports, or ATTN_CPU_ISA (a bad value is
  // reported on stderr and ignored). Idle threads poll for up to `spin`
  // before sleeping (see ThreadPool).
  explicit CpuBackend(int num_threads,
                      absl::Duration spin = ThreadPool::kDefaultSpin);

  // As above with an explicit instruction set. FAILED_PRECONDITION when
  // this processor or build cannot run `isa`.
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(
      int num_threads, CpuIsa isa,
      absl::Duration spin = ThreadPool::kDefaultSpin);

  ~CpuBackend() override;

  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  absl::string_view name() const override { return "cpu"; }
  // CPU model name, kernel ISA and thread count, e.g.
  // "Intel(R) Xeon(R) Platinum 8480+ (avx512, 16 threads)".
  std::string device() const override { return device_; }
  int num_threads() const { return pool_.num_threads(); }
  CpuIsa isa() const { return isa_; }

  // Host memory aligned to 64 bytes; arenas of 2 MiB and more are aligned
  // to 2 MiB and advised as transparent huge pages (fewer TLB misses when a
  // decode walks a long context). Pages are not touched, so a large arena
  // costs physical memory only as blocks are written (in huge-page units
  // where the kernel grants them).
  // INVALID_ARGUMENT for a negative size, RESOURCE_EXHAUSTED when the
  // allocation fails.
  absl::StatusOr<std::unique_ptr<DeviceArena>> AllocateArena(
      int64_t bytes) override;

  // INTERNAL when a destination block is missing.
  absl::Status WriteKv(const KvWrite& write) override;

  absl::Status CopyBlock(const std::byte* src, std::byte* dst,
                         int64_t bytes) override;
  absl::Status ReadBlock(const std::byte* src, std::byte* dst,
                         int64_t bytes) override;

  absl::Status Attend(absl::Span<const AttentionProblem> problems) override;
  // In one run: a failing problem stops only its own work.
  void AttendEach(absl::Span<const AttentionProblem> problems,
                  absl::Span<absl::Status> statuses) override;

  // How many chunk states were computed once for several decode steps
  // reading the same KV blocks (shared_chunks.h), since construction.
  int64_t shared_chunk_computations() const override {
    return shared_chunk_computations_.load(std::memory_order_relaxed);
  }

  // The thread pool attention runs on (benchmarks reuse it so that they
  // measure on the same threads).
  ThreadPool& thread_pool() { return pool_; }

 private:
  CpuBackend(int num_threads, CpuIsa isa, absl::Duration spin);
  // Attend and AttendEach: each problem's status into statuses[p]
  // (messages name problem p as "problem p" when `named`); the top-k
  // problems one at a time, the others in one AttendDense.
  void Run(absl::Span<const AttentionProblem> problems, bool named,
           absl::Span<absl::Status> statuses);
  // Attend for problems without a top-k selection. Messages name problem
  // i as names[i] of the caller's call (-1 or `names` empty: none; a
  // problem with an origin names the origin's). `share_chunks`: look for
  // chunks that several decode rows read alike (forks of one prompt); off
  // for the rows of top-k selections, which read one-token blocks of their
  // own, so that the search would build a key per row and chunk in vain.
  // `each`: empty, or each problem's own status (problems.size()).
  absl::Status AttendDense(absl::Span<const AttentionProblem> problems,
                           absl::Span<const int64_t> names, bool share_chunks,
                           absl::Span<absl::Status> each = {});

  ThreadPool pool_;
  CpuIsa isa_;
  const cpu::KernelTable* kernels_;
  std::string device_;
  std::atomic<int64_t> shared_chunk_computations_{0};
};

}  // namespace attention

#endif  // ATTENTION_CORE_CPU_CPU_BACKEND_H_
