#include "core/cpu/cpu_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cpu/attention_unit.h"
#include "core/cpu/index_kernels.h"
#include "core/cpu/kernels.h"
#include "core/cpu/shared_chunks.h"
#include "core/cpu/topk_attention.h"
#include "core/cpu/work_split.h"
#include "core/dtype.h"
#include "core/status_macros.h"
#include "core/work_plan.h"

namespace attention {
namespace {

using cpu::KernelTable;
using cpu::ProblemInfo;
using cpu::Unit;
using cpu::UnitRunner;

constexpr int64_t kHugePageBytes = int64_t{2} << 20;

const KernelTable* KernelsFor(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return cpu::Avx512Kernels();
    case CpuIsa::kAvx2:
      return cpu::Avx2Kernels();
    case CpuIsa::kScalar:
      break;
  }
  return cpu::ScalarKernels();
}

class CpuArena final : public DeviceArena {
 public:
  CpuArena(std::byte* data, int64_t size) : data_(data), size_(size) {}
  ~CpuArena() override { std::free(data_); }
  std::byte* data() override { return data_; }
  int64_t size_bytes() const override { return size_; }

 private:
  std::byte* data_;
  int64_t size_;
};

// Below this much work (visible keys x query rows, summed over units) an
// Attend call runs on the calling thread: waking a worker costs more than
// it saves: measured, a decode step of 32 query heads gains from a second
// thread from about 100 keys on. Never changes results.
constexpr int64_t kInlineWorkLimit = 2048;

// An AttendDense call offers the pool at most this many tasks per thread
// (each runs consecutive items): enough to balance unequal items.
constexpr int kTasksPerThread = 16;
// Most floats of chunk states a call's split units may take (256 MiB); the
// decode of GQA 32/8, d 128 over 131072 keys takes 4 MiB.
constexpr int64_t kMaxPartialFloats = int64_t{64} << 20;

// One parallel task: (shared >= 0) one shared chunk for all its member
// units, or chunk_list[chunks_begin, chunks_end) of unit `unit` and the
// same chunks of the units after it up to unit_end (a group of KV heads of
// one problem and row block, run interleaved: UnitRunner::RunInterleaved).
struct Item {
  int64_t unit;
  int64_t chunks_begin;
  int64_t chunks_end;
  int64_t shared = -1;
  int64_t unit_end = -1;
};

}  // namespace

CpuBackend::CpuBackend(int num_threads, absl::Duration spin)
    : CpuBackend(
          num_threads,
          [] {
            std::string warning;
            const CpuIsa isa = DefaultCpuIsa(&warning);
            if (!warning.empty()) {
              std::cerr << "attention: " << warning << "\n";
            }
            return isa;
          }(),
          spin) {}

CpuBackend::CpuBackend(int num_threads, CpuIsa isa, absl::Duration spin)
    : pool_(num_threads, spin), isa_(isa), kernels_(KernelsFor(isa)) {
  device_ = absl::StrCat(CpuModelName(), " (", CpuIsaName(isa_), ", ",
                         pool_.num_threads(),
                         pool_.num_threads() == 1 ? " thread)" : " threads)");
}

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(
    int num_threads, CpuIsa isa, absl::Duration spin) {
  if (!CpuIsaSupported(isa)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this processor or build cannot run the ", CpuIsaName(isa),
        " kernels; the best supported is ", CpuIsaName(BestCpuIsa())));
  }
  return std::unique_ptr<CpuBackend>(new CpuBackend(num_threads, isa, spin));
}

CpuBackend::~CpuBackend() = default;

absl::StatusOr<std::unique_ptr<DeviceArena>> CpuBackend::AllocateArena(
    int64_t bytes) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV arena size must be >= 0, got ", bytes));
  }
  if (bytes == 0) return std::make_unique<CpuArena>(nullptr, 0);
  // Large arenas are aligned to (and advised as) 2 MiB huge pages: a decode
  // walks every block of a long context, and 4 KiB pages would cost a TLB
  // miss per block run. Pages are still committed only when written.
  const int64_t alignment = bytes >= kHugePageBytes ? kHugePageBytes : 64;
  const int64_t rounded = (bytes + alignment - 1) / alignment * alignment;
  void* memory = nullptr;
  // posix_memalign reserves address space only; pages are committed when
  // first written.
  if (rounded < bytes ||
      posix_memalign(&memory, alignment, static_cast<size_t>(rounded)) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate ", bytes,
        " bytes of host memory for the KV cache; lower --kv_cache_bytes"));
  }
