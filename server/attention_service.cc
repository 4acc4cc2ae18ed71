#include "server/attention_service.h"

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/client_string.h"
#include "core/moved_sessions.h"
#include "core/session_spec.h"
#include "core/status_macros.h"
#include "server/append_reply.h"
#include "server/decode_stream_reactor.h"
#include "server/grpc_call_control.h"
#include "server/proto_convert.h"
#include "server/reply_size.h"
#include "server/request_scope.h"
#include "server/session_transfer.h"
#include "server/status_convert.h"

namespace attention::server {

namespace {

// Most sessions in one ListSessions reply, and the default.
constexpr int32_t kMaxListPageSize = 1000;
constexpr int32_t kDefaultListPageSize = 100;
// Longest page token: the last session id of a page.
constexpr size_t kMaxPageTokenBytes = 64;

// Prefills run at once up to this many, each parallelized over the backend
// threads; more wait in the executor's queue.
constexpr int kPrefillThreads = 4;

// What withdraws an import while it waits for another import of its kept
// id (ImportOptions::control): the call's own control. Each look at it
// counts as progress for the stall watchdog: the caller is not stalled,
// and the wait is bounded by the other import (watched itself) and by this
// call's deadline.
class ImportWaitControl final : public CallControl {
 public:
  ImportWaitControl(const CallControl& call, StallWatchdog::Watch& watch)
      : call_(call), watch_(watch) {}

  absl::Status Check() const override {
    watch_.Progress();
    return call_.Check();
  }

 private:
  const CallControl& call_;
  StallWatchdog::Watch& watch_;
};

// The caller of a long transfer (ExportSession, ImportSession): its tenant
// is authenticated when it begins and again, at each record, once the
// tenants changed since (Authenticator::generation), so that a revoked
// token also ends the transfers it has open.
class TransferCaller {
 public:
  // `authenticator` may be null (no authentication: the default tenant).
  TransferCaller(const Authenticator* authenticator,
                 const grpc::ServerContextBase& context)
      : authenticator_(authenticator), context_(context) {}

  // The tenant the transfer runs as, or UNAUTHENTICATED.
  absl::StatusOr<Tenant> Begin() {
    if (authenticator_ == nullptr) return DefaultTenant();
    // The generation first: a reload after it is seen at the next record.
    generation_ = authenticator_->generation();
    ATTN_ASSIGN_OR_RETURN(Tenant tenant,
                          authenticator_->Authenticate(context_));
    name_ = tenant.name;
    return tenant;
  }

  // OK while the call's token still names the tenant it began as;
  // UNAUTHENTICATED otherwise.
  absl::Status Check() {
    if (authenticator_ == nullptr) return absl::OkStatus();
    const uint64_t generation = authenticator_->generation();
    if (generation == generation_) return absl::OkStatus();
    generation_ = generation;
    ATTN_ASSIGN_OR_RETURN(const Tenant tenant,
                          authenticator_->Authenticate(context_));
    if (tenant.name == name_) return absl::OkStatus();
    return absl::UnauthenticatedError(
        "the call's token was given to another tenant while the transfer "
        "ran; start it again");
  }

