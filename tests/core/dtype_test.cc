#include "core/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();

uint32_t Bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return bits;
}

float FromBits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

bool IsHalfNan(uint16_t h) {
  return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
}

TEST(DTypeTest, NamesRoundTrip) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    absl::StatusOr<DType> parsed = ParseDType(DTypeName(dtype));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, dtype);
  }
  EXPECT_EQ(*ParseDType("fp32"), DType::kFloat32);
  EXPECT_EQ(*ParseDType("fp16"), DType::kFloat16);
  EXPECT_EQ(*ParseDType("bf16"), DType::kBFloat16);
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2);
  absl::StatusOr<DType> bad = ParseDType("int8");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("int8"));
}

TEST(DTypeTest, HalfKnownValues) {
  EXPECT_EQ(FloatToHalf(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(0x1p-14f), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToHalf(0x1p-24f), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(kInf), 0x7c00);
  EXPECT_EQ(FloatToHalf(-kInf), 0xfc00);
  EXPECT_TRUE(IsHalfNan(FloatToHalf(std::nanf(""))));
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(HalfToFloat(0xfc00), -kInf);
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));
  EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
}

TEST(DTypeTest, HalfOverflowAndUnderflowRoundToNearestEven) {
  // 65520 is exactly halfway between 65504 and 65536 (= inf): ties to even.
  EXPECT_EQ(FloatToHalf(65519.996f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-65520.0f), 0xfc00);
  EXPECT_EQ(FloatToHalf(1e10f), 0x7c00);
  // 2^-25 is halfway between 0 and the smallest subnormal: ties to 0.
  EXPECT_EQ(FloatToHalf(0x1p-25f), 0x0000);
  EXPECT_EQ(FloatToHalf(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(FloatToHalf(-0x1p-26f), 0x8000);
  EXPECT_EQ(FloatToHalf(1e-30f), 0x0000);
  // 3 * 2^-25 is halfway between subnormals 1 and 2: ties to 2.
  EXPECT_EQ(FloatToHalf(3 * 0x1p-25f), 0x0002);
  EXPECT_EQ(FloatToHalf(5 * 0x1p-25f), 0x0002);
}

TEST(DTypeTest, HalfRoundTripsEveryValue) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float x = HalfToFloat(bits);
    if (IsHalfNan(bits)) {
      EXPECT_TRUE(std::isnan(x));
      EXPECT_TRUE(IsHalfNan(FloatToHalf(x))) << h;
    } else {
      EXPECT_EQ(FloatToHalf(x), bits) << h;
    }
  }
}

// Every half decodes to the value its fields describe.
TEST(DTypeTest, HalfDecodesEveryValueExactly) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const int exponent = (h >> 10) & 0x1f;
    const int mantissa = h & 0x3ff;
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    const float x = HalfToFloat(static_cast<uint16_t>(h));
    if (exponent == 0x1f) {
      if (mantissa == 0) {
        EXPECT_EQ(x, sign * kInf) << h;
      } else {
        EXPECT_TRUE(std::isnan(x)) << h;
      }
      continue;
    }
    const double want = exponent == 0
                            ? sign * std::ldexp(mantissa, -24)
                            : sign * std::ldexp(1024 + mantissa, exponent - 25);
    EXPECT_EQ(static_cast<double>(x), want) << h;
    EXPECT_EQ(std::signbit(x), (h & 0x8000) != 0) << h;
  }
}

// Between every two adjacent finite halves a < b: the midpoint rounds to the
// one with an even mantissa, anything nearer to a side rounds to it.
TEST(DTypeTest, HalfRoundsToNearestEvenEverywhere) {
  for (uint16_t a = 0; a < 0x7bff; ++a) {
    const uint16_t b = a + 1;
    const float lo = HalfToFloat(a);
    const float hi = HalfToFloat(b);
    const float mid = (lo + hi) / 2;  // exact: 12 significant bits
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2);
    const uint16_t even = (a & 1) ? b : a;
    EXPECT_EQ(FloatToHalf(mid), even) << a;
    EXPECT_EQ(FloatToHalf(std::nextafter(mid, 0.0f)), a) << a;
    EXPECT_EQ(FloatToHalf(std::nextafter(mid, kInf)), b) << a;
    EXPECT_EQ(FloatToHalf(-mid), even | 0x8000) << a;
  }
}