#if defined(MADV_HUGEPAGE)
  if (alignment == kHugePageBytes) {
    // Advisory only: where transparent huge pages are off nothing changes.
    madvise(memory, static_cast<size_t>(rounded), MADV_HUGEPAGE);
  }
#endif
  return std::make_unique<CpuArena>(static_cast<std::byte*>(memory), bytes);
}

absl::Status CpuBackend::WriteKv(const KvWrite& write) {
  const KvBlockLayout& layout = write.layout;
  const int64_t num_tokens = write.k.dim(0);
  const int num_kv_heads = layout.num_kv_heads;
  const int head_dim = layout.head_dim;
  const int value_dim = layout.value_dim;
  const int64_t tokens_per_block = layout.tokens_per_block;
  const int64_t element = DTypeSize(layout.dtype);
  const int64_t k_element = DTypeSize(write.k.dtype);
  const int64_t v_element = DTypeSize(write.v.dtype);

  if (num_tokens == 0) return absl::OkStatus();
  const int64_t first_block = write.start / tokens_per_block;
  const int64_t last_block = (write.start + num_tokens - 1) / tokens_per_block;
  for (int64_t block = first_block; block <= last_block; ++block) {
    if (block >= write.num_blocks() || write.block(block) == nullptr) {
      return absl::InternalError(
          absl::StrCat("KV block ", block, " for positions from ",
                       std::max(write.start, block * tokens_per_block),
                       " is missing; this is a bug in the block pool"));
    }
  }
  // Each task converts a run of tokens into their blocks.
  constexpr int64_t kTokensPerTask = 64;
  const int64_t num_tasks = (num_tokens + kTokensPerTask - 1) / kTokensPerTask;
  auto convert = [&](int64_t task) {
    const int64_t end = std::min(num_tokens, (task + 1) * kTokensPerTask);
    for (int64_t t = task * kTokensPerTask; t < end; ++t) {
      const int64_t pos = write.start + t;
      std::byte* block = write.block(pos / tokens_per_block);
      const int64_t row = pos % tokens_per_block;
      if (layout.index_dim > 0) {
        const int64_t index_element = DTypeSize(write.index_k.dtype);
        ConvertDType(write.index_k.dtype,
                     write.index_k.data + t * layout.index_dim * index_element,
                     layout.index_dim, layout.dtype,
                     block + layout.index_offset_bytes() +
                         row * layout.index_dim * element);
      }
      for (int h = 0; h < num_kv_heads; ++h) {
        const int64_t slot = int64_t{h} * tokens_per_block + row;
        ConvertDType(
            write.k.dtype,
            write.k.data + (t * num_kv_heads + h) * head_dim * k_element,
            head_dim, layout.dtype, block + slot * head_dim * element);
        // A shared latent's values are the leading entries of its key.
        if (layout.shared_values) continue;
        ConvertDType(
            write.v.dtype,
            write.v.data + (t * num_kv_heads + h) * value_dim * v_element,
            value_dim, layout.dtype,
            block + layout.value_offset_bytes() + slot * value_dim * element);
      }
    }
  };
  // A decode step's one task runs here, without wrapping it for the pool.
  if (num_tasks == 1) {
    convert(0);
  } else {
    pool_.ParallelFor(num_tasks, convert);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::ReadBlock(const std::byte* src, std::byte* dst,
                                   int64_t bytes) {
  // Block memory is host memory: the same copy.
  return CopyBlock(src, dst, bytes);
}

absl::Status CpuBackend::CopyBlock(const std::byte* src, std::byte* dst,
                                   int64_t bytes) {
  if (bytes < 0 || (bytes > 0 && (src == nullptr || dst == nullptr))) {
    return absl::InternalError(
        absl::StrCat("invalid block copy of ", bytes,
                     " bytes; this is a bug in the caller"));
  }
  if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
  return absl::OkStatus();
}

absl::Status CpuBackend::Attend(absl::Span<const AttentionProblem> problems) {
  // Messages name a problem by its index in `problems`, unless it is alone;
  // the error is that of the first failing problem, whichever its kind.
  std::vector<absl::Status> statuses(problems.size());
  Run(problems, /*named=*/problems.size() > 1, absl::MakeSpan(statuses));
  for (absl::Status& status : statuses) {
    if (!status.ok()) return std::move(status);
  }
  return absl::OkStatus();
}

void CpuBackend::AttendEach(absl::Span<const AttentionProblem> problems,
                            absl::Span<absl::Status> statuses) {
  Run(problems, /*named=*/false, statuses);
}

void CpuBackend::Run(absl::Span<const AttentionProblem> problems, bool named,
                     absl::Span<absl::Status> statuses) {
  std::vector<AttentionProblem> dense;
  std::vector<int64_t> dense_names;
  std::vector<size_t> dense_index;
  dense.reserve(problems.size());
  dense_names.reserve(problems.size());
  dense_index.reserve(problems.size());
  for (size_t p = 0; p < problems.size(); ++p) {
    const AttentionProblem& problem = problems[p];
    const int64_t name = named ? static_cast<int64_t>(p) : -1;
    if (problem.topk == nullptr) {
      dense.push_back(problem);
      dense_names.push_back(name);
      dense_index.push_back(p);
      continue;
    }
    statuses[p] =
        cpu::AttendTopK(problem, name, pool_, cpu::IndexScoresFor(isa_),
                        [this](absl::Span<const AttentionProblem> rows) {
                          return AttendDense(rows, {},
                                             /*share_chunks=*/false);
                        });
  }
  if (dense.empty()) return;
  std::vector<absl::Status> dense_statuses(dense.size());
  AttendDense(dense.size() == problems.size()
                  ? problems
                  : absl::Span<const AttentionProblem>(dense),
              dense_names, /*share_chunks=*/true,
              absl::MakeSpan(dense_statuses))
      .IgnoreError();  // each problem's is in dense_statuses
  for (size_t k = 0; k < dense.size(); ++k) {
    statuses[dense_index[k]] = std::move(dense_statuses[k]);
  }
}

namespace {

// The work of one AttendDense call (core/work_plan.h): units (a block of
// query rows x one KV head) with their key ranges and chunks, and the items
// the threads run. Planning never changes results.
struct DensePlan {
  std::vector<ProblemInfo> infos;
  std::vector<Unit> units;
  std::vector<int64_t> chunk_list;  // every unit's chunks, increasing
  int64_t work = 0;                 // visible keys x query row-heads
  std::vector<cpu::SharedChunk> shared;
  std::vector<char> slot_shared;  // per chunk_list slot
  // Units [previous end, group_ends[i]) run as one item (PlanGroups).
  std::vector<int64_t> group_ends;
  std::vector<Item> items;
  int64_t partial_floats = 0;
  // Of kMaxPartialFloats, what the units with shared chunks take.
  int64_t shared_partial_floats = 0;
  bool inline_run = false;
};

// Mask -> key ranges -> chunks, per unit. `names`: as AttendDense.
void PlanUnits(absl::Span<const AttentionProblem> problems,
               absl::Span<const int64_t> names, DensePlan* plan) {
  plan->infos.reserve(problems.size());
  for (size_t p = 0; p < problems.size(); ++p) {
    const AttentionProblem& problem = problems[p];
    plan->infos.push_back(cpu::DescribeProblem(problem));
    if (!names.empty()) plan->infos.back().message_index = names[p];
    const ProblemInfo& info = plan->infos.back();
    const MaskSpec& mask = problem.mask;
    for (int64_t r = 0; r < info.rows; r += info.rows_per_unit) {
      for (int g = 0; g < info.kv_heads; ++g) {
        Unit unit;
        unit.problem = static_cast<int>(p);
        unit.kv_head = g;
        unit.row_begin = r;
        unit.row_end = std::min(info.rows, r + info.rows_per_unit);
        unit.keys = RowBlockKeys(mask.causal, mask.window, mask.num_sink_tokens,
                                 info.length, mask.query_start + unit.row_begin,
                                 mask.query_start + unit.row_end - 1);
        unit.chunks_begin = static_cast<int64_t>(plan->chunk_list.size());
        ForEachChunk(unit.keys,
                     [plan](int64_t c) { plan->chunk_list.push_back(c); });
        unit.chunks_end = static_cast<int64_t>(plan->chunk_list.size());
        plan->work +=
            unit.keys.size() * (unit.row_end - unit.row_begin) * info.group;
        plan->units.push_back(unit);
      }
    }
  }
}

// Floats of one chunk state of `unit`, and of all of them (what splitting
// it takes).
int64_t StateFloatsOf(const DensePlan& plan, const Unit& unit) {
  const ProblemInfo& info = plan.infos[unit.problem];
  return cpu::StateFloats((unit.row_end - unit.row_begin) * info.group,
                          info.value_dim_padded);
}
int64_t SplitFloatsOf(const DensePlan& plan, const Unit& unit) {
  return (unit.chunks_end - unit.chunks_begin) * StateFloatsOf(plan, unit);
}

// Decode steps of a batch that read the same KV blocks (forks of one
// prompt) compute each shared chunk once for all of them. A unit with a
// shared chunk is split, and keeps a state for each of its chunks: units
// take part in unit order while their states fit kMaxPartialFloats (many
// forks of a long, wide history took gigabytes); the others compute alone,
// which changes no result.
void PlanSharedChunks(absl::Span<const AttentionProblem> problems,
                      bool share_chunks, DensePlan* plan) {
  plan->slot_shared.assign(plan->chunk_list.size(), 0);
  if (!share_chunks || problems.size() <= 1) return;
  plan->shared = cpu::FindSharedChunks(problems, plan->infos, plan->units,
                                       plan->chunk_list);
  std::vector<int64_t> members;
  for (const cpu::SharedChunk& chunk : plan->shared) {
    for (const cpu::SharedChunkMember& member : chunk.members) {
      members.push_back(member.unit);
    }
  }
  std::sort(members.begin(), members.end());
  members.erase(std::unique(members.begin(), members.end()), members.end());
  std::vector<char> admitted(plan->units.size(), 0);
  int64_t floats = 0;
  for (const int64_t u : members) {
    const int64_t need = SplitFloatsOf(*plan, plan->units[u]);
    if (floats + need > kMaxPartialFloats) continue;
    floats += need;
    admitted[u] = 1;
  }
  plan->shared_partial_floats = floats;
  for (cpu::SharedChunk& chunk : plan->shared) {
    std::erase_if(chunk.members, [&](const cpu::SharedChunkMember& member) {
      return !admitted[member.unit];
    });
  }
  std::erase_if(plan->shared, [](const cpu::SharedChunk& chunk) {
    return chunk.members.size() < 2;
  });
  for (const cpu::SharedChunk& chunk : plan->shared) {
    for (const cpu::SharedChunkMember& member : chunk.members) {
      plan->slot_shared[member.slot] = 1;
    }
  }
}

// Whether reading a tile of every KV head in turn sweeps the KV memory
// better than reading each head's rows alone: when one head's rows of a
// tile reach as far as the next head's (paged blocks of at most a tile of
// tokens, whose heads' runs are adjacent; token-major contiguous KV). Not
// with longer blocks: there each head's run is long already, and
// interleaving would cut it into pieces.
bool InterleaveHeads(const KvView& kv) {
  return kv.k_head_stride <= kKeysPerTile * kv.k_token_stride &&
         kv.v_head_stride <= kKeysPerTile * kv.v_token_stride;
}

bool HasSharedChunks(const DensePlan& plan, const Unit& unit) {
  const char* shared = plan.slot_shared.data() + unit.chunks_begin;
  const char* end = shared + (unit.chunks_end - unit.chunks_begin);
  return std::find(shared, end, 1) != end;
}

// Groups units into runs of consecutive units [begin, end) that run as one
// item, interleaved: the units of one problem and row block (its KV heads,
// which share keys and chunks), at most cpu::kMaxInterleavedUnits, where
// InterleaveHeads says so. Units that return attention weights run alone
// (they are never split, so grouping them could leave threads idle), and
// so do units with shared chunks (each is split around its shared slots).
// REQUIRES: PlanSharedChunks has run.
void PlanGroups(absl::Span<const AttentionProblem> problems, DensePlan* plan) {
  auto alone = [&](const Unit& unit) {
    const AttentionProblem& problem = problems[unit.problem];
    return problem.weights != nullptr || !InterleaveHeads(problem.kv) ||
           HasSharedChunks(*plan, unit);
  };
  const int64_t num_units = static_cast<int64_t>(plan->units.size());
  for (int64_t u = 0, end = 0; u < num_units; u = end) {
    const Unit& first = plan->units[u];
    end = u + 1;
    if (!alone(first)) {
      while (end < num_units && end - u < cpu::kMaxInterleavedUnits &&
             plan->units[end].problem == first.problem &&
             plan->units[end].row_begin == first.row_begin &&
             !alone(plan->units[end])) {
        ++end;
      }
    }
    plan->group_ends.push_back(end);
  }
}

// Chunks -> work items, a group of units (PlanGroups) at a time. Groups
// with too few siblings to occupy the threads, and units with shared
// chunks, are split: their chunk states go to the partial buffer in pieces
// of at most `chunks_per_piece` chunks, merged afterwards.
void PlanItems(absl::Span<const AttentionProblem> problems,
               int64_t chunks_per_piece, DensePlan* plan) {
  // Shared chunks first: each is a long item, better started early.
  for (size_t s = 0; s < plan->shared.size(); ++s) {
    plan->items.push_back(Item{-1, 0, 0, static_cast<int64_t>(s)});
  }
  int64_t u = 0;
  // The other split units' states, after the shared ones' (wherever those
  // come in unit order).
  int64_t other_floats = 0;
  for (const int64_t end : plan->group_ends) {
    const Unit& first = plan->units[u];
    const int64_t count = first.chunks_end - first.chunks_begin;
    int64_t group_floats = 0;  // its chunk states, if split
    for (int64_t k = u; k < end; ++k) {
      group_floats += SplitFloatsOf(*plan, plan->units[k]);
    }
    // Splitting only spreads the work (it changes no result): not past
    // kMaxPartialFloats (a group of many heads per KV head and wide values
    // over a long history took gigabytes of chunk states). Units with
    // shared chunks are within it already (PlanSharedChunks).
    const bool has_shared = HasSharedChunks(*plan, first);
    const bool split =
        has_shared ||
        (count > chunks_per_piece &&
         problems[first.problem].weights == nullptr &&
         plan->shared_partial_floats + other_floats + group_floats <=
             kMaxPartialFloats);
    if (split && !has_shared) other_floats += group_floats;
    for (int64_t k = u; k < end; ++k) {
      Unit& unit = plan->units[k];
      unit.split = split;
      if (!split) continue;
      unit.partial = plan->partial_floats;
      plan->partial_floats += SplitFloatsOf(*plan, unit);
    }
    if (!split) {
      plan->items.push_back(
          Item{u, first.chunks_begin, first.chunks_end, -1, end});
    } else {
      // The shared slots' states come from the shared items above.
      const char* shared = plan->slot_shared.data() + first.chunks_begin;
      ForEachPiece(
          count, chunks_per_piece,
          [shared](int64_t slot) { return shared[slot] != 0; },
          [&](int64_t begin, int64_t piece_end) {
            plan->items.push_back(Item{u, first.chunks_begin + begin,
                                       first.chunks_begin + piece_end, -1,
                                       end});
          });
    }
    u = end;
  }
}

// Runs a DensePlan's items and the merges of its split units. Items run in
// any order, but a problem's reported error is always the first one of its
// lowest failing unit (in its own processing order: chunk order for split
// units), so it never depends on scheduling, thread count, splitting or
// sharing; the call's is that of the first failing problem (units are
// numbered in error order). Work of a problem's units above its failed one
// is skipped; the other problems run in full.
class DenseRun {
 public:
  DenseRun(const KernelTable& kernels,
           absl::Span<const AttentionProblem> problems, const DensePlan& plan,
           std::atomic<int64_t>* shared_computations)
      : kernels_(kernels),
        problems_(problems),
        plan_(plan),
        shared_computations_(shared_computations),
        partial_(plan.partial_floats > 0 ? new float[plan.partial_floats]
                                         : nullptr),
        slot_errors_(plan.chunk_list.size()),
        unit_errors_(plan.units.size()),
        first_failed_(problems.size()) {
    for (std::atomic<int64_t>& failed : first_failed_) failed = kNone;
  }

  void RunItem(int64_t i);
  // Merges split unit `u`'s chunk states in increasing chunk order.
  void MergeUnit(int64_t u);
  // Problem `p`'s status: the first error of its lowest failing unit.
  absl::Status ProblemError(int64_t p) const;
  // The call's status: that of the first failing problem.
  absl::Status FirstError() const;

 private:
  static constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

  UnitRunner Runner(const Unit& unit) const {
    return UnitRunner(kernels_, problems_[unit.problem],
                      plan_.infos[unit.problem], unit);
  }
  float* ChunkState(const Unit& unit, int64_t slot) const {
    return partial_.get() + unit.partial +
           (slot - unit.chunks_begin) * StateFloatsOf(plan_, unit);
  }
  std::atomic<int64_t>& FirstFailed(int64_t u) {
    return first_failed_[plan_.units[u].problem];
  }
  const std::atomic<int64_t>& FirstFailed(int64_t u) const {
    return first_failed_[plan_.units[u].problem];
  }
  bool Failed(int64_t u) const {
    return u > FirstFailed(u).load(std::memory_order_relaxed);
  }
  void RecordFailure(int64_t u) {
    std::atomic<int64_t>& first = FirstFailed(u);
    int64_t current = first.load(std::memory_order_relaxed);
    while (u < current && !first.compare_exchange_weak(
                              current, u, std::memory_order_relaxed)) {
    }
  }
  // The state of chunk_list[slot] for split unit u, computed by u alone.
  bool OwnChunkState(int64_t u, int64_t slot);
  void RunShared(const cpu::SharedChunk& chunk);

  const KernelTable& kernels_;
  const absl::Span<const AttentionProblem> problems_;
  const DensePlan& plan_;
  std::atomic<int64_t>* const shared_computations_;
  const std::unique_ptr<float[]> partial_;
  std::vector<absl::Status> slot_errors_;  // split units, per chunk slot
  std::vector<absl::Status> unit_errors_;  // whole units; split units' merges
  // Per problem: its lowest failed unit, or kNone.
  std::vector<std::atomic<int64_t>> first_failed_;
};

bool DenseRun::OwnChunkState(int64_t u, int64_t slot) {
  const Unit& unit = plan_.units[u];
  absl::Status status = Runner(unit).ComputeChunkStates(
      &plan_.chunk_list[slot], 1, ChunkState(unit, slot));
  if (status.ok()) return true;
  slot_errors_[slot] = std::move(status);
  RecordFailure(u);
  return false;
}

void DenseRun::RunShared(const cpu::SharedChunk& chunk) {
  if (cpu::ComputeSharedChunk(kernels_, problems_, plan_.infos, plan_.units,
                              chunk, partial_.get())
          .ok()) {
    shared_computations_->fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // Each member recomputes alone and reports its own error.
  for (const cpu::SharedChunkMember& member : chunk.members) {
    OwnChunkState(member.unit, member.slot);
  }
}

void DenseRun::RunItem(int64_t i) {
  const Item& item = plan_.items[i];
  if (item.shared >= 0) return RunShared(plan_.shared[item.shared]);
  if (Failed(item.unit)) return;
  const int n = static_cast<int>(item.unit_end - item.unit);
  const bool split = plan_.units[item.unit].split;
  // Every unit of the group has the item's chunks this far into its own.
  const int64_t offset =
      item.chunks_begin - plan_.units[item.unit].chunks_begin;
  const int64_t count = item.chunks_end - item.chunks_begin;
  std::optional<UnitRunner> runners[cpu::kMaxInterleavedUnits];
  UnitRunner* pointers[cpu::kMaxInterleavedUnits];
  float* states[cpu::kMaxInterleavedUnits];
  absl::Status statuses[cpu::kMaxInterleavedUnits];
  for (int k = 0; k < n; ++k) {
    const Unit& unit = plan_.units[item.unit + k];
    runners[k].emplace(kernels_, problems_[unit.problem],
                       plan_.infos[unit.problem], unit, k);
    pointers[k] = &*runners[k];
    if (split) states[k] = ChunkState(unit, unit.chunks_begin + offset);
  }
  UnitRunner::RunInterleaved(absl::MakeConstSpan(pointers, n),
                             plan_.chunk_list.data() + item.chunks_begin, count,
                             split ? states : nullptr, statuses);
  for (int k = 0; k < n; ++k) {
    if (statuses[k].ok()) continue;
    const int64_t u = item.unit + k;
    if (!split) {
      unit_errors_[u] = std::move(statuses[k]);
      RecordFailure(u);
      continue;
    }
    // Rare: chunk by chunk again, to pin down the first failing one.
    const int64_t begin = plan_.units[u].chunks_begin + offset;
    for (int64_t slot = begin; slot < begin + count; ++slot) {
      if (!OwnChunkState(u, slot)) break;
    }
  }
}

void DenseRun::MergeUnit(int64_t u) {
  if (u >= FirstFailed(u).load(std::memory_order_relaxed)) return;
  const Unit& unit = plan_.units[u];
  absl::Status status = Runner(unit).MergeAndFinish(
      unit.chunks_end - unit.chunks_begin, partial_.get() + unit.partial);
  if (!status.ok()) {
    unit_errors_[u] = std::move(status);
    RecordFailure(u);
  }
}

absl::Status DenseRun::ProblemError(int64_t p) const {
  const int64_t failed = first_failed_[p].load();
  if (failed == kNone) return absl::OkStatus();
  const Unit& unit = plan_.units[failed];
  if (unit.split) {
    for (int64_t slot = unit.chunks_begin; slot < unit.chunks_end; ++slot) {
      if (!slot_errors_[slot].ok()) return slot_errors_[slot];
    }
  }
  return unit_errors_[failed];
}

absl::Status DenseRun::FirstError() const {
  for (size_t p = 0; p < first_failed_.size(); ++p) {
    if (first_failed_[p].load() != kNone) return ProblemError(p);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CpuBackend::AttendDense(
    absl::Span<const AttentionProblem> problems,
    absl::Span<const int64_t> names, bool share_chunks,
    absl::Span<absl::Status> each) {
  DensePlan plan;
  PlanUnits(problems, names, &plan);
  PlanSharedChunks(problems, share_chunks, &plan);
  PlanGroups(problems, &plan);
  // Too few groups to occupy the threads: spread long groups' chunks over
  // several items. Whether and how units are grouped or split never
  // changes results.
  int64_t splittable_chunks = 0;
  int64_t u = 0;
  for (const int64_t end : plan.group_ends) {
    const Unit& first = plan.units[u];
    if (problems[first.problem].weights == nullptr) {
      splittable_chunks += first.chunks_end - first.chunks_begin;
    }
    u = end;
  }
  plan.inline_run = plan.work < kInlineWorkLimit;
  const int64_t chunks_per_piece =
      plan.inline_run
          ? kNoSplit
          : ChunksPerPiece(static_cast<int64_t>(plan.group_ends.size()),
                           splittable_chunks, pool_.num_threads());
  PlanItems(problems, chunks_per_piece, &plan);

  auto parallel_for = [&](int64_t n, const std::function<void(int64_t)>& fn) {
    if (plan.inline_run) {
      for (int64_t i = 0; i < n; ++i) fn(i);
    } else {
      pool_.ParallelFor(n, fn);
    }
  };
  DenseRun run(*kernels_, problems, plan, &shared_chunk_computations_);
  // Many items (a batch of short decode steps has one per step and KV
  // head) run as a few tasks of consecutive items each: a task claimed
  // from the pool costs a shared counter's cache line moving between
  // threads, more than a short item's attention.
  const int64_t num_items = static_cast<int64_t>(plan.items.size());
  const int64_t num_tasks =
      std::min(num_items, int64_t{kTasksPerThread} * pool_.num_threads());
  parallel_for(num_tasks, [&run, num_items, num_tasks](int64_t task) {
    const int64_t end = num_items * (task + 1) / num_tasks;
    for (int64_t i = num_items * task / num_tasks; i < end; ++i) {
      run.RunItem(i);
    }
  });
  std::vector<int64_t> split_units;
  for (size_t u = 0; u < plan.units.size(); ++u) {
    if (plan.units[u].split) split_units.push_back(static_cast<int64_t>(u));
  }
  parallel_for(static_cast<int64_t>(split_units.size()),
               [&](int64_t k) { run.MergeUnit(split_units[k]); });
  for (size_t p = 0; p < each.size(); ++p) each[p] = run.ProblemError(p);
  return run.FirstError();
}

}  // namespace attention
