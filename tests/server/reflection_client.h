// A minimal grpc.reflection client for tests, on gRPC's generic stub: it
// sends request bytes as given and returns the response bytes, so tests can
// check the wire format without the server's own definition of it.
#ifndef ATTENTION_TESTS_SERVER_REFLECTION_CLIENT_H_
#define ATTENTION_TESTS_SERVER_REFLECTION_CLIENT_H_

#include <grpcpp/channel.h>
#include <grpcpp/support/status.h>

#include <memory>
#include <string>
#include <vector>

namespace attention::testing {

struct ReflectionExchange {
  grpc::Status status;
  // The responses read, in order (all of them, whatever the status).
  std::vector<std::string> responses;
};

// Sends `requests` (encoded ServerReflectionRequests) on one
// ServerReflectionInfo stream over `channel`, reading one response after
// each, then half-closes; sends `authorization` as metadata when not empty.
// Stops at the first request that gets no response.
ReflectionExchange ExchangeWithReflection(
    const std::shared_ptr<grpc::Channel>& channel,
    const std::vector<std::string>& requests,
    const std::string& authorization = "");

struct ReflectionListing {
  grpc::Status status;
  // The services listed (empty unless status is OK).
  std::vector<std::string> services;
};

// Asks ServerReflectionInfo for list_services over `channel` (the request
// and response hand-encoded).
ReflectionListing ListServicesByReflection(
    const std::shared_ptr<grpc::Channel>& channel,
    const std::string& authorization = "");

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_SERVER_REFLECTION_CLIENT_H_