 private:
  const Authenticator* const authenticator_;
  const grpc::ServerContextBase& context_;
  uint64_t generation_ = 0;
  std::string name_;
};

absl::Status Draining() {
  return absl::UnavailableError(
      "the server is draining (shutting down) and takes no new sessions: "
      "create or import it on another replica; fork a session where it "
      "lives once the drain has moved it (GetSession names its replica)");
}

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(AttentionEngine* engine,
                                           DecodeBatcher* batcher,
                                           std::string version,
                                           const ServerOptions& options,
                                           ServerMetrics* metrics,
                                           const Authenticator* authenticator)
    : engine_(engine),
      batcher_(batcher),
      version_(std::move(version)),
      max_message_bytes_(options.max_message_bytes),
      metrics_(metrics),
      authenticator_(authenticator),
      on_decode_step_timing_(options.on_decode_step_timing),
      transfer_watchdog_(options.transfer_stall_timeout),
      prefill_share_("prefills", TenantQueueBounds::ShareOf(
                                     options.tenant_queue_share,
                                     options.max_queued_prefills,
                                     options.max_queued_prefill_bytes)),
      prefill_executor_(kPrefillThreads, options.max_queued_prefills,
                        options.max_queued_prefill_bytes) {
  SetMessageAllocatorFor_Prefill(&prefill_messages_);
  SetMessageAllocatorFor_DecodeStep(&decode_step_messages_);
  SetMessageAllocatorFor_BatchDecode(&batch_decode_messages_);
}

StallWatchdog::Watch AttentionServiceImpl::WatchTransfer(
    grpc::ServerContext* context) {
  return transfer_watchdog_.Start([context] { context->TryCancel(); });
}

absl::Status AttentionServiceImpl::TransferEnded(
    const StallWatchdog::Watch& watch, absl::string_view what) const {
  if (watch.stalled()) return transfer_watchdog_.StallError(what);
  return absl::CancelledError(
      absl::StrCat("the client cancelled the ", what, " or went away"));
}

absl::Status AttentionServiceImpl::HandoverImportOptions(
    const grpc::ServerContext& context, ImportOptions& options) const {
  if (context.client_metadata().find(kHandoverMetadata) ==
      context.client_metadata().end()) {
    return absl::OkStatus();
  }
  const bool authenticates =
      authenticator_ != nullptr && authenticator_->enabled();
  if (authenticates && options.tenant.name != peer_tenant_) {
    // The peer identity's name is not for other tenants to learn.
    return absl::PermissionDeniedError(absl::StrCat(
        "a handover import (", kHandoverMetadata,
        " metadata) keeps the session's owner and is accepted only from the "
        "replicas' peer identity (--peer_tenant); replicas call their peers "
        "with --peer_token_file or their client certificate"));
  }
  options.keep_owner = true;
  options.keep_idle_deadline = true;
  if (authenticates) {
    options.owner_quota = [auth = authenticator_](const std::string& owner) {
      return auth->QuotaOf(owner);
    };
  }
  return absl::OkStatus();
}

absl::StatusOr<Tenant> AttentionServiceImpl::Caller(
    const grpc::ServerContextBase& context) const {
  if (authenticator_ == nullptr) return DefaultTenant();
  return authenticator_->Authenticate(context);
}

absl::Status AttentionServiceImpl::CheckSessionMessageSizeOf(
    const std::string& session_id, const Tenant& tenant,
    const CallControl& control) const {
  // Not a use: the call this check guards may still fail.
  ATTN_ASSIGN_OR_RETURN(const SessionInfo info,
                        engine_->PeekSession(session_id, tenant, &control));
  return CheckSessionMessageSize(info.spec, max_message_bytes_);
}

void AttentionServiceImpl::SessionReply(const SessionInfo& info,
                                        v1::SessionInfo* out) const {
  SessionInfoToProto(info, out);
  out->set_owner(advertise_address());
}

void AttentionServiceImpl::SetAdvertiseAddress(std::string address) {
  absl::MutexLock lock(&advertise_mu_);
  advertise_address_ = std::move(address);
}

std::string AttentionServiceImpl::advertise_address() const {
  absl::MutexLock lock(&advertise_mu_);
  return advertise_address_;
}

void AttentionServiceImpl::StartDraining() {
  // Waits for the sessions being made (UnlessDraining) to exist.
  absl::WriterMutexLock lock(&drain_mu_);
  draining_.store(true, std::memory_order_release);
}

absl::StatusOr<SessionInfo> AttentionServiceImpl::UnlessDraining(
    absl::FunctionRef<absl::StatusOr<SessionInfo>()> create) {
  absl::ReaderMutexLock lock(&drain_mu_);
  if (draining_.load(std::memory_order_acquire)) return Draining();
  return create();
}

grpc::Status AttentionServiceImpl::CreateSession(
    grpc::ServerContext* context, const v1::CreateSessionRequest* request,
    v1::SessionInfo* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kCreateSession, "");
  return scope.Finish(ToGrpcStatus([&]() -> absl::Status {
    ATTN_ASSIGN_OR_RETURN(const Tenant tenant, Caller(*context));
    if (draining_.load(std::memory_order_acquire)) return Draining();
    ATTN_ASSIGN_OR_RETURN(SessionSpec spec,
                          SessionSpecFromProto(request->spec()));
    ATTN_ASSIGN_OR_RETURN(
        const SessionSpec resolved,
        ResolveSessionSpec(spec, engine_->options().sessions.limits));
    ATTN_RETURN_IF_ERROR(CheckSessionMessageSize(resolved, max_message_bytes_));
    // A call cancelled or past its deadline (say, while it waited for a
    // handler thread) creates nothing: its caller would never learn the id.
    const GrpcCallControl control(context);
    ATTN_ASSIGN_OR_RETURN(SessionInfo info, UnlessDraining([&] {
                            return engine_->CreateSession(
                                spec,
                                absl::Seconds(request->idle_timeout_seconds()),
                                tenant, &control);
                          }));
    SessionReply(info, response);
    return absl::OkStatus();
  }(), context));
}

grpc::Status AttentionServiceImpl::GetSession(
    grpc::ServerContext* context, const v1::GetSessionRequest* request,
    v1::SessionInfo* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kGetSession,
                     request->session_id());
  return scope.Finish(ToGrpcStatus([&]() -> absl::Status {
    ATTN_ASSIGN_OR_RETURN(const Tenant tenant, Caller(*context));
    const GrpcCallControl control(context);
    // A session restored under a larger --max_message_bytes may have a
    // SessionInfo this server cannot send; a lookup that fails so is no use.
    ATTN_RETURN_IF_ERROR(
        CheckSessionMessageSizeOf(request->session_id(), tenant, control));
    ATTN_ASSIGN_OR_RETURN(
        SessionInfo info,
        engine_->GetSession(request->session_id(), tenant, &control));
    SessionReply(info, response);
    return absl::OkStatus();
  }(), context));
}

