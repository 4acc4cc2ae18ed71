// The backend-neutral work plan of attention_problem.h, for host and device
// code alike (no dependencies beyond core/visibility.h; usable from .cu
// files). Both backends cut a call into work with these functions, so the
// fixed reduction order that makes outputs bitwise reproducible has one
// source:
//
//   mask        -> key ranges  the keys some row of a block of consecutive
//                              query rows sees (RowBlockKeys: the last
//                              row's sinks, then the first row's window up
//                              to the last row's last key);
//   key ranges  -> tiles       kKeysPerTile absolute positions each
//                              (TilesOf); tiles no row sees are skipped;
//   tiles       -> chunks      kKeysPerSplit absolute positions each
//                              (ForEachChunk, NumChunks; a chunk's tiles:
//                              TileRanges::Clip(ChunkTileBegin(c), ...));
//   chunks      -> work items  a row block of one KV head runs its chunks
//                              in one item (full mode), or is split into
//                              items of consecutive chunks whose chunk
//                              states are stored (ForEachPiece);
//   merge order                a row's state starts from its learned sink
//                              (or empty) and takes the chunk states in
//                              increasing chunk order, whoever computed
//                              them.
//
// Which rows share a block, how blocks are split and which thread or GPU
// block computes a chunk state never change a result: a chunk state depends
// only on its keys and each row, and the merge order is fixed.
#ifndef ATTENTION_CORE_WORK_PLAN_H_
#define ATTENTION_CORE_WORK_PLAN_H_

#include <cstdint>

#include "core/visibility.h"

#if defined(__CUDACC__)
#define ATTN_PLAN_FN __host__ __device__ inline
#else
#define ATTN_PLAN_FN inline
#endif

namespace attention {

// Keys per online-softmax tile and per chunk (split) of the reduction
// order, both counted in absolute positions from 0.
inline constexpr int64_t kKeysPerTile = 32;
inline constexpr int64_t kKeysPerSplit = 512;
inline constexpr int64_t kTilesPerChunk = kKeysPerSplit / kKeysPerTile;
static_assert(kKeysPerSplit % kKeysPerTile == 0);

// At most two half-open ranges [begin, end), increasing and disjoint: of
// keys (positions) or of tile indices.
struct KeyRanges {
  int count = 0;
  int64_t begin[2] = {0, 0};
  int64_t end[2] = {0, 0};

  // Appends [b, e) (nothing when empty), merged with the last range when
  // they overlap or touch. REQUIRES: b >= the last range's begin.
  ATTN_PLAN_FN void Add(int64_t b, int64_t e) {
    if (b >= e) return;
    if (count > 0 && b <= end[count - 1]) {
      if (e > end[count - 1]) end[count - 1] = e;
      return;
    }
    begin[count] = b;
    end[count] = e;
    ++count;
  }
  // Positions in all ranges.
  ATTN_PLAN_FN int64_t size() const {
    int64_t n = 0;
    for (int i = 0; i < count; ++i) n += end[i] - begin[i];
    return n;
  }
  // The i-th position, 0 <= i < size().
  ATTN_PLAN_FN int64_t at(int64_t i) const {
    const int64_t first = count > 0 ? end[0] - begin[0] : 0;
    return i < first ? begin[0] + i : begin[1] + (i - first);
  }
};

// Keys visible to at least one query at positions [first_p, last_p] over
// keys [0, length) under the mask (core/visibility.h): the sink prefix of
// the last row, then the window of the first row up to the last row's last
// key. Every key a row of the block sees is in them.
ATTN_PLAN_FN KeyRanges RowBlockKeys(bool causal, int32_t window,
                                    int32_t num_sink_tokens, int64_t length,
                                    int64_t first_p, int64_t last_p) {
  const VisibleKeys first =
      VisibleKeysOf(causal, window, num_sink_tokens, length, first_p);
  const VisibleKeys last =
      VisibleKeysOf(causal, window, num_sink_tokens, length, last_p);
  KeyRanges keys;
  keys.Add(0, last.sinks);
  keys.Add(first.lo, last.hi + 1);
  return keys;
}

// Tile index ranges, [begin0, end0) then [begin1, end1): the tiles holding
// a key of some KeyRanges, increasing, each once (the kernels' loop form).
struct TileRanges {
  int64_t begin0 = 0, end0 = 0;
  int64_t begin1 = 0, end1 = 0;

