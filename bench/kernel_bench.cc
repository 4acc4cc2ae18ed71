// The kernel section of attn-bench: CPU attention kernels measured against
// baselines run in the same process, on the same thread pool:
//   * decode: one query row per head over a long paged fp16 KV history
//     (T = 8192 and 32768, H = 32, H_kv = 8, head_dim 128) in a real
//     BlockPool, as KV bytes read per second, divided by a plain streaming
//     read (a sum) of a buffer of the same size in the same kind of memory,
//     a backend arena (decode_bandwidth_ratio_*);
//   * prefill: causal, T = 2048, H = H_kv = 16, head_dim 64, fp32, against
//     the seeds' straightforward tiled_attention loop written in plain C++
//     (prefill_gflops, prefill_vs_naive).
// Every figure is the median of several repetitions; the two sides of a
// ratio alternate so that machine noise hits both alike. Timing is done
// here rather than with Google Benchmark because each ratio needs its two
// sides interleaved repetition by repetition.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_report.h"
#include "bench/bench_util.h"
#include "core/attention_problem.h"
#include "core/block_pool.h"
#include "core/cpu/cpu_backend.h"
#include "core/cpu/cpu_features.h"
#include "core/dtype.h"
#include "core/engine.h"
#include "core/kv_view.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace attention::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kSection[] = "kernel";

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

void Die(const absl::Status& status, const char* what) {
  bench::Die("kernel", status, what);
}

std::vector<float> RandomFloats(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng);
  return out;
}

// ---- Streaming-read probe --------------------------------------------------

// Sums `bytes` of `data` (a multiple of 64) as 64-bit words in eight
// independent accumulators: integer adds reassociate freely, so the
// compiler vectorises this with whatever the baseline ISA offers and the
// loop runs at load bandwidth.
uint64_t SumWords(const std::byte* data, int64_t bytes) {
  uint64_t acc[8] = {};
  for (int64_t i = 0; i + 64 <= bytes; i += 64) {
    for (int k = 0; k < 8; ++k) {
      uint64_t word;
      std::memcpy(&word, data + i + 8 * k, sizeof(word));
      acc[k] += word;
    }
  }
  uint64_t sum = 0;
  for (uint64_t a : acc) sum += a;
  return sum;
}

// Reads `bytes` at `data` once on the pool's threads, in 16 pieces per
// thread like a long decode; returns the seconds taken.
double StreamRead(ThreadPool& pool, const std::byte* data, int64_t bytes,
                  uint64_t* sink) {
  const int64_t pieces = int64_t{16} * pool.num_threads();
  const int64_t piece_bytes = (bytes / pieces + 63) / 64 * 64;
  std::vector<uint64_t> sums(pieces);
  const Clock::time_point start = Clock::now();
  pool.ParallelFor(pieces, [&](int64_t i) {
    const int64_t begin = i * piece_bytes;
    const int64_t end = std::min(begin + piece_bytes, bytes);
    if (begin < end) sums[i] = SumWords(data + begin, end - begin);
  });
  const double seconds = Seconds(start);
  for (uint64_t s : sums) *sink += s;
  return seconds;
}

// ---- Decode ----------------------------------------------------------------

struct DecodeResult {
  double decode_gbps = 0;
  double stream_gbps = 0;  // the probe on backend (KV arena) memory
  double heap_gbps = 0;    // for context: the probe on a plain heap buffer
  double ratio = 0;
};

