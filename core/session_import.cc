#include "core/session_import.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "core/client_string.h"
#include "core/status_macros.h"

namespace attention {
namespace {

// Longest session id a snapshot may keep.
constexpr size_t kMaxSessionIdBytes = 64;

absl::Status Inconsistent(absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("the snapshot header is inconsistent: ", what,
                   "; export the session again from the server that holds it"));
}

absl::Status ValidateSessionId(const std::string& id) {
  const bool well_formed =
      !id.empty() && id.size() <= kMaxSessionIdBytes &&
      std::all_of(id.begin(), id.end(), [](char c) {
        return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' ||
               c == '_';
      });
  if (well_formed) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the snapshot's session id ", QuoteClientString(id),
      " cannot be kept: ids are 1 to 64 letters, digits, '-' or '_'; import "
      "without keep_session_id to get a new id"));
}

// Everything about the header that does not depend on the server's state.
absl::Status ValidateHeader(const SnapshotHeader& header,
                            const SpecLimits& limits) {
  ATTN_RETURN_IF_ERROR(
      CheckSnapshotFormatVersion(header.format_version, header.server_version));
  absl::StatusOr<SessionSpec> resolved =
      ResolveSessionSpec(header.spec, limits);
  if (!resolved.ok()) {
    // A spec a server with a larger --max_session_tokens takes is a valid
    // snapshot this one cannot hold, not a broken one.
    SpecLimits larger = limits;
    larger.max_tokens_limit = std::numeric_limits<int64_t>::max();
    const bool valid_elsewhere = ResolveSessionSpec(header.spec, larger).ok();
    return absl::Status(
        valid_elsewhere ? absl::StatusCode::kFailedPrecondition
                        : absl::StatusCode::kInvalidArgument,
        absl::StrCat("the snapshot's session spec is not accepted by this "
                     "server: ",
                     resolved.status().message(),
                     valid_elsewhere
                         ? "; import it into a server with a larger "
                           "--max_session_tokens"
                         : ""));
  }
  if (!(*resolved == header.spec)) {
    return Inconsistent("its spec is not in resolved form");
  }
  const SessionSpec& spec = header.spec;
  if (header.format_version < SnapshotFormatFor(spec)) {
    return Inconsistent(absl::StrCat(
        "format version ", header.format_version,
        " cannot carry MLA shared-latent or top-k layers (version ",
        SnapshotFormatFor(spec), " does)"));
  }
  if (header.owner.size() > kMaxTenantNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the snapshot's owner ", QuoteClientString(header.owner), " is ",
        header.owner.size(), " bytes; tenant names have at most ",
        kMaxTenantNameBytes, ": export the session again from its server"));
  }
  if (header.kv_dtype != spec.kv_dtype) {
    return Inconsistent(absl::StrCat("kv_dtype ", DTypeName(header.kv_dtype),
                                     " differs from the spec's ",
                                     DTypeName(spec.kv_dtype)));
  }
  if (static_cast<int64_t>(header.layer_lengths.size()) != spec.num_layers ||
      static_cast<int64_t>(header.first_positions.size()) != spec.num_layers) {
    return Inconsistent(
        absl::StrCat("it has ", header.layer_lengths.size(),
                     " layer lengths and ", header.first_positions.size(),
                     " first positions for ", spec.num_layers, " layers"));
  }
  for (int i = 0; i < spec.num_layers; ++i) {
    const int64_t length = header.layer_lengths[i];
    const int64_t first = header.first_positions[i];
    const LayerSpec& layer = spec.layers[i];
    if (length < 0 || length > spec.max_tokens) {
      return Inconsistent(
          absl::StrCat("layer ", i, " has length ", length,
                       ", outside [0, max_tokens = ", spec.max_tokens, "]"));
    }
    // A window layer must carry every row a later query can see.
    const int64_t last_needed =
        layer.window > 0 ? std::max<int64_t>(0, length - layer.window + 1) : 0;
    if (first < 0 || first > last_needed) {
      return Inconsistent(absl::StrCat(
          "layer ", i, " (window ", layer.window, ", length ", length,
          ") has first position ", first, "; it must be in [0, ", last_needed,
          "] so that every row a later query sees is carried"));
    }
  }
  if (header.idle_timeout_ms < 0) {
    return Inconsistent(
        absl::StrCat("idle_timeout_ms is ", header.idle_timeout_ms));
  }
  return absl::OkStatus();
}

