#include "core/cpu/shared_chunks.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "core/dtype.h"

namespace attention::cpu {
namespace {

bool DecodeLike(const AttentionProblem& problem, const Unit& unit) {
  return unit.row_end - unit.row_begin == 1 && problem.bias == nullptr &&
         problem.weights == nullptr;
}

// Whether the query at position `p` sees every key of [c0, c1) (the mask
// rule of attention_problem.h, checked at the hardest key).
bool SeesWholeChunk(const MaskSpec& mask, int64_t p, int64_t c0, int64_t c1) {
  if (mask.causal && c1 - 1 > p) return false;
  if (mask.window <= 0) return true;
  const int64_t first_non_sink =
      std::max<int64_t>(c0, int64_t{mask.num_sink_tokens});
  return first_non_sink >= c1 || p - first_non_sink < mask.window;
}

template <typename T>
void AppendBytes(const T& value, std::string* key) {
  key->append(reinterpret_cast<const char*>(&value), sizeof(value));
}

// Everything two units must agree on for their chunk states to come from
// one computation: the block addresses of the chunk, the KV layout, the
// head grouping and the scale, written over `*key_out` (its capacity reused
// from call to call). False when the chunk cannot be shared.
bool ChunkKey(const AttentionProblem& problem, const ProblemInfo& info,
              int kv_head, int64_t chunk, std::string* key_out) {
  const KvView& kv = problem.kv;
  const int64_t c0 = chunk * kKeysPerSplit;
  const int64_t c1 = c0 + kKeysPerSplit;
  const int64_t first_block = c0 / kv.tokens_per_block;
  const int64_t last_block = (c1 - 1) / kv.tokens_per_block;
  if (last_block >= kv.num_blocks()) return false;
  std::string& key = *key_out;
  key.clear();
  AppendBytes(chunk, &key);
  AppendBytes(kv_head, &key);
  AppendBytes(info.heads, &key);
  AppendBytes(kv.dtype, &key);
  AppendBytes(kv.num_kv_heads, &key);
  AppendBytes(kv.head_dim, &key);
  AppendBytes(kv.value_dim, &key);
  AppendBytes(kv.tokens_per_block, &key);
  AppendBytes(kv.k_token_stride, &key);
  AppendBytes(kv.k_head_stride, &key);
  AppendBytes(kv.v_token_stride, &key);
  AppendBytes(kv.v_head_stride, &key);
  AppendBytes(problem.scale, &key);
  for (int64_t b = first_block; b <= last_block; ++b) {
    if (kv.k_block(b) == nullptr || kv.v_block(b) == nullptr) return false;
    AppendBytes(kv.k_block(b), &key);
    AppendBytes(kv.v_block(b), &key);
  }
  return true;
}

// Per-thread buffers of ComputeSharedChunk.
struct SharedScratch {
  std::vector<float> queries;
  std::vector<float> states;
};

SharedScratch& ThreadSharedScratch() {
  thread_local SharedScratch scratch;
  return scratch;
}

}  // namespace

std::vector<SharedChunk> FindSharedChunks(
    absl::Span<const AttentionProblem> problems,
    absl::Span<const ProblemInfo> infos, absl::Span<const Unit> units,
    absl::Span<const int64_t> chunk_list) {
  // Groups in order of first appearance, so that the plan is reproducible.
  absl::flat_hash_map<std::string, size_t> group_of;
  std::vector<std::vector<SharedChunkMember>> groups;
  std::vector<std::pair<int64_t, int>> group_chunk;  // (chunk, kv_head)
  std::string key;  // one buffer: a key is copied only for a new group
  for (size_t u = 0; u < units.size(); ++u) {
    const Unit& unit = units[u];
    const AttentionProblem& problem = problems[unit.problem];
    const ProblemInfo& info = infos[unit.problem];
    if (!DecodeLike(problem, unit)) continue;
    const int64_t position = problem.mask.query_start + unit.row_begin;
    for (int64_t slot = unit.chunks_begin; slot < unit.chunks_end; ++slot) {
      const int64_t chunk = chunk_list[slot];
      const int64_t c0 = chunk * kKeysPerSplit;
      const int64_t c1 = c0 + kKeysPerSplit;
      if (c1 > info.length || !SeesWholeChunk(problem.mask, position, c0, c1)) {
        continue;
      }
      if (!ChunkKey(problem, info, unit.kv_head, chunk, &key)) continue;
      auto it = group_of.find(key);
      if (it == group_of.end()) {
        it = group_of.emplace(key, groups.size()).first;
        groups.emplace_back();
        group_chunk.emplace_back(chunk, unit.kv_head);
      }
      groups[it->second].push_back(
          SharedChunkMember{static_cast<int64_t>(u), slot});
    }
  }
  std::vector<SharedChunk> shared;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::vector<SharedChunkMember>& members = groups[g];
    const int64_t n = static_cast<int64_t>(members.size());
    if (n < 2) continue;
    const int64_t most = std::max<int64_t>(
        2, infos[units[members[0].unit].problem].rows_per_unit);
    const int64_t pieces = (n + most - 1) / most;
    for (int64_t p = 0; p < pieces; ++p) {
      const int64_t begin = n * p / pieces;
      const int64_t end = n * (p + 1) / pieces;
      if (end - begin < 2) continue;  // nothing to share
      SharedChunk piece;
      piece.chunk = group_chunk[g].first;
      piece.kv_head = group_chunk[g].second;
      piece.members.assign(members.begin() + begin, members.begin() + end);
      shared.push_back(std::move(piece));
    }
  }
  return shared;
}

