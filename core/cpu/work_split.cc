#include "core/cpu/work_split.h"

#include <algorithm>

namespace attention {
namespace {

// With fewer units than this per thread, long units are split by chunks...
constexpr int64_t kMinUnitsPerThread = 8;
// ...into about this many pieces per thread: more pieces balance better on
// a loaded machine. A piece costs one query load and the write-back of its
// chunk states (2 + value_dim floats per row-head and chunk: under 1% of
// the K/V bytes a decode chunk reads).
constexpr int64_t kPiecesPerThread = 16;

}  // namespace

int64_t ChunksPerPiece(int64_t num_units, int64_t splittable_chunks,
                       int num_threads) {
  if (num_threads <= 1 || num_units >= kMinUnitsPerThread * num_threads ||
      splittable_chunks <= 0) {
    return kNoSplit;
  }
  const int64_t pieces = kPiecesPerThread * num_threads;
  return std::max<int64_t>(1, (splittable_chunks + pieces - 1) / pieces);
}

}  // namespace attention
