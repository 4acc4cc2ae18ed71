#include "bench/soak/process.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

extern char** environ;

namespace attention::soak {

absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv,
                            const std::vector<std::string>& extra_env) {
  std::vector<std::string> env = extra_env;
  std::set<std::string> overridden;
  for (const std::string& entry : extra_env) {
    overridden.insert(entry.substr(0, entry.find('=')));
  }
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text(*entry);
    if (!overridden.contains(text.substr(0, text.find('=')))) {
      env.push_back(text);
    }
  }
  std::vector<char*> argv_pointers, env_pointers;
  for (const std::string& arg : argv) {
    argv_pointers.push_back(const_cast<char*>(arg.c_str()));
  }
  argv_pointers.push_back(nullptr);
  for (const std::string& entry : env) {
    env_pointers.push_back(const_cast<char*>(entry.c_str()));
  }
  env_pointers.push_back(nullptr);
  // fork + exec rather than posix_spawn, to set PR_SET_PDEATHSIG: if
  // attn-soak dies (a ctest timeout, a crash), its server and workers die
  // with it. Only async-signal-safe calls run in the child.
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    return absl::InternalError(
        absl::StrCat("cannot start ", argv[0], ": ", std::strerror(errno)));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);  // died before prctl
    execve(argv_pointers[0], argv_pointers.data(), env_pointers.data());
    _exit(127);
  }
  return pid;
}

bool Exited(pid_t pid, int* status) {
  return waitpid(pid, status, WNOHANG) == pid;
}

int StopChild(pid_t pid, int signal_number, absl::Duration grace) {
  kill(pid, signal_number);
  int status = 0;
  const absl::Time deadline = absl::Now() + grace;
  while (absl::Now() < deadline) {
    if (Exited(pid, &status)) return status;
    absl::SleepFor(absl::Milliseconds(20));
  }
  kill(pid, SIGKILL);
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("signal ", WTERMSIG(status), " (",
                        strsignal(WTERMSIG(status)), ")");
  }
  return absl::StrCat("wait status ", status);
}

absl::StatusOr<int64_t> ReadRssBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "VmRSS:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    int64_t kib = 0;
    if (absl::ConsumeSuffix(&rest, "kB") &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kib)) {
      return kib * 1024;
    }
  }
  return absl::NotFoundError(
      absl::StrCat("no VmRSS in /proc/", pid, "/status"));
}

std::string SelfExecutable() {
  char path[PATH_MAX];
  const ssize_t length = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (length <= 0) return "";
  return std::string(path, static_cast<size_t>(length));
}

}  // namespace attention::soak
