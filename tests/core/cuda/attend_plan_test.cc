// Host-side tests of the CUDA backend's planning (no GPU needed): the key
// tiles a block of rows walks, and how AttendPlan cuts problems into work
// items. They run on every machine that builds the CUDA backend.
#include "core/cuda/attend_plan.h"

#include <algorithm>
#include <cstddef>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "core/cuda/attention_kernels.h"
#include "core/cuda/kernel_params.h"
#include "core/dtype.h"
#include "core/kv_view.h"
#include "gtest/gtest.h"

namespace attention {
namespace cuda {
namespace {

// attention_problem.h's visibility rule, written out independently.
bool Visible(const ProblemParams& p, int64_t query_pos, int64_t key) {
  if (key >= p.length) return false;
  if (p.causal && key > query_pos) return false;
  if (p.window > 0 && query_pos - key >= p.window && key >= p.num_sink_tokens) {
    return false;
  }
  return true;
}

TEST(KeyTilesTest, CoversEveryVisibleKeyInIncreasingOrder) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 3000; ++trial) {
    ProblemParams p;
    p.group_size = 1 << (rng() % 4);
    p.length = 1 + rng() % 400;
    const int64_t tokens = 1 + rng() % 40;
    p.causal = rng() % 4 != 0;
    p.query_start = p.causal ? rng() % 400 : 0;
    p.window = p.causal && rng() % 2 ? 1 + rng() % 70 : 0;
    p.num_sink_tokens = p.window > 0 && rng() % 2 ? rng() % 6 : 0;
    const int64_t rows = tokens * p.group_size;
    const int64_t begin = rng() % rows;
    const int64_t count = 1 + rng() % (rows - begin);
    const TileRanges ranges = KeyTiles(p, begin, count);
    std::set<int64_t> tiles;
    int64_t previous = -1;
    for (int64_t i = 0; i < ranges.size(); ++i) {
      const int64_t tile = ranges.tile(i);
      ASSERT_GT(tile, previous) << "trial " << trial;
      ASSERT_LT(tile * kTileKeys, p.length) << "trial " << trial;
      previous = tile;
      tiles.insert(tile);
    }
    for (int64_t row = begin; row < begin + count; ++row) {
      const int64_t query_pos = p.query_start + row / p.group_size;
      for (int64_t key = 0; key < p.length; ++key) {
        if (Visible(p, query_pos, key)) {
          ASSERT_EQ(tiles.count(key / kTileKeys), 1u)
              << "trial " << trial << ": row " << row << " key " << key;
        }
      }
    }
  }
}

TEST(KeyTilesTest, ClipKeepsOneChunk) {
  ProblemParams p;
  p.group_size = 1;
  p.length = 5000;
  p.query_start = 4000;
  p.window = 1000;
  p.num_sink_tokens = 4;
  const TileRanges ranges = KeyTiles(p, 0, 1);
  // Keys [0, 4) and [3001, 4001): tile 0, then tiles 93..125.
  EXPECT_EQ(ranges.tile(0), 0);
  EXPECT_EQ(ranges.tile(1), 3001 / kTileKeys);
  const TileRanges chunk = ranges.Clip(6 * kChunkTiles, 7 * kChunkTiles);
  ASSERT_EQ(chunk.size(), kChunkTiles);
  EXPECT_EQ(chunk.tile(0), 6 * kChunkTiles);
  EXPECT_EQ(ranges.Clip(kChunkTiles, 5 * kChunkTiles).size(), 0);
}

// The device's error keys order rows as attention_problem.h's error units:
// by token block, then KV head, then (token, head) inside the unit.
TEST(ErrorRankTest, FollowsTheErrorUnitOrder) {
  EXPECT_EQ(ErrorUnitTokens(1), 16);
  EXPECT_EQ(ErrorUnitTokens(8), 16);
  EXPECT_EQ(ErrorUnitTokens(20), 12);
  EXPECT_EQ(ErrorUnitTokens(64), 4);
  EXPECT_EQ(ErrorUnitTokens(512), 1);
  for (int group : {1, 3, 8, 20}) {
    const int kv_heads = 3;
    const int64_t unit = ErrorUnitTokens(group);
    const int64_t tokens = 2 * unit + 5;
    std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, int64_t> rank;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < group * kv_heads; ++h) {
        const auto key =
            std::make_tuple(t / unit, h / group, t % unit, h % group);
        rank[key] = ErrorRank(t, h, unit, group, kv_heads);
      }
    }
    int64_t previous = -1;
    for (const auto& [key, r] : rank) {  // in unit order
      EXPECT_GT(r, previous) << "group " << group;
      previous = r;
    }
  }
  // The largest rank fits the 40 bits of an error key.
  EXPECT_LT(ErrorRank((int64_t{1} << 24) - 1, kMaxQueryHeads - 1, 16, 1,
                      kMaxQueryHeads),
            int64_t{1} << 40);
}

