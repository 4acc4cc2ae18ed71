// DecodeBatcher tests: concurrent steps share engine batches, steps of one
// (session, layer) keep their order and never share a batch, failures stay
// independent, atomic groups stay all-or-nothing, a full queue answers
// UNAVAILABLE, asynchronous submissions from one thread complete through
// their callbacks on the batch thread, and every result is bitwise what
// AttentionEngine::Append gives; a lone step allowed to run inline runs on
// the submitting thread when the batcher is idle, and queues otherwise.
// Nothing here is timed: batches are made deterministic by holding the first
// batch (in the on_batch observer) until the other steps queue.
#include "server/decode_batcher.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/cpu/cpu_backend.h"
#include "core/engine.h"
#include "gtest/gtest.h"
#include "tests/core/hold_at_first_check.h"

namespace attention::server {
namespace {

constexpr int kLayers = 2;
constexpr int kQHeads = 4;
constexpr int kKvHeads = 2;
constexpr int kDim = 16;
// A bound on waits that only a broken batcher reaches (nothing is timed).
constexpr absl::Duration kGenerous = absl::Seconds(60);

SessionSpec TestSpec() {
  SessionSpec spec;
  spec.num_layers = kLayers;
  spec.num_q_heads = kQHeads;
  spec.num_kv_heads = kKvHeads;
  spec.head_dim = kDim;
  spec.max_tokens = 1024;
  return spec;
}

std::unique_ptr<AttentionEngine> MakeEngine() {
  EngineOptions options;
  options.kv_cache_bytes = int64_t{16} << 20;
  options.kv_block_bytes = 4096;
  options.sessions.reap_interval = absl::ZeroDuration();
  auto engine =
      AttentionEngine::Create(std::make_unique<CpuBackend>(2), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? *std::move(engine) : nullptr;
}

// T tokens of q, k and v (float32) with owned bytes.
struct Tokens {
  std::vector<float> q, k, v;
  int64_t count = 0;

  Tokens(int64_t tokens, uint32_t seed) : count(tokens) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    q.resize(tokens * kQHeads * kDim);
    k.resize(tokens * kKvHeads * kDim);
    v.resize(tokens * kKvHeads * kDim);
    for (auto* values : {&q, &k, &v}) {
      for (float& x : *values) x = normal(rng);
    }
  }
};

TensorView View(const std::vector<float>& values, int64_t tokens, int heads) {
  return FloatView(values, {tokens, heads, kDim});
}

AppendRequest Request(const std::string& session, int layer,
                      const Tokens& tokens) {
  AppendRequest request;
  request.session_id = session;
  request.layer = layer;
  request.q = View(tokens.q, tokens.count, kQHeads);
  request.k = View(tokens.k, tokens.count, kKvHeads);
  request.v = View(tokens.v, tokens.count, kKvHeads);
  request.return_lse = true;
  return request;
}

AppendRequest DecodeRequest(const std::string& session, int layer,
                            const Tokens& tokens) {
  AppendRequest request = Request(session, layer, tokens);
  request.required_tokens = 1;
  return request;
}

std::vector<std::byte> Bytes(const Tensor& tensor) {
  return {tensor.data(), tensor.data() + tensor.size_bytes()};
}

// Records batch sizes; optionally holds the first batch until Release().
class BatchRecorder {
 public:
  explicit BatchRecorder(bool hold_first) : held_(hold_first) {}

  void OnBatch(int64_t size) {
    absl::MutexLock lock(&mu_);
    sizes_.push_back(size);
    batch_thread_ = std::this_thread::get_id();
    if (sizes_.size() == 1) {
      entered_ = true;
      mu_.Await(absl::Condition(
          +[](bool* held) { return !*held; }, &held_));
    }
  }
  // Blocks until the first batch is being held.
  void WaitUntilHolding() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&entered_));
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    held_ = false;
  }
  std::vector<int64_t> sizes() {
    absl::MutexLock lock(&mu_);
    return sizes_;
  }
  // The thread that ran the latest batch.
  std::thread::id batch_thread() {
    absl::MutexLock lock(&mu_);
    return batch_thread_;
  }
  // Whether `count` batches have run within `timeout` (a bound only for a
  // broken batcher, which would otherwise hang the test; nothing is timed).
  bool WaitForBatches(size_t count, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return sizes_.size() >= count;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }

 private:
  absl::Mutex mu_;
  bool held_ ABSL_GUARDED_BY(mu_);
  bool entered_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<int64_t> sizes_ ABSL_GUARDED_BY(mu_);
  std::thread::id batch_thread_ ABSL_GUARDED_BY(mu_);
};

// Polls until `steps` steps wait in the queue (no timing is asserted).
void WaitForQueued(const DecodeBatcher& batcher, int64_t steps) {
  while (batcher.queued_steps() < steps) absl::SleepFor(absl::Microseconds(50));
}

// One asynchronous submission's result.
template <class Result>
struct Answer {
  absl::Notification done;
  Result result;

  auto callback() {
    return [this](Result r) {
      result = std::move(r);
      done.Notify();
    };
  }
  bool Arrives() { return done.WaitForNotificationWithTimeout(kGenerous); }
};

class DecodeBatcherTest : public ::testing::Test {
 protected:
  // An engine run through a batcher, and a reference engine run with plain
  // Append calls; sessions are created in both, with the same history.
  void SetUp() override {
    engine_ = MakeEngine();
    reference_ = MakeEngine();
    ASSERT_NE(engine_, nullptr);
    ASSERT_NE(reference_, nullptr);
  }

  void MakeBatcher(DecodeBatcherOptions options, bool hold_first = true) {
    recorder_ = std::make_unique<BatchRecorder>(hold_first);
    options.on_batch = [recorder = recorder_.get()](int64_t size) {
      recorder->OnBatch(size);
    };
    batcher_ = std::make_unique<DecodeBatcher>(engine_.get(), options);
  }

  // Creates session `index` in both engines with `history` prefilled tokens
  // on every layer, owned by `tenant` (which must outlive the test).
  void AddSession(int history, const Tenant& tenant = DefaultTenant()) {
    const int index = static_cast<int>(ids_.size());
    auto id = engine_->CreateSession(TestSpec(), absl::ZeroDuration(), tenant);
    auto ref_id =
        reference_->CreateSession(TestSpec(), absl::ZeroDuration(), tenant);
    ASSERT_TRUE(id.ok() && ref_id.ok());
    ids_.push_back(id->session_id);
    reference_ids_.push_back(ref_id->session_id);
    for (int layer = 0; layer < kLayers; ++layer) {
      Tokens prompt(history, 1000 + index * 10 + layer);
      AppendRequest request = Request(ids_.back(), layer, prompt);
      request.tenant = &tenant;
      ASSERT_TRUE(engine_->Append(request).ok());
      request.session_id = reference_ids_.back();
      ASSERT_TRUE(reference_->Append(request).ok());
    }
  }

  // The reference engine's answer to the same step of session `index`.
  absl::StatusOr<AttentionOutput> ReferenceStep(int index, int layer,
                                                const Tokens& tokens) {
    return reference_->Append(
        DecodeRequest(reference_ids_[index], layer, tokens));
  }

