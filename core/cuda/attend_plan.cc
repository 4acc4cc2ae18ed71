#include "core/cuda/attend_plan.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/dtype.h"
#include "core/status_macros.h"
#include "core/work_plan.h"

namespace attention {
namespace cuda {
namespace {

static_assert(static_cast<int32_t>(DType::kFloat32) == kF32 &&
                  static_cast<int32_t>(DType::kFloat16) == kF16 &&
                  static_cast<int32_t>(DType::kBFloat16) == kBF16,
              "dtype codes must match");

constexpr int64_t kAlign = 256;
// Error keys hold 20 bits of problem index and a 40-bit row rank (tokens
// below 2^24 times heads below 2^16, kernel_params.h).
constexpr int64_t kMaxProblems = int64_t{1} << 20;
constexpr int64_t kMaxQueries = int64_t{1} << 24;

int64_t AlignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Bump allocation of 256-byte aligned ranges.
class Bump {
 public:
  explicit Bump(int64_t start) : end_(start) {}
  int64_t Add(int64_t bytes) {
    const int64_t offset = AlignUp(end_);
    end_ = offset + bytes;
    return offset;
  }
  int64_t end() const { return end_; }

 private:
  int64_t end_;
};

int32_t Code(DType dtype) { return static_cast<int32_t>(dtype); }

// Bytes a kernel may touch in logical block `b` of `kv` for keys (values
// when `values`).
int64_t BlockExtentBytes(const KvView& kv, int64_t b, bool values) {
  const int64_t first = b * kv.tokens_per_block;
  const int64_t rows = std::min(kv.tokens_per_block, kv.length - first);
  if (rows <= 0) return 0;
  const int64_t token_stride = values ? kv.v_token_stride : kv.k_token_stride;
  const int64_t head_stride = values ? kv.v_head_stride : kv.k_head_stride;
  const int64_t dim = values ? kv.value_dim : kv.head_dim;
  const int64_t elements = (rows - 1) * token_stride +
                           int64_t{kv.num_kv_heads - 1} * head_stride + dim;
  return elements * DTypeSize(kv.dtype);
}

// The mask and geometry fields RowKeys reads.
ProblemParams Geometry(const AttentionProblem& problem, int32_t group_size) {
  ProblemParams p;
  p.group_size = group_size;
  p.length = problem.kv.length;
  p.causal = problem.mask.causal ? 1 : 0;
  p.window = problem.mask.window;
  p.num_sink_tokens = problem.mask.num_sink_tokens;
  p.query_start = problem.mask.query_start;
  return p;
}

// Rejects a problem the kernels cannot take.
absl::Status CheckShape(int64_t i, const AttentionProblem& problem,
                        int32_t group_size) {
  const int64_t num_queries = problem.q.dim(0);
  const int64_t num_heads = problem.q.dim(1);
  if (num_heads > kMaxQueryHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat("problem ", i, ": ", num_heads,
                     " query heads exceed the CUDA backend's limit of ",
                     kMaxQueryHeads, "; use fewer heads or the cpu backend"));
  }
  if (problem.kv.value_dim > kSimtMaxValueDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("problem ", i, ": value_dim ", problem.kv.value_dim,
                     " exceeds the CUDA backend's limit of ", kSimtMaxValueDim,
                     "; use a smaller value_dim or the cpu backend"));
  }
  if (num_queries >= kMaxQueries ||
      num_queries * group_size > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "problem ", i, ": ", num_queries, " queries with ", num_heads,
        " heads are too many for one CUDA call; send fewer query tokens"));
  }
  return absl::OkStatus();
}

// Where a problem's keys and values live.
struct KvPlacement {
  bool on_device = false;
  bool aligned = true;  // every block pointer 16-byte aligned
};

absl::StatusOr<KvPlacement> LocateKv(
    int64_t i, const KvView& kv, int64_t num_blocks,
    const AttendPlan::DeviceMemoryTest& is_device_memory) {
  // Fast path: every block pointer lies between the lowest and the
  // highest, so when both ends (plus a whole block) fall in one arena, all
  // of them are device memory.
  bool any_device = false;
  bool any_host = false;
  KvPlacement placement;
  uintptr_t lowest = std::numeric_limits<uintptr_t>::max();
  uintptr_t highest = 0;
  uintptr_t low_bits = 0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (const std::byte* block : {kv.k_block(b), kv.v_block(b)}) {
      if (block == nullptr) continue;
      const auto address = reinterpret_cast<uintptr_t>(block);
      lowest = std::min(lowest, address);
      highest = std::max(highest, address);
      low_bits |= address;
    }
  }
  const int64_t block_extent =
      std::max(BlockExtentBytes(kv, 0, false), BlockExtentBytes(kv, 0, true));
  const bool fast_device =
      highest >= lowest &&
      is_device_memory(reinterpret_cast<const void*>(lowest),
                       static_cast<int64_t>(highest - lowest) + block_extent);
  if (fast_device) {
    any_device = true;
    placement.aligned = low_bits % 16 == 0;
  }
  for (int64_t b = 0; !fast_device && b < num_blocks; ++b) {
    for (int values = 0; values < 2; ++values) {
      const std::byte* block = values ? kv.v_block(b) : kv.k_block(b);
      if (block == nullptr) continue;
      const int64_t bytes = BlockExtentBytes(kv, b, values != 0);
      if (bytes <= 0) continue;
      if (is_device_memory(block, bytes)) {
        any_device = true;
      } else {
        any_host = true;
      }
      if (reinterpret_cast<uintptr_t>(block) % 16 != 0) {
        placement.aligned = false;
      }
    }
  }
  if (any_device && any_host) {
    return absl::InvalidArgumentError(absl::StrCat(
        "problem ", i,
        ": its KV blocks mix GPU memory and host memory; a problem's keys "
        "must all come from the KV pool or all from the request"));
  }
  placement.on_device = !any_host;
  return placement;
}

