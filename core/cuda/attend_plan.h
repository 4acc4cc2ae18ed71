// AttendPlan: how one CudaBackend::Attend call runs on the GPU.
//
// Create() classifies each problem (tensor-core or SIMT kernel, KV already in
// GPU memory or to be uploaded), cuts it into work items (blocks of rows of
// one KV head; full mode or one item per split chunk plus a merge), and lays
// out a single device scratch buffer:
//   [upload: descriptors, block tables, raw q, bias, sinks, host KV]
//   [work:   prepared q, split chunk states, row max/sum]
//   [download: output, lse, weights, error record]
// whose upload and download parts are mirrored in one pinned host buffer
// ([upload][download]). One H2D copy, the kernels and one D2H copy then run
// on the caller's stream.
//
// Passes. The split chunk states of one pass are capped (Limits::
// max_state_bytes). When a call's states need more, its split row blocks are
// spread over several passes (attention launches, then merges) that reuse
// the same state memory, so every item of a split row block still covers
// one chunk and the cost of a batch grows smoothly with its size; only a
// row block whose own states exceed the cap walks its chunks itself (full
// mode).
//
// The choices depend only on each problem, except split-vs-full mode and
// passes, which never change a result (see attention_kernels.cu).
#ifndef ATTENTION_CORE_CUDA_ATTEND_PLAN_H_
#define ATTENTION_CORE_CUDA_ATTEND_PLAN_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/attention_problem.h"
#include "core/cuda/attention_kernels.h"
#include "core/cuda/kernel_params.h"

namespace attention {
namespace cuda {

// Split chunk states one pass holds by default.
inline constexpr int64_t kDefaultMaxStateBytes = int64_t{64} << 20;
// Most query heads a problem may have: errors name the head in 16 bits.
inline constexpr int64_t kMaxQueryHeads = (int64_t{1} << 16) - 1;

class AttendPlan {
 public:
  // True when [ptr, ptr + bytes) is GPU memory the kernels may read.
  using DeviceMemoryTest = std::function<bool(const void* ptr, int64_t bytes)>;

  // What one call may use.
  struct Limits {
    // Device scratch and pinned staging bytes (device_bytes(),
    // pinned_bytes()).
    int64_t device_bytes = std::numeric_limits<int64_t>::max();
    int64_t pinned_bytes = std::numeric_limits<int64_t>::max();
    // Split chunk states per pass; 0 runs every problem in full mode.
    int64_t max_state_bytes = kDefaultMaxStateBytes;
    // Dynamic shared memory per block (the device's opt-in limit): bounds
    // the warps of tensor-core blocks (MmaWarpsFor).
    int64_t max_shared_bytes = kDefaultMaxSharedBytes;
  };

  // INVALID_ARGUMENT for a problem this backend cannot serve (value_dim over
  // kSimtMaxValueDim, more than kMaxQueryHeads heads, a mix of host and
  // device KV blocks, too many rows); INTERNAL for a block table shorter
  // than the KV length it describes; RESOURCE_EXHAUSTED when the call needs
  // more scratch or staging memory than `limits` allow. The problems must
  // outlive the plan.
  static absl::StatusOr<AttendPlan> Create(
      absl::Span<const AttentionProblem> problems,
      const DeviceMemoryTest& is_device_memory, int num_sms,
      const Limits& limits);
  static absl::StatusOr<AttendPlan> Create(
      absl::Span<const AttentionProblem> problems,
      const DeviceMemoryTest& is_device_memory, int num_sms) {
    return Create(problems, is_device_memory, num_sms, Limits());
  }

  int64_t device_bytes() const { return download_offset_ + download_bytes_; }
  int64_t pinned_bytes() const { return pinned_download_ + download_bytes_; }

  // Writes the upload image into `pinned`, with every pointer it holds
  // aimed at the scratch buffer at `device_base`.
  void FillUpload(std::byte* pinned, std::byte* device_base) const;