#ifdef __FLT16_MAX__
// Where the compiler has a native _Float16, it must agree bit for bit.
TEST(DTypeTest, HalfMatchesCompilerFloat16) {
  for (uint64_t i = 0; i < (uint64_t{1} << 32); i += 4099) {
    const float x = FromBits(static_cast<uint32_t>(i));
    if (std::isnan(x)) continue;
    const _Float16 native = static_cast<_Float16>(x);
    uint16_t native_bits;
    std::memcpy(&native_bits, &native, 2);
    ASSERT_EQ(FloatToHalf(x), native_bits) << std::hexfloat << x;
    ASSERT_EQ(Bits(HalfToFloat(native_bits)), Bits(static_cast<float>(native)));
  }
}
#endif

TEST(DTypeTest, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(BFloat16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(FloatToBFloat16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBFloat16(kInf), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(-kInf), 0xff80);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);
  // A NaN whose payload lives only in the low bits must stay NaN.
  const uint16_t nan = FloatToBFloat16(FromBits(0x7f800001u));
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(nan)));
  // Subnormal floats round like any other value.
  EXPECT_EQ(FloatToBFloat16(FromBits(0x00008000u)), 0x0000);  // tie to even
  EXPECT_EQ(FloatToBFloat16(FromBits(0x00018000u)), 0x0002);  // tie to even
  EXPECT_EQ(FloatToBFloat16(FromBits(0x00008001u)), 0x0001);
  for (uint32_t a = 0; a < 0x7f7f; ++a) {
    const uint16_t lo_bits = static_cast<uint16_t>(a);
    const uint16_t hi_bits = static_cast<uint16_t>(a + 1);
    const float lo = BFloat16ToFloat(lo_bits);
    const float hi = BFloat16ToFloat(hi_bits);
    const float mid = FromBits((static_cast<uint32_t>(a) << 16) | 0x8000u);
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2);
    const uint16_t even = (a & 1) ? hi_bits : lo_bits;
    EXPECT_EQ(FloatToBFloat16(mid), even) << a;
    EXPECT_EQ(FloatToBFloat16(FromBits(Bits(mid) - 1)), lo_bits) << a;
    EXPECT_EQ(FloatToBFloat16(FromBits(Bits(mid) + 1)), hi_bits) << a;
  }
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float x = BFloat16ToFloat(static_cast<uint16_t>(h));
    if (!std::isnan(x)) {
      EXPECT_EQ(FloatToBFloat16(x), h);
    }
  }
}

TEST(DTypeTest, BulkConversionsMatchScalar) {
  const std::vector<float> values = {0.0f,    -1.5f, 3.14159f, 1e-6f,
                                     65504.f, 1e-9f, -123.456f};
  const int64_t n = static_cast<int64_t>(values.size());
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    // Odd offset: unaligned storage must work.
    std::vector<std::byte> storage(n * 4 + 1);
    std::byte* bytes = storage.data() + 1;
    ConvertFromFloat(values.data(), n, dtype, bytes);
    std::vector<float> back(n);
    ConvertToFloat(dtype, bytes, n, back.data());
    for (int64_t i = 0; i < n; ++i) {
      float want = values[i];
      if (dtype == DType::kFloat16) want = HalfToFloat(FloatToHalf(want));
      if (dtype == DType::kBFloat16) {
        want = BFloat16ToFloat(FloatToBFloat16(want));
      }
      EXPECT_EQ(back[i], want);
    }
    // Any dtype to any dtype agrees with going through float.
    for (DType target : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      std::vector<std::byte> out(n * 4 + 1);
      ConvertDType(dtype, bytes, n, target, out.data() + 1);
      std::vector<float> via_float(n);
      ConvertToFloat(target, out.data() + 1, n, via_float.data());
      std::vector<std::byte> expected(n * 4);
      ConvertFromFloat(back.data(), n, target, expected.data());
      EXPECT_EQ(
          std::memcmp(out.data() + 1, expected.data(), n * DTypeSize(target)),
          0)
          << DTypeName(dtype) << " -> " << DTypeName(target);
    }
  }
}

TEST(DTypeTest, CheckFiniteNamesTheFirstBadElement) {
  std::vector<float> values = {1.0f, 2.0f, std::nanf(""), kInf};
  const auto* bytes = reinterpret_cast<const std::byte*>(values.data());
  EXPECT_TRUE(CheckFinite(DType::kFloat32, bytes, 2, "q").ok());
  absl::Status status = CheckFinite(DType::kFloat32, bytes, 4, "q");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("q"));
  EXPECT_THAT(status.message(), HasSubstr("element 2"));
  EXPECT_THAT(status.message(), HasSubstr("NaN"));

  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    std::vector<std::byte> half(8);
    ConvertFromFloat(values.data(), 4, dtype, half.data());
    absl::Status s = CheckFinite(dtype, half.data() + 2, 3, "k");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("element 1"));
    EXPECT_TRUE(CheckFinite(dtype, half.data(), 2, "k").ok());
  }
  std::vector<float> minus_inf = {-kInf};
  absl::Status s = CheckFinite(
      DType::kFloat32, reinterpret_cast<const std::byte*>(minus_inf.data()), 1,
      "bias");
  EXPECT_THAT(s.message(), HasSubstr("-inf"));
}