// The kernel variant of a problem: tensor cores for 16-bit KV of suitable
// dims and strides (and a block that fits `max_shared_bytes`), the SIMT
// kernel otherwise.
void ChooseVariant(const AttentionProblem& problem, bool aligned,
                   bool kv_on_device, int64_t max_shared_bytes,
                   KernelVariant* variant, bool* mma, bool* split_q) {
  const KvView& kv = problem.kv;
  const int64_t head_dim = problem.q.dim(2);
  const bool half = kv.dtype != DType::kFloat32;
  const bool q_differs = problem.q.dtype != kv.dtype;
  const KernelVariant mma_variant = MmaVariantFor(
      kv.dtype == DType::kBFloat16, q_differs, static_cast<int>(head_dim),
      static_cast<int>(kv.value_dim));
  // Weights come from float32 logits (WeightsKernel): the output of such a
  // problem is made from those same logits, not the tensor cores' ones.
  *mma = half && problem.weights == nullptr && head_dim % 8 == 0 &&
         kv.value_dim % 8 == 0 && head_dim <= kMmaWideMaxDim &&
         kv.value_dim <= kMmaWideMaxDim &&
         MmaWarpsFor(mma_variant, 1, max_shared_bytes) > 0 &&
         kv.length < std::numeric_limits<int32_t>::max() &&
         problem.mask.query_start + problem.q.dim(0) <
             std::numeric_limits<int32_t>::max() &&
         kv.tokens_per_block < std::numeric_limits<int32_t>::max() &&
         kv.k_token_stride % 8 == 0 && kv.k_head_stride % 8 == 0 &&
         kv.v_token_stride % 8 == 0 && kv.v_head_stride % 8 == 0 &&
         (aligned || !kv_on_device);
  *split_q = *mma && q_differs;
  if (*mma) {
    *variant = mma_variant;
    return;
  }
  *variant = kv.dtype == DType::kFloat32   ? KernelVariant::kSimtF32
             : kv.dtype == DType::kFloat16 ? KernelVariant::kSimtF16
                                           : KernelVariant::kSimtBF16;
}

}  // namespace

absl::Status AttendPlan::Classify(int64_t i, const AttentionProblem& problem,
                                  const DeviceMemoryTest& is_device_memory,
                                  const Limits& limits) {
  Planned& pl = planned_[i];
  pl.problem = &problem;
  const KvView& kv = problem.kv;
  pl.group_size = static_cast<int32_t>(problem.q.dim(1) / kv.num_kv_heads);
  ATTN_RETURN_IF_ERROR(CheckShape(i, problem, pl.group_size));
  pl.num_blocks = kv.length <= 0 ? 0
                                 : (kv.length + kv.tokens_per_block - 1) /
                                       kv.tokens_per_block;
  if (kv.num_blocks() < pl.num_blocks) {
    return absl::InternalError(absl::StrCat(
        "problem ", i, ": its block tables hold ", kv.k_blocks.size(),
        " key and ", kv.v_blocks.size(), " value blocks (", kv.gap_blocks,
        " dropped, not listed) but ", kv.length, " positions need ",
        pl.num_blocks, "; this is a bug in the caller"));
  }
  ATTN_ASSIGN_OR_RETURN(const KvPlacement placement,
                        LocateKv(i, kv, pl.num_blocks, is_device_memory));
  pl.kv_on_device = placement.on_device;
  ChooseVariant(problem, placement.aligned, pl.kv_on_device,
                limits.max_shared_bytes, &pl.variant, &pl.mma, &pl.split_q);
  pl.q_stride =
      pl.mma ? static_cast<int32_t>((problem.q.dim(2) + 15) / 16 * 16) : 0;
  return absl::OkStatus();
}

