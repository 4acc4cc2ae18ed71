// MLA shared-latent sessions (KV_LAYOUT_SHARED_LATENT) through the gRPC API:
// the seeds' absorption construction against explicit per-head attention in
// double precision, bitwise determinism across every serving path, the
// session operations, and the KV bytes they store.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "client/tensor_codec.h"
#include "gtest/gtest.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

constexpr int kHeads = 4;
constexpr int kLatent = 48;  // latent_dim (d_c): the values
constexpr int kRope = 16;    // rope_dim (d_r)
constexpr int kWidth = kLatent + kRope;

// A latent layer's shape: query heads, latent_dim, rope_dim, and d_nope
// (the per-head key width before absorption, which sets the scale).
struct LatentShape {
  int heads, latent, rope, nope;
  int width() const { return latent + rope; }
};
constexpr LatentShape kSmall = {kHeads, kLatent, kRope, 32};
// DeepSeek-V2/V3 per tensor-parallel rank of 8: 128 / 8 heads, d_c = 512,
// d_r = 64, d_nope = 128 (FlashMLA's 576 / 512).
constexpr LatentShape kDeepSeek = {16, 512, 64, 128};

class LatentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = StartTestServer();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  client::AttentionClient& client() { return *server_->client; }

  std::unique_ptr<TestServer> server_;
};

// Three latent layers: full causal; window 24 with 2 sink tokens; full with
// learned sink logits.
v1::SessionSpec LatentSpec(v1::DType kv_dtype = v1::DTYPE_FLOAT32,
                           const LatentShape& shape = kSmall) {
  v1::SessionSpec spec =
      MakeSpec(3, shape.heads, 1, shape.width(), {0, 24, 0}, kv_dtype);
  spec.set_value_dim(shape.latent);
  spec.set_kv_layout(v1::KV_LAYOUT_SHARED_LATENT);
  spec.set_scale(1.0f / std::sqrt(static_cast<float>(shape.nope + shape.rope)));
  spec.mutable_layers(1)->set_num_sink_tokens(2);
  for (int h = 0; h < shape.heads; ++h) {
    spec.mutable_layers(2)->add_sink_logits(0.25f * h - 0.5f);
  }
  return spec;
}

// Random absorbed queries [T, H, width] and latent keys [T, 1, width].
struct LatentTokens {
  LatentShape shape;
  std::vector<float> q, k;
  absl::Span<const float> q_rows(int64_t begin, int64_t rows) const {
    const int64_t row = int64_t{shape.heads} * shape.width();
    return absl::MakeConstSpan(q).subspan(begin * row, rows * row);
  }
  absl::Span<const float> k_rows(int64_t begin, int64_t rows) const {
    return absl::MakeConstSpan(k).subspan(begin * shape.width(),
                                          rows * shape.width());
  }
};
LatentTokens RandomLatent(int64_t count, uint32_t seed,
                          const LatentShape& shape = kSmall) {
  return {shape, RandomFloats(count * shape.heads * shape.width(), seed),
          RandomFloats(count * shape.width(), seed + 7777)};
}

// The bitwise oracle: stateless causal attention over k with explicit values
// v = k[:, :, :latent_dim] (both sent in the session's `kv_dtype`: a key is
// rounded to it as the session stores it) and the layer's mask, sinks and
// scale; for query rows [first_row, count) (query_start = first_row).
v1::AttentionRequest ExplicitValues(const LatentTokens& tokens, int64_t count,
                                    const v1::SessionSpec& spec, int layer,
                                    int64_t first_row = 0) {
  const LatentShape& shape = tokens.shape;
  v1::AttentionRequest request;
  auto tensor = [](v1::Tensor* out, absl::Span<const float> values,
                   std::vector<int64_t> shape, v1::DType dtype) {
    auto made = client::MakeTensor(values, shape, dtype);
    ASSERT_TRUE(made.ok()) << made.status();
    *out = *std::move(made);
  };
  std::vector<float> v;
  for (int64_t t = 0; t < count; ++t) {
    const auto key = tokens.k_rows(t, 1);
    v.insert(v.end(), key.begin(), key.begin() + shape.latent);
  }
  const int64_t rows = count - first_row;
  tensor(request.mutable_q(), tokens.q_rows(first_row, rows),
         {rows, shape.heads, shape.width()}, v1::DTYPE_FLOAT32);
  tensor(request.mutable_k(), tokens.k_rows(0, count),
         {count, 1, shape.width()}, spec.kv_dtype());
  tensor(request.mutable_v(), v, {count, 1, shape.latent}, spec.kv_dtype());
  request.set_query_start(first_row);
  request.set_causal(true);
  request.set_window(spec.layers(layer).window());
  request.set_num_sink_tokens(spec.layers(layer).num_sink_tokens());
  *request.mutable_sink_logits() = spec.layers(layer).sink_logits();
  request.set_scale(spec.scale());
  request.set_return_lse(true);
  return request;
}