grpc::Status AttentionServiceImpl::ListSessions(
    grpc::ServerContext* context, const v1::ListSessionsRequest* request,
    v1::ListSessionsResponse* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kListSessions, "");
  return scope.Finish(ToGrpcStatus([&]() -> absl::Status {
    ATTN_ASSIGN_OR_RETURN(const Tenant tenant, Caller(*context));
    if (request->page_size() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "page_size must be >= 0 (0 = ", kDefaultListPageSize, "), got ",
          request->page_size()));
    }
    if (request->page_token().size() > kMaxPageTokenBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "page_token ", QuoteClientString(request->page_token()),
          " is not a token this server gave; pass the previous page's "
          "next_page_token, or nothing for the first page"));
    }
    const int32_t page_size =
        request->page_size() == 0
            ? kDefaultListPageSize
            : std::min(request->page_size(), kMaxListPageSize);
    // One more than the page, to know whether another page follows; no
    // more sessions copied than about a reply's worth of metadata.
    const int64_t budget = max_message_bytes_ - 1024;
    bool cut = false;
    std::vector<SessionInfo> infos = engine_->ListSessions(
        request->page_token(), page_size + 1, tenant, budget, &cut);
    // The page also ends before the reply would pass the message limit
    // (framing of each entry and the token included).
    int64_t bytes = 0;
    for (const SessionInfo& info : infos) {
      if (response->sessions_size() == page_size) break;
      v1::SessionInfo entry;
      SessionReply(info, &entry);
      bytes += static_cast<int64_t>(entry.ByteSizeLong()) + 16;
      if (bytes > budget) {
        if (response->sessions_size() > 0) break;
        return absl::ResourceExhaustedError(absl::StrCat(
            "session ", QuoteClientString(info.session_id),
            " alone takes more than the message limit (--max_message_bytes "
            "= ",
            max_message_bytes_, "); raise the limit to list it"));
      }
      *response->add_sessions() = std::move(entry);
    }
    if (response->sessions_size() < static_cast<int>(infos.size()) || cut) {
      response->set_next_page_token(
          response->sessions(response->sessions_size() - 1).session_id());
    }
    return absl::OkStatus();
  }(), context));
}

