// Every kernel ISA of the CPU backend against the double-precision
// reference, and bitwise against the portable scalar kernels; decode split
// over threads against single-threaded decode and prefill rows.
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/cpu/cpu_backend.h"
#include "core/cpu/cpu_features.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/cpu/attention_case.h"

namespace attention {
namespace {

using ::attention::testing::Case;
using ::attention::testing::CheckAgainstReference;
using ::attention::testing::Config;
using ::attention::testing::ExpectBitwiseEqual;
using ::attention::testing::PagedKv;
using ::attention::testing::WritePaged;
using ::testing::HasSubstr;

constexpr CpuIsa kAllIsas[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512};

std::string ConfigName(const Config& c) {
  return absl::StrCat(DTypeName(c.kv_dtype), " H=", c.num_heads,
                      " H_kv=", c.num_kv_heads, " d=", c.head_dim, "/",
                      c.value_dim, " window=", c.mask.window,
                      " sinks=", c.mask.num_sink_tokens,
                      " learned_sinks=", c.sink_logits.size());
}

// fp32/fp16/bf16 KV, GQA groups 1/4/8, head_dim 64/128/80 and odd sizes,
// windows with sink tokens and learned sinks; each over several chunks.
std::vector<Config> IsaConfigs() {
  std::vector<Config> configs;
  const struct {
    int heads, kv_heads, head_dim, value_dim;
  } shapes[] = {
      {8, 8, 64, 64}, {8, 2, 128, 128}, {8, 1, 80, 80}, {4, 2, 24, 40}};
  int i = 0;
  for (DType kv_dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (const auto& shape : shapes) {
      Config c;
      c.kv_dtype = kv_dtype;
      c.q_dtype = i % 2 == 0 ? DType::kFloat32 : DType::kFloat16;
      c.num_heads = shape.heads;
      c.num_kv_heads = shape.kv_heads;
      c.head_dim = shape.head_dim;
      c.value_dim = shape.value_dim;
      c.num_queries = 21;
      c.mask.query_start = 1100;  // 3 chunks of keys
      if (i % 3 == 1) {
        c.mask.window = 300;
        c.mask.num_sink_tokens = 4;
      }
      if (i % 3 == 2) {
        c.sink_logits.assign(shape.heads, 0.0f);
        for (int h = 0; h < shape.heads; ++h) c.sink_logits[h] = 0.5f * h - 1;
      }
      c.want_weights = i % 4 == 0;
      c.seed = 100 + i;
      configs.push_back(c);
      ++i;
    }
  }
  return configs;
}

class CpuBackendIsaTest : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!CpuIsaSupported(GetParam())) {
      GTEST_SKIP() << "this processor or build cannot run the "
                   << CpuIsaName(GetParam()) << " kernels";
    }
    backend_ = Make(3);
    scalar_ = *CpuBackend::Create(3, CpuIsa::kScalar);
  }

  std::unique_ptr<CpuBackend> Make(int threads) {
    absl::StatusOr<std::unique_ptr<CpuBackend>> backend =
        CpuBackend::Create(threads, GetParam());
    EXPECT_TRUE(backend.ok()) << backend.status();
    return *std::move(backend);
  }

  std::unique_ptr<CpuBackend> backend_;
  std::unique_ptr<CpuBackend> scalar_;
};

TEST_P(CpuBackendIsaTest, DeviceNamesTheIsa) {
  EXPECT_EQ(backend_->isa(), GetParam());
  EXPECT_THAT(
      backend_->device(),
      HasSubstr(absl::StrCat("(", CpuIsaName(GetParam()), ", 3 threads)")));
}

TEST_P(CpuBackendIsaTest, MatchesTheReference) {
  for (const Config& config : IsaConfigs()) {
    SCOPED_TRACE(ConfigName(config));
    Case c(config);
    CheckAgainstReference(*backend_, c);
  }
}

TEST_P(CpuBackendIsaTest, IsBitwiseTheScalarKernels) {
  for (const Config& config : IsaConfigs()) {
    SCOPED_TRACE(ConfigName(config));
    Case c(config);
    const AttentionProblem problem = c.Problem();
    ASSERT_TRUE(scalar_->Attend({&problem, 1}).ok());
    const std::vector<float> output = c.output, lse = c.lse,
                             weights = c.weights;
    c.ResetOutputs();
    ASSERT_TRUE(backend_->Attend({&problem, 1}).ok());
    ExpectBitwiseEqual(c.output, output, "output");
    ExpectBitwiseEqual(c.lse, lse, "lse");
    ExpectBitwiseEqual(c.weights, weights, "weights");
  }
}

