#include "core/dtype_kernels.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/string_view.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define ATTN_DTYPE_HAVE_AVX2 1
#include <immintrin.h>

#include "core/cpu_has_f16c.h"
#endif

namespace attention::dtype_internal {
namespace {

uint32_t LoadU32(const std::byte* src) {
  uint32_t bits;
  std::memcpy(&bits, src, sizeof(bits));
  return bits;
}

uint16_t LoadU16(const std::byte* src) {
  uint16_t bits;
  std::memcpy(&bits, src, sizeof(bits));
  return bits;
}

// Exponent bits: all set means inf or NaN.
constexpr uint32_t kFloatExponent = 0x7f800000u;
constexpr uint16_t kHalfExponent = 0x7c00u;
constexpr uint16_t kBFloat16Exponent = 0x7f80u;
// |x| at or above 65520 (the midpoint between 65504 and 65536) rounds to
// float16 infinity under round-to-nearest-even.
constexpr uint32_t kHalfOverflowBits = 0x477ff000u;

// Whether finite |x| (its bits, sign cleared) rounds to a bfloat16 infinity:
// the same rounding arithmetic as FloatToBFloat16.
bool BFloat16Overflows(uint32_t abs_bits) {
  return abs_bits + 0x7fffu + ((abs_bits >> 16) & 1u) >= kFloatExponent;
}

// --- The portable path. -----------------------------------------------------

void PortableHalfToFloat(const std::byte* src, int64_t count, float* dst) {
  // Blocks of 16 with a tail: a shape the compiler vectorises.
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) {
      dst[i + l] = HalfToFloat(LoadU16(src + 2 * (i + l)));
    }
  }
  for (; i < count; ++i) dst[i] = HalfToFloat(LoadU16(src + 2 * i));
}

void PortableFloatToHalf(const float* src, int64_t count, std::byte* dst) {
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t bits = FloatToHalf(src[i]);
    std::memcpy(dst + 2 * i, &bits, sizeof(bits));
  }
}

int64_t PortableFirstNonFinite(DType dtype, const std::byte* src,
                               int64_t count) {
  switch (dtype) {
    case DType::kFloat32:
      for (int64_t i = 0; i < count; ++i) {
        if ((LoadU32(src + 4 * i) & kFloatExponent) == kFloatExponent) {
          return i;
        }
      }
      return -1;
    case DType::kFloat16:
      for (int64_t i = 0; i < count; ++i) {
        if ((LoadU16(src + 2 * i) & kHalfExponent) == kHalfExponent) return i;
      }
      return -1;
    case DType::kBFloat16:
      for (int64_t i = 0; i < count; ++i) {
        if ((LoadU16(src + 2 * i) & kBFloat16Exponent) == kBFloat16Exponent) {
          return i;
        }
      }
      return -1;
  }
  return -1;
}

int64_t PortableFirstOverflow(const std::byte* src, int64_t count,
                              DType target) {
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t abs_bits = LoadU32(src + 4 * i) & 0x7fffffffu;
    if (abs_bits >= kFloatExponent) continue;  // not finite: not ours
    const bool overflows =
        target == DType::kFloat16
            ? abs_bits >= kHalfOverflowBits
            : target == DType::kBFloat16 && BFloat16Overflows(abs_bits);
    if (overflows) return i;
  }
  return -1;
}

constexpr DTypeKernels kPortable = {
    "portable",
    PortableHalfToFloat,
    PortableFloatToHalf,
    PortableFirstNonFinite,
    PortableFirstOverflow,
};

// --- The AVX2 + F16C path.
// ---------------------------------------------------- Target attributes rather
// than per-file -m flags: no AVX2 code can leak into inline functions that
// other translation units share.
#if defined(ATTN_DTYPE_HAVE_AVX2)
#define ATTN_AVX2 __attribute__((target("avx2,f16c")))

ATTN_AVX2 void Avx2HalfToFloat(const std::byte* src, int64_t count,
                               float* dst) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i half =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(half));
  }
  PortableHalfToFloat(src + 2 * i, count - i, dst + i);
}

ATTN_AVX2 void Avx2FloatToHalf(const float* src, int64_t count,
                               std::byte* dst) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i half =
        _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), half);
  }
  PortableFloatToHalf(src + i, count - i, dst + 2 * i);
}

// Bad-lane tests for Avx2Scan: a byte mask, non-zero when some lane is bad.
struct Float32NonFinite {
  ATTN_AVX2 int operator()(__m256i v) const {
    const __m256i e = _mm256_set1_epi32(static_cast<int>(kFloatExponent));
    return _mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_and_si256(v, e), e));
  }
};

struct HalfNonFinite {  // float16 or bfloat16, by their exponent bits
  uint16_t exponent;
  ATTN_AVX2 int operator()(__m256i v) const {
    const __m256i e = _mm256_set1_epi16(static_cast<short>(exponent));
    return _mm256_movemask_epi8(_mm256_cmpeq_epi16(_mm256_and_si256(v, e), e));
  }
};

