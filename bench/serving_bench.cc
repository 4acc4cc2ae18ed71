// The serving section of attn-bench: the real attention server, started
// in-process (same AttentionServer and options as attention-server, CPU
// backend, ephemeral port), driven through the C++ client library.
//
//   rpc_overhead_ratio  DecodeStep p50 latency / p50 of a bare echo RPC
//                       carrying the same bytes (request = the step's q, k, v;
//                       response = its output), registered on the same server
//                       (bench_echo.proto) and called over the same channel.
//                       Decode step: H = 32, H_kv = 8, head_dim = 128, fp16
//                       q/k/v/output and KV, context 1024. The engine's own
//                       time for the same step is measured alongside, so the
//                       serving path's overhead can be told from attention,
//                       and so is an echo whose handler busy-waits that long
//                       (an RPC with a long handler pays more transport
//                       time, whatever the handler does).
//   batching_speedup    tokens/s of 64 concurrent Decode streams (one session
//                       each, context 2048, same shapes) / tokens/s of the
//                       same steps sent one DecodeStep at a time.
//   served_vs_engine_stream64
//                       tokens/s of those 64 Decode streams / the engine
//                       alone (no RPC) running the same steps as AppendEach
//                       batches of 64, measured alternately.
//   served_vs_engine_batchdecode64
//                       tokens/s of BatchDecode calls carrying the same 64
//                       steps (one call at a time) / the same engine rate.
//   echo_stream64_*     messages/s of 64 concurrent echo streams on the
//                       synchronous and the callback gRPC server API (gRPC's
//                       synchronous client streams), and on the callback
//                       API with the client library's BlockingBidiStream
//                       (blocking_bidi_vs_sync_client_ratio).
//   engine_batched_step_us_ctx16, engine_step_us_ctx16_batch{8,1}
//                       the engine alone (no RPC): time per step of those
//                       context-16 steps run as AppendEach batches of 64,
//                       8 and 1 (its fixed cost per step and per batch).
//   stream64_vs_callback_echo_ctx16
//                       steps/s of 64 Decode streams at context 16 (own
//                       16-token sessions, cut back before each round) /
//                       messages/s of 64 callback-API echo streams moving
//                       the same bytes: the serving path against the
//                       transport's limit when attention costs little.
//                       Every echo stream the ratios compare with uses the
//                       client machinery the Decode streams use
//                       (client::BlockingBidiStream).
//   {stream64,engine}_cpu_us_per_step_ctx{16,2048},
//   echo_stream64_cpu_us_per_msg_ctx{16,2048}, serving_path_cpu_us_per_step_*,
//   stream64_switches_per_step_*, echo_stream64_switches_per_msg_*
//                       what the 64 Decode streams, the engine alone and
//                       64 callback echo streams with the same bytes cost
//                       per step (message) in the same rounds: CPU time of
//                       the whole process (the in-process client, transport,
//                       server and engine share the cores) and context
//                       switches; the serving path's own CPU is served -
//                       engine - echo.
//   served_vs_engine_stream64_additive_bound,
//   stream64_vs_callback_echo_ctx16_additive_bound (and *_of_bound)
//                       the ratio if a served step took just the engine's
//                       wall time plus the echo's (what the two figures'
//                       goals would need the serving path to add nothing),
//                       and the achieved ratio's share of it.
//   fma_floor_cpu_us_per_step_ctx16, stream64_vs_callback_echo_ctx16_fma_bound
//                       the CPU a context-16 step's multiply-adds alone
//                       take at one thread's peak multiply-add rate (the
//                       kernel section's probe, CPU backend only), and the
//                       ratio if a served step cost the echo's CPU plus
//                       that: the ceiling set by the transport and the
//                       arithmetic alone.
//   widening_floor_cpu_us_per_step_ctx16,
//   stream64_vs_callback_echo_ctx16_widening_bound
//                       the same with each multiply-add paying its share of
//                       the float16 K/V widenings the float32 numerics
//                       need (the widening probe: one vector widened from
//                       L1 per 4 multiply-adds, as in GQA 32/8): the
//                       ceiling the transport and the instructions a step
//                       cannot skip set on this core.
//   shared_prompt_engine_speedup, shared_prompt_batchdecode_speedup
//                       tokens/s of decode steps of 64 forks of ONE
//                       2048-token context / of 64 forks of 64 distinct
//                       ones: the engine alone (AppendEach of 64) and
//                       BatchDecode calls of the 64 steps, alternately (a
//                       batch reads each shared chunk once per group of
//                       forks; shared_prompt_batchdecode_tokens_per_s).
//   latency_ctx{16,2048}_{total,transport,decode,queue,engine,encode}_p{50,99}_us
//                       one DecodeStep at a time, split with the server's
//                       own timestamps (server/decode_step_timing.h).
//
// The two sides of every ratio are measured alternately in the same run, so
// noise from other processes hits both. Contexts are built through the
// engine directly (not measured): 64 distinct 2048-token contexts, imported
// as snapshots of random K/V, in the quick run too. (Forks of a few shared
// prompts would let the engine-alone side's batches of 64 compute each
// shared chunk once per group of forks, a gain the served side gets only
// in the part of its batches that the streams' timing happens to gather.)
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_callback.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "attention/v1/attention.pb.h"
#include "bench/bench_echo.grpc.pb.h"
#include "bench/bench_report.h"
#include "bench/bench_util.h"
#include "bench/fma_probe.h"
#include "bench/process_usage.h"
#include "client/attention_client.h"
#include "client/blocking_bidi_stream.h"
#include "core/cpu/cpu_backend.h"
#include "core/dtype.h"
#include "core/engine.h"
#include "core/session_snapshot.h"
#include "core/session_spec.h"
#include "core/status_macros.h"
#include "core/tensor.h"
#include "server/attention_server.h"
#include "server/decode_step_timing.h"
#include "server/server_options.h"
#include "server/snapshot_store.h"

namespace attention::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kQHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kHeadDim = 128;
constexpr int64_t kRpcContext = 1024;
constexpr int64_t kShortContext = 16;
constexpr int64_t kBatchContext = 2048;
// Tokens a base context may grow to: the rounds append a few hundred steps.
constexpr int64_t kSetupCapacity = 2 * kBatchContext;
constexpr int kStreams = 64;
constexpr char kSection[] = "serving";
constexpr char kMobilitySection[] = "mobility";

double MicrosBetween(Clock::time_point begin, Clock::time_point end) {
  return std::chrono::duration<double, std::micro>(end - begin).count();
}

struct Percentiles {
  double p50 = 0, p99 = 0;
};
Percentiles Summarize(std::vector<double> samples) {
  Percentiles out;
  if (samples.empty()) return out;
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  out.p50 = samples[n / 2];
  out.p99 = samples[std::min(n - 1, n * 99 / 100)];
  return out;
}

// ---------------------------------------------------------------------------
// The echo services (bench_echo.proto).

// Answers with `response_bytes` bytes taken from the payload (zero-padded):
// like a decode step, the response bytes are written once.
void FillEcho(const echo::EchoRequest& request, echo::EchoResponse* response) {
  if (request.handler_busy_ns() > 0) {
    const Clock::time_point until =
        Clock::now() + std::chrono::nanoseconds(std::min<int64_t>(
                           request.handler_busy_ns(), int64_t{1000000000}));
    while (Clock::now() < until) {
    }
  }
  const size_t wanted = static_cast<size_t>(
      std::clamp<int64_t>(request.response_bytes(), 0, int64_t{64} << 20));
  std::string* out = response->mutable_payload();
  out->assign(request.payload(), 0, std::min(wanted, request.payload().size()));
  out->resize(wanted);
}

class SyncEchoService final : public echo::Echo::Service {
 public:
  grpc::Status Echo(grpc::ServerContext* context,
                    const echo::EchoRequest* request,
                    echo::EchoResponse* response) override {
    FillEcho(*request, response);
    return grpc::Status::OK;
  }
  grpc::Status EchoStream(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<echo::EchoResponse, echo::EchoRequest>* stream)
      override {
    echo::EchoRequest request;
    echo::EchoResponse response;
    while (stream->Read(&request)) {
      FillEcho(request, &response);
      if (!stream->Write(response)) break;
    }
    return grpc::Status::OK;
  }
};

// One echo stream on the callback API: read, answer, read again.
class EchoReactor final
    : public grpc::ServerBidiReactor<echo::EchoRequest, echo::EchoResponse> {
 public:
  EchoReactor() { StartRead(&request_); }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    FillEcho(request_, &response_);
    StartWrite(&response_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    StartRead(&request_);
  }
  void OnDone() override { delete this; }

 private:
  echo::EchoRequest request_;
  echo::EchoResponse response_;
};

class CallbackEchoService final : public echo::CallbackEcho::CallbackService {
 public:
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* context,
                                 const echo::EchoRequest* request,
                                 echo::EchoResponse* response) override {
    FillEcho(*request, response);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  grpc::ServerBidiReactor<echo::EchoRequest, echo::EchoResponse>* EchoStream(
      grpc::CallbackServerContext* context) override {
    return new EchoReactor();
  }
};

// ---------------------------------------------------------------------------
// Sessions and requests.

SessionSpec BenchSpec() {
  SessionSpec spec;
  spec.num_layers = 1;
  spec.num_q_heads = kQHeads;
  spec.num_kv_heads = kKvHeads;
  spec.head_dim = kHeadDim;
  spec.kv_dtype = DType::kFloat16;
  spec.model = "attn-bench";
  return spec;
}

