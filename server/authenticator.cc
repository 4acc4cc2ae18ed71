#include "server/authenticator.h"

#include <openssl/crypto.h>

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/read_file.h"
#include "core/status_macros.h"
#include "server/log.h"

namespace attention::server {
namespace {

constexpr char kAuthorizationKey[] = "authorization";
constexpr absl::string_view kBearerPrefix = "bearer ";
// X.509 subject common name, as gRPC's TLS stack names it.
constexpr char kCommonNameProperty[] = "x509_common_name";

absl::string_view View(const grpc::string_ref& ref) {
  return absl::string_view(ref.data(), ref.size());
}

bool SameTime(const struct timespec& a, const struct timespec& b) {
  return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec;
}

// Whether `a` and `b` describe the same version of a file. The change time
// too: it moves on every write and also on chmod/chown (a file that could
// not be read is read again once its permissions are fixed) and on an
// edit whose modification time was set back.
bool SameFile(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino &&
         a.st_size == b.st_size && SameTime(a.st_mtim, b.st_mtim) &&
         SameTime(a.st_ctim, b.st_ctim);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(
    AuthenticatorOptions options) {
  std::unique_ptr<Authenticator> authenticator(
      new Authenticator(std::move(options)));
  if (authenticator->options_.tokens_file.empty()) return authenticator;
  ATTN_RETURN_IF_ERROR(authenticator->Reload());
  if (authenticator->options_.reload_interval > absl::ZeroDuration()) {
    Authenticator* self = authenticator.get();
    authenticator->watcher_ = std::thread([self] { self->WatcherMain(); });
  }
  return authenticator;
}

Authenticator::Authenticator(AuthenticatorOptions options)
    : options_(std::move(options)) {}

Authenticator::~Authenticator() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (watcher_.joinable()) watcher_.join();
}

const char* Authenticator::mode() const {
  if (!options_.tokens_file.empty()) return "tokens";
  if (options_.tenant_from_client_certificate) return "client-cert";
  return "none";
}

bool Authenticator::enabled() const {
  return !options_.tokens_file.empty() ||
         options_.tenant_from_client_certificate;
}

absl::StatusOr<Tenant> Authenticator::Authenticate(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
    const grpc::AuthContext* auth_context) const {
  if (!options_.tokens_file.empty()) {
    auto it = metadata.find(kAuthorizationKey);
    if (it == metadata.end()) {
      return absl::UnauthenticatedError(
          "this server requires a bearer token: send the metadata "
          "'authorization: Bearer <token>' (attnctl --auth_token_file, "
          "ClientOptions::auth_token)");
    }
    const absl::string_view value = View(it->second);
    if (value.size() <= kBearerPrefix.size() ||
        !absl::StartsWithIgnoreCase(value, kBearerPrefix)) {
      return absl::UnauthenticatedError(
          "the authorization metadata must be 'Bearer <token>'");
    }
    const absl::string_view token =
        absl::StripAsciiWhitespace(value.substr(kBearerPrefix.size()));
    if (token.empty()) {
      return absl::UnauthenticatedError(
          "the bearer token is empty; send 'Bearer <token>'");
    }
    const TokenDigest digest = DigestToken(token);
    absl::MutexLock lock(&mu_);
    // Every digest is compared, in constant time, so that the time taken
    // says nothing about which (or whether one) matched.
    const TokenEntry* found = nullptr;
    for (const TokenEntry& entry : entries_) {
      const bool match =
          CRYPTO_memcmp(entry.digest.data(), digest.data(), digest.size()) == 0;
      if (match && found == nullptr) found = &entry;
    }
    if (found == nullptr) {
      return absl::UnauthenticatedError(
          "the bearer token is not one this server knows (unknown or "
          "revoked); ask the operator for a valid token");
    }
    return found->tenant;
  }
  if (options_.tenant_from_client_certificate) {
    std::vector<grpc::string_ref> names;
    if (auth_context != nullptr && auth_context->IsPeerAuthenticated()) {
      names = auth_context->FindPropertyValues(kCommonNameProperty);
    }
    if (names.empty() || names.front().empty()) {
      return absl::UnauthenticatedError(
          "the client certificate has no subject common name (CN), which "
          "names the tenant; use a certificate with a CN");
    }
    if (names.front().size() > kMaxTenantNameBytes) {
      return absl::UnauthenticatedError(absl::StrCat(
          "the client certificate's common name (CN) is ", names.front().size(),
          " bytes; a tenant name has at most ", kMaxTenantNameBytes,
          ": use a certificate with a shorter CN"));
    }
    return Tenant{std::string(View(names.front())), {}};
  }
  return DefaultTenant();
}

absl::StatusOr<Tenant> Authenticator::Authenticate(
    const grpc::ServerContextBase& context) const {
  if (!enabled()) return DefaultTenant();
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  return Authenticate(context.client_metadata(), auth.get());
}

absl::Status Authenticator::Reload() {
  if (options_.tokens_file.empty()) return absl::OkStatus();
  // One reload at a time (SIGHUP and the watcher): the file read last is
  // the one put in force, never an older one read before it.
  absl::MutexLock reloading(&reload_mu_);
  // stat before reading: a change made meanwhile is seen by the next poll.
  struct stat info = {};
  const bool have_info = stat(options_.tokens_file.c_str(), &info) == 0;
  const absl::StatusOr<std::string> text =
      ReadFile(options_.tokens_file, "tokens file");
  absl::StatusOr<std::vector<TokenEntry>> entries =
      text.ok() ? ParseTokensFileAt(options_.tokens_file, *text)
                : text.status();
  {
    absl::MutexLock lock(&mu_);
    // A file that could not be read (descriptors or memory short for a
    // moment) is read again at the next poll; one read whole waits for its
    // next change. A read failure is logged once until it changes.
    if (have_info && text.ok()) file_ = info;
    const bool repeated = !text.ok() && text.status() == read_failure_;
    read_failure_ = text.status();
    if (!entries.ok()) {
      if (!repeated) {
        Log(LogLevel::kError, "auth_tokens_reload_failed",
            {{"file", options_.tokens_file},
             {"error", entries.status().message()},
             {"tenants_in_force", static_cast<int64_t>(entries_.size())}});
      }
      return entries.status();
    }
    entries_ = *std::move(entries);
    generation_.fetch_add(1, std::memory_order_release);
    Log(LogLevel::kInfo, "auth_tokens_loaded",
        {{"file", options_.tokens_file},
         {"tenants", static_cast<int64_t>(entries_.size())}});
  }
  // Outside mu_: the listener authenticates calls again.
  absl::MutexLock lock(&listener_mu_);
  if (listener_) listener_();
  return absl::OkStatus();
}

void Authenticator::SetChangeListener(std::function<void()> listener) {
  absl::MutexLock lock(&listener_mu_);
  listener_ = std::move(listener);
}

TenantQuota Authenticator::QuotaOf(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  for (const TokenEntry& entry : entries_) {
    if (entry.tenant.name == name) return entry.tenant.quota;
  }
  return TenantQuota{};
}

std::vector<std::string> Authenticator::tenant_names() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> names;
  names.reserve(entries_.size());
  for (const TokenEntry& entry : entries_) names.push_back(entry.tenant.name);
  return names;
}

void Authenticator::WatcherMain() {
  while (true) {
    struct stat loaded = {};
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_),
                           options_.reload_interval);
      if (stopping_) return;
      loaded = file_;
    }
    // Outside mu_, which every call's authentication takes: a tokens file
    // on a mount that hangs must not hold those up. A file gone (deleted,
    // or a mount swapping it) is read too, so that its failure is logged,
    // once until the file changes.
    struct stat info = {};
    if (stat(options_.tokens_file.c_str(), &info) == 0 &&
        SameFile(info, loaded)) {
      continue;
    }
    Reload().IgnoreError();  // logged; the previous tenants stay in force
  }
}

}  // namespace attention::server
