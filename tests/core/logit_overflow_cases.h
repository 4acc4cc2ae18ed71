// Boundary cases of the logit-overflow rule (attention_problem.h), run on
// every backend: the CPU's tests always, the CUDA backend's with a GPU. One
// query row and one key over host memory; the key's dot product with q is
// q_value * k_value (one non-zero element each), its logit that times
// `scale`.
#ifndef ATTENTION_TESTS_CORE_LOGIT_OVERFLOW_CASES_H_
#define ATTENTION_TESTS_CORE_LOGIT_OVERFLOW_CASES_H_

#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/attention_problem.h"
#include "core/backend.h"
#include "core/dtype.h"
#include "core/kv_view.h"

namespace attention::testing {

struct LogitOverflowCase {
  std::string name;
  DType kv_dtype = DType::kFloat16;
  float q_value = 1.0f;
  float k_value = 1.0f;
  float scale = 1.0f;
  bool overflows = false;
};

inline std::vector<LogitOverflowCase> LogitOverflowCases() {
  const auto p2 = [](int e) { return std::ldexp(1.0f, e); };
  std::vector<LogitOverflowCase> cases;
  for (DType kv : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const std::string d(DTypeName(kv));
    // |q| >= 2^116 with a finite logit (the GPU's fp16 path used to clamp).
    cases.push_back({d + "_huge_q_finite", kv, p2(118), 1.0f, 1.0f, false});
    cases.push_back(
        {d + "_huge_q_small_scale", kv, p2(126), 1.0f, p2(-10), false});
    // q.k overflows float32 although q.k * scale would fit.
    cases.push_back({d + "_dot_overflows_before_scale", kv, p2(120), p2(12),
                     p2(-20), true});
    // The scaling overflows; or just fits.
    cases.push_back(
        {d + "_scaled_overflows", kv, p2(100), p2(12), p2(20), true});
    cases.push_back({d + "_scaled_fits", kv, p2(100), p2(12), p2(10), false});
    // Tiny q (the fp16 path used to clamp its rescaling at 2^100).
    cases.push_back({d + "_tiny_q", kv, p2(-120), 1.0f, 1.0f, false});
  }
  return cases;
}

// Runs `c` on `backend`: q [1, 1, 16] float32, one key, value 1s. Writes
// the output row (16 floats) and the lse.
inline absl::Status RunLogitOverflowCase(AttentionBackend& backend,
                                         const LogitOverflowCase& c,
                                         std::vector<float>* output,
                                         float* lse) {
  constexpr int kDim = 16;
  std::vector<float> q(kDim, 0.0f);
  q[3] = c.q_value;
  std::vector<float> k(kDim, 0.0f);
  k[3] = c.k_value;
  std::vector<float> v(kDim, 1.0f);
  const int64_t element = DTypeSize(c.kv_dtype);
  std::vector<std::byte> k_bytes(kDim * element);
  std::vector<std::byte> v_bytes(kDim * element);
  ConvertFromFloat(k.data(), kDim, c.kv_dtype, k_bytes.data());
  ConvertFromFloat(v.data(), kDim, c.kv_dtype, v_bytes.data());
  TensorView q_view{DType::kFloat32,
                    {1, 1, kDim},
                    reinterpret_cast<const std::byte*>(q.data()),
                    kDim * 4};
  TensorView k_view{c.kv_dtype,
                    {1, 1, kDim},
                    k_bytes.data(),
                    static_cast<int64_t>(k_bytes.size())};
  TensorView v_view{c.kv_dtype,
                    {1, 1, kDim},
                    v_bytes.data(),
                    static_cast<int64_t>(v_bytes.size())};
  const std::byte* storage[2];
  AttentionProblem problem;
  problem.q = q_view;
  problem.kv = ContiguousKvView(k_view, v_view, storage);
  problem.mask.causal = false;
  problem.scale = c.scale;
  output->assign(kDim, 0.0f);
  problem.output = output->data();
  problem.lse = lse;
  return backend.Attend(absl::MakeConstSpan(&problem, 1));
}

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_CORE_LOGIT_OVERFLOW_CASES_H_
