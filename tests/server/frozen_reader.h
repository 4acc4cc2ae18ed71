// FrozenReader: a client that sends gRPC calls over a plain TCP connection
// and then never reads again, as a client process stopped (SIGSTOP) or
// hung mid-reply would: the replies fill the socket buffers, and the
// server's transport can send nothing more on the connection, not even a
// cancellation. It speaks just enough HTTP/2 for that (the preface, open
// flow-control windows, one HEADERS and DATA frame per call).
#ifndef ATTENTION_TESTS_SERVER_FROZEN_READER_H_
#define ATTENTION_TESTS_SERVER_FROZEN_READER_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace attention::testing {

class FrozenReader {
 public:
  FrozenReader() = default;
  ~FrozenReader() { Close(); }
  FrozenReader(const FrozenReader&) = delete;
  FrozenReader& operator=(const FrozenReader&) = delete;

  // Connects to 127.0.0.1:`port` (a plaintext gRPC server).
  absl::Status Connect(int port);
  // Sends one unary call of `method` ("/package.Service/Method") with the
  // serialized `request` (at most 64 KiB, the initial flow-control window).
  absl::Status Call(absl::string_view method, absl::string_view request);
  // Closes the connection (the client comes back to life and goes away).
  void Close();

 private:
  absl::Status Send(absl::string_view bytes);

  int fd_ = -1;
  uint32_t next_stream_ = 1;
};

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_SERVER_FROZEN_READER_H_
