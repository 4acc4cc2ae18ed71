#include "server/metrics.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "tests/server/http_get.h"

namespace attention::server {
namespace {

using ::attention::testing::HttpGet;
using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using ::testing::HasSubstr;

std::unique_ptr<ServerMetrics> MakeMetrics(std::string listen_address = "") {
  ServerMetricsOptions options;
  options.listen_address = std::move(listen_address);
  options.version = "1.2.3";
  options.backend = "cpu";
  options.device = "test-device";
  auto metrics = ServerMetrics::Create(options);
  EXPECT_TRUE(metrics.ok()) << metrics.status();
  return metrics.ok() ? *std::move(metrics) : nullptr;
}

const MetricFamily* FindFamily(const std::vector<MetricFamily>& families,
                               const std::string& name) {
  for (const MetricFamily& family : families) {
    if (family.name == name) return &family;
  }
  return nullptr;
}

// The sample of `family` whose labels are exactly `labels`.
const ClientMetric* FindMetric(
    const MetricFamily& family,
    const std::map<std::string, std::string>& labels) {
  for (const ClientMetric& metric : family.metric) {
    std::map<std::string, std::string> have;
    for (const auto& label : metric.label) have[label.name] = label.value;
    if (have == labels) return &metric;
  }
  return nullptr;
}

MetricsState SomeState() {
  MetricsState state;
  state.prefill_tokens_total = 133;
  state.decode_tokens_total = 21;
  state.sessions_active = 3;
  state.sessions_created_total = 7;
  state.sessions_expired_total = 2;
  state.session_metadata_bytes = 4096 + 17;
  state.kv_cache_capacity_bytes = 1 << 20;
  state.kv_cache_used_bytes = 1 << 18;
  state.kv_blocks_used = 4;
  state.kv_blocks_capacity = 16;
  state.shared_kv_chunks_total = 11;
  state.backend_failed = 1;
  state.backend_scratch_bytes = 1 << 30;
  return state;
}

// The `# TYPE` of every family in a text exposition.
std::map<std::string, std::string> ExposedTypes(const std::string& text) {
  std::map<std::string, std::string> types;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::vector<std::string> parts = absl::StrSplit(line, ' ');
    if (parts.size() == 4 && parts[0] == "#" && parts[1] == "TYPE") {
      types[parts[2]] = parts[3];
    }
  }
  return types;
}

TEST(ServerMetricsTest, ExposesEveryFamilyWithItsType) {
  auto metrics = MakeMetrics();
  ASSERT_NE(metrics, nullptr);
  metrics->SetStateProvider(SomeState);
  const std::map<std::string, std::string> expected = {
      {"attention_requests_total", "counter"},
      {"attention_request_duration_seconds", "histogram"},
      {"attention_tokens_total", "counter"},
      {"attention_decode_batch_size", "histogram"},
      {"attention_streams_active", "gauge"},
      {"attention_streams_opened_total", "counter"},
      {"attention_sessions_active", "gauge"},
      {"attention_sessions_created_total", "counter"},
      {"attention_sessions_expired_total", "counter"},
      {"attention_session_metadata_bytes", "gauge"},
      {"attention_kv_cache_capacity_bytes", "gauge"},
      {"attention_kv_cache_used_bytes", "gauge"},
      {"attention_kv_cache_usage_ratio", "gauge"},
      {"attention_kv_blocks_used", "gauge"},
      {"attention_kv_blocks_capacity", "gauge"},
      {"attention_shared_kv_chunks_total", "counter"},
      {"attention_sessions_exported_total", "counter"},
      {"attention_session_export_bytes_total", "counter"},
      {"attention_sessions_imported_total", "counter"},
      {"attention_session_import_bytes_total", "counter"},
      {"attention_snapshot_sessions_written_total", "counter"},
      {"attention_snapshot_sessions_failed_total", "counter"},
      {"attention_snapshot_duration_seconds", "gauge"},
      {"attention_sessions_restored_total", "counter"},
      {"attention_snapshots_corrupt_total", "counter"},
      {"attention_snapshots_rejected_total", "counter"},
      {"attention_snapshots_kept_total", "counter"},
      {"attention_backend_failed", "gauge"},
      {"attention_backend_scratch_bytes", "gauge"},
      {"attention_handovers_sent_total", "counter"},
      {"attention_handovers_failed_total", "counter"},
      {"attention_handovers_received_total", "counter"},
      {"attention_moved_sessions", "gauge"},
      {"attention_moved_session_redirects_total", "counter"},
      {"attention_build_info", "gauge"},
  };
  EXPECT_EQ(ExposedTypes(metrics->TextExposition()), expected);
}

TEST(ServerMetricsTest, SnapshotCountersAddUp) {
  auto metrics = MakeMetrics();
  ASSERT_NE(metrics, nullptr);
  metrics->RecordExport(1000);
  metrics->RecordExport(24);
  metrics->RecordImport(512);
  metrics->RecordSnapshot(3, 1, absl::Milliseconds(1500));
  metrics->RecordRestore(2, 1, 3, 4);
  metrics->RecordHandovers(2, 1);
  metrics->RecordHandoverReceived();
  const auto families = metrics->Collect();
  const auto value = [&](const std::string& name) {
    const MetricFamily* family = FindFamily(families, name);
    EXPECT_NE(family, nullptr) << name;
    if (family == nullptr || family->metric.empty()) return -1.0;
    const ClientMetric& metric = family->metric[0];
    return family->type == prometheus::MetricType::Counter
               ? metric.counter.value
               : metric.gauge.value;
  };
  EXPECT_EQ(value("attention_sessions_exported_total"), 2);
  EXPECT_EQ(value("attention_session_export_bytes_total"), 1024);
  EXPECT_EQ(value("attention_sessions_imported_total"), 1);
  EXPECT_EQ(value("attention_session_import_bytes_total"), 512);
  EXPECT_EQ(value("attention_snapshot_sessions_written_total"), 3);
  EXPECT_EQ(value("attention_snapshot_sessions_failed_total"), 1);
  EXPECT_DOUBLE_EQ(value("attention_snapshot_duration_seconds"), 1.5);
  EXPECT_EQ(value("attention_sessions_restored_total"), 2);
  EXPECT_EQ(value("attention_snapshots_corrupt_total"), 1);
  EXPECT_EQ(value("attention_snapshots_rejected_total"), 3);
  EXPECT_EQ(value("attention_snapshots_kept_total"), 4);
  EXPECT_EQ(value("attention_handovers_sent_total"), 2);
  EXPECT_EQ(value("attention_handovers_failed_total"), 1);
  EXPECT_EQ(value("attention_handovers_received_total"), 1);
}

TEST(ServerMetricsTest, PrecreatesEveryMethodAndCodeAtZero) {
  auto metrics = MakeMetrics();
  ASSERT_NE(metrics, nullptr);
  const auto families = metrics->Collect();
  const MetricFamily* requests =
      FindFamily(families, "attention_requests_total");
  ASSERT_NE(requests, nullptr);
  EXPECT_EQ(requests->metric.size(), size_t{kNumRpcMethods * kNumGrpcCodes});
  std::set<std::pair<std::string, std::string>> seen;
  for (int m = 0; m < kNumRpcMethods; ++m) {
    for (int c = 0; c < kNumGrpcCodes; ++c) {
      const std::string method(RpcMethodName(static_cast<RpcMethod>(m)));
      const std::string code(GrpcCodeName(static_cast<grpc::StatusCode>(c)));
      const ClientMetric* metric =
          FindMetric(*requests, {{"method", method}, {"code", code}});
      ASSERT_NE(metric, nullptr) << method << " " << code;
      EXPECT_EQ(metric->counter.value, 0.0);
      seen.insert({method, code});
    }
  }
  // Names are distinct, so no two children collapse into one series.
  EXPECT_EQ(seen.size(), size_t{kNumRpcMethods * kNumGrpcCodes});
  const MetricFamily* durations =
      FindFamily(families, "attention_request_duration_seconds");
  ASSERT_NE(durations, nullptr);
  EXPECT_EQ(durations->metric.size(), size_t{kNumRpcMethods});
}

TEST(ServerMetricsTest, NamesFollowTheProtoAndGrpc) {
  EXPECT_EQ(RpcMethodName(RpcMethod::kCreateSession), "CreateSession");
  EXPECT_EQ(RpcMethodName(RpcMethod::kDecodeStep), "DecodeStep");
  EXPECT_EQ(RpcMethodName(RpcMethod::kGetServerInfo), "GetServerInfo");
  EXPECT_EQ(GrpcCodeName(grpc::StatusCode::OK), "OK");
  EXPECT_EQ(GrpcCodeName(grpc::StatusCode::RESOURCE_EXHAUSTED),
            "RESOURCE_EXHAUSTED");
  EXPECT_EQ(GrpcCodeName(grpc::StatusCode::UNAUTHENTICATED), "UNAUTHENTICATED");
  EXPECT_EQ(GrpcCodeName(static_cast<grpc::StatusCode>(99)), "UNKNOWN");
}

TEST(ServerMetricsTest, CountsRequestsByMethodAndCode) {
  auto metrics = MakeMetrics();
  ASSERT_NE(metrics, nullptr);
  for (int i = 0; i < 3; ++i) {
    metrics->RecordRequest(RpcMethod::kDecodeStep, grpc::StatusCode::OK,
                           absl::Microseconds(300));
  }
  metrics->RecordRequest(RpcMethod::kPrefill,
                         grpc::StatusCode::INVALID_ARGUMENT,
                         absl::Milliseconds(2));
  metrics->RecordRequest(RpcMethod::kPrefill, static_cast<grpc::StatusCode>(99),
                         absl::Seconds(1));

  const auto families = metrics->Collect();
  const MetricFamily* requests =
      FindFamily(families, "attention_requests_total");
  ASSERT_NE(requests, nullptr);
  double total = 0;
  for (const ClientMetric& metric : requests->metric) {
    total += metric.counter.value;
  }
  EXPECT_EQ(total, 5.0);
  EXPECT_EQ(FindMetric(*requests, {{"method", "DecodeStep"}, {"code", "OK"}})
                ->counter.value,
            3.0);
  EXPECT_EQ(FindMetric(*requests,
                       {{"method", "Prefill"}, {"code", "INVALID_ARGUMENT"}})
                ->counter.value,
            1.0);
  EXPECT_EQ(FindMetric(*requests, {{"method", "Prefill"}, {"code", "UNKNOWN"}})
                ->counter.value,
            1.0);
}

// Every cumulative bucket counts exactly the observations <= its bound.
TEST(ServerMetricsTest, DurationHistogramBucketsAreCumulativeAndInclusive) {
  auto metrics = MakeMetrics();
  ASSERT_NE(metrics, nullptr);
  const std::vector<double>& bounds = ServerMetrics::RequestDurationBuckets();
  // Below the first bound, exactly on some bounds, between bounds, and past
  // the last one.
  std::vector<absl::Duration> observed = {
      absl::ZeroDuration(),   -absl::Seconds(1),       absl::Microseconds(10),
      absl::Microseconds(50), absl::Microseconds(300), absl::Milliseconds(1),
      absl::Milliseconds(7),  absl::Seconds(10),       absl::Seconds(11),
      absl::Seconds(240),     absl::Seconds(250),      absl::Seconds(400)};
  for (absl::Duration d : observed) {
    metrics->RecordRequest(RpcMethod::kAttention, grpc::StatusCode::OK, d);
  }

  const auto families = metrics->Collect();
  const MetricFamily* durations =
      FindFamily(families, "attention_request_duration_seconds");
  ASSERT_NE(durations, nullptr);
  const ClientMetric* metric =
      FindMetric(*durations, {{"method", "Attention"}});
  ASSERT_NE(metric, nullptr);
  const auto& histogram = metric->histogram;
  ASSERT_EQ(histogram.bucket.size(), bounds.size() + 1);
  double expected_sum = 0;
  for (absl::Duration d : observed) {
    expected_sum += std::max(0.0, absl::ToDoubleSeconds(d));
  }
  for (size_t i = 0; i < bounds.size(); ++i) {
    EXPECT_DOUBLE_EQ(histogram.bucket[i].upper_bound, bounds[i]);
    uint64_t expected = 0;
    for (absl::Duration d : observed) {
      // Compare in integer nanoseconds, as the bounds are defined.
      if (std::max<int64_t>(0, absl::ToInt64Nanoseconds(d)) <=
          std::llround(bounds[i] * 1e9)) {
        ++expected;
      }
    }
    EXPECT_EQ(histogram.bucket[i].cumulative_count, expected)
        << "le=" << bounds[i];
  }
  EXPECT_TRUE(std::isinf(histogram.bucket.back().upper_bound));
  EXPECT_EQ(histogram.bucket.back().cumulative_count, observed.size());
  EXPECT_EQ(histogram.sample_count, observed.size());
  EXPECT_NEAR(histogram.sample_sum, expected_sum, 1e-9);
  // The other methods saw nothing.
  EXPECT_EQ(
      FindMetric(*durations, {{"method", "Prefill"}})->histogram.sample_count,
      0u);
}

TEST(ServerMetricsTest, DurationBucketsSpan50MicrosecondsTo250Seconds) {
  const std::vector<double>& bounds = ServerMetrics::RequestDurationBuckets();
  ASSERT_GE(bounds.size(), 2u);
  // Exactly the decimal bounds, as their `le` labels show them.
  EXPECT_EQ(bounds.front(), 50e-6);
  EXPECT_EQ(bounds[10], 0.1);
  EXPECT_EQ(bounds[16], 10.0);
  EXPECT_EQ(bounds.back(), 250.0);
  for (size_t i = 1; i < bounds.size(); ++i) {
    // Roughly exponential: each bound is 2 to 2.5 times the previous one.
    EXPECT_GE(bounds[i] / bounds[i - 1], 2.0 - 1e-9) << i;
    EXPECT_LE(bounds[i] / bounds[i - 1], 2.5 + 1e-9) << i;
  }
}

TEST(ServerMetricsTest, CountsDecodeBatches) {
  auto metrics = MakeMetrics();
  ASSERT_NE(metrics, nullptr);
  const std::vector<int64_t> batches = {1, 3, 8, 2000};
  for (int64_t size : batches) metrics->ObserveDecodeBatch(size);

  const auto families = metrics->Collect();
  const MetricFamily* batch =
      FindFamily(families, "attention_decode_batch_size");
  ASSERT_NE(batch, nullptr);
  ASSERT_EQ(batch->metric.size(), 1u);
  const auto& histogram = batch->metric[0].histogram;
  const std::vector<double>& bounds = ServerMetrics::DecodeBatchSizeBuckets();
  ASSERT_EQ(histogram.bucket.size(), bounds.size() + 1);
  double sum = 0;
  for (int64_t size : batches) sum += static_cast<double>(size);
  for (size_t i = 0; i < bounds.size(); ++i) {
    uint64_t expected = 0;
    for (int64_t size : batches) expected += size <= bounds[i] ? 1 : 0;
    EXPECT_EQ(histogram.bucket[i].cumulative_count, expected)
        << "le=" << bounds[i];
  }
  EXPECT_EQ(histogram.sample_count, batches.size());
  EXPECT_EQ(histogram.sample_sum, sum);
}

TEST(ServerMetricsTest, TracksOpenStreams) {
  auto metrics = MakeMetrics();
  ASSERT_NE(metrics, nullptr);
  const auto streams = [&] {
    return FindFamily(metrics->Collect(), "attention_streams_active")
        ->metric[0]
        .gauge.value;
  };
  {
    ScopedStreamMetric first(metrics.get());
    ScopedStreamMetric second(metrics.get());
    EXPECT_EQ(streams(), 2.0);
  }
  EXPECT_EQ(streams(), 0.0);
  metrics->StreamOpened();
  EXPECT_EQ(streams(), 1.0);
  metrics->StreamClosed();
  EXPECT_EQ(streams(), 0.0);
  ScopedStreamMetric no_metrics(nullptr);  // allowed, does nothing
}

TEST(ServerMetricsTest, ReadsEngineStateAtCollection) {
  auto metrics = MakeMetrics();
  ASSERT_NE(metrics, nullptr);
  EXPECT_EQ(FindFamily(metrics->Collect(), "attention_sessions_active"),
            nullptr)
      << "without a provider the state is absent, not 0";
  EXPECT_EQ(FindFamily(metrics->Collect(), "attention_tokens_total"), nullptr);

  MetricsState state = SomeState();
  int calls = 0;
  metrics->SetStateProvider([&] {
    ++calls;
    return state;
  });
  const auto value = [&](const std::vector<MetricFamily>& families,
                         const std::string& name) {
    const MetricFamily* family = FindFamily(families, name);
    EXPECT_NE(family, nullptr) << name;
    if (family == nullptr) return std::nan("");
    EXPECT_EQ(family->metric.size(), 1u);
    return family->type == MetricType::Counter ? family->metric[0].counter.value
                                               : family->metric[0].gauge.value;
  };
  auto families = metrics->Collect();
  EXPECT_EQ(calls, 1);
  const MetricFamily* tokens = FindFamily(families, "attention_tokens_total");
  ASSERT_NE(tokens, nullptr);
  EXPECT_EQ(tokens->type, MetricType::Counter);
  ASSERT_EQ(tokens->metric.size(), 2u);
  EXPECT_EQ(FindMetric(*tokens, {{"phase", "prefill"}})->counter.value,
            state.prefill_tokens_total);
  EXPECT_EQ(FindMetric(*tokens, {{"phase", "decode"}})->counter.value,
            state.decode_tokens_total);
  EXPECT_EQ(value(families, "attention_sessions_active"),
            state.sessions_active);
  EXPECT_EQ(value(families, "attention_sessions_created_total"),
            state.sessions_created_total);
  EXPECT_EQ(value(families, "attention_sessions_expired_total"),
            state.sessions_expired_total);
  EXPECT_EQ(value(families, "attention_session_metadata_bytes"),
            state.session_metadata_bytes);
  EXPECT_EQ(value(families, "attention_shared_kv_chunks_total"),
            state.shared_kv_chunks_total);
  EXPECT_EQ(value(families, "attention_backend_failed"), state.backend_failed);
  EXPECT_EQ(value(families, "attention_backend_scratch_bytes"),
            state.backend_scratch_bytes);
  EXPECT_EQ(value(families, "attention_kv_cache_capacity_bytes"),
            state.kv_cache_capacity_bytes);
  EXPECT_EQ(value(families, "attention_kv_cache_used_bytes"),
            state.kv_cache_used_bytes);
  EXPECT_DOUBLE_EQ(value(families, "attention_kv_cache_usage_ratio"),
                   static_cast<double>(state.kv_cache_used_bytes) /
                       static_cast<double>(state.kv_cache_capacity_bytes));
  EXPECT_EQ(value(families, "attention_kv_blocks_used"), state.kv_blocks_used);
  EXPECT_EQ(value(families, "attention_kv_blocks_capacity"),
            state.kv_blocks_capacity);

  // Read fresh at every collection.
  state.kv_cache_used_bytes = state.kv_cache_capacity_bytes;
  state.sessions_active = 0;
  families = metrics->Collect();
  EXPECT_EQ(value(families, "attention_kv_cache_usage_ratio"), 1.0);
  EXPECT_EQ(value(families, "attention_sessions_active"), 0.0);

  // An empty pool reports a ratio of 0, not NaN.
  state = MetricsState{};
  EXPECT_EQ(value(metrics->Collect(), "attention_kv_cache_usage_ratio"), 0.0);

  metrics->SetStateProvider(nullptr);
  const int calls_before = calls;
  EXPECT_EQ(FindFamily(metrics->Collect(), "attention_kv_cache_used_bytes"),
            nullptr);
  EXPECT_EQ(calls, calls_before);
}

TEST(ServerMetricsTest, BuildInfoIsOneWithItsLabels) {
  auto metrics = MakeMetrics();
  ASSERT_NE(metrics, nullptr);
  const auto families = metrics->Collect();
  const MetricFamily* info = FindFamily(families, "attention_build_info");
  ASSERT_NE(info, nullptr);
  const ClientMetric* metric = FindMetric(
      *info,
      {{"version", "1.2.3"}, {"backend", "cpu"}, {"device", "test-device"}});
  ASSERT_NE(metric, nullptr);
  EXPECT_EQ(metric->gauge.value, 1.0);
}

TEST(ServerMetricsTest, MapsEngineStats) {
  EngineStats stats;
  stats.prefill_tokens_total = 300;
  stats.decode_tokens_total = 40;
  stats.active_sessions = 5;
  stats.sessions_created_total = 9;
  stats.sessions_expired_total = 4;
  stats.session_metadata_bytes = 2048;
  stats.pool.capacity_bytes = 4096;
  stats.pool.used_bytes = 1024;
  stats.pool.blocks_used = 1;
  stats.pool.blocks_total = 4;
  stats.shared_kv_chunks_total = 6;
  stats.backend_failed = true;
  stats.backend_scratch_bytes = 8192;
  const MetricsState state = MetricsStateFromEngineStats(stats);
  EXPECT_EQ(state.backend_failed, 1);
  EXPECT_EQ(state.backend_scratch_bytes, 8192);
  EXPECT_EQ(state.prefill_tokens_total, stats.prefill_tokens_total);
  EXPECT_EQ(state.decode_tokens_total, stats.decode_tokens_total);
  EXPECT_EQ(state.shared_kv_chunks_total, stats.shared_kv_chunks_total);
  EXPECT_EQ(state.sessions_active, stats.active_sessions);
  EXPECT_EQ(state.sessions_created_total, stats.sessions_created_total);
  EXPECT_EQ(state.sessions_expired_total, stats.sessions_expired_total);
  EXPECT_EQ(state.session_metadata_bytes, stats.session_metadata_bytes);
  EXPECT_EQ(state.kv_cache_capacity_bytes, stats.pool.capacity_bytes);
  EXPECT_EQ(state.kv_cache_used_bytes, stats.pool.used_bytes);
  EXPECT_EQ(state.kv_blocks_used, stats.pool.blocks_used);
  EXPECT_EQ(state.kv_blocks_capacity, stats.pool.blocks_total);
}

// Many threads recording at once lose no update (atomics, no lock).
TEST(ServerMetricsTest, ConcurrentRecordingLosesNothing) {
  auto metrics = MakeMetrics();
  ASSERT_NE(metrics, nullptr);
  constexpr int kThreads = 8;
  constexpr int kPerThread = 5000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&metrics, t] {
      for (int i = 0; i < kPerThread; ++i) {
        metrics->RecordRequest(
            RpcMethod::kDecodeStep,
            t % 2 == 0 ? grpc::StatusCode::OK : grpc::StatusCode::NOT_FOUND,
            absl::Microseconds(i % 1000));
      }
    });
  }
  // Collecting while recording must be safe too.
  for (int i = 0; i < 20; ++i) metrics->TextExposition();
  for (std::thread& thread : threads) thread.join();

  const auto families = metrics->Collect();
  const MetricFamily* requests =
      FindFamily(families, "attention_requests_total");
  const double ok =
      FindMetric(*requests, {{"method", "DecodeStep"}, {"code", "OK"}})
          ->counter.value;
  const double not_found =
      FindMetric(*requests, {{"method", "DecodeStep"}, {"code", "NOT_FOUND"}})
          ->counter.value;
  EXPECT_EQ(ok + not_found, kThreads * kPerThread);
  EXPECT_EQ(ok, (kThreads + 1) / 2 * kPerThread);
  EXPECT_EQ(
      FindMetric(*FindFamily(families, "attention_request_duration_seconds"),
                 {{"method", "DecodeStep"}})
          ->histogram.sample_count,
      uint64_t{kThreads * kPerThread});
}

