// Device-side helpers of the GPU benchmark: fill memory with random bf16
// values without a round trip through the host.
#ifndef ATTENTION_BENCH_GPU_FILL_KERNELS_H_
#define ATTENTION_BENCH_GPU_FILL_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attention {
namespace bench {

// Writes `count` bf16 values, uniform in [-2, 2), derived from `seed`.
cudaError_t FillRandomBf16(void* dst, int64_t count, uint64_t seed,
                           cudaStream_t stream);

}  // namespace bench
}  // namespace attention

#endif  // ATTENTION_BENCH_GPU_FILL_KERNELS_H_
