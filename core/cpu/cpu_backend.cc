#include "core/cpu/cpu_backend.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/dtype.h"

namespace attention {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// At most this many query rows per work item; kMaxRowHeadsPerItem
// (rows x query heads of a KV group) bounds the per-thread scratch while one
// converted K/V tile serves many rows.
constexpr int64_t kMaxRowsPerItem = 16;
constexpr int64_t kMaxRowHeadsPerItem = 256;

// Lanes of the canonical dot product: element d accumulates into lane
// d % kDotLanes and the lanes are then summed pairwise. A fixed pattern keeps
// logits bitwise stable whatever the compiler vectorises, and maps onto 8- or
// 16-wide SIMD registers in later kernels.
constexpr int kDotLanes = 16;

inline float Dot(const float* a, const float* b, int n) {
  float lanes[kDotLanes] = {};
  int d = 0;
  for (; d + kDotLanes <= n; d += kDotLanes) {
    // Fully unrolled so the lanes stay in registers.
#pragma GCC unroll 16
    for (int l = 0; l < kDotLanes; ++l) lanes[l] += a[d + l] * b[d + l];
  }
  for (int l = 0; d + l < n; ++l) lanes[l] += a[d + l] * b[d + l];
#pragma GCC unroll 4
  for (int width = kDotLanes / 2; width > 0; width /= 2) {
#pragma GCC unroll 8
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

// Element-wise helpers, written as fixed 16-wide blocks plus a tail so that
// -O2 vectorises them (its cost model rejects loops that need an epilogue).
// Element-wise, so the result does not depend on vectorisation.

// y[d] += a * x[d]
inline void Axpy(float a, const float* __restrict x, float* __restrict y,
                 int n) {
  int d = 0;
  for (; d + 16 <= n; d += 16) {
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) y[d + l] += a * x[d + l];
  }
  for (; d < n; ++d) y[d] += a * x[d];
}

// y[d] = a * y[d] + x[d]
inline void ScaleAdd(float a, const float* __restrict x, float* __restrict y,
                     int n) {
  int d = 0;
  for (; d + 16 <= n; d += 16) {
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) y[d + l] = a * y[d + l] + x[d + l];
  }
  for (; d < n; ++d) y[d] = a * y[d] + x[d];
}

// y[d] = y[d] * a + x[d] * b
inline void Combine(float a, const float* __restrict x, float b,
                    float* __restrict y, int n) {
  int d = 0;
  for (; d + 16 <= n; d += 16) {
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) y[d + l] = y[d + l] * a + x[d + l] * b;
  }
  for (; d < n; ++d) y[d] = y[d] * a + x[d] * b;
}

class CpuArena final : public DeviceArena {
 public:
  CpuArena(std::byte* data, int64_t size) : data_(data), size_(size) {}
  ~CpuArena() override { std::free(data_); }
  std::byte* data() override { return data_; }
  int64_t size_bytes() const override { return size_; }

 private:
  std::byte* data_;
  int64_t size_;
};

std::string CpuModelName() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    absl::string_view view(line);
    if (absl::ConsumePrefix(&view, "model name")) {
      const size_t colon = view.find(':');
      if (colon == absl::string_view::npos) continue;
      view.remove_prefix(colon + 1);
      view = absl::StripAsciiWhitespace(view);
      if (!view.empty()) return std::string(view);
    }
  }
  return "unknown CPU";
}

// One unit of parallel work: rows [row_begin, row_end) of one problem and
// every query head that reads KV head `kv_head`. Items write disjoint parts
// of the outputs.
struct WorkItem {
  int problem;
  int kv_head;
  int64_t row_begin;
  int64_t row_end;
};

// Per-thread buffers, grown on demand and reused across items and calls.
struct Scratch {
  std::vector<float> q;          // [rows * group][head_dim]
  std::vector<float> k;          // [kKeysPerTile][head_dim]
  std::vector<float> v;          // [kKeysPerTile][value_dim]
  std::vector<float> row_m;      // [rows * group]
  std::vector<float> row_l;      // [rows * group]
  std::vector<float> row_acc;    // [rows * group][value_dim]
  std::vector<float> chunk_m;    // [rows * group]
  std::vector<float> chunk_l;    // [rows * group]
  std::vector<float> chunk_acc;  // [rows * group][value_dim]
  std::vector<float> pv;         // [value_dim]
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

void Grow(std::vector<float>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) {
    buffer.resize(static_cast<size_t>(size));
  }
}

