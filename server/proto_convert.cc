#include "server/proto_convert.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/session_spec.h"
#include "core/status_macros.h"

namespace attention::server {
namespace {

// "steps[2].q" from ("steps[2]", "q"); just "q" without a prefix.
std::string FieldName(absl::string_view prefix, absl::string_view field) {
  if (prefix.empty()) return std::string(field);
  return absl::StrCat(prefix, ".", field);
}

// Largest byte size a tensor may declare; keeps every later size computation
// (elements * dtype size, offsets) far from int64 overflow.
constexpr int64_t kMaxTensorBytes = int64_t{1} << 48;

// The view of an optional tensor that is set, or its error: never a
// scalar, since one set without a shape would pass for unset.
absl::Status RequireShape(const absl::StatusOr<TensorView>& view,
                          absl::string_view name) {
  if (!view.ok()) return view.status();
  if (view->shape.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        name,
        " is set but has no shape: give its shape, or leave it unset where "
        "the layer does not take it"));
  }
  return absl::OkStatus();
}

template <typename Request>
absl::StatusOr<AppendRequest> AppendFromProto(const Request& request,
                                              absl::string_view prefix) {
  AppendRequest out;
  out.session_id = request.session_id();
  out.layer = request.layer();
  auto q = TensorViewFromProto(request.q(), FieldName(prefix, "q"));
  if (!q.ok()) return q.status();
  auto k = TensorViewFromProto(request.k(), FieldName(prefix, "k"));
  if (!k.ok()) return k.status();
  // An unset v is an empty view: what a shared-latent session expects (its
  // values are read from k); any other session rejects it.
  absl::StatusOr<TensorView> v = TensorView();
  if (request.has_v()) {
    v = TensorViewFromProto(request.v(), FieldName(prefix, "v"));
    ATTN_RETURN_IF_ERROR(RequireShape(v, FieldName(prefix, "v")));
  }
  if (!v.ok()) return v.status();
  auto output_dtype = OptionalDTypeFromProto(request.output_dtype(),
                                             FieldName(prefix, "output_dtype"));
  if (!output_dtype.ok()) return output_dtype.status();
  out.q = *std::move(q);
  out.k = *std::move(k);
  out.v = *std::move(v);
  out.output_dtype = *output_dtype;
  out.return_lse = request.return_lse();
  // Index inputs of top-k layers; unset ones stay empty views.
  const struct {
    bool present;
    const v1::Tensor& tensor;
    const char* name;
    TensorView* view;
  } index_inputs[] = {
      {request.has_index_k(), request.index_k(), "index_k", &out.index_k},
      {request.has_index_q(), request.index_q(), "index_q", &out.index_q},
      {request.has_index_weights(), request.index_weights(), "index_weights",
       &out.index_weights},
  };
  for (const auto& input : index_inputs) {
    if (!input.present) continue;
    auto view = TensorViewFromProto(input.tensor, FieldName(prefix, input.name));
    ATTN_RETURN_IF_ERROR(RequireShape(view, FieldName(prefix, input.name)));
    *input.view = *std::move(view);
  }
  out.return_topk_indices = request.return_topk_indices();
  return out;
}

}  // namespace

absl::StatusOr<DType> TensorDTypeFromProto(v1::DType dtype,
                                           absl::string_view what) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_UNSPECIFIED:
      return absl::InvalidArgumentError(absl::StrCat(
          what,
          " has no dtype (is the tensor missing?): set Tensor.dtype to "
          "DTYPE_FLOAT32, DTYPE_FLOAT16 or DTYPE_BFLOAT16"));
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, " has unknown dtype ", static_cast<int>(dtype),
                   "; use DTYPE_FLOAT32, DTYPE_FLOAT16 or DTYPE_BFLOAT16"));
}

absl::StatusOr<DType> OptionalDTypeFromProto(v1::DType dtype,
                                             absl::string_view what) {
  if (dtype == v1::DTYPE_UNSPECIFIED) return DType::kFloat32;
  return TensorDTypeFromProto(dtype, what);
}

v1::DType DTypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return v1::DTYPE_FLOAT32;
    case DType::kFloat16:
      return v1::DTYPE_FLOAT16;
    case DType::kBFloat16:
      return v1::DTYPE_BFLOAT16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<TensorView> TensorViewFromProto(const v1::Tensor& tensor,
                                               absl::string_view what) {
  auto dtype = TensorDTypeFromProto(tensor.dtype(), absl::StrCat(what));
  if (!dtype.ok()) return dtype.status();
  if (tensor.shape_size() > kMaxTensorRank) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " has ", tensor.shape_size(), " dimensions; tensors of this API ",
        "have at most ", kMaxTensorRank, " (see the proto for each shape)"));
  }
  TensorView view;
  view.dtype = *dtype;
  view.shape.assign(tensor.shape().begin(), tensor.shape().end());
  int64_t bytes = DTypeSize(view.dtype);
  for (int i = 0; i < tensor.shape_size(); ++i) {
    const int64_t dim = tensor.shape(i);
    if (dim <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ".shape[", i, "] is ", dim, " in shape ",
          ShapeString(view.shape), "; every dimension must be positive"));
    }
    if (dim > kMaxTensorBytes / bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " shape ", ShapeString(view.shape),
                       " is too large to be a tensor"));
    }
    bytes *= dim;
  }
  // A view, not a copy: the request's bytes stay where gRPC parsed them.
  view.data = reinterpret_cast<const std::byte*>(tensor.data().data());
  view.size_bytes = static_cast<int64_t>(tensor.data().size());
  // Checked here already (TensorView::Validate checks it again): what is
  // sized from the shape before validation (the reply-size bound) then
  // sees only shapes its data backs.
  if (view.size_bytes != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " has ", view.size_bytes, " bytes of data but shape ",
        ShapeString(view.shape), " of ", DTypeName(view.dtype), " needs ",
        bytes, " bytes"));
  }
  return view;
}

