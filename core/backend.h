// AttentionBackend: the device-specific half of the engine (CPU now, CUDA
// later). It owns the memory KV blocks live in and runs attention over them.
// Everything above it (block pool, sessions, engine) is device-agnostic.
#ifndef ATTENTION_CORE_BACKEND_H_
#define ATTENTION_CORE_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/attention_problem.h"
#include "core/kv_view.h"
#include "core/session_spec.h"
#include "core/tensor.h"

namespace attention {

// A region of backend memory holding KV blocks. Owned by the block pool.
class DeviceArena {
 public:
  virtual ~DeviceArena() = default;
  // Base address (device address for a GPU backend). Stable for the
  // arena's lifetime.
  virtual std::byte* data() = 0;
  virtual int64_t size_bytes() const = 0;
};

// Destination of KvWrite: rows [start, start + T) of a paged layer.
struct KvWrite {
  KvBlockLayout layout;
  // Absolute position of the first new token.
  int64_t start = 0;
  // k [T, H_kv, head_dim] and v [T, H_kv, value_dim], any dtype; converted
  // to layout.dtype. REQUIRES: values representable in layout.dtype.
  TensorView k;
  TensorView v;  // empty with layout.shared_values
  // Index keys [T, index_dim] when layout.index_dim > 0, any dtype.
  TensorView index_k;
  // Base address of every block of the layer, listed as KvView::k_blocks
  // (logical blocks [gap_begin, gap_begin + gap_blocks) dropped, not
  // listed); read with block(b). The blocks covering [start, start + T) are
  // non-null and writable.
  absl::Span<std::byte* const> blocks;
  int64_t gap_begin = 0;
  int64_t gap_blocks = 0;

  // Logical blocks, listed and dropped.
  int64_t num_blocks() const {
    return static_cast<int64_t>(blocks.size()) + gap_blocks;
  }
  // REQUIRES: 0 <= b < num_blocks().
  std::byte* block(int64_t b) const {
    return ListedBlock(blocks, gap_begin, gap_blocks, b);
  }
};

// Thread-safety: every method may be called concurrently from any thread;
// calls touching disjoint blocks and outputs never interfere.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;

  // "cpu" or "cuda".
  virtual absl::string_view name() const = 0;
  // Human-readable device description, e.g. "AMD EPYC 9654 (avx2)".
  virtual std::string device() const = 0;

  // OK when this backend computes every layer of `spec` (as requested, not
  // yet resolved: only its kinds of attention matter here).
  // FAILED_PRECONDITION, naming what it lacks, for a kind of attention it
  // does not serve; the engine then refuses the session at CreateSession,
  // so a backend never computes a kind it does not serve. The default
  // serves everything.
  virtual absl::Status CheckSessionSpec(const SessionSpec& spec) const {
    return absl::OkStatus();
  }

  // Allocates `bytes` of block memory once at start-up.
  // RESOURCE_EXHAUSTED when the device cannot provide it.
  virtual absl::StatusOr<std::unique_ptr<DeviceArena>> AllocateArena(
      int64_t bytes) = 0;

  // Stores new keys and values into their blocks. INTERNAL on device
  // failure. REQUIRES: inputs validated by the caller.
  virtual absl::Status WriteKv(const KvWrite& write) = 0;

  // Copies `bytes` from block memory `src` to block memory `dst` (used for
  // copy-on-write). INTERNAL on device failure.
  virtual absl::Status CopyBlock(const std::byte* src, std::byte* dst,
                                 int64_t bytes) = 0;

  // Copies `bytes` of block memory at `src` to host memory at `dst` (reading
  // a session snapshot). INTERNAL on device failure.
  virtual absl::Status ReadBlock(const std::byte* src, std::byte* dst,
                                 int64_t bytes) = 0;

  // Computes every problem in the order documented in attention_problem.h.
  // The problems are independent and may run in parallel; their outputs must
  // not overlap. Returns INVALID_ARGUMENT when a visible logit overflows,
  // (policy kError) a row sees no key, or (top-k problems) an index score is
  // not finite, naming the row (and head, or key), and the problem's index
  // when the call holds several (the first failing one,
  // attention_problem.h); RESOURCE_EXHAUSTED
  // when the call needs more scratch memory than the backend reserved;
  // INTERNAL on a device failure that concerns this call only; UNAVAILABLE
  // once the device has failed for good (see failure()). On error the
  // outputs are unspecified.
  // REQUIRES: shapes, dtypes, finiteness and mask parameters validated.
  virtual absl::Status Attend(absl::Span<const AttentionProblem> problems) = 0;

  // As Attend, with one status per problem: statuses[p] (statuses.size() ==
  // problems.size()) is what Attend of problem p alone would return, and
  // every problem whose status is OK has its outputs in full, whatever the
  // others' errors (a batch of independent decode steps fails only the
  // offending ones). The default runs Attend over all of them and, when
  // that fails and failure() is OK, each one alone; a backend that can
  // tell its problems' errors apart in one run overrides it.
  virtual void AttendEach(absl::Span<const AttentionProblem> problems,
                          absl::Span<absl::Status> statuses);

  // How many KV chunks (kKeysPerSplit keys of one KV head) Attend has read
  // once for several decode steps whose sessions share those blocks (forks
  // of one prompt), since construction. 0 for a backend that never shares.
  // Thread-safe.
  virtual int64_t shared_chunk_computations() const { return 0; }

  // OK while the backend can serve. After a fault that leaves its device
  // unusable for the rest of the process (a sticky CUDA error such as an
  // illegal address), the UNAVAILABLE status of that fault, for good: every
  // later call fails with UNAVAILABLE without touching the device, and the
  // process must be restarted (the server reports NOT_SERVING). Thread-safe.
  virtual absl::Status failure() const { return absl::OkStatus(); }

  // Bytes of device memory the backend reserved at start-up for per-call
  // scratch, outside the KV arenas (0 when it needs none). Thread-safe.
  virtual int64_t scratch_bytes() const { return 0; }
};

}  // namespace attention

#endif  // ATTENTION_CORE_BACKEND_H_
