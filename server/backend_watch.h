// BackendWatch: notices when the attention backend has failed for good
// (AttentionBackend::failure(), e.g. a sticky CUDA error) and reports it
// once, so that the server turns its health NOT_SERVING and Kubernetes
// restarts the pod.
#ifndef ATTENTION_SERVER_BACKEND_WATCH_H_
#define ATTENTION_SERVER_BACKEND_WATCH_H_

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/backend.h"

namespace attention::server {

// Thread-safety: Check() may be called from any thread.
class BackendWatch {
 public:
  // Polls `backend` every `interval` on its own thread and calls
  // `on_failure` with the failure, once, from Check() or that thread.
  // `backend` must outlive the watch.
  BackendWatch(const AttentionBackend* backend, absl::Duration interval,
               std::function<void(const absl::Status&)> on_failure);
  // Stops the thread.
  ~BackendWatch();
  BackendWatch(const BackendWatch&) = delete;
  BackendWatch& operator=(const BackendWatch&) = delete;

  // Polls now; true when the backend has failed.
  bool Check();

 private:
  void Run();

  const AttentionBackend* const backend_;
  const absl::Duration interval_;
  const std::function<void(const absl::Status&)> on_failure_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool reported_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_BACKEND_WATCH_H_
