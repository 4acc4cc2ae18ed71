#include "core/session_export.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/session_busy.h"
#include "core/status_macros.h"

namespace attention {

absl::StatusOr<std::unique_ptr<SessionExport>> SessionExport::Start(
    AttentionBackend* backend, Session& session,
    absl::string_view server_version, absl::Time now, bool sealed,
    absl::Time wait_until) {
  const SessionSpec& spec = session.spec();
  if (wait_until == absl::InfiniteFuture()) {
    session.mu().Lock();
  } else {
    // A timed wait: LockWhenWithDeadline would still wait for the lock.
    while (!session.mu().TryLock()) {
      if (absl::Now() >= wait_until) return SessionBusyError(session.id());
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  std::vector<LayerKvCache> layers;
  layers.reserve(spec.num_layers);
  for (int i = 0; i < spec.num_layers; ++i) {
    layers.push_back(session.layer(i).Fork());
  }
  session.mu().Unlock();
  SnapshotHeader header;
  header.session_id = session.id();
  header.owner = session.owner();
  header.format_version = SnapshotFormatFor(spec);
  header.spec = spec;
  header.kv_dtype = spec.kv_dtype;
  header.server_version = std::string(server_version);
  header.idle_timeout_ms = absl::ToInt64Milliseconds(session.idle_timeout());
  const absl::Time idle_since = sealed || session.in_use()
                                    ? std::max(session.last_used(), now)
                                    : session.last_used();
  header.idle_deadline_unix_ms =
      absl::ToUnixMillis(idle_since + session.idle_timeout());
  for (int i = 0; i < spec.num_layers; ++i) {
    const int64_t length = layers[i].length();
    const int64_t first = layers[i].FirstHeldPosition();
    header.layer_lengths.push_back(length);
    header.first_positions.push_back(first);
    // Per layer: a top-k layer's rows also hold its index key.
    header.kv_bytes +=
        CarriedPositions(length, spec.layers[i].num_sink_tokens, first)
            .tokens() *
        layers[i].layout().bytes_per_token();
  }
  return std::unique_ptr<SessionExport>(
      new SessionExport(backend, std::move(layers), std::move(header)));
}

SessionExport::SessionExport(AttentionBackend* backend,
                             std::vector<LayerKvCache> layers,
                             SnapshotHeader header)
    : backend_(backend),
      layers_(std::move(layers)),
      header_(std::move(header)) {
  checksum_.AddHeader(header_);
}

absl::StatusOr<bool> SessionExport::NextChunk(SnapshotChunk* chunk,
                                              int64_t target_bytes) {
  int64_t range_end = 0;
  if (!SeekCarriedRow(header_, &layer_, &position_, &range_end)) return false;
  const LayerKvCache& layer = layers_[layer_];
  const KvBlockLayout& layout = layer.layout();
  const int64_t token_bytes = layout.bytes_per_token();
  const int64_t count = std::min(
      range_end - position_, std::max<int64_t>(1, target_bytes / token_bytes));

  const int64_t element = DTypeSize(layout.dtype);
  const int64_t heads = layout.num_kv_heads;
  const int64_t k_row = layout.head_dim * element;
  // A shared latent has no value rows (its values are the keys' leading
  // entries); only a top-k layer has index rows.
  const int64_t v_row = layout.shared_values ? 0 : layout.value_dim * element;
  const int64_t index_row = layout.index_dim * element;
  chunk->layer = layer_;
  chunk->start = position_;
  chunk->num_tokens = count;
  chunk->k.resize(static_cast<size_t>(count * heads * k_row));
  chunk->v.resize(static_cast<size_t>(count * heads * v_row));
  chunk->index_k.resize(static_cast<size_t>(count * index_row));

  std::vector<const std::byte*> k_blocks;
  std::vector<const std::byte*> v_blocks;
  const KvView view = layer.view(&k_blocks, &v_blocks);
  const int64_t tpb = layout.tokens_per_block;
  block_.resize(static_cast<size_t>(layout.used_bytes()));
  const int64_t value_offset = layout.value_offset_bytes();
  const int64_t index_offset = layout.index_offset_bytes();
  for (int64_t pos = position_; pos < position_ + count;) {
    const int64_t b = pos / tpb;
    const std::byte* source = view.k_block(b);
    if (source != block_source_) {
      ATTN_RETURN_IF_ERROR(
          backend_->ReadBlock(source, block_.data(), layout.used_bytes()));
      block_source_ = source;
    }
    const int64_t end = std::min((b + 1) * tpb, position_ + count);
    for (; pos < end; ++pos) {
      const int64_t row = pos % tpb;
      const int64_t t = pos - position_;
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(chunk->k.data() + (t * heads + h) * k_row,
                    block_.data() + (h * tpb + row) * k_row, k_row);
        std::memcpy(chunk->v.data() + (t * heads + h) * v_row,
                    block_.data() + value_offset + (h * tpb + row) * v_row,
                    v_row);
      }
      std::memcpy(chunk->index_k.data() + t * index_row,
                  block_.data() + index_offset + row * index_row, index_row);
    }
  }
  position_ += count;
  checksum_.AddChunk(*chunk);
  ++num_chunks_;
  return true;
}

SnapshotTrailer SessionExport::trailer() const {
  SnapshotTrailer trailer;
  trailer.num_chunks = num_chunks_;
  trailer.checksum = checksum_.value();
  return trailer;
}

}  // namespace attention
