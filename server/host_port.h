// "host:port" addresses as flags give them (--advertise_address, --peers).
#ifndef ATTENTION_SERVER_HOST_PORT_H_
#define ATTENTION_SERVER_HOST_PORT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attention::server {

struct HostPort {
  std::string host;  // a name, an IPv4 address or a bracketed IPv6 one
  int port = 0;
};

// Parses "host:port" ("[v6]:port" for an IPv6 address) with a non-empty
// host and a port in [1, 65535]. INVALID_ARGUMENT naming `what` (the flag)
// otherwise.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view address,
                                       absl::string_view what);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_HOST_PORT_H_
