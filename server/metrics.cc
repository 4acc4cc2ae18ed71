#include "server/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <exception>
#include <limits>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/types/span.h"

namespace attention::server {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

constexpr std::array<absl::string_view, kNumRpcMethods> kMethodNames = {
    "CreateSession", "GetSession",      "ListSessions", "DeleteSession",
    "ForkSession",   "TruncateSession", "Prefill",      "DecodeStep",
    "Decode",        "BatchDecode",     "Attention",    "GetServerInfo",
    "ExportSession", "ImportSession",
};

// Indexed by grpc::StatusCode.
constexpr std::array<absl::string_view, kNumGrpcCodes> kCodeNames = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

// 1-2.5-5 steps from 50 µs to 250 s (prefills near --max_call_flops on a
// CPU, transfers of large sessions), in nanoseconds so that recording
// compares integers.
constexpr std::array<int64_t, 21> kDurationBoundsNanos = {
    50'000,         100'000,        250'000,        500'000,
    1'000'000,      2'500'000,      5'000'000,      10'000'000,
    25'000'000,     50'000'000,     100'000'000,    250'000'000,
    500'000'000,    1'000'000'000,  2'500'000'000,  5'000'000'000,
    10'000'000'000, 25'000'000'000, 50'000'000'000, 100'000'000'000,
    250'000'000'000};

constexpr std::array<int64_t, 11> kBatchBounds = {1,  2,   4,   8,   16,  32,
                                                  64, 128, 256, 512, 1024};

int CodeIndex(grpc::StatusCode code) {
  const int index = static_cast<int>(code);
  return index >= 0 && index < kNumGrpcCodes ? index
                                             : grpc::StatusCode::UNKNOWN;
}

// A histogram over integer observations with fixed bounds: one atomic per
// bucket (non-cumulative; +Inf last) and an integer sum, so that Observe is
// two relaxed adds. The count is derived from the buckets at collection, so
// the exported _count always equals the +Inf bucket.
template <size_t kNumBounds>
class AtomicHistogram {
 public:
  explicit AtomicHistogram(const std::array<int64_t, kNumBounds>& bounds)
      : bounds_(bounds) {}

  void Observe(int64_t value) {
    // lower_bound: the first bound >= value, as `le` means.
    const size_t bucket =
        std::lower_bound(bounds_.begin(), bounds_.end(), value) -
        bounds_.begin();
    buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
    sum_.fetch_add(value, std::memory_order_relaxed);
  }

  // `unit` converts bounds and sum to the exported unit.
  ClientMetric::Histogram Collect(double unit) const {
    ClientMetric::Histogram out;
    uint64_t cumulative = 0;
    for (size_t i = 0; i <= kNumBounds; ++i) {
      cumulative += buckets_[i].load(std::memory_order_relaxed);
      ClientMetric::Bucket bucket;
      bucket.cumulative_count = cumulative;
      bucket.upper_bound = i < kNumBounds
                               ? static_cast<double>(bounds_[i]) * unit
                               : std::numeric_limits<double>::infinity();
      out.bucket.push_back(bucket);
    }
    out.sample_count = cumulative;
    out.sample_sum =
        static_cast<double>(sum_.load(std::memory_order_relaxed)) * unit;
    return out;
  }

 private:
  const std::array<int64_t, kNumBounds>& bounds_;
  std::array<std::atomic<uint64_t>, kNumBounds + 1> buckets_{};
  std::atomic<int64_t> sum_{0};
};

// One cache line (or more) per method, so that the hot DecodeStep counters
// do not share a line with other methods'.
struct alignas(64) MethodCounters {
  std::array<std::atomic<uint64_t>, kNumGrpcCodes> by_code{};
  AtomicHistogram<kDurationBoundsNanos.size()> duration{kDurationBoundsNanos};
};

ClientMetric::Label Label(absl::string_view name, absl::string_view value) {
  return ClientMetric::Label{std::string(name), std::string(value)};
}

MetricFamily Family(absl::string_view name, absl::string_view help,
                    MetricType type) {
  MetricFamily family;
  family.name = std::string(name);
  family.help = std::string(help);
  family.type = type;
  return family;
}

// A family with one unlabelled sample.
MetricFamily Scalar(absl::string_view name, absl::string_view help,
                    MetricType type, double value) {
  MetricFamily family = Family(name, help, type);
  ClientMetric metric;
  if (type == MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(std::move(metric));
  return family;
}

// values[i] / per_unit, each the double nearest the exact quotient (250 s
// is 250, not 250.00000000000003 as 250e9 * 1e-9 gives), so that the
// buckets' `le` labels read as the bounds.
std::vector<double> ToDoubles(absl::Span<const int64_t> values,
                              double per_unit) {
  std::vector<double> out;
  for (int64_t v : values) out.push_back(static_cast<double>(v) / per_unit);
  return out;
}

}  // namespace

absl::string_view RpcMethodName(RpcMethod method) {
  const int index = static_cast<int>(method);
  return index >= 0 && index < kNumRpcMethods ? kMethodNames[index] : "unknown";
}

constexpr absl::string_view kServicePathPrefix =
    "/attention.v1.AttentionService/";

std::string RpcMethodPath(RpcMethod method) {
  return absl::StrCat(kServicePathPrefix, RpcMethodName(method));
}

std::optional<RpcMethod> RpcMethodOfPath(absl::string_view path) {
  if (!absl::ConsumePrefix(&path, kServicePathPrefix)) {
    return std::nullopt;
  }
  for (int i = 0; i < kNumRpcMethods; ++i) {
    if (path == kMethodNames[i]) return static_cast<RpcMethod>(i);
  }
  return std::nullopt;
}

absl::string_view GrpcCodeName(grpc::StatusCode code) {
  return kCodeNames[CodeIndex(code)];
}

// The metrics this file owns, served as one prometheus::Collectable.
class ServerMetrics::Collector final : public prometheus::Collectable {
 public:
  void RecordRequest(RpcMethod method, grpc::StatusCode code,
                     absl::Duration elapsed) {
    const int index = static_cast<int>(method);
    if (index < 0 || index >= kNumRpcMethods) return;
    MethodCounters& counters = methods_[index];
    counters.by_code[CodeIndex(code)].fetch_add(1, std::memory_order_relaxed);
    counters.duration.Observe(
        std::max<int64_t>(0, absl::ToInt64Nanoseconds(elapsed)));
  }

  void ObserveDecodeBatch(int64_t size) {
    decode_batch_.Observe(std::max<int64_t>(0, size));
  }

  void AddSnapshotCounts(int64_t exported, int64_t exported_bytes,
                         int64_t imported, int64_t imported_bytes) {
    exported_.fetch_add(exported, std::memory_order_relaxed);
    exported_bytes_.fetch_add(exported_bytes, std::memory_order_relaxed);
    imported_.fetch_add(imported, std::memory_order_relaxed);
    imported_bytes_.fetch_add(imported_bytes, std::memory_order_relaxed);
  }

  void RecordSnapshot(int64_t written, int64_t failed,
                      absl::Duration duration) {
    snapshot_written_.fetch_add(written, std::memory_order_relaxed);
    snapshot_failed_.fetch_add(failed, std::memory_order_relaxed);
    snapshot_duration_ns_.store(absl::ToInt64Nanoseconds(duration),
                                std::memory_order_relaxed);
  }

  void RecordRestore(int64_t restored, int64_t corrupt, int64_t rejected,
                     int64_t kept) {
    restored_.fetch_add(restored, std::memory_order_relaxed);
    corrupt_.fetch_add(corrupt, std::memory_order_relaxed);
    rejected_.fetch_add(rejected, std::memory_order_relaxed);
    kept_.fetch_add(kept, std::memory_order_relaxed);
  }

  void RecordHandovers(int64_t sent, int64_t failed) {
    handovers_sent_.fetch_add(sent, std::memory_order_relaxed);
    handovers_failed_.fetch_add(failed, std::memory_order_relaxed);
  }
  void RecordHandoverReceived() {
    handovers_received_.fetch_add(1, std::memory_order_relaxed);
  }

  void AddStreams(int64_t delta) {
    streams_active_.fetch_add(delta, std::memory_order_relaxed);
    if (delta > 0) streams_opened_.fetch_add(delta, std::memory_order_relaxed);
  }

  void SetStateProvider(std::function<MetricsState()> provider) {
    absl::MutexLock lock(&provider_mu_);
    provider_ = std::move(provider);
  }

  std::vector<MetricFamily> Collect() const override {
    std::vector<MetricFamily> families;

    MetricFamily requests =
        Family("attention_requests_total",
               "Finished RPCs by method and gRPC status code (Decode: "
               "stream steps).",
               MetricType::Counter);
    MetricFamily durations =
        Family("attention_request_duration_seconds",
               "RPC handling time by method (Decode: per stream step).",
               MetricType::Histogram);
    for (int m = 0; m < kNumRpcMethods; ++m) {
      const MethodCounters& counters = methods_[m];
      for (int c = 0; c < kNumGrpcCodes; ++c) {
        ClientMetric metric;
        metric.label = {Label("method", kMethodNames[m]),
                        Label("code", kCodeNames[c])};
        metric.counter.value = static_cast<double>(
            counters.by_code[c].load(std::memory_order_relaxed));
        requests.metric.push_back(std::move(metric));
      }
      ClientMetric metric;
      metric.label = {Label("method", kMethodNames[m])};
      metric.histogram = counters.duration.Collect(1e-9);
      durations.metric.push_back(std::move(metric));
    }
    families.push_back(std::move(requests));
    families.push_back(std::move(durations));

    MetricFamily batch =
        Family("attention_decode_batch_size",
               "Decode steps run as one engine batch (a BatchDecode call, or "
               "concurrent steps gathered by the server).",
               MetricType::Histogram);
    ClientMetric batch_metric;
    batch_metric.histogram = decode_batch_.Collect(1.0);
    batch.metric.push_back(std::move(batch_metric));
    families.push_back(std::move(batch));

    families.push_back(Scalar(
        "attention_streams_active", "Open Decode streams.", MetricType::Gauge,
        static_cast<double>(streams_active_.load(std::memory_order_relaxed))));
    families.push_back(Scalar(
        "attention_streams_opened_total", "Decode streams opened.",
        MetricType::Counter,
        static_cast<double>(streams_opened_.load(std::memory_order_relaxed))));

    const auto load = [](const std::atomic<int64_t>& value) {
      return static_cast<double>(value.load(std::memory_order_relaxed));
    };
    families.push_back(Scalar("attention_sessions_exported_total",
                              "Sessions exported (ExportSession).",
                              MetricType::Counter, load(exported_)));
    families.push_back(Scalar("attention_session_export_bytes_total",
                              "K/V bytes of exported sessions.",
                              MetricType::Counter, load(exported_bytes_)));
    families.push_back(Scalar("attention_sessions_imported_total",
                              "Sessions imported (ImportSession).",
                              MetricType::Counter, load(imported_)));
    families.push_back(Scalar("attention_session_import_bytes_total",
                              "K/V bytes of imported sessions.",
                              MetricType::Counter, load(imported_bytes_)));
    families.push_back(
        Scalar("attention_snapshot_sessions_written_total",
               "Sessions written to --snapshot_dir while draining.",
               MetricType::Counter, load(snapshot_written_)));
    families.push_back(
        Scalar("attention_snapshot_sessions_failed_total",
               "Sessions the snapshot on drain could not write (error or "
               "--drain_timeout).",
               MetricType::Counter, load(snapshot_failed_)));
    families.push_back(Scalar(
        "attention_snapshot_duration_seconds",
        "How long the last snapshot of every session to --snapshot_dir took.",
        MetricType::Gauge, load(snapshot_duration_ns_) * 1e-9));
    families.push_back(
        Scalar("attention_sessions_restored_total",
               "Sessions restored from --snapshot_dir at start-up.",
               MetricType::Counter, load(restored_)));
    families.push_back(Scalar(
        "attention_snapshots_corrupt_total",
        "Snapshot files that failed validation at start-up (moved aside as "
        "*.corrupt).",
        MetricType::Counter, load(corrupt_)));
    families.push_back(
        Scalar("attention_snapshots_rejected_total",
               "Snapshot files this server refuses for good at start-up (id "
               "taken, not a regular file; moved aside as *.rejected).",
               MetricType::Counter, load(rejected_)));
    families.push_back(Scalar(
        "attention_snapshots_kept_total",
        "Snapshot files this server could not restore at start-up for now "
        "(KV pool or --max_sessions full, an I/O error, a spec or layout "
        "this configuration cannot hold); left in place for the next "
        "start.",
        MetricType::Counter, load(kept_)));

    families.push_back(
        Scalar("attention_handovers_sent_total",
               "Sessions this replica handed over to a peer while draining.",
               MetricType::Counter, load(handovers_sent_)));
    families.push_back(Scalar(
        "attention_handovers_failed_total",
        "Sessions a draining replica tried to hand over and could not (they "
        "fall back to --snapshot_dir when set).",
        MetricType::Counter, load(handovers_failed_)));
    families.push_back(
        Scalar("attention_handovers_received_total",
               "Sessions a draining peer handed over to this replica.",
               MetricType::Counter, load(handovers_received_)));

    // Holding the lock while the provider runs is what lets
    // SetStateProvider promise that a replaced provider is no longer used.
    absl::MutexLock lock(&provider_mu_);
    if (provider_) AppendState(provider_(), &families);
    return families;
  }

 private:
  static void AppendState(const MetricsState& s,
                          std::vector<MetricFamily>* families) {
    const auto d = [](int64_t v) { return static_cast<double>(v); };
    MetricFamily tokens =
        Family("attention_tokens_total",
               "Tokens appended to sessions, by phase (prefill or decode).",
               MetricType::Counter);
    for (const auto& [phase, count] :
         {std::pair{"prefill", s.prefill_tokens_total},
          std::pair{"decode", s.decode_tokens_total}}) {
      ClientMetric metric;
      metric.label = {Label("phase", phase)};
      metric.counter.value = d(count);
      tokens.metric.push_back(std::move(metric));
    }
    families->push_back(std::move(tokens));
    families->push_back(Scalar("attention_sessions_active", "Live sessions.",
                               MetricType::Gauge, d(s.sessions_active)));
    families->push_back(Scalar("attention_sessions_created_total",
                               "Sessions created (including forks).",
                               MetricType::Counter,
                               d(s.sessions_created_total)));
    families->push_back(Scalar("attention_sessions_expired_total",
                               "Sessions removed after their idle timeout.",
                               MetricType::Counter,
                               d(s.sessions_expired_total)));
    families->push_back(Scalar(
        "attention_session_metadata_bytes",
        "Host memory of live sessions' metadata: specs, labels, sink logits.",
        MetricType::Gauge, d(s.session_metadata_bytes)));
    families->push_back(Scalar(
        "attention_shared_kv_chunks_total",
        "KV chunks (512 keys of one KV head) read once for several decode "
        "steps of sessions sharing a prompt (forks).",
        MetricType::Counter, d(s.shared_kv_chunks_total)));
    families->push_back(Scalar(
        "attention_backend_failed",
        "1 once the attention backend's device failed for good (a sticky "
        "CUDA error); health is then NOT_SERVING.",
        MetricType::Gauge, d(s.backend_failed)));
    families->push_back(Scalar(
        "attention_backend_scratch_bytes",
        "Device memory reserved at start-up for per-call scratch, outside "
        "the KV cache.",
        MetricType::Gauge, d(s.backend_scratch_bytes)));
    families->push_back(
        Scalar("attention_moved_sessions",
               "Sessions handed over to peers whose ids this replica still "
               "redirects (tombstones).",
               MetricType::Gauge, d(s.moved_sessions)));
    families->push_back(Scalar(
        "attention_moved_session_redirects_total",
        "Calls on a moved session answered with NOT_FOUND naming its new "
        "owner (attention-session-owner).",
        MetricType::Counter, d(s.moved_session_redirects_total)));
    families->push_back(Scalar("attention_kv_cache_capacity_bytes",
                               "KV block pool capacity.", MetricType::Gauge,
                               d(s.kv_cache_capacity_bytes)));
    families->push_back(Scalar("attention_kv_cache_used_bytes",
                               "KV block pool bytes in referenced blocks.",
                               MetricType::Gauge, d(s.kv_cache_used_bytes)));
    families->push_back(Scalar(
        "attention_kv_cache_usage_ratio",
        "Used over capacity of the KV block pool (0 to 1).", MetricType::Gauge,
        s.kv_cache_capacity_bytes > 0
            ? std::clamp(
                  d(s.kv_cache_used_bytes) / d(s.kv_cache_capacity_bytes), 0.0,
                  1.0)
            : 0.0));
    families->push_back(Scalar("attention_kv_blocks_used",
                               "KV blocks with at least one reference.",
                               MetricType::Gauge, d(s.kv_blocks_used)));
    families->push_back(Scalar("attention_kv_blocks_capacity",
                               "KV blocks in the pool.", MetricType::Gauge,
                               d(s.kv_blocks_capacity)));
    if (s.tenants.empty()) return;
    MetricFamily sessions =
        Family("attention_tenant_sessions",
               "Live sessions of each tenant of the tokens file.",
               MetricType::Gauge);
    MetricFamily kv_bytes = Family(
        "attention_tenant_kv_bytes",
        "Bytes of the KV blocks each tenant's sessions reference (a block "
        "shared by forks counted once).",
        MetricType::Gauge);
    for (const TenantMetricsState& tenant : s.tenants) {
      ClientMetric metric;
      metric.label = {Label("tenant", tenant.tenant)};
      metric.gauge.value = d(tenant.sessions);
      sessions.metric.push_back(metric);
      metric.gauge.value = d(tenant.kv_bytes);
      kv_bytes.metric.push_back(std::move(metric));
    }
    families->push_back(std::move(sessions));
    families->push_back(std::move(kv_bytes));
  }

  std::array<MethodCounters, kNumRpcMethods> methods_;
  AtomicHistogram<kBatchBounds.size()> decode_batch_{kBatchBounds};
  alignas(64) std::atomic<int64_t> streams_active_{0};
  std::atomic<int64_t> streams_opened_{0};
  std::atomic<int64_t> exported_{0};
  std::atomic<int64_t> exported_bytes_{0};
  std::atomic<int64_t> imported_{0};
  std::atomic<int64_t> imported_bytes_{0};
  std::atomic<int64_t> snapshot_written_{0};
  std::atomic<int64_t> snapshot_failed_{0};
  std::atomic<int64_t> snapshot_duration_ns_{0};
  std::atomic<int64_t> restored_{0};
  std::atomic<int64_t> corrupt_{0};
  std::atomic<int64_t> rejected_{0};
  std::atomic<int64_t> kept_{0};
  std::atomic<int64_t> handovers_sent_{0};
  std::atomic<int64_t> handovers_failed_{0};
  std::atomic<int64_t> handovers_received_{0};

  mutable absl::Mutex provider_mu_;
  std::function<MetricsState()> provider_ ABSL_GUARDED_BY(provider_mu_);
};

const std::vector<double>& ServerMetrics::RequestDurationBuckets() {
  static const auto* const buckets =
      new std::vector<double>(ToDoubles(kDurationBoundsNanos, 1e9));
  return *buckets;
}

const std::vector<double>& ServerMetrics::DecodeBatchSizeBuckets() {
  static const auto* const buckets =
      new std::vector<double>(ToDoubles(kBatchBounds, 1.0));
  return *buckets;
}

ServerMetrics::ServerMetrics(const ServerMetricsOptions& options)
    : collector_(std::make_shared<Collector>()),
      registry_(std::make_shared<prometheus::Registry>()) {
  prometheus::BuildGauge()
      .Name("attention_build_info")
      .Help("Always 1; the labels say which build and backend is serving.")
      .Register(*registry_)
      .Add({{"version", options.version},
            {"backend", options.backend},
            {"device", options.device}})
      .Set(1);
}

absl::StatusOr<std::unique_ptr<ServerMetrics>> ServerMetrics::Create(
    const ServerMetricsOptions& options) {
  if (options.http_threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics http_threads is ", options.http_threads, "; it must be >= 1"));
  }
  std::unique_ptr<ServerMetrics> metrics(new ServerMetrics(options));
  if (options.listen_address.empty()) return metrics;
  // civetweb reports a failed bind by throwing; nothing else here throws.
  try {
    metrics->exposer_ =
        std::make_unique<prometheus::Exposer>(std::vector<std::string>{
            "listening_ports", options.listen_address, "num_threads",
            absl::StrCat(options.http_threads), "request_timeout_ms",
            absl::StrCat(absl::ToInt64Milliseconds(options.request_timeout))});
  } catch (const std::exception& e) {
    // Debian's civetweb has no IPv6: an IPv6 address cannot be bound.
    const bool ipv6 = absl::StartsWith(options.listen_address, "[");
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", options.listen_address, " (", e.what(),
        "); choose another --metrics_port, or a free one with 0",
        ipv6 ? "; the metrics endpoint may not bind IPv6 addresses: give "
               "--metrics_address an IPv4 one (or :: for every address it "
               "can)"
             : ""));
  }
  metrics->exposer_->RegisterCollectable(metrics->collector_);
  metrics->exposer_->RegisterCollectable(metrics->registry_);
  const std::vector<int> ports = metrics->exposer_->GetListeningPorts();
  metrics->port_ = ports.empty() ? 0 : ports.front();
  return metrics;
}

ServerMetrics::~ServerMetrics() = default;

void ServerMetrics::RecordRequest(RpcMethod method, grpc::StatusCode code,
                                  absl::Duration elapsed) {
  collector_->RecordRequest(method, code, elapsed);
}

void ServerMetrics::ObserveDecodeBatch(int64_t size) {
  collector_->ObserveDecodeBatch(size);
}

void ServerMetrics::RecordExport(int64_t bytes) {
  collector_->AddSnapshotCounts(1, bytes, 0, 0);
}

void ServerMetrics::RecordImport(int64_t bytes) {
  collector_->AddSnapshotCounts(0, 0, 1, bytes);
}

void ServerMetrics::RecordSnapshot(int64_t written, int64_t failed,
                                   absl::Duration duration) {
  collector_->RecordSnapshot(written, failed, duration);
}

void ServerMetrics::RecordRestore(int64_t restored, int64_t corrupt,
                                  int64_t rejected, int64_t kept) {
  collector_->RecordRestore(restored, corrupt, rejected, kept);
}

void ServerMetrics::RecordHandovers(int64_t sent, int64_t failed) {
  collector_->RecordHandovers(sent, failed);
}

void ServerMetrics::RecordHandoverReceived() {
  collector_->RecordHandoverReceived();
}

void ServerMetrics::StreamOpened() { collector_->AddStreams(1); }

void ServerMetrics::StreamClosed() { collector_->AddStreams(-1); }

void ServerMetrics::SetStateProvider(std::function<MetricsState()> provider) {
  collector_->SetStateProvider(std::move(provider));
}

std::vector<prometheus::MetricFamily> ServerMetrics::Collect() const {
  std::vector<MetricFamily> families = collector_->Collect();
  for (MetricFamily& family : registry_->Collect()) {
    families.push_back(std::move(family));
  }
  return families;
}

std::string ServerMetrics::TextExposition() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, Collect());
  return out.str();
}

ScopedStreamMetric::ScopedStreamMetric(ServerMetrics* metrics)
    : metrics_(metrics) {
  if (metrics_ != nullptr) metrics_->StreamOpened();
}

ScopedStreamMetric::~ScopedStreamMetric() {
  if (metrics_ != nullptr) metrics_->StreamClosed();
}

}  // namespace attention::server
