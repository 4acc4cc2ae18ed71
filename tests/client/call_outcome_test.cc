// Tests of client/call_outcome: what a failed call's status says about
// whether the server applied it. The gRPC failures come from real calls
// where they can be made on demand (no server listening).
#include "client/call_outcome.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/attention_client.h"
#include "gtest/gtest.h"
#include "tests/server/test_server.h"

namespace attention::client {
namespace {

// A loopback port nothing listens on (bound, then closed).
int ClosedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    close(fd);
    return 0;
  }
  close(fd);
  return ntohs(address.sin_port);
}

TEST(CallOutcomeTest, ACallToNoServerWasNeverSent) {
  const int port = ClosedPort();
  ASSERT_GT(port, 0);
  ClientOptions options;
  options.retry_max_attempts = 1;
  auto client =
      AttentionClient::Connect(absl::StrCat("127.0.0.1:", port), options);
  const absl::Status status =
      client->CreateSession(testing::MakeSpec(1, 2, 1, 8)).status();
  ASSERT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_TRUE(NeverSent(status)) << status;
  EXPECT_FALSE(RefusedByServer(status)) << status;
  EXPECT_FALSE(CreationInDoubt(status)) << status;
}

TEST(CallOutcomeTest, TheServersOwnRefusalsAppliedNothing) {
  for (const char* message :
       {"the server is overloaded: every thread for its synchronous RPCs "
        "(--max_rpc_threads) is busy; nothing was applied",
        "the server is draining (shutting down) and takes no new sessions",
        "the server is shutting down and has saved its sessions"}) {
    const absl::Status status = absl::UnavailableError(message);
    EXPECT_TRUE(RefusedByServer(status)) << status;
    EXPECT_EQ(RefusedWhileDraining(status),
              absl::StartsWith(message, "the server is draining"))
        << status;
    EXPECT_FALSE(NeverSent(status)) << status;
    EXPECT_FALSE(CreationInDoubt(status)) << status;
  }
  // The prefix alone, under another code, is not a refusal.
  EXPECT_FALSE(RefusedByServer(absl::InternalError("the server is broken")));
}

TEST(CallOutcomeTest, FailuresAfterSendingLeaveACreationInDoubt) {
  for (const absl::Status& status :
       {absl::UnavailableError("Socket closed"),
        absl::UnavailableError("Connection reset by peer"),
        absl::DeadlineExceededError("Deadline Exceeded"),
        absl::CancelledError("Cancelled"),
        absl::ResourceExhaustedError(
            "Received message larger than max (5000 vs. 4096)")}) {
    EXPECT_TRUE(CreationInDoubt(status)) << status;
    EXPECT_FALSE(NeverSent(status)) << status;
    EXPECT_FALSE(RefusedByServer(status)) << status;
  }
  // The server's own answers say what happened.
  for (const absl::Status& status :
       {absl::ResourceExhaustedError("tenant 'a' holds 4 of its 4 sessions"),
        absl::InvalidArgumentError("spec: num_layers must be positive"),
        absl::NotFoundError("session 'x' not found")}) {
    EXPECT_FALSE(CreationInDoubt(status)) << status;
  }
}

}  // namespace
}  // namespace attention::client
