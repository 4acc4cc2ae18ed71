// attn-soak: child processes (the server, the workers) and their memory.
#ifndef ATTENTION_BENCH_SOAK_PROCESS_H_
#define ATTENTION_BENCH_SOAK_PROCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attention::soak {

// Starts argv[0] with `argv` and this process's environment plus
// `extra_env` ("NAME=value" entries, which take precedence). The child is
// killed when the calling thread exits. A program that cannot be executed
// exits 127.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv,
                            const std::vector<std::string>& extra_env = {});

// True (and the raw wait status in *status) once child `pid` has exited;
// reaps it.
bool Exited(pid_t pid, int* status);

// Sends `signal_number` to child `pid`, waits up to `grace` for it to exit,
// then SIGKILLs it; reaps it and returns its raw wait status.
int StopChild(pid_t pid, int signal_number, absl::Duration grace);

// "exit 0", "signal 9 (Killed)", ...
std::string DescribeWaitStatus(int status);

// VmRSS of `pid` from /proc/<pid>/status, in bytes.
absl::StatusOr<int64_t> ReadRssBytes(pid_t pid);

// This executable (/proc/self/exe).
std::string SelfExecutable();

}  // namespace attention::soak

#endif  // ATTENTION_BENCH_SOAK_PROCESS_H_
