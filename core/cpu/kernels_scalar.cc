// The portable kernels: the 16-lane vector type is a plain array, so this
// file is the reference the AVX2 and AVX-512 instantiations must match
// bitwise. Built without instruction-set flags; its fused multiply-adds are
// library fmaf calls, correct (if slow) on any processor.
#include <cstdint>

#include "core/cpu/kernels.h"

#define ATTN_KERNEL_NAMESPACE scalar_kernels
#define ATTN_KERNEL_NAME "scalar"

namespace attention::cpu::scalar_kernels {

struct V {
  float lane[kLanes];
};
struct M {
  uint32_t bits;
};

// Register blocking (no registers here, but the same loop structure).
constexpr int kDotHeads = 4;
constexpr int kDotAccumulators = 4;
constexpr int kPvHeads = 4;
constexpr int kPvAccumulators = 8;
constexpr int kFmaProbeChains = 4;

inline V Zero() {
  V r;
  for (float& x : r.lane) x = 0.0f;
  return r;
}
inline V Splat(V, float c) {
  V r;
  for (float& x : r.lane) x = c;
  return r;
}
inline V Load(const float* p) {
  V r;
  __builtin_memcpy(r.lane, p, sizeof(r.lane));
  return r;
}
inline V LoadN(const float* p, int n) {
  V r = Zero();
  __builtin_memcpy(r.lane, p, sizeof(float) * n);
  return r;
}
inline void Store(float* p, V a) {
  __builtin_memcpy(p, a.lane, sizeof(a.lane));
}

inline float HalfBitsToFloat(uint16_t h);
inline float BFloat16BitsToFloat(uint16_t h);

inline V LoadHalf(const uint16_t* p) {
  V r;
  for (int l = 0; l < kLanes; ++l) {
    uint16_t bits;
    __builtin_memcpy(&bits, p + l, sizeof(bits));
    r.lane[l] = HalfBitsToFloat(bits);
  }
  return r;
}
inline V LoadBf16(const uint16_t* p) {
  V r;
  for (int l = 0; l < kLanes; ++l) {
    uint16_t bits;
    __builtin_memcpy(&bits, p + l, sizeof(bits));
    r.lane[l] = BFloat16BitsToFloat(bits);
  }
  return r;
}

#define ATTN_SCALAR_BINARY(name, expr)          \
  inline V name(V a, V b) {                     \
    V r;                                        \
    for (int l = 0; l < kLanes; ++l) {          \
      const float x = a.lane[l], y = b.lane[l]; \
      r.lane[l] = (expr);                       \
    }                                           \
    return r;                                   \
  }
ATTN_SCALAR_BINARY(Add, x + y)
ATTN_SCALAR_BINARY(Sub, x - y)
ATTN_SCALAR_BINARY(Mul, x* y)
ATTN_SCALAR_BINARY(Div, x / y)
ATTN_SCALAR_BINARY(Max, x < y ? y : x)
#undef ATTN_SCALAR_BINARY

inline V Fma(V a, V b, V c) {
  V r;
  for (int l = 0; l < kLanes; ++l) {
    r.lane[l] = __builtin_fmaf(a.lane[l], b.lane[l], c.lane[l]);
  }
  return r;
}
inline V Pow2(V n) {
  V r;
  for (int l = 0; l < kLanes; ++l) {
    const uint32_t bits =
        static_cast<uint32_t>(static_cast<int32_t>(n.lane[l]) + 127) << 23;
    __builtin_memcpy(&r.lane[l], &bits, sizeof(bits));
  }
  return r;
}
inline V ZeroWhereLess(V x, V lo, V y) {
  V r;
  for (int l = 0; l < kLanes; ++l) {
    r.lane[l] = x.lane[l] < lo.lane[l] ? 0.0f : y.lane[l];
  }
  return r;
}
inline M Ne(V a, V b) {
  M m{0};
  for (int l = 0; l < kLanes; ++l) {
    if (a.lane[l] != b.lane[l]) m.bits |= 1u << l;
  }
  return m;
}
inline M NonFinite(V a) {
  M m{0};
  for (int l = 0; l < kLanes; ++l) {
    const float x = a.lane[l];
    if (!(x - x == 0.0f)) m.bits |= 1u << l;  // inf - inf and NaN are NaN
  }
  return m;
}
inline M FromBits(uint32_t bits) { return M{bits & 0xffffu}; }
inline uint32_t Bits(M m) { return m.bits; }
inline M And(M a, M b) { return M{a.bits & b.bits}; }
inline V Select(M m, V a, V b) {
  V r;
  for (int l = 0; l < kLanes; ++l) {
    r.lane[l] = (m.bits >> l) & 1u ? a.lane[l] : b.lane[l];
  }
  return r;
}
inline float ReduceMax(V a) {
  float m = a.lane[0];
  for (int l = 1; l < kLanes; ++l) m = m < a.lane[l] ? a.lane[l] : m;
  return m;
}
inline V SumTree16(const V* acc) {
  V r;
  for (int i = 0; i < kLanes; ++i) {
    float lanes[kLanes];
    __builtin_memcpy(lanes, acc[i].lane, sizeof(lanes));
    for (int width = kLanes / 2; width > 0; width /= 2) {
      for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    }
    r.lane[i] = lanes[0];
  }
  return r;
}

}  // namespace attention::cpu::scalar_kernels

#include "core/cpu/kernels_impl.h"

namespace attention::cpu {

const KernelTable* ScalarKernels() { return &scalar_kernels::kKernelTable; }

// Builds without the AVX kernel files (non-x86, or a compiler lacking the
// flags) still link; CpuIsaSupported() never selects these.
#if !defined(ATTN_CPU_HAVE_AVX2)
const KernelTable* Avx2Kernels() { return nullptr; }
#endif
#if !defined(ATTN_CPU_HAVE_AVX512)
const KernelTable* Avx512Kernels() { return nullptr; }
#endif

}  // namespace attention::cpu