TEST_F(LatentTest, SpecIsResolvedAndValidated) {
  auto session = client().OpenSession(LatentSpec());
  ATTN_ASSERT_OK(session);
  EXPECT_EQ(session->spec().kv_layout(), v1::KV_LAYOUT_SHARED_LATENT);
  EXPECT_EQ(session->spec().value_dim(), kLatent);

  v1::CreateSessionRequest bad;
  *bad.mutable_spec() = LatentSpec();
  bad.mutable_spec()->set_num_kv_heads(2);
  ATTN_EXPECT_CODE(client().OpenSession(bad.spec()),
                   absl::StatusCode::kInvalidArgument);
  *bad.mutable_spec() = LatentSpec();
  bad.mutable_spec()->set_value_dim(kWidth + 1);
  ATTN_EXPECT_CODE(client().OpenSession(bad.spec()),
                   absl::StatusCode::kInvalidArgument);
}

// The seeds' "MLA key/value/output absorption": per head h, expanded keys
// C A_h^T (+ the shared RoPE key) and values C B_h^T; the caller absorbs A_h
// into the query and B_h^T W_out,h into the output. The served latent
// output times B_h^T W_out,h, summed over heads, equals explicit attention.
TEST_F(LatentTest, AbsorbedOutputEqualsExplicitPerHeadAttention) {
  constexpr int kNope = 32;  // d_k: per-head key dim before absorption
  constexpr int kValue = 24;  // d_v: per-head value dim
  constexpr int kModel = 20;  // output width of W_out
  constexpr int64_t kTokens = 70;
  std::mt19937 rng(506);
  std::normal_distribution<double> normal(0.0, 1.0);
  auto draw = [&](int64_t n, double scale) {
    std::vector<double> x(static_cast<size_t>(n));
    for (double& value : x) value = scale * normal(rng);
    return x;
  };
  const std::vector<double> c = draw(kTokens * kLatent, 1.0);          // C
  const std::vector<double> a = draw(kHeads * kNope * kLatent, 0.15);  // A
  const std::vector<double> b = draw(kHeads * kValue * kLatent, 0.15); // B
  const std::vector<double> q = draw(kTokens * kHeads * kNope, 0.2);
  const std::vector<double> qr = draw(kTokens * kHeads * kRope, 0.5);
  const std::vector<double> kr = draw(kTokens * kRope, 0.5);
  const std::vector<double> w_out = draw(kHeads * kValue * kModel, 0.2);
  const double scale = 1.0 / std::sqrt(double{kNope + kRope});

  // Caller side: absorbed queries (q_h A_h || q_rope) and latent keys.
  std::vector<float> q_abs(kTokens * kHeads * kWidth), k_lat(kTokens * kWidth);
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kHeads; ++h) {
      float* row = &q_abs[(t * kHeads + h) * kWidth];
      for (int j = 0; j < kLatent; ++j) {
        double sum = 0;
        for (int i = 0; i < kNope; ++i) {
          sum += q[(t * kHeads + h) * kNope + i] * a[(h * kNope + i) * kLatent + j];
        }
        row[j] = static_cast<float>(sum);
      }
      for (int r = 0; r < kRope; ++r) {
        row[kLatent + r] = static_cast<float>(qr[(t * kHeads + h) * kRope + r]);
      }
    }
    for (int j = 0; j < kLatent; ++j) {
      k_lat[t * kWidth + j] = static_cast<float>(c[t * kLatent + j]);
    }
    for (int r = 0; r < kRope; ++r) {
      k_lat[t * kWidth + kLatent + r] = static_cast<float>(kr[t * kRope + r]);
    }
  }
  v1::SessionSpec spec = MakeSpec(1, kHeads, 1, kWidth);
  spec.set_value_dim(kLatent);
  spec.set_kv_layout(v1::KV_LAYOUT_SHARED_LATENT);
  spec.set_scale(static_cast<float>(scale));
  auto session = client().OpenSession(spec);
  ATTN_ASSERT_OK(session);
  auto result = session->Prefill(0, q_abs, k_lat, {});
  ATTN_ASSERT_OK(result);
  const std::vector<float> latent_out = Floats(result->output());
  ASSERT_EQ(latent_out.size(), static_cast<size_t>(kTokens * kHeads * kLatent));

  // Explicit float64 reference over expanded keys and values.
  double max_error = 0, max_magnitude = 0;
  for (int64_t t = 0; t < kTokens; ++t) {
    std::vector<double> explicit_out(kModel, 0.0), served(kModel, 0.0);
    for (int h = 0; h < kHeads; ++h) {
      std::vector<double> scores(t + 1);
      double max_score = -INFINITY;
      for (int64_t s = 0; s <= t; ++s) {
        double score = 0;
        for (int i = 0; i < kNope; ++i) {
          double key = 0;  // (C A_h^T)[s, i]
          for (int j = 0; j < kLatent; ++j) {
            key += c[s * kLatent + j] * a[(h * kNope + i) * kLatent + j];
          }
          score += q[(t * kHeads + h) * kNope + i] * key;
        }
        for (int r = 0; r < kRope; ++r) {
          score += qr[(t * kHeads + h) * kRope + r] * kr[s * kRope + r];
        }
        scores[s] = score * scale;
        max_score = std::max(max_score, scores[s]);
      }
      double denominator = 0;
      for (double& score : scores) {
        score = std::exp(score - max_score);
        denominator += score;
      }
      std::vector<double> head_value(kValue, 0.0);  // p @ (C B_h^T)
      for (int64_t s = 0; s <= t; ++s) {
        for (int i = 0; i < kValue; ++i) {
          double value = 0;
          for (int j = 0; j < kLatent; ++j) {
            value += c[s * kLatent + j] * b[(h * kValue + i) * kLatent + j];
          }
          head_value[i] += scores[s] / denominator * value;
        }
      }
      // Caller side of the served output: (o_latent B_h^T) W_out,h.
      std::vector<double> up(kValue, 0.0);
      for (int i = 0; i < kValue; ++i) {
        for (int j = 0; j < kLatent; ++j) {
          up[i] += latent_out[(t * kHeads + h) * kLatent + j] *
                   b[(h * kValue + i) * kLatent + j];
        }
      }
      for (int m = 0; m < kModel; ++m) {
        for (int i = 0; i < kValue; ++i) {
          explicit_out[m] += head_value[i] * w_out[(h * kValue + i) * kModel + m];
          served[m] += up[i] * w_out[(h * kValue + i) * kModel + m];
        }
      }
    }
    for (int m = 0; m < kModel; ++m) {
      max_error = std::max(max_error, std::abs(served[m] - explicit_out[m]));
      max_magnitude = std::max(max_magnitude, std::abs(explicit_out[m]));
    }
  }
  EXPECT_GT(max_magnitude, 0.1);
  EXPECT_LE(max_error, 1e-5 * std::max(1.0, max_magnitude))
      << "magnitude " << max_magnitude;
}