// Sign-cleared float bits compare correctly as signed integers.
struct Float16Overflow {
  ATTN_AVX2 int operator()(__m256i v) const {
    const __m256i a = _mm256_and_si256(v, _mm256_set1_epi32(0x7fffffff));
    const __m256i finite_limit =
        _mm256_set1_epi32(static_cast<int>(kFloatExponent));
    const __m256i below_overflow =
        _mm256_set1_epi32(static_cast<int>(kHalfOverflowBits - 1));
    return _mm256_movemask_epi8(
        _mm256_and_si256(_mm256_cmpgt_epi32(a, below_overflow),
                         _mm256_cmpgt_epi32(finite_limit, a)));
  }
};

struct BFloat16Overflow {  // BFloat16Overflows(), eight lanes at a time
  ATTN_AVX2 int operator()(__m256i v) const {
    const __m256i a = _mm256_and_si256(v, _mm256_set1_epi32(0x7fffffff));
    const __m256i finite_limit =
        _mm256_set1_epi32(static_cast<int>(kFloatExponent));
    const __m256i rounded = _mm256_add_epi32(
        _mm256_add_epi32(a, _mm256_set1_epi32(0x7fff)),
        _mm256_and_si256(_mm256_srli_epi32(a, 16), _mm256_set1_epi32(1)));
    return _mm256_movemask_epi8(_mm256_and_si256(
        _mm256_cmpgt_epi32(
            rounded, _mm256_set1_epi32(static_cast<int>(kFloatExponent - 1))),
        _mm256_cmpgt_epi32(finite_limit, a)));
  }
};

// Scans 32-byte vectors with `bad_lanes`; `portable(at, n)` pins down the
// index inside the first bad vector and handles the tail.
template <typename BadLanes, typename Portable>
ATTN_AVX2 int64_t Avx2Scan(const std::byte* src, int64_t count,
                           int64_t element_size, BadLanes bad_lanes,
                           Portable portable) {
  const int64_t per_vector = 32 / element_size;
  int64_t i = 0;
  for (; i + per_vector <= count; i += per_vector) {
    const __m256i v = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(src + i * element_size));
    if (bad_lanes(v) != 0) {
      return i + portable(src + i * element_size, per_vector);
    }
  }
  const int64_t tail = portable(src + i * element_size, count - i);
  return tail < 0 ? -1 : i + tail;
}

ATTN_AVX2 int64_t Avx2FirstNonFinite(DType dtype, const std::byte* src,
                                     int64_t count) {
  auto portable = [dtype](const std::byte* at, int64_t n) {
    return PortableFirstNonFinite(dtype, at, n);
  };
  switch (dtype) {
    case DType::kFloat32:
      return Avx2Scan(src, count, 4, Float32NonFinite(), portable);
    case DType::kFloat16:
      return Avx2Scan(src, count, 2, HalfNonFinite{kHalfExponent}, portable);
    case DType::kBFloat16:
      return Avx2Scan(src, count, 2, HalfNonFinite{kBFloat16Exponent},
                      portable);
  }
  return -1;
}

ATTN_AVX2 int64_t Avx2FirstOverflow(const std::byte* src, int64_t count,
                                    DType target) {
  auto portable = [target](const std::byte* at, int64_t n) {
    return PortableFirstOverflow(at, n, target);
  };
  switch (target) {
    case DType::kFloat16:
      return Avx2Scan(src, count, 4, Float16Overflow(), portable);
    case DType::kBFloat16:
      return Avx2Scan(src, count, 4, BFloat16Overflow(), portable);
    case DType::kFloat32:
      return -1;
  }
  return -1;
}

constexpr DTypeKernels kAvx2 = {
    "avx2",
    Avx2HalfToFloat,
    Avx2FloatToHalf,
    Avx2FirstNonFinite,
    Avx2FirstOverflow,
};
#endif  // ATTN_DTYPE_HAVE_AVX2

}  // namespace

const DTypeKernels& PortableKernels() { return kPortable; }

const DTypeKernels* Avx2Kernels() {
#if defined(ATTN_DTYPE_HAVE_AVX2)
  // __builtin_cpu_supports also checks that the OS saves the YMM state.
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && CpuHasF16c();
  }();
  return supported ? &kAvx2 : nullptr;
#else
  return nullptr;
#endif
}

const DTypeKernels& ActiveKernels() {
  static const DTypeKernels* const active = [] {
    const char* isa = std::getenv("ATTN_CPU_ISA");
    const bool portable_requested =
        isa != nullptr && absl::AsciiStrToLower(isa) == "scalar";
    const DTypeKernels* avx2 = Avx2Kernels();
    return portable_requested || avx2 == nullptr ? &kPortable : avx2;
  }();
  return *active;
}

}  // namespace attention::dtype_internal
