// attn-soak: a soak and fault test of attention-server. Worker processes
// (this executable re-run) call every RPC at random for --duration with
// random cancellations, short deadlines, racing deletes/truncates and a
// small KV pool, while the parent SIGKILLs workers at random moments. Then
// it checks that the server is alive, answered only documented status
// codes, returns to its baseline sessions and KV bytes once the leftovers
// are deleted, and that its RSS grew by less than --max_rss_growth (or
// --rss_growth_slack_bytes) after the warm-up. Exits 1 on any violation.
//
//   attn-soak --server_binary=build/server/attention-server --duration=60s
//   attn-soak --target=127.0.0.1:50051 --server_pid=1234 --duration=10m
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <iostream>
#include <string>
#include <system_error>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "bench/soak/soak_parent.h"
#include "bench/soak/soak_worker.h"

ABSL_FLAG(std::string, server_binary, "",
          "attention-server to start on 127.0.0.1 (a free port) for the run "
          "and stop with SIGTERM at the end; preferred over --target");
ABSL_FLAG(std::string, server_flags,
          "--backend=cpu --threads=2 --kv_cache_bytes=3145728 "
          "--kv_block_bytes=16384 --max_message_bytes=1048576 "
          "--max_session_tokens=4096 --session_idle_timeout=10s "
          "--metrics_port=-1 --log_level=error",
          "Space-separated flags for --server_binary. The small KV pool "
          "makes appends run into RESOURCE_EXHAUSTED; the 1 MiB message "
          "limit refuses the occasional large stateless result; sessions "
          "that killed workers leave behind pile up until their idle timeout, "
          "so keep it well below --warmup");
ABSL_FLAG(int, malloc_arena_max, 2,
          "MALLOC_ARENA_MAX for the started server (0 = leave it unset). "
          "glibc adds malloc arenas (up to 8 per core) as new threads first "
          "contend, which steps RSS up at random moments; a fixed small "
          "number keeps the RSS check about leaks");
ABSL_FLAG(std::string, target, "",
          "host:port of a running server (instead of --server_binary)");
ABSL_FLAG(int, server_pid, 0, "pid of the --target server, for the RSS check");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(60), "Length of the load");
ABSL_FLAG(absl::Duration, warmup, absl::Seconds(30),
          "RSS at the end of the warm-up is the reference of the RSS check; "
          "make it longer than the server's --session_idle_timeout (the "
          "number of live sessions settles only then)");
ABSL_FLAG(bool, fill_pool, true,
          "Fill the server's KV pool once before the load, so that its pages "
          "(committed on first write) are resident before the warm-up ends");
ABSL_FLAG(double, max_rss_growth, 0.05,
          "Largest allowed RSS growth from warm-up to end (0.05 = 5 %)");
ABSL_FLAG(int64_t, rss_growth_slack_bytes, int64_t{4} << 20,
          "RSS growth below this many bytes passes whatever its share "
          "(allocator noise)");
ABSL_FLAG(int, workers, 3, "Worker processes running at once");
ABSL_FLAG(int, threads_per_worker, 3, "Client threads in each worker");
ABSL_FLAG(absl::Duration, kill_interval, absl::Seconds(3),
          "Mean time between two SIGKILLs of a random worker (0 = none)");
ABSL_FLAG(uint64_t, seed, 1,
          "Seed of every random choice (worker seeds, kill times, requests)");
ABSL_FLAG(std::string, work_dir, "",
          "Directory for the port file and worker reports (default: a new "
          "one under $TMPDIR or /tmp, removed at the end)");
ABSL_FLAG(std::string, json, "", "Also write the JSON summary to this file");

// Set by the parent when it starts a worker.
ABSL_FLAG(std::string, worker_report, "", "(internal) run as a worker");
ABSL_FLAG(std::string, worker_target, "", "(internal)");
ABSL_FLAG(uint64_t, worker_seed, 0, "(internal)");
ABSL_FLAG(int64_t, worker_end_unix_ms, 0, "(internal)");

namespace {

std::string MakeWorkDir() {
  const char* tmp = getenv("TMPDIR");
  std::string pattern =
      std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
      "/attn-soak-XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) return "";
  return pattern;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "soak and fault test of attention-server: attn-soak "
      "--server_binary=PATH [--duration=60s] [--seed=N] [--json=FILE]");
  absl::ParseCommandLine(argc, argv);
  using attention::soak::RunSoak;
  using attention::soak::RunWorker;

  if (!absl::GetFlag(FLAGS_worker_report).empty()) {
    attention::soak::WorkerOptions worker;
    worker.target = absl::GetFlag(FLAGS_worker_target);
    worker.seed = absl::GetFlag(FLAGS_worker_seed);
    worker.threads = absl::GetFlag(FLAGS_threads_per_worker);
    worker.end = absl::FromUnixMillis(absl::GetFlag(FLAGS_worker_end_unix_ms));
    worker.report_path = absl::GetFlag(FLAGS_worker_report);
    return RunWorker(worker);
  }

  attention::soak::SoakOptions options;
  options.server_binary = absl::GetFlag(FLAGS_server_binary);
  options.server_flags =
      absl::StrSplit(absl::GetFlag(FLAGS_server_flags), ' ', absl::SkipEmpty());
  options.malloc_arena_max = absl::GetFlag(FLAGS_malloc_arena_max);
  options.target = absl::GetFlag(FLAGS_target);
  options.server_pid = absl::GetFlag(FLAGS_server_pid);
  options.duration = absl::GetFlag(FLAGS_duration);
  options.warmup = absl::GetFlag(FLAGS_warmup);
  options.max_rss_growth = absl::GetFlag(FLAGS_max_rss_growth);
  options.rss_growth_slack_bytes = absl::GetFlag(FLAGS_rss_growth_slack_bytes);
  options.fill_pool = absl::GetFlag(FLAGS_fill_pool);
  options.workers = absl::GetFlag(FLAGS_workers);
  options.threads_per_worker = absl::GetFlag(FLAGS_threads_per_worker);
  options.kill_interval = absl::GetFlag(FLAGS_kill_interval);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.json_path = absl::GetFlag(FLAGS_json);
  options.work_dir = absl::GetFlag(FLAGS_work_dir);
  if (options.server_binary.empty() == options.target.empty()) {
    std::cerr << "attn-soak: give exactly one of --server_binary and --target"
              << std::endl;
    return 2;
  }
  if (options.duration <= absl::ZeroDuration() || options.workers < 1 ||
      options.threads_per_worker < 1) {
    std::cerr << "attn-soak: --duration, --workers and --threads_per_worker "
                 "must be positive"
              << std::endl;
    return 2;
  }
  const bool own_work_dir = options.work_dir.empty();
  if (own_work_dir) options.work_dir = MakeWorkDir();
  if (options.work_dir.empty()) {
    std::cerr << "attn-soak: cannot create a work directory" << std::endl;
    return 2;
  }
  const int exit_code = RunSoak(options);
  if (own_work_dir) {
    std::error_code ignored;
    std::filesystem::remove_all(options.work_dir, ignored);
  }
  return exit_code;
}
