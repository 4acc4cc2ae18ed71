// Engine tests: session semantics, bitwise determinism across call paths,
// and atomicity of failed calls. Numerical correctness of the attention
// itself is covered against a double-precision reference in
// tests/core/cpu/cpu_backend_test.cc; here the stateless path is the oracle
// for the session paths (they must agree bitwise).
#include "core/engine.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/cpu/cpu_backend.h"
#include "core/kv_size.h"
#include "gtest/gtest.h"
#include "tests/core/hold_at_first_check.h"
#include "tests/core/test_tensors.h"
#include "tests/core/withdraw_at.h"

namespace attention {
namespace {

using testing::FloatTensor;
using testing::HostTensor;
using testing::RandomTensor;
using testing::ToFloats;
using testing::WithdrawAt;

constexpr int kLayers = 3;
constexpr int kQHeads = 4;
constexpr int kKvHeads = 2;
constexpr int kDim = 16;
constexpr int kValueDim = 8;

SessionSpec TestSpec() {
  SessionSpec spec;
  spec.num_layers = kLayers;
  spec.num_q_heads = kQHeads;
  spec.num_kv_heads = kKvHeads;
  spec.head_dim = kDim;
  spec.value_dim = kValueDim;
  spec.max_tokens = 4096;
  LayerSpec full;
  LayerSpec window;
  window.window = 37;
  window.num_sink_tokens = 3;
  LayerSpec sinks;
  sinks.sink_logits = {0.5f, -1.0f, 2.0f, 0.0f};
  spec.layers = {full, window, sinks};
  return spec;
}

// A sequence of random q/k/v tokens for one layer.
struct Tokens {
  HostTensor q, k, v;
  Tokens(int64_t count, std::mt19937& rng, DType dtype = DType::kFloat32)
      : q(RandomTensor({count, kQHeads, kDim}, rng, dtype)),
        k(RandomTensor({count, kKvHeads, kDim}, rng, dtype)),
        v(RandomTensor({count, kKvHeads, kValueDim}, rng, dtype)) {}
};

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override { engine_ = MakeEngine(int64_t{64} << 20, 2); }

  static std::unique_ptr<AttentionEngine> MakeEngine(int64_t kv_bytes,
                                                     int threads) {
    EngineOptions options;
    options.kv_cache_bytes = kv_bytes;
    options.kv_block_bytes = 4096;
    options.sessions.reap_interval = absl::ZeroDuration();
    auto engine =
        AttentionEngine::Create(std::make_unique<CpuBackend>(threads), options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return *std::move(engine);
  }

  std::string NewSession(const SessionSpec& spec = TestSpec()) {
    auto info = engine_->CreateSession(spec, absl::ZeroDuration());
    EXPECT_TRUE(info.ok()) << info.status();
    return info->session_id;
  }

  static AppendRequest Request(const std::string& id, int layer,
                               const Tokens& t, int64_t begin, int64_t end) {
    AppendRequest r;
    r.session_id = id;
    r.layer = layer;
    r.q = t.q.rows(begin, end);
    r.k = t.k.rows(begin, end);
    r.v = t.v.rows(begin, end);
    r.return_lse = true;
    return r;
  }

  // Appends rows [begin, end) and returns the float outputs.
  std::vector<float> Append(const std::string& id, int layer, const Tokens& t,
                            int64_t begin, int64_t end) {
    auto out = engine_->Append(Request(id, layer, t, begin, end));
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return {};
    EXPECT_EQ(out->position, begin);
    return ToFloats(out->output);
  }

  // The stateless answer for rows [begin, end) over keys [0, end).
  std::vector<float> Stateless(const Tokens& t, int layer, int64_t begin,
                               int64_t end) {
    const SessionSpec spec = TestSpec();
    const LayerSpec& mask = spec.layers[layer];
    StatelessRequest r;
    r.q = t.q.rows(begin, end);
    r.k = t.k.rows(0, end);
    r.v = t.v.rows(0, end);
    r.mask.causal = true;
    r.mask.window = mask.window;
    r.mask.num_sink_tokens = mask.num_sink_tokens;
    r.mask.query_start = begin;
    r.sink_logits = mask.sink_logits;
    auto out = engine_->Attend(r);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? ToFloats(out->output) : std::vector<float>{};
  }

  SessionInfo Info(const std::string& id) {
    auto info = engine_->GetSession(id);
    EXPECT_TRUE(info.ok()) << info.status();
    return *info;
  }

  std::mt19937 rng_{2024};
  std::unique_ptr<AttentionEngine> engine_;
};

std::vector<float> Slice(const std::vector<float>& all, int64_t begin,
                         int64_t end) {
  const int64_t row = kQHeads * kValueDim;
  return {all.begin() + begin * row, all.begin() + end * row};
}

TEST_F(EngineTest, EveryPathGivesBitwiseTheSameOutput) {
  constexpr int64_t kTokens = 700;  // spans two 512-key splits
  for (int layer = 0; layer < kLayers; ++layer) {
    SCOPED_TRACE(layer);
    Tokens t(kTokens, rng_);
    const std::vector<float> expected = Stateless(t, layer, 0, kTokens);

    // One prefill.
    const std::string one = NewSession();
    EXPECT_EQ(Append(one, layer, t, 0, kTokens), expected);

    // Chunked prefill with uneven chunks.
    const std::string chunked = NewSession();
    std::vector<float> pieces;
    for (int64_t begin = 0, step = 1; begin < kTokens;
         step = step * 3 % 97 + 1) {
      const int64_t end = std::min(kTokens, begin + step);
      std::vector<float> out = Append(chunked, layer, t, begin, end);
      pieces.insert(pieces.end(), out.begin(), out.end());
      begin = end;
    }
    EXPECT_EQ(pieces, expected);

    // Prefill then token-by-token decode.
    const std::string decoded = NewSession();
    std::vector<float> steps = Append(decoded, layer, t, 0, 500);
    for (int64_t i = 500; i < kTokens; ++i) {
      AppendRequest r = Request(decoded, layer, t, i, i + 1);
      r.required_tokens = 1;
      auto out = engine_->Append(r);
      ASSERT_TRUE(out.ok()) << out.status();
      std::vector<float> row = ToFloats(out->output);
      steps.insert(steps.end(), row.begin(), row.end());
    }
    EXPECT_EQ(steps, expected);

    // A single late query over the cache, stateless with query_start.
    EXPECT_EQ(Stateless(t, layer, kTokens - 1, kTokens),
              Slice(expected, kTokens - 1, kTokens));
  }
}

// Scale 0 means the seeds' 1/sqrt(head_dim), rounded once to float32, in a
// session and in a stateless call alike: at head_dim 96 a float32 division
// of a float32 square root is one ulp away from it.
TEST_F(EngineTest, ScaleZeroIsTheSameInSessionsAndStatelessCalls) {
  constexpr int kWideDim = 96;
  ASSERT_NE(1.0f / std::sqrt(static_cast<float>(kWideDim)),
            DefaultScale(kWideDim));
  SessionSpec spec;
  spec.num_layers = 1;
  spec.num_q_heads = kQHeads;
  spec.num_kv_heads = kKvHeads;
  spec.head_dim = kWideDim;
  spec.value_dim = kValueDim;
  spec.max_tokens = 64;
  constexpr int64_t kTokens = 40;
  const HostTensor q = RandomTensor({kTokens, kQHeads, kWideDim}, rng_);
  const HostTensor k = RandomTensor({kTokens, kKvHeads, kWideDim}, rng_);
  const HostTensor v = RandomTensor({kTokens, kKvHeads, kValueDim}, rng_);
  AppendRequest append;
  append.session_id = NewSession(spec);
  append.q = q.rows(0, kTokens);
  append.k = k.rows(0, kTokens);
  append.v = v.rows(0, kTokens);
  StatelessRequest stateless;
  stateless.q = q.rows(0, kTokens);
  stateless.k = k.rows(0, kTokens);
  stateless.v = v.rows(0, kTokens);
  stateless.mask.causal = true;
  auto session_out = engine_->Append(append);
  ASSERT_TRUE(session_out.ok()) << session_out.status();
  auto stateless_out = engine_->Attend(stateless);
  ASSERT_TRUE(stateless_out.ok()) << stateless_out.status();
  EXPECT_EQ(ToFloats(session_out->output), ToFloats(stateless_out->output));
}

TEST_F(EngineTest, BatchEqualsSeparateStepsAndThreadCountDoesNotMatter) {
  // Two engines with different thread counts, sessions of different lengths.
  std::unique_ptr<AttentionEngine> single = MakeEngine(int64_t{64} << 20, 1);
  std::vector<Tokens> tokens;
  std::vector<std::string> batched_ids, single_ids;
  const int64_t lengths[] = {1, 40, 513, 200};
  for (int s = 0; s < 4; ++s) {
    tokens.emplace_back(lengths[s] + 1, rng_);
    batched_ids.push_back(NewSession());
    auto info = single->CreateSession(TestSpec(), absl::ZeroDuration());
    ASSERT_TRUE(info.ok());
    single_ids.push_back(info->session_id);
    for (int layer = 0; layer < kLayers; ++layer) {
      Append(batched_ids[s], layer, tokens[s], 0, lengths[s]);
      ASSERT_TRUE(
          single
              ->Append(Request(single_ids[s], layer, tokens[s], 0, lengths[s]))
              .ok());
    }
  }
  std::vector<AppendRequest> batch;
  for (int s = 0; s < 4; ++s) {
    for (int layer = 0; layer < kLayers; ++layer) {
      batch.push_back(Request(batched_ids[s], layer, tokens[s], lengths[s],
                              lengths[s] + 1));
    }
  }
  auto results = engine_->AppendBatch(batch);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), batch.size());
  size_t i = 0;
  for (int s = 0; s < 4; ++s) {
    for (int layer = 0; layer < kLayers; ++layer, ++i) {
      auto alone = single->Append(
          Request(single_ids[s], layer, tokens[s], lengths[s], lengths[s] + 1));
      ASSERT_TRUE(alone.ok());
      EXPECT_EQ(ToFloats((*results)[i].output), ToFloats(alone->output));
      EXPECT_EQ(ToFloats(*(*results)[i].lse), ToFloats(*alone->lse));
      EXPECT_EQ((*results)[i].position, lengths[s]);
    }
  }
}

