// CUDA attention kernels. See attention_problem.h for the canonical
// reduction order and cuda_backend.h for how the kernels are chosen.
//
// Bitwise reproducibility on the GPU. Every row (query token x query head)
// goes through exactly the same arithmetic whatever block serves it:
//   * one kernel variant per problem, chosen from the problem alone (and
//     the device: a problem the wide tensor-core kernel cannot fit in the
//     device's shared memory runs on SIMT, on that device always);
//   * a logit depends only on its own q row and k row (an MMA output element
//     depends only on its row of A and column of B; SIMT dots are
//     sequential fmaf chains over head_dim);
//   * a row's chunk state walks the chunk's tiles in increasing order and a
//     tile with no key visible to the row leaves the row untouched, so tiles
//     skipped for other rows of the block change nothing;
//   * chunk states merge into the row state in increasing chunk order from
//     the sink state, with the same MergeCoefficients/MergeAcc code whether a
//     block walks every chunk itself (full mode) or one block per chunk
//     writes states that MergeChunksKernel combines (split mode);
//   * all softmax/merge arithmetic uses explicitly rounded intrinsics
//     (__fmul_rn, __fmaf_rn, ...) and the file is compiled with
//     --fmad=false, so no contraction differs between kernels.
// Hence decode (T = 1, split mode) and prefill (full mode) give the same
// bits, and a problem's result does not depend on the rest of the batch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda/attention_kernels.h"
#include "core/visibility.h"

namespace attention {
namespace cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
// bfloat16's largest finite value (bits 0x7f7f).
constexpr float kBFloat16Max = 3.38953139e38f;
constexpr int kSimtDimChunk = 64;
constexpr int kSimtKeyStride = kSimtDimChunk + 1;

__device__ __forceinline__ float NegInf() { return __int_as_float(0xff800000); }

// ---------------------------------------------------------------------------
// Element access.

__device__ __forceinline__ float LoadElement(int32_t dtype, const char* base,
                                             int64_t index) {
  if (dtype == kF32) return reinterpret_cast<const float*>(base)[index];
  const unsigned short bits =
      reinterpret_cast<const unsigned short*>(base)[index];
  if (dtype == kF16) return __half2float(__ushort_as_half(bits));
  return __bfloat162float(__ushort_as_bfloat16(bits));
}

template <int kDType>
__device__ __forceinline__ float LoadAs(const char* base, int64_t index) {
  if constexpr (kDType == kF32) {
    return reinterpret_cast<const float*>(base)[index];
  } else if constexpr (kDType == kF16) {
    return __half2float(
        __ushort_as_half(reinterpret_cast<const unsigned short*>(base)[index]));
  } else {
    return __bfloat162float(__ushort_as_bfloat16(
        reinterpret_cast<const unsigned short*>(base)[index]));
  }
}

// Round to nearest even into a 16-bit type and back.
__device__ __forceinline__ uint16_t ToBits(int32_t dtype, float x) {
  if (dtype == kF16) return __half_as_ushort(__float2half_rn(x));
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float FromBits(int32_t dtype, uint16_t bits) {
  if (dtype == kF16) return __half2float(__ushort_as_half(bits));
  return __bfloat162float(__ushort_as_bfloat16(bits));
}

// ---------------------------------------------------------------------------
// The canonical per-row arithmetic, shared by every kernel.

// Key visibility (attention_problem.h MaskSpec).
__device__ __forceinline__ bool KeyVisible(const ProblemParams& p,
                                           int64_t query_pos, int64_t key) {
  return KeyIsVisible(p.causal != 0, p.window, p.num_sink_tokens, p.length,
                      query_pos, key);
}

// The logit of a visible key from its dot product computed on q scaled by
// 2^-exponent, or -inf when the bias masks it: (dot * 2^exponent) * scale
// (+ bias), the CPU's order (attention_problem.h), so a q.k that overflows
// float32 overflows here too whatever the scale. The power of two is exact
// in the normal range. A non-finite visible logit is recorded as an
// overflow (when `errors` is set) and treated as masked.
__device__ __forceinline__ float FinishLogit(const ProblemParams& p, float dot,
                                             int exponent, int64_t token,
                                             int head, int64_t key,
                                             ErrorRecord* errors) {
  float logit = __fmul_rn(exponent == 0 ? dot : scalbnf(dot, exponent),
                          p.scale);
  if (p.bias != nullptr) {
    const int64_t row =
        p.bias_per_head ? int64_t{head} * p.num_queries + token : token;
    const float bias = p.bias[row * p.length + key];
    if (bias == NegInf()) return NegInf();
    logit = __fadd_rn(logit, bias);
  }
  if (!isfinite(logit)) {
    if (errors != nullptr) {
      atomicMin(&errors->overflow, ErrorKey(p, token, head));
    }
    return NegInf();
  }
  return logit;
}

// Online-softmax rescale factor of a state whose max moves to m_new.
__device__ __forceinline__ float TileAlpha(float m_old, float m_new) {
  return m_old == NegInf() ? 0.0f : expf(__fsub_rn(m_old, m_new));
}

// exp(x) for the probabilities the tensor-core path rounds to 16 bits
// anyway: one MUFU.EX2 instead of expf's accurate sequence. Deterministic,
// and used only inside MmaAttentionKernel, so every mode of that kernel
// computes the same p.
__device__ __forceinline__ float FastExp(float x) {
  return exp2f(__fmul_rn(x, 1.4426950408889634f));
}

struct MergeCoef {
  float a;  // factor of the row state
  float b;  // factor of the chunk state
  float m;
  float l;
};

// Merging chunk state (cm, cl) into row state (rm, rl).
// REQUIRES: cm != -inf (empty chunk states are skipped).
__device__ __forceinline__ MergeCoef MergeCoefficients(float rm, float rl,
                                                       float cm, float cl) {
  MergeCoef c;
  c.m = fmaxf(rm, cm);
  c.a = rm == NegInf() ? 0.0f : expf(__fsub_rn(rm, c.m));
  c.b = expf(__fsub_rn(cm, c.m));
  c.l = __fmaf_rn(c.a, rl, __fmul_rn(c.b, cl));
  return c;
}

__device__ __forceinline__ float MergeAcc(const MergeCoef& c, float row_acc,
                                          float chunk_acc) {
  return __fmaf_rn(c.a, row_acc, __fmul_rn(c.b, chunk_acc));
}

// Output element of a finished row; +0.0f turns a -0 into +0 so that zero
// signs cannot depend on which tiles a block skipped. A value that is not
// finite (the sum of p * v overflowed) is recorded as the row's error.
__device__ __forceinline__ void WriteOutput(const ProblemParams& p,
                                            int64_t token, int head, int col,
                                            float l, float acc,
                                            ErrorRecord* errors) {
  const float value = l == 0.0f ? 0.0f : __fadd_rn(__fdiv_rn(acc, l), 0.0f);
  if (!isfinite(value)) {
    atomicMin(&errors->value_overflow, ErrorKey(p, token, head));
  }
  p.output[(token * p.num_q_heads + head) * p.value_dim + col] = value;
}

__device__ __forceinline__ void WriteRowStats(const ProblemParams& p,
                                              int64_t token, int head, float m,
                                              float l, ErrorRecord* errors) {
  const int64_t index = token * p.num_q_heads + head;
  if (l == 0.0f) {
    if (!p.empty_rows_zero) {
      atomicMin(&errors->empty_row, ErrorKey(p, token, head));
    }
    if (p.lse != nullptr) p.lse[index] = NegInf();
    if (p.row_max != nullptr) {
      p.row_max[index] = 0.0f;
      p.row_sum[index] = 0.0f;
    }
    return;
  }
  if (p.lse != nullptr) p.lse[index] = __fadd_rn(m, logf(l));
  if (p.row_max != nullptr) {
    p.row_max[index] = m;
    p.row_sum[index] = l;
  }
}

// The row state a row starts from: the learned sink or empty.
__device__ __forceinline__ void SinkState(const ProblemParams& p, int head,
                                          float* m, float* l) {
  if (p.sink_logits != nullptr) {
    *m = p.sink_logits[head];
    *l = 1.0f;
  } else {
    *m = NegInf();
    *l = 0.0f;
  }
}

// Largest k with prefix[k] <= x, for 0 <= x < prefix[n].
__device__ __forceinline__ int FindSegment(const int64_t* prefix, int n,
                                           int64_t x) {
  int lo = 0;
  int hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (prefix[mid] <= x) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// ---------------------------------------------------------------------------
// PTX wrappers (sm_80+).

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const unsigned address =
      static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address),
               "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4],
                                           const uint16_t* smem) {
  const unsigned address =
      static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(address)
      : "memory");
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4],
                                                const uint16_t* smem) {
  const unsigned address =
      static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, "
      "[%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(address)
      : "memory");
}

