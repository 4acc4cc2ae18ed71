// attn-soak: the parent process. Starts the server (or uses a given one),
// runs worker processes (this executable re-run with --worker_report) for
// the duration, SIGKILLs some at random moments and starts replacements,
// samples the server's RSS, then deletes what the workers left behind and
// checks the server.
#ifndef ATTENTION_BENCH_SOAK_SOAK_PARENT_H_
#define ATTENTION_BENCH_SOAK_SOAK_PARENT_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace attention::soak {

struct SoakOptions {
  // Either the server binary to start (on 127.0.0.1, a free port) with
  // `server_flags`, and MALLOC_ARENA_MAX=`malloc_arena_max` when > 0 ...
  std::string server_binary;
  std::vector<std::string> server_flags;
  int malloc_arena_max = 0;
  // ... or a running server; without its pid the RSS check is skipped.
  std::string target;
  pid_t server_pid = 0;

  absl::Duration duration = absl::Seconds(60);
  // RSS is compared between the end of the warm-up and the end of the load
  // (median of the samples in the last `rss_window` of each).
  absl::Duration warmup = absl::Seconds(30);
  absl::Duration rss_window = absl::Seconds(10);
  double max_rss_growth = 0.05;
  // Growth below this many bytes passes whatever its share: the allocator
  // moves RSS by a MiB or two between samples (a leak of 100 bytes per call
  // over the 60 s run's last 30 s, about 200 000 calls, is 18 MiB).
  int64_t rss_growth_slack_bytes = int64_t{4} << 20;
  int workers = 3;
  int threads_per_worker = 3;
  // Mean time between two SIGKILLs of a worker (exponentially distributed).
  absl::Duration kill_interval = absl::Seconds(3);
  uint64_t seed = 1;
  // Fill the KV pool once before the load (see pool_filler.h).
  bool fill_pool = true;
  std::string work_dir;   // for the port file and the worker reports
  std::string json_path;  // also write the JSON summary here
};

// Returns the process exit code: 0 when every check passed.
int RunSoak(const SoakOptions& options);

}  // namespace attention::soak

#endif  // ATTENTION_BENCH_SOAK_SOAK_PARENT_H_
