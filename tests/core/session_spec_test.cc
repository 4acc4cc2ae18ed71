#include "core/session_spec.h"

#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

using ::testing::HasSubstr;

SessionSpec ValidSpec() {
  SessionSpec spec;
  spec.num_layers = 4;
  spec.num_q_heads = 8;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  return spec;
}

// Expects INVALID_ARGUMENT whose message names `field`.
void ExpectInvalid(const SessionSpec& spec, const char* field,
                   const SpecLimits& limits = SpecLimits()) {
  absl::StatusOr<SessionSpec> resolved = ResolveSessionSpec(spec, limits);
  ASSERT_FALSE(resolved.ok()) << "expected an error naming " << field;
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(resolved.status().message(), HasSubstr(field));
}

TEST(SessionSpecTest, FillsDefaults) {
  absl::StatusOr<SessionSpec> resolved =
      ResolveSessionSpec(ValidSpec(), SpecLimits());
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->value_dim, 64);
  EXPECT_FLOAT_EQ(resolved->scale, 0.125f);
  EXPECT_EQ(resolved->max_tokens, SpecLimits().default_max_tokens);
  ASSERT_EQ(resolved->layers.size(), 4u);
  for (const LayerSpec& layer : resolved->layers) {
    EXPECT_EQ(layer, LayerSpec{});
  }
  EXPECT_EQ(resolved->kv_dtype, DType::kFloat32);
}

TEST(SessionSpecTest, KeepsExplicitValues) {
  SessionSpec spec = ValidSpec();
  spec.value_dim = 32;
  spec.scale = 0.5f;
  spec.max_tokens = 1000;
  spec.kv_dtype = DType::kBFloat16;
  spec.model = "test";
  absl::StatusOr<SessionSpec> resolved = ResolveSessionSpec(spec, SpecLimits());
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->value_dim, 32);
  EXPECT_EQ(resolved->scale, 0.5f);
  EXPECT_EQ(resolved->max_tokens, 1000);
  EXPECT_EQ(resolved->kv_dtype, DType::kBFloat16);
  EXPECT_EQ(resolved->model, "test");
  // Resolving is idempotent.
  absl::StatusOr<SessionSpec> again =
      ResolveSessionSpec(*resolved, SpecLimits());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *resolved);
}

TEST(SessionSpecTest, ExpandsOneLayerToAll) {
  SessionSpec spec = ValidSpec();
  LayerSpec window;
  window.window = 128;
  window.num_sink_tokens = 4;
  window.sink_logits.assign(8, 0.5f);
  spec.layers = {window};
  absl::StatusOr<SessionSpec> resolved = ResolveSessionSpec(spec, SpecLimits());
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  ASSERT_EQ(resolved->layers.size(), 4u);
  for (const LayerSpec& layer : resolved->layers) EXPECT_EQ(layer, window);
}

TEST(SessionSpecTest, KeepsPerLayerList) {
  SessionSpec spec = ValidSpec();
  spec.layers.resize(4);
  spec.layers[1].window = 128;
  spec.layers[3].window = 128;
  absl::StatusOr<SessionSpec> resolved = ResolveSessionSpec(spec, SpecLimits());
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->layers, spec.layers);
}

TEST(SessionSpecTest, RejectsBadDimensions) {
  SessionSpec spec = ValidSpec();
  spec.num_layers = 0;
  ExpectInvalid(spec, "num_layers");
  spec = ValidSpec();
  spec.num_layers = 5000;
  ExpectInvalid(spec, "num_layers");
  spec = ValidSpec();
  spec.num_q_heads = 0;
  ExpectInvalid(spec, "num_q_heads");
  spec = ValidSpec();
  spec.num_kv_heads = 0;
  ExpectInvalid(spec, "num_kv_heads");
  spec = ValidSpec();
  spec.num_kv_heads = 3;
  ExpectInvalid(spec, "multiple of num_kv_heads");
  spec = ValidSpec();
  spec.num_kv_heads = 16;
  ExpectInvalid(spec, "num_kv_heads");
  spec = ValidSpec();
  spec.head_dim = 0;
  ExpectInvalid(spec, "head_dim");
  spec = ValidSpec();
  spec.head_dim = 4096;
  ExpectInvalid(spec, "head_dim");
  spec = ValidSpec();
  spec.value_dim = -1;
  ExpectInvalid(spec, "value_dim");
  spec = ValidSpec();
  spec.kv_dtype = static_cast<DType>(0);
  ExpectInvalid(spec, "kv_dtype");
}

TEST(SessionSpecTest, RejectsBadScale) {
  SessionSpec spec = ValidSpec();
  spec.scale = -1.0f;
  ExpectInvalid(spec, "scale");
  spec.scale = std::numeric_limits<float>::infinity();
  ExpectInvalid(spec, "scale");
  spec.scale = std::nanf("");
  ExpectInvalid(spec, "scale");
}

