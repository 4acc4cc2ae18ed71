// GPU tests of CudaBackend (CTest label `gpu`). Every test skips when the
// machine has no CUDA device, and fails when one exists that the backend
// cannot use. The CPU backend is the oracle: fp32 results must agree within
// 1e-5 (relative, floor 1), fp16/bf16 KV storage within a few units of their
// rounding. On the GPU itself results must be bitwise
// reproducible: decode == prefill == chunked prefill, independent of the
// batch and of concurrent callers.
#include "core/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/cpu/cpu_backend.h"
#include "core/cuda/cuda_backend_factory.h"
#include "core/cuda/device_probe.h"
#include "core/engine.h"
#include "core/kv_view.h"
#include "core/status_macros.h"
#include "gtest/gtest.h"
#include "tests/core/logit_overflow_cases.h"
#include "tests/core/test_tensors.h"

namespace attention {
namespace {

using testing::HostTensor;
using testing::RandomTensor;
using testing::ToFloats;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Tolerance (relative, with a floor of 1) of GPU vs CPU results by KV dtype:
// fp32 1e-5; half types a few units of their rounding (the tensor-core path
// feeds P to the MMA in the KV dtype).
double Tolerance(DType kv_dtype) {
  switch (kv_dtype) {
    case DType::kFloat32:
      return 1e-5;
    case DType::kFloat16:
      return 4.0 / 2048;  // 4 ulp(1) of fp16
    case DType::kBFloat16:
      return 4.0 / 256;  // 4 ulp(1) of bf16
  }
  return 0.0;
}

// A KV cache living in one backend's arena: blocks in reversed physical
// order (so the block table matters), written in two WriteKv calls.
struct PagedKv {
  std::unique_ptr<DeviceArena> arena;
  KvBlockLayout layout;
  int64_t block_bytes = 0;
  std::vector<std::byte*> blocks;
  std::vector<const std::byte*> k_ptrs;
  std::vector<const std::byte*> v_ptrs;

  KvView View(int64_t length) const {
    return PagedKvView(layout, length, k_ptrs, v_ptrs);
  }
  // The arena holds one spare block after the used ones.
  std::byte* spare() const {
    return arena->data() + static_cast<int64_t>(blocks.size()) * block_bytes;
  }
};

std::unique_ptr<PagedKv> MakePagedKv(AttentionBackend& backend, DType dtype,
                                     const HostTensor& k, const HostTensor& v,
                                     int64_t tokens_per_block) {
  auto kv = std::make_unique<PagedKv>();
  kv->layout.dtype = dtype;
  kv->layout.num_kv_heads = static_cast<int>(k.shape[1]);
  kv->layout.head_dim = static_cast<int>(k.shape[2]);
  kv->layout.value_dim = static_cast<int>(v.shape[2]);
  kv->layout.tokens_per_block = tokens_per_block;
  const int64_t tokens = k.shape[0];
  const int64_t num_blocks = (tokens + tokens_per_block - 1) / tokens_per_block;
  kv->block_bytes = (kv->layout.used_bytes() + 255) / 256 * 256;
  absl::StatusOr<std::unique_ptr<DeviceArena>> arena =
      backend.AllocateArena(kv->block_bytes * (num_blocks + 1));
  if (!arena.ok()) {
    ADD_FAILURE() << "AllocateArena: " << arena.status();
    return nullptr;
  }
  kv->arena = *std::move(arena);
  for (int64_t b = 0; b < num_blocks; ++b) {
    std::byte* base =
        kv->arena->data() + (num_blocks - 1 - b) * kv->block_bytes;
    kv->blocks.push_back(base);
    kv->k_ptrs.push_back(base);
    kv->v_ptrs.push_back(base + kv->layout.value_offset_bytes());
  }
  const int64_t split = std::max<int64_t>(1, tokens / 3);
  for (const auto& [begin, end] :
       {std::pair<int64_t, int64_t>{0, split}, {split, tokens}}) {
    if (begin >= end) continue;
    KvWrite write;
    write.layout = kv->layout;
    write.start = begin;
    write.k = k.rows(begin, end);
    write.v = v.rows(begin, end);
    write.blocks = kv->blocks;
    const absl::Status status = backend.WriteKv(write);
    if (!status.ok()) {
      ADD_FAILURE() << "WriteKv: " << status;
      return nullptr;
    }
  }
  return kv;
}

// The query side of a problem and its outputs.
struct Query {
  TensorView q;
  MaskSpec mask;
  std::vector<float> sinks;
  float scale = 0.125f;
  const TensorView* bias = nullptr;
  EmptyRowPolicy policy = EmptyRowPolicy::kError;
  bool weights = false;
};

struct Outputs {
  std::vector<float> out;
  std::vector<float> lse;
  std::vector<float> weights;
};

// NaN-filled outputs, so an element a backend forgets to write fails.
AttentionProblem MakeProblem(const Query& query, const KvView& kv,
                             Outputs* outputs) {
  const int64_t tokens = query.q.dim(0);
  const int64_t heads = query.q.dim(1);
  outputs->out.assign(tokens * heads * kv.value_dim, kNaN);
  outputs->lse.assign(tokens * heads, kNaN);
  outputs->weights.assign(query.weights ? heads * tokens * kv.length : 0, kNaN);
  AttentionProblem problem;
  problem.q = query.q;
  problem.kv = kv;
  problem.mask = query.mask;
  problem.sink_logits = query.sinks;
  problem.scale = query.scale;
  problem.bias = query.bias;
  problem.empty_row_policy = query.policy;
  problem.output = outputs->out.data();
  problem.lse = outputs->lse.data();
  problem.weights = query.weights ? outputs->weights.data() : nullptr;
  return problem;
}

absl::Status AttendOne(AttentionBackend& backend, const Query& query,
                       const KvView& kv, Outputs* outputs) {
  const AttentionProblem problem = MakeProblem(query, kv, outputs);
  return backend.Attend(absl::MakeConstSpan(&problem, 1));
}

// |gpu - cpu| <= tolerance * max(1, |cpu|) elementwise; equal infinities
// match.
void ExpectClose(const std::vector<float>& gpu, const std::vector<float>& cpu,
                 double tolerance, const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  int64_t bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (std::isinf(cpu[i]) && gpu[i] == cpu[i]) continue;
    const double diff = std::fabs(static_cast<double>(gpu[i]) - cpu[i]);
    const double limit =
        tolerance * std::max(1.0, std::fabs(static_cast<double>(cpu[i])));
    if (!(diff <= limit)) {
      if (bad < 5) {
        ADD_FAILURE() << what << "[" << i << "]: gpu " << gpu[i] << " cpu "
                      << cpu[i];
      }
      ++bad;
    }
    if (diff > worst) worst = diff;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << gpu.size()
                    << " elements differ; worst |diff| " << worst;
}

// Bitwise equality of `count` floats.
void ExpectBitwise(const float* a, const float* b, size_t count,
                   const std::string& what) {
  if (std::memcmp(a, b, count * sizeof(float)) == 0) return;
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(a + i, b + i, sizeof(float)) != 0) {
      ADD_FAILURE() << what << ": first difference at " << i << ": " << a[i]
                    << " vs " << b[i];
      return;
    }
  }
}

// A smaller scratch budget than the default (made again for every test):
// ample for these tests' calls.
CudaBackendOptions FixtureOptions() {
  CudaBackendOptions options;
  options.max_streams = 4;
  options.scratch_bytes_per_stream = int64_t{128} << 20;
  options.pinned_bytes_per_stream = int64_t{64} << 20;
  return options;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<CudaBackend>> backend =
        CudaBackend::Create(FixtureOptions());
    if (!backend.ok()) {
      // A device the backend cannot use (no kernels for its architecture,
      // a driver too old for the runtime) is a failure; only a machine
      // without a device skips.
      if (cuda::ProbeDevices().device_present) {
        FAIL() << "a CUDA device exists but the backend cannot use it: "
               << backend.status();
      }
      GTEST_SKIP() << backend.status();
    }
    gpu_ = *std::move(backend);
    cpu_ = std::make_unique<CpuBackend>(2);
  }

  std::unique_ptr<CudaBackend> gpu_;
  std::unique_ptr<CpuBackend> cpu_;
};

