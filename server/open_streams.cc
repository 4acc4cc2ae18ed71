#include "server/open_streams.h"

namespace attention::server {

void OpenStreams::Add(TenantsChangedListener* stream) {
  absl::MutexLock lock(&mu_);
  streams_.insert(stream);
}

void OpenStreams::Remove(TenantsChangedListener* stream) {
  absl::MutexLock lock(&mu_);
  streams_.erase(stream);
}

void OpenStreams::TenantsChanged() {
  absl::MutexLock lock(&mu_);
  for (TenantsChangedListener* stream : streams_) stream->OnTenantsChanged();
}

}  // namespace attention::server
