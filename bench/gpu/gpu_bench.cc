// GPU benchmark of the CUDA attention backend.
//
//   attention_gpu_bench [--json=PATH] [--quick]
//
// Measures, in one run on one GPU:
//   * the device-to-device cudaMemcpy bandwidth ((read + write) / time), the
//     practical ceiling for a streaming kernel;
//   * paged decode (one query token per sequence, GQA 32/8, head_dim 128,
//     bf16 KV in the backend's KV arena with 64 KiB blocks) for contexts
//     8k..128k and batches 1..64: bytes of K/V read / time, as a ratio to the
//     copy bandwidth and to 4.8 TB/s (H200 HBM3e peak); and the long-context
//     batch of issue 16 (64 x 128k, GQA 64/8, "case": "long_context_gqa8"),
//     whose split-KV states need several passes;
//   * causal prefill (bf16, 32/8 heads, head_dim 128, T = 4k..16k): TFLOP/s
//     counted as 4 * H * head_dim * T^2 / 2, the convention of
//     bench/gpu/sdpa_bench.py;
//   * wide heads (issue 16 item 6, "wide_head"): causal prefill and decode
//     with Gemma-like 16/8 heads, bf16, head_dim 128, 192 and 256 side by
//     side; 192 and 256 run on the wide tensor-core kernel, and each figure
//     is also given as a ratio to the head_dim 128 one of the same run.
// "kernel" figures time the backend's kernels with CUDA events (what the
// PyTorch comparison measures); "call" figures time the whole
// CudaBackend::Attend call including the PCIe copies of q and the output.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/gpu/fill_kernels.h"
#include "core/attention_problem.h"
#include "core/cuda/cuda_backend.h"
#include "core/dtype.h"
#include "core/kv_view.h"

namespace attention {
namespace {

constexpr int kHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kDim = 128;
constexpr int64_t kBlockBytes = 64 << 10;  // the engine's default block
constexpr double kReferenceGBps = 4800.0;

struct Args {
  std::string json_path;
  bool quick = false;
};

Args ParseArgs(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--json=", 0) == 0) {
      args.json_path = arg.substr(7);
    } else if (arg == "--quick") {
      args.quick = true;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", arg.c_str());
      std::exit(2);
    }
  }
  return args;
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0.0 : values[values.size() / 2];
}

// Random bf16 query values (host), cheap to generate in bulk.
std::vector<uint16_t> RandomBf16(int64_t count, uint64_t seed) {
  std::vector<uint16_t> out(static_cast<size_t>(count));
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  for (int64_t i = 0; i < count; ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    const float unit = static_cast<float>(state >> 40) * (1.0f / 16777216.0f);
    out[static_cast<size_t>(i)] = FloatToBFloat16(4.0f * unit - 2.0f);
  }
  return out;
}

TensorView Bf16View(const std::vector<uint16_t>& values, Shape shape) {
  TensorView view;
  view.dtype = DType::kBFloat16;
  view.shape = std::move(shape);
  view.data = reinterpret_cast<const std::byte*>(values.data());
  view.size_bytes = static_cast<int64_t>(values.size() * 2);
  return view;
}

// Device-to-device copy bandwidth, (read + write) bytes per second.
absl::StatusOr<double> CopyBandwidthGBps(bool quick) {
  const size_t bytes = size_t{1} << 30;
  void* a = nullptr;
  void* b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess ||
      cudaMalloc(&b, bytes) != cudaSuccess) {
    return absl::ResourceExhaustedError("no room for the copy benchmark");
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaMemset(a, 1, bytes);
  cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);  // warm-up
  const int iterations = quick ? 5 : 20;
  cudaEventRecord(start);
  for (int i = 0; i < iterations; ++i) {
    cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, bytes,
                    cudaMemcpyDeviceToDevice);
  }
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(a);
  cudaFree(b);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return absl::InternalError(cudaGetErrorString(e));
  }
  return 2.0 * static_cast<double>(bytes) * iterations / (ms * 1e-3) / 1e9;
}

struct Timing {
  double kernel_ms = 0.0;
  double call_ms = 0.0;
};