  // Starts the thread whose step becomes the first (held) batch, and waits
  // until it is held.
  void StartHeldFirstBatch(int session) {
    first_tokens_ = std::make_unique<Tokens>(1, 7);
    first_thread_ = std::thread([this, session] {
      first_result_ =
          batcher_->Append(DecodeRequest(ids_[session], 0, *first_tokens_));
    });
    recorder_->WaitUntilHolding();
  }
  void FinishFirstBatch(int session) {
    first_thread_.join();
    ASSERT_TRUE(first_result_.ok()) << first_result_.status();
    auto expected = ReferenceStep(session, 0, *first_tokens_);
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(Bytes(first_result_->output), Bytes(expected->output));
  }

  std::unique_ptr<AttentionEngine> engine_;
  std::unique_ptr<AttentionEngine> reference_;
  std::unique_ptr<BatchRecorder> recorder_;
  std::unique_ptr<DecodeBatcher> batcher_;
  std::vector<std::string> ids_;
  std::vector<std::string> reference_ids_;

  std::unique_ptr<Tokens> first_tokens_;
  std::thread first_thread_;
  absl::StatusOr<AttentionOutput> first_result_;
};

TEST(DecodeBatcherOptionsTest, RejectsBadOptions) {
  DecodeBatcherOptions options;
  EXPECT_TRUE(DecodeBatcher::ValidateOptions(options).ok());
  options.batch_wait = absl::ZeroDuration();
  EXPECT_TRUE(DecodeBatcher::ValidateOptions(options).ok());
  options.batch_wait = -absl::Microseconds(1);
  EXPECT_EQ(DecodeBatcher::ValidateOptions(options).code(),
            absl::StatusCode::kInvalidArgument);
  options.batch_wait = absl::InfiniteDuration();  // would wait for ever
  EXPECT_EQ(DecodeBatcher::ValidateOptions(options).code(),
            absl::StatusCode::kInvalidArgument);
  options = DecodeBatcherOptions();
  options.max_batch_size = 0;
  EXPECT_EQ(DecodeBatcher::ValidateOptions(options).code(),
            absl::StatusCode::kInvalidArgument);
  options = DecodeBatcherOptions();
  options.max_queued_steps = 0;
  EXPECT_EQ(DecodeBatcher::ValidateOptions(options).code(),
            absl::StatusCode::kInvalidArgument);
  options = DecodeBatcherOptions();
  options.max_queued_bytes = -1;
  EXPECT_EQ(DecodeBatcher::ValidateOptions(options).code(),
            absl::StatusCode::kInvalidArgument);
  options = DecodeBatcherOptions();
  options.tenant_bounds.max_items = 0;
  EXPECT_EQ(DecodeBatcher::ValidateOptions(options).code(),
            absl::StatusCode::kInvalidArgument);
  options = DecodeBatcherOptions();
  options.tenant_bounds.max_bytes = -1;
  EXPECT_EQ(DecodeBatcher::ValidateOptions(options).code(),
            absl::StatusCode::kInvalidArgument);
  options = DecodeBatcherOptions();
  options.overlap_replies_step_time = absl::InfiniteDuration();
  EXPECT_TRUE(DecodeBatcher::ValidateOptions(options).ok());
  options.overlap_replies_step_time = -absl::Microseconds(1);
  EXPECT_EQ(DecodeBatcher::ValidateOptions(options).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(DecodeBatcherTest, ConcurrentStepsShareOneBatchAndMatchAppend) {
  // batch_wait 0: no waiting, yet whatever queued behind the running batch
  // runs as one batch.
  for (absl::Duration wait : {absl::ZeroDuration(), absl::Hours(1)}) {
    SCOPED_TRACE(absl::FormatDuration(wait));
    DecodeBatcherOptions options;
    options.batch_wait = wait;
    MakeBatcher(options);
    ids_.clear();
    reference_ids_.clear();
    constexpr int kSessions = 9;
    for (int s = 0; s < kSessions; ++s) AddSession(3 + 17 * s);

    StartHeldFirstBatch(0);
    // Sessions 1..8, both layers: 16 steps with distinct (session, layer).
    std::vector<std::unique_ptr<Tokens>> tokens;
    std::vector<absl::StatusOr<AttentionOutput>> results(2 * (kSessions - 1));
    std::vector<std::thread> threads;
    for (int s = 1; s < kSessions; ++s) {
      for (int layer = 0; layer < kLayers; ++layer) {
        const size_t i = tokens.size();
        tokens.push_back(std::make_unique<Tokens>(1, 50 + i));
        // The thread gets its tokens, not the vector the next push_back
        // may move.
        threads.emplace_back([&, s, layer, i, t = tokens.back().get()] {
          results[i] = batcher_->Append(DecodeRequest(ids_[s], layer, *t));
        });
      }
    }
    WaitForQueued(*batcher_, static_cast<int64_t>(tokens.size()));
    recorder_->Release();
    for (std::thread& thread : threads) thread.join();
    FinishFirstBatch(0);

    EXPECT_EQ(recorder_->sizes(),
              (std::vector<int64_t>{1, static_cast<int64_t>(tokens.size())}));
    size_t i = 0;
    for (int s = 1; s < kSessions; ++s) {
      for (int layer = 0; layer < kLayers; ++layer, ++i) {
        ASSERT_TRUE(results[i].ok()) << results[i].status();
        auto expected = ReferenceStep(s, layer, *tokens[i]);
        ASSERT_TRUE(expected.ok()) << expected.status();
        EXPECT_EQ(Bytes(results[i]->output), Bytes(expected->output));
        EXPECT_EQ(Bytes(*results[i]->lse), Bytes(*expected->lse));
        EXPECT_EQ(results[i]->position, expected->position);
      }
    }
    EXPECT_EQ(batcher_->queued_steps(), 0);
  }
}

TEST_F(DecodeBatcherTest, SameSessionLayerKeepsArrivalOrderInSeparateBatches) {
  DecodeBatcherOptions options;
  MakeBatcher(options);
  AddSession(10);  // 0: the held first batch
  AddSession(20);  // 1: three steps on layer 0, one on layer 1
  AddSession(30);  // 2: one step
  StartHeldFirstBatch(0);

  // Arrival order (each thread submits once the previous one queued):
  //   1/L0 #a, 2/L0, 1/L0 #b, 1/L1, 1/L0 #c
  struct Step {
    int session, layer;
  };
  const std::vector<Step> order = {{1, 0}, {2, 0}, {1, 0}, {1, 1}, {1, 0}};
  std::vector<std::unique_ptr<Tokens>> tokens;
  std::vector<absl::StatusOr<AttentionOutput>> results(order.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < order.size(); ++i) {
    tokens.push_back(std::make_unique<Tokens>(1, 300 + i));
    threads.emplace_back([&, i] {
      results[i] = batcher_->Append(
          DecodeRequest(ids_[order[i].session], order[i].layer, *tokens[i]));
    });
    WaitForQueued(*batcher_, static_cast<int64_t>(i + 1));
  }
  recorder_->Release();
  for (std::thread& thread : threads) thread.join();
  FinishFirstBatch(0);

  // {1/L0 #a, 2/L0, 1/L1}, then #b, then #c: a (session, layer) never twice
  // in a batch, and never overtaken.
  EXPECT_EQ(recorder_->sizes(), (std::vector<int64_t>{1, 3, 1, 1}));
  for (size_t i = 0; i < order.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    // The reference applies the steps in arrival order.
    auto expected = ReferenceStep(order[i].session, order[i].layer, *tokens[i]);
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(results[i]->position, expected->position) << i;
    EXPECT_EQ(Bytes(results[i]->output), Bytes(expected->output)) << i;
  }
  EXPECT_EQ(results[0]->position, 20);
  EXPECT_EQ(results[2]->position, 21);
  EXPECT_EQ(results[4]->position, 22);
}

TEST_F(DecodeBatcherTest, FailuresInABatchAreIndependent) {
  MakeBatcher(DecodeBatcherOptions());
  AddSession(5);
  AddSession(6);
  AddSession(7);
  AddSession(8);
  StartHeldFirstBatch(0);
  const auto lengths_before = engine_->GetSession(ids_[2])->layer_lengths;

  Tokens good(1, 11), overflow(1, 12), two_tokens(2, 13), good3(1, 14);
  std::fill(overflow.q.begin(), overflow.q.end(), 3e19f);
  std::fill(overflow.k.begin(), overflow.k.end(), 3e19f);
  std::vector<AppendRequest> requests = {
      DecodeRequest(ids_[1], 0, good),
      DecodeRequest(ids_[2], 0, overflow),  // logits overflow
      DecodeRequest("no-such-session", 0, good),
      DecodeRequest(ids_[2], 1, two_tokens),  // a decode step is 1 token
      DecodeRequest(ids_[3], 1, good3),
  };
  std::vector<absl::StatusOr<AttentionOutput>> results(requests.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back(
        [&, i] { results[i] = batcher_->Append(requests[i]); });
  }
  WaitForQueued(*batcher_, static_cast<int64_t>(requests.size()));
  recorder_->Release();
  for (std::thread& thread : threads) thread.join();
  FinishFirstBatch(0);

  EXPECT_EQ(recorder_->sizes(), (std::vector<int64_t>{1, 5}));
  ASSERT_TRUE(results[0].ok()) << results[0].status();
  EXPECT_EQ(results[1].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(results[2].status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(results[3].status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(results[4].ok()) << results[4].status();
  // The failures are what a lone Append reports, and change nothing.
  EXPECT_EQ(ReferenceStep(2, 0, overflow).status().code(),
            results[1].status().code());
  EXPECT_EQ(engine_->GetSession(ids_[2])->layer_lengths, lengths_before);
  auto expected1 = ReferenceStep(1, 0, good);
  auto expected3 = ReferenceStep(3, 1, good3);
  ASSERT_TRUE(expected1.ok() && expected3.ok());
  EXPECT_EQ(Bytes(results[0]->output), Bytes(expected1->output));
  EXPECT_EQ(Bytes(results[4]->output), Bytes(expected3->output));
}

TEST_F(DecodeBatcherTest, AtomicGroupsAreAllOrNothingAndKeepTheirPlace) {
  MakeBatcher(DecodeBatcherOptions());
  AddSession(5);  // 0: held first batch
  AddSession(6);  // 1
  AddSession(7);  // 2
  StartHeldFirstBatch(0);

  // Queue: 1/L0 step, group {1/L0, 2/L0}, bad group {2/L1, 1/L1 (2 tokens)},
  // then 1/L0 step. Independent steps may not overtake the groups on the
  // same (session, layer).
  Tokens before(1, 21), g1(1, 22), g2(1, 23), bad_ok(1, 24), bad(2, 25),
      after(1, 26);
  const std::vector<AppendRequest> group = {DecodeRequest(ids_[1], 0, g1),
                                            DecodeRequest(ids_[2], 0, g2)};
  const std::vector<AppendRequest> bad_group = {
      DecodeRequest(ids_[2], 1, bad_ok), DecodeRequest(ids_[1], 1, bad)};
  absl::StatusOr<AttentionOutput> before_result, after_result;
  absl::StatusOr<std::vector<AttentionOutput>> group_result, bad_result;
  std::vector<std::thread> threads;
  threads.emplace_back([&] {
    before_result = batcher_->Append(DecodeRequest(ids_[1], 0, before));
  });
  WaitForQueued(*batcher_, 1);
  threads.emplace_back([&] { group_result = batcher_->AppendAtomic(group); });
  WaitForQueued(*batcher_, 3);
  threads.emplace_back([&] { bad_result = batcher_->AppendAtomic(bad_group); });
  WaitForQueued(*batcher_, 5);
  threads.emplace_back([&] {
    after_result = batcher_->Append(DecodeRequest(ids_[1], 0, after));
  });
  WaitForQueued(*batcher_, 6);
  const auto lengths_before = engine_->GetSession(ids_[2])->layer_lengths;
  recorder_->Release();
  for (std::thread& thread : threads) thread.join();
  FinishFirstBatch(0);

  // held, {before}, group, bad group, {after}.
  EXPECT_EQ(recorder_->sizes(), (std::vector<int64_t>{1, 1, 2, 2, 1}));
  ASSERT_TRUE(before_result.ok()) << before_result.status();
  ASSERT_TRUE(group_result.ok()) << group_result.status();
  ASSERT_TRUE(after_result.ok()) << after_result.status();
  EXPECT_EQ(bad_result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(before_result->position, 6);
  EXPECT_EQ((*group_result)[0].position, 7);
  EXPECT_EQ(after_result->position, 8);
  // The bad group changed nothing, not even its valid step on session 2.
  EXPECT_EQ(engine_->GetSession(ids_[2])->layer_lengths[1], lengths_before[1]);
  EXPECT_EQ(engine_->GetSession(ids_[2])->layer_lengths[0], 8);

  // Bitwise equal to the reference applying the same steps in order.
  auto ref_before = ReferenceStep(1, 0, before);
  auto ref_group = reference_->AppendBatch(
      std::vector<AppendRequest>{DecodeRequest(reference_ids_[1], 0, g1),
                                 DecodeRequest(reference_ids_[2], 0, g2)});
  auto ref_after = ReferenceStep(1, 0, after);
  ASSERT_TRUE(ref_before.ok() && ref_group.ok() && ref_after.ok());
  EXPECT_EQ(Bytes(before_result->output), Bytes(ref_before->output));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(Bytes((*group_result)[i].output), Bytes((*ref_group)[i].output));
  }
  EXPECT_EQ(Bytes(after_result->output), Bytes(ref_after->output));
}

TEST_F(DecodeBatcherTest, MaxBatchSizeSplitsTheQueue) {
  DecodeBatcherOptions options;
  options.max_batch_size = 4;
  MakeBatcher(options);
  constexpr int kSessions = 11;
  for (int s = 0; s < kSessions; ++s) AddSession(4);
  StartHeldFirstBatch(0);
  std::vector<std::unique_ptr<Tokens>> tokens;
  std::vector<absl::StatusOr<AttentionOutput>> results(kSessions - 1);
  std::vector<std::thread> threads;
  for (int s = 1; s < kSessions; ++s) {
    tokens.push_back(std::make_unique<Tokens>(1, 400 + s));
    threads.emplace_back([&, s, t = tokens.back().get()] {
      results[s - 1] = batcher_->Append(DecodeRequest(ids_[s], 0, *t));
    });
  }
  WaitForQueued(*batcher_, kSessions - 1);
  recorder_->Release();
  for (std::thread& thread : threads) thread.join();
  FinishFirstBatch(0);
  EXPECT_EQ(recorder_->sizes(), (std::vector<int64_t>{1, 4, 4, 2}));
  for (int s = 1; s < kSessions; ++s) {
    ASSERT_TRUE(results[s - 1].ok()) << results[s - 1].status();
    auto expected = ReferenceStep(s, 0, *tokens[s - 1]);
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(Bytes(results[s - 1]->output), Bytes(expected->output));
  }
}

TEST_F(DecodeBatcherTest, FullQueueIsUnavailableAndAppliesNothing) {
  DecodeBatcherOptions options;
  options.max_queued_steps = 2;
  MakeBatcher(options);
  for (int s = 0; s < 4; ++s) AddSession(4);
  StartHeldFirstBatch(0);
  Tokens t1(1, 31), t2(1, 32), t3(1, 33);
  absl::StatusOr<AttentionOutput> r1, r2;
  std::thread a([&] { r1 = batcher_->Append(DecodeRequest(ids_[1], 0, t1)); });
  std::thread b([&] { r2 = batcher_->Append(DecodeRequest(ids_[2], 0, t2)); });
  WaitForQueued(*batcher_, 2);
  // A third step does not fit: refused at once, session 3 unchanged.
  auto refused = batcher_->Append(DecodeRequest(ids_[3], 0, t3));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(refused.status().message().empty());
  const std::vector<AppendRequest> group = {DecodeRequest(ids_[3], 1, t3)};
  EXPECT_EQ(batcher_->AppendAtomic(group).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(engine_->GetSession(ids_[3])->layer_lengths,
            (std::vector<int64_t>{4, 4}));
  recorder_->Release();
  a.join();
  b.join();
  FinishFirstBatch(0);
  EXPECT_TRUE(r1.ok()) << r1.status();
  EXPECT_TRUE(r2.ok()) << r2.status();

  // An empty queue accepts even a group larger than the limit.
  Tokens g(1, 34);
  const std::vector<AppendRequest> big = {DecodeRequest(ids_[1], 1, g),
                                          DecodeRequest(ids_[2], 1, g),
                                          DecodeRequest(ids_[3], 1, g)};
  auto accepted = batcher_->AppendAtomic(big);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_EQ(accepted->size(), 3u);
}

// A group of more steps than the queue bound never fits beside other
// steps: it is accepted while the queue is not full (not only when it is
// empty), so a busy server still runs it.
TEST_F(DecodeBatcherTest, AGroupLargerThanTheBoundWaitsBehindAQueueInUse) {
  DecodeBatcherOptions options;
  options.max_queued_steps = 2;
  MakeBatcher(options);
  for (int s = 0; s < 4; ++s) AddSession(4);
  StartHeldFirstBatch(0);
  Tokens t1(1, 35), g(1, 36);
  absl::StatusOr<AttentionOutput> r1;
  absl::StatusOr<std::vector<AttentionOutput>> big;
  std::thread a([&] { r1 = batcher_->Append(DecodeRequest(ids_[1], 0, t1)); });
  WaitForQueued(*batcher_, 1);
  std::atomic<bool> answered = false;
  std::thread b([&] {
    big = batcher_->AppendAtomic({DecodeRequest(ids_[1], 1, g),
                                  DecodeRequest(ids_[2], 1, g),
                                  DecodeRequest(ids_[3], 1, g)});
    answered = true;
  });
  while (batcher_->queued_steps() < 4 && !answered) {
    absl::SleepFor(absl::Microseconds(50));
  }
  EXPECT_FALSE(answered) << "refused: " << big.status();
  // Now the queue is full: a step is refused.
  auto refused = batcher_->Append(DecodeRequest(ids_[3], 0, t1));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("4 decode steps are already "
                                            "queued (limit 2)"),
            std::string::npos)
      << refused.status();
  recorder_->Release();
  a.join();
  b.join();
  FinishFirstBatch(0);
  EXPECT_TRUE(r1.ok()) << r1.status();
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->size(), 3u);
  EXPECT_EQ(engine_->GetSession(ids_[3])->layer_lengths,
            (std::vector<int64_t>{4, 5}));
}

// A tenant's share of the queue: past it that tenant's steps (and atomic
// groups) get RESOURCE_EXHAUSTED and change nothing, while another
// tenant's still queue; once its steps have run it queues again.
TEST_F(DecodeBatcherTest, ATenantPastItsShareIsRefusedAndOthersStillQueue) {
  const Tenant a{"a", {}};
  const Tenant b{"b", {}};
  DecodeBatcherOptions options;
  options.max_queued_steps = 8;
  options.tenant_bounds.max_items = 2;
  MakeBatcher(options);
  AddSession(4);  // 0: the held first batch's (the default tenant)
  for (int s = 1; s <= 3; ++s) AddSession(4, a);
  AddSession(4, b);  // 4
  StartHeldFirstBatch(0);
  Tokens t(1, 61);
  auto step = [&](int session, int layer, const Tenant& tenant) {
    AppendRequest request = DecodeRequest(ids_[session], layer, t);
    request.tenant = &tenant;
    return request;
  };
  const AppendRequest a1 = step(1, 0, a), a2 = step(2, 0, a),
                      a3 = step(3, 0, a), b1 = step(4, 0, b);
  const std::vector<AppendRequest> a_group = {step(3, 1, a)};
  Answer<absl::StatusOr<AttentionOutput>> r1, r2, refused, r3;
  Answer<absl::StatusOr<std::vector<AttentionOutput>>> refused_group;
  batcher_->AppendAsync(a1, r1.callback());
  batcher_->AppendAsync(a2, r2.callback());
  // Refusals are answered before the submission returns.
  batcher_->AppendAsync(a3, refused.callback());
  ASSERT_TRUE(refused.done.HasBeenNotified());
  EXPECT_EQ(refused.result.status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.result.status().message().find(
                "tenant 'a' already has 2 decode steps waiting"),
            std::string::npos)
      << refused.result.status();
  batcher_->AppendAtomicAsync(a_group, -1, refused_group.callback());
  ASSERT_TRUE(refused_group.done.HasBeenNotified());
  EXPECT_EQ(refused_group.result.status().code(),
            absl::StatusCode::kResourceExhausted);
  // The queue (8) has room, and tenant b has its own share.
  batcher_->AppendAsync(b1, r3.callback());
  EXPECT_FALSE(r3.done.HasBeenNotified()) << r3.result.status();
  EXPECT_EQ(batcher_->queued_steps(), 3);
  EXPECT_EQ(batcher_->queued_steps_of("a"), 2);
  EXPECT_EQ(batcher_->queued_steps_of("b"), 1);
  recorder_->Release();
  for (auto* answer : {&r1, &r2, &r3}) {
    ASSERT_TRUE(answer->Arrives());
    EXPECT_TRUE(answer->result.ok()) << answer->result.status();
  }
  FinishFirstBatch(0);
  EXPECT_EQ(engine_->GetSession(ids_[3], a)->layer_lengths,
            (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(engine_->GetSession(ids_[4], b)->layer_lengths,
            (std::vector<int64_t>{5, 4}));
  // Its steps ran: nothing of it is counted, and it queues again.
  EXPECT_EQ(batcher_->queued_steps_of("a"), 0);
  EXPECT_EQ(batcher_->queued_steps_of("b"), 0);
  auto accepted = batcher_->Append(a3);
  EXPECT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_EQ(engine_->GetSession(ids_[3], a)->layer_lengths,
            (std::vector<int64_t>{5, 4}));
}

TEST_F(DecodeBatcherTest, QueuedBytesAreBoundedToo) {
  Tokens t1(1, 41), t2(1, 42);
  const AppendRequest probe = DecodeRequest("any", 0, t1);
  const int64_t step_bytes =
      probe.q.size_bytes + probe.k.size_bytes + probe.v.size_bytes;
  DecodeBatcherOptions options;
  options.max_queued_bytes = step_bytes + step_bytes / 2;  // one step fits
  MakeBatcher(options);
  for (int s = 0; s < 3; ++s) AddSession(4);
  StartHeldFirstBatch(0);
  absl::StatusOr<AttentionOutput> r1;
  std::thread a([&] { r1 = batcher_->Append(DecodeRequest(ids_[1], 0, t1)); });
  WaitForQueued(*batcher_, 1);
  auto refused = batcher_->Append(DecodeRequest(ids_[2], 0, t2));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("--max_queued_decode_bytes"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ(engine_->GetSession(ids_[2])->layer_lengths,
            (std::vector<int64_t>{4, 4}));
  recorder_->Release();
  a.join();
  FinishFirstBatch(0);
  EXPECT_TRUE(r1.ok()) << r1.status();
  // The batch that ran gave its bytes back: the refused step now fits.
  EXPECT_EQ(batcher_->queued_steps(), 0);
  auto accepted = batcher_->Append(DecodeRequest(ids_[2], 0, t2));
  EXPECT_TRUE(accepted.ok()) << accepted.status();
}

// A bytes bound of 0 queues one step at a time: the step that finds the
// queue empty waits for the running batch, the next is refused.
TEST_F(DecodeBatcherTest, ZeroQueuedBytesQueueOneStepAtATime) {
  Tokens t1(1, 43), t2(1, 44);
  DecodeBatcherOptions options;
  options.max_queued_bytes = 0;
  MakeBatcher(options);
  for (int s = 0; s < 3; ++s) AddSession(4);
  StartHeldFirstBatch(0);
  absl::StatusOr<AttentionOutput> r1;
  std::thread a([&] { r1 = batcher_->Append(DecodeRequest(ids_[1], 0, t1)); });
  WaitForQueued(*batcher_, 1);
  auto refused = batcher_->Append(DecodeRequest(ids_[2], 0, t2));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  recorder_->Release();
  a.join();
  FinishFirstBatch(0);
  EXPECT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(engine_->GetSession(ids_[1])->layer_lengths,
            (std::vector<int64_t>{5, 4}));
  EXPECT_EQ(engine_->GetSession(ids_[2])->layer_lengths,
            (std::vector<int64_t>{4, 4}));
}

// A step whose message is larger than its tensors (unknown fields) counts
// its whole message; one that says less counts its tensors.
TEST_F(DecodeBatcherTest, QueuedBytesCountWholeMessagesWhenKnown) {
  Tokens t1(1, 51), t2(1, 52), t3(1, 53);
  const AppendRequest probe = DecodeRequest("any", 0, t1);
  const int64_t step_bytes =
      probe.q.size_bytes + probe.k.size_bytes + probe.v.size_bytes;
  DecodeBatcherOptions options;
  options.max_queued_bytes = 3 * step_bytes;
  MakeBatcher(options);
  for (int s = 0; s < 4; ++s) AddSession(4);
  StartHeldFirstBatch(0);
  absl::StatusOr<AttentionOutput> r1, r3;
  std::thread a([&] { r1 = batcher_->Append(DecodeRequest(ids_[1], 0, t1)); });
  WaitForQueued(*batcher_, 1);
  AppendRequest large = DecodeRequest(ids_[2], 0, t2);
  large.message_bytes = 3 * step_bytes;
  auto refused = batcher_->Append(large);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable)
      << refused.status();
  AppendRequest small = DecodeRequest(ids_[3], 0, t3);
  small.message_bytes = 1;
  std::thread b([&] { r3 = batcher_->Append(small); });
  WaitForQueued(*batcher_, 2);
  recorder_->Release();
  a.join();
  b.join();
  FinishFirstBatch(0);
  EXPECT_TRUE(r1.ok()) << r1.status();
  EXPECT_TRUE(r3.ok()) << r3.status();
  EXPECT_EQ(engine_->GetSession(ids_[2])->layer_lengths,
            (std::vector<int64_t>{4, 4}));
}

TEST_F(DecodeBatcherTest, ManyThreadsManyStepsMatchAppendBitwise) {
  // No held batch: whatever batching happens, every session's results are
  // the reference's, in its order.
  MakeBatcher(DecodeBatcherOptions(), /*hold_first=*/false);
  constexpr int kSessions = 6;
  constexpr int kSteps = 12;
  for (int s = 0; s < kSessions; ++s) AddSession(1 + 5 * s);
  std::vector<std::vector<std::unique_ptr<Tokens>>> tokens(kSessions);
  std::vector<std::vector<absl::StatusOr<AttentionOutput>>> results(kSessions);
  for (int s = 0; s < kSessions; ++s) {
    for (int i = 0; i < kSteps; ++i) {
      tokens[s].push_back(std::make_unique<Tokens>(1, 1000 * s + i));
    }
    results[s].resize(kSteps);
  }
  std::vector<std::thread> threads;
  for (int s = 0; s < kSessions; ++s) {
    // One thread per (session, layer), each step after the previous one, as
    // a Decode stream does; the two layers of a session run concurrently.
    for (int layer = 0; layer < kLayers; ++layer) {
      threads.emplace_back([&, s, layer] {
        for (int i = layer; i < kSteps; i += kLayers) {
          results[s][i] =
              batcher_->Append(DecodeRequest(ids_[s], layer, *tokens[s][i]));
        }
      });
    }
  }
  for (std::thread& thread : threads) thread.join();
  int64_t steps = 0;
  for (int64_t size : recorder_->sizes()) steps += size;
  EXPECT_EQ(steps, kSessions * kSteps);
  for (int s = 0; s < kSessions; ++s) {
    for (int i = 0; i < kSteps; ++i) {
      ASSERT_TRUE(results[s][i].ok()) << results[s][i].status();
      auto expected = ReferenceStep(s, i % kLayers, *tokens[s][i]);
      ASSERT_TRUE(expected.ok());
      EXPECT_EQ(Bytes(results[s][i]->output), Bytes(expected->output));
      EXPECT_EQ(results[s][i]->position, expected->position);
    }
  }
}

TEST_F(DecodeBatcherTest, OutputDestinationIsFilledInPlace) {
  MakeBatcher(DecodeBatcherOptions(), /*hold_first=*/false);
  AddSession(9);
  Tokens step(1, 77);
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    AppendRequest request = DecodeRequest(ids_[0], 0, step);
    request.output_dtype = dtype;
    std::vector<std::byte> destination(kQHeads * kDim * DTypeSize(dtype));
    request.output_destination = absl::MakeSpan(destination);
    auto result = batcher_->Append(request);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->output.size_bytes(), 0);
    AppendRequest reference = DecodeRequest(reference_ids_[0], 0, step);
    reference.output_dtype = dtype;
    auto expected = reference_->Append(reference);
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(destination, Bytes(expected->output));
  }
}

TEST_F(DecodeBatcherTest, AsyncStepsFromOneThreadShareABatchViaCallbacks) {
  MakeBatcher(DecodeBatcherOptions());
  constexpr int kSessions = 7;
  for (int s = 0; s < kSessions; ++s) AddSession(2 + 4 * s);
  StartHeldFirstBatch(0);
  // One thread submits every step (sessions 1..6 on layer 0, then session 1
  // twice more on layer 1) and an atomic group, without waiting.
  struct Step {
    int session, layer;
  };
  const std::vector<Step> order = {{1, 0}, {2, 0}, {3, 0}, {4, 0}, {5, 0},
                                   {6, 0}, {1, 1}, {1, 1}};
  std::vector<std::unique_ptr<Tokens>> tokens;
  std::vector<AppendRequest> requests;
  for (size_t i = 0; i < order.size(); ++i) {
    tokens.push_back(std::make_unique<Tokens>(1, 600 + i));
    requests.push_back(
        DecodeRequest(ids_[order[i].session], order[i].layer, *tokens[i]));
  }
  Tokens g(1, 650);
  const std::vector<AppendRequest> group = {DecodeRequest(ids_[2], 1, g),
                                            DecodeRequest(ids_[3], 1, g)};
  absl::Mutex mu;
  std::vector<absl::StatusOr<AttentionOutput>> results(order.size());
  absl::StatusOr<std::vector<AttentionOutput>> group_result;
  std::vector<std::thread::id> callback_threads;
  std::vector<int> answered;  // step indices; the group is order.size()
  int done = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    batcher_->AppendAsync(requests[i],
                          [&, i](absl::StatusOr<AttentionOutput> output) {
                            absl::MutexLock lock(&mu);
                            results[i] = std::move(output);
                            callback_threads.push_back(
                                std::this_thread::get_id());
                            answered.push_back(static_cast<int>(i));
                            ++done;
                          });
  }
  batcher_->AppendAtomicAsync(
      group, /*max_reply_bytes=*/-1,
      [&](absl::StatusOr<std::vector<AttentionOutput>> outputs) {
        absl::MutexLock lock(&mu);
        group_result = std::move(outputs);
        callback_threads.push_back(std::this_thread::get_id());
        answered.push_back(static_cast<int>(order.size()));
        ++done;
      });
  EXPECT_EQ(batcher_->queued_steps(),
            static_cast<int64_t>(requests.size() + group.size()));
  recorder_->Release();
  {
    absl::MutexLock lock(&mu);
    const int expected = static_cast<int>(requests.size()) + 1;
    auto all_done = [&] { return done == expected; };
    mu.Await(absl::Condition(&all_done));
  }
  FinishFirstBatch(0);
  // Held batch; 1/L0..6/L0 and the first 1/L1; the second 1/L1, which may
  // not share a batch with the first; the group (its own batch).
  EXPECT_EQ(recorder_->sizes(), (std::vector<int64_t>{1, 7, 1, 2}));
  // No callback ran on the submitting thread (they ran on the batch thread
  // or the reply thread), and they ran in batch order, each batch's in
  // queue order.
  for (std::thread::id id : callback_threads) {
    EXPECT_NE(id, std::this_thread::get_id());
  }
  EXPECT_EQ(answered, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  for (size_t i = 0; i < order.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    auto expected = ReferenceStep(order[i].session, order[i].layer, *tokens[i]);
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(results[i]->position, expected->position) << i;
    EXPECT_EQ(Bytes(results[i]->output), Bytes(expected->output)) << i;
  }
  ASSERT_TRUE(group_result.ok()) << group_result.status();
  auto ref_group = reference_->AppendBatch(
      std::vector<AppendRequest>{DecodeRequest(reference_ids_[2], 1, g),
                                 DecodeRequest(reference_ids_[3], 1, g)});
  ASSERT_TRUE(ref_group.ok());
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(Bytes((*group_result)[i].output), Bytes((*ref_group)[i].output));
  }
}

TEST_F(DecodeBatcherTest, ARefusedAsyncStepIsAnsweredOnTheSubmittingThread) {
  DecodeBatcherOptions options;
  options.max_queued_steps = 1;
  MakeBatcher(options);
  for (int s = 0; s < 3; ++s) AddSession(4);
  StartHeldFirstBatch(0);
  Tokens t1(1, 41), t2(1, 42);
  const AppendRequest queued = DecodeRequest(ids_[1], 0, t1);
  const AppendRequest refused = DecodeRequest(ids_[2], 0, t2);
  absl::Notification queued_done;
  absl::StatusOr<AttentionOutput> queued_result;
  batcher_->AppendAsync(queued, [&](absl::StatusOr<AttentionOutput> output) {
    queued_result = std::move(output);
    queued_done.Notify();
  });
  bool answered = false;
  std::thread::id answered_on;
  batcher_->AppendAsync(refused, [&](absl::StatusOr<AttentionOutput> output) {
    EXPECT_EQ(output.status().code(), absl::StatusCode::kUnavailable);
    answered = true;
    answered_on = std::this_thread::get_id();
  });
  EXPECT_TRUE(answered);
  EXPECT_EQ(answered_on, std::this_thread::get_id());
  recorder_->Release();
  queued_done.WaitForNotification();
  FinishFirstBatch(0);
  ASSERT_TRUE(queued_result.ok()) << queued_result.status();
  EXPECT_EQ(engine_->GetSession(ids_[2])->layer_lengths,
            (std::vector<int64_t>{4, 4}));
}

TEST_F(DecodeBatcherTest, ALoneStepOnAnIdleBatcherRunsOnTheSubmittingThread) {
  MakeBatcher(DecodeBatcherOptions(), /*hold_first=*/false);
  AddSession(5);
  // Two lone steps one after the other, as a lone DecodeStep caller sends
  // them: each runs before AppendAsync returns, on this thread.
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(step);
    Tokens tokens(1, 70 + step);
    const AppendRequest request = DecodeRequest(ids_[0], 0, tokens);
    BatchTimes times;
    bool answered = false;
    std::thread::id answered_on;
    absl::StatusOr<AttentionOutput> result;
    batcher_->AppendAsync(
        request,
        [&](absl::StatusOr<AttentionOutput> output) {
          result = std::move(output);
          answered = true;
          answered_on = std::this_thread::get_id();
        },
        &times, DecodeBatcher::RunInline::kWhenIdle);
    EXPECT_TRUE(answered);
    EXPECT_EQ(answered_on, std::this_thread::get_id());
    EXPECT_LE(times.start, times.end);
    ASSERT_TRUE(result.ok()) << result.status();
    auto expected = ReferenceStep(0, 0, tokens);
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(result->position, expected->position);
    EXPECT_EQ(Bytes(result->output), Bytes(expected->output));
  }
  EXPECT_EQ(recorder_->sizes(), (std::vector<int64_t>{1, 1}));
}

TEST_F(DecodeBatcherTest, InlineStepsQueueBehindARunningBatch) {
  MakeBatcher(DecodeBatcherOptions());
  for (int s = 0; s < 3; ++s) AddSession(3 + s);
  StartHeldFirstBatch(0);
  // A batch is running (held): steps that allow running inline queue, and
  // run together on the batch thread once it is released.
  Tokens t1(1, 81), t2(1, 82);
  const AppendRequest r1 = DecodeRequest(ids_[1], 0, t1);
  const AppendRequest r2 = DecodeRequest(ids_[2], 0, t2);
  absl::Mutex mu;
  int done = 0;
  std::vector<std::thread::id> threads;
  std::vector<absl::StatusOr<AttentionOutput>> results(2);
  for (int i = 0; i < 2; ++i) {
    batcher_->AppendAsync(
        i == 0 ? r1 : r2,
        [&, i](absl::StatusOr<AttentionOutput> output) {
          absl::MutexLock lock(&mu);
          results[i] = std::move(output);
          threads.push_back(std::this_thread::get_id());
          ++done;
        },
        nullptr, DecodeBatcher::RunInline::kWhenIdle);
  }
  EXPECT_EQ(batcher_->queued_steps(), 2);
  recorder_->Release();
  {
    absl::MutexLock lock(&mu);
    auto both = [&] { return done == 2; };
    mu.Await(absl::Condition(&both));
  }
  FinishFirstBatch(0);
  for (std::thread::id id : threads) EXPECT_NE(id, std::this_thread::get_id());
  // After that batch of two (concurrency seen), a step allowed inline still
  // goes through the batch thread.
  Tokens t3(1, 83);
  const AppendRequest r3 = DecodeRequest(ids_[1], 1, t3);
  absl::Notification third;
  std::thread::id third_on;
  absl::StatusOr<AttentionOutput> third_result;
  batcher_->AppendAsync(
      r3,
      [&](absl::StatusOr<AttentionOutput> output) {
        third_result = std::move(output);
        third_on = std::this_thread::get_id();
        third.Notify();
      },
      nullptr, DecodeBatcher::RunInline::kWhenIdle);
  third.WaitForNotification();
  EXPECT_NE(third_on, std::this_thread::get_id());
  EXPECT_EQ(recorder_->sizes(), (std::vector<int64_t>{1, 2, 1}));
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    auto expected = ReferenceStep(i + 1, 0, i == 0 ? t1 : t2);
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(Bytes(results[i]->output), Bytes(expected->output)) << i;
  }
  ASSERT_TRUE(third_result.ok()) << third_result.status();
  auto expected = ReferenceStep(1, 1, t3);
  ASSERT_TRUE(expected.ok());
  EXPECT_EQ(Bytes(third_result->output), Bytes(expected->output));
}

TEST_F(DecodeBatcherTest, TheNextBatchRunsWhileTheRepliesAreDelivered) {
  DecodeBatcherOptions options;
  options.overlap_replies_step_time = absl::ZeroDuration();  // however short
  MakeBatcher(options);
  for (int s = 0; s < 3; ++s) AddSession(3 + s);
  StartHeldFirstBatch(0);
  // Two steps of one (session, layer), and one of another session queued
  // behind the first: batches [1/L0, 2/L0] and [1/L0] after the held one.
  Tokens t1(1, 91), t2(1, 92), t3(1, 93);
  const std::vector<AppendRequest> requests = {
      DecodeRequest(ids_[1], 0, t1), DecodeRequest(ids_[2], 0, t2),
      DecodeRequest(ids_[1], 0, t3)};
  absl::Mutex mu;
  std::vector<int> answered;
  std::vector<std::thread::id> answered_on;
  std::vector<absl::StatusOr<AttentionOutput>> results(requests.size());
  bool next_batch_ran = false;
  for (size_t i = 0; i < requests.size(); ++i) {
    batcher_->AppendAsync(
        requests[i], [&, i](absl::StatusOr<AttentionOutput> output) {
          // The first reply waits for the next batch: it can only run if
          // that batch does not wait for the replies.
          if (i == 0) next_batch_ran = recorder_->WaitForBatches(3, kGenerous);
          absl::MutexLock lock(&mu);
          results[i] = std::move(output);
          answered.push_back(static_cast<int>(i));
          answered_on.push_back(std::this_thread::get_id());
        });
  }
  recorder_->Release();
  {
    absl::MutexLock lock(&mu);
    auto all = [&] { return answered.size() == requests.size(); };
    mu.Await(absl::Condition(&all));
  }
  FinishFirstBatch(0);
  EXPECT_TRUE(next_batch_ran);
  EXPECT_EQ(recorder_->sizes(), (std::vector<int64_t>{1, 2, 1}));
  // In batch order. The first batch's replies ran off the batch thread
  // (a step was waiting when it finished); the last one's may run on
  // either, once those are done.
  EXPECT_EQ(answered, (std::vector<int>{0, 1, 2}));
  EXPECT_NE(answered_on[0], recorder_->batch_thread());
  EXPECT_EQ(answered_on[1], answered_on[0]);
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
  }
  // The same bits as plain Append calls in the same order.
  const std::pair<int, const Tokens*> steps[] = {{1, &t1}, {2, &t2}, {1, &t3}};
  for (int i = 0; i < 3; ++i) {
    auto expected = ReferenceStep(steps[i].first, 0, *steps[i].second);
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(Bytes(results[i]->output), Bytes(expected->output)) << i;
  }
}