absl::Status ComputeSharedChunk(const KernelTable& kernels,
                                absl::Span<const AttentionProblem> problems,
                                absl::Span<const ProblemInfo> infos,
                                absl::Span<const Unit> units,
                                const SharedChunk& shared, float* partial) {
  const int64_t n = static_cast<int64_t>(shared.members.size());
  const Unit& first = units[shared.members[0].unit];
  const AttentionProblem& base = problems[first.problem];
  const ProblemInfo& base_info = infos[first.problem];
  const int group = base_info.group;
  const int hd = base_info.head_dim;
  const int first_head = shared.kv_head * group;

  // The members' queries as float32 rows of one problem [n, H, head_dim]
  // (only this KV head's query heads are filled: the only ones read).
  // Widening is exact, so the runner sees the very floats each member's
  // own runner would.
  SharedScratch& scratch = ThreadSharedScratch();
  scratch.queries.resize(static_cast<size_t>(n) * base_info.heads * hd);
  for (int64_t i = 0; i < n; ++i) {
    const Unit& unit = units[shared.members[i].unit];
    const TensorView& q = problems[unit.problem].q;
    const int64_t element = DTypeSize(q.dtype);
    for (int h = 0; h < group; ++h) {
      const int64_t from =
          (unit.row_begin * base_info.heads + first_head + h) * hd;
      const int64_t to = (i * base_info.heads + first_head + h) * hd;
      ConvertToFloat(q.dtype, q.data + from * element, hd,
                     scratch.queries.data() + to);
    }
  }
  AttentionProblem joint;
  joint.q.dtype = DType::kFloat32;
  joint.q.shape = {n, int64_t{base_info.heads}, int64_t{hd}};
  joint.q.data = reinterpret_cast<const std::byte*>(scratch.queries.data());
  joint.q.size_bytes =
      static_cast<int64_t>(scratch.queries.size() * sizeof(float));
  // The chunk's blocks are the same in every member's view.
  joint.kv = base.kv;
  // Every joint row sees the whole chunk, as every member row does.
  const int64_t c0 = shared.chunk * kKeysPerSplit;
  const int64_t c1 = c0 + kKeysPerSplit;
  joint.mask.causal = true;
  joint.mask.query_start = c1 - 1;
  joint.scale = base.scale;
  const ProblemInfo joint_info = DescribeProblem(joint);
  Unit joint_unit;
  joint_unit.kv_head = shared.kv_head;
  joint_unit.row_begin = 0;
  joint_unit.row_end = n;
  joint_unit.keys.Add(c0, c1);

  const int64_t row_heads = n * group;
  const int vdp = base_info.value_dim_padded;
  scratch.states.resize(StateFloats(row_heads, vdp));
  UnitRunner runner(kernels, joint, joint_info, joint_unit);
  const int64_t chunk = shared.chunk;
  if (absl::Status status =
          runner.ComputeChunkStates(&chunk, 1, scratch.states.data());
      !status.ok()) {
    return status;
  }
  // Joint state: m [n*g], l [n*g], acc [n*g][vdp]; member i owns row-heads
  // [i*g, (i+1)*g). A member's state: m [g], l [g], acc [g][vdp].
  const float* m = scratch.states.data();
  const float* l = m + row_heads;
  const float* acc = l + row_heads;
  const int64_t member_floats = StateFloats(group, vdp);
  for (int64_t i = 0; i < n; ++i) {
    const SharedChunkMember& member = shared.members[i];
    const Unit& unit = units[member.unit];
    float* out = partial + unit.partial +
                 (member.slot - unit.chunks_begin) * member_floats;
    std::memcpy(out, m + i * group, group * sizeof(float));
    std::memcpy(out + group, l + i * group, group * sizeof(float));
    std::memcpy(out + 2 * group, acc + i * group * vdp,
                static_cast<size_t>(group) * vdp * sizeof(float));
  }
  return absl::OkStatus();
}

}  // namespace attention::cpu
