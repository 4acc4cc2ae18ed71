#include "bench/fma_probe.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "bench/bench_util.h"

namespace attention::bench {

using Clock = std::chrono::steady_clock;

const cpu::KernelTable& KernelsOf(const CpuBackend& backend) {
  switch (backend.isa()) {
    case CpuIsa::kAvx512:
      return *cpu::Avx512Kernels();
    case CpuIsa::kAvx2:
      return *cpu::Avx2Kernels();
    case CpuIsa::kScalar:
      break;
  }
  return *cpu::ScalarKernels();
}

int64_t FmaProbeRounds(const cpu::KernelTable& kernels, float* sink) {
  constexpr int64_t kTrial = 4096;
  const Clock::time_point start = Clock::now();
  *sink += kernels.fma_probe(kTrial);
  const double seconds = std::max(SecondsSince(start), 1e-9);
  return std::max<int64_t>(256, static_cast<int64_t>(kTrial * 250e-6 /
                                                     seconds));
}

double FmaPeak(ThreadPool& pool, const cpu::KernelTable& kernels,
               int64_t rounds, float* sink) {
  const int64_t pieces = int64_t{16} * pool.num_threads();
  std::vector<float> results(pieces);
  const Clock::time_point start = Clock::now();
  pool.ParallelFor(pieces,
                   [&](int64_t i) { results[i] = kernels.fma_probe(rounds); });
  const double seconds = SecondsSince(start);
  for (float r : results) *sink += r;
  return static_cast<double>(pieces) * rounds * kernels.fma_probe_flops /
         seconds;
}

namespace {

double OneThreadRate(float (*probe)(int64_t), int flops_per_round,
                     int64_t rounds, float* sink) {
  const Clock::time_point start = Clock::now();
  *sink += probe(rounds);
  return static_cast<double>(rounds) * flops_per_round / SecondsSince(start);
}

}  // namespace

double OneThreadFmaPeak(const cpu::KernelTable& kernels, int64_t rounds,
                        float* sink) {
  return OneThreadRate(kernels.fma_probe, kernels.fma_probe_flops, rounds,
                       sink);
}

double OneThreadFmaWidenPeak(const cpu::KernelTable& kernels, int64_t rounds,
                             float* sink) {
  return OneThreadRate(kernels.fma_widen_probe, kernels.fma_widen_probe_flops,
                       rounds, sink);
}

}  // namespace attention::bench
