#include "core/session_busy.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "core/client_string.h"

namespace attention {
namespace {

constexpr char kSessionBusyPayload[] =
    "type.googleapis.com/attention.v1.SessionBusy";

}  // namespace

absl::Status SessionBusyError(absl::string_view id) {
  absl::Status status = absl::UnavailableError(absl::StrCat(
      "session ", QuoteClientString(id),
      " is busy with another call (for example a long prefill); nothing was "
      "applied: retry once that call has finished"));
  status.SetPayload(kSessionBusyPayload, absl::Cord("1"));
  return status;
}

bool IsSessionBusy(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable &&
         status.GetPayload(kSessionBusyPayload).has_value();
}

}  // namespace attention
