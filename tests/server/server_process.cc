#include "tests/server/server_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

extern char** environ;

namespace attention::testing {

std::string ServerProcess::DefaultBinary() { return ATTN_SERVER_BINARY; }

ServerProcess::ServerProcess(std::vector<std::string> flags, std::string binary)
    : binary_(std::move(binary)) {
  port_file_ = absl::StrCat(::testing::TempDir(), "/attention-server-port-",
                            getpid(), "-", counter_++);
  std::remove(port_file_.c_str());
  output_file_ = port_file_ + ".out";
  std::vector<std::string> args = {binary_, "--port_file=" + port_file_};
  args.insert(args.end(), flags.begin(), flags.end());
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  // stdout and stderr go to one file, read by output(). fork + exec rather
  // than posix_spawn, to set PR_SET_PDEATHSIG: a test process that dies
  // (an abort, a ctest timeout) takes its servers with it instead of
  // leaving them running. Only async-signal-safe calls run in the child.
  const int output = open(output_file_.c_str(),
                          O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (output < 0) return;
  const pid_t parent = getpid();
  pid_ = fork();
  if (pid_ == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);  // the test died before prctl
    if (dup2(output, STDOUT_FILENO) < 0 || dup2(output, STDERR_FILENO) < 0) {
      _exit(126);
    }
    execve(binary_.c_str(), argv.data(), environ);
    _exit(127);
  }
  close(output);
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0 && !exited_) {
    kill(pid_, SIGKILL);
    Wait();
  }
  std::remove(port_file_.c_str());
  std::remove(output_file_.c_str());
}

int ServerProcess::WaitForPort() {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    std::ifstream in(port_file_);
    std::string text;
    int port = 0;
    if (in >> text && absl::SimpleAtoi(text, &port) && port > 0) return port;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      status_ = status;
      return 0;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return 0;
}

void ServerProcess::Signal(int signal_number) { kill(pid_, signal_number); }

std::string ServerProcess::output() const {
  std::ifstream in(output_file_);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool ServerProcess::Freeze() {
  if (exited_) return false;
  kill(pid_, SIGSTOP);
  int status = 0;
  pid_t waited;
  while ((waited = waitpid(pid_, &status, WUNTRACED)) < 0 && errno == EINTR) {
  }
  if (waited == pid_ && !WIFSTOPPED(status)) {
    exited_ = true;
    status_ = status;
    return false;
  }
  return waited == pid_;
}

int ServerProcess::Wait() {
  if (!exited_) {
    while (waitpid(pid_, &status_, 0) < 0 && errno == EINTR) {
    }
    exited_ = true;
  }
  return status_;
}

}  // namespace attention::testing
