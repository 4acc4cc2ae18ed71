// The attention kernels, written once over a 16-lane vector type and
// instantiated by kernels_scalar.cc, kernels_avx2.cc and kernels_avx512.cc.
// Every operation the canonical numerics of kernels.h name is done the same
// way in every instantiation (same pairing, fused multiply-adds where the
// scalar code has them, the same exp), which is what makes the ISA paths
// bitwise equal.
//
// Usage: a kernels_<isa>.cc file defines ATTN_KERNEL_NAMESPACE and
// ATTN_KERNEL_NAME, declares inside namespace
// attention::cpu::ATTN_KERNEL_NAMESPACE the types V (16 floats) and M (16
// lane flags), the register-blocking constants kDotHeads, kPvHeads (row-heads
// sharing one key / value load, 1..4), kDotAccumulators and kPvAccumulators
// (vectors of partial sums one Q.K / P.V pass keeps in registers: row-heads
// x keys, row-heads x value blocks), kFmaProbeChains (independent chains of
// the multiply-add probe), and the operations listed below, then
// includes this file (once, never from a header). Everything here lands in
// that per-ISA namespace, so no inline function is shared between
// translation units built with different instruction-set flags.
//
// Operations the ISA file provides (lane-wise unless stated):
//   V Zero(); V Splat(V, float c) (c in every lane; the V argument only
//   selects the overload); V Load(const float*); V LoadN(const float*, int n)
//   (first n lanes, zeros after); void Store(float*, V);
//   V LoadHalf(const uint16_t*); V LoadBf16(const uint16_t*) (16 values);
//   V Add, Sub, Mul, Div, Max (no NaN inputs); V Fma(a, b, c) = a * b + c
//   rounded once; V Pow2(V n) (2^n for integer n in [-126, 127]);
//   V ZeroWhereLess(V x, V lo, V y) (x < lo ? 0 : y);
//   M Ne(V, V); M NonFinite(V); M FromBits(uint32_t); uint32_t Bits(M);
//   M And(M, M); V Select(M, V a, V b) (m ? a : b);
//   float ReduceMax(V) (any order: the kernels never feed it -0 or NaN);
//   V SumTree16(const V acc[16]): lane i = canonical lane sum of acc[i].
//
// No include guard on purpose: this file must be included exactly once per
// translation unit, after the ISA definitions.

#include <cstddef>
#include <cstdint>

#include "core/cpu/kernels.h"

#if !defined(ATTN_KERNEL_NAMESPACE) || !defined(ATTN_KERNEL_NAME)
#error "define ATTN_KERNEL_NAMESPACE and ATTN_KERNEL_NAME first"
#endif

namespace attention::cpu::ATTN_KERNEL_NAMESPACE {

constexpr float kNegInfinity = -__builtin_inff();

// Locality hint of the kernels' prefetches of the next tile's rows: 2
// (prefetcht1) brings a line into L2 but not L1, so the rows in use stay
// in L1. On an Intel Xeon with AVX-512 the decode from memory ran faster
// with it than into L1 (prefetcht0), fp32 KV most (see README, "What
// limits it"); on AMD Zen 5 the two were the same.
constexpr int kPrefetchLocality = 2;

// ---- Scalar overloads of the operations the shared templates use --------

inline float Splat(float, float c) { return c; }
inline float Add(float a, float b) { return a + b; }
inline float Sub(float a, float b) { return a - b; }
inline float Mul(float a, float b) { return a * b; }
// __builtin_fmaf, not std::fma: an inline std:: function would be shared
// between translation units built with different flags.
inline float Fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
// std::max order: the first argument wins ties.
inline float Max(float a, float b) { return a < b ? b : a; }
inline float ZeroWhereLess(float x, float lo, float y) {
  return x < lo ? 0.0f : y;
}
inline float Pow2(float n) {
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127)
                        << 23;
  float result;
  __builtin_memcpy(&result, &bits, sizeof(result));
  return result;
}

// ---- Canonical exp -------------------------------------------------------