// Per KV dtype (the stored latents are rounded to it, and the one kernel
// reads them in place for every path) and shape.
struct LatentCase {
  const char* name;
  v1::DType kv_dtype;
  LatentShape shape;
};
class LatentPathsTest : public LatentTest,
                        public ::testing::WithParamInterface<LatentCase> {};

TEST_P(LatentPathsTest, EveryServingPathIsBitwiseTheExplicitValueOracle) {
  const LatentShape& shape = GetParam().shape;
  const v1::SessionSpec spec_in = LatentSpec(GetParam().kv_dtype, shape);
  auto whole = client().OpenSession(spec_in);
  auto chunked = client().OpenSession(spec_in);
  auto streamed = client().OpenSession(spec_in);
  auto batched = client().OpenSession(spec_in);
  ATTN_ASSERT_OK(whole);
  ATTN_ASSERT_OK(chunked);
  ATTN_ASSERT_OK(streamed);
  ATTN_ASSERT_OK(batched);
  const v1::SessionSpec& spec = whole->spec();
  // Crosses the 512-key split boundary.
  const int64_t prompt = 520, steps = 8, total = prompt + steps;
  std::vector<LatentTokens> tokens;
  client::StepOptions lse;
  lse.return_lse = true;
  for (int layer = 0; layer < 3; ++layer) {
    tokens.push_back(RandomLatent(total, 40 + layer, shape));
    const LatentTokens& t = tokens.back();
    auto one = whole->Prefill(layer, t.q_rows(0, total), t.k_rows(0, total),
                              {}, lse);
    ATTN_ASSERT_OK(one);
    auto oracle = client().Attention(ExplicitValues(t, total, spec, layer));
    ATTN_ASSERT_OK(oracle);
    EXPECT_EQ(one->output().data(), oracle->output().data()) << layer;
    EXPECT_EQ(one->lse().data(), oracle->lse().data()) << layer;

    std::string pieces;
    int64_t start = 0;
    for (int64_t size : {1, 200, 311, 8}) {
      auto part = chunked->Prefill(layer, t.q_rows(start, size),
                                   t.k_rows(start, size), {});
      ATTN_ASSERT_OK(part);
      pieces += part->output().data();
      start += size;
    }
    ASSERT_EQ(start, prompt);
    EXPECT_EQ(pieces, RowBytes(one->output(), 0, prompt)) << layer;
    for (client::SessionHandle* handle : {&*streamed, &*batched}) {
      ATTN_ASSERT_OK(
          handle->Prefill(layer, t.q_rows(0, prompt), t.k_rows(0, prompt), {}));
    }
  }
  const int64_t row_bytes = int64_t{shape.heads} * shape.latent * sizeof(float);
  auto stream = client().OpenDecodeStream();
  for (int64_t t = prompt; t < total; ++t) {
    v1::BatchDecodeRequest batch;
    std::vector<std::string> expected;  // per layer: the oracle's row t
    for (int layer = 0; layer < 3; ++layer) {
      auto oracle = client().Attention(
          ExplicitValues(tokens[layer], t + 1, spec, layer, /*first_row=*/t));
      ATTN_ASSERT_OK(oracle);
      expected.push_back(oracle->output().data());
      ASSERT_EQ(static_cast<int64_t>(expected.back().size()), row_bytes);
      auto request = streamed->MakeDecodeRequest(
          layer, tokens[layer].q_rows(t, 1), tokens[layer].k_rows(t, 1), {});
      ATTN_ASSERT_OK(request);
      auto step = stream->Step(*request);
      ATTN_ASSERT_OK(step);
      EXPECT_EQ(step->output().data(), expected[layer])
          << "layer " << layer << " step " << t;
      auto batch_step = batched->MakeDecodeRequest(
          layer, tokens[layer].q_rows(t, 1), tokens[layer].k_rows(t, 1), {});
      ATTN_ASSERT_OK(batch_step);
      *batch.add_steps() = *std::move(batch_step);
    }
    auto results = client().BatchDecode(batch);
    ATTN_ASSERT_OK(results);
    ASSERT_EQ(results->size(), 3u);
    for (int layer = 0; layer < 3; ++layer) {
      EXPECT_EQ((*results)[layer].output().data(), expected[layer])
          << "layer " << layer << " step " << t;
    }
  }
  ATTN_ASSERT_OK(stream->Finish());
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LatentPathsTest,
    ::testing::Values(LatentCase{"fp32", v1::DTYPE_FLOAT32, kSmall},
                      LatentCase{"fp16", v1::DTYPE_FLOAT16, kSmall},
                      LatentCase{"bf16", v1::DTYPE_BFLOAT16, kSmall},
                      LatentCase{"bf16_576_512", v1::DTYPE_BFLOAT16,
                                 kDeepSeek}),
    [](const ::testing::TestParamInfo<LatentCase>& info) {
      return std::string(info.param.name);
    });

