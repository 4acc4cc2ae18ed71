// The AVX2 kernels: one 16-lane vector is a pair of ymm registers (lanes
// 0-7 and 8-15). Built with -mavx2 -mfma -mf16c; only called after
// CpuIsaSupported(kAvx2).
#include <immintrin.h>

#include <cstdint>

#include "core/cpu/kernels.h"

#define ATTN_KERNEL_NAMESPACE avx2_kernels
#define ATTN_KERNEL_NAME "avx2"

namespace attention::cpu::avx2_kernels {

struct V {
  __m256 lo, hi;
};
struct M {
  __m256 lo, hi;  // all-ones lanes where set
};

// Register blocking (see kernels_impl.h): at most 4 vectors (8 ymm) of
// accumulators per Q.K and per P.V pass.
constexpr int kDotHeads = 4;
constexpr int kDotAccumulators = 4;
constexpr int kPvHeads = 2;
constexpr int kPvAccumulators = 4;
// Multiply-add probe chains: 6 vectors = 12 of the 16 ymm registers.
constexpr int kFmaProbeChains = 6;

inline V Zero() { return V{_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V Splat(V, float c) {
  const __m256 s = _mm256_set1_ps(c);
  return V{s, s};
}
inline V Load(const float* p) {
  return V{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
// Mask of lanes [0, n) of an 8-lane half (n may be <= 0 or >= 8).
inline __m256i FirstLanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V LoadN(const float* p, int n) {
  return V{_mm256_maskload_ps(p, FirstLanes(n)),
           _mm256_maskload_ps(p + 8, FirstLanes(n - 8))};
}
inline void Store(float* p, V a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V LoadHalf(const uint16_t* p) {
  return V{
      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
      _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline __m256 WidenBf16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline V LoadBf16(const uint16_t* p) {
  return V{WidenBf16(p), WidenBf16(p + 8)};
}

#define ATTN_AVX2_BINARY(name, op) \
  inline V name(V a, V b) { return V{op(a.lo, b.lo), op(a.hi, b.hi)}; }
ATTN_AVX2_BINARY(Add, _mm256_add_ps)
ATTN_AVX2_BINARY(Sub, _mm256_sub_ps)
ATTN_AVX2_BINARY(Mul, _mm256_mul_ps)
ATTN_AVX2_BINARY(Div, _mm256_div_ps)
ATTN_AVX2_BINARY(Max, _mm256_max_ps)
#undef ATTN_AVX2_BINARY

inline V Fma(V a, V b, V c) {
  return V{_mm256_fmadd_ps(a.lo, b.lo, c.lo),
           _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline __m256 Pow2Half(__m256 n) {
  const __m256i e =
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline V Pow2(V n) { return V{Pow2Half(n.lo), Pow2Half(n.hi)}; }
inline V ZeroWhereLess(V x, V lo, V y) {
  return V{_mm256_andnot_ps(_mm256_cmp_ps(x.lo, lo.lo, _CMP_LT_OQ), y.lo),
           _mm256_andnot_ps(_mm256_cmp_ps(x.hi, lo.hi, _CMP_LT_OQ), y.hi)};
}
inline M Ne(V a, V b) {
  return M{_mm256_cmp_ps(a.lo, b.lo, _CMP_NEQ_UQ),
           _mm256_cmp_ps(a.hi, b.hi, _CMP_NEQ_UQ)};
}
inline __m256 NonFiniteHalf(__m256 x) {
  const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  return _mm256_cmp_ps(abs, _mm256_set1_ps(__builtin_inff()), _CMP_NLT_UQ);
}
inline M NonFinite(V a) { return M{NonFiniteHalf(a.lo), NonFiniteHalf(a.hi)}; }
inline __m256 BitsToLanes(uint32_t bits) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set = _mm256_and_si256(
      _mm256_set1_epi32(static_cast<int>(bits & 0xffu)), lane_bit);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(set, lane_bit));
}
inline M FromBits(uint32_t bits) {
  return M{BitsToLanes(bits), BitsToLanes(bits >> 8)};
}
inline uint32_t Bits(M m) {
  return static_cast<uint32_t>(_mm256_movemask_ps(m.lo)) |
         (static_cast<uint32_t>(_mm256_movemask_ps(m.hi)) << 8);
}
inline M And(M a, M b) {
  return M{_mm256_and_ps(a.lo, b.lo), _mm256_and_ps(a.hi, b.hi)};
}
inline V Select(M m, V a, V b) {
  return V{_mm256_blendv_ps(b.lo, a.lo, m.lo),
           _mm256_blendv_ps(b.hi, a.hi, m.hi)};
}
inline float ReduceMax(V a) {
  __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

// Sixteen canonical lane sums at once (see the AVX-512 version): width 8
// adds the two halves, then each stage pairs lane l with l + width.
inline V SumTree16(const V* acc) {
  __m256 s8[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) s8[i] = _mm256_add_ps(acc[i].lo, acc[i].hi);
  // Width 4: [input 2i lanes l + l+4 | input 2i+1 lanes l + l+4].
  __m256 s4[8];
#pragma GCC unroll 16
  for (int i = 0; i < 8; ++i) {
    const __m256 a = s8[2 * i], b = s8[2 * i + 1];
    s4[i] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20),
                          _mm256_permute2f128_ps(a, b, 0x31));
  }
  // Width 2: 128-bit half h of s2[i] = [input 4i+h (2 lanes),
  // input 4i+2+h (2 lanes)].
  __m256 s2[4];
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) {
    const __m256 a = s4[2 * i], b = s4[2 * i + 1];
    s2[i] = _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Width 1: lane 4 h + t of s1[i] = input 8i + 2t + h.
  __m256 s1[2];
#pragma GCC unroll 16
  for (int i = 0; i < 2; ++i) {
    const __m256 a = s2[2 * i], b = s2[2 * i + 1];
    s1[i] = _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  return V{_mm256_permutevar8x32_ps(s1[0], order),
           _mm256_permutevar8x32_ps(s1[1], order)};
}

}  // namespace attention::cpu::avx2_kernels

#include "core/cpu/kernels_impl.h"

namespace attention::cpu {

const KernelTable* Avx2Kernels() { return &avx2_kernels::kKernelTable; }

}  // namespace attention::cpu
