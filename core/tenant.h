// Tenant: who a call acts for. Every session belongs to the tenant that
// created it; calls of one tenant never see another's sessions. A tenant
// carries its quota, which the caller (the server's authenticator) may
// change between calls: each call is checked against the quota it carries.
#ifndef ATTENTION_CORE_TENANT_H_
#define ATTENTION_CORE_TENANT_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace attention {

// Per-tenant limits; nullopt = no limit (the server-wide limits still
// apply).
struct TenantQuota {
  // Most live sessions of the tenant.
  std::optional<int64_t> max_sessions;
  // Most bytes of KV blocks the tenant's sessions reference, a block
  // shared by several of them (forks) counted once.
  std::optional<int64_t> max_kv_bytes;
};

struct Tenant {
  std::string name;
  TenantQuota quota;
};

// The longest tenant name (X.509's bound on a certificate's common name):
// tokens files, client certificates and snapshot owners longer than this
// are refused.
inline constexpr size_t kMaxTenantNameBytes = 64;

// The name of the tenant everything runs as when the server authenticates
// nobody.
inline constexpr char kDefaultTenantName[] = "default";

// The tenant `default`, without quota.
const Tenant& DefaultTenant();

}  // namespace attention

#endif  // ATTENTION_CORE_TENANT_H_
