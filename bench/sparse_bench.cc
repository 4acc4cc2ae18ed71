// The sparse section of attn-bench: one decode step of a top-k sparse layer
// (index scoring of every key, top-2048 selection, attention over the
// selected keys) against the dense decode step over the same paged KV, at
// T = 32768: H = 32, H_kv = 8, head_dim 128, fp16 KV, and an index of 4
// heads x 64 dims (fp16 index keys) — sparse_vs_dense_decode is dense time
// / sparse time. Medians of paired repetitions, as the kernel section.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/bench_report.h"
#include "bench/bench_util.h"
#include "core/attention_problem.h"
#include "core/block_pool.h"
#include "core/cpu/cpu_backend.h"
#include "core/dtype.h"
#include "core/engine.h"
#include "core/kv_view.h"

namespace attention::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kSection[] = "sparse";

void Die(const absl::Status& status, const char* what) {
  bench::Die(kSection, status, what);
}

std::vector<uint16_t> RandomHalf(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> raw(n);
  for (float& x : raw) x = normal(rng);
  std::vector<uint16_t> out(n);
  ConvertFromFloat(raw.data(), n, DType::kFloat16,
                   reinterpret_cast<std::byte*>(out.data()));
  return out;
}

}  // namespace

void RunSparseBench(const BenchOptions& options, BenchReport* report) {
  constexpr int64_t kLength = 32768;
  constexpr int kTopK = 2048;
  constexpr int kHeads = 32, kKvHeads = 8, kHeadDim = 128;
  constexpr int kIndexHeads = 4, kIndexDim = 64;
  CpuBackend backend(options.threads);
  std::printf("sparse bench on %s: decode T=%lld top-%d\n",
              backend.device().c_str(), static_cast<long long>(kLength),
              kTopK);
  const EngineOptions defaults;
  KvBlockLayout layout;
  layout.dtype = DType::kFloat16;
  layout.num_kv_heads = kKvHeads;
  layout.head_dim = kHeadDim;
  layout.value_dim = kHeadDim;
  layout.index_dim = kIndexDim;
  layout.tokens_per_block = defaults.kv_block_bytes / layout.bytes_per_token();
  PagedBlocks paged(backend, layout, kLength, defaults.kv_block_bytes,
                    kSection);
  constexpr int64_t kChunk = 2048;
  const std::vector<uint16_t> kv = RandomHalf(kChunk * kKvHeads * kHeadDim, 1);
  for (int64_t start = 0; start < kLength; start += kChunk) {
    const std::vector<uint16_t> index = RandomHalf(kChunk * kIndexDim, start);
    KvWrite write;
    write.layout = layout;
    write.start = start;
    write.k = ViewOf(DType::kFloat16, {kChunk, kKvHeads, kHeadDim}, kv.data());
    write.v = write.k;
    write.index_k = ViewOf(DType::kFloat16, {kChunk, kIndexDim}, index.data());
    write.blocks = paged.blocks;
    if (absl::Status s = backend.WriteKv(write); !s.ok()) Die(s, "write");
  }
  const std::vector<uint16_t> q = RandomHalf(kHeads * kHeadDim, 2);
  const std::vector<uint16_t> index_q = RandomHalf(kIndexHeads * kIndexDim, 3);
  const std::vector<float> weights(kIndexHeads, 0.5f);
  std::vector<float> output(kHeads * kHeadDim);
  AttentionProblem dense;
  dense.q = ViewOf(DType::kFloat16, {1, kHeads, kHeadDim}, q.data());
  dense.kv = PagedKvView(layout, kLength, paged.k_blocks, paged.v_blocks);
  dense.mask.causal = true;
  dense.mask.query_start = kLength - 1;
  dense.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  dense.output = output.data();
  TopKSpec topk;
  topk.topk = kTopK;
  topk.score = IndexScore::kRelu;
  topk.index_q =
      ViewOf(DType::kFloat16, {1, kIndexHeads, kIndexDim}, index_q.data());
  topk.index_weights = ViewOf(DType::kFloat32, {1, kIndexHeads}, weights.data());
  AttentionProblem sparse = dense;
  sparse.topk = &topk;

  const int reps = options.quick ? 7 : 21;
  std::vector<double> dense_s, sparse_s, ratios;
  for (int rep = -1; rep < reps; ++rep) {  // rep -1 warms up
    Clock::time_point start = Clock::now();
    if (absl::Status s = backend.Attend({&dense, 1}); !s.ok()) Die(s, "dense");
    const double d = SecondsSince(start);
    start = Clock::now();
    if (absl::Status s = backend.Attend({&sparse, 1}); !s.ok()) {
      Die(s, "sparse");
    }
    const double sp = SecondsSince(start);
    if (rep < 0) continue;
    dense_s.push_back(d);
    sparse_s.push_back(sp);
    ratios.push_back(d / sp);
  }
  const std::string shape = "T=32768 H=32 H_kv=8 d=128 fp16";
  report->AddRow(kSection, absl::StrCat("dense decode ", shape),
                 Median(dense_s) * 1e3, "ms");
  report->AddRow(kSection,
                 absl::StrCat("top-2048 decode (index 4x64, relu), ", shape),
                 Median(sparse_s) * 1e3, "ms");
  report->AddRow(kSection, "dense / top-k decode time, median of pairs",
                 Median(ratios), "ratio");
  report->AddFigure("sparse_vs_dense_decode", Median(ratios));
}

}  // namespace attention::bench
