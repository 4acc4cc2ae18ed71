// Reply sizes known before the work: a call whose reply could not be sent
// (over --max_message_bytes, and so never near protobuf's 2 GB limit) is
// refused before anything is computed or applied.
#ifndef ATTENTION_SERVER_REPLY_SIZE_H_
#define ATTENTION_SERVER_REPLY_SIZE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/engine.h"

namespace attention::server {

// Upper bound of an AttentionResult's encoding beyond its tensors' bytes
// (ResultBytes, core/engine.h): field tags, lengths, shapes, dtypes and the
// position.
inline constexpr int64_t kResultFramingBytes = 256;

// The most an append's result tensors may take (AppendRequest::
// max_reply_bytes) when each of `results` AttentionResults in one reply of
// at most `max_message_bytes` has its framing; at least 0.
int64_t ResultBudget(int64_t max_message_bytes, int64_t results);

// Bytes of the AttentionResult stateless attention sends: output
// [T_q, H, value_dim] in its output_dtype, lse [T_q, H] float32 and weights
// [H, T_q, T_k] float32 when asked, plus framing. Taken from the shapes of
// q, k and v (a request whose q, k or v is not rank 3 counts as 0: the
// engine rejects it). A double: untrusted dimensions can multiply past
// 2^63.
double StatelessReplyBytes(const StatelessRequest& request);

// RESOURCE_EXHAUSTED, naming the size, the limit and what to change, when a
// reply of `bytes` would pass `max_message_bytes`.
absl::Status CheckReplySize(double bytes, int64_t max_message_bytes);

// Bytes of the larger of two messages that spell out a session with the
// resolved `spec`, each at its largest: its SessionInfo reply (a 64-byte
// id, every layer at spec.max_tokens, an owner address of up to 1 KiB) and
// the snapshot header an export or hand-over sends first (the same plus a
// first position per layer and the owner's tenant name). A resolved spec
// repeats its layer entries num_layers times, so a short CreateSession can
// name a spec of megabytes.
double SessionMessageBytes(const SessionSpec& spec);

// RESOURCE_EXHAUSTED when the SessionInfo or the snapshot header of a
// session with the resolved `spec` could pass `max_message_bytes`:
// CreateSession, ForkSession, TruncateSession and ImportSession check it
// before they change anything, since their reply is that SessionInfo and a
// session whose header cannot be sent could never be exported or handed
// over.
absl::Status CheckSessionMessageSize(const SessionSpec& spec,
                                     int64_t max_message_bytes);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_REPLY_SIZE_H_
