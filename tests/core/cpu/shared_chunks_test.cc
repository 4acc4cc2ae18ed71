// Forks of one prompt decoded in one batch share their common chunks
// (core/cpu/shared_chunks.h). Sharing must never change a bit: every step
// must give exactly what it gives decoded alone, and a failing step must
// fail alone, with the error it gets alone.
#include "core/cpu/shared_chunks.h"

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/cpu/cpu_backend.h"
#include "core/engine.h"
#include "gtest/gtest.h"
#include "tests/core/test_tensors.h"

namespace attention {
namespace {

using testing::HostTensor;
using testing::RandomTensor;
using testing::ToFloats;

constexpr int kQHeads = 8;
constexpr int kKvHeads = 2;
constexpr int64_t kPrompt = 1100;  // two complete 512-key chunks and a tail
constexpr int kForks = 20;         // more than one joint unit holds

struct Case {
  DType kv_dtype;
  int head_dim;
  int value_dim;
};

SessionSpec ForkSpec(const Case& c) {
  SessionSpec spec;
  spec.num_q_heads = kQHeads;
  spec.num_kv_heads = kKvHeads;
  spec.head_dim = c.head_dim;
  spec.value_dim = c.value_dim;
  spec.kv_dtype = c.kv_dtype;
  spec.max_tokens = 4096;
  LayerSpec full;
  // At position ~1100 this window sees the sinks and keys from ~400 on:
  // chunk 0 only in part (not shared), chunk 1 whole (shared).
  LayerSpec window;
  window.window = 700;
  window.num_sink_tokens = 4;
  LayerSpec sinks;
  sinks.sink_logits = {0.5f, -1.0f, 2.0f, 0.0f, 1.0f, -0.5f, 0.25f, 3.0f};
  spec.layers = {full, window, sinks};
  spec.num_layers = static_cast<int>(spec.layers.size());
  return spec;
}

// One token's q, k, v for every layer.
struct Step {
  std::vector<HostTensor> q, k, v;
};

class SharedChunksTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    EngineOptions options;
    options.kv_cache_bytes = int64_t{256} << 20;
    options.kv_block_bytes = 16 << 10;
    options.sessions.reap_interval = absl::ZeroDuration();
    auto backend = std::make_unique<CpuBackend>(2);
    backend_ = backend.get();
    auto engine = AttentionEngine::Create(std::move(backend), options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    spec_ = ForkSpec(GetParam());
  }

  int layers() const { return spec_.num_layers; }

  std::string Prompt() {
    auto info = engine_->CreateSession(spec_, absl::ZeroDuration());
    EXPECT_TRUE(info.ok()) << info.status();
    const Case c = GetParam();
    for (int layer = 0; layer < layers(); ++layer) {
      // In two chunks of prefill, as a client might send it.
      HostTensor q = RandomTensor({kPrompt, kQHeads, c.head_dim}, rng_);
      HostTensor k = RandomTensor({kPrompt, kKvHeads, c.head_dim}, rng_);
      HostTensor v = RandomTensor({kPrompt, kKvHeads, c.value_dim}, rng_);
      for (auto [begin, end] :
           {std::pair<int64_t, int64_t>{0, 700}, {700, kPrompt}}) {
        AppendRequest r;
        r.session_id = info->session_id;
        r.layer = layer;
        r.q = q.rows(begin, end);
        r.k = k.rows(begin, end);
        r.v = v.rows(begin, end);
        EXPECT_TRUE(engine_->Append(r).ok());
      }
    }
    return info->session_id;
  }

  std::vector<std::string> Forks(const std::string& base, int n) {
    std::vector<std::string> ids;
    for (int i = 0; i < n; ++i) {
      auto fork = engine_->ForkSession(base);
      EXPECT_TRUE(fork.ok()) << fork.status();
      ids.push_back(fork->session_id);
    }
    return ids;
  }

  // A random step; fork i's queries are float16 for even i (queries of any
  // dtype may share a chunk).
  Step RandomStep(int i) {
    const Case c = GetParam();
    Step step;
    for (int layer = 0; layer < layers(); ++layer) {
      step.q.push_back(
          RandomTensor({1, kQHeads, c.head_dim}, rng_,
                       i % 2 == 0 ? DType::kFloat16 : DType::kFloat32));
      step.k.push_back(RandomTensor({1, kKvHeads, c.head_dim}, rng_));
      step.v.push_back(RandomTensor({1, kKvHeads, c.value_dim}, rng_));
    }
    return step;
  }