// The rows `bytes` hold as a tensor of `shape` in `dtype`; its size_bytes
// is what the shape takes (the caller compares it with bytes.size()).
TensorView RowsView(DType dtype, Shape shape, const std::string& bytes) {
  const int64_t size = NumElements(shape) * DTypeSize(dtype);
  return TensorView{.dtype = dtype,
                    .shape = std::move(shape),
                    .data = reinterpret_cast<const std::byte*>(bytes.data()),
                    .size_bytes = size};
}

// The write of data chunk `index` (of layer `layer`, whose blocks have
// `layout`) with its k, v (none for a shared latent: its values are k's
// leading entries) and index_k (top-k layers only) rows; blocks are left
// to the caller. INVALID_ARGUMENT when the chunk holds several rows over
// kSnapshotChunkMaxBytes, its byte counts differ from what its rows take,
// or it holds a value that is not finite.
absl::StatusOr<KvWrite> ChunkWrite(const SnapshotChunk& chunk,
                                   const KvBlockLayout& layout, int64_t index,
                                   int layer) {
  const int64_t n = chunk.num_tokens;
  const int64_t heads = layout.num_kv_heads;
  KvWrite write;
  write.layout = layout;
  write.start = chunk.start;
  write.k = RowsView(layout.dtype, {n, heads, layout.head_dim}, chunk.k);
  if (!layout.shared_values) {
    write.v = RowsView(layout.dtype, {n, heads, layout.value_dim}, chunk.v);
  }
  if (layout.index_dim > 0) {
    write.index_k =
        RowsView(layout.dtype, {n, layout.index_dim}, chunk.index_k);
  }
  const int64_t k_bytes = write.k.size_bytes;
  const int64_t v_bytes = write.v.size_bytes;
  const int64_t index_bytes = write.index_k.size_bytes;
  // One row is always allowed: a token of a wide spec (with large
  // --kv_block_bytes) may alone hold more than the limit, and its size is
  // bounded by the validated spec.
  if (n > 1 && k_bytes + v_bytes + index_bytes > kSnapshotChunkMaxBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "snapshot data chunk ", index, " holds ", n, " rows in ",
        k_bytes + v_bytes + index_bytes, " bytes, over the limit of ",
        kSnapshotChunkMaxBytes, " per chunk of several rows; split it ",
        "(ExportSession writes about ", kSnapshotChunkTargetBytes, ")"));
  }
  if (static_cast<int64_t>(chunk.k.size()) != k_bytes ||
      static_cast<int64_t>(chunk.v.size()) != v_bytes ||
      static_cast<int64_t>(chunk.index_k.size()) != index_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "snapshot data chunk ", index, " has ", chunk.k.size(), " bytes of k, ",
        chunk.v.size(), " of v and ", chunk.index_k.size(), " of index_k; ", n,
        " rows of layer ", layer, " (", heads, " KV heads in ",
        DTypeName(layout.dtype),
        layout.shared_values ? ", a shared latent without v" : "",
        layout.index_dim > 0 ? ", with index keys" : ", without index keys",
        ") take ", k_bytes, ", ", v_bytes, " and ", index_bytes));
  }
  const int64_t element = DTypeSize(layout.dtype);
  ATTN_RETURN_IF_ERROR(
      CheckFinite(layout.dtype, write.k.data, k_bytes / element, "snapshot k"));
  ATTN_RETURN_IF_ERROR(
      CheckFinite(layout.dtype, write.v.data, v_bytes / element, "snapshot v"));
  ATTN_RETURN_IF_ERROR(CheckFinite(layout.dtype, write.index_k.data,
                                   index_bytes / element, "snapshot index_k"));
  return write;
}

