#include "core/session.h"

#include <utility>

namespace attention {
namespace {

std::vector<LayerKvCache> EmptyLayers(
    const SessionSpec& spec, const KvBlockLayout& layout, BlockPool* pool,
    const std::shared_ptr<TenantUsage>& usage) {
  std::vector<LayerKvCache> layers;
  layers.reserve(spec.num_layers);
  for (const LayerSpec& layer : spec.layers) {
    layers.emplace_back(pool,
                        LayerLayout(spec, layer, layout, pool->block_bytes()),
                        layer, usage);
  }
  return layers;
}

int64_t SpecMetadataBytes(const SessionSpec& spec) {
  int64_t bytes = sizeof(SessionSpec) + static_cast<int64_t>(spec.model.size());
  for (const LayerSpec& layer : spec.layers) {
    bytes += sizeof(LayerSpec) +
             static_cast<int64_t>(layer.sink_logits.size() * sizeof(float));
  }
  return bytes;
}

}  // namespace

KvBlockLayout LayerLayout(const SessionSpec& spec, const LayerSpec& layer,
                          const KvBlockLayout& dense, int64_t block_bytes) {
  if (layer.topk <= 0) return dense;
  KvBlockLayout layout = dense;
  layout.index_dim = spec.index_dim;
  layout.tokens_per_block = block_bytes / layout.bytes_per_token();
  return layout;
}

int64_t SessionMetadataBytes(const SessionSpec& spec) {
  return static_cast<int64_t>(sizeof(Session)) + SpecMetadataBytes(spec) +
         spec.num_layers * static_cast<int64_t>(sizeof(LayerKvCache));
}

Session::Session(std::string id, SessionSpec spec, const KvBlockLayout& layout,
                 BlockPool* pool, absl::Duration idle_timeout, absl::Time now,
                 std::shared_ptr<TenantUsage> usage)
    : Session(std::move(id), spec, layout, pool, idle_timeout, now, usage,
              EmptyLayers(spec, layout, pool, usage)) {}

Session::Session(std::string id, SessionSpec spec, const KvBlockLayout& layout,
                 BlockPool* pool, absl::Duration idle_timeout, absl::Time now,
                 std::shared_ptr<TenantUsage> usage,
                 std::vector<LayerKvCache> layers, int64_t copied_table_bytes)
    : id_(std::move(id)),
      usage_(std::move(usage)),
      spec_(std::move(spec)),
      layout_(layout),
      pool_(pool),
      idle_timeout_(idle_timeout),
      metadata_bytes_(SessionMetadataBytes(spec_) + copied_table_bytes),
      last_used_ns_(absl::ToUnixNanos(now)),
      layers_(std::move(layers)) {}

std::unique_ptr<Session> Session::FromLayers(
    std::string id, SessionSpec spec, const KvBlockLayout& layout,
    BlockPool* pool, absl::Duration idle_timeout, absl::Time last_used,
    std::shared_ptr<TenantUsage> usage, std::vector<LayerKvCache> layers) {
  // Its tables may cover positions no block backs (a restored window
  // layer's dropped rows): metadata, as a fork's copied tables are.
  int64_t table_bytes = 0;
  for (const LayerKvCache& layer : layers) table_bytes += layer.table_bytes();
  return std::unique_ptr<Session>(
      new Session(std::move(id), std::move(spec), layout, pool, idle_timeout,
                  last_used, std::move(usage), std::move(layers), table_bytes));
}

std::unique_ptr<Session> Session::Fork(std::string id, absl::Time now) const {
  std::vector<LayerKvCache> layers;
  layers.reserve(layers_.size());
  int64_t table_bytes = 0;
  for (const LayerKvCache& layer : layers_) {
    layers.push_back(layer.Fork());
    table_bytes += layer.table_bytes();
  }
  return std::unique_ptr<Session>(new Session(std::move(id), spec_, layout_,
                                              pool_, idle_timeout_, now, usage_,
                                              std::move(layers), table_bytes));
}

SessionInfo Session::Info() const {
  SessionInfo info;
  info.session_id = id_;
  info.owner = owner();
  info.spec = spec_;
  absl::MutexLock lock(&mu_);
  int64_t blocks = 0;
  for (const LayerKvCache& layer : layers_) {
    info.layer_lengths.push_back(layer.length());
    blocks += layer.referenced_blocks();
  }
  info.kv_cache_bytes = blocks * pool_->block_bytes();
  info.metadata_bytes = metadata_bytes_;
  return info;
}

void Session::Touch(absl::Time now) {
  last_used_ns_.store(absl::ToUnixNanos(now), std::memory_order_relaxed);
}

void Session::EndUse(bool used, const std::function<absl::Time()>& clock) {
  // Touch first: a reaper that sees the count drop also sees the new time.
  if (used) Touch(clock());
  users_.fetch_sub(1, std::memory_order_acq_rel);
}

absl::Time Session::last_used() const {
  return absl::FromUnixNanos(last_used_ns_.load(std::memory_order_relaxed));
}

bool Session::Expired(absl::Time now) const {
  if (users_.load(std::memory_order_acquire) > 0) return false;
  const absl::Time last =
      absl::FromUnixNanos(last_used_ns_.load(std::memory_order_relaxed));
  return now - last > idle_timeout_;
}

}  // namespace attention
