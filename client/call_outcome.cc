#include "client/call_outcome.h"

#include "absl/strings/match.h"

namespace attention::client {

bool NeverSent(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kUnavailable) return false;
  for (absl::string_view before_sending :
       {"failed to connect to all addresses", "DNS resolution failed",
        "empty address list"}) {
    if (absl::StrContains(status.message(), before_sending)) return true;
  }
  return false;
}

bool RefusedByServer(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable &&
         absl::StartsWith(status.message(), "the server is ");
}

bool RefusedWhileDraining(const absl::Status& status) {
  return RefusedByServer(status) &&
         absl::StartsWith(status.message(), "the server is draining");
}

bool CreationInDoubt(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
      return !NeverSent(status) && !RefusedByServer(status);
    case absl::StatusCode::kResourceExhausted:
      return absl::StartsWith(status.message(),
                              "Received message larger than max");
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
      return true;
    default:
      return false;
  }
}

}  // namespace attention::client
