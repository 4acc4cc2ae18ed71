#include "bench/soak/soak_parent.h"

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "bench/soak/list_sessions.h"
#include "bench/soak/pool_filler.h"
#include "bench/soak/process.h"
#include "bench/soak/rpc_tally.h"
#include "bench/soak/soak_summary.h"
#include "client/attention_client.h"

namespace attention::soak {
namespace {

using Outcome = CheckResult::Outcome;

constexpr absl::Duration kCallDeadline = absl::Seconds(10);
// Workers stop calling at the end of the load; this long more for their
// last calls and clean-up before they are killed.
constexpr absl::Duration kWorkerExitGrace = absl::Seconds(30);
// Sessions and KV bytes must return to the baseline within this.
constexpr absl::Duration kCleanupTimeout = absl::Seconds(20);

struct Worker {
  pid_t pid = 0;
  std::string report_path;
};

struct RssSample {
  absl::Duration at;  // since the start of the load
  int64_t bytes = 0;
};

// Median of the samples taken in (end - window, end].
int64_t MedianRss(const std::vector<RssSample>& samples, absl::Duration end,
                  absl::Duration window) {
  std::vector<int64_t> values;
  for (const RssSample& sample : samples) {
    if (sample.at > end - window && sample.at <= end) {
      values.push_back(sample.bytes);
    }
  }
  if (values.empty()) return -1;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

class Soak {
 public:
  explicit Soak(const SoakOptions& options)
      : options_(options), rng_(options.seed) {}

  int Run() {
    summary_.seed = options_.seed;
    summary_.warmup = options_.warmup;
    summary_.workers = options_.workers;
    summary_.threads_per_worker = options_.threads_per_worker;
    if (absl::Status status = ConnectToServer(); !status.ok()) {
      std::cerr << "attn-soak: " << status << std::endl;
      StopServer();
      return 1;
    }
    if (absl::Status status = TakeBaseline(); !status.ok()) {
      std::cerr << "attn-soak: no baseline: " << status << std::endl;
      StopServer();
      return 1;
    }
    if (options_.fill_pool) {
      auto filled = FillKvPoolOnce(*client_);
      if (!filled.ok()) {
        std::cerr << "attn-soak: filling the KV pool: " << filled.status()
                  << std::endl;
        StopServer();
        return 1;
      }
      std::cout << "attn-soak: filled the KV pool once (" << *filled << " of "
                << baseline_.kv_cache_capacity_bytes()
                << " bytes) so that its pages are resident before the load"
                << std::endl;
    }
    RunLoad();
    WaitForWorkers();
    CollectReports();
    summary_.checks.push_back(CheckAlive());
    summary_.checks.push_back(CheckCodes());
    summary_.checks.push_back(CheckCoverage());
    summary_.checks.push_back(CheckCleanup());
    summary_.checks.push_back(CheckRss());
    summary_.checks.push_back(CheckWorkers());
    summary_.checks.push_back(StopServer());
    PrintSummary(summary_, tally_, std::cout);
    const std::string json = SummaryJson(summary_, tally_);
    std::cout << "JSON " << json << std::endl;
    if (!options_.json_path.empty()) {
      std::ofstream(options_.json_path, std::ios::trunc) << json << "\n";
    }
    return summary_.passed() ? 0 : 1;
  }

 private:
  // Starts the server when asked to, then connects.
  absl::Status ConnectToServer() {
    target_ = options_.target;
    server_pid_ = options_.server_pid;
    if (!options_.server_binary.empty()) {
      const std::string port_file = options_.work_dir + "/server.port";
      std::remove(port_file.c_str());
      std::vector<std::string> argv = {options_.server_binary,
                                       "--listen_address=127.0.0.1", "--port=0",
                                       "--port_file=" + port_file};
      argv.insert(argv.end(), options_.server_flags.begin(),
                  options_.server_flags.end());
      std::vector<std::string> env;
      if (options_.malloc_arena_max > 0) {
        env.push_back(
            absl::StrCat("MALLOC_ARENA_MAX=", options_.malloc_arena_max));
      }
      auto pid = Spawn(argv, env);
      if (!pid.ok()) return pid.status();
      server_pid_ = *pid;
      owns_server_ = true;
      int port = 0;
      const absl::Time deadline = absl::Now() + absl::Seconds(60);
      while (port == 0) {
        std::ifstream in(port_file);
        std::string text;
        if (in >> text && absl::SimpleAtoi(text, &port) && port > 0) break;
        port = 0;
        int status = 0;
        if (Exited(server_pid_, &status)) {
          owns_server_ = false;
          return absl::UnavailableError(absl::StrCat(
              "the server exited at start-up: ", DescribeWaitStatus(status)));
        }
        if (absl::Now() > deadline) {
          return absl::DeadlineExceededError("the server did not start");
        }
        absl::SleepFor(absl::Milliseconds(20));
      }
      target_ = absl::StrCat("127.0.0.1:", port);
    }
    client_ = client::AttentionClient::Connect(target_);
    std::cout << "attn-soak: server " << target_ << " pid "
              << (server_pid_ > 0 ? absl::StrCat(server_pid_) : "unknown")
              << (owns_server_ && options_.malloc_arena_max > 0
                      ? absl::StrCat(" (MALLOC_ARENA_MAX=",
                                     options_.malloc_arena_max, ")")
                      : "")
              << "; " << options_.workers << " workers x "
              << options_.threads_per_worker << " threads for "
              << absl::FormatDuration(options_.duration) << ", warm-up "
              << absl::FormatDuration(options_.warmup) << ", a SIGKILL every "
              << absl::FormatDuration(options_.kill_interval)
              << " on average, seed " << options_.seed << std::endl;
    return client_->WaitForConnected(absl::Seconds(30));
  }

  absl::Status TakeBaseline() {
    auto info = client_->GetServerInfo();
    if (!info.ok()) return info.status();
    baseline_ = *info;
    std::vector<v1::SessionInfo> sessions;
    const grpc::Status status = ListAllSessions(
        client_->stub(), absl::Now() + kCallDeadline, &sessions);
    if (!status.ok()) return client::FromGrpcStatus(status);
    for (const v1::SessionInfo& session : sessions) {
      baseline_sessions_.insert(session.session_id());
    }
    return absl::OkStatus();
  }

  void StartWorker(absl::Time end) {
    Worker worker;
    worker.report_path = absl::StrCat(options_.work_dir, "/worker-",
                                      summary_.workers_started, ".report");
    std::remove(worker.report_path.c_str());
    const std::vector<std::string> argv = {
        SelfExecutable(),
        absl::StrCat("--worker_report=", worker.report_path),
        absl::StrCat("--worker_target=", target_),
        absl::StrCat("--worker_seed=", rng_()),
        absl::StrCat("--worker_end_unix_ms=", absl::ToUnixMillis(end)),
        absl::StrCat("--threads_per_worker=", options_.threads_per_worker)};
    auto pid = Spawn(argv);
    if (!pid.ok()) {
      worker_failures_.push_back(pid.status().ToString());
      return;
    }
    worker.pid = *pid;
    ++summary_.workers_started;
    reports_.push_back(worker.report_path);
    workers_.push_back(std::move(worker));
  }

  // A worker that ended by itself must have exited 0.
  void NoteExit(const Worker& worker, int status) {
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      worker_failures_.push_back(absl::StrCat("worker ", worker.pid, ": ",
                                              DescribeWaitStatus(status)));
    }
  }

  void SampleRss(absl::Duration at) {
    if (server_pid_ <= 0) return;
    auto rss = ReadRssBytes(server_pid_);
    if (!rss.ok()) return;
    rss_.push_back({at, *rss});
    summary_.rss_samples_bytes.push_back(*rss);
    summary_.rss_peak_bytes = std::max(summary_.rss_peak_bytes, *rss);
  }

  // Live sessions (GetServerInfo), for the progress lines.
  void SampleSessions() {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    v1::ServerInfo info;
    const grpc::Status status = client_->stub()->GetServerInfo(
        &context, v1::GetServerInfoRequest(), &info);
    tally_.Record(Rpc::kGetServerInfo, status);
    if (status.ok()) live_sessions_ = info.active_sessions();
  }

  bool ServerExited() {
    if (!owns_server_) return false;
    int status = 0;
    if (!Exited(server_pid_, &status)) return false;
    owns_server_ = false;
    server_exit_ = DescribeWaitStatus(status);
    std::cout << "attn-soak: the server died: " << server_exit_ << std::endl;
    return true;
  }

  void RunLoad() {
    const absl::Time start = absl::Now();
    const absl::Time end = start + options_.duration;
    const bool kills = options_.kill_interval > absl::ZeroDuration();
    std::exponential_distribution<double> kill_gap(
        kills ? 1.0 / absl::ToDoubleSeconds(options_.kill_interval) : 1.0);
    absl::Time next_kill =
        kills ? start + absl::Seconds(kill_gap(rng_)) : absl::InfiniteFuture();
    absl::Time next_sample = start;
    absl::Time next_progress = start + absl::Seconds(10);
    for (int i = 0; i < options_.workers; ++i) StartWorker(end);
    for (absl::Time now = start; now < end; now = absl::Now()) {
      // Workers that ended by themselves are replaced while there is time.
      for (size_t i = 0; i < workers_.size(); ++i) {
        int status = 0;
        if (!Exited(workers_[i].pid, &status)) continue;
        NoteExit(workers_[i], status);
        workers_.erase(workers_.begin() + static_cast<std::ptrdiff_t>(i--));
        if (end - now > absl::Seconds(1)) StartWorker(end);
      }
      if (now >= next_kill && !workers_.empty()) {
        std::uniform_int_distribution<size_t> pick(0, workers_.size() - 1);
        const size_t i = pick(rng_);
        StopChild(workers_[i].pid, SIGKILL, absl::ZeroDuration());
        ++summary_.workers_killed;
        workers_.erase(workers_.begin() + static_cast<std::ptrdiff_t>(i));
        if (end - now > absl::Seconds(1)) StartWorker(end);
        next_kill = now + absl::Seconds(kill_gap(rng_));
      }
      if (now >= next_sample) {
        SampleRss(now - start);
        SampleSessions();
        next_sample += absl::Seconds(1);
        if (ServerExited()) break;
      }
      if (now >= next_progress) {
        std::cout << absl::StrFormat(
                         "attn-soak: t=%.0fs server RSS %s, %d sessions, "
                         "workers started %d, killed %d",
                         absl::ToDoubleSeconds(now - start),
                         rss_.empty()
                             ? "n/a"
                             : absl::StrFormat("%.1f MiB",
                                               rss_.back().bytes / 1048576.0),
                         live_sessions_, summary_.workers_started,
                         summary_.workers_killed)
                  << std::endl;
        next_progress += absl::Seconds(10);
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    summary_.duration = std::min(absl::Now(), end) - start;
    summary_.rss_warmup_bytes =
        MedianRss(rss_, options_.warmup, options_.rss_window);
    summary_.rss_end_bytes =
        MedianRss(rss_, summary_.duration, options_.rss_window);
  }

  void WaitForWorkers() {
    const absl::Time deadline = absl::Now() + kWorkerExitGrace;
    for (const Worker& worker : workers_) {
      // Signal 0 sends nothing: the worker gets until the deadline to stop
      // by itself, then SIGKILL.
      const int status =
          StopChild(worker.pid, 0,
                    std::max(deadline - absl::Now(), absl::ZeroDuration()));
      NoteExit(worker, status);
    }
    workers_.clear();
  }

  void CollectReports() {
    for (const std::string& path : reports_) {
      std::ifstream in(path);
      if (!in) continue;  // killed before its first report
      std::stringstream text;
      text << in.rdbuf();
      if (absl::Status status = tally_.MergeSerialized(text.str());
          !status.ok()) {
        worker_failures_.push_back(absl::StrCat(path, ": ", status.message()));
      }
    }
  }

  CheckResult CheckAlive() {
    CheckResult check{"server_alive", Outcome::kFail, ""};
    if (ServerExited() || !server_exit_.empty()) {
      check.detail = absl::StrCat("the server process died: ", server_exit_);
      return check;
    }
    auto info = client_->GetServerInfo();
    auto health = client_->CheckHealth();
    auto service_health = client_->CheckHealth("attention.v1.AttentionService");
    if (!info.ok()) {
      check.detail = absl::StrCat("GetServerInfo: ", info.status().ToString());
    } else if (!health.ok() || *health != client::ServingStatus::kServing ||
               !service_health.ok() ||
               *service_health != client::ServingStatus::kServing) {
      check.detail = "grpc.health.v1 does not answer SERVING";
    } else {
      check.outcome = Outcome::kPass;
      check.detail = absl::StrCat("GetServerInfo OK (", info->backend(),
                                  "), health SERVING");
    }
    return check;
  }

  CheckResult CheckCodes() {
    int64_t calls = 0;
    for (int r = 0; r < kNumRpcs; ++r)
      calls += tally_.calls(static_cast<Rpc>(r));
    CheckResult check{
        "status_codes", Outcome::kPass,
        absl::StrCat(tally_.violations(), " undocumented answers in ", calls,
                     " calls (see VIOLATION lines)")};
    if (tally_.violations() > 0 || calls == 0) check.outcome = Outcome::kFail;
    return check;
  }

  // Every RPC answered OK at least once (the mix reached it).
  CheckResult CheckCoverage() {
    std::vector<std::string> missing;
    for (int r = 0; r < kNumRpcs; ++r) {
      if (tally_.count(static_cast<Rpc>(r), 0) == 0) {
        missing.push_back(std::string(RpcName(static_cast<Rpc>(r))));
      }
    }
    if (missing.empty()) {
      return {"coverage", Outcome::kPass,
              absl::StrCat("all ", kNumRpcs, " RPCs answered OK")};
    }
    return {"coverage", Outcome::kFail,
            absl::StrCat("never OK: ", absl::StrJoin(missing, ", "))};
  }

  // Deletes every session that was not there before the load (workers
  // killed by SIGKILL leave theirs), until the session count and the KV
  // bytes in use are back at the baseline.
  CheckResult CheckCleanup() {
    CheckResult check{"cleanup", Outcome::kFail, ""};
    const absl::Time deadline = absl::Now() + kCleanupTimeout;
    absl::StatusOr<v1::ServerInfo> info;
    while (true) {
      std::vector<v1::SessionInfo> sessions;
      const grpc::Status listed = ListAllSessions(
          client_->stub(), absl::Now() + kCallDeadline, &sessions);
      tally_.Record(Rpc::kListSessions, listed);
      for (const v1::SessionInfo& session : sessions) {
        if (baseline_sessions_.contains(session.session_id())) continue;
        const absl::Status deleted =
            client_->DeleteSession(session.session_id());
        tally_.Record(
            Rpc::kDeleteSession,
            grpc::Status(static_cast<grpc::StatusCode>(deleted.code()),
                         std::string(deleted.message())));
        if (deleted.ok()) ++summary_.sessions_left_behind;
      }
      info = client_->GetServerInfo();
      if (info.ok() && info->active_sessions() == baseline_.active_sessions() &&
          info->kv_cache_used_bytes() == baseline_.kv_cache_used_bytes()) {
        check.outcome = Outcome::kPass;
        break;
      }
      if (absl::Now() > deadline) break;
      absl::SleepFor(absl::Milliseconds(250));
    }
    if (!info.ok()) {
      check.detail = absl::StrCat("GetServerInfo: ", info.status().ToString());
      return check;
    }
    check.detail = absl::StrFormat(
        "sessions %d -> %d, kv_cache_used_bytes %d -> %d (%d sessions left "
        "by workers deleted by the parent)",
        baseline_.active_sessions(), info->active_sessions(),
        baseline_.kv_cache_used_bytes(), info->kv_cache_used_bytes(),
        summary_.sessions_left_behind);
    if (server_pid_ > 0) {
      if (auto rss = ReadRssBytes(server_pid_); rss.ok()) {
        summary_.rss_after_cleanup_bytes = *rss;
      }
    }
    return check;
  }

  CheckResult CheckRss() {
    CheckResult check{"rss_growth", Outcome::kSkip, ""};
    if (server_pid_ <= 0) {
      check.detail =
          "no server pid (start the server with --server_binary "
          "or give --server_pid)";
      return check;
    }
    if (summary_.rss_warmup_bytes <= 0 || summary_.rss_end_bytes <= 0 ||
        options_.warmup >= summary_.duration) {
      check.detail = "the run ended before the warm-up did";
      return check;
    }
    const double growth = static_cast<double>(summary_.rss_end_bytes) /
                              summary_.rss_warmup_bytes -
                          1;
    const bool within_slack =
        summary_.rss_end_bytes - summary_.rss_warmup_bytes <
        options_.rss_growth_slack_bytes;
    check.outcome = growth < options_.max_rss_growth || within_slack
                        ? Outcome::kPass
                        : Outcome::kFail;
    check.detail = absl::StrFormat(
        "VmRSS %.1f MiB at %s -> %.1f MiB at %s: %+.2f%% (limit %+.0f%%, or "
        "%.1f MiB; medians of 1 s samples over %s)",
        summary_.rss_warmup_bytes / 1048576.0,
        absl::FormatDuration(options_.warmup),
        summary_.rss_end_bytes / 1048576.0,
        absl::FormatDuration(summary_.duration), 100 * growth,
        100 * options_.max_rss_growth,
        options_.rss_growth_slack_bytes / 1048576.0,
        absl::FormatDuration(options_.rss_window));
    return check;
  }

  CheckResult CheckWorkers() {
    CheckResult check{
        "workers", Outcome::kPass,
        absl::StrCat(summary_.workers_started, " started, ",
                     summary_.workers_killed,
                     " killed with SIGKILL, the others exited 0")};
    if (!worker_failures_.empty()) {
      check.outcome = Outcome::kFail;
      check.detail = absl::StrJoin(worker_failures_, "; ");
    }
    return check;
  }

  // SIGTERM: the server drains and must exit 0.
  CheckResult StopServer() {
    CheckResult check{"server_exit", Outcome::kSkip,
                      "not started by attn-soak"};
    if (!owns_server_) {
      if (!server_exit_.empty()) {
        check.outcome = Outcome::kFail;
        check.detail = absl::StrCat("died during the run: ", server_exit_);
      }
      return check;
    }
    owns_server_ = false;
    const int status = StopChild(server_pid_, SIGTERM, absl::Seconds(40));
    check.outcome = WIFEXITED(status) && WEXITSTATUS(status) == 0
                        ? Outcome::kPass
                        : Outcome::kFail;
    check.detail = absl::StrCat("SIGTERM -> ", DescribeWaitStatus(status));
    return check;
  }

  const SoakOptions options_;
  std::mt19937_64 rng_;
  std::string target_;
  pid_t server_pid_ = 0;
  bool owns_server_ = false;
  std::string server_exit_;  // how it died, when it did
  std::unique_ptr<client::AttentionClient> client_;
  v1::ServerInfo baseline_;
  std::set<std::string> baseline_sessions_;
  std::vector<Worker> workers_;  // running
  std::vector<std::string> reports_;
  std::vector<std::string> worker_failures_;
  std::vector<RssSample> rss_;
  int64_t live_sessions_ = 0;
  RpcTally tally_;
  SoakSummary summary_;
};

}  // namespace

int RunSoak(const SoakOptions& options) { return Soak(options).Run(); }

}  // namespace attention::soak
