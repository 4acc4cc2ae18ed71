// What a failed call's status says about whether the server applied it.
//
// A retrying client must tell three cases apart: the server never saw the
// call (it may go anywhere again), the server saw it and refused it itself
// (it applied nothing), and the call was cut after the server may have
// acted (it may or may not have been applied). These predicates read that
// from the status alone: gRPC's own failure messages, and the prefix every
// refusal of the attention server starts its message with.
#ifndef ATTENTION_CLIENT_CALL_OUTCOME_H_
#define ATTENTION_CLIENT_CALL_OUTCOME_H_

#include "absl/status/status.h"

namespace attention::client {

// True when the call failed before any connection to the server existed,
// so the server never saw it: gRPC fails such a call with UNAVAILABLE
// "failed to connect to all addresses" (no transport was ready to carry
// it), or, when the server's name no longer resolves (a deleted pod),
// "DNS resolution failed" or "empty address list". A call cut after it was
// sent fails otherwise (reset, GOAWAY, ...).
bool NeverSent(const absl::Status& status);

// True when the server itself refused the call with UNAVAILABLE before
// applying anything: it is overloaded, draining or shutting down. Such a
// refusal's message starts with "the server is "; gRPC's failures never do.
bool RefusedByServer(const absl::Status& status);

// True for RefusedByServer's refusal of a draining server: it takes no new
// sessions (CreateSession, ForkSession, ImportSession) while it hands its
// own over or saves them.
bool RefusedWhileDraining(const absl::Status& status);

// Whether a CreateSession (or ForkSession, ImportSession) that failed with
// `status` may have created the session: the server saw the call and
// gRPC, not the server, failed it (a cut connection, a reply over the
// receive limit, a deadline).
bool CreationInDoubt(const absl::Status& status);

}  // namespace attention::client

#endif  // ATTENTION_CLIENT_CALL_OUTCOME_H_
