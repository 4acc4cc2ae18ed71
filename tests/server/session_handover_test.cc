#include "server/session_handover.h"

#include <grpcpp/support/status.h>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

using Doubt = SessionHandover::Doubt;

grpc::Status Code(grpc::StatusCode code) { return grpc::Status(code, "x"); }

// What an import's end says of what the peer holds. A refusal, or a stream
// cut before the whole snapshot went, leaves nothing there; a broken or
// cancelled call after it is asked again (a peer cancels only while it
// still reads, its stall watchdog, and then created nothing: counted as
// moved, the session was lost), and so is a RESOURCE_EXHAUSTED that the
// import handler did not flag (gRPC's own: a record the peer's transport
// refused, or the peer's answer too large for this side); a deadline or an
// odd error may hide a created session.
TEST(SessionHandoverTest, AnImportsEndSaysWhatThePeerMayHold) {
  for (grpc::StatusCode code :
       {grpc::StatusCode::CANCELLED, grpc::StatusCode::UNAVAILABLE,
        grpc::StatusCode::RESOURCE_EXHAUSTED}) {
    EXPECT_EQ(SessionHandover::DoubtOf(Code(code), true, false), Doubt::kBroken)
        << code;
    EXPECT_EQ(SessionHandover::DoubtOf(Code(code), true, true), Doubt::kNone)
        << code;
  }
  for (grpc::StatusCode code :
       {grpc::StatusCode::DEADLINE_EXCEEDED, grpc::StatusCode::UNKNOWN,
        grpc::StatusCode::INTERNAL}) {
    EXPECT_EQ(SessionHandover::DoubtOf(Code(code), true, false),
              Doubt::kUnknown)
        << code;
    // Refused by the import handler, or not all sent: nothing there.
    EXPECT_EQ(SessionHandover::DoubtOf(Code(code), true, true), Doubt::kNone)
        << code;
    EXPECT_EQ(SessionHandover::DoubtOf(Code(code), false, false), Doubt::kNone)
        << code;
  }
  for (grpc::StatusCode code :
       {grpc::StatusCode::ALREADY_EXISTS, grpc::StatusCode::PERMISSION_DENIED,
        grpc::StatusCode::FAILED_PRECONDITION}) {
    EXPECT_EQ(SessionHandover::DoubtOf(Code(code), true, false), Doubt::kNone)
        << code;
  }
}

// The hand-over stops sending an eighth of its time before its end, at
// least 250 ms (or half of it) and at most 2 s, leaving that for the peer's
// answer to the last import; a cut import is asked again with as much.
// Any first doubt is asked again, in the extension once the time is up:
// also a broken connection at the end, which may follow the peer's commit
// (left unasked, the session would stay here and be live on both). After
// the second answer it counts as moved unless both were broken.
TEST(SessionHandoverTest, EveryFirstDoubtIsAskedAgainEvenAtTheEnd) {
  using After = SessionHandover::AfterDoubt;
  for (const Doubt doubt : {Doubt::kBroken, Doubt::kUnknown}) {
    for (const bool out_of_time : {false, true}) {
      const After next =
          SessionHandover::NextAfterDoubt(0, doubt, doubt, out_of_time);
      EXPECT_TRUE(next.ask_again) << static_cast<int>(doubt);
      EXPECT_EQ(next.settle, out_of_time) << static_cast<int>(doubt);
    }
  }
  for (const bool out_of_time : {false, true}) {
    auto moved = [&](Doubt first, Doubt second) {
      const After next =
          SessionHandover::NextAfterDoubt(1, first, second, out_of_time);
      EXPECT_FALSE(next.ask_again);
      return next.moved;
    };
    EXPECT_FALSE(moved(Doubt::kBroken, Doubt::kBroken));
    EXPECT_TRUE(moved(Doubt::kBroken, Doubt::kUnknown));
    EXPECT_TRUE(moved(Doubt::kUnknown, Doubt::kBroken));
    EXPECT_TRUE(moved(Doubt::kUnknown, Doubt::kUnknown));
  }
}

TEST(SessionHandoverTest, TheLastImportHasTimeForItsAnswer) {
  const absl::Time start = absl::FromUnixSeconds(1000);
  const HandoverDeadlines drain =
      HandoverDeadlines::For(start, start + absl::Milliseconds(12500));
  EXPECT_EQ(drain.answer, start + absl::Milliseconds(12500));
  EXPECT_EQ(drain.send, drain.answer - absl::Milliseconds(1562.5));
  const HandoverDeadlines long_drain =
      HandoverDeadlines::For(start, start + absl::Minutes(5));
  EXPECT_EQ(long_drain.send, long_drain.answer - absl::Seconds(2));
  const HandoverDeadlines short_drain =
      HandoverDeadlines::For(start, start + absl::Seconds(1));
  EXPECT_EQ(short_drain.send, short_drain.answer - absl::Milliseconds(250));
  const HandoverDeadlines shorter =
      HandoverDeadlines::For(start, start + absl::Milliseconds(200));
  EXPECT_EQ(shorter.send, start + absl::Milliseconds(100));
  const HandoverDeadlines past = HandoverDeadlines::For(start, start);
  EXPECT_EQ(past.send, start);
  EXPECT_EQ(past.answer, start);
  const absl::Time late = start + absl::Seconds(20);
  const HandoverDeadlines settling = drain.Settling(late);
  EXPECT_EQ(settling.send, late + absl::Milliseconds(1562.5));
  EXPECT_EQ(settling.answer, late + absl::Milliseconds(3125));
}

}  // namespace
}  // namespace attention::server
