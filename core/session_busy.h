// Busy sessions: how a batch of many sessions' steps treats a session that
// another call holds at that moment.
//
// A session's calls run one at a time: each holds the session for its whole
// compute. A Prefill of a long prompt holds it for up to --max_call_flops of
// work (seconds on a CPU). A batch that waited for it would hold up every
// other session's step in it, and so every other caller of the batching
// path, behind one caller's prompt. The batching path therefore asks the
// engine to skip such a step (BusySessions::kSkip): the step applies
// nothing and fails with SessionBusyError, and the batcher runs it in a
// later batch, in its place among the steps of its session and layer.
#ifndef ATTENTION_CORE_SESSION_BUSY_H_
#define ATTENTION_CORE_SESSION_BUSY_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace attention {

// What AttentionEngine::AppendBatch and AppendEach do with a step whose
// session another call holds when the batch starts: wait for that call, or
// leave the step out (kSkip: nothing applied, SessionBusyError).
enum class BusySessions { kWait, kSkip };

// UNAVAILABLE: session `id` is held by another call, so the step was left
// out of its batch and nothing was applied. Recognized by IsSessionBusy
// (also once prefixed, e.g. with the step's index).
absl::Status SessionBusyError(absl::string_view id);

// Whether `status` is a SessionBusyError.
bool IsSessionBusy(const absl::Status& status);

}  // namespace attention

#endif  // ATTENTION_CORE_SESSION_BUSY_H_
