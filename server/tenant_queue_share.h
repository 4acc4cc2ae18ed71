// TenantQueueShare: each tenant's part of a bounded queue (the decode
// steps waiting for a batch, the prefills waiting for a thread), so that
// one tenant flooding the server cannot take the whole queue and leave the
// others nothing but UNAVAILABLE.
//
// The queue keeps its own bounds (items and bytes, UNAVAILABLE when full);
// this adds a bound per tenant on what that tenant has waiting in it. A
// submission that would take its tenant past the bound is refused with
// RESOURCE_EXHAUSTED (a per-tenant quota, as the tokens file's are),
// naming the tenant, what it holds and the bound, whether or not the queue
// has room (the queues ask Admit first); it changes nothing. A
// tenant with nothing waiting may always queue one submission, whatever
// its size (as an empty queue takes one): a BatchDecode larger than the
// share still runs.
//
// The server sets the bounds from --tenant_queue_share: a share of 1 (the
// default) leaves them unbounded, and then nothing is counted.
//
// Thread-safe.
#ifndef ATTENTION_SERVER_TENANT_QUEUE_SHARE_H_
#define ATTENTION_SERVER_TENANT_QUEUE_SHARE_H_

#include <cstdint>
#include <limits>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace attention::server {

struct TenantQueueBounds {
  static constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();

  // What one tenant may have waiting: items (steps, prefills) and the
  // bytes they hold.
  int64_t max_items = kUnbounded;
  int64_t max_bytes = kUnbounded;

  // `share` of a queue's bounds: at least one item; both unbounded for a
  // share of 1. REQUIRES: 0 < share <= 1 (the server checks the flag).
  static TenantQueueBounds ShareOf(double share, int64_t queue_max_items,
                                   int64_t queue_max_bytes);
  bool bounded() const {
    return max_items != kUnbounded || max_bytes != kUnbounded;
  }
};

class TenantQueueShare {
 public:
  // `items` names what the queue holds, plural ("decode steps").
  TenantQueueShare(std::string items, TenantQueueBounds bounds);

  TenantQueueShare(const TenantQueueShare&) = delete;
  TenantQueueShare& operator=(const TenantQueueShare&) = delete;

  // Counts `items` holding `bytes` as waiting for `tenant` and returns OK
  // when the tenant's bounds allow them (or it has nothing waiting);
  // otherwise counts nothing and returns RESOURCE_EXHAUSTED. Always OK,
  // counting nothing, when the bounds are unbounded.
  absl::Status Admit(absl::string_view tenant, int64_t items, int64_t bytes);
  // Counts them without a check: what comes back to wait (a step sent back
  // to the queue because its session was busy, also one that ran on its
  // submitting thread without queueing), which its tenant's share does
  // not refuse.
  void Readmit(absl::string_view tenant, int64_t items, int64_t bytes);
  // What Admit or Readmit counted has stopped waiting (it runs, or was
  // refused after all).
  void Release(absl::string_view tenant, int64_t items, int64_t bytes);

  const TenantQueueBounds& bounds() const { return bounds_; }
  // Items `tenant` has waiting (0 when unbounded: nothing is counted).
  int64_t waiting_items(absl::string_view tenant) const;

 private:
  struct Held {
    int64_t items = 0;
    int64_t bytes = 0;
  };

  const std::string items_;
  const TenantQueueBounds bounds_;
  mutable absl::Mutex mu_;
  // Tenants with something waiting.
  absl::flat_hash_map<std::string, Held> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_TENANT_QUEUE_SHARE_H_
