#include "client/attention_client.h"

#include <grpc/grpc.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <algorithm>
#include <iterator>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/read_file.h"
#include "core/status_macros.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace attention::client {
namespace {

// A BatchDecode reply holds one result per step, in order.
absl::Status CheckBatchResultCount(int64_t results, int64_t steps) {
  if (results == steps) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("the server answered ", results,
                                          " results to a BatchDecode of ",
                                          steps, " steps"));
}

int ClampToInt(int64_t value) {
  if (value < 0) return -1;  // gRPC: unlimited
  return value > std::numeric_limits<int>::max()
             ? std::numeric_limits<int>::max()
             : static_cast<int>(value);
}

// The contents of `path` (empty path: empty text).
absl::StatusOr<std::string> ReadPem(const std::string& path,
                                    absl::string_view what,
                                    const ClientOptions& options) {
  if (path.empty()) return std::string();
  return ReadFile(path, what,
                  options.tls_regular_files_only ? ReadFileFrom::kRegularFile
                                                 : ReadFileFrom::kAnyFile);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(
    const ClientOptions& options) {
  if (!UsesTls(options)) return grpc::InsecureChannelCredentials();
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "a client certificate needs both tls_cert_file and tls_key_file");
  }
  grpc::SslCredentialsOptions ssl;
  ATTN_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                        ReadPem(options.tls_ca_file, "TLS CA file", options));
  ATTN_ASSIGN_OR_RETURN(
      ssl.pem_cert_chain,
      ReadPem(options.tls_cert_file, "TLS certificate", options));
  ATTN_ASSIGN_OR_RETURN(
      ssl.pem_private_key,
      ReadPem(options.tls_key_file, "TLS private key", options));
  return grpc::SslCredentials(ssl);
}

grpc::ChannelArguments ChannelArguments(const ClientOptions& options) {
  grpc::ChannelArguments arguments;
  if (options.retry_max_attempts > 1) {
    arguments.SetServiceConfigJSON(
        RetryServiceConfig(options.retry_max_attempts));
  }
  arguments.SetMaxSendMessageSize(ClampToInt(options.max_send_message_bytes));
  arguments.SetMaxReceiveMessageSize(
      ClampToInt(options.max_receive_message_bytes));
  if (UsesTls(options) && !options.tls_server_name.empty()) {
    arguments.SetSslTargetNameOverride(options.tls_server_name);
  }
  if (options.max_reconnect_backoff > absl::ZeroDuration()) {
    const int max_ms = ClampToInt(
        std::max<int64_t>(1, absl::ToInt64Milliseconds(
                                 options.max_reconnect_backoff)));
    arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, max_ms);
    arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
                     std::min(max_ms, 100));
  }
  if (options.keepalive_time != absl::InfiniteDuration()) {
    const int time_ms = ClampToInt(absl::ToInt64Milliseconds(
        std::max(options.keepalive_time, kMinKeepaliveTime)));
    arguments.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, time_ms);
    arguments.SetInt(
        GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
        ClampToInt(std::max<int64_t>(
            1, absl::ToInt64Milliseconds(options.keepalive_timeout))));
    // Every keepalive ping goes out, also on a stream that only waits for
    // its answers (gRPC otherwise stops after 2 pings without data, and
    // then spaces them 5 minutes apart).
    arguments.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    arguments.SetInt(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS,
                     time_ms);
  }
  return arguments;
}

// The shape the proto gives an ExportSession stream: one header, its data
// records, then one trailer that counts them, and nothing after it. A
// stream that ends OK without it (a misbehaving server or proxy) would
// otherwise pass for a whole snapshot, found cut only at the import.
class SnapshotShape {
 public:
  absl::Status Add(const v1::SessionChunk& record) {
    if (trailer_) return Broken("a record after its trailer");
    if (!header_) {
      if (!record.has_header()) return Broken("no header first");
      header_ = true;
    } else if (record.has_header()) {
      return Broken("a second header");
    } else if (record.has_trailer()) {
      trailer_ = true;
      if (record.trailer().num_chunks() != data_) {
        return Broken(absl::StrCat("a trailer counting ",
                                   record.trailer().num_chunks(),
                                   " data records after ", data_));
      }
    } else if (record.has_data()) {
      ++data_;
    }
    return absl::OkStatus();
  }
  absl::Status Complete() const {
    if (trailer_) return absl::OkStatus();
    return Broken(header_ ? absl::StrCat("it ended after ", data_,
                                         " data records, without a trailer")
                          : "it ended without a record");
  }

