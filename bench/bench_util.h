// Small helpers the attn-bench sections share: medians, tensor views of
// host buffers, and aborting on a setup failure.
#ifndef ATTENTION_BENCH_BENCH_UTIL_H_
#define ATTENTION_BENCH_BENCH_UTIL_H_

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace attention::bench {

// The median (the mean of the middle two for an even count).
inline double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Reports `status` of step `what` of section `section` and aborts: a bench
// whose setup fails measures nothing.
[[noreturn]] inline void Die(const char* section, const absl::Status& status,
                             const char* what) {
  std::fprintf(stderr, "%s bench: %s: %s\n", section, what,
               status.ToString().c_str());
  std::abort();
}

// A view of `data` as a dense tensor of `shape` and `dtype`.
inline TensorView ViewOf(DType dtype, Shape shape, const void* data) {
  TensorView view;
  view.dtype = dtype;
  view.shape = std::move(shape);
  view.data = static_cast<const std::byte*>(data);
  view.size_bytes = view.num_elements() * DTypeSize(dtype);
  return view;
}

}  // namespace attention::bench

#endif  // ATTENTION_BENCH_BENCH_UTIL_H_
