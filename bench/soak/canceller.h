// attn-soak: cancels calls in flight from another thread
// (grpc::ClientContext::TryCancel), at random moments.
#ifndef ATTENTION_BENCH_SOAK_CANCELLER_H_
#define ATTENTION_BENCH_SOAK_CANCELLER_H_

#include <grpcpp/client_context.h>

#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attention::soak {

// A thread that, every `mean_interval` on average (exponentially
// distributed), cancels one registered context chosen at random. Contexts
// are registered for the length of a call with a Canceller::Scope.
class Canceller {
 public:
  Canceller(uint64_t seed, absl::Duration mean_interval);
  ~Canceller();  // stops the thread

  Canceller(const Canceller&) = delete;
  Canceller& operator=(const Canceller&) = delete;

  // Registers `context` (which must outlive the scope) while in scope; a
  // null canceller registers nothing.
  class Scope {
   public:
    Scope(Canceller* canceller, grpc::ClientContext* context);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Canceller* canceller_;
    grpc::ClientContext* context_;
  };

  int64_t cancelled() const;

 private:
  void Run();

  mutable absl::Mutex mu_;
  std::vector<grpc::ClientContext*> contexts_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  std::mt19937_64 rng_;
  const absl::Duration mean_interval_;
  std::thread thread_;
};

}  // namespace attention::soak

#endif  // ATTENTION_BENCH_SOAK_CANCELLER_H_