TEST_P(CpuBackendIsaTest, SplitDecodeIsBitwiseSingleThreadAndPrefill) {
  // A lone decode problem with 2 KV heads has fewer units than threads, so
  // its chunks run as separate pieces merged afterwards; one thread runs
  // each unit whole. Both must equal the row of a 16-row prefill over the
  // same keys, for every kind of layer. On 8 threads 5 chunks make a piece
  // each; on 2 threads 44 chunks make pieces of 3 (the last one of 2).
  struct Split {
    int threads;
    int64_t keys;
  };
  std::unique_ptr<CpuBackend> one_thread = Make(1);
  for (const Split split : {Split{8, 2100}, Split{2, 22100}}) {
    std::unique_ptr<CpuBackend> split_backend = Make(split.threads);
    for (int variant = 0; variant < 4; ++variant) {
      Config config;
      config.num_heads = 8;
      config.num_kv_heads = 2;
      config.head_dim = 64;
      config.value_dim = 64;
      config.kv_dtype = variant == 1   ? DType::kFloat32
                        : variant == 3 ? DType::kBFloat16
                                       : DType::kFloat16;
      config.num_queries = 16;
      config.mask.query_start = split.keys - 16;
      if (variant == 1) {
        config.mask.window = 1000;
        config.mask.num_sink_tokens = 3;
      }
      if (variant == 2) config.sink_logits = {1, 0, -1, 2, 0.5, 0, 0, 3};
      if (variant == 3) {  // two key ranges: the sinks and the window
        config.mask.window = 1500;
        config.mask.num_sink_tokens = 4;
      }
      config.seed = 7 + variant;
      SCOPED_TRACE(absl::StrCat(ConfigName(config), ", ", split.threads,
                                " threads, ", split.keys, " keys"));
      Case c(config);
      const AttentionProblem prefill = c.Problem();
      ASSERT_TRUE(one_thread->Attend({&prefill, 1}).ok());
      const std::vector<float> prefill_output = c.output;
      const std::vector<float> prefill_lse = c.lse;

      // The last row as a decode step over paged blocks of 7 tokens.
      const PagedKv paged = WritePaged(*backend_, c, 7, 300);
      const int64_t row = 15;
      const int64_t row_floats = config.num_heads * config.value_dim;
      TensorView q = c.q.view();
      const int64_t q_row_bytes =
          config.num_heads * config.head_dim * DTypeSize(config.q_dtype);
      q.shape[0] = 1;
      q.data += row * q_row_bytes;
      q.size_bytes = q_row_bytes;
      for (CpuBackend* backend : {one_thread.get(), split_backend.get()}) {
        std::vector<float> output(row_floats, 12345.0f);
        std::vector<float> lse(config.num_heads, 12345.0f);
        AttentionProblem decode = prefill;
        decode.q = q;
        decode.kv = paged.view(split.keys);
        decode.mask.query_start = split.keys - 1;
        decode.output = output.data();
        decode.lse = lse.data();
        ASSERT_TRUE(backend->Attend({&decode, 1}).ok());
        ExpectBitwiseEqual(
            output,
            std::vector<float>(prefill_output.begin() + row * row_floats,
                               prefill_output.begin() + (row + 1) * row_floats),
            absl::StrCat(backend->num_threads(), "-thread decode output")
                .c_str());
        ExpectBitwiseEqual(
            lse,
            std::vector<float>(
                prefill_lse.begin() + row * config.num_heads,
                prefill_lse.begin() + (row + 1) * config.num_heads),
            "decode lse");
      }
    }
  }
}

TEST_P(CpuBackendIsaTest, SplitPrefillChunksAreBitwiseUnsplit) {
  // Two rows over a long causal history with learned sinks: split on 8
  // threads (2 units), whole on one thread.
  Config config;
  config.num_queries = 2;
  config.num_heads = 4;
  config.num_kv_heads = 1;
  config.head_dim = 32;
  config.value_dim = 16;
  config.mask.query_start = 3000;
  config.sink_logits = {0.1f, 0.2f, 0.3f, 0.4f};
  Case c(config);
  const AttentionProblem problem = c.Problem();
  ASSERT_TRUE(Make(1)->Attend({&problem, 1}).ok());
  const std::vector<float> output = c.output, lse = c.lse;
  c.ResetOutputs();
  ASSERT_TRUE(Make(8)->Attend({&problem, 1}).ok());
  ExpectBitwiseEqual(c.output, output, "output");
  ExpectBitwiseEqual(c.lse, lse, "lse");
}

TEST_P(CpuBackendIsaTest, SplitUnitsReportTheFirstError) {
  // The empty row of a split unit (found while merging) and an overflow in
  // a later problem: the earlier problem's error wins on any thread count.
  Config empty;
  empty.num_queries = 1;
  empty.num_keys = 2000;
  empty.mask.causal = false;
  empty.bias_rank = 2;
  empty.masked_bias_fraction = 1.0;
  Config overflow;
  overflow.num_queries = 1;
  overflow.num_keys = 40;
  overflow.mask.causal = false;
  Case a(empty), b(overflow);
  const float big = std::sqrt(0.75f * std::numeric_limits<float>::max());
  b.q = testing::Store(DType::kFloat32, b.q.shape,
                       std::vector<float>(b.q.values.size(), big));
  b.k = testing::Store(DType::kFloat32, b.k.shape,
                       std::vector<float>(b.k.values.size(), big));
  for (int threads : {1, 8}) {
    const std::vector<AttentionProblem> batch = {a.Problem(), b.Problem()};
    const absl::Status status = Make(threads)->Attend(batch);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr("problem 0: query row 0 "));
  }
}

