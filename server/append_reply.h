// The replies of the append RPCs (Prefill, DecodeStep, a Decode stream's
// step, BatchDecode): bounded before any work, and written once — the
// engine writes each output (converted to its output_dtype) straight into
// the response's pre-sized bytes, unless the request's shapes claim an
// output out of proportion to the bytes it carries (append_reply.cc).
#ifndef ATTENTION_SERVER_APPEND_REPLY_H_
#define ATTENTION_SERVER_APPEND_REPLY_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "attention/v1/attention.pb.h"
#include "core/engine.h"

namespace attention::server {

// Before `append` runs: RESOURCE_EXHAUSTED when its reply would pass
// `max_message_bytes`; otherwise gives its top-k positions what the message
// has left, sizes `response`'s output tensor and makes it the request's
// output destination (or leaves it without one, see above). Reusing
// `response` (the Decode stream does) reuses its buffer.
absl::Status PrepareAppendReply(AppendRequest& append,
                                int64_t max_message_bytes,
                                v1::AttentionResult* response);

// The same for the steps of one BatchDecode, whose replies share one
// message: one result per step is added to `response`.
absl::Status PrepareBatchReply(absl::Span<AppendRequest> appends,
                               int64_t max_message_bytes,
                               v1::BatchDecodeResponse* response);

// Completes `response` (prepared by the above) from the engine's answer.
void FinishAppendReply(const AppendRequest& append,
                       const AttentionOutput& output,
                       v1::AttentionResult* response);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_APPEND_REPLY_H_
