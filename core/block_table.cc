#include "core/block_table.h"

#include <algorithm>

namespace attention {

void BlockTable::Compact() {
  if (gap_ == 0) {
    const auto first = std::find(stored_.begin(), stored_.end(), kNoBlock);
    if (first == stored_.end()) return;
    gap_begin_ = first - stored_.begin();
  }
  // The entries right after the run sit at stored index gap_begin_.
  const auto begin = stored_.begin() + gap_begin_;
  const auto end = std::find_if(begin, stored_.end(),
                                [](BlockId id) { return id != kNoBlock; });
  gap_ += end - begin;
  stored_.erase(begin, end);
  // A table built whole (a restore) gives its memory back.
  if (stored_.capacity() > 2 * stored_.size() + 64) stored_.shrink_to_fit();
}

void BlockTable::Truncate(int64_t blocks, std::vector<BlockId>* released) {
  int64_t keep_stored;
  if (blocks >= gap_begin_ + gap_) {
    keep_stored = blocks - gap_;
  } else if (blocks >= gap_begin_) {
    keep_stored = gap_begin_;  // the cut falls in the run: it gets shorter
    gap_ = blocks - gap_begin_;
  } else {
    keep_stored = blocks;
    gap_begin_ = 0;
    gap_ = 0;
  }
  released->insert(released->end(), stored_.begin() + keep_stored,
                   stored_.end());
  stored_.resize(static_cast<size_t>(keep_stored));
  if (gap_ == 0) gap_begin_ = 0;
}

void BlockTable::Clear() {
  stored_.clear();
  gap_begin_ = 0;
  gap_ = 0;
}

}  // namespace attention
