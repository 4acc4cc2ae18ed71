// parse_budget_fuzzer: raw bytes scanned by the parse budget's estimate
// (proto/parse_budget.h) and parsed by protobuf as the same request type.
//
// Input: byte 0 picks the message type; the rest is its wire bytes. Checks:
// bytes protobuf parses are well-formed to the estimate (so the budget never
// refuses a message as malformed that protobuf would take), and the
// estimate is at least what the parsed message takes (SpaceUsedLong).
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "attention/v1/attention.pb.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/stubs/logging.h"
#include "proto/parse_budget.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attention;  // NOLINT(build/namespaces): a fuzz target
  // Invalid UTF-8 in string fields is logged by protobuf; quiet.
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)quiet;
  if (size == 0) return 0;
  const google::protobuf::Message* const types[] = {
      &v1::BatchDecodeRequest::default_instance(),
      &v1::CreateSessionRequest::default_instance(),
      &v1::DecodeRequest::default_instance(),
      &v1::SessionChunk::default_instance(),
      &v1::AttentionRequest::default_instance(),
      &v1::PrefillRequest::default_instance(),
  };
  const google::protobuf::Message& type =
      *types[data[0] % (sizeof(types) / sizeof(types[0]))];
  const uint8_t* const wire = data + 1;
  const int wire_size = static_cast<int>(size - 1);

  std::unique_ptr<google::protobuf::Message> message(type.New());
  const bool parsed = message->ParseFromArray(wire, wire_size);
  google::protobuf::io::ArrayInputStream input(wire, wire_size);
  const std::optional<int64_t> estimate =
      proto::EstimateParseBytes(input, wire_size, *type.GetDescriptor(),
                                std::numeric_limits<int64_t>::max());
  if (!parsed) return 0;
  fuzz::Check(estimate.has_value(),
              absl::StrCat(type.GetTypeName(),
                           " parses, but the estimate calls it malformed"));
  const int64_t used = static_cast<int64_t>(message->SpaceUsedLong());
  fuzz::Check(*estimate >= used,
              absl::StrCat(type.GetTypeName(), " takes ", used,
                           " bytes parsed, over its estimate of ", *estimate));
  return 0;
}
