// The kernel section of attn-bench: CPU attention kernels measured against
// baselines run in the same process, on the same thread pool:
//   * decode: one query row per head over a long paged KV history
//     (T = 32768, head_dim 128, GQA H = 32 / H_kv = 8 and MHA 32 / 32, fp32,
//     fp16 and bf16 KV; the fp16 GQA case also at T = 8192) in a real
//     BlockPool, as KV bytes read per second, against the roofline measured
//     in the same repetitions on the same threads: a plain streaming read (a
//     sum) of a buffer of the same size in the same kind of memory, a backend
//     arena, and a peak multiply-add probe of the backend's kernel ISA
//     (decode_roofline_ratio_*: achieved / min(read bandwidth, multiply-add
//     peak / flops per KV byte), where the read bandwidth is the faster of
//     two reads of the same bytes: the baseline-ISA sum and the kernel
//     ISA's full-vector loads (on some machines 16-byte loads keep too few
//     cache lines in flight to reach the memory's bandwidth);
//     decode_bandwidth_ratio_*, kept for continuity: achieved / the
//     baseline-ISA sum alone); and, for what the kernels themselves
//     compute, the same decode on one thread over a 2 MiB history that
//     stays in the caches (decode_cached_gbps_per_thread_*), with the long
//     decode as a share of that rate times the thread count
//     (decode_vs_cached_kernels_*); and the tile kernel alone, one 32-key
//     tile of rows in L1 updated over and over on one thread, as a share
//     of that thread's multiply-add peak (decode_tile_fma_share_*): what
//     the kernels compute when neither memory nor the backend's per-tile
//     work costs anything;
//   * prefill: causal, T = 2048, H = H_kv = 16, head_dim 64, fp32, against
//     the seeds' straightforward tiled_attention loop written in plain C++
//     (prefill_gflops, prefill_vs_naive).
// Every figure is the median of several repetitions; the sides of a ratio
// alternate so that machine noise hits all alike. Timing is done here
// rather than with Google Benchmark because each ratio needs its sides
// interleaved repetition by repetition.
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
#include "bench/fma_probe.h"
#include "core/attention_problem.h"
#include "core/block_pool.h"
#include "core/cpu/attention_unit.h"
#include "core/cpu/cpu_backend.h"
#include "core/cpu/cpu_features.h"
#include "core/cpu/kernels.h"
#include "core/dtype.h"
#include "core/engine.h"
#include "core/kv_view.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace attention::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kSection[] = "kernel";

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
// thread like a long decode, each piece with `read(piece, piece_bytes)`,
// whose results go to *sink (so that no read is optimized away); returns
// the seconds taken.
template <typename T, typename Read>
double ParallelRead(ThreadPool& pool, const std::byte* data, int64_t bytes,
                    T* sink, Read read) {
  const int64_t pieces = int64_t{16} * pool.num_threads();
  const int64_t piece_bytes = (bytes / pieces + 63) / 64 * 64;
  std::vector<T> results(pieces);
  const Clock::time_point start = Clock::now();
  pool.ParallelFor(pieces, [&](int64_t i) {
    const int64_t begin = i * piece_bytes;
    const int64_t end = std::min(begin + piece_bytes, bytes);
    if (begin < end) results[i] = read(data + begin, end - begin);
  });
  const double seconds = SecondsSince(start);
  for (T result : results) *sink += result;
  return seconds;
}

// The streaming read: SumWords, compiled for the baseline ISA.
double StreamRead(ThreadPool& pool, const std::byte* data, int64_t bytes,
                  uint64_t* sink) {
  return ParallelRead(pool, data, bytes, sink, SumWords);
}

// The same read with the kernel ISA's full-vector loads (KernelTable::
// read_probe): with SumWords' 16-byte loads a core keeps fewer cache lines
// in flight than with 64-byte ones, so on some machines SumWords measures
// the core's memory-level parallelism rather than the memory's bandwidth.
// The roofline takes the faster of the two.
double WideRead(ThreadPool& pool, const cpu::KernelTable& kernels,
                const std::byte* data, int64_t bytes, float* sink) {
  return ParallelRead(pool, data, bytes, sink,
                      [&](const std::byte* piece, int64_t piece_bytes) {
                        return kernels.read_probe(
                            reinterpret_cast<const float*>(piece),
                            piece_bytes / 4);
                      });
}

