// Numerical semantics over the RPC API, against a double-precision reference:
// half-precision KV storage and outputs, LSE, weights, bias, learned sinks,
// windows with StreamingLLM sinks, GQA grouping, empty-row policies.
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

constexpr double kTolerance = 2e-5;  // float32 accumulation vs double

class NumericsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = StartTestServer();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  client::AttentionClient& client() { return *server_->client; }

  std::unique_ptr<TestServer> server_;
};

// The reference problem for `tokens` (k/v as stored in `kv_dtype`) under a
// layer of the resolved `spec`.
ReferenceProblem ProblemFor(const Tokens& tokens, const v1::SessionSpec& spec,
                            int layer, v1::DType kv_dtype) {
  ReferenceProblem problem;
  problem.tq = problem.tk = tokens.count;
  problem.heads = tokens.heads;
  problem.kv_heads = tokens.kv_heads;
  problem.head_dim = tokens.head_dim;
  problem.value_dim = tokens.value_dim;
  problem.q = tokens.q;
  problem.k = RoundThrough(tokens.k, kv_dtype);
  problem.v = RoundThrough(tokens.v, kv_dtype);
  problem.causal = true;
  problem.scale = spec.scale();
  if (layer < spec.layers_size()) {
    problem.window = spec.layers(layer).window();
    problem.num_sink_tokens = spec.layers(layer).num_sink_tokens();
    problem.sink_logits.assign(spec.layers(layer).sink_logits().begin(),
                               spec.layers(layer).sink_logits().end());
  }
  return problem;
}

void ExpectNear(const std::vector<float>& got,
                const std::vector<double>& expected, double tolerance,
                const std::string& what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(expected[i])) {
      EXPECT_EQ(static_cast<double>(got[i]), expected[i]) << what << " " << i;
    } else {
      EXPECT_NEAR(got[i], expected[i], tolerance) << what << " element " << i;
    }
  }
}

