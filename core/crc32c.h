// CRC-32C (Castagnoli), the checksum of session snapshots.
//
// Uses the SSE4.2 crc32 instruction when the CPU has it (chosen at run
// time, several GB/s) and a table otherwise; both give the same value.
#ifndef ATTENTION_CORE_CRC32C_H_
#define ATTENTION_CORE_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace attention {

// Extends `crc` (the value of the bytes so far; 0 for none) with `size`
// bytes at `data`. Crc32cExtend(0, "123456789", 9) == 0xe3069283.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

}  // namespace attention

#endif  // ATTENTION_CORE_CRC32C_H_