grpc::Status AttentionServiceImpl::DeleteSession(
    grpc::ServerContext* context, const v1::DeleteSessionRequest* request,
    v1::DeleteSessionResponse* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kDeleteSession,
                     request->session_id());
  return scope.Finish(ToGrpcStatus([&]() -> absl::Status {
    ATTN_ASSIGN_OR_RETURN(const Tenant tenant, Caller(*context));
    const GrpcCallControl control(context);
    return engine_->DeleteSession(request->session_id(), tenant, &control);
  }(), context));
}

grpc::Status AttentionServiceImpl::ForkSession(
    grpc::ServerContext* context, const v1::ForkSessionRequest* request,
    v1::SessionInfo* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kForkSession,
                     request->session_id());
  return scope.Finish(ToGrpcStatus([&]() -> absl::Status {
    ATTN_ASSIGN_OR_RETURN(const Tenant tenant, Caller(*context));
    const GrpcCallControl control(context);
    if (draining_.load(std::memory_order_acquire)) {
      // A session handed over is forked at its new owner: say where.
      ATTN_RETURN_IF_ERROR(
          engine_->PeekSession(request->session_id(), tenant, &control)
              .status());
      return Draining();
    }
    ATTN_RETURN_IF_ERROR(
        CheckSessionMessageSizeOf(request->session_id(), tenant, control));
    ATTN_ASSIGN_OR_RETURN(SessionInfo info, UnlessDraining([&] {
                            return engine_->ForkSession(request->session_id(),
                                                        tenant, &control);
                          }));
    SessionReply(info, response);
    return absl::OkStatus();
  }(), context));
}

grpc::Status AttentionServiceImpl::TruncateSession(
    grpc::ServerContext* context, const v1::TruncateSessionRequest* request,
    v1::SessionInfo* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kTruncateSession,
                     request->session_id());
  return scope.Finish(ToGrpcStatus(
      [&]() -> absl::Status {
        ATTN_ASSIGN_OR_RETURN(const Tenant tenant, Caller(*context));
        const GrpcCallControl control(context);
        ATTN_RETURN_IF_ERROR(
            CheckSessionMessageSizeOf(request->session_id(), tenant, control));
        ATTN_ASSIGN_OR_RETURN(
            SessionInfo info,
            engine_->TruncateSession(request->session_id(), request->length(),
                                     tenant, &control));
        SessionReply(info, response);
        return absl::OkStatus();
      }(),
      context));
}

