// SessionExport: a consistent snapshot of one session, read as
// header, data chunks, trailer (core/session_snapshot.h).
//
// Starting an export takes a fork-like reference to the session's blocks
// under its lock: one reference count per block, nothing copied. The
// chunks are then read from those blocks without the session lock, so
// decoding (of this and every other session) goes on meanwhile; an append
// racing with the export lands entirely after it, because a block the
// export references is copied on write. What an export costs the server:
// O(blocks) reference counts under the session lock; its blocks pinned
// while it runs (a deleted session's memory returns only once the export
// ends); one block copy per layer whose partially filled last block the
// session appends to meanwhile; and one host copy of each block read.
//
// Usage:
//   ATTN_ASSIGN_OR_RETURN(std::unique_ptr<SessionExport> e,
//                         engine.ExportSession(id));
//   Send(e->header());
//   SnapshotChunk chunk;
//   while (true) {
//     ATTN_ASSIGN_OR_RETURN(bool more, e->NextChunk(&chunk));
//     if (!more) break;
//     Send(chunk);
//   }
//   Send(e->trailer());
//
// Thread-safety: not thread-safe (one reader). Must be destroyed before the
// engine it came from.
#ifndef ATTENTION_CORE_SESSION_EXPORT_H_
#define ATTENTION_CORE_SESSION_EXPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/backend.h"
#include "core/layer_kv_cache.h"
#include "core/session.h"
#include "core/session_snapshot.h"

namespace attention {

class SessionExport {
 public:
  // Snapshots `session` now (taking and releasing its lock). `backend`
  // must be the one owning the session's blocks and outlive the export.
  // `now` is the session clock's time: the idle deadline of a session in
  // use (a running call, an open Decode stream) or `sealed` for a move
  // counts from it, since such a session cannot expire meanwhile (however
  // long ago its clock restarted; calls waiting for a move would have
  // restarted it), and the copy must not arrive expired. A call running on
  // the session holds its lock: the export waits for it, but not past
  // `wait_until` (SessionBusyError, see core/session_busy.h).
  static absl::StatusOr<std::unique_ptr<SessionExport>> Start(
      AttentionBackend* backend, Session& session,
      absl::string_view server_version, absl::Time now, bool sealed,
      absl::Time wait_until = absl::InfiniteFuture());

  SessionExport(const SessionExport&) = delete;
  SessionExport& operator=(const SessionExport&) = delete;

  const SnapshotHeader& header() const { return header_; }

  // Fills `chunk` (reusing its buffers) with the next data chunk, of at
  // most `target_bytes` of K/V rows (but at least one row), and returns
  // true, or returns false once every chunk has been read.
  // INTERNAL when the device cannot be read.
  absl::StatusOr<bool> NextChunk(
      SnapshotChunk* chunk, int64_t target_bytes = kSnapshotChunkTargetBytes);

  // REQUIRES: NextChunk returned false.
  SnapshotTrailer trailer() const;

 private:
  SessionExport(AttentionBackend* backend, std::vector<LayerKvCache> layers,
                SnapshotHeader header);

  AttentionBackend* const backend_;
  const std::vector<LayerKvCache> layers_;  // the pinned blocks
  const SnapshotHeader header_;
  SnapshotChecksum checksum_;
  int64_t num_chunks_ = 0;
  // Next row to export.
  int layer_ = 0;
  int64_t position_ = 0;
  // Host copy of the last block read (a block can straddle two chunks).
  std::vector<std::byte> block_;
  const std::byte* block_source_ = nullptr;
};

}  // namespace attention

#endif  // ATTENTION_CORE_SESSION_EXPORT_H_
