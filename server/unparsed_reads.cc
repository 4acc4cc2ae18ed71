#include "server/unparsed_reads.h"

#include "absl/strings/str_cat.h"
#include "proto/parse_budget.h"

namespace attention::server {

void UnparsedReads::Note(const grpc::ServerContextBase* call) {
  absl::MutexLock lock(&mu_);
  calls_.insert(call);
}

bool UnparsedReads::Take(const grpc::ServerContextBase* call) {
  absl::MutexLock lock(&mu_);
  return calls_.erase(call) > 0;
}

absl::Status UnparsedRequest(absl::string_view method) {
  return absl::InvalidArgumentError(absl::StrCat(
      "the request bytes are not a valid protobuf message for ", method,
      ", or parsing them would take more than ", proto::kParseBudgetRatio,
      " times their size in memory (at least ", proto::kParseBudgetFloor >> 20,
      " MiB: too many sub-messages, repeated values or unknown fields for "
      "their size); encode the request with the attention.v1 proto "
      "(proto/attention/v1/attention.proto)"));
}

}  // namespace attention::server
