// KvView: a read-only view of the keys and values of one attention problem,
// either paged (a session layer's blocks in the KV pool) or contiguous (the
// k/v tensors of a stateless call). Kernels address key `pos` of KV head `h`
// the same way in both cases, which is what lets every path share one
// reduction order.
#ifndef ATTENTION_CORE_KV_VIEW_H_
#define ATTENTION_CORE_KV_VIEW_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "absl/types/span.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace attention {

// Geometry of one paged KV block: all KV heads of `tokens_per_block`
// consecutive positions of one layer. Inside a block, keys are laid out
// [num_kv_heads][tokens_per_block][head_dim] followed by values
// [num_kv_heads][tokens_per_block][value_dim], so a kernel streams one head's
// keys contiguously. With `shared_values` (MLA's shared latent) there is no
// value region: a token's value is the first value_dim entries of its key.
// A top-k layer's blocks end with an index region [tokens_per_block]
// [index_dim] (one index key per token, not per head).
struct KvBlockLayout {
  DType dtype = DType::kFloat32;
  int num_kv_heads = 0;
  int head_dim = 0;
  int value_dim = 0;
  int64_t tokens_per_block = 0;
  bool shared_values = false;
  int index_dim = 0;  // 0 = no index keys (a dense layer)

  // Elements one token stores per KV head.
  int64_t stored_dims() const {
    return shared_values ? head_dim : int64_t{head_dim} + value_dim;
  }
  int64_t bytes_per_token() const {
    return (int64_t{num_kv_heads} * stored_dims() + index_dim) *
           DTypeSize(dtype);
  }
  // Bytes actually used in a block (<= the pool's block size).
  int64_t used_bytes() const { return tokens_per_block * bytes_per_token(); }
  // Byte offset of the value region inside a block (0 with shared values:
  // values are read from the keys).
  int64_t value_offset_bytes() const {
    if (shared_values) return 0;
    return int64_t{num_kv_heads} * tokens_per_block * head_dim *
           DTypeSize(dtype);
  }
  // Byte offset of the index region inside a block.
  int64_t index_offset_bytes() const {
    return int64_t{num_kv_heads} * tokens_per_block * stored_dims() *
           DTypeSize(dtype);
  }
};

// Logical block b of a layer's block table listed without the run of
// blocks [gap_begin, gap_begin + gap_blocks) it has dropped: nullptr in the
// run. (KvView and KvWrite list their blocks so.)
template <typename Block>
Block* ListedBlock(absl::Span<Block* const> listed, int64_t gap_begin,
                   int64_t gap_blocks, int64_t b) {
  if (b < gap_begin) return listed[b];
  if (b < gap_begin + gap_blocks) return nullptr;
  return listed[b - gap_blocks];
}

struct KvView {
  DType dtype = DType::kFloat32;
  int num_kv_heads = 0;
  int head_dim = 0;
  int value_dim = 0;
  // Keys exist at absolute positions [0, length).
  int64_t length = 0;
  // Position `pos` lives in block pos / tokens_per_block at row
  // pos % tokens_per_block.
  int64_t tokens_per_block = 0;
  // Base address of each listed block's keys and values; nullptr for a
  // block that a sliding-window layer has dropped (kernels never read masked
  // positions). Logical blocks [gap_begin, gap_begin + gap_blocks) are
  // dropped and not listed (a window layer's table without the run it has
  // dropped, so that a view costs the blocks held, not the layer's length):
  // k_blocks[i] is logical block i below gap_begin, else i + gap_blocks.
  // Read them with k_block(b) and v_block(b).
  absl::Span<const std::byte* const> k_blocks;
  absl::Span<const std::byte* const> v_blocks;
  int64_t gap_begin = 0;
  int64_t gap_blocks = 0;
  // Element strides inside a block.
  int64_t k_token_stride = 0;
  int64_t k_head_stride = 0;
  int64_t v_token_stride = 0;
  int64_t v_head_stride = 0;
  // Index keys (top-k layers): index_dim elements per position, contiguous
  // per block at byte offset index_offset_bytes from its k_blocks base.
  // index_dim == 0 when the view has none.
  int index_dim = 0;
  int64_t index_offset_bytes = 0;

  // Logical blocks both lists cover, listed and dropped.
  int64_t num_blocks() const {
    return static_cast<int64_t>(std::min(k_blocks.size(), v_blocks.size())) +
           gap_blocks;
  }
  // Base of logical block b's keys (values); nullptr when dropped.
  // REQUIRES: 0 <= b < num_blocks().
  const std::byte* k_block(int64_t b) const {
    return ListedBlock(k_blocks, gap_begin, gap_blocks, b);
  }
  const std::byte* v_block(int64_t b) const {
    return ListedBlock(v_blocks, gap_begin, gap_blocks, b);
  }

  const std::byte* key(int64_t pos, int head) const {
    const std::byte* block = k_block(pos / tokens_per_block);
    return block + ((pos % tokens_per_block) * k_token_stride +
                    head * k_head_stride) *
                       DTypeSize(dtype);
  }
  const std::byte* index_key(int64_t pos) const {
    const std::byte* block = k_block(pos / tokens_per_block);
    return block + index_offset_bytes +
           (pos % tokens_per_block) * index_dim * DTypeSize(dtype);
  }
  const std::byte* value(int64_t pos, int head) const {
    const std::byte* block = v_block(pos / tokens_per_block);
    return block + ((pos % tokens_per_block) * v_token_stride +
                    head * v_head_stride) *
                       DTypeSize(dtype);
  }
};

// A view of paged blocks. `k_blocks[i]` is the base address of listed block
// i (see KvView::gap_begin) and `v_blocks[i]` = k_blocks[i] +
// layout.value_offset_bytes() (or both null). With layout.shared_values the
// value strides are the key strides. The spans must outlive the view.
KvView PagedKvView(const KvBlockLayout& layout, int64_t length,
                   absl::Span<const std::byte* const> k_blocks,
                   absl::Span<const std::byte* const> v_blocks,
                   int64_t gap_begin = 0, int64_t gap_blocks = 0);

// A view of contiguous k [T_k, H_kv, head_dim] and v [T_k, H_kv, value_dim]
// tensors, as one block. `block_storage` (2 entries) holds the block
// pointers and must outlive the view.
// REQUIRES: k and v validated, same dtype and T_k, same H_kv.
KvView ContiguousKvView(const TensorView& k, const TensorView& v,
                        const std::byte* block_storage[2]);

}  // namespace attention

#endif  // ATTENTION_CORE_KV_VIEW_H_
