#include "server/open_streams.h"

namespace attention::server {

void OpenStreams::Add(OpenStreamListener* stream) {
  absl::MutexLock lock(&mu_);
  streams_.insert(stream);
}

void OpenStreams::Remove(OpenStreamListener* stream) {
  absl::MutexLock lock(&mu_);
  streams_.erase(stream);
}

void OpenStreams::TenantsChanged() {
  absl::MutexLock lock(&mu_);
  for (OpenStreamListener* stream : streams_) stream->OnTenantsChanged();
}

void OpenStreams::EndIdle() {
  ending_idle_.store(true, std::memory_order_release);
  absl::MutexLock lock(&mu_);
  for (OpenStreamListener* stream : streams_) stream->OnEndIdle();
}

}  // namespace attention::server
