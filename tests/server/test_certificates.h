// Throw-away X.509 material for the security tests, made with the openssl
// command at test time (no key is ever committed): a CA, and server and
// client certificates it signs.
#ifndef ATTENTION_TESTS_SERVER_TEST_CERTIFICATES_H_
#define ATTENTION_TESTS_SERVER_TEST_CERTIFICATES_H_

#include <string>

#include "absl/status/statusor.h"

namespace attention::testing {

// A certificate and its key, as PEM files.
struct CertificateFiles {
  std::string cert;
  std::string key;
};

// A new temporary directory (under $TMPDIR or /tmp).
absl::StatusOr<std::string> MakeTempDirectory();

// A self-signed CA named `name` in `dir` (`name`.crt, `name`.key).
absl::StatusOr<CertificateFiles> MakeCa(const std::string& dir,
                                        const std::string& name);

// A certificate with subject CN `common_name` signed by `ca`, in `dir`
// (`name`.crt, `name`.key). A server certificate names localhost and
// 127.0.0.1; a client certificate is for client authentication.
enum class CertificateUse { kServer, kClient };
absl::StatusOr<CertificateFiles> MakeCertificate(const CertificateFiles& ca,
                                                 const std::string& dir,
                                                 const std::string& name,
                                                 const std::string& common_name,
                                                 CertificateUse use);

// The contents of a file ("" when it cannot be read).
std::string ReadFileOrEmpty(const std::string& path);
// Writes `contents` to `path` through a temporary file and rename, so that
// a reader never sees a partial file. False on error.
bool WriteFileAtomically(const std::string& path, const std::string& contents);

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_SERVER_TEST_CERTIFICATES_H_
