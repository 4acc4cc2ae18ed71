// attn-soak: one worker process. Its threads call every RPC of
// AttentionService at random until a fixed time, with random cancellations
// and short deadlines, and it writes the tally of status codes seen to a
// report file every second (so a worker killed by SIGKILL still reports
// most of what it saw).
#ifndef ATTENTION_BENCH_SOAK_SOAK_WORKER_H_
#define ATTENTION_BENCH_SOAK_SOAK_WORKER_H_

#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace attention::soak {

struct WorkerOptions {
  std::string target;  // host:port
  uint64_t seed = 1;
  int threads = 3;
  absl::Time end;  // the threads start no call after it
  std::string report_path;
};

// Runs the mix until `end`, deletes the sessions it still holds, writes the
// final report. Returns the process exit code.
int RunWorker(const WorkerOptions& options);

}  // namespace attention::soak

#endif  // ATTENTION_BENCH_SOAK_SOAK_WORKER_H_