void TensorToProto(const Tensor& tensor, v1::Tensor* out) {
  out->Clear();
  out->set_dtype(DTypeToProto(tensor.dtype()));
  for (int64_t dim : tensor.shape()) out->add_shape(dim);
  out->set_data(reinterpret_cast<const char*>(tensor.data()),
                static_cast<size_t>(tensor.size_bytes()));
}

absl::StatusOr<SessionSpec> SessionSpecFromProto(const v1::SessionSpec& spec) {
  SessionSpec out;
  out.num_layers = spec.num_layers();
  out.num_q_heads = spec.num_q_heads();
  out.num_kv_heads = spec.num_kv_heads();
  out.head_dim = spec.head_dim();
  out.value_dim = spec.value_dim();
  auto kv_dtype = OptionalDTypeFromProto(spec.kv_dtype(), "spec.kv_dtype");
  if (!kv_dtype.ok()) return kv_dtype.status();
  out.kv_dtype = *kv_dtype;
  out.scale = spec.scale();
  ATTN_RETURN_IF_ERROR(
      CheckLayerEntries(spec.layers_size(), spec.num_layers()));
  out.layers.reserve(spec.layers_size());
  for (const v1::LayerSpec& layer : spec.layers()) {
    LayerSpec& converted = out.layers.emplace_back();
    converted.window = layer.window();
    converted.num_sink_tokens = layer.num_sink_tokens();
    converted.sink_logits.assign(layer.sink_logits().begin(),
                                 layer.sink_logits().end());
    converted.topk = layer.topk();
    switch (layer.index_score()) {
      case v1::INDEX_SCORE_UNSPECIFIED:
      case v1::INDEX_SCORE_IDENTITY:
        converted.index_score = IndexScore::kIdentity;
        break;
      case v1::INDEX_SCORE_RELU:
        converted.index_score = IndexScore::kRelu;
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "spec.layers[", out.layers.size() - 1,
            "].index_score has unknown value ", layer.index_score(),
            "; use INDEX_SCORE_IDENTITY or INDEX_SCORE_RELU"));
    }
  }
  out.index_dim = spec.index_dim();
  out.index_heads = spec.index_heads();
  out.max_tokens = spec.max_tokens();
  out.model = spec.model();
  switch (spec.kv_layout()) {
    case v1::KV_LAYOUT_UNSPECIFIED:
    case v1::KV_LAYOUT_SEPARATE:
      out.kv_layout = KvLayout::kSeparate;
      break;
    case v1::KV_LAYOUT_SHARED_LATENT:
      out.kv_layout = KvLayout::kSharedLatent;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.kv_layout has unknown value ", spec.kv_layout(),
          "; use KV_LAYOUT_SEPARATE or KV_LAYOUT_SHARED_LATENT"));
  }
  return out;
}

void SessionSpecToProto(const SessionSpec& spec, v1::SessionSpec* out) {
  out->Clear();
  out->set_num_layers(spec.num_layers);
  out->set_num_q_heads(spec.num_q_heads);
  out->set_num_kv_heads(spec.num_kv_heads);
  out->set_head_dim(spec.head_dim);
  out->set_value_dim(spec.value_dim);
  out->set_kv_dtype(DTypeToProto(spec.kv_dtype));
  out->set_scale(spec.scale);
  for (const LayerSpec& layer : spec.layers) {
    v1::LayerSpec* converted = out->add_layers();
    converted->set_window(layer.window);
    converted->set_num_sink_tokens(layer.num_sink_tokens);
    converted->mutable_sink_logits()->Add(layer.sink_logits.begin(),
                                          layer.sink_logits.end());
    converted->set_topk(layer.topk);
    // Defaults stay unset, as in the request.
    if (layer.index_score == IndexScore::kRelu) {
      converted->set_index_score(v1::INDEX_SCORE_RELU);
    }
  }
  out->set_index_dim(spec.index_dim);
  out->set_index_heads(spec.index_heads);
  out->set_max_tokens(spec.max_tokens);
  out->set_model(spec.model);
  if (spec.kv_layout == KvLayout::kSharedLatent) {
    out->set_kv_layout(v1::KV_LAYOUT_SHARED_LATENT);
  }
}

