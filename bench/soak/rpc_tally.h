// attn-soak: which status codes each RPC may answer, and a thread-safe tally
// of the codes seen (per RPC), with samples of undocumented ones.
#ifndef ATTENTION_BENCH_SOAK_RPC_TALLY_H_
#define ATTENTION_BENCH_SOAK_RPC_TALLY_H_

#include <grpcpp/support/status.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/metrics.h"

namespace attention::soak {

// The RPCs and status codes as the server's metrics name them.
using Rpc = server::RpcMethod;
inline constexpr int kNumRpcs = server::kNumRpcMethods;
inline constexpr int kNumCodes = server::kNumGrpcCodes;

inline absl::string_view RpcName(Rpc rpc) { return server::RpcMethodName(rpc); }
inline absl::string_view CodeName(int code) {
  return server::GrpcCodeName(static_cast<grpc::StatusCode>(code));
}

// True when attention.proto (with the README's status table) documents
// `code` for `rpc`. Every RPC may also end CANCELLED or DEADLINE_EXCEEDED
// (the client's doing), UNAVAILABLE (draining, overloaded, unreachable) and
// RESOURCE_EXHAUSTED (a message above --max_message_bytes). INTERNAL is
// documented only for device failures, which the CPU backend never has, and
// ABORTED, UNKNOWN and the rest are documented nowhere.
bool IsDocumentedCode(Rpc rpc, grpc::StatusCode code);

class RpcTally {
 public:
  RpcTally();

  // Counts one finished call (or Decode stream step).
  void Record(Rpc rpc, const grpc::Status& status);
  // Counts a call that answered something the contract rules out even
  // though its code is documented (e.g. OK for an invalid request).
  void RecordViolation(Rpc rpc, const std::string& what);
  // Counts a decode step that failed on the client's side (deadline,
  // cancellation) on a session no other call touched, and whether the
  // session grew anyway.
  void RecordFailedStep(bool applied);

  int64_t count(Rpc rpc, int code) const;
  int64_t calls(Rpc rpc) const;
  int64_t violations() const;
  int64_t failed_steps() const;
  int64_t failed_steps_applied() const;
  // Up to kMaxSamples descriptions of violations.
  std::vector<std::string> samples() const;
  // Messages of the first failures seen with `code` for `rpc`, at most
  // kMaxExamples that differ in their first kExamplePrefix characters.
  std::vector<std::string> examples(Rpc rpc, int code) const;

  // A line-based text form for the worker report files, and adding such a
  // text's counts to this tally.
  std::string Serialize() const;
  absl::Status MergeSerialized(absl::string_view text);

  static constexpr int kMaxSamples = 20;
  static constexpr int kMaxExamples = 3;
  static constexpr int kExamplePrefix = 24;

 private:
  void AddSample(std::string sample) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddExample(int rpc, int code, absl::string_view message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::array<std::array<int64_t, kNumCodes>, kNumRpcs> counts_
      ABSL_GUARDED_BY(mu_);
  int64_t violations_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t failed_steps_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t failed_steps_applied_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> samples_ ABSL_GUARDED_BY(mu_);
  std::array<std::array<std::vector<std::string>, kNumCodes>, kNumRpcs>
      examples_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::soak

#endif  // ATTENTION_BENCH_SOAK_RPC_TALLY_H_
