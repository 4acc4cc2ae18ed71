// ServerMetrics: the attention-service Prometheus metrics and the HTTP
// endpoint (`/metrics`) that serves them.
//
// Families (Prometheus naming: base units, `_total` counters):
//   attention_requests_total{method,code}            counter
//   attention_request_duration_seconds{method}       histogram, 50 µs .. 250 s
//   attention_decode_batch_size                      histogram, 1 .. 1024
//   attention_streams_active                         gauge
//   attention_streams_opened_total                   counter
//   attention_tokens_total{phase="prefill"|"decode"} counter  } read from the
//   attention_sessions_active                        gauge    } state
//   attention_sessions_created_total                 counter  } provider at
//   attention_sessions_expired_total                 counter  } scrape time
//   attention_session_metadata_bytes                 gauge    }
//   attention_kv_cache_capacity_bytes                gauge    }
//   attention_kv_cache_used_bytes                    gauge    }
//   attention_kv_cache_usage_ratio                   gauge    } (0..1)
//   attention_kv_blocks_used                         gauge    }
//   attention_kv_blocks_capacity                     gauge    }
//   attention_shared_kv_chunks_total                 counter  }
//   attention_sessions_exported_total                counter  } session
//   attention_session_export_bytes_total             counter  } snapshots:
//   attention_sessions_imported_total                counter  } Export/
//   attention_session_import_bytes_total             counter  } ImportSession,
//   attention_snapshot_sessions_written_total        counter  } --snapshot_dir
//   attention_snapshot_sessions_failed_total         counter  } on drain and
//   attention_snapshot_duration_seconds              gauge    } on start
//   attention_sessions_restored_total                counter  }
//   attention_snapshots_corrupt_total                counter  }
//   attention_snapshots_rejected_total               counter  }
//   attention_snapshots_kept_total                   counter  }
//   attention_tenant_sessions{tenant}                gauge    } (tenants of
//   attention_tenant_kv_bytes{tenant}                gauge    } tokens file)
//   attention_build_info{version,backend,device}     gauge, always 1
//
// Recording is on the serving hot path, so it takes no lock and allocates
// nothing: every (method, code) counter and every histogram bucket exists
// from construction in fixed arrays of atomics, and a call is an array index
// plus relaxed atomic adds. Values that the engine already keeps (tokens,
// sessions, KV pool) are not duplicated here; a state provider is asked for
// them when Prometheus scrapes, so they are never stale and cost nothing
// between scrapes.
//
// Usage (attention-server):
//   ATTN_ASSIGN_OR_RETURN(auto metrics, ServerMetrics::Create(
//       {.listen_address = "0.0.0.0:9464", .version = ..., .backend = "cpu",
//        .device = ...}));
//   metrics->SetStateProvider([engine] {
//     return MetricsStateFromEngineStats(engine->stats());
//   });
//   ... in each handler: metrics->RecordRequest(RpcMethod::kPrefill,
//                                               status.error_code(), elapsed);
//   ... before the engine is destroyed: metrics->SetStateProvider(nullptr);
#ifndef ATTENTION_SERVER_METRICS_H_
#define ATTENTION_SERVER_METRICS_H_

#include <grpcpp/support/status_code_enum.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/engine.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace attention::server {

// The RPCs of attention.v1.AttentionService; RpcMethodName gives the label
// value (the RPC's name as in the proto).
enum class RpcMethod : int {
  kCreateSession = 0,
  kGetSession,
  kListSessions,
  kDeleteSession,
  kForkSession,
  kTruncateSession,
  kPrefill,
  kDecodeStep,
  kDecode,
  kBatchDecode,
  kAttention,
  kGetServerInfo,
  kExportSession,
  kImportSession,
};
inline constexpr int kNumRpcMethods = 14;
absl::string_view RpcMethodName(RpcMethod method);
// The method of a gRPC path ("/attention.v1.AttentionService/Prefill");
// nullopt for any other service's.
std::optional<RpcMethod> RpcMethodOfPath(absl::string_view path);
// The gRPC path of `method` (the inverse of RpcMethodOfPath).
std::string RpcMethodPath(RpcMethod method);