// The spec's block layout in this server's blocks. A token larger than a
// block is a valid snapshot that a server with larger --kv_block_bytes
// takes, not a broken one: FAILED_PRECONDITION.
absl::StatusOr<KvBlockLayout> LayoutHere(const SessionManager& manager,
                                         const SessionSpec& spec) {
  absl::StatusOr<KvBlockLayout> layout = manager.LayoutFor(spec);
  if (layout.ok()) return layout;
  return absl::FailedPreconditionError(layout.status().message());
}

}  // namespace

absl::StatusOr<std::unique_ptr<SessionImport>> SessionImport::Begin(
    SessionManager* manager, BlockPool* pool, AttentionBackend* backend,
    const SnapshotHeader& header, const ImportOptions& options) {
  const SessionManagerOptions& config = manager->options();
  ATTN_RETURN_IF_ERROR(ValidateHeader(header, config.limits));
  // A backend that cannot serve the session (CUDA: MLA, top-k) refuses it
  // as CreateSession would, once the header is known to be well formed (a
  // malformed one is INVALID_ARGUMENT whatever it asks for).
  ATTN_RETURN_IF_ERROR(backend->CheckSessionSpec(header.spec));
  const SessionSpec& spec = header.spec;
  ATTN_ASSIGN_OR_RETURN(const KvBlockLayout layout, LayoutHere(*manager, spec));

  // Each layer's block layout: a top-k layer's rows also hold index keys.
  std::vector<KvBlockLayout> layer_layouts;
  int64_t tokens = 0;
  int64_t blocks = 0;
  int64_t kv_bytes = 0;
  int64_t table_entries = 0;  // one per block of each layer's length
  for (int i = 0; i < spec.num_layers; ++i) {
    layer_layouts.push_back(
        LayerLayout(spec, spec.layers[i], layout, pool->block_bytes()));
    const int64_t per_block = layer_layouts[i].tokens_per_block;
    table_entries += (header.layer_lengths[i] + per_block - 1) / per_block;
    const int64_t carried = CarriedPositions(header.layer_lengths[i],
                                             spec.layers[i].num_sink_tokens,
                                             header.first_positions[i])
                                .tokens();
    tokens += carried;
    kv_bytes += carried * layer_layouts[i].bytes_per_token();
    blocks += LayerKvCache::RestoreBlocks(layer_layouts[i], spec.layers[i],
                                          header.layer_lengths[i],
                                          header.first_positions[i]);
  }
  if (header.kv_bytes != kv_bytes) {
    return Inconsistent(absl::StrCat("kv_bytes is ", header.kv_bytes,
                                     " but its layers carry ", tokens,
                                     " rows of ", kv_bytes, " bytes in all"));
  }
  // The id first: a session held here is ALREADY_EXISTS whatever else is
  // short (a hand-over asking again after a lost answer counts on it).
  std::string id;
  std::optional<ImportIdClaim> id_claim;
  if (options.keep_session_id) {
    ATTN_RETURN_IF_ERROR(ValidateSessionId(header.session_id));
    ATTN_ASSIGN_OR_RETURN(
        ImportIdClaim claim,
        manager->ClaimImportId(header.session_id, options.control));
    id_claim.emplace(std::move(claim));
    if (manager->Contains(header.session_id)) {
      return absl::AlreadyExistsError(absl::StrCat(
          "a session with id ", QuoteClientString(header.session_id),
          " already exists on this server; import without keep_session_id "
          "to get a new id, or delete the existing session first"));
    }
    id = header.session_id;
  } else {
    id = manager->NewSessionId();
  }

  // The block tables cover every position, carried or not (a window
  // layer's dropped rows too): session metadata, set aside before they are
  // built, with the pointers to the blocks the import fills.
  ATTN_ASSIGN_OR_RETURN(
      MetadataReservation metadata,
      manager->ReserveMetadata(
          SessionMetadataBytes(spec) +
          table_entries * (kBlockTableEntryBytes + sizeof(std::byte*))));

  // Admission from the header's sizes, before any data arrives: the
  // owner's quotas first, then the pool.
  Tenant tenant = options.tenant;
  if (options.keep_owner) {
    tenant.name = header.owner.empty() ? kDefaultTenantName : header.owner;
    tenant.quota =
        options.owner_quota ? options.owner_quota(tenant.name) : TenantQuota{};
  }
  std::shared_ptr<TenantUsage> usage = manager->UsageOf(tenant.name);
  if (tenant.quota.max_sessions.has_value() &&
      usage->stats().sessions >= *tenant.quota.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant ", QuoteClientString(tenant.name),
        " is at its quota max_sessions: usage ", usage->stats().sessions,
        " sessions, limit ", *tenant.quota.max_sessions,
        "; delete sessions of the tenant before importing"));
  }
  // Held until the layers take their blocks (each layer's move from it to
  // the tenant's usage in one step), so that concurrent appends of the
  // tenant can neither pass max_kv_bytes with it nor see them counted twice.
  ATTN_RETURN_IF_ERROR(usage->Reserve(blocks, tenant.quota));
  BlockReservation reservation(usage.get(), blocks);
  const BlockPoolStats stats = pool->stats();
  const int64_t free_blocks = stats.blocks_total - stats.blocks_used;
  if (blocks > free_blocks) {
    return absl::ResourceExhaustedError(
        absl::StrCat("importing this session needs ", blocks, " KV blocks (",
                     blocks * stats.block_bytes, " bytes for ", header.kv_bytes,
                     " bytes of K/V) but the pool has ", free_blocks,
                     " free of ", stats.blocks_total,
                     "; delete sessions, or import into a server with a larger "
                     "--kv_cache_bytes"));
  }
  std::vector<LayerKvCache> layers;
  layers.reserve(spec.num_layers);
  for (int i = 0; i < spec.num_layers; ++i) {
    // A concurrent allocation can still take the blocks: the staged layers
    // are then released with `layers`.
    ATTN_ASSIGN_OR_RETURN(
        LayerKvCache layer,
        LayerKvCache::Restore(pool, layer_layouts[i], spec.layers[i],
                              header.layer_lengths[i],
                              header.first_positions[i], usage, &reservation));
    layers.push_back(std::move(layer));
  }

  absl::Duration idle_timeout = absl::Milliseconds(header.idle_timeout_ms);
  if (idle_timeout == absl::ZeroDuration()) {
    idle_timeout = config.default_idle_timeout;
  }
  idle_timeout = std::min(idle_timeout, config.max_idle_timeout);
  // A kept deadline is never later than a fresh one: the session was last
  // used before now (a far-future deadline would never expire).
  const absl::Time now = config.now();
  const absl::Time last_used =
      options.keep_idle_deadline
          ? std::min(now, absl::FromUnixMillis(header.idle_deadline_unix_ms) -
                              idle_timeout)
          : now;
  auto import = std::unique_ptr<SessionImport>(new SessionImport(
      manager, pool, backend, header, layout, std::move(id), idle_timeout,
      last_used, std::move(tenant), std::move(usage), std::move(metadata),
      std::move(layers), std::move(id_claim)));
  import->remaining_tokens_ = tokens;
  import->Advance();
  return import;
}

