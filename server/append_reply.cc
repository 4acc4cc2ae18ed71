#include "server/append_reply.h"

#include <algorithm>
#include <cstddef>
#include <string>

#include "core/status_macros.h"
#include "server/proto_convert.h"
#include "server/reply_size.h"

namespace attention::server {
namespace {

// An output is written straight into its reply only when it takes at most
// this many times the bytes of the request's q, k and v: the buffer is
// sized (and zeroed) from the request's shapes before the engine has
// checked them against the session, so a request of a few bytes whose
// shapes claim a huge output must not get one. Real steps take 1-4 times
// (fp32 output, q of head_dim >= value_dim / 2).
constexpr int64_t kMaxPresizedOutputFactor = 8;

// Sizes `result`'s output tensor for `request`'s [T, H, value_dim] output
// and makes it the request's output destination. Leaves the request without
// a destination (the engine then allocates the output once the step is
// checked, and FinishAppendReply copies it) when q or v is not rank 3 (the
// engine rejects it anyway) or the output would pass the factor above.
void PrepareOutput(AppendRequest& request, v1::AttentionResult* result) {
  if (request.q.rank() != 3 || request.v.rank() != 3) return;
  const int64_t tokens = request.q.dim(0);
  const int64_t heads = request.q.dim(1);
  const int64_t value_dim = request.v.dim(2);
  const int64_t bytes =
      tokens * heads * value_dim * DTypeSize(request.output_dtype);
  const int64_t sent =
      request.q.size_bytes + request.k.size_bytes + request.v.size_bytes;
  if (bytes > kMaxPresizedOutputFactor * sent) return;
  v1::Tensor* output = result->mutable_output();
  output->set_dtype(DTypeToProto(request.output_dtype));
  output->clear_shape();
  output->add_shape(tokens);
  output->add_shape(heads);
  output->add_shape(value_dim);
  std::string* data = output->mutable_data();
  data->resize(static_cast<size_t>(bytes));
  request.output_destination =
      absl::MakeSpan(reinterpret_cast<std::byte*>(data->data()), data->size());
}

}  // namespace

absl::Status PrepareAppendReply(AppendRequest& append,
                                int64_t max_message_bytes,
                                v1::AttentionResult* response) {
  const double reply_bytes = AppendReplyBytes(append);
  ATTN_RETURN_IF_ERROR(CheckReplySize(reply_bytes, max_message_bytes));
  // The selected positions of a top-k layer get what the message has left.
  append.max_topk_indices_bytes = std::max<int64_t>(
      0, max_message_bytes - static_cast<int64_t>(reply_bytes));
  PrepareOutput(append, response);
  return absl::OkStatus();
}

absl::Status PrepareBatchReply(absl::Span<AppendRequest> appends,
                               int64_t max_message_bytes,
                               v1::BatchDecodeResponse* response) {
  double reply_bytes = 0;
  int64_t index_steps = 0;
  for (const AppendRequest& append : appends) {
    reply_bytes += AppendReplyBytes(append);
    index_steps += append.return_topk_indices ? 1 : 0;
  }
  ATTN_RETURN_IF_ERROR(CheckReplySize(reply_bytes, max_message_bytes));
  // Steps returning top-k positions share what the message has left.
  const int64_t index_budget = std::max<int64_t>(
      0, (max_message_bytes - static_cast<int64_t>(reply_bytes)) /
             std::max<int64_t>(1, index_steps));
  // Result messages are allocated one by one by the repeated field, so
  // their buffers stay put while more are added.
  for (AppendRequest& append : appends) {
    append.max_topk_indices_bytes = index_budget;
    PrepareOutput(append, response->add_results());
  }
  return absl::OkStatus();
}

void FinishAppendReply(const AppendRequest& append,
                       const AttentionOutput& output,
                       v1::AttentionResult* response) {
  if (append.output_destination.empty()) {
    TensorToProto(output.output, response->mutable_output());
  }
  response->set_position(output.position);
  response->clear_weights();
  if (output.lse.has_value()) {
    TensorToProto(*output.lse, response->mutable_lse());
  } else {
    response->clear_lse();
  }
  response->mutable_topk_indices()->Assign(output.topk_indices.begin(),
                                           output.topk_indices.end());
}

}  // namespace attention::server