TEST_F(NumericsTest, HalfPrecisionKvStorageUsesTheStoredValues) {
  for (v1::DType kv_dtype : {v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    v1::SessionSpec requested = MakeSpec(2, 4, 2, 16, {0, 12}, kv_dtype);
    requested.set_value_dim(8);
    auto session = client().OpenSession(requested);
    ATTN_ASSERT_OK(session);
    EXPECT_EQ(session->spec().kv_dtype(), kv_dtype);
    EXPECT_EQ(session->spec().value_dim(), 8);
    const int64_t prompt = 30, steps = 4;
    for (int layer = 0; layer < 2; ++layer) {
      const Tokens tokens =
          RandomTokens(session->spec(), prompt + steps, 60 + layer);
      client::StepOptions options;
      options.return_lse = true;
      auto prefill = session->Prefill(layer, tokens.q_rows(0, prompt),
                                      tokens.k_rows(0, prompt),
                                      tokens.v_rows(0, prompt), options);
      ATTN_ASSERT_OK(prefill);
      std::vector<float> output = Floats(prefill->output());
      std::vector<float> lse = Floats(prefill->lse());
      for (int64_t t = prompt; t < prompt + steps; ++t) {
        auto step =
            session->DecodeStep(layer, tokens.q_rows(t, 1), tokens.k_rows(t, 1),
                                tokens.v_rows(t, 1), options);
        ATTN_ASSERT_OK(step);
        for (float x : Floats(step->output())) output.push_back(x);
        for (float x : Floats(step->lse())) lse.push_back(x);
      }
      const ReferenceResult expected = ReferenceAttention(
          ProblemFor(tokens, session->spec(), layer, kv_dtype));
      const std::string what =
          absl::StrCat(v1::DType_Name(kv_dtype), " layer ", layer);
      ExpectNear(output, expected.output, kTolerance, what + " output");
      ExpectNear(lse, expected.lse, kTolerance, what + " lse");
    }
  }
}

TEST_F(NumericsTest, OutputDTypesAreTheRoundedFloat32Output) {
  auto base = client().OpenSession(MakeSpec(1, 4, 2, 16));
  ATTN_ASSERT_OK(base);
  const Tokens tokens = RandomTokens(base->spec(), 21, 77);
  ATTN_ASSERT_OK(base->Prefill(0, tokens.q_rows(0, 20), tokens.k_rows(0, 20),
                               tokens.v_rows(0, 20)));
  // Identical histories: the same step on each fork, in different dtypes.
  auto reference = base->Fork();
  ATTN_ASSERT_OK(reference);
  auto float32 = reference->DecodeStep(
      0, tokens.q_rows(20, 1), tokens.k_rows(20, 1), tokens.v_rows(20, 1));
  ATTN_ASSERT_OK(float32);
  EXPECT_EQ(float32->output().dtype(), v1::DTYPE_FLOAT32);
  for (v1::DType dtype : {v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    auto fork = base->Fork();
    ATTN_ASSERT_OK(fork);
    client::StepOptions options;
    options.output_dtype = dtype;
    auto result =
        fork->DecodeStep(0, tokens.q_rows(20, 1), tokens.k_rows(20, 1),
                         tokens.v_rows(20, 1), options);
    ATTN_ASSERT_OK(result);
    EXPECT_EQ(result->output().dtype(), dtype);
    EXPECT_EQ(result->output().data().size(), 4u * 16u * 2u);
    auto rounded =
        client::MakeTensor(Floats(float32->output()), {1, 4, 16}, dtype);
    ATTN_ASSERT_OK(rounded);
    EXPECT_EQ(result->output().data(), rounded->data())
        << v1::DType_Name(dtype);
  }
}

TEST_F(NumericsTest, HalfPrecisionInputsAreAccepted) {
  auto session = client().OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 10, 5);
  for (v1::DType input : {v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    auto fork = session->Fork();
    ATTN_ASSERT_OK(fork);
    client::StepOptions options;
    options.input_dtype = input;
    auto result = fork->Prefill(0, tokens.q, tokens.k, tokens.v, options);
    ATTN_ASSERT_OK(result);
    Tokens rounded = tokens;
    rounded.q = RoundThrough(tokens.q, input);
    rounded.k = RoundThrough(tokens.k, input);
    rounded.v = RoundThrough(tokens.v, input);
    const ReferenceResult expected = ReferenceAttention(
        ProblemFor(rounded, fork->spec(), 0, v1::DTYPE_FLOAT32));
    ExpectNear(Floats(result->output()), expected.output, kTolerance,
               v1::DType_Name(input));
  }
}

TEST_F(NumericsTest, StatelessWeightsLseAndBiasMatchTheReference) {
  // GQA with 4 query heads per KV head; query heads read KV head h / 4.
  const int64_t tq = 6, tk = 9, heads = 8, kv_heads = 2, dim = 16, vdim = 12;
  ReferenceProblem problem;
  problem.tq = tq;
  problem.tk = tk;
  problem.heads = heads;
  problem.kv_heads = kv_heads;
  problem.head_dim = dim;
  problem.value_dim = vdim;
  problem.q = RandomFloats(tq * heads * dim, 1);
  problem.k = RandomFloats(tk * kv_heads * dim, 2);
  problem.v = RandomFloats(tk * kv_heads * vdim, 3);
  problem.causal = false;
  problem.scale = 0.3;
  problem.bias = RandomFloats(heads * tq * tk, 4, 2.0f);
  problem.bias[5] = -std::numeric_limits<float>::infinity();

  v1::AttentionRequest request;
  *request.mutable_q() = *client::MakeTensor(problem.q, {tq, heads, dim});
  *request.mutable_k() = *client::MakeTensor(problem.k, {tk, kv_heads, dim});
  *request.mutable_v() = *client::MakeTensor(problem.v, {tk, kv_heads, vdim});
  *request.mutable_bias() = *client::MakeTensor(problem.bias, {heads, tq, tk});
  request.set_scale(0.3f);
  request.set_return_weights(true);
  request.set_return_lse(true);
  auto result = client().Attention(request);
  ATTN_ASSERT_OK(result);
  EXPECT_EQ(result->position(), 0);
  ASSERT_EQ(result->weights().shape_size(), 3);
  EXPECT_EQ(result->weights().shape(0), heads);
  EXPECT_EQ(result->weights().shape(1), tq);
  EXPECT_EQ(result->weights().shape(2), tk);
  EXPECT_EQ(result->weights().dtype(), v1::DTYPE_FLOAT32);
  ASSERT_EQ(result->lse().shape_size(), 2);
  EXPECT_EQ(result->lse().shape(0), tq);
  EXPECT_EQ(result->lse().shape(1), heads);

  problem.scale = static_cast<double>(0.3f);
  const ReferenceResult expected = ReferenceAttention(problem);
  ExpectNear(Floats(result->output()), expected.output, kTolerance, "output");
  ExpectNear(Floats(result->weights()), expected.weights, kTolerance,
             "weights");
  ExpectNear(Floats(result->lse()), expected.lse, kTolerance, "lse");
  // Without sinks every row of weights sums to one.
  const std::vector<float> weights = Floats(result->weights());
  for (int64_t row = 0; row < heads * tq; ++row) {
    double sum = 0.0;
    for (int64_t j = 0; j < tk; ++j) sum += weights[row * tk + j];
    EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << row;
  }

  // A [T_q, T_k] bias applies to every head.
  std::vector<float> shared_bias = RandomFloats(tq * tk, 9);
  *request.mutable_bias() = *client::MakeTensor(shared_bias, {tq, tk});
  problem.bias.clear();
  for (int64_t h = 0; h < heads; ++h) {
    problem.bias.insert(problem.bias.end(), shared_bias.begin(),
                        shared_bias.end());
  }
  result = client().Attention(request);
  ATTN_ASSERT_OK(result);
  ExpectNear(Floats(result->output()), ReferenceAttention(problem).output,
             kTolerance, "shared bias output");
}

TEST_F(NumericsTest, LearnedSinksAbsorbMassAndEmptyRowsBecomeZero) {
  const int64_t t = 5, heads = 2, dim = 8;
  ReferenceProblem problem;
  problem.tq = problem.tk = t;
  problem.heads = heads;
  problem.kv_heads = 1;
  problem.head_dim = problem.value_dim = dim;
  problem.q = RandomFloats(t * heads * dim, 21);
  problem.k = RandomFloats(t * dim, 22);
  problem.v = RandomFloats(t * dim, 23);
  problem.causal = true;
  problem.sink_logits = {0.7f, -0.4f};
  // Row 2 sees no key through the bias: with sinks it is zeros, not an error.
  problem.bias.assign(heads * t * t, 0.0f);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t j = 0; j < t; ++j) {
      problem.bias[(h * t + 2) * t + j] =
          -std::numeric_limits<float>::infinity();
    }
  }
  v1::AttentionRequest request;
  *request.mutable_q() = *client::MakeTensor(problem.q, {t, heads, dim});
  *request.mutable_k() = *client::MakeTensor(problem.k, {t, 1, dim});
  *request.mutable_v() = *client::MakeTensor(problem.v, {t, 1, dim});
  *request.mutable_bias() = *client::MakeTensor(problem.bias, {heads, t, t});
  request.set_causal(true);
  request.add_sink_logits(0.7f);
  request.add_sink_logits(-0.4f);
  request.set_return_weights(true);
  request.set_return_lse(true);
  auto result = client().Attention(request);
  ATTN_ASSERT_OK(result);
  const ReferenceResult expected = ReferenceAttention(problem);
  ExpectNear(Floats(result->output()), expected.output, kTolerance, "output");
  ExpectNear(Floats(result->lse()), expected.lse, kTolerance, "lse");
  const std::vector<float> weights = Floats(result->weights());
  ExpectNear(weights, expected.weights, kTolerance, "weights");
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < t; ++i) {
      double sum = 0.0;
      for (int64_t j = 0; j < t; ++j) sum += weights[(h * t + i) * t + j];
      EXPECT_LT(sum, 1.0) << "head " << h << " row " << i;
    }
  }
  const std::vector<float> output = Floats(result->output());
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < dim; ++d) {
      EXPECT_EQ(output[(2 * heads + h) * dim + d], 0.0f);
    }
  }

  // The same learned sinks in a session layer give the same outputs.
  v1::SessionSpec spec = MakeSpec(1, heads, 1, dim, {0});
  spec.mutable_layers(0)->add_sink_logits(0.7f);
  spec.mutable_layers(0)->add_sink_logits(-0.4f);
  auto session = client().OpenSession(spec);
  ATTN_ASSERT_OK(session);
  auto prefill = session->Prefill(0, problem.q, problem.k, problem.v);
  ATTN_ASSERT_OK(prefill);
  problem.bias.clear();
  ExpectNear(Floats(prefill->output()), ReferenceAttention(problem).output,
             kTolerance, "session with learned sinks");
}

