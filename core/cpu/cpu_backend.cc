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
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cpu/attention_unit.h"
#include "core/cpu/topk_attention.h"
#include "core/cpu/kernels.h"
#include "core/cpu/shared_chunks.h"
#include "core/cpu/work_split.h"
#include "core/dtype.h"
#include "core/status_macros.h"

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

// One parallel task: chunk_list[chunks_begin, chunks_end) of a unit, or
// (shared >= 0) one shared chunk for all its member units.
struct Item {
  int64_t unit;
  int64_t chunks_begin;
  int64_t chunks_end;
  int64_t shared = -1;
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
    if (block >= static_cast<int64_t>(write.blocks.size()) ||
        write.blocks[block] == nullptr) {
      return absl::InternalError(
          absl::StrCat("KV block ", block, " for positions from ",
                       std::max(write.start, block * tokens_per_block),
                       " is missing; this is a bug in the block pool"));
    }
  }
  // Each task converts a run of tokens into their blocks.
  constexpr int64_t kTokensPerTask = 64;
  const int64_t num_tasks = (num_tokens + kTokensPerTask - 1) / kTokensPerTask;
  pool_.ParallelFor(num_tasks, [&](int64_t task) {
    const int64_t end = std::min(num_tokens, (task + 1) * kTokensPerTask);
    for (int64_t t = task * kTokensPerTask; t < end; ++t) {
      const int64_t pos = write.start + t;
      std::byte* block = write.blocks[pos / tokens_per_block];
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
  });
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
  std::vector<AttentionProblem> dense;
  dense.reserve(problems.size());
  for (const AttentionProblem& problem : problems) {
    if (problem.topk == nullptr) {
      dense.push_back(problem);
      continue;
    }
    ATTN_RETURN_IF_ERROR(cpu::AttendTopK(
        problem, pool_, [this](absl::Span<const AttentionProblem> rows) {
          return AttendDense(rows);
        }));
  }
  if (dense.size() == problems.size()) return AttendDense(problems);
  return dense.empty() ? absl::OkStatus() : AttendDense(dense);
}

