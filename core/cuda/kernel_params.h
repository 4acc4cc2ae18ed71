// Plain structs shared by the CUDA backend's host code and its kernels: the
// per-problem descriptor, the work items of one attention launch, and the
// error record the kernels fill. Everything here is trivially copyable and
// uploaded verbatim, so every pointer in it is a DEVICE address.
#ifndef ATTENTION_CORE_CUDA_KERNEL_PARAMS_H_
#define ATTENTION_CORE_CUDA_KERNEL_PARAMS_H_

#include <cstdint>

#include "core/visibility.h"
#include "core/work_plan.h"

#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__
#else
#define ATTN_HOST_DEVICE
#endif

namespace attention {
namespace cuda {

// Element types, numerically equal to attention::DType.
inline constexpr int32_t kF32 = 1;
inline constexpr int32_t kF16 = 2;
inline constexpr int32_t kBF16 = 3;

// Keys per online-softmax tile and tiles per split chunk, as ints for the
// kernels (core/work_plan.h).
inline constexpr int kTileKeys = static_cast<int>(kKeysPerTile);
inline constexpr int kChunkTiles = static_cast<int>(kTilesPerChunk);

// Tensor-core path limits: head_dim and value_dim up to kMmaMaxDim, both
// multiples of 8 (16-byte rows), 16-bit KV (kMmaWideMaxDim in
// attention_kernels.h for the wide kernel).
inline constexpr int kMmaMaxDim = 128;
// Rows (query token x query head of one GQA group) per warp on the
// tensor-core path: one m16 MMA tile.
inline constexpr int kMmaWarpRows = 16;

// Most rows one SIMT (fp32 / large-dim) block serves.
inline constexpr int kSimtMaxRows = 16;

// One attention problem as the kernels see it. Row r of KV head g of a
// problem is query token r / group_size and query head
// g * group_size + r % group_size ("token-major" rows).
struct ProblemParams {
  // Queries, prepared on the device from the raw upload.
  const void* q_raw = nullptr;  // [T][H][head_dim] in q_dtype
  int32_t q_dtype = kF32;
  float* q_f32 = nullptr;    // [T][H][head_dim] (SIMT path, weights)
  uint16_t* q_hi = nullptr;  // [T][H][q_stride] KV dtype (MMA path)
  uint16_t* q_lo = nullptr;  // residual q - q_hi, when split_q
  // [T][H] (MMA path): q_hi/q_lo hold the row times 2^-q_exponent; the
  // logit is (dot * 2^q_exponent) * scale.
  int32_t* q_exponent = nullptr;
  int32_t q_stride = 0;  // head_dim rounded up to 16
  int32_t split_q = 0;   // q is not exact in the KV dtype
  int32_t use_mma = 0;

  // Keys and values: one device pointer per logical block (null = dropped).
  const char* const* k_blocks = nullptr;
  const char* const* v_blocks = nullptr;
  int64_t length = 0;
  int64_t tokens_per_block = 0;
  int64_t k_token_stride = 0;  // elements
  int64_t k_head_stride = 0;
  int64_t v_token_stride = 0;
  int64_t v_head_stride = 0;
  int32_t kv_dtype = kF32;

  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t group_size = 0;
  int32_t head_dim = 0;
  int32_t value_dim = 0;
  int64_t num_queries = 0;

  // Mask (attention_problem.h MaskSpec).
  int32_t causal = 1;
  int32_t window = 0;
  int32_t num_sink_tokens = 0;
  int64_t query_start = 0;

  const float* sink_logits = nullptr;  // [H] or null
  float scale = 1.0f;
  const float* bias = nullptr;  // [T][T_k] or [H][T][T_k], or null
  int32_t bias_per_head = 0;
  int32_t empty_rows_zero = 0;

