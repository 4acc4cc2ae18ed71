#include "server/host_port.h"

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/client_string.h"

namespace attention::server {

absl::StatusOr<HostPort> ParseHostPort(absl::string_view address,
                                       absl::string_view what) {
  const size_t colon = address.rfind(':');
  HostPort result;
  int port = 0;
  if (colon != absl::string_view::npos) {
    result.host = std::string(address.substr(0, colon));
    if (!absl::SimpleAtoi(address.substr(colon + 1), &port)) port = 0;
  }
  const bool bare_ipv6 =
      result.host.find(':') != std::string::npos && result.host.front() != '[';
  if (result.host.empty() || bare_ipv6 || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " ", QuoteClientString(address),
        " is not host:port (e.g. replica-0.example:50051, or [::1]:50051 for "
        "an IPv6 address) with a port in [1, 65535]"));
  }
  result.port = port;
  return result;
}

}  // namespace attention::server