// One decode step (the last position) over `length` fp16 tokens stored in
// a real BlockPool with the engine's default block size.
DecodeResult MeasureDecode(CpuBackend& backend, int64_t length, int reps) {
  constexpr int kHeads = 32;
  constexpr int kKvHeads = 8;
  constexpr int kHeadDim = 128;
  const EngineOptions defaults;
  KvBlockLayout layout;
  layout.dtype = DType::kFloat16;
  layout.num_kv_heads = kKvHeads;
  layout.head_dim = kHeadDim;
  layout.value_dim = kHeadDim;
  layout.tokens_per_block = defaults.kv_block_bytes / layout.bytes_per_token();
  PagedBlocks paged(backend, layout, length, defaults.kv_block_bytes,
                    kSection);

  // Fill the history through the backend, reusing one random fp16 chunk
  // (the values do not matter for speed, only that they are finite).
  constexpr int64_t kChunk = 2048;
  const int64_t per_token = int64_t{kKvHeads} * kHeadDim;
  std::vector<uint16_t> chunk(kChunk * per_token);
  {
    const std::vector<float> raw = RandomFloats(kChunk * per_token, 11);
    ConvertFromFloat(raw.data(), raw.size(), DType::kFloat16,
                     reinterpret_cast<std::byte*>(chunk.data()));
  }
  for (int64_t start = 0; start < length; start += kChunk) {
    const int64_t n = std::min(kChunk, length - start);
    KvWrite write;
    write.layout = layout;
    write.start = start;
    write.k = ViewOf(DType::kFloat16, {n, kKvHeads, kHeadDim}, chunk.data());
    write.v = write.k;
    write.blocks = paged.blocks;
    if (absl::Status s = backend.WriteKv(write); !s.ok()) Die(s, "write KV");
  }

  const std::vector<float> q = RandomFloats(int64_t{kHeads} * kHeadDim, 12);
  const TensorView q_view =
      ViewOf(DType::kFloat32, {1, kHeads, kHeadDim}, q.data());
  std::vector<float> output(kHeads * kHeadDim);
  AttentionProblem problem;
  problem.q = q_view;
  problem.kv = PagedKvView(layout, length, paged.k_blocks, paged.v_blocks);
  problem.mask.causal = true;
  problem.mask.query_start = length - 1;
  problem.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  problem.output = output.data();

  // The probe reads as many bytes as the decode does (every K and V byte),
  // from the same kind of memory: an arena of the same backend.
  const int64_t kv_bytes = length * layout.bytes_per_token();
  absl::StatusOr<std::unique_ptr<DeviceArena>> probe_arena =
      backend.AllocateArena(kv_bytes);
  if (!probe_arena.ok()) Die(probe_arena.status(), "probe buffer");
  std::byte* probe = (*probe_arena)->data();
  std::memset(probe, 1, kv_bytes);
  // Reported for context only: ordinary heap memory (4 KiB pages where
  // transparent huge pages are opt-in, unlike the KV arena).
  std::vector<std::byte> heap(kv_bytes, std::byte{1});
  uint64_t sink = 0;
  // Warm-up: page in, fill caches and thread scratch.
  if (absl::Status s = backend.Attend({&problem, 1}); !s.ok()) {
    Die(s, "decode");
  }
  StreamRead(backend.thread_pool(), probe, kv_bytes, &sink);

  // Each repetition reads with the probe, then decodes; the ratio is the
  // median of the per-repetition ratios, so slow phases of a loaded
  // machine hit both sides of a pair.
  std::vector<double> decode_s, stream_s, heap_s, ratios;
  for (int rep = 0; rep < reps; ++rep) {
    heap_s.push_back(
        StreamRead(backend.thread_pool(), heap.data(), kv_bytes, &sink));
    stream_s.push_back(
        StreamRead(backend.thread_pool(), probe, kv_bytes, &sink));
    const Clock::time_point start = Clock::now();
    if (absl::Status s = backend.Attend({&problem, 1}); !s.ok()) {
      Die(s, "decode");
    }
    decode_s.push_back(Seconds(start));
    ratios.push_back(stream_s.back() / decode_s.back());
  }
  if (sink == 42) std::printf(" ");  // keep the probe's reads alive
  DecodeResult result;
  result.decode_gbps = kv_bytes / Median(decode_s) / 1e9;
  result.stream_gbps = kv_bytes / Median(stream_s) / 1e9;
  result.heap_gbps = kv_bytes / Median(heap_s) / 1e9;
  result.ratio = Median(ratios);
  return result;
}

