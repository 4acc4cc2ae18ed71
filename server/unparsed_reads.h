// UnparsedReads: the calls whose streamed request message did not parse.
//
// gRPC ends a stream's reads at a message whose bytes are not a valid
// protobuf message of the request's type, or would take more than their
// parse budget (proto/parse_budget.h), exactly as at the stream's clean
// end: a synchronous handler's Read returns false, a callback handler's
// OnReadDone gets false, either way. ParseErrorInterceptor sees which it
// was, on the thread that deserialized the message (TakeUnparsedMessage),
// and notes the call here before gRPC hands the read's outcome to the
// handler; the handler asks with Take once its reads end, and answers
// INVALID_ARGUMENT (UnparsedRequest) instead of treating the stream as
// ended by its client. A note the handler never takes goes with its call
// (the interceptor takes it when it is destroyed).
//
// Thread-safe.
#ifndef ATTENTION_SERVER_UNPARSED_READS_H_
#define ATTENTION_SERVER_UNPARSED_READS_H_

#include <grpcpp/server_context.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace attention::server {

class UnparsedReads {
 public:
  // `call`'s latest read ended at a message that did not parse.
  void Note(const grpc::ServerContextBase* call);
  // Whether `call`'s reads ended at a message that did not parse (rather
  // than at the stream's end, or its cancellation); clears the note.
  bool Take(const grpc::ServerContextBase* call);

 private:
  absl::Mutex mu_;
  absl::flat_hash_set<const grpc::ServerContextBase*> calls_
      ABSL_GUARDED_BY(mu_);
};

// INVALID_ARGUMENT for a request of `method` (its path,
// /package.Service/Method) whose bytes are not a valid protobuf message, or
// would take more than their parse budget; it says how to mend it.
absl::Status UnparsedRequest(absl::string_view method);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_UNPARSED_READS_H_
