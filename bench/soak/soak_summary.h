// attn-soak: the end-of-run report: a table of calls per RPC and status
// code, one line per check, and the same as JSON.
#ifndef ATTENTION_BENCH_SOAK_SOAK_SUMMARY_H_
#define ATTENTION_BENCH_SOAK_SOAK_SUMMARY_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "bench/soak/rpc_tally.h"

namespace attention::soak {

struct CheckResult {
  std::string name;
  enum class Outcome { kPass, kFail, kSkip } outcome = Outcome::kFail;
  std::string detail;
};

struct SoakSummary {
  uint64_t seed = 0;
  absl::Duration duration;  // of the load
  absl::Duration warmup;
  int workers = 0;
  int threads_per_worker = 0;
  int workers_started = 0;
  int workers_killed = 0;
  int64_t sessions_left_behind = 0;  // deleted by the parent at the end
  int64_t rss_warmup_bytes = -1;     // -1: not measured
  int64_t rss_end_bytes = -1;
  int64_t rss_peak_bytes = -1;
  int64_t rss_after_cleanup_bytes = -1;
  std::vector<int64_t> rss_samples_bytes;  // one a second during the load
  std::vector<CheckResult> checks;

  bool passed() const;
};

// The table of calls/s and codes per RPC, then "CHECK <name>: PASS|FAIL|SKIP
// <detail>" lines and the samples of violations.
void PrintSummary(const SoakSummary& summary, const RpcTally& tally,
                  std::ostream& out);

// One JSON object: calls/s per RPC, code counts (per RPC and in total), RSS
// at warm-up and end, duration, checks.
std::string SummaryJson(const SoakSummary& summary, const RpcTally& tally);

}  // namespace attention::soak

#endif  // ATTENTION_BENCH_SOAK_SOAK_SUMMARY_H_