// gRPC's canonical code name ("OK", "INVALID_ARGUMENT", ...), the `code`
// label value. Codes outside 0..16 are reported as "UNKNOWN".
inline constexpr int kNumGrpcCodes = 17;
absl::string_view GrpcCodeName(grpc::StatusCode code);

// One tenant's usage, exported with a `tenant` label (only for tenants the
// tokens file names, so that the label's values stay few).
struct TenantMetricsState {
  std::string tenant;
  int64_t sessions = 0;
  int64_t kv_bytes = 0;
};

// Engine state exported at scrape time. The *_total fields must never
// decrease over the life of a process (they are exported as counters).
struct MetricsState {
  // attention_tokens_total{phase}: EngineStats' token counts.
  int64_t prefill_tokens_total = 0;
  int64_t decode_tokens_total = 0;
  int64_t sessions_active = 0;
  int64_t sessions_created_total = 0;
  int64_t sessions_expired_total = 0;
  int64_t session_metadata_bytes = 0;
  int64_t kv_cache_capacity_bytes = 0;
  int64_t kv_cache_used_bytes = 0;
  int64_t kv_blocks_used = 0;
  int64_t kv_blocks_capacity = 0;
  int64_t shared_kv_chunks_total = 0;
  // attention_tenant_sessions / attention_tenant_kv_bytes {tenant}; the
  // families are left out when empty.
  std::vector<TenantMetricsState> tenants;
  // attention_backend_failed (0 or 1) and attention_backend_scratch_bytes.
  int64_t backend_failed = 0;
  int64_t backend_scratch_bytes = 0;
  // attention_moved_sessions (tombstones held) and
  // attention_moved_session_redirects_total: EngineStats' counts.
  int64_t moved_sessions = 0;
  int64_t moved_session_redirects_total = 0;
};

inline MetricsState MetricsStateFromEngineStats(const EngineStats& stats) {
  MetricsState state;
  state.prefill_tokens_total = stats.prefill_tokens_total;
  state.decode_tokens_total = stats.decode_tokens_total;
  state.sessions_active = stats.active_sessions;
  state.sessions_created_total = stats.sessions_created_total;
  state.sessions_expired_total = stats.sessions_expired_total;
  state.session_metadata_bytes = stats.session_metadata_bytes;
  state.kv_cache_capacity_bytes = stats.pool.capacity_bytes;
  state.kv_cache_used_bytes = stats.pool.used_bytes;
  state.kv_blocks_used = stats.pool.blocks_used;
  state.kv_blocks_capacity = stats.pool.blocks_total;
  state.shared_kv_chunks_total = stats.shared_kv_chunks_total;
  state.backend_failed = stats.backend_failed ? 1 : 0;
  state.backend_scratch_bytes = stats.backend_scratch_bytes;
  state.moved_sessions = stats.moved_sessions;
  state.moved_session_redirects_total = stats.moved_session_redirects_total;
  return state;
}

struct ServerMetricsOptions {
  // Where the HTTP endpoint serving `/metrics` listens, "host:port" (IPv6 as
  // "[::]:9464"); port 0 picks a free port (see ServerMetrics::port()).
  // Empty: no HTTP endpoint; the metrics are still recorded and readable
  // through Collect()/TextExposition() (tests, embedding).
  std::string listen_address = "0.0.0.0:9464";
  // HTTP worker threads of the endpoint (one per open connection).
  int http_threads = 2;
  // A connection that has not sent a whole request within this is closed,
  // so that idle connections hold the workers only this long (civetweb's
  // default, 30 s, let two idle connections blind the scrapes).
  absl::Duration request_timeout = absl::Seconds(2);
  // Labels of attention_build_info.
  std::string version;
  std::string backend;  // "cpu" or "cuda"
  std::string device;
};

