#include "core/tensor.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attention {

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return count;
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  if (shape.size() <= kMaxTensorRank) {
    return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
  }
  return absl::StrCat("[", absl::StrJoin(shape.first(kMaxTensorRank), ", "),
                      ", ... (", shape.size(), " dimensions)]");
}

absl::Status TensorView::Validate(absl::string_view what, int rank) const {
  if (static_cast<int>(shape.size()) != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must have rank ", rank, ", got shape ",
                     ShapeString(shape), " (rank ", shape.size(), ")"));
  }
  // Check each dimension and guard the element count against overflow so a
  // hostile shape cannot wrap around to a small byte size.
  const int64_t element_size = DTypeSize(dtype);
  const int64_t max_elements =
      std::numeric_limits<int64_t>::max() / element_size;
  int64_t count = 1;
  for (int i = 0; i < rank; ++i) {
    if (shape[i] <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " dimension ", i, " must be positive, got shape ",
                       ShapeString(shape)));
    }
    if (count > max_elements / shape[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " shape ", ShapeString(shape), " has too many elements"));
    }
    count *= shape[i];
  }
  const int64_t expected = count * element_size;
  if (size_bytes != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has ", size_bytes, " bytes of data but shape ",
                     ShapeString(shape), " of ", DTypeName(dtype), " needs ",
                     expected, " bytes"));
  }
  if (data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has no data"));
  }
  return absl::OkStatus();
}

Tensor::Tensor(DType dtype, Shape shape)
    : dtype_(dtype),
      shape_(std::move(shape)),
      bytes_(static_cast<size_t>(NumElements(shape_) * DTypeSize(dtype)),
             std::byte{0}) {}

TensorView Tensor::view() const {
  TensorView view;
  view.dtype = dtype_;
  view.shape = shape_;
  view.data = bytes_.data();
  view.size_bytes = size_bytes();
  return view;
}

TensorView FloatView(absl::Span<const float> values, Shape shape) {
  TensorView view;
  view.dtype = DType::kFloat32;
  view.shape = std::move(shape);
  view.data = reinterpret_cast<const std::byte*>(values.data());
  view.size_bytes = static_cast<int64_t>(values.size() * sizeof(float));
  return view;
}

}  // namespace attention