// ---- Decode ----------------------------------------------------------------

struct DecodeShape {
  int64_t length = 32768;
  int heads = 32;
  int kv_heads = 8;
  DType dtype = DType::kFloat16;
  bool heap_probe = false;  // also read a plain heap buffer, for context
  int64_t block_bytes = 0;  // KV block size; 0: the engine's default
};

constexpr int kDecodeHeadDim = 128;

// Floating-point operations per KV byte of a decode step: every query head
// of a KV head's group does a head_dim multiply-add per key (Q.K) and a
// value_dim multiply-add per value (P.V) on each K/V row it shares.
double FlopsPerKvByte(const DecodeShape& shape) {
  const double group = static_cast<double>(shape.heads) / shape.kv_heads;
  const double flops = group * (2.0 * kDecodeHeadDim + 2.0 * kDecodeHeadDim);
  const double bytes = 2.0 * kDecodeHeadDim * DTypeSize(shape.dtype);
  return flops / bytes;
}

struct DecodeResult {
  double decode_gbps = 0;
  double stream_gbps = 0;  // the probe on backend (KV arena) memory
  double heap_gbps = 0;    // for context: the probe on a plain heap buffer
  double wide_gbps = 0;    // WideRead on the probe's arena
  double fma_gflops = 0;   // peak multiply-add rate, all threads
  double flops_per_byte = 0;
  double compute_gbps = 0;  // fma_gflops / flops_per_byte
  double read_gbps = 0;     // max(stream, wide): the roofline's bandwidth
  double ratio = 0;           // decode / stream, median of paired reps
  double roofline_ratio = 0;  // decode / min(read, compute), median
  bool compute_bound = false;  // in most repetitions
  // The kernels on one thread over a cached history, and the decode as a
  // share of that rate times the backend's threads, median.
  double cached_gbps_per_thread = 0;
  double kernel_share = 0;
  // The tile kernel alone (TileLoop) as a share of one thread's
  // multiply-add peak, median.
  double tile_fma_share = 0;
};

// A KV history of `length` tokens of `shape`, written through `backend`
// into a real BlockPool with the shape's block size, and the decode step of
// its last position (one query row per head) over it.
class DecodeHistory {
 public:
  DecodeHistory(CpuBackend& backend, const DecodeShape& shape, int64_t length)
      : layout_(LayoutOf(shape)),
        paged_(backend, layout_, length, BlockBytes(shape), kSection),
        q_(RandomFloats(int64_t{shape.heads} * kDecodeHeadDim, 12)),
        output_(shape.heads * kDecodeHeadDim) {
    // Fill the history through the backend, reusing one random chunk (the
    // values do not matter for speed, only that they are finite).
    constexpr int64_t kChunk = 2048;
    const int64_t per_token = int64_t{shape.kv_heads} * kDecodeHeadDim;
    std::vector<std::byte> chunk(kChunk * per_token * DTypeSize(shape.dtype));
    {
      const std::vector<float> raw = RandomFloats(kChunk * per_token, 11);
      ConvertFromFloat(raw.data(), raw.size(), shape.dtype, chunk.data());
    }
    for (int64_t start = 0; start < length; start += kChunk) {
      const int64_t n = std::min(kChunk, length - start);
      KvWrite write;
      write.layout = layout_;
      write.start = start;
      write.k = ViewOf(shape.dtype, {n, shape.kv_heads, kDecodeHeadDim},
                       chunk.data());
      write.v = write.k;
      write.blocks = paged_.blocks;
      if (absl::Status s = backend.WriteKv(write); !s.ok()) Die(s, "write KV");
    }
    problem_.q = ViewOf(DType::kFloat32, {1, shape.heads, kDecodeHeadDim},
                        q_.data());
    problem_.kv =
        PagedKvView(layout_, length, paged_.k_blocks, paged_.v_blocks);
    problem_.mask.causal = true;
    problem_.mask.query_start = length - 1;
    problem_.scale = 1.0f / std::sqrt(static_cast<float>(kDecodeHeadDim));
    problem_.output = output_.data();
    bytes_ = length * layout_.bytes_per_token();
  }

