// Host-side entry points of the CUDA attention kernels (attention_kernels.cu).
//
// Every launch reads device-resident descriptors (kernel_params.h) and is
// asynchronous on the given stream; the returned cudaError_t reports launch
// failures only.
#ifndef ATTENTION_CORE_CUDA_ATTENTION_KERNELS_H_
#define ATTENTION_CORE_CUDA_ATTENTION_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/cuda/kernel_params.h"

namespace attention {
namespace cuda {

// Which attention kernel serves a problem. The choice depends only on the
// problem itself (KV dtype, dims, q dtype), never on the batch, so a row's
// arithmetic is the same in every call.
enum class KernelVariant : int {
  kMmaF16 = 0,        // tensor cores, fp16 KV, q exact in fp16
  kMmaF16SplitQ = 1,  // tensor cores, fp16 KV, q = hi + lo
  kMmaBF16 = 2,
  kMmaBF16SplitQ = 3,
  kSimtF32 = 4,  // CUDA cores, fp32 arithmetic throughout
  kSimtF16 = 5,
  kSimtBF16 = 6,
};
inline constexpr int kNumKernelVariants = 7;

inline bool IsMmaVariant(KernelVariant v) {
  return static_cast<int>(v) < static_cast<int>(KernelVariant::kSimtF32);
}

// Threads of a SIMT attention block.
inline constexpr int kSimtThreads = 128;
// Largest value_dim the SIMT kernel supports (its accumulators live in
// shared memory).
inline constexpr int kSimtMaxValueDim = 8192;

// Rows a SIMT block serves for a given value_dim (1..kSimtMaxRows).
int SimtRowsPerBlock(int value_dim);

// One launch of one kernel variant over `num_items` work items.
struct AttentionLaunch {
  KernelVariant variant = KernelVariant::kSimtF32;
  // MMA: 1, 2 or 4 warps (16 rows each). SIMT: ignored (kSimtThreads).
  int warps = 1;
  // SIMT: rows per block and the largest value_dim among the items.
  int simt_rows = 1;
  int max_value_dim = 1;
  // True when some item walks every chunk itself (needs row-state memory).
  bool full_mode = false;
  const WorkItem* items = nullptr;  // device
  int num_items = 0;
};

// Dynamic shared memory of a launch.
size_t AttentionSharedBytes(const AttentionLaunch& launch);

// Raises the kernels' dynamic shared memory limits and checks that this
// binary has code for the current device. Call once per device.
cudaError_t ConfigureAttentionKernels();

// Converts raw queries into the kernels' formats (q_f32, q_hi/q_lo/q_exponent).
// row_prefix[i] = rows (T * H) of problems before i; row_prefix[n] = total.
cudaError_t LaunchPrepareQueries(const ProblemParams* problems,
                                 const int64_t* row_prefix, int num_problems,
                                 int64_t total_rows, cudaStream_t stream);

cudaError_t LaunchAttention(const AttentionLaunch& launch,
                            const ProblemParams* problems, float* states,
                            ErrorRecord* errors, cudaStream_t stream);

cudaError_t LaunchMergeChunks(const MergeItem* items, int num_items,
                              const ProblemParams* problems,
                              const float* states, ErrorRecord* errors,
                              cudaStream_t stream);

// Softmax weights [H][T][T_k] of the listed problems, from the row max and
// denominator the attention pass stored. row_prefix as above, over
// `problem_ids` (rows = H * T).
cudaError_t LaunchWeights(const ProblemParams* problems,
                          const int32_t* problem_ids, const int64_t* row_prefix,
                          int num_ids, int64_t total_rows, cudaStream_t stream);

}  // namespace cuda
}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_ATTENTION_KERNELS_H_