// Problems over fake "device" memory: AttendPlan::Create never touches the
// bytes, it only classifies pointers.
class AttendPlanTest : public ::testing::Test {
 protected:
  AttendPlanTest() : fake_pool_(size_t{64} << 20) {}

  bool IsDevice(const void* ptr, int64_t bytes) const {
    const auto* p = static_cast<const std::byte*>(ptr);
    return p >= fake_pool_.data() && bytes >= 0 &&
           p + bytes <= fake_pool_.data() + fake_pool_.size();
  }

  // A paged problem: T queries at the end of `length` keys.
  void AddPaged(DType dtype, int heads, int kv_heads, int dim, int64_t tokens,
                int64_t length, int32_t window = 0) {
    KvBlockLayout layout;
    layout.dtype = dtype;
    layout.num_kv_heads = kv_heads;
    layout.head_dim = dim;
    layout.value_dim = dim;
    layout.tokens_per_block = 16;
    const int64_t blocks = (length + 15) / 16;
    auto& k = k_tables_.emplace_back();
    auto& v = v_tables_.emplace_back();
    for (int64_t b = 0; b < blocks; ++b) {
      const std::byte* base =
          fake_pool_.data() + (b * layout.used_bytes()) % (size_t{32} << 20);
      k.push_back(base);
      v.push_back(base + layout.value_offset_bytes());
    }
    AttentionProblem problem;
    problem.q.dtype = DType::kFloat32;
    problem.q.shape = {tokens, heads, dim};
    problem.q.data = fake_pool_.data();
    problem.kv = PagedKvView(layout, length, k, v);
    problem.mask.causal = true;
    problem.mask.window = window;
    problem.mask.query_start = length - tokens;
    problems_.push_back(problem);
  }

  absl::StatusOr<AttendPlan> Plan(int num_sms, AttendPlan::Limits limits = {}) {
    return AttendPlan::Create(
        problems_,
        [this](const void* ptr, int64_t bytes) { return IsDevice(ptr, bytes); },
        num_sms, limits);
  }

  // The fields KeyTiles reads, for a causal problem.
  static ProblemParams Geometry(const AttentionProblem& problem) {
    ProblemParams geometry;
    geometry.group_size =
        static_cast<int32_t>(problem.q.dim(1) / problem.kv.num_kv_heads);
    geometry.length = problem.kv.length;
    geometry.causal = 1;
    geometry.window = problem.mask.window;
    geometry.query_start = problem.mask.query_start;
    return geometry;
  }

  // Tiles (of kKeysPerTile keys) each work item walks, over every launch.
  std::vector<int64_t> ItemTiles(const AttendPlan& plan) const {
    std::vector<int64_t> tiles;
    for (const auto& [launch, items] : plan.launches()) {
      for (const WorkItem& item : items) {
        TileRanges ranges = KeyTiles(Geometry(problems_[item.problem]),
                                     item.row_begin, item.row_count);
        if (item.chunk >= 0) {
          ranges = ranges.Clip(int64_t{item.chunk} * kChunkTiles,
                               int64_t{item.chunk + 1} * kChunkTiles);
        }
        tiles.push_back(ranges.size());
      }
    }
    return tiles;
  }

  std::vector<std::byte> fake_pool_;
  std::vector<std::vector<const std::byte*>> k_tables_;
  std::vector<std::vector<const std::byte*>> v_tables_;
  std::vector<AttentionProblem> problems_;
};