 private:
  static absl::Status Broken(absl::string_view what) {
    return absl::DataLossError(
        absl::StrCat("the server's ExportSession stream is not a whole "
                     "snapshot (",
                     what, "); nothing it sent is a usable snapshot"));
  }

  bool header_ = false;
  bool trailer_ = false;
  int64_t data_ = 0;
};

}  // namespace

std::string RetryServiceConfig(int max_attempts) {
  return absl::StrCat(
      R"({"methodConfig": [{"name": [)",
      R"({"service": "attention.v1.AttentionService", "method": "GetSession"},)",
      R"({"service": "attention.v1.AttentionService", "method": "ListSessions"},)",
      R"({"service": "attention.v1.AttentionService", "method": "TruncateSession"},)",
      R"({"service": "attention.v1.AttentionService", "method": "Attention"},)",
      R"({"service": "attention.v1.AttentionService", "method": "GetServerInfo"},)",
      R"({"service": "attention.v1.AttentionService", "method": "ExportSession"}],)",
      R"("retryPolicy": {"maxAttempts": )", std::clamp(max_attempts, 2, 5),
      R"(, "initialBackoff": "0.2s", "maxBackoff": "5s",)",
      R"( "backoffMultiplier": 2,)",
      R"( "retryableStatusCodes": ["UNAVAILABLE"]}}]})");
}

bool UsesTls(const ClientOptions& options) {
  return options.tls || !options.tls_ca_file.empty() ||
         !options.tls_cert_file.empty() || !options.tls_key_file.empty() ||
         !options.tls_server_name.empty();
}

absl::Status CheckAuthToken(absl::string_view token) {
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the auth token has a byte (0x", absl::Hex(c, absl::kZeroPad2),
          " at offset ", i,
          ") that an HTTP/2 header cannot carry; a token is printable ASCII "
          "(0x20-0x7E) on one line"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> OpenChannel(
    const std::string& target, const ClientOptions& options) {
  ATTN_RETURN_IF_ERROR(CheckAuthToken(options.auth_token));
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                        Credentials(options));
  return grpc::CreateCustomChannel(target, credentials,
                                   ChannelArguments(options));
}

std::shared_ptr<grpc::Channel> CreateChannel(const std::string& target,
                                             const ClientOptions& options) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      OpenChannel(target, options);
  if (channel.ok()) return *std::move(channel);
  // TLS with no usable roots: every handshake, hence every call, fails.
  grpc::SslCredentialsOptions unusable;
  unusable.pem_root_certs = "-----BEGIN CERTIFICATE-----\n";
  return grpc::CreateCustomChannel(target, grpc::SslCredentials(unusable),
                                   ChannelArguments(options));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // gRPC and absl share the canonical code space.
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

absl::Status FromGrpcCall(const grpc::Status& status,
                          const grpc::ClientContext& context) {
  absl::Status converted = FromGrpcStatus(status);
  std::vector<const char*> keys;
  if (converted.code() == absl::StatusCode::kNotFound) {
    keys = {kSessionOwnerMetadata};
  } else if (converted.code() == absl::StatusCode::kUnavailable) {
    keys = {kSessionMovingMetadata, kStreamDrainedMetadata};
  }
  const auto& trailers = context.GetServerTrailingMetadata();
  for (const char* key : keys) {
    auto it = trailers.find(key);
    if (it == trailers.end() || it->second.empty()) continue;
    converted.SetPayload(key, absl::Cord(absl::string_view(it->second.data(),
                                                           it->second.size())));
  }
  return converted;
}

bool IsSessionMoving(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable &&
         status.GetPayload(kSessionMovingMetadata).has_value();
}

bool IsStreamDrained(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable &&
         status.GetPayload(kStreamDrainedMetadata).has_value();
}

std::optional<std::string> MovedSessionOwner(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kNotFound) return std::nullopt;
  auto owner = status.GetPayload(kSessionOwnerMetadata);
  if (!owner.has_value()) return std::nullopt;
  return std::string(*owner);
}

