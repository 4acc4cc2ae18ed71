// ProcessUsage: the CPU time and context switches of this whole process
// (every thread: the in-process server, its clients and the engine) from
// getrusage(RUSAGE_SELF). attn-bench takes it around each side of a ratio:
// on a machine whose cores the client, the transport and the engine share,
// CPU time per step says what each side costs whatever else runs, where
// wall time mostly says how busy the machine was.
#ifndef ATTENTION_BENCH_PROCESS_USAGE_H_
#define ATTENTION_BENCH_PROCESS_USAGE_H_

#include <sys/resource.h>

namespace attention::bench {

struct ProcessUsage {
  double cpu_us = 0;            // user + system
  double context_switches = 0;  // voluntary + involuntary

  // Since the process started.
  static ProcessUsage Now() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    auto micros = [](const timeval& t) {
      return static_cast<double>(t.tv_sec) * 1e6 +
             static_cast<double>(t.tv_usec);
    };
    ProcessUsage now;
    now.cpu_us = micros(usage.ru_utime) + micros(usage.ru_stime);
    now.context_switches = static_cast<double>(usage.ru_nvcsw) +
                           static_cast<double>(usage.ru_nivcsw);
    return now;
  }

  ProcessUsage& operator+=(const ProcessUsage& other) {
    cpu_us += other.cpu_us;
    context_switches += other.context_switches;
    return *this;
  }
  friend ProcessUsage operator-(ProcessUsage a, const ProcessUsage& b) {
    a.cpu_us -= b.cpu_us;
    a.context_switches -= b.context_switches;
    return a;
  }
};

}  // namespace attention::bench

#endif  // ATTENTION_BENCH_PROCESS_USAGE_H_
