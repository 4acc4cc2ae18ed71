#include "tests/server/frozen_reader.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace attention::testing {
namespace {

constexpr uint8_t kData = 0x0;
constexpr uint8_t kHeaders = 0x1;
constexpr uint8_t kSettings = 0x4;
constexpr uint8_t kWindowUpdate = 0x8;
constexpr uint8_t kEndStream = 0x1;
constexpr uint8_t kEndHeaders = 0x4;
constexpr uint8_t kAck = 0x1;
constexpr uint16_t kInitialWindowSize = 0x4;
constexpr uint32_t kMaxWindow = 0x7fffffff;
constexpr size_t kMaxFrameBytes = 16384;

void AppendBigEndian(std::string* out, uint64_t value, int bytes) {
  for (int i = bytes - 1; i >= 0; --i) {
    out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  }
}

std::string Frame(uint8_t type, uint8_t flags, uint32_t stream,
                  absl::string_view payload) {
  std::string frame;
  AppendBigEndian(&frame, payload.size(), 3);
  frame.push_back(static_cast<char>(type));
  frame.push_back(static_cast<char>(flags));
  AppendBigEndian(&frame, stream, 4);
  absl::StrAppend(&frame, payload);
  return frame;
}

// An HPACK string length with a 7-bit prefix (no Huffman coding).
void AppendHpackLength(std::string* out, size_t length) {
  if (length < 127) {
    out->push_back(static_cast<char>(length));
    return;
  }
  out->push_back(static_cast<char>(127));
  length -= 127;
  while (length >= 128) {
    out->push_back(static_cast<char>((length & 127) | 128));
    length >>= 7;
  }
  out->push_back(static_cast<char>(length));
}

// A literal header field without indexing, new name.
void AppendHeader(std::string* block, absl::string_view name,
                  absl::string_view value) {
  block->push_back('\0');
  AppendHpackLength(block, name.size());
  absl::StrAppend(block, name);
  AppendHpackLength(block, value.size());
  absl::StrAppend(block, value);
}

}  // namespace

absl::Status FrozenReader::Connect(int port) {
  fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd_ < 0) return absl::InternalError("socket() failed");
  // A small receive buffer, so that the replies fill it soon.
  const int rcvbuf = 4096;
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) !=
      0) {
    return absl::UnavailableError(
        absl::StrCat("connect: ", std::strerror(errno)));
  }
  std::string settings;
  AppendBigEndian(&settings, kInitialWindowSize, 2);
  AppendBigEndian(&settings, kMaxWindow, 4);
  std::string window;
  AppendBigEndian(&window, kMaxWindow - 65535, 4);
  // The preface, our settings (streams may receive as much as they like),
  // the acknowledgement of the server's (sent before they arrive: this
  // client never reads them, and gRPC does not mind), and the connection's
  // window.
  return Send(absl::StrCat(
      "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", Frame(kSettings, 0, 0, settings),
      Frame(kSettings, kAck, 0, ""), Frame(kWindowUpdate, 0, 0, window)));
}

absl::Status FrozenReader::Call(absl::string_view method,
                                absl::string_view request) {
  std::string headers;
  AppendHeader(&headers, ":method", "POST");
  AppendHeader(&headers, ":scheme", "http");
  AppendHeader(&headers, ":path", method);
  AppendHeader(&headers, ":authority", "localhost");
  AppendHeader(&headers, "content-type", "application/grpc");
  AppendHeader(&headers, "te", "trailers");
  std::string message(1, '\0');  // not compressed
  AppendBigEndian(&message, request.size(), 4);
  absl::StrAppend(&message, request);
  const uint32_t stream = next_stream_;
  next_stream_ += 2;
  std::string frames = Frame(kHeaders, kEndHeaders, stream, headers);
  // DATA frames of at most the default SETTINGS_MAX_FRAME_SIZE.
  absl::string_view rest = message;
  while (!rest.empty()) {
    const absl::string_view part = rest.substr(0, kMaxFrameBytes);
    rest.remove_prefix(part.size());
    absl::StrAppend(&frames,
                    Frame(kData, rest.empty() ? kEndStream : 0, stream, part));
  }
  return Send(frames);
}

absl::Status FrozenReader::Send(absl::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t sent = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(
          absl::StrCat("send: ", std::strerror(errno)));
    }
    bytes.remove_prefix(static_cast<size_t>(sent));
  }
  return absl::OkStatus();
}

void FrozenReader::Close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace attention::testing