// ---------------------------------------------------------------------------
// SessionHandle

SessionHandle::SessionHandle(AttentionClient* client, v1::SessionInfo info)
    : client_(client), info_(std::move(info)) {}

int64_t SessionHandle::value_dim() const {
  return spec().value_dim() > 0 ? spec().value_dim() : spec().head_dim();
}

absl::StatusOr<int64_t> SessionHandle::TokenCount(
    absl::Span<const float> q, absl::Span<const float> k,
    absl::Span<const float> v) const {
  const int64_t q_row = int64_t{spec().num_q_heads()} * spec().head_dim();
  const int64_t k_row = int64_t{spec().num_kv_heads()} * spec().head_dim();
  // A shared latent (MLA) session takes no v: its values are k's leading
  // value_dim entries.
  const bool latent = spec().kv_layout() == v1::KV_LAYOUT_SHARED_LATENT;
  const int64_t v_row =
      latent ? 0 : int64_t{spec().num_kv_heads()} * value_dim();
  if (q_row <= 0 || k_row <= 0 || (v_row <= 0 && !latent)) {
    return absl::FailedPreconditionError(
        "the session handle has no resolved spec (was it built from the "
        "server's SessionInfo?)");
  }
  // Divisions, not products: a spec from a malformed reply may hold rows
  // whose product with T overflows.
  const auto holds = [](size_t size, int64_t row, int64_t tokens) {
    const int64_t n = static_cast<int64_t>(size);
    return row == 0 ? n == 0 : n % row == 0 && n / row == tokens;
  };
  const int64_t tokens = static_cast<int64_t>(q.size()) / q_row;
  if (tokens < 1 || !holds(q.size(), q_row, tokens) ||
      !holds(k.size(), k_row, tokens) || !holds(v.size(), v_row, tokens)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q, k, v hold ", q.size(), ", ", k.size(), ", ", v.size(),
        " floats; for T tokens they need T*", q_row, ", T*", k_row, ", T*",
        v_row, " (H*head_dim, H_kv*head_dim, H_kv*value_dim) with T >= 1"));
  }
  return tokens;
}

template <typename Request>
absl::StatusOr<Request> SessionHandle::MakeRequest(
    int layer, absl::Span<const float> q, absl::Span<const float> k,
    absl::Span<const float> v, const StepOptions& options,
    std::optional<int64_t> required_tokens) const {
  auto tokens = TokenCount(q, k, v);
  if (!tokens.ok()) return tokens.status();
  if (required_tokens.has_value() && *tokens != *required_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("a decode step is exactly one token; got ", *tokens));
  }
  Request request;
  request.set_session_id(id());
  request.set_layer(layer);
  auto q_tensor =
      MakeTensor(q, {*tokens, spec().num_q_heads(), spec().head_dim()},
                 options.input_dtype);
  if (!q_tensor.ok()) return q_tensor.status();
  auto k_tensor =
      MakeTensor(k, {*tokens, spec().num_kv_heads(), spec().head_dim()},
                 options.input_dtype);
  if (!k_tensor.ok()) return k_tensor.status();
  *request.mutable_q() = *std::move(q_tensor);
  *request.mutable_k() = *std::move(k_tensor);
  if (spec().kv_layout() != v1::KV_LAYOUT_SHARED_LATENT) {
    auto v_tensor = MakeTensor(
        v, {*tokens, spec().num_kv_heads(), value_dim()}, options.input_dtype);
    if (!v_tensor.ok()) return v_tensor.status();
    *request.mutable_v() = *std::move(v_tensor);
  }
  request.set_output_dtype(options.output_dtype);
  request.set_return_lse(options.return_lse);
  return request;
}

absl::StatusOr<v1::PrefillRequest> SessionHandle::MakePrefillRequest(
    int layer, absl::Span<const float> q, absl::Span<const float> k,
    absl::Span<const float> v, const StepOptions& options) const {
  return MakeRequest<v1::PrefillRequest>(layer, q, k, v, options, std::nullopt);
}

absl::StatusOr<v1::DecodeRequest> SessionHandle::MakeDecodeRequest(
    int layer, absl::Span<const float> q, absl::Span<const float> k,
    absl::Span<const float> v, const StepOptions& options) const {
  return MakeRequest<v1::DecodeRequest>(layer, q, k, v, options, 1);
}

