#include "bench/soak/soak_worker.h"

#include <grpcpp/client_context.h>
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "attention/v1/attention.grpc.pb.h"
#include "bench/soak/canceller.h"
#include "bench/soak/list_sessions.h"
#include "bench/soak/rpc_tally.h"
#include "bench/soak/session_pool.h"
#include "client/attention_client.h"
#include "client/tensor_codec.h"

namespace attention::soak {
namespace {

using Stub = v1::AttentionService::Stub;

// Chances per call.
constexpr double kShortDeadlineChance = 0.05;
constexpr double kCancellerChance = 0.05;
constexpr double kStreamCancellerChance = 0.2;
constexpr double kStreamSelfCancelChance = 0.1;
constexpr absl::Duration kCallDeadline = absl::Seconds(10);

// The operations of the mix and their weights.
enum class Op {
  kCreate,
  kPrefill,
  kDecodeStep,
  kDecodeStream,
  kBatchDecode,
  kFork,
  kTruncate,
  kDelete,
  kList,
  kGet,
  kServerInfo,
  kAttention,
  kInvalid,
  kFailedStepProbe,
  kMove,
};
constexpr std::pair<Op, int> kWeights[] = {
    {Op::kCreate, 8},       {Op::kPrefill, 12},       {Op::kDecodeStep, 20},
    {Op::kDecodeStream, 8}, {Op::kBatchDecode, 8},    {Op::kFork, 4},
    {Op::kTruncate, 5},     {Op::kDelete, 4},         {Op::kList, 1},
    {Op::kGet, 5},          {Op::kServerInfo, 2},     {Op::kAttention, 8},
    {Op::kInvalid, 3},      {Op::kFailedStepProbe, 2},    {Op::kMove, 2}};

// One thread of the mix.
class Mixer {
 public:
  Mixer(Stub* stub, SessionPool* pool, Canceller* canceller, RpcTally* tally,
        uint64_t seed, absl::Time end)
      : stub_(stub),
        pool_(pool),
        canceller_(canceller),
        tally_(tally),
        rng_(seed),
        end_(end) {}

  void Run() {
    std::vector<int> weights;
    for (const auto& [op, weight] : kWeights) weights.push_back(weight);
    std::discrete_distribution<int> pick(weights.begin(), weights.end());
    while (absl::Now() < end_) RunOp(kWeights[pick(rng_)].first);
    if (probe_session_.has_value()) Delete(probe_session_->id);
  }

 private:
  void RunOp(Op op) {
    switch (op) {
      case Op::kCreate:
        return Create();
      case Op::kPrefill:
        return Prefill();
      case Op::kDecodeStep:
        return DecodeStep();
      case Op::kDecodeStream:
        return DecodeStream();
      case Op::kBatchDecode:
        return BatchDecode();
      case Op::kFork:
        return Fork();
      case Op::kTruncate:
        return Truncate();
      case Op::kDelete:
        if (auto session = pool_->Take(rng_)) Delete(session->id);
        return;
      case Op::kList:
        return List();
      case Op::kGet:
        return Get();
      case Op::kServerInfo:
        return ServerInfo();
      case Op::kAttention:
        return Attention();
      case Op::kInvalid:
        return Invalid();
      case Op::kFailedStepProbe:
        return FailedStepProbe();
      case Op::kMove:
        return Move();
    }
  }

  bool Chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  int64_t Uniform(int64_t low, int64_t high) {  // inclusive
    return std::uniform_int_distribution<int64_t>(low, high)(rng_);
  }
  template <typename T>
  T OneOf(std::initializer_list<T> values) {
    return values.begin()[Uniform(0, static_cast<int64_t>(values.size()) - 1)];
  }

  // Every call has a deadline; some a very short one.
  absl::Duration Deadline() {
    if (!Chance(kShortDeadlineChance)) return kCallDeadline;
    return absl::Microseconds(Uniform(100, 5000));
  }

