// Top-k sparse layers on the CPU backend, through the engine: the selection
// against a float64 reference with the same tie rule, the output against
// dense attention over the selected keys (bitwise), k >= visible as dense
// attention, the session operations, and the seeds' shortlist experiment.
#include "core/cpu/topk_attention.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/cpu/cpu_backend.h"
#include "core/engine.h"
#include "core/work_plan.h"
#include "gtest/gtest.h"
#include "tests/core/test_tensors.h"
#include "tests/core/withdraw_at.h"

namespace attention {
namespace {

using testing::FloatTensor;
using testing::HostTensor;
using testing::RandomTensor;
using testing::ToFloats;
using testing::WithdrawAt;

constexpr int kHeads = 4;
constexpr int kKvHeads = 2;
constexpr int kDim = 16;
constexpr int kValueDim = 8;
constexpr int kIndexHeads = 3;
constexpr int kIndexDim = 8;

// `backend`, when given, is set to the engine's backend.
std::unique_ptr<AttentionEngine> MakeEngine(CpuBackend** backend = nullptr) {
  EngineOptions options;
  options.kv_cache_bytes = int64_t{64} << 20;
  options.kv_block_bytes = 4096;
  options.sessions.reap_interval = absl::ZeroDuration();
  auto cpu = std::make_unique<CpuBackend>(2);
  if (backend != nullptr) *backend = cpu.get();
  auto engine = AttentionEngine::Create(std::move(cpu), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return *std::move(engine);
}

// Layers: full causal top-k; window 40 + 3 sinks top-k (ReLU index) with
// learned sinks; a dense full layer.
SessionSpec TopKSpec(int topk) {
  SessionSpec spec;
  spec.num_layers = 3;
  spec.num_q_heads = kHeads;
  spec.num_kv_heads = kKvHeads;
  spec.head_dim = kDim;
  spec.value_dim = kValueDim;
  spec.index_dim = kIndexDim;
  spec.index_heads = kIndexHeads;
  spec.max_tokens = 4096;
  spec.layers.resize(3);
  spec.layers[0].topk = topk;
  spec.layers[1].topk = topk;
  spec.layers[1].window = 40;
  spec.layers[1].num_sink_tokens = 3;
  spec.layers[1].index_score = IndexScore::kRelu;
  spec.layers[1].sink_logits = {0.5f, -1.0f, 2.0f, 0.0f};
  return spec;
}

// Tokens with small-integer index inputs, so that float32 index scores are
// exact and ties are frequent (the tie rule decides).
struct Tokens {
  HostTensor q, k, v, index_k, index_q, index_w;
  Tokens(int64_t count, uint32_t seed, int index_heads = kIndexHeads,
         int index_dim = kIndexDim, int q_heads = kHeads,
         int kv_heads = kKvHeads) {
    std::mt19937 rng(seed);
    q = RandomTensor({count, q_heads, kDim}, rng);
    k = RandomTensor({count, kv_heads, kDim}, rng);
    v = RandomTensor({count, kv_heads, kValueDim}, rng);
    std::uniform_int_distribution<int> small(-2, 2);
    auto integers = [&](Shape shape) {
      std::vector<float> values(NumElements(shape));
      for (float& x : values) x = static_cast<float>(small(rng));
      return FloatTensor(shape, values);
    };
    index_k = integers({count, index_dim});
    index_q = integers({count, index_heads, index_dim});
    index_w = integers({count, index_heads});
  }
};

AppendRequest Request(const std::string& id, int layer, const Tokens& t,
                      int64_t begin, int64_t end, bool index) {
  AppendRequest r;
  r.session_id = id;
  r.layer = layer;
  r.q = t.q.rows(begin, end);
  r.k = t.k.rows(begin, end);
  r.v = t.v.rows(begin, end);
  r.return_lse = true;
  if (index) {
    r.index_k = t.index_k.rows(begin, end);
    r.index_q = t.index_q.rows(begin, end);
    r.index_weights = t.index_w.rows(begin, end);
    r.return_topk_indices = true;
  }
  return r;
}

// Sets every element of row `row` of `x` to `value`.
void SetRow(HostTensor& x, int64_t row, float value) {
  std::vector<float> values = x.values;
  const int64_t width = NumElements(x.shape) / x.shape[0];
  std::fill(values.begin() + row * width, values.begin() + (row + 1) * width,
            value);
  x = FloatTensor(x.shape, values);
}

// The float64 reference selection of the query at `position` (tie: lower
// position first), increasing.
std::vector<int64_t> ReferenceSelection(const Tokens& t, int64_t row,
                                        int64_t position, const LayerSpec& layer) {
  std::vector<std::pair<double, int64_t>> scored;
  for (int64_t s = 0; s <= position; ++s) {
    const bool visible = layer.window == 0 || position - s < layer.window ||
                         s < layer.num_sink_tokens;
    if (!visible) continue;
    double score = 0;
    for (int j = 0; j < kIndexHeads; ++j) {
      double dot = 0;
      for (int d = 0; d < kIndexDim; ++d) {
        dot += double{t.index_q.values[(row * kIndexHeads + j) * kIndexDim + d]} *
               t.index_k.values[s * kIndexDim + d];
      }
      if (layer.index_score == IndexScore::kRelu) dot = std::max(dot, 0.0);
      score += t.index_w.values[row * kIndexHeads + j] * dot;
    }
    scored.emplace_back(score, s);
  }
  std::sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  scored.resize(std::min<size_t>(scored.size(), layer.topk));
  std::vector<int64_t> positions;
  for (const auto& [score, s] : scored) positions.push_back(s);
  std::sort(positions.begin(), positions.end());
  return positions;
}

// Rows [row, row + 1) of `t`'s keys at `positions`, gathered as contiguous
// k/v tensors.
std::pair<HostTensor, HostTensor> Gather(const Tokens& t,
                                         const std::vector<int64_t>& positions) {
  std::vector<float> k, v;
  for (int64_t s : positions) {
    k.insert(k.end(), t.k.values.begin() + s * kKvHeads * kDim,
             t.k.values.begin() + (s + 1) * kKvHeads * kDim);
    v.insert(v.end(), t.v.values.begin() + s * kKvHeads * kValueDim,
             t.v.values.begin() + (s + 1) * kKvHeads * kValueDim);
  }
  const int64_t n = static_cast<int64_t>(positions.size());
  return {FloatTensor({n, kKvHeads, kDim}, k),
          FloatTensor({n, kKvHeads, kValueDim}, v)};
}

// Row `row` of `selected` ([T, topk] as an append returns them) is `want`
// padded with -1.
void ExpectSelection(const std::vector<int64_t>& selected, int topk,
                     int64_t row, const std::vector<int64_t>& want) {
  std::vector<int64_t> got(selected.begin() + row * topk,
                           selected.begin() + (row + 1) * topk);
  for (size_t i = want.size(); i < got.size(); ++i) {
    EXPECT_EQ(got[i], -1) << "padding of row " << row;
  }
  got.resize(want.size());
  ASSERT_EQ(got, want) << "row " << row;
}

// Row `row` of an append's `output` [T, kHeads, kValueDim] and `lse` [T,
// kHeads] is bitwise dense non-causal attention of query `row` of `t`
// over exactly `keys` and `values` (the selected ones), with `layer`'s
// learned sinks.
void ExpectDenseOver(AttentionEngine& engine, const Tokens& t, int64_t row,
                     const HostTensor& keys, const HostTensor& values,
                     const LayerSpec& layer, float scale,
                     const std::vector<float>& output,
                     const std::vector<float>& lse) {
  StatelessRequest dense;
  dense.q = t.q.rows(row, row + 1);
  dense.k = keys.view();
  dense.v = values.view();
  dense.mask.causal = false;
  dense.sink_logits = layer.sink_logits;
  dense.scale = scale;
  dense.return_lse = true;
  auto oracle = engine.Attend(dense);
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  const std::vector<float> expected = ToFloats(oracle->output);
  for (int i = 0; i < kHeads * kValueDim; ++i) {
    ASSERT_EQ(output[row * kHeads * kValueDim + i], expected[i])
        << "row " << row << " element " << i;
  }
  const std::vector<float> expected_lse = ToFloats(*oracle->lse);
  for (int h = 0; h < kHeads; ++h) {
    ASSERT_EQ(lse[row * kHeads + h], expected_lse[h]) << "row " << row;
  }
}

TEST(TopKAttentionTest, SelectionMatchesReferenceAndOutputIsDenseOverIt) {
  auto engine = MakeEngine();
  const SessionSpec spec = TopKSpec(12);
  auto info = engine->CreateSession(spec, absl::ZeroDuration());
  ASSERT_TRUE(info.ok()) << info.status();
  const int64_t total = 90;
  for (int layer = 0; layer < 2; ++layer) {
    const Tokens t(total, 11 + layer);
    auto out = engine->Append(Request(info->session_id, layer, t, 0, total,
                                      /*index=*/true));
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->topk_indices.size(), static_cast<size_t>(total * 12));
    const std::vector<float> output = ToFloats(out->output);
    const std::vector<float> lse = ToFloats(*out->lse);
    const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
    for (int64_t row = 0; row < total; ++row) {
      SCOPED_TRACE(::testing::Message() << "layer " << layer);
      const std::vector<int64_t> want =
          ReferenceSelection(t, row, row, spec.layers[layer]);
      ASSERT_NO_FATAL_FAILURE(
          ExpectSelection(out->topk_indices, 12, row, want));
      const auto [k, v] = Gather(t, want);
      ASSERT_NO_FATAL_FAILURE(ExpectDenseOver(
          *engine, t, row, k, v, spec.layers[layer], scale, output, lse));
    }
  }
}

// MLA with top-k layers (DeepSeek-V3.2): one latent per token, shared by
// every query head, the values its leading value_dim entries. Each row's
// selection matches the reference, and its output is bitwise dense
// attention over the selected latents, for a prefill and for the decode
// steps after it.
TEST(TopKAttentionTest, SharedLatentSelectionMatchesAndOutputIsDenseOverIt) {
  auto engine = MakeEngine();
  SessionSpec spec = TopKSpec(12);
  spec.kv_layout = KvLayout::kSharedLatent;
  spec.num_kv_heads = 1;
  spec.scale = 0.2f;
  auto info = engine->CreateSession(spec, absl::ZeroDuration());
  ASSERT_TRUE(info.ok()) << info.status();
  const int64_t prompt = 60, total = 90;
  for (int layer = 0; layer < 2; ++layer) {
    const Tokens t(total, 21 + layer, kIndexHeads, kIndexDim, kHeads,
                   /*kv_heads=*/1);
    std::vector<float> output, lse;
    std::vector<int64_t> selected;
    // The prompt, then one decode step per token.
    for (int64_t begin = 0; begin < total;) {
      const int64_t end = begin == 0 ? prompt : begin + 1;
      AppendRequest r = Request(info->session_id, layer, t, begin, end,
                                /*index=*/true);
      r.v = TensorView();  // the values are the latents' leading entries
      auto out = engine->Append(r);
      ASSERT_TRUE(out.ok()) << out.status();
      const std::vector<float> o = ToFloats(out->output);
      const std::vector<float> l = ToFloats(*out->lse);
      output.insert(output.end(), o.begin(), o.end());
      lse.insert(lse.end(), l.begin(), l.end());
      selected.insert(selected.end(), out->topk_indices.begin(),
                      out->topk_indices.end());
      begin = end;
    }
    ASSERT_EQ(selected.size(), static_cast<size_t>(total * 12));
    for (int64_t row = 0; row < total; ++row) {
      SCOPED_TRACE(::testing::Message() << "layer " << layer);
      const std::vector<int64_t> want =
          ReferenceSelection(t, row, row, spec.layers[layer]);
      ASSERT_NO_FATAL_FAILURE(ExpectSelection(selected, 12, row, want));
      std::vector<float> k, v;
      for (int64_t s : want) {
        const auto latent = t.k.values.begin() + s * kDim;
        k.insert(k.end(), latent, latent + kDim);
        v.insert(v.end(), latent, latent + kValueDim);
      }
      const int64_t n = static_cast<int64_t>(want.size());
      ASSERT_NO_FATAL_FAILURE(
          ExpectDenseOver(*engine, t, row, FloatTensor({n, 1, kDim}, k),
                          FloatTensor({n, 1, kValueDim}, v), spec.layers[layer],
                          spec.scale, output, lse));
    }
  }
}

// k >= every row's visible count: dense attention. On a full causal layer
// the selected keys are [0, p], so even the chunking is the dense one:
// bitwise equal to the dense layer of the same session.
TEST(TopKAttentionTest, KAtLeastVisibleIsDenseAttention) {
  auto engine = MakeEngine();
  const SessionSpec spec = TopKSpec(4096);
  auto info = engine->CreateSession(spec, absl::ZeroDuration());
  ASSERT_TRUE(info.ok()) << info.status();
  const int64_t total = 600;  // crosses the 512-key split
  const Tokens t(total, 3);
  auto sparse =
      engine->Append(Request(info->session_id, 0, t, 0, total, true));
  auto dense =
      engine->Append(Request(info->session_id, 2, t, 0, total, false));
  ASSERT_TRUE(sparse.ok()) << sparse.status();
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_EQ(ToFloats(sparse->output), ToFloats(dense->output));
  EXPECT_EQ(ToFloats(*sparse->lse), ToFloats(*dense->lse));
  for (int64_t row = 0; row < total; ++row) {
    EXPECT_EQ(sparse->topk_indices[row * 4096 + row], row);
    EXPECT_EQ(sparse->topk_indices[row * 4096 + row + 1], -1);
  }
}

TEST(TopKAttentionTest, ChunkedBatchedForkedAndTruncatedAreBitwiseOneShot) {
  auto engine = MakeEngine();
  const SessionSpec spec = TopKSpec(20);
  auto whole = engine->CreateSession(spec, absl::ZeroDuration());
  auto pieces = engine->CreateSession(spec, absl::ZeroDuration());
  ASSERT_TRUE(whole.ok() && pieces.ok());
  const int64_t total = 140;
  std::vector<Tokens> tokens;
  std::vector<std::vector<float>> one_shot;
  for (int layer = 0; layer < 2; ++layer) {
    tokens.emplace_back(total, 100 + layer);
    auto out = engine->Append(
        Request(whole->session_id, layer, tokens.back(), 0, total, true));
    ASSERT_TRUE(out.ok()) << out.status();
    one_shot.push_back(ToFloats(out->output));
  }
  const int64_t row = kHeads * kValueDim;
  // Chunked prefill, then decode steps in one batch over both layers.
  const int64_t prompt = 120;
  for (int layer = 0; layer < 2; ++layer) {
    int64_t start = 0;
    for (int64_t size : {1, 50, 69}) {
      auto out = engine->Append(Request(pieces->session_id, layer,
                                        tokens[layer], start, start + size,
                                        true));
      ASSERT_TRUE(out.ok()) << out.status();
      const std::vector<float> got = ToFloats(out->output);
      ASSERT_EQ(got.size(), static_cast<size_t>(size * row));
      EXPECT_TRUE(std::equal(got.begin(), got.end(),
                             one_shot[layer].begin() + start * row))
          << "layer " << layer << " chunk at " << start;
      start += size;
    }
  }
  auto fork = engine->ForkSession(pieces->session_id);
  ASSERT_TRUE(fork.ok()) << fork.status();
  for (int64_t t = prompt; t < total; ++t) {
    std::vector<AppendRequest> batch;
    for (int layer = 0; layer < 2; ++layer) {
      for (const std::string& id : {pieces->session_id, fork->session_id}) {
        batch.push_back(Request(id, layer, tokens[layer], t, t + 1, true));
        batch.back().required_tokens = 1;
      }
    }
    auto outs = engine->AppendBatch(batch);
    ASSERT_TRUE(outs.ok()) << outs.status();
    for (size_t i = 0; i < outs->size(); ++i) {
      const std::vector<float> got = ToFloats((*outs)[i].output);
      ASSERT_EQ(got.size(), static_cast<size_t>(row));
      EXPECT_TRUE(std::equal(got.begin(), got.end(),
                             one_shot[i / 2].begin() + t * row))
          << "step " << t << " entry " << i;
    }
  }
  // Truncate and replay the last token.
  ASSERT_TRUE(engine->TruncateSession(pieces->session_id, total - 1).ok());
  auto replay = engine->Append(Request(pieces->session_id, 0, tokens[0],
                                       total - 1, total, true));
  ASSERT_TRUE(replay.ok()) << replay.status();
  const std::vector<float> got = ToFloats(replay->output);
  ASSERT_EQ(got.size(), static_cast<size_t>(row));
  EXPECT_TRUE(std::equal(got.begin(), got.end(),
                         one_shot[0].begin() + (total - 1) * row));
}

// Appends t's rows to layer 0 of one new session of `spec` in one call and
// of another in chunks of `sizes` rows (summing to all of them), and
// expects every chunk's outputs and selections to be bitwise the one-shot
// call's rows. Returns the one-shot call's result.
AttentionOutput ExpectChunksBitwiseOneShot(
    AttentionEngine& engine, const SessionSpec& spec, const Tokens& t,
    std::initializer_list<int64_t> sizes) {
  auto whole = engine.CreateSession(spec, absl::ZeroDuration());
  auto pieces = engine.CreateSession(spec, absl::ZeroDuration());
  EXPECT_TRUE(whole.ok() && pieces.ok());
  if (!whole.ok() || !pieces.ok()) return {};
  const int64_t total = t.q.shape[0];
  const int topk = spec.layers[0].topk;
  auto one_shot =
      engine.Append(Request(whole->session_id, 0, t, 0, total, true));
  EXPECT_TRUE(one_shot.ok()) << one_shot.status();
  if (!one_shot.ok()) return {};
  const std::vector<float> expected = ToFloats(one_shot->output);
  const int64_t row = int64_t{spec.num_q_heads} * spec.value_dim;
  int64_t start = 0;
  for (int64_t size : sizes) {
    auto out = engine.Append(
        Request(pieces->session_id, 0, t, start, start + size, true));
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return {};
    const std::vector<float> got = ToFloats(out->output);
    EXPECT_EQ(got.size(), static_cast<size_t>(size * row));
    EXPECT_EQ(out->topk_indices.size(), static_cast<size_t>(size * topk));
    if (got.size() != static_cast<size_t>(size * row) ||
        out->topk_indices.size() != static_cast<size_t>(size * topk)) {
      return {};
    }
    EXPECT_TRUE(
        std::equal(got.begin(), got.end(), expected.begin() + start * row))
        << "chunk at " << start;
    EXPECT_TRUE(std::equal(out->topk_indices.begin(), out->topk_indices.end(),
                           one_shot->topk_indices.begin() + start * topk))
        << "chunk at " << start;
    start += size;
  }
  EXPECT_EQ(start, total);
  return *std::move(one_shot);
}

TEST(TopKAttentionTest, ALongPrefillWithALargeKIsBitwiseItsChunks) {
  // 2048 rows selecting up to 1024 keys each exceed what one group of rows
  // may hold (2^20 selected keys), so the one-shot prefill runs in two
  // groups; the chunks (1000 rows: one group; 1048: two) must agree with
  // it bitwise, selections included.
  auto engine = MakeEngine();
  const int topk = 1024;
  const SessionSpec spec = TopKSpec(topk);
  const int64_t total = 2048;
  const Tokens t(total, 7);
  const AttentionOutput one_shot =
      ExpectChunksBitwiseOneShot(*engine, spec, t, {1000, 1048});
  ASSERT_EQ(one_shot.topk_indices.size(), static_cast<size_t>(total * topk));
  // A late row selected k keys, not all it sees.
  EXPECT_NE(one_shot.topk_indices[(total - 1) * topk + topk - 1], -1);
  EXPECT_EQ(ReferenceSelection(t, total - 1, total - 1, spec.layers[0]).size(),
            static_cast<size_t>(topk));
}

// Rows of one top-k prefill that select the same keys do not look for
// chunks to share (decode rows of forks do): each selected row reads
// one-token blocks of its own, and the search would build a key of every
// row's every chunk, far more memory than the request. Here every row
// selects positions 0..599 (the only ones whose index key scores), so a
// whole chunk of 512 selected keys is the same for all of them.
TEST(TopKAttentionTest, RowsOfASelectionDoNotSearchForSharedChunks) {
  CpuBackend* backend = nullptr;
  auto engine = MakeEngine(&backend);
  const SessionSpec spec = TopKSpec(/*topk=*/600);
  const int64_t total = 1108;
  Tokens t(total, 4);
  std::vector<float> index_k(total * kIndexDim, 0.0f);
  for (int64_t s = 0; s < 600; ++s) index_k[s * kIndexDim] = 1.0f;
  t.index_k = FloatTensor({total, kIndexDim}, index_k);
  t.index_q =
      FloatTensor({total, kIndexHeads, kIndexDim},
                  std::vector<float>(total * kIndexHeads * kIndexDim, 1.0f));
  t.index_w = FloatTensor({total, kIndexHeads},
                          std::vector<float>(total * kIndexHeads, 1.0f));
  auto info = engine->CreateSession(spec, absl::ZeroDuration());
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_TRUE(
      engine->Append(Request(info->session_id, 0, t, 0, 1100, true)).ok());
  const int64_t shared_before = backend->shared_chunk_computations();
  auto rows =
      engine->Append(Request(info->session_id, 0, t, 1100, total, true));
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->topk_indices[0], 0);
  EXPECT_EQ(rows->topk_indices[599], 599);
  EXPECT_EQ(backend->shared_chunk_computations(), shared_before);
}

TEST(TopKAttentionTest, ManyNarrowIndexHeadsRunInGroupsBitwiseTheirChunks) {
  // 256 index heads of one element are padded to 16 lanes each: 4096
  // floats of index queries per row, so a prefill converts them for at
  // most 64 rows at a time (2^18 floats) and 200 rows run in four groups.
  // Each row's selection and output must not depend on its group.
  auto engine = MakeEngine();
  SessionSpec spec = TopKSpec(/*topk=*/12);
  spec.index_heads = 256;
  spec.index_dim = 1;
  const int64_t total = 200;
  const Tokens t(total, 11, spec.index_heads, spec.index_dim);
  const AttentionOutput one_shot =
      ExpectChunksBitwiseOneShot(*engine, spec, t, {1, 63, 70, 66});
  ASSERT_EQ(one_shot.topk_indices.size(), static_cast<size_t>(total * 12));
  // The last row selected 12 of the 200 keys it sees.
  EXPECT_NE(one_shot.topk_indices[(total - 1) * 12 + 11], -1);
}

TEST(TopKAttentionTest, ManyRowsOfManyKvHeadsRunInBatchesBitwiseTheirChunks) {
  // The dense kernels plan a unit of work per row and KV head, so with 32
  // KV heads the rows' attention over their selections runs at most
  // 2^16 / 32 = 2048 rows at a time: the one-shot prefill of 2100 rows in
  // two batches, the chunks (1000, 1100 rows) in one each. Each row's
  // output must not depend on its batch.
  auto engine = MakeEngine();
  SessionSpec spec = TopKSpec(/*topk=*/12);
  spec.num_q_heads = 32;
  spec.num_kv_heads = 32;
  spec.layers[1].sink_logits.assign(32, 0.5f);
  const int64_t total = 2100;
  const Tokens t(total, 13, kIndexHeads, kIndexDim, spec.num_q_heads,
                 spec.num_kv_heads);
  const AttentionOutput one_shot =
      ExpectChunksBitwiseOneShot(*engine, spec, t, {1000, 1100});
  ASSERT_EQ(one_shot.topk_indices.size(), static_cast<size_t>(total * 12));
  EXPECT_NE(one_shot.topk_indices[(total - 1) * 12 + 11], -1);
}

TEST(TopKAttentionTest, BadIndexInputsFailAndChangeNothing) {
  auto engine = MakeEngine();
  auto info = engine->CreateSession(TopKSpec(8), absl::ZeroDuration());
  ASSERT_TRUE(info.ok());
  const Tokens t(4, 1);
  // A top-k layer without index inputs; a dense layer with them.
  auto missing =
      engine->Append(Request(info->session_id, 0, t, 0, 4, /*index=*/false));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  auto extra =
      engine->Append(Request(info->session_id, 2, t, 0, 4, /*index=*/true));
  EXPECT_EQ(extra.status().code(), absl::StatusCode::kInvalidArgument);
  AppendRequest wrong = Request(info->session_id, 0, t, 0, 4, true);
  wrong.index_weights = t.index_w.rows(0, 3);
  EXPECT_EQ(engine->Append(wrong).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Selected positions that would not fit the reply.
  AppendRequest big = Request(info->session_id, 0, t, 0, 4, true);
  big.max_reply_bytes = 8;
  EXPECT_EQ(engine->Append(big).status().code(),
            absl::StatusCode::kResourceExhausted);
  auto after = engine->GetSession(info->session_id);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->layer_lengths, std::vector<int64_t>(3, 0));
  EXPECT_EQ(after->kv_cache_bytes, 0);
}

// An index q . k that overflows float32 fails the call under ReLU too (a
// -inf would otherwise become a score of 0), and changes nothing.
TEST(TopKAttentionTest, AnOverflowedIndexScoreFailsUnderEitherFunction) {
  auto engine = MakeEngine();
  auto info = engine->CreateSession(TopKSpec(2), absl::ZeroDuration());
  ASSERT_TRUE(info.ok());
  Tokens t(4, 3);
  SetRow(t.index_k, 0, -1e30f);
  SetRow(t.index_q, 3, 1e30f);
  for (int layer : {0, 1}) {  // identity, ReLU
    const absl::Status status =
        engine->Append(Request(info->session_id, layer, t, 0, 4, true))
            .status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
        << "layer " << layer << ": " << status;
    EXPECT_NE(status.message().find(
                  "index score of key 0 for the query at position 3"),
              absl::string_view::npos)
        << status;
  }
  auto after = engine->GetSession(info->session_id);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->layer_lengths, std::vector<int64_t>(3, 0));
  EXPECT_EQ(after->kv_cache_bytes, 0);
}

