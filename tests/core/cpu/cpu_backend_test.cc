#include "core/cpu/cpu_backend.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/cpu/attention_case.h"
#include "tests/core/reference_attention.h"

namespace attention {
namespace {

using ::attention::testing::Case;
using ::attention::testing::CheckAgainstReference;
using ::attention::testing::Config;
using ::attention::testing::ExpectBitwiseEqual;
using ::attention::testing::ExpectClose;
using ::attention::testing::Normal;
using ::attention::testing::PagedKv;
using ::attention::testing::ReferenceAttention;
using ::attention::testing::ReferenceInputs;
using ::attention::testing::ReferenceKeyVisible;
using ::attention::testing::ReferenceOutputs;
using ::attention::testing::Store;
using ::attention::testing::Stored;
using ::attention::testing::WritePaged;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kFloatMax = std::numeric_limits<float>::max();

class CpuBackendTest : public ::testing::Test {
 protected:
  CpuBackend backend_{3};
};

TEST_F(CpuBackendTest, NameAndDevice) {
  EXPECT_EQ(backend_.name(), "cpu");
  EXPECT_EQ(backend_.num_threads(), 3);
  EXPECT_THAT(backend_.device(), HasSubstr("3 threads"));
}

TEST_F(CpuBackendTest, CausalPrefillMatchesReference) {
  Config config;
  config.num_queries = 77;
  config.want_weights = true;
  Case c(config);
  CheckAgainstReference(backend_, c);
}

TEST_F(CpuBackendTest, NonCausalMatchesReference) {
  Config config;
  config.num_queries = 5;
  config.num_keys = 70;
  config.mask.causal = false;
  config.want_weights = true;
  Case c(config);
  CheckAgainstReference(backend_, c);
}

TEST_F(CpuBackendTest, SlidingWindowMatchesReference) {
  Config config;
  config.num_queries = 100;
  config.mask.window = 16;
  config.want_weights = true;
  Case c(config);
  CheckAgainstReference(backend_, c);
}

TEST_F(CpuBackendTest, WindowWithSinkTokensMatchesReference) {
  Config config;
  config.num_queries = 150;
  config.mask.window = 20;
  config.mask.num_sink_tokens = 4;
  config.want_weights = true;
  Case c(config);
  CheckAgainstReference(backend_, c);
  // A late query sees the 4 sink tokens and its 20-token window, nothing
  // else.
  const int64_t row = 149;
  for (int64_t j = 0; j < 150; ++j) {
    const float w = c.weights[(0 * 150 + row) * 150 + j];
    const bool visible = j < 4 || j > row - 20;
    EXPECT_EQ(w > 0.0f, visible) << "key " << j;
  }
}

TEST_F(CpuBackendTest, LearnedSinkLogitsMatchReference) {
  Config config;
  config.num_queries = 40;
  config.sink_logits = {0.5f, -1.0f, 2.0f, 3.0f};
  config.want_weights = true;
  Case c(config);
  CheckAgainstReference(backend_, c);
  // The sink takes part of the mass: token weights sum to less than 1.
  for (int h = 0; h < 4; ++h) {
    for (int64_t i = 0; i < 40; ++i) {
      double sum = 0;
      for (int64_t j = 0; j < 40; ++j) sum += c.weights[(h * 40 + i) * 40 + j];
      EXPECT_LT(sum, 1.0);
      EXPECT_GT(sum, 0.0);
    }
  }
}

TEST_F(CpuBackendTest, LearnedSinkWithAllKeysMaskedGivesZeros) {
  Config config;
  config.num_queries = 6;
  config.sink_logits = {0.5f, -1.0f, 2.0f, 3.0f};
  config.bias_rank = 2;
  config.masked_bias_fraction = 1.0;  // every key masked
  config.want_weights = true;
  Case c(config);
  CheckAgainstReference(backend_, c);
  for (float x : c.output) EXPECT_EQ(x, 0.0f);
  for (float x : c.weights) EXPECT_EQ(x, 0.0f);
  // The denominator is the sink alone: lse = sink logit.
  for (int64_t i = 0; i < 6; ++i) {
    for (int h = 0; h < 4; ++h) {
      EXPECT_FLOAT_EQ(c.lse[i * 4 + h], config.sink_logits[h]);
    }
  }
}

TEST_F(CpuBackendTest, GqaRepeatsKvHeadsAndNeverTiles) {
  Config config;
  config.num_queries = 20;
  config.num_heads = 8;
  config.num_kv_heads = 2;
  Case c(config);
  CheckAgainstReference(backend_, c);
  ReferenceInputs tiled = c.ReferenceIn();
  tiled.tile_kv_heads = true;
  absl::StatusOr<ReferenceOutputs> wrong = ReferenceAttention(tiled);
  ASSERT_TRUE(wrong.ok());
  double max_diff = 0;
  for (size_t i = 0; i < c.output.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(c.output[i] - wrong->output[i]));
  }
  EXPECT_GT(max_diff, 1e-3) << "tile order must give a different answer";
}

TEST_F(CpuBackendTest, MultiQueryAndMultiHeadAttention) {
  for (int num_kv_heads : {1, 6}) {
    Config config;
    config.num_queries = 33;
    config.num_heads = 6;
    config.num_kv_heads = num_kv_heads;
    Case c(config);
    CheckAgainstReference(backend_, c);
  }
}

TEST_F(CpuBackendTest, EmptyRowErrorNamesTheRow) {
  Config config;
  config.num_queries = 4;
  config.mask.causal = false;
  config.num_keys = 9;
  config.bias_rank = 2;
  Case c(config);
  for (int64_t j = 0; j < 9; ++j) {
    float minus_inf = -kInf;
    std::memcpy(c.bias.bytes.data() + (2 * 9 + j) * 4, &minus_inf, 4);
  }
  const AttentionProblem problem = c.Problem();
  absl::Status status = backend_.Attend({&problem, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("query row 2"));
  EXPECT_THAT(status.message(), HasSubstr("ZERO"));
}

TEST_F(CpuBackendTest, EmptyRowZeroPolicyGivesZerosAndNegativeInfinityLse) {
  Config config;
  config.num_queries = 4;
  config.num_keys = 40;
  config.mask.causal = false;
  config.bias_rank = 3;
  config.masked_bias_fraction = 0.3;
  config.policy = EmptyRowPolicy::kZero;
  config.want_weights = true;
  Case c(config);
  // Row 1 of head 2 sees nothing.
  for (int64_t j = 0; j < 40; ++j) {
    float minus_inf = -kInf;
    std::memcpy(c.bias.bytes.data() + ((2 * 4 + 1) * 40 + j) * 4, &minus_inf,
                4);
    c.bias.values[(2 * 4 + 1) * 40 + j] = minus_inf;
  }
  CheckAgainstReference(backend_, c);
  EXPECT_EQ(c.lse[1 * 4 + 2], -kInf);
  for (int d = 0; d < 16; ++d) EXPECT_EQ(c.output[(1 * 4 + 2) * 16 + d], 0.0f);
  for (int64_t j = 0; j < 40; ++j) {
    EXPECT_EQ(c.weights[(2 * 4 + 1) * 40 + j], 0.0f);
  }
}

TEST_F(CpuBackendTest, HalfPrecisionInputsMatchReference) {
  for (DType kv_dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (DType q_dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
      Config config;
      config.num_queries = 45;
      config.q_dtype = q_dtype;
      config.kv_dtype = kv_dtype;
      config.mask.window = 24;
      Case c(config);
      CheckAgainstReference(backend_, c);
    }
  }
}

TEST_F(CpuBackendTest, WeightsSumToOneWithoutSinks) {
  Config config;
  config.num_queries = 50;
  config.want_weights = true;
  config.mask.window = 10;
  Case c(config);
  CheckAgainstReference(backend_, c);
  for (int h = 0; h < 4; ++h) {
    for (int64_t i = 0; i < 50; ++i) {
      double sum = 0;
      for (int64_t j = 0; j < 50; ++j) sum += c.weights[(h * 50 + i) * 50 + j];
      EXPECT_NEAR(sum, 1.0, 1e-5);
    }
  }
}

TEST_F(CpuBackendTest, BiasMatchesReference) {
  for (int rank : {2, 3}) {
    Config config;
    config.num_queries = 37;
    config.num_keys = 70;
    config.mask.causal = false;
    config.bias_rank = rank;
    config.masked_bias_fraction = 0.4;
    config.policy = EmptyRowPolicy::kZero;
    config.want_weights = true;
    Case c(config);
    CheckAgainstReference(backend_, c);
  }
  // Bias together with a causal mask.
  Config config;
  config.num_queries = 40;
  config.bias_rank = 3;
  config.masked_bias_fraction = 0.2;
  config.policy = EmptyRowPolicy::kZero;
  Case c(config);
  CheckAgainstReference(backend_, c);
}

TEST_F(CpuBackendTest, LogitOverflowIsRejected) {
  const float big = std::sqrt(0.75f * kFloatMax);
  Config config;
  config.num_queries = 1;
  config.num_heads = 1;
  config.num_kv_heads = 1;
  config.head_dim = 2;
  config.value_dim = 1;
  config.scale = 1.0f;
  Case c(config);
  for (Stored* s : {&c.q, &c.k})
    *s = Store(DType::kFloat32, s->shape, {big, big});
  c.v = Store(DType::kFloat32, c.v.shape, {1.0f});
  const AttentionProblem problem = c.Problem();
  absl::Status status = backend_.Attend({&problem, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("overflowed"));
  EXPECT_THAT(status.message(), HasSubstr("rescale"));
}

TEST_F(CpuBackendTest, OnlyVisibleLogitsAreChecked) {
  const float big = std::sqrt(0.75f * kFloatMax);
  Config config;
  config.num_queries = 1;
  config.num_keys = 2;
  config.num_heads = 1;
  config.num_kv_heads = 1;
  config.head_dim = 2;
  config.value_dim = 1;
  config.scale = 1.0f;
  Case c(config);
  c.q = Store(DType::kFloat32, c.q.shape, {big, big});
  // Key 0 is harmless; key 1 would overflow but lies in the causal future.
  c.k = Store(DType::kFloat32, c.k.shape, {0.0f, 1e-30f, big, big});
  c.v = Store(DType::kFloat32, c.v.shape, {3.0f, 5.0f});
  const AttentionProblem problem = c.Problem();
  ASSERT_TRUE(backend_.Attend({&problem, 1}).ok());
  EXPECT_EQ(c.output[0], 3.0f);
}

TEST_F(CpuBackendTest, BiasOverflowIsRejected) {
  // The seeds' case: a finite score and a finite bias whose sum overflows.
  const float big = std::sqrt(0.75f * kFloatMax);
  for (float sign : {1.0f, -1.0f}) {
    Config config;
    config.num_queries = 1;
    config.num_heads = 1;
    config.num_kv_heads = 1;
    config.head_dim = 1;
    config.value_dim = 1;
    config.scale = 1.0f;
    config.mask.causal = false;
    config.bias_rank = 2;
    Case c(config);
    c.q = Store(DType::kFloat32, c.q.shape, {big});
    c.k = Store(DType::kFloat32, c.k.shape, {sign * big});
    c.v = Store(DType::kFloat32, c.v.shape, {1.0f});
    c.bias = Store(DType::kFloat32, c.bias.shape, {sign * 0.75f * kFloatMax});
    const AttentionProblem problem = c.Problem();
    absl::Status status = backend_.Attend({&problem, 1});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr("bias overflowed"));
    EXPECT_FALSE(ReferenceAttention(c.ReferenceIn()).ok());
  }
}

TEST_F(CpuBackendTest, ValueDimDiffersFromHeadDim) {
  for (auto [head_dim, value_dim] :
       {std::pair{16, 24}, std::pair{5, 3}, std::pair{40, 7}}) {
    Config config;
    config.num_queries = 35;
    config.head_dim = head_dim;
    config.value_dim = value_dim;
    config.sink_logits = {0.1f, 0.2f, 0.3f, 0.4f};
    config.want_weights = true;
    Case c(config);
    CheckAgainstReference(backend_, c);
  }
}

TEST_F(CpuBackendTest, QueryStartOffsetsPositions) {
  Config config;
  config.num_queries = 10;
  config.mask.query_start = 50;
  config.mask.window = 30;
  config.mask.num_sink_tokens = 2;
  config.want_weights = true;
  Case c(config);
  ASSERT_EQ(c.config().num_keys, 60);
  CheckAgainstReference(backend_, c);
}

TEST_F(CpuBackendTest, LongContextSpansSeveralChunks) {
  {
    Config config;
    config.num_queries = 20;
    config.mask.query_start = 1480;  // T_k = 1500 > 2 * kKeysPerSplit
    config.sink_logits = {1.0f, 0.0f, -1.0f, 2.0f};
    config.want_weights = true;
    Case c(config);
    CheckAgainstReference(backend_, c);
  }
  {
    Config config;
    config.num_queries = 1500;
    config.head_dim = 8;
    config.value_dim = 8;
    config.num_heads = 2;
    config.num_kv_heads = 1;
    Case c(config);
    CheckAgainstReference(backend_, c);
  }
  {
    Config config;
    config.num_queries = 600;
    config.mask.window = 100;
    config.mask.num_sink_tokens = 3;
    config.head_dim = 8;
    config.value_dim = 8;
    Case c(config);
    CheckAgainstReference(backend_, c);
  }
}

TEST_F(CpuBackendTest, OnlineSoftmaxTraceAcrossTwoTiles) {
  // The seeds' online-softmax trace: logits [2, 1 | 3, 0.5] with values
  // [1, 2 | 3, 4], placed at positions 0, 1 (tile 0) and 32, 33 (tile 1).
  static_assert(kKeysPerTile == 32);
  Config config;
  config.num_queries = 1;
  config.num_keys = 34;
  config.num_heads = 1;
  config.num_kv_heads = 1;
  config.head_dim = 1;
  config.value_dim = 1;
  config.scale = 1.0f;
  config.mask.causal = false;
  config.bias_rank = 2;
  Case c(config);
  std::vector<float> keys(34, 0.0f), values(34, 0.0f), bias(34, -kInf);
  const int positions[4] = {0, 1, 32, 33};
  const float logits[4] = {2.0f, 1.0f, 3.0f, 0.5f};
  for (int i = 0; i < 4; ++i) {
    keys[positions[i]] = logits[i];
    values[positions[i]] = static_cast<float>(i + 1);
    bias[positions[i]] = 0.0f;
  }
  c.q = Store(DType::kFloat32, c.q.shape, {1.0f});
  c.k = Store(DType::kFloat32, c.k.shape, keys);
  c.v = Store(DType::kFloat32, c.v.shape, values);
  c.bias = Store(DType::kFloat32, c.bias.shape, bias);
  const AttentionProblem problem = c.Problem();
  ASSERT_TRUE(backend_.Attend({&problem, 1}).ok());
  // Frozen in the seeds: output 2.502296533903012, final denominator
  // l2 = 1.5852997230319539 relative to the running max 3.
  EXPECT_NEAR(c.output[0], 2.502296533903012, 1e-6);
  EXPECT_NEAR(c.lse[0], 3.0 + std::log(1.5852997230319539), 1e-6);
}

// ---- Paged views, eviction and bitwise determinism -------------------------

TEST_F(CpuBackendTest, WriteKvStoresTheBlockLayout) {
  Config config;
  config.num_queries = 1;
  config.num_keys = 10;
  config.num_kv_heads = 2;
  config.value_dim = 3;
  Case c(config);
  const PagedKv paged = WritePaged(backend_, c, 4, 3);
  for (int64_t pos = 0; pos < 10; ++pos) {
    const std::byte* block = paged.blocks[pos / 4];
    for (int h = 0; h < 2; ++h) {
      const float* key =
          reinterpret_cast<const float*>(block) + (h * 4 + pos % 4) * 16;
      const float* value = reinterpret_cast<const float*>(
                               block + paged.layout.value_offset_bytes()) +
                           (h * 4 + pos % 4) * 3;
      for (int d = 0; d < 16; ++d) {
        EXPECT_EQ(key[d], c.k.values[(pos * 2 + h) * 16 + d]);
      }
      for (int d = 0; d < 3; ++d) {
        EXPECT_EQ(value[d], c.v.values[(pos * 2 + h) * 3 + d]);
      }
    }
  }
}

TEST_F(CpuBackendTest, WriteKvConvertsToTheStorageDtype) {
  Config config;
  config.num_queries = 1;
  config.num_keys = 9;
  Case c(config);  // float32 inputs
  PagedKv paged;
  paged.layout = {DType::kFloat16, 2, 16, 16, 5};
  auto arena = backend_.AllocateArena(2 * paged.layout.used_bytes());
  ASSERT_TRUE(arena.ok());
  paged.arena = *std::move(arena);
  paged.blocks = {paged.arena->data(),
                  paged.arena->data() + paged.layout.used_bytes()};
  KvWrite write;
  write.layout = paged.layout;
  write.k = c.k.view();
  write.v = c.v.view();
  write.blocks = paged.blocks;
  ASSERT_TRUE(backend_.WriteKv(write).ok());
  const std::vector<const std::byte*> k_blocks(paged.blocks.begin(),
                                               paged.blocks.end());
  const KvView view = PagedKvView(paged.layout, 9, k_blocks, {});
  for (int64_t pos = 0; pos < 9; ++pos) {
    for (int h = 0; h < 2; ++h) {
      float key[16];
      ConvertToFloat(DType::kFloat16, view.key(pos, h), 16, key);
      for (int d = 0; d < 16; ++d) {
        EXPECT_EQ(key[d],
                  HalfToFloat(FloatToHalf(c.k.values[(pos * 2 + h) * 16 + d])));
      }
    }
  }
}

TEST_F(CpuBackendTest, WriteKvRejectsMissingBlock) {
  Config config;
  config.num_queries = 1;
  config.num_keys = 9;
  Case c(config);
  KvBlockLayout layout = {DType::kFloat32, 2, 16, 16, 5};
  std::vector<std::byte> memory(layout.used_bytes());
  std::vector<std::byte*> blocks = {memory.data(), nullptr};
  KvWrite write;
  write.layout = layout;
  write.k = c.k.view();
  write.v = c.v.view();
  write.blocks = blocks;
  EXPECT_EQ(backend_.WriteKv(write).code(), absl::StatusCode::kInternal);
}

TEST_F(CpuBackendTest, ArenaIsAlignedAndCopyBlockCopies) {
  auto arena = backend_.AllocateArena(1000);
  ASSERT_TRUE(arena.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*arena)->data()) % 64, 0u);
  EXPECT_EQ((*arena)->size_bytes(), 1000);
  std::byte* data = (*arena)->data();
  for (int i = 0; i < 100; ++i) data[i] = std::byte(i);
  ASSERT_TRUE(backend_.CopyBlock(data, data + 500, 100).ok());
  EXPECT_EQ(std::memcmp(data, data + 500, 100), 0);
  EXPECT_EQ(backend_.AllocateArena(-1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CpuBackendTest, LargeArenaIsUsableAtBothEnds) {
  // 4 GiB: the arena only reserves memory, so this stays cheap; touch the
  // first and the last block.
  const int64_t size = int64_t{4} << 30;
  auto arena = backend_.AllocateArena(size);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ((*arena)->size_bytes(), size);
  std::byte* data = (*arena)->data();
  data[0] = std::byte{1};
  data[size - 1] = std::byte{2};
  ASSERT_TRUE(backend_.CopyBlock(data + size - 1, data + 1, 1).ok());
  EXPECT_EQ(data[1], std::byte{2});
}

TEST_F(CpuBackendTest, PagedViewWithEvictedBlocksIsBitwiseContiguous) {
  for (DType kv_dtype : {DType::kFloat32, DType::kFloat16}) {
    Config config;
    config.num_queries = 10;
    config.mask.query_start = 1490;  // T_k = 1500
    config.mask.window = 100;
    config.mask.num_sink_tokens = 4;
    config.kv_dtype = kv_dtype;
    config.sink_logits = {0.3f, 0.2f, 0.1f, 0.0f};
    Case c(config);
    const AttentionProblem contiguous = c.Problem();
    ASSERT_TRUE(backend_.Attend({&contiguous, 1}).ok());
    const std::vector<float> want_output = c.output;
    const std::vector<float> want_lse = c.lse;

    PagedKv paged = WritePaged(backend_, c, /*tokens_per_block=*/7,
                               /*write_chunk=*/11);
    // Evict every block no query can see, as a window layer would.
    int evicted = 0;
    for (size_t b = 0; b < paged.k_blocks.size(); ++b) {
      bool needed = false;
      for (int64_t pos = b * 7; pos < std::min<int64_t>((b + 1) * 7, 1500);
           ++pos) {
        for (int64_t i = 0; i < 10; ++i) {
          needed |= ReferenceKeyVisible(config.mask, 1490 + i, pos);
        }
      }
      if (!needed) {
        paged.k_blocks[b] = nullptr;
        paged.v_blocks[b] = nullptr;
        ++evicted;
      }
    }
    EXPECT_GT(evicted, 180);
    c.ResetOutputs();
    const AttentionProblem problem = c.ProblemWith(paged.view(1500));
    ASSERT_TRUE(backend_.Attend({&problem, 1}).ok());
    ExpectBitwiseEqual(c.output, want_output, "paged output");
    ExpectBitwiseEqual(c.lse, want_lse, "paged lse");

    // The same blocks listed without the run dropped between the sinks and
    // the window, as a window layer's table lists them.
    size_t gap_begin = 0;
    while (paged.k_blocks[gap_begin] != nullptr) ++gap_begin;
    size_t gap_end = gap_begin;
    while (paged.k_blocks[gap_end] == nullptr) ++gap_end;
    std::vector<const std::byte*> k_listed = paged.k_blocks;
    std::vector<const std::byte*> v_listed = paged.v_blocks;
    k_listed.erase(k_listed.begin() + gap_begin, k_listed.begin() + gap_end);
    v_listed.erase(v_listed.begin() + gap_begin, v_listed.begin() + gap_end);
    EXPECT_GT(gap_end - gap_begin, 180u);
    c.ResetOutputs();
    const AttentionProblem listed = c.ProblemWith(PagedKvView(
        paged.layout, 1500, k_listed, v_listed, static_cast<int64_t>(gap_begin),
        static_cast<int64_t>(gap_end - gap_begin)));
    ASSERT_TRUE(backend_.Attend({&listed, 1}).ok());
    ExpectBitwiseEqual(c.output, want_output, "listed output");
    ExpectBitwiseEqual(c.lse, want_lse, "listed lse");
  }
}

// Configurations for the determinism tests: plain causal, window + sink
// tokens, a wide window, learned sinks, all over more than one chunk.
std::vector<Config> DeterminismConfigs() {
  std::vector<Config> configs;
  Config causal;
  causal.num_queries = 600;
  causal.head_dim = 24;
  causal.value_dim = 20;
  configs.push_back(causal);
  Config window = causal;
  window.mask.window = 70;
  window.mask.num_sink_tokens = 5;
  window.kv_dtype = DType::kBFloat16;
  configs.push_back(window);
  Config wide_window = causal;  // windows straddling a chunk boundary
  wide_window.num_queries = 1100;
  wide_window.mask.window = 530;
  configs.push_back(wide_window);
  Config sinks = causal;
  sinks.sink_logits = {2.0f, -2.0f, 0.0f, 1.0f};
  sinks.q_dtype = DType::kFloat16;
  configs.push_back(sinks);
  // Half-precision rows of a whole number of vectors: decode units read
  // them in place, prefill units of this many row-heads widen them per tile.
  for (DType kv_dtype : {DType::kFloat16, DType::kBFloat16}) {
    Config gqa = causal;
    gqa.num_heads = 8;
    gqa.num_kv_heads = 2;
    gqa.head_dim = 32;
    gqa.value_dim = 32;
    gqa.kv_dtype = kv_dtype;
    configs.push_back(gqa);
  }
  return configs;
}

TEST_F(CpuBackendTest, DecodeRowsAreBitwisePrefillRows) {
  for (const Config& config : DeterminismConfigs()) {
    Case c(config);
    const AttentionProblem prefill = c.Problem();
    ASSERT_TRUE(backend_.Attend({&prefill, 1}).ok());
    const std::vector<float> want_output = c.output;
    const std::vector<float> want_lse = c.lse;

    // One single-row problem per token over exactly the keys before it, all
    // in one batch (like a stream of decode steps).
    const int64_t T = config.num_queries;
    const int H = config.num_heads;
    std::vector<float> output(want_output.size()), lse(want_lse.size());
    std::vector<TensorView> q_rows(T), k_rows(T), v_rows(T);
    std::vector<std::array<const std::byte*, 2>> storage(T);
    std::vector<AttentionProblem> steps(T);
    const int64_t q_row_bytes = H * config.head_dim * DTypeSize(config.q_dtype);
    for (int64_t i = 0; i < T; ++i) {
      q_rows[i] = c.q.view();
      q_rows[i].shape[0] = 1;
      q_rows[i].data += i * q_row_bytes;
      q_rows[i].size_bytes = q_row_bytes;
      k_rows[i] = c.k.view();
      k_rows[i].shape[0] = i + 1;
      v_rows[i] = c.v.view();
      v_rows[i].shape[0] = i + 1;
      AttentionProblem& step = steps[i];
      step = prefill;
      step.q = q_rows[i];
      step.kv = ContiguousKvView(k_rows[i], v_rows[i], storage[i].data());
      step.mask.query_start = i;
      step.output = output.data() + i * H * config.value_dim;
      step.lse = lse.data() + i * H;
    }
    ASSERT_TRUE(backend_.Attend(steps).ok());
    ExpectBitwiseEqual(output, want_output, "decode output");
    ExpectBitwiseEqual(lse, want_lse, "decode lse");

    // Chunked prefill: uneven chunks, each over the keys up to its end.
    std::fill(output.begin(), output.end(), 0.0f);
    std::vector<AttentionProblem> chunks;
    std::vector<TensorView> views;
    views.reserve(64);
    std::vector<std::array<const std::byte*, 2>> chunk_storage(16);
    for (int64_t begin = 0, n = 1; begin < T; begin += n, n = n * 2 + 3) {
      const int64_t end = std::min(T, begin + n);
      views.push_back(c.q.view());
      TensorView& q = views.back();
      q.shape[0] = end - begin;
      q.data += begin * q_row_bytes;
      q.size_bytes = (end - begin) * q_row_bytes;
      views.push_back(c.k.view());
      views.back().shape[0] = end;
      views.push_back(c.v.view());
      views.back().shape[0] = end;
      AttentionProblem chunk = prefill;
      chunk.q = q;
      chunk.kv = ContiguousKvView(views[views.size() - 2], views.back(),
                                  chunk_storage[chunks.size()].data());
      chunk.mask.query_start = begin;
      chunk.output = output.data() + begin * H * config.value_dim;
      chunk.lse = lse.data() + begin * H;
      chunks.push_back(chunk);
    }
    ASSERT_TRUE(backend_.Attend(chunks).ok());
    ExpectBitwiseEqual(output, want_output, "chunked prefill output");
  }
}

TEST_F(CpuBackendTest, ThreadCountDoesNotChangeBits) {
  CpuBackend one_thread(1);
  CpuBackend four_threads(4);
  // The determinism configurations have units enough for every thread, so
  // they run whole; a few rows over a long history are split into pieces
  // of chunks on 4 threads.
  std::vector<Config> configs = DeterminismConfigs();
  for (int variant = 0; variant < 2; ++variant) {
    Config config;
    config.num_queries = variant == 0 ? 1 : 3;
    config.num_heads = 8;
    config.num_kv_heads = 2;
    config.head_dim = 64;
    config.value_dim = 64;
    config.kv_dtype = variant == 0 ? DType::kFloat16 : DType::kBFloat16;
    config.mask.query_start = 5000;
    if (variant == 1) {
      config.mask.window = 2000;
      config.mask.num_sink_tokens = 2;
      config.sink_logits = {1, 0, -1, 2, 0.5, 0, 0, 3};
    }
    config.seed = 40 + variant;
    configs.push_back(config);
  }
  for (const Config& config : configs) {
    Case c(config);
    const AttentionProblem problem = c.Problem();
    ASSERT_TRUE(one_thread.Attend({&problem, 1}).ok());
    const std::vector<float> want_output = c.output;
    const std::vector<float> want_lse = c.lse;
    c.ResetOutputs();
    ASSERT_TRUE(four_threads.Attend({&problem, 1}).ok());
    ExpectBitwiseEqual(c.output, want_output, "4-thread output");
    ExpectBitwiseEqual(c.lse, want_lse, "4-thread lse");
  }
}

// A problem's KV heads run as groups with their tiles interleaved when the
// layout keeps their rows of a tile together (token-major, or paged blocks
// of at most a tile of tokens), one head at a time otherwise, split into
// pieces or not depending on the threads. None of it changes a bit, nor
// the error reported.
TEST_F(CpuBackendTest, InterleavedKvHeadsDoNotChangeBits) {
  Config config;
  config.num_queries = 3;
  config.mask.query_start = 1400;  // three chunks
  config.num_heads = 24;
  config.num_kv_heads = 12;  // more than one group of interleaved heads
  config.head_dim = 32;
  config.value_dim = 32;
  config.kv_dtype = DType::kFloat16;
  Case c(config);
  const int64_t length = c.config().num_keys;
  CpuBackend one_thread(1);
  const AttentionProblem contiguous = c.Problem();
  ASSERT_TRUE(one_thread.Attend({&contiguous, 1}).ok());
  const std::vector<float> want_output = c.output;
  const std::vector<float> want_lse = c.lse;

  // Query heads 19 and 23 (KV heads 9 and 11) overflow Q.K: the error is
  // KV head 9's, however the heads are grouped.
  Case bad(config);
  std::vector<float> q = bad.q.values;
  for (int64_t r = 0; r < config.num_queries; ++r) {
    for (int head : {19, 23}) {
      float* row = q.data() + (r * config.num_heads + head) * config.head_dim;
      std::fill(row, row + config.head_dim, 3e38f);
    }
  }
  bad.q = Store(DType::kFloat32, bad.q.shape, q);
  const AttentionProblem bad_contiguous = bad.Problem();
  const absl::Status want_error = one_thread.Attend({&bad_contiguous, 1});
  ASSERT_EQ(want_error.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(want_error.message(), HasSubstr("head 19,"));

  for (int64_t tokens_per_block : {5, 100}) {
    const PagedKv paged = WritePaged(one_thread, c, tokens_per_block, 97);
    const PagedKv bad_paged = WritePaged(one_thread, bad, tokens_per_block, 97);
    for (int threads : {1, 2, 5}) {
      SCOPED_TRACE(::testing::Message()
                   << tokens_per_block << " tokens per block, " << threads
                   << " threads");
      CpuBackend backend(threads);
      c.ResetOutputs();
      const AttentionProblem problem = c.ProblemWith(paged.view(length));
      ASSERT_TRUE(backend.Attend({&problem, 1}).ok());
      ExpectBitwiseEqual(c.output, want_output, "output");
      ExpectBitwiseEqual(c.lse, want_lse, "lse");
      const AttentionProblem bad_problem =
          bad.ProblemWith(bad_paged.view(length));
      EXPECT_EQ(backend.Attend({&bad_problem, 1}), want_error);
    }
  }
}

TEST_F(CpuBackendTest, BatchCompanionsDoNotChangeBits) {
  Config a_config;
  a_config.num_queries = 70;
  a_config.mask.window = 20;
  a_config.mask.num_sink_tokens = 2;
  Config b_config;
  b_config.num_queries = 9;
  b_config.num_keys = 600;
  b_config.mask.causal = false;
  b_config.bias_rank = 3;
  b_config.masked_bias_fraction = 0.1;
  b_config.want_weights = true;
  b_config.num_heads = 2;
  b_config.num_kv_heads = 1;
  Config c_config;
  c_config.num_queries = 1;
  c_config.mask.query_start = 700;
  c_config.sink_logits = {1, 2, 3, 4};
  c_config.kv_dtype = DType::kFloat16;
  Case a(a_config), b(b_config), c(c_config);

  std::vector<std::vector<float>> alone;
  for (Case* x : {&a, &b, &c}) {
    const AttentionProblem problem = x->Problem();
    ASSERT_TRUE(backend_.Attend({&problem, 1}).ok());
    alone.push_back(x->output);
    alone.push_back(x->lse);
    alone.push_back(x->weights);
    x->ResetOutputs();
  }
  const std::vector<AttentionProblem> batch = {b.Problem(), c.Problem(),
                                               a.Problem()};
  ASSERT_TRUE(backend_.Attend(batch).ok());
  int i = 0;
  for (Case* x : {&a, &b, &c}) {
    ExpectBitwiseEqual(x->output, alone[i++], "batched output");
    ExpectBitwiseEqual(x->lse, alone[i++], "batched lse");
    ExpectBitwiseEqual(x->weights, alone[i++], "batched weights");
  }
}

// `num_queries` query rows of which none sees a key (the bias masks them
// all): Attend fails on query row 0 with the kError policy.
Config EmptyRows(int num_queries) {
  Config config;
  config.num_queries = num_queries;
  config.mask.causal = false;
  config.bias_rank = 2;
  config.masked_bias_fraction = 1.0;
  return config;
}

// An error names the problem by its index only when the call holds
// several; a problem alone is named by its rows.
TEST_F(CpuBackendTest, ErrorsNameTheProblemOnlyInABatch) {
  Config good;
  good.num_queries = 8;
  Case a(good), b(EmptyRows(4));
  const AttentionProblem alone = b.Problem();
  const absl::Status lone = backend_.Attend({&alone, 1});
  EXPECT_EQ(lone.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(lone.message().rfind("query row 0 (position ", 0), 0u) << lone;
  EXPECT_THAT(lone.message(), Not(HasSubstr("problem")));
  const std::vector<AttentionProblem> batch = {a.Problem(), b.Problem()};
  const absl::Status batched = backend_.Attend(batch);
  EXPECT_EQ(batched.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(batched.message().rfind("problem 1: query row 0 (position ", 0), 0u)
      << batched;
}

// `c`'s problem as a top-k problem (2 keys per row) with one index head of
// kIndexDim: index keys appended to a copy of its K bytes (the contiguous
// view's one block), random index keys and queries, both times
// `index_scale` (1e20 makes the index scores overflow), weights 1.
class TopKCase {
 public:
  static constexpr int kIndexDim = 4;

  TopKCase(Case& c, float index_scale) {
    const Config& config = c.config();
    std::mt19937 rng(11);
    std::vector<float> raw_keys = Normal(config.num_keys * kIndexDim, rng);
    for (float& x : raw_keys) x *= index_scale;
    const Stored index_keys =
        Store(config.kv_dtype, {config.num_keys, kIndexDim}, raw_keys);
    keys_ = c.k.bytes;
    keys_.insert(keys_.end(), index_keys.bytes.begin(), index_keys.bytes.end());
    std::vector<float> queries = Normal(config.num_queries * kIndexDim, rng);
    for (float& x : queries) x *= index_scale;
    index_q_ =
        Store(DType::kFloat32, {config.num_queries, 1, kIndexDim}, queries);
    weights_ = Store(DType::kFloat32, {config.num_queries, 1},
                     std::vector<float>(config.num_queries, 1.0f));
    k_view_ = c.k.view();
    k_view_.data = keys_.data();
    v_view_ = c.v.view();
    spec_.topk = 2;
    spec_.index_q = index_q_.view();
    spec_.index_weights = weights_.view();
    KvView kv = ContiguousKvView(k_view_, v_view_, storage_);
    kv.index_dim = kIndexDim;
    kv.index_offset_bytes = static_cast<int64_t>(c.k.bytes.size());
    problem_ = c.ProblemWith(kv);
    problem_.topk = &spec_;
  }

  const AttentionProblem& problem() const { return problem_; }

 private:
  std::vector<std::byte> keys_;
  Stored index_q_, weights_;
  TensorView k_view_, v_view_;
  const std::byte* storage_[2] = {};
  TopKSpec spec_;
  AttentionProblem problem_;
};

// In a call mixing top-k and dense problems, an error names the failing
// problem by its index in the call, whichever kind fails.
TEST_F(CpuBackendTest, MixedTopKAndDenseErrorsNameTheirIndexInTheCall) {
  Config good;
  good.num_queries = 6;
  Case sparse(good), overflowing(good), dense(good), empty(EmptyRows(4));
  const TopKCase topk(sparse, 1.0f), bad_topk(overflowing, 1e20f);

  const std::vector<AttentionProblem> ok = {topk.problem(), dense.Problem()};
  EXPECT_TRUE(backend_.Attend(ok).ok());

  // A dense failure after a top-k problem: its index among all problems.
  const std::vector<AttentionProblem> dense_fails = {topk.problem(),
                                                     empty.Problem()};
  const absl::Status dense_status = backend_.Attend(dense_fails);
  EXPECT_EQ(dense_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      dense_status.message().rfind("problem 1: query row 0 (position ", 0), 0u)
      << dense_status;

  // A top-k selection failure: named alone by positions, in a batch also by
  // its index.
  const absl::Status alone = backend_.Attend({&bad_topk.problem(), 1});
  EXPECT_EQ(alone.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alone.message().rfind("the index score of key ", 0), 0u) << alone;
  const std::vector<AttentionProblem> topk_fails = {dense.Problem(),
                                                    bad_topk.problem()};
  const absl::Status batched = backend_.Attend(topk_fails);
  EXPECT_EQ(batched.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(batched.message().rfind("problem 1: the index score of key ", 0),
            0u)
      << batched;

  // Both kinds failing: the first failing problem's error, a dense one
  // before a top-k one.
  const std::vector<AttentionProblem> both_fail = {empty.Problem(),
                                                   bad_topk.problem()};
  const absl::Status first = backend_.Attend(both_fail);
  EXPECT_EQ(first.message().rfind("problem 0: query row 0 (position ", 0), 0u)
      << first;
}

// AttendEach: in one run, each problem gets what Attend of it alone gives,
// the failing ones their own error and the others their outputs in full
// (a batch of decode steps fails only the offending ones).
TEST_F(CpuBackendTest, AttendEachGivesEveryProblemItsOwnResult) {
  Config good;
  good.num_queries = 6;
  Config long_rows;
  long_rows.num_queries = 3;
  long_rows.num_keys = 1100;  // split over chunks and threads
  long_rows.mask.query_start = 1097;
  Case dense(good), split(long_rows), empty(EmptyRows(4)), sparse(good),
      overflowing(good), late(good);
  const TopKCase topk(sparse, 1.0f), bad_topk(overflowing, 1e20f);
  const std::vector<Case*> cases = {&dense,       &empty,  &split,
                                    &overflowing, &sparse, &late};
  const std::vector<AttentionProblem> problems = {
      dense.Problem(),    empty.Problem(), split.Problem(),
      bad_topk.problem(), topk.problem(),  late.Problem()};
  std::vector<absl::Status> alone;
  std::vector<std::vector<float>> outputs;
  for (size_t p = 0; p < problems.size(); ++p) {
    alone.push_back(backend_.Attend({&problems[p], 1}));
    outputs.push_back(cases[p]->output);
    cases[p]->ResetOutputs();
  }
  EXPECT_FALSE(alone[1].ok());
  EXPECT_FALSE(alone[3].ok());
  std::vector<absl::Status> each(problems.size());
  backend_.AttendEach(problems, absl::MakeSpan(each));
  for (size_t p = 0; p < problems.size(); ++p) {
    EXPECT_EQ(each[p], alone[p]) << "problem " << p;
    if (each[p].ok()) {
      ExpectBitwiseEqual(cases[p]->output, outputs[p], "output of AttendEach");
    }
  }
}

TEST_F(CpuBackendTest, FirstErrorIsReportedDeterministically) {
  // Problems 1 and 2 both have an empty row; the error names problem 1 no
  // matter which thread finds which first.
  Config good;
  good.num_queries = 50;
  Case a(good), b(EmptyRows(40)), c(EmptyRows(40));
  CpuBackend four_threads(4);
  for (int attempt = 0; attempt < 20; ++attempt) {
    const std::vector<AttentionProblem> batch = {a.Problem(), b.Problem(),
                                                 c.Problem()};
    absl::Status status = four_threads.Attend(batch);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr("problem 1: query row 0 "));
  }
}

}  // namespace
}  // namespace attention