absl::StatusOr<v1::AttentionResult> SessionHandle::Prefill(
    int layer, absl::Span<const float> q, absl::Span<const float> k,
    absl::Span<const float> v, const StepOptions& options) {
  auto request = MakePrefillRequest(layer, q, k, v, options);
  if (!request.ok()) return request.status();
  return client_->Prefill(*request);
}

absl::StatusOr<v1::AttentionResult> SessionHandle::DecodeStep(
    int layer, absl::Span<const float> q, absl::Span<const float> k,
    absl::Span<const float> v, const StepOptions& options) {
  auto request = MakeDecodeRequest(layer, q, k, v, options);
  if (!request.ok()) return request.status();
  return client_->DecodeStep(*request);
}

absl::StatusOr<v1::SessionInfo> SessionHandle::Info() const {
  return client_->GetSession(id());
}

absl::StatusOr<v1::SessionInfo> SessionHandle::Truncate(int64_t length) {
  return client_->TruncateSession(id(), length);
}

absl::StatusOr<SessionHandle> SessionHandle::Fork() const {
  auto info = client_->ForkSession(id());
  if (!info.ok()) return info.status();
  return SessionHandle(client_, *std::move(info));
}

absl::Status SessionHandle::Delete() { return client_->DeleteSession(id()); }

// ---------------------------------------------------------------------------
// DecodeStream

DecodeStream::DecodeStream(v1::AttentionService::Stub* stub,
                           const std::string& authorization) {
  if (!authorization.empty()) {
    context_.AddMetadata("authorization", authorization);
  }
  stream_ = std::make_unique<
      BlockingBidiStream<v1::DecodeRequest, v1::AttentionResult>>(
      &context_,
      [stub](grpc::ClientContext* context,
             grpc::ClientBidiReactor<v1::DecodeRequest, v1::AttentionResult>*
                 reactor) { stub->async()->Decode(context, reactor); });
}

// The stream cancels the call when it was not finished.
DecodeStream::~DecodeStream() = default;

// Write and WritesDone read only the writer's own state: a reader thread
// may set final_status_ meanwhile, and the stream refuses writes once over.
bool DecodeStream::Write(const v1::DecodeRequest& request) {
  if (writes_done_) return false;
  // Counted first: the server may end the stream over this request before
  // Write returns. One that is not sent (the stream is over) counts only
  // past a stream that ended with an error or over an earlier request.
  sent_.fetch_add(1, std::memory_order_relaxed);
  return stream_->Write(request);
}

absl::Status DecodeStream::SurplusAnswers(int64_t sent) {
  context_.TryCancel();
  return absl::InternalError(absl::StrCat(
      "the server sent ", answered_, " results on a Decode stream of ", sent,
      " requests: the stream was cancelled, and its results may belong to "
      "other requests than they were read for"));
}

absl::StatusOr<v1::AttentionResult> DecodeStream::Read() {
  if (!final_status_.has_value()) {
    v1::AttentionResult result;
    if (stream_->Read(&result)) {
      // A result for no request sent (a reader may run ahead of nothing).
      if (++answered_ > sent_.load()) {
        final_status_ = SurplusAnswers(sent_.load());
        return *final_status_;
      }
      return result;
    }
    final_status_ = EndStatus();
  }
  if (!final_status_->ok()) return *final_status_;
  return absl::OutOfRangeError("the Decode stream has ended");
}

absl::Status DecodeStream::EndStatus() {
  absl::Status status = FromGrpcCall(stream_->Status(), context_);
  // writes_done_ first: the writer counts a request before it marks the
  // writes done, so a request written meanwhile is counted in `sent`.
  const bool writes_done = writes_done_.load();
  const int64_t sent = sent_.load();
  if (answered_ > sent) return SurplusAnswers(sent);
  // A draining server ended it after the last request, every one answered:
  // it lost nothing, as a clean end. (Before WritesDone the caller may
  // still mean to write: it needs the reason the stream is over.)
  if (IsStreamDrained(status) && writes_done && answered_ == sent) {
    return absl::OkStatus();
  }
  if (status.ok() && answered_ < sent) {
    // The server ends a stream with an error of its own. Servers before
    // December 2026 ended it with OK at a request gRPC could not parse
    // for them (this one answers INVALID_ARGUMENT, see the proto's Decode).
    status = absl::InvalidArgumentError(absl::StrCat(
        "requests[", answered_,
        "]: the server ended the Decode stream "
        "without an answer to it (",
        sent - answered_ - 1,
        " more sent after it): its bytes did not parse as a DecodeRequest or "
        "passed the server's parse budget; the requests before it were "
        "applied, it and those after it were not"));
  }
  return status;
}

