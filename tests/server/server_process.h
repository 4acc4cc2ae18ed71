// ServerProcess: an attention-server executable run as a child process by
// integration tests (its --port_file says the ephemeral port; stdout and
// stderr go to a file read by output()).
#ifndef ATTENTION_TESTS_SERVER_SERVER_PROCESS_H_
#define ATTENTION_TESTS_SERVER_SERVER_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

namespace attention::testing {

class ServerProcess {
 public:
  // Starts `binary` (default: the attention-server this test was built
  // with) with --port_file and `flags`. The server is killed when the
  // thread that started it exits (so, when the test process dies), so
  // start it on the thread that runs the test.
  explicit ServerProcess(std::vector<std::string> flags,
                         std::string binary = DefaultBinary());
  ~ServerProcess();

  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  bool started() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }

  // The port from --port_file, or 0 if the server exited or took too long.
  int WaitForPort();

  void Signal(int signal_number);
  // Stops the process (SIGSTOP) and returns once every thread of it has
  // stopped: a signal alone leaves its other threads running until one of
  // them takes it, which on a loaded machine can be long enough to answer
  // one more request. False when it exited instead.
  bool Freeze();

  // What the server wrote to stdout and stderr so far.
  std::string output() const;

  // The raw wait status once the process has exited.
  int Wait();

  // The attention-server executable the tests were built with.
  static std::string DefaultBinary();

 private:
  static inline int counter_ = 0;
  std::string binary_;
  std::string port_file_;
  std::string output_file_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = 0;
};

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_SERVER_SERVER_PROCESS_H_
