#include "server/parse_error_interceptor.h"

#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/parse_budget.h"

namespace attention::server {
namespace {

using grpc::experimental::InterceptionHookPoints;

class ParseErrorInterceptor final : public grpc::experimental::Interceptor {
 public:
  ParseErrorInterceptor(grpc::experimental::ServerRpcInfo* info,
                        const Authenticator* authenticator,
                        ServerMetrics* metrics, UnparsedReads* unparsed_reads)
      : info_(info),
        authenticator_(authenticator),
        metrics_(metrics),
        unparsed_reads_(unparsed_reads),
        method_(info->method() != nullptr ? info->method() : ""),
        single_request_(
            info->type() == grpc::experimental::ServerRpcInfo::Type::UNARY ||
            info->type() ==
                grpc::experimental::ServerRpcInfo::Type::SERVER_STREAMING) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods)
      override {
    // Taken at every received message, whatever the method, so that no
    // failed deserialization's note outlives the read it was for.
    const void* const unparsed = methods->QueryInterceptionHookPoint(
                                     InterceptionHookPoints::POST_RECV_MESSAGE)
                                     ? proto::TakeUnparsedMessage()
                                     : nullptr;
    if (!single_request_ && unparsed_reads_ != nullptr) {
      NoteStreamedRead(methods, unparsed);
    }
    // No received message where the method takes exactly one means its
    // bytes did not parse. A streaming request also ends with no message,
    // at its clean end, so there a missing message says nothing.
    if (single_request_ &&
        methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      unparsed_ = true;
      // Only a failed read reads the clock: the interceptor runs on every
      // call, the decode steps included.
      failed_at_ = absl::Now();
    }
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::PRE_SEND_STATUS) &&
        IsThreadpoolExhausted(methods->GetSendStatus())) {
      // gRPC's own refusal when every synchronous RPC thread is busy: an
      // overloaded server answers UNAVAILABLE, which callers retry.
      methods->ModifySendStatus(Overloaded());
      failed_at_ = absl::Now();
      to_record_ = grpc::StatusCode::UNAVAILABLE;
      Record();
    }
    if (unparsed_ && methods->QueryInterceptionHookPoint(
                         InterceptionHookPoints::PRE_SEND_STATUS)) {
      // The synchronous handlers answer INTERNAL, the callback ones
      // UNIMPLEMENTED with no message.
      const grpc::Status status = methods->GetSendStatus();
      const bool sync = status.error_code() == grpc::StatusCode::INTERNAL;
      if (sync || (status.error_code() == grpc::StatusCode::UNIMPLEMENTED &&
                   status.error_message().empty())) {
        const grpc::Status unparsed = UnparsedStatus();
        methods->ModifySendStatus(unparsed);
        to_record_ = unparsed.error_code();
        callback_ = !sync;
        if (sync) Record();
      }
    }
    // To a callback handler, a request that did not arrive whole (the
    // client cancelled, or its deadline passed, while it was sent) is no
    // message too; the call's close tells it apart. (A synchronous call
    // must not ask IsCancelled here: that runs this hook again.)
    if (callback_ && to_record_.has_value() &&
        methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::POST_RECV_CLOSE)) {
      grpc::ServerContextBase* const context = info_->server_context();
      if (context->IsCancelled()) {
        to_record_ = absl::Now() >= absl::FromChrono(context->deadline())
                         ? grpc::StatusCode::DEADLINE_EXCEEDED
                         : grpc::StatusCode::CANCELLED;
      }
      Record();
    }
    methods->Proceed();
  }

  // A call that ends without a close is counted as it is.
  ~ParseErrorInterceptor() override {
    Record();
    // A note the handler did not take goes with the call.
    if (noted_) unparsed_reads_->Take(info_->server_context());
  }

 private:
  // A streamed read: the message it is to fill (named as the read starts,
  // with no hook point of its own), then whether that message did not
  // parse (POST_RECV_MESSAGE, which runs on the thread that deserialized
  // it, before the handler learns of the read: `unparsed` is the message
  // that failed there, if any). A clean end or a cancellation deserializes
  // nothing.
  void NoteStreamedRead(grpc::experimental::InterceptorBatchMethods* methods,
                        const void* unparsed) {
    // A cancellation's batch has no messages (gRPC asserts on the question).
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::PRE_SEND_CANCEL)) {
      return;
    }
    void* const message = methods->GetRecvMessage();
    if (!methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::POST_RECV_MESSAGE)) {
      if (message != nullptr) receiving_ = message;
      return;
    }
    // (gRPC's messages derive from MessageLite alone: the same address.)
    if (message == nullptr && unparsed != nullptr && unparsed == receiving_) {
      unparsed_reads_->Note(info_->server_context());
      noted_ = true;
    }
  }

  // Counts the call once, with to_record_ (if set).
  void Record() {
    const std::optional<RpcMethod> method = RpcMethodOfPath(method_);
    if (metrics_ != nullptr && method.has_value() && to_record_.has_value()) {
      metrics_->RecordRequest(*method, *to_record_, absl::Now() - failed_at_);
    }
    to_record_.reset();
  }

  // gRPC's answer for a synchronous call that found no thread
  // (ResourceQuota::SetMaxThreads).
  static bool IsThreadpoolExhausted(const grpc::Status& status) {
    return status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
           status.error_message() == "Server Threadpool Exhausted";
  }

  static grpc::Status Overloaded() {
    return grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        "the server is overloaded: every thread for its synchronous RPCs "
        "(--max_rpc_threads) is busy; nothing was applied, retry with "
        "backoff");
  }

  // What an unparsable request gets: UNAUTHENTICATED for a caller the
  // authenticator refuses, else INVALID_ARGUMENT.
  grpc::Status UnparsedStatus() const {
    if (authenticator_ != nullptr && authenticator_->enabled()) {
      const absl::StatusOr<Tenant> tenant =
          authenticator_->Authenticate(*info_->server_context());
      if (!tenant.ok()) {
        return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                            std::string(tenant.status().message()));
      }
    }
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        std::string(UnparsedRequest(method_).message()));
  }

  grpc::experimental::ServerRpcInfo* const info_;
  const Authenticator* const authenticator_;
  ServerMetrics* const metrics_;
  UnparsedReads* const unparsed_reads_;
  const std::string method_;
  const bool single_request_;
  // The message a streamed read is to fill; whether a read of the call
  // was noted in unparsed_reads_.
  const void* receiving_ = nullptr;
  bool noted_ = false;
  bool unparsed_ = false;
  absl::Time failed_at_;  // when the request turned out missing
  // The status to count for a request that did not parse, until counted.
  std::optional<grpc::StatusCode> to_record_;
  bool callback_ = false;  // its handler is a callback one
};

}  // namespace

grpc::experimental::Interceptor*
ParseErrorInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new ParseErrorInterceptor(info, authenticator_, metrics_,
                                   unparsed_reads_);
}

}  // namespace attention::server
