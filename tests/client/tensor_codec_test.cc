#include "client/tensor_codec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "gtest/gtest.h"

namespace attention::client {
namespace {

TEST(TensorCodecTest, Float32IsTheRawLittleEndianBytes) {
  const std::vector<float> values = {1.0f, -2.0f, 0.5f, 1e-30f, 3.25f, 7.0f};
  auto tensor = MakeTensor(values, {2, 3});
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  EXPECT_EQ(tensor->dtype(), v1::DTYPE_FLOAT32);
  ASSERT_EQ(tensor->shape_size(), 2);
  EXPECT_EQ(tensor->shape(0), 2);
  EXPECT_EQ(tensor->shape(1), 3);
  ASSERT_EQ(tensor->data().size(), values.size() * 4);
  EXPECT_EQ(std::memcmp(tensor->data().data(), values.data(), 24), 0);
  auto decoded = TensorToFloats(*tensor);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(*decoded, values);
}

TEST(TensorCodecTest, HalfTypesRoundToNearestEven) {
  const std::vector<float> values = {1.0f, 0.1f, -3.14159f, 65504.0f, 1e-3f};
  for (v1::DType dtype : {v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    auto tensor = MakeTensor(values, {5}, dtype);
    ASSERT_TRUE(tensor.ok()) << tensor.status();
    ASSERT_EQ(tensor->data().size(), 10u);
    auto decoded = TensorToFloats(*tensor);
    ASSERT_TRUE(decoded.ok());
    for (size_t i = 0; i < values.size(); ++i) {
      const float expected = dtype == v1::DTYPE_FLOAT16
                                 ? HalfToFloat(FloatToHalf(values[i]))
                                 : BFloat16ToFloat(FloatToBFloat16(values[i]));
      EXPECT_EQ((*decoded)[i], expected) << v1::DType_Name(dtype) << " " << i;
    }
    // Exactly representable values survive unchanged.
    EXPECT_EQ((*decoded)[0], 1.0f);
  }
}

TEST(TensorCodecTest, BadInputsAreInvalidArgument) {
  const std::vector<float> values = {1, 2, 3, 4};
  EXPECT_EQ(MakeTensor(values, {3}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeTensor(values, {4, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeTensor(values, {-4}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeTensor(values, {4}, v1::DTYPE_UNSPECIFIED).status().code(),
            absl::StatusCode::kInvalidArgument);
  // 1e5 overflows float16 but not bfloat16.
  const std::vector<float> large = {1e5f};
  EXPECT_EQ(MakeTensor(large, {1}, v1::DTYPE_FLOAT16).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(MakeTensor(large, {1}, v1::DTYPE_BFLOAT16).ok());
}

TEST(TensorCodecTest, NonFiniteValuesPassThroughForTheServerToJudge) {
  const std::vector<float> values = {std::numeric_limits<float>::quiet_NaN(),
                                     std::numeric_limits<float>::infinity()};
  auto tensor = MakeTensor(values, {2}, v1::DTYPE_FLOAT16);
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  auto decoded = TensorToFloats(*tensor);
  ASSERT_TRUE(decoded.ok());
  EXPECT_TRUE(std::isnan((*decoded)[0]));
  EXPECT_TRUE(std::isinf((*decoded)[1]));
}

TEST(TensorCodecTest, DecodingChecksSizeAndDType) {
  auto tensor = MakeTensor(std::vector<float>{1, 2}, {2});
  ASSERT_TRUE(tensor.ok());
  v1::Tensor short_data = *tensor;
  short_data.mutable_data()->resize(7);
  EXPECT_EQ(TensorToFloats(short_data).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::Tensor no_dtype = *tensor;
  no_dtype.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(TensorToFloats(no_dtype).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DTypeBytes(v1::DTYPE_FLOAT32), 4);
  EXPECT_EQ(DTypeBytes(v1::DTYPE_BFLOAT16), 2);
  EXPECT_EQ(DTypeBytes(v1::DTYPE_UNSPECIFIED), 0);
  EXPECT_EQ(NumElements({2, 3, 4}), 24);
}

// A shape from a malformed reply never overflows: -1 for a negative
// dimension or a product past int64, so that no buffer is sized from it.
TEST(TensorCodecTest, NumElementsOfAnyShapeIsDefined) {
  EXPECT_EQ(NumElements({}), 1);
  EXPECT_EQ(NumElements({7, 0, 3}), 0);
  EXPECT_EQ(NumElements({int64_t{1} << 40, 0, int64_t{1} << 40}), 0);
  EXPECT_EQ(NumElements({4, -1}), -1);
  EXPECT_EQ(NumElements({0, -1}), -1);
  EXPECT_EQ(NumElements({int64_t{1} << 31, int64_t{1} << 31}),
            int64_t{1} << 62);
  EXPECT_EQ(NumElements({int64_t{1} << 32, int64_t{1} << 31}), -1);
  EXPECT_EQ(NumElements({3, std::numeric_limits<int64_t>::max()}), -1);
}

}  // namespace
}  // namespace attention::client
