// BlockPool: the fixed-capacity, paged KV memory shared by all sessions.
//
// The pool owns one arena of backend memory split into equal blocks. Block
// metadata (reference counts, the free list) lives on the host, apart from
// the block memory, so a GPU backend can use the same pool. Blocks are
// reference counted: a forked session shares its parent's blocks until one
// of them writes (copy-on-write, done by the layer cache).
#ifndef ATTENTION_CORE_BLOCK_POOL_H_
#define ATTENTION_CORE_BLOCK_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/backend.h"

namespace attention {

using BlockId = int32_t;
inline constexpr BlockId kNoBlock = -1;
// Host memory of one block table entry.
inline constexpr int64_t kBlockTableEntryBytes = sizeof(BlockId);

struct BlockPoolStats {
  int64_t capacity_bytes = 0;  // num_blocks * block_bytes
  int64_t used_bytes = 0;      // blocks with a reference * block_bytes
  int64_t block_bytes = 0;
  int64_t blocks_total = 0;
  int64_t blocks_used = 0;
};

// Thread-safety: all methods are thread-safe.
class BlockPool {
 public:
  // Allocates the arena from `backend` (which must outlive the pool):
  // capacity_bytes / block_bytes blocks. INVALID_ARGUMENT when fewer than one
  // block fits or block_bytes is not a positive multiple of 256;
  // RESOURCE_EXHAUSTED when the backend cannot allocate the arena.
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(
      AttentionBackend* backend, int64_t capacity_bytes, int64_t block_bytes);

  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  int64_t block_bytes() const { return block_bytes_; }
  int64_t num_blocks() const { return num_blocks_; }

  // Takes `count` free blocks, each with one reference, appending their ids
  // to `out`. All or nothing: RESOURCE_EXHAUSTED (nothing taken) when fewer
  // than `count` are free.
  absl::Status Allocate(int64_t count, std::vector<BlockId>* out);

  // Adds a reference. REQUIRES: `id` is live.
  void Ref(BlockId id);
  // Drops a reference; the block is free again when none is left.
  // REQUIRES: `id` is live.
  void Unref(BlockId id);
  // Drops one reference to each id that is not kNoBlock.
  void UnrefAll(absl::Span<const BlockId> ids);
  int RefCount(BlockId id) const;

  // Copies the bytes of block `src` to block `dst` through the backend
  // (copy-on-write). INTERNAL on device failure.
  absl::Status CopyBlock(BlockId src, BlockId dst);

  // Address of a block in backend memory. Stable while the block is live.
  std::byte* data(BlockId id) const {
    return arena_base_ + static_cast<int64_t>(id) * block_bytes_;
  }

  BlockPoolStats stats() const;

 private:
  BlockPool(AttentionBackend* backend, std::unique_ptr<DeviceArena> arena,
            int64_t block_bytes, int64_t num_blocks);

  AttentionBackend* const backend_;
  const std::unique_ptr<DeviceArena> arena_;
  std::byte* const arena_base_;
  const int64_t block_bytes_;
  const int64_t num_blocks_;

  mutable absl::Mutex mu_;
  std::vector<int32_t> refs_ ABSL_GUARDED_BY(mu_);
  std::vector<BlockId> free_ ABSL_GUARDED_BY(mu_);  // LIFO for locality
};

}  // namespace attention

#endif  // ATTENTION_CORE_BLOCK_POOL_H_