  // One unary call through `method` of the stub, tallied. With `faults`
  // the deadline is sometimes very short and the canceller may cancel the
  // call; without, the deadline is kCallDeadline.
  template <typename Request, typename Response>
  grpc::Status Call(Rpc rpc,
                    grpc::Status (Stub::*method)(grpc::ClientContext*,
                                                 const Request&, Response*),
                    const Request& request, Response* response,
                    bool faults = true) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(
        absl::Now() + (faults ? Deadline() : kCallDeadline)));
    const Canceller::Scope scope(
        faults && Chance(kCancellerChance) ? canceller_ : nullptr, &context);
    const grpc::Status status = (stub_->*method)(&context, request, response);
    tally_->Record(rpc, status);
    return status;
  }

  // A request that must fail answered OK.
  void ExpectFailure(Rpc rpc, const grpc::Status& status,
                     const std::string& what) {
    if (status.ok()) {
      tally_->RecordViolation(rpc, absl::StrCat("OK for ", what));
    }
  }

  v1::Tensor RandomTensor(std::vector<int64_t> shape, v1::DType dtype) {
    int64_t count = 1;
    for (int64_t dim : shape) count *= dim;
    std::vector<float> values(static_cast<size_t>(count));
    std::uniform_real_distribution<float> value(-1.0f, 1.0f);
    for (float& x : values) x = value(rng_);
    return client::MakeTensor(values, shape, dtype).value();
  }
  v1::DType RandomDType() {
    return OneOf({v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16,
                  v1::DTYPE_BFLOAT16});
  }

  v1::SessionSpec RandomSpec() {
    v1::SessionSpec spec;
    spec.set_num_layers(static_cast<int>(Uniform(1, 3)));
    spec.set_num_kv_heads(OneOf({1, 2}));
    spec.set_num_q_heads(spec.num_kv_heads() * OneOf({1, 2, 4}));
    spec.set_head_dim(OneOf({8, 16, 32, 64}));
    if (Chance(0.1)) spec.set_value_dim(16);
    spec.set_kv_dtype(RandomDType());
    spec.set_max_tokens(OneOf<int64_t>({0, 48, 256, 1024}));
    spec.set_model("attn-soak");
    const int layer_specs = OneOf({0, 0, 1, spec.num_layers()});
    for (int i = 0; i < layer_specs; ++i) {
      v1::LayerSpec* layer = spec.add_layers();
      layer->set_window(OneOf({0, 16, 64}));
      if (layer->window() > 0 && Chance(0.5)) layer->set_num_sink_tokens(2);
      if (Chance(0.2)) {
        for (int h = 0; h < spec.num_q_heads(); ++h) {
          layer->add_sink_logits(static_cast<float>(Uniform(-10, 10)) / 10);
        }
      }
    }
    return spec;
  }

  int64_t ValueDim(const v1::SessionSpec& spec) {
    return spec.value_dim() > 0 ? spec.value_dim() : spec.head_dim();
  }

  // q [T, H, D], k [T, H_kv, D], v [T, H_kv, Dv] for a session's layer.
  template <typename Request>
  Request AppendRequest(const PooledSession& session, int64_t tokens) {
    const v1::SessionSpec& spec = session.spec;
    Request request;
    request.set_session_id(session.id);
    request.set_layer(static_cast<int>(Uniform(0, spec.num_layers() - 1)));
    const v1::DType dtype = RandomDType();
    *request.mutable_q() =
        RandomTensor({tokens, spec.num_q_heads(), spec.head_dim()}, dtype);
    *request.mutable_k() =
        RandomTensor({tokens, spec.num_kv_heads(), spec.head_dim()}, dtype);
    *request.mutable_v() =
        RandomTensor({tokens, spec.num_kv_heads(), ValueDim(spec)}, dtype);
    if (Chance(0.2)) request.set_output_dtype(RandomDType());
    request.set_return_lse(Chance(0.2));
    return request;
  }

  // An OK result must have the [T, H, value_dim] output.
  void CheckResult(Rpc rpc, const v1::AttentionResult& result,
                   const v1::SessionSpec& spec, int64_t tokens) {
    const auto& shape = result.output().shape();
    if (shape.size() != 3 || shape[0] != tokens ||
        shape[1] != spec.num_q_heads() || shape[2] != ValueDim(spec)) {
      tally_->RecordViolation(rpc, "OK result with a wrong output shape");
    }
  }