// Cuts the problems into work items (core/work_plan.h): row blocks of one
// KV head, each in full mode or split into one item per chunk plus a merge,
// grouped into launches by (pass, variant, block shape). Full-mode items
// run in pass 0; a split row block goes to the current pass, or opens the
// next one when its states do not fit beside those already there.
class AttendPlan::WorkPlanner {
 public:
  WorkPlanner(AttendPlan* plan, int num_sms, const Limits& limits)
      : plan_(*plan),
        num_sms_(num_sms),
        max_state_floats_(std::max<int64_t>(limits.max_state_bytes, 0) / 4),
        max_shared_bytes_(limits.max_shared_bytes) {}

  void AddProblem(int64_t i, const AttentionProblem& problem);
  // Moves the merges into the plan, orders the launches' items; returns
  // the state floats of the largest pass.
  absl::StatusOr<int64_t> Finish();

 private:
  // The block shape of a problem: rows per block and the launch key.
  struct Shape {
    int warps = 1;
    int block_rows = 0;
    int key = 0;
  };
  Shape ShapeOf(const Planned& pl, int64_t rows_per_head, int value_dim) const;
  // The launch of (pass, variant, shape), created on first use.
  int LaunchFor(int pass, const Planned& pl, const Shape& shape, int value_dim);
  void AddSplit(const WorkItem& item, const Planned& pl, const Shape& shape,
                int value_dim, const TileRanges& tiles,
                const std::vector<int32_t>& chunks);
  void AddFull(WorkItem item, const Planned& pl, const Shape& shape,
               int value_dim, const TileRanges& tiles);

  AttendPlan& plan_;
  const int num_sms_;
  const int64_t max_state_floats_;
  const int64_t max_shared_bytes_;
  std::map<std::tuple<int, int, int>, int> launch_of_;
  std::vector<std::vector<int64_t>> launch_weights_;  // tiles per item
  std::vector<std::vector<MergeItem>> pass_merges_{1};
  int64_t state_floats_ = 0;     // of the current pass
  int64_t max_pass_floats_ = 0;  // of the largest pass
};

AttendPlan::WorkPlanner::Shape AttendPlan::WorkPlanner::ShapeOf(
    const Planned& pl, int64_t rows_per_head, int value_dim) const {
  Shape shape;
  if (pl.mma) {
    shape.warps = MmaWarpsFor(pl.variant, rows_per_head, max_shared_bytes_);
    shape.block_rows = kMmaWarpRows * shape.warps;
    shape.key = shape.warps;
  } else {
    shape.key = SimtRowsPerBlock(value_dim);
    shape.block_rows =
        static_cast<int>(std::min<int64_t>(shape.key, rows_per_head));
  }
  return shape;
}

int AttendPlan::WorkPlanner::LaunchFor(int pass, const Planned& pl,
                                       const Shape& shape, int value_dim) {
  const std::tuple<int, int, int> key(pass, static_cast<int>(pl.variant),
                                      shape.key);
  auto [it, inserted] =
      launch_of_.emplace(key, static_cast<int>(plan_.launches_.size()));
  if (inserted) {
    plan_.launches_.emplace_back();
    launch_weights_.emplace_back();
    Launch& created = plan_.launches_.back();
    created.pass = pass;
    created.launch.variant = pl.variant;
    created.launch.warps = shape.warps;
    created.launch.simt_rows = pl.mma ? 1 : shape.key;
  }
  Launch& launch = plan_.launches_[it->second];
  launch.launch.max_value_dim =
      std::max(launch.launch.max_value_dim, value_dim);
  return it->second;
}

void AttendPlan::WorkPlanner::AddSplit(const WorkItem& item, const Planned& pl,
                                       const Shape& shape, int value_dim,
                                       const TileRanges& tiles,
                                       const std::vector<int32_t>& chunks) {
  const int64_t slot_floats = int64_t{item.row_count} * (value_dim + 2);
  const int64_t group_floats =
      static_cast<int64_t>(chunks.size()) * slot_floats;
  if (state_floats_ + group_floats > max_state_floats_) {
    pass_merges_.emplace_back();  // the next pass
    state_floats_ = 0;
  }
  const int pass = static_cast<int>(pass_merges_.size()) - 1;
  const int l = LaunchFor(pass, pl, shape, value_dim);
  MergeItem merge;
  merge.problem = item.problem;
  merge.kv_head = item.kv_head;
  merge.row_begin = item.row_begin;
  merge.row_count = item.row_count;
  merge.num_slots = static_cast<int32_t>(chunks.size());
  merge.first_state_offset = state_floats_;
  pass_merges_.back().push_back(merge);
  // One item per chunk; the merge takes their states in chunk order.
  for (int32_t chunk : chunks) {
    WorkItem split_item = item;
    split_item.chunk = chunk;
    split_item.state_offset = state_floats_;
    state_floats_ += slot_floats;
    plan_.launches_[l].items.push_back(split_item);
    launch_weights_[l].push_back(
        tiles.Clip(ChunkTileBegin(chunk), ChunkTileBegin(chunk + 1)).size());
  }
  max_pass_floats_ = std::max(max_pass_floats_, state_floats_);
}

