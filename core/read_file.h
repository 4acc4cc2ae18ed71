// Reading a whole small file (certificates, keys, the tokens file) with an
// error that names it.
#ifndef ATTENTION_CORE_READ_FILE_H_
#define ATTENTION_CORE_READ_FILE_H_

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attention {

// The contents of the file at `path`. INVALID_ARGUMENT "cannot read the
// <what> <path>: <reason>" when it cannot be opened.
inline absl::StatusOr<std::string> ReadFile(const std::string& path,
                                            absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot read the ", what, " ", path, ": ", std::strerror(errno)));
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace attention

#endif  // ATTENTION_CORE_READ_FILE_H_
