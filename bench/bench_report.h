// BenchReport: what each attn-bench section measured — named figures for
// the JSON summary and rows for the human-readable table. Sections only
// report ratios and rates measured side by side in the same run.
#ifndef ATTENTION_BENCH_BENCH_REPORT_H_
#define ATTENTION_BENCH_BENCH_REPORT_H_

#include <string>
#include <utility>
#include <vector>

namespace attention::bench {

struct BenchOptions {
  bool quick = false;  // the CI-sized run: < 2 minutes on 2 cores in all
  int threads = 0;     // 0 = one per hardware thread
  // Mobility section: MiB of sessions to snapshot and restore; 0 = the
  // default (1 GiB, 256 MiB quick).
  int64_t snapshot_mib = 0;
};

class BenchReport {
 public:
  // A top-level JSON number, e.g. ("decode_bandwidth_ratio_32768", 0.83).
  void AddFigure(std::string key, double value) {
    figures_.emplace_back(std::move(key), value);
  }
  // A top-level JSON string, e.g. ("isa", "avx2").
  void AddFact(std::string key, std::string value) {
    facts_.emplace_back(std::move(key), std::move(value));
  }
  // One line of the printed table: section, what, value, unit.
  void AddRow(std::string section, std::string what, double value,
              std::string unit) {
    rows_.push_back(
        {std::move(section), std::move(what), value, std::move(unit)});
  }

  struct Row {
    std::string section, what;
    double value;
    std::string unit;
  };
  const std::vector<std::pair<std::string, double>>& figures() const {
    return figures_;
  }
  const std::vector<std::pair<std::string, std::string>>& facts() const {
    return facts_;
  }
  const std::vector<Row>& rows() const { return rows_; }

 private:
  std::vector<std::pair<std::string, double>> figures_;
  std::vector<std::pair<std::string, std::string>> facts_;
  std::vector<Row> rows_;
};

// The sections of attn-bench; each lives in its own file.
// Kernels: decode bandwidth vs a streaming-read probe, prefill vs the
// straightforward tiled reference (bench/kernel_bench.cc).
void RunKernelBench(const BenchOptions& options, BenchReport* report);
// Serving: DecodeStep vs a bare echo RPC, batched vs one-at-a-time decode
// streams (bench/serving_bench.cc).
void RunServingBench(const BenchOptions& options, BenchReport* report);
// Session mobility: ExportSession + ImportSession vs a bare echo of the
// same bytes, and the --snapshot_dir snapshot and restore times.
void RunMobilityBench(const BenchOptions& options, BenchReport* report);

// Fleets: decode tokens/s of three replicas against one through
// ClusterClient, and a drain's handover time (bench/fleet_bench.cc).
void RunFleetBench(const BenchOptions& options, BenchReport* report);

// Top-k sparse decode against dense decode at T = 32768, k = 2048
// (sparse_bench.cc).
void RunSparseBench(const BenchOptions& options, BenchReport* report);

}  // namespace attention::bench

#endif  // ATTENTION_BENCH_BENCH_REPORT_H_