  // KV bytes one step reads.
  int64_t bytes() const { return bytes_; }
  static int64_t BytesPerToken(const DecodeShape& shape) {
    return LayoutOf(shape).bytes_per_token();
  }

  // Seconds one decode step takes on `backend`.
  double Step(CpuBackend& backend) {
    const Clock::time_point start = Clock::now();
    if (absl::Status s = backend.Attend({&problem_, 1}); !s.ok()) {
      Die(s, "decode");
    }
    return SecondsSince(start);
  }

 private:
  static int64_t BlockBytes(const DecodeShape& shape) {
    return shape.block_bytes > 0 ? shape.block_bytes
                                 : EngineOptions().kv_block_bytes;
  }
  static KvBlockLayout LayoutOf(const DecodeShape& shape) {
    KvBlockLayout layout;
    layout.dtype = shape.dtype;
    layout.num_kv_heads = shape.kv_heads;
    layout.head_dim = kDecodeHeadDim;
    layout.value_dim = kDecodeHeadDim;
    layout.tokens_per_block = BlockBytes(shape) / layout.bytes_per_token();
    return layout;
  }

  const KvBlockLayout layout_;
  PagedBlocks paged_;
  const std::vector<float> q_;
  std::vector<float> output_;
  AttentionProblem problem_;
  int64_t bytes_ = 0;
};

// One decode tile (cpu::kTileKeys keys, one query row, the shape's query
// heads per KV head, its KV type read in place) updated over and over
// through the kernel table on the calling thread, its rows in L1: the
// kernels' own speed, without memory, row lookups, masks or scheduling.
class TileLoop {
 public:
  TileLoop(const cpu::KernelTable& kernels, const DecodeShape& shape)
      : kernels_(kernels),
        group_(shape.heads / shape.kv_heads),
        q_(RandomFloats(int64_t{group_} * kDecodeHeadDim, 31)),
        rows_(2 * cpu::kTileKeys * kDecodeHeadDim * DTypeSize(shape.dtype)),
        state_(group_ * (2 + kDecodeHeadDim)),
        work_(group_ * (cpu::kTileKeys + 1)),
        active_(group_) {
    const std::vector<float> raw =
        RandomFloats(2 * cpu::kTileKeys * kDecodeHeadDim, 32);
    ConvertFromFloat(raw.data(), raw.size(), shape.dtype, rows_.data());
    const int64_t row_bytes = kDecodeHeadDim * DTypeSize(shape.dtype);
    for (int j = 0; j < cpu::kTileKeys; ++j) {
      keys_[j] = rows_.data() + j * row_bytes;
      values_[j] = rows_.data() + (cpu::kTileKeys + j) * row_bytes;
    }
    job_.n = cpu::kTileKeys;
    job_.head_dim_padded = kDecodeHeadDim;
    job_.value_dim_padded = kDecodeHeadDim;
    job_.rows = 1;
    job_.group = group_;
    job_.scale = 1.0f / std::sqrt(static_cast<float>(kDecodeHeadDim));
    job_.q = q_.data();
    job_.key_type = job_.value_type = cpu::ToElementType(shape.dtype);
    job_.k = keys_;
    job_.v = values_;
    job_.visible = &visible_;
    job_.m = state_.data();
    job_.l = state_.data() + group_;
    job_.acc = state_.data() + 2 * group_;
    job_.work = work_.data();
    job_.alpha = work_.data() + group_ * cpu::kTileKeys;
    job_.active = active_.data();
  }

  // Floating-point operations of one update: a multiply-add per element
  // of each query head's Q.K and P.V.
  double Flops() const {
    return 2.0 * group_ * cpu::kTileKeys * (2.0 * kDecodeHeadDim);
  }

  // Seconds per update: the fastest of a few timed runs of `updates`.
  double SecondsPerUpdate(int updates) {
    double best = std::numeric_limits<double>::infinity();
    for (int run = 0; run < 3; ++run) {
      std::fill(state_.begin(), state_.begin() + group_,
                -std::numeric_limits<float>::infinity());
      std::fill(state_.begin() + group_, state_.end(), 0.0f);
      const Clock::time_point start = Clock::now();
      for (int i = 0; i < updates; ++i) {
        if (kernels_.update_tile(&job_) != cpu::TileError::kNone) {
          Die(absl::InternalError("the tile update failed"), "tile kernel");
        }
      }
      best = std::min(best, SecondsSince(start) / updates);
    }
    return best;
  }

