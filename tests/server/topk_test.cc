// Top-k sparse layers through the gRPC API: the spec round trip, selected
// positions in the reply, the output (and LSE, with window, sink tokens and
// learned sinks) bitwise equal to stateless attention over the selected
// keys, chunked / streamed / batched / forked / truncated runs equal to
// one-shot prefill, and failed calls changing nothing. (Export and import:
// tests/server/session_transfer_test.cc.)
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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

// A top-k layer with a window, StreamingLLM sink tokens, learned sink
// logits and LSE.
struct WindowCase {
  const char* name;
  int window, sink_tokens, topk;
  int64_t prompt, total;
  std::vector<int64_t> chunks;  // of the prompt
  std::vector<int64_t> rows;    // checked against the oracle
};

class TopKWindowTest : public TopKTest,
                       public ::testing::WithParamInterface<WindowCase> {};

// Every row selects only keys its mask shows and its output and LSE are
// bitwise the stateless attention (with the sinks) over them; chunked
// prefill, streamed decode, BatchDecode, a fork and a truncation followed by
// replay all give the one-shot bits.
TEST_P(TopKWindowTest, WindowSinksLseAndEveryServingPathOnATopKLayer) {
  const WindowCase& c = GetParam();
  v1::SessionSpec spec_in = MakeSpec(2, 4, 2, 16, {c.window, 0});
  spec_in.mutable_layers(0)->set_num_sink_tokens(c.sink_tokens);
  spec_in.mutable_layers(0)->set_topk(c.topk);
  for (int h = 0; h < 4; ++h) {
    spec_in.mutable_layers(0)->add_sink_logits(0.3f * h - 0.4f);
  }
  spec_in.set_index_dim(kIndexDim);
  spec_in.set_index_heads(kIndexHeads);
  auto whole = client().OpenSession(spec_in);
  auto chunked = client().OpenSession(spec_in);
  auto streamed = client().OpenSession(spec_in);
  auto batched = client().OpenSession(spec_in);
  ATTN_ASSERT_OK(whole);
  ATTN_ASSERT_OK(chunked);
  ATTN_ASSERT_OK(streamed);
  ATTN_ASSERT_OK(batched);
  const v1::SessionSpec& spec = whole->spec();
  const int64_t prompt = c.prompt, total = c.total;
  const Tokens tokens = RandomTokens(spec, total, 61);
  const IndexInputs index(total, 62);
  client::StepOptions with_lse;
  with_lse.return_lse = true;
  auto prefill = [&](client::SessionHandle& session, int layer, int64_t begin,
                     int64_t rows) -> absl::StatusOr<v1::AttentionResult> {
    auto request = session.MakePrefillRequest(
        layer, tokens.q_rows(begin, rows), tokens.k_rows(begin, rows),
        tokens.v_rows(begin, rows), with_lse);
    if (!request.ok()) return request.status();
    if (layer == 0) index.AddTo(&*request, begin, rows);
    return client().Prefill(*request);
  };
  auto decode_request = [&](client::SessionHandle& session, int layer,
                            int64_t t) {
    auto request = session.MakeDecodeRequest(layer, tokens.q_rows(t, 1),
                                             tokens.k_rows(t, 1),
                                             tokens.v_rows(t, 1), with_lse);
    EXPECT_TRUE(request.ok()) << request.status();
    if (layer == 0 && request.ok()) index.AddTo(&*request, t, 1);
    return *request;
  };
  // The one-shot reply's row t: output, LSE and selection.
  auto all = prefill(*whole, 0, 0, total);
  ATTN_ASSERT_OK(all);
  auto row_of = [&](int64_t t) {
    std::string bytes =
        RowBytes(all->output(), t, 1) + RowBytes(all->lse(), t, 1);
    for (int i = 0; i < c.topk; ++i) {
      bytes += absl::StrCat(",", all->topk_indices(t * c.topk + i));
    }
    return bytes;
  };
  auto bytes_of = [](const v1::AttentionResult& result) {
    std::string bytes = result.output().data() + result.lse().data();
    for (int64_t position : result.topk_indices()) {
      bytes += absl::StrCat(",", position);
    }
    return bytes;
  };

  for (int64_t t : c.rows) {
    std::vector<float> k, v;
    int64_t selected = 0;
    for (int i = 0; i < c.topk; ++i) {
      const int64_t s = all->topk_indices(t * c.topk + i);
      if (s < 0) continue;
      ++selected;
      EXPECT_TRUE(s <= t && (t - s < c.window || s < c.sink_tokens))
          << "row " << t << " selected invisible key " << s;
      const auto ks = tokens.k_rows(s, 1);
      const auto vs = tokens.v_rows(s, 1);
      k.insert(k.end(), ks.begin(), ks.end());
      v.insert(v.end(), vs.begin(), vs.end());
    }
    const int64_t visible =
        std::min<int64_t>(t + 1, c.window) +
        std::clamp<int64_t>(t + 1 - c.window, 0, c.sink_tokens);
    EXPECT_EQ(selected, std::min<int64_t>(visible, c.topk)) << "row " << t;
    v1::AttentionRequest oracle;
    SetTensor(oracle.mutable_q(), tokens.q_rows(t, 1), {1, 4, 16});
    SetTensor(oracle.mutable_k(), k, {selected, 2, 16});
    SetTensor(oracle.mutable_v(), v, {selected, 2, 16});
    oracle.set_scale(spec.scale());
    *oracle.mutable_sink_logits() = spec.layers(0).sink_logits();
    oracle.set_return_lse(true);
    auto expected = client().Attention(oracle);
    ATTN_ASSERT_OK(expected);
    EXPECT_EQ(RowBytes(all->output(), t, 1), expected->output().data())
        << "row " << t;
    EXPECT_EQ(RowBytes(all->lse(), t, 1), expected->lse().data())
        << "row " << t;
  }

  // Chunked prefill.
  std::string pieces;
  int64_t start = 0;
  for (int64_t size : c.chunks) {
    auto part = prefill(*chunked, 0, start, size);
    ATTN_ASSERT_OK(part);
    pieces += bytes_of(*part);
    start += size;
  }
  ASSERT_EQ(start, prompt);
  // Each piece holds its rows' outputs, LSE and indices.
  {
    std::string expected_pieces;
    int64_t begin = 0;
    for (int64_t size : c.chunks) {
      expected_pieces += RowBytes(all->output(), begin, size) +
                         RowBytes(all->lse(), begin, size);
      for (int64_t i = begin * c.topk; i < (begin + size) * c.topk; ++i) {
        expected_pieces += absl::StrCat(",", all->topk_indices(i));
      }
      begin += size;
    }
    EXPECT_EQ(pieces, expected_pieces);
  }

  // Streamed decode and BatchDecode (with the dense layer beside it).
  for (client::SessionHandle* session : {&*streamed, &*batched}) {
    for (int layer = 0; layer < 2; ++layer) {
      ATTN_ASSERT_OK(prefill(*session, layer, 0, prompt));
    }
  }
  auto stream = client().OpenDecodeStream();
  for (int64_t t = prompt; t < total; ++t) {
    auto step = stream->Step(decode_request(*streamed, 0, t));
    ATTN_ASSERT_OK(step);
    EXPECT_EQ(bytes_of(*step), row_of(t)) << "streamed step " << t;
    v1::BatchDecodeRequest batch;
    *batch.add_steps() = decode_request(*batched, 1, t);
    *batch.add_steps() = decode_request(*batched, 0, t);
    auto results = client().BatchDecode(batch);
    ATTN_ASSERT_OK(results);
    ASSERT_EQ(results->size(), 2u);
    EXPECT_EQ(bytes_of((*results)[1]), row_of(t)) << "batched step " << t;
  }
  ATTN_ASSERT_OK(stream->Finish());

  // Fork and truncate: the same bits again.
  auto fork = chunked->Fork();
  ATTN_ASSERT_OK(fork);
  for (client::SessionHandle* session : {&*chunked, &*fork}) {
    auto step = client().DecodeStep(decode_request(*session, 0, prompt));
    ATTN_ASSERT_OK(step);
    EXPECT_EQ(bytes_of(*step), row_of(prompt));
  }
  auto next = client().DecodeStep(decode_request(*chunked, 0, prompt + 1));
  ATTN_ASSERT_OK(next);
  ATTN_ASSERT_OK(chunked->Truncate(prompt));
  auto replay = client().DecodeStep(decode_request(*chunked, 0, prompt));
  ATTN_ASSERT_OK(replay);
  EXPECT_EQ(bytes_of(*replay), row_of(prompt));
  auto replay_next =
      client().DecodeStep(decode_request(*chunked, 0, prompt + 1));
  ATTN_ASSERT_OK(replay_next);
  EXPECT_EQ(bytes_of(*replay_next), bytes_of(*next));
  EXPECT_EQ(bytes_of(*replay_next), row_of(prompt + 1));
}

// The long case selects more than 512 keys in a window of more than 512:
// the attention over the selection is split into key chunks as dense
// attention over as many keys is.
INSTANTIATE_TEST_SUITE_P(
    Windows, TopKWindowTest,
    ::testing::Values(WindowCase{"short",
                                 40,
                                 3,
                                 kTopK,
                                 80,
                                 90,
                                 {1, 30, 49},
                                 {0, 2, 3, 20, 39, 40, 41, 43, 44, 60, 89}},
                      WindowCase{
                          "long",
                          560,
                          4,
                          530,
                          600,
                          606,
                          {1, 300, 299},
                          {0, 529, 530, 531, 559, 560, 563, 564, 599, 605}}),
    [](const ::testing::TestParamInfo<WindowCase>& info) {
      return std::string(info.param.name);
    });

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