TEST_F(AttendPlanTest, EveryRowIsServedOnceAndSplitChunksAreComplete) {
  k_tables_.reserve(16);
  v_tables_.reserve(16);
  AddPaged(DType::kBFloat16, 32, 8, 128, 1, 9000);     // decode: split
  AddPaged(DType::kBFloat16, 32, 8, 128, 3000, 3000);  // prefill: full
  AddPaged(DType::kFloat32, 8, 2, 64, 1, 1500, 300);   // SIMT, window
  AddPaged(DType::kFloat16, 16, 2, 72, 70, 2000);      // MMA, 4 warps
  AddPaged(DType::kBFloat16, 4, 4, 20, 5, 700);        // SIMT: dims
  absl::StatusOr<AttendPlan> plan = Plan(/*num_sms=*/132);
  ASSERT_TRUE(plan.ok()) << plan.status();

  // (problem, kv_head, row) -> times served.
  std::map<std::tuple<int, int, int>, int> served;
  // Split items by row block, in launch order.
  std::map<std::tuple<int, int, int>, std::vector<WorkItem>> split;
  std::map<int, KernelVariant> variant_of;
  for (const auto& [launch, items] : plan->launches()) {
    EXPECT_EQ(launch.num_items, static_cast<int>(items.size()));
    for (const WorkItem& item : items) {
      variant_of[item.problem] = launch.variant;
      if (IsMmaVariant(launch.variant)) {
        EXPECT_LE(item.row_count, kMmaWarpRows * launch.warps);
      } else {
        EXPECT_LE(item.row_count, launch.simt_rows);
      }
      if (item.chunk < 0) {
        EXPECT_TRUE(launch.full_mode);
        for (int r = 0; r < item.row_count; ++r) {
          ++served[{item.problem, item.kv_head, item.row_begin + r}];
        }
      } else {
        split[{item.problem, item.kv_head, item.row_begin}].push_back(item);
      }
    }
  }
  for (const MergeItem& merge : plan->merge_items()) {
    for (int r = 0; r < merge.row_count; ++r) {
      ++served[{merge.problem, merge.kv_head, merge.row_begin + r}];
    }
    std::vector<WorkItem> items =
        split[{merge.problem, merge.kv_head, merge.row_begin}];
    std::sort(items.begin(), items.end(),
              [](const WorkItem& a, const WorkItem& b) {
                return a.state_offset < b.state_offset;
              });
    ASSERT_EQ(static_cast<int>(items.size()), merge.num_slots);
    const AttentionProblem& problem = problems_[merge.problem];
    const TileRanges tiles =
        KeyTiles(Geometry(problem), merge.row_begin, merge.row_count);
    std::set<int64_t> chunks;
    for (int64_t i = 0; i < tiles.size(); ++i) {
      chunks.insert(tiles.tile(i) / kChunkTiles);
    }
    ASSERT_EQ(chunks.size(), items.size());
    auto chunk = chunks.begin();
    const int64_t slot = int64_t{merge.row_count} * (problem.kv.value_dim + 2);
    for (size_t s = 0; s < items.size(); ++s, ++chunk) {
      EXPECT_EQ(items[s].chunk, *chunk);  // increasing chunk order
      EXPECT_EQ(items[s].row_count, merge.row_count);
      EXPECT_EQ(items[s].state_offset,
                merge.first_state_offset + static_cast<int64_t>(s) * slot);
    }
  }
  for (size_t i = 0; i < problems_.size(); ++i) {
    const AttentionProblem& problem = problems_[i];
    const int group =
        static_cast<int>(problem.q.dim(1) / problem.kv.num_kv_heads);
    for (int h = 0; h < problem.kv.num_kv_heads; ++h) {
      for (int64_t r = 0; r < problem.q.dim(0) * group; ++r) {
        EXPECT_EQ((served[{static_cast<int>(i), h, static_cast<int>(r)}]), 1)
            << "problem " << i << " kv head " << h << " row " << r;
      }
    }
  }
  EXPECT_EQ(variant_of[0], KernelVariant::kMmaBF16SplitQ);
  EXPECT_EQ(variant_of[2], KernelVariant::kSimtF32);
  EXPECT_EQ(variant_of[3], KernelVariant::kMmaF16SplitQ);
  EXPECT_EQ(variant_of[4], KernelVariant::kSimtBF16);
  // The decode is split (one block per chunk), the big prefill is not.
  EXPECT_FALSE(split.empty());
  for (const auto& [key, items] : split) EXPECT_NE(std::get<0>(key), 1);
  EXPECT_GT(plan->device_bytes(), 0);
  EXPECT_GT(plan->pinned_bytes(), 0);
}

