// How the CPU backend spreads a call's work over its threads. Split
// decisions only change which thread computes which chunk state, never the
// results (attention_problem.h defines every chunk state from empty and
// their merge order), so they may depend on the thread count.
#ifndef ATTENTION_CORE_CPU_WORK_SPLIT_H_
#define ATTENTION_CORE_CPU_WORK_SPLIT_H_

#include <cstdint>
#include <limits>

namespace attention {

// Returned by ChunksPerPiece when units run whole.
inline constexpr int64_t kNoSplit = std::numeric_limits<int64_t>::max();

// A call has `num_units` units of work (query rows x one KV head, or a
// group of those that run together), holding `splittable_chunks` key chunks
// (kKeysPerSplit positions) in all among the units that may be split. With
// enough units to keep `num_threads` busy this returns kNoSplit; otherwise
// the number of chunks per piece: a unit with more chunks runs as several
// pieces on different threads, so that a lone long decode (8 KV heads, 16
// threads) still uses every thread.
int64_t ChunksPerPiece(int64_t num_units, int64_t splittable_chunks,
                       int num_threads);

}  // namespace attention

#endif  // ATTENTION_CORE_CPU_WORK_SPLIT_H_