absl::StatusOr<v1::AttentionResult> DecodeStream::Step(
    const v1::DecodeRequest& request) {
  if (final_status_.has_value() || writes_done_) return Read();
  v1::AttentionResult result;
  sent_.fetch_add(1, std::memory_order_relaxed);
  // A failed write means the stream is over; Read then reports why.
  if (stream_->Step(request, &result)) {
    ++answered_;
    return result;
  }
  return Read();
}

void DecodeStream::WritesDone() {
  if (writes_done_.load()) return;
  writes_done_.store(true);
  stream_->WritesDone();
}

absl::Status DecodeStream::Finish() {
  if (final_status_.has_value()) return *final_status_;
  WritesDone();
  // The results not read are discarded, but they count as answers.
  v1::AttentionResult discarded;
  while (stream_->Read(&discarded)) ++answered_;
  final_status_ = EndStatus();
  return *final_status_;
}

// ---------------------------------------------------------------------------
// AttentionClient

struct AttentionClient::HealthStub {
  std::unique_ptr<grpc::health::v1::Health::Stub> stub;
};

AttentionClient::AttentionClient(std::shared_ptr<grpc::Channel> channel,
                                 ClientOptions options)
    : channel_(std::move(channel)),
      options_(std::move(options)),
      stub_(v1::AttentionService::NewStub(channel_)),
      health_(std::make_unique<HealthStub>(
          HealthStub{grpc::health::v1::Health::NewStub(channel_)})) {
  // gRPC aborts the process on a call whose metadata it cannot send.
  if (!CheckAuthToken(options_.auth_token).ok()) options_.auth_token.clear();
}

AttentionClient::~AttentionClient() = default;

absl::Status AttentionClient::ExportSession(
    absl::string_view session_id,
    const std::function<absl::Status(const v1::SessionChunk&)>& sink) {
  grpc::ClientContext context;
  // A stream: the token, but no per-call deadline.
  if (!options_.auth_token.empty()) {
    context.AddMetadata("authorization", Authorization());
  }
  v1::ExportSessionRequest request;
  request.set_session_id(std::string(session_id));
  std::unique_ptr<grpc::ClientReader<v1::SessionChunk>> reader =
      stub_->ExportSession(&context, request);
  v1::SessionChunk record;
  SnapshotShape shape;
  while (reader->Read(&record)) {
    absl::Status status = shape.Add(record);
    if (status.ok()) status = sink(record);
    if (!status.ok()) {
      context.TryCancel();
      (void)reader->Finish();
      return status;
    }
  }
  ATTN_RETURN_IF_ERROR(FromGrpcCall(reader->Finish(), context));
  return shape.Complete();
}

absl::StatusOr<v1::SessionInfo> AttentionClient::ImportSession(
    const std::function<absl::StatusOr<bool>(v1::SessionChunk*)>& source,
    bool keep_session_id) {
  grpc::ClientContext context;
  if (!options_.auth_token.empty()) {
    context.AddMetadata("authorization", Authorization());
  }
  v1::SessionInfo info;
  std::unique_ptr<grpc::ClientWriter<v1::SessionChunk>> writer =
      stub_->ImportSession(&context, &info);
  v1::SessionChunk record;
  for (bool first = true;; first = false) {
    record.Clear();
    absl::StatusOr<bool> more = source(&record);
    if (!more.ok()) {
      context.TryCancel();
      (void)writer->Finish();
      return more.status();
    }
    if (!*more) break;
    if (first && keep_session_id) record.set_keep_session_id(true);
    // A failed write means the server has already answered (Finish says).
    if (!writer->Write(record)) break;
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (!status.ok()) return FromGrpcCall(status, context);
  return info;
}

std::unique_ptr<AttentionClient> AttentionClient::Connect(
    const std::string& target, ClientOptions options) {
  return std::make_unique<AttentionClient>(CreateChannel(target, options),
                                           options);
}

absl::StatusOr<std::unique_ptr<AttentionClient>> AttentionClient::Open(
    const std::string& target, ClientOptions options) {
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                        OpenChannel(target, options));
  return std::make_unique<AttentionClient>(std::move(channel), options);
}

