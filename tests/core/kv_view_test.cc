#include "core/kv_view.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace attention {
namespace {

float ReadFloat(const std::byte* p) {
  float x;
  std::memcpy(&x, p, 4);
  return x;
}

TEST(KvViewTest, ContiguousViewAddressesTokenHeadRows) {
  // k [T_k=3, H_kv=2, head_dim=4], v [3, 2, value_dim=5], value = index.
  std::vector<float> k(24), v(30);
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 100.0f + i;
  const TensorView k_view = FloatView(k, {3, 2, 4});
  const TensorView v_view = FloatView(v, {3, 2, 5});
  const std::byte* storage[2];
  const KvView view = ContiguousKvView(k_view, v_view, storage);
  EXPECT_EQ(view.length, 3);
  EXPECT_EQ(view.num_kv_heads, 2);
  EXPECT_EQ(view.head_dim, 4);
  EXPECT_EQ(view.value_dim, 5);
  for (int64_t pos = 0; pos < 3; ++pos) {
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(ReadFloat(view.key(pos, h)), (pos * 2 + h) * 4);
      EXPECT_EQ(ReadFloat(view.value(pos, h)), 100.0f + (pos * 2 + h) * 5);
    }
  }
}

TEST(KvViewTest, PagedViewFollowsTheBlockLayout) {
  KvBlockLayout layout;
  layout.dtype = DType::kFloat16;
  layout.num_kv_heads = 2;
  layout.head_dim = 4;
  layout.value_dim = 3;
  layout.tokens_per_block = 5;
  EXPECT_EQ(layout.bytes_per_token(), 2 * (4 + 3) * 2);
  EXPECT_EQ(layout.used_bytes(), 5 * 28);
  EXPECT_EQ(layout.value_offset_bytes(), 2 * 5 * 4 * 2);

  std::vector<std::byte> a(layout.used_bytes()), b(layout.used_bytes());
  const std::vector<const std::byte*> k_blocks = {a.data(), b.data()};
  const std::vector<const std::byte*> v_blocks = {
      a.data() + layout.value_offset_bytes(),
      b.data() + layout.value_offset_bytes()};
  const KvView view = PagedKvView(layout, 8, k_blocks, v_blocks);
  EXPECT_EQ(view.length, 8);
  EXPECT_EQ(view.dtype, DType::kFloat16);
  // Position 7 = block 1, row 2; head 1 starts after head 0's 5 rows.
  EXPECT_EQ(view.key(7, 1), b.data() + ((1 * 5 + 2) * 4) * 2);
  EXPECT_EQ(view.value(7, 1),
            b.data() + layout.value_offset_bytes() + ((1 * 5 + 2) * 3) * 2);
  EXPECT_EQ(view.key(0, 0), a.data());
}

}  // namespace
}  // namespace attention
