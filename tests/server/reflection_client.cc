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

ReflectionExchange ExchangeWithReflection(
    const std::shared_ptr<grpc::Channel>& channel,
    const std::vector<std::string>& requests,
    const std::string& authorization) {
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
  ReflectionExchange exchange;
  call->StartCall(&tag);
  if (Await(cq)) {
    for (const std::string& bytes : requests) {
      grpc::Slice slice(bytes);
      grpc::ByteBuffer request(&slice, 1);
      call->Write(request, &tag);
      if (!Await(cq)) break;
      grpc::ByteBuffer response;
      call->Read(&response, &tag);
      if (!Await(cq)) break;
      std::vector<grpc::Slice> slices;
      std::string& read = exchange.responses.emplace_back();
      if (response.Dump(&slices).ok()) {
        for (const grpc::Slice& s : slices) {
          read.append(reinterpret_cast<const char*>(s.begin()), s.size());
        }
      }
    }
    call->WritesDone(&tag);
    Await(cq);
  }
  call->Finish(&exchange.status, &tag);
  Await(cq);
  cq.Shutdown();
  void* ignored_tag = nullptr;
  bool ignored_ok = false;
  while (cq.Next(&ignored_tag, &ignored_ok)) {
  }
  return exchange;
}

ReflectionListing ListServicesByReflection(
    const std::shared_ptr<grpc::Channel>& channel,
    const std::string& authorization) {
  // ServerReflectionRequest{list_services: ""} (field 7).
  const ReflectionExchange exchange = ExchangeWithReflection(
      channel, {std::string("\x3a\x00", 2)}, authorization);
  ReflectionListing listing;
  listing.status = exchange.status;
  if (listing.status.ok() && !exchange.responses.empty()) {
    listing.services = ServiceNames(exchange.responses[0]);
  }
  return listing;
}

}  // namespace attention::testing