// D += A * B for one m16n8k16 tile, fp32 accumulation.
template <int kDType>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4],
                                         uint32_t b0, uint32_t b1) {
  if constexpr (kDType == kF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t Pack(uint16_t low, uint16_t high) {
  return static_cast<uint32_t>(low) | (static_cast<uint32_t>(high) << 16);
}

__device__ __forceinline__ uint32_t Load32(const uint16_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// ---------------------------------------------------------------------------
// Geometry of a tensor-core kernel by the largest dim it serves: kMmaMaxDim
// (narrow: q fragments in registers, a 3-deep ring) or kMmaWideMaxDim (wide:
// q in shared memory, a 2-deep ring so that 4 warps with split q and
// full-mode accumulators fit in 227 KiB).
template <int kMaxDim>
struct MmaGeometry {
  static constexpr bool kQInSmem = kMaxDim > kMmaMaxDim;
  static constexpr int kStages = kQInSmem ? 2 : 3;  // cp.async ring depth
  static constexpr int kSmemRowHalves = kMaxDim + 8;  // padded: no bank
                                                      // conflicts
  static constexpr int kStageHalves = kTileKeys * kSmemRowHalves;
  static constexpr int kMaxKSteps = kMaxDim / 16;
  static constexpr int kMaxVTiles = kMaxDim / 8;
  static constexpr int kRowAccFloatsPerWarp = kMaxVTiles * 4 * 32;

  // Dynamic shared memory of a block: the K and V rings, the q tiles
  // (q_hi, and q_lo when split) and, in full mode, the row accumulators.
  static constexpr size_t SharedBytes(int warps, bool split_q,
                                      bool full_mode) {
    const size_t ring = size_t{2} * kStages * kStageHalves * 2;
    const size_t q_tile =
        kQInSmem ? size_t{16} * warps * kSmemRowHalves * 2 : 0;
    const size_t acc =
        full_mode ? size_t{4} * warps * kRowAccFloatsPerWarp : 0;
    return ring + (split_q ? 2 : 1) * q_tile + acc;
  }
};
static_assert(kMmaWideMaxDim % 16 == 0 && kMmaMaxDim % 16 == 0,
              "k-steps of 16");

// ---------------------------------------------------------------------------
// Query preparation: one warp per (token, head) row.

__global__ void PrepareQueriesKernel(const ProblemParams* __restrict__ problems,
                                     const int64_t* __restrict__ row_prefix,
                                     int num_problems, int64_t total_rows) {
  const int lane = threadIdx.x & 31;
  const int warps_per_block = blockDim.x >> 5;
  const int64_t first =
      int64_t{blockIdx.x} * warps_per_block + (threadIdx.x >> 5);
  const int64_t step = int64_t{gridDim.x} * warps_per_block;
  for (int64_t row = first; row < total_rows; row += step) {
    const int k = FindSegment(row_prefix, num_problems, row);
    const ProblemParams& p = problems[k];
    const int64_t local = row - row_prefix[k];  // token * H + head
    const int dim = p.head_dim;
    const char* src = static_cast<const char*>(p.q_raw) +
                      local * dim * (p.q_dtype == kF32 ? 4 : 2);
    if (p.q_f32 != nullptr) {
      for (int d = lane; d < dim; d += 32) {
        p.q_f32[local * dim + d] = LoadElement(p.q_dtype, src, d);
      }
    }
    if (!p.use_mma) continue;
    // A q that is not in the KV's type is split into hi + lo in that type,
    // the row scaled by 2^-e first; FinishLogit multiplies the dot by 2^e
    // again. fp16 KV: the largest magnitude goes to [2^14, 2^15), so hi +
    // lo keep ~22 bits without overflowing fp16. e is not clamped: every
    // finite float32 row fits (e in [-163, 113]). bf16 KV: bf16 has
    // float32's range, so only a row past bf16's largest finite value
    // (whose hi would round to inf) is halved. No q overflows here that
    // the CPU computes.
    int exponent = 0;
    if (p.split_q) {
      float max_abs = 0.0f;
      for (int d = lane; d < dim; d += 32) {
        max_abs = fmaxf(max_abs, fabsf(LoadElement(p.q_dtype, src, d)));
      }
      for (int offset = 16; offset > 0; offset >>= 1) {
        max_abs = fmaxf(max_abs, __shfl_xor_sync(kFullMask, max_abs, offset));
      }
      if (p.kv_dtype == kF16) {
        if (max_abs > 0.0f) exponent = ilogbf(max_abs) - 14;
      } else if (max_abs > kBFloat16Max) {
        exponent = 1;
      }
    }
    const int stride = p.q_stride;
    for (int d = lane; d < stride; d += 32) {
      const float x =
          d < dim ? scalbnf(LoadElement(p.q_dtype, src, d), -exponent) : 0.0f;
      const uint16_t hi = ToBits(p.kv_dtype, x);
      p.q_hi[local * stride + d] = hi;
      if (p.split_q) {
        p.q_lo[local * stride + d] =
            ToBits(p.kv_dtype, __fsub_rn(x, FromBits(p.kv_dtype, hi)));
      }
    }
    if (lane == 0) p.q_exponent[local] = exponent;
  }
}

// ---------------------------------------------------------------------------
// Tensor-core attention (fp16 / bf16 KV, dims multiples of 8, up to
// kMmaMaxDim for the narrow kernel, kMmaWideMaxDim for the wide one).
//
// A block of `warps` warps serves 16 * warps rows of one (problem, KV head);
// warp w owns rows [16w, 16w + 16) as one m16 MMA tile. K/V tiles of 32 keys
// stream through a kStages-deep cp.async ring shared by all warps, so every
// K/V byte is read once per block for all query heads of the group. The
// block's q rows are read from global memory once: the narrow kernel keeps
// them in registers as MMA A fragments; the wide one (head_dim up to 256,
// whose fragments and accumulators would not fit in registers together)
// keeps them in shared memory and reads a k-step's fragment with ldmatrix,
// which yields the same registers (so the same bits) as the narrow path.
//
// Per tile and row: S = q k^T (m16n8k16, q as above, k via ldmatrix),
// logits = (S * 2^q_exponent) * scale (+ bias), masked keys -inf; the row's tile max and
// alpha; p = exp(logit - m_new) rounded to the KV dtype (the MMA operand);
// l = alpha * l + sum(p) (sum of the rounded p, fixed order); acc = alpha *
// acc then acc += P V (m16n8k16, V via ldmatrix.trans).
template <int kDType, bool kSplitQ, int kMaxDim>
__global__ void __launch_bounds__(128)
    MmaAttentionKernel(const ProblemParams* __restrict__ problems,
                       const WorkItem* __restrict__ items,
                       float* __restrict__ states, ErrorRecord* errors) {
  using G = MmaGeometry<kMaxDim>;
  constexpr int kStages = G::kStages;
  constexpr int kSmemRowHalves = G::kSmemRowHalves;
  constexpr int kStageHalves = G::kStageHalves;
  constexpr int kMaxKSteps = G::kMaxKSteps;
  constexpr int kMaxVTiles = G::kMaxVTiles;
  constexpr int kRowAccFloatsPerWarp = G::kRowAccFloatsPerWarp;
  constexpr bool kQInSmem = G::kQInSmem;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int nwarps = blockDim.x >> 5;
  // [K ring][V ring][q_hi tile][q_lo tile][row acc]; the q tiles (16 *
  // nwarps rows of kSmemRowHalves) only when kQInSmem, q_lo only when
  // kSplitQ (G::SharedBytes).
  uint16_t* k_smem = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* v_smem = k_smem + kStages * kStageHalves;
  uint16_t* q_smem = v_smem + kStages * kStageHalves;
  const int q_tile_halves = kQInSmem ? nwarps * 16 * kSmemRowHalves : 0;
  uint16_t* q_lo_smem = q_smem + q_tile_halves;
  float* row_acc = reinterpret_cast<float*>(
      q_smem + (kSplitQ ? 2 : 1) * q_tile_halves);

  const WorkItem item = items[blockIdx.x];
  const ProblemParams& p = problems[item.problem];
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int group = lane >> 2;  // MMA groupID
  const int quad = lane & 3;    // MMA threadID_in_group
  const int group_size = p.group_size;
  const int num_heads = p.num_q_heads;
  const int head_dim = p.head_dim;
  const int value_dim = p.value_dim;
  const int num_ksteps = (head_dim + 15) / 16;
  const int num_vtiles = value_dim / 8;
  const int64_t length = p.length;
  const uint32_t tokens_per_block = static_cast<uint32_t>(p.tokens_per_block);
  const int kv_head = item.kv_head;
  const bool full_mode = item.chunk < 0;

  // Zero the K/V ring once: padding columns stay zero for good.
  {
    uint4* z = reinterpret_cast<uint4*>(smem_raw);
    const int n = 2 * kStages * kStageHalves * 2 / 16;
    for (int i = tid; i < n; i += nthreads) z[i] = make_uint4(0, 0, 0, 0);
  }

  TileRanges tiles = KeyTiles(p, item.row_begin, item.row_count);
  if (!full_mode) {
    tiles = tiles.Clip(int64_t{item.chunk} * kChunkTiles,
                       int64_t{item.chunk + 1} * kChunkTiles);
  }
  const int64_t num_tiles = tiles.size();

  // The two rows of this thread: group and group + 8 of the warp's tile.
  int local_row[2];
  bool valid[2];
  int token[2];  // positions fit in int32 on this path (AttendPlan)
  int head[2];
  int query_pos[2];
  int exponent[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    local_row[r] = warp * 16 + group + 8 * r;
    valid[r] = local_row[r] < item.row_count;
    const int64_t row = item.row_begin + (valid[r] ? local_row[r] : 0);
    token[r] = static_cast<int>(row / group_size);
    head[r] = kv_head * group_size + static_cast<int>(row % group_size);
    query_pos[r] = static_cast<int>(p.query_start) + token[r];
    exponent[r] =
        valid[r] ? p.q_exponent[int64_t{token[r]} * num_heads + head[r]] : 0;
  }
  // Visible keys of each row: key <= visible_last and (key >= window_first
  // or key < sink_end); the same rule as KeyVisible, in a form that costs
  // two integer compares per logit.
  int visible_last[2];
  int window_first[2];
  const int sink_end = p.window > 0 ? p.num_sink_tokens : 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    visible_last[r] = static_cast<int>(length) - 1;
    if (p.causal && query_pos[r] < visible_last[r]) {
      visible_last[r] = query_pos[r];
    }
    if (!valid[r]) visible_last[r] = -1;
    window_first[r] = p.window > 0 ? query_pos[r] - p.window + 1 : 0;
  }
  const bool warp_active = warp * 16 < item.row_count;
  const int warp_rows = warp_active ? min(16, item.row_count - warp * 16) : 1;
  const int warp_first_pos = static_cast<int>(
      p.query_start + (item.row_begin + int64_t{warp} * 16) / group_size);
  const int warp_last_pos = static_cast<int>(
      p.query_start +
      (item.row_begin + int64_t{warp} * 16 + warp_rows - 1) / group_size);

  // Query fragments (A operand, row-major 16 x 16 per k-step): in
  // registers for the whole block (narrow), or the block's rows copied to
  // shared memory once (wide; zeros for rows past row_count). q_hi/q_lo
  // rows are q_stride halves, zero-padded by PrepareQueriesKernel, and
  // 32-byte aligned (256-byte aligned scratch, q_stride a multiple of 16).
  uint32_t q_frag[kQInSmem ? 1 : kMaxKSteps][4];
  uint32_t q_lo_frag[kSplitQ && !kQInSmem ? kMaxKSteps : 1][4];
  if constexpr (kQInSmem) {
    const int pieces = p.q_stride / 8;  // 16-byte pieces per row
    const int total = nwarps * 16 * pieces;
    for (int idx = tid; idx < total; idx += nthreads) {
      const int local = idx / pieces;
      const int piece = idx - local * pieces;
      uint4 hi = make_uint4(0, 0, 0, 0);
      uint4 lo = make_uint4(0, 0, 0, 0);
      if (local < item.row_count) {
        const int64_t row = item.row_begin + int64_t{local};
        const int64_t offset =
            ((row / group_size) * num_heads + kv_head * group_size +
             row % group_size) *
                p.q_stride +
            piece * 8;
        hi = *reinterpret_cast<const uint4*>(p.q_hi + offset);
        if constexpr (kSplitQ) {
          lo = *reinterpret_cast<const uint4*>(p.q_lo + offset);
        }
      }
      *reinterpret_cast<uint4*>(q_smem + local * kSmemRowHalves + piece * 8) =
          hi;
      if constexpr (kSplitQ) {
        *reinterpret_cast<uint4*>(q_lo_smem + local * kSmemRowHalves +
                                  piece * 8) = lo;
      }
    }
  } else {
    const int64_t stride = p.q_stride;
    const int64_t base0 = (int64_t{token[0]} * num_heads + head[0]) * stride;
    const int64_t base1 = (int64_t{token[1]} * num_heads + head[1]) * stride;
#pragma unroll
    for (int ks = 0; ks < kMaxKSteps; ++ks) {
      const bool in = ks < num_ksteps;
      const int c0 = ks * 16 + quad * 2;
      const int c1 = c0 + 8;
      q_frag[ks][0] = in && valid[0] ? Load32(p.q_hi + base0 + c0) : 0u;
      q_frag[ks][1] = in && valid[1] ? Load32(p.q_hi + base1 + c0) : 0u;
      q_frag[ks][2] = in && valid[0] ? Load32(p.q_hi + base0 + c1) : 0u;
      q_frag[ks][3] = in && valid[1] ? Load32(p.q_hi + base1 + c1) : 0u;
      if constexpr (kSplitQ) {
        q_lo_frag[ks][0] = in && valid[0] ? Load32(p.q_lo + base0 + c0) : 0u;
        q_lo_frag[ks][1] = in && valid[1] ? Load32(p.q_lo + base1 + c0) : 0u;
        q_lo_frag[ks][2] = in && valid[0] ? Load32(p.q_lo + base0 + c1) : 0u;
        q_lo_frag[ks][3] = in && valid[1] ? Load32(p.q_lo + base1 + c1) : 0u;
      }
    }
  }

  // Chunk state (registers) and row state (m, l in registers, acc in
  // shared memory in a thread-owned layout; full mode only).
  float chunk_m[2] = {NegInf(), NegInf()};
  float chunk_l[2] = {0.0f, 0.0f};
  float acc[kMaxVTiles][4];
#pragma unroll
  for (int vt = 0; vt < kMaxVTiles; ++vt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[vt][e] = 0.0f;
  }
  float row_m[2];
  float row_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) SinkState(p, head[r], &row_m[r], &row_l[r]);
  float* my_row_acc = row_acc + warp * kRowAccFloatsPerWarp + lane;
  if (full_mode) {
    for (int i = 0; i < kMaxVTiles * 4; ++i) my_row_acc[i * 32] = 0.0f;
  }

  auto merge_chunk = [&]() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (chunk_m[r] != NegInf()) {
        const MergeCoef c =
            MergeCoefficients(row_m[r], row_l[r], chunk_m[r], chunk_l[r]);
#pragma unroll
        for (int vt = 0; vt < kMaxVTiles; ++vt) {
          if (vt < num_vtiles) {
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
              float& ra = my_row_acc[(vt * 4 + e) * 32];
              ra = MergeAcc(c, ra, acc[vt][e]);
            }
          }
        }
        row_m[r] = c.m;
        row_l[r] = c.l;
      }
      chunk_m[r] = NegInf();
      chunk_l[r] = 0.0f;
    }
