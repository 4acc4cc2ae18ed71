// What the callback-API serving path (server/decode_stream_reactor.h,
// server/append_call.h, the DecodeBatcher's completion callbacks) could
// break: order within streams that interleave sessions, a step withdrawn by
// its deadline while queued, drain with many open streams, hundreds of
// streams without a thread each, and BatchDecode's all-or-nothing. Every
// result is checked bitwise against the same steps sent one DecodeStep at a
// time to twin sessions. Nothing is timed: a batch is held (in the
// on_decode_batch observer) where the order of events matters.
#include <dirent.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

// Holds the server's batch thread inside the on_decode_batch observer of a
// batch while armed, until Release.
class BatchGate {
 public:
  void Arm() {
    absl::MutexLock lock(&mu_);
    armed_ = true;
    holding_ = false;
  }
  void OnBatch() {
    absl::MutexLock lock(&mu_);
    if (!armed_) return;
    holding_ = true;
    mu_.Await(absl::Condition(
        +[](bool* armed) { return !*armed; }, &armed_));
    holding_ = false;
  }
  void WaitUntilHolding() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&holding_));
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    armed_ = false;
  }

 private:
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  bool holding_ ABSL_GUARDED_BY(mu_) = false;
};

// Threads of this process now (/proc/self/task).
int ThreadCount() {
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  int count = 0;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count;
}