TEST(SessionSpecTest, RejectsBadLayers) {
  SessionSpec spec = ValidSpec();
  spec.layers.resize(3);
  ExpectInvalid(spec, "layers");

  spec = ValidSpec();
  spec.layers.resize(4);
  spec.layers[2].window = -1;
  ExpectInvalid(spec, "layers[2].window");

  spec = ValidSpec();
  spec.layers.resize(1);
  spec.layers[0].window = 16;
  spec.layers[0].num_sink_tokens = -2;
  ExpectInvalid(spec, "layers[0].num_sink_tokens");

  spec = ValidSpec();
  spec.layers.resize(1);
  spec.layers[0].num_sink_tokens = 4;  // no window
  ExpectInvalid(spec, "num_sink_tokens");

  spec = ValidSpec();
  spec.layers.resize(1);
  spec.layers[0].sink_logits.assign(7, 0.0f);  // needs 8
  ExpectInvalid(spec, "layers[0].sink_logits");

  spec = ValidSpec();
  spec.layers.resize(4);
  spec.layers[3].sink_logits.assign(8, 0.0f);
  spec.layers[3].sink_logits[5] = std::numeric_limits<float>::infinity();
  ExpectInvalid(spec, "layers[3].sink_logits[5]");
}

TEST(SessionSpecTest, MaxTokensLimits) {
  SpecLimits limits;
  limits.default_max_tokens = 4096;
  limits.max_tokens_limit = 8192;
  SessionSpec spec = ValidSpec();
  absl::StatusOr<SessionSpec> resolved = ResolveSessionSpec(spec, limits);
  ASSERT_TRUE(resolved.ok());
  EXPECT_EQ(resolved->max_tokens, 4096);
  spec.max_tokens = 8192;
  EXPECT_TRUE(ResolveSessionSpec(spec, limits).ok());
  spec.max_tokens = 8193;
  ExpectInvalid(spec, "max_tokens", limits);
  spec.max_tokens = -1;
  ExpectInvalid(spec, "max_tokens", limits);
}

TEST(SessionSpecTest, LimitsAreConfigurable) {
  SpecLimits limits;
  limits.max_layers = 2;
  limits.max_heads = 4;
  limits.max_head_dim = 32;
  SessionSpec spec = ValidSpec();
  ExpectInvalid(spec, "num_layers", limits);
  spec.num_layers = 2;
  ExpectInvalid(spec, "num_q_heads", limits);
  spec.num_q_heads = 4;
  ExpectInvalid(spec, "head_dim", limits);
  spec.head_dim = 32;
  EXPECT_TRUE(ResolveSessionSpec(spec, limits).ok());
  spec.value_dim = 33;
  ExpectInvalid(spec, "value_dim", limits);
}

TEST(SessionSpecLimitsTest, ModelLabelIsBounded) {
  SessionSpec spec = ValidSpec();
  spec.model = std::string(SpecLimits().max_model_bytes, 'm');
  EXPECT_TRUE(ResolveSessionSpec(spec, SpecLimits()).ok());
  spec.model.push_back('m');
  ExpectInvalid(spec, "model");
}

TEST(SessionSpecTest, SharedLatentNeedsOneKvHeadValuesInsideTheKeyAndAScale) {
  SessionSpec spec = ValidSpec();
  spec.kv_layout = KvLayout::kSharedLatent;
  ExpectInvalid(spec, "num_kv_heads");
  spec.num_kv_heads = 1;
  spec.head_dim = 576;
  spec.value_dim = 577;
  ExpectInvalid(spec, "value_dim");
  // Not the default head_dim: the RoPE part is no value.
  spec.value_dim = 0;
  ExpectInvalid(spec, "value_dim");
  spec.value_dim = 512;
  // Not the default 1/sqrt(head_dim) either: MLA scales by the width
  // before absorption (DeepSeek-V3: 128 + 64), which only the caller knows.
  spec.scale = 0.0f;
  ExpectInvalid(spec, "scale");
  spec.scale = 1.0f / std::sqrt(192.0f);
  absl::StatusOr<SessionSpec> resolved = ResolveSessionSpec(spec, SpecLimits());
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->kv_layout, KvLayout::kSharedLatent);
  EXPECT_EQ(resolved->value_dim, 512);
  EXPECT_EQ(resolved->scale, 1.0f / std::sqrt(192.0f));
  spec.kv_layout = static_cast<KvLayout>(7);
  ExpectInvalid(spec, "kv_layout");
}

TEST(SessionSpecTest, TopKLayersNeedAnIndexAndOnlyThen) {
  SessionSpec spec = ValidSpec();
  spec.layers.resize(4);
  spec.layers[2].topk = 64;
  ExpectInvalid(spec, "index_dim");
  spec.index_dim = 32;
  ExpectInvalid(spec, "index_heads");
  spec.index_heads = 4;
  EXPECT_TRUE(ResolveSessionSpec(spec, SpecLimits()).ok());
  spec.layers[1].topk = -1;
  ExpectInvalid(spec, "layers[1].topk");
  // Up to the server's largest session, which it can select entirely.
  SpecLimits limits;
  limits.max_tokens_limit = 4096;
  spec.layers[1].topk = 4096;
  EXPECT_TRUE(ResolveSessionSpec(spec, limits).ok());
  spec.layers[1].topk = 4097;
  ExpectInvalid(spec, "layers[1].topk", limits);
  spec.layers[1].topk = 0;
  spec.layers[1].index_score = static_cast<IndexScore>(9);
  ExpectInvalid(spec, "layers[1].index_score");
  spec.layers[1].index_score = IndexScore::kRelu;
  spec.layers[2].topk = 0;
  ExpectInvalid(spec, "index_dim");  // an index without a top-k layer
}

}  // namespace
}  // namespace attention