#pragma unroll
    for (int vt = 0; vt < kMaxVTiles; ++vt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[vt][e] = 0.0f;
    }
  };

  // Loader. Warp w fills keys [w * keys_per_warp, (w + 1) * keys_per_warp)
  // of a tile: lane j looks up the row of key j once, and the warp then
  // walks the rows' 16-byte pieces with consecutive lanes on consecutive
  // pieces (coalesced), taking each row address from its lane by shuffle.
  const int keys_per_warp = kTileKeys / (nthreads / 32);
  const int k_pieces = head_dim / 8;  // 16-byte pieces per row
  const int v_pieces = value_dim / 8;
  auto load_rows = [&](uint16_t* dst_tile, unsigned long long row_address,
                       int pieces) {
    const int total = keys_per_warp * pieces;
    for (int base = 0; base < total; base += 32) {
      const int idx = base + lane;
      const int key = idx / pieces;
      const int piece = idx - key * pieces;
      const unsigned long long src =
          __shfl_sync(kFullMask, row_address, key < keys_per_warp ? key : 0);
      if (idx < total) {
        uint16_t* dst = dst_tile +
                        (warp * keys_per_warp + key) * kSmemRowHalves +
                        piece * 8;
        if (src != 0) {
          CpAsync16(dst, reinterpret_cast<const char*>(src) + piece * 16);
        } else {
          *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
        }
      }
    }
  };
  auto load_tile = [&](int stage, int64_t tile) {
    unsigned long long k_row = 0;
    unsigned long long v_row = 0;
    const int64_t pos = tile * kTileKeys + warp * keys_per_warp + lane;
    if (lane < keys_per_warp && pos < length) {
      const uint32_t b = static_cast<uint32_t>(pos) / tokens_per_block;
      const int64_t row_in_block =
          static_cast<uint32_t>(pos) - b * tokens_per_block;
      const char* k_block = p.k_blocks[b];
      const char* v_block = p.v_blocks[b];
      if (k_block != nullptr) {
        k_row = reinterpret_cast<unsigned long long>(
            k_block + (row_in_block * p.k_token_stride +
                       int64_t{kv_head} * p.k_head_stride) *
                          2);
      }
      if (v_block != nullptr) {
        v_row = reinterpret_cast<unsigned long long>(
            v_block + (row_in_block * p.v_token_stride +
                       int64_t{kv_head} * p.v_head_stride) *
                          2);
      }
    }
    load_rows(k_smem + stage * kStageHalves, k_row, k_pieces);
    load_rows(v_smem + stage * kStageHalves, v_row, v_pieces);
  };

  __syncthreads();  // the zero fill lands before any cp.async

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) load_tile(s, tiles.tile(s));
    CpAsyncCommit();
  }

  const int ld_matrix = lane >> 3;  // which 8x8 matrix this lane addresses
  const int ld_row = lane & 7;
  int64_t current_chunk = -1;
  for (int64_t i = 0; i < num_tiles; ++i) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();
    {
      const int64_t next = i + kStages - 1;
      if (next < num_tiles) {
        load_tile(static_cast<int>(next % kStages), tiles.tile(next));
      }
      CpAsyncCommit();
    }
    if (!warp_active) continue;
    const int64_t tile = tiles.tile(i);
    const int stage = static_cast<int>(i % kStages);
    const int64_t chunk = tile / kChunkTiles;
    if (full_mode && chunk != current_chunk) {
      if (current_chunk >= 0) merge_chunk();
      current_chunk = chunk;
    }
    const int key0 = static_cast<int>(tile) * kTileKeys;
    // Tiles no row of this warp can see leave every state unchanged.
    if (p.causal && key0 > warp_last_pos) continue;
    if (p.window > 0 && key0 + kTileKeys - 1 <= warp_first_pos - p.window &&
        key0 >= p.num_sink_tokens) {
      continue;
    }
    const uint16_t* k_tile = k_smem + stage * kStageHalves;
    const uint16_t* v_tile = v_smem + stage * kStageHalves;

    // S = Q K^T: 4 n-tiles of 8 keys.
    float s[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
    }