// `count` uniform values in [-1, 1) as float16 bytes.
std::string RandomHalfBytes(int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = uniform(rng);
  std::string bytes(static_cast<size_t>(count * 2), '\0');
  ConvertFromFloat(values.data(), count, DType::kFloat16,
                   reinterpret_cast<std::byte*>(bytes.data()));
  return bytes;
}

TensorView HalfView(const std::string& bytes, Shape shape) {
  TensorView view;
  view.dtype = DType::kFloat16;
  view.shape = std::move(shape);
  view.data = reinterpret_cast<const std::byte*>(bytes.data());
  view.size_bytes = static_cast<int64_t>(bytes.size());
  return view;
}

// A session of `tokens` tokens of random float16 history (room for
// `capacity` >= tokens), created through the snapshot import path:
// prefilling a long context computes its attention, seconds per 2048
// tokens on 2 cores, where only the K/V bytes matter here. The 1 MiB of
// random rows repeats.
absl::StatusOr<std::string> SyntheticSession(AttentionEngine& engine,
                                             int64_t tokens, uint32_t seed,
                                             int64_t capacity = 0) {
  SessionSpec spec = BenchSpec();
  spec.max_tokens = std::max(tokens, capacity);
  SnapshotHeader header;
  ATTN_ASSIGN_OR_RETURN(
      header.spec, ResolveSessionSpec(spec, engine.options().sessions.limits));
  header.kv_dtype = header.spec.kv_dtype;
  header.layer_lengths = {tokens};
  header.first_positions = {0};
  header.idle_timeout_ms = 3600 * 1000;
  header.idle_deadline_unix_ms = absl::ToUnixMillis(absl::Now()) + 3600 * 1000;
  const int64_t row_bytes = int64_t{kKvHeads} * kHeadDim * 2;
  header.kv_bytes = tokens * 2 * row_bytes;
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<SessionImport> import,
                        engine.BeginImport(header, ImportOptions{}));
  SnapshotChecksum checksum;
  checksum.AddHeader(header);
  const int64_t per_chunk = kSnapshotChunkTargetBytes / (2 * row_bytes);
  const std::string rows =
      RandomHalfBytes(per_chunk * kKvHeads * kHeadDim, seed);
  SnapshotChunk chunk;
  int64_t chunks = 0;
  for (int64_t start = 0; start < tokens; start += per_chunk) {
    chunk.layer = 0;
    chunk.start = start;
    chunk.num_tokens = std::min(per_chunk, tokens - start);
    chunk.k.assign(rows, 0, chunk.num_tokens * row_bytes);
    chunk.v = chunk.k;
    ATTN_RETURN_IF_ERROR(import->AddChunk(chunk));
    checksum.AddChunk(chunk);
    ++chunks;
  }
  ATTN_ASSIGN_OR_RETURN(
      SessionInfo info,
      import->Finish({.num_chunks = chunks, .checksum = checksum.value()}));
  return info.session_id;
}

// A session holding `tokens` tokens of random history.
absl::StatusOr<std::string> PrefilledSession(AttentionEngine& engine,
                                             int64_t tokens, uint32_t seed) {
  ATTN_ASSIGN_OR_RETURN(SessionInfo info,
                        engine.CreateSession(BenchSpec(), absl::Hours(1)));
  const std::string q = RandomHalfBytes(tokens * kQHeads * kHeadDim, seed);
  const std::string k = RandomHalfBytes(tokens * kKvHeads * kHeadDim, seed + 1);
  const std::string v = RandomHalfBytes(tokens * kKvHeads * kHeadDim, seed + 2);
  AppendRequest request;
  request.session_id = info.session_id;
  request.q = HalfView(q, {tokens, kQHeads, kHeadDim});
  request.k = HalfView(k, {tokens, kKvHeads, kHeadDim});
  request.v = HalfView(v, {tokens, kKvHeads, kHeadDim});
  ATTN_RETURN_IF_ERROR(engine.Append(request).status());
  return info.session_id;
}

void SetHalfTensor(const std::string& bytes,
                   std::initializer_list<int64_t> shape, v1::Tensor* tensor) {
  tensor->set_dtype(v1::DTYPE_FLOAT16);
  for (int64_t dim : shape) tensor->add_shape(dim);
  tensor->set_data(bytes);
}

// One decode step (fp16 in, fp16 out) for `session`.
v1::DecodeRequest MakeDecodeRequest(const std::string& session, uint32_t seed) {
  v1::DecodeRequest request;
  request.set_session_id(session);
  request.set_layer(0);
  SetHalfTensor(RandomHalfBytes(kQHeads * kHeadDim, seed),
                {1, kQHeads, kHeadDim}, request.mutable_q());
  SetHalfTensor(RandomHalfBytes(kKvHeads * kHeadDim, seed + 1),
                {1, kKvHeads, kHeadDim}, request.mutable_k());
  SetHalfTensor(RandomHalfBytes(kKvHeads * kHeadDim, seed + 2),
                {1, kKvHeads, kHeadDim}, request.mutable_v());
  request.set_output_dtype(v1::DTYPE_FLOAT16);
  return request;
}

// The same step as an engine request viewing `request`'s bytes.
AppendRequest EngineRequest(const v1::DecodeRequest& request) {
  AppendRequest append;
  append.session_id = request.session_id();
  append.q = HalfView(request.q().data(), {1, kQHeads, kHeadDim});
  append.k = HalfView(request.k().data(), {1, kKvHeads, kHeadDim});
  append.v = HalfView(request.v().data(), {1, kKvHeads, kHeadDim});
  append.output_dtype = DType::kFloat16;
  append.required_tokens = 1;
  return append;
}

// An echo request carrying a decode step's bytes both ways.
echo::EchoRequest MakeEchoRequest(const v1::DecodeRequest& step) {
  echo::EchoRequest request;
  request.set_payload(
      absl::StrCat(step.q().data(), step.k().data(), step.v().data()));
  request.set_response_bytes(int64_t{kQHeads} * kHeadDim * 2);
  return request;
}

// ---------------------------------------------------------------------------
// The measurements.

// Collects the server's DecodeStep timings (ServerOptions::
// on_decode_step_timing) while armed.
struct TimingCollector {
  std::atomic<bool> armed{false};
  absl::Mutex mu;
  std::vector<server::DecodeStepTiming> timings ABSL_GUARDED_BY(mu);

  void Record(const server::DecodeStepTiming& timing) {
    if (!armed.load(std::memory_order_relaxed)) return;
    absl::MutexLock lock(&mu);
    timings.push_back(timing);
  }
  size_t count() {
    absl::MutexLock lock(&mu);
    return timings.size();
  }
};

struct Harness {
  server::AttentionServer* server;
  client::AttentionClient* client;
  echo::Echo::Stub* echo;
  echo::CallbackEcho::Stub* callback_echo;
  const BenchOptions* options;
  BenchReport* report;
  TimingCollector* timings = nullptr;
};

absl::Status UnaryEcho(echo::Echo::Stub* stub,
                       const echo::EchoRequest& request) {
  grpc::ClientContext context;
  echo::EchoResponse response;
  return client::FromGrpcStatus(stub->Echo(&context, request, &response));
}
absl::Status UnaryEcho(echo::CallbackEcho::Stub* stub,
                       const echo::EchoRequest& request) {
  grpc::ClientContext context;
  echo::EchoResponse response;
  return client::FromGrpcStatus(stub->Echo(&context, request, &response));
}