TEST_F(DecodeBatcherTest, ShortBatchesAnswerOnTheBatchThread) {
  DecodeBatcherOptions options;
  options.overlap_replies_step_time = absl::InfiniteDuration();  // never long
  MakeBatcher(options);
  for (int s = 0; s < 2; ++s) AddSession(3 + s);
  StartHeldFirstBatch(0);
  // Two steps of one (session, layer): two batches, the first finishing
  // while the second waits. Its batch is "short", so the batch thread
  // answers it itself before starting the next.
  Tokens t1(1, 95), t2(1, 96);
  const AppendRequest r1 = DecodeRequest(ids_[1], 0, t1);
  const AppendRequest r2 = DecodeRequest(ids_[1], 0, t2);
  absl::Mutex mu;
  std::vector<std::thread::id> answered_on;
  std::vector<int64_t> batches_seen;  // batches run when each was answered
  for (const AppendRequest* request : {&r1, &r2}) {
    batcher_->AppendAsync(*request, [&](absl::StatusOr<AttentionOutput> out) {
      EXPECT_TRUE(out.ok()) << out.status();
      const size_t batches = recorder_->sizes().size();
      absl::MutexLock lock(&mu);
      answered_on.push_back(std::this_thread::get_id());
      batches_seen.push_back(static_cast<int64_t>(batches));
    });
  }
  recorder_->Release();
  {
    absl::MutexLock lock(&mu);
    auto both = [&] { return answered_on.size() == 2; };
    mu.Await(absl::Condition(&both));
  }
  FinishFirstBatch(0);
  EXPECT_EQ(recorder_->sizes(), (std::vector<int64_t>{1, 1, 1}));
  for (std::thread::id id : answered_on) {
    EXPECT_EQ(id, recorder_->batch_thread());
  }
  // The first step was answered before the second's batch ran.
  EXPECT_EQ(batches_seen, (std::vector<int64_t>{2, 3}));
}

