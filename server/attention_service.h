// AttentionServiceImpl: the attention.v1.AttentionService RPCs over an
// AttentionEngine (synchronous gRPC API).
//
// Each handler converts the request (proto_convert.h), makes one engine
// call, and converts the result and status back (status_convert.h); the
// semantics and status codes are the engine's (core/engine.h).
//
// Thread-safety: handlers run concurrently on gRPC's threads; the engine is
// thread-safe.
#ifndef ATTENTION_SERVER_ATTENTION_SERVICE_H_
#define ATTENTION_SERVER_ATTENTION_SERVICE_H_

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "core/engine.h"

namespace attention::server {

class AttentionServiceImpl final : public v1::AttentionService::Service {
 public:
  // `engine` must outlive the service. `version` and `max_message_bytes`
  // are reported by GetServerInfo.
  AttentionServiceImpl(AttentionEngine* engine, std::string version,
                       int64_t max_message_bytes);

  grpc::Status CreateSession(grpc::ServerContext* context,
                             const v1::CreateSessionRequest* request,
                             v1::SessionInfo* response) override;
  grpc::Status GetSession(grpc::ServerContext* context,
                          const v1::GetSessionRequest* request,
                          v1::SessionInfo* response) override;
  grpc::Status ListSessions(grpc::ServerContext* context,
                            const v1::ListSessionsRequest* request,
                            v1::ListSessionsResponse* response) override;
  grpc::Status DeleteSession(grpc::ServerContext* context,
                             const v1::DeleteSessionRequest* request,
                             v1::DeleteSessionResponse* response) override;
  grpc::Status ForkSession(grpc::ServerContext* context,
                           const v1::ForkSessionRequest* request,
                           v1::SessionInfo* response) override;
  grpc::Status TruncateSession(grpc::ServerContext* context,
                               const v1::TruncateSessionRequest* request,
                               v1::SessionInfo* response) override;
  grpc::Status Prefill(grpc::ServerContext* context,
                       const v1::PrefillRequest* request,
                       v1::AttentionResult* response) override;
  grpc::Status DecodeStep(grpc::ServerContext* context,
                          const v1::DecodeRequest* request,
                          v1::AttentionResult* response) override;
  // One engine Append per request, answered in order. The first failing
  // request ends the stream with its status; earlier steps stay applied.
  grpc::Status Decode(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::AttentionResult, v1::DecodeRequest>* stream)
      override;
  // All steps go to one engine AppendBatch: all or nothing.
  grpc::Status BatchDecode(grpc::ServerContext* context,
                           const v1::BatchDecodeRequest* request,
                           v1::BatchDecodeResponse* response) override;
  grpc::Status Attention(grpc::ServerContext* context,
                         const v1::AttentionRequest* request,
                         v1::AttentionResult* response) override;
  grpc::Status GetServerInfo(grpc::ServerContext* context,
                             const v1::GetServerInfoRequest* request,
                             v1::ServerInfo* response) override;

 private:
  AttentionEngine* const engine_;
  const std::string version_;
  const int64_t max_message_bytes_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_ATTENTION_SERVICE_H_
