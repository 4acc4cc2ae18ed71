#include "bench/soak/list_sessions.h"

#include <grpcpp/client_context.h>

namespace attention::soak {

grpc::Status ListAllSessions(v1::AttentionService::Stub* stub,
                             absl::Time deadline,
                             std::vector<v1::SessionInfo>* sessions) {
  // With paging: set page_token from the previous response and loop until
  // next_page_token is empty.
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  v1::ListSessionsRequest request;
  v1::ListSessionsResponse response;
  grpc::Status status = stub->ListSessions(&context, request, &response);
  if (!status.ok()) return status;
  for (v1::SessionInfo& info : *response.mutable_sessions()) {
    sessions->push_back(std::move(info));
  }
  return grpc::Status::OK;
}

}  // namespace attention::soak
