// Shared-prefix decode: when several decode steps in one Attend call read
// the same physical KV blocks (sessions forked from one prompt: parallel
// sampling, beam search, a common system prompt), each shared 512-key chunk
// is read once for all of them instead of once per step.
//
// A chunk's state (attention_problem.h: a chunk state is computed from
// empty, then merged in order) depends only on the chunk's keys and values
// and on each query row, so computing it for many rows together gives every
// row bitwise the state it gets alone; units that take part are run as
// split units and merge their chunk states exactly as before. Sharing
// therefore never changes results.
#ifndef ATTENTION_CORE_CPU_SHARED_CHUNKS_H_
#define ATTENTION_CORE_CPU_SHARED_CHUNKS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/attention_problem.h"
#include "core/cpu/attention_unit.h"
#include "core/cpu/kernels.h"

namespace attention::cpu {

// One unit's use of a shared chunk: the chunk is chunk_list[slot], and its
// state goes to the unit's partial buffer at (slot - unit.chunks_begin).
struct SharedChunkMember {
  int64_t unit = 0;
  int64_t slot = 0;
};

// A chunk (kKeysPerSplit keys at chunk * kKeysPerSplit) of one KV head whose
// blocks several units read, all of whose rows see every key of it.
struct SharedChunk {
  int64_t chunk = 0;
  int kv_head = 0;
  std::vector<SharedChunkMember> members;  // >= 2, increasing unit order
};

// Finds the chunks worth sharing among `units`. Only decode-like units take
// part (one query row; no bias; no weights requested) and only complete
// chunks that every member row sees whole. A group with more rows than a
// unit may hold (ProblemInfo::rows_per_unit) is cut into several
// SharedChunks of similar size.
std::vector<SharedChunk> FindSharedChunks(
    absl::Span<const AttentionProblem> problems,
    absl::Span<const ProblemInfo> infos, absl::Span<const Unit> units,
    absl::Span<const int64_t> chunk_list);

// Computes `shared`'s chunk state once for all members and stores each
// member's part at partial + units[member.unit].partial +
// (member.slot - units[member.unit].chunks_begin) * StateFloats(group, vdp).
// On a failure (e.g. a logit that is not finite) nothing is reported here:
// it returns the status and the caller recomputes the members one by one
// so that each reports its own error.
// REQUIRES: every member unit is split. Thread-compatible: different
// SharedChunks (which touch different slots) may run concurrently.
absl::Status ComputeSharedChunk(const KernelTable& kernels,
                                absl::Span<const AttentionProblem> problems,
                                absl::Span<const ProblemInfo> infos,
                                absl::Span<const Unit> units,
                                const SharedChunk& shared, float* partial);

}  // namespace attention::cpu

#endif  // ATTENTION_CORE_CPU_SHARED_CHUNKS_H_