SessionImport::SessionImport(SessionManager* manager, BlockPool* pool,
                             AttentionBackend* backend, SnapshotHeader header,
                             KvBlockLayout layout, std::string id,
                             absl::Duration idle_timeout, absl::Time last_used,
                             Tenant tenant, std::shared_ptr<TenantUsage> usage,
                             MetadataReservation metadata,
                             std::vector<LayerKvCache> layers,
                             std::optional<ImportIdClaim> id_claim)
    : id_claim_(std::move(id_claim)),
      manager_(manager),
      pool_(pool),
      backend_(backend),
      header_(std::move(header)),
      layout_(layout),
      id_(std::move(id)),
      idle_timeout_(idle_timeout),
      last_used_(last_used),
      tenant_(std::move(tenant)),
      usage_(std::move(usage)),
      metadata_(std::move(metadata)),
      layers_(std::move(layers)) {
  checksum_.AddHeader(header_);
  for (const LayerKvCache& layer : layers_) {
    blocks_.push_back(layer.restore_blocks());
  }
}

void SessionImport::Advance() {
  SeekCarriedRow(header_, &layer_, &position_, &range_end_);
}

absl::Status SessionImport::AddChunk(const SnapshotChunk& chunk) {
  if (finished_) {
    return absl::FailedPreconditionError("the import has already finished");
  }
  if (layer_ >= header_.spec.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("the snapshot has a data chunk (layer ", chunk.layer,
                     ", position ", chunk.start,
                     ") after every row its header announces; the next "
                     "record must be the trailer"));
  }
  if (chunk.layer != layer_ || chunk.start != position_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "snapshot data chunk ", num_chunks_,
        " is out of order: it starts at "
        "layer ",
        chunk.layer, " position ", chunk.start,
        " but the next row expected is layer ", layer_, " position ", position_,
        "; send the chunks in the order ExportSession wrote "
        "them"));
  }
  if (chunk.num_tokens < 1 || chunk.num_tokens > range_end_ - position_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "snapshot data chunk ", num_chunks_, " has ", chunk.num_tokens,
        " rows from position ", position_, " of layer ", layer_,
        ", but the carried range there ends at ", range_end_));
  }
  const KvBlockLayout& layout = layers_[layer_].layout();
  ATTN_ASSIGN_OR_RETURN(KvWrite write,
                        ChunkWrite(chunk, layout, num_chunks_, layer_));
  const LayerKvCache::ListedBlocks& listed = blocks_[layer_];
  write.blocks = listed.blocks;
  write.gap_begin = listed.gap_begin;
  write.gap_blocks = listed.gap_blocks;
  ATTN_RETURN_IF_ERROR(backend_->WriteKv(write));
  checksum_.AddChunk(chunk);
  ++num_chunks_;
  remaining_tokens_ -= chunk.num_tokens;
  position_ += chunk.num_tokens;
  Advance();
  return absl::OkStatus();
}

