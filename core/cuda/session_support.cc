#include "core/cuda/session_support.h"

#include <cstddef>

#include "absl/strings/str_cat.h"

namespace attention {

absl::Status CudaServesSessionSpec(const SessionSpec& spec) {
  if (spec.kv_layout == KvLayout::kSharedLatent) {
    return absl::FailedPreconditionError(
        "the CUDA backend does not serve MLA shared-latent KV layouts yet; "
        "start the server with --backend=cpu for this session");
  }
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    if (spec.layers[i].topk > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the CUDA backend does not serve top-k sparse layers yet (layer ",
          i, " has topk = ", spec.layers[i].topk,
          "); start the server with --backend=cpu for this session"));
    }
  }
  return absl::OkStatus();
}

}  // namespace attention
