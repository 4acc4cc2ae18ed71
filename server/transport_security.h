// Transport security of the gRPC port: plaintext, TLS, or mutual TLS.
//
//   plaintext   no TLS option set
//   tls         cert_file + key_file (PEM): the server proves its identity
//   mutual-tls  also client_ca_file: clients must present a certificate
//               signed by one of its CAs, or the handshake fails
//
// Certificates and keys are read by gRPC's file-watcher certificate
// provider, which re-reads them every `refresh_interval`: replacing the
// files (e.g. a Kubernetes Secret update) takes effect for new connections
// without a restart. Replace the key and the certificate together (as a
// Secret update does, by swapping a directory symlink).
#ifndef ATTENTION_SERVER_TRANSPORT_SECURITY_H_
#define ATTENTION_SERVER_TRANSPORT_SECURITY_H_

#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attention::server {

struct TransportSecurityOptions {
  std::string cert_file;       // server certificate chain (PEM)
  std::string key_file;        // its private key (PEM)
  std::string client_ca_file;  // CAs of client certificates (PEM)
  absl::Duration refresh_interval = absl::Seconds(10);
};

// "plaintext", "tls" or "mutual-tls".
const char* TransportMode(const TransportSecurityOptions& options);

// The credentials of the listening port. INVALID_ARGUMENT when only one of
// cert_file and key_file is set, client_ca_file is set without them, a
// file cannot be read or holds no PEM block, or refresh_interval is under
// one second.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TransportSecurityOptions& options);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_TRANSPORT_SECURITY_H_