#pragma unroll
    for (int ks = 0; ks < kMaxKSteps; ++ks) {
      if (ks < num_ksteps) {
        // The k-step's A fragment. From shared memory: matrix j of the
        // ldmatrix.x4 (lanes 8j..8j+7 give its row addresses) is rows
        // (j & 1) * 8 + [0, 8) and columns (j >> 1) * 8 + [0, 8) of the
        // warp's 16 x 16 block, so register j holds exactly q_frag[ks][j]
        // of the register path (a0a1: row group, a2a3: row group + 8, a4a5
        // and a6a7: the same rows, columns + 8).
        uint32_t a[4];
        uint32_t a_lo[4];
        if constexpr (kQInSmem) {
          const int q_offset =
              (warp * 16 + (ld_matrix & 1) * 8 + ld_row) * kSmemRowHalves +
              ks * 16 + (ld_matrix >> 1) * 8;
          LdMatrixX4(a, q_smem + q_offset);
          if constexpr (kSplitQ) LdMatrixX4(a_lo, q_lo_smem + q_offset);
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            a[j] = q_frag[ks][j];
            if constexpr (kSplitQ) a_lo[j] = q_lo_frag[ks][j];
          }
        }
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t b[4];
          LdMatrixX4(b, k_tile +
                            (np * 16 + (ld_matrix >> 1) * 8 + ld_row) *
                                kSmemRowHalves +
                            ks * 16 + (ld_matrix & 1) * 8);
          Mma16816<kDType>(s[2 * np], a, b[0], b[1]);
          Mma16816<kDType>(s[2 * np + 1], a, b[2], b[3]);
          if constexpr (kSplitQ) {
            Mma16816<kDType>(s[2 * np], a_lo, b[0], b[1]);
            Mma16816<kDType>(s[2 * np + 1], a_lo, b[2], b[3]);
          }
        }
      }
    }

    // Logits, masks and the tile max of each row; key offsets relative to
    // key0, clamped to [-1, 33].
    int last_rel[2];
    int first_rel[2];
    const int sink_rel =
        static_cast<int>(min(kTileKeys, max(0, sink_end - key0)));
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      last_rel[r] =
          static_cast<int>(min(kTileKeys, max(-1, visible_last[r] - key0)));
      first_rel[r] =
          static_cast<int>(min(kTileKeys + 1, max(0, window_first[r] - key0)));
    }
    float tile_max[2] = {NegInf(), NegInf()};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int k = nt * 8 + quad * 2 + (e & 1);
        float logit = NegInf();
        if (k <= last_rel[r] && (k >= first_rel[r] || k < sink_rel)) {
          logit = FinishLogit(p, s[nt][e], exponent[r], token[r], head[r],
                              key0 + k, errors);
        }
        s[nt][e] = logit;
        tile_max[r] = fmaxf(tile_max[r], logit);
      }
    }
    float m_new[2];
    float alpha[2];
    bool active[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] =
          fmaxf(tile_max[r], __shfl_xor_sync(kFullMask, tile_max[r], 1));
      tile_max[r] =
          fmaxf(tile_max[r], __shfl_xor_sync(kFullMask, tile_max[r], 2));
      active[r] = tile_max[r] != NegInf();
      m_new[r] = active[r] ? fmaxf(chunk_m[r], tile_max[r]) : chunk_m[r];
      alpha[r] = active[r] ? TileAlpha(chunk_m[r], m_new[r]) : 1.0f;
    }

    // P, rounded to the MMA operand type, and its row sums.
    uint32_t p_frag[2][4];
    float p_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      uint16_t bits[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const float x = s[nt][e];
        const float pe = x == NegInf() ? 0.0f : FastExp(__fsub_rn(x, m_new[r]));
        bits[e] = ToBits(kDType, pe);
      }
      p_sum[0] = __fadd_rn(__fadd_rn(p_sum[0], FromBits(kDType, bits[0])),
                           FromBits(kDType, bits[1]));
      p_sum[1] = __fadd_rn(__fadd_rn(p_sum[1], FromBits(kDType, bits[2])),
                           FromBits(kDType, bits[3]));
      const int kk = nt >> 1;
      const int half = nt & 1;
      p_frag[kk][half * 2 + 0] = Pack(bits[0], bits[1]);  // row group
      p_frag[kk][half * 2 + 1] = Pack(bits[2], bits[3]);  // row group + 8
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      p_sum[r] = __fadd_rn(p_sum[r], __shfl_xor_sync(kFullMask, p_sum[r], 1));
      p_sum[r] = __fadd_rn(p_sum[r], __shfl_xor_sync(kFullMask, p_sum[r], 2));
      if (active[r]) {
        chunk_l[r] = __fmaf_rn(alpha[r], chunk_l[r], p_sum[r]);
        chunk_m[r] = m_new[r];
      }
    }
    if (!__any_sync(kFullMask, active[0] || active[1])) continue;

      // acc = alpha * acc + P V.
