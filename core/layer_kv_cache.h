// LayerKvCache: the paged KV history of one layer of one session.
//
// A block table maps logical block b (positions [b*T_b, (b+1)*T_b), T_b =
// tokens per block) to a pool block. Sliding-window layers drop blocks no
// future query can see (kNoBlock entries), keeping window + sink tokens plus
// one block of slack for rollbacks; the table stores no entry for the run
// of dropped blocks (BlockTable), so its memory follows the window, not the
// layer's length.
//
// Appends are staged: PrepareAppend allocates (and copies on write) every
// block the new tokens need without touching the cache; the caller writes
// K/V and runs attention against the staged table; Commit then publishes it.
// Dropping an uncommitted PendingAppend returns its blocks, so a failed call
// changes nothing.
#ifndef ATTENTION_CORE_LAYER_KV_CACHE_H_
#define ATTENTION_CORE_LAYER_KV_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/block_pool.h"
#include "core/block_table.h"
#include "core/kv_view.h"
#include "core/session_spec.h"
#include "core/tenant_usage.h"

namespace attention {

// Thread-safety: not thread-safe; the owning Session serialises access.
class LayerKvCache {
 public:
  // `pool` must outlive the cache. `mask` is the layer's resolved spec.
  // `usage`, when not null, is told of every block reference the cache
  // gains or drops (the owning tenant's accounting); the cache and its forks
  // keep it alive, so an export's blocks stay counted against the tenant
  // after the session went.
  LayerKvCache(BlockPool* pool, const KvBlockLayout& layout,
               const LayerSpec& mask,
               std::shared_ptr<TenantUsage> usage = nullptr);
  ~LayerKvCache();  // drops every block reference

  LayerKvCache(LayerKvCache&& other) noexcept;
  LayerKvCache& operator=(LayerKvCache&&) = delete;
  LayerKvCache(const LayerKvCache&) = delete;
  LayerKvCache& operator=(const LayerKvCache&) = delete;

  // A copy sharing every block (each gains a reference).
  LayerKvCache Fork() const;

  // Restoring a snapshot (core/session_snapshot.h): a layer of `length`
  // tokens holding blocks for the positions a snapshot carries,
  // CarriedPositions(length, mask.num_sink_tokens, first_position), with
  // unspecified contents. The caller writes every carried row through
  // restore_blocks(), then calls CompleteRestore(). `usage` is the owning
  // tenant's accounting, as in the constructor; `reservation` holds the
  // tenant's reservation of the blocks (TenantUsage::Reserve, the caller's
  // check against the quota), from which they move to `usage` at once
  // (BlockReservation::Take). Both null for a cache without accounting.
  // RESOURCE_EXHAUSTED (nothing taken) when the pool cannot supply
  // RestoreBlocks(...) blocks.
  // REQUIRES: 0 <= first_position <= length; reservation->usage() is
  // usage and holds at least RestoreBlocks(...) blocks.
  static absl::StatusOr<LayerKvCache> Restore(
      BlockPool* pool, const KvBlockLayout& layout, const LayerSpec& mask,
      int64_t length, int64_t first_position,
      std::shared_ptr<TenantUsage> usage, BlockReservation* reservation);
  // Blocks Restore takes for those arguments.
  static int64_t RestoreBlocks(const KvBlockLayout& layout,
                               const LayerSpec& mask, int64_t length,
                               int64_t first_position);
  // The layer's blocks as KvWrite lists them (KvWrite::blocks, gap_begin,
  // gap_blocks: the stored entries' base addresses, nullptr where none,
  // without the run a window layer dropped), for the writes that restore
  // it. REQUIRES: this layer shares no block (fresh from Restore).
  struct ListedBlocks {
    std::vector<std::byte*> blocks;
    int64_t gap_begin = 0;
    int64_t gap_blocks = 0;
  };
  ListedBlocks restore_blocks() const;
  // Drops the blocks this server's window slack does not keep.
  void CompleteRestore() { DropUnneededBlocks(); }

  // The first position past the sinks whose row this layer still holds
  // (0 when it holds every row): what a snapshot of it carries
  // (SnapshotHeader::first_positions).
  int64_t FirstHeldPosition() const;