TEST_F(AttendPlanTest, RejectsProblemsTheGpuCannotServe) {
  AddPaged(DType::kFloat32, 2, 1, 16, 1, 40);
  problems_.back().kv.value_dim = kSimtMaxValueDim + 1;
  absl::StatusOr<AttendPlan> plan = Plan(132);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);

  problems_.clear();
  AddPaged(DType::kFloat32, 2, 1, 16, 1, 40);
  std::vector<std::byte> host(4096);
  k_tables_.back()[1] = host.data();  // one block outside GPU memory
  problems_.back().kv.k_blocks = k_tables_.back();
  plan = Plan(132);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
}

// Issue 16: 64 decode steps x 8 KV heads x 128k context, GQA group 8, used
// to need ~545 MB of split states; past the cap, half the batch switched to
// full mode, where one block walks all 256 chunks (a 256x longer item).
// Now the split row blocks spread over passes and every item stays about
// one chunk long.
TEST_F(AttendPlanTest, LongContextBatchHasNoCliff) {
  constexpr int kSequences = 64;
  constexpr int64_t kContext = int64_t{128} << 10;
  k_tables_.reserve(2 * kSequences);
  v_tables_.reserve(2 * kSequences);
  for (int s = 0; s < kSequences; ++s) {
    AddPaged(DType::kBFloat16, 64, 8, 128, 1, kContext);
  }
  absl::StatusOr<AttendPlan> plan = Plan(/*num_sms=*/132);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<int64_t> tiles = ItemTiles(*plan);
  ASSERT_FALSE(tiles.empty());
  std::vector<int64_t> sorted = tiles;
  std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2,
                   sorted.end());
  const int64_t median = sorted[sorted.size() / 2];
  const int64_t longest = *std::max_element(tiles.begin(), tiles.end());
  EXPECT_EQ(median, kChunkTiles);
  EXPECT_LE(longest, 2 * median) << "median " << median;
  // Several passes, each within the state cap; every row block merged once.
  EXPECT_GE(plan->num_passes(), 8);  // 545 MB over 64 MiB passes
  EXPECT_EQ(plan->merge_items().size(), size_t{kSequences} * 8);
  // Well within one stream's default scratch (CudaBackendOptions: 512 MiB).
  EXPECT_LE(plan->device_bytes(), int64_t{128} << 20);

  // The same batch, twice as large, costs about twice as much: passes and
  // items grow in proportion, the longest item does not.
  for (int s = 0; s < kSequences; ++s) {
    AddPaged(DType::kBFloat16, 64, 8, 128, 1, kContext);
  }
  absl::StatusOr<AttendPlan> doubled = Plan(132);
  ASSERT_TRUE(doubled.ok()) << doubled.status();
  const std::vector<int64_t> doubled_tiles = ItemTiles(*doubled);
  EXPECT_EQ(doubled_tiles.size(), 2 * tiles.size());
  EXPECT_EQ(*std::max_element(doubled_tiles.begin(), doubled_tiles.end()),
            longest);
  EXPECT_LE(doubled->num_passes(), 2 * plan->num_passes());
  EXPECT_GE(doubled->num_passes(), 2 * plan->num_passes() - 1);
}

