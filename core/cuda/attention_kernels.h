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
// problem itself (KV dtype, dims, q dtype) and the device, never on the
// batch, so a row's arithmetic is the same in every call.
enum class KernelVariant : int {
  kMmaF16 = 0,        // tensor cores, fp16 KV, q exact in fp16
  kMmaF16SplitQ = 1,  // tensor cores, fp16 KV, q = hi + lo
  kMmaBF16 = 2,
  kMmaBF16SplitQ = 3,
  kSimtF32 = 4,  // CUDA cores, fp32 arithmetic throughout
  kSimtF16 = 5,
  kSimtBF16 = 6,
  // Tensor cores for dims above kMmaMaxDim (up to kMmaWideMaxDim): the same
  // arithmetic as kMma*, q kept in shared memory instead of registers.
  kMmaWideF16 = 7,
  kMmaWideF16SplitQ = 8,
  kMmaWideBF16 = 9,
  kMmaWideBF16SplitQ = 10,
};
inline constexpr int kNumKernelVariants = 11;

inline bool IsMmaVariant(KernelVariant v) {
  return v != KernelVariant::kSimtF32 && v != KernelVariant::kSimtF16 &&
         v != KernelVariant::kSimtBF16;
}

// Largest head_dim / value_dim of the wide tensor-core kernel (Gemma's 256;
// kMmaMaxDim in kernel_params.h is the narrow kernel's).
inline constexpr int kMmaWideMaxDim = 256;

// The tensor-core variant for a 16-bit KV dtype (bf16 or fp16), q split
// into hi + lo or not, and the problem's dims (multiples of 8, at most
// kMmaWideMaxDim): narrow when both dims are at most kMmaMaxDim, else wide.
KernelVariant MmaVariantFor(bool bf16, bool split_q, int head_dim,
                            int value_dim);

// Dynamic shared memory a device grants one block by default on the
// devices this project targets (H100/H200: 227 KiB, opt-in).
inline constexpr int64_t kDefaultMaxSharedBytes = 227 * 1024;

// Warps (1, 2 or 4) of a tensor-core block serving a (problem, KV head)
// with `rows_per_head` rows: enough warps of 16 rows for the rows, at most
// 4, and no more than fit in `max_shared_bytes` even in full mode; 0 when
// not even one warp fits (the problem then runs on the SIMT kernel). A
// row's result does not depend on the warps of its block.
int MmaWarpsFor(KernelVariant variant, int64_t rows_per_head,
                int64_t max_shared_bytes);

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

// Raises the kernels' dynamic shared memory limits (to what the largest
// launch needs, capped at the current device's opt-in limit, which
// MmaWarpsFor must then be given) and checks that this binary has code for
// the current device. Call once per device.
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