void AttendPlan::WorkPlanner::AddFull(WorkItem item, const Planned& pl,
                                      const Shape& shape, int value_dim,
                                      const TileRanges& tiles) {
  const int l = LaunchFor(0, pl, shape, value_dim);
  item.chunk = -1;
  plan_.launches_[l].items.push_back(item);
  launch_weights_[l].push_back(tiles.size());
  plan_.launches_[l].launch.full_mode = true;
}

void AttendPlan::WorkPlanner::AddProblem(int64_t i,
                                         const AttentionProblem& problem) {
  const Planned& pl = plan_.planned_[i];
  const ProblemParams geometry = Geometry(problem, pl.group_size);
  const int64_t rows_per_head = problem.q.dim(0) * pl.group_size;
  const int value_dim = problem.kv.value_dim;
  const Shape shape = ShapeOf(pl, rows_per_head, value_dim);
  const int64_t num_row_blocks =
      (rows_per_head + shape.block_rows - 1) / shape.block_rows;
  const int num_kv_heads = problem.kv.num_kv_heads;
  // Few blocks: give each chunk its own block (flash-decoding split-KV).
  const bool split = num_row_blocks * num_kv_heads < num_sms_;
  for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
    for (int64_t b = 0; b < num_row_blocks; ++b) {
      WorkItem item;
      item.problem = static_cast<int32_t>(i);
      item.kv_head = kv_head;
      item.row_begin = static_cast<int32_t>(b * shape.block_rows);
      item.row_count = static_cast<int32_t>(std::min<int64_t>(
          shape.block_rows, rows_per_head - b * shape.block_rows));
      const KeyRanges keys = RowKeys(geometry, item.row_begin, item.row_count);
      const TileRanges tiles = TilesOf(keys);
      std::vector<int32_t> chunks;
      ForEachChunk(keys, [&chunks](int64_t c) {
        chunks.push_back(static_cast<int32_t>(c));
      });
      const int64_t group_floats = static_cast<int64_t>(chunks.size()) *
                                   item.row_count * (value_dim + 2);
      if (split && chunks.size() >= 2 && group_floats <= max_state_floats_) {
        AddSplit(item, pl, shape, value_dim, tiles, chunks);
      } else {
        AddFull(item, pl, shape, value_dim, tiles);
      }
    }
  }
}

absl::StatusOr<int64_t> AttendPlan::WorkPlanner::Finish() {
  plan_.num_passes_ = static_cast<int>(pass_merges_.size());
  plan_.merge_pass_begin_.assign(1, 0);
  for (std::vector<MergeItem>& merges : pass_merges_) {
    plan_.merge_items_.insert(plan_.merge_items_.end(), merges.begin(),
                              merges.end());
    plan_.merge_pass_begin_.push_back(
        static_cast<int64_t>(plan_.merge_items_.size()));
  }
  // Longest blocks first, so the grid's tail is short work (split items
  // are all about one chunk long and keep their order).
  for (size_t l = 0; l < plan_.launches_.size(); ++l) {
    std::vector<WorkItem>& items = plan_.launches_[l].items;
    if (items.size() >
        static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
      return absl::InvalidArgumentError(
          "too many attention blocks for one CUDA launch; split the batch");
    }
    if (!plan_.launches_[l].launch.full_mode) continue;
    const std::vector<int64_t>& weights = launch_weights_[l];
    std::vector<size_t> order(items.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return weights[a] > weights[b];
    });
    std::vector<WorkItem> sorted;
    sorted.reserve(items.size());
    for (size_t k : order) sorted.push_back(items[k]);
    items = std::move(sorted);
  }
  return max_pass_floats_;
}