TEST_F(AttendPlanTest, PassesKeepEachRowBlockTogetherWithinTheCap) {
  k_tables_.reserve(16);
  v_tables_.reserve(16);
  for (int s = 0; s < 12; ++s) AddPaged(DType::kFloat16, 8, 2, 64, 1, 5000);
  AttendPlan::Limits limits;
  limits.max_state_bytes = int64_t{64} << 10;  // a few row blocks per pass
  absl::StatusOr<AttendPlan> plan = Plan(132, limits);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_GT(plan->num_passes(), 2);
  const std::vector<int> launch_pass = plan->launch_passes();
  const std::vector<int> merge_pass = plan->merge_passes();
  ASSERT_EQ(merge_pass.size(), plan->merge_items().size());
  // (problem, kv head, row) -> pass of its chunk items.
  std::map<std::tuple<int, int, int>, std::set<int>> item_passes;
  std::map<int, int64_t> state_end;  // pass -> end of its states (floats)
  const auto launches = plan->launches();
  for (size_t l = 0; l < launches.size(); ++l) {
    for (const WorkItem& item : launches[l].second) {
      ASSERT_GE(item.chunk, 0);
      item_passes[{item.problem, item.kv_head, item.row_begin}].insert(
          launch_pass[l]);
      const int64_t end =
          item.state_offset + int64_t{item.row_count} * (64 + 2);
      state_end[launch_pass[l]] = std::max(state_end[launch_pass[l]], end);
    }
  }
  for (size_t m = 0; m < merge_pass.size(); ++m) {
    const MergeItem& merge = plan->merge_items()[m];
    const std::set<int>& passes =
        item_passes[{merge.problem, merge.kv_head, merge.row_begin}];
    ASSERT_EQ(passes.size(), 1u);
    EXPECT_EQ(*passes.begin(), merge_pass[m]);
    if (m > 0) EXPECT_GE(merge_pass[m], merge_pass[m - 1]);
  }
  for (const auto& [pass, end] : state_end) {
    EXPECT_LE(end * 4, limits.max_state_bytes) << "pass " << pass;
  }

  // No state memory at all: every problem runs in full mode, in one pass.
  limits.max_state_bytes = 0;
  plan = Plan(132, limits);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_passes(), 1);
  EXPECT_TRUE(plan->merge_items().empty());
  for (const auto& [launch, items] : plan->launches()) {
    EXPECT_TRUE(launch.full_mode);
    for (const WorkItem& item : items) EXPECT_LT(item.chunk, 0);
  }
}

