// Reading a whole small file (certificates, keys, the tokens file) with an
// error that names it.
#ifndef ATTENTION_CORE_READ_FILE_H_
#define ATTENTION_CORE_READ_FILE_H_

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attention {

// Largest file ReadFile reads: these files are a few KiB.
inline constexpr int64_t kMaxReadFileBytes = int64_t{16} << 20;

// What ReadFile reads.
enum class ReadFileFrom {
  // Regular files only: a server's reader (the tokens-file watcher) must
  // never block on a FIFO, nor read a device that never ends.
  kRegularFile,
  // Also a pipe or device a command-line tool is handed (`/dev/stdin`,
  // `<(...)`), read until its end (still at most kMaxReadFileBytes).
  kAnyFile,
};

// The contents of the file at `path` (links followed), read whole.
// INVALID_ARGUMENT "cannot read the <what> <path>: <reason>" when it cannot
// be opened or read, is not a file `from` allows, or is larger than
// kMaxReadFileBytes.
inline absl::StatusOr<std::string> ReadFile(
    const std::string& path, absl::string_view what,
    ReadFileFrom from = ReadFileFrom::kRegularFile) {
  const auto error = [&](absl::string_view reason) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read the ", what, " ", path, ": ", reason));
  };
  const bool regular_only = from == ReadFileFrom::kRegularFile;
  const int fd = ::open(path.c_str(),
                        O_RDONLY | O_CLOEXEC | (regular_only ? O_NONBLOCK : 0));
  if (fd < 0) return error(std::strerror(errno));
  absl::Cleanup close_file = [fd] { ::close(fd); };
  struct stat info = {};
  if (::fstat(fd, &info) != 0) return error(std::strerror(errno));
  if (S_ISDIR(info.st_mode) || (regular_only && !S_ISREG(info.st_mode))) {
    return error("not a regular file");
  }
  if (info.st_size > kMaxReadFileBytes) {
    return error(absl::StrCat("larger than ", kMaxReadFileBytes, " bytes"));
  }
  std::string text;
  char buffer[8192];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return error(std::strerror(errno));
    if (n == 0) return text;
    text.append(buffer, static_cast<size_t>(n));
    if (static_cast<int64_t>(text.size()) > kMaxReadFileBytes) {
      return error(absl::StrCat("larger than ", kMaxReadFileBytes, " bytes"));
    }
  }
}

}  // namespace attention

#endif  // ATTENTION_CORE_READ_FILE_H_