// With a device: CreateSession through the engine is FAILED_PRECONDITION
// and leaves no session behind.
TEST_F(CudaBackendTest, EngineRefusesLatentSessionsAtCreateSession) {
  EngineOptions options;
  options.kv_cache_bytes = 1 << 20;
  options.kv_block_bytes = 4096;
  auto engine = AttentionEngine::Create(std::move(gpu_), options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  SessionSpec latent;
  latent.num_layers = 1;
  latent.num_q_heads = 4;
  latent.num_kv_heads = 1;
  latent.head_dim = 24;
  latent.value_dim = 16;
  latent.kv_layout = KvLayout::kSharedLatent;
  latent.scale = 0.25f;
  auto session = (*engine)->CreateSession(latent, absl::ZeroDuration());
  EXPECT_EQ(session.status().code(), absl::StatusCode::kFailedPrecondition)
      << session.status();
  EXPECT_EQ((*engine)->stats().active_sessions, 0);
}

// Runs on every machine: either a working backend or UNAVAILABLE with a
// reason the server can log.
TEST(CudaBackendFactoryTest, CreatesBackendOrExplainsWhyNot) {
  absl::StatusOr<std::unique_ptr<AttentionBackend>> backend =
      CreateCudaBackend();
  if (backend.ok()) {
    EXPECT_EQ((*backend)->name(), "cuda");
    EXPECT_NE((*backend)->device().find("sm_"), std::string::npos)
        << (*backend)->device();
  } else {
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kUnavailable)
        << backend.status();
    EXPECT_FALSE(backend.status().message().empty());
    EXPECT_FALSE(cuda::ProbeDevices().device_present)
        << "a CUDA device exists but the backend cannot use it: "
        << backend.status();
  }
}

TEST_F(CudaBackendTest, DescribesTheDevice) {
  EXPECT_EQ(gpu_->name(), "cuda");
  EXPECT_NE(gpu_->device().find("sm_"), std::string::npos) << gpu_->device();
  EXPECT_GT(gpu_->num_sms(), 0);
  absl::StatusOr<int64_t> free_bytes = gpu_->FreeMemoryBytes();
  ASSERT_TRUE(free_bytes.ok()) << free_bytes.status();
  EXPECT_GT(*free_bytes, 0);
}

// One paged configuration compared with the CPU backend.
struct PagedCase {
  std::string name;
  DType kv_dtype = DType::kFloat32;
  DType q_dtype = DType::kFloat32;
  int heads = 8;
  int kv_heads = 2;
  int head_dim = 64;
  int value_dim = 64;
  int64_t length = 1300;
  int64_t queries = 37;  // the last `queries` positions
  int64_t tokens_per_block = 48;
  int32_t window = 0;
  int32_t sink_tokens = 0;
  bool sink_logits = false;
};

void PrintTo(const PagedCase& c, std::ostream* os) { *os << c.name; }

class PagedMatchesCpuTest : public CudaBackendTest,
                            public ::testing::WithParamInterface<PagedCase> {};

TEST_P(PagedMatchesCpuTest, OutputAndLseMatchCpu) {
  const PagedCase& c = GetParam();
  std::mt19937 rng(1234);
  const HostTensor k =
      RandomTensor({c.length, c.kv_heads, c.head_dim}, rng, c.kv_dtype);
  const HostTensor v =
      RandomTensor({c.length, c.kv_heads, c.value_dim}, rng, c.kv_dtype);
  const HostTensor q =
      RandomTensor({c.queries, c.heads, c.head_dim}, rng, c.q_dtype);
  auto gpu_kv = MakePagedKv(*gpu_, c.kv_dtype, k, v, c.tokens_per_block);
  auto cpu_kv = MakePagedKv(*cpu_, c.kv_dtype, k, v, c.tokens_per_block);
  ASSERT_NE(gpu_kv, nullptr);
  ASSERT_NE(cpu_kv, nullptr);

  Query query;
  query.q = q.view();
  query.mask.causal = true;
  query.mask.window = c.window;
  query.mask.num_sink_tokens = c.sink_tokens;
  query.mask.query_start = c.length - c.queries;
  query.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  if (c.sink_logits) {
    for (int h = 0; h < c.heads; ++h)
      query.sinks.push_back(0.25f * (h % 5) - 0.5f);
  }
  Outputs gpu_out;
  Outputs cpu_out;
  ASSERT_TRUE(AttendOne(*gpu_, query, gpu_kv->View(c.length), &gpu_out).ok());
  ASSERT_TRUE(AttendOne(*cpu_, query, cpu_kv->View(c.length), &cpu_out).ok());
  ExpectClose(gpu_out.out, cpu_out.out, Tolerance(c.kv_dtype), "output");
  ExpectClose(gpu_out.lse, cpu_out.lse, Tolerance(c.kv_dtype), "lse");
}

PagedCase Case(std::string name, DType kv, DType q) {
  PagedCase c;
  c.name = std::move(name);
  c.kv_dtype = kv;
  c.q_dtype = q;
  return c;
}

