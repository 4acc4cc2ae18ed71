// The fleet section of attn-bench: in-process attention servers (the same
// AttentionServer as attention-server, CPU backend, ephemeral ports) driven
// through ClusterClient, as a fleet of replicas would be.
//
//   fleet3_vs_single_decode  aggregate decode tokens/s of the same load
//                            (sessions placed by ClusterClient, decoded by
//                            concurrent multiplexed Decode streams) on three
//                            replicas / on one. Decode step: H = 32,
//                            H_kv = 8, head_dim = 128, fp16 KV. Each replica
//                            has --threads backend threads, as separate
//                            machines would; on a small machine the three
//                            share its cores, so the ratio shows the cost
//                            of routing and of more threads than cores, not
//                            the gain of more hardware.
//   handover_seconds_1gib    a draining replica handing 1 GiB of sessions
//                            to its peer (--quick: 256 MiB, reported as
//                            handover_seconds_256mib): from Shutdown (the
//                            drain) until it has handed them all over and
//                            stopped.
//
// The two sides of the ratio are measured alternately, rounds of each in
// turn, so noise from other processes hits both.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "attention/v1/attention.pb.h"
#include "bench/bench_report.h"
#include "bench/bench_util.h"
#include "client/cluster_client.h"
#include "client/tensor_codec.h"
#include "core/status_macros.h"
#include "server/attention_server.h"
#include "server/server_options.h"

namespace attention::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kSection[] = "fleet";
constexpr int kQHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kHeadDim = 128;
constexpr int kStreams = 8;


v1::SessionSpec DecodeSpec() {
  v1::SessionSpec spec;
  spec.set_num_layers(1);
  spec.set_num_q_heads(kQHeads);
  spec.set_num_kv_heads(kKvHeads);
  spec.set_head_dim(kHeadDim);
  spec.set_kv_dtype(v1::DTYPE_FLOAT16);
  spec.set_model("attn-bench-fleet");
  return spec;
}

std::vector<float> RandomValues(int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = uniform(rng);
  return values;
}

// `tokens` random tokens of `spec`'s single layer for `session`, fp16 on
// the wire.
template <typename Request>
absl::StatusOr<Request> RandomRequest(const std::string& session,
                                      const v1::SessionSpec& spec,
                                      int64_t tokens, uint32_t seed) {
  Request request;
  request.set_session_id(session);
  const int64_t q = spec.num_q_heads(), kv = spec.num_kv_heads();
  const int64_t d = spec.head_dim();
  ATTN_ASSIGN_OR_RETURN(*request.mutable_q(),
                        client::MakeTensor(RandomValues(tokens * q * d, seed),
                                           {tokens, q, d}, v1::DTYPE_FLOAT16));
  ATTN_ASSIGN_OR_RETURN(
      *request.mutable_k(),
      client::MakeTensor(RandomValues(tokens * kv * d, seed + 1),
                         {tokens, kv, d}, v1::DTYPE_FLOAT16));
  ATTN_ASSIGN_OR_RETURN(
      *request.mutable_v(),
      client::MakeTensor(RandomValues(tokens * kv * d, seed + 2),
                         {tokens, kv, d}, v1::DTYPE_FLOAT16));
  request.set_output_dtype(v1::DTYPE_FLOAT16);
  return request;
}

server::ServerOptions ReplicaOptions(const BenchOptions& options,
                                     int64_t kv_cache_bytes) {
  server::ServerOptions server_options;
  server_options.listen_address = "127.0.0.1";
  server_options.port = 0;
  server_options.backend = "cpu";
  server_options.threads = options.threads;
  server_options.kv_cache_bytes = kv_cache_bytes;
  server_options.drain_timeout = absl::Seconds(30);
  return server_options;
}

// In-process replicas and a ClusterClient over them.
struct Fleet {
  std::vector<std::unique_ptr<server::AttentionServer>> replicas;
  std::unique_ptr<client::ClusterClient> cluster;