TEST_F(EngineTest, AppendEachIsolatesFailuresAndMatchesAppend) {
  const std::string a = NewSession();
  const std::string b = NewSession();
  const std::string c = NewSession();
  Tokens ta(20, rng_), tb(20, rng_), tc(20, rng_);
  for (const auto& [id, t] : {std::pair{a, &ta}, {b, &tb}, {c, &tc}}) {
    Append(id, 0, *t, 0, 10);
  }
  const SessionInfo c_before = Info(c);
  // c's step overflows; b appears twice; a and b's first step are fine.
  Tokens huge = tc;
  std::vector<float> big(huge.q.values.size(), 3e19f);
  std::memcpy(huge.q.bytes.data(), big.data(), big.size() * 4);
  std::memcpy(huge.k.bytes.data(), big.data(),
              std::min(big.size(), huge.k.values.size()) * 4);
  std::vector<AppendRequest> requests = {
      Request(a, 0, ta, 10, 11), Request(c, 0, huge, 10, 11),
      Request(b, 0, tb, 10, 11), Request(b, 0, tb, 11, 12),
      Request("missing", 0, ta, 10, 11)};
  std::vector<absl::StatusOr<AttentionOutput>> results =
      engine_->AppendEach(requests);
  ASSERT_EQ(results.size(), requests.size());
  ASSERT_TRUE(results[0].ok()) << results[0].status();
  EXPECT_EQ(results[1].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(results[1].status().message().rfind(
                "Q @ K^T overflowed at query row 0 (position 10), head ", 0),
            0u)
      << results[1].status();
  ASSERT_TRUE(results[2].ok()) << results[2].status();
  EXPECT_EQ(results[3].status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(results[4].status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ToFloats(results[0]->output),
            Slice(Stateless(ta, 0, 0, 11), 10, 11));
  EXPECT_EQ(ToFloats(results[2]->output),
            Slice(Stateless(tb, 0, 0, 11), 10, 11));
  EXPECT_EQ(Info(a).layer_lengths[0], 11);
  EXPECT_EQ(Info(b).layer_lengths[0], 11);
  EXPECT_EQ(Info(c).layer_lengths, c_before.layer_lengths);
  EXPECT_EQ(Info(c).kv_cache_bytes, c_before.kv_cache_bytes);
}

// An atomic batch that fails in the attention itself names the step that
// failed (found by running the steps one by one), and applies nothing.
TEST_F(EngineTest, AnAtomicBatchNamesTheStepThatFailedInTheKernels) {
  const std::string a = NewSession();
  const std::string b = NewSession();
  Tokens ta(20, rng_), tb(20, rng_);
  Append(a, 0, ta, 0, 10);
  Append(b, 0, tb, 0, 10);
  Tokens huge = tb;
  std::vector<float> big(huge.q.values.size(), 3e19f);
  std::memcpy(huge.q.bytes.data(), big.data(), big.size() * 4);
  std::memcpy(huge.k.bytes.data(), big.data(),
              std::min(big.size(), huge.k.values.size()) * 4);
  const std::vector<AppendRequest> batch = {Request(a, 0, ta, 10, 11),
                                            Request(b, 0, huge, 10, 11)};
  const absl::Status status = engine_->AppendBatch(batch).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message().rfind("step 1", 0), 0u) << status;
  // In the step's own numbers: its row and key positions, not the index
  // the backend gave its problem (the step is re-run alone to find it).
  EXPECT_EQ(status.message().rfind(
                "step 1: Q @ K^T overflowed at query row 0 (position 10), "
                "head ",
                0),
            0u)
      << status;
  EXPECT_EQ(status.message().find("problem"), absl::string_view::npos)
      << status;
  EXPECT_EQ(Info(a).layer_lengths[0], 10);
  EXPECT_EQ(Info(b).layer_lengths[0], 10);
}

TEST_F(EngineTest, ReducedPrecisionKvUsesTheStoredValues) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    SessionSpec spec = TestSpec();
    spec.kv_dtype = dtype;
    const std::string id = NewSession(spec);
    // fp32 inputs; the session rounds K/V to `dtype` when storing them.
    Tokens t(50, rng_);
    std::vector<float> session_out = Append(id, 0, t, 0, 50);
    // The same attention over K/V pre-rounded to `dtype` must match bitwise.
    Tokens rounded = t;
    for (HostTensor* x : {&rounded.k, &rounded.v}) {
      *x = RandomTensor(x->shape, rng_, dtype);  // right shape and dtype
      const HostTensor& src = x == &rounded.k ? t.k : t.v;
      ConvertFromFloat(src.values.data(), NumElements(src.shape), dtype,
                       x->bytes.data());
    }
    EXPECT_EQ(session_out, Stateless(rounded, 0, 0, 50));
  }
}

TEST_F(EngineTest, OutputDtypesRoundTheFloat32Result) {
  const std::string id = NewSession();
  Tokens t(5, rng_);
  AppendRequest r = Request(id, 0, t, 0, 5);
  r.output_dtype = DType::kBFloat16;
  auto out = engine_->Append(r);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->output.dtype(), DType::kBFloat16);
  const std::vector<float> expected = Stateless(t, 0, 0, 5);
  std::vector<float> got = ToFloats(out->output);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i], BFloat16ToFloat(FloatToBFloat16(expected[i])));
  }
}

TEST_F(EngineTest, ForkIsCopyOnWrite) {
  const std::string parent = NewSession();
  Tokens t(100, rng_);
  Tokens other(100, rng_);
  for (int layer = 0; layer < kLayers; ++layer) Append(parent, layer, t, 0, 60);
  const int64_t used_before = engine_->stats().pool.used_bytes;
  auto fork = engine_->ForkSession(parent);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->layer_lengths, Info(parent).layer_lengths);
  EXPECT_EQ(engine_->stats().pool.used_bytes, used_before)
      << "a fork allocates nothing until it writes";
  // Diverge: the fork continues with other tokens, the parent with t.
  std::vector<float> fork_out = Append(fork->session_id, 0, other, 60, 61);
  std::vector<float> parent_out = Append(parent, 0, t, 60, 100);
  EXPECT_EQ(parent_out, Slice(Stateless(t, 0, 0, 100), 60, 100));
  // The fork sees t's first 60 tokens and then its own.
  Tokens mixed = t;
  std::memcpy(mixed.q.bytes.data() + 60 * kQHeads * kDim * 4,
              other.q.bytes.data() + 60 * kQHeads * kDim * 4,
              kQHeads * kDim * 4);
  std::memcpy(mixed.k.bytes.data() + 60 * kKvHeads * kDim * 4,
              other.k.bytes.data() + 60 * kKvHeads * kDim * 4,
              kKvHeads * kDim * 4);
  std::memcpy(mixed.v.bytes.data() + 60 * kKvHeads * kValueDim * 4,
              other.v.bytes.data() + 60 * kKvHeads * kValueDim * 4,
              kKvHeads * kValueDim * 4);
  EXPECT_EQ(fork_out, Stateless(mixed, 0, 60, 61));
  // Deleting the parent leaves the fork intact.
  ASSERT_TRUE(engine_->DeleteSession(parent).ok());
  EXPECT_EQ(Info(fork->session_id).layer_lengths[0], 61);
}