absl::StatusOr<SessionInfo> SessionImport::Finish(
    const SnapshotTrailer& trailer) {
  if (finished_) {
    return absl::FailedPreconditionError("the import has already finished");
  }
  finished_ = true;
  if (layer_ < header_.spec.num_layers) {
    return absl::DataLossError(absl::StrCat(
        "the snapshot is truncated: its trailer came after ", num_chunks_,
        " data chunks, but layer ", layer_, " still lacks rows from position ",
        position_, " (", remaining_tokens_,
        " rows missing in all); export the session again"));
  }
  if (trailer.num_chunks != num_chunks_) {
    return absl::DataLossError(absl::StrCat(
        "the snapshot trailer counts ", trailer.num_chunks, " data chunks but ",
        num_chunks_,
        " arrived; the stream or file is damaged, export the session again"));
  }
  if (trailer.checksum != checksum_.value()) {
    return absl::DataLossError(absl::StrCat(
        "the snapshot is corrupted: its checksum is ", trailer.checksum,
        " but its records give ", checksum_.value(),
        "; the stream or file is damaged, export the session again"));
  }
  for (LayerKvCache& layer : layers_) layer.CompleteRestore();
  std::shared_ptr<Session> session =
      Session::FromLayers(id_, header_.spec, layout_, pool_, idle_timeout_,
                          last_used_, usage_, std::move(layers_));
  ATTN_RETURN_IF_ERROR(
      manager_->Adopt(session, tenant_.quota, std::move(metadata_)));
  id_claim_.reset();  // an import of the id waiting now finds the session
  return session->Info();
}

}  // namespace attention
