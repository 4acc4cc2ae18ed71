// Which kinds of sessions the CUDA backend serves, decided without a
// device so that it can be tested anywhere (CudaBackend::CheckSessionSpec
// answers with it).
#ifndef ATTENTION_CORE_CUDA_SESSION_SUPPORT_H_
#define ATTENTION_CORE_CUDA_SESSION_SUPPORT_H_

#include "absl/status/status.h"
#include "core/session_spec.h"

namespace attention {

// OK for every spec the CUDA kernels compute. FAILED_PRECONDITION, naming
// the missing kind and the CPU backend as the way out, for MLA
// shared-latent layouts and top-k sparse layers (CPU-only so far): the
// engine then refuses the session at CreateSession, so the CUDA backend
// never computes them wrongly.
absl::Status CudaServesSessionSpec(const SessionSpec& spec);

}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_SESSION_SUPPORT_H_
