#include "tests/core/reference_attention.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace attention::testing {

bool ReferenceKeyVisible(const MaskSpec& mask, int64_t position, int64_t key) {
  if (mask.causal && key > position) return false;
  if (mask.window == 0) return true;
  return position - key < mask.window || key < mask.num_sink_tokens;
}

absl::StatusOr<ReferenceOutputs> ReferenceAttention(const ReferenceInputs& in) {
  const double kInf = std::numeric_limits<double>::infinity();
  // The smallest magnitude float32 rounds to infinity: FLT_MAX plus half
  // an ulp (the contract's "not finite" in float32).
  const double kFloatOverflow = 0x1.ffffffp+127;
  const int64_t T = in.num_queries;
  const int64_t Tk = in.num_keys;
  const int H = in.num_heads;
  const int Hkv = in.num_kv_heads;
  const int D = in.head_dim;
  const int Dv = in.value_dim;
  const int group = H / Hkv;

  ReferenceOutputs out;
  out.output.assign(T * H * Dv, 0.0);
  out.lse.assign(T * H, -kInf);
  out.weights.assign(H * T * Tk, 0.0);

  std::vector<double> scores(Tk);
  for (int h = 0; h < H; ++h) {
    const int g = in.tile_kv_heads ? h % Hkv : h / group;
    for (int64_t i = 0; i < T; ++i) {
      const int64_t position = in.mask.query_start + i;
      // Scores of every key; -inf marks a forbidden one.
      bool has_token = false;
      double token_max = -kInf;
      for (int64_t j = 0; j < Tk; ++j) {
        scores[j] = -kInf;
        if (!ReferenceKeyVisible(in.mask, position, j)) continue;
        double bias = 0.0;
        if (in.bias_rank == 2) bias = in.bias[i * Tk + j];
        if (in.bias_rank == 3) bias = in.bias[(h * T + i) * Tk + j];
        if (bias == -kInf) continue;
        double dot = 0.0;
        for (int d = 0; d < D; ++d) {
          dot += static_cast<double>(in.q[(i * H + h) * D + d]) *
                 in.k[(j * Hkv + g) * D + d];
        }
        double s = dot * in.scale;
        // q.k alone past the float32 range overflows too, whatever the
        // scale (the backends compute it in float32 before scaling).
        if (std::abs(dot) >= kFloatOverflow || std::abs(s) >= kFloatOverflow) {
          return absl::InvalidArgumentError(
              absl::StrCat("reference: Q @ K^T overflowed at row ", i));
        }
        s += bias;
        if (std::abs(s) >= kFloatOverflow) {
          return absl::InvalidArgumentError(
              absl::StrCat("reference: adding the bias overflowed at row ", i));
        }
        scores[j] = s;
        has_token = true;
        token_max = std::max(token_max, s);
      }
      const bool has_sink = !in.sink_logits.empty();
      if (!has_token && !has_sink) {
        if (in.empty_row_policy == EmptyRowPolicy::kError) {
          return absl::InvalidArgumentError(
              absl::StrCat("reference: row ", i, " head ", h, " sees no key"));
        }
        continue;  // zeros, lse -inf
      }
      const double row_max =
          has_sink ? std::max(token_max, double{in.sink_logits[h]}) : token_max;
      double denominator =
          has_sink ? std::exp(in.sink_logits[h] - row_max) : 0.0;
      for (int64_t j = 0; j < Tk; ++j) {
        if (scores[j] != -kInf) denominator += std::exp(scores[j] - row_max);
      }
      for (int64_t j = 0; j < Tk; ++j) {
        if (scores[j] == -kInf) continue;
        const double w = std::exp(scores[j] - row_max) / denominator;
        out.weights[(h * T + i) * Tk + j] = w;
        for (int d = 0; d < Dv; ++d) {
          out.output[(i * H + h) * Dv + d] += w * in.v[(j * Hkv + g) * Dv + d];
        }
      }
      out.lse[i * H + h] = row_max + std::log(denominator);
    }
  }
  return out;
}

}  // namespace attention::testing