std::string AttentionClient::Authorization() const {
  if (options_.auth_token.empty()) return std::string();
  return absl::StrCat("Bearer ", options_.auth_token);
}

absl::Status AttentionClient::WaitForConnected(absl::Duration timeout) {
  if (channel_->WaitForConnected(absl::ToChronoTime(
          absl::Now() + std::max(timeout, absl::ZeroDuration())))) {
    return absl::OkStatus();
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "could not connect to the server within ", absl::FormatDuration(timeout),
      "; is attention-server running at this address?"));
}

void AttentionClient::PrepareContext(grpc::ClientContext* context,
                                     absl::Time deadline) const {
  if (!options_.auth_token.empty()) {
    context->AddMetadata("authorization", Authorization());
  }
  const absl::Time now = absl::Now();
  // gRPC reads a deadline before 1970 (a far negative timeout) as none, so
  // one already past is now.
  const absl::Time end =
      std::max(now, std::min(deadline, now + std::max(options_.call_timeout,
                                                      absl::ZeroDuration())));
  if (end != absl::InfiniteFuture()) {
    context->set_deadline(absl::ToChronoTime(end));
  }
}

absl::StatusOr<v1::SessionInfo> AttentionClient::CreateSession(
    const v1::SessionSpec& spec, absl::Duration idle_timeout) {
  v1::CreateSessionRequest request;
  *request.mutable_spec() = spec;
  request.set_idle_timeout_seconds(
      absl::ToInt64Seconds(absl::Ceil(idle_timeout, absl::Seconds(1))));
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::SessionInfo response;
  grpc::Status status = stub_->CreateSession(&context, request, &response);
  if (!status.ok()) return FromGrpcCall(status, context);
  return response;
}

absl::StatusOr<v1::SessionInfo> AttentionClient::GetSession(
    absl::string_view session_id) {
  v1::GetSessionRequest request;
  request.set_session_id(std::string(session_id));
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::SessionInfo response;
  grpc::Status status = stub_->GetSession(&context, request, &response);
  if (!status.ok()) return FromGrpcCall(status, context);
  return response;
}

template <typename Request, typename Response, typename Result>
void AttentionClient::CallAsync(
    Request request,
    absl::FunctionRef<void(grpc::ClientContext*, const Request*, Response*,
                           std::function<void(grpc::Status)>)>
        start,
    Result (*convert)(Response&&),
    absl::AnyInvocable<void(absl::StatusOr<Result>) &&> done,
    absl::Time deadline) {
  // What the call needs until it completes; its callback owns it.
  struct Call {
    grpc::ClientContext context;
    Request request;
    Response response;
    absl::AnyInvocable<void(absl::StatusOr<Result>) &&> done;
  };
  auto call = std::make_unique<Call>();
  call->request = std::move(request);
  call->done = std::move(done);
  PrepareContext(&call->context, deadline);
  Call* raw = call.release();
  start(&raw->context, &raw->request, &raw->response,
        [raw, convert](grpc::Status status) {
          std::unique_ptr<Call> call(raw);
          absl::StatusOr<Result> result =
              status.ok()
                  ? absl::StatusOr<Result>(convert(std::move(call->response)))
                  : FromGrpcCall(status, call->context);
          auto done = std::move(call->done);
          // The context holds a reference to the channel: it goes while
          // the client (whose channel it is) still lives. Dropped after
          // `done`, it could be the channel's last, and destroying a
          // channel on gRPC's own callback thread shuts down the queue that
          // thread runs.
          call.reset();
          std::move(done)(std::move(result));
        });
}

