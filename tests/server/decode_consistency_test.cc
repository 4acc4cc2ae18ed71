// Bitwise determinism across serving paths: a token's output is the same
// whether computed by one Prefill, chunked prefill, DecodeStep, the Decode
// stream, BatchDecode with other sessions, or stateless Attention (float32
// KV; and half-precision KV and outputs through the stream and BatchDecode).
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

class DecodeConsistencyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = StartTestServer();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  client::AttentionClient& client() { return *server_->client; }

  std::unique_ptr<TestServer> server_;
};

// Three layers: full causal; window 64; window 32 with StreamingLLM sinks
// and learned sink logits. GQA with 2 query heads per KV head.
v1::SessionSpec MixedSpec() {
  v1::SessionSpec spec = MakeSpec(3, 4, 2, 16, {0, 64, 32});
  spec.mutable_layers(2)->set_num_sink_tokens(4);
  for (int h = 0; h < 4; ++h) {
    spec.mutable_layers(2)->add_sink_logits(0.5f * h - 1.0f);
  }
  return spec;
}

TEST_F(DecodeConsistencyTest, StreamedDecodeEqualsStatelessCausalBitwise) {
  auto session = client().OpenSession(MixedSpec());
  ATTN_ASSERT_OK(session);
  const v1::SessionSpec& spec = session->spec();
  // The prompt crosses the 512-key split boundary of the reduction order.
  const int64_t prompt = 530, steps = 12, total = prompt + steps;
  std::vector<Tokens> tokens;
  std::vector<v1::AttentionResult> prefill;
  for (int layer = 0; layer < 3; ++layer) {
    tokens.push_back(RandomTokens(spec, total, 100 + layer));
    auto result = session->Prefill(layer, tokens[layer].q_rows(0, prompt),
                                   tokens[layer].k_rows(0, prompt),
                                   tokens[layer].v_rows(0, prompt));
    ATTN_ASSERT_OK(result);
    EXPECT_EQ(result->position(), 0);
    prefill.push_back(*std::move(result));
  }

  auto stream = client().OpenDecodeStream();
  std::vector<std::vector<v1::AttentionResult>> streamed(3);
  for (int64_t t = prompt; t < total; ++t) {
    for (int layer = 0; layer < 3; ++layer) {
      auto request = session->MakeDecodeRequest(
          layer, tokens[layer].q_rows(t, 1), tokens[layer].k_rows(t, 1),
          tokens[layer].v_rows(t, 1));
      ATTN_ASSERT_OK(request);
      auto result = stream->Step(*request);
      ATTN_ASSERT_OK(result);
      EXPECT_EQ(result->position(), t);
      streamed[layer].push_back(*std::move(result));
    }
  }
  ATTN_ASSERT_OK(stream->Finish());

  for (int layer = 0; layer < 3; ++layer) {
    auto stateless = client().Attention(
        StatelessRequestFor(tokens[layer], spec, layer, v1::DTYPE_FLOAT32));
    ATTN_ASSERT_OK(stateless);
    EXPECT_EQ(prefill[layer].output().data(),
              RowBytes(stateless->output(), 0, prompt))
        << "layer " << layer;
    for (int64_t i = 0; i < steps; ++i) {
      EXPECT_EQ(streamed[layer][i].output().data(),
                RowBytes(stateless->output(), prompt + i, 1))
          << "layer " << layer << " step " << i;
    }
  }
  auto info = session->Info();
  ATTN_ASSERT_OK(info);
  for (int layer = 0; layer < 3; ++layer) {
    EXPECT_EQ(info->layer_lengths(layer), total);
  }
}

