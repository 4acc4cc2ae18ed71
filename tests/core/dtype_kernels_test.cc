#include "core/dtype_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "gtest/gtest.h"

namespace attention::dtype_internal {
namespace {

float FromBits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

const std::byte* Bytes(const void* data) {
  return static_cast<const std::byte*>(data);
}

// The paths to check: the portable one always, AVX2 where this CPU has it.
std::vector<const DTypeKernels*> AllPaths() {
  std::vector<const DTypeKernels*> paths = {&PortableKernels()};
  if (Avx2Kernels() != nullptr) paths.push_back(Avx2Kernels());
  return paths;
}

// Float bit patterns to convert: a prime stride over all 2^32 (so every
// exponent and many mantissas), plus every pattern in the windows where
// float16 rounding changes behaviour (overflow, the subnormal range, the
// normal/subnormal boundary), both signs.
std::vector<uint32_t> InterestingFloatBits() {
  std::vector<uint32_t> bits;
  for (uint64_t b = 0; b <= 0xffffffffu; b += 4099) {
    bits.push_back(static_cast<uint32_t>(b));
  }
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t b = 0x477fe000u; b <= 0x47801000u; ++b) {
      bits.push_back(sign | b);
    }
    for (uint32_t b = 0x32ff0000u; b <= 0x38810000u; b += 13) {
      bits.push_back(sign | b);
    }
    for (uint32_t b = 0x387f0000u; b <= 0x38810000u; ++b) {
      bits.push_back(sign | b);
    }
    for (uint32_t b = 0x7f7f0000u; b <= 0x7fc10000u; b += 7) {
      bits.push_back(sign | b);  // bfloat16 overflow, inf, NaNs
    }
  }
  return bits;
}

TEST(DTypeKernelsTest, ActivePathIsOneOfThePaths) {
  const DTypeKernels& active = ActiveKernels();
  EXPECT_TRUE(&active == &PortableKernels() || &active == Avx2Kernels())
      << active.name;
}

TEST(DTypeKernelsTest, FloatToHalfMatchesScalarRounding) {
  const std::vector<uint32_t> bits = InterestingFloatBits();
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) values[i] = FromBits(bits[i]);
  for (const DTypeKernels* path : AllPaths()) {
    std::vector<uint16_t> out(values.size() + 1);
    // Odd byte offset: unaligned output must work.
    std::vector<std::byte> storage(2 * values.size() + 1);
    path->float_to_half(values.data(), static_cast<int64_t>(values.size()),
                        storage.data() + 1);
    std::memcpy(out.data(), storage.data() + 1, 2 * values.size());
    int64_t mismatches = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t want = FloatToHalf(values[i]);
      if (out[i] != want && ++mismatches <= 5) {
        ADD_FAILURE() << path->name << ": float bits 0x" << std::hex << bits[i]
                      << " -> 0x" << out[i] << ", want 0x" << want;
      }
    }
    EXPECT_EQ(mismatches, 0) << path->name;
  }
}

TEST(DTypeKernelsTest, HalfToFloatIsExactForEveryHalf) {
  std::vector<uint16_t> halves(65536 + 3);
  for (uint32_t h = 0; h < 65536; ++h) halves[h] = static_cast<uint16_t>(h);
  for (const DTypeKernels* path : AllPaths()) {
    std::vector<float> out(halves.size());
    path->half_to_float(Bytes(halves.data()),
                        static_cast<int64_t>(halves.size()), out.data());
    for (uint32_t h = 0; h < 65536; ++h) {
      const float want = HalfToFloat(static_cast<uint16_t>(h));
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(out[h])) << path->name << " half 0x" << h;
        // The payload survives the widening (the NaN may become quiet).
        ASSERT_EQ(FloatToHalf(out[h]), h | 0x0200u) << path->name;
      } else {
        ASSERT_EQ(out[h], want) << path->name << " half 0x" << std::hex << h;
      }
    }
  }
}

// A finite element of each dtype, and the ways of not being finite.
std::vector<std::byte> Encode(DType dtype, const std::vector<float>& values) {
  std::vector<std::byte> bytes(values.size() * DTypeSize(dtype));
  ConvertFromFloat(values.data(), static_cast<int64_t>(values.size()), dtype,
                   bytes.data());
  return bytes;
}