// The keys a query at absolute position p may see:
//   j <= hi && (j >= lo || j < sinks).
struct RowRange {
  int64_t lo;     // first window position (0 without a window)
  int64_t hi;     // last visible position (may be < 0: none)
  int64_t sinks;  // positions [0, sinks) are always visible (<= hi + 1)
};

RowRange VisibleRange(const MaskSpec& mask, int64_t length, int64_t p) {
  RowRange range;
  range.hi = mask.causal ? std::min(p, length - 1) : length - 1;
  if (mask.window > 0) {
    range.lo = std::max<int64_t>(0, p - mask.window + 1);
    range.sinks = std::min<int64_t>(mask.num_sink_tokens, range.hi + 1);
  } else {
    range.lo = 0;
    range.sinks = 0;
  }
  return range;
}

// Half-open key intervals, increasing and disjoint.
struct Intervals {
  int count = 0;
  int64_t begin[2];
  int64_t end[2];

  void Add(int64_t b, int64_t e) {
    if (b >= e) return;
    if (count > 0 && b <= end[count - 1]) {
      end[count - 1] = std::max(end[count - 1], e);
      return;
    }
    begin[count] = b;
    end[count] = e;
    ++count;
  }
};

// Keys visible to at least one row of [first_p, last_p]: the sink prefix of
// the last row and the window of the first row up to the last row's limit.
Intervals UnionRange(const MaskSpec& mask, int64_t length, int64_t first_p,
                     int64_t last_p) {
  const RowRange first = VisibleRange(mask, length, first_p);
  const RowRange last = VisibleRange(mask, length, last_p);
  Intervals intervals;
  intervals.Add(0, last.sinks);
  intervals.Add(first.lo, last.hi + 1);
  return intervals;
}

// Calls fn(t0) for every tile [t0, t0 + kKeysPerTile) holding a key of
// `keys`, in increasing order, each once.
template <typename Fn>
void ForEachTile(const Intervals& keys, Fn fn) {
  int64_t next = 0;  // first tile start not visited yet
  for (int i = 0; i < keys.count; ++i) {
    int64_t t0 = std::max(next, keys.begin[i] / kKeysPerTile * kKeysPerTile);
    for (; t0 < keys.end[i]; t0 += kKeysPerTile) fn(t0);
    next = std::max(next, t0);
  }
}

// Attention of one work item, following attention_problem.h exactly.
class ItemKernel {
 public:
  ItemKernel(const AttentionProblem& problem, int problem_index,
             const WorkItem& item)
      : pr_(problem),
        problem_index_(problem_index),
        item_(item),
        kv_(problem.kv),
        num_rows_total_(problem.q.dim(0)),
        num_heads_(static_cast<int>(problem.q.dim(1))),
        head_dim_(static_cast<int>(problem.q.dim(2))),
        value_dim_(problem.kv.value_dim),
        group_(num_heads_ / problem.kv.num_kv_heads),
        rows_(item.row_end - item.row_begin),
        row_heads_(rows_ * group_),
        first_head_(item.kv_head * group_),
        scratch_(ThreadScratch()) {}

  absl::Status Run();

 private:
  int64_t Position(int64_t r) const {
    return pr_.mask.query_start + item_.row_begin + r;
  }
  void LoadQueries();
  void LoadTile(int64_t t0, int64_t t1, const Intervals& keys,
                bool with_values);
  // Logits (bias included) of row r, group head hh over [t0, t1) into
  // `logits`, kNegInf where invisible; *any_visible tells whether any key
  // is. INVALID_ARGUMENT when a visible logit overflows.
  absl::Status TileLogits(int64_t r, int hh, int64_t t0, int64_t t1,
                          const RowRange& range, float* logits,
                          bool* any_visible);
  void UpdateChunk(int64_t idx, int64_t t0, int64_t t1, const float* logits);
  void MergeChunks();
  absl::Status Finish();
  void WriteWeights(const Intervals& keys);

  const AttentionProblem& pr_;
  const int problem_index_;
  const WorkItem& item_;
  const KvView& kv_;
  const int64_t num_rows_total_;
  const int num_heads_;
  const int head_dim_;
  const int value_dim_;
  const int group_;
  const int64_t rows_;
  const int64_t row_heads_;
  const int first_head_;
  Scratch& scratch_;
};

