#include "proto/parse_budget.h"

#include <grpcpp/impl/codegen/proto_buffer_reader.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/message.h"
#include "google/protobuf/unknown_field_set.h"
#include "google/protobuf/wire_format.h"
#include "google/protobuf/wire_format_lite.h"

namespace attention::proto {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::UnknownField;
using google::protobuf::UnknownFieldSet;
using google::protobuf::internal::WireFormat;
using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;
using WireType = WireFormatLite::WireType;

// Protobuf's default limit on nesting: deeper bytes do not parse.
constexpr int kMaxDepth = 100;
// A repeated field's array doubles as it grows from a header and 4 slots:
// up to twice its elements, and on an arena (which keeps the arrays it
// outgrew) up to four times. Charged per element of a repeated message or
// string field (a pointer slot each) and per packed run.
constexpr int64_t kGrowth = 4;
constexpr int64_t kArrayFloor = 8 + 4 * 8;
static_assert(kArrayFloor >= kGrowth * sizeof(void*));
// A string or bytes value: its object on the heap and its bytes, at least
// twice the inline capacity (a string grown past it doubles it).
constexpr int64_t kStringObject = sizeof(std::string);
constexpr int64_t kShortestHeapString = 32;
int64_t StringBytes(uint32_t length) {
  return kStringObject + std::max<int64_t>(length, kShortestHeapString);
}
constexpr int64_t kUnknownField = kGrowth * sizeof(UnknownField);

// Heap bytes of an empty message of each type of a .proto file (its
// object), and the most an element of the wire can cost per byte.
class MessageSizes {
 public:
  explicit MessageSizes(const google::protobuf::FileDescriptor& file) {
    for (int i = 0; i < file.message_type_count(); ++i) {
      Add(*file.message_type(i));
    }
    // Every element takes at least 2 bytes (a tag and a length or value),
    // except the values of a packed field (1 byte each).
    const int64_t element =
        std::max({largest_ + kArrayFloor,
                  kUnknownField + std::max<int64_t>(StringBytes(0),
                                                    sizeof(UnknownFieldSet)),
                  StringBytes(0) + kArrayFloor});
    per_byte_ = std::max<int64_t>((element + 1) / 2, 8 * kGrowth);
  }

  int64_t Of(const Descriptor& type) const {
    auto it = sizes_.find(&type);
    return it != sizes_.end() ? it->second : SpaceUsed(type);
  }
  // A message of at most this many bytes cannot pass kParseBudgetFloor.
  int64_t never_over() const {
    return (kParseBudgetFloor - largest_) / per_byte_;
  }

 private:
  static int64_t SpaceUsed(const Descriptor& type) {
    const google::protobuf::Message* prototype =
        google::protobuf::MessageFactory::generated_factory()->GetPrototype(
            &type);
    return prototype != nullptr
               ? static_cast<int64_t>(prototype->SpaceUsedLong())
               : 1024;
  }
  void Add(const Descriptor& type) {
    const int64_t size = SpaceUsed(type);
    sizes_[&type] = size;
    largest_ = std::max(largest_, size);
    for (int i = 0; i < type.nested_type_count(); ++i) {
      Add(*type.nested_type(i));
    }
  }

  absl::flat_hash_map<const Descriptor*, int64_t> sizes_;
  int64_t largest_ = 0;
  int64_t per_byte_ = 1;
};

// The sizes of the file of the first type asked about (every budgeted
// message is of attention.v1); other types are measured when met.
const MessageSizes& SizesFor(const Descriptor& type) {
  static const MessageSizes* const sizes = new MessageSizes(*type.file());
  return *sizes;
}

// Bytes per element of a repeated scalar field.
int64_t ElementBytes(const FieldDescriptor& field) {
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT64:
    case FieldDescriptor::CPPTYPE_UINT64:
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return 8;
    case FieldDescriptor::CPPTYPE_BOOL:
      return 1;
    default:
      return 4;
  }
}

// One scan of a message's wire bytes, adding up what its parse allocates.
class Estimator {
 public:
  Estimator(CodedInputStream* in, int64_t size, const MessageSizes& sizes,
            int64_t stop_above)
      : in_(in), size_(size), sizes_(sizes), stop_above_(stop_above) {}

