// OpenStreams: the Decode streams open now, so that what happens to the
// server reaches the streams that wait for their client:
//   - a change of the server's tenants (a reloaded tokens file). Without it
//     a stream would see the change only with its client's next request: a
//     revoked tenant that kept its stream open and silent would keep the
//     sessions it had used from expiring for as long as its connection
//     lived.
//   - the end of a drain's time for calls (EndIdle). gRPC's shutdown would
//     cancel a stream left open, and a client could not tell whether a
//     request it had just sent was applied; a stream that ends itself
//     between two steps says that none was.
//
// Thread-safety: thread-safe. TenantsChanged() and EndIdle() call the
// streams with the registry's lock held, so Remove() waits for a call in
// progress: a stream that removes itself before it is destroyed is never
// called after.
#ifndef ATTENTION_SERVER_OPEN_STREAMS_H_
#define ATTENTION_SERVER_OPEN_STREAMS_H_

#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"

namespace attention::server {

// What OpenStreams calls, on the thread that calls OpenStreams. Neither
// may call into the OpenStreams that calls it.
class OpenStreamListener {
 public:
  virtual ~OpenStreamListener() = default;

  // The server's tenants changed.
  virtual void OnTenantsChanged() = 0;
  // The stream is to end as soon as it waits for its client's next request
  // (now, if it does): OpenStreams::ending_idle() is true from before this
  // call on.
  virtual void OnEndIdle() = 0;
};

class OpenStreams {
 public:
  // REQUIRES: `stream` is not registered; it stays valid until Remove().
  void Add(OpenStreamListener* stream) ABSL_LOCKS_EXCLUDED(mu_);
  // Unregisters `stream` (nothing when it is not registered); once this
  // returns, the registry never calls it again.
  void Remove(OpenStreamListener* stream) ABSL_LOCKS_EXCLUDED(mu_);

  // Calls OnTenantsChanged() of every registered stream.
  void TenantsChanged() ABSL_LOCKS_EXCLUDED(mu_);

  // From now on every stream ends instead of waiting for its client's next
  // request: sets ending_idle(), then calls OnEndIdle() of every registered
  // stream. For the end of a drain; there is no way back.
  void EndIdle() ABSL_LOCKS_EXCLUDED(mu_);
  // Whether EndIdle() was called. A stream about to wait for its client
  // checks it (after it marked itself waiting, under the lock OnEndIdle
  // takes), so that it ends whichever comes first.
  bool ending_idle() const {
    return ending_idle_.load(std::memory_order_acquire);
  }

 private:
  std::atomic<bool> ending_idle_{false};
  absl::Mutex mu_;
  absl::flat_hash_set<OpenStreamListener*> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_OPEN_STREAMS_H_