 private:
  const cpu::KernelTable& kernels_;
  const int group_;
  const std::vector<float> q_;
  std::vector<std::byte> rows_;
  const std::byte* keys_[cpu::kTileKeys];
  const std::byte* values_[cpu::kTileKeys];
  const uint32_t visible_ = ~uint32_t{0};
  std::vector<float> state_;  // m, l [group]; acc [group][head_dim]
  std::vector<float> work_;
  std::vector<int> active_;
  cpu::TileJob job_;
};

// Tile updates per timed run: about a millisecond.
constexpr int kTileUpdates = 2000;

// KV bytes of the cached decode: small enough to stay in one core's caches
// between steps, large enough that a step is mostly kernel work.
constexpr int64_t kCachedDecodeBytes = int64_t{2} << 20;
// Cached steps per repetition; the fastest counts (the first may find
// the history partly evicted by the probes).
constexpr int kCachedSteps = 4;

// The decode step of `shape` over `shape.length` tokens on `backend`, with
// the probes that bound it; and the same step on one thread (`single`) over
// a history that stays in the caches: what the kernels compute per thread
// when memory is not the limit.
DecodeResult MeasureDecode(CpuBackend& backend, CpuBackend& single,
                           const DecodeShape& shape, int reps) {
  DecodeHistory history(backend, shape, shape.length);
  DecodeHistory cached(
      single, shape,
      std::max<int64_t>(
          1, kCachedDecodeBytes / DecodeHistory::BytesPerToken(shape)));
  // The probes read as many bytes as the decode does (every K and V byte),
  // from the same kind of memory: arenas of the same backend. Each probe
  // has its own arena, so that every timed read (stream probe, wide probe,
  // decode) finds its bytes behind the same amount of other traffic: the
  // other two reads, 2 x kv_bytes. With one arena for both probes the wide
  // probe re-read what the stream probe had just read, partly from a last
  // level cache that can hold a whole 128 MiB history (these VMs report
  // 480 MiB), while the decode always read its history cold.
  const int64_t kv_bytes = history.bytes();
  std::unique_ptr<DeviceArena> probe_arenas[2];
  for (std::unique_ptr<DeviceArena>& arena : probe_arenas) {
    absl::StatusOr<std::unique_ptr<DeviceArena>> allocated =
        backend.AllocateArena(kv_bytes);
    if (!allocated.ok()) Die(allocated.status(), "probe buffer");
    arena = *std::move(allocated);
    std::memset(arena->data(), 1, kv_bytes);
  }
  std::byte* probe = probe_arenas[0]->data();
  std::byte* wide_probe = probe_arenas[1]->data();
  // Reported for context only: ordinary heap memory (4 KiB pages where
  // transparent huge pages are opt-in, unlike the KV arena).
  std::vector<std::byte> heap(shape.heap_probe ? kv_bytes : 0, std::byte{1});
  const cpu::KernelTable& kernels = KernelsOf(backend);
  TileLoop tile(kernels, shape);
  ThreadPool& pool = backend.thread_pool();
  uint64_t sink = 0;
  float fma_sink = 0;
  // Warm-up: page in, fill caches and thread scratch.
  history.Step(backend);
  cached.Step(single);
  StreamRead(pool, probe, kv_bytes, &sink);
  WideRead(pool, kernels, wide_probe, kv_bytes, &fma_sink);
  const int64_t fma_rounds = FmaProbeRounds(kernels, &fma_sink);
  FmaPeak(pool, kernels, fma_rounds, &fma_sink);
  tile.SecondsPerUpdate(kTileUpdates);

  // Each repetition reads with the probe, runs the multiply-add probe, then
  // decodes; the ratios are the medians of the per-repetition ratios, so
  // slow phases of a loaded machine hit all sides of a repetition.
  const double flops_per_byte = FlopsPerKvByte(shape);
  std::vector<double> decode_s, stream_s, heap_s, wide_s, read_s, fma_rate,
      cached_s, ratios, roofline, kernel_share, tile_share;
  int compute_bound_reps = 0;
  for (int rep = 0; rep < reps; ++rep) {
    if (shape.heap_probe) {
      heap_s.push_back(StreamRead(pool, heap.data(), kv_bytes, &sink));
    }
    stream_s.push_back(StreamRead(pool, probe, kv_bytes, &sink));
    wide_s.push_back(WideRead(pool, kernels, wide_probe, kv_bytes, &fma_sink));
    fma_rate.push_back(FmaPeak(pool, kernels, fma_rounds, &fma_sink));
    double cached_best = std::numeric_limits<double>::infinity();
    for (int i = 0; i < kCachedSteps; ++i) {
      cached_best = std::min(cached_best, cached.Step(single));
    }
    cached_s.push_back(cached_best);
    const double tile_flops =
        tile.Flops() / tile.SecondsPerUpdate(kTileUpdates);
    tile_share.push_back(tile_flops /
                         OneThreadFmaPeak(kernels, fma_rounds, &fma_sink));
    decode_s.push_back(history.Step(backend));
    const double decode_bps = kv_bytes / decode_s.back();
    const double stream_bps = kv_bytes / stream_s.back();
    const double read_bps = std::max(stream_bps, kv_bytes / wide_s.back());
    read_s.push_back(kv_bytes / read_bps);
    const double compute_bps = fma_rate.back() / flops_per_byte;
    ratios.push_back(decode_bps / stream_bps);
    roofline.push_back(decode_bps / std::min(read_bps, compute_bps));
    kernel_share.push_back(decode_bps * cached_s.back() /
                           (cached.bytes() * backend.num_threads()));
    if (compute_bps < read_bps) ++compute_bound_reps;
  }
  if (sink == 42 || fma_sink == 42.0f) std::printf(" ");  // keep probes alive
  DecodeResult result;
  result.decode_gbps = kv_bytes / Median(decode_s) / 1e9;
  result.stream_gbps = kv_bytes / Median(stream_s) / 1e9;
  if (shape.heap_probe) result.heap_gbps = kv_bytes / Median(heap_s) / 1e9;
  result.wide_gbps = kv_bytes / Median(wide_s) / 1e9;
  result.read_gbps = kv_bytes / Median(read_s) / 1e9;
  result.fma_gflops = Median(fma_rate) / 1e9;
  result.flops_per_byte = flops_per_byte;
  result.compute_gbps = result.fma_gflops / flops_per_byte;
  result.ratio = Median(ratios);
  result.roofline_ratio = Median(roofline);
  result.compute_bound = 2 * compute_bound_reps > reps;
  result.cached_gbps_per_thread = cached.bytes() / Median(cached_s) / 1e9;
  result.kernel_share = Median(kernel_share);
  result.tile_fma_share = Median(tile_share);
  return result;
}

