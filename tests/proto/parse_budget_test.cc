// The parse budget: its estimate covers what protobuf's parse of the same
// bytes allocates (SpaceUsedLong), however the bytes are shaped; malformed
// bytes are told apart; gRPC's deserialization of a request message refuses
// a message over its budget and parses every other as before.
#include "proto/parse_budget.h"

#include <string>
#include <thread>
#include <vector>

#include "attention/v1/attention.grpc.pb.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"

namespace attention::proto {
namespace {

using google::protobuf::io::ArrayInputStream;
using google::protobuf::io::CodedOutputStream;
using google::protobuf::io::StringOutputStream;

std::optional<int64_t> Estimate(const std::string& bytes,
                                const google::protobuf::Descriptor& type,
                                int64_t stop_above = INT64_MAX) {
  ArrayInputStream input(bytes.data(), static_cast<int>(bytes.size()));
  return EstimateParseBytes(input, static_cast<int64_t>(bytes.size()), type,
                            stop_above);
}

// Wire bytes written field by field (for shapes a message cannot have).
class Wire {
 public:
  Wire& Varint(int field, uint64_t value) {
    Out().WriteTag(field << 3);
    Out().WriteVarint64(value);
    return *this;
  }
  Wire& Bytes(int field, const std::string& value) {
    Out().WriteTag((field << 3) | 2);
    Out().WriteVarint32(static_cast<uint32_t>(value.size()));
    Out().WriteString(value);
    return *this;
  }
  Wire& Tag(int field, int wire_type) {
    Out().WriteTag((field << 3) | wire_type);
    return *this;
  }
  std::string str() {
    coded_.reset();
    stream_.reset();
    return bytes_;
  }

 private:
  CodedOutputStream& Out() {
    if (coded_ == nullptr) {
      stream_ = std::make_unique<StringOutputStream>(&bytes_);
      coded_ = std::make_unique<CodedOutputStream>(stream_.get());
    }
    return *coded_;
  }
  std::string bytes_;
  std::unique_ptr<StringOutputStream> stream_;
  std::unique_ptr<CodedOutputStream> coded_;
};

std::string Repeat(const std::string& part, int times) {
  std::string out;
  out.reserve(part.size() * times);
  for (int i = 0; i < times; ++i) out += part;
  return out;
}

// The estimate of `bytes` as a `T` is at least what parsing them takes.
template <class T>
void ExpectCovers(const std::string& bytes, const std::string& what) {
  T message;
  ASSERT_TRUE(message.ParseFromString(bytes)) << what;
  const std::optional<int64_t> estimate = Estimate(bytes, *T::descriptor());
  ASSERT_TRUE(estimate.has_value()) << what;
  EXPECT_GE(*estimate, static_cast<int64_t>(message.SpaceUsedLong())) << what;
}

TEST(ParseBudgetTest, EstimateCoversWhatTheParseAllocates) {
  v1::DecodeRequest step;
  step.set_session_id("session-1");
  step.mutable_q()->set_dtype(v1::DTYPE_FLOAT16);
  for (int64_t d : {1, 32, 128}) step.mutable_q()->add_shape(d);
  step.mutable_q()->set_data(std::string(32 * 128 * 2, 'q'));
  step.mutable_k()->add_shape(1);
  step.mutable_k()->set_data(std::string(8 * 128 * 2, 'k'));
  ExpectCovers<v1::DecodeRequest>(step.SerializeAsString(), "a decode step");
  // A real request is estimated close to what it takes.
  v1::DecodeRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(step.SerializeAsString()));
  EXPECT_LE(
      *Estimate(step.SerializeAsString(), *v1::DecodeRequest::descriptor()),
      2 * static_cast<int64_t>(parsed.SpaceUsedLong()));

  v1::BatchDecodeRequest batch;
  for (int i = 0; i < 300; ++i) *batch.add_steps() = step;
  ExpectCovers<v1::BatchDecodeRequest>(batch.SerializeAsString(),
                                       "a batch of steps");