void ItemKernel::LoadQueries() {
  const TensorView& q = pr_.q;
  const int64_t element = DTypeSize(q.dtype);
  for (int64_t r = 0; r < rows_; ++r) {
    const int64_t offset =
        ((item_.row_begin + r) * num_heads_ + first_head_) * head_dim_;
    ConvertToFloat(q.dtype, q.data + offset * element,
                   int64_t{group_} * head_dim_,
                   scratch_.q.data() + r * group_ * head_dim_);
  }
}

void ItemKernel::LoadTile(int64_t t0, int64_t t1, const Intervals& keys,
                          bool with_values) {
  for (int i = 0; i < keys.count; ++i) {
    const int64_t b = std::max(t0, keys.begin[i]);
    const int64_t e = std::min(t1, keys.end[i]);
    for (int64_t j = b; j < e; ++j) {
      ConvertToFloat(kv_.dtype, kv_.key(j, item_.kv_head), head_dim_,
                     scratch_.k.data() + (j - t0) * head_dim_);
      if (with_values) {
        ConvertToFloat(kv_.dtype, kv_.value(j, item_.kv_head), value_dim_,
                       scratch_.v.data() + (j - t0) * value_dim_);
      }
    }
  }
}

absl::Status ItemKernel::TileLogits(int64_t r, int hh, int64_t t0, int64_t t1,
                                    const RowRange& range, float* logits,
                                    bool* any_visible) {
  const float* q = scratch_.q.data() + (r * group_ + hh) * head_dim_;
  const int head = first_head_ + hh;
  const int64_t row = item_.row_begin + r;
  const int64_t n = t1 - t0;
  float bias[kKeysPerTile];
  if (pr_.bias != nullptr) {
    const TensorView& b = *pr_.bias;
    const int64_t base = b.rank() == 3
                             ? (head * num_rows_total_ + row) * kv_.length
                             : row * kv_.length;
    ConvertToFloat(b.dtype, b.data + (base + t0) * DTypeSize(b.dtype), n, bias);
  }
  *any_visible = false;
  for (int64_t j = t0; j < t1; ++j) {
    float& s = logits[j - t0];
    s = kNegInf;
    if (j > range.hi || (j < range.lo && j >= range.sinks)) continue;
    if (pr_.bias != nullptr && bias[j - t0] == kNegInf) continue;
    s = Dot(q, scratch_.k.data() + (j - t0) * head_dim_, head_dim_) * pr_.scale;
    if (!std::isfinite(s)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Q @ K^T overflowed at problem ", problem_index_, ", query row ", row,
          " (position ", Position(r), "), head ", head, ", key position ", j,
          "; rescale the inputs"));
    }
    if (pr_.bias != nullptr) {
      s += bias[j - t0];
      if (!std::isfinite(s)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "adding the bias overflowed at problem ", problem_index_,
            ", query row ", row, " (position ", Position(r), "), head ", head,
            ", key position ", j, "; reduce the bias magnitude"));
      }
    }
    *any_visible = true;
  }
  return absl::OkStatus();
}

void ItemKernel::UpdateChunk(int64_t idx, int64_t t0, int64_t t1,
                             const float* logits) {
  const int64_t n = t1 - t0;
  float tile_max = kNegInf;
  for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, logits[j]);
  const float m_old = scratch_.chunk_m[idx];
  const float m_new = std::max(m_old, tile_max);
  const float alpha = m_old == kNegInf ? 0.0f : std::exp(m_old - m_new);
  float* pv = scratch_.pv.data();
  std::fill(pv, pv + value_dim_, 0.0f);
  float p_sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    if (logits[j] == kNegInf) continue;  // not visible to this row
    const float p = std::exp(logits[j] - m_new);
    p_sum += p;
    Axpy(p, scratch_.v.data() + j * value_dim_, pv, value_dim_);
  }
  scratch_.chunk_l[idx] = alpha * scratch_.chunk_l[idx] + p_sum;
  ScaleAdd(alpha, pv, scratch_.chunk_acc.data() + idx * value_dim_, value_dim_);
  scratch_.chunk_m[idx] = m_new;
}

