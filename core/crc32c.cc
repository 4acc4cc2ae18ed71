#include "core/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace attention {
namespace {

constexpr uint32_t kPolynomial = 0x82f63b78;  // reflected Castagnoli

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc >> 1) ^ ((crc & 1) ? kPolynomial : 0);
    }
    table[i] = crc;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kTable = MakeTable();

uint32_t ExtendPortable(uint32_t crc, const unsigned char* data, size_t size) {
  for (size_t i = 0; i < size; ++i) {
    crc = (crc >> 8) ^ kTable[(crc ^ data[i]) & 0xff];
  }
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t ExtendSse42(
    uint32_t crc, const unsigned char* data, size_t size) {
  uint64_t value = crc;
  while (size >= 8) {
    uint64_t word;
    std::memcpy(&word, data, 8);
    value = _mm_crc32_u64(value, word);
    data += 8;
    size -= 8;
  }
  uint32_t crc32 = static_cast<uint32_t>(value);
  while (size > 0) {
    crc32 = _mm_crc32_u8(crc32, *data++);
    --size;
  }
  return crc32;
}

bool HasSse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (HasSse42()) return ~ExtendSse42(crc, bytes, size);
#endif
  return ~ExtendPortable(crc, bytes, size);
}

}  // namespace attention
