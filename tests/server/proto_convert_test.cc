#include "server/proto_convert.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attention/v1/attention.pb.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

v1::Tensor FloatTensor(const std::vector<float>& values,
                       const std::vector<int64_t>& shape) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::DTYPE_FLOAT32);
  for (int64_t dim : shape) tensor.add_shape(dim);
  tensor.set_data(values.data(), values.size() * sizeof(float));
  return tensor;
}

TEST(ProtoConvertTest, TensorViewPointsIntoTheRequestBytes) {
  const v1::Tensor tensor = FloatTensor({1, 2, 3, 4, 5, 6}, {1, 2, 3});
  auto view = TensorViewFromProto(tensor, "q");
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->dtype, DType::kFloat32);
  EXPECT_EQ(std::vector<int64_t>(view->shape.begin(), view->shape.end()),
            (std::vector<int64_t>{1, 2, 3}));
  // No copy: the view addresses the protobuf's own string.
  EXPECT_EQ(reinterpret_cast<const char*>(view->data), tensor.data().data());
  EXPECT_EQ(view->size_bytes, 24);
  EXPECT_TRUE(view->Validate("q", 3).ok());
}

// A decode step says how large its message is, unknown fields included:
// what the decode queue's byte bound counts while it waits.
TEST(ProtoConvertTest, ADecodeStepCarriesItsMessageSize) {
  v1::DecodeRequest request;
  request.set_session_id("s");
  *request.mutable_q() = FloatTensor({1, 2, 3, 4}, {1, 1, 4});
  *request.mutable_k() = FloatTensor({1, 2, 3, 4}, {1, 1, 4});
  *request.mutable_v() = FloatTensor({1, 2, 3, 4}, {1, 1, 4});
  request.GetReflection()->MutableUnknownFields(&request)->AddLengthDelimited(
      1000, std::string(1 << 20, 'u'));
  auto append = AppendRequestFromProto(request, "step");
  ASSERT_TRUE(append.ok()) << append.status();
  EXPECT_EQ(append->message_bytes,
            static_cast<int64_t>(request.ByteSizeLong()));
  EXPECT_GT(append->message_bytes, 1 << 20);
}

// A BatchDecode's steps carry the whole message between them, what lies
// outside every step (unknown fields) included, and their errors name the
// step.
TEST(ProtoConvertTest, BatchDecodeStepsCarryTheWholeMessageSize) {
  v1::BatchDecodeRequest request;
  for (int i = 0; i < 3; ++i) {
    v1::DecodeRequest* step = request.add_steps();
    step->set_session_id("s");
    *step->mutable_q() = FloatTensor({1, 2, 3, 4}, {1, 1, 4});
    *step->mutable_k() = FloatTensor({1, 2, 3, 4}, {1, 1, 4});
    *step->mutable_v() = FloatTensor({1, 2, 3, 4}, {1, 1, 4});
  }
  request.GetReflection()->MutableUnknownFields(&request)->AddLengthDelimited(
      1000, std::string(1 << 20, 'u'));
  auto steps = AppendRequestsFromProto(request);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->size(), 3u);
  int64_t total = 0;
  for (const AppendRequest& step : *steps) {
    EXPECT_EQ(step.required_tokens, 1);
    total += step.message_bytes;
  }
  EXPECT_EQ(total, static_cast<int64_t>(request.ByteSizeLong()));
  EXPECT_GT((*steps)[0].message_bytes, 1 << 20);

  request.mutable_steps(2)->mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED);
  const absl::Status bad = AppendRequestsFromProto(request).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("steps[2]"), std::string::npos) << bad;
}

// A spec's layer entries are converted only for a layer count the server
// could take: millions of 2-byte entries would each become a LayerSpec.
TEST(ProtoConvertTest, LayerEntriesPastTheLayerLimitAreNotConverted) {
  v1::SessionSpec spec;
  spec.set_num_layers(SpecLimits{}.max_layers + 1);
  for (int i = 0; i < spec.num_layers(); ++i) spec.add_layers();
  const absl::Status status = SessionSpecFromProto(spec).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("num_layers"), std::string::npos) << status;
}

