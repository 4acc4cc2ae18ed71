#include "server/tokens_file.h"

#include <openssl/sha.h>

#include <cstring>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/read_file.h"
#include "core/status_macros.h"

namespace attention::server {
namespace {

bool ValidTenantName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxTenantNameBytes) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

absl::Status LineError(int line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", what));
}

// '-' (no limit) or an integer >= 0.
absl::StatusOr<std::optional<int64_t>> ParseLimit(int line,
                                                  absl::string_view field,
                                                  absl::string_view name) {
  // Field contents are never quoted: a token pasted by mistake must not
  // reach the logs.
  if (field == "-") return std::nullopt;
  int64_t value = 0;
  if (!absl::SimpleAtoi(field, &value) || value < 0) {
    return LineError(line, absl::StrCat(name,
                                        " is neither '-' (no limit) "
                                        "nor an integer >= 0"));
  }
  return value;
}

}  // namespace

TokenDigest DigestToken(absl::string_view token) {
  TokenDigest digest;
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(),
         digest.data());
  return digest;
}

std::string DigestTokenHex(absl::string_view token) {
  const TokenDigest digest = DigestToken(token);
  return absl::BytesToHexString(absl::string_view(
      reinterpret_cast<const char*>(digest.data()), digest.size()));
}

absl::StatusOr<std::vector<TokenEntry>> ParseTokensFile(
    absl::string_view text) {
  std::vector<TokenEntry> entries;
  absl::flat_hash_set<std::string> names;
  absl::flat_hash_set<std::string> digests;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = line.substr(0, line.find('#'));
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    if (fields.size() != 4) {
      return LineError(line_number,
                       absl::StrCat("has ", fields.size(),
                                    " fields; write 'tenant sha256-hex "
                                    "max_sessions max_kv_bytes' ('-' = no "
                                    "limit)"));
    }
    TokenEntry entry;
    if (!ValidTenantName(fields[0])) {
      return LineError(line_number,
                       "the tenant name must be 1 to 64 of A-Z a-z 0-9 . _ -");
    }
    entry.tenant.name = std::string(fields[0]);
    const std::string hex = absl::AsciiStrToLower(fields[1]);
    if (hex.size() != 64 ||
        hex.find_first_not_of("0123456789abcdef") != std::string::npos) {
      return LineError(line_number,
                       "the digest must be the token's SHA-256 as 64 hex "
                       "digits (e.g. printf %s TOKEN | sha256sum)");
    }
    if (hex == DigestTokenHex("")) {
      return LineError(line_number,
                       "the digest is the SHA-256 of an empty token (an unset "
                       "variable in printf %s \"$TOKEN\" | sha256sum?); "
                       "hash the tenant's real token");
    }
    const std::string bytes = absl::HexStringToBytes(hex);
    std::memcpy(entry.digest.data(), bytes.data(), entry.digest.size());
    ATTN_ASSIGN_OR_RETURN(entry.tenant.quota.max_sessions,
                          ParseLimit(line_number, fields[2], "max_sessions"));
    ATTN_ASSIGN_OR_RETURN(entry.tenant.quota.max_kv_bytes,
                          ParseLimit(line_number, fields[3], "max_kv_bytes"));
    if (!names.insert(entry.tenant.name).second) {
      return LineError(line_number, absl::StrCat("tenant ", entry.tenant.name,
                                                 " is listed twice"));
    }
    if (!digests.insert(hex).second) {
      return LineError(line_number,
                       "this digest is already another tenant's; give every "
                       "tenant its own token");
    }
    entries.push_back(std::move(entry));
  }
  if (entries.empty()) {
    return absl::InvalidArgumentError(
        "it lists no tenant, so no call could authenticate (a file read "
        "while being rewritten in place?); list at least one, and replace "
        "the file by renaming a complete one over it");
  }
  return entries;
}

absl::StatusOr<std::vector<TokenEntry>> ParseTokensFileAt(
    const std::string& path, absl::string_view text) {
  absl::StatusOr<std::vector<TokenEntry>> entries = ParseTokensFile(text);
  if (!entries.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens file ", path, ": ", entries.status().message()));
  }
  return entries;
}

absl::StatusOr<std::vector<TokenEntry>> LoadTokensFile(
    const std::string& path) {
  ATTN_ASSIGN_OR_RETURN(const std::string text, ReadFile(path, "tokens file"));
  return ParseTokensFileAt(path, text);
}

}  // namespace attention::server