  static AppendRequest Request(const std::string& id, int layer,
                               const Step& step) {
    AppendRequest r;
    r.session_id = id;
    r.layer = layer;
    r.q = step.q[layer].view();
    r.k = step.k[layer].view();
    r.v = step.v[layer].view();
    r.return_lse = true;
    r.required_tokens = 1;
    return r;
  }

  static void ExpectSame(const absl::StatusOr<AttentionOutput>& batched,
                         const absl::StatusOr<AttentionOutput>& alone,
                         const std::string& what) {
    ASSERT_EQ(batched.ok(), alone.ok())
        << what << ": " << batched.status() << " vs " << alone.status();
    if (!alone.ok()) {
      EXPECT_EQ(batched.status(), alone.status()) << what;
      return;
    }
    EXPECT_EQ(batched->position, alone->position) << what;
    EXPECT_EQ(ToFloats(batched->output), ToFloats(alone->output)) << what;
    ASSERT_TRUE(batched->lse.has_value() && alone->lse.has_value());
    EXPECT_EQ(ToFloats(*batched->lse), ToFloats(*alone->lse)) << what;
  }

  std::mt19937 rng_{7};
  CpuBackend* backend_ = nullptr;
  std::unique_ptr<AttentionEngine> engine_;
  SessionSpec spec_;
};

TEST_P(SharedChunksTest, ForksDecodedTogetherMatchForksDecodedAlone) {
  const std::string base = Prompt();
  const std::vector<std::string> together = Forks(base, kForks);
  const std::vector<std::string> alone = Forks(base, kForks);
  // An unrelated session in the same batches.
  const std::string other = Prompt();

  const int64_t shared_before = backend_->shared_chunk_computations();
  for (int s = 0; s < 3; ++s) {
    std::vector<Step> steps;
    for (int i = 0; i <= kForks; ++i) steps.push_back(RandomStep(i));
    std::vector<AppendRequest> batch;
    for (int layer = 0; layer < layers(); ++layer) {
      for (int i = 0; i < kForks; ++i) {
        batch.push_back(Request(together[i], layer, steps[i]));
      }
      batch.push_back(Request(other, layer, steps[kForks]));
    }
    const std::vector<absl::StatusOr<AttentionOutput>> batched =
        engine_->AppendEach(batch);
    ASSERT_EQ(batched.size(), batch.size());
    size_t b = 0;
    for (int layer = 0; layer < layers(); ++layer) {
      for (int i = 0; i < kForks; ++i, ++b) {
        ExpectSame(batched[b],
                   engine_->Append(Request(alone[i], layer, steps[i])),
                   "step " + std::to_string(s) + " layer " +
                       std::to_string(layer) + " fork " + std::to_string(i));
      }
      ASSERT_TRUE(batched[b++].ok());
    }
  }
  // Sharing did happen: per step, layer and KV head at least the chunks
  // every fork sees whole.
  EXPECT_GE(backend_->shared_chunk_computations() - shared_before,
            3 * layers() * kKvHeads);
  EXPECT_EQ(engine_->stats().shared_kv_chunks_total,
            backend_->shared_chunk_computations());
}

TEST_P(SharedChunksTest, AFailingForkFailsAloneWithItsOwnError) {
  const std::string base = Prompt();
  const std::vector<std::string> together = Forks(base, 6);
  const std::vector<std::string> alone = Forks(base, 6);
  std::vector<Step> steps;
  for (int i = 0; i < 6; ++i) steps.push_back(RandomStep(1));  // float32 q
  // Fork 3's queries make a logit overflow float32.
  for (int layer = 0; layer < layers(); ++layer) {
    HostTensor& q = steps[3].q[layer];
    std::vector<float> huge(q.values.size(), 3e38f);
    std::memcpy(q.bytes.data(), huge.data(), huge.size() * sizeof(float));
  }
  std::vector<AppendRequest> batch;
  for (int i = 0; i < 6; ++i)
    batch.push_back(Request(together[i], 0, steps[i]));
  const std::vector<absl::StatusOr<AttentionOutput>> batched =
      engine_->AppendEach(batch);
  for (int i = 0; i < 6; ++i) {
    ExpectSame(batched[i], engine_->Append(Request(alone[i], 0, steps[i])),
               "fork " + std::to_string(i));
  }
  EXPECT_EQ(batched[3].status().code(), absl::StatusCode::kInvalidArgument);
}

// So many forks of a wide history decoded together that sharing every
// chunk would keep more chunk states than a call may (each sharing unit
// keeps one per chunk): the forks past the bound compute alone, and every
// result is still what the fork gives decoded alone.
TEST(SharedChunksBoundTest, ForksPastTheChunkStateBoundComputeAlone) {
  constexpr int kHeads = 64, kDim = 16, kValueDim = 512;
  constexpr int64_t kHistory = 1024;  // two whole chunks
  constexpr int kManyForks = 1100;    // 2 x 64 x 514 floats each: ~72M
  EngineOptions options;
  options.kv_cache_bytes = int64_t{256} << 20;
  options.kv_block_bytes = 16 << 10;
  options.sessions.reap_interval = absl::ZeroDuration();
  auto backend = std::make_unique<CpuBackend>(2);
  CpuBackend* backend_ptr = backend.get();
  auto engine = AttentionEngine::Create(std::move(backend), options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  SessionSpec spec;
  spec.num_q_heads = kHeads;
  spec.num_kv_heads = 1;
  spec.head_dim = kDim;
  spec.value_dim = kValueDim;
  spec.max_tokens = 2048;
  spec.layers = {LayerSpec{}};
  spec.num_layers = 1;
  std::mt19937 rng(3);
  auto info = (*engine)->CreateSession(spec, absl::ZeroDuration());
  ASSERT_TRUE(info.ok()) << info.status();
  for (int64_t begin = 0; begin < kHistory; begin += 256) {
    HostTensor q = RandomTensor({256, kHeads, kDim}, rng);
    HostTensor k = RandomTensor({256, 1, kDim}, rng);
    HostTensor v = RandomTensor({256, 1, kValueDim}, rng);
    AppendRequest r;
    r.session_id = info->session_id;
    r.q = q.view();
    r.k = k.view();
    r.v = v.view();
    ASSERT_TRUE((*engine)->Append(r).ok());
  }
  std::vector<std::string> forks;
  for (int i = 0; i < kManyForks + 2; ++i) {
    auto fork = (*engine)->ForkSession(info->session_id);
    ASSERT_TRUE(fork.ok()) << fork.status();
    forks.push_back(fork->session_id);
  }
  HostTensor q = RandomTensor({1, kHeads, kDim}, rng);
  HostTensor k = RandomTensor({1, 1, kDim}, rng);
  HostTensor v = RandomTensor({1, 1, kValueDim}, rng);
  auto step = [&](const std::string& id) {
    AppendRequest r;
    r.session_id = id;
    r.q = q.view();
    r.k = k.view();
    r.v = v.view();
    r.required_tokens = 1;
    return r;
  };
  std::vector<AppendRequest> batch;
  for (int i = 0; i < kManyForks; ++i) batch.push_back(step(forks[i]));
  const int64_t shared_before = backend_ptr->shared_chunk_computations();
  const std::vector<absl::StatusOr<AttentionOutput>> batched =
      (*engine)->AppendEach(batch);
  EXPECT_GT(backend_ptr->shared_chunk_computations(), shared_before);
  // The same step on two spare forks, alone: every fork's result.
  for (int spare : {kManyForks, kManyForks + 1}) {
    auto alone = (*engine)->Append(step(forks[spare]));
    ASSERT_TRUE(alone.ok()) << alone.status();
    for (int i : {0, 1, kManyForks / 2, kManyForks - 2, kManyForks - 1}) {
      ASSERT_TRUE(batched[i].ok()) << batched[i].status();
      EXPECT_EQ(ToFloats(batched[i]->output), ToFloats(alone->output))
          << "fork " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(KvTypes, SharedChunksTest,
                         ::testing::Values(Case{DType::kFloat32, 64, 64},
                                           Case{DType::kFloat16, 64, 64},
                                           Case{DType::kBFloat16, 64, 64},
                                           Case{DType::kFloat16, 40,
                                                24}),  // padded rows
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(DTypeName(info.param.kv_dtype)) +
                                  "_d" + std::to_string(info.param.head_dim) +
                                  "_v" + std::to_string(info.param.value_dim);
                         });

}  // namespace
}  // namespace attention
