// SnapshotStore: every session saved to a directory when the server drains
// (--snapshot_dir) and restored from it at the next start.
//
// A directory holds one file per session, `<session id>.session`: the
// session's snapshot records (attention.v1.SessionChunk), each preceded by
// its serialized length as 4 bytes little-endian. Crash safety: a file is
// written as `<id>.session.tmp`, fsynced, renamed to its final name, and the
// directory is fsynced at the end; a process killed at any moment leaves
// only whole `.session` files (and perhaps a `.tmp` one, which the next
// start deletes). So every session comes back whole or not at all.
//
// Thread-safety: the functions may run concurrently with calls on the
// engine; SaveAll while nothing appends gives a consistent set.
#ifndef ATTENTION_SERVER_SNAPSHOT_STORE_H_
#define ATTENTION_SERVER_SNAPSHOT_STORE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine.h"
#include "core/tenant.h"

namespace attention::server {

struct SaveAllResult {
  int64_t written = 0;  // sessions in the directory
  int64_t failed = 0;   // sessions not written (logged): error or deadline
  int64_t bytes = 0;    // K/V bytes written
  absl::Duration duration;
};

// Writes every live session of `engine`, of every tenant, to `dir` (created
// if missing), stopping at `deadline`: the sessions left are counted as
// failed. A session that a call still holds (a long prefill that outlived
// StopChanges' wait) is written after the others, so that the wait for it
// costs no other session its file.
SaveAllResult SaveAllSessions(AttentionEngine& engine, const std::string& dir,
                              absl::Time deadline);

// Writes the snapshot of `owner`'s session `id` to `path` (temporary name,
// fsync, rename; the caller fsyncs the directory). Returns the K/V bytes
// written. NOT_FOUND for an unknown session (or another tenant's);
// INTERNAL for a file system error; DEADLINE_EXCEEDED (no file left) when
// `deadline` passes; SessionBusyError when a call holds the session past
// `wait_until` (at most `deadline`).
absl::StatusOr<int64_t> SaveSession(
    AttentionEngine& engine, const std::string& id, const std::string& path,
    absl::Time deadline, const Tenant& owner = DefaultTenant(),
    absl::Time wait_until = absl::InfiniteFuture());

// An exclusive lock on a snapshot directory (flock(2) on its `.lock`
// file), held until destroyed: one server per directory, so that two
// servers given the same --snapshot_dir do not both restore (duplicate)
// every session and then overwrite each other's files. Move-only.
class SnapshotDirectoryLock {
 public:
  explicit SnapshotDirectoryLock(int fd = -1) : fd_(fd) {}
  SnapshotDirectoryLock(SnapshotDirectoryLock&& other) noexcept
      : fd_(std::exchange(other.fd_, -1)) {}
  SnapshotDirectoryLock& operator=(SnapshotDirectoryLock&& other) noexcept;
  ~SnapshotDirectoryLock();

 private:
  int fd_;
};

// Makes sure `dir` can hold snapshots and is this server's alone: creates
// it if missing (one level), takes its lock, and writes, fsyncs and removes
// a probe file in it. INTERNAL, naming the path and the system's error, for
// a directory that cannot be created or written (a missing parent, a
// regular file, a read-only mount): a server that could not save its
// sessions at the drain must not start. FAILED_PRECONDITION when another
// process holds the directory's lock.
absl::StatusOr<SnapshotDirectoryLock> PrepareSnapshotDirectory(
    const std::string& dir);

struct RestoreAllResult {
  int64_t restored = 0;
  int64_t corrupt = 0;   // failed validation: moved aside as *.corrupt
  int64_t rejected = 0;  // refused for good (id taken, not a regular
                         // file): moved aside as *.rejected
  int64_t kept = 0;      // not restorable now (KV pool or --max_sessions
                         // full, an I/O error, a spec or layout this
                         // configuration cannot hold): left as they are,
                         // for the next start
  int64_t bytes = 0;
  // The files restored, still in the directory: the caller removes them
  // (RemoveRestoredFiles) once the server serves, so that a start that
  // fails after the restore loses no session.
  std::vector<std::string> files;
};

// A tenant's quota now, by name (Authenticator::QuotaOf).
using OwnerQuota = std::function<TenantQuota(const std::string& owner)>;

// Restores every `*.session` file of `dir` with its id, idle deadline and
// owner tenant, deleting leftover `*.tmp` files and logging every file it
// moves aside or keeps. The restored files stay (see RestoreAllResult::files).
// A directory that cannot be read is logged and restores nothing. Never fails.
// When `stop_requested` (may be empty) returns true before a file, the rest are
// left unread.
//
// With `owner_quota` (may be empty: no quotas) the files restore in two
// rounds. The first admits each session under its owner's quota as it is
// now, so that no tenant's sessions take the room of another tenant's
// share. The second restores the files the first refused RESOURCE_EXHAUSTED
// without quota, into the room left, so that no session waits on disk for a
// room that is there: forks, which share their blocks while live, come back
// as whole copies, and a quota may have been lowered since. Such a tenant is
// over its quota until it deletes sessions (its new sessions are refused
// meanwhile).
RestoreAllResult RestoreAllSessions(
    AttentionEngine& engine, const std::string& dir,
    const std::function<bool()>& stop_requested = nullptr,
    const OwnerQuota& owner_quota = nullptr);

// Removes the files of a restore and fsyncs `dir`, logging each failure: a
// file left would restore stale state at the next start.
void RemoveRestoredFiles(const std::string& dir,
                         const std::vector<std::string>& files);

// Imports one snapshot file (with its id, idle deadline and owner tenant),
// under the owner's quota when `owner_quota` is set (RESOURCE_EXHAUSTED
// past it, as ImportSession), else under none.
// INVALID_ARGUMENT or DATA_LOSS for a malformed file, PERMISSION_DENIED
// for an entry that is not a regular file (a link is not followed, a FIFO
// not read); others as ImportSession (FAILED_PRECONDITION: a session this
// server's configuration cannot hold).
absl::StatusOr<int64_t> RestoreSession(AttentionEngine& engine,
                                       const std::string& path,
                                       const OwnerQuota& owner_quota = nullptr);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_SNAPSHOT_STORE_H_
