// The bearer-token file of --auth_tokens_file: which tenants exist, the
// SHA-256 digest of each one's token and its quota. Whitespace-separated
// text, one tenant per line, '#' starts a comment:
//
//   # tenant  sha256 of the token (hex)   max_sessions  max_kv_bytes
//   team-a    9f86d081...0f00a08          100           4294967296
//   batch     60303ae2...8c11c752         -             -
//
// '-' means no limit. The file holds digests only, never tokens.
#ifndef ATTENTION_SERVER_TOKENS_FILE_H_
#define ATTENTION_SERVER_TOKENS_FILE_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/tenant.h"

namespace attention::server {

using TokenDigest = std::array<uint8_t, 32>;

struct TokenEntry {
  TokenDigest digest;
  Tenant tenant;
};

// SHA-256 of `token`.
TokenDigest DigestToken(absl::string_view token);
// The same as the tokens file writes it: 64 lower-case hex digits.
std::string DigestTokenHex(absl::string_view token);

// Parses the file's text. INVALID_ARGUMENT naming the line and what is
// wrong (never quoting the line, which could hold a token pasted by
// mistake): not 4 fields, a tenant name that is not 1-64 of [A-Za-z0-9._-], a
// digest that is not 64 hex digits, a limit that is neither '-' nor an
// integer >= 0, a tenant or digest listed twice, the digest of the empty
// token, or no tenant at all (what a file read halfway through an in-place
// rewrite looks like).
absl::StatusOr<std::vector<TokenEntry>> ParseTokensFile(absl::string_view text);

// ParseTokensFile of `text`, read from the file at `path`, with an error
// that names the path.
absl::StatusOr<std::vector<TokenEntry>> ParseTokensFileAt(
    const std::string& path, absl::string_view text);

// Reads and parses the file at `path`. INVALID_ARGUMENT naming the path when
// it cannot be read or does not parse.
absl::StatusOr<std::vector<TokenEntry>> LoadTokensFile(const std::string& path);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_TOKENS_FILE_H_
