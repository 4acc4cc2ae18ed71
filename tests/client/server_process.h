// A child attention-server process on 127.0.0.1 for the fleet tests: real
// replicas that can be drained (SIGTERM), killed (SIGKILL) and replaced on
// the same port.
#ifndef ATTENTION_TESTS_CLIENT_SERVER_PROCESS_H_
#define ATTENTION_TESTS_CLIENT_SERVER_PROCESS_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace attention::testing {

// A port on 127.0.0.1 free right now (bound, then released), so that
// replicas can name each other before they start.
int PickFreePort();

class ServerProcess {
 public:
  // Starts `binary` with --listen_address=127.0.0.1 --port=`port` plus
  // `flags`; stdout and stderr go to a file (output()).
  ServerProcess(const std::string& binary, int port,
                std::vector<std::string> flags);
  ~ServerProcess();  // SIGKILL if still running
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  // "127.0.0.1:port".
  std::string address() const;
  int port() const { return port_; }
  // True once the server serves (its --port_file exists); false when it
  // exited or took longer than `timeout`.
  bool WaitServing(absl::Duration timeout = absl::Seconds(30));
  void Signal(int signal_number);
  // The exit code once the process has exited on its own within `timeout`
  // (-1: killed by a signal; nullopt: still running).
  std::optional<int> WaitExit(absl::Duration timeout);
  std::string output() const;

 private:
  int port_;
  std::string port_file_;
  std::string output_file_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = 0;
};

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_CLIENT_SERVER_PROCESS_H_