// (a) DecodeStep vs echo of the same bytes, one call at a time, at
// `context` tokens. The headline figures use kRpcContext; `suffix` names
// the others' figures.
absl::Status MeasureRpcOverhead(const Harness& h,
                                const std::string& base_session,
                                int64_t context, const std::string& suffix) {
  AttentionEngine& engine = h.server->engine();
  ATTN_ASSIGN_OR_RETURN(SessionInfo fork, engine.ForkSession(base_session));
  ATTN_RETURN_IF_ERROR(
      engine.TruncateSession(fork.session_id, context).status());
  const v1::DecodeRequest step = MakeDecodeRequest(fork.session_id, 77);
  const AppendRequest engine_step = EngineRequest(step);
  const echo::EchoRequest echo_request = MakeEchoRequest(step);

  const int samples = h.options->quick ? 800 : 3000;
  const int warmup = 30;
  // An echo whose handler busy-waits as long as the engine takes (the
  // median so far, warm-up included): it tells the serving path's own cost
  // from what any RPC with a handler that long pays in transport time (on
  // the 2-vCPU VM, tens of microseconds more than a bare echo).
  echo::EchoRequest busy_echo_request = echo_request;
  std::vector<double> engine_so_far_us;
  double busy_us = 0;
  std::vector<double> decode_us, echo_us, callback_echo_us, engine_us,
      busy_echo_us;
  for (int i = -warmup; i < samples; ++i) {
    // Each iteration appends two tokens (DecodeStep and engine Append):
    // cut back to `context` (untimed) so every sample sees the same length.
    ATTN_RETURN_IF_ERROR(
        engine.TruncateSession(fork.session_id, context).status());
    if (!engine_so_far_us.empty() && (i + warmup) % 25 == 0) {
      busy_us = Summarize(engine_so_far_us).p50;
      busy_echo_request.set_handler_busy_ns(
          static_cast<int64_t>(busy_us * 1e3));
    }
    // Rotate the order so that no side always runs right after another.
    for (int j = 0; j < 5; ++j) {
      const int what = (i + j) % 5;
      const Clock::time_point begin = Clock::now();
      absl::Status status;
      if (what == 0) {
        status = h.client->DecodeStep(step).status();
      } else if (what == 1) {
        status = UnaryEcho(h.echo, echo_request);
      } else if (what == 2) {
        status = UnaryEcho(h.callback_echo, echo_request);
      } else if (what == 3) {
        status = engine.Append(engine_step).status();
      } else {
        status = UnaryEcho(h.echo, busy_echo_request);
      }
      const double elapsed = MicrosBetween(begin, Clock::now());
      ATTN_RETURN_IF_ERROR(status);
      if (what == 3) engine_so_far_us.push_back(elapsed);
      if (i < 0) continue;
      (what == 0   ? decode_us
       : what == 1 ? echo_us
       : what == 2 ? callback_echo_us
       : what == 3 ? engine_us
                   : busy_echo_us)
          .push_back(elapsed);
    }
  }
  ATTN_RETURN_IF_ERROR(engine.DeleteSession(fork.session_id));

  const Percentiles decode = Summarize(decode_us);
  const Percentiles echo = Summarize(echo_us);
  const Percentiles callback_echo = Summarize(callback_echo_us);
  const Percentiles engine_only = Summarize(engine_us);
  const Percentiles busy_echo = Summarize(busy_echo_us);
  BenchReport& r = *h.report;
  const std::string ctx = absl::StrCat("ctx ", context);
  r.AddRow(kSection,
           absl::StrCat("DecodeStep p50 (H=32 Hkv=8 d=128 fp16, ", ctx, ", ",
                        echo_request.payload().size(), " B in / ",
                        echo_request.response_bytes(), " B out)"),
           decode.p50, "us");
  r.AddRow(kSection, absl::StrCat("DecodeStep p99, ", ctx), decode.p99, "us");
  r.AddRow(kSection, "echo RPC, same bytes, p50 (sync API)", echo.p50, "us");
  r.AddRow(kSection, "echo RPC, same bytes, p99 (sync API)", echo.p99, "us");
  r.AddRow(kSection, "echo RPC, same bytes, p50 (callback API)",
           callback_echo.p50, "us");
  r.AddRow(kSection,
           absl::StrCat("engine Append alone (same step, no RPC) p50, ", ctx),
           engine_only.p50, "us");
  r.AddRow(
      kSection,
      absl::StrCat("rpc_overhead_ratio (DecodeStep p50 / echo p50), ", ctx),
      decode.p50 / echo.p50, "x");
  r.AddRow(kSection, "  excluding attention ((DecodeStep - engine) / echo)",
           (decode.p50 - engine_only.p50) / echo.p50, "x");
  r.AddRow(kSection,
           absl::StrCat("echo RPC whose handler busy-waits ",
                        absl::StrFormat("%.0f", busy_us),
                        " us (the engine's running p50), p50"),
           busy_echo.p50, "us");
  r.AddRow(kSection, "  DecodeStep p50 / that echo's p50",
           decode.p50 / busy_echo.p50, "x");
  r.AddFigure(absl::StrCat("rpc_overhead_ratio", suffix),
              decode.p50 / echo.p50);
  r.AddFigure(absl::StrCat("rpc_overhead_ratio_excluding_attention", suffix),
              (decode.p50 - engine_only.p50) / echo.p50);
  r.AddFigure(absl::StrCat("decodestep_p50_us", suffix), decode.p50);
  r.AddFigure(absl::StrCat("decodestep_p99_us", suffix), decode.p99);
  r.AddFigure(absl::StrCat("echo_p50_us", suffix), echo.p50);
  r.AddFigure(absl::StrCat("echo_p99_us", suffix), echo.p99);
  r.AddFigure(absl::StrCat("echo_callback_p50_us", suffix), callback_echo.p50);
  r.AddFigure(absl::StrCat("decodestep_engine_p50_us", suffix),
              engine_only.p50);
  r.AddFigure(absl::StrCat("busy_echo_p50_us", suffix), busy_echo.p50);
  r.AddFigure(absl::StrCat("rpc_overhead_ratio_vs_busy_echo", suffix),
              decode.p50 / busy_echo.p50);
  return absl::OkStatus();
}

// Counts the server's engine batches (ServerOptions::on_decode_batch).
struct BatchCounter {
  std::atomic<int64_t> batches{0};
  std::atomic<int64_t> steps{0};
};

struct RoundResult {
  double wall_us = 0;
  std::vector<double> step_us;
};

// 64 threads, each with its own Decode stream and session, `steps` steps
// each; all start together.
absl::StatusOr<RoundResult> BatchedRound(
    std::vector<std::unique_ptr<client::DecodeStream>>& streams,
    const std::vector<v1::DecodeRequest>& requests, int steps) {
  const size_t n = streams.size();
  absl::Notification start;
  Clock::time_point start_time;
  std::vector<Clock::time_point> end_times(n);
  std::vector<std::vector<double>> latencies(n);
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      latencies[i].reserve(steps);
      start.WaitForNotification();
      for (int s = 0; s < steps; ++s) {
        const Clock::time_point begin = Clock::now();
        auto result = streams[i]->Step(requests[i]);
        latencies[i].push_back(MicrosBetween(begin, Clock::now()));
        if (!result.ok()) {
          statuses[i] = result.status();
          break;
        }
      }
      end_times[i] = Clock::now();
    });
  }
  start_time = Clock::now();
  start.Notify();
  for (std::thread& thread : threads) thread.join();
  RoundResult round;
  Clock::time_point last = start_time;
  for (size_t i = 0; i < n; ++i) {
    ATTN_RETURN_IF_ERROR(statuses[i]);
    last = std::max(last, end_times[i]);
    round.step_us.insert(round.step_us.end(), latencies[i].begin(),
                         latencies[i].end());
  }
  round.wall_us = MicrosBetween(start_time, last);
  return round;
}

// The same steps, one DecodeStep at a time (step s of every session, then
// step s + 1).
absl::StatusOr<RoundResult> SequentialRound(
    client::AttentionClient& client,
    const std::vector<v1::DecodeRequest>& requests, int steps) {
  RoundResult round;
  round.step_us.reserve(requests.size() * steps);
  const Clock::time_point start = Clock::now();
  for (int s = 0; s < steps; ++s) {
    for (const v1::DecodeRequest& request : requests) {
      const Clock::time_point begin = Clock::now();
      ATTN_RETURN_IF_ERROR(client.DecodeStep(request).status());
      round.step_us.push_back(MicrosBetween(begin, Clock::now()));
    }
  }
  round.wall_us = MicrosBetween(start, Clock::now());
  return round;
}

// The same steps as BatchDecode calls of all 64 steps, one call after the
// other from one thread.
absl::StatusOr<RoundResult> BatchDecodeRound(
    client::AttentionClient& client,
    const std::vector<v1::DecodeRequest>& requests, int steps) {
  v1::BatchDecodeRequest batch;
  for (const v1::DecodeRequest& request : requests) {
    *batch.add_steps() = request;
  }
  RoundResult round;
  const Clock::time_point start = Clock::now();
  for (int s = 0; s < steps; ++s) {
    ATTN_RETURN_IF_ERROR(client.BatchDecode(batch).status());
  }
  round.wall_us = MicrosBetween(start, Clock::now());
  return round;
}

// The same steps straight into the engine, without RPC: one Append at a
// time, or (batched) one AppendEach of every session's step per step.
absl::StatusOr<RoundResult> EngineRound(AttentionEngine& engine,
                                        const std::vector<AppendRequest>& steps,
                                        int count, bool batched) {
  RoundResult round;
  const Clock::time_point start = Clock::now();
  for (int s = 0; s < count; ++s) {
    if (batched) {
      for (const auto& result : engine.AppendEach(steps)) {
        ATTN_RETURN_IF_ERROR(result.status());
      }
      continue;
    }
    for (const AppendRequest& step : steps) {
      ATTN_RETURN_IF_ERROR(engine.Append(step).status());
    }
  }
  round.wall_us = MicrosBetween(start, Clock::now());
  return round;
}

// The client side of an echo stream: the client library's
// BlockingBidiStream (gRPC's callback API; what client::DecodeStream runs
// on, so the echo moves its bytes as the Decode streams do), or gRPC's
// synchronous stream.
enum class EchoClient { kBlockingBidi, kSync };

// 64 echo streams on one API, `messages` round trips each; messages/s.
template <typename Stub>
absl::StatusOr<double> EchoStreamRound(
    Stub* stub, const echo::EchoRequest& request, int messages,
    EchoClient client_kind = EchoClient::kBlockingBidi) {
  absl::Notification start;
  Clock::time_point start_time;
  std::vector<Clock::time_point> end_times(kStreams);
  std::vector<absl::Status> statuses(kStreams);
  std::atomic<int> ready{0};
  // One stream's round trips, then its close; its status.
  auto run = [&](auto& stream, int i) -> grpc::Status {
    echo::EchoResponse response;
    ready.fetch_add(1);
    start.WaitForNotification();
    for (int m = 0; m < messages; ++m) {
      // BlockingBidiStream's Step, as client::DecodeStream::Step uses it.
      bool ok;
      if constexpr (requires { stream.Step(request, &response); }) {
        ok = stream.Step(request, &response);
      } else {
        ok = stream.Write(request) && stream.Read(&response);
      }
      if (!ok) {
        statuses[i] = absl::UnavailableError("echo stream broke");
        break;
      }
    }
    end_times[i] = Clock::now();
    stream.WritesDone();
    return stream.Finish();
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext context;
      grpc::Status status;
      if (client_kind == EchoClient::kSync) {
        auto stream = stub->EchoStream(&context);
        status = run(*stream, i);
      } else {
        client::BlockingBidiStream<echo::EchoRequest, echo::EchoResponse>
            stream(&context, [stub](grpc::ClientContext* ctx, auto* reactor) {
              stub->async()->EchoStream(ctx, reactor);
            });
        status = run(stream, i);
      }
      if (statuses[i].ok()) statuses[i] = client::FromGrpcStatus(status);
    });
  }
  while (ready.load() < kStreams) std::this_thread::yield();
  start_time = Clock::now();
  start.Notify();
  for (std::thread& thread : threads) thread.join();
  Clock::time_point last = start_time;
  for (int i = 0; i < kStreams; ++i) {
    ATTN_RETURN_IF_ERROR(statuses[i]);
    last = std::max(last, end_times[i]);
  }
  return double{kStreams} * messages / (MicrosBetween(start_time, last) * 1e-6);
}