TEST(DTypeTest, CheckRepresentable) {
  std::vector<float> values = {1.0f, -65504.0f, 1e5f};
  const auto* bytes = reinterpret_cast<const std::byte*>(values.data());
  EXPECT_TRUE(
      CheckRepresentable(DType::kFloat32, bytes, 2, DType::kFloat16, "k").ok());
  absl::Status status =
      CheckRepresentable(DType::kFloat32, bytes, 3, DType::kFloat16, "k");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("element 2"));
  EXPECT_THAT(status.message(), HasSubstr("float16"));
  EXPECT_TRUE(
      CheckRepresentable(DType::kFloat32, bytes, 3, DType::kBFloat16, "k")
          .ok());
  EXPECT_TRUE(
      CheckRepresentable(DType::kFloat32, bytes, 3, DType::kFloat32, "k").ok());
  // Rounding, not truncation, decides: 65519 rounds to 65504, 65520 to inf.
  std::vector<float> edge = {65519.0f, 65520.0f};
  const auto* edge_bytes = reinterpret_cast<const std::byte*>(edge.data());
  EXPECT_TRUE(
      CheckRepresentable(DType::kFloat32, edge_bytes, 1, DType::kFloat16, "v")
          .ok());
  EXPECT_FALSE(
      CheckRepresentable(DType::kFloat32, edge_bytes, 2, DType::kFloat16, "v")
          .ok());
  // The largest float overflows bfloat16 when rounded.
  std::vector<float> max = {std::numeric_limits<float>::max()};
  EXPECT_FALSE(
      CheckRepresentable(DType::kFloat32,
                         reinterpret_cast<const std::byte*>(max.data()), 1,
                         DType::kBFloat16, "v")
          .ok());
  // bfloat16 -> float16 can overflow; float16 -> bfloat16 cannot.
  std::vector<std::byte> bf(2);
  const float big = 1e6f;
  ConvertFromFloat(&big, 1, DType::kBFloat16, bf.data());
  EXPECT_FALSE(
      CheckRepresentable(DType::kBFloat16, bf.data(), 1, DType::kFloat16, "v")
          .ok());
  std::vector<std::byte> fp16(2);
  const float max_half = 65504.0f;
  ConvertFromFloat(&max_half, 1, DType::kFloat16, fp16.data());
  EXPECT_TRUE(
      CheckRepresentable(DType::kFloat16, fp16.data(), 1, DType::kBFloat16, "v")
          .ok());
  // Non-finite values are CheckFinite's business, not this check's.
  std::vector<float> inf = {kInf};
  EXPECT_TRUE(CheckRepresentable(DType::kFloat32,
                                 reinterpret_cast<const std::byte*>(inf.data()),
                                 1, DType::kFloat16, "v")
                  .ok());
}

// The one-pass check and conversion gives what the two calls give, past
// its internal chunks (1024 elements), and the same error.
TEST(DTypeTest, ConvertFromFloatCheckedIsCheckThenConvert) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-70000.0f, 70000.0f);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    std::vector<float> values(2500);
    for (float& x : values) x = std::clamp(dist(rng), -65504.0f, 65504.0f);
    const int64_t n = static_cast<int64_t>(values.size());
    std::vector<std::byte> want(values.size() * DTypeSize(dtype));
    std::vector<std::byte> got(want.size());
    ConvertFromFloat(values.data(), n, dtype, want.data());
    ASSERT_TRUE(
        ConvertFromFloatChecked(values.data(), n, dtype, got.data(), "o").ok())
        << DTypeName(dtype);
    EXPECT_EQ(got, want) << DTypeName(dtype);
  }
  std::vector<float> values(2500, 1.0f);
  values[1700] = 1e5f;
  values[2400] = 2e5f;
  const absl::Status want = CheckRepresentable(
      DType::kFloat32, reinterpret_cast<const std::byte*>(values.data()), 2500,
      DType::kFloat16, "attention output");
  std::vector<std::byte> out(2 * values.size());
  const absl::Status got = ConvertFromFloatChecked(
      values.data(), 2500, DType::kFloat16, out.data(), "attention output");
  EXPECT_EQ(got, want);
  EXPECT_THAT(got.message(), HasSubstr("element 1700"));
}

}  // namespace
}  // namespace attention
