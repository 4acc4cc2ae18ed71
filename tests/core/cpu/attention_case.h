// Test helpers for the CPU backend: one attention problem over random
// tensors (contiguous or written into paged blocks), with its outputs, and
// comparisons against the double-precision reference or bitwise.
#ifndef ATTENTION_TESTS_CORE_CPU_ATTENTION_CASE_H_
#define ATTENTION_TESTS_CORE_CPU_ATTENTION_CASE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/attention_problem.h"
#include "core/cpu/cpu_backend.h"
#include "core/dtype.h"
#include "core/kv_view.h"
#include "core/tensor.h"
#include "gtest/gtest.h"
#include "tests/core/reference_attention.h"

namespace attention::testing {

inline constexpr float kInfinity = std::numeric_limits<float>::infinity();

// Tensor bytes in some dtype plus the exact stored values as floats.
struct Stored {
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<std::byte> bytes;
  std::vector<float> values;

  TensorView view() const {
    TensorView v;
    v.dtype = dtype;
    v.shape = shape;
    v.data = bytes.data();
    v.size_bytes = static_cast<int64_t>(bytes.size());
    return v;
  }
};

inline Stored Store(DType dtype, Shape shape, const std::vector<float>& raw) {
  Stored s;
  s.dtype = dtype;
  s.shape = std::move(shape);
  const int64_t n = NumElements(s.shape);
  EXPECT_EQ(n, static_cast<int64_t>(raw.size()));
  s.bytes.resize(n * DTypeSize(dtype));
  ConvertFromFloat(raw.data(), n, dtype, s.bytes.data());
  s.values.resize(n);
  ConvertToFloat(dtype, s.bytes.data(), n, s.values.data());
  return s;
}

inline std::vector<float> Normal(int64_t n, std::mt19937& rng,
                                 float stddev = 1.0f) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng);
  return out;
}

struct Config {
  int64_t num_queries = 8;
  int num_heads = 4;
  int num_kv_heads = 2;
  int head_dim = 16;
  int value_dim = 16;
  int64_t num_keys = -1;  // -1: query_start + num_queries
  DType q_dtype = DType::kFloat32;
  DType kv_dtype = DType::kFloat32;
  MaskSpec mask;
  std::vector<float> sink_logits;
  float scale = 0.0f;  // 0: 1/sqrt(head_dim)
  int bias_rank = 0;
  double masked_bias_fraction = 0.0;  // share of -inf bias entries
  EmptyRowPolicy policy = EmptyRowPolicy::kError;
  bool want_weights = false;
  uint32_t seed = 7;
};

// One attention problem over a contiguous KV view, with its outputs.
// Not movable: the problem points into it.
class Case {
 public:
  explicit Case(const Config& config) : config_(config) {
    std::mt19937 rng(config.seed);
    if (config_.num_keys < 0) {
      config_.num_keys = config_.mask.query_start + config_.num_queries;
    }
    if (config_.scale == 0.0f) {
      config_.scale = 1.0f / std::sqrt(static_cast<float>(config_.head_dim));
    }
    const Config& c = config_;
    q = Store(c.q_dtype, {c.num_queries, c.num_heads, c.head_dim},
              Normal(c.num_queries * c.num_heads * c.head_dim, rng));
    k = Store(c.kv_dtype, {c.num_keys, c.num_kv_heads, c.head_dim},
              Normal(c.num_keys * c.num_kv_heads * c.head_dim, rng));
    v = Store(c.kv_dtype, {c.num_keys, c.num_kv_heads, c.value_dim},
              Normal(c.num_keys * c.num_kv_heads * c.value_dim, rng));
    if (c.bias_rank > 0) {
      Shape shape = {c.num_queries, c.num_keys};
      if (c.bias_rank == 3) shape.insert(shape.begin(), c.num_heads);
      std::vector<float> raw = Normal(NumElements(shape), rng, 0.5f);
      std::uniform_real_distribution<double> uniform(0.0, 1.0);
      for (float& x : raw) {
        if (uniform(rng) < c.masked_bias_fraction) x = -kInfinity;
      }
      bias = Store(DType::kFloat32, shape, raw);
    }
    ResetOutputs();
  }
  Case(const Case&) = delete;
  Case& operator=(const Case&) = delete;

  const Config& config() const { return config_; }

  void ResetOutputs() {
    const Config& c = config_;
    // Poison the outputs so a value the backend forgets to write shows up.
    output.assign(c.num_queries * c.num_heads * c.value_dim, 12345.0f);
    lse.assign(c.num_queries * c.num_heads, 12345.0f);
    if (c.want_weights) {
      weights.assign(c.num_heads * c.num_queries * c.num_keys, 12345.0f);
    }
  }

  // The problem over the contiguous K/V tensors.
  AttentionProblem Problem() {
    k_view = k.view();
    v_view = v.view();
    AttentionProblem p = BaseProblem();
    p.kv = ContiguousKvView(k_view, v_view, block_storage);
    return p;
  }

  // The problem with an explicit KV view (e.g. paged).
  AttentionProblem ProblemWith(const KvView& kv) {
    AttentionProblem p = BaseProblem();
    p.kv = kv;
    return p;
  }