std::vector<PagedCase> PagedCases() {
  std::vector<PagedCase> cases;
  for (DType kv : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const std::string d(DTypeName(kv));
    cases.push_back(Case(d + "_full", kv, DType::kFloat32));
    cases.push_back(Case(d + "_q_same_dtype", kv, kv));
    PagedCase window = Case(d + "_window_sinks", kv, DType::kFloat32);
    window.window = 100;
    window.sink_tokens = 4;
    window.sink_logits = true;
    cases.push_back(window);
    PagedCase decode = Case(d + "_decode_mha", kv, DType::kFloat32);
    decode.heads = 4;
    decode.kv_heads = 4;
    decode.queries = 1;
    decode.length = 2100;
    cases.push_back(decode);
    PagedCase gqa8 = Case(d + "_gqa8_dim128", kv, DType::kBFloat16);
    gqa8.heads = 16;
    gqa8.kv_heads = 2;
    gqa8.head_dim = 128;
    gqa8.value_dim = 128;
    gqa8.queries = 70;
    cases.push_back(gqa8);
    PagedCase odd = Case(d + "_odd_dims", kv, DType::kFloat32);
    odd.head_dim = 20;
    odd.value_dim = 12;
    odd.tokens_per_block = 7;
    cases.push_back(odd);
    PagedCase padded = Case(d + "_dims_72_40", kv, DType::kFloat16);
    padded.head_dim = 72;
    padded.value_dim = 40;
    cases.push_back(padded);
    PagedCase large = Case(d + "_dim256", kv, DType::kFloat32);
    large.head_dim = 256;
    large.value_dim = 256;
    large.length = 700;
    large.queries = 20;
    cases.push_back(large);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, PagedMatchesCpuTest,
                         ::testing::ValuesIn(PagedCases()),
                         [](const ::testing::TestParamInfo<PagedCase>& info) {
                           return info.param.name;
                         });

// Decode (T = 1 per call, batched), chunked prefill and one full prefill of
// the same tokens give bitwise identical rows on the GPU.
struct BitwiseCase {
  std::string name;
  DType kv_dtype;
  DType q_dtype;
  int32_t window;
};

void PrintTo(const BitwiseCase& c, std::ostream* os) { *os << c.name; }

class DecodeEqualsPrefillTest
    : public CudaBackendTest,
      public ::testing::WithParamInterface<BitwiseCase> {};

TEST_P(DecodeEqualsPrefillTest, Bitwise) {
  const BitwiseCase& c = GetParam();
  constexpr int kHeads = 8;
  constexpr int kKvHeads = 2;
  constexpr int kDim = 64;
  constexpr int64_t kLength = 2048;  // 4 chunks; many row blocks
  std::mt19937 rng(99);
  const HostTensor k = RandomTensor({kLength, kKvHeads, kDim}, rng, c.kv_dtype);
  const HostTensor v = RandomTensor({kLength, kKvHeads, kDim}, rng, c.kv_dtype);
  const HostTensor q = RandomTensor({kLength, kHeads, kDim}, rng, c.q_dtype);
  auto kv = MakePagedKv(*gpu_, c.kv_dtype, k, v, /*tokens_per_block=*/48);
  ASSERT_NE(kv, nullptr);

  Query base;
  base.mask.causal = true;
  base.mask.window = c.window;
  base.mask.num_sink_tokens = c.window > 0 ? 4 : 0;
  if (c.window > 0)
    base.sinks = {0.5f, -1.0f, 2.0f, 0.0f, 1.0f, -0.5f, 0.0f, 3.0f};

  Query full = base;
  full.q = q.view();
  Outputs full_out;
  ASSERT_TRUE(AttendOne(*gpu_, full, kv->View(kLength), &full_out).ok());
  const size_t row_floats = kHeads * kDim;

  // Chunked prefill: positions [1348, 2048).
  Query chunk = base;
  chunk.q = q.rows(1348, kLength);
  chunk.mask.query_start = 1348;
  Outputs chunk_out;
  ASSERT_TRUE(AttendOne(*gpu_, chunk, kv->View(kLength), &chunk_out).ok());
  ExpectBitwise(chunk_out.out.data(), full_out.out.data() + 1348 * row_floats,
                chunk_out.out.size(), "chunked prefill output");
  ExpectBitwise(chunk_out.lse.data(), full_out.lse.data() + 1348 * kHeads,
                chunk_out.lse.size(), "chunked prefill lse");

  // Decode steps, all in one ragged batch.
  const std::vector<int64_t> positions = {0,   1,   31,   32,   511, 512,
                                          513, 999, 1347, 1500, 2047};
  std::vector<Query> steps(positions.size(), base);
  std::vector<Outputs> step_out(positions.size());
  std::vector<AttentionProblem> problems;
  for (size_t i = 0; i < positions.size(); ++i) {
    steps[i].q = q.rows(positions[i], positions[i] + 1);
    steps[i].mask.query_start = positions[i];
    problems.push_back(
        MakeProblem(steps[i], kv->View(positions[i] + 1), &step_out[i]));
  }
  ASSERT_TRUE(gpu_->Attend(problems).ok());
  for (size_t i = 0; i < positions.size(); ++i) {
    const std::string what = absl::StrCat("decode at ", positions[i]);
    ExpectBitwise(step_out[i].out.data(),
                  full_out.out.data() + positions[i] * row_floats, row_floats,
                  what + " output");
    ExpectBitwise(step_out[i].lse.data(),
                  full_out.lse.data() + positions[i] * kHeads, kHeads,
                  what + " lse");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DecodeEqualsPrefillTest,
    ::testing::Values(
        BitwiseCase{"fp32", DType::kFloat32, DType::kFloat32, 0},
        BitwiseCase{"fp32_window", DType::kFloat32, DType::kFloat32, 300},
        BitwiseCase{"fp16", DType::kFloat16, DType::kFloat16, 0},
        BitwiseCase{"fp16_q_fp32", DType::kFloat16, DType::kFloat32, 0},
        BitwiseCase{"bf16", DType::kBFloat16, DType::kBFloat16, 0},
        BitwiseCase{"bf16_q_fp32_window", DType::kBFloat16, DType::kFloat32,
                    300}),
    [](const ::testing::TestParamInfo<BitwiseCase>& info) {
      return info.param.name;
    });

// A problem's result does not depend on what else is in the batch.
TEST_F(CudaBackendTest, BatchInvariance) {
  std::mt19937 rng(7);
  constexpr int64_t kLength = 1500;
  std::vector<std::unique_ptr<PagedKv>> caches;
  std::vector<HostTensor> queries;
  std::vector<Query> query_list;
  struct Spec {
    DType dtype;
    int heads, kv_heads, dim;
    int64_t queries;
  };
  const std::vector<Spec> specs = {{DType::kBFloat16, 8, 2, 64, 1},
                                   {DType::kFloat32, 4, 4, 32, 3},
                                   {DType::kFloat16, 8, 1, 128, 40},
                                   {DType::kBFloat16, 8, 2, 64, 200}};
  for (const Spec& s : specs) {
    const HostTensor k =
        RandomTensor({kLength, s.kv_heads, s.dim}, rng, s.dtype);
    const HostTensor v =
        RandomTensor({kLength, s.kv_heads, s.dim}, rng, s.dtype);
    caches.push_back(MakePagedKv(*gpu_, s.dtype, k, v, 64));
    ASSERT_NE(caches.back(), nullptr);
    queries.push_back(RandomTensor({s.queries, s.heads, s.dim}, rng));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    Query query;
    query.q = queries[i].view();
    query.mask.query_start = kLength - specs[i].queries;
    query_list.push_back(query);
  }
  // Each problem alone.
  std::vector<Outputs> alone(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    ASSERT_TRUE(
        AttendOne(*gpu_, query_list[i], caches[i]->View(kLength), &alone[i])
            .ok());
  }
  // All together, in reverse order, twice over.
  std::vector<Outputs> together(2 * specs.size());
  std::vector<AttentionProblem> problems;
  for (size_t r = 0; r < 2; ++r) {
    for (size_t j = 0; j < specs.size(); ++j) {
      const size_t i = specs.size() - 1 - j;
      problems.push_back(MakeProblem(query_list[i], caches[i]->View(kLength),
                                     &together[r * specs.size() + i]));
    }
  }
  ASSERT_TRUE(gpu_->Attend(problems).ok());
  for (size_t r = 0; r < 2; ++r) {
    for (size_t i = 0; i < specs.size(); ++i) {
      const Outputs& t = together[r * specs.size() + i];
      ExpectBitwise(t.out.data(), alone[i].out.data(), t.out.size(),
                    absl::StrCat("problem ", i, " output"));
      ExpectBitwise(t.lse.data(), alone[i].lse.data(), t.lse.size(),
                    absl::StrCat("problem ", i, " lse"));
    }
  }
}

// Stateless problems (host K/V): non-causal, bias with -inf, learned sinks,
// weights and lse, in each input dtype.
TEST_F(CudaBackendTest, StatelessMatchesCpu) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    std::mt19937 rng(5);
    constexpr int64_t kQueries = 19;
    constexpr int64_t kKeys = 600;
    const HostTensor q = RandomTensor({kQueries, 6, 32}, rng, dtype);
    const HostTensor k = RandomTensor({kKeys, 3, 32}, rng, dtype);
    const HostTensor v = RandomTensor({kKeys, 3, 24}, rng, dtype);
    HostTensor bias = RandomTensor({6, kQueries, kKeys}, rng);
    for (size_t i = 0; i < bias.values.size(); i += 7) {
      bias.values[i] = kNegInf;
    }
    std::memcpy(bias.bytes.data(), bias.values.data(), bias.bytes.size());
    const TensorView bias_view = bias.view();
    const std::byte* storage[2];
    const KvView kv = ContiguousKvView(k.view(), v.view(), storage);

    Query query;
    query.q = q.view();
    query.mask.causal = false;
    query.sinks = {0.0f, 1.0f, -2.0f, 0.5f, 0.25f, 3.0f};
    query.bias = &bias_view;
    query.weights = true;
    Outputs gpu_out;
    Outputs cpu_out;
    ASSERT_TRUE(AttendOne(*gpu_, query, kv, &gpu_out).ok());
    ASSERT_TRUE(AttendOne(*cpu_, query, kv, &cpu_out).ok());
    ExpectClose(gpu_out.out, cpu_out.out, Tolerance(dtype), "output");
    ExpectClose(gpu_out.lse, cpu_out.lse, Tolerance(dtype), "lse");
    ExpectClose(gpu_out.weights, cpu_out.weights, Tolerance(dtype), "weights");

    // Causal with query_start and a window, [T, T_k] bias.
    HostTensor bias2 = RandomTensor({kQueries, kKeys}, rng);
    const TensorView bias2_view = bias2.view();
    query.mask.causal = true;
    query.mask.query_start = 400;
    query.mask.window = 150;
    query.mask.num_sink_tokens = 2;
    query.bias = &bias2_view;
    query.sinks.clear();
    ASSERT_TRUE(AttendOne(*gpu_, query, kv, &gpu_out).ok());
    ASSERT_TRUE(AttendOne(*cpu_, query, kv, &cpu_out).ok());
    ExpectClose(gpu_out.out, cpu_out.out, Tolerance(dtype), "causal output");
    ExpectClose(gpu_out.weights, cpu_out.weights, Tolerance(dtype),
                "causal weights");
  }
}

