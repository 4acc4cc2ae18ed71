// The per-ISA kernel tables: the canonical numerics of kernels.h, and
// bitwise equality of every SIMD table with the portable scalar one.
#include "core/cpu/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/cpu/cpu_features.h"
#include "core/dtype.h"
#include "gtest/gtest.h"

namespace attention::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

const KernelTable* TableFor(CpuIsa isa) {
  if (!CpuIsaSupported(isa)) return nullptr;
  switch (isa) {
    case CpuIsa::kScalar:
      return ScalarKernels();
    case CpuIsa::kAvx2:
      return Avx2Kernels();
    case CpuIsa::kAvx512:
      return Avx512Kernels();
  }
  return nullptr;
}

DType ToDType(ElementType type) {
  switch (type) {
    case ElementType::kFloat16:
      return DType::kFloat16;
    case ElementType::kBFloat16:
      return DType::kBFloat16;
    case ElementType::kFloat32:
      break;
  }
  return DType::kFloat32;
}

uint32_t Bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b,
                    const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    if (Bits(a[i]) != Bits(b[i])) {
      ADD_FAILURE() << what << "[" << i << "]: " << a[i] << " vs " << b[i];
      return;
    }
  }
}

// The canonical dot product written out independently: 16 lanes of fused
// multiply-adds, then the pairwise lane tree.
float CanonicalDot(const float* a, const float* b, int n) {
  float lanes[kLanes] = {};
  for (int d = 0; d < n; ++d) {
    lanes[d % kLanes] = std::fmaf(a[d], b[d], lanes[d % kLanes]);
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

// Everything one update_tile call reads and writes, owning its memory.
struct Tile {
  int n = kTileKeys;
  int head_dim = 64;  // padded; a multiple of kLanes
  int value_dim = 64;
  int rows = 1;
  int group = 4;
  float scale = 0.125f;
  ElementType type = ElementType::kFloat16;
  bool with_bias = false;

  std::vector<float> q;
  std::vector<std::vector<std::byte>> k_bytes, v_bytes;
  std::vector<const std::byte*> k, v;
  std::vector<uint32_t> visible;
  std::vector<std::vector<float>> bias_values;
  std::vector<const float*> bias;
  std::vector<float> m, l, acc;
  std::vector<float> work, alpha;
  std::vector<int> active;

  int row_heads() const { return rows * group; }

  void Fill(std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    auto random = [&](int count, float stddev) {
      std::vector<float> out(count);
      for (float& x : out) x = stddev * normal(rng);
      return out;
    };
    q = random(row_heads() * head_dim, 1.0f);
    auto rows_of = [&](int dim, std::vector<std::vector<std::byte>>* bytes,
                       std::vector<const std::byte*>* ptrs) {
      const DType dtype = ToDType(type);
      bytes->assign(n, std::vector<std::byte>(dim * DTypeSize(dtype)));
      ptrs->resize(n);
      for (int j = 0; j < n; ++j) {
        const std::vector<float> raw = random(dim, 1.0f);
        ConvertFromFloat(raw.data(), dim, dtype, (*bytes)[j].data());
        (*ptrs)[j] = (*bytes)[j].data();
      }
    };
    rows_of(head_dim, &k_bytes, &k);
    rows_of(value_dim, &v_bytes, &v);
    visible.resize(rows);
    for (int r = 0; r < rows; ++r) {
      // Mostly a causal-like prefix, sometimes scattered, sometimes none.
      const float pick = uniform(rng);
      const int limit = std::uniform_int_distribution<int>(0, n)(rng);
      uint32_t bits = limit >= 32 ? 0xffffffffu : (1u << limit) - 1;
      if (pick < 0.3f) bits = static_cast<uint32_t>(rng());
      if (pick > 0.9f) bits = 0;
      if (n < 32) bits &= (1u << n) - 1;
      visible[r] = bits;
    }
    if (with_bias) {
      bias_values.assign(row_heads(), {});
      bias.resize(row_heads());
      for (int rh = 0; rh < row_heads(); ++rh) {
        bias_values[rh] = random(n, 0.5f);
        for (float& b : bias_values[rh]) {
          if (uniform(rng) < 0.2f) b = -kInf;
        }
        bias[rh] = bias_values[rh].data();
      }
    }
    // A state mid-chunk (or empty for some row-heads).
    m.resize(row_heads());
    l.resize(row_heads());
    acc = random(row_heads() * value_dim, 1.0f);
    for (int rh = 0; rh < row_heads(); ++rh) {
      if (uniform(rng) < 0.3f) {
        m[rh] = -kInf;
        l[rh] = 0.0f;
        std::fill(acc.begin() + rh * value_dim,
                  acc.begin() + (rh + 1) * value_dim, 0.0f);
      } else {
        m[rh] = normal(rng);
        l[rh] = 1.0f + 3.0f * uniform(rng);
      }
    }
    work.assign(row_heads() * kTileKeys, 0.0f);
    alpha.assign(row_heads(), 0.0f);
    active.assign(row_heads(), 0);
  }

  TileJob Job() {
    TileJob job;
    job.n = n;
    job.head_dim_padded = head_dim;
    job.value_dim_padded = value_dim;
    job.rows = rows;
    job.group = group;
    job.scale = scale;
    job.q = q.data();
    job.key_type = type;
    job.value_type = type;
    job.k = k.data();
    job.v = v.data();
    job.visible = visible.data();
    job.bias = with_bias ? bias.data() : nullptr;
    job.m = m.data();
    job.l = l.data();
    job.acc = acc.data();
    job.work = work.data();
    job.alpha = alpha.data();
    job.active = active.data();
    return job;
  }
};

// Tile shapes covering every dispatch branch of the kernels.
std::vector<Tile> TileShapes() {
  std::vector<Tile> shapes;
  for (ElementType type :
       {ElementType::kFloat32, ElementType::kFloat16, ElementType::kBFloat16}) {
    for (int head_dim : {16, 64, 80, 128}) {
      for (int group : {1, 3, 4, 8}) {
        Tile t;
        t.type = type;
        t.head_dim = head_dim;
        t.value_dim = head_dim == 80 ? 48 : head_dim;
        t.group = group;
        t.rows = group == 1 ? 5 : 2;
        t.n = head_dim == 16 ? 7 : (group == 3 ? 19 : 32);
        t.with_bias = group == 3;
        shapes.push_back(t);
      }
    }
  }
  return shapes;
}

class KernelTableTest : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    table_ = TableFor(GetParam());
    if (table_ == nullptr) {
      GTEST_SKIP() << "this processor or build cannot run the "
                   << CpuIsaName(GetParam()) << " kernels";
    }
  }
  const KernelTable* table_ = nullptr;
  const KernelTable* scalar_ = ScalarKernels();
};

