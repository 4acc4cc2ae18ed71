// OpenStreams: the Decode streams open now, so that a change of the
// server's tenants (a reloaded tokens file) reaches the streams that wait
// for their client. Without it a stream would see the change only with its
// client's next request: a revoked tenant that kept its stream open and
// silent would keep the sessions it had used from expiring for as long as
// its connection lived.
//
// Thread-safety: thread-safe. TenantsChanged() calls every stream's
// OnTenantsChanged() with the registry's lock held, so Remove() waits for
// a call in progress: a stream that removes itself before it is destroyed
// is never called after.
#ifndef ATTENTION_SERVER_OPEN_STREAMS_H_
#define ATTENTION_SERVER_OPEN_STREAMS_H_

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"

namespace attention::server {

// What OpenStreams calls.
class TenantsChangedListener {
 public:
  virtual ~TenantsChangedListener() = default;

  // Called after the server's tenants changed, on the thread that changed
  // them. Must not call into the OpenStreams that calls it.
  virtual void OnTenantsChanged() = 0;
};

class OpenStreams {
 public:
  // REQUIRES: `stream` is not registered; it stays valid until Remove().
  void Add(TenantsChangedListener* stream) ABSL_LOCKS_EXCLUDED(mu_);
  // Unregisters `stream` (nothing when it is not registered); once this
  // returns, the registry never calls it again.
  void Remove(TenantsChangedListener* stream) ABSL_LOCKS_EXCLUDED(mu_);

  // Calls OnTenantsChanged() of every registered stream.
  void TenantsChanged() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  absl::flat_hash_set<TenantsChangedListener*> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_OPEN_STREAMS_H_