class CallbackServingTest : public ::testing::Test {
 protected:
  void Start(server::ServerOptions options = TestServerOptions()) {
    options.on_decode_batch = [this](int64_t) { gate_.OnBatch(); };
    auto server = StartTestServer(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  client::AttentionClient& client() { return *server_->client; }

  // A session and its twin with the same `prompt` tokens on every layer.
  struct Twins {
    std::unique_ptr<client::SessionHandle> served, reference;
  };
  Twins MakeTwins(const v1::SessionSpec& spec, int64_t prompt, uint32_t seed) {
    Twins twins;
    auto a = client().OpenSession(spec);
    auto b = client().OpenSession(spec);
    EXPECT_TRUE(a.ok() && b.ok());
    if (!a.ok() || !b.ok()) return twins;
    twins.served = std::make_unique<client::SessionHandle>(*a);
    twins.reference = std::make_unique<client::SessionHandle>(*b);
    for (int layer = 0; layer < spec.num_layers(); ++layer) {
      const Tokens tokens = RandomTokens(a->spec(), prompt, seed + layer);
      for (client::SessionHandle* s :
           {twins.served.get(), twins.reference.get()}) {
        EXPECT_TRUE(s->Prefill(layer, tokens.q_rows(0, prompt),
                               tokens.k_rows(0, prompt),
                               tokens.v_rows(0, prompt))
                        .ok());
      }
    }
    return twins;
  }

  BatchGate gate_;
  std::unique_ptr<TestServer> server_;
};

// One step of a stream's script: which of its sessions, which layer, and
// the token.
struct ScriptStep {
  int session;
  int layer;
  Tokens token;
};

TEST_F(CallbackServingTest, StreamsInterleavingSessionsKeepTheirOrderBitwise) {
  Start();
  const v1::SessionSpec spec = MakeSpec(2, 4, 2, 16);
  constexpr int kStreams = 8;
  constexpr int kSessionsPerStream = 3;
  constexpr int kSteps = 18;
  std::vector<std::vector<Twins>> twins(kStreams);
  std::vector<std::vector<ScriptStep>> scripts(kStreams);
  for (int s = 0; s < kStreams; ++s) {
    for (int i = 0; i < kSessionsPerStream; ++i) {
      twins[s].push_back(MakeTwins(spec, 5 + 3 * i + s, 100 * s + 10 * i));
      ASSERT_NE(twins[s].back().served, nullptr);
    }
    // Sessions and layers interleaved; some (session, layer) twice in a
    // row, so that consecutive steps of one stream hit the same KV.
    for (int t = 0; t < kSteps; ++t) {
      const int session = (t / 2 + t % 3) % kSessionsPerStream;
      const int layer = (t / 3) % 2;
      scripts[s].push_back(
          {session, layer,
           RandomTokens(twins[s][0].served->spec(), 1, 5000 + 97 * s + t)});
    }
  }
  std::vector<std::vector<v1::AttentionResult>> results(kStreams);
  std::vector<absl::Status> statuses(kStreams);
  std::vector<std::thread> threads;
  // Each stream keeps up to kWindow steps written ahead of their results,
  // so that several of its steps (some on one session) are in flight at
  // once and their order is the stream's to keep.
  constexpr int kWindow = 4;
  for (int s = 0; s < kStreams; ++s) {
    threads.emplace_back([&, s] {
      auto stream = client().OpenDecodeStream();
      const int total = static_cast<int>(scripts[s].size());
      int written = 0;
      while (static_cast<int>(results[s].size()) < total) {
        while (written < total &&
               written - static_cast<int>(results[s].size()) < kWindow) {
          const ScriptStep& step = scripts[s][written];
          auto request = twins[s][step.session].served->MakeDecodeRequest(
              step.layer, step.token.q_rows(0, 1), step.token.k_rows(0, 1),
              step.token.v_rows(0, 1));
          if (!request.ok()) {
            statuses[s] = request.status();
            return;
          }
          // False once the stream has ended: the Read below says why.
          if (!stream->Write(*request)) break;
          ++written;
        }
        auto result = stream->Read();
        if (!result.ok()) {
          statuses[s] = result.status();
          return;
        }
        results[s].push_back(*std::move(result));
      }
      stream->WritesDone();
      statuses[s] = stream->Finish();
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int s = 0; s < kStreams; ++s) {
    ATTN_ASSERT_OK(statuses[s]);
    ASSERT_EQ(results[s].size(), scripts[s].size());
    for (size_t t = 0; t < scripts[s].size(); ++t) {
      const ScriptStep& step = scripts[s][t];
      auto expected = twins[s][step.session].reference->DecodeStep(
          step.layer, step.token.q_rows(0, 1), step.token.k_rows(0, 1),
          step.token.v_rows(0, 1));
      ATTN_ASSERT_OK(expected);
      EXPECT_EQ(results[s][t].position(), expected->position())
          << "stream " << s << " step " << t;
      EXPECT_EQ(results[s][t].output().data(), expected->output().data())
          << "stream " << s << " step " << t;
    }
  }
}

TEST_F(CallbackServingTest, AStepPastItsDeadlineWhileQueuedChangesNothing) {
  Start();
  const v1::SessionSpec spec = MakeSpec(1, 4, 2, 16);
  Twins target = MakeTwins(spec, 9, 1);
  Twins blocker = MakeTwins(spec, 9, 2);
  ASSERT_NE(target.served, nullptr);
  ASSERT_NE(blocker.served, nullptr);
  const Tokens tokens = RandomTokens(target.served->spec(), 3, 3);
  auto step = [&](int t) {
    return target.served->MakeDecodeRequest(0, tokens.q_rows(t, 1),
                                            tokens.k_rows(t, 1),
                                            tokens.v_rows(t, 1));
  };

  grpc::ClientContext context;
  // Room for the first step and for queueing the second before it, even
  // in a sanitizer build on a slow machine (the test waits it out).
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  context.set_deadline(absl::ToChronoTime(deadline));
  auto stream = client().stub()->Decode(&context);
  v1::AttentionResult result;
  auto first = step(0);
  ATTN_ASSERT_OK(first);
  ASSERT_TRUE(stream->Write(*first));
  ASSERT_TRUE(stream->Read(&result));
  EXPECT_EQ(result.position(), 9);

  // Hold the batch thread on another session's step, queue the stream's
  // second step behind it, and release only once the deadline has passed.
  gate_.Arm();
  std::thread blocked([&] {
    const Tokens other = RandomTokens(blocker.served->spec(), 1, 4);
    EXPECT_TRUE(blocker.served
                    ->DecodeStep(0, other.q_rows(0, 1), other.k_rows(0, 1),
                                 other.v_rows(0, 1))
                    .ok());
  });
  gate_.WaitUntilHolding();
  auto second = step(1);
  ATTN_ASSERT_OK(second);
  // EXPECT, not ASSERT: `blocked` must be joined below.
  EXPECT_TRUE(stream->Write(*second));
  // The server's deadline comes from the relative timeout the client sent
  // (rounded up, counted from arrival), so it may end a little after the
  // client's; once the client's deadline fires, the client also cancels the
  // stream. A second later either has reached the server.
  while (absl::Now() <= deadline + absl::Seconds(1)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  gate_.Release();
  blocked.join();
  EXPECT_FALSE(stream->Read(&result));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << status.error_message();

  // Only the first step was applied: the session is still its twin plus
  // that step, and the next step matches bitwise.
  auto info = target.served->Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 10);
  ATTN_ASSERT_OK(target.reference->DecodeStep(
      0, tokens.q_rows(0, 1), tokens.k_rows(0, 1), tokens.v_rows(0, 1)));
  auto served = target.served->DecodeStep(
      0, tokens.q_rows(2, 1), tokens.k_rows(2, 1), tokens.v_rows(2, 1));
  auto expected = target.reference->DecodeStep(
      0, tokens.q_rows(2, 1), tokens.k_rows(2, 1), tokens.v_rows(2, 1));
  ATTN_ASSERT_OK(served);
  ATTN_ASSERT_OK(expected);
  EXPECT_EQ(served->position(), 10);
  EXPECT_EQ(served->output().data(), expected->output().data());
}

TEST_F(CallbackServingTest, CancellingAStreamKeepsItsAnsweredSteps) {
  Start();
  const v1::SessionSpec spec = MakeSpec(1, 4, 2, 16);
  Twins twins = MakeTwins(spec, 4, 7);
  ASSERT_NE(twins.served, nullptr);
  const Tokens tokens = RandomTokens(twins.served->spec(), 4, 8);
  {
    auto stream = client().OpenDecodeStream();
    for (int t = 0; t < 3; ++t) {
      auto request = twins.served->MakeDecodeRequest(
          0, tokens.q_rows(t, 1), tokens.k_rows(t, 1), tokens.v_rows(t, 1));
      ATTN_ASSERT_OK(request);
      ATTN_ASSERT_OK(stream->Step(*request));
    }
    // Destroying the stream unfinished cancels it.
  }
  // The server ends the stream; its answered steps stay, nothing else.
  for (int t = 0; t < 3; ++t) {
    ATTN_ASSERT_OK(twins.reference->DecodeStep(
        0, tokens.q_rows(t, 1), tokens.k_rows(t, 1), tokens.v_rows(t, 1)));
  }
  auto info = twins.served->Info();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), 7);
  auto served = twins.served->DecodeStep(
      0, tokens.q_rows(3, 1), tokens.k_rows(3, 1), tokens.v_rows(3, 1));
  auto expected = twins.reference->DecodeStep(
      0, tokens.q_rows(3, 1), tokens.k_rows(3, 1), tokens.v_rows(3, 1));
  ATTN_ASSERT_OK(served);
  ATTN_ASSERT_OK(expected);
  EXPECT_EQ(served->output().data(), expected->output().data());
}

TEST_F(CallbackServingTest, DrainWaitsForManyOpenStreamsWhichKeepWorking) {
  server::ServerOptions options = TestServerOptions();
  options.drain_timeout = absl::Seconds(60);
  Start(options);
  const v1::SessionSpec spec = MakeSpec(1, 2, 1, 8);
  constexpr int kStreams = 16;
  auto base = client().OpenSession(spec);
  ATTN_ASSERT_OK(base);
  const Tokens tokens = RandomTokens(base->spec(), 2, 11);
  std::vector<client::SessionHandle> sessions;
  std::vector<std::unique_ptr<client::DecodeStream>> streams;
  for (int i = 0; i < kStreams; ++i) {
    auto fork = base->Fork();
    ATTN_ASSERT_OK(fork);
    sessions.push_back(*fork);
    streams.push_back(client().OpenDecodeStream());
    auto request = fork->MakeDecodeRequest(
        0, tokens.q_rows(0, 1), tokens.k_rows(0, 1), tokens.v_rows(0, 1));
    ATTN_ASSERT_OK(request);
    ATTN_ASSERT_OK(streams.back()->Step(*request));
  }
  absl::Notification stopped;
  std::thread shutdown([&] {
    server_->server->Shutdown();
    stopped.Notify();
  });
  // New sessions are refused once the drain started (a condition).
  absl::Status refused;
  for (int i = 0; i < 2000; ++i) {
    refused = client().OpenSession(spec).status();
    if (refused.code() == absl::StatusCode::kUnavailable) break;
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  // Every open stream keeps working; outputs equal (same history and token).
  std::string first_output;
  for (int i = 0; i < kStreams; ++i) {
    EXPECT_FALSE(stopped.HasBeenNotified());
    auto request = sessions[i].MakeDecodeRequest(
        0, tokens.q_rows(1, 1), tokens.k_rows(1, 1), tokens.v_rows(1, 1));
    ATTN_ASSERT_OK(request);
    auto result = streams[i]->Step(*request);
    ATTN_ASSERT_OK(result);
    EXPECT_EQ(result->position(), 1);
    if (i == 0) first_output = result->output().data();
    EXPECT_EQ(result->output().data(), first_output);
    streams[i]->WritesDone();
    ATTN_EXPECT_OK(streams[i]->Finish());
  }
  shutdown.join();
  EXPECT_TRUE(stopped.HasBeenNotified());
}

TEST_F(CallbackServingTest, TwoHundredStreamsNeedNoThreadEach) {
  Start();
  const v1::SessionSpec spec = MakeSpec(1, 2, 1, 8);
  constexpr int kStreams = 200;
  constexpr int kSteps = 3;
  auto base = client().OpenSession(spec);
  ATTN_ASSERT_OK(base);
  const Tokens prompt = RandomTokens(base->spec(), 6, 21);
  ATTN_ASSERT_OK(base->Prefill(0, prompt.q_rows(0, 6), prompt.k_rows(0, 6),
                               prompt.v_rows(0, 6)));
  const Tokens tokens = RandomTokens(base->spec(), kSteps, 22);
  std::vector<client::SessionHandle> sessions;
  std::vector<std::unique_ptr<client::DecodeStream>> streams;
  for (int i = 0; i < kStreams; ++i) {
    auto fork = base->Fork();
    ATTN_ASSERT_OK(fork);
    sessions.push_back(*fork);
    streams.push_back(client().OpenDecodeStream());
  }
  // One client thread drives all streams, each step of all 200 in flight
  // at once: every stream is open on the server at the same time.
  std::vector<std::string> outputs(kSteps);
  int peak_threads = 0;
  for (int t = 0; t < kSteps; ++t) {
    for (int i = 0; i < kStreams; ++i) {
      auto request = sessions[i].MakeDecodeRequest(
          0, tokens.q_rows(t, 1), tokens.k_rows(t, 1), tokens.v_rows(t, 1));
      ATTN_ASSERT_OK(request);
      ASSERT_TRUE(streams[i]->Write(*request));
    }
    peak_threads = std::max(peak_threads, ThreadCount());
    for (int i = 0; i < kStreams; ++i) {
      auto result = streams[i]->Read();
      ATTN_ASSERT_OK(result);
      EXPECT_EQ(result->position(), 6 + t);
      // Forks of one history given the same token: the same bits, however
      // the 200 steps were batched.
      if (i == 0) outputs[t] = result->output().data();
      EXPECT_EQ(result->output().data(), outputs[t]) << "stream " << i;
    }
  }
  peak_threads = std::max(peak_threads, ThreadCount());
  for (auto& stream : streams) {
    stream->WritesDone();
    ATTN_EXPECT_OK(stream->Finish());
  }
  // Server, client and test together: far fewer threads than streams.
  EXPECT_GT(peak_threads, 0);
  EXPECT_LT(peak_threads, kStreams / 2);
  // The steps equal one DecodeStep at a time on the base.
  for (int t = 0; t < kSteps; ++t) {
    auto expected = base->DecodeStep(0, tokens.q_rows(t, 1),
                                     tokens.k_rows(t, 1), tokens.v_rows(t, 1));
    ATTN_ASSERT_OK(expected);
    EXPECT_EQ(expected->output().data(), outputs[t]) << "step " << t;
  }
}

TEST_F(CallbackServingTest, BatchDecodeIsAllOrNothingAndMatchesDecodeSteps) {
  Start();
  const v1::SessionSpec spec = MakeSpec(2, 4, 2, 16);
  std::vector<Twins> twins;
  for (int i = 0; i < 4; ++i) {
    twins.push_back(MakeTwins(spec, 7 + i, 40 + 10 * i));
    ASSERT_NE(twins.back().served, nullptr);
  }
  const v1::SessionSpec& resolved = twins[0].served->spec();
  std::vector<Tokens> tokens;
  for (int i = 0; i < 4; ++i) tokens.push_back(RandomTokens(resolved, 1, 90 + i));
  std::vector<StateSnapshot> before;
  for (const Twins& t : twins) {
    auto snapshot = Snapshot(client(), t.served->id());
    ATTN_ASSERT_OK(snapshot);
    before.push_back(*snapshot);
  }
  // The last step's logits overflow: the engine refuses it, and with it the
  // whole group (the other three steps are valid).
  Tokens overflow = RandomTokens(resolved, 1, 99);
  std::fill(overflow.q.begin(), overflow.q.end(), 3e19f);
  std::fill(overflow.k.begin(), overflow.k.end(), 3e19f);
  v1::BatchDecodeRequest bad;
  for (int i = 0; i < 4; ++i) {
    const Tokens& t = i == 3 ? overflow : tokens[i];
    auto step = twins[i].served->MakeDecodeRequest(
        i % 2, t.q_rows(0, 1), t.k_rows(0, 1), t.v_rows(0, 1));
    ATTN_ASSERT_OK(step);
    *bad.add_steps() = *step;
  }
  ATTN_EXPECT_CODE(client().BatchDecode(bad),
                   absl::StatusCode::kInvalidArgument);
  for (size_t i = 0; i < twins.size(); ++i) {
    auto snapshot = Snapshot(client(), twins[i].served->id());
    ATTN_ASSERT_OK(snapshot);
    EXPECT_EQ(snapshot->layer_lengths, before[i].layer_lengths) << i;
  }

  // The same group without the bad step applies whole, bitwise equal to
  // one DecodeStep at a time.
  v1::BatchDecodeRequest good;
  for (int i = 0; i < 3; ++i) *good.add_steps() = bad.steps(i);
  auto results = client().BatchDecode(good);
  ATTN_ASSERT_OK(results);
  ASSERT_EQ(results->size(), 3u);
  for (int i = 0; i < 3; ++i) {
    auto expected = twins[i].reference->DecodeStep(
        i % 2, tokens[i].q_rows(0, 1), tokens[i].k_rows(0, 1),
        tokens[i].v_rows(0, 1));
    ATTN_ASSERT_OK(expected);
    EXPECT_EQ((*results)[i].position(), expected->position());
    EXPECT_EQ((*results)[i].output().data(), expected->output().data()) << i;
  }
}

}  // namespace
}  // namespace attention::testing
