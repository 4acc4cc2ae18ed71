// Session snapshots as attention.v1.SessionChunk streams: the 1:1 mapping
// of core's snapshot records (core/session_snapshot.h) onto the proto
// messages, and whole exports and imports over any stream of them (the
// ExportSession/ImportSession RPCs, --snapshot_dir files).
#ifndef ATTENTION_SERVER_SESSION_TRANSFER_H_
#define ATTENTION_SERVER_SESSION_TRANSFER_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "core/engine.h"
#include "core/session_import.h"
#include "core/session_snapshot.h"

namespace attention::server {

// Record mapping. The *FromProto functions take the proto's bytes fields
// (swapping, no copy) and fail with INVALID_ARGUMENT for values core cannot
// hold (an unknown dtype, a bad spec field). SnapshotHeaderFromProto checks
// the format version first (CheckSnapshotFormatVersion): a later version's
// header is FAILED_PRECONDITION whatever values it holds.
void SnapshotHeaderToProto(const SnapshotHeader& header,
                           v1::SessionSnapshotHeader* out);
absl::StatusOr<SnapshotHeader> SnapshotHeaderFromProto(
    const v1::SessionSnapshotHeader& header);
// Swaps `chunk`'s k, v and index_k into `out` (swap back to reuse the
// buffers).
void SwapSnapshotChunkToProto(SnapshotChunk* chunk,
                              v1::SessionSnapshotData* out);
void SwapSnapshotChunkFromProto(v1::SessionSnapshotData* data,
                                SnapshotChunk* chunk);
void SnapshotTrailerToProto(const SnapshotTrailer& trailer,
                            v1::SessionSnapshotTrailer* out);
SnapshotTrailer SnapshotTrailerFromProto(
    const v1::SessionSnapshotTrailer& trailer);

// Writes `session_export` whole through `write`, one record per call (the
// message is reused between calls; `write` may modify it), the K/V rows of
// each data record within half of `max_message_bytes` unless one row alone
// is larger.
// Returns the K/V bytes sent; the first error of `write` or of the export;
// RESOURCE_EXHAUSTED, before the record is written, for a record over
// `max_message_bytes` (the header, or one token's rows, of a session
// restored from a snapshot saved under a larger limit), which no stream
// could carry.
absl::StatusOr<int64_t> WriteSessionExport(
    SessionExport& session_export,
    const std::function<absl::Status(v1::SessionChunk&)>& write,
    int64_t max_message_bytes);

// Metadata of an ImportSession call by a draining replica handing the
// session over (server/session_handover.h); its value is the sender's
// advertise address. The import then keeps the snapshot's owner tenant
// (AttentionServiceImpl::AcceptHandoversFrom says who may send it).
inline constexpr char kHandoverMetadata[] = "attention-handover-from";

// Trailing metadata of an ImportSession call the server itself refused
// (value "1"): nothing was created, whatever the status code (an INTERNAL
// from the backend included). A failure without it (the transport's
// DEADLINE_EXCEEDED, a broken connection) may have come after the commit.
inline constexpr char kImportRefusedMetadata[] = "attention-import-refused";

// Initial metadata of an ImportSession call (value "1"), sent as soon as
// its header passed the server's checks, before any data is read: had the
// snapshot kept an id this server holds, the answer would have been
// ALREADY_EXISTS, so the server held no session of that id then (a
// hand-over asking again after a lost answer learns that its first attempt
// created nothing there, even if this attempt is cut later).
inline constexpr char kImportIdCheckedMetadata[] =
    "attention-import-id-checked";

// A snapshot read to its trailer and checked as far as it can be before
// the session exists.
struct ReadImport {
  std::unique_ptr<SessionImport> import;  // every chunk added
  SnapshotTrailer trailer;
  int64_t kv_bytes = 0;  // the header's

  // Creates the session (SessionImport::Finish: the checksum, the id).
  absl::StatusOr<SessionInfo> Commit() { return import->Finish(trailer); }
};

// Whether a snapshot stream may ask to keep its session id. Session ids
// are shared by all tenants of a server, so with tenants an ordinary
// caller may not: whether the id is taken would tell it that another
// tenant's session has that id.
enum class KeepSessionId { kAllowed, kRefused };

// Reads one snapshot from `read` into an import on `engine`, for the
// caller to Commit (or drop: nothing stays behind). `read` fills the
// message and returns true, or returns false at the end of the stream; the
// stream must end right after the trailer. A header record with
// keep_session_id adds it to `options` where `keep` allows it. Errors:
// those of SessionImport, plus INVALID_ARGUMENT for records in the wrong
// place, DATA_LOSS for a stream that ends early and PERMISSION_DENIED for
// keep_session_id where it is refused, and RESOURCE_EXHAUSTED right after
// the header when the session's SessionInfo or header could pass
// `max_message_bytes` (CheckSessionMessageSize; a restore passes the largest
// int64_t, never losing a session for it); nothing is left behind.
// `admit`, when set, is asked once the header passed the engine's checks
// (so a kept id that is held here has answered ALREADY_EXISTS) and before
// any data is read: its error ends the import.
absl::StatusOr<ReadImport> ReadSessionImport(
    AttentionEngine& engine, ImportOptions options, KeepSessionId keep,
    int64_t max_message_bytes,
    const std::function<absl::StatusOr<bool>(v1::SessionChunk*)>& read,
    const std::function<absl::Status()>& admit = nullptr);

// Reads a whole snapshot from `read`, as ReadSessionImport does, without
// importing it, and checks its records against its trailer (the count of
// data chunks and the checksum): for a snapshot whose import failed in a
// way its corruption could explain (a header corrupted into a spec or a
// size this server cannot take now). OK when they match, and for a later
// format version than this build reads (nothing to check it with); DATA_LOSS
// when they do not match or the stream ends early, INVALID_ARGUMENT for
// records in the wrong place or values core cannot hold.
absl::Status CheckSnapshotRecords(
    const std::function<absl::StatusOr<bool>(v1::SessionChunk*)>& read);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_SESSION_TRANSFER_H_