  void Keep(const v1::SessionInfo& info) {
    if (auto evicted = pool_->Add({info.session_id(), info.spec()})) {
      Delete(evicted->id);
    }
  }

  void Create() {
    v1::CreateSessionRequest request;
    *request.mutable_spec() = RandomSpec();
    // Some sessions expire while in use.
    if (Chance(0.1)) request.set_idle_timeout_seconds(2);
    v1::SessionInfo info;
    if (Call(Rpc::kCreateSession, &Stub::CreateSession, request, &info).ok()) {
      Keep(info);
    }
  }

  void Prefill() {
    auto session = pool_->Pick(rng_);
    if (!session) return Create();
    const int64_t tokens = Uniform(1, 32);
    auto request = AppendRequest<v1::PrefillRequest>(*session, tokens);
    v1::AttentionResult result;
    if (Call(Rpc::kPrefill, &Stub::Prefill, request, &result).ok()) {
      CheckResult(Rpc::kPrefill, result, session->spec, tokens);
    }
  }

  void DecodeStep() {
    auto session = pool_->Pick(rng_);
    if (!session) return Create();
    auto request = AppendRequest<v1::DecodeRequest>(*session, 1);
    v1::AttentionResult result;
    if (Call(Rpc::kDecodeStep, &Stub::DecodeStep, request, &result).ok()) {
      CheckResult(Rpc::kDecodeStep, result, session->spec, 1);
    }
  }

