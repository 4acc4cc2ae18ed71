// The Authenticator's modes: bearer tokens from a tokens file (missing,
// malformed, unknown and known tokens; a reload that fails keeps the old
// tenants), the client certificate's CN, and nobody (tenant `default`).
#include "server/authenticator.h"

#include <fcntl.h>
#include <grpcpp/support/string_ref.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/tokens_file.h"
#include "tests/server/test_certificates.h"

namespace attention::server {
namespace {

using Metadata = std::multimap<grpc::string_ref, grpc::string_ref>;

class AuthenticatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = testing::MakeTempDirectory();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
    file_ = absl::StrCat(dir_, "/tokens");
    ASSERT_TRUE(testing::WriteFileAtomically(
        file_, absl::StrCat("team ", DigestTokenHex("good-token"), " 3 -\n")));
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  std::string dir_;
  std::string file_;
};

absl::StatusOr<Tenant> WithAuthorization(const Authenticator& authenticator,
                                         const std::string& value) {
  Metadata metadata;
  metadata.emplace("authorization", value);
  return authenticator.Authenticate(metadata, nullptr);
}

// Whether the watcher (polling every 10 ms in these tests) puts `value` in
// force within a generous 10 s.
bool AcceptedSoon(const Authenticator& authenticator,
                  const std::string& value) {
  for (int i = 0; i < 1000; ++i) {
    if (WithAuthorization(authenticator, value).ok()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

TEST_F(AuthenticatorTest, TokensNameTheirTenant) {
  auto authenticator = Authenticator::Create({.tokens_file = file_});
  ASSERT_TRUE(authenticator.ok()) << authenticator.status();
  EXPECT_STREQ((*authenticator)->mode(), "tokens");
  EXPECT_EQ((*authenticator)->tenant_names(), std::vector<std::string>{"team"});
  EXPECT_EQ((*authenticator)->Authenticate(Metadata{}, nullptr).status().code(),
            absl::StatusCode::kUnauthenticated);
  for (const std::string value :
       {"good-token", "Basic good-token", "Bearer ", "Bearer   ", "Bearer \t\v",
        "Bearer bad-token"}) {
    const absl::Status status =
        WithAuthorization(**authenticator, value).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kUnauthenticated) << value;
    EXPECT_EQ(status.message().find("bad-token"), std::string::npos);
  }
  for (const std::string value : {"Bearer good-token", "bearer good-token"}) {
    auto tenant = WithAuthorization(**authenticator, value);
    ASSERT_TRUE(tenant.ok()) << tenant.status();
    EXPECT_EQ(tenant->name, "team");
    EXPECT_EQ(tenant->quota.max_sessions, 3);
    EXPECT_FALSE(tenant->quota.max_kv_bytes.has_value());
  }
}

TEST_F(AuthenticatorTest, AFailedReloadKeepsThePreviousTenants) {
  auto authenticator = Authenticator::Create(
      {.tokens_file = file_, .reload_interval = absl::ZeroDuration()});
  ASSERT_TRUE(authenticator.ok());
  ASSERT_TRUE(testing::WriteFileAtomically(file_, "team x - -\n"));
  EXPECT_EQ((*authenticator)->Reload().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(WithAuthorization(**authenticator, "Bearer good-token").ok());
  // An empty file is what a reload sees halfway through an in-place
  // rewrite: it is refused too, not taken as "no tenants".
  ASSERT_TRUE(testing::WriteFileAtomically(file_, ""));
  EXPECT_EQ((*authenticator)->Reload().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(WithAuthorization(**authenticator, "Bearer good-token").ok());
  ASSERT_TRUE(testing::WriteFileAtomically(
      file_, absl::StrCat("other ", DigestTokenHex("new-token"), " - -\n")));
  EXPECT_TRUE((*authenticator)->Reload().ok());
  EXPECT_FALSE(WithAuthorization(**authenticator, "Bearer good-token").ok());
  EXPECT_EQ(WithAuthorization(**authenticator, "Bearer new-token")->name,
            "other");
}

// The watcher reads the file again when any of it changes, also an edit
// in place that keeps its size and sets its modification time back (the
// change time still moves, as it does on chmod).
TEST_F(AuthenticatorTest, TheWatcherSeesAnEditThatKeepsSizeAndTime) {
  auto authenticator = Authenticator::Create(
      {.tokens_file = file_, .reload_interval = absl::Milliseconds(10)});
  ASSERT_TRUE(authenticator.ok()) << authenticator.status();
  struct stat before = {};
  ASSERT_EQ(stat(file_.c_str(), &before), 0);
  {
    // Same length: "good-token" and "newt-token" both have 10 bytes.
    std::ofstream out(file_, std::ios::in | std::ios::out);
    out << absl::StrCat("team ", DigestTokenHex("newt-token"), " 3 -\n");
  }
  const struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(utimensat(AT_FDCWD, file_.c_str(), times, 0), 0);
  struct stat after = {};
  ASSERT_EQ(stat(file_.c_str(), &after), 0);
  ASSERT_EQ(after.st_size, before.st_size);
  ASSERT_EQ(after.st_mtim.tv_nsec, before.st_mtim.tv_nsec);
  EXPECT_TRUE(AcceptedSoon(**authenticator, "Bearer newt-token"));
  EXPECT_FALSE(WithAuthorization(**authenticator, "Bearer good-token").ok());
}

// A read that fails for a moment (no descriptor free) leaves nothing to
// see in stat(2) once it could succeed: the watcher reads again at its next
// poll instead of taking the file as seen, so a revocation is not lost.
TEST_F(AuthenticatorTest, AReadThatFailsIsTriedAgainAtTheNextPoll) {
  auto authenticator = Authenticator::Create(
      {.tokens_file = file_, .reload_interval = absl::Milliseconds(10)});
  ASSERT_TRUE(authenticator.ok()) << authenticator.status();
  const std::string next = file_ + ".next";
  ASSERT_TRUE(testing::WriteFileAtomically(
      next, absl::StrCat("team ", DigestTokenHex("new-token"), " 3 -\n")));
  struct rlimit before = {};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &before), 0);
  const int lowest_free = dup(0);
  ASSERT_GE(lowest_free, 0);
  close(lowest_free);
  // From here until the limit is restored no descriptor can be opened.
  struct rlimit none = before;
  none.rlim_cur = lowest_free;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &none), 0);
  const bool renamed = rename(next.c_str(), file_.c_str()) == 0;
  absl::SleepFor(absl::Milliseconds(200));  // about 20 polls, all failing
  const bool old_in_force =
      WithAuthorization(**authenticator, "Bearer good-token").ok();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &before), 0);
  ASSERT_TRUE(renamed);
  EXPECT_TRUE(old_in_force);
  EXPECT_TRUE(AcceptedSoon(**authenticator, "Bearer new-token"));
  EXPECT_FALSE(WithAuthorization(**authenticator, "Bearer good-token").ok());
}