TEST_F(LatentTest, ForkTruncateAndFailedCallsChangeNothing) {
  auto session = client().OpenSession(LatentSpec());
  ATTN_ASSERT_OK(session);
  const LatentTokens t = RandomLatent(64, 5);
  for (int layer = 0; layer < 3; ++layer) {
    ATTN_ASSERT_OK(session->Prefill(layer, t.q_rows(0, 40), t.k_rows(0, 40), {}));
  }
  auto fork = session->Fork();
  ATTN_ASSERT_OK(fork);
  // Both continue with the same token: same bits; then they diverge.
  auto a = session->DecodeStep(0, t.q_rows(40, 1), t.k_rows(40, 1), {});
  auto b = fork->DecodeStep(0, t.q_rows(40, 1), t.k_rows(40, 1), {});
  ATTN_ASSERT_OK(a);
  ATTN_ASSERT_OK(b);
  EXPECT_EQ(a->output().data(), b->output().data());
  ATTN_ASSERT_OK(fork->DecodeStep(0, t.q_rows(50, 1), t.k_rows(50, 1), {}));
  auto a2 = session->DecodeStep(0, t.q_rows(41, 1), t.k_rows(41, 1), {});
  ATTN_ASSERT_OK(a2);

  // Truncate back and replay: the same bits.
  ATTN_ASSERT_OK(session->Truncate(40));
  auto replay = session->DecodeStep(0, t.q_rows(40, 1), t.k_rows(40, 1), {});
  ATTN_ASSERT_OK(replay);
  EXPECT_EQ(replay->output().data(), a->output().data());

  // Sending v to a latent session fails and changes nothing.
  auto before = Snapshot(client(), session->id());
  ATTN_ASSERT_OK(before);
  v1::DecodeRequest with_v;
  {
    auto request =
        session->MakeDecodeRequest(0, t.q_rows(41, 1), t.k_rows(41, 1), {});
    ATTN_ASSERT_OK(request);
    with_v = *request;
    *with_v.mutable_v() = with_v.k();
  }
  ATTN_EXPECT_CODE(client().DecodeStep(with_v),
                   absl::StatusCode::kInvalidArgument);
  auto after = Snapshot(client(), session->id());
  ATTN_ASSERT_OK(after);
  EXPECT_EQ(*before, *after);
}

