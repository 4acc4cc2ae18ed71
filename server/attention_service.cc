#include "server/attention_service.h"

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/proto_convert.h"
#include "server/request_scope.h"
#include "server/status_convert.h"

namespace attention::server {

namespace {

// Sizes `result`'s output tensor for `request`'s [T, H, value_dim] output
// and makes it the request's output destination, so that the engine writes
// the output once, straight into the response. Leaves the request without a
// destination when q or v is not rank 3 (the engine rejects it anyway) or
// when the output could not be sent in a message of `max_message_bytes`.
// Reusing `result` (the Decode stream does) reuses its buffer.
void PrepareOutput(AppendRequest& request, v1::AttentionResult* result,
                   int64_t max_message_bytes) {
  if (request.q.rank() != 3 || request.v.rank() != 3) return;
  const int64_t tokens = request.q.dim(0);
  const int64_t heads = request.q.dim(1);
  const int64_t value_dim = request.v.dim(2);
  const int64_t element = DTypeSize(request.output_dtype);
  // Each dimension is positive and below 2^48; compare by division so the
  // product cannot overflow.
  if (tokens > max_message_bytes / element / heads / value_dim) return;
  const int64_t bytes = tokens * heads * value_dim * element;
  v1::Tensor* output = result->mutable_output();
  output->set_dtype(DTypeToProto(request.output_dtype));
  output->clear_shape();
  output->add_shape(tokens);
  output->add_shape(heads);
  output->add_shape(value_dim);
  std::string* data = output->mutable_data();
  data->resize(static_cast<size_t>(bytes));
  request.output_destination =
      absl::MakeSpan(reinterpret_cast<std::byte*>(data->data()), data->size());
}

// Completes `result` from the engine's answer to `request`, whose output
// PrepareOutput may have already placed in the response.
void FinishResult(const AppendRequest& request, const AttentionOutput& output,
                  v1::AttentionResult* result) {
  if (request.output_destination.empty()) {
    TensorToProto(output.output, result->mutable_output());
  }
  result->set_position(output.position);
  result->clear_weights();
  if (output.lse.has_value()) {
    TensorToProto(*output.lse, result->mutable_lse());
  } else {
    result->clear_lse();
  }
}

// One Prefill or DecodeStep: converts `request`, runs it with `run` (the
// engine, or the batcher for decode steps) and answers with the output
// written once, straight into `response`.
template <typename Request, typename Run>
grpc::Status AppendAndRespond(const Request& request, int64_t max_message_bytes,
                              v1::AttentionResult* response, Run run) {
  auto append = AppendRequestFromProto(request);
  if (!append.ok()) return ToGrpcStatus(append.status());
  PrepareOutput(*append, response, max_message_bytes);
  absl::StatusOr<AttentionOutput> output = run(*append);
  if (!output.ok()) return ToGrpcStatus(output.status());
  FinishResult(*append, *output, response);
  return grpc::Status::OK;
}

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(AttentionEngine* engine,
                                           DecodeBatcher* batcher,
                                           std::string version,
                                           int64_t max_message_bytes,
                                           ServerMetrics* metrics)
    : engine_(engine),
      batcher_(batcher),
      version_(std::move(version)),
      max_message_bytes_(max_message_bytes),
      metrics_(metrics) {}

void AttentionServiceImpl::StartDraining() {
  draining_.store(true, std::memory_order_release);
}

grpc::Status AttentionServiceImpl::CreateSession(
    grpc::ServerContext* context, const v1::CreateSessionRequest* request,
    v1::SessionInfo* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kCreateSession, "");
  const grpc::Status status = [&]() -> grpc::Status {
    if (draining_.load(std::memory_order_acquire)) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "the server is draining (shutting down) and takes "
                          "no new sessions; create the session on another "
                          "replica");
    }
    auto spec = SessionSpecFromProto(request->spec());
    if (!spec.ok()) return ToGrpcStatus(spec.status());
    auto info = engine_->CreateSession(
        *spec, absl::Seconds(request->idle_timeout_seconds()));
    if (!info.ok()) return ToGrpcStatus(info.status());
    SessionInfoToProto(*info, response);
    return grpc::Status::OK;
  }();
  return scope.Finish(status);
}