template <typename Request>
absl::Status AttentionServiceImpl::StartUnaryAppend(
    grpc::CallbackServerContext* context, const Request& request,
    v1::AttentionResult* response, AppendCall* call) {
  ATTN_ASSIGN_OR_RETURN(call->tenant, Caller(*context));
  ATTN_ASSIGN_OR_RETURN(AppendRequest append, AppendRequestFromProto(request));
  call->appends.push_back(std::move(append));
  call->AdoptAppends();
  PrepareAppendReply(call->appends[0], max_message_bytes_, response);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Prefill(
    grpc::CallbackServerContext* context, const v1::PrefillRequest* request,
    v1::AttentionResult* response) {
  auto* call = new AppendCall(context, metrics_, &in_flight_,
                              RpcMethod::kPrefill, request->session_id());
  if (absl::Status status =
          StartUnaryAppend(context, *request, response, call);
      !status.ok()) {
    call->Reply(status);
    return call;
  }
  const int64_t bytes = HeldBytes(call->appends[0]);
  if (absl::Status refused = prefill_share_.Admit(call->tenant->name, 1, bytes);
      !refused.ok()) {
    call->Reply(refused);
    return call;
  }
  const CallExecutor::Admission admission = prefill_executor_.TrySchedule(
      [this, call, response, bytes] {
        prefill_share_.Release(call->tenant->name, 1, bytes);
        const absl::StatusOr<AttentionOutput> output =
            engine_->Append(call->appends[0]);
        if (output.ok()) FinishAppendReply(call->appends[0], *output, response);
        call->Reply(output.status());
      },
      bytes);
  if (!admission.queued) {
    // Dropped, not run: `call` is still here (once queued it may be gone).
    prefill_share_.Release(call->tenant->name, 1, bytes);
    call->Reply(PrefillsOverloaded(admission, bytes));
  }
  return call;
}

absl::Status AttentionServiceImpl::PrefillsOverloaded(
    const CallExecutor::Admission& admission, int64_t bytes) const {
  if (admission.waiting >= prefill_executor_.max_queued()) {
    return absl::UnavailableError(absl::StrCat(
        "the server is overloaded: ", admission.waiting,
        " prefills already wait to run; nothing was applied, retry with "
        "backoff (or raise --max_queued_prefills)"));
  }
  return absl::UnavailableError(absl::StrCat(
      "the server is overloaded: the prefills waiting to run hold ",
      admission.waiting_bytes, " bytes and this one's ", bytes,
      " more would pass the limit of ", prefill_executor_.max_queued_bytes(),
      "; nothing was applied, retry with backoff (or raise "
      "--max_queued_prefill_bytes)"));
}

grpc::ServerUnaryReactor* AttentionServiceImpl::DecodeStep(
    grpc::CallbackServerContext* context, const v1::DecodeRequest* request,
    v1::AttentionResult* response) {
  auto* call = new AppendCall(context, metrics_, &in_flight_,
                              RpcMethod::kDecodeStep, request->session_id());
  DecodeStepTiming* timing = nullptr;
  if (on_decode_step_timing_) {
    call->EnableTiming(&on_decode_step_timing_);
    timing = call->timing();
    timing->handler = DecodeStepTiming::Clock::now();
    timing->received =
        ArenaMessagesOf<v1::DecodeRequest, v1::AttentionResult>(
            context->GetRpcAllocatorState())
            .allocated();
  }
  if (absl::Status status =
          StartUnaryAppend(context, *request, response, call);
      !status.ok()) {
    call->Reply(status);
    return call;
  }
  if (timing != nullptr) timing->submitted = DecodeStepTiming::Clock::now();
  // A lone caller's step runs here when the batcher is idle (no wake-up of
  // the batch thread); the reply may then be sent before this returns.
  batcher_->AppendAsync(
      call->appends[0],
      [call, response](absl::StatusOr<AttentionOutput> output) {
        if (output.ok()) FinishAppendReply(call->appends[0], *output, response);
        call->Reply(output.status());
      },
      timing != nullptr ? &timing->batch : nullptr,
      DecodeBatcher::RunInline::kWhenIdle);
  return call;
}

grpc::ServerBidiReactor<v1::DecodeRequest, v1::AttentionResult>*
AttentionServiceImpl::Decode(grpc::CallbackServerContext* context) {
  const DecodeStreamReactor::Deps deps{.engine = engine_,
                                       .batcher = batcher_,
                                       .metrics = metrics_,
                                       .in_flight = &in_flight_,
                                       .max_message_bytes = max_message_bytes_,
                                       .authenticator = authenticator_,
                                       .open_streams = &open_streams_,
                                       .unparsed_reads = &unparsed_reads_};
  return new DecodeStreamReactor(context, deps);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::BatchDecode(
    grpc::CallbackServerContext* context,
    const v1::BatchDecodeRequest* request,
    v1::BatchDecodeResponse* response) {
  auto* call = new AppendCall(context, metrics_, &in_flight_,
                              RpcMethod::kBatchDecode, "");
  int64_t max_reply_bytes = 0;
  const absl::Status status = [&]() -> absl::Status {
    ATTN_ASSIGN_OR_RETURN(call->tenant, Caller(*context));
    ATTN_ASSIGN_OR_RETURN(call->appends, AppendRequestsFromProto(*request));
    call->AdoptAppends();
    max_reply_bytes = PrepareBatchReply(absl::MakeSpan(call->appends),
                                        max_message_bytes_, response);
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    call->Reply(status);
    return call;
  }
  batcher_->AppendAtomicAsync(
      call->appends, max_reply_bytes,
      [call, response](absl::StatusOr<std::vector<AttentionOutput>> outputs) {
        if (outputs.ok()) {
          for (size_t i = 0; i < outputs->size(); ++i) {
            FinishAppendReply(call->appends[i], (*outputs)[i],
                              response->mutable_results(static_cast<int>(i)));
          }
        }
        call->Reply(outputs.status());
      });
  return call;
}

grpc::Status AttentionServiceImpl::Attention(
    grpc::ServerContext* context, const v1::AttentionRequest* request,
    v1::AttentionResult* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kAttention, "");
  return scope.Finish(ToGrpcStatus([&]() -> absl::Status {
    ATTN_RETURN_IF_ERROR(Caller(*context).status());
    ATTN_ASSIGN_OR_RETURN(StatelessRequest stateless,
                          StatelessRequestFromProto(*request));
    GrpcCallControl control(context);
    stateless.control = &control;
    ATTN_RETURN_IF_ERROR(
        CheckReplySize(StatelessReplyBytes(stateless), max_message_bytes_));
    ATTN_ASSIGN_OR_RETURN(AttentionOutput output, engine_->Attend(stateless));
    AttentionOutputToProto(output, response);
    return absl::OkStatus();
  }(), context));
}

grpc::Status AttentionServiceImpl::ExportSession(
    grpc::ServerContext* context, const v1::ExportSessionRequest* request,
    grpc::ServerWriter<v1::SessionChunk>* writer) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kExportSession,
                     request->session_id());
  return scope.Finish(ToGrpcStatus(
      [&]() -> absl::Status {
        TransferCaller caller(authenticator_, *context);
        ATTN_ASSIGN_OR_RETURN(const Tenant tenant, caller.Begin());
        ATTN_ASSIGN_OR_RETURN(
            std::unique_ptr<SessionExport> session_export,
            engine_->ExportSession(request->session_id(), tenant));
        StallWatchdog::Watch watch = WatchTransfer(context);
        ATTN_ASSIGN_OR_RETURN(
            const int64_t bytes,
            WriteSessionExport(
                *session_export,
                [&](v1::SessionChunk& record) -> absl::Status {
                  ATTN_RETURN_IF_ERROR(caller.Check());
                  if (context->IsCancelled() || !writer->Write(record)) {
                    return TransferEnded(watch, "export");
                  }
                  watch.Progress();
                  return absl::OkStatus();
                },
                max_message_bytes_));
        if (metrics_ != nullptr) metrics_->RecordExport(bytes);
        return absl::OkStatus();
      }(),
      context));
}

