// CpuHasF16c: whether the CPU has the F16C half-precision conversions.
// __builtin_cpu_supports("f16c") needs GCC or clang >= 16; Debian's clang 14
// (the fuzz build) rejects it, so CPUID leaf 1 is read directly (ECX bit
// 29). x86-64 only. Callers also check AVX2/AVX-512 through
// __builtin_cpu_supports, which covers the OS saving the YMM state.
#ifndef ATTENTION_CORE_CPU_HAS_F16C_H_
#define ATTENTION_CORE_CPU_HAS_F16C_H_

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>

namespace attention {

inline bool CpuHasF16c() {
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

}  // namespace attention

#endif  // __x86_64__ && __GNUC__
#endif  // ATTENTION_CORE_CPU_HAS_F16C_H_
