// The backend-neutral work plan (core/work_plan.h) against brute force over
// the visibility predicate: a row block's key ranges hold exactly the keys
// some row sees, tiles and chunks are those holding such a key (increasing,
// each once), a chunk's clipped tiles partition them, and the pieces of a
// split block cover its unskipped chunk slots once, in order.
#include "core/work_plan.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "core/visibility.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

struct Mask {
  bool causal;
  int32_t window;
  int32_t sinks;
  int64_t length;
  int64_t query_start;
};

std::vector<Mask> Masks() {
  std::vector<Mask> masks;
  for (bool causal : {true, false}) {
    for (int32_t window : {0, 1, 7, 40, 600}) {
      for (int32_t sinks : {0, 3, 33}) {
        if (window == 0 && sinks > 0) continue;
        for (int64_t length : {0, 1, 31, 32, 100, 1100}) {
          for (int64_t query_start : {int64_t{0}, length / 2, length - 1}) {
            masks.push_back({causal, window, sinks, length,
                             query_start < 0 ? 0 : query_start});
          }
        }
      }
    }
  }
  return masks;
}

// Keys some query at [first_p, last_p] sees, by the predicate.
std::set<int64_t> VisibleUnion(const Mask& m, int64_t first_p, int64_t last_p) {
  std::set<int64_t> keys;
  for (int64_t p = first_p; p <= last_p; ++p) {
    for (int64_t j = 0; j < m.length; ++j) {
      if (KeyIsVisible(m.causal, m.window, m.sinks, m.length, p, j)) {
        keys.insert(j);
      }
    }
  }
  return keys;
}

TEST(WorkPlanTest, RowBlockKeysHoldEveryVisibleKeyAndTheirTilesAndChunks) {
  for (const Mask& m : Masks()) {
    for (int64_t rows : {1, 5, 16}) {
      const int64_t first_p = m.query_start;
      const int64_t last_p = m.query_start + rows - 1;
      SCOPED_TRACE(::testing::Message()
                   << "causal " << m.causal << " window " << m.window
                   << " sinks " << m.sinks << " length " << m.length
                   << " rows [" << first_p << ", " << last_p << "]");
      const KeyRanges keys =
          RowBlockKeys(m.causal, m.window, m.sinks, m.length, first_p, last_p);
      std::vector<int64_t> listed;
      for (int64_t i = 0; i < keys.size(); ++i) listed.push_back(keys.at(i));
      const std::set<int64_t> visible = VisibleUnion(m, first_p, last_p);
      // Every visible key is listed, increasing, each once; a causal block
      // of one row lists exactly its visible keys.
      for (size_t i = 1; i < listed.size(); ++i) {
        ASSERT_LT(listed[i - 1], listed[i]);
      }
      for (int64_t key : visible) {
        EXPECT_TRUE(std::binary_search(listed.begin(), listed.end(), key))
            << key;
      }
      if (rows == 1) {
        EXPECT_EQ(std::set<int64_t>(listed.begin(), listed.end()), visible);
      }
      for (int64_t key : listed) ASSERT_LT(key, m.length);

      // Tiles and chunks: those holding a listed key.
      std::vector<int64_t> want_tiles, want_chunks;
      for (int64_t key : listed) {
        if (want_tiles.empty() || want_tiles.back() != key / kKeysPerTile) {
          want_tiles.push_back(key / kKeysPerTile);
        }
        if (want_chunks.empty() || want_chunks.back() != key / kKeysPerSplit) {
          want_chunks.push_back(key / kKeysPerSplit);
        }
      }
      const TileRanges tiles = TilesOf(keys);
      std::vector<int64_t> got_tiles;
      for (int64_t i = 0; i < tiles.size(); ++i) {
        got_tiles.push_back(tiles.tile(i));
      }
      EXPECT_EQ(got_tiles, want_tiles);
      std::vector<int64_t> got_chunks;
      ForEachChunk(keys, [&](int64_t c) { got_chunks.push_back(c); });
      EXPECT_EQ(got_chunks, want_chunks);
      EXPECT_EQ(NumChunks(keys), static_cast<int64_t>(want_chunks.size()));

      // A chunk's clipped tiles, chunk after chunk, are the tiles again.
      std::vector<int64_t> by_chunk;
      for (int64_t c : got_chunks) {
        const TileRanges part =
            tiles.Clip(ChunkTileBegin(c), ChunkTileBegin(c + 1));
        EXPECT_GT(part.size(), 0) << "chunk " << c;
        for (int64_t i = 0; i < part.size(); ++i) {
          by_chunk.push_back(part.tile(i));
        }
      }
      EXPECT_EQ(by_chunk, want_tiles);
    }
  }
}

TEST(WorkPlanTest, KeyRangesMergeTouchingRanges) {
  KeyRanges keys;
  keys.Add(0, 5);
  keys.Add(5, 9);    // touches: merged
  keys.Add(3, 4);    // inside: nothing new
  keys.Add(20, 20);  // empty: ignored
  EXPECT_EQ(keys.count, 1);
  EXPECT_EQ(keys.size(), 9);
  keys.Add(20, 25);
  EXPECT_EQ(keys.count, 2);
  EXPECT_EQ(keys.at(9), 20);
  EXPECT_EQ(keys.size(), 14);
}

TEST(WorkPlanTest, PiecesCoverTheUnskippedSlotsOnceInOrder) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t count = rng() % 40;
    const int64_t per_piece = 1 + rng() % 6;
    std::vector<bool> skipped(static_cast<size_t>(count));
    for (size_t i = 0; i < skipped.size(); ++i) skipped[i] = rng() % 4 == 0;
    std::vector<int64_t> covered;
    ForEachPiece(
        count, per_piece, [&](int64_t slot) { return skipped[slot]; },
        [&](int64_t begin, int64_t end) {
          EXPECT_LT(begin, end);
          EXPECT_LE(end - begin, per_piece);
          for (int64_t s = begin; s < end; ++s) covered.push_back(s);
        });
    std::vector<int64_t> want;
    for (int64_t s = 0; s < count; ++s) {
      if (!skipped[s]) want.push_back(s);
    }
    EXPECT_EQ(covered, want);
  }
}

}  // namespace
}  // namespace attention