#pragma unroll
    for (int vt = 0; vt < kMaxVTiles; ++vt) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[vt][e] = __fmul_rn(acc[vt][e], alpha[e >> 1]);
    }
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
      for (int vp = 0; vp < kMaxVTiles / 2; ++vp) {
        if (2 * vp < num_vtiles) {
          uint32_t b[4];
          LdMatrixX4Trans(
              b, v_tile +
                     (kk * 16 + (ld_matrix & 1) * 8 + ld_row) * kSmemRowHalves +
                     vp * 16 + (ld_matrix >> 1) * 8);
          Mma16816<kDType>(acc[2 * vp], p_frag[kk], b[0], b[1]);
          if (2 * vp + 1 < num_vtiles) {
            Mma16816<kDType>(acc[2 * vp + 1], p_frag[kk], b[2], b[3]);
          }
        }
      }
    }
  }
  CpAsyncWait<0>();
  if (!warp_active) return;

  if (!full_mode) {
    // Split mode: this chunk's state for MergeChunksKernel.
    float* state = states + item.state_offset;
    const int rows = item.row_count;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (!valid[r]) continue;
      if (quad == 0) {
        state[local_row[r]] = chunk_m[r];
        state[rows + local_row[r]] = chunk_l[r];
      }
      float* state_acc = state + 2 * rows + int64_t{local_row[r]} * value_dim;
#pragma unroll
      for (int vt = 0; vt < kMaxVTiles; ++vt) {
        if (vt < num_vtiles) {
          const int col = vt * 8 + quad * 2;
          state_acc[col] = acc[vt][2 * r];
          state_acc[col + 1] = acc[vt][2 * r + 1];
        }
      }
    }
    return;
  }

  merge_chunk();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!valid[r]) continue;
#pragma unroll
    for (int vt = 0; vt < kMaxVTiles; ++vt) {
      if (vt < num_vtiles) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const int col = vt * 8 + quad * 2 + (e & 1);
          WriteOutput(p, token[r], head[r], col, row_l[r],
                      my_row_acc[(vt * 4 + e) * 32], errors);
        }
      }
    }
    if (quad == 0) {
      WriteRowStats(p, token[r], head[r], row_m[r], row_l[r], errors);
    }
  }
}

// ---------------------------------------------------------------------------
// SIMT attention (fp32 KV, and 16-bit KV whose dims the MMA path does not
// take). fp32 arithmetic throughout; every dot product is one sequential
// fmaf chain over head_dim, every P V element one fmaf chain over the 32
// keys of a tile. Rows of the block: R = item.row_count; warp w computes the
// logits and softmax of rows w, w + 4, ...

struct SimtShared {
  const char* k_ptr[kTileKeys];
  const char* v_ptr[kTileKeys];
  float q[kSimtMaxRows][kSimtDimChunk];
  float k[kTileKeys][kSimtKeyStride];
  float p[kSimtMaxRows][kTileKeys];
  float v[kTileKeys][kSimtDimChunk];
  float chunk_m[kSimtMaxRows];
  float chunk_l[kSimtMaxRows];
  float row_m[kSimtMaxRows];
  float row_l[kSimtMaxRows];
  float alpha[kSimtMaxRows];
  int active[kSimtMaxRows];
};