TEST_F(NumericsTest, EmptyRowPolicyZeroGivesZerosAndMinusInfinityLse) {
  const int64_t t = 4, dim = 8;
  std::vector<float> bias(t * t, 0.0f);
  for (int64_t j = 0; j < t; ++j) {
    bias[1 * t + j] = -std::numeric_limits<float>::infinity();
  }
  v1::AttentionRequest request;
  *request.mutable_q() =
      *client::MakeTensor(RandomFloats(t * dim, 1), {t, 1, dim});
  *request.mutable_k() =
      *client::MakeTensor(RandomFloats(t * dim, 2), {t, 1, dim});
  *request.mutable_v() =
      *client::MakeTensor(RandomFloats(t * dim, 3), {t, 1, dim});
  *request.mutable_bias() = *client::MakeTensor(bias, {t, t});
  request.set_return_lse(true);
  request.set_empty_row_policy(v1::EMPTY_ROW_POLICY_ERROR);
  auto error = client().Attention(request);
  ATTN_EXPECT_CODE(error, absl::StatusCode::kInvalidArgument);

  request.set_empty_row_policy(v1::EMPTY_ROW_POLICY_ZERO);
  auto result = client().Attention(request);
  ATTN_ASSERT_OK(result);
  const std::vector<float> output = Floats(result->output());
  for (int64_t d = 0; d < dim; ++d) EXPECT_EQ(output[1 * dim + d], 0.0f);
  const std::vector<float> lse = Floats(result->lse());
  EXPECT_EQ(lse[1], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isfinite(lse[0]));
}

