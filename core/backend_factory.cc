#include "core/backend_factory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/cpu/cpu_backend.h"

#ifdef ATTN_HAVE_CUDA
#include "core/cuda/cuda_backend_factory.h"
#endif

namespace attention {
namespace {

std::unique_ptr<AttentionBackend> MakeCpu(const BackendOptions& options) {
  return std::make_unique<CpuBackend>(options.threads, options.cpu_spin);
}

}  // namespace

bool CudaBackendCompiled() {
#ifdef ATTN_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

absl::StatusOr<BackendChoice> CreateBackend(const BackendOptions& options) {
  BackendChoice choice;
  if (options.kind == "cpu") {
    choice.backend = MakeCpu(options);
    choice.reason = "cpu requested";
    return choice;
  }
  if (options.kind == "cuda") {
#ifdef ATTN_HAVE_CUDA
    absl::StatusOr<std::unique_ptr<AttentionBackend>> cuda =
        CreateCudaBackend();
    if (!cuda.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "cuda backend requested but no CUDA device is usable: ",
          cuda.status().message(), "; use --backend=cpu or --backend=auto"));
    }
    choice.backend = *std::move(cuda);
    choice.reason = "cuda requested";
    return choice;
#else
    return absl::UnavailableError(
        "cuda backend requested but this build has no CUDA backend (built "
        "without nvcc); use --backend=cpu or --backend=auto, or rebuild with "
        "-DATTN_CUDA=ON");
#endif
  }
  if (options.kind == "auto") {
#ifdef ATTN_HAVE_CUDA
    absl::StatusOr<std::unique_ptr<AttentionBackend>> cuda =
        CreateCudaBackend();
    if (cuda.ok()) {
      choice.backend = *std::move(cuda);
      choice.reason = "auto: a CUDA device is usable; using cuda";
      return choice;
    }
    choice.backend = MakeCpu(options);
    choice.reason =
        absl::StrCat("cuda requested by auto but no device is usable: ",
                     cuda.status().message(), "; using cpu");
    return choice;
#else
    choice.backend = MakeCpu(options);
    choice.reason = "auto: this build has no CUDA backend; using cpu";
    return choice;
#endif
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown backend kind '", options.kind, "'; use auto, cpu or cuda"));
}

}  // namespace attention
