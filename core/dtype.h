// Element types of tensors and KV storage, and conversions to and from
// float32. Conversions round to nearest even, like hardware F16C / bf16
// instructions, so every backend stores bitwise the same values.
#ifndef ATTENTION_CORE_DTYPE_H_
#define ATTENTION_CORE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace attention {

enum class DType : uint8_t {
  kFloat32 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
};

// Bytes per element: 4 or 2.
constexpr int64_t DTypeSize(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : 2;
}

// "float32", "float16" or "bfloat16".
absl::string_view DTypeName(DType dtype);

// Inverse of DTypeName; also accepts "fp32", "fp16", "bf16".
// INVALID_ARGUMENT for any other name.
absl::StatusOr<DType> ParseDType(absl::string_view name);

// Scalar conversions. Half/bfloat16 values travel as their raw bits.
float HalfToFloat(uint16_t bits);
uint16_t FloatToHalf(float value);  // round to nearest even; overflow -> inf
float BFloat16ToFloat(uint16_t bits);
uint16_t FloatToBFloat16(float value);  // round to nearest even

// Converts `count` elements of `dtype` at `src` (unaligned allowed) to float.
void ConvertToFloat(DType dtype, const std::byte* src, int64_t count,
                    float* dst);

// Converts `count` floats to `dtype` at `dst` (unaligned allowed).
// REQUIRES: every value is representable (see CheckRepresentable), otherwise
// out-of-range values become +-inf.
void ConvertFromFloat(const float* src, int64_t count, DType dtype,
                      std::byte* dst);

// Converts between any two dtypes (a plain copy when they are equal).
void ConvertDType(DType src_dtype, const std::byte* src, int64_t count,
                  DType dst_dtype, std::byte* dst);

// OK when every one of the `count` elements of `dtype` at `src` is finite.
// Otherwise INVALID_ARGUMENT naming `what` and the first bad element index.
absl::Status CheckFinite(DType dtype, const std::byte* src, int64_t count,
                         absl::string_view what);

// OK when every finite element of `src` stays finite after rounding to
// `target`; INVALID_ARGUMENT naming `what` otherwise (e.g. 1e5 in float16).
absl::Status CheckRepresentable(DType dtype, const std::byte* src,
                                int64_t count, DType target,
                                absl::string_view what);

// CheckRepresentable(kFloat32, src, count, dtype, what) and then
// ConvertFromFloat(src, count, dtype, dst), in one pass over `src`. On
// INVALID_ARGUMENT (the same status CheckRepresentable gives) `dst` holds
// an unspecified part of the conversion.
absl::Status ConvertFromFloatChecked(const float* src, int64_t count,
                                     DType dtype, std::byte* dst,
                                     absl::string_view what);

}  // namespace attention

#endif  // ATTENTION_CORE_DTYPE_H_