// e^x for x <= 0 (or -inf): Cody-Waite reduction x = n ln2 + r with
// |r| <= ln2 / 2, Cephes' degree-6 polynomial for e^r, scaled by 2^n.
// Results below FLT_MIN (x < ln(FLT_MIN)) are flushed to 0, so the kernels
// never see denormal probabilities. Within ~2 ulp of the true value.
template <class T>
inline T ExpNonPositive(T x) {
  const T lowest = Splat(x, -87.33654475f);  // ~ln(FLT_MIN)
  const T clamped = Max(x, lowest);          // keeps -inf out of the math
  // Adding 1.5 * 2^23 rounds x * log2(e) to the nearest integer.
  const T round = Splat(x, 12582912.0f);
  const T n = Sub(Fma(clamped, Splat(x, 1.44269504088896341f), round), round);
  // ln2 = 0.693359375 - 2.12194440e-4 (the first part exact in n * it).
  T r = Fma(n, Splat(x, -0.693359375f), clamped);
  r = Fma(n, Splat(x, 2.12194440e-4f), r);
  T p = Splat(x, 1.9875691500e-4f);
  p = Fma(p, r, Splat(x, 1.3981999507e-3f));
  p = Fma(p, r, Splat(x, 8.3334519073e-3f));
  p = Fma(p, r, Splat(x, 4.1665795894e-2f));
  p = Fma(p, r, Splat(x, 1.6666665459e-1f));
  p = Fma(p, r, Splat(x, 5.0000001201e-1f));
  T y = Add(Fma(p, Mul(r, r), r), Splat(x, 1.0f));
  y = Mul(y, Pow2(n));
  return ZeroWhereLess(x, lowest, y);
}

float ScalarExp(float x) { return ExpNonPositive(x); }

// ---- Conversions ---------------------------------------------------------

inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    __builtin_memcpy(&bits, &magnitude, sizeof(bits));
    bits |= sign;
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float result;
  __builtin_memcpy(&result, &bits, sizeof(result));
  return result;
}

inline float BFloat16BitsToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float result;
  __builtin_memcpy(&result, &bits, sizeof(result));
  return result;
}

void ConvertRows(ElementType type, const std::byte* const* src, int n, int dim,
                 int stride, float* dst) {
  for (int j = 0; j < n; ++j) {
    float* out = dst + static_cast<int64_t>(j) * stride;
    const std::byte* in = src[j];
    int d = 0;
    if (in == nullptr) {
      __builtin_memset(out, 0, sizeof(float) * stride);
      continue;
    }
    switch (type) {
      case ElementType::kFloat32: {
        const float* f = reinterpret_cast<const float*>(in);
        for (; d + kLanes <= dim; d += kLanes) Store(out + d, Load(f + d));
        __builtin_memcpy(out + d, f + d, sizeof(float) * (dim - d));
        break;
      }
      case ElementType::kFloat16: {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(in);
        for (; d + kLanes <= dim; d += kLanes) {
          Store(out + d, LoadHalf(h + d));
        }
        for (int e = d; e < dim; ++e) {
          uint16_t bits;
          __builtin_memcpy(&bits, h + e, sizeof(bits));
          out[e] = HalfBitsToFloat(bits);
        }
        break;
      }
      case ElementType::kBFloat16: {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(in);
        for (; d + kLanes <= dim; d += kLanes) {
          Store(out + d, LoadBf16(h + d));
        }
        for (int e = d; e < dim; ++e) {
          uint16_t bits;
          __builtin_memcpy(&bits, h + e, sizeof(bits));
          out[e] = BFloat16BitsToFloat(bits);
        }
        break;
      }
    }
    __builtin_memset(out + dim, 0, sizeof(float) * (stride - dim));
  }
}

// ---- Tile kernels --------------------------------------------------------

template <ElementType kType>
inline V LoadRow(const std::byte* row, int block) {
  if constexpr (kType == ElementType::kFloat32) {
    return Load(reinterpret_cast<const float*>(row) + block * kLanes);
  } else if constexpr (kType == ElementType::kFloat16) {
    return LoadHalf(reinterpret_cast<const uint16_t*>(row) + block * kLanes);
  } else {
    return LoadBf16(reinterpret_cast<const uint16_t*>(row) + block * kLanes);
  }
}

// Whole cache lines holding kBlocks blocks of a row of kType read in place,
// or 0 (unknown at compile time, or not a whole number of lines).
template <ElementType kType>
constexpr int RowLines(int blocks) {
  const int bytes =
      blocks * kLanes * (kType == ElementType::kFloat32 ? 4 : 2);
  return bytes > 0 && bytes % 64 == 0 ? bytes / 64 : 0;
}

// Keys whose dots one pass computes together with kHeads row-heads: as
// many as kDotAccumulators allows (a power of two dividing kLanes), so
// that short dot chains of few row-heads still overlap.
template <int kHeads>
constexpr int DotKeys() {
  int keys = 1;
  while (keys < kLanes && 2 * keys * kHeads <= kDotAccumulators) keys *= 2;
  return keys;
}

