// The top-k index scoring kernels (core/cpu/index_kernels.h): every ISA
// bitwise equal to the scalar kernel over dims with and without a lane
// tail, every KV dtype, both score functions and signed zeros; the scalar
// kernel equal to the canonical arithmetic written out; scores independent
// of how the keys are cut into calls.
#include "core/cpu/index_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cpu/cpu_features.h"
#include "core/dtype.h"
#include "gtest/gtest.h"

namespace attention::cpu {
namespace {

struct Inputs {
  std::vector<float> q;  // [heads][IndexDimPadded(dim)], zero padded
  std::vector<float> w;
  std::vector<std::byte> keys;    // [n][dim] in the key dtype
  std::vector<float> key_values;  // the same, widened
  IndexQuery query;
};

Inputs MakeInputs(int heads, int dim, int64_t n, DType dtype, IndexScore f,
                  uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Inputs in;
  const int stride = IndexDimPadded(dim);
  in.q.assign(static_cast<size_t>(heads * stride), 0.0f);
  for (int j = 0; j < heads; ++j) {
    for (int d = 0; d < dim; ++d) in.q[j * stride + d] = normal(rng);
  }
  // Signed zeros in the query and weights exercise ReLU's -0 and 0 * x.
  in.q[0] = -0.0f;
  for (int j = 0; j < heads; ++j) in.w.push_back(j == 1 ? -0.0f : normal(rng));
  std::vector<float> raw(static_cast<size_t>(n * dim));
  for (float& x : raw) x = normal(rng);
  if (n > 3) {
    std::fill(raw.begin() + 3 * dim, raw.begin() + 4 * dim, 0.0f);  // dot 0
  }
  in.keys.resize(raw.size() * DTypeSize(dtype));
  ConvertFromFloat(raw.data(), static_cast<int64_t>(raw.size()), dtype,
                   in.keys.data());
  in.key_values.resize(raw.size());
  ConvertToFloat(dtype, in.keys.data(), static_cast<int64_t>(raw.size()),
                 in.key_values.data());
  in.query = IndexQuery{
      .q = in.q.data(), .w = in.w.data(), .heads = heads, .dim = dim, .f = f};
  return in;
}

std::vector<uint32_t> Bits(const std::vector<float>& values) {
  std::vector<uint32_t> bits(values.size());
  std::memcpy(bits.data(), values.data(), values.size() * 4);
  return bits;
}

TEST(IndexKernelsTest, ScalarIsTheCanonicalArithmetic) {
  const Inputs in =
      MakeInputs(3, 37, 20, DType::kFloat32, IndexScore::kRelu, 1);
  std::vector<float> scores(20);
  ScalarIndexScores()(in.query, DType::kFloat32, in.keys.data(), 20,
                      scores.data());
  const int stride = IndexDimPadded(37);
  for (int64_t s = 0; s < 20; ++s) {
    float score = 0.0f;
    for (int j = 0; j < 3; ++j) {
      float lanes[kIndexLanes] = {};
      for (int d = 0; d < 37; ++d) {
        const float product = in.q[j * stride + d] * in.key_values[s * 37 + d];
        lanes[d % kIndexLanes] += product;
      }
      for (int width = 8; width >= 1; width /= 2) {
        for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
      }
      const float f =
          lanes[0] == -INFINITY ? lanes[0] : std::max(lanes[0], 0.0f);
      const float term = in.w[j] * f;
      score += term;
    }
    EXPECT_EQ(Bits({scores[s]}), Bits({score})) << "key " << s;
  }
}

TEST(IndexKernelsTest, EveryIsaIsBitwiseTheScalarKernel) {
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!CpuIsaSupported(isa) || IndexScoresFor(isa) == nullptr) {
      std::printf("skipping %s: not supported here\n",
                  std::string(CpuIsaName(isa)).c_str());
      continue;
    }
    for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      for (int dim : {1, 8, 15, 16, 17, 33, 64, 70, 128}) {
        for (IndexScore f : {IndexScore::kIdentity, IndexScore::kRelu}) {
          SCOPED_TRACE(absl::StrCat(CpuIsaName(isa), " ", DTypeName(dtype),
                                    " dim ", dim,
                                    f == IndexScore::kRelu ? " relu" : ""));
          const int64_t n = 45;  // partial blocks of 8 and 16 keys
          const Inputs in = MakeInputs(5, dim, n, dtype, f, 7 + dim);
          std::vector<float> want(n), got(n);
          ScalarIndexScores()(in.query, dtype, in.keys.data(), n, want.data());
          IndexScoresFor(isa)(in.query, dtype, in.keys.data(), n, got.data());
          EXPECT_EQ(Bits(got), Bits(want));
        }
      }
    }
  }
}

// A dot product that overflows float32 leaves the score not finite under
// either f (the call then fails): ReLU does not turn a -inf into a 0. Each
// key's dot overflows at a different point: the first in a product, the
// second only in the lane reduction, the third in one lane although its
// true sum is finite (2 * -3.4e38 + 2 * 3e38).
TEST(IndexKernelsTest, AnOverflowedDotIsNeverHidden) {
  const int dim = 48;
  const int stride = IndexDimPadded(dim);
  std::vector<float> q(stride, 0.0f);
  std::vector<float> keys(3 * dim, 0.0f);
  q[0] = 1e30f;
  keys[0] = -1e30f;  // key 0: -1e60
  for (int d = 16; d < 32; ++d) {
    q[d] = 1.0f;
    keys[dim + d] = -3e38f;  // key 1: lanes of -3e38, reduced: -inf
  }
  q[1] = q[2] = q[3] = 1.0f;
  keys[2 * dim + 1] = -3.4e38f;  // key 2: lane 1 -3.4e38 - 3.4e38
  keys[2 * dim + 17] = -3.4e38f;
  keys[2 * dim + 2] = 3e38f;
  keys[2 * dim + 3] = 3e38f;
  const float w = 0.5f;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!CpuIsaSupported(isa) || IndexScoresFor(isa) == nullptr) continue;
    for (IndexScore f : {IndexScore::kIdentity, IndexScore::kRelu}) {
      const IndexQuery query{
          .q = q.data(), .w = &w, .heads = 1, .dim = dim, .f = f};
      std::vector<float> scores(3);
      IndexScoresFor(isa)(query, DType::kFloat32,
                          reinterpret_cast<const std::byte*>(keys.data()), 3,
                          scores.data());
      for (int s = 0; s < 3; ++s) {
        EXPECT_FALSE(std::isfinite(scores[s]))
            << CpuIsaName(isa) << (f == IndexScore::kRelu ? " relu" : "")
            << " key " << s << ": " << scores[s];
      }
    }
  }
}

TEST(IndexKernelsTest, ScoresDoNotDependOnHowKeysAreCut) {
  const int64_t n = 100;
  const Inputs in =
      MakeInputs(4, 64, n, DType::kFloat16, IndexScore::kIdentity, 3);
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!CpuIsaSupported(isa)) continue;
    const IndexScoresFn kernel = IndexScoresFor(isa);
    std::vector<float> whole(n), pieces(n);
    kernel(in.query, DType::kFloat16, in.keys.data(), n, whole.data());
    const int64_t row_bytes = 64 * 2;
    for (int64_t begin = 0, size = 1; begin < n; begin += size, size += 3) {
      const int64_t count = std::min(size, n - begin);
      kernel(in.query, DType::kFloat16, in.keys.data() + begin * row_bytes,
             count, pieces.data() + begin);
    }
    EXPECT_EQ(Bits(pieces), Bits(whole)) << CpuIsaName(isa);
  }
}

}  // namespace
}  // namespace attention::cpu