void AttentionClient::GetSessionAsync(
    absl::string_view session_id,
    absl::AnyInvocable<void(absl::StatusOr<v1::SessionInfo>) &&> done,
    absl::Time deadline) {
  v1::GetSessionRequest request;
  request.set_session_id(std::string(session_id));
  CallAsync<v1::GetSessionRequest, v1::SessionInfo, v1::SessionInfo>(
      std::move(request),
      [this](grpc::ClientContext* context, const v1::GetSessionRequest* request,
             v1::SessionInfo* response,
             std::function<void(grpc::Status)> on_done) {
        stub_->async()->GetSession(context, request, response,
                                   std::move(on_done));
      },
      [](v1::SessionInfo&& info) { return std::move(info); }, std::move(done),
      deadline);
}

absl::StatusOr<std::vector<v1::SessionInfo>> AttentionClient::ListSessions() {
  std::vector<v1::SessionInfo> sessions;
  v1::ListSessionsRequest request;
  absl::flat_hash_set<std::string> tokens;  // page tokens already followed
  do {
    grpc::ClientContext context;
    PrepareContext(&context);
    v1::ListSessionsResponse response;
    grpc::Status status = stub_->ListSessions(&context, request, &response);
    if (!status.ok()) return FromGrpcCall(status, context);
    // A page token seen before, or an empty page with a next one, would
    // loop for ever.
    if (!response.next_page_token().empty() &&
        (response.sessions().empty() ||
         !tokens.insert(response.next_page_token()).second)) {
      return absl::InternalError(
          "the server's ListSessions pages do not advance (a page token "
          "seen before, or an empty page with a next one)");
    }
    for (v1::SessionInfo& info : *response.mutable_sessions()) {
      sessions.push_back(std::move(info));
    }
    request.set_page_token(response.next_page_token());
  } while (!request.page_token().empty());
  return sessions;
}

absl::Status AttentionClient::DeleteSession(absl::string_view session_id) {
  v1::DeleteSessionRequest request;
  request.set_session_id(std::string(session_id));
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::DeleteSessionResponse response;
  return FromGrpcCall(stub_->DeleteSession(&context, request, &response),
                      context);
}

absl::StatusOr<v1::SessionInfo> AttentionClient::ForkSession(
    absl::string_view session_id) {
  v1::ForkSessionRequest request;
  request.set_session_id(std::string(session_id));
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::SessionInfo response;
  grpc::Status status = stub_->ForkSession(&context, request, &response);
  if (!status.ok()) return FromGrpcCall(status, context);
  return response;
}

absl::StatusOr<v1::SessionInfo> AttentionClient::TruncateSession(
    absl::string_view session_id, int64_t length) {
  v1::TruncateSessionRequest request;
  request.set_session_id(std::string(session_id));
  request.set_length(length);
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::SessionInfo response;
  grpc::Status status = stub_->TruncateSession(&context, request, &response);
  if (!status.ok()) return FromGrpcCall(status, context);
  return response;
}

absl::StatusOr<v1::AttentionResult> AttentionClient::Prefill(
    const v1::PrefillRequest& request) {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::AttentionResult response;
  grpc::Status status = stub_->Prefill(&context, request, &response);
  if (!status.ok()) return FromGrpcCall(status, context);
  return response;
}

absl::StatusOr<v1::AttentionResult> AttentionClient::DecodeStep(
    const v1::DecodeRequest& request) {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::AttentionResult response;
  grpc::Status status = stub_->DecodeStep(&context, request, &response);
  if (!status.ok()) return FromGrpcCall(status, context);
  return response;
}

absl::StatusOr<std::vector<v1::AttentionResult>> AttentionClient::BatchDecode(
    const v1::BatchDecodeRequest& request) {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::BatchDecodeResponse response;
  grpc::Status status = stub_->BatchDecode(&context, request, &response);
  if (!status.ok()) return FromGrpcCall(status, context);
  ATTN_RETURN_IF_ERROR(
      CheckBatchResultCount(response.results_size(), request.steps_size()));
  return std::vector<v1::AttentionResult>(response.results().begin(),
                                          response.results().end());
}

