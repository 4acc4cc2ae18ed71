// Authenticator: who a call comes from (core/tenant.h), in one of three
// modes, chosen by the server's options:
//
//   tokens       (--auth_tokens_file) every call carries
//                `authorization: Bearer <token>`; the token's SHA-256 is
//                looked up in the tokens file (server/tokens_file.h),
//                comparing every digest in constant time. The file is
//                re-read when it changes (polled) or on Reload() (SIGHUP);
//                a file that does not parse leaves the previous one in force
//                and is logged; one that cannot be read (descriptors short)
//                is read again at each poll until it can.
//   client-cert  (mutual TLS without a tokens file) the verified client
//                certificate's subject CN names the tenant (no quota).
//   none         everything runs as DefaultTenant().
//
// A call that cannot be authenticated gets UNAUTHENTICATED. Neither tokens
// nor digests ever reach a log line or an error message.
//
// Thread-safety: all methods are thread-safe.
#ifndef ATTENTION_SERVER_AUTHENTICATOR_H_
#define ATTENTION_SERVER_AUTHENTICATOR_H_

#include <grpcpp/security/auth_context.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/string_ref.h>
#include <sys/stat.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/tenant.h"
#include "server/tokens_file.h"

namespace attention::server {

struct AuthenticatorOptions {
  // The tokens file; empty = no token authentication.
  std::string tokens_file;
  // How often the tokens file is checked for changes (zero = never; Reload
  // still works).
  absl::Duration reload_interval = absl::Seconds(1);
  // Without a tokens file: name the tenant after the client certificate's
  // subject CN (the server requires and verifies client certificates).
  bool tenant_from_client_certificate = false;
};

class Authenticator {
 public:
  // Loads the tokens file, if any: INVALID_ARGUMENT when it cannot be read
  // or parsed (the server must not start without its tenants).
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(
      AuthenticatorOptions options);
  ~Authenticator();  // stops the watcher

  Authenticator(const Authenticator&) = delete;
  Authenticator& operator=(const Authenticator&) = delete;

  // "tokens", "client-cert" or "none" (for the start-up line).
  const char* mode() const;
  // False in mode "none".
  bool enabled() const;

  // The tenant of a call with client metadata `metadata` over a connection
  // whose peer is `auth_context` (may be null). UNAUTHENTICATED saying what
  // is missing or wrong.
  absl::StatusOr<Tenant> Authenticate(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
      const grpc::AuthContext* auth_context) const;
  absl::StatusOr<Tenant> Authenticate(
      const grpc::ServerContextBase& context) const;

  // Re-reads the tokens file now. On error the previous tenants stay in
  // force; the error (also logged) names the file and the line. OK without
  // a tokens file.
  absl::Status Reload();

  // Changes whenever the tenants in force change (each successful load of
  // the tokens file). A long-lived call (a Decode stream) that read it
  // before authenticating authenticates again once it differs, so that a
  // revoked token or a changed quota also reaches open streams.
  uint64_t generation() const {
    return generation_.load(std::memory_order_acquire);
  }

  // Calls `listener` after each change of the tenants (once generation()
  // has moved), on the thread that reloaded, until another listener
  // replaces it; nullptr: none. A call in progress ends before this
  // returns, so a listener that is reset can be destroyed.
  void SetChangeListener(std::function<void()> listener)
      ABSL_LOCKS_EXCLUDED(listener_mu_);

  // The quota the tokens file gives tenant `name` now (none in the other
  // modes, or for a tenant it does not name).
  TenantQuota QuotaOf(const std::string& name) const;

  // The tenants of the tokens file now, in file order (empty in the other
  // modes): the only tenant names metrics may carry.
  std::vector<std::string> tenant_names() const;

 private:
  explicit Authenticator(AuthenticatorOptions options);
  void WatcherMain();

  const AuthenticatorOptions options_;

  // Held across a whole Reload (read, then put in force); taken before mu_.
  absl::Mutex reload_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  std::vector<TokenEntry> entries_ ABSL_GUARDED_BY(mu_);
  // What the tokens file looked like when last read whole (stat(2)).
  struct stat file_ ABSL_GUARDED_BY(mu_) = {};
  // Why the last read failed (OK: it did not), so that a failure the
  // watcher meets at every poll is logged once.
  absl::Status read_failure_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uint64_t> generation_{0};
  absl::Mutex listener_mu_ ABSL_ACQUIRED_AFTER(reload_mu_);
  std::function<void()> listener_ ABSL_GUARDED_BY(listener_mu_);
  std::thread watcher_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_AUTHENTICATOR_H_