// A tokens file deleted under a running server keeps the tokens loaded in
// force (as a file that does not parse does) and says so in the log, once,
// not at every poll; the file put back is read again.
TEST_F(AuthenticatorTest, ADeletedFileKeepsItsTokensAndIsLoggedOnce) {
  auto authenticator = Authenticator::Create(
      {.tokens_file = file_, .reload_interval = absl::Milliseconds(10)});
  ASSERT_TRUE(authenticator.ok()) << authenticator.status();
  ::testing::internal::CaptureStderr();
  ASSERT_EQ(std::remove(file_.c_str()), 0);
  absl::SleepFor(absl::Milliseconds(300));  // about 30 polls
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(WithAuthorization(**authenticator, "Bearer good-token").ok());
  int failures = 0;
  for (size_t at = log.find("auth_tokens_reload_failed");
       at != std::string::npos;
       at = log.find("auth_tokens_reload_failed", at + 1)) {
    ++failures;
  }
  EXPECT_EQ(failures, 1) << log;
  EXPECT_NE(log.find("tenants_in_force=1"), std::string::npos) << log;
  ASSERT_TRUE(testing::WriteFileAtomically(
      file_, absl::StrCat("team ", DigestTokenHex("new-token"), " 3 -\n")));
  EXPECT_TRUE(AcceptedSoon(**authenticator, "Bearer new-token"));
  EXPECT_FALSE(WithAuthorization(**authenticator, "Bearer good-token").ok());
}

TEST_F(AuthenticatorTest, AMissingOrBadFileFailsCreation) {
  EXPECT_EQ(
      Authenticator::Create({.tokens_file = dir_ + "/missing"}).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(AuthenticatorModesTest, ClientCertificateAndNone) {
  auto by_certificate =
      Authenticator::Create({.tenant_from_client_certificate = true});
  ASSERT_TRUE(by_certificate.ok());
  EXPECT_STREQ((*by_certificate)->mode(), "client-cert");
  // No verified peer, no CN: refused.
  EXPECT_EQ(
      (*by_certificate)->Authenticate(Metadata{}, nullptr).status().code(),
      absl::StatusCode::kUnauthenticated);
  auto nobody = Authenticator::Create({});
  ASSERT_TRUE(nobody.ok());
  EXPECT_STREQ((*nobody)->mode(), "none");
  EXPECT_FALSE((*nobody)->enabled());
  auto tenant = (*nobody)->Authenticate(Metadata{}, nullptr);
  ASSERT_TRUE(tenant.ok());
  EXPECT_EQ(tenant->name, "default");
  EXPECT_TRUE((*nobody)->tenant_names().empty());
}

}  // namespace
}  // namespace attention::server
