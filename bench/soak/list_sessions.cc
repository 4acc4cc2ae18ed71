#include "bench/soak/list_sessions.h"

#include <grpcpp/client_context.h>

#include <string>

namespace attention::soak {
namespace {

// Bounds the loop even if a server kept returning tokens: 10000 pages of up
// to 1000 sessions.
constexpr int kMaxPages = 10000;

}  // namespace

grpc::Status ListAllSessions(v1::AttentionService::Stub* stub,
                             absl::Time deadline,
                             std::vector<v1::SessionInfo>* sessions) {
  std::string page_token;
  for (int page = 0; page < kMaxPages; ++page) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    v1::ListSessionsRequest request;
    request.set_page_token(page_token);
    v1::ListSessionsResponse response;
    grpc::Status status = stub->ListSessions(&context, request, &response);
    if (!status.ok()) return status;
    for (v1::SessionInfo& info : *response.mutable_sessions()) {
      sessions->push_back(std::move(info));
    }
    if (response.next_page_token().empty()) return grpc::Status::OK;
    page_token = response.next_page_token();
  }
  return grpc::Status(grpc::StatusCode::OUT_OF_RANGE,
                      "ListSessions returned more pages than attn-soak reads");
}

}  // namespace attention::soak