// ---- Prefill ---------------------------------------------------------------

constexpr int64_t kPrefillTokens = 2048;
constexpr int kPrefillHeads = 16;
constexpr int kPrefillDim = 64;

// The seeds' tiled_attention, written plainly: per query row, 128-key
// tiles, a scalar dot product per key, online softmax. Causal, no window.
// Parallel over (head, 16-row block) on the same pool, like the kernels.
void NaiveTiledPrefill(ThreadPool& pool, const float* q, const float* k,
                       const float* v, float* out) {
  constexpr int64_t T = kPrefillTokens;
  constexpr int H = kPrefillHeads;
  constexpr int D = kPrefillDim;
  constexpr int64_t kTile = 128;
  constexpr int64_t kRowsPerTask = 16;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t row_blocks = T / kRowsPerTask;
  pool.ParallelFor(H * row_blocks, [&](int64_t task) {
    const int h = static_cast<int>(task / row_blocks);
    const int64_t first = (task % row_blocks) * kRowsPerTask;
    float logits[kTile];
    float acc[D];
    for (int64_t i = first; i < first + kRowsPerTask; ++i) {
      const float* qi = q + (i * H + h) * D;
      float m = -std::numeric_limits<float>::infinity();
      float l = 0.0f;
      std::fill(acc, acc + D, 0.0f);
      for (int64_t start = 0; start <= i; start += kTile) {
        const int64_t stop = std::min(start + kTile, i + 1);  // causal
        float tile_max = -std::numeric_limits<float>::infinity();
        for (int64_t j = start; j < stop; ++j) {
          const float* kj = k + (j * H + h) * D;
          float dot = 0.0f;
          for (int d = 0; d < D; ++d) dot += qi[d] * kj[d];
          logits[j - start] = dot * scale;
          tile_max = std::max(tile_max, logits[j - start]);
        }
        const float m_new = std::max(m, tile_max);
        const float alpha = std::isfinite(m) ? std::exp(m - m_new) : 0.0f;
        for (int d = 0; d < D; ++d) acc[d] *= alpha;
        float sum = 0.0f;
        for (int64_t j = start; j < stop; ++j) {
          const float p = std::exp(logits[j - start] - m_new);
          sum += p;
          const float* vj = v + (j * H + h) * D;
          for (int d = 0; d < D; ++d) acc[d] += p * vj[d];
        }
        l = alpha * l + sum;
        m = m_new;
      }
      float* o = out + (i * H + h) * D;
      for (int d = 0; d < D; ++d) o[d] = acc[d] / l;
    }
  });
}

struct PrefillResult {
  double kernel_gflops = 0;
  double naive_gflops = 0;
  double speedup = 0;
  double max_difference = 0;
};