TEST_F(EngineTest, TruncateThenReappendReproduces) {
  const std::string id = NewSession();
  Tokens t(90, rng_);
  Tokens draft(90, rng_);
  for (int layer = 0; layer < kLayers; ++layer) Append(id, layer, t, 0, 80);
  const int64_t bytes_at_80 = Info(id).kv_cache_bytes;
  // Speculative tokens that get rejected.
  for (int layer = 0; layer < kLayers; ++layer)
    Append(id, layer, draft, 80, 88);
  auto info = engine_->TruncateSession(id, 80);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->layer_lengths, (std::vector<int64_t>{80, 80, 80}));
  EXPECT_EQ(info->kv_cache_bytes, bytes_at_80);
  for (int layer = 0; layer < kLayers; ++layer) {
    EXPECT_EQ(Append(id, layer, t, 80, 90),
              Slice(Stateless(t, layer, 0, 90), 80, 90));
  }
  // Truncating past the end changes nothing.
  EXPECT_EQ(engine_->TruncateSession(id, 1000)->layer_lengths,
            (std::vector<int64_t>{90, 90, 90}));
}

TEST_F(EngineTest, TruncateIntoDroppedWindowIsFailedPreconditionAndAtomic) {
  const std::string id = NewSession();
  Tokens t(400, rng_);
  for (int layer = 0; layer < kLayers; ++layer) Append(id, layer, t, 0, 400);
  const SessionInfo before = Info(id);
  auto status = engine_->TruncateSession(id, 100).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("layer 1"), absl::string_view::npos);
  const SessionInfo after = Info(id);
  EXPECT_EQ(after.layer_lengths, before.layer_lengths)
      << "no layer was cut, not even the full ones";
  EXPECT_EQ(after.kv_cache_bytes, before.kv_cache_bytes);
}

TEST_F(EngineTest, WindowLayersStayBounded) {
  const std::string id = NewSession();
  Tokens t(2000, rng_);
  Append(id, 1, t, 0, 1000);
  const int64_t at_1000 = Info(id).kv_cache_bytes;
  Append(id, 1, t, 1000, 2000);
  EXPECT_EQ(Info(id).kv_cache_bytes, at_1000);
  // 21 tokens per block: the sink block, window 37 and one block of slack.
  EXPECT_LE(at_1000, 5 * 4096);
}

TEST_F(EngineTest, HybridSessionUsesTheCalculatorsMemory) {
  // gpt-oss geometry (8 KV heads, head_dim 64, fp16, window 128 every other
  // layer) with fewer layers and a shorter context.
  SessionSpec spec;
  spec.num_layers = 4;
  spec.num_q_heads = 8;
  spec.num_kv_heads = 8;
  spec.head_dim = 64;
  spec.kv_dtype = DType::kFloat16;
  LayerSpec full, window;
  window.window = 128;
  spec.layers = {full, window, full, window};
  EngineOptions options;
  options.kv_cache_bytes = int64_t{256} << 20;
  options.kv_block_bytes = 64 << 10;  // 32 tokens of 2048 bytes
  options.sessions.reap_interval = absl::ZeroDuration();
  auto engine =
      *AttentionEngine::Create(std::make_unique<CpuBackend>(2), options);
  auto info = *engine->CreateSession(spec, absl::ZeroDuration());
  constexpr int64_t kContext = 1024;
  HostTensor q = RandomTensor({kContext, 8, 64}, rng_, DType::kFloat16);
  HostTensor kv = RandomTensor({kContext, 8, 64}, rng_, DType::kFloat16);
  for (int layer = 0; layer < 4; ++layer) {
    AppendRequest r;
    r.session_id = info.session_id;
    r.layer = layer;
    r.q = q.view();
    r.k = kv.view();
    r.v = kv.view();
    ASSERT_TRUE(engine->Append(r).ok());
  }
  auto resolved = *engine->GetSession(info.session_id);
  const KvSizePlan plan = PlanKvSize(resolved.spec, kContext);
  // Full layers: exactly the payload (1024 tokens = 32 whole blocks).
  // Window layers: window + one block of slack + the partial block.
  const int64_t full_bytes = 2 * kContext * 2048;
  const int64_t window_bytes = 2 * 128 * 2048;
  EXPECT_EQ(plan.context_bytes, full_bytes + window_bytes);
  EXPECT_GE(resolved.kv_cache_bytes, plan.context_bytes);
  EXPECT_LE(resolved.kv_cache_bytes, full_bytes + 2 * (128 + 2 * 32) * 2048);
}

TEST_F(EngineTest, FailedCallsChangeNothing) {
  const std::string id = NewSession();
  Tokens t(64, rng_);
  for (int layer = 0; layer < kLayers; ++layer) Append(id, layer, t, 0, 30);
  const SessionInfo before = Info(id);
  const int64_t pool_before = engine_->stats().pool.used_bytes;
  auto expect_unchanged = [&](absl::StatusCode code, const AppendRequest& r) {
    auto out = engine_->Append(r);
    EXPECT_EQ(out.status().code(), code) << out.status();
    EXPECT_FALSE(out.status().message().empty());
    const SessionInfo after = Info(id);
    EXPECT_EQ(after.layer_lengths, before.layer_lengths);
    EXPECT_EQ(after.kv_cache_bytes, before.kv_cache_bytes);
    EXPECT_EQ(engine_->stats().pool.used_bytes, pool_before);
  };

  // NaN in k.
  Tokens nan = t;
  float bad = std::nanf("");
  std::memcpy(nan.k.bytes.data() + 30 * kKvHeads * kDim * 4 + 8, &bad, 4);
  expect_unchanged(absl::StatusCode::kInvalidArgument,
                   Request(id, 0, nan, 30, 34));
  // Overflowing logits.
  Tokens huge = t;
  for (HostTensor* x : {&huge.q, &huge.k}) {
    std::vector<float> big(x->values.size(), 3e19f);
    std::memcpy(x->bytes.data(), big.data(), big.size() * 4);
  }
  expect_unchanged(absl::StatusCode::kInvalidArgument,
                   Request(id, 0, huge, 30, 34));
  // Wrong head count.
  HostTensor wrong_q = RandomTensor({4, kQHeads + 1, kDim}, rng_);
  AppendRequest r = Request(id, 0, t, 30, 34);
  r.q = wrong_q.view();
  expect_unchanged(absl::StatusCode::kInvalidArgument, r);
  // Byte count that does not match the shape.
  r = Request(id, 0, t, 30, 34);
  r.k.size_bytes -= 4;
  expect_unchanged(absl::StatusCode::kInvalidArgument, r);
  // Bad layer.
  r = Request(id, 0, t, 30, 34);
  r.layer = kLayers;
  expect_unchanged(absl::StatusCode::kInvalidArgument, r);
  // Decode step with two tokens.
  r = Request(id, 0, t, 30, 32);
  r.required_tokens = 1;
  expect_unchanged(absl::StatusCode::kInvalidArgument, r);
  // K not representable in float16 storage is tested in a float16 session.
  // Output not representable in float16.
  Tokens loud = t;
  std::vector<float> big_v(loud.v.values.size(), 1e6f);
  std::memcpy(loud.v.bytes.data(), big_v.data(), big_v.size() * 4);
  r = Request(id, 0, loud, 30, 34);
  r.output_dtype = DType::kFloat16;
  expect_unchanged(absl::StatusCode::kInvalidArgument, r);
  // A batch whose last step is bad applies none of its steps.
  std::vector<AppendRequest> batch = {Request(id, 0, t, 30, 31),
                                      Request(id, 1, t, 30, 31),
                                      Request(id, 2, nan, 30, 31)};
  auto result = engine_->AppendBatch(batch);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("step 2"), absl::string_view::npos);
  EXPECT_EQ(Info(id).layer_lengths, before.layer_lengths);
  // Duplicate (session, layer) in one batch.
  batch = {Request(id, 0, t, 30, 31), Request(id, 0, t, 31, 32)};
  EXPECT_EQ(engine_->AppendBatch(batch).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Info(id).layer_lengths, before.layer_lengths);
  EXPECT_EQ(engine_->stats().pool.used_bytes, pool_before);
}

