// CPU instruction-set detection and the choice of attention kernels.
//
// The CPU backend carries one kernel implementation per instruction set
// (portable scalar, AVX2+FMA+F16C, AVX-512) compiled from the same source,
// so all of them give bitwise identical results; the fastest one the
// processor supports is picked at run time. The environment variable
// ATTN_CPU_ISA (scalar|avx2|avx512|auto) overrides the choice for tests and
// benchmarks.
#ifndef ATTENTION_CORE_CPU_CPU_FEATURES_H_
#define ATTENTION_CORE_CPU_CPU_FEATURES_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attention {

// Kernel instruction sets, slowest first.
enum class CpuIsa {
  kScalar,  // portable C++; the reference every other path must match
  kAvx2,    // AVX2 + FMA + F16C
  kAvx512,  // AVX-512 F/BW/VL/DQ
};

// "scalar", "avx2" or "avx512".
absl::string_view CpuIsaName(CpuIsa isa);

// Inverse of CpuIsaName. INVALID_ARGUMENT for any other name.
absl::StatusOr<CpuIsa> ParseCpuIsa(absl::string_view name);

// True when this build contains kernels for `isa` and the processor (and
// operating system) can run them.
bool CpuIsaSupported(CpuIsa isa);

// The fastest supported instruction set.
CpuIsa BestCpuIsa();

// The instruction set a CpuBackend uses by default: ATTN_CPU_ISA when set
// (and supported), else BestCpuIsa(). When ATTN_CPU_ISA names an unknown or
// unsupported instruction set, `*warning` (if not null) explains the
// fallback; it is left empty otherwise.
CpuIsa DefaultCpuIsa(std::string* warning);

// The processor's model name from /proc/cpuinfo, or "unknown CPU".
std::string CpuModelName();

}  // namespace attention

#endif  // ATTENTION_CORE_CPU_CPU_FEATURES_H_
