#include "client/placement.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace attention::client {
namespace {

constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;
constexpr uint64_t kFnvPrime = 0x100000001b3ull;

uint64_t Fnv1a(uint64_t hash, absl::string_view bytes) {
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= kFnvPrime;
  }
  return hash;
}

uint64_t SplitMix64Finalizer(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t RendezvousWeight(absl::string_view key, absl::string_view address) {
  // The separator keeps ("ab", "c") and ("a", "bc") apart.
  uint64_t hash = Fnv1a(kFnvOffset, key);
  hash = Fnv1a(hash, absl::string_view("\xff", 1));
  return SplitMix64Finalizer(Fnv1a(hash, address));
}

std::vector<std::string> PlacementOrder(absl::Span<const ReplicaLoad> replicas,
                                        absl::string_view key, bool keyed,
                                        double tie_fraction) {
  std::vector<const ReplicaLoad*> accepting;
  int64_t most_free = 0;
  int64_t largest_capacity = 0;
  // Free bytes as a replica reported them, but at least 0 (so that no
  // difference or negation below can overflow, whatever it sent).
  auto free_bytes = [](const ReplicaLoad& replica) {
    return std::max<int64_t>(0, replica.kv_free_bytes);
  };
  for (const ReplicaLoad& replica : replicas) {
    if (!replica.accepting) continue;
    accepting.push_back(&replica);
    most_free = std::max(most_free, free_bytes(replica));
    largest_capacity = std::max(largest_capacity, replica.kv_capacity_bytes);
  }
  const double tie_bytes =
      std::max(0.0, tie_fraction) * static_cast<double>(largest_capacity);
  // Sort key: (not tied, -free bytes for the untied, -weight). Keyed
  // placement treats every replica as tied.
  auto rank = [&](const ReplicaLoad* replica) {
    const bool tied =
        keyed ||
        static_cast<double>(most_free - free_bytes(*replica)) <= tie_bytes;
    return std::make_tuple(!tied, tied ? 0 : -free_bytes(*replica),
                           ~RendezvousWeight(key, replica->address),
                           replica->address);
  };
  std::sort(accepting.begin(), accepting.end(),
            [&](const ReplicaLoad* a, const ReplicaLoad* b) {
              return rank(a) < rank(b);
            });
  std::vector<std::string> order;
  order.reserve(accepting.size());
  for (const ReplicaLoad* replica : accepting)
    order.push_back(replica->address);
  return order;
}

}  // namespace attention::client
