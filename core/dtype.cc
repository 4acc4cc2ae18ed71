#include "core/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/dtype_kernels.h"

namespace attention {
namespace {

uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

float BitsToFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

uint16_t LoadU16(const std::byte* src) {
  uint16_t bits;
  std::memcpy(&bits, src, sizeof(bits));
  return bits;
}

void StoreU16(uint16_t bits, std::byte* dst) {
  std::memcpy(dst, &bits, sizeof(bits));
}

float LoadElement(DType dtype, const std::byte* src, int64_t index) {
  switch (dtype) {
    case DType::kFloat32: {
      float value;
      std::memcpy(&value, src + index * 4, sizeof(value));
      return value;
    }
    case DType::kFloat16:
      return HalfToFloat(LoadU16(src + index * 2));
    case DType::kBFloat16:
      return BFloat16ToFloat(LoadU16(src + index * 2));
  }
  return 0.0f;
}

// Largest finite magnitude of each type, for error messages.
absl::string_view MaxMagnitudeText(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "3.4028235e38";
    case DType::kFloat16:
      return "65504";
    case DType::kBFloat16:
      return "3.3895314e38";
  }
  return "?";
}

}  // namespace

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "float32" || name == "fp32") return DType::kFloat32;
  if (name == "float16" || name == "fp16") return DType::kFloat16;
  if (name == "bfloat16" || name == "bf16") return DType::kBFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name,
                   "'; use float32 (fp32), float16 (fp16) or bfloat16 (bf16)"));
}

float HalfToFloat(uint16_t bits) {
  // Branch-free widening (so bulk conversion vectorises): shift the
  // exponent and mantissa into float position and rescale by 2^-112, or,
  // for subnormals, build 0.5 + m * 2^-24 and subtract 0.5; both are exact.
  const uint32_t w = static_cast<uint32_t>(bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized =
      BitsToFloat((two_w >> 4) + (0xe0u << 23)) * 0x1p-112f;
  const float denormalized = BitsToFloat((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude =
      two_w < (1u << 27) ? FloatBits(denormalized) : FloatBits(normalized);
  return BitsToFloat(sign | magnitude);
}

uint16_t FloatToHalf(float value) {
  uint32_t x = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) {
    if (x == 0x7f800000u) return sign | 0x7c00u;  // inf
    // NaN: keep the top payload bits and force a quiet NaN.
    return sign | 0x7e00u | static_cast<uint16_t>((x >> 13) & 0x3ffu);
  }
  // 65520 is halfway between 65504 (odd mantissa) and 65536: ties to even
  // rounds it, and everything above, to infinity.
  if (x >= 0x477ff000u) return sign | 0x7c00u;
  if (x < 0x38800000u) {
    // Below the smallest normal half (2^-14): the result is subnormal. Values
    // up to 2^-25 (the halfway point to the smallest subnormal) round to 0.
    if (x <= 0x33000000u) return sign;
    const uint32_t exponent = x >> 23;  // 102..112
    const uint32_t mantissa = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exponent;  // 14..24
    uint32_t result = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (remainder > half || (remainder == half && (result & 1u))) ++result;
    // A carry into bit 10 yields the smallest normal, which is correct.
    return sign | static_cast<uint16_t>(result);
  }
  // Normal: rebias the exponent from 127 to 15, then round the 13 dropped
  // mantissa bits to nearest even. A mantissa carry bumps the exponent.
  x -= 112u << 23;
  x += 0xfffu + ((x >> 13) & 1u);
  return sign | static_cast<uint16_t>(x >> 13);
}

float BFloat16ToFloat(uint16_t bits) {
  return BitsToFloat(static_cast<uint32_t>(bits) << 16);
}

uint16_t FloatToBFloat16(float value) {
  const uint32_t x = FloatBits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    // NaN: truncate and force the quiet bit so it cannot become inf.
    return static_cast<uint16_t>((x >> 16) | 0x40u);
  }
  // Round to nearest even; overflow carries into the exponent and yields inf.
  const uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

void ConvertToFloat(DType dtype, const std::byte* src, int64_t count,
                    float* dst) {
  switch (dtype) {
    case DType::kFloat32:
      // memcpy needs non-null pointers even for zero bytes.
      if (count > 0) {
        std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(float));
      }
      return;
    case DType::kFloat16:
      dtype_internal::ActiveKernels().half_to_float(src, count, dst);
      return;
    case DType::kBFloat16: {
      // Blocks of 16 with a tail: a shape the compiler vectorises.
      int64_t i = 0;
      for (; i + 16 <= count; i += 16) {
#pragma GCC unroll 16
        for (int l = 0; l < 16; ++l) {
          dst[i + l] = BFloat16ToFloat(LoadU16(src + 2 * (i + l)));
        }
      }
      for (; i < count; ++i) dst[i] = BFloat16ToFloat(LoadU16(src + 2 * i));
      return;
    }
  }
}

void ConvertFromFloat(const float* src, int64_t count, DType dtype,
                      std::byte* dst) {
  switch (dtype) {
    case DType::kFloat32:
      // memcpy needs non-null pointers even for zero bytes.
      if (count > 0) {
        std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(float));
      }
      return;
    case DType::kFloat16:
      dtype_internal::ActiveKernels().float_to_half(src, count, dst);
      return;
    case DType::kBFloat16:
      for (int64_t i = 0; i < count; ++i) {
        StoreU16(FloatToBFloat16(src[i]), dst + 2 * i);
      }
      return;
  }
}