TEST_F(DecodeConsistencyTest, ChunkedPrefillEqualsOnePrefillBitwise) {
  const v1::SessionSpec spec_in = MixedSpec();
  auto whole = client().OpenSession(spec_in);
  auto chunked = client().OpenSession(spec_in);
  ATTN_ASSERT_OK(whole);
  ATTN_ASSERT_OK(chunked);
  const int64_t total = 600;
  const std::vector<int64_t> chunks = {1, 31, 100, 250, 1, 217};
  for (int layer = 0; layer < 3; ++layer) {
    const Tokens tokens = RandomTokens(whole->spec(), total, 7 + layer);
    auto one = whole->Prefill(layer, tokens.q_rows(0, total),
                              tokens.k_rows(0, total), tokens.v_rows(0, total));
    ATTN_ASSERT_OK(one);
    std::string pieces;
    int64_t start = 0;
    for (int64_t size : chunks) {
      auto part = chunked->Prefill(layer, tokens.q_rows(start, size),
                                   tokens.k_rows(start, size),
                                   tokens.v_rows(start, size));
      ATTN_ASSERT_OK(part);
      EXPECT_EQ(part->position(), start);
      pieces += part->output().data();
      start += size;
    }
    ASSERT_EQ(start, total);
    EXPECT_EQ(pieces, one->output().data()) << "layer " << layer;

    auto stateless = client().Attention(
        StatelessRequestFor(tokens, whole->spec(), layer, v1::DTYPE_FLOAT32));
    ATTN_ASSERT_OK(stateless);
    EXPECT_EQ(stateless->output().data(), one->output().data())
        << "layer " << layer;
  }
}

TEST_F(DecodeConsistencyTest, BatchDecodeAcrossSessionsEqualsDecodeSteps) {
  // Sessions of different shapes decode together in one batch; their twins
  // decode alone. Every result must match bitwise, lse included.
  const std::vector<v1::SessionSpec> specs = {
      MixedSpec(), MakeSpec(2, 8, 2, 32, {0, 16}), MakeSpec(1, 2, 2, 8)};
  std::vector<client::SessionHandle> alone, batched;
  std::vector<std::vector<Tokens>> tokens(specs.size());
  const int64_t prompt = 40, steps = 6;
  for (size_t s = 0; s < specs.size(); ++s) {
    auto a = client().OpenSession(specs[s]);
    auto b = client().OpenSession(specs[s]);
    ATTN_ASSERT_OK(a);
    ATTN_ASSERT_OK(b);
    alone.push_back(*a);
    batched.push_back(*b);
    for (int layer = 0; layer < specs[s].num_layers(); ++layer) {
      tokens[s].push_back(
          RandomTokens(a->spec(), prompt + steps, 1000 * (s + 1) + layer));
      const Tokens& t = tokens[s].back();
      for (client::SessionHandle* handle : {&alone.back(), &batched.back()}) {
        ATTN_ASSERT_OK(handle->Prefill(layer, t.q_rows(0, prompt),
                                       t.k_rows(0, prompt),
                                       t.v_rows(0, prompt)));
      }
    }
  }
  client::StepOptions options;
  options.return_lse = true;
  for (int64_t t = prompt; t < prompt + steps; ++t) {
    v1::BatchDecodeRequest batch;
    std::vector<v1::AttentionResult> expected;
    for (size_t s = 0; s < specs.size(); ++s) {
      for (int layer = 0; layer < specs[s].num_layers(); ++layer) {
        const Tokens& tok = tokens[s][layer];
        auto single =
            alone[s].DecodeStep(layer, tok.q_rows(t, 1), tok.k_rows(t, 1),
                                tok.v_rows(t, 1), options);
        ATTN_ASSERT_OK(single);
        expected.push_back(*std::move(single));
        auto step = batched[s].MakeDecodeRequest(layer, tok.q_rows(t, 1),
                                                 tok.k_rows(t, 1),
                                                 tok.v_rows(t, 1), options);
        ATTN_ASSERT_OK(step);
        *batch.add_steps() = *std::move(step);
      }
    }
    auto results = client().BatchDecode(batch);
    ATTN_ASSERT_OK(results);
    ASSERT_EQ(results->size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_EQ((*results)[i].position(), t);
      EXPECT_EQ((*results)[i].output().data(), expected[i].output().data())
          << "step " << t << " entry " << i;
      EXPECT_EQ((*results)[i].lse().data(), expected[i].lse().data());
    }
  }
}

// Half-precision KV caches and outputs through every serving path: one
// Prefill crossing the 512-key split boundary, then the Decode stream for
// one session and BatchDecode for its twin. Each row equals stateless
// Attention over the same keys bitwise, in the same output dtype.
struct HalfCase {
  const char* name;
  v1::DType kv_dtype;
  v1::DType output_dtype;
};

