#include "bench/soak/soak_summary.h"

#include <array>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace attention::soak {
namespace {

constexpr Rpc kAllRpcs[kNumRpcs] = {
    Rpc::kCreateSession, Rpc::kGetSession,  Rpc::kListSessions,
    Rpc::kDeleteSession, Rpc::kForkSession, Rpc::kTruncateSession,
    Rpc::kPrefill,       Rpc::kDecodeStep,  Rpc::kDecode,
    Rpc::kBatchDecode,   Rpc::kAttention,   Rpc::kGetServerInfo,
    Rpc::kExportSession, Rpc::kImportSession};

absl::string_view OutcomeName(CheckResult::Outcome outcome) {
  switch (outcome) {
    case CheckResult::Outcome::kPass:
      return "PASS";
    case CheckResult::Outcome::kFail:
      return "FAIL";
    case CheckResult::Outcome::kSkip:
      return "SKIP";
  }
  return "?";
}

std::string JsonString(absl::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out.push_back('\\');
    if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", c);
      continue;
    }
    out.push_back(c);
  }
  out.push_back('"');
  return out;
}

// "CODE=n CODE=n" of the non-zero counts of `rpc`.
std::string CodeCounts(const RpcTally& tally, Rpc rpc) {
  std::vector<std::string> parts;
  for (int code = 0; code < kNumCodes; ++code) {
    if (const int64_t n = tally.count(rpc, code); n > 0) {
      parts.push_back(absl::StrCat(CodeName(code), "=", n));
    }
  }
  return absl::StrJoin(parts, " ");
}

std::array<int64_t, kNumCodes> CodeTotals(const RpcTally& tally) {
  std::array<int64_t, kNumCodes> totals{};
  for (Rpc rpc : kAllRpcs) {
    for (int code = 0; code < kNumCodes; ++code) {
      totals[code] += tally.count(rpc, code);
    }
  }
  return totals;
}

std::string Mib(int64_t bytes) {
  return bytes < 0 ? "n/a" : absl::StrFormat("%.1f MiB", bytes / 1048576.0);
}

}  // namespace

bool SoakSummary::passed() const {
  for (const CheckResult& check : checks) {
    if (check.outcome == CheckResult::Outcome::kFail) return false;
  }
  return true;
}

void PrintSummary(const SoakSummary& summary, const RpcTally& tally,
                  std::ostream& out) {
  const double seconds = absl::ToDoubleSeconds(summary.duration);
  out << absl::StrFormat("%-16s %10s %9s  %s\n", "rpc", "calls", "calls/s",
                         "codes");
  for (Rpc rpc : kAllRpcs) {
    out << absl::StrFormat("%-16s %10d %9.1f  %s\n", RpcName(rpc),
                           tally.calls(rpc), tally.calls(rpc) / seconds,
                           CodeCounts(tally, rpc));
  }
  std::vector<std::string> totals;
  const auto code_totals = CodeTotals(tally);
  for (int code = 0; code < kNumCodes; ++code) {
    if (code_totals[code] > 0) {
      totals.push_back(absl::StrCat(CodeName(code), "=", code_totals[code]));
    }
  }
  out << "codes in total: " << absl::StrJoin(totals, " ") << "\n";
  out << absl::StrFormat(
      "workers: %d started, %d killed with SIGKILL; %d sessions left behind "
      "and deleted at the end; server RSS: warm-up %s, end %s, peak %s, "
      "after clean-up %s\n",
      summary.workers_started, summary.workers_killed,
      summary.sessions_left_behind, Mib(summary.rss_warmup_bytes),
      Mib(summary.rss_end_bytes), Mib(summary.rss_peak_bytes),
      Mib(summary.rss_after_cleanup_bytes));
  for (Rpc rpc : kAllRpcs) {
    for (int code = 1; code < kNumCodes; ++code) {
      for (const std::string& example : tally.examples(rpc, code)) {
        out << "example " << RpcName(rpc) << " " << CodeName(code) << ": "
            << example.substr(0, 160) << "\n";
      }
    }
  }
  for (const std::string& sample : tally.samples()) {
    out << "VIOLATION " << sample << "\n";
  }
  out << "OBSERVED failed_steps_applied: " << tally.failed_steps_applied()
      << " of " << tally.failed_steps()
      << " DecodeSteps that ended DEADLINE_EXCEEDED on a session nothing "
         "else touched had appended their token anyway (\"a call that fails "
         "changes nothing\"; a step finished just before the deadline also "
         "counts, so this is reported, not checked)\n";
  for (const CheckResult& check : summary.checks) {
    out << "CHECK " << check.name << ": " << OutcomeName(check.outcome) << " "
        << check.detail << "\n";
  }
  out << "attn-soak: " << (summary.passed() ? "PASS" : "FAIL") << "\n";
}

