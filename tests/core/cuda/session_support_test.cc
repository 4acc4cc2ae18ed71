#include "core/cuda/session_support.h"

#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

// MLA shared-latent sessions and top-k layers are CPU-only for now: the
// CUDA backend refuses them before any session exists (runs everywhere).
TEST(CudaServesSessionSpecTest, RefusesLatentAndTopKServesTheRest) {
  SessionSpec dense;
  dense.num_layers = 2;
  dense.num_q_heads = 4;
  dense.num_kv_heads = 2;
  dense.head_dim = 16;
  EXPECT_TRUE(CudaServesSessionSpec(dense).ok());

  SessionSpec latent = dense;
  latent.num_kv_heads = 1;
  latent.kv_layout = KvLayout::kSharedLatent;
  const absl::Status refused = CudaServesSessionSpec(latent);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("latent"), std::string::npos) << refused;

  SessionSpec sparse = dense;
  sparse.index_dim = 8;
  sparse.index_heads = 2;
  sparse.layers.resize(2);
  sparse.layers[1].topk = 4;
  const absl::Status refused_topk = CudaServesSessionSpec(sparse);
  EXPECT_EQ(refused_topk.code(), absl::StatusCode::kFailedPrecondition)
      << refused_topk;
  EXPECT_NE(refused_topk.message().find("top-k"), std::string::npos)
      << refused_topk;
}

}  // namespace
}  // namespace attention