// acc[i][jj0 + k] = the 16 lanes of dot(q[i], key[k]) for k < kKeys:
// lane l accumulates elements d = l (mod 16) in increasing d from +0. Each
// key block is loaded and converted once for all kHeads row-heads, and each
// query block is loaded once for all kKeys keys.
// With `next` (kKeys rows of the next tile, nullptr entries skipped; only
// when kBlocks and the rows' kLines whole cache lines are known at compile
// time) the pass also prefetches those rows, a few lines per block: spread
// over the multiply-adds rather than in a burst after them, the requests
// find miss buffers free: in a burst they stalled the pass (on the Intel
// VMs the fp16 GQA decode reads 4-8 % more this way, see README).
template <ElementType kType, int kHeads, int kKeys, int kBlocks, int kLines = 0>
inline void KeyDots(const TileJob& job, const float* const* q,
                    const std::byte* const* key, V (*acc)[kLanes], int jj0,
                    const std::byte* const* next = nullptr) {
  const int blocks = kBlocks > 0 ? kBlocks : job.head_dim_padded / kLanes;
  V a[kHeads][kKeys];
#pragma GCC unroll 16
  for (int i = 0; i < kHeads; ++i) {
#pragma GCC unroll 16
    for (int k = 0; k < kKeys; ++k) a[i][k] = Zero();
  }
#pragma GCC unroll 8
  for (int b = 0; b < blocks; ++b) {
    V kb[kKeys];
#pragma GCC unroll 16
    for (int k = 0; k < kKeys; ++k) kb[k] = LoadRow<kType>(key[k], b);
    if constexpr (kBlocks > 0 && kLines > 0) {
      // Lines [b, b + 1) * kKeys * kLines / kBlocks of the next rows, in
      // line-major order (every row's first line, then every second line).
      if (next != nullptr) {
        // No unroll pragma: the bounds are constants once the loop over b
        // is unrolled, and GCC warns where it is not (-O1 sanitizer builds).
        constexpr int kTotal = kKeys * kLines;
        for (int p = b * kTotal / kBlocks; p < (b + 1) * kTotal / kBlocks;
             ++p) {
          if (const std::byte* row = next[p % kKeys]) {
            __builtin_prefetch(row + (p / kKeys) * 64, 0, kPrefetchLocality);
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < kHeads; ++i) {
      const V qb = Load(q[i] + b * kLanes);
#pragma GCC unroll 16
      for (int k = 0; k < kKeys; ++k) a[i][k] = Fma(qb, kb[k], a[i][k]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < kHeads; ++i) {
#pragma GCC unroll 16
    for (int k = 0; k < kKeys; ++k) acc[i][jj0 + k] = a[i][k];
  }
}

// out[i][j] = canonical dot(q of row-head rhs[i], k[j]) for j < n; entries
// [n, 32) of a half that holds keys are 0. kBlocks = head_dim_padded /
// kLanes when known at compile time, else 0.
template <ElementType kType, int kHeads, int kBlocks>
inline void JointDots(const TileJob& job, const int* rhs, float* out,
                      bool prefetch) {
  constexpr int kKeys = DotKeys<kHeads>();
  // Cache lines of one key row read in place, when known at compile time.
  constexpr int kKeyLines = RowLines<kType>(kBlocks);
  const float* q[kHeads];
  for (int i = 0; i < kHeads; ++i) {
    q[i] = job.q + static_cast<int64_t>(rhs[i]) * job.head_dim_padded;
  }
  for (int half = 0; half * kLanes < job.n; ++half) {
    V acc[kHeads][kLanes];
    for (int jj = 0; jj < kLanes; jj += kKeys) {
      const int j0 = half * kLanes + jj;
      // The next tile's rows j0.. ride on this pass (KeyDots) when it is a
      // whole pass over whole rows of kKeyLines lines, the usual case; else
      // the loop below prefetches them after it.
      const bool in_pass = kBlocks > 0 && kKeyLines > 0 && prefetch &&
                           j0 + kKeys <= job.n &&
                           j0 + kKeys <= job.prefetch_n &&
                           job.prefetch_key_bytes == kKeyLines * 64;
      if (j0 + kKeys <= job.n) {
        KeyDots<kType, kHeads, kKeys, kBlocks, kKeyLines>(
            job, q, job.k + j0, acc, jj,
            in_pass ? job.prefetch_k + j0 : nullptr);
      } else if (j0 < job.n) {
        // The tile's last keys, in one pass like the others (each dot is
        // computed on its own, so this changes no result): the slots past
        // the end repeat the last key, and their dots are then zeroed.
        const std::byte* key[kKeys];
        for (int k = 0; k < kKeys; ++k) {
          key[k] = job.k[j0 + k < job.n ? j0 + k : job.n - 1];
        }
        KeyDots<kType, kHeads, kKeys, kBlocks>(job, q, key, acc, jj);
        for (int k = job.n - j0; k < kKeys; ++k) {
          for (int i = 0; i < kHeads; ++i) acc[i][jj + k] = Zero();
        }
      } else {
        for (int k = 0; k < kKeys; ++k) {
          for (int i = 0; i < kHeads; ++i) acc[i][jj + k] = Zero();
        }
      }
      for (int j = j0;
           prefetch && !in_pass && j < j0 + kKeys && j < job.prefetch_n; ++j) {
        // Spread the next tile's key prefetches over this tile's dots (its
        // value prefetches over the P.V passes, see JointValues): the
        // memory system then sees a steady stream of requests. Keep this
        // code inline here: moved into a helper function that only
        // prefetches, GCC's IPA pure-const analysis deems the helper free
        // of side effects and deletes the calls.
        if (const std::byte* next = job.prefetch_k[j]) {
          if (kKeyLines > 0 && job.prefetch_key_bytes == kKeyLines * 64) {
#pragma GCC unroll 16
            for (int o = 0; o < kKeyLines * 64; o += 64) {
              __builtin_prefetch(next + o, 0, kPrefetchLocality);
            }
          } else {
            for (int o = 0; o < job.prefetch_key_bytes; o += 64) {
              __builtin_prefetch(next + o, 0, kPrefetchLocality);
            }
          }
        }
      }
    }
    for (int i = 0; i < kHeads; ++i) {
      Store(out + static_cast<int64_t>(rhs[i]) * kTileKeys + half * kLanes,
            SumTree16(acc[i]));
    }
  }
}

template <ElementType kType, int kBlocks>
inline void DotsFor(const TileJob& job, const int* rhs, int count) {
  int i = 0;
  for (; i + kDotHeads <= count; i += kDotHeads) {
    JointDots<kType, kDotHeads, kBlocks>(job, rhs + i, job.work, i == 0);
  }
  switch (count - i) {
    case 1:
      JointDots<kType, 1, kBlocks>(job, rhs + i, job.work, i == 0);
      break;
    case 2:
      if constexpr (kDotHeads > 2) {
        JointDots<kType, 2, kBlocks>(job, rhs + i, job.work, i == 0);
      }
      break;
    case 3:
      if constexpr (kDotHeads > 3) {
        JointDots<kType, 3, kBlocks>(job, rhs + i, job.work, i == 0);
      }
      break;
    default:
      break;
  }
}

// Dots of row-heads rhs[0, count) into job.work ([rh][kTileKeys]).
inline void Dots(const TileJob& job, const int* rhs, int count) {
  const int blocks = job.head_dim_padded / kLanes;
  switch (job.key_type) {
    case ElementType::kFloat32:
      if (blocks == 4)
        return DotsFor<ElementType::kFloat32, 4>(job, rhs, count);
      if (blocks == 8)
        return DotsFor<ElementType::kFloat32, 8>(job, rhs, count);
      return DotsFor<ElementType::kFloat32, 0>(job, rhs, count);
    case ElementType::kFloat16:
      if (blocks == 4)
        return DotsFor<ElementType::kFloat16, 4>(job, rhs, count);
      if (blocks == 8)
        return DotsFor<ElementType::kFloat16, 8>(job, rhs, count);
      return DotsFor<ElementType::kFloat16, 0>(job, rhs, count);
    case ElementType::kBFloat16:
      if (blocks == 4) {
        return DotsFor<ElementType::kBFloat16, 4>(job, rhs, count);
      }
      if (blocks == 8) {
        return DotsFor<ElementType::kBFloat16, 8>(job, rhs, count);
      }
      return DotsFor<ElementType::kBFloat16, 0>(job, rhs, count);
  }
}

// Scaled, biased and masked logits of row-head `rh` from its dots; -inf
// where invisible, for all 32 entries (`logits` may be `dots`). Checks that
// every visible logit is finite (before and after the bias, as the seeds
// do).
inline TileError MaskedLogits(const TileJob& job, int rh, uint32_t visible,
                              const float* dots, float* logits,
                              int* error_key) {
  const V scale = Splat(V{}, job.scale);
  const V zero = Zero();
  const V minus_inf = Splat(V{}, kNegInfinity);
  const float* bias = job.bias != nullptr ? job.bias[rh] : nullptr;
  int half = 0;
  for (; half * kLanes < job.n; ++half) {
    const int offset = half * kLanes;
    M vis = FromBits((visible >> offset) & 0xffffu);
    // + 0 turns -0 into +0 (see kernels.h).
    V s = Add(Mul(Load(dots + offset), scale), zero);
    uint32_t bad_logit;
    uint32_t bad_bias = 0;
    if (bias != nullptr) {
      const int count = job.n - offset < kLanes ? job.n - offset : kLanes;
      const V b = LoadN(bias + offset, count);
      vis = And(vis, Ne(b, minus_inf));
      bad_logit = Bits(And(vis, NonFinite(s)));
      s = Add(s, b);
      bad_bias = Bits(And(vis, NonFinite(s)));
    } else {
      bad_logit = Bits(And(vis, NonFinite(s)));
    }
    if ((bad_logit | bad_bias) != 0) {
      const int lane = __builtin_ctz(bad_logit | bad_bias);
      *error_key = offset + lane;
      return (bad_logit >> lane) & 1u ? TileError::kLogitOverflow
                                      : TileError::kBiasOverflow;
    }
    Store(logits + offset, Select(vis, s, minus_inf));
  }
  for (; half * kLanes < kTileKeys; ++half) {
    Store(logits + half * kLanes, minus_inf);
  }
  return TileError::kNone;
}

// Softmax part of the online update of row-head rh from its masked logits:
// m and alpha; the probabilities replace the logits (l is updated with the
// values, JointValues). False when the row-head sees no key of the tile (its
// state then stays as it is).
inline bool UpdateMaximum(const TileJob& job, int rh, float* logits) {
  const V l0 = Load(logits);
  const V l1 = Load(logits + kLanes);
  // One reduction of both halves: a maximum is the same in any order.
  const float tile_max = ReduceMax(Max(l0, l1));
  if (tile_max == kNegInfinity) return false;
  const float m_old = job.m[rh];
  const float m_new = Max(m_old, tile_max);
  const float alpha =
      m_old == kNegInfinity ? 0.0f : ExpNonPositive(Sub(m_old, m_new));
  const V m_splat = Splat(V{}, m_new);
  Store(logits, ExpNonPositive(Sub(l0, m_splat)));
  Store(logits + kLanes, ExpNonPositive(Sub(l1, m_splat)));
  job.m[rh] = m_new;
  job.alpha[rh] = alpha;
  return true;
}

// Value blocks one P.V pass accumulates for kHeads row-heads: as many as
// kPvAccumulators allows (a power of two).
template <int kHeads>
constexpr int PvBlocks() {
  int blocks = 1;
  while (2 * blocks * kHeads <= kPvAccumulators) blocks *= 2;
  return blocks;
}

// acc[rh][d0, d0 + kBlocks * kLanes) = fma(alpha, acc, sum_j p_j v_j) for
// the kHeads row-heads rhs[]: each value block is loaded and converted once
// for all of them. p_j v_j for an invisible key is +-0, which can change
// only the sign of a zero sum (visible products that underflowed to -0,
// then +0 * v): so the sum is taken + +0 (a zero becomes +0, nothing else
// changes) before it meets acc, and a row's output does not depend on which
// invisible keys share its tiles (later rows of the call, rows padding a
// window). With kSumP the pass also sets
// l = fma(alpha, l, sum_j p_j), the p_j added in key order one at a time
// from +0 (invisible keys add +0: exact), riding on the P.V loop.
template <ElementType kType, int kHeads, int kBlocks, bool kSumP>
inline void JointValues(const TileJob& job, const int* rhs, int d0,
                        bool prefetch) {
  const float* p[kHeads];
  for (int i = 0; i < kHeads; ++i) {
    p[i] = job.work + static_cast<int64_t>(rhs[i]) * kTileKeys;
  }
  V pv[kHeads][kBlocks];
  float p_sum[kHeads];
#pragma GCC unroll 16
  for (int i = 0; i < kHeads; ++i) {
    p_sum[i] = 0.0f;
#pragma GCC unroll 16
    for (int b = 0; b < kBlocks; ++b) pv[i][b] = Zero();
  }
  const int first_block = d0 / kLanes;
  // Rows of the next tile this pass prefetches from.
  const int prefetch_n = prefetch ? job.prefetch_n : 0;
  // Bytes [prefetch_lo, prefetch_hi) of a row hold value blocks
  // [first_block, first_block + kBlocks), rounded out to cache lines.
  int prefetch_lo = 0;
  int prefetch_hi = 0;
  if (prefetch_n > 0) {
    prefetch_lo =
        job.prefetch_value_bytes * d0 / job.value_dim_padded / 64 * 64;
    prefetch_hi = job.prefetch_value_bytes * (d0 + kBlocks * kLanes) /
                  job.value_dim_padded;
  }
  // The common case, rows read in place whose pass covers whole lines.
  constexpr int kValueLines = RowLines<kType>(kBlocks);
  const bool whole_lines =
      kValueLines > 0 && prefetch_hi - prefetch_lo == kValueLines * 64;
  for (int j = 0; j < job.n; ++j) {
    const std::byte* row = job.v[j];
    V vb[kBlocks];
#pragma GCC unroll 16
    for (int b = 0; b < kBlocks; ++b) {
      vb[b] = LoadRow<kType>(row, first_block + b);
    }
    // The next tile's value rows (inline: see JointDots).
    if (j < prefetch_n) {
      if (const std::byte* next = job.prefetch_v[j]) {
        if (whole_lines) {
#pragma GCC unroll 16
          for (int o = 0; o < kValueLines * 64; o += 64) {
            __builtin_prefetch(next + prefetch_lo + o, 0, kPrefetchLocality);
          }
        } else {
          for (int o = prefetch_lo; o < prefetch_hi; o += 64) {
            __builtin_prefetch(next + o, 0, kPrefetchLocality);
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < kHeads; ++i) {
      if constexpr (kSumP) p_sum[i] = Add(p_sum[i], p[i][j]);
      const V pj = Splat(V{}, p[i][j]);
#pragma GCC unroll 16
      for (int b = 0; b < kBlocks; ++b) pv[i][b] = Fma(pj, vb[b], pv[i][b]);
    }
  }
  // Unrolled so that the partial sums stay in registers.
#pragma GCC unroll 16
  for (int i = 0; i < kHeads; ++i) {
    const int rh = rhs[i];
    float* acc = job.acc + static_cast<int64_t>(rh) * job.value_dim_padded + d0;
    const V alpha = Splat(V{}, job.alpha[rh]);
#pragma GCC unroll 16
    for (int b = 0; b < kBlocks; ++b) {
      Store(acc + b * kLanes,
            Fma(alpha, Load(acc + b * kLanes), Add(pv[i][b], Zero())));
    }
    if constexpr (kSumP) job.l[rh] = Fma(job.alpha[rh], job.l[rh], p_sum[i]);
  }
}

// P.V passes of kBlocks value blocks from *d0 while they fit, then of
// halves of that. The pass at d0 = 0 also updates l; each pass prefetches
// its part of the next tile's values when asked to.
template <ElementType kType, int kHeads, int kBlocks>
inline void ValuePasses(const TileJob& job, const int* rhs, int* d0,
                        bool prefetch) {
  for (; *d0 + kBlocks * kLanes <= job.value_dim_padded;
       *d0 += kBlocks * kLanes) {
    if (*d0 == 0) {
      JointValues<kType, kHeads, kBlocks, true>(job, rhs, 0, prefetch);
    } else {
      JointValues<kType, kHeads, kBlocks, false>(job, rhs, *d0, prefetch);
    }
  }
  if constexpr (kBlocks > 1) {
    ValuePasses<kType, kHeads, kBlocks / 2>(job, rhs, d0, prefetch);
  }
}

template <ElementType kType, int kHeads>
inline void ValuesForHeads(const TileJob& job, const int* rhs, bool prefetch) {
  int d0 = 0;
  ValuePasses<kType, kHeads, PvBlocks<kHeads>()>(job, rhs, &d0, prefetch);
}

template <ElementType kType>
inline void ValuesFor(const TileJob& job, const int* rhs, int count) {
  int i = 0;
  for (; i + kPvHeads <= count; i += kPvHeads) {
    ValuesForHeads<kType, kPvHeads>(job, rhs + i, i == 0);
  }
  switch (count - i) {
    case 1:
      ValuesForHeads<kType, 1>(job, rhs + i, i == 0);
      break;
    case 2:
      if constexpr (kPvHeads > 2) {
        ValuesForHeads<kType, 2>(job, rhs + i, i == 0);
      }
      break;
    case 3:
      if constexpr (kPvHeads > 3) {
        ValuesForHeads<kType, 3>(job, rhs + i, i == 0);
      }
      break;
    default:
      break;
  }
}

inline void Values(const TileJob& job, const int* rhs, int count) {
  switch (job.value_type) {
    case ElementType::kFloat32:
      return ValuesFor<ElementType::kFloat32>(job, rhs, count);
    case ElementType::kFloat16:
      return ValuesFor<ElementType::kFloat16>(job, rhs, count);
    case ElementType::kBFloat16:
      return ValuesFor<ElementType::kBFloat16>(job, rhs, count);
  }
}

TileError UpdateTile(TileJob* job) {
  // Row-heads of rows that see a key of the tile, in order.
  int* rhs = job->active;
  int count = 0;
  for (int r = 0; r < job->rows; ++r) {
    if (job->visible[r] == 0) continue;
    for (int h = 0; h < job->group; ++h) rhs[count++] = r * job->group + h;
  }
  Dots(*job, rhs, count);
  // Logits in row-head order, so the first error is the first in the
  // canonical processing order. They replace the dots in place.
  for (int i = 0; i < count; ++i) {
    const int rh = rhs[i];
    float* logits = job->work + static_cast<int64_t>(rh) * kTileKeys;
    int key = -1;
    const TileError error = MaskedLogits(
        *job, rh, job->visible[rh / job->group], logits, logits, &key);
    if (error != TileError::kNone) {
      job->error_row_head = rh;
      job->error_key = key;
      return error;
    }
  }
  // Then the softmax statistics, in a loop of their own so that the
  // row-heads' chains of dependent steps overlap; keep the row-heads that
  // see a key.
  int active = 0;
  for (int i = 0; i < count; ++i) {
    const int rh = rhs[i];
    float* probabilities = job->work + static_cast<int64_t>(rh) * kTileKeys;
    if (UpdateMaximum(*job, rh, probabilities)) rhs[active++] = rh;
  }
  Values(*job, rhs, active);
  return TileError::kNone;
}

TileError TileLogits(TileJob* job, int rh, float* logits) {
  alignas(64) float all[kTileKeys];
  Dots(*job, &rh, 1);
  int key = -1;
  const TileError error =
      MaskedLogits(*job, rh, job->visible[rh / job->group],
                   job->work + static_cast<int64_t>(rh) * kTileKeys, all, &key);
  if (error != TileError::kNone) {
    job->error_row_head = rh;
    job->error_key = key;
    return error;
  }
  __builtin_memcpy(logits, all, sizeof(float) * job->n);
  return TileError::kNone;
}

void TileWeights(const float* logits, int n, float m, float l, float* weights) {
  alignas(64) float in[kTileKeys];
  alignas(64) float out[kTileKeys];
  __builtin_memcpy(in, logits, sizeof(float) * n);
  for (int j = n; j < kTileKeys; ++j) in[j] = kNegInfinity;
  const V m_splat = Splat(V{}, m);
  const V l_splat = Splat(V{}, l);
  for (int half = 0; half < kTileKeys / kLanes; ++half) {
    const V e = ExpNonPositive(Sub(Load(in + half * kLanes), m_splat));
    Store(out + half * kLanes, Div(e, l_splat));
  }
  for (int j = 0; j < n; ++j) {
    if (in[j] != kNegInfinity) weights[j] = out[j];
  }
}

void MergeState(float* a_m, float* a_l, float* a_acc, float b_m, float b_l,
                const float* b_acc, int value_dim_padded) {
  if (*a_m == kNegInfinity) {
    // Empty row state: the merge is a copy.
    *a_m = b_m;
    *a_l = b_l;
    __builtin_memcpy(a_acc, b_acc, sizeof(float) * value_dim_padded);
    return;
  }
  const float m = Max(*a_m, b_m);
  const float ca = ExpNonPositive(Sub(*a_m, m));
  const float cb = ExpNonPositive(Sub(b_m, m));
  *a_l = Fma(*a_l, ca, Mul(b_l, cb));
  const V ca_splat = Splat(V{}, ca);
  const V cb_splat = Splat(V{}, cb);
  for (int d = 0; d < value_dim_padded; d += kLanes) {
    Store(a_acc + d,
          Fma(Load(a_acc + d), ca_splat, Mul(Load(b_acc + d), cb_splat)));
  }
  *a_m = m;
}

bool DivideRow(const float* acc, float divisor, int n, float* out) {
  const V d = Splat(V{}, divisor);
  uint32_t non_finite = 0;
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const V quotient = Div(Load(acc + i), d);
    non_finite |= Bits(NonFinite(quotient));
    Store(out + i, quotient);
  }
  for (; i < n; ++i) {
    out[i] = acc[i] / divisor;
    if (!__builtin_isfinite(out[i])) non_finite = 1;
  }
  return non_finite == 0;
}

// Chains of a multiply-add latency each; kFmaProbeChains covers the
// latency times the units of the processors the ISA file targets.
float FmaProbe(int64_t rounds) {
  V chain[kFmaProbeChains];
  for (int i = 0; i < kFmaProbeChains; ++i) {
    chain[i] = Splat(V{}, 0.5f + 0.01f * static_cast<float>(i));
  }
  // Converges to 1: no overflow, no denormals.
  const V x = Splat(V{}, 0.999f);
  const V y = Splat(V{}, 0.001f);
  for (int64_t r = 0; r < rounds; ++r) {
#pragma GCC unroll 32
    for (int i = 0; i < kFmaProbeChains; ++i) chain[i] = Fma(chain[i], x, y);
  }
  V sum = chain[0];
  for (int i = 1; i < kFmaProbeChains; ++i) sum = Add(sum, chain[i]);
  alignas(64) float lanes[kLanes];
  Store(lanes, sum);
  float total = 0.0f;
  for (float lane : lanes) total += lane;
  return total;
}

// FmaProbe's chains, in groups of kWidenProbeHeads fed by one float16
// vector widened from L1 per round. The halves' address passes through an
// empty asm statement every round, so the compiler cannot hoist their
// loads and widenings out of the loop.
constexpr int kWidenProbeHeads = 4;
constexpr int kWidenProbeVectors = kFmaProbeChains / kWidenProbeHeads > 0
                                       ? kFmaProbeChains / kWidenProbeHeads
                                       : 1;
float FmaWidenProbe(int64_t rounds) {
  // 0x3BFE is 0.99902 in float16: the chains converge, as FmaProbe's do.
  alignas(64) uint16_t halves[kWidenProbeVectors * kLanes];
  for (uint16_t& h : halves) h = 0x3BFE;
  V chain[kWidenProbeVectors][kWidenProbeHeads];
  for (int v = 0; v < kWidenProbeVectors; ++v) {
    for (int h = 0; h < kWidenProbeHeads; ++h) {
      chain[v][h] = Splat(V{}, 0.5f + 0.01f * static_cast<float>(v * 4 + h));
    }
  }
  const V y = Splat(V{}, 0.001f);
  const uint16_t* from = halves;
  for (int64_t r = 0; r < rounds; ++r) {
    asm volatile("" : "+r"(from));
#pragma GCC unroll 8
    for (int v = 0; v < kWidenProbeVectors; ++v) {
      const V w = LoadHalf(from + v * kLanes);
#pragma GCC unroll 4
      for (int h = 0; h < kWidenProbeHeads; ++h) {
        chain[v][h] = Fma(chain[v][h], w, y);
      }
    }
  }
  V sum = Zero();
  for (const auto& group : chain) {
    for (const V& c : group) sum = Add(sum, c);
  }
  alignas(64) float lanes[kLanes];
  Store(lanes, sum);
  float total = 0.0f;
  for (float lane : lanes) total += lane;
  return total;
}

// Eight vectors of running maxima per iteration: a whole 512-byte stretch
// in flight per loop turn on AVX-512.
float ReadProbe(const float* data, int64_t count) {
  constexpr int kChains = 8;
  const float lowest = -__builtin_inff();
  V chain[kChains];
  for (int i = 0; i < kChains; ++i) chain[i] = Splat(V{}, lowest);
  int64_t i = 0;
  for (; i + kChains * kLanes <= count; i += kChains * kLanes) {
#pragma GCC unroll 8
    for (int c = 0; c < kChains; ++c) {
      chain[c] = Max(chain[c], Load(data + i + c * kLanes));
    }
  }
  for (; i + kLanes <= count; i += kLanes) {
    chain[0] = Max(chain[0], Load(data + i));
  }
  float result = lowest;
  for (; i < count; ++i) result = Max(result, data[i]);
  for (int c = 0; c < kChains; ++c) result = Max(result, ReduceMax(chain[c]));
  return result;
}

// Floating-point operations of one round of each probe (a multiply-add
// counts 2).
constexpr int kFmaProbeFlops = kFmaProbeChains * kLanes * 2;
constexpr int kFmaWidenProbeFlops =
    kWidenProbeVectors * kWidenProbeHeads * kLanes * 2;

constexpr KernelTable kKernelTable = {
    ATTN_KERNEL_NAME, &ConvertRows,   &UpdateTile,    &TileLogits,
    &TileWeights,     &MergeState,    &DivideRow,     &ScalarExp,
    &FmaProbe,        kFmaProbeFlops, &FmaWidenProbe, kFmaWidenProbeFlops,
    &ReadProbe,
};

}  // namespace attention::cpu::ATTN_KERNEL_NAMESPACE
