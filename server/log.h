// Structured, leveled logging: one line per event on stderr, as
// `ts=2026-11-29T12:00:00.123456Z level=info event=session_created
// session=3f2a... layers=36`. Values never contain tensor data.
//
// Thread-safety: all functions are thread-safe; a line is written with one
// write call so lines from different threads never interleave.
#ifndef ATTENTION_SERVER_LOG_H_
#define ATTENTION_SERVER_LOG_H_

#include <initializer_list>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attention::server {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// "debug", "info", "warning" (or "warn"), "error"; INVALID_ARGUMENT
// otherwise.
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name);

// Events below `level` are dropped. Default: kInfo.
void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);

// One key=value field. Values with spaces, quotes or '=' are quoted.
struct LogField {
  template <typename T>
  LogField(absl::string_view key, const T& value)
      : key(key), value(absl::StrCat(value)) {}
  LogField(absl::string_view key, absl::string_view value)
      : key(key), value(value) {}
  LogField(absl::string_view key, const char* value) : key(key), value(value) {}
  LogField(absl::string_view key, const std::string& value)
      : key(key), value(value) {}

  absl::string_view key;
  std::string value;
};

// Formats the line (without writing it); exposed for tests.
std::string FormatLogLine(LogLevel level, absl::string_view event,
                          std::initializer_list<LogField> fields);

// Writes `event` with `fields` when `level` is enabled.
void Log(LogLevel level, absl::string_view event,
         std::initializer_list<LogField> fields = {});

}  // namespace attention::server

#endif  // ATTENTION_SERVER_LOG_H_