TEST_F(EngineTest, WithdrawnCallsStopAndChangeNothing) {
  const std::string id = NewSession();
  Tokens t(1700, rng_);
  for (int layer = 0; layer < kLayers; ++layer) Append(id, layer, t, 0, 600);
  const SessionInfo before = Info(id);
  const int64_t pool_before = engine_->stats().pool.used_bytes;
  // How often a prefill over several 512-key chunks checks its control:
  // on a fork, which is then deleted.
  AppendRequest r = Request(id, 0, t, 600, 1700);
  WithdrawAt never(std::numeric_limits<int64_t>::max(),
                   absl::StatusCode::kCancelled);
  {
    auto fork = engine_->ForkSession(id);
    ASSERT_TRUE(fork.ok()) << fork.status();
    AppendRequest on_fork = r;
    on_fork.session_id = fork->session_id;
    on_fork.control = &never;
    ASSERT_TRUE(engine_->Append(on_fork).ok());
    ASSERT_TRUE(engine_->DeleteSession(fork->session_id).ok());
  }
  const int64_t checks = never.checks();
  // Before the work, between chunks of every unit, and before the commit.
  ASSERT_GE(checks, 5);
  ASSERT_EQ(engine_->stats().pool.used_bytes, pool_before);
  // Withdrawn at any of those points (the first, some between chunks, the
  // commit check), the call fails with the control's code and the session,
  // its blocks and the pool are as they were.
  for (int64_t k : {int64_t{0}, int64_t{1}, int64_t{2}, checks / 3,
                    checks / 2, checks - 2, checks - 1}) {
    const absl::StatusCode code = k % 2 == 0
                                      ? absl::StatusCode::kCancelled
                                      : absl::StatusCode::kDeadlineExceeded;
    WithdrawAt withdraw(k, code);
    r.control = &withdraw;
    auto out = engine_->Append(r);
    EXPECT_EQ(out.status().code(), code) << "check " << k << ": "
                                         << out.status();
    const SessionInfo after = Info(id);
    EXPECT_EQ(after.layer_lengths, before.layer_lengths) << k;
    EXPECT_EQ(after.kv_cache_bytes, before.kv_cache_bytes) << k;
    EXPECT_EQ(engine_->stats().pool.used_bytes, pool_before) << k;
  }
  // In an AppendEach batch a withdrawn step fails alone; the others are
  // exactly what they are without it.
  const std::string other = NewSession();
  Append(other, 0, t, 0, 600);
  WithdrawAt cancelled(0, absl::StatusCode::kCancelled);
  std::vector<AppendRequest> steps = {Request(id, 0, t, 600, 601),
                                      Request(other, 0, t, 600, 601)};
  steps[0].control = &cancelled;
  auto each = engine_->AppendEach(steps);
  EXPECT_EQ(each[0].status().code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(each[1].ok()) << each[1].status();
  EXPECT_EQ(ToFloats(each[1]->output), Stateless(t, 0, 600, 601));
  EXPECT_EQ(Info(id).layer_lengths, before.layer_lengths);
  // An atomic batch with one withdrawn step applies nothing.
  steps = {Request(other, 1, t, 0, 1), Request(id, 0, t, 600, 601)};
  steps[1].control = &cancelled;
  EXPECT_EQ(engine_->AppendBatch(steps).status().code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ(Info(other).layer_lengths[1], 0);
  // Stateless calls stop too.
  StatelessRequest stateless;
  stateless.q = t.q.rows(0, 600);
  stateless.k = t.k.rows(0, 600);
  stateless.v = t.v.rows(0, 600);
  stateless.control = &cancelled;
  EXPECT_EQ(engine_->Attend(stateless).status().code(),
            absl::StatusCode::kCancelled);
}

// A create withdrawn before the session is added (a cancelled call, or one
// whose deadline passed while it waited for a handler) creates nothing:
// its caller would never learn the id, and the session would hold a slot
// of max_sessions and of its tenant's quota until it expired.
TEST_F(EngineTest, AWithdrawnCreateCreatesNothing) {
  const int64_t sessions = engine_->stats().active_sessions;
  const auto create = [&](const CallControl& control) {
    return engine_
        ->CreateSession(TestSpec(), absl::ZeroDuration(), DefaultTenant(),
                        &control)
        .status();
  };
  CancellationFlag cancelled;
  cancelled.Cancel();
  EXPECT_EQ(create(cancelled).code(), absl::StatusCode::kCancelled);
  const CancellationFlag late(absl::Now() - absl::Seconds(1));
  EXPECT_EQ(create(late).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(engine_->stats().active_sessions, sessions);
  EXPECT_EQ(engine_->ListSessions("", 100).size(),
            static_cast<size_t>(sessions));
  EXPECT_TRUE(create(CancellationFlag()).ok());
  EXPECT_EQ(engine_->stats().active_sessions, sessions + 1);
}

// Delete, fork and truncate check their control once they hold the
// session: here they wait for a hand-over's seal, meanwhile their client
// gives up, and once the seal goes they change nothing.
TEST_F(EngineTest, WithdrawnDeletesForksAndTruncatesChangeNothing) {
  const std::string id = NewSession();
  Tokens t(40, rng_);
  Append(id, 0, t, 0, 40);
  const SessionInfo before = Info(id);
  const int64_t sessions = engine_->stats().active_sessions;
  CancellationFlag fork_flag, truncate_flag, delete_flag;
  absl::Status forked, truncated, deleted;
  {
    auto seal = std::make_unique<absl::StatusOr<SessionSeal>>(
        engine_->SealSession(id, absl::Now() + absl::Seconds(20)));
    ASSERT_TRUE(seal->ok()) << seal->status();
    std::thread fork([&] {
      forked = engine_->ForkSession(id, DefaultTenant(), &fork_flag).status();
    });
    std::thread truncate([&] {
      truncated =
          engine_->TruncateSession(id, 10, DefaultTenant(), &truncate_flag)
              .status();
    });
    std::thread remove([&] {
      deleted = engine_->DeleteSession(id, DefaultTenant(), &delete_flag);
    });
    // Whether or not the calls wait yet, they are withdrawn before the
    // seal goes.
    absl::SleepFor(absl::Milliseconds(100));
    fork_flag.Cancel();
    truncate_flag.Cancel();
    delete_flag.Cancel();
    absl::SleepFor(absl::Milliseconds(50));
    seal.reset();  // unsealed: the waiting calls go on
    fork.join();
    truncate.join();
    remove.join();
  }
  EXPECT_EQ(forked.code(), absl::StatusCode::kCancelled) << forked;
  EXPECT_EQ(truncated.code(), absl::StatusCode::kCancelled) << truncated;
  EXPECT_EQ(deleted.code(), absl::StatusCode::kCancelled) << deleted;
  EXPECT_EQ(engine_->stats().active_sessions, sessions);
  const SessionInfo after = Info(id);
  EXPECT_EQ(after.layer_lengths, before.layer_lengths);
  EXPECT_EQ(after.kv_cache_bytes, before.kv_cache_bytes);
  // Not withdrawn, they apply.
  CancellationFlag live;
  ASSERT_TRUE(engine_->ForkSession(id, DefaultTenant(), &live).ok());
  ASSERT_TRUE(engine_->TruncateSession(id, 10, DefaultTenant(), &live).ok());
  EXPECT_EQ(Info(id).layer_lengths[0], 10);
  EXPECT_TRUE(engine_->DeleteSession(id, DefaultTenant(), &live).ok());
}

// A batch with steps on several layers of one session looks the session up
// once: a hand-over's seal that begins between the steps' lookups waits for
// the batch, and the batch never waits for the seal (which would wait for
// the batch until the seal's deadline).
TEST(EngineSealTest, ASealBeginningDuringAMultiLayerBatchWaitsForIt) {
  const std::thread::id batch_thread = std::this_thread::get_id();
  std::atomic<bool> armed{false};
  std::atomic<int> clock_reads{0};
  std::atomic<AttentionEngine*> engine_ptr{nullptr};
  std::string id;
  std::thread sealer;
  absl::Status sealed = absl::UnknownError("not sealed");
  EngineOptions options;
  options.kv_cache_bytes = 1 << 20;
  options.kv_block_bytes = 4096;
  options.sessions.reap_interval = absl::ZeroDuration();
  options.sessions.now = [&] {
    // The batch's second read of the clock: a seal begins (and is given
    // 50 ms to register) while the batch holds the session.
    if (armed.load() && std::this_thread::get_id() == batch_thread &&
        ++clock_reads == 2) {
      sealer = std::thread([&] {
        auto seal =
            engine_ptr.load()->SealSession(id, absl::Now() + absl::Seconds(20));
        sealed = seal.status();
      });
      absl::SleepFor(absl::Milliseconds(50));
    }
    return absl::Now();
  };
  auto engine =
      AttentionEngine::Create(std::make_unique<CpuBackend>(1), options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  engine_ptr = engine->get();
  id = (*engine)->CreateSession(TestSpec(), absl::ZeroDuration())->session_id;
  std::mt19937 rng(7);
  const Tokens t(1, rng);
  std::vector<AppendRequest> steps;
  for (int layer = 0; layer < kLayers; ++layer) {
    AppendRequest step;
    step.session_id = id;
    step.layer = layer;
    step.q = t.q.view();
    step.k = t.k.view();
    step.v = t.v.view();
    steps.push_back(step);
  }
  armed = true;
  const auto batch = (*engine)->AppendBatch(steps);
  armed = false;
  ASSERT_TRUE(sealer.joinable());
  sealer.join();
  EXPECT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(sealed.ok()) << sealed;
}

// A fork copies its parent's block tables but shares its blocks, so the
// pool does not bound those copies: they count as the fork's metadata
// (bounded by --max_session_metadata_bytes, as sessions are), and deleting
// the fork gives them back.
TEST_F(EngineTest, ForksCountTheBlockTablesTheyCopy) {
  const std::string parent = NewSession();
  const Tokens t(600, rng_);
  Append(parent, 0, t, 0, 600);
  const int64_t base = Info(parent).metadata_bytes;
  EXPECT_EQ(engine_->stats().session_metadata_bytes, base);
  auto fork = engine_->ForkSession(parent);
  ASSERT_TRUE(fork.ok()) << fork.status();
  // float32 K and V: 2 heads x (16 + 8) x 4 bytes a token, 4096-byte blocks.
  const int64_t tokens_per_block = 4096 / (kKvHeads * (kDim + kValueDim) * 4);
  const int64_t blocks = (600 + tokens_per_block - 1) / tokens_per_block;
  EXPECT_EQ(fork->metadata_bytes, base + blocks * 4);
  EXPECT_EQ(engine_->stats().session_metadata_bytes, 2 * base + blocks * 4);
  ASSERT_TRUE(engine_->DeleteSession(fork->session_id).ok());
  EXPECT_EQ(engine_->stats().session_metadata_bytes, base);
}

// The batched appends (the decode batcher's) and HoldSession (a Decode
// stream's) never wait for a hand-over: a step on a sealed session fails at
// once with UNAVAILABLE and changes nothing, and the other steps of its
// batch run. (They used to wait for the move, holding up every session the
// batcher serves.) Once the seal goes, the session is as it was.
TEST_F(EngineTest, BatchedAppendsDoNotWaitForASeal) {
  const std::string moving = NewSession();
  const std::string staying = NewSession();
  const Tokens t(2, rng_);
  Append(moving, 0, t, 0, 1);
  std::vector<absl::StatusOr<AttentionOutput>> each;
  absl::Status atomic, hold;
  {
    auto seal = engine_->SealSession(moving, absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(seal.ok()) << seal.status();
    absl::Notification done;
    std::thread batcher([&] {
      each = engine_->AppendEach(
          {Request(moving, 0, t, 1, 2), Request(staying, 0, t, 0, 1)});
      atomic = engine_
                   ->AppendBatch({Request(staying, 1, t, 0, 1),
                                  Request(moving, 1, t, 0, 1)})
                   .status();
      hold = engine_->HoldSession(moving).status();
      done.Notify();
    });
    // While the seal is held (a wait would last until it goes).
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    seal = absl::UnavailableError("the move failed: unsealed");
    batcher.join();
  }
  ASSERT_EQ(each.size(), 2u);
  EXPECT_EQ(each[0].status().code(), absl::StatusCode::kUnavailable)
      << each[0].status();
  EXPECT_NE(each[0].status().message().find("being moved"),
            absl::string_view::npos);
  ASSERT_TRUE(each[1].ok()) << each[1].status();
  EXPECT_EQ(ToFloats(each[1]->output), Stateless(t, 0, 0, 1));
  EXPECT_EQ(atomic.code(), absl::StatusCode::kUnavailable) << atomic;
  EXPECT_EQ(hold.code(), absl::StatusCode::kUnavailable) << hold;
  EXPECT_EQ(Info(moving).layer_lengths, (std::vector<int64_t>{1, 0, 0}));
  EXPECT_EQ(Info(staying).layer_lengths, (std::vector<int64_t>{1, 0, 0}));
  EXPECT_EQ(ToFloats(engine_->Append(Request(moving, 0, t, 1, 2))->output),
            Stateless(t, 0, 1, 2));
}

TEST_F(EngineTest, AnAppendOrTruncateWithdrawnWhileSealedChangesNothing) {
  const std::string moving = NewSession();
  const Tokens t(2, rng_);
  Append(moving, 0, t, 0, 1);
  CancellationFlag cancel;
  AppendRequest prefill = Request(moving, 0, t, 1, 2);
  prefill.control = &cancel;
  const CancellationFlag expire(absl::Now() + absl::Milliseconds(50));
  absl::Status appended, truncated;
  absl::Notification done;
  bool ended = false;
  {
    auto seal = engine_->SealSession(moving, absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(seal.ok()) << seal.status();
    std::thread calls([&] {
      appended = engine_->Append(prefill).status();
      truncated = engine_->TruncateSession(moving, 0, DefaultTenant(), &expire)
                      .status();
      done.Notify();
    });
    absl::SleepFor(absl::Milliseconds(30));
    EXPECT_FALSE(done.HasBeenNotified());  // waits while sealed
    cancel.Cancel();
    ended = done.WaitForNotificationWithTimeout(absl::Seconds(30));
    seal = absl::UnavailableError("the move failed: unsealed");
    calls.join();
  }
  EXPECT_TRUE(ended) << "the withdrawn calls waited for the seal";
  EXPECT_EQ(appended.code(), absl::StatusCode::kCancelled) << appended;
  EXPECT_EQ(truncated.code(), absl::StatusCode::kDeadlineExceeded) << truncated;
  EXPECT_EQ(Info(moving).layer_lengths, (std::vector<int64_t>{1, 0, 0}));
}

TEST_F(EngineTest, BatchedAppendsCanSkipASessionAnotherCallHolds) {
  const std::string busy = NewSession();
  const std::string free = NewSession();
  const Tokens prompt(4, rng_);
  const Tokens t(1, rng_);
  testing::HoldAtFirstCheck hold;
  AppendRequest prefill = Request(busy, 1, prompt, 0, 4);
  prefill.control = &hold;
  absl::Status prefill_status;
  std::thread prefill_thread(
      [&] { prefill_status = engine_->Append(prefill).status(); });
  hold.WaitUntilHeld();

  // The prefill holds `busy`: skipped steps on it apply nothing, a
  // withdrawn one ends as withdrawn, the others run.
  const testing::WithdrawAt withdrawn(0, absl::StatusCode::kCancelled);
  AppendRequest withdrawn_step = Request(busy, 2, t, 0, 1);
  withdrawn_step.control = &withdrawn;
  const auto each = engine_->AppendEach(
      {Request(busy, 0, t, 0, 1), Request(free, 0, t, 0, 1), withdrawn_step},
      BusySessions::kSkip);
  const absl::Status atomic =
      engine_
          ->AppendBatch({Request(free, 1, t, 0, 1), Request(busy, 0, t, 0, 1)},
                        -1, BusySessions::kSkip)
          .status();
  hold.Release();
  prefill_thread.join();
  ASSERT_TRUE(prefill_status.ok()) << prefill_status;

  ASSERT_EQ(each.size(), 3u);
  EXPECT_TRUE(IsSessionBusy(each[0].status())) << each[0].status();
  EXPECT_EQ(each[0].status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(each[1].ok()) << each[1].status();
  EXPECT_EQ(ToFloats(each[1]->output), Stateless(t, 0, 0, 1));
  EXPECT_EQ(each[2].status().code(), absl::StatusCode::kCancelled)
      << each[2].status();
  EXPECT_TRUE(absl::StrContains(each[0].status().message(), busy))
      << each[0].status();
  EXPECT_TRUE(IsSessionBusy(atomic)) << atomic;
  EXPECT_TRUE(absl::StartsWith(atomic.message(), "step 1: ")) << atomic;
  EXPECT_EQ(Info(busy).layer_lengths, (std::vector<int64_t>{0, 4, 0}));
  EXPECT_EQ(Info(free).layer_lengths, (std::vector<int64_t>{1, 0, 0}));
  // Once free, the same steps run as if nothing had happened (and `free`
  // was left unlocked).
  EXPECT_EQ(Append(busy, 0, t, 0, 1), Stateless(t, 0, 0, 1));
  EXPECT_EQ(Append(free, 1, t, 0, 1), Stateless(t, 1, 0, 1));
}

// An engine whose sessions' clock reads `*now` (no reaper).
std::unique_ptr<AttentionEngine> EngineOnClock(const absl::Time* now) {
  EngineOptions options;
  options.kv_cache_bytes = 1 << 20;
  options.kv_block_bytes = 4096;
  options.sessions.reap_interval = absl::ZeroDuration();
  options.sessions.now = [now] { return *now; };
  auto engine =
      AttentionEngine::Create(std::make_unique<CpuBackend>(1), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? *std::move(engine) : nullptr;
}

// The idle deadline (unix seconds) an export of session `id` carries.
int64_t ExportedDeadline(AttentionEngine& engine, const std::string& id) {
  auto exported = engine.ExportSession(id);
  EXPECT_TRUE(exported.ok()) << exported.status();
  return exported.ok() ? (*exported)->header().idle_deadline_unix_ms / 1000
                       : -1;
}

// A failed call changes nothing, the session's idle clock included: only
// calls that succeed restart it (the deadline an export reports moves).
TEST_F(EngineTest, OnlySuccessfulCallsRestartTheIdleClock) {
  absl::Time now = absl::FromUnixSeconds(1000);
  std::unique_ptr<AttentionEngine> engine = EngineOnClock(&now);
  AttentionEngine& e = *engine;
  const std::string id =
      e.CreateSession(TestSpec(), absl::Seconds(10))->session_id;
  const std::string other =
      e.CreateSession(TestSpec(), absl::Seconds(10))->session_id;
  const auto deadline = [&](const std::string& session) {
    return ExportedDeadline(e, session);
  };
  std::mt19937 rng(3);
  const Tokens t(400, rng);
  // Layer 1's window drops its early blocks: it cannot be cut back to 100.
  ASSERT_TRUE(e.Append(Request(id, 1, t, 0, 400)).ok());
  ASSERT_EQ(deadline(id), 1010);

  now += absl::Seconds(4);
  AppendRequest bad_layer = Request(id, 0, t, 0, 1);
  bad_layer.layer = kLayers;
  EXPECT_EQ(e.Append(bad_layer).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.TruncateSession(id, 100).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // In an independent batch, the failed step's session keeps its clock;
  // the other step's session restarts its own.
  const std::vector<AppendRequest> batch = {bad_layer,
                                            Request(other, 0, t, 0, 1)};
  const auto results = e.AppendEach(batch);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_FALSE(results[0].ok());
  EXPECT_TRUE(results[1].ok()) << results[1].status();
  EXPECT_EQ(deadline(id), 1010);
  EXPECT_EQ(deadline(other), 1014);

  // Successful calls restart it: a step, a truncate, a fork, a lookup.
  now += absl::Seconds(1);
  ASSERT_TRUE(e.Append(Request(id, 0, t, 0, 1)).ok());
  EXPECT_EQ(deadline(id), 1015);
  now += absl::Seconds(1);
  ASSERT_TRUE(e.TruncateSession(id, 400).ok());
  EXPECT_EQ(deadline(id), 1016);
  now += absl::Seconds(1);
  ASSERT_TRUE(e.ForkSession(id).ok());
  EXPECT_EQ(deadline(id), 1017);
  now += absl::Seconds(1);
  ASSERT_TRUE(e.GetSession(id).ok());
  EXPECT_EQ(deadline(id), 1018);
}

// A session in use (an open Decode stream's hold) cannot expire, however
// long ago its clock restarted: its export carries a deadline counted from
// the export, so a peer or a restart that imports it does not find it
// expired at once.
TEST_F(EngineTest, AnExportOfASessionInUseCarriesAFreshIdleDeadline) {
  absl::Time now = absl::FromUnixSeconds(1000);
  std::unique_ptr<AttentionEngine> engine = EngineOnClock(&now);
  AttentionEngine& e = *engine;
  const std::string id =
      e.CreateSession(TestSpec(), absl::Seconds(10))->session_id;
  const auto deadline = [&] { return ExportedDeadline(e, id); };
  now += absl::Seconds(5);
  EXPECT_EQ(deadline(), 1010);  // not in use: where its last use put it
  {
    auto hold = e.HoldSession(id);
    ASSERT_TRUE(hold.ok()) << hold.status();
    now += absl::Seconds(30);  // past the idle timeout, but held
    EXPECT_EQ(deadline(), 1045);
    auto seal = e.SealSession(id, absl::InfiniteFuture());
    ASSERT_TRUE(seal.ok()) << seal.status();
    auto sealed = e.ExportSealed(*seal);
    ASSERT_TRUE(sealed.ok()) << sealed.status();
    EXPECT_EQ((*sealed)->header().idle_deadline_unix_ms / 1000, 1045);
  }
}

// Neither can a session sealed for a move (calls waiting for the move would
// restart its clock): the hand-over's copy must not arrive expired.
TEST_F(EngineTest, AnExportOfASealedSessionCarriesAFreshIdleDeadline) {
  absl::Time now = absl::FromUnixSeconds(1000);
  std::unique_ptr<AttentionEngine> engine = EngineOnClock(&now);
  AttentionEngine& e = *engine;
  const std::string id =
      e.CreateSession(TestSpec(), absl::Seconds(10))->session_id;
  now += absl::Seconds(5);
  auto seal = e.SealSession(id, absl::InfiniteFuture());
  ASSERT_TRUE(seal.ok()) << seal.status();
  now += absl::Seconds(30);  // past the idle timeout while sealed
  auto sealed = e.ExportSealed(*seal);
  ASSERT_TRUE(sealed.ok()) << sealed.status();
  EXPECT_EQ((*sealed)->header().idle_deadline_unix_ms / 1000, 1045);
}

// After StopChanges (a server about to write its snapshot) every change
// is refused with UNAVAILABLE and nothing changes; reads still work.
TEST_F(EngineTest, StoppedChangesAreUnavailableAndReadsStillWork) {
  const std::string id = NewSession();
  Tokens t(4, rng_);
  Append(id, 0, t, 0, 2);
  const absl::Status stopped =
      engine_->StopChanges(absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(stopped.ok()) << stopped;
  const auto unavailable = [](const absl::Status& status) {
    return status.code() == absl::StatusCode::kUnavailable;
  };
  EXPECT_TRUE(unavailable(engine_->Append(Request(id, 0, t, 2, 3)).status()));
  const std::vector<AppendRequest> batch = {Request(id, 0, t, 2, 3),
                                            Request(id, 1, t, 0, 1)};
  EXPECT_TRUE(unavailable(engine_->AppendBatch(batch).status()));
  for (const auto& result : engine_->AppendEach(batch)) {
    EXPECT_TRUE(unavailable(result.status()));
  }
  EXPECT_TRUE(unavailable(engine_->TruncateSession(id, 1).status()));
  EXPECT_TRUE(unavailable(engine_->ForkSession(id).status()));
  EXPECT_TRUE(unavailable(engine_->DeleteSession(id)));
  EXPECT_TRUE(unavailable(
      engine_->CreateSession(TestSpec(), absl::ZeroDuration()).status()));
  const SessionInfo info = Info(id);
  EXPECT_EQ(info.layer_lengths, (std::vector<int64_t>{2, 0, 0}));
  EXPECT_TRUE(engine_->ExportSession(id).ok());
  EXPECT_EQ(engine_->stats().active_sessions, 1);
}

TEST_F(EngineTest, CallsOverTheFlopLimitAreRefusedBeforeAnyWork) {
  EngineOptions options;
  options.kv_cache_bytes = int64_t{16} << 20;
  options.kv_block_bytes = 4096;
  options.sessions.reap_interval = absl::ZeroDuration();
  // Each token of TestSpec() costs 2 * (16 + 16) * 4 = 256 flops per key
  // (value_dim 8 counts as 16).
  options.max_call_flops = 256 * 100;
  auto engine =
      AttentionEngine::Create(std::make_unique<CpuBackend>(1), options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto session = (*engine)->CreateSession(TestSpec(), absl::ZeroDuration());
  ASSERT_TRUE(session.ok());
  const std::string id = session->session_id;
  Tokens t(20, rng_);
  // 13 causal queries see 1 + 2 + ... + 13 = 91 keys: allowed.
  for (int layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE((*engine)->Append(Request(id, layer, t, 0, 13)).ok());
  }
  // Seven more see 14 + ... + 20 = 119 > 100.
  auto refused = (*engine)->Append(Request(id, 0, t, 13, 20));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("--max_call_flops"),
            std::string::npos)
      << refused.status();
  auto info = (*engine)->GetSession(id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_lengths[0], 13);
  // An atomic batch is one call: 14 + 15 + 16 + 17 = 62 keys per step fits,
  // two such steps do not. As independent steps (AppendEach) both run.
  std::vector<AppendRequest> batch = {Request(id, 0, t, 13, 17),
                                      Request(id, 1, t, 13, 17)};
  EXPECT_EQ((*engine)->AppendBatch(batch).status().code(),
            absl::StatusCode::kResourceExhausted);
  for (const auto& result : (*engine)->AppendEach(batch)) {
    EXPECT_TRUE(result.ok()) << result.status();
  }
  // Stateless: 11 queries x 10 keys, not causal = 110 pairs.
  StatelessRequest stateless;
  stateless.q = t.q.rows(0, 11);
  stateless.k = t.k.rows(0, 10);
  stateless.v = t.v.rows(0, 10);
  EXPECT_EQ((*engine)->Attend(stateless).status().code(),
            absl::StatusCode::kResourceExhausted);
  stateless.q = t.q.rows(0, 10);
  EXPECT_TRUE((*engine)->Attend(stateless).ok());
}

// A step's result is bounded by what the session's spec makes of it
// (value_dim, not the request's widths), once the request checked out
// against the session and before any work; an atomic batch's results add
// up. A request that does not fit the session is INVALID_ARGUMENT first.
TEST_F(EngineTest, RepliesAreBoundedExactlyBeforeAnyWork) {
  const std::string id = NewSession();
  Tokens t(10, rng_);
  // 5 tokens x 4 heads x (8 values x 4 bytes + a float32 lse).
  EXPECT_EQ(ResultBytes(TestSpec(), 0, 5, DType::kFloat32,
                        /*return_lse=*/true, /*return_topk_indices=*/false),
            720);
  AppendRequest fits = Request(id, 0, t, 0, 5);
  fits.return_lse = true;
  fits.max_reply_bytes = 720;
  ASSERT_TRUE(engine_->Append(fits).ok());
  AppendRequest over = Request(id, 0, t, 5, 10);
  over.return_lse = true;
  over.max_reply_bytes = 719;
  auto refused = engine_->Append(over);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted)
      << refused.status();
  EXPECT_NE(refused.status().message().find("720 bytes"), std::string::npos)
      << refused.status();
  AppendRequest malformed = Request(id, 0, t, 5, 10);
  malformed.q = t.k.rows(5, 10);  // 2 heads where the session has 4
  malformed.max_reply_bytes = 0;
  EXPECT_EQ(engine_->Append(malformed).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Two steps of 720 bytes: one reply of 1440.
  const std::vector<AppendRequest> batch = {Request(id, 0, t, 5, 10),
                                            Request(id, 1, t, 0, 5)};
  EXPECT_EQ(engine_->AppendBatch(batch, 1439).status().code(),
            absl::StatusCode::kResourceExhausted);
  auto info = engine_->GetSession(id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_lengths, (std::vector<int64_t>{5, 0, 0}));
  auto accepted = engine_->AppendBatch(batch, 1440);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
}

TEST_F(EngineTest, Float16StorageRejectsUnrepresentableKeys) {
  SessionSpec spec = TestSpec();
  spec.kv_dtype = DType::kFloat16;
  const std::string id = NewSession(spec);
  Tokens t(4, rng_);
  std::vector<float> big(t.k.values.size(), 1e5f);  // > 65504
  std::memcpy(t.k.bytes.data(), big.data(), big.size() * 4);
  auto out = engine_->Append(Request(id, 0, t, 0, 4));
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Info(id).layer_lengths[0], 0);
}

TEST_F(EngineTest, MaxTokensIsOutOfRange) {
  SessionSpec spec = TestSpec();
  spec.max_tokens = 10;
  const std::string id = NewSession(spec);
  Tokens t(12, rng_);
  Append(id, 0, t, 0, 8);
  auto out = engine_->Append(Request(id, 0, t, 8, 11));
  EXPECT_EQ(out.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Info(id).layer_lengths[0], 8);
  Append(id, 0, t, 8, 10);  // exactly max_tokens is fine
}

TEST_F(EngineTest, FullPoolIsResourceExhaustedAndRecovers) {
  // 4 blocks of 21 tokens (2 KV heads * (16 + 8) floats = 192 bytes each).
  engine_ = MakeEngine(4 * 4096, 2);
  const std::string a = NewSession();
  const std::string b = NewSession();
  Tokens t(100, rng_);
  Append(a, 0, t, 0, 60);  // 3 blocks
  const SessionInfo before = Info(b);
  auto out = engine_->Append(Request(b, 0, t, 0, 30));  // needs 2
  EXPECT_EQ(out.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Info(b).layer_lengths, before.layer_lengths);
  EXPECT_EQ(engine_->stats().pool.blocks_used, 3);
  ASSERT_TRUE(engine_->DeleteSession(a).ok());
  EXPECT_EQ(engine_->stats().pool.blocks_used, 0);
  EXPECT_EQ(Append(b, 0, t, 0, 30), Stateless(t, 0, 0, 30));
}

TEST_F(EngineTest, UnknownSessionIsNotFound) {
  Tokens t(1, rng_);
  EXPECT_EQ(engine_->Append(Request("0123", 0, t, 0, 1)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->GetSession("0123").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->ForkSession("0123").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->TruncateSession("0123", 0).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->DeleteSession("0123").code(), absl::StatusCode::kNotFound);
}

TEST_F(EngineTest, StatelessValidation) {
  Tokens t(8, rng_);
  StatelessRequest r;
  r.q = t.q.view();
  r.k = t.k.view();
  r.v = t.v.view();
  auto code = [&](const StatelessRequest& req) {
    return engine_->Attend(req).status().code();
  };
  EXPECT_EQ(code(r), absl::StatusCode::kOk);
  StatelessRequest bad = r;
  bad.mask.window = 4;  // needs causal
  EXPECT_EQ(code(bad), absl::StatusCode::kInvalidArgument);
  bad = r;
  bad.mask.query_start = 3;  // needs causal
  EXPECT_EQ(code(bad), absl::StatusCode::kInvalidArgument);
  // The last of the 8 rows' positions must be representable; the largest
  // query_start that allows it works.
  bad = r;
  bad.mask.causal = true;
  bad.mask.query_start = std::numeric_limits<int64_t>::max() - 7;
  EXPECT_EQ(code(bad), absl::StatusCode::kInvalidArgument);
  bad.mask.query_start = std::numeric_limits<int64_t>::max() - 8;
  EXPECT_EQ(code(bad), absl::StatusCode::kOk);
  bad = r;
  bad.mask.causal = true;
  bad.mask.num_sink_tokens = 2;  // needs a window
  EXPECT_EQ(code(bad), absl::StatusCode::kInvalidArgument);
  bad = r;
  bad.sink_logits = {1.0f};  // needs one per query head
  EXPECT_EQ(code(bad), absl::StatusCode::kInvalidArgument);
  bad = r;
  bad.scale = -1.0f;
  EXPECT_EQ(code(bad), absl::StatusCode::kInvalidArgument);
  HostTensor bias = RandomTensor({8, 7}, rng_);
  bad = r;
  bad.bias = bias.view();
  EXPECT_EQ(code(bad), absl::StatusCode::kInvalidArgument);
  HostTensor nan_bias = FloatTensor({8, 8}, std::vector<float>(64, 0.0f));
  const float nan = std::nanf("");
  std::memcpy(nan_bias.bytes.data() + 12, &nan, 4);
  bad = r;
  bad.bias = nan_bias.view();
  EXPECT_EQ(code(bad), absl::StatusCode::kInvalidArgument);
  bad = r;
  bad.return_weights = true;
  EXPECT_EQ(code(bad), absl::StatusCode::kOk);
}

// A stateless call's heads and widths are bounded as a session's: 2^22
// query heads over one KV head (a few megabytes of request) took tens of
// gigabytes of chunk states.
TEST_F(EngineTest, StatelessHeadsAndWidthsHaveASessionsLimits) {
  const auto attend = [&](int64_t heads, int64_t head_dim, int64_t value_dim) {
    HostTensor q = FloatTensor({1, heads, head_dim},
                               std::vector<float>(heads * head_dim, 0.5f));
    HostTensor k =
        FloatTensor({4, 1, head_dim}, std::vector<float>(4 * head_dim, 0.25f));
    HostTensor v =
        FloatTensor({4, 1, value_dim}, std::vector<float>(4 * value_dim, 1.0f));
    StatelessRequest r;
    r.q = q.view();
    r.k = k.view();
    r.v = v.view();
    return engine_->Attend(r).status();
  };
  EXPECT_TRUE(attend(1024, 4, 4).ok());
  const absl::Status heads = attend(1025, 4, 4);
  EXPECT_EQ(heads.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(heads.message().find("1025 heads"), std::string::npos) << heads;
  EXPECT_TRUE(attend(2, 1024, 1024).ok());
  EXPECT_EQ(attend(2, 1025, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(attend(2, 4, 1025).code(), absl::StatusCode::kInvalidArgument);
}

// A stateless call may send K and V in two dtypes: each is read as what it
// holds, bitwise as if both came as float32. (The kernels read both in K's
// dtype: bfloat16 values read as float32 ran past the end of V.)
TEST_F(EngineTest, StatelessKAndVInTwoDtypes) {
  const HostTensor q = RandomTensor({3, kQHeads, kDim}, rng_);
  for (const DType k_dtype : {DType::kFloat32, DType::kFloat16}) {
    const DType v_dtype =
        k_dtype == DType::kFloat32 ? DType::kBFloat16 : DType::kFloat32;
    const HostTensor k = RandomTensor({40, kKvHeads, kDim}, rng_, k_dtype);
    const HostTensor v = RandomTensor({40, kKvHeads, kValueDim}, rng_, v_dtype);
    const HostTensor k32 = FloatTensor(k.shape, k.values);
    const HostTensor v32 = FloatTensor(v.shape, v.values);
    StatelessRequest mixed;
    mixed.q = q.view();
    mixed.k = k.view();
    mixed.v = v.view();
    StatelessRequest wide = mixed;
    wide.k = k32.view();
    wide.v = v32.view();
    auto got = engine_->Attend(mixed);
    auto want = engine_->Attend(wide);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(ToFloats(got->output), ToFloats(want->output))
        << DTypeName(k_dtype) << " K, " << DTypeName(v_dtype) << " V";
  }
}

TEST_F(EngineTest, StatelessWeightsRespectTheSizeLimit) {
  EngineOptions options;
  options.kv_cache_bytes = 1 << 20;
  options.kv_block_bytes = 4096;
  options.max_weights_bytes = 1000;
  options.sessions.reap_interval = absl::ZeroDuration();
  auto engine =
      *AttentionEngine::Create(std::make_unique<CpuBackend>(1), options);
  Tokens t(16, rng_);
  StatelessRequest r;
  r.q = t.q.view();
  r.k = t.k.view();
  r.v = t.v.view();
  r.return_weights = true;  // 4 * 16 * 16 * 4 bytes > 1000
  auto out = engine->Attend(r);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("return_weights"),
            absl::string_view::npos);
}

TEST_F(EngineTest, ConcurrentSessionsMatchTheirStatelessAnswers) {
  constexpr int kThreads = 6;
  std::vector<Tokens> tokens;
  for (int i = 0; i < kThreads; ++i) tokens.emplace_back(64, rng_);
  std::vector<std::vector<float>> expected;
  for (int i = 0; i < kThreads; ++i) {
    expected.push_back(Stateless(tokens[i], 2, 0, 64));
  }
  std::vector<std::vector<float>> got(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      const std::string id = NewSession();
      got[i] = Append(id, 2, tokens[i], 0, 16);
      for (int64_t p = 16; p < 64; ++p) {
        std::vector<float> row = Append(id, 2, tokens[i], p, p + 1);
        got[i].insert(got[i].end(), row.begin(), row.end());
      }
      EXPECT_TRUE(engine_->DeleteSession(id).ok());
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(got[i], expected[i]) << i;
  EXPECT_EQ(engine_->stats().pool.used_bytes, 0);
  EXPECT_EQ(engine_->stats().active_sessions, 0);
}

TEST_F(EngineTest, ListAndStats) {
  const std::string a = NewSession();
  const std::string b = NewSession();
  std::vector<SessionInfo> all = engine_->ListSessions("", 10);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_LT(all[0].session_id, all[1].session_id);
  // Pages follow the id order.
  std::vector<SessionInfo> first = engine_->ListSessions("", 1);
  ASSERT_EQ(first.size(), 1u);
  std::vector<SessionInfo> second =
      engine_->ListSessions(first[0].session_id, 1);
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(second[0].session_id, all[1].session_id);
  EXPECT_TRUE(engine_->ListSessions(all[1].session_id, 1).empty());
  EXPECT_GT(all[0].metadata_bytes, 0);
  EXPECT_EQ(engine_->stats().session_metadata_bytes,
            all[0].metadata_bytes + all[1].metadata_bytes);
  EXPECT_EQ(engine_->stats().active_sessions, 2);
  EXPECT_EQ(engine_->stats().sessions_created_total, 2);
  Tokens t(8, rng_);
  Append(a, 0, t, 0, 5);
  AppendRequest step = Request(a, 0, t, 5, 6);
  step.required_tokens = 1;
  ASSERT_TRUE(engine_->Append(step).ok());
  EXPECT_EQ(engine_->stats().prefill_tokens_total, 5);
  EXPECT_EQ(engine_->stats().decode_tokens_total, 1);
  EXPECT_EQ(all[0].layer_lengths.size(), static_cast<size_t>(kLayers));
  // A page ends with the session that brings its metadata past the bound.
  const std::string c = NewSession();
  const Tenant& tenant = DefaultTenant();
  all = engine_->ListSessions("", 10);
  ASSERT_EQ(all.size(), 3u);
  const int64_t two = all[0].metadata_bytes + all[1].metadata_bytes;
  EXPECT_EQ(engine_->ListSessions("", 10, tenant, 0).size(), 1u);
  EXPECT_EQ(engine_->ListSessions("", 10, tenant, all[0].metadata_bytes).size(),
            2u);
  EXPECT_EQ(engine_->ListSessions("", 10, tenant, two - 1).size(), 2u);
  EXPECT_EQ(engine_->ListSessions("", 10, tenant, two).size(), 3u);
}

TEST_F(EngineTest, OutputDestinationReceivesTheOutputBitwise) {
  // Every output dtype, an aligned and a misaligned float32 buffer, through
  // Append, AppendBatch and AppendEach: the destination holds exactly the
  // bytes the owned output would, and output is left empty.
  const std::string with_destination = NewSession();
  const std::string plain = NewSession();
  Tokens t(40, rng_);
  for (const std::string& id : {with_destination, plain}) {
    for (int layer = 0; layer < kLayers; ++layer) Append(id, layer, t, 0, 30);
  }
  struct Case {
    DType dtype;
    size_t offset;  // bytes into the buffer; 1 = not float-aligned
  };
  int64_t position = 30;
  for (const Case& c : {Case{DType::kFloat32, 0}, Case{DType::kFloat32, 1},
                        Case{DType::kFloat16, 0}, Case{DType::kBFloat16, 1}}) {
    SCOPED_TRACE(DTypeName(c.dtype));
    const size_t bytes = kQHeads * kValueDim * DTypeSize(c.dtype);
    std::vector<std::vector<std::byte>> buffers(
        kLayers, std::vector<std::byte>(bytes + c.offset));
    std::vector<AppendRequest> requests, plain_requests;
    for (int layer = 0; layer < kLayers; ++layer) {
      AppendRequest r =
          Request(with_destination, layer, t, position, position + 1);
      r.required_tokens = 1;
      r.output_dtype = c.dtype;
      r.output_destination =
          absl::MakeSpan(buffers[layer].data() + c.offset, bytes);
      requests.push_back(r);
      AppendRequest p = Request(plain, layer, t, position, position + 1);
      p.required_tokens = 1;
      p.output_dtype = c.dtype;
      plain_requests.push_back(p);
    }
    std::vector<AttentionOutput> expected;
    for (const AppendRequest& p : plain_requests) {
      auto out = engine_->Append(p);
      ASSERT_TRUE(out.ok()) << out.status();
      expected.push_back(*std::move(out));
    }
    auto check = [&](int layer, const AttentionOutput& out) {
      EXPECT_EQ(out.output.size_bytes(), 0);
      EXPECT_EQ(out.position, expected[layer].position);
      ASSERT_TRUE(out.lse.has_value());
      EXPECT_EQ(ToFloats(*out.lse), ToFloats(*expected[layer].lse));
      const std::byte* want = expected[layer].output.data();
      EXPECT_EQ(
          std::vector<std::byte>(requests[layer].output_destination.begin(),
                                 requests[layer].output_destination.end()),
          std::vector<std::byte>(want, want + bytes));
    };
    // Layer 0 alone, the other layers through AppendEach, then all again
    // (on the next position) through AppendBatch against fresh plain steps.
    auto alone = engine_->Append(requests[0]);
    ASSERT_TRUE(alone.ok()) << alone.status();
    check(0, *alone);
    auto each = engine_->AppendEach(absl::MakeConstSpan(requests).subspan(1));
    for (int layer = 1; layer < kLayers; ++layer) {
      ASSERT_TRUE(each[layer - 1].ok()) << each[layer - 1].status();
      check(layer, *each[layer - 1]);
    }
    ++position;
    expected.clear();
    for (int layer = 0; layer < kLayers; ++layer) {
      requests[layer].q = t.q.rows(position, position + 1);
      requests[layer].k = t.k.rows(position, position + 1);
      requests[layer].v = t.v.rows(position, position + 1);
      plain_requests[layer].q = requests[layer].q;
      plain_requests[layer].k = requests[layer].k;
      plain_requests[layer].v = requests[layer].v;
      auto out = engine_->Append(plain_requests[layer]);
      ASSERT_TRUE(out.ok()) << out.status();
      expected.push_back(*std::move(out));
    }
    auto batch = engine_->AppendBatch(requests);
    ASSERT_TRUE(batch.ok()) << batch.status();
    for (int layer = 0; layer < kLayers; ++layer) check(layer, (*batch)[layer]);
    ++position;
  }

  // A destination of the wrong size is INVALID_ARGUMENT and changes nothing.
  const SessionInfo before = Info(with_destination);
  std::vector<std::byte> small(kQHeads * kValueDim * 4 - 4);
  AppendRequest wrong = Request(with_destination, 0, t, position, position + 1);
  wrong.output_destination = absl::MakeSpan(small);
  EXPECT_EQ(engine_->Append(wrong).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Info(with_destination).layer_lengths, before.layer_lengths);
}

}  // namespace
}  // namespace attention
