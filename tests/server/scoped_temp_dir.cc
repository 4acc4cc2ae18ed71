#include "tests/server/scoped_temp_dir.h"

#include <unistd.h>

#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace attention::testing {

ScopedTempDir::ScopedTempDir(absl::string_view name)
    : path_(absl::StrCat(::testing::TempDir(), "/", name, "-", getpid())) {
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

ScopedTempDir::~ScopedTempDir() {
  std::error_code ignored;  // a test must not fail for its clean-up
  std::filesystem::remove_all(path_, ignored);
}

}  // namespace attention::testing