TEST_P(KernelTableTest, NameMatchesTheIsa) {
  EXPECT_EQ(std::string(table_->name), CpuIsaName(GetParam()));
}

TEST_P(KernelTableTest, ExpIsWithinTwoUlpAndExactAtTheEnds) {
  double worst_ulps = 0;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> uniform(-87.0f, 0.0f);
  for (int i = 0; i < 200000; ++i) {
    const float x = i < 1000 ? -0.001f * i : uniform(rng);
    const float got = table_->exp(x);
    const double want = std::exp(static_cast<double>(x));
    const float want_f = static_cast<float>(want);
    const double ulp =
        std::nextafter(want_f, std::numeric_limits<float>::infinity()) - want_f;
    worst_ulps = std::max(worst_ulps, std::abs(got - want) / ulp);
  }
  EXPECT_LE(worst_ulps, 2.0);
  EXPECT_EQ(table_->exp(0.0f), 1.0f);
  EXPECT_EQ(table_->exp(-kInf), 0.0f);
  EXPECT_EQ(table_->exp(-1000.0f), 0.0f);
  EXPECT_EQ(table_->exp(-88.0f), 0.0f);  // below FLT_MIN: flushed
  EXPECT_GT(table_->exp(-87.0f), 0.0f);
}

TEST_P(KernelTableTest, ExpIsBitwiseTheScalarExp) {
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> uniform(-100.0f, 0.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = uniform(rng);
    ASSERT_EQ(Bits(table_->exp(x)), Bits(scalar_->exp(x))) << x;
  }
}

TEST_P(KernelTableTest, FmaProbeComputesItsChains) {
  // Chain i starts at 0.5 + 0.01 i in every lane and becomes
  // 1 + (start - 1) 0.999^r after r rounds of fma(x, 0.999, 0.001).
  const int lanes_times_chains = table_->fma_probe_flops / 2;
  ASSERT_EQ(lanes_times_chains % kLanes, 0);
  const int chains = lanes_times_chains / kLanes;
  for (int64_t rounds : {0, 1, 1000}) {
    double want = 0;
    for (int i = 0; i < chains; ++i) {
      want += kLanes * (1 + (0.5 + 0.01 * i - 1) * std::pow(0.999, rounds));
    }
    EXPECT_NEAR(table_->fma_probe(rounds), want, 1e-4 * want) << rounds;
  }
}

