// The AVX-512 index scoring kernel: the canonical arithmetic of
// index_kernels.h, 16 lanes in one register, products and adds as separate
// instructions (no FMA), and 16 keys' scores updated together per index
// head.
// GCC 12 reports its own `__Y = __Y` idiom inside the AVX-512 intrinsic
// headers as uninitialized (GCC bug 105593), as in kernels_avx512.cc.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstring>

#include "core/cpu/index_kernels.h"

namespace attention::cpu {
namespace {

// 16 key elements from `p` as floats (exact conversions); lanes outside
// `mask` are +0.
template <DType T>
__m512 Load16(const std::byte* p, __mmask16 mask) {
  if constexpr (T == DType::kFloat32) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else if constexpr (T == DType::kFloat16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  } else {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
}

// The canonical dot of a padded query row and one key row.
template <DType T>
float Dot(const float* q, const std::byte* k, int dim) {
  constexpr int kElement = T == DType::kFloat32 ? 4 : 2;
  __m512 acc = _mm512_setzero_ps();
  int d = 0;
  for (; d + kIndexLanes <= dim; d += kIndexLanes) {
    acc =
        _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(q + d),
                                         Load16<T>(k + d * kElement, 0xffff)));
  }
  if (d < dim) {
    // Masked lanes multiply +0 by +0: adding it leaves them as they are.
    const __mmask16 mask = static_cast<__mmask16>((1u << (dim - d)) - 1u);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(q + d),
                                           Load16<T>(k + d * kElement, mask)));
  }
  const __m256 r8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                                  _mm512_extractf32x8_ps(acc, 1));
  const __m128 r4 =
      _mm_add_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps(r8, 1));
  const __m128 r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
  return _mm_cvtss_f32(_mm_add_ss(r2, _mm_movehdup_ps(r2)));
}

template <DType T>
void Scores(const IndexQuery& query, const std::byte* keys, int64_t n,
            float* scores) {
  constexpr int kElement = T == DType::kFloat32 ? 4 : 2;
  constexpr int kBlock = 16;
  const int dim = query.dim;
  const int stride = IndexDimPadded(dim);
  const int64_t row_bytes = int64_t{dim} * kElement;
  const __m512 zero = _mm512_setzero_ps();
  const __m512 minus_infinity = _mm512_set1_ps(-__builtin_inff());
  for (int64_t s0 = 0; s0 < n; s0 += kBlock) {
    const int count = n - s0 < kBlock ? static_cast<int>(n - s0) : kBlock;
    __m512 score = zero;
    alignas(64) float dots[kBlock] = {};
    for (int j = 0; j < query.heads; ++j) {
      const float* q = query.q + int64_t{j} * stride;
      for (int i = 0; i < count; ++i) {
        dots[i] = Dot<T>(q, keys + (s0 + i) * row_bytes, dim);
      }
      __m512 f = _mm512_load_ps(dots);
      // max(0, x) keeps -0 and NaN, as std::max(x, 0.0f); the mask -inf.
      if (query.f == IndexScore::kRelu) {
        f = _mm512_mask_mov_ps(
            _mm512_max_ps(zero, f),
            _mm512_cmp_ps_mask(f, minus_infinity, _CMP_EQ_OQ), f);
      }
      score =
          _mm512_add_ps(score, _mm512_mul_ps(_mm512_set1_ps(query.w[j]), f));
    }
    _mm512_mask_storeu_ps(scores + s0,
                          static_cast<__mmask16>((1u << count) - 1u), score);
  }
}

void Avx512Scores(const IndexQuery& query, DType key_type,
                  const std::byte* keys, int64_t n, float* scores) {
  switch (key_type) {
    case DType::kFloat32:
      return Scores<DType::kFloat32>(query, keys, n, scores);
    case DType::kFloat16:
      return Scores<DType::kFloat16>(query, keys, n, scores);
    case DType::kBFloat16:
      return Scores<DType::kBFloat16>(query, keys, n, scores);
  }
}

}  // namespace

IndexScoresFn Avx512IndexScores() { return &Avx512Scores; }

}  // namespace attention::cpu