TEST(ProtoConvertTest, TensorDTypesMap) {
  for (v1::DType dtype :
       {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    v1::Tensor tensor;
    tensor.set_dtype(dtype);
    tensor.add_shape(2);
    tensor.set_data(std::string(2 * (dtype == v1::DTYPE_FLOAT32 ? 4 : 2), 0));
    auto view = TensorViewFromProto(tensor, "k");
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(DTypeToProto(view->dtype), dtype);
  }
}

TEST(ProtoConvertTest, TensorWithoutDTypeIsInvalidAndNamed) {
  v1::Tensor tensor = FloatTensor({1, 2}, {2});
  tensor.set_dtype(v1::DTYPE_UNSPECIFIED);
  auto view = TensorViewFromProto(tensor, "steps[2].k");
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(view.status().message().find("steps[2].k"), std::string::npos)
      << view.status();
  // A missing tensor looks the same.
  auto missing = TensorViewFromProto(v1::Tensor(), "v");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ProtoConvertTest, UnknownDTypeIsInvalid) {
  v1::Tensor tensor = FloatTensor({1, 2}, {2});
  tensor.set_dtype(static_cast<v1::DType>(9));
  EXPECT_EQ(TensorViewFromProto(tensor, "q").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(OptionalDTypeFromProto(static_cast<v1::DType>(9), "output_dtype")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ProtoConvertTest, AShapeOfManyDimensionsIsInvalidWithAShortMessage) {
  v1::Tensor tensor = FloatTensor({1}, std::vector<int64_t>(300000, 1));
  const absl::Status status = TensorViewFromProto(tensor, "q").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              ::testing::HasSubstr("q has 300000 dimensions"));
  EXPECT_LT(status.message().size(), 200u) << status;
}

TEST(ProtoConvertTest, NonPositiveOrOverflowingShapesAreInvalid) {
  v1::Tensor tensor = FloatTensor({1, 2}, {2, -1});
  EXPECT_EQ(TensorViewFromProto(tensor, "q").status().code(),
            absl::StatusCode::kInvalidArgument);
  tensor = FloatTensor({1, 2}, {2, 0});
  EXPECT_EQ(TensorViewFromProto(tensor, "q").status().code(),
            absl::StatusCode::kInvalidArgument);
  // 2^62 elements of 4 bytes overflow int64.
  tensor = FloatTensor({1, 2}, {int64_t{1} << 31, int64_t{1} << 31});
  EXPECT_EQ(TensorViewFromProto(tensor, "q").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A shape its bytes do not back is refused at once, naming both: what is
// sized from the shape before the engine validates it (the reply bound)
// never sees it.
TEST(ProtoConvertTest, AShapeItsBytesDoNotBackIsInvalid) {
  const v1::Tensor huge = FloatTensor({1}, {1000000, 1000, 128});
  const auto view = TensorViewFromProto(huge, "q");
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(view.status().message().find("q has 4 bytes of data but shape"),
            std::string::npos)
      << view.status();
  EXPECT_EQ(
      TensorViewFromProto(FloatTensor({1, 2, 3}, {2}), "k").status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(TensorViewFromProto(FloatTensor({1, 2}, {2}), "k").ok());
}

TEST(ProtoConvertTest, OptionalDTypeDefaultsToFloat32) {
  auto dtype = OptionalDTypeFromProto(v1::DTYPE_UNSPECIFIED, "output_dtype");
  ASSERT_TRUE(dtype.ok());
  EXPECT_EQ(*dtype, DType::kFloat32);
  EXPECT_EQ(*OptionalDTypeFromProto(v1::DTYPE_BFLOAT16, "x"), DType::kBFloat16);
  EXPECT_EQ(TensorDTypeFromProto(v1::DTYPE_UNSPECIFIED, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ProtoConvertTest, TensorToProtoCopiesShapeDTypeAndBytes) {
  Tensor tensor(DType::kFloat32, Shape{2, 3});
  for (int i = 0; i < 6; ++i) tensor.float_data()[i] = 0.5f * i;
  v1::Tensor proto;
  proto.add_shape(99);  // replaced, not appended to
  TensorToProto(tensor, &proto);
  EXPECT_EQ(proto.dtype(), v1::DTYPE_FLOAT32);
  ASSERT_EQ(proto.shape_size(), 2);
  EXPECT_EQ(proto.shape(0), 2);
  EXPECT_EQ(proto.shape(1), 3);
  ASSERT_EQ(proto.data().size(), 24u);
  EXPECT_EQ(std::memcmp(proto.data().data(), tensor.data(), 24), 0);
}

v1::SessionSpec FullSpec() {
  v1::SessionSpec spec;
  spec.set_num_layers(2);
  spec.set_num_q_heads(8);
  spec.set_num_kv_heads(2);
  spec.set_head_dim(64);
  spec.set_value_dim(32);
  spec.set_kv_dtype(v1::DTYPE_BFLOAT16);
  spec.set_scale(0.125f);
  v1::LayerSpec* full = spec.add_layers();
  full->set_window(0);
  v1::LayerSpec* window = spec.add_layers();
  window->set_window(128);
  window->set_num_sink_tokens(4);
  for (int h = 0; h < 8; ++h) window->add_sink_logits(0.25f * h);
  spec.set_max_tokens(4096);
  spec.set_model("gpt-oss-like");
  return spec;
}

TEST(ProtoConvertTest, SessionSpecRoundTrips) {
  const v1::SessionSpec proto = FullSpec();
  auto spec = SessionSpecFromProto(proto);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->num_layers, 2);
  EXPECT_EQ(spec->num_q_heads, 8);
  EXPECT_EQ(spec->num_kv_heads, 2);
  EXPECT_EQ(spec->head_dim, 64);
  EXPECT_EQ(spec->value_dim, 32);
  EXPECT_EQ(spec->kv_dtype, DType::kBFloat16);
  EXPECT_EQ(spec->scale, 0.125f);
  ASSERT_EQ(spec->layers.size(), 2u);
  EXPECT_EQ(spec->layers[1].window, 128);
  EXPECT_EQ(spec->layers[1].num_sink_tokens, 4);
  EXPECT_EQ(spec->layers[1].sink_logits.size(), 8u);
  EXPECT_EQ(spec->max_tokens, 4096);
  EXPECT_EQ(spec->model, "gpt-oss-like");

  v1::SessionSpec back;
  SessionSpecToProto(*spec, &back);
  EXPECT_EQ(back.SerializeAsString(), proto.SerializeAsString());
}

TEST(ProtoConvertTest, SessionSpecKvDTypeDefaultsAndValidates) {
  v1::SessionSpec proto = FullSpec();
  proto.set_kv_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(SessionSpecFromProto(proto)->kv_dtype, DType::kFloat32);
  proto.set_kv_dtype(static_cast<v1::DType>(42));
  auto spec = SessionSpecFromProto(proto);
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(spec.status().message().find("kv_dtype"), std::string::npos);
}

TEST(ProtoConvertTest, SessionInfoToProto) {
  SessionInfo info;
  info.session_id = "abc";
  info.spec = *SessionSpecFromProto(FullSpec());
  info.layer_lengths = {7, 3};
  info.kv_cache_bytes = 8192;
  v1::SessionInfo proto;
  SessionInfoToProto(info, &proto);
  EXPECT_EQ(proto.session_id(), "abc");
  EXPECT_EQ(proto.spec().SerializeAsString(), FullSpec().SerializeAsString());
  ASSERT_EQ(proto.layer_lengths_size(), 2);
  EXPECT_EQ(proto.layer_lengths(0), 7);
  EXPECT_EQ(proto.layer_lengths(1), 3);
  EXPECT_EQ(proto.kv_cache_bytes(), 8192);
}

TEST(ProtoConvertTest, EmptyRowPolicyMaps) {
  EXPECT_EQ(*EmptyRowPolicyFromProto(v1::EMPTY_ROW_POLICY_UNSPECIFIED),
            EmptyRowPolicy::kError);
  EXPECT_EQ(*EmptyRowPolicyFromProto(v1::EMPTY_ROW_POLICY_ERROR),
            EmptyRowPolicy::kError);
  EXPECT_EQ(*EmptyRowPolicyFromProto(v1::EMPTY_ROW_POLICY_ZERO),
            EmptyRowPolicy::kZero);
  EXPECT_EQ(EmptyRowPolicyFromProto(static_cast<v1::EmptyRowPolicy>(5))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ProtoConvertTest, PrefillRequestConverts) {
  v1::PrefillRequest request;
  request.set_session_id("s1");
  request.set_layer(3);
  *request.mutable_q() = FloatTensor({1, 2, 3, 4}, {2, 1, 2});
  *request.mutable_k() = FloatTensor({5, 6, 7, 8}, {2, 1, 2});
  *request.mutable_v() = FloatTensor({9, 10, 11, 12}, {2, 1, 2});
  request.set_output_dtype(v1::DTYPE_FLOAT16);
  request.set_return_lse(true);
  auto append = AppendRequestFromProto(request);
  ASSERT_TRUE(append.ok()) << append.status();
  EXPECT_EQ(append->session_id, "s1");
  EXPECT_EQ(append->layer, 3);
  EXPECT_EQ(reinterpret_cast<const char*>(append->k.data),
            request.k().data().data());
  EXPECT_EQ(append->output_dtype, DType::kFloat16);
  EXPECT_TRUE(append->return_lse);
  EXPECT_FALSE(append->required_tokens.has_value());
}

TEST(ProtoConvertTest, LatentAndTopKSpecFieldsRoundTrip) {
  v1::SessionSpec proto = FullSpec();
  proto.set_num_kv_heads(1);
  proto.set_kv_layout(v1::KV_LAYOUT_SHARED_LATENT);
  proto.set_index_dim(16);
  proto.set_index_heads(4);
  proto.mutable_layers(1)->set_topk(256);
  proto.mutable_layers(1)->set_index_score(v1::INDEX_SCORE_RELU);
  auto spec = SessionSpecFromProto(proto);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->kv_layout, KvLayout::kSharedLatent);
  EXPECT_EQ(spec->index_dim, 16);
  EXPECT_EQ(spec->index_heads, 4);
  EXPECT_EQ(spec->layers[1].topk, 256);
  EXPECT_EQ(spec->layers[1].index_score, IndexScore::kRelu);
  EXPECT_EQ(spec->layers[0].index_score, IndexScore::kIdentity);
  v1::SessionSpec back;
  SessionSpecToProto(*spec, &back);
  EXPECT_EQ(back.SerializeAsString(), proto.SerializeAsString());

  proto.set_kv_layout(static_cast<v1::KvLayout>(9));
  EXPECT_EQ(SessionSpecFromProto(proto).status().code(),
            absl::StatusCode::kInvalidArgument);
  proto.set_kv_layout(v1::KV_LAYOUT_SEPARATE);
  proto.mutable_layers(0)->set_index_score(static_cast<v1::IndexScore>(9));
  EXPECT_EQ(SessionSpecFromProto(proto).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ProtoConvertTest, UnsetVAndIndexInputsConvert) {
  v1::PrefillRequest request;
  request.set_session_id("s1");
  *request.mutable_q() = FloatTensor({1, 2, 3, 4}, {2, 1, 2});
  *request.mutable_k() = FloatTensor({5, 6, 7, 8}, {2, 1, 2});
  *request.mutable_index_k() = FloatTensor({1, 2}, {2, 1});
  *request.mutable_index_q() = FloatTensor({3, 4}, {2, 1, 1});
  *request.mutable_index_weights() = FloatTensor({5, 6}, {2, 1});
  request.set_return_topk_indices(true);
  auto append = AppendRequestFromProto(request);
  ASSERT_TRUE(append.ok()) << append.status();
  EXPECT_TRUE(append->v.shape.empty());  // a shared latent's absent v
  EXPECT_EQ(append->index_k.shape, (Shape{2, 1}));
  EXPECT_EQ(append->index_q.shape, (Shape{2, 1, 1}));
  EXPECT_EQ(append->index_weights.shape, (Shape{2, 1}));
  EXPECT_TRUE(append->return_topk_indices);

  AttentionOutput output;
  output.output = Tensor(DType::kFloat32, {1, 1, 1});
  output.topk_indices = {0, 3, -1};
  v1::AttentionResult result;
  AttentionOutputToProto(output, &result);
  ASSERT_EQ(result.topk_indices_size(), 3);
  EXPECT_EQ(result.topk_indices(1), 3);
  EXPECT_EQ(result.topk_indices(2), -1);
}

// An optional tensor that is set (v, the index inputs) has a shape: set
// without one (a scalar, or just a dtype) it would pass for unset.
TEST(ProtoConvertTest, ASetIndexInputWithoutAShapeIsInvalid) {
  for (const char* field : {"v", "index_k", "index_q", "index_weights"}) {
    v1::PrefillRequest request;
    request.set_session_id("s1");
    *request.mutable_q() = FloatTensor({1, 2}, {1, 1, 2});
    *request.mutable_k() = FloatTensor({1, 2}, {1, 1, 2});
    *request.mutable_v() = FloatTensor({1, 2}, {1, 1, 2});
    v1::Tensor scalar = FloatTensor({1}, {});
    if (std::string(field) == "v") *request.mutable_v() = scalar;
    if (std::string(field) == "index_k") *request.mutable_index_k() = scalar;
    if (std::string(field) == "index_q") {
      request.mutable_index_q()->set_dtype(v1::DTYPE_FLOAT32);
    }
    if (std::string(field) == "index_weights") {
      *request.mutable_index_weights() = scalar;
    }
    const absl::Status status = AppendRequestFromProto(request).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(status.message().find(field), absl::string_view::npos) << status;
  }
}

TEST(ProtoConvertTest, DecodeRequestRequiresOneTokenAndNamesItsStep) {
  v1::DecodeRequest request;
  request.set_session_id("s1");
  *request.mutable_q() = FloatTensor({1, 2}, {1, 1, 2});
  *request.mutable_k() = FloatTensor({1, 2}, {1, 1, 2});
  *request.mutable_v() = FloatTensor({1, 2}, {1, 1, 2});
  auto append = AppendRequestFromProto(request);
  ASSERT_TRUE(append.ok()) << append.status();
  ASSERT_TRUE(append->required_tokens.has_value());
  EXPECT_EQ(*append->required_tokens, 1);
  EXPECT_EQ(append->output_dtype, DType::kFloat32);

  request.mutable_v()->set_dtype(v1::DTYPE_UNSPECIFIED);
  auto bad = AppendRequestFromProto(request, "steps[2]");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("steps[2].v"), std::string::npos)
      << bad.status();
}

TEST(ProtoConvertTest, StatelessRequestConverts) {
  v1::AttentionRequest request;
  *request.mutable_q() = FloatTensor({1, 2}, {1, 1, 2});
  *request.mutable_k() = FloatTensor({1, 2, 3, 4}, {2, 1, 2});
  *request.mutable_v() = FloatTensor({1, 2, 3, 4}, {2, 1, 2});
  request.set_causal(true);
  request.set_window(16);
  request.set_num_sink_tokens(2);
  request.set_query_start(1);
  request.add_sink_logits(0.5f);
  request.set_empty_row_policy(v1::EMPTY_ROW_POLICY_ZERO);
  request.set_scale(0.3f);
  request.set_return_weights(true);
  request.set_output_dtype(v1::DTYPE_BFLOAT16);
  request.set_return_lse(true);

  auto stateless = StatelessRequestFromProto(request);
  ASSERT_TRUE(stateless.ok()) << stateless.status();
  EXPECT_TRUE(stateless->mask.causal);
  EXPECT_EQ(stateless->mask.window, 16);
  EXPECT_EQ(stateless->mask.num_sink_tokens, 2);
  EXPECT_EQ(stateless->mask.query_start, 1);
  EXPECT_EQ(stateless->sink_logits, std::vector<float>{0.5f});
  EXPECT_FALSE(stateless->bias.has_value());
  EXPECT_EQ(stateless->empty_row_policy, EmptyRowPolicy::kZero);
  EXPECT_EQ(stateless->scale, 0.3f);
  EXPECT_TRUE(stateless->return_weights);
  EXPECT_EQ(stateless->output_dtype, DType::kBFloat16);
  EXPECT_TRUE(stateless->return_lse);

  *request.mutable_bias() = FloatTensor({0, -1}, {1, 2});
  stateless = StatelessRequestFromProto(request);
  ASSERT_TRUE(stateless.ok()) << stateless.status();
  ASSERT_TRUE(stateless->bias.has_value());
  EXPECT_EQ(reinterpret_cast<const char*>(stateless->bias->data),
            request.bias().data().data());

  request.mutable_bias()->set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(StatelessRequestFromProto(request).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ProtoConvertTest, AttentionOutputToProtoSetsOnlyWhatIsPresent) {
  AttentionOutput output;
  output.output = Tensor(DType::kFloat32, Shape{1, 2, 2});
  for (int i = 0; i < 4; ++i) output.output.float_data()[i] = i + 1.0f;
  output.position = 17;
  v1::AttentionResult result;
  AttentionOutputToProto(output, &result);
  EXPECT_EQ(result.position(), 17);
  EXPECT_EQ(result.output().data().size(), 16u);
  EXPECT_FALSE(result.has_weights());
  EXPECT_FALSE(result.has_lse());

  output.lse = Tensor(DType::kFloat32, Shape{1, 2});
  output.weights = Tensor(DType::kFloat32, Shape{2, 1, 3});
  AttentionOutputToProto(output, &result);
  ASSERT_TRUE(result.has_lse());
  ASSERT_TRUE(result.has_weights());
  EXPECT_EQ(result.lse().shape_size(), 2);
  EXPECT_EQ(result.weights().data().size(), 24u);
}

}  // namespace
}  // namespace attention::server
