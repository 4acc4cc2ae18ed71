#include "tests/server/test_certificates.h"

#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attention::testing {
namespace {

// Runs `command` with its output in `dir`/openssl.log; the log's tail is
// the error.
absl::Status Run(const std::string& dir, const std::string& command) {
  const std::string log = absl::StrCat(dir, "/openssl.log");
  const std::string full = absl::StrCat(command, " >", log, " 2>&1");
  if (std::system(full.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("`", command, "` failed: ", ReadFileOrEmpty(log)));
  }
  return absl::OkStatus();
}

// An EC P-256 key (fast to make) and a request or self-signed certificate.
constexpr char kNewKey[] =
    "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";

}  // namespace

absl::StatusOr<std::string> MakeTempDirectory() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern =
      absl::StrCat(base != nullptr && *base != '\0' ? base : "/tmp",
                   "/attn-security-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", pattern, " failed"));
  }
  return pattern;
}

absl::StatusOr<CertificateFiles> MakeCa(const std::string& dir,
                                        const std::string& name) {
  CertificateFiles ca{absl::StrCat(dir, "/", name, ".crt"),
                      absl::StrCat(dir, "/", name, ".key")};
  if (absl::Status status =
          Run(dir, absl::StrCat(kNewKey, " -x509 -days 2 -subj /CN=", name,
                                " -addext basicConstraints=critical,CA:TRUE"
                                " -addext keyUsage=critical,keyCertSign,cRLSign"
                                " -keyout ",
                                ca.key, " -out ", ca.cert));
      !status.ok()) {
    return status;
  }
  return ca;
}

absl::StatusOr<CertificateFiles> MakeCertificate(const CertificateFiles& ca,
                                                 const std::string& dir,
                                                 const std::string& name,
                                                 const std::string& common_name,
                                                 CertificateUse use) {
  CertificateFiles files{absl::StrCat(dir, "/", name, ".crt"),
                         absl::StrCat(dir, "/", name, ".key")};
  const std::string request = absl::StrCat(dir, "/", name, ".csr");
  const std::string extensions = absl::StrCat(dir, "/", name, ".ext");
  {
    std::ofstream out(extensions);
    out << "basicConstraints=CA:FALSE\n";
    if (use == CertificateUse::kServer) {
      out << "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
          << "extendedKeyUsage=serverAuth\n";
    } else {
      out << "extendedKeyUsage=clientAuth\n";
    }
  }
  std::random_device entropy;
  if (absl::Status status =
          Run(dir, absl::StrCat(kNewKey, " -subj /CN=", common_name,
                                " -keyout ", files.key, " -out ", request));
      !status.ok()) {
    return status;
  }
  if (absl::Status status = Run(
          dir, absl::StrCat("openssl x509 -req -days 2 -in ", request, " -CA ",
                            ca.cert, " -CAkey ", ca.key, " -set_serial ",
                            entropy() & 0x7fffffff, " -extfile ", extensions,
                            " -out ", files.cert));
      !status.ok()) {
    return status;
  }
  return files;
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool WriteFileAtomically(const std::string& path, const std::string& contents) {
  const std::string temporary = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out << contents;
    if (!out.good()) return false;
  }
  return std::rename(temporary.c_str(), path.c_str()) == 0;
}

}  // namespace attention::testing