TEST_F(CudaBackendTest, EmptyRowPolicies) {
  std::mt19937 rng(11);
  const HostTensor q = RandomTensor({4, 2, 16}, rng);
  const HostTensor k = RandomTensor({40, 1, 16}, rng);
  const HostTensor v = RandomTensor({40, 1, 16}, rng);
  // Row 2 sees nothing: its bias is -inf everywhere.
  std::vector<float> bias_values(4 * 40, 0.0f);
  std::fill(bias_values.begin() + 2 * 40, bias_values.begin() + 3 * 40,
            kNegInf);
  const TensorView bias = FloatView(bias_values, {4, 40});
  const std::byte* storage[2];
  const KvView kv = ContiguousKvView(k.view(), v.view(), storage);
  Query query;
  query.q = q.view();
  query.mask.causal = false;
  query.bias = &bias;
  query.weights = true;

  Outputs out;
  const absl::Status error = AttendOne(*gpu_, query, kv, &out);
  EXPECT_EQ(error.code(), absl::StatusCode::kInvalidArgument) << error;
  EXPECT_NE(error.message().find("row 2"), std::string::npos) << error;

  query.policy = EmptyRowPolicy::kZero;
  Outputs gpu_out;
  Outputs cpu_out;
  ASSERT_TRUE(AttendOne(*gpu_, query, kv, &gpu_out).ok());
  ASSERT_TRUE(AttendOne(*cpu_, query, kv, &cpu_out).ok());
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(gpu_out.lse[2 * 2 + h], kNegInf);
    for (int d = 0; d < 16; ++d) {
      EXPECT_EQ(gpu_out.out[(2 * 2 + h) * 16 + d], 0.0f);
    }
  }
  ExpectClose(gpu_out.out, cpu_out.out, 1e-5, "zero policy output");
  ExpectClose(gpu_out.weights, cpu_out.weights, 1e-5, "zero policy weights");

  // With learned sinks the empty row is zeros and lse = the sink logit.
  query.policy = EmptyRowPolicy::kError;
  query.sinks = {1.5f, -0.5f};
  ASSERT_TRUE(AttendOne(*gpu_, query, kv, &gpu_out).ok());
  EXPECT_EQ(gpu_out.lse[2 * 2 + 0], 1.5f);
  EXPECT_EQ(gpu_out.lse[2 * 2 + 1], -0.5f);
  EXPECT_EQ(gpu_out.out[(2 * 2) * 16], 0.0f);
}

// An overflowing logit is INVALID_ARGUMENT naming the row and head, and the
// backend keeps serving afterwards.
TEST_F(CudaBackendTest, OverflowIsInvalidArgumentAndBackendRecovers) {
  std::mt19937 rng(3);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    HostTensor k = RandomTensor({100, 2, 32}, rng, dtype);
    const HostTensor v = RandomTensor({100, 2, 32}, rng, dtype);
    auto kv = MakePagedKv(*gpu_, dtype, k, v, 32);
    ASSERT_NE(kv, nullptr);
    HostTensor q = RandomTensor({5, 4, 32}, rng);
    // Row 3 (position 98), head 1 (KV head 0): huge and aligned with the
    // signs of key 98, which it sees.
    for (int d = 0; d < 32; ++d) {
      const float key = k.values[(98 * 2 + 0) * 32 + d];
      q.values[(3 * 4 + 1) * 32 + d] = key >= 0 ? 3e37f : -3e37f;
    }
    std::memcpy(q.bytes.data(), q.values.data(), q.bytes.size());
    Query query;
    query.q = q.view();
    query.mask.query_start = 95;
    query.scale = 1.0f;
    Outputs out;
    const absl::Status status = AttendOne(*gpu_, query, kv->View(100), &out);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find("row 3"), std::string::npos) << status;
    EXPECT_NE(status.message().find("head 1"), std::string::npos) << status;

    // A normal call right after works and matches the CPU.
    const HostTensor good_q = RandomTensor({5, 4, 32}, rng);
    query.q = good_q.view();
    auto cpu_kv = MakePagedKv(*cpu_, dtype, k, v, 32);
    ASSERT_NE(cpu_kv, nullptr);
    Outputs gpu_out;
    Outputs cpu_out;
    ASSERT_TRUE(AttendOne(*gpu_, query, kv->View(100), &gpu_out).ok());
    ASSERT_TRUE(AttendOne(*cpu_, query, cpu_kv->View(100), &cpu_out).ok());
    ExpectClose(gpu_out.out, cpu_out.out, Tolerance(dtype), "after overflow");
  }
}

// Finite values whose weighted sum overflows float32 before the division:
// INVALID_ARGUMENT on both backends (2 keys of v = 3e38 sum to inf; 32 of
// them and a 33rd far ahead make 0 * inf = NaN), never an inf or NaN
// output.
TEST_F(CudaBackendTest, OverflowingValueSumsAreInvalidArgumentAsOnTheCpu) {
  std::mt19937 rng(1);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (int keys : {2, 33}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), ", ", keys, " keys"));
      std::vector<float> k(keys * 32, 0.0f), v(keys * 32, 1.0f);
      for (int j = 0; j < keys; ++j) v[j * 32] = 3e38f;
      std::vector<float> q(32, 0.0f);
      if (keys == 33) {
        q[0] = 10.0f;
        k[32 * 32] = 10.0f;  // logit 100
        v[32 * 32] = 1.0f;
      }
      HostTensor k_t = RandomTensor({keys, 1, 32}, rng, dtype);
      HostTensor v_t = k_t;
      ConvertFromFloat(k.data(), keys * 32, dtype, k_t.bytes.data());
      ConvertFromFloat(v.data(), keys * 32, dtype, v_t.bytes.data());
      ConvertToFloat(dtype, k_t.bytes.data(), keys * 32, k_t.values.data());
      ConvertToFloat(dtype, v_t.bytes.data(), keys * 32, v_t.values.data());
      const HostTensor q_t = testing::FloatTensor({1, 1, 32}, q);
      Query query;
      query.q = q_t.view();
      query.mask.query_start = keys - 1;
      query.scale = 1.0f;
      for (AttentionBackend* backend :
           std::vector<AttentionBackend*>{gpu_.get(), cpu_.get()}) {
        auto kv = MakePagedKv(*backend, dtype, k_t, v_t, 32);
        ASSERT_NE(kv, nullptr);
        Outputs out;
        const absl::Status status =
            AttendOne(*backend, query, kv->View(keys), &out);
        EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
            << backend->name() << ": " << status;
        EXPECT_NE(status.message().find("weighted sum of the values"),
                  std::string::npos)
            << status;
      }
    }
  }
}

// A float32 query element past bfloat16's largest finite value, over bf16
// KV, whose logit float32 still holds: served as on the CPU, not refused
// as an overflow (the tensor cores' bf16 copy of q would round it to inf).
TEST_F(CudaBackendTest, AQueryPastBFloat16sRangeIsNotAnOverflow) {
  std::mt19937 rng(4);
  constexpr int kKeys = 3;
  std::vector<float> k(kKeys * 32, 0.0f);
  k[0] = 0.5f;  // key 0: logit 3.4e38 * 0.5; keys 1 and 2: logit 0
  HostTensor k_t = RandomTensor({kKeys, 1, 32}, rng, DType::kBFloat16);
  const HostTensor v_t = RandomTensor({kKeys, 1, 32}, rng, DType::kBFloat16);
  ConvertFromFloat(k.data(), kKeys * 32, DType::kBFloat16, k_t.bytes.data());
  ConvertToFloat(DType::kBFloat16, k_t.bytes.data(), kKeys * 32,
                 k_t.values.data());
  std::vector<float> q(2 * 32, 0.0f);
  q[0] = 3.4e38f;  // row 0: past bf16's 3.3895e38; row 1: zeros
  const HostTensor q_t = testing::FloatTensor({2, 1, 32}, q);
  Query query;
  query.q = q_t.view();
  query.mask.query_start = kKeys - 2;
  query.scale = 1.0f;
  Outputs gpu_out;
  Outputs cpu_out;
  auto gpu_kv = MakePagedKv(*gpu_, DType::kBFloat16, k_t, v_t, 32);
  auto cpu_kv = MakePagedKv(*cpu_, DType::kBFloat16, k_t, v_t, 32);
  ASSERT_NE(gpu_kv, nullptr);
  ASSERT_NE(cpu_kv, nullptr);
  const absl::Status cpu_status =
      AttendOne(*cpu_, query, cpu_kv->View(kKeys), &cpu_out);
  ASSERT_TRUE(cpu_status.ok()) << cpu_status;
  const absl::Status gpu_status =
      AttendOne(*gpu_, query, gpu_kv->View(kKeys), &gpu_out);
  ASSERT_TRUE(gpu_status.ok()) << gpu_status;
  // Row 0 puts all its weight on key 0; its lse is that logit.
  for (int d = 0; d < 32; ++d) EXPECT_EQ(cpu_out.out[d], v_t.values[d]) << d;
  EXPECT_EQ(cpu_out.lse[0], 1.7e38f);
  ExpectClose(gpu_out.out, cpu_out.out, Tolerance(DType::kBFloat16), "out");
  ExpectClose(gpu_out.lse, cpu_out.lse, Tolerance(DType::kBFloat16), "lse");
}

