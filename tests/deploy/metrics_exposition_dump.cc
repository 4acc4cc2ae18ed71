// Prints the text exposition of a ServerMetrics (server/metrics.h), with
// every family present, so that the deploy tests can check the dashboard and
// alert rules against what the server really exports and lint it with
// `promtool check metrics` without starting a server.
#include <iostream>

#include "absl/time/time.h"
#include "server/metrics.h"

int main() {
  using attention::server::MetricsState;
  using attention::server::RpcMethod;
  using attention::server::ServerMetrics;
  using attention::server::ServerMetricsOptions;

  ServerMetricsOptions options;
  options.listen_address = "";  // no HTTP endpoint needed
  options.version = "0.0.0-dump";
  options.backend = "cpu";
  options.device = "metrics_exposition_dump";
  auto metrics = ServerMetrics::Create(options);
  if (!metrics.ok()) {
    std::cerr << "metrics_exposition_dump: " << metrics.status() << std::endl;
    return 1;
  }
  // Some activity, so that histograms have samples.
  (*metrics)->RecordRequest(RpcMethod::kPrefill, grpc::StatusCode::OK,
                            absl::Milliseconds(3));
  (*metrics)->ObserveDecodeBatch(4);
  (*metrics)->SetStateProvider([] {
    MetricsState state;
    state.prefill_tokens_total = 16;
    state.kv_cache_capacity_bytes = 1 << 20;
    state.kv_blocks_capacity = 16;
    return state;
  });
  std::cout << (*metrics)->TextExposition();
  return std::cout.good() ? 0 : 1;
}
