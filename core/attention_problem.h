// AttentionProblem: one fully validated attention computation handed to a
// backend, and the canonical reduction order every backend must follow.
//
// Reduction order (what makes results bitwise reproducible). For each query
// row and query head:
//   * key positions are split into chunks of kKeysPerSplit absolute
//     positions [c*kKeysPerSplit, (c+1)*kKeysPerSplit), and each chunk into
//     tiles of kKeysPerTile absolute positions;
//   * a chunk's (max, denominator, accumulator) state starts empty and is
//     updated tile by tile, keys in increasing position inside a tile, with
//     the online-softmax rescaling of the seeds' tiled_attention;
//   * the row state starts as the learned sink (max = sink logit,
//     denominator = 1, accumulator = 0) or empty, and chunk states are merged
//     into it in increasing chunk order.
// Positions are absolute, so a token's output does not depend on how the
// queries were chunked or batched, nor on the number of threads.
//
// Logits and overflow. The logit of query row i, head h and key j is
// computed as (q_i,h . k_j in float32) * scale, plus bias[h][i][j] when
// there is a bias. A visible logit overflows when that value is not finite,
// including when q.k alone exceeds the float32 range although q.k * scale
// would not (backends that scale q before the dot product must detect
// that too), and when adding the bias overflows. Every backend reports
// exactly these cases, as INVALID_ARGUMENT.
//
// Error order. Only one error is reported per call: that of the first
// failing error unit. A problem's rows are taken in units of
// ErrorUnitTokens(group) consecutive query tokens times the query heads of
// one KV head, ordered by problem, then token block, then KV head. Inside
// the failing unit an overflowing logit is reported before an empty row
// (policy kError), and among rows of the same kind the first in (token,
// head) order. (The CPU backend reports the overflow of the earliest key
// tile first, which names the same row unless one unit overflows in
// several rows.)
//
// Top-k problems (AttentionProblem::topk) first select, per query row, the
// keys it attends (TopKSpec); the row then attends over exactly those keys
// as a dense non-causal row over a contiguous key sequence of them in
// increasing position: chunks and tiles count selected keys, not
// positions. The selection depends only on the row's position and the
// stored index keys, so this too is the same however rows are batched.
#ifndef ATTENTION_CORE_ATTENTION_PROBLEM_H_
#define ATTENTION_CORE_ATTENTION_PROBLEM_H_

#include <cstdint>

#include "absl/types/span.h"
#include "core/call_control.h"
#include "core/kv_view.h"
#include "core/session_spec.h"
#include "core/tensor.h"
#include "core/work_plan.h"

namespace attention {

// kKeysPerTile and kKeysPerSplit, and how both backends cut a call into
// chunks and work items in this order, are in core/work_plan.h.

// Query tokens per error unit (see "Error order") for a GQA group size
// (query heads per KV head).
inline constexpr int64_t ErrorUnitTokens(int64_t group) {
  const int64_t tokens = 256 / group;
  return tokens < 1 ? 1 : (tokens > 16 ? 16 : tokens);
}

enum class EmptyRowPolicy {
  kError,  // a row with no visible key and no sink is INVALID_ARGUMENT
  kZero,   // such a row yields zero output/weights and lse = -inf
};

// Which keys a query sees. Query i of a problem sits at absolute position
// p = query_start + i. Key j is visible iff
//   (!causal || j <= p) && (window == 0 || p - j < window ||
//                           j < num_sink_tokens).
// REQUIRES (checked by the engine): window > 0 and query_start > 0 only with
// causal; num_sink_tokens > 0 only with window > 0.
struct MaskSpec {
  bool causal = true;
  int32_t window = 0;
  int32_t num_sink_tokens = 0;
  int64_t query_start = 0;
};

// The selection of a top-k problem. For query row t at position p, key s
// (visible under the mask) scores
//   score(s) = sum_j w[t][j] * f(dot(q_index[t][j], k_index[s]))
// in float32: the dot over index_dim in 16 lanes, lane l adding the rounded
// products of d = l (mod 16) in increasing d from +0 (a separate multiply
// and add, never fused), the lanes then summed pairwise as kernels.h's
// canonical dot; f the layer's IndexScore; the sum over j adding the
// rounded w[t][j] * f(dot) in increasing j from +0 (cpu/index_kernels.h
// has the exact order). The row keeps
// the `topk` visible keys of highest score, ties broken by the lower
// position (all of them when at most `topk` are visible).
// REQUIRES: kv.index_dim == index_q.dim(2) > 0, finite inputs.
struct TopKSpec {
  int32_t topk = 0;
  IndexScore score = IndexScore::kIdentity;
  TensorView index_q;        // [T, index_heads, index_dim], any dtype
  TensorView index_weights;  // [T, index_heads], any dtype
  // Optional [T, topk] output: each row's selected positions, increasing,
  // padded with -1.
  int64_t* selected = nullptr;
};

// What a problem made from one row of another problem and a selection of
// its keys (a top-k row's attention over its shortlist) stands for in that
// problem: its error messages name these, which the caller knows, instead
// of its own indices.
struct ProblemOrigin {
  // The other problem's index in its batch, or -1 when that batch held it
  // alone (its messages then name no problem).
  int64_t problem = 0;
  int64_t row = 0;                // the row's index in it
  int64_t position = 0;           // and its position
  const int64_t* keys = nullptr;  // [kv.length]: each key's position there
};

struct AttentionProblem {
  // Queries [T, H, head_dim], any dtype (converted to float32 once).
  TensorView q;
  // Keys and values at positions [0, kv.length).
  KvView kv;
  MaskSpec mask;
  // Learned sink logit per query head: empty or exactly H finite values.
  absl::Span<const float> sink_logits;
  // Logit scale (finite, > 0).
  float scale = 1.0f;
  // Optional additive bias [T, T_k] or [H, T, T_k] (finite or -inf), where
  // T_k = kv.length. nullptr when absent. Only stateless calls use it.
  const TensorView* bias = nullptr;
  EmptyRowPolicy empty_row_policy = EmptyRowPolicy::kError;
  // Optional: the backend asks it between KV chunks and stops the problem
  // with its status (CANCELLED, DEADLINE_EXCEEDED) once the caller no
  // longer wants the result. Outputs are then unspecified.
  const CallControl* control = nullptr;
  // Optional top-k selection (sessions' top-k layers; causal masks only,
  // no bias, no weights). nullptr = dense.
  const TopKSpec* topk = nullptr;
  // Optional, for error messages only (see ProblemOrigin); one query row.
  const ProblemOrigin* origin = nullptr;

  // Caller-owned float32 outputs, written by the backend:
  float* output = nullptr;   // [T, H, value_dim], required
  float* lse = nullptr;      // [T, H], optional
  float* weights = nullptr;  // [H, T, T_k], optional
};

}  // namespace attention

#endif  // ATTENTION_CORE_ATTENTION_PROBLEM_H_
