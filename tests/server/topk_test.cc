// Top-k sparse layers through the gRPC API: the spec round trip, selected
// positions in the reply, the output bitwise equal to stateless attention
// over the selected keys, streamed decode equal to one-shot prefill, and
// failed calls changing nothing.
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

constexpr int kIndexHeads = 2;
constexpr int kIndexDim = 8;
constexpr int kTopK = 16;

class TopKTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = StartTestServer();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  client::AttentionClient& client() { return *server_->client; }

  std::unique_ptr<TestServer> server_;
};

// Layer 0 top-k (ReLU index), layer 1 dense.
v1::SessionSpec SparseSpec() {
  v1::SessionSpec spec = MakeSpec(2, 4, 2, 16, {0, 0});
  spec.mutable_layers(0)->set_topk(kTopK);
  spec.mutable_layers(0)->set_index_score(v1::INDEX_SCORE_RELU);
  spec.set_index_dim(kIndexDim);
  spec.set_index_heads(kIndexHeads);
  return spec;
}

void SetTensor(v1::Tensor* out, absl::Span<const float> values,
               std::vector<int64_t> shape) {
  out->set_dtype(v1::DTYPE_FLOAT32);
  out->clear_shape();
  for (int64_t d : shape) out->add_shape(d);
  out->set_data(reinterpret_cast<const char*>(values.data()),
                values.size() * sizeof(float));
}

struct IndexInputs {
  std::vector<float> k, q, w;
  explicit IndexInputs(int64_t count, uint32_t seed)
      : k(RandomFloats(count * kIndexDim, seed)),
        q(RandomFloats(count * kIndexHeads * kIndexDim, seed + 1)),
        w(RandomFloats(count * kIndexHeads, seed + 2)) {}
  template <typename Request>
  void AddTo(Request* request, int64_t begin, int64_t rows) const {
    SetTensor(request->mutable_index_k(),
              absl::MakeConstSpan(k).subspan(begin * kIndexDim,
                                             rows * kIndexDim),
              {rows, kIndexDim});
    SetTensor(request->mutable_index_q(),
              absl::MakeConstSpan(q).subspan(begin * kIndexHeads * kIndexDim,
                                             rows * kIndexHeads * kIndexDim),
              {rows, kIndexHeads, kIndexDim});
    SetTensor(request->mutable_index_weights(),
              absl::MakeConstSpan(w).subspan(begin * kIndexHeads,
                                             rows * kIndexHeads),
              {rows, kIndexHeads});
    request->set_return_topk_indices(true);
  }
};

