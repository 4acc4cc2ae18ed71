// The AVX2 index scoring kernel: the canonical arithmetic of
// index_kernels.h, 16 lanes as two 8-float registers (lanes 0-7, 8-15),
// products and adds as separate instructions (no FMA), and 8 keys' scores
// updated together per index head.
#include <immintrin.h>

#include <cstring>

#include "core/cpu/index_kernels.h"

namespace attention::cpu {
namespace {

// 8 key elements from `p` as floats (exact conversions).
template <DType T>
__m256 Load8(const std::byte* p) {
  if constexpr (T == DType::kFloat32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (T == DType::kFloat16) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m256i wide = _mm256_cvtepu16_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
}

// The canonical dot of a padded query row and one key row.
template <DType T>
float Dot(const float* q, const std::byte* k, int dim) {
  constexpr int kElement = T == DType::kFloat32 ? 4 : 2;
  __m256 lo = _mm256_setzero_ps();  // lanes 0-7
  __m256 hi = _mm256_setzero_ps();  // lanes 8-15
  int d = 0;
  for (; d + kIndexLanes <= dim; d += kIndexLanes) {
    lo = _mm256_add_ps(
        lo, _mm256_mul_ps(_mm256_loadu_ps(q + d), Load8<T>(k + d * kElement)));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(q + d + 8),
                                         Load8<T>(k + (d + 8) * kElement)));
  }
  if (d < dim) {
    // The tail, zero-padded: +0 products leave the lanes as they are.
    alignas(32) std::byte tail[kIndexLanes * 4] = {};
    std::memcpy(tail, k + d * kElement, (dim - d) * kElement);
    lo = _mm256_add_ps(lo,
                       _mm256_mul_ps(_mm256_loadu_ps(q + d), Load8<T>(tail)));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(q + d + 8),
                                         Load8<T>(tail + 8 * kElement)));
  }
  const __m256 r8 = _mm256_add_ps(lo, hi);  // l + (l + 8)
  const __m128 r4 = _mm_add_ps(_mm256_castps256_ps128(r8),
                               _mm256_extractf128_ps(r8, 1));  // l + (l + 4)
  const __m128 r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));     // l + (l + 2)
  return _mm_cvtss_f32(_mm_add_ss(r2, _mm_movehdup_ps(r2)));   // 0 + 1
}

template <DType T>
void Scores(const IndexQuery& query, const std::byte* keys, int64_t n,
            float* scores) {
  constexpr int kElement = T == DType::kFloat32 ? 4 : 2;
  constexpr int kBlock = 8;
  const int dim = query.dim;
  const int stride = IndexDimPadded(dim);
  const int64_t row_bytes = int64_t{dim} * kElement;
  const __m256 zero = _mm256_setzero_ps();
  const __m256 minus_infinity = _mm256_set1_ps(-__builtin_inff());
  for (int64_t s0 = 0; s0 < n; s0 += kBlock) {
    const int count = n - s0 < kBlock ? static_cast<int>(n - s0) : kBlock;
    __m256 score = zero;
    alignas(32) float dots[kBlock] = {};
    for (int j = 0; j < query.heads; ++j) {
      const float* q = query.q + int64_t{j} * stride;
      for (int i = 0; i < count; ++i) {
        dots[i] = Dot<T>(q, keys + (s0 + i) * row_bytes, dim);
      }
      __m256 f = _mm256_load_ps(dots);
      // max(0, x) keeps -0 and NaN, as std::max(x, 0.0f); the blend -inf.
      if (query.f == IndexScore::kRelu) {
        f = _mm256_blendv_ps(_mm256_max_ps(zero, f), f,
                             _mm256_cmp_ps(f, minus_infinity, _CMP_EQ_OQ));
      }
      score =
          _mm256_add_ps(score, _mm256_mul_ps(_mm256_set1_ps(query.w[j]), f));
    }
    alignas(32) float out[kBlock];
    _mm256_store_ps(out, score);
    std::memcpy(scores + s0, out, sizeof(float) * count);
  }
}

void Avx2Scores(const IndexQuery& query, DType key_type, const std::byte* keys,
                int64_t n, float* scores) {
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

IndexScoresFn Avx2IndexScores() { return &Avx2Scores; }

}  // namespace attention::cpu
