#include "server/attention_service.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/proto_convert.h"
#include "server/status_convert.h"

namespace attention::server {

AttentionServiceImpl::AttentionServiceImpl(AttentionEngine* engine,
                                           std::string version,
                                           int64_t max_message_bytes)
    : engine_(engine),
      version_(std::move(version)),
      max_message_bytes_(max_message_bytes) {}

grpc::Status AttentionServiceImpl::CreateSession(
    grpc::ServerContext* context, const v1::CreateSessionRequest* request,
    v1::SessionInfo* response) {
  auto spec = SessionSpecFromProto(request->spec());
  if (!spec.ok()) return ToGrpcStatus(spec.status());
  auto info = engine_->CreateSession(
      *spec, absl::Seconds(request->idle_timeout_seconds()));
  if (!info.ok()) return ToGrpcStatus(info.status());
  SessionInfoToProto(*info, response);
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::GetSession(
    grpc::ServerContext* context, const v1::GetSessionRequest* request,
    v1::SessionInfo* response) {
  auto info = engine_->GetSession(request->session_id());
  if (!info.ok()) return ToGrpcStatus(info.status());
  SessionInfoToProto(*info, response);
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::ListSessions(
    grpc::ServerContext* context, const v1::ListSessionsRequest* request,
    v1::ListSessionsResponse* response) {
  for (const SessionInfo& info : engine_->ListSessions()) {
    SessionInfoToProto(info, response->add_sessions());
  }
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::DeleteSession(
    grpc::ServerContext* context, const v1::DeleteSessionRequest* request,
    v1::DeleteSessionResponse* response) {
  return ToGrpcStatus(engine_->DeleteSession(request->session_id()));
}

grpc::Status AttentionServiceImpl::ForkSession(
    grpc::ServerContext* context, const v1::ForkSessionRequest* request,
    v1::SessionInfo* response) {
  auto info = engine_->ForkSession(request->session_id());
  if (!info.ok()) return ToGrpcStatus(info.status());
  SessionInfoToProto(*info, response);
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::TruncateSession(
    grpc::ServerContext* context, const v1::TruncateSessionRequest* request,
    v1::SessionInfo* response) {
  auto info =
      engine_->TruncateSession(request->session_id(), request->length());
  if (!info.ok()) return ToGrpcStatus(info.status());
  SessionInfoToProto(*info, response);
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::Prefill(grpc::ServerContext* context,
                                           const v1::PrefillRequest* request,
                                           v1::AttentionResult* response) {
  auto append = AppendRequestFromProto(*request);
  if (!append.ok()) return ToGrpcStatus(append.status());
  auto output = engine_->Append(*append);
  if (!output.ok()) return ToGrpcStatus(output.status());
  AttentionOutputToProto(*output, response);
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::DecodeStep(grpc::ServerContext* context,
                                              const v1::DecodeRequest* request,
                                              v1::AttentionResult* response) {
  auto append = AppendRequestFromProto(*request);
  if (!append.ok()) return ToGrpcStatus(append.status());
  auto output = engine_->Append(*append);
  if (!output.ok()) return ToGrpcStatus(output.status());
  AttentionOutputToProto(*output, response);
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::Decode(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::AttentionResult, v1::DecodeRequest>* stream) {
  v1::DecodeRequest request;
  v1::AttentionResult result;
  for (int64_t index = 0; stream->Read(&request); ++index) {
    const std::string what = absl::StrCat("requests[", index, "]");
    auto append = AppendRequestFromProto(request, what);
    if (!append.ok()) return ToGrpcStatus(append.status());
    auto output = engine_->Append(*append);
    if (!output.ok()) {
      // Say which request of the stream failed: the client has already
      // seen `index` results and needs to know where the stream stopped.
      return ToGrpcStatus(
          absl::Status(output.status().code(),
                       absl::StrCat(what, ": ", output.status().message())));
    }
    AttentionOutputToProto(*output, &result);
    if (!stream->Write(result)) {
      // The client went away; the step is applied, nobody is listening.
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          "the client closed the Decode stream");
    }
  }
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::BatchDecode(
    grpc::ServerContext* context, const v1::BatchDecodeRequest* request,
    v1::BatchDecodeResponse* response) {
  std::vector<AppendRequest> appends;
  appends.reserve(request->steps_size());
  for (int i = 0; i < request->steps_size(); ++i) {
    auto append = AppendRequestFromProto(request->steps(i),
                                         absl::StrCat("steps[", i, "]"));
    if (!append.ok()) return ToGrpcStatus(append.status());
    appends.push_back(*std::move(append));
  }
  auto outputs = engine_->AppendBatch(appends);
  if (!outputs.ok()) return ToGrpcStatus(outputs.status());
  for (const AttentionOutput& output : *outputs) {
    AttentionOutputToProto(output, response->add_results());
  }
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::Attention(
    grpc::ServerContext* context, const v1::AttentionRequest* request,
    v1::AttentionResult* response) {
  auto stateless = StatelessRequestFromProto(*request);
  if (!stateless.ok()) return ToGrpcStatus(stateless.status());
  auto output = engine_->Attend(*stateless);
  if (!output.ok()) return ToGrpcStatus(output.status());
  AttentionOutputToProto(*output, response);
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::GetServerInfo(
    grpc::ServerContext* context, const v1::GetServerInfoRequest* request,
    v1::ServerInfo* response) {
  const EngineStats stats = engine_->stats();
  response->set_version(version_);
  response->set_backend(std::string(engine_->backend().name()));
  response->set_device(engine_->backend().device());
  response->set_kv_cache_capacity_bytes(stats.pool.capacity_bytes);
  response->set_kv_cache_used_bytes(stats.pool.used_bytes);
  response->set_active_sessions(stats.active_sessions);
  response->set_max_message_bytes(max_message_bytes_);
  return grpc::Status::OK;
}

}  // namespace attention::server
