#include "core/layer_kv_cache.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/session_snapshot.h"
#include "core/status_macros.h"
#include "core/visibility.h"

namespace attention {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

LayerKvCache::LayerKvCache(BlockPool* pool, const KvBlockLayout& layout,
                           const LayerSpec& mask,
                           std::shared_ptr<TenantUsage> usage)
    : pool_(pool), usage_(std::move(usage)), layout_(layout), mask_(mask) {}

LayerKvCache::~LayerKvCache() { Release(table_.stored()); }

void LayerKvCache::Release(absl::Span<const BlockId> ids) {
  pool_->UnrefAll(ids);
  if (usage_ != nullptr) usage_->UnrefAll(ids);
}

LayerKvCache::LayerKvCache(LayerKvCache&& other) noexcept
    : pool_(other.pool_),
      usage_(std::move(other.usage_)),
      layout_(other.layout_),
      mask_(std::move(other.mask_)),
      length_(other.length_),
      first_held_(other.first_held_),
      table_(std::move(other.table_)) {
  other.table_.Clear();
  other.length_ = 0;
  other.first_held_ = 0;
}

LayerKvCache LayerKvCache::Fork() const {
  LayerKvCache copy(pool_, layout_, mask_, usage_);
  copy.length_ = length_;
  copy.first_held_ = first_held_;
  copy.table_ = table_;
  for (BlockId id : table_.stored()) {
    if (id != kNoBlock) pool_->Ref(id);
  }
  if (usage_ != nullptr) usage_->RefAll(table_.stored());
  return copy;
}

namespace {

// The logical blocks of a restored layer: [0, blocks), of which the run
// [dropped_begin, dropped_end) holds no carried position (empty when every
// block holds one). Worked out without a walk over the blocks: an import
// sizes itself from an untrusted header before its admission.
struct RestoredBlocks {
  int64_t blocks = 0;
  int64_t dropped_begin = 0;
  int64_t dropped_end = 0;

