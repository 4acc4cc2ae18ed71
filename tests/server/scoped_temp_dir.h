// ScopedTempDir: a directory of one test's own (a snapshot directory, a
// tokens file's home), empty when made and removed with all it holds when
// the object goes, also when an assertion ends the test early. Declare it
// before the servers that write into it: they are gone first.
#ifndef ATTENTION_TESTS_SERVER_SCOPED_TEMP_DIR_H_
#define ATTENTION_TESTS_SERVER_SCOPED_TEMP_DIR_H_

#include <string>

#include "absl/strings/string_view.h"

namespace attention::testing {

class ScopedTempDir {
 public:
  // ::testing::TempDir()/<name>-<pid>, emptied if it was left behind.
  explicit ScopedTempDir(absl::string_view name);
  ~ScopedTempDir();

  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  const std::string path_;
};

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_SERVER_SCOPED_TEMP_DIR_H_
