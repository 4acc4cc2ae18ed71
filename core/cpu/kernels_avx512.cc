// The AVX-512 kernels: one 16-lane vector is one zmm register. Built with
// -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c; only called
// after CpuIsaSupported(kAvx512). bfloat16 rows are widened exactly by a
// shift; the AVX512-BF16 dot-product instructions are deliberately not used
// because they round pairs of products differently from the canonical
// lane-wise FMA order (and flush denormals), which would break bitwise
// equality with the other paths.
// GCC 12 reports its own `__Y = __Y` idiom inside the AVX-512 intrinsic
// headers as uninitialized (GCC bug 105593); silence it for those headers
// only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>

#include "core/cpu/kernels.h"

#define ATTN_KERNEL_NAMESPACE avx512_kernels
#define ATTN_KERNEL_NAME "avx512"

namespace attention::cpu::avx512_kernels {

struct V {
  __m512 x;
};
struct M {
  __mmask16 k;
};

// Register blocking: up to kDotHeads row-heads share each key load, and
// row-heads x keys of one Q.K pass use up to kDotAccumulators zmm
// accumulators; up to kPvHeads row-heads share each value load, and
// row-heads x value blocks of one P.V pass use up to kPvAccumulators.
constexpr int kDotHeads = 4;
constexpr int kDotAccumulators = 16;
constexpr int kPvHeads = 4;
constexpr int kPvAccumulators = 16;
// Independent chains of the multiply-add probe: 2 units x 4 cycles of
// latency need 8; 16 leave room for longer latencies.
constexpr int kFmaProbeChains = 16;

inline V Zero() { return V{_mm512_setzero_ps()}; }
inline V Splat(V, float c) { return V{_mm512_set1_ps(c)}; }
inline V Load(const float* p) { return V{_mm512_loadu_ps(p)}; }
inline V LoadN(const float* p, int n) {
  const __mmask16 k = static_cast<__mmask16>((1u << n) - 1u);
  return V{_mm512_maskz_loadu_ps(k, p)};
}
inline void Store(float* p, V a) { _mm512_storeu_ps(p, a.x); }
inline V LoadHalf(const uint16_t* p) {
  return V{
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline V LoadBf16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return V{_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
inline V Add(V a, V b) { return V{_mm512_add_ps(a.x, b.x)}; }
inline V Sub(V a, V b) { return V{_mm512_sub_ps(a.x, b.x)}; }
inline V Mul(V a, V b) { return V{_mm512_mul_ps(a.x, b.x)}; }
inline V Div(V a, V b) { return V{_mm512_div_ps(a.x, b.x)}; }
inline V Max(V a, V b) { return V{_mm512_max_ps(a.x, b.x)}; }
inline V Fma(V a, V b, V c) { return V{_mm512_fmadd_ps(a.x, b.x, c.x)}; }
inline V Pow2(V n) {
  const __m512i e =
      _mm512_add_epi32(_mm512_cvttps_epi32(n.x), _mm512_set1_epi32(127));
  return V{_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
}
inline V ZeroWhereLess(V x, V lo, V y) {
  const __mmask16 less = _mm512_cmp_ps_mask(x.x, lo.x, _CMP_LT_OQ);
  return V{_mm512_maskz_mov_ps(static_cast<__mmask16>(~less), y.x)};
}
inline M Ne(V a, V b) { return M{_mm512_cmp_ps_mask(a.x, b.x, _CMP_NEQ_UQ)}; }
inline M NonFinite(V a) {
  return M{_mm512_cmp_ps_mask(_mm512_abs_ps(a.x),
                              _mm512_set1_ps(__builtin_inff()), _CMP_NLT_UQ)};
}
inline M FromBits(uint32_t bits) { return M{static_cast<__mmask16>(bits)}; }
inline uint32_t Bits(M m) { return static_cast<uint32_t>(m.k); }
inline M And(M a, M b) { return M{static_cast<__mmask16>(a.k & b.k)}; }
inline V Select(M m, V a, V b) {
  return V{_mm512_mask_blend_ps(m.k, b.x, a.x)};
}
inline float ReduceMax(V a) { return _mm512_reduce_max_ps(a.x); }

// Sixteen canonical lane sums at once: each stage adds lane l and lane
// l + width of the same input, exactly the pairing of the scalar tree (an
// addition is commutative, so which operand is which does not matter).
// Lane-crossing shuffles compete with the multiply-adds for execution
// ports on some processors, so each pair of vectors in the two stages that
// cross 128-bit lanes takes one shuffle plus blends (which run anywhere),
// and the inputs are taken in the order that leaves input i in lane i.
inline V SumTree16(const V* acc) {
  // in[4 t + u']: the input whose sum ends up in lane 4 u + t, where
  // u' = (0, 2, 1, 3)[u] (see the stages below).
  constexpr int in[16] = {0, 8, 4, 12, 1, 9, 5, 13, 2, 10, 6, 14, 3, 11, 7, 15};
  // Width 8: s8[i] = [x.lo8 + x.hi8 | y.lo8 + y.hi8] for x, y = inputs
  // in[2i], in[2i + 1]: [x.q2, x.q3, y.q0, y.q1] + [x.q0, x.q1, y.q2, y.q3]
  // (q: 128-bit quarters).
  __m512 s8[8];
#pragma GCC unroll 16
  for (int i = 0; i < 8; ++i) {
    const __m512 x = acc[in[2 * i]].x, y = acc[in[2 * i + 1]].x;
    s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 3, 2)),
                          _mm512_mask_blend_ps(0xff00, x, y));
  }
  // Width 4: a = s8[2i] = [a0 a1 | a2 a3], b = s8[2i + 1] (quarters; a0 a1
  // hold one input's 8 partial lanes, a2 a3 another's). s4[i] =
  // [a1 b0 a3 b2] + [a0 b1 a2 b3]: each quarter one input's 4 partial lanes,
  // inputs in[4i], in[4i + 2], in[4i + 1], in[4i + 3].
  __m512 s4[4];
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) {
    const __m512 a = s8[2 * i], b = s8[2 * i + 1];
    const __m512 b0a1b2a3 = _mm512_mask_blend_ps(0xf0f0, b, a);
    s4[i] = _mm512_add_ps(
        _mm512_shuffle_f32x4(b0a1b2a3, b0a1b2a3, _MM_SHUFFLE(2, 3, 0, 1)),
        _mm512_mask_blend_ps(0xf0f0, a, b));
  }
  // Width 2 and 1 inside each quarter: lane 4 u + t of s1 is quarter u of
  // s4[t].
  __m512 s2[2];
#pragma GCC unroll 16
  for (int i = 0; i < 2; ++i) {
    const __m512 a = s4[2 * i], b = s4[2 * i + 1];
    s2[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return V{
      _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                    _mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)))};
}

}  // namespace attention::cpu::avx512_kernels

#include "core/cpu/kernels_impl.h"

namespace attention::cpu {

const KernelTable* Avx512Kernels() { return &avx512_kernels::kKernelTable; }

}  // namespace attention::cpu