// Finite values whose weighted sum overflows float32 before the softmax
// divides it: INVALID_ARGUMENT on every ISA and thread count (split or
// not), never an inf or NaN output. Two keys of equal logit and v = 3e38
// sum to inf; 32 such keys and a 33rd far ahead (alpha flushes to 0) make
// 0 * inf = NaN.
TEST_P(CpuBackendIsaTest, OverflowingValueSumsAreRejected) {
  for (int keys : {2, 33, 3000}) {
    SCOPED_TRACE(keys);
    Config config;
    config.num_queries = 1;
    config.num_keys = keys;
    config.num_heads = 1;
    config.num_kv_heads = 1;
    config.head_dim = 16;
    config.value_dim = 16;
    config.scale = 1.0f;
    config.mask.causal = false;
    Case c(config);
    std::vector<float> q(16, 0.0f), k(keys * 16, 0.0f), v(keys * 16, 1.0f);
    for (int j = 0; j < keys; ++j) v[j * 16] = 3e38f;
    if (keys == 33) {
      q[0] = 10.0f;
      k[32 * 16] = 10.0f;  // logit 100
      v[32 * 16] = 1.0f;
    }
    c.q = testing::Store(DType::kFloat32, c.q.shape, q);
    c.k = testing::Store(DType::kFloat32, c.k.shape, k);
    c.v = testing::Store(DType::kFloat32, c.v.shape, v);
    for (int threads : {1, 2, 5}) {
      const AttentionProblem problem = c.Problem();
      const absl::Status status = Make(threads)->Attend({&problem, 1});
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << threads;
      EXPECT_THAT(status.message(),
                  HasSubstr("weighted sum of the values overflowed"));
    }
  }
}

// A row whose visible products underflow to -0 (tiny values far behind
// its largest logit) gets the same zero whether or not later rows of a
// causal prefill share its last tile (their keys add +0 * v to it): one
// token's output, alone or prefilled with the next, bit for bit.
TEST_P(CpuBackendIsaTest, AZeroOutputDoesNotDependOnLaterRows) {
  constexpr int kDim = 16;
  std::vector<float> k(66 * kDim, 0.0f), v(66 * kDim, 0.0f);
  v[0] = -1e-30f;
  for (int j = 32; j < 64; ++j) k[j * kDim] = 80.0f;  // logit 80
  v[64 * kDim] = -1e-20f;  // the row's own key: logit 0
  v[65 * kDim] = 1.0f;     // the next row's key
  std::vector<float> first_row;
  for (int rows : {1, 2}) {
    SCOPED_TRACE(rows);
    Config config;
    config.num_queries = rows;
    config.num_heads = 1;
    config.num_kv_heads = 1;
    config.scale = 1.0f;
    config.mask.causal = true;
    config.mask.query_start = 64;
    Case c(config);
    std::vector<float> q(rows * kDim, 0.0f);
    for (int r = 0; r < rows; ++r) q[r * kDim] = 1.0f;
    const int64_t keys = 64 + rows;
    c.q = testing::Store(DType::kFloat32, c.q.shape, q);
    c.k = testing::Store(DType::kFloat32, c.k.shape,
                         {k.begin(), k.begin() + keys * kDim});
    c.v = testing::Store(DType::kFloat32, c.v.shape,
                         {v.begin(), v.begin() + keys * kDim});
    const AttentionProblem problem = c.Problem();
    ASSERT_TRUE(Make(1)->Attend({&problem, 1}).ok());
    const std::vector<float> row(c.output.begin(), c.output.begin() + kDim);
    EXPECT_EQ(row[0], 0.0f);
    if (first_row.empty()) {
      first_row = row;
    } else {
      ExpectBitwiseEqual(row, first_row, "row 64");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, CpuBackendIsaTest,
                         ::testing::Values(CpuIsa::kScalar, CpuIsa::kAvx2,
                                           CpuIsa::kAvx512),
                         [](const ::testing::TestParamInfo<CpuIsa>& info) {
                           return std::string(CpuIsaName(info.param));
                         });

TEST(CpuBackendCreateTest, UnsupportedIsaIsFailedPrecondition) {
  for (CpuIsa isa : kAllIsas) {
    if (CpuIsaSupported(isa)) {
      EXPECT_TRUE(CpuBackend::Create(1, isa).ok()) << CpuIsaName(isa);
      continue;
    }
    const absl::Status status = CpuBackend::Create(1, isa).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(status.message(), HasSubstr(CpuIsaName(isa)));
    return;
  }
  GTEST_SKIP() << "this machine supports every kernel ISA";
}

}  // namespace
}  // namespace attention
