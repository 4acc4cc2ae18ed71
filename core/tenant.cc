#include "core/tenant.h"

namespace attention {

const Tenant& DefaultTenant() {
  static const Tenant* const tenant = new Tenant{kDefaultTenantName, {}};
  return *tenant;
}

}  // namespace attention
