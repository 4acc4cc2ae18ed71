// Bulk element kernels behind dtype.h's conversions and checks: a portable
// path and, on x86-64 CPUs with AVX2 and F16C, a vector path chosen at run
// time. Both give bitwise the same results (F16C rounds to nearest even,
// like FloatToHalf), which tests/core/dtype_test.cc checks.
//
// Internal to attention_dtype; exposed so that tests can compare the paths.
// Every function is thread-safe and takes unaligned pointers.
#ifndef ATTENTION_CORE_DTYPE_KERNELS_H_
#define ATTENTION_CORE_DTYPE_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace attention::dtype_internal {

struct DTypeKernels {
  const char* name;
  // `count` float16 values at `src` to float32 (exact).
  void (*half_to_float)(const std::byte* src, int64_t count, float* dst);
  // `count` float32 values to float16, rounding to nearest even (overflow
  // becomes inf, NaN stays NaN).
  void (*float_to_half)(const float* src, int64_t count, std::byte* dst);
  // Index of the first NaN or infinite element of `dtype` at `src`, or -1.
  int64_t (*first_non_finite)(DType dtype, const std::byte* src, int64_t count);
  // Index of the first finite float32 at `src` that becomes infinite when
  // rounded to `target` (float16 or bfloat16), or -1.
  int64_t (*first_overflow)(const std::byte* src, int64_t count, DType target);
};

// The portable reference path.
const DTypeKernels& PortableKernels();

// The AVX2+F16C path, or nullptr when it was not compiled in or this CPU
// (or OS) lacks it.
const DTypeKernels* Avx2Kernels();

// The path dtype.h uses: AVX2 when available, unless ATTN_CPU_ISA=scalar
// asks for the portable path (read once).
const DTypeKernels& ActiveKernels();

}  // namespace attention::dtype_internal

#endif  // ATTENTION_CORE_DTYPE_KERNELS_H_
