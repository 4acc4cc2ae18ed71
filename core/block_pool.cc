#include "core/block_pool.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "core/try_first_mutex_lock.h"

namespace attention {

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(
    AttentionBackend* backend, int64_t capacity_bytes, int64_t block_bytes) {
  if (block_bytes <= 0 || block_bytes % 256 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV block size must be a positive multiple of 256 bytes, got ",
        block_bytes));
  }
  const int64_t num_blocks = capacity_bytes / block_bytes;
  if (num_blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV cache capacity ", capacity_bytes, " bytes holds no block of ",
        block_bytes, " bytes; raise --kv_cache_bytes"));
  }
  if (num_blocks > int64_t{INT32_MAX}) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache of ", num_blocks,
                     " blocks is too many; raise the block size"));
  }
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<DeviceArena> arena,
                        backend->AllocateArena(num_blocks * block_bytes));
  return std::unique_ptr<BlockPool>(
      new BlockPool(backend, std::move(arena), block_bytes, num_blocks));
}

BlockPool::BlockPool(AttentionBackend* backend,
                     std::unique_ptr<DeviceArena> arena, int64_t block_bytes,
                     int64_t num_blocks)
    : backend_(backend),
      arena_(std::move(arena)),
      arena_base_(arena_->data()),
      block_bytes_(block_bytes),
      num_blocks_(num_blocks),
      refs_(num_blocks, 0) {
  free_.reserve(num_blocks);
  // Hand out low ids first (LIFO pops from the back).
  for (int64_t id = num_blocks - 1; id >= 0; --id) {
    free_.push_back(static_cast<BlockId>(id));
  }
}

absl::Status BlockPool::Allocate(int64_t count, std::vector<BlockId>* out) {
  if (count <= 0) return absl::OkStatus();
  TryFirstMutexLock lock(&mu_);
  if (static_cast<int64_t>(free_.size()) < count) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache is full: need ", count, " more blocks of ", block_bytes_,
        " bytes but only ", free_.size(), " of ", num_blocks_,
        " are free; delete or truncate sessions, or raise --kv_cache_bytes"));
  }
  for (int64_t i = 0; i < count; ++i) {
    const BlockId id = free_.back();
    free_.pop_back();
    refs_[id] = 1;
    out->push_back(id);
  }
  return absl::OkStatus();
}

void BlockPool::Ref(BlockId id) {
  TryFirstMutexLock lock(&mu_);
  ++refs_[id];
}

void BlockPool::Unref(BlockId id) {
  TryFirstMutexLock lock(&mu_);
  if (--refs_[id] == 0) free_.push_back(id);
}

void BlockPool::UnrefAll(absl::Span<const BlockId> ids) {
  TryFirstMutexLock lock(&mu_);
  for (BlockId id : ids) {
    if (id == kNoBlock) continue;
    if (--refs_[id] == 0) free_.push_back(id);
  }
}

int BlockPool::RefCount(BlockId id) const {
  TryFirstMutexLock lock(&mu_);
  return refs_[id];
}

absl::Status BlockPool::CopyBlock(BlockId src, BlockId dst) {
  return backend_->CopyBlock(data(src), data(dst), block_bytes_);
}

BlockPoolStats BlockPool::stats() const {
  TryFirstMutexLock lock(&mu_);
  BlockPoolStats stats;
  stats.block_bytes = block_bytes_;
  stats.blocks_total = num_blocks_;
  stats.blocks_used = num_blocks_ - static_cast<int64_t>(free_.size());
  stats.capacity_bytes = num_blocks_ * block_bytes_;
  stats.used_bytes = stats.blocks_used * block_bytes_;
  return stats;
}

}  // namespace attention