void AttentionClient::BatchDecodeAsync(
    v1::BatchDecodeRequest request,
    absl::AnyInvocable<
        void(absl::StatusOr<std::vector<v1::AttentionResult>>) &&>
        done,
    absl::Time deadline) {
  const int steps = request.steps_size();
  CallAsync<v1::BatchDecodeRequest, v1::BatchDecodeResponse,
            std::vector<v1::AttentionResult>>(
      std::move(request),
      [this](grpc::ClientContext* context,
             const v1::BatchDecodeRequest* request,
             v1::BatchDecodeResponse* response,
             std::function<void(grpc::Status)> on_done) {
        stub_->async()->BatchDecode(context, request, response,
                                    std::move(on_done));
      },
      [](v1::BatchDecodeResponse&& response) {
        return std::vector<v1::AttentionResult>(
            std::make_move_iterator(response.mutable_results()->begin()),
            std::make_move_iterator(response.mutable_results()->end()));
      },
      [steps, done = std::move(done)](
          absl::StatusOr<std::vector<v1::AttentionResult>> results) mutable {
        if (results.ok()) {
          if (absl::Status count =
                  CheckBatchResultCount(results->size(), steps);
              !count.ok()) {
            results = std::move(count);
          }
        }
        std::move(done)(std::move(results));
      },
      deadline);
}

absl::StatusOr<v1::AttentionResult> AttentionClient::Attention(
    const v1::AttentionRequest& request) {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::AttentionResult response;
  grpc::Status status = stub_->Attention(&context, request, &response);
  if (!status.ok()) return FromGrpcCall(status, context);
  return response;
}

absl::StatusOr<v1::ServerInfo> AttentionClient::GetServerInfo() {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::ServerInfo response;
  grpc::Status status =
      stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &response);
  if (!status.ok()) return FromGrpcCall(status, context);
  return response;
}

void AttentionClient::GetServerInfoAsync(
    absl::AnyInvocable<void(absl::StatusOr<v1::ServerInfo>) &&> done,
    absl::Time deadline) {
  CallAsync<v1::GetServerInfoRequest, v1::ServerInfo, v1::ServerInfo>(
      v1::GetServerInfoRequest(),
      [this](grpc::ClientContext* context,
             const v1::GetServerInfoRequest* request, v1::ServerInfo* response,
             std::function<void(grpc::Status)> on_done) {
        stub_->async()->GetServerInfo(context, request, response,
                                      std::move(on_done));
      },
      [](v1::ServerInfo&& info) { return std::move(info); }, std::move(done),
      deadline);
}

namespace {

ServingStatus ServingStatusOf(
    grpc::health::v1::HealthCheckResponse&& response) {
  switch (response.status()) {
    case grpc::health::v1::HealthCheckResponse::SERVING:
      return ServingStatus::kServing;
    case grpc::health::v1::HealthCheckResponse::NOT_SERVING:
      return ServingStatus::kNotServing;
    case grpc::health::v1::HealthCheckResponse::SERVICE_UNKNOWN:
      return ServingStatus::kServiceUnknown;
    default:
      return ServingStatus::kUnknown;
  }
}

}  // namespace

absl::StatusOr<ServingStatus> AttentionClient::CheckHealth(
    const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::ClientContext context;
  PrepareContext(&context);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = health_->stub->Check(&context, request, &response);
  if (!status.ok()) return FromGrpcCall(status, context);
  return ServingStatusOf(std::move(response));
}

void AttentionClient::CheckHealthAsync(
    const std::string& service,
    absl::AnyInvocable<void(absl::StatusOr<ServingStatus>) &&> done,
    absl::Time deadline) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  CallAsync<grpc::health::v1::HealthCheckRequest,
            grpc::health::v1::HealthCheckResponse, ServingStatus>(
      std::move(request),
      [this](grpc::ClientContext* context,
             const grpc::health::v1::HealthCheckRequest* request,
             grpc::health::v1::HealthCheckResponse* response,
             std::function<void(grpc::Status)> on_done) {
        health_->stub->async()->Check(context, request, response,
                                      std::move(on_done));
      },
      &ServingStatusOf, std::move(done), deadline);
}

std::unique_ptr<DecodeStream> AttentionClient::OpenDecodeStream() {
  return std::make_unique<DecodeStream>(stub_.get(), Authorization());
}

absl::StatusOr<SessionHandle> AttentionClient::OpenSession(
    const v1::SessionSpec& spec, absl::Duration idle_timeout) {
  auto info = CreateSession(spec, idle_timeout);
  if (!info.ok()) return info.status();
  return SessionHandle(this, *std::move(info));
}

}  // namespace attention::client
