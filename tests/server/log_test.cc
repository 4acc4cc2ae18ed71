#include "server/log.h"

#include <string>

#include "gtest/gtest.h"

namespace attention::server {
namespace {

TEST(LogTest, ParsesLevels) {
  EXPECT_EQ(*ParseLogLevel("debug"), LogLevel::kDebug);
  EXPECT_EQ(*ParseLogLevel("INFO"), LogLevel::kInfo);
  EXPECT_EQ(*ParseLogLevel("warn"), LogLevel::kWarning);
  EXPECT_EQ(*ParseLogLevel("error"), LogLevel::kError);
  EXPECT_EQ(ParseLogLevel("loud").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LogTest, LevelsFilter) {
  SetLogLevel(LogLevel::kWarning);
  EXPECT_FALSE(LogEnabled(LogLevel::kInfo));
  EXPECT_TRUE(LogEnabled(LogLevel::kError));
  SetLogLevel(LogLevel::kInfo);
  EXPECT_TRUE(LogEnabled(LogLevel::kInfo));
  EXPECT_FALSE(LogEnabled(LogLevel::kDebug));
}

TEST(LogTest, OneLineOfKeyValueFields) {
  const std::string line =
      FormatLogLine(LogLevel::kInfo, "session_created",
                    {{"session", "ab12"},
                     {"layers", 36},
                     {"message", "needs \"quotes\" = yes\nsecond"}});
  EXPECT_EQ(line.find("ts="), 0u);
  EXPECT_NE(
      line.find(" level=info event=session_created session=ab12 "
                "layers=36 message=\"needs \\\"quotes\\\" = yes\\nsecond\""),
      std::string::npos)
      << line;
  EXPECT_EQ(line.back(), '\n');
  EXPECT_EQ(line.find('\n'), line.size() - 1) << "exactly one line";
}

// A client's string may hold any byte: control characters are written as
// escapes, so a carriage return or a terminal escape sequence cannot
// rewrite what a log viewer shows.
TEST(LogTest, ControlCharactersAreEscaped) {
  const std::string line = FormatLogLine(
      LogLevel::kWarning, "rpc",
      {{"session", std::string("a\rb\x1b[2J\tc\x7f", 10)}, {"plain", "x"}});
  EXPECT_NE(line.find(" session=\"a\\x0db\\x1b[2J\\x09c\\x7f\" plain=x"),
            std::string::npos)
      << line;
  for (char c : line.substr(0, line.size() - 1)) {
    const unsigned char u = static_cast<unsigned char>(c);
    EXPECT_TRUE(u >= 0x20 && u != 0x7f) << "raw control byte " << int{u};
  }
}

}  // namespace
}  // namespace attention::server
