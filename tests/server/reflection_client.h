// A minimal grpc.reflection client for tests: the reflection protos are not
// installed by the gRPC packages, so the request is hand-encoded and the
// response read as unknown fields.
#ifndef ATTENTION_TESTS_SERVER_REFLECTION_CLIENT_H_
#define ATTENTION_TESTS_SERVER_REFLECTION_CLIENT_H_

#include <grpcpp/channel.h>
#include <grpcpp/support/status.h>

#include <memory>
#include <string>
#include <vector>

namespace attention::testing {

struct ReflectionListing {
  grpc::Status status;
  // The services listed (empty unless status is OK).
  std::vector<std::string> services;
};

// Asks ServerReflectionInfo for list_services over `channel`, sending
// `authorization` as metadata when not empty.
ReflectionListing ListServicesByReflection(
    const std::shared_ptr<grpc::Channel>& channel,
    const std::string& authorization = "");

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_SERVER_REFLECTION_CLIENT_H_
