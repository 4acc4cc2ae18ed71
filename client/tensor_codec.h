// Building attention.v1.Tensor messages from floats and decoding them back.
#ifndef ATTENTION_CLIENT_TENSOR_CODEC_H_
#define ATTENTION_CLIENT_TENSOR_CODEC_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/v1/attention.pb.h"

namespace attention::client {

// Number of elements of `shape` (1 for rank 0); -1 when a dimension is
// negative or the product does not fit an int64 (a shape from a malformed
// reply): check it before sizing a buffer from it.
int64_t NumElements(absl::Span<const int64_t> shape);

// Bytes per element of `dtype`: 4 or 2; 0 for DTYPE_UNSPECIFIED or an
// unknown value.
int64_t DTypeBytes(v1::DType dtype);

// A Tensor of `dtype` holding `values` (row-major) with `shape`. Values are
// rounded to nearest even for float16/bfloat16. INVALID_ARGUMENT when `dtype`
// is unspecified or unknown, a dimension is not positive, values.size() is
// not the product of `shape`, or a finite value overflows `dtype` (e.g. 1e5
// in float16). NaN and Inf pass through unchanged (the server rejects them).
absl::StatusOr<v1::Tensor> MakeTensor(absl::Span<const float> values,
                                      absl::Span<const int64_t> shape,
                                      v1::DType dtype = v1::DTYPE_FLOAT32);

// The elements of `tensor` as floats (exact for every dtype).
// INVALID_ARGUMENT when the dtype is unknown or the data size does not match
// the shape.
absl::StatusOr<std::vector<float>> TensorToFloats(const v1::Tensor& tensor);

}  // namespace attention::client

#endif  // ATTENTION_CLIENT_TENSOR_CODEC_H_
