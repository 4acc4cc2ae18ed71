#include "server/log.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>

#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attention::server {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

absl::string_view LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarning:
      return "warning";
    case LogLevel::kError:
      return "error";
  }
  return "info";
}

// Control characters (a client's string may hold any byte): a carriage
// return or a terminal escape must not reach the log as it is.
bool IsControl(char c) {
  const unsigned char u = static_cast<unsigned char>(c);
  return u < 0x20 || u == 0x7f;
}

void AppendValue(std::string* line, absl::string_view value) {
  const bool plain = !value.empty() &&
                     value.find_first_of(" \"=\\") == absl::string_view::npos &&
                     std::none_of(value.begin(), value.end(), IsControl);
  if (plain) {
    absl::StrAppend(line, value);
    return;
  }
  line->push_back('"');
  for (char c : value) {
    if (c == '"' || c == '\\') {
      line->push_back('\\');
      line->push_back(c);
    } else if (c == '\n') {
      line->append("\\n");
    } else if (IsControl(c)) {
      absl::StrAppendFormat(line, "\\x%02x", static_cast<unsigned char>(c));
    } else {
      line->push_back(c);
    }
  }
  line->push_back('"');
}

}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "debug") return LogLevel::kDebug;
  if (lower == "info") return LogLevel::kInfo;
  if (lower == "warning" || lower == "warn") return LogLevel::kWarning;
  if (lower == "error") return LogLevel::kError;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown log level '", name, "'; use debug, info, warning or error"));
}

void SetLogLevel(LogLevel level) {
  g_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed);
}

std::string FormatLogLine(LogLevel level, absl::string_view event,
                          std::initializer_list<LogField> fields) {
  std::string line =
      absl::StrCat("ts=",
                   absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(),
                                    absl::UTCTimeZone()),
                   " level=", LevelName(level), " event=");
  AppendValue(&line, event);
  for (const LogField& field : fields) {
    absl::StrAppend(&line, " ", field.key, "=");
    AppendValue(&line, field.value);
  }
  line.push_back('\n');
  return line;
}

void Log(LogLevel level, absl::string_view event,
         std::initializer_list<LogField> fields) {
  if (!LogEnabled(level)) return;
  const std::string line = FormatLogLine(level, event, fields);
  // One write per line keeps concurrent lines whole.
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

}  // namespace attention::server