TEST(ServerMetricsTest, ServesMetricsOverHttp) {
  auto metrics = MakeMetrics("127.0.0.1:0");
  ASSERT_NE(metrics, nullptr);
  ASSERT_GT(metrics->port(), 0);
  metrics->RecordRequest(RpcMethod::kGetServerInfo, grpc::StatusCode::OK,
                         absl::Microseconds(80));
  metrics->SetStateProvider(SomeState);

  const std::string response = HttpGet(metrics->port(), "/metrics");
  EXPECT_THAT(response, HasSubstr("200 OK"));
  EXPECT_THAT(response,
              HasSubstr("attention_requests_total{method=\"GetServerInfo\","
                        "code=\"OK\"} 1"));
  EXPECT_THAT(response,
              HasSubstr("# TYPE attention_kv_cache_used_bytes gauge"));
  EXPECT_THAT(response, HasSubstr("attention_build_info{"));
  // The endpoint serves what TextExposition renders, plus prometheus-cpp's
  // own exposer_* scrape statistics.
  const std::string body = response.substr(response.find("\r\n\r\n") + 4);
  std::map<std::string, std::string> served = ExposedTypes(body);
  std::erase_if(served, [](const auto& entry) {
    return entry.first.rfind("exposer_", 0) == 0;
  });
  EXPECT_EQ(served, ExposedTypes(metrics->TextExposition()));
}