// CUDA failures are statuses, never aborts, and the backend stays usable.
TEST_F(CudaBackendTest, DeviceErrorsAreStatuses) {
  const absl::StatusOr<std::unique_ptr<DeviceArena>> huge =
      gpu_->AllocateArena(int64_t{1} << 60);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted)
      << huge.status();
  EXPECT_FALSE(gpu_->AllocateArena(0).ok());

  std::vector<std::byte> host(1024);
  auto arena = gpu_->AllocateArena(4096);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ(gpu_->CopyBlock(host.data(), (*arena)->data(), 512).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      gpu_->CopyBlock((*arena)->data(), (*arena)->data() + 2048, 4096).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      gpu_->CopyBlock((*arena)->data(), (*arena)->data() + 2048, 2048).ok());

  // Attention still works.
  std::mt19937 rng(2);
  const HostTensor q = RandomTensor({3, 2, 16}, rng);
  const HostTensor k = RandomTensor({10, 2, 16}, rng);
  const HostTensor v = RandomTensor({10, 2, 16}, rng);
  const std::byte* storage[2];
  Query query;
  query.q = q.view();
  query.mask.causal = false;
  Outputs gpu_out;
  Outputs cpu_out;
  const KvView kv = ContiguousKvView(k.view(), v.view(), storage);
  ASSERT_TRUE(AttendOne(*gpu_, query, kv, &gpu_out).ok());
  ASSERT_TRUE(AttendOne(*cpu_, query, kv, &cpu_out).ok());
  ExpectClose(gpu_out.out, cpu_out.out, 1e-5, "output");
}

// Copy-on-write copies and dropped (null) window blocks.
TEST_F(CudaBackendTest, CopyBlockAndDroppedBlocks) {
  std::mt19937 rng(8);
  constexpr int64_t kLength = 900;
  const HostTensor k = RandomTensor({kLength, 2, 64}, rng, DType::kBFloat16);
  const HostTensor v = RandomTensor({kLength, 2, 64}, rng, DType::kBFloat16);
  const HostTensor q = RandomTensor({1, 4, 64}, rng);
  auto kv = MakePagedKv(*gpu_, DType::kBFloat16, k, v, 40);
  ASSERT_NE(kv, nullptr);
  Query query;
  query.q = q.view();
  query.mask.query_start = kLength - 1;
  query.mask.window = 128;
  query.mask.num_sink_tokens = 3;
  Outputs reference;
  ASSERT_TRUE(AttendOne(*gpu_, query, kv->View(kLength), &reference).ok());

  // Blocks no query can see are dropped (null in the table).
  PagedKv& cache = *kv;
  const std::vector<const std::byte*> k_all = cache.k_ptrs;
  const std::vector<const std::byte*> v_all = cache.v_ptrs;
  const int64_t first_needed = (kLength - 128) / 40;
  for (int64_t b = 1; b < first_needed; ++b) {
    cache.k_ptrs[b] = nullptr;
    cache.v_ptrs[b] = nullptr;
  }
  Outputs dropped;
  ASSERT_TRUE(AttendOne(*gpu_, query, cache.View(kLength), &dropped).ok());
  ExpectBitwise(dropped.out.data(), reference.out.data(), reference.out.size(),
                "dropped blocks");

  // The last block copied to the spare block reads the same.
  const int64_t last = static_cast<int64_t>(cache.blocks.size()) - 1;
  ASSERT_TRUE(
      gpu_->CopyBlock(cache.blocks[last], cache.spare(), cache.block_bytes)
          .ok());
  cache.k_ptrs = k_all;
  cache.v_ptrs = v_all;
  cache.k_ptrs[last] = cache.spare();
  cache.v_ptrs[last] = cache.spare() + cache.layout.value_offset_bytes();
  Outputs copied;
  ASSERT_TRUE(AttendOne(*gpu_, query, cache.View(kLength), &copied).ok());
  ExpectBitwise(copied.out.data(), reference.out.data(), reference.out.size(),
                "copied block");
}

// Many threads calling at once get exactly their single-threaded results.
TEST_F(CudaBackendTest, ConcurrentCallers) {
  std::mt19937 rng(21);
  constexpr int kThreads = 6;
  constexpr int64_t kLength = 1200;
  const HostTensor k = RandomTensor({kLength, 2, 64}, rng, DType::kFloat16);
  const HostTensor v = RandomTensor({kLength, 2, 64}, rng, DType::kFloat16);
  auto kv = MakePagedKv(*gpu_, DType::kFloat16, k, v, 64);
  ASSERT_NE(kv, nullptr);
  std::vector<HostTensor> queries;
  std::vector<Query> query_list(kThreads);
  std::vector<Outputs> expected(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    queries.push_back(RandomTensor({1 + 13 * t, 8, 64}, rng));
  }
  for (int t = 0; t < kThreads; ++t) {
    query_list[t].q = queries[t].view();
    query_list[t].mask.query_start = kLength - (1 + 13 * t);
    ASSERT_TRUE(
        AttendOne(*gpu_, query_list[t], kv->View(kLength), &expected[t]).ok());
  }
  std::vector<std::vector<Outputs>> got(kThreads, std::vector<Outputs>(5));
  std::vector<absl::Status> statuses(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 5; ++i) {
        absl::Status s =
            AttendOne(*gpu_, query_list[t], kv->View(kLength), &got[t][i]);
        if (!s.ok()) statuses[t] = s;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_TRUE(statuses[t].ok()) << statuses[t];
    for (int i = 0; i < 5; ++i) {
      ExpectBitwise(got[t][i].out.data(), expected[t].out.data(),
                    expected[t].out.size(), absl::StrCat("thread ", t));
    }
  }
}

// A session exported from the CPU engine imports into the GPU engine (a
// different block size) and back: outputs on the GPU agree within rounding,
// and back on the CPU the session continues bitwise like the original (the
// stored bits never change).
TEST_F(CudaBackendTest, SnapshotsMoveBetweenCpuAndGpuEngines) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> second =
      CudaBackend::Create(CudaBackendOptions());
  ASSERT_TRUE(second.ok()) << second.status();
  EngineOptions options;
  options.kv_block_bytes = 64 << 10;
  options.kv_cache_bytes = 64 * options.kv_block_bytes;
  options.sessions.reap_interval = absl::ZeroDuration();
  auto gpu_engine = AttentionEngine::Create(*std::move(second), options);
  options.kv_block_bytes = 16 << 10;
  auto cpu_engine =
      AttentionEngine::Create(std::make_unique<CpuBackend>(2), options);
  auto cpu_again =
      AttentionEngine::Create(std::make_unique<CpuBackend>(2), options);
  ASSERT_TRUE(gpu_engine.ok()) << gpu_engine.status();
  ASSERT_TRUE(cpu_engine.ok()) << cpu_engine.status();
  ASSERT_TRUE(cpu_again.ok()) << cpu_again.status();

  // Moves session `id` of `from` into `to`; returns the new id.
  auto move = [](AttentionEngine& from, const std::string& id,
                 AttentionEngine& to) -> absl::StatusOr<std::string> {
    ATTN_ASSIGN_OR_RETURN(std::unique_ptr<SessionExport> exported,
                          from.ExportSession(id));
    ATTN_ASSIGN_OR_RETURN(std::unique_ptr<SessionImport> imported,
                          to.BeginImport(exported->header(), {}));
    SnapshotChunk chunk;
    while (true) {
      ATTN_ASSIGN_OR_RETURN(bool more, exported->NextChunk(&chunk));
      if (!more) break;
      ATTN_RETURN_IF_ERROR(imported->AddChunk(chunk));
    }
    ATTN_ASSIGN_OR_RETURN(SessionInfo info,
                          imported->Finish(exported->trailer()));
    return info.session_id;
  };

  SessionSpec spec;
  spec.num_layers = 2;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.max_tokens = 100000;
  LayerSpec window;
  window.window = 50;
  window.num_sink_tokens = 2;
  spec.layers = {LayerSpec(), window};
  auto original = (*cpu_engine)->CreateSession(spec, absl::Minutes(5));
  ASSERT_TRUE(original.ok()) << original.status();
  std::mt19937 rng(23);
  const HostTensor q = RandomTensor({260, 4, 64}, rng);
  const HostTensor k = RandomTensor({260, 2, 64}, rng);
  const HostTensor v = RandomTensor({260, 2, 64}, rng);
  auto append = [&](AttentionEngine& engine, const std::string& id, int layer,
                    int64_t begin, int64_t end) {
    AppendRequest request;
    request.session_id = id;
    request.layer = layer;
    request.q = q.rows(begin, end);
    request.k = k.rows(begin, end);
    request.v = v.rows(begin, end);
    auto out = engine.Append(request);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? ToFloats(out->output) : std::vector<float>{};
  };
  for (int layer = 0; layer < 2; ++layer) {
    append(**cpu_engine, original->session_id, layer, 0, 200);
  }
  auto on_gpu = move(**cpu_engine, original->session_id, **gpu_engine);
  ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
  for (int layer = 0; layer < 2; ++layer) {
    ExpectClose(append(**gpu_engine, *on_gpu, layer, 200, 210),
                append(**cpu_engine, original->session_id, layer, 200, 210),
                1e-5, absl::StrCat("GPU after import, layer ", layer));
  }
  auto back = move(**gpu_engine, *on_gpu, **cpu_again);
  ASSERT_TRUE(back.ok()) << back.status();
  for (int layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(append(**cpu_again, *back, layer, 210, 260),
              append(**cpu_engine, original->session_id, layer, 210, 260))
        << "layer " << layer;
  }
}