grpc::Status AttentionServiceImpl::GetSession(
    grpc::ServerContext* context, const v1::GetSessionRequest* request,
    v1::SessionInfo* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kGetSession,
                     request->session_id());
  const grpc::Status status = [&]() -> grpc::Status {
    auto info = engine_->GetSession(request->session_id());
    if (!info.ok()) return ToGrpcStatus(info.status());
    SessionInfoToProto(*info, response);
    return grpc::Status::OK;
  }();
  return scope.Finish(status);
}

grpc::Status AttentionServiceImpl::ListSessions(
    grpc::ServerContext* context, const v1::ListSessionsRequest* request,
    v1::ListSessionsResponse* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kListSessions, "");
  const grpc::Status status = [&]() -> grpc::Status {
    for (const SessionInfo& info : engine_->ListSessions()) {
      SessionInfoToProto(info, response->add_sessions());
    }
    return grpc::Status::OK;
  }();
  return scope.Finish(status);
}

grpc::Status AttentionServiceImpl::DeleteSession(
    grpc::ServerContext* context, const v1::DeleteSessionRequest* request,
    v1::DeleteSessionResponse* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kDeleteSession,
                     request->session_id());
  const grpc::Status status = [&]() -> grpc::Status {
    return ToGrpcStatus(engine_->DeleteSession(request->session_id()));
  }();
  return scope.Finish(status);
}

grpc::Status AttentionServiceImpl::ForkSession(
    grpc::ServerContext* context, const v1::ForkSessionRequest* request,
    v1::SessionInfo* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kForkSession,
                     request->session_id());
  const grpc::Status status = [&]() -> grpc::Status {
    if (draining_.load(std::memory_order_acquire)) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "the server is draining (shutting down) and takes "
                          "no new sessions; create the session on another "
                          "replica");
    }
    auto info = engine_->ForkSession(request->session_id());
    if (!info.ok()) return ToGrpcStatus(info.status());
    SessionInfoToProto(*info, response);
    return grpc::Status::OK;
  }();
  return scope.Finish(status);
}

grpc::Status AttentionServiceImpl::TruncateSession(
    grpc::ServerContext* context, const v1::TruncateSessionRequest* request,
    v1::SessionInfo* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kTruncateSession,
                     request->session_id());
  const grpc::Status status = [&]() -> grpc::Status {
    auto info =
        engine_->TruncateSession(request->session_id(), request->length());
    if (!info.ok()) return ToGrpcStatus(info.status());
    SessionInfoToProto(*info, response);
    return grpc::Status::OK;
  }();
  return scope.Finish(status);
}

grpc::Status AttentionServiceImpl::Prefill(grpc::ServerContext* context,
                                           const v1::PrefillRequest* request,
                                           v1::AttentionResult* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kPrefill,
                     request->session_id());
  const grpc::Status status = AppendAndRespond(
      *request, max_message_bytes_, response,
      [&](const AppendRequest& append) { return engine_->Append(append); });
  return scope.Finish(status);
}

grpc::Status AttentionServiceImpl::DecodeStep(grpc::ServerContext* context,
                                              const v1::DecodeRequest* request,
                                              v1::AttentionResult* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kDecodeStep,
                     request->session_id());
  const grpc::Status status = AppendAndRespond(
      *request, max_message_bytes_, response,
      [&](const AppendRequest& append) { return batcher_->Append(append); });
  return scope.Finish(status);
}

