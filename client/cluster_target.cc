#include "client/cluster_target.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/client_string.h"

namespace attention::client {
namespace {

struct HostPort {
  std::string host;  // without brackets
  std::string port;
};

absl::StatusOr<HostPort> SplitHostPort(absl::string_view entry) {
  HostPort parts;
  size_t colon = absl::string_view::npos;
  if (absl::StartsWith(entry, "[")) {
    const size_t close = entry.find(']');
    if (close != absl::string_view::npos && close + 1 < entry.size() &&
        entry[close + 1] == ':') {
      parts.host = std::string(entry.substr(1, close - 1));
      colon = close + 1;
    }
  } else {
    colon = entry.rfind(':');
    if (colon != absl::string_view::npos) {
      parts.host = std::string(entry.substr(0, colon));
    }
  }
  int port = 0;
  if (colon == absl::string_view::npos || parts.host.empty() ||
      !absl::SimpleAtoi(entry.substr(colon + 1), &port) || port <= 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster target entry ", QuoteClientString(entry),
        " is not host:port (a DNS name or address and a port 1..65535; "
        "IPv6 in brackets)"));
  }
  parts.port = absl::StrCat(port);
  return parts;
}

std::string JoinHostPort(const std::string& host, const std::string& port) {
  if (host.find(':') != std::string::npos) {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

}  // namespace

absl::StatusOr<ClusterTarget> ParseClusterTarget(absl::string_view target) {
  target = absl::StripAsciiWhitespace(target);
  ClusterTarget parsed;
  if (absl::StrContains(target, ',')) {
    parsed.fixed = true;
    for (absl::string_view entry :
         absl::StrSplit(target, ',', absl::SkipWhitespace())) {
      entry = absl::StripAsciiWhitespace(entry);
      absl::StatusOr<HostPort> parts = SplitHostPort(entry);
      if (!parts.ok()) return parts.status();
      parsed.addresses.push_back(JoinHostPort(parts->host, parts->port));
    }
    if (parsed.addresses.empty()) {
      return absl::InvalidArgumentError(
          "the cluster target lists no replica: give host:port,host:port");
    }
    std::sort(parsed.addresses.begin(), parsed.addresses.end());
    parsed.addresses.erase(
        std::unique(parsed.addresses.begin(), parsed.addresses.end()),
        parsed.addresses.end());
    return parsed;
  }
  absl::ConsumePrefix(&target, "dns:///");
  absl::ConsumePrefix(&target, "dns:");
  if (target.empty()) {
    return absl::InvalidArgumentError(
        "the cluster target is empty: give a DNS name resolving to the "
        "replicas (name:port) or a list host:port,host:port");
  }
  absl::StatusOr<HostPort> parts = SplitHostPort(target);
  if (!parts.ok()) return parts.status();
  parsed.host = parts->host;
  parsed.port = parts->port;
  return parsed;
}

absl::StatusOr<std::vector<std::string>> ResolveClusterTarget(
    const ClusterTarget& target) {
  if (target.fixed) return target.addresses;
  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int error =
      getaddrinfo(target.host.c_str(), target.port.c_str(), &hints, &found);
  if (error != 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot resolve the cluster name ", QuoteClientString(target.host),
        ": ", gai_strerror(error)));
  }
  std::vector<std::string> addresses;
  for (const addrinfo* entry = found; entry != nullptr;
       entry = entry->ai_next) {
    char host[NI_MAXHOST];
    if (getnameinfo(entry->ai_addr, entry->ai_addrlen, host, sizeof(host),
                    nullptr, 0, NI_NUMERICHOST) == 0) {
      addresses.push_back(JoinHostPort(host, target.port));
    }
  }
  freeaddrinfo(found);
  std::sort(addresses.begin(), addresses.end());
  addresses.erase(std::unique(addresses.begin(), addresses.end()),
                  addresses.end());
  return addresses;
}

}  // namespace attention::client