grpc::Status AttentionServiceImpl::ImportSession(
    grpc::ServerContext* context, grpc::ServerReader<v1::SessionChunk>* reader,
    v1::SessionInfo* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kImportSession, "");
  absl::Status status = [&]() -> absl::Status {
    const GrpcCallControl control(context);
    ImportOptions options;
    TransferCaller caller(authenticator_, *context);
    ATTN_ASSIGN_OR_RETURN(options.tenant, caller.Begin());
    ATTN_RETURN_IF_ERROR(HandoverImportOptions(*context, options));
    const bool handover = options.keep_owner;
    // A replica handing a session over keeps its id; so may anyone where
    // there are no tenants to tell apart.
    const KeepSessionId keep =
        handover || authenticator_ == nullptr || !authenticator_->enabled()
            ? KeepSessionId::kAllowed
            : KeepSessionId::kRefused;
    // The stall watch ends with the stream: the commit below waits for no
    // message, and a watchdog's cancel after it would report a failure for
    // a session that was created.
    ATTN_ASSIGN_OR_RETURN(ReadImport read, [&]() -> absl::StatusOr<ReadImport> {
      StallWatchdog::Watch watch = WatchTransfer(context);
      // Bounds the wait for another import of the same kept id (which only
      // reading the header waits for: the control goes with the watch).
      const ImportWaitControl wait_control(control, watch);
      ImportOptions watched = std::move(options);
      watched.control = &wait_control;
      return ReadSessionImport(
          *engine_, std::move(watched), keep, max_message_bytes_,
          [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
            ATTN_RETURN_IF_ERROR(caller.Check());
            const bool more = !context->IsCancelled() && reader->Read(record);
            if (context->IsCancelled()) {
              return TransferEnded(watch, "import");
            }
            if (!more && unparsed_reads_.Take(context)) {
              return PrefixStatus(
                  "a record of the snapshot stream: ",
                  UnparsedRequest(RpcMethodPath(RpcMethod::kImportSession)));
            }
            watch.Progress();
            return more;
          },
          [&]() -> absl::Status {
            // The header passed BeginImport's checks (a kept id is not held
            // here), said at once for a hand-over asking again after a lost
            // answer: it then knows its first attempt created nothing here,
            // even if this one is cut before its end.
            context->AddInitialMetadata(kImportIdCheckedMetadata, "1");
            reader->SendInitialMetadata();
            // A draining replica refuses an import only now: a session it
            // holds has answered ALREADY_EXISTS, which tells that hand-over
            // its first attempt created the session here.
            return draining_.load(std::memory_order_acquire) ? Draining()
                                                             : absl::OkStatus();
          });
    }());
    // Not once the caller's token was revoked (after its last record).
    ATTN_RETURN_IF_ERROR(caller.Check());
    // Nor once the drain began: its hand-over may have listed the sessions
    // already, and this one would be lost.
    ATTN_ASSIGN_OR_RETURN(const SessionInfo info,
                          UnlessDraining([&]() -> absl::StatusOr<SessionInfo> {
                            // Nor once the call was withdrawn: its caller would
                            // take it for a session not created.
                            ATTN_RETURN_IF_ERROR(control.Check());
                            return read.Commit();
                          }));
    if (metrics_ != nullptr) {
      metrics_->RecordImport(read.kv_bytes);
      if (handover) metrics_->RecordHandoverReceived();
    }
    SessionReply(info, response);
    return absl::OkStatus();
  }();
  // Nothing fails after the commit: every error here created nothing,
  // which a sender handing the session over must know (kUnknown doubts).
  if (!status.ok()) context->AddTrailingMetadata(kImportRefusedMetadata, "1");
  return scope.Finish(ToGrpcStatus(std::move(status), context));
}