  // Enqueues the upload, the kernels (between the two events when they are
  // not null) and the download on `stream`.
  absl::Status Enqueue(std::byte* pinned, std::byte* device_base,
                       cudaStream_t stream, cudaEvent_t kernels_start,
                       cudaEvent_t kernels_stop) const;

  // The work decomposition, for tests: every launch's variant and items, and
  // the split-mode merges; launch_passes()[l] is the pass of launches()[l],
  // merge_passes()[m] that of merge_items()[m].
  std::vector<std::pair<AttentionLaunch, std::vector<WorkItem>>> launches()
      const;
  const std::vector<MergeItem>& merge_items() const { return merge_items_; }
  std::vector<int> launch_passes() const;
  std::vector<int> merge_passes() const;
  int num_passes() const { return num_passes_; }

  // After the stream has finished: INVALID_ARGUMENT for an overflowing
  // logit or (policy kError) an empty row, naming the problem, row and
  // head; otherwise copies the results to the problems' outputs.
  absl::Status Collect(const std::byte* pinned) const;

 private:
  // A block of host KV memory copied to the scratch buffer.
  struct HostCopy {
    const std::byte* source = nullptr;
    int64_t bytes = 0;
    int64_t offset = 0;  // in the scratch buffer (upload part)
  };

  struct Planned {
    const AttentionProblem* problem = nullptr;
    KernelVariant variant = KernelVariant::kSimtF32;
    bool mma = false;
    bool split_q = false;
    bool kv_on_device = false;
    int32_t group_size = 1;
    int32_t q_stride = 0;
    int64_t num_blocks = 0;
    // Scratch offsets (-1 = absent).
    int64_t q_raw = -1, k_table = -1, v_table = -1, sinks = -1, bias = -1;
    int64_t q_f32 = -1, q_hi = -1, q_lo = -1, q_exponent = -1;
    int64_t row_max = -1, row_sum = -1;
    int64_t output = -1, lse = -1, weights = -1;
    std::vector<HostCopy> k_copies;  // per logical block (bytes 0 = none)
    std::vector<HostCopy> v_copies;
  };

  struct Launch {
    AttentionLaunch launch;
    int pass = 0;
    std::vector<WorkItem> items;
    int64_t items_offset = 0;
  };

  // Cuts the problems into work items and launches (attend_plan.cc).
  class WorkPlanner;

  AttendPlan() = default;

  // Fills planned_[i] for `problem`: checks, KV placement, kernel variant.
  absl::Status Classify(int64_t i, const AttentionProblem& problem,
                        const DeviceMemoryTest& is_device_memory,
                        const Limits& limits);
  // Lays out the upload part of the scratch buffer, then the work and
  // download parts (with `max_pass_floats` of split chunk states).
  void LayoutUpload(absl::Span<const AttentionProblem> problems);
  void LayoutWorkAndDownload(absl::Span<const AttentionProblem> problems,
                             int64_t max_pass_floats);

  // Fills the problem descriptor of planned[i] for a scratch base.
  ProblemParams Params(int i, std::byte* device_base) const;

  std::vector<Planned> planned_;
  std::vector<Launch> launches_;
  std::vector<MergeItem> merge_items_;  // ordered by pass
  // merge_items_[merge_pass_begin_[p], merge_pass_begin_[p + 1]): pass p.
  std::vector<int64_t> merge_pass_begin_;
  int num_passes_ = 1;
  std::vector<int64_t> q_row_prefix_;
  std::vector<int32_t> weight_ids_;
  std::vector<int64_t> weight_row_prefix_;

  int64_t params_offset_ = 0;
  int64_t q_prefix_offset_ = 0;
  int64_t merge_offset_ = 0;
  int64_t weight_ids_offset_ = 0;
  int64_t weight_prefix_offset_ = 0;
  int64_t upload_bytes_ = 0;
  int64_t states_offset_ = 0;
  int64_t errors_offset_ = 0;
  int64_t download_offset_ = 0;  // start of the download part (scratch)
  int64_t download_bytes_ = 0;
  int64_t pinned_download_ = 0;  // start of the download part (pinned)
};

}  // namespace cuda
}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_ATTEND_PLAN_H_
