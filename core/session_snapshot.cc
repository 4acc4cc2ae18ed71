#include "core/session_snapshot.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/client_string.h"
#include "core/crc32c.h"

namespace attention {
namespace {

// SessionChunk field numbers of the records (the proto's oneof).
constexpr int64_t kHeaderRecord = 1;
constexpr int64_t kDataRecord = 2;

int64_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// The proto enum value of a dtype (attention.v1.DType).
int64_t DTypeNumber(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 1;
    case DType::kFloat16:
      return 2;
    case DType::kBFloat16:
      return 3;
  }
  return 0;
}

// The proto enum values (attention.v1.KvLayout, attention.v1.IndexScore).
int64_t KvLayoutNumber(KvLayout layout) {
  return layout == KvLayout::kSharedLatent ? 2 : 1;
}
int64_t IndexScoreNumber(IndexScore score) {
  return score == IndexScore::kRelu ? 2 : 1;
}

}  // namespace

absl::Status CheckSnapshotFormatVersion(uint32_t format_version,
                                        absl::string_view server_version) {
  if (format_version == kSnapshotFormatVersion ||
      format_version == kSnapshotFormatVersionLatentTopK) {
    return absl::OkStatus();
  }
  return absl::Status(
      format_version > kSnapshotFormatVersionLatentTopK
          ? absl::StatusCode::kFailedPrecondition
          : absl::StatusCode::kInvalidArgument,
      absl::StrCat(
          "snapshot format version ", format_version,
          " is not supported: this server reads versions ",
          kSnapshotFormatVersion, " and ", kSnapshotFormatVersionLatentTopK,
          " (written by server version ", QuoteClientString(server_version),
          "); import it into a server of that version"));
}

uint32_t SnapshotFormatFor(const SessionSpec& spec) {
  bool topk = false;
  for (const LayerSpec& layer : spec.layers) topk |= layer.topk > 0;
  return spec.kv_layout == KvLayout::kSharedLatent || topk
             ? kSnapshotFormatVersionLatentTopK
             : kSnapshotFormatVersion;
}

CarriedRanges CarriedPositions(int64_t length, int32_t num_sink_tokens,
                               int64_t first_position) {
  CarriedRanges ranges;
  ranges.length = length;
  ranges.sink_end = std::min<int64_t>(num_sink_tokens, length);
  ranges.window_start =
      std::clamp<int64_t>(first_position, ranges.sink_end, length);
  return ranges;
}

bool SeekCarriedRow(const SnapshotHeader& header, int* layer, int64_t* position,
                    int64_t* range_end) {
  for (; *layer < header.spec.num_layers; ++*layer, *position = 0) {
    const CarriedRanges ranges =
        CarriedPositions(header.layer_lengths[*layer],
                         header.spec.layers[*layer].num_sink_tokens,
                         header.first_positions[*layer]);
    if (*position < ranges.sink_end) {
      *range_end = ranges.sink_end;
      return true;
    }
    *position = std::max(*position, ranges.window_start);
    if (*position < ranges.length) {
      *range_end = ranges.length;
      return true;
    }
  }
  return false;
}

void SnapshotChecksum::AddInt(int64_t value) {
  unsigned char bytes[8];
  for (int i = 0; i < 8; ++i) {
    bytes[i] =
        static_cast<unsigned char>(static_cast<uint64_t>(value) >> (8 * i));
  }
  crc_ = Crc32cExtend(crc_, bytes, sizeof(bytes));
}

void SnapshotChecksum::AddBytes(absl::string_view bytes) {
  AddInt(static_cast<int64_t>(bytes.size()));
  crc_ = Crc32cExtend(crc_, bytes.data(), bytes.size());
}

void SnapshotChecksum::AddHeader(const SnapshotHeader& header) {
  format_version_ = header.format_version;
  // Version 2 encodes the fields version 1 does not know (see the proto).
  const bool v2 = format_version_ >= kSnapshotFormatVersionLatentTopK;
  AddInt(kHeaderRecord);
  AddInt(header.format_version);
  AddBytes(header.session_id);
  const SessionSpec& spec = header.spec;
  AddInt(spec.num_layers);
  AddInt(spec.num_q_heads);
  AddInt(spec.num_kv_heads);
  AddInt(spec.head_dim);
  AddInt(spec.value_dim);
  AddInt(DTypeNumber(spec.kv_dtype));
  AddInt(FloatBits(spec.scale));
  AddInt(static_cast<int64_t>(spec.layers.size()));
  for (const LayerSpec& layer : spec.layers) {
    AddInt(layer.window);
    AddInt(layer.num_sink_tokens);
    AddInt(static_cast<int64_t>(layer.sink_logits.size()));
    for (float logit : layer.sink_logits) AddInt(FloatBits(logit));
    if (v2) {
      AddInt(layer.topk);
      AddInt(IndexScoreNumber(layer.index_score));
    }
  }
  AddInt(spec.max_tokens);
  AddBytes(spec.model);
  if (v2) {
    AddInt(KvLayoutNumber(spec.kv_layout));
    AddInt(spec.index_dim);
    AddInt(spec.index_heads);
  }
  AddInt(static_cast<int64_t>(header.layer_lengths.size()));
  for (int64_t length : header.layer_lengths) AddInt(length);
  AddInt(static_cast<int64_t>(header.first_positions.size()));
  for (int64_t first : header.first_positions) AddInt(first);
  AddInt(DTypeNumber(header.kv_dtype));
  AddBytes(header.server_version);
  AddInt(header.idle_timeout_ms);
  AddInt(header.idle_deadline_unix_ms);
  AddInt(header.kv_bytes);
  AddBytes(header.owner);
}

void SnapshotChecksum::AddChunk(const SnapshotChunk& chunk) {
  AddInt(kDataRecord);
  AddInt(chunk.layer);
  AddInt(chunk.start);
  AddInt(chunk.num_tokens);
  AddBytes(chunk.k);
  AddBytes(chunk.v);
  if (format_version_ >= kSnapshotFormatVersionLatentTopK) {
    AddBytes(chunk.index_k);
  }
}

}  // namespace attention
