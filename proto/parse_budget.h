// Parse budget: a request's wire bytes are checked, before protobuf builds
// the message, for how much memory the message would take.
//
// Protobuf builds an object per sub-message, a slot per repeated value and a
// record per unknown field; a 2-byte empty sub-message can cost a hundred
// bytes of heap, so a request within the message-size limit could take tens
// of times its size (64 MiB of empty BatchDecode steps: about 3 GB). Every
// request message of attention.v1 is therefore deserialized through
// BudgetedProtoTraits (below): its bytes are scanned once (no copy, no
// allocation per field), the memory the parse would take is estimated from
// the descriptors, and a request over its budget is refused without being
// parsed, as gRPC refuses bytes that do not parse. Small messages skip the
// scan: they cannot reach the floor of the budget.
//
// The gRPC generated header includes this one (grpc_cpp_plugin's
// additional_header_includes, see proto/CMakeLists.txt), so that every
// translation unit that instantiates gRPC's serialization of these messages
// sees the specializations below.
#ifndef ATTENTION_PROTO_PARSE_BUDGET_H_
#define ATTENTION_PROTO_PARSE_BUDGET_H_

#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/status.h>

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.pb.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/zero_copy_stream.h"

namespace attention::proto {

// A message may take at most kParseBudgetRatio times its wire size in
// memory once parsed, and always at least kParseBudgetFloor.
inline constexpr int64_t kParseBudgetRatio = 4;
inline constexpr int64_t kParseBudgetFloor = int64_t{64} << 20;

// Estimated heap bytes parsing `size` bytes from `input` as a `type`
// message takes (objects, repeated slots with their growth, strings,
// unknown fields; on an arena, also the arrays outgrown, but not the
// unused tails of its blocks), scanning stops once the estimate passes
// `stop_above`
// (whatever it returns then is above it). nullopt when the bytes are not
// well-formed protobuf (protobuf's own parse would fail too).
std::optional<int64_t> EstimateParseBytes(
    google::protobuf::io::ZeroCopyInputStream& input, int64_t size,
    const google::protobuf::Descriptor& type, int64_t stop_above);

// The most memory a `size`-byte message may take once parsed.
int64_t ParseBudget(int64_t size);

// OK, or INTERNAL (what gRPC's own failed parse reports; the server's
// ParseErrorInterceptor answers INVALID_ARGUMENT) when parsing `buffer` as
// a `type` message would take more than ParseBudget of its size, or when
// its bytes are not well-formed.
grpc::Status CheckParseBudget(grpc::ByteBuffer& buffer,
                              const google::protobuf::Descriptor& type);

// As above for bytes read elsewhere (a file): OK, or INVALID_ARGUMENT.
absl::Status CheckParseBudget(absl::string_view bytes,
                              const google::protobuf::Descriptor& type);

// The message the latest deserialization on the calling thread failed to
// fill (its bytes did not parse, or passed the budget), or null when that
// deserialization succeeded or nothing was deserialized since the last
// call; reading it clears it. gRPC deserializes a received message and then
// runs the server's interceptors for it on one thread, so an interceptor's
// POST_RECV_MESSAGE can tell a streamed message that did not parse from the
// stream's clean end: both reach it as no message.
const grpc::protobuf::MessageLite* TakeUnparsedMessage();

namespace internal {
// Records a deserialization of `message` on the calling thread for
// TakeUnparsedMessage.
void NoteDeserialized(const grpc::protobuf::MessageLite* message, bool ok);
}  // namespace internal

// gRPC serialization of `T` (as gRPC's own for protobuf) whose
// deserialization first checks the parse budget.
template <class T>
class BudgetedProtoTraits {
 public:
  static grpc::Status Serialize(const grpc::protobuf::MessageLite& message,
                                grpc::ByteBuffer* buffer, bool* own_buffer) {
    return grpc::GenericSerialize<grpc::ProtoBufferWriter, T>(message, buffer,
                                                              own_buffer);
  }
  static grpc::Status Deserialize(grpc::ByteBuffer* buffer,
                                  grpc::protobuf::MessageLite* message) {
    grpc::Status status = Parse(buffer, message);
    internal::NoteDeserialized(message, status.ok());
    return status;
  }

 private:
  static grpc::Status Parse(grpc::ByteBuffer* buffer,
                            grpc::protobuf::MessageLite* message) {
    if (buffer != nullptr) {
      grpc::Status budget = CheckParseBudget(*buffer, *T::descriptor());
      if (!budget.ok()) {
        buffer->Clear();
        return budget;
      }
    }
    return grpc::GenericDeserialize<grpc::ProtoBufferReader, T>(buffer,
                                                                message);
  }
};

}  // namespace attention::proto

// Every request message the service receives (unary, streamed or imported).
namespace grpc {
#define ATTN_BUDGETED_PARSE(T)                         \
  template <>                                          \
  class SerializationTraits< ::attention::v1::T, void> \
      : public ::attention::proto::BudgetedProtoTraits< ::attention::v1::T> {}
ATTN_BUDGETED_PARSE(CreateSessionRequest);
ATTN_BUDGETED_PARSE(GetSessionRequest);
ATTN_BUDGETED_PARSE(ListSessionsRequest);
ATTN_BUDGETED_PARSE(DeleteSessionRequest);
ATTN_BUDGETED_PARSE(ForkSessionRequest);
ATTN_BUDGETED_PARSE(TruncateSessionRequest);
ATTN_BUDGETED_PARSE(PrefillRequest);
ATTN_BUDGETED_PARSE(DecodeRequest);
ATTN_BUDGETED_PARSE(BatchDecodeRequest);
ATTN_BUDGETED_PARSE(AttentionRequest);
ATTN_BUDGETED_PARSE(GetServerInfoRequest);
ATTN_BUDGETED_PARSE(ExportSessionRequest);
ATTN_BUDGETED_PARSE(SessionChunk);
#undef ATTN_BUDGETED_PARSE
}  // namespace grpc

#endif  // ATTENTION_PROTO_PARSE_BUDGET_H_
