// PrepareAppendReply: a step's output is written straight into its reply
// only when the reply buffer, sized from the request's shapes before the
// engine checks them, is not out of proportion to the bytes the request
// carries; otherwise the engine allocates the output after checking the
// step, and the reply gets a copy of the same bytes.
#include "server/append_reply.h"

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/cpu/cpu_backend.h"
#include "core/engine.h"
#include "gtest/gtest.h"
#include "server/reply_size.h"
#include "tests/core/test_tensors.h"

namespace attention::server {
namespace {

using testing::HostTensor;
using testing::RandomTensor;

constexpr int64_t kLargeLimit = int64_t{1} << 30;

std::unique_ptr<AttentionEngine> MakeEngine() {
  EngineOptions options;
  options.kv_cache_bytes = int64_t{16} << 20;
  options.kv_block_bytes = 4096;
  options.sessions.reap_interval = absl::ZeroDuration();
  auto engine =
      AttentionEngine::Create(std::make_unique<CpuBackend>(1), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? *std::move(engine) : nullptr;
}

AppendRequest Step(const HostTensor& q, const HostTensor& k,
                   const HostTensor& v, DType output_dtype) {
  AppendRequest append;
  append.q = q.view();
  append.k = k.view();
  append.v = v.view();
  append.output_dtype = output_dtype;
  return append;
}

TEST(AppendReplyTest, AnOrdinaryStepIsWrittenIntoItsReply) {
  std::mt19937 rng(1);
  const HostTensor q = RandomTensor({1, 32, 128}, rng, DType::kFloat16);
  const HostTensor k = RandomTensor({1, 8, 128}, rng, DType::kFloat16);
  const HostTensor v = RandomTensor({1, 8, 128}, rng, DType::kFloat16);
  for (DType output : {DType::kFloat16, DType::kFloat32}) {
    AppendRequest append = Step(q, k, v, output);
    v1::AttentionResult reply;
    PrepareAppendReply(append, kLargeLimit, &reply);
    const size_t bytes = 32 * 128 * DTypeSize(output);
    EXPECT_EQ(reply.output().data().size(), bytes);
    EXPECT_EQ(append.output_destination.size(), bytes);
    EXPECT_EQ(reinterpret_cast<const char*>(append.output_destination.data()),
              reply.output().data().data());
  }
}

TEST(AppendReplyTest, ShapesClaimingAHugeOutputGetNoBuffer) {
  std::mt19937 rng(2);
  // 16 KiB of q and v whose shapes make a 64 MiB float32 output.
  const HostTensor q = RandomTensor({1, 4096, 1}, rng, DType::kFloat16);
  const HostTensor k = RandomTensor({1, 1, 1}, rng, DType::kFloat16);
  const HostTensor v = RandomTensor({1, 1, 4096}, rng, DType::kFloat16);
  AppendRequest append = Step(q, k, v, DType::kFloat32);
  v1::AttentionResult reply;
  PrepareAppendReply(append, kLargeLimit, &reply);
  EXPECT_TRUE(append.output_destination.empty());
  EXPECT_TRUE(reply.output().data().empty());
  // No bytes at all: a few bytes on the wire.
  AppendRequest empty = Step(q, k, v, DType::kFloat32);
  empty.v.shape = {1, 1, 1 << 14};  // a 256 MiB output
  empty.v.size_bytes = 0;
  PrepareAppendReply(empty, kLargeLimit, &reply);
  EXPECT_TRUE(empty.output_destination.empty());
  EXPECT_TRUE(reply.output().data().empty());
}

// Nor is an output larger than the reply may take (the engine refuses the
// step then), however much the request carries; a batch's outputs take
// the message together.
TEST(AppendReplyTest, OutputsPastTheMessageLimitGetNoBuffer) {
  std::mt19937 rng(4);
  const HostTensor q = RandomTensor({1, 32, 128}, rng, DType::kFloat16);
  const HostTensor k = RandomTensor({1, 8, 128}, rng, DType::kFloat16);
  const HostTensor v = RandomTensor({1, 8, 128}, rng, DType::kFloat16);
  // 16 KiB of float32 output, one result's framing on top.
  const int64_t fits = 32 * 128 * 4 + kResultFramingBytes;
  AppendRequest over = Step(q, k, v, DType::kFloat32);
  v1::AttentionResult reply;
  PrepareAppendReply(over, fits - 1, &reply);
  EXPECT_EQ(over.max_reply_bytes, 32 * 128 * 4 - 1);
  EXPECT_TRUE(over.output_destination.empty());
  AppendRequest at = Step(q, k, v, DType::kFloat32);
  PrepareAppendReply(at, fits, &reply);
  EXPECT_EQ(at.output_destination.size(), 32u * 128 * 4);
  // Two such steps in a message for one and a half: the first gets its
  // buffer, the second none.
  std::vector<AppendRequest> batch = {Step(q, k, v, DType::kFloat32),
                                      Step(q, k, v, DType::kFloat32)};
  v1::BatchDecodeResponse replies;
  const int64_t budget = PrepareBatchReply(
      absl::MakeSpan(batch), 3 * 32 * 128 * 4 / 2 + 2 * kResultFramingBytes,
      &replies);
  EXPECT_EQ(budget, 3 * 32 * 128 * 4 / 2);
  ASSERT_EQ(replies.results_size(), 2);
  EXPECT_EQ(batch[0].output_destination.size(), 32u * 128 * 4);
  EXPECT_TRUE(batch[1].output_destination.empty());
}

// A real step past the factor (head_dim 8, value_dim 128, GQA 8/1, fp16
// in, fp32 out: about 10 times the request) takes the engine's output.
TEST(AppendReplyTest, AStepPastTheFactorGetsTheEnginesOutput) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  SessionSpec spec;
  spec.num_layers = 1;
  spec.num_q_heads = 8;
  spec.num_kv_heads = 1;
  spec.head_dim = 8;
  spec.value_dim = 128;
  spec.kv_dtype = DType::kFloat16;
  spec.max_tokens = 64;
  auto a = engine->CreateSession(spec, absl::ZeroDuration());
  auto b = engine->CreateSession(spec, absl::ZeroDuration());
  ASSERT_TRUE(a.ok() && b.ok());
  std::mt19937 rng(3);
  const HostTensor q = RandomTensor({1, 8, 8}, rng, DType::kFloat16);
  const HostTensor k = RandomTensor({1, 1, 8}, rng, DType::kFloat16);
  const HostTensor v = RandomTensor({1, 1, 128}, rng, DType::kFloat16);
  AppendRequest append = Step(q, k, v, DType::kFloat32);
  append.session_id = a->session_id;
  v1::AttentionResult reply;
  PrepareAppendReply(append, kLargeLimit, &reply);
  EXPECT_TRUE(append.output_destination.empty());
  auto output = engine->Append(append);
  ASSERT_TRUE(output.ok()) << output.status();
  FinishAppendReply(append, *output, &reply);
  // The same step on a twin session, its output computed in place.
  AppendRequest twin = Step(q, k, v, DType::kFloat32);
  twin.session_id = b->session_id;
  std::string in_place(8 * 128 * 4, '\0');
  twin.output_destination = absl::MakeSpan(
      reinterpret_cast<std::byte*>(in_place.data()), in_place.size());
  ASSERT_TRUE(engine->Append(twin).ok());
  EXPECT_EQ(reply.output().data(), in_place);
  ASSERT_EQ(reply.output().shape_size(), 3);
  EXPECT_EQ(reply.output().shape(1), 8);
  EXPECT_EQ(reply.output().shape(2), 128);
}

}  // namespace
}  // namespace attention::server