TEST_P(KernelTableTest, FmaWidenProbeComputesItsChains) {
  // Chain i starts at 0.5 + 0.01 i in every lane and becomes
  // f + (start - f) w^r after r rounds of fma(x, w, 0.001), where w is
  // the float16 0x3BFE widened (exactly 0.9990234375) and
  // f = 0.001 / (1 - w) the fixed point.
  const int lanes_times_chains = table_->fma_widen_probe_flops / 2;
  ASSERT_EQ(lanes_times_chains % kLanes, 0);
  const int chains = lanes_times_chains / kLanes;
  ASSERT_EQ(chains % 4, 0);  // 4 chains per widened vector
  const double w = 0.9990234375;
  const double f = 0.001 / (1 - w);
  for (int64_t rounds : {0, 1, 1000}) {
    double want = 0;
    for (int i = 0; i < chains; ++i) {
      want += kLanes * (f + (0.5 + 0.01 * i - f) * std::pow(w, rounds));
    }
    EXPECT_NEAR(table_->fma_widen_probe(rounds), want, 1e-4 * want) << rounds;
  }
}

TEST_P(KernelTableTest, DivideRowIsCorrectlyRoundedDivision) {
  std::mt19937 rng(6);
  std::uniform_real_distribution<float> uniform(-1e3f, 1e3f);
  std::vector<float> acc(70);
  for (float& x : acc) x = uniform(rng);
  for (int n : {0, 1, 15, 16, 17, 40, 64, 70}) {
    const float divisor = std::abs(uniform(rng)) + 1e-3f;
    std::vector<float> out(70, -7.0f);
    EXPECT_TRUE(table_->divide_row(acc.data(), divisor, n, out.data()));
    for (int d = 0; d < 70; ++d) {
      const float want = d < n ? acc[d] / divisor : -7.0f;
      ASSERT_EQ(Bits(out[d]), Bits(want)) << n << " " << d;
    }
  }
  // In place.
  std::vector<float> row = acc;
  EXPECT_TRUE(table_->divide_row(row.data(), 3.0f, 70, row.data()));
  for (int d = 0; d < 70; ++d) ASSERT_EQ(Bits(row[d]), Bits(acc[d] / 3.0f));
  // A non-finite sum anywhere, in the vector part or the tail, is reported.
  for (int at : {0, 15, 16, 63, 64, 69}) {
    for (float bad : {kInf, -kInf, std::numeric_limits<float>::quiet_NaN()}) {
      std::vector<float> with = acc;
      with[at] = bad;
      EXPECT_FALSE(table_->divide_row(with.data(), 2.0f, 70, with.data()))
          << at << " " << bad;
    }
  }
}

TEST_P(KernelTableTest, ReadProbeReturnsTheMaximum) {
  // Counts around the 8-vector stride and the vector tail; the maximum at
  // every position of the longest buffer in turn.
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uniform(-1000.0f, 1000.0f);
  std::vector<float> data(300);
  for (float& x : data) x = uniform(rng);
  for (int64_t count : {0, 1, 15, 16, 17, 127, 128, 129, 150, 300}) {
    const float want =
        count == 0 ? -kInf
                   : *std::max_element(data.begin(), data.begin() + count);
    EXPECT_EQ(table_->read_probe(data.data(), count), want) << count;
  }
  for (int64_t at = 0; at < 300; ++at) {
    std::vector<float> peaked = data;
    peaked[at] = 5000.0f;
    ASSERT_EQ(table_->read_probe(peaked.data(), 300), 5000.0f) << at;
  }
}

