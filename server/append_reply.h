// The replies of the append RPCs (Prefill, DecodeStep, a Decode stream's
// step, BatchDecode): bounded before any work (by the engine, which knows
// the session's shapes), and written once — the
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

// Before `append` runs: bounds its result by what `max_message_bytes`
// leaves (AppendRequest::max_reply_bytes: the engine refuses a larger one
// with RESOURCE_EXHAUSTED once it knows the session, before any work),
// sizes `response`'s output tensor and makes it the request's output
// destination (or leaves it without one, see above). Reusing `response`
// (the Decode stream does) reuses its buffer.
void PrepareAppendReply(AppendRequest& append, int64_t max_message_bytes,
                        v1::AttentionResult* response);

// The same for the steps of one BatchDecode, whose results share one
// message: one result per step is added to `response`. Returns the bound
// on the sum of their results (AttentionEngine::AppendBatch's
// max_reply_bytes).
int64_t PrepareBatchReply(absl::Span<AppendRequest> appends,
                          int64_t max_message_bytes,
                          v1::BatchDecodeResponse* response);

// Completes `response` (prepared by the above) from the engine's answer.
void FinishAppendReply(const AppendRequest& append,
                       const AttentionOutput& output,
                       v1::AttentionResult* response);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_APPEND_REPLY_H_