class HalfPrecisionPathsTest : public DecodeConsistencyTest,
                               public ::testing::WithParamInterface<HalfCase> {
};

TEST_P(HalfPrecisionPathsTest, StreamAndBatchDecodeEqualStatelessBitwise) {
  const HalfCase& c = GetParam();
  v1::SessionSpec spec_in = MixedSpec();
  spec_in.set_kv_dtype(c.kv_dtype);
  auto streamed = client().OpenSession(spec_in);
  auto batched = client().OpenSession(spec_in);
  ATTN_ASSERT_OK(streamed);
  ATTN_ASSERT_OK(batched);
  const v1::SessionSpec& spec = streamed->spec();
  const int64_t prompt = 530, steps = 5, total = prompt + steps;
  client::StepOptions options;
  options.output_dtype = c.output_dtype;
  std::vector<Tokens> tokens;
  // Per layer: the rows' output bytes, from each path.
  std::vector<std::string> from_stream(3), from_batch(3);
  for (int layer = 0; layer < 3; ++layer) {
    tokens.push_back(RandomTokens(spec, total, 300 + layer));
    const Tokens& t = tokens.back();
    for (auto [handle, out] : {std::pair{&*streamed, &from_stream[layer]},
                               std::pair{&*batched, &from_batch[layer]}}) {
      auto result =
          handle->Prefill(layer, t.q_rows(0, prompt), t.k_rows(0, prompt),
                          t.v_rows(0, prompt), options);
      ATTN_ASSERT_OK(result);
      *out = result->output().data();
    }
  }
  auto stream = client().OpenDecodeStream();
  for (int64_t t = prompt; t < total; ++t) {
    v1::BatchDecodeRequest batch;
    for (int layer = 0; layer < 3; ++layer) {
      const Tokens& tok = tokens[layer];
      auto request = streamed->MakeDecodeRequest(
          layer, tok.q_rows(t, 1), tok.k_rows(t, 1), tok.v_rows(t, 1), options);
      ATTN_ASSERT_OK(request);
      auto result = stream->Step(*request);
      ATTN_ASSERT_OK(result);
      from_stream[layer] += result->output().data();
      auto step = batched->MakeDecodeRequest(
          layer, tok.q_rows(t, 1), tok.k_rows(t, 1), tok.v_rows(t, 1), options);
      ATTN_ASSERT_OK(step);
      *batch.add_steps() = *std::move(step);
    }
    auto results = client().BatchDecode(batch);
    ATTN_ASSERT_OK(results);
    ASSERT_EQ(results->size(), 3u);
    for (int layer = 0; layer < 3; ++layer) {
      from_batch[layer] += (*results)[layer].output().data();
    }
  }
  ATTN_ASSERT_OK(stream->Finish());
  for (int layer = 0; layer < 3; ++layer) {
    v1::AttentionRequest request =
        StatelessRequestFor(tokens[layer], spec, layer, c.kv_dtype);
    request.set_output_dtype(c.output_dtype);
    auto stateless = client().Attention(request);
    ATTN_ASSERT_OK(stateless);
    EXPECT_EQ(stateless->output().dtype(), c.output_dtype);
    EXPECT_EQ(from_stream[layer], stateless->output().data())
        << "layer " << layer;
    EXPECT_EQ(from_batch[layer], stateless->output().data())
        << "layer " << layer;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, HalfPrecisionPathsTest,
    ::testing::Values(
        HalfCase{"fp16_kv", v1::DTYPE_FLOAT16, v1::DTYPE_FLOAT32},
        HalfCase{"bf16_kv", v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT32},
        HalfCase{"fp16_kv_fp16_out", v1::DTYPE_FLOAT16, v1::DTYPE_FLOAT16},
        HalfCase{"bf16_kv_bf16_out", v1::DTYPE_BFLOAT16, v1::DTYPE_BFLOAT16},
        HalfCase{"fp32_kv_bf16_out", v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16}),
    [](const ::testing::TestParamInfo<HalfCase>& info) {
      return std::string(info.param.name);
    });

TEST_F(DecodeConsistencyTest, ManyClientThreadsOnManySessions) {
  constexpr int kThreads = 8, kSessionsPerThread = 4;
  constexpr int64_t kPrompt = 24, kSteps = 8;
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int thread = 0; thread < kThreads; ++thread) {
    threads.emplace_back([&, thread] {
      std::string& failure = failures[thread];
      const v1::SessionSpec spec =
          MakeSpec(2, 4, thread % 2 == 0 ? 2 : 4, 16, {0, 8 + thread});
      std::vector<client::SessionHandle> sessions;
      std::vector<Tokens> tokens;  // [session * 2 + layer]
      std::vector<std::vector<std::string>> outputs;
      for (int s = 0; s < kSessionsPerThread; ++s) {
        auto session = client().OpenSession(spec);
        if (!session.ok()) {
          failure = session.status().ToString();
          return;
        }
        sessions.push_back(*session);
        for (int layer = 0; layer < 2; ++layer) {
          tokens.push_back(RandomTokens(session->spec(), kPrompt + kSteps,
                                        thread * 100 + s * 10 + layer));
          outputs.emplace_back();
        }
      }
      // Interleave sessions and paths: prefill, DecodeStep, Decode stream.
      auto stream = client().OpenDecodeStream();
      for (int64_t t = 0; t < kPrompt + kSteps; ++t) {
        for (int s = 0; s < kSessionsPerThread; ++s) {
          for (int layer = 0; layer < 2; ++layer) {
            const Tokens& tok = tokens[s * 2 + layer];
            absl::StatusOr<v1::AttentionResult> result;
            if (t == 0) {
              result = sessions[s].Prefill(layer, tok.q_rows(0, kPrompt),
                                           tok.k_rows(0, kPrompt),
                                           tok.v_rows(0, kPrompt));
            } else if (t < kPrompt) {
              continue;  // covered by the prefill
            } else if ((t + s) % 2 == 0) {
              result = sessions[s].DecodeStep(
                  layer, tok.q_rows(t, 1), tok.k_rows(t, 1), tok.v_rows(t, 1));
            } else {
              auto request = sessions[s].MakeDecodeRequest(
                  layer, tok.q_rows(t, 1), tok.k_rows(t, 1), tok.v_rows(t, 1));
              if (!request.ok()) {
                failure = request.status().ToString();
                return;
              }
              result = stream->Step(*request);
            }
            if (!result.ok()) {
              failure = result.status().ToString();
              return;
            }
            outputs[s * 2 + layer].push_back(result->output().data());
          }
        }
      }
      if (absl::Status finished = stream->Finish(); !finished.ok()) {
        failure = finished.ToString();
        return;
      }
      for (int s = 0; s < kSessionsPerThread; ++s) {
        for (int layer = 0; layer < 2; ++layer) {
          const Tokens& tok = tokens[s * 2 + layer];
          auto stateless = client().Attention(StatelessRequestFor(
              tok, sessions[s].spec(), layer, v1::DTYPE_FLOAT32));
          if (!stateless.ok()) {
            failure = stateless.status().ToString();
            return;
          }
          const auto& got = outputs[s * 2 + layer];
          if (got.size() != 1 + kSteps ||
              got[0] != RowBytes(stateless->output(), 0, kPrompt)) {
            failure = "prefill output differs from stateless attention";
            return;
          }
          for (int64_t i = 0; i < kSteps; ++i) {
            if (got[1 + i] != RowBytes(stateless->output(), kPrompt + i, 1)) {
              failure = "decode output differs from stateless attention";
              return;
            }
          }
        }
        if (absl::Status deleted = sessions[s].Delete(); !deleted.ok()) {
          failure = deleted.ToString();
          return;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int thread = 0; thread < kThreads; ++thread) {
    EXPECT_EQ(failures[thread], "") << "thread " << thread;
  }
  auto info = client().GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->active_sessions(), 0);
  EXPECT_EQ(info->kv_cache_used_bytes(), 0);
}

}  // namespace
}  // namespace attention::testing