template <int kDType>
__global__ void __launch_bounds__(kSimtThreads)
    SimtAttentionKernel(const ProblemParams* __restrict__ problems,
                        const WorkItem* __restrict__ items,
                        float* __restrict__ states, ErrorRecord* errors) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SimtShared& sh = *reinterpret_cast<SimtShared*>(smem_raw);
  const WorkItem item = items[blockIdx.x];
  const ProblemParams& p = problems[item.problem];
  const int rows = item.row_count;
  const int value_dim = p.value_dim;
  float* chunk_acc = reinterpret_cast<float*>(smem_raw + sizeof(SimtShared));
  float* row_acc = chunk_acc + rows * value_dim;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  constexpr int kWarps = kSimtThreads / 32;
  const int group_size = p.group_size;
  const int num_heads = p.num_q_heads;
  const int head_dim = p.head_dim;
  const int kv_head = item.kv_head;
  const int64_t length = p.length;
  const int64_t tokens_per_block = p.tokens_per_block;
  constexpr int64_t kElementSize = kDType == kF32 ? 4 : 2;
  const bool full_mode = item.chunk < 0;

  auto row_token = [&](int local) {
    return (item.row_begin + int64_t{local}) / group_size;
  };
  auto row_head = [&](int local) {
    return kv_head * group_size +
           static_cast<int>((item.row_begin + int64_t{local}) % group_size);
  };

  TileRanges tiles = KeyTiles(p, item.row_begin, rows);
  if (!full_mode) {
    tiles = tiles.Clip(int64_t{item.chunk} * kChunkTiles,
                       int64_t{item.chunk + 1} * kChunkTiles);
  }
  const int64_t num_tiles = tiles.size();

  if (tid < rows) {
    sh.chunk_m[tid] = NegInf();
    sh.chunk_l[tid] = 0.0f;
    SinkState(p, row_head(tid), &sh.row_m[tid], &sh.row_l[tid]);
  }
  for (int i = tid; i < rows * value_dim; i += kSimtThreads) {
    chunk_acc[i] = 0.0f;
    row_acc[i] = 0.0f;
  }
  __syncthreads();

  auto merge_chunk = [&]() {
    __syncthreads();
    for (int i = tid; i < rows * value_dim; i += kSimtThreads) {
      const int local = i / value_dim;
      if (sh.chunk_m[local] != NegInf()) {
        const MergeCoef c =
            MergeCoefficients(sh.row_m[local], sh.row_l[local],
                              sh.chunk_m[local], sh.chunk_l[local]);
        row_acc[i] = MergeAcc(c, row_acc[i], chunk_acc[i]);
      }
      chunk_acc[i] = 0.0f;
    }
    __syncthreads();
    if (tid < rows) {
      if (sh.chunk_m[tid] != NegInf()) {
        const MergeCoef c = MergeCoefficients(sh.row_m[tid], sh.row_l[tid],
                                              sh.chunk_m[tid], sh.chunk_l[tid]);
        sh.row_m[tid] = c.m;
        sh.row_l[tid] = c.l;
      }
      sh.chunk_m[tid] = NegInf();
      sh.chunk_l[tid] = 0.0f;
    }
    __syncthreads();
  };

  int64_t current_chunk = -1;
  for (int64_t i = 0; i < num_tiles; ++i) {
    const int64_t tile = tiles.tile(i);
    const int64_t chunk = tile / kChunkTiles;
    if (full_mode && chunk != current_chunk) {
      if (current_chunk >= 0) merge_chunk();
      current_chunk = chunk;
    }
    const int64_t key0 = tile * kTileKeys;
    if (tid < kTileKeys) {
      const int64_t pos = key0 + tid;
      const char* k_row = nullptr;
      const char* v_row = nullptr;
      if (pos < length) {
        const int64_t b = pos / tokens_per_block;
        const int64_t row_in_block = pos - b * tokens_per_block;
        const char* k_block = p.k_blocks[b];
        const char* v_block = p.v_blocks[b];
        if (k_block != nullptr) {
          k_row = k_block + (row_in_block * p.k_token_stride +
                             int64_t{kv_head} * p.k_head_stride) *
                                kElementSize;
        }
        if (v_block != nullptr) {
          v_row = v_block + (row_in_block * p.v_token_stride +
                             int64_t{kv_head} * p.v_head_stride) *
                                kElementSize;
        }
      }
      sh.k_ptr[tid] = k_row;
      sh.v_ptr[tid] = v_row;
    }

    // Dot products, head_dim streamed in chunks of 64.
    float dot[kSimtMaxRows / kWarps];
#pragma unroll
    for (int j = 0; j < kSimtMaxRows / kWarps; ++j) dot[j] = 0.0f;
    for (int d0 = 0; d0 < head_dim; d0 += kSimtDimChunk) {
      const int dn = min(kSimtDimChunk, head_dim - d0);
      __syncthreads();
      for (int idx = tid; idx < rows * kSimtDimChunk; idx += kSimtThreads) {
        const int local = idx / kSimtDimChunk;
        const int d = idx % kSimtDimChunk;
        if (d < dn) {
          sh.q[local][d] =
              p.q_f32[(row_token(local) * num_heads + row_head(local)) *
                          head_dim +
                      d0 + d];
        }
      }
      for (int idx = tid; idx < kTileKeys * kSimtDimChunk;
           idx += kSimtThreads) {
        const int key = idx / kSimtDimChunk;
        const int d = idx % kSimtDimChunk;
        if (d < dn) {
          const char* k_row = sh.k_ptr[key];
          sh.k[key][d] =
              k_row != nullptr ? LoadAs<kDType>(k_row, d0 + d) : 0.0f;
        }
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kSimtMaxRows / kWarps; ++j) {
        const int local = warp + kWarps * j;
        if (local < rows) {
          float x = dot[j];
          for (int d = 0; d < dn; ++d)
            x = __fmaf_rn(sh.q[local][d], sh.k[lane][d], x);
          dot[j] = x;
        }
      }
    }

    // Logits and the online-softmax update of each row (lane = key).
#pragma unroll
    for (int j = 0; j < kSimtMaxRows / kWarps; ++j) {
      const int local = warp + kWarps * j;
      if (local >= rows) continue;
      const int64_t token = row_token(local);
      const int head = row_head(local);
      const int64_t key = key0 + lane;
      float logit = NegInf();
      if (KeyVisible(p, p.query_start + token, key)) {
        logit = FinishLogit(p, dot[j], 0, token, head, key, errors);
      }
      float tile_max = logit;
      for (int offset = 16; offset > 0; offset >>= 1) {
        tile_max =
            fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, offset));
      }
      const float old_m = sh.chunk_m[local];
      const float old_l = sh.chunk_l[local];
      __syncwarp();
      if (tile_max == NegInf()) {
        sh.p[local][lane] = 0.0f;
        if (lane == 0) {
          sh.active[local] = 0;
          sh.alpha[local] = 1.0f;
        }
        continue;
      }
      const float m_new = fmaxf(old_m, tile_max);
      const float alpha = TileAlpha(old_m, m_new);
      const float pe = logit == NegInf() ? 0.0f : expf(__fsub_rn(logit, m_new));
      sh.p[local][lane] = pe;
      float sum = pe;
      for (int offset = 16; offset > 0; offset >>= 1) {
        sum = __fadd_rn(sum, __shfl_xor_sync(kFullMask, sum, offset));
      }
      if (lane == 0) {
        sh.chunk_l[local] = __fmaf_rn(alpha, old_l, sum);
        sh.chunk_m[local] = m_new;
        sh.alpha[local] = alpha;
        sh.active[local] = 1;
      }
    }

    // acc = alpha * acc + P V, value_dim streamed in chunks of 64.
    for (int c0 = 0; c0 < value_dim; c0 += kSimtDimChunk) {
      const int cn = min(kSimtDimChunk, value_dim - c0);
      __syncthreads();
      for (int idx = tid; idx < kTileKeys * kSimtDimChunk;
           idx += kSimtThreads) {
        const int key = idx / kSimtDimChunk;
        const int c = idx % kSimtDimChunk;
        if (c < cn) {
          const char* v_row = sh.v_ptr[key];
          sh.v[key][c] =
              v_row != nullptr ? LoadAs<kDType>(v_row, c0 + c) : 0.0f;
        }
      }
      __syncthreads();
      for (int idx = tid; idx < rows * kSimtDimChunk; idx += kSimtThreads) {
        const int local = idx / kSimtDimChunk;
        const int c = idx % kSimtDimChunk;
        if (c < cn && sh.active[local]) {
          float pv = 0.0f;
#pragma unroll 8
          for (int key = 0; key < kTileKeys; ++key) {
            pv = __fmaf_rn(sh.p[local][key], sh.v[key][c], pv);
          }
          float& a = chunk_acc[local * value_dim + c0 + c];
          a = __fmaf_rn(sh.alpha[local], a, pv);
        }
      }
    }
    __syncthreads();
  }

  if (!full_mode) {
    float* state = states + item.state_offset;
    if (tid < rows) {
      state[tid] = sh.chunk_m[tid];
      state[rows + tid] = sh.chunk_l[tid];
    }
    for (int i = tid; i < rows * value_dim; i += kSimtThreads) {
      state[2 * rows + i] = chunk_acc[i];
    }
    return;
  }
  merge_chunk();
  for (int i = tid; i < rows * value_dim; i += kSimtThreads) {
    const int local = i / value_dim;
    WriteOutput(p, row_token(local), row_head(local), i % value_dim,
                sh.row_l[local], row_acc[i], errors);
  }
  if (tid < rows) {
    WriteRowStats(p, row_token(tid), row_head(tid), sh.row_m[tid],
                  sh.row_l[tid], errors);
  }
}

