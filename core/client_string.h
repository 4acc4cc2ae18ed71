// Quoting strings a client sent (session ids, labels, page tokens) in error
// messages: at most a short prefix, so that a hostile string can neither
// blow up an error (gRPC sends the message as metadata, whose size the
// client bounds) nor be echoed whole into logs.
#ifndef ATTENTION_CORE_CLIENT_STRING_H_
#define ATTENTION_CORE_CLIENT_STRING_H_

#include <cstddef>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attention {

// The longest prefix of a client string an error message quotes.
inline constexpr size_t kMaxQuotedClientBytes = 40;

// `text` in single quotes, cut to kMaxQuotedClientBytes bytes with
// "... (N bytes)" when longer; bytes outside printable ASCII become '?'.
inline std::string QuoteClientString(absl::string_view text) {
  std::string quoted = "'";
  const absl::string_view shown = text.substr(0, kMaxQuotedClientBytes);
  for (char c : shown) quoted.push_back(c >= 0x20 && c < 0x7f ? c : '?');
  quoted.push_back('\'');
  if (shown.size() < text.size()) {
    absl::StrAppend(&quoted, "... (", text.size(), " bytes)");
  }
  return quoted;
}

}  // namespace attention

#endif  // ATTENTION_CORE_CLIENT_STRING_H_