TEST_F(TopKTest, ServedOutputIsDenseAttentionOverTheSelectedKeys) {
  auto session = client().OpenSession(SparseSpec());
  ATTN_ASSERT_OK(session);
  EXPECT_EQ(session->spec().layers(0).topk(), kTopK);
  EXPECT_EQ(session->spec().layers(0).index_score(), v1::INDEX_SCORE_RELU);
  EXPECT_EQ(session->spec().index_dim(), kIndexDim);
  const v1::SessionSpec& spec = session->spec();
  const int64_t prompt = 60, steps = 5, total = prompt + steps;
  const Tokens tokens = RandomTokens(spec, total, 21);
  const IndexInputs index(total, 33);

  auto one_shot = client().OpenSession(SparseSpec());
  ATTN_ASSERT_OK(one_shot);
  auto whole = one_shot->MakePrefillRequest(0, tokens.q_rows(0, total),
                                            tokens.k_rows(0, total),
                                            tokens.v_rows(0, total));
  ATTN_ASSERT_OK(whole);
  index.AddTo(&*whole, 0, total);
  auto all = client().Prefill(*whole);
  ATTN_ASSERT_OK(all);
  ASSERT_EQ(all->topk_indices_size(), total * kTopK);

  // Each row: stateless non-causal attention over its selected keys.
  for (int64_t row = 0; row < total; row += 7) {
    std::vector<float> k, v;
    for (int i = 0; i < kTopK; ++i) {
      const int64_t s = all->topk_indices(row * kTopK + i);
      if (i <= row) {
        ASSERT_GE(s, 0);
      } else {
        ASSERT_EQ(s, -1);
        continue;
      }
      const auto ks = tokens.k_rows(s, 1);
      const auto vs = tokens.v_rows(s, 1);
      k.insert(k.end(), ks.begin(), ks.end());
      v.insert(v.end(), vs.begin(), vs.end());
    }
    const int64_t n = static_cast<int64_t>(k.size()) / (2 * 16);
    EXPECT_EQ(n, std::min<int64_t>(row + 1, kTopK));
    v1::AttentionRequest oracle;
    SetTensor(oracle.mutable_q(), tokens.q_rows(row, 1), {1, 4, 16});
    SetTensor(oracle.mutable_k(), k, {n, 2, 16});
    SetTensor(oracle.mutable_v(), v, {n, 2, 16});
    oracle.set_scale(spec.scale());
    auto expected = client().Attention(oracle);
    ATTN_ASSERT_OK(expected);
    EXPECT_EQ(RowBytes(all->output(), row, 1), expected->output().data())
        << "row " << row;
  }

  // Prefill then streamed decode: bitwise the one-shot rows and the same
  // selections.
  auto prefill = session->MakePrefillRequest(0, tokens.q_rows(0, prompt),
                                             tokens.k_rows(0, prompt),
                                             tokens.v_rows(0, prompt));
  ATTN_ASSERT_OK(prefill);
  index.AddTo(&*prefill, 0, prompt);
  auto first = client().Prefill(*prefill);
  ATTN_ASSERT_OK(first);
  EXPECT_EQ(first->output().data(), RowBytes(all->output(), 0, prompt));
  auto stream = client().OpenDecodeStream();
  for (int64_t t = prompt; t < total; ++t) {
    auto step = session->MakeDecodeRequest(0, tokens.q_rows(t, 1),
                                           tokens.k_rows(t, 1),
                                           tokens.v_rows(t, 1));
    ATTN_ASSERT_OK(step);
    index.AddTo(&*step, t, 1);
    auto result = stream->Step(*step);
    ATTN_ASSERT_OK(result);
    EXPECT_EQ(result->output().data(), RowBytes(all->output(), t, 1));
    ASSERT_EQ(result->topk_indices_size(), kTopK);
    for (int i = 0; i < kTopK; ++i) {
      EXPECT_EQ(result->topk_indices(i), all->topk_indices(t * kTopK + i));
    }
  }
  ATTN_ASSERT_OK(stream->Finish());
}

TEST_F(TopKTest, MissingOrMisplacedIndexInputsFailAndChangeNothing) {
  auto session = client().OpenSession(SparseSpec());
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 4, 5);
  const IndexInputs index(4, 6);
  auto before = Snapshot(client(), session->id());
  ATTN_ASSERT_OK(before);
  // Top-k layer without its index.
  auto bare = session->MakePrefillRequest(0, tokens.q_rows(0, 4),
                                          tokens.k_rows(0, 4),
                                          tokens.v_rows(0, 4));
  ATTN_ASSERT_OK(bare);
  ATTN_EXPECT_CODE(client().Prefill(*bare), absl::StatusCode::kInvalidArgument);
  // Dense layer with one.
  auto dense = session->MakePrefillRequest(1, tokens.q_rows(0, 4),
                                           tokens.k_rows(0, 4),
                                           tokens.v_rows(0, 4));
  ATTN_ASSERT_OK(dense);
  index.AddTo(&*dense, 0, 4);
  ATTN_EXPECT_CODE(client().Prefill(*dense),
                   absl::StatusCode::kInvalidArgument);
  auto after = Snapshot(client(), session->id());
  ATTN_ASSERT_OK(after);
  EXPECT_EQ(*before, *after);

  // A top-k spec without an index is refused.
  v1::SessionSpec no_index = SparseSpec();
  no_index.set_index_dim(0);
  ATTN_EXPECT_CODE(client().OpenSession(no_index),
                   absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attention::testing