// Replies that fall behind hold the batch thread back instead of piling up
// answered steps outside the queue's bounds: while one batch's callbacks
// are stuck on the reply thread, the batch thread runs one more batch and
// then leaves the rest queued, so the queue fills and refuses new steps.
TEST_F(DecodeBatcherTest, StuckRepliesHoldBackTheBatchesAfterTheNext) {
  DecodeBatcherOptions options;
  options.overlap_replies_step_time = absl::ZeroDuration();  // however short
  options.max_queued_steps = 2;
  MakeBatcher(options);
  for (int s = 0; s < 3; ++s) AddSession(3 + s);
  StartHeldFirstBatch(0);
  // Four steps of one (session, layer) behind the held batch: four batches
  // of one, each handed to the reply thread (the next step waits).
  std::vector<Tokens> tokens;
  for (int i = 0; i < 4; ++i) tokens.emplace_back(1, 120 + i);
  std::vector<AppendRequest> requests;
  for (const Tokens& t : tokens) {
    requests.push_back(DecodeRequest(ids_[1], 0, t));
  }
  absl::Notification first_reply_started, release_first_reply;
  absl::Mutex mu;
  std::vector<absl::StatusOr<AttentionOutput>> results(requests.size());
  int answered = 0;
  for (size_t i = 0; i < 2; ++i) {
    batcher_->AppendAsync(requests[i],
                          [&, i](absl::StatusOr<AttentionOutput> output) {
                            if (i == 0) {
                              first_reply_started.Notify();
                              release_first_reply.WaitForNotification();
                            }
                            absl::MutexLock lock(&mu);
                            results[i] = std::move(output);
                            ++answered;
                          });
  }
  recorder_->Release();
  first_reply_started.WaitForNotification();
  // The batch after the stuck one runs (its callbacks wait behind)...
  ASSERT_TRUE(recorder_->WaitForBatches(3, kGenerous));
  for (size_t i = 2; i < requests.size(); ++i) {
    batcher_->AppendAsync(requests[i],
                          [&, i](absl::StatusOr<AttentionOutput> output) {
                            absl::MutexLock lock(&mu);
                            results[i] = std::move(output);
                            ++answered;
                          });
  }
  // ...and no batch after it (the wait only gives a batcher that would run
  // one the time to do so): the two steps stay queued, the queue is full
  // and a step of another session is refused, changing nothing.
  EXPECT_FALSE(recorder_->WaitForBatches(4, absl::Milliseconds(200)));
  EXPECT_EQ(batcher_->queued_steps(), 2);
  Tokens other(1, 130);
  auto refused = batcher_->Append(DecodeRequest(ids_[2], 0, other));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(engine_->GetSession(ids_[2])->layer_lengths,
            (std::vector<int64_t>{5, 5}));
  EXPECT_EQ(recorder_->sizes().size(), 3u);
  release_first_reply.Notify();
  {
    absl::MutexLock lock(&mu);
    auto all = [&] { return answered == static_cast<int>(requests.size()); };
    mu.Await(absl::Condition(&all));
  }
  FinishFirstBatch(0);
  EXPECT_EQ(recorder_->sizes(), (std::vector<int64_t>{1, 1, 1, 1, 1}));
  // In order and the same bits as plain Append calls.
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    auto expected = ReferenceStep(1, 0, tokens[i]);
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(Bytes(results[i]->output), Bytes(expected->output)) << i;
  }
}