  static absl::StatusOr<Fleet> Start(
      const std::vector<server::ServerOptions>& replica_options) {
    Fleet fleet;
    std::vector<std::string> addresses;
    for (const server::ServerOptions& options : replica_options) {
      ATTN_ASSIGN_OR_RETURN(std::unique_ptr<server::AttentionServer> replica,
                            server::AttentionServer::Start(options));
      addresses.push_back(replica->local_target());
      fleet.replicas.push_back(std::move(replica));
    }
    client::ClusterOptions cluster_options;
    cluster_options.client.retry_max_attempts = 1;
    // A resolver, because a one-entry list would be read as a DNS name.
    cluster_options.resolver = [addresses] { return addresses; };
    ATTN_ASSIGN_OR_RETURN(
        fleet.cluster,
        client::ClusterClient::Open(addresses.front(), cluster_options));
    return fleet;
  }
  ~Fleet() {
    cluster.reset();
    for (auto& replica : replicas) {
      if (replica != nullptr) replica->Shutdown();
    }
  }
  Fleet() = default;
  Fleet(Fleet&&) = default;
};

// `sessions` sessions placed by the cluster, each prefilled with `context`
// tokens (not measured).
absl::StatusOr<std::vector<std::string>> PlaceSessions(
    client::ClusterClient& cluster, int sessions, int64_t context) {
  std::vector<std::string> ids;
  const v1::SessionSpec spec = DecodeSpec();
  for (int s = 0; s < sessions; ++s) {
    ATTN_ASSIGN_OR_RETURN(v1::SessionInfo info, cluster.CreateSession(spec));
    ATTN_ASSIGN_OR_RETURN(
        v1::PrefillRequest prefill,
        RandomRequest<v1::PrefillRequest>(info.session_id(), info.spec(),
                                          context, 100 + 3 * s));
    ATTN_RETURN_IF_ERROR(cluster.Prefill(prefill).status());
    ids.push_back(info.session_id());
  }
  return ids;
}

// `steps` decode steps of every session, by kStreams threads each driving
// one multiplexed ClusterDecodeStream over its share of the sessions (one
// step of each written, then the results read). Returns tokens/s.
absl::StatusOr<double> DecodeRound(client::ClusterClient& cluster,
                                   const std::vector<std::string>& ids,
                                   int steps) {
  const v1::SessionSpec spec = DecodeSpec();
  std::vector<std::vector<v1::DecodeRequest>> requests(kStreams);
  for (size_t s = 0; s < ids.size(); ++s) {
    ATTN_ASSIGN_OR_RETURN(
        v1::DecodeRequest request,
        RandomRequest<v1::DecodeRequest>(ids[s], spec, 1, 7 * s + 5));
    requests[s % kStreams].push_back(std::move(request));
  }
  std::vector<absl::Status> statuses(kStreams);
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < kStreams; ++t) {
    threads.emplace_back([&, t] {
      std::unique_ptr<client::ClusterDecodeStream> stream =
          cluster.OpenDecodeStream();
      for (int step = 0; step < steps && statuses[t].ok(); ++step) {
        for (const v1::DecodeRequest& request : requests[t]) {
          stream->Write(request);
        }
        for (size_t i = 0; i < requests[t].size(); ++i) {
          if (auto result = stream->Read(); !result.ok()) {
            statuses[t] = result.status();
            break;
          }
        }
      }
      if (statuses[t].ok()) statuses[t] = stream->Finish();
    });
  }
  for (std::thread& thread : threads) thread.join();
  const double seconds = SecondsSince(start);
  for (const absl::Status& status : statuses) ATTN_RETURN_IF_ERROR(status);
  return static_cast<double>(ids.size()) * steps / seconds;
}

