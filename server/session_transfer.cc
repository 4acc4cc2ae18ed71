#include "server/session_transfer.h"

#include <algorithm>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "core/session_spec.h"
#include "core/status_macros.h"
#include "server/proto_convert.h"
#include "server/reply_size.h"

namespace attention::server {

void SnapshotHeaderToProto(const SnapshotHeader& header,
                           v1::SessionSnapshotHeader* out) {
  out->Clear();
  out->set_format_version(header.format_version);
  out->set_session_id(header.session_id);
  SessionSpecToProto(header.spec, out->mutable_spec());
  out->mutable_layer_lengths()->Add(header.layer_lengths.begin(),
                                    header.layer_lengths.end());
  out->mutable_first_positions()->Add(header.first_positions.begin(),
                                      header.first_positions.end());
  out->set_kv_dtype(DTypeToProto(header.kv_dtype));
  out->set_server_version(header.server_version);
  out->set_idle_timeout_ms(header.idle_timeout_ms);
  out->set_idle_deadline_unix_ms(header.idle_deadline_unix_ms);
  out->set_kv_bytes(header.kv_bytes);
  out->set_owner(header.owner);
}

absl::StatusOr<SnapshotHeader> SnapshotHeaderFromProto(
    const v1::SessionSnapshotHeader& header) {
  // First: a later version's fields may hold values this build does not
  // know, which would otherwise read as a broken snapshot.
  ATTN_RETURN_IF_ERROR(CheckSnapshotFormatVersion(header.format_version(),
                                                  header.server_version()));
  SnapshotHeader out;
  out.format_version = header.format_version();
  out.session_id = header.session_id();
  ATTN_ASSIGN_OR_RETURN(out.spec, SessionSpecFromProto(header.spec()));
  out.layer_lengths.assign(header.layer_lengths().begin(),
                           header.layer_lengths().end());
  out.first_positions.assign(header.first_positions().begin(),
                             header.first_positions().end());
  ATTN_ASSIGN_OR_RETURN(
      out.kv_dtype,
      OptionalDTypeFromProto(header.kv_dtype(), "snapshot header kv_dtype"));
  out.server_version = header.server_version();
  out.idle_timeout_ms = header.idle_timeout_ms();
  out.idle_deadline_unix_ms = header.idle_deadline_unix_ms();
  out.kv_bytes = header.kv_bytes();
  out.owner = header.owner();
  return out;
}

void SwapSnapshotChunkToProto(SnapshotChunk* chunk,
                              v1::SessionSnapshotData* out) {
  out->set_layer(chunk->layer);
  out->set_start(chunk->start);
  out->set_num_tokens(chunk->num_tokens);
  out->mutable_k()->swap(chunk->k);
  out->mutable_v()->swap(chunk->v);
  out->mutable_index_k()->swap(chunk->index_k);
}

void SwapSnapshotChunkFromProto(v1::SessionSnapshotData* data,
                                SnapshotChunk* chunk) {
  chunk->layer = data->layer();
  chunk->start = data->start();
  chunk->num_tokens = data->num_tokens();
  chunk->k.swap(*data->mutable_k());
  chunk->v.swap(*data->mutable_v());
  chunk->index_k.swap(*data->mutable_index_k());
}

void SnapshotTrailerToProto(const SnapshotTrailer& trailer,
                            v1::SessionSnapshotTrailer* out) {
  out->set_num_chunks(trailer.num_chunks);
  out->set_checksum(trailer.checksum);
}

SnapshotTrailer SnapshotTrailerFromProto(
    const v1::SessionSnapshotTrailer& trailer) {
  SnapshotTrailer out;
  out.num_chunks = trailer.num_chunks();
  out.checksum = trailer.checksum();
  return out;
}

namespace {

// A record no stream under `max_message_bytes` can carry: gRPC would
// refuse to send it without naming the flag that sets the limit.
absl::Status CheckRecordSize(const v1::SessionChunk& record,
                             int64_t max_message_bytes) {
  const int64_t bytes = static_cast<int64_t>(record.ByteSizeLong());
  if (bytes <= max_message_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      record.has_data()
          ? absl::StrCat("one token's rows of layer ", record.data().layer())
          : std::string("the session's header (its spec, every layer "
                        "spelled out)"),
      " take ", bytes,
      " bytes in an export record, over the server's message limit of ",
      max_message_bytes,
      " bytes (--max_message_bytes; the session was restored from a "
      "snapshot saved under a larger one); nothing was changed. Export it "
      "from a server with a limit of at least that size"));
}

}  // namespace

absl::StatusOr<int64_t> WriteSessionExport(
    SessionExport& session_export,
    const std::function<absl::Status(v1::SessionChunk&)>& write,
    int64_t max_message_bytes) {
  const int64_t chunk_bytes =
      std::min(kSnapshotChunkTargetBytes, max_message_bytes / 2);
  v1::SessionChunk record;
  SnapshotHeaderToProto(session_export.header(), record.mutable_header());
  ATTN_RETURN_IF_ERROR(CheckRecordSize(record, max_message_bytes));
  ATTN_RETURN_IF_ERROR(write(record));
  SnapshotChunk chunk;
  while (true) {
    ATTN_ASSIGN_OR_RETURN(const bool more,
                          session_export.NextChunk(&chunk, chunk_bytes));
    if (!more) break;
    v1::SessionSnapshotData* data = record.mutable_data();
    SwapSnapshotChunkToProto(&chunk, data);
    ATTN_RETURN_IF_ERROR(CheckRecordSize(record, max_message_bytes));
    ATTN_RETURN_IF_ERROR(write(record));
    // Take the buffers back for the next chunk.
    chunk.k.swap(*data->mutable_k());
    chunk.v.swap(*data->mutable_v());
    chunk.index_k.swap(*data->mutable_index_k());
  }
  SnapshotTrailerToProto(session_export.trailer(), record.mutable_trailer());
  ATTN_RETURN_IF_ERROR(write(record));
  return session_export.header().kv_bytes;
}