TEST_F(DecodeBatcherTest, StepsOnABusySessionWaitWithoutHoldingUpOthers) {
  DecodeBatcherOptions options;
  // Bounded (not reached), so that the tenant's count follows the steps
  // sent back and forth too.
  options.tenant_bounds.max_items = 100;
  MakeBatcher(options, /*hold_first=*/false);
  AddSession(5);  // 0: busy with a long prefill of its layer 1
  AddSession(6);  // 1
  testing::HoldAtFirstCheck gate;
  Tokens prompt(3, 140);
  AppendRequest prefill = Request(ids_[0], 1, prompt);
  prefill.control = &gate;
  absl::Status prefill_status;
  std::thread prefill_thread(
      [&] { prefill_status = engine_->Append(prefill).status(); });
  gate.WaitUntilHeld();

  // Two steps of session 0 (in this order), a step of session 1, an atomic
  // group on session 1 alone and one on both sessions.
  Tokens a1(1, 141), a2(1, 142), b(1, 143), free1(1, 144), busy0(1, 145),
      busy1(1, 146);
  const AppendRequest ra1 = DecodeRequest(ids_[0], 0, a1);
  const AppendRequest ra2 = DecodeRequest(ids_[0], 0, a2);
  const AppendRequest rb = DecodeRequest(ids_[1], 0, b);
  const std::vector<AppendRequest> free_group = {
      DecodeRequest(ids_[1], 1, free1)};
  const std::vector<AppendRequest> busy_group = {
      DecodeRequest(ids_[0], 1, busy0), DecodeRequest(ids_[1], 0, busy1)};
  Answer<absl::StatusOr<AttentionOutput>> step1, step2, other;
  Answer<absl::StatusOr<std::vector<AttentionOutput>>> free_answer, busy_answer;
  // The first finds the batcher idle: it runs on its submitting thread,
  // which must not wait for the prefill either.
  absl::Notification submitted;
  std::thread submitter([&] {
    batcher_->AppendAsync(ra1, step1.callback(), nullptr,
                          DecodeBatcher::RunInline::kWhenIdle);
    submitted.Notify();
  });
  const bool inline_returned =
      submitted.WaitForNotificationWithTimeout(kGenerous);
  EXPECT_TRUE(inline_returned);
  if (!inline_returned) {
    gate.Release();
    submitter.join();
    prefill_thread.join();
    batcher_.reset();  // answers what is queued while it is still here
    return;
  }
  submitter.join();
  batcher_->AppendAsync(ra2, step2.callback());
  batcher_->AppendAsync(rb, other.callback());
  batcher_->AppendAtomicAsync(free_group, -1, free_answer.callback());
  batcher_->AppendAtomicAsync(busy_group, -1, busy_answer.callback());

  // What does not involve session 0 runs while the prefill holds it.
  const bool others_ran = other.Arrives() && free_answer.Arrives();
  EXPECT_TRUE(others_ran);
  EXPECT_FALSE(step1.done.HasBeenNotified());
  EXPECT_FALSE(step2.done.HasBeenNotified());
  EXPECT_FALSE(busy_answer.done.HasBeenNotified());
  EXPECT_EQ(engine_->GetSession(ids_[1])->layer_lengths,
            (std::vector<int64_t>{7, 7}));
  gate.Release();
  prefill_thread.join();
  const bool rest_ran =
      step1.Arrives() && step2.Arrives() && busy_answer.Arrives();
  // Every step sent back was counted once more, and given back once more.
  EXPECT_EQ(batcher_->queued_steps_of(kDefaultTenantName), 0);
  batcher_.reset();  // nothing queued may outlive this test's requests
  ASSERT_TRUE(prefill_status.ok()) << prefill_status;
  ASSERT_TRUE(rest_ran);

  // Each in its place, the same bits as plain Append calls in that order.
  ASSERT_TRUE(other.result.ok()) << other.result.status();
  ASSERT_TRUE(free_answer.result.ok()) << free_answer.result.status();
  ASSERT_TRUE(step1.result.ok()) << step1.result.status();
  ASSERT_TRUE(step2.result.ok()) << step2.result.status();
  ASSERT_TRUE(busy_answer.result.ok()) << busy_answer.result.status();
  EXPECT_EQ(step1.result->position, 5);
  EXPECT_EQ(step2.result->position, 6);
  EXPECT_EQ((*busy_answer.result)[0].position, 8);
  EXPECT_EQ((*busy_answer.result)[1].position, 7);
  ASSERT_TRUE(reference_->Append(Request(reference_ids_[0], 1, prompt)).ok());
  auto ref1 = ReferenceStep(0, 0, a1);
  auto ref2 = ReferenceStep(0, 0, a2);
  auto ref_other = ReferenceStep(1, 0, b);
  auto ref_free = ReferenceStep(1, 1, free1);
  auto ref_busy = reference_->AppendBatch(
      std::vector<AppendRequest>{DecodeRequest(reference_ids_[0], 1, busy0),
                                 DecodeRequest(reference_ids_[1], 0, busy1)});
  ASSERT_TRUE(ref1.ok() && ref2.ok() && ref_other.ok() && ref_free.ok() &&
              ref_busy.ok());
  EXPECT_EQ(Bytes(step1.result->output), Bytes(ref1->output));
  EXPECT_EQ(Bytes(step2.result->output), Bytes(ref2->output));
  EXPECT_EQ(Bytes(other.result->output), Bytes(ref_other->output));
  EXPECT_EQ(Bytes((*free_answer.result)[0].output), Bytes(ref_free->output));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(Bytes((*busy_answer.result)[i].output),
              Bytes((*ref_busy)[i].output))
        << i;
  }
}

}  // namespace
}  // namespace attention::server