  // Device outputs.
  float* output = nullptr;        // [T][H][value_dim]
  float* lse = nullptr;           // [T][H] or null
  float* row_max = nullptr;       // [T][H] or null (needed by weights)
  float* row_sum = nullptr;       // [T][H] or null
  float* weights = nullptr;       // [H][T][T_k] or null
  int32_t problem_index = 0;      // index in the caller's span, for errors
  int32_t error_unit_tokens = 1;  // ErrorUnitTokens(group_size)
};

// A block of rows of one (problem, KV head). chunk < 0: the block walks every
// chunk and merges them itself (full mode); chunk >= 0: it computes that one
// chunk's state into `states + state_offset` for MergeChunksKernel (split
// mode). A state is m[row_count], l[row_count], acc[row_count][value_dim].
struct WorkItem {
  int32_t problem = 0;
  int32_t kv_head = 0;
  int32_t row_begin = 0;
  int32_t row_count = 0;
  int32_t chunk = -1;
  int32_t reserved = 0;
  int64_t state_offset = 0;  // floats
};

// Merges `num_slots` consecutive chunk states (increasing chunk order) of
// one row block, starting from the sink state, and writes the outputs.
struct MergeItem {
  int32_t problem = 0;
  int32_t kv_head = 0;
  int32_t row_begin = 0;
  int32_t row_count = 0;
  int32_t num_slots = 0;
  int32_t reserved = 0;
  int64_t first_state_offset = 0;  // floats; slots are contiguous
};

// Errors found on the device, as the smallest key of each kind; kNoError
// when none. A key is problem << 40 | ErrorRank(...): rows in the error
// order of attention_problem.h, so the smallest key is the first error.
inline constexpr unsigned long long kNoError = ~0ull;
struct ErrorRecord {
  unsigned long long overflow = kNoError;   // a visible logit not finite
  unsigned long long empty_row = kNoError;  // no visible key, no sink
  // An output not finite: the weighted sum of values overflowed float32
  // before the division by the probabilities' sum.
  unsigned long long value_overflow = kNoError;
};

// Position of (token, head) in the error order inside its problem: units
// of `unit_tokens` tokens x the `group` heads of one KV head, by token block
// then KV head, rows (token, head) in order inside a unit. Below 2^40 for
// the problems AttendPlan accepts (tokens < 2^24, heads < 2^16).
ATTN_HOST_DEVICE inline int64_t ErrorRank(int64_t token, int64_t head,
                                          int64_t unit_tokens, int64_t group,
                                          int64_t num_kv_heads) {
  const int64_t block = token / unit_tokens;
  const int64_t kv_head = head / group;
  return ((block * num_kv_heads + kv_head) * unit_tokens +
          token % unit_tokens) *
             group +
         head % group;
}

ATTN_HOST_DEVICE inline unsigned long long ErrorKey(const ProblemParams& p,
                                                    int64_t token,
                                                    int64_t head) {
  return (static_cast<unsigned long long>(p.problem_index) << 40) |
         static_cast<unsigned long long>(ErrorRank(
             token, head, p.error_unit_tokens, p.group_size, p.num_kv_heads));
}

// The keys visible to at least one of rows [row_begin, row_begin +
// row_count) of a problem (core/work_plan.h RowBlockKeys).
ATTN_HOST_DEVICE inline KeyRanges RowKeys(const ProblemParams& p,
                                          int64_t row_begin,
                                          int64_t row_count) {
  const int64_t first_token = row_begin / p.group_size;
  const int64_t last_token = (row_begin + row_count - 1) / p.group_size;
  return RowBlockKeys(p.causal != 0, p.window, p.num_sink_tokens, p.length,
                      p.query_start + first_token, p.query_start + last_token);
}

// The key tiles those rows may see, in increasing order (TilesOf: at most
// two ranges, the sink tokens', then the window's). Tiles outside them are
// fully masked for every row of the block, so skipping them changes no
// row's state.
ATTN_HOST_DEVICE inline TileRanges KeyTiles(const ProblemParams& p,
                                            int64_t row_begin,
                                            int64_t row_count) {
  return TilesOf(RowKeys(p, row_begin, row_count));
}

}  // namespace cuda
}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_KERNEL_PARAMS_H_
