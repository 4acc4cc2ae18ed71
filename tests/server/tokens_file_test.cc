// The tokens file format: tenants, SHA-256 digests and quotas; errors name
// the line and never quote it.
#include "server/tokens_file.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

constexpr char kTestDigest[] =
    "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

TEST(TokensFileTest, DigestIsSha256) {
  EXPECT_EQ(DigestTokenHex("test"), kTestDigest);
}

TEST(TokensFileTest, ParsesTenantsQuotasAndComments) {
  const std::string text = absl::StrCat(
      "# tenant sha256 max_sessions max_kv_bytes\n\n", "team-a  ", kTestDigest,
      "  100  4294967296\n", "batch\t",
      "60303AE22B998861BCE3B28F33EEC1BE758A213C86C93C076DBE9F558C11C752",
      " - -  # no limits\r\n");
  auto entries = ParseTokensFile(text);
  ASSERT_TRUE(entries.ok()) << entries.status();
  ASSERT_EQ(entries->size(), 2u);
  EXPECT_EQ((*entries)[0].tenant.name, "team-a");
  EXPECT_EQ((*entries)[0].digest, DigestToken("test"));
  EXPECT_EQ((*entries)[0].tenant.quota.max_sessions, 100);
  EXPECT_EQ((*entries)[0].tenant.quota.max_kv_bytes, int64_t{4294967296});
  EXPECT_EQ((*entries)[1].tenant.name, "batch");
  EXPECT_FALSE((*entries)[1].tenant.quota.max_sessions.has_value());
  EXPECT_FALSE((*entries)[1].tenant.quota.max_kv_bytes.has_value());
}

TEST(TokensFileTest, ErrorsNameTheLineAndNeverQuoteIt) {
  const std::string good = absl::StrCat("a ", kTestDigest, " - -\n");
  const struct {
    std::string text;
    std::string expected;
  } cases[] = {
      {"my-secret-token\n", "line 1: has 1 fields"},
      {absl::StrCat(good, "b my-secret-token - -\n"), "line 2: the digest"},
      {absl::StrCat("b/c ", kTestDigest, " - -\n"), "line 1: the tenant name"},
      {absl::StrCat("a ", kTestDigest, " -1 -\n"), "line 1: max_sessions"},
      {absl::StrCat("a ", kTestDigest, " - lots\n"), "line 1: max_kv_bytes"},
      {absl::StrCat(good, good), "line 2: tenant a is listed twice"},
      {absl::StrCat(good, "b ", kTestDigest, " - -\n"),
       "line 2: this digest is already another tenant's"},
      {absl::StrCat(good, "b ", DigestTokenHex(""), " - -\n"),
       "line 2: the digest is the SHA-256 of an empty token"},
      {"", "lists no tenant"},
      {"# tenant digest max_sessions max_kv_bytes\n\n", "lists no tenant"},
  };
  for (const auto& c : cases) {
    auto entries = ParseTokensFile(c.text);
    ASSERT_FALSE(entries.ok()) << c.text;
    EXPECT_EQ(entries.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(entries.status().message().find(c.expected), std::string::npos)
        << entries.status();
    EXPECT_EQ(entries.status().message().find("my-secret-token"),
              std::string::npos)
        << entries.status();
  }
}

TEST(TokensFileTest, UnreadableFileNamesThePath) {
  auto entries = LoadTokensFile("/nonexistent/tokens");
  ASSERT_FALSE(entries.ok());
  EXPECT_NE(entries.status().message().find("/nonexistent/tokens"),
            std::string::npos);
}

}  // namespace
}  // namespace attention::server
