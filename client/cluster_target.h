// The replicas a ClusterClient talks to, from its target string:
//
//   "host:port,host:port,..."   a fixed list (two or more entries);
//   "dns:///name:port", "name:port"
//                               every address `name` resolves to (A and
//                               AAAA records, e.g. a Kubernetes headless
//                               Service), all on `port`; re-resolved by
//                               the client periodically and on failures.
//
// IPv6 literals are written in brackets ("[::1]:50051").
#ifndef ATTENTION_CLIENT_CLUSTER_TARGET_H_
#define ATTENTION_CLIENT_CLUSTER_TARGET_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attention::client {

struct ClusterTarget {
  // Fixed list: `addresses` as given. Otherwise `host` and `port` to resolve.
  bool fixed = false;
  std::vector<std::string> addresses;
  std::string host;
  std::string port;
};

// INVALID_ARGUMENT (quoting a short prefix of the text) when `target` is
// empty or an entry lacks a host or a numeric port.
absl::StatusOr<ClusterTarget> ParseClusterTarget(absl::string_view target);

// The replica addresses ("ip:port", "[ipv6]:port"), sorted and without
// duplicates: the fixed list, or the name's addresses now (getaddrinfo).
// UNAVAILABLE naming the host when it does not resolve.
absl::StatusOr<std::vector<std::string>> ResolveClusterTarget(
    const ClusterTarget& target);

}  // namespace attention::client

#endif  // ATTENTION_CLIENT_CLUSTER_TARGET_H_