void ConvertDType(DType src_dtype, const std::byte* src, int64_t count,
                  DType dst_dtype, std::byte* dst) {
  if (src_dtype == dst_dtype) {
    if (count > 0) {
      std::memcpy(dst, src, static_cast<size_t>(count * DTypeSize(src_dtype)));
    }
    return;
  }
  // Through an aligned float buffer in small batches (widening is exact).
  constexpr int64_t kBatch = 256;
  float buffer[kBatch];
  for (int64_t begin = 0; begin < count; begin += kBatch) {
    const int64_t n = count - begin < kBatch ? count - begin : kBatch;
    ConvertToFloat(src_dtype, src + begin * DTypeSize(src_dtype), n, buffer);
    ConvertFromFloat(buffer, n, dst_dtype, dst + begin * DTypeSize(dst_dtype));
  }
}

absl::Status CheckFinite(DType dtype, const std::byte* src, int64_t count,
                         absl::string_view what) {
  const int64_t bad =
      dtype_internal::ActiveKernels().first_non_finite(dtype, src, count);
  if (bad < 0) return absl::OkStatus();
  const float value = LoadElement(dtype, src, bad);
  return absl::InvalidArgumentError(absl::StrCat(
      what, " must be finite, but element ", bad, " (flat index) is ",
      std::isnan(value) ? "NaN" : (value > 0 ? "+inf" : "-inf"),
      "; send only finite values"));
}

namespace {

// Index of the first finite element of `src` that becomes infinite when
// rounded to `target`, or -1.
int64_t FirstUnrepresentable(DType dtype, const std::byte* src, int64_t count,
                             DType target) {
  // Widening conversions always fit: float16's range lies inside
  // bfloat16's and float32's.
  if (target == dtype || target == DType::kFloat32 ||
      (dtype == DType::kFloat16 && target == DType::kBFloat16)) {
    return -1;
  }
  const dtype_internal::DTypeKernels& kernels = dtype_internal::ActiveKernels();
  if (dtype == DType::kFloat32) {
    return kernels.first_overflow(src, count, target);
  }
  // bfloat16 -> float16: widen in small batches, then check the floats.
  constexpr int64_t kBatch = 256;
  float buffer[kBatch];
  for (int64_t begin = 0; begin < count; begin += kBatch) {
    const int64_t n = count - begin < kBatch ? count - begin : kBatch;
    ConvertToFloat(dtype, src + begin * DTypeSize(dtype), n, buffer);
    const int64_t in_batch = kernels.first_overflow(
        reinterpret_cast<const std::byte*>(buffer), n, target);
    if (in_batch >= 0) return begin + in_batch;
  }
  return -1;
}

absl::Status UnrepresentableError(DType dtype, const std::byte* src,
                                  int64_t bad, DType target,
                                  absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(
      what, " element ", bad, " (flat index) = ", LoadElement(dtype, src, bad),
      " overflows ", DTypeName(target), " (largest finite magnitude ",
      MaxMagnitudeText(target), "); rescale the values or use a wider dtype"));
}

}  // namespace

absl::Status CheckRepresentable(DType dtype, const std::byte* src,
                                int64_t count, DType target,
                                absl::string_view what) {
  const int64_t bad = FirstUnrepresentable(dtype, src, count, target);
  if (bad < 0) return absl::OkStatus();
  return UnrepresentableError(dtype, src, bad, target, what);
}

absl::Status ConvertFromFloatChecked(const float* src, int64_t count,
                                     DType dtype, std::byte* dst,
                                     absl::string_view what) {
  // Chunks small enough that the conversion reads what the check just
  // brought into the L1 cache.
  constexpr int64_t kChunk = 1024;
  const auto* bytes = reinterpret_cast<const std::byte*>(src);
  for (int64_t begin = 0; begin < count; begin += kChunk) {
    const int64_t n = std::min(kChunk, count - begin);
    const int64_t bad = FirstUnrepresentable(
        DType::kFloat32, bytes + sizeof(float) * begin, n, dtype);
    if (bad >= 0) {
      return UnrepresentableError(DType::kFloat32, bytes, begin + bad, dtype,
                                  what);
    }
    ConvertFromFloat(src + begin, n, dtype, dst + begin * DTypeSize(dtype));
  }
  return absl::OkStatus();
}

}  // namespace attention
