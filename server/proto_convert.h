// Translation between attention.v1 protobuf messages and core types.
//
// Only translation happens here: every semantic check (ranks, head counts,
// finiteness, mask parameters, spec limits) belongs to the engine. The one
// exception is what the engine cannot see: a Tensor without a dtype, an enum
// value this build does not know, or a shape whose size overflows.
// All such errors are INVALID_ARGUMENT with a message naming the field.
//
// Input tensors are NOT copied: a TensorView produced here points into the
// `data` bytes of the protobuf message, which must outlive the view and stay
// unchanged while it is used.
#ifndef ATTENTION_SERVER_PROTO_CONVERT_H_
#define ATTENTION_SERVER_PROTO_CONVERT_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.pb.h"
#include "core/attention_problem.h"
#include "core/dtype.h"
#include "core/engine.h"
#include "core/session.h"
#include "core/session_spec.h"
#include "core/tensor.h"

namespace attention::server {

// DType of a Tensor: must be set. INVALID_ARGUMENT naming `what` for
// DTYPE_UNSPECIFIED or an unknown value.
absl::StatusOr<DType> TensorDTypeFromProto(v1::DType dtype,
                                           absl::string_view what);

// An optional dtype (output_dtype, kv_dtype): DTYPE_UNSPECIFIED means
// float32. INVALID_ARGUMENT naming `what` for an unknown value.
absl::StatusOr<DType> OptionalDTypeFromProto(v1::DType dtype,
                                             absl::string_view what);

v1::DType DTypeToProto(DType dtype);

// A view of `tensor`'s bytes (no copy). `what` names the tensor in errors
// ("q", "steps[3].k", ...). Checks the dtype is set and the shape's byte
// size does not overflow; the engine checks rank, dimensions and size.
absl::StatusOr<TensorView> TensorViewFromProto(const v1::Tensor& tensor,
                                               absl::string_view what);

// Copies `tensor` into `out` (replacing its contents).
void TensorToProto(const Tensor& tensor, v1::Tensor* out);

// The spec as given (defaults are resolved by the engine).
absl::StatusOr<SessionSpec> SessionSpecFromProto(const v1::SessionSpec& spec);
void SessionSpecToProto(const SessionSpec& spec, v1::SessionSpec* out);

void SessionInfoToProto(const SessionInfo& info, v1::SessionInfo* out);

// UNSPECIFIED and ERROR mean kError.
absl::StatusOr<EmptyRowPolicy> EmptyRowPolicyFromProto(
    v1::EmptyRowPolicy policy);

// Prefill: any T. The request must outlive the result (views, see above).
// message_bytes = the request's encoded size.
absl::StatusOr<AppendRequest> AppendRequestFromProto(
    const v1::PrefillRequest& request);

// DecodeStep / Decode / BatchDecode: required_tokens = 1. `what` prefixes
// field names in errors (e.g. "steps[2]"); empty for a lone request.
absl::StatusOr<AppendRequest> AppendRequestFromProto(
    const v1::DecodeRequest& request, absl::string_view what = "");

// Most steps in one BatchDecode (attention.proto).
inline constexpr int kMaxBatchDecodeSteps = 65536;

// BatchDecode: each step as the DecodeRequest overload, with errors naming
// `steps[i]`; INVALID_ARGUMENT past kMaxBatchDecodeSteps (before anything
// is sized from the count). The steps' message_bytes add up to the whole
// request's encoded size (the first step also carries what lies outside
// every step, unknown fields included): what the decode queue counts.
absl::StatusOr<std::vector<AppendRequest>> AppendRequestsFromProto(
    const v1::BatchDecodeRequest& request);

// Stateless attention. The request must outlive the result.
absl::StatusOr<StatelessRequest> StatelessRequestFromProto(
    const v1::AttentionRequest& request);

// Copies `output` into `out` (replacing its contents). Weights and lse are
// set only when present.
void AttentionOutputToProto(const AttentionOutput& output,
                            v1::AttentionResult* out);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_PROTO_CONVERT_H_
