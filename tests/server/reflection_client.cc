#include "tests/server/reflection_client.h"

#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/client_context.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/byte_buffer.h>

namespace attention::testing {
namespace {

// Runs one async operation on `cq`; whether it succeeded.
bool Await(grpc::CompletionQueue& cq) {
  void* tag = nullptr;
  bool ok = false;
  return cq.Next(&tag, &ok) && ok;
}

// ServerReflectionResponse.list_services_response (6) .service (1) .name (1).
std::vector<std::string> ServiceNames(const std::string& bytes) {
  std::vector<std::string> names;
  google::protobuf::UnknownFieldSet message;
  if (!message.ParseFromString(bytes)) return names;
  for (int i = 0; i < message.field_count(); ++i) {
    if (message.field(i).number() != 6) continue;
    google::protobuf::UnknownFieldSet list;
    if (!list.ParseFromString(message.field(i).length_delimited())) continue;
    for (int j = 0; j < list.field_count(); ++j) {
      google::protobuf::UnknownFieldSet service;
      if (!service.ParseFromString(list.field(j).length_delimited())) continue;
      for (int k = 0; k < service.field_count(); ++k) {
        names.push_back(service.field(k).length_delimited());
      }
    }
  }
  return names;
}

}  // namespace

ReflectionListing ListServicesByReflection(
    const std::shared_ptr<grpc::Channel>& channel,
    const std::string& authorization) {
  // ServerReflectionRequest{list_services: ""} (field 7).
  const std::string request_bytes("\x3a\x00", 2);
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  if (!authorization.empty()) {
    context.AddMetadata("authorization", authorization);
  }
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(
      &context,
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  int tag = 0;
  std::string bytes;
  call->StartCall(&tag);
  if (Await(cq)) {
    grpc::Slice slice(request_bytes);
    grpc::ByteBuffer request(&slice, 1);
    call->Write(request, &tag);
    Await(cq);
    grpc::ByteBuffer response;
    call->Read(&response, &tag);
    if (Await(cq)) {
      std::vector<grpc::Slice> slices;
      if (response.Dump(&slices).ok()) {
        for (const grpc::Slice& s : slices) {
          bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
        }
      }
    }
    call->WritesDone(&tag);
    Await(cq);
  }
  ReflectionListing listing;
  call->Finish(&listing.status, &tag);
  Await(cq);
  cq.Shutdown();
  void* ignored_tag = nullptr;
  bool ignored_ok = false;
  while (cq.Next(&ignored_tag, &ignored_ok)) {
  }
  if (listing.status.ok()) listing.services = ServiceNames(bytes);
  return listing;
}

}  // namespace attention::testing
