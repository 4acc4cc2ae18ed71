#include "server/decode_stream_reactor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/moved_sessions.h"
#include "core/status_macros.h"
#include "server/append_reply.h"
#include "server/proto_convert.h"
#include "server/status_convert.h"

namespace attention::server {

DecodeStreamReactor::DecodeStreamReactor(grpc::CallbackServerContext* context,
                                         const Deps& deps)
    : context_(context),
      deps_(deps),
      scope_(deps.metrics, deps.in_flight, RpcMethod::kDecode, ""),
      control_(context),
      tenant_(DefaultTenant()),
      held_(deps.engine) {
  if (deps_.authenticator != nullptr) {
    auth_generation_ = deps_.authenticator->generation();
    absl::StatusOr<Tenant> tenant = deps_.authenticator->Authenticate(*context);
    if (!tenant.ok()) {
      End(tenant.status());
      return;
    }
    tenant_ = *std::move(tenant);
  }
  open_stream_.emplace(deps.metrics);
  if (deps_.open_streams != nullptr) deps_.open_streams->Add(this);
  ReadNext();
}

void DecodeStreamReactor::OnDone() {
  if (deps_.open_streams != nullptr) deps_.open_streams->Remove(this);
  delete this;
}

absl::Status DecodeStreamReactor::Authenticate() {
  if (deps_.authenticator == nullptr) return absl::OkStatus();
  // The generation first: a reload after it is seen by the next step.
  const uint64_t generation = deps_.authenticator->generation();
  if (generation == auth_generation_) return absl::OkStatus();
  auth_generation_ = generation;
  ATTN_ASSIGN_OR_RETURN(Tenant tenant,
                        deps_.authenticator->Authenticate(*context_));
  // The token now names another tenant: the sessions held for the old one
  // are no longer this stream's to keep from expiring.
  if (tenant.name != tenant_.name) held_.Clear();
  tenant_ = std::move(tenant);
  return absl::OkStatus();
}

void DecodeStreamReactor::ReadNext() {
  absl::MutexLock lock(&mu_);
  // A change of the tenants before reading_ is set is seen here; one after
  // it, by OnTenantsChanged.
  if (const absl::Status auth = Authenticate(); !auth.ok()) {
    scope_.Restart("");  // the request it would have read
    OnStepDone(auth);
    return;
  }
  // EndIdle before this point is seen here; one after it, by OnEndIdle.
  if (deps_.open_streams != nullptr && deps_.open_streams->ending_idle()) {
    EndIdle();
    return;
  }
  reading_ = true;
  StartRead(&request_);
}

void DecodeStreamReactor::OnEndIdle() {
  absl::MutexLock lock(&mu_);
  // Otherwise a reaction runs or will, and the next ReadNext ends it.
  if (!reading_ || ended_) return;
  ended_ = true;
  EndIdle();
}

void DecodeStreamReactor::EndIdle() {
  scope_.Restart("");  // the request it would have read
  OnStepDone(StreamDrainedError());
}

void DecodeStreamReactor::OnTenantsChanged() {
  absl::MutexLock lock(&mu_);
  if (writing_) {
    RevokeWhileWriting();
    return;
  }
  // Otherwise a reaction runs or will, and the next read or step
  // authenticates.
  if (!reading_ || ended_) return;
  if (const absl::Status auth = Authenticate(); !auth.ok()) {
    ended_ = true;
    // Ends the stream with the read pending; its reaction does nothing.
    scope_.Restart("");
    OnStepDone(auth);
  }
}

void DecodeStreamReactor::RevokeWhileWriting() {
  if (!revoked_.ok()) return;
  if (absl::Status auth = Authenticate(); !auth.ok()) {
    // A client that stops reading holds the write for as long as it stays
    // connected: its sessions must not wait for that.
    held_.Clear();
    revoked_ = std::move(auth);
  }
}

void DecodeStreamReactor::OnReadDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (ended_) return;
  }
  if (!ok) {
    // gRPC ended the reads at a request that did not parse: it fails the
    // stream as a bad request does.
    if (deps_.unparsed_reads != nullptr &&
        deps_.unparsed_reads->Take(context_)) {
      scope_.Restart("");
      OnStepDone(UnparsedRequest(RpcMethodPath(RpcMethod::kDecode)));
      return;
    }
    // The client half-closed (or went away): every step it sent is
    // answered.
    Close(grpc::Status::OK);
    return;
  }
  StartStep();
}

void DecodeStreamReactor::StartStep() {
  scope_.Restart(request_.session_id());
  if (const absl::Status auth = Authenticate(); !auth.ok()) {
    OnStepDone(auth);
    return;
  }
  // An unknown session fails the step below with NOT_FOUND.
  const absl::Status held_status = held_.Hold(request_.session_id(), tenant_);
  const absl::Status status = [&]() -> absl::Status {
    // A moved session's redirect ends the stream here (once looked up).
    if (MovedSessionOwner(held_status).has_value()) return held_status;
    // Field names bare: OnStepDone names the request.
    ATTN_ASSIGN_OR_RETURN(append_, AppendRequestFromProto(request_));
    append_.control = &control_;
    append_.tenant = &tenant_;
    PrepareAppendReply(append_, deps_.max_message_bytes, &result_);
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    OnStepDone(status);
    return;
  }
  deps_.batcher->AppendAsync(append_,
                             [this](absl::StatusOr<AttentionOutput> output) {
                               OnStepDone(std::move(output));
                             });
}

void DecodeStreamReactor::OnStepDone(absl::StatusOr<AttentionOutput> output) {
  if (!output.ok()) {
    // Say which request of the stream failed: the client has already seen
    // `index_` results and needs to know where the stream stopped.
    End(PrefixStatus(absl::StrCat("requests[", index_, "]: "),
                     output.status()));
    return;
  }
  FinishAppendReply(append_, *output, &result_);
  // The stream used the session: held until its end, which restarts the
  // idle clock. (Held again here: the hold at the step's start fails while
  // the session is sealed for a move that may fail before the batch.)
  held_.Hold(request_.session_id(), tenant_).IgnoreError();
  held_.MarkUsed(request_.session_id());
  absl::MutexLock lock(&mu_);
  writing_ = true;
  StartWrite(&result_);
  // A change of the tenants while the step ran found no read pending.
  RevokeWhileWriting();
}

void DecodeStreamReactor::OnWriteDone(bool ok) {
  absl::Status revoked;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    revoked = revoked_;
  }
  if (!revoked.ok()) {
    // The token was revoked while the reply waited for the client; the
    // request after it is refused, as ReadNext would.
    if (ok) {
      scope_.Finish(grpc::Status::OK);
      ++index_;
    }
    scope_.Restart("");
    OnStepDone(revoked);
    return;
  }
  if (!ok) {
    // The client went away after the step was committed (the documented
    // race): it is applied, and nobody is listening.
    End(absl::CancelledError("the client closed the Decode stream"));
    return;
  }
  scope_.Finish(grpc::Status::OK);
  ++index_;
  ReadNext();
}

void DecodeStreamReactor::End(const absl::Status& status) {
  Close(scope_.Finish(ToGrpcStatus(status, context_)));
}

void DecodeStreamReactor::Close(const grpc::Status& status) {
  // No longer open once the client can see the status: the sessions it
  // held are let go first.
  held_.Clear();
  open_stream_.reset();
  Finish(status);
}

}  // namespace attention::server