// Upload part: descriptors, item tables, raw q, block tables, sinks, bias,
// host KV copies.
void AttendPlan::LayoutUpload(absl::Span<const AttentionProblem> problems) {
  const int64_t n = static_cast<int64_t>(problems.size());
  Bump upload(0);
  params_offset_ = upload.Add(n * int64_t{sizeof(ProblemParams)});
  q_row_prefix_.assign(1, 0);
  for (int64_t i = 0; i < n; ++i) {
    q_row_prefix_.push_back(q_row_prefix_.back() +
                            problems[i].q.dim(0) * problems[i].q.dim(1));
  }
  q_prefix_offset_ = upload.Add((n + 1) * int64_t{sizeof(int64_t)});
  for (Launch& launch : launches_) {
    launch.launch.num_items = static_cast<int>(launch.items.size());
    launch.items_offset = upload.Add(
        static_cast<int64_t>(launch.items.size() * sizeof(WorkItem)));
  }
  merge_offset_ =
      upload.Add(static_cast<int64_t>(merge_items_.size() * sizeof(MergeItem)));
  weight_row_prefix_.assign(1, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (problems[i].weights == nullptr) continue;
    weight_ids_.push_back(static_cast<int32_t>(i));
    weight_row_prefix_.push_back(weight_row_prefix_.back() +
                                 problems[i].q.dim(0) * problems[i].q.dim(1));
  }
  weight_ids_offset_ =
      upload.Add(static_cast<int64_t>(weight_ids_.size() * sizeof(int32_t)));
  weight_prefix_offset_ = upload.Add(
      static_cast<int64_t>(weight_row_prefix_.size() * sizeof(int64_t)));
  for (int64_t i = 0; i < n; ++i) {
    const AttentionProblem& problem = problems[i];
    Planned& pl = planned_[i];
    pl.q_raw =
        upload.Add(problem.q.num_elements() * DTypeSize(problem.q.dtype));
    pl.k_table = upload.Add(pl.num_blocks * 8);
    pl.v_table = upload.Add(pl.num_blocks * 8);
    if (!problem.sink_logits.empty()) {
      pl.sinks =
          upload.Add(static_cast<int64_t>(problem.sink_logits.size()) * 4);
    }
    if (problem.bias != nullptr) {
      pl.bias = upload.Add(problem.bias->num_elements() * 4);
    }
    if (pl.kv_on_device) continue;
    pl.k_copies.resize(pl.num_blocks);
    pl.v_copies.resize(pl.num_blocks);
    for (int64_t b = 0; b < pl.num_blocks; ++b) {
      for (int values = 0; values < 2; ++values) {
        const std::byte* block =
            values ? problem.kv.v_block(b) : problem.kv.k_block(b);
        const int64_t bytes = BlockExtentBytes(problem.kv, b, values != 0);
        if (block == nullptr || bytes <= 0) continue;
        HostCopy& copy = values ? pl.v_copies[b] : pl.k_copies[b];
        copy.source = block;
        copy.bytes = bytes;
        copy.offset = upload.Add(bytes);
      }
    }
  }
  upload_bytes_ = upload.end();
}

// Work part (device only): prepared queries, split chunk states, row
// max/sum; then the download part: outputs, LSE, weights, error record.
void AttendPlan::LayoutWorkAndDownload(
    absl::Span<const AttentionProblem> problems, int64_t max_pass_floats) {
  const int64_t n = static_cast<int64_t>(problems.size());
  Bump work(AlignUp(upload_bytes_));
  for (int64_t i = 0; i < n; ++i) {
    const AttentionProblem& problem = problems[i];
    Planned& pl = planned_[i];
    const int64_t rows = problem.q.dim(0) * problem.q.dim(1);
    const bool weights = problem.weights != nullptr;
    if (!pl.mma || weights) pl.q_f32 = work.Add(rows * problem.q.dim(2) * 4);
    if (pl.mma) {
      pl.q_hi = work.Add(rows * pl.q_stride * 2);
      if (pl.split_q) pl.q_lo = work.Add(rows * pl.q_stride * 2);
      pl.q_exponent = work.Add(rows * 4);
    }
    if (weights) {
      pl.row_max = work.Add(rows * 4);
      pl.row_sum = work.Add(rows * 4);
    }
  }
  states_offset_ = work.Add(max_pass_floats * 4);

  Bump download(AlignUp(work.end()));
  download_offset_ = AlignUp(work.end());
  for (int64_t i = 0; i < n; ++i) {
    const AttentionProblem& problem = problems[i];
    Planned& pl = planned_[i];
    const int64_t rows = problem.q.dim(0) * problem.q.dim(1);
    pl.output = download.Add(rows * problem.kv.value_dim * 4);
    if (problem.lse != nullptr) pl.lse = download.Add(rows * 4);
    if (problem.weights != nullptr) {
      pl.weights = download.Add(rows * problem.kv.length * 4);
    }
  }
  errors_offset_ = download.Add(sizeof(ErrorRecord));
  download_bytes_ = download.end() - download_offset_;
  pinned_download_ = AlignUp(upload_bytes_);
}