  // A Decode stream of 1..16 steps over random sessions, cancelled now and
  // then by the canceller thread or by this thread between steps.
  void DecodeStream() {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(
        absl::Now() + (Chance(kShortDeadlineChance)
                           ? absl::Milliseconds(Uniform(1, 20))
                           : kCallDeadline)));
    const Canceller::Scope scope(
        Chance(kStreamCancellerChance) ? canceller_ : nullptr, &context);
    auto stream = stub_->Decode(&context);
    const int64_t steps = Uniform(1, 16);
    const int64_t cancel_at =
        Chance(kStreamSelfCancelChance) ? Uniform(0, steps - 1) : -1;
    v1::AttentionResult result;
    for (int64_t i = 0; i < steps; ++i) {
      if (i == cancel_at) context.TryCancel();
      auto session = pool_->Pick(rng_);
      if (!session) break;
      if (!stream->Write(AppendRequest<v1::DecodeRequest>(*session, 1))) break;
      if (!stream->Read(&result)) break;
      tally_->Record(Rpc::kDecode, grpc::Status::OK);
      CheckResult(Rpc::kDecode, result, session->spec, 1);
    }
    stream->WritesDone();
    // Results after a failed Write; bounded by the deadline.
    while (stream->Read(&result)) {
      tally_->Record(Rpc::kDecode, grpc::Status::OK);
    }
    const grpc::Status status = stream->Finish();
    if (!status.ok()) tally_->Record(Rpc::kDecode, status);
  }

  void BatchDecode() {
    v1::BatchDecodeRequest request;
    std::set<std::pair<std::string, int>> seen;
    for (const PooledSession& session :
         pool_->PickSome(static_cast<size_t>(Uniform(1, 6)), rng_)) {
      v1::DecodeRequest step = AppendRequest<v1::DecodeRequest>(session, 1);
      if (!seen.emplace(step.session_id(), step.layer()).second) continue;
      *request.add_steps() = std::move(step);
    }
    if (request.steps().empty()) return Create();
    v1::BatchDecodeResponse response;
    const grpc::Status status =
        Call(Rpc::kBatchDecode, &Stub::BatchDecode, request, &response);
    if (status.ok() && response.results_size() != request.steps_size()) {
      tally_->RecordViolation(Rpc::kBatchDecode, "OK with a result missing");
    }
  }

  void Fork() {
    auto session = pool_->Pick(rng_);
    if (!session) return Create();
    v1::ForkSessionRequest request;
    request.set_session_id(session->id);
    v1::SessionInfo info;
    if (Call(Rpc::kForkSession, &Stub::ForkSession, request, &info).ok()) {
      Keep(info);
    }
  }

  // Exports a session (racing the other threads' appends, deletes and
  // cancellations) and imports the snapshot as a new session, which joins
  // the pool.
  void Move() {
    auto session = pool_->Pick(rng_);
    if (!session) return Create();
    std::vector<v1::SessionChunk> chunks;
    {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + Deadline()));
      const Canceller::Scope scope(
          Chance(kCancellerChance) ? canceller_ : nullptr, &context);
      v1::ExportSessionRequest request;
      request.set_session_id(session->id);
      auto reader = stub_->ExportSession(&context, request);
      v1::SessionChunk chunk;
      while (reader->Read(&chunk)) chunks.push_back(chunk);
      const grpc::Status status = reader->Finish();
      tally_->Record(Rpc::kExportSession, status);
      if (!status.ok()) return;
    }
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Deadline()));
    const Canceller::Scope scope(
        Chance(kCancellerChance) ? canceller_ : nullptr, &context);
    v1::SessionInfo info;
    auto writer = stub_->ImportSession(&context, &info);
    for (const v1::SessionChunk& chunk : chunks) {
      if (!writer->Write(chunk)) break;
    }
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    tally_->Record(Rpc::kImportSession, status);
    if (status.ok()) Keep(info);
  }

  void Truncate() {
    auto session = pool_->Pick(rng_);
    if (!session) return Create();
    v1::TruncateSessionRequest request;
    request.set_session_id(session->id);
    request.set_length(Uniform(0, 64));
    v1::SessionInfo info;
    Call(Rpc::kTruncateSession, &Stub::TruncateSession, request, &info);
  }

  void Delete(const std::string& id) {
    v1::DeleteSessionRequest request;
    request.set_session_id(id);
    v1::DeleteSessionResponse response;
    Call(Rpc::kDeleteSession, &Stub::DeleteSession, request, &response);
  }

  void List() {
    std::vector<v1::SessionInfo> sessions;
    tally_->Record(Rpc::kListSessions,
                   ListAllSessions(stub_, absl::Now() + Deadline(), &sessions));
  }

  void Get() {
    auto session = pool_->Pick(rng_);
    if (!session) return Create();
    v1::GetSessionRequest request;
    request.set_session_id(session->id);
    v1::SessionInfo info;
    Call(Rpc::kGetSession, &Stub::GetSession, request, &info);
  }

  void ServerInfo() {
    v1::ServerInfo info;
    Call(Rpc::kGetServerInfo, &Stub::GetServerInfo, v1::GetServerInfoRequest(),
         &info);
  }

  // Stateless attention with every option; now and then one whose weights
  // exceed the server's message limit.
  void Attention() {
    // 8 heads x 32 x 1024 float32 weights fill a 1 MiB message by
    // themselves: with the output the answer is too large to send
    // (RESOURCE_EXHAUSTED), and twice as many queries even more so.
    const bool huge = Chance(0.01);
    const int64_t kv_heads = OneOf({1, 2});
    const int64_t heads = huge ? 8 : kv_heads * OneOf({1, 2, 4});
    const int64_t head_dim = huge ? 16 : OneOf({8, 16, 32, 64});
    const int64_t tq = huge ? OneOf({32, 64}) : Uniform(1, 16);
    const int64_t tk = huge ? 1024 : Uniform(1, 64);
    v1::AttentionRequest request;
    const v1::DType dtype = RandomDType();
    *request.mutable_q() = RandomTensor({tq, heads, head_dim}, dtype);
    *request.mutable_k() = RandomTensor({tk, kv_heads, head_dim}, dtype);
    *request.mutable_v() = RandomTensor({tk, kv_heads, head_dim}, dtype);
    request.set_causal(Chance(0.7));
    if (request.causal()) {
      if (Chance(0.3)) {
        request.set_window(OneOf({4, 16}));
        if (Chance(0.5)) request.set_num_sink_tokens(1);
      }
      if (Chance(0.5)) request.set_query_start(Uniform(0, tk));
    }
    if (Chance(0.2)) {
      for (int64_t h = 0; h < heads; ++h) request.add_sink_logits(0.5f);
    }
    if (Chance(0.1)) {
      *request.mutable_bias() = RandomTensor({tq, tk}, v1::DTYPE_FLOAT32);
    }
    request.set_empty_row_policy(Chance(0.8) ? v1::EMPTY_ROW_POLICY_ZERO
                                             : v1::EMPTY_ROW_POLICY_ERROR);
    request.set_return_weights(huge || Chance(0.2));
    request.set_return_lse(Chance(0.2));
    if (Chance(0.2)) request.set_output_dtype(RandomDType());
    v1::AttentionResult result;
    Call(Rpc::kAttention, &Stub::Attention, request, &result);
  }

  // A request the contract says must fail.
  void Invalid() {
    auto session = pool_->Pick(rng_);
    switch (session ? Uniform(0, 4) : OneOf<int64_t>({0, 3})) {
      case 0: {
        v1::CreateSessionRequest request;
        *request.mutable_spec() = RandomSpec();
        request.mutable_spec()->set_num_q_heads(3);
        request.mutable_spec()->set_num_kv_heads(2);
        v1::SessionInfo info;
        const grpc::Status status =
            Call(Rpc::kCreateSession, &Stub::CreateSession, request, &info);
        ExpectFailure(Rpc::kCreateSession, status, "3 query heads, 2 KV");
        if (status.ok()) Delete(info.session_id());
        return;
      }
      case 1: {
        auto request = AppendRequest<v1::DecodeRequest>(*session, 1);
        request.set_layer(session->spec.num_layers());
        v1::AttentionResult result;
        ExpectFailure(
            Rpc::kDecodeStep,
            Call(Rpc::kDecodeStep, &Stub::DecodeStep, request, &result),
            "a layer past num_layers");
        return;
      }
      case 2: {
        auto request = AppendRequest<v1::PrefillRequest>(*session, 2);
        *request.mutable_k() =
            AppendRequest<v1::PrefillRequest>(*session, 3).k();
        v1::AttentionResult result;
        ExpectFailure(Rpc::kPrefill,
                      Call(Rpc::kPrefill, &Stub::Prefill, request, &result),
                      "q of 2 tokens, k of 3");
        return;
      }
      case 3: {
        // 1.06 MiB of keys: above the server's 1 MiB receive limit.
        v1::AttentionRequest request;
        *request.mutable_q() = RandomTensor({1, 1, 64}, v1::DTYPE_FLOAT32);
        *request.mutable_k() = RandomTensor({4352, 1, 64}, v1::DTYPE_FLOAT32);
        *request.mutable_v() = RandomTensor({4352, 1, 1}, v1::DTYPE_FLOAT32);
        v1::AttentionResult result;
        ExpectFailure(Rpc::kAttention,
                      Call(Rpc::kAttention, &Stub::Attention, request, &result),
                      "a request above --max_message_bytes");
        return;
      }
      default: {
        auto request = AppendRequest<v1::DecodeRequest>(*session, 1);
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::string data(static_cast<size_t>(session->spec.num_q_heads() *
                                             session->spec.head_dim()) *
                             sizeof(float),
                         '\0');
        std::memcpy(data.data(), &nan, sizeof(nan));
        request.mutable_q()->set_dtype(v1::DTYPE_FLOAT32);
        request.mutable_q()->set_data(std::move(data));
        v1::AttentionResult result;
        ExpectFailure(
            Rpc::kDecodeStep,
            Call(Rpc::kDecodeStep, &Stub::DecodeStep, request, &result),
            "a NaN query");
        return;
      }
    }
  }

  // The first layer's length of `id`; -1 when GetSession fails.
  int64_t LayerLength(const std::string& id) {
    v1::GetSessionRequest request;
    request.set_session_id(id);
    v1::SessionInfo info;
    const grpc::Status status = Call(Rpc::kGetSession, &Stub::GetSession,
                                     request, &info, /*faults=*/false);
    return status.ok() && info.layer_lengths_size() > 0 ? info.layer_lengths(0)
                                                        : -1;
  }

  // A decode step with a deadline of 50 us to 1 ms on a session of this
  // thread's own that no other call touches. When the step fails the
  // session must not have grown ("a call that fails changes nothing").
  // The server may finish a step just before the client gives up, so a
  // correct server shows a few too; the count is reported, not failed.
  void FailedStepProbe() {
    if (!probe_session_.has_value()) {
      v1::CreateSessionRequest request;
      v1::SessionSpec& spec = *request.mutable_spec();
      spec.set_num_layers(1);
      spec.set_num_q_heads(1);
      spec.set_num_kv_heads(1);
      spec.set_head_dim(8);
      spec.set_model("attn-soak probe");
      v1::SessionInfo info;
      if (!Call(Rpc::kCreateSession, &Stub::CreateSession, request, &info,
                /*faults=*/false)
               .ok()) {
        return;
      }
      probe_session_ = PooledSession{info.session_id(), info.spec()};
    }
    const int64_t before = LayerLength(probe_session_->id);
    if (before < 0) {
      probe_session_.reset();  // expired or deleted: start a new one
      return;
    }
    if (before >= 1000) {
      v1::TruncateSessionRequest request;
      request.set_session_id(probe_session_->id);
      v1::SessionInfo info;
      Call(Rpc::kTruncateSession, &Stub::TruncateSession, request, &info,
           /*faults=*/false);
      return;
    }
    const auto request = AppendRequest<v1::DecodeRequest>(*probe_session_, 1);
    v1::AttentionResult result;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(
        absl::Now() + absl::Microseconds(Uniform(50, 1000))));
    const grpc::Status status = stub_->DecodeStep(&context, request, &result);
    tally_->Record(Rpc::kDecodeStep, status);
    if (status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) return;
    const int64_t after = LayerLength(probe_session_->id);
    if (after >= 0) tally_->RecordFailedStep(after > before);
  }

  Stub* const stub_;
  SessionPool* const pool_;
  Canceller* const canceller_;
  RpcTally* const tally_;
  std::mt19937_64 rng_;
  const absl::Time end_;
  std::optional<PooledSession> probe_session_;
};