TEST(DTypeKernelsTest, FirstNonFiniteFindsTheFirstBadElementAnywhere) {
  const float bad_values[] = {std::nanf(""), INFINITY, -INFINITY};
  for (const DTypeKernels* path : AllPaths()) {
    for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      for (int64_t length : {0, 1, 7, 8, 15, 16, 17, 33, 70}) {
        std::vector<float> values(length, 0.5f);
        // The largest finite values are finite.
        if (length > 2) values[1] = dtype == DType::kFloat16 ? 65504.0f : 3e38f;
        if (dtype == DType::kFloat32 && length > 2) values[1] = 3.4e38f;
        if (dtype == DType::kBFloat16 && length > 2) values[1] = 3.38e38f;
        std::vector<std::byte> clean = Encode(dtype, values);
        EXPECT_EQ(path->first_non_finite(dtype, clean.data(), length), -1)
            << path->name << " " << DTypeName(dtype) << " length " << length;
        for (int64_t at = 0; at < length; ++at) {
          for (float bad : bad_values) {
            std::vector<float> dirty = values;
            dirty[at] = bad;
            if (at + 3 < length) dirty[at + 3] = bad;  // only the first counts
            std::vector<std::byte> bytes = Encode(dtype, dirty);
            ASSERT_EQ(path->first_non_finite(dtype, bytes.data(), length), at)
                << path->name << " " << DTypeName(dtype) << " length " << length
                << " bad " << bad;
          }
        }
      }
    }
  }
}

// The definition: a finite float overflows `target` when rounding it there
// gives an infinity.
bool Overflows(float value, DType target) {
  if (!std::isfinite(value)) return false;
  const float rounded = target == DType::kFloat16
                            ? HalfToFloat(FloatToHalf(value))
                            : BFloat16ToFloat(FloatToBFloat16(value));
  return std::isinf(rounded);
}

TEST(DTypeKernelsTest, FirstOverflowMatchesRoundingToTheTarget) {
  const std::vector<uint32_t> bits = InterestingFloatBits();
  for (const DTypeKernels* path : AllPaths()) {
    for (DType target : {DType::kFloat16, DType::kBFloat16}) {
      // Element by element in windows of 40 (vector body plus tail): the
      // first overflow of each window.
      int64_t overflowing = 0;
      for (size_t begin = 0; begin < bits.size(); begin += 40) {
        const size_t n = std::min<size_t>(40, bits.size() - begin);
        int64_t want = -1;
        for (size_t i = 0; i < n && want < 0; ++i) {
          if (Overflows(FromBits(bits[begin + i]), target)) want = i;
        }
        overflowing += want >= 0;
        ASSERT_EQ(path->first_overflow(Bytes(bits.data() + begin),
                                       static_cast<int64_t>(n), target),
                  want)
            << path->name << " -> " << DTypeName(target) << " at bits 0x"
            << std::hex << bits[begin];
      }
      EXPECT_GT(overflowing, 0);  // the windows did cover overflows
    }
  }
}

TEST(DTypeKernelsTest, FirstOverflowEdges) {
  for (const DTypeKernels* path : AllPaths()) {
    const float half_edge[] = {65504.0f, 65519.996f,    -65519.0f,
                               INFINITY, std::nanf(""), 65520.0f};
    EXPECT_EQ(path->first_overflow(Bytes(half_edge), 6, DType::kFloat16), 5)
        << path->name;
    EXPECT_EQ(path->first_overflow(Bytes(half_edge), 5, DType::kFloat16), -1)
        << path->name;
    EXPECT_EQ(path->first_overflow(Bytes(half_edge), 6, DType::kBFloat16), -1)
        << path->name;
    const float bf16_edge[] = {3.38e38f, -3.3895314e38f, FromBits(0x7f7f7fffu),
                               FromBits(0xff7f8000u)};
    EXPECT_EQ(path->first_overflow(Bytes(bf16_edge), 4, DType::kBFloat16), 3)
        << path->name;
    EXPECT_EQ(path->first_overflow(Bytes(bf16_edge), 4, DType::kFloat32), -1)
        << path->name;
  }
}

}  // namespace
}  // namespace attention::dtype_internal
