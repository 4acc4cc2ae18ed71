// BlockTable: the block table of one layer of one session, stored without
// the blocks a sliding-window layer has dropped.
//
// Logical block b holds positions [b*T_b, (b+1)*T_b). A window layer keeps
// its sink blocks at the front and the blocks its window still reaches at
// the back; everything between is dropped for good. The table stores the
// entries of every logical block except one skipped run, [gap_begin,
// gap_begin + gap), whose blocks are all dropped (kNoBlock): so its memory
// follows the blocks a layer holds, not its length. Entries outside the
// run may be kNoBlock too (a block dropped but not yet next to the run).
//
// Thread-safety: none; the owning LayerKvCache serialises access.
#ifndef ATTENTION_CORE_BLOCK_TABLE_H_
#define ATTENTION_CORE_BLOCK_TABLE_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "core/block_pool.h"

namespace attention {

class BlockTable {
 public:
  // Logical blocks: stored entries plus the skipped run.
  int64_t size() const { return static_cast<int64_t>(stored_.size()) + gap_; }
  // The block of logical block b (kNoBlock when dropped).
  // REQUIRES: 0 <= b < size().
  BlockId at(int64_t b) const {
    if (b < gap_begin_) return stored_[b];
    if (b < gap_begin_ + gap_) return kNoBlock;
    return stored_[b - gap_];
  }
  // The stored entry of logical block b, to replace it.
  // REQUIRES: 0 <= b < size() and b is not in the skipped run.
  BlockId& mutable_at(int64_t b) {
    return stored_[b < gap_begin_ ? b : b - gap_];
  }
  // The first logical block at or after b that is not in the skipped run.
  int64_t SkipGap(int64_t b) const {
    return b >= gap_begin_ && b < gap_begin_ + gap_ ? gap_begin_ + gap_ : b;
  }

  // Every stored entry (each block the table references, and kNoBlock
  // entries), in logical order: logical block b is stored()[b] below
  // gap_begin(), stored()[b - gap()] from gap_begin() + gap() on.
  absl::Span<const BlockId> stored() const { return stored_; }
  int64_t gap_begin() const { return gap_begin_; }
  int64_t gap() const { return gap_; }
  // Host memory of the stored entries.
  int64_t bytes() const {
    return static_cast<int64_t>(stored_.size()) * kBlockTableEntryBytes;
  }

  // Appends logical block size().
  void push_back(BlockId id) { stored_.push_back(id); }
  // Appends `count` >= 0 dropped logical blocks as (the end of) the
  // skipped run. REQUIRES: the table has no skipped run, or it ends at
  // size().
  void PushDropped(int64_t count) {
    if (count <= 0) return;
    if (gap_ == 0) gap_begin_ = static_cast<int64_t>(stored_.size());
    gap_ += count;
  }
  void reserve(int64_t logical_blocks) {
    stored_.reserve(static_cast<size_t>(logical_blocks - gap_));
  }
  // Moves the kNoBlock entries that follow the skipped run (or, with no
  // run yet, the first run of kNoBlock entries) into it.
  void Compact();
  // Keeps logical blocks [0, blocks) and appends the stored entries cut
  // off to `*released`. REQUIRES: blocks <= size().
  void Truncate(int64_t blocks, std::vector<BlockId>* released);
  // An empty table.
  void Clear();

 private:
  std::vector<BlockId> stored_;
  int64_t gap_begin_ = 0;
  int64_t gap_ = 0;
};

}  // namespace attention

#endif  // ATTENTION_CORE_BLOCK_TABLE_H_