grpc::Status AttentionServiceImpl::GetServerInfo(
    grpc::ServerContext* context, const v1::GetServerInfoRequest* request,
    v1::ServerInfo* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kGetServerInfo, "");
  absl::StatusOr<Tenant> tenant = Caller(*context);
  if (!tenant.ok()) return scope.Finish(ToGrpcStatus(tenant.status(), context));
  const TenantStats usage = engine_->tenant_stats(tenant->name);
  response->set_tenant(tenant->name);
  response->set_tenant_sessions(usage.sessions);
  response->set_tenant_kv_bytes(usage.kv_bytes);
  if (tenant->quota.max_sessions.has_value()) {
    response->set_tenant_max_sessions(*tenant->quota.max_sessions);
  }
  if (tenant->quota.max_kv_bytes.has_value()) {
    response->set_tenant_max_kv_bytes(*tenant->quota.max_kv_bytes);
  }
  const EngineStats stats = engine_->stats();
  const EngineOptions& options = engine_->options();
  response->set_version(version_);
  response->set_backend(std::string(engine_->backend().name()));
  response->set_device(engine_->backend().device());
  response->set_kv_cache_capacity_bytes(stats.pool.capacity_bytes);
  response->set_kv_cache_used_bytes(stats.pool.used_bytes);
  response->set_active_sessions(stats.active_sessions);
  response->set_max_message_bytes(max_message_bytes_);
  response->set_max_call_flops(options.max_call_flops);
  response->set_max_sessions(options.sessions.max_sessions);
  response->set_session_metadata_bytes(stats.session_metadata_bytes);
  response->set_max_session_metadata_bytes(
      options.sessions.max_metadata_bytes);
  response->set_advertise_address(advertise_address());
  response->set_draining(draining());
  response->set_queued_steps(batcher_->queued_steps());
  response->set_kv_cache_free_bytes(stats.pool.capacity_bytes -
                                    stats.pool.used_bytes);
  return scope.Finish(grpc::Status::OK);
}

}  // namespace attention::server
