#include "server/host_port.h"

#include <string>

#include "gtest/gtest.h"

namespace attention::server {
namespace {

TEST(HostPortTest, ParsesNamesAndAddresses) {
  auto name = ParseHostPort("replica-0.svc.cluster.local:50051", "x");
  ASSERT_TRUE(name.ok()) << name.status();
  EXPECT_EQ(name->host, "replica-0.svc.cluster.local");
  EXPECT_EQ(name->port, 50051);
  auto v4 = ParseHostPort("127.0.0.1:1", "x");
  ASSERT_TRUE(v4.ok()) << v4.status();
  EXPECT_EQ(v4->host, "127.0.0.1");
  EXPECT_EQ(v4->port, 1);
  auto v6 = ParseHostPort("[::1]:65535", "x");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(v6->host, "[::1]");
  EXPECT_EQ(v6->port, 65535);
}

TEST(HostPortTest, RefusesWhatIsNotHostPort) {
  for (const char* bad :
       {"", "host", ":1", "host:", "host:0", "host:65536", "host:-1", "host:8x",
        "::1:50051", "[::1:50051", "[]:1", "[::1]]:1", "h]:1", "h:+80", "h: 80",
        "h:080000"}) {
    auto parsed = ParseHostPort(bad, "--peers");
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
    EXPECT_NE(parsed.status().message().find("--peers"),
              absl::string_view::npos);
  }
}

// An address may travel as gRPC metadata (a moved session's new owner):
// visible ASCII only, and not longer than a DNS name allows.
TEST(HostPortTest, RefusesInvisibleCharactersAndOverlongAddresses) {
  const std::string longest = std::string(kMaxAddressBytes - 6, 'a') + ":50051";
  EXPECT_TRUE(ParseHostPort(longest, "--peers").ok());
  for (const std::string& bad :
       {std::string("a b:80"), std::string("host\n:80"),
        std::string("h\x01st:80"), std::string("h\xc3\xa9:80"),
        std::string(kMaxAddressBytes - 5, 'a') + ":50051"}) {
    EXPECT_EQ(ParseHostPort(bad, "--peers").status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

}  // namespace
}  // namespace attention::server