// ---------------------------------------------------------------------------
// Split-mode merge: chunk states of one row block, in increasing chunk
// order, from the sink state. One thread per output element.

__global__ void MergeChunksKernel(const MergeItem* __restrict__ items,
                                  const ProblemParams* __restrict__ problems,
                                  const float* __restrict__ states,
                                  ErrorRecord* errors) {
  const MergeItem item = items[blockIdx.x];
  const ProblemParams& p = problems[item.problem];
  const int value_dim = p.value_dim;
  const int rows = item.row_count;
  const int64_t slot_stride = int64_t{rows} * (value_dim + 2);
  for (int64_t i = threadIdx.x; i < int64_t{rows} * value_dim;
       i += blockDim.x) {
    const int local = static_cast<int>(i / value_dim);
    const int col = static_cast<int>(i % value_dim);
    const int64_t row = item.row_begin + int64_t{local};
    const int64_t token = row / p.group_size;
    const int head =
        item.kv_head * p.group_size + static_cast<int>(row % p.group_size);
    float m;
    float l;
    SinkState(p, head, &m, &l);
    float acc = 0.0f;
    const float* state = states + item.first_state_offset;
    // Loads are unconditional and the loop unrolled so that several
    // slots' loads are in flight at once; the merge order is unchanged.
#pragma unroll 8
    for (int s = 0; s < item.num_slots; ++s) {
      const float* slot = state + s * slot_stride;
      const float cm = slot[local];
      const float cl = slot[rows + local];
      const float ca = slot[2 * rows + i];
      if (cm == NegInf()) continue;
      const MergeCoef c = MergeCoefficients(m, l, cm, cl);
      acc = MergeAcc(c, acc, ca);
      m = c.m;
      l = c.l;
    }
    WriteOutput(p, token, head, col, l, acc, errors);
    if (col == 0) WriteRowStats(p, token, head, m, l, errors);
  }
}

// ---------------------------------------------------------------------------
// Softmax weights (stateless return_weights): one block per (head, token)
// row, one thread per key, from the row max and denominator of the
// attention pass.

__global__ void WeightsKernel(const ProblemParams* __restrict__ problems,
                              const int32_t* __restrict__ problem_ids,
                              const int64_t* __restrict__ row_prefix,
                              int num_ids, int64_t total_rows) {
  for (int64_t row = blockIdx.x; row < total_rows; row += gridDim.x) {
    const int k = FindSegment(row_prefix, num_ids, row);
    const ProblemParams& p = problems[problem_ids[k]];
    const int64_t local = row - row_prefix[k];  // head * T + token
    const int64_t num_queries = p.num_queries;
    const int head = static_cast<int>(local / num_queries);
    const int64_t token = local % num_queries;
    const int64_t stat = token * p.num_q_heads + head;
    const float m = p.row_max[stat];
    const float l = p.row_sum[stat];
    const int head_dim = p.head_dim;
    const float* q = p.q_f32 + stat * head_dim;
    const int kv_head = head / p.group_size;
    const int64_t element_size = p.kv_dtype == kF32 ? 4 : 2;
    float* out = p.weights + local * p.length;
    for (int64_t key = threadIdx.x; key < p.length; key += blockDim.x) {
      float w = 0.0f;
      if (l != 0.0f && KeyVisible(p, p.query_start + token, key)) {
        const int64_t b = key / p.tokens_per_block;
        const char* k_row =
            p.k_blocks[b] + ((key - b * p.tokens_per_block) * p.k_token_stride +
                             int64_t{kv_head} * p.k_head_stride) *
                                element_size;
        float dot = 0.0f;
        for (int d = 0; d < head_dim; ++d) {
          dot = __fmaf_rn(q[d], LoadElement(p.kv_dtype, k_row, d), dot);
        }
        const float logit =
            FinishLogit(p, dot, 0, token, head, key, nullptr);
        if (logit != NegInf()) {
          w = __fdiv_rn(expf(__fsub_rn(logit, m)), l);
        }
      }
      out[key] = w;
    }
  }
}

// ---------------------------------------------------------------------------
// Launch plumbing.

using AttentionKernelFn = void (*)(const ProblemParams*, const WorkItem*,
                                   float*, ErrorRecord*);

