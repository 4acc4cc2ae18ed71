// Failing a fuzz target: prints what went wrong and aborts, which libFuzzer
// (and the standalone driver's caller) reports as a crash with the input.
#ifndef ATTENTION_TESTS_FUZZ_FUZZ_CHECK_H_
#define ATTENTION_TESTS_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>
#include <string>

namespace attention::fuzz {

[[noreturn]] inline void Fail(const std::string& what) {
  std::fprintf(stderr, "fuzz check failed: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

inline void Check(bool ok, const std::string& what) {
  if (!ok) Fail(what);
}

}  // namespace attention::fuzz

#endif  // ATTENTION_TESTS_FUZZ_FUZZ_CHECK_H_