TEST_F(NumericsTest, WindowSinksAndQueryStartMatchTheReference) {
  const int64_t tq = 7, tk = 40, heads = 4, kv_heads = 2, dim = 16;
  ReferenceProblem problem;
  problem.tq = tq;
  problem.tk = tk;
  problem.heads = heads;
  problem.kv_heads = kv_heads;
  problem.head_dim = problem.value_dim = dim;
  problem.q = RandomFloats(tq * heads * dim, 31);
  problem.k = RandomFloats(tk * kv_heads * dim, 32);
  problem.v = RandomFloats(tk * kv_heads * dim, 33);
  problem.causal = true;
  problem.window = 6;
  problem.num_sink_tokens = 3;
  problem.query_start = 30;
  v1::AttentionRequest request;
  *request.mutable_q() = *client::MakeTensor(problem.q, {tq, heads, dim});
  *request.mutable_k() = *client::MakeTensor(problem.k, {tk, kv_heads, dim});
  *request.mutable_v() = *client::MakeTensor(problem.v, {tk, kv_heads, dim});
  request.set_causal(true);
  request.set_window(6);
  request.set_num_sink_tokens(3);
  request.set_query_start(30);
  request.set_return_weights(true);
  auto result = client().Attention(request);
  ATTN_ASSERT_OK(result);
  EXPECT_EQ(result->position(), 30);
  const ReferenceResult expected = ReferenceAttention(problem);
  ExpectNear(Floats(result->output()), expected.output, kTolerance, "output");
  ExpectNear(Floats(result->weights()), expected.weights, kTolerance,
             "weights");
}

}  // namespace
}  // namespace attention::testing
