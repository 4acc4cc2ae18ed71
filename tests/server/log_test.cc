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

}  // namespace
}  // namespace attention::server