  ReferenceInputs ReferenceIn() const {
    const Config& c = config_;
    ReferenceInputs in;
    in.num_queries = c.num_queries;
    in.num_heads = c.num_heads;
    in.num_kv_heads = c.num_kv_heads;
    in.head_dim = c.head_dim;
    in.value_dim = c.value_dim;
    in.num_keys = c.num_keys;
    in.q = q.values;
    in.k = k.values;
    in.v = v.values;
    in.mask = c.mask;
    in.sink_logits = c.sink_logits;
    in.scale = c.scale;
    in.bias_rank = c.bias_rank;
    in.bias = bias.values;
    in.empty_row_policy = c.policy;
    return in;
  }

  Stored q, k, v, bias;
  std::vector<float> output, lse, weights;

 private:
  AttentionProblem BaseProblem() {
    const Config& c = config_;
    q_view = q.view();
    bias_view = bias.view();
    AttentionProblem p;
    p.q = q_view;
    p.mask = c.mask;
    p.sink_logits = c.sink_logits;
    p.scale = c.scale;
    p.bias = c.bias_rank > 0 ? &bias_view : nullptr;
    p.empty_row_policy = c.policy;
    p.output = output.data();
    p.lse = lse.data();
    p.weights = c.want_weights ? weights.data() : nullptr;
    return p;
  }

  Config config_;
  TensorView q_view, k_view, v_view, bias_view;
  const std::byte* block_storage[2] = {nullptr, nullptr};
};

inline void ExpectClose(const std::vector<float>& got,
                        const std::vector<double>& want, double tolerance,
                        const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool ok =
        (std::isinf(want[i]) && got[i] == want[i]) ||
        std::abs(got[i] - want[i]) <= tolerance * (1.0 + std::abs(want[i]));
    if (!ok && reported++ < 5) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", want "
                    << want[i];
    }
  }
}

inline void ExpectBitwiseEqual(const std::vector<float>& a,
                               const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  if (a.empty()) return;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
      << what << " differs bitwise";
}

// Runs `c` on `backend` and checks output, lse and (if wanted) weights
// against the double-precision reference.
inline void CheckAgainstReference(CpuBackend& backend, Case& c,
                                  double tolerance = 2e-5) {
  const AttentionProblem problem = c.Problem();
  ASSERT_TRUE(backend.Attend({&problem, 1}).ok());
  absl::StatusOr<ReferenceOutputs> want = ReferenceAttention(c.ReferenceIn());
  ASSERT_TRUE(want.ok()) << want.status();
  ExpectClose(c.output, want->output, tolerance, "output");
  ExpectClose(c.lse, want->lse, tolerance, "lse");
  if (c.config().want_weights) {
    ExpectClose(c.weights, want->weights, tolerance, "weights");
  }
}

// The keys and values of a Case written by the backend into paged blocks.
struct PagedKv {
  std::unique_ptr<DeviceArena> arena;
  KvBlockLayout layout;
  std::vector<std::byte*> blocks;
  std::vector<const std::byte*> k_blocks;
  std::vector<const std::byte*> v_blocks;

  KvView view(int64_t length) const {
    return PagedKvView(layout, length, k_blocks, v_blocks);
  }
};

inline PagedKv WritePaged(CpuBackend& backend, const Case& c,
                          int64_t tokens_per_block, int64_t write_chunk) {
  const Config& config = c.config();
  PagedKv paged;
  paged.layout.dtype = config.kv_dtype;
  paged.layout.num_kv_heads = config.num_kv_heads;
  paged.layout.head_dim = config.head_dim;
  paged.layout.value_dim = config.value_dim;
  paged.layout.tokens_per_block = tokens_per_block;
  const int64_t num_blocks =
      (config.num_keys + tokens_per_block - 1) / tokens_per_block;
  // Spread blocks out (reverse order, a gap between them) like a pool would.
  const int64_t stride = paged.layout.used_bytes() + 64;
  auto arena = backend.AllocateArena(num_blocks * stride);
  EXPECT_TRUE(arena.ok());
  paged.arena = *std::move(arena);
  for (int64_t b = 0; b < num_blocks; ++b) {
    paged.blocks.push_back(paged.arena->data() + (num_blocks - 1 - b) * stride);
  }
  for (int64_t start = 0; start < config.num_keys; start += write_chunk) {
    const int64_t end = std::min(config.num_keys, start + write_chunk);
    KvWrite write;
    write.layout = paged.layout;
    write.start = start;
    // k/v rows [start, end), in the case's own dtype.
    write.k = c.k.view();
    write.k.shape[0] = end - start;
    write.k.data += start * config.num_kv_heads * config.head_dim *
                    DTypeSize(config.kv_dtype);
    write.v = c.v.view();
    write.v.shape[0] = end - start;
    write.v.data += start * config.num_kv_heads * config.value_dim *
                    DTypeSize(config.kv_dtype);
    write.blocks = paged.blocks;
    EXPECT_TRUE(backend.WriteKv(write).ok());
  }
  for (std::byte* block : paged.blocks) {
    paged.k_blocks.push_back(block);
    paged.v_blocks.push_back(block + paged.layout.value_offset_bytes());
  }
  return paged;
}

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_CORE_CPU_ATTENTION_CASE_H_
