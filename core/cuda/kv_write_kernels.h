// Host-side entry point of the kernel that stores new keys and values into
// paged KV blocks on the GPU (kv_write_kernels.cu).
#ifndef ATTENTION_CORE_CUDA_KV_WRITE_KERNELS_H_
#define ATTENTION_CORE_CUDA_KV_WRITE_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attention {
namespace cuda {

// Rows [start, start + num_tokens) of a paged layer. All pointers are
// device addresses.
struct KvWriteParams {
  const void* k = nullptr;  // [T][H_kv][head_dim] in k_dtype
  const void* v = nullptr;  // [T][H_kv][value_dim] in v_dtype
  int32_t k_dtype = 1;
  int32_t v_dtype = 1;
  int32_t kv_dtype = 1;  // storage dtype of the blocks
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t value_dim = 0;
  int64_t start = 0;
  int64_t num_tokens = 0;
  int64_t tokens_per_block = 0;
  int64_t value_offset_bytes = 0;
  // Base address of logical blocks first_block, first_block + 1, ...
  char* const* blocks = nullptr;
  int64_t first_block = 0;
};

// Converts (round to nearest even, like the host conversions) and stores
// every element: keys at [h][row][d], values at value_offset + [h][row][d].
cudaError_t LaunchWriteKv(const KvWriteParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_KV_WRITE_KERNELS_H_