absl::StatusOr<AttendPlan> AttendPlan::Create(
    absl::Span<const AttentionProblem> problems,
    const DeviceMemoryTest& is_device_memory, int num_sms,
    const Limits& limits) {
  AttendPlan plan;
  const int64_t n = static_cast<int64_t>(problems.size());
  if (n > kMaxProblems) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA backend takes at most ", kMaxProblems,
                     " problems per call, got ", n, "; split the batch"));
  }
  plan.planned_.resize(problems.size());
  for (int64_t i = 0; i < n; ++i) {
    ATTN_RETURN_IF_ERROR(
        plan.Classify(i, problems[i], is_device_memory, limits));
  }
  WorkPlanner planner(&plan, num_sms, limits);
  for (int64_t i = 0; i < n; ++i) planner.AddProblem(i, problems[i]);
  ATTN_ASSIGN_OR_RETURN(const int64_t max_pass_floats, planner.Finish());
  plan.LayoutUpload(problems);
  plan.LayoutWorkAndDownload(problems, max_pass_floats);
  if (plan.device_bytes() > limits.device_bytes ||
      plan.pinned_bytes() > limits.pinned_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this call needs ", plan.device_bytes(), " bytes of GPU scratch and ",
        plan.pinned_bytes(), " bytes of pinned staging memory, over the ",
        "per-call budget of ", limits.device_bytes, " and ",
        limits.pinned_bytes, "; send fewer tokens or problems per call"));
  }
  return plan;
}

std::vector<std::pair<AttentionLaunch, std::vector<WorkItem>>>
AttendPlan::launches() const {
  std::vector<std::pair<AttentionLaunch, std::vector<WorkItem>>> out;
  for (const Launch& launch : launches_) {
    out.emplace_back(launch.launch, launch.items);
  }
  return out;
}

std::vector<int> AttendPlan::launch_passes() const {
  std::vector<int> out;
  for (const Launch& launch : launches_) out.push_back(launch.pass);
  return out;
}

std::vector<int> AttendPlan::merge_passes() const {
  std::vector<int> out;
  for (int pass = 0; pass < num_passes_; ++pass) {
    out.resize(static_cast<size_t>(merge_pass_begin_[pass + 1]), pass);
  }
  return out;
}

ProblemParams AttendPlan::Params(int i, std::byte* device_base) const {
  const Planned& pl = planned_[i];
  const AttentionProblem& problem = *pl.problem;
  const KvView& kv = problem.kv;
  auto at = [device_base](int64_t offset) -> std::byte* {
    return offset < 0 ? nullptr : device_base + offset;
  };
  ProblemParams p;
  p.q_raw = at(pl.q_raw);
  p.q_dtype = Code(problem.q.dtype);
  p.q_f32 = reinterpret_cast<float*>(at(pl.q_f32));
  p.q_hi = reinterpret_cast<uint16_t*>(at(pl.q_hi));
  p.q_lo = reinterpret_cast<uint16_t*>(at(pl.q_lo));
  p.q_exponent = reinterpret_cast<int32_t*>(at(pl.q_exponent));
  p.q_stride = pl.q_stride;
  p.split_q = pl.split_q ? 1 : 0;
  p.use_mma = pl.mma ? 1 : 0;
  p.k_blocks = reinterpret_cast<const char* const*>(at(pl.k_table));
  p.v_blocks = reinterpret_cast<const char* const*>(at(pl.v_table));
  p.length = kv.length;
  p.tokens_per_block = kv.tokens_per_block;
  p.k_token_stride = kv.k_token_stride;
  p.k_head_stride = kv.k_head_stride;
  p.v_token_stride = kv.v_token_stride;
  p.v_head_stride = kv.v_head_stride;
  p.kv_dtype = Code(kv.dtype);
  p.num_q_heads = static_cast<int32_t>(problem.q.dim(1));
  p.num_kv_heads = kv.num_kv_heads;
  p.group_size = pl.group_size;
  p.head_dim = static_cast<int32_t>(problem.q.dim(2));
  p.value_dim = kv.value_dim;
  p.num_queries = problem.q.dim(0);
  p.causal = problem.mask.causal ? 1 : 0;
  p.window = problem.mask.window;
  p.num_sink_tokens = problem.mask.num_sink_tokens;
  p.query_start = problem.mask.query_start;
  p.sink_logits = reinterpret_cast<const float*>(at(pl.sinks));
  p.scale = problem.scale;
  p.bias = reinterpret_cast<const float*>(at(pl.bias));
  p.bias_per_head =
      problem.bias != nullptr && problem.bias->rank() == 3 ? 1 : 0;
  p.empty_rows_zero = problem.empty_row_policy == EmptyRowPolicy::kZero ? 1 : 0;
  p.output = reinterpret_cast<float*>(at(pl.output));
  p.lse = reinterpret_cast<float*>(at(pl.lse));
  p.row_max = reinterpret_cast<float*>(at(pl.row_max));
  p.row_sum = reinterpret_cast<float*>(at(pl.row_sum));
  p.weights = reinterpret_cast<float*>(at(pl.weights));
  p.problem_index = i;
  p.error_unit_tokens = static_cast<int32_t>(ErrorUnitTokens(pl.group_size));
  return p;
}