// One side of a ratio: what its rounds took over `units` steps (or echo
// messages): wall time, and the process's CPU time and context switches.
struct SideCost {
  double wall_us = 0;
  ProcessUsage usage;
  double units = 0;

  void Add(double round_wall_us, const ProcessUsage& used, double count) {
    wall_us += round_wall_us;
    usage += used;
    units += count;
  }
  double Rate() const { return units / (wall_us * 1e-6); }
  double WallPerUnit() const { return wall_us / units; }
  double CpuPerUnit() const { return usage.cpu_us / units; }
  double SwitchesPerUnit() const { return usage.context_switches / units; }
};

// Wall time (us) of one EchoStreamRound of `messages` per stream.
absl::StatusOr<double> EchoRoundWall(const Harness& h,
                                     const echo::EchoRequest& request,
                                     int messages) {
  ATTN_ASSIGN_OR_RETURN(double rate,
                        EchoStreamRound(h.callback_echo, request, messages));
  return double{kStreams} * messages / rate * 1e6;
}

// Runs `round` (its wall time in us, or an error) and adds it to `side`,
// with the process usage it took, as kStreams * `per_stream` units.
template <typename Round>
absl::Status Metered(SideCost& side, int per_stream, Round&& round) {
  const ProcessUsage before = ProcessUsage::Now();
  ATTN_ASSIGN_OR_RETURN(const double wall_us, round());
  side.Add(wall_us, ProcessUsage::Now() - before,
           double{kStreams} * per_stream);
  return absl::OkStatus();
}

// Where a served step's time goes, against the two things it is made of:
// the same bytes through the transport (64 callback-API echo streams) and
// the same steps in the engine alone. Per step (per echo message), all
// measured in the same rounds: CPU time of the whole process (client,
// transport, server, engine: they share the cores) and context switches;
// the serving path's own CPU (served - engine - echo); and, for the figure
// `ratio_name` = served rate / `reference`'s rate (`reference` is `engine`
// or `echo`), the ratio the served streams would reach if a step took just
// the engine's wall time plus the echo's (`additive_bound`).
void ReportCostSplit(const Harness& h, const std::string& suffix,
                     const SideCost& served, const SideCost& engine,
                     const SideCost& echo, const SideCost& reference,
                     const std::string& ratio_name) {
  BenchReport& r = *h.report;
  const double ratio = served.Rate() / reference.Rate();
  const double additive_bound =
      reference.WallPerUnit() / (engine.WallPerUnit() + echo.WallPerUnit());
  const double own =
      served.CpuPerUnit() - engine.CpuPerUnit() - echo.CpuPerUnit();
  const std::string at = absl::StrCat(" (", suffix.substr(1), ")");
  r.AddRow(kSection, "CPU per step: 64 Decode streams" + at,
           served.CpuPerUnit(), "us");
  r.AddRow(kSection, "CPU per step: engine alone" + at, engine.CpuPerUnit(),
           "us");
  r.AddRow(kSection, "CPU per message: 64 callback echo streams" + at,
           echo.CpuPerUnit(), "us");
  r.AddRow(kSection,
           "CPU per step: serving path's own (served - engine - echo)" + at,
           own, "us");
  r.AddRow(kSection, "context switches per step: streams / echo" + at,
           served.SwitchesPerUnit() / echo.SwitchesPerUnit(), "x");
  r.AddRow(kSection, ratio_name + " if a step cost engine + echo wall time",
           additive_bound, "x");
  r.AddRow(kSection, ratio_name + " / that bound", ratio / additive_bound, "x");
  r.AddFigure("stream64_cpu_us_per_step" + suffix, served.CpuPerUnit());
  r.AddFigure("engine_cpu_us_per_step" + suffix, engine.CpuPerUnit());
  r.AddFigure("echo_stream64_cpu_us_per_msg" + suffix, echo.CpuPerUnit());
  r.AddFigure("serving_path_cpu_us_per_step" + suffix, own);
  r.AddFigure("stream64_switches_per_step" + suffix, served.SwitchesPerUnit());
  r.AddFigure("echo_stream64_switches_per_msg" + suffix,
              echo.SwitchesPerUnit());
  r.AddFigure(ratio_name + "_additive_bound", additive_bound);
  r.AddFigure(ratio_name + "_of_bound", ratio / additive_bound);
}

// (b) 64 concurrent Decode streams vs the same steps one at a time. The
// engine's own rates for the same steps (no RPC) bound what the service
// could reach.

absl::Status MeasureBatching(const Harness& h,
                             const std::vector<std::string>& bases,
                             const BatchCounter& counter) {
  AttentionEngine& engine = h.server->engine();
  std::vector<std::string> sessions;
  std::vector<v1::DecodeRequest> requests;
  for (int i = 0; i < kStreams; ++i) {
    ATTN_ASSIGN_OR_RETURN(SessionInfo fork,
                          engine.ForkSession(bases[i % bases.size()]));
    sessions.push_back(fork.session_id);
    requests.push_back(MakeDecodeRequest(fork.session_id, 1000 + 3 * i));
  }
  std::vector<std::unique_ptr<client::DecodeStream>> streams;
  for (int i = 0; i < kStreams; ++i) {
    streams.push_back(h.client->OpenDecodeStream());
  }

  std::vector<AppendRequest> engine_steps;
  for (const v1::DecodeRequest& request : requests) {
    engine_steps.push_back(EngineRequest(request));
  }

  const int steps = h.options->quick ? 8 : 16;
  const int rounds = h.options->quick ? 4 : 6;
  const echo::EchoRequest echo_request = MakeEchoRequest(requests[0]);
  // Echo streams are opened per round (the Decode streams stay open):
  // enough messages that opening them costs little per message.
  const int echo_messages = 40;
  // Warm-up: every stream and session once each way.
  ATTN_RETURN_IF_ERROR(BatchedRound(streams, requests, 1).status());
  ATTN_RETURN_IF_ERROR(SequentialRound(*h.client, requests, 1).status());
  ATTN_RETURN_IF_ERROR(BatchDecodeRound(*h.client, requests, 1).status());
  ATTN_RETURN_IF_ERROR(EchoRoundWall(h, echo_request, 1).status());

  // The sides, in the order of the first round (each later round starts one
  // further on). Every side but the echo moves kStreams * steps tokens.
  enum Side {
    kServedStreams,
    kServedSequential,
    kEngineSequential,
    kEngineBatched,
    kServedBatchDecode,
    kEchoStreams,
    kNumSides
  };
  SideCost cost[kNumSides];
  std::vector<double> batched_us, sequential_us;
  int64_t batches = 0, batched_steps = 0;
  for (int round = 0; round < rounds; ++round) {
    for (int side = 0; side < kNumSides; ++side) {
      const Side what = static_cast<Side>((side + round) % kNumSides);
      const ProcessUsage before = ProcessUsage::Now();
      double wall = 0;
      if (what == kServedBatchDecode) {
        ATTN_ASSIGN_OR_RETURN(RoundResult result,
                              BatchDecodeRound(*h.client, requests, steps));
        wall = result.wall_us;
      } else if (what == kEngineSequential || what == kEngineBatched) {
        ATTN_ASSIGN_OR_RETURN(RoundResult result,
                              EngineRound(engine, engine_steps, steps,
                                          /*batched=*/what == kEngineBatched));
        wall = result.wall_us;
      } else if (what == kEchoStreams) {
        ATTN_ASSIGN_OR_RETURN(wall,
                              EchoRoundWall(h, echo_request, echo_messages));
      } else if (what == kServedStreams) {
        const int64_t batches_before = counter.batches.load();
        const int64_t steps_before = counter.steps.load();
        ATTN_ASSIGN_OR_RETURN(RoundResult result,
                              BatchedRound(streams, requests, steps));
        batches += counter.batches.load() - batches_before;
        batched_steps += counter.steps.load() - steps_before;
        wall = result.wall_us;
        batched_us.insert(batched_us.end(), result.step_us.begin(),
                          result.step_us.end());
      } else {
        ATTN_ASSIGN_OR_RETURN(RoundResult result,
                              SequentialRound(*h.client, requests, steps));
        wall = result.wall_us;
        sequential_us.insert(sequential_us.end(), result.step_us.begin(),
                             result.step_us.end());
      }
      cost[what].Add(
          wall, ProcessUsage::Now() - before,
          double{kStreams} * (what == kEchoStreams ? echo_messages : steps));
    }
  }
  for (auto& stream : streams) ATTN_RETURN_IF_ERROR(stream->Finish());
  for (const std::string& id : sessions) {
    ATTN_RETURN_IF_ERROR(engine.DeleteSession(id));
  }

  const double batched_rate = cost[kServedStreams].Rate();
  const double sequential_rate = cost[kServedSequential].Rate();
  const double engine_sequential_rate = cost[kEngineSequential].Rate();
  const double engine_batched_rate = cost[kEngineBatched].Rate();
  const double batch_decode_rate = cost[kServedBatchDecode].Rate();
  const Percentiles batched = Summarize(batched_us);
  const Percentiles sequential = Summarize(sequential_us);
  const double mean_batch =
      batches > 0 ? static_cast<double>(batched_steps) / batches : 0.0;
  BenchReport& r = *h.report;
  r.AddRow(kSection,
           absl::StrCat("64 Decode streams, ctx ", kBatchContext, ": tokens/s"),
           batched_rate, "tok/s");
  r.AddRow(kSection, "same steps one DecodeStep at a time: tokens/s",
           sequential_rate, "tok/s");
  r.AddRow(kSection, "batching_speedup", batched_rate / sequential_rate, "x");
  r.AddRow(kSection, "64 streams: step latency p50", batched.p50, "us");
  r.AddRow(kSection, "64 streams: step latency p99", batched.p99, "us");
  r.AddRow(kSection, "64 streams: mean engine batch", mean_batch, "steps");
  r.AddRow(kSection, "one at a time: step latency p50", sequential.p50, "us");
  r.AddRow(kSection, "one at a time: step latency p99", sequential.p99, "us");
  r.AddRow(kSection, "engine alone (no RPC), one Append at a time: tokens/s",
           engine_sequential_rate, "tok/s");
  r.AddRow(kSection, "engine alone (no RPC), AppendEach of 64: tokens/s",
           engine_batched_rate, "tok/s");
  r.AddRow(kSection, "bound on batching_speedup (engine batched / sequential)",
           engine_batched_rate / sequential_rate, "x");
  r.AddRow(kSection, "BatchDecode calls of the 64 steps: tokens/s",
           batch_decode_rate, "tok/s");
  r.AddRow(kSection,
           "served_vs_engine_stream64 (64 streams / engine AppendEach of 64)",
           batched_rate / engine_batched_rate, "x");
  r.AddRow(kSection,
           "served_vs_engine_batchdecode64 (BatchDecode of 64 / engine "
           "AppendEach of 64)",
           batch_decode_rate / engine_batched_rate, "x");
  r.AddFigure("served_vs_engine_stream64", batched_rate / engine_batched_rate);
  ReportCostSplit(h, absl::StrCat("_ctx", kBatchContext), cost[kServedStreams],
                  cost[kEngineBatched], cost[kEchoStreams],
                  /*reference=*/cost[kEngineBatched],
                  "served_vs_engine_stream64");
  r.AddFigure("served_vs_engine_batchdecode64",
              batch_decode_rate / engine_batched_rate);
  r.AddFigure("batchdecode64_tokens_per_s", batch_decode_rate);
  r.AddFigure("engine_sequential_tokens_per_s", engine_sequential_rate);
  r.AddFigure("engine_batched_tokens_per_s", engine_batched_rate);
  r.AddFigure("batching_speedup_engine_bound",
              engine_batched_rate / sequential_rate);
  r.AddFigure("batching_speedup", batched_rate / sequential_rate);
  r.AddFigure("batched_tokens_per_s", batched_rate);
  r.AddFigure("sequential_tokens_per_s", sequential_rate);
  r.AddFigure("batched_step_p50_us", batched.p50);
  r.AddFigure("batched_step_p99_us", batched.p99);
  r.AddFigure("sequential_step_p50_us", sequential.p50);
  r.AddFigure("sequential_step_p99_us", sequential.p99);
  r.AddFigure("batched_mean_batch_size", mean_batch);
  return absl::OkStatus();
}

