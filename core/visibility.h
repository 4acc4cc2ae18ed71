// The visibility rule of attention_problem.h in one place, for host and
// device code alike (no dependencies beyond <cstdint>; usable from .cu
// files): which keys a query at absolute position p sees, as a predicate
// and as the interval form the work planners cut into chunks.
//
//   key j is visible to the query at p  iff  j < length
//     && (!causal || j <= p)
//     && (window == 0 || p - j < window || j < num_sink_tokens).
//
// Every user derives from these functions, so the rule cannot drift
// between them: the work plan both backends cut calls with
// (core/work_plan.h RowBlockKeys: CPU units, top-k selection, CUDA tile
// ranges), the CPU rows' tile masks (core/cpu/attention_unit.cc
// VisibleRange), the CUDA kernels' per-key test (KeyVisible), and the KV
// cache's dropping of unreachable blocks (core/layer_kv_cache.cc).
#ifndef ATTENTION_CORE_VISIBILITY_H_
#define ATTENTION_CORE_VISIBILITY_H_

#include <cstdint>

#if defined(__CUDACC__)
#define ATTN_VISIBILITY_FN __host__ __device__ inline
#else
#define ATTN_VISIBILITY_FN inline
#endif

namespace attention {

// The keys a query at absolute position p sees: j <= hi && (j >= lo ||
// j < sinks). hi < 0 means none; sinks <= hi + 1.
struct VisibleKeys {
  int64_t lo = 0;     // first window position (0 without a window)
  int64_t hi = -1;    // last visible position
  int64_t sinks = 0;  // positions [0, sinks) are visible regardless of lo
};

// The interval form of the rule for the query at `p` over keys [0, length).
ATTN_VISIBILITY_FN VisibleKeys VisibleKeysOf(bool causal, int32_t window,
                                             int32_t num_sink_tokens,
                                             int64_t length, int64_t p) {
  VisibleKeys keys;
  keys.hi = causal ? (p < length - 1 ? p : length - 1) : length - 1;
  if (window > 0) {
    const int64_t lo = p - window + 1;
    keys.lo = lo > 0 ? lo : 0;
    const int64_t sinks = num_sink_tokens;
    keys.sinks = sinks < keys.hi + 1 ? sinks : keys.hi + 1;
    if (keys.sinks < 0) keys.sinks = 0;
  }
  return keys;
}

// The predicate form: key `j` (0 <= j) is visible to the query at `p`.
ATTN_VISIBILITY_FN bool KeyIsVisible(bool causal, int32_t window,
                                     int32_t num_sink_tokens, int64_t length,
                                     int64_t p, int64_t j) {
  if (j >= length) return false;
  if (causal && j > p) return false;
  if (window > 0 && p - j >= window && j >= num_sink_tokens) return false;
  return true;
}

// The first position a query at a position >= `length` of a causal window
// layer can still see, outside its sinks (0 without a window).
ATTN_VISIBILITY_FN int64_t FirstReachablePosition(int32_t window,
                                                  int64_t length) {
  if (window <= 0) return 0;
  const int64_t first = length - window + 1;
  return first > 0 ? first : 0;
}

}  // namespace attention

#undef ATTN_VISIBILITY_FN

#endif  // ATTENTION_CORE_VISIBILITY_H_
