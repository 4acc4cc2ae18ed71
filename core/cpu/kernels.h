// The instruction-set specific half of the CPU backend: a table of kernel
// functions per ISA (scalar, AVX2, AVX-512), all compiled from the one
// template in kernels_impl.h so that every table computes bitwise the same
// results. cpu_backend.cc walks problems, chunks and tiles and calls these.
//
// Canonical numerics (shared by every table, see kernels_impl.h):
//   * dot(q, k): 16 lanes; lane l accumulates elements d = l (mod 16) in
//     increasing d with a fused multiply-add, from +0; the lanes are then
//     summed pairwise (l + l+8, then l + l+4, l + l+2, l + l+1).
//   * logit = dot * scale + 0 (the +0 turns a -0 into +0, so maxima do not
//     depend on evaluation order), then + bias when there is one.
//   * exp: one Cody-Waite + degree-6 polynomial evaluation with FMAs,
//     flushed to 0 below ln(FLT_MIN) (ExpNonPositive in kernels_impl.h).
//   * tile update of a (m, l, acc) state: m' = max(m, tile max),
//     alpha = m == -inf ? 0 : exp(m - m'), p_j = exp(s_j - m'),
//     l' = fma(alpha, l, sum_j p_j) with the p_j summed in key order,
//     acc'[d] = fma(alpha, acc[d], pv[d]), pv[d] accumulating
//     fma(p_j, v_j[d], pv[d]) in key order from +0.
//   * merge of state b into a: m = max(a.m, b.m), ca = exp(a.m - m),
//     cb = exp(b.m - m), l = fma(a.l, ca, b.l * cb),
//     acc[d] = fma(a.acc[d], ca, b.acc[d] * cb); an empty a takes b's state.
//
// Header hygiene: the ISA translation units are compiled with -mavx2 /
// -mavx512f. Besides <immintrin.h> (always-inline intrinsics) and integer
// types they include only this header and kernels_impl.h (which places
// everything in a per-ISA namespace), never a header with inline functions
// shared with portable code, so the linker can never pick an AVX copy of a
// shared inline function for the portable path.
#ifndef ATTENTION_CORE_CPU_KERNELS_H_
#define ATTENTION_CORE_CPU_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace attention::cpu {

// SIMD width of the canonical numerics (floats per vector).
inline constexpr int kLanes = 16;
// Keys per tile handed to UpdateTile; equals kKeysPerTile.
inline constexpr int kTileKeys = 32;

// Element type of K/V (and query) rows the kernels convert.
enum class ElementType : uint8_t { kFloat32, kFloat16, kBFloat16 };

enum class TileError : int {
  kNone = 0,
  kLogitOverflow = 1,  // q.k * scale is not finite for a visible key
  kBiasOverflow = 2,   // logit + bias is not finite
};

// One tile of keys [t0, t0 + n) seen by `rows` query rows times `group`
// query heads of one KV head. Row-head rh = r * group + h. All row-heads
// share each K/V row load (converted to float in registers).
struct TileJob {
  int n = 0;                 // keys in the tile, 1..kTileKeys
  int head_dim_padded = 0;   // multiple of kLanes
  int value_dim_padded = 0;  // multiple of kLanes
  int rows = 0;
  int group = 0;
  float scale = 1.0f;
  // [rows * group][head_dim_padded] queries, zero padded.
  const float* q = nullptr;
  // n key rows and n value rows of head_dim_padded / value_dim_padded
  // elements of key_type / value_type; keys the caller does not load point
  // at zeros (all-zero bytes are +0 in every type).
  ElementType key_type = ElementType::kFloat32;
  ElementType value_type = ElementType::kFloat32;
  const std::byte* const* k = nullptr;
  const std::byte* const* v = nullptr;
  // [rows]: bit j set when key t0 + j is visible to the row (mask only).
  const uint32_t* visible = nullptr;
  // nullptr, or [rows * group] pointers to n float32 bias values each.
  const float* const* bias = nullptr;
  // Chunk state: m, l [rows * group]; acc [rows * group][value_dim_padded].
  float* m = nullptr;
  float* l = nullptr;
  float* acc = nullptr;
  // Kernel scratch: [rows * group][kTileKeys] floats, [rows * group]
  // floats and [rows * group] ints.
  float* work = nullptr;
  float* alpha = nullptr;
  int* active = nullptr;
  // Optional: rows of the next tile (prefetch_n of them, nullptr entries
  // skipped) to pull into the cache while this one is computed.
  int prefetch_n = 0;
  int prefetch_key_bytes = 0;
  int prefetch_value_bytes = 0;
  const std::byte* const* prefetch_k = nullptr;
  const std::byte* const* prefetch_v = nullptr;
  // Set on error: the row-head and key index (0..n-1) that failed.
  int error_row_head = -1;
  int error_key = -1;
};

