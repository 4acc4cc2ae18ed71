#include "core/session.h"

#include <utility>

namespace attention {
namespace {

std::vector<LayerKvCache> EmptyLayers(const SessionSpec& spec,
                                      const KvBlockLayout& layout,
                                      BlockPool* pool, TenantUsage* usage) {
  std::vector<LayerKvCache> layers;
  layers.reserve(spec.num_layers);
  for (const LayerSpec& layer : spec.layers) {
    layers.emplace_back(pool, layout, layer, usage);
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

int64_t SessionMetadataBytes(const SessionSpec& spec) {
  return static_cast<int64_t>(sizeof(Session)) + SpecMetadataBytes(spec) +
         spec.num_layers * static_cast<int64_t>(sizeof(LayerKvCache));
}

Session::Session(std::string id, SessionSpec spec, const KvBlockLayout& layout,
                 BlockPool* pool, absl::Duration idle_timeout, absl::Time now,
                 std::shared_ptr<TenantUsage> usage)
    : Session(std::move(id), spec, layout, pool, idle_timeout, now, usage,
              EmptyLayers(spec, layout, pool, usage.get())) {}

Session::Session(std::string id, SessionSpec spec, const KvBlockLayout& layout,
                 BlockPool* pool, absl::Duration idle_timeout, absl::Time now,
                 std::shared_ptr<TenantUsage> usage,
                 std::vector<LayerKvCache> layers)
    : id_(std::move(id)),
      usage_(std::move(usage)),
      spec_(std::move(spec)),
      layout_(layout),
      pool_(pool),
      idle_timeout_(idle_timeout),
      metadata_bytes_(SessionMetadataBytes(spec_)),
      last_used_ns_(absl::ToUnixNanos(now)),
      layers_(std::move(layers)) {}

std::unique_ptr<Session> Session::Fork(std::string id, absl::Time now) const {
  std::vector<LayerKvCache> layers;
  layers.reserve(layers_.size());
  for (const LayerKvCache& layer : layers_) layers.push_back(layer.Fork());
  return std::unique_ptr<Session>(new Session(std::move(id), spec_, layout_,
                                              pool_, idle_timeout_, now, usage_,
                                              std::move(layers)));
}

SessionInfo Session::Info() const {
  SessionInfo info;
  info.session_id = id_;
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

void Session::EndUse(absl::Time now) {
  // Touch first: a reaper that sees the count drop also sees the new time.
  Touch(now);
  users_.fetch_sub(1, std::memory_order_acq_rel);
}

bool Session::Expired(absl::Time now) const {
  if (users_.load(std::memory_order_acquire) > 0) return false;
  const absl::Time last =
      absl::FromUnixNanos(last_used_ns_.load(std::memory_order_relaxed));
  return now - last > idle_timeout_;
}

}  // namespace attention