void SessionInfoToProto(const SessionInfo& info, v1::SessionInfo* out) {
  out->Clear();
  out->set_session_id(info.session_id);
  SessionSpecToProto(info.spec, out->mutable_spec());
  out->mutable_layer_lengths()->Add(info.layer_lengths.begin(),
                                    info.layer_lengths.end());
  out->set_kv_cache_bytes(info.kv_cache_bytes);
  out->set_metadata_bytes(info.metadata_bytes);
}

absl::StatusOr<EmptyRowPolicy> EmptyRowPolicyFromProto(
    v1::EmptyRowPolicy policy) {
  switch (policy) {
    case v1::EMPTY_ROW_POLICY_UNSPECIFIED:
    case v1::EMPTY_ROW_POLICY_ERROR:
      return EmptyRowPolicy::kError;
    case v1::EMPTY_ROW_POLICY_ZERO:
      return EmptyRowPolicy::kZero;
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "empty_row_policy has unknown value ", static_cast<int>(policy),
      "; use EMPTY_ROW_POLICY_ERROR or EMPTY_ROW_POLICY_ZERO"));
}

absl::StatusOr<AppendRequest> AppendRequestFromProto(
    const v1::PrefillRequest& request) {
  auto out = AppendFromProto(request, "");
  if (out.ok())
    out->message_bytes = static_cast<int64_t>(request.ByteSizeLong());
  return out;
}

absl::StatusOr<AppendRequest> AppendRequestFromProto(
    const v1::DecodeRequest& request, absl::string_view what) {
  auto out = AppendFromProto(request, what);
  if (out.ok()) {
    out->required_tokens = 1;
    out->message_bytes = static_cast<int64_t>(request.ByteSizeLong());
  }
  return out;
}

absl::StatusOr<std::vector<AppendRequest>> AppendRequestsFromProto(
    const v1::BatchDecodeRequest& request) {
  // Empty steps take 2 bytes on the wire each, and a step's AppendRequest
  // some 400.
  if (request.steps_size() > kMaxBatchDecodeSteps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BatchDecode carries ", request.steps_size(), " steps; at most ",
        kMaxBatchDecodeSteps, " per call: split them over several calls"));
  }
  std::vector<AppendRequest> steps;
  steps.reserve(request.steps_size());
  int64_t step_bytes = 0;
  for (int i = 0; i < request.steps_size(); ++i) {
    ATTN_ASSIGN_OR_RETURN(
        AppendRequest step,
        AppendRequestFromProto(request.steps(i),
                               absl::StrCat("steps[", i, "]")));
    step_bytes += step.message_bytes;
    steps.push_back(std::move(step));
  }
  if (!steps.empty()) {
    steps[0].message_bytes += std::max<int64_t>(
        0, static_cast<int64_t>(request.ByteSizeLong()) - step_bytes);
  }
  return steps;
}

absl::StatusOr<StatelessRequest> StatelessRequestFromProto(
    const v1::AttentionRequest& request) {
  StatelessRequest out;
  auto q = TensorViewFromProto(request.q(), "q");
  if (!q.ok()) return q.status();
  auto k = TensorViewFromProto(request.k(), "k");
  if (!k.ok()) return k.status();
  auto v = TensorViewFromProto(request.v(), "v");
  if (!v.ok()) return v.status();
  out.q = *std::move(q);
  out.k = *std::move(k);
  out.v = *std::move(v);
  out.mask.causal = request.causal();
  out.mask.window = request.window();
  out.mask.num_sink_tokens = request.num_sink_tokens();
  out.mask.query_start = request.query_start();
  out.sink_logits.assign(request.sink_logits().begin(),
                         request.sink_logits().end());
  if (request.has_bias()) {
    auto bias = TensorViewFromProto(request.bias(), "bias");
    if (!bias.ok()) return bias.status();
    out.bias = *std::move(bias);
  }
  auto policy = EmptyRowPolicyFromProto(request.empty_row_policy());
  if (!policy.ok()) return policy.status();
  out.empty_row_policy = *policy;
  out.scale = request.scale();
  out.return_weights = request.return_weights();
  auto output_dtype =
      OptionalDTypeFromProto(request.output_dtype(), "output_dtype");
  if (!output_dtype.ok()) return output_dtype.status();
  out.output_dtype = *output_dtype;
  out.return_lse = request.return_lse();
  return out;
}

void AttentionOutputToProto(const AttentionOutput& output,
                            v1::AttentionResult* out) {
  out->Clear();
  TensorToProto(output.output, out->mutable_output());
  out->set_position(output.position);
  if (output.weights.has_value()) {
    TensorToProto(*output.weights, out->mutable_weights());
  }
  if (output.lse.has_value()) TensorToProto(*output.lse, out->mutable_lse());
  out->mutable_topk_indices()->Add(output.topk_indices.begin(),
                                   output.topk_indices.end());
}

}  // namespace attention::server