TEST_P(KernelTableTest, ConvertRowsIsExactAndZeroPads) {
  // Every finite float16 / bfloat16 bit pattern, in rows of 37 elements
  // (two full blocks and a tail) padded to 48, plus a missing row.
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    const ElementType type = dtype == DType::kFloat16 ? ElementType::kFloat16
                             : dtype == DType::kBFloat16
                                 ? ElementType::kBFloat16
                                 : ElementType::kFloat32;
    std::vector<float> expected;
    std::vector<std::byte> bytes;
    for (uint32_t bits = 0; bits < 65536; ++bits) {
      const uint16_t h = static_cast<uint16_t>(bits);
      float value;
      if (dtype == DType::kFloat32) {
        value = static_cast<float>(static_cast<int>(bits) - 32768) * 0.37f;
      } else {
        value = dtype == DType::kFloat16 ? HalfToFloat(h) : BFloat16ToFloat(h);
        if (!std::isfinite(value)) continue;
      }
      expected.push_back(value);
      const size_t at = bytes.size();
      bytes.resize(at + DTypeSize(dtype));
      if (dtype == DType::kFloat32) {
        std::memcpy(bytes.data() + at, &value, 4);
      } else {
        std::memcpy(bytes.data() + at, &h, 2);
      }
    }
    constexpr int kDim = 37, kStride = 48;
    const int rows = static_cast<int>(expected.size()) / kDim;
    std::vector<const std::byte*> src(rows + 1);
    for (int j = 0; j < rows; ++j) {
      src[j] = bytes.data() + int64_t{j} * kDim * DTypeSize(dtype);
    }
    src[rows] = nullptr;
    std::vector<float> out((rows + 1) * kStride, 12345.0f);
    table_->convert_rows(type, src.data(), rows + 1, kDim, kStride, out.data());
    for (int j = 0; j <= rows; ++j) {
      for (int d = 0; d < kStride; ++d) {
        const float want = j < rows && d < kDim ? expected[j * kDim + d] : 0.0f;
        ASSERT_EQ(Bits(out[j * kStride + d]), Bits(want))
            << DTypeName(dtype) << " row " << j << " element " << d;
      }
    }
  }
}

TEST_P(KernelTableTest, LogitsFollowTheCanonicalDotProduct) {
  std::mt19937 rng(5);
  for (int head_dim : {16, 48, 64, 128}) {
    Tile t;
    t.type = ElementType::kFloat32;
    t.head_dim = head_dim;
    t.value_dim = 16;
    t.rows = 1;
    t.group = 2;
    t.scale = 1.0f;
    t.Fill(rng);
    t.visible[0] = 0xffffffffu;
    TileJob job = t.Job();
    for (int rh = 0; rh < 2; ++rh) {
      float logits[kTileKeys];
      ASSERT_EQ(table_->tile_logits(&job, rh, logits), TileError::kNone);
      for (int j = 0; j < t.n; ++j) {
        const float want =
            CanonicalDot(t.q.data() + rh * head_dim,
                         reinterpret_cast<const float*>(t.k[j]), head_dim) +
            0.0f;
        ASSERT_EQ(Bits(logits[j]), Bits(want))
            << "head_dim " << head_dim << " key " << j;
      }
    }
  }
}

TEST_P(KernelTableTest, UpdateTileIsBitwiseTheScalarUpdate) {
  std::mt19937 rng(6);
  int compared = 0;
  for (Tile shape : TileShapes()) {
    for (int trial = 0; trial < 3; ++trial) {
      shape.Fill(rng);
      Tile mine = shape;
      Tile reference = shape;
      TileJob mine_job = mine.Job();
      TileJob reference_job = reference.Job();
      ASSERT_EQ(table_->update_tile(&mine_job), TileError::kNone);
      ASSERT_EQ(scalar_->update_tile(&reference_job), TileError::kNone);
      const std::string what = std::string(DTypeName(ToDType(shape.type))) +
                               " head_dim " + std::to_string(shape.head_dim) +
                               " group " + std::to_string(shape.group);
      ExpectSameBits(mine.m, reference.m, what + " m");
      ExpectSameBits(mine.l, reference.l, what + " l");
      ExpectSameBits(mine.acc, reference.acc, what + " acc");
      // The state actually changed (the comparison is not vacuous).
      if (mine.acc != shape.acc) ++compared;
    }
  }
  EXPECT_GT(compared, 50);
}