  // Scans the fields of a `type` message (null: an unknown group's) up to
  // the current limit, or up to the end-group tag of field `end_group` when
  // not 0. False when the bytes are not well-formed. Stops early (true)
  // once the estimate is over stop_above.
  bool Fields(const Descriptor* type, int depth, int end_group) {
    if (depth > kMaxDepth) return false;
    while (!over()) {
      const uint32_t tag = in_->ReadTag();
      if (tag == 0) return end_group == 0 && in_->ConsumedEntireMessage();
      const int number = WireFormatLite::GetTagFieldNumber(tag);
      const WireType wire = WireFormatLite::GetTagWireType(tag);
      if (number == 0) return false;
      if (wire == WireFormatLite::WIRETYPE_END_GROUP) {
        return number == end_group;
      }
      const FieldDescriptor* field =
          type != nullptr ? type->FindFieldByNumber(number) : nullptr;
      const bool well_formed = field != nullptr && Accepts(*field, wire)
                                   ? Known(*field, wire, depth)
                                   : Unknown(number, wire, depth);
      if (!well_formed) return false;
    }
    return true;
  }

  void Add(int64_t bytes) { bytes_ += bytes; }
  int64_t bytes() const { return bytes_; }

 private:
  bool over() const { return bytes_ > stop_above_; }

  // Whether protobuf parses `wire` into `field` (else: an unknown field).
  static bool Accepts(const FieldDescriptor& field, WireType wire) {
    if (field.is_packable() &&
        wire == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      return true;  // the packed form, whichever the field declares
    }
    return WireFormat::WireTypeForFieldType(field.type()) == wire;
  }

  // Bytes left in the current message.
  int64_t Remaining() const {
    const int until = in_->BytesUntilLimit();
    return until >= 0 ? until : size_ - in_->CurrentPosition();
  }

  // Reads a length that must fit in what is left.
  bool ReadLength(uint32_t* length) {
    return in_->ReadVarint32(length) && *length <= Remaining();
  }

  bool Known(const FieldDescriptor& field, WireType wire, int depth) {
    const int64_t slot = field.is_repeated() ? kArrayFloor : 0;
    switch (wire) {
      case WireFormatLite::WIRETYPE_LENGTH_DELIMITED: {
        uint32_t length = 0;
        if (!ReadLength(&length)) return false;
        if (field.is_packable()) return Packed(field, length);
        if (field.cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) {
          Add(StringBytes(length) + slot);
          return in_->Skip(static_cast<int>(length));
        }
        Add(sizes_.Of(*field.message_type()) + slot);
        const CodedInputStream::Limit limit =
            in_->PushLimit(static_cast<int>(length));
        const bool well_formed = Fields(field.message_type(), depth + 1, 0);
        in_->PopLimit(limit);
        return well_formed;
      }
      case WireFormatLite::WIRETYPE_START_GROUP:
        Add(sizes_.Of(*field.message_type()) + slot);
        return Fields(field.message_type(), depth + 1, field.number());
      default:
        Add(slot);  // one element of an unpacked repeated field
        return SkipScalar(wire);
    }
  }

  // A packed run of `length` bytes of a repeated scalar field.
  bool Packed(const FieldDescriptor& field, uint32_t length) {
    const WireType element = WireFormat::WireTypeForFieldType(field.type());
    int64_t count = 0;
    if (element == WireFormatLite::WIRETYPE_FIXED32 ||
        element == WireFormatLite::WIRETYPE_FIXED64) {
      count = length / (element == WireFormatLite::WIRETYPE_FIXED32 ? 4 : 8);
      if (!in_->Skip(static_cast<int>(length))) return false;
    } else if (!CountVarints(length, &count)) {
      return false;
    }
    Add(kArrayFloor + kGrowth * count * ElementBytes(field));
    return true;
  }

  // Reads `length` bytes of varints, counting them (one ends at each byte
  // below 0x80).
  bool CountVarints(uint32_t length, int64_t* count) {
    for (uint32_t left = length; left > 0;) {
      const void* data = nullptr;
      int available = 0;
      if (!in_->GetDirectBufferPointer(&data, &available)) return false;
      const int n = static_cast<int>(
          std::min<int64_t>(available, static_cast<int64_t>(left)));
      const auto* bytes = static_cast<const uint8_t*>(data);
      *count +=
          std::count_if(bytes, bytes + n, [](uint8_t b) { return b < 0x80; });
      if (!in_->Skip(n)) return false;
      left -= static_cast<uint32_t>(n);
    }
    return true;
  }