  int64_t length() const { return length_; }
  const KvBlockLayout& layout() const { return layout_; }
  const LayerSpec& mask() const { return mask_; }
  // Blocks this layer references (shared blocks included).
  int64_t referenced_blocks() const;
  // Host memory of its block table (one entry per block it holds, plus
  // dropped ones not yet folded into the table's skipped run).
  int64_t table_bytes() const { return table_.bytes(); }

  // A staged append of `count` tokens at positions [start, start + count).
  class PendingAppend {
   public:
    PendingAppend(PendingAppend&& other) noexcept;
    PendingAppend& operator=(PendingAppend&&) = delete;
    ~PendingAppend();  // releases the staged blocks unless committed

    int64_t start() const { return start_; }
    int64_t new_length() const { return start_ + count_; }
    // Destination for the new K/V (k and v left for the caller to set).
    KvWrite write_target() const;
    // Keys [0, new_length) as attention will see them after the append.
    KvView view() const;

   private:
    friend class LayerKvCache;
    PendingAppend(BlockPool* pool, const KvBlockLayout& layout);

    BlockPool* pool_;
    KvBlockLayout layout_;
    int64_t start_ = 0;
    int64_t count_ = 0;
    BlockTable table_;                // the staged block table
    std::vector<BlockId> allocated_;  // owned until commit
    std::vector<BlockId> replaced_;   // originals replaced by COW copies
    // Per stored entry of table_ (n of them, without its skipped run, so
    // that a step costs the blocks the layer holds, not its length): the
    // keys' base address in [0, n), the values' in [n, 2n); nullptr where
    // the entry has no block. One buffer, so a step allocates it once.
    std::vector<std::byte*> bases_;
    bool committed_ = false;
  };

  // Blocks PrepareAppend(count) would take from the pool: new blocks plus
  // a private copy of a shared tail block.
  int64_t BlocksToStage(int64_t count) const;

  // Stages `count` >= 1 new tokens. RESOURCE_EXHAUSTED when the pool cannot
  // supply the blocks; INTERNAL when a copy-on-write copy fails. Nothing
  // changes on error.
  absl::StatusOr<PendingAppend> PrepareAppend(int64_t count);

  // Publishes `pending`, which must come from this cache's latest
  // PrepareAppend with no other change in between, then drops the blocks a
  // window layer no longer needs. The blocks it took move from
  // `reservation` (the tenant's reservation of BlocksToStage blocks) to the
  // tenant's usage in one step (BlockReservation::Take); null for a cache
  // without accounting.
  void Commit(PendingAppend pending, BlockReservation* reservation);

  // OK when Truncate(length) keeps every key a query at position `length`
  // could see; FAILED_PRECONDITION when a window layer already dropped one.
  absl::Status CheckTruncate(int64_t length) const;
  // The shortest length from which on every length passes CheckTruncate:
  // past the last row a window layer dropped (or did not carry when it was
  // restored), one window's span; 0 for a layer that misses no row.
  int64_t ShortestTruncation() const;
  // Cuts the layer back to min(length(), length) tokens, releasing blocks
  // past the end. REQUIRES: CheckTruncate(length) is OK.
  void Truncate(int64_t length);

  // Keys [0, length()) as they are now; valid until the next change.
  KvView view(std::vector<const std::byte*>* k_storage,
              std::vector<const std::byte*>* v_storage) const;

 private:
  // First position a future query (at >= length) may read, with slack.
  int64_t FirstNeededPosition(int64_t length) const;
  void DropUnneededBlocks();
  // Drops one reference (pool and tenant) to each id that is not kNoBlock.
  void Release(absl::Span<const BlockId> ids);
  // Counts `ids`, just taken from the pool, as the tenant's, moving them out
  // of `reservation` (Commit, Restore).
  void TakeReserved(absl::Span<const BlockId> ids,
                    BlockReservation* reservation);

  BlockPool* pool_;
  std::shared_ptr<TenantUsage> usage_;
  KvBlockLayout layout_;
  LayerSpec mask_;
  int64_t length_ = 0;
  // Positions in [num_sink_tokens, first_held_) may have no row even where
  // their block exists (a restored window layer carries only what it
  // still needs); 0 for a layer built by appends.
  int64_t first_held_ = 0;
  BlockTable table_;
};

}  // namespace attention

#endif  // ATTENTION_CORE_LAYER_KV_CACHE_H_