TEST_P(KernelTableTest, OverflowReportsTheSameFirstKey) {
  std::mt19937 rng(7);
  for (bool bias_overflow : {false, true}) {
    Tile t;
    t.type = ElementType::kFloat32;
    t.rows = 2;
    t.group = 2;
    t.with_bias = true;
    t.Fill(rng);
    t.visible = {0xffffffffu, 0xffffffffu};
    for (auto& row : t.bias_values) std::fill(row.begin(), row.end(), 0.0f);
    const float big = std::sqrt(0.75f * std::numeric_limits<float>::max());
    if (bias_overflow) {
      // Row-head 1, key 9: a finite logit of ~0.4 FLT_MAX plus a finite
      // bias of 0.75 FLT_MAX. Key 4 would overflow too but is masked.
      t.scale = 1.0f;
      const float x = std::sqrt(0.4f / static_cast<float>(t.head_dim) *
                                std::numeric_limits<float>::max());
      std::fill(t.q.begin() + t.head_dim, t.q.begin() + 2 * t.head_dim, x);
      std::vector<float> key(t.head_dim, x);
      for (int j : {4, 9}) {
        ConvertFromFloat(key.data(), t.head_dim, DType::kFloat32,
                         t.k_bytes[j].data());
        t.bias_values[1][j] = 0.75f * std::numeric_limits<float>::max();
      }
      t.bias_values[1][4] = -kInf;
    } else {
      // Row-head 2 (row 1), keys 5 and 20 overflow; key 3 would too but is
      // invisible to the row.
      std::fill(t.q.begin() + 2 * t.head_dim, t.q.begin() + 3 * t.head_dim,
                big);
      t.visible[1] = ~(1u << 3);
      for (int j : {3, 5, 20}) {
        std::vector<float> key(t.head_dim, big);
        ConvertFromFloat(key.data(), t.head_dim, DType::kFloat32,
                         t.k_bytes[j].data());
      }
    }
    Tile other = t;
    TileJob job = t.Job();
    TileJob other_job = other.Job();
    const TileError error = table_->update_tile(&job);
    EXPECT_EQ(error, scalar_->update_tile(&other_job));
    EXPECT_EQ(error, bias_overflow ? TileError::kBiasOverflow
                                   : TileError::kLogitOverflow);
    EXPECT_EQ(job.error_row_head, bias_overflow ? 1 : 2);
    EXPECT_EQ(job.error_key, bias_overflow ? 9 : 5);
    EXPECT_EQ(job.error_row_head, other_job.error_row_head);
    EXPECT_EQ(job.error_key, other_job.error_key);
  }
}

TEST_P(KernelTableTest, WeightsAndMergeAreBitwiseTheScalarOnes) {
  std::mt19937 rng(8);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + trial % kTileKeys;
    std::vector<float> logits(n);
    for (float& s : logits) s = normal(rng);
    logits[trial % n] = -kInf;
    const float m = 3.0f + normal(rng) * 0.1f + 6.0f;
    std::vector<float> mine(n, -1.0f), reference(n, -1.0f);
    table_->tile_weights(logits.data(), n, m, 2.5f, mine.data());
    scalar_->tile_weights(logits.data(), n, m, 2.5f, reference.data());
    ExpectSameBits(mine, reference, "weights");
    EXPECT_EQ(mine[trial % n], -1.0f) << "invisible weight was written";

    const int dims = 16 * (1 + trial % 9);
    std::vector<float> a_acc(dims), b_acc(dims);
    for (float& x : a_acc) x = normal(rng);
    for (float& x : b_acc) x = normal(rng);
    float a_m = trial % 7 == 0 ? -kInf : normal(rng);
    float a_l = a_m == -kInf ? 0.0f : 1.5f;
    if (a_m == -kInf) std::fill(a_acc.begin(), a_acc.end(), 0.0f);
    const float b_m = normal(rng), b_l = 2.0f;
    std::vector<float> ref_acc = a_acc;
    float ref_m = a_m, ref_l = a_l;
    table_->merge_state(&a_m, &a_l, a_acc.data(), b_m, b_l, b_acc.data(), dims);
    scalar_->merge_state(&ref_m, &ref_l, ref_acc.data(), b_m, b_l, b_acc.data(),
                         dims);
    EXPECT_EQ(Bits(a_m), Bits(ref_m));
    EXPECT_EQ(Bits(a_l), Bits(ref_l));
    ExpectSameBits(a_acc, ref_acc, "merged acc");
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, KernelTableTest,
                         ::testing::Values(CpuIsa::kScalar, CpuIsa::kAvx2,
                                           CpuIsa::kAvx512),
                         [](const ::testing::TestParamInfo<CpuIsa>& info) {
                           return std::string(CpuIsaName(info.param));
                         });

}  // namespace
}  // namespace attention::cpu
