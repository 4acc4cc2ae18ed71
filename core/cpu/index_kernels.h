// Index scoring kernels of top-k sparse layers (attention_problem.h's
// TopKSpec): the score of index key k_s for one query is
//   sum_j w[j] * f(q[j] . k_s),   j = 0 .. heads - 1.
// One kernel per instruction set (scalar, AVX2, AVX-512), picked at run
// time with the dense kernels' ISA (cpu_features.h). They compute the same
// canonical arithmetic, so every ISA gives the same bits:
//   * a dot product keeps 16 lanes; lane l accumulates, for d = l, l + 16,
//     ... < dim in increasing d, the rounded product q[d] * k[d] with a
//     separate add (never a fused multiply-add); the lanes are then reduced
//     pairwise, lanes[l] += lanes[l + w] for w = 8, 4, 2, 1, and lane 0 is
//     the dot;
//   * f is the identity or ReLU (max(x, 0) keeping -0, NaN and -inf as they
//     are: a dot that overflowed float32 leaves the score not finite, which
//     fails the call, instead of vanishing into a 0);
//   * the score starts at 0 and adds the rounded w[j] * f(dot_j) for
//     j = 0, 1, ... in order.
// A key's score depends on its key and the query alone, so it is the same
// however the keys are cut into runs, pieces or threads.
#ifndef ATTENTION_CORE_CPU_INDEX_KERNELS_H_
#define ATTENTION_CORE_CPU_INDEX_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "core/cpu/cpu_features.h"
#include "core/dtype.h"
#include "core/session_spec.h"

namespace attention::cpu {

// Lanes of the canonical index dot product.
inline constexpr int kIndexLanes = 16;

// Index dims rounded up to whole kIndexLanes blocks. Out of line: this
// header is included by files built for other instruction sets, which must
// define no symbol outside their own namespace (see core/cpu/CMakeLists.txt).
int IndexDimPadded(int dim);

// The query side of one row's scoring: `heads` index queries of `dim`
// floats, each padded with zeros to IndexDimPadded(dim) (q[j] starts at
// q + j * IndexDimPadded(dim)), and their weights w[heads].
struct IndexQuery {
  const float* q = nullptr;
  const float* w = nullptr;
  int heads = 0;
  int dim = 0;
  IndexScore f = IndexScore::kIdentity;
};

// Writes scores[s] for the `n` index keys at `keys`: rows of query.dim
// elements of `key_type`, contiguous. Thread-compatible (no shared state).
using IndexScoresFn = void (*)(const IndexQuery& query, DType key_type,
                               const std::byte* keys, int64_t n, float* scores);

// The kernel of `isa`. REQUIRES: CpuIsaSupported(isa).
IndexScoresFn IndexScoresFor(CpuIsa isa);

// Per-ISA kernels (index_kernels_<isa>.cc); nullptr when not built.
IndexScoresFn ScalarIndexScores();
IndexScoresFn Avx2IndexScores();
IndexScoresFn Avx512IndexScores();

}  // namespace attention::cpu

#endif  // ATTENTION_CORE_CPU_INDEX_KERNELS_H_
