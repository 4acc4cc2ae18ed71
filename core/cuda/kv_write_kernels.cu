#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "core/cuda/kernel_params.h"
#include "core/cuda/kv_write_kernels.h"

namespace attention {
namespace cuda {
namespace {

__device__ __forceinline__ float Load(int32_t dtype, const void* base,
                                      int64_t index) {
  if (dtype == kF32) return static_cast<const float*>(base)[index];
  const unsigned short bits = static_cast<const unsigned short*>(base)[index];
  if (dtype == kF16) return __half2float(__ushort_as_half(bits));
  return __bfloat162float(__ushort_as_bfloat16(bits));
}

__device__ __forceinline__ void Store(int32_t dtype, char* dst, float value) {
  if (dtype == kF32) {
    *reinterpret_cast<float*>(dst) = value;
  } else if (dtype == kF16) {
    *reinterpret_cast<unsigned short*>(dst) =
        __half_as_ushort(__float2half_rn(value));
  } else {
    *reinterpret_cast<unsigned short*>(dst) =
        __bfloat16_as_ushort(__float2bfloat16_rn(value));
  }
}

// One thread per element, grid-stride; elements of a token are its keys
// [H_kv][head_dim] followed by its values [H_kv][value_dim].
__global__ void WriteKvKernel(KvWriteParams p) {
  const int64_t key_elems = int64_t{p.num_kv_heads} * p.head_dim;
  const int64_t per_token = key_elems + int64_t{p.num_kv_heads} * p.value_dim;
  const int64_t total = per_token * p.num_tokens;
  const int64_t element_size = p.kv_dtype == kF32 ? 4 : 2;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / per_token;
    int64_t rem = i - t * per_token;
    const int64_t pos = p.start + t;
    const int64_t block = pos / p.tokens_per_block;
    const int64_t row = pos - block * p.tokens_per_block;
    char* base = p.blocks[block - p.first_block];
    if (rem < key_elems) {
      const int64_t h = rem / p.head_dim;
      const int64_t d = rem - h * p.head_dim;
      const float x = Load(p.k_dtype, p.k, t * key_elems + rem);
      Store(p.kv_dtype,
            base + ((h * p.tokens_per_block + row) * p.head_dim + d) *
                       element_size,
            x);
    } else {
      rem -= key_elems;
      const int64_t h = rem / p.value_dim;
      const int64_t d = rem - h * p.value_dim;
      const float x =
          Load(p.v_dtype, p.v, t * int64_t{p.num_kv_heads} * p.value_dim + rem);
      Store(p.kv_dtype,
            base + p.value_offset_bytes +
                (((h * p.tokens_per_block + row) * p.value_dim + d) *
                 element_size),
            x);
    }
  }
}

}  // namespace

cudaError_t LaunchWriteKv(const KvWriteParams& params, cudaStream_t stream) {
  const int64_t total = params.num_tokens * params.num_kv_heads *
                        (int64_t{params.head_dim} + params.value_dim);
  if (total <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  int64_t blocks = (total + kThreads - 1) / kThreads;
  if (blocks > 65535) blocks = 65535;
  WriteKvKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace attention