// Idle connections (a slow or hostile client) hold a worker each, only
// until the request timeout closes them: a scrape behind them still gets
// its answer.
TEST(ServerMetricsTest, IdleConnectionsDoNotBlindTheEndpoint) {
  ServerMetricsOptions options;
  options.listen_address = "127.0.0.1:0";
  options.http_threads = 1;
  options.request_timeout = absl::Milliseconds(500);
  auto metrics = ServerMetrics::Create(options);
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const int idle = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(idle, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>((*metrics)->port()));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(
      connect(idle, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  // civetweb's default timeout (30 s) would still hold the only worker
  // when HttpGet gives up (20 s).
  EXPECT_THAT(HttpGet((*metrics)->port(), "/metrics"), HasSubstr("200 OK"));
  close(idle);
}

TEST(ServerMetricsTest, PortInUseIsUnavailable) {
  auto first = MakeMetrics("127.0.0.1:0");
  ASSERT_NE(first, nullptr);
  ServerMetricsOptions options;
  options.listen_address = absl::StrCat("127.0.0.1:", first->port());
  auto second = ServerMetrics::Create(options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable)
      << second.status();
  EXPECT_THAT(second.status().message(), HasSubstr("--metrics_port"));
}

TEST(ServerMetricsTest, RejectsZeroHttpThreads) {
  ServerMetricsOptions options;
  options.listen_address = "127.0.0.1:0";
  options.http_threads = 0;
  EXPECT_EQ(ServerMetrics::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ServerMetricsTest, NoHttpEndpointWhenAddressIsEmpty) {
  auto metrics = MakeMetrics("");
  ASSERT_NE(metrics, nullptr);
  EXPECT_EQ(metrics->port(), 0);
}

}  // namespace
}  // namespace attention::server