absl::Status CpuBackend::AttendDense(
    absl::Span<const AttentionProblem> problems) {
  const KernelTable& kernels = *kernels_;
  std::vector<ProblemInfo> infos;
  infos.reserve(problems.size());
  std::vector<Unit> units;
  std::vector<int64_t> chunk_list;
  int64_t work = 0;  // visible keys x query rows
  for (size_t p = 0; p < problems.size(); ++p) {
    const AttentionProblem& problem = problems[p];
    infos.push_back(cpu::DescribeProblem(problem));
    const ProblemInfo& info = infos.back();
    for (int64_t r = 0; r < info.rows; r += info.rows_per_unit) {
      for (int g = 0; g < info.kv_heads; ++g) {
        Unit unit;
        unit.problem = static_cast<int>(p);
        unit.kv_head = g;
        unit.row_begin = r;
        unit.row_end = std::min(info.rows, r + info.rows_per_unit);
        unit.keys =
            cpu::UnionRange(problem.mask, info.length,
                            problem.mask.query_start + unit.row_begin,
                            problem.mask.query_start + unit.row_end - 1);
        unit.chunks_begin = static_cast<int64_t>(chunk_list.size());
        cpu::AppendChunks(unit.keys, &chunk_list);
        for (int k = 0; k < unit.keys.count; ++k) {
          work += (unit.keys.end[k] - unit.keys.begin[k]) *
                  (unit.row_end - unit.row_begin) * info.group;
        }
        unit.chunks_end = static_cast<int64_t>(chunk_list.size());
        units.push_back(unit);
      }
    }
  }

  // Too few units to occupy the threads: spread long units' chunks over
  // several items. Whether and how units are split never changes results.
  int64_t splittable_chunks = 0;
  for (const Unit& unit : units) {
    if (problems[unit.problem].weights != nullptr) continue;
    splittable_chunks += unit.chunks_end - unit.chunks_begin;
  }
  const bool inline_run = work < kInlineWorkLimit;
  const int64_t chunks_per_piece =
      inline_run ? kNoSplit
                 : ChunksPerPiece(static_cast<int64_t>(units.size()),
                                  splittable_chunks, pool_.num_threads());
  auto parallel_for = [&](int64_t n, const std::function<void(int64_t)>& fn) {
    if (inline_run) {
      for (int64_t i = 0; i < n; ++i) fn(i);
    } else {
      pool_.ParallelFor(n, fn);
    }
  };
  // Decode steps of a batch that read the same KV blocks (forks of one
  // prompt) compute each shared chunk once for all of them.
  std::vector<cpu::SharedChunk> shared;
  std::vector<char> slot_shared(chunk_list.size(), 0);
  if (problems.size() > 1) {
    shared = cpu::FindSharedChunks(problems, infos, units, chunk_list);
    for (const cpu::SharedChunk& chunk : shared) {
      for (const cpu::SharedChunkMember& member : chunk.members) {
        slot_shared[member.slot] = 1;
      }
    }
  }

  // Shared chunks first: each is a long item, better started early.
  std::vector<Item> items;
  for (size_t s = 0; s < shared.size(); ++s) {
    items.push_back(Item{-1, 0, 0, static_cast<int64_t>(s)});
  }
  int64_t partial_floats = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    Unit& unit = units[u];
    const ProblemInfo& info = infos[unit.problem];
    const int64_t count = unit.chunks_end - unit.chunks_begin;
    const bool has_shared =
        std::any_of(slot_shared.begin() + unit.chunks_begin,
                    slot_shared.begin() + unit.chunks_end,
                    [](char is_shared) { return is_shared != 0; });
    unit.items_begin = static_cast<int64_t>(items.size());
    if (has_shared || (count > chunks_per_piece &&
                       problems[unit.problem].weights == nullptr)) {
      unit.split = true;
      unit.partial = partial_floats;
      partial_floats +=
          count * cpu::StateFloats((unit.row_end - unit.row_begin) * info.group,
                                   info.value_dim_padded);
      // Its own chunks in pieces of at most chunks_per_piece, skipping the
      // shared ones (their items above fill those states).
      int64_t c = unit.chunks_begin;
      while (c < unit.chunks_end) {
        if (slot_shared[c]) {
          ++c;
          continue;
        }
        int64_t end = c;
        while (end < unit.chunks_end && !slot_shared[end] &&
               end - c < chunks_per_piece) {
          ++end;
        }
        items.push_back(Item{static_cast<int64_t>(u), c, end});
        c = end;
      }
    } else {
      items.push_back(
          Item{static_cast<int64_t>(u), unit.chunks_begin, unit.chunks_end});
    }
    unit.items_end = static_cast<int64_t>(items.size());
  }
  std::unique_ptr<float[]> partial(
      partial_floats > 0 ? new float[partial_floats] : nullptr);
  auto chunk_state = [&](const Unit& unit, int64_t slot) {
    const ProblemInfo& info = infos[unit.problem];
    return partial.get() + unit.partial +
           (slot - unit.chunks_begin) *
               cpu::StateFloats((unit.row_end - unit.row_begin) * info.group,
                                info.value_dim_padded);
  };

  // Items run in any order, but the reported error is always the first one
  // of the lowest failing unit (in its own processing order: chunk order
  // for split units), so it never depends on scheduling, thread count,
  // splitting or sharing. Work of units above a failed one is skipped.
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  std::atomic<int64_t> first_failed{kNone};
  auto record_failure = [&first_failed](int64_t unit) {
    int64_t current = first_failed.load(std::memory_order_relaxed);
    while (unit < current && !first_failed.compare_exchange_weak(
                                 current, unit, std::memory_order_relaxed)) {
    }
  };
  std::vector<absl::Status> item_errors(items.size());       // unsplit units
  std::vector<absl::Status> slot_errors(chunk_list.size());  // split units
  // The state of chunk_list[slot] for split unit u, computed by u alone.
  auto own_chunk_state = [&](int64_t u, int64_t slot) {
    const Unit& unit = units[u];
    UnitRunner runner(kernels, problems[unit.problem], infos[unit.problem],
                      unit);
    absl::Status status = runner.ComputeChunkStates(&chunk_list[slot], 1,
                                                    chunk_state(unit, slot));
    if (!status.ok()) {
      slot_errors[slot] = std::move(status);
      record_failure(u);
      return false;
    }
    return true;
  };
  parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& item = items[i];
    if (item.shared >= 0) {
      const cpu::SharedChunk& chunk = shared[item.shared];
      if (cpu::ComputeSharedChunk(kernels, problems, infos, units, chunk,
                                  partial.get())
              .ok()) {
        shared_chunk_computations_.fetch_add(1, std::memory_order_relaxed);
      } else {
        // Each member recomputes alone and reports its own error.
        for (const cpu::SharedChunkMember& member : chunk.members) {
          own_chunk_state(member.unit, member.slot);
        }
      }
      return;
    }
    if (item.unit > first_failed.load(std::memory_order_relaxed)) return;
    const Unit& unit = units[item.unit];
    UnitRunner runner(kernels, problems[unit.problem], infos[unit.problem],
                      unit);
    if (unit.split) {
      if (!runner
               .ComputeChunkStates(chunk_list.data() + item.chunks_begin,
                                   item.chunks_end - item.chunks_begin,
                                   chunk_state(unit, item.chunks_begin))
               .ok()) {
        // Rare: chunk by chunk again, to pin down the first failing one.
        for (int64_t slot = item.chunks_begin; slot < item.chunks_end; ++slot) {
          if (!own_chunk_state(item.unit, slot)) return;
        }
      }
      return;
    }
    absl::Status status =
        runner.RunDirect(chunk_list.data() + item.chunks_begin,
                         item.chunks_end - item.chunks_begin);
    if (!status.ok()) {
      item_errors[i] = std::move(status);
      record_failure(item.unit);
    }
  });

  // Merge the chunk states of split units, in increasing chunk order.
  std::vector<int64_t> split_units;
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].split) split_units.push_back(static_cast<int64_t>(u));
  }
  std::vector<absl::Status> unit_errors(units.size());
  parallel_for(static_cast<int64_t>(split_units.size()), [&](int64_t k) {
    const int64_t u = split_units[k];
    if (u >= first_failed.load(std::memory_order_relaxed)) return;
    const Unit& unit = units[u];
    UnitRunner runner(kernels, problems[unit.problem], infos[unit.problem],
                      unit);
    absl::Status status = runner.MergeAndFinish(
        unit.chunks_end - unit.chunks_begin, partial.get() + unit.partial);
    if (!status.ok()) {
      unit_errors[u] = std::move(status);
      record_failure(u);
    }
  });

  const int64_t failed = first_failed.load();
  if (failed == kNone) return absl::OkStatus();
  const Unit& unit = units[failed];
  if (unit.split) {
    for (int64_t slot = unit.chunks_begin; slot < unit.chunks_end; ++slot) {
      if (!slot_errors[slot].ok()) return slot_errors[slot];
    }
  } else {
    for (int64_t i = unit.items_begin; i < unit.items_end; ++i) {
      if (!item_errors[i].ok()) return item_errors[i];
    }
  }
  return unit_errors[failed];
}

}  // namespace attention
