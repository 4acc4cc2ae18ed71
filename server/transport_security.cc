#include "server/transport_security.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/read_file.h"
#include "core/status_macros.h"

namespace attention::server {
namespace {

// Checks that `path` can be read and holds a PEM block, so that a typo
// fails at start-up instead of in every handshake.
absl::Status CheckPemFile(const std::string& path, const char* what) {
  ATTN_ASSIGN_OR_RETURN(const std::string text, ReadFile(path, what));
  if (!absl::StrContains(text, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ", what, " ", path, " holds no PEM block (-----BEGIN ...)"));
  }
  return absl::OkStatus();
}

}  // namespace

const char* TransportMode(const TransportSecurityOptions& options) {
  if (options.cert_file.empty()) return "plaintext";
  return options.client_ca_file.empty() ? "tls" : "mutual-tls";
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TransportSecurityOptions& options) {
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs both --tls_cert_file and --tls_key_file");
  }
  if (options.cert_file.empty()) {
    if (!options.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca_file (mutual TLS) needs --tls_cert_file and "
          "--tls_key_file too");
    }
    return grpc::InsecureServerCredentials();
  }
  if (options.refresh_interval < absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls_refresh_interval ", absl::FormatDuration(options.refresh_interval),
        " must be at least 1s"));
  }
  ATTN_RETURN_IF_ERROR(CheckPemFile(options.cert_file, "TLS certificate"));
  ATTN_RETURN_IF_ERROR(CheckPemFile(options.key_file, "TLS private key"));
  const bool mutual = !options.client_ca_file.empty();
  if (mutual) {
    ATTN_RETURN_IF_ERROR(
        CheckPemFile(options.client_ca_file, "TLS client CA file"));
  }
  const auto refresh_seconds =
      static_cast<unsigned int>(absl::ToInt64Seconds(options.refresh_interval));
  auto provider =
      std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
          options.key_file, options.cert_file, options.client_ca_file,
          refresh_seconds);
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (mutual) {
    tls.watch_root_certs();
    tls.set_cert_request_type(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(tls);
}

}  // namespace attention::server