  bool Unknown(int number, WireType wire, int depth) {
    Add(kUnknownField);
    switch (wire) {
      case WireFormatLite::WIRETYPE_LENGTH_DELIMITED: {
        uint32_t length = 0;
        if (!ReadLength(&length)) return false;
        Add(StringBytes(length));
        return in_->Skip(static_cast<int>(length));
      }
      case WireFormatLite::WIRETYPE_START_GROUP:
        Add(sizeof(UnknownFieldSet));
        return Fields(nullptr, depth + 1, number);
      default:
        return SkipScalar(wire);
    }
  }

  bool SkipScalar(WireType wire) {
    switch (wire) {
      case WireFormatLite::WIRETYPE_VARINT: {
        uint64_t value = 0;
        return in_->ReadVarint64(&value);
      }
      case WireFormatLite::WIRETYPE_FIXED64: {
        uint64_t value = 0;
        return in_->ReadLittleEndian64(&value);
      }
      case WireFormatLite::WIRETYPE_FIXED32: {
        uint32_t value = 0;
        return in_->ReadLittleEndian32(&value);
      }
      default:  // wire types 6 and 7 do not exist
        return false;
    }
  }

  CodedInputStream* const in_;
  const int64_t size_;
  const MessageSizes& sizes_;
  const int64_t stop_above_;
  int64_t bytes_ = 0;
};

}  // namespace

std::optional<int64_t> EstimateParseBytes(
    google::protobuf::io::ZeroCopyInputStream& input, int64_t size,
    const Descriptor& type, int64_t stop_above) {
  CodedInputStream in(&input);
  const MessageSizes& sizes = SizesFor(type);
  Estimator estimator(&in, size, sizes, stop_above);
  estimator.Add(sizes.Of(type));
  if (!estimator.Fields(&type, 0, 0)) return std::nullopt;
  return estimator.bytes();
}

namespace {
thread_local const grpc::protobuf::MessageLite* unparsed_message = nullptr;
}  // namespace

const grpc::protobuf::MessageLite* TakeUnparsedMessage() {
  return std::exchange(unparsed_message, nullptr);
}

void internal::NoteDeserialized(const grpc::protobuf::MessageLite* message,
                                bool ok) {
  unparsed_message = ok ? nullptr : message;
}

int64_t ParseBudget(int64_t size) {
  return std::max(kParseBudgetFloor, kParseBudgetRatio * size);
}

namespace {

// Why parsing `size` bytes of `input` as a `type` message is refused, or
// nullopt when it is within its budget.
std::optional<std::string> BudgetRefusal(
    google::protobuf::io::ZeroCopyInputStream& input, int64_t size,
    const Descriptor& type) {
  const int64_t budget = ParseBudget(size);
  const std::optional<int64_t> estimate =
      EstimateParseBytes(input, size, type, budget);
  if (!estimate.has_value()) {
    return absl::StrCat("the bytes are not a well-formed ", type.full_name(),
                        " message");
  }
  if (*estimate <= budget) return std::nullopt;
  return absl::StrCat("these ", size, " bytes would take more than ", budget,
                      " bytes of memory to parse as ", type.full_name());
}

}  // namespace

grpc::Status CheckParseBudget(grpc::ByteBuffer& buffer,
                              const Descriptor& type) {
  const int64_t size = static_cast<int64_t>(buffer.Length());
  if (size <= SizesFor(type).never_over()) return grpc::Status::OK;
  grpc::ProtoBufferReader reader(&buffer);
  if (!reader.status().ok()) return reader.status();
  std::optional<std::string> refusal = BudgetRefusal(reader, size, type);
  if (!refusal.has_value()) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::INTERNAL, *std::move(refusal));
}

absl::Status CheckParseBudget(absl::string_view bytes, const Descriptor& type) {
  const int64_t size = static_cast<int64_t>(bytes.size());
  if (size <= SizesFor(type).never_over()) return absl::OkStatus();
  if (size > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat(size, " bytes are more than a message may hold"));
  }
  google::protobuf::io::ArrayInputStream input(bytes.data(),
                                               static_cast<int>(size));
  std::optional<std::string> refusal = BudgetRefusal(input, size, type);
  if (!refusal.has_value()) return absl::OkStatus();
  return absl::InvalidArgumentError(*std::move(refusal));
}

}  // namespace attention::proto