// An overflow in a row's attention over its shortlist names the row's and
// the key's positions in the session, not those inside the shortlist.
TEST(TopKAttentionTest, AnOverflowNamesThePositionsOfTheSession) {
  auto engine = MakeEngine();
  auto info = engine->CreateSession(TopKSpec(4), absl::ZeroDuration());
  ASSERT_TRUE(info.ok());
  Tokens t(101, 5);
  // Token 100: its query and key overflow Q @ K^T, and its index key
  // scores highest, so that its own key is in its shortlist.
  SetRow(t.q, 100, 1e20f);
  SetRow(t.k, 100, 1e20f);
  SetRow(t.index_k, 100, 3.0f);
  SetRow(t.index_q, 100, 2.0f);
  SetRow(t.index_w, 100, 2.0f);
  ASSERT_TRUE(
      engine->Append(Request(info->session_id, 0, t, 0, 100, true)).ok());
  const absl::Status status =
      engine->Append(Request(info->session_id, 0, t, 100, 101, true)).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("query row 0 (position 100)"),
            absl::string_view::npos)
      << status;
  EXPECT_NE(status.message().find("key position 100"), absl::string_view::npos)
      << status;
  // The step was its backend call's only problem: no problem index.
  EXPECT_EQ(status.message().find("problem"), absl::string_view::npos)
      << status;
}

