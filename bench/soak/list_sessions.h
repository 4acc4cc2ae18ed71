// attn-soak: lists every live session, following ListSessions' pages. The
// one place that calls ListSessions.
#ifndef ATTENTION_BENCH_SOAK_LIST_SESSIONS_H_
#define ATTENTION_BENCH_SOAK_LIST_SESSIONS_H_

#include <grpcpp/support/status.h>

#include <vector>

#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"

namespace attention::soak {

// Appends every live session to `sessions`, following next_page_token; every
// page must come by `deadline`. On failure returns the failing call's
// status, `sessions` holding the pages read before it.
grpc::Status ListAllSessions(v1::AttentionService::Stub* stub,
                             absl::Time deadline,
                             std::vector<v1::SessionInfo>* sessions);

}  // namespace attention::soak

#endif  // ATTENTION_BENCH_SOAK_LIST_SESSIONS_H_