bool WriteReport(const RpcTally& tally, const std::string& path) {
  const std::string temporary = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << tally.Serialize();
    if (!out.good()) return false;
  }
  return std::rename(temporary.c_str(), path.c_str()) == 0;
}

}  // namespace

int RunWorker(const WorkerOptions& options) {
  auto channel = client::CreateChannel(options.target, client::ClientOptions());
  auto stub = v1::AttentionService::NewStub(channel);
  RpcTally tally;
  SessionPool pool(static_cast<size_t>(options.threads) * 3);
  std::seed_seq seeds{options.seed};
  std::vector<uint64_t> thread_seeds(options.threads + 1);
  seeds.generate(thread_seeds.begin(), thread_seeds.end());

  absl::Notification done;
  std::thread reporter([&] {
    while (!done.WaitForNotificationWithTimeout(absl::Seconds(1))) {
      WriteReport(tally, options.report_path);
    }
  });
  {
    Canceller canceller(thread_seeds.back(), absl::Milliseconds(10));
    std::vector<std::thread> threads;
    for (int i = 0; i < options.threads; ++i) {
      threads.emplace_back([&, i] {
        Mixer(stub.get(), &pool, &canceller, &tally, thread_seeds[i],
              options.end)
            .Run();
      });
    }
    for (std::thread& thread : threads) thread.join();
  }
  for (const PooledSession& session : pool.TakeAll()) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
    v1::DeleteSessionRequest request;
    request.set_session_id(session.id);
    v1::DeleteSessionResponse response;
    tally.Record(Rpc::kDeleteSession,
                 stub->DeleteSession(&context, request, &response));
  }
  done.Notify();
  reporter.join();
  return WriteReport(tally, options.report_path) ? 0 : 1;
}

}  // namespace attention::soak