// Index keys are stored in the KV dtype and counted: a top-k layer's token
// takes (H_kv * (head_dim + value_dim) + index_dim) * dtype bytes.
TEST(TopKAttentionTest, IndexKeysAreCountedInKvBytes) {
  auto engine = MakeEngine();
  SessionSpec spec = TopKSpec(8);
  spec.num_layers = 1;
  spec.layers.resize(1);
  spec.kv_dtype = DType::kBFloat16;
  auto info = engine->CreateSession(spec, absl::ZeroDuration());
  ASSERT_TRUE(info.ok());
  // (2 * (16 + 8) + 8) * 2 = 112 bytes per token: 36 tokens per 4 KiB block.
  const int64_t tokens = 72;
  const Tokens t(tokens, 2);
  ASSERT_TRUE(
      engine->Append(Request(info->session_id, 0, t, 0, tokens, true)).ok());
  auto after = engine->GetSession(info->session_id);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->kv_cache_bytes, 2 * 4096);
  EXPECT_EQ(tokens / 36, 2);
}

// Scoring a row's visible keys asks the call's control between pieces of
// kKeysPerSplit keys, as the dense kernels do between chunks: a decode step
// over 4000 keys checks it at least once per such piece more than one over
// 100 (the rest of the call, attention over the 8 selected keys included,
// checks the same number of times before and after the scoring). A step
// cancelled while it scores changes nothing.
TEST(TopKAttentionTest, ScoringChecksTheCallEveryChunkOfKeys) {
  auto engine = MakeEngine();
  SessionSpec spec = TopKSpec(8);
  spec.num_layers = 1;
  spec.layers.resize(1);
  constexpr int64_t kLong = 4000;
  constexpr int64_t kShort = 100;
  const Tokens t(kLong + 1, 6);
  auto session_of = [&](int64_t context) -> std::string {
    auto info = engine->CreateSession(spec, absl::ZeroDuration());
    if (!info.ok()) {
      ADD_FAILURE() << info.status();
      return "";
    }
    EXPECT_TRUE(
        engine->Append(Request(info->session_id, 0, t, 0, context, true)).ok());
    return info->session_id;
  };
  auto checks_of_step = [&](int64_t context) {
    WithdrawAt control(std::numeric_limits<int64_t>::max(),
                       absl::StatusCode::kCancelled);
    AppendRequest step =
        Request(session_of(context), 0, t, context, context + 1, true);
    step.control = &control;
    EXPECT_TRUE(engine->Append(step).ok());
    return control.checks();
  };
  // Checks before the scoring (b), of it (s) and after it (a): the short
  // step makes b + 1 + a, the long one b + s + a.
  const int64_t short_checks = checks_of_step(kShort);
  const int64_t long_checks = checks_of_step(kLong);
  const int64_t long_scoring_checks = long_checks - short_checks + 1;
  EXPECT_GE(long_scoring_checks, kLong / kKeysPerSplit)
      << short_checks << " checks at " << kShort << " keys, " << long_checks
      << " at " << kLong;

  // Check number short_checks = b + a + 1 of the long step comes after the
  // b before the scoring, and within the scoring when s >= a + 1, which
  // s >= b + a + 1 ensures.
  ASSERT_GE(long_scoring_checks, short_checks);
  const std::string id = session_of(kLong);
  const int64_t kv_bytes = engine->GetSession(id)->kv_cache_bytes;
  // Counting from 0, check number short_checks is the one at short_checks - 1.
  WithdrawAt cancel(short_checks - 1, absl::StatusCode::kCancelled);
  AppendRequest step = Request(id, 0, t, kLong, kLong + 1, true);
  step.control = &cancel;
  EXPECT_EQ(engine->Append(step).status().code(), absl::StatusCode::kCancelled);
  auto after = engine->GetSession(id);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->layer_lengths, std::vector<int64_t>{kLong});
  EXPECT_EQ(after->kv_cache_bytes, kv_bytes);
}

