// Small helpers the attn-bench sections share: medians, tensor views of
// host buffers, and aborting on a setup failure.
#ifndef ATTENTION_BENCH_BENCH_UTIL_H_
#define ATTENTION_BENCH_BENCH_UTIL_H_

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include <memory>

#include "absl/status/status.h"
#include "core/backend.h"
#include "core/block_pool.h"
#include "core/dtype.h"
#include "core/kv_view.h"
#include "core/tensor.h"

namespace attention::bench {

// Seconds of the steady clock since `start`.
inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                       start)
      .count();
}

// The median (the mean of the middle two for an even count).
inline double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Reports `status` of step `what` of section `section` and aborts: a bench
// whose setup fails measures nothing.
[[noreturn]] inline void Die(const char* section, const absl::Status& status,
                             const char* what) {
  std::fprintf(stderr, "%s bench: %s: %s\n", section, what,
               status.ToString().c_str());
  std::abort();
}

// A view of `data` as a dense tensor of `shape` and `dtype`.
inline TensorView ViewOf(DType dtype, Shape shape, const void* data) {
  TensorView view;
  view.dtype = dtype;
  view.shape = std::move(shape);
  view.data = static_cast<const std::byte*>(data);
  view.size_bytes = view.num_elements() * DTypeSize(dtype);
  return view;
}

// A KV history of `length` tokens of `layout` in a real BlockPool of the
// backend (blocks of `block_bytes`), as the engine would hold it: the
// writable block bases and the key/value views' block tables.
struct PagedBlocks {
  std::unique_ptr<BlockPool> pool;
  std::vector<BlockId> ids;
  std::vector<std::byte*> blocks;
  std::vector<const std::byte*> k_blocks, v_blocks;

  PagedBlocks(AttentionBackend& backend, const KvBlockLayout& layout,
              int64_t length, int64_t block_bytes, const char* section) {
    const int64_t num_blocks =
        (length + layout.tokens_per_block - 1) / layout.tokens_per_block;
    absl::StatusOr<std::unique_ptr<BlockPool>> created =
        BlockPool::Create(&backend, num_blocks * block_bytes, block_bytes);
    if (!created.ok()) Die(section, created.status(), "block pool");
    pool = *std::move(created);
    if (absl::Status s = pool->Allocate(num_blocks, &ids); !s.ok()) {
      Die(section, s, "allocate blocks");
    }
    for (BlockId id : ids) {
      blocks.push_back(pool->data(id));
      k_blocks.push_back(blocks.back());
      v_blocks.push_back(blocks.back() + layout.value_offset_bytes());
    }
  }
  ~PagedBlocks() { pool->UnrefAll(ids); }
  PagedBlocks(const PagedBlocks&) = delete;
  PagedBlocks& operator=(const PagedBlocks&) = delete;
};

}  // namespace attention::bench

#endif  // ATTENTION_BENCH_BENCH_UTIL_H_