void AttendPlan::FillUpload(std::byte* pinned, std::byte* device_base) const {
  const int n = static_cast<int>(planned_.size());
  for (int i = 0; i < n; ++i) {
    const ProblemParams params = Params(i, device_base);
    std::memcpy(pinned + params_offset_ + i * sizeof(ProblemParams), &params,
                sizeof(params));
  }
  std::memcpy(pinned + q_prefix_offset_, q_row_prefix_.data(),
              q_row_prefix_.size() * sizeof(int64_t));
  for (const Launch& launch : launches_) {
    std::memcpy(pinned + launch.items_offset, launch.items.data(),
                launch.items.size() * sizeof(WorkItem));
  }
  std::memcpy(pinned + merge_offset_, merge_items_.data(),
              merge_items_.size() * sizeof(MergeItem));
  std::memcpy(pinned + weight_ids_offset_, weight_ids_.data(),
              weight_ids_.size() * sizeof(int32_t));
  std::memcpy(pinned + weight_prefix_offset_, weight_row_prefix_.data(),
              weight_row_prefix_.size() * sizeof(int64_t));
  for (const Planned& pl : planned_) {
    const AttentionProblem& problem = *pl.problem;
    std::memcpy(pinned + pl.q_raw, problem.q.data,
                static_cast<size_t>(problem.q.num_elements() *
                                    DTypeSize(problem.q.dtype)));
    uint64_t* k_table = reinterpret_cast<uint64_t*>(pinned + pl.k_table);
    uint64_t* v_table = reinterpret_cast<uint64_t*>(pinned + pl.v_table);
    static_assert(sizeof(const std::byte*) == sizeof(uint64_t));
    for (int64_t b = 0; pl.kv_on_device && b < pl.num_blocks; ++b) {
      k_table[b] = reinterpret_cast<uint64_t>(problem.kv.k_block(b));
      v_table[b] = reinterpret_cast<uint64_t>(problem.kv.v_block(b));
    }
    for (int64_t b = 0; !pl.kv_on_device && b < pl.num_blocks; ++b) {
      const HostCopy& k = pl.k_copies[b];
      const HostCopy& v = pl.v_copies[b];
      k_table[b] =
          k.bytes > 0 ? reinterpret_cast<uint64_t>(device_base + k.offset) : 0;
      v_table[b] =
          v.bytes > 0 ? reinterpret_cast<uint64_t>(device_base + v.offset) : 0;
      if (k.bytes > 0) {
        std::memcpy(pinned + k.offset, k.source, static_cast<size_t>(k.bytes));
      }
      if (v.bytes > 0) {
        std::memcpy(pinned + v.offset, v.source, static_cast<size_t>(v.bytes));
      }
    }
    if (pl.sinks >= 0) {
      std::memcpy(pinned + pl.sinks, problem.sink_logits.data(),
                  problem.sink_logits.size() * sizeof(float));
    }
    if (pl.bias >= 0) {
      ConvertToFloat(problem.bias->dtype, problem.bias->data,
                     problem.bias->num_elements(),
                     reinterpret_cast<float*>(pinned + pl.bias));
    }
  }
}

absl::Status AttendPlan::Enqueue(std::byte* pinned, std::byte* device_base,
                                 cudaStream_t stream, cudaEvent_t kernels_start,
                                 cudaEvent_t kernels_stop) const {
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(device_base, pinned, static_cast<size_t>(upload_bytes_),
                      cudaMemcpyHostToDevice, stream),
      "copying attention inputs to the GPU");
  ATTN_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(device_base + errors_offset_, 0xff,
                                            sizeof(ErrorRecord), stream),
                            "clearing the GPU error record");
  if (kernels_start != nullptr) {
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(kernels_start, stream),
                              "recording a CUDA event");
  }
  const auto* problems =
      reinterpret_cast<const ProblemParams*>(device_base + params_offset_);
  auto* states = reinterpret_cast<float*>(device_base + states_offset_);
  auto* errors = reinterpret_cast<ErrorRecord*>(device_base + errors_offset_);
  ATTN_CUDA_RETURN_IF_ERROR(
      LaunchPrepareQueries(
          problems,
          reinterpret_cast<const int64_t*>(device_base + q_prefix_offset_),
          static_cast<int>(planned_.size()), q_row_prefix_.back(), stream),
      "launching the query preparation kernel");
  // Each pass: its attention launches, then the merges of its split row
  // blocks, which free the state memory for the next pass (stream order).
  for (int pass = 0; pass < num_passes_; ++pass) {
    for (const Launch& launch : launches_) {
      if (launch.pass != pass) continue;
      AttentionLaunch l = launch.launch;
      l.items =
          reinterpret_cast<const WorkItem*>(device_base + launch.items_offset);
      ATTN_CUDA_RETURN_IF_ERROR(
          LaunchAttention(l, problems, states, errors, stream),
          "launching the attention kernel");
    }
    const int64_t first_merge = merge_pass_begin_[pass];
    ATTN_CUDA_RETURN_IF_ERROR(
        LaunchMergeChunks(
            reinterpret_cast<const MergeItem*>(device_base + merge_offset_) +
                first_merge,
            static_cast<int>(merge_pass_begin_[pass + 1] - first_merge),
            problems, states, errors, stream),
        "launching the split-KV merge kernel");
  }
  ATTN_CUDA_RETURN_IF_ERROR(
      LaunchWeights(
          problems,
          reinterpret_cast<const int32_t*>(device_base + weight_ids_offset_),
          reinterpret_cast<const int64_t*>(device_base + weight_prefix_offset_),
          static_cast<int>(weight_ids_.size()), weight_row_prefix_.back(),
          stream),
      "launching the attention weights kernel");
  if (kernels_stop != nullptr) {
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(kernels_stop, stream),
                              "recording a CUDA event");
  }
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(pinned + pinned_download_, device_base + download_offset_,
                      static_cast<size_t>(download_bytes_),
                      cudaMemcpyDeviceToHost, stream),
      "copying attention results from the GPU");
  return absl::OkStatus();
}