TEST_F(AttendPlanTest, RefusesACallOverTheScratchBudget) {
  AddPaged(DType::kBFloat16, 32, 8, 128, 1, 9000);
  absl::StatusOr<AttendPlan> plan = Plan(132);
  ASSERT_TRUE(plan.ok()) << plan.status();
  AttendPlan::Limits limits;
  limits.device_bytes = plan->device_bytes();
  limits.pinned_bytes = plan->pinned_bytes();
  EXPECT_TRUE(Plan(132, limits).ok());
  limits.device_bytes = plan->device_bytes() - 1;
  EXPECT_EQ(Plan(132, limits).status().code(),
            absl::StatusCode::kResourceExhausted);
  limits.device_bytes = plan->device_bytes();
  limits.pinned_bytes = plan->pinned_bytes() - 1;
  EXPECT_EQ(Plan(132, limits).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// CudaBackendOptions' default budget (512 MiB scratch, 256 MiB pinned per
// stream) serves the largest prefill a 64 MiB request carries: q of 32M
// bf16 elements, its float32 output (a 16-bit reply of 64 MiB).
TEST_F(AttendPlanTest, DefaultBudgetServesTheLargestRequest) {
  AddPaged(DType::kBFloat16, 32, 8, 128, 8192, 8192);
  problems_.back().q.dtype = DType::kBFloat16;
  AttendPlan::Limits limits;
  limits.device_bytes = int64_t{512} << 20;
  limits.pinned_bytes = int64_t{256} << 20;
  absl::StatusOr<AttendPlan> plan = Plan(132, limits);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // The float32 q of the same size (16M elements) too.
  problems_.clear();
  AddPaged(DType::kBFloat16, 32, 8, 128, 4096, 8192);
  plan = Plan(132, limits);
  ASSERT_TRUE(plan.ok()) << plan.status();
}

TEST_F(AttendPlanTest, RejectsShortBlockTablesAndTooManyHeads) {
  AddPaged(DType::kFloat32, 2, 1, 16, 1, 40);  // 3 blocks of 16
  problems_.back().kv.k_blocks = problems_.back().kv.k_blocks.subspan(0, 2);
  EXPECT_EQ(Plan(132).status().code(), absl::StatusCode::kInternal);
  problems_.clear();
  AddPaged(DType::kFloat32, 2, 1, 16, 1, 40);
  problems_.back().kv.v_blocks = problems_.back().kv.v_blocks.subspan(0, 2);
  EXPECT_EQ(Plan(132).status().code(), absl::StatusCode::kInternal);

  problems_.clear();
  AddPaged(DType::kFloat32, 1, 1, 16, 1, 40);
  problems_.back().q.shape = {1, kMaxQueryHeads + 1, 16};
  problems_.back().kv.num_kv_heads = 1;
  EXPECT_EQ(Plan(132).status().code(), absl::StatusCode::kInvalidArgument);
}

// Issue 16 item 6: fp16/bf16 with head_dim 192 or 256 (Gemma) runs on the
// wide tensor-core kernel, q split or not, GQA or MHA, decode or prefill;
// the narrow kernel keeps dims up to 128 and fp32 or dims over 256 stay on
// SIMT. Every launch's shared memory fits the default per-block limit.
TEST_F(AttendPlanTest, WideHeadsRunOnTensorCores) {
  struct Expected {
    DType kv;
    DType q;
    int dim;
    KernelVariant variant;
  };
  const std::vector<Expected> expected = {
      {DType::kFloat16, DType::kFloat16, 256, KernelVariant::kMmaWideF16},
      {DType::kFloat16, DType::kFloat32, 256,
       KernelVariant::kMmaWideF16SplitQ},
      {DType::kBFloat16, DType::kBFloat16, 192, KernelVariant::kMmaWideBF16},
      {DType::kBFloat16, DType::kFloat32, 192,
       KernelVariant::kMmaWideBF16SplitQ},
      {DType::kFloat16, DType::kFloat16, 136, KernelVariant::kMmaWideF16},
      {DType::kBFloat16, DType::kBFloat16, 128, KernelVariant::kMmaBF16},
      {DType::kFloat32, DType::kFloat32, 256, KernelVariant::kSimtF32},
      {DType::kBFloat16, DType::kBFloat16, 264, KernelVariant::kSimtBF16},
      {DType::kFloat16, DType::kFloat16, 196, KernelVariant::kSimtF16},
  };
  for (const Expected& e : expected) {
    for (const auto& [heads, kv_heads, tokens] :
         {std::tuple<int, int, int64_t>{16, 2, 1}, {8, 8, 1}, {16, 2, 70},
          {8, 8, 300}}) {
      SCOPED_TRACE(::testing::Message()
                   << DTypeName(e.kv) << " q " << DTypeName(e.q) << " dim "
                   << e.dim << " heads " << heads << "/" << kv_heads
                   << " tokens " << tokens);
      problems_.clear();
      AddPaged(e.kv, heads, kv_heads, e.dim, tokens, 1500);
      problems_.back().q.dtype = e.q;
      absl::StatusOr<AttendPlan> plan = Plan(/*num_sms=*/132);
      ASSERT_TRUE(plan.ok()) << plan.status();
      for (const auto& [launch, items] : plan->launches()) {
        EXPECT_EQ(launch.variant, e.variant);
        EXPECT_LE(AttentionSharedBytes(launch),
                  static_cast<size_t>(kDefaultMaxSharedBytes));
        if (IsMmaVariant(launch.variant)) {
          const int64_t rows = tokens * (heads / kv_heads);
          EXPECT_EQ(launch.warps, rows <= 16 ? 1 : (rows <= 32 ? 2 : 4));
        }
      }
    }
  }
}

// A problem that returns its weights runs on SIMT: the weights come from
// float32 logits, and the output must be made from the same ones.
TEST_F(AttendPlanTest, ProblemsReturningWeightsRunOnSimt) {
  for (DType kv : {DType::kFloat16, DType::kBFloat16}) {
    problems_.clear();
    AddPaged(kv, 8, 8, 128, 4, 1500);
    std::vector<float> weights(8 * 4 * 1500);
    problems_.back().weights = weights.data();
    absl::StatusOr<AttendPlan> plan = Plan(/*num_sms=*/132);
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (const auto& [launch, items] : plan->launches()) {
      EXPECT_EQ(launch.variant, kv == DType::kFloat16
                                    ? KernelVariant::kSimtF16
                                    : KernelVariant::kSimtBF16);
    }
  }
}

// On a device with less shared memory per block than an H100 (A100: 163
// KiB, sm_86/89: 99 KiB), wide blocks get fewer warps, and where not even
// one warp fits the problem runs on SIMT; no launch exceeds the limit.
TEST_F(AttendPlanTest, SharedMemoryLimitBoundsWideBlocks) {
  struct Limit {
    int64_t bytes;
    int warps;         // of a 64-row split-q wide block; 0: SIMT
    int narrow_warps;  // of a 64-row split-q narrow block
  };
  for (const Limit& limit :
       {Limit{kDefaultMaxSharedBytes, 4, 4}, Limit{163 * 1024, 2, 4},
        Limit{99 * 1024, 1, 4}, Limit{64 * 1024, 0, 1}}) {
    SCOPED_TRACE(limit.bytes);
    problems_.clear();
    AddPaged(DType::kBFloat16, 16, 2, 256, 70, 1500);  // q fp32: split
    AddPaged(DType::kBFloat16, 16, 2, 256, 1, 9000);   // decode, split KV
    AddPaged(DType::kFloat16, 16, 2, 128, 70, 1500);   // narrow: unchanged
    AttendPlan::Limits limits;
    limits.max_shared_bytes = limit.bytes;
    absl::StatusOr<AttendPlan> plan = Plan(/*num_sms=*/132, limits);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(MmaWarpsFor(KernelVariant::kMmaWideBF16SplitQ, 64, limit.bytes),
              limit.warps);
    bool wide_prefill_seen = false;
    for (const auto& [launch, items] : plan->launches()) {
      EXPECT_LE(AttentionSharedBytes(launch), static_cast<size_t>(limit.bytes));
      for (const WorkItem& item : items) {
        if (item.problem == 2) {
          EXPECT_EQ(launch.variant, KernelVariant::kMmaF16SplitQ);
          EXPECT_EQ(launch.warps, limit.narrow_warps);
        } else if (limit.warps == 0) {
          EXPECT_EQ(launch.variant, KernelVariant::kSimtBF16);
        } else {
          EXPECT_EQ(launch.variant, KernelVariant::kMmaWideBF16SplitQ);
          EXPECT_LE(item.row_count, kMmaWarpRows * launch.warps);
          if (item.problem == 0) {
            EXPECT_EQ(launch.warps, limit.warps);
            wide_prefill_seen = true;
          }
        }
      }
    }
    EXPECT_EQ(wide_prefill_seen, limit.warps > 0);
  }
}

// The largest launch of every variant fits the default limit, and the wide
// kernel's full-mode 4-warp block is the one that needs the most.
TEST(MmaSharedBytesTest, EveryVariantFitsTheDefaultLimit) {
  size_t largest = 0;
  KernelVariant largest_variant = KernelVariant::kSimtF32;
  for (int v = 0; v < kNumKernelVariants; ++v) {
    AttentionLaunch launch;
    launch.variant = static_cast<KernelVariant>(v);
    launch.warps = 4;
    launch.simt_rows = SimtRowsPerBlock(64);
    launch.max_value_dim = 64;
    launch.full_mode = true;
    const size_t bytes = AttentionSharedBytes(launch);
    EXPECT_LE(bytes, static_cast<size_t>(kDefaultMaxSharedBytes)) << v;
    if (IsMmaVariant(launch.variant)) {
      EXPECT_EQ(MmaWarpsFor(launch.variant, 64, kDefaultMaxSharedBytes), 4);
      launch.full_mode = false;
      EXPECT_LT(AttentionSharedBytes(launch), bytes) << v;
    }
    if (bytes > largest) {
      largest = bytes;
      largest_variant = launch.variant;
    }
  }
  EXPECT_TRUE(largest_variant == KernelVariant::kMmaWideF16SplitQ ||
              largest_variant == KernelVariant::kMmaWideBF16SplitQ);
}

}  // namespace
}  // namespace cuda
}  // namespace attention
