#include "core/cpu/index_kernels.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace attention::cpu {

int IndexDimPadded(int dim) {
  return (dim + kIndexLanes - 1) / kIndexLanes * kIndexLanes;
}

namespace {

constexpr float kInfinity = std::numeric_limits<float>::infinity();

// The canonical dot product (index_kernels.h) of a padded query row and a
// key row of `dim` floats.
float ScalarDot(const float* q, const float* k, int dim) {
  float lanes[kIndexLanes] = {};
  int d = 0;
  for (; d + kIndexLanes <= dim; d += kIndexLanes) {
    for (int l = 0; l < kIndexLanes; ++l) lanes[l] += q[d + l] * k[d + l];
  }
  for (int l = 0; d + l < dim; ++l) lanes[l] += q[d + l] * k[d + l];
  for (int width = kIndexLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

void ScalarScores(const IndexQuery& query, DType key_type,
                  const std::byte* keys, int64_t n, float* scores) {
  const int dim = query.dim;
  const int stride = IndexDimPadded(dim);
  const int64_t row_bytes = int64_t{dim} * DTypeSize(key_type);
  std::vector<float> key(static_cast<size_t>(dim));
  for (int64_t s = 0; s < n; ++s) {
    ConvertToFloat(key_type, keys + s * row_bytes, dim, key.data());
    float score = 0.0f;
    for (int j = 0; j < query.heads; ++j) {
      float dot = ScalarDot(query.q + int64_t{j} * stride, key.data(), dim);
      if (query.f == IndexScore::kRelu && dot != -kInfinity) {
        dot = std::max(dot, 0.0f);
      }
      score += query.w[j] * dot;
    }
    scores[s] = score;
  }
}

}  // namespace

IndexScoresFn ScalarIndexScores() { return &ScalarScores; }

#if !defined(ATTN_CPU_HAVE_AVX2)
IndexScoresFn Avx2IndexScores() { return nullptr; }
#endif
#if !defined(ATTN_CPU_HAVE_AVX512)
IndexScoresFn Avx512IndexScores() { return nullptr; }
#endif

IndexScoresFn IndexScoresFor(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return Avx512IndexScores();
    case CpuIsa::kAvx2:
      return Avx2IndexScores();
    case CpuIsa::kScalar:
      break;
  }
  return ScalarIndexScores();
}

}  // namespace attention::cpu