AttentionKernelFn KernelFor(KernelVariant variant) {
  switch (variant) {
    case KernelVariant::kMmaF16:
      return MmaAttentionKernel<kF16, false, kMmaMaxDim>;
    case KernelVariant::kMmaF16SplitQ:
      return MmaAttentionKernel<kF16, true, kMmaMaxDim>;
    case KernelVariant::kMmaBF16:
      return MmaAttentionKernel<kBF16, false, kMmaMaxDim>;
    case KernelVariant::kMmaBF16SplitQ:
      return MmaAttentionKernel<kBF16, true, kMmaMaxDim>;
    case KernelVariant::kMmaWideF16:
      return MmaAttentionKernel<kF16, false, kMmaWideMaxDim>;
    case KernelVariant::kMmaWideF16SplitQ:
      return MmaAttentionKernel<kF16, true, kMmaWideMaxDim>;
    case KernelVariant::kMmaWideBF16:
      return MmaAttentionKernel<kBF16, false, kMmaWideMaxDim>;
    case KernelVariant::kMmaWideBF16SplitQ:
      return MmaAttentionKernel<kBF16, true, kMmaWideMaxDim>;
    case KernelVariant::kSimtF32:
      return SimtAttentionKernel<kF32>;
    case KernelVariant::kSimtF16:
      return SimtAttentionKernel<kF16>;
    case KernelVariant::kSimtBF16:
      return SimtAttentionKernel<kBF16>;
  }
  return nullptr;
}

bool IsWideVariant(KernelVariant variant) {
  return variant == KernelVariant::kMmaWideF16 ||
         variant == KernelVariant::kMmaWideF16SplitQ ||
         variant == KernelVariant::kMmaWideBF16 ||
         variant == KernelVariant::kMmaWideBF16SplitQ;
}

bool IsSplitQVariant(KernelVariant variant) {
  return variant == KernelVariant::kMmaF16SplitQ ||
         variant == KernelVariant::kMmaBF16SplitQ ||
         variant == KernelVariant::kMmaWideF16SplitQ ||
         variant == KernelVariant::kMmaWideBF16SplitQ;
}

// Dynamic shared memory of a tensor-core block.
size_t MmaSharedBytes(KernelVariant variant, int warps, bool full_mode) {
  const bool split_q = IsSplitQVariant(variant);
  return IsWideVariant(variant)
             ? MmaGeometry<kMmaWideMaxDim>::SharedBytes(warps, split_q,
                                                        full_mode)
             : MmaGeometry<kMmaMaxDim>::SharedBytes(warps, split_q, full_mode);
}

constexpr size_t kSimtMaxAccBytes = size_t{2} * 8192 * sizeof(float);

// Grid size for grid-stride kernels.
unsigned GridFor(int64_t work, int64_t per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < 65535 ? (blocks > 0 ? blocks : 1)
                                              : 65535);
}

}  // namespace

int SimtRowsPerBlock(int value_dim) {
  const int rows = 8192 / (value_dim > 0 ? value_dim : 1);
  return rows < 1 ? 1 : (rows > kSimtMaxRows ? kSimtMaxRows : rows);
}

KernelVariant MmaVariantFor(bool bf16, bool split_q, int head_dim,
                            int value_dim) {
  const bool wide = head_dim > kMmaMaxDim || value_dim > kMmaMaxDim;
  if (bf16) {
    if (wide) {
      return split_q ? KernelVariant::kMmaWideBF16SplitQ
                     : KernelVariant::kMmaWideBF16;
    }
    return split_q ? KernelVariant::kMmaBF16SplitQ : KernelVariant::kMmaBF16;
  }
  if (wide) {
    return split_q ? KernelVariant::kMmaWideF16SplitQ
                   : KernelVariant::kMmaWideF16;
  }
  return split_q ? KernelVariant::kMmaF16SplitQ : KernelVariant::kMmaF16;
}

int MmaWarpsFor(KernelVariant variant, int64_t rows_per_head,
                int64_t max_shared_bytes) {
  int warps = rows_per_head <= 16 ? 1 : (rows_per_head <= 32 ? 2 : 4);
  while (warps > 0 &&
         static_cast<int64_t>(MmaSharedBytes(variant, warps, true)) >
             max_shared_bytes) {
    warps /= 2;
  }
  return warps;
}

size_t AttentionSharedBytes(const AttentionLaunch& launch) {
  if (IsMmaVariant(launch.variant)) {
    return MmaSharedBytes(launch.variant, launch.warps, launch.full_mode);
  }
  return sizeof(SimtShared) +
         size_t{2} * launch.simt_rows * launch.max_value_dim * sizeof(float);
}

cudaError_t ConfigureAttentionKernels() {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int optin = 0;
  err = cudaDeviceGetAttribute(
      &optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  const size_t simt_max = sizeof(SimtShared) + kSimtMaxAccBytes;
  for (int v = 0; v < kNumKernelVariants; ++v) {
    const KernelVariant variant = static_cast<KernelVariant>(v);
    const AttentionKernelFn fn = KernelFor(variant);
    cudaFuncAttributes attributes;
    err = cudaFuncGetAttributes(&attributes, fn);
    if (err != cudaSuccess) return err;
    // The largest launch (4 warps, full mode); a wide variant on a device
    // with less shared memory gets fewer warps or none (MmaWarpsFor).
    const size_t wanted = IsMmaVariant(variant)
                              ? MmaSharedBytes(variant, 4, /*full_mode=*/true)
                              : simt_max;
    err = cudaFuncSetAttribute(
        fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(std::min(wanted, static_cast<size_t>(optin))));
    if (err != cudaSuccess) return err;
  }
  cudaFuncAttributes attributes;
  err = cudaFuncGetAttributes(&attributes, MergeChunksKernel);
  if (err != cudaSuccess) return err;
  err = cudaFuncGetAttributes(&attributes, PrepareQueriesKernel);
  if (err != cudaSuccess) return err;
  return cudaFuncGetAttributes(&attributes, WeightsKernel);
}

cudaError_t LaunchPrepareQueries(const ProblemParams* problems,
                                 const int64_t* row_prefix, int num_problems,
                                 int64_t total_rows, cudaStream_t stream) {
  if (total_rows <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  PrepareQueriesKernel<<<GridFor(total_rows, kThreads / 32), kThreads, 0,
                         stream>>>(problems, row_prefix, num_problems,
                                   total_rows);
  return cudaGetLastError();
}

cudaError_t LaunchAttention(const AttentionLaunch& launch,
                            const ProblemParams* problems, float* states,
                            ErrorRecord* errors, cudaStream_t stream) {
  if (launch.num_items <= 0) return cudaSuccess;
  const AttentionKernelFn fn = KernelFor(launch.variant);
  const int threads =
      IsMmaVariant(launch.variant) ? 32 * launch.warps : kSimtThreads;
  fn<<<static_cast<unsigned>(launch.num_items), threads,
       AttentionSharedBytes(launch), stream>>>(problems, launch.items, states,
                                               errors);
  return cudaGetLastError();
}

cudaError_t LaunchMergeChunks(const MergeItem* items, int num_items,
                              const ProblemParams* problems,
                              const float* states, ErrorRecord* errors,
                              cudaStream_t stream) {
  if (num_items <= 0) return cudaSuccess;
  MergeChunksKernel<<<static_cast<unsigned>(num_items), 128, 0, stream>>>(
      items, problems, states, errors);
  return cudaGetLastError();
}

cudaError_t LaunchWeights(const ProblemParams* problems,
                          const int32_t* problem_ids, const int64_t* row_prefix,
                          int num_ids, int64_t total_rows,
                          cudaStream_t stream) {
  if (total_rows <= 0) return cudaSuccess;
  WeightsKernel<<<GridFor(total_rows, 1), 128, 0, stream>>>(
      problems, problem_ids, row_prefix, num_ids, total_rows);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace attention