// One latent vector per token and layer: (latent_dim + rope_dim) * dtype
// bytes, half what K + V of the same width would take.
TEST_F(LatentTest, KvBytesPerTokenAreOneLatentVector) {
  const int64_t tokens = 256;  // whole 4 KiB blocks for both dtypes
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16}) {
    const int64_t element = dtype == v1::DTYPE_FLOAT32 ? 4 : 2;
    v1::SessionSpec latent_spec = MakeSpec(1, kHeads, 1, kWidth, {}, dtype);
    latent_spec.set_value_dim(kLatent);
    latent_spec.set_kv_layout(v1::KV_LAYOUT_SHARED_LATENT);
    latent_spec.set_scale(0.25f);
    v1::SessionSpec separate_spec = MakeSpec(1, kHeads, 1, kWidth, {}, dtype);
    auto latent = client().OpenSession(latent_spec);
    auto separate = client().OpenSession(separate_spec);
    ATTN_ASSERT_OK(latent);
    ATTN_ASSERT_OK(separate);
    const LatentTokens t = RandomLatent(tokens, 9);
    const std::vector<float> v(tokens * kWidth, 0.5f);
    ATTN_ASSERT_OK(
        latent->Prefill(0, t.q_rows(0, tokens), t.k_rows(0, tokens), {}));
    ATTN_ASSERT_OK(separate->Prefill(0, t.q_rows(0, tokens),
                                     t.k_rows(0, tokens), v));
    auto latent_info = latent->Info();
    auto separate_info = separate->Info();
    ATTN_ASSERT_OK(latent_info);
    ATTN_ASSERT_OK(separate_info);
    EXPECT_EQ(latent_info->kv_cache_bytes(), tokens * kWidth * element);
    EXPECT_EQ(separate_info->kv_cache_bytes(),
              2 * latent_info->kv_cache_bytes());
  }
}

}  // namespace
}  // namespace attention::testing
