#include "core/kv_size.h"

#include <cmath>
#include <cstdint>

#include "gtest/gtest.h"

namespace attention {
namespace {

constexpr int64_t kKiB = int64_t{1} << 10;
constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kContext = 131072;

SessionSpec Resolved(SessionSpec spec) {
  absl::StatusOr<SessionSpec> resolved = ResolveSessionSpec(spec, SpecLimits());
  EXPECT_TRUE(resolved.ok()) << resolved.status();
  return *resolved;
}

SessionSpec Dense(int layers, int q_heads, int kv_heads, int head_dim) {
  SessionSpec spec;
  spec.num_layers = layers;
  spec.num_q_heads = q_heads;
  spec.num_kv_heads = kv_heads;
  spec.head_dim = head_dim;
  spec.kv_dtype = DType::kFloat16;
  return spec;
}

// gpt-oss: 36 layers alternating full / sliding window 128, 8 KV heads of
// 64, fp16 KV (the seeds' frozen Module-5 numbers).
SessionSpec GptOssHybrid() {
  SessionSpec spec = Dense(36, 64, 8, 64);
  spec.layers.resize(36);
  for (int i = 1; i < 36; i += 2) spec.layers[i].window = 128;
  return Resolved(spec);
}

TEST(KvSizeTest, GptOssHybridMatchesTheSeeds) {
  const KvSizePlan plan = PlanKvSize(GptOssHybrid(), kContext);
  EXPECT_EQ(plan.bytes_per_token_per_layer, 2048);
  EXPECT_EQ(plan.bytes_per_token_all_full, 73728);
  EXPECT_EQ(plan.full_layers, 18);
  EXPECT_EQ(plan.window_layers, 18);
  EXPECT_EQ(plan.context_bytes, 4836556800);
  EXPECT_EQ(plan.context_bytes_all_full, 9663676416);
  // The seeds' split: full 4 831 838 208 + sliding 4 718 592.
  EXPECT_EQ(plan.context_bytes - 18 * 128 * 2048, 4831838208);
}

TEST(KvSizeTest, DenseModelsMatchTheSeeds) {
  const KvSizePlan llama =
      PlanKvSize(Resolved(Dense(80, 64, 8, 128)), kContext);
  EXPECT_EQ(llama.bytes_per_token_all_full, 320 * kKiB);
  EXPECT_EQ(llama.context_bytes, 40 * kGiB);
  EXPECT_EQ(llama.context_bytes_all_full, 40 * kGiB);
  EXPECT_EQ(llama.window_layers, 0);

  const KvSizePlan qwen = PlanKvSize(Resolved(Dense(28, 28, 4, 128)), kContext);
  EXPECT_EQ(qwen.bytes_per_token_all_full, 56 * kKiB);
  EXPECT_EQ(qwen.context_bytes, 7 * kGiB);

  // The seeds' hypothetical gpt-oss MHA / MQA rows.
  EXPECT_EQ(PlanKvSize(Resolved(Dense(36, 64, 64, 64)), kContext)
                .bytes_per_token_all_full,
            589824);
  EXPECT_EQ(PlanKvSize(Resolved(Dense(36, 64, 1, 64)), kContext)
                .bytes_per_token_all_full,
            9216);
}

TEST(KvSizeTest, WindowLayersAreCappedBySinksAndContext) {
  SessionSpec spec = Dense(2, 4, 4, 16);
  spec.kv_dtype = DType::kFloat32;
  spec.value_dim = 8;
  LayerSpec window;
  window.window = 100;
  window.num_sink_tokens = 4;
  spec.layers = {window};
  const SessionSpec resolved = Resolved(spec);
  const int64_t per_token = 4 * (16 + 8) * 4;
  EXPECT_EQ(PlanKvSize(resolved, 1000).bytes_per_token_per_layer, per_token);
  EXPECT_EQ(PlanKvSize(resolved, 1000).context_bytes, 2 * 104 * per_token);
  EXPECT_EQ(PlanKvSize(resolved, 50).context_bytes, 2 * 50 * per_token);
  EXPECT_EQ(PlanKvSize(resolved, 1000).context_bytes_all_full,
            2 * 1000 * per_token);
  EXPECT_EQ(PlanKvSize(resolved, 0).context_bytes, 0);
}

// DeepSeek-V3 MLA: (512 + 64) * 61 layers * 2 bytes per token, against
// the seeds' MHA equivalent 2 * 61 * 128 * 128 * 2.
TEST(KvSizeTest, LatentLayoutMatchesTheSeeds) {
  SessionSpec spec = Dense(61, 128, 1, 512 + 64);
  spec.kv_dtype = DType::kBFloat16;
  spec.value_dim = 512;
  spec.kv_layout = KvLayout::kSharedLatent;
  spec.scale = 1.0f / std::sqrt(128.0f + 64.0f);
  const SessionSpec resolved = Resolved(spec);
  const KvSizePlan plan = PlanKvSize(resolved, kContext);
  EXPECT_EQ(plan.bytes_per_token_per_layer, (512 + 64) * 2);
  EXPECT_EQ(plan.bytes_per_token_all_full, 70272);
  EXPECT_EQ(MhaEquivalentBytesPerToken(resolved, 128), 3997696);
  EXPECT_EQ(plan.context_bytes, 70272 * kContext);
  EXPECT_EQ(plan.sparse_layers, 0);
}

TEST(KvSizeTest, TopKLayersAddTheirIndexKeys) {
  SessionSpec spec = Dense(4, 8, 2, 64);
  spec.index_dim = 32;
  spec.index_heads = 4;
  spec.layers.resize(4);
  spec.layers[1].topk = 16;
  spec.layers[3].topk = 16;
  spec.layers[3].window = 100;
  const KvSizePlan plan = PlanKvSize(Resolved(spec), 1000);
  EXPECT_EQ(plan.bytes_per_token_per_layer, 2 * 2 * 64 * 2);
  EXPECT_EQ(plan.index_bytes_per_token_per_layer, 32 * 2);
  EXPECT_EQ(plan.sparse_layers, 2);
  EXPECT_EQ(plan.bytes_per_token_all_full, 4 * 512 + 2 * 64);
  EXPECT_EQ(plan.context_bytes, 3 * 1000 * 512 + 1000 * 64 + 100 * 576);
}

}  // namespace
}  // namespace attention