const char* DTypeLabel(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat32:
      break;
  }
  return "fp32";
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
    return SecondsSince(start);
  };
  auto run_naive = [&] {
    const Clock::time_point start = Clock::now();
    NaiveTiledPrefill(backend.thread_pool(), q.data(), k.data(), v.data(),
                      naive_out.data());
    return SecondsSince(start);
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

  // The same kernels on one thread, for the cached decode.
  absl::StatusOr<std::unique_ptr<CpuBackend>> single =
      CpuBackend::Create(1, backend.isa());
  if (!single.ok()) Die(single.status(), "one-thread backend");
  const int decode_reps = options.quick ? 15 : 41;
  // The fp16 GQA shape at two lengths (decode_bandwidth_ratio*), then the
  // roofline of every KV type, GQA and MHA, at T = 32768.
  std::vector<DecodeShape> shapes;
  shapes.push_back({.length = 8192, .heap_probe = true});
  for (int heads_per_kv : {4, 1}) {
    for (DType dtype : {DType::kFloat16, DType::kFloat32, DType::kBFloat16}) {
      shapes.push_back({.kv_heads = 32 / heads_per_kv,
                        .dtype = dtype,
                        .heap_probe = heads_per_kv == 4 &&
                                      dtype == DType::kFloat16});
    }
  }
  // For context: the fp16 GQA decode over 1 MiB blocks (each head's keys
  // and values in 64 KiB runs instead of 4 KiB; --kv_block_bytes).
  constexpr int64_t kLargeBlock = int64_t{1} << 20;
  shapes.push_back({.block_bytes = kLargeBlock});
  for (const DecodeShape& shape : shapes) {
    const bool mha = shape.heads == shape.kv_heads;
    const bool large_blocks = shape.block_bytes == kLargeBlock;
    const bool legacy = !mha && shape.dtype == DType::kFloat16 && !large_blocks;
    const std::string type = DTypeLabel(shape.dtype);
    const std::string what =
        absl::StrCat("T=", shape.length, " H=", shape.heads, "/",
                     shape.kv_heads, " ", type, large_blocks ? " 1MiB" : "");
    std::printf("  decode %s ...\n", what.c_str());
    std::fflush(stdout);
    // The roofline-only shapes run fewer repetitions: --quick stays short.
    const DecodeResult r = MeasureDecode(
        backend, **single, shape, legacy ? decode_reps : decode_reps / 2);
    const char* bound = r.compute_bound ? "compute" : "memory";
    report->AddRow(kSection, absl::StrCat("decode ", what, " d=128 KV read"),
                   r.decode_gbps, "GB/s");
    report->AddRow(kSection,
                   absl::StrCat("streaming-read probe, same bytes (", what, ")"),
                   r.stream_gbps, "GB/s");
    if (shape.heap_probe) {
      report->AddRow(kSection,
                     absl::StrCat("same probe on a heap buffer (", what,
                                  "), context"),
                     r.heap_gbps, "GB/s");
    }
    report->AddRow(kSection,
                   absl::StrCat("read probe, ", CpuIsaName(backend.isa()),
                                " loads (", what, ")"),
                   r.wide_gbps, "GB/s");
    report->AddRow(kSection,
                   absl::StrCat("read bandwidth, faster probe (", what, ")"),
                   r.read_gbps, "GB/s");
    report->AddRow(kSection,
                   absl::StrCat("multiply-add peak, same threads (", what, ")"),
                   r.fma_gflops, "GFLOP/s");
    report->AddRow(kSection,
                   absl::StrFormat("peak / %.2g flops per KV byte (%s)",
                                   r.flops_per_byte, what),
                   r.compute_gbps, "GB/s");
    report->AddRow(kSection,
                   absl::StrFormat("decode, one thread, %d KiB cached (%s)",
                                   static_cast<int>(kCachedDecodeBytes >> 10),
                                   what),
                   r.cached_gbps_per_thread, "GB/s");
    report->AddRow(kSection,
                   absl::StrCat("decode / (", threads, " x cached rate) (",
                                what, ")"),
                   r.kernel_share, "ratio");
    report->AddRow(kSection,
                   absl::StrCat("tile kernel alone, rows in L1: multiply-adds "
                                "/ one thread's peak (",
                                what, ")"),
                   r.tile_fma_share, "ratio");
    report->AddRow(kSection, absl::StrCat("decode / read probe (", what, ")"),
                   r.ratio, "ratio");
    report->AddRow(kSection,
                   absl::StrCat("decode / roofline, ", bound, " bound (", what,
                                ")"),
                   r.roofline_ratio, "ratio");
    if (legacy) {
      report->AddFigure(absl::StrCat("decode_bandwidth_ratio_", shape.length),
                        r.ratio);
    }
    if (shape.length != 32768) continue;
    if (legacy) {
      report->AddFigure("decode_bandwidth_ratio", r.ratio);
      report->AddFigure("decode_roofline_ratio", r.roofline_ratio);
      report->AddFact("decode_roofline_bound", bound);
    }
    const std::string suffix = absl::StrCat(mha ? "_mha_" : "_", type,
                                            large_blocks ? "_1mib_blocks" : "");
    report->AddFigure(absl::StrCat("decode_roofline_ratio", suffix),
                      r.roofline_ratio);
    report->AddFact(absl::StrCat("decode_roofline_bound", suffix), bound);
    report->AddFigure(absl::StrCat("decode_cached_gbps_per_thread", suffix),
                      r.cached_gbps_per_thread);
    report->AddFigure(absl::StrCat("decode_vs_cached_kernels", suffix),
                      r.kernel_share);
    report->AddFigure(absl::StrCat("decode_tile_fma_share", suffix),
                      r.tile_fma_share);
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