  ATTN_PLAN_FN int64_t size() const {
    return (end0 - begin0) + (end1 - begin1);
  }
  // The i-th tile, 0 <= i < size().
  ATTN_PLAN_FN int64_t tile(int64_t i) const {
    const int64_t n0 = end0 - begin0;
    return i < n0 ? begin0 + i : begin1 + (i - n0);
  }
  // Restricted to tiles [lo, hi) (one chunk).
  ATTN_PLAN_FN TileRanges Clip(int64_t lo, int64_t hi) const {
    TileRanges r;
    r.begin0 = begin0 > lo ? begin0 : lo;
    r.end0 = end0 < hi ? end0 : hi;
    if (r.end0 < r.begin0) r.end0 = r.begin0;
    r.begin1 = begin1 > lo ? begin1 : lo;
    r.end1 = end1 < hi ? end1 : hi;
    if (r.end1 < r.begin1) r.end1 = r.begin1;
    return r;
  }
};

// The tiles holding a key of `keys`.
ATTN_PLAN_FN TileRanges TilesOf(const KeyRanges& keys) {
  KeyRanges tiles;
  for (int i = 0; i < keys.count; ++i) {
    tiles.Add(keys.begin[i] / kKeysPerTile,
              (keys.end[i] + kKeysPerTile - 1) / kKeysPerTile);
  }
  TileRanges r;
  if (tiles.count > 0) {
    r.begin0 = tiles.begin[0];
    r.end0 = tiles.end[0];
  }
  if (tiles.count > 1) {
    r.begin1 = tiles.begin[1];
    r.end1 = tiles.end[1];
  }
  return r;
}

// The first tile of chunk `chunk` (its tiles are [ChunkTileBegin(c),
// ChunkTileBegin(c + 1))).
ATTN_PLAN_FN int64_t ChunkTileBegin(int64_t chunk) {
  return chunk * kTilesPerChunk;
}

// Calls fn(chunk) for every chunk holding a key of `keys`, increasing,
// each once: the merge order of a row block's chunk states.
template <typename Fn>
ATTN_PLAN_FN void ForEachChunk(const KeyRanges& keys, Fn fn) {
  int64_t next = 0;  // first chunk not visited yet
  for (int i = 0; i < keys.count; ++i) {
    int64_t c = keys.begin[i] / kKeysPerSplit;
    if (c < next) c = next;
    const int64_t last = (keys.end[i] - 1) / kKeysPerSplit;
    for (; c <= last; ++c) fn(c);
    if (c > next) next = c;
  }
}

// The number of chunks ForEachChunk visits.
ATTN_PLAN_FN int64_t NumChunks(const KeyRanges& keys) {
  int64_t n = 0;
  int64_t next = 0;
  for (int i = 0; i < keys.count; ++i) {
    const int64_t first = keys.begin[i] / kKeysPerSplit;
    const int64_t last = (keys.end[i] - 1) / kKeysPerSplit;
    const int64_t from = first > next ? first : next;
    if (last >= from) n += last - from + 1;
    if (last + 1 > next) next = last + 1;
  }
  return n;
}

// Cuts a split row block's `count` chunk slots [0, count) into work items
// of at most `per_piece` consecutive slots, skipping the slots for which
// skip(slot) is true (states another item fills): calls fn(begin, end) for
// each, increasing.
template <typename Skip, typename Fn>
ATTN_PLAN_FN void ForEachPiece(int64_t count, int64_t per_piece, Skip skip,
                               Fn fn) {
  int64_t c = 0;
  while (c < count) {
    if (skip(c)) {
      ++c;
      continue;
    }
    int64_t end = c;
    while (end < count && !skip(end) && end - c < per_piece) ++end;
    fn(c, end);
    c = end;
  }
}

}  // namespace attention

#undef ATTN_PLAN_FN

#endif  // ATTENTION_CORE_WORK_PLAN_H_
