// Creation of the CUDA backend for the backend factory. This header needs no
// CUDA headers, so core/backend_factory.cc can include it whenever the
// build has the CUDA backend (ATTN_HAVE_CUDA).
#ifndef ATTENTION_CORE_CUDA_CUDA_BACKEND_FACTORY_H_
#define ATTENTION_CORE_CUDA_CUDA_BACKEND_FACTORY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "core/backend.h"

namespace attention {

// The CUDA backend on device 0 with default options. UNAVAILABLE with the
// reason (e.g. "no CUDA device: cudaGetDeviceCount failed: ...") when no
// device is usable, so callers can fall back to the CPU backend.
absl::StatusOr<std::unique_ptr<AttentionBackend>> CreateCudaBackend();

}  // namespace attention

#endif  // ATTENTION_CORE_CUDA_CUDA_BACKEND_FACTORY_H_
