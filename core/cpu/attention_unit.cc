#include "core/cpu/attention_unit.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/status_macros.h"
#include "core/visibility.h"

namespace attention::cpu {

ElementType ToElementType(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return ElementType::kFloat16;
    case DType::kBFloat16:
      return ElementType::kBFloat16;
    case DType::kFloat32:
      break;
  }
  return ElementType::kFloat32;
}

namespace {

static_assert(kTileKeys == kKeysPerTile,
              "the kernels work on kKeysPerTile keys at a time");
static_assert(kKeysPerTile <= 32, "row visibility is a 32-bit mask");

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Units of several query rows and at least this many row-heads widen
// half-precision rows once per tile (UnitRunner::widen_rows_). Decode units
// (one row) read them in place whatever their group: their rows come from
// memory and are used by few row-heads, and the extra pass made an fp16
// GQA 32/4 decode a quarter slower.
constexpr int64_t kWidenRowHeads = 32;

// Units are the error units of attention_problem.h: at most 16 query rows,
// and at most 256 row-heads (rows x query heads of a KV group), which bounds
// the per-thread scratch while each K/V row load serves many row-heads.

int64_t PadToLanes(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// A growable 64-byte aligned float buffer; contents are not kept on growth.
class FloatBuffer {
 public:
  FloatBuffer() = default;
  FloatBuffer(const FloatBuffer&) = delete;
  FloatBuffer& operator=(const FloatBuffer&) = delete;
  ~FloatBuffer() { std::free(data_); }

  float* Get(int64_t size) {
    if (size > capacity_) {
      std::free(data_);
      capacity_ = std::max<int64_t>(size, capacity_ * 2);
      const size_t bytes = (static_cast<size_t>(capacity_) * 4 + 63) / 64 * 64;
      data_ = static_cast<float*>(std::aligned_alloc(64, bytes));
      if (data_ == nullptr) std::abort();  // out of memory, as operator new
    }
    return data_;
  }
  // Like Get, but the buffer holds zeros (callers never write to it).
  const float* Zeros(int64_t size) {
    if (size > capacity_) {
      float* data = Get(size);
      std::memset(data, 0, sizeof(float) * capacity_);
    }
    return data_;
  }

 private:
  float* data_ = nullptr;
  int64_t capacity_ = 0;
};

// Per-thread buffers, grown on demand and reused across units and calls.
}  // namespace

struct Scratch {
  FloatBuffer q;  // [row_heads][head_dim_padded]
  // Rows converted to padded floats when head_dim / value_dim is not a
  // multiple of kLanes (other rows are read in place).
  FloatBuffer keys;         // [kKeysPerTile][head_dim_padded]
  FloatBuffer values;       // [kKeysPerTile][value_dim_padded]
  FloatBuffer zeros;        // a zero row for keys a unit does not load
  FloatBuffer row_state;    // (m, l, acc) of every row-head
  FloatBuffer chunk_state;  // (m, l, acc) of the current chunk
  FloatBuffer bias;         // [row_heads][kKeysPerTile] converted bias
  FloatBuffer work;         // kernel scratch: [row_heads][kKeysPerTile + 1]
  const std::byte* key_rows[kKeysPerTile];
  const std::byte* value_rows[kKeysPerTile];
  const std::byte* next_key_rows[kKeysPerTile];  // prefetched
  const std::byte* next_value_rows[kKeysPerTile];
  std::vector<uint32_t> visible;        // [rows]
  std::vector<const float*> bias_rows;  // [row_heads]
  std::vector<int> active;              // [row_heads] kernel scratch
};

namespace {

Scratch& ThreadScratch(int slot) {
  thread_local Scratch scratch[kMaxInterleavedUnits];
  return scratch[slot];
}

// The keys a query at absolute position p may see:
//   j <= hi && (j >= lo || j < sinks).
struct RowRange {
  int64_t lo;     // first window position (0 without a window)
  int64_t hi;     // last visible position (may be < 0: none)
  int64_t sinks;  // positions [0, sinks) are always visible (<= hi + 1)
};

RowRange VisibleRange(const MaskSpec& mask, int64_t length, int64_t p) {
  const VisibleKeys keys = VisibleKeysOf(mask.causal, mask.window,
                                         mask.num_sink_tokens, length, p);
  return RowRange{.lo = keys.lo, .hi = keys.hi, .sinks = keys.sinks};
}

// Calls fn(t0) for every tile [t0, t0 + kKeysPerTile) inside [lo, hi)
// holding a key of `keys`, in increasing order, each once (core/
// work_plan.h's tiles). REQUIRES: lo and hi are multiples of kKeysPerTile,
// or hi is past every key of `keys`.
template <typename Fn>
void ForEachTile(const KeyRanges& keys, int64_t lo, int64_t hi, Fn fn) {
  const TileRanges tiles = TilesOf(keys).Clip(
      lo / kKeysPerTile, (hi + kKeysPerTile - 1) / kKeysPerTile);
  for (int64_t i = 0; i < tiles.size(); ++i) fn(tiles.tile(i) * kKeysPerTile);
}

// Bits [a - t0, b - t0] of a tile starting at t0 (positions a..b).
uint32_t BitSpan(int64_t a, int64_t b, int64_t t0) {
  if (a > b) return 0;
  const int lo = static_cast<int>(a - t0);
  const int hi = static_cast<int>(b - t0);
  const uint32_t upto = hi >= 31 ? 0xffffffffu : (uint32_t{1} << (hi + 1)) - 1;
  return upto & ~((uint32_t{1} << lo) - 1);
}

}  // namespace

ProblemInfo DescribeProblem(const AttentionProblem& problem) {
  ProblemInfo info;
  info.rows = problem.q.dim(0);
  info.heads = static_cast<int>(problem.q.dim(1));
  info.head_dim = static_cast<int>(problem.q.dim(2));
  info.kv_heads = problem.kv.num_kv_heads;
  info.group = info.heads / info.kv_heads;
  info.value_dim = problem.kv.value_dim;
  info.head_dim_padded = static_cast<int>(PadToLanes(info.head_dim));
  info.value_dim_padded = static_cast<int>(PadToLanes(info.value_dim));
  info.length = problem.kv.length;
  info.kv_type = ToElementType(problem.kv.dtype);
  info.direct_keys = info.head_dim == info.head_dim_padded;
  info.direct_values = info.value_dim == info.value_dim_padded;
  info.rows_per_unit = ErrorUnitTokens(info.group);
  return info;
}

UnitRunner::UnitRunner(const KernelTable& kernels,
                       const AttentionProblem& problem, const ProblemInfo& info,
                       const Unit& unit, int slot)
    : kernels_(kernels),
      pr_(problem),
      info_(info),
      unit_(unit),
      rows_(unit.row_end - unit.row_begin),
      row_heads_(rows_ * info.group),
      widen_rows_(info.kv_type != ElementType::kFloat32 && rows_ > 1 &&
                  row_heads_ >= kWidenRowHeads),
      first_head_(unit.kv_head * info.group),
      state_floats_(StateFloats(row_heads_, info.value_dim_padded)),
      scratch_(ThreadScratch(slot)) {}

void UnitRunner::LoadQueries() {
  const TensorView& q = pr_.q;
  const int64_t element = DTypeSize(q.dtype);
  const int hd = info_.head_dim;
  const int hdp = info_.head_dim_padded;
  float* out = scratch_.q.Get(row_heads_ * hdp);
  for (int64_t r = 0; r < rows_; ++r) {
    for (int h = 0; h < info_.group; ++h) {
      const int64_t offset =
          ((unit_.row_begin + r) * info_.heads + first_head_ + h) * hd;
      float* row = out + (r * info_.group + h) * hdp;
      ConvertToFloat(q.dtype, q.data + offset * element, hd, row);
      std::fill(row + hd, row + hdp, 0.0f);
    }
  }
  q_ = out;
}

// Row states start from the learned sink (m = sink, l = 1) or empty.
void UnitRunner::InitRowState(float* state) {
  float* m = state;
  float* l = state + row_heads_;
  for (int64_t r = 0; r < rows_; ++r) {
    for (int h = 0; h < info_.group; ++h) {
      const int64_t rh = r * info_.group + h;
      if (pr_.sink_logits.empty()) {
        m[rh] = kNegInf;
        l[rh] = 0.0f;
      } else {
        m[rh] = pr_.sink_logits[first_head_ + h];
        l[rh] = 1.0f;
      }
    }
  }
  std::fill(state + 2 * row_heads_, state + state_floats_, 0.0f);
}

void UnitRunner::MergeInto(float* row_state, const float* chunk_state) {
  const int vdp = info_.value_dim_padded;
  for (int64_t rh = 0; rh < row_heads_; ++rh) {
    const float chunk_m = chunk_state[rh];
    if (chunk_m == kNegInf) continue;  // empty chunk: nothing to merge
    kernels_.merge_state(row_state + rh, row_state + row_heads_ + rh,
                         row_state + 2 * row_heads_ + rh * vdp, chunk_m,
                         chunk_state[row_heads_ + rh],
                         chunk_state + 2 * row_heads_ + rh * vdp, vdp);
  }
}

void UnitRunner::FindRows(int64_t t0, int64_t t1, bool values,
                          const std::byte** rows) const {
  const KvView& kv = pr_.kv;
  std::fill(rows, rows + (t1 - t0), nullptr);
  const int64_t element = DTypeSize(kv.dtype);
  const int64_t token_stride =
      (values ? kv.v_token_stride : kv.k_token_stride) * element;
  const int64_t head_offset =
      unit_.kv_head * (values ? kv.v_head_stride : kv.k_head_stride) * element;
  auto block_base = [&kv, values](int64_t block) {
    return values ? kv.v_block(block) : kv.k_block(block);
  };
  for (int i = 0; i < unit_.keys.count; ++i) {
    const int64_t b = std::max(unit_.keys.begin[i], t0);
    const int64_t e = std::min(unit_.keys.end[i], t1);
    if (b >= e) continue;
    // Walk the blocks incrementally (one division per run, not per key).
    int64_t block = b / kv.tokens_per_block;
    int64_t row = b % kv.tokens_per_block;
    const std::byte* p = block_base(block) + head_offset + row * token_stride;
    for (int64_t pos = b; pos < e; ++pos) {
      rows[pos - t0] = p;
      p += token_stride;
      if (++row == kv.tokens_per_block && pos + 1 < e) {
        row = 0;
        p = block_base(++block) + head_offset;
      }
    }
  }
}

ElementType UnitRunner::LoadRows(int64_t t0, int64_t t1, bool values,
                                 const std::byte** rows) {
  const int n = static_cast<int>(t1 - t0);
  if (t0 == found_t0_ && t1 == found_t1_) {
    // Found already, to prefetch them during the previous tile.
    std::copy_n(values ? scratch_.next_value_rows : scratch_.next_key_rows, n,
                rows);
  } else {
    FindRows(t0, t1, values, rows);
  }
  const bool direct =
      !widen_rows_ && (values ? info_.direct_values : info_.direct_keys);
  const int dim = values ? info_.value_dim : info_.head_dim;
  const int stride = values ? info_.value_dim_padded : info_.head_dim_padded;
  if (direct) {
    if (CoversTile(t0, t1)) return info_.kv_type;
    // Zero bytes are +0 in every element type. One size for keys and
    // values: growing the buffer for the values would free the zeros the
    // tile's key rows point at.
    const std::byte* zeros = reinterpret_cast<const std::byte*>(
        scratch_.zeros.Zeros(std::max(info_.head_dim_padded,
                                      info_.value_dim_padded)));
    for (int j = 0; j < n; ++j) {
      if (rows[j] == nullptr) rows[j] = zeros;
    }
    return info_.kv_type;
  }
  float* buffer = (values ? scratch_.values : scratch_.keys)
                      .Get(int64_t{kKeysPerTile} * stride);
  kernels_.convert_rows(info_.kv_type, rows, n, dim, stride, buffer);
  for (int j = 0; j < n; ++j) {
    rows[j] = reinterpret_cast<const std::byte*>(buffer + int64_t{j} * stride);
  }
  return ElementType::kFloat32;
}

bool UnitRunner::PrepareTile(int64_t t0, int64_t t1, bool with_values,
                             TileJob* job) {
  const int n = static_cast<int>(t1 - t0);
  uint32_t* visible = scratch_.visible.data();
  bool any = false;
  for (int64_t r = 0; r < rows_; ++r) {
    const RowRange range = VisibleRange(pr_.mask, info_.length, Position(r));
    const uint32_t window =
        BitSpan(std::max(range.lo, t0), std::min(range.hi, t1 - 1), t0);
    const uint32_t sinks =
        BitSpan(t0, std::min({range.sinks - 1, range.hi, t1 - 1}), t0);
    visible[r] = window | sinks;
    any |= visible[r] != 0;
  }
  if (!any) return false;

  job->n = n;
  job->head_dim_padded = info_.head_dim_padded;
  job->value_dim_padded = info_.value_dim_padded;
  job->rows = static_cast<int>(rows_);
  job->group = info_.group;
  job->scale = pr_.scale;
  job->q = q_;
  job->visible = visible;
  job->key_type = LoadRows(t0, t1, /*values=*/false, scratch_.key_rows);
  job->k = scratch_.key_rows;
  if (with_values) {
    job->value_type = LoadRows(t0, t1, /*values=*/true, scratch_.value_rows);
    job->v = scratch_.value_rows;
  }
  float* work = scratch_.work.Get(row_heads_ * (kKeysPerTile + 1));
  job->work = work;
  job->alpha = work + row_heads_ * kKeysPerTile;
  job->active = scratch_.active.data();
  job->bias = nullptr;
  if (pr_.bias != nullptr) {
    const TensorView& b = *pr_.bias;
    const int64_t element = DTypeSize(b.dtype);
    float* converted = scratch_.bias.Get(row_heads_ * kKeysPerTile);
    for (int64_t r = 0; r < rows_; ++r) {
      const int64_t row = unit_.row_begin + r;
      for (int h = 0; h < info_.group; ++h) {
        const int64_t rh = r * info_.group + h;
        const int64_t base =
            (b.rank() == 3 ? ((first_head_ + h) * info_.rows + row) : row) *
                info_.length +
            t0;
        if (b.dtype == DType::kFloat32) {
          scratch_.bias_rows[rh] =
              reinterpret_cast<const float*>(b.data) + base;
        } else {
          float* out = converted + rh * kKeysPerTile;
          ConvertToFloat(b.dtype, b.data + base * element, n, out);
          scratch_.bias_rows[rh] = out;
        }
      }
    }
    job->bias = scratch_.bias_rows.data();
  }
  return true;
}

std::string ProblemLabel(int64_t index, absl::string_view separator) {
  return index < 0 ? "" : absl::StrCat("problem ", index, separator);
}

std::string UnitRunner::ProblemLabel(absl::string_view separator) const {
  return cpu::ProblemLabel(
      pr_.origin != nullptr ? pr_.origin->problem : info_.message_index,
      separator);
}

std::string UnitRunner::RowName(int64_t r, int head) const {
  const ProblemOrigin* origin = pr_.origin;
  const int64_t row = unit_.row_begin + r;
  return absl::StrCat("query row ", origin != nullptr ? origin->row + row : row,
                      " (position ",
                      origin != nullptr ? origin->position + row : Position(r),
                      "), head ", head);
}

absl::Status UnitRunner::TileFailure(TileError error, const TileJob& job,
                                     int64_t t0) {
  const int64_t r = job.error_row_head / info_.group;
  const int head = first_head_ + job.error_row_head % info_.group;
  const std::string where =
      absl::StrCat(" at ", ProblemLabel(", "), RowName(r, head),
                   ", key position ", KeyName(t0 + job.error_key));
  if (error == TileError::kBiasOverflow) {
    return absl::InvalidArgumentError(absl::StrCat(
        "adding the bias overflowed", where, "; reduce the bias magnitude"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("Q @ K^T overflowed", where, "; rescale the inputs"));
}

void UnitRunner::StartChunk(float* state, TileJob* job) const {
  std::fill(state, state + row_heads_, kNegInf);
  std::fill(state + row_heads_, state + state_floats_, 0.0f);
  job->m = state;
  job->l = state + row_heads_;
  job->acc = state + 2 * row_heads_;
}

absl::Status UnitRunner::Tile(int64_t t0, TileJob* job, UnitRunner& next,
                              int64_t next_t0) {
  const int64_t t1 = std::min(t0 + kKeysPerTile, info_.length);
  if (!PrepareTile(t0, t1, /*with_values=*/true, job)) {
    return absl::OkStatus();
  }
  // The kernel prefetches the next tile's rows while it works on this
  // one: paged blocks are short runs the hardware prefetcher handles
  // badly, and prefetching a whole tile at once stalls on fill buffers.
  const int64_t next_t1 = std::min(next_t0 + kKeysPerTile, info_.length);
  job->prefetch_n = static_cast<int>(std::max<int64_t>(next_t1 - next_t0, 0));
  if (job->prefetch_n > 0) {
    next.FindRows(next_t0, next_t1, /*values=*/false,
                  next.scratch_.next_key_rows);
    next.FindRows(next_t0, next_t1, /*values=*/true,
                  next.scratch_.next_value_rows);
    next.found_t0_ = next_t0;
    next.found_t1_ = next_t1;
  }
  job->prefetch_k = next.scratch_.next_key_rows;
  job->prefetch_v = next.scratch_.next_value_rows;
  job->prefetch_key_bytes = info_.head_dim * DTypeSize(pr_.kv.dtype);
  job->prefetch_value_bytes = info_.value_dim * DTypeSize(pr_.kv.dtype);
  const TileError error = kernels_.update_tile(job);
  if (error != TileError::kNone) return TileFailure(error, *job, t0);
  return absl::OkStatus();
}

absl::Status UnitRunner::Finish(const float* state) {
  const float* m = state;
  const float* l = state + row_heads_;
  const float* acc = state + 2 * row_heads_;
  const int vd = info_.value_dim;
  for (int64_t r = 0; r < rows_; ++r) {
    const int64_t row = unit_.row_begin + r;
    for (int h = 0; h < info_.group; ++h) {
      const int64_t rh = r * info_.group + h;
      const int head = first_head_ + h;
      float* out = pr_.output + (row * info_.heads + head) * vd;
      float lse = kNegInf;
      if (l[rh] == 0.0f) {
        if (pr_.empty_row_policy == EmptyRowPolicy::kError) {
          return absl::InvalidArgumentError(absl::StrCat(
              ProblemLabel(": "), RowName(r, head),
              " sees no key and has no sink logit, so its softmax is "
              "undefined; fix the mask/bias or use empty_row_policy ZERO to "
              "get zeros for padding rows"));
        }
        std::fill(out, out + vd, 0.0f);
      } else {
        if (!kernels_.divide_row(acc + rh * info_.value_dim_padded, l[rh], vd,
                                 out)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "the weighted sum of the values overflowed float32 at ",
              ProblemLabel(", "), RowName(r, head),
              "; rescale v (its rows are summed before the softmax "
              "normalization divides them)"));
        }
        // Only when asked for: a logarithm per row-head is a measurable
        // share of a short decode step.
        if (pr_.lse != nullptr) lse = m[rh] + std::log(l[rh]);
      }
      if (pr_.lse != nullptr) pr_.lse[row * info_.heads + head] = lse;
    }
  }
  return absl::OkStatus();
}

void UnitRunner::WriteWeights(const float* state) {
  const float* m = state;
  const float* l = state + row_heads_;
  const int64_t length = info_.length;
  for (int64_t r = 0; r < rows_; ++r) {
    const int64_t row = unit_.row_begin + r;
    for (int h = 0; h < info_.group; ++h) {
      float* w = pr_.weights + ((first_head_ + h) * info_.rows + row) * length;
      std::fill(w, w + length, 0.0f);
    }
  }
  float logits[kKeysPerTile];
  TileJob job;
  ForEachTile(unit_.keys, 0, length, [&](int64_t t0) {
    const int64_t t1 = std::min(t0 + kKeysPerTile, length);
    if (!PrepareTile(t0, t1, /*with_values=*/false, &job)) return;
    for (int64_t r = 0; r < rows_; ++r) {
      if (job.visible[r] == 0) continue;
      const int64_t row = unit_.row_begin + r;
      for (int h = 0; h < info_.group; ++h) {
        const int64_t rh = r * info_.group + h;
        if (l[rh] == 0.0f) continue;  // empty row: zero weights
        // Logits were checked in the first pass; this cannot fail.
        if (kernels_.tile_logits(&job, static_cast<int>(rh), logits) !=
            TileError::kNone) {
          continue;
        }
        float* w =
            pr_.weights + ((first_head_ + h) * info_.rows + row) * length;
        kernels_.tile_weights(logits, job.n, m[rh], l[rh], w + t0);
      }
    }
  });
}

void UnitRunner::Begin() {
  scratch_.visible.resize(std::max<size_t>(scratch_.visible.size(), rows_));
  scratch_.bias_rows.resize(
      std::max<size_t>(scratch_.bias_rows.size(), row_heads_));
  scratch_.active.resize(std::max<size_t>(scratch_.active.size(), row_heads_));
  LoadQueries();
}

void UnitRunner::BeginWhole(int64_t count) {
  Begin();
  row_state_ = scratch_.row_state.Get(state_floats_);
  // A lone chunk without sink logits is its own row state: merging it into
  // an empty row state would copy it (row-heads it shows no key stay empty
  // either way), and for short decode steps that copy and the fill cost as
  // much as a tile.
  lone_ = count == 1 && pr_.sink_logits.empty();
  chunk_state_ = lone_ ? row_state_ : scratch_.chunk_state.Get(state_floats_);
  if (!lone_) InitRowState(row_state_);
}

void UnitRunner::EndChunk() {
  if (!lone_) MergeInto(row_state_, chunk_state_);
}

absl::Status UnitRunner::EndWhole() {
  ATTN_RETURN_IF_ERROR(Finish(row_state_));
  if (pr_.weights != nullptr) WriteWeights(row_state_);
  return absl::OkStatus();
}

void UnitRunner::RunInterleaved(absl::Span<UnitRunner* const> runners,
                                const int64_t* chunks, int64_t count,
                                float* const* states, absl::Status* statuses) {
  const int n = static_cast<int>(runners.size());
  for (UnitRunner* runner : runners) {
    if (states == nullptr) {
      runner->BeginWhole(count);
    } else {
      runner->Begin();
    }
  }
  TileJob jobs[kMaxInterleavedUnits];
  const UnitRunner& first = *runners[0];
  for (int64_t i = 0; i < count; ++i) {
    for (int k = 0; k < n; ++k) {
      UnitRunner& runner = *runners[k];
      if (statuses[k].ok()) statuses[k] = CheckCall(runner.pr_.control);
      if (!statuses[k].ok()) continue;
      runner.StartChunk(states == nullptr
                            ? runner.chunk_state_
                            : states[k] + i * runner.state_floats_,
                        &jobs[k]);
    }
    const int64_t lo = chunks[i] * kKeysPerSplit;
    const int64_t hi = std::min(lo + kKeysPerSplit, first.info_.length);
    // Tiles are aligned to absolute positions; only tiles holding a key
    // some row of the units can see are visited (causal and window
    // skipping).
    ForEachTile(first.unit_.keys, lo, hi, [&](int64_t t0) {
      for (int k = 0; k < n; ++k) {
        if (!statuses[k].ok()) continue;
        // Prefetch the next unit's rows of this tile (the next KV head's
        // runs in the same blocks); the last unit the first one's next.
        const bool last = k + 1 == n;
        statuses[k] = runners[k]->Tile(t0, &jobs[k], *runners[last ? 0 : k + 1],
                                       last ? t0 + kKeysPerTile : t0);
      }
    });
    if (states != nullptr) continue;
    for (int k = 0; k < n; ++k) {
      if (statuses[k].ok()) runners[k]->EndChunk();
    }
  }
  if (states != nullptr) return;
  for (int k = 0; k < n; ++k) {
    if (statuses[k].ok()) statuses[k] = runners[k]->EndWhole();
  }
}

absl::Status UnitRunner::ComputeChunkStates(const int64_t* chunks,
                                            int64_t count, float* states) {
  UnitRunner* self = this;
  absl::Status status;
  RunInterleaved({&self, 1}, chunks, count, &states, &status);
  return status;
}

absl::Status UnitRunner::MergeAndFinish(int64_t count, const float* states) {
  float* row_state = scratch_.row_state.Get(state_floats_);
  InitRowState(row_state);
  for (int64_t i = 0; i < count; ++i) {
    MergeInto(row_state, states + i * state_floats_);
  }
  return Finish(row_state);
}

}  // namespace attention::cpu
