#include "core/backend.h"

namespace attention {

void AttentionBackend::AttendEach(absl::Span<const AttentionProblem> problems,
                                  absl::Span<absl::Status> statuses) {
  const absl::Status status = Attend(problems);
  if (status.ok() || problems.size() == 1 || !failure().ok()) {
    for (absl::Status& each : statuses) each = status;
    return;
  }
  for (size_t p = 0; p < problems.size(); ++p) {
    statuses[p] = Attend(problems.subspan(p, 1));
  }
}

}  // namespace attention