  int64_t carried() const { return blocks - (dropped_end - dropped_begin); }
};

RestoredBlocks RestoredBlocksOf(const KvBlockLayout& layout,
                                const CarriedRanges& ranges) {
  // The sink's blocks [0, sink_end_block) and the window's
  // [window_start / tpb, blocks) hold carried positions.
  const int64_t tpb = layout.tokens_per_block;
  RestoredBlocks restored;
  restored.blocks = CeilDiv(ranges.length, tpb);
  const int64_t sink_end_block =
      std::min(restored.blocks, CeilDiv(ranges.sink_end, tpb));
  const int64_t window_block =
      std::min(restored.blocks, ranges.window_start / tpb);
  restored.dropped_begin = sink_end_block;
  restored.dropped_end = std::max(sink_end_block, window_block);
  return restored;
}

}  // namespace

int64_t LayerKvCache::RestoreBlocks(const KvBlockLayout& layout,
                                    const LayerSpec& mask, int64_t length,
                                    int64_t first_position) {
  return RestoredBlocksOf(layout, CarriedPositions(length, mask.num_sink_tokens,
                                                   first_position))
      .carried();
}

absl::StatusOr<LayerKvCache> LayerKvCache::Restore(
    BlockPool* pool, const KvBlockLayout& layout, const LayerSpec& mask,
    int64_t length, int64_t first_position, std::shared_ptr<TenantUsage> usage,
    BlockReservation* reservation) {
  const CarriedRanges ranges =
      CarriedPositions(length, mask.num_sink_tokens, first_position);
  const RestoredBlocks restored = RestoredBlocksOf(layout, ranges);
  std::vector<BlockId> blocks;
  ATTN_RETURN_IF_ERROR(pool->Allocate(restored.carried(), &blocks));
  LayerKvCache layer(pool, layout, mask, std::move(usage));
  layer.TakeReserved(blocks, reservation);
  layer.length_ = length;
  layer.first_held_ =
      ranges.window_start > ranges.sink_end ? ranges.window_start : 0;
  // The table as a window layer keeps it: the dropped run skipped.
  auto next = blocks.begin();
  for (int64_t b = 0; b < restored.dropped_begin; ++b) {
    layer.table_.push_back(*next++);
  }
  layer.table_.PushDropped(restored.dropped_end - restored.dropped_begin);
  while (next != blocks.end()) layer.table_.push_back(*next++);
  return layer;
}

LayerKvCache::ListedBlocks LayerKvCache::restore_blocks() const {
  ListedBlocks listed;
  listed.blocks.reserve(table_.stored().size());
  for (const BlockId id : table_.stored()) {
    listed.blocks.push_back(id == kNoBlock ? nullptr : pool_->data(id));
  }
  listed.gap_begin = table_.gap_begin();
  listed.gap_blocks = table_.gap();
  return listed;
}

int64_t LayerKvCache::FirstHeldPosition() const {
  // The rows from the start of the last run of blocks still held.
  int64_t b = table_.size();
  while (b > 0 && table_.at(b - 1) != kNoBlock) --b;
  return std::max(first_held_, b * layout_.tokens_per_block);
}

int64_t LayerKvCache::referenced_blocks() const {
  const absl::Span<const BlockId> stored = table_.stored();
  return std::count_if(stored.begin(), stored.end(),
                       [](BlockId id) { return id != kNoBlock; });
}

int64_t LayerKvCache::FirstNeededPosition(int64_t length) const {
  if (mask_.window <= 0) return 0;
  // A query at position >= length reads keys > length - window. One extra
  // block is kept so that short rollbacks (speculative decoding) still work.
  return std::max<int64_t>(
      0, FirstReachablePosition(mask_.window, length) -
             layout_.tokens_per_block);
}

LayerKvCache::PendingAppend::PendingAppend(BlockPool* pool,
                                           const KvBlockLayout& layout)
    : pool_(pool), layout_(layout) {}

LayerKvCache::PendingAppend::PendingAppend(PendingAppend&& other) noexcept
    : pool_(other.pool_),
      layout_(other.layout_),
      start_(other.start_),
      count_(other.count_),
      table_(std::move(other.table_)),
      allocated_(std::move(other.allocated_)),
      replaced_(std::move(other.replaced_)),
      bases_(std::move(other.bases_)),
      committed_(other.committed_) {
  other.committed_ = true;  // the moved-from object owns nothing
}

LayerKvCache::PendingAppend::~PendingAppend() {
  if (!committed_) pool_->UnrefAll(allocated_);
}

KvWrite LayerKvCache::PendingAppend::write_target() const {
  KvWrite write;
  write.layout = layout_;
  write.start = start_;
  write.blocks = absl::MakeConstSpan(bases_.data(), table_.stored().size());
  write.gap_begin = table_.gap_begin();
  write.gap_blocks = table_.gap();
  return write;
}

KvView LayerKvCache::PendingAppend::view() const {
  const size_t n = table_.stored().size();
  return PagedKvView(layout_, new_length(),
                     absl::Span<const std::byte* const>(bases_.data(), n),
                     absl::Span<const std::byte* const>(bases_.data() + n, n),
                     table_.gap_begin(), table_.gap());
}

int64_t LayerKvCache::BlocksToStage(int64_t count) const {
  const int64_t tpb = layout_.tokens_per_block;
  const bool copy_tail =
      length_ % tpb != 0 && pool_->RefCount(table_.at(length_ / tpb)) > 1;
  return CeilDiv(length_ + count, tpb) - table_.size() + (copy_tail ? 1 : 0);
}

absl::StatusOr<LayerKvCache::PendingAppend> LayerKvCache::PrepareAppend(
    int64_t count) {
  const int64_t tpb = layout_.tokens_per_block;
  PendingAppend pending(pool_, layout_);
  pending.start_ = length_;
  pending.count_ = count;

  // The block holding the current end is written in place unless another
  // session shares it, in which case the new tokens go to a private copy.
  const int64_t tail = length_ / tpb;
  const int64_t new_blocks = CeilDiv(length_ + count, tpb) - table_.size();
  pending.table_ = table_;
  pending.table_.reserve(table_.size() + std::max<int64_t>(new_blocks, 0));
  const bool copy_tail = BlocksToStage(count) > new_blocks;
  if (absl::Status status = pool_->Allocate(new_blocks + (copy_tail ? 1 : 0),
                                            &pending.allocated_);
      !status.ok()) {
    return status;
  }
  int64_t next = 0;
  if (copy_tail) {
    const BlockId copy = pending.allocated_[next++];
    if (absl::Status status = pool_->CopyBlock(table_.at(tail), copy);
        !status.ok()) {
      return status;  // `pending` releases what it allocated
    }
    pending.replaced_.push_back(table_.at(tail));
    pending.table_.mutable_at(tail) = copy;
  }
  while (next < static_cast<int64_t>(pending.allocated_.size())) {
    pending.table_.push_back(pending.allocated_[next++]);
  }

  const int64_t value_offset = layout_.value_offset_bytes();
  const absl::Span<const BlockId> stored = pending.table_.stored();
  const size_t n = stored.size();
  pending.bases_.resize(2 * n);
  for (size_t i = 0; i < n; ++i) {
    std::byte* base = stored[i] == kNoBlock ? nullptr : pool_->data(stored[i]);
    pending.bases_[i] = base;
    pending.bases_[n + i] = base == nullptr ? nullptr : base + value_offset;
  }
  return pending;
}

void LayerKvCache::TakeReserved(absl::Span<const BlockId> ids,
                                BlockReservation* reservation) {
  if (usage_ != nullptr) reservation->Take(ids);
}

void LayerKvCache::Commit(PendingAppend pending,
                          BlockReservation* reservation) {
  table_ = std::move(pending.table_);
  length_ = pending.new_length();
  TakeReserved(pending.allocated_, reservation);
  Release(pending.replaced_);
  pending.committed_ = true;
  DropUnneededBlocks();
}

void LayerKvCache::DropUnneededBlocks() {
  if (mask_.window <= 0) return;
  const int64_t tpb = layout_.tokens_per_block;
  const int64_t first_needed = FirstNeededPosition(length_);
  // Blocks dropped earlier are folded into the table's skipped run: the
  // walk jumps over it.
  for (int64_t b = table_.SkipGap(0); b < table_.size();
       b = table_.SkipGap(b + 1)) {
    const bool holds_sink = b * tpb < mask_.num_sink_tokens;
    const bool before_window = (b + 1) * tpb <= first_needed;
    if (!before_window) break;
    BlockId& id = table_.mutable_at(b);
    if (!holds_sink && id != kNoBlock) {
      Release(absl::MakeConstSpan(&id, 1));
      id = kNoBlock;
    }
  }
  table_.Compact();
}

absl::Status LayerKvCache::CheckTruncate(int64_t length) const {
  if (length >= length_ || mask_.window <= 0 || length == 0) {
    return absl::OkStatus();
  }
  // A query at `length` sees keys (length - window, length) besides sinks.
  const int64_t tpb = layout_.tokens_per_block;
  const int64_t first_visible = std::max<int64_t>(0, length - mask_.window + 1);
  // A restored layer holds no rows in [num_sink_tokens, first_held_).
  if (const int64_t first_needed =
          std::max<int64_t>(first_visible, mask_.num_sink_tokens);
      first_needed < std::min(first_held_, length)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "truncating to ", length, " tokens needs keys from position ",
        first_needed, ", which this sliding-window layer (window ",
        mask_.window,
        ") did not keep when it was restored from a snapshot (it was "
        "restored with positions from ",
        first_held_, ")"));
  }
  for (int64_t b = first_visible / tpb; b <= (length - 1) / tpb; ++b) {
    if (table_.at(b) != kNoBlock) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "truncating to ", length, " tokens needs keys from position ",
        first_visible, ", which this sliding-window layer (window ",
        mask_.window, ") has already dropped"));
  }
  return absl::OkStatus();
}

