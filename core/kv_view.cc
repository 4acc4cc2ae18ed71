#include "core/kv_view.h"

namespace attention {

KvView PagedKvView(const KvBlockLayout& layout, int64_t length,
                   absl::Span<const std::byte* const> k_blocks,
                   absl::Span<const std::byte* const> v_blocks,
                   int64_t gap_begin, int64_t gap_blocks) {
  KvView view;
  view.dtype = layout.dtype;
  view.num_kv_heads = layout.num_kv_heads;
  view.head_dim = layout.head_dim;
  view.value_dim = layout.value_dim;
  view.length = length;
  view.tokens_per_block = layout.tokens_per_block;
  view.k_blocks = k_blocks;
  view.v_blocks = v_blocks;
  view.gap_begin = gap_begin;
  view.gap_blocks = gap_blocks;
  // [num_kv_heads][tokens_per_block][dim] inside a block.
  view.k_token_stride = layout.head_dim;
  view.k_head_stride = layout.tokens_per_block * layout.head_dim;
  const int64_t stored_value_dim =
      layout.shared_values ? layout.head_dim : layout.value_dim;
  view.v_token_stride = stored_value_dim;
  view.v_head_stride = layout.tokens_per_block * stored_value_dim;
  view.index_dim = layout.index_dim;
  view.index_offset_bytes = layout.index_offset_bytes();
  return view;
}

KvView ContiguousKvView(const TensorView& k, const TensorView& v,
                        const std::byte* block_storage[2]) {
  KvView view;
  view.dtype = k.dtype;
  view.length = k.dim(0);
  view.num_kv_heads = static_cast<int>(k.dim(1));
  view.head_dim = static_cast<int>(k.dim(2));
  view.value_dim = static_cast<int>(v.dim(2));
  // One block holding every position: [T_k][H_kv][dim].
  view.tokens_per_block = view.length;
  block_storage[0] = k.data;
  block_storage[1] = v.data;
  view.k_blocks = absl::Span<const std::byte* const>(block_storage, 1);
  view.v_blocks = absl::Span<const std::byte* const>(block_storage + 1, 1);
  view.k_token_stride = int64_t{view.num_kv_heads} * view.head_dim;
  view.k_head_stride = view.head_dim;
  view.v_token_stride = int64_t{view.num_kv_heads} * view.value_dim;
  view.v_head_stride = view.value_dim;
  return view;
}

}  // namespace attention
