// One unit of CPU attention work: query rows x the query heads of one KV
// head, over some of its key chunks, following the canonical reduction
// order of attention_problem.h. CpuBackend::Attend cuts problems into units
// with the work plan of core/work_plan.h and runs them (or pieces of them)
// on its threads; the kernels of the chosen ISA do the arithmetic
// (kernels.h).
#ifndef ATTENTION_CORE_CPU_ATTENTION_UNIT_H_
#define ATTENTION_CORE_CPU_ATTENTION_UNIT_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/attention_problem.h"
#include "core/cpu/kernels.h"
#include "core/work_plan.h"

namespace attention::cpu {

// The kernels' element type of KV rows of `dtype`.
ElementType ToElementType(DType dtype);

// Shape facts of one problem, computed once per Attend call.
struct ProblemInfo {
  int64_t rows = 0;
  int heads = 0;
  int kv_heads = 0;
  int group = 0;
  int head_dim = 0;
  int value_dim = 0;
  int head_dim_padded = 0;
  int value_dim_padded = 0;
  int64_t length = 0;
  ElementType kv_type = ElementType::kFloat32;
  // Rows whose length is a multiple of kLanes are read in place (and
  // converted in registers); others are first converted to padded floats.
  bool direct_keys = false;
  bool direct_values = false;
  int64_t rows_per_unit = 1;
  // The problem's index in error messages, or -1 to name none (the call
  // held it alone).
  int64_t message_index = -1;
};

// Shape facts of `problem`. REQUIRES: a validated problem.
ProblemInfo DescribeProblem(const AttentionProblem& problem);

// How error messages name problem `index` of a backend call: "problem N"
// followed by `separator`, or "" for index -1 (the call held it alone).
std::string ProblemLabel(int64_t index, absl::string_view separator);

// Query rows [row_begin, row_end) of one problem and every query head that
// reads KV head `kv_head`. Units write disjoint parts of the outputs.
struct Unit {
  int problem = 0;
  int kv_head = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  KeyRanges keys;  // keys some row of the unit sees (RowBlockKeys)
  // Its chunks (increasing) are chunk_list[chunks_begin, chunks_end).
  int64_t chunks_begin = 0;
  int64_t chunks_end = 0;
  // Split units run as several items that store per-chunk states at
  // `partial` (floats) in the call's partial buffer; a merge step then
  // produces the outputs. Other units run as one item.
  bool split = false;
  int64_t partial = 0;
};

// A chunk or row state of R row-heads: m [R], l [R], acc [R][value_dim_p].
inline int64_t StateFloats(int64_t row_heads, int value_dim_padded) {
  return row_heads * (2 + value_dim_padded);
}

// Per-thread buffers, reused across units and calls (attention_unit.cc).
struct Scratch;

// At most this many units run interleaved (UnitRunner::RunInterleaved).
inline constexpr int kMaxInterleavedUnits = 8;

// Runs one unit (or a piece of one) on the calling thread, following
// attention_problem.h exactly.
class UnitRunner {
 public:
  // Uses the calling thread's scratch buffers: construct and run on the
  // same thread. All references must outlive the runner.
  // `slot` picks one of the thread's kMaxInterleavedUnits scratch sets:
  // runners alive on one thread at the same time need different slots.
  UnitRunner(const KernelTable& kernels, const AttentionProblem& problem,
             const ProblemInfo& info, const Unit& unit, int slot = 0);

  // A piece of a split unit: the states of `count` chunks, each
  // StateFloats() apart at `states`.
  absl::Status ComputeChunkStates(const int64_t* chunks, int64_t count,
                                  float* states);
  // The merge step of a split unit over all its `count` chunk states.
  absl::Status MergeAndFinish(int64_t count, const float* states);