PrefillResult MeasurePrefill(CpuBackend& backend, int kernel_reps,
                             int naive_reps) {
  constexpr int64_t T = kPrefillTokens;
  constexpr int H = kPrefillHeads;
  constexpr int D = kPrefillDim;
  const int64_t n = T * H * D;
  const std::vector<float> q = RandomFloats(n, 21);
  const std::vector<float> k = RandomFloats(n, 22);
  const std::vector<float> v = RandomFloats(n, 23);
  std::vector<float> kernel_out(n), naive_out(n);

  const TensorView q_view = ViewOf(DType::kFloat32, {T, H, D}, q.data());
  const TensorView k_view = ViewOf(DType::kFloat32, {T, H, D}, k.data());
  const TensorView v_view = ViewOf(DType::kFloat32, {T, H, D}, v.data());
  const std::byte* storage[2];
  AttentionProblem problem;
  problem.q = q_view;
  problem.kv = ContiguousKvView(k_view, v_view, storage);
  problem.mask.causal = true;
  problem.scale = 1.0f / std::sqrt(static_cast<float>(D));
  problem.output = kernel_out.data();

  auto run_kernel = [&] {
    const Clock::time_point start = Clock::now();
    if (absl::Status s = backend.Attend({&problem, 1}); !s.ok()) {
      Die(s, "prefill");
    }
    return Seconds(start);
  };
  auto run_naive = [&] {
    const Clock::time_point start = Clock::now();
    NaiveTiledPrefill(backend.thread_pool(), q.data(), k.data(), v.data(),
                      naive_out.data());
    return Seconds(start);
  };
  run_kernel();  // warm-up
  std::vector<double> kernel_s, naive_s;
  for (int rep = 0; rep < std::max(kernel_reps, naive_reps); ++rep) {
    if (rep < naive_reps) naive_s.push_back(run_naive());
    if (rep < kernel_reps) kernel_s.push_back(run_kernel());
  }
  // Causal: T (T + 1) / 2 visible (query, key) pairs per head, each a
  // head_dim dot product and a value_dim multiply-add (2 flops each).
  const double flops = double{H} * T * (T + 1) / 2 * (2.0 * D + 2.0 * D);
  PrefillResult result;
  result.kernel_gflops = flops / Median(kernel_s) / 1e9;
  result.naive_gflops = flops / Median(naive_s) / 1e9;
  result.speedup = Median(naive_s) / Median(kernel_s);
  for (int64_t i = 0; i < n; ++i) {
    result.max_difference =
        std::max(result.max_difference,
                 static_cast<double>(std::abs(kernel_out[i] - naive_out[i])));
  }
  return result;
}

}  // namespace

void RunKernelBench(const BenchOptions& options, BenchReport* report) {
  CpuBackend backend(options.threads);
  const int threads = backend.num_threads();
  report->AddFact("cpu_model", CpuModelName());
  report->AddFact("isa", std::string(CpuIsaName(backend.isa())));
  report->AddFact("cpu_device", backend.device());
  std::printf("kernel bench on %s\n", backend.device().c_str());

  const int decode_reps = options.quick ? 15 : 41;
  for (int64_t length : {int64_t{8192}, int64_t{32768}}) {
    std::printf("  decode T=%lld ...\n", static_cast<long long>(length));
    std::fflush(stdout);
    const DecodeResult r = MeasureDecode(backend, length, decode_reps);
    const std::string t = absl::StrCat("T=", length);
    report->AddRow(
        kSection, absl::StrCat("decode ", t, " H=32 H_kv=8 d=128 fp16 KV read"),
        r.decode_gbps, "GB/s");
    report->AddRow(
        kSection,
        absl::StrCat("streaming-read probe, same bytes, KV arena (", t, ")"),
        r.stream_gbps, "GB/s");
    report->AddRow(
        kSection,
        absl::StrCat("same probe on a plain heap buffer (", t, "), context"),
        r.heap_gbps, "GB/s");
    report->AddRow(
        kSection,
        absl::StrCat("decode / probe, median of paired reps (", t, ")"),
        r.ratio, "ratio");
    report->AddFigure(absl::StrCat("decode_bandwidth_ratio_", length), r.ratio);
    if (length == 32768) report->AddFigure("decode_bandwidth_ratio", r.ratio);
  }

  std::printf("  prefill T=2048 ...\n");
  std::fflush(stdout);
  const PrefillResult p =
      MeasurePrefill(backend, options.quick ? 5 : 15, options.quick ? 3 : 7);
  report->AddRow(kSection, "prefill causal T=2048 H=16 d=64 fp32, kernels",
                 p.kernel_gflops, "GFLOP/s");
  report->AddRow(kSection,
                 absl::StrCat("prefill, naive tiled reference (same ", threads,
                              threads == 1 ? " thread)" : " threads)"),
                 p.naive_gflops, "GFLOP/s");
  report->AddRow(kSection, "prefill kernels / naive reference", p.speedup,
                 "ratio");
  report->AddRow(kSection, "prefill max |kernels - naive| (sanity)",
                 p.max_difference, "abs");
  report->AddFigure("prefill_gflops", p.kernel_gflops);
  report->AddFigure("prefill_vs_naive", p.speedup);
}

}  // namespace attention::bench