int64_t LayerKvCache::ShortestTruncation() const {
  if (mask_.window <= 0) return 0;
  // Every row from here on is held (0: every row).
  const int64_t first_held = FirstHeldPosition();
  if (first_held == 0) return 0;
  return std::min(first_held + mask_.window - 1, length_);
}

void LayerKvCache::Truncate(int64_t length) {
  if (length >= length_) return;
  const int64_t keep = CeilDiv(length, layout_.tokens_per_block);
  std::vector<BlockId> released;
  table_.Truncate(keep, &released);
  Release(released);
  length_ = length;
  first_held_ = std::min(first_held_, length);
  // Cut back inside the sinks, the layer misses no row any more.
  if (first_held_ <= mask_.num_sink_tokens) first_held_ = 0;
}

KvView LayerKvCache::view(std::vector<const std::byte*>* k_storage,
                          std::vector<const std::byte*>* v_storage) const {
  k_storage->clear();
  v_storage->clear();
  const int64_t value_offset = layout_.value_offset_bytes();
  for (const BlockId id : table_.stored()) {
    const std::byte* base = id == kNoBlock ? nullptr : pool_->data(id);
    k_storage->push_back(base);
    v_storage->push_back(base == nullptr ? nullptr : base + value_offset);
  }
  return PagedKvView(layout_, length_, *k_storage, *v_storage,
                     table_.gap_begin(), table_.gap());
}

}  // namespace attention