// The whole engine on the GPU: sessions, chunked prefill, decode, fork
// (copy-on-write through CopyBlock), pool exhaustion; compared with the
// engine on the CPU.
TEST_F(CudaBackendTest, EngineMatchesCpuEngineAndReportsPoolExhaustion) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> second =
      CudaBackend::Create(CudaBackendOptions());
  ASSERT_TRUE(second.ok()) << second.status();
  EngineOptions options;
  options.kv_block_bytes = 64 << 10;
  options.kv_cache_bytes = 6 * options.kv_block_bytes;
  options.sessions.reap_interval = absl::ZeroDuration();
  auto gpu_engine = AttentionEngine::Create(*std::move(second), options);
  auto cpu_engine =
      AttentionEngine::Create(std::make_unique<CpuBackend>(2), options);
  ASSERT_TRUE(gpu_engine.ok()) << gpu_engine.status();
  ASSERT_TRUE(cpu_engine.ok()) << cpu_engine.status();

  SessionSpec spec;
  spec.num_layers = 2;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.kv_dtype = DType::kFloat32;
  spec.max_tokens = 100000;
  LayerSpec window;
  window.window = 50;
  window.num_sink_tokens = 2;
  spec.layers = {LayerSpec(), window};
  // fp32, 2 KV heads, dim 64: 1 KiB per token per layer, 64 tokens/block.
  auto gpu_session = (*gpu_engine)->CreateSession(spec, absl::Minutes(5));
  auto cpu_session = (*cpu_engine)->CreateSession(spec, absl::Minutes(5));
  ASSERT_TRUE(gpu_session.ok()) << gpu_session.status();
  ASSERT_TRUE(cpu_session.ok()) << cpu_session.status();

  std::mt19937 rng(17);
  auto append = [&](AttentionEngine& engine, const std::string& id, int layer,
                    const HostTensor& q, const HostTensor& k,
                    const HostTensor& v) {
    AppendRequest request;
    request.session_id = id;
    request.layer = layer;
    request.q = q.view();
    request.k = k.view();
    request.v = v.view();
    request.return_lse = true;
    return engine.Append(request);
  };
  for (int layer = 0; layer < 2; ++layer) {
    for (int64_t tokens : {70, 1, 1, 30}) {
      const HostTensor q = RandomTensor({tokens, 4, 64}, rng);
      const HostTensor k = RandomTensor({tokens, 2, 64}, rng);
      const HostTensor v = RandomTensor({tokens, 2, 64}, rng);
      auto g = append(**gpu_engine, gpu_session->session_id, layer, q, k, v);
      auto c = append(**cpu_engine, cpu_session->session_id, layer, q, k, v);
      ASSERT_TRUE(g.ok()) << g.status();
      ASSERT_TRUE(c.ok()) << c.status();
      ExpectClose(ToFloats(g->output), ToFloats(c->output), 1e-5,
                  absl::StrCat("layer ", layer, " append of ", tokens));
      ExpectClose(ToFloats(*g->lse), ToFloats(*c->lse), 1e-5, "lse");
    }
  }

  // Fork, then append to both: the shared partial block is copied on write.
  auto fork = (*gpu_engine)->ForkSession(gpu_session->session_id);
  ASSERT_TRUE(fork.ok()) << fork.status();
  const HostTensor q = RandomTensor({1, 4, 64}, rng);
  const HostTensor k1 = RandomTensor({1, 2, 64}, rng);
  const HostTensor v1 = RandomTensor({1, 2, 64}, rng);
  const HostTensor k2 = RandomTensor({1, 2, 64}, rng);
  const HostTensor v2 = RandomTensor({1, 2, 64}, rng);
  auto a = append(**gpu_engine, gpu_session->session_id, 0, q, k1, v1);
  auto b = append(**gpu_engine, fork->session_id, 0, q, k2, v2);
  auto c = append(**cpu_engine, cpu_session->session_id, 0, q, k1, v1);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ExpectClose(ToFloats(a->output), ToFloats(c->output), 1e-5, "after fork");
  EXPECT_NE(ToFloats(a->output), ToFloats(b->output));

  // Fill the pool: a prefill that does not fit is RESOURCE_EXHAUSTED and
  // changes nothing.
  auto before = (*gpu_engine)->GetSession(gpu_session->session_id);
  ASSERT_TRUE(before.ok());
  const HostTensor big_q = RandomTensor({400, 4, 64}, rng);
  const HostTensor big_k = RandomTensor({400, 2, 64}, rng);
  const HostTensor big_v = RandomTensor({400, 2, 64}, rng);
  auto full =
      append(**gpu_engine, gpu_session->session_id, 0, big_q, big_k, big_v);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted)
      << full.status();
  auto after = (*gpu_engine)->GetSession(gpu_session->session_id);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->layer_lengths, before->layer_lengths);
  // And the session still decodes, matching the CPU engine.
  const HostTensor k3 = RandomTensor({1, 2, 64}, rng);
  const HostTensor v3 = RandomTensor({1, 2, 64}, rng);
  auto g = append(**gpu_engine, gpu_session->session_id, 0, q, k3, v3);
  auto cc = append(**cpu_engine, cpu_session->session_id, 0, q, k3, v3);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE(cc.ok()) << cc.status();
  ExpectClose(ToFloats(g->output), ToFloats(cc->output), 1e-5,
              "decode after exhaustion");
}

// A CUDA backend with other options, or null (skipped) without a device.
std::unique_ptr<CudaBackend> MakeGpu(const CudaBackendOptions& options) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend =
      CudaBackend::Create(options);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? *std::move(backend) : nullptr;
}

// Issue 16 item 7: full (non-split) mode forced for fp16 and bf16 decode
// batches that would otherwise run split-KV: close to the CPU, and bitwise
// equal to split mode (and to split mode spread over several passes).
TEST_F(CudaBackendTest, ForcedFullModeAndPassesMatchCpuAndSplitMode) {
  CudaBackendOptions full_options = FixtureOptions();
  full_options.max_streams = 1;
  full_options.max_state_bytes = 0;
  std::unique_ptr<CudaBackend> full = MakeGpu(full_options);
  CudaBackendOptions pass_options = FixtureOptions();
  pass_options.max_streams = 1;
  pass_options.max_state_bytes = int64_t{96} << 10;  // a few blocks a pass
  std::unique_ptr<CudaBackend> passes = MakeGpu(pass_options);
  ASSERT_NE(full, nullptr);
  ASSERT_NE(passes, nullptr);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (DType q_dtype : {dtype, DType::kFloat32}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " q ", DTypeName(q_dtype)));
      std::mt19937 rng(77);
      constexpr int64_t kLength = 3000;
      const HostTensor k = RandomTensor({kLength, 2, 128}, rng, dtype);
      const HostTensor v = RandomTensor({kLength, 2, 128}, rng, dtype);
      const HostTensor q = RandomTensor({6, 16, 128}, rng, q_dtype);
      // All three GPU backends read the same arena: block pointers are
      // plain device addresses.
      auto gpu_kv = MakePagedKv(*gpu_, dtype, k, v, 64);
      auto full_kv = MakePagedKv(*full, dtype, k, v, 64);
      auto pass_kv = MakePagedKv(*passes, dtype, k, v, 64);
      auto cpu_kv = MakePagedKv(*cpu_, dtype, k, v, 64);
      ASSERT_TRUE(gpu_kv && full_kv && pass_kv && cpu_kv);
      // Six decode steps at different lengths, one batch.
      std::vector<Query> steps(6);
      std::vector<std::vector<Outputs>> out(4, std::vector<Outputs>(6));
      std::vector<std::vector<AttentionProblem>> problems(4);
      const PagedKv* kvs[4] = {gpu_kv.get(), full_kv.get(), pass_kv.get(),
                               cpu_kv.get()};
      for (int i = 0; i < 6; ++i) {
        const int64_t length = kLength - 400 * i;
        steps[i].q = q.rows(i, i + 1);
        steps[i].mask.query_start = length - 1;
        steps[i].scale = 0.088f;
        for (int b = 0; b < 4; ++b) {
          problems[b].push_back(
              MakeProblem(steps[i], kvs[b]->View(length), &out[b][i]));
        }
      }
      AttentionBackend* backends[4] = {gpu_.get(), full.get(), passes.get(),
                                       cpu_.get()};
      for (int b = 0; b < 4; ++b) {
        const absl::Status status = backends[b]->Attend(problems[b]);
        ASSERT_TRUE(status.ok()) << b << ": " << status;
      }
      for (int i = 0; i < 6; ++i) {
        for (int b = 1; b <= 2; ++b) {
          ExpectBitwise(out[b][i].out.data(), out[0][i].out.data(),
                        out[0][i].out.size(), b == 1 ? "full" : "passes");
          ExpectBitwise(out[b][i].lse.data(), out[0][i].lse.data(),
                        out[0][i].lse.size(), b == 1 ? "full lse" : "p lse");
        }
        ExpectClose(out[1][i].out, out[3][i].out, Tolerance(dtype),
                    "full mode vs cpu");
        ExpectClose(out[1][i].lse, out[3][i].lse, Tolerance(dtype),
                    "full mode lse vs cpu");
      }
    }
  }
}

