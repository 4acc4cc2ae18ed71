#include "server/tenant_queue_share.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/client_string.h"

namespace attention::server {

TenantQueueBounds TenantQueueBounds::ShareOf(double share,
                                             int64_t queue_max_items,
                                             int64_t queue_max_bytes) {
  TenantQueueBounds bounds;
  if (share >= 1.0) return bounds;
  bounds.max_items = std::max<int64_t>(
      1, static_cast<int64_t>(std::floor(share * queue_max_items)));
  bounds.max_bytes = static_cast<int64_t>(std::floor(share * queue_max_bytes));
  return bounds;
}

TenantQueueShare::TenantQueueShare(std::string items, TenantQueueBounds bounds)
    : items_(std::move(items)), bounds_(bounds) {}

absl::Status TenantQueueShare::Admit(absl::string_view tenant, int64_t items,
                                     int64_t bytes) {
  if (!bounds_.bounded()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  Held& held = held_[tenant];
  const bool fits = held.items + items <= bounds_.max_items &&
                    held.bytes + bytes <= bounds_.max_bytes;
  if (fits || held.items == 0) {
    held.items += items;
    held.bytes += bytes;
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "tenant ", QuoteClientString(tenant), " already has ", held.items, " ",
      items_, " waiting (", held.bytes, " bytes); ", items, " more (", bytes,
      " bytes) would pass its share of the queue, ", bounds_.max_items, " ",
      items_, " and ", bounds_.max_bytes,
      " bytes (--tenant_queue_share); nothing was applied, retry with "
      "backoff once some of them have run"));
}

void TenantQueueShare::Readmit(absl::string_view tenant, int64_t items,
                               int64_t bytes) {
  if (!bounds_.bounded()) return;
  absl::MutexLock lock(&mu_);
  Held& held = held_[tenant];
  held.items += items;
  held.bytes += bytes;
}

void TenantQueueShare::Release(absl::string_view tenant, int64_t items,
                               int64_t bytes) {
  if (!bounds_.bounded()) return;
  absl::MutexLock lock(&mu_);
  auto it = held_.find(tenant);
  if (it == held_.end()) return;
  it->second.items -= items;
  it->second.bytes -= bytes;
  if (it->second.items <= 0) held_.erase(it);
}

int64_t TenantQueueShare::waiting_items(absl::string_view tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(tenant);
  return it == held_.end() ? 0 : it->second.items;
}

}  // namespace attention::server
