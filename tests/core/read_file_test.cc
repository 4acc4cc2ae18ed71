#include "core/read_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace attention {
namespace {

std::string TempPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/read_file_", getpid(), "_", name);
}

TEST(ReadFileTest, ReadsARegularFileWhole) {
  const std::string path = TempPath("tokens");
  const std::string text(100000, 'x');
  std::ofstream(path, std::ios::binary) << text << "end\n";
  auto read = ReadFile(path, "tokens file");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, text + "end\n");
  std::remove(path.c_str());
}

// What is not a regular file is refused at once, naming it: a FIFO would
// block the reader (the tokens-file watcher), a directory cannot be read.
TEST(ReadFileTest, RefusesWhatIsNotARegularFile) {
  const std::string fifo = TempPath("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {fifo, ::testing::TempDir()}) {
    const absl::Status status = ReadFile(path, "tokens file").status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_NE(status.message().find("not a regular file"), std::string::npos)
        << status;
    EXPECT_NE(status.message().find("tokens file"), std::string::npos)
        << status;
  }
  std::remove(fifo.c_str());
  const absl::Status missing =
      ReadFile(TempPath("missing"), "peer token file").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.message().find("No such file"), std::string::npos)
      << missing;
}

// A command-line tool may be handed a pipe (`--auth_token_file=/dev/stdin`,
// `<(vault read ...)`): read to its end.
TEST(ReadFileTest, AToolReadsAPipeToItsEnd) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const std::string token = "a-token\n";
  ASSERT_EQ(::write(fds[1], token.data(), token.size()),
            static_cast<ssize_t>(token.size()));
  ::close(fds[1]);
  const std::string path = absl::StrCat("/proc/self/fd/", fds[0]);
  EXPECT_EQ(ReadFile(path, "token").status().code(),
            absl::StatusCode::kInvalidArgument);
  auto read = ReadFile(path, "token", ReadFileFrom::kAnyFile);
  ::close(fds[0]);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, token);
  EXPECT_FALSE(
      ReadFile(::testing::TempDir(), "token", ReadFileFrom::kAnyFile).ok());
}

TEST(ReadFileTest, RefusesAFileLargerThanTheBound) {
  const std::string path = TempPath("large");
  { std::ofstream(path, std::ios::binary); }
  ASSERT_EQ(::truncate(path.c_str(), kMaxReadFileBytes + 1), 0);
  const absl::Status status = ReadFile(path, "certificate").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("larger than"), std::string::npos) << status;
  std::remove(path.c_str());
}

}  // namespace
}  // namespace attention