// Thread-safety: every method is thread-safe. RecordRequest,
// ObserveDecodeBatch, StreamOpened and StreamClosed are lock-free and
// allocation-free; the other methods may block on a scrape in progress.
class ServerMetrics {
 public:
  // Histogram bucket upper bounds (the `le` labels; +Inf is implied).
  static const std::vector<double>& RequestDurationBuckets();  // seconds
  static const std::vector<double>& DecodeBatchSizeBuckets();

  // Creates the metrics and, unless options.listen_address is empty, starts
  // serving them over HTTP. Errors: INVALID_ARGUMENT for http_threads < 1;
  // UNAVAILABLE when the address cannot be bound (port in use, bad address).
  static absl::StatusOr<std::unique_ptr<ServerMetrics>> Create(
      const ServerMetricsOptions& options);

  // Stops the HTTP endpoint (waiting for a scrape in progress) first.
  ~ServerMetrics();

  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // The bound HTTP port, or 0 without an HTTP endpoint.
  int port() const { return port_; }

  // One finished call of `method` with final status `code` that took
  // `elapsed` (negative durations count as 0). For the Decode stream, record
  // each answered step (its own latency) and the failing step's code, so
  // that Decode's latency histogram is per step like DecodeStep's.
  void RecordRequest(RpcMethod method, grpc::StatusCode code,
                     absl::Duration elapsed);

  // Steps run as one engine batch: a BatchDecode call, or concurrent decode
  // steps the server gathered into one AppendBatch. Record each engine
  // batch once (not both the call and the gathered batch it joined).
  void ObserveDecodeBatch(int64_t size);

  // Session snapshots. A finished export or import (ExportSession,
  // ImportSession, a --snapshot_dir file) of `bytes` K/V bytes.
  void RecordExport(int64_t bytes);
  void RecordImport(int64_t bytes);
  // The snapshot on drain: sessions written and not written, and how long
  // it took (attention_snapshot_duration_seconds is the last one's).
  void RecordSnapshot(int64_t written, int64_t failed, absl::Duration duration);
  // The restore at start-up: sessions restored, files found corrupt, valid
  // files this server refuses, files left for the next start.
  void RecordRestore(int64_t restored, int64_t corrupt, int64_t rejected,
                     int64_t kept);
  // Handovers on drain (server/session_handover.h): sessions this replica
  // moved to a peer, and those it could not; and a session a draining peer
  // moved here (a handover's ImportSession).
  void RecordHandovers(int64_t sent, int64_t failed);
  void RecordHandoverReceived();

  // Open Decode streams (attention_streams_active) and those ever opened
  // (attention_streams_opened_total). Calls must pair up.
  void StreamOpened();
  void StreamClosed();

  // Sets the function asked for the engine state at each scrape; it must be
  // thread-safe and cheap. Null removes it, and the state families are then
  // left out of the exposition (absent rather than a false 0). Once this
  // returns, the previous provider is not running and is never called
  // again, so it may capture objects that are destroyed afterwards.
  void SetStateProvider(std::function<MetricsState()> provider);

  // A registry served beside these metrics, for families added by other
  // parts of the server. Lives as long as this object.
  prometheus::Registry& registry() { return *registry_; }

  // Everything `/metrics` serves, as metric families / as the text
  // exposition format.
  std::vector<prometheus::MetricFamily> Collect() const;
  std::string TextExposition() const;

 private:
  class Collector;

  explicit ServerMetrics(const ServerMetricsOptions& options);

  // Declared in destruction order: the endpoint goes first so that no
  // scrape reaches the collectors while they are destroyed.
  std::shared_ptr<Collector> collector_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

// Calls StreamOpened() now and StreamClosed() when it goes out of scope.
class ScopedStreamMetric {
 public:
  // `metrics` may be null (no metrics); otherwise it must outlive this.
  explicit ScopedStreamMetric(ServerMetrics* metrics);
  ~ScopedStreamMetric();

  ScopedStreamMetric(const ScopedStreamMetric&) = delete;
  ScopedStreamMetric& operator=(const ScopedStreamMetric&) = delete;

 private:
  ServerMetrics* const metrics_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_METRICS_H_
