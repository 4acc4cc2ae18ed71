// Dense row-major tensors: a non-owning view (TensorView) used for inputs,
// and an owning Tensor used for results.
#ifndef ATTENTION_CORE_TENSOR_H_
#define ATTENTION_CORE_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/dtype.h"

namespace attention {

using Shape = absl::InlinedVector<int64_t, 4>;

// Number of elements of `shape` (1 for rank 0).
int64_t NumElements(absl::Span<const int64_t> shape);

// The most dimensions any tensor of the API has is 3; a shape from a client
// with more than this many is refused before anything else looks at it.
inline constexpr int kMaxTensorRank = 8;

// "[2, 3, 4]". A shape of more than kMaxTensorRank dimensions shows only
// its first kMaxTensorRank and their count ("[1, 1, 1, 1, 1, 1, 1, 1, ...
// (300000 dimensions)]"), so an error quoting a client's shape stays short.
std::string ShapeString(absl::Span<const int64_t> shape);

// A read-only view of caller-owned tensor bytes. Cheap to copy. The caller
// keeps the bytes alive and unchanged while any view of them is in use.
struct TensorView {
  DType dtype = DType::kFloat32;
  Shape shape;
  const std::byte* data = nullptr;
  int64_t size_bytes = 0;  // as given by the caller; Validate() checks it

  int64_t num_elements() const { return NumElements(shape); }
  int rank() const { return static_cast<int>(shape.size()); }
  int64_t dim(int i) const { return shape[i]; }

  // OK when the view has rank `rank`, every dimension is positive, and
  // size_bytes == num_elements() * DTypeSize(dtype). Otherwise
  // INVALID_ARGUMENT naming the tensor `what`.
  absl::Status Validate(absl::string_view what, int rank) const;
};

// An owning tensor (bytes held in a std::vector; at least 16-byte aligned).
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, Shape shape);  // zero-filled

  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t num_elements() const { return NumElements(shape_); }
  int64_t size_bytes() const { return num_elements() * DTypeSize(dtype_); }
  std::byte* data() { return bytes_.data(); }
  const std::byte* data() const { return bytes_.data(); }
  // REQUIRES: dtype() == kFloat32.
  float* float_data() { return reinterpret_cast<float*>(bytes_.data()); }
  const float* float_data() const {
    return reinterpret_cast<const float*>(bytes_.data());
  }
  TensorView view() const;

 private:
  DType dtype_ = DType::kFloat32;
  Shape shape_;
  std::vector<std::byte> bytes_;
};

// Builds a float32 view of `values` with `shape` (used by tests and tools).
TensorView FloatView(absl::Span<const float> values, Shape shape);

}  // namespace attention

#endif  // ATTENTION_CORE_TENSOR_H_