  // Several units of one problem and row block (so with the same keys and
  // chunks) that differ in their KV head, over chunks[0, count), with
  // their tiles interleaved: every unit's tile t, then every unit's tile
  // t + 1. With states == nullptr the units run whole (chunk states merged
  // into the row states in order, then the outputs); otherwise as pieces
  // of split units (ComputeChunkStates, unit k's states at states[k]).
  // Where a paged block stores the KV heads' rows of its tokens next to
  // each other, the units read it in one sweep, which the hardware
  // prefetchers follow better than each head's short run alone. Each unit
  // computes exactly what it would alone, in the same order. statuses[k]
  // gets unit k's status; a failed unit stops, the others go on.
  // REQUIRES: 1 <= runners.size() <= kMaxInterleavedUnits, each runner
  // with its own scratch slot.
  static void RunInterleaved(absl::Span<UnitRunner* const> runners,
                             const int64_t* chunks, int64_t count,
                             float* const* states, absl::Status* statuses);

 private:
  int64_t Position(int64_t r) const {
    return pr_.mask.query_start + unit_.row_begin + r;
  }
  // ProblemLabel of this problem; and "query row R (position X), head H",
  // for messages: in the numbers of the problem's origin when it has one.
  std::string ProblemLabel(absl::string_view separator) const;
  std::string RowName(int64_t r, int head) const;
  // Key `key`'s position for messages (its origin's when it has one).
  int64_t KeyName(int64_t key) const {
    return pr_.origin != nullptr ? pr_.origin->keys[key] : key;
  }
  void LoadQueries();
  void InitRowState(float* state);
  void MergeInto(float* row_state, const float* chunk_state);
  // RunInterleaved's steps for one unit: Begin (BeginWhole for a whole
  // unit), then per chunk StartChunk, Tile for each of its tiles and
  // (whole units) EndChunk; then (whole units) EndWhole.
  void Begin();
  void BeginWhole(int64_t count);
  void StartChunk(float* state, TileJob* job) const;
  void EndChunk();
  absl::Status EndWhole();
  // Tile [t0, t0 + kKeysPerTile) of the current chunk into `job`'s state,
  // prefetching `next`'s rows of tile next_t0 meanwhile (`next` may be
  // this runner).
  absl::Status Tile(int64_t t0, TileJob* job, UnitRunner& next,
                    int64_t next_t0);
  // Fills `job` for tile [t0, t1); false when no row of the unit sees a
  // key of it.
  bool PrepareTile(int64_t t0, int64_t t1, bool with_values, TileJob* job);
  // Addresses of the unit's keys (or values) at positions [t0, t1) into
  // rows[0, t1 - t0); nullptr for positions no row of the unit sees.
  void FindRows(int64_t t0, int64_t t1, bool values,
                const std::byte** rows) const;
  // Whether the unit's keys include every position of [t0, t1) (FindRows
  // then leaves no row missing).
  bool CoversTile(int64_t t0, int64_t t1) const {
    for (int i = 0; i < unit_.keys.count; ++i) {
      if (unit_.keys.begin[i] <= t0 && t1 <= unit_.keys.end[i]) return true;
    }
    return false;
  }
  // Row pointers for the kernels: FindRows with zeros for missing rows,
  // or rows converted to padded floats; returns their element type.
  ElementType LoadRows(int64_t t0, int64_t t1, bool values,
                       const std::byte** rows);
  absl::Status TileFailure(TileError error, const TileJob& job, int64_t t0);
  absl::Status Finish(const float* state);
  void WriteWeights(const float* state);

  const KernelTable& kernels_;
  const AttentionProblem& pr_;
  const ProblemInfo& info_;
  const Unit& unit_;
  const int64_t rows_;
  const int64_t row_heads_;
  // Whether the unit widens each tile's half-precision rows to floats once
  // (LoadRows) rather than reading them in place, which converts a row in
  // registers again for every group of row-heads the kernels handle
  // together: worth it for the many row-heads of a prefill or a shared
  // chunk. Widening is exact, so results are the same either way.
  const bool widen_rows_;
  const int first_head_;
  const int64_t state_floats_;
  Scratch& scratch_;
  const float* q_ = nullptr;
  // The tile whose rows are in scratch_.next_*_rows (found for prefetching
  // while the tile before it was computed).
  int64_t found_t0_ = -1;
  int64_t found_t1_ = -1;
  // Whole units: the row state, and the chunk state (the row state itself
  // for a lone chunk).
  float* row_state_ = nullptr;
  float* chunk_state_ = nullptr;
  bool lone_ = false;
};

}  // namespace attention::cpu

#endif  // ATTENTION_CORE_CPU_ATTENTION_UNIT_H_
