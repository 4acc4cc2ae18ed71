#include "tests/client/server_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

extern char** environ;

namespace attention::testing {

int PickFreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in address;
  std::memset(&address, 0, sizeof(address));
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  close(fd);
  return port;
}

ServerProcess::ServerProcess(const std::string& binary, int port,
                             std::vector<std::string> flags)
    : port_(port) {
  static std::atomic<int> counter{0};
  port_file_ = absl::StrCat(::testing::TempDir(), "/fleet-server-", getpid(),
                            "-", counter++, ".port");
  std::remove(port_file_.c_str());
  output_file_ = port_file_ + ".out";
  std::vector<std::string> args = {binary, "--listen_address=127.0.0.1",
                                   absl::StrCat("--port=", port),
                                   "--port_file=" + port_file_};
  args.insert(args.end(), flags.begin(), flags.end());
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO,
                                   output_file_.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  if (posix_spawn(&pid_, binary.c_str(), &actions, nullptr, argv.data(),
                  environ) != 0) {
    pid_ = -1;
  }
  posix_spawn_file_actions_destroy(&actions);
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0 && !exited_) {
    kill(pid_, SIGKILL);
    while (waitpid(pid_, &status_, 0) < 0 && errno == EINTR) {
    }
  }
  std::remove(port_file_.c_str());
  std::remove(output_file_.c_str());
}

std::string ServerProcess::address() const {
  return absl::StrCat("127.0.0.1:", port_);
}

bool ServerProcess::WaitServing(absl::Duration timeout) {
  if (pid_ <= 0) return false;
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    std::ifstream in(port_file_);
    std::string text;
    int port = 0;
    if (in >> text && absl::SimpleAtoi(text, &port) && port > 0) return true;
    if (WaitExit(absl::ZeroDuration()).has_value()) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

void ServerProcess::Signal(int signal_number) {
  if (pid_ > 0 && !exited_) kill(pid_, signal_number);
}

std::optional<int> ServerProcess::WaitExit(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!exited_ && pid_ > 0) {
    const pid_t waited = waitpid(pid_, &status_, WNOHANG);
    if (waited == pid_) {
      exited_ = true;
      break;
    }
    if (absl::Now() >= deadline) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (pid_ <= 0) return std::nullopt;
  return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
}

std::string ServerProcess::output() const {
  std::ifstream in(output_file_);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace attention::testing