absl::StatusOr<Timing> TimeAttend(CudaBackend& backend,
                                  const std::vector<AttentionProblem>& problems,
                                  int warmup, int iterations) {
  std::vector<double> kernel;
  std::vector<double> call;
  for (int i = 0; i < warmup + iterations; ++i) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<float> ms = backend.AttendTimed(problems);
    const auto end = std::chrono::steady_clock::now();
    if (!ms.ok()) return ms.status();
    if (i < warmup) continue;
    kernel.push_back(*ms);
    call.push_back(
        std::chrono::duration<double, std::milli>(end - start).count());
  }
  return Timing{Median(kernel), Median(call)};
}

int Run(const Args& args) {
  // Two callers at most; scratch for the largest prefill (T = 16384: q,
  // its 16-bit copy and the float32 output) rather than the server's
  // default of 8 x 512 MiB.
  CudaBackendOptions options;
  options.max_streams = 2;
  options.scratch_bytes_per_stream = int64_t{2} << 30;
  options.pinned_bytes_per_stream = int64_t{1} << 30;
  absl::StatusOr<std::unique_ptr<CudaBackend>> created =
      CudaBackend::Create(options);
  if (!created.ok()) {
    std::fprintf(stderr, "attention_gpu_bench: %s\n",
                 std::string(created.status().message()).c_str());
    return 2;
  }
  CudaBackend& backend = **created;
  std::printf("device: %s\n", backend.device().c_str());

  absl::StatusOr<double> copy = CopyBandwidthGBps(args.quick);
  if (!copy.ok()) {
    std::fprintf(stderr, "copy benchmark: %s\n",
                 std::string(copy.status().message()).c_str());
    return 1;
  }
  std::printf("device-to-device copy: %.0f GB/s (read + write)\n", *copy);

  // One KV arena for every configuration, filled with random bf16.
  KvBlockLayout layout;
  layout.dtype = DType::kBFloat16;
  layout.num_kv_heads = kKvHeads;
  layout.head_dim = kDim;
  layout.value_dim = kDim;
  layout.tokens_per_block = kBlockBytes / layout.bytes_per_token();
  const std::vector<int64_t> contexts =
      args.quick ? std::vector<int64_t>{8192, 32768}
                 : std::vector<int64_t>{8192, 32768, 131072};
  const std::vector<int> batches =
      args.quick ? std::vector<int>{1, 8} : std::vector<int>{1, 8, 64};
  int64_t want = 0;
  for (int64_t c : contexts) {
    want = std::max(want, c * batches.back() * layout.bytes_per_token());
  }
  want = std::max<int64_t>(want, int64_t{16384} * layout.bytes_per_token());
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  cudaMemGetInfo(&free_bytes, &total_bytes);
  // Leave room for the scratch of the largest prefill (~1.5 GB) and more.
  const int64_t room = static_cast<int64_t>(free_bytes) - (int64_t{6} << 30);
  const int64_t arena_bytes =
      std::max<int64_t>(std::min(want, room), int64_t{1} << 30) / kBlockBytes *
      kBlockBytes;
  absl::StatusOr<std::unique_ptr<DeviceArena>> arena =
      backend.AllocateArena(arena_bytes);
  if (!arena.ok()) {
    std::fprintf(stderr, "arena: %s\n",
                 std::string(arena.status().message()).c_str());
    return 1;
  }
  if (bench::FillRandomBf16((*arena)->data(), arena_bytes / 2, 42, nullptr) !=
          cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess) {
    std::fprintf(stderr, "filling the arena failed\n");
    return 1;
  }
  const int64_t total_blocks = arena_bytes / kBlockBytes;
  auto block = [&](int64_t i) {
    return (*arena)->data() + (i % total_blocks) * kBlockBytes;
  };
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));

  std::vector<std::string> decode_json;
  std::printf(
      "\ndecode (GQA %d/%d, head_dim %d, bf16 KV, %lld tokens/block)\n"
      "%8s %6s %10s %10s %10s %9s %9s %9s\n",
      kHeads, kKvHeads, kDim, static_cast<long long>(layout.tokens_per_block),
      "context", "batch", "kernel_ms", "call_ms", "GB/s", "vs_copy", "vs_4.8TB",
      "call_GB/s");
  // One decode batch: `batch` sequences of `context` tokens, `heads` query
  // heads over kKvHeads. Appends its JSON object; false on failure.
  auto run_decode = [&](int64_t context, int batch, int heads,
                        const char* label) -> bool {
    const int64_t blocks_per_seq =
        (context + layout.tokens_per_block - 1) / layout.tokens_per_block;
    if (blocks_per_seq * batch > total_blocks && label == nullptr) {
      std::printf("%8lld %6d  skipped: KV does not fit in %lld bytes\n",
                  static_cast<long long>(context), batch,
                  static_cast<long long>(arena_bytes));
      decode_json.push_back(absl::StrFormat(
          R"({"context": %d, "batch": %d, "skipped": "KV does not fit"})",
          context, batch));
      return true;
    }
    std::vector<std::vector<const std::byte*>> k_ptrs(batch);
    std::vector<std::vector<const std::byte*>> v_ptrs(batch);
    std::vector<std::vector<uint16_t>> queries(batch);
    std::vector<std::vector<float>> outputs(batch);
    std::vector<AttentionProblem> problems(batch);
    for (int s = 0; s < batch; ++s) {
      for (int64_t b = 0; b < blocks_per_seq; ++b) {
        // Wraps around a smaller arena (the long-context batch).
        std::byte* base = block(s * blocks_per_seq + b);
        k_ptrs[s].push_back(base);
        v_ptrs[s].push_back(base + layout.value_offset_bytes());
      }
      queries[s] = RandomBf16(heads * kDim, 1000 + s);
      outputs[s].resize(heads * kDim);
      AttentionProblem& p = problems[s];
      p.q = Bf16View(queries[s], {1, heads, kDim});
      p.kv = PagedKvView(layout, context, k_ptrs[s], v_ptrs[s]);
      p.mask.causal = true;
      p.mask.query_start = context - 1;
      p.scale = scale;
      p.output = outputs[s].data();
    }
    const int iterations = args.quick ? 3 : 10;
    absl::StatusOr<Timing> t = TimeAttend(backend, problems, 2, iterations);
    if (!t.ok()) {
      std::fprintf(stderr, "decode: %s\n",
                   std::string(t.status().message()).c_str());
      return false;
    }
    const double bytes =
        static_cast<double>(batch) * context * kKvHeads * (2 * kDim) * 2;
    const double gbps = bytes / (t->kernel_ms * 1e-3) / 1e9;
    const double call_gbps = bytes / (t->call_ms * 1e-3) / 1e9;
    std::printf("%8lld %6d %10.3f %10.3f %10.0f %9.2f %9.2f %9.0f%s%s\n",
                static_cast<long long>(context), batch, t->kernel_ms,
                t->call_ms, gbps, gbps / *copy, gbps / kReferenceGBps,
                call_gbps, label != nullptr ? "  " : "",
                label != nullptr ? label : "");
    decode_json.push_back(absl::StrFormat(
        R"({"context": %d, "batch": %d, "heads": %d, "bytes": %.0f, )"
        R"("kernel_ms": %.4f, "call_ms": %.4f, "kernel_gbps": %.1f, )"
        R"("call_gbps": %.1f, "ratio_to_copy": %.4f, )"
        R"("ratio_to_4800gbps": %.4f%s})",
        context, batch, heads, bytes, t->kernel_ms, t->call_ms, gbps, call_gbps,
        gbps / *copy, gbps / kReferenceGBps,
        label != nullptr ? absl::StrCat(R"(, "case": ")", label, "\"") : ""));
    return true;
  };
  for (int64_t context : contexts) {
    for (int batch : batches) {
      if (!run_decode(context, batch, kHeads, nullptr)) return 1;
    }
  }
  // Issue 16's long-context batch: 64 x 128k, GQA 64/8. Its split-KV states
  // (~545 MB) exceed one pass; it used to send half the batch to full mode
  // (one block walking 256 chunks), now it runs in several split passes.
  // Blocks wrap around the arena when it is smaller than the 32 GiB of KV.
  if (!run_decode(131072, 64, 8 * kKvHeads, "long_context_gqa8")) return 1;

  std::vector<std::string> prefill_json;
  std::printf(
      "\ncausal prefill (bf16, %d/%d heads, head_dim %d)\n"
      "%8s %10s %10s %10s %10s\n",
      kHeads, kKvHeads, kDim, "tokens", "kernel_ms", "call_ms", "TFLOP/s",
      "call_TF/s");
  const std::vector<int64_t> prefill_tokens =
      args.quick ? std::vector<int64_t>{4096}
                 : std::vector<int64_t>{4096, 8192, 16384};
  for (int64_t tokens : prefill_tokens) {
    const int64_t blocks =
        (tokens + layout.tokens_per_block - 1) / layout.tokens_per_block;
    std::vector<const std::byte*> k_ptrs;
    std::vector<const std::byte*> v_ptrs;
    for (int64_t b = 0; b < blocks; ++b) {
      k_ptrs.push_back(block(b));
      v_ptrs.push_back(block(b) + layout.value_offset_bytes());
    }
    const std::vector<uint16_t> q = RandomBf16(tokens * kHeads * kDim, 7);
    std::vector<float> output(static_cast<size_t>(tokens * kHeads * kDim));
    AttentionProblem p;
    p.q = Bf16View(q, {tokens, kHeads, kDim});
    p.kv = PagedKvView(layout, tokens, k_ptrs, v_ptrs);
    p.mask.causal = true;
    p.scale = scale;
    p.output = output.data();
    absl::StatusOr<Timing> t = TimeAttend(backend, {p}, 1, args.quick ? 2 : 5);
    if (!t.ok()) {
      std::fprintf(stderr, "prefill: %s\n",
                   std::string(t.status().message()).c_str());
      return 1;
    }
    const double flops = 4.0 * kHeads * kDim * static_cast<double>(tokens) *
                         static_cast<double>(tokens) / 2.0;
    const double tflops = flops / (t->kernel_ms * 1e-3) / 1e12;
    const double call_tflops = flops / (t->call_ms * 1e-3) / 1e12;
    std::printf("%8lld %10.3f %10.3f %10.1f %10.1f\n",
                static_cast<long long>(tokens), t->kernel_ms, t->call_ms,
                tflops, call_tflops);
    prefill_json.push_back(absl::StrFormat(
        R"({"tokens": %d, "heads": %d, "kv_heads": %d, "head_dim": %d, )"
        R"("kernel_ms": %.4f, "call_ms": %.4f, "kernel_tflops": %.2f, )"
        R"("call_tflops": %.2f})",
        tokens, kHeads, kKvHeads, kDim, t->kernel_ms, t->call_ms, tflops,
        call_tflops));
  }

  // Wide heads: the same arena seen with head_dim 128, 192 and 256 layouts
  // (16/8 heads); prefill TFLOP/s and decode K/V GB/s, each with its ratio
  // to head_dim 128.
  std::vector<std::string> wide_json;
  constexpr int kWideHeads = 16;
  std::printf(
      "\nwide heads (bf16, %d/%d heads; ratio = figure / head_dim 128's)\n"
      "%8s %8s %8s %10s %12s %8s\n",
      kWideHeads, kKvHeads, "kind", "head_dim", "tokens", "kernel_ms",
      "TFLOP|GB/s", "ratio");
  // One causal problem over `tokens` keys: `queries` = tokens (prefill) or
  // `batch` sequences of one query (decode).
  auto time_wide = [&](int dim, int64_t tokens, bool decode,
                       int batch) -> absl::StatusOr<Timing> {
    KvBlockLayout wide = layout;
    wide.head_dim = dim;
    wide.value_dim = dim;
    wide.tokens_per_block = kBlockBytes / wide.bytes_per_token();
    const int64_t blocks =
        (tokens + wide.tokens_per_block - 1) / wide.tokens_per_block;
    const int64_t queries = decode ? 1 : tokens;
    std::vector<std::vector<const std::byte*>> k_ptrs(batch);
    std::vector<std::vector<const std::byte*>> v_ptrs(batch);
    std::vector<std::vector<uint16_t>> q(batch);
    std::vector<std::vector<float>> output(batch);
    std::vector<AttentionProblem> problems(batch);
    for (int s = 0; s < batch; ++s) {
      for (int64_t b = 0; b < blocks; ++b) {
        k_ptrs[s].push_back(block(s * blocks + b));
        v_ptrs[s].push_back(block(s * blocks + b) + wide.value_offset_bytes());
      }
      q[s] = RandomBf16(queries * kWideHeads * dim, 11 + s);
      output[s].resize(static_cast<size_t>(queries * kWideHeads * dim));
      AttentionProblem& p = problems[s];
      p.q = Bf16View(q[s], {queries, kWideHeads, dim});
      p.kv = PagedKvView(wide, tokens, k_ptrs[s], v_ptrs[s]);
      p.mask.causal = true;
      p.mask.query_start = tokens - queries;
      p.scale = 1.0f / std::sqrt(static_cast<float>(dim));
      p.output = output[s].data();
    }
    return TimeAttend(backend, problems, decode ? 2 : 1,
                      args.quick ? 2 : (decode ? 10 : 5));
  };
  struct WideRun {
    const char* kind;
    int64_t tokens;
    int batch;
  };
  const std::vector<WideRun> wide_runs =
      args.quick ? std::vector<WideRun>{{"prefill", 4096, 1},
                                        {"decode", 32768, 8}}
                 : std::vector<WideRun>{{"prefill", 4096, 1},
                                        {"prefill", 8192, 1},
                                        {"decode", 32768, 8}};
  for (const WideRun& run : wide_runs) {
    const bool decode = std::string(run.kind) == "decode";
    double base = 0.0;
    for (int dim : {128, 192, 256}) {
      absl::StatusOr<Timing> t = time_wide(dim, run.tokens, decode, run.batch);
      if (!t.ok()) {
        std::fprintf(stderr, "wide heads: %s\n",
                     std::string(t.status().message()).c_str());
        return 1;
      }
      const double tokens = static_cast<double>(run.tokens);
      // Prefill: TFLOP/s (4 * H * d * T^2 / 2); decode: K/V GB/s.
      const double figure =
          decode ? run.batch * tokens * kKvHeads * (2.0 * dim) * 2 /
                       (t->kernel_ms * 1e-3) / 1e9
                 : 4.0 * kWideHeads * dim * tokens * tokens / 2.0 /
                       (t->kernel_ms * 1e-3) / 1e12;
      if (dim == 128) base = figure;
      const double ratio = base > 0.0 ? figure / base : 0.0;
      std::printf("%8s %8d %8lld %10.3f %12.1f %8.2f\n", run.kind, dim,
                  static_cast<long long>(run.tokens), t->kernel_ms, figure,
                  ratio);
      wide_json.push_back(absl::StrFormat(
          R"({"kind": "%s", "head_dim": %d, "heads": %d, "kv_heads": %d, )"
          R"("tokens": %d, "batch": %d, "kernel_ms": %.4f, "call_ms": %.4f, )"
          R"("%s": %.2f, "ratio_to_dim128": %.4f})",
          run.kind, dim, kWideHeads, kKvHeads, run.tokens, run.batch,
          t->kernel_ms, t->call_ms, decode ? "kernel_gbps" : "kernel_tflops",
          figure, ratio));
    }
  }

  if (!args.json_path.empty()) {
    std::ofstream out(args.json_path);
    out << "{\n  \"device\": \"" << backend.device() << "\",\n"
        << absl::StrFormat("  \"copy_gbps_read_plus_write\": %.1f,\n", *copy)
        << absl::StrFormat("  \"reference_gbps\": %.1f,\n", kReferenceGBps)
        << "  \"decode\": [\n    " << absl::StrJoin(decode_json, ",\n    ")
        << "\n  ],\n  \"prefill\": [\n    "
        << absl::StrJoin(prefill_json, ",\n    ")
        << "\n  ],\n  \"wide_head\": [\n    "
        << absl::StrJoin(wide_json, ",\n    ") << "\n  ]\n}\n";
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", args.json_path.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace attention

int main(int argc, char** argv) {
  return attention::Run(attention::ParseArgs(argc, argv));
}
