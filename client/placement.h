// Where a ClusterClient places a new session: on the accepting replica with
// the most free KV memory; near-ties, and sessions with a placement key, by
// rendezvous (highest-random-weight) hashing.
//
// Rendezvous hashing gives every (key, replica) pair a pseudo-random weight
// and picks the replica of highest weight. The same key picks the same
// replica in every client, with no coordination; adding or removing a
// replica moves only the keys whose best replica it is. That is what lets
// related sessions (one prompt's forks, one user's conversations) land
// together, and spreads unkeyed sessions evenly among equally free
// replicas.
#ifndef ATTENTION_CLIENT_PLACEMENT_H_
#define ATTENTION_CLIENT_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attention::client {

// What placement knows of one replica.
struct ReplicaLoad {
  std::string address;  // the replica's identity (its advertise address)
  // SERVING and not draining: the only replicas a new session may go to.
  bool accepting = false;
  int64_t kv_free_bytes = 0;
  int64_t kv_capacity_bytes = 0;
};

// The weight of `address` for `key`: a fixed 64-bit hash of both (FNV-1a,
// then the SplitMix64 finalizer), the same in every process and version.
uint64_t RendezvousWeight(absl::string_view key, absl::string_view address);

// The order in which a new session tries the replicas (the next one when a
// replica refuses it): accepting replicas only, never a draining one.
//   * With a placement key (`keyed`), by decreasing RendezvousWeight(key):
//     the key alone decides, so every session with that key lands on the
//     same replica while membership is stable.
//   * Without, the replicas whose free KV is within `tie_fraction` of the
//     largest capacity of the most free one come first, by decreasing
//     RendezvousWeight(key) (`key` is then a per-session random nonce);
//     the others follow by decreasing free KV.
// Empty when no replica accepts.
std::vector<std::string> PlacementOrder(absl::Span<const ReplicaLoad> replicas,
                                        absl::string_view key, bool keyed,
                                        double tie_fraction);

}  // namespace attention::client

#endif  // ATTENTION_CLIENT_PLACEMENT_H_
