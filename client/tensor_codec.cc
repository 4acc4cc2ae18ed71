#include "client/tensor_codec.h"

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"

namespace attention::client {
namespace {

absl::StatusOr<DType> CoreDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("tensor dtype ", static_cast<int>(dtype),
                   " is not DTYPE_FLOAT32, DTYPE_FLOAT16 or DTYPE_BFLOAT16"));
}

}  // namespace

int64_t NumElements(absl::Span<const int64_t> shape) {
  for (int64_t dim : shape) {
    if (dim < 0) return -1;
  }
  for (int64_t dim : shape) {
    if (dim == 0) return 0;
  }
  int64_t count = 1;
  for (int64_t dim : shape) {
    if (__builtin_mul_overflow(count, dim, &count)) return -1;
  }
  return count;
}

int64_t DTypeBytes(v1::DType dtype) {
  auto core = CoreDType(dtype);
  return core.ok() ? DTypeSize(*core) : 0;
}

absl::StatusOr<v1::Tensor> MakeTensor(absl::Span<const float> values,
                                      absl::Span<const int64_t> shape,
                                      v1::DType dtype) {
  auto core_dtype = CoreDType(dtype);
  if (!core_dtype.ok()) return core_dtype.status();
  int64_t count = 1;
  for (int64_t dim : shape) {
    if (dim <= 0 || dim > (int64_t{1} << 40) / count) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape [", absl::StrJoin(shape, ", "),
                       "] must have positive dimensions of sane size"));
    }
    count *= dim;
  }
  if (count != static_cast<int64_t>(values.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape [", absl::StrJoin(shape, ", "), "] needs ", count,
                     " values but ", values.size(), " were given"));
  }
  v1::Tensor tensor;
  tensor.set_dtype(dtype);
  tensor.mutable_shape()->Add(shape.begin(), shape.end());
  std::string* data = tensor.mutable_data();
  data->resize(static_cast<size_t>(count * DTypeSize(*core_dtype)));
  if (absl::Status status = ConvertFromFloatChecked(
          values.data(), count, *core_dtype,
          reinterpret_cast<std::byte*>(data->data()), "tensor values");
      !status.ok()) {
    return status;
  }
  return tensor;
}

absl::StatusOr<std::vector<float>> TensorToFloats(const v1::Tensor& tensor) {
  auto core_dtype = CoreDType(tensor.dtype());
  if (!core_dtype.ok()) return core_dtype.status();
  int64_t count = 1;
  for (int64_t dim : tensor.shape()) {
    if (dim <= 0 || dim > (int64_t{1} << 40) / count) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor shape [", absl::StrJoin(tensor.shape(), ", "),
                       "] has a non-positive or huge dimension"));
    }
    count *= dim;
  }
  const int64_t expected_bytes = count * DTypeSize(*core_dtype);
  if (static_cast<int64_t>(tensor.data().size()) != expected_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor of shape [", absl::StrJoin(tensor.shape(), ", "),
                     "] and ", DTypeName(*core_dtype), " needs ",
                     expected_bytes, " bytes but has ", tensor.data().size()));
  }
  std::vector<float> values(static_cast<size_t>(count));
  ConvertToFloat(*core_dtype,
                 reinterpret_cast<const std::byte*>(tensor.data().data()),
                 count, values.data());
  return values;
}

}  // namespace attention::client