void ItemKernel::MergeChunks() {
  for (int64_t idx = 0; idx < row_heads_; ++idx) {
    const float b_m = scratch_.chunk_m[idx];
    if (b_m == kNegInf) continue;  // empty chunk: nothing to merge
    float* a_acc = scratch_.row_acc.data() + idx * value_dim_;
    const float* b_acc = scratch_.chunk_acc.data() + idx * value_dim_;
    const float a_m = scratch_.row_m[idx];
    if (a_m == kNegInf) {
      // Empty row state: the merge is a copy.
      scratch_.row_m[idx] = b_m;
      scratch_.row_l[idx] = scratch_.chunk_l[idx];
      std::copy(b_acc, b_acc + value_dim_, a_acc);
    } else {
      const float m = std::max(a_m, b_m);
      const float ca = std::exp(a_m - m);
      const float cb = std::exp(b_m - m);
      scratch_.row_m[idx] = m;
      scratch_.row_l[idx] =
          scratch_.row_l[idx] * ca + scratch_.chunk_l[idx] * cb;
      Combine(ca, b_acc, cb, a_acc, value_dim_);
    }
  }
  // Start the next chunk empty.
  std::fill_n(scratch_.chunk_m.begin(), row_heads_, kNegInf);
  std::fill_n(scratch_.chunk_l.begin(), row_heads_, 0.0f);
  std::fill_n(scratch_.chunk_acc.begin(), row_heads_ * value_dim_, 0.0f);
}

absl::Status ItemKernel::Finish() {
  for (int64_t r = 0; r < rows_; ++r) {
    const int64_t row = item_.row_begin + r;
    for (int hh = 0; hh < group_; ++hh) {
      const int64_t idx = r * group_ + hh;
      const int head = first_head_ + hh;
      float* out = pr_.output + (row * num_heads_ + head) * value_dim_;
      const float l = scratch_.row_l[idx];
      float lse;
      if (l == 0.0f) {
        if (pr_.empty_row_policy == EmptyRowPolicy::kError) {
          return absl::InvalidArgumentError(absl::StrCat(
              "problem ", problem_index_, ": query row ", row, " (position ",
              Position(r), "), head ", head,
              " sees no key and has no sink logit, so its softmax is "
              "undefined; fix the mask/bias or use empty_row_policy ZERO to "
              "get zeros for padding rows"));
        }
        std::fill(out, out + value_dim_, 0.0f);
        lse = kNegInf;
      } else {
        const float* acc = scratch_.row_acc.data() + idx * value_dim_;
        for (int d = 0; d < value_dim_; ++d) out[d] = acc[d] / l;
        lse = scratch_.row_m[idx] + std::log(l);
      }
      if (pr_.lse != nullptr) pr_.lse[row * num_heads_ + head] = lse;
    }
  }
  return absl::OkStatus();
}

void ItemKernel::WriteWeights(const Intervals& keys) {
  const int64_t length = kv_.length;
  for (int64_t r = 0; r < rows_; ++r) {
    const int64_t row = item_.row_begin + r;
    for (int hh = 0; hh < group_; ++hh) {
      float* w =
          pr_.weights + ((first_head_ + hh) * num_rows_total_ + row) * length;
      std::fill(w, w + length, 0.0f);
    }
  }
  float logits[kKeysPerTile];
  ForEachTile(keys, [&](int64_t t0) {
    const int64_t t1 = std::min(t0 + kKeysPerTile, length);
    LoadTile(t0, t1, keys, /*with_values=*/false);
    for (int64_t r = 0; r < rows_; ++r) {
      const RowRange range = VisibleRange(pr_.mask, length, Position(r));
      const int64_t row = item_.row_begin + r;
      for (int hh = 0; hh < group_; ++hh) {
        const int64_t idx = r * group_ + hh;
        const float l = scratch_.row_l[idx];
        if (l == 0.0f) continue;  // empty row: zero weights
        bool any_visible;
        // Logits were checked in the first pass; this cannot fail.
        TileLogits(r, hh, t0, t1, range, logits, &any_visible).IgnoreError();
        if (!any_visible) continue;
        const float m = scratch_.row_m[idx];
        float* w =
            pr_.weights + ((first_head_ + hh) * num_rows_total_ + row) * length;
        for (int64_t j = t0; j < t1; ++j) {
          if (logits[j - t0] == kNegInf) continue;
          w[j] = std::exp(logits[j - t0] - m) / l;
        }
      }
    }
  });
}

