#include "bench/soak/rpc_tally.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace attention::soak {
namespace {

int ClampCode(int code) { return code >= 0 && code < kNumCodes ? code : 2; }

}  // namespace

bool IsDocumentedCode(Rpc rpc, grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return true;
    default:
      break;
  }
  switch (rpc) {
    case Rpc::kCreateSession:
      return code == grpc::StatusCode::INVALID_ARGUMENT;
    case Rpc::kGetSession:
    case Rpc::kDeleteSession:
    case Rpc::kForkSession:
      return code == grpc::StatusCode::NOT_FOUND;
    case Rpc::kTruncateSession:
      return code == grpc::StatusCode::NOT_FOUND ||
             code == grpc::StatusCode::INVALID_ARGUMENT ||
             code == grpc::StatusCode::FAILED_PRECONDITION;
    case Rpc::kPrefill:
    case Rpc::kDecodeStep:
    case Rpc::kDecode:
    case Rpc::kBatchDecode:
      return code == grpc::StatusCode::INVALID_ARGUMENT ||
             code == grpc::StatusCode::NOT_FOUND ||
             code == grpc::StatusCode::OUT_OF_RANGE;
    case Rpc::kAttention:
      return code == grpc::StatusCode::INVALID_ARGUMENT;
    case Rpc::kExportSession:
      return code == grpc::StatusCode::NOT_FOUND;
    case Rpc::kImportSession:
      // Only complete snapshots are imported: a malformed one
      // (INVALID_ARGUMENT, DATA_LOSS) is a server bug here.
      return false;
    case Rpc::kListSessions:
    case Rpc::kGetServerInfo:
      return false;
  }
  return false;
}

RpcTally::RpcTally() {
  for (auto& row : counts_) row.fill(0);
}

void RpcTally::Record(Rpc rpc, const grpc::Status& status) {
  const int code = ClampCode(static_cast<int>(status.error_code()));
  absl::MutexLock lock(&mu_);
  ++counts_[static_cast<int>(rpc)][code];
  if (code != 0)
    AddExample(static_cast<int>(rpc), code, status.error_message());
  if (!IsDocumentedCode(rpc, status.error_code())) {
    ++violations_;
    AddSample(absl::StrCat(RpcName(rpc), " answered ", CodeName(code), ": ",
                           status.error_message()));
  }
}

void RpcTally::RecordViolation(Rpc rpc, const std::string& what) {
  absl::MutexLock lock(&mu_);
  ++violations_;
  AddSample(absl::StrCat(RpcName(rpc), ": ", what));
}

void RpcTally::RecordFailedStep(bool applied) {
  absl::MutexLock lock(&mu_);
  ++failed_steps_;
  if (applied) ++failed_steps_applied_;
}

void RpcTally::AddSample(std::string sample) {
  if (static_cast<int>(samples_.size()) >= kMaxSamples) return;
  samples_.push_back(absl::StrReplaceAll(sample, {{"\n", " "}}));
}

int64_t RpcTally::count(Rpc rpc, int code) const {
  absl::MutexLock lock(&mu_);
  return counts_[static_cast<int>(rpc)][ClampCode(code)];
}

int64_t RpcTally::calls(Rpc rpc) const {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  for (int64_t n : counts_[static_cast<int>(rpc)]) total += n;
  return total;
}

void RpcTally::AddExample(int rpc, int code, absl::string_view message) {
  std::vector<std::string>& examples = examples_[rpc][code];
  if (static_cast<int>(examples.size()) >= kMaxExamples) return;
  for (const std::string& example : examples) {
    if (example.substr(0, kExamplePrefix) ==
        message.substr(0, kExamplePrefix)) {
      return;
    }
  }
  examples.push_back(absl::StrReplaceAll(message, {{"\n", " "}}));
}

std::vector<std::string> RpcTally::examples(Rpc rpc, int code) const {
  absl::MutexLock lock(&mu_);
  return examples_[static_cast<int>(rpc)][ClampCode(code)];
}

int64_t RpcTally::violations() const {
  absl::MutexLock lock(&mu_);
  return violations_;
}

int64_t RpcTally::failed_steps() const {
  absl::MutexLock lock(&mu_);
  return failed_steps_;
}

int64_t RpcTally::failed_steps_applied() const {
  absl::MutexLock lock(&mu_);
  return failed_steps_applied_;
}

std::vector<std::string> RpcTally::samples() const {
  absl::MutexLock lock(&mu_);
  return samples_;
}

// One line per non-zero count ("count <rpc> <code> <n>"), one per example
// ("example <rpc> <code> <message>"), then "violations <n>",
// "failed_steps <n> <applied>" and "sample <text>" lines.
std::string RpcTally::Serialize() const {
  absl::MutexLock lock(&mu_);
  std::string out;
  for (int r = 0; r < kNumRpcs; ++r) {
    for (int c = 0; c < kNumCodes; ++c) {
      if (counts_[r][c] != 0) {
        absl::StrAppend(&out, "count ", r, " ", c, " ", counts_[r][c], "\n");
      }
    }
  }
  for (int r = 0; r < kNumRpcs; ++r) {
    for (int c = 0; c < kNumCodes; ++c) {
      for (const std::string& example : examples_[r][c]) {
        absl::StrAppend(&out, "example ", r, " ", c, " ", example, "\n");
      }
    }
  }
  absl::StrAppend(&out, "violations ", violations_, "\n");
  absl::StrAppend(&out, "failed_steps ", failed_steps_, " ",
                  failed_steps_applied_, "\n");
  for (const std::string& sample : samples_) {
    absl::StrAppend(&out, "sample ", sample, "\n");
  }
  return out;
}

absl::Status RpcTally::MergeSerialized(absl::string_view text) {
  absl::MutexLock lock(&mu_);
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> words =
        absl::StrSplit(line, absl::MaxSplits(' ', 3));
    int r = 0, c = 0;
    int64_t n = 0, applied = 0;
    if (words[0] == "count" && words.size() == 4 &&
        absl::SimpleAtoi(words[1], &r) && absl::SimpleAtoi(words[2], &c) &&
        absl::SimpleAtoi(words[3], &n) && r >= 0 && r < kNumRpcs && c >= 0 &&
        c < kNumCodes) {
      counts_[r][c] += n;
    } else if (words[0] == "example" && words.size() == 4 &&
               absl::SimpleAtoi(words[1], &r) &&
               absl::SimpleAtoi(words[2], &c) && r >= 0 && r < kNumRpcs &&
               c >= 0 && c < kNumCodes) {
      AddExample(r, c, words[3]);
    } else if (words[0] == "violations" && words.size() == 2 &&
               absl::SimpleAtoi(words[1], &n)) {
      violations_ += n;
    } else if (words[0] == "failed_steps" && words.size() == 3 &&
               absl::SimpleAtoi(words[1], &n) &&
               absl::SimpleAtoi(words[2], &applied)) {
      failed_steps_ += n;
      failed_steps_applied_ += applied;
    } else if (words[0] == "sample") {
      AddSample(std::string(line.substr(7)));
    } else {
      return absl::DataLossError(absl::StrCat("bad report line: ", line));
    }
  }
  return absl::OkStatus();
}

}  // namespace attention::soak