absl::Status AttendPlan::Collect(const std::byte* pinned) const {
  auto host = [&](int64_t offset) {
    return pinned + pinned_download_ + (offset - download_offset_);
  };
  ErrorRecord record;
  std::memcpy(&record, host(errors_offset_), sizeof(record));
  // The first error in the order of attention_problem.h: the first failing
  // error unit, a logit overflow before a row's error inside it (the first
  // row, in (token, head) order, that is empty or whose values overflowed).
  const unsigned long long row_error =
      std::min(record.empty_row, record.value_overflow);
  if (record.overflow != kNoError || row_error != kNoError) {
    struct Decoded {
      int64_t index = 0, unit = 0, token = 0, head = 0;
    };
    const auto decode = [this](unsigned long long key) {
      Decoded d;
      d.index = static_cast<int64_t>(key >> 40);
      int64_t rank = static_cast<int64_t>(key & ((1ull << 40) - 1));
      if (d.index >= static_cast<int64_t>(planned_.size())) return d;
      const int64_t group = planned_[d.index].group_size;
      const int64_t unit_tokens = ErrorUnitTokens(group);
      const int64_t in_group = rank % group;
      rank /= group;
      const int64_t in_block = rank % unit_tokens;
      d.unit = rank / unit_tokens;
      const int64_t kv_heads = planned_[d.index].problem->kv.num_kv_heads;
      d.token = (d.unit / kv_heads) * unit_tokens + in_block;
      d.head = (d.unit % kv_heads) * group + in_group;
      return d;
    };
    const Decoded o = decode(record.overflow);
    const Decoded e = decode(row_error);
    const bool overflow =
        row_error == kNoError ||
        (record.overflow != kNoError &&
         std::make_pair(o.index, o.unit) <= std::make_pair(e.index, e.unit));
    const Decoded& d = overflow ? o : e;
    const int64_t index = d.index;
    const int64_t token = d.token;
    const int64_t head = d.head;
    const AttentionProblem* problem =
        index < static_cast<int64_t>(planned_.size()) ? planned_[index].problem
                                                      : nullptr;
    const int64_t position =
        problem != nullptr ? problem->mask.query_start + token : token;
    // A problem alone in its call needs no index.
    const std::string label =
        planned_.size() > 1 ? absl::StrCat("problem ", index, ": ") : "";
    if (overflow) {
      return absl::InvalidArgumentError(absl::StrCat(
          label, "the logit of query row ", token, " (position ", position,
          "), head ", head, " overflows float32 (q.k * scale",
          problem != nullptr && problem->bias != nullptr ? " + bias" : "",
          " is not finite); rescale q or k"));
    }
    if (row_error == record.value_overflow) {
      return absl::InvalidArgumentError(absl::StrCat(
          label,
          "the weighted sum of the values overflowed float32 at query "
          "row ",
          token, " (position ", position, "), head ", head,
          "; rescale v (its rows are summed before the softmax "
          "normalization divides them)"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        label, "query row ", token, " (position ", position, "), head ", head,
        " sees no key and there is no sink logit; change the mask (causal, "
        "window, query_start, bias) or use the ZERO empty-row policy"));
  }
  for (const Planned& pl : planned_) {
    const AttentionProblem& problem = *pl.problem;
    const int64_t rows = problem.q.dim(0) * problem.q.dim(1);
    std::memcpy(problem.output, host(pl.output),
                static_cast<size_t>(rows * problem.kv.value_dim * 4));
    if (problem.lse != nullptr) {
      std::memcpy(problem.lse, host(pl.lse), static_cast<size_t>(rows * 4));
    }
    if (problem.weights != nullptr) {
      std::memcpy(problem.weights, host(pl.weights),
                  static_cast<size_t>(rows * problem.kv.length * 4));
    }
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace attention
