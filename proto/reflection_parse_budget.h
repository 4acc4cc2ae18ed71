// The parse budget (parse_budget.h) for the requests of the server's
// reflection service: the generated reflection.grpc.pb.h includes this.
#ifndef ATTENTION_PROTO_REFLECTION_PARSE_BUDGET_H_
#define ATTENTION_PROTO_REFLECTION_PARSE_BUDGET_H_

#include "grpc/reflection/v1alpha/reflection.pb.h"
#include "proto/parse_budget.h"

namespace grpc {

template <>
class SerializationTraits< ::grpc::reflection::v1alpha::ServerReflectionRequest,
                           void>
    : public ::attention::proto::BudgetedProtoTraits<
          ::grpc::reflection::v1alpha::ServerReflectionRequest> {};

}  // namespace grpc

#endif  // ATTENTION_PROTO_REFLECTION_PARSE_BUDGET_H_