// Issue 16 item 4: the logit-overflow rule, the same cases as on the CPU.
TEST_F(CudaBackendTest, LogitOverflowBoundariesMatchCpu) {
  for (const testing::LogitOverflowCase& c : testing::LogitOverflowCases()) {
    SCOPED_TRACE(c.name);
    std::vector<float> gpu_out;
    std::vector<float> cpu_out;
    float gpu_lse = 0.0f;
    float cpu_lse = 0.0f;
    const absl::Status g =
        testing::RunLogitOverflowCase(*gpu_, c, &gpu_out, &gpu_lse);
    const absl::Status k =
        testing::RunLogitOverflowCase(*cpu_, c, &cpu_out, &cpu_lse);
    EXPECT_EQ(g.code(), c.overflows ? absl::StatusCode::kInvalidArgument
                                    : absl::StatusCode::kOk)
        << g;
    EXPECT_EQ(g.code(), k.code()) << g << " vs " << k;
    if (g.ok() && k.ok()) {
      EXPECT_EQ(gpu_out, cpu_out);
      EXPECT_EQ(gpu_lse, cpu_lse);
    }
  }
}

// Issue 16 item 5: the first error in the order of attention_problem.h.
TEST_F(CudaBackendTest, ErrorOrderMatchesCpu) {
  std::mt19937 rng(12);
  // group 2: units of 16 tokens.
  const HostTensor k = RandomTensor({64, 1, 16}, rng);
  const HostTensor v = RandomTensor({64, 1, 16}, rng);
  const std::byte* storage[2];
  const KvView kv = ContiguousKvView(k.view(), v.view(), storage);
  struct OrderCase {
    int64_t empty_token;
    int64_t overflow_token;
    int overflow_head;
    std::string expected;  // "row N" of the reported error
  };
  for (const OrderCase& c :
       {OrderCase{0, 2, 1, "row 2"}, OrderCase{0, 20, 0, "row 0"},
        OrderCase{20, 5, 1, "row 5"}, OrderCase{3, 3, 0, "row 3"}}) {
    SCOPED_TRACE(c.expected);
    HostTensor q = RandomTensor({40, 2, 16}, rng);
    for (int d = 0; d < 16; ++d) {
      q.values[(c.overflow_token * 2 + c.overflow_head) * 16 + d] =
          k.values[d] >= 0 ? 1e38f : -1e38f;
    }
    std::memcpy(q.bytes.data(), q.values.data(), q.bytes.size());
    std::vector<float> bias_values(40 * 64, 0.0f);
    std::fill(bias_values.begin() + c.empty_token * 64,
              bias_values.begin() + (c.empty_token + 1) * 64, kNegInf);
    bias_values[c.empty_token * 64] = 0.0f;  // key 0 visible...
    if (c.empty_token != c.overflow_token) {
      bias_values[c.empty_token * 64] = kNegInf;  // ...unless only empty
    }
    const TensorView bias = FloatView(bias_values, {40, 64});
    Query query;
    query.q = q.view();
    query.mask.causal = false;
    query.scale = 1.0f;
    query.bias = &bias;
    Outputs out;
    const absl::Status g = AttendOne(*gpu_, query, kv, &out);
    const absl::Status cpu = AttendOne(*cpu_, query, kv, &out);
    EXPECT_EQ(g.code(), absl::StatusCode::kInvalidArgument) << g;
    EXPECT_EQ(cpu.code(), absl::StatusCode::kInvalidArgument) << cpu;
    EXPECT_NE(g.message().find(c.expected + " "), std::string::npos) << g;
    EXPECT_NE(cpu.message().find(c.expected + " "), std::string::npos) << cpu;
    const bool gpu_overflow = g.message().find("overflow") != std::string::npos;
    const bool cpu_overflow =
        cpu.message().find("overflow") != std::string::npos;
    EXPECT_EQ(gpu_overflow, cpu_overflow) << g << " vs " << cpu;
  }
}

// Issue 16 item 2: the scratch budget is reserved at start-up and reported;
// a call over it is refused up front; large KV writes go in pieces.
TEST_F(CudaBackendTest, ScratchBudget) {
  EXPECT_EQ(
      gpu_->scratch_bytes(),
      FixtureOptions().max_streams * FixtureOptions().scratch_bytes_per_stream);
  CudaBackendOptions options;
  options.max_streams = 2;
  options.scratch_bytes_per_stream = int64_t{1} << 20;
  options.pinned_bytes_per_stream = int64_t{1} << 20;
  std::unique_ptr<CudaBackend> small = MakeGpu(options);
  ASSERT_NE(small, nullptr);
  EXPECT_EQ(small->scratch_bytes(), int64_t{2} << 20);
  std::mt19937 rng(21);
  // 3000 tokens x 2 heads x 128 x 4 bytes x 2 = 6 MB: written in pieces.
  const HostTensor k = RandomTensor({3000, 2, 128}, rng);
  const HostTensor v = RandomTensor({3000, 2, 128}, rng);
  auto small_kv = MakePagedKv(*small, DType::kFloat32, k, v, 32);
  auto cpu_kv = MakePagedKv(*cpu_, DType::kFloat32, k, v, 32);
  ASSERT_TRUE(small_kv && cpu_kv);
  const HostTensor q = RandomTensor({1, 4, 128}, rng);
  Query query;
  query.q = q.view();
  query.mask.query_start = 2999;
  Outputs small_out;
  Outputs cpu_out;
  ASSERT_TRUE(AttendOne(*small, query, small_kv->View(3000), &small_out).ok());
  ASSERT_TRUE(AttendOne(*cpu_, query, cpu_kv->View(3000), &cpu_out).ok());
  ExpectClose(small_out.out, cpu_out.out, 1e-5, "after chunked WriteKv");
  // A stateless call whose keys alone exceed 1 MiB.
  const std::byte* storage[2];
  const KvView host_kv = ContiguousKvView(k.view(), v.view(), storage);
  query.mask.causal = false;
  query.mask.query_start = 0;
  const absl::Status refused = AttendOne(*small, query, host_kv, &small_out);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(small->failure().ok());
  // And the backend keeps serving.
  query.mask.causal = true;
  query.mask.query_start = 2999;
  EXPECT_TRUE(AttendOne(*small, query, small_kv->View(3000), &small_out).ok());
}

// Issue 16 item 6: fp16/bf16 with head dims above 128 (Gemma's 256, and 192)
// on the wide tensor-core kernel. Each case runs a prefill and a batch of
// decode steps, on the default backend (split-KV where the planner chooses
// it) and on one forced to full mode: both close to the CPU, bitwise equal
// to each other, and every decode step bitwise equal to its prefill row.
struct WideCase {
  std::string name;
  DType kv_dtype;
  DType q_dtype;  // != kv_dtype: q split into hi + lo
  int heads;
  int kv_heads;
  int head_dim;
  int value_dim;
  int32_t window;  // > 0: with 4 sink tokens and learned sink logits
};

void PrintTo(const WideCase& c, std::ostream* os) { *os << c.name; }

class WideHeadMatchesCpuTest : public CudaBackendTest,
                               public ::testing::WithParamInterface<WideCase> {
};

