#include "server/append_reply.h"

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
// and makes it the request's output destination; returns its bytes. Leaves
// the request without a destination, and returns 0 (the engine then
// allocates the output once the step is checked, and FinishAppendReply
// copies it), when q or v is not rank 3 (the engine rejects it anyway) or
// the output would pass the factor above or `max_bytes` (what the reply may
// take: the engine refuses the step then).
int64_t PrepareOutput(AppendRequest& request, int64_t max_bytes,
                      v1::AttentionResult* result) {
  if (request.q.rank() != 3 || request.v.rank() != 3) return 0;
  const int64_t tokens = request.q.dim(0);
  const int64_t heads = request.q.dim(1);
  const int64_t value_dim = request.v.dim(2);
  // A double: untrusted dimensions can multiply past 2^63.
  const double bytes = static_cast<double>(tokens) * heads * value_dim *
                       DTypeSize(request.output_dtype);
  const int64_t sent =
      request.q.size_bytes + request.k.size_bytes + request.v.size_bytes;
  if (bytes > static_cast<double>(kMaxPresizedOutputFactor * sent) ||
      bytes > static_cast<double>(max_bytes)) {
    return 0;
  }
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
  return static_cast<int64_t>(bytes);
}

}  // namespace

void PrepareAppendReply(AppendRequest& append, int64_t max_message_bytes,
                        v1::AttentionResult* response) {
  append.max_reply_bytes = ResultBudget(max_message_bytes, 1);
  PrepareOutput(append, append.max_reply_bytes, response);
}

int64_t PrepareBatchReply(absl::Span<AppendRequest> appends,
                          int64_t max_message_bytes,
                          v1::BatchDecodeResponse* response) {
  const int64_t budget =
      ResultBudget(max_message_bytes, static_cast<int64_t>(appends.size()));
  // Result messages are allocated one by one by the repeated field, so
  // their buffers stay put while more are added. Together they take at
  // most the budget.
  int64_t left = budget;
  for (AppendRequest& append : appends) {
    left -= PrepareOutput(append, left, response->add_results());
  }
  return budget;
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
