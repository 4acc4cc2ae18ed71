// attn-bench: measures attention-service side by side in one run and prints
// a table plus a JSON summary. Not a test: nothing here asserts.
//
//   attn-bench [--quick] [--threads=N] [--sections=kernel,serving]
//              [--json=FILE]
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_report.h"
#include "server/attention_server.h"

ABSL_FLAG(int64_t, snapshot_mib, 0,
          "mobility: MiB of sessions to snapshot and restore (0 = 1024, "
          "256 with --quick); the pool takes as much memory, twice.");
ABSL_FLAG(bool, quick, false,
          "CI-sized run: smaller repetitions, < 2 minutes on 2 cores");
ABSL_FLAG(int, threads, 0, "Worker threads (0 = one per hardware thread)");
ABSL_FLAG(std::string, sections, "kernel,serving",
          "Comma-separated sections to run: kernel, serving, mobility, sparse, "
          "fleet");
ABSL_FLAG(std::string, json, "", "Also write the JSON summary to this file");

namespace attention::bench {
namespace {

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out.push_back('\\');
    if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
      continue;
    }
    out.push_back(c);
  }
  return out;
}

std::string ToJson(const BenchReport& report, const BenchOptions& options) {
  std::vector<std::string> fields;
  fields.push_back(
      absl::StrCat("\"quick\": ", options.quick ? "true" : "false"));
  for (const auto& [key, value] : report.facts()) {
    fields.push_back(
        absl::StrCat("\"", JsonEscape(key), "\": \"", JsonEscape(value), "\""));
  }
  for (const auto& [key, value] : report.figures()) {
    fields.push_back(absl::StrFormat("\"%s\": %.6g", JsonEscape(key), value));
  }
  std::vector<std::string> rows;
  for (const BenchReport::Row& row : report.rows()) {
    rows.push_back(absl::StrFormat(
        "{\"section\": \"%s\", \"what\": \"%s\", \"value\": %.6g, "
        "\"unit\": \"%s\"}",
        JsonEscape(row.section), JsonEscape(row.what), row.value,
        JsonEscape(row.unit)));
  }
  fields.push_back(absl::StrCat("\"rows\": [\n    ",
                                absl::StrJoin(rows, ",\n    "), "\n  ]"));
  return absl::StrCat("{\n  ", absl::StrJoin(fields, ",\n  "), "\n}\n");
}

void PrintTable(const BenchReport& report) {
  std::printf("\n%-10s %-58s %14s  %s\n", "section", "measurement", "value",
              "unit");
  std::printf("%s\n", std::string(96, '-').c_str());
  for (const BenchReport::Row& row : report.rows()) {
    std::printf("%-10s %-58s %14.4g  %s\n", row.section.c_str(),
                row.what.c_str(), row.value, row.unit.c_str());
  }
  std::printf("\n");
  for (const auto& [key, value] : report.facts()) {
    std::printf("%-32s %s\n", key.c_str(), value.c_str());
  }
  for (const auto& [key, value] : report.figures()) {
    std::printf("%-32s %.4g\n", key.c_str(), value);
  }
}

int Main() {
  BenchOptions options;
  options.quick = absl::GetFlag(FLAGS_quick);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.snapshot_mib = absl::GetFlag(FLAGS_snapshot_mib);
  if (options.threads <= 0) {
    options.threads = static_cast<int>(std::thread::hardware_concurrency());
  }
  BenchReport report;
  report.AddFact("threads", absl::StrCat(options.threads));
  for (absl::string_view section :
       absl::StrSplit(absl::GetFlag(FLAGS_sections), ',', absl::SkipEmpty())) {
    if (section == "kernel") {
      RunKernelBench(options, &report);
    } else if (section == "serving") {
      RunServingBench(options, &report);
    } else if (section == "mobility") {
      RunMobilityBench(options, &report);
    } else if (section == "sparse") {
      RunSparseBench(options, &report);
    } else if (section == "fleet") {
      RunFleetBench(options, &report);
    } else {
      std::fprintf(stderr,
                   "unknown section '%s' (kernel, serving, mobility, sparse, "
                   "fleet)\n",
                   std::string(section).c_str());
      return 2;
    }
  }
  PrintTable(report);
  const std::string json = ToJson(report, options);
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream out(path);
    out << json;
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 1;
    }
    std::printf("JSON summary written to %s\n", path.c_str());
  } else {
    std::printf("%s", json.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace attention::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  attention::server::ConfigureServingProcess();
  return attention::bench::Main();
}