  // The shapes that cost most per byte.
  ExpectCovers<v1::BatchDecodeRequest>(Repeat(Wire().Bytes(1, "").str(), 50000),
                                       "empty steps");
  const std::string shape_of_one =
      Wire().Bytes(3, Wire().Bytes(2, std::string(1, '\x01')).str()).str();
  ExpectCovers<v1::BatchDecodeRequest>(
      Repeat(Wire().Bytes(1, shape_of_one).str(), 20000),
      "steps whose q has a shape of one dimension");
  ExpectCovers<v1::Tensor>(Wire().Bytes(2, std::string(100000, '\x01')).str(),
                           "a packed shape of 1-byte varints");
  ExpectCovers<v1::Tensor>(Repeat(Wire().Varint(2, 1).str(), 50000),
                           "an unpacked shape");
  const std::string layer = Wire().Bytes(3, std::string(8, '\0')).str();
  ExpectCovers<v1::CreateSessionRequest>(
      Wire().Bytes(1, Repeat(Wire().Bytes(8, layer).str(), 20000)).str(),
      "layers with sink logits");
  ExpectCovers<v1::CreateSessionRequest>(
      Wire().Bytes(1, Repeat(Wire().Bytes(8, "").str(), 20000)).str(),
      "empty layers");
  ExpectCovers<v1::DecodeRequest>(Repeat(Wire().Varint(1000, 7).str(), 30000),
                                  "unknown varints");
  ExpectCovers<v1::DecodeRequest>(Repeat(Wire().Bytes(1001, "").str(), 30000),
                                  "unknown empty strings");
  ExpectCovers<v1::DecodeRequest>(
      Repeat(Wire().Tag(1002, 3).Tag(1002, 4).str(), 30000),
      "unknown empty groups");
  ExpectCovers<v1::DecodeRequest>(
      Repeat(Wire().Tag(1002, 3).Varint(5, 1).Bytes(6, "x").Tag(1002, 4).str(),
             10000),
      "unknown groups with fields");
  ExpectCovers<v1::DecodeRequest>(
      Repeat(Wire().Tag(3, 3).Tag(3, 4).str(), 30000),
      "groups on a message field (unknown)");
  ExpectCovers<v1::Tensor>(
      Repeat(Wire().Bytes(1, std::string(3, '\x01')).str(), 30000),
      "a length-delimited enum (unknown)");
}

TEST(ParseBudgetTest, MalformedBytesAreToldApart) {
  const auto& type = *v1::BatchDecodeRequest::descriptor();
  EXPECT_TRUE(Estimate("", type).has_value());
  EXPECT_FALSE(Estimate("\x0a\x05\x0a", type).has_value())
      << "a step longer than what is left";
  EXPECT_FALSE(Estimate("\x0f", type).has_value()) << "wire type 7";
  EXPECT_FALSE(Estimate("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", type)
                   .has_value())
      << "a tag varint of 11 bytes";
  EXPECT_FALSE(Estimate(Wire().Tag(7, 3).Tag(8, 4).str(), type).has_value())
      << "a group ended by another field's end";
  EXPECT_FALSE(Estimate(Wire().Tag(7, 3).str(), type).has_value())
      << "a group never ended";
  EXPECT_FALSE(Estimate(Wire().Tag(7, 4).str(), type).has_value())
      << "an end of group outside any";
  std::string deep =
      Repeat(Wire().Tag(9, 3).str(), 150) + Repeat(Wire().Tag(9, 4).str(), 150);
  EXPECT_FALSE(Estimate(deep, type).has_value()) << "nested past 100";
  v1::BatchDecodeRequest message;
  EXPECT_FALSE(message.ParseFromString(deep)) << "protobuf refuses it too";
}

TEST(ParseBudgetTest, TheScanStopsOnceOverTheBudget) {
  const std::string empty_steps = Repeat(Wire().Bytes(1, "").str(), 100000);
  const auto& type = *v1::BatchDecodeRequest::descriptor();
  const int64_t whole = *Estimate(empty_steps, type);
  const std::optional<int64_t> stopped = Estimate(empty_steps, type, 1000);
  ASSERT_TRUE(stopped.has_value());
  EXPECT_GT(*stopped, 1000);
  EXPECT_LT(*stopped, whole / 100);
}

grpc::ByteBuffer Buffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

TEST(ParseBudgetTest, DeserializationRefusesOnlyWhatPassesTheBudget) {
  using Traits = grpc::SerializationTraits<v1::BatchDecodeRequest>;
  // 4 Mi empty steps in 8 MiB: gigabytes once parsed.
  const std::string empty_steps = Repeat(Wire().Bytes(1, "").str(), 4 << 20);
  grpc::ByteBuffer buffer = Buffer(empty_steps);
  v1::BatchDecodeRequest message;
  const grpc::Status refused = Traits::Deserialize(&buffer, &message);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_NE(refused.error_message().find("bytes of memory"), std::string::npos)
      << refused.error_message();
  EXPECT_EQ(message.steps_size(), 0);

  // Large real steps parse, through gRPC's own serialization.
  v1::BatchDecodeRequest batch;
  for (int i = 0; i < 64; ++i) {
    v1::DecodeRequest* step = batch.add_steps();
    step->set_session_id("s");
    step->mutable_q()->add_shape(1);
    step->mutable_q()->set_data(std::string(512 << 10, 'q'));
  }
  grpc::ByteBuffer serialized;
  bool own = false;
  ASSERT_TRUE(Traits::Serialize(batch, &serialized, &own).ok());
  ASSERT_GT(serialized.Length(), size_t{32} << 20);
  v1::BatchDecodeRequest parsed;
  ASSERT_TRUE(Traits::Deserialize(&serialized, &parsed).ok());
  EXPECT_EQ(parsed.SerializeAsString(), batch.SerializeAsString());

  // Below the size the scan starts at, even costly shapes pass to protobuf.
  grpc::ByteBuffer small = Buffer(Repeat(Wire().Bytes(1, "").str(), 1000));
  EXPECT_TRUE(Traits::Deserialize(&small, &parsed).ok());
  EXPECT_EQ(parsed.steps_size(), 1000);
  // Malformed bytes fail as before (here from the scan).
  grpc::ByteBuffer garbage = Buffer(std::string(1 << 20, '\xff'));
  EXPECT_FALSE(Traits::Deserialize(&garbage, &parsed).ok());
}

// The server's interceptor tells a streamed message that did not parse
// from the stream's end by the thread's note of the failed message.
TEST(ParseBudgetTest, AFailedDeserializationIsNotedForItsThreadOnce) {
  using Traits = grpc::SerializationTraits<v1::DecodeRequest>;
  EXPECT_EQ(TakeUnparsedMessage(), nullptr);
  v1::DecodeRequest message;
  grpc::ByteBuffer garbage = Buffer("\xff\xff\xff\xff\x0f");
  ASSERT_FALSE(Traits::Deserialize(&garbage, &message).ok());
  EXPECT_EQ(TakeUnparsedMessage(), &message);
  EXPECT_EQ(TakeUnparsedMessage(), nullptr);  // taken
  // A later success on the thread clears an untaken note; so would a
  // deserialization on another thread not.
  ASSERT_FALSE(Traits::Deserialize(&garbage, &message).ok());
  std::thread([] {
    v1::DecodeRequest other;
    grpc::ByteBuffer also_garbage = Buffer("\xff\xff\xff\xff\x0f");
    EXPECT_FALSE(Traits::Deserialize(&also_garbage, &other).ok());
  }).join();
  EXPECT_EQ(TakeUnparsedMessage(), &message);
  ASSERT_FALSE(Traits::Deserialize(&garbage, &message).ok());
  grpc::ByteBuffer valid = Buffer(std::string("\x0a\x01s", 3));
  ASSERT_TRUE(Traits::Deserialize(&valid, &message).ok());
  EXPECT_EQ(message.session_id(), "s");
  EXPECT_EQ(TakeUnparsedMessage(), nullptr);
}

}  // namespace
}  // namespace attention::proto