TEST_P(WideHeadMatchesCpuTest, PrefillAndDecodeInSplitAndFullMode) {
  const WideCase& c = GetParam();
  CudaBackendOptions full_options = FixtureOptions();
  full_options.max_streams = 1;
  full_options.max_state_bytes = 0;
  std::unique_ptr<CudaBackend> full = MakeGpu(full_options);
  ASSERT_NE(full, nullptr);
  constexpr int64_t kLength = 1400;  // 3 chunks of 512 keys
  constexpr int64_t kQueries = 70;   // prefill: the last 70 positions
  std::mt19937 rng(616);
  const HostTensor k =
      RandomTensor({kLength, c.kv_heads, c.head_dim}, rng, c.kv_dtype);
  const HostTensor v =
      RandomTensor({kLength, c.kv_heads, c.value_dim}, rng, c.kv_dtype);
  const HostTensor q =
      RandomTensor({kQueries, c.heads, c.head_dim}, rng, c.q_dtype);
  auto gpu_kv = MakePagedKv(*gpu_, c.kv_dtype, k, v, 40);
  auto full_kv = MakePagedKv(*full, c.kv_dtype, k, v, 40);
  auto cpu_kv = MakePagedKv(*cpu_, c.kv_dtype, k, v, 40);
  ASSERT_TRUE(gpu_kv && full_kv && cpu_kv);

  Query base;
  base.mask.causal = true;
  base.mask.window = c.window;
  base.mask.num_sink_tokens = c.window > 0 ? 4 : 0;
  base.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  if (c.window > 0) {
    for (int h = 0; h < c.heads; ++h) base.sinks.push_back(0.5f * (h % 4) - 1);
  }
  AttentionBackend* backends[3] = {gpu_.get(), full.get(), cpu_.get()};
  const PagedKv* kvs[3] = {gpu_kv.get(), full_kv.get(), cpu_kv.get()};
  const char* names[3] = {"gpu", "full", "cpu"};

  // Prefill of positions [kLength - kQueries, kLength).
  Query prefill = base;
  prefill.q = q.view();
  prefill.mask.query_start = kLength - kQueries;
  Outputs prefill_out[3];
  for (int b = 0; b < 3; ++b) {
    const absl::Status status =
        AttendOne(*backends[b], prefill, kvs[b]->View(kLength), &prefill_out[b]);
    ASSERT_TRUE(status.ok()) << names[b] << ": " << status;
  }
  // Decode steps at some of those positions, in one batch.
  const std::vector<int64_t> steps = {0, 1, 31, 32, 69};  // rows of q
  std::vector<Query> step_query(steps.size(), base);
  Outputs step_out[3][5];
  for (int b = 0; b < 3; ++b) {
    std::vector<AttentionProblem> problems;
    for (size_t i = 0; i < steps.size(); ++i) {
      const int64_t pos = kLength - kQueries + steps[i];
      step_query[i].q = q.rows(steps[i], steps[i] + 1);
      step_query[i].mask.query_start = pos;
      problems.push_back(MakeProblem(step_query[i], kvs[b]->View(pos + 1),
                                     &step_out[b][i]));
    }
    const absl::Status status = backends[b]->Attend(problems);
    ASSERT_TRUE(status.ok()) << names[b] << " decode: " << status;
  }

  const double tolerance = Tolerance(c.kv_dtype);
  for (int b = 0; b < 2; ++b) {
    ExpectClose(prefill_out[b].out, prefill_out[2].out, tolerance,
                absl::StrCat(names[b], " prefill output"));
    ExpectClose(prefill_out[b].lse, prefill_out[2].lse, tolerance,
                absl::StrCat(names[b], " prefill lse"));
  }
  ExpectBitwise(prefill_out[1].out.data(), prefill_out[0].out.data(),
                prefill_out[0].out.size(), "prefill: full vs default mode");
  const size_t row_floats = static_cast<size_t>(c.heads) * c.value_dim;
  for (size_t i = 0; i < steps.size(); ++i) {
    const std::string what = absl::StrCat("decode at row ", steps[i]);
    for (int b = 0; b < 2; ++b) {
      ExpectClose(step_out[b][i].out, step_out[2][i].out, tolerance,
                  absl::StrCat(names[b], " ", what));
      ExpectBitwise(step_out[b][i].out.data(),
                    prefill_out[0].out.data() + steps[i] * row_floats,
                    row_floats, absl::StrCat(names[b], " ", what, " output"));
      ExpectBitwise(step_out[b][i].lse.data(),
                    prefill_out[0].lse.data() + steps[i] * c.heads, c.heads,
                    absl::StrCat(names[b], " ", what, " lse"));
    }
  }
}

std::vector<WideCase> WideCases() {
  std::vector<WideCase> cases;
  for (DType kv : {DType::kFloat16, DType::kBFloat16}) {
    for (int dim : {192, 256}) {
      for (bool gqa : {true, false}) {
        for (int32_t window : {0, 300}) {
          WideCase c;
          c.kv_dtype = kv;
          // GQA with a float32 q (split into hi + lo), MHA with q in the
          // KV dtype.
          c.q_dtype = gqa ? DType::kFloat32 : kv;
          c.heads = gqa ? 16 : 4;
          c.kv_heads = gqa ? 2 : 4;
          c.head_dim = dim;
          c.value_dim = dim;
          c.window = window;
          c.name = absl::StrCat(DTypeName(kv), "_dim", dim,
                                gqa ? "_gqa8_q_fp32" : "_mha",
                                window > 0 ? "_window_sinks" : "_causal");
          cases.push_back(c);
        }
      }
    }
    // Mixed dims: only one of them above 128.
    WideCase k_wide{absl::StrCat(DTypeName(kv), "_dims_256_128"),
                    kv, kv, 8, 2, 256, 128, 0};
    WideCase v_wide{absl::StrCat(DTypeName(kv), "_dims_136_200_q_fp32"),
                    kv, DType::kFloat32, 8, 1, 136, 200, 300};
    cases.push_back(k_wide);
    cases.push_back(v_wide);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, WideHeadMatchesCpuTest,
                         ::testing::ValuesIn(WideCases()),
                         [](const ::testing::TestParamInfo<WideCase>& info) {
                           return info.param.name;
                         });

// The wide kernel's rows are bitwise independent of the batch: a 256-dim
// problem alone and batched with narrow and SIMT problems.
TEST_F(CudaBackendTest, WideHeadBatchInvariance) {
  std::mt19937 rng(256);
  constexpr int64_t kLength = 900;
  struct Spec {
    DType dtype;
    int heads, kv_heads, dim;
    int64_t queries;
  };
  const std::vector<Spec> specs = {{DType::kBFloat16, 8, 2, 256, 1},
                                   {DType::kFloat16, 16, 2, 192, 40},
                                   {DType::kBFloat16, 8, 2, 64, 100},
                                   {DType::kFloat32, 4, 4, 256, 3}};
  std::vector<std::unique_ptr<PagedKv>> caches;
  std::vector<HostTensor> queries;
  for (const Spec& s : specs) {
    const HostTensor k =
        RandomTensor({kLength, s.kv_heads, s.dim}, rng, s.dtype);
    const HostTensor v =
        RandomTensor({kLength, s.kv_heads, s.dim}, rng, s.dtype);
    caches.push_back(MakePagedKv(*gpu_, s.dtype, k, v, 64));
    ASSERT_NE(caches.back(), nullptr);
    queries.push_back(RandomTensor({s.queries, s.heads, s.dim}, rng));
  }
  std::vector<Query> query_list(specs.size());
  std::vector<Outputs> alone(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    query_list[i].q = queries[i].view();
    query_list[i].mask.query_start = kLength - specs[i].queries;
    ASSERT_TRUE(
        AttendOne(*gpu_, query_list[i], caches[i]->View(kLength), &alone[i])
            .ok());
  }
  std::vector<Outputs> together(specs.size());
  std::vector<AttentionProblem> problems;
  for (size_t j = 0; j < specs.size(); ++j) {
    const size_t i = specs.size() - 1 - j;
    problems.push_back(MakeProblem(query_list[i], caches[i]->View(kLength),
                                   &together[i]));
  }
  ASSERT_TRUE(gpu_->Attend(problems).ok());
  for (size_t i = 0; i < specs.size(); ++i) {
    ExpectBitwise(together[i].out.data(), alone[i].out.data(),
                  alone[i].out.size(), absl::StrCat("problem ", i, " output"));
    ExpectBitwise(together[i].lse.data(), alone[i].lse.data(),
                  alone[i].lse.size(), absl::StrCat("problem ", i, " lse"));
  }
}

}  // namespace
}  // namespace attention