grpc::Status AttentionServiceImpl::Decode(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::AttentionResult, v1::DecodeRequest>* stream) {
  // The stream counts as in flight while open; each step is recorded as one
  // Decode request (its own code and latency).
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kDecode, "");
  ScopedStreamMetric open_stream(metrics_);
  v1::DecodeRequest request;
  // Reused for every step, so a steady stream reuses its output buffer.
  v1::AttentionResult result;
  for (int64_t index = 0; stream->Read(&request); ++index) {
    scope.Restart(request.session_id());
    auto append =
        AppendRequestFromProto(request, absl::StrCat("requests[", index, "]"));
    if (!append.ok()) return scope.Finish(ToGrpcStatus(append.status()));
    PrepareOutput(*append, &result, max_message_bytes_);
    auto output = batcher_->Append(*append);
    if (!output.ok()) {
      // Say which request of the stream failed: the client has already
      // seen `index` results and needs to know where the stream stopped.
      return scope.Finish(ToGrpcStatus(absl::Status(
          output.status().code(),
          absl::StrCat("requests[", index, "]: ", output.status().message()))));
    }
    FinishResult(*append, *output, &result);
    if (!stream->Write(result)) {
      // The client went away; the step is applied, nobody is listening.
      return scope.Finish(grpc::Status(grpc::StatusCode::CANCELLED,
                                       "the client closed the Decode stream"));
    }
    scope.Finish(grpc::Status::OK);
  }
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::BatchDecode(
    grpc::ServerContext* context, const v1::BatchDecodeRequest* request,
    v1::BatchDecodeResponse* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kBatchDecode, "");
  const grpc::Status status = [&]() -> grpc::Status {
    std::vector<AppendRequest> appends;
    appends.reserve(request->steps_size());
    for (int i = 0; i < request->steps_size(); ++i) {
      auto append = AppendRequestFromProto(request->steps(i),
                                           absl::StrCat("steps[", i, "]"));
      if (!append.ok()) return ToGrpcStatus(append.status());
      appends.push_back(*std::move(append));
    }
    // Result messages are heap-allocated by the repeated field, so their
    // buffers stay put while more are added.
    for (AppendRequest& append : appends) {
      PrepareOutput(append, response->add_results(), max_message_bytes_);
    }
    auto outputs = batcher_->AppendAtomic(appends);
    if (!outputs.ok()) return ToGrpcStatus(outputs.status());
    for (size_t i = 0; i < appends.size(); ++i) {
      FinishResult(appends[i], (*outputs)[i],
                   response->mutable_results(static_cast<int>(i)));
    }
    return grpc::Status::OK;
  }();
  return scope.Finish(status);
}

grpc::Status AttentionServiceImpl::Attention(
    grpc::ServerContext* context, const v1::AttentionRequest* request,
    v1::AttentionResult* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kAttention, "");
  const grpc::Status status = [&]() -> grpc::Status {
    auto stateless = StatelessRequestFromProto(*request);
    if (!stateless.ok()) return ToGrpcStatus(stateless.status());
    auto output = engine_->Attend(*stateless);
    if (!output.ok()) return ToGrpcStatus(output.status());
    AttentionOutputToProto(*output, response);
    return grpc::Status::OK;
  }();
  return scope.Finish(status);
}

grpc::Status AttentionServiceImpl::GetServerInfo(
    grpc::ServerContext* context, const v1::GetServerInfoRequest* request,
    v1::ServerInfo* response) {
  RequestScope scope(metrics_, &in_flight_, RpcMethod::kGetServerInfo, "");
  const grpc::Status status = [&]() -> grpc::Status {
    const EngineStats stats = engine_->stats();
    response->set_version(version_);
    response->set_backend(std::string(engine_->backend().name()));
    response->set_device(engine_->backend().device());
    response->set_kv_cache_capacity_bytes(stats.pool.capacity_bytes);
    response->set_kv_cache_used_bytes(stats.pool.used_bytes);
    response->set_active_sessions(stats.active_sessions);
    response->set_max_message_bytes(max_message_bytes_);
    return grpc::Status::OK;
  }();
  return scope.Finish(status);
}

}  // namespace attention::server
