#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "bench/gpu/fill_kernels.h"

namespace attention {
namespace bench {
namespace {

__device__ __forceinline__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void FillKernel(__nv_bfloat16* dst, int64_t count, uint64_t seed) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint64_t bits = SplitMix64(seed ^ static_cast<uint64_t>(i));
    const float unit = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);
    dst[i] = __float2bfloat16_rn(4.0f * unit - 2.0f);
  }
}

}  // namespace

cudaError_t FillRandomBf16(void* dst, int64_t count, uint64_t seed,
                           cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  FillKernel<<<4096, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), count,
                                       seed);
  return cudaGetLastError();
}

}  // namespace bench
}  // namespace attention
