// ReflectionService: gRPC server reflection (grpc.reflection.v1alpha, what
// grpcurl and grpc_cli ask) on the callback API, answered from the
// descriptors linked into the process (protobuf's generated pool).
//
// gRPC's own reflection service comes in Debian only as a prebuilt library,
// whose request parsing the parse budget cannot reach: a 64 MiB request of
// empty unknown groups parsed there into about 2 GiB. This one parses its
// requests through the budget (proto/reflection_parse_budget.h) like every
// other request of the server. It answers list_services,
// file_by_filename, file_containing_symbol, file_containing_extension and
// all_extension_numbers_of_type as gRPC's does: a file comes with every
// file it imports, directly or not; a question without an answer gets an
// error_response (NOT_FOUND, quoting at most a short prefix of the name;
// UNIMPLEMENTED for a request that asks nothing; INVALID_ARGUMENT, echoing
// nothing, for one over 64 KiB, since an answer echoes its request), and
// the stream goes on. A request whose bytes do not parse ends the stream
// with INVALID_ARGUMENT (server/unparsed_reads.h).
//
// Thread-safety: SetServices and the streams may run concurrently.
#ifndef ATTENTION_SERVER_REFLECTION_SERVICE_H_
#define ATTENTION_SERVER_REFLECTION_SERVICE_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>

#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "server/unparsed_reads.h"

namespace attention::server {

class ReflectionService final
    : public grpc::reflection::v1alpha::ServerReflection::CallbackService {
 public:
  using Request = grpc::reflection::v1alpha::ServerReflectionRequest;
  using Response = grpc::reflection::v1alpha::ServerReflectionResponse;

  // `unparsed_reads` (may be null: a request that does not parse then ends
  // the stream as its client's half-close would) must outlive the service.
  explicit ReflectionService(UnparsedReads* unparsed_reads)
      : unparsed_reads_(unparsed_reads) {}

  // The services list_services names (fully qualified): those of the
  // server once it is built. None until then.
  void SetServices(std::vector<std::string> names);

  // The answer to one request.
  Response Answer(const Request& request) const;

  grpc::ServerBidiReactor<Request, Response>* ServerReflectionInfo(
      grpc::CallbackServerContext* context) override;

 private:
  UnparsedReads* const unparsed_reads_;
  mutable absl::Mutex mu_;
  std::vector<std::string> services_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_REFLECTION_SERVICE_H_