// (c) Sync vs callback API at 64 concurrent streams: the server's API (with
// gRPC's synchronous client streams, as before), and the client's (the
// callback server with the library's BlockingBidiStream).
absl::Status MeasureApis(const Harness& h, const std::string& session) {
  const echo::EchoRequest request =
      MakeEchoRequest(MakeDecodeRequest(session, 5));
  const int messages = h.options->quick ? 40 : 200;
  const int rounds = h.options->quick ? 3 : 5;
  // (stub, client) of each side.
  auto side_round = [&](int side, int count) -> absl::StatusOr<double> {
    if (side == 0) {
      return EchoStreamRound(h.echo, request, count, EchoClient::kSync);
    }
    return EchoStreamRound(
        h.callback_echo, request, count,
        side == 1 ? EchoClient::kSync : EchoClient::kBlockingBidi);
  };
  constexpr int kSides = 3;
  for (int side = 0; side < kSides; ++side) {
    ATTN_RETURN_IF_ERROR(side_round(side, 4).status());
  }
  double sum[kSides] = {0, 0, 0};
  for (int round = 0; round < rounds; ++round) {
    for (int i = 0; i < kSides; ++i) {
      const int side = (i + round) % kSides;
      ATTN_ASSIGN_OR_RETURN(double rate, side_round(side, messages));
      sum[side] += rate;
    }
  }
  const double sync_rate = sum[0] / rounds;
  const double callback_rate = sum[1] / rounds;
  const double blocking_bidi_rate = sum[2] / rounds;
  BenchReport& r = *h.report;
  r.AddRow(kSection, "64 echo streams, sync API: messages/s", sync_rate,
           "msg/s");
  r.AddRow(kSection, "64 echo streams, callback API: messages/s", callback_rate,
           "msg/s");
  r.AddRow(kSection,
           "64 echo streams, callback API, BlockingBidiStream clients: "
           "messages/s",
           blocking_bidi_rate, "msg/s");
  r.AddFigure("echo_stream64_sync_msgs_per_s", sync_rate);
  r.AddFigure("echo_stream64_callback_msgs_per_s", callback_rate);
  r.AddFigure("callback_vs_sync_stream_ratio", callback_rate / sync_rate);
  r.AddFigure("echo_stream64_callback_blocking_bidi_msgs_per_s",
              blocking_bidi_rate);
  r.AddFigure("blocking_bidi_vs_sync_client_ratio",
              blocking_bidi_rate / callback_rate);
  return absl::OkStatus();
}

// (f) Shared prompts: decode steps of 64 forks of ONE 2048-token context
// (parallel sampling, beam search, a common system prompt: one batch reads
// each shared 512-key chunk once per group of forks, see
// core/cpu/shared_chunks.h) against 64 forks of the 64 distinct contexts,
// through the engine alone (AppendEach of 64) and served (BatchDecode calls
// of the 64 steps), the four sides alternately. Outputs are bitwise those
// of decoding each fork alone (tested in tests/core/cpu); this measures
// only the speed.
absl::Status MeasureSharedPrompt(const Harness& h,
                                 const std::vector<std::string>& bases) {
  AttentionEngine& engine = h.server->engine();
  enum Kind { kShared, kDistinct, kNumKinds };
  std::vector<std::string> sessions;
  std::vector<v1::DecodeRequest> requests[kNumKinds];
  std::vector<AppendRequest> engine_steps[kNumKinds];
  for (int kind = 0; kind < kNumKinds; ++kind) {
    for (int i = 0; i < kStreams; ++i) {
      ATTN_ASSIGN_OR_RETURN(
          SessionInfo fork,
          engine.ForkSession(bases[kind == kShared ? 0 : i % bases.size()]));
      sessions.push_back(fork.session_id);
      requests[kind].push_back(
          MakeDecodeRequest(fork.session_id, 5000 + 100 * kind + 3 * i));
    }
    for (const v1::DecodeRequest& request : requests[kind]) {
      engine_steps[kind].push_back(EngineRequest(request));
    }
  }
  const int steps = h.options->quick ? 4 : 8;
  const int rounds = h.options->quick ? 3 : 5;
  enum Side {
    kEngineShared,
    kEngineDistinct,
    kServedShared,
    kServedDistinct,
    kNumSides
  };
  for (int kind = 0; kind < kNumKinds; ++kind) {  // warm-up
    ATTN_RETURN_IF_ERROR(
        BatchDecodeRound(*h.client, requests[kind], 1).status());
  }
  SideCost cost[kNumSides];
  for (int round = 0; round < rounds; ++round) {
    for (int side = 0; side < kNumSides; ++side) {
      const Side what = static_cast<Side>((side + round) % kNumSides);
      const Kind kind =
          what == kEngineShared || what == kServedShared ? kShared : kDistinct;
      const ProcessUsage before = ProcessUsage::Now();
      absl::StatusOr<RoundResult> result =
          what == kEngineShared || what == kEngineDistinct
              ? EngineRound(engine, engine_steps[kind], steps, /*batched=*/true)
              : BatchDecodeRound(*h.client, requests[kind], steps);
      ATTN_RETURN_IF_ERROR(result.status());
      cost[what].Add(result->wall_us, ProcessUsage::Now() - before,
                     double{kStreams} * steps);
    }
  }
  for (const std::string& id : sessions) {
    ATTN_RETURN_IF_ERROR(engine.DeleteSession(id));
  }
  const double engine_speedup =
      cost[kEngineShared].Rate() / cost[kEngineDistinct].Rate();
  const double served_speedup =
      cost[kServedShared].Rate() / cost[kServedDistinct].Rate();
  BenchReport& r = *h.report;
  r.AddRow(kSection,
           absl::StrCat("engine alone, AppendEach of 64 forks of one ",
                        kBatchContext, "-token prompt: tokens/s"),
           cost[kEngineShared].Rate(), "tok/s");
  r.AddRow(kSection, "same, 64 forks of 64 distinct contexts: tokens/s",
           cost[kEngineDistinct].Rate(), "tok/s");
  r.AddRow(kSection, "shared_prompt_engine_speedup", engine_speedup, "x");
  r.AddRow(kSection, "BatchDecode of 64 forks of one prompt: tokens/s",
           cost[kServedShared].Rate(), "tok/s");
  r.AddRow(kSection, "same, 64 forks of 64 distinct contexts: tokens/s",
           cost[kServedDistinct].Rate(), "tok/s");
  r.AddRow(kSection, "shared_prompt_batchdecode_speedup", served_speedup, "x");
  r.AddFigure("shared_prompt_engine_speedup", engine_speedup);
  r.AddFigure("shared_prompt_batchdecode_speedup", served_speedup);
  r.AddFigure("shared_prompt_batchdecode_tokens_per_s",
              cost[kServedShared].Rate());
  return absl::OkStatus();
}