absl::Status MeasureDecode(const BenchOptions& options, BenchReport* report) {
  const int sessions = options.quick ? 24 : 48;
  const int64_t context = options.quick ? 256 : 1024;
  const int steps = options.quick ? 8 : 32;
  const int rounds = options.quick ? 3 : 5;
  // 4 KiB of K/V per token; room for the contexts and every step.
  const int64_t needed =
      sessions * (context + int64_t{rounds + 1} * steps) * 4096;
  const int64_t pool = std::max<int64_t>(int64_t{256} << 20, 2 * needed);
  ATTN_ASSIGN_OR_RETURN(Fleet single,
                        Fleet::Start({ReplicaOptions(options, pool)}));
  ATTN_ASSIGN_OR_RETURN(Fleet three,
                        Fleet::Start({ReplicaOptions(options, pool),
                                      ReplicaOptions(options, pool),
                                      ReplicaOptions(options, pool)}));
  ATTN_ASSIGN_OR_RETURN(std::vector<std::string> single_ids,
                        PlaceSessions(*single.cluster, sessions, context));
  ATTN_ASSIGN_OR_RETURN(std::vector<std::string> three_ids,
                        PlaceSessions(*three.cluster, sessions, context));
  std::vector<int> per_replica;
  for (const auto& replica : three.replicas) {
    per_replica.push_back(
        static_cast<int>(replica->engine().stats().active_sessions));
  }
  // Warm-up, then alternate.
  ATTN_RETURN_IF_ERROR(DecodeRound(*single.cluster, single_ids, 2).status());
  ATTN_RETURN_IF_ERROR(DecodeRound(*three.cluster, three_ids, 2).status());
  std::vector<double> single_rates, three_rates;
  for (int round = 0; round < rounds; ++round) {
    for (int side = 0; side < 2; ++side) {
      const bool fleet_side = (side + round) % 2 == 0;
      ATTN_ASSIGN_OR_RETURN(
          double rate, fleet_side
                           ? DecodeRound(*three.cluster, three_ids, steps)
                           : DecodeRound(*single.cluster, single_ids, steps));
      (fleet_side ? three_rates : single_rates).push_back(rate);
    }
  }
  const double single_rate = Median(single_rates);
  const double three_rate = Median(three_rates);
  report->AddFact(
      "fleet_decode_load",
      absl::StrCat(sessions, " sessions of ", context,
                   " tokens (H 32/8, d 128, fp16), ", kStreams,
                   " multiplexed Decode streams, ", steps,
                   " steps per session per round, median of ", rounds,
                   " rounds; sessions per replica of the three: ",
                   absl::StrJoin(per_replica, "/"), "; ", options.threads,
                   " backend threads per replica on ",
                   std::thread::hardware_concurrency(), " hardware threads"));
  report->AddRow(kSection, "decode tokens/s, one replica", single_rate,
                 "tok/s");
  report->AddRow(kSection, "decode tokens/s, three replicas (ClusterClient)",
                 three_rate, "tok/s");
  report->AddRow(kSection, "three replicas / one", three_rate / single_rate,
                 "x");
  report->AddFigure("fleet_single_decode_tokens_per_s", single_rate);
  report->AddFigure("fleet3_decode_tokens_per_s", three_rate);
  report->AddFigure("fleet3_vs_single_decode", three_rate / single_rate);
  return absl::OkStatus();
}

