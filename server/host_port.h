// "host:port" addresses as flags give them (--advertise_address, --peers).
#ifndef ATTENTION_SERVER_HOST_PORT_H_
#define ATTENTION_SERVER_HOST_PORT_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attention::server {

struct HostPort {
  std::string host;  // a name, an IPv4 address or a bracketed IPv6 one
  int port = 0;
};

// Longest address ParseHostPort accepts (a DNS name is at most 253 bytes).
inline constexpr size_t kMaxAddressBytes = 261;

// Parses "host:port" ("[v6]:port" for an IPv6 address) with a non-empty
// host and a port in [1, 65535], of at most kMaxAddressBytes visible ASCII
// characters (an address may travel as gRPC metadata). INVALID_ARGUMENT
// naming `what` (the flag) otherwise.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view address,
                                       absl::string_view what);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_HOST_PORT_H_