struct KernelTable {
  const char* name;  // "scalar", "avx2" or "avx512"

  // Converts n rows of `dim` elements (src[j] == nullptr: zeros) into dst
  // rows of `stride` floats (stride >= dim, a multiple of kLanes), zero
  // filling [dim, stride). Conversions are exact.
  void (*convert_rows)(ElementType type, const std::byte* const* src, int n,
                       int dim, int stride, float* dst);

  // Updates the chunk state of every row-head with a visible key in the
  // tile. On error returns its kind and sets job->error_*; the state is
  // then unspecified.
  TileError (*update_tile)(TileJob* job);

  // The masked logits (-inf where invisible) of row-head `rh` over the
  // tile, exactly as update_tile computes them, into logits[0, n).
  TileError (*tile_logits)(TileJob* job, int rh, float* logits);

  // weights[j] = exp(logits[j] - m) / l for every visible (finite) logit;
  // other entries are left untouched.
  void (*tile_weights)(const float* logits, int n, float m, float l,
                       float* weights);

  // Merges state (b_m, b_l, b_acc) into (a_m, a_l, a_acc) as documented
  // above; value_dim_padded floats of acc. REQUIRES b_m != -inf.
  void (*merge_state)(float* a_m, float* a_l, float* a_acc, float b_m,
                      float b_l, const float* b_acc, int value_dim_padded);

  // out[d] = acc[d] / divisor for d < n, each quotient correctly rounded
  // (the same as one by one); out may be acc. False when a quotient is not
  // finite (the unnormalized sum of p * v overflowed float32).
  bool (*divide_row)(const float* acc, float divisor, int n, float* out);

  // The canonical exp of one value (x <= 0 or -inf), for tests.
  float (*exp)(float x);

  // Peak multiply-add probe, for benchmarks: `rounds` rounds of
  // independent fused multiply-add chains on full vectors, enough chains to
  // keep every multiply-add unit of the processor busy, nothing else in
  // the loop. Each round is fma_probe_flops floating-point operations (a
  // multiply-add counts 2). Returns a value that depends on every chain.
  float (*fma_probe)(int64_t rounds);
  int fma_probe_flops;

  // The same probe with the widening a decode over float16 KV cannot do
  // without under these numerics: every round widens vectors of float16
  // values read from L1 (LoadHalf) and feeds each one to 4 multiply-add
  // chains, as a GQA 32/8 decode shares each widened K or V vector among
  // the 4 query heads of its KV head. Each round is fma_widen_probe_flops
  // floating-point operations (a multiply-add counts 2).
  float (*fma_widen_probe)(int64_t rounds);
  int fma_widen_probe_flops;

  // Streaming-read probe, for benchmarks: the maximum of data[0, count)
  // (no NaNs), read with full-vector loads into several independent
  // running maxima, nothing else in the loop, so that it runs at the rate a
  // core can stream memory rather than at the rate of its instructions.
  float (*read_probe)(const float* data, int64_t count);
};

// The tables compiled into this build; the AVX ones are nullptr when the
// build lacks them (non-x86 targets or compilers without the flags). A
// table may only be used when CpuIsaSupported() says the CPU can run it.
const KernelTable* ScalarKernels();
const KernelTable* Avx2Kernels();
const KernelTable* Avx512Kernels();

}  // namespace attention::cpu

#endif  // ATTENTION_CORE_CPU_KERNELS_H_