namespace {

absl::Status Truncated(absl::string_view what) {
  return absl::DataLossError(absl::StrCat(
      "the snapshot stream ended ", what,
      "; it is truncated or damaged: export the session again and send it "
      "whole"));
}

// Reads one snapshot's records from `read` in their order: the header
// record to `on_header`, each data record's chunk to `on_chunk`; returns
// the trailer. The stream must end right after it.
absl::StatusOr<SnapshotTrailer> WalkSnapshotRecords(
    const std::function<absl::StatusOr<bool>(v1::SessionChunk*)>& read,
    absl::FunctionRef<absl::Status(const v1::SessionChunk&)> on_header,
    absl::FunctionRef<absl::Status(const SnapshotChunk&)> on_chunk) {
  v1::SessionChunk record;
  ATTN_ASSIGN_OR_RETURN(bool more, read(&record));
  if (!more) return Truncated("before its header");
  if (!record.has_header()) {
    return absl::InvalidArgumentError(
        "the first record of a snapshot stream must be its header; send the "
        "records in the order ExportSession wrote them");
  }
  ATTN_RETURN_IF_ERROR(on_header(record));
  SnapshotChunk chunk;
  while (true) {
    ATTN_ASSIGN_OR_RETURN(more, read(&record));
    if (!more) return Truncated("before its trailer");
    if (record.has_trailer()) break;
    if (!record.has_data()) {
      return absl::InvalidArgumentError(
          "a snapshot stream has exactly one header, first; this record is "
          "another header or empty");
    }
    SwapSnapshotChunkFromProto(record.mutable_data(), &chunk);
    ATTN_RETURN_IF_ERROR(on_chunk(chunk));
  }
  const SnapshotTrailer trailer = SnapshotTrailerFromProto(record.trailer());
  ATTN_ASSIGN_OR_RETURN(more, read(&record));
  if (more) {
    return absl::InvalidArgumentError(
        "a snapshot stream ends with its trailer; a record follows it");
  }
  return trailer;
}

}  // namespace

absl::StatusOr<ReadImport> ReadSessionImport(
    AttentionEngine& engine, ImportOptions options, KeepSessionId keep,
    int64_t max_message_bytes,
    const std::function<absl::StatusOr<bool>(v1::SessionChunk*)>& read,
    const std::function<absl::Status()>& admit) {
  ReadImport result;
  const auto begin = [&](const v1::SessionChunk& record) -> absl::Status {
    if (record.keep_session_id()) {
      if (keep == KeepSessionId::kRefused) {
        return absl::PermissionDeniedError(
            "keep_session_id is refused on a server that authenticates "
            "tenants: session ids are shared by all its tenants, so keeping "
            "one would tell whether another tenant's session has it; import "
            "without keep_session_id to get a new id");
      }
      options.keep_session_id = true;
    }
    ATTN_ASSIGN_OR_RETURN(const SnapshotHeader header,
                          SnapshotHeaderFromProto(record.header()));
    // The header's spec is client input until it resolves (its num_layers
    // sizes the SessionInfo below): one that does not is refused by
    // BeginImport, with the reason.
    if (const absl::StatusOr<SessionSpec> resolved =
            ResolveSessionSpec(header.spec, engine.options().sessions.limits);
        resolved.ok()) {
      ATTN_RETURN_IF_ERROR(
          CheckSessionMessageSize(*resolved, max_message_bytes));
    }
    result.kv_bytes = header.kv_bytes;
    ATTN_ASSIGN_OR_RETURN(result.import, engine.BeginImport(header, options));
    if (admit) ATTN_RETURN_IF_ERROR(admit());
    return absl::OkStatus();
  };
  ATTN_ASSIGN_OR_RETURN(
      result.trailer,
      WalkSnapshotRecords(read, begin, [&](const SnapshotChunk& chunk) {
        return result.import->AddChunk(chunk);
      }));
  return result;
}

absl::Status CheckSnapshotRecords(
    const std::function<absl::StatusOr<bool>(v1::SessionChunk*)>& read) {
  bool later_version = false;
  SnapshotChecksum checksum;
  int64_t chunks = 0;
  const absl::StatusOr<SnapshotTrailer> trailer = WalkSnapshotRecords(
      read,
      [&](const v1::SessionChunk& record) -> absl::Status {
        const absl::StatusOr<SnapshotHeader> header =
            SnapshotHeaderFromProto(record.header());
        // Nothing to check a later version's records with (the conversion's
        // only FAILED_PRECONDITION): the walk ends.
        later_version = absl::IsFailedPrecondition(header.status());
        if (later_version) return absl::CancelledError();
        ATTN_RETURN_IF_ERROR(header.status());
        checksum.AddHeader(*header);
        return absl::OkStatus();
      },
      [&](const SnapshotChunk& chunk) {
        checksum.AddChunk(chunk);
        ++chunks;
        return absl::OkStatus();
      });
  if (later_version) return absl::OkStatus();
  ATTN_RETURN_IF_ERROR(trailer.status());
  if (trailer->num_chunks != chunks || trailer->checksum != checksum.value()) {
    return absl::DataLossError(absl::StrCat(
        "the snapshot is corrupted: its trailer counts ", trailer->num_chunks,
        " data chunks with checksum ", trailer->checksum, ", its records are ",
        chunks, " with checksum ", checksum.value()));
  }
  return absl::OkStatus();
}

}  // namespace attention::server
