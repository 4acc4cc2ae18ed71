#include "server/host_port.h"

#include <algorithm>

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
    const absl::string_view digits = address.substr(colon + 1);
    // SimpleAtoi alone would take "+80" and " 80".
    const bool all_digits =
        !digits.empty() && digits.size() <= 5 &&
        digits.find_first_not_of("0123456789") == absl::string_view::npos;
    if (!all_digits || !absl::SimpleAtoi(digits, &port)) port = 0;
  }
  // What a DNS name, an address and a metadata value can hold: visible
  // ASCII, at most kMaxAddressBytes in all.
  const bool visible = address.size() <= kMaxAddressBytes &&
                       std::all_of(address.begin(), address.end(),
                                   [](char c) { return c > ' ' && c < 0x7f; });
  if (!visible) port = 0;
  const bool bracketed = !result.host.empty() && result.host.front() == '[';
  // A bracketed host is one IPv6 address; a bare one has no colon.
  const bool well_formed =
      bracketed
          ? result.host.size() > 2 && result.host.back() == ']' &&
                result.host.find_first_of("[]", 1) == result.host.size() - 1
          : result.host.find_first_of(":[]") == std::string::npos;
  if (result.host.empty() || !well_formed || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " ", QuoteClientString(address),
        " is not host:port (e.g. replica-0.example:50051, or [::1]:50051 for "
        "an IPv6 address) with a port in [1, 65535], of at most ",
        kMaxAddressBytes, " visible ASCII characters"));
  }
  result.port = port;
  return result;
}

}  // namespace attention::server
