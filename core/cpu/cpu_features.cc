#include "core/cpu/cpu_features.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/cpu_has_f16c.h"

namespace attention {

absl::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return "scalar";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

absl::StatusOr<CpuIsa> ParseCpuIsa(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (lower == CpuIsaName(isa)) return isa;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown CPU instruction set '", name, "'; use scalar, avx2 or avx512"));
}

bool CpuIsaSupported(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return true;
    case CpuIsa::kAvx2:
#if defined(ATTN_CPU_HAVE_AVX2)
      // __builtin_cpu_supports also checks that the OS saves the YMM state.
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             CpuHasF16c();
#else
      return false;
#endif
    case CpuIsa::kAvx512:
#if defined(ATTN_CPU_HAVE_AVX512)
      // The AVX-512 kernels also use F16C/FMA (always present with AVX-512F
      // in practice, checked anyway).
      return __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma") && CpuHasF16c();
#else
      return false;
#endif
  }
  return false;
}

CpuIsa BestCpuIsa() {
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2}) {
    if (CpuIsaSupported(isa)) return isa;
  }
  return CpuIsa::kScalar;
}

CpuIsa DefaultCpuIsa(std::string* warning) {
  if (warning != nullptr) warning->clear();
  const CpuIsa best = BestCpuIsa();
  const char* env = std::getenv("ATTN_CPU_ISA");
  if (env == nullptr || *env == '\0' || absl::AsciiStrToLower(env) == "auto") {
    return best;
  }
  absl::StatusOr<CpuIsa> requested = ParseCpuIsa(env);
  if (!requested.ok()) {
    if (warning != nullptr) {
      *warning = absl::StrCat("ATTN_CPU_ISA=", env,
                              " is not scalar, avx2, avx512 or auto; using ",
                              CpuIsaName(best));
    }
    return best;
  }
  if (!CpuIsaSupported(*requested)) {
    if (warning != nullptr) {
      *warning = absl::StrCat("ATTN_CPU_ISA=", env,
                              " is not supported by this processor or build; "
                              "using ",
                              CpuIsaName(best));
    }
    return best;
  }
  return *requested;
}

std::string CpuModelName() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    absl::string_view view(line);
    if (absl::ConsumePrefix(&view, "model name")) {
      const size_t colon = view.find(':');
      if (colon == absl::string_view::npos) continue;
      view.remove_prefix(colon + 1);
      view = absl::StripAsciiWhitespace(view);
      if (!view.empty()) return std::string(view);
    }
  }
  return "unknown CPU";
}

}  // namespace attention