// The most stream64_vs_callback_echo_ctx16 could be if a served step cost
// the CPU of an echo message plus nothing but its attention's multiply-adds
// at one thread's peak rate (the multiply-add probe): a step at message m
// of a round (0-based) attends over kShortContext + m + 1 keys, each a
// head_dim multiply-add for Q.K and one for P.V per query head. And the
// most it could be if those multiply-adds also paid for the widening of
// the float16 K and V they read (the widening probe: one widened vector
// per 4 multiply-adds, as GQA 32/8 shares each among 4 query heads), which
// the documented float32 numerics over float16 KV cannot skip. Only for
// the CPU backend (its kernel ISA's probes), alternately 5 times each.
void ReportFmaBound(const Harness& h, const SideCost& echo, int messages) {
  const auto* cpu_backend =
      dynamic_cast<const CpuBackend*>(&h.server->engine().backend());
  if (cpu_backend == nullptr) return;
  const cpu::KernelTable& kernels = KernelsOf(*cpu_backend);
  float sink = 0;
  const int64_t rounds = 8 * FmaProbeRounds(kernels, &sink);
  std::vector<double> peaks, widen_peaks;
  for (int rep = 0; rep < 5; ++rep) {
    peaks.push_back(OneThreadFmaPeak(kernels, rounds, &sink));
    widen_peaks.push_back(OneThreadFmaWidenPeak(kernels, rounds, &sink));
  }
  const double mean_keys = kShortContext + (messages + 1) / 2.0;
  const double flops_per_step = mean_keys * kQHeads * 4.0 * kHeadDim;
  const double echo_us = echo.CpuPerUnit();
  const double fma_us = flops_per_step / Median(peaks) * 1e6;
  const double widen_us = flops_per_step / Median(widen_peaks) * 1e6;
  const double bound = echo_us / (echo_us + fma_us);
  const double widen_bound = echo_us / (echo_us + widen_us);
  BenchReport& r = *h.report;
  r.AddRow(kSection,
           absl::StrCat("CPU per step of its multiply-adds at one thread's "
                        "peak (ctx", kShortContext, ")"),
           fma_us, "us");
  r.AddRow(kSection,
           "stream64_vs_callback_echo_ctx16 if a step cost echo CPU + those",
           bound, "x");
  r.AddRow(kSection,
           "same multiply-adds with their float16 widenings, at one "
           "thread's peak",
           widen_us, "us");
  r.AddRow(kSection,
           "stream64_vs_callback_echo_ctx16 if a step cost echo CPU + those",
           widen_bound, "x");
  r.AddFigure("fma_floor_cpu_us_per_step_ctx16", fma_us);
  r.AddFigure("stream64_vs_callback_echo_ctx16_fma_bound", bound);
  r.AddFigure("widening_floor_cpu_us_per_step_ctx16", widen_us);
  r.AddFigure("stream64_vs_callback_echo_ctx16_widening_bound", widen_bound);
  if (sink == 42.0f) std::printf(" ");  // keeps the probe's results alive
}

// (e) Small steps at the transport's limit: 64 Decode streams at context 16
// (attention is a few microseconds) vs 64 callback-API echo streams moving
// the same bytes, alternately. The sessions are cut back to 16 tokens
// before each round (untimed).
absl::Status MeasureSmallSteps(const Harness& h) {
  AttentionEngine& engine = h.server->engine();
  std::vector<std::string> sessions;
  std::vector<v1::DecodeRequest> requests;
  // Sessions of their own (not forks of the long contexts, whose shared
  // blocks a batched decode would treat as a shared prompt).
  for (int i = 0; i < kStreams; ++i) {
    ATTN_ASSIGN_OR_RETURN(
        std::string id, PrefilledSession(engine, kShortContext, 3000 + 7 * i));
    sessions.push_back(id);
    requests.push_back(MakeDecodeRequest(id, 2000 + 3 * i));
  }
  const echo::EchoRequest echo_request = MakeEchoRequest(requests[0]);
  std::vector<std::unique_ptr<client::DecodeStream>> streams;
  for (int i = 0; i < kStreams; ++i) {
    streams.push_back(h.client->OpenDecodeStream());
  }
  auto reset = [&]() -> absl::Status {
    for (const std::string& id : sessions) {
      ATTN_RETURN_IF_ERROR(engine.TruncateSession(id, kShortContext).status());
    }
    return absl::OkStatus();
  };
  // Rounds of 40 steps keep the contexts at 17-56 keys (what the figure's
  // name says); the full run takes more rounds, not longer ones.
  const int messages = 40;
  const int rounds = h.options->quick ? 3 : 15;
  ATTN_RETURN_IF_ERROR(BatchedRound(streams, requests, 4).status());
  ATTN_RETURN_IF_ERROR(
      EchoStreamRound(h.callback_echo, echo_request, 4).status());
  std::vector<AppendRequest> engine_steps;
  for (const v1::DecodeRequest& request : requests) {
    engine_steps.push_back(EngineRequest(request));
  }
  SideCost stream_cost, echo_cost, engine_cost;
  for (int round = 0; round < rounds; ++round) {
    ATTN_RETURN_IF_ERROR(reset());
    ATTN_RETURN_IF_ERROR(
        Metered(engine_cost, messages, [&]() -> absl::StatusOr<double> {
          ATTN_ASSIGN_OR_RETURN(RoundResult result,
                                EngineRound(engine, engine_steps, messages,
                                            /*batched=*/true));
          return result.wall_us;
        }));
    for (int side = 0; side < 2; ++side) {
      if ((side + round) % 2 == 0) {
        ATTN_RETURN_IF_ERROR(reset());
        ATTN_RETURN_IF_ERROR(
            Metered(stream_cost, messages, [&]() -> absl::StatusOr<double> {
              ATTN_ASSIGN_OR_RETURN(RoundResult result,
                                    BatchedRound(streams, requests, messages));
              return result.wall_us;
            }));
      } else {
        ATTN_RETURN_IF_ERROR(Metered(echo_cost, messages, [&] {
          return EchoRoundWall(h, echo_request, messages);
        }));
      }
    }
  }
  // The engine's time per step in smaller batches of the same steps (the
  // 64 sessions in groups), for the fixed cost per step and per batch.
  std::vector<double> small_batch_step_us;
  for (const size_t batch : {size_t{1}, size_t{8}}) {
    double wall = 0;
    for (int round = 0; round < rounds; ++round) {
      ATTN_RETURN_IF_ERROR(reset());
      for (size_t g = 0; g < engine_steps.size(); g += batch) {
        const std::vector<AppendRequest> group(
            engine_steps.begin() + g, engine_steps.begin() + g + batch);
        ATTN_ASSIGN_OR_RETURN(
            RoundResult group_round,
            EngineRound(engine, group, messages, /*batched=*/true));
        wall += group_round.wall_us;
      }
    }
    small_batch_step_us.push_back(wall /
                                  (double{kStreams} * messages * rounds));
  }
  for (auto& stream : streams) ATTN_RETURN_IF_ERROR(stream->Finish());
  for (const std::string& id : sessions) {
    ATTN_RETURN_IF_ERROR(engine.DeleteSession(id));
  }
  const double stream_rate = stream_cost.Rate();
  const double echo_rate = echo_cost.Rate();
  // The engine's own time per step in these batches (no RPC): what the
  // served steps pay on top of the echo's transport.
  const double engine_step_us = engine_cost.WallPerUnit();
  BenchReport& r = *h.report;
  r.AddRow(kSection,
           absl::StrCat("engine alone, AppendEach of 64 at ctx ", kShortContext,
                        ": time per step"),
           engine_step_us, "us");
  r.AddFigure("engine_batched_step_us_ctx16", engine_step_us);
  r.AddRow(kSection,
           absl::StrCat("engine alone, AppendEach of 8 at ctx ", kShortContext,
                        ": time per step"),
           small_batch_step_us[1], "us");
  r.AddFigure("engine_step_us_ctx16_batch8", small_batch_step_us[1]);
  r.AddRow(kSection,
           absl::StrCat("engine alone, AppendEach of 1 at ctx ", kShortContext,
                        ": time per step"),
           small_batch_step_us[0], "us");
  r.AddFigure("engine_step_us_ctx16_batch1", small_batch_step_us[0]);
  r.AddRow(kSection,
           absl::StrCat("64 Decode streams, ctx ", kShortContext, ": steps/s"),
           stream_rate, "steps/s");
  r.AddRow(kSection, "64 callback echo streams, same bytes: messages/s",
           echo_rate, "msg/s");
  r.AddRow(kSection, "stream64_vs_callback_echo_ctx16", stream_rate / echo_rate,
           "x");
  r.AddFigure("stream64_ctx16_steps_per_s", stream_rate);
  r.AddFigure("callback_echo_stream64_msgs_per_s", echo_rate);
  r.AddFigure("stream64_vs_callback_echo_ctx16", stream_rate / echo_rate);
  ReportCostSplit(h, absl::StrCat("_ctx", kShortContext), stream_cost,
                  engine_cost, echo_cost, /*reference=*/echo_cost,
                  "stream64_vs_callback_echo_ctx16");
  ReportFmaBound(h, echo_cost, messages);
  return absl::OkStatus();
}

