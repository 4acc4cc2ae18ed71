// Helpers for core tests: random tensors that own their bytes.
#ifndef ATTENTION_TESTS_CORE_TEST_TENSORS_H_
#define ATTENTION_TESTS_CORE_TEST_TENSORS_H_

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace attention::testing {

// A tensor of random normal values stored in `dtype`, with a float copy of
// the exact stored values.
struct HostTensor {
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<std::byte> bytes;
  std::vector<float> values;  // the stored values, widened to float

  TensorView view() const {
    TensorView v;
    v.dtype = dtype;
    v.shape = shape;
    v.data = bytes.data();
    v.size_bytes = static_cast<int64_t>(bytes.size());
    return v;
  }
  // Rows [begin, end) of the outermost dimension, as a view.
  TensorView rows(int64_t begin, int64_t end) const {
    TensorView v = view();
    const int64_t row_bytes = static_cast<int64_t>(bytes.size()) / shape[0];
    v.shape[0] = end - begin;
    v.data = bytes.data() + begin * row_bytes;
    v.size_bytes = (end - begin) * row_bytes;
    return v;
  }
};

inline HostTensor RandomTensor(Shape shape, std::mt19937& rng,
                               DType dtype = DType::kFloat32,
                               float stddev = 1.0f) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = shape;
  const int64_t n = NumElements(shape);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> raw(n);
  for (float& x : raw) x = normal(rng);
  t.bytes.resize(n * DTypeSize(dtype));
  ConvertFromFloat(raw.data(), n, dtype, t.bytes.data());
  t.values.resize(n);
  ConvertToFloat(dtype, t.bytes.data(), n, t.values.data());
  return t;
}

inline HostTensor FloatTensor(Shape shape, std::vector<float> values) {
  HostTensor t;
  t.shape = shape;
  t.values = std::move(values);
  t.bytes.resize(t.values.size() * 4);
  std::memcpy(t.bytes.data(), t.values.data(), t.bytes.size());
  return t;
}

inline std::vector<float> ToFloats(const Tensor& t) {
  std::vector<float> out(t.num_elements());
  ConvertToFloat(t.dtype(), t.data(), t.num_elements(), out.data());
  return out;
}

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_CORE_TEST_TENSORS_H_