// The seeds' shortlist: length 2048, dim 32, index rank 8 (the first 8
// dims of key and query), top-64. The served selection must be exactly the
// top-64 of full index scoring (in float64 here), so its recall of the
// target is what full scoring of the index gives.
TEST(TopKAttentionTest, SeedsShortlistRecallIsFullIndexScoringRecall) {
  constexpr int64_t kLength = 2048;
  constexpr int kSeedDim = 32, kRank = 8, kTopK = 64, kTrials = 12;
  auto engine = MakeEngine();
  SessionSpec spec;
  spec.num_layers = 1;
  spec.num_q_heads = 1;
  spec.num_kv_heads = 1;
  spec.head_dim = kSeedDim;
  spec.value_dim = 6;
  spec.index_dim = kRank;
  spec.index_heads = 1;
  spec.max_tokens = kLength;
  spec.layers.resize(1);
  spec.layers[0].topk = kTopK;
  std::mt19937 rng(2024);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int served_recall = 0, reference_recall = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    auto info = engine->CreateSession(spec, absl::ZeroDuration());
    ASSERT_TRUE(info.ok()) << info.status();
    std::vector<float> keys(kLength * kSeedDim), values(kLength * 6);
    for (float& x : keys) x = normal(rng);
    for (float& x : values) x = normal(rng);
    const int64_t target = std::uniform_int_distribution<int64_t>(
        0, kLength - 1)(rng);
    std::vector<float> query(kSeedDim);
    for (int d = 0; d < kSeedDim; ++d) {
      query[d] = keys[target * kSeedDim + d] + 0.05f * normal(rng);
    }
    // Decode the query as the last token: the prompt is the other keys.
    std::vector<float> index_k(kLength * kRank), q(kLength * kSeedDim),
        index_q(kLength * kRank), w(kLength, 1.0f);
    for (int64_t s = 0; s < kLength; ++s) {
      for (int d = 0; d < kRank; ++d) {
        index_k[s * kRank + d] = keys[s * kSeedDim + d];
        index_q[s * kRank + d] = query[d];
      }
      for (int d = 0; d < kSeedDim; ++d) q[s * kSeedDim + d] = query[d];
    }
    const HostTensor qt = FloatTensor({kLength, 1, kSeedDim}, q);
    const HostTensor kt = FloatTensor({kLength, 1, kSeedDim}, keys);
    const HostTensor vt = FloatTensor({kLength, 1, 6}, values);
    const HostTensor ikt = FloatTensor({kLength, kRank}, index_k);
    const HostTensor iqt = FloatTensor({kLength, 1, kRank}, index_q);
    const HostTensor wt = FloatTensor({kLength, 1}, w);
    AppendRequest prompt;
    prompt.session_id = info->session_id;
    prompt.q = qt.rows(0, kLength - 1);
    prompt.k = kt.rows(0, kLength - 1);
    prompt.v = vt.rows(0, kLength - 1);
    prompt.index_k = ikt.rows(0, kLength - 1);
    prompt.index_q = iqt.rows(0, kLength - 1);
    prompt.index_weights = wt.rows(0, kLength - 1);
    ASSERT_TRUE(engine->Append(prompt).ok());
    AppendRequest step = prompt;
    step.q = qt.rows(kLength - 1, kLength);
    step.k = kt.rows(kLength - 1, kLength);
    step.v = vt.rows(kLength - 1, kLength);
    step.index_k = ikt.rows(kLength - 1, kLength);
    step.index_q = iqt.rows(kLength - 1, kLength);
    step.index_weights = wt.rows(kLength - 1, kLength);
    step.return_topk_indices = true;
    auto out = engine->Append(step);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->topk_indices.size(), static_cast<size_t>(kTopK));

    // Full scoring of the index in float64: the seeds' argpartition.
    std::vector<std::pair<double, int64_t>> scored;
    for (int64_t s = 0; s < kLength; ++s) {
      double score = 0;
      for (int d = 0; d < kRank; ++d) {
        score += double{index_k[s * kRank + d]} * query[d];
      }
      scored.emplace_back(score, s);
    }
    std::sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    std::vector<int64_t> reference;
    for (int i = 0; i < kTopK; ++i) reference.push_back(scored[i].second);
    std::sort(reference.begin(), reference.end());
    EXPECT_EQ(out->topk_indices, reference) << "trial " << trial;
    served_recall += std::count(out->topk_indices.begin(),
                                out->topk_indices.end(), target) > 0;
    reference_recall +=
        std::count(reference.begin(), reference.end(), target) > 0;
    ASSERT_TRUE(engine->DeleteSession(info->session_id).ok());
  }
  EXPECT_GE(served_recall, reference_recall);
  EXPECT_GT(served_recall, kTrials / 2);  // the shortlist finds the target
}

}  // namespace
}  // namespace attention