// A replica holding `total` bytes of sessions drains with one peer: the
// time from Shutdown until it has handed them all over (and exited). The
// sessions are copies of one 64 MiB session (64 layers of 256 tokens, H 8,
// d 128, fp16): prefilled once, exported, imported again with new ids.
absl::Status MeasureHandover(const BenchOptions& options, BenchReport* report) {
  constexpr int kLayers = 64;
  constexpr int64_t kTokens = 256;
  const int64_t session_bytes = kLayers * kTokens * 8 * kHeadDim * 2 * 2;
  const int64_t total = options.quick ? int64_t{256} << 20 : int64_t{1} << 30;
  const int64_t sessions = total / session_bytes;
  server::ServerOptions peer_options =
      ReplicaOptions(options, total + (int64_t{128} << 20));
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<server::AttentionServer> peer,
                        server::AttentionServer::Start(peer_options));
  server::ServerOptions source_options =
      ReplicaOptions(options, total + (int64_t{64} << 20));
  source_options.peers = peer->advertise_address();
  source_options.drain_timeout = absl::Minutes(5);
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<server::AttentionServer> source,
                        server::AttentionServer::Start(source_options));
  client::ClientOptions client_options;
  client_options.retry_max_attempts = 1;
  std::unique_ptr<client::AttentionClient> client =
      client::AttentionClient::Connect(source->local_target(), client_options);

  v1::SessionSpec spec;
  spec.set_num_layers(kLayers);
  spec.set_num_q_heads(8);
  spec.set_num_kv_heads(8);
  spec.set_head_dim(kHeadDim);
  spec.set_kv_dtype(v1::DTYPE_FLOAT16);
  ATTN_ASSIGN_OR_RETURN(v1::SessionInfo seed, client->CreateSession(spec));
  for (int layer = 0; layer < kLayers; ++layer) {
    ATTN_ASSIGN_OR_RETURN(
        v1::PrefillRequest prefill,
        RandomRequest<v1::PrefillRequest>(seed.session_id(), seed.spec(),
                                          kTokens, 1000 + 3 * layer));
    prefill.set_layer(layer);
    ATTN_RETURN_IF_ERROR(client->Prefill(prefill).status());
  }
  std::vector<v1::SessionChunk> records;
  ATTN_RETURN_IF_ERROR(client->ExportSession(
      seed.session_id(), [&](const v1::SessionChunk& record) {
        records.push_back(record);
        return absl::OkStatus();
      }));
  for (int64_t copy = 1; copy < sessions; ++copy) {
    size_t next = 0;
    ATTN_RETURN_IF_ERROR(
        client
            ->ImportSession(
                [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
                  if (next == records.size()) return false;
                  *record = records[next++];
                  return true;
                })
            .status());
  }
  records.clear();
  client.reset();
  const int64_t held = source->engine().stats().active_sessions;

  const Clock::time_point start = Clock::now();
  source->Shutdown();
  const double seconds = SecondsSince(start);
  const int64_t received = peer->engine().stats().active_sessions;
  peer->Shutdown();
  if (held != sessions || received != sessions) {
    return absl::InternalError(absl::StrCat("handover: the source held ", held,
                                            " sessions, the peer received ",
                                            received, " of ", sessions));
  }
  const std::string size = absl::StrCat(total >> 20, " MiB");
  report->AddFact(
      "fleet_handover_size",
      absl::StrCat(size, " (", sessions, " sessions of ", session_bytes >> 20,
                   " MiB)", options.quick ? ", --quick: not 1 GiB" : ""));
  report->AddRow(kSection, absl::StrCat("drain handing over ", size), seconds,
                 "s");
  report->AddRow(kSection, "handover rate",
                 static_cast<double>(total) * 1e-9 / seconds, "GB/s");
  report->AddFigure(
      options.quick ? "handover_seconds_256mib" : "handover_seconds_1gib",
      seconds);
  report->AddFigure("handover_gbps",
                    static_cast<double>(total) * 1e-9 / seconds);
  return absl::OkStatus();
}

absl::Status RunFleet(const BenchOptions& options, BenchReport* report) {
  const Clock::time_point start = Clock::now();
  ATTN_RETURN_IF_ERROR(MeasureDecode(options, report));
  ATTN_RETURN_IF_ERROR(MeasureHandover(options, report));
  report->AddRow(kSection, "fleet section wall time", SecondsSince(start), "s");
  return absl::OkStatus();
}

}  // namespace

void RunFleetBench(const BenchOptions& options, BenchReport* report) {
  std::fprintf(stderr, "attn-bench: fleet section...\n");
  if (absl::Status status = RunFleet(options, report); !status.ok()) {
    std::fprintf(stderr, "attn-bench: fleet section failed: %s\n",
                 status.ToString().c_str());
    report->AddFact("fleet_error", status.ToString());
  }
}

}  // namespace attention::bench