// (f) The latency budget of one DecodeStep (one call at a time) at
// `context` tokens: the client's round trip split with the server's
// timestamps (server/decode_step_timing.h) into transport (everything the
// server does not see: client stub and serialization, the network stack,
// gRPC's transport on both sides), request decode (protobuf parse into the
// arena + conversion and checks), queueing in the batcher (the batch
// thread's wake-up; about nothing when the lone step runs inline on the
// gRPC thread), engine, and reply encode (result into the response, and
// Finish: when called from the batch thread it also writes the reply; from
// the handler, gRPC writes it after the handler returns, in transport).
// Each stage's p50 and p99 are taken on their own, so they need not add up
// to the total's.
absl::Status MeasureLatencyBudget(const Harness& h,
                                  const std::string& base_session,
                                  int64_t context) {
  AttentionEngine& engine = h.server->engine();
  ATTN_ASSIGN_OR_RETURN(SessionInfo fork, engine.ForkSession(base_session));
  const v1::DecodeRequest step = MakeDecodeRequest(fork.session_id, 99);
  const int samples = h.options->quick ? 400 : 2000;
  const int warmup = 20;
  std::vector<double> total_us, transport_us, decode_us, queue_us, engine_us,
      encode_us;
  auto us = [](server::DecodeStepTiming::Clock::time_point begin,
               server::DecodeStepTiming::Clock::time_point end) {
    return MicrosBetween(begin, end);
  };
  for (int i = -warmup; i < samples; ++i) {
    ATTN_RETURN_IF_ERROR(
        engine.TruncateSession(fork.session_id, context).status());
    const size_t before = h.timings->count();
    h.timings->armed.store(true);
    const Clock::time_point begin = Clock::now();
    ATTN_RETURN_IF_ERROR(h.client->DecodeStep(step).status());
    const Clock::time_point end = Clock::now();
    // The server reports right after handing the reply to gRPC; the client
    // may see the reply first.
    while (h.timings->count() == before) std::this_thread::yield();
    h.timings->armed.store(false);
    if (i < 0) continue;
    server::DecodeStepTiming t;
    {
      absl::MutexLock lock(&h.timings->mu);
      t = h.timings->timings.back();
    }
    const double total = MicrosBetween(begin, end);
    total_us.push_back(total);
    transport_us.push_back(total - us(t.received, t.replied));
    decode_us.push_back(us(t.received, t.submitted));
    queue_us.push_back(us(t.submitted, t.batch.start));
    engine_us.push_back(us(t.batch.start, t.batch.end));
    encode_us.push_back(us(t.batch.end, t.replied));
  }
  ATTN_RETURN_IF_ERROR(engine.DeleteSession(fork.session_id));
  BenchReport& r = *h.report;
  const std::string ctx = absl::StrCat("ctx", context);
  const std::pair<const char*, std::vector<double>*> stages[] = {
      {"total", &total_us},   {"transport", &transport_us},
      {"decode", &decode_us}, {"queue", &queue_us},
      {"engine", &engine_us}, {"encode", &encode_us}};
  for (const auto& [name, values] : stages) {
    const Percentiles p = Summarize(*values);
    for (const auto& [which, value] : {std::pair{"p50", p.p50},
                                       std::pair{"p99", p.p99}}) {
      r.AddRow(kSection,
               absl::StrFormat("DecodeStep latency budget, ctx %d: %s %s",
                               context, name, which),
               value, "us");
    }
    r.AddFigure(absl::StrCat("latency_", ctx, "_", name, "_p50_us"), p.p50);
    r.AddFigure(absl::StrCat("latency_", ctx, "_", name, "_p99_us"), p.p99);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// (d) Session mobility.

struct TransferTimes {
  double export_s = 0, import_s = 0;
};

// ExportSession of `session` into memory, then ImportSession of the
// records; the copy is deleted again.
absl::StatusOr<TransferTimes> ExportImportRound(const Harness& h,
                                                const std::string& session) {
  TransferTimes times;
  std::vector<v1::SessionChunk> records;
  const Clock::time_point start = Clock::now();
  ATTN_RETURN_IF_ERROR(
      h.client->ExportSession(session, [&](const v1::SessionChunk& record) {
        records.push_back(record);
        return absl::OkStatus();
      }));
  const Clock::time_point exported = Clock::now();
  size_t next = 0;
  ATTN_ASSIGN_OR_RETURN(
      v1::SessionInfo copy,
      h.client->ImportSession(
          [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
            if (next == records.size()) return false;
            record->Swap(&records[next++]);
            return true;
          }));
  const Clock::time_point imported = Clock::now();
  ATTN_RETURN_IF_ERROR(h.client->DeleteSession(copy.session_id()));
  times.export_s = MicrosBetween(start, exported) * 1e-6;
  times.import_s = MicrosBetween(exported, imported) * 1e-6;
  return times;
}

// The same bytes through the bare echo stream, pipelined like a gRPC
// stream: `messages` requests of `bytes` up (answers empty), then
// `messages` empty requests answered with `bytes` down.
absl::StatusOr<double> EchoTransferSeconds(const Harness& h, int64_t messages,
                                           int64_t bytes) {
  const Clock::time_point start = Clock::now();
  for (bool upload : {true, false}) {
    echo::EchoRequest request;
    if (upload) {
      request.set_payload(std::string(static_cast<size_t>(bytes), 'x'));
    } else {
      request.set_response_bytes(bytes);
    }
    grpc::ClientContext context;
    auto stream = h.echo->EchoStream(&context);
    std::thread writer([&] {
      for (int64_t m = 0; m < messages; ++m) {
        if (!stream->Write(request)) break;
      }
      stream->WritesDone();
    });
    echo::EchoResponse response;
    int64_t received = 0;
    while (stream->Read(&response)) ++received;
    writer.join();
    ATTN_RETURN_IF_ERROR(client::FromGrpcStatus(stream->Finish()));
    if (received != messages) {
      return absl::InternalError("the echo stream lost messages");
    }
  }
  return MicrosBetween(start, Clock::now()) * 1e-6;
}

absl::Status MeasureSessionTransfer(const Harness& h) {
  // float16, 8 KV heads of 128: 4 KiB of K/V per token.
  const int64_t tokens = h.options->quick ? 16384 : 65536;
  ATTN_ASSIGN_OR_RETURN(
      const std::string session,
      SyntheticSession(h.server->engine(), tokens, /*seed=*/77));
  const int64_t kv_bytes = tokens * 2 * kKvHeads * kHeadDim * 2;
  const int64_t chunk_bytes = kSnapshotChunkTargetBytes;
  const int64_t messages = kv_bytes / chunk_bytes;
  const int rounds = h.options->quick ? 3 : 5;
  ATTN_RETURN_IF_ERROR(ExportImportRound(h, session).status());  // warm-up
  ATTN_RETURN_IF_ERROR(EchoTransferSeconds(h, 4, chunk_bytes).status());
  double export_s = 0, import_s = 0, echo_s = 0;
  for (int round = 0; round < rounds; ++round) {
    for (int side = 0; side < 2; ++side) {
      if ((side + round) % 2 == 0) {
        ATTN_ASSIGN_OR_RETURN(TransferTimes times,
                              ExportImportRound(h, session));
        export_s += times.export_s;
        import_s += times.import_s;
      } else {
        ATTN_ASSIGN_OR_RETURN(double seconds,
                              EchoTransferSeconds(h, messages, chunk_bytes));
        echo_s += seconds;
      }
    }
  }
  ATTN_RETURN_IF_ERROR(h.server->engine().DeleteSession(session));
  const double gb = static_cast<double>(kv_bytes) * 1e-9;
  const double export_gbps = gb * rounds / export_s;
  const double import_gbps = gb * rounds / import_s;
  const double transfer_gbps = 2 * gb * rounds / (export_s + import_s);
  const double echo_gbps = 2 * gb * rounds / echo_s;
  BenchReport& r = *h.report;
  const std::string size = absl::StrCat(kv_bytes >> 20, " MiB session");
  r.AddRow(kMobilitySection, absl::StrCat("ExportSession, ", size), export_gbps,
           "GB/s");
  r.AddRow(kMobilitySection, absl::StrCat("ImportSession, ", size), import_gbps,
           "GB/s");
  r.AddRow(kMobilitySection, "export then import (bytes moved / time)",
           transfer_gbps, "GB/s");
  r.AddRow(kMobilitySection, "echo stream of the same bytes, up then down",
           echo_gbps, "GB/s");
  r.AddRow(kMobilitySection, "session transfer / echo",
           transfer_gbps / echo_gbps, "x");
  r.AddFigure("session_export_gbps", export_gbps);
  r.AddFigure("session_import_gbps", import_gbps);
  r.AddFigure("session_transfer_gbps", transfer_gbps);
  r.AddFigure("session_transfer_echo_gbps", echo_gbps);
  r.AddFigure("session_transfer_vs_echo_ratio", transfer_gbps / echo_gbps);
  return absl::OkStatus();
}

// Snapshot to disk and restore, as --snapshot_dir does on drain and start,
// of `total` bytes of sessions (16 sessions), on engines of their own.
absl::Status MeasureSnapshot(const BenchOptions& options, BenchReport* report) {
  // 4 GiB (--snapshot_mib=4096) needs 4 GiB of pool (twice, one after the
  // other) and 4 GiB of page cache: 1 GiB (256 MiB quick) by default on the
  // 24 GiB shared development machine.
  const int64_t total =
      options.snapshot_mib > 0
          ? options.snapshot_mib << 20
          : (options.quick ? int64_t{256} << 20 : int64_t{1} << 30);
  const int sessions = 16;
  const int64_t tokens = total / sessions / (2 * kKvHeads * kHeadDim * 2);
  const std::string dir =
      absl::StrCat(std::filesystem::temp_directory_path().string(),
                   "/attn-bench-snapshot-", ::getpid());
  std::filesystem::remove_all(dir);
  EngineOptions engine_options;
  engine_options.kv_cache_bytes = total + (int64_t{64} << 20);
  engine_options.sessions.limits.max_tokens_limit = tokens;
  engine_options.sessions.limits.default_max_tokens = tokens;
  engine_options.sessions.reap_interval = absl::ZeroDuration();
  double save_s = 0, restore_s = 0;
  int64_t written = 0, restored = 0;
  {
    ATTN_ASSIGN_OR_RETURN(
        std::unique_ptr<AttentionEngine> engine,
        AttentionEngine::Create(std::make_unique<CpuBackend>(options.threads),
                                engine_options));
    for (int i = 0; i < sessions; ++i) {
      ATTN_RETURN_IF_ERROR(SyntheticSession(*engine, tokens, 100 + i).status());
    }
    const server::SaveAllResult saved =
        server::SaveAllSessions(*engine, dir, absl::Now() + absl::Minutes(10));
    save_s = absl::ToDoubleSeconds(saved.duration);
    written = saved.written;
  }
  {
    ATTN_ASSIGN_OR_RETURN(
        std::unique_ptr<AttentionEngine> engine,
        AttentionEngine::Create(std::make_unique<CpuBackend>(options.threads),
                                engine_options));
    const Clock::time_point start = Clock::now();
    const server::RestoreAllResult result =
        server::RestoreAllSessions(*engine, dir);
    restore_s = MicrosBetween(start, Clock::now()) * 1e-6;
    restored = result.restored;
  }
  std::filesystem::remove_all(dir);
  if (written != sessions || restored != sessions) {
    return absl::InternalError(absl::StrCat("snapshot wrote ", written,
                                            " and restored ", restored, " of ",
                                            sessions, " sessions"));
  }
  const std::string what =
      absl::StrCat(total >> 20, " MiB in ", sessions, " sessions");
  report->AddRow(kMobilitySection,
                 absl::StrCat("snapshot to disk (fsync), ", what), save_s, "s");
  report->AddRow(kMobilitySection, absl::StrCat("restore at start, ", what),
                 restore_s, "s");
  report->AddFigure("snapshot_seconds", save_s);
  report->AddFigure("restore_seconds", restore_s);
  report->AddFigure("snapshot_mib", static_cast<double>(total >> 20));
  return absl::OkStatus();
}

absl::Status RunServing(const BenchOptions& options, BenchReport* report) {
  const Clock::time_point section_start = Clock::now();
  BatchCounter counter;
  TimingCollector timings;
  SyncEchoService sync_echo;
  CallbackEchoService callback_echo;

  server::ServerOptions server_options;
  server_options.listen_address = "127.0.0.1";
  server_options.port = 0;
  server_options.backend = "cpu";
  server_options.threads = options.threads;
  server_options.kv_cache_bytes = int64_t{2} << 30;
  server_options.drain_timeout = absl::Seconds(1);
  server_options.on_decode_batch = [&counter](int64_t size) {
    counter.batches.fetch_add(1, std::memory_order_relaxed);
    counter.steps.fetch_add(size, std::memory_order_relaxed);
  };
  server_options.on_decode_step_timing =
      [&timings](const server::DecodeStepTiming& timing) {
        timings.Record(timing);
      };
  const std::vector<grpc::Service*> extra = {&sync_echo, &callback_echo};
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<server::AttentionServer> server,
                        server::AttentionServer::Start(server_options, extra));
  // The client's defaults match the server's message limits.
  std::unique_ptr<client::AttentionClient> client =
      client::AttentionClient::Connect(server->local_target());
  ATTN_RETURN_IF_ERROR(client->WaitForConnected(absl::Seconds(10)));
  std::unique_ptr<echo::Echo::Stub> echo_stub =
      echo::Echo::NewStub(client->channel());
  std::unique_ptr<echo::CallbackEcho::Stub> callback_stub =
      echo::CallbackEcho::NewStub(client->channel());
  const Harness harness{server.get(),        client.get(), echo_stub.get(),
                        callback_stub.get(), &options,     report,
                        &timings};

  // One base context per stream (not measured), each 2048 tokens of its
  // own random K/V, imported rather than prefilled (kSetupCapacity leaves
  // room for the steps the rounds append to their forks).
  std::vector<std::string> bases;
  const Clock::time_point setup_start = Clock::now();
  for (int b = 0; b < kStreams; ++b) {
    ATTN_ASSIGN_OR_RETURN(std::string id,
                          SyntheticSession(server->engine(), kBatchContext,
                                           10 * b + 1, kSetupCapacity));
    bases.push_back(id);
  }
  const double setup_s = MicrosBetween(setup_start, Clock::now()) * 1e-6;
  report->AddFact("serving_contexts",
                  absl::StrCat(kStreams, " sessions of ", kBatchContext,
                               " tokens each, none sharing KV blocks"));
  report->AddFact("serving_backend", server->engine().backend().device());

  ATTN_RETURN_IF_ERROR(
      MeasureRpcOverhead(harness, bases[0], kRpcContext, /*suffix=*/""));
  // The same at a short context, where attention is small (tens of us)
  // and the serving path dominates.
  ATTN_RETURN_IF_ERROR(MeasureRpcOverhead(harness, bases[0], kShortContext,
                                          absl::StrCat("_ctx", kShortContext)));
  ATTN_RETURN_IF_ERROR(MeasureBatching(harness, bases, counter));
  ATTN_RETURN_IF_ERROR(MeasureApis(harness, bases[0]));
  ATTN_RETURN_IF_ERROR(MeasureSmallSteps(harness));
  ATTN_RETURN_IF_ERROR(MeasureSharedPrompt(harness, bases));
  for (int64_t context : {kShortContext, kBatchContext}) {
    ATTN_RETURN_IF_ERROR(MeasureLatencyBudget(harness, bases[0], context));
  }

  report->AddRow(kSection, "set-up: importing the base contexts", setup_s, "s");
  report->AddRow(kSection, "serving section wall time",
                 MicrosBetween(section_start, Clock::now()) * 1e-6, "s");
  client.reset();
  server->Shutdown();
  return absl::OkStatus();
}

absl::Status RunMobility(const BenchOptions& options, BenchReport* report) {
  SyncEchoService sync_echo;
  server::ServerOptions server_options;
  server_options.listen_address = "127.0.0.1";
  server_options.port = 0;
  server_options.backend = "cpu";
  server_options.threads = options.threads;
  server_options.kv_cache_bytes = int64_t{1} << 30;
  server_options.max_session_tokens = 1 << 20;
  server_options.drain_timeout = absl::Seconds(1);
  const std::vector<grpc::Service*> extra = {&sync_echo};
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<server::AttentionServer> server,
                        server::AttentionServer::Start(server_options, extra));
  std::unique_ptr<client::AttentionClient> client =
      client::AttentionClient::Connect(server->local_target());
  ATTN_RETURN_IF_ERROR(client->WaitForConnected(absl::Seconds(10)));
  std::unique_ptr<echo::Echo::Stub> echo_stub =
      echo::Echo::NewStub(client->channel());
  const Harness harness{server.get(), client.get(), echo_stub.get(),
                        nullptr,      &options,     report};
  ATTN_RETURN_IF_ERROR(MeasureSessionTransfer(harness));
  client.reset();
  server->Shutdown();
  return MeasureSnapshot(options, report);
}

}  // namespace

void RunMobilityBench(const BenchOptions& options, BenchReport* report) {
  std::fprintf(stderr, "attn-bench: mobility section...\n");
  if (absl::Status status = RunMobility(options, report); !status.ok()) {
    std::fprintf(stderr, "attn-bench: mobility section failed: %s\n",
                 status.ToString().c_str());
    report->AddFact("mobility_error", status.ToString());
  }
}

void RunServingBench(const BenchOptions& options, BenchReport* report) {
  std::fprintf(stderr, "attn-bench: serving section...\n");
  if (absl::Status status = RunServing(options, report); !status.ok()) {
    std::fprintf(stderr, "attn-bench: serving section failed: %s\n",
                 status.ToString().c_str());
    report->AddFact("serving_error", status.ToString());
  }
}

}  // namespace attention::bench