absl::Status ItemKernel::Run() {
  Grow(scratch_.q, row_heads_ * head_dim_);
  Grow(scratch_.k, kKeysPerTile * head_dim_);
  Grow(scratch_.v, kKeysPerTile * value_dim_);
  Grow(scratch_.row_m, row_heads_);
  Grow(scratch_.row_l, row_heads_);
  Grow(scratch_.row_acc, row_heads_ * value_dim_);
  Grow(scratch_.chunk_m, row_heads_);
  Grow(scratch_.chunk_l, row_heads_);
  Grow(scratch_.chunk_acc, row_heads_ * value_dim_);
  Grow(scratch_.pv, value_dim_);

  LoadQueries();
  // Row states start from the learned sink (m = sink, l = 1) or empty.
  for (int64_t r = 0; r < rows_; ++r) {
    for (int hh = 0; hh < group_; ++hh) {
      const int64_t idx = r * group_ + hh;
      if (pr_.sink_logits.empty()) {
        scratch_.row_m[idx] = kNegInf;
        scratch_.row_l[idx] = 0.0f;
      } else {
        scratch_.row_m[idx] = pr_.sink_logits[first_head_ + hh];
        scratch_.row_l[idx] = 1.0f;
      }
    }
  }
  std::fill_n(scratch_.row_acc.begin(), row_heads_ * value_dim_, 0.0f);
  std::fill_n(scratch_.chunk_m.begin(), row_heads_, kNegInf);
  std::fill_n(scratch_.chunk_l.begin(), row_heads_, 0.0f);
  std::fill_n(scratch_.chunk_acc.begin(), row_heads_ * value_dim_, 0.0f);

  const int64_t length = kv_.length;
  const Intervals keys =
      UnionRange(pr_.mask, length, Position(0), Position(rows_ - 1));

  // Tiles are aligned to absolute positions; only tiles holding a key some
  // row of this item can see are visited (causal and window skipping).
  float logits[kKeysPerTile];
  int64_t chunk = -1;
  absl::Status status;
  ForEachTile(keys, [&](int64_t t0) {
    if (!status.ok()) return;
    const int64_t t1 = std::min(t0 + kKeysPerTile, length);
    const int64_t tile_chunk = t0 / kKeysPerSplit;
    if (tile_chunk != chunk) {
      if (chunk >= 0) MergeChunks();
      chunk = tile_chunk;
    }
    LoadTile(t0, t1, keys, /*with_values=*/true);
    for (int64_t r = 0; r < rows_; ++r) {
      const RowRange range = VisibleRange(pr_.mask, length, Position(r));
      // Skip rows that see nothing in this tile.
      if (range.hi < t0) continue;
      if (range.lo >= t1 && range.sinks <= t0) continue;
      for (int hh = 0; hh < group_; ++hh) {
        bool any_visible;
        status = TileLogits(r, hh, t0, t1, range, logits, &any_visible);
        if (!status.ok()) return;
        if (!any_visible) continue;
        UpdateChunk(r * group_ + hh, t0, t1, logits);
      }
    }
  });
  if (!status.ok()) return status;
  if (chunk >= 0) MergeChunks();

  status = Finish();
  if (!status.ok()) return status;
  if (pr_.weights != nullptr) WriteWeights(keys);
  return absl::OkStatus();
}

}  // namespace

CpuBackend::CpuBackend(int num_threads) : pool_(num_threads) {
  device_ = absl::StrCat(CpuModelName(), " (", pool_.num_threads(),
                         pool_.num_threads() == 1 ? " thread)" : " threads)");
}

CpuBackend::~CpuBackend() = default;

absl::StatusOr<std::unique_ptr<DeviceArena>> CpuBackend::AllocateArena(
    int64_t bytes) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV arena size must be >= 0, got ", bytes));
  }
  if (bytes == 0) return std::make_unique<CpuArena>(nullptr, 0);
  constexpr int64_t kAlignment = 64;
  const int64_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* memory = nullptr;
  // posix_memalign reserves address space only; pages are committed when
  // first written.
  if (rounded < bytes ||
      posix_memalign(&memory, kAlignment, static_cast<size_t>(rounded)) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate ", bytes,
        " bytes of host memory for the KV cache; lower --kv_cache_bytes"));
  }
  return std::make_unique<CpuArena>(static_cast<std::byte*>(memory), bytes);
}

