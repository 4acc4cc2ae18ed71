#include "core/tensor.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

using ::testing::HasSubstr;

TEST(TensorTest, NumElementsAndShapeString) {
  EXPECT_EQ(NumElements({}), 1);
  EXPECT_EQ(NumElements({2, 3, 4}), 24);
  EXPECT_EQ(ShapeString({2, 3, 4}), "[2, 3, 4]");
  EXPECT_EQ(ShapeString({}), "[]");
  // A client's very long shape is quoted by its first dimensions only.
  EXPECT_EQ(ShapeString(std::vector<int64_t>(300000, 1)),
            "[1, 1, 1, 1, 1, 1, 1, 1, ... (300000 dimensions)]");
}

TEST(TensorTest, OwningTensorIsZeroFilledAndViewable) {
  Tensor t(DType::kFloat32, {2, 3});
  EXPECT_EQ(t.num_elements(), 6);
  EXPECT_EQ(t.size_bytes(), 24);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(t.float_data()[i], 0.0f);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 16, 0u);
  t.float_data()[5] = 7.0f;
  const TensorView view = t.view();
  EXPECT_TRUE(view.Validate("t", 2).ok());
  EXPECT_EQ(view.dim(1), 3);
  EXPECT_EQ(reinterpret_cast<const float*>(view.data)[5], 7.0f);

  Tensor half(DType::kBFloat16, {5});
  EXPECT_EQ(half.size_bytes(), 10);
  Tensor moved = std::move(half);
  EXPECT_EQ(moved.dtype(), DType::kBFloat16);
  EXPECT_EQ(moved.shape(), Shape({5}));
}

TEST(TensorTest, FloatViewDescribesTheSpan) {
  std::vector<float> values(12, 1.0f);
  const TensorView view = FloatView(values, {3, 4});
  EXPECT_EQ(view.dtype, DType::kFloat32);
  EXPECT_EQ(view.size_bytes, 48);
  EXPECT_EQ(view.rank(), 2);
  EXPECT_EQ(view.num_elements(), 12);
  EXPECT_TRUE(view.Validate("q", 2).ok());
}

TEST(TensorTest, ValidateRejectsBadViews) {
  std::vector<float> values(12, 1.0f);
  TensorView view = FloatView(values, {3, 4});

  absl::Status rank = view.Validate("q", 3);
  EXPECT_EQ(rank.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rank.message(), HasSubstr("q must have rank 3"));
  EXPECT_THAT(rank.message(), HasSubstr("[3, 4]"));

  TensorView wrong_size = view;
  wrong_size.size_bytes = 44;
  absl::Status size = wrong_size.Validate("k", 2);
  EXPECT_EQ(size.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(size.message(), HasSubstr("44 bytes"));
  EXPECT_THAT(size.message(), HasSubstr("48"));

  TensorView zero_dim = view;
  zero_dim.shape = {3, 0};
  zero_dim.size_bytes = 0;
  EXPECT_THAT(zero_dim.Validate("v", 2).message(), HasSubstr("positive"));

  TensorView negative = view;
  negative.shape = {-3, -4};
  EXPECT_EQ(negative.Validate("v", 2).code(),
            absl::StatusCode::kInvalidArgument);

  // A shape whose byte size would overflow int64 must not wrap around.
  TensorView huge = view;
  huge.shape = {int64_t{1} << 40, int64_t{1} << 40, 16};
  huge.size_bytes = 0;
  EXPECT_THAT(huge.Validate("q", 3).message(), HasSubstr("too many"));

  TensorView half = view;
  half.dtype = DType::kFloat16;
  EXPECT_FALSE(half.Validate("q", 2).ok());
  half.size_bytes = 24;
  EXPECT_TRUE(half.Validate("q", 2).ok());

  TensorView no_data = view;
  no_data.data = nullptr;
  EXPECT_FALSE(no_data.Validate("q", 2).ok());
}

}  // namespace
}  // namespace attention