std::string SummaryJson(const SoakSummary& summary, const RpcTally& tally) {
  const double seconds = absl::ToDoubleSeconds(summary.duration);
  std::vector<std::string> rates, codes, checks;
  for (Rpc rpc : kAllRpcs) {
    rates.push_back(absl::StrFormat("%s: %.2f", JsonString(RpcName(rpc)),
                                    tally.calls(rpc) / seconds));
    std::vector<std::string> per_code;
    for (int code = 0; code < kNumCodes; ++code) {
      if (const int64_t n = tally.count(rpc, code); n > 0) {
        per_code.push_back(absl::StrCat(JsonString(CodeName(code)), ": ", n));
      }
    }
    codes.push_back(absl::StrCat(JsonString(RpcName(rpc)), ": {",
                                 absl::StrJoin(per_code, ", "), "}"));
  }
  std::vector<std::string> totals;
  const auto code_totals = CodeTotals(tally);
  for (int code = 0; code < kNumCodes; ++code) {
    if (code_totals[code] > 0) {
      totals.push_back(
          absl::StrCat(JsonString(CodeName(code)), ": ", code_totals[code]));
    }
  }
  for (const CheckResult& check : summary.checks) {
    checks.push_back(absl::StrCat(JsonString(check.name), ": ",
                                  JsonString(OutcomeName(check.outcome))));
  }
  std::vector<std::string> rss_series;
  for (int64_t bytes : summary.rss_samples_bytes) {
    rss_series.push_back(absl::StrFormat("%.2f", bytes / 1048576.0));
  }
  std::vector<std::string> violations;
  for (const std::string& sample : tally.samples()) {
    violations.push_back(JsonString(sample));
  }
  const double growth =
      summary.rss_warmup_bytes > 0 && summary.rss_end_bytes > 0
          ? static_cast<double>(summary.rss_end_bytes) /
                    summary.rss_warmup_bytes -
                1
          : 0.0;
  return absl::StrCat(
      "{\"passed\": ", summary.passed() ? "true" : "false",
      ", \"seed\": ", summary.seed,
      absl::StrFormat(", \"duration_s\": %.1f, \"warmup_s\": %.1f", seconds,
                      absl::ToDoubleSeconds(summary.warmup)),
      ", \"workers\": ", summary.workers,
      ", \"threads_per_worker\": ", summary.threads_per_worker,
      ", \"workers_started\": ", summary.workers_started,
      ", \"workers_killed\": ", summary.workers_killed,
      ", \"sessions_left_behind\": ", summary.sessions_left_behind,
      ", \"rss_warmup_bytes\": ", summary.rss_warmup_bytes,
      ", \"rss_end_bytes\": ", summary.rss_end_bytes,
      absl::StrFormat(", \"rss_growth\": %.4f", growth),
      ", \"rss_peak_bytes\": ", summary.rss_peak_bytes,
      ", \"rss_after_cleanup_bytes\": ", summary.rss_after_cleanup_bytes,
      ", \"rss_mib_each_second\": [", absl::StrJoin(rss_series, ", "), "]",
      ", \"violations_count\": ", tally.violations(),
      ", \"failed_steps\": ", tally.failed_steps(),
      ", \"failed_steps_applied\": ", tally.failed_steps_applied(),
      ", \"calls_per_s\": {", absl::StrJoin(rates, ", "), "}", ", \"codes\": {",
      absl::StrJoin(codes, ", "), "}", ", \"code_totals\": {",
      absl::StrJoin(totals, ", "), "}", ", \"checks\": {",
      absl::StrJoin(checks, ", "), "}", ", \"violations\": [",
      absl::StrJoin(violations, ", "), "]}");
}

}  // namespace attention::soak