absl::Status CpuBackend::WriteKv(const KvWrite& write) {
  const KvBlockLayout& layout = write.layout;
  const int64_t num_tokens = write.k.dim(0);
  const int num_kv_heads = layout.num_kv_heads;
  const int head_dim = layout.head_dim;
  const int value_dim = layout.value_dim;
  const int64_t tokens_per_block = layout.tokens_per_block;
  const int64_t element = DTypeSize(layout.dtype);
  const int64_t k_element = DTypeSize(write.k.dtype);
  const int64_t v_element = DTypeSize(write.v.dtype);

  if (num_tokens == 0) return absl::OkStatus();
  const int64_t first_block = write.start / tokens_per_block;
  const int64_t last_block = (write.start + num_tokens - 1) / tokens_per_block;
  for (int64_t block = first_block; block <= last_block; ++block) {
    if (block >= static_cast<int64_t>(write.blocks.size()) ||
        write.blocks[block] == nullptr) {
      return absl::InternalError(
          absl::StrCat("KV block ", block, " for positions from ",
                       std::max(write.start, block * tokens_per_block),
                       " is missing; this is a bug in the block pool"));
    }
  }
  // Each task converts a run of tokens into their blocks.
  constexpr int64_t kTokensPerTask = 64;
  const int64_t num_tasks = (num_tokens + kTokensPerTask - 1) / kTokensPerTask;
  pool_.ParallelFor(num_tasks, [&](int64_t task) {
    const int64_t end = std::min(num_tokens, (task + 1) * kTokensPerTask);
    for (int64_t t = task * kTokensPerTask; t < end; ++t) {
      const int64_t pos = write.start + t;
      std::byte* block = write.blocks[pos / tokens_per_block];
      const int64_t row = pos % tokens_per_block;
      for (int h = 0; h < num_kv_heads; ++h) {
        const int64_t slot = int64_t{h} * tokens_per_block + row;
        ConvertDType(
            write.k.dtype,
            write.k.data + (t * num_kv_heads + h) * head_dim * k_element,
            head_dim, layout.dtype, block + slot * head_dim * element);
        ConvertDType(
            write.v.dtype,
            write.v.data + (t * num_kv_heads + h) * value_dim * v_element,
            value_dim, layout.dtype,
            block + layout.value_offset_bytes() + slot * value_dim * element);
      }
    }
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyBlock(const std::byte* src, std::byte* dst,
                                   int64_t bytes) {
  if (bytes < 0 || (bytes > 0 && (src == nullptr || dst == nullptr))) {
    return absl::InternalError(
        absl::StrCat("invalid block copy of ", bytes,
                     " bytes; this is a bug in the caller"));
  }
  if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
  return absl::OkStatus();
}

absl::Status CpuBackend::Attend(absl::Span<const AttentionProblem> problems) {
  std::vector<WorkItem> items;
  for (size_t p = 0; p < problems.size(); ++p) {
    const AttentionProblem& problem = problems[p];
    const int64_t num_rows = problem.q.dim(0);
    const int num_kv_heads = problem.kv.num_kv_heads;
    const int64_t group = problem.q.dim(1) / num_kv_heads;
    const int64_t rows_per_item =
        std::clamp<int64_t>(kMaxRowHeadsPerItem / group, 1, kMaxRowsPerItem);
    for (int64_t r = 0; r < num_rows; r += rows_per_item) {
      for (int g = 0; g < num_kv_heads; ++g) {
        items.push_back(WorkItem{static_cast<int>(p), g, r,
                                 std::min(num_rows, r + rows_per_item)});
      }
    }
  }

  // Items run in any order, but the reported error is always that of the
  // lowest failing item: an item is skipped only when a lower one failed.
  std::vector<absl::Status> errors(items.size());
  std::atomic<int64_t> first_failed{std::numeric_limits<int64_t>::max()};
  pool_.ParallelFor(static_cast<int64_t>(items.size()), [&](int64_t i) {
    if (i > first_failed.load(std::memory_order_relaxed)) return;
    const WorkItem& item = items[i];
    ItemKernel kernel(problems[item.problem], item.problem, item);
    absl::Status status = kernel.Run();
    if (!status.ok()) {
      errors[i] = std::move(status);
      int64_t current = first_failed.load(std::memory_order_relaxed);
      while (i < current && !first_failed.compare_exchange_weak(
                                current, i, std::memory_order_relaxed)) {
      }
    }
  });
  const int64_t failed = first_failed.load();
  if (failed != std::numeric_limits<int64_t>::max()) return errors[failed];
  return absl::OkStatus();
}

}  // namespace attention
